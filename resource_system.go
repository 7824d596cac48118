package rmm

import (
	"fmt"
	"sync"
)

// SystemMemoryResource allocates host memory from the C heap (posix_memalign with 256-byte
// alignment; the Go heap when built without cgo). The stream is ignored. On a GPU with
// pageable-memory access (HMM or ATS systems) the memory is also device-accessible; otherwise
// only the host can touch it. It is the initial resource when there is no CUDA device, so that
// programs and tests run anywhere, on host memory.
//
// Every SystemMemoryResource shares one record of the pointers it handed out, so that a pointer it
// never gave out, a double free or a wrong size returns [ErrInvalidFree] instead of corrupting the C
// heap.
type SystemMemoryResource struct {
	access Access
}

var (
	systemMu   sync.Mutex
	systemLive = map[DevicePtr]int{}
)

var (
	systemAccessOnce sync.Once
	systemAccess     Access
)

// NewSystemMemoryResource returns a host-memory resource.
func NewSystemMemoryResource() *SystemMemoryResource {
	systemAccessOnce.Do(func() {
		systemAccess = HostAccessible
		if CUDAAvailable() == nil {
			if v, err := CurrentDevice().Attribute(attrPageableMemoryAccess); err == nil && v == 1 {
				systemAccess |= DeviceAccessible
			}
		}
	})
	return &SystemMemoryResource{access: systemAccess}
}

// Allocate returns nbytes of host memory aligned to 256 bytes. Memory exhaustion wraps
// [ErrOutOfMemory].
func (r *SystemMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes <= 0 {
		if nbytes < 0 {
			return 0, invalidSize("SystemMemoryResource", "Allocate", nbytes)
		}
		return 0, nil
	}
	p, ok := hostMalloc(nbytes)
	if !ok {
		return 0, outOfMemory("SystemMemoryResource", nbytes, nil)
	}
	systemMu.Lock()
	systemLive[DevicePtr(p)] = nbytes
	systemMu.Unlock()
	return DevicePtr(p), nil
}

// Deallocate frees p. A pointer not allocated by a [SystemMemoryResource], a double free or a size
// other than the one allocated returns [ErrInvalidFree] and frees nothing.
func (r *SystemMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if p == 0 {
		return nil
	}
	systemMu.Lock()
	size, ok := systemLive[p]
	if ok && size == nbytes {
		delete(systemLive, p)
	}
	systemMu.Unlock()
	switch {
	case !ok:
		return errorf("SystemMemoryResource.Deallocate(%#x, %d): the pointer was not allocated here or was already freed: %w", uintptr(p), nbytes, ErrInvalidFree)
	case size != nbytes:
		return errorf("SystemMemoryResource.Deallocate(%#x, %d): the block was allocated with %s: %w", uintptr(p), nbytes, bytesText(size), ErrInvalidFree)
	}
	hostFree(uintptr(p))
	return nil
}

// Access reports [HostAccessible], plus [DeviceAccessible] where the GPU can read pageable memory.
func (r *SystemMemoryResource) Access() Access { return r.access }

// SimulatedMemoryResource hands out addresses without memory behind them, from a range of the
// given capacity that no real allocation uses: for replaying a trace of a large GPU on any
// machine (rmm-replay -simulate, as librmm's replay benchmark's -s), and for testing
// sub-allocators with huge sizes. Addresses are never reused (a bump pointer); the capacity
// limits the bytes live at once. Nothing may read or write the memory: Access reports 0, so
// containers refuse it.
type SimulatedMemoryResource struct {
	mu       sync.Mutex
	capacity int
	used     int
	next     uintptr
	live     map[DevicePtr]int
}

// simulatedBase is where simulated addresses start: above the 47-bit user address space of
// x86-64 and arm64 Linux, so they never alias real memory.
const simulatedBase = uintptr(1) << 52

// NewSimulatedMemoryResource returns an address-only resource that allows capacity bytes live at
// once. A negative capacity returns an error wrapping [ErrInvalidArgument].
func NewSimulatedMemoryResource(capacity int) (*SimulatedMemoryResource, error) {
	if capacity < 0 {
		return nil, errorf("NewSimulatedMemoryResource: negative capacity %d: %w", capacity, ErrInvalidArgument)
	}
	return &SimulatedMemoryResource{capacity: capacity, next: simulatedBase, live: map[DevicePtr]int{}}, nil
}

// Allocate returns the next 256-aligned address range of nbytes, or [ErrOutOfMemory] when the
// live bytes would exceed the capacity.
func (r *SimulatedMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes <= 0 {
		if nbytes < 0 {
			return 0, invalidSize("SimulatedMemoryResource", "Allocate", nbytes)
		}
		return 0, nil
	}
	n, ok := alignSize(nbytes)
	r.mu.Lock()
	defer r.mu.Unlock()
	if !ok || n > r.capacity-r.used {
		return 0, outOfMemory(fmt.Sprintf("SimulatedMemoryResource (capacity %d, in use %d)", r.capacity, r.used), nbytes, nil)
	}
	if r.next+uintptr(n) < r.next {
		return 0, outOfMemory("SimulatedMemoryResource (its address range is used up)", nbytes, nil)
	}
	p := DevicePtr(r.next)
	r.next += uintptr(n)
	r.used += n
	r.live[p] = nbytes
	return p, nil
}

// Deallocate takes p back. A pointer it never gave out, a double free or a wrong size returns
// [ErrInvalidFree].
func (r *SimulatedMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if p == 0 {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	size, ok := r.live[p]
	if !ok {
		return errorf("SimulatedMemoryResource.Deallocate: %#x was not allocated here or was already freed: %w", uintptr(p), ErrInvalidFree)
	}
	if size != nbytes {
		return errorf("SimulatedMemoryResource.Deallocate: %#x was allocated with %s, freed with %d: %w", uintptr(p), bytesText(size), nbytes, ErrInvalidFree)
	}
	delete(r.live, p)
	n, _ := alignSize(size)
	r.used -= n
	return nil
}

// Access reports 0: the addresses have no memory behind them.
func (r *SimulatedMemoryResource) Access() Access { return 0 }

// Capacity returns the capacity in bytes.
func (r *SimulatedMemoryResource) Capacity() int { return r.capacity }

// UsedBytes returns the bytes (rounded to 256) live now.
func (r *SimulatedMemoryResource) UsedBytes() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.used
}

// Contains reports whether [p, p+n) lies inside one live allocation.
func (r *SimulatedMemoryResource) Contains(p DevicePtr, n int) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for base, size := range r.live {
		if p >= base && uintptr(p)+uintptr(n) <= uintptr(base)+uintptr(size) {
			return true
		}
	}
	return false
}
