package rmm

import (
	"errors"
)

// CallbackOptions configures [NewCallbackMemoryResource]. nil means the defaults.
type CallbackOptions struct {
	// Access says where the memory the allocate function returns can be touched (what Access
	// reports, and so how containers fill and copy it). Default 0, meaning [DeviceAccessible]: what
	// [AccessOf] assumes of a resource it knows nothing about. Use [HostAccessible] for host memory,
	// HostAccessible|DeviceAccessible for managed or pinned memory.
	Access Access
}

// CallbackMemoryResource is a [MemoryResource] whose allocate and free are done by user functions,
// as librmm's callback_memory_resource: for plugging in another library's allocator (a framework's
// caching allocator, a custom arena) without writing a type.
//
// The allocate function must return at least nbytes bytes aligned to [Alignment] (256 bytes) and
// usable on stream s, or an error (wrap [ErrOutOfMemory] when the memory is exhausted, so that
// callers can tell). The free function is given exactly what the allocate function returned and
// the size asked for. The functions are called for positive sizes only: Allocate(0, s) returns
// (0, nil) and Deallocate(0, ·, s) does nothing, without calling them. They must be safe for
// concurrent use when the resource is used by several goroutines. A panic in a function reaches
// the caller of Allocate or Deallocate.
//
// The device is the current device when the resource is built (Device).
type CallbackMemoryResource struct {
	alloc  func(nbytes int, s StreamView) (DevicePtr, error)
	free   func(p DevicePtr, nbytes int, s StreamView) error
	access Access
	dev    Device
}

// NewCallbackMemoryResource returns a resource that calls alloc for every allocation and free for
// every deallocation. A nil function returns an error wrapping [ErrInvalidArgument].
func NewCallbackMemoryResource(
	alloc func(nbytes int, s StreamView) (DevicePtr, error),
	free func(p DevicePtr, nbytes int, s StreamView) error,
	opts *CallbackOptions,
) (*CallbackMemoryResource, error) {
	switch {
	case alloc == nil && free == nil:
		return nil, errorf("NewCallbackMemoryResource: nil allocate and free functions: %w", ErrInvalidArgument)
	case alloc == nil:
		return nil, errorf("NewCallbackMemoryResource: nil allocate function: %w", ErrInvalidArgument)
	case free == nil:
		return nil, errorf("NewCallbackMemoryResource: nil free function: %w", ErrInvalidArgument)
	}
	r := &CallbackMemoryResource{alloc: alloc, free: free, access: DeviceAccessible, dev: CurrentDevice()}
	if opts != nil && opts.Access != 0 {
		r.access = opts.Access
	}
	return r, nil
}

// Allocate calls the allocate function for nbytes on s. A negative size returns [ErrInvalidArgument]
// without calling it. The function's error is returned wrapped (errors.Is sees through it). A
// null pointer with no error is reported as [ErrOutOfMemory]; a pointer not aligned to 256 bytes is
// handed straight back to the free function and reported as ErrInvalidArgument, so that
// sub-allocators over this resource never see it.
func (r *CallbackMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes <= 0 {
		if nbytes < 0 {
			return 0, invalidSize("CallbackMemoryResource", "Allocate", nbytes)
		}
		return 0, nil
	}
	p, err := r.alloc(nbytes, s)
	switch {
	case err != nil:
		if errors.Is(err, ErrOutOfMemory) {
			return 0, errorf("CallbackMemoryResource: allocating %s on %v: %w", bytesText(nbytes), s, err)
		}
		return 0, errorf("CallbackMemoryResource: the allocate function failed for %s on %v: %w", bytesText(nbytes), s, err)
	case p == 0:
		return 0, outOfMemory("CallbackMemoryResource", nbytes, errors.New("the allocate function returned a null pointer and no error"))
	case p%Alignment != 0:
		ferr := r.free(p, nbytes, s)
		err := errorf("CallbackMemoryResource: the allocate function returned %#x for %s, which is not aligned to %d bytes (given back to the free function): %w", uintptr(p), bytesText(nbytes), Alignment, ErrInvalidArgument)
		if ferr != nil {
			return 0, errorf("%w; giving it back failed: %w", err, ferr)
		}
		return 0, err
	}
	return p, nil
}

// Deallocate calls the free function for p (nbytes, s). A null p does nothing; a negative size
// returns [ErrInvalidArgument] without calling it. The function's error is returned wrapped.
func (r *CallbackMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if p == 0 {
		return nil
	}
	if nbytes < 0 {
		return invalidSize("CallbackMemoryResource", "Deallocate", nbytes)
	}
	if err := r.free(p, nbytes, s); err != nil {
		return errorf("CallbackMemoryResource: the free function failed for %#x (%d bytes) on %v: %w", uintptr(p), nbytes, s, err)
	}
	return nil
}

// Access reports the access given in [CallbackOptions] ([DeviceAccessible] by default).
func (r *CallbackMemoryResource) Access() Access { return r.access }

// Device returns the device that was current when the resource was built.
func (r *CallbackMemoryResource) Device() Device { return r.dev }
