package rmm

import (
	"sync/atomic"

	"github.com/gormm/rmm/internal/cuda"
)

// memAllocationTypeManaged is CU_MEM_ALLOCATION_TYPE_MANAGED (CUDA 13.0).
const memAllocationTypeManaged = 2

// asyncManagedMinDriver is the first driver version whose default pools include a managed-memory
// pool per device (cuMemGetDefaultMemPool).
const asyncManagedMinDriver = 13000

// CudaAsyncManagedMemoryResource is a stream-ordered allocator over a device's default pool of
// managed memory, as librmm's cuda_async_managed_memory_resource: Allocate is
// cuMemAllocFromPoolAsync on that pool, ordered on the given stream, Deallocate is cuMemFreeAsync
// on the given stream. The memory is managed: the host may read and write it once the work that
// wrote it is done (Access is [HostAccessible] and [DeviceAccessible]). Allocations are aligned to
// at least 256 bytes.
//
// The pool belongs to the device (cuMemGetDefaultMemPool with a device location and
// CU_MEM_ALLOCATION_TYPE_MANAGED, CUDA 13.0): every resource of the device shares it, its
// attributes are left as the driver set them, and Close does not destroy it. A view of a
// [Stream] that was closed is never handed to the driver: Allocate on it returns [ErrClosed];
// Deallocate on it waits for the device (cuCtxSynchronize) and frees on the legacy default stream.
type CudaAsyncManagedMemoryResource struct {
	dev    Device
	ctx    uintptr
	pool   uintptr
	closed atomic.Bool
}

// NewCudaAsyncManagedMemoryResource returns a resource over device dev's default managed-memory
// pool. Without CUDA the error wraps [ErrNoDevice]; where the driver is older than CUDA 13.0, or
// the device lacks managed memory or stream-ordered memory pools, it wraps [ErrNotSupported],
// found from the driver's version and the device's attributes (no failing driver call); a bad
// ordinal wraps [ErrInvalidArgument].
func NewCudaAsyncManagedMemoryResource(dev Device) (*CudaAsyncManagedMemoryResource, error) {
	ctx, err := dev.ctx()
	if err != nil {
		return nil, err
	}
	if v, err := DriverVersion(); err != nil || v < asyncManagedMinDriver {
		return nil, errorf("NewCudaAsyncManagedMemoryResource: managed memory pools need a CUDA 13.0 driver (this one is %d): %w", v, ErrNotSupported)
	}
	for _, a := range []struct {
		attr int
		what string
	}{{attrMemoryPoolsSupported, "stream-ordered memory pools"}, {attrManagedMemory, "managed memory"}} {
		if v, err := dev.Attribute(a.attr); err != nil || v == 0 {
			return nil, errorf("NewCudaAsyncManagedMemoryResource: %s does not support %s: %w", dev, a.what, ErrNotSupported)
		}
	}
	pool, r := cuda.MemGetDefaultMemPool(ctx, int(dev), memAllocationTypeManaged)
	if r == cuda.Missing {
		return nil, errorf("NewCudaAsyncManagedMemoryResource: the driver lacks cuMemGetDefaultMemPool: %w", ErrNotSupported)
	}
	if err := cuErr("cuMemGetDefaultMemPool", r); err != nil {
		return nil, errorf("NewCudaAsyncManagedMemoryResource(%s): %w", dev, err)
	}
	return &CudaAsyncManagedMemoryResource{dev: dev, ctx: ctx, pool: pool}, nil
}

// Allocate returns nbytes of managed memory from the pool, ordered on s (cuMemAllocFromPoolAsync):
// the memory may be used by work queued on s after this call. Zero bytes return 0 and no error; a
// negative size wraps [ErrInvalidArgument]. Out of memory is reported synchronously and wraps
// [ErrOutOfMemory]. After Close, or on a view of a [Stream] that was closed, it returns an error
// wrapping [ErrClosed] without calling the driver.
func (r *CudaAsyncManagedMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	return poolAllocate("CudaAsyncManagedMemoryResource", r.ctx, r.pool, &r.closed, nbytes, s)
}

// Deallocate returns p to the pool, ordered on s (cuMemFreeAsync): the memory is reused only by
// work ordered after everything queued on s so far. A null p does nothing. It works after Close
// too, so that memory still allocated can be given back. On a view of a [Stream] that was closed
// it waits for the device (cuCtxSynchronize) and frees on the legacy default stream. A pointer the
// pool did not hand out is not detected here: the driver's error comes back as a *[CUDAError].
func (r *CudaAsyncManagedMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if p == 0 {
		return nil
	}
	return freeAsyncOn("CudaAsyncManagedMemoryResource", r.ctx, p, s)
}

// Device returns the pool's device.
func (r *CudaAsyncManagedMemoryResource) Device() Device { return r.dev }

// Access reports [HostAccessible] and [DeviceAccessible]: the memory is managed.
func (r *CudaAsyncManagedMemoryResource) Access() Access { return HostAccessible | DeviceAccessible }

// PoolHandle returns the CUmemoryPool handle of the device's default managed-memory pool.
func (r *CudaAsyncManagedMemoryResource) PoolHandle() uintptr { return r.pool }

// UsedBytes returns the bytes allocated from the pool and not freed, by any user of the pool
// (CU_MEMPOOL_ATTR_USED_MEM_CURRENT).
func (r *CudaAsyncManagedMemoryResource) UsedBytes() (int, error) {
	v, err := cuMemPoolGetAttributeU64(r.ctx, r.pool, memPoolAttrUsedMemCurrent)
	return int(v), err
}

// ReservedBytes returns the bytes the pool holds (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT).
func (r *CudaAsyncManagedMemoryResource) ReservedBytes() (int, error) {
	v, err := cuMemPoolGetAttributeU64(r.ctx, r.pool, memPoolAttrReservedMemCurrent)
	return int(v), err
}

// Close makes later Allocate calls return [ErrClosed]. It neither destroys the pool nor frees
// anything. Closing twice returns nil.
func (r *CudaAsyncManagedMemoryResource) Close() error {
	r.closed.Store(true)
	return nil
}
