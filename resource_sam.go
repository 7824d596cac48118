package rmm

// CUmem_advise and CUmemLocationType values.
const (
	memAdviseSetPreferredLocation = 3
	memLocationTypeDevice         = 1
	memLocationTypeHost           = 2
)

// SamHeadroomMemoryResource allocates system memory (as [SystemMemoryResource]) for GPUs that can
// use pageable host memory directly (system allocated memory, "SAM": HMM or ATS systems such as
// Grace Hopper), and steers where it lives, as librmm's sam_headroom_memory_resource: after each
// allocation it reads the device's free memory, and the first [AlignDown](min(free − headroom,
// nbytes), 256) bytes are advised to prefer the GPU, the rest to prefer the host
// (cuMemAdvise_v2 with CU_MEM_ADVISE_SET_PREFERRED_LOCATION). headroom bytes of device memory are
// so left to other users (CUDA itself, kernels' local memory, other libraries). Nothing is
// prefetched: pages move when first touched.
//
// The stream is ignored by Allocate; Deallocate waits for the stream (cuStreamSynchronize), since
// free is immediate and work queued on the stream may still use the memory.
type SamHeadroomMemoryResource struct {
	dev      Device
	ctx      uintptr
	headroom int
	system   *SystemMemoryResource
}

// NewSamHeadroomMemoryResource returns a resource for device dev that leaves headroom bytes of
// device memory free. A negative headroom returns [ErrInvalidArgument]; without CUDA the error
// wraps [ErrNoDevice]; a device that cannot access pageable host memory
// (CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 0, as on an H200 in an x86 host without HMM)
// returns [ErrNotSupported].
func NewSamHeadroomMemoryResource(dev Device, headroom int) (*SamHeadroomMemoryResource, error) {
	if headroom < 0 {
		return nil, errorf("NewSamHeadroomMemoryResource: negative headroom %d: %w", headroom, ErrInvalidArgument)
	}
	ctx, err := dev.ctx()
	if err != nil {
		return nil, errorf("NewSamHeadroomMemoryResource: %w", err)
	}
	v, err := dev.Attribute(attrPageableMemoryAccess)
	if err != nil {
		return nil, errorf("NewSamHeadroomMemoryResource: %w", err)
	}
	if v == 0 {
		return nil, errorf("NewSamHeadroomMemoryResource: %s cannot access pageable host memory (no HMM or ATS: CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS is 0): %w", dev, ErrNotSupported)
	}
	return &SamHeadroomMemoryResource{dev: dev, ctx: ctx, headroom: headroom, system: NewSystemMemoryResource()}, nil
}

// samGPUPortion is how many of nbytes prefer the GPU when free bytes of device memory are free and
// headroom must stay free: AlignDown(min(max(free − headroom, 0), nbytes), 256).
func samGPUPortion(nbytes, free, headroom int) int {
	allocatable := 0
	if free > headroom {
		allocatable = free - headroom
	}
	return AlignDown(min(allocatable, nbytes), Alignment)
}

// Allocate returns nbytes of system memory, 256-byte aligned, with the preferred locations set as
// the type describes (cuMemGetInfo, then one or two cuMemAdvise_v2 calls). Exhausted host memory
// wraps [ErrOutOfMemory]; a failing driver call frees the memory and returns the [*CUDAError].
func (r *SamHeadroomMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("SamHeadroomMemoryResource", "Allocate", nbytes)
	}
	p, err := r.system.Allocate(nbytes, s)
	if err != nil || p == 0 {
		return 0, err
	}
	fail := func(err error) (DevicePtr, error) {
		_ = r.system.Deallocate(p, nbytes, s)
		return 0, errorf("SamHeadroomMemoryResource: allocating %s: %w", bytesText(nbytes), err)
	}
	free, _, err := cuMemGetInfo(r.ctx)
	if err != nil {
		return fail(err)
	}
	gpu := samGPUPortion(nbytes, free, r.headroom)
	if gpu > 0 {
		if err := cuMemAdvise(r.ctx, p, gpu, memAdviseSetPreferredLocation, memLocationTypeDevice, int(r.dev)); err != nil {
			return fail(err)
		}
	}
	if cpu := nbytes - gpu; cpu > 0 {
		if err := cuMemAdvise(r.ctx, p+DevicePtr(gpu), cpu, memAdviseSetPreferredLocation, memLocationTypeHost, 0); err != nil {
			return fail(err)
		}
	}
	return p, nil
}

// Deallocate waits for s and frees p. A pointer not allocated by a system resource, a double free
// or a wrong size returns [ErrInvalidFree] and frees nothing.
func (r *SamHeadroomMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if p == 0 {
		return nil
	}
	if err := waitStreamBeforeFree(r.dev, s); err != nil {
		return errorf("SamHeadroomMemoryResource.Deallocate: waiting for %v: %w", s, err)
	}
	return r.system.Deallocate(p, nbytes, s)
}

// Headroom returns the bytes of device memory the resource leaves free.
func (r *SamHeadroomMemoryResource) Headroom() int { return r.headroom }

// Device returns the resource's device.
func (r *SamHeadroomMemoryResource) Device() Device { return r.dev }

// Access reports [HostAccessible]|[DeviceAccessible].
func (r *SamHeadroomMemoryResource) Access() Access { return HostAccessible | DeviceAccessible }
