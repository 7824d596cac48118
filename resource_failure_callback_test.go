package rmm

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// adpAlwaysFails fails every allocation with err.
type adpAlwaysFails struct {
	err   error
	calls atomic.Int64
}

func (u *adpAlwaysFails) Allocate(n int, s StreamView) (DevicePtr, error) {
	u.calls.Add(1)
	return 0, u.err
}

func (u *adpAlwaysFails) Deallocate(DevicePtr, int, StreamView) error { return nil }

// adpRetryOnce asks for one retry, then gives up (librmm's failure_handler).
func adpRetryOnce(calls *[]int) FailureCallback {
	return func(nbytes int, err error) bool {
		*calls = append(*calls, nbytes)
		return len(*calls) == 1
	}
}

func TestFailureCallbackOptions(t *testing.T) {
	_, err := NewFailureCallbackResourceAdaptor(nil, nil, nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	r, err := NewFailureCallbackResourceAdaptor(nil, func(int, error) bool { return false }, nil)
	require.NoError(t, err)
	require.Same(t, CurrentDeviceResource(), r.Upstream())
	require.Equal(t, AccessOf(CurrentDeviceResource()), r.Access())
	require.Equal(t, CurrentDevice(), r.Device())
}

// librmm's RetryAllocationOnce: the callback asks for a retry, then gives up; the upstream's
// error comes back unchanged.
func TestFailureCallbackRetryThenGiveUp(t *testing.T) {
	oom := outOfMemory("adpAlwaysFails", 1<<20, nil)
	up := &adpAlwaysFails{err: oom}
	var calls []int
	r, err := NewFailureCallbackResourceAdaptor(up, adpRetryOnce(&calls), nil)
	require.NoError(t, err)
	_, err = r.Allocate(1<<20, DefaultStream)
	require.Same(t, oom, err)
	require.Equal(t, []int{1 << 20, 1 << 20}, calls)
	require.Equal(t, int64(2), up.calls.Load())
}

// The use it was made for: the callback frees memory (spills) and the retry succeeds.
func TestFailureCallbackSpillAndRetry(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 20)
	var spill []DevicePtr
	for range 4 {
		p, err := sim.Allocate(256<<10, DefaultStream)
		require.NoError(t, err)
		spill = append(spill, p)
	}
	var calls atomic.Int64
	r, err := NewFailureCallbackResourceAdaptor(sim, func(nbytes int, err error) bool {
		calls.Add(1)
		if len(spill) == 0 {
			return false
		}
		p := spill[len(spill)-1]
		spill = spill[:len(spill)-1]
		return sim.Deallocate(p, 256<<10, DefaultStream) == nil
	}, nil)
	require.NoError(t, err)
	p, err := r.Allocate(600<<10, DefaultStream)
	require.NoError(t, err)
	require.NotZero(t, p)
	require.Equal(t, int64(3), calls.Load(), "three blocks of 256 KiB spilled to fit 600 KiB")
	require.Len(t, spill, 1)
	require.NoError(t, r.Deallocate(p, 600<<10, DefaultStream))
	require.Equal(t, 256<<10, sim.UsedBytes())
}

// librmm's DifferentExceptionTypes: only the errors the adaptor catches reach the callback;
// others pass through untouched. Catch chooses another kind.
func TestFailureCallbackFiltersErrors(t *testing.T) {
	other := errors.New("not a memory error")
	up := &adpAlwaysFails{err: other}
	var calls []int
	r, err := NewFailureCallbackResourceAdaptor(up, adpRetryOnce(&calls), nil)
	require.NoError(t, err)
	_, err = r.Allocate(100, DefaultStream)
	require.Same(t, other, err)
	require.Empty(t, calls, "an error that is not ErrOutOfMemory is not caught")
	require.Equal(t, int64(1), up.calls.Load())

	// A *CUDAError for CUDA_ERROR_OUT_OF_MEMORY is caught by default (errors.Is).
	cudaOOM := &CUDAError{Op: "cuMemAlloc_v2", Code: cudaErrorOutOfMemory, Name: "CUDA_ERROR_OUT_OF_MEMORY"}
	calls = nil
	r, err = NewFailureCallbackResourceAdaptor(&adpAlwaysFails{err: cudaOOM}, adpRetryOnce(&calls), nil)
	require.NoError(t, err)
	_, err = r.Allocate(100, DefaultStream)
	require.Same(t, cudaOOM, err)
	require.Len(t, calls, 2)

	// Catch: retry on any error.
	calls = nil
	r, err = NewFailureCallbackResourceAdaptor(&adpAlwaysFails{err: other}, adpRetryOnce(&calls), &FailureCallbackOptions{Catch: func(error) bool { return true }})
	require.NoError(t, err)
	_, err = r.Allocate(100, DefaultStream)
	require.Same(t, other, err)
	require.Len(t, calls, 2)

	// Catch: only errors it names; out of memory then passes through.
	calls = nil
	r, err = NewFailureCallbackResourceAdaptor(&adpAlwaysFails{err: outOfMemory("x", 1, nil)}, adpRetryOnce(&calls),
		&FailureCallbackOptions{Catch: func(err error) bool { return errors.Is(err, other) }})
	require.NoError(t, err)
	_, err = r.Allocate(100, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Empty(t, calls)
}

// Sizes and pointers pass through unchanged (librmm's ForwardsAlignment); negative sizes are
// refused before the upstream.
func TestFailureCallbackForwards(t *testing.T) {
	up := newAdpScriptUpstream(0x12300)
	r, err := NewFailureCallbackResourceAdaptor(up, func(int, error) bool { t.Error("callback called"); return false }, nil)
	require.NoError(t, err)
	p := adpAlloc(t, r, 1024)
	require.Equal(t, DevicePtr(0x12300), p)
	adpFree(t, r, p, 1024)
	allocs, frees := up.calls()
	require.Equal(t, []adpCall{{0x12300, 1024}}, allocs)
	require.Equal(t, []adpCall{{0x12300, 1024}}, frees)
	_, err = r.Allocate(-5, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	allocs, _ = up.calls()
	require.Len(t, allocs, 1)
}

// The callback runs on each failing goroutine; with a retry budget shared by all, every
// allocation either succeeds or gives up, and none is lost.
func TestFailureCallbackConcurrent(t *testing.T) {
	up := newAdpFaultUpstream(newAdpScriptUpstream())
	up.failNextAllocs(50, nil)
	var retries atomic.Int64
	r, err := NewFailureCallbackResourceAdaptor(up, func(int, error) bool { retries.Add(1); return true }, nil)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				p, err := r.Allocate(512, DefaultStream)
				if err != nil {
					t.Error(err)
					return
				}
				if err := r.Deallocate(p, 512, DefaultStream); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	require.Equal(t, int64(50), retries.Load())
	allocs, _ := up.callCounts()
	require.Equal(t, 850, allocs)
}
