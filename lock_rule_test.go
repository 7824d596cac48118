package rmm

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestNoAssertUnderLock holds the test files to the rule in helpers_test.go's header: no
// assertion while a lock of the code under test is held.
func TestNoAssertUnderLock(t *testing.T) {
	var bad []string
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		// This file's own example breaks the rule on purpose, inside a string.
		if err != nil || d.IsDir() || !strings.HasSuffix(path, "_test.go") || path == "lock_rule_test.go" {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, v := range assertsUnderLock(string(b)) {
			bad = append(bad, path+":"+v)
		}
		return nil
	})
	require.NoError(t, err)
	require.Empty(t, bad, "assertions made while holding a lock (see helpers_test.go's header)")
}

var (
	lockLine    = regexp.MustCompile(`^\s*([\w.()\[\]]+)\.(mu|lock)\.Lock\(\)\s*$`)
	deferUnlock = regexp.MustCompile(`^\s*defer [\w.()\[\]]+\.(mu|lock)\.Unlock\(\)\s*$`)
	assertCall  = regexp.MustCompile(`\b(require|assert)\.[A-Z]|\bt\.(Fatal|Error)`)
)

// assertsUnderLock returns "line: text" for each assertion src makes with a lock held: after a
// `x.mu.Lock()` line up to the next Unlock, or, when the next line defers the Unlock, up to
// the end of the function (the first line indented less than the Lock).
func assertsUnderLock(src string) []string {
	lines := strings.Split(src, "\n")
	indent := func(l string) int { return len(l) - len(strings.TrimLeft(l, "\t")) }
	var found []string
	for i, l := range lines {
		if !lockLine.MatchString(l) {
			continue
		}
		deferred := i+1 < len(lines) && deferUnlock.MatchString(lines[i+1])
		for j := i + 1; j < len(lines); j++ {
			m := lines[j]
			if deferred {
				if strings.TrimSpace(m) != "" && indent(m) < indent(l) {
					break
				}
			} else if strings.Contains(m, "Unlock()") {
				break
			}
			if assertCall.MatchString(m) {
				found = append(found, strconv.Itoa(j+1)+": "+strings.TrimSpace(m))
				break
			}
		}
	}
	return found
}

// The check finds both shapes, and passes reads made under the lock with asserts after it.
func TestAssertsUnderLockFinds(t *testing.T) {
	src := `func a() {
	p.mu.Lock()
	require.Equal(t, 1, p.n)
	p.mu.Unlock()
}

func b() {
	c.mu.Lock()
	defer c.mu.Unlock()
	x := 1
	if x > 0 {
		t.Fatalf("no")
	}
}

func ok() {
	p.mu.Lock()
	n := p.n
	p.mu.Unlock()
	require.Equal(t, 1, n)
}
`
	require.Equal(t, []string{"3: require.Equal(t, 1, p.n)", "12: t.Fatalf(\"no\")"}, assertsUnderLock(src))
}
