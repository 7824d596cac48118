package rmm

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// logTestUpstream forwards to a real resource, counts calls, and fails the next allocation on
// demand with an ErrOutOfMemory error that it remembers.
type logTestUpstream struct {
	MemoryResource
	failNext  atomic.Bool
	lastErr   error
	allocs    atomic.Int64
	deallocs  atomic.Int64
	lastFreed atomic.Uintptr
}

func (u *logTestUpstream) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	u.allocs.Add(1)
	if u.failNext.Swap(false) {
		u.lastErr = outOfMemory("logTestUpstream", nbytes, nil)
		return 0, u.lastErr
	}
	return u.MemoryResource.Allocate(nbytes, s)
}

func (u *logTestUpstream) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	u.deallocs.Add(1)
	u.lastFreed.Store(uintptr(p))
	return u.MemoryResource.Deallocate(p, nbytes, s)
}

// logLineRE is one event line as librmm writes it.
var logLineRE = regexp.MustCompile(`^[0-9]+,[0-2][0-9]:[0-5][0-9]:[0-5][0-9]\.[0-9]{6},(allocate|free|allocate failure),(\(nil\)|0x[1-9a-f][0-9a-f]*),(0|[1-9][0-9]*),(0|0x[1-9a-f][0-9a-f]*)$`)

// checkLogText checks that text is a header and well-formed event lines, and returns the lines.
func checkLogText(t *testing.T, text string) []string {
	t.Helper()
	require.True(t, strings.HasSuffix(text, "\n"), "the log ends with a newline")
	lines := strings.Split(strings.TrimSuffix(text, "\n"), "\n")
	require.Equal(t, LogHeader, lines[0])
	for i, l := range lines[1:] {
		require.Regexp(t, logLineRE, l, "line %d", i+2)
	}
	return lines[1:]
}

// logStep is the part of an event the tests compare exactly.
type logStep struct {
	Action  EventAction
	Pointer DevicePtr
	Size    int
	Stream  uintptr
}

func logSteps(events []LogEvent) []logStep {
	out := make([]logStep, len(events))
	for i, e := range events {
		out[i] = logStep{e.Action, e.Pointer, e.Size, e.Stream}
	}
	return out
}

func TestLoggingResourceAdaptorSequence(t *testing.T) {
	up := &logTestUpstream{MemoryResource: NewSystemMemoryResource()}
	var buf bytes.Buffer
	mr, err := NewLoggingResourceAdaptor(up, &buf, nil)
	require.NoError(t, err)
	require.Same(t, up, mr.Upstream())

	foreign := StreamView{h: 0x7f9730003840, id: foreignStreamBit | 9}
	host, err := NewStream(0, nil)
	require.NoError(t, err)
	defer host.Close()

	before := timeOfDay(time.Now())
	p1, err := mr.Allocate(1000, DefaultStream)
	require.NoError(t, err)
	require.NotZero(t, p1)
	p0, err := mr.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, p0)
	p2, err := mr.Allocate(4096, foreign)
	require.NoError(t, err)
	p3, err := mr.Allocate(1, host.View())
	require.NoError(t, err)

	up.failNext.Store(true)
	pf, err := mr.Allocate(1<<40, foreign)
	require.Error(t, err)
	require.Zero(t, pf)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.True(t, err == up.lastErr, "the upstream's error is returned unchanged")

	require.NoError(t, mr.Deallocate(p1, 1000, DefaultStream))
	require.NoError(t, mr.Deallocate(p2, 4096, foreign))
	require.NoError(t, mr.Deallocate(p3, 1, host.View()))
	require.NoError(t, mr.Deallocate(0, 0, DefaultStream))
	require.Equal(t, int64(5), up.allocs.Load(), "every allocation, the zero-byte one included, reaches the upstream")
	require.Equal(t, int64(4), up.deallocs.Load())

	require.NoError(t, mr.Flush())
	text := buf.String()
	lines := checkLogText(t, text)
	require.Len(t, lines, 9)
	require.Equal(t, fmt.Sprintf("allocate failure,(nil),%d,0x7f9730003840", 1<<40),
		lines[4][strings.Index(lines[4], ",a")+1:], "the failure line, after thread and time")

	events, err := ReadLog(strings.NewReader(text))
	require.NoError(t, err)
	hs := host.View().Handle() // the CUstream on a GPU
	if hs == 0 {
		hs = uintptr(host.View().ID()) // a host stream logs its ID
	}
	require.Equal(t, []logStep{
		{ActionAllocate, p1, 1000, 0},
		{ActionAllocate, 0, 0, 0},
		{ActionAllocate, p2, 4096, 0x7f9730003840},
		{ActionAllocate, p3, 1, hs},
		{ActionAllocateFailure, 0, 1 << 40, 0x7f9730003840},
		{ActionFree, p1, 1000, 0},
		{ActionFree, p2, 4096, 0x7f9730003840},
		{ActionFree, p3, 1, hs},
		{ActionFree, 0, 0, 0},
	}, logSteps(events))
	after := timeOfDay(time.Now())
	for _, e := range events {
		if runtime.GOOS == "linux" {
			require.NotZero(t, e.Thread, "line %d: the OS thread id", e.Line)
		}
		if before <= after { // not across midnight
			require.True(t, e.Time >= before && e.Time <= after, "line %d: time %v outside [%v, %v]", e.Line, e.Time, before, after)
		}
	}
}

// logOrderUpstream records, at each upstream call, how much of the log has been written.
type logOrderUpstream struct {
	MemoryResource
	out          *bytes.Buffer
	linesAtAlloc int
	linesAtFree  int
}

func (u *logOrderUpstream) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	u.linesAtAlloc = strings.Count(u.out.String(), "\n")
	return u.MemoryResource.Allocate(nbytes, s)
}

func (u *logOrderUpstream) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	u.linesAtFree = strings.Count(u.out.String(), "\n")
	return u.MemoryResource.Deallocate(p, nbytes, s)
}

func TestLoggingResourceAdaptorOrdering(t *testing.T) {
	var buf bytes.Buffer
	up := &logOrderUpstream{MemoryResource: NewSystemMemoryResource(), out: &buf}
	mr, err := NewLoggingResourceAdaptor(up, &buf, &LoggingOptions{AutoFlush: true})
	require.NoError(t, err)
	require.Equal(t, LogHeader+"\n", buf.String(), "with AutoFlush the header is written at construction")

	p, err := mr.Allocate(512, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, 1, up.linesAtAlloc, "allocate is logged after the upstream returns")
	require.Equal(t, 2, strings.Count(buf.String(), "\n"))

	require.NoError(t, mr.Deallocate(p, 512, DefaultStream))
	require.Equal(t, 3, up.linesAtFree, "free is logged before the upstream is called")
}

func TestLoggingResourceAdaptorBuffering(t *testing.T) {
	var buf bytes.Buffer
	mr, err := NewLoggingResourceAdaptor(NewSystemMemoryResource(), &buf, nil)
	require.NoError(t, err)
	p, err := mr.Allocate(256, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, buf.Len(), "without AutoFlush nothing reaches the writer before Flush")
	require.NoError(t, mr.Flush())
	require.Len(t, checkLogText(t, buf.String()), 1)
	require.NoError(t, mr.Deallocate(p, 256, DefaultStream))
	require.NoError(t, mr.Close())
	require.Len(t, checkLogText(t, buf.String()), 2, "Close flushes")
}

func TestLoggingResourceAdaptorNegativeSize(t *testing.T) {
	up := &logTestUpstream{MemoryResource: NewSystemMemoryResource()}
	var buf bytes.Buffer
	mr, err := NewLoggingResourceAdaptor(up, &buf, nil)
	require.NoError(t, err)
	_, err = mr.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, mr.Deallocate(0x100, -1, DefaultStream), ErrInvalidArgument)
	require.Zero(t, up.allocs.Load())
	require.Zero(t, up.deallocs.Load())
	require.NoError(t, mr.Flush())
	require.Equal(t, LogHeader+"\n", buf.String(), "nothing is logged for a negative size")
}

func TestLoggingResourceAdaptorWriteError(t *testing.T) {
	var dbg bytes.Buffer
	old := SetDebugLogger(slog.New(slog.NewTextHandler(&dbg, nil)))
	defer SetDebugLogger(old)

	boom := errors.New("disk full")
	up := &logTestUpstream{MemoryResource: NewSystemMemoryResource()}
	mr, err := NewLoggingResourceAdaptor(up, logFailingWriter{boom}, nil)
	require.NoError(t, err, "without AutoFlush the header is only buffered")
	require.ErrorIs(t, mr.Flush(), boom)

	p, err := mr.Allocate(256, DefaultStream)
	require.NoError(t, err, "a log that cannot be written does not fail the allocation")
	require.NotZero(t, p)
	require.NoError(t, mr.Deallocate(p, 256, DefaultStream))
	require.Equal(t, uintptr(p), up.lastFreed.Load())
	p, err = mr.Allocate(256, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, mr.Deallocate(p, 256, DefaultStream))
	require.Equal(t, 1, strings.Count(dbg.String(), "cannot write the event log"), "reported once in the debug log: %s", dbg.String())
	require.ErrorIs(t, mr.Close(), boom)

	_, err = NewLoggingResourceAdaptor(up, logFailingWriter{boom}, &LoggingOptions{AutoFlush: true})
	require.ErrorIs(t, err, boom, "with AutoFlush the header is written at construction")
}

func TestLoggingResourceAdaptorFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "rmm_log.csv")
	require.NoError(t, os.WriteFile(path, []byte("old contents that must go\n"), 0o644))

	up := &logTestUpstream{MemoryResource: NewSystemMemoryResource()}
	mr, err := NewLoggingResourceAdaptorFile(up, path, nil)
	require.NoError(t, err)
	require.Equal(t, path, mr.FileName())
	p, err := mr.Allocate(300, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, mr.Close())
	require.NoError(t, mr.Close(), "closing twice is harmless")

	_, err = mr.Allocate(300, DefaultStream)
	require.ErrorIs(t, err, ErrClosed)
	require.Equal(t, int64(1), up.allocs.Load(), "a closed adaptor does not call the upstream to allocate")
	require.NoError(t, mr.Deallocate(p, 300, DefaultStream), "memory can still be given back after Close")
	require.Equal(t, uintptr(p), up.lastFreed.Load())

	events, err := ReadLogFile(path)
	require.NoError(t, err)
	require.Equal(t, []logStep{{ActionAllocate, p, 300, 0}}, logSteps(events), "the file was truncated; events after Close are not logged")
}

func TestLoggingResourceAdaptorFileFromEnvironment(t *testing.T) {
	path := filepath.Join(t.TempDir(), "from_env.csv")
	t.Setenv("RMM_LOG_FILE", path)
	mr, err := NewLoggingResourceAdaptorFile(NewSystemMemoryResource(), "", &LoggingOptions{AutoFlush: true})
	require.NoError(t, err)
	require.Equal(t, path, mr.FileName(), "the name RMM_LOG_FILE gave")
	_, err = mr.Allocate(0, DefaultStream)
	require.NoError(t, err)
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	lines := checkLogText(t, string(b))
	require.Len(t, lines, 1, "AutoFlush wrote the line through to the file")
	require.True(t, strings.HasSuffix(lines[0], ",allocate,(nil),0,0"), lines[0])
	require.NoError(t, mr.Close())
}

func TestLoggingResourceAdaptorMissingLogFile(t *testing.T) {
	t.Setenv("RMM_LOG_FILE", "")
	os.Unsetenv("RMM_LOG_FILE")
	_, err := NewLoggingResourceAdaptorFile(NewSystemMemoryResource(), "", nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Contains(t, err.Error(), "RMM_LOG_FILE")

	_, err = NewLoggingResourceAdaptorFile(NewSystemMemoryResource(), filepath.Join(t.TempDir(), "no", "such", "dir.csv"), nil)
	require.ErrorIs(t, err, fs.ErrNotExist)

	_, err = NewLoggingResourceAdaptor(NewSystemMemoryResource(), nil, nil)
	require.ErrorIs(t, err, ErrInvalidArgument)

	var buf strings.Builder
	mr, err := NewLoggingResourceAdaptor(NewSystemMemoryResource(), &buf, nil)
	require.NoError(t, err)
	require.Empty(t, mr.FileName(), "an adaptor over a writer has no file")
}

func TestLoggingResourceAdaptorForwardsAccessAndDevice(t *testing.T) {
	sys := NewSystemMemoryResource()
	mr, err := NewLoggingResourceAdaptor(sys, io.Discard, nil)
	require.NoError(t, err)
	require.Equal(t, sys.Access(), mr.Access())
	require.Equal(t, sys.Access(), AccessOf(mr))
	require.Equal(t, DeviceOf(sys), DeviceOf(mr))

	sim, err := NewSimulatedMemoryResource(1 << 30)
	require.NoError(t, err)
	mr, err = NewLoggingResourceAdaptor(sim, io.Discard, nil)
	require.NoError(t, err)
	require.Equal(t, Access(0), AccessOf(mr), "address-only memory stays inaccessible through the adaptor")

	// An adaptor over an adaptor sees the innermost answer.
	outer, err := NewLoggingResourceAdaptor(mr, io.Discard, nil)
	require.NoError(t, err)
	require.Equal(t, Access(0), AccessOf(outer))

	mr, err = NewLoggingResourceAdaptor(nil, io.Discard, nil)
	require.NoError(t, err)
	require.Equal(t, CurrentDeviceResource(), mr.Upstream(), "nil means the current device resource")
}

// TestLoggingResourceAdaptorConcurrent: 8 goroutines allocate and free through one adaptor; the
// log has only whole lines, and replayed in file order it is consistent (every free matches a live
// allocation of the same size, no pointer is handed out twice while live), which holds only when
// allocations are logged after the upstream returns and frees before the upstream is called.
func TestLoggingResourceAdaptorConcurrent(t *testing.T) {
	const goroutines, pairs = 8, 300
	var buf bytes.Buffer
	mr, err := NewLoggingResourceAdaptor(NewSystemMemoryResource(), &buf, nil)
	require.NoError(t, err)

	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := StreamView{h: uintptr(0x1000 + g), id: foreignStreamBit | uint64(100+g)}
			var held []DevicePtr
			var sizes []int
			for i := range pairs {
				n := 1 + (g*pairs+i)%5000
				p, err := mr.Allocate(n, s)
				if err != nil {
					errs <- err
					return
				}
				held, sizes = append(held, p), append(sizes, n)
				if i%3 == 2 { // keep a few live, free in another order
					for j := len(held) - 1; j >= 0; j-- {
						if err := mr.Deallocate(held[j], sizes[j], s); err != nil {
							errs <- err
							return
						}
					}
					held, sizes = held[:0], sizes[:0]
				}
			}
			for j := range held {
				if err := mr.Deallocate(held[j], sizes[j], s); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, mr.Flush())

	lines := checkLogText(t, buf.String())
	require.Len(t, lines, goroutines*pairs*2)
	events, err := ReadLog(&buf)
	require.NoError(t, err)
	live := map[DevicePtr]int{}
	perStream := map[uintptr][2]int{}
	for _, e := range events {
		c := perStream[e.Stream]
		switch e.Action {
		case ActionAllocate:
			_, dup := live[e.Pointer]
			require.False(t, dup, "line %d: pointer handed out twice while live", e.Line)
			live[e.Pointer] = e.Size
			c[0]++
		case ActionFree:
			size, ok := live[e.Pointer]
			require.True(t, ok, "line %d: free of a pointer not live in the log", e.Line)
			require.Equal(t, size, e.Size, "line %d", e.Line)
			delete(live, e.Pointer)
			c[1]++
		default:
			t.Fatalf("line %d: unexpected %v", e.Line, e.Action)
		}
		perStream[e.Stream] = c
	}
	require.Empty(t, live)
	require.Len(t, perStream, goroutines)
	for g := range goroutines {
		require.Equal(t, [2]int{pairs, pairs}, perStream[uintptr(0x1000+g)], "goroutine %d", g)
	}
}

// logNullUpstream hands out fake addresses and allocates nothing, to measure the adaptor alone.
type logNullUpstream struct{ next atomic.Uintptr }

func (u *logNullUpstream) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	return DevicePtr(u.next.Add(256)), nil
}
func (u *logNullUpstream) Deallocate(p DevicePtr, nbytes int, s StreamView) error { return nil }

func TestLoggingResourceAdaptorDoesNotAllocatePerEvent(t *testing.T) {
	if logRaceEnabled {
		t.Skip("the race detector changes allocation counts")
	}
	mr, err := NewLoggingResourceAdaptor(&logNullUpstream{}, io.Discard, nil)
	require.NoError(t, err)
	s := StreamView{h: 0x7f9730003840, id: foreignStreamBit | 1}
	allocs := testing.AllocsPerRun(1000, func() {
		p, err := mr.Allocate(1<<20, s)
		if err != nil {
			panic(err)
		}
		if err := mr.Deallocate(p, 1<<20, s); err != nil {
			panic(err)
		}
	})
	require.Zero(t, allocs, "heap allocations per allocate+free pair")
}

func BenchmarkLoggingResourceAdaptor(b *testing.B) {
	mr, err := NewLoggingResourceAdaptor(&logNullUpstream{}, io.Discard, nil)
	require.NoError(b, err)
	b.ReportAllocs()
	for b.Loop() {
		p, err := mr.Allocate(4096, DefaultStream)
		if err != nil {
			b.Fatal(err)
		}
		if err := mr.Deallocate(p, 4096, DefaultStream); err != nil {
			b.Fatal(err)
		}
	}
}

// TestLoggingResourceAdaptorCUDA logs device allocations on a real stream: the pointer in the log
// is the device pointer, and the stream column is the CUstream handle.
func TestLoggingResourceAdaptorCUDA(t *testing.T) {
	if err := CUDAAvailable(); err != nil {
		t.Skip("no CUDA device:", err)
	}
	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	var buf bytes.Buffer
	mr, err := NewLoggingResourceAdaptor(cuda, &buf, nil)
	require.NoError(t, err)
	require.Equal(t, DeviceAccessible, AccessOf(mr))
	require.Equal(t, Device(0), DeviceOf(mr))
	st, err := NewStream(0, nil)
	require.NoError(t, err)
	defer st.Close()
	require.NotZero(t, st.View().Handle())

	p, err := mr.Allocate(1<<20, st.View())
	require.NoError(t, err)
	require.NotZero(t, p)
	_, err = mr.Allocate(1<<50, DefaultStream) // 1 PiB: more than any device has
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.NoError(t, mr.Deallocate(p, 1<<20, st.View()))
	require.NoError(t, mr.Flush())

	checkLogText(t, buf.String())
	events, err := ReadLog(&buf)
	require.NoError(t, err)
	require.Equal(t, []logStep{
		{ActionAllocate, p, 1 << 20, st.View().Handle()},
		{ActionAllocateFailure, 0, 1 << 50, 0},
		{ActionFree, p, 1 << 20, st.View().Handle()},
	}, logSteps(events))
}

// Without CUDA, streams are host streams with no handle: each logs its ID, so that the log
// replays with as many streams as it was made on (it logged them all as 0, one stream).
func TestLoggingResourceAdaptorHostStreams(t *testing.T) {
	if CUDAAvailable() == nil {
		t.Skip("streams here have CUstream handles")
	}
	var buf bytes.Buffer
	lr, err := NewLoggingResourceAdaptor(NewSystemMemoryResource(), &buf, nil)
	require.NoError(t, err)
	a, err := NewStream(0, nil)
	require.NoError(t, err)
	b, err := NewStream(0, nil)
	require.NoError(t, err)
	for _, s := range []StreamView{DefaultStream, a.View(), b.View()} {
		p, err := lr.Allocate(512, s)
		require.NoError(t, err)
		require.NoError(t, lr.Deallocate(p, 512, s))
	}
	require.NoError(t, b.Close())
	p, err := lr.Allocate(256, b.View()) // closed: logged as the default stream
	require.NoError(t, err)
	require.NoError(t, lr.Deallocate(p, 256, DefaultStream))
	require.NoError(t, lr.Close())
	require.NoError(t, a.Close())
	events, err := ReadLog(&buf)
	require.NoError(t, err)
	var got []uintptr
	for _, e := range events {
		got = append(got, e.Stream)
	}
	require.Equal(t, []uintptr{0, 0, uintptr(a.View().ID()), uintptr(a.View().ID()), uintptr(b.View().ID()), uintptr(b.View().ID()), 0, 0}, got)
	seen := map[uintptr]bool{}
	_, err = Replay(events, NewSystemMemoryResource(), &ReplayOptions{Stream: func(h uintptr) StreamView { seen[h] = true; return DefaultStream }})
	require.NoError(t, err)
	require.Len(t, seen, 3, "the replay sees the default stream and two others")
}
