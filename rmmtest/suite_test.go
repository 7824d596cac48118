package rmmtest

import (
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/gormm/rmm"
	"github.com/stretchr/testify/require"
)

// Tests of the suite itself: it must fail, and shrink, on resources that break the contract.
// The suite runs on a recorder, so the failures are data here.

// brokenResource forwards to its upstream (one piece per allocation, or a shared block for
// "overlap") and keeps a map of what is live, detecting invalid frees; kind selects the fault.
type brokenResource struct {
	up   rmm.MemoryResource
	kind string

	mu    sync.Mutex
	live  map[rmm.DevicePtr]brokenAlloc
	count int // live allocations as reported by Stats
	bytes int
	block rmm.DevicePtr // "overlap": the shared block
	next  int
	prev  rmm.DevicePtr // "scribble": the previous allocation
	// "dropLive": allocations whose upstream block a failed Allocate gave back while they were
	// still live
	dropped map[rmm.DevicePtr]bool
}

type brokenAlloc struct {
	base rmm.DevicePtr // what the upstream returned
	size int           // what was asked
	upN  int           // what was asked of the upstream
}

const brokenBlock = 16 << 20

func newBroken(kind string) func(t tester, up rmm.MemoryResource) rmm.MemoryResource {
	return func(t tester, up rmm.MemoryResource) rmm.MemoryResource {
		r := &brokenResource{up: up, kind: kind, live: map[rmm.DevicePtr]brokenAlloc{}}
		t.Cleanup(r.freeLeftovers)
		if kind == "staleStats" {
			return brokenWithStats{r}
		}
		return r
	}
}

func (r *brokenResource) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	if n < 0 {
		return 0, fmt.Errorf("%w: negative", rmm.ErrInvalidArgument)
	}
	if n == 0 {
		return 0, nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.kind == "crowd" && len(r.live) >= 10 {
		for p := range r.live {
			return p, nil // a live allocation's pointer, handed out again
		}
	}
	if r.kind == "oom" && n > 4096 {
		return 0, fmt.Errorf("%w: brokenResource refuses %d bytes", rmm.ErrOutOfMemory, n)
	}
	if r.kind == "dropLive" && n >= 1<<40 {
		// Out of memory, and "makes room" by giving back the block of a live allocation.
		for p, a := range r.live {
			if !r.dropped[p] {
				r.up.Deallocate(a.base, a.upN, s)
				if r.dropped == nil {
					r.dropped = map[rmm.DevicePtr]bool{}
				}
				r.dropped[p] = true
				break
			}
		}
		return 0, fmt.Errorf("%w: brokenResource refuses %d bytes", rmm.ErrOutOfMemory, n)
	}
	var p rmm.DevicePtr
	a := brokenAlloc{size: n, upN: roundUp(n)}
	switch r.kind {
	case "overlap":
		// Pieces advance by half their rounded size: every piece above 256 bytes overlaps the next.
		if r.block == 0 {
			b, err := r.up.Allocate(brokenBlock, s)
			if err != nil {
				return 0, err
			}
			r.block, r.next = b, 0
		}
		rounded := roundUp(n)
		if r.next+rounded > brokenBlock {
			return 0, fmt.Errorf("%w: overlap block full", rmm.ErrOutOfMemory)
		}
		p = r.block + rmm.DevicePtr(r.next)
		r.next += max(rmm.Alignment, rmm.AlignDown(rounded/2, rmm.Alignment))
	case "misalign":
		if n > 1000 {
			a.upN += rmm.Alignment
		}
		fallthrough
	default:
		b, err := r.up.Allocate(a.upN, s)
		if err != nil {
			return 0, err
		}
		a.base, p = b, b
		if r.kind == "misalign" && n > 1000 {
			p += 8
		}
	}
	if r.kind == "scribble" && r.prev != 0 {
		if _, ok := r.live[r.prev]; ok {
			hostView(r.prev, 1)[0] ^= 0xff
		}
	}
	r.prev = p
	r.live[p] = a
	r.count++
	r.bytes += roundUp(n)
	return p, nil
}

func (r *brokenResource) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	if p == 0 {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	a, ok := r.live[p]
	if !ok || a.size != n {
		if r.kind == "lenient" {
			return nil // claims to detect invalid frees, but ignores them
		}
		return fmt.Errorf("%w: brokenResource: %#x, %d", rmm.ErrInvalidFree, uintptr(p), n)
	}
	delete(r.live, p)
	if r.kind != "staleStats" {
		r.count--
	}
	r.bytes -= roundUp(n)
	switch r.kind {
	case "overlap":
		if len(r.live) == 0 {
			r.next = 0
			b := r.block
			r.block = 0
			return r.up.Deallocate(b, brokenBlock, s)
		}
		return nil
	case "leak":
		return nil // never gives the memory back, and Release does nothing
	}
	if r.dropped[p] {
		delete(r.dropped, p)
		return nil // its block went back already
	}
	return r.up.Deallocate(a.base, a.upN, s)
}

func (r *brokenResource) Upstream() rmm.MemoryResource { return r.up }

// freeLeftovers gives back to the upstream what a failed check left live (after the suite's
// teardown): every SystemMemoryResource shares one table of live pointers, so a block left there
// would be a pointer "handed out" to a later test's resource.
func (r *brokenResource) freeLeftovers() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.kind == "overlap" {
		if r.block != 0 {
			r.up.Deallocate(r.block, brokenBlock, rmm.DefaultStream)
			r.block = 0
		}
		clear(r.live)
		return
	}
	if r.kind == "leak" {
		return // it never gave its blocks back: nothing to tell apart from what it freed
	}
	for p, a := range r.live {
		if !r.dropped[p] {
			r.up.Deallocate(a.base, a.upN, rmm.DefaultStream)
		}
		delete(r.live, p)
	}
	clear(r.dropped)
}

func (r *brokenResource) Release() error { return nil }

// brokenWithStats adds Stats to brokenResource ("staleStats" only).
type brokenWithStats struct{ *brokenResource }

// Stats reports what the resource counts: the live allocations (stale after frees for
// "staleStats") and what it holds from the upstream.
func (r brokenWithStats) Stats() rmm.PoolStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := rmm.PoolStats{LiveAllocations: r.count, LiveBytes: r.bytes}
	for _, a := range r.live {
		st.PoolSize += a.upN
		st.UpstreamBlocks++
	}
	st.FreeBytes = st.PoolSize - st.LiveBytes
	return st
}

func simulated() rmm.MemoryResource {
	sim, err := rmm.NewSimulatedMemoryResource(1 << 40)
	if err != nil {
		panic(err)
	}
	return sim
}

func system() rmm.MemoryResource { return rmm.NewSystemMemoryResource() }

// runStateMachine runs only the state machine over the resources build makes, on a recorder,
// and returns the recorder of the sub-test.
func runStateMachine(t *testing.T, build buildFunc, opts Options) (*recorder, *config) {
	t.Helper()
	if opts.Seed == 0 {
		opts.Seed = 1
	}
	if opts.MaxAllocationSize == 0 {
		opts.MaxAllocationSize = 64 << 10
	}
	c, err := resolve(&opts)
	require.NoError(t, err)
	s := &suite{cfg: c, build: build}
	root := newRecorder("T")
	root.run(func(tb tester) { tb.Run("StateMachine", s.testStateMachine) })
	sm := root.find("StateMachine")
	require.NotNil(t, sm)
	return sm, c
}

// shrunkSteps parses the failure report: the number of commands and the steps.
var (
	stepRE   = regexp.MustCompile(`(?m)^  (=>|  ) +\d+\. `)
	reportRE = regexp.MustCompile(`a sequence of (\d+) commands? fails \(found after \d+ passing sequences; shrunk from (\d+) commands? in (\d+) steps\)`)
)

func requireShrunk(t *testing.T, sm *recorder, c *config, maxSteps int, want ...string) string {
	t.Helper()
	require.True(t, sm.Failed(), "the suite passed a broken resource")
	require.Len(t, sm.msgs, 1)
	msg := sm.msgs[0]
	m := reportRE.FindStringSubmatch(msg)
	require.NotNil(t, m, "no shrink report in:\n%s", msg)
	n, _ := strconv.Atoi(m[1])
	orig, _ := strconv.Atoi(m[2])
	require.LessOrEqual(t, n, maxSteps, "not shrunk enough:\n%s", msg)
	require.LessOrEqual(t, n, orig)
	require.Contains(t, msg, fmt.Sprintf("seed %d: replay with %s=%d", c.seed, SeedEnv, c.seed))
	require.Contains(t, msg, "=> ")
	require.Len(t, stepRE.FindAllString(msg, -1), n, "one line per command:\n%s", msg)
	for _, w := range want {
		require.Contains(t, msg, w, "in:\n%s", msg)
	}
	t.Logf("the report:\n%s", msg)
	return msg
}

func TestStateMachineFindsOverlap(t *testing.T) {
	sm, c := runStateMachine(t, newBroken("overlap"), Options{Upstream: system})
	msg := requireShrunk(t, sm, c, 2, "overlap")
	require.Regexp(t, `1\. Allocate#\d+\(\d+, DefaultStream\) = 0x`, msg, "shrunk to DefaultStream")
}

// A fault that needs ten live allocations is found in a longer sequence and shrunk to eleven
// commands: ten allocations of 1 byte on DefaultStream and the one that goes wrong.
func TestStateMachineShrinks(t *testing.T) {
	sm, c := runStateMachine(t, newBroken("crowd"), Options{Upstream: simulated})
	msg := requireShrunk(t, sm, c, 11, "overlaps the live allocation")
	m := reportRE.FindStringSubmatch(msg)
	orig, _ := strconv.Atoi(m[2])
	require.Greater(t, orig, 11, "the first failing sequence was already minimal: nothing was shrunk")
	require.Equal(t, 11, strings.Count(msg, "Allocate#"), "ten allocations, then the eleventh overlaps")
	require.Len(t, regexp.MustCompile(`Allocate#\d+\(1, DefaultStream\)`).FindAllString(msg, -1), 11, "sizes and streams shrunk")
}

func TestStateMachineFindsMisalignment(t *testing.T) {
	sm, c := runStateMachine(t, newBroken("misalign"), Options{Upstream: simulated})
	msg := requireShrunk(t, sm, c, 1, "not aligned to 256 bytes", "Allocate#")
	// A size above 1000 bytes is what fails; the shrinker halves it towards that.
	m := regexp.MustCompile(`Allocate#\d+\((\d+), DefaultStream\)`).FindStringSubmatch(msg)
	require.NotNil(t, m)
	size, _ := strconv.Atoi(m[1])
	require.Greater(t, size, 1000)
	require.LessOrEqual(t, size, 2048, "the size was not shrunk")
}

func TestStateMachineFindsScribbling(t *testing.T) {
	sm, c := runStateMachine(t, newBroken("scribble"), Options{Upstream: system})
	requireShrunk(t, sm, c, 2, "byte 0 is", "the memory was written by someone else")
}

func TestStateMachineFindsLeakAfterRelease(t *testing.T) {
	sm, c := runStateMachine(t, newBroken("leak"), Options{Upstream: simulated})
	requireShrunk(t, sm, c, 3, "after Release the upstream block", "Release")
}

func TestStateMachineFindsUndetectedInvalidFree(t *testing.T) {
	sm, c := runStateMachine(t, newBroken("lenient"), Options{Upstream: simulated, DetectsInvalidFree: true})
	requireShrunk(t, sm, c, 2, "want an error wrapping rmm.ErrInvalidFree")
}

func TestStateMachineFindsStaleStats(t *testing.T) {
	sm, c := runStateMachine(t, newBroken("staleStats"), Options{Upstream: simulated})
	requireShrunk(t, sm, c, 2, "Stats: 1 live allocations", "the suite holds 0")
}

func TestStateMachineFindsOutOfMemoryWithoutCapacity(t *testing.T) {
	sm, c := runStateMachine(t, newBroken("oom"), Options{Upstream: simulated})
	msg := requireShrunk(t, sm, c, 1, "Options.Capacity is 0")
	require.Contains(t, msg, "= out of memory")
}

// The same seed draws the same sequences, so a failure replays: over an address-only upstream
// (the same addresses every time) the reports are equal.
func TestStateMachineReplays(t *testing.T) {
	sm1, c := runStateMachine(t, newBroken("misalign"), Options{Upstream: simulated, Seed: 42})
	sm2, _ := runStateMachine(t, newBroken("misalign"), Options{Upstream: simulated, Seed: 42})
	require.True(t, sm1.Failed())
	require.Equal(t, sm1.msgs, sm2.msgs)
	require.Contains(t, sm1.msgs[0], fmt.Sprintf("seed %d", c.seed))
}

// A correct resource passes the state machine, and its coverage is logged.
func TestStateMachinePassesSystem(t *testing.T) {
	sm, _ := runStateMachine(t, func(tester, rmm.MemoryResource) rmm.MemoryResource { return rmm.NewSystemMemoryResource() },
		Options{DetectsInvalidFree: true, Sequences: 30})
	require.False(t, sm.Failed(), "%v", sm.msgs)
	require.Len(t, sm.logs, 1)
	require.Contains(t, sm.logs[0], "30 sequences (30 passed)")
}

// The fixed checks catch the broken resources too, each naming what was wrong.
func TestChecklistFindsBrokenResources(t *testing.T) {
	for _, tc := range []struct {
		kind     string
		upstream func() rmm.MemoryResource
		failing  map[string]string // sub-test -> part of its message
		passing  []string
		machine  bool // the state machine passes (the fault needs a request it never makes)
	}{
		{"overlap", system, map[string]string{
			"RandomSizes/DefaultStream": "overlaps the live allocation",
			"Concurrent/RandomSizes":    "overlaps the live allocation",
		}, []string{"DistinctPointers", "ZeroSize"}, false},
		{"misalign", simulated, map[string]string{
			"Alignment":                 "not aligned to 256 bytes",
			"RandomSizes/Stream":        "not aligned to 256 bytes",
			"MixedAllocFree/Stream":     "not aligned to 256 bytes",
			"Concurrent/MixedAllocFree": "not aligned to 256 bytes",
		}, []string{"DistinctPointers"}, false},
		{"oom", simulated, map[string]string{
			"RandomSizes/DefaultStream": "out of memory",
		}, []string{"Sizes", "OutOfMemory"}, false}, // out of memory is allowed for the fixed sizes
		{"leak", simulated, map[string]string{
			"Alignment": "yet the upstream still holds",
		}, []string{"Equality"}, false},
		{"lenient", simulated, map[string]string{}, []string{"Alignment", "RandomSizes", "Concurrent", "CurrentDeviceResource"}, false},
		// Gives a live allocation's upstream block back when it runs out: the upstream then
		// holds fewer blocks, none new, as when a pool gives free memory back.
		{"dropLive", simulated, map[string]string{
			"OutOfMemory": "while the live allocation",
		}, []string{"Alignment", "RandomSizes", "StateMachine"}, true},
	} {
		t.Run(tc.kind, func(t *testing.T) {
			opts := &Options{Upstream: tc.upstream, Seed: 7, Sequences: 5, DetectsInvalidFree: true}
			c, err := resolve(opts)
			require.NoError(t, err)
			root := newRecorder("T")
			root.run(func(tb tester) { runSuite(tb, newBroken(tc.kind), c) })
			require.True(t, root.Failed())
			require.Equal(t, !tc.machine, root.find("StateMachine").Failed())
			for name, want := range tc.failing {
				sub := root.find(name)
				require.NotNil(t, sub, name)
				require.True(t, sub.Failed(), "%s passed", name)
				require.Contains(t, strings.Join(sub.msgs, "\n"), want, name)
			}
			for _, name := range tc.passing {
				sub := root.find(name)
				require.NotNil(t, sub, name)
				require.False(t, sub.Failed(), "%s: %v", name, sub.msgs)
			}
			// Check reports the same failures, prefixed by their checks.
			err = Check(func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
				return newBroken(tc.kind)(nil, up), nil
			}, opts)
			require.Error(t, err)
			if !tc.machine {
				require.Contains(t, err.Error(), "Check/StateMachine: ")
			}
			for name := range tc.failing {
				require.Contains(t, err.Error(), "Check/"+name+": ")
			}
		})
	}
}

func TestResolveOptions(t *testing.T) {
	t.Setenv(SeedEnv, "")
	t.Setenv(ScaleEnv, "")
	os.Unsetenv(SeedEnv)
	os.Unsetenv(ScaleEnv)
	c, err := resolve(nil)
	require.NoError(t, err)
	require.Equal(t, 8<<20, c.maxAllocationSize)
	require.Equal(t, 8<<20, c.maxSize)
	require.Equal(t, 3, c.streams)
	require.Equal(t, 100, c.sequences)
	require.Equal(t, 50, c.maxCommands)
	require.Equal(t, 1, c.scale)
	require.NotZero(t, c.seed)
	require.True(t, sameResource(c.upstream(), rmm.CurrentDeviceResource()))

	c, err = resolve(&Options{Streams: -1, Capacity: 1 << 20, Seed: 5})
	require.NoError(t, err)
	require.Zero(t, c.streams)
	require.Equal(t, 1<<20, c.maxSize, "draws capped at the capacity")
	require.EqualValues(t, 5, c.seed)

	t.Setenv(SeedEnv, "123")
	t.Setenv(ScaleEnv, "3")
	c, err = resolve(&Options{Seed: 5})
	require.NoError(t, err)
	require.EqualValues(t, 123, c.seed, "the environment overrides Options.Seed")
	require.Equal(t, 3, c.scale)

	t.Setenv(SeedEnv, "x")
	_, err = resolve(nil)
	require.ErrorContains(t, err, SeedEnv)
	t.Setenv(SeedEnv, "")
	os.Unsetenv(SeedEnv)
	t.Setenv(ScaleEnv, "0")
	_, err = resolve(nil)
	require.ErrorContains(t, err, ScaleEnv)
	os.Unsetenv(ScaleEnv)
	for _, o := range []Options{{MaxAllocationSize: -1}, {Capacity: -1}, {Sequences: -1}} {
		_, err = resolve(&o)
		require.Error(t, err)
	}
}

// The recording upstream refuses frees it did not hand out and remembers the misuse.
func TestRecordingUpstream(t *testing.T) {
	u := newRecordingUpstream(simulated())
	require.False(t, u.used())
	p, err := u.Allocate(1000, rmm.DefaultStream)
	require.NoError(t, err)
	require.True(t, u.used())
	require.True(t, u.contains(p, 1000))
	require.False(t, u.contains(p, 1001))
	require.False(t, u.contains(p+1000, 1))
	bs, misuse := u.blocks()
	require.Equal(t, []span{{p, 1000}}, bs)
	require.NoError(t, misuse)
	require.ErrorIs(t, u.Deallocate(p, 999, rmm.DefaultStream), rmm.ErrInvalidFree)
	bs, misuse = u.blocks()
	require.Len(t, bs, 1, "a refused free keeps the block")
	require.ErrorContains(t, misuse, "allocated with 1000")
	require.NoError(t, u.Deallocate(p, 1000, rmm.DefaultStream))
	bs, _ = u.blocks()
	require.Empty(t, bs)
	require.Equal(t, rmm.Access(0), u.Access())
	require.NoError(t, u.Deallocate(0, 0, rmm.DefaultStream))
	_, err = u.Allocate(-1, rmm.DefaultStream)
	require.True(t, errors.Is(err, rmm.ErrInvalidArgument))
}

// Patterns: blocks up to 64 KiB hold theirs in every byte, larger ones in sampled regions; a
// change in a checked region is found and named.
func TestPatterns(t *testing.T) {
	covered := func(size int) int {
		n := 0
		patternRegions(size, false, func(off, k int) error {
			require.GreaterOrEqual(t, off, 0)
			require.LessOrEqual(t, off+k, size)
			n += k
			return nil
		})
		return n
	}
	require.Equal(t, 1, covered(1))
	require.Equal(t, 64<<10, covered(64<<10))
	require.Equal(t, 2*patternEdge+15*patternSample, covered(1<<20))

	up := rmm.NewSystemMemoryResource()
	for _, size := range []int{1, 300, 64 << 10, 1<<20 + 3} {
		p, err := up.Allocate(size, rmm.DefaultStream)
		require.NoError(t, err)
		b := &block{ptr: p, size: size, id: uint64(size), written: true}
		writePattern(b)
		require.NoError(t, verifyPattern(b))
		mem := hostView(p, size)
		mem[size-1] ^= 1
		require.ErrorContains(t, verifyPattern(b), fmt.Sprintf("byte %d is", size-1))
		mem[size-1] ^= 1
		require.NoError(t, verifyPattern(b))
		require.NoError(t, up.Deallocate(p, size, rmm.DefaultStream))
	}
}

// Small limits: sizes capped at 256 bytes and DefaultStream only; a resource that runs out at
// 64 KiB live.
func TestCheckSmallLimits(t *testing.T) {
	err := Check(func(rmm.MemoryResource) (rmm.MemoryResource, error) { return rmm.NewSystemMemoryResource(), nil },
		&Options{DetectsInvalidFree: true, IgnoresStreams: true, MaxAllocationSize: 256, Streams: -1, Sequences: 20})
	require.NoError(t, err)
	err = Check(func(rmm.MemoryResource) (rmm.MemoryResource, error) { return rmm.NewSimulatedMemoryResource(64 << 10) },
		&Options{DetectsInvalidFree: true, IgnoresStreams: true, Upstream: simulated, Capacity: 64 << 10, Sequences: 50})
	require.NoError(t, err)
	// The same resource declared unbounded fails: it runs out.
	err = Check(func(rmm.MemoryResource) (rmm.MemoryResource, error) { return rmm.NewSimulatedMemoryResource(64 << 10) },
		&Options{Upstream: simulated, IgnoresStreams: true, Sequences: 50})
	require.ErrorContains(t, err, "Check/RandomSizes/DefaultStream: ")
	require.ErrorContains(t, err, "out of memory")
	require.ErrorContains(t, err, "replay with "+SeedEnv)
}
