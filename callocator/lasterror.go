//go:build cgo

package callocator

/*
#include "callocator.h"
*/
import "C"

import "unsafe"

// The last error of each OS thread is a C string in the thread's own storage (callocator.c): an
// exported function runs on the C thread that called it, so the thread that failed is the one
// that asks. A thread's string lives until its next error or its exit; a new thread starts with
// none, also where it was given the id of a thread that failed and exited.

// SetError records err as the calling OS thread's last error, for exported functions of other
// packages that fail outside Allocate and Deallocate.
func SetError(err error) { setError(err) }

func setError(err error) { C.rmm_callocator_set_error(C.CString(err.Error())) }

// LastError returns, as a C string (const char *), the message of the calling OS thread's last
// failed call, or nil if it has had none. It stays valid until that thread's next failure or its
// exit.
func LastError() unsafe.Pointer { return unsafe.Pointer(C.rmm_callocator_get_error()) }
