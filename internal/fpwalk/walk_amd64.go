package fpwalk

// Callers is runtime.Callers(skip, pcs) by frame pointers, for skip >= 1 (1 is the caller of
// Callers; 0 counts as 1): it fills pcs with the return PCs of the calling goroutine's frames,
// innermost first, and returns how many it wrote. complete is true when the walk reached the
// goroutine's outermost frame (runtime.goexit's PC is then the last, as with runtime.Callers) or
// filled pcs; false when it stopped at a frame pointer that failed the checks of the package's
// comment, as it does in Go called back from C, and the caller should use runtime.Callers then.
// It takes about a nanosecond a frame and allocates nothing.
//
//go:noescape
func Callers(skip int, pcs []uintptr) (n int, complete bool)

// stackHi returns the top of the running goroutine's stack, as Callers reads it (for tests).
func stackHi() uintptr

// callersFrom is Callers(skip, pcs) started with the frame pointer fp (for tests): frame 1 is
// callersFrom's caller, frame 2 the one whose PC is at 8(fp).
//
//go:noescape
func callersFrom(fp uintptr, skip int, pcs []uintptr) (n int, complete bool)
