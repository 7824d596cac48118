//go:build cgo

// Package cthreads calls C allocator function pointers from C, on C threads of its own, for the
// tests of package callocator (cgo is not allowed in test files).
package cthreads

/*
#cgo LDFLAGS: -lpthread
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void *(*alloc_fn)(size_t, int, void *, void *);
typedef void (*free_fn)(void *, size_t, int, void *, void *);
typedef const char *(*err_fn)(void);

struct job {
	alloc_fn a; free_fn f; err_fn e; void *ctx;
	int iters, id, touch;
	int failures, bad;
	char msg[256];
};

static void note(struct job *j) {
	const char *m = j->e();
	if (m) { strncpy(j->msg, m, sizeof j->msg - 1); }
}

static void *run(void *p) {
	struct job *j = p;
	for (int i = 0; i < j->iters; i++) {
		size_t n = 1 + (size_t)((i * 7919u + j->id * 104729u) % 70000u);
		unsigned char *q = j->a(n, 0, NULL, j->ctx);
		if (!q) { j->failures++; note(j); continue; }
		if (j->touch) {
			q[0] = (unsigned char)j->id; q[n - 1] = (unsigned char)i;
			for (volatile int k = 0; k < 50; k++) {}
			if (q[0] != (unsigned char)j->id || q[n - 1] != (unsigned char)i) j->bad++;
		}
		const char *before = j->e();
		j->f(q, n, 0, NULL, j->ctx);
		if (j->e() != before) { j->failures++; note(j); }
	}
	return NULL;
}

// run_threads runs n threads of iters allocations and frees each; it returns the failures and
// the blocks whose bytes changed under their owner, and copies one failure's message into msg.
static int run_threads(alloc_fn a, free_fn f, err_fn e, void *ctx, int n, int iters, int touch, int *bad, char *msg) {
	pthread_t *t = calloc(n, sizeof *t);
	struct job *jobs = calloc(n, sizeof *jobs);
	for (int i = 0; i < n; i++) {
		jobs[i] = (struct job){a, f, e, ctx, iters, i, touch, 0, 0, {0}};
		pthread_create(&t[i], NULL, run, &jobs[i]);
	}
	int failures = 0;
	*bad = 0;
	for (int i = 0; i < n; i++) {
		pthread_join(t[i], NULL);
		failures += jobs[i].failures;
		*bad += jobs[i].bad;
		if (jobs[i].msg[0]) strncpy(msg, jobs[i].msg, 255);
	}
	free(t); free(jobs);
	return failures;
}

static void *call_alloc(alloc_fn a, size_t size, int device, void *stream, void *ctx) { return a(size, device, stream, ctx); }
static void call_free(free_fn f, void *p, size_t size, int device, void *stream, void *ctx) { f(p, size, device, stream, ctx); }
static const char *call_err(err_fn e) { return e(); }
static void *rmm_cthreads_ptr(unsigned long long p) { return (void *)(size_t)p; }
*/
import "C"

import "unsafe"

// Run calls alloc and free from threads C threads, iters times each, on device 0 and the default
// stream, with sizes of 1..70000 bytes; with touch it writes and reads back the first and last
// byte of each block (host memory only). It returns the failed calls, the blocks whose bytes
// another thread changed, and one failure's message.
func Run(alloc, free, lastErr, ctx unsafe.Pointer, threads, iters int, touch bool) (failures, bad int, msg string) {
	var b C.int
	buf := (*C.char)(C.calloc(256, 1))
	defer C.free(unsafe.Pointer(buf))
	t := C.int(0)
	if touch {
		t = 1
	}
	f := C.run_threads(C.alloc_fn(alloc), C.free_fn(free), C.err_fn(lastErr), ctx, C.int(threads), C.int(iters), t, &b, buf)
	return int(f), int(b), C.GoString(buf)
}

// Alloc calls alloc once from C; the pointer comes back as an address.
func Alloc(alloc, ctx unsafe.Pointer, size uintptr, device int, stream uintptr) uintptr {
	return uintptr(C.call_alloc(C.alloc_fn(alloc), C.size_t(size), C.int(device), ptr(stream), ctx))
}

// Free calls free once from C.
func Free(free, ctx unsafe.Pointer, p uintptr, size uintptr, device int, stream uintptr) {
	C.call_free(C.free_fn(free), ptr(p), C.size_t(size), C.int(device), ptr(stream), ctx)
}

// LastError calls last_error from C, on the calling goroutine's thread; "" when it returns NULL.
func LastError(lastErr unsafe.Pointer) string {
	m := C.call_err(C.err_fn(lastErr))
	if m == nil {
		return ""
	}
	return C.GoString(m)
}

func ptr(p uintptr) unsafe.Pointer { return C.rmm_cthreads_ptr(C.ulonglong(p)) }
