package rmm

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

func newSimPool(t *testing.T, capacity int, opts *PoolOptions) (*PoolMemoryResource, *SimulatedMemoryResource) {
	t.Helper()
	sim, err := NewSimulatedMemoryResource(capacity)
	require.NoError(t, err)
	p, err := NewPoolMemoryResource(sim, opts)
	require.NoError(t, err)
	return p, sim
}

func TestPoolOptionsValidation(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 30)
	for _, o := range []PoolOptions{
		{InitialPoolSize: 100},
		{MaximumPoolSize: 1000},
		{InitialPoolSize: 2048, MaximumPoolSize: 1024},
		{InitialPoolSize: -256},
	} {
		_, err := NewPoolMemoryResource(sim, &o)
		require.ErrorIs(t, err, ErrInvalidArgument, "%+v", o)
	}
	p, err := NewPoolMemoryResource(sim, &PoolOptions{InitialPoolSize: 1024, MaximumPoolSize: 1024})
	require.NoError(t, err, "initial == maximum is allowed")
	require.Equal(t, 1024, p.PoolSize())
	require.Equal(t, 1024, sim.UsedBytes())
	// The initial block is too big for the upstream.
	_, err = NewPoolMemoryResource(sim, &PoolOptions{InitialPoolSize: 2 << 30})
	require.ErrorIs(t, err, ErrOutOfMemory)
}

// librmm's PoolTest.ForceGrowth over a 6000-byte limited upstream, number for number.
func TestPoolForceGrowthUnbounded(t *testing.T) {
	up := newLimitedUpstream(6000)
	p, err := NewPoolMemoryResource(up, nil)
	require.NoError(t, err)
	s := DefaultStream

	_, err = p.Allocate(1000, s)
	require.NoError(t, err)
	require.Equal(t, []int{1024}, up.asked)
	require.Equal(t, 1024, p.PoolSize())

	_, err = p.Allocate(4000, s)
	require.NoError(t, err)
	require.Equal(t, []int{1024, 4096}, up.asked)
	require.Equal(t, 5120, p.PoolSize())

	_, err = p.Allocate(500, s)
	require.NoError(t, err)
	require.Equal(t, []int{1024, 4096, 5120, 2560, 1280, 640}, up.asked)
	require.Equal(t, 5760, p.PoolSize())

	_, err = p.Allocate(2000, s)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Equal(t, []int{1024, 4096, 5120, 2560, 1280, 640, 5760, 2880, 2048}, up.asked)
	require.Equal(t, 5760, p.PoolSize(), "a failed growth leaves the pool as it was")
	require.NoError(t, p.CheckInvariants())
}

func TestPoolForceGrowthWithMaximum(t *testing.T) {
	up := newLimitedUpstream(6000)
	p, err := NewPoolMemoryResource(up, &PoolOptions{MaximumPoolSize: 8192})
	require.NoError(t, err)
	s := DefaultStream

	_, err = p.Allocate(1000, s)
	require.NoError(t, err)
	require.Equal(t, []int{4096}, up.asked)

	_, err = p.Allocate(4000, s)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Equal(t, []int{4096, 4096}, up.asked)

	_, err = p.Allocate(500, s)
	require.NoError(t, err)
	_, err = p.Allocate(2000, s)
	require.NoError(t, err)
	require.Equal(t, []int{4096, 4096}, up.asked, "both served from the 3072 bytes left")
	require.Equal(t, 4096, p.PoolSize())
	st := p.Stats()
	require.Equal(t, 1024+512+2048, st.LiveBytes)
	require.Equal(t, 512, st.FreeBytes)
	require.NoError(t, p.CheckInvariants())
}

func TestPoolGrowthStopsAtMaximum(t *testing.T) {
	p, _ := newSimPool(t, 1<<40, &PoolOptions{MaximumPoolSize: 1 << 20})
	_, err := p.Allocate(1<<20+1, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Contains(t, err.Error(), "the request exceeds the maximum pool size")
	ptr, err := p.Allocate(1<<20, DefaultStream)
	require.NoError(t, err, "exactly the maximum fits")
	require.NoError(t, p.Deallocate(ptr, 1<<20, DefaultStream))
}

// Four 256 KiB blocks freed on two streams must coalesce for a 1 MiB request on a third stream,
// in a pool that cannot grow.
func TestPoolStreamMerge(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 1 << 20, MaximumPoolSize: 1 << 20})
	a := mustStream(t)
	b := mustStream(t)
	c := mustStream(t)
	const q = 256 << 10
	var ptrs [4]DevicePtr
	for i := range ptrs {
		var err error
		ptrs[i], err = p.Allocate(q, DefaultStream)
		require.NoError(t, err)
	}
	// Interleave: 0 and 2 on a, 1 and 3 on b, so neither list alone holds two neighbours.
	require.NoError(t, p.Deallocate(ptrs[0], q, a))
	require.NoError(t, p.Deallocate(ptrs[2], q, a))
	require.NoError(t, p.Deallocate(ptrs[1], q, b))
	require.NoError(t, p.Deallocate(ptrs[3], q, b))
	st := p.Stats()
	require.Equal(t, 4, st.FreeBlocks)
	require.Equal(t, q, st.LargestFreeBlock)
	require.NoError(t, p.CheckInvariants())

	ptr, err := p.Allocate(1<<20, c)
	require.NoError(t, err)
	require.Equal(t, ptrs[0], ptr)
	require.Equal(t, 1<<20, p.PoolSize(), "served without growing")
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(ptr, 1<<20, c))
	require.NoError(t, p.CheckInvariants())
}

func mustStream(t *testing.T) StreamView {
	t.Helper()
	s, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s.View()
}

func TestPoolInvalidFree(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, nil)
	s := DefaultStream
	ptr, err := p.Allocate(1000, s)
	require.NoError(t, err)
	before := p.Stats()

	require.ErrorIs(t, p.Deallocate(ptr+256, 1000, s), ErrInvalidFree, "interior pointer")
	require.ErrorIs(t, p.Deallocate(0xdead00, 1000, s), ErrInvalidFree, "pointer never handed out")
	require.ErrorIs(t, p.Deallocate(ptr, 999, s), ErrInvalidFree, "wrong size")
	require.ErrorIs(t, p.Deallocate(ptr, -1, s), ErrInvalidFree, "negative size")
	require.Equal(t, before, p.Stats(), "invalid frees change nothing")
	require.NoError(t, p.CheckInvariants())

	require.NoError(t, p.Deallocate(ptr, 1000, s))
	err = p.Deallocate(ptr, 1000, s)
	require.ErrorIs(t, err, ErrInvalidFree, "double free")
	require.Contains(t, err.Error(), "already freed")
	require.NoError(t, p.CheckInvariants())
	require.Equal(t, 0, p.Stats().LiveAllocations)
}

func TestPoolZeroAndNegative(t *testing.T) {
	p, sim := newSimPool(t, 1<<30, nil)
	ptr, err := p.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, ptr)
	require.NoError(t, p.Deallocate(0, 0, DefaultStream))
	require.Zero(t, sim.UsedBytes(), "zero-byte calls never reach the upstream")
	_, err = p.Allocate(-5, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = p.Allocate(int(^uint(0)>>1), DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory, "a size that overflows when rounded")
}

func TestPoolBestFitAndCoalesce(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 1 << 20})
	s := DefaultStream
	sizes := []int{4096, 256, 8192, 512, 4096, 1024}
	ptrs := make([]DevicePtr, len(sizes))
	for i, n := range sizes {
		var err error
		ptrs[i], err = p.Allocate(n, s)
		require.NoError(t, err)
		if i > 0 {
			require.Equal(t, ptrs[i-1]+DevicePtr(sizes[i-1]), ptrs[i], "carved front to back")
		}
	}
	// Free the 4096 at 0, the 8192 at 2 and the 4096 at 4: holes of 4096, 8192, 4096.
	for _, i := range []int{0, 2, 4} {
		require.NoError(t, p.Deallocate(ptrs[i], sizes[i], s))
	}
	// Best fit for 3000 bytes is a 4096 hole, the lower-addressed one.
	q, err := p.Allocate(3000, s)
	require.NoError(t, err)
	require.Equal(t, ptrs[0], q)
	// 5000 bytes fit only the 8192 hole (the tail of the pool is larger).
	r, err := p.Allocate(5000, s)
	require.NoError(t, err)
	require.Equal(t, ptrs[2], r)
	require.NoError(t, p.CheckInvariants())
	// Free everything: one block again.
	require.NoError(t, p.Deallocate(q, 3000, s))
	require.NoError(t, p.Deallocate(r, 5000, s))
	for _, i := range []int{1, 3, 5} {
		require.NoError(t, p.Deallocate(ptrs[i], sizes[i], s))
	}
	// The last frees, of sizes just asked for, wait in the default stream's cache: free, but
	// not coalesced yet.
	st := p.Stats()
	require.Equal(t, 1<<20, st.FreeBytes)
	require.Positive(t, st.CachedBlocks)
	require.Greater(t, st.FreeBlocks, st.CachedBlocks, "cached blocks keep their free neighbours apart")
	require.NoError(t, p.CheckInvariants())
	// A request the cache cannot serve coalesces them first: the whole pool is one block again.
	whole, err := p.Allocate(1<<20, s)
	require.NoError(t, err)
	require.Equal(t, ptrs[0], whole)
	require.Equal(t, 1<<20, p.PoolSize(), "no growth")
	require.NoError(t, p.Deallocate(whole, 1<<20, s))
	st = p.Stats()
	require.Equal(t, 1, st.FreeBlocks)
	require.Equal(t, 1, st.CachedBlocks, "a size just asked for, of at most 1 MiB, waits in the cache")
	require.Equal(t, 1<<20, st.LargestFreeBlock)
	require.NoError(t, p.CheckInvariants())
}

func TestPoolUpstreamBlocksNeverCoalesce(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, nil) // unbounded, initial 0: grows 1 KiB, then doubles
	s := DefaultStream
	a, err := p.Allocate(1024, s)
	require.NoError(t, err)
	b, err := p.Allocate(1024, s) // grows by max(1024, 1024)
	require.NoError(t, err)
	require.Equal(t, a+1024, b, "the simulated upstream hands out adjacent ranges")
	require.NoError(t, p.Deallocate(a, 1024, s))
	require.NoError(t, p.Deallocate(b, 1024, s))
	st := p.Stats()
	require.Equal(t, 2, st.FreeBlocks, "adjacent blocks from two upstream allocations stay apart")
	require.Equal(t, 2, st.UpstreamBlocks)
	require.NoError(t, p.CheckInvariants())
}

func TestPoolRelease(t *testing.T) {
	p, sim := newSimPool(t, 1<<30, nil)
	a, _ := NewStream(0, nil)
	defer a.Close()
	x, err := p.Allocate(1<<20, DefaultStream) // upstream block 1: 1 MiB
	require.NoError(t, err)
	y, err := p.Allocate(2<<20, a.View()) // upstream block 2: 2 MiB
	require.NoError(t, err)
	z, err := p.Allocate(1<<20, DefaultStream) // upstream block 3: 3 MiB (doubling), 2 MiB free
	require.NoError(t, err)
	require.Equal(t, 6<<20, p.PoolSize())
	require.NoError(t, p.Deallocate(y, 2<<20, a.View()))
	require.NoError(t, p.Deallocate(x, 1<<20, DefaultStream))
	require.NoError(t, p.Release())
	require.Equal(t, 3<<20, p.PoolSize(), "blocks 1 and 2 were wholly free")
	require.Equal(t, 3<<20, sim.UsedBytes())
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(z, 1<<20, DefaultStream))
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
	require.Zero(t, sim.UsedBytes())
	// Still usable.
	w, err := p.Allocate(4096, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(w, 4096, DefaultStream))
}

func TestPoolClose(t *testing.T) {
	p, sim := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 1 << 20})
	a, err := p.Allocate(4096, DefaultStream) // left live across Close
	require.NoError(t, err)
	b, err := p.Allocate(2<<20, DefaultStream) // a second upstream block
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(b, 2<<20, DefaultStream))
	require.Equal(t, 3<<20, sim.UsedBytes())
	require.NoError(t, p.Close())
	require.Equal(t, 1<<20, sim.UsedBytes(), "Close returns the wholly free block, keeps the one still in use")
	_, err = p.Allocate(1, DefaultStream)
	require.ErrorIs(t, err, ErrClosed)
	require.NoError(t, p.Close())
	require.NoError(t, p.CheckInvariants())
	// The live allocation stays valid and can still be freed, once; its block then goes back.
	require.ErrorIs(t, p.Deallocate(a, 4095, DefaultStream), ErrInvalidFree)
	require.NoError(t, p.Deallocate(a, 4096, DefaultStream))
	require.Zero(t, sim.UsedBytes())
	require.Zero(t, p.PoolSize())
	require.ErrorIs(t, p.Deallocate(a, 4096, DefaultStream), ErrInvalidFree)
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Release())
}

// A container outliving its pool's Close stays usable and is returned when closed.
func TestPoolCloseWithLiveContainer(t *testing.T) {
	p, err := NewPoolMemoryResource(NewSystemMemoryResource(), nil)
	require.NoError(t, err)
	v, err := NewUvector[float32](1000, DefaultStream, p)
	require.NoError(t, err)
	require.NoError(t, v.Fill(2.5, DefaultStream))
	require.NoError(t, p.Close())
	require.NotZero(t, p.PoolSize())
	require.NoError(t, v.Fill(1.5, DefaultStream))
	got, err := v.ToSlice(DefaultStream)
	require.NoError(t, err)
	require.Equal(t, float32(1.5), got[999])
	require.NoError(t, v.Close())
	require.Zero(t, p.PoolSize())
}

func TestPoolOverPool(t *testing.T) {
	outer, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 1 << 24})
	inner, err := NewPoolMemoryResource(outer, &PoolOptions{InitialPoolSize: 1 << 20})
	require.NoError(t, err)
	require.Same(t, outer, inner.Upstream())
	var ptrs []DevicePtr
	for i := 0; i < 100; i++ {
		ptr, err := inner.Allocate(100_000, DefaultStream)
		require.NoError(t, err)
		ptrs = append(ptrs, ptr)
	}
	require.NoError(t, inner.CheckInvariants())
	require.NoError(t, outer.CheckInvariants())
	for _, ptr := range ptrs {
		require.NoError(t, inner.Deallocate(ptr, 100_000, DefaultStream))
	}
	require.NoError(t, inner.Close())
	require.Zero(t, outer.Stats().LiveAllocations)
}

func TestPoolOOMMessage(t *testing.T) {
	p, _ := newSimPool(t, 1<<20, nil)
	_, err := p.Allocate(2<<20, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	var cause *CUDAError
	require.False(t, errors.As(err, &cause))
	require.Contains(t, err.Error(), "PoolMemoryResource")
	require.Contains(t, err.Error(), "2097152")
}

// A Stream closed while the pool holds its frees: allocating on it is refused, freeing on it is
// ordered by a device synchronisation and lands on the default stream, and its free blocks are
// reused by other streams.
func TestPoolClosedStream(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 1 << 20, MaximumPoolSize: 1 << 20})
	a, err := NewStream(0, nil)
	require.NoError(t, err)
	x, err := p.Allocate(4096, a.View())
	require.NoError(t, err)
	y, err := p.Allocate(4096, a.View())
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(x, 4096, a.View()))
	require.NoError(t, a.Close())
	require.ErrorIs(t, a.Synchronize(), ErrClosed)
	require.ErrorIs(t, a.View().WaitEvent(&Event{host: true}), ErrClosed)
	_, err = p.Allocate(256, a.View())
	require.ErrorIs(t, err, ErrClosed)
	require.NoError(t, p.Deallocate(y, 4096, a.View()), "a free on a closed stream still returns the memory")
	z, err := p.Allocate(1<<20, DefaultStream)
	require.NoError(t, err, "the closed stream's blocks coalesce back into the whole pool")
	require.NoError(t, p.Deallocate(z, 1<<20, DefaultStream))
	require.NoError(t, p.CheckInvariants())
	// A stream closed before the pool ever saw it.
	b, _ := NewStream(0, nil)
	require.NoError(t, b.Close())
	_, err = p.Allocate(256, b.View())
	require.ErrorIs(t, err, ErrClosed)
	require.Equal(t, 0, p.Stats().LiveAllocations)
}

// Closing a Stream drops its free list: the pool keeps no state for short-lived streams.
func TestPoolForgetsClosedStreams(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 1 << 20})
	for i := 0; i < 1000; i++ {
		st, err := NewStream(0, nil)
		require.NoError(t, err)
		q, err := p.Allocate(4096, st.View())
		require.NoError(t, err)
		require.NoError(t, p.Deallocate(q, 4096, st.View()))
		require.NoError(t, st.Close())
	}
	st := p.Stats()
	require.Equal(t, 1, st.Streams, "only the default stream's list is left")
	require.Equal(t, 1, st.FreeBlocks, "the closed streams' blocks coalesced back")
	require.NoError(t, p.CheckInvariants())
}

// A capped pool reaches its maximum exactly with 256-byte requests.
func TestPoolReachesMaximum(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	for _, maximum := range []int{768, 1280, 1<<20 + 1280, shortOrLong(16<<20, 100<<20)} {
		p, _ := newSimPool(t, 1<<40, &PoolOptions{MaximumPoolSize: maximum})
		served := 0
		for {
			if _, err := p.Allocate(256, DefaultStream); err != nil {
				require.ErrorIs(t, err, ErrOutOfMemory)
				break
			}
			served += 256
		}
		require.Equal(t, maximum, served, "maximum %d", maximum)
		require.Equal(t, maximum, p.PoolSize())
		require.NoError(t, p.CheckInvariants())
	}
}

// A capped pool that cannot grow gives back its wholly free upstream blocks and tries again.
func TestPoolCappedReleasesBeforeFailing(t *testing.T) {
	p, _ := newSimPool(t, 1<<40, &PoolOptions{MaximumPoolSize: 4 << 20})
	a, err := p.Allocate(2<<20, DefaultStream)
	require.NoError(t, err)
	b, err := p.Allocate(1<<20, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, 3<<20, p.PoolSize())
	require.Equal(t, 2, p.Stats().UpstreamBlocks)
	require.NoError(t, p.Deallocate(a, 2<<20, DefaultStream))
	c, err := p.Allocate(3<<20, DefaultStream)
	require.NoError(t, err, "the free 2 MiB block went back, making room under the cap")
	st := p.Stats()
	require.Equal(t, 4<<20, st.PoolSize)
	require.Equal(t, 2, st.UpstreamBlocks)
	require.NoError(t, p.CheckInvariants())
	// Nothing wholly free now: the next failure releases nothing and says why.
	_, err = p.Allocate(1<<20, DefaultStream)
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	require.Equal(t, 4<<20, oom.PoolSize)
	require.Zero(t, oom.FreeBytes)
	require.False(t, oom.Fragmented)
	require.NoError(t, p.Deallocate(b, 1<<20, DefaultStream))
	require.NoError(t, p.Deallocate(c, 3<<20, DefaultStream))
}

// When the maximum stops a growth of a pool that has not reached it, the error says how much
// the growth needed and how much was left under the maximum, not that the maximum was reached.
func TestPoolOutOfMemoryDetailUnderMaximum(t *testing.T) {
	for _, c := range []struct {
		name       string
		expandable bool
		want       string
	}{
		{"plain", false, "growing by the 3145728 bytes it needs would pass the maximum pool size (2097152 bytes left under it)"},
		{"expandable", true, "growing by the 4194304 bytes it needs would pass the maximum pool size (2097152 bytes left under it)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sim, err := NewSimulatedMemoryResource(64 << 20)
			require.NoError(t, err)
			p, err := NewPoolMemoryResource(sim, &PoolOptions{InitialPoolSize: 2 << 20, MaximumPoolSize: 4 << 20, Expandable: c.expandable})
			require.NoError(t, err)
			defer p.Close()
			a, err := p.Allocate(2<<20, DefaultStream)
			require.NoError(t, err)
			_, err = p.Allocate(3<<20, DefaultStream)
			var oom *OutOfMemoryError
			require.ErrorAs(t, err, &oom)
			require.Equal(t, c.want, oom.Detail)
			require.False(t, oom.TooLarge)
			require.Equal(t, 2<<20, oom.Headroom)
			require.NoError(t, p.Deallocate(a, 2<<20, DefaultStream))
		})
	}
}

// A free block alone in its class gives the front of itself to an allocation and takes a freed
// neighbour back without leaving its place in the list (takeFront, freeInto, freeList.resize):
// the list's one block stays the same node through allocate-free pairs, also when its size moves
// between classes (8 GiB is the first size of its class; less 64 MiB is in the class below), and
// the pool's invariants hold after each step.
func TestPoolResizesInPlace(t *testing.T) {
	const initial, n = 8 << 30, 64 << 20
	p, _ := newSimPool(t, 16<<30, &PoolOptions{InitialPoolSize: initial})
	only := func() *block {
		t.Helper()
		p.mu.Lock()
		l, err := p.listFor(DefaultStream)
		count, b := 0, (*block)(nil)
		if err == nil {
			count, b = l.count, l.bestFit(1)
		}
		p.mu.Unlock()
		require.NoError(t, err)
		require.Equal(t, 1, count)
		return b
	}
	b0 := only()
	base := b0.addr
	require.Equal(t, initial, b0.size)
	for i := range 3 {
		a, err := p.Allocate(n, DefaultStream)
		require.NoError(t, err)
		require.Equal(t, base, a, "pair %d: the front of the block", i)
		require.Same(t, b0, only(), "pair %d: the rest kept the node", i)
		require.Equal(t, base+n, b0.addr)
		require.Equal(t, initial-n, b0.size)
		require.NoError(t, p.CheckInvariants())
		require.NoError(t, p.Deallocate(a, n, DefaultStream))
		require.Same(t, b0, only(), "pair %d: the freed bytes went back into the node", i)
		require.Equal(t, base, b0.addr)
		require.Equal(t, initial, b0.size)
		require.NoError(t, p.CheckInvariants())
	}
	// When the class the rest moves to holds another block, the rest goes into that class's
	// treap the usual way: A (64 MiB) free apart from the big block R by B, then all of R but 64
	// MiB taken.
	pa, err := p.Allocate(n, DefaultStream)
	require.NoError(t, err)
	pb, err := p.Allocate(n, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(pa, n, DefaultStream))
	rest := initial - 3*n
	pr, err := p.Allocate(rest, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, pb+n, pr)
	require.NoError(t, p.CheckInvariants())
	require.Equal(t, 2, underLock(&p.mu, func() int { l, _ := p.listFor(DefaultStream); return l.count }), "A and R's rest, both of 64 MiB")
	for _, f := range []struct {
		ptr  DevicePtr
		size int
	}{{pr, rest}, {pb, n}} {
		require.NoError(t, p.Deallocate(f.ptr, f.size, DefaultStream))
		require.NoError(t, p.CheckInvariants())
	}
	require.Equal(t, initial, p.Stats().FreeBytes)
	last := only() // all coalesced again (into another node: R's went to the allocation)
	require.Equal(t, base, last.addr)
	require.Equal(t, initial, last.size)
}

// A PoolMemoryResource that NewPoolMemoryResource did not make (its zero value) has no backing:
// every method works on it as on an empty pool or returns ErrInvalidArgument, naming the
// constructor, rather than dereferencing nil.
func TestPoolZeroValue(t *testing.T) {
	var p PoolMemoryResource
	notMade := func(err error) {
		t.Helper()
		require.ErrorIs(t, err, ErrInvalidArgument)
		require.ErrorContains(t, err, "not made by NewPoolMemoryResource")
	}
	q, err := p.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, q)
	for _, n := range []int{256, 4 << 20} { // a size a cache could hold, and one it could not
		_, err = p.Allocate(n, DefaultStream)
		notMade(err)
	}
	notMade(p.Deallocate(0x10000, 256, DefaultStream))
	require.NoError(t, p.Deallocate(0, 256, DefaultStream))
	notMade(p.Release())
	notMade(p.CheckInvariants())
	_, err = p.ExportIPC(0x10000, 256)
	notMade(err)
	require.Equal(t, PoolStats{}, p.Stats())
	require.Zero(t, p.PoolSize())
	require.Zero(t, p.MaximumPoolSize())
	require.False(t, p.Expandable())
	require.Nil(t, p.Upstream())
	notMade(p.Close())
	_, err = p.Allocate(256, DefaultStream)
	notMade(err) // still: Close made nothing
}
