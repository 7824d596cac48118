//go:build cgo

// Package callocator hands Go memory resources to C and C++ code running in the same process:
// a pair of C function pointers bound to a resource, for libraries that take an allocator
// callback, and the calls behind cmd/rmm-python, which makes a Go pool the allocator of PyTorch
// (torch.cuda.memory.CUDAPluggableAllocator) and CuPy (cupy.cuda.set_allocator).
//
// The C signatures are (callocator.h in this package's directory declares them as the
// typedefs rmm_alloc_fn, rmm_free_fn and rmm_last_error_fn; C code of another module declares
// its own and casts the unsafe.Pointers Funcs returns)
//
//	void *alloc(size_t size, int device, void *stream, void *ctx);
//	void  free(void *ptr, size_t size, int device, void *stream, void *ctx);
//	const char *last_error(void);
//
// where stream is a CUstream / cudaStream_t (NULL: the legacy default stream) and ctx the value
// Allocator.Funcs returns. alloc returns NULL on failure, and for size 0 without asking the
// resource (as free(NULL) does nothing); the failure's message
// is then what last_error returns on the same C thread, until that thread's next failing call or
// its exit (NULL on a thread that has had no failure).
// free reports a failure only that way. A Go panic never unwinds into C: it becomes the error.
// The functions may be called from any C thread, concurrently.
package callocator

/*
#include <stdlib.h>
#include "callocator.h"
*/
import "C"

import (
	"sync"
	"unsafe"

	rmm "github.com/gormm/rmm"
	"github.com/gormm/rmm/internal/errshape"
)

// Allocator binds a Go memory resource to the C functions.
type Allocator struct {
	mr  rmm.MemoryResource // nil: the device's resource (rmm.PerDeviceResource) at each call
	ctx unsafe.Pointer     // a byte of C memory, never freed: its address names the Allocator
}

var (
	regMu sync.RWMutex
	reg   = map[uintptr]*Allocator{}
)

// New returns an Allocator for mr: what C allocates through it comes from mr and goes back to
// it, and a call naming another device than mr's (rmm.DeviceOf) fails. A nil mr means the
// resource of the device named in each call (rmm.PerDeviceResource), as RMM's allocators for
// other libraries do. Close it when C no longer holds its functions.
func New(mr rmm.MemoryResource) *Allocator {
	// The ctx is a real (C) address, not a counter: Go's collector rejects an unsafe.Pointer
	// that holds a small integer. Never freed (one byte an Allocator), so that no later
	// Allocator can take the address of a closed one.
	a := &Allocator{mr: mr, ctx: C.malloc(1)}
	regMu.Lock()
	defer regMu.Unlock()
	reg[uintptr(a.ctx)] = a
	return a
}

// Funcs returns the C function pointers alloc and free (signatures in the package comment) and
// the ctx value to pass them, which names a. C code calls them as it would malloc and free, with
// the stream the memory is ordered on.
func (a *Allocator) Funcs() (alloc, free, ctx unsafe.Pointer) {
	return unsafe.Pointer(C.rmm_callocator_alloc_fn()), unsafe.Pointer(C.rmm_callocator_free_fn()), a.ctx
}

// LastErrorFunc returns the C function pointer last_error (see the package comment).
func LastErrorFunc() unsafe.Pointer { return unsafe.Pointer(C.rmm_callocator_last_error_fn()) }

// Close unregisters a: later calls with its ctx fail (NULL and an error saying so) instead of
// reaching a resource that may be gone. Memory allocated through it must be freed through the
// resource directly. Closing twice is harmless.
func (a *Allocator) Close() {
	regMu.Lock()
	defer regMu.Unlock()
	delete(reg, uintptr(a.ctx))
}

func lookup(ctx unsafe.Pointer) (*Allocator, error) {
	regMu.RLock()
	a := reg[uintptr(ctx)]
	regMu.RUnlock()
	if a == nil {
		return nil, errshape.Errorf("callocator: ctx %#x names no open Allocator: %w", uintptr(ctx), rmm.ErrInvalidArgument)
	}
	return a, nil
}

//export rmmCallocatorAlloc
func rmmCallocatorAlloc(size C.size_t, device C.int, stream unsafe.Pointer, ctx unsafe.Pointer) unsafe.Pointer {
	a, err := lookup(ctx)
	if err != nil {
		setError(err)
		return nil
	}
	return Allocate(a.mr, uintptr(size), int(device), uintptr(stream))
}

//export rmmCallocatorFree
func rmmCallocatorFree(ptr unsafe.Pointer, size C.size_t, device C.int, stream unsafe.Pointer, ctx unsafe.Pointer) {
	a, err := lookup(ctx)
	if err != nil {
		setError(err)
		return
	}
	Deallocate(a.mr, ptr, uintptr(size), int(device), uintptr(stream))
}

//export rmmCallocatorLastError
func rmmCallocatorLastError() *C.char { return (*C.char)(LastError()) }

// Allocate is alloc's body, for exported functions of other packages (cmd/rmm-python):
// size bytes from mr (nil: device's resource) on the stream whose CUstream handle is stream (0:
// the legacy default stream). It returns nil on failure and records the error for the calling
// OS thread (LastError). A pointer is returned as unsafe.Pointer for C; it is device memory, not
// to be dereferenced by Go.
func Allocate(mr rmm.MemoryResource, size uintptr, device int, stream uintptr) (p unsafe.Pointer) {
	defer func() {
		if r := recover(); r != nil {
			setError(errshape.Errorf("callocator: alloc(%d, device %d, stream %#x) panicked: %v", size, device, stream, r))
			p = nil
		}
	}()
	if size == 0 {
		// As malloc(0) may: NULL, and the resource is not asked, so that a free(NULL) that never
		// comes (PyTorch does not free its empty tensors' NULL) leaves no count behind.
		return nil
	}
	mr, s, err := resolve(mr, device, stream, "alloc")
	if err == nil && size > uintptr(int(^uint(0)>>1)) {
		err = errshape.Errorf("callocator: alloc(%d): the size overflows an int: %w", size, rmm.ErrInvalidArgument)
	}
	if err != nil {
		setError(err)
		return nil
	}
	ptr, err := mr.Allocate(int(size), s)
	if err != nil {
		setError(errshape.Errorf("callocator: alloc(%d, device %d, stream %#x): %w", size, device, stream, err))
		return nil
	}
	return C.rmm_callocator_ptr(C.ulonglong(ptr)) // a device address, for C
}

// Deallocate is free's body (see Allocate): ptr, allocated with size bytes on device, goes back
// to mr (nil: device's resource), ordered on stream. A failure is recorded for LastError.
func Deallocate(mr rmm.MemoryResource, ptr unsafe.Pointer, size uintptr, device int, stream uintptr) {
	defer func() {
		if r := recover(); r != nil {
			setError(errshape.Errorf("callocator: free(%p, %d, device %d, stream %#x) panicked: %v", ptr, size, device, stream, r))
		}
	}()
	if ptr == nil {
		return
	}
	mr, s, err := resolve(mr, device, stream, "free")
	if err != nil {
		setError(err)
		return
	}
	if err := mr.Deallocate(rmm.DevicePtr(uintptr(ptr)), int(size), s); err != nil {
		setError(errshape.Errorf("callocator: free(%p, %d, device %d, stream %#x): %w", ptr, size, device, stream, err))
	}
}

// resolve finds the resource and the stream view of a call.
func resolve(mr rmm.MemoryResource, device int, stream uintptr, op string) (rmm.MemoryResource, rmm.StreamView, error) {
	if device < 0 {
		return nil, rmm.StreamView{}, errshape.Errorf("callocator: %s: device %d: %w", op, device, rmm.ErrInvalidArgument)
	}
	if mr == nil {
		var err error
		if mr, err = rmm.PerDeviceResource(rmm.Device(device)); err != nil {
			return nil, rmm.StreamView{}, errshape.Errorf("callocator: %s: %w", op, err)
		}
	} else if d := rmm.DeviceOf(mr); int(d) != device {
		return nil, rmm.StreamView{}, errshape.Errorf("callocator: %s: device %d, but the Allocator's resource is on %v: %w", op, device, d, rmm.ErrInvalidArgument)
	}
	s, err := rmm.NewStreamView(rmm.Device(device), stream)
	if err != nil {
		return nil, rmm.StreamView{}, errshape.Errorf("callocator: %s: stream %#x on device %d: %w", op, stream, device, err)
	}
	return mr, s, nil
}
