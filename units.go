package rmm

import (
	"fmt"
	"math"
	"math/bits"
	"strings"

	humanize "github.com/dustin/go-humanize"
)

// ParseBytes reads a size in bytes as RMM's Python API accepts one where it takes a string: a
// number of bytes ("1073741824"), or a number and a unit, binary ("4GiB", "512MiB", "0.5KiB") or
// decimal ("1.5GB", "512MB", "4kB"; a unit of one letter, "4G", is decimal too), in any case, with
// or without a space between, spaces around it ignored, and commas between digits taken as
// thousands separators ("1,000"), as go-humanize's ParseBytes reads them. A fraction of a byte is
// dropped.
//
// Errors wrap ErrInvalidArgument and quote s: anything else (an empty string, a sign, an
// exponent, an unknown unit), or a size above the largest int.
func ParseBytes(s string) (int, error) {
	v, err := humanize.ParseBytes(strings.TrimSpace(s))
	if err != nil {
		return 0, fmt.Errorf("%w: rmm.ParseBytes: not a size: %q (examples: 1073741824, 4GiB, 512MiB, 1.5GB)", ErrInvalidArgument, s)
	}
	if v > math.MaxInt {
		return 0, fmt.Errorf("%w: rmm.ParseBytes: %q is %d bytes, more than the largest int", ErrInvalidArgument, s, v)
	}
	return int(v), nil
}

// FormatBytes renders a byte count n (in bytes) for people, as errors and the cmd/ tools print
// sizes: in the largest binary unit (B, KiB, MiB, GiB, TiB, PiB, EiB; 1 KiB = 1024 bytes) that is
// at most |n|, rounded to the nearest thousandth of that unit (halves up), with trailing zeros
// dropped; a figure that rounds to 1024 is shown as 1 of the next unit.
// FormatBytes(768) == "768 B", FormatBytes(1024) == "1 KiB", FormatBytes(2<<20) == "2 MiB",
// FormatBytes(3<<29) == "1.5 GiB", FormatBytes(500000) == "488.281 KiB" (488.28125),
// FormatBytes(65537) == "64.001 KiB" and FormatBytes(1<<30-1) == "1 GiB". A negative n reads as
// its magnitude after a minus sign. It never fails. Errors print the exact byte count beside it.
//
// librmm prints six decimals and keeps exactly 1024 in the lower unit ("1024.000000 B"); no
// output of this package needs that form (the logging adaptor's CSV writes sizes in bytes).
func FormatBytes(n int64) string {
	const units = "B  KiBMiBGiBTiBPiBEiB"
	u := uint64(n)
	sign := ""
	if n < 0 {
		u, sign = -u, "-" // two's complement: right for math.MinInt64 too
	}
	i := 0
	for i < 6 && u>>(10*(i+1)) != 0 {
		i++
	}
	shift := uint(10 * i)
	whole, milli := u>>shift, uint64(0)
	if shift > 0 {
		// Thousandths of the unit in the remainder, rounded: (rem*1000 + unit/2) >> shift, in
		// 128 bits (rem < 2^60).
		hi, lo := bits.Mul64(u&(1<<shift-1), 1000)
		lo, carry := bits.Add64(lo, 1<<(shift-1), 0)
		hi += carry
		milli = lo>>shift | hi<<(64-shift)
	}
	if milli == 1000 {
		whole, milli = whole+1, 0
	}
	if whole == 1024 {
		whole, i = 1, i+1 // i < 6 here: int64 holds less than 8 EiB
	}
	unit := strings.TrimSpace(units[3*i : 3*i+3])
	if milli == 0 {
		return fmt.Sprintf("%s%d %s", sign, whole, unit)
	}
	frac := strings.TrimRight(fmt.Sprintf("%03d", milli), "0")
	return fmt.Sprintf("%s%d.%s %s", sign, whole, frac, unit)
}
