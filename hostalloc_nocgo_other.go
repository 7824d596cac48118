//go:build !cgo && !unix

package rmm

import (
	"sync"
	"unsafe"
)

// Host memory without cgo or mmap: the Go heap. The slice is kept reachable in hostBlocks until
// hostFree, and Go's collector does not move objects, so the address stays valid.
var (
	hostMu     sync.Mutex
	hostBlocks = map[uintptr][]byte{}
)

func hostMalloc(n int) (p uintptr, ok bool) {
	defer func() {
		if recover() != nil {
			p, ok = 0, false
		}
	}()
	b := make([]byte, n+255)
	base := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	p = (base + 255) &^ 255
	hostMu.Lock()
	hostBlocks[p] = b
	hostMu.Unlock()
	return p, true
}

func hostFree(p uintptr) {
	hostMu.Lock()
	delete(hostBlocks, p)
	hostMu.Unlock()
}
