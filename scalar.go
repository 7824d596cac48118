package rmm

import (
	"runtime"
	"unsafe"
)

// Scalar is one element of T in device memory (RMM's device_scalar), for results of device
// work and parameters to it. Its storage is a one-element Uvector: the same rules about element
// types, streams, where work runs, Close and leaks apply. A Scalar must not be copied by value.
//
// A nil *Scalar reads as an empty one, as a nil *Uvector does: Data is 0, Span is empty, Stream
// is DefaultStream, MemoryResource is nil, SetStream does nothing and Close returns nil; every
// other call that can fail returns an error wrapping [ErrInvalidArgument] that names the nil
// scalar.
//
// Make one with its constructor; the zero value is not usable.
type Scalar[T any] struct {
	noCopy noCopy
	v      *Uvector[T]
}

// vec is c's storage; nil for a nil scalar, which then reads as a nil *Uvector does.
func (c *Scalar[T]) vec() *Uvector[T] {
	if c == nil {
		return nil
	}
	return c.v
}

// state is c's memory state, or a nil scalar's (nilMemState).
func (c *Scalar[T]) state() *memState {
	if c == nil {
		return nilMemState(scalarKind[T]())
	}
	return c.v.st
}

func scalarKind[T any]() string { return "Scalar[" + typeName[T]() + "]" }

// NewScalar allocates one uninitialized element of T (sizeof(T) bytes) from mr on s; nil mr means
// CurrentDeviceResource(). An element type holding Go pointers returns ErrInvalidArgument; a
// failed allocation returns the resource's error.
func NewScalar[T any](s StreamView, mr MemoryResource) (*Scalar[T], error) {
	return newScalarAs[T]("New"+scalarKind[T](), s, mr)
}

// newScalarAs is NewScalar for the constructor op, which its errors name.
func newScalarAs[T any](op string, s StreamView, mr MemoryResource) (*Scalar[T], error) {
	if err := checkElemType[T](op); err != nil {
		return nil, err
	}
	st, err := newMemState(scalarKind[T](), sizeOf[T](), s, mr)
	if err != nil {
		return nil, errorf("%s: %w", op, err)
	}
	return &Scalar[T]{v: newUvector[T](st)}, nil
}

// NewScalarWithValue allocates one element from mr on s and sets it to x; the copy is complete at
// return (it reads Go memory). On failure nothing stays allocated.
func NewScalarWithValue[T any](x T, s StreamView, mr MemoryResource) (*Scalar[T], error) {
	op := "NewScalarWithValue[" + typeName[T]() + "]"
	c, err := newScalarAs[T](op, s, mr)
	if err != nil {
		return nil, err
	}
	if err := copyFromGo(op, c.state().ref(), unsafe.Pointer(&x), sizeOf[T](), s); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// Copy returns a new Scalar from mr (nil: the current device resource) holding c's value, copied
// on s (asynchronously between device memories).
func (c *Scalar[T]) Copy(s StreamView, mr MemoryResource) (*Scalar[T], error) {
	defer runtime.KeepAlive(c) // the leak cleanup must not run during the call
	if c == nil {
		return nil, c.state().errClosed("Copy")
	}
	v, err := c.v.Copy(s, mr)
	if err != nil {
		return nil, err
	}
	return &Scalar[T]{v: v}, nil
}

// Value returns the element, copied to the host (cuMemcpyDtoHAsync on s, then s synchronised).
func (c *Scalar[T]) Value(s StreamView) (T, error) {
	defer runtime.KeepAlive(c)
	var x T
	if c.state().closed {
		return x, c.state().errClosed("Value")
	}
	err := copyToGo(c.state().kind+".Value", unsafe.Pointer(&x), c.state().ref(), sizeOf[T](), s)
	return x, err
}

// SetValue writes x (cuMemcpyHtoDAsync on s, then s synchronised: finished at return). The bytes
// are copied as they are (-0.0 stays -0.0).
func (c *Scalar[T]) SetValue(x T, s StreamView) error {
	defer runtime.KeepAlive(c)
	if c.state().closed {
		return c.state().errClosed("SetValue")
	}
	return copyFromGo(c.state().kind+".SetValue", c.state().ref(), unsafe.Pointer(&x), sizeOf[T](), s)
}

// SetValueToZero sets the element's bytes to zero, asynchronously on s on device memory
// (cuMemsetD8Async).
func (c *Scalar[T]) SetValueToZero(s StreamView) error {
	defer runtime.KeepAlive(c)
	if c.state().closed {
		return c.state().errClosed("SetValueToZero")
	}
	return fillMem(c.state().kind+".SetValueToZero", c.state().ref(), sizeOf[T](), []byte{0}, s)
}

// Data returns the element's address (0 after Close).
func (c *Scalar[T]) Data() DevicePtr { return c.vec().Data() }

// Span returns a one-element view (empty after Close).
func (c *Scalar[T]) Span() DeviceSpan[T] { return c.vec().Span() }

// Stream returns the scalar's stream: the one it was allocated on, or set with SetStream; Close
// frees it there. Calls that take a stream argument do not change it: before Close, order work
// queued on other streams before this one (SetStream, or an Event).
func (c *Scalar[T]) Stream() StreamView { return c.vec().Stream() }

// SetStream sets the stream on which the memory is freed.
func (c *Scalar[T]) SetStream(s StreamView) { c.vec().SetStream(s) }

// MemoryResource returns the resource the memory came from.
func (c *Scalar[T]) MemoryResource() MemoryResource { return c.vec().MemoryResource() }

// Device returns the device recorded at construction.
func (c *Scalar[T]) Device() Device { return c.vec().Device() }

// Close frees the element through its resource on Stream(); later calls that can fail return
// ErrClosed; closing again returns nil.
func (c *Scalar[T]) Close() error { return c.vec().Close() }
