package rmm

import "fmt"

// Allocator hands out typed, uninitialized spans of memory from a MemoryResource, counted in
// elements of T (RMM's polymorphic_allocator). It owns nothing: every span it allocates must be
// given back with Deallocate. It is a small value; copies allocate from the same resource. The
// zero Allocator is not usable (its methods return ErrInvalidArgument): make one with
// NewAllocator.
type Allocator[T any] struct {
	mr     MemoryResource
	dev    Device
	access Access
}

func allocatorKind[T any]() string { return "Allocator[" + typeName[T]() + "]" }

// NewAllocator returns an allocator over mr; nil mr means CurrentDeviceResource() at the time of
// the call. An element type holding Go pointers returns ErrInvalidArgument.
func NewAllocator[T any](mr MemoryResource) (Allocator[T], error) {
	if err := checkElemType[T]("New" + allocatorKind[T]()); err != nil {
		return Allocator[T]{}, err
	}
	mr = resourceOrCurrent(mr)
	return Allocator[T]{mr: mr, dev: DeviceOf(mr), access: AccessOf(mr)}, nil
}

// Allocate returns a span of n uninitialized elements (n*sizeof(T) bytes, aligned to 256 bytes)
// usable on stream s. n == 0 gives an empty span without calling the resource. A negative or
// overflowing n returns ErrInvalidArgument; a failed allocation the resource's error.
func (a Allocator[T]) Allocate(n int, s StreamView) (DeviceSpan[T], error) {
	op := fmt.Sprintf("%s.Allocate(%d)", allocatorKind[T](), n)
	if a.mr == nil {
		return DeviceSpan[T]{}, errorf("%s: zero Allocator (use NewAllocator): %w", op, ErrInvalidArgument)
	}
	nb, ok := elemBytes[T](n)
	if !ok {
		return DeviceSpan[T]{}, countErr[T](op, n)
	}
	sp := DeviceSpan[T]{n: n, dev: a.dev, access: a.access}
	if nb == 0 {
		return sp, nil
	}
	p, err := a.mr.Allocate(nb, s)
	if err != nil {
		return DeviceSpan[T]{}, errorf("%s: %w", op, err)
	}
	sp.ptr = p
	return sp, nil
}

// Deallocate gives back a span that Allocate returned (the whole span, not a Subspan), in stream
// order on s: the memory may be reused by work ordered after everything queued on s. The
// resource's error (ErrInvalidFree for a span it did not hand out, where it checks) is returned.
func (a Allocator[T]) Deallocate(sp DeviceSpan[T], s StreamView) error {
	if a.mr == nil {
		return errorf("%s.Deallocate: zero Allocator (use NewAllocator): %w", allocatorKind[T](), ErrInvalidArgument)
	}
	if sp.ptr == 0 && sp.n == 0 {
		return nil
	}
	if err := a.mr.Deallocate(sp.ptr, sp.SizeBytes(), s); err != nil {
		return errorf("%s.Deallocate(%#x, %d elements): %w", allocatorKind[T](), uintptr(sp.ptr), sp.n, err)
	}
	return nil
}

// MemoryResource returns the resource the allocator draws from.
func (a Allocator[T]) MemoryResource() MemoryResource { return a.mr }

// StreamAllocator is an Allocator bound to one stream (RMM's stream_allocator_adaptor): every
// allocation and deallocation is ordered on that stream.
type StreamAllocator[T any] struct {
	a Allocator[T]
	s StreamView
}

// NewStreamAllocator returns an allocator over mr (nil: the current device resource) whose
// calls are ordered on s. Errors as NewAllocator.
func NewStreamAllocator[T any](mr MemoryResource, s StreamView) (StreamAllocator[T], error) {
	a, err := NewAllocator[T](mr)
	if err != nil {
		return StreamAllocator[T]{}, err
	}
	return StreamAllocator[T]{a: a, s: s}, nil
}

// Allocate returns n uninitialized elements usable on Stream(); see Allocator.Allocate.
func (sa StreamAllocator[T]) Allocate(n int) (DeviceSpan[T], error) { return sa.a.Allocate(n, sa.s) }

// Deallocate gives back a span from Allocate, ordered on Stream().
func (sa StreamAllocator[T]) Deallocate(sp DeviceSpan[T]) error { return sa.a.Deallocate(sp, sa.s) }

// Stream returns the stream the allocator is bound to.
func (sa StreamAllocator[T]) Stream() StreamView { return sa.s }

// Allocator returns the underlying allocator.
func (sa StreamAllocator[T]) Allocator() Allocator[T] { return sa.a }

// MemoryResource returns the resource the allocator draws from.
func (sa StreamAllocator[T]) MemoryResource() MemoryResource { return sa.a.mr }
