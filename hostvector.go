package rmm

import (
	"fmt"
	"runtime"
	"unsafe"
)

// HostVector is a typed vector of elements of T in host memory from a HostMemoryResource — by
// default pinned memory from a process-wide PinnedMemoryResource — whose copies to and from device
// containers are truly asynchronous: CopyToDeviceAsync and CopyFromDeviceAsync queue the copy on
// a stream (cuMemcpyHtoDAsync / cuMemcpyDtoHAsync) and return at once, while the copy runs. This
// is allowed because the memory is not Go memory: the driver may keep using it after the call,
// which it may never do with a Go slice (Uvector.CopyFromHost and CopyToHost therefore wait).
// Counts and indices are in elements.
//
// Each asynchronous copy records an event on its stream. Every host access — Slice, At, Set,
// Resize, Close — first waits for all copies in flight (Wait), so the host never sees a
// half-copied vector. A copy queued on another stream while copies are in flight is ordered
// after them on the device (cuStreamWaitEvent), without blocking the host.
//
// Where the device side is host memory only (a SystemMemoryResource, or any container where
// there is no GPU), the copy is done by the CPU at once and nothing is in flight. So on a machine
// without CUDA everything is synchronous and a program behaves the same.
//
// T must hold no Go pointers (as for Uvector). New elements are zero. Close frees the memory; a
// vector dropped without Close is freed by a cleanup (after its copies finish) and the leak is
// reported to DebugLogger. A HostVector must not be copied by value, and is not safe for
// concurrent use by several goroutines.
//
// A nil *HostVector reads as an empty vector, as a nil slice does: Len and Cap are 0, Data and
// MemoryResource are nil, and Close returns nil; every other call that can fail returns an error
// wrapping [ErrInvalidArgument] that names the nil vector.
//
// Make one with NewHostVector; the zero value is not usable.
type HostVector[T any] struct {
	noCopy  noCopy
	st      *hostVecState
	cleanup runtime.Cleanup
}

// state is h's state, or a nil vector's: nothing allocated, and closed, so that every call that
// can fail returns errClosed's error, which names the nil vector.
func (h *HostVector[T]) state() *hostVecState {
	if h == nil {
		return &hostVecState{kind: hostVectorKind[T](), closed: true, isNil: true}
	}
	return h.st
}

// hostVecState is what a HostVector owns, apart from the vector so that its leak cleanup can
// hold it.
type hostVecState struct {
	mr       HostMemoryResource
	ptr      unsafe.Pointer
	size     int // bytes in use
	capacity int // bytes allocated
	kind     string
	closed   bool
	isNil    bool // the state of a nil vector (HostVector.state)
	events   []*hostCopyEvent
}

// hostCopyEvent is the event of one stream that copies to or from the vector.
type hostCopyEvent struct {
	dev     Device
	stream  StreamView
	ev      *Event
	pending bool // recorded after a copy that Wait has not yet waited for
}

func hostVectorKind[T any]() string { return "HostVector[" + typeName[T]() + "]" }

// NewHostVector allocates n zeroed elements of T (exactly n*sizeof(T) bytes, 256-byte aligned;
// nothing for 0) from mr; nil mr means the process-wide PinnedMemoryResource (device 0's
// context; plain host memory without CUDA). A negative n, an n whose byte size overflows int, or
// an element type holding Go pointers returns ErrInvalidArgument; a failed allocation returns the
// resource's error (ErrOutOfMemory).
func NewHostVector[T any](n int, mr HostMemoryResource) (*HostVector[T], error) {
	return newHostVectorAs[T]("New"+hostVectorKind[T](), n, mr)
}

// newHostVectorAs is NewHostVector for the constructor op, which its errors name.
func newHostVectorAs[T any](op string, n int, mr HostMemoryResource) (*HostVector[T], error) {
	kind := hostVectorKind[T]()
	if err := checkElemType[T](op); err != nil {
		return nil, err
	}
	nb, ok := elemBytes[T](n)
	if !ok {
		return nil, countErr[T](op, n)
	}
	if mr == nil {
		pinned, err := defaultPinnedResource()
		if err != nil {
			return nil, errorf("%s: the default pinned resource: %w", op, err)
		}
		mr = pinned
	}
	st := &hostVecState{mr: mr, kind: kind}
	if nb > 0 {
		p, err := mr.AllocateHost(nb, Alignment)
		if err != nil {
			return nil, errorf("%s(%d elements, %d bytes): %w", op, n, nb, err)
		}
		clear(unsafe.Slice((*byte)(p), nb))
		st.ptr = p
	}
	st.size, st.capacity = nb, nb
	h := &HostVector[T]{st: st}
	h.cleanup = runtime.AddCleanup(h, reclaimLeakedHost, st)
	return h, nil
}

// NewHostVectorFromSlice allocates len(src) elements from mr (nil: the default pinned resource)
// and copies src into them.
func NewHostVectorFromSlice[T any](src []T, mr HostMemoryResource) (*HostVector[T], error) {
	h, err := newHostVectorAs[T]("NewHostVectorFromSlice["+typeName[T]()+"]", len(src), mr)
	if err != nil {
		return nil, err
	}
	copy(h.view(), src)
	return h, nil
}

// Len returns the number of elements (0 after Close).
func (h *HostVector[T]) Len() int { return h.state().size / sizeOf[T]() }

// Cap returns the number of elements the allocation holds (0 after Close).
func (h *HostVector[T]) Cap() int { return h.state().capacity / sizeOf[T]() }

// SizeBytes returns Len() * sizeof(T).
func (h *HostVector[T]) SizeBytes() int { return h.state().size }

// Data returns the address of the first element (nil when nothing is allocated or after Close).
// It does not wait for copies in flight.
func (h *HostVector[T]) Data() unsafe.Pointer { return h.state().ptr }

// MemoryResource returns the resource the memory came from.
func (h *HostVector[T]) MemoryResource() HostMemoryResource { return h.state().mr }

// view is the elements as a slice, without waiting.
func (h *HostVector[T]) view() []T {
	if h.state().ptr == nil {
		return nil
	}
	return unsafe.Slice((*T)(h.state().ptr), h.Len())
}

// Wait blocks until every asynchronous copy to or from the vector has finished
// (cuEventSynchronize on the event recorded after each). With nothing in flight it returns at
// once. After Close it returns ErrClosed.
func (h *HostVector[T]) Wait() error {
	defer runtime.KeepAlive(h)
	if h.state().closed {
		return h.state().errClosed("Wait")
	}
	return h.state().wait()
}

// Pending reports whether copies may still be in flight: some copy was queued since the last
// wait and its event has not completed (cuEventQuery). It does not block. After Close it returns
// ErrClosed.
func (h *HostVector[T]) Pending() (bool, error) {
	defer runtime.KeepAlive(h)
	if h.state().closed {
		return false, h.state().errClosed("Pending")
	}
	for _, e := range h.state().events {
		if !e.pending {
			continue
		}
		done, err := e.ev.Query()
		if err != nil {
			return false, err
		}
		if !done {
			return true, nil
		}
		e.pending = false
	}
	return false, nil
}

// Slice waits for copies in flight and returns the elements as a Go slice over the vector's own
// memory (no copy). Writes through the slice change the vector. The slice is valid until the next
// Resize or Close, and only while the vector is reachable: keep using the vector (Close it after
// the last use of the slice). Do not touch it while a copy queued after this call may be running;
// call Wait (or Slice again) first.
func (h *HostVector[T]) Slice() ([]T, error) {
	defer runtime.KeepAlive(h)
	if h.state().closed {
		return nil, h.state().errClosed("Slice")
	}
	if err := h.state().wait(); err != nil {
		return nil, err
	}
	return h.view(), nil
}

// At waits for copies in flight and returns element i. An index outside [0, Len()) returns
// ErrOutOfRange.
func (h *HostVector[T]) At(i int) (T, error) {
	defer runtime.KeepAlive(h)
	var z T
	if err := h.check("At", i); err != nil {
		return z, err
	}
	if err := h.state().wait(); err != nil {
		return z, err
	}
	return h.view()[i], nil
}

// Set waits for copies in flight and sets element i to v. An index outside [0, Len()) returns
// ErrOutOfRange.
func (h *HostVector[T]) Set(i int, v T) error {
	defer runtime.KeepAlive(h)
	if err := h.check("Set", i); err != nil {
		return err
	}
	if err := h.state().wait(); err != nil {
		return err
	}
	h.view()[i] = v
	return nil
}

func (h *HostVector[T]) check(op string, i int) error {
	if h.state().closed {
		return h.state().errClosed(op)
	}
	if n := h.Len(); i < 0 || i >= n {
		return errorf("%s.%s: index %d, length %d: %w", h.state().kind, op, i, n, ErrOutOfRange)
	}
	return nil
}

// Resize waits for copies in flight and sets the length to n elements. Within the capacity only
// the length changes; beyond it exactly n elements are allocated, the old elements copied and the
// old memory freed. Elements past the old length are zero. A negative or overflowing n returns
// ErrInvalidArgument; a failed allocation returns the resource's error and leaves the vector as
// it was.
func (h *HostVector[T]) Resize(n int) error {
	defer runtime.KeepAlive(h)
	st := h.state()
	if st.closed {
		return st.errClosed("Resize")
	}
	op := fmt.Sprintf("%s.Resize(%d)", st.kind, n)
	nb, ok := elemBytes[T](n)
	if !ok {
		return countErr[T](op, n)
	}
	if err := st.wait(); err != nil {
		return err
	}
	if nb <= st.capacity {
		if nb > st.size {
			clear(unsafe.Slice((*byte)(unsafe.Add(st.ptr, st.size)), nb-st.size))
		}
		st.size = nb
		return nil
	}
	p, err := st.mr.AllocateHost(nb, Alignment)
	if err != nil {
		return errorf("%s: allocating %s: %w", op, bytesText(nb), err)
	}
	nbuf := unsafe.Slice((*byte)(p), nb)
	k := 0
	if st.size > 0 {
		k = copy(nbuf, unsafe.Slice((*byte)(st.ptr), st.size))
	}
	clear(nbuf[k:])
	old, oldCap := st.ptr, st.capacity
	st.ptr, st.size, st.capacity = p, nb, nb
	if old != nil {
		if err := st.mr.DeallocateHost(old, oldCap, Alignment); err != nil {
			return errorf("%s: freeing the previous %d bytes (the contents were moved): %w", op, oldCap, err)
		}
	}
	return nil
}

// CopyToDeviceAsync copies the Len() elements into the first Len() elements of dst (a *Uvector[T]
// or a DeviceSpan[T]), ordered on s. On device memory the copy is queued (cuMemcpyHtoDAsync, or
// cuMemcpyAsync when dst is also host-accessible) and the call returns while it runs: the vector
// must not be changed until it has finished (host access through the vector's methods waits for
// it). On host-only memory the CPU copies at once. dst shorter than Len() returns ErrOutOfRange; a
// nil or closed dst returns ErrInvalidArgument or ErrClosed; a closed stream ErrClosed.
func (h *HostVector[T]) CopyToDeviceAsync(dst SpanSource[T], s StreamView) error {
	defer runtime.KeepAlive(h)
	defer runtime.KeepAlive(dst)
	op := h.state().kind + ".CopyToDeviceAsync"
	if h.state().closed {
		return h.state().errClosed("CopyToDeviceAsync")
	}
	sp, err := hostSpanOf(op, dst)
	if err != nil {
		return err
	}
	if h.Len() > sp.n {
		return errorf("%s: %d elements do not fit in a destination of length %d: %w", op, h.Len(), sp.n, ErrOutOfRange)
	}
	return h.state().copyAsync(op, sp.ref(), true, h.state().size, s)
}

// CopyFromDeviceAsync copies every element of src (a *Uvector[T], *Scalar[T] or DeviceSpan[T])
// into the first src.Len() elements of the vector, ordered on s. On device memory the copy is
// queued (cuMemcpyDtoHAsync, or cuMemcpyAsync when src is also host-accessible) and the call
// returns while it runs: read the elements through Slice, At or after Wait, which wait for it.
// On host-only memory the CPU copies at once. src longer than Len() returns ErrOutOfRange; a nil
// or closed src ErrInvalidArgument or ErrClosed; a closed stream ErrClosed.
func (h *HostVector[T]) CopyFromDeviceAsync(src SpanSource[T], s StreamView) error {
	defer runtime.KeepAlive(h)
	defer runtime.KeepAlive(src)
	op := h.state().kind + ".CopyFromDeviceAsync"
	if h.state().closed {
		return h.state().errClosed("CopyFromDeviceAsync")
	}
	sp, err := hostSpanOf(op, src)
	if err != nil {
		return err
	}
	if sp.n > h.Len() {
		return errorf("%s: %d source elements do not fit in length %d: %w", op, sp.n, h.Len(), ErrOutOfRange)
	}
	return h.state().copyAsync(op, sp.ref(), false, sp.SizeBytes(), s)
}

// Close waits for copies in flight, destroys the vector's events and frees the memory through the
// resource. Later calls that can fail return ErrClosed; closing again returns nil. An error
// waiting or freeing is returned, and the vector is closed all the same.
func (h *HostVector[T]) Close() error {
	defer runtime.KeepAlive(h)
	if h.state().closed {
		return nil
	}
	h.cleanup.Stop()
	return h.state().close()
}

// hostSpanOf returns the span of a device container, refusing nil and closed ones.
func hostSpanOf[T any](op string, src SpanSource[T]) (DeviceSpan[T], error) {
	var st *memState
	switch u := src.(type) {
	case nil:
		return DeviceSpan[T]{}, errorf("%s: nil device container: %w", op, ErrInvalidArgument)
	case *Uvector[T]:
		if u == nil {
			return DeviceSpan[T]{}, errorf("%s: nil device container: %w", op, ErrInvalidArgument)
		}
		st = u.st
	case *Scalar[T]:
		if u == nil {
			return DeviceSpan[T]{}, errorf("%s: nil device container: %w", op, ErrInvalidArgument)
		}
		st = u.v.st
	}
	if st != nil && st.closed {
		return DeviceSpan[T]{}, errorf("%s: the device container %s was closed: %w", op, st.kind, ErrClosed)
	}
	return src.Span(), nil
}

func (st *hostVecState) errClosed(op string) error {
	if st.isNil {
		return errorf("%s.%s: called on a nil *%s: %w", st.kind, op, st.kind, ErrInvalidArgument)
	}
	return errorf("%s.%s: called after Close: %w", st.kind, op, ErrClosed)
}

// wait synchronises every pending event; an event that fails stays pending.
func (st *hostVecState) wait() error {
	for _, e := range st.events {
		if !e.pending {
			continue
		}
		if err := e.ev.Synchronize(); err != nil {
			return errorf("%s: waiting for copies on %v: %w", st.kind, e.stream, err)
		}
		e.pending = false
	}
	return nil
}

// copyAsync copies n bytes between the vector and dev (toDevice: from the vector), ordered on
// s, as CopyToDeviceAsync and CopyFromDeviceAsync describe.
func (st *hostVecState) copyAsync(op string, dev memRef, toDevice bool, n int, s StreamView) error {
	if s.closed() {
		return errStreamClosed(op, s)
	}
	if n == 0 {
		return nil
	}
	r, err := routeOf(op, dev)
	if err != nil {
		return err
	}
	if r == routeHost {
		if err := st.wait(); err != nil {
			return err
		}
		host := unsafe.Slice((*byte)(st.ptr), n)
		if toDevice {
			copy(hostBytes(dev.p, n), host)
		} else {
			copy(host, hostBytes(dev.p, n))
		}
		return nil
	}
	d := s.deviceFor(dev.dev)
	ctx, err := d.ctx()
	if err != nil {
		return err
	}
	// Copies in flight on other streams touch the same host memory: order this one after them
	// on the device.
	for _, e := range st.events {
		if e.pending && (e.stream != s || e.dev != d) {
			if err := cuStreamWaitEvent(ctx, s.cu(), e.ev.h); err != nil {
				return errorf("%s: ordering after copies on %v: %w", op, e.stream, err)
			}
		}
	}
	e, err := st.eventFor(d, s)
	if err != nil {
		return errorf("%s: %w", op, err)
	}
	hp := uintptr(st.ptr)
	switch {
	case dev.access&HostAccessible != 0 && toDevice: // pinned or managed: unified addressing
		err = cuMemcpyAsync(ctx, uintptr(dev.p), hp, n, s.cu())
	case dev.access&HostAccessible != 0:
		err = cuMemcpyAsync(ctx, hp, uintptr(dev.p), n, s.cu())
	case toDevice:
		err = cuMemcpyHtoDAsyncPtr(ctx, dev.p, hp, n, s.cu())
	default:
		err = cuMemcpyDtoHAsyncPtr(ctx, hp, dev.p, n, s.cu())
	}
	if err != nil {
		return errorf("%s: copying %s on %v: %w", op, bytesText(n), s, err)
	}
	if err := e.ev.Record(s); err != nil {
		// The copy is queued but cannot be waited for by event: wait for it now.
		serr := cuStreamSynchronize(ctx, s.cu())
		return errorf("%s: recording the copy's event on %v (stream synchronised: %v): %w", op, s, serr, err)
	}
	e.pending = true
	return nil
}

// eventFor returns the vector's event for stream s on device d, creating it on first use.
func (st *hostVecState) eventFor(d Device, s StreamView) (*hostCopyEvent, error) {
	for _, e := range st.events {
		if e.stream == s && e.dev == d {
			return e, nil
		}
	}
	ev, err := NewEvent(d, nil)
	if err != nil {
		return nil, err
	}
	e := &hostCopyEvent{dev: d, stream: s, ev: ev}
	st.events = append(st.events, e)
	return e, nil
}

// close waits, destroys the events and frees the memory.
func (st *hostVecState) close() error {
	err := st.wait()
	for _, e := range st.events {
		if cerr := e.ev.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}
	st.events = nil
	p, n := st.ptr, st.capacity
	st.ptr, st.size, st.capacity, st.closed = nil, 0, 0, true
	if p != nil {
		if ferr := st.mr.DeallocateHost(p, n, Alignment); ferr != nil && err == nil {
			err = ferr
		}
	}
	if err != nil {
		return errorf("%s.Close: %w", st.kind, err)
	}
	return nil
}

// reclaimLeakedHost is the cleanup of a HostVector that became unreachable without Close.
func reclaimLeakedHost(st *hostVecState) {
	if st.closed {
		return
	}
	n := st.capacity
	err := st.close()
	if n == 0 && err == nil {
		return
	}
	attrs := []any{"type", st.kind, "bytes", n, "resource", resourceName(st.mr)}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	DebugLogger().Warn("rmm: host vector reclaimed without Close (leak)", attrs...)
}
