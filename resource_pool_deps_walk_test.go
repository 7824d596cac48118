package rmm

import (
	"errors"
	"fmt"
	randv2 "math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Adversarial tests of coalescing across streams (pool_placement.go): block.deps, depRefs, retargetDeps,
// coveredDeps, forgetDropped, streamClosing.

// depCloseHook is a second close hook on a Stream, registered after the pool's: Stream.Close
// calls it after the pool's streamClosing and before its own cuStreamSynchronize. It reports
// that it was reached and holds the Close there until released, so that a test acts while the
// closing stream's work is still pending on the device (as on a GPU, where Close only waits for
// the stream after every hook returned).
type depCloseHook struct {
	reached, release chan struct{}
}

func (h *depCloseHook) streamClosing(StreamView) {
	close(h.reached)
	<-h.release
}

// depCoalesceEnv: a 16 MiB pool (one upstream block) on the fake device whose whole block was
// freed on the default stream.
func depCoalesceEnv(t *testing.T) *poolSyncEnv {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{MaximumPoolSize: 16 * mib})
	e := newPoolSyncEnv(t, p)
	all := e.mustAlloc(16*mib, DefaultStream, e.def)
	e.mustFree(all, 16*mib, DefaultStream, e.def)
	return e
}

// A Stream A whose list is empty but named by a block in S's list (x freed on A coalesced into y
// freed on S) closes while S waits, unlocked, on the default stream's event (a take from the
// default list). streamClosing retargets the name from A's list to the default list, without
// any free into the default list; S's Allocate then runs coveredDeps with its older wait on the
// default list (frees unchanged) and drops the name. S then takes x+y from its own list with no
// wait at all, while the free of x on A is still pending (Close has not synchronised A yet).
func TestDepCoalesceCloseRetargetThenCoveredDeps(t *testing.T) {
	e := depCoalesceEnv(t)
	p := e.p
	sa, stA, ia := e.stream(0xa, "A")
	ss, _, is := e.stream(0x5, "S")
	sc, _, ic := e.stream(0xc, "C")

	x := e.mustAlloc(2*mib, DefaultStream, e.def)
	y := e.mustAlloc(2*mib, DefaultStream, e.def)
	z := e.mustAlloc(2*mib, DefaultStream, e.def)
	require.Equal(t, x+2*mib, y)
	e.mustFree(x, 2*mib, sa, ia) // A's list: x
	e.mustFree(y, 2*mib, ss, is) // coalesces with x into S's list, naming A's
	la := p.byStream[sa.id]
	require.Equal(t, 1, la.depRefs)
	require.Zero(t, la.count)
	require.NoError(t, p.CheckInvariants())

	// C takes a piece of the default list: the default list's event is recorded, not dirty.
	c := e.mustAlloc(2*mib, sc, ic)

	// A second hook on A, after the pool's: holds Close before its stream synchronisation.
	h := &depCloseHook{reached: make(chan struct{}), release: make(chan struct{})}
	require.True(t, addStreamCloseHook(stA.View(), h))

	// S asks for 8 MiB: not in its list (4 MiB), taken from the default list; hold its wait.
	g := e.holdFirst(t, "wait")
	var big DevicePtr
	var bigErr error
	bigDone := make(chan struct{})
	go func() {
		defer close(bigDone)
		big, bigErr = e.alloc(8*mib, ss, is)
	}()
	require.Equal(t, "wait", g.waitEntered(t))

	closed := make(chan error, 1)
	go func() { closed <- stA.Close() }()
	<-h.reached // the pool's streamClosing for A is done; A's work is still pending

	g.open()
	<-bigDone
	require.NoError(t, bigErr)

	// S takes x+y (4 MiB) from its own list: it must still be ordered after A's free of x.
	q, qerr := e.alloc(4*mib, ss, is)

	// Let A's Close synchronise A (modelled) and end.
	close(h.release)
	require.NoError(t, <-closed)
	e.streamSynced(sa.h) // the Stream's own handle where there is CUDA
	e.f.kill(sa.h)

	require.NoError(t, qerr, "stream-ordering violation")
	require.Equal(t, x, q)
	e.mustFree(q, 4*mib, ss, is)
	e.mustFree(big, 8*mib, ss, is)
	e.mustFree(c, 2*mib, sc, ic)
	e.mustFree(z, 2*mib, DefaultStream, e.def)
	e.done()
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
}

// depCheckDepRefs recounts every list's depRefs over the listed blocks and the live stitched
// ranges (which name the list their chunks were lent out of) and checks that no listed
// block names a dropped list (stronger than CheckInvariants: dropped lists too). Pool quiescent.
func depCheckDepRefs(p *PoolMemoryResource) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	count := map[*freeList]int{}
	var err error
	for _, l := range p.lists {
		l.each(func(b *block) {
			for _, o := range b.deps() {
				count[o]++
				if o.dropped && err == nil {
					err = fmt.Errorf("listed block %#x names a dropped list (%v)", uintptr(b.addr), o.stream)
				}
				if o == l && err == nil {
					err = fmt.Errorf("listed block %#x names its own list", uintptr(b.addr))
				}
			}
		})
	}
	if err != nil {
		return err
	}
	if st := p.stitching(); st != nil {
		for _, a := range st.aliases {
			if a.b != nil {
				count[a.from]++ // a live stitched range names the list its chunks were lent out of
			}
		}
	}
	for _, l := range p.lists {
		if l.depRefs != count[l] {
			return fmt.Errorf("list %v: depRefs %d, counted %d", l.stream, l.depRefs, count[l])
		}
	}
	for o, n := range count {
		if o.depRefs < n {
			return fmt.Errorf("list %v (dropped %v): depRefs %d < %d", o.stream, o.dropped, o.depRefs, n)
		}
	}
	return nil
}

type depWalkStream struct {
	v      StreamView
	st     *Stream // nil: default or foreign
	i      int     // model number
	h      uintptr
	closed bool
}

// depSeqWalk: one goroutine, many streams (ours, foreign, default), sizes around the 1 MiB
// cross-coalescing minimum and the cache's sizes, frees on random streams (closed ones
// included), stream closes (Close's host synchronisation modelled), Release, and every check
// after each step.
func depSeqWalk(t *testing.T, e *poolSyncEnv, seed uint64, ops int, withRelease bool) {
	depSeqWalkF(t, e, seed, ops, withRelease, nil)
}

func depSeqWalkF(t *testing.T, e *poolSyncEnv, seed uint64, ops int, withRelease bool, faults *atomic.Bool) {
	p := e.p
	r := randv2.New(randv2.NewPCG(seed, 99))
	ss := []*depWalkStream{{v: DefaultStream, i: e.def}}
	nextH := uintptr(0x100)
	newStream := func() {
		nextH++
		if r.IntN(4) == 0 {
			v, i := e.foreign(nextH, uint64(nextH), fmt.Sprintf("F%x", nextH))
			ss = append(ss, &depWalkStream{v: v, i: i, h: v.h})
			return
		}
		// With CUDA the Stream keeps its own handle (nextH only names it without CUDA): the
		// model and the fake know it by the view's.
		v, st, i := e.stream(nextH, fmt.Sprintf("S%x", nextH))
		ss = append(ss, &depWalkStream{v: v, st: st, i: i, h: v.h})
	}
	for range 4 {
		newStream()
	}
	type live struct {
		p DevicePtr
		n int
	}
	var mine []live
	sizes := []int{256 << 10, 512 << 10, 768 << 10, 1 * mib, mib + 256, 2 * mib, 3 * mib, 5 * mib}
	pick := func(open bool) *depWalkStream {
		for {
			s := ss[r.IntN(len(ss))]
			if !open || !s.closed {
				return s
			}
		}
	}
	for step := range ops {
		switch k := r.IntN(20); {
		case k < 8 && len(mine) > 0:
			j := r.IntN(len(mine))
			x := mine[j]
			mine = append(mine[:j], mine[j+1:]...)
			s := pick(false)
			if err := chaosFree(e, x.p, x.n, s.v, s.i); err != nil {
				require.NotNil(t, faults, "step %d: %v", step, err)
				require.NotErrorIs(t, err, ErrInvalidFree, "step %d", step)
				mine = append(mine, x)
			}
		case k == 8:
			// Close one of our open streams (not the last few).
			var cands []*depWalkStream
			for _, s := range ss {
				if s.st != nil && !s.closed {
					cands = append(cands, s)
				}
			}
			if len(cands) > 1 {
				s := cands[r.IntN(len(cands))]
				if err := s.st.Close(); faults == nil {
					require.NoError(t, err)
				}
				e.streamSynced(s.h) // Close waits for the stream (after the hooks)
				e.f.kill(s.h)
				s.closed = true
				newStream()
			}
		case k == 9 && withRelease:
			if err := p.Release(); faults == nil {
				require.NoError(t, err, "step %d", step)
			}
		default:
			s := pick(true)
			n := sizes[r.IntN(len(sizes))]
			q, err := e.alloc(n, s.v, s.i)
			var oom *OutOfMemoryError
			if errors.As(err, &oom) {
				break
			}
			if err != nil && faults != nil && !errors.Is(err, ErrClosed) {
				// an injected failure; but never a violation of stream order
				require.NotContains(t, err.Error(), "got [", "step %d", step)
				break
			}
			require.NoError(t, err, "step %d: alloc %d on %v", step, n, s.v)
			mine = append(mine, live{q, n})
		}
		require.Empty(t, e.f.errors(), "step %d", step)
		require.NoError(t, p.CheckInvariants(), "step %d", step)
		require.NoError(t, depCheckDepRefs(p), "step %d", step)
	}
	if faults != nil {
		faults.Store(false)
	}
	for _, x := range mine {
		s := pick(false)
		require.NoError(t, e.free(x.p, x.n, s.v, s.i))
	}
	e.done()
	require.NoError(t, depCheckDepRefs(p))
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
}

func TestDepCoalesceSeqWalk(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	// Stitched ranges made, and how many of their blocks named other streams' lists (so that
	// Allocate waited for them), over every seed.
	stitched, stitchedDeps := 0, 0
	for seed := range uint64(shortOrLong(12, 60)) {
		for _, mode := range []string{"plain", "exp", "stitch"} {
			t.Run(fmt.Sprintf("seed%d-%s", seed, mode), func(t *testing.T) {
				var p *PoolMemoryResource
				if mode != "plain" {
					// The gated VMM's check fails on an unmap of memory whose frees the model
					// does not know complete.
					vm := newGatedVMM(0)
					var tune poolTuning
					if mode == "stitch" {
						tune.stitchPiece, tune.stitchRest = 2*mib, true
					}
					p = newTunedTestPool(t, vm, PoolOptions{MaximumPoolSize: 64 * mib}, tune)
					e := newPoolSyncEnv(t, p)
					vm.check = e.checkReturned
					depSeqWalk(t, e, seed, 400, seed%2 == 0)
					require.Empty(t, vm.errs)
					if st := p.stitching(); st != nil {
						stitched += st.stitches
						stitchedDeps += st.stitchedDeps
					}
				} else {
					u := newGatedUpstream(t, 1<<30)
					var err error
					p, err = NewPoolMemoryResource(u, &PoolOptions{MaximumPoolSize: 32 * mib})
					require.NoError(t, err)
					e := newPoolSyncEnv(t, p)
					u.check = e.checkReturned
					depSeqWalk(t, e, seed, 400, seed%2 == 0)
					_, _, _, errs := u.figures()
					require.Empty(t, errs)
				}
			})
		}
	}
	require.Positive(t, stitched, "nothing stitched")
	require.Positive(t, stitchedDeps, "no stitched block named another stream's list")
}

func TestDepCoalesceSeqWalkTrim(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	// The short form still draws every threshold (seed%3) with either parity (seed%2).
	for seed := range uint64(shortOrLong(12, 60)) {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			vm := newGatedVMM(0)
			p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 64 * mib, ReleaseThreshold: int(seed%3) * 4 * mib})
			e := newPoolSyncEnv(t, p)
			vm.check = e.checkReturned
			depSeqWalk(t, e, seed, 400, seed%2 == 0)
			require.Empty(t, vm.errs)
		})
	}
}

func TestDepCoalesceSeqWalkFaulty(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	for seed := range uint64(shortOrLong(16, 80)) {
		for _, exp := range []bool{false, true} {
			t.Run(fmt.Sprintf("seed%d-exp%v", seed, exp), func(t *testing.T) {
				var p *PoolMemoryResource
				var vm *gatedVMM
				var u *gatedUpstream
				if exp {
					vm = newGatedVMM(0)
					p = newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 64 * mib, ReleaseThreshold: int(seed%2) * 8 * mib})
				} else {
					u = newGatedUpstream(t, 1<<30)
					var err error
					p, err = NewPoolMemoryResource(u, &PoolOptions{MaximumPoolSize: 32 * mib})
					require.NoError(t, err)
				}
				e := newPoolSyncEnv(t, p)
				var on atomic.Bool
				p.drv = faultyDriver(p.drv, &on, []string{"wait", "record-and-wait", "create", "record", "event-sync", "ctx-sync"}, 7, seed)
				on.Store(true)
				if exp {
					vm.check = e.checkReturned
				} else {
					u.check = e.checkReturned
				}
				depSeqWalkF(t, e, seed, 400, seed%2 == 0, &on)
				if exp {
					require.Empty(t, vm.errs)
				} else {
					_, _, _, errs := u.figures()
					require.Empty(t, errs)
				}
			})
		}
	}
}

// depSyncHook models, in the fake's model, the host synchronisation Stream.Close makes after its
// hooks (registered after the pool's hook, it runs after the pool's streamClosing).
type depSyncHook struct {
	e *poolSyncEnv
	h uintptr
}

func (x depSyncHook) streamClosing(StreamView) { x.e.streamSynced(x.h) }

// streamSynced tells the model that the host has waited for the stream with handle h. The
// deferred unlock keeps a failing model (an unknown handle panics) from leaving the fake's lock
// held, which would hang the test's clean-up instead of reporting the failure.
func (e *poolSyncEnv) streamSynced(h uintptr) {
	e.f.mu.Lock()
	defer e.f.mu.Unlock()
	e.m.streamSync(h)
}

// depConcWalk: goroutines each with their own Streams (made and closed as they go), the default
// stream and a foreign stream; frees on any stream (closed ones included), Release, sizes around
// the cross-coalescing minimum. Checks the model on every take and every range given back.
func depConcWalk(t *testing.T, e *poolSyncEnv, workers, rounds, ops int, seed uint64, withRelease bool, faults *atomic.Bool) {
	p := e.p
	type sref struct {
		v StreamView
		i int
	}
	var regMu sync.Mutex
	reg := []sref{{DefaultStream, e.def}}
	fs, fi := e.foreign(0xf0, 9, "F")
	reg = append(reg, sref{fs, fi})
	var handles atomic.Uintptr
	handles.Store(0x100)
	type live struct {
		p DevicePtr
		n int
	}
	var leftMu sync.Mutex
	var left []live
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := randv2.New(randv2.NewPCG(seed, uint64(w)))
			var mine []live
			for round := range rounds {
				h := handles.Add(1)
				s, st, si := e.stream(h, fmt.Sprintf("W%d.%d", w, round))
				regMu.Lock()
				reg = append(reg, sref{s, si})
				regMu.Unlock()
				for range ops {
					k := r.IntN(12)
					switch {
					case k < 5 && len(mine) > 0:
						j := r.IntN(len(mine))
						x := mine[j]
						mine = append(mine[:j], mine[j+1:]...)
						regMu.Lock()
						o := reg[r.IntN(len(reg))]
						regMu.Unlock()
						if err := chaosFree(e, x.p, x.n, o.v, o.i); err != nil {
							if faults == nil || errors.Is(err, ErrInvalidFree) {
								t.Error(err)
								return
							}
							mine = append(mine, x)
						}
					case k == 5 && withRelease && w == 0:
						if err := p.Release(); err != nil && faults == nil {
							t.Error(err)
							return
						}
					default:
						n := []int{256 << 10, 512 << 10, 768 << 10, 1 * mib, 2 * mib, 3*mib + 512, 6 * mib}[r.IntN(7)]
						sv, svi := s, si
						if r.IntN(5) == 0 {
							sv, svi = fs, fi
						} else if r.IntN(5) == 0 {
							sv, svi = DefaultStream, e.def
						}
						q, err := e.alloc(n, sv, svi)
						if err != nil {
							var oom *OutOfMemoryError
							if q != 0 || !(errors.As(err, &oom) || (faults != nil && !strings.Contains(err.Error(), " got ["))) {
								t.Error(err)
								return
							}
							continue
						}
						mine = append(mine, live{q, n})
					}
				}
				require.True(t, addStreamCloseHook(st.View(), depSyncHook{e, s.h}))
				st.Close()
				e.f.kill(s.h)
			}
			leftMu.Lock()
			left = append(left, mine...)
			leftMu.Unlock()
		}()
	}
	wg.Wait()
	if faults != nil {
		faults.Store(false)
	}
	for _, x := range left {
		require.NoError(t, chaosFree(e, x.p, x.n, DefaultStream, e.def))
	}
	e.done()
	require.NoError(t, depCheckDepRefs(p))
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
}

func TestDepCoalesceConcWalk(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	for seed := range uint64(shortOrLong(4, 12)) {
		modes := []string{"plain", "exp", "trim", "plain-faults", "exp-faults", "stitch", "stitch-faults"}
		for _, mode := range modes {
			t.Run(fmt.Sprintf("%s-seed%d", mode, seed), func(t *testing.T) {
				var p *PoolMemoryResource
				var vm *gatedVMM
				var u *gatedUpstream
				if mode == "plain" || mode == "plain-faults" {
					u = newGatedUpstream(t, 1<<30)
					var err error
					p, err = NewPoolMemoryResource(u, &PoolOptions{MaximumPoolSize: 48 * mib})
					require.NoError(t, err)
				} else {
					thr := 0
					if mode == "trim" || mode == "exp-faults" {
						thr = 8 * mib
					}
					piece := 0
					if strings.HasPrefix(mode, "stitch") {
						piece = 2 * mib
					}
					vm = newGatedVMM(0)
					p = newTunedTestPool(t, vm, PoolOptions{MaximumPoolSize: 96 * mib, ReleaseThreshold: thr}, poolTuning{stitchPiece: piece, stitchRest: piece > 0})
				}
				e := newPoolSyncEnv(t, p)
				var faults *atomic.Bool
				if strings.HasSuffix(mode, "faults") {
					faults = new(atomic.Bool)
					p.drv = faultyDriver(p.drv, faults, []string{"wait", "record-and-wait", "create", "record", "event-sync", "ctx-sync"}, 9, seed)
					faults.Store(true)
				}
				if vm != nil {
					vm.check = e.checkReturned
				} else {
					u.check = e.checkReturned
				}
				var jit atomic.Uint64
				e.f.mu.Lock()
				e.f.onCall = func(string) {
					if x := jit.Add(0x9E3779B97F4A7C15); x>>61 == 0 {
						time.Sleep(time.Duration(x>>50&0x1f) * time.Microsecond)
					}
				}
				e.f.mu.Unlock()
				depConcWalk(t, e, 5, 6, 80, seed, seed%2 == 0, faults)
				if vm != nil {
					require.Empty(t, vm.errs)
				} else {
					_, _, _, errs := u.figures()
					require.Empty(t, errs)
				}
			})
		}
	}
}

// Holds: a Stream closes while a merge by another stream holds, in flight, a block naming its
// list: the pool synchronises the closing stream; the block forgets the name when it lands.
func TestDepCoalesceCloseWhileMergeHoldsNamedBlock(t *testing.T) {
	e := depCoalesceEnv(t)
	p := e.p
	sa, stA, ia := e.stream(0xa, "A")
	st, _, it := e.stream(0xb, "T")
	ss, _, is := e.stream(0x5, "S")
	x := e.mustAlloc(2*mib, DefaultStream, e.def)
	y := e.mustAlloc(2*mib, DefaultStream, e.def)
	z := e.mustAlloc(2*mib, DefaultStream, e.def)
	w := e.mustAlloc(2*mib, DefaultStream, e.def)
	rest := e.mustAlloc(8*mib, DefaultStream, e.def) // the pool is full
	e.mustFree(x, 2*mib, sa, ia)
	e.mustFree(y, 2*mib, st, it) // T's list: x+y naming A
	e.mustFree(w, 2*mib, ss, is) // S's list: w
	require.Equal(t, 1, p.byStream[sa.id].depRefs)
	// S asks for 5 MiB: no block holds it; S merges T's list into its own: hold the wait.
	g := e.holdFirst(t, "record-and-wait")
	var qerr error
	qdone := make(chan struct{})
	go func() {
		defer close(qdone)
		_, qerr = e.alloc(5*mib, ss, is)
	}()
	g.waitEntered(t)
	e.f.take()
	closed := make(chan error, 1)
	go func() {
		require.True(t, addStreamCloseHook(stA.View(), depSyncHook{e, sa.h}))
		closed <- stA.Close()
	}()
	require.NoError(t, <-closed)
	calls := e.f.take()
	t.Log(calls)
	require.Contains(t, calls, "sync A")
	e.f.kill(sa.h)
	g.open()
	<-qdone
	t.Log(qerr)
	require.NoError(t, depCheckDepRefs(p))
	require.NoError(t, p.CheckInvariants())
	r, err := e.alloc(4*mib, ss, is)
	require.NoError(t, err)
	e.mustFree(r, 4*mib, ss, is)
	e.mustFree(z, 2*mib, ss, is)
	e.mustFree(rest, 8*mib, ss, is)
	e.done()
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
}

// Holds: the dep wait of a take from the stream's own list fails; the block goes back naming
// the other list, and the next take waits for it again.
func TestDepCoalesceFailedDepWaitRestores(t *testing.T) {
	e := depCoalesceEnv(t)
	p := e.p
	sa, _, ia := e.stream(0xa, "A")
	ss, _, is := e.stream(0x5, "S")
	x := e.mustAlloc(2*mib, DefaultStream, e.def)
	y := e.mustAlloc(2*mib, DefaultStream, e.def)
	z := e.mustAlloc(2*mib, DefaultStream, e.def)
	e.mustFree(x, 2*mib, sa, ia)
	e.mustFree(y, 2*mib, ss, is)
	var on atomic.Bool
	p.drv = faultyDriver(p.drv, &on, []string{"record-and-wait", "wait"}, 1, 1)
	on.Store(true)
	_, err := p.Allocate(4*mib, ss)
	require.Error(t, err)
	on.Store(false)
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, depCheckDepRefs(p))
	require.Equal(t, 1, p.byStream[sa.id].depRefs)
	e.f.take()
	q := e.mustAlloc(4*mib, ss, is)
	require.NotEmpty(t, e.f.take())
	e.mustFree(q, 4*mib, ss, is)
	e.mustFree(z, 2*mib, ss, is)
	e.done()
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
}

// Holds: a stream S takes from another list o a block naming S's own list l (memory freed on S
// coalesced into it), and its wait on o fails while S's list is merged into a third stream's
// list by that stream's allocation, which would drop l once empty. The block goes back to o
// still naming S's list (l stays: it was pinned across the wait), so the next taker, on a fourth
// stream, waits for S's free too.
func TestDepCoalesceFailedTakeKeepsOwnListDep(t *testing.T) {
	e := depCoalesceEnv(t)
	p := e.p
	ss, _, is := e.stream(0x5, "S")
	so, _, io := e.stream(0xb, "O")
	s2, _, i2 := e.stream(0x2, "S2")
	sc, _, ic := e.stream(0xc, "C")

	a := e.mustAlloc(256<<10, DefaultStream, e.def)
	z := e.mustAlloc(512<<10, DefaultStream, e.def)
	sep := e.mustAlloc(256<<10, DefaultStream, e.def)
	x := e.mustAlloc(2*mib, DefaultStream, e.def)
	y := e.mustAlloc(2*mib, DefaultStream, e.def)
	rest := e.mustAlloc(16*mib-5*mib, DefaultStream, e.def) // the pool is full
	require.Equal(t, a+256<<10, z)
	require.Equal(t, x+2*mib, y)
	e.mustFree(z, 512<<10, ss, is) // S's list: z
	e.mustFree(x, 2*mib, ss, is)   // S's list: z, x
	e.mustFree(y, 2*mib, so, io)   // x+y coalesce into O's list, naming S's
	e.mustFree(a, 256<<10, s2, i2) // S2's list: a (a+z is too small to coalesce across streams)
	ls := p.byStream[ss.id]
	require.Equal(t, 1, ls.depRefs)
	require.Equal(t, 1, ls.count)
	require.NoError(t, p.CheckInvariants())

	// S's first record-and-wait (its take of x+y from O's list) is held, then fails.
	errFake := errors.New("fake driver failure")
	held, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	d := p.drv
	x2 := *d
	x2.recordAndWait = func(ctx, ev, from, to uintptr) error {
		if first.CompareAndSwap(false, true) {
			close(held)
			<-release
			return errFake
		}
		return d.recordAndWait(ctx, ev, from, to)
	}
	p.drv = &x2

	var serr error
	sdone := make(chan struct{})
	go func() {
		defer close(sdone)
		_, serr = e.alloc(4*mib, ss, is)
	}()
	<-held

	// S2 asks for 768 KiB: no list holds it, so S2 merges S's list (z) into its own, where z
	// coalesces with a.
	q := e.mustAlloc(768<<10, s2, i2)
	require.Equal(t, a, q)

	close(release)
	<-sdone
	require.ErrorIs(t, serr, errFake)
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, depCheckDepRefs(p))

	// C takes x+y from O's list: it must wait for S's free of x as well.
	c, err := e.alloc(4*mib, sc, ic)
	require.NoError(t, err, "stream-ordering violation")
	require.Equal(t, x, c)

	e.mustFree(c, 4*mib, sc, ic)
	e.mustFree(q, 768<<10, s2, i2)
	e.mustFree(sep, 256<<10, DefaultStream, e.def)
	e.mustFree(rest, 11*mib, DefaultStream, e.def)
	e.done()
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
}

// Holds: stream T's take from B's list waits on B's event (recorded now) and then, held, on a
// third list's. Meanwhile B takes from its own list part of a block naming A's list, waits for
// A, and its remainder (memory A freed) forgets A's name; a free on T coalesces that remainder
// into T's list, naming B's. When T's take ends, its earlier wait on B's event must not be taken
// to cover that name: B's record came before B waited for A.
func TestDepCoalesceCoveredDepsCountsAsFree(t *testing.T) {
	e := depCoalesceEnv(t)
	p := e.p
	sq, _, iq := e.stream(0x9, "Q")
	sb, _, ib := e.stream(0xb, "B")
	sa, _, ia := e.stream(0xa, "A")
	st, _, it := e.stream(0x7, "T")

	y1 := e.mustAlloc(512<<10, DefaultStream, e.def)
	y2 := e.mustAlloc(512<<10, DefaultStream, e.def)
	sep := e.mustAlloc(256<<10, DefaultStream, e.def)
	u := e.mustAlloc(2*mib, DefaultStream, e.def)
	v := e.mustAlloc(2*mib, DefaultStream, e.def)
	z := e.mustAlloc(3*mib/2, DefaultStream, e.def)
	rest := e.mustAlloc(16*mib-27*mib/4, DefaultStream, e.def) // the pool is full
	require.Equal(t, u+2*mib, v)
	require.Equal(t, v+2*mib, z)
	e.mustFree(y1, 512<<10, sq, iq) // Q's list: y1
	e.mustFree(y2, 512<<10, sb, ib) // y1+y2 in B's list, naming Q's
	e.mustFree(v, 2*mib, sa, ia)    // A's list: v
	e.mustFree(u, 2*mib, sb, ib)    // u+v in B's list, naming A's
	require.NoError(t, p.CheckInvariants())

	// T's second record-and-wait (its dep wait on Q's list) is held.
	g := newGate()
	g.shut(t)
	var calls atomic.Int32
	e.f.mu.Lock()
	e.f.onCall = func(op string) {
		if op == "record-and-wait" && calls.Add(1) == 2 {
			g.pass(op)
		}
	}
	e.f.mu.Unlock()
	var ty DevicePtr
	var terr error
	tdone := make(chan struct{})
	go func() {
		defer close(tdone)
		ty, terr = e.alloc(mib, st, it) // y1+y2, from B's list
	}()
	g.waitEntered(t)

	// B takes u (its own list, naming A's: B waits for A); v stays in B's list.
	bu := e.mustAlloc(2*mib, sb, ib)
	require.Equal(t, u, bu)
	// A free on T coalesces v into T's list, naming B's.
	e.mustFree(z, 3*mib/2, st, it)

	g.open()
	<-tdone
	require.NoError(t, terr)
	require.Equal(t, y1, ty)

	// T takes v+z from its own list: it must be ordered after A's free of v.
	q, err := e.alloc(7*mib/2, st, it)
	require.NoError(t, err, "stream-ordering violation")
	require.Equal(t, v, q)

	e.mustFree(q, 7*mib/2, st, it)
	e.mustFree(ty, mib, st, it)
	e.mustFree(bu, 2*mib, sb, ib)
	e.mustFree(sep, 256<<10, DefaultStream, e.def)
	e.mustFree(rest, 16*mib-27*mib/4, DefaultStream, e.def)
	e.done()
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
}
