//go:build !linux

package rmm

// osThreadID returns 0: only Linux gives thread ids cheaply.
func osThreadID() uint64 { return 0 }
