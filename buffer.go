package rmm

import (
	"fmt"
	"runtime"
	"unsafe"
)

// noCopy makes `go vet` (copylocks) report containers copied by value: a copy would share the
// memory and free it twice.
type noCopy struct{}

func (*noCopy) Lock()   {}
func (*noCopy) Unlock() {}

// memState is what a container owns: one allocation and what is needed to free it. It lives
// apart from the container so that the cleanup that reclaims a leaked container's memory can hold
// it without keeping the container reachable.
type memState struct {
	ptr      DevicePtr
	size     int // bytes in use
	capacity int // bytes allocated (what Deallocate is given)
	stream   StreamView
	mr       MemoryResource
	dev      Device
	access   Access
	kind     string // "DeviceBuffer", "Uvector[float32]", ... for messages
	closed   bool
	isNil    bool // the state of a nil container (nilMemState)
}

// nilMemState is what a nil container of kind reads as: nothing allocated, the default stream,
// no resource, and closed, so that every call that can fail returns errClosed's error (which
// names the nil container). Each call gets its own, so that nothing is shared.
func nilMemState(kind string) *memState { return &memState{kind: kind, closed: true, isNil: true} }

// newMemState allocates nbytes (exactly, none for 0) from mr, or the current device resource when
// mr is nil, on s.
func newMemState(kind string, nbytes int, s StreamView, mr MemoryResource) (*memState, error) {
	// Refused whatever the resource: one that ignores streams would allocate, and the container
	// would keep a stream that its next operation refuses.
	if s.closed() {
		return nil, errStreamClosed("allocating", s)
	}
	mr = resourceOrCurrent(mr)
	st := &memState{stream: s, mr: mr, dev: DeviceOf(mr), access: AccessOf(mr), kind: kind}
	if nbytes > 0 {
		p, err := mr.Allocate(nbytes, s)
		if err != nil {
			return nil, err
		}
		st.ptr = p
	}
	st.size, st.capacity = nbytes, nbytes
	return st, nil
}

// ref is the allocation as one end of a copy or fill.
func (st *memState) ref() memRef { return memRef{p: st.ptr, access: st.access, dev: st.dev, mr: st.mr} }

// reallocate moves the first keep bytes into a new allocation of exactly newCap bytes, ordered on
// s, frees the old allocation on s and makes s the stream. When the allocation or the copy fails
// the state is unchanged. On memory with no access (SimulatedMemoryResource) only the addresses
// change: there are no bytes to copy.
func (st *memState) reallocate(op string, newCap, keep int, s StreamView) error {
	var p DevicePtr
	if newCap > 0 {
		var err error
		if p, err = st.mr.Allocate(newCap, s); err != nil {
			return errorf("%s: allocating %s: %w", op, bytesText(newCap), err)
		}
	}
	if keep > 0 && st.access != 0 {
		if err := copyMem(op, memRef{p, st.access, st.dev, st.mr}, st.ref(), keep, s); err != nil {
			_ = st.mr.Deallocate(p, newCap, s)
			return err
		}
	}
	oldPtr, oldCap := st.ptr, st.capacity
	st.ptr, st.capacity, st.stream = p, newCap, s
	if oldCap > 0 || oldPtr != 0 {
		if err := st.mr.Deallocate(oldPtr, oldCap, s); err != nil {
			return errorf("%s: freeing the previous %s at %#x (the contents were moved): %w", op, bytesText(oldCap), uintptr(oldPtr), err)
		}
	}
	return nil
}

// resize sets the size to n bytes: within the capacity only the size changes (shrinking keeps the
// capacity); beyond it exactly n bytes are allocated and the old size copied. s becomes the
// stream on success.
func (st *memState) resize(op string, n int, s StreamView) error {
	if n <= st.capacity {
		st.size, st.stream = n, s
		return nil
	}
	if err := st.reallocate(op, n, st.size, s); err != nil {
		return err
	}
	st.size = n
	return nil
}

// reserve grows the capacity to exactly n bytes when n exceeds it; the size stays.
func (st *memState) reserve(op string, n int, s StreamView) error {
	if n <= st.capacity {
		st.stream = s
		return nil
	}
	return st.reallocate(op, n, st.size, s)
}

// shrinkToFit reallocates exactly size bytes when the capacity is larger.
func (st *memState) shrinkToFit(op string, s StreamView) error {
	if st.size == st.capacity {
		st.stream = s
		return nil
	}
	return st.reallocate(op, st.size, st.size, s)
}

// close frees the capacity on the stream and empties the state.
func (st *memState) close() error {
	if st.closed {
		return nil
	}
	p, n := st.ptr, st.capacity
	st.ptr, st.size, st.capacity, st.closed = 0, 0, 0, true
	if p == 0 && n == 0 {
		return nil
	}
	if err := st.mr.Deallocate(p, n, st.stream); err != nil {
		return errorf("%s.Close: freeing %s at %#x: %w", st.kind, bytesText(n), uintptr(p), err)
	}
	return nil
}

// errClosed is the error of every method called after Close, or on a nil container.
func (st *memState) errClosed(op string) error {
	if st.isNil {
		return errorf("%s.%s: called on a nil *%s: %w", st.kind, op, st.kind, ErrInvalidArgument)
	}
	return errorf("%s.%s: called after Close: %w", st.kind, op, ErrClosed)
}

// reclaimLeaked is the cleanup of a container that became unreachable without Close: it frees
// the memory through its resource on its stream and says so in the debug log.
func reclaimLeaked(st *memState) {
	if st.closed || (st.ptr == 0 && st.capacity == 0) {
		return
	}
	p, n := st.ptr, st.capacity
	st.ptr, st.size, st.capacity, st.closed = 0, 0, 0, true
	err := st.mr.Deallocate(p, n, st.stream)
	attrs := []any{"type", st.kind, "bytes", n, "ptr", fmt.Sprintf("%#x", uintptr(p)),
		"resource", resourceName(st.mr), "stream", st.stream.String()}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	DebugLogger().Warn("rmm: container reclaimed without Close (leak)", attrs...)
}

// ---- where memory is, and how to copy and fill it ----

// memRef is one end of a copy or a fill: an address, where it can be touched, its device, and
// the resource it came from when known (nil for a span), for routeOf's errors.
type memRef struct {
	p      DevicePtr
	access Access
	dev    Device
	mr     MemoryResource
}

// route is how memory of some access is read and written.
type route int

const (
	routeDevice route = iota // driver copies and kernels, ordered on the stream
	routeHost                // the CPU, at once
)

// routeOf picks the device path for device-accessible memory when CUDA is available, else the
// CPU for host-accessible memory. Memory with no access gives ErrNotSupported; device-only memory
// without CUDA gives the reason CUDA is unavailable (ErrNoDevice), and says so when the memory was
// taken as device memory because its resource does not report its Access (AccessOf).
func routeOf(op string, m memRef) (route, error) {
	a := m.access
	if a&DeviceAccessible != 0 {
		err := CUDAAvailable()
		if err == nil {
			return routeDevice, nil
		}
		if a&HostAccessible == 0 {
			if m.mr != nil {
				if _, silent := accessOf(m.mr); silent != nil {
					return 0, errorf("%s: %s does not implement Access or Upstream, so its memory is taken as device memory: %w", op, resourceName(silent), err)
				}
			}
			return 0, errorf("%s: device memory: %w", op, err)
		}
	}
	if a&HostAccessible != 0 {
		return routeHost, nil
	}
	return 0, errorf("%s: the memory has no access (an address-only resource such as SimulatedMemoryResource): it cannot be read or written: %w", op, ErrNotSupported)
}

// memRoute is the start every copy and fill makes: ErrClosed for a closed s, nothing to do
// (skip) for n == 0, else the route to the memory of access a.
func memRoute(op string, m memRef, n int, s StreamView) (r route, skip bool, err error) {
	if s.closed() {
		return 0, false, errStreamClosed(op, s)
	}
	if n == 0 {
		return 0, true, nil
	}
	r, err = routeOf(op, m)
	return r, false, err
}

// copyMem copies n bytes from src to dst (not overlapping), choosing by where each lies:
//   - both device-accessible: deviceCopy (cuMemcpyAsync), asynchronous on s;
//   - both host-accessible: the CPU (after synchronising s when one end is also device memory
//     that work on s may still be using);
//   - host-only and device memory: cuMemcpyHtoDAsync / cuMemcpyDtoHAsync on s, then s is
//     synchronised, because the host end is then touched by the CPU without stream order.
func copyMem(op string, dst, src memRef, n int, s StreamView) error {
	dr, skip, err := memRoute(op, dst, n, s)
	if skip || err != nil {
		return err
	}
	sr, err := routeOf(op, src)
	if err != nil {
		return err
	}
	switch {
	case dr == routeDevice && sr == routeDevice:
		// In the stream's context when it has a device (the ends may lie on two devices: a peer
		// copy through unified addressing), else in the destination's.
		if err := deviceCopy(s.deviceFor(dst.dev), dst.p, src.p, n, s); err != nil {
			return errorf("%s: copying %s: %w", op, bytesText(n), err)
		}
		return nil
	case dst.access&HostAccessible != 0 && src.access&HostAccessible != 0:
		if dr == routeDevice || sr == routeDevice {
			dev := dst.dev
			if dr != routeDevice {
				dev = src.dev
			}
			if err := syncStream(dev, s); err != nil {
				return errorf("%s: %w", op, err)
			}
		}
		copy(hostBytes(dst.p, n), hostBytes(src.p, n))
		return nil
	case dr == routeDevice: // src is host-only memory outside the Go heap
		ctx, err := dst.dev.ctx()
		if err == nil {
			err = cuMemcpyHtoDAsyncPtr(ctx, dst.p, uintptr(src.p), n, s.cu())
		}
		if err == nil {
			err = cuStreamSynchronize(ctx, s.cu())
		}
		if err != nil {
			return errorf("%s: copying %s from host to device: %w", op, bytesText(n), err)
		}
		return nil
	default: // dst is host-only, src device memory
		ctx, err := src.dev.ctx()
		if err == nil {
			err = cuMemcpyDtoHAsyncPtr(ctx, uintptr(dst.p), src.p, n, s.cu())
		}
		if err == nil {
			err = cuStreamSynchronize(ctx, s.cu())
		}
		if err != nil {
			return errorf("%s: copying %s from device to host: %w", op, bytesText(n), err)
		}
		return nil
	}
}

// copyFromAddr copies n bytes from src, an address of unknown kind, to dst. With CUDA the
// driver infers the source's kind through unified addressing (cuMemcpyAsync on s; s is then
// synchronised when dst is host-only memory). Without CUDA src must be host memory.
func copyFromAddr(op string, dst memRef, src DevicePtr, n int, s StreamView) error {
	dr, skip, err := memRoute(op, dst, n, s)
	if skip || err != nil {
		return err
	}
	if CUDAAvailable() != nil {
		copy(hostBytes(dst.p, n), hostBytes(src, n))
		return nil
	}
	ctx, err := dst.dev.ctx()
	if err == nil {
		err = cuMemcpyAsync(ctx, uintptr(dst.p), uintptr(src), n, s.cu())
	}
	if err == nil && dr != routeDevice {
		err = cuStreamSynchronize(ctx, s.cu())
	}
	if err != nil {
		return errorf("%s: copying %s from %#x: %w", op, bytesText(n), uintptr(src), err)
	}
	return nil
}

// copyFromGo copies Go memory (which must hold no Go pointers) to dst; finished at return
// (cuMemcpyHtoDAsync on s, then s synchronised, in one driver call).
func copyFromGo(op string, dst memRef, src unsafe.Pointer, n int, s StreamView) error {
	r, skip, err := memRoute(op, dst, n, s)
	if skip || err != nil {
		return err
	}
	if r == routeHost {
		copy(hostBytes(dst.p, n), unsafe.Slice((*byte)(src), n))
		return nil
	}
	ctx, err := dst.dev.ctx()
	if err == nil {
		err = cuMemcpyHtoDSync(ctx, dst.p, src, n, s.cu())
	}
	if err != nil {
		return errorf("%s: copying %s from host: %w", op, bytesText(n), err)
	}
	return nil
}

// copyToGo copies n bytes at src into Go memory; finished at return (cuMemcpyDtoHAsync on s,
// then s synchronised).
func copyToGo(op string, dst unsafe.Pointer, src memRef, n int, s StreamView) error {
	r, skip, err := memRoute(op, src, n, s)
	if skip || err != nil {
		return err
	}
	if r == routeHost {
		copy(unsafe.Slice((*byte)(dst), n), hostBytes(src.p, n))
		return nil
	}
	ctx, err := src.dev.ctx()
	if err == nil {
		err = cuMemcpyDtoHSync(ctx, dst, src.p, n, s.cu())
	}
	if err != nil {
		return errorf("%s: copying %s to host: %w", op, bytesText(n), err)
	}
	return nil
}

// fillMem writes elem repeatedly over nbytes at dst (nbytes a multiple of len(elem)): deviceFill
// (driver memset or fill kernels, asynchronous on s) on device memory, the CPU on host memory.
func fillMem(op string, dst memRef, nbytes int, elem []byte, s StreamView) error {
	r, skip, err := memRoute(op, dst, nbytes, s)
	if skip || err != nil {
		return err
	}
	if r == routeHost {
		hostFill(hostBytes(dst.p, nbytes), elem)
		return nil
	}
	if err := deviceFill(dst.dev, dst.p, nbytes, elem, s); err != nil {
		return errorf("%s: filling %s with a %d-byte value: %w", op, bytesText(nbytes), len(elem), err)
	}
	return nil
}

// hostFill writes elem over b (len(b) a multiple of len(elem)): once, then by doubling copies.
func hostFill(b, elem []byte) {
	if len(b) == 0 {
		return
	}
	n := copy(b, elem)
	for n < len(b) {
		n += copy(b[n:], b[:n])
	}
}

// syncStream waits for s on dev (cuStreamSynchronize).
func syncStream(dev Device, s StreamView) error {
	ctx, err := dev.ctx()
	if err != nil {
		return err
	}
	return cuStreamSynchronize(ctx, s.cu())
}

// rangeErr is the error for bytes [off, off+n) outside a container of length size.
func rangeErr(op string, off, n, size int, unit string) error {
	return errorf("%s: %s [%d, %d+%d) outside length %d: %w", op, unit, off, off, n, size, ErrOutOfRange)
}

// inRange reports whether [off, off+n) lies in [0, size) without overflow.
func inRange(off, n, size int) bool { return off >= 0 && n >= 0 && off <= size && n <= size-off }

// ---- DeviceBuffer ----

// DeviceBuffer is an untyped, uninitialized allocation of device memory (RMM's device_buffer):
// a size in bytes, a capacity in bytes, the MemoryResource it came from, its stream (the one it
// was allocated, last resized or set on with SetStream, on which Close frees it), and the device
// of that resource, recorded at construction and used for every later call.
//
// Memory comes from the resource, aligned to Alignment (256 bytes). Copies and fills on
// device-accessible memory are ordered on the stream passed to each call and run on the GPU;
// methods that read or write Go memory (CopyFromHost, CopyToHost, Bytes) finish before they return.
// On host-only memory (a SystemMemoryResource, the current device resource where there is no
// GPU) everything runs on the CPU at once. Memory with no access (SimulatedMemoryResource) can be
// allocated and resized but not read or written: those calls return ErrNotSupported.
//
// Close frees the memory; a buffer dropped without Close is freed by a cleanup once the collector
// finds it unreachable, and the leak is reported to DebugLogger. A DeviceBuffer must not be copied
// by value, and is not safe for concurrent use by several goroutines.
//
// A nil *DeviceBuffer reads as an empty buffer, as a nil slice does: Len, Cap and Data are 0,
// Stream is DefaultStream, MemoryResource is nil, Release returns (0, 0), SetStream does nothing
// and Close returns nil; every other call that can fail returns an error wrapping
// [ErrInvalidArgument] that names the nil buffer.
//
// Make one with its constructor; the zero value is not usable.
type DeviceBuffer struct {
	noCopy  noCopy
	st      *memState
	cleanup runtime.Cleanup
}

// state is b's memory state, or a nil buffer's (nilMemState).
func (b *DeviceBuffer) state() *memState {
	if b == nil {
		return nilMemState("DeviceBuffer")
	}
	return b.st
}

func newDeviceBuffer(st *memState) *DeviceBuffer {
	b := &DeviceBuffer{st: st}
	b.cleanup = runtime.AddCleanup(b, reclaimLeaked, st)
	return b
}

// NewDeviceBuffer allocates size bytes (exactly; nothing for 0) from mr on stream s; nil mr means
// CurrentDeviceResource(). The contents are uninitialized. A negative size returns
// ErrInvalidArgument; a failed allocation returns the resource's error (ErrOutOfMemory).
func NewDeviceBuffer(size int, s StreamView, mr MemoryResource) (*DeviceBuffer, error) {
	return newDeviceBufferAs("NewDeviceBuffer", size, s, mr)
}

// newDeviceBufferAs is NewDeviceBuffer for the constructor op, which its errors name.
func newDeviceBufferAs(op string, size int, s StreamView, mr MemoryResource) (*DeviceBuffer, error) {
	if size < 0 {
		return nil, errorf("%s: negative size %d: %w", op, size, ErrInvalidArgument)
	}
	st, err := newMemState("DeviceBuffer", size, s, mr)
	if err != nil {
		return nil, errorf("%s(%d bytes): %w", op, size, err)
	}
	return newDeviceBuffer(st), nil
}

// NewDeviceBufferFromHost allocates len(src) bytes from mr (nil: the current device resource) on
// s and copies src into them; the copy is complete when it returns (cuMemcpyHtoDAsync, then s
// synchronised). On failure nothing stays allocated.
func NewDeviceBufferFromHost(src []byte, s StreamView, mr MemoryResource) (*DeviceBuffer, error) {
	b, err := newDeviceBufferAs("NewDeviceBufferFromHost", len(src), s, mr)
	if err != nil {
		return nil, err
	}
	if err := copyFromGo("NewDeviceBufferFromHost", b.st.ref(), bytesPtr(src), len(src), s); err != nil {
		b.Close()
		return nil, err
	}
	return b, nil
}

// NewDeviceBufferFromDevice allocates size bytes from mr (nil: the current device resource) on s
// and copies size bytes at src into them, asynchronously on s (cuMemcpyAsync; the driver tells
// device, managed and host addresses apart by unified addressing). src must not be Go memory.
// Without CUDA src must be host memory. A zero src with size > 0 returns ErrInvalidArgument and
// allocates nothing.
func NewDeviceBufferFromDevice(src DevicePtr, size int, s StreamView, mr MemoryResource) (*DeviceBuffer, error) {
	if src == 0 && size > 0 {
		return nil, errorf("NewDeviceBufferFromDevice: null source with size %d: %w", size, ErrInvalidArgument)
	}
	b, err := newDeviceBufferAs("NewDeviceBufferFromDevice", size, s, mr)
	if err != nil {
		return nil, err
	}
	if err := copyFromAddr("NewDeviceBufferFromDevice", b.st.ref(), src, size, s); err != nil {
		b.Close()
		return nil, err
	}
	return b, nil
}

// AdoptDeviceBuffer makes a DeviceBuffer own size bytes at p that were allocated elsewhere from mr
// on stream s (mr.Allocate(size, s) returned p, or an equivalent allocation mr can free): the
// buffer's Len and Cap are size, its resource mr, its stream s, and Close, Resize, Reserve and
// ShrinkToFit free p through mr.Deallocate(p, size, s) as for a buffer the package allocated.
// Nothing is allocated or copied. The caller must no longer free p itself. A nil mr, a negative
// size, or a zero p with size > 0 returns ErrInvalidArgument; (0, 0) is an empty buffer.
func AdoptDeviceBuffer(p DevicePtr, size int, s StreamView, mr MemoryResource) (*DeviceBuffer, error) {
	switch {
	case mr == nil:
		return nil, errorf("AdoptDeviceBuffer(%#x, %d): no resource to free the memory with: %w", uintptr(p), size, ErrInvalidArgument)
	case size < 0:
		return nil, errorf("AdoptDeviceBuffer: negative size %d: %w", size, ErrInvalidArgument)
	case p == 0 && size > 0:
		return nil, errorf("AdoptDeviceBuffer: null pointer with size %d: %w", size, ErrInvalidArgument)
	}
	st := &memState{ptr: p, size: size, capacity: size, stream: s, mr: mr, dev: DeviceOf(mr), access: AccessOf(mr), kind: "DeviceBuffer"}
	return newDeviceBuffer(st), nil
}

// Copy returns a deep copy of b's Len() bytes in a new buffer whose capacity equals that size,
// allocated from mr (nil: the current device resource, not b's resource) on s, copied on s
// (asynchronously between device memories). The new buffer's stream is s.
func (b *DeviceBuffer) Copy(s StreamView, mr MemoryResource) (*DeviceBuffer, error) {
	defer runtime.KeepAlive(b) // the leak cleanup must not run during the call
	if b.state().closed {
		return nil, b.state().errClosed("Copy")
	}
	st, err := newMemState("DeviceBuffer", b.state().size, s, mr)
	if err != nil {
		return nil, errorf("DeviceBuffer.Copy(%d bytes): %w", b.state().size, err)
	}
	c := newDeviceBuffer(st)
	if err := copyMem("DeviceBuffer.Copy", st.ref(), b.state().ref(), b.state().size, s); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// Data returns the address of the first byte (0 when nothing is allocated or after Close).
func (b *DeviceBuffer) Data() DevicePtr { return b.state().ptr }

// Len returns the size in bytes (0 after Close).
func (b *DeviceBuffer) Len() int { return b.state().size }

// Cap returns the capacity in bytes: what is allocated, at least Len (0 after Close).
func (b *DeviceBuffer) Cap() int { return b.state().capacity }

// IsEmpty reports whether Len() == 0; an empty buffer may still hold capacity.
func (b *DeviceBuffer) IsEmpty() bool { return b.state().size == 0 }

// Stream returns the buffer's stream: the one it was allocated on, or last resized on, or set
// with SetStream; Close frees it there. Calls that take a stream argument (fills, copies) do not
// change it: before Close, order work queued on other streams before this one (SetStream, or an
// Event), or the memory may be reused while that work still runs.
func (b *DeviceBuffer) Stream() StreamView { return b.state().stream }

// SetStream sets the stream on which the memory is next freed or reallocated. The caller keeps
// the order: work on the old stream that uses the memory must be ordered before the new one.
func (b *DeviceBuffer) SetStream(s StreamView) { b.state().stream = s }

// MemoryResource returns the resource the memory came from (and is freed through).
func (b *DeviceBuffer) MemoryResource() MemoryResource { return b.state().mr }

// Device returns the device recorded at construction (DeviceOf the resource).
func (b *DeviceBuffer) Device() Device { return b.state().dev }

// Access reports where the memory can be touched (AccessOf the resource).
func (b *DeviceBuffer) Access() Access { return b.state().access }

// Resize sets the size to n bytes and makes s the stream. When n ≤ Cap() only the size changes
// (no allocation; shrinking keeps the capacity). Otherwise exactly n bytes are allocated on s, the
// old Len() bytes copied on s, and the old memory freed on s. Bytes past the old size are
// uninitialized. Nothing is synchronised. A negative n returns ErrInvalidArgument; a failed
// allocation returns the resource's error and leaves the buffer unchanged.
func (b *DeviceBuffer) Resize(n int, s StreamView) error {
	defer runtime.KeepAlive(b)
	if b.state().closed {
		return b.state().errClosed("Resize")
	}
	if n < 0 {
		return errorf("DeviceBuffer.Resize: negative size %d: %w", n, ErrInvalidArgument)
	}
	return b.state().resize(fmt.Sprintf("DeviceBuffer.Resize(%d)", n), n, s)
}

// Reserve grows the capacity to exactly n bytes when n > Cap() (allocate on s, copy Len() bytes
// on s, free the old on s); the size is unchanged. s becomes the stream. Errors as Resize.
func (b *DeviceBuffer) Reserve(n int, s StreamView) error {
	defer runtime.KeepAlive(b)
	if b.state().closed {
		return b.state().errClosed("Reserve")
	}
	if n < 0 {
		return errorf("DeviceBuffer.Reserve: negative capacity %d: %w", n, ErrInvalidArgument)
	}
	return b.state().reserve(fmt.Sprintf("DeviceBuffer.Reserve(%d)", n), n, s)
}

// ShrinkToFit reallocates exactly Len() bytes when Cap() is larger (copying on s, freeing the
// old on s); s becomes the stream. A failed allocation leaves the buffer unchanged.
func (b *DeviceBuffer) ShrinkToFit(s StreamView) error {
	defer runtime.KeepAlive(b)
	if b.state().closed {
		return b.state().errClosed("ShrinkToFit")
	}
	return b.state().shrinkToFit("DeviceBuffer.ShrinkToFit", s)
}

// CopyFromHost copies src into the buffer at byte offset dstOffset; complete at return
// (cuMemcpyHtoDAsync on s, then s synchronised; a CPU copy on host memory). The bytes must lie in
// [0, Len()), else ErrOutOfRange.
func (b *DeviceBuffer) CopyFromHost(dstOffset int, src []byte, s StreamView) error {
	defer runtime.KeepAlive(b)
	if b.state().closed {
		return b.state().errClosed("CopyFromHost")
	}
	if !inRange(dstOffset, len(src), b.state().size) {
		return rangeErr("DeviceBuffer.CopyFromHost", dstOffset, len(src), b.state().size, "bytes")
	}
	dst := b.state().ref()
	dst.p += DevicePtr(dstOffset)
	return copyFromGo("DeviceBuffer.CopyFromHost", dst, bytesPtr(src), len(src), s)
}

// CopyToHost copies len(dst) bytes from byte offset srcOffset into dst; complete at return
// (cuMemcpyDtoHAsync on s, then s synchronised). The bytes must lie in [0, Len()), else
// ErrOutOfRange.
func (b *DeviceBuffer) CopyToHost(dst []byte, srcOffset int, s StreamView) error {
	defer runtime.KeepAlive(b)
	if b.state().closed {
		return b.state().errClosed("CopyToHost")
	}
	if !inRange(srcOffset, len(dst), b.state().size) {
		return rangeErr("DeviceBuffer.CopyToHost", srcOffset, len(dst), b.state().size, "bytes")
	}
	src := b.state().ref()
	src.p += DevicePtr(srcOffset)
	return copyToGo("DeviceBuffer.CopyToHost", bytesPtr(dst), src, len(dst), s)
}

// Bytes returns a copy of the buffer's Len() bytes in Go memory, complete at return (ordered on
// s, then s synchronised).
func (b *DeviceBuffer) Bytes(s StreamView) ([]byte, error) {
	defer runtime.KeepAlive(b)
	if b.state().closed {
		return nil, b.state().errClosed("Bytes")
	}
	if _, err := routeOf("DeviceBuffer.Bytes", b.state().ref()); err != nil {
		return nil, err // before allocating the result
	}
	out := make([]byte, b.state().size)
	if err := copyToGo("DeviceBuffer.Bytes", bytesPtr(out), b.state().ref(), len(out), s); err != nil {
		return nil, err
	}
	return out, nil
}

// CopyFromDevice copies nbytes at src (device, managed or host memory outside the Go heap) into
// the buffer at byte offset dstOffset, asynchronously on s (cuMemcpyAsync; s is synchronised
// when the buffer is host-only memory). The bytes must lie in [0, Len()) (ErrOutOfRange); a zero
// src with nbytes > 0 returns ErrInvalidArgument. The ranges must not overlap.
func (b *DeviceBuffer) CopyFromDevice(dstOffset int, src DevicePtr, nbytes int, s StreamView) error {
	defer runtime.KeepAlive(b)
	if b.state().closed {
		return b.state().errClosed("CopyFromDevice")
	}
	if nbytes < 0 {
		return errorf("DeviceBuffer.CopyFromDevice: negative size %d: %w", nbytes, ErrInvalidArgument)
	}
	if src == 0 && nbytes > 0 {
		return errorf("DeviceBuffer.CopyFromDevice: null source with size %d: %w", nbytes, ErrInvalidArgument)
	}
	if !inRange(dstOffset, nbytes, b.state().size) {
		return rangeErr("DeviceBuffer.CopyFromDevice", dstOffset, nbytes, b.state().size, "bytes")
	}
	dst := b.state().ref()
	dst.p += DevicePtr(dstOffset)
	return copyFromAddr("DeviceBuffer.CopyFromDevice", dst, src, nbytes, s)
}

// Release hands the memory to the caller and leaves the buffer empty (Data 0, Len 0, Cap 0; it
// keeps its resource and stream and may be resized again), as moving from a device_buffer does.
// The caller then owns p and frees it with MemoryResource().Deallocate(p, capacity, s) on the
// buffer's stream (see Stream). After Close it returns (0, 0).
func (b *DeviceBuffer) Release() (p DevicePtr, capacity int) {
	defer runtime.KeepAlive(b)
	p, capacity = b.state().ptr, b.state().capacity
	b.state().ptr, b.state().size, b.state().capacity = 0, 0, 0
	return p, capacity
}

// Close frees Cap() bytes through the resource on Stream() and leaves the buffer empty. Every
// later call that can fail returns ErrClosed; closing again returns nil. An error of the
// resource's Deallocate is returned, and the buffer is closed all the same.
func (b *DeviceBuffer) Close() error {
	defer runtime.KeepAlive(b)
	if b.state().closed {
		return nil
	}
	b.cleanup.Stop()
	return b.state().close()
}
