package rmm

import (
	"sync/atomic"
)

// DefaultMemPool returns the handle (a CUmemoryPool) of device dev's default memory pool
// (cuDeviceGetDefaultMemPool): the pool that stream-ordered allocations use unless another is
// set, and the one the CUDA runtime's cudaMallocAsync shares. Without CUDA the error wraps
// [ErrNoDevice]; on a device or driver without memory pools it wraps [ErrNotSupported]; a bad ordinal
// wraps [ErrInvalidArgument].
func DefaultMemPool(dev Device) (uintptr, error) {
	ctx, err := dev.ctx()
	if err != nil {
		return 0, err
	}
	if v, err := dev.Attribute(attrMemoryPoolsSupported); err != nil || v == 0 {
		return 0, errorf("%s does not support stream-ordered memory pools: %w", dev, ErrNotSupported)
	}
	pool, err := cuDeviceGetDefaultMemPool(ctx, int(dev))
	if err != nil {
		return 0, errorf("DefaultMemPool(%s): %w", dev, err)
	}
	return pool, nil
}

// CudaAsyncViewMemoryResource is a stream-ordered allocator over a CUDA memory pool it does not
// own, as librmm's cuda_async_view_memory_resource: a device's default pool ([DefaultMemPool]), a
// pool made by another library, or one imported from another process. Allocate is
// cuMemAllocFromPoolAsync on the given stream, Deallocate is cuMemFreeAsync on the given stream.
// Close does not destroy the pool; the pool must outlive the view and every allocation made
// through it. A view of a [Stream] that was closed is never handed to the driver: Allocate on it
// returns [ErrClosed], Deallocate on it waits for the device (cuCtxSynchronize) and frees on the
// legacy default stream. A free on another stream than the memory's last use must be ordered
// after that use by the caller (see [MemoryResource]).
//
// Equality (librmm's rule): memory from one view may be freed through any other view of the same
// pool, or through the [CudaAsyncMemoryResource] that owns the pool.
type CudaAsyncViewMemoryResource struct {
	dev    Device
	ctx    uintptr
	pool   uintptr
	closed atomic.Bool
}

// NewCudaAsyncViewMemoryResource returns a view of pool, a CUmemoryPool handle of device dev. A
// zero handle returns [ErrInvalidArgument]; without CUDA the error wraps [ErrNoDevice]; a device
// without memory pools gives [ErrNotSupported]. The handle is not checked further: a handle that is
// not a live pool of dev makes the driver calls fail.
func NewCudaAsyncViewMemoryResource(dev Device, pool uintptr) (*CudaAsyncViewMemoryResource, error) {
	if pool == 0 {
		return nil, errorf("NewCudaAsyncViewMemoryResource: null pool handle: %w", ErrInvalidArgument)
	}
	ctx, err := dev.ctx()
	if err != nil {
		return nil, err
	}
	if v, err := dev.Attribute(attrMemoryPoolsSupported); err != nil || v == 0 {
		return nil, errorf("%s does not support stream-ordered memory pools: %w", dev, ErrNotSupported)
	}
	return &CudaAsyncViewMemoryResource{dev: dev, ctx: ctx, pool: pool}, nil
}

// Allocate returns nbytes from the pool, ordered on s (cuMemAllocFromPoolAsync): the memory may
// be used by work queued on s after this call. Out of memory is reported synchronously and wraps
// [ErrOutOfMemory]. After Close, or on a view of a [Stream] that was closed, it returns an error
// wrapping [ErrClosed] without calling the driver.
func (r *CudaAsyncViewMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	return poolAllocate("CudaAsyncViewMemoryResource", r.ctx, r.pool, &r.closed, nbytes, s)
}

// poolAllocate is Allocate of a resource over a CUmemoryPool it does not own (a view, the
// device's managed pool), named name in errors: cuMemAllocFromPoolAsync on s, after the checks of
// the size, of Close and of a closed Stream.
func poolAllocate(name string, ctx, pool uintptr, closed *atomic.Bool, nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes <= 0 {
		if nbytes < 0 {
			return 0, invalidSize(name, "Allocate", nbytes)
		}
		return 0, nil
	}
	if closed.Load() {
		return 0, errorf("%s.Allocate: called after Close: %w", name, ErrClosed)
	}
	if s.closed() {
		return 0, errStreamClosed(name+".Allocate", s)
	}
	p, err := cuMemAllocFromPoolAsync(ctx, nbytes, pool, s.cu())
	if err != nil {
		if isOOM(err) {
			return 0, outOfMemory(name, nbytes, err)
		}
		return 0, errorf("%s: allocating %s: %w", name, bytesText(nbytes), err)
	}
	return p, nil
}

// Deallocate returns p to the pool, ordered on s (cuMemFreeAsync): the memory is reused only by
// work ordered after everything queued on s so far. On a view of a [Stream] that was closed it
// waits for the device (cuCtxSynchronize) and frees on the legacy default stream. It works after
// Close too, so that memory still allocated can be given back.
func (r *CudaAsyncViewMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if p == 0 {
		return nil
	}
	return freeAsyncOn("CudaAsyncViewMemoryResource", r.ctx, p, s)
}

// Device returns the pool's device.
func (r *CudaAsyncViewMemoryResource) Device() Device { return r.dev }

// Access reports [DeviceAccessible].
func (r *CudaAsyncViewMemoryResource) Access() Access { return DeviceAccessible }

// PoolHandle returns the CUmemoryPool handle the view allocates from.
func (r *CudaAsyncViewMemoryResource) PoolHandle() uintptr { return r.pool }

// UsedBytes returns the bytes allocated from the pool and not freed, by any user of the pool
// (CU_MEMPOOL_ATTR_USED_MEM_CURRENT).
func (r *CudaAsyncViewMemoryResource) UsedBytes() (int, error) {
	v, err := cuMemPoolGetAttributeU64(r.ctx, r.pool, memPoolAttrUsedMemCurrent)
	return int(v), err
}

// ReservedBytes returns the bytes the pool holds from the device
// (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT).
func (r *CudaAsyncViewMemoryResource) ReservedBytes() (int, error) {
	v, err := cuMemPoolGetAttributeU64(r.ctx, r.pool, memPoolAttrReservedMemCurrent)
	return int(v), err
}

// Close makes later Allocate calls return [ErrClosed]. It does not destroy the pool nor free
// anything. Closing twice returns nil.
func (r *CudaAsyncViewMemoryResource) Close() error {
	r.closed.Store(true)
	return nil
}
