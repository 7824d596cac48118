package rmm

// The pool's blocks. Every block of an upstream allocation — free or allocated — links to its
// address neighbours inside that upstream block (prev, next; nil at its ends), as a boundary-tag
// allocator does, so coalescing a freed block with free neighbours costs no lookup at all, and
// blocks of two upstream allocations are never neighbours. Free blocks are each in exactly one
// per-stream free list, kept in a treap ordered by (size, address): best fit — the smallest
// block that is large enough, the lowest address among equals — and removal are O(log n).
// Allocated blocks are found by address in one map (the pool's live map).

// block is a block of an upstream allocation. A free block is the treap node itself, so indexing
// it allocates nothing.
type block struct {
	addr        DevicePtr
	size        int
	free        bool
	req         int       // allocated: the size asked
	list        *freeList // free and indexed: its list; nil otherwise
	left, right *block
	prio        uint32
	prev, next  *block // address neighbours within the upstream allocation
}

func (b *block) end() DevicePtr { return b.addr + DevicePtr(b.size) }

// less orders blocks by size, then address.
func (b *block) less(o *block) bool {
	return b.size < o.size || (b.size == o.size && b.addr < o.addr)
}

// freeList is the free blocks ordered on one stream.
type freeList struct {
	stream StreamView
	event  uintptr // CUevent recorded on stream (0 without CUDA)
	lazy   bool    // the stream's lifetime is known: record the event only when another stream takes blocks
	dirty  bool    // lazy list freed blocks since its event was last recorded
	closed bool    // the stream was destroyed (its event was recorded just before)
	root   *block
	count  int // blocks
	bytes  int // free bytes
	rng    uint32
}

func (l *freeList) nextPrio() uint32 {
	// xorshift32; never zero.
	x := l.rng
	x ^= x << 13
	x ^= x >> 17
	x ^= x << 5
	l.rng = x
	return x
}

// insert adds b to the treap.
func (l *freeList) insert(b *block) {
	b.list = l
	b.left, b.right = nil, nil
	b.prio = l.nextPrio()
	l.root = treapInsert(l.root, b)
	l.count++
	l.bytes += b.size
}

func treapInsert(t, b *block) *block {
	if t == nil {
		return b
	}
	if b.less(t) {
		t.left = treapInsert(t.left, b)
		if t.left.prio > t.prio {
			t = rotateRight(t)
		}
	} else {
		t.right = treapInsert(t.right, b)
		if t.right.prio > t.prio {
			t = rotateLeft(t)
		}
	}
	return t
}

func rotateRight(t *block) *block {
	l := t.left
	t.left = l.right
	l.right = t
	return l
}

func rotateLeft(t *block) *block {
	r := t.right
	t.right = r.left
	r.left = t
	return r
}

// remove takes b out of the treap (b must be in it).
func (l *freeList) remove(b *block) {
	l.root = treapRemove(l.root, b)
	b.left, b.right, b.list = nil, nil, nil
	l.count--
	l.bytes -= b.size
}

func treapRemove(t, b *block) *block {
	if t == nil {
		panic("rmm: free list corrupted: block not found in its list")
	}
	if t == b {
		return treapJoin(t.left, t.right)
	}
	if b.less(t) {
		t.left = treapRemove(t.left, b)
	} else {
		t.right = treapRemove(t.right, b)
	}
	return t
}

// treapJoin merges two treaps where every key of a is below every key of b.
func treapJoin(a, b *block) *block {
	if a == nil {
		return b
	}
	if b == nil {
		return a
	}
	if a.prio > b.prio {
		a.right = treapJoin(a.right, b)
		return a
	}
	b.left = treapJoin(a, b.left)
	return b
}

// bestFit returns the smallest block of at least n bytes (lowest address among equal sizes), or
// nil.
func (l *freeList) bestFit(n int) *block {
	var best *block
	for t := l.root; t != nil; {
		if t.size >= n {
			best = t
			t = t.left
		} else {
			t = t.right
		}
	}
	return best
}

// largest returns the largest block (highest address among equals), or nil.
func (l *freeList) largest() *block {
	t := l.root
	for t != nil && t.right != nil {
		t = t.right
	}
	return t
}

// each calls f for every block in (size, address) order.
func (l *freeList) each(f func(*block)) {
	var walk func(*block)
	walk = func(t *block) {
		if t == nil {
			return
		}
		walk(t.left)
		f(t)
		walk(t.right)
	}
	walk(l.root)
}
