package rmm

import (
	"strings"
)

// Exporting memory for other processes (ipc.go has the overview).

// IPCExporter is implemented by memory resources whose memory another process can import:
// [CudaMemoryResource], [CudaAsyncMemoryResource] and [PoolMemoryResource] (each answering
// [ErrNotExportable] when the way it was made does not allow it).
type IPCExporter interface {
	// ExportIPC returns a handle to [p, p+nbytes), which must lie in one allocation the resource
	// gave out and that is still live (nbytes > 0). The caller owns the handle (Close it once
	// sent) and must keep the memory allocated until every importer has closed it. Errors:
	// [ErrNotExportable] when the resource cannot export (the message says why),
	// [ErrInvalidArgument] for a range that is not live memory of the resource (where the
	// resource can tell), a [*CUDAError] from the driver. A failed export leaves nothing open.
	ExportIPC(p DevicePtr, nbytes int) (*IPCHandle, error)
}

// ExportIPC exports [p, p+nbytes) of memory from mr (nil: the current device resource), which
// must lie in one live allocation of mr. Adaptors that hand out their upstream's pointers
// unchanged (Statistics, StreamStatistics, Logging, Tracking, Limiting, FailureCallback,
// ThreadSafe, Prefetch, MemoryProfile) export through their upstream. A resource that cannot
// export gives an error wrapping [ErrNotExportable] that names it. See [IPCExporter].
func ExportIPC(mr MemoryResource, p DevicePtr, nbytes int) (*IPCHandle, error) {
	mr = resourceOrCurrent(mr)
	chain := ""
	for r := mr; ; {
		if e, ok := r.(IPCExporter); ok {
			h, err := e.ExportIPC(p, nbytes)
			if err != nil && chain != "" {
				return nil, errorf("ExportIPC through %s: %w", strings.TrimSuffix(chain, " over "), err)
			}
			return h, err
		}
		up := ipcPassThrough(r)
		if up == nil {
			return nil, notExportable(chain+resourceName(r), "it cannot export memory to other processes (exportable: CudaMemoryResource; CudaAsyncMemoryResource made with EnablePOSIXFileDescriptor; a PoolMemoryResource over those, or expandable and made with Exportable)")
		}
		chain += resourceName(r) + " over "
		r = up
	}
}

// ipcPassThrough returns the upstream of an adaptor whose pointers are its upstream's, else nil.
func ipcPassThrough(mr MemoryResource) MemoryResource {
	if r, ok := mr.(passThrough); ok {
		return r.Upstream()
	}
	return nil
}

// notExportable is the ErrNotExportable error naming the resource and why.
func notExportable(resource, why string) error {
	return errorf("%s: %s: %w", resource, why, ErrNotExportable)
}

// checkExportRange validates the range given to resource.ExportIPC.
func checkExportRange(resource string, p DevicePtr, nbytes int) error {
	if nbytes <= 0 || p == 0 {
		return errorf("%s.ExportIPC(%#x, %d): an export needs a non-null pointer and a positive size: %w", resource, uintptr(p), nbytes, ErrInvalidArgument)
	}
	if uintptr(p)+uintptr(nbytes) < uintptr(p) {
		return errorf("%s.ExportIPC(%#x, %d): the range runs past the end of the address space: %w", resource, uintptr(p), nbytes, ErrInvalidArgument)
	}
	return nil
}

// ExportIPC exports the buffer's Len() bytes through its memory resource (see the package
// function ExportIPC). The buffer must stay open, and not be resized beyond its capacity, until
// every importer has closed its import. An empty buffer is [ErrInvalidArgument].
func (b *DeviceBuffer) ExportIPC() (*IPCHandle, error) {
	return b.st.exportIPC()
}

// ExportIPC exports the vector's Len() elements through its memory resource (see the package
// function ExportIPC); the importer views them with ImportIPC[T]. The vector must stay open, and
// not be resized beyond its capacity, until every importer has closed its import. An empty
// vector is [ErrInvalidArgument].
func (v *Uvector[T]) ExportIPC() (*IPCHandle, error) {
	return v.st.exportIPC()
}

func (st *memState) exportIPC() (*IPCHandle, error) {
	if st.closed {
		return nil, st.errClosed("ExportIPC")
	}
	if st.size == 0 {
		return nil, errorf("%s.ExportIPC: the container is empty: %w", st.kind, ErrInvalidArgument)
	}
	h, err := ExportIPC(st.mr, st.ptr, st.size)
	if err != nil {
		return nil, errorf("%s.ExportIPC: %w", st.kind, err)
	}
	return h, nil
}

// ipcDeviceOf returns what a handle records of dev: its ordinal and UUID.
func ipcDeviceOf(dev Device) (int, [16]byte, error) {
	u, err := dev.UUID()
	return int(dev), u, err
}

var (
	_ IPCExporter = (*CudaMemoryResource)(nil)
	_ IPCExporter = (*CudaAsyncMemoryResource)(nil)
	_ IPCExporter = (*PoolMemoryResource)(nil)
)

// ExportIPC exports [p, p+nbytes) of cuMemAlloc memory as an [IPCKindLegacy] handle: the
// allocation holding the range (cuMemGetAddressRange) is exported with cuIpcGetMemHandle and the
// range's offset in it is recorded, so p may point anywhere inside an allocation. The driver is
// first asked (cuPointerGetAttributes, a call that cannot fail on a bad address) whether p is
// memory of this device that cuIpcGetMemHandle accepts: [ErrInvalidArgument] if it is not device
// memory of this resource's device, [ErrNotSupported] if the driver says legacy IPC does not apply
// to it (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE is 0).
func (r *CudaMemoryResource) ExportIPC(p DevicePtr, nbytes int) (*IPCHandle, error) {
	const name = "CudaMemoryResource"
	if err := checkExportRange(name, p, nbytes); err != nil {
		return nil, err
	}
	ctx, err := r.dev.ctx()
	if err != nil {
		return nil, errorf("%s.ExportIPC on %s: %w", name, r.dev, err)
	}
	if cuIPCBound()&ipcBoundLegacy == 0 {
		return nil, errorf("%s.ExportIPC: the CUDA driver lacks cuIpcGetMemHandle, cuIpcOpenMemHandle_v2 or cuMemGetAddressRange_v2: %w", name, ErrNotSupported)
	}
	info, err := cuPointerInfo(ctx, p, false)
	if err != nil {
		return nil, errorf("%s.ExportIPC(%#x): %w", name, uintptr(p), err)
	}
	if info.memType != cuMemoryTypeDevice || info.ordinal != int(r.dev) {
		return nil, errorf("%s.ExportIPC(%#x): not device memory of %s (the driver reports memory type %d on device %d): %w", name, uintptr(p), r.dev, info.memType, info.ordinal, ErrInvalidArgument)
	}
	if !info.legacyIPC {
		return nil, errorf("%s.ExportIPC(%#x): the driver reports the allocation as not exportable with cuIpcGetMemHandle (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE is 0): %w", name, uintptr(p), ErrNotSupported)
	}
	base, size, err := cuMemGetAddressRange(ctx, p)
	if err != nil {
		return nil, errorf("%s.ExportIPC(%#x): %w", name, uintptr(p), err)
	}
	if p < base || uintptr(p-base)+uintptr(nbytes) > uintptr(size) {
		return nil, errorf("%s.ExportIPC(%#x, %d): the range runs past its allocation [%#x, %#x): %w", name, uintptr(p), nbytes, uintptr(base), uintptr(base)+uintptr(size), ErrInvalidArgument)
	}
	ord, uuid, err := ipcDeviceOf(r.dev)
	if err != nil {
		return nil, errorf("%s.ExportIPC: %w", name, err)
	}
	data, err := cuIpcGetMemHandle(ctx, base)
	if err != nil {
		return nil, errorf("%s.ExportIPC(%#x): %w", name, uintptr(p), err)
	}
	return &IPCHandle{kind: IPCKindLegacy, dev: ord, uuid: uuid, size: nbytes, offset: int(p - base), data: data}, nil
}

// ExportIPC exports [p, p+nbytes) as an [IPCKindMemPool] handle: the pool as a POSIX file
// descriptor (cuMemPoolExportToShareableHandle) and the allocation (cuMemPoolExportPointer). p
// must be a pointer Allocate returned (the start of an allocation, as a container's Data is):
// the driver exports whole allocations, and a pointer inside one cannot be told from a start
// here. The resource must have been made with [CudaAsyncOptions.EnablePOSIXFileDescriptor]
// ([ErrNotExportable] otherwise); a pointer that is not from this resource's pool is
// [ErrInvalidArgument] (asked of the driver with cuPointerGetAttributes, which cannot fail on a bad
// address). The driver requires the importers to free their imports before this process frees
// the allocation.
func (r *CudaAsyncMemoryResource) ExportIPC(p DevicePtr, nbytes int) (*IPCHandle, error) {
	const name = "CudaAsyncMemoryResource"
	if err := checkExportRange(name, p, nbytes); err != nil {
		return nil, err
	}
	pool := r.pool.Load()
	if pool == 0 {
		return nil, errorf("%s.ExportIPC: called after Close: %w", name, ErrClosed)
	}
	if !r.posixFD {
		return nil, notExportable(name, "it was made without CudaAsyncOptions.EnablePOSIXFileDescriptor, so its pool cannot be shared")
	}
	if cuIPCBound()&ipcBoundMemPool == 0 {
		return nil, errorf("%s.ExportIPC: the CUDA driver lacks cuMemPoolExportToShareableHandle or cuMemPoolExportPointer: %w", name, ErrNotSupported)
	}
	info, err := cuPointerInfo(r.ctx, p, true)
	if err != nil {
		return nil, errorf("%s.ExportIPC(%#x): %w", name, uintptr(p), err)
	}
	if info.pool != pool {
		return nil, errorf("%s.ExportIPC(%#x): not an allocation of this resource's pool: %w", name, uintptr(p), ErrInvalidArgument)
	}
	ord, uuid, err := ipcDeviceOf(r.dev)
	if err != nil {
		return nil, errorf("%s.ExportIPC: %w", name, err)
	}
	// The driver exports an allocation only from a pool that has already been shared
	// (cuMemPoolExportPointer is CUDA_ERROR_INVALID_VALUE before the pool's first
	// cuMemPoolExportToShareableHandle), so the pool goes first.
	fd, err := cuMemPoolExportFD(r.ctx, pool)
	if err != nil {
		return nil, errorf("%s.ExportIPC(%#x): %w", name, uintptr(p), err)
	}
	data, err := cuMemPoolExportPointer(r.ctx, p)
	if err != nil {
		closeFDs([]int{fd})
		return nil, errorf("%s.ExportIPC(%#x): %w", name, uintptr(p), err)
	}
	return &IPCHandle{kind: IPCKindMemPool, dev: ord, uuid: uuid, size: nbytes, data: data, nfds: 1, fds: []int{fd}}, nil
}

// ExportIPC exports [p, p+nbytes), which must lie in one live allocation of the pool
// ([ErrInvalidArgument] otherwise; p may point inside it).
//
// An expandable pool made with [PoolOptions.Exportable] exports the pieces of physical memory
// under the range ([IPCKindVirtualMemory]: one file descriptor per piece, from
// cuMemExportToShareableHandle); one made without it, or over host memory, is [ErrNotExportable].
// A plain pool exports the upstream allocation holding the range through its upstream (so over a
// [CudaMemoryResource], or a [CudaAsyncMemoryResource] made with EnablePOSIXFileDescriptor; other
// upstreams are ErrNotExportable) and records the range's offset in it.
func (p *PoolMemoryResource) ExportIPC(ptr DevicePtr, nbytes int) (*IPCHandle, error) {
	const name = "PoolMemoryResource"
	if err := checkExportRange(name, ptr, nbytes); err != nil {
		return nil, err
	}
	if p.backing == nil {
		return nil, errNotMade("ExportIPC")
	}
	return p.backing.exportIPC(ptr, nbytes)
}
