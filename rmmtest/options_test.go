package rmmtest

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gormm/rmm"
	"github.com/stretchr/testify/require"
)

// Tests of the options for resources that need more than the defaults (RunConfigurations, the
// pool's, the expandable pool's), each over a resource that breaks what the option checks, and
// over one that keeps it.

// ---------------------------------------------------------------------------------------------
// An upstream that hands freed addresses out again.

// reusingUpstream hands out address-only memory first fit: the lowest free range that holds the
// request, so that memory freed is handed out again at the same address, cut as asked.
type reusingUpstream struct {
	mu   sync.Mutex
	live []span // sorted by address
}

const reusingBase = rmm.DevicePtr(1 << 44)

func newReusing() rmm.MemoryResource { return &reusingUpstream{} }

func (u *reusingUpstream) Allocate(n int, _ rmm.StreamView) (rmm.DevicePtr, error) {
	if n < 0 {
		return 0, fmt.Errorf("%w: negative", rmm.ErrInvalidArgument)
	}
	if n == 0 {
		return 0, nil
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	r := roundUp(n)
	at, i := reusingBase, 0
	for ; i < len(u.live) && u.live[i].addr-at < rmm.DevicePtr(r); i++ {
		at = u.live[i].end()
	}
	u.live = slices.Insert(u.live, i, span{at, r})
	return at, nil
}

func (u *reusingUpstream) Deallocate(p rmm.DevicePtr, n int, _ rmm.StreamView) error {
	if p == 0 {
		return nil
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	i := sort.Search(len(u.live), func(i int) bool { return u.live[i].addr >= p })
	if i == len(u.live) || u.live[i] != (span{p, roundUp(n)}) {
		return fmt.Errorf("%w: reusingUpstream: %#x, %d", rmm.ErrInvalidFree, uintptr(p), n)
	}
	u.live = slices.Delete(u.live, i, i+1)
	return nil
}

func (u *reusingUpstream) Access() rmm.Access { return 0 }

// ---------------------------------------------------------------------------------------------
// A resource with a free reserve block, and PoolStats.

// reserving hands out one upstream block per allocation, and takes a reserve block of 64 KiB
// from the upstream with its first allocation, which it keeps free. A request above 1 GiB fails
// with rmm.ErrOutOfMemory; kind "regrow" first gives the reserve back and takes one of half its
// size in its place (over a first-fit upstream: inside the old one). Kind "refuseFree" also
// refuses requests above 4 KiB, which its reserve would hold. Kind "keepOnClose" keeps the reserve
// after Close. Its PoolStats count the reserve as free.
type reserving struct {
	up   rmm.MemoryResource
	kind string

	mu      sync.Mutex
	live    map[rmm.DevicePtr]int
	reserve span
}

func newReserving(kind string) buildFunc {
	return func(_ tester, up rmm.MemoryResource) rmm.MemoryResource {
		return &reserving{up: up, kind: kind, live: map[rmm.DevicePtr]int{}}
	}
}

func (r *reserving) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	if n < 0 {
		return 0, fmt.Errorf("%w: negative", rmm.ErrInvalidArgument)
	}
	if n == 0 {
		return 0, nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if n > 1<<30 || (r.kind == "refuseFree" && n > 4096) {
		if r.kind == "regrow" && r.reserve.size > rmm.Alignment {
			if err := r.up.Deallocate(r.reserve.addr, r.reserve.size, s); err != nil {
				return 0, err
			}
			half := r.reserve.size / 2
			p, err := r.up.Allocate(half, s)
			if err != nil {
				return 0, err
			}
			r.reserve = span{p, half}
		}
		return 0, fmt.Errorf("%w: reserving refuses %d bytes", rmm.ErrOutOfMemory, n)
	}
	if r.reserve.size == 0 {
		p, err := r.up.Allocate(64<<10, s)
		if err != nil {
			return 0, err
		}
		r.reserve = span{p, 64 << 10}
	}
	p, err := r.up.Allocate(roundUp(n), s)
	if err != nil {
		return 0, err
	}
	r.live[p] = n
	return p, nil
}

func (r *reserving) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	if p == 0 {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if m, ok := r.live[p]; !ok || m != n {
		return fmt.Errorf("%w: reserving: %#x, %d", rmm.ErrInvalidFree, uintptr(p), n)
	}
	delete(r.live, p)
	return r.up.Deallocate(p, roundUp(n), s)
}

func (r *reserving) Stats() rmm.PoolStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := rmm.PoolStats{LiveAllocations: len(r.live), UpstreamBlocks: len(r.live)}
	for _, n := range r.live {
		st.LiveBytes += roundUp(n)
	}
	st.PoolSize = st.LiveBytes + r.reserve.size
	st.FreeBytes = r.reserve.size
	st.LargestFreeBlock = r.reserve.size
	if r.reserve.size > 0 {
		st.UpstreamBlocks++
	}
	return st
}

// Close gives the reserve back (kind "keepOnClose": keeps it).
func (r *reserving) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.reserve.size == 0 || r.kind == "keepOnClose" {
		return nil
	}
	err := r.up.Deallocate(r.reserve.addr, r.reserve.size, rmm.DefaultStream)
	r.reserve = span{}
	return err
}

func (r *reserving) Upstream() rmm.MemoryResource { return r.up }

// The rule the two checkers disagreed on. A failed allocation may give wholly free blocks back to
// the upstream; what it still holds must then be some of the blocks it held, each the very block
// it was. A block lying inside one held before, but not that block, was taken anew (the upstream
// hands freed addresses out again, cut as asked) and is refused. Mapped ranges are not blocks: an
// unmap may leave part of one, and that is accepted.
func TestFailedAllocationKeepsTheSameBlocks(t *testing.T) {
	stats := func(size, blocks int) rmm.PoolStats {
		return rmm.PoolStats{PoolSize: size, FreeBytes: size - 512, LiveBytes: 512, LiveAllocations: 1, UpstreamBlocks: blocks}
	}
	a := span{0x10000, 64 << 10}
	b := span{0x40000, 512}
	live := []span{{0x40000, 300}}
	before := observation{stats: stats(a.size+b.size, 2), held: []span{a, b}, live: live}

	gaveBack := observation{stats: stats(b.size, 1), held: []span{b}, live: live}
	require.NoError(t, unchangedAccounting(before, gaveBack), "the free block given back")

	inner := span{a.addr, a.size / 2} // inside a, not a
	regrown := observation{stats: stats(inner.size+b.size, 2), held: []span{inner, b}, live: live}
	require.ErrorContains(t, unchangedAccounting(before, regrown), "took a new upstream block")

	liveGone := observation{stats: stats(a.size, 1), held: []span{a}, live: live}
	require.ErrorContains(t, unchangedAccounting(before, liveGone), "while the live allocation")

	// The same shapes as mapped ranges: part of a range unmapped is a shrink.
	mb := observation{stats: stats(a.size+b.size, 0), mapped: []span{a, b}, live: live}
	ma := observation{stats: stats(inner.size+b.size, 0), mapped: []span{inner, b}, live: live}
	require.NoError(t, unchangedAccounting(mb, ma))
	outside := observation{stats: stats(4096+b.size, 0), mapped: []span{{a.end(), 4096}, b}, live: live}
	require.ErrorContains(t, unchangedAccounting(mb, outside), "mapped new memory")
}

// The state machine finds a resource that, failing, swaps its reserve for a smaller block at the
// same address, and shrinks the case to its first allocation and the request that fails.
func TestStateMachineFindsBlockRetakenWhileFailing(t *testing.T) {
	opts := Options{Upstream: newReusing, Capacity: 1 << 31, MaxAllocationSize: 64 << 10}
	sm, c := runStateMachine(t, newReserving("regrow"), opts)
	msg := requireShrunk(t, sm, c, 3, "a failed allocation took a new upstream block", "AllocateBeyondCapacity")
	m := regexpFind(t, `took a new upstream block \[(0x[0-9a-f]+), \+(\d+)\) \(held before: \[([^]]*)\]`, msg)
	require.Contains(t, m[3], "["+m[1]+", +65536)", "the new block starts where the old reserve did")
	require.Equal(t, "32768", m[2])

	sm, _ = runStateMachine(t, newReserving(""), opts)
	require.False(t, sm.Failed(), "%v", sm.msgs)
}

// An allocation that fails while PoolStats reported a free block that holds it is a failure.
func TestStateMachineFindsRefusalBesideAFreeBlock(t *testing.T) {
	sm, c := runStateMachine(t, newReserving("refuseFree"), Options{Upstream: newReusing, Capacity: 1 << 31, MaxAllocationSize: 64 << 10})
	requireShrunk(t, sm, c, 2, "out of memory although Stats reported a free block of 65536 bytes")
}

// Close gives everything back, even what Release keeps (Options.ReleaseKeepsMemory).
func TestStateMachineFindsReserveKeptAfterClose(t *testing.T) {
	sm, _ := runStateMachine(t, newReserving("keepOnClose"), Options{Upstream: newReusing, ReleaseKeepsMemory: true, MaxAllocationSize: 64 << 10})
	require.True(t, sm.Failed())
	require.Contains(t, sm.msgs[0], "tearing the resource down failed")
	require.Contains(t, sm.msgs[0], "everything freed and the resource closed, yet the upstream still holds")
}

// ---------------------------------------------------------------------------------------------
// A resource that maps its memory itself.

const (
	mapPage  = 4096
	mapPages = 1 << 16 // a 256 MiB range
)

// mapping maps pages of an address range of its own (address-only, never from the suite's
// upstream): each allocation takes fresh whole pages at the end of what it used; the pages of a
// freed allocation stay mapped until Release, or until a request above 1 GiB, which fails, unmaps
// them. Its PoolStats count the pages it believes mapped. Kinds: "mapOnFail" maps a fresh page
// when it fails (after unmapping the free ones), "unmapLive" also unmaps the pages of live
// allocations at Release (still counting them), "badSize" counts a page more than it maps.
type mapping struct {
	kind string

	mu      sync.Mutex
	base    rmm.DevicePtr
	next    int          // the next page to hand out
	mapped  map[int]bool // page -> mapped
	counted int          // pages mapped, as the resource believes
	live    map[rmm.DevicePtr]int
}

func newMapping(kind string) buildFunc {
	return func(tester, rmm.MemoryResource) rmm.MemoryResource {
		return &mapping{kind: kind, base: 1 << 45, mapped: map[int]bool{}, live: map[rmm.DevicePtr]int{}}
	}
}

func (m *mapping) pagesOf(p rmm.DevicePtr, n int) (first, count int) {
	return int(p-m.base) / mapPage, (roundUp(n) + mapPage - 1) / mapPage
}

func (m *mapping) Allocate(n int, _ rmm.StreamView) (rmm.DevicePtr, error) {
	if n < 0 {
		return 0, fmt.Errorf("%w: negative", rmm.ErrInvalidArgument)
	}
	if n == 0 {
		return 0, nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	count := (roundUp(n) + mapPage - 1) / mapPage
	if n > 1<<30 || m.next+count > mapPages {
		unmapped := m.unmapFree()
		if m.kind == "mapOnFail" && unmapped >= 2 {
			m.mapped[m.next] = true // new memory, beyond what was ever mapped
			m.counted++
			m.next++
		}
		return 0, fmt.Errorf("%w: mapping refuses %d bytes", rmm.ErrOutOfMemory, n)
	}
	p := m.base + rmm.DevicePtr(m.next*mapPage)
	for i := range count {
		m.mapped[m.next+i] = true
	}
	m.counted += count
	m.next += count
	m.live[p] = n
	return p, nil
}

// unmapFree unmaps the pages no live allocation uses and returns how many.
func (m *mapping) unmapFree() int {
	used := map[int]bool{}
	for p, n := range m.live {
		first, count := m.pagesOf(p, n)
		for i := range count {
			used[first+i] = true
		}
	}
	k := 0
	for pg := range m.mapped {
		switch {
		case !used[pg]:
			delete(m.mapped, pg)
			m.counted--
			k++
		case m.kind == "unmapLive":
			delete(m.mapped, pg) // and still counted
		}
	}
	return k
}

func (m *mapping) Deallocate(p rmm.DevicePtr, n int, _ rmm.StreamView) error {
	if p == 0 {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if k, ok := m.live[p]; !ok || k != n {
		return fmt.Errorf("%w: mapping: %#x, %d", rmm.ErrInvalidFree, uintptr(p), n)
	}
	delete(m.live, p)
	return nil
}

func (m *mapping) Release() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.unmapFree()
	return nil
}

func (m *mapping) Access() rmm.Access { return 0 }

func (m *mapping) Stats() rmm.PoolStats {
	m.mu.Lock()
	defer m.mu.Unlock()
	st := rmm.PoolStats{PoolSize: m.counted * mapPage, LiveAllocations: len(m.live)}
	for _, n := range m.live {
		st.LiveBytes += roundUp(n)
	}
	if m.kind == "badSize" && st.PoolSize > 0 {
		st.PoolSize += mapPage
	}
	st.FreeBytes = st.PoolSize - st.LiveBytes
	return st
}

// ranges returns the pages mapped as maximal ranges.
func (m *mapping) ranges() []Range {
	m.mu.Lock()
	defer m.mu.Unlock()
	pages := make([]int, 0, len(m.mapped))
	for pg := range m.mapped {
		pages = append(pages, pg)
	}
	sort.Ints(pages)
	var rs []Range
	for _, pg := range pages {
		addr := m.base + rmm.DevicePtr(pg*mapPage)
		if k := len(rs) - 1; k >= 0 && rs[k].Addr+rmm.DevicePtr(rs[k].Size) == addr {
			rs[k].Size += mapPage
			continue
		}
		rs = append(rs, Range{addr, mapPage})
	}
	return rs
}

func mappedOf(mr rmm.MemoryResource) []Range { return mr.(*mapping).ranges() }

func TestMappedRanges(t *testing.T) {
	opts := Options{Upstream: simulated, Mapped: mappedOf, Capacity: 1 << 31, MaxAllocationSize: 64 << 10, DetectsInvalidFree: true}
	sm, _ := runStateMachine(t, newMapping(""), opts)
	require.False(t, sm.Failed(), "a resource that unmaps free pages when it fails: %v", sm.msgs)

	for kind, want := range map[string]string{
		"mapOnFail": "a failed allocation mapped new memory",
		"unmapLive": "nor inside a range the resource maps",
		"badSize":   "the resource maps",
	} {
		t.Run(kind, func(t *testing.T) {
			sm, c := runStateMachine(t, newMapping(kind), opts)
			requireShrunk(t, sm, c, 4, want)
		})
	}

	// Without Options.Mapped the suite cannot tell where the memory is: the same faults pass
	// (the badly counted PoolSize included).
	opts.Mapped = nil
	for _, kind := range []string{"mapOnFail", "unmapLive", "badSize"} {
		sm, _ := runStateMachine(t, newMapping(kind), opts)
		require.False(t, sm.Failed(), "%s: %v", kind, sm.msgs)
	}
}

// ---------------------------------------------------------------------------------------------
// Capacity, sizes, zero bytes, patterns.

func TestStrictCapacity(t *testing.T) {
	opts := Options{Upstream: simulated, Capacity: 1 << 30}
	sm, _ := runStateMachine(t, newBroken("oom"), opts)
	require.False(t, sm.Failed(), "running out is allowed under a capacity: %v", sm.msgs)
	opts.StrictCapacity = true
	sm, c := runStateMachine(t, newBroken("oom"), opts)
	requireShrunk(t, sm, c, 1, "within Options.Capacity 1073741824, and Options.StrictCapacity is set")

	c, err := resolve(&Options{Capacity: 1 << 20, StrictCapacity: true})
	require.NoError(t, err)
	require.True(t, c.mayRunOut(1<<20-256, 257))
	require.False(t, c.mayRunOut(1<<20-512, 512))
	c, err = resolve(&Options{Capacity: 1 << 20, StrictCapacity: true, MayRunOutOfMemory: true})
	require.NoError(t, err)
	require.True(t, c.mayRunOut(0, 1), "MayRunOutOfMemory wins")
}

// zeroRefusing refuses zero-byte allocations as out of memory.
type zeroRefusing struct{ *brokenResource }

func (z zeroRefusing) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	if n == 0 {
		return 0, fmt.Errorf("%w: zeroRefusing", rmm.ErrOutOfMemory)
	}
	return z.brokenResource.Allocate(n, s)
}

// A zero-byte allocation that fails is a failure, whatever the capacity allows.
func TestStateMachineFindsZeroByteRefusal(t *testing.T) {
	build := func(t tester, up rmm.MemoryResource) rmm.MemoryResource {
		return zeroRefusing{newBroken("")(t, up).(*brokenResource)}
	}
	sm, c := runStateMachine(t, build, Options{Upstream: simulated, Capacity: 1 << 30})
	msg := requireShrunk(t, sm, c, 1)
	require.True(t, strings.Contains(msg, "a zero-byte allocation failed") || strings.Contains(msg, "Allocate(0) = "), msg)
}

// sizeRecording forwards to brokenResource and records the largest size asked.
type sizeRecording struct {
	*brokenResource
	largest *atomic.Int64
	asked   *sync.Map
}

func (r sizeRecording) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	for {
		m := r.largest.Load()
		if int64(n) <= m || r.largest.CompareAndSwap(m, int64(n)) {
			break
		}
	}
	r.asked.Store(n, true)
	return r.brokenResource.Allocate(n, s)
}

func TestDrawSize(t *testing.T) {
	var largest atomic.Int64
	var asked sync.Map
	build := func(t tester, up rmm.MemoryResource) rmm.MemoryResource {
		return sizeRecording{newBroken("")(t, up).(*brokenResource), &largest, &asked}
	}
	draw := func(r *rand.Rand) int { return []int{0, 300, 700}[r.IntN(3)] }
	sm, _ := runStateMachine(t, build, Options{Upstream: simulated, DrawSize: draw, MaxAllocationSize: 1 << 20, Sequences: 20})
	require.False(t, sm.Failed(), "%v", sm.msgs)
	require.EqualValues(t, 700, largest.Load(), "sizes from DrawSize only")
	_, ok := asked.Load(300)
	require.True(t, ok)
}

// scribblingMiddle is brokenResource that, on every allocation, flips a byte of the previous
// allocation at an offset the sampled patterns do not cover (64 KiB + 4,464: past the first
// 4 KiB, and past the 64 bytes sampled at 64 KiB).
type scribblingMiddle struct {
	*brokenResource
	prev *[2]int // pointer, size
}

const scribbleAt = 64<<10 + 4464

func (r scribblingMiddle) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	p, err := r.brokenResource.Allocate(n, s)
	if err == nil && r.prev[0] != 0 {
		r.mu.Lock()
		if _, live := r.live[rmm.DevicePtr(r.prev[0])]; live && r.prev[1] > scribbleAt+patternEdge {
			hostView(rmm.DevicePtr(r.prev[0]), r.prev[1])[scribbleAt] ^= 0xff
		}
		r.mu.Unlock()
	}
	if err == nil && n > 0 {
		r.prev[0], r.prev[1] = int(p), n
	}
	return p, err
}

// FullPatterns finds a scribble the sampled patterns miss.
func TestFullPatterns(t *testing.T) {
	build := func(t tester, up rmm.MemoryResource) rmm.MemoryResource {
		return scribblingMiddle{newBroken("")(t, up).(*brokenResource), new([2]int)}
	}
	opts := Options{Upstream: system, DrawSize: func(*rand.Rand) int { return 200 << 10 }, MaxAllocationSize: 1 << 20, Sequences: 20}
	sm, _ := runStateMachine(t, build, opts)
	require.False(t, sm.Failed(), "sampled patterns do not cover the byte: %v", sm.msgs)
	opts.FullPatterns = true
	sm, c := runStateMachine(t, build, opts)
	requireShrunk(t, sm, c, 2, fmt.Sprintf("byte %d is", scribbleAt))
}

// ---------------------------------------------------------------------------------------------
// Pool-like figures: PoolSize() and MaximumPoolSize() agree with Stats, the maximum never moves.

type poolSizeLying struct{ brokenWithStats }

// PoolSize is off by 256 bytes while something is live.
func (r poolSizeLying) PoolSize() int {
	st := r.Stats()
	if st.LiveAllocations == 0 {
		return st.PoolSize
	}
	return st.PoolSize + rmm.Alignment
}

// maximumMoving reports a maximum one byte larger while something is live.
type maximumMoving struct{ *brokenResource }

func (r maximumMoving) Stats() rmm.PoolStats {
	st := brokenWithStats(r).Stats()
	st.MaximumPoolSize = 1 << 40
	if st.LiveAllocations > 0 {
		st.MaximumPoolSize++
	}
	return st
}

func TestStateMachineFindsPoolFiguresDisagreeing(t *testing.T) {
	sm, c := runStateMachine(t, func(t tester, up rmm.MemoryResource) rmm.MemoryResource {
		return poolSizeLying{brokenWithStats{newBroken("")(t, up).(*brokenResource)}}
	}, Options{Upstream: simulated})
	requireShrunk(t, sm, c, 1, "PoolSize() = ", "but Stats reports PoolSize")

	sm, c = runStateMachine(t, func(t tester, up rmm.MemoryResource) rmm.MemoryResource {
		return maximumMoving{newBroken("")(t, up).(*brokenResource)}
	}, Options{Upstream: simulated})
	requireShrunk(t, sm, c, 1, "when the resource was built")
}

// ---------------------------------------------------------------------------------------------
// Close with allocations live.

// closing is brokenResource with a Close method. After Close, Allocate fails with rmm.ErrClosed
// and Deallocate keeps working; kind "dropsAfterClose" then forgets what is freed without giving
// it back to the upstream.
type closing struct {
	*brokenResource
	drops  bool
	closed *atomic.Bool
}

func newClosing(drops bool) buildFunc {
	return func(t tester, up rmm.MemoryResource) rmm.MemoryResource {
		return closing{newBroken("")(t, up).(*brokenResource), drops, new(atomic.Bool)}
	}
}

func (c closing) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	if n > 0 && c.closed.Load() {
		return 0, fmt.Errorf("%w: closing", rmm.ErrClosed)
	}
	return c.brokenResource.Allocate(n, s)
}

func (c closing) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	if c.drops && c.closed.Load() && p != 0 {
		c.mu.Lock()
		defer c.mu.Unlock()
		delete(c.live, p)
		return nil
	}
	return c.brokenResource.Deallocate(p, n, s)
}

func (c closing) Close() error {
	c.closed.Store(true)
	return nil
}

func TestFreeAfterClose(t *testing.T) {
	opts := Options{Upstream: simulated, FreeAfterClose: true, DetectsInvalidFree: true}
	sm, _ := runStateMachine(t, newClosing(false), opts)
	require.False(t, sm.Failed(), "%v", sm.msgs)

	sm, _ = runStateMachine(t, newClosing(true), opts)
	require.True(t, sm.Failed())
	require.Contains(t, sm.msgs[0], "tearing the resource down failed")
	require.Regexp(t, `closed with \d+ allocations live, which were then freed, yet the upstream still holds`, sm.msgs[0])

	// Without the option the suite frees before it closes: the fault is not reached.
	opts.FreeAfterClose = false
	sm, _ = runStateMachine(t, newClosing(true), opts)
	require.False(t, sm.Failed(), "%v", sm.msgs)
}

// ---------------------------------------------------------------------------------------------
// Checks while goroutines run.

// flickering forwards to its upstream; CheckInvariants fails while an Allocate is under way.
type flickering struct {
	up      rmm.MemoryResource
	inAlloc *atomic.Int64
}

func (f flickering) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	f.inAlloc.Add(1)
	defer f.inAlloc.Add(-1)
	time.Sleep(20 * time.Microsecond)
	return f.up.Allocate(n, s)
}

func (f flickering) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	return f.up.Deallocate(p, n, s)
}

func (f flickering) Upstream() rmm.MemoryResource { return f.up }

func (f flickering) CheckInvariants() error {
	if f.inAlloc.Load() > 0 {
		return errors.New("caught in the middle of an allocation")
	}
	return nil
}

func TestConcurrentInvariants(t *testing.T) {
	build := func(_ tester, up rmm.MemoryResource) rmm.MemoryResource { return flickering{up, new(atomic.Int64)} }
	run := func(opts Options) *recorder {
		opts.Upstream, opts.Seed, opts.IgnoresStreams, opts.MaxAllocationSize = simulated, 5, true, 64<<10
		c, err := resolve(&opts)
		require.NoError(t, err)
		root := newRecorder("T")
		s := &suite{cfg: c, build: build}
		root.run(func(tb tester) { tb.Run("Concurrent", s.testConcurrent) })
		return root
	}
	root := run(Options{})
	require.False(t, root.Failed(), "%v", root.err())
	root = run(Options{ConcurrentInvariants: true})
	require.True(t, root.Failed())
	require.ErrorContains(t, root.err(), "while the goroutines ran: CheckInvariants: caught in the middle of an allocation")

	// Three goroutines: the pairs across goroutines leave the third out.
	root = run(Options{Goroutines: 3})
	require.False(t, root.Failed(), "%v", root.err())
	_, err := resolve(&Options{Goroutines: -1})
	require.ErrorContains(t, err, "Goroutines")
}

// ---------------------------------------------------------------------------------------------
// RunConfigurations.

// runConfigs runs runConfigurations on a recorder and returns the StateMachine recorder and the
// coverage.
func runConfigs(t *testing.T, draw func(*rand.Rand) Configuration, opts Options) (*recorder, *config, Coverage) {
	t.Helper()
	if opts.Seed == 0 {
		opts.Seed = 1
	}
	run, err := resolve(&opts)
	require.NoError(t, err)
	root := newRecorder("T")
	var cov Coverage
	root.run(func(tb tester) {
		tb.Run("StateMachine", func(tb tester) { cov = runConfigurations(tb, draw, run) })
	})
	sm := root.find("StateMachine")
	require.NotNil(t, sm)
	return sm, run, cov
}

// Configurations vary per sequence; a fault of one of them is found, shrunk, and named.
func TestRunConfigurations(t *testing.T) {
	var mu sync.Mutex
	built := map[string]int{}
	draw := func(r *rand.Rand) Configuration {
		limit := 4 << (10 + r.IntN(8)) // 4 KiB .. 512 KiB
		name := fmt.Sprintf("pool over an upstream of %d bytes", limit)
		return Configuration{
			Name: name,
			NewResource: func(_ *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
				mu.Lock()
				built[name]++
				mu.Unlock()
				mr, err := rmm.NewPoolMemoryResource(up, nil)
				if err != nil {
					panic(err)
				}
				return mr
			},
			Options: Options{
				Upstream: func() rmm.MemoryResource {
					sim, _ := rmm.NewSimulatedMemoryResource(limit)
					return sim
				},
				DetectsInvalidFree: true,
				Capacity:           limit,
				DrawSize:           func(r *rand.Rand) int { return r.IntN(limit/2 + 1) },
			},
		}
	}
	sm, _, cov := runConfigs(t, draw, Options{Sequences: 60})
	require.False(t, sm.Failed(), "%v", sm.msgs)
	require.Greater(t, len(built), 3, "configurations drawn anew: %v", built)
	require.GreaterOrEqual(t, cov.Sequences, 60)
	require.Positive(t, cov.Allocations)
	require.Positive(t, cov.OutOfMemory)
	require.Positive(t, cov.BeyondCapacity)
	require.Positive(t, cov.CrossStreamFrees)
	require.Positive(t, cov.InvalidFrees)
	require.Positive(t, cov.Releases)
	require.Positive(t, cov.ReleasesToNothing)
	require.Positive(t, cov.UpstreamRefusals)
	require.Positive(t, cov.UpstreamRetries, "the pool backs off to smaller sizes")
	require.Len(t, sm.logs, 2, "the seed, then the coverage")

	// Half the configurations declare that the resource does not run out: a resource that does
	// fails there, and the report names the configuration of the shrunk sequence.
	faulty := func(r *rand.Rand) Configuration {
		capacity := []int{0, 1 << 30}[r.IntN(2)]
		return Configuration{
			Name: fmt.Sprintf("capacity %d", capacity),
			NewResource: func(_ *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
				return &brokenResource{up: up, kind: "oom", live: map[rmm.DevicePtr]brokenAlloc{}}
			},
			Options: Options{Upstream: simulated, Capacity: capacity},
		}
	}
	sm, c, _ := runConfigs(t, faulty, Options{Seed: 9})
	msg := requireShrunk(t, sm, c, 1, "configuration: capacity 0; ", "Options.Capacity is 0")
	sm2, _, _ := runConfigs(t, faulty, Options{Seed: 9})
	require.Equal(t, msg, sm2.msgs[0], "the same seed replays the same configurations and commands")

	// A configuration whose options do not resolve is reported.
	bad := func(*rand.Rand) Configuration {
		return Configuration{Name: "negative", NewResource: func(*testing.T, rmm.MemoryResource) rmm.MemoryResource { return nil }, Options: Options{Capacity: -1}}
	}
	sm, _, _ = runConfigs(t, bad, Options{})
	require.True(t, sm.Failed())
	require.Contains(t, sm.msgs[0], `configuration "negative": rmmtest: Options.Capacity -1 is negative`)
}

// regexpFind returns the submatches of expr in s, failing t when there are none.
func regexpFind(t *testing.T, expr, s string) []string {
	t.Helper()
	m := regexp.MustCompile(expr).FindStringSubmatch(s)
	require.NotNil(t, m, "%q not in:\n%s", expr, s)
	return m
}
