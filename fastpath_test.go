package rmm

import (
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// apart requires at least 64 bytes between the end of the field ending at end and the field
// starting at next: then no cache line holds bytes of both, wherever the object starts.
func apart(t *testing.T, end, next uintptr, msg string) {
	t.Helper()
	require.GreaterOrEqual(t, next, end+64, msg)
}

// The fields that every fast path reads, or that one stream writes at every allocation and free,
// share no cache line with fields that others write.
func TestFastPathLayout(t *testing.T) {
	var c poolCache
	apart(t, unsafe.Offsetof(c.stream)+unsafe.Sizeof(c.stream), unsafe.Offsetof(c.mu), "poolCache: stream, read by every cacheOf, off the written fields")
	apart(t, unsafe.Offsetof(c.issued)+unsafe.Sizeof(c.issued), unsafe.Sizeof(c), "poolCache: the written fields off the next object")

	var p PoolMemoryResource
	apart(t, unsafe.Offsetof(p.peakSize)+unsafe.Sizeof(p.peakSize), unsafe.Offsetof(p.caches), "PoolMemoryResource: caches off the fields written under mu")
	apart(t, unsafe.Offsetof(p.caches)+unsafe.Sizeof(p.caches), unsafe.Sizeof(p)+8, "PoolMemoryResource: caches off the next object")

	var s arenaStreamSet
	apart(t, 0, unsafe.Offsetof(s.arenaSet)+64, "arenaStreamSet: a pad before")
	apart(t, unsafe.Offsetof(s.arenaSet)+unsafe.Sizeof(s.arenaSet), unsafe.Sizeof(s), "arenaStreamSet: a pad after")

	var r ArenaMemoryResource
	apart(t, unsafe.Offsetof(r.dumpPath)+unsafe.Sizeof(r.dumpPath), unsafe.Offsetof(r.global), "ArenaMemoryResource: the read-only fields off the global arena")
	apart(t, unsafe.Offsetof(r.recs)+unsafe.Sizeof(r.recs), unsafe.Offsetof(r.arenas), "ArenaMemoryResource: arenas off recs")
	require.Less(t, unsafe.Offsetof(r.arenas), unsafe.Offsetof(r.closed))
	require.Less(t, unsafe.Offsetof(r.lazyRecs), unsafe.Offsetof(r.closed))
	apart(t, unsafe.Offsetof(r.closed)+unsafe.Sizeof(r.closed), unsafe.Offsetof(r.defRec), "ArenaMemoryResource: closed off defRec")
}

// A block back from the cache for another size that rounds the same is checked against the size
// asked last, not the one it was cached with.
func TestPoolCacheSizeAskedAgain(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{InitialPoolSize: 4 << 20})
	s := poolCacheTestStream(t)
	a, err := p.Allocate(64<<10-100, s)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(a, 64<<10-100, s))
	require.Equal(t, 1, p.Stats().CachedBlocks)
	require.NoError(t, p.CheckInvariants())
	for range 3 {
		b, err := p.Allocate(64<<10, s)
		require.NoError(t, err)
		require.Equal(t, a, b)
		require.ErrorIs(t, p.Deallocate(b, 64<<10-100, s), ErrInvalidFree)
		require.NoError(t, p.Deallocate(b, 64<<10, s))
		require.Equal(t, 1, p.Stats().CachedBlocks)
		require.NoError(t, p.CheckInvariants())
	}
	b, err := p.Allocate(64<<10-100, s)
	require.NoError(t, err)
	require.ErrorIs(t, p.Deallocate(b, 64<<10, s), ErrInvalidFree)
	require.NoError(t, p.Deallocate(b, 64<<10-100, s))
	require.ErrorIs(t, p.Deallocate(b, 64<<10-100, s), ErrInvalidFree, "double free")
	require.NoError(t, p.CheckInvariants())
}

// Small blocks are indexed by the 1 MiB range of the arena they lie in: the blocks of one
// stream's superblock share a shard, which the next stream's superblock does not use.
func TestArenaLiveShardByRange(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 40)
	r, err := NewArenaMemoryResource(sim, &ArenaOptions{ArenaSize: 256 << 20})
	require.NoError(t, err)
	defer r.Close()
	s1, s2 := poolCacheTestStream(t), poolCacheTestStream(t)
	var p1, p2 []DevicePtr
	for range 8 {
		p, err := r.Allocate(64<<10, s1)
		require.NoError(t, err)
		p1 = append(p1, p)
		p, err = r.Allocate(64<<10, s2)
		require.NoError(t, err)
		p2 = append(p2, p)
	}
	for _, p := range p1[1:] {
		require.Same(t, r.liveShard(p1[0]), r.liveShard(p))
	}
	for _, p := range p2[1:] {
		require.Same(t, r.liveShard(p2[0]), r.liveShard(p))
	}
	require.NotSame(t, r.liveShard(p1[0]), r.liveShard(p2[0]))
	// Pointers outside the arena still map to a shard (and are then not found there).
	require.NotNil(t, r.liveShard(r.base-256))
	require.NotNil(t, r.liveShard(r.base+DevicePtr(r.size)+(1<<30)))
	require.ErrorIs(t, r.Deallocate(r.base+DevicePtr(r.size)+(1<<30), 256, s1), ErrInvalidFree)
	st := r.Stats()
	require.Equal(t, 16, st.LiveAllocations)
	require.Equal(t, 16*64<<10, st.LiveBytes)
	require.NoError(t, r.CheckInvariants())
}

// Many streams allocating and freeing at once in an arena larger than the shards' period (64
// MiB), with frees on other streams and on DefaultStream: the live figures add up and the
// invariants hold.
func TestArenaLiveShardsConcurrent(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 40)
	r, err := NewArenaMemoryResource(sim, &ArenaOptions{ArenaSize: 512 << 20})
	require.NoError(t, err)
	defer r.Close()
	const workers = 8
	streams := make([]StreamView, workers)
	for i := range streams {
		streams[i] = poolCacheTestStream(t)
	}
	type alloc struct {
		p DevicePtr
		n int
	}
	kept := make([][]alloc, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := streams[w]
			var live []alloc
			x := uint32(w + 1)
			next := func() uint32 { x ^= x << 13; x ^= x >> 17; x ^= x << 5; return x }
			for range 3000 {
				if len(live) >= 128 || (len(live) > 0 && next()%2 == 0) {
					i := int(next() % uint32(len(live)))
					free := s
					if next()%8 == 0 {
						free = streams[(w+1)%workers]
					}
					if err := r.Deallocate(live[i].p, live[i].n, free); err != nil {
						t.Error(err)
						return
					}
					live[i] = live[len(live)-1]
					live = live[:len(live)-1]
					continue
				}
				n := 1 + int(next()%(256<<10))
				p, err := r.Allocate(n, s)
				if err != nil {
					t.Error(err)
					return
				}
				live = append(live, alloc{p, n})
			}
			kept[w] = live
		}()
	}
	wg.Wait()
	require.NoError(t, r.CheckInvariants())
	require.Greater(t, r.Stats().Superblocks, arenaLiveShards, "the shards' period is passed")
	count, bytes := 0, 0
	for _, live := range kept {
		for _, a := range live {
			n, _ := alignSize(a.n)
			count++
			bytes += n
		}
	}
	st := r.Stats()
	require.Equal(t, count, st.LiveAllocations)
	require.Equal(t, bytes, st.LiveBytes)
	for _, live := range kept {
		for _, a := range live {
			require.NoError(t, r.Deallocate(a.p, a.n, DefaultStream))
		}
	}
	st = r.Stats()
	require.Zero(t, st.LiveAllocations)
	require.Zero(t, st.LiveBytes)
	require.NoError(t, r.CheckInvariants())
}
