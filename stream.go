package rmm

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
)

// StreamView is a non-owning, comparable reference to a CUDA stream: its handle, the device it
// belongs to and an identity that a reused handle cannot fake. The zero value is [DefaultStream].
//
// Two views are equal when they name the same stream. Views of our own Streams carry a
// process-unique identity; views made from a foreign handle with [NewStreamView] carry the
// driver's stream id (cuStreamGetId), so a handle recycled by the driver after its stream was
// destroyed is a different stream.
type StreamView struct {
	h    uintptr // CUstream; 0 = the legacy default stream
	id   uint64  // 0 = default stream; ownedStreamBit|n for Streams; perThreadStreamBit|tid; foreignStreamBit|id otherwise
	dev1 int32   // device ordinal + 1; 0 = whichever device the operation is on
}

const (
	ownedStreamBit     = uint64(1) << 63
	foreignStreamBit   = uint64(1) << 62
	perThreadStreamBit = uint64(1) << 61 // with the OS thread's id: PerThreadDefaultStream
	cuStreamPerThread  = 2               // CU_STREAM_PER_THREAD

	cuStreamLegacy       = 1 // CU_STREAM_LEGACY
	cuStreamNonBlocking  = 1 // CU_STREAM_NON_BLOCKING
	cuEventDisableTiming = 2 // CU_EVENT_DISABLE_TIMING
)

// DefaultStream is the legacy default stream (CU_STREAM_LEGACY) of whichever device an operation
// runs on. There is no per-thread default stream: goroutines move between OS threads.
var DefaultStream = StreamView{}

var streamCounter atomic.Uint64

// cu returns the handle to pass to the driver.
func (s StreamView) cu() uintptr {
	if s.h == 0 {
		return cuStreamLegacy
	}
	return s.h
}

// Handle returns the CUstream handle (0 for the default stream; 0 for every stream when CUDA is
// unavailable and streams are host streams).
func (s StreamView) Handle() uintptr { return s.h }

// ID returns the stream's identity (0 for [DefaultStream]).
func (s StreamView) ID() uint64 { return s.id }

// IsDefault reports whether s is the legacy default stream.
func (s StreamView) IsDefault() bool { return s.id == 0 }

// Device returns the device the stream belongs to; for [DefaultStream], the current device.
func (s StreamView) Device() Device {
	if s.dev1 == 0 {
		return CurrentDevice()
	}
	return Device(s.dev1 - 1)
}

// deviceFor returns the stream's device, or def for the default stream.
func (s StreamView) deviceFor(def Device) Device {
	if s.dev1 == 0 {
		return def
	}
	return Device(s.dev1 - 1)
}

// lifetimeKnown reports whether the package knows when the stream dies: the default stream and
// our own Streams (whose Close tells every interested resource first). Sub-allocators record
// events lazily only on such streams.
func (s StreamView) lifetimeKnown() bool { return s.id == 0 || s.id&ownedStreamBit != 0 }

func (s StreamView) String() string {
	switch {
	case s.id == 0:
		return "DefaultStream"
	case s.id&ownedStreamBit != 0 && s.h == 0:
		return fmt.Sprintf("Stream#%d(host)", s.id&^ownedStreamBit) // made without CUDA
	case s.id&ownedStreamBit != 0:
		return fmt.Sprintf("Stream#%d(%#x)", s.id&^ownedStreamBit, s.h)
	case s.id&perThreadStreamBit != 0:
		return fmt.Sprintf("PerThreadDefaultStream(thread %d)", s.id&^perThreadStreamBit)
	default:
		return fmt.Sprintf("StreamView(%#x)", s.h)
	}
}

// PerThreadDefaultStream returns a view of the calling OS thread's per-thread default stream on
// the current device (CU_STREAM_PER_THREAD), RMM's PER_THREAD_DEFAULT_STREAM: the stream that C
// and C++ code compiled with per-thread default streams uses on this thread. Work on it is
// ordered with work on the other streams as on any blocking stream, but not with other threads'
// per-thread streams.
//
// The stream belongs to an OS thread, and a goroutine moves between OS threads: call
// [runtime.LockOSThread] before PerThreadDefaultStream and use the view only from that goroutine,
// and only while it stays locked. Views from different threads compare unequal, so the pools keep
// their memory apart. Without CUDA it is a host stream of its own (not [DefaultStream]: a pool
// keeps a free list for it). It returns
// [ErrNotSupported] where the OS does not give thread ids (Linux does).
func PerThreadDefaultStream() (StreamView, error) {
	tid := osThreadID()
	if tid == 0 {
		return StreamView{}, errorf("PerThreadDefaultStream: this OS gives no thread id to tell the threads' streams apart: %w", ErrNotSupported)
	}
	v := StreamView{id: perThreadStreamBit | tid}
	if CUDAAvailable() == nil {
		v.h, v.dev1 = cuStreamPerThread, int32(CurrentDevice())+1
	}
	return v, nil
}

// Closed reports whether s is a view of a [Stream] that has been closed ([Stream.Close]). It makes no
// driver call (one map lookup), so a [MemoryResource] can ask it on every call before it hands s's
// handle to the driver; [DefaultStream] and views made with [NewStreamView] report false (the
// package cannot know when a foreign stream is destroyed).
func (s StreamView) Closed() bool { return s.closed() }

// closed reports whether s is a view of one of our Streams that has been closed.
func (s StreamView) closed() bool {
	if s.id&ownedStreamBit == 0 {
		return false
	}
	_, ok := streamRegistry.Load(s.id)
	return !ok
}

func errStreamClosed(op string, s StreamView) error {
	return errorf("%s on %v, which was closed: %w", op, s, ErrClosed)
}

// Synchronize waits until all work queued on s is done (cuStreamSynchronize). Without CUDA it
// returns nil at once. A view of a closed [Stream] returns [ErrClosed].
func (s StreamView) Synchronize() error {
	if s.closed() {
		return errStreamClosed("Synchronize", s)
	}
	if CUDAAvailable() != nil {
		return nil
	}
	ctx, err := s.Device().ctx()
	if err != nil {
		return err
	}
	return cuStreamSynchronize(ctx, s.cu())
}

// Query reports whether all work queued on s is done (cuStreamQuery). Without CUDA it reports
// true. A view of a closed [Stream] returns false and [ErrClosed], without calling the driver (a
// resource of another package can tell such a view this way).
func (s StreamView) Query() (bool, error) {
	if s.closed() {
		return false, errStreamClosed("Query", s)
	}
	if CUDAAvailable() != nil {
		return true, nil
	}
	ctx, err := s.Device().ctx()
	if err != nil {
		return false, err
	}
	return cuStreamQuery(ctx, s.cu())
}

// WaitEvent makes all work queued on s after this call wait until e has completed
// (cuStreamWaitEvent); the host does not block. A view of a closed [Stream] returns [ErrClosed].
func (s StreamView) WaitEvent(e *Event) error {
	if s.closed() {
		return errStreamClosed("WaitEvent", s)
	}
	if e == nil || e.h == 0 {
		if e != nil && e.host {
			return nil
		}
		return errorf("WaitEvent: nil or closed event: %w", ErrInvalidArgument)
	}
	return cuStreamWaitEvent(e.ctx, s.cu(), e.h)
}

// NewStreamView wraps a CUstream created elsewhere (by the CUDA runtime, PyTorch, CuPy, ...) on
// device dev. Handles 0 and 1 (CU_STREAM_LEGACY) give [DefaultStream]. The view does not own the
// stream; resources that keep per-stream state record a CUDA event on every free on such a
// stream, since they cannot know when it is destroyed.
func NewStreamView(dev Device, handle uintptr) (StreamView, error) {
	if handle == 0 || handle == cuStreamLegacy {
		return DefaultStream, nil
	}
	ctx, err := dev.ctx()
	if err != nil {
		return StreamView{}, err
	}
	id, err := cuStreamGetID(ctx, handle)
	if err != nil {
		// Drivers before 12.0 have no stream ids: fall back to the handle.
		id = uint64(handle)
	}
	return StreamView{h: handle, id: foreignStreamBit | (id &^ (ownedStreamBit | foreignStreamBit)), dev1: int32(dev) + 1}, nil
}

// StreamOptions configures [NewStream]. nil means the defaults.
type StreamOptions struct {
	// NonBlocking creates the stream with CU_STREAM_NON_BLOCKING: it does not synchronise with the
	// legacy default stream. Default false.
	NonBlocking bool
}

// Stream owns a CUDA stream (cuStreamCreate) on one device. Close destroys it. Without CUDA, a
// Stream is a host stream: an identity with no work queue (host operations are synchronous).
type Stream struct {
	view   StreamView
	ctx    uintptr
	mu     sync.Mutex
	closed bool
	hooks  []streamCloseHook
}

// streamCloseHook is told that a stream is about to be destroyed, while it still exists, so that
// it can record an event on it (or synchronise it) for free memory ordered on that stream.
type streamCloseHook interface {
	streamClosing(s StreamView)
}

var streamRegistry sync.Map // id -> *Stream, for live Streams

// NewStream creates a stream on device dev (cuStreamCreate; with opts.NonBlocking,
// CU_STREAM_NON_BLOCKING: the stream does not synchronise with the legacy default stream). The
// [Stream] owns it: Close destroys it after waiting for its work, and tells the resources that
// keep free memory ordered on it. Without CUDA the stream is a host stream (its work runs at
// once). Errors: [ErrInvalidArgument] for a device that does not exist, [ErrNoDevice] when the driver
// cannot be used, a [*CUDAError] from cuStreamCreate.
func NewStream(dev Device, opts *StreamOptions) (*Stream, error) {
	if err := dev.check(); err != nil {
		return nil, errorf("NewStream: %w", err)
	}
	id := ownedStreamBit | streamCounter.Add(1)
	st := &Stream{view: StreamView{id: id, dev1: int32(dev) + 1}}
	if CUDAAvailable() == nil {
		ctx, err := dev.ctx()
		if err != nil {
			return nil, err
		}
		var flags uint
		if opts != nil && opts.NonBlocking {
			flags = cuStreamNonBlocking
		}
		h, err := cuStreamCreate(ctx, flags)
		if err != nil {
			return nil, err
		}
		st.view.h, st.ctx = h, ctx
	}
	streamRegistry.Store(id, st)
	return st, nil
}

// View returns the non-owning view of the stream.
func (s *Stream) View() StreamView { return s.view }

// Device returns the stream's device.
func (s *Stream) Device() Device { return s.view.Device() }

// Synchronize waits for all work queued on the stream; [ErrClosed] after Close.
func (s *Stream) Synchronize() error { return s.view.Synchronize() }

// Close tells every resource holding free memory ordered on the stream (so that it records an
// event while the stream still exists), waits for the work queued on the stream
// (cuStreamSynchronize), then destroys it (cuStreamDestroy). It returns the first error of the
// two calls; the stream is destroyed and closed either way. Closing twice returns nil. Afterwards the stream's views must not be used
// for new work: StreamView's Synchronize, Query and WaitEvent, [Event.Record] and the Allocate of
// [PoolMemoryResource], [ArenaMemoryResource], [FixedSizeMemoryResource], [CudaAsyncMemoryResource],
// [CudaAsyncViewMemoryResource] and [PrefetchResourceAdaptor] return [ErrClosed] for them (resources that do not order on streams,
// such as [SystemMemoryResource] and [CudaMemoryResource], ignore the stream), and those resources
// treat a free on them as a free on [DefaultStream] after synchronising the device, never passing
// the destroyed handle to the driver. A pool moves the closed stream's free blocks, its cached
// ones included, to DefaultStream's list.
func (s *Stream) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	hooks := s.hooks
	s.hooks = nil
	s.mu.Unlock()
	for _, h := range hooks {
		h.streamClosing(s.view)
	}
	streamRegistry.Delete(s.view.id)
	if s.view.h == 0 {
		return nil
	}
	// Waiting here, rather than letting cuStreamDestroy return at once with work pending, means
	// that everything ordered on the stream (stream-ordered allocations from the driver's pools
	// included) is complete, in the host's order, before anything is freed on another stream.
	// Without it compute-sanitizer (--track-stream-ordered-races) reports the later free of a
	// block that cuMemAllocAsync gave out on the destroyed stream as freed before its
	// allocation, even after cuCtxSynchronize: it cannot see the allocation complete on a stream
	// that no longer exists.
	serr := cuStreamSynchronize(s.ctx, s.view.h)
	if derr := cuStreamDestroy(s.ctx, s.view.h); serr == nil {
		return derr
	}
	return errorf("Stream.Close: waiting for the stream's work: %w", serr)
}

// addStreamCloseHook asks to be told before the Stream behind v is destroyed. It returns false
// when v is not a live Stream of ours (already closed, or a foreign view): the caller must then not
// rely on lazy event recording for v.
func addStreamCloseHook(v StreamView, h streamCloseHook) bool {
	if v.id == 0 {
		return true // the default stream is never destroyed
	}
	x, ok := streamRegistry.Load(v.id)
	if !ok {
		return false
	}
	st := x.(*Stream)
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.closed {
		return false
	}
	st.hooks = append(st.hooks, h)
	return true
}

// removeStreamCloseHook takes h off the Stream with id id, when that Stream is still live, so
// that the Stream no longer keeps h reachable. A resource calls it once it no longer needs to hear
// of the Stream's Close (see streamLists.dropHooks). The Stream's mutex is a leaf: Close calls the
// hooks after unlocking it, and nothing else is locked under it, so the caller may hold its own
// locks. A Close that took its hooks before this call still tells h, which must then cope with
// being told after it let go.
func removeStreamCloseHook(id uint64, h streamCloseHook) {
	if id == 0 {
		return
	}
	x, ok := streamRegistry.Load(id)
	if !ok {
		return
	}
	st := x.(*Stream)
	st.mu.Lock()
	defer st.mu.Unlock()
	// DeleteFunc clears the slots it frees, so the array behind hooks keeps no reference to h.
	st.hooks = slices.DeleteFunc(st.hooks, func(x streamCloseHook) bool { return x == h })
	if len(st.hooks) == 0 {
		st.hooks = nil
	}
}

// StreamPool hands out views of a fixed set of streams round-robin, as rmm::cuda_stream_pool. Make
// one with [NewStreamPool]; the zero value has no streams and is not usable.
type StreamPool struct {
	streams []*Stream
	next    atomic.Uint64
}

// NewStreamPool creates n streams on device dev. n must be positive ([ErrInvalidArgument]).
func NewStreamPool(dev Device, n int, opts *StreamOptions) (*StreamPool, error) {
	if n <= 0 {
		return nil, errorf("NewStreamPool: size %d must be positive: %w", n, ErrInvalidArgument)
	}
	p := &StreamPool{streams: make([]*Stream, 0, n)}
	for i := 0; i < n; i++ {
		s, err := NewStream(dev, opts)
		if err != nil {
			p.Close()
			return nil, err
		}
		p.streams = append(p.streams, s)
	}
	return p, nil
}

// Get returns the next stream, round-robin. Safe for concurrent use.
func (p *StreamPool) Get() StreamView {
	i := p.next.Add(1) - 1
	return p.streams[i%uint64(len(p.streams))].view
}

// GetIndexed returns stream i modulo the pool size (negative i counts from the end).
func (p *StreamPool) GetIndexed(i int) StreamView {
	n := len(p.streams)
	return p.streams[((i%n)+n)%n].view
}

// Size returns the number of streams.
func (p *StreamPool) Size() int { return len(p.streams) }

// Close destroys every stream and returns the first error.
func (p *StreamPool) Close() error {
	var first error
	for _, s := range p.streams {
		if err := s.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// EventOptions configures [NewEvent]. nil means the defaults.
type EventOptions struct {
	// EnableTiming lets the event be used with [ElapsedTime]. Default false (timing disabled, as
	// events used only for ordering should be).
	EnableTiming bool
}

// Event is a CUDA event (cuEventCreate) on one device. Without CUDA it is a host event that is
// always complete (host work is synchronous) and [ElapsedTime] returns [ErrNotSupported].
type Event struct {
	ctx  uintptr
	h    uintptr
	host bool
}

// NewEvent creates an event on device dev (cuEventCreate; without opts.EnableTiming,
// CU_EVENT_DISABLE_TIMING). Destroy it with Close. Without CUDA the event is a host event,
// complete at once. Errors: [ErrInvalidArgument] for a device that does not exist, [ErrNoDevice] when
// the driver cannot be used, a [*CUDAError] from cuEventCreate.
func NewEvent(dev Device, opts *EventOptions) (*Event, error) {
	if err := dev.check(); err != nil {
		return nil, errorf("NewEvent: %w", err)
	}
	if CUDAAvailable() != nil {
		return &Event{host: true}, nil
	}
	ctx, err := dev.ctx()
	if err != nil {
		return nil, err
	}
	flags := uint(cuEventDisableTiming)
	if opts != nil && opts.EnableTiming {
		flags = 0
	}
	h, err := cuEventCreate(ctx, flags)
	if err != nil {
		return nil, err
	}
	return &Event{ctx: ctx, h: h}, nil
}

func (e *Event) usable(op string) error {
	if e == nil || (e.h == 0 && !e.host) {
		return errorf("Event.%s: a nil or closed event: %w", op, ErrClosed)
	}
	return nil
}

// Record captures the work queued on s so far (cuEventRecord). A view of a closed [Stream] returns
// [ErrClosed] (its handle may already name another stream).
func (e *Event) Record(s StreamView) error {
	if err := e.usable("Record"); err != nil {
		return err
	}
	if s.closed() {
		return errStreamClosed("Event.Record", s)
	}
	if e.host {
		return nil
	}
	return cuEventRecord(e.ctx, e.h, s.cu())
}

// Synchronize waits until the recorded work is done (cuEventSynchronize).
func (e *Event) Synchronize() error {
	if err := e.usable("Synchronize"); err != nil || e.host {
		return err
	}
	return cuEventSynchronize(e.ctx, e.h)
}

// Query reports whether the recorded work is done (cuEventQuery).
func (e *Event) Query() (bool, error) {
	if err := e.usable("Query"); err != nil || e.host {
		return err == nil, err
	}
	return cuEventQuery(e.ctx, e.h)
}

// ElapsedTime returns the milliseconds between two completed timing events (cuEventElapsedTime).
func ElapsedTime(start, end *Event) (float32, error) {
	if err := start.usable("ElapsedTime"); err != nil {
		return 0, err
	}
	if err := end.usable("ElapsedTime"); err != nil {
		return 0, err
	}
	if start.host || end.host {
		return 0, errorf("ElapsedTime needs CUDA events: %w", ErrNotSupported)
	}
	return cuEventElapsedTime(start.ctx, start.h, end.h)
}

// Close destroys the event (cuEventDestroy). Closing twice returns nil.
func (e *Event) Close() error {
	if e == nil || e.h == 0 {
		return nil
	}
	h := e.h
	e.h = 0
	return cuEventDestroy(e.ctx, h)
}

// deviceView returns s bound to dev when s is the default stream.
func (s StreamView) deviceView(dev Device) StreamView {
	if s.dev1 == 0 {
		s.dev1 = int32(dev) + 1
	}
	return s
}

// StreamFreeStats is the free memory a sub-allocator keeps for one stream: blocks freed on that
// stream, which it hands out again to that stream without waiting.
type StreamFreeStats struct {
	Stream     StreamView
	FreeBlocks int
	FreeBytes  int
}
