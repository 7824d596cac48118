package rmm

import (
	"errors"
	"fmt"
)

// PrefetchResourceAdaptor forwards every call to its upstream and, after each allocation,
// prefetches the whole range to the resource's device on the allocation's stream
// (cuMemPrefetchAsync_v2 to CU_MEM_LOCATION_TYPE_DEVICE), as librmm's prefetch_resource_adaptor:
// managed memory then starts out resident on the GPU instead of faulting its pages in on first
// touch. The prefetch is ordered on the stream and the host does not wait for it.
//
// It does nothing (the adaptor is a plain pass-through) when CUDA is unavailable, or when the
// device cannot prefetch (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, attribute 89, is 0).
// Memory that is not managed or otherwise migratable makes the driver answer
// CUDA_ERROR_INVALID_VALUE, which is ignored, as is CUDA_ERROR_NOT_SUPPORTED (also what a driver
// older than CUDA 12.2, which lacks cuMemPrefetchAsync_v2, gives). Any other driver error frees
// the allocation again and is returned as a *CUDAError. Deallocate is forwarded unchanged. Safe
// for concurrent use when the upstream is.
type PrefetchResourceAdaptor struct {
	upstream MemoryResource
	dev      Device
	ctx      uintptr // the device's primary context; 0 when prefetching is off
}

// cuMemLocationTypeDevice is CU_MEM_LOCATION_TYPE_DEVICE.
const cuMemLocationTypeDevice = 1

// NewPrefetchResourceAdaptor returns an adaptor over upstream (nil: the current device resource)
// that prefetches every allocation to DeviceOf(upstream). With CUDA it reads the device's
// concurrent-managed-access attribute once, here; an error doing so (or retaining the device's
// context) is returned.
func NewPrefetchResourceAdaptor(upstream MemoryResource) (*PrefetchResourceAdaptor, error) {
	upstream = resourceOrCurrent(upstream)
	r := &PrefetchResourceAdaptor{upstream: upstream, dev: DeviceOf(upstream)}
	if CUDAAvailable() != nil {
		return r, nil
	}
	v, err := r.dev.Attribute(attrConcurrentManagedAccess)
	if err != nil {
		return nil, fmt.Errorf("NewPrefetchResourceAdaptor: %w", err)
	}
	if v == 0 {
		return r, nil
	}
	if r.ctx, err = r.dev.ctx(); err != nil {
		return nil, fmt.Errorf("NewPrefetchResourceAdaptor: %w", err)
	}
	return r, nil
}

// Allocate allocates nbytes from the upstream on stream s and prefetches them to the device on s
// (see the type's comment). The upstream's errors are returned unchanged; a prefetch error is
// returned after the memory was given back to the upstream. A negative size returns an error
// wrapping ErrInvalidArgument.
func (r *PrefetchResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("PrefetchResourceAdaptor", "Allocate", nbytes)
	}
	p, err := r.upstream.Allocate(nbytes, s)
	if err != nil || r.ctx == 0 || p == 0 || nbytes == 0 {
		return p, err
	}
	err = cuMemPrefetchAsync(r.ctx, p, nbytes, cuMemLocationTypeDevice, int(r.dev), s.cu())
	if err == nil || prefetchIgnorable(err) {
		return p, nil
	}
	err = fmt.Errorf("PrefetchResourceAdaptor: prefetching %d bytes at %#x to %v on %v: %w", nbytes, uintptr(p), r.dev, s, err)
	if ferr := r.upstream.Deallocate(p, nbytes, s); ferr != nil {
		err = fmt.Errorf("%w; giving the memory back failed: %w", err, ferr)
	}
	return 0, err
}

// prefetchIgnorable reports the driver answers that mean "this memory cannot be prefetched".
func prefetchIgnorable(err error) bool {
	var ce *CUDAError
	return errors.As(err, &ce) && (ce.Code == cudaErrorInvalidValue || ce.Code == cudaErrorNotSupported)
}

// Deallocate returns p to the upstream on stream s.
func (r *PrefetchResourceAdaptor) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	return r.upstream.Deallocate(p, nbytes, s)
}

// Prefetching reports whether allocations are prefetched: CUDA is available and the device has
// concurrent managed access.
func (r *PrefetchResourceAdaptor) Prefetching() bool { return r.ctx != 0 }

// Upstream returns the resource the adaptor forwards to.
func (r *PrefetchResourceAdaptor) Upstream() MemoryResource { return r.upstream }

// Access reports the upstream's accessibility (AccessOf(Upstream())).
func (r *PrefetchResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the device allocations are prefetched to (DeviceOf(Upstream())).
func (r *PrefetchResourceAdaptor) Device() Device { return r.dev }
