package rmm

import (
	"errors"
	"slices"
)

// Stream-ordered free lists: the part the pool (freeList, pool_freelist.go) and the
// fixed-size resource (fixedList, resource_fixed.go) share. Each list embeds a streamOrder, each
// resource a streamLists, its registry of lists; what a list holds (a TLSF index of blocks, a
// stack of equal blocks) and how the resource locks stay its own.
//
// Memory freed on stream A may be reused at once by work ordered on A; stream B may reuse it only
// after B waits, on the device, for an event recorded on A after the free. A resource keeps one
// free list per stream, made on the stream's first use, and one event (cuEventDisableTiming) per
// list, destroyed when the list is dropped or the resource closed. The driver calls go through
// the resource's cudaDriver (drv), so that tests can fake CUDA (arenaSyncFake); without CUDA
// (ctx 0) no event exists and nothing is waited for.
//
//   - Recording. On a stream whose lifetime the package knows (DefaultStream, and our own
//     Streams, whose Close tells the resource first: streamCloseHook) the list is lazy: a free
//     only marks it dirty, and the event is recorded when another stream takes from it (a record
//     and a wait in one call) or when the stream closes. On a view of a foreign handle, which may
//     be destroyed at any time, the event is recorded at every free, while the stream surely
//     exists.
//   - Taking. A stream taking blocks from another stream's list records that list's event first
//     when it is dirty (claimRecord clears the flag: the record is the taker's), never on a closed
//     list (its stream is gone; its event was recorded before), then waits on the event. After a
//     failed call the event's state is unknown: a lazy list is marked dirty again (unclaim).
//   - A stream closing (streamClosing, called by Stream.Close while the stream still exists):
//     an idle list is dropped. Otherwise the legacy default stream waits for the list's event
//     (recorded first when dirty) and the resource moves the blocks to the default stream's list
//     and drops the list; when the wait fails the host waits for the stream, failing that for the
//     whole device. Without a default list (the event then recorded when dirty), or when even the
//     device could not be waited for, the blocks stay where they are, in a list now closed: never
//     recorded again, taken only after a wait on its event.
//   - A closed Stream. A free on a Stream that was closed can no longer be ordered after it: the
//     host waits for the whole device (syncClosed) and the block goes to the default stream's
//     list. After the resource's Close (no events left), a free waits on the host for its stream,
//     the whole device for a closed Stream (syncAfterClose).

// streamOrder is a free list's stream-ordering state.
type streamOrder struct {
	stream  StreamView // with the resource's device
	event   uintptr    // CUevent recorded on stream (0 without CUDA, and after it was destroyed)
	lazy    bool       // the stream's lifetime is known: record the event only when another stream takes blocks
	dirty   bool       // a lazy list freed blocks since its event was last recorded
	closed  bool       // the stream was destroyed (its event was recorded just before)
	dropped bool       // the resource forgot the list (dropList)
}

// order gives the registry a list's stream-ordering state (promoted to the lists that embed it).
func (o *streamOrder) order() *streamOrder { return o }

// claimRecord reports whether a stream taking from the list must record its event before waiting
// on it: the list is dirty, or inFlight (the pool: a record made unlocked is still on its way,
// and until it is made the event holds an older one), and its stream still exists. The flag is
// cleared: the record is the taker's now.
func (o *streamOrder) claimRecord(inFlight bool) bool {
	record := (o.dirty || inFlight) && !o.closed
	if record {
		o.dirty = false
	}
	return record
}

// unclaim follows a failed record or wait: the event's state is unknown, so a lazy list records
// again at its next take.
func (o *streamOrder) unclaim() {
	if o.lazy {
		o.dirty = true
	}
}

// streamList is a resource's per-stream free list: it embeds streamOrder.
type streamList interface {
	comparable
	order() *streamOrder
	// idle reports whether nothing keeps the list once its stream closes (no free blocks, and
	// for the pool no block that names it among its deps).
	idle() bool
}

// streamLists is a resource's registry of per-stream lists, with the device context and driver
// table its calls go through. The resource embeds it (so p.ctx, p.drv, p.lists and p.listFor
// read as the resource's own) and locks around every method.
type streamLists[L streamList] struct {
	name    string // the resource's type, for errors and logs
	dev     Device
	ctx     uintptr     // 0 without CUDA: no events are used
	drv     *cudaDriver // the CUDA calls (tests may fake them)
	hook    streamCloseHook
	newList func(n int) L // a new empty list, the registry holding n
	lists   []L           // in order of first use
	// byStream finds a stream's list by StreamView.ID.
	byStream map[uint64]L
	// hooked holds the Streams whose Close will tell the resource, hook (even while they have no
	// list). dropHooks empties it and sets hook to nil: no Stream is hooked again.
	hooked map[uint64]bool
}

// initStreams readies the registry of the resource hook, named name, on dev. It fails when dev's
// context cannot be had.
func (r *streamLists[L]) initStreams(name string, dev Device, hook streamCloseHook, newList func(n int) L) error {
	r.name, r.dev, r.drv, r.hook, r.newList = name, dev, &cudaCalls, hook, newList
	r.byStream, r.hooked = map[uint64]L{}, map[uint64]bool{}
	if CUDAAvailable() == nil {
		ctx, err := dev.ctx()
		if err != nil {
			return err
		}
		r.ctx = ctx
	}
	return nil
}

// listFor returns stream s's list, creating it (and its event) on first use, and asking to be
// told of s's Close when the list is lazy. It returns ErrClosed for a Stream of ours that was
// closed.
func (r *streamLists[L]) listFor(s StreamView) (L, error) {
	var zero L
	if l, ok := r.byStream[s.id]; ok {
		if l.order().closed {
			return zero, errStreamClosed(r.name+".Allocate", s)
		}
		return l, nil
	}
	l := r.newList(len(r.byStream))
	o := l.order()
	o.stream, o.lazy = s.deviceView(r.dev), s.lifetimeKnown()
	if o.lazy && s.id != 0 && !r.hooked[s.id] {
		if r.hook == nil {
			// Never reached: nothing names a stream after dropHooks. Should it be, the caller
			// treats the stream as closed (a free then waits for the device).
			return zero, errorf("%s: called after Close: %w", r.name, ErrClosed)
		}
		if !addStreamCloseHook(s, r.hook) {
			return zero, errStreamClosed(r.name+".Allocate", s)
		}
		r.hooked[s.id] = true
	}
	if r.ctx != 0 {
		e, err := r.drv.eventCreate(r.ctx, cuEventDisableTiming)
		if err != nil {
			return zero, errorf("%s: creating the event for %v: %w", r.name, s, err)
		}
		o.event = e
	}
	r.byStream[s.id] = l
	r.lists = append(r.lists, l)
	return l, nil
}

// dropHooks takes the resource's close hook off every Stream it is on (resource locked). The
// resource calls it once it is closed and nothing allocated from it is live: from then on
// Allocate fails and a Deallocate can only be an invalid free, so no call names a stream again,
// and a Stream's Close has nothing left to tell it (after Close its lists hold no blocks and it
// has no events). Until then the hooks stay, so that everything a Stream's Close did for the
// resource before it was closed, and for the frees that outlive its Close, stays as it was;
// among them, the Close of a Stream waits on the resource's lock for a free after Close that is
// synchronising that Stream. Without these removals a long-lived Stream (one of a StreamPool)
// would keep every resource it ever served reachable.
//
// Removing the hooks, rather than leaving on the Stream an indirection the resource clears,
// leaves the Stream holding nothing of the resource at all, and needs no new lock order: the
// resource's lock, then the Stream's, is the order listFor already takes when it adds a hook.
// A Stream whose Close took its hooks before this call still tells the resource afterwards;
// streamClosing, under the resource's lock, then finds it closed (closeStream with closed set).
func (r *streamLists[L]) dropHooks() {
	for id := range r.hooked {
		removeStreamCloseHook(id, r.hook)
	}
	clear(r.hooked)
	r.hook = nil
}

// dropList forgets list l and destroys its event (the pool: l must not be pinned).
func (r *streamLists[L]) dropList(l L) {
	o := l.order()
	o.dropped = true
	delete(r.byStream, o.stream.id)
	if i := slices.Index(r.lists, l); i >= 0 {
		r.lists = append(r.lists[:i], r.lists[i+1:]...)
	}
	if o.event != 0 {
		r.drv.eventDestroy(r.ctx, o.event)
		o.event = 0
	}
}

// destroyEvents destroys every list's event (the resource's Close): nothing is recorded or waited
// for afterwards.
func (r *streamLists[L]) destroyEvents() {
	for _, l := range r.lists {
		o := l.order()
		if o.event != 0 {
			r.drv.eventDestroy(r.ctx, o.event)
			o.event = 0
		}
		o.lazy, o.dirty = false, false
	}
}

// freeTo returns the list a free on s goes to, with its event made to cover the free (noteFree),
// and the stream the free is then ordered on: s's list, or for a Stream that was closed the
// default stream's, once sync waited for the whole device (nil: syncClosed; the pool makes that
// call unlocked).
func (r *streamLists[L]) freeTo(s StreamView, sync func() error) (L, StreamView, error) {
	l, err := r.listFor(s)
	if errors.Is(err, ErrClosed) {
		if sync == nil {
			err = r.syncClosed(s)
		} else {
			err = sync()
		}
		if err != nil {
			return l, s, err
		}
		s = DefaultStream
		l, err = r.listFor(s)
	}
	if err == nil {
		err = r.noteFree(l, s)
	}
	return l, s, err
}

// noteFree makes l's event cover a free on s, l's stream: recorded now on a stream we hold only a
// view of (while it surely exists), else l is marked dirty.
func (r *streamLists[L]) noteFree(l L, s StreamView) error {
	o := l.order()
	if o.lazy || r.ctx == 0 {
		o.dirty = true
		return nil
	}
	if err := r.drv.eventRecord(r.ctx, o.event, s.cu()); err != nil {
		return errorf("%s.Deallocate: recording the event on %v: %w", r.name, s, err)
	}
	return nil
}

// ordered reports whether a taker from l must wait at all: l has an event.
func (r *streamLists[L]) ordered(l L) bool { return r.ctx != 0 && l.order().event != 0 }

// waitOn makes the stream with handle s wait, on the device, for l's event, recorded on l's
// stream first when record is set (claimRecord).
func (r *streamLists[L]) waitOn(l L, record bool, s uintptr) error {
	o := l.order()
	if record {
		return r.drv.recordAndWait(r.ctx, o.event, o.stream.cu(), s)
	}
	return r.drv.streamWaitEvent(r.ctx, s, o.event)
}

// orderAfter orders stream s after every free into l, under the caller's lock (the pool's
// takes split this around an unlock: beginWait, doWait, endWait).
func (r *streamLists[L]) orderAfter(l L, s StreamView) error {
	if !r.ordered(l) {
		return nil
	}
	o := l.order()
	record := o.claimRecord(false)
	err := r.waitOn(l, record, s.cu())
	if err != nil && record {
		o.unclaim()
	}
	return err
}

// hostWait waits on the host for the work behind l's frees, recording its event first when
// record is set (claimRecord).
func (r *streamLists[L]) hostWait(l L, record bool) error {
	o := l.order()
	if record {
		if err := r.drv.eventRecord(r.ctx, o.event, o.stream.cu()); err != nil {
			return err
		}
	}
	return r.drv.eventSynchronize(r.ctx, o.event)
}

// closeStream applies the close rule to s's list as Stream.Close is about to destroy s (resource
// locked; closed: the resource was closed). When the list's blocks are to move to the default
// stream's list (ordered after s's work, and def marked dirty), it returns both lists and true:
// the caller moves them and drops l.
func (r *streamLists[L]) closeStream(s StreamView, closed bool) (def, l L, move bool) {
	delete(r.hooked, s.id)
	l, ok := r.byStream[s.id]
	if !ok {
		return def, l, false
	}
	o := l.order()
	if closed {
		o.closed = true
		return def, l, false
	}
	if l.idle() {
		r.dropList(l)
		return def, l, false
	}
	def, derr := r.listFor(DefaultStream)
	hasDef := derr == nil
	var err error
	if r.ctx != 0 && o.event != 0 {
		switch {
		case !hasDef && o.dirty:
			// The blocks stay in l, and whoever takes them later waits on l's event (l is closed:
			// never recorded again), which must cover them now.
			err = r.drv.eventRecord(r.ctx, o.event, o.stream.cu())
		case !hasDef:
		default:
			err = r.waitOn(l, o.dirty, cuStreamLegacy)
		}
		if err != nil {
			// Cannot order on the device: wait for the stream on the host instead, or failing
			// that for the whole device (the event may not hold the frees: the record may be what
			// failed).
			DebugLogger().Warn("rmm: "+r.name+": ordering a closing stream's frees failed; synchronising it", "stream", s.String(), "err", err)
			if err = r.drv.streamSynchronize(r.ctx, o.stream.cu()); err != nil {
				err = r.drv.ctxSynchronize(r.ctx)
			}
		}
	}
	if !hasDef || err != nil {
		// Keep the blocks where they are, reachable only through an event wait by other streams
		// (when even the device could not be waited for, the context is broken: nothing orders
		// them then).
		o.dirty, o.closed, o.lazy = false, true, false
		return def, l, false
	}
	def.order().dirty = true // the default stream's event must now cover what it waited for
	return def, l, true
}

// syncClosed waits on the host for the whole device before a free on s, a Stream that was closed,
// goes to the default stream's list (freeTo).
func (r *streamLists[L]) syncClosed(s StreamView) error {
	if r.ctx == 0 {
		return nil
	}
	if err := r.drv.ctxSynchronize(r.ctx); err != nil {
		return errorf("%s.Deallocate on closed %v: %w", r.name, s, err)
	}
	return nil
}

// syncAfterClose waits on the host for the work queued on s before a free made after the
// resource's Close, which has no events left: for a Stream that was closed, whose handle is gone,
// the whole device.
func (r *streamLists[L]) syncAfterClose(s StreamView) error {
	var err error
	switch {
	case r.ctx == 0:
	case s.closed():
		err = r.drv.ctxSynchronize(r.ctx)
	default:
		err = r.drv.streamSynchronize(r.ctx, s.cu())
	}
	if err != nil {
		return errorf("%s.Deallocate: called after Close: synchronising %v: %w", r.name, s, err)
	}
	return nil
}
