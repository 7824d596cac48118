package rmm

import (
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func hostPinned(t *testing.T) *PinnedMemoryResource {
	t.Helper()
	mr, err := NewPinnedMemoryResource(0)
	require.NoError(t, err)
	return mr
}

func TestPinnedMemoryResourceBasics(t *testing.T) {
	mr := hostPinned(t)
	var _ HostMemoryResource = mr
	var _ MemoryResource = mr
	assert.Equal(t, Device(0), mr.Device())
	if CUDAAvailable() == nil {
		assert.Equal(t, HostAccessible|DeviceAccessible, mr.Access())
	} else {
		assert.Equal(t, HostAccessible, mr.Access(), "plain host memory without CUDA")
	}
	_, err := NewPinnedMemoryResource(Device(DeviceCount() + 1))
	require.ErrorIs(t, err, ErrInvalidArgument)

	before := pinnedLiveCount()
	for _, align := range []int{1, 2, 8, 64, 256, 512, 4096, 1 << 16, 1 << 21} {
		for _, n := range []int{1, 3, 255, 256, 1000, 70000} {
			p, err := mr.AllocateHost(n, align)
			require.NoError(t, err, "n=%d align=%d", n, align)
			require.NotNil(t, p)
			require.Zero(t, uintptr(p)%uintptr(align), "n=%d align=%d: %p", n, align, p)
			require.Zero(t, uintptr(p)%Alignment, "at least 256-byte aligned")
			b := unsafe.Slice((*byte)(p), n)
			for i := range b {
				b[i] = byte(i + align)
			}
			require.Equal(t, byte(n-1+align), b[n-1])
			require.Equal(t, before+1, pinnedLiveCount())
			require.NoError(t, mr.DeallocateHost(p, n, align))
			require.Equal(t, before, pinnedLiveCount())
		}
	}
}

func TestPinnedMemoryResourceBadArguments(t *testing.T) {
	mr := hostPinned(t)
	for _, align := range []int{0, -256, 3, 100, 257} {
		_, err := mr.AllocateHost(64, align)
		require.ErrorIs(t, err, ErrInvalidArgument, "alignment %d", align)
		require.Contains(t, err.Error(), "power of two")
	}
	_, err := mr.AllocateHost(-1, 256)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = mr.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)

	p, err := mr.AllocateHost(0, 256)
	require.NoError(t, err)
	require.Nil(t, p)
	require.NoError(t, mr.DeallocateHost(nil, 0, 256))
	d, err := mr.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, d)
	require.NoError(t, mr.Deallocate(0, 0, DefaultStream))
}

func TestPinnedMemoryResourceInvalidFree(t *testing.T) {
	mr := hostPinned(t)
	before := pinnedLiveCount()
	p, err := mr.AllocateHost(1000, 4096)
	require.NoError(t, err)
	// Wrong size, wrong alignment, interior pointer, foreign pointer: refused, nothing freed.
	require.ErrorIs(t, mr.DeallocateHost(p, 999, 4096), ErrInvalidFree)
	require.ErrorIs(t, mr.DeallocateHost(p, 1000, 256), ErrInvalidFree)
	require.ErrorIs(t, mr.DeallocateHost(unsafe.Add(p, 256), 1000, 4096), ErrInvalidFree)
	var x [512]byte
	require.ErrorIs(t, mr.DeallocateHost(unsafe.Pointer(&x[0]), 512, 256), ErrInvalidFree)
	require.ErrorIs(t, mr.Deallocate(DevicePtr(uintptr(p)), 1000, DefaultStream), ErrInvalidFree, "the MemoryResource side uses alignment 256")
	require.Equal(t, before+1, pinnedLiveCount())
	// Still intact and freeable.
	unsafe.Slice((*byte)(p), 1000)[999] = 1
	require.NoError(t, mr.DeallocateHost(p, 1000, 4096))
	err = mr.DeallocateHost(p, 1000, 4096)
	require.ErrorIs(t, err, ErrInvalidFree, "double free")
	require.Contains(t, err.Error(), "already freed")

	// Memory from one pinned resource may be freed by another (all are interchangeable).
	other := hostPinned(t)
	q, err := mr.Allocate(300, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, other.Deallocate(q, 300, DefaultStream))
	// A stream closed before the free.
	st, err := NewStream(0, nil)
	require.NoError(t, err)
	q, err = mr.Allocate(300, st.View())
	require.NoError(t, err)
	require.NoError(t, st.Close())
	require.NoError(t, mr.Deallocate(q, 300, st.View()))
	require.Equal(t, before, pinnedLiveCount())
}

func TestPinnedMemoryResourceConcurrent(t *testing.T) {
	mr := hostPinned(t)
	before := pinnedLiveCount()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				n := 1 + (g*977+i*131)%5000
				align := 1 << ((g + i) % 14)
				p, err := mr.AllocateHost(n, align)
				if err != nil {
					errs <- err
					return
				}
				b := unsafe.Slice((*byte)(p), n)
				for j := range b {
					b[j] = byte(g)
				}
				for j := range b {
					if b[j] != byte(g) {
						errs <- assert.AnError
						return
					}
				}
				if err := mr.DeallocateHost(p, n, align); err != nil {
					errs <- err
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, before, pinnedLiveCount())
}

// A pool over pinned memory, and containers over the pool: host memory on CI, pinned memory that
// kernels and device copies use directly on a GPU.
func TestPinnedMemoryResourceAsPoolUpstream(t *testing.T) {
	mr := hostPinned(t)
	pool, err := NewPoolMemoryResource(mr, &PoolOptions{InitialPoolSize: 4 << 20})
	require.NoError(t, err)
	assert.Equal(t, mr.Access(), AccessOf(pool))
	before := pinnedLiveCount()
	v, err := NewUvector[uint16](100_000, DefaultStream, pool)
	require.NoError(t, err)
	require.NoError(t, v.Fill(0xBEEF, DefaultStream))
	require.NoError(t, v.SetElement(5, 1, DefaultStream))
	got, err := v.ToSlice(DefaultStream)
	require.NoError(t, err)
	require.Equal(t, uint16(0xBEEF), got[0])
	require.Equal(t, uint16(1), got[5])
	require.Equal(t, uint16(0xBEEF), got[len(got)-1])
	// The pointer is host memory: the CPU reads it directly.
	require.Equal(t, byte(0xEF), hostBytes(v.Data(), 2)[0])
	require.NoError(t, v.Close())
	require.Equal(t, before, pinnedLiveCount(), "the pool took its memory at construction")
	require.NoError(t, pool.Close())
	require.Equal(t, before-1, pinnedLiveCount(), "closing the pool frees its pinned block")
}

func TestGPUPinnedMemoryResource(t *testing.T) {
	requireGPU(t)
	mr := hostPinned(t)
	require.Equal(t, HostAccessible|DeviceAccessible, mr.Access())
	s := gpuStream(t)
	ctx, err := Device(0).ctx()
	require.NoError(t, err)

	// The driver knows the memory as host memory (CU_MEMORYTYPE_HOST through cuMemcpyAsync's
	// unified addressing): copy device → pinned → device.
	const n = 8 << 20
	p, err := mr.Allocate(n, s)
	require.NoError(t, err)
	hb := hostBytes(p, n)
	for i := range hb {
		hb[i] = byte(i * 13)
	}
	dev, err := NewDeviceBuffer(n, s, nil)
	require.NoError(t, err)
	defer dev.Close()
	require.NoError(t, cuMemcpyAsync(ctx, uintptr(dev.Data()), uintptr(p), n, s.cu()))
	require.NoError(t, s.Synchronize())
	back, err := dev.Bytes(s)
	require.NoError(t, err)
	require.Equal(t, hb, back)
	require.NoError(t, mr.Deallocate(p, n, s))

	// Freed on a Stream that is already closed: the device is synchronised instead.
	closed, err := NewStream(0, nil)
	require.NoError(t, err)
	q, err := mr.Allocate(4096, closed.View())
	require.NoError(t, err)
	require.NoError(t, closed.Close())
	require.NoError(t, mr.Deallocate(q, 4096, closed.View()))

	// Containers over a pool over pinned memory take the device path: fill on the GPU, then read
	// the result with the CPU straight from the pinned pointer.
	pool, err := NewPoolMemoryResource(mr, &PoolOptions{InitialPoolSize: 64 << 20})
	require.NoError(t, err)
	defer pool.Close()
	v, err := NewUvector[float32](1<<20, s, pool)
	require.NoError(t, err)
	require.NoError(t, v.Fill(3.5, s))
	require.NoError(t, s.Synchronize())
	f := unsafe.Slice((*float32)(addrToPointer(uintptr(v.Data()))), v.Len())
	require.Equal(t, float32(3.5), f[0])
	require.Equal(t, float32(3.5), f[len(f)-1])
	// Device-to-device copy between pinned and device memory.
	d, err := NewUvector[float32](v.Len(), s, nil)
	require.NoError(t, err)
	defer d.Close()
	require.NoError(t, d.CopyFrom(v, s))
	got, err := d.ToSlice(s)
	require.NoError(t, err)
	require.Equal(t, float32(3.5), got[12345])
	require.NoError(t, v.Close())
}

func TestPageableMemoryResource(t *testing.T) {
	mr := NewPageableMemoryResource()
	var _ HostMemoryResource = mr
	before := pageableTable.count()
	// Memory from one pageable resource may be freed by another (they share one table).
	p0, err := mr.AllocateHost(100, 8)
	require.NoError(t, err)
	require.Equal(t, before+1, pageableTable.count())
	require.NoError(t, NewPageableMemoryResource().DeallocateHost(p0, 100, 8))
	require.Equal(t, before, pageableTable.count())
	for _, align := range []int{1, 8, 256, 4096, 1 << 21} {
		for _, n := range []int{1, 255, 1000, 70000} {
			p, err := mr.AllocateHost(n, align)
			require.NoError(t, err, "n=%d align=%d", n, align)
			require.Zero(t, uintptr(p)%uintptr(align), "n=%d align=%d: %p", n, align, p)
			b := unsafe.Slice((*byte)(p), n)
			for i := range b {
				b[i] = byte(i * 7)
			}
			require.Equal(t, byte((n-1)*7), b[n-1])
			require.Equal(t, before+1, pageableTable.count())
			require.NoError(t, NewPageableMemoryResource().DeallocateHost(p, n, align), "any of them frees it")
			require.Equal(t, before, pageableTable.count())
		}
	}
	p, err := mr.AllocateHost(0, 64)
	require.NoError(t, err)
	require.Nil(t, p)
	require.NoError(t, mr.DeallocateHost(nil, 0, 64))
	for _, align := range []int{0, -8, 3, 257} {
		_, err := mr.AllocateHost(64, align)
		require.ErrorIs(t, err, ErrInvalidArgument, "alignment %d", align)
	}
	_, err = mr.AllocateHost(-1, 8)
	require.ErrorIs(t, err, ErrInvalidArgument)

	// Bad frees change nothing: a wrong size or alignment, a double free, a pinned pointer, a
	// pointer into the block.
	p, err = mr.AllocateHost(4096, 512)
	require.NoError(t, err)
	require.ErrorIs(t, mr.DeallocateHost(p, 4095, 512), ErrInvalidFree)
	require.ErrorIs(t, mr.DeallocateHost(p, 4096, 256), ErrInvalidFree)
	require.ErrorIs(t, mr.DeallocateHost(unsafe.Add(p, 256), 4096, 512), ErrInvalidFree)
	q, err := hostPinned(t).AllocateHost(4096, 512)
	require.NoError(t, err)
	err = mr.DeallocateHost(q, 4096, 512)
	require.ErrorIs(t, err, ErrInvalidFree)
	require.Contains(t, err.Error(), "PageableMemoryResource")
	require.ErrorIs(t, hostPinned(t).DeallocateHost(p, 4096, 512), ErrInvalidFree, "nor the other way")
	require.NoError(t, hostPinned(t).DeallocateHost(q, 4096, 512))
	require.NoError(t, mr.DeallocateHost(p, 4096, 512))
	require.ErrorIs(t, mr.DeallocateHost(p, 4096, 512), ErrInvalidFree, "twice")
	require.Equal(t, before, pageableTable.count())
}

// Concurrent allocations and frees keep the table exact.
func TestPageableMemoryResourceConcurrent(t *testing.T) {
	mr := NewPageableMemoryResource()
	before := pageableTable.count()
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				n, align := 64+i*g, 1<<(i%13)
				p, err := mr.AllocateHost(n, align)
				if !assert.NoError(t, err) {
					return
				}
				*(*byte)(p) = byte(g)
				assert.NoError(t, mr.DeallocateHost(p, n, align))
			}
		}()
	}
	wg.Wait()
	require.Equal(t, before, pageableTable.count())
}
