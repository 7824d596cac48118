package rmm

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// cuMemRangeAttributeLastPrefetchLocation is CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION: the
// device a managed range was last prefetched to (-1 the host, -2 none or mixed).
const cuMemRangeAttributeLastPrefetchLocation = 4

// gpuPrefetchSetup reads the device's concurrent-managed-access and pageable-memory-access
// attributes.
func gpuPrefetchSetup(t *testing.T) (cma, pageable bool) {
	t.Helper()
	requireGPU(t)
	c, err := Device(0).Attribute(attrConcurrentManagedAccess)
	require.NoError(t, err)
	pg, err := Device(0).Attribute(attrPageableMemoryAccess)
	require.NoError(t, err)
	return c != 0, pg != 0
}

// gpuCountPrefetches makes r count its prefetches (still made by the driver).
func gpuCountPrefetches(r *PrefetchResourceAdaptor) *atomic.Int64 {
	var n atomic.Int64
	real := r.prefetch
	r.prefetch = func(ctx uintptr, p DevicePtr, size, locType, locID int, stream uintptr) error {
		n.Add(1)
		return real(ctx, p, size, locType, locID, stream)
	}
	return &n
}

// gpuLastPrefetch is where [p, p+n) of managed memory was last prefetched to.
func gpuLastPrefetch(t *testing.T, p DevicePtr, n int) int {
	t.Helper()
	ctx, err := Device(0).ctx()
	require.NoError(t, err)
	loc, err := cuMemRangeGetAttributeInt(ctx, p, n, cuMemRangeAttributeLastPrefetchLocation)
	require.NoError(t, err)
	return loc
}

// The mode each upstream chain gets on the device: the decision of NewPrefetchResourceAdaptor.
func TestGPUPrefetchModes(t *testing.T) {
	cma, pageable := gpuPrefetchSetup(t)
	want := func(m prefetchMode) prefetchMode {
		if !cma || !cuMemPrefetchBound() {
			return prefetchNever
		}
		return m
	}
	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	managed, err := NewManagedMemoryResource(0)
	require.NoError(t, err)
	pinned, err := NewPinnedMemoryResource(0)
	require.NoError(t, err)
	poolCuda, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: 4 << 20})
	require.NoError(t, err)
	defer poolCuda.Close()
	poolManaged, err := NewPoolMemoryResource(managed, &PoolOptions{InitialPoolSize: 4 << 20})
	require.NoError(t, err)
	defer poolManaged.Close()
	expandable, err := NewPoolMemoryResource(cuda, &PoolOptions{Expandable: true, MaximumPoolSize: 1 << 30})
	require.NoError(t, err)
	defer expandable.Close()
	binning, err := NewBinningMemoryResource(managed, nil)
	require.NoError(t, err)
	defer binning.Close()
	stats, err := NewStatisticsResourceAdaptor(poolManaged)
	require.NoError(t, err)

	system := prefetchNever // malloc'd memory is prefetchable only with pageable memory access
	if pageable {
		system = want(prefetchAlways)
	}
	cases := []struct {
		name string
		mr   MemoryResource
		want prefetchMode
	}{
		{"cuda", cuda, prefetchNever},
		{"pool/cuda", poolCuda, prefetchNever},
		{"expandable pool", expandable, prefetchNever},
		{"pinned", pinned, prefetchNever},
		{"managed", managed, want(prefetchAlways)},
		{"pool/managed", poolManaged, want(prefetchAlways)},
		{"statistics/pool/managed", stats, want(prefetchAlways)},
		{"binning/managed", binning, want(prefetchIfManaged)},
		{"hidden cuda", pfHidden{cuda}, want(prefetchIfManaged)},
		{"system", NewSystemMemoryResource(), system},
	}
	if async, err := NewCudaAsyncMemoryResource(0, nil); err == nil {
		defer async.Close()
		cases = append(cases, struct {
			name string
			mr   MemoryResource
			want prefetchMode
		}{"async", async, prefetchNever})
	}
	for _, c := range cases {
		r, err := NewPrefetchResourceAdaptor(c.mr)
		require.NoError(t, err, c.name)
		require.Equal(t, c.want, r.mode, c.name)
		require.Equal(t, c.want != prefetchNever, r.Prefetching(), c.name)
	}
}

// Over memory that is not managed (cuMemAlloc, a pool over it, pinned host memory, an expandable
// pool) no prefetch is made, and the memory works.
func TestGPUPrefetchNotManagedNoCall(t *testing.T) {
	gpuPrefetchSetup(t)
	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	pool, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: 16 << 20})
	require.NoError(t, err)
	defer pool.Close()
	expandable, err := NewPoolMemoryResource(cuda, &PoolOptions{Expandable: true, MaximumPoolSize: 1 << 30})
	require.NoError(t, err)
	defer expandable.Close()
	for name, up := range map[string]MemoryResource{"cuda": cuda, "pool/cuda": pool, "expandable": expandable, "hidden cuda": pfHidden{cuda}} {
		r, err := NewPrefetchResourceAdaptor(up)
		require.NoError(t, err, name)
		n := gpuCountPrefetches(r)
		const size = 1 << 20
		p, err := r.Allocate(size, DefaultStream)
		require.NoError(t, err, name)
		require.NotZero(t, p, name)
		require.NoError(t, deviceFill(0, p, size, []byte{7}, DefaultStream), name)
		require.NoError(t, DefaultStream.Synchronize(), name)
		require.NoError(t, r.Deallocate(p, size, DefaultStream), name)
		require.Zero(t, n.Load(), "%s: no prefetch", name)
	}
}

// Over managed memory, also under a pool or an arena or hidden behind a wrapper of another kind,
// each allocation is prefetched to the device: the range's last prefetch location is device 0
// (and is not, for managed memory allocated beside the adaptor).
func TestGPUPrefetchManagedResident(t *testing.T) {
	cma, _ := gpuPrefetchSetup(t)
	if !cma || !cuMemPrefetchBound() {
		t.Skip("the device has no concurrent managed access, or the driver no cuMemPrefetchAsync_v2")
	}
	managed, err := NewManagedMemoryResource(0)
	require.NoError(t, err)
	pool, err := NewPoolMemoryResource(managed, &PoolOptions{InitialPoolSize: 128 << 20})
	require.NoError(t, err)
	defer pool.Close()
	arena, err := NewArenaMemoryResource(managed, &ArenaOptions{ArenaSize: 128 << 20})
	require.NoError(t, err)
	defer arena.Close()
	s, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	defer s.Close()

	const size = 16 << 20
	control, err := managed.Allocate(size, s.View())
	require.NoError(t, err)
	require.NotEqual(t, 0, gpuLastPrefetch(t, control, size), "never prefetched")
	require.NoError(t, managed.Deallocate(control, size, s.View()))

	for name, c := range map[string]struct {
		up   MemoryResource
		mode prefetchMode
	}{
		"managed":        {managed, prefetchAlways},
		"pool/managed":   {pool, prefetchAlways},
		"arena/managed":  {arena, prefetchAlways},
		"hidden managed": {pfHidden{managed}, prefetchIfManaged},
	} {
		r, err := NewPrefetchResourceAdaptor(c.up)
		require.NoError(t, err, name)
		require.Equal(t, c.mode, r.mode, name)
		n := gpuCountPrefetches(r)
		p, err := r.Allocate(size, s.View())
		require.NoError(t, err, name)
		require.NoError(t, s.Synchronize(), name)
		require.Equal(t, int64(1), n.Load(), name)
		require.Equal(t, 0, gpuLastPrefetch(t, p, size), "%s: prefetched to device 0", name)
		require.NoError(t, r.Deallocate(p, size, s.View()), name)
	}
}

// cuPointerGetAttributes answers for any address without an error: managed memory is managed;
// device, pinned and malloc'd memory are not.
func TestGPUPointerIsManaged(t *testing.T) {
	gpuPrefetchSetup(t)
	ctx, err := Device(0).ctx()
	require.NoError(t, err)
	managed, err := NewManagedMemoryResource(0)
	require.NoError(t, err)
	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	pinned, err := NewPinnedMemoryResource(0)
	require.NoError(t, err)
	sys := NewSystemMemoryResource()
	for name, c := range map[string]struct {
		mr   MemoryResource
		want bool
	}{"managed": {managed, true}, "cuda": {cuda, false}, "pinned": {pinned, false}, "system": {sys, false}} {
		p, err := c.mr.Allocate(4096, DefaultStream)
		require.NoError(t, err, name)
		got, err := cuPointerIsManaged(ctx, p+256)
		require.NoError(t, err, name)
		require.Equal(t, c.want, got, name)
		require.NoError(t, c.mr.Deallocate(p, 4096, DefaultStream), name)
	}
}

// A view of a closed Stream is refused before the upstream is called.
func TestGPUPrefetchClosedStream(t *testing.T) {
	gpuPrefetchSetup(t)
	managed, err := NewManagedMemoryResource(0)
	require.NoError(t, err)
	stats, err := NewStatisticsResourceAdaptor(managed)
	require.NoError(t, err)
	r, err := NewPrefetchResourceAdaptor(stats)
	require.NoError(t, err)
	s, err := NewStream(0, nil)
	require.NoError(t, err)
	v := s.View()
	require.NoError(t, s.Close())
	_, err = r.Allocate(4096, v)
	require.ErrorIs(t, err, ErrClosed)
	require.Zero(t, stats.Stats().TotalCount, "the upstream was not called")
}

// The containers' Prefetch and the package function move managed memory to the device and back to
// the host, on the stream given, and make no driver call for device memory.
func TestGPUPrefetchContainers(t *testing.T) {
	cma, _ := gpuPrefetchSetup(t)
	if !cma || !cuMemPrefetchBound() {
		t.Skip("the device cannot prefetch")
	}
	calls := countPrefetches(t)
	managed, err := NewManagedMemoryResource(0)
	require.NoError(t, err)
	s, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	defer s.Close()
	const n = 4 << 20
	b, err := NewDeviceBuffer(n, s.View(), managed)
	require.NoError(t, err)
	defer b.Close()
	require.NoError(t, b.Prefetch(0, s.View()))
	require.NoError(t, s.Synchronize())
	require.Equal(t, 0, gpuLastPrefetch(t, b.Data(), n))
	require.NoError(t, b.Prefetch(CPU, s.View()))
	require.NoError(t, s.Synchronize())
	require.Equal(t, -1, gpuLastPrefetch(t, b.Data(), n), "the host")
	require.Equal(t, int64(2), calls.Load())

	u, err := NewUvector[int64](n/8, s.View(), managed)
	require.NoError(t, err)
	defer u.Close()
	require.NoError(t, u.Span().Prefetch(0, s.View()), "a span asks the driver, then prefetches")
	require.NoError(t, Prefetch(u.Data(), u.SizeBytes(), CPU, s.View()))
	require.NoError(t, u.Prefetch(0, s.View()))
	require.NoError(t, s.Synchronize())
	require.Equal(t, 0, gpuLastPrefetch(t, u.Data(), n))
	require.Equal(t, int64(5), calls.Load())

	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	d, err := NewDeviceBuffer(n, s.View(), cuda)
	require.NoError(t, err)
	defer d.Close()
	require.NoError(t, d.Prefetch(0, s.View()))
	require.NoError(t, Prefetch(d.Data(), n, CPU, s.View()), "asked: not managed")
	ds, err := NewDeviceSpan[byte](d.Data(), n, 0, DeviceAccessible)
	require.NoError(t, err)
	require.NoError(t, ds.Prefetch(0, s.View()))
	require.Equal(t, int64(5), calls.Load(), "device memory: no prefetch")
}
