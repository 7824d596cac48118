package rmm

// Multi-GPU tests: they skip unless at least two CUDA devices are present.

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func mgRequireTwoGPUs(t *testing.T) {
	t.Helper()
	requireGPU(t)
	if n := DeviceCount(); n < 2 {
		t.Skipf("needs two CUDA devices, found %d", n)
	}
}

// mgCounter counts the bytes and allocations that go through it (what a statistics adaptor
// reports), per resource.
type mgCounter struct {
	up MemoryResource

	mu                      sync.Mutex
	bytes, peak, count, all int
}

func (c *mgCounter) Allocate(n int, s StreamView) (DevicePtr, error) {
	p, err := c.up.Allocate(n, s)
	if err == nil && n > 0 {
		c.mu.Lock()
		c.bytes += n
		c.peak = max(c.peak, c.bytes)
		c.count++
		c.all++
		c.mu.Unlock()
	}
	return p, err
}

func (c *mgCounter) Deallocate(p DevicePtr, n int, s StreamView) error {
	err := c.up.Deallocate(p, n, s)
	if err == nil && p != 0 {
		c.mu.Lock()
		c.bytes -= n
		c.count--
		c.mu.Unlock()
	}
	return err
}

func (c *mgCounter) Upstream() MemoryResource { return c.up }

func (c *mgCounter) stats() (bytes, peak, count, all int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.bytes, c.peak, c.count, c.all
}

// mgPools sets a pool over cuMemAlloc as the resource of devices 0 and 1, each wrapped in a
// counter, and restores the previous resources when the test ends.
func mgPools(t *testing.T) (pools [2]*PoolMemoryResource, counters [2]*mgCounter) {
	t.Helper()
	require.NoError(t, SetCurrentDevice(0))
	for d := Device(0); d < 2; d++ {
		cuda, err := NewCudaMemoryResource(d)
		require.NoError(t, err)
		pool, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: 64 << 20})
		require.NoError(t, err)
		require.Equal(t, d, pool.Device())
		c := &mgCounter{up: pool}
		prev, err := SetPerDeviceResource(d, c)
		require.NoError(t, err)
		t.Cleanup(func() {
			_, err := SetPerDeviceResource(d, prev)
			assert.NoError(t, err)
			assert.NoError(t, pool.Close())
		})
		pools[d], counters[d] = pool, c
	}
	return pools, counters
}

func mgStream(t *testing.T, d Device) StreamView {
	t.Helper()
	st, err := NewStream(d, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	t.Cleanup(func() { st.Close() })
	require.Equal(t, d, st.Device())
	return st.View()
}

func TestMultiGPUPerDeviceResources(t *testing.T) {
	mgRequireTwoGPUs(t)
	pools, counters := mgPools(t)
	for d := Device(0); d < 2; d++ {
		mr, err := PerDeviceResource(d)
		require.NoError(t, err)
		require.Same(t, counters[d], mr)
		require.Equal(t, d, DeviceOf(mr), "the device comes from the pool under the counter")
		require.Equal(t, 64<<20, pools[d].PoolSize())
	}
	require.Equal(t, Device(0), CurrentDevice())
	require.Same(t, counters[0], CurrentDeviceResource())
	// The current device selects the resource.
	require.NoError(t, SetCurrentDevice(1))
	require.Same(t, counters[1], CurrentDeviceResource())
	require.NoError(t, SetCurrentDevice(0))
}

// A vector made for device 1 while device 0 is current: every call uses device 1 (recorded at
// construction), and Close with device 0 current frees it to device 1's pool.
func TestMultiGPUVectorOnOtherDevice(t *testing.T) {
	mgRequireTwoGPUs(t)
	pools, counters := mgPools(t)
	mr1, err := PerDeviceResource(1)
	require.NoError(t, err)
	for _, s := range []StreamView{mgStream(t, 1), DefaultStream} {
		require.Equal(t, Device(0), CurrentDevice())
		v, err := NewUvector[int32](1<<20, s, mr1)
		require.NoError(t, err)
		require.Equal(t, Device(1), v.Device())
		require.Equal(t, 1, pools[1].Stats().LiveAllocations)
		require.Zero(t, pools[0].Stats().LiveAllocations)
		require.NoError(t, v.Fill(7, s))
		require.NoError(t, v.SetElement(5, -3, s))
		got, err := v.ToSlice(s)
		require.NoError(t, err)
		require.Equal(t, int32(7), got[0])
		require.Equal(t, int32(-3), got[5])
		require.Equal(t, int32(7), got[len(got)-1])
		require.NoError(t, v.Resize(2<<20, s))
		x, err := v.Element(5, s)
		require.NoError(t, err)
		require.Equal(t, int32(-3), x, "Resize copied on device 1")
		require.NoError(t, v.Close())
		require.Zero(t, pools[1].Stats().LiveAllocations)
		bytes, _, count, _ := counters[1].stats()
		require.Zero(t, bytes)
		require.Zero(t, count)
	}
	_, _, _, all0 := counters[0].stats()
	require.Zero(t, all0, "nothing went to device 0")
}

// Device-to-device copies between vectors on two devices (cuMemcpyAsync through unified
// addressing: a peer copy), on a stream of either device and on the default stream.
func TestMultiGPUCopyBetweenDevices(t *testing.T) {
	mgRequireTwoGPUs(t)
	pools, _ := mgPools(t)
	s0, s1 := mgStream(t, 0), mgStream(t, 1)
	const n = 3<<20 + 5
	src := make([]float64, n)
	for i := range src {
		src[i] = float64(i) * 0.25
	}
	a, err := NewUvectorFromSlice(src, s0, pools[0]) // complete at return
	require.NoError(t, err)
	defer a.Close()
	require.Equal(t, Device(0), a.Device())

	b, err := NewUvector[float64](n, s1, pools[1])
	require.NoError(t, err)
	defer b.Close()
	require.NoError(t, b.Fill(-1, s1))
	require.NoError(t, b.CopyFrom(a, s1)) // on device 1's stream
	got, err := b.ToSlice(s1)
	require.NoError(t, err)
	require.Equal(t, src, got)

	// Back, on device 0's stream, into a second vector on device 0.
	require.NoError(t, b.Fill(2, s1))
	require.NoError(t, s1.Synchronize()) // the source's stream, before another stream reads it
	c, err := NewUvector[float64](n, s0, pools[0])
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.CopyFrom(b, s0))
	got, err = c.ToSlice(s0)
	require.NoError(t, err)
	for i := 0; i < n; i += 1001 {
		require.Equal(t, 2.0, got[i], "element %d", i)
	}

	// On the default stream (the destination's device), and a subspan.
	sub, err := a.Span().Subspan(100, 1000)
	require.NoError(t, err)
	d, err := NewUvector[float64](1000, DefaultStream, pools[1])
	require.NoError(t, err)
	defer d.Close()
	require.NoError(t, d.CopyFrom(sub, DefaultStream))
	got, err = d.ToSlice(DefaultStream)
	require.NoError(t, err)
	require.Equal(t, src[100:1100], got)

	// Copy() into a resource of the other device.
	e, err := a.Copy(s1, pools[1])
	require.NoError(t, err)
	defer e.Close()
	require.Equal(t, Device(1), e.Device())
	got, err = e.ToSlice(s1)
	require.NoError(t, err)
	require.Equal(t, src, got)

	// Through a host vector: device 1 → pinned host memory → device 0, asynchronously.
	h, err := NewHostVector[float64](n, nil)
	require.NoError(t, err)
	defer h.Close()
	require.NoError(t, h.CopyFromDeviceAsync(e, s1))
	require.NoError(t, c.Fill(0, s0))
	require.NoError(t, h.CopyToDeviceAsync(c, s0)) // ordered after the copy on s1 by the vector
	got, err = c.ToSlice(s0)
	require.NoError(t, err)
	require.Equal(t, src, got)
}

// Per-device statistics: what is allocated on each device is counted by that device's resource
// only.
func TestMultiGPUStatisticsPerDevice(t *testing.T) {
	mgRequireTwoGPUs(t)
	_, counters := mgPools(t)
	mr0, err := PerDeviceResource(0)
	require.NoError(t, err)
	mr1, err := PerDeviceResource(1)
	require.NoError(t, err)
	var vs []*Uvector[byte]
	for i, size := range []int{1000, 2000, 3000} {
		v, err := NewUvector[byte](size, DefaultStream, mr0)
		require.NoError(t, err)
		vs = append(vs, v)
		if i < 2 {
			w, err := NewUvector[byte](size*10, DefaultStream, mr1)
			require.NoError(t, err)
			vs = append(vs, w)
		}
	}
	b0, p0, c0, _ := counters[0].stats()
	b1, p1, c1, _ := counters[1].stats()
	require.Equal(t, []int{6000, 6000, 3}, []int{b0, p0, c0})
	require.Equal(t, []int{30000, 30000, 2}, []int{b1, p1, c1})

	// Concurrent allocations on both devices.
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			mr := mr0
			if g%2 == 1 {
				mr = mr1
			}
			for i := 0; i < 50; i++ {
				v, err := NewUvector[int64](100+i, DefaultStream, mr)
				if !assert.NoError(t, err) {
					return
				}
				assert.NoError(t, v.Fill(int64(g), DefaultStream))
				assert.NoError(t, v.Close())
			}
		}(g)
	}
	wg.Wait()
	for _, v := range vs {
		require.NoError(t, v.Close())
	}
	b0, _, c0, all0 := counters[0].stats()
	b1, _, c1, all1 := counters[1].stats()
	require.Equal(t, []int{0, 0, 3 + 200}, []int{b0, c0, all0})
	require.Equal(t, []int{0, 0, 2 + 200}, []int{b1, c1, all1})
}
