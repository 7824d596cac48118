package rmmtest

import (
	"strings"
	"testing"

	"github.com/gormm/rmm"
	"github.com/stretchr/testify/require"
)

// silentWrapper wraps its upstream with Allocate and Deallocate only: rmm.AccessOf takes its
// memory as device memory.
type silentWrapper struct{ up rmm.MemoryResource }

func (w silentWrapper) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	return w.up.Allocate(n, s)
}
func (w silentWrapper) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	return w.up.Deallocate(p, n, s)
}

// silentAdaptor is silentWrapper with Upstream: its memory is its upstream's, host memory here.
type silentAdaptor struct{ silentWrapper }

func (w silentAdaptor) Upstream() rmm.MemoryResource { return w.up }

// runAlignment runs the Alignment check alone on a recorder, over host memory.
func runAlignment(t *testing.T, build buildFunc) *recorder {
	t.Helper()
	c, err := resolve(&Options{Upstream: system, Seed: 1})
	require.NoError(t, err)
	root := newRecorder("T")
	s := &suite{cfg: c, build: build}
	root.run(func(tb tester) { tb.Run("Alignment", s.testAlignment) })
	return root.find("Alignment")
}

// Without CUDA, a wrapper that reports neither Access nor Upstream passes, and the suite logs
// that it took its memory as device memory (so that the checks of host memory were not made);
// with Upstream it logs nothing of the kind.
func TestAlignmentLogsAssumedDeviceMemory(t *testing.T) {
	if rmm.CUDAAvailable() == nil {
		t.Skip("CUDA is available: device memory is what the suite assumes")
	}
	const want = "rmmtest: rmmtest.silentWrapper implements neither Access (rmm.Accessible) nor Upstream (rmm.Upstreamer), so rmm.AccessOf takes its memory as device memory and the checks of host memory are not made"
	r := runAlignment(t, func(_ tester, up rmm.MemoryResource) rmm.MemoryResource { return silentWrapper{up} })
	require.NotNil(t, r)
	require.False(t, r.Failed(), "%v", r.msgs)
	require.Len(t, r.logs, 1)
	require.True(t, strings.HasPrefix(r.logs[0], want), r.logs[0])

	r = runAlignment(t, func(_ tester, up rmm.MemoryResource) rmm.MemoryResource { return silentAdaptor{silentWrapper{up}} })
	require.NotNil(t, r)
	require.False(t, r.Failed(), "%v", r.msgs)
	require.Empty(t, r.logs)
}
