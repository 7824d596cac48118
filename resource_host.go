package rmm

import (
	"sync"
	"unsafe"
)

// HostMemoryResource is the contract of host memory resources, which, as C++'s
// std::pmr::memory_resource, take an alignment:
//
//   - AllocateHost returns a pointer to at least nbytes bytes of host memory aligned to alignment
//     bytes, which must be a power of two (else [ErrInvalidArgument]). AllocateHost(0, a) returns
//     (nil, nil). A negative size returns ErrInvalidArgument; exhausted memory wraps
//     [ErrOutOfMemory]. The memory lies outside the Go heap (the collector neither sees nor moves
//     it), so it may be handed to asynchronous driver copies and it may not hold Go pointers.
//   - DeallocateHost frees p, which AllocateHost(nbytes, alignment) returned; nbytes and
//     alignment must be the values given then. DeallocateHost(nil, ·, ·) is a no-op.
//   - Both are safe for concurrent use.
//
// There is no stream: host memory is allocated and freed at once. Host containers such as
// [HostVector] take their memory from a HostMemoryResource.
type HostMemoryResource interface {
	AllocateHost(nbytes, alignment int) (unsafe.Pointer, error)
	DeallocateHost(p unsafe.Pointer, nbytes, alignment int) error
}

// CU_MEMHOSTALLOC_* flags.
const (
	memHostAllocPortable  = 0x1
	memHostAllocDeviceMap = 0x2
)

// PinnedMemoryResource allocates page-locked ("pinned") host memory with cuMemHostAlloc
// (CU_MEMHOSTALLOC_PORTABLE|CU_MEMHOSTALLOC_DEVICEMAP) and frees it with cuMemFreeHost, as
// librmm's pinned_host_memory_resource. Pinned memory is what makes host↔device copies truly
// asynchronous ([HostVector]), and it is usable by every device through unified addressing.
//
// It is both a [HostMemoryResource] (any power-of-two alignment) and a [MemoryResource] (256-byte
// alignment, the stream ignored on allocation), so it can be the upstream of a
// [PoolMemoryResource]: the pointers are host addresses that kernels and device copies can use
// directly ([Access] reports [HostAccessible]|[DeviceAccessible]).
//
// Without CUDA it falls back to plain host memory (the C heap, as [SystemMemoryResource]; anonymous
// mappings when built without cgo), Access reports HostAccessible only, and programs run anywhere
// unchanged.
//
// Alignments above 256 bytes are met by allocating nbytes + alignment bytes and returning the
// first aligned address inside; the offset is kept in a table beside the memory (nothing is
// written before the returned block). The same table detects a pointer never handed out, a double
// free and a size or alignment other than the one allocated: those return [ErrInvalidFree] and free
// nothing. All PinnedMemoryResources share the table, so memory from one may be freed by another
// (librmm's rule: all pinned resources compare equal).
type PinnedMemoryResource struct {
	dev    Device
	ctx    uintptr // 0 without CUDA: plain host memory
	access Access
}

// hostBlock is one live allocation of a hostTable: where the underlying block starts and what was
// asked.
type hostBlock struct {
	base      uintptr
	nbytes    int
	alignment int
}

// hostTable records the blocks a kind of host resource handed out. Alignments above 256 bytes are
// met by allocating nbytes + alignment bytes and returning the first aligned address inside; the
// offset is kept here, beside the memory (nothing is written before the returned block). The
// same table detects a pointer never handed out, a double free and a size or alignment other
// than the one allocated.
type hostTable struct {
	name string // the resource type, for messages
	mu   sync.Mutex
	live map[uintptr]hostBlock
}

// allocate takes nbytes > 0 aligned to alignment (a power of two) with alloc (total bytes, 256-byte
// aligned) and records the block.
func (t *hostTable) allocate(nbytes, alignment int, alloc func(total int) (uintptr, error)) (uintptr, error) {
	total := nbytes
	if alignment > Alignment {
		if nbytes > int(^uint(0)>>1)-alignment {
			return 0, outOfMemory(t.name, nbytes, errorf("%s plus alignment %d overflow", bytesText(nbytes), alignment))
		}
		total += alignment
	}
	base, err := alloc(total)
	if err != nil {
		return 0, err
	}
	p := (base + uintptr(alignment) - 1) &^ (uintptr(alignment) - 1)
	t.mu.Lock()
	t.live[p] = hostBlock{base: base, nbytes: nbytes, alignment: alignment}
	t.mu.Unlock()
	return p, nil
}

// deallocate checks p against the table, forgets it and frees its block with free; anything not
// handed out as asked returns ErrInvalidFree and frees nothing.
func (t *hostTable) deallocate(op string, p uintptr, nbytes, alignment int, free func(base uintptr) error) error {
	t.mu.Lock()
	b, ok := t.live[p]
	if ok && b.nbytes == nbytes && b.alignment == alignment {
		delete(t.live, p)
	}
	t.mu.Unlock()
	switch {
	case !ok:
		return errorf("%s.%s(%#x, %d): the pointer was not allocated by a %s or was already freed: %w", t.name, op, p, nbytes, t.name, ErrInvalidFree)
	case b.nbytes != nbytes:
		return errorf("%s.%s(%#x, %d): the block was allocated with %s: %w", t.name, op, p, nbytes, bytesText(b.nbytes), ErrInvalidFree)
	case b.alignment != alignment:
		return errorf("%s.%s(%#x, %d): the block was allocated with alignment %d, freed with %d: %w", t.name, op, p, nbytes, b.alignment, alignment, ErrInvalidFree)
	}
	return free(b.base)
}

func (t *hostTable) count() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.live)
}

// hostAllocateChecked is AllocateHost's argument checking for resource name.
func hostAllocateChecked(name string, nbytes, alignment int) error {
	if nbytes < 0 {
		return invalidSize(name, "AllocateHost", nbytes)
	}
	if !IsPowerOfTwo(alignment) {
		return errorf("%s.AllocateHost: alignment %d is not a power of two: %w", name, alignment, ErrInvalidArgument)
	}
	return nil
}

var pinnedTable = hostTable{name: "PinnedMemoryResource", live: map[uintptr]hostBlock{}}

// NewPinnedMemoryResource returns a pinned host memory resource that makes its driver calls in
// device dev's primary context (the memory itself is portable: every device can use it). Without
// CUDA it returns a resource over plain host memory (see the type) and no error; a device that
// does not exist returns [ErrInvalidArgument].
func NewPinnedMemoryResource(dev Device) (*PinnedMemoryResource, error) {
	if err := dev.check(); err != nil {
		return nil, errorf("NewPinnedMemoryResource: %w", err)
	}
	if CUDAAvailable() != nil {
		return &PinnedMemoryResource{dev: dev, access: HostAccessible}, nil
	}
	ctx, err := dev.ctx()
	if err != nil {
		return nil, errorf("NewPinnedMemoryResource: %w", err)
	}
	return &PinnedMemoryResource{dev: dev, ctx: ctx, access: HostAccessible | DeviceAccessible}, nil
}

var (
	defaultPinnedOnce sync.Once
	defaultPinned     *PinnedMemoryResource
	defaultPinnedErr  error
)

// defaultPinnedResource is the process-wide PinnedMemoryResource used when a host container is
// given no resource; it makes its calls in device 0's context.
func defaultPinnedResource() (*PinnedMemoryResource, error) {
	defaultPinnedOnce.Do(func() { defaultPinned, defaultPinnedErr = NewPinnedMemoryResource(0) })
	return defaultPinned, defaultPinnedErr
}

// AllocateHost returns nbytes of pinned host memory aligned to alignment bytes (a power of two).
// Errors: a negative size or an alignment that is not a power of two wraps [ErrInvalidArgument];
// memory the driver cannot pin wraps [ErrOutOfMemory] (with the [*CUDAError]).
func (r *PinnedMemoryResource) AllocateHost(nbytes, alignment int) (unsafe.Pointer, error) {
	if err := hostAllocateChecked("PinnedMemoryResource", nbytes, alignment); err != nil || nbytes == 0 {
		return nil, err
	}
	p, err := r.allocate("AllocateHost", nbytes, alignment)
	return addrToPointer(p), err
}

// DeallocateHost frees p, which AllocateHost(nbytes, alignment) returned (cuMemFreeHost).
// Anything else (a pointer not handed out, freed twice, or another size or alignment) returns
// [ErrInvalidFree] and frees nothing.
func (r *PinnedMemoryResource) DeallocateHost(p unsafe.Pointer, nbytes, alignment int) error {
	if p == nil {
		return nil
	}
	return r.deallocate("DeallocateHost", uintptr(p), nbytes, alignment)
}

// Allocate returns nbytes of pinned host memory aligned to 256 bytes; the stream is ignored (the
// memory is usable on every stream at once). Errors as AllocateHost.
func (r *PinnedMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes <= 0 {
		if nbytes < 0 {
			return 0, invalidSize("PinnedMemoryResource", "Allocate", nbytes)
		}
		return 0, nil
	}
	p, err := r.allocate("Allocate", nbytes, Alignment)
	return DevicePtr(p), err
}

// Deallocate waits for stream s (cuStreamSynchronize: work queued on s may still read or write
// the memory, and the free is immediate; for a [Stream] already closed, the whole device), then
// frees p as DeallocateHost(p, nbytes, 256) does.
func (r *PinnedMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if p == 0 {
		return nil
	}
	if r.ctx != 0 {
		if err := waitStreamBeforeFree(r.dev, s); err != nil {
			return errorf("PinnedMemoryResource.Deallocate: waiting for %v: %w", s, err)
		}
	}
	return r.deallocate("Deallocate", uintptr(p), nbytes, Alignment)
}

// allocate takes nbytes > 0 aligned to alignment (a power of two) and records the block.
func (r *PinnedMemoryResource) allocate(op string, nbytes, alignment int) (uintptr, error) {
	return pinnedTable.allocate(nbytes, alignment, func(total int) (uintptr, error) {
		if r.ctx == 0 {
			base, ok := hostMalloc(total)
			if !ok {
				return 0, outOfMemory("PinnedMemoryResource (host memory: no CUDA)", nbytes, nil)
			}
			return base, nil
		}
		base, err := cuMemHostAlloc(r.ctx, total, memHostAllocPortable|memHostAllocDeviceMap)
		if err != nil {
			if isOOM(err) {
				return 0, outOfMemory("PinnedMemoryResource", nbytes, err)
			}
			return 0, errorf("PinnedMemoryResource.%s: allocating %s: %w", op, bytesText(nbytes), err)
		}
		return base, nil
	})
}

func (r *PinnedMemoryResource) deallocate(op string, p uintptr, nbytes, alignment int) error {
	return pinnedTable.deallocate(op, p, nbytes, alignment, func(base uintptr) error {
		if r.ctx == 0 {
			hostFree(base)
			return nil
		}
		if err := cuMemFreeHost(r.ctx, base); err != nil {
			return errorf("PinnedMemoryResource.%s(%#x, %d): %w", op, p, nbytes, err)
		}
		return nil
	})
}

// Device returns the device in whose context the driver calls are made.
func (r *PinnedMemoryResource) Device() Device { return r.dev }

// Access reports [HostAccessible]|[DeviceAccessible] with CUDA, HostAccessible without.
func (r *PinnedMemoryResource) Access() Access { return r.access }

// pinnedLiveCount returns the number of live pinned allocations (for tests).
func pinnedLiveCount() int { return pinnedTable.count() }

// PageableMemoryResource is host memory from the C heap (posix_memalign; anonymous mappings when
// built without cgo), neither pinned nor registered with the driver: librmm's
// new_delete_resource, a [HostMemoryResource] for host memory that is not copied to or from the
// device asynchronously (copies from pageable memory are staged by the driver and return only
// once the source has been read). It takes any power-of-two alignment (an alignment above 256
// bytes costs an allocation of nbytes + alignment bytes, of which the first aligned address is
// returned); a pointer
// never handed out by a PageableMemoryResource, a double free, or another size or alignment
// returns [ErrInvalidFree] and frees nothing. All PageableMemoryResources share one table: memory
// from one may be freed by another. Safe for concurrent use.
type PageableMemoryResource struct{}

var pageableTable = hostTable{name: "PageableMemoryResource", live: map[uintptr]hostBlock{}}

// NewPageableMemoryResource returns a pageable host memory resource.
func NewPageableMemoryResource() *PageableMemoryResource { return &PageableMemoryResource{} }

// AllocateHost returns nbytes of pageable host memory aligned to alignment bytes (a power of
// two); (nil, nil) for 0 bytes. A negative size or an alignment that is not a power of two wraps
// [ErrInvalidArgument]; memory the C heap refuses wraps [ErrOutOfMemory].
func (r *PageableMemoryResource) AllocateHost(nbytes, alignment int) (unsafe.Pointer, error) {
	if err := hostAllocateChecked("PageableMemoryResource", nbytes, alignment); err != nil || nbytes == 0 {
		return nil, err
	}
	p, err := pageableTable.allocate(nbytes, alignment, func(total int) (uintptr, error) {
		base, ok := hostMalloc(total)
		if !ok {
			return 0, outOfMemory("PageableMemoryResource", nbytes, nil)
		}
		return base, nil
	})
	return addrToPointer(p), err
}

// DeallocateHost frees p, which AllocateHost(nbytes, alignment) returned; nil is a no-op.
// Anything else returns [ErrInvalidFree] and frees nothing.
func (r *PageableMemoryResource) DeallocateHost(p unsafe.Pointer, nbytes, alignment int) error {
	if p == nil {
		return nil
	}
	return pageableTable.deallocate("DeallocateHost", uintptr(p), nbytes, alignment, func(base uintptr) error {
		hostFree(base)
		return nil
	})
}

// waitStreamBeforeFree waits for the work queued on s (on dev when s is the default stream)
// before host memory it may use is freed. A Stream that was closed cannot be waited for by
// handle: the device is synchronised instead.
func waitStreamBeforeFree(dev Device, s StreamView) error {
	d := s.deviceFor(dev)
	if s.closed() {
		return d.Synchronize()
	}
	return syncStream(d, s)
}
