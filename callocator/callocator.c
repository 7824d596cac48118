#include <pthread.h>
#include <stdlib.h>

#include "callocator.h"
#include "_cgo_export.h"

rmm_alloc_fn rmm_callocator_alloc_fn(void) { return (rmm_alloc_fn)rmmCallocatorAlloc; }
rmm_free_fn rmm_callocator_free_fn(void) { return (rmm_free_fn)rmmCallocatorFree; }
rmm_last_error_fn rmm_callocator_last_error_fn(void) { return (rmm_last_error_fn)rmmCallocatorLastError; }
void *rmm_callocator_ptr(unsigned long long p) { return (void *)(size_t)p; }

// Each thread's last error, a string from malloc owned here: thread-local, so that a thread
// never reads the message of an exited thread whose id it was given, and freed when the thread
// exits (the key's destructor) or at the thread's next error.
static pthread_key_t rmm_err_key;
static pthread_once_t rmm_err_once = PTHREAD_ONCE_INIT;
static void rmm_err_init(void) { pthread_key_create(&rmm_err_key, free); }

void rmm_callocator_set_error(char *msg) {
	pthread_once(&rmm_err_once, rmm_err_init);
	char *old = pthread_getspecific(rmm_err_key);
	pthread_setspecific(rmm_err_key, msg);
	free(old);
}

const char *rmm_callocator_get_error(void) {
	pthread_once(&rmm_err_once, rmm_err_init);
	return pthread_getspecific(rmm_err_key);
}
