package rmm

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func adpNewStats(t *testing.T, up MemoryResource) *StatisticsResourceAdaptor {
	t.Helper()
	r, err := NewStatisticsResourceAdaptor(up)
	require.NoError(t, err)
	return r
}

func TestStatisticsEmpty(t *testing.T) {
	r := adpNewStats(t, nil)
	require.Equal(t, Statistics{}, r.Stats())
	require.Equal(t, 1, r.Depth())
	require.Same(t, CurrentDeviceResource(), r.Upstream())
}

func TestStatisticsAllFreed(t *testing.T) {
	for _, u := range adpUpstreams() {
		t.Run(u.name, func(t *testing.T) {
			r := adpNewStats(t, u.new())
			var ps []DevicePtr
			for range 10 {
				ps = append(ps, adpAlloc(t, r, 10*miB))
			}
			for _, p := range ps {
				adpFree(t, r, p, 10*miB)
			}
			require.Equal(t, Statistics{0, 0, 100 * miB, 10, 100 * miB, 10}, r.Stats())
		})
	}
}

// librmm's PeakAllocations: 10 × 10 MiB, every other one freed, then 10 more and all freed.
func TestStatisticsPeakAllocations(t *testing.T) {
	for _, u := range adpUpstreams() {
		t.Run(u.name, func(t *testing.T) {
			r := adpNewStats(t, u.new())
			var ps []DevicePtr
			for range 10 {
				ps = append(ps, adpAlloc(t, r, 10*miB))
			}
			var kept []DevicePtr
			for i, p := range ps {
				if i%2 == 0 {
					adpFree(t, r, p, 10*miB)
				} else {
					kept = append(kept, p)
				}
			}
			require.Equal(t, Statistics{50 * miB, 5, 100 * miB, 10, 100 * miB, 10}, r.Stats())

			for range 10 {
				kept = append(kept, adpAlloc(t, r, 10*miB))
			}
			for _, p := range kept {
				adpFree(t, r, p, 10*miB)
			}
			require.Equal(t, Statistics{0, 0, 150 * miB, 15, 200 * miB, 20}, r.Stats())
		})
	}
}

// The counter stack, step by step: librmm's Python test of push_counters/pop_counters
// (test_counter_stack), with every buffer 10 bytes (today's librmm counts the size asked; its old
// test saw 16 because sizes were padded then). The sequence:
//
//  1. allocate 10 buffers of 10 B                 level 0: value 100, count 10
//  2. push        → returns level 0: {100, 10, 100, 10, 100, 10}
//  3. allocate b1 (10 B)                          level 1: value 10, peak 10, total 10
//  4. push        → returns level 1: {10, 1, 10, 1, 10, 1}
//  5. free b1                                     level 2: value −10, count −1, peaks 0, totals 0
//  6. pop         → returns {−10, −1, 0, 0, 0, 0}; level 1 becomes value 0, peak 10, total 10
//  7. allocate b1 (10 B)                          level 1: value 10, peak 10, total 20
//  8. push        → returns level 1: {10, 1, 10, 1, 20, 2}
//  9. allocate b2 (10 B)                          level 2: {10, 1, 10, 1, 10, 1}
//  10. pop        → returns {10, 1, 10, 1, 10, 1}; level 1: value 20, peak max(10, 10+10) = 20, total 30
//  11. pop        → returns {20, 2, 20, 2, 30, 3}; level 0: value 120, peak max(100, 100+20) = 120, total 130
//  12. free b1 and b2                             level 0: {100, 10, 120, 12, 130, 13}
//  13. free the 10 buffers                        level 0: {0, 0, 120, 12, 130, 13}
//  14. pop        → error (ErrOutOfRange), nothing changes
func TestStatisticsCounterStackWorkedExample(t *testing.T) {
	for _, u := range adpUpstreams() {
		t.Run(u.name, func(t *testing.T) {
			r := adpNewStats(t, u.new())
			var bufs []DevicePtr
			for range 10 {
				bufs = append(bufs, adpAlloc(t, r, 10))
			}
			require.Equal(t, Statistics{100, 10, 100, 10, 100, 10}, r.PushCounters())
			require.Equal(t, 2, r.Depth())
			require.Equal(t, Statistics{}, r.Stats())
			b1 := adpAlloc(t, r, 10)
			require.Equal(t, Statistics{10, 1, 10, 1, 10, 1}, r.PushCounters())
			adpFree(t, r, b1, 10)
			st, err := r.PopCounters()
			require.NoError(t, err)
			require.Equal(t, Statistics{-10, -1, 0, 0, 0, 0}, st)
			require.Equal(t, Statistics{0, 0, 10, 1, 10, 1}, r.Stats())
			b1 = adpAlloc(t, r, 10)
			require.Equal(t, Statistics{10, 1, 10, 1, 20, 2}, r.PushCounters())
			b2 := adpAlloc(t, r, 10)
			st, err = r.PopCounters()
			require.NoError(t, err)
			require.Equal(t, Statistics{10, 1, 10, 1, 10, 1}, st)
			st, err = r.PopCounters()
			require.NoError(t, err)
			require.Equal(t, Statistics{20, 2, 20, 2, 30, 3}, st)
			require.Equal(t, Statistics{120, 12, 120, 12, 130, 13}, r.Stats())
			adpFree(t, r, b1, 10)
			adpFree(t, r, b2, 10)
			require.Equal(t, Statistics{100, 10, 120, 12, 130, 13}, r.Stats())
			for _, p := range bufs {
				adpFree(t, r, p, 10)
			}
			require.Equal(t, Statistics{0, 0, 120, 12, 130, 13}, r.Stats())
			_, err = r.PopCounters()
			require.ErrorIs(t, err, ErrOutOfRange)
			require.ErrorContains(t, err, "cannot pop the last level")
			require.Equal(t, Statistics{0, 0, 120, 12, 130, 13}, r.Stats())
			require.Equal(t, 1, r.Depth())
		})
	}
}

// librmm's Nested: a push hides what is below it; a pop folds the level back in.
func TestStatisticsNested(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 30)
	r := adpNewStats(t, sim)
	a0 := adpAlloc(t, r, 10*miB)
	require.Equal(t, Statistics{10 * miB, 1, 10 * miB, 1, 10 * miB, 1}, r.Stats())
	st := r.PushCounters()
	require.Equal(t, int64(10*miB), st.CurrentBytes)
	require.Equal(t, int64(1), st.CurrentCount)
	require.Equal(t, Statistics{}, r.Stats())
	a1 := adpAlloc(t, r, 10*miB)
	r.PushCounters()
	require.Equal(t, Statistics{}, r.Stats())
	a2 := adpAlloc(t, r, 10*miB)
	adpFree(t, r, a2, 10*miB)
	require.Equal(t, Statistics{0, 0, 10 * miB, 1, 10 * miB, 1}, r.Stats())
	st, err := r.PopCounters()
	require.NoError(t, err)
	require.Equal(t, Statistics{0, 0, 10 * miB, 1, 10 * miB, 1}, st)
	adpFree(t, r, a0, 10*miB)
	st, err = r.PopCounters()
	require.NoError(t, err)
	require.Equal(t, Statistics{0, 0, 20 * miB, 2, 20 * miB, 2}, st)
	adpFree(t, r, a1, 10*miB)
	_, err = r.PopCounters()
	require.ErrorIs(t, err, ErrOutOfRange)
	require.Equal(t, Statistics{0, 0, 30 * miB, 3, 30 * miB, 3}, r.Stats(), "a0, a1 and a2 were live at once")
}

// librmm's MultiTracking: an adaptor over an adaptor; each counts what goes through it.
func TestStatisticsStackedAdaptors(t *testing.T) {
	for _, u := range adpUpstreams() {
		t.Run(u.name, func(t *testing.T) {
			outer := adpNewStats(t, u.new())
			var ps []DevicePtr
			for range 10 {
				ps = append(ps, adpAlloc(t, outer, 10*kiB))
			}
			inner := adpNewStats(t, outer)
			var qs []DevicePtr
			for range 5 {
				qs = append(qs, adpAlloc(t, inner, 10*kiB))
			}
			require.Equal(t, Statistics{150 * kiB, 15, 150 * kiB, 15, 150 * kiB, 15}, outer.Stats())
			require.Equal(t, Statistics{50 * kiB, 5, 50 * kiB, 5, 50 * kiB, 5}, inner.Stats())
			for _, p := range ps {
				adpFree(t, outer, p, 10*kiB)
			}
			for _, q := range qs {
				adpFree(t, inner, q, 10*kiB)
			}
			require.Equal(t, Statistics{0, 0, 150 * kiB, 15, 150 * kiB, 15}, outer.Stats())
			require.Equal(t, Statistics{0, 0, 50 * kiB, 5, 50 * kiB, 5}, inner.Stats())
		})
	}
}

// librmm's NegativeInnerTracking: memory from the outer adaptor freed through the inner one
// takes the inner counts below zero; the outer adaptor still sees every free.
func TestStatisticsNegativeInnerCounts(t *testing.T) {
	for _, u := range adpUpstreams() {
		t.Run(u.name, func(t *testing.T) {
			outer := adpNewStats(t, u.new())
			var ps []DevicePtr
			for range 10 {
				ps = append(ps, adpAlloc(t, outer, 10*kiB))
			}
			inner := adpNewStats(t, outer)
			for range 5 {
				ps = append(ps, adpAlloc(t, inner, 10*kiB))
			}
			for _, p := range ps {
				adpFree(t, inner, p, 10*kiB)
			}
			require.Equal(t, Statistics{0, 0, 150 * kiB, 15, 150 * kiB, 15}, outer.Stats())
			require.Equal(t, Statistics{-100 * kiB, -10, 50 * kiB, 5, 50 * kiB, 5}, inner.Stats())
		})
	}
}

func TestStatisticsZeroBytesFailuresAndBadSizes(t *testing.T) {
	up := newAdpFaultUpstream(NewSystemMemoryResource())
	r := adpNewStats(t, up)

	// A zero-byte allocation counts as an allocation of 0 bytes, and its free counts it off.
	p, err := r.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, p)
	require.Equal(t, Statistics{0, 1, 0, 1, 0, 1}, r.Stats())
	adpFree(t, r, 0, 0)
	require.Equal(t, Statistics{0, 0, 0, 1, 0, 1}, r.Stats())

	// Bytes are the size asked, not rounded.
	q := adpAlloc(t, r, 1)
	require.Equal(t, Statistics{1, 1, 1, 1, 1, 2}, r.Stats())

	// A failed allocation changes nothing and returns the upstream's error.
	up.failNextAllocs(1, nil)
	_, err = r.Allocate(4096, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Equal(t, Statistics{1, 1, 1, 1, 1, 2}, r.Stats())

	// Negative sizes are refused before the upstream.
	allocs, frees := up.callCounts()
	_, err = r.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, r.Deallocate(q, -1, DefaultStream), ErrInvalidArgument)
	allocs2, frees2 := up.callCounts()
	require.Equal(t, allocs, allocs2)
	require.Equal(t, frees, frees2)
	require.Equal(t, Statistics{1, 1, 1, 1, 1, 2}, r.Stats())

	// A free the upstream refuses leaves the counts as they were.
	up.failNextFrees(1)
	require.ErrorIs(t, r.Deallocate(q, 1, DefaultStream), errAdpInjected)
	require.Equal(t, Statistics{1, 1, 1, 1, 1, 2}, r.Stats())
	adpFree(t, r, q, 1)
	require.Equal(t, Statistics{0, 0, 1, 1, 1, 2}, r.Stats())
}

// Deallocate counts down before it calls the upstream: while a free is held inside the upstream
// (after the address was freed), the counts already show it gone, and another goroutine's
// allocation of the same address counts once. librmm's MultiThreaded, sizes 0 and 256.
func TestStatisticsFreeCountsDownBeforeUpstream(t *testing.T) {
	for _, size := range []int{0, 256} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			up := newAdpReuseUpstream()
			r := adpNewStats(t, up)
			p0, p1, errs := adpInterleave(r, up, size, func() {
				// Goroutine 0 is still inside its free: nothing is outstanding.
				st := r.Stats()
				assert.Zero(t, st.CurrentBytes)
				assert.Zero(t, st.CurrentCount)
			})
			for _, err := range errs {
				require.NoError(t, err)
			}
			if size > 0 {
				require.Equal(t, p0, p1, "the upstream handed the freed address out again")
			}
			require.Equal(t, Statistics{0, 0, int64(size), 1, 2 * int64(size), 2}, r.Stats())
		})
	}
}

// Many goroutines allocate and free the same size over an upstream that reuses addresses, while
// another pushes and pops levels: after the last pop the bottom level holds exact figures.
func TestStatisticsConcurrent(t *testing.T) {
	up := newAdpReuseUpstream()
	r := adpNewStats(t, up)
	const goroutines, rounds, size = 8, 2000, 256
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var pusherErr error
	var pusher sync.WaitGroup
	pusher.Add(1)
	go func() {
		defer pusher.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			r.PushCounters()
			if _, err := r.PopCounters(); err != nil {
				pusherErr = err
				return
			}
		}
	}()
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			held := []DevicePtr{}
			for range rounds {
				if len(held) < 4 && (len(held) == 0 || rng.IntN(2) == 0) {
					p, err := r.Allocate(size, DefaultStream)
					if !assert.NoError(t, err) {
						return
					}
					held = append(held, p)
				} else {
					p := held[len(held)-1]
					held = held[:len(held)-1]
					if !assert.NoError(t, r.Deallocate(p, size, DefaultStream)) {
						return
					}
				}
			}
			for _, p := range held {
				assert.NoError(t, r.Deallocate(p, size, DefaultStream))
			}
		}()
	}
	wg.Wait()
	close(stop)
	pusher.Wait()
	require.NoError(t, pusherErr)
	require.Equal(t, 1, r.Depth())
	st := r.Stats()
	require.Zero(t, st.CurrentBytes)
	require.Zero(t, st.CurrentCount)
	require.Equal(t, st.TotalCount*size, st.TotalBytes)
	require.Positive(t, st.TotalCount)
	require.LessOrEqual(t, st.PeakCount, int64(goroutines*4))
	require.Equal(t, st.PeakCount*size, st.PeakBytes)
	live, reused := up.counts()
	require.Zero(t, live)
	require.Positive(t, reused)
}

func TestStatisticsForwarding(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 20)
	r := adpNewStats(t, sim)
	require.Equal(t, Access(0), r.Access())
	require.Equal(t, CurrentDevice(), r.Device())
	require.Same(t, sim, r.Upstream())
	sys := adpNewStats(t, NewSystemMemoryResource())
	require.Equal(t, AccessOf(NewSystemMemoryResource()), sys.Access())
	require.NotZero(t, sys.Access()&HostAccessible)
}

// adpSwapCurrent makes mr the current device resource for the rest of the test.
func adpSwapCurrent(t *testing.T, mr MemoryResource) {
	t.Helper()
	prev := SetCurrentDeviceResource(mr)
	t.Cleanup(func() { SetCurrentDeviceResource(prev) })
}

// The package helpers, as rmm.statistics: disabled, enabled (idempotent), push and pop; the
// sequence of librmm's Python test_current_statistics with buffers of 10 and 20 bytes.
func TestStatisticsPackageHelpers(t *testing.T) {
	base := NewSystemMemoryResource()
	adpSwapCurrent(t, base)

	_, ok := GetStatistics()
	require.False(t, ok)
	_, ok = PushStatistics()
	require.False(t, ok)
	_, err := PopStatistics()
	require.ErrorIs(t, err, ErrNotSupported)
	require.Same(t, base, CurrentDeviceResource())

	r := EnableStatistics()
	require.Same(t, r, CurrentDeviceResource())
	require.Same(t, base, r.Upstream())
	require.Same(t, r, EnableStatistics(), "EnableStatistics is idempotent")
	require.Same(t, base, r.Upstream())

	mr := CurrentDeviceResource()
	b1 := adpAlloc(t, mr, 10)
	st, ok := GetStatistics()
	require.True(t, ok)
	require.Equal(t, Statistics{10, 1, 10, 1, 10, 1}, st)
	b2 := adpAlloc(t, mr, 20)
	st, ok = PushStatistics()
	require.True(t, ok)
	require.Equal(t, Statistics{30, 2, 30, 2, 30, 2}, st)
	adpFree(t, mr, b1, 10)
	st, err = PopStatistics()
	require.NoError(t, err)
	require.Equal(t, Statistics{-10, -1, 0, 0, 0, 0}, st)
	adpFree(t, mr, b2, 20)
	st, ok = GetStatistics()
	require.True(t, ok)
	require.Equal(t, Statistics{0, 0, 30, 2, 30, 2}, st)
	_, err = PopStatistics()
	require.ErrorIs(t, err, ErrOutOfRange)
}

// WithStatistics, as librmm's Python test_context: a temporary adaptor when statistics are off,
// a pushed level when they are on; the previous resource comes back.
func TestWithStatistics(t *testing.T) {
	base := NewSystemMemoryResource()
	adpSwapCurrent(t, base)

	var b1, b2 DevicePtr
	var inner Statistics
	outer, err := WithStatistics(func() {
		r, ok := CurrentDeviceResource().(*StatisticsResourceAdaptor)
		require.True(t, ok)
		require.Same(t, base, r.Upstream())
		b1 = adpAlloc(t, r, 20)
		st, _ := GetStatistics()
		require.Equal(t, Statistics{20, 1, 20, 1, 20, 1}, st)
		var err error
		inner, err = WithStatistics(func() {
			require.Same(t, r, CurrentDeviceResource(), "an enabled adaptor is reused")
			require.Equal(t, 2, r.Depth())
			b2 = adpAlloc(t, r, 10)
			st, _ := GetStatistics()
			require.Equal(t, Statistics{10, 1, 10, 1, 10, 1}, st)
		})
		require.NoError(t, err)
		require.Equal(t, 1, r.Depth())
		st, _ = GetStatistics()
		require.Equal(t, Statistics{30, 2, 30, 2, 30, 2}, st)
		adpFree(t, r, b1, 20)
		adpFree(t, r, b2, 10)
	})
	require.NoError(t, err)
	require.Equal(t, Statistics{10, 1, 10, 1, 10, 1}, inner)
	require.Equal(t, Statistics{0, 0, 30, 2, 30, 2}, outer)
	require.Same(t, base, CurrentDeviceResource(), "the previous resource is back")
	_, ok := GetStatistics()
	require.False(t, ok)
}

func TestWithStatisticsMisuse(t *testing.T) {
	base := NewSystemMemoryResource()
	adpSwapCurrent(t, base)

	// The current resource changed inside: error; the resource is left as set.
	other := NewSystemMemoryResource()
	_, err := WithStatistics(func() { SetCurrentDeviceResource(other) })
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "changed")
	require.Same(t, other, CurrentDeviceResource())

	// Enabled: the pushed level is popped even though the resource changed.
	r := EnableStatistics()
	_, err = WithStatistics(func() { SetCurrentDeviceResource(base) })
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Equal(t, 1, r.Depth())
	SetCurrentDeviceResource(r)

	// Unbalanced pushes inside: error; the scope's own level is removed, the one pushed inside
	// stays.
	_, err = WithStatistics(func() { PushStatistics() })
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Equal(t, 2, r.Depth())
	_, _ = r.PopCounters()

	// A panic inside still pops, and the panic goes on.
	func() {
		defer func() { require.Equal(t, "boom", recover()) }()
		_, _ = WithStatistics(func() {
			adpFree(t, r, adpAlloc(t, r, 100), 100)
			panic("boom")
		})
	}()
	require.Equal(t, 1, r.Depth())
	require.Equal(t, int64(100), r.Stats().TotalBytes)
}

func TestStatisticsNoAllocationPerCall(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 30)
	r := adpNewStats(t, sim)
	p := adpAlloc(t, r, 4096)
	adpFree(t, r, p, 4096)
	n := testing.AllocsPerRun(100, func() {
		p, err := r.Allocate(4096, DefaultStream)
		if err != nil {
			panic(err)
		}
		if err := r.Deallocate(p, 4096, DefaultStream); err != nil {
			panic(err)
		}
	})
	require.Zero(t, n)
}

// Overlapping scopes (not nested): each removes its own level; the base level keeps counting.
func TestStatisticsOverlappingScopes(t *testing.T) {
	base := CurrentDeviceResource()
	defer SetCurrentDeviceResource(base)
	SetCurrentDeviceResource(NewSystemMemoryResource())
	r := EnableStatistics()
	p, err := r.Allocate(1000, DefaultStream)
	require.NoError(t, err)
	prof := NewProfiler()
	stopA := prof.Start("A")
	stopB := prof.Start("B")
	require.ErrorIs(t, stopA(), ErrInvalidArgument, "A ends while B is open")
	require.NoError(t, stopB())
	require.Equal(t, 1, r.Depth())
	st, ok := GetStatistics()
	require.True(t, ok)
	require.Equal(t, int64(1000), st.CurrentBytes)
	require.NoError(t, r.Deallocate(p, 1000, DefaultStream))

	// WithStatistics installing a temporary adaptor puts the previous resource back even when
	// the scope ends in an error.
	plain := NewSystemMemoryResource()
	SetCurrentDeviceResource(plain)
	_, err = WithStatistics(func() { PushStatistics() })
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Same(t, plain, CurrentDeviceResource())
}

func TestStatisticsString(t *testing.T) {
	s := Statistics{CurrentBytes: 4096, CurrentCount: 1, PeakBytes: 8192, PeakCount: 2, TotalBytes: 12288, TotalCount: 3}
	require.Equal(t, "current 4096 bytes in 1, peak 8192 bytes in 2, total 12288 bytes in 3", s.String())
}
