//go:build !cgo && unix

package rmm

import (
	"sync"
	"syscall"
	"unsafe"
)

// Host memory without cgo: anonymous private mappings (page-aligned, so 256-aligned). A refused
// mapping is an error (ENOMEM), not a fatal runtime out-of-memory as a huge Go allocation would be.
var (
	hostMu     sync.Mutex
	hostBlocks = map[uintptr][]byte{}
)

func hostMalloc(n int) (uintptr, bool) {
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return 0, false
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	hostMu.Lock()
	hostBlocks[p] = b
	hostMu.Unlock()
	return p, true
}

func hostFree(p uintptr) {
	hostMu.Lock()
	b := hostBlocks[p]
	delete(hostBlocks, p)
	hostMu.Unlock()
	if b != nil {
		syscall.Munmap(b)
	}
}
