#include "callocator.h"
#include "_cgo_export.h"

rmm_alloc_fn rmm_callocator_alloc_fn(void) { return (rmm_alloc_fn)rmmCallocatorAlloc; }
rmm_free_fn rmm_callocator_free_fn(void) { return (rmm_free_fn)rmmCallocatorFree; }
rmm_last_error_fn rmm_callocator_last_error_fn(void) { return (rmm_last_error_fn)rmmCallocatorLastError; }
void *rmm_callocator_ptr(unsigned long long p) { return (void *)(size_t)p; }
