package rmm

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// TrackingOptions configures a [TrackingResourceAdaptor]. nil means the defaults.
type TrackingOptions struct {
	// CaptureStacks records the allocating goroutine's call stack (up to 64 frames, starting at
	// the caller of Allocate) with every allocation. The program counters are taken with
	// runtime.Callers (one small heap allocation per allocation); they are resolved to
	// functions, files and lines only when printed. Default false.
	CaptureStacks bool
}

// maxTrackedFrames is the deepest stack a TrackingResourceAdaptor records.
const maxTrackedFrames = 64

// TrackedAllocation is one outstanding allocation of a [TrackingResourceAdaptor].
type TrackedAllocation struct {
	Ptr  DevicePtr
	Size int // bytes, as asked
	// Stack holds the program counters of the allocating call stack, innermost first (the
	// caller of Allocate), as runtime.Callers gives them; nil unless CaptureStacks was set.
	Stack []uintptr
}

// Frames resolves the allocation's stack to functions, files and lines (runtime.CallersFrames),
// leaving out the innermost frames that are inside this package (adaptors, containers), so that
// the first frame is the program's own call — NewUvector's caller rather than [NewUvector]; nil when
// no stack was captured.
func (a TrackedAllocation) Frames() []runtime.Frame {
	if len(a.Stack) == 0 {
		return nil
	}
	var out []runtime.Frame
	frames := runtime.CallersFrames(a.Stack)
	inside := true
	for {
		f, more := frames.Next()
		if inside && isPackageFrame(f.Function) && more {
			continue // keep at least the outermost frame
		}
		inside = false
		out = append(out, f)
		if !more {
			return out
		}
	}
}

// isPackageFrame reports whether function (as runtime.Frame names it) belongs to this package,
// not to its tests or other packages.
func isPackageFrame(function string) bool {
	const pkg = "github.com/gormm/rmm."
	if !strings.HasPrefix(function, pkg) {
		return false
	}
	rest := function[len(pkg):]
	// Test functions of the package keep their frames: they are the program here.
	return !strings.HasPrefix(rest, "Test") && !strings.Contains(rest, ".Test") && !strings.HasPrefix(rest, "Example")
}

// trackedInfo is what the adaptor keeps per pointer.
type trackedInfo struct {
	size  int
	stack []uintptr
}

// TrackingResourceAdaptor forwards every call to its upstream and keeps a record of every
// allocation not yet freed — pointer, size and, with CaptureStacks, the allocating call stack —
// as librmm's tracking_resource_adaptor, to find leaks (OutstandingAllocationsString,
// LogOutstandingAllocations).
//
//   - Allocate calls the upstream first and then records the pointer with its size. Zero-byte
//     allocations are not recorded. A pointer that is recorded already means the memory was freed
//     behind the adaptor's back (through its upstream directly): the new memory is given back to
//     the upstream and the error wraps [ErrInvalidFree].
//   - Deallocate looks the pointer up and drops its record before it calls the upstream, so that
//     an address the upstream hands out again at once is never seen twice. A pointer the adaptor
//     has no record of is reported at level Error to [DebugLogger] ("Deallocating a pointer that was
//     not tracked. ...") and AllocatedBytes does not change, but the free is still passed to the
//     upstream, which may have handed the memory out itself (librmm does the same). A size other
//     than the one allocated is reported at level Error ("Alloc bytes (a) and Dealloc bytes (b) do
//     not match") and the recorded size is used, for AllocatedBytes and for the upstream's free.
//     When the upstream returns an error, which is returned, the record is put back. Only
//     Deallocate(0, 0, s), the free of a zero-byte allocation, skips the records (librmm skips
//     every zero-size free; a live pointer freed with size 0 is a wrong size and is corrected).
//
// Safe for concurrent use: the records and the byte count are kept under one mutex, never held
// across a call to the upstream. Without CaptureStacks nothing is allocated per call (beyond the
// growth of the record map).
type TrackingResourceAdaptor struct {
	upstream      MemoryResource
	captureStacks bool

	mu          sync.Mutex
	allocations map[DevicePtr]trackedInfo
	allocated   int
}

// NewTrackingResourceAdaptor returns an adaptor that records the allocations made through it from
// upstream; nil opts means the defaults. A nil upstream means the current device resource
// ([CurrentDeviceResource], read once, here); a nil pointer as upstream returns an error wrapping
// [ErrInvalidArgument].
func NewTrackingResourceAdaptor(upstream MemoryResource, opts *TrackingOptions) (*TrackingResourceAdaptor, error) {
	up, err := upstreamOf("NewTrackingResourceAdaptor", upstream)
	if err != nil {
		return nil, err
	}
	r := &TrackingResourceAdaptor{upstream: up, allocations: map[DevicePtr]trackedInfo{}}
	if opts != nil {
		r.captureStacks = opts.CaptureStacks
	}
	return r, nil
}

// Allocate allocates nbytes from the upstream on stream s and records the allocation (see the
// type's comment). A negative size returns an error wrapping [ErrInvalidArgument] without calling the
// upstream; the upstream's errors are returned unchanged.
func (r *TrackingResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("TrackingResourceAdaptor", "Allocate", nbytes)
	}
	p, err := r.upstream.Allocate(nbytes, s)
	if err != nil || nbytes == 0 {
		return p, err
	}
	info := trackedInfo{size: nbytes}
	if r.captureStacks {
		var pcs [maxTrackedFrames]uintptr
		n := runtime.Callers(2, pcs[:])
		info.stack = slices.Clone(pcs[:n])
	}
	r.mu.Lock()
	old, dup := r.allocations[p]
	if !dup {
		r.allocations[p] = info
		r.allocated += nbytes
	}
	r.mu.Unlock()
	if dup {
		ferr := r.upstream.Deallocate(p, nbytes, s)
		err := errorf("TrackingResourceAdaptor.Allocate(%d): the upstream returned %#x, which is already tracked (an allocation of %s that was freed without going through this adaptor): %w", nbytes, uintptr(p), bytesText(old.size), ErrInvalidFree)
		if ferr != nil {
			err = errorf("%w; giving the new memory back failed: %w", err, ferr)
		}
		return 0, err
	}
	return p, nil
}

// Deallocate drops the record of p and returns p to the upstream on stream s (see the type's
// comment for untracked pointers and wrong sizes). A negative size returns an error wrapping
// [ErrInvalidArgument] and changes nothing.
func (r *TrackingResourceAdaptor) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if nbytes < 0 {
		return invalidSize("TrackingResourceAdaptor", "Deallocate", nbytes)
	}
	if nbytes == 0 && p == 0 {
		return r.upstream.Deallocate(p, nbytes, s)
	}
	r.mu.Lock()
	info, found := r.allocations[p]
	if found {
		delete(r.allocations, p)
		r.allocated -= info.size
	}
	outstanding := len(r.allocations)
	r.mu.Unlock()

	if !found {
		DebugLogger().Error(fmt.Sprintf("rmm: TrackingResourceAdaptor: Deallocating a pointer that was not tracked. Ptr: %#x [%d B], Current Num. Allocations: %d", uintptr(p), nbytes, outstanding))
		return r.upstream.Deallocate(p, nbytes, s)
	}
	if info.size != nbytes {
		DebugLogger().Error(fmt.Sprintf("rmm: TrackingResourceAdaptor: Alloc bytes (%d) and Dealloc bytes (%d) do not match", info.size, nbytes))
	}
	if err := r.upstream.Deallocate(p, info.size, s); err != nil {
		r.mu.Lock()
		r.allocations[p] = info
		r.allocated += info.size
		r.mu.Unlock()
		return err
	}
	return nil
}

// AllocatedBytes returns the bytes of the allocations not yet freed.
func (r *TrackingResourceAdaptor) AllocatedBytes() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.allocated
}

// OutstandingAllocations returns the allocations not yet freed, in ascending pointer order. The
// slice is a copy the caller owns.
func (r *TrackingResourceAdaptor) OutstandingAllocations() []TrackedAllocation {
	r.mu.Lock()
	out := make([]TrackedAllocation, 0, len(r.allocations))
	for p, info := range r.allocations {
		out = append(out, TrackedAllocation{Ptr: p, Size: info.size, Stack: info.stack})
	}
	r.mu.Unlock()
	slices.SortFunc(out, func(a, b TrackedAllocation) int {
		switch {
		case a.Ptr < b.Ptr:
			return -1
		case a.Ptr > b.Ptr:
			return 1
		}
		return 0
	})
	return out
}

// OutstandingAllocationsString describes the allocations not yet freed, one line each in
// ascending pointer order: "0x<pointer in hex>: <size> B". With CaptureStacks the line ends in
// " : callstack:" and is followed by one line per frame, "#<i> in <function> at <file>:<line>",
// innermost first. Empty when nothing is outstanding.
func (r *TrackingResourceAdaptor) OutstandingAllocationsString() string {
	var b strings.Builder
	for _, a := range r.OutstandingAllocations() {
		b.WriteString("0x")
		b.WriteString(strconv.FormatUint(uint64(a.Ptr), 16))
		b.WriteString(": ")
		b.WriteString(strconv.Itoa(a.Size))
		b.WriteString(" B")
		if len(a.Stack) > 0 {
			b.WriteString(" : callstack:\n")
			for i, f := range a.Frames() {
				fmt.Fprintf(&b, "#%d in %s at %s:%d\n", i, f.Function, f.File, f.Line)
			}
			continue
		}
		b.WriteByte('\n')
	}
	return b.String()
}

// LogOutstandingAllocations writes OutstandingAllocationsString to [DebugLogger] at level Debug,
// as "Outstanding Allocations: ..." (nothing is computed when the level is not enabled).
func (r *TrackingResourceAdaptor) LogOutstandingAllocations() {
	l := DebugLogger()
	if !l.Enabled(context.Background(), slog.LevelDebug) {
		return
	}
	l.Debug("rmm: TrackingResourceAdaptor: Outstanding Allocations: " + r.OutstandingAllocationsString())
}

// Upstream returns the resource the adaptor forwards to.
func (r *TrackingResourceAdaptor) Upstream() MemoryResource { return r.upstream }

func (*TrackingResourceAdaptor) insideUpstream() {}

func (*TrackingResourceAdaptor) passesPointersThrough() {}

// Access reports the upstream's accessibility ([AccessOf](Upstream())).
func (r *TrackingResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the upstream's device ([DeviceOf](Upstream())).
func (r *TrackingResourceAdaptor) Device() Device { return DeviceOf(r.upstream) }
