package rmm

import (
	"errors"
	"reflect"
	"runtime"
	"sync"
)

// Importing memory another process exported (ipc.go has the overview).

// IPCSpan is memory another process exported, mapped into this one by [ImportIPC]: a [DeviceSpan]
// over the shared range (all its methods work on it: copies, fills, Subspan, Span) plus Close,
// which unmaps what the import mapped. The exporter must keep the memory allocated until Close
// (see ImportIPC). After Close the span is empty. An IPCSpan that
// becomes unreachable without Close is closed by a cleanup and reported as a leak in the debug
// log, as containers are; do not rely on it (spans taken from it must not outlive it). Close is
// not safe to call concurrently with the span's other methods.
type IPCSpan[T any] struct {
	DeviceSpan[T]
	imp *ipcImport
}

// checkIPCElems returns an error wrapping ErrInvalidArgument, naming the handle and T, when h's
// range cannot be read as elements of T: its size is not a whole number of them, or its offset
// (or, once mapped, its address p; 0 before) is not a multiple of T's alignment.
func checkIPCElems[T any](op string, h *IPCHandle, p DevicePtr) error {
	t := reflect.TypeFor[T]()
	w, a := int(t.Size()), t.Align()
	switch {
	case h.size%w != 0:
		return errorf("%s: %v: its %s are not a whole number of %d-byte %s elements: %w", op, h, bytesText(h.size), w, t, ErrInvalidArgument)
	case h.offset%a != 0:
		return errorf("%s: %v: its range starts %d bytes into the shared memory, not a multiple of %s's %d-byte alignment: %w", op, h, h.offset, t, a, ErrInvalidArgument)
	case uintptr(p)%uintptr(a) != 0:
		return errorf("%s: %v: its range is mapped at %#x, not a multiple of %s's %d-byte alignment: %w", op, h, uintptr(p), t, a, ErrInvalidArgument)
	}
	return nil
}

// ImportIPC maps the memory of h, exported by another process, into this process on the device
// with h's device UUID, and returns a view of its Size()/sizeof(T) elements. h keeps its file
// descriptors (Close it when done with it; the import does not need them afterwards). Importing
// the same cuIpcGetMemHandle or memory-pool allocation twice in one process shares one mapping,
// counted: it is unmapped at the last Close.
//
// Reading what the exporter wrote needs ordering: the exporter records an [IPCEvent] after its
// writes and the importer waits on it ([IPCEvent.StreamWait]) before its own work, or the two
// synchronise through the host.
//
// Lifetime: the exporter must keep the memory allocated until every importer has closed its
// span (the driver requires it for memory-pool allocations). If the exporter frees it or exits
// first: imported virtual memory ([IPCKindVirtualMemory]) stays valid here until Close, since the
// imported pieces hold their physical memory, but the exporter's pool may hand that memory to a
// new allocation meanwhile; for [IPCKindMemPool] and [IPCKindLegacy] the driver documentation leaves
// it undefined.
//
// Errors: [ErrInvalidIPCHandle] for an event handle or a handle without its descriptors attached;
// [ErrInvalidArgument] when Size() is not a multiple of sizeof(T), the range's offset or address
// is not a multiple of T's alignment, or T holds Go pointers; an error wrapping [ErrNoDevice]
// when no device of this process has the handle's UUID or CUDA is unavailable;
// [ErrNotSupported] when the device or driver lacks the mechanism; a [*CUDAError] from
// the driver (for example memory the exporter freed). A failed import leaves nothing mapped.
func ImportIPC[T any](h *IPCHandle) (*IPCSpan[T], error) {
	op := "ImportIPC[" + typeName[T]() + "]"
	if err := checkElemType[T](op); err != nil {
		return nil, err
	}
	if h == nil {
		return nil, errorf("%s: nil handle: %w", op, ErrInvalidArgument)
	}
	if err := checkIPCElems[T](op, h, 0); err != nil {
		return nil, err
	}
	imp, p, err := importIPC(op, h)
	if err != nil {
		return nil, err
	}
	// The offset was checked above; the address also depends on where the driver mapped the
	// memory, which is aligned for any T, but a span is only as good as its first element's
	// alignment.
	if err := checkIPCElems[T](op, h, p); err != nil {
		if cerr := imp.close(); cerr != nil {
			err = errors.Join(err, errorf("undoing: %w", cerr))
		}
		return nil, err
	}
	s := &IPCSpan[T]{DeviceSpan: DeviceSpan[T]{ptr: p, n: h.size / sizeOf[T](), dev: imp.dev, access: DeviceAccessible}, imp: imp}
	imp.cleanup = runtime.AddCleanup(s, reclaimLeakedImport, imp)
	return s, nil
}

// Close waits for the device (work on the span must be done: unmapping does not wait for it),
// then unmaps what the import mapped and closes what it opened. Closing twice returns nil. Every
// step is attempted even when one fails; the span is closed afterwards either way.
func (s *IPCSpan[T]) Close() error {
	if s == nil || s.imp == nil {
		return nil
	}
	imp := s.imp
	s.DeviceSpan = DeviceSpan[T]{}
	s.imp = nil
	return imp.close()
}

// ipcImport is what one ImportIPC mapped or opened.
type ipcImport struct {
	kind IPCKind
	dev  Device
	ctx  uintptr

	mu      sync.Mutex
	closed  bool
	cleanup runtime.Cleanup // on the IPCSpan: closes a span dropped without Close

	// IPCKindVirtualMemory: the reservation, and the imported handles mapped back to back in it.
	base    DevicePtr
	extent  int
	handles []uint64

	// IPCKindLegacy, IPCKindMemPool: the process-wide opening of the allocation it shares.
	key ipcOpenKey
}

// ipcOpenKey names an allocation opened with cuIpcOpenMemHandle or imported with
// cuMemPoolImportPointer. The driver maps such an allocation once per process, so imports of
// the same one share an ipcOpened, counted.
type ipcOpenKey struct {
	kind IPCKind
	dev  Device
	data [64]byte
}

type ipcOpened struct {
	base DevicePtr // what the driver returned: the start of the allocation
	pool uintptr   // IPCKindMemPool: the imported pool
	refs int
}

var ipcOpens = struct {
	mu sync.Mutex
	m  map[ipcOpenKey]*ipcOpened
}{m: map[ipcOpenKey]*ipcOpened{}}

// importIPC maps or opens h's memory and returns the import and the address of the shared range.
func importIPC(op string, h *IPCHandle) (*ipcImport, DevicePtr, error) {
	if err := h.checkShape(); err != nil {
		return nil, 0, errorf("%s: %v: %w", op, err, ErrInvalidIPCHandle)
	}
	if h.kind == IPCKindEvent {
		return nil, 0, errorf("%s: %v is an event: open it with OpenIPCEvent: %w", op, h, ErrInvalidIPCHandle)
	}
	if !h.attached() {
		return nil, 0, errorf("%s: %v: its file descriptors are not attached (receive it with ReceiveIPCHandle, or attach them with SetFDs): %w", op, h, ErrInvalidIPCHandle)
	}
	dev, err := ipcLocalDevice(h.uuid, h.dev)
	if err != nil {
		return nil, 0, errorf("%s: %w", op, err)
	}
	ctx, err := dev.ctx()
	if err != nil {
		return nil, 0, errorf("%s: %w", op, err)
	}
	imp := &ipcImport{kind: h.kind, dev: dev, ctx: ctx}
	var base DevicePtr
	if h.kind == IPCKindVirtualMemory {
		base, err = imp.mapPieces(h)
	} else {
		base, err = imp.openShared(h)
	}
	if err != nil {
		return nil, 0, errorf("%s(%v): %w", op, h, err)
	}
	if h.kind != IPCKindVirtualMemory {
		// The handle's offset and size are the exporter's word: a range past what the driver
		// mapped here would give a span over memory this process does not have.
		if err := imp.checkMapped(base, h); err != nil {
			if cerr := imp.close(); cerr != nil {
				err = errors.Join(err, errorf("undoing: %w", cerr))
			}
			return nil, 0, errorf("%s(%v): %w", op, h, err)
		}
	}
	return imp, base + DevicePtr(h.offset), nil
}

// checkMapped checks that h's range, from base (what the driver opened), lies in the allocation
// the driver mapped there (cuMemGetAddressRange); ErrInvalidIPCHandle if not.
func (imp *ipcImport) checkMapped(base DevicePtr, h *IPCHandle) error {
	rb, rs, err := cuMemGetAddressRange(imp.ctx, base)
	if err != nil {
		return err
	}
	if base < rb || uint64(h.offset)+uint64(h.size) > uint64(rb)+uint64(rs)-uint64(base) {
		return errorf("bytes [%d, %d) from %#x run past the allocation the driver mapped, [%#x, %#x): %w", h.offset, h.offset+h.size, uintptr(base), uintptr(rb), uintptr(rb)+uintptr(rs), ErrInvalidIPCHandle)
	}
	return nil
}

// mapPieces reserves a range for h's pieces, imports each, maps them back to back and grants
// this device read/write access. On failure everything done is undone.
func (imp *ipcImport) mapPieces(h *IPCHandle) (DevicePtr, error) {
	ord := int(imp.dev)
	if cuIPCBound()&ipcBoundVMM == 0 {
		return 0, errorf("the CUDA driver lacks cuMemImportFromShareableHandle or the virtual memory functions: %w", ErrNotSupported)
	}
	for _, a := range []struct {
		id   int
		name string
	}{{attrVirtualMemoryManagementSupported, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"}, {attrHandleTypePOSIXFDSupported, "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"}} {
		v, err := cuDeviceAttribute(ord, a.id)
		if err != nil {
			return 0, err
		}
		if v != 1 {
			return 0, errorf("%s cannot import memory as POSIX file descriptors (CU_DEVICE_ATTRIBUTE_%s is %d): %w", imp.dev, a.name, v, ErrNotSupported)
		}
	}
	gran, err := cuMemGetAllocationGranularity(imp.ctx, ord, vmmGranularityMinimum)
	if err != nil {
		return 0, err
	}
	total := 0
	for i, size := range h.pieces {
		if gran <= 0 || size%gran != 0 {
			return 0, errorf("piece %d has %s, not a multiple of the device's granularity %d: %w", i, bytesText(size), gran, ErrInvalidIPCHandle)
		}
		total += size
	}
	align := 0
	if gran&(gran-1) == 0 {
		align = gran
	}
	base, err := cuMemAddressReserve(imp.ctx, total, align)
	if err != nil {
		return 0, errorf("reserving %s of address space: %w", bytesText(total), err)
	}
	mapped := 0
	undo := func(err error) error {
		errs := []error{err}
		if mapped > 0 {
			if uerr := cuMemUnmap(imp.ctx, base, mapped); uerr != nil {
				errs = append(errs, errorf("undoing: %w", uerr))
			}
		}
		for _, hh := range imp.handles {
			if rerr := cuMemRelease(imp.ctx, hh); rerr != nil {
				errs = append(errs, errorf("undoing: %w", rerr))
			}
		}
		imp.handles = nil
		if ferr := cuMemAddressFree(imp.ctx, base, total); ferr != nil {
			errs = append(errs, errorf("undoing: %w", ferr))
		}
		return errors.Join(errs...)
	}
	for i, size := range h.pieces {
		hh, err := cuMemImportFD(imp.ctx, h.fds[i])
		if err != nil {
			return 0, undo(errorf("piece %d (descriptor %d): %w", i, h.fds[i], err))
		}
		imp.handles = append(imp.handles, hh)
		if err := cuMemMap(imp.ctx, base+DevicePtr(mapped), size, hh); err != nil {
			return 0, undo(errorf("mapping piece %d (%d bytes) at %#x: %w", i, size, uintptr(base)+uintptr(mapped), err))
		}
		mapped += size
	}
	if err := cuMemSetAccess(imp.ctx, base, total, ord); err != nil {
		return 0, undo(errorf("granting access to %s at %#x: %w", bytesText(total), uintptr(base), err))
	}
	imp.base, imp.extent = base, total
	return base, nil
}

// openShared opens h's allocation (cuIpcOpenMemHandle, or cuMemPoolImportFromShareableHandle and
// cuMemPoolImportPointer), or takes one more reference to it when this process has it open.
func (imp *ipcImport) openShared(h *IPCHandle) (DevicePtr, error) {
	key := ipcOpenKey{kind: h.kind, dev: imp.dev, data: h.data}
	ipcOpens.mu.Lock()
	defer ipcOpens.mu.Unlock()
	if o := ipcOpens.m[key]; o != nil {
		o.refs++
		imp.key = key
		return o.base, nil
	}
	o := &ipcOpened{refs: 1}
	switch h.kind {
	case IPCKindLegacy:
		if cuIPCBound()&ipcBoundLegacy == 0 {
			return 0, errorf("the CUDA driver lacks cuIpcOpenMemHandle_v2 or cuIpcCloseMemHandle: %w", ErrNotSupported)
		}
		p, err := cuIpcOpenMemHandle(imp.ctx, &h.data)
		if err != nil {
			return 0, err
		}
		o.base = p
	case IPCKindMemPool:
		if cuIPCBound()&ipcBoundMemPool == 0 {
			return 0, errorf("the CUDA driver lacks cuMemPoolImportFromShareableHandle or cuMemPoolImportPointer: %w", ErrNotSupported)
		}
		if v, err := imp.dev.Attribute(attrMemoryPoolsSupported); err != nil || v == 0 {
			return 0, errorf("%s does not support stream-ordered memory pools: %w", imp.dev, ErrNotSupported)
		}
		if err := checkPoolPOSIXFD(imp.dev); err != nil {
			return 0, err
		}
		pool, err := cuMemPoolImportFD(imp.ctx, h.fds[0])
		if err != nil {
			return 0, err
		}
		p, err := cuMemPoolImportPointer(imp.ctx, pool, &h.data)
		if err != nil {
			if derr := cuMemPoolDestroy(imp.ctx, pool); derr != nil {
				err = errors.Join(err, errorf("undoing: %w", derr))
			}
			return 0, err
		}
		o.base, o.pool = p, pool
	}
	ipcOpens.m[key] = o
	imp.key = key
	return o.base, nil
}

// close waits for the device, then unmaps and closes what the import holds (see IPCSpan.Close).
func (imp *ipcImport) close() error {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	if imp.closed {
		return nil
	}
	imp.closed = true
	imp.cleanup.Stop()
	var errs []error
	// Unmapping does not wait for work that still uses the memory; freeing the imported pool
	// pointer and closing a cuIpc mapping are not documented to either.
	if err := cuCtxSynchronize(imp.ctx); err != nil {
		errs = append(errs, errorf("waiting for %s: %w", imp.dev, err))
	}
	switch imp.kind {
	case IPCKindVirtualMemory:
		if err := cuMemUnmap(imp.ctx, imp.base, imp.extent); err != nil {
			errs = append(errs, err)
		}
		for _, h := range imp.handles {
			if err := cuMemRelease(imp.ctx, h); err != nil {
				errs = append(errs, err)
			}
		}
		imp.handles = nil
		if err := cuMemAddressFree(imp.ctx, imp.base, imp.extent); err != nil {
			errs = append(errs, err)
		}
	default:
		ipcOpens.mu.Lock()
		o := ipcOpens.m[imp.key]
		o.refs--
		if o.refs == 0 {
			delete(ipcOpens.m, imp.key)
			if imp.kind == IPCKindLegacy {
				if err := cuIpcCloseMemHandle(imp.ctx, o.base); err != nil {
					errs = append(errs, err)
				}
			} else {
				// The driver asks importers to free an imported pointer (cuMemFree) before
				// the exporter frees the allocation; then the imported pool can go.
				if err := cuMemFree(imp.ctx, o.base); err != nil {
					errs = append(errs, err)
				}
				if err := cuMemPoolDestroy(imp.ctx, o.pool); err != nil {
					errs = append(errs, err)
				}
			}
		}
		ipcOpens.mu.Unlock()
	}
	if err := errors.Join(errs...); err != nil {
		return errorf("IPCSpan.Close (%s memory on %s): %w", imp.kind, imp.dev, err)
	}
	return nil
}

// reclaimLeakedImport is the cleanup of an IPCSpan that became unreachable without Close.
func reclaimLeakedImport(imp *ipcImport) {
	err := imp.close()
	attrs := []any{"kind", imp.kind.String(), "device", int(imp.dev)}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	DebugLogger().Warn("rmm: IPCSpan reclaimed without Close (leak)", attrs...)
}
