//go:build cgo

package rmm

import "github.com/gormm/rmm/internal/cuda"

// hostMalloc returns n bytes of 256-byte-aligned C heap memory (posix_memalign).
func hostMalloc(n int) (uintptr, bool) { return cuda.HostMalloc(n) }

func hostFree(p uintptr) { cuda.HostFree(p) }
