package rmm

import (
	"fmt"
	"sync/atomic"
)

// The arena's ordered structures. Both levels of the arena search by address with first fit:
// the free blocks of a superblock (the lowest-addressed block of at least n bytes) and the
// superblocks of an arena (the lowest-addressed superblock whose largest free block is at least n
// bytes). Both are an address-ordered treap in which every node also knows the largest weight in
// its subtree, so that first fit, insertion, removal and neighbour lookups are O(log n) expected.

// arenaNode is a node of an arenaTree: a free block of a superblock (weight = its size) or a
// superblock in an arena (weight = its largest free block; sb points to it).
type arenaNode struct {
	addr        DevicePtr
	size        int
	weight      int // what first fit compares with the request
	maxWeight   int // the largest weight in the subtree rooted here
	left, right *arenaNode
	prio        uint32
	sb          *arenaSuperblock // the superblock, for nodes of a superblock tree
}

func (n *arenaNode) end() DevicePtr { return n.addr + DevicePtr(n.size) }

// pull recomputes maxWeight from n's weight and its children.
func (n *arenaNode) pull() {
	m := n.weight
	if n.left != nil && n.left.maxWeight > m {
		m = n.left.maxWeight
	}
	if n.right != nil && n.right.maxWeight > m {
		m = n.right.maxWeight
	}
	n.maxWeight = m
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

// insert adds n, whose range must not overlap any node of t.
func (t *arenaTree) insert(n *arenaNode) {
	n.left, n.right = nil, nil
	n.prio = t.nextPrio()
	n.maxWeight = n.weight
	t.root = arenaInsert(t.root, n)
	t.count++
}

func arenaInsert(t, n *arenaNode) *arenaNode {
	if t == nil {
		return n
	}
	if n.addr < t.addr {
		t.left = arenaInsert(t.left, n)
		if t.left.prio > t.prio {
			return arenaRotateRight(t)
		}
	} else {
		t.right = arenaInsert(t.right, n)
		if t.right.prio > t.prio {
			return arenaRotateLeft(t)
		}
	}
	t.pull()
	return t
}

func arenaRotateRight(t *arenaNode) *arenaNode {
	l := t.left
	t.left = l.right
	l.right = t
	t.pull()
	l.pull()
	return l
}

func arenaRotateLeft(t *arenaNode) *arenaNode {
	r := t.right
	t.right = r.left
	r.left = t
	t.pull()
	r.pull()
	return r
}

// remove takes n (which must be in t) out of t.
func (t *arenaTree) remove(n *arenaNode) {
	t.root = arenaRemove(t.root, n)
	n.left, n.right = nil, nil
	t.count--
}

func arenaRemove(t, n *arenaNode) *arenaNode {
	if t == nil {
		panic("rmm: arena tree corrupted: node not found")
	}
	if t == n {
		return arenaJoin(t.left, t.right)
	}
	if n.addr < t.addr {
		t.left = arenaRemove(t.left, n)
	} else {
		t.right = arenaRemove(t.right, n)
	}
	t.pull()
	return t
}

// arenaJoin merges two treaps where every address of a is below every address of b.
func arenaJoin(a, b *arenaNode) *arenaNode {
	if a == nil {
		return b
	}
	if b == nil {
		return a
	}
	if a.prio > b.prio {
		a.right = arenaJoin(a.right, b)
		a.pull()
		return a
	}
	b.left = arenaJoin(a, b.left)
	b.pull()
	return b
}

// fix restores the subtree maxima on the path to n after n's weight changed, or after its
// address or size changed without moving it past a neighbour (the tree order still holds).
func (t *arenaTree) fix(n *arenaNode) { arenaFix(t.root, n) }

func arenaFix(t, n *arenaNode) {
	if t == nil {
		panic("rmm: arena tree corrupted: node not found")
	}
	if t != n {
		if n.addr < t.addr {
			arenaFix(t.left, n)
		} else {
			arenaFix(t.right, n)
		}
	}
	t.pull()
}

// firstFit returns the lowest-addressed node whose weight is at least w, or nil.
func (t *arenaTree) firstFit(w int) *arenaNode {
	x := t.root
	if x == nil || x.maxWeight < w {
		return nil
	}
	for {
		if x.left != nil && x.left.maxWeight >= w {
			x = x.left
			continue
		}
		if x.weight >= w {
			return x
		}
		x = x.right
	}
}

// below returns the node with the highest address below a, or nil.
func (t *arenaTree) below(a DevicePtr) *arenaNode {
	var best *arenaNode
	for x := t.root; x != nil; {
		if x.addr < a {
			best = x
			x = x.right
		} else {
			x = x.left
		}
	}
	return best
}

// above returns the node with the lowest address above a, or nil.
func (t *arenaTree) above(a DevicePtr) *arenaNode {
	var best *arenaNode
	for x := t.root; x != nil; {
		if x.addr > a {
			best = x
			x = x.left
		} else {
			x = x.right
		}
	}
	return best
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
			err = fmt.Errorf("treap heap order broken at %#x", uintptr(x.addr))
			return
		}
		walk(x.left, x)
		if err != nil {
			return
		}
		if prev != nil && prev.end() > x.addr {
			err = fmt.Errorf("nodes [%#x, %#x) and [%#x, %#x) out of order or overlapping", uintptr(prev.addr), uintptr(prev.end()), uintptr(x.addr), uintptr(x.end()))
			return
		}
		m := x.weight
		if x.left != nil {
			m = max(m, x.left.maxWeight)
		}
		if x.right != nil {
			m = max(m, x.right.maxWeight)
		}
		if m != x.maxWeight {
			err = fmt.Errorf("node %#x: subtree maximum %d, recomputed %d", uintptr(x.addr), x.maxWeight, m)
			return
		}
		prev = x
		n++
		walk(x.right, x)
	}
	walk(t.root, nil)
	if err == nil && n != t.count {
		err = fmt.Errorf("tree counts %d nodes, holds %d", t.count, n)
	}
	return err
}

// arenaSuperblock is a contiguous range of the arena, at least 1 MiB, owned by one arena (or the
// global arena) at a time, in which blocks are carved by first fit and coalesced when freed.
// Only an empty superblock is ever split or merged, so a superblock holding live allocations
// keeps its range.
type arenaSuperblock struct {
	node      arenaNode // the superblock's node in its owner's tree; node.sb is the superblock
	free      arenaTree // free blocks, weight = size
	freeBytes int
	spare     *arenaNode // unused free-block nodes (linked through right)
	nspare    int
	owner     atomic.Pointer[arenaSet]
}

func newArenaSuperblock(addr DevicePtr, size int) *arenaSuperblock {
	sb := &arenaSuperblock{}
	sb.node = arenaNode{addr: addr, size: size, sb: sb}
	sb.free.rng = uint32(addr>>8) | 1
	sb.free.insert(&arenaNode{addr: addr, size: size, weight: size})
	sb.freeBytes = size
	sb.node.weight = size
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
	n.addr, n.size, n.weight = addr, size, size
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
// must fix the superblock's node in its owner's tree afterwards (its weight may have changed).
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
		b.weight = b.size
		sb.free.fix(b)
	}
	sb.freeBytes -= n
	sb.node.weight = sb.maxFree()
	return p, true
}

// coalesce returns [p, p+n) to the superblock's free blocks, merged with the free blocks just
// before and after it. The caller must fix the superblock's node in its owner's tree afterwards.
func (sb *arenaSuperblock) coalesce(p DevicePtr, n int) {
	end := p + DevicePtr(n)
	prev := sb.free.below(p)
	next := sb.free.above(p)
	joinPrev := prev != nil && prev.end() == p
	joinNext := next != nil && next.addr == end
	switch {
	case joinPrev && joinNext:
		sb.free.remove(next)
		prev.size += n + next.size
		prev.weight = prev.size
		sb.free.fix(prev)
		sb.dropNode(next)
	case joinPrev:
		prev.size += n
		prev.weight = prev.size
		sb.free.fix(prev)
	case joinNext:
		// next's start moves down to p; nothing lies between p and next.
		next.addr = p
		next.size += n
		next.weight = next.size
		sb.free.fix(next)
	default:
		sb.free.insert(sb.newNode(p, n))
	}
	sb.freeBytes += n
	sb.node.weight = sb.maxFree()
}

// split cuts an empty superblock after head bytes: sb keeps [addr, addr+head) and the rest is
// returned as a new empty superblock (with no owner). The caller fixes sb's node in its tree.
func (sb *arenaSuperblock) split(head int) *arenaSuperblock {
	if !sb.empty() || head <= 0 || head >= sb.size() {
		panic("rmm: arena: split of a superblock that is not empty or too small")
	}
	tail := newArenaSuperblock(sb.addr()+DevicePtr(head), sb.size()-head)
	b := sb.free.root // the one free block, covering the superblock
	b.size, b.weight = head, head
	sb.free.fix(b)
	sb.node.size = head
	sb.freeBytes = head
	sb.node.weight = head
	return tail
}

// absorb merges the empty superblock next, which starts where the empty sb ends, into sb. next
// must already be out of every tree. The caller fixes sb's node in its tree.
func (sb *arenaSuperblock) absorb(next *arenaSuperblock) {
	if !sb.empty() || !next.empty() || sb.end() != next.addr() {
		panic("rmm: arena: merge of superblocks that are not empty neighbours")
	}
	b := sb.free.root
	b.size += next.size()
	b.weight = b.size
	sb.free.fix(b)
	sb.node.size += next.size()
	sb.freeBytes = sb.node.size
	sb.node.weight = sb.node.size
	next.owner.Store(nil)
}
