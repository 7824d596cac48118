package rmm

import (
	"fmt"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// keptAtEnd lending a kept alias whose chunks lie in several streams' lists, on a stream whose
// own list is empty (the request taken, in findBlock, from another stream's list).

// keptLists is a stitching pool (2 MiB pieces, over the fake device and its model of stream
// order) holding a kept alias of n bytes over eight 2 MiB chunks, every other one of sixteen,
// whose chunks are live again as 2 MiB blocks of the default stream, and a 40 MiB block at the
// end of the chain (y), live too.
type keptLists struct {
	e      *poolSyncEnv
	p      *PoolMemoryResource
	vm     *gatedVMM
	cv     *countingVMM
	n      int
	va     DevicePtr   // the alias
	chunks []DevicePtr // the 2 MiB blocks over its chunks, live on the default stream
	y      DevicePtr   // 40 MiB at the end, live on the default stream
	end    DevicePtr
	blocks []DevicePtr
	x      DevicePtr
}

func newKeptLists(t *testing.T, n int) *keptLists {
	vm := newGatedVMM(0)
	cv := newCountingVMM(vm.vmm)
	vm.vmm = cv
	p := newTunedTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30}, poolTuning{stitchPiece: 2 * mib})
	e := newPoolSyncEnv(t, p)
	vm.check = e.checkReturned
	a := &keptLists{e: e, p: p, vm: vm, cv: cv, n: n}
	for range 16 {
		a.blocks = append(a.blocks, e.mustAlloc(2*mib, DefaultStream, e.def))
	}
	require.Equal(t, 32*mib, p.PoolSize())
	for i := 1; i < 16; i++ {
		require.Equal(t, a.blocks[0]+DevicePtr(2*mib*i), a.blocks[i])
	}
	a.x = e.mustAlloc(2*mib, DefaultStream, e.def)
	require.Equal(t, a.blocks[15]+2*mib, a.x)
	require.Equal(t, 48*mib, p.PoolSize())
	a.end = a.x + 2*mib
	var even []DevicePtr
	for i := 0; i < 16; i += 2 {
		e.mustFree(a.blocks[i], 2*mib, DefaultStream, e.def)
		even = append(even, a.blocks[i])
	}
	s := e.mustAlloc(n, DefaultStream, e.def)
	require.Equal(t, 1, p.stitching().stitches)
	require.Equal(t, 48*mib, p.PoolSize(), "stitched, not grown")
	al := p.stitching().aliases[s]
	require.NotNil(t, al)
	var cs []DevicePtr
	for _, c := range al.chunks {
		cs = append(cs, c.addr)
	}
	slices.Sort(cs)
	require.Equal(t, even, cs, "the alias maps the eight free chunks")
	require.Len(t, al.runs, 8)
	a.va = s
	a.y = e.mustAlloc(40*mib, DefaultStream, e.def)
	require.Equal(t, a.end, a.y)
	require.Equal(t, 1, p.stitching().stitches)
	e.mustFree(s, n, DefaultStream, e.def)
	for range 8 {
		a.chunks = append(a.chunks, e.mustAlloc(2*mib, DefaultStream, e.def))
	}
	got := slices.Clone(a.chunks)
	slices.Sort(got)
	require.Equal(t, even, got, "the 2 MiB requests took the alias's chunks")
	require.NoError(t, p.CheckInvariants())
	return a
}

// spread frees the end (y) into list of tail, and the alias's chunks: three on the default
// stream, three on sa, two on sb.
func (a *keptLists) spread(t *testing.T, tail StreamView, ti int, sa StreamView, ia int, sb StreamView, ib int) {
	e := a.e
	e.mustFree(a.y, 40*mib, tail, ti)
	for i, c := range a.chunks {
		switch {
		case i < 3:
			e.mustFree(c, 2*mib, DefaultStream, e.def)
		case i < 6:
			e.mustFree(c, 2*mib, sa, ia)
		default:
			e.mustFree(c, 2*mib, sb, ib)
		}
	}
	require.NoError(t, a.p.CheckInvariants())
}

// drain allocates 2 MiB blocks on s until the pool would grow, checks each in the model, and
// frees them again on s.
func (a *keptLists) drain(t *testing.T, s StreamView, i int) {
	e := a.e
	size := a.p.PoolSize()
	var got []DevicePtr
	for {
		free, _ := a.p.freeFigures()
		if free < 2*mib {
			break
		}
		q, err := e.alloc(2*mib, s, i)
		require.NoError(t, err)
		if a.p.PoolSize() != size {
			e.mustFree(q, 2*mib, s, i)
			break
		}
		got = append(got, q)
		if len(got) > 64 {
			break
		}
	}
	require.NotEmpty(t, got)
	for _, q := range got {
		e.mustFree(q, 2*mib, s, i)
	}
}

// The alias's chunks lie in three lists (default, A, B), the end of the chain in B's list; a
// request for n on a fourth stream C (empty list) finds its best fit, the end, in B's list:
// keptAtEnd lends the alias out of all three lists, and C must be ordered after every free.
func TestStitchKeptAtEndThreeLists(t *testing.T) {
	for _, n := range []int{16 * mib, 15*mib + 512*kiB} {
		for _, freeOn := range []string{"C", "D", "default"} {
			t.Run(fmt.Sprintf("%d-%s", n, freeOn), func(t *testing.T) {
				a := newKeptLists(t, n)
				e, p := a.e, a.p
				sa, _, ia := e.stream(0xa, "A")
				sb, _, ib := e.stream(0xb, "B")
				sc, _, ic := e.stream(0xc, "C")
				sd, _, id := e.stream(0xd, "D")
				a.spread(t, sb, ib, sa, ia, sb, ib)
				maps, deps := a.cv.counts().maps, p.stitching().stitchedDeps
				q, err := e.alloc(n, sc, ic)
				require.NoError(t, err)
				require.Equal(t, a.va, q, "the kept alias")
				require.Equal(t, maps, a.cv.counts().maps)
				require.Greater(t, p.stitching().stitchedDeps, deps)
				require.Empty(t, e.f.errors())
				require.NoError(t, p.CheckInvariants())
				fs, fi := sc, ic
				switch freeOn {
				case "D":
					fs, fi = sd, id
				case "default":
					fs, fi = DefaultStream, e.def
				}
				e.mustFree(q, n, fs, fi)
				require.NoError(t, p.CheckInvariants())
				require.NoError(t, depCheckDepRefs(p))
				// Every stream now takes what it can: each take checked in the model.
				a.drain(t, sa, ia)
				a.drain(t, DefaultStream, e.def)
				a.drain(t, sd, id)
				a.drain(t, sb, ib)
				for i, b := range a.blocks {
					if i%2 == 1 {
						e.mustFree(b, 2*mib, DefaultStream, e.def)
					}
				}
				e.mustFree(a.x, 2*mib, sa, ia)
				a.drain(t, sc, ic)
				e.done()
				require.NoError(t, depCheckDepRefs(p))
				require.NoError(t, p.Release())
				require.Empty(t, a.vm.errs)
				require.NoError(t, p.Close())
				require.Empty(t, a.vm.errs)
			})
		}
	}
}

// As above, with the dep waits of the lend failing: the allocation fails, the chunks go back
// (to C's list) naming the lists they came from; the next takes on C must still be ordered.
func TestStitchKeptAtEndFailedWait(t *testing.T) {
	for seed := uint64(0); seed < 24; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			a := newKeptLists(t, 16*mib)
			e, p := a.e, a.p
			sa, _, ia := e.stream(0xa, "A")
			sb, _, ib := e.stream(0xb, "B")
			sc, _, ic := e.stream(0xc, "C")
			a.spread(t, sb, ib, sa, ia, sb, ib)
			var on atomic.Bool
			every := 1 + int(seed%3)
			p.drv = faultyDriver(p.drv, &on, []string{"record-and-wait", "wait", "record"}, every, seed)
			on.Store(true)
			q, err := e.alloc(16*mib, sc, ic)
			on.Store(false)
			if err == nil {
				require.Equal(t, a.va, q)
				e.mustFree(q, 16*mib, sc, ic)
			} else {
				t.Log("failed:", err)
				require.NotContains(t, err.Error(), "got [")
				require.Zero(t, q)
			}
			require.Empty(t, e.f.errors())
			require.NoError(t, p.CheckInvariants())
			require.NoError(t, depCheckDepRefs(p))
			// C takes the chunks again, one at a time, then the whole alias.
			var got []DevicePtr
			for range 8 {
				got = append(got, e.mustAlloc(2*mib, sc, ic))
			}
			for _, g := range got {
				e.mustFree(g, 2*mib, sc, ic)
			}
			q = e.mustAlloc(16*mib, sc, ic)
			e.mustFree(q, 16*mib, sa, ia)
			a.drain(t, DefaultStream, e.def)
			e.done()
			require.NoError(t, depCheckDepRefs(p))
		})
	}
}

// A stitching pool over the fake device and its model of stream order, 2 MiB pieces, with two
// streams A and B.
// finishEndLast ends a test over newEndLastPool, every block freed: the fake saw no bad call,
// the pool's invariants and dep counts hold, and it closes.
func finishEndLast(t *testing.T, e *poolSyncEnv, p *PoolMemoryResource) {
	t.Helper()
	e.done()
	require.NoError(t, depCheckDepRefs(p))
	require.NoError(t, p.Close())
}

func newEndLastPool(t *testing.T) (*poolSyncEnv, *PoolMemoryResource, *countingVMM, [2]StreamView, [2]int) {
	vm := newGatedVMM(0)
	cv := newCountingVMM(vm.vmm)
	vm.vmm = cv
	p := newTunedTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30}, poolTuning{stitchPiece: 2 * mib})
	e := newPoolSyncEnv(t, p)
	vm.check = e.checkReturned
	sa, _, ia := e.stream(0xa, "A")
	sb, _, ib := e.stream(0xb, "B")
	return e, p, cv, [2]StreamView{sa, sb}, [2]int{ia, ib}
}

// The free block at the end of the chain is served last, whatever list it lies in (findEndLast):
// A's own best fit is the end (in A's list), but a block of B's list fits, so A takes that one,
// ordered after B's free by a wait.
func TestStitchEndServedLastAcrossLists(t *testing.T) {
	e, p, _, s, i := newEndLastPool(t)
	a := e.mustAlloc(4*mib, s[0], i[0])
	require.Equal(t, 16*mib, p.PoolSize(), "one growth of 16 MiB, the rest free at the end in A's list")
	b := e.mustAlloc(8*mib, s[1], i[1])
	require.Equal(t, a+4*mib, b, "B takes the end of the chain out of A's list")
	sep := e.mustAlloc(2*mib, s[1], i[1])
	require.Equal(t, b+8*mib, sep)
	e.mustFree(b, 8*mib, s[1], i[1]) // 8 MiB free in B's list, between two live blocks
	q := e.mustAlloc(2*mib, s[0], i[0])
	require.Equal(t, b, q, "the block of B's list, not the 2 MiB left at the end (in B's list since B took from the end)")
	require.Equal(t, 16*mib, p.PoolSize())
	require.Empty(t, e.f.errors())
	require.NoError(t, p.CheckInvariants())
	e.mustFree(a, 4*mib, s[0], i[0])
	e.mustFree(q, 2*mib, s[0], i[0])
	e.mustFree(sep, 2*mib, s[1], i[1])
	finishEndLast(t, e, p)
}

// The end of the chain, too small for B's request and freed on A, moves into B's list naming A;
// the growth extends it, and B is ordered after A's free of the bytes it gets.
func TestStitchEndMovesToGrowingList(t *testing.T) {
	e, p, _, s, i := newEndLastPool(t)
	a := e.mustAlloc(4*mib, s[0], i[0])
	a2 := e.mustAlloc(10*mib, s[0], i[0])
	require.Equal(t, a+4*mib, a2)
	e.mustFree(a2, 10*mib, s[0], i[0]) // the end of the chain: 12 MiB in A's list, used on A
	q := e.mustAlloc(14*mib, s[1], i[1])
	require.Equal(t, a+4*mib, q, "the growth extended the end of the chain")
	require.Greater(t, p.PoolSize(), 16*mib)
	require.Empty(t, e.f.errors())
	require.NoError(t, p.CheckInvariants())
	e.mustFree(q, 14*mib, s[1], i[1])
	e.mustFree(a, 4*mib, s[0], i[0])
	finishEndLast(t, e, p)
}

// The end of the chain, large enough for B's request but in A's list, moves into B's list naming
// A before B's bytes are cut from it: the rest stays in B's list, as a growth for B would have
// left it, and B is ordered after A's frees (the model checks every byte B gets).
func TestStitchEndRestStaysWithTaker(t *testing.T) {
	e, p, _, s, i := newEndLastPool(t)
	a := e.mustAlloc(4*mib, s[0], i[0])
	a2 := e.mustAlloc(10*mib, s[0], i[0])
	e.mustFree(a2, 10*mib, s[0], i[0]) // the end of the chain: 12 MiB in A's list, used on A
	la := p.byStream[s[0].id]
	require.NotNil(t, la)
	q := e.mustAlloc(6*mib, s[1], i[1])
	require.Equal(t, a+4*mib, q, "B's bytes are cut from the front of the end")
	p.mu.Lock() // read under the lock, checked after it (a failed check must not hold it)
	tail := *p.tail
	lb := p.byStream[s[1].id]
	aBytes := la.bytes
	p.mu.Unlock()
	require.True(t, tail.free)
	require.Equal(t, q+6*mib, tail.addr)
	require.Equal(t, 6*mib, tail.size)
	require.Same(t, lb, tail.list, "the rest stays in B's list")
	// It named A's list; B's wait for A, made before q was handed out, orders every taker of
	// B's list after A's frees, so the name may already be dropped.
	require.Zero(t, aBytes, "A's list holds nothing")
	require.Empty(t, e.f.errors())
	require.NoError(t, p.CheckInvariants())
	// B takes the rest from its own list; A, whose list is empty, takes the end back from B's.
	r := e.mustAlloc(2*mib, s[1], i[1])
	require.Equal(t, q+6*mib, r)
	w := e.mustAlloc(2*mib, s[0], i[0])
	require.Equal(t, r+2*mib, w)
	require.Equal(t, 16*mib, p.PoolSize(), "no growth")
	e.mustFree(q, 6*mib, s[1], i[1])
	e.mustFree(r, 2*mib, s[1], i[1])
	e.mustFree(w, 2*mib, s[0], i[0])
	e.mustFree(a, 4*mib, s[0], i[0])
	finishEndLast(t, e, p)
}

// The end of the chain, just freed into its stream's cache (blocks up to 1 MiB), is still served
// last: the search reads it again once the caches are flushed, so B takes a block of C's list
// that fits rather than the end out of A's list.
func TestStitchEndInCacheServedLast(t *testing.T) {
	e, p, _, ab, iab := newEndLastPool(t)
	sc, _, ic := e.stream(0xc, "C")
	s, i := [3]StreamView{ab[0], ab[1], sc}, [3]int{iab[0], iab[1], ic}
	big := e.mustAlloc(14*mib, s[0], i[0])
	var ys []DevicePtr
	for range 4 {
		ys = append(ys, e.mustAlloc(512*kiB, s[0], i[0]))
	}
	require.Equal(t, 16*mib, p.PoolSize())
	x, end := ys[0], ys[3]
	e.mustFree(x, 512*kiB, s[2], i[2])   // C's list
	e.mustFree(end, 512*kiB, s[0], i[0]) // the end of the chain, into A's cache
	p.mu.Lock()
	cached := p.tail.list == nil
	p.mu.Unlock()
	require.True(t, cached, "the end lies in A's cache, in no list")
	q := e.mustAlloc(384*kiB, s[1], i[1])
	require.Equal(t, x, q, "the block of C's list, not the end")
	require.Empty(t, e.f.errors())
	require.NoError(t, p.CheckInvariants())
	e.mustFree(q, 384*kiB, s[1], i[1])
	for _, y := range ys[1:3] {
		e.mustFree(y, 512*kiB, s[0], i[0])
	}
	e.mustFree(big, 14*mib, s[0], i[0])
	finishEndLast(t, e, p)
}

// A request on A that no free block holds is stitched from chunks of B's list (the lists are
// not merged first): the stitched block names B's list, and A is ordered after B's frees.
func TestStitchChunksOfAnotherList(t *testing.T) {
	e, p, cv, s, i := newEndLastPool(t)
	var blocks []DevicePtr
	for range 17 {
		blocks = append(blocks, e.mustAlloc(2*mib, s[1], i[1]))
	}
	require.Equal(t, 48*mib, p.PoolSize())
	var even []DevicePtr
	for k := 0; k < 16; k += 2 {
		e.mustFree(blocks[k], 2*mib, s[1], i[1]) // used, then freed, on B
		even = append(even, blocks[k])
	}
	maps, deps := cv.counts().maps, p.stitching().stitchedDeps
	q := e.mustAlloc(16*mib, s[0], i[0])
	require.Equal(t, 1, p.stitching().stitches)
	require.Equal(t, 48*mib, p.PoolSize(), "stitched, not grown")
	require.Equal(t, maps+8, cv.counts().maps)
	require.Greater(t, p.stitching().stitchedDeps, deps, "the stitched block names B's list")
	var cs []DevicePtr
	for _, c := range p.stitching().aliases[q].chunks {
		cs = append(cs, c.addr)
	}
	slices.Sort(cs)
	require.Equal(t, even, cs, "the chunks B freed")
	require.Empty(t, e.f.errors())
	require.NoError(t, p.CheckInvariants())
	e.mustFree(q, 16*mib, s[0], i[0])
	for k := 1; k < 17; k += 2 {
		e.mustFree(blocks[k], 2*mib, s[1], i[1])
	}
	finishEndLast(t, e, p)
}
