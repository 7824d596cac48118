package rmm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Container operations on a view of a closed Stream return ErrClosed and change nothing; with
// CUDA they would otherwise hand the driver a destroyed stream handle.
func TestContainersRejectClosedStream(t *testing.T) {
	mr := NewSystemMemoryResource()
	v, err := NewUvectorFromSlice([]int32{1, 2, 3, 4}, DefaultStream, mr)
	require.NoError(t, err)
	defer v.Close()
	w, err := NewUvectorFromSlice([]int32{9, 9, 9, 9}, DefaultStream, mr)
	require.NoError(t, err)
	defer w.Close()
	buf, err := NewDeviceBuffer(8, DefaultStream, mr)
	require.NoError(t, err)
	defer buf.Close()
	require.NoError(t, buf.CopyFromHost(0, []byte{1, 2, 3, 4, 5, 6, 7, 8}, DefaultStream))
	sc, err := NewScalar[int64](DefaultStream, mr)
	require.NoError(t, err)
	defer sc.Close()
	require.NoError(t, sc.SetValue(7, DefaultStream))

	st, err := NewStream(0, nil)
	require.NoError(t, err)
	s := st.View()
	require.NoError(t, st.Close())

	host := make([]int32, 4)
	hostB := make([]byte, 8)
	ops := map[string]func() error{
		"Uvector.Fill":          func() error { return v.Fill(5, s) },
		"Uvector.SetElement":    func() error { return v.SetElement(0, 5, s) },
		"Uvector.Element":       func() error { _, err := v.Element(0, s); return err },
		"Uvector.CopyFromHost":  func() error { return v.CopyFromHost([]int32{5, 5, 5, 5}, s) },
		"Uvector.CopyToHost":    func() error { return v.CopyToHost(host, s) },
		"Uvector.ToSlice":       func() error { _, err := v.ToSlice(s); return err },
		"Uvector.CopyFrom":      func() error { return v.CopyFrom(w.Span(), s) },
		"DeviceSpan.Fill":       func() error { return v.Span().Fill(5, s) },
		"DeviceBuffer.CopyFrom": func() error { return buf.CopyFromHost(0, []byte{9}, s) },
		"DeviceBuffer.CopyTo":   func() error { return buf.CopyToHost(hostB, 0, s) },
		"DeviceBuffer.Device":   func() error { return buf.CopyFromDevice(0, w.Data(), 4, s) },
		"Scalar.SetValue":       func() error { return sc.SetValue(9, s) },
		"Scalar.Value":          func() error { _, err := sc.Value(s); return err },
	}
	for name, op := range ops {
		require.ErrorIs(t, op(), ErrClosed, name)
	}
	got, err := v.ToSlice(DefaultStream)
	require.NoError(t, err)
	require.Equal(t, []int32{1, 2, 3, 4}, got)
	require.Equal(t, []int32{0, 0, 0, 0}, host)
	b, err := buf.Bytes(DefaultStream)
	require.NoError(t, err)
	require.Equal(t, []byte{1, 2, 3, 4, 5, 6, 7, 8}, b)
	x, err := sc.Value(DefaultStream)
	require.NoError(t, err)
	require.Equal(t, int64(7), x)
}

// A container whose Stream was closed frees its memory on that Stream's view at Close, Resize
// and after Release: the resource (a pool here) treats the free as one on DefaultStream, and
// Resize beyond the capacity, which would allocate on the closed Stream, returns ErrClosed and
// changes nothing.
func TestContainersFreeOnClosedStream(t *testing.T) {
	pool, err := NewPoolMemoryResource(NewSystemMemoryResource(), nil)
	require.NoError(t, err)
	defer pool.Close()
	st, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	s := st.View()
	v, err := NewUvectorFromSlice([]int32{1, 2, 3, 4}, s, pool)
	require.NoError(t, err)
	buf, err := NewDeviceBuffer(1000, s, pool)
	require.NoError(t, err)
	sc, err := NewScalarWithValue[int64](7, s, pool)
	require.NoError(t, err)
	require.Equal(t, 3, pool.Stats().LiveAllocations)
	require.NoError(t, st.Close())

	require.ErrorIs(t, v.Resize(1000, s), ErrClosed, "growing allocates on the closed Stream")
	require.Equal(t, 4, v.Len())
	got, err := v.ToSlice(DefaultStream)
	require.NoError(t, err)
	require.Equal(t, []int32{1, 2, 3, 4}, got)
	require.Equal(t, 3, pool.Stats().LiveAllocations)

	require.NoError(t, v.Close())
	require.NoError(t, sc.Close())
	p, n := buf.Release()
	require.NoError(t, buf.Close())
	require.Equal(t, 1, pool.Stats().LiveAllocations)
	require.NoError(t, pool.Deallocate(p, n, s), "the released buffer freed on the closed Stream")
	st2 := pool.Stats()
	require.Zero(t, st2.LiveAllocations)
	require.Equal(t, st2.PoolSize, st2.FreeBytes)
	require.NoError(t, pool.CheckInvariants())
	// The memory is handed out again on DefaultStream.
	w, err := NewUvector[int32](4, DefaultStream, pool)
	require.NoError(t, err)
	require.NoError(t, w.Close())
}

// A container is not made on a view of a closed Stream, whatever the resource (host memory
// ignores streams): the constructor returns ErrClosed and allocates nothing.
func TestContainersNotMadeOnClosedStream(t *testing.T) {
	st, err := NewStream(0, nil)
	require.NoError(t, err)
	s := st.View()
	require.NoError(t, st.Close())
	mr, err := NewStatisticsResourceAdaptor(NewSystemMemoryResource())
	require.NoError(t, err)
	makers := map[string]func() error{
		"NewUvector":          func() error { _, err := NewUvector[float32](10, s, mr); return err },
		"NewUvectorFromSlice": func() error { _, err := NewUvectorFromSlice([]int32{1}, s, mr); return err },
		"NewDeviceBuffer":     func() error { _, err := NewDeviceBuffer(64, s, mr); return err },
		"NewScalar":           func() error { _, err := NewScalar[int64](s, mr); return err },
		"NewUvector(0)":       func() error { _, err := NewUvector[float32](0, s, mr); return err },
	}
	for name, mk := range makers {
		err := mk()
		require.ErrorIs(t, err, ErrClosed, name)
		require.ErrorContains(t, err, "closed", name)
	}
	require.Zero(t, mr.Stats().TotalCount, "nothing was allocated")
}
