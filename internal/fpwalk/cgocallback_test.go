//go:build amd64 && linux

package fpwalk

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// In Go called back from C, on a thread Go started and on one C started, with the C caller's
// frame pointer register pointing into a page that cannot be read, Callers stops where the
// chain leaves the goroutine's stack and reports the stack incomplete, with the innermost frames
// of runtime.Callers's (testdata/cgocallback checks them). Without the checks, the walk follows
// the C frame pointer and the program faults.
func TestCallersCgoCallback(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a cgo program: not in -short mode")
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH")
	}
	env, err := exec.Command(goTool, "env", "CGO_ENABLED", "CC").Output()
	if err != nil {
		t.Fatal(err)
	}
	fields := strings.Fields(string(env))
	if len(fields) < 2 || fields[0] != "1" {
		t.Skip("cgo is off")
	}
	if _, err := exec.LookPath(fields[1]); err != nil {
		t.Skipf("no C compiler (%s)", fields[1])
	}
	exe := filepath.Join(t.TempDir(), "cgocallback")
	if out, err := exec.Command(goTool, "build", "-o", exe, "./testdata/cgocallback").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(exe).CombinedOutput()
	t.Logf("%s", out)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(string(out), "ok\n") {
		t.Fatal("no ok")
	}
}
