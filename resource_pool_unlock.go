package rmm

// Driver calls out of the pool's mutex.
//
// A cuMemAlloc, a cuMemCreate + cuMemMap + cuMemSetAccess, a cuEventSynchronize or a cuMemFree
// takes tens of microseconds to milliseconds; made under the pool's mutex it would stall every
// goroutine using the pool. So the pool makes them unlocked, and keeps its state consistent
// around them:
//
//   - Growth and release are slow paths run by one goroutine at a time, the holder of the busy
//     token (p.busy). Between its decisions (under the mutex) and its effects (under the mutex
//     again) nothing else grows, maps, unmaps or gives memory back, so the pool's size, the
//     expandable pool's chunks, holes and end stay as the holder left them, and the pool can
//     never pass its maximum. An allocation that would need to grow while the token is held
//     waits (p.wait) and searches again when it is released: the growth in flight may have made
//     the room it needs. Allocations and frees that fit in free memory go on meanwhile.
//   - A list held across an unlock is pinned (freeList.pins): no one drops it, so its event
//     exists until the call naming it returns; Stream.Close (streamClosing) waits until its list
//     is unpinned before the stream is destroyed, and the pool's Close until no list is.
//   - A block taken from another stream's list is out of every list (allocated, or in flight to
//     the taker's list in a merge) before the pool unlocks for the record and the wait, and
//     becomes visible again only after the wait is queued: nothing can see it unordered.
//   - A list's event is shared by every taker. A taker that finds the list dirty clears the flag
//     and records after unlocking; until that record is made the event holds an older one, so
//     a second taker that finds a record in flight (freeList.recording) records again itself
//     rather than waiting on whatever the event holds: records on one stream only ever cover
//     more, so the later of the two covers both takers' needs.

// wait blocks until another goroutine reports progress (a growth or release ended, a list was
// unpinned, a merge ended); the pool is locked before and after.
func (p *PoolMemoryResource) wait() {
	if p.cond.L == nil {
		p.cond.L = &p.mu
	}
	p.waiters++
	p.cond.Wait()
	p.waiters--
}

// wake reports progress to the goroutines in wait (pool locked).
func (p *PoolMemoryResource) wake() {
	if p.waiters > 0 {
		p.cond.Broadcast()
	}
}

// busyWaiter is a goroutine queued for the growth/release token.
type busyWaiter struct{ granted bool }

// acquireBusy takes the growth/release token, waiting while another goroutine holds it (pool
// locked). The token goes to the waiters in the order they came: a goroutine that grows or
// releases again and again (a loop of allocations that miss, or of Release calls) cannot keep
// the others from growing.
func (p *PoolMemoryResource) acquireBusy() {
	if !p.busy {
		p.busy = true
		return
	}
	w := &busyWaiter{}
	p.busyQ = append(p.busyQ, w)
	for !w.granted {
		p.wait()
	}
}

// releaseBusy gives the token back (pool locked): to the first goroutine queued for it, if any.
func (p *PoolMemoryResource) releaseBusy() {
	if len(p.busyQ) > 0 {
		w := p.busyQ[0]
		p.busyQ[0] = nil
		p.busyQ = p.busyQ[1:]
		w.granted = true // busy stays set: the token passes to w
	} else {
		p.busy = false
	}
	p.wake()
}

// pin keeps l from being dropped while the pool is unlocked (pool locked).
func (p *PoolMemoryResource) pin(l *freeList) {
	l.pins++
	p.pinned++
}

// unpin undoes pin (pool locked).
func (p *PoolMemoryResource) unpin(l *freeList) {
	l.pins--
	p.pinned--
	if l.pins == 0 {
		p.wake()
	}
}

// quiesce waits until no growth, release, merge or take is in flight (pool locked), for a
// consistent view of every block (CheckInvariants).
func (p *PoolMemoryResource) quiesce() {
	for p.busy || p.pinned > 0 || p.merging > 0 {
		p.wait()
	}
}

// takeWait is the wait a take from list o makes after unlocking: a record of o's event on o's
// stream first when record is set, then the wait of the taking stream on it. The zero value
// (o nil) waits for nothing.
type takeWait struct {
	o      *freeList
	record bool
	frees  uint64 // o.frees at beginWait: the wait covers every free into o counted there
}

// beginWait decides, under the lock, what a stream taking blocks from o must wait for, and pins o
// (and counts the record in flight) until endWait.
func (p *PoolMemoryResource) beginWait(o *freeList) takeWait {
	if !p.ordered(o) {
		return takeWait{}
	}
	w := takeWait{o: o, record: o.claimRecord(o.recording > 0), frees: o.frees}
	if w.record {
		o.recording++
	}
	p.pin(o)
	return w
}

// doWait makes w's calls (pool unlocked): s is then ordered after every free into w.o made
// before beginWait.
func (p *PoolMemoryResource) doWait(w takeWait, s StreamView) error {
	if w.o == nil {
		return nil
	}
	return p.waitOn(w.o, w.record, s.cu())
}

// endWait ends w (pool locked). After a failed call the event's state is unknown: a lazy list is
// marked dirty again, so the next taker records.
func (p *PoolMemoryResource) endWait(w takeWait, err error) {
	if w.o == nil {
		return
	}
	if w.record {
		w.o.recording--
		if err != nil {
			w.o.unclaim()
		}
	}
	p.unpin(w.o)
}

// takeAll takes every block out of o (pool locked): they stay free but belong to no list, so no
// one finds them or coalesces with them until the caller frees them into a list.
func (p *PoolMemoryResource) takeAll(o *freeList) []*block {
	var blocks []*block
	o.each(func(b *block) { blocks = append(blocks, b) })
	for _, b := range blocks {
		o.remove(b)
	}
	return blocks
}

// relock and unlock are the pool's mutex when hold is false; with hold (Close, and frees after
// Close) the caller keeps the mutex throughout.
func (p *PoolMemoryResource) unlockUnless(hold bool) {
	if !hold {
		p.mu.Unlock()
	}
}

func (p *PoolMemoryResource) relockUnless(hold bool) {
	if !hold {
		p.mu.Lock()
	}
}
