package rmm

import (
	"runtime"
)

// CPU names host memory as where [Prefetch] moves memory to (CUDA's cudaCpuDeviceId).
const CPU Device = -1

// cuMemLocationTypeHost is CU_MEM_LOCATION_TYPE_HOST.
const cuMemLocationTypeHost = 2

// prefetchCall is cuMemPrefetchAsync_v2, replaced in tests to count the calls.
var prefetchCall = cuMemPrefetchAsync

// Prefetch moves the n bytes at p to device to, or to host memory when to is CPU, ordered on
// stream s (cuMemPrefetchAsync_v2; the host does not wait), when they are managed memory:
// pages then need not fault in where they are next used. Memory that is not managed is left
// where it is and no prefetch is tried: the driver is asked first (cuPointerGetAttributes,
// CU_POINTER_ATTRIBUTE_IS_MANAGED, which answers for any address), as it is not by the
// containers' Prefetch, which know their resource. Nothing is done either without CUDA, when the
// destination device (for CPU, s's device) cannot prefetch (its concurrent-managed-access
// attribute is 0), or when the driver lacks cuMemPrefetchAsync_v2 (before CUDA 12.2).
//
// Errors: a negative n or a device that does not exist wraps [ErrInvalidArgument], a view of a
// closed [Stream] [ErrClosed] (whatever the memory, so that the answer does not depend on the
// machine), and a failed driver call is a [*CUDAError].
func Prefetch(p DevicePtr, n int, to Device, s StreamView) error {
	return prefetchRange("Prefetch", nil, p, n, to, s)
}

// prefetchRange is Prefetch for memory from mr (nil: not known): what prefetchModeOf says of mr
// decides without a driver call where it can.
func prefetchRange(op string, mr MemoryResource, p DevicePtr, n int, to Device, s StreamView) error {
	if n < 0 {
		return invalidSize("rmm", op, n)
	}
	if to != CPU {
		if err := to.check(); err != nil {
			return errorf("%s: %w", op, err)
		}
	}
	if s.closed() {
		return errStreamClosed(op, s)
	}
	if p == 0 || n == 0 || CUDAAvailable() != nil || !cuMemPrefetchBound() {
		return nil
	}
	if mr != nil && prefetchModeOf(mr, true) == prefetchNever {
		return nil // never prefetchable, whatever the device (no attribute read either)
	}
	d := to
	if to == CPU {
		d = s.deviceFor(CurrentDevice())
	}
	cma, err := d.Attribute(attrConcurrentManagedAccess)
	if err != nil || cma == 0 {
		return err
	}
	mode := prefetchIfManaged
	if mr != nil {
		pageable, err := d.Attribute(attrPageableMemoryAccess)
		if err != nil {
			return err
		}
		if mode = prefetchModeOf(mr, pageable != 0); mode == prefetchNever {
			return nil
		}
	}
	ctx, err := d.ctx()
	if err != nil {
		return err
	}
	if mode == prefetchIfManaged {
		managed, err := cuPointerIsManaged(ctx, p)
		if err != nil {
			return errorf("%s: asking whether %#x is managed memory: %w", op, uintptr(p), err)
		}
		if !managed {
			return nil
		}
	}
	locType, locID := cuMemLocationTypeDevice, int(to)
	if to == CPU {
		locType, locID = cuMemLocationTypeHost, 0
	}
	if err := prefetchCall(ctx, p, n, locType, locID, s.cu()); err != nil {
		return errorf("%s: %s at %#x to %v on %v: %w", op, bytesText(n), uintptr(p), to, s, err)
	}
	return nil
}

// Prefetch moves the buffer's bytes to device to (CPU: host memory) on stream s
// (cuMemPrefetchAsync_v2, ordered on s) when they are memory that can be prefetched, which the
// buffer's resource tells without a driver call (as for [PrefetchResourceAdaptor]): managed memory,
// and host memory from [SystemMemoryResource] on a device that can access pageable memory; for any
// other memory it is a no-op with no driver call (a resource the package does not know is asked
// about as the package function Prefetch asks). A closed buffer returns [ErrClosed]; other errors
// as Prefetch.
func (b *DeviceBuffer) Prefetch(to Device, s StreamView) error {
	defer runtime.KeepAlive(b)
	if b.st.closed {
		return b.st.errClosed("Prefetch")
	}
	return prefetchRange("DeviceBuffer.Prefetch", b.st.mr, b.st.ptr, b.st.size, to, s)
}

// Prefetch moves the vector's elements to device to (CPU: host memory) on stream s, as
// [DeviceBuffer.Prefetch].
func (v *Uvector[T]) Prefetch(to Device, s StreamView) error {
	defer runtime.KeepAlive(v)
	if v.st.closed {
		return v.st.errClosed("Prefetch")
	}
	return prefetchRange(v.st.kind+".Prefetch", v.st.mr, v.st.ptr, v.st.size, to, s)
}

// Prefetch moves the span's elements to device to (CPU: host memory) on stream s when they are
// managed memory, as the package function Prefetch (a span does not know its resource: the
// driver is asked).
func (sp DeviceSpan[T]) Prefetch(to Device, s StreamView) error {
	return prefetchRange("DeviceSpan.Prefetch", nil, sp.ptr, sp.n*sizeOf[T](), to, s)
}
