package rmm

// CudaMemoryResource allocates device memory with cuMemAlloc and frees it with cuMemFree, one
// driver call per operation, on the device given at construction. The stream is ignored and
// never reaches the driver (a view of a [Stream] that was closed is accepted as any other):
// cuMemAlloc memory is usable on every stream, and cuMemFree synchronises. It is the initial
// resource of every device. All CudaMemoryResources of one device are interchangeable.
type CudaMemoryResource struct {
	dev Device
}

// NewCudaMemoryResource returns a resource over cuMemAlloc on device dev. It returns an error
// wrapping [ErrNoDevice] without CUDA, [ErrInvalidArgument] for a bad ordinal.
func NewCudaMemoryResource(dev Device) (*CudaMemoryResource, error) {
	if _, err := dev.ctx(); err != nil {
		return nil, errorf("NewCudaMemoryResource(%d): %w", dev, err)
	}
	return &CudaMemoryResource{dev: dev}, nil
}

// Allocate returns nbytes of device memory from cuMemAlloc (256-byte aligned; in practice the
// driver aligns to 512 bytes or more).
func (r *CudaMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	return driverAllocate("CudaMemoryResource", r.dev, nbytes, func(ctx uintptr) (DevicePtr, error) {
		return cuMemAlloc(ctx, nbytes)
	})
}

// Deallocate frees p with cuMemFree.
func (r *CudaMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	return driverFree(r.dev, p)
}

// Device returns the resource's device.
func (r *CudaMemoryResource) Device() Device { return r.dev }

// Access reports [DeviceAccessible].
func (r *CudaMemoryResource) Access() Access { return DeviceAccessible }

// ManagedMemoryResource allocates CUDA managed (unified) memory with cuMemAllocManaged
// (CU_MEM_ATTACH_GLOBAL) on the device given at construction; it is usable from the host and
// every device. Freed with cuMemFree, which synchronises; the stream is ignored and never reaches
// the driver (a view of a [Stream] that was closed is accepted as any other).
type ManagedMemoryResource struct {
	dev Device
}

// NewManagedMemoryResource returns a resource over cuMemAllocManaged on device dev. It returns
// [ErrNotSupported] when the device cannot allocate managed memory.
func NewManagedMemoryResource(dev Device) (*ManagedMemoryResource, error) {
	if _, err := dev.ctx(); err != nil {
		return nil, err
	}
	if v, err := dev.Attribute(attrManagedMemory); err != nil {
		return nil, err
	} else if v == 0 {
		return nil, errorf("%s does not support managed memory: %w", dev, ErrNotSupported)
	}
	return &ManagedMemoryResource{dev: dev}, nil
}

// Allocate returns nbytes of managed memory, 256-byte aligned.
func (r *ManagedMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	const cuMemAttachGlobal = 1
	return driverAllocate("ManagedMemoryResource", r.dev, nbytes, func(ctx uintptr) (DevicePtr, error) {
		return cuMemAllocManaged(ctx, nbytes, cuMemAttachGlobal)
	})
}

// Deallocate frees p with cuMemFree.
func (r *ManagedMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	return driverFree(r.dev, p)
}

// Device returns the resource's device.
func (r *ManagedMemoryResource) Device() Device { return r.dev }

// Access reports [HostAccessible]|[DeviceAccessible].
func (r *ManagedMemoryResource) Access() Access { return HostAccessible | DeviceAccessible }

// driverAllocate is the allocate path of the synchronous driver resources: size checks, the
// device's context, one driver call, out-of-memory errors named after the resource.
func driverAllocate(name string, dev Device, nbytes int, alloc func(ctx uintptr) (DevicePtr, error)) (DevicePtr, error) {
	if nbytes <= 0 {
		if nbytes < 0 {
			return 0, invalidSize(name, "Allocate", nbytes)
		}
		return 0, nil
	}
	ctx, err := dev.ctx()
	if err != nil {
		return 0, err
	}
	p, err := alloc(ctx)
	if err != nil {
		if isOOM(err) {
			return 0, outOfMemory(name, nbytes, err)
		}
		return 0, errorf("%s: allocating %s: %w", name, bytesText(nbytes), err)
	}
	return p, nil
}

// driverFree frees p with cuMemFree in dev's context.
func driverFree(dev Device, p DevicePtr) error {
	if p == 0 {
		return nil
	}
	ctx, err := dev.ctx()
	if err != nil {
		return err
	}
	return cuMemFree(ctx, p)
}

// isOOM reports whether err is an out-of-memory condition (CUDA_ERROR_OUT_OF_MEMORY: what
// cuMemAlloc, cuMemAllocManaged and cuMemAllocFromPoolAsync return for a size beyond the
// device's memory).
func isOOM(err error) bool {
	return errIs(err, ErrOutOfMemory)
}
