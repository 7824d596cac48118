package rmm

import (
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// docs/python-api.md's closing count line says how many rows of its tables are present, partial,
// differs and absent: it must match the rows.
func TestPythonAPICounts(t *testing.T) {
	b, err := os.ReadFile("docs/python-api.md")
	require.NoError(t, err)
	counts := map[string]int{}
	rows := 0
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		cols := strings.Split(line, "|")
		require.GreaterOrEqual(t, len(cols), 4, "row %q", line)
		status := strings.Fields(cols[3])
		require.NotEmpty(t, status, "row %q has no status", line)
		counts[status[0]]++
		rows++
	}
	want := fmt.Sprintf("Counts: %d rows: %d present, %d partial, %d differs (no dedicated Go name; Go idiom instead), %d absent.",
		rows, counts["present"], counts["partial"], counts["differs"], counts["absent"])
	require.Equal(t, rows, counts["present"]+counts["partial"]+counts["differs"]+counts["absent"], "every row has one of the four statuses: %v", counts)
	got := regexp.MustCompile(`(?m)^Counts: .*$`).FindString(string(b))
	require.Equal(t, want, got)
}
