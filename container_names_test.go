package rmm

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// refusingResource refuses every allocation with ErrOutOfMemory.
type refusingResource struct{}

func (refusingResource) Allocate(n int, _ StreamView) (DevicePtr, error) {
	if n == 0 {
		return 0, nil
	}
	return 0, errorf("refusingResource: %w", ErrOutOfMemory)
}
func (refusingResource) Deallocate(DevicePtr, int, StreamView) error { return nil }
func (refusingResource) Access() Access                              { return HostAccessible }

// Each constructor that builds on another names itself in its errors, not the one it calls.
func TestContainerConstructorsNameThemselves(t *testing.T) {
	check := func(err error, want, not string, sentinel error) {
		t.Helper()
		require.Error(t, err)
		require.True(t, errors.Is(err, sentinel), "%v", err)
		require.True(t, strings.HasPrefix(err.Error(), "rmm: "+want), "%v", err)
		require.NotContains(t, err.Error(), not)
	}
	_, err := NewUvectorFromSlice([]float32{1, 2}, DefaultStream, refusingResource{})
	check(err, "NewUvectorFromSlice[float32](2 elements, 8 bytes): ", "NewUvector[", ErrOutOfMemory)
	_, err = NewUvectorFromSlice([]*int{nil}, DefaultStream, refusingResource{})
	check(err, "NewUvectorFromSlice[*int]: ", "NewUvector[", ErrInvalidArgument)
	_, err = NewScalarWithValue[float64](1, DefaultStream, refusingResource{})
	check(err, "NewScalarWithValue[float64]: ", "NewScalar[", ErrOutOfMemory)
	_, err = NewScalarWithValue[*int](nil, DefaultStream, refusingResource{})
	check(err, "NewScalarWithValue[*int]: ", "NewScalar[", ErrInvalidArgument)
	_, err = NewDeviceBufferFromHost([]byte{1, 2, 3}, DefaultStream, refusingResource{})
	check(err, "NewDeviceBufferFromHost(3 bytes): ", "NewDeviceBuffer(", ErrOutOfMemory)
	_, err = NewDeviceBufferFromDevice(0x1000, 3, DefaultStream, refusingResource{}) // fails before the copy
	check(err, "NewDeviceBufferFromDevice(3 bytes): ", "NewDeviceBuffer(", ErrOutOfMemory)
	_, err = NewHostVectorFromSlice([]*int{nil}, nil)
	check(err, "NewHostVectorFromSlice[*int]: ", "NewHostVector[", ErrInvalidArgument)
}
