//go:build !amd64

package fpwalk

// Callers takes no stack on this architecture: it returns 0 and complete false, so that the
// caller uses runtime.Callers.
func Callers(skip int, pcs []uintptr) (n int, complete bool) { return 0, false }
