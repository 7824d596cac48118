package rmm

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// Prefetch over managed memory: the range becomes resident on the GPU (the device's free memory
// drops by about its size once the stream is done), and the memory works from both sides.
func TestGPUPrefetchManaged(t *testing.T) {
	requireGPU(t)
	managed, err := NewManagedMemoryResource(0)
	require.NoError(t, err)
	r, err := NewPrefetchResourceAdaptor(managed)
	require.NoError(t, err)
	cma, err := Device(0).Attribute(attrConcurrentManagedAccess)
	require.NoError(t, err)
	require.Equal(t, cma == 1, r.Prefetching())
	if !r.Prefetching() {
		t.Skip("the device has no concurrent managed access: prefetching is off")
	}
	require.Equal(t, HostAccessible|DeviceAccessible, r.Access())
	require.Equal(t, Device(0), r.Device())
	s, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	defer s.Close()

	const n = 512 << 20
	require.NoError(t, Device(0).Synchronize())
	free0, _, err := Device(0).MemoryInfo()
	require.NoError(t, err)
	p, err := r.Allocate(n, s.View())
	require.NoError(t, err)
	require.NotZero(t, p)
	require.Zero(t, p%256)
	require.NoError(t, s.Synchronize())
	free1, _, err := Device(0).MemoryInfo()
	require.NoError(t, err)
	t.Logf("free before %d, after the prefetch %d: %d MiB resident", free0, free1, (free0-free1)>>20)
	require.GreaterOrEqual(t, free0-free1, n/2, "the prefetched range is resident on the device")

	// The GPU writes it on the stream; the host reads it.
	require.NoError(t, deviceFill(0, p, n, []byte{0xab, 0xcd}, s.View()))
	require.NoError(t, s.Synchronize())
	b := hostBytes(p, n)
	require.True(t, bytes.Equal(b[:4], []byte{0xab, 0xcd, 0xab, 0xcd}))
	require.True(t, bytes.Equal(b[n-2:], []byte{0xab, 0xcd}))
	require.NoError(t, r.Deallocate(p, n, s.View()))

	z, err := r.Allocate(0, s.View())
	require.NoError(t, err)
	require.Zero(t, z)
}

// Over cuMemAlloc memory (not managed) nothing is prefetched and no prefetch is tried (the driver
// would refuse it with CUDA_ERROR_INVALID_VALUE): the adaptor is a pass-through, and the memory
// works.
func TestGPUPrefetchUnmanagedSkipped(t *testing.T) {
	requireGPU(t)
	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	r, err := NewPrefetchResourceAdaptor(cuda)
	require.NoError(t, err)
	require.False(t, r.Prefetching())
	require.Equal(t, prefetchNever, r.mode)
	const n = 1 << 20
	p, err := r.Allocate(n, DefaultStream)
	require.NoError(t, err)
	require.NotZero(t, p)
	require.NoError(t, deviceFill(0, p, n, []byte{7}, DefaultStream))
	require.NoError(t, DefaultStream.Synchronize())
	require.NoError(t, r.Deallocate(p, n, DefaultStream))
}

// Statistics and limits over cuMemAlloc: real device pointers, exact figures, a refusal before
// the driver is called, the driver's own out-of-memory passing through both.
func TestGPUStatisticsAndLimiting(t *testing.T) {
	requireGPU(t)
	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	stats, err := NewStatisticsResourceAdaptor(cuda)
	require.NoError(t, err)
	lim, err := NewLimitingResourceAdaptor(stats, 8<<20, nil)
	require.NoError(t, err)
	require.Equal(t, DeviceAccessible, lim.Access())
	require.Equal(t, Device(0), lim.Device())

	var ps []DevicePtr
	for i := range 10 {
		p, err := stats.Allocate(1<<20+i, DefaultStream)
		require.NoError(t, err)
		require.NotZero(t, p)
		require.Zero(t, p%256)
		ps = append(ps, p)
	}
	require.Equal(t, Statistics{10<<20 + 45, 10, 10<<20 + 45, 10, 10<<20 + 45, 10}, stats.Stats())
	for i, p := range ps {
		require.NoError(t, stats.Deallocate(p, 1<<20+i, DefaultStream))
	}
	require.Equal(t, Statistics{0, 0, 10<<20 + 45, 10, 10<<20 + 45, 10}, stats.Stats())

	stats.PushCounters()
	a, err := lim.Allocate(3<<20, DefaultStream)
	require.NoError(t, err)
	b, err := lim.Allocate(3<<20, DefaultStream)
	require.NoError(t, err)
	_, err = lim.Allocate(3<<20, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.ErrorContains(t, err, "exceeded memory limit")
	require.Equal(t, 6<<20, lim.AllocatedBytes())
	require.Equal(t, Statistics{6 << 20, 2, 6 << 20, 2, 6 << 20, 2}, stats.Stats(), "the refusal never reached the upstream")
	// A device pointer from the limit can be written by the GPU.
	require.NoError(t, deviceFill(0, a, 3<<20, []byte{1, 2, 3, 4}, DefaultStream))
	require.NoError(t, DefaultStream.Synchronize())
	require.NoError(t, lim.Deallocate(a, 3<<20, DefaultStream))
	require.NoError(t, lim.Deallocate(b, 3<<20, DefaultStream))
	st, err := stats.PopCounters()
	require.NoError(t, err)
	require.Equal(t, Statistics{0, 0, 6 << 20, 2, 6 << 20, 2}, st)
	require.Zero(t, lim.AllocatedBytes())

	// The driver's out of memory: 1 PiB under a limit of 2 PiB.
	big, err := NewLimitingResourceAdaptor(stats, 2<<50, nil)
	require.NoError(t, err)
	_, err = big.Allocate(1<<50, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Zero(t, big.AllocatedBytes())
	require.Equal(t, int64(0), stats.Stats().CurrentCount)

	// A failure callback sees the driver's out of memory, and gives up.
	calls := 0
	fc, err := NewFailureCallbackResourceAdaptor(cuda, func(n int, err error) bool { calls++; return false }, nil)
	require.NoError(t, err)
	_, err = fc.Allocate(1<<50, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Equal(t, 1, calls)
}

// Aligned and tracked device memory: a 1 MiB-aligned range the GPU can fill from end to end.
func TestGPUAlignedAndTracking(t *testing.T) {
	requireGPU(t)
	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	tr, err := NewTrackingResourceAdaptor(cuda, &TrackingOptions{CaptureStacks: true})
	require.NoError(t, err)
	al, err := NewAlignedResourceAdaptor(tr, &AlignedOptions{Alignment: 1 << 20})
	require.NoError(t, err)
	const n = 5<<20 + 3
	p, err := al.Allocate(n, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, p%(1<<20))
	out := tr.OutstandingAllocations()
	require.Len(t, out, 1)
	require.Equal(t, 6<<20+(1<<20)-256, out[0].Size)
	require.LessOrEqual(t, out[0].Ptr, p)
	require.NotEmpty(t, out[0].Frames())
	require.NoError(t, deviceFill(0, p, n, []byte{9}, DefaultStream))
	require.NoError(t, DefaultStream.Synchronize())
	require.NoError(t, al.Deallocate(p, n, DefaultStream))
	require.Empty(t, tr.OutstandingAllocations())
	require.Zero(t, tr.AllocatedBytes())
}

// A pool over the device sampling into a MemoryProfile at rate 1 (plain, expandable and
// stitching) counts every allocation and free exactly, on the stream cache's path and the pool's.
func TestGPUPoolMemoryProfile(t *testing.T) {
	requireGPU(t)
	for _, o := range []PoolOptions{{InitialPoolSize: 64 << 20}, {Expandable: true, MaximumPoolSize: 1 << 30}, {Expandable: true, Stitch: true, MaximumPoolSize: 1 << 30}} {
		t.Run(fmt.Sprintf("expandable=%v/stitch=%v", o.Expandable, o.Stitch), func(t *testing.T) {
			poolProfRateOne(t, func(prof *MemoryProfile) *PoolMemoryResource {
				o.MemoryProfile = prof
				var up MemoryResource // expandable: the current device
				if !o.Expandable {
					cuda, err := NewCudaMemoryResource(0)
					require.NoError(t, err)
					up = cuda
				}
				p, err := NewPoolMemoryResource(up, &o)
				require.NoError(t, err)
				return p
			})
		})
	}
}
