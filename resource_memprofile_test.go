package rmm

import (
	"bytes"
	"fmt"
	"io"
	"math"
	"math/bits"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/google/pprof/profile"
	"github.com/gormm/rmm/internal/fpwalk"
	"github.com/stretchr/testify/require"
)

// memProfNew returns a MemoryProfileResourceAdaptor over up at rate; a seed other than 0 makes
// its draws reproducible (see testRand).
func memProfNew(t testing.TB, up MemoryResource, rate int, seed uint64) *MemoryProfileResourceAdaptor {
	t.Helper()
	r, err := NewMemoryProfileResourceAdaptor(up, &MemoryProfileOptions{Rate: rate})
	require.NoError(t, err)
	if seed != 0 {
		r.testRand = rand.New(rand.NewPCG(seed, seed^0x5eed))
	}
	return r
}

// memProfParse writes r's profile and reads it back, checking that it is well formed and shaped
// as Go's heap profile.
func memProfParse(t *testing.T, r memProfSource) *profile.Profile {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, r.WriteProfile(&buf))
	p, err := profile.Parse(&buf)
	require.NoError(t, err)
	require.NoError(t, p.CheckValid())
	var types []string
	for _, st := range p.SampleType {
		types = append(types, st.Type+"/"+st.Unit)
	}
	require.Equal(t, []string{"alloc_objects/count", "alloc_space/bytes", "inuse_objects/count", "inuse_space/bytes"}, types)
	require.Equal(t, "inuse_space", p.DefaultSampleType)
	require.Equal(t, "space", p.PeriodType.Type)
	require.Equal(t, "bytes", p.PeriodType.Unit)
	require.Equal(t, int64(r.Rate()), p.Period)
	return p
}

// memProfSource is a MemoryProfile or a MemoryProfileResourceAdaptor.
type memProfSource interface {
	WriteProfile(io.Writer) error
	Rate() int
}

// memProfTotals sums the four values of p's samples of allocations of size bytes (all sizes
// when size is 0): alloc_objects, alloc_space, inuse_objects, inuse_space.
func memProfTotals(p *profile.Profile, size int64) [4]int64 {
	var v [4]int64
	for _, s := range p.Sample {
		if size != 0 && s.NumLabel["bytes"][0] != size {
			continue
		}
		for i := range v {
			v[i] += s.Value[i]
		}
	}
	return v
}

// memProfEmpty checks that r holds no record of a sampled block.
func memProfEmpty(t *testing.T, r *MemoryProfileResourceAdaptor) {
	t.Helper()
	for i := range r.shards {
		sh := &r.shards[i]
		sh.mu.Lock()
		n := sh.live.n
		sh.mu.Unlock()
		require.Zero(t, n, "shard %d", i)
	}
	for i := range r.maybe {
		require.Zero(t, r.maybe[i].Load(), "slot %d", i)
	}
}

// A shard fills a cache line exactly, so that shards used by different goroutines share none.
func TestMemoryProfileShardSize(t *testing.T) {
	require.Equal(t, uintptr(64), unsafe.Sizeof(memProfShard{}))
}

func TestMemoryProfileOptions(t *testing.T) {
	r, err := NewMemoryProfileResourceAdaptor(nil, nil)
	require.NoError(t, err)
	require.Equal(t, DefaultMemoryProfileRate, r.Rate())
	require.Equal(t, CurrentDeviceResource(), r.Upstream())

	r, err = NewMemoryProfileResourceAdaptor(nil, &MemoryProfileOptions{})
	require.NoError(t, err)
	require.Equal(t, DefaultMemoryProfileRate, r.Rate())

	r, err = NewMemoryProfileResourceAdaptor(nil, &MemoryProfileOptions{Rate: -1})
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "negative sampling rate -1")
	require.Nil(t, r)
}

// Negative sizes are refused before the upstream is asked; zero sizes are passed on and never
// sampled.
func TestMemoryProfileSizes(t *testing.T) {
	up := newAdpScriptUpstream()
	r := memProfNew(t, up, 1, 0)
	_, err := r.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, r.Deallocate(1<<40, -1, DefaultStream), ErrInvalidArgument)
	allocs, frees := up.calls()
	require.Empty(t, allocs)
	require.Empty(t, frees)

	p, err := r.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, p)
	require.NoError(t, r.Deallocate(0, 0, DefaultStream))
	allocs, frees = up.calls()
	require.Equal(t, []adpCall{{0, 0}}, allocs)
	require.Equal(t, []adpCall{{0, 0}}, frees)
	require.Empty(t, memProfParse(t, r).Sample)
}

// At rate 1 every allocation is recorded and the figures are exact; frees take blocks off the
// in-use figures only.
func TestMemoryProfileRateOneFrees(t *testing.T) {
	for _, u := range adpUpstreams() {
		t.Run(u.name, func(t *testing.T) {
			r := memProfNew(t, u.new(), 1, 0)
			var ps []DevicePtr
			for range 5 {
				ps = append(ps, adpAlloc(t, r, 3000))
			}
			q := adpAlloc(t, r, 100)
			require.Equal(t, [4]int64{6, 15100, 6, 15100}, memProfTotals(memProfParse(t, r), 0))
			for _, p := range ps[:3] {
				adpFree(t, r, p, 3000)
			}
			prof := memProfParse(t, r)
			require.Equal(t, [4]int64{5, 15000, 2, 6000}, memProfTotals(prof, 3000))
			require.Equal(t, [4]int64{1, 100, 1, 100}, memProfTotals(prof, 100))
			for _, p := range ps[3:] {
				adpFree(t, r, p, 3000)
			}
			adpFree(t, r, q, 100)
			require.Equal(t, [4]int64{6, 15100, 0, 0}, memProfTotals(memProfParse(t, r), 0))
			memProfEmpty(t, r)
		})
	}
}

// A free of a pointer the adaptor has no record of — never allocated, or freed already — is the
// upstream's to judge, and its error comes back unchanged.
func TestMemoryProfileUnknownAndDoubleFree(t *testing.T) {
	up := newAdpScriptUpstream()
	r := memProfNew(t, up, 1, 0)
	p := adpAlloc(t, r, 4096)
	adpFree(t, r, p, 4096)

	want := up.Deallocate(p, 4096, DefaultStream) // what the upstream says of a double free
	require.ErrorIs(t, want, ErrInvalidFree)
	err := r.Deallocate(p, 4096, DefaultStream)
	require.Equal(t, want.Error(), err.Error())
	require.ErrorIs(t, err, ErrInvalidFree)

	err = r.Deallocate(1<<50, 512, DefaultStream) // never allocated
	require.ErrorIs(t, err, ErrInvalidFree)
	require.Contains(t, err.Error(), "adpScriptUpstream: free of 0x4000000000000 with 512 bytes")

	_, frees := up.calls()
	require.Equal(t, []adpCall{{p, 4096}, {p, 4096}, {p, 4096}, {1 << 50, 512}}, frees)
	require.Equal(t, [4]int64{1, 4096, 0, 0}, memProfTotals(memProfParse(t, r), 0))
	memProfEmpty(t, r)
}

// The upstream's errors come back as they are: a failed allocation records nothing, a refused
// free keeps the block's record.
func TestMemoryProfileUpstreamErrors(t *testing.T) {
	up := newAdpFaultUpstream(newAdpScriptUpstream())
	r := memProfNew(t, up, 1, 0)

	up.failNextAllocs(1, errAdpInjected)
	p, err := r.Allocate(1000, DefaultStream)
	require.Same(t, errAdpInjected, err)
	require.Zero(t, p)
	up.failNextAllocs(1, nil)
	_, err = r.Allocate(1000, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Empty(t, memProfParse(t, r).Sample)
	memProfEmpty(t, r)

	p = adpAlloc(t, r, 1000)
	up.failNextFrees(1)
	require.Same(t, errAdpInjected, r.Deallocate(p, 1000, DefaultStream))
	require.Equal(t, [4]int64{1, 1000, 1, 1000}, memProfTotals(memProfParse(t, r), 0))
	adpFree(t, r, p, 1000)
	require.Equal(t, [4]int64{1, 1000, 0, 0}, memProfTotals(memProfParse(t, r), 0))
	memProfEmpty(t, r)
}

// A block freed behind the adaptor's back and handed out again is counted freed when its
// address is sampled anew.
func TestMemoryProfileFreedBehindItsBack(t *testing.T) {
	up := newAdpReuseUpstream()
	r := memProfNew(t, up, 1, 0)
	p := adpAlloc(t, r, 5000)
	require.NoError(t, up.Deallocate(p, 5000, DefaultStream))
	q := adpAlloc(t, r, 5000)
	require.Equal(t, p, q)
	require.Equal(t, [4]int64{2, 10000, 1, 5000}, memProfTotals(memProfParse(t, r), 0))
	adpFree(t, r, q, 5000)
	memProfEmpty(t, r)
}

// librmm's interleaving: the address freed by goroutine 0 is handed out again, allocated and
// freed by goroutine 1 while goroutine 0 is still inside the upstream's free. The record is
// dropped before the upstream's free, so the second allocation is recorded and freed on its own.
func TestMemoryProfileInterleaving(t *testing.T) {
	up := newAdpReuseUpstream()
	r := memProfNew(t, up, 1, 0)
	p0, p1, errs := adpInterleave(r, up, 4096, func() {
		require.Equal(t, [4]int64{2, 8192, 0, 0}, memProfTotals(memProfParse(t, r), 0))
	})
	require.Equal(t, p0, p1)
	require.Equal(t, [4]error{}, errs)
	require.Equal(t, [4]int64{2, 8192, 0, 0}, memProfTotals(memProfParse(t, r), 0))
	memProfEmpty(t, r)
}

// memProfBound is the half-width of the interval that holds an estimate k/q of n events, k of
// which are drawn with probability q each (binomially), with probability 1-2e-9 at least: six
// standard deviations of k/q, sqrt(n(1-q)/q). The estimates are further truncated to integers,
// as runtime/pprof's are: one unit more.
func memProfBound(n int, q float64) float64 {
	return 6*math.Sqrt(float64(n)*(1-q)/q) + 1
}

// memProfRequireCounts checks the object counts of size in pr against count allocations, live of
// them in use, each sampled with probability 1-exp(-size/rate), within memProfBound; it returns
// the four totals (memProfTotals) and the two bounds, for the caller's further checks.
func memProfRequireCounts(t *testing.T, pr *profile.Profile, size, count, live int, rate float64) (got [4]int64, b, bLive float64) {
	t.Helper()
	q := 1 - math.Exp(-float64(size)/rate)
	got = memProfTotals(pr, int64(size))
	b, bLive = memProfBound(count, q), memProfBound(live, q)
	t.Logf("size %d: q %.4f, alloc_objects %d of %d (bound ±%.0f), inuse_objects %d of %d (±%.0f)", size, q, got[0], count, b, got[2], live, bLive)
	require.InDelta(t, count, got[0], b, "alloc_objects, size %d", size)
	require.InDelta(t, live, got[2], bLive, "inuse_objects, size %d", size)
	return got, b, bLive
}

// memProfRateOne returns a new MemoryProfile that records every allocation.
func memProfRateOne(t *testing.T) *MemoryProfile {
	t.Helper()
	m, err := NewMemoryProfile(&MemoryProfileOptions{Rate: 1})
	require.NoError(t, err)
	return m
}

// Sampled: the scaled figures estimate the allocations made within a bound computed from the
// binomial distribution of the number of samples (memProfBound: six standard deviations, so a
// failure by chance has a probability under 1e-8). Each size is sampled with probability
// 1-exp(-size/rate) and scaled by its inverse, so the estimates of every size are unbiased; the
// in-use ones are estimates of the blocks left after every other block was freed. The seeded
// runs are reproducible; the unseeded one uses the adaptor's own random source.
func TestMemoryProfileSampledEstimates(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	const rate = 64 << 10
	sizes := []struct{ size, count int }{
		{4 << 10, 200_000}, // sampled with probability 0.061
		{48 << 10, 40_000}, // 0.53
		{1 << 20, 200},     // 1 - 1e-7: all of them, in all likelihood
	}
	for _, seed := range shortOrLong([]uint64{0, 1}, []uint64{0, 1, 2, 3}) {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { // 0: the adaptor's own source
			r := memProfNew(t, &adpNullUpstream{}, rate, seed)
			for _, sz := range sizes {
				ps := make([]DevicePtr, sz.count)
				for i := range ps {
					ps[i] = adpAlloc(t, r, sz.size)
				}
				for i := 0; i < len(ps); i += 2 {
					adpFree(t, r, ps[i], sz.size)
				}
			}
			prof := memProfParse(t, r)
			for _, sz := range sizes {
				live := sz.count / 2
				got, b, bLive := memProfRequireCounts(t, prof, sz.size, sz.count, live, rate)
				require.InDelta(t, sz.count*sz.size, got[1], b*float64(sz.size), "alloc_space, size %d", sz.size)
				require.InDelta(t, live*sz.size, got[3], bLive*float64(sz.size), "inuse_space, size %d", sz.size)
				// The values are the sampled counts scaled by 1/q, as runtime/pprof's
				// scaleHeapSample does (one bucket per size: one call site).
				for _, b := range r.snapshot() {
					if b.size == int64(sz.size) {
						k, scale := b.allocs.Load(), 1/(1-math.Exp(-float64(sz.size)/rate))
						require.Equal(t, int64(float64(k)*scale), got[0])
						require.Equal(t, int64(float64(k*b.size)*scale), got[1])
					}
				}
			}
		})
	}
}

// Every allocation of at least about 40 times the rate is sampled, and its scale is 1.
func TestMemoryProfileLargeAlwaysSampled(t *testing.T) {
	r := memProfNew(t, &adpNullUpstream{}, 1024, 0)
	for range 1000 {
		adpAlloc(t, r, 64<<10)
	}
	require.Equal(t, [4]int64{1000, 1000 * 64 << 10, 1000, 1000 * 64 << 10}, memProfTotals(memProfParse(t, r), 0))
}

// An allocation of n bytes is sampled when its variate u is below a threshold t(n), and t(n) is
// floor(2^64 p(n)), p(n) = 1-exp(-n/rate), to within float64's rounding of p(n): found by
// bisection over u, for rates and sizes from 1 byte to far beyond the rate, so that the bounds
// sample and sampleExact test before computing p(n) agree with it. Every u above
// n*ceil(2^64/rate) is above t(n). At rate 1 every u samples.
func TestMemoryProfileSampleThreshold(t *testing.T) {
	r1 := memProfNew(t, &adpNullUpstream{}, 1, 0)
	for _, n := range []uint64{1, 2, 256, 1 << 40, math.MaxInt64} {
		for _, u := range []uint64{0, 1 << 63, math.MaxUint64} {
			require.True(t, r1.sample(n, u), "rate 1, n %d, u %#x", n, u)
		}
	}
	for _, rate := range []int{2, 3, 1000, 64 << 10, 1<<20 + 1, 128 << 20, 1 << 40, 1<<62 + 12345} {
		r := memProfNew(t, &adpNullUpstream{}, rate, 0)
		step, rem := bits.Div64(1, 0, uint64(rate)) // 2^64/rate
		if rem != 0 {
			step++
		}
		require.Equal(t, step, r.step, "rate %d", rate)
		for _, n := range []uint64{1, 2, 255, 256, 4096, 1 << 20, 64 << 20, uint64(rate) / 16, uint64(rate) / 2, uint64(rate) - 1, uint64(rate), 2 * uint64(rate), 36 * uint64(rate), 40 * uint64(rate), math.MaxInt64} {
			if n == 0 || n > math.MaxInt64 {
				continue
			}
			// The least u not sampled, lo (got: 1 when all are).
			lo, hi := uint64(0), uint64(math.MaxUint64)
			got := 1.0
			if !r.sample(n, hi) {
				for lo < hi { // sample(n, hi) is false
					mid := lo + (hi-lo)/2
					if r.sample(n, mid) {
						lo = mid + 1
					} else {
						hi = mid
					}
				}
				got = float64(lo) * 0x1p-64
			}
			want := -math.Expm1(-float64(n) / float64(rate))
			require.InDelta(t, want, got, want*0x1p-50+0x1p-63, "rate %d, n %d", rate, n)
			if got == 1 {
				continue
			}
			// Monotone below and above the threshold.
			for _, d := range []uint64{1, 2, 1 << 20, 1 << 40} {
				if lo >= d {
					require.True(t, r.sample(n, lo-d), "rate %d, n %d, u t-%d", rate, n, d)
				}
				if lo+d > lo {
					require.False(t, r.sample(n, lo+d), "rate %d, n %d, u t+%d", rate, n, d)
				}
			}
			// The bound: nothing above n*step is sampled.
			if h, l := bits.Mul64(n, step); h == 0 {
				require.LessOrEqual(t, lo, l+1, "rate %d, n %d", rate, n)
				require.LessOrEqual(t, n, r.fastMax)
			} else {
				require.Greater(t, n, r.fastMax)
			}
		}
	}
}

// Allocate's test of the variate's top 32 bits alone (rejects) never rejects a variate that
// sample would sample, whatever its bottom 32 bits, and rejects all but a fraction of about
// 2^-32 + n/rate of them: checked at the boundary hi = top 32 bits of n*step and either side.
func TestMemoryProfileRejects(t *testing.T) {
	for _, rate := range []int{1, 2, 3, 1000, 64 << 10, 1<<20 + 1, 128 << 20, DefaultMemoryProfileRate, 1 << 40, 1<<62 + 12345} {
		r := memProfNew(t, &adpNullUpstream{}, rate, 0)
		for _, n := range []uint64{1, 2, 255, 256, 4096, 1 << 20, 64 << 20, uint64(rate) / 2, uint64(rate), 40 * uint64(rate), math.MaxInt64} {
			if n == 0 || n > math.MaxInt64 {
				continue
			}
			var his []uint32
			if n <= r.fastMax {
				b := n * r.step >> 32
				for _, d := range []uint64{0, 1, 2} {
					if b >= d {
						his = append(his, uint32(b-d))
					}
					if b+d <= math.MaxUint32 {
						his = append(his, uint32(b+d))
					}
				}
				// Above the boundary, everything is rejected.
				if b < math.MaxUint32 {
					require.True(t, r.rejects(n, uint32(b+1)), "rate %d, n %d", rate, n)
				}
				require.False(t, r.rejects(n, uint32(b)), "rate %d, n %d", rate, n)
			} else {
				require.False(t, r.rejects(n, math.MaxUint32), "rate %d, n %d", rate, n)
			}
			his = append(his, 0, math.MaxUint32)
			for _, hi := range his {
				if !r.rejects(n, hi) {
					continue
				}
				for _, lo := range []uint32{0, 1, math.MaxUint32} {
					require.False(t, r.sample(n, uint64(hi)<<32|uint64(lo)), "rate %d, n %d, hi %#x, lo %#x", rate, n, hi, lo)
				}
			}
		}
	}
}

// Each allocation of n bytes is sampled with probability 1-exp(-n/rate) whatever came before
// it: over a mix of sizes in a seeded random order, each size's sampled count stays within six
// standard deviations of its expectation.
func TestMemoryProfileSamplingProbability(t *testing.T) {
	const rate = 1 << 20
	r := memProfNew(t, &adpNullUpstream{}, rate, 7)
	sizes := []int{256, 16 << 10, 256 << 10, 1 << 20, 4 << 20}
	counts := make([]int, len(sizes))
	sampled := make([]int, len(sizes))
	order := rand.New(rand.NewPCG(11, 12))
	for range 300_000 {
		i := order.IntN(len(sizes))
		counts[i]++
		if r.sample(uint64(sizes[i]), r.testRand.Uint64()) {
			sampled[i]++
		}
	}
	for i, n := range sizes {
		q := 1 - math.Exp(-float64(n)/rate)
		sd := math.Sqrt(float64(counts[i]) * q * (1 - q))
		t.Logf("size %d: sampled %d of %d, expected %.1f ± %.1f", n, sampled[i], counts[i], q*float64(counts[i]), sd)
		require.InDelta(t, q*float64(counts[i]), sampled[i], 6*sd+1, "size %d", n)
	}
}

// Many goroutines allocate and free at once, while others read the profile: the figures at rate
// 1 are exact at the end; at the default rate nothing is left recorded once everything is freed.
func TestMemoryProfileConcurrent(t *testing.T) {
	for _, rate := range []int{1, 64 << 10} {
		r := memProfNew(t, NewSystemMemoryResource(), rate, 0)
		const goroutines, rounds = 8, 400
		var wg sync.WaitGroup
		kept := make([][]DevicePtr, goroutines)
		stop := make(chan struct{})
		var readers sync.WaitGroup
		readers.Add(1)
		go func() {
			defer readers.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				var buf bytes.Buffer
				if err := r.WriteProfile(&buf); err != nil {
					t.Error(err)
					return
				}
				if _, err := r.TopSites(3, "alloc_space"); err != nil {
					t.Error(err)
					return
				}
			}
		}()
		for g := range goroutines {
			wg.Go(func() {
				for i := range rounds {
					n := 256 * (1 + (g+i)%64)
					p, err := r.Allocate(n, DefaultStream)
					if err != nil {
						t.Error(err)
						return
					}
					if i%4 == 0 {
						kept[g] = append(kept[g], p)
						continue
					}
					if err := r.Deallocate(p, n, DefaultStream); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		close(stop)
		readers.Wait()
		if rate == 1 {
			got := memProfTotals(memProfParse(t, r), 0)
			var allocs, allocBytes, live, liveBytes int64
			for g := range goroutines {
				for i := range rounds {
					n := int64(256 * (1 + (g+i)%64))
					allocs++
					allocBytes += n
					if i%4 == 0 {
						live++
						liveBytes += n
					}
				}
			}
			require.Equal(t, [4]int64{allocs, allocBytes, live, liveBytes}, got)
		}
		for g := range goroutines {
			for j, p := range kept[g] {
				adpFree(t, r, p, 256*(1+(g+4*j)%64))
			}
		}
		got := memProfTotals(memProfParse(t, r), 0)
		require.Zero(t, got[2])
		require.Zero(t, got[3])
		memProfEmpty(t, r)
	}
}

// The stack starts at the caller of Allocate and names the functions on it; an inlined call
// shares its caller's location, listed first.
func TestMemoryProfileStacks(t *testing.T) {
	r := memProfNew(t, &adpNullUpstream{}, 1, 0)
	memProfAllocHere(t, r, 1000)
	memProfAllocInlinable(r, 2000)
	prof := memProfParse(t, r)
	require.Len(t, prof.Sample, 2)

	first := prof.Sample[0].Location[0].Line
	require.Equal(t, "github.com/gormm/rmm.memProfAllocHere", first[len(first)-1].Function.Name)
	require.Contains(t, memProfFunctions(prof.Sample[0]), "github.com/gormm/rmm.TestMemoryProfileStacks")
	require.NotContains(t, memProfFunctions(prof.Sample[0]), "runtime.goexit")

	names := memProfFunctions(prof.Sample[1])
	require.Equal(t, "github.com/gormm/rmm.memProfAllocInlinable", names[0])
	loc := prof.Sample[1].Location[0]
	if len(loc.Line) > 1 { // inlined (not with -gcflags=-l)
		require.Equal(t, "github.com/gormm/rmm.TestMemoryProfileStacks", loc.Line[1].Function.Name)
	}
	require.Contains(t, names, "github.com/gormm/rmm.TestMemoryProfileStacks")
	require.Len(t, prof.Mapping, 1)
	require.True(t, prof.Mapping[0].HasFunctions && prof.Mapping[0].HasLineNumbers)
	for _, l := range prof.Location {
		require.NotZero(t, l.Address)
		require.Same(t, prof.Mapping[0], l.Mapping)
		for _, line := range l.Line {
			require.NotZero(t, line.Line)
			require.NotEmpty(t, line.Function.Filename)
		}
	}
}

//go:noinline
func memProfAllocHere(t *testing.T, mr MemoryResource, n int) DevicePtr {
	p, err := mr.Allocate(n, DefaultStream)
	require.NoError(t, err)
	return p
}

func memProfAllocInlinable(mr MemoryResource, n int) DevicePtr {
	p, _ := mr.Allocate(n, DefaultStream)
	return p
}

// memProfFunctions lists the functions of s's stack, innermost first.
func memProfFunctions(s *profile.Sample) []string {
	var out []string
	for _, l := range s.Location {
		for _, line := range l.Line {
			out = append(out, line.Function.Name)
		}
	}
	return out
}

func TestMemorySitesErrors(t *testing.T) {
	r := memProfNew(t, &adpNullUpstream{}, 1, 0)
	_, err := r.TopSites(0, "peak")
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = r.Report(0, "peak")
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = MemorySites(&profile.Profile{SampleType: []*profile.ValueType{{Type: "samples", Unit: "count"}}}, "")
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "no sample type inuse_objects")
	sites, err := r.TopSites(5, "")
	require.NoError(t, err)
	require.Empty(t, sites)
	report, err := r.Report(0, "")
	require.NoError(t, err)
	require.Equal(t, "Device Memory by Call Site\n==========================\n\nSampling: every allocation\nOrdered by: inuse_space\n\nNo samples", report)
}

// memProfTake takes its caller's stack by frame pointers (fp) or with runtime.Callers, from one
// call site for both, so that the two differ only in how they were taken.
//
//go:noinline
func memProfTake(fp bool) []uintptr {
	pcs := make([]uintptr, maxTrackedFrames)
	if !fp {
		return pcs[:runtime.Callers(2, pcs)]
	}
	n, complete := fpwalk.Callers(2, pcs)
	if !complete {
		panic("incomplete walk on a goroutine's stack")
	}
	return pcs[:n]
}

type memProfChain struct{}

func (memProfChain) inlined(fp bool) []uintptr { return memProfTake(fp) }

//go:noinline
func (c memProfChain) outer(fp bool) []uintptr { return c.inlined(fp) }

// memProfEmbeds's outer, promoted from memProfChain, is a wrapper when called through an
// interface.
type memProfEmbeds struct{ memProfChain }

type memProfOuter interface{ outer(bool) []uintptr }

// memProfRun calls o.outer through a method value (another wrapper); started with a go
// statement with arguments, it runs under a third wrapper.
func memProfRun(o memProfOuter, fp bool, out chan<- []uintptr) {
	f := o.outer
	out <- f(fp)
}

// A stack taken by frame pointers and the same stack taken by runtime.Callers give the same
// profile locations: the same functions, files and lines, an inlined call in its caller's
// location, and none of the wrappers the compiler generated (a promoted method called through
// an interface, a method value, a go statement's closure), which runtime.Callers leaves out and
// the walk does not.
func TestMemoryProfileStackBothWays(t *testing.T) {
	stacks := map[bool][]uintptr{}
	for _, fp := range []bool{true, false} {
		out := make(chan []uintptr)
		go memProfRun(memProfEmbeds{}, fp, out)
		stacks[fp] = <-out
	}
	lb := memProfLocations{p: &profile.Profile{}, locs: map[string]*profile.Location{}, funcs: map[[2]string]*profile.Function{}}
	byFP, byCallers := lb.stack(stacks[true]), lb.stack(stacks[false])
	describe := func(locs []*profile.Location) (out [][]string) {
		for _, l := range locs {
			var lines []string
			for _, line := range l.Line {
				lines = append(lines, fmt.Sprintf("%s %s:%d", line.Function.Name, line.Function.Filename, line.Line))
			}
			out = append(out, lines)
		}
		return out
	}
	t.Logf("by frame pointers, %d PCs: %q", len(stacks[true]), describe(byFP))
	t.Logf("by runtime.Callers, %d PCs: %q", len(stacks[false]), describe(byCallers))
	require.Equal(t, describe(byCallers), describe(byFP))
	require.Equal(t, byCallers, byFP) // the very same locations
	var names [][]string
	for _, l := range byFP {
		var fs []string
		for _, line := range l.Line {
			fs = append(fs, strings.TrimPrefix(line.Function.Name, "github.com/gormm/rmm."))
		}
		names = append(names, fs)
	}
	want := [][]string{{"memProfChain.inlined", "memProfChain.outer"}, {"memProfRun"}}
	if len(byFP[0].Line) == 1 { // not inlined (-gcflags=-l)
		want = [][]string{{"memProfChain.inlined"}, {"memProfChain.outer"}, {"memProfRun"}}
	}
	require.Equal(t, want, names)
	// The logical frames are runtime.Callers's, less runtime.goexit.
	var logical []string
	it := runtime.CallersFrames(stacks[false])
	for more := true; more; {
		var f runtime.Frame
		f, more = it.Next()
		if f.Function != "runtime.goexit" {
			logical = append(logical, fmt.Sprintf("%s %s:%d", f.Function, f.File, f.Line))
		}
	}
	require.Equal(t, logical, slices.Concat(describe(byFP)...))
}

// Allocate's caller starts the stack also when Allocate is called through wrappers: a method
// promoted from an embedded field, called through an interface, and a method value.
func TestMemoryProfileStackThroughWrappers(t *testing.T) {
	r := memProfNew(t, &adpNullUpstream{}, 1, 0)
	var mr MemoryResource = struct{ *MemoryProfileResourceAdaptor }{r}
	memProfAllocHere(t, mr, 1000)
	alloc := r.Allocate
	memProfAllocValue(alloc, 2000)
	prof := memProfParse(t, r)
	require.Len(t, prof.Sample, 2)
	for _, s := range prof.Sample {
		names := memProfFunctions(s)
		fn := map[int64]string{1000: "github.com/gormm/rmm.memProfAllocHere", 2000: "github.com/gormm/rmm.memProfAllocValue"}[s.NumLabel["bytes"][0]]
		require.Equal(t, fn, names[0])
		require.Contains(t, names, "github.com/gormm/rmm.TestMemoryProfileStackThroughWrappers")
		for _, l := range s.Location {
			for _, line := range l.Line {
				require.NotEqual(t, "<autogenerated>", line.Function.Filename, line.Function.Name)
			}
		}
	}
}

//go:noinline
func memProfAllocValue(alloc func(int, StreamView) (DevicePtr, error), n int) DevicePtr {
	p, _ := alloc(n, DefaultStream)
	return p
}

// The table of sampled blocks gives what a map gives, over a seeded random mix of insertions,
// replacements and deletions of pointers that collide often (few distinct ones, multiples of
// 256 as blocks are), through its growth and the back shifts of its deletions.
func TestMemoryProfileLiveTable(t *testing.T) {
	buckets := make([]*memProfBucket, 4)
	for i := range buckets {
		buckets[i] = &memProfBucket{size: int64(i)}
	}
	for _, distinct := range []int{3, 40, 1000} {
		var live memProfLive
		want := map[DevicePtr]*memProfBucket{}
		rnd := rand.New(rand.NewPCG(uint64(distinct), 1))
		for i := range 50_000 {
			p := DevicePtr(rnd.IntN(distinct)) << 8
			h := memProfHash(p)
			switch op := rnd.IntN(3); op {
			case 0, 1:
				b := buckets[rnd.IntN(len(buckets))]
				require.Same(t, want[p], live.put(p, h, b), "op %d: put %#x", i, p)
				want[p] = b
			case 2:
				require.Same(t, want[p], live.delete(p, h), "op %d: delete %#x", i, p)
				delete(want, p)
			}
			require.Same(t, want[p], live.get(p, h), "op %d: get %#x", i, p)
			require.Equal(t, len(want), live.n, "op %d", i)
			if i%1000 == 0 {
				for q, b := range want {
					require.Same(t, b, live.get(q, memProfHash(q)), "op %d: get %#x", i, q)
				}
				require.LessOrEqual(t, 2*live.n, len(live.slots))
			}
		}
	}
}

// Each stack and size has one bucket, found again by later samples through the table's growth.
func TestMemoryProfileBuckets(t *testing.T) {
	r := memProfNew(t, &adpNullUpstream{}, 1, 0)
	const sizes = 300
	for round := range 3 {
		for n := 1; n <= sizes; n++ {
			memProfAllocHere(t, r, n)
		}
		require.Len(t, r.snapshot(), sizes, "round %d", round)
	}
	require.GreaterOrEqual(t, len(r.buckets.Load().slots), 2*sizes)
	got := memProfTotals(memProfParse(t, r), 0)
	require.Equal(t, [4]int64{3 * sizes, 3 * sizes * (sizes + 1) / 2, 3 * sizes, 3 * sizes * (sizes + 1) / 2}, got)
	for _, b := range r.snapshot() {
		require.Equal(t, int64(3), b.allocs.Load(), "size %d", b.size)
	}
}

// The adaptor's generator (draw: the runtime's per-thread cheaprand, on one thread here, so
// that the draws come from one sequence) gives variates below 2^64 q with frequency q, and two
// in a row both below it with frequency q^2, within six standard deviations, for q from 1/2 to
// 1/1000.
func TestMemoryProfileDraw(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const draws = 1 << 20
	us := make([]uint64, draws)
	for i := range us {
		us[i] = draw()
	}
	for _, q := range []float64{0.5, 0.1, 0.01, 0.001} {
		th := uint64(q * 0x1p64)
		var below, pairs int
		for i, u := range us {
			if u < th {
				below++
				if i > 0 && us[i-1] < th {
					pairs++
				}
			}
		}
		sd := math.Sqrt(draws * q * (1 - q))
		require.InDelta(t, q*draws, below, 6*sd, "q %g", q)
		q2 := q * q
		sd2 := math.Sqrt((draws - 1) * q2 * (1 - q2))
		require.InDelta(t, q2*(draws-1), pairs, 6*sd2+1, "q %g: pairs", q)
	}
}
