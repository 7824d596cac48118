package rmm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseBytes(t *testing.T) {
	for s, want := range map[string]int{
		"1073741824": 1 << 30, "4GiB": 4 << 30, "4 GiB": 4 << 30, "4gib": 4 << 30, "512MiB": 512 << 20,
		"0.5KiB": 512, "1.5GB": 1_500_000_000, "512MB": 512_000_000, "4kB": 4000, "4G": 4_000_000_000,
		"0": 0, "9223372036854775807": 1<<63 - 1, " 4GiB ": 4 << 30, "1,000": 1000,
	} {
		got, err := ParseBytes(s)
		require.NoError(t, err, s)
		require.Equal(t, want, got, s)
	}
	for _, s := range []string{"", "-1", "abc", "1e3", "4 parsecs", "9223372036854775808", "99999999999999999999"} {
		_, err := ParseBytes(s)
		require.ErrorIs(t, err, ErrInvalidArgument, s)
		require.Contains(t, err.Error(), `"`+s+`"`)
	}
}
