//go:build linux

package rmm

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The IPC tests' second process: this test binary run again, as TestIPCHelperProcess in the
// mode named by ipcHelperEnv, talking to its parent over a Unix socket that is its fd 3.

const ipcHelperEnv = "RMM_IPC_TEST_HELPER"

func TestIPCHelperProcess(t *testing.T) {
	mode := os.Getenv(ipcHelperEnv)
	if mode == "" {
		t.Skip("the child process of the IPC tests; they run it")
	}
	f := os.NewFile(3, "ipc-socket")
	c, err := net.FileConn(f)
	require.NoError(t, err)
	f.Close()
	conn := c.(*net.UnixConn)
	defer conn.Close()
	switch mode {
	case "transport":
		ipcChildTransport(t, conn)
	case "gpu":
		gpuIPCChild(t, conn)
	case "gpu-bench":
		gpuIPCBenchChild(t, conn)
	default:
		t.Fatalf("unknown helper mode %q", mode)
	}
}

// ipcSocketPair returns two connected Unix stream sockets, as *net.UnixConn.
func ipcSocketPair(t testing.TB) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	a, b := ipcSocketPairFiles(t)
	ca, cb := fileUnixConn(t, a), fileUnixConn(t, b)
	return ca, cb
}

func ipcSocketPairFiles(t testing.TB) (*os.File, *os.File) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	return os.NewFile(uintptr(fds[0]), "ipc-a"), os.NewFile(uintptr(fds[1]), "ipc-b")
}

// fileUnixConn turns f into a *net.UnixConn (which holds its own descriptor) and closes f.
func fileUnixConn(t testing.TB, f *os.File) *net.UnixConn {
	t.Helper()
	c, err := net.FileConn(f)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	t.Cleanup(func() { c.Close() })
	return c.(*net.UnixConn)
}

// startIPCHelper starts the child process in mode with the other end of a socket as its fd 3.
// wait waits for it to exit and fails the test with its output if it did not pass.
func startIPCHelper(t testing.TB, mode string) (conn *net.UnixConn, wait func()) {
	t.Helper()
	mine, theirs := ipcSocketPairFiles(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestIPCHelperProcess$", "-test.count=1", "-test.v", "-test.timeout=120s")
	cmd.Env = append(os.Environ(), ipcHelperEnv+"="+mode)
	cmd.ExtraFiles = []*os.File{theirs}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	theirs.Close()
	conn = fileUnixConn(t, mine)
	done := false
	wait = func() {
		if done {
			return
		}
		done = true
		err := cmd.Wait()
		if err != nil || bytes.Contains(out.Bytes(), []byte("--- FAIL")) {
			t.Fatalf("the child process (%s) failed: %v\n%s", mode, err, out.String())
		}
		if testing.Verbose() {
			t.Logf("child process (%s):\n%s", mode, out.String())
		}
	}
	t.Cleanup(func() {
		if !done {
			cmd.Process.Kill()
			cmd.Wait()
			if t.Failed() {
				t.Logf("child process (%s) output:\n%s", mode, out.String())
			}
		}
	})
	return conn, wait
}

// sendIPCText and recvIPCText exchange short text messages between the two processes, on the
// same connection as the handles (the protocol fixes which comes when).
func sendIPCText(conn *net.UnixConn, s string) error {
	b := binary.LittleEndian.AppendUint32(nil, uint32(len(s)))
	_, err := conn.Write(append(b, s...))
	return err
}

func recvIPCText(conn *net.UnixConn) (string, error) {
	conn.SetReadDeadline(time.Now().Add(90 * time.Second))
	defer conn.SetReadDeadline(time.Time{})
	var hdr [4]byte
	if _, err := io.ReadFull(conn, hdr[:]); err != nil {
		return "", err
	}
	b := make([]byte, binary.LittleEndian.Uint32(hdr[:]))
	if _, err := io.ReadFull(conn, b); err != nil {
		return "", err
	}
	return string(b), nil
}

// countFDs returns the number of open descriptors of this process.
func countFDs(t testing.TB) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(es)
}

// memfdWith returns a memfd holding n bytes of pattern(i).
func memfdWith(t testing.TB, n int, pattern func(i int) byte) int {
	t.Helper()
	fd, err := unix.MemfdCreate("rmm-ipc-test", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	b := make([]byte, n)
	for i := range b {
		b[i] = pattern(i)
	}
	w, err := unix.Pwrite(fd, b, 0)
	require.NoError(t, err)
	require.Equal(t, n, w)
	return fd
}

// checkFD checks that fd holds n bytes of pattern(i).
func checkFD(fd, n int, pattern func(i int) byte) error {
	b := make([]byte, n+1)
	r, err := unix.Pread(fd, b, 0)
	if err != nil {
		return err
	}
	if r != n {
		return fmt.Errorf("descriptor %d holds %d bytes, want %d", fd, r, n)
	}
	for i := range n {
		if b[i] != pattern(i) {
			return fmt.Errorf("descriptor %d: byte %d is %#x, want %#x", fd, i, b[i], pattern(i))
		}
	}
	return nil
}

// piecePattern is the content of piece k of a test handle.
func piecePattern(k int) func(i int) byte {
	return func(i int) byte { return byte(k*31 + i*7 + i>>8) }
}

// memfdHandle returns a handle of kind IPCKindVirtualMemory over len(sizes) memfds, piece k
// holding sizes[k] bytes of piecePattern(k).
func memfdHandle(t testing.TB, sizes []int) *IPCHandle {
	t.Helper()
	h := &IPCHandle{kind: IPCKindVirtualMemory, dev: 0, uuid: [16]byte{7, 7, 7}, pieces: sizes, nfds: len(sizes)}
	for k, n := range sizes {
		h.fds = append(h.fds, memfdWith(t, n, piecePattern(k)))
		h.size += n
	}
	return h
}

// checkMemfdHandle checks a received memfdHandle.
func checkMemfdHandle(h *IPCHandle, sizes []int) error {
	if h.Kind() != IPCKindVirtualMemory || h.NumFDs() != len(sizes) || len(h.FDs()) != len(sizes) {
		return fmt.Errorf("received %v, want %d pieces", h, len(sizes))
	}
	for k, fd := range h.FDs() {
		if err := checkFD(fd, sizes[k], piecePattern(k)); err != nil {
			return fmt.Errorf("piece %d: %w", k, err)
		}
	}
	return nil
}
