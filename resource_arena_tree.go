package rmm

import (
	"sync/atomic"
)

// The free blocks of a superblock, searched by address with first fit (the lowest-addressed
// block of at least n bytes): an address-ordered treap in which every node also knows the
// largest block in each of its subtrees, so that first fit and insertion are O(log n) expected.
// Nodes link to their parent: removing a node and updating a size start at the node and climb
// only as far as a subtree maximum changes, O(1) expected for a random node, with no search from
// the root. (An arena's superblocks are indexed by arenaIndex.)

// arenaNode is a free block of a superblock, a node of its arenaTree; first fit compares sizes.
// A superblock's own node (arenaSuperblock.node) uses only addr, size and sb.
type arenaNode struct {
	// What a descent or a climb reads, in the first 64 bytes (one cache line where the node is
	// 64-byte aligned, as a superblock's first free-block node is).
	addr        DevicePtr
	size        int
	maxWeight   int // the largest size in the subtree rooted here
	lmax, rmax  int // the maxWeight of the left and right child (0 without one)
	left, right *arenaNode
	parent      *arenaNode

	sb   *arenaSuperblock // for a superblock's own node: the superblock
	prio uint32
}

func (n *arenaNode) end() DevicePtr { return n.addr + DevicePtr(n.size) }

// pull recomputes maxWeight from n's size and its children's maxima.
func (n *arenaNode) pull() { n.maxWeight = max(n.size, n.lmax, n.rmax) }

// setLeft and setRight make c (possibly nil) a child of n.
func (n *arenaNode) setLeft(c *arenaNode) {
	n.left, n.lmax = c, 0
	if c != nil {
		c.parent, n.lmax = n, c.maxWeight
	}
}

func (n *arenaNode) setRight(c *arenaNode) {
	n.right, n.rmax = c, 0
	if c != nil {
		c.parent, n.rmax = n, c.maxWeight
	}
}

// arenaTree is an address-ordered treap of non-overlapping nodes.
type arenaTree struct {
	root  *arenaNode
	count int
	rng   uint32
}

func (t *arenaTree) nextPrio() uint32 {
	x := t.rng
	if x == 0 {
		x = 0x9e3779b9
	}
	// xorshift32; never zero.
	x ^= x << 13
	x ^= x >> 17
	x ^= x << 5
	t.rng = x
	return x
}

// replace puts c (possibly nil) where the child old of parent p was (the root when p is nil).
func (t *arenaTree) replace(p, old, c *arenaNode) {
	switch {
	case p == nil:
		t.root = c
		if c != nil {
			c.parent = nil
		}
	case p.left == old:
		p.setLeft(c)
	default:
		p.setRight(c)
	}
}

// rotateUp rotates x above its parent p, keeping the address order. The maxima of p and x are
// recomputed; the subtree holds the same nodes, so those above are unchanged.
func (t *arenaTree) rotateUp(x *arenaNode) {
	p := x.parent
	g := p.parent
	if p.left == x {
		p.setLeft(x.right)
		p.pull()
		x.setRight(p)
	} else {
		p.setRight(x.left)
		p.pull()
		x.setLeft(p)
	}
	x.pull()
	t.replace(g, p, x)
}

// insert adds n, whose range must not overlap any node of t.
func (t *arenaTree) insert(n *arenaNode) {
	n.left, n.right, n.parent = nil, nil, nil
	n.lmax, n.rmax = 0, 0
	n.prio = t.nextPrio()
	n.maxWeight = n.size
	t.count++
	w := n.size
	var p *arenaNode
	for x := t.root; x != nil; {
		p = x
		x.maxWeight = max(x.maxWeight, w)
		if n.addr < x.addr {
			x.lmax = max(x.lmax, w)
			x = x.left
		} else {
			x.rmax = max(x.rmax, w)
			x = x.right
		}
	}
	switch {
	case p == nil:
		t.root = n
	case n.addr < p.addr:
		p.left = n
		n.parent = p
	default:
		p.right = n
		n.parent = p
	}
	for n.parent != nil && n.prio > n.parent.prio {
		t.rotateUp(n)
	}
}

// remove takes n (which must be in t) out of t.
func (t *arenaTree) remove(n *arenaNode) {
	p := n.parent
	if p == nil && t.root != n {
		panic("rmm: arena tree corrupted: node not found")
	}
	t.replace(p, n, arenaJoin(n.left, n.right))
	n.left, n.right, n.parent = nil, nil, nil
	t.count--
	if p != nil {
		climb(p)
	}
}

// climb recomputes the subtree maxima from x up, after x's size or a child's maximum (as x
// records it) changed; it stops where a maximum is unchanged.
func climb(x *arenaNode) {
	for {
		old := x.maxWeight
		x.pull()
		if x.maxWeight == old {
			return
		}
		p := x.parent
		if p == nil {
			return
		}
		if p.left == x {
			p.lmax = x.maxWeight
		} else {
			p.rmax = x.maxWeight
		}
		x = p
	}
}

// arenaJoin merges two treaps where every address of a is below every address of b. The
// parent of the result is left for the caller to set.
func arenaJoin(a, b *arenaNode) *arenaNode {
	if a == nil {
		return b
	}
	if b == nil {
		return a
	}
	if a.prio > b.prio {
		a.setRight(arenaJoin(a.right, b))
		a.pull()
		return a
	}
	b.setLeft(arenaJoin(a, b.left))
	b.pull()
	return b
}

// fix restores the subtree maxima above n after n's size changed, with or without its address,
// without moving it past a neighbour (the tree order still holds). n must be in t, and fix must
// come before any other change to t: it climbs only while a maximum changes.
func (t *arenaTree) fix(n *arenaNode) { climb(n) }

// firstFit returns the lowest-addressed node of at least w bytes, or nil.
func (t *arenaTree) firstFit(w int) *arenaNode {
	x := t.root
	if x == nil || x.maxWeight < w {
		return nil
	}
	for {
		if x.left != nil && x.lmax >= w {
			x = x.left
			continue
		}
		if x.size >= w {
			return x
		}
		x = x.right
	}
}

// around returns the nodes with the highest address below a and the lowest address above a
// (each nil when there is none), in one descent.
func (t *arenaTree) around(a DevicePtr) (below, above *arenaNode) {
	for x := t.root; x != nil; {
		switch {
		case x.addr < a:
			below = x
			x = x.right
		case x.addr > a:
			above = x
			x = x.left
		default:
			// a is a node's address: its neighbours are the extremes of its subtrees, or the
			// ancestors found so far.
			if l := x.left; l != nil {
				for below = l; below.right != nil; below = below.right {
				}
			}
			if r := x.right; r != nil {
				for above = r; above.left != nil; above = above.left {
				}
			}
			return below, above
		}
	}
	return below, above
}

// each calls f for every node in address order; f must not change the tree.
func (t *arenaTree) each(f func(*arenaNode)) {
	var walk func(*arenaNode)
	walk = func(x *arenaNode) {
		if x == nil {
			return
		}
		walk(x.left)
		f(x)
		walk(x.right)
	}
	walk(t.root)
}

// nodes returns the nodes in address order.
func (t *arenaTree) nodes() []*arenaNode {
	out := make([]*arenaNode, 0, t.count)
	t.each(func(n *arenaNode) { out = append(out, n) })
	return out
}

// check verifies the tree: address order without overlaps, heap order of priorities, the
// subtree maxima and the count.
func (t *arenaTree) check() error {
	n := 0
	var prev *arenaNode
	var err error
	var walk func(x *arenaNode, parent *arenaNode)
	walk = func(x *arenaNode, parent *arenaNode) {
		if x == nil || err != nil {
			return
		}
		if parent != nil && x.prio > parent.prio {
			err = errorf("treap heap order broken at %#x", uintptr(x.addr))
			return
		}
		if x.parent != parent {
			err = errorf("node %#x does not link to its parent", uintptr(x.addr))
			return
		}
		walk(x.left, x)
		if err != nil {
			return
		}
		if prev != nil && prev.end() > x.addr {
			err = errorf("nodes [%#x, %#x) and [%#x, %#x) out of order or overlapping", uintptr(prev.addr), uintptr(prev.end()), uintptr(x.addr), uintptr(x.end()))
			return
		}
		m, lm, rm := x.size, 0, 0
		if x.left != nil {
			lm = x.left.maxWeight
		}
		if x.right != nil {
			rm = x.right.maxWeight
		}
		if lm != x.lmax || rm != x.rmax {
			err = errorf("node %#x: children's maxima recorded %d and %d, are %d and %d", uintptr(x.addr), x.lmax, x.rmax, lm, rm)
			return
		}
		m = max(m, lm, rm)
		if m != x.maxWeight {
			err = errorf("node %#x: subtree maximum %d, recomputed %d", uintptr(x.addr), x.maxWeight, m)
			return
		}
		prev = x
		n++
		walk(x.right, x)
	}
	walk(t.root, nil)
	if err == nil && n != t.count {
		err = errorf("tree counts %d nodes, holds %d", t.count, n)
	}
	return err
}

// arenaSuperblock is a contiguous range of the arena, at least 1 MiB, owned by one arena (or the
// global arena) at a time, in which blocks are carved by first fit and coalesced when freed.
// Only an empty superblock is ever split or merged, so a superblock holding live allocations
// keeps its range. Superblocks tile the arena; each links to its address neighbours (prevSB,
// nextSB), which only the global arena's lock guards: superblocks are split and merged only
// there.
type arenaSuperblock struct {
	// Laid out for the cache (TestArenaSuperblockLayout): 256 bytes, Go's 256-byte size class,
	// so the struct starts on a 64-byte line. What an allocation or a free reads first (owner,
	// free tree, free bytes, place in the index) fills the first line, the first free-block
	// node's hot part the second.
	owner     atomic.Pointer[arenaSet]
	free      arenaTree // free blocks
	freeBytes int
	ileaf     *arenaIndexNode // the index leaf holding the superblock (nil outside an index)
	islot     int32           // the superblock's entry in ileaf
	nspare    int32
	spare     *arenaNode // unused free-block nodes (linked through right)
	first     arenaNode  // the first free-block node, stored with the superblock
	node      arenaNode  // the superblock's range (addr, size) and node.sb, the superblock

	prevSB, nextSB *arenaSuperblock // address neighbours (nil at the arena's ends)
	// pend: the streams that freed into the superblock while it was in the global arena and
	// may still have work queued (nil or empty: none). Only the global arena's lock guards it;
	// it is empty whenever the superblock is in another arena.
	pend *arenaPending
	_    [8]byte
}

func newArenaSuperblock(addr DevicePtr, size int) *arenaSuperblock {
	return new(arenaSuperblock).reset(addr, size)
}

// reset makes sb an empty superblock of size bytes at addr, with no owner and no neighbours. A
// superblock merged into its neighbour (absorb) can be reset and used again: its free-block
// nodes (and its set of pending streams, emptied) are kept for reuse. The owner is left alone
// (nil for both).
func (sb *arenaSuperblock) reset(addr DevicePtr, size int) *arenaSuperblock {
	// The spares must not hold the first node, which goes back into the tree.
	spare := sb.spare
	sb.spare, sb.nspare = nil, 0
	for n := spare; n != nil; {
		next := n.right
		if n != &sb.first {
			sb.dropNode(n)
		}
		n = next
	}
	if b := sb.free.root; b != nil && b != &sb.first {
		sb.dropNode(b)
	}
	sb.node = arenaNode{addr: addr, size: size, sb: sb}
	sb.free = arenaTree{rng: uint32(addr>>8) | 1}
	sb.first = arenaNode{addr: addr, size: size}
	sb.free.insert(&sb.first)
	sb.freeBytes = size
	sb.ileaf, sb.islot = nil, 0
	sb.prevSB, sb.nextSB = nil, nil
	sb.pend.clear() // kept, empty, for reuse
	return sb
}

func (sb *arenaSuperblock) addr() DevicePtr { return sb.node.addr }
func (sb *arenaSuperblock) size() int       { return sb.node.size }
func (sb *arenaSuperblock) end() DevicePtr  { return sb.node.end() }

// empty reports whether nothing in the superblock is allocated.
func (sb *arenaSuperblock) empty() bool { return sb.freeBytes == sb.node.size }

// maxFree returns the superblock's largest free block.
func (sb *arenaSuperblock) maxFree() int {
	if sb.free.root == nil {
		return 0
	}
	return sb.free.root.maxWeight
}

func (sb *arenaSuperblock) newNode(addr DevicePtr, size int) *arenaNode {
	n := sb.spare
	if n != nil {
		sb.spare = n.right
		sb.nspare--
		*n = arenaNode{}
	} else {
		n = new(arenaNode)
	}
	n.addr, n.size = addr, size
	return n
}

func (sb *arenaSuperblock) dropNode(n *arenaNode) {
	if sb.nspare >= 32 {
		return
	}
	*n = arenaNode{right: sb.spare}
	sb.spare = n
	sb.nspare++
}

// firstFit carves n bytes (a multiple of 256) from the lowest-addressed free block large
// enough and returns their address; ok is false when no free block is large enough. The caller
// must fix the superblock in its owner's index afterwards (its largest free block may have
// changed).
func (sb *arenaSuperblock) firstFit(n int) (p DevicePtr, ok bool) {
	b := sb.free.firstFit(n)
	if b == nil {
		return 0, false
	}
	p = b.addr
	if b.size == n {
		sb.free.remove(b)
		sb.dropNode(b)
	} else {
		// The block keeps its place in address order: only its start moves up.
		b.addr += DevicePtr(n)
		b.size -= n
		sb.free.fix(b)
	}
	sb.freeBytes -= n
	return p, true
}

// coalesce returns [p, p+n) to the superblock's free blocks, merged with the free blocks just
// before and after it. The caller must fix the superblock in its owner's index afterwards.
func (sb *arenaSuperblock) coalesce(p DevicePtr, n int) {
	end := p + DevicePtr(n)
	prev, next := sb.free.around(p)
	joinPrev := prev != nil && prev.end() == p
	joinNext := next != nil && next.addr == end
	switch {
	case joinPrev && joinNext:
		sb.free.remove(next)
		prev.size += n + next.size
		sb.free.fix(prev)
		sb.dropNode(next)
	case joinPrev:
		prev.size += n
		sb.free.fix(prev)
	case joinNext:
		// next's start moves down to p; nothing lies between p and next.
		next.addr = p
		next.size += n
		sb.free.fix(next)
	default:
		sb.free.insert(sb.newNode(p, n))
	}
	sb.freeBytes += n
}

// split cuts an empty superblock after head bytes: sb keeps [addr, addr+head) and the rest is
// returned as an empty superblock (with no owner): spare, reset, when not nil (a superblock an
// absorb left over), else a new one. The caller fixes sb in its owner's index.
func (sb *arenaSuperblock) split(head int, spare *arenaSuperblock) *arenaSuperblock {
	if !sb.empty() || head <= 0 || head >= sb.size() {
		panic("rmm: arena: split of a superblock that is not empty or too small")
	}
	if spare == nil {
		spare = new(arenaSuperblock)
	}
	tail := spare.reset(sb.addr()+DevicePtr(head), sb.size()-head)
	tail.prevSB, tail.nextSB = sb, sb.nextSB
	if sb.nextSB != nil {
		sb.nextSB.prevSB = tail
	}
	sb.nextSB = tail
	b := sb.free.root // the one free block, covering the superblock
	b.size = head
	sb.free.fix(b)
	sb.node.size = head
	sb.freeBytes = head
	return tail
}

// absorb merges the empty superblock next, which starts where the empty sb ends, into sb. next
// must already be out of every tree; afterwards it has no owner and may be reset and used again.
// The caller fixes sb in its owner's index.
func (sb *arenaSuperblock) absorb(next *arenaSuperblock) {
	if !sb.empty() || !next.empty() || sb.end() != next.addr() {
		panic("rmm: arena: merge of superblocks that are not empty neighbours")
	}
	b := sb.free.root
	b.size += next.size()
	sb.free.fix(b)
	sb.node.size += next.size()
	sb.freeBytes = sb.node.size
	sb.nextSB = next.nextSB
	if next.nextSB != nil {
		next.nextSB.prevSB = sb
	}
	next.prevSB, next.nextSB = nil, nil
	next.owner.Store(nil)
}
