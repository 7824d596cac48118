package rmm

import (
	"fmt"
	"math"
	"reflect"
	"runtime"
	"sync"
	"unsafe"
)

// ---- element types ----

// elemTypeChecks caches, per element type, nil or the error saying why the type cannot live in
// device memory.
var elemTypeChecks sync.Map // reflect.Type -> error (nil when the type is fine)

// checkElemType returns nil when T may be stored in device memory: it holds no Go pointers
// (pointers, slices, maps, strings, channels, functions, interfaces, unsafe.Pointer) at any depth
// of arrays and structs, and is not zero-sized. The answer is computed once per type. The error
// wraps ErrInvalidArgument and names the type and the offending field.
func checkElemType[T any](op string) error {
	t := reflect.TypeFor[T]()
	v, ok := elemTypeChecks.Load(t)
	if !ok {
		v, _ = elemTypeChecks.LoadOrStore(t, computeElemTypeCheck(t))
	}
	if err, _ := v.(error); err != nil {
		return errorf("%s: %w: %w", op, err, ErrInvalidArgument)
	}
	return nil
}

// elemTypeError is the cached reason a type was refused (without the sentinel, which
// checkElemType adds together with the operation).
type elemTypeError struct{ msg string }

func (e *elemTypeError) Error() string { return e.msg }

func computeElemTypeCheck(t reflect.Type) error {
	if t.Size() == 0 {
		return &elemTypeError{fmt.Sprintf("element type %s has size 0", t)}
	}
	path, bad := findGoPointer(t, "")
	if bad == nil {
		return nil
	}
	if path == "" {
		return &elemTypeError{fmt.Sprintf("element type %s is a %s: %s", t, kindName(bad), plainDataOnly)}
	}
	return &elemTypeError{fmt.Sprintf("element type %s holds a Go pointer in field %s (%s, a %s): %s", t, path, bad, kindName(bad), plainDataOnly)}
}

const plainDataOnly = "Go pointers cannot live in memory the collector does not see (device, pinned or C memory); use plain data (numbers, bools, and arrays and structs of them)"

// findGoPointer returns the path and type of the first part of t that holds a Go pointer, or a
// nil type when there is none.
func findGoPointer(t reflect.Type, path string) (string, reflect.Type) {
	switch t.Kind() {
	case reflect.Bool, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr,
		reflect.Float32, reflect.Float64, reflect.Complex64, reflect.Complex128:
		return "", nil
	case reflect.Array:
		if t.Len() == 0 {
			return "", nil
		}
		return findGoPointer(t.Elem(), path+"[0]")
	case reflect.Struct:
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			if p, bad := findGoPointer(f.Type, path+"."+f.Name); bad != nil {
				return p, bad
			}
		}
		return "", nil
	default:
		return path, t
	}
}

func kindName(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Pointer:
		return "pointer"
	case reflect.UnsafePointer:
		return "unsafe.Pointer"
	case reflect.Chan:
		return "channel"
	case reflect.Func:
		return "function"
	default:
		return t.Kind().String()
	}
}

// typeName is T's name for messages, e.g. "float32" or "rmm.pair".
func typeName[T any]() string { return reflect.TypeFor[T]().String() }

// sizeOf is the size of T in bytes.
func sizeOf[T any]() int {
	var z T
	return int(unsafe.Sizeof(z))
}

// elemBytes returns n elements of T in bytes; false when that overflows int.
func elemBytes[T any](n int) (int, bool) {
	w := sizeOf[T]()
	if n < 0 || (w > 0 && n > math.MaxInt/w) {
		return 0, false
	}
	return n * w, true
}

// countErr is the error for a negative or overflowing element count.
func countErr[T any](op string, n int) error {
	if n < 0 {
		return errorf("%s: negative element count %d: %w", op, n, ErrInvalidArgument)
	}
	return errorf("%s: %d elements of %d bytes (%s) overflow int: %w", op, n, sizeOf[T](), typeName[T](), ErrInvalidArgument)
}

// valueBytes views *v as bytes (T holds no Go pointers).
func valueBytes[T any](v *T) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v))
}

// ---- DeviceSpan ----

// DeviceSpan is a non-owning view of n elements of T in memory from a MemoryResource: an
// address, an element count, the device and where the memory can be touched. It is what
// Uvector.Span, Subspan and Allocator.Allocate give; it is valid while the memory it views is.
// The zero value is an empty span.
type DeviceSpan[T any] struct {
	ptr    DevicePtr
	n      int
	dev    Device
	access Access
}

// NewDeviceSpan views n elements of T at p, memory of the given access on device dev (for memory
// allocated elsewhere). T must hold no Go pointers and n must not be negative (ErrInvalidArgument).
func NewDeviceSpan[T any](p DevicePtr, n int, dev Device, access Access) (DeviceSpan[T], error) {
	op := "NewDeviceSpan[" + typeName[T]() + "]"
	if err := checkElemType[T](op); err != nil {
		return DeviceSpan[T]{}, err
	}
	if _, ok := elemBytes[T](n); !ok {
		return DeviceSpan[T]{}, countErr[T](op, n)
	}
	if p == 0 && n > 0 {
		return DeviceSpan[T]{}, errorf("%s: null pointer with %d elements: %w", op, n, ErrInvalidArgument)
	}
	return DeviceSpan[T]{ptr: p, n: n, dev: dev, access: access}, nil
}

func (sp DeviceSpan[T]) kind() string { return "DeviceSpan[" + typeName[T]() + "]" }

func (sp DeviceSpan[T]) ref() memRef { return memRef{p: sp.ptr, access: sp.access, dev: sp.dev} }

// Data returns the address of the first element.
func (sp DeviceSpan[T]) Data() DevicePtr { return sp.ptr }

// Len returns the number of elements.
func (sp DeviceSpan[T]) Len() int { return sp.n }

// SizeBytes returns Len() * sizeof(T).
func (sp DeviceSpan[T]) SizeBytes() int { return sp.n * sizeOf[T]() }

// IsEmpty reports whether Len() == 0.
func (sp DeviceSpan[T]) IsEmpty() bool { return sp.n == 0 }

// Device returns the device of the memory.
func (sp DeviceSpan[T]) Device() Device { return sp.dev }

// Access reports where the memory can be touched.
func (sp DeviceSpan[T]) Access() Access { return sp.access }

// Span returns sp itself, so that a DeviceSpan is a SpanSource.
func (sp DeviceSpan[T]) Span() DeviceSpan[T] { return sp }

// Subspan returns the n elements starting at element offset. [offset, offset+n) must lie in
// [0, Len()], else the error wraps ErrOutOfRange and names the bounds.
func (sp DeviceSpan[T]) Subspan(offset, n int) (DeviceSpan[T], error) {
	if !inRange(offset, n, sp.n) {
		return DeviceSpan[T]{}, rangeErr(sp.kind()+".Subspan", offset, n, sp.n, "elements")
	}
	return DeviceSpan[T]{ptr: sp.ptr + DevicePtr(offset*sizeOf[T]()), n: n, dev: sp.dev, access: sp.access}, nil
}

// Fill writes v into every element: asynchronously on s on device memory (cuMemsetD8/16/32Async
// for 1-, 2- and 4-byte values, else the fill kernels), on the CPU at once on host memory. Memory
// with no access returns ErrNotSupported.
func (sp DeviceSpan[T]) Fill(v T, s StreamView) error {
	return fillMem(sp.kind()+".Fill", sp.ref(), sp.SizeBytes(), valueBytes(&v), s)
}

// CopyFromHost copies src into the first len(src) elements; complete at return
// (cuMemcpyHtoDAsync on s, then s synchronised). len(src) > Len() returns ErrOutOfRange.
func (sp DeviceSpan[T]) CopyFromHost(src []T, s StreamView) error {
	return spanFromHost(sp.kind()+".CopyFromHost", sp, src, s)
}

// CopyToHost copies the first len(dst) elements into dst; complete at return
// (cuMemcpyDtoHAsync on s, then s synchronised). len(dst) > Len() returns ErrOutOfRange.
func (sp DeviceSpan[T]) CopyToHost(dst []T, s StreamView) error {
	return spanToHost(sp.kind()+".CopyToHost", dst, sp, s)
}

// CopyFrom copies every element of src into the first src.Len() elements of sp; see
// Uvector.CopyFrom.
func (sp DeviceSpan[T]) CopyFrom(src SpanSource[T], s StreamView) error {
	return copySpans(sp.kind()+".CopyFrom", sp, src, s)
}

func spanFromHost[T any](op string, sp DeviceSpan[T], src []T, s StreamView) error {
	if len(src) > sp.n {
		return errorf("%s: %d elements do not fit in length %d: %w", op, len(src), sp.n, ErrOutOfRange)
	}
	return copyFromGo(op, sp.ref(), unsafe.Pointer(unsafe.SliceData(src)), len(src)*sizeOf[T](), s)
}

func spanToHost[T any](op string, dst []T, sp DeviceSpan[T], s StreamView) error {
	if len(dst) > sp.n {
		return errorf("%s: %d elements asked from length %d: %w", op, len(dst), sp.n, ErrOutOfRange)
	}
	return copyToGo(op, unsafe.Pointer(unsafe.SliceData(dst)), sp.ref(), len(dst)*sizeOf[T](), s)
}

// SpanSource is anything that views elements of T in device memory: *Uvector[T], *Scalar[T] and
// DeviceSpan[T].
type SpanSource[T any] interface {
	Span() DeviceSpan[T]
}

// copySpans copies all of src into the start of dst.
func copySpans[T any](op string, dst DeviceSpan[T], src SpanSource[T], s StreamView) error {
	if src == nil {
		return errorf("%s: nil source: %w", op, ErrInvalidArgument)
	}
	var st *memState
	switch u := src.(type) {
	case *Uvector[T]:
		if u == nil {
			return errorf("%s: nil source: %w", op, ErrInvalidArgument)
		}
		st = u.st
	case *Scalar[T]:
		if u == nil {
			return errorf("%s: nil source: %w", op, ErrInvalidArgument)
		}
		st = u.v.st
	}
	if st != nil && st.closed {
		return errorf("%s: the source %s was closed: %w", op, st.kind, ErrClosed)
	}
	sp := src.Span()
	if sp.n > dst.n {
		return errorf("%s: %d source elements do not fit in length %d: %w", op, sp.n, dst.n, ErrOutOfRange)
	}
	n := sp.SizeBytes()
	if n == 0 || sp.ptr == dst.ptr {
		return nil
	}
	if sp.ptr < dst.ptr+DevicePtr(n) && dst.ptr < sp.ptr+DevicePtr(n) {
		return errorf("%s: source [%#x, +%d) and destination [%#x, +%d) overlap: %w", op, uintptr(sp.ptr), n, uintptr(dst.ptr), n, ErrInvalidArgument)
	}
	return copyMem(op, dst.ref(), sp.ref(), n, s)
}

// ---- Uvector ----

// Uvector is a typed, uninitialized vector of elements of T in device memory (RMM's
// device_uvector): Len elements in an allocation of Cap elements from a MemoryResource, with the
// stream (the one it was allocated, last resized or set on with SetStream, on which Close
// frees it) and the device of the resource, recorded at construction.
// Counts and indices are in elements.
//
// T must hold no Go pointers (pointers, slices, maps, strings, channels, functions, interfaces,
// unsafe.Pointer, at any depth of arrays and structs): constructors refuse such types with
// ErrInvalidArgument. The elements are not initialized (there is no constructor that zeroes; use
// Fill).
//
// Where the work runs follows the memory, as for DeviceBuffer: device-accessible memory is filled
// and copied on the GPU, ordered on the stream passed to each call; host-only memory is handled by
// the CPU at once; memory with no access (SimulatedMemoryResource) returns ErrNotSupported for any
// data access. Methods that take or return Go values (SetElement, Element, CopyFromHost,
// CopyToHost, ToSlice) finish before they return (cgo forbids C from keeping Go memory).
//
// Close frees the memory; a vector dropped without Close is freed by a cleanup and the leak is
// reported to DebugLogger. A Uvector must not be copied by value, and is not safe for concurrent
// use by several goroutines.
//
// A nil *Uvector reads as an empty vector, as a nil slice does: Len, Cap and Data are 0, Span
// is empty, Stream is DefaultStream, MemoryResource is nil, Release returns nil, SetStream does
// nothing, ElementPtr panics as for any index out of range, and Close returns nil; every other
// call that can fail returns an error wrapping [ErrInvalidArgument] that names the nil vector.
//
// Make one with its constructor; the zero value is not usable.
type Uvector[T any] struct {
	noCopy  noCopy
	st      *memState
	cleanup runtime.Cleanup
}

// state is v's memory state, or a nil vector's (nilMemState).
func (v *Uvector[T]) state() *memState {
	if v == nil {
		return nilMemState(uvectorKind[T]())
	}
	return v.st
}

func uvectorKind[T any]() string { return "Uvector[" + typeName[T]() + "]" }

func newUvector[T any](st *memState) *Uvector[T] {
	v := &Uvector[T]{st: st}
	v.cleanup = runtime.AddCleanup(v, reclaimLeaked, st)
	return v
}

// NewUvector allocates n elements of T (exactly n*sizeof(T) bytes; nothing for 0) from mr on s;
// nil mr means CurrentDeviceResource(). The elements are uninitialized. A negative n, an n whose
// byte size overflows int, or an element type holding Go pointers returns ErrInvalidArgument; a
// failed allocation returns the resource's error (ErrOutOfMemory).
func NewUvector[T any](n int, s StreamView, mr MemoryResource) (*Uvector[T], error) {
	return newUvectorAs[T]("New"+uvectorKind[T](), n, s, mr)
}

// newUvectorAs is NewUvector for the constructor op, which its errors name.
func newUvectorAs[T any](op string, n int, s StreamView, mr MemoryResource) (*Uvector[T], error) {
	kind := uvectorKind[T]()
	if err := checkElemType[T](op); err != nil {
		return nil, err
	}
	nb, ok := elemBytes[T](n)
	if !ok {
		return nil, countErr[T](op, n)
	}
	st, err := newMemState(kind, nb, s, mr)
	if err != nil {
		return nil, errorf("%s(%d elements, %d bytes): %w", op, n, nb, err)
	}
	return newUvector[T](st), nil
}

// NewUvectorFromSlice allocates len(src) elements from mr (nil: the current device resource) on
// s and copies src into them; the copy is complete at return. On failure nothing stays allocated.
func NewUvectorFromSlice[T any](src []T, s StreamView, mr MemoryResource) (*Uvector[T], error) {
	op := "NewUvectorFromSlice[" + typeName[T]() + "]"
	v, err := newUvectorAs[T](op, len(src), s, mr)
	if err != nil {
		return nil, err
	}
	// The vector's own reference, not a span's: it names the resource in routeOf's errors.
	if err := copyFromGo(op, v.st.ref(), unsafe.Pointer(unsafe.SliceData(src)), len(src)*sizeOf[T](), s); err != nil {
		v.Close()
		return nil, err
	}
	return v, nil
}

// Copy returns a deep copy: Len() elements in a new vector with capacity Len(), allocated from mr
// (nil: the current device resource, not v's) on s and copied on s (asynchronously between device
// memories). The new vector's stream is s.
func (v *Uvector[T]) Copy(s StreamView, mr MemoryResource) (*Uvector[T], error) {
	defer runtime.KeepAlive(v) // the leak cleanup must not run during the call
	if v.state().closed {
		return nil, v.state().errClosed("Copy")
	}
	st, err := newMemState(v.state().kind, v.state().size, s, mr)
	if err != nil {
		return nil, errorf("%s.Copy(%d elements): %w", v.state().kind, v.Len(), err)
	}
	c := newUvector[T](st)
	if err := copyMem(v.state().kind+".Copy", st.ref(), v.state().ref(), v.state().size, s); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// Len returns the number of elements (0 after Close).
func (v *Uvector[T]) Len() int { return v.state().size / sizeOf[T]() }

// Cap returns the number of elements the allocation holds (0 after Close).
func (v *Uvector[T]) Cap() int { return v.state().capacity / sizeOf[T]() }

// SizeBytes returns Len() * sizeof(T).
func (v *Uvector[T]) SizeBytes() int { return v.state().size }

// IsEmpty reports whether Len() == 0 (the vector may still hold capacity).
func (v *Uvector[T]) IsEmpty() bool { return v.state().size == 0 }

// Data returns the address of the first element (0 when nothing is allocated or after Close).
func (v *Uvector[T]) Data() DevicePtr { return v.state().ptr }

// ElementPtr returns the address of element i. Like indexing a slice, it panics unless
// 0 ≤ i < Len().
func (v *Uvector[T]) ElementPtr(i int) DevicePtr {
	defer runtime.KeepAlive(v)
	if i < 0 || i >= v.Len() {
		panic(fmt.Sprintf("rmm: %s.ElementPtr: index %d out of range [0, %d)", v.state().kind, i, v.Len()))
	}
	return v.state().ptr + DevicePtr(i*sizeOf[T]())
}

// Span returns a view of the Len() elements (empty after Close).
func (v *Uvector[T]) Span() DeviceSpan[T] {
	defer runtime.KeepAlive(v)
	return DeviceSpan[T]{ptr: v.state().ptr, n: v.Len(), dev: v.state().dev, access: v.state().access}
}

// Stream returns the vector's stream: the one it was allocated on, or last resized on, or set
// with SetStream; Close frees it there. Calls that take a stream argument (fills, copies) do not
// change it: before Close, order work queued on other streams before this one (SetStream, or an
// Event), or the memory may be reused while that work still runs.
func (v *Uvector[T]) Stream() StreamView { return v.state().stream }

// SetStream sets the stream on which the memory is next freed or reallocated.
func (v *Uvector[T]) SetStream(s StreamView) { v.state().stream = s }

// MemoryResource returns the resource the memory came from.
func (v *Uvector[T]) MemoryResource() MemoryResource { return v.state().mr }

// Device returns the device recorded at construction.
func (v *Uvector[T]) Device() Device { return v.state().dev }

// Access reports where the memory can be touched.
func (v *Uvector[T]) Access() Access { return v.state().access }

// check returns ErrClosed after Close, or ErrOutOfRange (naming the index and the length) when
// i is outside [0, Len()).
func (v *Uvector[T]) check(op string, i int) error {
	defer runtime.KeepAlive(v)
	if v.state().closed {
		return v.state().errClosed(op)
	}
	if n := v.Len(); i < 0 || i >= n {
		return errorf("%s.%s: index %d, length %d: %w", v.state().kind, op, i, n, ErrOutOfRange)
	}
	return nil
}

func (v *Uvector[T]) elemRef(i int) memRef {
	defer runtime.KeepAlive(v)
	r := v.state().ref()
	r.p += DevicePtr(i * sizeOf[T]())
	return r
}

// Element returns element i, copied to the host (cuMemcpyDtoHAsync on s, then s synchronised).
// An index outside [0, Len()) returns ErrOutOfRange.
func (v *Uvector[T]) Element(i int, s StreamView) (T, error) {
	defer runtime.KeepAlive(v)
	var x T
	if err := v.check("Element", i); err != nil {
		return x, err
	}
	err := copyToGo(v.state().kind+".Element", unsafe.Pointer(&x), v.elemRef(i), sizeOf[T](), s)
	return x, err
}

// SetElement writes x into element i (cuMemcpyHtoDAsync on s, then s synchronised: the copy
// reads Go memory, so it is finished at return). The bytes are copied as they are: -0.0 stays
// -0.0. An index outside [0, Len()) returns ErrOutOfRange.
func (v *Uvector[T]) SetElement(i int, x T, s StreamView) error {
	defer runtime.KeepAlive(v)
	if err := v.check("SetElement", i); err != nil {
		return err
	}
	return copyFromGo(v.state().kind+".SetElement", v.elemRef(i), unsafe.Pointer(&x), sizeOf[T](), s)
}

// SetElementToZero sets the bytes of element i to zero, asynchronously on s on device memory
// (cuMemsetD8Async). An index outside [0, Len()) returns ErrOutOfRange.
func (v *Uvector[T]) SetElementToZero(i int, s StreamView) error {
	defer runtime.KeepAlive(v)
	if err := v.check("SetElementToZero", i); err != nil {
		return err
	}
	return fillMem(v.state().kind+".SetElementToZero", v.elemRef(i), sizeOf[T](), []byte{0}, s)
}

// Front returns the first element (as Element(0, s)); an empty vector returns ErrOutOfRange.
func (v *Uvector[T]) Front(s StreamView) (T, error) {
	defer runtime.KeepAlive(v)
	var z T
	if v.state().closed {
		return z, v.state().errClosed("Front")
	}
	if v.state().size == 0 {
		return z, errorf("%s.Front: empty vector: %w", v.state().kind, ErrOutOfRange)
	}
	return v.Element(0, s)
}

// Back returns the last element (as Element(Len()-1, s)); an empty vector returns ErrOutOfRange.
func (v *Uvector[T]) Back(s StreamView) (T, error) {
	defer runtime.KeepAlive(v)
	var z T
	if v.state().closed {
		return z, v.state().errClosed("Back")
	}
	if v.state().size == 0 {
		return z, errorf("%s.Back: empty vector: %w", v.state().kind, ErrOutOfRange)
	}
	return v.Element(v.Len()-1, s)
}

// Resize sets the length to n elements and makes s the stream. When n ≤ Cap() only the length
// changes (no allocation; shrinking keeps the capacity); otherwise exactly n elements are
// allocated on s, the old elements copied on s and the old memory freed on s. New elements are
// uninitialized. A negative or overflowing n returns ErrInvalidArgument; a failed allocation
// returns the resource's error and leaves the vector unchanged.
func (v *Uvector[T]) Resize(n int, s StreamView) error {
	defer runtime.KeepAlive(v)
	if v.state().closed {
		return v.state().errClosed("Resize")
	}
	op := fmt.Sprintf("%s.Resize(%d)", v.state().kind, n)
	nb, ok := elemBytes[T](n)
	if !ok {
		return countErr[T](op, n)
	}
	return v.state().resize(op, nb, s)
}

// Reserve grows the capacity to exactly n elements when n > Cap() (allocate on s, copy the
// elements on s, free the old on s); the length is unchanged and s becomes the stream. Errors as
// Resize.
func (v *Uvector[T]) Reserve(n int, s StreamView) error {
	defer runtime.KeepAlive(v)
	if v.state().closed {
		return v.state().errClosed("Reserve")
	}
	op := fmt.Sprintf("%s.Reserve(%d)", v.state().kind, n)
	nb, ok := elemBytes[T](n)
	if !ok {
		return countErr[T](op, n)
	}
	return v.state().reserve(op, nb, s)
}

// ShrinkToFit reallocates exactly Len() elements when Cap() is larger (copy and free on s); s
// becomes the stream. A failed allocation leaves the vector unchanged.
func (v *Uvector[T]) ShrinkToFit(s StreamView) error {
	defer runtime.KeepAlive(v)
	if v.state().closed {
		return v.state().errClosed("ShrinkToFit")
	}
	return v.state().shrinkToFit(v.state().kind+".ShrinkToFit", s)
}

// Release moves the memory into a new DeviceBuffer (with the vector's size and capacity in bytes,
// resource, stream and device) and leaves the vector empty, as device_uvector::release. The
// vector stays usable. After Close it returns nil.
func (v *Uvector[T]) Release() *DeviceBuffer {
	defer runtime.KeepAlive(v)
	if v.state().closed {
		return nil
	}
	st := *v.state()
	st.kind = "DeviceBuffer"
	v.state().ptr, v.state().size, v.state().capacity = 0, 0, 0
	return newDeviceBuffer(&st)
}

// CopyFromHost copies src into the first len(src) elements; complete at return. len(src) > Len()
// returns ErrOutOfRange.
func (v *Uvector[T]) CopyFromHost(src []T, s StreamView) error {
	defer runtime.KeepAlive(v)
	if v.state().closed {
		return v.state().errClosed("CopyFromHost")
	}
	return spanFromHost(v.state().kind+".CopyFromHost", v.Span(), src, s)
}

// CopyToHost copies the first len(dst) elements into dst; complete at return. len(dst) > Len()
// returns ErrOutOfRange.
func (v *Uvector[T]) CopyToHost(dst []T, s StreamView) error {
	defer runtime.KeepAlive(v)
	if v.state().closed {
		return v.state().errClosed("CopyToHost")
	}
	return spanToHost(v.state().kind+".CopyToHost", dst, v.Span(), s)
}

// ToSlice returns the Len() elements in a new Go slice; complete at return.
func (v *Uvector[T]) ToSlice(s StreamView) ([]T, error) {
	defer runtime.KeepAlive(v)
	if v.state().closed {
		return nil, v.state().errClosed("ToSlice")
	}
	if _, err := routeOf(v.state().kind+".ToSlice", v.state().ref()); err != nil {
		return nil, err // before allocating the result
	}
	out := make([]T, v.Len())
	if err := spanToHost(v.state().kind+".ToSlice", out, v.Span(), s); err != nil {
		return nil, err
	}
	return out, nil
}

// CopyFrom copies every element of src (a *Uvector[T] or a DeviceSpan[T]) into the first
// src.Len() elements of v. Between device memories it is asynchronous on s (cuMemcpyAsync);
// between host memories the CPU copies at once; between host-only and device memory the copy is
// ordered on s and s then synchronised. src longer than v returns ErrOutOfRange; overlapping
// ranges return ErrInvalidArgument; a closed source returns ErrClosed.
func (v *Uvector[T]) CopyFrom(src SpanSource[T], s StreamView) error {
	defer runtime.KeepAlive(v)
	if v.state().closed {
		return v.state().errClosed("CopyFrom")
	}
	return copySpans(v.state().kind+".CopyFrom", v.Span(), src, s)
}

// Fill writes x into every element: asynchronously on s on device memory (cuMemsetD8/16/32Async
// for 1-, 2- and 4-byte elements, the fill kernels otherwise), on the CPU on host memory.
// ErrClosed after Close or for a closed s; ErrNotSupported for memory that is neither host- nor
// device-accessible (a SimulatedMemoryResource's).
func (v *Uvector[T]) Fill(x T, s StreamView) error {
	defer runtime.KeepAlive(v)
	if v.state().closed {
		return v.state().errClosed("Fill")
	}
	return fillMem(v.state().kind+".Fill", v.state().ref(), v.state().size, valueBytes(&x), s)
}

// Close frees the capacity through the resource on Stream() and leaves the vector empty. Later
// calls that can fail return ErrClosed; closing again returns nil. An error of the resource's
// Deallocate is returned, and the vector is closed all the same.
func (v *Uvector[T]) Close() error {
	defer runtime.KeepAlive(v)
	if v.state().closed {
		return nil
	}
	v.cleanup.Stop()
	return v.state().close()
}
