package rmm

import (
	"errors"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

func adpNewLimiting(t *testing.T, up MemoryResource, limit int, opts *LimitingOptions) *LimitingResourceAdaptor {
	t.Helper()
	r, err := NewLimitingResourceAdaptor(up, limit, opts)
	require.NoError(t, err)
	return r
}

func TestLimitingOptions(t *testing.T) {
	_, err := NewLimitingResourceAdaptor(nil, -1, nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	for _, a := range []int{-256, 3, 255, 768} {
		_, err = NewLimitingResourceAdaptor(nil, 1<<20, &LimitingOptions{Alignment: a})
		require.ErrorIs(t, err, ErrInvalidArgument, "alignment %d", a)
	}
	r := adpNewLimiting(t, nil, 1<<20, nil)
	require.Equal(t, 1<<20, r.AllocationLimit())
	require.Equal(t, 256, r.Alignment())
	require.Zero(t, r.AllocatedBytes())
	require.Same(t, CurrentDeviceResource(), r.Upstream())
	r = adpNewLimiting(t, nil, 0, &LimitingOptions{Alignment: 4096})
	require.Equal(t, 4096, r.Alignment())
}

// librmm's limiting tests: limit+1 is refused; exactly the limit fits; the counter is exact,
// unchanged by a refusal, and frees restore the headroom.
func TestLimitingAccounting(t *testing.T) {
	const limit = 10 * miB
	for _, u := range adpUpstreams() {
		t.Run(u.name, func(t *testing.T) {
			r := adpNewLimiting(t, u.new(), limit, nil)

			_, err := r.Allocate(limit+1, DefaultStream)
			require.ErrorIs(t, err, ErrOutOfMemory)
			require.ErrorContains(t, err, "exceeded memory limit")
			require.ErrorContains(t, err, "limit 10485760, allocated 0")
			require.ErrorContains(t, err, "failed to allocate 10485761 bytes")
			require.Zero(t, r.AllocatedBytes())

			p := adpAlloc(t, r, limit)
			require.Equal(t, limit, r.AllocatedBytes())
			_, err = r.Allocate(1, DefaultStream)
			require.ErrorIs(t, err, ErrOutOfMemory)
			require.Equal(t, limit, r.AllocatedBytes(), "a refusal leaves the counter")
			adpFree(t, r, p, limit)
			require.Zero(t, r.AllocatedBytes())

			// Each allocation is charged its size rounded up to 256.
			sizes := []int{1, 255, 256, 257, 1000, 4096, 1 << 20}
			var ps []DevicePtr
			want := 0
			for _, n := range sizes {
				ps = append(ps, adpAlloc(t, r, n))
				want += roundUp(n)
				require.Equal(t, want, r.AllocatedBytes())
			}
			require.Equal(t, 256+256+256+512+1024+4096+1<<20, want)
			// Zero bytes are free.
			adpAlloc(t, r, 0)
			require.Equal(t, want, r.AllocatedBytes())
			// The headroom is the limit less the charges: the rest fits exactly, one more byte not.
			q := adpAlloc(t, r, limit-want)
			_, err = r.Allocate(1, DefaultStream)
			require.ErrorIs(t, err, ErrOutOfMemory)
			adpFree(t, r, q, limit-want)
			for i, n := range sizes {
				adpFree(t, r, ps[i], n)
				want -= roundUp(n)
				require.Equal(t, want, r.AllocatedBytes())
			}
			require.Zero(t, r.AllocatedBytes())
			p = adpAlloc(t, r, limit)
			adpFree(t, r, p, limit)
		})
	}
}

func TestLimitingChargeAlignment(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 30)
	r := adpNewLimiting(t, sim, 3*4096, &LimitingOptions{Alignment: 4096})
	p := adpAlloc(t, r, 1)
	require.Equal(t, 4096, r.AllocatedBytes(), "a 1-byte allocation costs the alignment")
	q := adpAlloc(t, r, 4097)
	require.Equal(t, 3*4096, r.AllocatedBytes())
	_, err := r.Allocate(1, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	adpFree(t, r, p, 1)
	adpFree(t, r, q, 4097)
	require.Zero(t, r.AllocatedBytes())

	// A size whose charge overflows is refused.
	_, err = r.Allocate(int(^uint(0)>>1), DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Zero(t, r.AllocatedBytes())
}

// Nested limits: 2 MiB under 5 MiB refuses 4 MiB, and so does 5 MiB over 2 MiB (the inner
// adaptor's charge is rolled back when the outer one refuses).
func TestLimitingNested(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 30)
	outer := adpNewLimiting(t, sim, 5*miB, nil)
	inner := adpNewLimiting(t, outer, 2*miB, nil)
	_, err := inner.Allocate(4*miB, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Zero(t, inner.AllocatedBytes())
	require.Zero(t, outer.AllocatedBytes())
	p := adpAlloc(t, inner, 2*miB)
	require.Equal(t, 2*miB, inner.AllocatedBytes())
	require.Equal(t, 2*miB, outer.AllocatedBytes())
	adpFree(t, inner, p, 2*miB)

	low := adpNewLimiting(t, sim, 2*miB, nil)
	high := adpNewLimiting(t, low, 5*miB, nil)
	_, err = high.Allocate(4*miB, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Zero(t, high.AllocatedBytes(), "the upstream's refusal rolls the charge back")
	require.Zero(t, low.AllocatedBytes())
	require.Zero(t, sim.UsedBytes())
}

func TestLimitingUpstreamErrors(t *testing.T) {
	up := newAdpFaultUpstream(NewSystemMemoryResource())
	r := adpNewLimiting(t, up, 1*miB, nil)
	up.failNextAllocs(1, errAdpInjected)
	_, err := r.Allocate(1000, DefaultStream)
	require.ErrorIs(t, err, errAdpInjected, "the upstream's error is returned unchanged")
	require.Zero(t, r.AllocatedBytes())

	p := adpAlloc(t, r, 1000)
	up.failNextFrees(1)
	require.ErrorIs(t, r.Deallocate(p, 1000, DefaultStream), errAdpInjected)
	require.Equal(t, 1024, r.AllocatedBytes(), "a refused free keeps the charge")
	adpFree(t, r, p, 1000)
	require.Zero(t, r.AllocatedBytes())

	_, err = r.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, r.Deallocate(p, -1, DefaultStream), ErrInvalidArgument)
	require.Zero(t, r.AllocatedBytes())
}

// adpPeakUpstream records the most bytes (rounded to 256) it has had live at once.
type adpPeakUpstream struct {
	inner      MemoryResource
	live, peak atomic.Int64
}

func (u *adpPeakUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	p, err := u.inner.Allocate(n, s)
	if err == nil {
		v := u.live.Add(int64(roundUp(n)))
		for {
			old := u.peak.Load()
			if v <= old || u.peak.CompareAndSwap(old, v) {
				break
			}
		}
	}
	return p, err
}

func (u *adpPeakUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	u.live.Add(-int64(roundUp(n)))
	return u.inner.Deallocate(p, n, s)
}

// Many goroutines allocating near the limit: the upstream never holds more than the limit, and
// everything ends at zero.
func TestLimitingConcurrent(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 30)
	up := &adpPeakUpstream{inner: sim}
	const limit = 64 * kiB
	r := adpNewLimiting(t, up, limit, nil)
	var refused atomic.Int64
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 2000 {
				n := 1 + (g*7919+i*104729)%(16*kiB)
				p, err := r.Allocate(n, DefaultStream)
				if err != nil {
					refused.Add(1)
					continue
				}
				if err := r.Deallocate(p, n, DefaultStream); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	require.Zero(t, r.AllocatedBytes())
	require.LessOrEqual(t, up.peak.Load(), int64(limit))
	require.Zero(t, up.live.Load())
	t.Logf("refused %d of %d", refused.Load(), 8*2000)
}

func TestLimitingForwarding(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 20)
	r := adpNewLimiting(t, sim, 1<<20, nil)
	require.Same(t, sim, r.Upstream())
	require.Equal(t, Access(0), r.Access())
	require.Equal(t, CurrentDevice(), r.Device())
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

// limFlakyUpstream forwards to inner but fails every every-th allocation (counted across all
// goroutines) with errAdpInjected.
type limFlakyUpstream struct {
	inner  MemoryResource
	every  int64
	calls  atomic.Int64
	failed atomic.Int64
}

func (u *limFlakyUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	if u.calls.Add(1)%u.every == 0 {
		u.failed.Add(1)
		return 0, errAdpInjected
	}
	return u.inner.Allocate(n, s)
}

func (u *limFlakyUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	return u.inner.Deallocate(p, n, s)
}

// limRaceRounds makes three goroutines each allocate 5 MiB under a 12 MiB limit at the same
// moment, rounds times, while a fourth reads AllocatedBytes in a loop. Each round the three are
// released together and spin until all three are running before they allocate. check is given
// each round's results (nil error: success); the successes are then freed. It returns the
// largest figure the reader saw and how many reads it made.
func limRaceRounds(t *testing.T, r *LimitingResourceAdaptor, rounds int, check func(round int, errs [3]error)) (maxSeen, reads int64) {
	t.Helper()
	const n = 5 * miB
	var stop atomic.Bool
	var seen, count atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for !stop.Load() {
			if v := int64(r.AllocatedBytes()); v > seen.Load() {
				seen.Store(v)
			}
			count.Add(1)
		}
	}()
	for round := range rounds {
		var ptrs [3]DevicePtr
		var errs [3]error
		var arrived atomic.Int32
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				arrived.Add(1)
				for arrived.Load() < 3 {
					runtime.Gosched()
				}
				ptrs[i], errs[i] = r.Allocate(n, DefaultStream)
			}()
		}
		close(start)
		wg.Wait()
		check(round, errs)
		for i, err := range errs {
			if err == nil {
				require.NoError(t, r.Deallocate(ptrs[i], n, DefaultStream))
			}
		}
		require.Zero(t, r.AllocatedBytes(), "round %d", round)
		if t.Failed() {
			break
		}
	}
	stop.Store(true)
	<-done
	return seen.Load(), count.Load()
}

// Three allocations of 5 MiB race under a 12 MiB limit: exactly two succeed each round, the third
// is refused, and no reader ever sees the count above the limit (a refused charge is never added).
func TestLimitingRaceReaderNeverAboveLimit(t *testing.T) {
	const limit = 12 * miB
	sim, err := NewSimulatedMemoryResource(1 << 30)
	require.NoError(t, err)
	r := adpNewLimiting(t, sim, limit, nil)
	maxSeen, reads := limRaceRounds(t, r, 10000, func(round int, errs [3]error) {
		ok, refused := 0, 0
		for _, err := range errs {
			switch {
			case err == nil:
				ok++
			case errors.Is(err, ErrOutOfMemory):
				refused++
			default:
				t.Errorf("round %d: unexpected error %v", round, err)
			}
		}
		if ok != 2 || refused != 1 {
			t.Errorf("round %d: %d succeeded, %d refused; want 2 and 1", round, ok, refused)
		}
	})
	t.Logf("reader: %d reads, largest figure %d", reads, maxSeen)
	require.Greater(t, reads, int64(0))
	require.LessOrEqual(t, maxSeen, int64(limit), "the reader saw the count above the limit")
	require.Zero(t, sim.UsedBytes())
}

// The same race over an upstream that fails every fifth allocation: a charge whose upstream call
// fails is rolled back, the count never passes the limit, and each round at most two succeed and
// at most one is refused by the limit.
func TestLimitingRaceFailingUpstream(t *testing.T) {
	const limit = 12 * miB
	sim, err := NewSimulatedMemoryResource(1 << 30)
	require.NoError(t, err)
	up := &limFlakyUpstream{inner: sim, every: 5}
	r := adpNewLimiting(t, up, limit, nil)
	var upstreamFailures int64
	maxSeen, _ := limRaceRounds(t, r, 5000, func(round int, errs [3]error) {
		ok, refused := 0, 0
		for _, err := range errs {
			switch {
			case err == nil:
				ok++
			case errors.Is(err, errAdpInjected):
				upstreamFailures++
			case errors.Is(err, ErrOutOfMemory):
				refused++
			default:
				t.Errorf("round %d: unexpected error %v", round, err)
			}
		}
		if ok > 2 || refused > 1 {
			t.Errorf("round %d: %d succeeded, %d refused by the limit", round, ok, refused)
		}
	})
	require.Equal(t, up.failed.Load(), upstreamFailures, "every upstream failure is returned as is")
	require.Greater(t, upstreamFailures, int64(100))
	require.LessOrEqual(t, maxSeen, int64(limit))
	require.Zero(t, r.AllocatedBytes())
	require.Zero(t, sim.UsedBytes())
}

// Charges near the top of int: the sum of the charges never wraps, a refused request leaves the
// counter, and the headroom is exact to the byte.
func TestLimitingOverflow(t *testing.T) {
	r := adpNewLimiting(t, &adpNullUpstream{}, math.MaxInt, nil)
	p := adpAlloc(t, r, 1<<62)
	// 2^62 + 2^62 = 2^63 is one past MaxInt.
	_, err := r.Allocate(1<<62, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Equal(t, 1<<62, r.AllocatedBytes())
	q := adpAlloc(t, r, 1<<62-256)
	require.Equal(t, math.MaxInt-255, r.AllocatedBytes())
	// 255 bytes of headroom left: a 1-byte allocation is charged 256.
	_, err = r.Allocate(1, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	_, err = r.Allocate(math.MaxInt-255, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	// A size whose rounding overflows: larger than any limit, even MaxInt with nothing allocated.
	_, err = r.Allocate(math.MaxInt, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Equal(t, math.MaxInt-255, r.AllocatedBytes())
	var oom *OutOfMemoryError
	empty := adpNewLimiting(t, &adpNullUpstream{}, math.MaxInt, nil)
	_, err = empty.Allocate(math.MaxInt, DefaultStream)
	require.ErrorAs(t, err, &oom)
	require.True(t, oom.TooLarge)
	require.False(t, oom.Fragmented)
	require.Equal(t, math.MaxInt, oom.Headroom)
	z := adpAlloc(t, r, 0)
	require.Zero(t, z)
	adpFree(t, r, q, 1<<62-256)
	adpFree(t, r, p, 1<<62)
	require.Zero(t, r.AllocatedBytes())

	// A limit of 0 takes only zero-byte requests.
	zero := adpNewLimiting(t, &adpNullUpstream{}, 0, nil)
	_, err = zero.Allocate(1, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	z = adpAlloc(t, zero, 0)
	require.Zero(t, z)
	require.Zero(t, zero.AllocatedBytes())
}

// The refusal is an *OutOfMemoryError with the limit's figures; its message names the limit and
// the bytes allocated.
func TestLimitingOutOfMemoryError(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 30)
	r := adpNewLimiting(t, sim, 1<<20, nil)
	p := adpAlloc(t, r, 700_000)
	_, err := r.Allocate(500_000, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	require.Equal(t, OutOfMemoryError{
		Resource:    "LimitingResourceAdaptor",
		Requested:   500_000,
		PoolSize:    700_160,
		MaximumSize: 1 << 20,
		Headroom:    1<<20 - 700_160,
		Limited:     true,
		Detail:      "exceeded memory limit",
	}, *oom)
	require.EqualError(t, err, "rmm: LimitingResourceAdaptor.Allocate (limit 1048576, allocated 700160): failed to allocate 500000 bytes (488.281 KiB): exceeded memory limit: out of memory")
	require.Nil(t, errors.Unwrap(err), "no upstream error behind a refusal")

	// Larger than the limit itself: TooLarge, and the message says so.
	_, err = r.Allocate(1<<20+1, DefaultStream)
	require.ErrorAs(t, err, &oom)
	require.True(t, oom.TooLarge)
	require.False(t, oom.Fragmented)
	require.Equal(t, 1<<20+1, oom.Requested)
	require.ErrorContains(t, err, "(limit 1048576, allocated 700160): failed to allocate 1048577 bytes")
	require.ErrorContains(t, err, "exceeded memory limit; the request is larger than the limit")
	_, err = r.Allocate(math.MaxInt, DefaultStream)
	require.ErrorAs(t, err, &oom)
	require.True(t, oom.TooLarge)
	require.ErrorIs(t, err, ErrOutOfMemory)

	// The upstream's own out of memory passes through unchanged (not made a limit error).
	small, _ := NewSimulatedMemoryResource(1 << 20)
	r2 := adpNewLimiting(t, small, 1<<30, nil)
	_, err = r2.Allocate(2<<20, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	if errors.As(err, &oom) {
		require.False(t, oom.Limited, "%v", err)
	}
	require.Zero(t, r2.AllocatedBytes())
	adpFree(t, r, p, 700_000)
}

// A free with a larger size than allocated, which an upstream that does not check sizes accepts,
// takes the count below zero; the limit check must still not overflow, so that under a limit of
// MaxInt a later allocation is not refused.
func TestLimitingNegativeCountDoesNotOverflow(t *testing.T) {
	up, err := NewTrackingResourceAdaptor(NewSystemMemoryResource(), nil)
	require.NoError(t, err)
	lim, err := NewLimitingResourceAdaptor(up, math.MaxInt, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := lim.Allocate(1, DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	if err := lim.Deallocate(p, 1<<20, DefaultStream); err != nil {
		t.Fatal(err)
	}
	if got := lim.AllocatedBytes(); got >= 0 {
		t.Fatalf("AllocatedBytes = %d after a free larger than the allocation, want below zero (the test relies on it)", got)
	}
	q, err := lim.Allocate(1, DefaultStream)
	if err != nil {
		t.Fatalf("Allocate(1) under a limit of MaxInt with the count below zero: %v", err)
	}
	if err := lim.Deallocate(q, 1, DefaultStream); err != nil {
		t.Fatal(err)
	}
}
