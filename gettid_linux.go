//go:build linux

package rmm

import "syscall"

// osThreadID returns the id of the OS thread running the caller (gettid), as librmm's event log
// records it. The goroutine may move to another thread right after.
func osThreadID() uint64 { return uint64(syscall.Gettid()) }
