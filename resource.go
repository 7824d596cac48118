package rmm

import (
	"errors"
	"fmt"
	"math/bits"
)

// DevicePtr is an address of memory handed out by a [MemoryResource]: device memory, managed
// memory, or host memory for host resources. The zero value is the null pointer.
type DevicePtr uintptr

// Alignment is the alignment, in bytes, of every pointer a [MemoryResource] returns (CUDA's
// allocation alignment, as librmm's CUDA_ALLOCATION_ALIGNMENT).
const Alignment = 256

// MemoryResource is the contract every device memory resource keeps.
//
//   - Allocate returns a pointer to at least nbytes bytes, aligned to [Alignment] (256 bytes), that
//     may be used by work ordered on stream s (other streams need an ordering edge first, e.g. an
//     [Event]). Allocate(0, s) returns (0, nil) and takes no memory; a resource may count it as
//     an allocation of 0 bytes ([StatisticsResourceAdaptor] does). A negative size returns
//     [ErrInvalidArgument]. When the memory cannot be had the error wraps [ErrOutOfMemory], names the
//     resource and the size asked, and the resource stays fully usable.
//   - Deallocate returns p, which Allocate(nbytes, ·) gave, so that it may be reused by work
//     ordered after everything queued on s at the time of the call. nbytes must be the size given to
//     Allocate. Deallocate(0, 0, s) frees a zero-byte allocation: a resource must accept it
//     (return nil) and may count it, so a caller makes it once for each Allocate(0, ·), as for
//     any other allocation. The sub-allocators ([PoolMemoryResource],
//     [ArenaMemoryResource], [FixedSizeMemoryResource], [BinningMemoryResource]), [SystemMemoryResource]
//     and [SimulatedMemoryResource] detect a pointer they never gave out, a double free and a wrong size,
//     and return [ErrInvalidFree] without changing their state; the driver resources pass the
//     pointer to CUDA, which reports what it detects as a [*CUDAError].
//   - A free on another stream than the one the memory was allocated on (or last used on) must be
//     ordered after that stream by the caller: record an Event on the allocating stream after the
//     last use (an allocation made on it counts as a use), make the freeing stream wait for it
//     ([StreamView.WaitEvent]), then Deallocate. No resource of this package does it for the caller
//     (a resource would have to document that it does): the driver's stream-ordered allocator
//     ([CudaAsyncMemoryResource], cuMemFreeAsync) orders nothing, and a free it is given unordered
//     races with the allocation; the sub-allocators order a block's reuse after the freeing
//     stream only, not after the allocating one, whose allocation may itself have been made to
//     wait for an earlier free.
//   - A view of a [Stream] that was closed is never handed to the driver: a resource that orders
//     its work on streams returns an error wrapping [ErrClosed] from Allocate on it, and treats
//     Deallocate on it as a free on [DefaultStream] after waiting for the device
//     (cuCtxSynchronize); resources that ignore the stream (SystemMemoryResource,
//     [CudaMemoryResource], [ManagedMemoryResource], [PinnedMemoryResource]) accept it as any other.
//     Adaptors hand the view on as it is, except [PrefetchResourceAdaptor], which would prefetch on
//     it and so refuses a non-zero Allocate with ErrClosed. [StreamView.Closed] tells such a view
//     without a driver call.
//   - Both are safe for concurrent use by many goroutines.
//
// Optional behaviour is discovered by type assertion, as io.WriterTo is: [Releaser] (give unused
// memory back), [Upstreamer] (adaptors and sub-allocators), [Accessible] (where the memory can be
// touched), [DeviceResource] (the device the resource belongs to).
//
// A resource that wraps another should implement Upstream (or Access): [AccessOf] takes the
// memory of a resource that reports neither as device memory, so the containers ([Uvector],
// [Scalar], [DeviceBuffer]) copy to and from it with CUDA — which, over host memory on a machine
// without a GPU, fails with [ErrNoDevice] — and the conformance suite (rmmtest) does not check
// what is written into it.
//
// A resource written in another package is held to this contract by the conformance suite of
// package github.com/gormm/rmm/rmmtest (rmmtest.Run in a test, rmmtest.Check elsewhere); the
// Event example shows a caller ordering a free on another stream.
type MemoryResource interface {
	Allocate(nbytes int, s StreamView) (DevicePtr, error)
	Deallocate(p DevicePtr, nbytes int, s StreamView) error
}

// Releaser is implemented by resources that can give memory they hold but do not use back to
// their upstream ([PoolMemoryResource.Release]).
type Releaser interface {
	Release() error
}

// Upstreamer is implemented by adaptors and sub-allocators: the resource they take memory from.
type Upstreamer interface {
	Upstream() MemoryResource
}

// insideUpstream is implemented by this package's resources whose every allocation lies inside
// memory their upstream handed out (the adaptors, the arena, the fixed-size resource): a
// PrefetchResourceAdaptor asks their upstream what kind of memory they hand out. Another
// package's Upstreamer is not trusted to do the same: the prefetcher asks about each allocation.
// A new adaptor of this package that sub-allocates from its upstream or passes its pointers on
// implements it (a method with an empty body).
type insideUpstream interface {
	Upstreamer
	insideUpstream()
}

// passThrough is implemented by this package's adaptors that hand out their upstream's pointers
// unchanged, each allocation being exactly one of the upstream's: ExportIPC exports through
// them. A new adaptor that passes allocations through implements it (and insideUpstream).
type passThrough interface {
	insideUpstream
	passesPointersThrough()
}

// Access says where memory from a resource can be read and written: a set of the flags
// [DeviceAccessible] (kernels and device copies can use it) and [HostAccessible] (the CPU can
// read and write it through a plain pointer). Managed and pinned memory have both; 0 is memory
// that can be touched nowhere (the addresses of a [SimulatedMemoryResource]). [AccessOf] reports
// a resource's.
type Access uint8

// Each flag is a declaration of its own, not one of a block, so that go doc lists both with the
// type.

// DeviceAccessible memory can be used by kernels and device copies.
const DeviceAccessible Access = 1

// HostAccessible memory can be read and written by the CPU through a plain pointer.
const HostAccessible Access = 2

func (a Access) String() string {
	switch a {
	case 0:
		return "inaccessible"
	case DeviceAccessible:
		return "device"
	case HostAccessible:
		return "host"
	default:
		return "host+device"
	}
}

// Accessible is implemented by resources that know where their memory can be touched.
type Accessible interface {
	Access() Access
}

// DeviceResource is implemented by resources tied to one CUDA device.
type DeviceResource interface {
	Device() Device
}

// AccessOf reports where memory from mr can be touched: mr's own answer when it implements
// [Accessible], else its upstream's, else [DeviceAccessible] (a resource we know nothing of is assumed
// to hand out device memory).
func AccessOf(mr MemoryResource) Access {
	a, _ := accessOf(mr)
	return a
}

// accessOf is AccessOf, and the resource where the walk stopped without an answer (nil when one
// answered): the one whose memory is taken as device memory for want of an Access method.
func accessOf(mr MemoryResource) (Access, MemoryResource) {
	for mr != nil {
		if a, ok := mr.(Accessible); ok {
			return a.Access(), nil
		}
		u, ok := mr.(Upstreamer)
		if !ok {
			break
		}
		mr = u.Upstream()
	}
	return DeviceAccessible, mr
}

// DeviceOf returns the device mr belongs to: its own answer when it implements [DeviceResource],
// else its upstream's, else the current device.
func DeviceOf(mr MemoryResource) Device {
	for mr != nil {
		if d, ok := mr.(DeviceResource); ok {
			return d.Device()
		}
		u, ok := mr.(Upstreamer)
		if !ok {
			break
		}
		mr = u.Upstream()
	}
	return CurrentDevice()
}

// resourceName is the name used in error messages: the type's name without the package.
func resourceName(mr any) string {
	s := fmt.Sprintf("%T", mr)
	for i := len(s) - 1; i >= 0; i-- {
		if s[i] == '.' {
			s = s[i+1:]
			break
		}
	}
	if len(s) > 0 && s[0] == '*' {
		s = s[1:]
	}
	return s
}

// AlignUp rounds n up to a multiple of align, which must be a power of two (1, 2, 4, ...). It
// returns 0, false when align is not a power of two (0, a negative number, 3, 768) or when the
// result would overflow int.
func AlignUp(n, align int) (int, bool) {
	if !IsPowerOfTwo(align) {
		return 0, false
	}
	r := (n + align - 1) &^ (align - 1)
	if r < n {
		return 0, false
	}
	return r, true
}

// AlignDown rounds n down to a multiple of align, which must be a power of two (1, 2, 4, ...);
// it cannot overflow. It has no failure result, so an align that is not a power of two (0, a
// negative number, 3, 768) is a programmer error and panics, as an integer division by zero
// does; check a computed alignment with [IsPowerOfTwo] first.
func AlignDown(n, align int) int {
	if !IsPowerOfTwo(align) {
		panic(fmt.Sprintf("rmm.AlignDown: alignment %d is not a power of two", align))
	}
	return n &^ (align - 1)
}

// IsPowerOfTwo reports whether n is a power of two.
func IsPowerOfTwo(n int) bool { return n > 0 && bits.OnesCount(uint(n)) == 1 }

// alignSize rounds a non-negative request to Alignment; ok is false on overflow.
func alignSize(n int) (int, bool) { return AlignUp(n, Alignment) }

// errIs is errors.Is (kept short for the resource files).
func errIs(err, target error) bool { return errors.Is(err, target) }
