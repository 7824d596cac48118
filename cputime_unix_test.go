//go:build unix

package rmm

import (
	"syscall"
	"time"
)

// processCPUTime returns the CPU time (user and system) the process has used so far; ok is false
// where it cannot be read.
func processCPUTime() (d time.Duration, ok bool) {
	var u syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &u) != nil {
		return 0, false
	}
	return time.Duration(u.Utime.Nano() + u.Stime.Nano()), true
}
