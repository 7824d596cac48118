package rmm

import (
	"encoding/binary"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// Exporting and importing without a GPU: the errors of resources that cannot export, of
// handles that cannot be imported, and the pools' bookkeeping behind an export.

func TestIPCImportMisuse(t *testing.T) {
	// A handle whose descriptors are not attached cannot be imported.
	h := *testIPCHandles()["vmm"]
	_, err := ImportIPC[byte](&h)
	require.ErrorIs(t, err, ErrInvalidIPCHandle)
	require.ErrorContains(t, err, "not attached")
	// An event is not memory, and memory is not an event.
	ev := testIPCHandles()["event"]
	_, err = ImportIPC[byte](ev)
	require.ErrorIs(t, err, ErrInvalidIPCHandle)
	require.ErrorContains(t, err, "OpenIPCEvent")
	_, err = OpenIPCEvent(testIPCHandles()["legacy"])
	require.ErrorIs(t, err, ErrInvalidIPCHandle)
	require.ErrorContains(t, err, "ImportIPC")
	_, err = OpenIPCEvent(nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	// Element size and element type.
	_, err = ImportIPC[[3]byte](testIPCHandles()["legacy"])
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "3-byte [3]uint8 elements")
	// Length, offset and address that do not suit T: errors naming the handle and T, before
	// anything is imported (the address once the driver mapped it).
	ten := *testIPCHandles()["legacy"]
	ten.size, ten.offset = 10, 0
	_, err = ImportIPC[float64](&ten)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "its 10 bytes are not a whole number of 8-byte float64 elements")
	require.ErrorContains(t, err, "IPCHandle(cuIpcGetMemHandle")
	odd := *testIPCHandles()["vmm"]
	odd.offset, odd.size = 4, 16
	_, err = ImportIPC[float64](&odd)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "starts 4 bytes into the shared memory, not a multiple of float64's 8-byte alignment")
	_, err = ImportIPC[uint32](&odd)
	require.NotErrorIs(t, err, ErrInvalidArgument, "4 bytes in suits a uint32")
	require.ErrorIs(t, checkIPCElems[uint64]("ImportIPC[uint64]", testIPCHandles()["legacy"], 0x10004), ErrInvalidArgument)
	require.ErrorContains(t, checkIPCElems[uint64]("ImportIPC[uint64]", testIPCHandles()["legacy"], 0x10004), "mapped at 0x10004, not a multiple of uint64's 8-byte alignment")
	require.NoError(t, checkIPCElems[uint64]("ImportIPC[uint64]", testIPCHandles()["legacy"], 0x10008))
	_, err = ImportIPC[*int](testIPCHandles()["legacy"])
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = ImportIPC[byte](nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	// A hand-made handle of an unknown kind.
	_, err = ImportIPC[byte](&IPCHandle{kind: 77, size: 1})
	require.ErrorIs(t, err, ErrInvalidIPCHandle)
	if CUDAAvailable() != nil {
		// A well-formed handle on a machine without CUDA: the device cannot be found.
		_, err = ImportIPC[uint64](testIPCHandles()["legacy"])
		require.ErrorIs(t, err, ErrNoDevice)
		_, err = OpenIPCEvent(ev)
		require.ErrorIs(t, err, ErrNoDevice)
		_, err = NewIPCEvent(0)
		require.ErrorIs(t, err, ErrNoDevice)
		_, err = Device(0).UUID()
		require.ErrorIs(t, err, ErrNoDevice)
	}
	var closed *IPCEvent
	require.NoError(t, closed.Close())
	require.ErrorIs(t, closed.Record(DefaultStream), ErrInvalidArgument)
}

// CudaMemoryResource.ExportIPC names itself when its device cannot be used (no CUDA here, or an
// ordinal beyond the devices): the driver's error came back alone.
func TestIPCCudaMemoryResourceExportErrorNamesCall(t *testing.T) {
	for _, dev := range []Device{0, 4096} {
		_, err := (&CudaMemoryResource{dev: dev}).ExportIPC(0x10000, 4096)
		require.Error(t, err)
		require.ErrorContains(t, err, "CudaMemoryResource.ExportIPC")
		if CUDAAvailable() != nil {
			require.ErrorIs(t, err, ErrNoDevice)
		}
	}
}

// A zero or unknown-kind handle given to OpenIPCEvent is called what it is, not memory.
func TestIPCOpenEventUnknownKind(t *testing.T) {
	for _, h := range []*IPCHandle{{}, {kind: 77}} {
		_, err := OpenIPCEvent(h)
		require.ErrorIs(t, err, ErrInvalidIPCHandle)
		require.ErrorContains(t, err, fmt.Sprintf("OpenIPCEvent: unknown kind %d", h.kind))
		require.NotContains(t, err.Error(), "is memory")
	}
}

// A resource that cannot export names itself (and the adaptors in front of it) in the error.
func TestIPCNotExportable(t *testing.T) {
	sys := NewSystemMemoryResource()
	p, err := sys.Allocate(4096, DefaultStream)
	require.NoError(t, err)
	defer sys.Deallocate(p, 4096, DefaultStream)

	_, err = ExportIPC(sys, p, 4096)
	require.ErrorIs(t, err, ErrNotExportable)
	require.ErrorContains(t, err, "SystemMemoryResource: it cannot export")

	stats, err := NewStatisticsResourceAdaptor(sys)
	require.NoError(t, err)
	_, err = ExportIPC(stats, p, 4096)
	require.ErrorIs(t, err, ErrNotExportable)
	require.ErrorContains(t, err, "StatisticsResourceAdaptor over SystemMemoryResource")

	arena, err := NewArenaMemoryResource(sys, &ArenaOptions{ArenaSize: 1 << 20})
	require.NoError(t, err)
	defer arena.Close()
	_, err = ExportIPC(arena, p, 4096)
	require.ErrorIs(t, err, ErrNotExportable)
	require.ErrorContains(t, err, "ArenaMemoryResource")

	v, err := NewUvector[uint64](512, DefaultStream, stats)
	require.NoError(t, err)
	_, err = v.ExportIPC()
	require.ErrorIs(t, err, ErrNotExportable)
	require.ErrorContains(t, err, "Uvector[uint64].ExportIPC")
	require.NoError(t, v.Close())
	_, err = v.ExportIPC()
	require.ErrorIs(t, err, ErrClosed)
	empty, err := NewDeviceBuffer(0, DefaultStream, sys)
	require.NoError(t, err)
	_, err = empty.ExportIPC()
	require.ErrorIs(t, err, ErrInvalidArgument)

	_, err = ExportIPC(sys, 0, 4096)
	require.ErrorIs(t, err, ErrNotExportable, "the resource is asked first")
}

// A plain pool checks that the range is live memory of its own, then asks its upstream.
func TestIPCPlainPoolExport(t *testing.T) {
	pool, err := NewPoolMemoryResource(NewSystemMemoryResource(), &PoolOptions{InitialPoolSize: 1 << 20})
	require.NoError(t, err)
	defer pool.Close()
	_, err = NewPoolMemoryResource(nil, &PoolOptions{Exportable: true})
	require.ErrorIs(t, err, ErrInvalidArgument, "Exportable needs an expandable pool")

	p, err := pool.Allocate(64<<10, DefaultStream)
	require.NoError(t, err)
	_, err = pool.ExportIPC(p+256, 1024)
	require.ErrorIs(t, err, ErrNotExportable, "live memory: the upstream is asked, and refuses")
	require.ErrorContains(t, err, "PoolMemoryResource.ExportIPC")
	require.ErrorContains(t, err, "SystemMemoryResource")
	_, err = pool.ExportIPC(p+(64<<10)-256, 512)
	require.ErrorIs(t, err, ErrInvalidArgument, "the range runs past the allocation")
	_, err = pool.ExportIPC(p, 0)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.NoError(t, pool.Deallocate(p, 64<<10, DefaultStream))
	_, err = pool.ExportIPC(p, 1024)
	require.ErrorIs(t, err, ErrInvalidArgument, "freed memory")
	require.ErrorContains(t, err, "not inside one live allocation")

	// A block a stream's cache handed out is live too.
	s, err := NewStream(0, nil)
	require.NoError(t, err)
	defer s.Close()
	for range 3 {
		q, err := pool.Allocate(4096, s.View())
		require.NoError(t, err)
		require.NoError(t, pool.Deallocate(q, 4096, s.View()))
	}
	q, err := pool.Allocate(4096, s.View())
	require.NoError(t, err)
	pool.mu.Lock()
	inTable := pool.live.get(q) != nil
	pool.mu.Unlock()
	require.False(t, inTable, "the block came from the stream's cache")
	_, err = pool.ExportIPC(q+8, 16)
	require.ErrorIs(t, err, ErrNotExportable)
	require.NoError(t, pool.Deallocate(q, 4096, s.View()))
	_, err = pool.ExportIPC(q, 16)
	require.ErrorIs(t, err, ErrInvalidArgument)
}

// A pool exports only within the bytes an allocation asked for: a range into the block's rounding
// beyond them (an allocation of 1000 bytes is a block of 1024) was exported.
func TestIPCPoolExportWithinAllocation(t *testing.T) {
	pool, err := NewPoolMemoryResource(newHostExporter(), &PoolOptions{InitialPoolSize: 1 << 20})
	require.NoError(t, err)
	defer pool.Close()
	s, err := NewStream(0, nil)
	require.NoError(t, err)
	defer s.Close()
	for range 3 { // the stream's cache hands the next block of this size out
		q, err := pool.Allocate(1000, s.View())
		require.NoError(t, err)
		require.NoError(t, pool.Deallocate(q, 1000, s.View()))
	}
	p, err := pool.Allocate(1000, DefaultStream)
	require.NoError(t, err)
	defer pool.Deallocate(p, 1000, DefaultStream)
	q, err := pool.Allocate(1000, s.View())
	require.NoError(t, err)
	defer pool.Deallocate(q, 1000, s.View())
	require.Nil(t, underLock(&pool.mu, func() *block { return pool.live.get(q) }), "q came from the stream's cache")
	for _, base := range []DevicePtr{p, q} {
		for _, r := range []struct{ off, n int }{{0, 1000}, {999, 1}, {8, 992}} {
			h, err := pool.ExportIPC(base+DevicePtr(r.off), r.n)
			require.NoError(t, err, "[%d, %d)", r.off, r.off+r.n)
			require.Equal(t, r.n, h.Size())
		}
		for _, r := range []struct{ off, n int }{{0, 1001}, {0, 1024}, {999, 2}, {1000, 8}, {1016, 8}} {
			_, err := pool.ExportIPC(base+DevicePtr(r.off), r.n)
			require.ErrorIs(t, err, ErrInvalidArgument, "[%d, %d)", r.off, r.off+r.n)
			require.ErrorContains(t, err, fmt.Sprintf("runs past the end of the allocation [%#x, %#x)", uintptr(base), uintptr(base)+1000))
		}
	}
	v, err := NewUvector[uint32](250, DefaultStream, pool)
	require.NoError(t, err)
	defer v.Close()
	h, err := v.ExportIPC()
	require.NoError(t, err)
	require.Equal(t, 1000, h.Size())
}

// A range that wraps past the end of the address space is called that, not a null pointer or a
// size that is not positive.
func TestIPCExportRangeWraps(t *testing.T) {
	pool, err := NewPoolMemoryResource(newHostExporter(), &PoolOptions{InitialPoolSize: 1 << 20})
	require.NoError(t, err)
	defer pool.Close()
	for _, r := range []struct {
		p DevicePtr
		n int
	}{{DevicePtr(^uintptr(0) - 10), 100}, {DevicePtr(^uintptr(0)), 1}} {
		_, err := pool.ExportIPC(r.p, r.n)
		require.ErrorIs(t, err, ErrInvalidArgument)
		require.ErrorContains(t, err, "runs past the end of the address space")
	}
	for _, n := range []int{0, -1} {
		_, err := pool.ExportIPC(0x10000, n)
		require.ErrorIs(t, err, ErrInvalidArgument)
		require.ErrorContains(t, err, "a positive size")
	}
}

// The pieces of an expandable pool under a live range tile it, across growth steps.
func TestIPCExpandablePieces(t *testing.T) {
	sim, err := NewSimulatedMemoryResource(1 << 34)
	require.NoError(t, err)
	pool, err := NewPoolMemoryResource(sim, &PoolOptions{Expandable: true, MaximumPoolSize: 1 << 34})
	require.NoError(t, err)
	defer pool.Close()
	var ptrs []DevicePtr
	for range 3 {
		p, err := pool.Allocate(40<<20, DefaultStream)
		require.NoError(t, err)
		ptrs = append(ptrs, p)
	}
	require.Equal(t, 3, pool.Stats().UpstreamBlocks, "one chunk per growth")
	for _, p := range ptrs {
		for _, r := range []struct{ off, n int }{{0, 40 << 20}, {1 << 20, 1}, {(40 << 20) - 4096, 4096}} {
			start, pieces, err := pool.expandable().vmmPiecesCovering(p+DevicePtr(r.off), r.n)
			require.NoError(t, err)
			require.NotEmpty(t, pieces)
			require.LessOrEqual(t, start, p+DevicePtr(r.off))
			at := 0
			for _, pc := range pieces {
				require.Equal(t, at, pc.offset, "back to back")
				require.Zero(t, pc.size%(2<<20))
				at += pc.size
			}
			require.GreaterOrEqual(t, start+DevicePtr(at), p+DevicePtr(r.off+r.n), "the pieces cover the range")
			first := pieces[0]
			require.Greater(t, start+DevicePtr(first.size), p+DevicePtr(r.off), "the first piece holds the range's start")
		}
	}
	// A block over two chunks of separate growth steps lies in two pieces.
	require.NoError(t, pool.Deallocate(ptrs[0], 40<<20, DefaultStream))
	require.NoError(t, pool.Deallocate(ptrs[1], 40<<20, DefaultStream))
	_, _, err = pool.expandable().vmmPiecesCovering(ptrs[1], 4096)
	require.ErrorIs(t, err, ErrInvalidArgument, "freed memory")
	big, err := pool.Allocate(80<<20, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, ptrs[0], big, "the two freed blocks coalesced")
	start, pieces, err := pool.expandable().vmmPiecesCovering(big+(30<<20), 20<<20)
	require.NoError(t, err)
	require.Equal(t, big, start)
	require.Equal(t, []vmmPiece{{0, 40 << 20, pieces[0].h}, {40 << 20, 40 << 20, pieces[1].h}}, pieces)
	require.NotEqual(t, pieces[0].h, pieces[1].h)
	start, pieces, err = pool.expandable().vmmPiecesCovering(big+(50<<20), 1)
	require.NoError(t, err)
	require.Equal(t, big+(40<<20), start, "only the piece under the range")
	require.Len(t, pieces, 1)
	_, err = pool.ExportIPC(big, 80<<20)
	require.ErrorIs(t, err, ErrNotExportable, "the simulated memory cannot be exported")
	require.ErrorContains(t, err, "PoolMemoryResource (expandable)")

	if hostVMMSupported && CUDAAvailable() != nil {
		_, err := NewPoolMemoryResource(NewSystemMemoryResource(), &PoolOptions{Expandable: true, Exportable: true, MaximumPoolSize: 64 << 20})
		require.ErrorIs(t, err, ErrNotSupported, "host memory cannot be exported")
		require.ErrorContains(t, err, "Exportable needs device memory")
	}
}

// hostExporter is host memory that exports as IPCKindLegacy handles (the allocation's address in
// the opaque bytes, the range's offset in it), so that the paths around an export run without a
// GPU.
type hostExporter struct {
	*SystemMemoryResource
	mu   sync.Mutex
	live map[DevicePtr]int
}

func newHostExporter() *hostExporter {
	return &hostExporter{SystemMemoryResource: NewSystemMemoryResource(), live: map[DevicePtr]int{}}
}

func (r *hostExporter) Allocate(n int, s StreamView) (DevicePtr, error) {
	p, err := r.SystemMemoryResource.Allocate(n, s)
	if err == nil && p != 0 {
		r.mu.Lock()
		r.live[p] = n
		r.mu.Unlock()
	}
	return p, err
}

func (r *hostExporter) Deallocate(p DevicePtr, n int, s StreamView) error {
	r.mu.Lock()
	delete(r.live, p)
	r.mu.Unlock()
	return r.SystemMemoryResource.Deallocate(p, n, s)
}

func (r *hostExporter) ExportIPC(p DevicePtr, n int) (*IPCHandle, error) {
	if err := checkExportRange("hostExporter", p, n); err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for base, size := range r.live {
		if base <= p && uintptr(p-base)+uintptr(n) <= uintptr(size) {
			h := &IPCHandle{kind: IPCKindLegacy, size: n, offset: int(p - base)}
			binary.LittleEndian.PutUint64(h.data[:], uint64(base))
			return h, nil
		}
	}
	return nil, fmt.Errorf("%w: hostExporter.ExportIPC(%#x, %d): not a live allocation", ErrInvalidArgument, uintptr(p), n)
}

// Every adaptor that hands out its upstream's pointers unchanged exports through it; every other
// resource over an exporter names itself in ErrNotExportable. The memory-profile adaptor, which
// hands out its upstream's pointers, said it could not export.
func TestIPCExportThroughAdaptors(t *testing.T) {
	up := newHostExporter()
	must := func(r MemoryResource, err error) MemoryResource {
		t.Helper()
		require.NoError(t, err)
		return r
	}
	passThrough := passThroughAdaptors(t, up)
	for name, r := range passThrough {
		t.Run(name, func(t *testing.T) {
			p, err := r.Allocate(4096, DefaultStream)
			require.NoError(t, err)
			defer r.Deallocate(p, 4096, DefaultStream)
			h, err := ExportIPC(r, p+256, 1024)
			require.NoError(t, err)
			want, err := up.ExportIPC(p+256, 1024)
			require.NoError(t, err)
			require.Equal(t, want, h)
			// Stacked, too.
			stats, err := NewStatisticsResourceAdaptor(r)
			require.NoError(t, err)
			_, err = ExportIPC(stats, p, 4096)
			require.NoError(t, err)
		})
	}
	sys := NewSystemMemoryResource()
	prof := must(NewMemoryProfileResourceAdaptor(sys, nil))
	p, err := prof.Allocate(4096, DefaultStream)
	require.NoError(t, err)
	defer prof.Deallocate(p, 4096, DefaultStream)
	_, err = ExportIPC(prof, p, 4096)
	require.ErrorIs(t, err, ErrNotExportable)
	require.ErrorContains(t, err, "MemoryProfileResourceAdaptor over SystemMemoryResource: it cannot export")

	others := map[string]MemoryResource{
		"AlignedResourceAdaptor":  must(NewAlignedResourceAdaptor(up, nil)),
		"ArenaMemoryResource":     must(NewArenaMemoryResource(up, &ArenaOptions{ArenaSize: 1 << 20})),
		"BinningMemoryResource":   must(NewBinningMemoryResource(up, nil)),
		"FixedSizeMemoryResource": must(NewFixedSizeMemoryResource(up, &FixedSizeOptions{BlockSize: 4096, BlocksToPreallocate: 4})),
		"CallbackMemoryResource": must(NewCallbackMemoryResource(
			func(n int, s StreamView) (DevicePtr, error) { return up.Allocate(n, s) },
			func(p DevicePtr, n int, s StreamView) error { return up.Deallocate(p, n, s) }, nil)),
	}
	for name, r := range others {
		t.Run(name, func(t *testing.T) {
			p, err := r.Allocate(4096, DefaultStream)
			require.NoError(t, err)
			defer r.Deallocate(p, 4096, DefaultStream)
			_, err = ExportIPC(r, p, 4096)
			require.ErrorIs(t, err, ErrNotExportable)
			require.ErrorContains(t, err, name+": it cannot export")
		})
	}
}

// passThroughAdaptors makes, over up, every adaptor of the package that hands out its upstream's
// pointers unchanged (the passThrough markers), by type name.
func passThroughAdaptors(t *testing.T, up MemoryResource) map[string]MemoryResource {
	must := func(r MemoryResource, err error) MemoryResource {
		t.Helper()
		require.NoError(t, err)
		return r
	}
	return map[string]MemoryResource{
		"StatisticsResourceAdaptor":       must(NewStatisticsResourceAdaptor(up)),
		"LoggingResourceAdaptor":          must(NewLoggingResourceAdaptor(up, io.Discard, nil)),
		"TrackingResourceAdaptor":         must(NewTrackingResourceAdaptor(up, nil)),
		"LimitingResourceAdaptor":         must(NewLimitingResourceAdaptor(up, 1<<30, nil)),
		"FailureCallbackResourceAdaptor":  must(NewFailureCallbackResourceAdaptor(up, func(int, error) bool { return false }, nil)),
		"ThreadSafeResourceAdaptor":       must(NewThreadSafeResourceAdaptor(up)),
		"PrefetchResourceAdaptor":         must(NewPrefetchResourceAdaptor(up)),
		"MemoryProfileResourceAdaptor":    must(NewMemoryProfileResourceAdaptor(up, &MemoryProfileOptions{Rate: 1})),
		"StreamStatisticsResourceAdaptor": must(NewStreamStatisticsResourceAdaptor(up)),
	}
}

// notPassThroughAdaptors are the package's adaptors that hand out other pointers than their
// upstream's (an aligned pointer inside a larger allocation).
var notPassThroughAdaptors = []string{"AlignedResourceAdaptor"}

// Every exported adaptor type of the package is either in passThroughAdaptors (and declares both
// markers: ExportIPC and the prefetcher trust it) or in notPassThroughAdaptors (and declares
// neither passesPointersThrough): a new adaptor that forgets its markers fails here (and one that
// conformance_test.go does not run rmmtest over fails TestConformanceCoversEveryAdaptor).
func TestAdaptorMarkers(t *testing.T) {
	fset := token.NewFileSet()
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	var names []string
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		require.NoError(t, err)
		for _, d := range f.Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok || g.Tok != token.TYPE {
				continue
			}
			for _, sp := range g.Specs {
				if n := sp.(*ast.TypeSpec).Name.Name; ast.IsExported(n) && strings.HasSuffix(n, "ResourceAdaptor") {
					names = append(names, n)
				}
			}
		}
	}
	require.NotEmpty(t, names)
	pt := passThroughAdaptors(t, newHostExporter())
	for _, n := range names {
		r, listed := pt[n]
		switch {
		case listed:
			_, ok := r.(passThrough)
			require.True(t, ok, "%s is listed as passing pointers through but does not declare insideUpstream and passesPointersThrough", n)
		case slices.Contains(notPassThroughAdaptors, n):
		default:
			t.Errorf("%s is in neither passThroughAdaptors nor notPassThroughAdaptors (ipc_export_test.go): say whether it hands out its upstream's pointers unchanged", n)
		}
	}
}

// Every adaptor refuses a negative size, in Allocate and in Deallocate, with ErrInvalidArgument
// and without calling its upstream.
func TestAdaptorsRefuseNegativeSizes(t *testing.T) {
	up := newAdpScriptUpstream(0x1000)
	p, err := up.Allocate(4096, DefaultStream)
	require.NoError(t, err)
	all := passThroughAdaptors(t, up)
	aligned, err := NewAlignedResourceAdaptor(up, nil)
	require.NoError(t, err)
	all["AlignedResourceAdaptor"] = aligned
	for name, r := range all {
		_, err := r.Allocate(-1, DefaultStream)
		require.ErrorIs(t, err, ErrInvalidArgument, "%s.Allocate", name)
		require.ErrorIs(t, r.Deallocate(p, -1, DefaultStream), ErrInvalidArgument, "%s.Deallocate", name)
	}
	allocs, frees := up.calls()
	require.Len(t, allocs, 1, "only the test's own allocation reached the upstream")
	require.Empty(t, frees)
}
