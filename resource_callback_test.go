package rmm

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// hostCallbackRecorder backs a CallbackMemoryResource with another resource and records calls.
type hostCallbackRecorder struct {
	up       MemoryResource
	mu       sync.Mutex
	allocs   []int
	frees    []DevicePtr
	freeSize []int
	streams  []StreamView
	allocErr error
	retPtr   DevicePtr // when non-zero, returned instead of allocating
}

func (r *hostCallbackRecorder) alloc(n int, s StreamView) (DevicePtr, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.allocs = append(r.allocs, n)
	r.streams = append(r.streams, s)
	if r.allocErr != nil {
		return 0, r.allocErr
	}
	if r.retPtr != 0 {
		return r.retPtr, nil
	}
	return r.up.Allocate(n, s)
}

func (r *hostCallbackRecorder) free(p DevicePtr, n int, s StreamView) error {
	r.mu.Lock()
	r.frees = append(r.frees, p)
	r.freeSize = append(r.freeSize, n)
	r.streams = append(r.streams, s)
	ret := r.retPtr
	r.mu.Unlock()
	if p == ret {
		return nil
	}
	return r.up.Deallocate(p, n, s)
}

func TestCallbackMemoryResourceNilFunctions(t *testing.T) {
	rec := &hostCallbackRecorder{up: NewSystemMemoryResource()}
	for name, c := range map[string]struct {
		a func(int, StreamView) (DevicePtr, error)
		f func(DevicePtr, int, StreamView) error
	}{
		"nil alloc": {nil, rec.free},
		"nil free":  {rec.alloc, nil},
		"both nil":  {nil, nil},
	} {
		mr, err := NewCallbackMemoryResource(c.a, c.f, nil)
		require.ErrorIs(t, err, ErrInvalidArgument, name)
		require.Nil(t, mr, name)
		require.Contains(t, err.Error(), "nil", name)
	}
}

func TestCallbackMemoryResourceForwards(t *testing.T) {
	rec := &hostCallbackRecorder{up: NewSystemMemoryResource()}
	mr, err := NewCallbackMemoryResource(rec.alloc, rec.free, &CallbackOptions{Access: HostAccessible})
	require.NoError(t, err)
	assert.Equal(t, HostAccessible, mr.Access())
	assert.Equal(t, HostAccessible, AccessOf(mr))
	assert.Equal(t, CurrentDevice(), mr.Device())

	st, err := NewStream(0, nil)
	require.NoError(t, err)
	defer st.Close()

	p, err := mr.Allocate(1000, st.View())
	require.NoError(t, err)
	require.NotZero(t, p)
	require.Zero(t, p%Alignment)
	b := hostBytes(p, 1000)
	for i := range b {
		b[i] = byte(i)
	}
	require.Equal(t, byte(999%256), hostBytes(p, 1000)[999])
	require.NoError(t, mr.Deallocate(p, 1000, st.View()))
	assert.Equal(t, []int{1000}, rec.allocs)
	assert.Equal(t, []DevicePtr{p}, rec.frees)
	assert.Equal(t, []int{1000}, rec.freeSize)
	assert.Equal(t, []StreamView{st.View(), st.View()}, rec.streams, "the stream reaches both functions")

	// Zero and negative sizes never reach the functions.
	z, err := mr.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, z)
	require.NoError(t, mr.Deallocate(0, 0, DefaultStream))
	_, err = mr.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, mr.Deallocate(p, -1, DefaultStream), ErrInvalidArgument)
	assert.Len(t, rec.allocs, 1)
	assert.Len(t, rec.frees, 1)

	// The free function's error comes back wrapped: here the system resource sees a double free.
	err = mr.Deallocate(p, 1000, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidFree)
	require.Contains(t, err.Error(), "free function")
}

func TestCallbackMemoryResourceDefaultAccess(t *testing.T) {
	rec := &hostCallbackRecorder{up: NewSystemMemoryResource()}
	mr, err := NewCallbackMemoryResource(rec.alloc, rec.free, nil)
	require.NoError(t, err)
	assert.Equal(t, DeviceAccessible, mr.Access())
}

func TestCallbackMemoryResourceErrors(t *testing.T) {
	rec := &hostCallbackRecorder{up: NewSystemMemoryResource()}
	mr, err := NewCallbackMemoryResource(rec.alloc, rec.free, &CallbackOptions{Access: HostAccessible})
	require.NoError(t, err)

	// An out-of-memory error stays one.
	rec.allocErr = outOfMemory("theirs", 64, nil)
	_, err = mr.Allocate(64, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	// Another error is passed on, wrapped.
	boom := errors.New("boom")
	rec.allocErr = boom
	_, err = mr.Allocate(64, DefaultStream)
	require.ErrorIs(t, err, boom)
	require.NotErrorIs(t, err, ErrOutOfMemory)
	rec.allocErr = nil

	// A null pointer without an error is out of memory.
	rec.retPtr = 0
	nullMR, err := NewCallbackMemoryResource(
		func(int, StreamView) (DevicePtr, error) { return 0, nil },
		func(DevicePtr, int, StreamView) error { return nil }, nil)
	require.NoError(t, err)
	_, err = nullMR.Allocate(10, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)

	// A misaligned pointer is given back to the free function and refused.
	rec.retPtr = 0x1010
	_, err = mr.Allocate(32, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Contains(t, err.Error(), "not aligned")
	require.Equal(t, []DevicePtr{0x1010}, rec.frees)
	require.Equal(t, []int{32}, rec.freeSize)
}

// A pool over a callback resource: the pool's growth goes through the user's functions.
func TestCallbackMemoryResourceAsPoolUpstream(t *testing.T) {
	rec := &hostCallbackRecorder{up: NewSystemMemoryResource()}
	cb, err := NewCallbackMemoryResource(rec.alloc, rec.free, &CallbackOptions{Access: HostAccessible})
	require.NoError(t, err)
	pool, err := NewPoolMemoryResource(cb, &PoolOptions{InitialPoolSize: 1 << 20})
	require.NoError(t, err)
	assert.Equal(t, HostAccessible, AccessOf(pool))
	v, err := NewUvector[int32](1000, DefaultStream, pool)
	require.NoError(t, err)
	require.NoError(t, v.Fill(7, DefaultStream))
	got, err := v.ToSlice(DefaultStream)
	require.NoError(t, err)
	require.Equal(t, int32(7), got[999])
	require.NoError(t, v.Close())
	require.NoError(t, pool.Close())
	assert.Equal(t, []int{1 << 20}, rec.allocs)
	assert.Len(t, rec.frees, 1)
}

// GPU: a callback resource over cuMemAlloc through a CudaMemoryResource.
func TestGPUCallbackOverCuda(t *testing.T) {
	cuda := cudaResource(t)
	var mu sync.Mutex
	live := map[DevicePtr]int{}
	cb, err := NewCallbackMemoryResource(
		func(n int, s StreamView) (DevicePtr, error) {
			p, err := cuda.Allocate(n, s)
			if err == nil {
				mu.Lock()
				live[p] = n
				mu.Unlock()
			}
			return p, err
		},
		func(p DevicePtr, n int, s StreamView) error {
			mu.Lock()
			delete(live, p)
			mu.Unlock()
			return cuda.Deallocate(p, n, s)
		}, nil)
	require.NoError(t, err)
	require.Equal(t, DeviceAccessible, cb.Access())
	s := gpuStream(t)
	v, err := NewUvector[float64](1<<20, s, cb)
	require.NoError(t, err)
	require.Len(t, live, 1)
	require.NoError(t, v.Fill(2.5, s))
	require.NoError(t, v.SetElement(17, -1, s))
	got, err := v.ToSlice(s)
	require.NoError(t, err)
	require.Equal(t, 2.5, got[0])
	require.Equal(t, -1.0, got[17])
	require.Equal(t, 2.5, got[len(got)-1])
	require.NoError(t, v.Close())
	require.Empty(t, live)

	_, err = cb.Allocate(1<<50, s)
	require.ErrorIs(t, err, ErrOutOfMemory, "the driver's out-of-memory error passes through")
}
