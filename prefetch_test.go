package rmm

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// countPrefetches replaces the driver's prefetch with one that counts its calls.
func countPrefetches(t *testing.T) *atomic.Int64 {
	var n atomic.Int64
	real := prefetchCall
	prefetchCall = func(ctx uintptr, p DevicePtr, size, locType, locID int, stream uintptr) error {
		n.Add(1)
		return real(ctx, p, size, locType, locID, stream)
	}
	t.Cleanup(func() { prefetchCall = real })
	return &n
}

// Bad arguments are refused before anything else; memory that cannot be prefetched (here host
// memory, or any memory without CUDA) is left alone with no driver call.
func TestPrefetchArguments(t *testing.T) {
	calls := countPrefetches(t)
	b, err := NewDeviceBuffer(4096, DefaultStream, NewSystemMemoryResource())
	require.NoError(t, err)
	require.ErrorIs(t, Prefetch(b.Data(), -1, 0, DefaultStream), ErrInvalidArgument)
	require.ErrorIs(t, Prefetch(b.Data(), 16, Device(DeviceCount()+3), DefaultStream), ErrInvalidArgument)
	require.ErrorIs(t, b.Prefetch(Device(-7), DefaultStream), ErrInvalidArgument)
	s, err := NewStream(0, nil)
	require.NoError(t, err)
	v := s.View()
	require.NoError(t, s.Close())
	require.ErrorIs(t, b.Prefetch(0, v), ErrClosed)
	require.ErrorIs(t, Prefetch(b.Data(), 16, CPU, v), ErrClosed)

	require.NoError(t, b.Prefetch(0, DefaultStream))
	require.NoError(t, b.Prefetch(CPU, DefaultStream))
	require.NoError(t, Prefetch(b.Data(), 0, 0, DefaultStream))
	u, err := NewUvector[float32](100, DefaultStream, NewSystemMemoryResource())
	require.NoError(t, err)
	require.NoError(t, u.Prefetch(0, DefaultStream))
	require.NoError(t, u.Span().Prefetch(CPU, DefaultStream))
	if CUDAAvailable() != nil {
		require.NoError(t, Prefetch(b.Data(), 16, 0, DefaultStream))
	}
	pageable := false
	if CUDAAvailable() == nil {
		a, err := Device(0).Attribute(attrPageableMemoryAccess)
		require.NoError(t, err)
		pageable = a != 0
	}
	if !pageable {
		require.Zero(t, calls.Load(), "host memory is not prefetched where the device cannot read it")
	}

	require.NoError(t, b.Close())
	require.ErrorIs(t, b.Prefetch(0, DefaultStream), ErrClosed)
	require.NoError(t, u.Close())
	require.ErrorIs(t, u.Prefetch(0, DefaultStream), ErrClosed)
	require.Equal(t, "CPU", CPU.String())
}
