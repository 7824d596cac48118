package rmm

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCudaAsyncViewWithoutCUDA(t *testing.T) {
	if CUDAAvailable() == nil {
		t.Skip("CUDA is available")
	}
	_, err := DefaultMemPool(0)
	require.ErrorIs(t, err, ErrNoDevice)
	_, err = NewCudaAsyncViewMemoryResource(0, 0x1234)
	require.ErrorIs(t, err, ErrNoDevice)
	_, err = NewCudaAsyncViewMemoryResource(0, 0)
	require.ErrorIs(t, err, ErrInvalidArgument, "a null handle is refused before anything else")
}

func TestSamHeadroomWithoutCUDA(t *testing.T) {
	if CUDAAvailable() == nil {
		t.Skip("CUDA is available")
	}
	_, err := NewSamHeadroomMemoryResource(0, 1<<30)
	require.ErrorIs(t, err, ErrNoDevice)
	_, err = NewSamHeadroomMemoryResource(0, -1)
	require.ErrorIs(t, err, ErrInvalidArgument)
}

func TestSamGPUPortion(t *testing.T) {
	for _, c := range []struct{ n, free, headroom, want int }{
		{1 << 20, 10 << 20, 1 << 20, 1 << 20},          // fits: all on the GPU
		{10 << 20, 5 << 20, 1 << 20, 4 << 20},          // free − headroom on the GPU
		{10 << 20, 5<<20 + 300, 1 << 20, 4<<20 + 256},  // rounded down to 256
		{1000, 1 << 30, 0, 768},                        // small sizes round down too
		{100, 1 << 30, 0, 0},                           // below 256: all on the host
		{1 << 20, 1 << 20, 1 << 20, 0},                 // no room left
		{1 << 20, 1 << 19, 1 << 20, 0},                 // headroom above free
		{3<<20 + 17, 64 << 20, 60 << 20, 3<<20 + 0},    // min(4 MiB, n) then aligned down
		{(1 << 40) + 5, 1 << 41, 1 << 30, 1 << 40},     // large values
		{513, 1 << 30, 1<<30 - 512, 512},               // exactly 512 allowed
		{0, 1 << 30, 0, 0},                             // nothing asked
		{1 << 20, 0, 0, 0},                             // nothing free
		{4096, 4096 + 255, 255, 4096},                  // free − headroom = n
		{4096, 4096 + 255, 256, 3840},                  // one byte short of n, rounded down
		{8 << 20, 16 << 20, 12<<20 + 100, 4<<20 - 256}, // (4 MiB − 100) rounded down
		{1, 1, 0, 0},                                        // one byte
		{257, 1 << 20, 0, 256},                              // the tail goes to the host
		{2 << 30, 80 << 30, 0, 2 << 30},                     // all on the GPU
		{2 << 30, 80 << 30, 79 << 30, 1 << 30},              // half and half
		{2 << 30, 80 << 30, 80 << 30, 0},                    // headroom = free
		{2 << 30, 80 << 30, 81 << 30, 0},                    // headroom > free
		{12345678, 1 << 40, 1<<40 - 1234567, 1234432},       // 1234567 rounded down to 256
		{12345678, 1 << 40, 1<<40 - 12345678, 12345600},     // n rounded down to 256
		{12345678, 1 << 40, 1<<40 - 12345678 - 1, 12345600}, // one more byte of room: n still rounds down
	} {
		got := samGPUPortion(c.n, c.free, c.headroom)
		assert.Equal(t, c.want, got, "n=%d free=%d headroom=%d", c.n, c.free, c.headroom)
		assert.Zero(t, got%Alignment)
		assert.LessOrEqual(t, got, c.n)
	}
}

func TestGPUCudaAsyncViewDefaultPool(t *testing.T) {
	requireGPU(t)
	pool, err := DefaultMemPool(0)
	require.NoError(t, err)
	require.NotZero(t, pool)
	again, err := DefaultMemPool(0)
	require.NoError(t, err)
	require.Equal(t, pool, again, "the default pool is one pool")

	view, err := NewCudaAsyncViewMemoryResource(0, pool)
	require.NoError(t, err)
	view2, err := NewCudaAsyncViewMemoryResource(0, pool)
	require.NoError(t, err)
	assert.Equal(t, pool, view.PoolHandle())
	assert.Equal(t, Device(0), view.Device())
	assert.Equal(t, DeviceAccessible, view.Access())
	// Memory from one view of a pool may be freed through another view of it, or through the
	// resource that owns the pool.
	p, err := view.Allocate(4096, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, view2.Deallocate(p, 4096, DefaultStream), "two views of one pool are interchangeable")
	own, err := NewCudaAsyncMemoryResource(0, nil)
	require.NoError(t, err)
	defer own.Close()
	ownView, err := NewCudaAsyncViewMemoryResource(0, own.PoolHandle())
	require.NoError(t, err)
	p, err = ownView.Allocate(4096, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, own.Deallocate(p, 4096, DefaultStream))

	s := gpuStream(t)
	used0, err := view.UsedBytes()
	require.NoError(t, err)
	v, err := NewUvector[int32](1<<20, s, view)
	require.NoError(t, err)
	used1, err := view.UsedBytes()
	require.NoError(t, err)
	require.GreaterOrEqual(t, used1-used0, 4<<20, "the allocation comes from the default pool")
	reserved, err := view.ReservedBytes()
	require.NoError(t, err)
	require.GreaterOrEqual(t, reserved, used1)
	require.NoError(t, v.Fill(-9, s))
	got, err := v.ToSlice(s)
	require.NoError(t, err)
	require.Equal(t, int32(-9), got[0])
	require.Equal(t, int32(-9), got[len(got)-1])

	// Freed through the other view of the same pool, in stream order.
	buf := v.Release()
	p, n := buf.Release()
	require.NoError(t, buf.Close())
	require.NoError(t, v.Close())
	require.NoError(t, view2.Deallocate(p, n, s))
	require.NoError(t, s.Synchronize())
	used2, err := view.UsedBytes()
	require.NoError(t, err)
	require.Equal(t, used0, used2)

	// Out of memory is an error and the view keeps working.
	_, err = view.Allocate(1<<50, s)
	require.ErrorIs(t, err, ErrOutOfMemory)

	// Close does not destroy the pool: another view still allocates from it.
	require.NoError(t, view.Close())
	_, err = view.Allocate(256, s)
	require.ErrorIs(t, err, ErrClosed)
	q, err := view2.Allocate(1<<20, s)
	require.NoError(t, err)
	require.NoError(t, view2.Deallocate(q, 1<<20, s))
	require.NoError(t, s.Synchronize())
	still, err := DefaultMemPool(0)
	require.NoError(t, err)
	require.Equal(t, pool, still)
}

func TestGPUSamHeadroom(t *testing.T) {
	requireGPU(t)
	pageable, err := Device(0).Attribute(attrPageableMemoryAccess)
	require.NoError(t, err)
	mr, err := NewSamHeadroomMemoryResource(0, 1<<30)
	if pageable == 0 {
		// The H200 in an x86 host without HMM reports 0.
		require.ErrorIs(t, err, ErrNotSupported)
		require.Contains(t, err.Error(), "PAGEABLE_MEMORY_ACCESS")
		return
	}
	require.NoError(t, err)
	require.Equal(t, HostAccessible|DeviceAccessible, mr.Access())
	require.Equal(t, 1<<30, mr.Headroom())
	s := gpuStream(t)
	v, err := NewUvector[int64](1<<20, s, mr)
	require.NoError(t, err)
	require.NoError(t, v.Fill(42, s))
	got, err := v.ToSlice(s)
	require.NoError(t, err)
	require.Equal(t, int64(42), got[0])
	require.Equal(t, int64(42), got[len(got)-1])
	require.NoError(t, v.Close())
	_, err = mr.Allocate(-1, s)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, mr.Deallocate(0x100, 256, s), ErrInvalidFree)
}
