package rmm

import (
	"errors"
	"fmt"
	"slices"
)

// Placement: where a request goes inside the memory the pool holds, whatever its backing
// (poolBacking). The search (findBlock, or findEndLast for a tailLast pool), split and coalescing
// (takeFront, split, freeInto) over the blocks' chains, the cross-stream waits and dependencies,
// and the slow path of Allocate (allocateSlow), which asks the backing to grow when nothing fits,
// and to give back what is wholly free before it fails. The free lists themselves are in
// pool_freelist.go, the per-stream caches in pool_cache.go.

// allocateSlow finds or grows a free block of n bytes for s, whose list is l, and returns it cut
// to n bytes and out of every list, with the wait to make once unlocked when it was taken from
// another stream's list, and s's list as it is now (the pool may have dropped and remade it
// while unlocked) (pool locked; it may unlock and relock).
func (p *PoolMemoryResource) allocateSlow(l *freeList, n int, s StreamView) (*block, takeWait, *freeList, error) {
	released := false
	gaveBack := 0    // bytes the release before failing gave back
	grew := false    // an expandable growth mapped memory that others' takes left too small
	holding := false // the busy token: this goroutine may grow
	done := func() {
		if holding {
			p.releaseBusy()
		}
	}
	for {
		p.pin(l)
		b, w, err := p.findBlock(l, n, s)
		if err != nil || b != nil {
			done()
			p.unpin(l)
			return b, w, l, err
		}
		if p.merging > 0 || (!holding && p.busy) {
			// A merge holding free blocks out of the lists, or a growth or release in flight (it
			// may make the room this request needs): wait for it and search again, rather than
			// grow past what is needed or fail while memory is on its way back. Growths queue
			// for the token in order; the next one searches again before it grows.
			p.unpin(l)
			if p.merging > 0 {
				p.wait()
			} else {
				p.acquireBusy()
				holding = true
			}
			if p.closed {
				done()
				return nil, takeWait{}, l, errorf("PoolMemoryResource.Allocate: called after Close: %w", ErrClosed)
			}
			if l, err = p.listFor(s); err != nil {
				done()
				return nil, takeWait{}, l, err
			}
			continue
		}
		if !holding {
			p.busy, holding = true, true
		}
		sizeBefore := p.size
		b, err = p.backing.grow(n, s, l)
		if err == nil && b == nil {
			// The expandable pool grew, but the free block the new chunk was to extend was taken
			// meanwhile: search again (and grow again if need be).
			grew = true
			p.unpin(l)
			continue
		}
		if err != nil && !released && (grew || p.releaseMayHelp(n, err)) {
			// Give back what is wholly free (other sizes may fit the upstream better) and try
			// again: a capped pool reaches its cap, a full device gets room. After a growth for
			// this request that others' takes left too small, also when nothing else could
			// help: the chunk it mapped is free, and a failed request must not leave the pool
			// larger than it found it.
			released = true
			DebugLogger().Debug("rmm: PoolMemoryResource releasing free memory before failing", "request", n, "pool_size", p.size)
			before := sizeBefore
			if _, rerr := p.releaseWhole(false); rerr != nil {
				// A chunk that could not be given back stays in the pool, whole and free; what
				// was given back still counts.
				DebugLogger().Debug("rmm: PoolMemoryResource could not give back all free memory", "request", n, "err", rerr)
			}
			if p.size < before {
				// Every free block is now in the default stream's list, with the work behind it
				// waited for: the search merges it into s's list (so that growth extends it), and
				// grows once more if it must.
				gaveBack = before - p.size
				p.unpin(l)
				continue
			}
			done()
			p.unpin(l)
			return nil, takeWait{}, l, err
		}
		if err == nil {
			p.split(b, n, l)
		}
		done()
		p.unpin(l)
		if err != nil {
			var oom *OutOfMemoryError
			if gaveBack > 0 && errors.As(err, &oom) {
				// The figures are those after the release: say so, or "pool size 0" reads as if
				// the pool had never held anything.
				oom.Detail += fmt.Sprintf(" (on a second try, after giving back %d bytes of free memory)", gaveBack)
			}
			return nil, takeWait{}, l, err
		}
		return b, takeWait{}, l, nil
	}
}

// findBlock takes a free block of at least n bytes for stream s out of the lists — own list l
// first, then other lists, then merging other lists into l (a stitching pool merges none:
// findEndLast) — and returns it cut to n bytes, its remainder left in the list it came from; nil
// when none is free. A block from another stream's
// list comes with the wait the caller must make once unlocked (s waits for that stream's event).
// Pool locked, l pinned; a merge unlocks and relocks.
func (p *PoolMemoryResource) findBlock(l *freeList, n int, s StreamView) (*block, takeWait, error) {
	if p.tailLast {
		b, w := p.findEndLast(l, n)
		return b, w, nil
	}
	if b := l.bestFit(n); b != nil {
		return p.takeFront(l, b, n), takeWait{}, nil
	}
	// Blocks in the other streams' caches are free memory: put them where this search (and the
	// merging after it) sees them.
	p.flushCaches()
	// A block that fits on its own in another stream's list: take it (the remainder after the
	// split stays in that list); s waits for that stream once the caller has unlocked.
	for _, o := range p.lists {
		if o == l {
			continue
		}
		if b := o.bestFit(n); b != nil {
			return p.takeFront(o, b, n), p.beginWait(o), nil
		}
	}
	// Merge whole lists into ours, so that neighbours from different streams coalesce. Each
	// list's blocks leave it under the lock, s waits for its stream unlocked, and they enter l
	// only then: whoever takes them from l (after l's own event) is ordered after that wait.
	for budget := 2*len(p.lists) + 2; budget > 0; budget-- {
		var o *freeList
		for _, x := range p.lists {
			if x != l && x.count > 0 {
				o = x
				break
			}
		}
		if o == nil {
			break
		}
		blocks := p.takeAll(o)
		w := p.beginWait(o)
		frees := o.frees
		var err error
		if w.o != nil {
			lazy, ev := l.lazy, l.event
			p.merging++
			p.mu.Unlock()
			err = p.doWait(w, s)
			if err == nil && !lazy && ev != 0 {
				// A stream we hold only a view of records at every free: l's event must cover
				// what s now waits for before the blocks can be seen in l (l is pinned: ev lives).
				err = p.drv.eventRecord(p.ctx, ev, s.cu())
			}
			p.mu.Lock()
			p.merging--
			p.wake()
		}
		if err != nil {
			for _, b := range blocks {
				p.freeInto(o, b)
			}
			p.endWait(w, err)
			return nil, takeWait{}, err
		}
		for _, b := range blocks {
			p.freeInto(l, b)
		}
		p.endWait(w, nil)
		if l.lazy {
			l.dirty = true // l's event must now also cover what s waited for
		}
		// o can go once nothing names it. Blocks that name it among their deps may name l
		// instead only when every free into o came before the wait: a free made while the pool
		// was unlocked (which may have coalesced into another list since) is not covered by it.
		if o.count == 0 && o.pins == 0 && p.byStream[o.stream.id] == o &&
			(o.depRefs == 0 || (o.frees == frees && !p.retargetDeps(o, l))) {
			p.dropList(o)
		}
		if b := l.bestFit(n); b != nil {
			return p.takeFront(l, b, n), takeWait{}, nil
		}
	}
	return nil, takeWait{}, nil
}

// findEndLast takes a free block of at least n bytes for the stream of l (findBlock's work in a
// tailLast pool): the best fit in l, else in another stream's list, the free block at the end of
// the chain (p.tail) only when no other block fits, in whichever list it lies. It returns the
// block cut to n bytes, or what the backing serves instead (serveAtEnd), with the wait the caller
// must make when it came from another list; nil when nothing fits. The lists are not merged: the
// pool then grows, and its backing may take memory from any list (a list other than l named among
// the deps of what it serves). A free block at the end of the chain too small for the request
// moves into l naming its list among its deps (the growth extends it, as a free block of l's,
// and whoever takes it waits for that list). Pool locked; it does not unlock.
//
// Why: the first pass of a training loop grows the pool, and a growth leaves what it mapped
// beyond the request free at the end of the chain, where the next small requests fit best. Later
// passes find every growth's memory free at the end, the largest block; the same requests then
// go to the free blocks between live ones, and placement differs from the first pass's, and so
// does the free memory a stitching backing finds: the second pass would map new ranges. Served
// last, the end of the chain is placed the same way however much it holds. The list a free block
// lies in depends on the stream that freed it and on the merges: a pass that grew would have
// merged every list into the growing stream's before each growth, a later pass that does not grow
// none, so that a request would find a block of its own list in one pass and of another in the
// next; so no list is merged.
//
// The end of the chain, taken for a request of another stream than the one whose list holds it,
// moves into that stream's list first, so that the rest stays there: a first pass grows the end
// for the stream that asks, and its rest lies in that stream's list, where the later passes,
// which find the end free and large, then leave it too. Left in the list that held the end, the
// rest would serve another stream in a later pass than in the first, and every placement after
// it would differ. BENCHMARKS.md ("Stitching in the package") gives the driver calls this saves.
func (p *PoolMemoryResource) findEndLast(l *freeList, n int) (*block, takeWait) {
	t := p.listedTail()
	if b := bestFitBut(l, n, t); b != nil {
		return p.takeOwn(l, b, n), takeWait{}
	}
	// Blocks in the other streams' caches are free memory: put them where this search sees them.
	// The end of the chain may be one of them: read it again, listed now, so that the other
	// lists' best fits skip it as well.
	p.flushCaches()
	t = p.listedTail()
	for _, o := range p.lists {
		if o == l {
			continue
		}
		if b := bestFitBut(o, n, t); b != nil {
			return p.takeOther(l, o, b, n)
		}
	}
	if t == nil {
		return nil, takeWait{}
	}
	fits := t.size >= n
	o := t.list
	if o == l {
		if !fits {
			return nil, takeWait{}
		}
		return p.takeOwn(l, t, n), takeWait{}
	}
	if fits {
		if sb := p.backing.serveAtEnd(n, l, t); sb != nil {
			return sb, takeWait{}
		}
	}
	// The end moves into l naming o, as a free into l would (freeInto coalesces it with l's
	// neighbours, and drops l from its deps: l's takers are ordered after l's frees). What a
	// request leaves of it then stays in l, where a growth for l would have left it (see
	// above); whoever takes it waits for o (its deps), this request
	// included. Too small, it is what the growth extends, unless it coalesced in l with a free
	// neighbour into a block that holds the request (the growth would then find nothing to
	// map for it).
	o.remove(t)
	p.addDep(t, o)
	t = p.freeInto(l, t)
	if t.size < n {
		return nil, takeWait{}
	}
	return p.takeFront(l, t, n), takeWait{}
}

// listedTail returns the free block at the end of the chain while it lies in a list; nil when
// the end is live, or out of the lists (in a cache, or while the pool is unlocked).
func (p *PoolMemoryResource) listedTail() *block {
	if t := p.tail; t != nil && t.free && t.list != nil {
		return t
	}
	return nil
}

// takeOther takes n bytes of b, a free block of another stream's list o, for l's stream: what
// the backing serves instead when b is the end of the chain (serveAtEnd; the lists it takes from
// are among the deps of what it serves), else b cut to n bytes with the wait for o the caller
// makes once unlocked.
func (p *PoolMemoryResource) takeOther(l, o *freeList, b *block, n int) (*block, takeWait) {
	if sb := p.backing.serveAtEnd(n, l, b); sb != nil {
		return sb, takeWait{}
	}
	return p.takeFront(o, b, n), p.beginWait(o)
}

// bestFitBut returns o's best fit for n bytes other than the block x (nil: none).
func bestFitBut(o *freeList, n int, x *block) *block {
	b := o.bestFit(n)
	if b == nil || b != x {
		return b
	}
	if o.count == 1 {
		return nil // x is o's only block (the common case: a stream whose free memory is the end)
	}
	o.remove(x)
	b = o.bestFit(n)
	o.insert(x)
	return b
}

// takeOwn takes a block of n bytes for l's stream out of l, whose block b serves it: when b is
// the free block at the end of the chain, what the backing serves there instead (serveAtEnd), if
// anything. Pool locked; it does not unlock.
func (p *PoolMemoryResource) takeOwn(l *freeList, b *block, n int) *block {
	if sb := p.backing.serveAtEnd(n, l, b); sb != nil {
		return sb
	}
	return p.takeFront(l, b, n)
}

// releaseMayHelp reports whether, after growing for an n-byte request failed with err, giving
// wholly free memory back could let a second growth succeed: the pool holds free memory (blocks in
// the streams' caches included), the request fits under the maximum (if any), and either the
// upstream (or the device) refused for want of memory — capped or not: the upstream may then have
// room for one block where it had none beside the free ones; another failure is not helped by
// giving back —, or the maximum stopped a plain pool (whose free upstream blocks count against
// it), or an expandable pool has holes: growth fills a hole only together with the free blocks
// right next to it, and the free chunks given back between two holes (or between a hole and the
// end) merge them into one. An expandable pool without holes stopped by its maximum gains
// nothing: a chunk given back leaves a hole exactly where its free memory already was.
func (p *PoolMemoryResource) releaseMayHelp(n int, err error) bool {
	var oom *OutOfMemoryError
	if !errors.As(err, &oom) || (p.maximum > 0 && n > p.maximum) {
		return false
	}
	if free, _ := p.freeFigures(); free == 0 {
		return false
	}
	if oom.Cause != nil {
		// The upstream refused: only when for want of memory, which giving back may make.
		return errors.Is(oom.Cause, ErrOutOfMemory)
	}
	if p.maximum == 0 {
		return false // nothing stopped it but the upstream, which did not refuse (overflow)
	}
	return p.backing.releaseMayHelp()
}

// split keeps the first n bytes of the free block b (out of every list) and puts the rest, as a
// new free block after it, into list home.
func (p *PoolMemoryResource) split(b *block, n int, home *freeList) {
	if b.size == n {
		return
	}
	r := p.newBlock(b.addr+DevicePtr(n), b.size-n)
	b.size = n
	p.linkAfter(b, r)
	p.copyDeps(r, b)
	p.dropDep(r, home)
	home.insert(r)
}

// takeFront takes the first n bytes of b, a free block of list l of at least n bytes, and returns
// them as a block out of every list, with b's deps; the rest stays free in l (pool locked).
func (p *PoolMemoryResource) takeFront(l *freeList, b *block, n int) *block {
	if b.size > n && l.resize(b, b.size-n) {
		// The rest keeps b's node in l, alone in its class's treap (see resize), so that no
		// treap removal and insertion is made: the n bytes become a new block before b. A loop
		// that allocates and frees one size from a large free block (W1 once its block
		// coalesced with its neighbours) then costs no treap operation either way (see
		// freeInto).
		a := p.newBlock(b.addr, n)
		p.copyDeps(a, b)
		p.linkBefore(a, b)
		b.addr += DevicePtr(n)
		return a
	}
	l.remove(b)
	p.split(b, n, l)
	return b
}

// linkBefore puts a into b's chain right before b (a's memory is what precedes b's). At the head of
// an expandable pool's chain, a becomes its head.
func (p *PoolMemoryResource) linkBefore(a, b *block) {
	a.prev, a.next = b.prev, b
	if b.prev != nil {
		b.prev.next = a
	} else if p.chained && p.head == b {
		p.head = a
	}
	b.prev = a
}

// linkAfter puts r into b's chain right after b (r's memory is the end of what b had). At the end
// of an expandable pool's chain, r becomes its tail.
func (p *PoolMemoryResource) linkAfter(b, r *block) {
	r.prev, r.next = b, b.next
	if b.next != nil {
		b.next.prev = r
	} else if p.chained {
		p.tail = r
	}
	b.next = r
}

// absorbNext merges b's next neighbour into b and returns it, unlinked, for the caller to recycle.
func (p *PoolMemoryResource) absorbNext(b *block) *block {
	nx := b.next
	b.size += nx.size
	b.next = nx.next
	if nx.next != nil {
		nx.next.prev = b
	} else if p.chained {
		p.tail = b
	}
	return nx
}

// freeInto makes b free in list l, coalescing it with its address neighbours that are free in
// l (neighbours are never in another upstream allocation). It returns the resulting block.
//
// A neighbour free in another stream's list coalesces too when the two hold at least
// poolCrossCoalesceMin bytes: the merged block lands in l and names that list among its deps,
// which its taker waits for (pool_placement.go). Blocks free but in no list (in flight between lists,
// or held out while the pool is unlocked) are left alone.
func (p *PoolMemoryResource) freeInto(l *freeList, b *block) *block {
	b.free, b.slack = true, 0
	l.frees++
	noDeps := len(b.deps()) == 0
	if !noDeps {
		p.forgetDropped(b)
		noDeps = len(b.deps()) == 0
	}
	// The next neighbour free in l, alone in its class's treap, with no other neighbour to
	// coalesce with: it takes b's bytes with no treap's descent (see resize and takeFront). The
	// neighbours are checked against the merged size, as the loop below checks them after a
	// merge; nx's next needs no check when nx alone reaches poolCrossCoalesceMin (had it joined
	// nx, it would have then).
	if nx := b.next; noDeps && nx != nil && nx.free && nx.list == l &&
		!joins(b.prev, l, nx.size+b.size) && (nx.size >= poolCrossCoalesceMin || !joins(nx.next, l, nx.size+b.size)) &&
		l.resize(nx, nx.size+b.size) {
		nx.addr = b.addr
		nx.prev = b.prev
		if b.prev != nil {
			b.prev.next = nx
		} else if p.chained && p.head == b {
			p.head = nx
		}
		p.recycle(b)
		return nx
	}
	// Both sides again after each merge: a neighbour too small to coalesce across streams with
	// b alone may coalesce with what b has become.
	for merged := true; merged; {
		merged = false
		if pr := b.prev; joins(pr, l, b.size) {
			p.addDep(pr, unlist(pr, l))
			p.mergeDeps(pr, b)
			p.recycle(p.absorbNext(pr))
			b, merged = pr, true
		}
		if nx := b.next; joins(nx, l, b.size) {
			p.addDep(b, unlist(nx, l))
			p.mergeDeps(b, nx)
			p.recycle(p.absorbNext(b))
			merged = true
		}
	}
	p.dropDep(b, l)
	l.insert(b)
	return b
}

func (p *PoolMemoryResource) newBlock(ptr DevicePtr, n int) *block {
	var b *block
	if k := len(p.spare); k > 0 {
		b = p.spare[k-1] // zeroed by recycle
		p.spare = p.spare[:k-1]
	} else {
		b = new(block)
	}
	b.addr, b.size, b.free = ptr, n, true
	return b
}

func (p *PoolMemoryResource) recycle(b *block) {
	p.clearDeps(b)
	*b = block{}
	p.spare = append(p.spare, b)
}

// mergeInto moves every block of o into l, coalescing.
func (p *PoolMemoryResource) mergeInto(l, o *freeList) {
	// All out of o first: a block freed into l may coalesce with neighbours in other lists, and
	// must not take one of o's blocks that this loop has still to move.
	for _, b := range p.takeAll(o) {
		p.freeInto(l, b)
	}
}

// newFreeList makes the list of a stream, the pool holding n lists.
func newFreeList(n int) *freeList {
	l := &freeList{rng: uint32(n)*2654435761 + 1}
	if l.rng == 0 {
		l.rng = 1
	}
	return l
}

// syncAll waits (on the host) for the work behind every list's frees (pool locked, busy token
// held). Without hold the records and synchronisations are made unlocked; frees made meanwhile
// are not covered by them, so it tries again (the last try locked) until no list changed.
func (p *PoolMemoryResource) syncAll(hold bool) error {
	if p.ctx == 0 {
		return nil
	}
	type snap struct {
		l      *freeList
		record bool
		frees  uint64
	}
	for try := 0; ; try++ {
		locked := hold || try == poolSyncTries-1
		var snaps []snap
		for _, l := range p.lists {
			if l.event == 0 {
				continue
			}
			x := snap{l: l, frees: l.frees, record: l.claimRecord(l.recording > 0)}
			if x.record {
				l.recording++
			}
			p.pin(l)
			snaps = append(snaps, x)
		}
		p.unlockUnless(locked)
		var err error
		for _, x := range snaps {
			if err = p.hostWait(x.l, x.record); err != nil {
				break
			}
		}
		p.relockUnless(locked)
		for _, x := range snaps {
			if x.record {
				x.l.recording--
				if err != nil {
					x.l.unclaim()
				}
			}
			p.unpin(x.l)
		}
		if err != nil || locked {
			return err
		}
		changed := false
		for _, l := range p.lists {
			i := slices.IndexFunc(snaps, func(x snap) bool { return x.l == l })
			if (i < 0 && l.count > 0) || (i >= 0 && snaps[i].frees != l.frees) {
				changed = true
				break
			}
		}
		if !changed {
			return nil
		}
	}
}

// mergeAllSynced waits for the work behind every free and merges every list into the default
// stream's, which it returns (pool locked, busy token held; see syncAll for hold).
func (p *PoolMemoryResource) mergeAllSynced(hold bool) (*freeList, error) {
	p.flushCaches()
	if err := p.syncAll(hold); err != nil {
		return nil, errorf("PoolMemoryResource: waiting for the streams: %w", err)
	}
	p.clearAllDeps() // every stream's work behind the frees is done
	def, err := p.listFor(DefaultStream)
	if err != nil {
		return nil, err
	}
	for _, o := range append([]*freeList(nil), p.lists...) {
		if o != def {
			p.mergeInto(def, o)
			if o.pins == 0 {
				// Every free was waited for: a block in flight that still names o may forget it.
				p.retargetDeps(o, def)
				p.dropList(o)
			}
		}
	}
	return def, nil
}

// releaseWhole synchronises, merges every list into the default stream's list and returns the
// wholly free upstream blocks (expandable: chunks); it returns that list. Pool locked, busy token
// held; without hold the upstream's frees are made unlocked, the blocks out of every list
// meanwhile (still counted in the pool's size: nothing grows until the token is released).
func (p *PoolMemoryResource) releaseWhole(hold bool) (*freeList, error) {
	def, err := p.mergeAllSynced(hold)
	if err != nil {
		return nil, err
	}
	return def, p.backing.release(def, hold)
}

// oomErr is the *OutOfMemoryError for an n-byte (rounded) request (Allocate puts the size asked
// for in Requested); refused: the upstream (or
// the device) refused memory, so there is no headroom whatever the maximum says.
func (p *PoolMemoryResource) oomErr(n int, detail string, cause error, refused bool) error {
	free, largest := p.freeFigures()
	e := OutOfMemoryError{
		Resource:         "PoolMemoryResource",
		Requested:        n,
		PoolSize:         p.size,
		FreeBytes:        free,
		LargestFreeBlock: largest,
		MaximumSize:      p.maximum,
		Detail:           detail,
		Cause:            cause,
	}
	e.Resource = p.name
	if !refused && p.maximum > 0 {
		e.Headroom = p.maximum - p.size
	}
	return newOutOfMemory(e, n)
}

// maxDetail is the Detail of an out-of-memory error when the maximum stopped a growth of need
// bytes for an n-byte request with left bytes under the maximum.
func maxDetail(n, need, left, maximum int) string {
	switch {
	case n > maximum:
		return "the request exceeds the maximum pool size"
	case left <= 0:
		return "maximum pool size reached"
	}
	return fmt.Sprintf("growing by the %d bytes it needs would pass the maximum pool size (%d bytes left under it)", need, left)
}

// freeFigures returns the free bytes and the largest free block, blocks in the streams' caches
// included (as Stats counts them; liveBytes counts cached blocks as live). Pool locked.
func (p *PoolMemoryResource) freeFigures() (free, largest int) {
	free, largest = p.size-p.liveBytes, p.largestFree()
	for _, c := range p.cachedByStream() {
		free += c.bytes
		largest = max(largest, c.largest)
	}
	return free, largest
}

// largestFree is the largest free block over all lists. O(s log n).
func (p *PoolMemoryResource) largestFree() int {
	m := 0
	for _, l := range p.lists {
		if b := l.largest(); b != nil && b.size > m {
			m = b.size
		}
	}
	return m
}

// poolSyncTries bounds the unlocked synchronisations of Release: when every try saw frees made
// meanwhile, the last one keeps the lock.
const poolSyncTries = 3

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

// Coalescing across streams.
//
// A block freed on one stream and a free neighbour in another stream's list coalesce at once
// (freeInto), into the list of the stream that freed last. The neighbour's memory is then in a
// list whose event does not cover the frees made on the neighbour's stream, so the merged block
// remembers that stream's list (block.deps): whoever takes the block, even on the stream of the
// list it sits in, first waits on the events of its deps (Allocate, the same record-and-wait as a
// take from another stream's list), and only then uses the memory. A remainder split off keeps
// the deps (the part it holds may or may not come from them: waiting for more than needed is
// safe). A record of a list's event covers every earlier free on its stream, so waiting on a
// later record than the one current at the coalesce is correct too.
//
// Only pieces that make at least poolCrossCoalesceMin bytes together coalesce across streams:
// smaller blocks are what a stream's own list and cache serve at once, and taking a neighbour's
// small block out of its stream's list sends that stream down the slow path, to take memory from
// another list with a wait: with many goroutines each on its own stream (W3), coalescing at any
// size did that many times a second and cut the throughput several-fold; with the minimum it is
// rare.
//
// Why coalesce at all: without it, memory freed on different streams stays cut at every boundary between them
// until the pool, having no block that fits, merges every list into one; by then best fit has
// split the small pieces, and the pool grows. On the multi-stream traces this took the
// expandable pool's footprint well down, for one record and wait per take of such a block
// (BENCHMARKS.md, the section on coalescing across streams).
//
// A list named in deps is counted (freeList.depRefs). When a list is merged into another one
// whose stream waited for it, the listed blocks naming it name the other list instead
// (retargetDeps); a merge drops it only when no block in flight still names it. After a host
// synchronisation of every stream (Release, the trim, giving back before failing) no dep is
// needed: all are cleared, and a block in flight that names a list dropped then (or by a Stream's
// Close, which waits for the stream on the host in that case) forgets it when it is freed into a
// list again (forgetDropped).

// addDep records that a taker of the free block b must also wait for list o (unless b is in o).
func (p *PoolMemoryResource) addDep(b *block, o *freeList) {
	if p.ctx == 0 || o == nil || slices.Contains(b.deps(), o) {
		// Without CUDA nothing is ordered on a stream: no wait is ever needed.
		return
	}
	r := b.rareFields()
	r.deps = append(r.deps, o)
	o.depRefs++
}

// dropDep removes o from b's deps (b now lies in o: o's own takers need no wait for it).
func (p *PoolMemoryResource) dropDep(b *block, o *freeList) {
	if i := slices.Index(b.deps(), o); i >= 0 {
		r := b.rare
		r.deps = slices.Delete(r.deps, i, i+1)
		o.depRefs--
		if len(r.deps) == 0 {
			r.deps = nil
			b.tidyRare()
		}
	}
}

// clearDeps forgets every dep of b.
func (p *PoolMemoryResource) clearDeps(b *block) {
	r := b.rare
	if r == nil {
		return
	}
	for _, o := range r.deps {
		o.depRefs--
	}
	r.deps = nil
	b.tidyRare()
}

// mergeDeps gives dst the deps of src and clears src's (src is about to be absorbed by dst).
func (p *PoolMemoryResource) mergeDeps(dst, src *block) {
	for _, o := range src.deps() {
		p.addDep(dst, o)
	}
	p.clearDeps(src)
}

// copyDeps gives dst (a remainder split off src) src's deps as well.
func (p *PoolMemoryResource) copyDeps(dst, src *block) {
	for _, o := range src.deps() {
		p.addDep(dst, o)
	}
}

// retargetDeps makes every listed block that names o name to instead (o was merged into to, whose
// stream waited for o's event; to's later records cover o's frees). It returns whether o is still
// named (by a block out of every list, in flight): o must not be dropped then.
//
// A renamed block counts as a free into to (to.frees): a wait on to that began before (whose
// record may not cover o's frees) must not be taken, by coveredDeps, to cover the new names.
func (p *PoolMemoryResource) retargetDeps(o, to *freeList) bool {
	if o.depRefs == 0 {
		return false
	}
	renamed := false
	for _, l := range p.lists {
		l.each(func(b *block) {
			if slices.Contains(b.deps(), o) {
				p.dropDep(b, o)
				if l != to {
					p.addDep(b, to)
					renamed = true
				}
			}
		})
	}
	if renamed {
		to.frees++
		if to.lazy {
			to.dirty = true
		}
	}
	return o.depRefs > 0
}

// clearAllDeps forgets the deps of every listed block: the caller waited on the host for the work
// behind every free.
func (p *PoolMemoryResource) clearAllDeps() {
	named := false
	for _, l := range p.lists {
		named = named || l.depRefs > 0
	}
	if !named {
		return
	}
	for _, l := range p.lists {
		l.each(p.clearDeps)
	}
}

// beginDepWaits decides, under the lock, the waits a stream s whose list is l must make before it
// uses the block b just taken (out of every list) from list from (l, or another list whose own
// wait w covers from): one per dep of b other than l and from. It pins their lists (beginWait)
// and clears b's deps, returning them for a restore (restoreDeps) should a wait fail. The caller
// keeps l and from pinned as well until the waits end: b's names are not counted in depRefs
// meanwhile, and a list dropped then (a merge into another stream's list drops one no block
// names) would be forgotten by the restore with nothing having ordered its frees.
func (p *PoolMemoryResource) beginDepWaits(b *block, l, from *freeList) (waits []takeWait, deps []*freeList) {
	if len(b.deps()) == 0 {
		return nil, nil
	}
	deps = slices.Clone(b.deps())
	for _, o := range b.deps() {
		if o == l || o == from {
			continue
		}
		if w := p.beginWait(o); w.o != nil {
			waits = append(waits, w)
		}
	}
	p.clearDeps(b)
	return waits, deps
}

// restoreDeps gives b back the deps that are still lists of the pool (after a failed wait).
func (p *PoolMemoryResource) restoreDeps(b *block, deps []*freeList) {
	for _, o := range deps {
		if p.byStream[o.stream.id] == o {
			p.addDep(b, o)
		}
	}
}

// forgetDropped removes from b's deps the lists the pool dropped (their streams' work behind the
// frees was waited for before).
func (p *PoolMemoryResource) forgetDropped(b *block) {
	for i := 0; i < len(b.deps()); {
		if o := b.deps()[i]; o.dropped {
			p.dropDep(b, o)
			continue
		}
		i++
	}
}

// coveredDeps is called after l's stream (whose list l is lazy) waited on w: when no free into
// w's list came after the wait began, the blocks in l no longer need to name it. Without this, a
// block's deps would pass to every remainder split off it, and each take of one would wait again.
// l is marked dirty: a taker from another stream must wait on a record made after this wait.
//
// A block that forgets o counts as a free into l (l.frees), as a renamed one does in
// retargetDeps: its memory is now covered only by l's records after this wait, so a wait on l
// that began before (another stream's, whose record may not hold this one) must not be taken,
// by its own coveredDeps, to cover the blocks that name l (a block in l split, its remainder
// coalesced into that stream's list, naming l).
func (p *PoolMemoryResource) coveredDeps(l *freeList, w takeWait) {
	o := w.o
	if o == nil || o == l || o.depRefs == 0 || o.frees != w.frees {
		return
	}
	dropped := false
	l.each(func(b *block) {
		if slices.Contains(b.deps(), o) {
			p.dropDep(b, o)
			dropped = true
		}
	})
	if dropped {
		l.frees++
	}
	l.dirty = true
}

// poolCrossCoalesceMin is the least two free neighbours in different streams' lists must hold
// together to coalesce (bytes).
const poolCrossCoalesceMin = 1 << 20

// joins reports whether nb, a neighbour of a block of size bytes going into list l, coalesces
// with it: nb is free and listed, in l, or in another list and the two hold enough bytes.
func joins(nb *block, l *freeList, size int) bool {
	return nb != nil && nb.free && nb.list != nil &&
		(nb.list == l || nb.size+size >= poolCrossCoalesceMin)
}

// unlist takes nb, about to coalesce with a block going into l, out of its list, and returns that
// list when it is not l (the merged block must name it among its deps), else nil.
func unlist(nb *block, l *freeList) *freeList {
	o := nb.list
	o.remove(nb)
	if o == l {
		return nil
	}
	return o
}

// adjacentUncoalesced reports whether the neighbours a and b (a before b) should have coalesced
// (CheckInvariants): both free and listed, and b joins a block of a's size going into a's list.
func adjacentUncoalesced(a, b *block) bool {
	return a.free && a.list != nil && joins(b, a.list, a.size)
}
