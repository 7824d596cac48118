package rmm

import (
	"errors"
	"fmt"
	"sync"
)

// errAlignedOverflow is the cause of an aligned allocation whose enlarged size overflows.
var errAlignedOverflow = errors.New("the size enlarged for alignment overflows")

// AlignedOptions configures an [AlignedResourceAdaptor]. nil means the defaults.
type AlignedOptions struct {
	// Alignment is the alignment, in bytes, of the pointers handed out. It must be a power of
	// two; values below 256 give 256-aligned pointers (which are aligned to them too). Default 0
	// means 256: every allocation passes straight through.
	Alignment int
	// Threshold is the smallest size, in bytes, that is aligned to more than 256: smaller
	// allocations pass straight through. Default 0: every non-empty allocation is aligned.
	Threshold int
}

// AlignedResourceAdaptor hands out pointers aligned to more than the 256 bytes every resource
// gives, as librmm's aligned_resource_adaptor. Let A = max(Alignment, 256). An allocation of n
// bytes passes straight through to the upstream (same size, same pointer) when n is 0, when A is
// 256 or when n < Threshold. Otherwise the upstream is asked for [AlignUp](n, A) + (A − 256) bytes
// — enough to hold n bytes from the first A-aligned address inside them, since the upstream's
// pointer is 256-aligned — and the pointer returned is the upstream's rounded up to A. The
// adaptor remembers the upstream's pointer for every rounded pointer that differs from it, and
// Deallocate gives the upstream its own pointer and the same enlarged size back, after forgetting
// the rounded one.
//
// The alignment comes from this arithmetic, so it holds whatever the upstream is (address-only
// upstreams included). Safe for concurrent use: the remembered pointers are kept under a mutex,
// taken only for allocations that are aligned.
type AlignedResourceAdaptor struct {
	upstream  MemoryResource
	alignment int
	threshold int

	mu       sync.Mutex
	original map[DevicePtr]DevicePtr // rounded pointer -> the upstream's, where they differ
}

// NewAlignedResourceAdaptor returns an adaptor over upstream that aligns allocations as opts says
// (nil: the defaults). An alignment that is not a power of two (e.g. 255 or 768) or negative, or
// a negative threshold, returns an error wrapping [ErrInvalidArgument]. A nil upstream means the
// current device resource ([CurrentDeviceResource], read once, here); a nil pointer as upstream
// returns an error wrapping [ErrInvalidArgument].
func NewAlignedResourceAdaptor(upstream MemoryResource, opts *AlignedOptions) (*AlignedResourceAdaptor, error) {
	upstream, err := upstreamOf("NewAlignedResourceAdaptor", upstream)
	if err != nil {
		return nil, err
	}
	var o AlignedOptions
	if opts != nil {
		o = *opts
	}
	if o.Alignment == 0 {
		o.Alignment = Alignment
	}
	if !IsPowerOfTwo(o.Alignment) {
		return nil, errorf("NewAlignedResourceAdaptor: alignment %d is not a power of two: %w", o.Alignment, ErrInvalidArgument)
	}
	if o.Threshold < 0 {
		return nil, errorf("NewAlignedResourceAdaptor: negative threshold %d: %w", o.Threshold, ErrInvalidArgument)
	}
	return &AlignedResourceAdaptor{
		upstream:  upstream,
		alignment: max(o.Alignment, Alignment),
		threshold: o.Threshold,
		original:  map[DevicePtr]DevicePtr{},
	}, nil
}

// passThrough reports whether an allocation of nbytes goes to the upstream unchanged.
func (r *AlignedResourceAdaptor) passThrough(nbytes int) bool {
	return nbytes == 0 || r.alignment == Alignment || nbytes < r.threshold
}

// upstreamSize is what the upstream is asked for to align nbytes; ok is false on overflow.
func (r *AlignedResourceAdaptor) upstreamSize(nbytes int) (int, bool) {
	n, ok := AlignUp(nbytes, r.alignment)
	if !ok || n > int(^uint(0)>>1)-(r.alignment-Alignment) {
		return 0, false
	}
	return n + r.alignment - Alignment, true
}

// Allocate returns nbytes aligned to the adaptor's alignment, ordered on stream s (see the type's
// comment). A size whose enlarged upstream size overflows returns an error wrapping
// [ErrOutOfMemory]. The upstream's errors are returned unchanged for allocations passed straight
// through, and wrapped (errors.Is sees through) with the size asked and the padded size for
// aligned ones. A negative size returns an error wrapping [ErrInvalidArgument].
func (r *AlignedResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("AlignedResourceAdaptor", "Allocate", nbytes)
	}
	if r.passThrough(nbytes) {
		return r.upstream.Allocate(nbytes, s)
	}
	size, ok := r.upstreamSize(nbytes)
	if !ok {
		return 0, outOfMemory(fmt.Sprintf("AlignedResourceAdaptor (alignment %d)", r.alignment), nbytes, errAlignedOverflow)
	}
	p, err := r.upstream.Allocate(size, s)
	if err != nil {
		return 0, errorf("AlignedResourceAdaptor: allocating %s aligned to %d (%d bytes with the padding): %w", bytesText(nbytes), r.alignment, size, err)
	}
	mask := uintptr(r.alignment) - 1
	a := DevicePtr((uintptr(p) + mask) &^ mask)
	if a == p {
		return p, nil
	}
	r.mu.Lock()
	_, dup := r.original[a]
	if !dup {
		r.original[a] = p
	}
	r.mu.Unlock()
	if dup {
		err := errorf("AlignedResourceAdaptor.Allocate(%d): the aligned pointer %#x is already tracked (the upstream returned %#x, inside memory it handed out before): %w", nbytes, uintptr(a), uintptr(p), ErrInvalidFree)
		if ferr := r.upstream.Deallocate(p, size, s); ferr != nil {
			err = errorf("%w; giving the memory back failed: %w", err, ferr)
		}
		return 0, err
	}
	return a, nil
}

// Deallocate returns p, which Allocate(nbytes, ·) gave, to the upstream on stream s: with the
// upstream's own pointer and size when the allocation was aligned. When the upstream returns an
// error, which is returned, the adaptor still knows p. A negative size returns an error wrapping
// [ErrInvalidArgument].
func (r *AlignedResourceAdaptor) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if nbytes < 0 {
		return invalidSize("AlignedResourceAdaptor", "Deallocate", nbytes)
	}
	if r.passThrough(nbytes) {
		return r.upstream.Deallocate(p, nbytes, s)
	}
	size, ok := r.upstreamSize(nbytes)
	if !ok {
		return errorf("AlignedResourceAdaptor.Deallocate(%#x, %d): no allocation of that size can exist: %w", uintptr(p), nbytes, ErrInvalidFree)
	}
	up := p
	r.mu.Lock()
	orig, found := r.original[p]
	if found {
		up = orig
		delete(r.original, p)
	}
	r.mu.Unlock()
	if err := r.upstream.Deallocate(up, size, s); err != nil {
		if found {
			r.mu.Lock()
			r.original[p] = orig
			r.mu.Unlock()
		}
		return err
	}
	return nil
}

// Alignment returns the alignment of the pointers handed out: max([AlignedOptions.Alignment], 256).
func (r *AlignedResourceAdaptor) Alignment() int { return r.alignment }

// Threshold returns the size from which allocations are aligned.
func (r *AlignedResourceAdaptor) Threshold() int { return r.threshold }

// Upstream returns the resource the adaptor forwards to.
func (r *AlignedResourceAdaptor) Upstream() MemoryResource { return r.upstream }

func (*AlignedResourceAdaptor) insideUpstream() {}

// Access reports the upstream's accessibility ([AccessOf](Upstream())).
func (r *AlignedResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the upstream's device ([DeviceOf](Upstream())).
func (r *AlignedResourceAdaptor) Device() Device { return DeviceOf(r.upstream) }
