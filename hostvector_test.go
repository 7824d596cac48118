package rmm

import (
	"runtime"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// hostRecordingMR is a HostMemoryResource over pinned memory that records what is live and
// reports every free on a channel.
type hostRecordingMR struct {
	up    *PinnedMemoryResource
	mu    sync.Mutex
	live  map[unsafe.Pointer]int
	total int // allocations made
	freed chan unsafe.Pointer
}

func newHostRecordingMR(t *testing.T) *hostRecordingMR {
	return &hostRecordingMR{up: hostPinned(t), live: map[unsafe.Pointer]int{}, freed: make(chan unsafe.Pointer, 64)}
}

func (r *hostRecordingMR) AllocateHost(n, align int) (unsafe.Pointer, error) {
	p, err := r.up.AllocateHost(n, align)
	if err == nil && p != nil {
		r.mu.Lock()
		r.live[p] = n
		r.total++
		r.mu.Unlock()
	}
	return p, err
}

func (r *hostRecordingMR) DeallocateHost(p unsafe.Pointer, n, align int) error {
	r.mu.Lock()
	delete(r.live, p)
	r.mu.Unlock()
	err := r.up.DeallocateHost(p, n, align)
	select {
	case r.freed <- p:
	default:
	}
	return err
}

func (r *hostRecordingMR) liveCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.live)
}

func (r *hostRecordingMR) isLive(p unsafe.Pointer) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.live[p]
	return ok
}

func TestHostVectorBasics(t *testing.T) {
	h, err := NewHostVector[int32](10, nil)
	require.NoError(t, err)
	defer h.Close()
	assert.Equal(t, 10, h.Len())
	assert.Equal(t, 10, h.Cap())
	assert.Equal(t, 40, h.SizeBytes())
	require.NotNil(t, h.Data())
	require.Zero(t, uintptr(h.Data())%Alignment)
	_, ok := h.MemoryResource().(*PinnedMemoryResource)
	require.True(t, ok, "the default resource is pinned memory")

	s, err := h.Slice()
	require.NoError(t, err)
	require.Equal(t, make([]int32, 10), s, "new elements are zero")
	for i := range s {
		s[i] = int32(i * i)
	}
	x, err := h.At(9)
	require.NoError(t, err)
	require.Equal(t, int32(81), x)
	require.NoError(t, h.Set(3, -1))
	require.Equal(t, int32(-1), s[3], "the slice views the vector's memory")

	_, err = h.At(10)
	require.ErrorIs(t, err, ErrOutOfRange)
	require.Contains(t, err.Error(), "index 10, length 10")
	_, err = h.At(-1)
	require.ErrorIs(t, err, ErrOutOfRange)
	require.ErrorIs(t, h.Set(10, 0), ErrOutOfRange)
	require.NoError(t, h.Wait())
	pending, err := h.Pending()
	require.NoError(t, err)
	require.False(t, pending)

	h2, err := NewHostVectorFromSlice([]float64{1, 2.5, -3}, nil)
	require.NoError(t, err)
	got, err := h2.Slice()
	require.NoError(t, err)
	require.Equal(t, []float64{1, 2.5, -3}, got)
	require.NoError(t, h2.Close())

	empty, err := NewHostVector[int64](0, nil)
	require.NoError(t, err)
	require.Zero(t, empty.Len())
	require.Nil(t, empty.Data())
	es, err := empty.Slice()
	require.NoError(t, err)
	require.Empty(t, es)
	require.NoError(t, empty.Close())
}

func TestHostVectorBadArguments(t *testing.T) {
	_, err := NewHostVector[*int](1, nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Contains(t, err.Error(), "Go pointer")
	_, err = NewHostVector[struct{ S string }](1, nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = NewHostVector[int32](-1, nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = NewHostVector[int64](1<<62, nil)
	require.ErrorIs(t, err, ErrInvalidArgument, "the byte size overflows")

	h, err := NewHostVector[int32](4, nil)
	require.NoError(t, err)
	require.ErrorIs(t, h.Resize(-1), ErrInvalidArgument)
	require.Equal(t, 4, h.Len(), "unchanged after a failed Resize")
	require.NoError(t, h.Close())
	require.NoError(t, h.Close(), "closing twice")
	require.Zero(t, h.Len())
	require.Zero(t, h.Cap())
	_, err = h.Slice()
	require.ErrorIs(t, err, ErrClosed)
	_, err = h.At(0)
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, h.Set(0, 1), ErrClosed)
	require.ErrorIs(t, h.Resize(2), ErrClosed)
	require.ErrorIs(t, h.Wait(), ErrClosed)
	_, err = h.Pending()
	require.ErrorIs(t, err, ErrClosed)
	v, err := NewUvector[int32](4, DefaultStream, nil)
	require.NoError(t, err)
	defer v.Close()
	require.ErrorIs(t, h.CopyToDeviceAsync(v, DefaultStream), ErrClosed)
	require.ErrorIs(t, h.CopyFromDeviceAsync(v, DefaultStream), ErrClosed)
}

func TestHostVectorResize(t *testing.T) {
	mr := newHostRecordingMR(t)
	h, err := NewHostVector[uint16](5, mr)
	require.NoError(t, err)
	s, _ := h.Slice()
	copy(s, []uint16{1, 2, 3, 4, 5})
	first := h.Data()

	// Shrink: same memory, capacity kept; growing back within it zeroes the revealed elements.
	require.NoError(t, h.Resize(2))
	assert.Equal(t, 2, h.Len())
	assert.Equal(t, 5, h.Cap())
	require.NoError(t, h.Resize(4))
	s, _ = h.Slice()
	require.Equal(t, []uint16{1, 2, 0, 0}, s)
	require.Equal(t, first, h.Data())
	require.Equal(t, 1, mr.total)

	// Grow past the capacity: exactly n elements, contents kept, the tail zero, old memory freed.
	require.NoError(t, h.Resize(1000))
	assert.Equal(t, 1000, h.Len())
	assert.Equal(t, 1000, h.Cap())
	s, _ = h.Slice()
	require.Equal(t, []uint16{1, 2, 0, 0, 0}, s[:5])
	for _, x := range s[5:] {
		require.Zero(t, x)
	}
	require.Equal(t, 2, mr.total)
	require.Equal(t, 1, mr.liveCount())
	require.False(t, mr.isLive(first))

	require.NoError(t, h.Resize(0))
	assert.Equal(t, 0, h.Len())
	assert.Equal(t, 1000, h.Cap())
	require.NoError(t, h.Close())
	require.Zero(t, mr.liveCount())
}

// hostFailingHostMR refuses every allocation.
type hostFailingHostMR struct{ HostMemoryResource }

func (hostFailingHostMR) AllocateHost(n, _ int) (unsafe.Pointer, error) {
	return nil, outOfMemory("hostFailingHostMR", n, nil)
}

func TestHostVectorResizeFailureLeavesItUnchanged(t *testing.T) {
	mr := newHostRecordingMR(t)
	h, err := NewHostVector[int32](3, mr)
	require.NoError(t, err)
	defer h.Close()
	require.NoError(t, h.Set(2, 7))
	h.st.mr = hostFailingHostMR{mr}
	err = h.Resize(100)
	require.ErrorIs(t, err, ErrOutOfMemory)
	h.st.mr = mr
	require.Equal(t, 3, h.Len())
	require.Equal(t, 3, h.Cap())
	x, err := h.At(2)
	require.NoError(t, err)
	require.Equal(t, int32(7), x)

	_, err = NewHostVector[int32](10, hostFailingHostMR{mr})
	require.ErrorIs(t, err, ErrOutOfMemory)
}

// On the current device resource (host memory on CI, the GPU elsewhere) a round trip through a
// device vector gives back the data.
func TestHostVectorRoundTrip(t *testing.T) {
	s := DefaultStream
	h, err := NewHostVector[float32](1000, nil)
	require.NoError(t, err)
	defer h.Close()
	hs, _ := h.Slice()
	for i := range hs {
		hs[i] = float32(i) / 4
	}
	v, err := NewUvector[float32](1200, s, nil)
	require.NoError(t, err)
	defer v.Close()
	require.NoError(t, v.Fill(-1, s))
	require.NoError(t, h.CopyToDeviceAsync(v, s))
	got, err := v.ToSlice(s) // ordered after the copy on s
	require.NoError(t, err)
	require.Equal(t, hs, got[:1000])
	require.Equal(t, float32(-1), got[1000], "only Len() elements were copied")

	// Back: the device vector doubled, into a second host vector, through a span.
	w, err := NewUvectorFromSlice(got[:1000], s, nil)
	require.NoError(t, err)
	defer w.Close()
	sub, err := w.Span().Subspan(10, 20)
	require.NoError(t, err)
	h2, err := NewHostVector[float32](30, nil)
	require.NoError(t, err)
	defer h2.Close()
	require.NoError(t, h2.Set(29, 99))
	require.NoError(t, h2.CopyFromDeviceAsync(sub, s))
	out, err := h2.Slice() // waits for the copy
	require.NoError(t, err)
	require.Equal(t, hs[10:30], out[:20])
	require.Equal(t, float32(99), out[29], "only src.Len() elements were written")

	// A scalar.
	c, err := NewScalarWithValue[float32](6.5, s, nil)
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, h2.CopyFromDeviceAsync(c, s))
	x, err := h2.At(0)
	require.NoError(t, err)
	require.Equal(t, float32(6.5), x)
}

func TestHostVectorCopyErrors(t *testing.T) {
	s := DefaultStream
	h, err := NewHostVector[int32](10, nil)
	require.NoError(t, err)
	defer h.Close()
	short, err := NewUvector[int32](9, s, nil)
	require.NoError(t, err)
	defer short.Close()
	err = h.CopyToDeviceAsync(short, s)
	require.ErrorIs(t, err, ErrOutOfRange)
	require.Contains(t, err.Error(), "10 elements do not fit")
	long, err := NewUvector[int32](11, s, nil)
	require.NoError(t, err)
	require.ErrorIs(t, h.CopyFromDeviceAsync(long, s), ErrOutOfRange)
	require.NoError(t, long.Close())
	require.ErrorIs(t, h.CopyToDeviceAsync(long, s), ErrClosed)
	require.ErrorIs(t, h.CopyFromDeviceAsync(long, s), ErrClosed)
	require.ErrorIs(t, h.CopyToDeviceAsync(nil, s), ErrInvalidArgument)
	var nilVec *Uvector[int32]
	require.ErrorIs(t, h.CopyFromDeviceAsync(nilVec, s), ErrInvalidArgument)

	st, err := NewStream(0, nil)
	require.NoError(t, err)
	require.NoError(t, st.Close())
	ok, err := NewUvector[int32](10, s, nil)
	require.NoError(t, err)
	defer ok.Close()
	require.ErrorIs(t, h.CopyToDeviceAsync(ok, st.View()), ErrClosed)

	// Address-only memory cannot be copied.
	sim, err := NewSimulatedMemoryResource(1 << 20)
	require.NoError(t, err)
	nv, err := NewUvector[int32](10, s, sim)
	require.NoError(t, err)
	defer nv.Close()
	require.ErrorIs(t, h.CopyToDeviceAsync(nv, s), ErrNotSupported)
	require.ErrorIs(t, h.CopyFromDeviceAsync(nv, s), ErrNotSupported)

	// Empty copies do nothing.
	e, err := NewHostVector[int32](0, nil)
	require.NoError(t, err)
	defer e.Close()
	require.NoError(t, e.CopyToDeviceAsync(ok, s))
}

//go:noinline
func hostCopyIntoDropped(mr HostMemoryResource, src SpanSource[uint8]) (unsafe.Pointer, error) {
	h, err := NewHostVector[uint8](4096, mr)
	if err != nil {
		return nil, err
	}
	p := h.Data()
	return p, h.CopyFromDeviceAsync(src, DefaultStream) // h's last use; never closed (a leak)
}

// A host vector stays reachable until its method returns: its leak cleanup must not free the
// memory a copy is writing into.
func TestHostVectorKeptAliveDuringCopy(t *testing.T) {
	mr := newHostRecordingMR(t)
	src, err := NewUvector[uint8](4096, DefaultStream, nil)
	require.NoError(t, err)
	defer src.Close()
	require.NoError(t, src.Fill(0xAA, DefaultStream))

	var block unsafe.Pointer
	freedDuring := false
	during := func() {
		for i := 0; i < 20; i++ {
			runtime.GC()
			time.Sleep(time.Millisecond)
		}
		mr.mu.Lock()
		freedDuring = len(mr.live) == 0
		mr.mu.Unlock()
	}
	block, err = hostCopyIntoDropped(mr, gcSlowSource{src.Span(), during})
	require.NoError(t, err)
	require.False(t, freedDuring, "the vector's memory was freed by its cleanup while CopyFromDeviceAsync ran")
	// Once unreachable, the cleanup frees it.
	deadline := time.Now().Add(5 * time.Second)
	for mr.isLive(block) && time.Now().Before(deadline) {
		runtime.GC()
		time.Sleep(2 * time.Millisecond)
	}
	require.False(t, mr.isLive(block), "a leaked host vector is reclaimed by its cleanup")
}

//go:noinline
func hostLeak(mr HostMemoryResource) error {
	_, err := NewHostVector[int64](1000, mr)
	return err
}

func TestHostVectorLeakReclaimed(t *testing.T) {
	mr := newHostRecordingMR(t)
	logs := captureDebugLog(t)
	require.NoError(t, hostLeak(mr))
	require.Equal(t, 1, mr.liveCount())
	deadline := time.Now().Add(5 * time.Second)
	for mr.liveCount() > 0 && time.Now().Before(deadline) {
		runtime.GC()
		time.Sleep(2 * time.Millisecond)
	}
	require.Zero(t, mr.liveCount(), "the leaked vector's memory was not reclaimed")
	// Only this vector's record counts: a vector another test leaked may be reclaimed meanwhile.
	var found bool
	for i := 0; i < 100 && !found; i++ {
		for _, r := range logs.all() {
			if r["msg"] == "rmm: host vector reclaimed without Close (leak)" && r["type"] == "HostVector[int64]" {
				found = true
				assert.EqualValues(t, 8000, r["bytes"])
			}
		}
		time.Sleep(time.Millisecond)
	}
	require.True(t, found, "the leak is reported in the debug log (as a HostVector[int64] of 8000 bytes)")
}

// GPU: a large copy is still in flight when the method returns, and host access waits for it.
func TestGPUHostVectorAsync(t *testing.T) {
	requireGPU(t)
	s := gpuStream(t)
	const n = 128 << 20 // 512 MiB of float32: tens of milliseconds over PCIe
	v, err := NewUvector[float32](n, s, nil)
	require.NoError(t, err)
	defer v.Close()
	require.NoError(t, v.Fill(1.25, s))
	require.NoError(t, s.Synchronize())

	h, err := NewHostVector[float32](n, nil)
	require.NoError(t, err)
	defer h.Close()
	require.NoError(t, h.CopyFromDeviceAsync(v, s))
	done, err := s.Query()
	require.NoError(t, err)
	require.False(t, done, "the device-to-host copy of 512 MiB finished before CopyFromDeviceAsync returned: not asynchronous")
	pending, err := h.Pending()
	require.NoError(t, err)
	require.True(t, pending)

	x, err := h.At(n - 1) // waits for the copy
	require.NoError(t, err)
	require.Equal(t, float32(1.25), x)
	done, err = s.Query()
	require.NoError(t, err)
	require.True(t, done, "host access waited for the copy")
	hs, err := h.Slice()
	require.NoError(t, err)
	for i := 0; i < n; i += 4093 {
		if hs[i] != 1.25 {
			t.Fatalf("element %d = %v after the copy, want 1.25", i, hs[i])
		}
	}

	// Host to device, also asynchronous.
	for i := range hs {
		hs[i] = float32(i % 1000)
	}
	require.NoError(t, h.CopyToDeviceAsync(v, s))
	done, err = s.Query()
	require.NoError(t, err)
	require.False(t, done, "the host-to-device copy of 512 MiB finished before CopyToDeviceAsync returned")
	// v is written on s: a copy of it on s2 must be ordered after s by the caller.
	s2 := gpuStream(t)
	ev, err := NewEvent(0, nil)
	require.NoError(t, err)
	defer ev.Close()
	require.NoError(t, ev.Record(s))
	require.NoError(t, s2.WaitEvent(ev))
	h2, err := NewHostVector[float32](n, nil)
	require.NoError(t, err)
	defer h2.Close()
	require.NoError(t, h2.CopyFromDeviceAsync(v, s2))
	out, err := h2.Slice()
	require.NoError(t, err)
	for i := 0; i < n; i += 4093 {
		if out[i] != float32(i%1000) {
			t.Fatalf("element %d = %v after the round trip, want %v", i, out[i], float32(i%1000))
		}
	}
	require.Equal(t, float32((n-1)%1000), out[n-1])
}

// GPU: a copy queued on a second stream while the first one's copy into the same host vector is
// in flight is ordered after it on the device.
func TestGPUHostVectorCrossStreamOrder(t *testing.T) {
	requireGPU(t)
	s1, s2 := gpuStream(t), gpuStream(t)
	const n = 64 << 20
	a, err := NewUvector[int32](n, s1, nil)
	require.NoError(t, err)
	defer a.Close()
	b, err := NewUvector[int32](n, s2, nil)
	require.NoError(t, err)
	defer b.Close()
	require.NoError(t, a.Fill(1, s1))
	require.NoError(t, b.Fill(2, s2))
	require.NoError(t, s1.Synchronize())
	require.NoError(t, s2.Synchronize())

	h, err := NewHostVector[int32](n, nil)
	require.NoError(t, err)
	defer h.Close()
	// a → h on s1, then h → b on s2: the second must see a's values, not the zeros h started with.
	require.NoError(t, h.CopyFromDeviceAsync(a, s1))
	require.NoError(t, h.CopyToDeviceAsync(b, s2))
	got, err := b.ToSlice(s2)
	require.NoError(t, err)
	for i := 0; i < n; i += 999 {
		if got[i] != 1 {
			t.Fatalf("b[%d] = %d: the copy on the second stream ran before the first finished", i, got[i])
		}
	}
}

// GPU: a host vector over pinned memory to a vector in pinned memory (both host-accessible: the
// unified-addressing path).
func TestGPUHostVectorToPinnedVector(t *testing.T) {
	requireGPU(t)
	s := gpuStream(t)
	pool, err := NewPoolMemoryResource(hostPinned(t), &PoolOptions{InitialPoolSize: 16 << 20})
	require.NoError(t, err)
	defer pool.Close()
	v, err := NewUvector[int64](1<<20, s, pool)
	require.NoError(t, err)
	defer v.Close()
	h, err := NewHostVector[int64](1<<20, nil)
	require.NoError(t, err)
	defer h.Close()
	hs, _ := h.Slice()
	for i := range hs {
		hs[i] = int64(i) * 3
	}
	require.NoError(t, h.CopyToDeviceAsync(v, s))
	require.NoError(t, h.Wait())
	got, err := v.ToSlice(s)
	require.NoError(t, err)
	require.Equal(t, hs, got)
}

// A nil *HostVector reads as an empty vector (no elements, no memory), closes with nil, and every
// call that can fail returns ErrInvalidArgument naming the nil vector.
func TestHostVectorNil(t *testing.T) {
	var h *HostVector[uint16]
	require.Zero(t, h.Len())
	require.Zero(t, h.Cap())
	require.Zero(t, h.SizeBytes())
	require.Nil(t, h.Data())
	require.Nil(t, h.MemoryResource())
	require.NoError(t, h.Close())
	require.NoError(t, h.Close())
	s := newHostStream(t)
	dev, err := NewUvector[uint16](2, s, NewSystemMemoryResource())
	require.NoError(t, err)
	defer dev.Close()
	requireNilErr(t, "HostVector[uint16]", map[string]func() error{
		"Wait":                func() error { return h.Wait() },
		"Pending":             func() error { _, err := h.Pending(); return err },
		"Slice":               func() error { out, err := h.Slice(); require.Nil(t, out); return err },
		"At":                  func() error { _, err := h.At(0); return err },
		"Set":                 func() error { return h.Set(0, 1) },
		"Resize":              func() error { return h.Resize(4) },
		"CopyToDeviceAsync":   func() error { return h.CopyToDeviceAsync(dev, s) },
		"CopyFromDeviceAsync": func() error { return h.CopyFromDeviceAsync(dev, s) },
	})
}
