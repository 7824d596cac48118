package rmm

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/google/pprof/profile"
	"github.com/stretchr/testify/require"
)

// poolProfKinds are the pools a MemoryProfile is tested in: plain, expandable and stitching, over
// simulated memory.
var poolProfKinds = []struct {
	name string
	opts PoolOptions
}{
	{"plain", PoolOptions{}},
	{"expandable", PoolOptions{Expandable: true}},
	{"stitch", PoolOptions{Expandable: true, Stitch: true}},
}

func newProfPool(t *testing.T, o PoolOptions, prof *MemoryProfile) *PoolMemoryResource {
	t.Helper()
	o.MemoryProfile = prof
	p, _ := newSimPool(t, 1<<30, &o)
	return p
}

//go:noinline
func poolProfAllocSmall(t *testing.T, p *PoolMemoryResource, n int, s StreamView) DevicePtr {
	ptr, err := p.Allocate(n, s)
	require.NoError(t, err)
	return ptr
}

//go:noinline
func poolProfAllocLarge(t *testing.T, p *PoolMemoryResource, n int, s StreamView) DevicePtr {
	ptr, err := p.Allocate(n, s)
	require.NoError(t, err)
	return ptr
}

// poolProfSite sums the values of p's samples whose stacks start in function fn.
func poolProfSite(p *profile.Profile, fn string) [4]int64 {
	var v [4]int64
	for _, s := range p.Sample {
		if memProfFunctions(s)[0] == fn {
			for i := range v {
				v[i] += s.Value[i]
			}
		}
	}
	return v
}

// At rate 1 a pool's profile counts every allocation and free exactly, by the caller's stack, on
// the per-stream cache's path, the pool's own and after Close; refused frees change nothing.
func TestPoolMemoryProfileRateOne(t *testing.T) {
	for _, k := range poolProfKinds {
		t.Run(k.name, func(t *testing.T) {
			poolProfRateOne(t, func(prof *MemoryProfile) *PoolMemoryResource { return newProfPool(t, k.opts, prof) })
		})
	}
}

// poolProfRateOne is TestPoolMemoryProfileRateOne's case over the pool newPool makes (host or
// device).
func poolProfRateOne(t *testing.T, newPool func(*MemoryProfile) *PoolMemoryResource) {
	const small, large = 64 << 10, 8 << 20
	const fnSmall, fnLarge = "github.com/gormm/rmm.poolProfAllocSmall", "github.com/gormm/rmm.poolProfAllocLarge"
	prof := memProfRateOne(t)
	p := newPool(prof)
	s := poolCacheTestStream(t)

	var ps []DevicePtr
	for range 10 {
		ps = append(ps, poolProfAllocSmall(t, p, small, s))
	}
	for _, ptr := range ps[6:] {
		require.NoError(t, p.Deallocate(ptr, small, s))
	}
	ps = ps[:6]
	cached := p.Stats().CachedBlocks
	require.Positive(t, cached, "the frees went to the stream's cache")
	for range 3 {
		ps = append(ps, poolProfAllocSmall(t, p, small, s))
	}
	require.Equal(t, cached-3, p.Stats().CachedBlocks, "the cache served the next three")
	a := poolProfAllocLarge(t, p, large, s)
	b := poolProfAllocLarge(t, p, large, DefaultStream)

	pr := memProfParse(t, prof)
	require.Equal(t, [4]int64{13, 13 * small, 9, 9 * small}, poolProfSite(pr, fnSmall))
	require.Equal(t, [4]int64{2, 2 * large, 2, 2 * large}, poolProfSite(pr, fnLarge))
	require.Contains(t, memProfFunctions(pr.Sample[0]), "github.com/gormm/rmm.poolProfRateOne")

	// Refused frees: another size, a pointer never handed out; then a double free.
	require.ErrorIs(t, p.Deallocate(ps[0], small+256, s), ErrInvalidFree)
	require.ErrorIs(t, p.Deallocate(a, large-256, s), ErrInvalidFree)
	require.ErrorIs(t, p.Deallocate(a+256, large, s), ErrInvalidFree)
	require.NoError(t, p.Deallocate(a, large, s))
	require.ErrorIs(t, p.Deallocate(a, large, s), ErrInvalidFree)
	pr = memProfParse(t, prof)
	require.Equal(t, [4]int64{13, 13 * small, 9, 9 * small}, poolProfSite(pr, fnSmall))
	require.Equal(t, [4]int64{2, 2 * large, 1, large}, poolProfSite(pr, fnLarge))

	for _, ptr := range ps {
		require.NoError(t, p.Deallocate(ptr, small, s))
	}
	// b is freed after Close, which takes it back still.
	require.NoError(t, p.Close())
	require.Equal(t, [4]int64{2, 2 * large, 1, large}, poolProfSite(memProfParse(t, prof), fnLarge))
	require.NoError(t, p.Deallocate(b, large, DefaultStream))
	pr = memProfParse(t, prof)
	require.Equal(t, [4]int64{13, 13 * small, 0, 0}, poolProfSite(pr, fnSmall))
	require.Equal(t, [4]int64{2, 2 * large, 0, 0}, poolProfSite(pr, fnLarge))
}

// Sampled: a pool's countdown samples each allocation with probability 1-exp(-size/rate), as the
// adaptor's draw does, so the scaled figures estimate the allocations made within the bound of
// TestMemoryProfileSampledEstimates; through the per-stream cache (allocate and free in turn) and
// through the pool's lists (many blocks live at once). Seeded runs are reproducible; seed 0 uses
// the runtime's generator.
func TestPoolMemoryProfileSampled(t *testing.T) {
	t.Parallel()
	const rate = 64 << 10
	sizes := []struct{ size, count int }{
		{4 << 10, 100_000}, // sampled with probability 0.061
		{48 << 10, 20_000}, // 0.53
	}
	for _, k := range poolProfKinds[:2] {
		for _, seed := range shortOrLong([]uint64{0, 1}, []uint64{0, 1, 2}) { // the runtime's generator and a seeded one
			t.Run(fmt.Sprintf("%s/seed=%d", k.name, seed), func(t *testing.T) {
				prof, err := NewMemoryProfile(&MemoryProfileOptions{Rate: rate})
				require.NoError(t, err)
				if seed != 0 {
					prof.testRand = rand.New(rand.NewPCG(seed, seed^0x5eed))
				}
				p := newProfPool(t, k.opts, prof)
				s := poolCacheTestStream(t)
				for _, sz := range sizes {
					// Half the allocations freed at once (the cache's path), then half kept
					// live, of which every other one is freed.
					for range sz.count / 2 {
						ptr := poolProfAllocSmall(t, p, sz.size, s)
						require.NoError(t, p.Deallocate(ptr, sz.size, s))
					}
					ps := make([]DevicePtr, sz.count/2)
					for i := range ps {
						ps[i] = poolProfAllocSmall(t, p, sz.size, s)
					}
					for i := 0; i < len(ps); i += 2 {
						require.NoError(t, p.Deallocate(ps[i], sz.size, s))
					}
				}
				pr := memProfParse(t, prof)
				for _, sz := range sizes {
					memProfRequireCounts(t, pr, sz.size, sz.count, sz.count/4, rate)
				}
			})
		}
	}
}

// The countdown's lengths are exponential with mean rate: their mean and the share above the
// rate (e^-1) within six standard deviations; 0 at rate 1 and for no profile.
func TestMemoryProfileNextSample(t *testing.T) {
	var none *MemoryProfile
	require.Zero(t, none.nextSample())
	one, err := NewMemoryProfile(&MemoryProfileOptions{Rate: 1})
	require.NoError(t, err)
	require.Zero(t, one.nextSample())

	const rate, n = 1 << 20, 100_000
	m, err := NewMemoryProfile(&MemoryProfileOptions{Rate: rate})
	require.NoError(t, err)
	sum, above := 0.0, 0
	for range n {
		x := m.nextSample()
		require.GreaterOrEqual(t, x, 0)
		require.Less(t, x, 37*rate)
		sum += float64(x)
		if x > rate {
			above++
		}
	}
	require.InDelta(t, 1.0, sum/n/rate, 6/math.Sqrt(n))
	q := math.Exp(-1)
	require.InDelta(t, q*n, float64(above), 6*math.Sqrt(n*q*(1-q)))

	// Rates near the largest int: never negative (the product is clamped to MaxInt).
	for _, huge := range []int{1 << 61, math.MaxInt} {
		m, err := NewMemoryProfile(&MemoryProfileOptions{Rate: huge})
		require.NoError(t, err)
		m.testRand = rand.New(rand.NewPCG(9, 9))
		for range 10_000 {
			require.GreaterOrEqual(t, m.nextSample(), 0, "rate %d", huge)
		}
	}

	_, err = NewMemoryProfile(&MemoryProfileOptions{Rate: -5})
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "NewMemoryProfile: negative sampling rate -5")
	m, err = NewMemoryProfile(nil)
	require.NoError(t, err)
	require.Equal(t, DefaultMemoryProfileRate, m.Rate())
}

// Goroutines allocating and freeing at once, each on its stream and some on one stream shared,
// through one profile shared by two pools: at rate 1 its counts are exact, and nothing is left
// in use at the end.
func TestPoolMemoryProfileConcurrent(t *testing.T) {
	t.Parallel()
	prof := memProfRateOne(t)
	pools := []*PoolMemoryResource{newProfPool(t, PoolOptions{}, prof), newProfPool(t, PoolOptions{Expandable: true}, prof)}
	shared := poolCacheTestStream(t)
	const workers, rounds = 6, 3000
	var wg sync.WaitGroup
	var mu sync.Mutex
	total, bytes := 0, 0
	for w := range workers {
		s := shared
		if w%2 == 0 {
			s = poolCacheTestStream(t)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			type held struct {
				p    *PoolMemoryResource
				ptr  DevicePtr
				size int
			}
			var live []held
			n, nb := 0, 0
			for range rounds {
				if len(live) > 0 && rng.IntN(2) == 0 {
					i := rng.IntN(len(live))
					h := live[i]
					live[i] = live[len(live)-1]
					live = live[:len(live)-1]
					if err := h.p.Deallocate(h.ptr, h.size, s); err != nil {
						t.Error(err)
						return
					}
					continue
				}
				p := pools[rng.IntN(2)]
				size := []int{256, 4 << 10, 64 << 10, 3 << 20}[rng.IntN(4)]
				ptr, err := p.Allocate(size, s)
				if err != nil {
					t.Error(err)
					return
				}
				live = append(live, held{p, ptr, size})
				n, nb = n+1, nb+size
			}
			for _, h := range live {
				if err := h.p.Deallocate(h.ptr, h.size, s); err != nil {
					t.Error(err)
				}
			}
			mu.Lock()
			total, bytes = total+n, bytes+nb
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Equal(t, [4]int64{int64(total), int64(bytes), 0, 0}, memProfTotals(memProfParse(t, prof), 0))
}

type poolProfHeld struct {
	p    *PoolMemoryResource
	ptr  DevicePtr
	size int
	s    StreamView
}

// poolProfCheck checks the totals of prof: allocs and bytes allocated, live objects and bytes.
func poolProfCheck(t *testing.T, prof *MemoryProfile, allocs, bytes int, live []poolProfHeld, msg string) {
	t.Helper()
	lb := 0
	for _, h := range live {
		lb += h.size
	}
	require.Equal(t, [4]int64{int64(allocs), int64(bytes), int64(len(live)), int64(lb)}, memProfTotals(memProfParse(t, prof), 0), msg)
}

// Failed allocations record nothing: out of memory (a capped pool, or a full upstream), at the
// cache's sizes and larger, a negative size, a size that overflows when rounded, and allocations
// after Close; zero-byte allocations and frees record nothing either. At rate 1 the profile
// counts exactly the allocations that succeeded.
func TestPoolMemoryProfileFailuresRecordNothing(t *testing.T) {
	for _, k := range poolProfKinds {
		t.Run(k.name, func(t *testing.T) {
			prof := memProfRateOne(t)
			o := k.opts
			o.MemoryProfile = prof
			if !o.Expandable {
				o.MaximumPoolSize = 32 << 20
			}
			p, _ := newSimPool(t, 32<<20, &o)
			s := poolCacheTestStream(t)
			var live []poolProfHeld
			allocs, bytes := 0, 0
			for _, sz := range []int{0, 0} {
				ptr, err := p.Allocate(sz, s)
				require.NoError(t, err)
				require.Zero(t, ptr)
				require.NoError(t, p.Deallocate(ptr, sz, s))
			}
			for _, size := range []int{4 << 20, 64 << 10} { // until out of memory
				for {
					ptr, err := p.Allocate(size, s)
					if err != nil {
						require.ErrorIs(t, err, ErrOutOfMemory)
						break
					}
					live = append(live, poolProfHeld{p, ptr, size, s})
					allocs, bytes = allocs+1, bytes+size
				}
			}
			for range 5 {
				_, err := p.Allocate(1<<30, s)
				require.Error(t, err)
				_, err = p.Allocate(256, DefaultStream)
				require.Error(t, err)
				_, err = p.Allocate(-1, s)
				require.Error(t, err)
				_, err = p.Allocate(1<<62+1, s)
				require.Error(t, err)
			}
			poolProfCheck(t, prof, allocs, bytes, live, "after failures")
			for _, h := range live {
				require.NoError(t, p.Deallocate(h.ptr, h.size, h.s))
			}
			poolProfCheck(t, prof, allocs, bytes, nil, "all freed")
			require.NoError(t, p.Close())
			_, err := p.Allocate(256, s)
			require.Error(t, err)
			_, err = p.Allocate(2<<20, s)
			require.Error(t, err)
			poolProfCheck(t, prof, allocs, bytes, nil, "after close")
		})
	}
}

//go:noinline
func poolProfAllocSite(p *PoolMemoryResource, n int, s StreamView) (DevicePtr, error) {
	return p.Allocate(n, s)
}

// Every sample's first frame is the caller of Allocate: cache path, slow path, the path that
// waits on another stream (block freed on another stream), stitched blocks.
func TestPoolMemoryProfileStacksEveryPath(t *testing.T) {
	const fn = "github.com/gormm/rmm.poolProfAllocSite"
	for _, k := range poolProfKinds {
		t.Run(k.name, func(t *testing.T) {
			prof := memProfRateOne(t)
			o := k.opts
			o.MemoryProfile = prof
			p, _ := newSimPool(t, 1<<30, &o)
			s1 := poolCacheTestStream(t)
			s2 := poolCacheTestStream(t)
			n, stitched := 0, 0
			alloc := func(sz int, s StreamView) DevicePtr {
				ptr, err := poolProfAllocSite(p, sz, s)
				require.NoError(t, err)
				n++
				if p.stitching() != nil {
					p.mu.Lock()
					if _, ok := p.stitching().aliases[ptr]; ok {
						stitched++
					}
					p.mu.Unlock()
				}
				return ptr
			}
			for range 3 {
				for _, sz := range []int{256, 64 << 10, 1 << 20, 3 << 20, 9 << 20} {
					a := alloc(sz, s1)
					require.NoError(t, p.Deallocate(a, sz, s1))
					a = alloc(sz, s1) // cache path for small
					require.NoError(t, p.Deallocate(a, sz, s2))
					a = alloc(sz, s1) // taken back from s2's list (wait path)
					b := alloc(sz, s2)
					require.NoError(t, p.Deallocate(a, sz, s1))
					require.NoError(t, p.Deallocate(b, sz, s2))
				}
				// Stitching: many distinct large sizes.
				var ps []DevicePtr
				var ss []int
				for i := range 12 {
					sz := (2 << 20) + i*(768<<10) + 512
					ps = append(ps, alloc(sz, s1))
					ss = append(ss, sz)
				}
				for i := 0; i < len(ps); i += 2 {
					require.NoError(t, p.Deallocate(ps[i], ss[i], s2))
				}
				for i := range 6 {
					sz := (5 << 20) + i*(1<<20) + 256
					x := alloc(sz, s1)
					require.NoError(t, p.Deallocate(x, sz, s1))
				}
				for i := 1; i < len(ps); i += 2 {
					require.NoError(t, p.Deallocate(ps[i], ss[i], s1))
				}
			}
			pr := memProfParse(t, prof)
			for _, smp := range pr.Sample {
				fns := memProfFunctions(smp)
				require.Equal(t, fn, fns[0], "stack %v", fns)
			}
			v := poolProfSite(pr, fn)
			require.Equal(t, int64(n), v[0])
			require.Zero(t, v[2])
			require.Zero(t, v[3])
			t.Logf("%s: %d allocations, %d stitched", k.name, n, stitched)
		})
	}
}
