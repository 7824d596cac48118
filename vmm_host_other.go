//go:build !linux

package rmm

// Host virtual memory management needs mmap, mprotect and madvise with Linux's semantics;
// elsewhere newHostVMM returns ErrNotSupported and these are never reached.

const hostVMMSupported = false

func hostVMMOSReserve(size, align int) (uintptr, []byte, error) { return 0, nil, ErrNotSupported }
func hostVMMOSFree([]byte) error                                { return ErrNotSupported }
func hostVMMOSProtect(uintptr, int, bool) error                 { return ErrNotSupported }
func hostVMMOSDrop(uintptr, int) error                          { return ErrNotSupported }
func hostVMMOSMemfd(int) (int, error)                           { return -1, ErrNotSupported }
func hostVMMOSMapShared(uintptr, int, int) error                { return ErrNotSupported }
func hostVMMOSPlaceholder(uintptr, int) error                   { return ErrNotSupported }
func hostVMMOSClose(int) error                                  { return ErrNotSupported }

func hostDescriptorBudget() int { return 0 }
