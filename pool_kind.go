package rmm

import "fmt"

// PoolKind names one of the package's pools, for the calls that build a pool for the user:
// [ReinitializeOptions.Pool], and the pools of the rmm-replay command and of the shared library
// for Python. The zero value is [StitchingPool], the default.
//
// Pick [StitchingPool] unless the program's first pass is most of its life: its memory stays
// closest to what is live, but the first time it meets a shape it makes more driver calls. Pick
// [ExpandablePool] for a short-lived program, and [PlainPool] for code that must behave as
// librmm's pool does.
type PoolKind int

const (
	// StitchingPool is an expandable pool that stitches:
	// PoolOptions{Expandable: true, Stitch: true}.
	StitchingPool PoolKind = iota
	// ExpandablePool is an expandable pool without stitching: PoolOptions{Expandable: true}.
	ExpandablePool
	// PlainPool is librmm's pool (PoolOptions without Expandable): it grows by allocations
	// from its upstream.
	PlainPool
)

// String returns "stitching", "expandable" or "plain", the names [ParsePoolKind] reads.
func (k PoolKind) String() string {
	switch k {
	case StitchingPool:
		return "stitching"
	case ExpandablePool:
		return "expandable"
	case PlainPool:
		return "plain"
	}
	return fmt.Sprintf("PoolKind(%d)", int(k))
}

// ParsePoolKind returns the kind [PoolKind.String] names; [ErrInvalidArgument] for another name.
func ParsePoolKind(name string) (PoolKind, error) {
	for k := StitchingPool; k <= PlainPool; k++ {
		if k.String() == name {
			return k, nil
		}
	}
	return 0, errorf("ParsePoolKind: %q is not a pool kind (stitching, expandable or plain): %w", name, ErrInvalidArgument)
}

// Options returns the options that make [NewPoolMemoryResource] build a pool of this kind, with
// every other option zero. A kind other than the three constants returns zero options.
func (k PoolKind) Options() PoolOptions {
	switch k {
	case StitchingPool:
		return PoolOptions{Expandable: true, Stitch: true}
	case ExpandablePool:
		return PoolOptions{Expandable: true}
	}
	return PoolOptions{}
}

// valid reports whether k is one of the three kinds.
func (k PoolKind) valid() bool { return k >= StitchingPool && k <= PlainPool }
