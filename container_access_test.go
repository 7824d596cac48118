package rmm

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// plainWrapper is a user's resource with only Allocate and Deallocate, over host memory: it
// reports neither its Access nor its upstream, so AccessOf takes its memory as device memory.
type plainWrapper struct{ up MemoryResource }

func (w plainWrapper) Allocate(n int, s StreamView) (DevicePtr, error) { return w.up.Allocate(n, s) }
func (w plainWrapper) Deallocate(p DevicePtr, n int, s StreamView) error {
	return w.up.Deallocate(p, n, s)
}

// plainAdaptor is plainWrapper with an Upstream method: AccessOf asks its upstream.
type plainAdaptor struct{ plainWrapper }

func (w plainAdaptor) Upstream() MemoryResource { return w.up }

// Without CUDA, a container over a resource that does not report its Access fails saying why its
// memory was taken as device memory; the same resource with Upstream works on host memory.
func TestContainerOverResourceWithoutAccess(t *testing.T) {
	if CUDAAvailable() == nil {
		t.Skip("CUDA is available: device memory can be copied to")
	}
	host := NewSystemMemoryResource()
	require.Equal(t, HostAccessible, host.Access())

	_, err := NewUvectorFromSlice([]float32{1, 2, 3}, DefaultStream, plainWrapper{host})
	require.Error(t, err)
	require.True(t, errors.Is(err, ErrNoDevice), "%v", err)
	require.Contains(t, err.Error(), "plainWrapper does not implement Access or Upstream, so its memory is taken as device memory: ")

	v, err := NewUvectorFromSlice([]float32{1, 2, 3}, DefaultStream, plainAdaptor{plainWrapper{host}})
	require.NoError(t, err)
	got, err := v.ToSlice(DefaultStream)
	require.NoError(t, err)
	require.Equal(t, []float32{1, 2, 3}, got)
	require.NoError(t, v.Close())
}
