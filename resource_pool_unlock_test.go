package rmm

import (
	"errors"
	"fmt"
	randv2 "math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Tests of the pool's driver calls made unlocked (pool_placement.go): growth, cross-stream takes,
// merges and Release racing other goroutines, through the fake device of
// resource_arena_pending_test.go (arenaSyncFake) and its model of stream order, with upstreams
// and virtual memory whose calls can be held on a gate.

// gate holds calls until opened: each held call first reports on entered.
type gate struct {
	mu      sync.Mutex
	ch      chan struct{} // nil: calls pass
	entered chan string
}

func newGate() *gate { return &gate{entered: make(chan string, 64)} }

// shut makes calls wait from now on, until open (at the latest when the test ends, before the
// cleanups registered earlier, such as the Streams' Close, which would wait for held calls).
func (g *gate) shut(t *testing.T) {
	g.mu.Lock()
	g.ch = make(chan struct{})
	g.mu.Unlock()
	t.Cleanup(g.open)
}

// open lets the held calls (and later ones) pass.
func (g *gate) open() {
	g.mu.Lock()
	if g.ch != nil {
		close(g.ch)
		g.ch = nil
	}
	g.mu.Unlock()
}

func (g *gate) pass(what string) {
	g.mu.Lock()
	ch := g.ch
	g.mu.Unlock()
	if ch != nil {
		g.entered <- what
		<-ch
	}
}

// waitEntered waits for a held call.
func (g *gate) waitEntered(t *testing.T) string {
	t.Helper()
	select {
	case w := <-g.entered:
		return w
	case <-time.After(10 * time.Second):
		t.Fatal("no call reached the gate")
		return ""
	}
}

// gatedUpstream wraps a resource: Allocate and Deallocate may be held on gates, the bytes held
// and their peak are counted, and check (when set) is told every block given back first.
type gatedUpstream struct {
	MemoryResource
	alloc, free *gate
	mu          sync.Mutex
	held, peak  int
	calls       int // Allocate calls in flight
	maxCalls    int // the most Allocate calls in flight at once
	delay       time.Duration
	check       func(p DevicePtr, n int) error
	errs        []string
}

func newGatedUpstream(t *testing.T, capacity int) *gatedUpstream {
	sim, err := NewSimulatedMemoryResource(capacity)
	require.NoError(t, err)
	return &gatedUpstream{MemoryResource: sim, alloc: newGate(), free: newGate()}
}

func (u *gatedUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	u.mu.Lock()
	u.calls++
	u.maxCalls = max(u.maxCalls, u.calls)
	u.mu.Unlock()
	defer func() {
		u.mu.Lock()
		u.calls--
		u.mu.Unlock()
	}()
	u.alloc.pass("alloc")
	if u.delay > 0 {
		time.Sleep(u.delay)
	}
	p, err := u.MemoryResource.Allocate(n, s)
	if err == nil {
		u.mu.Lock()
		u.held += n
		u.peak = max(u.peak, u.held)
		u.mu.Unlock()
	}
	return p, err
}

func (u *gatedUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	u.free.pass("free")
	if u.check != nil {
		if err := u.check(p, n); err != nil {
			u.mu.Lock()
			u.errs = append(u.errs, err.Error())
			u.mu.Unlock()
		}
	}
	err := u.MemoryResource.Deallocate(p, n, s)
	if err == nil {
		u.mu.Lock()
		u.held -= n
		u.mu.Unlock()
	}
	return err
}

func (u *gatedUpstream) figures() (held, peak, maxCalls int, errs []string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.held, u.peak, u.maxCalls, append([]string(nil), u.errs...)
}

// gatedVMM wraps a vmm: create and unmap may be held on gates; the bytes mapped and their peak
// are counted, and check (when set) is told every range unmapped first.
type gatedVMM struct {
	vmm
	create_, unmap_ *gate
	mu              sync.Mutex
	mapped, peak    int
	check           func(p DevicePtr, n int) error
	errs            []string
}

func newGatedVMM(limit int) *gatedVMM {
	return &gatedVMM{vmm: newSimVMM(hostVMMGranularity, limit), create_: newGate(), unmap_: newGate()}
}

func (v *gatedVMM) create(n int) (vmmHandle, error) {
	v.create_.pass("create")
	return v.vmm.create(n)
}

func (v *gatedVMM) mapAt(a DevicePtr, n int, h vmmHandle) error {
	if err := v.vmm.mapAt(a, n, h); err != nil {
		return err
	}
	v.mu.Lock()
	v.mapped += n
	v.peak = max(v.peak, v.mapped)
	v.mu.Unlock()
	return nil
}

func (v *gatedVMM) unmap(a DevicePtr, n int) error {
	v.unmap_.pass("unmap")
	if v.check != nil {
		if err := v.check(a, n); err != nil {
			v.mu.Lock()
			v.errs = append(v.errs, err.Error())
			v.mu.Unlock()
		}
	}
	if err := v.vmm.unmap(a, n); err != nil {
		return err
	}
	v.mu.Lock()
	v.mapped -= n
	v.mu.Unlock()
	return nil
}

// poolSyncEnv is a pool whose CUDA calls go to the fake device, with the model of stream order.
type poolSyncEnv struct {
	t   *testing.T
	p   *PoolMemoryResource
	f   *arenaSyncFake
	m   *arenaSyncModel
	def int // the default stream's number in the model
}

// newPoolSyncEnv wires p (just made, with no list yet) to a fake device.
func newPoolSyncEnv(t *testing.T, p *PoolMemoryResource) *poolSyncEnv {
	return newPoolSyncEnvOver(t, p, nil)
}

// newPoolSyncEnvOver wires p (just made, with no list yet) to the fake, which passes the calls on
// to next (the device) when next is not nil.
func newPoolSyncEnvOver(t *testing.T, p *PoolMemoryResource, next *cudaDriver) *poolSyncEnv {
	t.Helper()
	f := newArenaSyncFake(next)
	m := newArenaSyncModel()
	f.model = m
	if next == nil {
		p.ctx = 1
	}
	p.drv = f.driver()
	e := &poolSyncEnv{t: t, p: p, f: f, m: m}
	f.mu.Lock()
	e.def = m.stream(cuStreamLegacy)
	f.mu.Unlock()
	return e
}

// checkReturned makes the model check every range given back to the upstream (or unmapped).
func (e *poolSyncEnv) checkReturned(p DevicePtr, n int) error {
	e.f.mu.Lock()
	defer e.f.mu.Unlock()
	return e.m.returned(p, n)
}

// stream makes one of our Streams with the fake handle h and returns its view, the Stream and its
// number in the model.
func (e *poolSyncEnv) stream(h uintptr, name string) (StreamView, *Stream, int) {
	v, st := arenaSyncStream(e.t, e.f, h, name)
	e.f.mu.Lock()
	defer e.f.mu.Unlock()
	return v, st, e.m.stream(v.h)
}

// foreign makes a foreign stream view with handle h and returns it with its number.
func (e *poolSyncEnv) foreign(h uintptr, id uint64, name string) (StreamView, int) {
	v := arenaSyncForeign(e.f, h, id, name)
	e.f.mu.Lock()
	defer e.f.mu.Unlock()
	return v, e.m.stream(h)
}

// alloc allocates n bytes on s (number i) and checks in the model that s may use them.
func (e *poolSyncEnv) alloc(n int, s StreamView, i int) (DevicePtr, error) {
	ptr, err := e.p.Allocate(n, s)
	if err != nil {
		return 0, err
	}
	rs := e.modelRanges(ptr, n, false)
	e.f.mu.Lock()
	defer e.f.mu.Unlock()
	for _, r := range rs {
		if err == nil {
			err = e.m.allocated(i, r.p, int(r.end-r.p))
		}
	}
	return ptr, err
}

// modelRanges returns where the model knows the n bytes at ptr (live in e.p): the range itself,
// or for a stitched block the pieces of the chain's chunks mapped under it (at their addresses in
// the chain) and, with va, its own range as well (a free notes both: the stitched range must not
// be unmapped before the work behind every free through it is known finished). What makes memory
// safe to hand out is the order after the last free of the same bytes, through whichever address.
func (e *poolSyncEnv) modelRanges(ptr DevicePtr, n int, va bool) []arenaSyncFreed {
	n = AlignDown(n+Alignment-1, Alignment)
	one := []arenaSyncFreed{{p: ptr, end: ptr + DevicePtr(n)}}
	if e.p.stitching() == nil {
		return one
	}
	e.p.mu.Lock()
	a := e.p.stitching().aliases[ptr]
	stitched := a != nil && a.b != nil
	e.p.mu.Unlock()
	if !stitched {
		return one
	}
	var rs []arenaSyncFreed
	for _, x := range stitchPhysOf(e.p, ptr, n) {
		rs = append(rs, arenaSyncFreed{p: x.at, end: x.at + DevicePtr(x.size)})
	}
	if va {
		rs = append(rs, one...)
	}
	return rs
}

func (e *poolSyncEnv) mustAlloc(n int, s StreamView, i int) DevicePtr {
	e.t.Helper()
	ptr, err := e.alloc(n, s, i)
	require.NoError(e.t, err)
	return ptr
}

// free frees ptr on s (number i), noting the free in the model first.
func (e *poolSyncEnv) free(ptr DevicePtr, n int, s StreamView, i int) error {
	rs := e.modelRanges(ptr, n, true)
	e.f.mu.Lock()
	for _, r := range rs {
		e.m.free(i, r.p, int(r.end-r.p))
	}
	e.f.mu.Unlock()
	return e.p.Deallocate(ptr, n, s)
}

func (e *poolSyncEnv) mustFree(ptr DevicePtr, n int, s StreamView, i int) {
	e.t.Helper()
	require.NoError(e.t, e.free(ptr, n, s, i))
}

// done checks the fake saw no call naming a destroyed stream, and the pool's invariants.
func (e *poolSyncEnv) done() {
	e.t.Helper()
	require.Empty(e.t, e.f.errors())
	require.NoError(e.t, e.p.CheckInvariants())
}

// within runs f in a goroutine and reports whether it returned within d; it returns a channel
// that is closed when f returns.
func within(f func(), d time.Duration) (bool, chan struct{}) {
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		f()
	}()
	select {
	case <-ch:
		return true, ch
	case <-time.After(d):
		return false, ch
	}
}

const mib = 1 << 20

// (d) While one goroutine's growth waits in the upstream (cuMemAlloc), allocations that fit in
// free memory are served — on the stream's own list and from another stream's list — and frees
// go on; an allocation that would also need to grow waits for the growth in flight rather than
// calling the upstream at the same time.
func TestPoolUnlockServesWhileGrowing(t *testing.T) {
	u := newGatedUpstream(t, 1<<30)
	p, err := NewPoolMemoryResource(u, nil)
	require.NoError(t, err)
	e := newPoolSyncEnv(t, p)
	sa, _, ia := e.stream(0xa, "A")
	sb, _, ib := e.stream(0xb, "B")
	sc, _, ic := e.stream(0xc, "C")
	x := e.mustAlloc(64*mib, DefaultStream, e.def)
	e.mustFree(x, 64*mib, DefaultStream, e.def) // 64 MiB free in the default stream's list

	u.alloc.shut(t)
	var big DevicePtr
	var bigErr error
	growing := make(chan struct{})
	go func() {
		defer close(growing)
		big, bigErr = e.alloc(128*mib, sa, ia) // does not fit: grows
	}()
	require.Equal(t, "alloc", u.alloc.waitEntered(t))

	var small, other DevicePtr
	var errs [3]error
	ok, _ := within(func() {
		small, errs[0] = e.alloc(2*mib, DefaultStream, e.def) // own list
		other, errs[1] = e.alloc(4*mib, sb, ib)               // another stream's list
		errs[2] = e.free(small, 2*mib, DefaultStream, e.def)  // a free
	}, 5*time.Second)
	require.True(t, ok, "allocations that fit were not served while a growth was in flight")
	require.NoError(t, errors.Join(errs[:]...))

	// A second request that does not fit waits for the growth in flight.
	var second DevicePtr
	var secondErr error
	secondDone := make(chan struct{})
	go func() {
		defer close(secondDone)
		second, secondErr = e.alloc(256*mib, sc, ic)
	}()
	select {
	case <-secondDone:
		t.Fatal("a second growth ran while the first was in flight")
	case w := <-u.alloc.entered:
		t.Fatalf("a second upstream call (%s) was made while the first was in flight", w)
	case <-time.After(100 * time.Millisecond):
	}
	u.alloc.open()
	<-growing
	<-secondDone
	require.NoError(t, bigErr)
	require.NoError(t, secondErr)
	_, _, maxCalls, _ := u.figures()
	require.Equal(t, 1, maxCalls, "upstream calls in flight at once")
	e.mustFree(big, 128*mib, sa, ia)
	e.mustFree(second, 256*mib, sc, ic)
	e.mustFree(other, 4*mib, sb, ib)
	e.done()
	st := p.Stats()
	require.Equal(t, 0, st.LiveBytes)
	require.Equal(t, 64*mib+128*mib+256*mib, st.PoolSize, "each request grew once (the second after the first)")
}

// (a) Expandable pool: the free block at the end, which a growth was sized to extend, is taken
// while the chunk is being created; the growth then searches again (and grows again) instead of
// handing out a block smaller than asked. Meanwhile the taker was served (d). Then the tail block
// is freed on another stream while a growth maps: the new chunk does not coalesce with a block of
// another list, and the pool's chain stays whole.
func TestPoolUnlockExpandableGrowthRacesTail(t *testing.T) {
	vm := newGatedVMM(0)
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30})
	e := newPoolSyncEnv(t, p)
	sa, _, ia := e.stream(0xa, "A")
	sb, _, ib := e.stream(0xb, "B")

	x := e.mustAlloc(12*mib, sa, ia) // maps 32 MiB: 20 MiB free at the end, in A's list
	require.Equal(t, 32*mib, p.PoolSize())

	vm.create_.shut(t)
	var big DevicePtr
	var bigErr error
	growing := make(chan struct{})
	go func() {
		defer close(growing)
		big, bigErr = e.alloc(40*mib, sa, ia) // needs 20 MiB beyond the free tail: a 32 MiB chunk
	}()
	require.Equal(t, "create", vm.create_.waitEntered(t))
	var tail DevicePtr
	ok, _ := within(func() { tail = e.mustAlloc(20*mib, sa, ia) }, 5*time.Second)
	require.True(t, ok, "the free tail was not handed out while the growth was in flight")
	vm.create_.open()
	<-growing
	require.NoError(t, bigErr)
	require.NotEqual(t, tail, big)
	require.NoError(t, p.CheckInvariants())
	// The first chunk (32 MiB) was too small once the tail was taken: a second growth mapped the
	// request whole.
	st := p.Stats()
	require.Equal(t, 3, st.UpstreamBlocks)
	require.Equal(t, 12*mib+20*mib+40*mib, st.LiveBytes)
	require.Equal(t, 3*32*mib, st.PoolSize)
	e.mustFree(big, 40*mib, sa, ia)

	// The end of the chain is now free in A's list; free the block before it on B while a growth
	// for C extends the chain. Fill the free end first so the growth starts from a live tail.
	free := p.Stats().FreeBytes
	fill := e.mustAlloc(free, sa, ia)
	vm.create_.shut(t)
	sc, _, ic := e.stream(0xc, "C")
	var c DevicePtr
	var cErr error
	growing = make(chan struct{})
	go func() {
		defer close(growing)
		c, cErr = e.alloc(64*mib, sc, ic)
	}()
	vm.create_.waitEntered(t)
	ok, _ = within(func() { e.mustFree(fill, free, sb, ib) }, 5*time.Second)
	require.True(t, ok, "a free waited for a growth")
	vm.create_.open()
	<-growing
	require.NoError(t, cErr)
	require.NoError(t, p.CheckInvariants())
	e.mustFree(c, 64*mib, sc, ic)
	e.mustFree(tail, 20*mib, sa, ia)
	e.mustFree(x, 12*mib, sa, ia)
	vm.check = e.checkReturned
	require.NoError(t, p.Release())
	e.done()
	require.Empty(t, vm.errs)
	require.Equal(t, 0, p.PoolSize())
}

// (c) Two takes from one list of a lazy stream A race A's Close. The first take records A's
// event unlocked (held in the driver); the second must not wait on the event's older record (it
// records again itself), and A's Close must not destroy the stream while the first record is in
// flight. In the model, each taker is ordered after A's frees.
func TestPoolUnlockTakeRacesTakeAndStreamClose(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, nil)
	e := newPoolSyncEnv(t, p)
	sa, stA, ia := e.stream(0xa, "A")
	sb, _, ib := e.stream(0xb, "B")
	sc, _, ic := e.stream(0xc, "C")
	x := e.mustAlloc(4*mib, sa, ia)
	y := e.mustAlloc(4*mib, sa, ia) // two upstream blocks of 4 MiB
	e.mustFree(x, 4*mib, sa, ia)
	e.mustFree(y, 4*mib, sa, ia)

	g := e.holdFirst(t, "record-and-wait")
	var bp DevicePtr
	var bErr error
	bDone := make(chan struct{})
	go func() {
		defer close(bDone)
		bp, bErr = e.alloc(4*mib, sb, ib)
	}()
	g.waitEntered(t) // B took one block; its record of A's event is in flight

	var cp DevicePtr
	var cErr error
	ok, _ := within(func() { cp, cErr = e.alloc(4*mib, sc, ic) }, 5*time.Second)
	require.True(t, ok, "a take waited for another take's record")
	require.NoError(t, cErr, "C's take is not ordered after A's frees")

	closed, closeDone := within(func() { require.NoError(t, stA.Close()) }, 100*time.Millisecond)
	require.False(t, closed, "A's Close returned while a record on A was in flight")
	g.open()
	<-bDone
	<-closeDone
	e.f.kill(sa.h)
	require.NoError(t, bErr, "B's take is not ordered after A's frees")
	require.NotEqual(t, bp, cp)
	e.mustFree(bp, 4*mib, sb, ib)
	e.mustFree(cp, 4*mib, sc, ic)
	e.done()
}

// A merge of another stream's list into ours keeps the merged blocks out of every list until the
// wait is queued: a third stream that asks for them meanwhile does not get them unordered.
func TestPoolUnlockMergeHidesBlocksUntilWaited(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{MaximumPoolSize: 16 * mib})
	e := newPoolSyncEnv(t, p)
	sa, _, ia := e.stream(0xa, "A")
	sb, _, ib := e.stream(0xb, "B")
	ss, _, is := e.stream(0xd, "S")
	st, _, it := e.stream(0xe, "T")
	p1 := e.mustAlloc(4*mib, ss, is) // the pool grows by 8 MiB (half the headroom)
	p2 := e.mustAlloc(2*mib, ss, is)
	p3 := e.mustAlloc(2*mib, ss, is)
	require.Equal(t, 8*mib, p.PoolSize())
	e.mustFree(p1, 4*mib, sa, ia)
	e.mustFree(p2, 2*mib, sb, ib)

	g := e.holdFirst(t, "record-and-wait")
	var sp DevicePtr
	var sErr error
	sDone := make(chan struct{})
	go func() {
		defer close(sDone)
		sp, sErr = e.alloc(6*mib, ss, is) // no list holds 6 MiB: merges A's, then B's
	}()
	g.waitEntered(t)
	var tp DevicePtr
	var tErr error
	tDone := make(chan struct{})
	go func() {
		defer close(tDone)
		tp, tErr = e.alloc(4*mib, st, it)
	}()
	time.Sleep(50 * time.Millisecond) // T searches while S's wait is held
	g.open()
	<-sDone
	<-tDone
	require.NoError(t, sErr)
	require.NoError(t, tErr, "T got memory merged into S's list before S waited for it")
	e.mustFree(sp, 6*mib, ss, is)
	e.mustFree(tp, 4*mib, st, it)
	e.mustFree(p3, 2*mib, ss, is)
	e.done()
}

// (b) Release races an allocation and frees: a block freed while Release waits for the streams
// (unlocked) is not given back before its work is seen finished; while the upstream's frees are
// held, frees and allocations that fit are served, and an allocation that must grow waits for
// the Release; the blocks being given back are never handed out.
func TestPoolUnlockReleaseRacesAllocateAndFree(t *testing.T) {
	u := newGatedUpstream(t, 1<<30)
	p, err := NewPoolMemoryResource(u, nil)
	require.NoError(t, err)
	e := newPoolSyncEnv(t, p)
	u.check = e.checkReturned
	sa, _, ia := e.stream(0xa, "A")
	sb, _, ib := e.stream(0xb, "B")
	u1 := e.mustAlloc(8*mib, sa, ia) // upstream block #1
	u2 := e.mustAlloc(8*mib, sa, ia) // #2
	u3 := e.mustAlloc(16*mib, sb, ib)
	z := e.mustAlloc(32*mib, sa, ia)
	e.mustFree(u1, 8*mib, sa, ia)
	e.mustFree(u2, 8*mib, sb, ib)

	// z is freed in the middle of Release's first synchronisation.
	var once atomic.Bool
	var zErr error
	e.f.mu.Lock()
	e.f.onCall = func(op string) {
		if op == "event-sync" && once.CompareAndSwap(false, true) {
			zErr = e.free(z, 32*mib, sa, ia)
		}
	}
	e.f.mu.Unlock()
	u.free.shut(t)
	var relErr error
	relDone := make(chan struct{})
	go func() {
		defer close(relDone)
		relErr = p.Release()
	}()
	require.Equal(t, "free", u.free.waitEntered(t))
	require.True(t, once.Load(), "z was freed during the synchronisation")
	require.NoError(t, zErr)

	var got DevicePtr
	ok, _ := within(func() {
		e.mustFree(u3, 16*mib, sb, ib)
		got = e.mustAlloc(16*mib, sb, ib) // B's own free block
	}, 5*time.Second)
	require.True(t, ok, "a free or an allocation that fits waited for Release")
	require.Equal(t, u3, got)
	var grown DevicePtr
	var grownErr error
	growDone := make(chan struct{})
	go func() {
		defer close(growDone)
		grown, grownErr = e.alloc(64*mib, sa, ia)
	}()
	select {
	case <-growDone:
		t.Fatal("an allocation that must grow did not wait for Release")
	case <-time.After(50 * time.Millisecond):
	}
	u.free.open()
	<-relDone
	<-growDone
	require.NoError(t, relErr)
	require.NoError(t, grownErr)
	for _, q := range []DevicePtr{got, grown} {
		require.NotContains(t, []DevicePtr{u1, u2, z}, q, "a block being given back was handed out")
	}
	_, _, _, errs := u.figures()
	require.Empty(t, errs)
	e.mustFree(got, 16*mib, sb, ib)
	e.mustFree(grown, 64*mib, sa, ia)
	e.done()
	require.NoError(t, p.Release())
	held, _, _, errs := u.figures()
	require.Empty(t, errs)
	require.Equal(t, 0, held)
	require.Equal(t, 0, p.PoolSize())
}

// The expandable pool's trim (ReleaseThreshold) and Release race frees and allocations: every
// chunk unmapped holds only memory whose work the host saw finish.
func TestPoolUnlockExpandableTrimRaces(t *testing.T) {
	vm := newGatedVMM(0)
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30, ReleaseThreshold: 1})
	e := newPoolSyncEnv(t, p)
	vm.check = e.checkReturned
	var ss []StreamView
	var is []int
	for i := range 3 {
		s, _, k := e.stream(uintptr(0xa0+i), fmt.Sprintf("S%d", i))
		ss, is = append(ss, s), append(is, k)
	}
	r := randv2.New(randv2.NewPCG(7, 7))
	var mu sync.Mutex
	type live struct {
		p DevicePtr
		n int
	}
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []live
			for range 150 {
				mu.Lock()
				n := (1 + r.IntN(40)) * mib
				k := r.IntN(3)
				drop := r.IntN(3) == 0 || len(mine) > 4
				mu.Unlock()
				if drop && len(mine) > 0 {
					x := mine[0]
					mine = mine[1:]
					if err := e.free(x.p, x.n, ss[k], is[k]); err != nil {
						t.Error(err)
						return
					}
					continue
				}
				q, err := e.alloc(n, ss[w], is[w])
				if err != nil {
					t.Error(err)
					return
				}
				mine = append(mine, live{q, n})
			}
			for _, x := range mine {
				if err := e.free(x.p, x.n, ss[w], is[w]); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	stop := make(chan struct{})
	relDone := make(chan struct{})
	go func() {
		defer close(relDone)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := p.Release(); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	wg.Wait()
	close(stop)
	<-relDone
	require.Empty(t, vm.errs)
	e.done()
	require.NoError(t, p.Release())
	require.Empty(t, vm.errs)
	require.Equal(t, 0, p.PoolSize())
}

// (e) Concurrent allocations that all need to grow never take the pool past its maximum: the
// upstream never holds more than MaximumPoolSize bytes (a capped pool also gives memory back
// before failing, and the gives-back and the growths do not overlap), for the plain pool and the
// expandable pool.
func TestPoolUnlockConcurrentGrowthRespectsMaximum(t *testing.T) {
	const maximum = 64 * mib
	run := func(t *testing.T, p *PoolMemoryResource, peak func() int) {
		var wg sync.WaitGroup
		var served, refused atomic.Int64
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := randv2.New(randv2.NewPCG(uint64(w), 3))
				var mine [][2]int
				for range 60 {
					if len(mine) > 2 || (len(mine) > 0 && r.IntN(2) == 0) {
						x := mine[0]
						mine = mine[1:]
						require.NoError(t, p.Deallocate(DevicePtr(x[0]), x[1], DefaultStream))
						continue
					}
					n := (1 + r.IntN(12)) * mib
					q, err := p.Allocate(n, DefaultStream)
					if err != nil {
						var oom *OutOfMemoryError
						require.ErrorAs(t, err, &oom)
						refused.Add(1)
						continue
					}
					served.Add(1)
					mine = append(mine, [2]int{int(q), n})
					require.LessOrEqual(t, p.PoolSize(), maximum)
					if r.IntN(8) == 0 {
						require.NoError(t, p.Release())
					}
				}
				for _, x := range mine {
					require.NoError(t, p.Deallocate(DevicePtr(x[0]), x[1], DefaultStream))
				}
			}()
		}
		wg.Wait()
		require.NoError(t, p.CheckInvariants())
		require.LessOrEqual(t, peak(), maximum, "the upstream held more than the maximum at once")
		require.LessOrEqual(t, p.Stats().PeakPoolSize, maximum)
		require.Positive(t, served.Load())
		t.Logf("served %d, refused %d, peak %d MiB", served.Load(), refused.Load(), peak()/mib)
	}
	t.Run("plain", func(t *testing.T) {
		u := newGatedUpstream(t, 1<<30)
		u.delay = 100 * time.Microsecond
		p, err := NewPoolMemoryResource(u, &PoolOptions{MaximumPoolSize: maximum})
		require.NoError(t, err)
		run(t, p, func() int { _, pk, _, _ := u.figures(); return pk })
	})
	t.Run("expandable", func(t *testing.T) {
		vm := newGatedVMM(0)
		p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: maximum})
		run(t, p, func() int { vm.mu.Lock(); defer vm.mu.Unlock(); return vm.peak })
	})
}

// Goroutines on our Streams, a foreign stream and the default stream allocate, free on random
// streams (so that blocks pass from stream to stream through takes and merges) and Release, in a
// capped pool (so that it grows, merges and gives back before failing): in the model every block
// handed to a stream is ordered after the frees of its bytes on other streams, and every block
// given back to the upstream was seen finished.
func TestPoolUnlockConcurrentStreamOrder(t *testing.T) {
	for _, expandable := range []bool{false, true} {
		t.Run(fmt.Sprint("expandable=", expandable), func(t *testing.T) {
			var p *PoolMemoryResource
			var u *gatedUpstream
			var vm *gatedVMM
			if expandable {
				vm = newGatedVMM(0)
				p = newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 256 * mib})
			} else {
				u = newGatedUpstream(t, 1<<30)
				var err error
				p, err = NewPoolMemoryResource(u, &PoolOptions{MaximumPoolSize: 64 * mib})
				require.NoError(t, err)
			}
			e := newPoolSyncEnv(t, p)
			if u != nil {
				u.check = e.checkReturned
			} else {
				vm.check = e.checkReturned
			}
			ss := []StreamView{DefaultStream}
			is := []int{e.def}
			for i := range 3 {
				s, _, k := e.stream(uintptr(0xa0+i), fmt.Sprintf("S%d", i))
				ss, is = append(ss, s), append(is, k)
			}
			fs, fi := e.foreign(0xf0, 9, "F")
			ss, is = append(ss, fs), append(is, fi)
			poolUnlockWalk(t, e, ss, is, 200)
			require.NoError(t, p.Release())
			if u != nil {
				held, _, _, errs := u.figures()
				require.Empty(t, errs)
				require.Equal(t, 0, held)
			} else {
				require.Empty(t, vm.errs)
			}
			require.Equal(t, 0, p.PoolSize())
		})
	}
}

// poolUnlockWalk runs one goroutine per stream of ss (numbered is in the model): each allocates
// on its stream, frees on random streams and (the first) calls Release, ops times; then it
// checks the fake's errors and the pool's invariants.
func poolUnlockWalk(t *testing.T, e *poolSyncEnv, ss []StreamView, is []int, ops int) {
	p := e.p
	var wg sync.WaitGroup
	for w := range len(ss) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := randv2.New(randv2.NewPCG(uint64(w), 11))
			type live struct {
				p DevicePtr
				n int
			}
			var mine []live
			for range ops {
				switch k := r.IntN(10); {
				case k < 4 && len(mine) > 0:
					i := r.IntN(len(mine))
					x := mine[i]
					mine = append(mine[:i], mine[i+1:]...)
					o := r.IntN(len(ss))
					if err := e.free(x.p, x.n, ss[o], is[o]); err != nil {
						t.Error(err)
						return
					}
				case k == 4 && w == 0:
					if err := p.Release(); err != nil {
						t.Error(err)
						return
					}
				default:
					n := []int{256 << 10, 1 * mib, 2 * mib, 3*mib + 512, 8 * mib}[r.IntN(5)]
					q, err := e.alloc(n, ss[w], is[w])
					var oom *OutOfMemoryError
					if errors.As(err, &oom) {
						continue
					}
					if err != nil {
						t.Error(err)
						return
					}
					mine = append(mine, live{q, n})
				}
			}
			for _, x := range mine {
				if err := e.free(x.p, x.n, ss[w], is[w]); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	e.done()
}

// A free on a closed Stream waits for the device (cuCtxSynchronize) unlocked: meanwhile other
// streams are served, and the block being freed cannot be freed twice. (An allocation that would
// need it, or growth, waits for the free to end.)
func TestPoolUnlockFreeOnClosedStream(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, nil)
	e := newPoolSyncEnv(t, p)
	sa, stA, ia := e.stream(0xa, "A")
	sb, _, ib := e.stream(0xb, "B")
	x := e.mustAlloc(4*mib, sa, ia)
	y := e.mustAlloc(4*mib, sb, ib)
	y2 := e.mustAlloc(4*mib, sb, ib)
	e.mustFree(y, 4*mib, sb, ib) // 2 × 4 MiB free in B's list
	e.mustFree(y2, 4*mib, sb, ib)
	require.NoError(t, stA.Close())
	e.f.kill(sa.h)

	var during []DevicePtr
	var duringErrs []error
	var once atomic.Bool
	e.f.mu.Lock()
	e.f.onSync = func() {
		if !once.CompareAndSwap(false, true) {
			return
		}
		// Inside the free's cuCtxSynchronize: two 4 MiB requests on B, served from B's list,
		// and a second free of x, which fails.
		for range 2 {
			q, err := e.alloc(4*mib, sb, ib)
			during, duringErrs = append(during, q), append(duringErrs, err)
		}
		duringErrs = append(duringErrs, p.Deallocate(x, 4*mib, sb))
	}
	e.f.mu.Unlock()
	ok, _ := within(func() { e.mustFree(x, 4*mib, sa, ia) }, 5*time.Second)
	require.True(t, ok, "the free on a closed stream, or the allocations within its synchronisation, did not end")
	require.True(t, once.Load())
	require.NoError(t, duringErrs[0])
	require.NoError(t, duringErrs[1])
	require.ErrorIs(t, duringErrs[2], ErrInvalidFree, "a second free of the block in flight")
	require.ElementsMatch(t, []DevicePtr{y, y2}, during)
	st := p.Stats()
	require.Equal(t, 8*mib, st.LiveBytes, "x is free")
	require.Equal(t, 4*mib, st.PerStream[0].FreeBytes, "x is in the default stream's list")
	for _, q := range during {
		e.mustFree(q, 4*mib, sb, ib)
	}
	e.done()
}

// holdFirst shuts a gate that the first driver call named op passes (and waits at until the gate
// is opened); later calls go through.
func (e *poolSyncEnv) holdFirst(t *testing.T, op string) *gate {
	g := newGate()
	g.shut(t)
	var once atomic.Bool
	e.f.mu.Lock()
	e.f.onCall = func(name string) {
		if name == op && once.CompareAndSwap(false, true) {
			g.pass(name)
		}
	}
	e.f.mu.Unlock()
	return g
}
