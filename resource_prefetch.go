package rmm

// PrefetchResourceAdaptor forwards every call to its upstream and, after each allocation of
// memory that can be prefetched, prefetches the whole range to the resource's device on the
// allocation's stream (cuMemPrefetchAsync_v2 to CU_MEM_LOCATION_TYPE_DEVICE), as librmm's
// prefetch_resource_adaptor: managed memory then starts out resident on the GPU instead of
// faulting its pages in on first touch. The prefetch is ordered on the stream and the host does
// not wait for it.
//
// What is prefetched is decided once, at construction, from the resources under the adaptor
// (through the package's adaptors and sub-allocators, which hand out their upstream's memory):
//   - managed memory ([ManagedMemoryResource], also under a pool, an arena or a fixed-size
//     resource) is prefetched;
//   - host memory from [SystemMemoryResource] or [SamHeadroomMemoryResource] is prefetched only when
//     the device can access pageable memory (CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS, 88);
//   - memory that cannot be prefetched ([CudaMemoryResource], [CudaAsyncMemoryResource],
//     [PinnedMemoryResource], [SimulatedMemoryResource], an expandable pool's mapped memory, and
//     host memory without pageable access) is never: the adaptor is then a pass-through and
//     makes no driver call;
//   - memory from any other resource (one of another package, a [CallbackMemoryResource], a
//     [BinningMemoryResource], whose bins may be any resource, a [CudaAsyncViewMemoryResource],
//     whose pool may be a managed pool) is asked about per allocation: cuPointerGetAttributes
//     (CU_POINTER_ATTRIBUTE_IS_MANAGED), which succeeds for any address, and only managed memory
//     is prefetched.
//
// Nothing is prefetched when CUDA is unavailable, when the device cannot prefetch
// (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, 89, is 0), or when the driver lacks
// cuMemPrefetchAsync_v2 (older than CUDA 12.2). So the adaptor makes no driver call that fails
// by design: a prefetch (or pointer query) error means something really failed, and the
// allocation is then given back to the upstream and the error returned as a [*CUDAError].
// Deallocate is forwarded unchanged. Safe for concurrent use when the upstream is.
type PrefetchResourceAdaptor struct {
	upstream MemoryResource
	dev      Device
	ctx      uintptr // the device's primary context; 0 when nothing is prefetched
	mode     prefetchMode

	// The driver calls, replaced in tests.
	isManaged func(ctx uintptr, p DevicePtr) (bool, error)
	prefetch  func(ctx uintptr, p DevicePtr, n, locType, locID int, stream uintptr) error
}

// cuMemLocationTypeDevice is CU_MEM_LOCATION_TYPE_DEVICE.
const cuMemLocationTypeDevice = 1

// prefetchMode says which allocations of a PrefetchResourceAdaptor are prefetched.
type prefetchMode uint8

const (
	// prefetchNever: the memory cannot be prefetched (or the device cannot prefetch); no driver call.
	prefetchNever prefetchMode = iota
	// prefetchAlways: every allocation is prefetchable memory.
	prefetchAlways
	// prefetchIfManaged: the resource is unknown; each allocation is prefetched when the driver
	// says it is managed.
	prefetchIfManaged
)

func (m prefetchMode) String() string {
	switch m {
	case prefetchNever:
		return "never"
	case prefetchAlways:
		return "always"
	default:
		return "if managed"
	}
}

// prefetchModeOf decides from the resources under mr whether their memory can be prefetched;
// pageable tells whether the device can access pageable host memory. It makes no driver call.
func prefetchModeOf(mr MemoryResource, pageable bool) prefetchMode {
	for {
		switch r := mr.(type) {
		case *ManagedMemoryResource:
			return prefetchAlways
		case *SystemMemoryResource, *SamHeadroomMemoryResource:
			// malloc'd memory: cuMemPrefetchAsync takes it only on HMM/ATS systems.
			if pageable {
				return prefetchAlways
			}
			return prefetchNever
		case *CudaMemoryResource, *CudaAsyncMemoryResource, *PinnedMemoryResource, *SimulatedMemoryResource:
			// cuMemAlloc and pinned pool memory, cuMemHostAlloc memory, addresses without memory.
			return prefetchNever
		case *PoolMemoryResource:
			if r.Expandable() {
				// cuMemCreate/cuMemMap memory (or host or simulated mappings), never managed.
				return prefetchNever
			}
			mr = r.upstream
		case insideUpstream:
			// These hand out their upstream's memory (or ranges inside it). Another package's
			// Upstreamer is not trusted to do the same: it is asked about per allocation.
			mr = r.Upstream()
		default:
			return prefetchIfManaged
		}
	}
}

// NewPrefetchResourceAdaptor returns an adaptor over upstream that prefetches allocations to
// [DeviceOf](upstream) (see the type's comment for which). With CUDA it reads the device's
// concurrent-managed-access attribute, and its pageable-memory-access attribute, once, here
// (cuDeviceGetAttribute); the driver's error doing so (or retaining the device's context) is
// returned as a [*CUDAError]. A nil upstream means the current device resource
// ([CurrentDeviceResource], read once, here); a nil pointer as upstream returns an error wrapping
// [ErrInvalidArgument].
func NewPrefetchResourceAdaptor(upstream MemoryResource) (*PrefetchResourceAdaptor, error) {
	upstream, err := upstreamOf("NewPrefetchResourceAdaptor", upstream)
	if err != nil {
		return nil, err
	}
	r := &PrefetchResourceAdaptor{upstream: upstream, dev: DeviceOf(upstream), isManaged: cuPointerIsManaged, prefetch: cuMemPrefetchAsync}
	if CUDAAvailable() != nil || !cuMemPrefetchBound() {
		return r, nil
	}
	cma, err := r.dev.Attribute(attrConcurrentManagedAccess)
	if err != nil {
		return nil, errorf("NewPrefetchResourceAdaptor: %w", err)
	}
	if cma == 0 {
		return r, nil
	}
	pageable, err := r.dev.Attribute(attrPageableMemoryAccess)
	if err != nil {
		return nil, errorf("NewPrefetchResourceAdaptor: %w", err)
	}
	mode := prefetchModeOf(upstream, pageable != 0)
	if mode == prefetchNever {
		return r, nil
	}
	if r.ctx, err = r.dev.ctx(); err != nil {
		return nil, errorf("NewPrefetchResourceAdaptor: %w", err)
	}
	r.mode = mode
	return r, nil
}

// Allocate allocates nbytes from the upstream on stream s and, when the memory can be prefetched
// (see the type's comment), prefetches it to the device on s. The upstream's errors are returned
// unchanged; a driver error of the prefetch, or of the question whether the memory is managed, is
// returned after the memory was given back to the upstream. A view of a closed [Stream] returns an
// error wrapping [ErrClosed] without calling the upstream (its handle is gone: nothing may be queued
// on it), except for a size of 0, which returns (0, nil) on any stream as [MemoryResource] says.
// A negative size returns an error wrapping [ErrInvalidArgument].
func (r *PrefetchResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("PrefetchResourceAdaptor", "Allocate", nbytes)
	}
	if nbytes > 0 && s.closed() {
		// Checked whatever the mode, so that the answer does not depend on the machine.
		return 0, errStreamClosed("PrefetchResourceAdaptor.Allocate", s)
	}
	p, err := r.upstream.Allocate(nbytes, s)
	if err != nil || r.mode == prefetchNever || p == 0 || nbytes == 0 {
		return p, err
	}
	if r.mode == prefetchIfManaged {
		managed, err := r.isManaged(r.ctx, p)
		if err != nil {
			return 0, r.giveBack(p, nbytes, s, errorf("PrefetchResourceAdaptor: asking whether %#x is managed memory: %w", uintptr(p), err))
		}
		if !managed {
			return p, nil
		}
	}
	if err := r.prefetch(r.ctx, p, nbytes, cuMemLocationTypeDevice, int(r.dev), s.cu()); err != nil {
		return 0, r.giveBack(p, nbytes, s, errorf("PrefetchResourceAdaptor: prefetching %s at %#x to %v on %v: %w", bytesText(nbytes), uintptr(p), r.dev, s, err))
	}
	return p, nil
}

// giveBack returns p to the upstream after a failed prefetch and returns err, with the
// upstream's error added when that fails too.
func (r *PrefetchResourceAdaptor) giveBack(p DevicePtr, nbytes int, s StreamView, err error) error {
	if ferr := r.upstream.Deallocate(p, nbytes, s); ferr != nil {
		return errorf("%w; giving the memory back failed: %w", err, ferr)
	}
	return err
}

// Deallocate returns p to the upstream on stream s and returns the upstream's error. A negative
// size returns an error wrapping [ErrInvalidArgument] without calling the upstream.
func (r *PrefetchResourceAdaptor) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if nbytes < 0 {
		return invalidSize("PrefetchResourceAdaptor", "Deallocate", nbytes)
	}
	return r.upstream.Deallocate(p, nbytes, s)
}

// Prefetching reports whether allocations are prefetched: CUDA is available, the device has
// concurrent managed access, and the upstream hands out memory that can be prefetched, or may
// (an upstream the package does not know, whose allocations are prefetched when managed).
func (r *PrefetchResourceAdaptor) Prefetching() bool { return r.mode != prefetchNever }

// Upstream returns the resource the adaptor forwards to.
func (r *PrefetchResourceAdaptor) Upstream() MemoryResource { return r.upstream }

func (*PrefetchResourceAdaptor) insideUpstream() {}

func (*PrefetchResourceAdaptor) passesPointersThrough() {}

// Access reports the upstream's accessibility ([AccessOf](Upstream())).
func (r *PrefetchResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the device allocations are prefetched to ([DeviceOf](Upstream())).
func (r *PrefetchResourceAdaptor) Device() Device { return r.dev }
