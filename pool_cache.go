package rmm

import (
	"errors"
	"slices"
	"sync"
	"sync/atomic"
)

// Per-stream caches: the pool's fast path.
//
// A pool has one mutex, and goroutines that allocate and free on their own streams all take it.
// Under contention (16 goroutines on 16 cores, each with its own stream) the mutex, not the
// pool's work, bounds the throughput. So each stream whose lifetime the package knows (the
// default stream and our own Streams) gets a small cache of blocks it freed, under a lock of its
// own:
//
//   - A free on stream s of a block of at most poolCacheMaxBlock bytes, of the size of one of the
//     last poolCacheRecent allocations on s that went down the slow path (so a size the stream
//     asks for again and again), puts the block into s's cache instead of s's free list. The block stays out of the free lists (it is not free in the
//     chain, so no neighbour coalesces with it) and counts as held in the pool's live bytes.
//   - An allocation on s of exactly a cached block's (rounded) size takes it back under s's lock
//     alone, and the block is recorded in the cache's own table of blocks it handed out, so that
//     its free on s is found there, again under s's lock alone.
//   - Everything else takes the pool's mutex as before. An allocation on s that its cache cannot
//     serve first gives s's cached blocks back to s's free list, so best fit (and coalescing) see
//     them: only an exact-size reuse on the same stream skips them. The slow path looks a pointer up in the
//     pool's live table and, when it is not there, in the caches' tables: a block handed out by
//     one stream's cache may be freed on another stream, or twice.
//   - Before the pool searches other streams' lists (so before it grows or fails), and in Release
//     and the release threshold's trim, every cache gives its blocks back to its stream's free
//     list, where they coalesce. So no request fails and no growth happens that the cached memory
//     could have served. A stream's Close and the pool's Close also end the caches: the blocks
//     they handed out go to the pool's live table, and a new cache is made at the next free. Stats and
//     out-of-memory errors count cached blocks as free.
//   - An expandable pool with a ReleaseThreshold has no caches: memory held in a cache would
//     escape the trim that each free checks for.
//
// Memory in a cache is reused only by its own stream, so no event is needed (as for a stream's
// own free list). Streams made from foreign handles (NewStreamView) have no cache: their frees
// record an event each, under the pool's mutex.
//
// Blocks above poolCacheMaxBlock are not cached, though a large pair would skip the mutex too: a
// cached block is out of the free lists until its stream's next miss, so it neither coalesces
// with its neighbours nor serves best fit for other sizes, and for large blocks that changes
// placement enough to raise the expandable and stitching pools' footprints on the bundled traces
// (go test -run TestPoolGolden -rmm.golden and -run TestFirstPass -rmm.firstpass show it). Small
// blocks are many and alike, so holding a few out of the lists costs no footprint.
const (
	poolCacheSlots    = 16
	poolCacheMaxBlock = 1 << 20 // bytes
	poolCacheRecent   = 4
)

// poolCache is one stream's cache. Lock order: the pool's mutex, then a cache's.
//
// Laid out for the cache lines of a many-core host: cacheOf reads stream of every cache it passes
// on every fast path, while the fields after it are written at every allocation and free on the
// cache's own stream. The pads keep stream on a line that is never written after the cache is
// made, and the written fields off the lines of the objects allocated next to the cache (caches
// are made one after another, often by one goroutine).
type poolCache struct {
	stream StreamView // the stream whose frees the cache holds; never changes
	_      [64]byte
	mu     sync.Mutex
	dead   bool
	// busy is whether the cache holds blocks or has blocks handed out; written under mu only when
	// it changes, read without mu by the fast paths to skip an idle cache.
	busy   atomic.Bool
	n      int // slots in use
	next   int // the slot replaced when all are in use
	slots  [poolCacheSlots]*block
	issued blockTable // blocks taken from the slots and not freed yet
	// profLeft is the bytes still to allocate from the cache before the next sample of the
	// pool's MemoryProfile (see MemoryProfile.take).
	profLeft int
	_        [64]byte
}

// note updates c.busy (c locked).
func (c *poolCache) note() {
	if v := c.n > 0 || c.issued.len() > 0; c.busy.Load() != v {
		c.busy.Store(v)
	}
}

// noteAllocation records n, the size of an allocation on l's stream that its cache did not
// serve (pool locked).
func (l *freeList) noteAllocation(n int) {
	if l.asksFor(n) {
		return
	}
	l.recent[l.recentNext] = n
	l.recentNext = (l.recentNext + 1) % poolCacheRecent
}

// asksFor reports whether n is among the recent sizes of noteAllocation.
func (l *freeList) asksFor(n int) bool { return slices.Contains(l.recent[:], n) }

func (p *PoolMemoryResource) cacheOf(s StreamView) *poolCache {
	m := p.caches.Load()
	if m == nil {
		return nil
	}
	if len(m.ids) > streamSetScan {
		c, _ := m.lookup(s.id)
		return c
	}
	// streamSet.find's scan, spelt out: its generic body is not inlined, and this is on every
	// allocation and free.
	for i, x := range m.ids {
		if x >= s.id {
			if x == s.id {
				return m.vals[i]
			}
			break
		}
	}
	return nil
}

// allocateCached takes a block of exactly n bytes (rounded) from s's cache, for a request of
// nbytes; 0 when the cache has none.
//
// A cached block keeps the size last asked for it (req), which the free on the fast path leaves
// alone: a loop that asks the same size again writes nothing to the block (blocks are small
// objects that lie next to other streams' blocks, so a write to one would take the cache line
// from the cores using its neighbours).
func (p *PoolMemoryResource) allocateCached(n, nbytes int, s StreamView) (DevicePtr, *block) {
	c := p.cacheOf(s)
	if c == nil || !c.busy.Load() {
		return 0, nil
	}
	c.mu.Lock()
	if c.dead {
		c.mu.Unlock()
		return 0, nil
	}
	for i := 0; i < c.n; i++ {
		if b := c.slots[i]; b.size == n {
			c.n--
			c.slots[i] = c.slots[c.n]
			c.slots[c.n] = nil
			if b.req() != nbytes {
				b.setReq(nbytes)
			}
			c.issued.put(b)
			var sampled *block
			if p.prof.take(&c.profLeft, nbytes) { // the cache's own count, under its lock
				sampled = b
			}
			c.mu.Unlock()
			return b.addr, sampled
		}
	}
	c.mu.Unlock()
	return 0, nil
}

// deallocateCached frees ptr on s when s's cache handed it out and has a slot for it. It reports
// whether it did; a size other than the one allocated is an error (and changes nothing).
func (p *PoolMemoryResource) deallocateCached(ptr DevicePtr, nbytes int, s StreamView) (bool, error) {
	c := p.cacheOf(s)
	if c == nil || !c.busy.Load() {
		return false, nil
	}
	c.mu.Lock()
	if c.dead || c.n == poolCacheSlots {
		c.mu.Unlock()
		return false, nil
	}
	i, b := c.issued.at(ptr)
	if b == nil {
		c.mu.Unlock()
		return false, nil
	}
	if b.req() != nbytes {
		req := b.req()
		c.mu.Unlock()
		return false, errorf("PoolMemoryResource.Deallocate(%#x, %d): the block was allocated with %s: %w", uintptr(ptr), nbytes, bytesText(req), ErrInvalidFree)
	}
	if p.prof != nil { // only the pool's own profile samples its blocks
		b.dropSample()
	}
	c.issued.delAt(i)
	c.slots[c.n] = b // the asked size stays: see allocateCached
	c.n++
	c.mu.Unlock()
	return true, nil
}

// takeIssued finds ptr among the blocks the caches handed out and, when found and asked for with
// nbytes, makes it a block of the pool's live table again (pool locked); a block asked for with
// another size is returned where it is, for the caller's error. It returns nil when no cache
// handed ptr out.
func (p *PoolMemoryResource) takeIssued(ptr DevicePtr, nbytes int) *block {
	m := p.caches.Load()
	if m == nil {
		return nil
	}
	for _, c := range m.all() {
		c.mu.Lock()
		b := c.issued.get(ptr)
		if b != nil && b.req() == nbytes {
			c.issued.del(ptr)
			c.note()
			p.live.put(b)
		}
		c.mu.Unlock()
		if b != nil {
			return b
		}
	}
	return nil
}

// cacheFree puts the block b, just freed on s (whose list is l), into s's cache, making the cache
// when s has none; the block the cache drops to make room goes to l. It reports false, changing
// nothing, when b is not for a cache. Pool locked; b is out of the live table, still counted in
// liveBytes.
func (p *PoolMemoryResource) cacheFree(l *freeList, b *block, s StreamView) bool {
	if !l.lazy || b.size > poolCacheMaxBlock || p.closed || !l.asksFor(b.size) ||
		p.trimAt > 0 {
		return false
	}
	c := p.cacheOf(s)
	if c == nil {
		c = &poolCache{stream: l.stream, profLeft: p.prof.nextSample()}
		old := p.caches.Load()
		m := old.with(s.id, c)
		if m == old {
			return false // streamSetMax streams have caches already
		}
		p.caches.Store(m)
	}
	c.mu.Lock()
	if c.n < poolCacheSlots {
		c.slots[c.n] = b
		c.n++
		c.note()
		c.mu.Unlock()
		return true
	}
	old := c.slots[c.next]
	c.slots[c.next] = b
	c.next = (c.next + 1) % poolCacheSlots
	c.mu.Unlock()
	p.liveBytes -= old.size
	p.freeInto(l, old)
	return true
}

// flushCache gives the blocks in s's cache back to s's list l (pool locked), where they
// coalesce, so that a best-fit search of l sees them. The cache stays.
func (p *PoolMemoryResource) flushCache(l *freeList, s StreamView) {
	if c := p.cacheOf(s); c != nil && c.busy.Load() {
		p.returnCached(c, l, false)
	}
}

// flushCaches gives every cache's blocks back to its stream's list (pool locked); the caches
// stay, with the blocks they handed out.
func (p *PoolMemoryResource) flushCaches() {
	if m := p.caches.Load(); m != nil {
		for _, c := range m.all() {
			if c.busy.Load() {
				p.returnCached(c, nil, false)
			}
		}
	}
}

// dropCaches empties every cache (pool locked): cached blocks go to their streams' free lists,
// coalescing, and blocks the caches handed out go to the live table. The caches die (one whose
// blocks found no list stays, holding them).
func (p *PoolMemoryResource) dropCaches() {
	m := p.caches.Load()
	if m == nil {
		return
	}
	var keep *streamSet[*poolCache]
	for _, c := range m.all() {
		if !p.returnCached(c, nil, true) {
			keep = keep.with(c.stream.id, c)
		}
	}
	p.caches.Store(keep)
}

// returnCached gives c's cached blocks back to l, or when l is nil to the list of c's stream
// (pool locked); with kill it also moves the blocks c handed out to the live table and marks c
// dead, for the caller to unpublish. The list's event must then cover the frees behind the
// blocks (dirty). It reports false, changing nothing, when no list can be had for the blocks.
func (p *PoolMemoryResource) returnCached(c *poolCache, l *freeList, kill bool) bool {
	if l == nil && c.busy.Load() {
		// The stream's list may have been merged into another stream's and dropped since: make
		// it again. If that fails, wait for the stream on the host; then the blocks may go to
		// the default stream's list.
		var err error
		if l, err = p.listFor(c.stream); err != nil {
			DebugLogger().Warn("rmm: PoolMemoryResource: no free list for a stream's cached blocks; synchronising it", "stream", c.stream.String(), "err", err)
			// (Under the lock: this path follows a failure to make a list, rarely if ever taken;
			// the blocks must not be seen in the default stream's list before the wait.)
			// A Stream that was closed has no handle any more (no call may name it), and its
			// Close may not have waited for its work yet (Close synchronises after its hooks):
			// wait for the device.
			if p.ctx != 0 {
				if errors.Is(err, ErrClosed) {
					p.drv.ctxSynchronize(p.ctx)
				} else if serr := p.drv.streamSynchronize(p.ctx, c.stream.cu()); serr != nil {
					p.drv.ctxSynchronize(p.ctx)
				}
			}
			if l, err = p.listFor(DefaultStream); err != nil {
				DebugLogger().Error("rmm: PoolMemoryResource: no free list for a stream's cached blocks; they stay cached", "stream", c.stream.String(), "err", err)
				return false
			}
		}
	}
	c.mu.Lock()
	slots, k := c.slots, c.n
	c.n, c.next, c.slots = 0, 0, [poolCacheSlots]*block{}
	if kill {
		c.dead = true
		c.issued.each(func(b *block) { p.live.put(b) })
		c.issued = blockTable{}
	}
	c.note()
	c.mu.Unlock()
	for _, b := range slots[:k] {
		p.liveBytes -= b.size
		p.freeInto(l, b)
	}
	if k > 0 {
		l.dirty = true
	}
	return true
}

// poolCacheFigures is what one stream's cache holds, for Stats.
type poolCacheFigures struct {
	stream                         StreamView
	blocks, bytes, largest, issued int
}

// cachedByStream returns each cache's figures by stream id (pool locked).
func (p *PoolMemoryResource) cachedByStream() map[uint64]poolCacheFigures {
	m := p.caches.Load()
	if m == nil {
		return nil
	}
	out := make(map[uint64]poolCacheFigures, len(m.all()))
	for _, c := range m.all() {
		c.mu.Lock()
		f := poolCacheFigures{stream: c.stream, blocks: c.n, issued: c.issued.len()}
		for _, b := range c.slots[:c.n] {
			f.bytes += b.size
			f.largest = max(f.largest, b.size)
		}
		c.mu.Unlock()
		out[c.stream.id] = f
	}
	return out
}

// cachesWithoutList returns the figures of the caches holding blocks whose stream has no free
// list (pool locked), in the order of their streams' ids.
func (p *PoolMemoryResource) cachesWithoutList(cached map[uint64]poolCacheFigures) []poolCacheFigures {
	var out []poolCacheFigures
	if m := p.caches.Load(); m != nil {
		for _, c := range m.all() {
			if f := cached[c.stream.id]; f.blocks > 0 && p.byStream[c.stream.id] == nil {
				out = append(out, f)
			}
		}
	}
	return out
}

// checkCaches verifies the caches for CheckInvariants (pool locked): every cached block is
// allocated in the chain, out of the lists and the live table, of at most poolCacheMaxBlock
// bytes; every block a cache handed out is in no other table. It adds both kinds to all, and
// returns the bytes they hold.
func (p *PoolMemoryResource) checkCaches(all map[DevicePtr]*block) (int, error) {
	m := p.caches.Load()
	if m == nil {
		return 0, nil
	}
	held := 0
	for _, c := range m.all() {
		id := c.stream.id
		c.mu.Lock()
		var err error
		add := func(b *block, what string) {
			switch {
			case err != nil:
			case b.free || b.list != nil:
				err = errorf("%s block %#x of stream %#x is free or listed", what, uintptr(b.addr), id)
			case all[b.addr] != nil || p.live.get(b.addr) != nil:
				err = errorf("%s block %#x of stream %#x is indexed twice", what, uintptr(b.addr), id)
			case b.size > poolCacheMaxBlock:
				err = errorf("%s block %#x of stream %#x has %s", what, uintptr(b.addr), id, bytesText(b.size))
			}
			all[b.addr] = b
			held += b.size
		}
		for _, b := range c.slots[:c.n] {
			add(b, "cached") // its asked size is the last one: see allocateCached
		}
		c.issued.each(func(b *block) {
			if n, _ := alignSize(b.req()); err == nil && n != b.size {
				err = errorf("block %#x handed out by the cache of stream %#x has %s, asked %d", uintptr(b.addr), id, bytesText(b.size), b.req())
			}
			add(b, "handed-out")
		})
		dead := c.dead
		c.mu.Unlock()
		if err != nil {
			return 0, err
		}
		if dead {
			return 0, errorf("the cache of stream %#x is dead but published", id)
		}
	}
	return held, nil
}
