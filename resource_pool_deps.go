package rmm

import "slices"

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
