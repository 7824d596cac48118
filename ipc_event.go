package rmm

import (
	"sync"
)

// cuEventInterprocess is CU_EVENT_INTERPROCESS (it requires CU_EVENT_DISABLE_TIMING).
const cuEventInterprocess = 4

// IPCEvent is a CUDA event shared between processes, to order one process's work on the device
// after another's without a round trip through the host. The producer makes one with
// [NewIPCEvent], records it on its stream after the writes the consumer must see (Record), and
// sends its handle once (Export, [SendIPCHandle]); the consumer opens it ([OpenIPCEvent]) and, each
// time, makes its stream wait for the last record (StreamWait) before the work that reads. Either
// side may record and wait; a wait orders after the record that the other process had made when
// the wait was queued, so the processes still agree through the host on which round they are in
// (a message per round, as the handles themselves are).
//
// The event is cuEventCreate with CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS; the handle
// comes from cuIpcGetEventHandle and is opened with cuIpcOpenEventHandle. The process that
// created the event must keep it open while others use it: the driver leaves operations on an
// opened event undefined once its creator destroyed it. Safe for concurrent use.
type IPCEvent struct {
	dev    Device
	ctx    uintptr
	opened bool // from OpenIPCEvent

	mu sync.Mutex
	h  uintptr // 0 after Close
}

// NewIPCEvent creates an interprocess event on device dev. It returns an error wrapping
// [ErrNoDevice] without CUDA, [ErrNotSupported] when the device or driver has no interprocess events
// (CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED, asked of drivers from 12.0 on).
func NewIPCEvent(dev Device) (*IPCEvent, error) {
	ctx, err := ipcEventContext(dev)
	if err != nil {
		return nil, errorf("NewIPCEvent: %w", err)
	}
	h, err := cuEventCreate(ctx, cuEventDisableTiming|cuEventInterprocess)
	if err != nil {
		return nil, errorf("NewIPCEvent on %s: %w", dev, err)
	}
	return &IPCEvent{dev: dev, ctx: ctx, h: h}, nil
}

// OpenIPCEvent opens an event another process exported ([IPCKindEvent]), on this process's device
// with the handle's device UUID. Close it when done; the exporting process must keep its event
// open until then.
func OpenIPCEvent(h *IPCHandle) (*IPCEvent, error) {
	if h == nil {
		return nil, errorf("OpenIPCEvent: nil handle: %w", ErrInvalidArgument)
	}
	if err := h.checkShape(); err != nil {
		return nil, errorf("OpenIPCEvent: %v: %w", err, ErrInvalidIPCHandle)
	}
	if h.kind != IPCKindEvent {
		return nil, errorf("OpenIPCEvent: %v is memory, not an event (import it with ImportIPC): %w", h, ErrInvalidIPCHandle)
	}
	dev, err := ipcLocalDevice(h.uuid, h.dev)
	if err != nil {
		return nil, errorf("OpenIPCEvent: %w", err)
	}
	ctx, err := ipcEventContext(dev)
	if err != nil {
		return nil, errorf("OpenIPCEvent: %w", err)
	}
	e, err := cuIpcOpenEventHandle(ctx, &h.data)
	if err != nil {
		return nil, errorf("OpenIPCEvent on %s: %w", dev, err)
	}
	return &IPCEvent{dev: dev, ctx: ctx, h: e, opened: true}, nil
}

// ipcEventContext returns dev's context after checking that dev has interprocess events.
func ipcEventContext(dev Device) (uintptr, error) {
	ctx, err := dev.ctx()
	if err != nil {
		return 0, err
	}
	if cuIPCBound()&ipcBoundEvent == 0 {
		return 0, errorf("the CUDA driver lacks cuIpcGetEventHandle or cuIpcOpenEventHandle: %w", ErrNotSupported)
	}
	v, err := deviceAttrSince(dev, attrIPCEventSupported, 12000, 1)
	if err != nil {
		return 0, err
	}
	if v != 1 {
		return 0, errorf("%s has no interprocess events (CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED is %d): %w", dev, v, ErrNotSupported)
	}
	return ctx, nil
}

// Device returns the event's device in this process.
func (e *IPCEvent) Device() Device { return e.dev }

// acquire locks the event and returns its CUevent; on error (a nil or closed event) it is not
// locked.
func (e *IPCEvent) acquire(op string) (uintptr, error) {
	if e == nil {
		return 0, errorf("IPCEvent.%s on a nil event: %w", op, ErrInvalidArgument)
	}
	e.mu.Lock()
	if e.h == 0 {
		e.mu.Unlock()
		return 0, errorf("IPCEvent.%s: called after Close: %w", op, ErrClosed)
	}
	return e.h, nil
}

// stream checks that s may be used with the event: open, and on the event's device (the default
// stream is taken as the event's device's).
func (e *IPCEvent) stream(op string, s StreamView) (uintptr, error) {
	if s.closed() {
		return 0, errStreamClosed("IPCEvent."+op, s)
	}
	if d := s.deviceFor(e.dev); d != e.dev {
		return 0, errorf("IPCEvent.%s: %v is on %s, the event on %s: %w", op, s, d, e.dev, ErrInvalidArgument)
	}
	return s.cu(), nil
}

// Record captures the work queued on s so far (cuEventRecord); s must be on the event's device.
func (e *IPCEvent) Record(s StreamView) error {
	h, err := e.acquire("Record")
	if err != nil {
		return err
	}
	defer e.mu.Unlock()
	cs, err := e.stream("Record", s)
	if err != nil {
		return err
	}
	return cuEventRecord(e.ctx, h, cs)
}

// StreamWait makes the work queued on s after this call wait until the event's last record
// (in whichever process made it) has completed (cuStreamWaitEvent); the host does not block. s
// must be on the event's device.
func (e *IPCEvent) StreamWait(s StreamView) error {
	h, err := e.acquire("StreamWait")
	if err != nil {
		return err
	}
	defer e.mu.Unlock()
	cs, err := e.stream("StreamWait", s)
	if err != nil {
		return err
	}
	return cuStreamWaitEvent(e.ctx, cs, h)
}

// Synchronize blocks the host until the event's last record has completed (cuEventSynchronize).
func (e *IPCEvent) Synchronize() error {
	h, err := e.acquire("Synchronize")
	if err != nil {
		return err
	}
	defer e.mu.Unlock()
	return cuEventSynchronize(e.ctx, h)
}

// Query reports whether the event's last record has completed (cuEventQuery).
func (e *IPCEvent) Query() (bool, error) {
	h, err := e.acquire("Query")
	if err != nil {
		return false, err
	}
	defer e.mu.Unlock()
	return cuEventQuery(e.ctx, h)
}

// Export returns the event's handle ([IPCKindEvent], no file descriptor) for [OpenIPCEvent] in
// another process (cuIpcGetEventHandle). Only the process that created the event exports it: an
// opened event is [ErrInvalidArgument].
func (e *IPCEvent) Export() (*IPCHandle, error) {
	h, err := e.acquire("Export")
	if err != nil {
		return nil, err
	}
	defer e.mu.Unlock()
	if e.opened {
		return nil, errorf("IPCEvent.Export: the event was opened from another process's handle; export it there: %w", ErrInvalidArgument)
	}
	ord, uuid, err := ipcDeviceOf(e.dev)
	if err != nil {
		return nil, errorf("IPCEvent.Export: %w", err)
	}
	data, err := cuIpcGetEventHandle(e.ctx, h)
	if err != nil {
		return nil, errorf("IPCEvent.Export on %s: %w", e.dev, err)
	}
	return &IPCHandle{kind: IPCKindEvent, dev: ord, uuid: uuid, data: data}, nil
}

// Close destroys the event in this process (cuEventDestroy). Closing twice returns nil.
func (e *IPCEvent) Close() error {
	if e == nil {
		return nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.h == 0 {
		return nil
	}
	h := e.h
	e.h = 0
	return cuEventDestroy(e.ctx, h)
}
