package rmm_test

import (
	"errors"
	"testing"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/rmmtest"
	"github.com/stretchr/testify/require"
)

// Without CUDA there is no managed pool: ErrNoDevice. On a GPU the resource exists where the
// driver and the device offer managed memory pools, and holds rmmtest's contract; elsewhere the
// constructor says ErrNotSupported.
func TestCudaAsyncManagedMemoryResource(t *testing.T) {
	if err := rmm.CUDAAvailable(); err != nil {
		_, err := rmm.NewCudaAsyncManagedMemoryResource(0)
		require.ErrorIs(t, err, rmm.ErrNoDevice)
		t.Skipf("no CUDA device: %v", rmm.CUDAAvailable())
	}
	_, err := rmm.NewCudaAsyncManagedMemoryResource(rmm.Device(1 << 20))
	require.ErrorIs(t, err, rmm.ErrInvalidArgument, "a bad ordinal")
	mr, err := rmm.NewCudaAsyncManagedMemoryResource(rmm.CurrentDevice())
	if errors.Is(err, rmm.ErrNotSupported) {
		v, _ := rmm.DriverVersion()
		t.Skipf("driver %d: %v", v, err)
	}
	require.NoError(t, err)
	require.NotZero(t, mr.PoolHandle())
	require.Equal(t, rmm.HostAccessible|rmm.DeviceAccessible, mr.Access())
	require.NoError(t, mr.Close())

	rmmtest.Run(t, func(t *testing.T, _ rmm.MemoryResource) rmm.MemoryResource {
		mr, err := rmm.NewCudaAsyncManagedMemoryResource(rmm.CurrentDevice())
		require.NoError(t, err)
		return mr
	}, &rmmtest.Options{MaxAllocationSize: 1 << 20})

	// The host reads what a stream wrote, once the stream is done.
	mr, err = rmm.NewCudaAsyncManagedMemoryResource(rmm.CurrentDevice())
	require.NoError(t, err)
	s, err := rmm.NewStream(rmm.CurrentDevice(), nil)
	require.NoError(t, err)
	defer s.Close()
	v, err := rmm.NewUvector[int32](1000, s.View(), mr)
	require.NoError(t, err)
	require.NoError(t, v.Fill(7, s.View()))
	before, err := mr.UsedBytes()
	require.NoError(t, err)
	require.GreaterOrEqual(t, before, 4000)
	got, err := v.ToSlice(s.View())
	require.NoError(t, err)
	require.Equal(t, int32(7), got[999])
	require.NoError(t, v.Close())
	require.NoError(t, s.Synchronize())
	after, err := mr.UsedBytes()
	require.NoError(t, err)
	require.Less(t, after, before, "the free went back to the pool")
	require.NoError(t, mr.Close())
	_, err = mr.Allocate(256, rmm.DefaultStream)
	require.ErrorIs(t, err, rmm.ErrClosed)
}
