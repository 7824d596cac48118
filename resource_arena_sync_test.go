package rmm

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// Attacks on the arena's stream-ordered frees into the global arena (resource_arena_pending.go),
// through the fake device of resource_arena_pending_test.go and its model of stream order.

// brkArenaModelStream is a stream of the random walks: one of our Streams, a foreign stream, or
// a foreign view of one of our Streams (same handle, another identity).
type brkArenaModelStream struct {
	v    StreamView
	st   *Stream              // our Stream (nil for foreign streams and views)
	of   *brkArenaModelStream // a view's Stream
	i    int                  // in the model
	gone bool
}

// Bad sizes, double frees and frees of unknown pointers on every kind of stream make no driver
// call and change nothing.
func TestArenaSyncBadFreesMakeNoCalls(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, f := arenaSyncSim(t, 32*mb)
	sa, _ := arenaSyncStream(t, f, 0xa, "A")
	fs := arenaSyncForeign(f, 0xf, 7, "F")
	streams := []StreamView{DefaultStream, sa, fs}
	var ptrs []DevicePtr
	var sizes []int
	for i, n := range []int{4096, 2 * mb, 1 << 20, 3*mb + 256} {
		s := streams[i%len(streams)]
		ptrs = append(ptrs, arenaAlloc(t, a, n, s))
		sizes = append(sizes, n)
	}
	// Free the second: it goes to the global arena on A.
	require.NoError(t, a.Deallocate(ptrs[1], sizes[1], sa))
	f.take()
	before := a.Stats()
	for _, s := range streams {
		for k, p := range ptrs {
			n := sizes[k]
			require.ErrorIs(t, a.Deallocate(p, n+256, s), ErrInvalidFree)
			require.ErrorIs(t, a.Deallocate(p, n-1, s), ErrInvalidFree)
			require.ErrorIs(t, a.Deallocate(p, 0, s), ErrInvalidFree)
			require.ErrorIs(t, a.Deallocate(p, -n, s), ErrInvalidFree)
			require.ErrorIs(t, a.Deallocate(p+256, n, s), ErrInvalidFree)
		}
		require.ErrorIs(t, a.Deallocate(ptrs[1], sizes[1], s), ErrInvalidFree, "double free")
		require.ErrorIs(t, a.Deallocate(a.base+DevicePtr(a.size), 256, s), ErrInvalidFree)
	}
	require.Empty(t, f.take(), "a rejected free makes no driver call")
	require.Equal(t, before, a.Stats())
	arenaCheck(t, a)
	for _, n := range []int{-1, math.MinInt} {
		_, err := a.Allocate(n, sa)
		require.ErrorIs(t, err, ErrInvalidArgument)
	}
	for _, n := range []int{math.MaxInt, math.MaxInt - 255, 32*mb + 1} {
		_, err := a.Allocate(n, sa)
		var oom *OutOfMemoryError
		require.ErrorAs(t, err, &oom, "%d", n)
		require.Equal(t, n, oom.Requested)
	}
	require.Empty(t, f.take(), "a request larger than the arena fails at once")
	require.Equal(t, before, a.Stats())
}

// Six streams free large blocks of one superblock (more than arenaPendingMax); whatever the
// order of frees and merges, a seventh stream (and each of the first six) that takes the whole
// superblock is ordered after every one of them, in the model of stream order.
func TestArenaSyncManyPendingStreams(t *testing.T) {
	const mb = arenaMinSuperblockSize
	for seed := range uint64(12) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			a, f := arenaSyncSim(t, 16*mb)
			m := newArenaSyncModel()
			f.model = m
			r := rand.New(rand.NewPCG(seed, 1))
			var ss []StreamView
			var idx []int
			for i := range 7 {
				s, _ := arenaSyncStream(t, f, uintptr(0xa0+i), fmt.Sprintf("S%d", i))
				ss = append(ss, s)
				f.mu.Lock()
				idx = append(idx, m.stream(s.h))
				f.mu.Unlock()
			}
			ss = append(ss, DefaultStream)
			f.mu.Lock()
			idx = append(idx, m.stream(cuStreamLegacy))
			f.mu.Unlock()
			for round := range 4 {
				// eight 2 MiB blocks, allocated on random streams, freed on random streams in a
				// random order
				var ps []DevicePtr
				for range 8 {
					k := r.IntN(len(ss))
					p := arenaAlloc(t, a, 2*mb, ss[k])
					f.mu.Lock()
					err := m.allocated(idx[k], p, 2*mb)
					f.mu.Unlock()
					require.NoError(t, err, "round %d", round)
					ps = append(ps, p)
				}
				for _, j := range r.Perm(len(ps)) {
					k := r.IntN(len(ss))
					f.mu.Lock()
					m.free(idx[k], ps[j], 2*mb)
					f.mu.Unlock()
					require.NoError(t, a.Deallocate(ps[j], 2*mb, ss[k]))
					arenaCheck(t, a)
				}
				k := r.IntN(len(ss))
				p := arenaAlloc(t, a, 16*mb, ss[k])
				f.mu.Lock()
				err := m.allocated(idx[k], p, 16*mb)
				f.mu.Unlock()
				require.NoError(t, err, "round %d", round)
				f.mu.Lock()
				m.free(idx[k], p, 16*mb)
				f.mu.Unlock()
				require.NoError(t, a.Deallocate(p, 16*mb, ss[k]))
			}
			require.Empty(t, f.errors())
		})
	}
}

// A foreign view of one of our Streams (the same handle under another identity): frees on both
// are waited for by a third stream, and the view outliving its Stream's Close names no
// destroyed stream.
func TestArenaSyncForeignViewOfOwnStream(t *testing.T) {
	const n = 4 << 20
	a, f := arenaSyncSim(t, 4*n)
	m := newArenaSyncModel()
	f.model = m
	sa, sta := arenaSyncStream(t, f, 0xa, "A")
	va := arenaSyncForeign(f, sa.h, 42, "A")
	sb, _ := arenaSyncStream(t, f, 0xb, "B")
	f.mu.Lock()
	ia, ib := m.stream(sa.h), m.stream(sb.h)
	m.stream(cuStreamLegacy)
	f.mu.Unlock()
	x := arenaAlloc(t, a, n, sa)
	y := arenaAlloc(t, a, n, va)
	f.mu.Lock()
	m.free(ia, x, n)
	f.mu.Unlock()
	require.NoError(t, a.Deallocate(x, n, va)) // allocated on A, freed through the view
	f.mu.Lock()
	m.free(ia, y, n)
	f.mu.Unlock()
	require.NoError(t, a.Deallocate(y, n, sa)) // allocated through the view, freed on A
	z := arenaAlloc(t, a, 2*n, sb)
	f.mu.Lock()
	err := m.allocated(ib, z, 2*n)
	f.mu.Unlock()
	require.NoError(t, err)
	// small blocks through the view, then A closes; the view's arena still holds them
	q := arenaAlloc(t, a, 4096, va)
	brkCloseInModel(t, f, sta, ia)
	f.kill(sa.h)
	f.take()
	f.mu.Lock()
	m.free(ib, q, 4096)
	m.free(ib, z, 2*n)
	f.mu.Unlock()
	require.NoError(t, a.Deallocate(q, 4096, sb))
	require.NoError(t, a.Deallocate(z, 2*n, sb))
	w := arenaAlloc(t, a, 4*n, DefaultStream)
	require.NoError(t, a.Deallocate(w, 4*n, DefaultStream))
	require.NoError(t, a.Release())
	w = arenaAlloc(t, a, 4*n, DefaultStream)
	require.NoError(t, a.Deallocate(w, 4*n, DefaultStream))
	require.Empty(t, f.errors())
	arenaCheck(t, a)
}

// A random walk against the model with more streams than a superblock remembers, foreign
// streams, foreign views of our Streams, frees on closed Streams, double frees and wrong sizes
// (rejected without a call), Release, Streams closing: every block handed out is ordered after
// the work behind every earlier free of its bytes, and no call names a destroyed stream.
func TestArenaSyncRandomWalk(t *testing.T) {
	for seed := range uint64(6) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { brkArenaWalk(t, seed, 1500) })
	}
}

func brkArenaWalk(t *testing.T, seed uint64, ops int) {
	const mb = arenaMinSuperblockSize
	a, f := arenaSyncSim(t, 48*mb)
	m := newArenaSyncModel()
	f.model = m
	r := rand.New(rand.NewPCG(seed, 77))
	var streams []*brkArenaModelStream
	nextH := uintptr(0x100)
	nextID := uint64(100)
	addOwn := func() *brkArenaModelStream {
		nextH++
		s := &brkArenaModelStream{}
		s.v, s.st = arenaSyncStream(t, f, nextH, fmt.Sprintf("S%#x", nextH))
		f.mu.Lock()
		s.i = m.stream(s.v.h)
		f.mu.Unlock()
		streams = append(streams, s)
		return s
	}
	addForeign := func() {
		nextH++
		nextID++
		s := &brkArenaModelStream{v: arenaSyncForeign(f, nextH, nextID, fmt.Sprintf("F%d", nextID))}
		f.mu.Lock()
		s.i = m.stream(s.v.h)
		f.mu.Unlock()
		streams = append(streams, s)
	}
	addView := func(of *brkArenaModelStream) {
		nextID++
		s := &brkArenaModelStream{v: arenaSyncForeign(f, of.v.h, nextID, f.nameOf(of.v.h)), of: of, i: of.i}
		streams = append(streams, s)
	}
	f.mu.Lock()
	streams = append(streams, &brkArenaModelStream{v: DefaultStream, i: m.stream(cuStreamLegacy)})
	f.mu.Unlock()
	for range 7 {
		addOwn()
	}
	addForeign()
	addForeign()
	addView(streams[1])
	live := func() []*brkArenaModelStream {
		var out []*brkArenaModelStream
		for _, s := range streams {
			if !s.gone {
				out = append(out, s)
			}
		}
		return out
	}
	type block struct {
		p DevicePtr
		n int
		s *brkArenaModelStream
	}
	var blocks []block
	var freed []block
	free := func(k int) {
		b := blocks[k]
		blocks = slices.Delete(blocks, k, k+1)
		s := b.s
		switch v := r.IntN(10); {
		case v < 3 || s.gone:
			ls := live()
			s = ls[r.IntN(len(ls))]
		case v == 3:
			for _, x := range streams {
				if x.gone && x.st != nil {
					s = x // a closed Stream: the device is synchronised
					break
				}
			}
		}
		f.mu.Lock()
		m.free(s.i, b.p, b.n)
		f.mu.Unlock()
		require.NoError(t, a.Deallocate(b.p, b.n, s.v))
		freed = append(freed, b)
		if len(freed) > 8 {
			freed = freed[1:]
		}
	}
	for op := 0; op < ops; op++ {
		switch v := r.IntN(100); {
		case len(blocks) == 0 || (len(blocks) < 20 && v < 48):
			ls := live()
			s := ls[r.IntN(len(ls))]
			var n int
			switch w := r.IntN(10); {
			case w < 4:
				n = 256 * (1 + r.IntN(64))
			case w < 6:
				n = 256*(1+r.IntN(4096)) - r.IntN(256)
			default:
				n = mb + 256*(1+r.IntN(5*4096))
			}
			p, err := a.Allocate(n, s.v)
			if errors.Is(err, ErrOutOfMemory) {
				continue
			}
			require.NoError(t, err, "op %d: Allocate(%d, %v)", op, n, s.v)
			f.mu.Lock()
			err = m.allocated(s.i, p, roundUp(n))
			f.mu.Unlock()
			require.NoError(t, err, "op %d", op)
			blocks = append(blocks, block{p, n, s})
		case v < 88:
			free(r.IntN(len(blocks)))
		case v < 92 && len(freed) > 0:
			// a double free or a wrong size: rejected, no driver call
			b := freed[r.IntN(len(freed))]
			if slices.ContainsFunc(blocks, func(x block) bool { return x.p == b.p }) {
				continue
			}
			ls := live()
			s := ls[r.IntN(len(ls))]
			calls := brkArenaCalls(f)
			require.ErrorIs(t, a.Deallocate(b.p, b.n, s.v), ErrInvalidFree, "op %d", op)
			if len(blocks) > 0 {
				x := blocks[r.IntN(len(blocks))]
				require.ErrorIs(t, a.Deallocate(x.p, x.n+256, s.v), ErrInvalidFree, "op %d", op)
			}
			require.Equal(t, calls, brkArenaCalls(f), "op %d: a rejected free makes no call", op)
		case v < 95:
			// one of our Streams closes (with its views) and another comes
			for _, s := range streams[1:] {
				if !s.gone && s.st != nil {
					brkCloseInModel(t, f, s.st, s.i)
					f.kill(s.v.h)
					s.gone = true
					for _, x := range streams {
						if x.of == s {
							x.gone = true
						}
					}
					break
				}
			}
			n := addOwn()
			if r.IntN(2) == 0 {
				addView(n)
			}
		case v < 98:
			for _, s := range streams {
				if !s.gone && s.st == nil && s.of == nil && s.v.id != 0 {
					f.kill(s.v.h)
					s.gone = true
					break
				}
			}
			addForeign()
		default:
			require.NoError(t, a.Release())
		}
		require.Empty(t, f.errors(), "op %d", op)
		if op%50 == 0 {
			arenaCheck(t, a)
		}
	}
	// Close with half the blocks live; they are freed afterwards, on any stream.
	for k := len(blocks) / 2; k > 0; k-- {
		free(len(blocks) - 1)
	}
	arenaCheck(t, a)
	t.Logf("closing with %d blocks live", len(blocks))
	require.NoError(t, a.Close())
	_, err := a.Allocate(4096, DefaultStream)
	require.ErrorIs(t, err, ErrClosed)
	for len(blocks) > 0 {
		free(len(blocks) - 1)
	}
	require.Empty(t, f.errors())
	arenaCheck(t, a)
	st := a.Stats()
	require.Zero(t, st.LiveAllocations)
	require.Equal(t, a.size, st.FreeBytes)
	require.False(t, a.held, "the last free gave the arena back")
	kinds := map[string]int{}
	for _, c := range f.take() {
		kinds[strings.Fields(c)[0]]++
	}
	require.NotZero(t, kinds["record"], "streams took memory other streams freed")
	require.NotZero(t, kinds["sync"], "frees synchronised their streams")
	require.Equal(t, kinds["create"], kinds["destroy"], "every event made is destroyed")
	t.Logf("calls: %v", kinds)
}

// Goroutines sharing streams (the default one among them) allocate and free large and small
// blocks on any stream while another goroutine calls Release, Stats and CheckInvariants; every
// allocation is checked against the model of stream order.
func TestArenaSyncConcurrentAgainstModel(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, f := arenaSyncSim(t, 64*mb)
	f.quiet = true
	m := newArenaSyncModel()
	f.model = m
	type strm struct {
		v StreamView
		i int
	}
	var streams []strm
	f.mu.Lock()
	streams = append(streams, strm{DefaultStream, m.stream(cuStreamLegacy)})
	f.mu.Unlock()
	for i := range 6 {
		v, _ := arenaSyncStream(t, f, uintptr(0x200+i), fmt.Sprintf("S%d", i))
		f.mu.Lock()
		streams = append(streams, strm{v, m.stream(v.h)})
		f.mu.Unlock()
	}
	for i := range 2 {
		v := arenaSyncForeign(f, uintptr(0x300+i), uint64(500+i), fmt.Sprintf("F%d", i))
		f.mu.Lock()
		streams = append(streams, strm{v, m.stream(v.h)})
		f.mu.Unlock()
	}
	var stop atomic.Bool
	var wg, side sync.WaitGroup
	errc := make(chan error, 16)
	report := func(err error) {
		select {
		case errc <- err:
		default:
		}
	}
	side.Add(1)
	go func() {
		defer side.Done()
		for i := 0; !stop.Load(); i++ {
			switch i % 3 {
			case 0:
				if err := a.Release(); err != nil {
					report(err)
				}
			case 1:
				if st := a.Stats(); st.FreeBytes+st.LiveBytes != st.ArenaSize {
					report(fmt.Errorf("Stats: free %d + live %d != %d", st.FreeBytes, st.LiveBytes, st.ArenaSize))
				}
			default:
				if err := a.CheckInvariants(); err != nil {
					report(err)
				}
			}
		}
	}()
	for g := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 5))
			type blk struct {
				p DevicePtr
				n int
			}
			var mine []blk
			for k := 0; k < 600; k++ {
				s := streams[r.IntN(len(streams))]
				if len(mine) == 0 || (len(mine) < 8 && r.IntN(2) == 0) {
					n := 256 * (1 + r.IntN(64))
					if r.IntN(2) == 0 {
						n = mb + 256*(1+r.IntN(4*4096))
					}
					p, err := a.Allocate(n, s.v)
					if errors.Is(err, ErrOutOfMemory) {
						continue
					}
					if err != nil {
						report(err)
						return
					}
					f.mu.Lock()
					err = m.allocated(s.i, p, roundUp(n))
					f.mu.Unlock()
					if err != nil {
						report(fmt.Errorf("goroutine %d op %d: %w", g, k, err))
						return
					}
					mine = append(mine, blk{p, n})
					continue
				}
				j := r.IntN(len(mine))
				b := mine[j]
				mine = slices.Delete(mine, j, j+1)
				f.mu.Lock()
				m.free(s.i, b.p, b.n)
				f.mu.Unlock()
				if err := a.Deallocate(b.p, b.n, s.v); err != nil {
					report(err)
					return
				}
			}
			for _, b := range mine {
				s := streams[r.IntN(len(streams))]
				f.mu.Lock()
				m.free(s.i, b.p, b.n)
				f.mu.Unlock()
				if err := a.Deallocate(b.p, b.n, s.v); err != nil {
					report(err)
				}
			}
		}()
	}
	wg.Wait()
	stop.Store(true)
	side.Wait()
	close(errc)
	for err := range errc {
		t.Error(err)
	}
	require.Empty(t, f.errors())
	arenaCheck(t, a)
	require.Zero(t, a.Stats().LiveAllocations)
}

// Streams close while other goroutines free blocks of theirs into the global arena and others
// take that memory; afterwards no call names a destroyed stream and the arena is consistent.
func TestArenaSyncStreamCloseRacesFrees(t *testing.T) {
	const mb = arenaMinSuperblockSize
	for round := range 4 {
		a, f := arenaSyncSim(t, 64*mb)
		f.quiet = true
		var own []*Stream
		var views []StreamView
		for i := range 4 {
			v, st := arenaSyncStream(t, f, uintptr(0x400+16*round+i), fmt.Sprintf("C%d", i))
			own = append(own, st)
			views = append(views, v)
		}
		// Blocks allocated on the doomed streams.
		type blk struct {
			p DevicePtr
			n int
			s StreamView
		}
		var blocks []blk
		for i, v := range views {
			for k := range 6 {
				n := 2*mb + 256*k
				if k%2 == 1 {
					n = 4096 * (k + i)
				}
				blocks = append(blocks, blk{arenaAlloc(t, a, n, v), n, v})
			}
		}
		var wg sync.WaitGroup
		errc := make(chan error, len(blocks)+8)
		for g := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for k, b := range blocks {
					if k%4 != g {
						continue
					}
					if err := a.Deallocate(b.p, b.n, b.s); err != nil {
						errc <- err
					}
					if p, err := a.Allocate(3*mb, DefaultStream); err == nil {
						if err := a.Deallocate(p, 3*mb, DefaultStream); err != nil {
							errc <- err
						}
					} else if !errors.Is(err, ErrOutOfMemory) {
						errc <- err
					}
				}
			}()
		}
		for i, st := range own {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := st.Close(); err != nil {
					errc <- err
				}
				f.kill(views[i].h)
			}()
		}
		wg.Wait()
		close(errc)
		for err := range errc {
			t.Error(err)
		}
		arenaCheck(t, a)
		require.Zero(t, a.Stats().LiveAllocations)
		p := arenaAlloc(t, a, 64*mb, DefaultStream)
		require.NoError(t, a.Deallocate(p, 64*mb, DefaultStream))
		// Calls naming a closed stream are possible only for a free racing with its Stream's
		// Close (the caller's race); report them for the record.
		if errs := f.errors(); len(errs) > 0 {
			t.Logf("round %d: %d calls named a closed stream: %v", round, len(errs), errs[0])
		}
		require.NoError(t, a.Close())
	}
}

func brkArenaCalls(f *arenaSyncFake) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// brkCloseInModel closes st, model stream i. Without CUDA the Stream's own view, which Close
// names to the arena, has handle 0 (the legacy stream's): while it closes, that handle stands
// for st in the model, and every other handle for its own stream (the model's closing field
// would credit every call made during the Close, such as the host wait for another stream
// that a merge of pending sets makes, to the closing stream).
func brkCloseInModel(t *testing.T, f *arenaSyncFake, st *Stream, i int) {
	t.Helper()
	m := f.model
	f.mu.Lock()
	def, ok := m.streams[cuStreamLegacy]
	if st.View().h == 0 {
		m.streams[cuStreamLegacy] = i
	}
	f.mu.Unlock()
	require.NoError(t, st.Close())
	f.mu.Lock()
	if ok {
		m.streams[cuStreamLegacy] = def
	} else {
		delete(m.streams, cuStreamLegacy)
	}
	f.mu.Unlock()
}
