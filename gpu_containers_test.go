package rmm

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// GPU tests of the containers: they skip without a CUDA device.

func cudaResource(t *testing.T) *CudaMemoryResource {
	t.Helper()
	requireGPU(t)
	mr, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	return mr
}

func gpuStream(t *testing.T) StreamView {
	t.Helper()
	st, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	t.Cleanup(func() { st.Close() })
	require.NotZero(t, st.View().Handle(), "a CUDA stream")
	return st.View()
}

func TestGPUUvectorRoundTrip100M(t *testing.T) {
	mr := cudaResource(t)
	s := gpuStream(t)
	const n = 100_000_000
	src := make([]float32, n)
	for i := range src {
		src[i] = float32(i%1000003) * 0.5
	}
	v, err := NewUvectorFromSlice(src, s, mr)
	require.NoError(t, err)
	defer v.Close()
	require.Equal(t, n, v.Len())
	assert.Equal(t, DeviceAccessible, v.Access())

	got, err := v.ToSlice(s)
	require.NoError(t, err)
	for i := range got {
		if got[i] != src[i] {
			t.Fatalf("element %d: got %v, want %v after the host→device→host round trip", i, got[i], src[i])
		}
	}

	require.NoError(t, v.Fill(-3.25, s))
	require.NoError(t, v.SetElement(n-1, 9, s))
	clear(got)
	require.NoError(t, v.CopyToHost(got, s))
	for i := 0; i < n-1; i++ {
		if got[i] != -3.25 {
			t.Fatalf("element %d: got %v after Fill(-3.25)", i, got[i])
		}
	}
	assert.Equal(t, float32(9), got[n-1])
}

// checkFillGPU runs checkFill on device memory for several lengths and odd subspan offsets.
func checkFillGPU[T comparable](t *testing.T, mr MemoryResource, x, y T) {
	t.Helper()
	for _, n := range []int{1, 2, 3, 17, 1000, 1<<20 + 3} {
		checkFill(t, mr, n, 0, n, x, y)
		if n >= 3 {
			checkFill(t, mr, n, 1, n-2, x, y)
			checkFill(t, mr, n, 3, (n-3)/2, x, y)
		}
	}
}

// big is an element too large for the fill kernels' pattern (filled by doubling copies).
type big struct{ W [40]uint64 }

func TestGPUFillWidths(t *testing.T) {
	mr := cudaResource(t)
	checkFillGPU[uint8](t, mr, 0xA5, 0x3C)
	checkFillGPU[uint16](t, mr, 0xBEEF, 0x1234)
	checkFillGPU[float32](t, mr, -2.5, 7.25)
	checkFillGPU[uint32](t, mr, 0xDEADBEEF, 0x01020304)
	checkFillGPU[int64](t, mr, -0x0102030405060708, 0x1122334455667788)
	checkFillGPU[wide](t, mr, wide{0x0123456789ABCDEF, 0xFEDCBA9876543210}, wide{1, 2})
	checkFillGPU[complex128](t, mr, complex(1, -1), complex(-3, 4))
	checkFillGPU[triple](t, mr, triple{1, -2, 3}, triple{-7, 8, -9})
	checkFillGPU[[3]byte](t, mr, [3]byte{1, 2, 3}, [3]byte{9, 8, 7})
	var b1, b2 big
	for i := range b1.W {
		b1.W[i], b2.W[i] = uint64(i)*0x0101010101, ^uint64(i)
	}
	checkFill(t, mr, 1000, 0, 1000, b1, b2)
	checkFill(t, mr, 1001, 1, 999, b1, b2)
}

func TestGPUElements(t *testing.T) {
	mr := cudaResource(t)
	s := gpuStream(t)
	v, err := NewUvector[float64](1000, s, mr)
	require.NoError(t, err)
	defer v.Close()
	require.NoError(t, v.Fill(0.5, s))
	negZero := math.Copysign(0, -1)
	require.NoError(t, v.SetElement(0, negZero, s))
	require.NoError(t, v.SetElement(999, math.Inf(-1), s))
	front, err := v.Front(s)
	require.NoError(t, err)
	assert.Equal(t, math.Float64bits(negZero), math.Float64bits(front), "-0.0 keeps its sign on the device")
	back, err := v.Back(s)
	require.NoError(t, err)
	assert.True(t, math.IsInf(back, -1))
	mid, err := v.Element(500, s)
	require.NoError(t, err)
	assert.Equal(t, 0.5, mid)
	require.NoError(t, v.SetElementToZero(999, s))
	back, _ = v.Back(s)
	assert.Equal(t, uint64(0), math.Float64bits(back))
	_, err = v.Element(1000, s)
	assert.ErrorIs(t, err, ErrOutOfRange)
	assert.ErrorIs(t, v.SetElement(-1, 1, s), ErrOutOfRange)
	assert.Equal(t, v.Data()+999*8, v.ElementPtr(999))
}

func TestGPUScalar(t *testing.T) {
	mr := cudaResource(t)
	s := gpuStream(t)
	c, err := NewScalarWithValue(triple{7, -8, 9}, s, mr)
	require.NoError(t, err)
	defer c.Close()
	v, err := c.Value(s)
	require.NoError(t, err)
	assert.Equal(t, triple{7, -8, 9}, v)
	require.NoError(t, c.SetValue(triple{1, 2, 3}, s))
	d, err := c.Copy(s, NewSystemMemoryResource())
	require.NoError(t, err)
	defer d.Close()
	v, _ = d.Value(s)
	assert.Equal(t, triple{1, 2, 3}, v, "copied from device to host memory")
	require.NoError(t, c.SetValueToZero(s))
	v, _ = c.Value(s)
	assert.Equal(t, triple{}, v)
}

func TestGPUDeviceBuffer(t *testing.T) {
	mr := cudaResource(t)
	s := gpuStream(t)
	data := seq(1 << 20)
	b, err := NewDeviceBufferFromHost(data, s, mr)
	require.NoError(t, err)
	defer b.Close()
	assert.Equal(t, DeviceAccessible, b.Access())
	assert.Equal(t, Device(0), b.Device())

	p := b.Data()
	require.NoError(t, b.Resize(1000, s))
	assert.Equal(t, p, b.Data(), "shrinking keeps the allocation")
	require.NoError(t, b.Resize(3<<20, s))
	assert.Equal(t, 3<<20, b.Cap())
	got, err := b.Bytes(s)
	require.NoError(t, err)
	assert.Equal(t, data[:1000], got[:1000], "the old size is kept across reallocation")
	require.NoError(t, b.CopyFromHost(1000, data[1000:], s))
	require.NoError(t, b.Reserve(4<<20, s))
	require.NoError(t, b.ShrinkToFit(s))
	assert.Equal(t, 3<<20, b.Cap())
	got, _ = b.Bytes(s)
	assert.Equal(t, data, got[:1<<20])

	c, err := b.Copy(s, mr)
	require.NoError(t, err)
	defer c.Close()
	assert.Equal(t, 3<<20, c.Cap())
	out := make([]byte, 100)
	require.NoError(t, c.CopyToHost(out, 5000, s))
	assert.Equal(t, data[5000:5100], out)

	// Device to device from a raw pointer, at an offset.
	require.NoError(t, c.CopyFromDevice(0, b.Data()+200, 50, s))
	require.NoError(t, c.CopyToHost(out[:50], 0, s))
	assert.Equal(t, data[200:250], out[:50])
	d, err := NewDeviceBufferFromDevice(b.Data()+7, 64, s, mr)
	require.NoError(t, err)
	defer d.Close()
	got, _ = d.Bytes(s)
	assert.Equal(t, data[7:71], got)

	// Device memory to host memory and back.
	host := NewSystemMemoryResource()
	h, err := b.Copy(s, host)
	require.NoError(t, err)
	defer h.Close()
	assert.Equal(t, data, hostBytes(h.Data(), 1<<20), "the copy is complete at return")
	e, err := h.Copy(s, mr)
	require.NoError(t, err)
	defer e.Close()
	got, _ = e.Bytes(s)
	assert.Equal(t, data, got[:1<<20])
	hb, err := NewDeviceBufferFromDevice(b.Data(), 256, s, host)
	require.NoError(t, err)
	defer hb.Close()
	assert.Equal(t, data[:256], hostBytes(hb.Data(), 256))

	p2, n2 := d.Release()
	assert.NotZero(t, p2)
	require.NoError(t, mr.Deallocate(p2, n2, s))
}

func TestGPUCopyBetweenDeviceAndHostVectors(t *testing.T) {
	mr := cudaResource(t)
	s := gpuStream(t)
	host := newTestResource() // host-only memory
	dv, err := NewUvectorFromSlice(iota32(10000), s, mr)
	require.NoError(t, err)
	defer dv.Close()
	hv, err := NewUvector[int32](10000, s, host)
	require.NoError(t, err)
	defer hv.Close()
	require.NoError(t, hv.Fill(-1, s))

	require.NoError(t, hv.CopyFrom(dv, s)) // device → host-only
	assert.Equal(t, iota32(10000), unsafeInt32s(hv.Data(), 10000), "complete at return")

	require.NoError(t, hv.Fill(5, s))
	sub, err := hv.Span().Subspan(3, 101)
	require.NoError(t, err)
	dsub, err := dv.Span().Subspan(1001, 200)
	require.NoError(t, err)
	require.NoError(t, dsub.CopyFrom(sub, s)) // host-only → device, odd offsets
	got, err := dv.ToSlice(s)
	require.NoError(t, err)
	want := iota32(10000)
	for i := 1001; i < 1102; i++ {
		want[i] = 5
	}
	assert.Equal(t, want, got)

	// Deep copies across kinds.
	hc, err := dv.Copy(s, host)
	require.NoError(t, err)
	defer hc.Close()
	assert.Equal(t, want, unsafeInt32s(hc.Data(), 10000))
	dc, err := hc.Copy(s, mr)
	require.NoError(t, err)
	defer dc.Close()
	got, _ = dc.ToSlice(s)
	assert.Equal(t, want, got)

	// Device to device between two vectors, asynchronous on s, then read back on s.
	require.NoError(t, dc.Fill(0, s))
	require.NoError(t, dc.CopyFrom(dv, s))
	got, _ = dc.ToSlice(s)
	assert.Equal(t, want, got)
}

func unsafeInt32s(p DevicePtr, n int) []int32 {
	b := hostBytes(p, 4*n)
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(uint32(b[4*i]) | uint32(b[4*i+1])<<8 | uint32(b[4*i+2])<<16 | uint32(b[4*i+3])<<24)
	}
	return out
}

func TestGPUSpanAndLeak(t *testing.T) {
	cuda := cudaResource(t)
	s := gpuStream(t)
	mr := newTestResource()
	mr.up = cuda // counts and checks frees of device memory
	p0, err := mr.Allocate(8<<16, s)
	require.NoError(t, err)
	sp, err := NewDeviceSpan[uint64](p0, 1<<16, DeviceOf(cuda), AccessOf(mr))
	require.NoError(t, err)
	assert.Equal(t, DeviceAccessible, sp.Access())
	require.NoError(t, sp.Fill(0x0102030405060708, s))
	got := make([]uint64, 1<<16)
	require.NoError(t, sp.CopyToHost(got, s))
	for i, g := range got {
		require.Equal(t, uint64(0x0102030405060708), g, "element %d", i)
	}
	require.NoError(t, mr.Deallocate(p0, 8<<16, s))

	logs := captureDebugLog(t)
	p, err := leakUvector(mr, s)
	require.NoError(t, err)
	awaitReclaim(t, mr, 2, logs, 1)
	_, _, live := mr.counts()
	assert.Zero(t, live)
	recs := ours(logs.all(), p)
	require.Len(t, recs, 1)
	assert.Equal(t, "Uvector[float64]", recs[0]["type"])
}
