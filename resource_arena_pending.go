package rmm

import (
	"slices"
)

// Stream-ordered reuse of the global arena. A free into the global arena does not wait for the
// freeing stream: the superblock notes the stream as pending (arenaPending), and a stream that
// later takes memory from that superblock first waits on the device for an event of each
// pending stream (waitPending). Apart from making a stream's record (streamRec) and finding a
// published one (lazyRec, streamSet), everything here runs under the global arena's lock,
// CUDA calls included: they are made when memory passes from one stream to another (and at each
// free on a foreign stream), never when DefaultStream or one of our Streams allocates and frees
// alone.

// arenaPendingMax bounds the streams a superblock remembers. A free by one more stream
// synchronises that stream on the host instead; a merge that would hold more synchronises the
// streams that do not fit.
const arenaPendingMax = 4

// arenaStream is what the arena knows of a stream that freed memory into the global arena. Its
// fields are guarded by the global arena's lock, except stream and lazy, which never change (nor
// does a foreign stream's event until the record is dropped).
type arenaStream struct {
	stream StreamView
	// event is recorded on stream to order another stream after the frees (0 until needed on
	// a lazy stream; made with the record on a foreign one).
	event uintptr
	// lazy: the package knows when the stream dies (DefaultStream, our own Streams), so the
	// event is recorded only when another stream waits for it. Otherwise (NewStreamView) it is
	// recorded at every free, while the stream surely exists.
	lazy bool
	// dirty: a lazy stream freed memory since its event was last recorded.
	dirty bool
	// waited holds the ids of the first nWaited streams of known lifetime (DefaultStream, our
	// Streams) that already wait for the event as last recorded: a stream's later work stays
	// ordered after a wait, so waiting again would be a redundant cuStreamWaitEvent. Emptied at
	// each record; when full, the oldest entry gives way.
	waited  [arenaWaitedMax]uint64
	nWaited uint8
	oldest  uint8
	// done: the work queued on the stream before it was set has finished (the Stream was
	// synchronised before it closed; a foreign stream's record was dropped after the device was
	// synchronised) and the record is no longer used: entries naming it are ignored, and its
	// event is destroyed.
	done bool
}

// arenaWaitedMax bounds the streams an arenaStream remembers as already waiting for its event.
const arenaWaitedMax = 4

// hasWaited reports whether the stream with this id already waits for x's event as last
// recorded.
func (x *arenaStream) hasWaited(id uint64) bool {
	return slices.Contains(x.waited[:x.nWaited], id)
}

// noteWaited notes that stream t now waits for x's event as last recorded (streams of unknown
// lifetime are not noted: a foreign stream's id may come back with another stream).
func (x *arenaStream) noteWaited(t StreamView) {
	if !t.lifetimeKnown() || x.hasWaited(t.id) {
		return
	}
	if int(x.nWaited) < arenaWaitedMax {
		x.waited[x.nWaited] = t.id
		x.nWaited++
		return
	}
	x.waited[x.oldest] = t.id
	x.oldest = (x.oldest + 1) % arenaWaitedMax
}

// recorded notes that x's event was recorded again: no stream waits for it yet.
func (x *arenaStream) recorded() { x.nWaited, x.oldest = 0, 0 }

// arenaPending is the set of streams that freed memory into a superblock of the global arena
// and may still have work queued before those frees. A stream other than these that takes
// memory from the superblock must first wait for them.
type arenaPending struct {
	recs [arenaPendingMax]*arenaStream
	n    int
}

func (p *arenaPending) len() int {
	if p == nil {
		return 0
	}
	return p.n
}

// has reports whether x is in the set.
func (p *arenaPending) has(x *arenaStream) bool {
	if p == nil {
		return false
	}
	for _, y := range p.recs[:p.n] {
		if y == x {
			return true
		}
	}
	return false
}

// prune drops the entries whose stream is done.
func (p *arenaPending) prune() {
	k := 0
	for _, y := range p.recs[:p.n] {
		if !y.done {
			p.recs[k] = y
			k++
		}
	}
	clear(p.recs[k:p.n])
	p.n = k
}

// fits reports whether x is in the set or can be added, pruning finished streams first when the
// set is full.
func (p *arenaPending) fits(x *arenaStream) bool {
	if p == nil || p.has(x) {
		return true
	}
	if p.n == arenaPendingMax {
		p.prune()
	}
	return p.n < arenaPendingMax
}

// add puts x in the set and reports whether it is there (false: the set is full without it).
func (p *arenaPending) add(x *arenaStream) bool {
	if !p.fits(x) {
		return false
	}
	if !p.has(x) {
		p.recs[p.n] = x
		p.n++
	}
	return true
}

// union adds q's entries to p; those that do not fit are passed to over (which must see to
// their work) and left out.
func (p *arenaPending) union(q *arenaPending, over func(*arenaStream)) {
	if q == nil {
		return
	}
	for _, y := range q.recs[:q.n] {
		if !p.add(y) {
			over(y)
		}
	}
}

// check verifies the set: at most arenaPendingMax distinct entries, the rest of the array nil.
func (p *arenaPending) check() error {
	if p.n < 0 || p.n > arenaPendingMax {
		return errorf("pending set of %d streams", p.n)
	}
	for i, x := range p.recs {
		switch {
		case i >= p.n && x != nil:
			return errorf("pending set keeps a stream past its %d entries", p.n)
		case i < p.n && x == nil:
			return errorf("pending set entry %d is empty", i)
		case i < p.n && slices.Index(p.recs[:i], x) >= 0:
			return errorf("pending set names %v twice", x.stream)
		}
	}
	return nil
}

// clear empties the set (nil: nothing to do).
func (p *arenaPending) clear() {
	if p != nil {
		clear(p.recs[:p.n])
		p.n = 0
	}
}

// pending returns sb's set of pending streams, making it on first use (global arena locked). A
// superblock keeps its set, emptied, when it is reset, so a reused superblock allocates nothing.
func (sb *arenaSuperblock) pending() *arenaPending {
	if sb.pend == nil {
		sb.pend = new(arenaPending)
	}
	return sb.pend
}

// streamRec returns what the arena knows of s, making it on first use: for a foreign stream
// with its event (cuEventCreate), for one of our Streams after asking to be told when it closes.
// It returns nil (and no error) after Close and for a Stream that was closed: the caller then
// synchronises s instead.
func (r *ArenaMemoryResource) streamRec(s StreamView) (*arenaStream, error) {
	if s.id == 0 {
		return &r.defRec, nil
	}
	if v, ok := r.recs.Load(s.id); ok {
		return v.(*arenaStream), nil
	}
	r.streamsMu.Lock()
	defer r.streamsMu.Unlock()
	if v, ok := r.recs.Load(s.id); ok {
		return v.(*arenaStream), nil
	}
	if r.closed.Load() {
		return nil, nil
	}
	x := &arenaStream{stream: s.deviceView(r.dev), lazy: s.lifetimeKnown()}
	if x.lazy {
		if r.hook(s) != nil {
			return nil, nil
		}
	} else {
		e, err := r.drv.eventCreate(r.ctx, cuEventDisableTiming)
		if err != nil {
			return nil, errorf("ArenaMemoryResource: creating the event for %v: %w", s, err)
		}
		x.event = e
	}
	r.recs.Store(s.id, x)
	if x.lazy {
		r.lazyRecs.Store(r.lazyRecs.Load().with(s.id, x))
	}
	return x, nil
}

// lazyRec returns the record of s when s is DefaultStream, or one of our Streams whose record is
// published in lazyRecs; nil otherwise. It takes no lock (a binary search of the published
// records); the record's fields are read under the global arena's lock.
func (r *ArenaMemoryResource) lazyRec(s StreamView) *arenaStream {
	if s.id == 0 {
		return &r.defRec
	}
	if s.id&ownedStreamBit == 0 {
		return nil
	}
	x, _ := r.lazyRecs.Load().find(s.id)
	return x
}

// notePending records, before a free on x's stream into sb (in the global arena, locked), that
// the stream may still have work queued: a foreign stream's event is recorded now
// (cuEventRecord), a lazy stream is marked dirty. It returns false, changing nothing, when sb
// already remembers arenaPendingMax other streams: the caller synchronises the stream instead.
func (r *ArenaMemoryResource) notePending(sb *arenaSuperblock, x *arenaStream) (bool, error) {
	known := sb.pend.has(x)
	if !known && !sb.pend.fits(x) {
		return false, nil
	}
	if x.lazy {
		x.dirty = true
	} else if err := r.drv.eventRecord(r.ctx, x.event, x.stream.cu()); err != nil {
		return false, errorf("ArenaMemoryResource.Deallocate: recording the event on %v: %w", x.stream, err)
	} else {
		x.recorded()
	}
	if !known {
		sb.pending().add(x)
	}
	return true, nil
}

// waitPending makes t wait, on the device (the host does not block), for the work queued
// before the frees of every stream in p but t: a lazy stream with frees since its last record
// records its event and t waits on it in one call (cuEventRecord, cuStreamWaitEvent; the event
// is made then if needed, cuEventCreate), any other waits on the event as last recorded. The
// global arena is locked: these CUDA calls run under its lock, on the path where memory passes
// from one stream to another.
func (r *ArenaMemoryResource) waitPending(p *arenaPending, t StreamView) error {
	if p == nil {
		return nil
	}
	for _, x := range p.recs[:p.n] {
		if x.done || x.stream.id == t.id {
			continue
		}
		if x.lazy && x.dirty {
			if x.event == 0 {
				e, err := r.drv.eventCreate(r.ctx, cuEventDisableTiming)
				if err != nil {
					return errorf("creating the event for %v: %w", x.stream, err)
				}
				x.event = e
			}
			if err := r.drv.recordAndWait(r.ctx, x.event, x.stream.cu(), t.cu()); err != nil {
				return errorf("ordering %v after %v: %w", t, x.stream, err)
			}
			x.dirty = false
			x.recorded()
			x.noteWaited(t)
			continue
		}
		if x.event != 0 && !x.hasWaited(t.id) {
			if err := r.drv.streamWaitEvent(r.ctx, t.cu(), x.event); err != nil {
				return errorf("ordering %v after %v: %w", t, x.stream, err)
			}
			x.noteWaited(t)
		}
	}
	return nil
}

// hostWait waits on the host for the work x's stream queued before its frees (global arena
// locked): cuStreamSynchronize on a lazy stream with frees since its last record, else
// cuEventSynchronize on its event. A failure falls back to cuCtxSynchronize; if that fails too
// it is logged, and the entry is dropped all the same (the context is then lost anyway).
func (r *ArenaMemoryResource) hostWait(x *arenaStream) {
	if x.done {
		return
	}
	var err error
	switch {
	case x.lazy && x.dirty:
		if err = r.drv.streamSynchronize(r.ctx, x.stream.cu()); err == nil {
			x.dirty = false // every free so far is covered: the event as last recorded (or none) will do
		}
	case x.event != 0:
		err = r.drv.eventSynchronize(r.ctx, x.event)
	}
	if err == nil {
		return
	}
	DebugLogger().Warn("rmm: ArenaMemoryResource: waiting for a stream's frees failed; synchronising the device", "stream", x.stream.String(), "err", err)
	if err := r.drv.ctxSynchronize(r.ctx); err != nil {
		DebugLogger().Error("rmm: ArenaMemoryResource: synchronising the device failed", "err", err)
	}
}

// mergePending gives sb, about to absorb its empty neighbour next (both in the global arena,
// locked), the union of their pending streams. Streams that do not fit are waited for on the
// host (hostWait), under the global arena's lock: with at most arenaPendingMax streams per
// superblock this is rare, and keeps every later reuse to a bounded number of waits.
func (r *ArenaMemoryResource) mergePending(sb, next *arenaSuperblock) {
	if next.pend.len() == 0 {
		return
	}
	sb.pending().union(next.pend, r.hostWait)
	next.pend.clear()
}

// copyPending gives the superblock tail, just split off sb (global arena locked), sb's pending
// streams: its memory was freed behind the same work.
func copyPending(tail, sb *arenaSuperblock) {
	switch {
	case sb.pend.len() == 0:
		tail.pend.clear()
	case samePending(tail, sb):
	default:
		*tail.pending() = *sb.pend
	}
}

// samePending reports whether sb and next name the same pending streams in the same order
// (global arena locked).
func samePending(sb, next *arenaSuperblock) bool {
	p, q := sb.pend, next.pend
	if p.len() != q.len() {
		return false
	}
	for i := range p.len() {
		if p.recs[i] != q.recs[i] {
			return false
		}
	}
	return true
}

// clearPending forgets sb's pending streams (global arena locked): their work has finished, or
// the stream that takes sb has waited for it.
func clearPending(sb *arenaSuperblock) { sb.pend.clear() }

// dropRec marks x done and destroys its event (global arena locked).
func (r *ArenaMemoryResource) dropRec(x *arenaStream) {
	x.done, x.dirty = true, false
	if x.event != 0 {
		if err := r.drv.eventDestroy(r.ctx, x.event); err != nil {
			DebugLogger().Warn("rmm: ArenaMemoryResource: destroying a stream's event failed", "stream", x.stream.String(), "err", err)
		}
		x.event = 0
	}
}

// forgetPending runs after the device was synchronised, with streamsMu and the global arena
// locked: every superblock of the global arena forgets its pending streams, lazy streams need
// not record their events for the frees so far, and the records of foreign streams are dropped
// (their events destroyed), so that an arena used with many short-lived foreign streams keeps
// nothing for them. Records of our Streams go when the Streams close.
func (r *ArenaMemoryResource) forgetPending() {
	r.global.tree.each(func(x *arenaNode) { clearPending(x.sb) })
	r.defRec.dirty = false
	r.recs.Range(func(k, v any) bool {
		x := v.(*arenaStream)
		if x.lazy {
			x.dirty = false
		} else {
			r.dropRec(x)
			r.recs.Delete(k)
		}
		return true
	})
}

// dropRecs destroys every record's event once the device has been synchronised at Close
// (streamsMu and the global arena are taken here). After Close no record is made again.
func (r *ArenaMemoryResource) dropRecs() {
	r.streamsMu.Lock()
	defer r.streamsMu.Unlock()
	r.lockGlobal()
	defer r.global.mu.Unlock()
	r.global.tree.each(func(x *arenaNode) { clearPending(x.sb) })
	r.dropRec(&r.defRec)
	r.recs.Range(func(k, v any) bool {
		r.dropRec(v.(*arenaStream))
		r.recs.Delete(k)
		return true
	})
	r.lazyRecs.Store(nil)
}
