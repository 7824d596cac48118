package rmmtest

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/gormm/rmm"
)

// instance is one resource under test: the resource, its recording upstream, the streams the
// checks use, and the model of what is live (every allocation the suite holds).
type instance struct {
	cfg      *config
	up       *recordingUpstream
	upAccess rmm.Access // where the upstream's memory can be touched
	mr       rmm.MemoryResource
	access   rmm.Access
	streams  []*rmm.Stream
	views    []rmm.StreamView // [0] is DefaultStream, then streams

	// events[i] orders a free on another stream after the work queued on views[i] (made on first
	// use, under eventsMu); closedViews[i] is set once the suite closed the Stream behind views[i].
	eventsMu    sync.Mutex
	events      []*rmm.Event
	closedViews []bool

	invariants func() error // CheckInvariants, nil when the resource has none
	stats      func() any   // Stats, nil when the resource has none
	releaser   rmm.Releaser // nil when the resource is not one
	poolSize   func() int   // PoolSize, nil when the resource has none
	maximum    func() int   // MaximumPoolSize, nil when the resource has none
	mapped     func() []span
	// initialMaximum is PoolStats.MaximumPoolSize when the resource was built (-1 without
	// PoolStats): it never changes.
	initialMaximum int

	mu        sync.Mutex
	live      map[rmm.DevicePtr]*block
	liveBytes int // sum of the live sizes rounded up to 256
	nextID    atomic.Uint64
	closed    bool

	// reserved counts (rounded) bytes from before Allocate is called until after Deallocate
	// returns, so that it is never below what the resource holds for the suite, even while
	// goroutines allocate and free at once; peak is its maximum. concurrent makes out-of-memory
	// tolerance (config.mayRunOut) judge by the peak.
	reserved, peak atomic.Int64
	concurrent     bool
}

// orderFreeHook, when set (by the suite's own tests), is called with the two streams of every
// free that orderFree ordered.
var orderFreeHook func(from, to rmm.StreamView)

// block is a live allocation of the model.
type block struct {
	ptr     rmm.DevicePtr
	size    int
	stream  int // index into views
	id      uint64
	written bool // a pattern was written into it
	full    bool // in every byte (Options.FullPatterns), not in samples
}

func (b *block) String() string {
	return fmt.Sprintf("[%#x, +%d) on %s", uintptr(b.ptr), b.size, streamName(b.stream))
}

// newInstance builds a resource with build over a fresh recording upstream, and nstreams Streams
// on its device. The instance is torn down (finish) by a cleanup of t; a failure of the teardown
// fails t.
func (s *suite) newInstance(t tester, nstreams int) *instance {
	t.Helper()
	in := s.newInstanceNoCleanup(t, nstreams)
	t.Cleanup(func() {
		if err := in.finish(); err != nil {
			t.Errorf("tearing the resource down: %v", err)
		}
	})
	return in
}

func (s *suite) newInstanceNoCleanup(t tester, nstreams int) *instance {
	t.Helper()
	inner := s.cfg.upstream()
	if inner == nil {
		t.Fatalf("Options.Upstream returned nil")
	}
	up := newRecordingUpstream(inner)
	mr := s.build(t, up)
	if mr == nil {
		t.Fatalf("newResource returned a nil resource")
	}
	in := &instance{
		cfg:      s.cfg,
		up:       up,
		upAccess: rmm.AccessOf(inner),
		mr:       mr,
		access:   rmm.AccessOf(mr),
		views:    []rmm.StreamView{rmm.DefaultStream},
		live:     map[rmm.DevicePtr]*block{},
	}
	if c, ok := mr.(interface{ CheckInvariants() error }); ok {
		in.invariants = c.CheckInvariants
	}
	in.stats = statsFunc(mr)
	in.releaser, _ = mr.(rmm.Releaser)
	if p, ok := mr.(interface{ PoolSize() int }); ok {
		in.poolSize = p.PoolSize
	}
	if m, ok := mr.(interface{ MaximumPoolSize() int }); ok {
		in.maximum = m.MaximumPoolSize
	}
	if f := s.cfg.mapped; f != nil {
		in.mapped = func() []span { return spansOf(f(mr)) }
	}
	in.initialMaximum = -1
	if in.stats != nil {
		if st, ok := in.stats().(rmm.PoolStats); ok {
			in.initialMaximum = st.MaximumPoolSize
		}
	}
	dev := rmm.DeviceOf(mr)
	for range nstreams {
		st, err := rmm.NewStream(dev, &rmm.StreamOptions{NonBlocking: true})
		if err != nil {
			in.closeStreams()
			t.Fatalf("rmm.NewStream(%v): %v", dev, err)
		}
		in.streams = append(in.streams, st)
		in.views = append(in.views, st.View())
	}
	return in
}

// statsFunc returns a function calling mr's Stats method (any result type), nil when mr has
// none.
func statsFunc(mr rmm.MemoryResource) func() any {
	m := reflect.ValueOf(mr).MethodByName("Stats")
	if !m.IsValid() || m.Type().NumIn() != 0 || m.Type().NumOut() != 1 {
		return nil
	}
	return func() any { return m.Call(nil)[0].Interface() }
}

func (in *instance) closeStreams() {
	for _, s := range in.streams {
		s.Close()
	}
	in.streams = nil
	in.eventsMu.Lock()
	for _, e := range in.events {
		if e != nil {
			e.Close()
		}
	}
	in.events = nil
	in.eventsMu.Unlock()
}

// addStream creates one more Stream on the resource's device and returns its index in views.
// Not for use while goroutines use the instance.
func (in *instance) addStream() (int, error) {
	st, err := rmm.NewStream(rmm.DeviceOf(in.mr), &rmm.StreamOptions{NonBlocking: true})
	if err != nil {
		return 0, fmt.Errorf("rmm.NewStream: %w", err)
	}
	in.streams = append(in.streams, st)
	in.views = append(in.views, st.View())
	return len(in.views) - 1, nil
}

// closedView reports whether the suite closed the Stream behind views[i]; eventsMu is held.
func (in *instance) closedView(i int) bool { return i < len(in.closedViews) && in.closedViews[i] }

// closeStream closes the Stream behind views[i], which the suite keeps using as a view.
func (in *instance) closeStream(i int) error {
	for _, st := range in.streams {
		if st.View() != in.views[i] {
			continue
		}
		in.eventsMu.Lock()
		for len(in.closedViews) <= i {
			in.closedViews = append(in.closedViews, false)
		}
		in.closedViews[i] = true
		in.eventsMu.Unlock()
		return st.Close()
	}
	return fmt.Errorf("rmmtest: %s is not a Stream of the suite", streamName(i))
}

// usesUpstream reports whether the resource has taken memory from the upstream: from then on its
// allocations must lie inside the upstream's blocks.
func (in *instance) usesUpstream() bool { return in.up.used() }

// placed reports whether the suite knows where the resource's memory is: in the blocks held
// from the upstream (once it has used the upstream) and in the ranges it maps
// (Options.Mapped). Its live allocations must then lie inside one of them.
func (in *instance) placed() bool { return in.mapped != nil || in.usesUpstream() }

// within reports whether [p, p+n) lies inside one of the blocks held or one of the ranges mapped.
func within(held, mapped []span, p rmm.DevicePtr, n int) bool {
	return inside(held, p, n) || inside(mapped, p, n)
}

// holdsNothing reports whether the resource holds nothing from the upstream and maps nothing.
func (in *instance) holdsNothing() bool {
	held, _ := in.up.blocks()
	return len(held) == 0 && len(in.mappedSpans()) == 0
}

// mappedSpans returns the ranges the resource maps itself (Options.Mapped), nil without it.
func (in *instance) mappedSpans() []span {
	if in.mapped == nil {
		return nil
	}
	return in.mapped()
}

// spansOf converts rs to spans in address order.
func spansOf(rs []Range) []span {
	ss := make([]span, 0, len(rs))
	for _, r := range rs {
		ss = append(ss, span{r.Addr, r.Size})
	}
	slices.SortFunc(ss, func(a, b span) int { return compareAddr(a.addr, b.addr) })
	return ss
}

// addressOnly reports whether the upstream is address-only.
func (in *instance) addressOnly() bool { return in.upAccess == 0 }

// ---------------------------------------------------------------------------------------------
// Allocating and freeing through the model.

// allocate asks the resource for n bytes on stream i. A successful non-zero allocation is
// checked (admit), added to the model and filled with its pattern; a zero-byte one must return a
// null pointer. It returns the block (nil for zero bytes or on error) and the resource's error
// unchanged; a broken contract is returned as bad.
func (in *instance) allocate(n, stream int) (b *block, err, bad error) {
	r := 0
	if n > 0 {
		r = roundUp(n)
	}
	v := in.reserved.Add(int64(r))
	for {
		pk := in.peak.Load()
		if v <= pk || in.peak.CompareAndSwap(pk, v) {
			break
		}
	}
	p, err := in.mr.Allocate(n, in.views[stream])
	call := fmt.Sprintf("Allocate(%d, %s)", n, streamName(stream))
	if err != nil {
		in.reserved.Add(-int64(r))
		if p != 0 {
			return nil, err, fmt.Errorf("%s failed (%v) but returned the pointer %#x, not 0", call, err, uintptr(p))
		}
		return nil, err, nil
	}
	if n == 0 {
		if p != 0 {
			return nil, nil, fmt.Errorf("%s = %#x, want 0 (a zero-byte allocation returns the null pointer)", call, uintptr(p))
		}
		return nil, nil, nil
	}
	b, bad = in.admit(p, n, stream)
	if bad != nil {
		return nil, nil, fmt.Errorf("%s = %#x: %w", call, uintptr(p), bad)
	}
	return b, nil, nil
}

// admit checks a new allocation [p, p+n) against the model and adds it: non-null, 256-aligned,
// no overlap with a live allocation, inside a block held from the upstream once the resource uses
// it. It then writes the block's pattern when the memory is host-accessible.
func (in *instance) admit(p rmm.DevicePtr, n, stream int) (*block, error) {
	switch {
	case p == 0:
		return nil, errors.New("a null pointer without an error")
	case p%rmm.Alignment != 0:
		return nil, fmt.Errorf("not aligned to %d bytes", rmm.Alignment)
	}
	upstream := in.usesUpstream()
	if in.placed() {
		held, _ := in.up.blocks()
		if mapped := in.mappedSpans(); !within(held, mapped, p, n) {
			if in.mapped != nil {
				return nil, fmt.Errorf("[%#x, +%d) is not inside a block the upstream handed out and still holds (held: %s), nor inside a range the resource maps (mapped: %s)", uintptr(p), n, heldString(held), heldString(mapped))
			}
			return nil, fmt.Errorf("[%#x, +%d) is not inside a block the upstream handed out and still holds (held: %s)", uintptr(p), n, heldString(held))
		}
	}
	// Memory from an address-only upstream must not be touched, whatever the resource says.
	write := in.access&rmm.HostAccessible != 0 && (in.upAccess&rmm.HostAccessible != 0 || !upstream)
	b := &block{ptr: p, size: n, stream: stream, id: in.nextID.Add(1), written: write, full: in.cfg.fullPatterns}
	in.mu.Lock()
	for _, x := range in.live {
		if overlaps(x, b) {
			in.mu.Unlock()
			return nil, fmt.Errorf("overlaps the live allocation %v", x)
		}
	}
	in.live[p] = b
	in.liveBytes += roundUp(n)
	in.mu.Unlock()
	if write {
		writePattern(b)
	}
	return b, nil
}

func overlaps(a, b *block) bool {
	return a.ptr < b.ptr+rmm.DevicePtr(b.size) && b.ptr < a.ptr+rmm.DevicePtr(a.size)
}

// free checks b's pattern, takes it out of the model and frees it on stream. On an error from
// the resource b goes back into the model. A free on another stream than b's is first ordered
// after b's stream (orderFree), as a correct caller does.
func (in *instance) free(b *block, stream int) error {
	if err := verifyPattern(b); err != nil {
		return err
	}
	if stream != b.stream {
		if err := in.orderFree(b.stream, stream); err != nil {
			return err
		}
	}
	in.forget(b)
	if err := in.mr.Deallocate(b.ptr, b.size, in.views[stream]); err != nil {
		in.mu.Lock()
		in.live[b.ptr] = b
		in.liveBytes += roundUp(b.size)
		in.mu.Unlock()
		return fmt.Errorf("Deallocate(%#x, %d, %s): %w", uintptr(b.ptr), b.size, streamName(stream), err)
	}
	in.reserved.Add(-int64(roundUp(b.size)))
	return nil
}

// orderFree makes the work queued on views[to] from now on wait for the work queued so far on
// views[from] (an event recorded on from, waited for by to), so that a free on to is ordered
// after the allocation on from and its uses: the caller's duty under rmm.MemoryResource's
// contract, which the driver's stream-ordered allocator does not do for it. Nothing is done when
// Options.OrdersCrossStreamFrees is set. A Stream the suite closed cannot be recorded on: the
// device is synchronised instead (also when to was closed).
func (in *instance) orderFree(from, to int) error {
	if in.cfg.ordersCrossStreamFrees || from == to {
		return nil
	}
	in.eventsMu.Lock()
	if len(in.events) < len(in.views) {
		in.events = append(in.events, make([]*rmm.Event, len(in.views)-len(in.events))...)
	}
	e := in.events[from]
	closed := in.closedView(from) || in.closedView(to)
	if e == nil && !closed {
		var err error
		if e, err = rmm.NewEvent(rmm.DeviceOf(in.mr), nil); err != nil {
			in.eventsMu.Unlock()
			return fmt.Errorf("ordering a free on %s after %s: rmm.NewEvent: %w", streamName(to), streamName(from), err)
		}
		in.events[from] = e
	}
	in.eventsMu.Unlock()
	if closed {
		if err := rmm.DeviceOf(in.mr).Synchronize(); err != nil {
			return fmt.Errorf("ordering a free on %s after %s, one of them closed: synchronising the device: %w", streamName(to), streamName(from), err)
		}
	} else {
		// Goroutines may record the same event at once: every record is on from, and a later
		// one covers at least what an earlier one did, so the wait below is never too early.
		if err := e.Record(in.views[from]); err != nil {
			return fmt.Errorf("ordering a free on %s after %s: Event.Record: %w", streamName(to), streamName(from), err)
		}
		if err := in.views[to].WaitEvent(e); err != nil {
			return fmt.Errorf("ordering a free on %s after %s: WaitEvent: %w", streamName(to), streamName(from), err)
		}
	}
	if orderFreeHook != nil {
		orderFreeHook(in.views[from], in.views[to])
	}
	return nil
}

// forget takes b out of the model (not out of reserved: the caller does that once the resource
// took it back).
func (in *instance) forget(b *block) {
	in.mu.Lock()
	delete(in.live, b.ptr)
	in.liveBytes -= roundUp(b.size)
	in.mu.Unlock()
}

// liveCount returns the number and rounded bytes of live allocations.
func (in *instance) liveCount() (int, int) {
	in.mu.Lock()
	defer in.mu.Unlock()
	return len(in.live), in.liveBytes
}

// liveBlocks returns the live allocations in address order.
func (in *instance) liveBlocks() []*block {
	in.mu.Lock()
	bs := make([]*block, 0, len(in.live))
	for _, b := range in.live {
		bs = append(bs, b)
	}
	in.mu.Unlock()
	slices.SortFunc(bs, func(a, b *block) int { return compareAddr(a.ptr, b.ptr) })
	return bs
}

// freeAll frees every live allocation, on its own stream (or on stream id%streams when mixed).
func (in *instance) freeAll(mixed bool) error {
	bs := in.liveBlocks()
	slices.SortFunc(bs, func(a, b *block) int { return int(a.id) - int(b.id) })
	for _, b := range bs {
		s := b.stream
		if mixed {
			s = int(b.id % uint64(len(in.views)))
		}
		if err := in.free(b, s); err != nil {
			return err
		}
	}
	return nil
}

// ---------------------------------------------------------------------------------------------
// Observing the resource.

// observation is what can be seen of the resource between two calls.
type observation struct {
	stats      any // Stats(), nil without one
	poolSize   int // PoolSize(), -1 without one
	maximum    int // MaximumPoolSize(), -1 without one
	invariants error
	held       []span
	mapped     []span // Options.Mapped
	misuse     error
	live       []span // the suite's live allocations
}

func (in *instance) observe() observation {
	o := observation{poolSize: -1, maximum: -1}
	if in.stats != nil {
		o.stats = in.stats()
	}
	if in.poolSize != nil {
		o.poolSize = in.poolSize()
	}
	if in.maximum != nil {
		o.maximum = in.maximum()
	}
	if in.invariants != nil {
		o.invariants = in.invariants()
	}
	o.mapped = in.mappedSpans()
	o.held, o.misuse = in.up.blocks()
	in.mu.Lock()
	for _, b := range in.live {
		o.live = append(o.live, span{b.ptr, b.size})
	}
	in.mu.Unlock()
	return o
}

// unchanged checks that nothing observable changed between before and after (a failed free or a
// zero-byte call).
func unchanged(before, after observation) error {
	if !reflect.DeepEqual(before.stats, after.stats) {
		return fmt.Errorf("rmmtest: Stats changed across a refused call, which must change nothing (the value of a Stats method with no arguments and one result, whatever its type, is compared before and after; a method that counts refused calls must be named otherwise: see the package documentation): %+v -> %+v", before.stats, after.stats)
	}
	return unchangedUpstream(before, after)
}

// unchangedByZero checks a zero-byte allocation and its free: nothing changes, except figures
// that count calls. rmm.MemoryResource's contract lets a resource count Allocate(0) and
// Deallocate(0, 0) (rmm.StatisticsResourceAdaptor does, as librmm's): a matched pair leaves the
// live figures as they were but may raise a peak or a total. So rmm.PoolStats is compared whole
// (it counts nothing but what is live), rmm.Statistics but for PeakCount and TotalCount, and a
// Stats of another type not at all (the suite cannot tell its counts of calls from the rest).
func unchangedByZero(before, after observation) error {
	b, a := before.stats, after.stats
	switch bs := b.(type) {
	case rmm.Statistics:
		as, _ := a.(rmm.Statistics)
		bs.PeakCount, bs.TotalCount = 0, 0
		as.PeakCount, as.TotalCount = 0, 0
		b, a = bs, as
	case rmm.PoolStats, nil:
	default:
		b, a = nil, nil
	}
	if !reflect.DeepEqual(b, a) {
		return fmt.Errorf("rmmtest: Stats changed across a zero-byte allocation and its free, which may change only counts of calls (rmm.PoolStats is compared whole, rmm.Statistics but for PeakCount and TotalCount: see ZeroSize in the package documentation): %+v -> %+v", before.stats, after.stats)
	}
	return unchangedUpstream(before, after)
}

// unchangedAccounting checks a failed allocation: the live figures are the same, and the upstream
// holds the same blocks — or, when PoolStats shows the pool shrank (or, without PoolStats, the
// upstream holds fewer blocks or less is mapped), a subset of them, none of those it gave back
// holding part of a live allocation: a resource may rearrange its free blocks while it searches,
// and may give wholly free blocks back to its upstream before it gives up.
//
// A block given back is given back whole (the upstream takes back only what it handed out, as
// it handed it out), so what is left is a subset of the blocks held before, each the same block.
// A block that lies inside one held before but is not that block is new: the upstream may hand
// the same addresses out again once they are freed, cut differently, and a resource that took
// such a block while failing holds memory it did not hold before. Mapped ranges (Options.Mapped)
// are not blocks: a failed allocation may unmap part of one, and each range left must lie inside
// one mapped before.
func unchangedAccounting(before, after observation) error {
	shrank := false
	if b, ok := before.stats.(rmm.PoolStats); ok {
		a := after.stats.(rmm.PoolStats)
		if b.LiveBytes != a.LiveBytes || b.LiveAllocations != a.LiveAllocations || b.MaximumPoolSize != a.MaximumPoolSize ||
			a.PoolSize > b.PoolSize || a.PoolSize-a.FreeBytes != b.PoolSize-b.FreeBytes ||
			(a.PoolSize == b.PoolSize && (a.FreeBytes != b.FreeBytes || a.UpstreamBlocks != b.UpstreamBlocks)) {
			return fmt.Errorf("rmmtest: Stats changed across a failed allocation, which may only give wholly free blocks back (the live figures and the bytes in use stay, PoolSize may only shrink, and without shrinking FreeBytes and UpstreamBlocks stay): %+v -> %+v", b, a)
		}
		shrank = a.PoolSize < b.PoolSize
	} else {
		// An adaptor over a pool (or any resource without PoolStats): its figures are not in
		// sight, but what the upstream holds is. Fewer blocks, none of them new and none of
		// those given back under a live allocation, is a give-back of free memory.
		shrank = len(after.held) < len(before.held) || total(after.mapped) < total(before.mapped)
	}
	if !shrank {
		return unchangedUpstream(before, after)
	}
	for _, h := range after.held {
		if !slices.Contains(before.held, h) {
			return fmt.Errorf("a failed allocation took a new upstream block %v (held before: %s)", h, heldString(before.held))
		}
	}
	for _, m := range after.mapped {
		if !inside(before.mapped, m.addr, m.size) {
			return fmt.Errorf("a failed allocation mapped new memory: %v lies inside no range mapped before (%s)", m, heldString(before.mapped))
		}
	}
	for _, h := range before.held {
		if slices.Contains(after.held, h) {
			continue
		}
		for _, l := range before.live {
			if l.addr < h.end() && h.addr < l.end() {
				return fmt.Errorf("a failed allocation gave the upstream block %v back while the live allocation %v lies in it", h, l)
			}
		}
	}
	if after.invariants != nil && before.invariants == nil {
		return fmt.Errorf("CheckInvariants: %v", after.invariants)
	}
	return nil
}

func unchangedUpstream(before, after observation) error {
	if !slices.Equal(before.held, after.held) {
		return fmt.Errorf("the blocks held from the upstream changed: %s -> %s", heldString(before.held), heldString(after.held))
	}
	if !slices.Equal(before.mapped, after.mapped) {
		return fmt.Errorf("the ranges the resource maps changed: %s -> %s", heldString(before.mapped), heldString(after.mapped))
	}
	if after.invariants != nil && before.invariants == nil {
		return fmt.Errorf("CheckInvariants: %v", after.invariants)
	}
	return nil
}

// verify checks the resource against the model: invariants, upstream use, the live allocations
// (non-null, aligned, disjoint, inside the upstream's blocks), Stats, and the patterns.
func (in *instance) verify() error {
	return in.verifyObserved(in.observe())
}

func (in *instance) verifyObserved(o observation) error {
	if o.invariants != nil {
		return fmt.Errorf("CheckInvariants: %v", o.invariants)
	}
	if o.misuse != nil {
		return fmt.Errorf("upstream misused: %v", o.misuse)
	}
	bs := in.liveBlocks()
	placed := in.placed()
	liveBytes := 0
	for i, b := range bs {
		switch {
		case b.ptr == 0:
			return fmt.Errorf("live allocation %v has a null pointer", b)
		case b.ptr%rmm.Alignment != 0:
			return fmt.Errorf("live allocation %v is not 256-aligned", b)
		case i > 0 && overlaps(bs[i-1], b):
			return fmt.Errorf("live allocations %v and %v overlap", bs[i-1], b)
		case placed && in.mapped == nil && !inside(o.held, b.ptr, b.size):
			return fmt.Errorf("live allocation %v is not inside a block held from the upstream (held: %s)", b, heldString(o.held))
		case placed && !within(o.held, o.mapped, b.ptr, b.size):
			return fmt.Errorf("live allocation %v is not inside a block held from the upstream (held: %s) nor inside a range the resource maps (mapped: %s)", b, heldString(o.held), heldString(o.mapped))
		}
		liveBytes += roundUp(b.size)
	}
	if in.cfg.holdsNothingBack {
		if what, h, ok := heldUnused(o.held, o.mapped, bs); ok {
			return fmt.Errorf("%s %v, which holds no live allocation, is still held (%d live allocations), yet Options.HoldsNothingBack declares that the resource keeps none of the memory it is told to free", what, h, len(bs))
		}
	}
	if st, ok := o.stats.(rmm.PoolStats); ok {
		if err := checkPoolStats(st, len(bs), liveBytes, placed, o.held, o.mapped, in.mapped != nil); err != nil {
			return err
		}
		switch {
		case o.poolSize >= 0 && o.poolSize != st.PoolSize:
			return fmt.Errorf("PoolSize() = %d, but Stats reports PoolSize %d", o.poolSize, st.PoolSize)
		case o.maximum >= 0 && o.maximum != st.MaximumPoolSize:
			return fmt.Errorf("MaximumPoolSize() = %d, but Stats reports MaximumPoolSize %d", o.maximum, st.MaximumPoolSize)
		case in.initialMaximum >= 0 && st.MaximumPoolSize != in.initialMaximum:
			return fmt.Errorf("rmmtest: Stats reports MaximumPoolSize %d; it was %d when the resource was built", st.MaximumPoolSize, in.initialMaximum)
		}
	}
	for _, b := range bs {
		if err := verifyPattern(b); err != nil {
			return err
		}
	}
	return nil
}

// checkPoolStats compares PoolStats with the model: count live allocations of liveBytes (rounded)
// bytes, and (when placed: the suite knows where the resource's memory is) the blocks held from
// the upstream and the ranges mapped; the number of upstream blocks only when the resource maps
// nothing itself (hasMapped false).
func checkPoolStats(s rmm.PoolStats, count, liveBytes int, placed bool, held, mapped []span, hasMapped bool) error {
	heldBytes := total(held) + total(mapped)
	switch {
	case s.LiveAllocations != count || s.LiveBytes != liveBytes:
		return fmt.Errorf("rmmtest: Stats: %d live allocations of %d bytes, the suite holds %d of %d (each rounded up to 256)", s.LiveAllocations, s.LiveBytes, count, liveBytes)
	case s.FreeBytes != s.PoolSize-s.LiveBytes:
		return fmt.Errorf("rmmtest: Stats: FreeBytes %d != PoolSize %d - LiveBytes %d", s.FreeBytes, s.PoolSize, s.LiveBytes)
	case s.LargestFreeBlock > s.FreeBytes || s.LargestFreeBlock < 0:
		return fmt.Errorf("rmmtest: Stats: LargestFreeBlock %d outside [0, FreeBytes %d]", s.LargestFreeBlock, s.FreeBytes)
	case s.MaximumPoolSize > 0 && s.PoolSize > s.MaximumPoolSize:
		return fmt.Errorf("rmmtest: Stats: PoolSize %d exceeds MaximumPoolSize %d", s.PoolSize, s.MaximumPoolSize)
	case placed && hasMapped && s.PoolSize != heldBytes:
		return fmt.Errorf("rmmtest: Stats: PoolSize %d; the upstream handed out %d bytes in %d blocks and the resource maps %d bytes in %d ranges", s.PoolSize, total(held), len(held), total(mapped), len(mapped))
	case placed && !hasMapped && (s.PoolSize != heldBytes || s.UpstreamBlocks != len(held)):
		return fmt.Errorf("rmmtest: Stats: PoolSize %d in %d upstream blocks; the upstream handed out %d bytes in %d blocks", s.PoolSize, s.UpstreamBlocks, heldBytes, len(held))
	}
	return nil
}

// total returns the bytes of ss.
func total(ss []span) int {
	n := 0
	for _, s := range ss {
		n += s.size
	}
	return n
}

// checkReleased checks the state after a successful Release: every block held from the upstream
// holds part of a live allocation (nothing is held when nothing is live).
func (in *instance) checkReleased() error {
	if in.cfg.releaseKeeps {
		return nil
	}
	held, _ := in.up.blocks()
	bs := in.liveBlocks()
	if what, h, ok := heldUnused(held, in.mappedSpans(), bs); ok {
		return fmt.Errorf("after Release %s %v, which holds no live allocation, is still held (%d live allocations; set Options.ReleaseKeepsMemory if the resource keeps a reserve)", what, h, len(bs))
	}
	return nil
}

// heldUnused finds a block held from the upstream, or a range mapped, that holds no part of a
// live allocation of bs, and says which of the two it is.
func heldUnused(held, mapped []span, bs []*block) (what string, h span, ok bool) {
	for i, h := range append(slices.Clip(held), mapped...) {
		used := false
		for _, b := range bs {
			if b.ptr < h.end() && h.addr < b.ptr+rmm.DevicePtr(b.size) {
				used = true
				break
			}
		}
		if !used {
			what := "the upstream block"
			if i >= len(held) {
				what = "the range mapped"
			}
			return what, h, true
		}
	}
	return "", span{}, false
}

// ---------------------------------------------------------------------------------------------
// Tearing down.

// chain returns the resources from mr down to (not including) the recording upstream, following
// rmm.Upstreamer; nil when the upstream is not reached that way.
func (in *instance) chain() []rmm.MemoryResource {
	var c []rmm.MemoryResource
	mr := in.mr
	for range 64 {
		if r, ok := mr.(*recordingUpstream); ok && r == in.up {
			return c
		}
		c = append(c, mr)
		u, ok := mr.(rmm.Upstreamer)
		if !ok {
			return nil
		}
		mr = u.Upstream()
		if mr == nil {
			return nil
		}
	}
	return nil
}

// finish frees every live allocation, releases and closes the resource (and every resource
// between it and the upstream), closes the streams, and checks that accounting returned to zero
// and that the upstream got everything back where the resource can give it back. With
// Options.FreeAfterClose, a resource left with an odd number of live allocations is closed
// first, and they are freed after (closeThenFree).
func (in *instance) finish() error {
	in.mu.Lock()
	if in.closed {
		in.mu.Unlock()
		return nil
	}
	in.closed = true
	closeFirst := in.cfg.freeAfterClose && len(in.live)%2 == 1
	in.mu.Unlock()
	defer in.closeStreams()
	if closeFirst {
		return in.closeThenFree()
	}
	var errs []error
	if err := in.freeAll(false); err != nil {
		errs = append(errs, fmt.Errorf("freeing what is live: %w", err))
	}
	if err := in.verify(); err != nil {
		errs = append(errs, fmt.Errorf("everything freed: %w", err))
	}
	if st, ok := in.observe().stats.(rmm.PoolStats); ok && (st.LiveAllocations != 0 || st.LiveBytes != 0 || st.FreeBytes != st.PoolSize) {
		errs = append(errs, fmt.Errorf("everything freed, yet Stats reports %+v", st))
	}
	// Release, then Close, every resource from the one under test down to the upstream (the one
	// under test only, when the upstream cannot be reached through rmm.Upstreamer). What the
	// innermost one holds from the upstream must then be back, when it can give it back.
	chain := in.chain()
	known := chain != nil // every resource between the one under test and the upstream is seen
	if chain == nil {
		chain = []rmm.MemoryResource{in.mr}
	}
	inner := len(chain) - 1
	var released, closed bool
	for i, mr := range chain {
		if r, ok := mr.(rmm.Releaser); ok {
			released = released || i == inner
			if err := r.Release(); err != nil {
				errs = append(errs, fmt.Errorf("%T.Release: %w", mr, err))
			}
		}
	}
	if held, _ := in.up.blocks(); released && len(held) > 0 && !in.cfg.releaseKeeps {
		errs = append(errs, fmt.Errorf("everything freed and released, yet the upstream still holds %s", heldString(held)))
	}
	if mapped := in.mappedSpans(); released && len(mapped) > 0 && !in.cfg.releaseKeeps {
		errs = append(errs, fmt.Errorf("everything freed and released, yet the resource still maps %s", heldString(mapped)))
	}
	closed = in.closeChain(chain, &errs)
	// A resource with neither Release nor Close can give memory back only when it is freed: what
	// it still holds with everything freed, it keeps for good (a free it did not pass on).
	if known && !released && !closed && !in.cfg.releaseKeeps {
		if held, _ := in.up.blocks(); len(held) > 0 {
			errs = append(errs, fmt.Errorf("everything freed, yet the upstream still holds %s, and %T has neither Release nor Close to give it back (set Options.ReleaseKeepsMemory if it keeps a reserve for good)", heldString(held), chain[inner]))
		}
		if mapped := in.mappedSpans(); len(mapped) > 0 {
			errs = append(errs, fmt.Errorf("everything freed, yet the resource still maps %s, and %T has neither Release nor Close to unmap it (set Options.ReleaseKeepsMemory if it keeps a reserve for good)", heldString(mapped), chain[inner]))
		}
	}
	// Whatever Release may keep, Close gives it back: nothing is live any more.
	if held, _ := in.up.blocks(); closed && len(held) > 0 {
		errs = append(errs, fmt.Errorf("everything freed and the resource closed, yet the upstream still holds %s", heldString(held)))
	}
	if mapped := in.mappedSpans(); closed && len(mapped) > 0 {
		errs = append(errs, fmt.Errorf("everything freed and the resource closed, yet it still maps %s", heldString(mapped)))
	}
	if _, misuse := in.up.blocks(); misuse != nil {
		errs = append(errs, fmt.Errorf("upstream misused: %w", misuse))
	}
	return errors.Join(errs...)
}

// closeChain closes every resource of chain that has a Close method, outermost first, adding
// their errors to errs, and reports whether the innermost one was closed.
func (in *instance) closeChain(chain []rmm.MemoryResource, errs *[]error) bool {
	closed := false
	for i, mr := range chain {
		if c, ok := mr.(interface{ Close() error }); ok {
			closed = closed || i == len(chain)-1
			if err := c.Close(); err != nil {
				*errs = append(*errs, fmt.Errorf("%T.Close: %w", mr, err))
			}
		}
	}
	return closed
}

// closeThenFree is finish for Options.FreeAfterClose: it closes the resource and every resource
// between it and the upstream with allocations live, frees them afterwards (checking their
// patterns: Close must leave them intact), and checks that the upstream then got everything back
// and that nothing is mapped any more.
func (in *instance) closeThenFree() error {
	var errs []error
	if err := in.verify(); err != nil {
		errs = append(errs, fmt.Errorf("before closing: %w", err))
	}
	chain := in.chain()
	if chain == nil {
		chain = []rmm.MemoryResource{in.mr}
	}
	n, _ := in.liveCount()
	closed := in.closeChain(chain, &errs)
	if err := in.freeAll(false); err != nil {
		errs = append(errs, fmt.Errorf("freeing the %d allocations live at Close, after it: %w", n, err))
	}
	if held, _ := in.up.blocks(); closed && len(held) > 0 {
		errs = append(errs, fmt.Errorf("closed with %d allocations live, which were then freed, yet the upstream still holds %s", n, heldString(held)))
	}
	if mapped := in.mappedSpans(); closed && len(mapped) > 0 {
		errs = append(errs, fmt.Errorf("closed with %d allocations live, which were then freed, yet the resource still maps %s", n, heldString(mapped)))
	}
	if _, misuse := in.up.blocks(); misuse != nil {
		errs = append(errs, fmt.Errorf("upstream misused: %w", misuse))
	}
	return errors.Join(errs...)
}

// ---------------------------------------------------------------------------------------------
// Patterns in host-accessible memory.

const (
	fullPatternLimit = 64 * kiB // blocks up to this size hold their pattern in every byte
	patternEdge      = 4 * kiB  // larger blocks: the first and last 4 KiB ...
	patternStride    = 64 * kiB // ... and 64 bytes every 64 KiB between
	patternSample    = 64
)

// patternRegions calls f for each range [off, off+n) of a size-byte block that holds its pattern:
// the whole block when full is set or the block is small, else samples.
func patternRegions(size int, full bool, f func(off, n int) error) error {
	if full || size <= fullPatternLimit {
		return f(0, size)
	}
	if err := f(0, patternEdge); err != nil {
		return err
	}
	for off := patternStride; off < size-patternEdge; off += patternStride {
		if err := f(off, patternSample); err != nil {
			return err
		}
	}
	return f(size-patternEdge, patternEdge)
}

// patternChunk returns 4 KiB + 64 bytes of block id's pattern: byte i is unit[i%64], where unit is
// 64 bytes drawn from id.
func patternChunk(id uint64) []byte {
	r := rand.New(rand.NewPCG(id, 0x9e3779b97f4a7c15))
	buf := make([]byte, 4*kiB+64)
	for i := 0; i < 64; i += 8 {
		x := r.Uint64()
		for j := range 8 {
			buf[i+j] = byte(x >> (8 * j))
		}
	}
	for i := 64; i < len(buf); i *= 2 {
		copy(buf[i:], buf[:i])
	}
	return buf
}

// hostView views n bytes of host-accessible memory at p. The memory is not Go memory (C heap,
// managed or pinned), so the slice must not outlive the allocation.
func hostView(p rmm.DevicePtr, n int) []byte {
	a := uintptr(p)
	// Reinterpreting the word, rather than converting uintptr to unsafe.Pointer, is valid
	// because the memory is not managed by Go's collector.
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&a))), n)
}

func writePattern(b *block) {
	chunk := patternChunk(b.id)
	mem := hostView(b.ptr, b.size)
	patternRegions(b.size, b.full, func(off, n int) error {
		for n > 0 {
			k := copy(mem[off:off+n], chunk[off%64:])
			off, n = off+k, n-k
		}
		return nil
	})
}

// verifyPattern checks that b's pattern is intact (nothing when none was written).
func verifyPattern(b *block) error {
	if !b.written {
		return nil
	}
	chunk := patternChunk(b.id)
	mem := hostView(b.ptr, b.size)
	return patternRegions(b.size, b.full, func(off, n int) error {
		for n > 0 {
			k := min(n, len(chunk)-64)
			want := chunk[off%64 : off%64+k]
			if got := mem[off : off+k]; !bytes.Equal(got, want) {
				for i := range got {
					if got[i] != want[i] {
						return fmt.Errorf("live allocation %v: byte %d is %#02x, its pattern says %#02x (the memory was written by someone else)", b, off+i, got[i], want[i])
					}
				}
			}
			off, n = off+k, n-k
		}
		return nil
	})
}

// roundUp rounds n up to a multiple of 256.
func roundUp(n int) int {
	r, ok := rmm.AlignUp(n, rmm.Alignment)
	if !ok {
		return n
	}
	return r
}
