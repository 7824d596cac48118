package rmm

import (
	"fmt"
	"math"
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

// FormatBytes renders a byte count with a binary unit, dividing by 1024 while the value is above
// 1024, as librmm prints sizes in its messages: FormatBytes(1<<40+1<<39) == "1.500000 TiB",
// FormatBytes(1024) == "1024.000000 B" and FormatBytes(1<<50) == "1024.000000 TiB" (a value of
// exactly 1024 stays in the lower unit).
func FormatBytes(n int64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}
	v := float64(n)
	i := 0
	for (v > 1024 || v < -1024) && i < len(units)-1 {
		v /= 1024
		i++
	}
	return fmt.Sprintf("%f %s", v, units[i])
}
