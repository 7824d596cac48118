// Property tests: the contract checker of package rmmtest driven over the package's resources in
// random configurations.
//
// Every test here builds resources and hands them to rmmtest, which checks them; none keeps a
// model of its own. rmmtest.RunConfigurations runs gopter's state machine (commands) with
// shrinking, and draws a configuration for each random sequence: a pool's initial and maximum
// sizes over an upstream with a random cap, an expandable pool's maximum and physical limit, an
// adaptor over such a pool. What each resource is checked for after every step is
// rmmtest's list (the package documentation of rmmtest): alignment, no overlaps, every
// allocation inside memory the upstream gave (or the VMM mapped), Stats against the live
// allocations and the upstream, failed calls changing nothing, patterns intact in host memory,
// Release giving back what is wholly free, Close giving back everything, and the rest. A test
// then checks that its configurations reached what it is about (out of memory, the upstream
// refusing, the pool's back-off, releases down to nothing).
//
// Replaying a failure: the seed is printed with every failure (and logged with -v), and
//
//	RMM_PROPERTY_SEED=1234 go test -race -run '^TestPoolPropertySimulated$' .
//
// draws the same configurations and sequences again. The default run is the short form, sized
// for a few seconds per test under -race; -rmm.long runs each test's full count of sequences
// (testrand_test.go), and RMM_PROPERTY_SCALE=k k times as many as either (a longer search).

package rmm_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/rmmtest"
	"github.com/stretchr/testify/require"
)

const (
	propKiB = 1 << 10
	propMiB = 1 << 20
	propGiB = 1 << 30

	// propBeyondHost is a capacity no host can give (more than the 47-bit user address space,
	// and more than a Go slice may be): a request beyond it fails in malloc rather than after
	// exhausting the machine.
	propBeyondHost = 1 << 49
)

// ---------------------------------------------------------------------------------------------
// Sizes.

// propLogUniform returns a size in [lo, hi) drawn uniformly in log scale.
func propLogUniform(r *rand.Rand, lo, hi int) int {
	e := math.Log2(float64(lo)) + r.Float64()*(math.Log2(float64(hi))-math.Log2(float64(lo)))
	return max(lo, min(hi-1, int(math.Exp2(e))))
}

// propSmallSize draws from the mix every configuration shares: 0, 1..300, multiples of 256 up
// to 64 KiB, anything up to 64 KiB.
func propSmallSize(r *rand.Rand) int {
	switch k := r.IntN(100); {
	case k < 4:
		return 0
	case k < 45:
		return 1 + r.IntN(300)
	case k < 75:
		return rmm.Alignment * (1 + r.IntN(256))
	default:
		return 1 + r.IntN(64*propKiB)
	}
}

// propAligned draws a multiple of 256 in [lo, hi] (lo, hi multiples of 256).
func propAligned(r *rand.Rand, lo, hi int) int {
	return lo + rmm.Alignment*r.IntN((hi-lo)/rmm.Alignment+1)
}

func propRoundUp(n int) int {
	r, _ := rmm.AlignUp(n, rmm.Alignment)
	return r
}

// propStreams draws the number of Streams besides DefaultStream: 3 or 4.
func propStreams(r *rand.Rand) int { return 3 + r.IntN(2) }

// ---------------------------------------------------------------------------------------------
// Upstreams.

// propSimulated returns a fresh address-only upstream of capacity bytes for each resource.
func propSimulated(capacity int) func() rmm.MemoryResource {
	return func() rmm.MemoryResource {
		sim, err := rmm.NewSimulatedMemoryResource(capacity)
		if err != nil {
			panic(err)
		}
		return sim
	}
}

// propCapped returns a fresh upstream that grants limit bytes in all (each allocation charged
// rounded up to 256), over addresses without memory: librmm's limiting adaptor over a huge
// simulated device, as in librmm's pool tests.
func propCapped(limit int) func() rmm.MemoryResource {
	return func() rmm.MemoryResource {
		lim, err := rmm.NewLimitingResourceAdaptor(propSimulated(1<<60)(), limit, nil)
		if err != nil {
			panic(err)
		}
		return lim
	}
}

func propSystem() rmm.MemoryResource { return rmm.NewSystemMemoryResource() }

// ---------------------------------------------------------------------------------------------
// Pools.

// propPool is one configuration of a pool.
type propPool struct {
	streams          int // Streams besides DefaultStream
	initial, maximum int // PoolOptions (0: none)
	upstreamLimit    int // what the upstream grants in all (0: its capacity)
}

func (c propPool) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "pool, initial %d", c.initial)
	if c.maximum > 0 {
		fmt.Fprintf(&b, ", maximum %d", c.maximum)
	}
	if c.upstreamLimit > 0 {
		fmt.Fprintf(&b, ", upstream limit %d", c.upstreamLimit)
	}
	return b.String()
}

// limit is the most bytes (each allocation rounded up to 256) that can be live at once in a pool
// of c over an upstream of capacity bytes.
func (c propPool) limit(capacity int) int {
	l := capacity
	if c.upstreamLimit > 0 {
		l = min(l, rmm.AlignDown(c.upstreamLimit, rmm.Alignment))
	}
	if c.maximum > 0 {
		l = min(l, c.maximum)
	}
	return l
}

// newPool returns a constructor of pools of c with build (rmm.NewPoolMemoryResource by default),
// which checks that the pool reports the maximum it was given (rmmtest checks that it never
// changes).
func (c propPool) newPool(build func(rmm.MemoryResource, *rmm.PoolOptions) (*rmm.PoolMemoryResource, error)) func(*testing.T, rmm.MemoryResource) rmm.MemoryResource {
	if build == nil {
		build = rmm.NewPoolMemoryResource
	}
	return func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
		p, err := build(up, &rmm.PoolOptions{InitialPoolSize: c.initial, MaximumPoolSize: c.maximum})
		if err != nil {
			t.Fatalf("building a %v: %v", c, err)
		}
		if st := p.Stats(); st.MaximumPoolSize != c.maximum {
			t.Fatalf("a %v reports the maximum %d", c, st.MaximumPoolSize)
		}
		return p
	}
}

// propPoolOptions is what a pool promises: it detects invalid frees, it gives back what is
// wholly free at Release and everything at Close, and its allocations stay valid after Close.
// It runs out only past its maximum or its upstream's limit — or, when capacity is all that
// bounds it and the upstream cannot run out before (strict), only past capacity.
func propPoolOptions(c propPool, upstream func() rmm.MemoryResource, capacity int, strict bool, size func(*rand.Rand) int) rmmtest.Options {
	return rmmtest.Options{
		Upstream:           upstream,
		Streams:            c.streams,
		DetectsInvalidFree: true,
		Capacity:           c.limit(capacity),
		StrictCapacity:     strict && c.maximum == 0 && c.upstreamLimit == 0,
		DrawSize:           size,
		FreeAfterClose:     true,
	}
}

// Over real host memory: patterns in every byte catch overlaps in memory.
func TestPoolPropertySystem(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	cov := rmmtest.RunConfigurations(t, func(r *rand.Rand) rmmtest.Configuration {
		c := propPool{streams: propStreams(r)}
		if r.IntN(2) == 0 {
			c.initial = propAligned(r, rmm.Alignment, 4*propMiB)
		}
		if r.IntN(4) == 0 {
			c.maximum = propAligned(r, max(c.initial, rmm.Alignment), c.initial+8*propMiB)
		}
		opts := propPoolOptions(c, propSystem, propBeyondHost, true, func(r *rand.Rand) int {
			if r.IntN(12) == 0 {
				return propLogUniform(r, 64*propKiB, 4*propMiB+1)
			}
			return propSmallSize(r)
		})
		opts.FullPatterns = true
		return rmmtest.Configuration{Name: c.String() + ", over SystemMemoryResource", NewResource: c.newPool(nil), Options: opts}
	}, &rmmtest.Options{Sequences: rmm.ShortOrLong(80, 300), MaxCommands: 120})
	require.Positive(t, cov.Allocations)
	require.Positive(t, cov.CrossStreamFrees)
	require.Positive(t, cov.InvalidFrees)
	require.Positive(t, cov.OutOfMemory)
}

// Over an address-only upstream of 100 GiB: initial pools up to 100 GiB, maximums, allocations
// of tens of GiB, so growth runs into the upstream's capacity and the maximum.
func TestPoolPropertySimulated(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	const capacity = 100 * propGiB
	cov := rmmtest.RunConfigurations(t, func(r *rand.Rand) rmmtest.Configuration {
		c := propPool{streams: propStreams(r)}
		switch r.IntN(3) {
		case 0:
		case 1:
			c.initial = propAligned(r, rmm.Alignment, capacity)
		default:
			c.initial = propRoundUp(propLogUniform(r, 1*propMiB, capacity))
		}
		if r.IntN(3) == 0 {
			c.maximum = propAligned(r, max(c.initial, rmm.Alignment), capacity)
		}
		// Growth may fail before the capacity: the pool asks for max(request, its size).
		opts := propPoolOptions(c, propSimulated(capacity), capacity, false, func(r *rand.Rand) int {
			switch r.IntN(10) {
			case 0, 1:
				return propLogUniform(r, 64*propKiB, 40*propGiB)
			case 2:
				return propGiB * (1 + r.IntN(40))
			}
			return propSmallSize(r)
		})
		return rmmtest.Configuration{Name: c.String() + ", over a 100 GiB address-only upstream", NewResource: c.newPool(nil), Options: opts}
	}, &rmmtest.Options{Sequences: rmm.ShortOrLong(200, 800), MaxCommands: 120})
	require.Positive(t, cov.OutOfMemory)
	require.Positive(t, cov.ReleasesToNothing)
	require.Positive(t, cov.UpstreamRefusals, "growth never ran into the upstream's capacity")
}

// propCappedPool draws a pool over an upstream that grants only a few KiB to a MiB in all (the
// limiting adaptor of librmm's tests): growth fails, the halving back-off runs, maximums are
// small. initial: whether to draw an initial size.
func propCappedPool(r *rand.Rand, initial bool) (propPool, func(*rand.Rand) int) {
	c := propPool{streams: propStreams(r), upstreamLimit: propLogUniform(r, 2*propKiB, 1*propMiB)}
	if initial && r.IntN(3) == 0 {
		c.initial = propAligned(r, rmm.Alignment, rmm.AlignDown(c.upstreamLimit/2, rmm.Alignment))
	}
	if r.IntN(2) == 0 {
		c.maximum = propAligned(r, max(c.initial, rmm.Alignment), 2*c.upstreamLimit)
	}
	limit := c.upstreamLimit
	return c, func(r *rand.Rand) int {
		if r.IntN(4) == 0 {
			return 1 + r.IntN(limit)
		}
		return propSmallSize(r) % (limit/2 + 1)
	}
}

func TestPoolPropertyCappedUpstream(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	cov := rmmtest.RunConfigurations(t, func(r *rand.Rand) rmmtest.Configuration {
		c, size := propCappedPool(r, true)
		opts := propPoolOptions(c, propCapped(c.upstreamLimit), 1<<60, false, size)
		return rmmtest.Configuration{Name: c.String(), NewResource: c.newPool(nil), Options: opts}
	}, &rmmtest.Options{Sequences: rmm.ShortOrLong(200, 800), MaxCommands: 120})
	require.Positive(t, cov.OutOfMemory)
	require.Positive(t, cov.UpstreamRefusals, "growth never failed")
	require.Positive(t, cov.UpstreamRetries, "the halving back-off never succeeded")
}

// The pool over a capped upstream with its CUDA calls going to a fake device: every take, merge,
// Release and stream Close then unlocks the pool for its records, waits and synchronisations, and
// the checks (free lists, live table, sizes, out-of-memory figures, what the upstream holds) must
// hold as without a device. No initial size: every list gets a (fake) event.
func TestPoolPropertyFakeDevice(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	cov := rmmtest.RunConfigurations(t, func(r *rand.Rand) rmmtest.Configuration {
		c, size := propCappedPool(r, false)
		opts := propPoolOptions(c, propCapped(c.upstreamLimit), 1<<60, false, size)
		return rmmtest.Configuration{Name: c.String() + ", with a fake device", NewResource: c.newPool(rmm.NewPoolOverFakeDevice), Options: opts}
	}, &rmmtest.Options{Sequences: rmm.ShortOrLong(80, 300), MaxCommands: 120})
	require.Positive(t, cov.OutOfMemory)
	require.Positive(t, cov.CrossStreamFrees)
}

// Eight goroutines allocate and free at random on their own streams, sometimes freeing on another
// stream, while a ninth checks the pool's invariants and its Stats; no two live allocations may
// ever overlap, and at the end everything coalesces and Release gives everything back (rmmtest's
// Concurrent checks, with the rest of its checklist).
func TestPoolPropertyConcurrent(t *testing.T) {
	rmmtest.Run(t, func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
		p, err := rmm.NewPoolMemoryResource(up, &rmm.PoolOptions{InitialPoolSize: 4 * propMiB})
		require.NoError(t, err)
		return p
	}, &rmmtest.Options{
		Upstream:             propSimulated(1 << 40),
		DetectsInvalidFree:   true,
		Goroutines:           8,
		ConcurrentInvariants: true,
		FreeAfterClose:       true,
	})
}

// Found by TestPoolPropertyCappedUpstream, shrunk to: maximum 1280 bytes, Alloc(1), Alloc(628).
// Growing by half the headroom unaligned (640 bytes) and then rounding the headroom left up to 256
// took the pool to 1408 bytes, past its maximum. Growth under a maximum now stays on the 256-byte
// grid: 512 bytes first, then the 768 that exactly reach the maximum.
func TestPoolGrowthKeepsToMaximum(t *testing.T) {
	sim, err := rmm.NewSimulatedMemoryResource(1 << 30)
	require.NoError(t, err)
	p, err := rmm.NewPoolMemoryResource(sim, &rmm.PoolOptions{MaximumPoolSize: 1280})
	require.NoError(t, err)
	_, err = p.Allocate(1, rmm.DefaultStream)
	require.NoError(t, err)
	require.Equal(t, 512, p.PoolSize(), "grown by half the headroom, rounded down to 256")
	_, err = p.Allocate(628, rmm.DefaultStream)
	require.NoError(t, err, "768 bytes: 256 are free and 768 left below the maximum")
	require.Equal(t, 1280, p.PoolSize())
	require.LessOrEqual(t, sim.UsedBytes(), 1280)
	_, err = p.Allocate(257, rmm.DefaultStream)
	require.ErrorIs(t, err, rmm.ErrOutOfMemory, "512 bytes: 256 are free and the pool is at its maximum")
	_, err = p.Allocate(256, rmm.DefaultStream)
	require.NoError(t, err, "the last 256 bytes")
	require.NoError(t, p.CheckInvariants())
}

// Adaptors over a pool over a capped upstream: a failing allocation that makes the pool give free
// blocks back shows under the adaptor only as fewer upstream blocks (no PoolStats in sight).
func TestAdaptorsOverPoolProperty(t *testing.T) {
	adaptors := []struct {
		name string
		new  func(rmm.MemoryResource) (rmm.MemoryResource, error)
	}{
		{"logging", func(p rmm.MemoryResource) (rmm.MemoryResource, error) {
			return rmm.NewLoggingResourceAdaptor(p, confDiscard{}, nil)
		}},
		{"statistics", confStatistics},
		{"failure callback", confFailureCallback},
		{"thread-safe", confThreadSafe},
		{"memory profile", confMemoryProfile(1)},
		{"limiting", nil}, // its limit is drawn
	}
	rmmtest.RunConfigurations(t, func(r *rand.Rand) rmmtest.Configuration {
		c, size := propCappedPool(r, true)
		a := adaptors[r.IntN(len(adaptors))]
		opts := propPoolOptions(c, propCapped(c.upstreamLimit), 1<<60, false, size)
		opts.FreeAfterClose = false // an adaptor need not keep working after Close
		newAdaptor := a.new
		name := a.name
		if newAdaptor == nil {
			limit := propAligned(r, rmm.Alignment, 2*c.upstreamLimit)
			newAdaptor, name = confLimiting(limit), fmt.Sprintf("limiting (%d bytes)", limit)
			opts.Capacity = min(opts.Capacity, limit)
		}
		newPool := c.newPool(nil)
		return rmmtest.Configuration{
			Name: fmt.Sprintf("%s adaptor over a %v", name, c),
			NewResource: func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
				mr, err := newAdaptor(newPool(t, up))
				if err != nil {
					t.Fatalf("building the %s adaptor: %v", name, err)
				}
				return mr
			},
			Options: opts,
		}
	}, &rmmtest.Options{Sequences: 200, MaxCommands: 100})
}

// ---------------------------------------------------------------------------------------------
// Expandable pools: the suite sees the memory the pool maps (rmmtest.Options.Mapped).

// propExpandable is one configuration of an expandable pool over a VMM of granularity gran.
type propExpandable struct {
	streams          int
	gran             int
	host             bool // host memory, else addresses without memory
	initial, maximum int
	physicalLimit    int // 0: none
	capacity         int // the address range (the maximum when there is none)
	size             func(*rand.Rand) int
	fullPattern      bool
}

func (c propExpandable) String() string {
	mem := "addresses without memory"
	if c.host {
		mem = "host memory"
	}
	return fmt.Sprintf("expandable pool over %s (%d-byte granularity), initial %d, maximum %d, physical limit %d",
		mem, c.gran, c.initial, c.maximum, c.physicalLimit)
}

func (c propExpandable) configuration() rmmtest.Configuration {
	var vm *rmm.TrackedVMM
	upstream := propSimulated(1 << 40) // the pool maps its memory itself: only the access matters
	if c.host {
		upstream = propSystem
	}
	capacity := min(c.capacity, c.maximum)
	if c.physicalLimit > 0 {
		capacity = min(capacity, rmm.AlignDown(c.physicalLimit, rmm.Alignment))
	}
	return rmmtest.Configuration{
		Name: c.String(),
		NewResource: func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
			p, v, err := rmm.NewTrackedExpandablePool(up, c.host, c.gran, c.physicalLimit,
				rmm.PoolOptions{InitialPoolSize: c.initial, MaximumPoolSize: c.maximum})
			if err != nil {
				t.Fatalf("building an %v: %v", c, err)
			}
			vm = v
			return p
		},
		Options: rmmtest.Options{
			Upstream: upstream,
			Mapped: func(rmm.MemoryResource) []rmmtest.Range {
				var rs []rmmtest.Range
				for _, m := range vm.Ranges() {
					rs = append(rs, rmmtest.Range{Addr: m.Addr, Size: m.Size})
				}
				return rs
			},
			Streams:            c.streams,
			DetectsInvalidFree: true,
			Capacity:           capacity,
			DrawSize:           c.size,
			FullPatterns:       c.fullPattern,
			FreeAfterClose:     true,
		},
	}
}

func TestExpandablePoolProperty(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	const gran, capacity = 4 * propKiB, 64 * propMiB
	cov := rmmtest.RunConfigurations(t, func(r *rand.Rand) rmmtest.Configuration {
		c := propExpandable{streams: propStreams(r), gran: gran, capacity: capacity}
		if r.IntN(2) == 0 {
			c.initial = gran * r.IntN(256)
		}
		c.maximum = capacity // an expandable pool always has one: its range
		if r.IntN(3) == 0 {
			c.maximum = max(c.initial, gran) + gran*r.IntN(2048)
		}
		c.size = func(r *rand.Rand) int {
			switch r.IntN(12) {
			case 0:
				return propLogUniform(r, 64*propKiB, 16*propMiB)
			case 1:
				return gran * (1 + r.IntN(8))
			}
			return propSmallSize(r)
		}
		return c.configuration()
	}, &rmmtest.Options{Sequences: 300, MaxCommands: 120}) // full length by default: carving is rare here
	require.Positive(t, cov.Allocations)
	require.Positive(t, cov.CrossStreamFrees)
	require.Positive(t, cov.OutOfMemory)
}

// Over real host memory mapped with a 4 KiB granularity: a pattern in every byte of every live
// allocation, checked after every step, catches overlaps and pages mapped twice, and memory
// unmapped under a live block (reading it would fault).
func TestExpandablePoolPropertyHostMemory(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	const gran, capacity = 4 * propKiB, 32 * propMiB
	cov := rmmtest.RunConfigurations(t, func(r *rand.Rand) rmmtest.Configuration {
		c := propExpandable{streams: propStreams(r), gran: gran, host: true, capacity: capacity, maximum: capacity, fullPattern: true}
		if r.IntN(2) == 0 {
			c.initial = gran * r.IntN(64)
		}
		if r.IntN(3) == 0 {
			c.physicalLimit = c.initial + gran*(1+r.IntN(1024))
		}
		c.size = func(r *rand.Rand) int {
			switch r.IntN(12) {
			case 0:
				return propLogUniform(r, 64*propKiB, 4*propMiB)
			case 1:
				return gran * (1 + r.IntN(8))
			}
			return propSmallSize(r)
		}
		return c.configuration()
	}, &rmmtest.Options{Sequences: 200, MaxCommands: 100}) // full length by default: carving is rare here
	require.Positive(t, cov.Allocations)
	require.Positive(t, cov.CrossStreamFrees)
}

// With a physical limit below the range: the device refuses chunks.
func TestExpandablePoolPropertyPhysicalLimit(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	const gran, capacity = 4 * propKiB, 64 * propMiB
	cov := rmmtest.RunConfigurations(t, func(r *rand.Rand) rmmtest.Configuration {
		c := propExpandable{streams: propStreams(r), gran: gran, capacity: capacity, maximum: capacity}
		c.physicalLimit = gran * (1 + r.IntN(512))
		limit := c.physicalLimit
		c.size = func(r *rand.Rand) int {
			if r.IntN(4) == 0 {
				return 1 + r.IntN(limit)
			}
			return propSmallSize(r) % (limit/2 + 1)
		}
		return c.configuration()
	}, &rmmtest.Options{Sequences: rmm.ShortOrLong(80, 300), MaxCommands: 120})
	require.Positive(t, cov.OutOfMemory)
}

// ---------------------------------------------------------------------------------------------
// The arena, fixed-size and binning resources.

// propFixedConfiguration is a configuration that varies only in its number of streams.
func propFixedConfiguration(name string, build func(rmm.MemoryResource) (rmm.MemoryResource, error), opts rmmtest.Options) func(*rand.Rand) rmmtest.Configuration {
	return func(r *rand.Rand) rmmtest.Configuration {
		o := opts
		o.Streams = propStreams(r)
		return rmmtest.Configuration{
			Name: fmt.Sprintf("%s, %d Streams", name, o.Streams),
			NewResource: func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
				mr, err := build(up)
				if err != nil {
					t.Fatalf("building the %s: %v", name, err)
				}
				return mr
			},
			Options: o,
		}
	}
}

func propArena(size int) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
		return rmm.NewArenaMemoryResource(up, &rmm.ArenaOptions{ArenaSize: size, DefaultStreamArenas: 2})
	}
}

// An arena keeps its one upstream allocation until Close (ReleaseKeepsMemory), and fragments.
func TestArenaPropertySystem(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	const size = 16 * propMiB
	cov := rmmtest.RunConfigurations(t, propFixedConfiguration("arena of 16 MiB over SystemMemoryResource", propArena(size), rmmtest.Options{
		Upstream: propSystem,
		DrawSize: func(r *rand.Rand) int {
			if r.IntN(8) == 0 {
				return propLogUniform(r, propMiB, 6*propMiB)
			}
			return propSmallSize(r)
		},
		Capacity:           size,
		DetectsInvalidFree: true,
		ReleaseKeepsMemory: true,
		FullPatterns:       true,
		FreeAfterClose:     true,
	}), &rmmtest.Options{Sequences: rmm.ShortOrLong(40, 120), MaxCommands: 120})
	require.Positive(t, cov.Allocations)
	require.Positive(t, cov.CrossStreamFrees)
	require.Positive(t, cov.InvalidFrees)
	require.Positive(t, cov.OutOfMemory)
}

func TestArenaPropertySimulated(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	const size = 1 * propGiB
	cov := rmmtest.RunConfigurations(t, propFixedConfiguration("arena of 1 GiB over an address-only upstream", propArena(size), rmmtest.Options{
		Upstream: propSimulated(2 * propGiB),
		DrawSize: func(r *rand.Rand) int {
			switch r.IntN(10) {
			case 0, 1:
				return propLogUniform(r, 64*propKiB, 400*propMiB)
			case 2:
				return propMiB * (1 + r.IntN(3))
			}
			return propSmallSize(r)
		},
		Capacity:           size,
		DetectsInvalidFree: true,
		ReleaseKeepsMemory: true,
		FreeAfterClose:     true,
	}), &rmmtest.Options{Sequences: rmm.ShortOrLong(80, 300), MaxCommands: 120})
	require.Positive(t, cov.OutOfMemory)
	require.Positive(t, cov.InvalidFrees)
}

func propFixed(block, prealloc int) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
		return rmm.NewFixedSizeMemoryResource(up, &rmm.FixedSizeOptions{BlockSize: block, BlocksToPreallocate: prealloc})
	}
}

// Blocks of 64 KiB: every size drawn fits one, and the host never runs out.
func TestFixedSizePropertySystem(t *testing.T) {
	cov := rmmtest.RunConfigurations(t, propFixedConfiguration("fixed-size (64 KiB × 4) over SystemMemoryResource", propFixed(64*propKiB, 4), rmmtest.Options{
		Upstream:           propSystem,
		DrawSize:           propSmallSize, // ≤ 64 KiB
		Capacity:           propBeyondHost,
		StrictCapacity:     true,
		DetectsInvalidFree: true,
		FullPatterns:       true,
		FreeAfterClose:     true,
	}), &rmmtest.Options{Sequences: 200, MaxCommands: 120})
	require.Positive(t, cov.Allocations)
	require.Positive(t, cov.CrossStreamFrees)
	require.Positive(t, cov.InvalidFrees)
	require.Positive(t, cov.ReleasesToNothing)
}

// Blocks of 1 MiB over an upstream capped at 3 to 12 MiB. A block holds any request up to 1 MiB,
// so the cap counts blocks, not bytes: when the upstream refuses a chunk is not known exactly.
func TestFixedSizePropertySimulated(t *testing.T) {
	cov := rmmtest.RunConfigurations(t, func(r *rand.Rand) rmmtest.Configuration {
		limit := 3 * propMiB * (1 + r.IntN(4))
		return propFixedConfiguration(fmt.Sprintf("fixed-size (1 MiB × 3) over an address-only upstream capped at %d bytes", limit), propFixed(propMiB, 3), rmmtest.Options{
			Upstream:           propCapped(limit),
			DrawSize:           func(r *rand.Rand) int { return propLogUniform(r, 1, propMiB+1) },
			Capacity:           limit,
			DetectsInvalidFree: true,
			FreeAfterClose:     true,
		})(r)
	}, &rmmtest.Options{Sequences: 300, MaxCommands: 120})
	require.Positive(t, cov.OutOfMemory)
	require.Positive(t, cov.UpstreamRefusals, "growth never ran into the upstream's limit")
}

// Bins of 256 B to 16 KiB over the host. Requests above the largest bin reach the upstream as
// they are; the suite counts every allocation as its size rounded up to 256 inside an upstream
// block, so those are drawn as multiples of 256.
func TestBinningPropertySystem(t *testing.T) {
	binning := func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
		return rmm.NewBinningMemoryResource(up, &rmm.BinningOptions{MinSizeExponent: 8, MaxSizeExponent: 14})
	}
	cov := rmmtest.RunConfigurations(t, propFixedConfiguration("binning (256 B – 16 KiB bins) over SystemMemoryResource", binning, rmmtest.Options{
		Upstream: propSystem,
		DrawSize: func(r *rand.Rand) int {
			n := propSmallSize(r)
			if r.IntN(8) == 0 {
				n = propLogUniform(r, 16*propKiB, propMiB)
			}
			if n > 16*propKiB {
				n = propRoundUp(n)
			}
			return n
		},
		Capacity:       propBeyondHost,
		StrictCapacity: true,
		FullPatterns:   true,
		FreeAfterClose: true,
	}), &rmmtest.Options{Sequences: 100, MaxCommands: 120})
	require.Positive(t, cov.Allocations)
	require.Positive(t, cov.CrossStreamFrees)
}
