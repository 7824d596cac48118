package rmm

import "sync"

// ThreadSafeResourceAdaptor makes a resource that is not safe for concurrent use safe, by holding
// one mutex around every Allocate and Deallocate of its upstream, as librmm's
// thread_safe_resource_adaptor. Every resource of this package is safe for concurrent use
// already; this is for a program's own resources (a [MemoryResource] written without locking).
// Calls through the adaptor are serialised; calls made to the upstream directly are not.
type ThreadSafeResourceAdaptor struct {
	upstream MemoryResource
	mu       sync.Mutex
}

// NewThreadSafeResourceAdaptor returns an adaptor that serialises the calls to upstream. A nil
// upstream means the current device resource ([CurrentDeviceResource], read once, here); a nil
// pointer as upstream returns an error wrapping [ErrInvalidArgument].
func NewThreadSafeResourceAdaptor(upstream MemoryResource) (*ThreadSafeResourceAdaptor, error) {
	up, err := upstreamOf("NewThreadSafeResourceAdaptor", upstream)
	if err != nil {
		return nil, err
	}
	return &ThreadSafeResourceAdaptor{upstream: up}, nil
}

// Allocate calls the upstream's Allocate under the adaptor's mutex and returns its results. A
// negative size returns an error wrapping [ErrInvalidArgument] without calling the upstream.
func (r *ThreadSafeResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("ThreadSafeResourceAdaptor", "Allocate", nbytes)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.upstream.Allocate(nbytes, s)
}

// Deallocate calls the upstream's Deallocate under the adaptor's mutex and returns its error. A
// negative size returns an error wrapping [ErrInvalidArgument] without calling the upstream.
func (r *ThreadSafeResourceAdaptor) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if nbytes < 0 {
		return invalidSize("ThreadSafeResourceAdaptor", "Deallocate", nbytes)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.upstream.Deallocate(p, nbytes, s)
}

// Upstream returns the resource the adaptor forwards to.
func (r *ThreadSafeResourceAdaptor) Upstream() MemoryResource { return r.upstream }

func (*ThreadSafeResourceAdaptor) insideUpstream() {}

func (*ThreadSafeResourceAdaptor) passesPointersThrough() {}

// Access reports the upstream's accessibility ([AccessOf](Upstream())).
func (r *ThreadSafeResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the upstream's device ([DeviceOf](Upstream())).
func (r *ThreadSafeResourceAdaptor) Device() Device { return DeviceOf(r.upstream) }
