#ifndef RMM_CALLOCATOR_H
#define RMM_CALLOCATOR_H
#include <stddef.h>

// The allocator functions a Go memory resource is handed to C code with (see the Go package's
// comment for the contract).
typedef void *(*rmm_alloc_fn)(size_t size, int device, void *stream, void *ctx);
typedef void (*rmm_free_fn)(void *ptr, size_t size, int device, void *stream, void *ctx);
typedef const char *(*rmm_last_error_fn)(void);

rmm_alloc_fn rmm_callocator_alloc_fn(void);
rmm_free_fn rmm_callocator_free_fn(void);
rmm_last_error_fn rmm_callocator_last_error_fn(void);

// rmm_callocator_ptr makes an address a pointer (for Go, which may not turn a uintptr into an
// unsafe.Pointer it did not come from).
void *rmm_callocator_ptr(unsigned long long p);

// The calling thread's last error: set takes msg (from malloc) and frees the one it replaces;
// get returns it, or NULL.
void rmm_callocator_set_error(char *msg);
const char *rmm_callocator_get_error(void);

#endif
