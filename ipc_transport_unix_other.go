//go:build unix && !linux

package rmm

// scmPidfd: no control message of this system carries a pidfd (see ipc_transport_linux.go).
const scmPidfd = -1
