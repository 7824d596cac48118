//go:build cgo

package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// headerCallerHarness is a C++ program written against the generated header librmm_go.h, which
// README.md offers "for C and C++ callers" with "the functions' C declarations", and linked with
// the library (no dlsym): it calls rmm_torch_alloc as declared there.
const headerCallerHarness = `#include "librmm_go.h"
#include <cstdio>
#include <new>
int main() {
  void* p = rmm_torch_alloc(4096, 0, nullptr);
  printf("granted %d\n", p != nullptr);
  rmm_free(p, 4096, 0, nullptr);
  try {
    rmm_torch_alloc((size_t)1 << 60, 0, nullptr);
    printf("refused: returned\n");
  } catch (const std::bad_alloc& e) {
    printf("refused: bad_alloc: %s\n", e.what());
  }
  return 0;
}
`

// The header the build writes declares every C function of the package comment, rmm_torch_alloc
// (which is C++, not a Go export) included, with C linkage: a C++ caller that includes
// librmm_go.h and links the library can call it.
func TestTorchAllocDeclaredInHeader(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the library")
	}
	needGo(t)
	root := repoRoot(t)
	dir := t.TempDir()
	lib := filepath.Join(dir, "librmm_go.so")
	build := exec.Command("go", "build", "-buildmode=c-shared", "-o", lib, "./cmd/rmm-python")
	build.Dir = root
	build.Env = append(os.Environ(), "CGO_ENABLED=1")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "%s", out)
	header, err := os.ReadFile(filepath.Join(dir, "librmm_go.h"))
	require.NoError(t, err)
	require.True(t, strings.Contains(string(header), "rmm_torch_alloc("), "librmm_go.h does not declare rmm_torch_alloc")

	bin := cxxHarness(t, dir, "caller", headerCallerHarness, "-I", dir, "-L", dir, "-lrmm_go", "-Wl,-rpath,"+dir)
	out, err = exec.Command(bin).CombinedOutput()
	require.NoError(t, err, "%s", out)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	require.Len(t, lines, 2, "%s", out)
	require.Equal(t, "granted 1", lines[0])
	require.True(t, strings.HasPrefix(lines[1], "refused: bad_alloc: "), "%s", lines[1])
	require.Contains(t, lines[1], "1152921504606846976")
}

// staleErrorHarness runs more threads, one after another in small groups, than the system has
// thread ids (kernel.pid_max), so that some thread gets the id of one that has exited (a thread's
// id is in use only while it lives: by the pigeonhole principle ids must repeat). Each thread
// first reads rmm_last_error, before any call of its own has failed, then makes rmm_torch_alloc
// refuse a request (so that every thread leaves a message behind) and checks that the message is
// about its own request.
const staleErrorHarness = `#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <set>
#include <string>
typedef void* (*alloc_fn)(size_t, int, void*);
typedef const char* (*err_fn)(void);
static alloc_fn A;
static err_fn E;
static std::mutex mu;
static std::set<long> used;  // the ids of threads that have had a failure
static std::atomic<long> reused{0}, stale{0}, wrong{0};
static std::string example;
static void* body(void* arg) {
  long tid = syscall(SYS_gettid);
  bool again;
  {
    std::lock_guard<std::mutex> g(mu);
    again = used.count(tid) != 0;
  }
  if (again) reused++;
  const char* e = E();  // this thread has had no failure: must be NULL
  if (e != nullptr) {
    if (stale++ == 0) { std::lock_guard<std::mutex> g(mu); example = e; }
  }
  size_t n = ((size_t)1 << 50) + (size_t)arg;
  try {
    A(n, 0, nullptr);
    wrong++;
  } catch (const std::bad_alloc& x) {
    if (std::string(x.what()).find("alloc(" + std::to_string(n) + ",") == std::string::npos) wrong++;
  }
  std::lock_guard<std::mutex> g(mu);
  used.insert(tid);
  return nullptr;
}
int main(int argc, char** argv) {
  void* so = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!so) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
  A = (alloc_fn)dlsym(so, "rmm_torch_alloc");
  E = (err_fn)dlsym(so, "rmm_last_error");
  long n = atol(argv[2]);
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setstacksize(&at, 256 << 10);
  for (long i = 0; i < n; i += 8) {
    pthread_t t[8];
    for (int j = 0; j < 8; j++)
      if (pthread_create(&t[j], &at, body, (void*)(i + j)) != 0) { fprintf(stderr, "pthread_create failed\n"); return 2; }
    for (int j = 0; j < 8; j++) pthread_join(t[j], nullptr);
  }
  printf("threads %ld reused %ld stale %ld wrong %ld\n", n, reused.load(), stale.load(), wrong.load());
  if (stale) printf("stale message: %s\n", example.c_str());
  return 0;
}
`

// rmm_last_error is "the message of the calling OS thread's last failed call, or nil if it has had
// none" (package callocator): a new thread that the kernel gives an exited thread's id must not
// read that thread's message as its own. The test runs more threads than there are thread ids
// (kernel.pid_max; skipped where that is too large to cycle through quickly), so ids must be
// reused: none of those threads may see a message.
func TestLastErrorNotInheritedByReusedThreadID(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the library and cycles through the thread ids")
	}
	raw, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Skipf("no kernel.pid_max: %v", err)
	}
	pidMax, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	require.NoError(t, err)
	if pidMax > 1<<17 {
		t.Skipf("kernel.pid_max is %d: too many threads to cycle through", pidMax)
	}
	bin := cxxHarness(t, t.TempDir(), "stale", staleErrorHarness, "-O1", "-pthread", "-ldl")
	lib := buildLibrary(t, repoRoot(t))
	n := pidMax + 4096
	out, err := exec.Command(bin, lib, strconv.Itoa(n)).CombinedOutput()
	require.NoError(t, err, "%s", out)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var threads, reused, stale, wrong int
	_, err = fmt.Sscanf(lines[0], "threads %d reused %d stale %d wrong %d", &threads, &reused, &stale, &wrong)
	require.NoError(t, err, "%s", out)
	require.Equal(t, n, threads)
	require.Zero(t, wrong, "a refusal's message was not about the thread's own request: %s", out)
	require.Positive(t, reused, "no thread id was reused: the test proves nothing: %s", out)
	require.Zero(t, stale, "threads that had not failed read another (exited) thread's message from rmm_last_error: %s", out)
}
