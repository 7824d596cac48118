//go:build linux

package rmm

// scmPidfd is SCM_PIDFD (Linux 6.5): a pidfd of the sender, which a socket with SO_PASSPIDFD
// receives with every message.
const scmPidfd = 4
