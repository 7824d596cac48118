package rmm

import (
	"bytes"
	"errors"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// seq returns n bytes 1, 2, 3, ... (mod 256).
func seq(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i + 1)
	}
	return b
}

func newHostStream(t *testing.T) StreamView {
	t.Helper()
	st, err := NewStream(0, nil)
	require.NoError(t, err)
	t.Cleanup(func() { st.Close() })
	return st.View()
}

func TestDeviceBufferNew(t *testing.T) {
	mr := newTestResource()
	s := newHostStream(t)
	b, err := NewDeviceBuffer(1000, s, mr)
	require.NoError(t, err)
	assert.Equal(t, 1000, b.Len())
	assert.Equal(t, 1000, b.Cap())
	assert.False(t, b.IsEmpty())
	assert.NotZero(t, b.Data())
	assert.Zero(t, b.Data()%Alignment)
	assert.Equal(t, s, b.Stream())
	assert.Same(t, mr, b.MemoryResource())
	assert.Equal(t, CurrentDevice(), b.Device())
	assert.Equal(t, HostAccessible, b.Access()&HostAccessible)
	assert.Equal(t, 1000, mr.liveBytes())
	require.NoError(t, b.Close())
	allocs, frees, live := mr.counts()
	assert.Equal(t, []int{1, 1, 0}, []int{allocs, frees, live})
	assert.Equal(t, s, mr.lastFreeS, "Close frees on the buffer's stream")
}

func TestDeviceBufferNewDefaultsAndErrors(t *testing.T) {
	b, err := NewDeviceBuffer(16, DefaultStream, nil)
	require.NoError(t, err)
	assert.Equal(t, CurrentDeviceResource(), b.MemoryResource(), "nil mr is the current device resource")
	assert.Equal(t, DefaultStream, b.Stream())
	require.NoError(t, b.Close())

	mr := newTestResource()
	z, err := NewDeviceBuffer(0, DefaultStream, mr)
	require.NoError(t, err)
	assert.True(t, z.IsEmpty())
	assert.Zero(t, z.Data())
	assert.Zero(t, z.Cap())
	require.NoError(t, z.Close())
	allocs, _, _ := mr.counts()
	assert.Zero(t, allocs, "a zero-size buffer never calls the resource")

	_, err = NewDeviceBuffer(-1, DefaultStream, mr)
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.Contains(t, err.Error(), "NewDeviceBuffer")
	assert.Contains(t, err.Error(), "-1")

	mr.setFailNext(1)
	_, err = NewDeviceBuffer(4096, DefaultStream, mr)
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.Contains(t, err.Error(), "4096")
}

func TestDeviceBufferFromHostAndDevice(t *testing.T) {
	mr := newTestResource()
	src := seq(777)
	a, err := NewDeviceBufferFromHost(src, DefaultStream, mr)
	require.NoError(t, err)
	defer a.Close()
	got, err := a.Bytes(DefaultStream)
	require.NoError(t, err)
	assert.Equal(t, src, got)
	src[0] = 99 // the buffer holds its own copy
	got, _ = a.Bytes(DefaultStream)
	assert.Equal(t, byte(1), got[0])

	b, err := NewDeviceBufferFromDevice(a.Data()+7, 100, DefaultStream, mr)
	require.NoError(t, err)
	defer b.Close()
	got, err = b.Bytes(DefaultStream)
	require.NoError(t, err)
	assert.Equal(t, seq(777)[7:107], got)

	allocsBefore, _, _ := mr.counts()
	_, err = NewDeviceBufferFromDevice(0, 10, DefaultStream, mr)
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.Contains(t, err.Error(), "null source")
	allocsAfter, _, _ := mr.counts()
	assert.Equal(t, allocsBefore, allocsAfter, "a null source allocates nothing")

	e, err := NewDeviceBufferFromDevice(0, 0, DefaultStream, mr)
	require.NoError(t, err)
	assert.True(t, e.IsEmpty())
	require.NoError(t, e.Close())

	mr.setFailNext(1)
	_, err = NewDeviceBufferFromHost(src, DefaultStream, mr)
	require.ErrorIs(t, err, ErrOutOfMemory)
}

func TestDeviceBufferCopy(t *testing.T) {
	mr1, mr2 := newTestResource(), newTestResource()
	a, err := NewDeviceBufferFromHost(seq(300), DefaultStream, mr1)
	require.NoError(t, err)
	defer a.Close()
	require.NoError(t, a.Reserve(1000, DefaultStream))
	require.Equal(t, 1000, a.Cap())

	s := newHostStream(t)
	c, err := a.Copy(s, mr2)
	require.NoError(t, err)
	assert.Equal(t, 300, c.Len())
	assert.Equal(t, 300, c.Cap(), "a copy's capacity is the size")
	assert.Same(t, mr2, c.MemoryResource(), "a copy uses the resource argument")
	assert.Equal(t, s, c.Stream())
	assert.NotEqual(t, a.Data(), c.Data())
	got, _ := c.Bytes(DefaultStream)
	assert.Equal(t, seq(300), got)
	require.NoError(t, c.CopyFromHost(0, []byte{0xEE}, DefaultStream))
	got, _ = a.Bytes(DefaultStream)
	assert.Equal(t, byte(1), got[0], "the copy is deep")
	require.NoError(t, c.Close())

	d, err := a.Copy(DefaultStream, nil)
	require.NoError(t, err)
	assert.Equal(t, CurrentDeviceResource(), d.MemoryResource(), "nil means the current device resource, not the source's")
	require.NoError(t, d.Close())

	mr2.setFailNext(1)
	_, err = a.Copy(DefaultStream, mr2)
	require.ErrorIs(t, err, ErrOutOfMemory)
	_, _, live := mr2.counts()
	assert.Zero(t, live)
}

func TestDeviceBufferResize(t *testing.T) {
	mr := newTestResource()
	s1, s2, s3 := newHostStream(t), newHostStream(t), newHostStream(t)
	b, err := NewDeviceBufferFromHost(seq(100), s1, mr)
	require.NoError(t, err)
	defer b.Close()
	p := b.Data()

	// Shrinking changes only the size; the stream becomes s2.
	require.NoError(t, b.Resize(40, s2))
	assert.Equal(t, 40, b.Len())
	assert.Equal(t, 100, b.Cap())
	assert.Equal(t, p, b.Data())
	assert.Equal(t, s2, b.Stream())
	allocs, frees, _ := mr.counts()
	assert.Equal(t, []int{1, 0}, []int{allocs, frees})

	// Growing within the capacity: no allocation.
	require.NoError(t, b.Resize(100, s2))
	assert.Equal(t, p, b.Data())
	allocs, _, _ = mr.counts()
	assert.Equal(t, 1, allocs)

	// Growing past it: exactly n, the old size copied, the old memory freed on s3.
	require.NoError(t, b.Resize(40, s2))
	require.NoError(t, b.Resize(250, s3))
	assert.Equal(t, 250, b.Len())
	assert.Equal(t, 250, b.Cap())
	assert.NotEqual(t, p, b.Data())
	assert.Equal(t, s3, b.Stream())
	allocs, frees, live := mr.counts()
	assert.Equal(t, []int{2, 1, 1}, []int{allocs, frees, live})
	assert.Equal(t, s3, mr.lastFreeS)
	assert.Equal(t, 250, mr.liveBytes())
	got, _ := b.Bytes(DefaultStream)
	assert.Equal(t, seq(40), got[:40], "the old size (40 bytes) is kept")

	require.ErrorIs(t, b.Resize(-5, s1), ErrInvalidArgument)
	assert.ErrorContains(t, b.Resize(-5, s1), "-5")

	require.NoError(t, b.Resize(0, s1))
	assert.True(t, b.IsEmpty())
	assert.Equal(t, 250, b.Cap())
}

func TestDeviceBufferReserveAndShrink(t *testing.T) {
	mr := newTestResource()
	s1, s2 := newHostStream(t), newHostStream(t)
	b, err := NewDeviceBufferFromHost(seq(64), s1, mr)
	require.NoError(t, err)
	defer b.Close()
	p := b.Data()

	require.NoError(t, b.Reserve(10, s2))
	assert.Equal(t, []int{64, 64}, []int{b.Len(), b.Cap()})
	assert.Equal(t, p, b.Data())
	assert.Equal(t, s2, b.Stream())

	require.NoError(t, b.Reserve(512, s1))
	assert.Equal(t, []int{64, 512}, []int{b.Len(), b.Cap()})
	assert.NotEqual(t, p, b.Data())
	assert.Equal(t, s1, mr.lastFreeS)
	got, _ := b.Bytes(DefaultStream)
	assert.Equal(t, seq(64), got)
	assert.ErrorIs(t, b.Reserve(-1, s1), ErrInvalidArgument)

	require.NoError(t, b.ShrinkToFit(s2))
	assert.Equal(t, []int{64, 64}, []int{b.Len(), b.Cap()})
	assert.Equal(t, s2, b.Stream())
	got, _ = b.Bytes(DefaultStream)
	assert.Equal(t, seq(64), got)
	assert.Equal(t, 64, mr.liveBytes())

	// Already fitting: nothing is allocated.
	allocs, _, _ := mr.counts()
	require.NoError(t, b.ShrinkToFit(s1))
	allocs2, _, _ := mr.counts()
	assert.Equal(t, allocs, allocs2)

	// Shrinking an empty buffer with capacity frees it all.
	require.NoError(t, b.Resize(0, s1))
	require.NoError(t, b.ShrinkToFit(s1))
	assert.Zero(t, b.Cap())
	assert.Zero(t, b.Data())
	assert.Zero(t, mr.liveBytes())
}

// snapshot is what a failed call must leave as it was.
type bufSnapshot struct {
	p        DevicePtr
	n, c     int
	s        StreamView
	contents []byte
}

func snapBuf(t *testing.T, b *DeviceBuffer) bufSnapshot {
	got, err := b.Bytes(DefaultStream)
	require.NoError(t, err)
	return bufSnapshot{b.Data(), b.Len(), b.Cap(), b.Stream(), got}
}

func TestDeviceBufferFailedAllocationLeavesItUnchanged(t *testing.T) {
	mr := newTestResource()
	s1, s2 := newHostStream(t), newHostStream(t)
	b, err := NewDeviceBufferFromHost(seq(100), s1, mr)
	require.NoError(t, err)
	defer b.Close()
	require.NoError(t, b.Reserve(200, s1))
	before := snapBuf(t, b)

	for name, call := range map[string]func() error{
		"Resize":      func() error { return b.Resize(300, s2) },
		"Reserve":     func() error { return b.Reserve(300, s2) },
		"ShrinkToFit": func() error { return b.ShrinkToFit(s2) },
	} {
		mr.setFailNext(1)
		err := call()
		require.ErrorIs(t, err, ErrOutOfMemory, name)
		assert.Contains(t, err.Error(), "DeviceBuffer."+name, name)
		assert.Equal(t, before, snapBuf(t, b), name)
		assert.Equal(t, 200, mr.liveBytes(), name)
	}
}

func TestDeviceBufferHostCopies(t *testing.T) {
	mr := newTestResource()
	b, err := NewDeviceBuffer(64, DefaultStream, mr)
	require.NoError(t, err)
	defer b.Close()
	require.NoError(t, b.CopyFromHost(0, make([]byte, 64), DefaultStream))
	require.NoError(t, b.CopyFromHost(10, []byte{1, 2, 3}, DefaultStream))
	require.NoError(t, b.CopyFromHost(61, []byte{7, 8, 9}, DefaultStream))
	dst := make([]byte, 5)
	require.NoError(t, b.CopyToHost(dst, 9, DefaultStream))
	assert.Equal(t, []byte{0, 1, 2, 3, 0}, dst)
	require.NoError(t, b.CopyToHost(dst[:3], 61, DefaultStream))
	assert.Equal(t, []byte{7, 8, 9}, dst[:3])
	require.NoError(t, b.CopyFromHost(64, nil, DefaultStream), "an empty copy at the end is fine")

	err = b.CopyFromHost(62, []byte{1, 2, 3}, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfRange)
	assert.Contains(t, err.Error(), "DeviceBuffer.CopyFromHost")
	assert.Contains(t, err.Error(), "62")
	assert.ErrorIs(t, b.CopyFromHost(-1, []byte{1}, DefaultStream), ErrOutOfRange)
	assert.ErrorIs(t, b.CopyToHost(make([]byte, 65), 0, DefaultStream), ErrOutOfRange)
	assert.ErrorIs(t, b.CopyToHost(make([]byte, 1), 64, DefaultStream), ErrOutOfRange)
	assert.ErrorIs(t, b.CopyToHost(make([]byte, 2), int(^uint(0)>>1), DefaultStream), ErrOutOfRange)

	// CopyFromDevice from another buffer.
	src, err := NewDeviceBufferFromHost(seq(20), DefaultStream, mr)
	require.NoError(t, err)
	defer src.Close()
	require.NoError(t, b.CopyFromDevice(30, src.Data()+5, 10, DefaultStream))
	got, _ := b.Bytes(DefaultStream)
	assert.Equal(t, seq(20)[5:15], got[30:40])
	assert.Equal(t, []byte{0, 1, 2, 3}, got[9:13], "bytes around are untouched")
	assert.ErrorIs(t, b.CopyFromDevice(60, src.Data(), 10, DefaultStream), ErrOutOfRange)
	assert.ErrorIs(t, b.CopyFromDevice(0, 0, 10, DefaultStream), ErrInvalidArgument)
	assert.ErrorIs(t, b.CopyFromDevice(0, src.Data(), -1, DefaultStream), ErrInvalidArgument)
}

func TestDeviceBufferRelease(t *testing.T) {
	mr := newTestResource()
	s := newHostStream(t)
	b, err := NewDeviceBufferFromHost(seq(128), s, mr)
	require.NoError(t, err)
	want := b.Data()
	p, c := b.Release()
	assert.Equal(t, want, p)
	assert.Equal(t, 128, c)
	assert.True(t, b.IsEmpty())
	assert.Zero(t, b.Cap())
	assert.Zero(t, b.Data())
	assert.Same(t, mr, b.MemoryResource())
	assert.Equal(t, s, b.Stream())
	assert.True(t, bytes.Equal(seq(128), hostBytes(p, 128)), "the released memory keeps its contents")

	// The buffer is still usable, and Close does not free the released memory.
	require.NoError(t, b.Resize(10, s))
	require.NoError(t, b.Close())
	_, _, live := mr.counts()
	assert.Equal(t, 1, live, "the released allocation is the caller's")
	require.NoError(t, mr.Deallocate(p, c, s))
	_, _, live = mr.counts()
	assert.Zero(t, live)

	p, c = b.Release()
	assert.Zero(t, p)
	assert.Zero(t, c)
}

func TestDeviceBufferClose(t *testing.T) {
	mr := newTestResource()
	s1, s2 := newHostStream(t), newHostStream(t)
	b, err := NewDeviceBuffer(300, s1, mr)
	require.NoError(t, err)
	require.NoError(t, b.Resize(100, s1))
	b.SetStream(s2)
	assert.Equal(t, s2, b.Stream())
	require.NoError(t, b.Close())
	_, frees, live := mr.counts()
	assert.Equal(t, 1, frees)
	assert.Zero(t, live, "Close frees the whole capacity (the resource checks the size)")
	assert.Equal(t, s2, mr.lastFreeS)
	require.NoError(t, b.Close(), "closing twice")
	_, frees, _ = mr.counts()
	assert.Equal(t, 1, frees)

	assert.Zero(t, b.Len())
	assert.Zero(t, b.Cap())
	assert.Zero(t, b.Data())
	for name, err := range map[string]error{
		"Resize":         b.Resize(1, s1),
		"Reserve":        b.Reserve(1, s1),
		"ShrinkToFit":    b.ShrinkToFit(s1),
		"CopyFromHost":   b.CopyFromHost(0, nil, s1),
		"CopyToHost":     b.CopyToHost(nil, 0, s1),
		"CopyFromDevice": b.CopyFromDevice(0, 0, 0, s1),
		"Bytes":          func() error { _, err := b.Bytes(s1); return err }(),
		"Copy":           func() error { _, err := b.Copy(s1, mr); return err }(),
	} {
		require.ErrorIs(t, err, ErrClosed, name)
		assert.Contains(t, err.Error(), "DeviceBuffer."+name, name)
	}
}

func TestDeviceBufferCloseReportsFreeError(t *testing.T) {
	mr := newTestResource()
	b, err := NewDeviceBuffer(64, DefaultStream, mr)
	require.NoError(t, err)
	p, c := b.Release()
	require.NoError(t, mr.Deallocate(p, c, DefaultStream))
	// Put a bogus allocation back to provoke an invalid free.
	b.st.ptr, b.st.capacity, b.st.size = p, c, c
	err = b.Close()
	require.ErrorIs(t, err, ErrInvalidFree)
	assert.Contains(t, err.Error(), "DeviceBuffer.Close")
	assert.NoError(t, b.Close(), "the buffer is closed even so")
}

func TestDeviceBufferSimulated(t *testing.T) {
	sim, err := NewSimulatedMemoryResource(1 << 40)
	require.NoError(t, err)
	b, err := NewDeviceBuffer(1<<30, DefaultStream, sim)
	require.NoError(t, err)
	assert.Equal(t, Access(0), b.Access())
	// Reallocation works (addresses only); data access does not.
	require.NoError(t, b.Resize(1<<31, DefaultStream))
	assert.Equal(t, 1<<31, b.Cap())
	assert.Equal(t, 1<<31, sim.UsedBytes())
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	_, err = b.Bytes(DefaultStream)
	runtime.ReadMemStats(&m1)
	require.ErrorIs(t, err, ErrNotSupported)
	assert.Contains(t, err.Error(), "DeviceBuffer.Bytes")
	assert.Less(t, m1.TotalAlloc-m0.TotalAlloc, uint64(1<<20), "no 2 GiB result slice is made for memory that cannot be read")
	assert.ErrorIs(t, b.CopyFromHost(0, []byte{1}, DefaultStream), ErrNotSupported)
	assert.ErrorIs(t, b.CopyToHost(make([]byte, 1), 0, DefaultStream), ErrNotSupported)
	_, err = b.Copy(DefaultStream, sim)
	assert.ErrorIs(t, err, ErrNotSupported)
	assert.Equal(t, 1<<31, sim.UsedBytes(), "a failed copy frees what it allocated")
	require.NoError(t, b.Close())
	assert.Zero(t, sim.UsedBytes())
}

func TestDeviceBufferCopyBetweenResources(t *testing.T) {
	// Host-only memory to address-only memory: refused, naming the method.
	sim, _ := NewSimulatedMemoryResource(1 << 20)
	a, err := NewDeviceBufferFromHost(seq(10), DefaultStream, nil)
	require.NoError(t, err)
	defer a.Close()
	_, err = a.Copy(DefaultStream, sim)
	require.ErrorIs(t, err, ErrNotSupported)
	assert.True(t, errors.Is(err, ErrNotSupported))
	assert.Zero(t, sim.UsedBytes())
}

// An adopted allocation is the buffer's: its bytes are read and written through it, and Close
// (or a Resize that moves it) frees it through the resource, on the buffer's stream, once.
func TestAdoptDeviceBuffer(t *testing.T) {
	mr := newTestResource()
	s := newHostStream(t)
	p, err := mr.Allocate(4096, s)
	require.NoError(t, err)
	copy(hostBytes(p, 4096), seq(4096))
	b, err := AdoptDeviceBuffer(p, 4096, s, mr)
	require.NoError(t, err)
	assert.Equal(t, p, b.Data())
	assert.Equal(t, 4096, b.Len())
	assert.Equal(t, 4096, b.Cap())
	assert.Equal(t, s, b.Stream())
	assert.Same(t, mr, b.MemoryResource())
	got, err := b.Bytes(s)
	require.NoError(t, err)
	assert.Equal(t, seq(4096), got)
	require.NoError(t, b.Resize(8192, s), "grows into a new allocation and frees the adopted one")
	allocs, frees, live := mr.counts()
	assert.Equal(t, []int{2, 1, 1}, []int{allocs, frees, live})
	require.NoError(t, b.Close())
	_, frees, live = mr.counts()
	assert.Equal(t, []int{2, 0}, []int{frees, live})
	assert.Equal(t, s, mr.lastFreeS)

	q, err := mr.Allocate(512, s)
	require.NoError(t, err)
	c, err := AdoptDeviceBuffer(q, 512, s, mr)
	require.NoError(t, err)
	require.NoError(t, c.Close())
	allocs, frees, live = mr.counts()
	assert.Equal(t, []int{3, 3, 0}, []int{allocs, frees, live}, "freed once, with its size")

	_, err = AdoptDeviceBuffer(q, 512, s, nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = AdoptDeviceBuffer(q, -1, s, mr)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = AdoptDeviceBuffer(0, 16, s, mr)
	require.ErrorIs(t, err, ErrInvalidArgument)
	e, err := AdoptDeviceBuffer(0, 0, s, mr)
	require.NoError(t, err)
	assert.True(t, e.IsEmpty())
	require.NoError(t, e.Close())
	_, frees, _ = mr.counts()
	assert.Equal(t, 3, frees, "an empty buffer frees nothing")
}

// A nil *DeviceBuffer reads as an empty buffer (no bytes, no memory, the default stream), closes
// with nil, releases nothing, and every call that can fail returns ErrInvalidArgument naming the
// nil buffer.
func TestDeviceBufferNil(t *testing.T) {
	var b *DeviceBuffer
	require.Zero(t, b.Len())
	require.Zero(t, b.Cap())
	require.True(t, b.IsEmpty())
	require.Zero(t, b.Data())
	require.Equal(t, DefaultStream, b.Stream())
	require.Nil(t, b.MemoryResource())
	require.Zero(t, b.Device())
	require.Zero(t, b.Access())
	p, n := b.Release()
	require.Zero(t, p)
	require.Zero(t, n)
	s := newHostStream(t)
	b.SetStream(s)
	require.Equal(t, DefaultStream, b.Stream())
	require.NoError(t, b.Close())
	require.NoError(t, b.Close())
	mr := newTestResource()
	src := []byte{1, 2, 3}
	requireNilErr(t, "DeviceBuffer", map[string]func() error{
		"Copy":           func() error { c, err := b.Copy(s, mr); require.Nil(t, c); return err },
		"Resize":         func() error { return b.Resize(4, s) },
		"Reserve":        func() error { return b.Reserve(4, s) },
		"ShrinkToFit":    func() error { return b.ShrinkToFit(s) },
		"CopyFromHost":   func() error { return b.CopyFromHost(0, src, s) },
		"CopyToHost":     func() error { return b.CopyToHost(src, 0, s) },
		"Bytes":          func() error { out, err := b.Bytes(s); require.Nil(t, out); return err },
		"CopyFromDevice": func() error { return b.CopyFromDevice(0, DevicePtr(0x1000), 3, s) },
	})
	require.Zero(t, mr.liveBytes())
}
