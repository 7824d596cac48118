package rmm

import (
	"fmt"
	"math"
	"math/bits"
	"strconv"
	"strings"
)

// byteUnits is what ParseBytes multiplies by, by unit in lower case: binary units (KiB, 1024
// bytes), decimal ones (kB, 1000 bytes), either without its "b", and "b" or none for bytes.
var byteUnits = map[string]uint64{
	"": 1, "b": 1,
	"kib": 1 << 10, "ki": 1 << 10, "kb": 1e3, "k": 1e3,
	"mib": 1 << 20, "mi": 1 << 20, "mb": 1e6, "m": 1e6,
	"gib": 1 << 30, "gi": 1 << 30, "gb": 1e9, "g": 1e9,
	"tib": 1 << 40, "ti": 1 << 40, "tb": 1e12, "t": 1e12,
	"pib": 1 << 50, "pi": 1 << 50, "pb": 1e15, "p": 1e15,
	"eib": 1 << 60, "ei": 1 << 60, "eb": 1e18, "e": 1e18,
}

// ParseBytes reads a size in bytes as RMM's Python API accepts one where it takes a string: a
// number of bytes ("1073741824"), or a number and a unit, binary ("4GiB", "512MiB", "0.5KiB") or
// decimal ("1.5GB", "512MB", "4kB"), the unit's B optional ("4Gi" is 4GiB; "4G", one letter, is
// decimal: 4GB) and "B" alone meaning bytes, in any case, with or without a space between, spaces
// around it ignored, and commas in the whole number taken as thousands separators ("1,000",
// "1,048,576kB": one to three digits before the first comma, exactly three after each). A whole
// number is read exactly; a fraction is computed in float64 and a fraction of a byte dropped.
//
// Errors wrap [ErrInvalidArgument] and quote s: anything else (an empty string, a sign, an
// exponent, an unknown unit, a comma anywhere else, as in ",100", "1,00" or "1,2,3"), or a size
// above the largest int.
func ParseBytes(s string) (int, error) {
	notSize := func() error {
		return errorf("ParseBytes: not a size: %q (examples: 1073741824, 4GiB, 512MiB, 1.5GB): %w", s, ErrInvalidArgument)
	}
	tooLarge := func() error {
		return errorf("ParseBytes: %q is more bytes than the largest int (%d): %w", s, math.MaxInt, ErrInvalidArgument)
	}
	t := strings.TrimSpace(s)
	end := 0
	for end < len(t) && ('0' <= t[end] && t[end] <= '9' || t[end] == '.' || t[end] == ',') {
		end++
	}
	if !thousandsGrouped(t[:end]) {
		return 0, errorf("ParseBytes: misplaced comma in %q: commas separate the whole number's digits in groups of three, as in 1,000,000: %w", s, ErrInvalidArgument)
	}
	num := strings.ReplaceAll(t[:end], ",", "")
	unit, ok := byteUnits[strings.ToLower(strings.TrimSpace(t[end:]))]
	if !ok || num == "" {
		return 0, notSize()
	}
	if !strings.Contains(num, ".") {
		v, err := strconv.ParseUint(num, 10, 64) // digits only: fails only when out of range
		if err != nil {
			return 0, tooLarge()
		}
		hi, lo := bits.Mul64(v, unit)
		if hi != 0 || lo > math.MaxInt {
			return 0, tooLarge()
		}
		return int(lo), nil
	}
	f, err := strconv.ParseFloat(num, 64) // "1.5", ".5", "1."; not "." or "1.2.3"
	if err != nil {
		return 0, notSize()
	}
	if f *= float64(unit); f >= 1<<63 {
		return 0, tooLarge()
	}
	return int(f), nil
}

// thousandsGrouped reports whether the commas in num, a run of digits, dots and commas, are all
// thousands separators: none after the first dot, and where the whole part has any, one to three
// digits before the first and exactly three after each. Dots are ParseFloat's to judge.
func thousandsGrouped(num string) bool {
	whole, frac, _ := strings.Cut(num, ".")
	if strings.Contains(frac, ",") {
		return false
	}
	if !strings.Contains(whole, ",") {
		return true
	}
	groups := strings.Split(whole, ",")
	if n := len(groups[0]); n < 1 || n > 3 {
		return false
	}
	for _, g := range groups[1:] {
		if len(g) != 3 {
			return false
		}
	}
	return true
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

// groupThousands writes n in decimal with a comma between each group of three digits, as the
// profilers' reports print counts and bytes: groupThousands(-1234567) == "-1,234,567".
func groupThousands(n int64) string {
	s := strconv.FormatInt(n, 10)
	digits := strings.TrimPrefix(s, "-")
	sign := s[:len(s)-len(digits)]
	var b strings.Builder
	b.WriteString(sign)
	for i, c := range digits {
		if i > 0 && (len(digits)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}
