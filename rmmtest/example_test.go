package rmmtest_test

import (
	"fmt"
	"sync"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/rmmtest"
)

// BumpResource is a resource written outside package rmm: it takes one block of Size bytes from
// its upstream on the first allocation and hands out consecutive 256-byte aligned pieces of it
// (a bump pointer), never reusing a piece; the block goes back to the upstream when the last
// allocation is freed. It detects invalid frees with a map of what is live.
type BumpResource struct {
	upstream rmm.MemoryResource
	size     int

	mu   sync.Mutex
	base rmm.DevicePtr // the block held from the upstream, 0 when none
	next int           // offset of the next piece
	live map[rmm.DevicePtr]int
}

// NewBumpResource returns a bump allocator of size bytes (a multiple of 256) over upstream.
func NewBumpResource(upstream rmm.MemoryResource, size int) *BumpResource {
	return &BumpResource{upstream: upstream, size: size, live: map[rmm.DevicePtr]int{}}
}

// Allocate returns nbytes (rounded up to 256) from the block, on stream s.
func (r *BumpResource) Allocate(nbytes int, s rmm.StreamView) (rmm.DevicePtr, error) {
	switch {
	case nbytes < 0:
		return 0, fmt.Errorf("%w: BumpResource.Allocate: negative size %d", rmm.ErrInvalidArgument, nbytes)
	case nbytes == 0:
		return 0, nil
	}
	n, ok := rmm.AlignUp(nbytes, rmm.Alignment)
	r.mu.Lock()
	defer r.mu.Unlock()
	if !ok || n > r.size-r.next {
		return 0, fmt.Errorf("%w: BumpResource failed to allocate %d bytes (%d of %d left)", rmm.ErrOutOfMemory, nbytes, r.size-r.next, r.size)
	}
	if r.base == 0 {
		p, err := r.upstream.Allocate(r.size, s)
		if err != nil {
			return 0, fmt.Errorf("BumpResource: taking %d bytes from the upstream for %d bytes: %w", r.size, nbytes, err)
		}
		r.base, r.next = p, 0
	}
	p := r.base + rmm.DevicePtr(r.next)
	r.next += n
	r.live[p] = nbytes
	return p, nil
}

// Deallocate frees p; the block goes back to the upstream, ordered on s, when nothing is live.
// That free is ordered after s only: pieces used and freed on other streams may still have work
// queued there. Over an upstream that ignores streams (the default: CudaMemoryResource or
// SystemMemoryResource) that does not matter; over a stream-ordered one (a pool, the driver's
// async allocator) the resource is the caller of rmm.MemoryResource's contract and must first
// make s wait for those streams (an rmm.Event recorded on each at its free, StreamView.WaitEvent).
func (r *BumpResource) Deallocate(p rmm.DevicePtr, nbytes int, s rmm.StreamView) error {
	if p == 0 {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if size, ok := r.live[p]; !ok || size != nbytes {
		return fmt.Errorf("%w: BumpResource.Deallocate(%#x, %d)", rmm.ErrInvalidFree, uintptr(p), nbytes)
	}
	delete(r.live, p)
	if len(r.live) == 0 {
		if err := r.upstream.Deallocate(r.base, r.size, s); err != nil {
			return err
		}
		r.base, r.next = 0, 0
	}
	return nil
}

// Upstream returns the resource the block comes from.
func (r *BumpResource) Upstream() rmm.MemoryResource { return r.upstream }

// Access reports the upstream's access.
func (r *BumpResource) Access() rmm.Access { return rmm.AccessOf(r.upstream) }

// A resource written outside package rmm held to the conformance suite. In a test it is
//
//	func TestBumpResource(t *testing.T) {
//		rmmtest.Run(t, func(t *testing.T, upstream rmm.MemoryResource) rmm.MemoryResource {
//			return NewBumpResource(upstream, 256<<20)
//		}, &rmmtest.Options{DetectsInvalidFree: true, IgnoresStreams: true, MaxAllocationSize: 256 << 10, Capacity: 256 << 20, MayRunOutOfMemory: true})
//	}
//
// Check runs the same checks without a testing.T. The bump allocator never reuses memory while
// anything is live, so it declares a capacity and MayRunOutOfMemory: it can run out with far less
// than its capacity live (without MayRunOutOfMemory a smaller Size, such as 4 MiB, fails the
// checklist's MixedAllocFree). It does not look at streams (it hands out memory on a closed Stream
// too), so it declares IgnoresStreams.
func ExampleCheck() {
	err := rmmtest.Check(func(upstream rmm.MemoryResource) (rmm.MemoryResource, error) {
		return NewBumpResource(upstream, 256<<20), nil
	}, &rmmtest.Options{DetectsInvalidFree: true, IgnoresStreams: true, MaxAllocationSize: 256 << 10, Capacity: 256 << 20, MayRunOutOfMemory: true})
	if err != nil {
		fmt.Println(err)
	}
	fmt.Println("conforms:", err == nil)
	// Output: conforms: true
}
