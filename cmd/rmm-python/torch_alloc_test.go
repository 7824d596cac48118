//go:build cgo

package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// torchAllocHarness calls rmm_torch_alloc as PyTorch's CUDAPluggableAllocator does (through a
// function pointer from dlsym, in C++): a granted request, 0 bytes, a refused request (which must
// throw a std::bad_alloc carrying the library's message, not return NULL), and a request after it.
const torchAllocHarness = `#include <dlfcn.h>
#include <cstdio>
#include <new>
typedef void* (*alloc_fn)(size_t, int, void*);
typedef void (*free_fn)(void*, size_t, int, void*);
int main(int argc, char** argv) {
  void* so = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!so) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
  alloc_fn a = (alloc_fn)dlsym(so, "rmm_torch_alloc");
  free_fn f = (free_fn)dlsym(so, "rmm_free");
  if (!a || !f) { fprintf(stderr, "dlsym: %s\n", dlerror()); return 2; }
  void* p = a(1 << 20, 0, nullptr);
  printf("granted %d\n", p != nullptr);
  f(p, 1 << 20, 0, nullptr);
  printf("zero bytes: NULL %d\n", a(0, 0, nullptr) == nullptr);
  try {
    p = a((size_t)1 << 60, 0, nullptr);
    printf("refused: returned %p\n", p);
  } catch (const std::bad_alloc& e) {
    printf("refused: bad_alloc: %s\n", e.what());
  }
  p = a(4096, 0, nullptr);
  printf("granted after %d\n", p != nullptr);
  f(p, 4096, 0, nullptr);
  return 0;
}
`

// rmm_torch_alloc throws where rmm_alloc returns NULL, with the reason as what(); it grants and
// frees as rmm_alloc does otherwise.
func TestTorchAllocThrowsOnRefusal(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the library")
	}
	bin := cxxHarness(t, t.TempDir(), "harness", torchAllocHarness, "-ldl")
	lib := buildLibrary(t, repoRoot(t))
	out, err := exec.Command(bin, lib).CombinedOutput()
	require.NoError(t, err, "%s", out)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	require.Len(t, lines, 4, "%s", out)
	require.Equal(t, "granted 1", lines[0])
	require.Equal(t, "zero bytes: NULL 1", lines[1])
	require.True(t, strings.HasPrefix(lines[2], "refused: bad_alloc: "), "%s", lines[2])
	require.Contains(t, lines[2], "1152921504606846976")
	require.Contains(t, lines[2], "out of memory")
	require.Equal(t, "granted after 1", lines[3])
}

// cxxHarness compiles the C++ program src with g++ into dir as name (skipping the test where there
// is no g++) and returns the binary's path; args follow the source on g++'s command line.
func cxxHarness(t *testing.T, dir, name, src string, args ...string) string {
	t.Helper()
	cxx, err := exec.LookPath("g++")
	if err != nil {
		t.Skip("no g++ to build the harness")
	}
	file := filepath.Join(dir, name+".cpp")
	require.NoError(t, os.WriteFile(file, []byte(src), 0o644))
	bin := filepath.Join(dir, name)
	out, err := exec.Command(cxx, append([]string{"-o", bin, file}, args...)...).CombinedOutput()
	require.NoError(t, err, "g++ %s: %s", name, out)
	return bin
}
