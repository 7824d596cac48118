//go:build cgo

package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// repoRoot is the module's root, two directories above this package.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "python", "pyproject.toml")); err != nil {
		t.Skipf("no Python project beside the module: %v", err)
	}
	return root
}

// needPython skips the test where python3 or cgo's C compiler is missing, and returns python3's
// path.
func needPython(t *testing.T) string {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 is not on the PATH")
	}
	cc := "gcc"
	if out, err := exec.Command("go", "env", "CC").Output(); err == nil && strings.TrimSpace(string(out)) != "" {
		cc = strings.Fields(string(out))[0]
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler (%s) for cgo", cc)
	}
	return py
}

// buildLibrary builds librmm_go.so into a temporary directory, or returns GORMM_RMM_LIBRARY where
// it names a library built already (as on a GPU machine without Go); it skips the test where it
// has neither.
func buildLibrary(t *testing.T, root string) string {
	t.Helper()
	if lib := os.Getenv("GORMM_RMM_LIBRARY"); lib != "" {
		if _, err := os.Stat(lib); err != nil {
			t.Fatalf("GORMM_RMM_LIBRARY: %v", err)
		}
		return lib
	}
	needGo(t)
	lib := filepath.Join(t.TempDir(), "librmm_go.so")
	cmd := exec.Command("go", "build", "-buildmode=c-shared", "-o", lib, "./cmd/rmm-python")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build -buildmode=c-shared: %v\n%s", err, out)
	}
	return lib
}

// needGo skips the test where the go command is not on the PATH.
func needGo(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go is not on the PATH")
	}
}

// pythonEnv is the environment of the Python processes: no bytecode left in the source tree, and
// the library named or not.
func pythonEnv(lib string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GORMM_RMM_LIBRARY=") && !strings.HasPrefix(kv, "PYTHONPATH=") {
			env = append(env, kv)
		}
	}
	env = append(env, "PYTHONDONTWRITEBYTECODE=1")
	if lib != "" {
		env = append(env, "GORMM_RMM_LIBRARY="+lib)
	}
	return env
}

// The Python package over the library built here (host memory where there is no GPU): the pool's
// kinds and figures, allocations through ctypes, the library's errors as the package's exception,
// and the CuPy and PyTorch allocators against stand-ins of both (python/tests).
func TestPythonPackage(t *testing.T) {
	t.Parallel() // beside TestPipInstall: each waits mostly on its own link of the library
	py := needPython(t)
	root := repoRoot(t)
	lib := buildLibrary(t, root)
	cmd := exec.Command(py, "-m", "unittest", "discover", "-v", "-s", filepath.Join(root, "python", "tests"))
	cmd.Dir = t.TempDir()
	cmd.Env = pythonEnv(lib)
	out, err := cmd.CombinedOutput()
	t.Logf("%s", out)
	if err != nil {
		t.Fatalf("python tests: %v", err)
	}
}

// pip install ./python builds the library and installs it inside the package, where the package
// finds it without GORMM_RMM_LIBRARY.
func TestPipInstall(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the library and a virtual environment")
	}
	t.Parallel()
	py := needPython(t)
	needGo(t) // the build backend runs go build
	root := repoRoot(t)
	venv := filepath.Join(t.TempDir(), "venv")
	if out, err := exec.Command(py, "-m", "venv", venv).CombinedOutput(); err != nil {
		t.Skipf("python3 -m venv: %v\n%s", err, out)
	}
	vpy := filepath.Join(venv, "bin", "python")
	// The build backend needs no package from an index (pyproject.toml: requires = []), so the
	// install runs offline.
	pip := exec.Command(vpy, "-m", "pip", "install", "--no-index", "--no-cache-dir", "-v", filepath.Join(root, "python"))
	pip.Env = pythonEnv("")
	pip.Dir = t.TempDir()
	out, err := pip.CombinedOutput()
	if err != nil {
		if bytes.Contains(out, []byte("No module named pip")) {
			t.Skipf("the virtual environment has no pip:\n%s", out)
		}
		t.Fatalf("pip install: %v\n%s", err, out)
	}
	if bytes.Count(out, []byte("go build -buildmode=c-shared")) != 1 || bytes.Contains(out, []byte("installing without")) {
		t.Fatalf("pip install did not build the library:\n%s", out)
	}
	check := exec.Command(vpy, "-c", `
import os, sys, gormm_rmm
p = gormm_rmm.loaded_path()
assert p.startswith(os.path.realpath(sys.prefix)) or p.startswith(sys.prefix), p
assert os.path.dirname(p) == os.path.dirname(gormm_rmm.__file__), (p, gormm_rmm.__file__)
gormm_rmm.reinitialize(pool="plain", initial_pool_size=1 << 26, maximum_pool_size=1 << 28)
print(gormm_rmm.pool_stats()["kind"])
`)
	check.Env = pythonEnv("")
	check.Dir = t.TempDir()
	got, err := check.CombinedOutput()
	if err != nil || strings.TrimSpace(string(got)) != "plain" {
		t.Fatalf("the installed package: %v\n%s", err, got)
	}
}
