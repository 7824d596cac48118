//go:build linux

package rmm

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The transport of handles and their descriptors between two real processes, over host-memory
// descriptors (memfd), and its error paths, which must close every descriptor they received.

var (
	ipcTestSmall = []int{4096, 1 << 20, 12345}
	ipcTestMany  = func() []int { // more than one SCM_RIGHTS message holds
		s := make([]int, 2*ipcFDBatch+17)
		for i := range s {
			s[i] = 64 + i
		}
		return s
	}()
	ipcTestReply = []int{65536}
)

func TestIPCTransportTwoProcesses(t *testing.T) {
	conn, wait := startIPCHelper(t, "transport")
	for _, sizes := range [][]int{ipcTestSmall, ipcTestMany} {
		h := memfdHandle(t, sizes)
		require.NoError(t, SendIPCHandle(conn, h))
		require.NoError(t, h.Close(), "the sender closes its descriptors once sent")
	}
	// The child checked both, and replies with a descriptor of its own.
	r, err := ReceiveIPCHandle(conn)
	require.NoError(t, err)
	require.NoError(t, checkMemfdHandle(r, ipcTestReply))
	require.NoError(t, r.Close())
	msg, err := recvIPCText(conn)
	require.NoError(t, err)
	require.Equal(t, "ok", msg)
	wait()
}

func ipcChildTransport(t *testing.T, conn *net.UnixConn) {
	before := countFDs(t)
	for _, sizes := range [][]int{ipcTestSmall, ipcTestMany} {
		h, err := ReceiveIPCHandle(conn)
		require.NoError(t, err)
		require.NoError(t, checkMemfdHandle(h, sizes))
		require.NoError(t, h.Close())
		require.NoError(t, h.Close(), "closing twice")
	}
	require.Equal(t, before, countFDs(t), "every received descriptor was closed")
	r := memfdHandle(t, ipcTestReply)
	require.NoError(t, SendIPCHandle(conn, r))
	require.NoError(t, r.Close())
	require.NoError(t, sendIPCText(conn, "ok"))
}

func TestIPCTransportClosedConnection(t *testing.T) {
	a, b := ipcSocketPair(t)
	require.NoError(t, b.Close())
	_, err := ReceiveIPCHandle(a)
	require.ErrorIs(t, err, io.EOF)
	require.ErrorContains(t, err, "closed before a handle arrived")

	h := memfdHandle(t, []int{100})
	defer h.Close()
	err = SendIPCHandle(a, h)
	require.Error(t, err, "the peer is gone")
	require.True(t, errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET), "%v", err)
	require.NoError(t, a.Close())
	err = SendIPCHandle(a, h)
	require.ErrorIs(t, err, net.ErrClosed)
	_, err = ReceiveIPCHandle(a)
	require.ErrorIs(t, err, net.ErrClosed)

	require.ErrorIs(t, SendIPCHandle(nil, h), ErrInvalidArgument)
	_, err = ReceiveIPCHandle(nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, SendIPCHandle(a, nil), ErrInvalidArgument)
	decoded := *testIPCHandles()["mempool"]
	require.ErrorIs(t, SendIPCHandle(a, &decoded), ErrInvalidIPCHandle, "descriptors not attached")
}

// Every error path of ReceiveIPCHandle closes what it received: the count of open descriptors
// is the same before and after.
func TestIPCTransportNoFDLeaks(t *testing.T) {
	a, b := ipcSocketPair(t)
	valid := func(nfds int) []byte {
		h := &IPCHandle{kind: IPCKindVirtualMemory, size: 1, nfds: nfds}
		for range nfds {
			h.pieces = append(h.pieces, 2<<20)
		}
		p, err := h.MarshalBinary()
		require.NoError(t, err)
		return p
	}
	cases := []struct {
		name    string
		payload []byte
		nfds    int
		want    error
		wantMsg string
	}{
		{"corrupt payload", func() []byte { p := valid(2); p[40] ^= 1; return p }(), 2, ErrInvalidIPCHandle, "checksum"},
		{"not a handle", []byte("not a handle at all, but long enough to be read whole by the receiver........................................................"), 3, ErrInvalidIPCHandle, "magic"},
		{"fewer descriptors than the handle says", valid(2), 1, ErrInvalidIPCHandle, "arrived with 1 file descriptors"},
		{"more descriptors than the handle says", valid(1), 3, ErrInvalidIPCHandle, "arrived with 3 file descriptors"},
		{"descriptors with no handle", valid(0)[:0], 2, ErrInvalidIPCHandle, "truncated"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := countFDs(t)
			fds := make([]int, c.nfds)
			for i := range fds {
				fds[i] = memfdWith(t, 10, piecePattern(i))
			}
			require.NoError(t, writeIPCFrame(b, c.payload, fds))
			require.NoError(t, closeFDs(fds))
			_, err := ReceiveIPCHandle(a)
			require.ErrorIs(t, err, c.want)
			require.ErrorContains(t, err, c.wantMsg)
			require.Equal(t, before, countFDs(t), "descriptors leaked")
		})
	}

	t.Run("frame too large", func(t *testing.T) {
		before := countFDs(t)
		fd := memfdWith(t, 10, piecePattern(0))
		hdr := binary.LittleEndian.AppendUint32(nil, ipcFrameMaxBytes+1)
		require.NoError(t, writeMsg(b, hdr, []int{fd}))
		require.NoError(t, closeFDs([]int{fd}))
		_, err := ReceiveIPCHandle(a)
		require.ErrorIs(t, err, ErrInvalidIPCHandle)
		require.ErrorContains(t, err, "does not speak this protocol")
		require.Equal(t, before, countFDs(t))
	})

	t.Run("round trip", func(t *testing.T) {
		before := countFDs(t)
		h := memfdHandle(t, ipcTestMany)
		done := make(chan error, 1)
		go func() { done <- SendIPCHandle(b, h) }() // larger than the socket's buffer may hold
		r, err := ReceiveIPCHandle(a)
		require.NoError(t, err)
		require.NoError(t, <-done)
		require.NoError(t, checkMemfdHandle(r, ipcTestMany))
		require.NoError(t, h.Close())
		require.NoError(t, r.Close())
		require.Equal(t, before, countFDs(t))
	})

	// Last: the peer goes away in the middle of a frame, after its descriptors were sent.
	t.Run("closed mid-frame", func(t *testing.T) {
		before := countFDs(t)
		fds := []int{memfdWith(t, 10, piecePattern(0)), memfdWith(t, 10, piecePattern(1))}
		p := valid(2)
		frame := binary.LittleEndian.AppendUint32(nil, uint32(len(p)))
		require.NoError(t, writeMsg(b, append(frame, p[:50]...), fds))
		require.NoError(t, closeFDs(fds))
		require.NoError(t, b.Close())
		_, err := ReceiveIPCHandle(a)
		require.ErrorIs(t, err, io.ErrUnexpectedEOF)
		require.ErrorContains(t, err, "54 bytes into a handle")
		require.Equal(t, before-1, countFDs(t), "only the closed socket less")
	})
}

// Goroutines sending on one connection at once each get their frame through whole: a frame is
// several writes (a handle of more than ipcFDBatch descriptors always; a large one whenever the
// socket's buffer takes part of it), which must not interleave with another sender's. Likewise
// goroutines receiving on one connection at once each read one whole frame.
func TestIPCTransportConcurrentSendersAndReceivers(t *testing.T) {
	a, b := ipcSocketPair(t)
	before := countFDs(t)
	const senders, receivers, each = 6, 3, 12
	sizes := make([]int, ipcFDBatch+40) // two messages per frame
	for i := range sizes {
		sizes[i] = 16 + i
	}
	handles := make([]*IPCHandle, senders)
	for i := range handles {
		handles[i] = memfdHandle(t, sizes)
	}
	var wg sync.WaitGroup
	sendErrs := make(chan error, senders*each)
	for i := range senders {
		wg.Go(func() {
			for range each {
				sendErrs <- SendIPCHandle(b, handles[i])
			}
		})
	}
	recvErrs := make(chan error, senders*each)
	var rwg sync.WaitGroup
	for r := range receivers {
		rwg.Go(func() {
			for k := r; k < senders*each; k += receivers {
				h, err := ReceiveIPCHandle(a)
				if err == nil {
					err = checkMemfdHandle(h, sizes)
					h.Close()
				}
				recvErrs <- err
				if err != nil {
					a.Close() // unblock the others
					b.Close()
					return
				}
			}
		})
	}
	wg.Wait()
	rwg.Wait()
	close(sendErrs)
	close(recvErrs)
	for err := range recvErrs {
		require.NoError(t, err)
	}
	for err := range sendErrs {
		require.NoError(t, err)
	}
	for _, h := range handles {
		require.NoError(t, h.Close())
	}
	require.Equal(t, before, countFDs(t))
	ipcConnLocks.mu.Lock()
	left := len(ipcConnLocks.m)
	ipcConnLocks.mu.Unlock()
	require.Zero(t, left, "the connections' locks are dropped once unused")
}

// A datagram or sequenced-packet socket is refused at both ends: there a read takes one message
// and drops the rest of it, so the receiver lost the frame and waited for the rest forever.
func TestIPCTransportNotAStreamSocket(t *testing.T) {
	for _, c := range []struct {
		typ  int
		name string
	}{{syscall.SOCK_SEQPACKET, "unixpacket"}, {syscall.SOCK_DGRAM, "unixgram"}} {
		t.Run(c.name, func(t *testing.T) {
			fds, err := syscall.Socketpair(syscall.AF_UNIX, c.typ|syscall.SOCK_CLOEXEC, 0)
			require.NoError(t, err)
			a := fileUnixConn(t, os.NewFile(uintptr(fds[0]), "a"))
			b := fileUnixConn(t, os.NewFile(uintptr(fds[1]), "b"))
			before := countFDs(t)
			h := memfdHandle(t, []int{10, 20})
			err = SendIPCHandle(b, h)
			require.ErrorIs(t, err, ErrInvalidArgument)
			require.ErrorContains(t, err, "SendIPCHandle: the connection is a")
			require.ErrorContains(t, err, c.name)
			require.NoError(t, h.Close())
			// Even with a frame waiting, the receiver refuses at once (the deadline only bounds
			// the test should it not).
			require.NoError(t, writeIPCFrame(b, mustMarshal(t, testIPCHandles()["legacy"]), nil))
			require.NoError(t, a.SetReadDeadline(time.Now().Add(5*time.Second)))
			_, err = ReceiveIPCHandle(a)
			require.ErrorIs(t, err, ErrInvalidArgument)
			require.ErrorContains(t, err, "ReceiveIPCHandle: the connection is a")
			require.Equal(t, before, countFDs(t))
		})
	}
}

// Options of the receiving socket that add control messages to every read: with SO_PASSCRED the
// credentials took the room of the last descriptors of a full batch, which were lost; with
// SO_PASSPIDFD each read brought a pidfd of the sender that nothing closed.
func TestIPCTransportReceiverSocketOptions(t *testing.T) {
	for _, o := range []struct {
		name string
		opt  int
	}{{"SO_PASSCRED", syscall.SO_PASSCRED}, {"SO_PASSPIDFD", unix.SO_PASSPIDFD}, {"SO_PASSSEC", unix.SO_PASSSEC}} {
		t.Run(o.name, func(t *testing.T) {
			a, b := ipcSocketPair(t)
			rc, err := a.SyscallConn()
			require.NoError(t, err)
			var serr error
			require.NoError(t, rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, o.opt, 1) }))
			if serr != nil {
				t.Skipf("%s: %v", o.name, serr)
			}
			before := countFDs(t)
			for _, sizes := range [][]int{ipcTestSmall, ipcTestMany} {
				h := memfdHandle(t, sizes)
				done := make(chan error, 1)
				go func() { done <- SendIPCHandle(b, h) }()
				r, err := ReceiveIPCHandle(a)
				require.NoError(t, <-done)
				require.NoError(t, h.Close())
				require.NoError(t, err)
				require.NoError(t, checkMemfdHandle(r, sizes))
				require.NoError(t, r.Close())
			}
			// An error path too: a frame too large, after its descriptor.
			fd := memfdWith(t, 10, piecePattern(0))
			require.NoError(t, writeMsg(b, binary.LittleEndian.AppendUint32(nil, ipcFrameMaxBytes+1), []int{fd}))
			require.NoError(t, closeFDs([]int{fd}))
			_, err = ReceiveIPCHandle(a)
			require.ErrorIs(t, err, ErrInvalidIPCHandle)
			require.Equal(t, before, countFDs(t), "descriptors leaked")
		})
	}
}
