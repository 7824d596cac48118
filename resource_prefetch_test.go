package rmm

import (
	"errors"
	"io"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// Without CUDA the adaptor is a pass-through: same sizes, same pointers, same errors.
func TestPrefetchWithoutCUDA(t *testing.T) {
	if CUDAAvailable() == nil {
		t.Skip("CUDA is available: TestGPUPrefetch* cover the adaptor")
	}
	up := newAdpFaultUpstream(newAdpScriptUpstream(0x7700))
	r, err := NewPrefetchResourceAdaptor(up)
	require.NoError(t, err)
	require.False(t, r.Prefetching())
	require.Same(t, up, r.Upstream())
	require.Equal(t, DeviceAccessible, r.Access())
	require.Equal(t, CurrentDevice(), r.Device())
	p := adpAlloc(t, r, 1000)
	require.Equal(t, DevicePtr(0x7700), p)
	adpFree(t, r, p, 1000)
	allocs, frees := up.inner.(*adpScriptUpstream).calls()
	require.Equal(t, []adpCall{{0x7700, 1000}}, allocs)
	require.Equal(t, []adpCall{{0x7700, 1000}}, frees)

	up.failNextAllocs(1, nil)
	_, err = r.Allocate(10, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	_, err = r.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)

	sys, err := NewPrefetchResourceAdaptor(NewSystemMemoryResource())
	require.NoError(t, err)
	q := adpAlloc(t, sys, 4096)
	hostBytes(q, 4096)[4095] = 1
	adpFree(t, sys, q, 4096)
	require.Equal(t, AccessOf(NewSystemMemoryResource()), sys.Access())
}

// pfHidden hides the resource it wraps: it is not an Upstreamer, as another package's adaptor
// need not be.
type pfHidden struct{ inner MemoryResource }

func (h pfHidden) Allocate(n int, s StreamView) (DevicePtr, error) { return h.inner.Allocate(n, s) }
func (h pfHidden) Deallocate(p DevicePtr, n int, s StreamView) error {
	return h.inner.Deallocate(p, n, s)
}

// Which chains of resources are prefetched, decided without CUDA from the resources' types (the
// resources are bare values: nothing is allocated).
func TestPrefetchModeOf(t *testing.T) {
	managed := &ManagedMemoryResource{}
	cuda := &CudaMemoryResource{}
	over := func(up MemoryResource, wrap ...func(MemoryResource) MemoryResource) MemoryResource {
		for _, w := range wrap {
			up = w(up)
		}
		return up
	}
	pool := func(up MemoryResource) MemoryResource { return &PoolMemoryResource{upstream: up} }
	arena := func(up MemoryResource) MemoryResource { return &ArenaMemoryResource{upstream: up} }
	fixed := func(up MemoryResource) MemoryResource { return &FixedSizeMemoryResource{upstream: up} }
	must := func(mr MemoryResource, err error) MemoryResource {
		require.NoError(t, err)
		return mr
	}
	stats := func(up MemoryResource) MemoryResource { return must(NewStatisticsResourceAdaptor(up)) }
	limit := func(up MemoryResource) MemoryResource { return must(NewLimitingResourceAdaptor(up, 1<<30, nil)) }
	track := func(up MemoryResource) MemoryResource { return must(NewTrackingResourceAdaptor(up, nil)) }
	logging := func(up MemoryResource) MemoryResource { return must(NewLoggingResourceAdaptor(up, io.Discard, nil)) }
	safe := func(up MemoryResource) MemoryResource { return must(NewThreadSafeResourceAdaptor(up)) }
	byStream := func(up MemoryResource) MemoryResource { return must(NewStreamStatisticsResourceAdaptor(up)) }
	profile := func(up MemoryResource) MemoryResource { return must(NewMemoryProfileResourceAdaptor(up, nil)) }
	aligned := func(up MemoryResource) MemoryResource {
		return must(NewAlignedResourceAdaptor(up, &AlignedOptions{Alignment: 4096}))
	}
	failure := func(up MemoryResource) MemoryResource {
		return must(NewFailureCallbackResourceAdaptor(up, func(int, error) bool { return false }, nil))
	}
	prefetch := func(up MemoryResource) MemoryResource {
		return &PrefetchResourceAdaptor{upstream: up}
	}
	hidden := func(up MemoryResource) MemoryResource { return pfHidden{up} }
	foreign := func(up MemoryResource) MemoryResource { return newAdpFaultUpstream(up) }
	sim, err := NewSimulatedMemoryResource(1 << 30)
	require.NoError(t, err)
	callback, err := NewCallbackMemoryResource(
		func(int, StreamView) (DevicePtr, error) { return 0, nil },
		func(DevicePtr, int, StreamView) error { return nil }, nil)
	require.NoError(t, err)

	cases := []struct {
		name     string
		mr       MemoryResource
		pageable bool
		want     prefetchMode
	}{
		{"managed", managed, false, prefetchAlways},
		{"pool/managed", over(managed, pool), false, prefetchAlways},
		{"arena/managed", over(managed, arena), false, prefetchAlways},
		{"fixed/pool/managed", over(managed, pool, fixed), false, prefetchAlways},
		{"every adaptor/pool/managed", over(managed, pool, stats, limit, track, logging, safe, aligned, failure, prefetch, byStream, profile), false, prefetchAlways},
		{"cuda", cuda, true, prefetchNever},
		{"pool/cuda", over(cuda, pool), false, prefetchNever},
		{"stats/arena/cuda", over(cuda, arena, stats), false, prefetchNever},
		{"expandable pool", &PoolMemoryResource{upstream: cuda, chained: true}, true, prefetchNever},
		{"expandable pool/managed", &PoolMemoryResource{upstream: managed, chained: true}, true, prefetchNever},
		{"async", &CudaAsyncMemoryResource{}, true, prefetchNever},
		{"pinned", &PinnedMemoryResource{}, true, prefetchNever},
		{"simulated", sim, true, prefetchNever},
		{"pool/simulated", over(sim, pool, limit), true, prefetchNever},
		{"system", NewSystemMemoryResource(), false, prefetchNever},
		{"system, pageable", NewSystemMemoryResource(), true, prefetchAlways},
		{"pool/system, pageable", over(NewSystemMemoryResource(), pool), true, prefetchAlways},
		{"sam", &SamHeadroomMemoryResource{}, false, prefetchNever},
		{"sam, pageable", &SamHeadroomMemoryResource{}, true, prefetchAlways},
		{"async view", &CudaAsyncViewMemoryResource{}, false, prefetchIfManaged},
		{"binning/managed", &BinningMemoryResource{upstream: managed}, false, prefetchIfManaged},
		{"callback", callback, false, prefetchIfManaged},
		{"hidden managed", over(managed, hidden), false, prefetchIfManaged},
		{"hidden cuda", over(cuda, hidden, stats), false, prefetchIfManaged},
		{"foreign upstreamer/cuda", over(cuda, foreign), false, prefetchIfManaged},
		{"pool/foreign/managed", over(managed, foreign, pool), false, prefetchIfManaged},
	}
	for _, c := range cases {
		require.Equal(t, c.want, prefetchModeOf(c.mr, c.pageable), "%s (pageable %v)", c.name, c.pageable)
	}
}

// pfDriver records the driver calls of an adaptor built with fake driver functions.
type pfDriver struct {
	mu          sync.Mutex
	managed     map[DevicePtr]bool
	queries     []DevicePtr
	prefetches  []pfPrefetch
	queryErr    error
	prefetchErr error
}

type pfPrefetch struct {
	ctx            uintptr
	p              DevicePtr
	n              int
	locType, locID int
	stream         uintptr
}

func (d *pfDriver) isManaged(ctx uintptr, p DevicePtr) (bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.queries = append(d.queries, p)
	return d.managed[p], d.queryErr
}

func (d *pfDriver) prefetch(ctx uintptr, p DevicePtr, n, locType, locID int, stream uintptr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.prefetches = append(d.prefetches, pfPrefetch{ctx, p, n, locType, locID, stream})
	return d.prefetchErr
}

// pfAdaptor is an adaptor in the given mode whose driver calls go to d.
func pfAdaptor(up MemoryResource, mode prefetchMode, d *pfDriver) *PrefetchResourceAdaptor {
	return &PrefetchResourceAdaptor{upstream: up, dev: 3, ctx: 0xc0, mode: mode, isManaged: d.isManaged, prefetch: d.prefetch}
}

// What Allocate asks the driver in each mode, with fake driver calls.
func TestPrefetchAllocatePaths(t *testing.T) {
	s := StreamView{h: 0x5000, id: foreignStreamBit | 7, dev1: 4}

	// Always: one prefetch of the whole allocation to the adaptor's device, on the stream; no query.
	up := newAdpScriptUpstream(0x10000, 0x20000)
	d := &pfDriver{}
	r := pfAdaptor(up, prefetchAlways, d)
	require.True(t, r.Prefetching())
	p, err := r.Allocate(1000, s)
	require.NoError(t, err)
	require.Equal(t, DevicePtr(0x10000), p)
	require.Equal(t, []pfPrefetch{{0xc0, 0x10000, 1000, cuMemLocationTypeDevice, 3, 0x5000}}, d.prefetches)
	require.Empty(t, d.queries)
	z, err := r.Allocate(0, s)
	require.NoError(t, err)
	require.Zero(t, z)
	require.Len(t, d.prefetches, 1, "nothing to prefetch for zero bytes")
	require.NoError(t, r.Deallocate(p, 1000, s))
	require.Len(t, d.prefetches, 1, "Deallocate is forwarded only")

	// If managed: one query per allocation; only managed memory is prefetched.
	up = newAdpScriptUpstream(0x10000, 0x20000)
	d = &pfDriver{managed: map[DevicePtr]bool{0x20000: true}}
	r = pfAdaptor(up, prefetchIfManaged, d)
	require.True(t, r.Prefetching())
	p, err = r.Allocate(4096, s)
	require.NoError(t, err)
	q, err := r.Allocate(8192, s)
	require.NoError(t, err)
	require.Equal(t, []DevicePtr{0x10000, 0x20000}, d.queries)
	require.Equal(t, []pfPrefetch{{0xc0, 0x20000, 8192, cuMemLocationTypeDevice, 3, 0x5000}}, d.prefetches)
	adpFree(t, r, p, 4096)
	adpFree(t, r, q, 8192)

	// Never: no driver call at all.
	up = newAdpScriptUpstream(0x10000)
	d = &pfDriver{managed: map[DevicePtr]bool{0x10000: true}}
	r = pfAdaptor(up, prefetchNever, d)
	require.False(t, r.Prefetching())
	p = adpAlloc(t, r, 4096)
	require.Equal(t, DevicePtr(0x10000), p)
	require.Empty(t, d.queries)
	require.Empty(t, d.prefetches)
	adpFree(t, r, p, 4096)

	// The upstream's error is returned unchanged, with no driver call.
	fault := newAdpFaultUpstream(newAdpScriptUpstream())
	d = &pfDriver{}
	r = pfAdaptor(fault, prefetchAlways, d)
	fault.failNextAllocs(1, errAdpInjected)
	_, err = r.Allocate(100, s)
	require.Same(t, errAdpInjected, err)
	require.Empty(t, d.prefetches)
}

// A failed prefetch or pointer query gives the memory back and returns the driver's error.
func TestPrefetchDriverErrors(t *testing.T) {
	s := StreamView{h: 0x5000, id: foreignStreamBit | 7, dev1: 1}
	illegal := &CUDAError{Op: "cuMemPrefetchAsync_v2", Code: cudaErrorIllegalAddress, Name: "CUDA_ERROR_ILLEGAL_ADDRESS"}

	script := newAdpScriptUpstream(0x10000)
	d := &pfDriver{prefetchErr: illegal}
	r := pfAdaptor(script, prefetchAlways, d)
	p, err := r.Allocate(1000, s)
	require.Zero(t, p)
	var ce *CUDAError
	require.ErrorAs(t, err, &ce)
	require.Same(t, illegal, ce)
	require.ErrorContains(t, err, "PrefetchResourceAdaptor: prefetching 1000 bytes at 0x10000 to device 3 on StreamView(0x5000)")
	allocs, frees := script.calls()
	require.Equal(t, []adpCall{{0x10000, 1000}}, allocs)
	require.Equal(t, []adpCall{{0x10000, 1000}}, frees, "the allocation was given back")
	require.Zero(t, script.liveCount())

	// The query fails: no prefetch, the memory is given back.
	script = newAdpScriptUpstream(0x10000)
	qerr := &CUDAError{Op: "cuPointerGetAttributes", Code: cudaErrorInvalidContext, Name: "CUDA_ERROR_INVALID_CONTEXT"}
	d = &pfDriver{queryErr: qerr}
	r = pfAdaptor(script, prefetchIfManaged, d)
	_, err = r.Allocate(1000, s)
	require.ErrorIs(t, err, qerr)
	require.ErrorContains(t, err, "asking whether 0x10000 is managed memory")
	require.Empty(t, d.prefetches)
	require.Zero(t, script.liveCount())

	// Giving the memory back fails as well: both errors are returned.
	fault := newAdpFaultUpstream(newAdpScriptUpstream(0x10000))
	d = &pfDriver{prefetchErr: illegal}
	r = pfAdaptor(fault, prefetchAlways, d)
	fault.failNextFrees(1)
	_, err = r.Allocate(1000, s)
	require.ErrorIs(t, err, illegal)
	require.ErrorIs(t, err, errAdpInjected)
	require.ErrorContains(t, err, "giving the memory back failed")
}

// A view of a closed Stream is refused before the upstream is called, in every mode.
func TestPrefetchClosedStream(t *testing.T) {
	st, err := NewStream(CurrentDevice(), nil)
	require.NoError(t, err)
	v := st.View()
	require.NoError(t, st.Close())
	for _, mode := range []prefetchMode{prefetchNever, prefetchAlways, prefetchIfManaged} {
		fault := newAdpFaultUpstream(newAdpScriptUpstream())
		d := &pfDriver{}
		r := pfAdaptor(fault, mode, d)
		_, err := r.Allocate(4096, v)
		require.ErrorIs(t, err, ErrClosed, "mode %v", mode)
		require.ErrorContains(t, err, "PrefetchResourceAdaptor.Allocate")
		allocs, _ := fault.callCounts()
		require.Zero(t, allocs, "mode %v: the upstream was not called", mode)
		require.Empty(t, d.prefetches)
		require.Empty(t, d.queries)
	}
	// Without CUDA as well.
	r, err := NewPrefetchResourceAdaptor(newAdpScriptUpstream())
	require.NoError(t, err)
	_, err = r.Allocate(4096, v)
	require.True(t, errors.Is(err, ErrClosed), "%v", err)
}

// Allocate(0) returns (0, nil) on a closed Stream too, as on any stream (MemoryResource's
// contract), in every mode.
func TestPrefetchZeroBytesOnClosedStream(t *testing.T) {
	st, err := NewStream(CurrentDevice(), nil)
	require.NoError(t, err)
	v := st.View()
	require.NoError(t, st.Close())
	for _, mode := range []prefetchMode{prefetchNever, prefetchAlways, prefetchIfManaged} {
		d := &pfDriver{}
		r := pfAdaptor(newAdpScriptUpstream(), mode, d)
		p, err := r.Allocate(0, v)
		require.NoError(t, err, "mode %v", mode)
		require.Zero(t, p, "mode %v", mode)
		require.Empty(t, d.prefetches)
		require.Empty(t, d.queries)
	}
}
