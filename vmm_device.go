package rmm

import (
	"sync"
)

// attrVirtualMemoryManagementSupported is CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED.
const attrVirtualMemoryManagementSupported = 102

// vmmGranularityMinimum is CU_MEM_ALLOC_GRANULARITY_MINIMUM.
const vmmGranularityMinimum = 0

// deviceVMM is vmm over the CUDA driver's virtual memory management on one device. Physical
// memory is pinned memory of that device (CU_MEM_ALLOCATION_TYPE_PINNED, located on the device);
// setAccess grants read/write access to that device only. All calls run in the device's primary
// context and none of them is stream-ordered: unmap in particular does not wait for queued work.
//
// On top of the driver's own checks it validates sizes and addresses against the granularity
// (ErrInvalidArgument), and keeps the set of live handles so that mapping or releasing a handle
// it did not create, or one already released, is ErrInvalidArgument rather than the driver's
// undefined behaviour.
type deviceVMM struct {
	dev  Device
	ctx  uintptr
	gran int
	// handleTypes is the CUmemAllocationHandleType bit set create asks for: 0, or
	// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR for an exportable pool (ipc_vmm.go). Set before
	// the first create.
	handleTypes int

	mu      sync.Mutex
	handles map[vmmHandle]int // created and not released: the size in bytes
}

var _ vmm = (*deviceVMM)(nil)

// newDeviceVMM returns the virtual-memory operations of dev. The error wraps ErrNoDevice
// without CUDA, ErrInvalidArgument for a bad ordinal, and ErrNotSupported when the driver lacks
// the VMM functions (CUDA < 10.2) or the device does not support them (attribute 102,
// CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, is 0). The granularity is the
// driver's MINIMUM for pinned memory on dev (cuMemGetAllocationGranularity; 2 MiB on the H200).
func newDeviceVMM(dev Device) (*deviceVMM, error) {
	st, err := dev.state()
	if err != nil {
		return nil, err
	}
	if !cuVMMBound() {
		return nil, errorf("virtual memory management on %s: the CUDA driver lacks the cuMem{AddressReserve,Create,Map,SetAccess,...} functions (CUDA 10.2): %w", dev, ErrNotSupported)
	}
	ok, err := cuDeviceAttribute(st.ord, attrVirtualMemoryManagementSupported)
	if err != nil {
		return nil, errorf("virtual memory management on %s: %w", dev, err)
	}
	if ok != 1 {
		return nil, errorf("%s does not support virtual memory management (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is %d): %w", dev, ok, ErrNotSupported)
	}
	g, err := cuMemGetAllocationGranularity(st.ctx, st.ord, vmmGranularityMinimum)
	if err != nil {
		return nil, errorf("virtual memory management on %s: %w", dev, err)
	}
	if g <= 0 {
		return nil, errorf("%s reports an allocation granularity of %s: %w", dev, bytesText(g), ErrNotSupported)
	}
	return &deviceVMM{dev: dev, ctx: st.ctx, gran: g, handles: map[vmmHandle]int{}}, nil
}

const deviceVMMName = "deviceVMM"

func (v *deviceVMM) granularity() int { return v.gran }

// reserve reserves size bytes of address space aligned to the granularity
// (cuMemAddressReserve); it costs no device memory. A range too large for the address space is
// ErrOutOfMemory.
func (v *deviceVMM) reserve(size int) (DevicePtr, error) {
	if err := vmmCheckSize(deviceVMMName, "reserve", size, v.gran); err != nil {
		return 0, err
	}
	align := 0
	if v.gran&(v.gran-1) == 0 {
		align = v.gran
	}
	p, err := cuMemAddressReserve(v.ctx, size, align)
	if err != nil {
		return 0, errorf("%s.reserve(%d bytes) on %s: %w", deviceVMMName, size, v.dev, err)
	}
	if uintptr(p)%uintptr(v.gran) != 0 {
		_ = cuMemAddressFree(v.ctx, p, size)
		return 0, errorf("%s.reserve(%d bytes) on %s: the driver returned %#x, not aligned to the granularity %d: %w", deviceVMMName, size, v.dev, uintptr(p), v.gran, ErrNotSupported)
	}
	return p, nil
}

func (v *deviceVMM) free(base DevicePtr, size int) error {
	if err := vmmCheckRange(deviceVMMName, "free", base, size, v.gran); err != nil {
		return err
	}
	if err := cuMemAddressFree(v.ctx, base, size); err != nil {
		return errorf("%s.free(%#x, %d bytes) on %s: %w", deviceVMMName, uintptr(base), size, v.dev, err)
	}
	return nil
}

func (v *deviceVMM) create(size int) (vmmHandle, error) {
	if err := vmmCheckSize(deviceVMMName, "create", size, v.gran); err != nil {
		return 0, err
	}
	h, err := cuMemCreate(v.ctx, size, int(v.dev), v.handleTypes)
	if err != nil {
		return 0, errorf("%s.create(%d bytes) on %s: %w", deviceVMMName, size, v.dev, err)
	}
	v.mu.Lock()
	v.handles[vmmHandle(h)] = size
	v.mu.Unlock()
	return vmmHandle(h), nil
}

// mapAt maps handle h at addr (cuMemMap, offset 0). The mutex is held across the driver call so
// that a concurrent release of h cannot pass the driver a released handle.
func (v *deviceVMM) mapAt(addr DevicePtr, size int, h vmmHandle) error {
	if err := vmmCheckRange(deviceVMMName, "mapAt", addr, size, v.gran); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	hs, ok := v.handles[h]
	if !ok {
		return errorf("%s.mapAt(%#x, %s, handle %#x): unknown or released handle: %w", deviceVMMName, uintptr(addr), bytesText(size), uint64(h), ErrInvalidArgument)
	}
	if hs != size {
		return errorf("%s.mapAt(%#x, %s, handle %#x): the handle has %s and a mapping is one whole handle: %w", deviceVMMName, uintptr(addr), bytesText(size), uint64(h), bytesText(hs), ErrInvalidArgument)
	}
	if err := cuMemMap(v.ctx, addr, size, uint64(h)); err != nil {
		return errorf("%s.mapAt(%#x, %s, handle %#x) on %s: %w", deviceVMMName, uintptr(addr), bytesText(size), uint64(h), v.dev, err)
	}
	return nil
}

func (v *deviceVMM) setAccess(addr DevicePtr, size int) error {
	if err := vmmCheckRange(deviceVMMName, "setAccess", addr, size, v.gran); err != nil {
		return err
	}
	if err := cuMemSetAccess(v.ctx, addr, size, int(v.dev)); err != nil {
		return errorf("%s.setAccess(%#x, %d bytes) on %s: %w", deviceVMMName, uintptr(addr), size, v.dev, err)
	}
	return nil
}

func (v *deviceVMM) unmap(addr DevicePtr, size int) error {
	if err := vmmCheckRange(deviceVMMName, "unmap", addr, size, v.gran); err != nil {
		return err
	}
	if err := cuMemUnmap(v.ctx, addr, size); err != nil {
		return errorf("%s.unmap(%#x, %d bytes) on %s: %w", deviceVMMName, uintptr(addr), size, v.dev, err)
	}
	return nil
}

func (v *deviceVMM) release(h vmmHandle) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if _, ok := v.handles[h]; !ok {
		return errorf("%s.release(handle %#x): unknown or already released handle: %w", deviceVMMName, uint64(h), ErrInvalidArgument)
	}
	if err := cuMemRelease(v.ctx, uint64(h)); err != nil {
		return errorf("%s.release(handle %#x) on %s: %w", deviceVMMName, uint64(h), v.dev, err)
	}
	delete(v.handles, h)
	return nil
}
