package rmm

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// Attacks on the pool's per-stream caches (pool_cache.go): sizes at the cache's limits, double
// frees and frees on other streams in every order relative to caching, frees after Close and
// after a Stream's Close, capped and expandable pools, adaptors stacked on a pool, and
// concurrent use with Stats, Release, CheckInvariants and Close.

// brkStream makes a Stream closed at the end of the test; it returns the Stream too, for tests
// that close it themselves.
func brkStream(t *testing.T) (StreamView, *Stream) {
	t.Helper()
	s, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s.View(), s
}

// brkCheck verifies the pool's invariants and the identities Stats must satisfy: free plus
// live bytes make the pool size, the per-stream entries add up to the free figures, cached
// blocks are counted as free.
func brkCheck(t *testing.T, p *PoolMemoryResource) PoolStats {
	t.Helper()
	require.NoError(t, p.CheckInvariants())
	st := p.Stats()
	require.Equal(t, st.PoolSize-st.LiveBytes, st.FreeBytes)
	blocks, bytes := 0, 0
	for _, ps := range st.PerStream {
		blocks += ps.FreeBlocks
		bytes += ps.FreeBytes
	}
	require.Equal(t, st.FreeBlocks, blocks, "per-stream free blocks add up")
	require.Equal(t, st.FreeBytes, bytes, "per-stream free bytes add up")
	require.LessOrEqual(t, st.CachedBytes, st.FreeBytes)
	require.LessOrEqual(t, st.CachedBlocks, st.FreeBlocks)
	require.LessOrEqual(t, st.LargestFreeBlock, st.FreeBytes)
	return st
}

// brkCached returns the bytes cached by stream s, reading the cache directly.
func brkCached(p *PoolMemoryResource, s StreamView) (blocks, issued int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := p.cachedByStream()[s.ID()]
	return f.blocks, f.issued
}

// Sizes at the cache's edges: 0, negative, overflowing, 1 MiB exactly (cached), 1 MiB + 1 and
// 1 MiB + 256 (not cached), sizes that round to the same 256 multiple (served by one cached
// block; the free must give the size asked for that allocation, not the other one).
func TestPoolCacheSizeEdges(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 16 << 20})
	s, _ := brkStream(t)

	q, err := p.Allocate(0, s)
	require.NoError(t, err)
	require.Zero(t, q)
	require.NoError(t, p.Deallocate(0, 0, s))
	require.NoError(t, p.Deallocate(0, 123, s), "a nil pointer is ignored whatever the size")
	_, err = p.Allocate(-1, s)
	require.ErrorIs(t, err, ErrInvalidArgument)
	// Sizes that overflow when rounded fail before anything is touched.
	x0, err := p.Allocate(4096, s)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(x0, 4096, s)) // cached: the failures below must keep it
	before := brkCheck(t, p)
	require.Equal(t, 1, before.CachedBlocks)
	for _, n := range []int{math.MaxInt, math.MaxInt - 254} {
		_, err = p.Allocate(n, s)
		var oom *OutOfMemoryError
		require.ErrorAs(t, err, &oom, "%d", n)
		require.Equal(t, n, oom.Requested)
		require.True(t, oom.TooLarge)
		require.Equal(t, before.FreeBytes, oom.FreeBytes)
		require.Equal(t, before.LargestFreeBlock, oom.LargestFreeBlock)
	}
	require.Equal(t, before, brkCheck(t, p), "a failed call changes nothing")
	// The largest size that rounds without overflow: an ordinary failure (the search may merge
	// other streams' lists, and the upstream's refusal makes the pool give its wholly free block
	// back before it tries once more, as documented), after which nothing is cached and the
	// figures agree.
	_, err = p.Allocate(math.MaxInt-255, s)
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	require.False(t, oom.TooLarge && oom.Fragmented)
	st := brkCheck(t, p)
	require.Zero(t, st.CachedBlocks, "the caches gave their blocks back before failing")
	require.Equal(t, st.FreeBytes, oom.FreeBytes)
	require.Equal(t, st.LargestFreeBlock, oom.LargestFreeBlock)
	require.Zero(t, st.PoolSize, "the cached block coalesced into the free initial block, which was given back")
	require.NoError(t, p.Release())

	// 1 MiB is cached, 1 MiB + 1 (rounded to 1 MiB + 256) is not.
	for _, c := range []struct {
		n      int
		cached bool
	}{{1 << 20, true}, {1<<20 + 1, false}, {1<<20 + 256, false}, {1<<20 - 255, true}, {1, true}} {
		x, err := p.Allocate(c.n, s)
		require.NoError(t, err)
		require.NoError(t, p.Deallocate(x, c.n, s))
		st := brkCheck(t, p)
		if c.cached {
			require.Equal(t, 1, st.CachedBlocks, "%d", c.n)
			r, _ := alignSize(c.n)
			require.Equal(t, r, st.CachedBytes)
			y, err := p.Allocate(c.n, s)
			require.NoError(t, err)
			require.Equal(t, x, y, "%d: served by the cache", c.n)
			require.Zero(t, p.Stats().CachedBlocks)
			require.NoError(t, p.Deallocate(y, c.n, s))
		} else {
			require.Zero(t, st.CachedBlocks, "%d", c.n)
		}
		require.NoError(t, p.Release())
		require.Zero(t, p.Stats().CachedBlocks)
	}

	// 1 MiB − 255 and 1 MiB round alike: the cached block serves either, and the free must name
	// the size asked for the allocation it serves.
	x, err := p.Allocate(1<<20-255, s)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(x, 1<<20-255, s))
	y, err := p.Allocate(1<<20, s)
	require.NoError(t, err)
	require.Equal(t, x, y)
	before = brkCheck(t, p)
	require.ErrorIs(t, p.Deallocate(y, 1<<20-255, s), ErrInvalidFree, "the size of the earlier allocation")
	require.ErrorIs(t, p.Deallocate(y, 1<<20+1, s), ErrInvalidFree)
	require.ErrorIs(t, p.Deallocate(y, 0, s), ErrInvalidFree)
	require.ErrorIs(t, p.Deallocate(y, -1<<20, s), ErrInvalidFree)
	require.ErrorIs(t, p.Deallocate(y+256, 1<<20, s), ErrInvalidFree, "an interior pointer")
	require.Equal(t, before, brkCheck(t, p))
	require.NoError(t, p.Deallocate(y, 1<<20, s))
	require.Equal(t, 1, brkCheck(t, p).CachedBlocks)
}

// Double frees and frees on other streams, in every order relative to the cache, with a
// check after each step that a rejected call changed nothing.
func TestPoolCacheDoubleFreeOrders(t *testing.T) {
	const n = 4096
	type step struct {
		stream int // 0: A, 1: B, 2: DefaultStream
		size   int
		ok     bool
	}
	cases := map[string][]step{
		// freed into A's cache, then freed again anywhere
		"cached/again":  {{0, n, true}, {0, n, false}, {1, n, false}, {2, n, false}, {0, n - 1, false}},
		"handed/other":  {{0, n, true}, {-1, n, true}, {1, n, true}, {0, n, false}, {1, n, false}, {2, n, false}},
		"handed/wrong":  {{0, n, true}, {-1, n, true}, {1, n - 1, false}, {0, n + 256, false}, {2, n, true}, {0, n, false}},
		"handed/same":   {{0, n, true}, {-1, n, true}, {0, n, true}, {0, n, false}, {1, n, false}},
		"handed/twice":  {{0, n, true}, {-1, n, true}, {-1, n, true}, {0, n, true}, {1, n, true}, {0, n, false}, {1, n, false}},
		"other/ncached": {{1, n, true}, {0, n, false}, {1, n, false}},
	}
	for name, steps := range cases {
		t.Run(name, func(t *testing.T) {
			p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 1 << 20})
			a, _ := brkStream(t)
			b, _ := brkStream(t)
			streams := []StreamView{a, b, DefaultStream}
			x, err := p.Allocate(n, a) // slow path: A asks for n
			require.NoError(t, err)
			ptrs := []DevicePtr{x}
			live := map[DevicePtr]bool{x: true}
			for i, st := range steps {
				if st.stream < 0 { // allocate on A again: the cache hands its block out
					y, err := p.Allocate(st.size, a)
					require.NoError(t, err)
					ptrs = append(ptrs, y)
					live[y] = true
					continue
				}
				// free the most recently allocated pointer still live, else the last one
				ptr := ptrs[len(ptrs)-1]
				for k := len(ptrs) - 1; k >= 0; k-- {
					if live[ptrs[k]] {
						ptr = ptrs[k]
						break
					}
				}
				before := brkCheck(t, p)
				err := p.Deallocate(ptr, st.size, streams[st.stream])
				if st.ok {
					require.NoError(t, err, "step %d", i)
					delete(live, ptr)
				} else {
					require.ErrorIs(t, err, ErrInvalidFree, "step %d", i)
					require.Equal(t, before, brkCheck(t, p), "step %d: a rejected free changes nothing", i)
				}
			}
			st := brkCheck(t, p)
			require.Equal(t, len(live), st.LiveAllocations)
			for ptr := range live {
				require.NoError(t, p.Deallocate(ptr, n, a))
			}
			require.NoError(t, p.Release())
			require.Zero(t, brkCheck(t, p).PoolSize)
		})
	}
}

// A full cache (16 blocks) sends the free of a block it handed out down the slow path, which
// must find it in the cache's table, check the size there, and detect a second free.
func TestPoolCacheFullCacheSlowPathFree(t *testing.T) {
	const n = 8192
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 4 << 20})
	s, _ := brkStream(t)
	var ptrs []DevicePtr
	for range poolCacheSlots + 1 {
		q, err := p.Allocate(n, s)
		require.NoError(t, err)
		ptrs = append(ptrs, q)
	}
	require.NoError(t, p.Deallocate(ptrs[0], n, s)) // cached
	h, err := p.Allocate(n, s)                      // handed out by the cache
	require.NoError(t, err)
	require.Equal(t, ptrs[0], h)
	for _, q := range ptrs[1:] {
		require.NoError(t, p.Deallocate(q, n, s)) // fills the cache
	}
	blocks, issued := brkCached(p, s)
	require.Equal(t, poolCacheSlots, blocks)
	require.Equal(t, 1, issued)
	before := brkCheck(t, p)
	require.ErrorIs(t, p.Deallocate(h, n+256, s), ErrInvalidFree)
	require.ErrorIs(t, p.Deallocate(h, n-1, DefaultStream), ErrInvalidFree)
	require.Equal(t, before, brkCheck(t, p))
	require.NoError(t, p.Deallocate(h, n, s))
	require.ErrorIs(t, p.Deallocate(h, n, s), ErrInvalidFree)
	st := brkCheck(t, p)
	require.Zero(t, st.LiveAllocations)
	require.Equal(t, poolCacheSlots, st.CachedBlocks, "the cache keeps 16 blocks, the oldest went to the list")
	require.Equal(t, 4<<20, st.FreeBytes)
}

// Frees after Close, of blocks that were cached, handed out by a cache, or live; double frees
// after Close; the upstream gets everything back.
func TestPoolCacheFreesAfterClose(t *testing.T) {
	const n = 2048
	p, sim := newSimPool(t, 1<<30, nil)
	a, _ := brkStream(t)
	var ptrs []DevicePtr
	for range 4 {
		q, err := p.Allocate(n, a)
		require.NoError(t, err)
		ptrs = append(ptrs, q)
	}
	require.NoError(t, p.Deallocate(ptrs[0], n, a)) // cached
	h, err := p.Allocate(n, a)                      // handed out by the cache
	require.NoError(t, err)
	require.Equal(t, ptrs[0], h)
	require.NoError(t, p.Deallocate(ptrs[1], n, a)) // cached
	require.NoError(t, p.Close())
	st := brkCheck(t, p)
	require.Zero(t, st.CachedBlocks)
	require.Equal(t, 3, st.LiveAllocations)
	_, err = p.Allocate(n, a)
	require.ErrorIs(t, err, ErrClosed, "the dead cache serves nothing")
	_, err = p.Allocate(n, DefaultStream)
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, p.Deallocate(ptrs[1], n, a), ErrInvalidFree, "it was cached: already free")
	require.ErrorIs(t, p.Deallocate(h, n+1, a), ErrInvalidFree)
	require.NoError(t, p.Deallocate(h, n, a))
	require.ErrorIs(t, p.Deallocate(h, n, a), ErrInvalidFree)
	require.NoError(t, p.Deallocate(ptrs[2], n, DefaultStream))
	require.NotZero(t, sim.UsedBytes())
	require.NoError(t, p.Deallocate(ptrs[3], n, a))
	require.ErrorIs(t, p.Deallocate(ptrs[3], n, a), ErrInvalidFree)
	require.Zero(t, sim.UsedBytes())
	require.Zero(t, brkCheck(t, p).PoolSize)
	require.NoError(t, p.Close())
}

// A Stream's Close empties its cache; its blocks (cached or handed out) stay consistent; frees
// on the closed stream go to the default stream; Allocate on it fails even when the cache had
// the size; the stream's next frees do not make a cache again.
func TestPoolCacheStreamClose(t *testing.T) {
	const n = 4096
	p, sim := newSimPool(t, 1<<30, nil)
	a, sta := brkStream(t)
	var ptrs []DevicePtr
	for range 4 {
		q, err := p.Allocate(n, a)
		require.NoError(t, err)
		ptrs = append(ptrs, q)
	}
	require.NoError(t, p.Deallocate(ptrs[0], n, a))
	h, err := p.Allocate(n, a)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(ptrs[1], n, a))
	require.Equal(t, 1, p.Stats().CachedBlocks)
	require.NoError(t, sta.Close())
	st := brkCheck(t, p)
	require.Zero(t, st.CachedBlocks)
	require.Equal(t, 3, st.LiveAllocations)
	for _, ps := range st.PerStream {
		require.NotEqual(t, a.ID(), ps.Stream.ID(), "the closed stream keeps no list")
	}
	_, err = p.Allocate(n, a)
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, p.Deallocate(ptrs[1], n, a), ErrInvalidFree)
	require.NoError(t, p.Deallocate(h, n, a))
	require.ErrorIs(t, p.Deallocate(h, n, a), ErrInvalidFree)
	require.NoError(t, p.Deallocate(ptrs[2], n, a))
	_, err = p.Allocate(n, a)
	require.ErrorIs(t, err, ErrClosed)
	blocks, issued := brkCached(p, a)
	require.Zero(t, blocks+issued, "no cache for a closed stream")
	st = brkCheck(t, p)
	require.Equal(t, 1, st.LiveAllocations)
	for _, ps := range st.PerStream {
		require.NotEqual(t, a.ID(), ps.Stream.ID())
	}
	require.NoError(t, p.Deallocate(ptrs[3], n, DefaultStream))
	require.NoError(t, p.Release())
	require.Zero(t, sim.UsedBytes())
}

// A capped pool whose memory sits in many streams' caches: a request that needs all of it
// coalesces them before failing, and a failure's figures match Stats.
func TestPoolCacheCappedFindsCachedMemory(t *testing.T) {
	const total = 4 << 20
	p, sim := newSimPool(t, 1<<30, &PoolOptions{MaximumPoolSize: total})
	var streams []StreamView
	for range 8 {
		s, _ := brkStream(t)
		streams = append(streams, s)
	}
	streams = append(streams, DefaultStream)
	// Fill the pool with 16 KiB blocks over the streams, then free each on its stream: most go
	// into the caches (16 per stream), the rest to the lists.
	type blk struct {
		p DevicePtr
		s StreamView
	}
	var blocks []blk
	for i := 0; ; i++ {
		s := streams[i%len(streams)]
		q, err := p.Allocate(16<<10, s)
		if errors.Is(err, ErrOutOfMemory) {
			break
		}
		require.NoError(t, err)
		blocks = append(blocks, blk{q, s})
	}
	require.Equal(t, total/(16<<10), len(blocks))
	require.Equal(t, total, sim.UsedBytes())
	for _, b := range blocks {
		require.NoError(t, p.Deallocate(b.p, 16<<10, b.s))
	}
	st := brkCheck(t, p)
	require.Equal(t, len(streams)*poolCacheSlots, st.CachedBlocks)
	require.Equal(t, total, st.FreeBytes)
	// One more byte than the pool: fails, the figures are the pool's.
	_, err := p.Allocate(total+1, streams[0])
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	st = brkCheck(t, p)
	require.Equal(t, st.FreeBytes, oom.FreeBytes)
	require.Equal(t, total, oom.FreeBytes)
	// The whole pool, on each stream in turn: the cached blocks coalesce.
	for _, s := range streams {
		q, err := p.Allocate(total, s)
		require.NoError(t, err, "%v", s)
		require.Equal(t, total, brkCheck(t, p).LiveBytes)
		require.NoError(t, p.Deallocate(q, total, s))
	}
	require.Equal(t, total, sim.UsedBytes(), "never past the maximum")
}

// After any out-of-memory error (not one of a size that overflows), no free block of the
// pool, cached or not, could have served the request.
func TestPoolCacheCappedOOMLeavesNothingUsable(t *testing.T) {
	for seed := range uint64(3) {
		p, _ := newSimPool(t, 1<<30, &PoolOptions{MaximumPoolSize: 8 << 20})
		r := rand.New(rand.NewPCG(seed, 11))
		var streams []StreamView
		for range 3 {
			s, _ := brkStream(t)
			streams = append(streams, s)
		}
		streams = append(streams, DefaultStream)
		type blk struct {
			p DevicePtr
			n int
		}
		var live []blk
		ooms := 0
		for op := 0; op < 3000; op++ {
			s := streams[r.IntN(len(streams))]
			if r.IntN(2) == 0 || len(live) == 0 {
				n := []int{256, 4096, 64 << 10, 1 << 20, 1<<20 + 256, 3 << 20}[r.IntN(6)]
				q, err := p.Allocate(n, s)
				if errors.Is(err, ErrOutOfMemory) {
					ooms++
					var oom *OutOfMemoryError
					require.ErrorAs(t, err, &oom)
					st := brkCheck(t, p)
					require.Less(t, st.LargestFreeBlock, roundUp(n), "op %d: a free block could serve %d bytes", op, n)
					require.Equal(t, st.FreeBytes, oom.FreeBytes)
					require.Equal(t, st.LargestFreeBlock, oom.LargestFreeBlock)
					continue
				}
				require.NoError(t, err)
				live = append(live, blk{q, n})
			} else {
				k := r.IntN(len(live))
				require.NoError(t, p.Deallocate(live[k].p, live[k].n, s))
				live = append(live[:k], live[k+1:]...)
			}
		}
		require.NotZero(t, ooms)
		for _, b := range live {
			require.NoError(t, p.Deallocate(b.p, b.n, DefaultStream))
		}
		require.Zero(t, brkCheck(t, p).LiveBytes)
	}
}

// An expandable pool with a release threshold keeps at most the threshold plus one minimum
// chunk (32 MiB) of free memory mapped after a free. Memory freed into the streams' caches is
// free memory too (Stats counts it so), so it must not let the pool keep more mapped. Three
// Streams each allocate sixteen blocks (the pool maps two 32 MiB chunks) and free them, last
// first: with 1 MiB + 256 bytes (too large for a cache) a trim gives the upper chunk back and
// 32 MiB stay mapped; with 1 MiB every block waits in a cache, no free reaches the trim, and all
// 64 MiB stay mapped with ReleaseThreshold 1.
func TestPoolCacheReleaseThresholdCountsCachedMemory(t *testing.T) {
	for _, n := range []int{1<<20 + 256, 1 << 20} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			sim, err := NewSimulatedMemoryResource(1 << 40)
			require.NoError(t, err)
			p, err := NewPoolMemoryResource(sim, &PoolOptions{Expandable: true, ReleaseThreshold: 1})
			require.NoError(t, err)
			t.Cleanup(func() { p.Close() })
			type blk struct {
				p DevicePtr
				s StreamView
			}
			var blocks []blk
			for range 3 {
				s, _ := brkStream(t)
				for range poolCacheSlots {
					q, err := p.Allocate(n, s)
					require.NoError(t, err)
					blocks = append(blocks, blk{q, s})
				}
			}
			require.Equal(t, 64<<20, p.PoolSize())
			for i := len(blocks) - 1; i >= 0; i-- {
				require.NoError(t, p.Deallocate(blocks[i].p, n, blocks[i].s))
			}
			st := brkCheck(t, p)
			require.Zero(t, st.LiveBytes)
			require.LessOrEqual(t, st.FreeBytes, 1+32<<20,
				"%d MiB free kept mapped with ReleaseThreshold 1 (%d MiB of it in the caches)", st.FreeBytes>>20, st.CachedBytes>>20)
		})
	}
}

// After a trim that can give nothing back (live blocks pin every chunk), the next trim waits
// until the free memory has grown by another minimum chunk: resetTrim sets the level to the
// free bytes plus 32 MiB, not to the threshold plus 32 MiB as its comment and ReleaseThreshold's
// documentation say. Here (no cache involved: the blocks are too large for one) both 32 MiB
// chunks end wholly free and stay mapped with ReleaseThreshold 1, although the last free left
// 64 MiB free, more than the threshold plus one chunk, with two whole chunks free.
func TestPoolExpandableTrimLevelRisesPastThreshold(t *testing.T) {
	const n = 1<<20 + 256
	sim, err := NewSimulatedMemoryResource(1 << 40)
	require.NoError(t, err)
	p, err := NewPoolMemoryResource(sim, &PoolOptions{Expandable: true, ReleaseThreshold: 1})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	var ptrs []DevicePtr
	for range 48 {
		q, err := p.Allocate(n, DefaultStream)
		require.NoError(t, err)
		ptrs = append(ptrs, q)
	}
	require.Equal(t, 64<<20, p.PoolSize())
	for _, q := range ptrs { // first allocated first: the lower chunk stays pinned the longest
		require.NoError(t, p.Deallocate(q, n, DefaultStream))
	}
	st := brkCheck(t, p)
	require.Zero(t, st.LiveBytes)
	require.Zero(t, st.CachedBytes)
	require.LessOrEqual(t, st.FreeBytes, 1+32<<20, "%d MiB free kept mapped with ReleaseThreshold 1", st.FreeBytes>>20)
}

// Adaptors stacked on a pool: wrong sizes and double frees through the stack are rejected by
// the pool (the tracking adaptor frees with the size it recorded), and the statistics adaptor's
// counters come back to what they were after a rejected free.
func TestPoolCacheUnderAdaptors(t *testing.T) {
	const n = 4096
	p, _ := newSimPool(t, 1<<30, nil)
	tr, err := NewTrackingResourceAdaptor(p, nil)
	require.NoError(t, err)
	var logBuf brkSyncBuffer
	lg, err := NewLoggingResourceAdaptor(tr, &logBuf, nil)
	require.NoError(t, err)
	stats, err := NewStatisticsResourceAdaptor(lg)
	require.NoError(t, err)
	s, _ := brkStream(t)
	b, _ := brkStream(t)
	x, err := stats.Allocate(n, s)
	require.NoError(t, err)
	require.NoError(t, stats.Deallocate(x, n, s)) // into s's cache
	require.Equal(t, 1, p.Stats().CachedBlocks)
	before := stats.Stats()
	require.ErrorIs(t, stats.Deallocate(x, n, s), ErrInvalidFree, "double free of a cached block")
	require.ErrorIs(t, stats.Deallocate(x, n, b), ErrInvalidFree)
	require.Equal(t, before, stats.Stats())
	y, err := stats.Allocate(n, s) // from the cache
	require.NoError(t, err)
	require.Equal(t, x, y)
	require.Equal(t, 1, p.Stats().LiveAllocations)
	require.NoError(t, stats.Deallocate(y, n, b), "freed on another stream")
	require.ErrorIs(t, stats.Deallocate(y, n, s), ErrInvalidFree)
	st := stats.Stats()
	require.Zero(t, st.CurrentBytes)
	require.Zero(t, st.CurrentCount)
	require.Zero(t, brkCheck(t, p).LiveAllocations)
	require.Zero(t, tr.AllocatedBytes())
}

// brkSyncBuffer is a goroutine-safe sink for a logging adaptor.
type brkSyncBuffer struct {
	mu    sync.Mutex
	n     int
	lines int
}

func (b *brkSyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.n += len(p)
	for _, c := range p {
		if c == '\n' {
			b.lines++
		}
	}
	return len(p), nil
}

// A random single-goroutine walk over allocations, frees on any stream (own, other, default,
// closed), double frees, wrong sizes, Release, stream closes and new streams, for a plain pool,
// a capped one and expandable ones; the invariants and Stats are checked against a shadow after
// every operation.
func TestPoolCacheRandomWalk(t *testing.T) {
	configs := []struct {
		name string
		opts *PoolOptions
	}{
		{"plain", nil},
		{"capped", &PoolOptions{MaximumPoolSize: 16 << 20}},
		{"expandable", &PoolOptions{Expandable: true}},
		{"expandable-threshold", &PoolOptions{Expandable: true, ReleaseThreshold: 1 << 20, MaximumPoolSize: 256 << 20}},
	}
	for _, c := range configs {
		t.Run(c.name, func(t *testing.T) {
			brkRandomWalk(t, c.opts, 1, 700)
		})
	}
}

func brkRandomWalk(t *testing.T, opts *PoolOptions, seed uint64, ops int) {
	sim, err := NewSimulatedMemoryResource(1 << 40)
	require.NoError(t, err)
	p, err := NewPoolMemoryResource(sim, opts)
	require.NoError(t, err)
	r := rand.New(rand.NewPCG(seed, 5))
	type strm struct {
		v      StreamView
		st     *Stream
		closed bool
	}
	streams := []*strm{{v: DefaultStream}}
	newStream := func() {
		v, st := brkStream(t)
		streams = append(streams, &strm{v: v, st: st})
	}
	for range 3 {
		newStream()
	}
	pick := func() *strm { return streams[r.IntN(len(streams))] }
	type blk struct {
		p DevicePtr
		n int
	}
	var live []blk
	var freed []blk // recently freed: double-free candidates
	liveBytes := 0
	sizes := []int{1, 256, 257, 4096, 4000, 64 << 10, 1<<20 - 255, 1 << 20, 1<<20 + 1, 5 << 20}
	for op := 0; op < ops; op++ {
		what := ""
		switch k := r.IntN(100); {
		case k < 45 || len(live) == 0:
			s := pick()
			n := sizes[r.IntN(len(sizes))]
			what = fmt.Sprintf("Allocate(%d, %v)", n, s.v)
			q, err := p.Allocate(n, s.v)
			switch {
			case s.closed:
				require.ErrorIs(t, err, ErrClosed, what)
			case errors.Is(err, ErrOutOfMemory):
				require.NotNil(t, opts, what)
			default:
				require.NoError(t, err, what)
				live = append(live, blk{q, n})
				liveBytes += roundUp(n)
			}
		case k < 85:
			j := r.IntN(len(live))
			b := live[j]
			s := pick()
			what = fmt.Sprintf("Deallocate(%#x, %d, %v)", uintptr(b.p), b.n, s.v)
			if r.IntN(10) == 0 {
				// a wrong size first: rejected, nothing changes
				before := p.Stats()
				require.ErrorIs(t, p.Deallocate(b.p, b.n+256, s.v), ErrInvalidFree, what)
				require.Equal(t, before, p.Stats(), what)
			}
			require.NoError(t, p.Deallocate(b.p, b.n, s.v), what)
			live = append(live[:j], live[j+1:]...)
			liveBytes -= roundUp(b.n)
			freed = append(freed, b)
			if len(freed) > 8 {
				freed = freed[1:]
			}
		case k < 92 && len(freed) > 0:
			b := freed[r.IntN(len(freed))]
			reused := false
			for _, l := range live {
				if l.p == b.p {
					reused = true
				}
			}
			if reused {
				continue
			}
			s := pick()
			what = fmt.Sprintf("double Deallocate(%#x, %d, %v)", uintptr(b.p), b.n, s.v)
			before := p.Stats()
			require.ErrorIs(t, p.Deallocate(b.p, b.n, s.v), ErrInvalidFree, what)
			require.Equal(t, before, p.Stats(), what)
		case k < 95:
			what = "Release"
			require.NoError(t, p.Release())
			require.Zero(t, p.Stats().CachedBlocks, what)
		case k < 98:
			for _, s := range streams[1:] {
				if !s.closed {
					what = fmt.Sprintf("Close %v", s.v)
					require.NoError(t, s.st.Close())
					s.closed = true
					blocks, issued := brkCached(p, s.v)
					require.Zero(t, blocks+issued, what)
					break
				}
			}
			newStream()
		default:
			what = "Stats"
		}
		require.NoError(t, p.CheckInvariants(), "op %d: %s", op, what)
		st := p.Stats()
		require.Equal(t, len(live), st.LiveAllocations, "op %d: %s", op, what)
		require.Equal(t, liveBytes, st.LiveBytes, "op %d: %s", op, what)
		require.Equal(t, st.PoolSize-st.LiveBytes, st.FreeBytes, "op %d: %s", op, what)
		if opts != nil && opts.MaximumPoolSize > 0 {
			require.LessOrEqual(t, st.PoolSize, opts.MaximumPoolSize)
		}
		sum := 0
		for _, ps := range st.PerStream {
			sum += ps.FreeBytes
		}
		require.Equal(t, st.FreeBytes, sum, "op %d: %s", op, what)
	}
	for _, b := range live {
		require.NoError(t, p.Deallocate(b.p, b.n, DefaultStream))
	}
	require.NoError(t, p.Close())
	require.Zero(t, sim.UsedBytes())
}

// Many goroutines sharing streams (the default one among them) and a pool, while others call
// Stats, CheckInvariants and Release, and streams close under the users' feet; in two of the
// runs the pool itself is closed midway. Run with -race.
func TestPoolCacheConcurrentChaos(t *testing.T) {
	for _, opts := range []*PoolOptions{nil, {MaximumPoolSize: 64 << 20}, {Expandable: true, ReleaseThreshold: 4 << 20}} {
		brkChaos(t, opts, false)
	}
	brkChaos(t, nil, true)
	brkChaos(t, &PoolOptions{Expandable: true}, true)
}

// brkChaos runs the workers; with closeMidway the pool is closed while they run: later
// allocations fail with ErrClosed, frees keep working, and the upstream gets everything back.
func brkChaos(t *testing.T, opts *PoolOptions, closeMidway bool) {
	sim, err := NewSimulatedMemoryResource(1 << 40)
	require.NoError(t, err)
	p, err := NewPoolMemoryResource(sim, opts)
	require.NoError(t, err)
	const workers = 6
	// Two streams that close midway, two that stay, and the default stream.
	vShared, stShared := brkStream(t)
	vDoomed, stDoomed := brkStream(t)
	vStay, _ := brkStream(t)
	streams := []StreamView{DefaultStream, vShared, vDoomed, vStay}
	var stop atomic.Bool
	var closedOK, progress atomic.Int64
	errc := make(chan error, 64)
	report := func(err error) {
		select {
		case errc <- err:
		default:
		}
	}
	var wg, side sync.WaitGroup
	type blk struct {
		p DevicePtr
		n int
	}
	handoff := make(chan blk, 256)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 9))
			var mine []blk
			// With closeMidway, go on past 1500 steps until an allocation meets the closed pool, so
			// that the close happens while the workers run however the goroutines are scheduled.
			for i := 0; i < 1500 || (closeMidway && closedOK.Load() == 0 && i < 1_000_000); i++ {
				progress.Add(1)
				s := streams[r.IntN(len(streams))]
				switch k := r.IntN(10); {
				case k < 5 || len(mine) == 0:
					// sizes unique to the goroutine (they round alike across goroutines), so that
					// a stray double free can never match another goroutine's allocation
					n := []int{256, 1000, 4096, 64 << 10, 1 << 20, 2 << 20}[r.IntN(6)] - 1 - w
					q, err := p.Allocate(n, s)
					switch {
					case errors.Is(err, ErrClosed):
						closedOK.Add(1)
					case errors.Is(err, ErrOutOfMemory) && opts != nil && opts.MaximumPoolSize > 0:
					case err != nil:
						report(fmt.Errorf("Allocate(%d, %v): %w", n, s, err))
						return
					default:
						mine = append(mine, blk{q, n})
					}
				case k < 9:
					j := r.IntN(len(mine))
					b := mine[j]
					mine = append(mine[:j], mine[j+1:]...)
					if r.IntN(6) == 0 {
						select {
						case handoff <- b:
							continue
						default:
						}
					}
					if err := p.Deallocate(b.p, b.n, s); err != nil {
						report(fmt.Errorf("Deallocate(%#x, %d, %v): %w", uintptr(b.p), b.n, s, err))
						return
					}
					if r.IntN(20) == 0 {
						// A double free on any stream: another goroutine may have the memory now,
						// but never with this size.
						if err := p.Deallocate(b.p, b.n, streams[r.IntN(len(streams))]); !errors.Is(err, ErrInvalidFree) {
							report(fmt.Errorf("double Deallocate(%#x, %d): %v", uintptr(b.p), b.n, err))
							return
						}
					}
				default:
					select {
					case b := <-handoff:
						if err := p.Deallocate(b.p, b.n, s); err != nil {
							report(fmt.Errorf("handed-off Deallocate(%#x, %d, %v): %w", uintptr(b.p), b.n, s, err))
							return
						}
					default:
					}
				}
			}
			for _, b := range mine {
				if err := p.Deallocate(b.p, b.n, streams[r.IntN(len(streams))]); err != nil {
					report(err)
				}
			}
		}()
	}
	side.Add(1)
	go func() {
		defer side.Done()
		doomedClosed, sharedClosed, poolClosed := false, false, false
		for i := 0; !stop.Load(); i++ {
			switch i % 4 {
			case 0:
				if err := p.CheckInvariants(); err != nil {
					report(fmt.Errorf("CheckInvariants: %w", err))
				}
			case 1:
				if st := p.Stats(); st.FreeBytes != st.PoolSize-st.LiveBytes || st.FreeBytes < 0 || st.LiveBytes < 0 {
					report(fmt.Errorf("Stats: %+v", st))
				}
			case 2:
				if err := p.Release(); err != nil {
					report(fmt.Errorf("Release: %w", err))
				}
			case 3:
				// events driven by the workers' progress, so that they happen while they run
				switch n := progress.Load(); {
				case n >= 2000 && !doomedClosed:
					doomedClosed = true
					stDoomed.Close()
				case n >= 4000 && !sharedClosed:
					sharedClosed = true
					stShared.Close()
				case closeMidway && n >= 6000 && !poolClosed:
					poolClosed = true
					if err := p.Close(); err != nil {
						report(fmt.Errorf("Close: %w", err))
					}
				}
			}
		}
	}()
	wg.Wait()
	stop.Store(true)
	side.Wait()
	close(handoff)
	for b := range handoff {
		require.NoError(t, p.Deallocate(b.p, b.n, vShared))
	}
	close(errc)
	for err := range errc {
		t.Error(err)
	}
	if closeMidway {
		require.NotZero(t, closedOK.Load(), "allocations met the closed pool")
	}
	st := brkCheck(t, p)
	require.Zero(t, st.LiveAllocations)
	require.NoError(t, p.Close())
	require.Zero(t, sim.UsedBytes())
}

// Goroutines on their own streams and the default one go through a statistics adaptor over a
// logging adaptor over a pool, with double frees (rejected by the pool, the counters restored)
// on any stream; at the end the counters are back to zero and every call was logged. (A
// tracking adaptor is left out: it corrects a wrong size, so a double free that meets another
// goroutine's reuse of the address would free that allocation, as documented.)
func TestPoolCacheAdaptorStackConcurrent(t *testing.T) {
	p, sim := newSimPool(t, 1<<40, nil)
	var sink brkSyncBuffer
	lg, err := NewLoggingResourceAdaptor(p, &sink, &LoggingOptions{AutoFlush: true})
	require.NoError(t, err)
	stats, err := NewStatisticsResourceAdaptor(lg)
	require.NoError(t, err)
	streams := []StreamView{DefaultStream}
	for range 3 {
		s, _ := brkStream(t)
		streams = append(streams, s)
	}
	var wg sync.WaitGroup
	var doubles atomic.Int64
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 3))
			own := streams[w]
			type blk struct {
				p DevicePtr
				n int
			}
			var mine []blk
			for i := 0; i < 1500; i++ {
				if len(mine) == 0 || r.IntN(2) == 0 {
					n := []int{512, 4096, 64 << 10}[r.IntN(3)] - w - 1 // unique to the goroutine
					q, err := stats.Allocate(n, own)
					if err != nil {
						t.Error(err)
						return
					}
					mine = append(mine, blk{q, n})
					continue
				}
				j := r.IntN(len(mine))
				b := mine[j]
				mine = append(mine[:j], mine[j+1:]...)
				s := own
				if r.IntN(4) == 0 {
					s = streams[r.IntN(len(streams))]
				}
				if err := stats.Deallocate(b.p, b.n, s); err != nil {
					t.Error(err)
					return
				}
				if r.IntN(10) == 0 {
					doubles.Add(1)
					if err := stats.Deallocate(b.p, b.n, streams[r.IntN(len(streams))]); !errors.Is(err, ErrInvalidFree) {
						t.Errorf("double free: %v", err)
						return
					}
				}
			}
			for _, b := range mine {
				if err := stats.Deallocate(b.p, b.n, own); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	require.NotZero(t, doubles.Load())
	st := stats.Stats()
	require.Zero(t, st.CurrentBytes)
	require.Zero(t, st.CurrentCount)
	require.NoError(t, lg.Flush())
	require.Equal(t, int(2*st.TotalCount+doubles.Load())+1, underLock(&sink.mu, func() int { return sink.lines }), "a header, then one line per call")
	ps := brkCheck(t, p)
	require.Zero(t, ps.LiveAllocations)
	require.NoError(t, p.Release())
	require.Zero(t, sim.UsedBytes())
}
