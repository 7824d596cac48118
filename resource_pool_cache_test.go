package rmm

import (
	"math/rand"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func poolCacheTestStream(t *testing.T) StreamView {
	t.Helper()
	s, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s.View()
}

// A free of a size the stream just asked for waits in the stream's cache, and the next request
// of that size on that stream gets the same block back.
func TestPoolCacheReusesOnTheSameStream(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 4 << 20})
	s := poolCacheTestStream(t)
	a, err := p.Allocate(64<<10, s)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(a, 64<<10, s))
	st := p.Stats()
	require.Equal(t, 1, st.CachedBlocks)
	require.Equal(t, 64<<10, st.CachedBytes)
	require.Zero(t, st.LiveBytes)
	require.Equal(t, 4<<20, st.FreeBytes)
	require.NoError(t, p.CheckInvariants())

	// 64 KiB − 100 bytes rounds to the same 64 KiB: served by the cache.
	b, err := p.Allocate(64<<10-100, s)
	require.NoError(t, err)
	require.Equal(t, a, b)
	st = p.Stats()
	require.Zero(t, st.CachedBlocks)
	require.Equal(t, 1, st.LiveAllocations)
	require.Equal(t, 64<<10, st.LiveBytes)
	require.NoError(t, p.CheckInvariants())

	// The size asked is checked on the cache's own path too.
	require.ErrorIs(t, p.Deallocate(b, 64<<10, s), ErrInvalidFree)
	require.Equal(t, 1, p.Stats().LiveAllocations, "a rejected free changes nothing")
	require.NoError(t, p.Deallocate(b, 64<<10-100, s))
	require.ErrorIs(t, p.Deallocate(b, 64<<10-100, s), ErrInvalidFree, "double free")
	require.NoError(t, p.CheckInvariants())
	require.Zero(t, p.Stats().LiveAllocations)
}

// Sizes the stream has not asked for lately, blocks over 1 MiB and streams of foreign handles
// bypass the cache.
func TestPoolCacheTakesOnlyRecentSmallSizes(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 64 << 20})
	s := poolCacheTestStream(t)
	var ptrs []DevicePtr
	sizes := []int{256, 512, 768, 1024, 1280, 2 << 20}
	for _, n := range sizes {
		q, err := p.Allocate(n, s)
		require.NoError(t, err)
		ptrs = append(ptrs, q)
	}
	for i, n := range sizes {
		require.NoError(t, p.Deallocate(ptrs[i], n, s))
	}
	st := p.Stats()
	// The last four sizes asked were 768, 1024, 1280 and 2 MiB; 2 MiB is too large.
	require.Equal(t, 3, st.CachedBlocks)
	require.Equal(t, 768+1024+1280, st.CachedBytes)
	require.NoError(t, p.CheckInvariants())
}

// A block handed out by one stream's cache may be freed on another stream; it then goes to that
// stream's list or cache like any block.
func TestPoolCacheFreeOnAnotherStream(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 4 << 20})
	a, b := poolCacheTestStream(t), poolCacheTestStream(t)
	x, err := p.Allocate(4096, a)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(x, 4096, a))
	y, err := p.Allocate(4096, a) // from a's cache
	require.NoError(t, err)
	require.Equal(t, x, y)
	require.ErrorIs(t, p.Deallocate(y, 4000, b), ErrInvalidFree, "wrong size, on another stream")
	require.NoError(t, p.CheckInvariants())
	require.Equal(t, 1, p.Stats().LiveAllocations)
	require.NoError(t, p.Deallocate(y, 4096, b))
	require.ErrorIs(t, p.Deallocate(y, 4096, a), ErrInvalidFree, "double free, on the first stream")
	require.ErrorIs(t, p.Deallocate(y, 4096, b), ErrInvalidFree, "double free, on the second stream")
	st := p.Stats()
	require.Zero(t, st.LiveAllocations)
	require.Equal(t, 4<<20, st.FreeBytes)
	for _, ps := range st.PerStream {
		if ps.Stream.ID() == a.ID() {
			require.Zero(t, ps.FreeBytes, "the block left a's cache")
		}
	}
	require.NoError(t, p.CheckInvariants())
}

// Memory in one stream's cache serves another stream before the pool grows, and a capped pool
// reaches its cap with it.
func TestPoolCacheServesOtherStreamsBeforeGrowth(t *testing.T) {
	p, sim := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 1 << 20, MaximumPoolSize: 1 << 20})
	a, b := poolCacheTestStream(t), poolCacheTestStream(t)
	var ptrs []DevicePtr
	for range 4 {
		q, err := p.Allocate(256<<10, a)
		require.NoError(t, err)
		ptrs = append(ptrs, q)
	}
	for _, q := range ptrs {
		require.NoError(t, p.Deallocate(q, 256<<10, a))
	}
	require.Equal(t, 4, p.Stats().CachedBlocks)
	whole, err := p.Allocate(1<<20, b)
	require.NoError(t, err, "the four cached blocks coalesce into the whole pool")
	require.Equal(t, ptrs[0], whole)
	require.Equal(t, 1<<20, sim.UsedBytes())
	st := p.Stats()
	require.Zero(t, st.CachedBlocks)
	require.Equal(t, 1<<20, st.LiveBytes)
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(whole, 1<<20, b))
}

// Closing a stream, Release and Close leave nothing behind in the caches.
func TestPoolCacheStreamCloseReleaseAndClose(t *testing.T) {
	p, sim := newSimPool(t, 1<<30, nil)
	s, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	live, err := p.Allocate(8192, s.View())
	require.NoError(t, err)
	q, err := p.Allocate(8192, s.View())
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(q, 8192, s.View()))
	q, err = p.Allocate(8192, s.View()) // handed out by the cache
	require.NoError(t, err)
	r, err := p.Allocate(8192, s.View())
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(r, 8192, s.View())) // cached
	require.Equal(t, 1, p.Stats().CachedBlocks)
	require.NoError(t, s.Close())
	st := p.Stats()
	require.Zero(t, st.CachedBlocks, "a closing stream's cache is emptied")
	require.Equal(t, 2, st.LiveAllocations)
	require.NoError(t, p.CheckInvariants())
	// Blocks handed out on the closed stream are freed on another one.
	require.NoError(t, p.Deallocate(q, 8192, DefaultStream))
	q, err = p.Allocate(8192, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(q, 8192, DefaultStream)) // cached on the default stream
	require.Equal(t, 1, p.Stats().CachedBlocks)
	require.NoError(t, p.Release())
	require.Zero(t, p.Stats().CachedBlocks, "Release empties the caches")
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(live, 8192, DefaultStream))
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
	require.Zero(t, sim.UsedBytes())

	// Close with a cached block and one handed out by a cache: the handed-out one outlives
	// Close, and its free returns the last upstream block.
	x, err := p.Allocate(512, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(x, 512, DefaultStream))
	x, err = p.Allocate(512, DefaultStream)
	require.NoError(t, err)
	y, err := p.Allocate(512, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(y, 512, DefaultStream))
	require.NoError(t, p.Close())
	_, err = p.Allocate(512, DefaultStream)
	require.ErrorIs(t, err, ErrClosed, "no cache serves after Close")
	require.NotZero(t, sim.UsedBytes())
	require.NoError(t, p.Deallocate(x, 512, DefaultStream))
	require.Zero(t, sim.UsedBytes())
}

// An out-of-memory error counts cached blocks as free, as Stats does.
func TestPoolCacheOutOfMemoryFigures(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 1 << 20, MaximumPoolSize: 1 << 20})
	s := poolCacheTestStream(t)
	q, err := p.Allocate(4096, s)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(q, 4096, s))
	_, err = p.Allocate(int(^uint(0)>>1), s) // overflows when rounded: fails before any search
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	st := p.Stats()
	require.Equal(t, 1, st.CachedBlocks)
	require.Equal(t, st.FreeBytes, oom.FreeBytes)
	require.Equal(t, st.LargestFreeBlock, oom.LargestFreeBlock)
}

// Goroutines on their own streams (and some on the default stream) allocate and free sizes from
// a small set, free some blocks on other streams, and call Stats and Release meanwhile; run with
// -race. At the end nothing is live, the invariants hold and Release gives everything back.
func TestPoolCacheConcurrent(t *testing.T) {
	p, sim := newSimPool(t, 1<<34, nil)
	const workers = 8
	streams := make([]StreamView, workers)
	for i := range streams {
		if i%4 == 3 {
			streams[i] = DefaultStream
		} else {
			streams[i] = poolCacheTestStream(t)
		}
	}
	type handoff struct {
		ptr DevicePtr
		n   int
	}
	passed := make(chan handoff, 1024)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewSource(int64(w)))
			s := streams[w]
			var mine []handoff
			for i := range 3000 {
				switch k := r.Intn(10); {
				case k < 5 || len(mine) == 0:
					n := []int{256, 1000, 4096, 64 << 10, 1 << 20, 3 << 20}[r.Intn(6)]
					q, err := p.Allocate(n, s)
					if err != nil {
						t.Error(err)
						return
					}
					mine = append(mine, handoff{q, n})
				case k < 9:
					j := r.Intn(len(mine))
					h := mine[j]
					mine = append(mine[:j], mine[j+1:]...)
					if r.Intn(8) == 0 {
						passed <- h // freed by whoever takes it, on its stream
						continue
					}
					if err := p.Deallocate(h.ptr, h.n, s); err != nil {
						t.Error(err)
						return
					}
				default:
					select {
					case h := <-passed:
						if err := p.Deallocate(h.ptr, h.n, s); err != nil {
							t.Error(err)
							return
						}
					default:
					}
				}
				if i%500 == 0 {
					if w == 0 {
						if err := p.Release(); err != nil {
							t.Error(err)
						}
					} else if st := p.Stats(); st.FreeBytes != st.PoolSize-st.LiveBytes {
						t.Errorf("Stats: free %d, pool %d, live %d", st.FreeBytes, st.PoolSize, st.LiveBytes)
					}
				}
			}
			for _, h := range mine {
				if err := p.Deallocate(h.ptr, h.n, s); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	close(passed)
	for h := range passed {
		require.NoError(t, p.Deallocate(h.ptr, h.n, DefaultStream))
	}
	require.NoError(t, p.CheckInvariants())
	st := p.Stats()
	require.Zero(t, st.LiveAllocations)
	require.Zero(t, st.LiveBytes)
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
	require.Zero(t, sim.UsedBytes())
}

// Blocks freed through a cache's fast path and then returned to the stream's list mark the list
// dirty, so that the next stream to take them waits for an event recorded after those frees.
func TestPoolCacheFlushMarksListDirty(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 4 << 20})
	s := poolCacheTestStream(t)
	x, err := p.Allocate(4096, s)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(x, 4096, s)) // slow path: into the cache
	p.mu.Lock()
	l := p.byStream[s.ID()]
	l.dirty = false // as after another stream made it record its event
	p.mu.Unlock()
	x, err = p.Allocate(4096, s) // from the cache
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(x, 4096, s)) // fast path: back into the cache
	require.False(t, underLock(&p.mu, func() bool { return l.dirty }))
	y, err := p.Allocate(8192, s) // a miss: the cached block goes to the list
	require.NoError(t, err)
	require.True(t, underLock(&p.mu, func() bool { return l.dirty }), "the list holds a block freed after its event was recorded")
	require.NoError(t, p.Deallocate(y, 8192, s))
	require.NoError(t, p.CheckInvariants())
}

// A free on a Stream while its Close waits for a take in flight on the stream's list makes the
// stream a new cache; Close must end that cache too. Left alive, its blocks were flushed after the
// stream was gone into the default stream's list with nothing ordering them after the stream's
// work (a random walk with failing event synchronisations found it).
func TestPoolCacheFreeDuringStreamClose(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, nil) // no list before the fake is wired
	e := newPoolSyncEnv(t, p)
	s, st, si := e.stream(0x101, "S")
	tv, _, ti := e.stream(0x102, "T")
	x := e.mustAlloc(4096, s, si) // slow path: 4096 is now a size s asks for
	p.mu.Lock()
	l := p.byStream[s.ID()]
	p.pin(l) // a take in flight on s's list: Close waits for it
	p.mu.Unlock()
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		st.Close()
	}()
	// Wait until the pool's hook waits for the take (unlocked).
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.waiters > 0
	}, 5*time.Second, time.Millisecond)
	e.mustFree(x, 4096, s, si) // s's list still exists: the block goes to a new cache
	p.mu.Lock()
	cached := p.cacheOf(s) != nil
	p.unpin(l)
	p.mu.Unlock()
	require.True(t, cached, "the free went to a cache")
	<-closed
	e.f.kill(s.h)
	require.Nil(t, underLock(&p.mu, func() *poolCache { return p.cacheOf(s) }), "Close ended the cache made while it waited")
	// Another stream takes the memory: ordered after s's free, with no call naming s.
	y := e.mustAlloc(4<<20, tv, ti)
	e.mustFree(y, 4<<20, tv, ti)
	e.done()
}
