//go:build !unix

package rmm

import "github.com/gormm/rmm/internal/cuda"

// driverFD runs export: POSIX file descriptors, and so their inheritance, exist only on Unix
// systems, where the driver's descriptors are made close-on-exec (ipc_cloexec_unix.go).
func driverFD(export func() (int, cuda.Result)) (int, cuda.Result) { return export() }
