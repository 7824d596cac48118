package rmm

import (
	"fmt"
	"math"
	bignum "math/big"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseBytes(t *testing.T) {
	for s, want := range map[string]int{
		"1073741824": 1 << 30, "4GiB": 4 << 30, "4 GiB": 4 << 30, "4gib": 4 << 30, "512MiB": 512 << 20,
		"0.5KiB": 512, "1.5GB": 1_500_000_000, "512MB": 512_000_000, "4kB": 4000, "4G": 4_000_000_000,
		"0": 0, "9223372036854775807": 1<<63 - 1, " 4GiB ": 4 << 30, "1,000": 1000,
		"4Gi": 4 << 30, "512b": 512, "512 B": 512, ".5KiB": 512, "1.KiB": 1024, "1.9": 1, "7.5EiB": 15 << 59,
		"1,048,576kB": 1_048_576_000, "2.5 mb": 2_500_000, "1.5ki": 1536,
	} {
		got, err := ParseBytes(s)
		require.NoError(t, err, s)
		require.Equal(t, want, got, s)
	}
	for _, s := range []string{"", "-1", "abc", "1e3", "4 parsecs", "9223372036854775808", "99999999999999999999",
		"8EiB", "8.0EiB", "1.2.3", ".", "KiB", "4 GiBs", "0x10", "\u0663"} {
		_, err := ParseBytes(s)
		require.ErrorIs(t, err, ErrInvalidArgument, s)
		require.Contains(t, err.Error(), `"`+s+`"`)
	}
}

// TestParseBytesCommas: a comma is read only as a thousands separator, with one to three digits
// before the first and exactly three after each; anything else is an error naming the comma.
func TestParseBytesCommas(t *testing.T) {
	for s, want := range map[string]int{
		"1,000": 1000, "12,345": 12345, "123,456,789": 123456789, "1,000,000": 1_000_000,
		"1,024KiB": 1 << 20, "1,000.5KiB": 1_024_512, "999": 999, "1000": 1000,
	} {
		got, err := ParseBytes(s)
		require.NoError(t, err, s)
		require.Equal(t, want, got, s)
	}
	for _, s := range []string{",100", "100,", "1,00", "1,2,3", "1,0000", "1234,567", "1,,000",
		",", "1,000,", "1.000,5", "1,000.5,0", ",5KiB", "1,0.5"} {
		_, err := ParseBytes(s)
		require.ErrorIs(t, err, ErrInvalidArgument, s)
		require.Contains(t, err.Error(), `"`+s+`"`)
		require.Contains(t, err.Error(), "comma", s)
	}
}

func TestFormatBytes(t *testing.T) {
	for n, want := range map[int64]string{
		0: "0 B", 1: "1 B", 768: "768 B", 1023: "1023 B", 1024: "1 KiB", 1025: "1.001 KiB",
		1536: "1.5 KiB", 500000: "488.281 KiB", 614400: "600 KiB", 65537: "64.001 KiB",
		1<<20 - 1024: "1023 KiB", 1<<20 - 1: "1023.999 KiB", 1<<30 - 1: "1 GiB", 1<<20 - 512: "1023.5 KiB", 2 << 20: "2 MiB",
		771751936: "736 MiB", 1579564032: "1.471 GiB", 3 << 29: "1.5 GiB", 1<<30 + 1<<20: "1.001 GiB",
		1<<30 + 1<<19: "1 GiB", 1<<40 + 1<<39: "1.5 TiB", 1 << 50: "1 PiB", 1<<50 + 1<<31: "1 PiB",
		1<<50 + 1<<41: "1.002 PiB", 1<<60 - 1: "1 EiB", 1 << 60: "1 EiB", math.MaxInt64: "8 EiB",
		-1536: "-1.5 KiB", -768: "-768 B", math.MinInt64: "-8 EiB",
	} {
		require.Equal(t, want, FormatBytes(n), "%d", n)
	}
}

// TestFormatBytesModel checks FormatBytes on random sizes of every magnitude against exact
// rational arithmetic: the unit is the largest power of 1024 at most n, the figure n/unit rounded
// to thousandths, halves up, and 1024 of a unit is 1 of the next.
func TestFormatBytesModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(16, 1))
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}
	for k := range 20000 {
		n := rng.Int64N(math.MaxInt64) >> rng.IntN(63)
		if k%2 == 1 { // near a unit boundary, where rounding carries
			n = int64(1)<<(10*rng.IntN(7)) - rng.Int64N(1<<rng.IntN(20))
		}
		if n < 0 {
			continue
		}
		i := 0
		for i < 6 && n >= int64(1)<<(10*(i+1)) {
			i++
		}
		unit := new(bignum.Rat).SetFrac(big1(n), new(bignum.Int).Lsh(big1(1), uint(10*i)))
		// round(x*1000) with halves up = floor(x*1000 + 1/2)
		r := new(bignum.Rat).Add(new(bignum.Rat).Mul(unit, new(bignum.Rat).SetInt64(1000)), bignum.NewRat(1, 2))
		milli := new(bignum.Int).Quo(r.Num(), r.Denom())
		whole, frac := new(bignum.Int).QuoRem(milli, big1(1000), new(bignum.Int))
		if whole.Int64() == 1024 {
			whole, i = big1(1), i+1
		}
		want := fmt.Sprintf("%d.%03d", whole, frac)
		want = strings.TrimSuffix(strings.TrimRight(want, "0"), ".") + " " + units[i]
		require.Equal(t, want, FormatBytes(n), "%d", n)
		if n != 0 {
			require.Equal(t, "-"+want, FormatBytes(-n), "%d", -n)
		}
	}
}

func big1(n int64) *bignum.Int { return bignum.NewInt(n) }

func TestGroupThousands(t *testing.T) {
	for n, want := range map[int64]string{
		0: "0", 7: "7", 999: "999", 1000: "1,000", -1000: "-1,000", 134217728: "134,217,728",
		-999999: "-999,999", 1234567: "1,234,567", math.MaxInt64: "9,223,372,036,854,775,807",
		math.MinInt64: "-9,223,372,036,854,775,808",
	} {
		require.Equal(t, want, groupThousands(n), "%d", n)
	}
}

// TestAlignNotPowerOfTwo: AlignUp reports an alignment that is not a power of two through its ok
// result, as it reports overflow; AlignDown, which has no failure result, panics naming it.
func TestAlignNotPowerOfTwo(t *testing.T) {
	for _, align := range []int{3, 6, 768, 0, -256, math.MinInt} {
		n, ok := AlignUp(11, align)
		require.False(t, ok, "AlignUp(11, %d)", align)
		require.Zero(t, n, "AlignUp(11, %d)", align)
		require.PanicsWithValue(t, fmt.Sprintf("rmm.AlignDown: alignment %d is not a power of two", align),
			func() { AlignDown(11, align) }, "AlignDown(11, %d)", align)
	}
	for _, c := range []struct{ n, align, up, down int }{
		{11, 1, 11, 11}, {11, 4, 12, 8}, {-11, 4, -8, -12}, {0, 256, 0, 0}, {257, 256, 512, 256},
		{math.MaxInt, 1 << 62, 0, 1 << 62},
	} {
		up, ok := AlignUp(c.n, c.align)
		require.Equal(t, c.up != 0 || c.n == 0, ok, "AlignUp(%d, %d)", c.n, c.align)
		require.Equal(t, c.up, up, "AlignUp(%d, %d)", c.n, c.align)
		require.Equal(t, c.down, AlignDown(c.n, c.align), "AlignDown(%d, %d)", c.n, c.align)
	}
}
