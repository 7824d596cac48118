package rmm

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// The records of our Streams are published for the fast paths once a Stream frees into the
// global arena, and withdrawn when it closes. A closed Stream cannot allocate, large blocks
// included, and a free on it synchronises the device, also when a fast path still reads an older
// copy of the published records (which names the Stream's record, marked done).
func TestArenaFastStreamRecords(t *testing.T) {
	const n = 4 << 20
	a, f := arenaSyncSim(t, 8*n)
	sa, sta := arenaSyncStream(t, f, 0xa, "A")
	sb, stb := arenaSyncStream(t, f, 0xb, "B")
	require.Nil(t, a.lazyRec(sa), "no record before a free into the global arena")
	require.Same(t, &a.defRec, a.lazyRec(DefaultStream))
	require.Nil(t, a.lazyRec(arenaSyncForeign(f, 0xf, 7, "F")), "foreign streams are never published")

	for _, s := range []StreamView{sb, sa} {
		p := arenaAlloc(t, a, n, s)
		require.NoError(t, a.Deallocate(p, n, s))
	}
	xa, xb := a.lazyRec(sa), a.lazyRec(sb)
	require.NotNil(t, xa)
	require.NotNil(t, xb)
	require.Equal(t, sa.ID(), xa.stream.ID())
	require.Equal(t, sb.ID(), xb.stream.ID())
	require.Len(t, a.lazyRecs.Load().ids, 2)
	require.Equal(t, []string{"create e1", "record e1 on B, wait A"}, f.take(), "A takes what B freed")

	// The pair on A again, from the fast paths: the superblock still names B, but A already
	// waits for B's event as last recorded: no call.
	p := arenaAlloc(t, a, n, sa)
	require.NoError(t, a.Deallocate(p, n, sa))
	require.Empty(t, f.take())

	old := a.lazyRecs.Load()
	require.NoError(t, sta.Close())
	f.kill(sa.h)
	require.Nil(t, a.lazyRec(sa), "withdrawn at Close")
	require.Same(t, xb, a.lazyRec(sb))
	require.Len(t, a.lazyRecs.Load().ids, 1)
	f.take()

	cur := a.lazyRecs.Load()
	for _, stale := range []bool{false, true} {
		if stale {
			a.lazyRecs.Store(old) // a reader of the copy published before Close
			require.Same(t, xa, a.lazyRec(sa))
		}
		_, err := a.Allocate(n, sa)
		require.ErrorIs(t, err, ErrClosed, "stale %v", stale)
		_, err = a.Allocate(4096, sa)
		require.ErrorIs(t, err, ErrClosed, "stale %v", stale)
		p := arenaAlloc(t, a, n, sb)
		f.take()
		require.NoError(t, a.Deallocate(p, n, sa))
		require.Equal(t, []string{"ctx-sync"}, f.take(), "stale %v: a free on a closed Stream synchronises the device", stale)
		arenaCheck(t, a)
	}
	a.lazyRecs.Store(cur)
	require.NoError(t, stb.Close())
	require.Nil(t, a.lazyRecs.Load(), "no Stream left with a record")
	require.Empty(t, f.errors())
	require.NoError(t, a.Close())
}

// arenaFastSettled locks and unlocks the global arena, which completes a put-off merge.
func arenaFastSettled(a *ArenaMemoryResource) {
	a.lockGlobal()
	a.global.mu.Unlock()
}

// A merge put off by a free is invisible: the next large request of the freed superblock's size
// takes it as it is, and any other use of the global arena merges first, so that addresses are
// those of the merged superblock split again.
func TestArenaFastPutOffMerge(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, f := arenaSyncSim(t, 64*mb)
	base := a.base
	s, _ := arenaSyncStream(t, f, 0xa, "A")

	p := arenaAlloc(t, a, 8*mb, s)
	require.Equal(t, base, p)
	require.NoError(t, a.Deallocate(p, 8*mb, s))
	require.NotNil(t, a.putOff, "the merge with the rest of the arena is put off")
	require.Equal(t, base, a.putOff.addr())
	require.Equal(t, 8*mb, a.putOff.size())

	// The same size takes the superblock as it is.
	p = arenaAlloc(t, a, 8*mb, s)
	require.Equal(t, base, p)
	require.Nil(t, a.putOff)
	require.Equal(t, 2, a.global.tree.count)
	require.NoError(t, a.Deallocate(p, 8*mb, s))

	// Larger and smaller requests, and a small one moving a superblock to a stream arena, are
	// served from the merged superblock.
	for _, n := range []int{16 * mb, 4 * mb, 8*mb - 256, 4096} {
		require.NotNil(t, a.putOff)
		p = arenaAlloc(t, a, n, s)
		require.Equal(t, base, p, "%d bytes", n)
		require.Nil(t, a.putOff, "%d bytes", n)
		st := a.Stats()
		require.Equal(t, 2, st.Superblocks, "%d bytes: the merged superblock, split once", n)
		require.NoError(t, a.Deallocate(p, n, s))
		if n == 4096 {
			break
		}
		arenaCheck(t, a)
		require.Nil(t, a.putOff, "CheckInvariants merges")
		require.Equal(t, 1, a.Stats().Superblocks)
		q := arenaAlloc(t, a, 8*mb, s)
		require.NoError(t, a.Deallocate(q, 8*mb, s))
	}

	// A free that empties a superblock whose previous neighbour is empty merges at once.
	arenaFastSettled(a)
	require.Empty(t, f.take(), "one stream: no CUDA call")
	require.NoError(t, a.Release())
	require.Equal(t, []string{"ctx-sync"}, f.take())
	x := arenaAlloc(t, a, 4*mb, s)
	y := arenaAlloc(t, a, 4*mb, s)
	require.Equal(t, base+DevicePtr(4*mb), y)
	require.NoError(t, a.Deallocate(x, 4*mb, s))
	require.Nil(t, a.putOff, "the next neighbour is in use")
	require.NoError(t, a.Deallocate(y, 4*mb, s))
	require.Nil(t, a.putOff)
	require.Equal(t, 1, a.global.tree.count)
	st := a.Stats()
	require.Equal(t, 1, st.Superblocks)
	require.Equal(t, 64*mb, st.LargestFreeBlock)
	require.Empty(t, f.take(), "one stream: no CUDA call")
	arenaCheck(t, a)
}

// Random work on several streams, run twice: on an arena left alone, and on one whose put-off
// merge is completed after every operation. Both hand out the same addresses, make the same CUDA
// calls and end in the same state.
func TestArenaFastPutOffAgainstMerged(t *testing.T) {
	const mb = arenaMinSuperblockSize
	for seed := range uint64(10) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			ax, fx := arenaSyncSim(t, 128*mb) // merged after every operation
			ay, fy := arenaSyncSim(t, 128*mb)
			r := rand.New(rand.NewPCG(seed, 11))
			type stream struct {
				v  StreamView
				st *Stream
			}
			streams := []*stream{{v: DefaultStream}}
			nextH := uintptr(0x100)
			add := func(foreign bool) {
				nextH++
				name := fmt.Sprintf("S%#x", nextH)
				s := &stream{}
				if foreign {
					s.v = arenaSyncForeign(fx, nextH, uint64(nextH), name)
					fy.name(nextH, name)
				} else {
					st, err := NewStream(CurrentDevice(), nil)
					require.NoError(t, err)
					t.Cleanup(func() { st.Close() })
					s.st, s.v = st, st.View()
					if s.v.h == 0 {
						s.v.h = nextH
					}
					fx.name(s.v.h, name)
					fy.name(s.v.h, name)
				}
				streams = append(streams, s)
			}
			for range 3 {
				add(false)
			}
			add(true)
			sizes := []int{4096, 1 << 20, 2 * mb, 8 * mb, 8 * mb, 8*mb + 256, 24 * mb}
			type block struct {
				p DevicePtr
				n int
				s *stream
			}
			var blocks []block
			putOff := 0
			for op := 0; op < 3000; op++ {
				v := r.IntN(100)
				switch {
				case len(blocks) == 0 || (len(blocks) < 12 && v < 50):
					s := streams[r.IntN(len(streams))]
					n := sizes[r.IntN(len(sizes))]
					if r.IntN(4) == 0 {
						n = mb + 256*(1+r.IntN(12*4096))
					}
					px, errx := ax.Allocate(n, s.v)
					py, erry := ay.Allocate(n, s.v)
					require.Equal(t, px, py, "op %d: Allocate(%d)", op, n)
					require.Equal(t, errx == nil, erry == nil, "op %d: %v, %v", op, errx, erry)
					if errx == nil {
						blocks = append(blocks, block{px, n, s})
					}
				case v < 90:
					k := r.IntN(len(blocks))
					b := blocks[k]
					blocks = slices.Delete(blocks, k, k+1)
					s := b.s
					if r.IntN(5) == 0 {
						s = streams[r.IntN(len(streams))]
					}
					require.NoError(t, ax.Deallocate(b.p, b.n, s.v))
					require.NoError(t, ay.Deallocate(b.p, b.n, s.v))
					if ay.putOff != nil {
						putOff++
					}
				case v < 95:
					// A Stream closes and another comes; a foreign stream is replaced.
					for i, s := range streams[1:] {
						if s.st != nil {
							require.NoError(t, s.st.Close())
							streams = slices.Delete(streams, i+1, i+2)
							for k := range blocks {
								if blocks[k].s == s {
									blocks[k].s = streams[0]
								}
							}
							break
						}
					}
					add(r.IntN(3) == 0)
				default:
					require.NoError(t, ax.Release())
					require.NoError(t, ay.Release())
				}
				arenaFastSettled(ax)
				lx, ly := fx.take(), fy.take()
				if slices.Contains(lx, "ctx-sync") {
					// A defragmentation (Release, or a failed request) drops the records of
					// foreign streams in map order.
					slices.Sort(lx)
					slices.Sort(ly)
				}
				require.Equal(t, lx, ly, "op %d", op)
				if op%97 == 0 {
					arenaCheck(t, ax)
					arenaCheck(t, ay)
				}
			}
			for _, b := range blocks {
				require.NoError(t, ax.Deallocate(b.p, b.n, b.s.v))
				require.NoError(t, ay.Deallocate(b.p, b.n, b.s.v))
			}
			require.Equal(t, fx.take(), fy.take())
			require.Equal(t, ax.Stats(), ay.Stats())
			arenaCheck(t, ay)
			require.Empty(t, fx.errors())
			require.Empty(t, fy.errors())
			require.Positive(t, putOff, "some merges were put off")
			t.Logf("%d frees left a merge put off; %d driver calls", putOff, fy.calls)
		})
	}
}

// Blocks above 1 MiB are kept in their own live table, under the global arena's lock, wherever
// their superblock goes: frees find them in a stream's arena too, a free with the size of the
// other table names the size allocated, and Stats counts both tables.
func TestArenaFastLargeTable(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, f := arenaSyncSim(t, 2*mb+mb/2)
	sa, _ := arenaSyncStream(t, f, 0xa, "A")
	sb, _ := arenaSyncStream(t, f, 0xb, "B")

	big := arenaAlloc(t, a, 2*mb, sa) // the superblock is not split: 512 KiB stay free in it
	require.Equal(t, 1, a.large.count)
	small := arenaAlloc(t, a, 4096, sa) // the superblock moves to A's arena
	require.Equal(t, big+DevicePtr(2*mb), small)
	st := a.Stats()
	require.Equal(t, 2, st.LiveAllocations)
	require.Equal(t, 2*mb+4096, st.LiveBytes)
	require.Zero(t, st.GlobalSuperblocks)
	arenaCheck(t, a)

	// Sizes of the other table.
	err := a.Deallocate(big, 4096, sa)
	require.ErrorIs(t, err, ErrInvalidFree)
	require.Contains(t, err.Error(), fmt.Sprintf("allocated with %d bytes", 2*mb))
	err = a.Deallocate(small, 2*mb, sa)
	require.ErrorIs(t, err, ErrInvalidFree)
	require.Contains(t, err.Error(), "allocated with 4096 bytes")
	err = a.Deallocate(big+DevicePtr(mb), 2*mb, sa)
	require.ErrorIs(t, err, ErrInvalidFree)
	require.Contains(t, err.Error(), "not allocated")
	require.Equal(t, 2, a.Stats().LiveAllocations)
	require.Empty(t, f.take())

	// Freed on A, into A's arena, whose lock may still be held when the free tries it.
	arena, ok := a.streams.Load(sa.ID())
	require.True(t, ok)
	arena.(*arenaSet).mu.Lock()
	done := make(chan error)
	go func() { done <- a.Deallocate(big, 2*mb, sa) }()
	arena.(*arenaSet).mu.Unlock()
	require.NoError(t, <-done)
	require.Zero(t, a.large.count)
	require.Empty(t, f.take(), "A's own arena: no CUDA call")
	arenaCheck(t, a)

	// Again, freed on B: B is synchronised first. (Large requests come from the global arena:
	// the superblock, in A's arena, returns there when the arena defragments.)
	big2 := arenaAlloc(t, a, 2*mb, sa)
	require.Equal(t, big, big2)
	require.Equal(t, []string{"ctx-sync"}, f.take())
	small2 := arenaAlloc(t, a, 4096, sa)
	require.Equal(t, 1, a.Stats().StreamArenas)
	require.Zero(t, a.Stats().GlobalSuperblocks)
	require.NoError(t, a.Deallocate(big, 2*mb, sb))
	require.Equal(t, []string{"query B", "sync B"}, f.take())
	require.NoError(t, a.Deallocate(small, 4096, sa))
	require.NoError(t, a.Deallocate(small2, 4096, sa))
	require.Empty(t, f.take())
	require.Equal(t, 0, a.Stats().LiveAllocations)
	arenaCheck(t, a)
}

// The published sets keyed by stream id: changes make copies and leave the old set as it was;
// past streamSetMax entries nothing more is added.
func TestArenaFastByStream(t *testing.T) {
	var p *streamSet[int]
	_, ok := p.find(1)
	require.False(t, ok)
	require.Nil(t, p.without(1))
	for _, id := range []uint64{5, 1, 9, 3} {
		p = p.with(id, int(id)*10)
	}
	require.Equal(t, []uint64{1, 3, 5, 9}, p.ids)
	require.Equal(t, []int{10, 30, 50, 90}, p.vals)
	for _, id := range []uint64{0, 2, 4, 10} {
		_, ok := p.find(id)
		require.False(t, ok, "%d", id)
	}
	v, ok := p.find(9)
	require.True(t, ok)
	require.Equal(t, 90, v)
	q := p.without(3)
	require.Equal(t, []uint64{1, 5, 9}, q.ids)
	require.Equal(t, []int{10, 50, 90}, q.vals)
	require.Equal(t, []uint64{1, 3, 5, 9}, p.ids, "the published set is unchanged")
	require.Same(t, q, q.without(3), "not there")
	require.Nil(t, q.without(1).without(5).without(9))

	var full *streamSet[int]
	for id := range uint64(streamSetMax) {
		full = full.with(2*id+1, 1)
	}
	require.Same(t, full, full.with(2, 2), "full")
	_, ok = full.find(2)
	require.False(t, ok)
	for id := range uint64(streamSetMax) {
		_, ok := full.find(2*id + 1)
		require.True(t, ok)
	}
}

// A set past streamSetScan ids finds them through its hash index: against a map, through sets
// growing and shrinking between none and 200 ids, every id present is found with its value and
// every other id (0 to 199) is not, and a set left behind by a change still answers as it did.
func TestStreamSetIndexed(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	var p *streamSet[int]
	model := map[uint64]int{}
	check := func(p *streamSet[int], model map[uint64]int) {
		t.Helper()
		for id := range uint64(200) {
			v, ok := p.find(id)
			want, in := model[id]
			require.Equal(t, in, ok, "id %d among %d", id, len(model))
			require.Equal(t, want, v, "id %d", id)
		}
	}
	for step := range 2000 {
		id := uint64(rng.IntN(200))
		old, oldModel := p, maps.Clone(model)
		if step%400 < 250 {
			p = p.with(id, step)
			model[id] = step
		} else {
			p = p.without(id)
			delete(model, id)
		}
		require.Len(t, p.all(), len(model))
		if step%50 == 0 {
			check(p, model)
			check(old, oldModel)
		}
	}
	require.Greater(t, len(model), 0)
}
