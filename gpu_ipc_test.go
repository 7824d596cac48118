//go:build linux

package rmm

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Sharing device memory with a second process, for each resource that can export. The machine
// may refuse a mechanism (a sandboxed VM, a container without the right namespaces): each case
// first makes its resource and exports, and a refusal by the driver is logged and skips that
// case only; the child process reports a refused import the same way.

const (
	gpuIPCElems   = 256 << 20 / 8 // a 256 MiB Uvector[uint64]
	gpuIPCSegment = 8192          // elements per fill segment (64 KiB)
)

type gpuIPCCase struct {
	name string
	// make returns the resource, closed by a clean-up of tb; some allocate from it first, so
	// that the exported vector does not start its upstream allocation or lies in two pieces.
	make func(tb testing.TB) (MemoryResource, error)
}

func gpuIPCCases() []gpuIPCCase {
	return []gpuIPCCase{
		{"async", func(tb testing.TB) (MemoryResource, error) {
			r, err := NewCudaAsyncMemoryResource(0, &CudaAsyncOptions{EnablePOSIXFileDescriptor: true})
			if err == nil {
				tb.Cleanup(func() { r.Close() })
			}
			return r, err
		}},
		{"expandable", func(tb testing.TB) (MemoryResource, error) {
			cuda, err := NewCudaMemoryResource(0)
			if err != nil {
				return nil, err
			}
			p, err := NewPoolMemoryResource(cuda, &PoolOptions{Expandable: true, Exportable: true, MaximumPoolSize: 4 << 30})
			if err != nil {
				return nil, err
			}
			tb.Cleanup(func() { p.Close() })
			// A free block of 100 MiB at the end: the vector's growth extends it, so the vector
			// lies in two pieces of physical memory.
			x, err := p.Allocate(100<<20, DefaultStream)
			if err == nil {
				err = p.Deallocate(x, 100<<20, DefaultStream)
			}
			return p, err
		}},
		{"cuda", func(tb testing.TB) (MemoryResource, error) {
			return NewCudaMemoryResource(0)
		}},
		{"pool", func(tb testing.TB) (MemoryResource, error) {
			cuda, err := NewCudaMemoryResource(0)
			if err != nil {
				return nil, err
			}
			p, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: 512 << 20})
			if err != nil {
				return nil, err
			}
			tb.Cleanup(func() { p.Close() })
			// 1 MiB kept live first: the vector starts 1 MiB into the upstream allocation.
			_, err = p.Allocate(1<<20, DefaultStream)
			return p, err
		}},
	}
}

// isIPCRefusal reports whether err is the driver or device refusing a mechanism (rather than a
// mistake of ours): ErrNotSupported or any driver error.
func isIPCRefusal(err error) bool {
	var ce *CUDAError
	return errors.Is(err, ErrNotSupported) || errors.As(err, &ce)
}

// ipcPatternValue is element i of the test pattern tag: the tag, the 64 KiB segment and the
// element's place in its 256-byte period, so that a view shifted by any whole number of
// elements reads wrong values.
func ipcPatternValue(i int, tag uint64) uint64 {
	return tag<<56 | uint64(i/gpuIPCSegment)<<8 | uint64(i%32)
}

// fillIPCPattern writes pattern tag over sp on the GPU (the fill kernels, one 256-byte element
// per 64 KiB segment), ordered on s.
func fillIPCPattern(sp DeviceSpan[uint64], tag uint64, s StreamView) error {
	n := sp.Len()
	if n%gpuIPCSegment != 0 {
		return fmt.Errorf("%d elements are not whole segments", n)
	}
	view, err := NewDeviceSpan[[32]uint64](sp.Data(), n/32, sp.Device(), sp.Access())
	if err != nil {
		return err
	}
	for seg := range n / gpuIPCSegment {
		var pat [32]uint64
		for k := range pat {
			pat[k] = ipcPatternValue(seg*gpuIPCSegment+k, tag)
		}
		sub, err := view.Subspan(seg*gpuIPCSegment/32, gpuIPCSegment/32)
		if err != nil {
			return err
		}
		if err := sub.Fill(pat, s); err != nil {
			return err
		}
	}
	return nil
}

// checkIPCPattern copies sp to the host (complete at return) and checks every element.
func checkIPCPattern(sp DeviceSpan[uint64], tag uint64, s StreamView) error {
	host := make([]uint64, sp.Len())
	if err := sp.CopyToHost(host, s); err != nil {
		return err
	}
	for i, v := range host {
		if want := ipcPatternValue(i, tag); v != want {
			return fmt.Errorf("element %d of %d is %#x, want %#x (pattern %d)", i, len(host), v, want, tag)
		}
	}
	return nil
}

// TestGPUIPCShare: the parent fills a 256 MiB vector, exports it with an event recorded after
// the fill; the child imports it, waits on the event, checks every element, writes a second
// pattern, records an event of its own and exports it; the parent waits on that event on its
// stream and checks every element.
func TestGPUIPCShare(t *testing.T) {
	requireGPU(t)
	outcome := map[string]string{}
	t.Cleanup(func() {
		for _, c := range gpuIPCCases() {
			t.Logf("%-10s %s", c.name, outcome[c.name])
		}
	})
	conn, wait := startIPCHelper(t, "gpu")
	defer func() {
		require.NoError(t, sendIPCText(conn, "end"))
		wait()
	}()
	for _, c := range gpuIPCCases() {
		t.Run(c.name, func(t *testing.T) {
			outcome[c.name] = "failed"
			defer func() {
				if t.Skipped() {
					outcome[c.name] = "refused (see the log)"
				} else if !t.Failed() {
					outcome[c.name] = "ok"
				}
			}()
			gpuIPCShareCase(t, c, conn)
		})
	}
}

func gpuIPCShareCase(t *testing.T, c gpuIPCCase, conn *net.UnixConn) {
	start := time.Now()
	mr, err := c.make(t)
	if err != nil && isIPCRefusal(err) {
		t.Skipf("%s: making the resource was refused: %v", c.name, err)
	}
	require.NoError(t, err)
	s, err := NewStream(0, nil)
	require.NoError(t, err)
	defer s.Close()
	v, err := NewUvector[uint64](gpuIPCElems, s.View(), mr)
	require.NoError(t, err)
	defer v.Close()
	require.NoError(t, fillIPCPattern(v.Span(), 1, s.View()))

	// The event that orders the child's reads after the fill; without interprocess events the
	// parent synchronises before it sends the handle.
	var eh *IPCHandle
	ev1, err := NewIPCEvent(0)
	if err == nil {
		defer func() {
			require.NoError(t, ev1.Close())
			require.NoError(t, ev1.Close(), "closing twice")
		}()
		if err = ev1.Record(s.View()); err == nil {
			eh, err = ev1.Export()
		}
	}
	if err != nil {
		require.True(t, isIPCRefusal(err), "%v", err)
		t.Logf("%s: interprocess events refused (%v): ordering through the host instead", c.name, err)
		eh = nil
		require.NoError(t, s.Synchronize())
	}
	h, err := v.ExportIPC()
	if err != nil && isIPCRefusal(err) {
		t.Skipf("%s: export refused: %v", c.name, err)
	}
	require.NoError(t, err)
	t.Logf("%s: exported %v", c.name, h)

	require.NoError(t, sendIPCText(conn, fmt.Sprintf("share %d %t", gpuIPCElems, eh != nil)))
	require.NoError(t, SendIPCHandle(conn, h))
	require.NoError(t, h.Close())
	require.NoError(t, h.Close(), "closing a handle twice")
	if eh != nil {
		require.NoError(t, SendIPCHandle(conn, eh))
		require.NoError(t, eh.Close())
	}
	// The child imports, waits, checks and writes its pattern: "ok" with its event's handle,
	// "ok-noevent" when it synchronised instead; "noevent: ..." when it could not open ours.
	var ev2 *IPCEvent
	for done := false; !done; {
		msg, err := recvIPCText(conn)
		require.NoError(t, err)
		switch {
		case strings.HasPrefix(msg, "refused: "):
			t.Skipf("%s: the child's import was refused: %s", c.name, strings.TrimPrefix(msg, "refused: "))
		case strings.HasPrefix(msg, "noevent: "):
			t.Logf("%s: the child could not open the event (%s): ordering through the host instead", c.name, strings.TrimPrefix(msg, "noevent: "))
			require.NoError(t, s.Synchronize())
			require.NoError(t, sendIPCText(conn, "synced"))
		case msg == "ok-noevent":
			done = true
		case msg == "ok":
			done = true
			h2, err := ReceiveIPCHandle(conn)
			require.NoError(t, err)
			ev2, err = OpenIPCEvent(h2)
			require.NoError(t, h2.Close())
			if err != nil {
				require.True(t, isIPCRefusal(err), "%v", err)
				t.Logf("%s: opening the child's event refused (%v): the child synchronises instead", c.name, err)
				require.NoError(t, sendIPCText(conn, "sync"))
				msg, err := recvIPCText(conn)
				require.NoError(t, err)
				require.Equal(t, "synced", msg)
				break
			}
			require.NoError(t, ev2.StreamWait(s.View()), "the parent's stream waits for the child's writes")
			_, err = ev2.Export()
			require.ErrorIs(t, err, ErrInvalidArgument, "an opened event is not exported again")
		default:
			t.Fatalf("%s: the child says: %s", c.name, msg)
		}
	}
	require.NoError(t, checkIPCPattern(v.Span(), 2, s.View()), "the child's pattern, seen by the parent")
	// The opened event goes before the child destroys its own.
	require.NoError(t, ev2.Close())
	require.NoError(t, ev2.Close(), "closing twice")
	require.NoError(t, sendIPCText(conn, "done"))
	msg, err := recvIPCText(conn)
	require.NoError(t, err)
	require.Equal(t, "closed", msg)
	t.Logf("%s: shared, checked both ways and closed in %v", c.name, time.Since(start).Round(time.Millisecond))
}

// TestGPUIPCImportAfterFree exports memory, frees it (and gives the resource's free memory back
// to the driver), then has the child import it: the result depends on the mechanism and is
// logged. The import either fails with a clear error or succeeds (the driver cannot tell: a
// virtual-memory descriptor keeps its physical memory alive; a pool's freed block is still the
// pool's), and then closes cleanly.
func TestGPUIPCImportAfterFree(t *testing.T) {
	requireGPU(t)
	conn, wait := startIPCHelper(t, "gpu")
	defer func() {
		require.NoError(t, sendIPCText(conn, "end"))
		wait()
	}()
	for _, c := range gpuIPCCases() {
		t.Run(c.name, func(t *testing.T) {
			mr, err := c.make(t)
			if err != nil && isIPCRefusal(err) {
				t.Skipf("%s: making the resource was refused: %v", c.name, err)
			}
			require.NoError(t, err)
			v, err := NewUvector[uint64](4<<20/8, DefaultStream, mr)
			require.NoError(t, err)
			h, err := v.ExportIPC()
			if err != nil && isIPCRefusal(err) {
				v.Close()
				t.Skipf("%s: export refused: %v", c.name, err)
			}
			require.NoError(t, err)
			defer h.Close()
			require.NoError(t, v.Close())
			require.NoError(t, Device(0).Synchronize())
			if r, ok := mr.(interface{ Release() error }); ok {
				require.NoError(t, r.Release())
			}
			require.NoError(t, sendIPCText(conn, "afterfree"))
			require.NoError(t, SendIPCHandle(conn, h))
			msg, err := recvIPCText(conn)
			require.NoError(t, err)
			t.Logf("%s: importing memory its exporter freed: %s", c.name, msg)
			require.True(t, strings.HasPrefix(msg, "error: ") || msg == "imported and closed", msg)
		})
	}
}

// TestGPUIPCImportOversize: a handle whose size runs past the exported allocation (what a
// hostile or broken exporter could send) is refused by the importer with ErrInvalidIPCHandle,
// after the driver opened the allocation, which the import then closes.
func TestGPUIPCImportOversize(t *testing.T) {
	requireGPU(t)
	conn, wait := startIPCHelper(t, "gpu")
	defer func() {
		require.NoError(t, sendIPCText(conn, "end"))
		wait()
	}()
	for _, c := range gpuIPCCases() {
		if c.name == "expandable" {
			continue // its pieces travel with the handle, whose decoding checks the range
		}
		t.Run(c.name, func(t *testing.T) {
			mr, err := c.make(t)
			if err != nil && isIPCRefusal(err) {
				t.Skipf("%s: making the resource was refused: %v", c.name, err)
			}
			require.NoError(t, err)
			v, err := NewUvector[uint64](4<<20/8, DefaultStream, mr)
			require.NoError(t, err)
			defer v.Close()
			h, err := v.ExportIPC()
			if err != nil && isIPCRefusal(err) {
				t.Skipf("%s: export refused: %v", c.name, err)
			}
			require.NoError(t, err)
			defer h.Close()
			h.size += 64 << 30 // past any allocation of the device
			require.NoError(t, sendIPCText(conn, "oversize"))
			require.NoError(t, SendIPCHandle(conn, h))
			msg, err := recvIPCText(conn)
			require.NoError(t, err)
			t.Logf("%s: %s", c.name, msg)
			require.True(t, strings.HasPrefix(msg, "error: "), msg)
			require.Contains(t, msg, "run past the allocation")
		})
	}
}

// gpuIPCChild serves the parent's requests until "end".
func gpuIPCChild(t *testing.T, conn *net.UnixConn) {
	for {
		msg, err := recvIPCText(conn)
		require.NoError(t, err)
		f := strings.Fields(msg)
		switch f[0] {
		case "end":
			return
		case "share":
			n, err := strconv.Atoi(f[1])
			require.NoError(t, err)
			gpuIPCChildShare(t, conn, n, f[2] == "true")
		case "afterfree":
			h, err := ReceiveIPCHandle(conn)
			require.NoError(t, err)
			sp, err := ImportIPC[uint64](h)
			require.NoError(t, h.Close())
			if err != nil {
				require.ErrorContains(t, err, "ImportIPC", "the error says where")
				require.True(t, isIPCRefusal(err), "a driver error: %v", err)
				require.NoError(t, sendIPCText(conn, "error: "+err.Error()))
				continue
			}
			require.NoError(t, sp.Close())
			require.NoError(t, sendIPCText(conn, "imported and closed"))
		case "oversize":
			h, err := ReceiveIPCHandle(conn)
			require.NoError(t, err)
			sp, err := ImportIPC[uint64](h)
			require.NoError(t, h.Close())
			if err != nil {
				require.ErrorIs(t, err, ErrInvalidIPCHandle)
				require.NoError(t, sendIPCText(conn, "error: "+err.Error()))
				continue
			}
			require.NoError(t, sp.Close())
			require.NoError(t, sendIPCText(conn, "imported and closed"))
		default:
			t.Fatalf("unknown request %q", msg)
		}
	}
}

func gpuIPCChildShare(t *testing.T, conn *net.UnixConn, n int, events bool) {
	h, err := ReceiveIPCHandle(conn)
	require.NoError(t, err)
	defer h.Close()
	var eh *IPCHandle
	if events {
		eh, err = ReceiveIPCHandle(conn)
		require.NoError(t, err)
	}
	sp, err := ImportIPC[uint64](h)
	if err != nil {
		if isIPCRefusal(err) {
			require.NoError(t, sendIPCText(conn, "refused: "+err.Error()))
			return
		}
		require.NoError(t, err)
	}
	require.Equal(t, n, sp.Len())
	s, err := NewStream(sp.Device(), nil)
	require.NoError(t, err)
	defer s.Close()
	var ev1 *IPCEvent
	if events {
		ev1, err = OpenIPCEvent(eh)
		if err != nil {
			require.True(t, isIPCRefusal(err), "%v", err)
			require.NoError(t, sendIPCText(conn, "noevent: "+err.Error()))
			msg, err := recvIPCText(conn)
			require.NoError(t, err)
			require.Equal(t, "synced", msg)
		} else {
			require.NoError(t, ev1.StreamWait(s.View()), "the child's stream waits for the parent's fill")
		}
	}
	if err := checkIPCPattern(sp.DeviceSpan, 1, s.View()); err != nil {
		require.NoError(t, sendIPCText(conn, "fail: the parent's pattern: "+err.Error()))
		t.Fatal(err)
	}

	// A second import of the same handle: for cuIpc and pool memory the process shares one
	// mapping, counted; virtual memory is mapped again. Closing it leaves the first intact.
	sp2, err := ImportIPC[uint64](h)
	require.NoError(t, err)
	if h.Kind() != IPCKindVirtualMemory {
		require.Equal(t, sp.Data(), sp2.Data(), "one mapping per process")
	}
	last, err := sp2.Subspan(n-gpuIPCSegment, gpuIPCSegment)
	require.NoError(t, err)
	got := make([]uint64, gpuIPCSegment)
	require.NoError(t, last.CopyToHost(got, s.View()))
	require.Equal(t, ipcPatternValue(n-1, 1), got[len(got)-1])
	require.NoError(t, sp2.Close())
	require.NoError(t, sp2.Close(), "closing twice")
	require.Zero(t, sp2.Len(), "a closed span is empty")
	first := make([]uint64, 4)
	require.NoError(t, sp.CopyToHost(first, s.View()), "the first import still reads")
	require.Equal(t, ipcPatternValue(3, 1), first[3])

	require.NoError(t, fillIPCPattern(sp.DeviceSpan, 2, s.View()))
	// Our own event, recorded after the writes; without one, synchronise before answering.
	var h2 *IPCHandle
	ev2, err := NewIPCEvent(sp.Device())
	if err == nil {
		if err = ev2.Record(s.View()); err == nil {
			h2, err = ev2.Export()
		}
	}
	if err != nil {
		require.True(t, isIPCRefusal(err), "%v", err)
		require.NoError(t, ev2.Close())
		require.NoError(t, s.Synchronize())
		require.NoError(t, sendIPCText(conn, "ok-noevent"))
	} else {
		require.NoError(t, sendIPCText(conn, "ok"))
		require.NoError(t, SendIPCHandle(conn, h2))
	}
	// The parent waits on our event and checks; the event and the import stay open until then.
	for {
		msg, err := recvIPCText(conn)
		require.NoError(t, err)
		if msg == "done" {
			break
		}
		require.Equal(t, "sync", msg)
		require.NoError(t, s.Synchronize())
		require.NoError(t, sendIPCText(conn, "synced"))
	}
	// Close before answering: the driver wants imported pool memory freed in the importer
	// before the exporter frees it.
	require.NoError(t, ev2.Close())
	require.NoError(t, ev1.Close())
	require.NoError(t, sp.Close())
	require.NoError(t, sp.Close(), "closing twice")
	require.Zero(t, sp.Len(), "a closed span is empty")
	require.NoError(t, sendIPCText(conn, "closed"))
}

// BenchmarkIPC: per mechanism, the cost of exporting a 256 MiB vector (parent), importing it
// and first touching it (the child copies the whole range into memory of its own) and closing
// the import, beside a device-to-device copy of the same size in one process ("copy").
func BenchmarkIPC(b *testing.B) {
	requireGPU(b)
	b.Run("copy", func(b *testing.B) {
		s, err := NewStream(0, nil)
		require.NoError(b, err)
		defer s.Close()
		src, err := NewUvector[uint64](gpuIPCElems, s.View(), nil)
		require.NoError(b, err)
		defer src.Close()
		dst, err := NewUvector[uint64](gpuIPCElems, s.View(), nil)
		require.NoError(b, err)
		defer dst.Close()
		b.SetBytes(gpuIPCElems * 8)
		for b.Loop() {
			require.NoError(b, dst.CopyFrom(src, s.View()))
			require.NoError(b, s.Synchronize())
		}
	})
	for _, c := range gpuIPCCases() {
		b.Run(c.name, func(b *testing.B) { benchIPCCase(b, c) })
	}
}

func benchIPCCase(b *testing.B, c gpuIPCCase) {
	mr, err := c.make(b)
	if err != nil && isIPCRefusal(err) {
		b.Skipf("%s: making the resource was refused: %v", c.name, err)
	}
	require.NoError(b, err)
	v, err := NewUvector[uint64](gpuIPCElems, DefaultStream, mr)
	require.NoError(b, err)
	defer v.Close()
	require.NoError(b, v.Fill(7, DefaultStream))
	require.NoError(b, DefaultStream.Synchronize())
	conn, wait := startIPCHelper(b, "gpu-bench")
	defer func() {
		sendIPCText(conn, "end")
		wait()
	}()
	var export, imp, access, closing time.Duration
	b.SetBytes(gpuIPCElems * 8)
	for b.Loop() {
		t0 := time.Now()
		h, err := v.ExportIPC()
		export += time.Since(t0)
		if err != nil && isIPCRefusal(err) {
			b.Skipf("%s: export refused: %v", c.name, err)
		}
		require.NoError(b, err)
		require.NoError(b, sendIPCText(conn, "import"))
		require.NoError(b, SendIPCHandle(conn, h))
		require.NoError(b, h.Close())
		msg, err := recvIPCText(conn)
		require.NoError(b, err)
		if strings.HasPrefix(msg, "refused: ") {
			b.Skipf("%s: the child's import was refused: %s", c.name, msg)
		}
		var di, da, dc int64
		_, err = fmt.Sscanf(msg, "%d %d %d", &di, &da, &dc)
		require.NoError(b, err, msg)
		imp += time.Duration(di)
		access += time.Duration(da)
		closing += time.Duration(dc)
	}
	n := float64(b.N)
	b.ReportMetric(float64(export.Nanoseconds())/n, "export-ns/op")
	b.ReportMetric(float64(imp.Nanoseconds())/n, "import-ns/op")
	b.ReportMetric(float64(access.Nanoseconds())/n, "first-copy-ns/op")
	b.ReportMetric(float64(closing.Nanoseconds())/n, "close-ns/op")
}

// gpuIPCBenchChild imports each handle it is sent, copies the whole range into a vector of its
// own, closes the import and replies with the three durations.
func gpuIPCBenchChild(t *testing.T, conn *net.UnixConn) {
	s, err := NewStream(0, nil)
	require.NoError(t, err)
	defer s.Close()
	dst, err := NewUvector[uint64](gpuIPCElems, s.View(), nil)
	require.NoError(t, err)
	defer dst.Close()
	for {
		msg, err := recvIPCText(conn)
		require.NoError(t, err)
		if msg == "end" {
			return
		}
		h, err := ReceiveIPCHandle(conn)
		require.NoError(t, err)
		t0 := time.Now()
		sp, err := ImportIPC[uint64](h)
		di := time.Since(t0)
		require.NoError(t, h.Close())
		if err != nil {
			require.True(t, isIPCRefusal(err), "%v", err)
			require.NoError(t, sendIPCText(conn, "refused: "+err.Error()))
			continue
		}
		t0 = time.Now()
		require.NoError(t, dst.CopyFrom(sp, s.View()))
		require.NoError(t, s.Synchronize())
		da := time.Since(t0)
		t0 = time.Now()
		require.NoError(t, sp.Close())
		dc := time.Since(t0)
		require.NoError(t, sendIPCText(conn, fmt.Sprintf("%d %d %d", di.Nanoseconds(), da.Nanoseconds(), dc.Nanoseconds())))
	}
}
