//go:build cgo

package main

import (
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The short form of one PyTorch and one CuPy workload of python/bench (run_all.sh --short runs
// the same number of steps) on the library's own allocator and on the Go pool, each in a
// process of its own: the results must be equal to the bit, the Go pool must have served the
// memory, no call into the library may have failed (a failed free is reported only through
// rmm_last_error) and the pool's invariants must hold. Skipped
// unless python3 imports torch and cupy and PyTorch sees a GPU.
func TestPythonWorkloadsOnGPU(t *testing.T) {
	py, root, lib := needTorchOnGPU(t, "torch, cupy")
	run := func(script, workload, allocator string) map[string]any {
		t.Helper()
		cmd := exec.Command(py, filepath.Join(root, "python", "bench", script), "--workload", workload,
			"--allocator", allocator, "--steps", "6", "--warmup", "1")
		cmd.Env = pythonEnv(lib)
		out, err := cmd.Output()
		if err != nil {
			var stderr []byte
			if ee, ok := err.(*exec.ExitError); ok {
				stderr = ee.Stderr
			}
			t.Fatalf("%s %s %s: %v\n%s", script, workload, allocator, err, lastLines(stderr, 30))
		}
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		var rec map[string]any
		if err := json.Unmarshal([]byte(lines[len(lines)-1]), &rec); err != nil {
			t.Fatalf("%s %s %s: %v\n%s", script, workload, allocator, err, out)
		}
		t.Logf("%s %s %s: %s", script, workload, allocator, lines[len(lines)-1])
		return rec
	}
	for _, c := range []struct{ script, workload, native string }{
		{"torch_workloads.py", "gpt", "torch-default"},
		{"cupy_workloads.py", "fft", "cupy-default"},
	} {
		n, g := run(c.script, c.workload, c.native), run(c.script, c.workload, "go")
		if n["hash"] != g["hash"] {
			t.Errorf("%s %s: the results differ: %s on %s, %s on go", c.script, c.workload, n["hash"], c.native, g["hash"])
		}
		if e, ok := g["go_last_error"].(string); !ok || e != "" {
			t.Errorf("%s %s on go: the library's last error: %v", c.script, c.workload, g["go_last_error"])
		}
		if g["go_pool_invariants"] != "hold" {
			t.Errorf("%s %s on go: the pool's invariants: %v", c.script, c.workload, g["go_pool_invariants"])
		}
		if v, _ := g["peak_reserved"].(float64); v <= 0 {
			t.Errorf("%s %s on go: the pool's peak size is %v", c.script, c.workload, g["peak_reserved"])
		}
	}
}

// On the GPU, a tensor larger than the pool's maximum raises an error in Python with the pool's
// message (rmm_torch_alloc throws; a NULL would become a tensor at address 0), and PyTorch goes on
// working on the pool afterwards. Skipped as TestPythonWorkloadsOnGPU is.
func TestTorchRefusalRaisesOnGPU(t *testing.T) {
	py, root, lib := needTorchOnGPU(t, "torch")
	const script = `
import sys
sys.path.insert(0, sys.argv[1])
import gormm_rmm, torch
gormm_rmm.use_torch(maximum_pool_size=1 << 30)
try:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    print("no error: tensor at %#x" % x.data_ptr())
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0])
y = torch.ones(1 << 20, device="cuda")
print("after:", int(y.sum().item()))
`
	cmd := exec.Command(py, "-c", script, filepath.Join(root, "python"))
	cmd.Env = pythonEnv(lib)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, lastLines(out, 30))
	}
	s := string(out)
	t.Log(s)
	if !strings.Contains(s, "raised:") || !strings.Contains(s, "out of memory") {
		t.Errorf("the refused tensor raised no error with the pool's message:\n%s", s)
	}
	if !strings.Contains(s, "after: 1048576") {
		t.Errorf("PyTorch did not go on working on the pool:\n%s", s)
	}
}

// needTorchOnGPU skips the test in -short runs and unless python3 imports modules (a
// comma-separated list, torch among them) and PyTorch sees a GPU; it returns python3's path, the
// repository's root and the library (buildLibrary).
func needTorchOnGPU(t *testing.T, modules string) (py, root, lib string) {
	t.Helper()
	if testing.Short() {
		t.Skip("runs Python's GPU libraries on the GPU")
	}
	py = needPython(t)
	probe := exec.Command(py, "-c", "import sys, "+modules+"; sys.exit(0 if torch.cuda.is_available() else 1)")
	if out, err := probe.CombinedOutput(); err != nil {
		t.Skipf("python3 cannot import %s, or sees no GPU: %v\n%s", modules, err, lastLines(out, 3))
	}
	root = repoRoot(t)
	return py, root, buildLibrary(t, root)
}

func lastLines(b []byte, n int) string {
	l := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}
