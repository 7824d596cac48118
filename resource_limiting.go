package rmm

import (
	"math"
	"sync/atomic"
)

// LimitingOptions configures a [LimitingResourceAdaptor]. nil means the defaults.
type LimitingOptions struct {
	// Alignment is the granularity, in bytes, of what each allocation is charged against the
	// limit: its size rounded up to a multiple of Alignment. It must be a power of two. Default 0
	// means 256 (Alignment), so a 1-byte allocation costs 256 bytes of the limit.
	Alignment int
}

// LimitingResourceAdaptor forwards every call to its upstream but refuses allocations that would
// take the bytes it has handed out above a limit, as librmm's limiting_resource_adaptor (and
// CuPy's set_limit): for capping a program's or a test's device memory.
//
// Each allocation of n bytes is charged [AlignUp](n, alignment) bytes. Allocate adds the charge to
// the counter only if the new total stays within the limit (reaching the limit exactly is
// allowed), in one compare-and-swap; otherwise nothing is added and the error is an
// [*OutOfMemoryError] (errors.Is(err, [ErrOutOfMemory]); Limited set, MaximumSize the limit, PoolSize
// the bytes charged when the request was refused, Detail "exceeded memory limit"). After the
// charge the upstream is called, and its failure takes the charge off again. Deallocate calls the
// upstream and then takes the charge off (not when the upstream returns an error: the memory is
// still allocated). Fragmentation and page sizes of the upstream are not considered.
//
// Safe for concurrent use, lock-free. The limit holds at every instant: AllocatedBytes never
// exceeds it, and allocations racing for the last bytes are served in the order their charges
// land (of three allocations of 5 MiB racing under 12 MiB, exactly two succeed), unlike librmm,
// whose add-then-check briefly counts a refused charge and may refuse an allocation that would
// have fitted. Only an allocation that holds its charge can make another one fail, including one
// whose upstream call is under way and then fails.
type LimitingResourceAdaptor struct {
	upstream  MemoryResource
	limit     int64
	alignment int
	allocated atomic.Int64
}

// NewLimitingResourceAdaptor returns an adaptor that lets at most limit bytes (as charged; see
// [LimitingOptions.Alignment]) be allocated through it from upstream at once; nil opts means the
// defaults. A negative limit, or an alignment that is negative or not a power of two, returns an
// error wrapping [ErrInvalidArgument]. A nil upstream means the current device resource
// ([CurrentDeviceResource], read once, here); a nil pointer as upstream returns an error wrapping
// [ErrInvalidArgument].
func NewLimitingResourceAdaptor(upstream MemoryResource, limit int, opts *LimitingOptions) (*LimitingResourceAdaptor, error) {
	upstream, err := upstreamOf("NewLimitingResourceAdaptor", upstream)
	if err != nil {
		return nil, err
	}
	align := Alignment
	if opts != nil && opts.Alignment != 0 {
		align = opts.Alignment
	}
	if limit < 0 {
		return nil, errorf("NewLimitingResourceAdaptor: negative limit %d: %w", limit, ErrInvalidArgument)
	}
	if !IsPowerOfTwo(align) {
		return nil, errorf("NewLimitingResourceAdaptor: alignment %d is not a power of two: %w", align, ErrInvalidArgument)
	}
	return &LimitingResourceAdaptor{upstream: upstream, limit: int64(limit), alignment: align}, nil
}

// Allocate allocates nbytes from the upstream on stream s if its charge fits under the limit.
// Over the limit (or a size whose rounding overflows) the error is an [*OutOfMemoryError] that
// says the limit and the bytes allocated, and the upstream is not called; the upstream's errors
// are returned unchanged. Either way the counter is as it was. A negative size returns an error
// wrapping [ErrInvalidArgument].
func (r *LimitingResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("LimitingResourceAdaptor", "Allocate", nbytes)
	}
	charge, ok := AlignUp(nbytes, r.alignment)
	if !ok {
		return 0, r.limitError(nbytes, math.MaxInt, true, r.allocated.Load())
	}
	c := int64(charge)
	for {
		cur := r.allocated.Load()
		// Comparing the charge with limit − cur (rather than cur + c with the limit) cannot wrap
		// for a huge charge. The counter never exceeds the limit, but it can go below zero when a
		// caller frees with a larger size than it allocated and the upstream accepts that (as
		// the tracking and aligned adaptors do); cur > limit − c then still cannot overflow. The
		// charge is only added when it fits: a refused one is never visible to others.
		if c > r.limit || cur > r.limit-c {
			return 0, r.limitError(nbytes, charge, false, cur)
		}
		if r.allocated.CompareAndSwap(cur, cur+c) {
			break
		}
	}
	p, err := r.upstream.Allocate(nbytes, s)
	if err != nil {
		r.allocated.Add(-c)
		return 0, err
	}
	return p, nil
}

// limitError is the error for a request of nbytes charged charge bytes (overflow: the rounding
// overflowed, charge is math.MaxInt), refused while allocated bytes were charged.
func (r *LimitingResourceAdaptor) limitError(nbytes, charge int, overflow bool, allocated int64) *OutOfMemoryError {
	return newOutOfMemory(OutOfMemoryError{
		Resource:    "LimitingResourceAdaptor",
		Requested:   nbytes,
		PoolSize:    int(allocated),
		MaximumSize: int(r.limit),
		Headroom:    int(r.limit - allocated),
		Limited:     true,
		TooLarge:    overflow || int64(charge) > r.limit,
		Detail:      "exceeded memory limit",
	}, charge)
}

// Deallocate returns p to the upstream on stream s and then takes its charge off the counter.
// The upstream's error is returned, and the counter is then unchanged. A negative size returns an
// error wrapping [ErrInvalidArgument].
func (r *LimitingResourceAdaptor) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if nbytes < 0 {
		return invalidSize("LimitingResourceAdaptor", "Deallocate", nbytes)
	}
	if p == 0 {
		return nil // nothing was charged for it
	}
	if err := r.upstream.Deallocate(p, nbytes, s); err != nil {
		return err
	}
	charge, _ := AlignUp(nbytes, r.alignment)
	r.allocated.Add(-int64(charge))
	return nil
}

// AllocatedBytes returns the bytes charged against the limit now.
func (r *LimitingResourceAdaptor) AllocatedBytes() int { return int(r.allocated.Load()) }

// AllocationLimit returns the limit in bytes.
func (r *LimitingResourceAdaptor) AllocationLimit() int { return int(r.limit) }

// Alignment returns the granularity of the charges, in bytes.
func (r *LimitingResourceAdaptor) Alignment() int { return r.alignment }

// Upstream returns the resource the adaptor forwards to.
func (r *LimitingResourceAdaptor) Upstream() MemoryResource { return r.upstream }

func (*LimitingResourceAdaptor) insideUpstream() {}

func (*LimitingResourceAdaptor) passesPointersThrough() {}

// Access reports the upstream's accessibility ([AccessOf](Upstream())).
func (r *LimitingResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the upstream's device ([DeviceOf](Upstream())).
func (r *LimitingResourceAdaptor) Device() Device { return DeviceOf(r.upstream) }
