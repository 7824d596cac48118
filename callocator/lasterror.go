//go:build cgo

package callocator

/*
#include <stdlib.h>
*/
import "C"

import (
	"sync"
	"unsafe"
)

// The last error of each OS thread, as C strings: an exported function runs on the C thread that
// called it, so the thread id names the caller. A thread's string lives until its next error.
var (
	errMu   sync.Mutex
	lastErr = map[int]*C.char{}
)

// SetError records err as the calling OS thread's last error, for exported functions of other
// packages that fail outside Allocate and Deallocate.
func SetError(err error) { setError(err) }

func setError(err error) {
	msg := C.CString(err.Error())
	tid := threadID()
	errMu.Lock()
	old := lastErr[tid]
	lastErr[tid] = msg
	errMu.Unlock()
	if old != nil {
		C.free(unsafe.Pointer(old))
	}
}

// LastError returns, as a C string (const char *), the message of the calling OS thread's last
// failed call, or nil if it has had none. It stays valid until that thread's next failure.
func LastError() unsafe.Pointer {
	tid := threadID()
	errMu.Lock()
	defer errMu.Unlock()
	return unsafe.Pointer(lastErr[tid])
}
