package rmm

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestNoDeviceBehaviour(t *testing.T) {
	if CUDAAvailable() == nil {
		t.Skip("a CUDA device is present")
	}
	err := CUDAAvailable()
	require.ErrorIs(t, err, ErrNoDevice)
	if cgoEnabled {
		require.Contains(t, err.Error(), "cannot load the CUDA driver: libcuda.so.1")
	} else {
		require.Contains(t, err.Error(), "built without cgo (CGO_ENABLED=0)")
	}
	require.Zero(t, DeviceCount())
	require.Equal(t, Device(0), CurrentDevice())
	require.NoError(t, SetCurrentDevice(0))
	require.ErrorIs(t, SetCurrentDevice(1), ErrInvalidArgument)
	name, err := Device(0).Name()
	require.NoError(t, err)
	require.Equal(t, "host", name)
	// Device 0 is the host: its memory figures are the host's.
	free, total, err := AvailableDeviceMemory()
	require.NoError(t, err)
	require.Greater(t, total, 1<<20)
	require.Greater(t, free, 0)
	require.LessOrEqual(t, free, total)
	total2, err := Device(0).TotalMemory()
	require.NoError(t, err)
	require.Equal(t, total, total2)
	pct, err := PercentOfFreeDeviceMemory(50)
	require.NoError(t, err)
	require.Zero(t, pct%256)
	require.Greater(t, pct, 0)
	_, _, err = Device(1).MemoryInfo()
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = DriverVersion()
	require.ErrorIs(t, err, ErrNoDevice)
	_, err = NewCudaMemoryResource(0)
	require.ErrorIs(t, err, ErrNoDevice)
	_, err = NewManagedMemoryResource(0)
	require.ErrorIs(t, err, ErrNoDevice)
	_, err = NewCudaAsyncMemoryResource(0, nil)
	require.ErrorIs(t, err, ErrNoDevice)
	_, err = NewStreamView(0, 0x1234)
	require.ErrorIs(t, err, ErrNoDevice)
	require.NoError(t, Device(0).Synchronize())
	_, ok := CurrentDeviceResource().(*SystemMemoryResource)
	require.True(t, ok, "the initial resource without CUDA is host memory")
	require.Equal(t, HostAccessible, AccessOf(CurrentDeviceResource()))
}

func TestPercentOfFreeDeviceMemoryRange(t *testing.T) {
	for _, p := range []int{-1, 101} {
		_, err := PercentOfFreeDeviceMemory(p)
		require.ErrorIs(t, err, ErrInvalidArgument)
	}
}

func TestPerDeviceResource(t *testing.T) {
	initial, err := PerDeviceResource(0)
	require.NoError(t, err)
	require.Same(t, initial, CurrentDeviceResource())
	sim, _ := NewSimulatedMemoryResource(1 << 20)
	old := SetCurrentDeviceResource(sim)
	require.Same(t, initial, old)
	require.Same(t, sim, CurrentDeviceResource())
	got, err := PerDeviceResource(0)
	require.NoError(t, err)
	require.Same(t, sim, got)
	require.Same(t, sim, resourceOrCurrent(nil))
	old, err = SetPerDeviceResource(0, nil) // restores the initial resource
	require.NoError(t, err)
	require.Same(t, sim, old)
	require.IsType(t, initial, CurrentDeviceResource())
	_, err = PerDeviceResource(Device(DeviceCount() + 5))
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = SetPerDeviceResource(-1, sim)
	require.ErrorIs(t, err, ErrInvalidArgument)
	SetCurrentDeviceResource(initial)
}

// Setting and getting the current resource from many goroutines stays consistent.
func TestCurrentResourceConcurrent(t *testing.T) {
	initial := CurrentDeviceResource()
	defer SetCurrentDeviceResource(initial)
	res := make([]MemoryResource, 8)
	for i := range res {
		res[i], _ = NewSimulatedMemoryResource(i + 1)
	}
	done := make(chan bool)
	for i := range res {
		go func(mr MemoryResource) {
			for j := 0; j < 1000; j++ {
				SetCurrentDeviceResource(mr)
				got := CurrentDeviceResource()
				found := false
				for _, r := range res {
					if r == got {
						found = true
					}
				}
				if !found {
					done <- false
					return
				}
			}
			done <- true
		}(res[i])
	}
	for range res {
		require.True(t, <-done)
	}
}

func TestStreams(t *testing.T) {
	require.True(t, DefaultStream.IsDefault())
	require.Zero(t, DefaultStream.ID())
	require.Equal(t, "DefaultStream", DefaultStream.String())
	require.Equal(t, StreamView{}, DefaultStream)
	a, err := NewStream(0, nil)
	require.NoError(t, err)
	b, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	require.NotEqual(t, a.View(), b.View())
	require.Equal(t, a.View(), a.View(), "views are comparable values")
	require.False(t, a.View().IsDefault())
	require.True(t, a.View().lifetimeKnown())
	require.Equal(t, Device(0), a.Device())
	require.Contains(t, a.View().String(), "Stream#")
	require.NoError(t, a.Synchronize())
	done, err := a.View().Query()
	require.NoError(t, err)
	require.True(t, done)
	require.NoError(t, a.Close())
	require.NoError(t, a.Close(), "closing twice is fine")
	require.NoError(t, b.Close())
	_, err = NewStream(7, nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	// A view of a closed stream is no longer known: a pool records events for it at every free.
	require.False(t, addStreamCloseHook(a.View(), nil))
}

func TestStreamPool(t *testing.T) {
	_, err := NewStreamPool(0, 0, nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	p, err := NewStreamPool(0, 3, nil)
	require.NoError(t, err)
	defer p.Close()
	require.Equal(t, 3, p.Size())
	seen := []StreamView{p.Get(), p.Get(), p.Get()}
	require.Equal(t, seen[0], p.Get(), "round robin")
	require.NotEqual(t, seen[0], seen[1])
	require.NotEqual(t, seen[1], seen[2])
	for i := 0; i < 3; i++ {
		require.Equal(t, seen[i], p.GetIndexed(i))
		require.Equal(t, seen[i], p.GetIndexed(i+3), "modulo")
	}
	require.Equal(t, seen[2], p.GetIndexed(-1))
}

func TestEvents(t *testing.T) {
	e, err := NewEvent(0, nil)
	require.NoError(t, err)
	require.NoError(t, e.Record(DefaultStream))
	require.NoError(t, DefaultStream.WaitEvent(e))
	require.NoError(t, e.Synchronize())
	done, err := e.Query()
	require.NoError(t, err)
	require.True(t, done)
	require.NoError(t, e.Close())
	require.NoError(t, e.Close())
	if CUDAAvailable() == nil {
		require.ErrorIs(t, e.Record(DefaultStream), ErrClosed)
	}
	require.ErrorIs(t, DefaultStream.WaitEvent(nil), ErrInvalidArgument)
}

func TestCUDAErrorIs(t *testing.T) {
	oom := &CUDAError{Op: "cuMemAlloc_v2", Code: 2, Name: "CUDA_ERROR_OUT_OF_MEMORY", Message: "out of memory"}
	require.ErrorIs(t, oom, ErrOutOfMemory)
	require.NotErrorIs(t, oom, ErrNoDevice)
	require.Equal(t, "rmm: cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory", oom.Error())
	nodev := &CUDAError{Code: 100}
	require.ErrorIs(t, nodev, ErrNoDevice)
	wrapped := outOfMemory("X", 1<<50, oom)
	require.ErrorIs(t, wrapped, ErrOutOfMemory)
	var ce *CUDAError
	require.True(t, errors.As(wrapped, &ce))
	require.Equal(t, 2, ce.Code)
	require.Contains(t, wrapped.Error(), "rmm: X.Allocate: failed to allocate 1125899906842624 bytes (1 PiB): out of memory: cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory")
}

func TestAlign(t *testing.T) {
	n, ok := AlignUp(1, 256)
	require.True(t, ok)
	require.Equal(t, 256, n)
	n, _ = AlignUp(512, 256)
	require.Equal(t, 512, n)
	_, ok = AlignUp(int(^uint(0)>>1), 256)
	require.False(t, ok, "overflow is reported, not wrapped")
	require.Equal(t, 256, AlignDown(511, 256))
	require.True(t, IsPowerOfTwo(4096))
	require.False(t, IsPowerOfTwo(768))
	require.False(t, IsPowerOfTwo(0))
}

func TestSimulatedMemoryResource(t *testing.T) {
	_, err := NewSimulatedMemoryResource(-1)
	require.ErrorIs(t, err, ErrInvalidArgument)
	r, err := NewSimulatedMemoryResource(1024)
	require.NoError(t, err)
	require.Equal(t, Access(0), r.Access())
	a, err := r.Allocate(1000, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, a%256)
	require.Equal(t, 1024, r.UsedBytes())
	_, err = r.Allocate(1, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.True(t, r.Contains(a+10, 100))
	require.False(t, r.Contains(a+1000, 100))
	require.ErrorIs(t, r.Deallocate(a, 999, DefaultStream), ErrInvalidFree)
	require.NoError(t, r.Deallocate(a, 1000, DefaultStream))
	require.ErrorIs(t, r.Deallocate(a, 1000, DefaultStream), ErrInvalidFree)
	b, err := r.Allocate(1024, DefaultStream)
	require.NoError(t, err)
	require.NotEqual(t, a, b, "addresses are never reused")
	_, err = r.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Equal(t, 1024, r.Capacity())
}

func TestSystemMemoryResource(t *testing.T) {
	r := NewSystemMemoryResource()
	require.NotZero(t, r.Access()&HostAccessible)
	p, err := r.Allocate(1000, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, p%256)
	b := hostBytes(p, 1000)
	for i := range b {
		b[i] = byte(i)
	}
	require.Equal(t, byte(231), b[999])
	require.ErrorIs(t, r.Deallocate(p, 999, DefaultStream), ErrInvalidFree, "wrong size")
	require.ErrorIs(t, r.Deallocate(p+256, 1000, DefaultStream), ErrInvalidFree, "interior pointer")
	require.Equal(t, byte(231), b[999], "an invalid free frees nothing")
	require.NoError(t, r.Deallocate(p, 1000, DefaultStream))
	require.ErrorIs(t, r.Deallocate(p, 1000, DefaultStream), ErrInvalidFree, "double free")
	z, err := r.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, z)
	_, err = r.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
}

func TestAccessAndDeviceOf(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 20)
	pool, err := NewPoolMemoryResource(sim, nil)
	require.NoError(t, err)
	require.Equal(t, Access(0), AccessOf(pool), "a pool reports its upstream's access")
	require.Equal(t, CurrentDevice(), DeviceOf(pool))
	require.Equal(t, DeviceAccessible, AccessOf(struct{ MemoryResource }{sim}), "unknown resources are assumed to be device memory")
	require.Equal(t, "host+device", (HostAccessible | DeviceAccessible).String())
}

// Addresses are never reused, so the range can run out: that is out of memory, not a wrap.
func TestSimulatedAddressRangeEnd(t *testing.T) {
	r, _ := NewSimulatedMemoryResource(int(^uint(0) >> 1))
	var last DevicePtr
	for i := 0; ; i++ {
		p, err := r.Allocate(1<<62, DefaultStream)
		if err != nil {
			require.ErrorIs(t, err, ErrOutOfMemory)
			require.Contains(t, err.Error(), "address range")
			break
		}
		require.Greater(t, p, last)
		last = p
		require.NoError(t, r.Deallocate(p, 1<<62, DefaultStream))
		require.Less(t, i, 8)
	}
}

func TestCopyFromClosedScalar(t *testing.T) {
	sc, err := NewScalarWithValue[int32](42, DefaultStream, nil)
	require.NoError(t, err)
	require.NoError(t, sc.Close())
	v, err := NewUvector[int32](1, DefaultStream, nil)
	require.NoError(t, err)
	defer v.Close()
	require.ErrorIs(t, v.CopyFrom(sc, DefaultStream), ErrClosed)
}
