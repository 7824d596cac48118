package rmm

import (
	"math"
	"reflect"
	"runtime"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// triple is a 12-byte element (three 4-byte fields, 4-byte aligned).
type triple struct{ A, B, C int32 }

// wide is a 16-byte element.
type wide struct{ Lo, Hi uint64 }

type withString struct {
	N    int
	Name string
}

type nested struct {
	X     float64
	Inner [2]struct {
		Y int32
		P *int
	}
}

func iota32(n int) []int32 {
	s := make([]int32, n)
	for i := range s {
		s[i] = int32(i * 3)
	}
	return s
}

func TestUvectorNew(t *testing.T) {
	mr := newTestResource()
	s := newHostStream(t)
	v, err := NewUvector[float64](100, s, mr)
	require.NoError(t, err)
	assert.Equal(t, 100, v.Len())
	assert.Equal(t, 100, v.Cap())
	assert.Equal(t, 800, v.SizeBytes())
	assert.False(t, v.IsEmpty())
	assert.Zero(t, v.Data()%Alignment)
	assert.Equal(t, s, v.Stream())
	assert.Same(t, mr, v.MemoryResource())
	assert.Equal(t, CurrentDevice(), v.Device())
	assert.NotZero(t, v.Access()&HostAccessible)
	assert.Equal(t, 800, mr.liveBytes(), "exactly n*sizeof(T) bytes")
	require.NoError(t, v.Close())
	assert.Zero(t, mr.liveBytes())
	assert.Equal(t, s, mr.lastFreeS)

	e, err := NewUvector[int32](0, DefaultStream, nil)
	require.NoError(t, err)
	assert.True(t, e.IsEmpty())
	assert.Zero(t, e.Data())
	assert.Equal(t, CurrentDeviceResource(), e.MemoryResource())
	require.NoError(t, e.Close())

	_, err = NewUvector[int32](-3, DefaultStream, mr)
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.Contains(t, err.Error(), "NewUvector[int32]")
	assert.Contains(t, err.Error(), "-3")

	_, err = NewUvector[int64](math.MaxInt/4, DefaultStream, mr)
	require.ErrorIs(t, err, ErrInvalidArgument, "n*sizeof(T) overflows")
	assert.Contains(t, err.Error(), "overflow")
	allocs, _, _ := mr.counts()
	assert.Equal(t, 1, allocs, "refused sizes never reach the resource")

	mr.setFailNext(1)
	_, err = NewUvector[int64](10, DefaultStream, mr)
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.Contains(t, err.Error(), "10 elements")
}

func TestUvectorFromSliceAndHostCopies(t *testing.T) {
	mr := newTestResource()
	src := iota32(50)
	v, err := NewUvectorFromSlice(src, DefaultStream, mr)
	require.NoError(t, err)
	defer v.Close()
	got, err := v.ToSlice(DefaultStream)
	require.NoError(t, err)
	assert.Equal(t, src, got)

	require.NoError(t, v.CopyFromHost([]int32{-1, -2}, DefaultStream))
	dst := make([]int32, 3)
	require.NoError(t, v.CopyToHost(dst, DefaultStream))
	assert.Equal(t, []int32{-1, -2, 6}, dst)

	err = v.CopyFromHost(make([]int32, 51), DefaultStream)
	require.ErrorIs(t, err, ErrOutOfRange)
	assert.Contains(t, err.Error(), "Uvector[int32].CopyFromHost: 51 elements do not fit in length 50")
	err = v.CopyToHost(make([]int32, 51), DefaultStream)
	require.ErrorIs(t, err, ErrOutOfRange)
	assert.Contains(t, err.Error(), "Uvector[int32].CopyToHost: 51 elements asked from length 50")

	empty, err := NewUvectorFromSlice([]int32{}, DefaultStream, mr)
	require.NoError(t, err)
	got, err = empty.ToSlice(DefaultStream)
	require.NoError(t, err)
	assert.Empty(t, got)
	require.NoError(t, empty.Close())

	mr.setFailNext(1)
	_, err = NewUvectorFromSlice(src, DefaultStream, mr)
	require.ErrorIs(t, err, ErrOutOfMemory)
}

func TestUvectorElements(t *testing.T) {
	v, err := NewUvectorFromSlice(iota32(10), DefaultStream, nil)
	require.NoError(t, err)
	defer v.Close()

	for _, i := range []int{0, 9} {
		x, err := v.Element(i, DefaultStream)
		require.NoError(t, err)
		assert.Equal(t, int32(i*3), x)
		require.NoError(t, v.SetElement(i, int32(1000+i), DefaultStream))
		x, err = v.Element(i, DefaultStream)
		require.NoError(t, err)
		assert.Equal(t, int32(1000+i), x)
	}
	f, err := v.Front(DefaultStream)
	require.NoError(t, err)
	assert.Equal(t, int32(1000), f)
	b, err := v.Back(DefaultStream)
	require.NoError(t, err)
	assert.Equal(t, int32(1009), b)

	require.NoError(t, v.SetElementToZero(9, DefaultStream))
	b, _ = v.Back(DefaultStream)
	assert.Zero(t, b)
	got, _ := v.ToSlice(DefaultStream)
	assert.Equal(t, []int32{1000, 3, 6, 9, 12, 15, 18, 21, 24, 0}, got)

	for _, i := range []int{-1, 10, 11, math.MaxInt} {
		_, err := v.Element(i, DefaultStream)
		require.ErrorIs(t, err, ErrOutOfRange)
		assert.Contains(t, err.Error(), "Uvector[int32].Element")
		assert.Contains(t, err.Error(), "length 10")
		assert.Contains(t, err.Error(), "index ")
		assert.ErrorIs(t, v.SetElement(i, 1, DefaultStream), ErrOutOfRange)
		assert.ErrorIs(t, v.SetElementToZero(i, DefaultStream), ErrOutOfRange)
	}
	_, err = v.Element(10, DefaultStream)
	assert.Contains(t, err.Error(), "index 10, length 10")

	assert.Equal(t, v.Data(), v.ElementPtr(0))
	assert.Equal(t, v.Data()+36, v.ElementPtr(9))
	assert.PanicsWithValue(t, "rmm: Uvector[int32].ElementPtr: index 10 out of range [0, 10)", func() { v.ElementPtr(10) })
	assert.Panics(t, func() { v.ElementPtr(-1) })

	e, err := NewUvector[int32](0, DefaultStream, nil)
	require.NoError(t, err)
	defer e.Close()
	_, err = e.Front(DefaultStream)
	require.ErrorIs(t, err, ErrOutOfRange)
	assert.Contains(t, err.Error(), "Uvector[int32].Front: empty")
	_, err = e.Back(DefaultStream)
	require.ErrorIs(t, err, ErrOutOfRange)
	assert.Contains(t, err.Error(), "Uvector[int32].Back: empty")
	// Capacity does not make elements: still empty after Reserve.
	require.NoError(t, e.Reserve(4, DefaultStream))
	_, err = e.Back(DefaultStream)
	assert.ErrorIs(t, err, ErrOutOfRange)
}

func TestUvectorNegativeZeroPreserved(t *testing.T) {
	negZero := math.Copysign(0, -1)
	v, err := NewUvector[float64](3, DefaultStream, nil)
	require.NoError(t, err)
	defer v.Close()
	require.NoError(t, v.Fill(1.5, DefaultStream))
	require.NoError(t, v.SetElement(1, negZero, DefaultStream))
	x, err := v.Element(1, DefaultStream)
	require.NoError(t, err)
	assert.True(t, math.Signbit(x), "-0.0 keeps its sign")
	assert.Equal(t, math.Float64bits(negZero), math.Float64bits(x))

	f32, err := NewUvector[float32](1, DefaultStream, nil)
	require.NoError(t, err)
	defer f32.Close()
	require.NoError(t, f32.SetElement(0, float32(negZero), DefaultStream))
	y, _ := f32.Front(DefaultStream)
	assert.True(t, math.Signbit(float64(y)))

	// A fill with -0.0 keeps it too.
	require.NoError(t, v.Fill(negZero, DefaultStream))
	got, _ := v.ToSlice(DefaultStream)
	for _, g := range got {
		assert.True(t, math.Signbit(g))
	}
}

// checkFill fills a vector of n elements with x, then a subspan [off, off+cnt) with y, and checks
// every element.
func checkFill[T comparable](t *testing.T, mr MemoryResource, n, off, cnt int, x, y T) {
	t.Helper()
	v, err := NewUvector[T](n, DefaultStream, mr)
	require.NoError(t, err)
	defer v.Close()
	require.NoError(t, v.Fill(x, DefaultStream))
	got, err := v.ToSlice(DefaultStream)
	require.NoError(t, err)
	for i := range got {
		if got[i] != x {
			t.Fatalf("%s of %d: element %d is %v after Fill(%v)", v.st.kind, n, i, got[i], x)
		}
	}
	sub, err := v.Span().Subspan(off, cnt)
	require.NoError(t, err)
	require.NoError(t, sub.Fill(y, DefaultStream))
	got, err = v.ToSlice(DefaultStream)
	require.NoError(t, err)
	for i := range got {
		want := x
		if i >= off && i < off+cnt {
			want = y
		}
		if got[i] != want {
			t.Fatalf("%s of %d: element %d is %v, want %v, after filling [%d, %d) with %v", v.st.kind, n, i, got[i], want, off, off+cnt, y)
		}
	}
}

func TestUvectorFillWidths(t *testing.T) {
	mr := newTestResource()
	for _, n := range []int{1, 2, 7, 1000, 4099} {
		off, cnt := 1, n-2
		if n < 3 {
			off, cnt = n-1, 1
		}
		checkFill[uint8](t, mr, n, off, cnt, 0xA5, 0x3C)
		checkFill[uint16](t, mr, n, off, cnt, 0xBEEF, 0x1234)
		checkFill[float32](t, mr, n, off, cnt, -2.5, 7.25)
		checkFill[int64](t, mr, n, off, cnt, -0x0102030405060708, 0x1122334455667788)
		checkFill[wide](t, mr, n, off, cnt, wide{1, 2}, wide{0xFFFFFFFFFFFFFFFF, 3})
		checkFill[complex128](t, mr, n, off, cnt, complex(1, -1), complex(-3, 4))
		checkFill[triple](t, mr, n, off, cnt, triple{1, -2, 3}, triple{-7, 8, -9})
		checkFill[[3]byte](t, mr, n, off, cnt, [3]byte{1, 2, 3}, [3]byte{9, 8, 7})
	}
	assert.Zero(t, mr.liveBytes())

	// Fill of an empty vector touches nothing.
	e, err := NewUvector[triple](0, DefaultStream, mr)
	require.NoError(t, err)
	require.NoError(t, e.Fill(triple{1, 2, 3}, DefaultStream))
	require.NoError(t, e.Close())
}

func TestHostFill(t *testing.T) {
	for _, w := range []int{1, 2, 3, 4, 5, 8, 12, 16, 100} {
		for _, n := range []int{0, 1, 2, 3, 17, 64} {
			elem := seq(w)
			b := make([]byte, w*n)
			hostFill(b, elem)
			for i := 0; i < n; i++ {
				require.Equal(t, elem, b[i*w:(i+1)*w], "width %d, count %d, element %d", w, n, i)
			}
		}
	}
}

func TestUvectorResizeReserveShrink(t *testing.T) {
	mr := newTestResource()
	s1, s2 := newHostStream(t), newHostStream(t)
	v, err := NewUvectorFromSlice(iota32(10), s1, mr)
	require.NoError(t, err)
	defer v.Close()
	p := v.Data()

	require.NoError(t, v.Resize(4, s2))
	assert.Equal(t, []int{4, 10}, []int{v.Len(), v.Cap()})
	assert.Equal(t, p, v.Data())
	assert.Equal(t, s2, v.Stream())

	require.NoError(t, v.Resize(25, s1))
	assert.Equal(t, []int{25, 25}, []int{v.Len(), v.Cap()})
	assert.Equal(t, 100, mr.liveBytes(), "exactly 25 elements")
	assert.Equal(t, s1, mr.lastFreeS)
	got, _ := v.ToSlice(DefaultStream)
	assert.Equal(t, iota32(4), got[:4])

	require.NoError(t, v.Reserve(40, s2))
	assert.Equal(t, []int{25, 40}, []int{v.Len(), v.Cap()})
	assert.Equal(t, 160, mr.liveBytes())
	got, _ = v.ToSlice(DefaultStream)
	assert.Equal(t, iota32(4), got[:4])

	require.NoError(t, v.ShrinkToFit(s1))
	assert.Equal(t, []int{25, 25}, []int{v.Len(), v.Cap()})
	assert.Equal(t, 100, mr.liveBytes())
	assert.Equal(t, s1, v.Stream())

	for _, n := range []int{-1, math.MaxInt / 2} {
		err := v.Resize(n, s1)
		require.ErrorIs(t, err, ErrInvalidArgument)
		assert.Contains(t, err.Error(), "Uvector[int32].Resize")
		require.ErrorIs(t, v.Reserve(n, s1), ErrInvalidArgument)
	}

	// A failed allocation leaves everything as it was.
	before := snapVec(t, v)
	for name, call := range map[string]func() error{
		"Resize":  func() error { return v.Resize(100, s2) },
		"Reserve": func() error { return v.Reserve(100, s2) },
	} {
		mr.setFailNext(1)
		err := call()
		require.ErrorIs(t, err, ErrOutOfMemory, name)
		assert.Contains(t, err.Error(), "Uvector[int32]."+name)
		assert.Equal(t, before, snapVec(t, v), name)
	}
	require.NoError(t, v.Resize(5, s1))
	before = snapVec(t, v)
	mr.setFailNext(1)
	require.ErrorIs(t, v.ShrinkToFit(s2), ErrOutOfMemory)
	assert.Equal(t, before, snapVec(t, v))
	assert.Equal(t, 100, mr.liveBytes())
}

type vecSnapshot struct {
	p        DevicePtr
	n, c     int
	s        StreamView
	contents []int32
}

func snapVec(t *testing.T, v *Uvector[int32]) vecSnapshot {
	got, err := v.ToSlice(DefaultStream)
	require.NoError(t, err)
	return vecSnapshot{v.Data(), v.Len(), v.Cap(), v.Stream(), got}
}

func TestUvectorRelease(t *testing.T) {
	mr := newTestResource()
	s := newHostStream(t)
	v, err := NewUvectorFromSlice(iota32(8), s, mr)
	require.NoError(t, err)
	require.NoError(t, v.Reserve(16, s))
	p := v.Data()
	b := v.Release()
	require.NotNil(t, b)
	assert.Equal(t, p, b.Data())
	assert.Equal(t, 32, b.Len())
	assert.Equal(t, 64, b.Cap())
	assert.Equal(t, s, b.Stream())
	assert.Same(t, mr, b.MemoryResource())
	assert.True(t, v.IsEmpty())
	assert.Zero(t, v.Cap())
	assert.Zero(t, v.Data())
	raw, _ := b.Bytes(DefaultStream)
	assert.Equal(t, iota32(8), unsafe.Slice((*int32)(unsafe.Pointer(&raw[0])), 8))

	// The vector stays usable; its Close does not touch the released memory.
	require.NoError(t, v.Resize(2, s))
	require.NoError(t, v.Close())
	assert.Equal(t, 64, mr.liveBytes())
	require.NoError(t, b.Close())
	assert.Zero(t, mr.liveBytes())
	assert.Nil(t, v.Release(), "Release after Close")
}

func TestUvectorCopies(t *testing.T) {
	mr1, mr2 := newTestResource(), newTestResource()
	a, err := NewUvectorFromSlice(iota32(20), DefaultStream, mr1)
	require.NoError(t, err)
	defer a.Close()
	b, err := NewUvector[int32](30, DefaultStream, mr2)
	require.NoError(t, err)
	defer b.Close()
	require.NoError(t, b.Fill(-1, DefaultStream))

	require.NoError(t, b.CopyFrom(a, DefaultStream))
	got, _ := b.ToSlice(DefaultStream)
	assert.Equal(t, iota32(20), got[:20])
	assert.Equal(t, int32(-1), got[20])

	sub, err := a.Span().Subspan(5, 3)
	require.NoError(t, err)
	dst, err := b.Span().Subspan(25, 5)
	require.NoError(t, err)
	require.NoError(t, dst.CopyFrom(sub, DefaultStream))
	got, _ = b.ToSlice(DefaultStream)
	assert.Equal(t, []int32{15, 18, 21, -1, -1}, got[25:])
	require.NoError(t, b.CopyFrom(sub, DefaultStream))
	got, _ = b.ToSlice(DefaultStream)
	assert.Equal(t, []int32{15, 18, 21, 9}, got[:4])

	err = a.CopyFrom(b, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfRange)
	assert.Contains(t, err.Error(), "30 source elements do not fit in length 20")

	// Overlapping ranges of one vector are refused; the same range is a no-op.
	lo, _ := b.Span().Subspan(0, 10)
	hi, _ := b.Span().Subspan(5, 10)
	require.ErrorIs(t, hi.CopyFrom(lo, DefaultStream), ErrInvalidArgument)
	require.NoError(t, lo.CopyFrom(lo, DefaultStream))

	c, err := a.Copy(DefaultStream, mr2)
	require.NoError(t, err)
	assert.Equal(t, []int{20, 20}, []int{c.Len(), c.Cap()})
	assert.Same(t, mr2, c.MemoryResource())
	got, _ = c.ToSlice(DefaultStream)
	assert.Equal(t, iota32(20), got)
	require.NoError(t, c.Close())
	require.ErrorIs(t, b.CopyFrom(c, DefaultStream), ErrClosed, "a closed source")
	var nilVec *Uvector[int32]
	require.ErrorIs(t, b.CopyFrom(nilVec, DefaultStream), ErrInvalidArgument)
	require.ErrorIs(t, b.CopyFrom(nil, DefaultStream), ErrInvalidArgument)

	mr2.setFailNext(1)
	_, err = a.Copy(DefaultStream, mr2)
	require.ErrorIs(t, err, ErrOutOfMemory)
}

func TestUvectorClosed(t *testing.T) {
	mr := newTestResource()
	v, err := NewUvectorFromSlice(iota32(4), DefaultStream, mr)
	require.NoError(t, err)
	require.NoError(t, v.Close())
	require.NoError(t, v.Close())
	_, frees, live := mr.counts()
	assert.Equal(t, []int{1, 0}, []int{frees, live})
	assert.Zero(t, v.Len())
	assert.Zero(t, v.Cap())
	assert.True(t, v.Span().IsEmpty())
	other, _ := NewUvector[int32](4, DefaultStream, mr)
	defer other.Close()
	for name, err := range map[string]error{
		"Element":          func() error { _, err := v.Element(0, DefaultStream); return err }(),
		"SetElement":       v.SetElement(0, 1, DefaultStream),
		"SetElementToZero": v.SetElementToZero(0, DefaultStream),
		"Front":            func() error { _, err := v.Front(DefaultStream); return err }(),
		"Back":             func() error { _, err := v.Back(DefaultStream); return err }(),
		"Resize":           v.Resize(1, DefaultStream),
		"Reserve":          v.Reserve(1, DefaultStream),
		"ShrinkToFit":      v.ShrinkToFit(DefaultStream),
		"CopyFromHost":     v.CopyFromHost(nil, DefaultStream),
		"CopyToHost":       v.CopyToHost(nil, DefaultStream),
		"ToSlice":          func() error { _, err := v.ToSlice(DefaultStream); return err }(),
		"CopyFrom":         v.CopyFrom(other, DefaultStream),
		"Fill":             v.Fill(1, DefaultStream),
		"Copy":             func() error { _, err := v.Copy(DefaultStream, nil); return err }(),
	} {
		require.ErrorIs(t, err, ErrClosed, name)
		assert.Contains(t, err.Error(), "rmm: Uvector[int32]."+name+": called after Close: use after close", name)
	}
}

func TestUvectorSimulated(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 40)
	v, err := NewUvector[float32](1<<28, DefaultStream, sim)
	require.NoError(t, err)
	defer v.Close()
	err = v.Fill(1, DefaultStream)
	require.ErrorIs(t, err, ErrNotSupported)
	assert.Contains(t, err.Error(), "Uvector[float32].Fill")
	_, err = v.Element(0, DefaultStream)
	assert.ErrorIs(t, err, ErrNotSupported)
	assert.ErrorIs(t, v.SetElement(0, 1, DefaultStream), ErrNotSupported)
	assert.ErrorIs(t, v.SetElementToZero(0, DefaultStream), ErrNotSupported)
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	_, err = v.ToSlice(DefaultStream)
	runtime.ReadMemStats(&m1)
	assert.ErrorIs(t, err, ErrNotSupported)
	assert.Less(t, m1.TotalAlloc-m0.TotalAlloc, uint64(1<<20), "no 1 GiB result slice is made for memory that cannot be read")
	require.NoError(t, v.Resize(1<<29, DefaultStream), "reallocation needs no data access")
	assert.Equal(t, 1<<31, sim.UsedBytes())

	h, err := NewUvector[float32](4, DefaultStream, nil)
	require.NoError(t, err)
	defer h.Close()
	sub, err := v.Span().Subspan(0, 4)
	require.NoError(t, err)
	assert.ErrorIs(t, h.CopyFrom(sub, DefaultStream), ErrNotSupported)
	assert.ErrorIs(t, sub.CopyFrom(h, DefaultStream), ErrNotSupported)
}

func TestElementTypeRefusal(t *testing.T) {
	cases := []struct {
		name  string
		make  func() error
		parts []string
	}{
		{"pointer", func() error { _, err := NewUvector[*int](1, DefaultStream, nil); return err }, []string{"*int", "pointer"}},
		{"slice", func() error { _, err := NewUvector[[]int](1, DefaultStream, nil); return err }, []string{"[]int", "slice"}},
		{"string", func() error { _, err := NewUvector[string](1, DefaultStream, nil); return err }, []string{"string"}},
		{"map", func() error { _, err := NewUvector[map[int]int](1, DefaultStream, nil); return err }, []string{"map[int]int"}},
		{"chan", func() error { _, err := NewUvector[chan int](1, DefaultStream, nil); return err }, []string{"chan int", "channel"}},
		{"func", func() error { _, err := NewUvector[func()](1, DefaultStream, nil); return err }, []string{"func()", "function"}},
		{"interface", func() error { _, err := NewUvector[any](1, DefaultStream, nil); return err }, []string{"interface"}},
		{"unsafe.Pointer", func() error { _, err := NewUvector[unsafe.Pointer](1, DefaultStream, nil); return err }, []string{"unsafe.Pointer"}},
		{"struct field", func() error { _, err := NewUvector[withString](1, DefaultStream, nil); return err }, []string{"rmm.withString", "field .Name", "string"}},
		{"nested", func() error { _, err := NewUvector[nested](1, DefaultStream, nil); return err }, []string{"rmm.nested", "field .Inner[0].P", "*int"}},
		{"array", func() error { _, err := NewUvector[[4]*byte](1, DefaultStream, nil); return err }, []string{"[4]*uint8", "field [0]"}},
		{"zero size", func() error { _, err := NewUvector[struct{}](1, DefaultStream, nil); return err }, []string{"struct {}", "size 0"}},
		{"scalar", func() error { _, err := NewScalar[string](DefaultStream, nil); return err }, []string{"NewScalar[string]", "string"}},
		{"span", func() error { _, err := NewDeviceSpan[map[int]int](0, 0, 0, HostAccessible); return err }, []string{"map[int]int"}},
		{"from slice", func() error { _, err := NewUvectorFromSlice([]string{"a"}, DefaultStream, nil); return err }, []string{"NewUvectorFromSlice[string]"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for range 2 { // the second answer comes from the cache
				err := c.make()
				require.ErrorIs(t, err, ErrInvalidArgument)
				for _, p := range c.parts {
					assert.Contains(t, err.Error(), p)
				}
			}
		})
	}
	// Plain data of every shape is accepted.
	type ok struct {
		A [3]complex64
		B struct {
			U uintptr
			F bool
		}
		C [0]*int // an empty array holds nothing
	}
	v, err := NewUvector[ok](2, DefaultStream, nil)
	require.NoError(t, err)
	require.NoError(t, v.Close())
	_, cached := elemTypeChecks.Load(reflect.TypeFor[ok]())
	assert.True(t, cached)
}

func TestDeviceSpan(t *testing.T) {
	v, err := NewUvectorFromSlice(iota32(10), DefaultStream, nil)
	require.NoError(t, err)
	defer v.Close()
	sp := v.Span()
	assert.Equal(t, v.Data(), sp.Data())
	assert.Equal(t, 10, sp.Len())
	assert.Equal(t, 40, sp.SizeBytes())
	assert.False(t, sp.IsEmpty())
	assert.Equal(t, v.Device(), sp.Device())
	assert.Equal(t, v.Access(), sp.Access())
	assert.Equal(t, sp, sp.Span())

	sub, err := sp.Subspan(3, 4)
	require.NoError(t, err)
	assert.Equal(t, v.Data()+12, sub.Data())
	assert.Equal(t, 4, sub.Len())
	assert.Equal(t, 16, sub.SizeBytes())
	got := make([]int32, 4)
	require.NoError(t, sub.CopyToHost(got, DefaultStream))
	assert.Equal(t, []int32{9, 12, 15, 18}, got)
	require.NoError(t, sub.CopyFromHost([]int32{-9}, DefaultStream))
	x, _ := v.Element(3, DefaultStream)
	assert.Equal(t, int32(-9), x)
	assert.ErrorIs(t, sub.CopyFromHost(make([]int32, 5), DefaultStream), ErrOutOfRange)
	assert.ErrorIs(t, sub.CopyToHost(make([]int32, 5), DefaultStream), ErrOutOfRange)

	end, err := sp.Subspan(10, 0)
	require.NoError(t, err)
	assert.True(t, end.IsEmpty())
	for _, c := range [][2]int{{-1, 2}, {0, 11}, {9, 2}, {11, 0}, {2, -1}, {1, math.MaxInt}} {
		_, err := sp.Subspan(c[0], c[1])
		require.ErrorIs(t, err, ErrOutOfRange, "%v", c)
		assert.Contains(t, err.Error(), "DeviceSpan[int32].Subspan")
		assert.Contains(t, err.Error(), "length 10")
	}

	var zero DeviceSpan[int32]
	assert.True(t, zero.IsEmpty())
	assert.Zero(t, zero.SizeBytes())
	require.NoError(t, zero.Fill(1, DefaultStream), "filling nothing")

	ext, err := NewDeviceSpan[int32](v.Data()+4, 2, v.Device(), v.Access())
	require.NoError(t, err)
	require.NoError(t, ext.Fill(77, DefaultStream))
	got2, _ := v.ToSlice(DefaultStream)
	assert.Equal(t, []int32{0, 77, 77, -9}, got2[:4])
	_, err = NewDeviceSpan[int32](0, 2, 0, HostAccessible)
	assert.ErrorIs(t, err, ErrInvalidArgument)
	_, err = NewDeviceSpan[int32](v.Data(), -2, 0, HostAccessible)
	assert.ErrorIs(t, err, ErrInvalidArgument)
}

// requireNilErr checks that each call, made on a nil container of the named kind, returns an error
// wrapping ErrInvalidArgument that names the method and the nil container.
func requireNilErr(t *testing.T, kind string, calls map[string]func() error) {
	t.Helper()
	for op, call := range calls {
		err := call()
		require.ErrorIs(t, err, ErrInvalidArgument, op)
		require.EqualError(t, err, "rmm: "+kind+"."+op+": called on a nil *"+kind+": invalid argument", op)
	}
}

// A nil *Uvector reads as an empty vector, as a nil slice does: no elements, no memory, the
// default stream; Close returns nil; SetStream changes nothing; ElementPtr panics as indexing an
// empty slice does; every call that can fail returns ErrInvalidArgument naming the nil vector.
func TestUvectorNil(t *testing.T) {
	var v *Uvector[int32]
	require.Zero(t, v.Len())
	require.Zero(t, v.Cap())
	require.Zero(t, v.SizeBytes())
	require.True(t, v.IsEmpty())
	require.Zero(t, v.Data())
	require.Equal(t, DeviceSpan[int32]{}, v.Span())
	require.Equal(t, DefaultStream, v.Stream())
	require.Nil(t, v.MemoryResource())
	require.Zero(t, v.Device())
	require.Zero(t, v.Access())
	require.Nil(t, v.Release())
	s := newHostStream(t)
	v.SetStream(s)
	require.Equal(t, DefaultStream, v.Stream())
	require.NoError(t, v.Close())
	require.NoError(t, v.Close())
	require.PanicsWithValue(t, "rmm: Uvector[int32].ElementPtr: index 0 out of range [0, 0)", func() { v.ElementPtr(0) })
	mr := newTestResource()
	src, err := NewUvectorFromSlice([]int32{1, 2}, s, mr)
	require.NoError(t, err)
	defer src.Close()
	requireNilErr(t, "Uvector[int32]", map[string]func() error{
		"Copy":             func() error { c, err := v.Copy(s, mr); require.Nil(t, c); return err },
		"Element":          func() error { _, err := v.Element(0, s); return err },
		"SetElement":       func() error { return v.SetElement(0, 1, s) },
		"SetElementToZero": func() error { return v.SetElementToZero(0, s) },
		"Front":            func() error { _, err := v.Front(s); return err },
		"Back":             func() error { _, err := v.Back(s); return err },
		"Resize":           func() error { return v.Resize(4, s) },
		"Reserve":          func() error { return v.Reserve(4, s) },
		"ShrinkToFit":      func() error { return v.ShrinkToFit(s) },
		"CopyFromHost":     func() error { return v.CopyFromHost(nil, s) },
		"CopyToHost":       func() error { return v.CopyToHost(nil, s) },
		"ToSlice":          func() error { out, err := v.ToSlice(s); require.Nil(t, out); return err },
		"CopyFrom":         func() error { return v.CopyFrom(src, s) },
		"Fill":             func() error { return v.Fill(7, s) },
	})
	require.Equal(t, 8, mr.liveBytes(), "nothing allocated for the nil vector")
	// As a source, a nil vector is refused as before.
	require.ErrorIs(t, src.CopyFrom(v, s), ErrInvalidArgument)
}
