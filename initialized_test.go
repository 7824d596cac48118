package rmm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// IsInitialized follows what the devices' resources are: false while every device has its initial
// resource, true while one has another (set by hand or by Reinitialize), false again once it is
// restored or torn down.
func TestIsInitialized(t *testing.T) {
	// What an earlier Reinitialize left is torn down first, so that the cleanup's teardown closes
	// only what this test makes.
	require.NoError(t, Reinitialize(&ReinitializeOptions{Devices: []Device{}}))
	n := max(DeviceCount(), 1)
	prevs := make([]MemoryResource, n)
	for d := range n {
		prev, err := SetPerDeviceResource(Device(d), nil)
		require.NoError(t, err)
		prevs[d] = prev
	}
	t.Cleanup(func() {
		require.NoError(t, Reinitialize(&ReinitializeOptions{Devices: []Device{}}))
		for d, prev := range prevs {
			_, err := SetPerDeviceResource(Device(d), prev)
			require.NoError(t, err)
		}
	})
	require.False(t, IsInitialized())
	_, err := PerDeviceResource(0) // looked up: still the initial one
	require.NoError(t, err)
	require.False(t, IsInitialized())

	lim, err := NewLimitingResourceAdaptor(CurrentDeviceResource(), 1<<20, nil)
	require.NoError(t, err)
	SetCurrentDeviceResource(lim)
	require.True(t, IsInitialized())
	require.Equal(t, lim, SetCurrentDeviceResource(nil))
	require.False(t, IsInitialized())

	require.NoError(t, Reinitialize(&ReinitializeOptions{PoolAllocator: true, InitialPoolSize: 2 << 20, Pool: PlainPool}))
	require.True(t, IsInitialized())
	require.NoError(t, Reinitialize(&ReinitializeOptions{Devices: []Device{}})) // tears down only
	require.False(t, IsInitialized())
}
