package rmm

import (
	"fmt"
	"math/bits"
)

// The pool's blocks. Every block of an upstream allocation — free or allocated — links to its
// address neighbours inside that upstream block (prev, next; nil at its ends), as a boundary-tag
// allocator does, so coalescing a freed block with free neighbours costs no lookup at all, and
// blocks of two upstream allocations are never neighbours. Free blocks are each in exactly one
// per-stream free list. A list sorts its blocks into size classes, as a two-level segregated fit
// allocator (TLSF) does — exact 256-byte steps below 16 KiB, then 64 classes per power of two —
// and keeps each class in a treap ordered by (size, address), with a bitmap of the classes that
// hold blocks. Best fit — the smallest block that is large enough, the lowest address among
// equals — searches the request's own class, else takes the first block of the next class that
// holds any (two bit scans): O(log k) for k blocks in a class, far fewer than in the list.
// Insertion is O(log k) as well; removal is O(1) expected, since a block links to its parent in
// the treap. Allocated blocks are found by address in one map (the pool's live map).

// block is a block of an upstream allocation. A free block is the treap node itself, so indexing
// it allocates nothing. The fields a treap descent reads come first.
//
// A block is 80 bytes, and should stay so: W2 walks treaps and chains of tens of thousands of
// blocks, and is bound by the cache lines they take; a larger block made it measurably slower
// (BENCHMARKS.md). So what few blocks have lies out of line (rare), the asked size is kept as its
// difference from the size, and the treap's priorities have 16 bits (ties only cost a class's
// treap a little balance).
type block struct {
	size        int
	addr        DevicePtr
	left, right *block
	parent      *block // in the treap; nil at its root and outside it
	prio        uint16
	free        bool
	hole        bool // an expandable pool's range whose memory was given back (not free)
	lent        bool // a chunk of the chain mapped into a live stitched block (pool_backing_stitch.go)
	served      bool // a live block the backing served outside every chain (a stitched range: poolBacking.freeServed)
	// slack: allocated, the size less the size asked (below Alignment: an allocated block has the
	// asked size rounded up; see req and setReq).
	slack      uint8
	list       *freeList // free and indexed: its list; nil otherwise
	prev, next *block    // address neighbours within the upstream allocation
	rare       *blockRare
}

// blockRare holds what almost every block leaves empty.
type blockRare struct {
	// sample: allocated and sampled for the pool's MemoryProfile: the bucket its free is
	// counted in. Written by the allocating goroutine after it unlocks, before Allocate returns
	// the address (so before any free of it), read and cleared by the free under its lock.
	sample *memProfBucket
	// deps: free, listed: other lists whose events a taker must also wait on (memory freed on
	// their streams coalesced into this block; pool_placement.go).
	deps []*freeList
}

// req returns the size asked for the allocated block b.
func (b *block) req() int { return b.size - int(b.slack) }

// setReq records n as the size asked for b, whose size is n rounded up to Alignment.
func (b *block) setReq(n int) {
	d := b.size - n
	if uint(d) >= Alignment {
		badReq(b.size, n)
	}
	b.slack = uint8(d)
}

// badReq panics: a block of size bytes was handed out for n (out of line, so that setReq inlines).
//
//go:noinline
func badReq(size, n int) {
	panic(fmt.Sprintf("rmm: a pool block of %d bytes handed out for %d", size, n))
}

// deps returns the lists whose events a taker of b must also wait on (pool_placement.go).
func (b *block) deps() []*freeList {
	if b.rare == nil {
		return nil
	}
	return b.rare.deps
}

// rareFields returns b's out-of-line fields, making them on first use.
func (b *block) rareFields() *blockRare {
	if b.rare == nil {
		b.rare = new(blockRare)
	}
	return b.rare
}

// tidyRare drops b's out-of-line fields once they are all empty.
func (b *block) tidyRare() {
	if r := b.rare; r != nil && r.sample == nil && r.deps == nil {
		b.rare = nil
	}
}

func (b *block) end() DevicePtr { return b.addr + DevicePtr(b.size) }

// less orders blocks by size, then address.
func (b *block) less(o *block) bool {
	return b.size < o.size || (b.size == o.size && b.addr < o.addr)
}

// Size classes: a size below 16 KiB (64 × 256 bytes) is in level 0, class size/256; a larger
// size of 2^e × 256 bytes or more (e ≥ 6) is in level e − 5, class given by the 6 bits below
// its leading one (in units of 256 bytes). Classes are ordered as the sizes they hold.
const (
	freeSubBits = 6
	freeSubs    = 1 << freeSubBits
	freeLevels  = 63 - 8 - freeSubBits + 1 // the largest int, 2^63 − 1, is in the last level
)

// freeClass returns the level and class of a block of size bytes (size > 0).
func freeClass(size int) (level, class int) {
	u := uint64(size) >> 8
	if u < freeSubs {
		return 0, int(u)
	}
	e := bits.Len64(u) - 1
	return e - freeSubBits + 1, int(u>>(e-freeSubBits)) & (freeSubs - 1)
}

// freeList is the free blocks ordered on one stream.
type freeList struct {
	streamOrder // stream, event, lazy, dirty, closed, dropped (stream_order.go)
	// pins counts the goroutines that hold the list across an unlock of the pool's mutex (a
	// take waiting on its event, a merge into it, a growth for it, Release's synchronisation):
	// a pinned list is never dropped, so its event outlives every call naming it.
	pins int
	// recording counts the records of event in flight (made after an unlock): until they are
	// done the event may still hold an older record, so a taker records it again itself.
	recording int
	// frees counts the blocks freed (or merged) into the list: Release compares it before and
	// after the synchronisation it made unlocked, to know whether it covered every block.
	frees uint64
	// depRefs counts the blocks whose deps name this list: it is dropped while a listed block
	// does only once its stream's work behind the frees was waited for (pool_placement.go).
	depRefs int
	count   int // blocks
	bytes   int // free bytes
	rng     uint32
	// The sizes (rounded) of the stream's last allocations that its cache could not serve; a
	// free of one of these sizes goes to the stream's cache (pool_cache.go).
	recent     [poolCacheRecent]int
	recentNext int

	top    uint64                        // bit L: level L has a class holding blocks
	sub    [freeLevels]uint64            // bit c of sub[L]: class c of level L holds blocks
	levels [freeLevels]*[freeSubs]*block // the treap root of every class, by level (nil: unused)
}

// idle reports whether nothing keeps the list when its stream closes: no free block, and no
// block naming it among its deps.
func (l *freeList) idle() bool { return l.count == 0 && l.depRefs == 0 }

func (l *freeList) nextPrio() uint16 {
	// xorshift32 (never zero), its top 16 bits.
	x := l.rng
	x ^= x << 13
	x ^= x >> 17
	x ^= x << 5
	l.rng = x
	return uint16(x >> 16)
}

// rootOf returns the treap root slot of the class of size bytes, making the level on first use.
func (l *freeList) rootOf(size int) (root **block, level, class int) {
	level, class = freeClass(size)
	lv := l.levels[level]
	if lv == nil {
		lv = new([freeSubs]*block)
		l.levels[level] = lv
	}
	return &lv[class], level, class
}

// insert adds b to the treap of its class: a descent to a leaf position, then rotations up
// while b's priority is above its parent's (O(1) expected).
func (l *freeList) insert(b *block) {
	b.list = l
	b.left, b.right, b.parent = nil, nil, nil
	b.prio = l.nextPrio()
	l.count++
	l.bytes += b.size
	root, level, class := l.rootOf(b.size)
	var p *block
	for t := *root; t != nil; {
		p = t
		if b.less(t) {
			t = t.left
		} else {
			t = t.right
		}
	}
	b.parent = p
	switch {
	case p == nil:
		*root = b
		l.sub[level] |= 1 << class
		l.top |= 1 << level
		return
	case b.less(p):
		p.left = b
	default:
		p.right = b
	}
	for p != nil && b.prio > p.prio {
		rotateUp(root, b)
		p = b.parent
	}
}

// replace puts c (possibly nil) where the child old of p was (*root when p is nil).
func replace(root **block, p, old, c *block) {
	switch {
	case p == nil:
		*root = c
	case p.left == old:
		p.left = c
	default:
		p.right = c
	}
	if c != nil {
		c.parent = p
	}
}

// rotateUp rotates x above its parent, keeping the (size, address) order.
func rotateUp(root **block, x *block) {
	p := x.parent
	replace(root, p.parent, p, x)
	if p.left == x {
		p.left = x.right
		if x.right != nil {
			x.right.parent = p
		}
		x.right = p
	} else {
		p.right = x.left
		if x.left != nil {
			x.left.parent = p
		}
		x.left = p
	}
	p.parent = x
}

// remove takes b out of its list l (b must be in it, with the size it was inserted with). b's
// parent link finds its place: no search, only the merge of its two subtrees (O(1) expected).
func (l *freeList) remove(b *block) {
	level, class := freeClass(b.size)
	lv := l.levels[level]
	if b.list != l || lv == nil || (b.parent == nil && lv[class] != b) {
		panic("rmm: free list corrupted: block not found in its list")
	}
	root := &lv[class]
	replace(root, b.parent, b, treapJoin(b.left, b.right))
	if *root == nil {
		l.sub[level] &^= 1 << class
		if l.sub[level] == 0 {
			l.top &^= 1 << level
		}
	}
	b.left, b.right, b.parent, b.list = nil, nil, nil, nil
	l.count--
	l.bytes -= b.size
}

// resize gives b, a block of l, size bytes without a treap's descent when it can, and reports
// whether it did: when b is alone in its class's treap and the class of size is b's or holds no
// block, b stays or becomes that class's only block, so that no order among l's blocks needs
// looking at (the caller changes b's address to match, l.bytes is updated here).
func (l *freeList) resize(b *block, size int) bool {
	if b.parent != nil || b.left != nil || b.right != nil || b.lent || b.hole || b.served {
		return false
	}
	l1, c1 := freeClass(b.size)
	l2, c2 := freeClass(size)
	if l1 != l2 || c1 != c2 {
		if l.sub[l2]&(1<<c2) != 0 {
			return false // another block's class: b would have to go into its treap
		}
		lv := l.levels[l2]
		if lv == nil {
			lv = new([freeSubs]*block)
			l.levels[l2] = lv
		}
		l.levels[l1][c1] = nil
		if l.sub[l1] &^= 1 << c1; l.sub[l1] == 0 {
			l.top &^= 1 << l1
		}
		lv[c2] = b
		l.sub[l2] |= 1 << c2
		l.top |= 1 << l2
	}
	l.bytes += size - b.size
	b.size = size
	return true
}

// treapJoin merges two treaps where every key of a is below every key of b. The parent link of
// the result is left to the caller.
func treapJoin(a, b *block) *block {
	if a == nil {
		return b
	}
	if b == nil {
		return a
	}
	if a.prio > b.prio {
		a.right = treapJoin(a.right, b)
		a.right.parent = a
		return a
	}
	b.left = treapJoin(a, b.left)
	b.left.parent = b
	return b
}

// bestFit returns the smallest block of at least n bytes (lowest address among equal sizes), or
// nil: the best fit within n's own class, else the first block of the next class holding any.
func (l *freeList) bestFit(n int) *block {
	level, class := freeClass(n)
	if lv := l.levels[level]; lv != nil {
		var best *block
		for t := lv[class]; t != nil; {
			if t.size >= n {
				best = t
				t = t.left
			} else {
				t = t.right
			}
		}
		if best != nil {
			return best
		}
	}
	// Every block of a later class is larger than n.
	if class+1 < freeSubs {
		if m := l.sub[level] >> (class + 1); m != 0 {
			return treapFirst(l.levels[level][class+1+bits.TrailingZeros64(m)])
		}
	}
	m := l.top >> (level + 1)
	if m == 0 {
		return nil
	}
	level += 1 + bits.TrailingZeros64(m)
	return treapFirst(l.levels[level][bits.TrailingZeros64(l.sub[level])])
}

// treapFirst returns the first block of the treap t (nil when empty).
func treapFirst(t *block) *block {
	for t != nil && t.left != nil {
		t = t.left
	}
	return t
}

// largest returns the largest block (highest address among equals), or nil.
func (l *freeList) largest() *block {
	if l.top == 0 {
		return nil
	}
	level := bits.Len64(l.top) - 1
	t := l.levels[level][bits.Len64(l.sub[level])-1]
	for t.right != nil {
		t = t.right
	}
	return t
}

// each calls f for every block in (size, address) order; f must not change the list.
func (l *freeList) each(f func(*block)) { l.eachAtLeast(0, f) }

// eachAtLeast calls f for every block of the classes that may hold n bytes or more (some blocks
// of n's own class may be smaller), in (size, address) order.
func (l *freeList) eachAtLeast(n int, f func(*block)) {
	var walk func(*block)
	walk = func(t *block) { // in order
		if t == nil {
			return
		}
		walk(t.left)
		f(t)
		walk(t.right)
	}
	level, class := freeClass(n)
	for top := l.top &^ (1<<level - 1); top != 0; top &= top - 1 {
		lv := bits.TrailingZeros64(top)
		sub := l.sub[lv]
		if lv == level {
			sub &^= 1<<class - 1
		}
		for ; sub != 0; sub &= sub - 1 {
			walk(l.levels[lv][bits.TrailingZeros64(sub)])
		}
	}
}

// check verifies the list and calls visit for every block in (size, address) order: each class
// is a treap (order, heap order of priorities, parent links) holding only sizes of its class,
// the bitmaps name exactly the classes holding blocks, and the count and bytes add up. It stops
// at the first error, its own or visit's.
func (l *freeList) check(visit func(*block) error) error {
	n, bytes := 0, 0
	var prev *block
	var walk func(t, parent *block, level, class int) error
	walk = func(t, parent *block, level, class int) error {
		if t == nil {
			return nil
		}
		switch lv, c := freeClass(t.size); {
		case t.parent != parent:
			return errorf("block %#x does not link to its parent in the treap", uintptr(t.addr))
		case parent != nil && t.prio > parent.prio:
			return errorf("treap heap order broken at block %#x", uintptr(t.addr))
		case lv != level || c != class:
			return errorf("block %#x of %s is in size class (%d, %d), not (%d, %d)", uintptr(t.addr), bytesText(t.size), level, class, lv, c)
		}
		if err := walk(t.left, t, level, class); err != nil {
			return err
		}
		if prev != nil && !prev.less(t) {
			return errorf("free list of %v out of order: (%d, %#x) before (%d, %#x)", l.stream, prev.size, uintptr(prev.addr), t.size, uintptr(t.addr))
		}
		prev = t
		n++
		bytes += t.size
		if err := visit(t); err != nil {
			return err
		}
		return walk(t.right, t, level, class)
	}
	for level, lv := range l.levels {
		if (l.top>>level)&1 != uint64(min(l.sub[level], 1)) {
			return errorf("free list of %v: level %d's bit does not match its classes", l.stream, level)
		}
		for class := 0; class < freeSubs; class++ {
			var root *block
			if lv != nil {
				root = lv[class]
			}
			if (root != nil) != ((l.sub[level]>>class)&1 == 1) {
				return errorf("free list of %v: class (%d, %d)'s bit does not match its blocks", l.stream, level, class)
			}
			if err := walk(root, nil, level, class); err != nil {
				return err
			}
		}
	}
	if n != l.count || bytes != l.bytes {
		return errorf("free list of %v counts %d blocks / %s, holds %d / %d", l.stream, l.count, bytesText(l.bytes), n, bytes)
	}
	return nil
}
