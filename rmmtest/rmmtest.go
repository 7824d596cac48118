// Package rmmtest is a conformance suite for implementations of rmm.MemoryResource, as
// testing/slogtest is for slog handlers. A package that writes a resource or an adaptor runs it
// in its own tests:
//
//	func TestMyResource(t *testing.T) {
//		rmmtest.Run(t, func(t *testing.T, upstream rmm.MemoryResource) rmm.MemoryResource {
//			mr, err := mypkg.NewMyResource(upstream, nil)
//			if err != nil {
//				t.Fatal(err)
//			}
//			return mr
//		}, &rmmtest.Options{DetectsInvalidFree: true})
//	}
//
// and the resource is held to every invariant the resources of package rmm are held to.
//
// A resource that wraps another (an adaptor, a sub-allocator) should implement Upstream
// (rmm.Upstreamer) or Access (rmm.Accessible). rmm.AccessOf takes the memory of a resource that
// reports neither as device memory, so the suite writes no patterns into it (the checks of host
// memory are not made, even over host memory), and the containers of package rmm copy to it with
// CUDA; through Upstream the suite also releases and closes what lies between the resource and
// its upstream. The Alignment sub-test logs it (go test -v) when it takes a resource's memory as
// device memory for want of either method on a machine without CUDA.
//
// # What is checked
//
// Run builds a fresh resource for each of its sub-tests (and for each random sequence of the
// state machine) by calling newResource with an upstream: a recording resource over
// Options.Upstream (the current device resource by default) that notes every block it hands out
// and takes back. Sub-allocators and adaptors take their memory from it; leaf resources (those
// that get memory from somewhere else) ignore it.
//
// The fixed sub-tests follow the checklist of librmm's own resource tests (every size is capped
// at Options.MaxAllocationSize and Options.Capacity):
//
//   - Alignment: a non-zero allocation returns a non-null, 256-byte aligned pointer, and the
//     resource reports where its memory can be touched (rmm.AccessOf is not 0), unless the
//     upstream is address-only (rmm.SimulatedMemoryResource).
//   - DistinctPointers: two live 8-byte allocations have different pointers.
//   - ZeroSize: Allocate(0) returns (0, nil) and Deallocate(0, 0) returns nil, on DefaultStream and
//     on a Stream, and the pair changes nothing but counts of calls: rmm.MemoryResource's
//     contract lets a resource count a zero-byte allocation and its free, so across the pair
//     rmm.Statistics' PeakCount and TotalCount may grow, and a Stats of another type than
//     rmm.PoolStats and rmm.Statistics is not compared. The suite frees each zero-byte
//     allocation it makes once, as any other. NegativeSize: Allocate(-1) wraps
//     rmm.ErrInvalidArgument.
//   - Sizes: 4 B, 1 KiB, 1 MiB and 1 GiB (those not above Options.MaxAllocationSize) succeed or
//     fail with rmm.ErrOutOfMemory only. OutOfMemory: 1 PiB fails with rmm.ErrOutOfMemory, a null
//     pointer and a message that names the size (1125899906842624), changes nothing, and the
//     resource keeps working.
//   - RandomSizes: 100 random sizes in [1 B, 5 MiB] allocated, then all freed. MixedAllocFree: 200
//     random steps, 53% allocations, at most 100 live, then everything freed. Both on
//     DefaultStream and on a Stream.
//   - Concurrent: four goroutines (Options.Goroutines) run RandomSizes, Sizes (up to 1 MiB) and
//     MixedAllocFree (one free in five on another stream) at once, spread over the streams; and
//     memory allocated on one goroutine is freed on another (100 allocations of at most 1 MiB
//     each), on the same stream and on another stream. With Options.ConcurrentInvariants one more
//     goroutine calls CheckInvariants and Stats for as long as they run.
//   - CurrentDeviceResource: setting and getting the current device resource from many
//     goroutines is consistent. It changes the process-wide current device resource while it
//     runs and restores it afterwards, so tests that depend on the current resource must not run
//     in parallel with it.
//   - Equality: the resource compares equal to itself as an rmm.MemoryResource (its dynamic type
//     must be comparable); two resources that compare equal must be interchangeable.
//   - ClosedStream: the resource never uses the handle of a stream that was destroyed. FreeOnClosed:
//     memory allocated on a Stream (and on DefaultStream) is freed on the Stream's view after the
//     Stream was closed, and memory allocated on it on another Stream; each free returns nil. FreeThenReuse: memory freed on a Stream that
//     is then closed is allocated and freed again on DefaultStream and on another Stream.
//     AllocateOnClosed: Allocate(0) on a closed Stream returns (0, nil), Deallocate(0, 0) on it
//     returns nil, and the pair changes nothing but counts of calls (as in ZeroSize);
//     Allocate of more on it returns 0 and an error wrapping rmm.ErrClosed and changes nothing
//     (or, when Options.IgnoresStreams is set, succeeds or fails so), and the resource keeps
//     working. ForeignHandle: memory is allocated and freed on
//     a view made with rmm.NewStreamView from a Stream's handle, the Stream is then closed (its
//     handle destroyed), other streams allocate and free, and the resource is released and torn
//     down; on a GPU a later use of the handle crashes or is reported by compute-sanitizer.
//     Skipped when Options.Streams is negative.
//
// The StateMachine sub-test drives the resource with random command sequences (gopter's
// commands API): allocations of random sizes (0, small, multiples of 256, up to
// Options.MaxAllocationSize, or drawn by Options.DrawSize) on random streams, frees on the
// allocating stream and on another one, zero-byte allocate and free, invalid frees (an interior
// pointer, a pointer never handed out, a double free, a wrong size) when
// Options.DetectsInvalidFree is set, requests larger than Options.Capacity when it is set, Release
// when the resource implements rmm.Releaser, and freeing everything. After every step it checks
// that:
//
//   - every live allocation is non-null and 256-byte aligned, and no two overlap; a zero-byte
//     allocation returns (0, nil);
//   - once the resource has taken memory from the upstream, every live allocation lies inside a
//     block the upstream handed out and has not taken back (or inside a range the resource maps
//     itself, Options.Mapped), and the resource never frees to the upstream what it did not get
//     from it;
//   - CheckInvariants() returns nil, when the resource has that method;
//   - Stats() equals the model, when the resource has a Stats() rmm.PoolStats method:
//     LiveAllocations and LiveBytes (each size rounded up to 256) as the live allocations,
//     FreeBytes = PoolSize - LiveBytes, PoolSize and UpstreamBlocks as what the upstream holds
//     (when the resource uses it; PoolSize as what it maps with Options.Mapped), PoolSize within
//     MaximumPoolSize, MaximumPoolSize as when the resource was built; PoolSize() and
//     MaximumPoolSize() methods, where the resource has them, agree with Stats;
//   - an allocation fails only with rmm.ErrOutOfMemory, only as Options.Capacity,
//     Options.StrictCapacity and Options.MayRunOutOfMemory allow, and never while PoolStats
//     reported a free block (LargestFreeBlock) that holds the request;
//   - over host-accessible memory (rmm.AccessOf(mr) has rmm.HostAccessible), a pattern written
//     into every live allocation is intact: blocks up to 64 KiB entirely, larger ones in their
//     first and last 4 KiB and 64 bytes of every 64 KiB between (every byte with
//     Options.FullPatterns);
//   - a failed call changes nothing: after an invalid free nothing observable changes (the value
//     of any Stats() method with no arguments and one result, found by reflection whatever its
//     type, so a resource whose Stats counts refused calls fails here: name such a method
//     otherwise; what the upstream holds, what the resource maps, the patterns);
//     after an out-of-memory error PoolStats' live figures are the same and the upstream holds
//     the same blocks, or (when PoolSize shrank, or without PoolStats the upstream holds fewer
//     blocks: a pool, or a pool under an adaptor, may give wholly free blocks back before it gives
//     up) some of them, each the very block it was — a block inside one held before but not that
//     block is new memory, however the upstream placed it — and none of those given back under a
//     live allocation; mapped ranges may only shrink (each inside one mapped before);
//   - after Release, every block still held from the upstream (and every range mapped) holds part
//     of a live allocation (so with nothing live, nothing is held), unless
//     Options.ReleaseKeepsMemory is set; with Options.HoldsNothingBack, after every step;
//   - with everything freed, accounting is back to zero; after Close, nothing is held from the
//     upstream, nor mapped, whatever Release may keep; a resource with neither Release nor Close
//     holds nothing from the upstream once everything is freed, unless
//     Options.ReleaseKeepsMemory is set. With Options.FreeAfterClose the resource is
//     closed with its allocations live, and they are freed afterwards, whenever an odd number is
//     left.
//
// Wherever the suite frees memory on another stream than the one it was allocated on (the state
// machine's frees on another stream and FreeAllOnMixedStreams, Concurrent's
// AcrossGoroutines/OtherStream), it first records an rmm.Event on the allocating stream and makes
// the freeing stream wait for it, as rmm.MemoryResource's contract asks of a caller, unless
// Options.OrdersCrossStreamFrees is set.
//
// Every resource the suite builds is torn down by freeing what is still live, then calling
// Release (rmm.Releaser) and then Close (a Close() error method), where they exist, on the
// resource and on each resource between it and the upstream when it reaches the upstream through
// rmm.Upstreamer (an adaptor over a pool that newResource built: both are released and closed).
// When the resource that takes memory from the upstream has Release or Close, the upstream must
// then hold nothing. When it has neither, and the suite reaches the upstream through rmm.Upstreamer
// (so no resource it cannot see stands between), the upstream must hold nothing once everything
// is freed: nothing could make the resource give back what it kept (Options.ReleaseKeepsMemory
// declares such a reserve).
//
// # Failures and replaying them
//
// A failing sequence is shrunk to a minimal one, and the failure shows the configuration, the
// shrunk commands with what each returned, what was wrong, the seed, and the command that
// replays it: RMM_PROPERTY_SEED=<seed> go test -run '<the sub-test>'. The seed is
// Options.Seed, or a fresh one for every run when that is 0; the environment variable
// RMM_PROPERTY_SEED overrides both. RMM_PROPERTY_SCALE=k runs k times as many random sequences,
// sizes and steps (a longer search); the default run takes a few seconds for a host-memory
// resource under the race detector.
//
// Check runs the same suite without a testing.T and returns the failures as an error, as
// slogtest.TestHandler does.
//
// # Configurations
//
// RunConfigurations runs the state machine alone over a resource whose configuration (sizes,
// limits, upstream, and what it promises) is drawn anew for every random sequence: a pool's
// initial and maximum sizes, say, over an upstream capped at a random limit. The configuration of
// a failing sequence is kept while its commands are shrunk, and named in the report; the seed
// replays both.
package rmmtest

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gormm/rmm"
)

// Sizes used in the options' defaults and the checks.
const (
	kiB = 1 << 10
	miB = 1 << 20
	giB = 1 << 30
	piB = 1 << 50
)

// Environment variables read by Run and Check.
const (
	// SeedEnv names the environment variable that overrides Options.Seed: a decimal int64.
	SeedEnv = "RMM_PROPERTY_SEED"
	// ScaleEnv names the environment variable that multiplies the number of random sequences,
	// sizes and steps: a positive integer, 1 by default.
	ScaleEnv = "RMM_PROPERTY_SCALE"
)

// Options declares what a resource promises, and how long the random checks run. nil means the
// defaults, each given with its field.
type Options struct {
	// Upstream returns the resource that the suite's recording upstream forwards to. It is
	// called once for every resource the suite builds (one per sub-test, and one per sequence of
	// the state machine), so it may return a fresh resource each time. Use
	// rmm.NewSimulatedMemoryResource for an address-only upstream (addresses without memory,
	// for huge sizes on any machine). Default: rmm.CurrentDeviceResource().
	Upstream func() rmm.MemoryResource

	// DetectsInvalidFree declares that Deallocate returns an error wrapping rmm.ErrInvalidFree,
	// and changes nothing observable, for a pointer the resource did not hand out (including one
	// inside a live allocation and one the resource holds free), for a double free, and for a
	// size other than the one allocated (even one that rounds to the same 256 bytes). Default
	// false: no invalid frees are attempted (a resource over the CUDA driver passes them to the
	// driver, which may not detect them). An adaptor that forwards every free to the upstream it
	// was given does not detect them, even when that upstream would: the suite's recording
	// upstream reports a free of memory it did not hand out as a failure ("upstream misused").
	// Declare it for such an adaptor only when newResource builds the detecting resource under
	// it (e.g. a pool over the upstream).
	DetectsInvalidFree bool

	// MaxAllocationSize is the largest size, in bytes, the suite asks for in its random
	// allocations and in the fixed sizes of the checklist (a fixed size above it is skipped);
	// sizes above it may legitimately be refused with rmm.ErrOutOfMemory. Default 8 MiB.
	MaxAllocationSize int

	// Capacity is the most bytes the resource can have live at once, counting each allocation
	// rounded up to 256 bytes; 0 declares that it does not run out of memory for the sizes the
	// suite asks for. When it is set: the state machine also asks for more than what is left of
	// it (which must fail with rmm.ErrOutOfMemory); its random allocations may fail with
	// rmm.ErrOutOfMemory (fragmentation, growth policy); the checklist's allocations may fail
	// with it once the bytes live plus the request pass half the capacity; the draws are capped
	// at Capacity; and the 1 PiB request is expected to fail only when Capacity is below 1 PiB.
	// Default 0: every allocation the suite asks for must succeed, except the checklist's fixed
	// sizes (Sizes), which may always fail with rmm.ErrOutOfMemory.
	Capacity int

	// MayRunOutOfMemory declares that any allocation may fail with rmm.ErrOutOfMemory, whatever
	// is live — for resources that run out before their capacity (a bump allocator that reuses
	// memory only when everything is freed, a fragmenting arena). A failed allocation must still
	// leave everything as it was. Default false: allocations fail only as Capacity allows.
	MayRunOutOfMemory bool

	// Streams is the number of Streams, besides rmm.DefaultStream, that allocations and frees
	// are spread over. Default 0 means 3; a negative value means DefaultStream only.
	Streams int

	// Sequences is the number of random command sequences the state machine runs (times
	// RMM_PROPERTY_SCALE). Default 100.
	Sequences int

	// MaxCommands is the length of the longest sequence; lengths grow from 1 to it over the run.
	// Default 50.
	MaxCommands int

	// Seed seeds every random choice of the suite. Default 0: a fresh seed for every run. The
	// environment variable RMM_PROPERTY_SEED, when set, overrides it. The seed in use is logged
	// (go test -v) and printed with every failure of a random check.
	Seed int64

	// ReleaseKeepsMemory declares that Release may keep upstream blocks that no live allocation
	// uses (a resource with a reserve it never gives back), and that a resource with neither
	// Release nor Close may keep them for good. Default false: after Release every block held
	// from the upstream holds part of a live allocation, and with nothing live the resource holds
	// nothing from the upstream; a resource that has neither Release nor Close (nor has any
	// resource between it and the upstream, see Run) must hold nothing from the upstream once
	// everything is freed, since nothing could ever make it give memory back.
	ReleaseKeepsMemory bool

	// HoldsNothingBack declares that the resource keeps none of the memory it is told to free:
	// every block it holds from the upstream (and every range it maps, Options.Mapped) holds part
	// of a live allocation after every call. Adaptors that pass each allocation and free on to
	// their upstream (statistics, tracking, limiting, logging) hold nothing back, and so does a
	// resource that gives a block back as soon as nothing in it is live; a pool or a cache does
	// not. The suite checks it wherever it checks the resource against its model (after every
	// step of the state machine, and in the fixed checks), so a free that is dropped fails at
	// the step that dropped it. It is checked through the suite's upstream: memory a resource
	// takes from elsewhere is not seen. Default false: freed memory may be kept until Release
	// or Close.
	HoldsNothingBack bool

	// IgnoresStreams declares that the resource does not look at the stream it is given
	// (rmm.SystemMemoryResource, rmm.CudaMemoryResource, ... and adaptors over them): Allocate on
	// a view of a Stream that was closed may then succeed, as on any stream, or fail with
	// rmm.ErrClosed. Default false: such an Allocate must return 0 and an error wrapping
	// rmm.ErrClosed, and change nothing. An adaptor that hands the stream on inherits this from
	// what is under it: declare it when the upstream ignores streams (the default upstream,
	// rmm.CurrentDeviceResource(), does unless the program set a pool or another stream-ordered
	// resource there). A resource can tell a view of a closed Stream with StreamView.Closed,
	// which makes no driver call.
	IgnoresStreams bool

	// OrdersCrossStreamFrees declares that the resource itself orders a free on one stream after
	// the allocation made on another (and after the work that allocation made the allocating
	// stream wait for), so that the suite frees on another stream without ordering it first.
	// Default false: before every free on another stream than the allocating one, the suite does
	// what rmm.MemoryResource's contract asks of a caller: it records an rmm.Event on the
	// allocating stream and makes the freeing stream wait for it (host no-ops without CUDA). The
	// driver's stream-ordered allocator (cuMemFreeAsync) orders nothing itself: a free it is
	// given unordered is a race (compute-sanitizer's free-before-alloc).
	OrdersCrossStreamFrees bool

	// StrictCapacity declares that nothing but Capacity makes the resource run out of memory: an
	// allocation fails with rmm.ErrOutOfMemory only when the bytes live plus the request, each
	// rounded up to 256, exceed Capacity (a pool without a maximum over an upstream that does not
	// run out for the sizes asked, with Capacity set above what the upstream can ever give).
	// Default false: once Capacity is set, the state machine's allocations may fail with
	// rmm.ErrOutOfMemory whatever is live, and the checklist's once half of Capacity is live.
	// Ignored when Capacity is 0 or MayRunOutOfMemory is set.
	StrictCapacity bool

	// DrawSize, when set, draws the size in bytes of each allocation of the state machine (the
	// fixed checks keep theirs), for a resource whose interesting sizes the default mix misses,
	// such as sizes relative to a limit of its configuration (see RunConfigurations). It must
	// depend only on r, and should return 0 now and then. Default: 0 now and then, sizes up to
	// 1 KiB, multiples of 256 up to 64 KiB, and log-uniform sizes up to MaxAllocationSize (and
	// Capacity).
	DrawSize func(r *rand.Rand) int

	// Mapped, when set, returns the address ranges of the memory that mr (a resource newResource
	// built) holds from somewhere else than its upstream: memory it maps itself, as an expandable
	// pool maps physical memory into an address range it reserved. Adjacent mapped memory is one
	// range. The suite holds the ranges to what it holds the upstream's blocks to: every live
	// allocation lies inside one; PoolStats.PoolSize is their total (plus what the upstream
	// holds), while PoolStats.UpstreamBlocks is not compared; a failed call maps nothing, and a
	// failed allocation may only unmap (each range after it lies inside one before it); after
	// Release each range holds part of a live allocation, unless ReleaseKeepsMemory is set; and
	// once the resource is torn down (Release or Close) none is left. Default nil: the resource's
	// memory comes from its upstream, or from somewhere the suite does not see.
	Mapped func(mr rmm.MemoryResource) []Range

	// FullPatterns makes the suite write its pattern into every byte of every allocation in
	// host-accessible memory, and check every byte, rather than the first and last 4 KiB and 64
	// bytes of every 64 KiB of the allocations above 64 KiB. Slower; for a resource that maps
	// memory itself, where a page mapped twice, or unmapped, under a live allocation shows only
	// in that page's bytes. Default false.
	FullPatterns bool

	// FreeAfterClose declares that memory live when the resource is closed (a Close() error
	// method) stays valid: Deallocate keeps working after Close, and the resource gives the
	// memory back to its upstream once it is freed. The suite then tears down a resource left
	// with an odd number of live allocations (so that a seed replays the same teardown) by
	// closing it (and each resource between it and the upstream, see Run) first and freeing them
	// afterwards. Default false: the suite frees everything before it releases and closes.
	FreeAfterClose bool

	// Goroutines is the number of goroutines the Concurrent checks run at once. Default 0
	// means 4.
	Goroutines int

	// ConcurrentInvariants declares that CheckInvariants and Stats may be called while other
	// goroutines allocate and free. The Concurrent checks then call them from one more goroutine
	// for as long as the others run, and check a PoolStats against itself (FreeBytes = PoolSize -
	// LiveBytes, LargestFreeBlock within [0, FreeBytes], PoolSize within MaximumPoolSize).
	// Default false: they are called only while nothing else runs.
	ConcurrentInvariants bool
}

// Range is the address range [Addr, Addr+Size).
type Range struct {
	Addr rmm.DevicePtr
	Size int
}

// config is Options resolved: defaults filled in, environment applied.
type config struct {
	upstream           func() rmm.MemoryResource
	detectsInvalidFree bool
	maxSize            int // largest drawn size: min(MaxAllocationSize, Capacity)
	mayRunOutAnywhere  bool
	maxAllocationSize  int
	capacity           int
	streams            int
	sequences          int
	maxCommands        int
	seed               int64
	scale              int
	releaseKeeps       bool
	holdsNothingBack   bool
	ignoresStreams     bool
	// ordersCrossStreamFrees: the suite does not order frees on another stream (orderFree).
	ordersCrossStreamFrees bool
	strictCapacity         bool
	drawSize               func(r *rand.Rand) int
	mapped                 func(mr rmm.MemoryResource) []Range
	fullPatterns           bool
	freeAfterClose         bool
	goroutines             int
	concurrentInvariants   bool
}

func resolve(opts *Options) (*config, error) {
	var o Options
	if opts != nil {
		o = *opts
	}
	c := &config{
		upstream:           o.Upstream,
		detectsInvalidFree: o.DetectsInvalidFree,
		maxAllocationSize:  o.MaxAllocationSize,
		capacity:           o.Capacity,
		mayRunOutAnywhere:  o.MayRunOutOfMemory,
		streams:            o.Streams,
		sequences:          o.Sequences,
		maxCommands:        o.MaxCommands,
		seed:               o.Seed,
		scale:              1,
		releaseKeeps:       o.ReleaseKeepsMemory,
		holdsNothingBack:   o.HoldsNothingBack,
		ignoresStreams:     o.IgnoresStreams,

		ordersCrossStreamFrees: o.OrdersCrossStreamFrees,
		strictCapacity:         o.StrictCapacity && o.Capacity > 0 && !o.MayRunOutOfMemory,
		drawSize:               o.DrawSize,
		mapped:                 o.Mapped,
		fullPatterns:           o.FullPatterns,
		freeAfterClose:         o.FreeAfterClose,
		goroutines:             o.Goroutines,
		concurrentInvariants:   o.ConcurrentInvariants,
	}
	if c.upstream == nil {
		c.upstream = currentResource
	}
	switch {
	case c.maxAllocationSize < 0:
		return nil, fmt.Errorf("rmmtest: Options.MaxAllocationSize %d is negative", c.maxAllocationSize)
	case c.capacity < 0:
		return nil, fmt.Errorf("rmmtest: Options.Capacity %d is negative", c.capacity)
	case c.sequences < 0 || c.maxCommands < 0:
		return nil, fmt.Errorf("rmmtest: Options.Sequences %d or MaxCommands %d is negative", c.sequences, c.maxCommands)
	case c.goroutines < 0:
		return nil, fmt.Errorf("rmmtest: Options.Goroutines %d is negative", c.goroutines)
	}
	if c.goroutines == 0 {
		c.goroutines = 4
	}
	if c.maxAllocationSize == 0 {
		c.maxAllocationSize = 8 * miB
	}
	c.maxSize = c.maxAllocationSize
	if c.capacity > 0 {
		c.maxSize = min(c.maxSize, c.capacity)
	}
	switch {
	case c.streams == 0:
		c.streams = 3
	case c.streams < 0:
		c.streams = 0
	}
	if c.sequences == 0 {
		c.sequences = 100
	}
	if c.maxCommands == 0 {
		c.maxCommands = 50
	}
	if s := os.Getenv(SeedEnv); s != "" {
		seed, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("rmmtest: %s=%q is not a decimal int64", SeedEnv, s)
		}
		c.seed = seed
	}
	if c.seed == 0 {
		c.seed = time.Now().UnixNano()
	}
	if s := os.Getenv(ScaleEnv); s != "" {
		k, err := strconv.Atoi(s)
		if err != nil || k <= 0 {
			return nil, fmt.Errorf("rmmtest: %s=%q is not a positive integer", ScaleEnv, s)
		}
		c.scale = k
	}
	return c, nil
}

// mayRunOut reports whether a checklist allocation of n bytes may fail with ErrOutOfMemory while
// live bytes (each rounded to 256) are live.
func (c *config) mayRunOut(live, n int) bool {
	if c.strictCapacity {
		return live+roundUp(n) > c.capacity
	}
	return c.mayRunOutAnywhere || c.capacity > 0 && live+roundUp(n) > c.capacity/2
}

// Run runs the conformance suite against the resources newResource builds, as sub-tests of t.
// newResource is called for every resource the suite needs, with the sub-test it belongs to and
// the upstream to build it over, and may call t.Fatal. The suite frees what it allocated and
// releases and closes what newResource built (see the package documentation). opts declares
// what the resource promises; nil means the defaults (see Options). A resource that wraps another
// should implement Upstream or Access: without them its memory is taken as device memory, and the
// checks of host memory are not made (see the package documentation).
//
// The CurrentDeviceResource sub-test changes the process-wide current device resource while it
// runs. The suites of a process take turns at it, and the default upstream is read between
// turns, so Run may be called from parallel tests (t.Parallel); other code of theirs that uses
// the current device resource may see the resource under test meanwhile.
func Run(t *testing.T, newResource func(t *testing.T, upstream rmm.MemoryResource) rmm.MemoryResource, opts *Options) {
	t.Helper()
	c, err := resolve(opts)
	if err != nil {
		t.Fatal(err)
	}
	runSuite(testT{t}, func(tb tester, up rmm.MemoryResource) rmm.MemoryResource {
		return newResource(tb.(testT).T, up)
	}, c)
}

// Check runs the same suite as Run without a testing.T and returns nil when the resources
// newResource builds pass, else an error joining every failure, each prefixed by the name of its
// check (as slogtest.TestHandler does for slog handlers). An error from newResource fails the
// check that asked for the resource. Checks that cannot run (no second stream, sizes above the
// maximum) are skipped silently.
func Check(newResource func(upstream rmm.MemoryResource) (rmm.MemoryResource, error), opts *Options) error {
	c, err := resolve(opts)
	if err != nil {
		return err
	}
	root := newRecorder("Check")
	root.run(func(tb tester) {
		runSuite(tb, func(tb tester, up rmm.MemoryResource) rmm.MemoryResource {
			mr, err := newResource(up)
			if err != nil {
				tb.Fatalf("newResource: %v", err)
			}
			return mr
		}, c)
	})
	return root.err()
}

// runSuite runs every check as a sub-test of t.
func runSuite(t tester, build buildFunc, c *config) {
	t.Logf("rmmtest: seed %d (replay with %s=%d)", c.seed, SeedEnv, c.seed)
	s := &suite{cfg: c, build: build}
	t.Run("Alignment", s.testAlignment)
	t.Run("DistinctPointers", s.testDistinct)
	t.Run("ZeroSize", s.testZeroSize)
	t.Run("NegativeSize", s.testNegativeSize)
	t.Run("Sizes", s.testSizes)
	t.Run("OutOfMemory", s.testOutOfMemory)
	t.Run("RandomSizes", s.testRandomSizes)
	t.Run("MixedAllocFree", s.testMixed)
	t.Run("Concurrent", s.testConcurrent)
	t.Run("CurrentDeviceResource", s.testCurrentDeviceResource)
	t.Run("Equality", s.testEquality)
	t.Run("ClosedStream", s.testClosedStream)
	t.Run("StateMachine", s.testStateMachine)
}

// buildFunc builds a resource over up for the (sub-)test t.
type buildFunc func(t tester, up rmm.MemoryResource) rmm.MemoryResource

type suite struct {
	cfg   *config
	build buildFunc
}

// replayHint says how to run t again with the same seed.
func replayHint(t tester, seed int64) string {
	if _, ok := t.(testT); !ok {
		return fmt.Sprintf("replay with %s=%d (or Options.Seed = %d)", SeedEnv, seed, seed)
	}
	parts := strings.Split(t.Name(), "/")
	for i, p := range parts {
		parts[i] = "^" + regexp.QuoteMeta(p) + "$"
	}
	return fmt.Sprintf("replay with %s=%d go test -run '%s'", SeedEnv, seed, strings.Join(parts, "/"))
}

// ---------------------------------------------------------------------------------------------
// The testing interface: *testing.T, or a recorder for Check and for testing the suite itself.

// tester is the part of testing.T the suite uses, with Run taking a tester so that the suite
// runs on a recorder too.
type tester interface {
	Helper()
	Name() string
	Logf(format string, args ...any)
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
	Skipf(format string, args ...any)
	Failed() bool
	Cleanup(func())
	Run(name string, f func(t tester)) bool
}

// testT adapts *testing.T.
type testT struct{ *testing.T }

func (t testT) Run(name string, f func(t tester)) bool {
	return t.T.Run(name, func(t *testing.T) { f(testT{t}) })
}

// recorder is a tester that records failures instead of reporting them. Fatalf and Skipf end
// the goroutine running the (sub-)test, as testing.T's do; Run runs f on a new goroutine and
// waits for it.
type recorder struct {
	name     string
	mu       sync.Mutex
	failed   bool
	skipped  bool
	msgs     []string // errors, in order
	logs     []string
	cleanups []func()
	subs     []*recorder
}

func newRecorder(name string) *recorder { return &recorder{name: name} }

func (r *recorder) Helper()      {}
func (r *recorder) Name() string { return r.name }

func (r *recorder) Logf(format string, args ...any) {
	r.mu.Lock()
	r.logs = append(r.logs, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

func (r *recorder) Errorf(format string, args ...any) {
	r.mu.Lock()
	r.failed = true
	r.msgs = append(r.msgs, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

func (r *recorder) Fatalf(format string, args ...any) {
	r.Errorf(format, args...)
	runtime.Goexit()
}

func (r *recorder) Skipf(format string, args ...any) {
	r.mu.Lock()
	r.skipped = true
	r.logs = append(r.logs, fmt.Sprintf(format, args...))
	r.mu.Unlock()
	runtime.Goexit()
}

func (r *recorder) Failed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failed
}

func (r *recorder) Cleanup(f func()) {
	r.mu.Lock()
	r.cleanups = append(r.cleanups, f)
	r.mu.Unlock()
}

// run runs f as the body of r, then r's cleanups (last registered first), on a new goroutine.
func (r *recorder) run(f func(t tester)) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() {
			for i := len(r.cleanups) - 1; i >= 0; i-- {
				r.cleanups[i]()
			}
		}()
		defer func() {
			if p := recover(); p != nil {
				buf := make([]byte, 16<<10)
				buf = buf[:runtime.Stack(buf, false)]
				r.Errorf("panic: %v\n%s", p, buf)
			}
		}()
		f(r)
	}()
	<-done
}

func (r *recorder) Run(name string, f func(t tester)) bool {
	sub := newRecorder(r.name + "/" + strings.ReplaceAll(name, " ", "_"))
	r.mu.Lock()
	r.subs = append(r.subs, sub)
	r.mu.Unlock()
	sub.run(f)
	if sub.Failed() {
		r.mu.Lock()
		r.failed = true
		r.mu.Unlock()
	}
	return !sub.Failed()
}

// err returns the failures of r and its sub-tests, each prefixed by its test's name, then what
// the failing ones logged (how to replay them), joined.
func (r *recorder) err() error {
	var errs []error
	r.walk(func(x *recorder) {
		for _, m := range x.msgs {
			errs = append(errs, fmt.Errorf("%s: %s", x.name, m))
		}
		if len(x.msgs) > 0 {
			for _, l := range x.logs {
				errs = append(errs, fmt.Errorf("%s: %s", x.name, l))
			}
		}
	})
	return errors.Join(errs...)
}

func (r *recorder) walk(f func(*recorder)) {
	f(r)
	for _, s := range r.subs {
		s.walk(f)
	}
}

// find returns the (sub-)recorder named name (relative to r), nil when there is none.
func (r *recorder) find(name string) *recorder {
	var found *recorder
	want := r.name + "/" + name
	r.walk(func(x *recorder) {
		if x.name == want {
			found = x
		}
	})
	return found
}
