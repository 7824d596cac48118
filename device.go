package rmm

import (
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"
)

// Device is a CUDA device ordinal. On a machine with no usable CUDA device the package runs on
// host memory and Device(0) stands for the host.
type Device int

// CUdevice_attribute values used by the package.
const (
	attrMultiprocessorCount     = 16
	attrUnifiedAddressing       = 41
	attrComputeCapabilityMajor  = 75
	attrComputeCapabilityMinor  = 76
	attrManagedMemory           = 83
	attrPageableMemoryAccess    = 88
	attrConcurrentManagedAccess = 89
	attrMemoryPoolsSupported    = 115
)

var (
	driverOnce   sync.Once
	driverErr    error // nil when a CUDA device is usable
	driverLoaded bool  // libcuda.so.1 was opened and bound
	deviceCount  int
	devStates    []*deviceState
	currentDev   atomic.Int64
)

// deviceState is what the package keeps per device: its primary context, retained once.
type deviceState struct {
	ord     int
	once    sync.Once
	ctx     uintptr
	err     error
	smCount int

	kernelsOnce sync.Once
	kernels     *kernelSet
	kernelsErr  error
}

// initDriver loads the driver and initialises CUDA once per process.
func initDriver() error {
	driverOnce.Do(func() {
		if !cgoEnabled {
			driverErr = errorf("built without cgo (CGO_ENABLED=0), so the CUDA driver cannot be loaded: %w", ErrNoDevice)
			return
		}
		if why := loadDriver(); why != "" {
			driverErr = errorf("%s: %w", why, ErrNoDevice)
			return
		}
		driverLoaded = true
		if err := cuInit(); err != nil {
			driverErr = errorf("cuInit failed: %w: %w", err, ErrNoDevice)
			return
		}
		n, err := cuDeviceCount()
		if err != nil {
			driverErr = errorf("%w: %w", err, ErrNoDevice)
			return
		}
		if n == 0 {
			driverErr = errorf("the driver reports no CUDA-capable device: %w", ErrNoDevice)
			return
		}
		deviceCount = n
		devStates = make([]*deviceState, n)
		for i := range devStates {
			devStates[i] = &deviceState{ord: i}
		}
	})
	return driverErr
}

// CUDAAvailable returns nil when the CUDA driver is loaded and at least one device is present;
// otherwise an error wrapping [ErrNoDevice] that says why (libcuda.so.1 missing, no device, driver
// too old, built without cgo). The package then runs on host memory.
func CUDAAvailable() error { return initDriver() }

// DriverVersion returns the CUDA driver's version as 1000*major + 10*minor (13000 for 13.0).
func DriverVersion() (int, error) {
	if err := initDriver(); err != nil {
		return 0, err
	}
	return cuDriverVersion()
}

// DeviceCount returns the number of CUDA devices, 0 when CUDA is unavailable.
func DeviceCount() int {
	if initDriver() != nil {
		return 0
	}
	return deviceCount
}

// CurrentDevice returns the process-wide current device (0 until [SetCurrentDevice]). Go has no
// goroutine-local state, so unlike cudaSetDevice this is shared by all goroutines; resources,
// streams and containers record their device when they are made and use it from then on.
func CurrentDevice() Device { return Device(currentDev.Load()) }

// SetCurrentDevice makes d the process-wide current device. It returns [ErrInvalidArgument] for an
// ordinal that does not exist (on a machine without CUDA only [Device](0), the host, exists).
func SetCurrentDevice(d Device) error {
	if err := d.check(); err != nil {
		return errorf("SetCurrentDevice: %w", err)
	}
	currentDev.Store(int64(d))
	return nil
}

// check validates the ordinal.
func (d Device) check() error {
	n := DeviceCount()
	if n == 0 {
		if d == 0 {
			return nil
		}
		return errorf("device %d does not exist (no CUDA device; only device 0, the host, is available): %w", int(d), ErrInvalidArgument)
	}
	if d < 0 || int(d) >= n {
		return errorf("device %d does not exist (%d CUDA devices): %w", int(d), n, ErrInvalidArgument)
	}
	return nil
}

// state returns the device's retained primary context, retaining it on first use. The error
// wraps ErrNoDevice without CUDA and ErrInvalidArgument for a bad ordinal.
func (d Device) state() (*deviceState, error) {
	if err := initDriver(); err != nil {
		return nil, err
	}
	if err := d.check(); err != nil {
		return nil, err
	}
	st := devStates[d]
	st.once.Do(func() {
		st.ctx, st.err = cuPrimaryCtxRetain(st.ord)
		if st.err == nil {
			st.smCount, _ = cuDeviceAttribute(st.ord, attrMultiprocessorCount)
			if st.smCount <= 0 {
				st.smCount = 1
			}
		}
	})
	return st, st.err
}

// ctx returns the device's primary context.
func (d Device) ctx() (uintptr, error) {
	st, err := d.state()
	if err != nil {
		return 0, err
	}
	return st.ctx, nil
}

// Name returns the device's name, e.g. "NVIDIA H200", or "host" without CUDA.
func (d Device) Name() (string, error) {
	if err := d.check(); err != nil {
		return "", errorf("Device.Name: %w", err)
	}
	if initDriver() != nil {
		return "host", nil
	}
	return cuDeviceName(int(d))
}

// Attribute returns a CUdevice_attribute value (CUDA's numbering).
func (d Device) Attribute(attr int) (int, error) {
	if err := initDriver(); err != nil {
		return 0, err
	}
	if err := d.check(); err != nil {
		return 0, errorf("Device.Attribute: %w", err)
	}
	return cuDeviceAttribute(int(d), attr)
}

// ComputeCapability returns the device's major and minor compute capability (9, 0 on an H200).
func (d Device) ComputeCapability() (major, minor int, err error) {
	if major, err = d.Attribute(attrComputeCapabilityMajor); err != nil {
		return 0, 0, err
	}
	minor, err = d.Attribute(attrComputeCapabilityMinor)
	return major, minor, err
}

// TotalMemory returns the device's memory in bytes (cuDeviceTotalMem). Without CUDA, [Device](0)
// is the host and this is the host's memory (MemTotal on Linux; elsewhere an error wrapping
// [ErrNoDevice]).
func (d Device) TotalMemory() (int, error) {
	if err := d.check(); err != nil {
		return 0, errorf("Device.TotalMemory: %w", err)
	}
	if err := initDriver(); err != nil {
		_, total, herr := hostMemoryInfo()
		if herr != nil {
			return 0, errorf("%w (and %v)", err, herr)
		}
		return total, nil
	}
	return cuDeviceTotalMem(int(d))
}

// MemoryInfo returns the free and total bytes of the device (cuMemGetInfo in its primary
// context). Without CUDA, [Device](0) is the host and these are the host's available and total
// memory (MemAvailable and MemTotal on Linux; elsewhere an error wrapping [ErrNoDevice]).
func (d Device) MemoryInfo() (free, total int, err error) {
	if err := d.check(); err != nil {
		return 0, 0, errorf("Device.MemoryInfo: %w", err)
	}
	if err := initDriver(); err != nil {
		free, total, herr := hostMemoryInfo()
		if herr != nil {
			return 0, 0, errorf("%w (and %v)", err, herr)
		}
		return free, total, nil
	}
	ctx, err := d.ctx()
	if err != nil {
		return 0, 0, err
	}
	return cuMemGetInfo(ctx)
}

// Synchronize waits until all work queued on the device is done (cuCtxSynchronize). Without CUDA
// it returns nil at once: host work is synchronous.
func (d Device) Synchronize() error {
	if initDriver() != nil {
		if err := d.check(); err != nil {
			return errorf("Device.Synchronize: %w", err)
		}
		return nil
	}
	ctx, err := d.ctx()
	if err != nil {
		return err
	}
	return cuCtxSynchronize(ctx)
}

func (d Device) String() string {
	if d == CPU {
		return "CPU"
	}
	return fmt.Sprintf("device %d", int(d))
}

// AvailableDeviceMemory returns the free and total bytes of the current device, as
// rmm::available_device_memory. Without CUDA these are the host's (see [Device.MemoryInfo]).
func AvailableDeviceMemory() (free, total int, err error) {
	return CurrentDevice().MemoryInfo()
}

// PercentOfFreeDeviceMemory returns percent% of the current device's free memory, rounded down
// to a multiple of 256 bytes, as rmm::percent_of_free_device_memory. percent must be in 0..100.
// Without CUDA it is a percentage of the host's available memory.
func PercentOfFreeDeviceMemory(percent int) (int, error) {
	if percent < 0 || percent > 100 {
		return 0, errorf("PercentOfFreeDeviceMemory: percent %d is outside 0..100: %w", percent, ErrInvalidArgument)
	}
	free, _, err := AvailableDeviceMemory()
	if err != nil {
		return 0, err
	}
	return AlignDown(int(float64(free)*float64(percent)/100), Alignment), nil
}

// ---- current and per-device resources ----

var (
	resMu       sync.RWMutex
	perDevice   = map[Device]MemoryResource{}
	initialOnce sync.Once
	initialHost MemoryResource
	initialMu   sync.Mutex
	initialCuda = map[Device]*CudaMemoryResource{}
)

// initialResource is the resource a device has before anything is set: a CudaMemoryResource for
// the device, or, without CUDA, one process-wide SystemMemoryResource. The same value at every
// call, so that IsInitialized can tell it from a resource that was set.
func initialResource(d Device) MemoryResource {
	if CUDAAvailable() != nil {
		initialOnce.Do(func() { initialHost = NewSystemMemoryResource() })
		return initialHost
	}
	initialMu.Lock()
	defer initialMu.Unlock()
	mr, ok := initialCuda[d]
	if !ok {
		mr = &CudaMemoryResource{dev: d}
		initialCuda[d] = mr
	}
	return mr
}

// IsInitialized reports whether some device has a resource other than its initial one (a
// [CudaMemoryResource]; a [SystemMemoryResource] without CUDA): one installed by [Reinitialize], or set
// with [SetPerDeviceResource] or [SetCurrentDeviceResource] and not restored since. As RMM's
// is_initialized, it tells a program whether something set up the memory resources before it.
func IsInitialized() bool {
	resMu.RLock()
	defer resMu.RUnlock()
	for d, mr := range perDevice {
		if mr != initialResource(d) {
			return true
		}
	}
	return false
}

// PerDeviceResource returns the resource set for device d, or its initial resource (a
// [CudaMemoryResource]; a [SystemMemoryResource] without CUDA), which is then recorded. Safe for
// concurrent use.
func PerDeviceResource(d Device) (MemoryResource, error) {
	if err := d.check(); err != nil {
		return nil, errorf("PerDeviceResource: %w", err)
	}
	resMu.RLock()
	mr, ok := perDevice[d]
	resMu.RUnlock()
	if ok {
		return mr, nil
	}
	resMu.Lock()
	defer resMu.Unlock()
	if mr, ok = perDevice[d]; !ok {
		mr = initialResource(d)
		perDevice[d] = mr
	}
	return mr, nil
}

// SetPerDeviceResource makes mr the resource of device d and returns the previous one. A nil mr
// restores the initial resource. Set it before allocating on d: memory from the previous resource
// must still be freed through that resource.
func SetPerDeviceResource(d Device, mr MemoryResource) (MemoryResource, error) {
	if err := d.check(); err != nil {
		return nil, errorf("SetPerDeviceResource: %w", err)
	}
	if mr == nil {
		mr = initialResource(d)
	}
	resMu.Lock()
	defer resMu.Unlock()
	old, ok := perDevice[d]
	if !ok {
		old = initialResource(d)
	}
	perDevice[d] = mr
	return old, nil
}

// CurrentDeviceResource returns the resource of the current device ([PerDeviceResource] of
// [CurrentDevice]()).
func CurrentDeviceResource() MemoryResource {
	mr, err := PerDeviceResource(CurrentDevice())
	if err != nil {
		// The current device was validated when it was set, so this cannot fail.
		panic(err)
	}
	return mr
}

// SetCurrentDeviceResource makes mr the resource of the current device and returns the previous
// one; nil restores the initial resource.
func SetCurrentDeviceResource(mr MemoryResource) MemoryResource {
	old, err := SetPerDeviceResource(CurrentDevice(), mr)
	if err != nil {
		panic(err)
	}
	return old
}

// resourceOrCurrent resolves a nil resource argument to the current device resource.
func resourceOrCurrent(mr MemoryResource) MemoryResource {
	if mr == nil {
		return CurrentDeviceResource()
	}
	return mr
}

// upstreamOf resolves the upstream argument of the constructor op of an adaptor or
// sub-allocator: nil means the current device resource, read once, here; a nil pointer (or other
// nil value) inside a non-nil interface is refused, because every call through the adaptor would
// panic on it, far from the mistake.
func upstreamOf(op string, upstream MemoryResource) (MemoryResource, error) {
	if upstream == nil {
		return CurrentDeviceResource(), nil
	}
	switch v := reflect.ValueOf(upstream); v.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan, reflect.Interface:
		if v.IsNil() {
			return nil, errorf("%s: upstream is a nil %T: %w", op, upstream, ErrInvalidArgument)
		}
	}
	return upstream, nil
}
