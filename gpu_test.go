package rmm

import (
	"bytes"
	"encoding/binary"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// TestMain lets a run load freshly generated PTX (RMM_TEST_PTX_DIR holding fill.ptx and
// copy.ptx) instead of the embedded kernels, to check kernels before they are committed.
// TestMain quiets the debug log. The tests that take seconds of host work on resources of their
// own (property tests, walks, traces) call t.Parallel(): they run side by side after the others,
// which halves the package's time on a two-core machine. A test that touches global state (the
// debug logger, the current device resource, a global counter it checks) stays serial.
func TestMain(m *testing.M) {
	if os.Getenv("RMM_DEBUG_LOG_FILE") == "" && os.Getenv("RMM_DEBUG_LOG_LEVEL") == "" {
		// Tests provoke warnings on purpose (leaks, pools closed in use): keep the output clean.
		SetDebugLogger(slog.New(slog.DiscardHandler))
	}
	if dir := os.Getenv("RMM_TEST_PTX_DIR"); dir != "" {
		fill, err1 := os.ReadFile(filepath.Join(dir, "fill.ptx"))
		cp, err2 := os.ReadFile(filepath.Join(dir, "copy.ptx"))
		if err1 != nil || err2 != nil {
			panic("RMM_TEST_PTX_DIR: cannot read PTX")
		}
		ptxSources = func() (string, string) { return string(fill), string(cp) }
	}
	os.Exit(m.Run())
}

func TestGPUDevice(t *testing.T) {
	requireGPU(t)
	require.GreaterOrEqual(t, DeviceCount(), 1)
	name, err := Device(0).Name()
	require.NoError(t, err)
	require.NotEmpty(t, name)
	total, err := Device(0).TotalMemory()
	require.NoError(t, err)
	free, total2, err := AvailableDeviceMemory()
	require.NoError(t, err)
	require.Equal(t, total, total2)
	require.Greater(t, free, 0)
	require.LessOrEqual(t, free, total)
	pct, err := PercentOfFreeDeviceMemory(50)
	require.NoError(t, err)
	require.Zero(t, pct%256)
	require.InDelta(t, float64(free)/2, float64(pct), float64(free)/100)
	v, err := DriverVersion()
	require.NoError(t, err)
	require.GreaterOrEqual(t, v, 11020)
	major, _, err := Device(0).ComputeCapability()
	require.NoError(t, err)
	require.GreaterOrEqual(t, major, 7)
	require.NoError(t, Device(0).Synchronize())
	_, err = Device(DeviceCount()).Name()
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, ok := CurrentDeviceResource().(*CudaMemoryResource)
	require.True(t, ok, "the initial resource is a CudaMemoryResource")
	t.Logf("%s, %d MiB, driver %d", name, total>>20, v)
}

func gpuResources(t *testing.T) map[string]MemoryResource {
	t.Helper()
	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	async, err := NewCudaAsyncMemoryResource(0, nil)
	require.NoError(t, err)
	t.Cleanup(func() { async.Close() })
	managed, err := NewManagedMemoryResource(0)
	require.NoError(t, err)
	pool, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: 1 << 30})
	require.NoError(t, err)
	t.Cleanup(func() { pool.Close() })
	return map[string]MemoryResource{"cuda": cuda, "async": async, "managed": managed, "pool": pool}
}

func TestGPUResourcesRoundTrip(t *testing.T) {
	requireGPU(t)
	s, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	defer s.Close()
	ctx, err := Device(0).ctx()
	require.NoError(t, err)
	for name, mr := range gpuResources(t) {
		t.Run(name, func(t *testing.T) {
			const n = 1 << 20
			p, err := mr.Allocate(n, s.View())
			require.NoError(t, err)
			require.NotZero(t, p)
			require.Zero(t, p%256)
			src := make([]byte, n)
			for i := range src {
				src[i] = byte(i * 7)
			}
			require.NoError(t, cuMemcpyHtoDSync(ctx, p, unsafe.Pointer(&src[0]), n, s.View().cu()))
			dst := make([]byte, n)
			require.NoError(t, cuMemcpyDtoHSync(ctx, unsafe.Pointer(&dst[0]), p, n, s.View().cu()))
			require.Equal(t, src, dst)
			require.NoError(t, mr.Deallocate(p, n, s.View()))
			// Zero bytes.
			z, err := mr.Allocate(0, s.View())
			require.NoError(t, err)
			require.Zero(t, z)
			require.NoError(t, mr.Deallocate(0, 0, s.View()))
		})
	}
}

// 1 PiB fails with ErrOutOfMemory and the resource keeps working.
func TestGPUOutOfMemory(t *testing.T) {
	requireGPU(t)
	const pib = 1 << 50
	for name, mr := range gpuResources(t) {
		if name == "managed" {
			continue // never ask for more managed memory than the card has
		}
		t.Run(name, func(t *testing.T) {
			_, err := mr.Allocate(pib, DefaultStream)
			require.ErrorIs(t, err, ErrOutOfMemory)
			require.Contains(t, err.Error(), "1125899906842624")
			p, err := mr.Allocate(4096, DefaultStream)
			require.NoError(t, err, "still usable")
			require.NoError(t, mr.Deallocate(p, 4096, DefaultStream))
		})
	}
}

func TestGPUFillKernels(t *testing.T) {
	requireGPU(t)
	mr, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	ctx, _ := Device(0).ctx()
	const total = 3<<20 + 48 // not a multiple of 16 everywhere
	p, err := mr.Allocate(total+64, DefaultStream)
	require.NoError(t, err)
	defer mr.Deallocate(p, total+64, DefaultStream)
	for _, w := range []int{1, 2, 3, 4, 5, 8, 12, 16, 24, 100, 256, 300} {
		for _, off := range []int{0, w, 8, 3 * w} {
			if off%min(w, 8) != 0 && w <= 8 {
				continue
			}
			n := (total / w) * w
			elem := make([]byte, w)
			for i := range elem {
				elem[i] = byte(0x11*i + w)
			}
			dst := p + DevicePtr(off)
			if off+n > total+64 {
				n -= w * ((off + n - total - 64 + w - 1) / w)
			}
			require.NoError(t, cuMemsetAsync(ctx, p, 0, (total+64)/4, 4, cuStreamLegacy))
			require.NoError(t, deviceFill(0, dst, n, elem, DefaultStream), "w=%d off=%d", w, off)
			got := make([]byte, total+64)
			require.NoError(t, cuMemcpyDtoHSync(ctx, unsafe.Pointer(&got[0]), p, total+64, cuStreamLegacy))
			for i := 0; i < off; i++ {
				require.Zero(t, got[i], "w=%d off=%d: byte %d before the fill was written", w, off, i)
			}
			for i := 0; i < n; i++ {
				if got[off+i] != elem[i%w] {
					t.Fatalf("w=%d off=%d: byte %d = %#x, want %#x", w, off, i, got[off+i], elem[i%w])
				}
			}
			for i := off + n; i < total+64; i++ {
				require.Zero(t, got[i], "w=%d off=%d: byte %d after the fill was written", w, off, i)
			}
		}
	}
}

func TestGPUCopyKernel(t *testing.T) {
	requireGPU(t)
	mr, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	ctx, _ := Device(0).ctx()
	const n = 1<<20 + 16*3
	a, _ := mr.Allocate(n, DefaultStream)
	b, _ := mr.Allocate(n, DefaultStream)
	defer mr.Deallocate(a, n, DefaultStream)
	defer mr.Deallocate(b, n, DefaultStream)
	src := make([]byte, n)
	for i := range src {
		src[i] = byte(i*31 + 5)
	}
	require.NoError(t, cuMemcpyHtoDSync(ctx, a, unsafe.Pointer(&src[0]), n, cuStreamLegacy))
	for _, f := range []func(Device, DevicePtr, DevicePtr, int, StreamView) error{deviceCopy, deviceCopyKernel} {
		require.NoError(t, cuMemsetAsync(ctx, b, 0, n/4, 4, cuStreamLegacy))
		require.NoError(t, f(0, b, a, n, DefaultStream))
		got := make([]byte, n)
		require.NoError(t, cuMemcpyDtoHSync(ctx, unsafe.Pointer(&got[0]), b, n, cuStreamLegacy))
		require.Equal(t, src, got)
		// Unaligned: bytes kernel.
		require.NoError(t, f(0, b+1, a+3, 1000, DefaultStream))
		require.NoError(t, cuMemcpyDtoHSync(ctx, unsafe.Pointer(&got[0]), b, n, cuStreamLegacy))
		require.Equal(t, src[3:1003], got[1:1001])
	}
}

// While a long sequence of fills on stream A still writes a block, A copies the block to a result
// buffer and frees it; stream B then allocates the same size from the pool and overwrites it at
// once. B must get the memory only after A's work: A's result is intact and the block holds B's
// value.
func TestGPUPoolCrossStreamReuse(t *testing.T) {
	requireGPU(t)
	cuda, _ := NewCudaMemoryResource(0)
	const n = 256 << 20
	pool, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: n, MaximumPoolSize: n})
	require.NoError(t, err)
	defer pool.Close()
	a, _ := NewStream(0, &StreamOptions{NonBlocking: true})
	b, _ := NewStream(0, &StreamOptions{NonBlocking: true})
	defer a.Close()
	defer b.Close()
	ctx, _ := Device(0).ctx()
	result, err := cuda.Allocate(n, DefaultStream)
	require.NoError(t, err)
	defer cuda.Deallocate(result, n, DefaultStream)
	for round := 0; round < 3; round++ {
		x, err := pool.Allocate(n, a.View())
		require.NoError(t, err)
		gpuBusyThenCopy(t, ctx, x, n, result, a.View())
		require.NoError(t, pool.Deallocate(x, n, a.View()))
		y, err := pool.Allocate(n, b.View())
		require.NoError(t, err)
		require.Equal(t, x, y, "the pool cannot grow, so B gets A's block")
		require.NoError(t, deviceFill(0, y, n, le64(0x0909090909090909), b.View()))
		require.NoError(t, a.Synchronize())
		require.NoError(t, b.Synchronize())
		checkAll(t, ctx, result, n, 0x07)
		checkAll(t, ctx, y, n, 0x09)
		require.NoError(t, pool.Deallocate(y, n, b.View()))
	}
	require.NoError(t, pool.CheckInvariants())
}

// As above, but A is closed (its work still running) before B allocates: A's free blocks move to
// the default stream's list behind a device-side wait, and B must still be ordered after A's work.
func TestGPUPoolReuseAfterStreamClose(t *testing.T) {
	requireGPU(t)
	cuda, _ := NewCudaMemoryResource(0)
	const n = 256 << 20
	pool, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: n, MaximumPoolSize: n})
	require.NoError(t, err)
	defer pool.Close()
	b, _ := NewStream(0, &StreamOptions{NonBlocking: true})
	defer b.Close()
	ctx, _ := Device(0).ctx()
	result, err := cuda.Allocate(n, DefaultStream)
	require.NoError(t, err)
	defer cuda.Deallocate(result, n, DefaultStream)
	for round := 0; round < 2; round++ {
		a, _ := NewStream(0, &StreamOptions{NonBlocking: true})
		lists := pool.Stats().Streams
		x, err := pool.Allocate(n, a.View())
		require.NoError(t, err)
		gpuBusyThenCopy(t, ctx, x, n, result, a.View())
		require.NoError(t, pool.Deallocate(x, n, a.View()))
		require.NoError(t, a.Close())
		require.Equal(t, lists, pool.Stats().Streams, "A's list was dropped, its blocks moved to the default stream")
		y, err := pool.Allocate(n, b.View())
		require.NoError(t, err)
		require.Equal(t, x, y)
		require.NoError(t, deviceFill(0, y, n, le64(0x0909090909090909), b.View()))
		require.NoError(t, Device(0).Synchronize())
		checkAll(t, ctx, result, n, 0x07)
		checkAll(t, ctx, y, n, 0x09)
		require.NoError(t, pool.Deallocate(y, n, b.View()))
	}
	// A free on a stream that was already closed is ordered by a device synchronisation.
	c, _ := NewStream(0, nil)
	z, err := pool.Allocate(4096, c.View())
	require.NoError(t, err)
	require.NoError(t, c.Close())
	require.NoError(t, pool.Deallocate(z, 4096, c.View()))
	require.NoError(t, pool.CheckInvariants())
}

// A pool closed while a container still holds its memory: the container keeps working on the GPU
// and its block goes back to the upstream when it is closed.
func TestGPUPoolCloseWithLiveContainer(t *testing.T) {
	requireGPU(t)
	cuda, _ := NewCudaMemoryResource(0)
	pool, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: 64 << 20})
	require.NoError(t, err)
	v, err := NewUvector[float32](1000, DefaultStream, pool)
	require.NoError(t, err)
	require.NoError(t, pool.Close())
	require.NoError(t, v.Fill(1.5, DefaultStream))
	got, err := v.ToSlice(DefaultStream)
	require.NoError(t, err)
	require.Equal(t, float32(1.5), got[999])
	require.NoError(t, v.Close())
	require.Zero(t, pool.PoolSize())
}

func le64(v uint64) []byte {
	b := make([]byte, 8)
	binary.LittleEndian.PutUint64(b, v)
	return b
}

func checkAll(t *testing.T, ctx uintptr, p DevicePtr, n int, want byte) {
	t.Helper()
	got := make([]byte, n)
	require.NoError(t, cuMemcpyDtoHSync(ctx, unsafe.Pointer(&got[0]), p, n, cuStreamLegacy))
	// Compared a MiB at a time with bytes.Equal: a byte loop over hundreds of MiB takes minutes
	// in a race-built binary, which instruments every read.
	chunk := bytes.Repeat([]byte{want}, 1<<20)
	for off := 0; off < n; off += len(chunk) {
		part := got[off:min(n, off+len(chunk))]
		if bytes.Equal(part, chunk[:len(part)]) {
			continue
		}
		for i, v := range part {
			if v != want {
				t.Fatalf("byte %d of %d = %#x, want %#x", off+i, n, v, want)
			}
		}
	}
}

// Allocate and free on eight streams that are then destroyed, then allocate on the default
// stream: the pool must take their blocks without touching the dead streams.
func TestGPUPoolDestroyedStreams(t *testing.T) {
	requireGPU(t)
	cuda, _ := NewCudaMemoryResource(0)
	pool, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: 64 << 20, MaximumPoolSize: 64 << 20})
	require.NoError(t, err)
	defer pool.Close()
	for i := 0; i < 8; i++ {
		s, err := NewStream(0, nil)
		require.NoError(t, err)
		p, err := pool.Allocate(8<<20, s.View())
		require.NoError(t, err)
		require.NoError(t, deviceFill(0, p, 8<<20, []byte{byte(i)}, s.View()))
		require.NoError(t, pool.Deallocate(p, 8<<20, s.View()))
		require.NoError(t, s.Close())
	}
	// A stream made elsewhere, known only through a view: its event is recorded at each free.
	ctx, _ := Device(0).ctx()
	raw, err := cuStreamCreate(ctx, cuStreamNonBlocking)
	require.NoError(t, err)
	fv, err := NewStreamView(0, raw)
	require.NoError(t, err)
	require.False(t, fv.lifetimeKnown())
	q, err := pool.Allocate(8<<20, fv)
	require.NoError(t, err)
	require.NoError(t, deviceFill(0, q, 8<<20, []byte{9}, fv))
	require.NoError(t, pool.Deallocate(q, 8<<20, fv))
	require.NoError(t, cuStreamDestroy(ctx, raw))
	p, err := pool.Allocate(64<<20, DefaultStream)
	require.NoError(t, err, "all eight lists merged back into one block")
	require.NoError(t, deviceFill(0, p, 64<<20, []byte{0xab}, DefaultStream))
	require.NoError(t, Device(0).Synchronize())
	require.NoError(t, pool.Deallocate(p, 64<<20, DefaultStream))
	require.NoError(t, pool.CheckInvariants())
}

// gpuBusyThenCopy queues ~200 × 60 µs of fills over the n bytes at x on s, then a fill of 0x07 and
// a copy of x into result, all still running when it returns.
func gpuBusyThenCopy(t *testing.T, ctx uintptr, x DevicePtr, n int, result DevicePtr, s StreamView) {
	t.Helper()
	for i := 0; i < 200; i++ {
		require.NoError(t, deviceFill(0, x, n, []byte{1, 2, 3, 4, 5, 6, 7, byte(i)}, s))
	}
	require.NoError(t, deviceFill(0, x, n, le64(0x0707070707070707), s))
	require.NoError(t, cuMemcpyDtoDAsync(ctx, result, x, n, s.cu()))
}
