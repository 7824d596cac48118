package rmm

import (
	"errors"
)

// FailureCallbackOptions configures a [FailureCallbackResourceAdaptor]. nil means the defaults.
type FailureCallbackOptions struct {
	// Catch reports whether an error of the upstream's Allocate goes to the callback; errors it
	// does not catch are returned at once, untouched. Default nil: errors.Is(err,
	// [ErrOutOfMemory]), as librmm's default exception type rmm::out_of_memory.
	Catch func(err error) bool
}

// FailureCallback is called by a [FailureCallbackResourceAdaptor] when an allocation of nbytes
// failed with err (an error its Catch accepts). Returning true retries the allocation; returning
// false gives up, and Allocate returns err. It is called on the allocating goroutine, possibly by
// several goroutines at once.
type FailureCallback func(nbytes int, err error) bool

// FailureCallbackResourceAdaptor forwards every call to its upstream and, when an allocation
// fails, lets a callback act and decide whether to try again, as librmm's
// failure_callback_resource_adaptor: for spilling memory to the host on demand and retrying.
//
// Allocate loops: call the upstream; on success return; on an error that Catch does not accept,
// return it untouched; otherwise call the callback with the size and the error: true → try again
// (there is no bound on the retries: the callback decides), false → return the error. Deallocate
// is forwarded unchanged. Safe for concurrent use when the upstream and the callback are.
type FailureCallbackResourceAdaptor struct {
	upstream MemoryResource
	callback FailureCallback
	catch    func(error) bool
}

// isOutOfMemory is the default Catch.
func isOutOfMemory(err error) bool { return errors.Is(err, ErrOutOfMemory) }

// NewFailureCallbackResourceAdaptor returns an adaptor over upstream that calls callback when an
// allocation fails; nil opts means the defaults. A nil callback returns an error wrapping
// [ErrInvalidArgument]. A nil upstream means the current device resource
// ([CurrentDeviceResource], read once, here); a nil pointer as upstream returns an error wrapping
// [ErrInvalidArgument].
func NewFailureCallbackResourceAdaptor(upstream MemoryResource, callback FailureCallback, opts *FailureCallbackOptions) (*FailureCallbackResourceAdaptor, error) {
	upstream, err := upstreamOf("NewFailureCallbackResourceAdaptor", upstream)
	if err != nil {
		return nil, err
	}
	if callback == nil {
		return nil, errorf("NewFailureCallbackResourceAdaptor: nil callback: %w", ErrInvalidArgument)
	}
	r := &FailureCallbackResourceAdaptor{upstream: upstream, callback: callback, catch: isOutOfMemory}
	if opts != nil && opts.Catch != nil {
		r.catch = opts.Catch
	}
	return r, nil
}

// Allocate allocates nbytes from the upstream on stream s, calling the callback after each
// failure that Catch accepts (see the type's comment). A negative size returns an error wrapping
// [ErrInvalidArgument] without calling the upstream.
func (r *FailureCallbackResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("FailureCallbackResourceAdaptor", "Allocate", nbytes)
	}
	for {
		p, err := r.upstream.Allocate(nbytes, s)
		if err == nil {
			return p, nil
		}
		if !r.catch(err) || !r.callback(nbytes, err) {
			return 0, err
		}
	}
}

// Deallocate returns p to the upstream on stream s and returns the upstream's error. A negative
// size returns an error wrapping [ErrInvalidArgument] without calling the upstream.
func (r *FailureCallbackResourceAdaptor) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if nbytes < 0 {
		return invalidSize("FailureCallbackResourceAdaptor", "Deallocate", nbytes)
	}
	return r.upstream.Deallocate(p, nbytes, s)
}

// Upstream returns the resource the adaptor forwards to.
func (r *FailureCallbackResourceAdaptor) Upstream() MemoryResource { return r.upstream }

func (*FailureCallbackResourceAdaptor) insideUpstream() {}

func (*FailureCallbackResourceAdaptor) passesPointersThrough() {}

// Access reports the upstream's accessibility ([AccessOf](Upstream())).
func (r *FailureCallbackResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the upstream's device ([DeviceOf](Upstream())).
func (r *FailureCallbackResourceAdaptor) Device() Device { return DeviceOf(r.upstream) }
