//go:build !linux

package callocator

// Without gettid every thread shares one last error.
func threadID() int { return 0 }
