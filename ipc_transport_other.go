//go:build !unix

package rmm

import (
	"net"
)

// SendIPCHandle is not supported on this system: the driver exports memory as POSIX file
// descriptors, which travel over Unix domain sockets (SCM_RIGHTS) only on Unix systems.
func SendIPCHandle(conn *net.UnixConn, h *IPCHandle) error {
	return errorf("SendIPCHandle: passing file descriptors needs a Unix system: %w", ErrNotSupported)
}

// ReceiveIPCHandle is not supported on this system (see [SendIPCHandle]).
func ReceiveIPCHandle(conn *net.UnixConn) (*IPCHandle, error) {
	return nil, errorf("ReceiveIPCHandle: passing file descriptors needs a Unix system: %w", ErrNotSupported)
}

// closeFDs has nothing to close: no descriptor is ever received here.
func closeFDs([]int) error { return nil }
