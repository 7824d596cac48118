package rmm

import (
	"math"
	"sync/atomic"
)

// CUmemPool_attribute values.
const (
	memPoolAttrReleaseThreshold   = 4
	memPoolAttrReservedMemCurrent = 5
	memPoolAttrReservedMemHigh    = 6
	memPoolAttrUsedMemCurrent     = 7
)

// CudaAsyncOptions configures [NewCudaAsyncMemoryResource]. nil means the defaults.
type CudaAsyncOptions struct {
	// InitialPoolSize, when positive, primes the pool: that many bytes are allocated and freed on
	// the default stream at construction, so the first allocations do not reach the driver.
	// Default 0 (not primed).
	InitialPoolSize int
	// ReleaseThreshold is the number of free bytes the pool keeps reserved at synchronisation
	// points (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD). Default -1, meaning unlimited (the pool never
	// gives memory back on its own), as librmm's default; 0 releases at every synchronisation.
	ReleaseThreshold int
	// EnablePOSIXFileDescriptor creates the pool exportable through a POSIX file descriptor
	// (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), so that its allocations can be shared with other
	// processes ([ExportIPC]). The constructor returns [ErrNotSupported] when the device does not
	// offer it (CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES). Default false.
	EnablePOSIXFileDescriptor bool
}

// CudaAsyncMemoryResource is a stream-ordered allocator over its own CUDA memory pool
// (cuMemPoolCreate): Allocate is cuMemAllocFromPoolAsync on the given stream, Deallocate is
// cuMemFreeAsync on the given stream. Close destroys the pool.
//
// A view of a [Stream] that was closed is never handed to the driver: Allocate on it returns
// [ErrClosed], and Deallocate on it first waits for the device (cuCtxSynchronize) and then frees on
// the legacy default stream. A free on a stream other than the one the memory was last used on
// must be ordered after that use by the caller (see [MemoryResource]): the driver does not.
type CudaAsyncMemoryResource struct {
	dev     Device
	ctx     uintptr
	pool    atomic.Uintptr // 0 after Close
	posixFD bool           // made with EnablePOSIXFileDescriptor: ExportIPC works
}

// NewCudaAsyncMemoryResource creates a memory pool on device dev. It returns [ErrNotSupported]
// when the device or driver lacks memory pools, [ErrInvalidArgument] for a negative initial size.
func NewCudaAsyncMemoryResource(dev Device, opts *CudaAsyncOptions) (*CudaAsyncMemoryResource, error) {
	o := CudaAsyncOptions{ReleaseThreshold: -1}
	if opts != nil {
		o = *opts
	}
	if o.InitialPoolSize < 0 {
		return nil, errorf("CudaAsyncOptions.InitialPoolSize %d is negative: %w", o.InitialPoolSize, ErrInvalidArgument)
	}
	ctx, err := dev.ctx()
	if err != nil {
		return nil, err
	}
	if v, err := dev.Attribute(attrMemoryPoolsSupported); err != nil || v == 0 {
		return nil, errorf("%s does not support stream-ordered memory pools: %w", dev, ErrNotSupported)
	}
	handles := 0
	if o.EnablePOSIXFileDescriptor {
		if err := checkPoolPOSIXFD(dev); err != nil {
			return nil, err
		}
		handles = memHandleTypePOSIXFD
	}
	pool, err := cuMemPoolCreate(ctx, int(dev), handles)
	if err != nil {
		return nil, err
	}
	r := &CudaAsyncMemoryResource{dev: dev, ctx: ctx, posixFD: o.EnablePOSIXFileDescriptor}
	r.pool.Store(pool)
	threshold := uint64(math.MaxUint64)
	if o.ReleaseThreshold >= 0 {
		threshold = uint64(o.ReleaseThreshold)
	}
	if err := cuMemPoolSetAttributeU64(ctx, pool, memPoolAttrReleaseThreshold, threshold); err != nil {
		cuMemPoolDestroy(ctx, pool)
		return nil, err
	}
	if o.InitialPoolSize > 0 {
		p, err := r.Allocate(o.InitialPoolSize, DefaultStream)
		if err == nil {
			err = r.Deallocate(p, o.InitialPoolSize, DefaultStream)
		}
		if err == nil {
			err = DefaultStream.deviceView(dev).Synchronize()
		}
		if err != nil {
			cuMemPoolDestroy(ctx, pool)
			return nil, err
		}
	}
	return r, nil
}

// Allocate returns nbytes from the pool, ordered on s (cuMemAllocFromPoolAsync). Out of memory is
// reported synchronously and wraps [ErrOutOfMemory]. After Close, or on a view of a [Stream] that was
// closed, it returns an error wrapping [ErrClosed] without calling the driver.
func (r *CudaAsyncMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes <= 0 {
		if nbytes < 0 {
			return 0, invalidSize("CudaAsyncMemoryResource", "Allocate", nbytes)
		}
		return 0, nil
	}
	pool := r.pool.Load()
	if pool == 0 {
		return 0, errorf("CudaAsyncMemoryResource.Allocate: called after Close: %w", ErrClosed)
	}
	if s.closed() {
		return 0, errStreamClosed("CudaAsyncMemoryResource.Allocate", s)
	}
	p, err := cuMemAllocFromPoolAsync(r.ctx, nbytes, pool, s.cu())
	if err != nil {
		if isOOM(err) {
			return 0, outOfMemory("CudaAsyncMemoryResource", nbytes, err)
		}
		return 0, errorf("CudaAsyncMemoryResource: allocating %s: %w", bytesText(nbytes), err)
	}
	return p, nil
}

// Deallocate returns p to the pool, ordered on s (cuMemFreeAsync). On a view of a [Stream] that was
// closed it waits for the device (cuCtxSynchronize) and frees on the legacy default stream.
func (r *CudaAsyncMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if p == 0 {
		return nil
	}
	return freeAsyncOn("CudaAsyncMemoryResource", r.ctx, p, s)
}

// freeAsyncOn frees p with cuMemFreeAsync ordered on s, or, when s is a view of a Stream that was
// closed, on the legacy default stream once the device is idle.
func freeAsyncOn(name string, ctx uintptr, p DevicePtr, s StreamView) error {
	if s.closed() {
		// The handle was destroyed (and may already name another stream): the driver must not
		// see it. Work queued on the stream before Close still runs, so wait for the whole
		// device before the memory may be reused; the free itself is then ordered after nothing.
		if err := cuCtxSynchronize(ctx); err != nil {
			return errorf("%s.Deallocate(%#x) on closed %v: waiting for the device: %w", name, uintptr(p), s, err)
		}
		s = DefaultStream
	}
	return cuMemFreeAsync(ctx, p, s.cu())
}

// Device returns the resource's device.
func (r *CudaAsyncMemoryResource) Device() Device { return r.dev }

// Access reports [DeviceAccessible].
func (r *CudaAsyncMemoryResource) Access() Access { return DeviceAccessible }

// PoolHandle returns the CUmemoryPool handle.
func (r *CudaAsyncMemoryResource) PoolHandle() uintptr { return r.pool.Load() }

// ReservedBytes returns the bytes the pool holds from the device (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT).
func (r *CudaAsyncMemoryResource) ReservedBytes() (int, error) {
	v, err := cuMemPoolGetAttributeU64(r.ctx, r.pool.Load(), memPoolAttrReservedMemCurrent)
	return int(v), err
}

// ReservedBytesHigh returns the most bytes the pool has held from the device since it was created
// (CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH).
func (r *CudaAsyncMemoryResource) ReservedBytesHigh() (int, error) {
	v, err := cuMemPoolGetAttributeU64(r.ctx, r.pool.Load(), memPoolAttrReservedMemHigh)
	return int(v), err
}

// UsedBytes returns the bytes allocated from the pool and not freed (CU_MEMPOOL_ATTR_USED_MEM_CURRENT).
func (r *CudaAsyncMemoryResource) UsedBytes() (int, error) {
	v, err := cuMemPoolGetAttributeU64(r.ctx, r.pool.Load(), memPoolAttrUsedMemCurrent)
	return int(v), err
}

// Release gives the pool's unused memory back to the device (cuMemPoolTrimTo 0) after
// synchronising the device, so that frees still queued on streams are counted.
func (r *CudaAsyncMemoryResource) Release() error {
	if err := r.dev.Synchronize(); err != nil {
		return err
	}
	return cuMemPoolTrimTo(r.ctx, r.pool.Load(), 0)
}

// Close synchronises the device and destroys the pool. Memory still allocated from it is freed
// by the driver. Closing twice returns nil.
func (r *CudaAsyncMemoryResource) Close() error {
	if r.pool.Load() == 0 {
		return nil
	}
	if err := r.dev.Synchronize(); err != nil {
		return err
	}
	p := r.pool.Swap(0)
	if p == 0 {
		return nil
	}
	return cuMemPoolDestroy(r.ctx, p)
}
