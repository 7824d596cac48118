package rmm

import (
	"errors"
	"fmt"
	"sort"
)

// Exporting pool memory (PoolMemoryResource.ExportIPC) and the expandable pool's exportable
// physical memory (PoolOptions.Exportable).

// checkPoolPOSIXFD returns nil when dev can make memory pools exportable as POSIX file
// descriptors: CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES has the bit (drivers before
// 11.3 do not know the attribute, and are taken as unable).
func checkPoolPOSIXFD(dev Device) error {
	v, err := deviceAttrSince(dev, attrMemPoolSupportedHandleTypes, 11030, 0)
	if err != nil {
		return err
	}
	if v&memHandleTypePOSIXFD == 0 {
		return errorf("%s cannot export memory pools as POSIX file descriptors (CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES is %d): %w", dev, v, ErrNotSupported)
	}
	return nil
}

// setVMMExportable makes vm, an expandable pool's virtual memory, create physical memory that
// can be exported as POSIX file descriptors. Only device memory can be: another vm is
// ErrNotSupported, as is a device or driver without the export (attribute 103,
// CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED).
func setVMMExportable(vm vmm) error {
	dv, ok := vm.(*deviceVMM)
	if !ok {
		return errorf("NewPoolMemoryResource: Exportable needs device memory (an expandable pool over a CudaMemoryResource, or nil with a CUDA device); %T cannot be shared with other processes: %w", vm, ErrNotSupported)
	}
	if cuIPCBound()&ipcBoundVMM == 0 {
		return errorf("NewPoolMemoryResource: Exportable: the CUDA driver lacks cuMemExportToShareableHandle or cuMemImportFromShareableHandle: %w", ErrNotSupported)
	}
	v, err := cuDeviceAttribute(int(dv.dev), attrHandleTypePOSIXFDSupported)
	if err != nil {
		return errorf("NewPoolMemoryResource: Exportable on %s: %w", dv.dev, err)
	}
	if v != 1 {
		return errorf("NewPoolMemoryResource: Exportable: %s cannot export memory as POSIX file descriptors (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is %d): %w", dv.dev, v, ErrNotSupported)
	}
	dv.handleTypes = memHandleTypePOSIXFD
	return nil
}

// exportFD exports the physical allocation h as a new POSIX file descriptor
// (cuMemExportToShareableHandle). The mutex is held across the call, so that a concurrent
// release cannot pass the driver a released handle.
func (v *deviceVMM) exportFD(h vmmHandle) (int, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if _, ok := v.handles[h]; !ok {
		return -1, errorf("%s.exportFD(handle %#x): unknown or released handle: %w", deviceVMMName, uint64(h), ErrInvalidArgument)
	}
	if v.handleTypes&memHandleTypePOSIXFD == 0 {
		return -1, errorf("%s.exportFD: the memory was not created exportable: %w", deviceVMMName, ErrNotExportable)
	}
	fd, err := cuMemExportFD(v.ctx, uint64(h))
	if err != nil {
		return -1, errorf("%s.exportFD(handle %#x) on %s: %w", deviceVMMName, uint64(h), v.dev, err)
	}
	return fd, nil
}

// vmmPiece is one piece of physical memory under a range of an expandable pool: its handle, its
// size, and its offset from the start of the first piece.
type vmmPiece struct {
	offset int
	size   int
	h      vmmHandle
}

// vmmPiecesCovering returns the chunks of an expandable pool that hold [ptr, ptr+n), which must
// lie in one live allocation, in address order, and the address the first one starts at. The
// chunks under a live block are mapped back to back (a release never takes a chunk
// that holds live memory), so the pieces tile [start, start+Σsize).
func (e *expandable) vmmPiecesCovering(ptr DevicePtr, n int) (DevicePtr, []vmmPiece, error) {
	p := e.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.checkLiveRange(ptr, n); err != nil {
		return 0, nil, err
	}
	end := ptr + DevicePtr(n)
	i := sort.Search(len(e.chunks), func(i int) bool { return e.chunks[i].end() > ptr })
	var start DevicePtr
	var pieces []vmmPiece
	for ; i < len(e.chunks) && e.chunks[i].addr < end; i++ {
		c := e.chunks[i]
		if len(pieces) == 0 {
			if c.addr > ptr {
				break
			}
			start = c.addr
		} else if last := pieces[len(pieces)-1]; start+DevicePtr(last.offset+last.size) != c.addr {
			return 0, nil, errorf("internal error: PoolMemoryResource.ExportIPC(%#x, %d): the chunks under a live block are not back to back (%#x follows %#x)", uintptr(ptr), n, uintptr(c.addr), uintptr(start)+uintptr(last.offset+last.size))
		}
		pieces = append(pieces, vmmPiece{offset: int(c.addr - start), size: c.size, h: c.h})
	}
	if len(pieces) == 0 || start+DevicePtr(pieces[len(pieces)-1].offset+pieces[len(pieces)-1].size) < end {
		return 0, nil, errorf("internal error: PoolMemoryResource.ExportIPC(%#x, %d): live memory not wholly mapped", uintptr(ptr), n)
	}
	return start, pieces, nil
}

// exportVMM exports [ptr, ptr+n) of an expandable pool: one file descriptor per piece. stitched,
// when not nil, gives the pieces under a stitched block (nil pieces when ptr is in none).
func (e *expandable) exportVMM(ptr DevicePtr, n int, stitched func(DevicePtr, int) (DevicePtr, []vmmPiece, error)) (*IPCHandle, error) {
	const name = "PoolMemoryResource (expandable)"
	p := e.p
	dv, ok := e.vm.(*deviceVMM)
	if !ok {
		return nil, notExportable(name, fmt.Sprintf("its memory is %s, which cannot be shared with other processes", e.source))
	}
	if dv.handleTypes&memHandleTypePOSIXFD == 0 {
		return nil, notExportable(name, "it was made without PoolOptions.Exportable, so its physical memory cannot be exported")
	}
	ord, uuid, err := ipcDeviceOf(p.dev)
	if err != nil {
		return nil, errorf("%s.ExportIPC: %w", name, err)
	}
	// A stitched block exports the handles mapped under its own range, in order.
	var start DevicePtr
	var pieces []vmmPiece
	if stitched != nil {
		start, pieces, err = stitched(ptr, n)
	}
	if err == nil && pieces == nil {
		start, pieces, err = e.vmmPiecesCovering(ptr, n)
	}
	if err != nil {
		return nil, err
	}
	h := &IPCHandle{kind: IPCKindVirtualMemory, dev: ord, uuid: uuid, size: n, offset: int(ptr - start), nfds: len(pieces)}
	fds := make([]int, 0, len(pieces))
	for _, pc := range pieces {
		fd, err := dv.exportFD(pc.h)
		if err != nil {
			if cerr := closeFDs(fds); cerr != nil {
				err = errors.Join(err, cerr)
			}
			return nil, errorf("%s.ExportIPC(%#x, %d): %w", name, uintptr(ptr), n, err)
		}
		fds = append(fds, fd)
		h.pieces = append(h.pieces, pc.size)
	}
	h.fds = fds
	return h, nil
}

// checkLiveRange returns nil when [ptr, ptr+n) lies in one allocation the pool handed out and has
// not taken back (in its live table, or handed out by a stream's cache), within the bytes asked
// for, not the block's rounding beyond them (pool locked). A pointer at a block's start is found
// at once; one inside a block costs a scan of the live blocks.
func (p *PoolMemoryResource) checkLiveRange(ptr DevicePtr, n int) error {
	if p.closed {
		return errorf("PoolMemoryResource.ExportIPC: called after Close: %w", ErrClosed)
	}
	holds := func(b *block) bool { return b != nil && b.addr <= ptr && ptr < b.end() }
	b := p.live.get(ptr)
	if !holds(b) {
		b = nil
		scan := func(c *block) {
			if b == nil && holds(c) {
				b = c
			}
		}
		if m := p.caches.Load(); m != nil {
			for _, c := range m.all() {
				c.mu.Lock()
				if b = c.issued.get(ptr); b == nil {
					c.issued.each(scan)
				}
				c.mu.Unlock()
				if b != nil {
					break
				}
			}
		}
		if b == nil {
			p.live.each(scan)
		}
	}
	if b == nil {
		return errorf("PoolMemoryResource.ExportIPC(%#x, %d): the range is not inside one live allocation of the pool: %w", uintptr(ptr), n, ErrInvalidArgument)
	}
	if end := b.addr + DevicePtr(b.req()); uintptr(ptr-b.addr)+uintptr(n) > uintptr(b.req()) {
		return errorf("PoolMemoryResource.ExportIPC(%#x, %d): the range runs past the end of the allocation [%#x, %#x) it starts in: %w", uintptr(ptr), n, uintptr(b.addr), uintptr(end), ErrInvalidArgument)
	}
	return nil
}
