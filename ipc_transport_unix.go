//go:build unix

package rmm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
)

// The frame SendIPCHandle writes on a stream socket: the encoded handle's length (uint32,
// little-endian) and the encoded handle, in one sendmsg that carries the first ipcFDBatch
// descriptors (SCM_RIGHTS); then, while descriptors remain, one byte per further batch of up to
// ipcFDBatch descriptors (Linux passes at most 253 descriptors in one message). The receiver
// learns the number of descriptors from the decoded handle, so it reads exactly the frame and
// nothing of what follows it on the connection.
const (
	ipcFDBatch       = 250
	ipcFrameMaxBytes = 1 << 24 // far above the largest handle (ipcMaxPieces pieces)
	// ipcOOBExtra is the room for the control messages that options of the receiving socket add
	// to every read, besides the descriptors: the sender's credentials (SO_PASSCRED), a pidfd
	// (SO_PASSPIDFD), a security label (SO_PASSSEC).
	ipcOOBExtra = 512
)

// SendIPCHandle writes h, with its file descriptors, to conn (a Unix domain stream socket; a
// datagram or sequenced-packet one is [ErrInvalidArgument]), for [ReceiveIPCHandle] at the other
// end. h keeps its descriptors (the receiver gets its own copies): Close it once sent.
// Goroutines may send on one conn at once: each frame goes out whole, after or before the
// others. A handle whose descriptors are not attached is [ErrInvalidIPCHandle]; a closed or broken
// connection gives the system's error (errors.Is with net.ErrClosed or syscall.EPIPE), and the
// connection should then be dropped, as part of a frame may have been written.
func SendIPCHandle(conn *net.UnixConn, h *IPCHandle) error {
	if conn == nil {
		return errorf("SendIPCHandle: nil connection: %w", ErrInvalidArgument)
	}
	if h == nil {
		return errorf("SendIPCHandle: nil handle: %w", ErrInvalidArgument)
	}
	if !h.attached() {
		return errorf("SendIPCHandle: %v: its %d file descriptors are not attached: %w", h, h.nfds, ErrInvalidIPCHandle)
	}
	if err := checkStreamSocket("SendIPCHandle", conn); err != nil {
		return err
	}
	payload, err := h.MarshalBinary()
	if err != nil {
		return errorf("SendIPCHandle: %w", err)
	}
	defer lockIPCConn(conn, false)()
	if err := writeIPCFrame(conn, payload, h.fds); err != nil {
		return errorf("SendIPCHandle(%v): %w", h.kind, err)
	}
	return nil
}

// writeIPCFrame writes one frame: payload with fds (see ipcFDBatch).
func writeIPCFrame(conn *net.UnixConn, payload []byte, fds []int) error {
	frame := binary.LittleEndian.AppendUint32(make([]byte, 0, 4+len(payload)), uint32(len(payload)))
	frame = append(frame, payload...)
	first := fds[:min(len(fds), ipcFDBatch)]
	if err := writeMsg(conn, frame, first); err != nil {
		return err
	}
	for rest := fds[len(first):]; len(rest) > 0; {
		k := min(len(rest), ipcFDBatch)
		if err := writeMsg(conn, []byte{0}, rest[:k]); err != nil {
			return err
		}
		rest = rest[k:]
	}
	return nil
}

// writeMsg writes b with fds attached to its first byte, then whatever of b the first write
// left (a stream socket may take part of it).
func writeMsg(conn *net.UnixConn, b []byte, fds []int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = syscall.UnixRights(fds...)
	}
	n, _, err := conn.WriteMsgUnix(b, oob, nil)
	if err != nil {
		return err
	}
	if n < len(b) {
		_, err = conn.Write(b[n:])
	}
	return err
}

// ReceiveIPCHandle reads one handle that [SendIPCHandle] wrote on the other end of conn (a Unix
// domain stream socket; another kind is [ErrInvalidArgument]), with its file descriptors (owned by the returned handle: Close it after
// importing). On every error the descriptors received so far are closed. A connection closed before a handle arrives gives an
// error wrapping io.EOF, one closed in the middle io.ErrUnexpectedEOF; bytes that are not a valid
// handle, descriptors lost in transit (too many for the receive buffer) or a count that differs
// from the handle's give [ErrInvalidIPCHandle]. After an error the connection's position in the
// stream is unknown: drop it. Goroutines may receive on one conn at once: each reads one whole
// frame.
func ReceiveIPCHandle(conn *net.UnixConn) (*IPCHandle, error) {
	if conn == nil {
		return nil, errorf("ReceiveIPCHandle: nil connection: %w", ErrInvalidArgument)
	}
	if err := checkStreamSocket("ReceiveIPCHandle", conn); err != nil {
		return nil, err
	}
	r := ipcReader{conn: conn}
	unlock := lockIPCConn(conn, true)
	h, err := r.receive()
	unlock()
	if err != nil {
		if cerr := closeFDs(r.fds); cerr != nil {
			err = errors.Join(err, errorf("closing the received descriptors: %w", cerr))
		}
		return nil, errorf("ReceiveIPCHandle: %w", err)
	}
	return h, nil
}

// checkStreamSocket returns an error wrapping ErrInvalidArgument when conn is not a stream socket:
// on a datagram or sequenced-packet socket each read takes one message and drops what of it does
// not fit, so the receiver would lose the frame and wait for the rest of it forever. When the
// socket's type cannot be read (a closed connection) it returns nil, and the call's first read or
// write reports the error.
func checkStreamSocket(op string, conn *net.UnixConn) error {
	rc, err := conn.SyscallConn()
	if err != nil {
		return nil
	}
	typ, gerr := syscall.SOCK_STREAM, error(nil)
	if err := rc.Control(func(fd uintptr) {
		typ, gerr = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_TYPE)
	}); err != nil || gerr != nil || typ == syscall.SOCK_STREAM {
		return nil
	}
	kind := fmt.Sprintf("type %d", typ)
	switch typ {
	case syscall.SOCK_DGRAM:
		kind = "datagram (unixgram)"
	case syscall.SOCK_SEQPACKET:
		kind = "sequenced-packet (unixpacket)"
	}
	return errorf("%s: the connection is a %s socket; handles travel on Unix domain stream sockets (network \"unix\"): %w", op, kind, ErrInvalidArgument)
}

// ipcConnLocks serialises the frames on a connection, one lock for its senders and one for its
// receivers: a frame takes several writes (a further message per ipcFDBatch descriptors, and the
// rest of a frame the socket's buffer did not take at once) and several reads, which must not
// interleave with another goroutine's. A lock lives while a call holds or waits for it.
var ipcConnLocks = struct {
	mu sync.Mutex
	m  map[ipcConnKey]*ipcConnLock
}{m: map[ipcConnKey]*ipcConnLock{}}

type ipcConnKey struct {
	conn *net.UnixConn
	recv bool
}

type ipcConnLock struct {
	mu   sync.Mutex
	refs int // calls holding or waiting for mu
}

// lockIPCConn takes the lock of conn's senders (recv false) or receivers and returns its unlock.
func lockIPCConn(conn *net.UnixConn, recv bool) (unlock func()) {
	key := ipcConnKey{conn, recv}
	ipcConnLocks.mu.Lock()
	l := ipcConnLocks.m[key]
	if l == nil {
		l = &ipcConnLock{}
		ipcConnLocks.m[key] = l
	}
	l.refs++
	ipcConnLocks.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		ipcConnLocks.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(ipcConnLocks.m, key)
		}
		ipcConnLocks.mu.Unlock()
	}
}

type ipcReader struct {
	conn *net.UnixConn
	fds  []int // received so far
	oob  []byte
	got  int // bytes of the frame read so far
}

func (r *ipcReader) receive() (*IPCHandle, error) {
	r.oob = make([]byte, syscall.CmsgSpace(4*(ipcFDBatch+3))+ipcOOBExtra)
	var hdr [4]byte
	if err := r.readFull(hdr[:]); err != nil {
		return nil, err
	}
	n := binary.LittleEndian.Uint32(hdr[:])
	if n > ipcFrameMaxBytes {
		return nil, errorf("a frame of %d bytes (at most %d): the peer does not speak this protocol: %w", n, ipcFrameMaxBytes, ErrInvalidIPCHandle)
	}
	payload := make([]byte, n)
	if err := r.readFull(payload); err != nil {
		return nil, err
	}
	h, err := decodeIPCHandle(payload)
	if err != nil {
		return nil, err
	}
	for extra := max(0, h.nfds-ipcFDBatch); extra > 0; extra -= min(extra, ipcFDBatch) {
		var one [1]byte
		if err := r.readFull(one[:]); err != nil {
			return nil, err
		}
	}
	if len(r.fds) != h.nfds {
		return nil, errorf("%v arrived with %d file descriptors: %w", h, len(r.fds), ErrInvalidIPCHandle)
	}
	if h.nfds > 0 {
		h.fds, r.fds = r.fds, nil
	}
	return h, nil
}

// readFull fills b from the connection, collecting the descriptors that come with it.
func (r *ipcReader) readFull(b []byte) error {
	for done := 0; done < len(b); {
		n, oobn, flags, _, err := r.conn.ReadMsgUnix(b[done:], r.oob)
		if oobn > 0 {
			if perr := r.parseRights(r.oob[:oobn]); perr != nil && err == nil {
				err = perr
			}
		}
		if flags&syscall.MSG_CTRUNC != 0 && err == nil {
			err = errorf("file descriptors were lost in transit (the control data of one message did not fit in %s: more than %d descriptors, or other control messages): %w", bytesText(len(r.oob)), ipcFDBatch, ErrInvalidIPCHandle)
		}
		done += n
		r.got += n
		if err != nil && !errors.Is(err, io.EOF) {
			return err
		}
		if err != nil || (n == 0 && oobn == 0) {
			// End of stream (a read of nothing, which the net package reports as io.EOF).
			if r.got == 0 {
				return errorf("the connection was closed before a handle arrived: %w", io.EOF)
			}
			return errorf("the connection was closed %s into a handle: %w", bytesText(r.got), io.ErrUnexpectedEOF)
		}
	}
	return nil
}

// parseRights takes the descriptors out of the control messages in oob. A pidfd of the sender
// (SO_PASSPIDFD on the receiving socket) is closed at once: the handle has no use for it.
func (r *ipcReader) parseRights(oob []byte) error {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return errorf("unreadable control message: %w: %w", err, ErrInvalidIPCHandle)
	}
	for _, m := range msgs {
		if m.Header.Level != syscall.SOL_SOCKET || (m.Header.Type != syscall.SCM_RIGHTS && m.Header.Type != scmPidfd) {
			continue
		}
		fds := make([]int, len(m.Data)/4) // SCM_RIGHTS and SCM_PIDFD both carry C ints
		for i := range fds {
			fds[i] = int(int32(binary.NativeEndian.Uint32(m.Data[4*i:])))
		}
		if m.Header.Type == scmPidfd {
			closeFDs(fds) // just received: closing cannot fail but for a kernel bug
			continue
		}
		r.fds = append(r.fds, fds...)
	}
	return nil
}

// closeFDs closes every descriptor and returns the errors joined.
func closeFDs(fds []int) error {
	var errs []error
	for _, fd := range fds {
		if fd < 0 {
			continue
		}
		if err := syscall.Close(fd); err != nil {
			errs = append(errs, errorf("close(%d): %w", fd, err))
		}
	}
	return errors.Join(errs...)
}
