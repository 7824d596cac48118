//go:build unix

package rmm

import (
	"syscall"

	"github.com/gormm/rmm/internal/cuda"
)

// driverFD runs export, a driver call that opens a new file descriptor, and makes that
// descriptor close-on-exec. The driver opens it without the flag, so a child process started
// meanwhile (os/exec) would inherit an open handle to this process's device memory. Holding
// the read side of syscall.ForkLock, as the os and net packages do for descriptors they cannot
// open close-on-exec at once, keeps every fork out until the flag is set.
func driverFD(export func() (int, cuda.Result)) (int, cuda.Result) {
	syscall.ForkLock.RLock()
	defer syscall.ForkLock.RUnlock()
	fd, r := export()
	if r == 0 && fd >= 0 {
		syscall.CloseOnExec(fd)
	}
	return fd, r
}
