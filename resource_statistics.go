package rmm

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// Statistics are the allocation figures of one level of a StatisticsResourceAdaptor's counter
// stack, as rmm.statistics.Statistics in librmm's Python API. Bytes are the sizes callers asked
// for (not rounded); counts are numbers of allocations. All are signed: a level pushed while
// memory was live goes negative when that memory is freed.
type Statistics struct {
	CurrentBytes int64 // bytes allocated and not yet freed
	CurrentCount int64 // allocations not yet freed (zero-byte allocations count)
	PeakBytes    int64 // the most CurrentBytes has been
	PeakCount    int64 // the most CurrentCount has been
	TotalBytes   int64 // bytes allocated in all, freed or not
	TotalCount   int64 // allocations made in all, freed or not
}

// String reads, for example, "current 4194304 bytes in 1, peak 4194304 bytes in 1, total 4194304
// bytes in 1".
func (s Statistics) String() string {
	return fmt.Sprintf("current %d bytes in %d, peak %d bytes in %d, total %d bytes in %d",
		s.CurrentBytes, s.CurrentCount, s.PeakBytes, s.PeakCount, s.TotalBytes, s.TotalCount)
}

// statCounter is one counter of a StatisticsResourceAdaptor level, in bytes or in allocations:
// its value now, the highest value it has had and the sum of everything added to it (librmm's
// statistics_resource_adaptor::counter).
type statCounter struct {
	Value int64
	Peak  int64
	Total int64
}

// statLevel is one level of the counter stack.
type statLevel struct {
	bytes, count statCounter
	scope        uint64 // the scope (pushAt) that pushed it; 0 for PushCounters and the base
}

// statScopes numbers scopes opened with pushAt.
var statScopes atomic.Uint64

// add counts an allocation of n bytes: values and totals grow, peaks follow the values.
func (l *statLevel) add(n int64) {
	l.bytes.Value += n
	l.bytes.Total += n
	l.bytes.Peak = max(l.bytes.Peak, l.bytes.Value)
	l.count.Value++
	l.count.Total++
	l.count.Peak = max(l.count.Peak, l.count.Value)
}

// sub counts the free of n bytes.
func (l *statLevel) sub(n int64) {
	l.bytes.Value -= n
	l.count.Value--
}

// restore puts back the free of n bytes the upstream refused (totals unchanged; the peaks
// stay at or above the values).
func (l *statLevel) restore(n int64) {
	l.bytes.Value += n
	l.bytes.Peak = max(l.bytes.Peak, l.bytes.Value)
	l.count.Value++
	l.count.Peak = max(l.count.Peak, l.count.Value)
}

func (l *statLevel) stats() Statistics {
	return Statistics{
		CurrentBytes: l.bytes.Value, CurrentCount: l.count.Value,
		PeakBytes: l.bytes.Peak, PeakCount: l.count.Peak,
		TotalBytes: l.bytes.Total, TotalCount: l.count.Total,
	}
}

// StatisticsResourceAdaptor forwards every call to its upstream and counts what goes through it,
// as librmm's statistics_resource_adaptor: bytes and allocations, each with its current value,
// its peak and its total, kept on a stack of levels so that a block of code can be measured on
// its own (PushCounters before it, PopCounters after it; [Profiler] does this).
//
//   - Allocate calls the upstream first; when it succeeds the top level's bytes grow by nbytes
//     (as asked, not rounded) and its count by one, and each peak follows its value. A zero-byte
//     allocation counts (one allocation of 0 bytes). A failed allocation changes nothing.
//   - Deallocate takes nbytes and one allocation off the top level first and then calls the
//     upstream, so that an address the upstream hands out again at once is never counted twice.
//     Deallocate(0, 0, s) counts one allocation off, as Allocate(0, s) counted one on (the
//     [MemoryResource] contract lets a resource count both; a caller frees each zero-byte
//     allocation once). When the upstream returns an error the memory is still allocated, and
//     the counts are put back.
//
// Levels may go negative: memory allocated before a push and freed after it is taken off the new
// level. PopCounters folds a level into the one below it (see there).
//
// Safe for concurrent use: the counters are kept under one mutex, held for a few additions and
// never across a call to the upstream; nothing is allocated per call. (Every goroutine updates
// the same counters, so atomics would not scale better, and would cost several read-modify-write
// operations per call where the mutex costs two.)
type StatisticsResourceAdaptor struct {
	upstream MemoryResource

	mu     sync.Mutex
	levels []statLevel // bottom first; never empty; the last is the top
}

// NewStatisticsResourceAdaptor returns an adaptor that counts the allocations made through it
// from upstream, with one level of zero counters. A nil upstream means the current device
// resource ([CurrentDeviceResource], read once, here); a nil pointer as upstream returns an error
// wrapping [ErrInvalidArgument].
func NewStatisticsResourceAdaptor(upstream MemoryResource) (*StatisticsResourceAdaptor, error) {
	up, err := upstreamOf("NewStatisticsResourceAdaptor", upstream)
	if err != nil {
		return nil, err
	}
	return newStatistics(up), nil
}

func newStatistics(upstream MemoryResource) *StatisticsResourceAdaptor {
	return &StatisticsResourceAdaptor{upstream: upstream, levels: make([]statLevel, 1, 4)}
}

// top returns the top level (under mu).
func (r *StatisticsResourceAdaptor) top() *statLevel { return &r.levels[len(r.levels)-1] }

// Allocate allocates nbytes from the upstream on stream s and counts it on the top level when the
// upstream succeeds. A negative size returns an error wrapping [ErrInvalidArgument] without calling
// the upstream. The upstream's errors are returned unchanged.
func (r *StatisticsResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("StatisticsResourceAdaptor", "Allocate", nbytes)
	}
	p, err := r.upstream.Allocate(nbytes, s)
	if err != nil {
		return 0, err
	}
	r.mu.Lock()
	r.top().add(int64(nbytes))
	r.mu.Unlock()
	return p, nil
}

// Deallocate takes nbytes and one allocation off the top level, then returns p to the upstream on
// stream s. When the upstream returns an error (which is returned) the counts are put back on the
// top level. A negative size returns an error wrapping [ErrInvalidArgument] and changes nothing.
func (r *StatisticsResourceAdaptor) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if nbytes < 0 {
		return invalidSize("StatisticsResourceAdaptor", "Deallocate", nbytes)
	}
	r.mu.Lock()
	r.top().sub(int64(nbytes))
	r.mu.Unlock()
	if err := r.upstream.Deallocate(p, nbytes, s); err != nil {
		r.mu.Lock()
		r.top().restore(int64(nbytes))
		r.mu.Unlock()
		return err
	}
	return nil
}

// Stats returns the figures of the top level.
func (r *StatisticsResourceAdaptor) Stats() Statistics {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.top().stats()
}

// Depth returns the number of levels on the counter stack: 1, plus one per PushCounters not yet
// popped.
func (r *StatisticsResourceAdaptor) Depth() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.levels)
}

// PushCounters returns the figures of the top level and pushes a new level of zero counters,
// which allocations and frees update from now on.
func (r *StatisticsResourceAdaptor) PushCounters() Statistics {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pushLocked()
}

// pushLocked is PushCounters under the mutex.
func (r *StatisticsResourceAdaptor) pushLocked() Statistics {
	old := r.top().stats()
	r.levels = append(r.levels, statLevel{})
	return old
}

// PopCounters removes the top level, folds it into the level below, and returns its figures.
// For each counter (bytes, allocations), with T the popped level and P the one below it:
//
//	P.peak  = max(P.peak, P.value + T.peak)
//	P.value = P.value + T.value
//	P.total = P.total + T.total
//
// so the level below reads as if the popped level had never been pushed. With only one level
// left it returns an error wrapping [ErrOutOfRange] (librmm throws std::out_of_range, Python an
// IndexError) and changes nothing.
func (r *StatisticsResourceAdaptor) PopCounters() (Statistics, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.popLocked()
}

// popLocked is PopCounters under the mutex.
func (r *StatisticsResourceAdaptor) popLocked() (Statistics, error) {
	if len(r.levels) == 1 {
		return Statistics{}, errorf("StatisticsResourceAdaptor.PopCounters: cannot pop the last level of counters: %w", ErrOutOfRange)
	}
	t := r.levels[len(r.levels)-1]
	r.levels = r.levels[:len(r.levels)-1]
	p := r.top()
	foldCounter(&p.bytes, t.bytes)
	foldCounter(&p.count, t.count)
	return t.stats(), nil
}

// foldCounter merges popped counter t into its parent p.
func foldCounter(p *statCounter, t statCounter) {
	p.Peak = max(p.Peak, p.Value+t.Peak)
	p.Value += t.Value
	p.Total += t.Total
}

// pushAt pushes a level for a scope (WithStatistics, Profiler) and returns the scope's identity,
// for popAt.
func (r *StatisticsResourceAdaptor) pushAt() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pushLocked()
	id := statScopes.Add(1)
	r.levels[len(r.levels)-1].scope = id
	return id
}

// popAt removes the level scope pushed and folds it into the level below it, as PopCounters
// does, and returns its figures. When that level is the top (scopes nested), that is all. When
// levels pushed later are still above it (scopes of several goroutines overlapping), it is taken
// out from under them all the same — so the stack stays as deep as the open scopes — and the
// error wraps ErrInvalidArgument: its figures miss what was counted on the levels above it. When
// the level is gone (popped with PopCounters) nothing changes and the error wraps
// ErrInvalidArgument.
func (r *StatisticsResourceAdaptor) popAt(scope uint64) (Statistics, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	i := len(r.levels) - 1
	for i > 0 && r.levels[i].scope != scope {
		i--
	}
	if i == 0 {
		return Statistics{}, errorf("the statistics level of this scope was popped by someone else (PopCounters): %w", ErrInvalidArgument)
	}
	if i == len(r.levels)-1 {
		return r.popLocked()
	}
	t := r.levels[i]
	p := &r.levels[i-1]
	foldCounter(&p.bytes, t.bytes)
	foldCounter(&p.count, t.count)
	r.levels = append(r.levels[:i], r.levels[i+1:]...)
	return t.stats(), errorf("%d statistics levels pushed after this scope's were still open when it ended: scopes on one StatisticsResourceAdaptor overlapped instead of nesting, so its figures miss what was counted on them: %w", len(r.levels)-i, ErrInvalidArgument)
}

// Upstream returns the resource the adaptor forwards to.
func (r *StatisticsResourceAdaptor) Upstream() MemoryResource { return r.upstream }

func (*StatisticsResourceAdaptor) insideUpstream() {}

func (*StatisticsResourceAdaptor) passesPointersThrough() {}

// Access reports the upstream's accessibility ([AccessOf](Upstream())).
func (r *StatisticsResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the upstream's device ([DeviceOf](Upstream())).
func (r *StatisticsResourceAdaptor) Device() Device { return DeviceOf(r.upstream) }

// ---- the current device resource's statistics, as rmm.statistics ----

// statsMu serialises EnableStatistics and WithStatistics, which read and then replace the current
// device resource.
var statsMu sync.Mutex

// currentStatistics returns the current device resource as a StatisticsResourceAdaptor.
func currentStatistics() (*StatisticsResourceAdaptor, bool) {
	r, ok := CurrentDeviceResource().(*StatisticsResourceAdaptor)
	return r, ok
}

// EnableStatistics makes the current device resource count its allocations: unless it already is
// a [StatisticsResourceAdaptor], it is wrapped in a new one, which becomes the current device
// resource (rmm.statistics.enable_statistics). Calling it again changes nothing. It returns the
// adaptor. Allocations made before it are not counted (freeing them through the adaptor, which
// forwards the free, takes its counts below zero).
func EnableStatistics() *StatisticsResourceAdaptor {
	statsMu.Lock()
	defer statsMu.Unlock()
	return enableStatisticsLocked()
}

func enableStatisticsLocked() *StatisticsResourceAdaptor {
	cur := CurrentDeviceResource()
	if r, ok := cur.(*StatisticsResourceAdaptor); ok {
		return r
	}
	r := newStatistics(cur)
	SetCurrentDeviceResource(r)
	return r
}

// GetStatistics returns the top level of the current device resource's counters; ok is false
// when the current device resource is not a [StatisticsResourceAdaptor] (statistics not enabled).
func GetStatistics() (st Statistics, ok bool) {
	r, ok := currentStatistics()
	if !ok {
		return Statistics{}, false
	}
	return r.Stats(), true
}

// PushStatistics pushes a new level of zero counters on the current device resource and returns
// the figures of the level that was on top ([StatisticsResourceAdaptor.PushCounters]); ok is false,
// and nothing is done, when the current device resource is not a [StatisticsResourceAdaptor].
func PushStatistics() (st Statistics, ok bool) {
	r, ok := currentStatistics()
	if !ok {
		return Statistics{}, false
	}
	return r.PushCounters(), true
}

// PopStatistics pops the top level of the current device resource's counters and returns its
// figures ([StatisticsResourceAdaptor.PopCounters]). The error wraps [ErrOutOfRange] when only one
// level is left, and [ErrNotSupported] when the current device resource is not a
// [StatisticsResourceAdaptor] (statistics not enabled; rmm.statistics.pop_statistics returns None).
func PopStatistics() (Statistics, error) {
	r, ok := currentStatistics()
	if !ok {
		return Statistics{}, errorf("PopStatistics: statistics are not enabled (the current device resource is a %s): %w", resourceName(CurrentDeviceResource()), ErrNotSupported)
	}
	return r.PopCounters()
}

// WithStatistics runs f and returns the statistics of the allocations made through the current
// device resource while it ran, as the rmm.statistics.statistics context manager: when the current
// device resource is a [StatisticsResourceAdaptor] a level is pushed before f and popped after it;
// otherwise a new StatisticsResourceAdaptor is made the current device resource for the duration
// of f and the previous resource is put back afterwards. The figures are those of the popped
// level (or of the temporary adaptor). They are collected also when f panics.
//
// f must leave the current device resource as it found it, and the adaptor's counter stack as
// deep: when the current device resource was changed inside f, the level pushed is still popped,
// the current device resource is left as f set it, and the error wraps [ErrInvalidArgument]; when
// levels were pushed or popped without being balanced inside f, nothing is popped and the error
// wraps ErrInvalidArgument. The counter stack belongs to the adaptor and is shared by every
// goroutine allocating through it: a scope counts the allocations other goroutines make while it
// runs, and scopes opened concurrently by several goroutines do not nest, which is reported as
// that error: open such scopes from one goroutine at a time (or give each its own adaptor). Each
// scope still removes its own level, so the stack is left as deep as the scopes still open. Memory allocated inside f through a temporary adaptor may be freed through that adaptor
// or through the previous resource, to which it forwards.
func WithStatistics(f func()) (st Statistics, err error) {
	statsMu.Lock()
	prev := CurrentDeviceResource()
	r, pushed := prev.(*StatisticsResourceAdaptor)
	var scope uint64
	if pushed {
		scope = r.pushAt()
	} else {
		r = enableStatisticsLocked()
	}
	statsMu.Unlock()

	defer func() {
		statsMu.Lock()
		defer statsMu.Unlock()
		cur := CurrentDeviceResource()
		changed := cur != MemoryResource(r)
		if pushed {
			if st, err = r.popAt(scope); err != nil {
				err = errorf("WithStatistics: %w", err)
				return
			}
		} else {
			if d := r.Depth(); d != 1 {
				err = errorf("WithStatistics: the statistics counter stack of the adaptor it installed is %d levels deep at the end: levels were pushed without being popped: %w", d, ErrInvalidArgument)
			}
			st = r.Stats()
			if !changed {
				SetCurrentDeviceResource(prev) // also after that error: the temporary adaptor goes
			}
		}
		if changed {
			err = errorf("WithStatistics: the current device resource was changed to a %s while the statistics were being gathered: %w", resourceName(cur), ErrInvalidArgument)
		}
	}()
	f()
	return st, nil
}
