package rmm

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// GPU tests of the pool's driver calls made unlocked (pool_placement.go).

// The random walk of TestPoolUnlockConcurrentStreamOrder on the device: the pool's calls go
// through the fake, which passes them on to the driver and checks them against its model of
// stream order; the upstream is the device (its frees checked finished in the model).
func TestGPUPoolUnlockConcurrentStreamOrder(t *testing.T) {
	requireGPU(t)
	cuda, _ := suballocCuda(t)
	for _, expandable := range []bool{false, true} {
		t.Run(fmt.Sprint("expandable=", expandable), func(t *testing.T) {
			u := &gatedUpstream{MemoryResource: cuda, alloc: newGate(), free: newGate()}
			var p *PoolMemoryResource
			var err error
			if expandable {
				p, err = NewPoolMemoryResource(cuda, &PoolOptions{Expandable: true, MaximumPoolSize: 256 << 20})
			} else {
				p, err = NewPoolMemoryResource(u, &PoolOptions{MaximumPoolSize: 64 << 20})
			}
			require.NoError(t, err)
			e := newPoolSyncEnvOver(t, p, &cudaCalls)
			u.check = e.checkReturned
			ss := []StreamView{DefaultStream}
			is := []int{e.def}
			for i := range 3 {
				s, _, k := e.stream(0, fmt.Sprintf("S%d", i))
				ss, is = append(ss, s), append(is, k)
			}
			poolUnlockWalk(t, e, ss, is, 300)
			require.NoError(t, p.Release())
			_, _, _, errs := u.figures()
			require.Empty(t, errs)
			require.Equal(t, 0, p.PoolSize())
			require.NoError(t, p.Close())
		})
	}
}

// TestGPUPoolCrossStreamReuse while other goroutines grow the pool and Release it in a loop (the
// growth's cuMemAlloc and Release's cuEventSynchronize and cuMemFree made unlocked): B still gets
// A's block only after A's work, so the result holds A's 0x07 and the block B's 0x09.
func TestGPUPoolUnlockCrossStreamReuseWhileGrowing(t *testing.T) {
	requireGPU(t)
	cuda, ctx := suballocCuda(t)
	const n = 256 << 20
	pool, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: n})
	require.NoError(t, err)
	defer pool.Close()
	a, b := suballocStreams(t)
	c, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	defer c.Close()
	result, err := cuda.Allocate(n, DefaultStream)
	require.NoError(t, err)
	defer cuda.Deallocate(result, n, DefaultStream)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			q, err := pool.Allocate(2*n, c.View()) // never fits: grows
			if err != nil {
				t.Error(err)
				return
			}
			if err := pool.Deallocate(q, 2*n, c.View()); err != nil {
				t.Error(err)
				return
			}
			if err := pool.Release(); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	for round := 0; round < 5; round++ {
		x, err := pool.Allocate(n, a.View())
		require.NoError(t, err)
		gpuBusyThenCopy(t, ctx, x, n, result, a.View())
		require.NoError(t, pool.Deallocate(x, n, a.View()))
		y, err := pool.Allocate(n, b.View())
		require.NoError(t, err)
		require.NoError(t, deviceFill(0, y, n, le64(0x0909090909090909), b.View()))
		require.NoError(t, a.Synchronize())
		require.NoError(t, b.Synchronize())
		checkAll(t, ctx, result, n, 0x07)
		checkAll(t, ctx, y, n, 0x09)
		require.NoError(t, pool.Deallocate(y, n, b.View()))
	}
	close(stop)
	wg.Wait()
	require.NoError(t, pool.CheckInvariants())
}
