//go:build !unix

package rmm

import "time"

// processCPUTime returns the CPU time the process has used so far; ok is false: it is not read
// on this system.
func processCPUTime() (d time.Duration, ok bool) { return 0, false }
