package rmm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Without CUDA the adaptor is a pass-through: same sizes, same pointers, same errors.
func TestPrefetchWithoutCUDA(t *testing.T) {
	if CUDAAvailable() == nil {
		t.Skip("CUDA is available: TestGPUPrefetch* cover the adaptor")
	}
	up := newAdpFaultUpstream(newAdpScriptUpstream(0x7700))
	r, err := NewPrefetchResourceAdaptor(up)
	require.NoError(t, err)
	require.False(t, r.Prefetching())
	require.Same(t, up, r.Upstream())
	require.Equal(t, DeviceAccessible, r.Access())
	require.Equal(t, CurrentDevice(), r.Device())
	p := adpAlloc(t, r, 1000)
	require.Equal(t, DevicePtr(0x7700), p)
	adpFree(t, r, p, 1000)
	allocs, frees := up.inner.(*adpScriptUpstream).calls()
	require.Equal(t, []adpCall{{0x7700, 1000}}, allocs)
	require.Equal(t, []adpCall{{0x7700, 1000}}, frees)

	up.failNextAllocs(1, nil)
	_, err = r.Allocate(10, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	_, err = r.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)

	sys, err := NewPrefetchResourceAdaptor(NewSystemMemoryResource())
	require.NoError(t, err)
	q := adpAlloc(t, sys, 4096)
	hostBytes(q, 4096)[4095] = 1
	adpFree(t, sys, q, 4096)
	require.Equal(t, AccessOf(NewSystemMemoryResource()), sys.Access())
}

func TestPrefetchIgnorableErrors(t *testing.T) {
	require.True(t, prefetchIgnorable(&CUDAError{Code: cudaErrorInvalidValue}))
	require.True(t, prefetchIgnorable(&CUDAError{Code: cudaErrorNotSupported}))
	require.False(t, prefetchIgnorable(&CUDAError{Code: cudaErrorIllegalAddress}))
	require.False(t, prefetchIgnorable(ErrInvalidArgument))
}
