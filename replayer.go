package rmm

import (
	"errors"
	"math"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// ReplayOptions configures Replay. nil means the defaults.
type ReplayOptions struct {
	// Stream maps a stream handle recorded in the log to the stream to replay it on. Default: the
	// logged default stream (0) to DefaultStream and every other logged stream to a stream of its
	// own, created on the resource's device for the replay and closed afterwards.
	Stream func(logged uintptr) StreamView
	// OnFailure, when set, is called for each allocation that fails during the replay (not for
	// the log's own "allocate failure" lines, which are skipped). Default: failures are counted.
	OnFailure func(e LogEvent, err error)
	// AfterEvent, when set, is called once for every event of the log, right after it was
	// replayed (or skipped), in the log's order and never concurrently: with several logged
	// threads the goroutine that replayed event i calls it before event i+1 may start. It gets
	// the event's index in events and the bytes the log holds live after it (the requested
	// sizes allocated and not yet freed, whose maximum is ReplayResult.PeakLiveBytes; the same
	// whatever mr does). It runs in the timed part of the replay, so it should be quick: it is
	// meant for sampling a resource's footprint along the trace. Default: none, at no cost.
	AfterEvent func(i int, liveBytes int64)
	// Serial replays every event from the calling goroutine, whatever thread logged it, as
	// librmm's replay benchmark does when run single-threaded: the resource gets the same calls
	// in the same order (the log's, which the goroutine per logged thread keep too), without
	// the hand-off from one goroutine to the next where the logged thread changes. Default:
	// one goroutine per logged thread.
	Serial bool
}

// ReplayResult is what a Replay measured.
type ReplayResult struct {
	Events          int           // events in the log
	Allocations     int           // allocations replayed (including zero-byte ones)
	Frees           int           // frees replayed
	LoggedFailures  int           // "allocate failure" lines in the log, skipped
	Failures        int           // allocations that failed during the replay
	UnmatchedFrees  int           // frees of pointers the log never allocated (skipped)
	Threads         int           // logged threads: the goroutines used, unless Serial
	Wall            time.Duration // time to replay all events, in their logged order
	PeakLiveBytes   int64         // highest sum of live (requested) sizes during the replay
	LeftAllocations int           // allocations the log never frees (duplicated ones included)
	LeftBytes       int64         // their requested bytes

	// MismatchedFrees counts frees whose logged size differs from the size their allocation
	// logged. Each is replayed with the allocation's size, as a resource needs it, and the live
	// bytes drop by that size.
	MismatchedFrees int
	// DuplicateAllocations counts allocations of a pointer the log already held live (the log
	// has no free of it in between). The new allocation takes the pointer, and so the later
	// free; the earlier one is left live to the end of the replay, freed then with the other
	// leftovers, and counted in LeftAllocations and LeftBytes.
	DuplicateAllocations int
}

// NsPerEvent is the wall time per replayed event.
func (r ReplayResult) NsPerEvent() float64 {
	if r.Events == 0 {
		return 0
	}
	return float64(r.Wall.Nanoseconds()) / float64(r.Events)
}

// Replay replays an RMM event log (as read by ReadLog) against mr in the log's exact global
// order: one goroutine per logged thread, each event waiting for the one before it in the log,
// as librmm's replay benchmark does (or all from one goroutine: ReplayOptions.Serial). Logged
// pointers are remapped to the pointers mr returns; "allocate failure" lines are skipped; a free
// of a pointer the log never allocated is skipped and counted. A log that contradicts itself is
// replayed as far as it can be and counted, never rejected: a free with a size other than its
// allocation's frees the allocation's size ([ReplayResult.MismatchedFrees]), and a pointer
// allocated again while live leaves the earlier allocation live
// ([ReplayResult.DuplicateAllocations]). Allocations the log leaves live are freed after the
// timed part. The error is non-nil only for a failed Deallocate (which means
// a bug in mr) or a stream that cannot be created.
func Replay(events []LogEvent, mr MemoryResource, opts *ReplayOptions) (ReplayResult, error) {
	mr = resourceOrCurrent(mr)
	var o ReplayOptions
	if opts != nil {
		o = *opts
	}
	res := ReplayResult{Events: len(events)}

	// Pre-pass: match each free with its allocation, group events by thread, map streams.
	type op struct {
		kind   EventAction
		size   int
		match  int32 // for a free: index of its allocation in events, or -1
		stream StreamView
	}
	ops := make([]op, len(events))
	lastAlloc := map[DevicePtr]int32{}
	threads := map[uint64][]int32{}
	var owned []*Stream
	defer func() {
		for _, s := range owned {
			s.Close()
		}
	}()
	streams := map[uintptr]StreamView{}
	streamFor := func(h uintptr) (StreamView, error) {
		if s, ok := streams[h]; ok {
			return s, nil
		}
		var s StreamView
		switch {
		case o.Stream != nil:
			s = o.Stream(h)
		case h == 0:
			s = DefaultStream
		default:
			st, err := NewStream(DeviceOf(mr), &StreamOptions{NonBlocking: true})
			if err != nil {
				return s, err
			}
			owned = append(owned, st)
			s = st.View()
		}
		streams[h] = s
		return s, nil
	}
	var live, peak int64
	var liveAfter []int64 // live bytes after each event, for AfterEvent
	after := o.AfterEvent
	if after != nil {
		liveAfter = make([]int64, len(events))
	}
	var orphans []int32
	for i, e := range events {
		s, err := streamFor(e.Stream)
		if err != nil {
			return res, errorf("Replay: creating a stream for logged stream %#x: %w", e.Stream, err)
		}
		ops[i] = op{kind: e.Action, size: e.Size, match: -1, stream: s}
		switch e.Action {
		case ActionAllocate:
			res.Allocations++
			if e.Pointer != 0 {
				if j, ok := lastAlloc[e.Pointer]; ok {
					// The log hands out a pointer it never freed: that earlier allocation is
					// never freed by the log.
					orphans = append(orphans, j)
					res.DuplicateAllocations++
				}
				lastAlloc[e.Pointer] = int32(i)
			}
			if live <= math.MaxInt64-int64(e.Size) {
				live += int64(e.Size)
			}
			peak = max(peak, live)
		case ActionFree:
			switch j, ok := lastAlloc[e.Pointer]; {
			case e.Pointer == 0:
				res.Frees++ // a zero-byte allocation's free: nothing to do
			case ok:
				ops[i].match = j
				delete(lastAlloc, e.Pointer)
				live -= int64(events[j].Size)
				res.Frees++
				if e.Size != events[j].Size {
					res.MismatchedFrees++ // replayed with the allocation's size, ops[j].size
				}
			default:
				res.UnmatchedFrees++
			}
		case ActionAllocateFailure:
			res.LoggedFailures++
		}
		if liveAfter != nil {
			liveAfter[i] = live
		}
		threads[e.Thread] = append(threads[e.Thread], int32(i))
	}
	res.PeakLiveBytes = peak
	res.LeftAllocations = len(lastAlloc) + len(orphans)
	for _, j := range lastAlloc {
		res.LeftBytes += int64(events[j].Size)
	}
	for _, j := range orphans {
		res.LeftBytes += int64(events[j].Size)
	}
	res.Threads = len(threads)

	ptrs := make([]DevicePtr, len(events))
	failed := make([]bool, len(events))
	var turn atomic.Int64 // index of the event whose turn it is
	var failures atomic.Int64
	var firstErr error
	var errMu sync.Mutex
	// With several logged threads, the goroutine that finishes event i wakes the owner of event
	// i+1: it stores the turn, then posts a token to the owner's channel. The owner spins a little
	// first (a hand-off between two running goroutines is then cheap) and parks otherwise.
	owner := make([]int32, len(events))
	wake := make([]chan struct{}, 0, len(threads))
	waitTurn := func(g int, i int32) {
		for spin := 0; spin < 200; spin++ {
			if turn.Load() == int64(i) {
				return
			}
			if spin%16 == 15 {
				runtime.Gosched()
			}
		}
		for turn.Load() != int64(i) {
			<-wake[g]
		}
	}
	pass := func(i int32) {
		turn.Store(int64(i) + 1)
		if next := int(i) + 1; next < len(owner) {
			select {
			case wake[owner[next]] <- struct{}{}:
			default: // a token is already waiting
			}
		}
	}
	run := func(g int, idx []int32, wait bool) {
		for _, i := range idx {
			if wait {
				waitTurn(g, i)
			}
			o := &ops[i]
			switch o.kind {
			case ActionAllocate:
				p, err := mr.Allocate(o.size, o.stream)
				if err != nil {
					failed[i] = true
					failures.Add(1)
					if opts != nil && opts.OnFailure != nil {
						opts.OnFailure(events[i], err)
					}
				}
				ptrs[i] = p
			case ActionFree:
				if j := o.match; j >= 0 && !failed[j] {
					if err := mr.Deallocate(ptrs[j], ops[j].size, o.stream); err != nil {
						errMu.Lock()
						if firstErr == nil {
							firstErr = errorf("Replay: line %d: freeing %s: %w", events[i].Line, bytesText(ops[j].size), err)
						}
						errMu.Unlock()
					}
					ptrs[j] = 0
				}
			}
			if after != nil {
				after(int(i), liveAfter[i])
			}
			if wait {
				pass(i)
			}
		}
	}
	start := time.Now()
	if len(threads) <= 1 || o.Serial {
		all := make([]int32, len(events))
		for i := range all {
			all[i] = int32(i)
		}
		run(0, all, false)
	} else {
		ids := make([]uint64, 0, len(threads))
		for id := range threads {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		for g, id := range ids {
			wake = append(wake, make(chan struct{}, 1))
			for _, i := range threads[id] {
				owner[i] = int32(g)
			}
		}
		var wg sync.WaitGroup
		for g, id := range ids {
			wg.Add(1)
			go func(g int, idx []int32) {
				defer wg.Done()
				run(g, idx, true)
			}(g, threads[id])
		}
		wg.Wait()
	}
	res.Wall = time.Since(start)
	res.Failures = int(failures.Load())

	// Free what the log left allocated (orphaned allocations included).
	for j, p := range ptrs {
		if p != 0 && ops[j].kind == ActionAllocate {
			if err := mr.Deallocate(p, ops[j].size, ops[j].stream); err != nil && firstErr == nil {
				firstErr = errorf("Replay: freeing a leftover allocation of line %d: %w", events[j].Line, err)
			}
		}
	}
	for _, s := range streams {
		s.Synchronize()
	}
	return res, firstErr
}

var _ = errors.New
