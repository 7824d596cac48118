package rmm

import (
	"errors"
	"fmt"
	randv2 "math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// faultyDriver wraps d: while on, each call named in ops fails with probability 1/every.
func faultyDriver(d *cudaDriver, on *atomic.Bool, ops []string, every int, seed uint64) *cudaDriver {
	var mu sync.Mutex
	r := randv2.New(randv2.NewPCG(seed, 1))
	errFake := errors.New("fake driver failure")
	fail := func(op string) error {
		if !on.Load() || !slices.Contains(ops, op) {
			return nil
		}
		mu.Lock()
		defer mu.Unlock()
		if r.IntN(every) == 0 {
			return errFake
		}
		return nil
	}
	x := *d
	x.streamWaitEvent = func(ctx, s, e uintptr) error {
		if err := fail("wait"); err != nil {
			return err
		}
		return d.streamWaitEvent(ctx, s, e)
	}
	x.recordAndWait = func(ctx, e, from, to uintptr) error {
		if err := fail("record-and-wait"); err != nil {
			return err
		}
		return d.recordAndWait(ctx, e, from, to)
	}
	x.eventCreate = func(ctx uintptr, flags uint) (uintptr, error) {
		if err := fail("create"); err != nil {
			return 0, err
		}
		return d.eventCreate(ctx, flags)
	}
	x.eventRecord = func(ctx, e, s uintptr) error {
		if err := fail("record"); err != nil {
			return err
		}
		return d.eventRecord(ctx, e, s)
	}
	x.eventSynchronize = func(ctx, e uintptr) error {
		if err := fail("event-sync"); err != nil {
			return err
		}
		return d.eventSynchronize(ctx, e)
	}
	x.ctxSynchronize = func(ctx uintptr) error {
		if err := fail("ctx-sync"); err != nil {
			return err
		}
		return d.ctxSynchronize(ctx)
	}
	return &x
}

// chaosFree frees ptr on s (number i); when the free fails the pool kept the block live, so the
// model forgets the free it noted.
func chaosFree(e *poolSyncEnv, ptr DevicePtr, n int, s StreamView, i int) error {
	rs := e.modelRanges(ptr, n, true)
	e.f.mu.Lock()
	for _, r := range rs {
		e.m.free(i, r.p, int(r.end-r.p))
	}
	k := e.m.seq[i]
	e.f.mu.Unlock()
	err := e.p.Deallocate(ptr, n, s)
	if err != nil {
		e.f.mu.Lock()
		e.m.freed = slices.DeleteFunc(e.m.freed, func(x arenaSyncFreed) bool {
			return x.s == i && x.k > k-len(rs) && x.k <= k
		})
		e.f.mu.Unlock()
	}
	return err
}

// Goroutines allocate and free on their own Streams (made and closed as they go, some blocks
// freed after their Stream's Close), on the default stream and on a foreign stream, while
// another one calls Release and reads Stats and CheckInvariants (or closes the pool), with the
// fake driver's calls failing at random: in the model every block handed out is ordered after
// its frees and every range given back was seen finished, no call names a destroyed stream, the
// upstream never holds more than the maximum, and once the failures stop and everything is
// freed, Release (or the frees after Close) gives every byte back. (The stream synchronisations
// never fail here: a Stream that closes when neither its event can be recorded nor the stream
// nor the device synchronised, a broken context, keeps blocks whose frees nothing orders.)
func TestPoolUnlockChaos(t *testing.T) {
	for _, c := range []struct {
		name                       string
		expandable, faults, closes bool
		threshold                  int
	}{
		{name: "plain"},
		{name: "plain,faults", faults: true},
		{name: "plain,faults,close", faults: true, closes: true},
		{name: "expandable", expandable: true},
		{name: "expandable,faults", expandable: true, faults: true},
		{name: "expandable,faults,close", expandable: true, faults: true, closes: true},
		{name: "expandable,threshold,faults", expandable: true, faults: true, threshold: 8 * mib},
	} {
		t.Run(c.name, func(t *testing.T) {
			poolUnlockChaos(t, c.expandable, c.faults, c.closes, c.threshold, false, 5)
		})
	}
	// A stitching pool: 2 MiB pieces, growing the rest at even seeds, four workers and larger
	// requests, so that aliases are made, kept, lent and dropped by Release while the others run.
	// (Release once gave back memory freed while it unmapped a kept alias, unwaited: 1 to 3 of
	// 30 such runs failed.)
	for seed := range uint64(6) {
		for _, c := range []struct {
			name           string
			faults, closes bool
			threshold      int
		}{
			{name: "stitch"},
			{name: "stitch,faults", faults: true},
			{name: "stitch,faults,close", faults: true, closes: true},
			{name: "stitch,close", closes: true},
			{name: "stitch,threshold,faults", faults: true, threshold: 8 * mib},
		} {
			t.Run(fmt.Sprintf("%s-%d", c.name, seed), func(t *testing.T) {
				poolUnlockChaos(t, true, c.faults, c.closes, c.threshold, true, seed)
			})
		}
	}
}

// poolUnlockChaos: with stitch, over a stitching expandable pool; seed varies the faults and the
// workers' draws.
func poolUnlockChaos(t *testing.T, expandable, faults, closes bool, threshold int, stitch bool, seed uint64) {
	const maximum = 64 * mib
	var p *PoolMemoryResource
	var u *gatedUpstream
	var vm *gatedVMM
	if expandable {
		vm = newGatedVMM(0)
		var tune poolTuning
		if stitch {
			tune.stitchPiece, tune.stitchRest = 2*mib, seed%2 == 0
		}
		p = newTunedTestPool(t, vm, PoolOptions{MaximumPoolSize: maximum, ReleaseThreshold: threshold}, tune)
	} else {
		u = newGatedUpstream(t, 1<<30)
		var err error
		p, err = NewPoolMemoryResource(u, &PoolOptions{MaximumPoolSize: maximum})
		require.NoError(t, err)
	}
	e := newPoolSyncEnv(t, p)
	var on atomic.Bool
	if faults {
		p.drv = faultyDriver(p.drv, &on, []string{"wait", "record-and-wait", "create", "record", "event-sync", "ctx-sync"}, 12, seed)
		on.Store(true)
	}
	if u != nil {
		u.check = e.checkReturned
	} else {
		vm.check = e.checkReturned
	}
	fs, fi := e.foreign(0xf0, 9, "F")
	var handles atomic.Uintptr
	handles.Store(0x100)
	type live struct {
		p DevicePtr
		n int
		s StreamView
		i int
	}
	var leftMu sync.Mutex
	var left []live // blocks whose free failed, freed at the end
	keep := func(x live) {
		leftMu.Lock()
		left = append(left, x)
		leftMu.Unlock()
	}
	var closed atomic.Bool
	var wg sync.WaitGroup
	workers, sizes := 3, []int{256 << 10, 1 * mib, 2 * mib, 3*mib + 512, 8 * mib, 20 * mib}
	if stitch {
		workers, sizes = 4, []int{256 << 10, 2 * mib, 3*mib + 512, 6 * mib, 8 * mib, 12 * mib, 20 * mib}
	}
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := randv2.New(randv2.NewPCG(uint64(w), 12+seed))
			for round := range 6 {
				h := handles.Add(1)
				s, st, si := e.stream(h, fmt.Sprintf("W%d.%d", w, round))
				var mine []live
				for range 60 {
					if k := r.IntN(10); k < 4 && len(mine) > 0 {
						j := r.IntN(len(mine))
						x := mine[j]
						mine = append(mine[:j], mine[j+1:]...)
						x.s, x.i = s, si
						switch r.IntN(3) {
						case 0:
							x.s, x.i = DefaultStream, e.def
						case 1:
							x.s, x.i = fs, fi
						}
						if err := chaosFree(e, x.p, x.n, x.s, x.i); err != nil {
							if !faults || errors.Is(err, ErrInvalidFree) {
								t.Error(err)
								return
							}
							keep(x)
						}
						continue
					}
					n := sizes[r.IntN(len(sizes))]
					sv, svi := s, si
					if r.IntN(4) == 0 {
						sv, svi = fs, fi
					}
					q, err := e.alloc(n, sv, svi)
					if err != nil {
						var oom *OutOfMemoryError
						if q != 0 || !(errors.As(err, &oom) || faults || (closed.Load() && errors.Is(err, ErrClosed))) {
							t.Error(err)
							return
						}
						continue
					}
					mine = append(mine, live{q, n, sv, svi})
				}
				// Free some before the Close, the rest on the closed Stream.
				var after []live
				for _, x := range mine {
					if r.IntN(2) == 0 {
						after = append(after, x)
					} else if err := chaosFree(e, x.p, x.n, x.s, x.i); err != nil {
						keep(x)
					}
				}
				require.NoError(t, st.Close())
				e.f.kill(h)
				for _, x := range after {
					if err := chaosFree(e, x.p, x.n, s, si); err != nil {
						x.s, x.i = DefaultStream, e.def
						keep(x)
					}
				}
			}
		}()
	}
	stop := make(chan struct{})
	var aux sync.WaitGroup
	aux.Add(1)
	go func() {
		defer aux.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if closes && i == 20 {
				closed.Store(true)
				if err := p.Close(); err != nil && !faults {
					t.Error(err)
				}
			}
			if err := p.Release(); err != nil && !faults {
				t.Error(err)
			}
			st := p.Stats()
			if st.PoolSize > maximum || st.FreeBytes < 0 || st.PeakPoolSize > maximum {
				t.Errorf("stats: %+v", st)
			}
			if err := p.CheckInvariants(); err != nil {
				t.Error(err)
			}
		}
	}()
	wg.Wait()
	close(stop)
	aux.Wait()
	on.Store(false)
	for _, x := range left {
		require.NoError(t, chaosFree(e, x.p, x.n, x.s, x.i))
	}
	e.done()
	require.NoError(t, p.Release())
	if !closes {
		require.NoError(t, p.Close())
	}
	require.Equal(t, 0, p.PoolSize(), "%+v", p.Stats())
	if u != nil {
		held, peak, _, errs := u.figures()
		require.Empty(t, errs)
		require.Equal(t, 0, held)
		require.LessOrEqual(t, peak, maximum)
	} else {
		require.Empty(t, vm.errs)
		if !stitch { // an alias maps the same handles a second time
			require.LessOrEqual(t, vm.peak, maximum)
		}
		require.Zero(t, vm.mapped)
	}
}
