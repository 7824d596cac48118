package rmm

// arenaIndexFan is the fan-out of the superblock index's nodes.
const arenaIndexFan = 16

// arenaIndex holds an arena's superblocks in address order for first fit: a B+ tree whose every
// entry records the largest free block below it. A first fit reads one compact node per level
// (four levels for 20,000 superblocks, against some twenty nodes of a binary tree, each in
// another superblock's memory), and the nodes are few enough to stay in the cache. A superblock
// knows its leaf and slot, so a removal or a change of its largest free block starts there and
// climbs only as far as a maximum changes. Nodes emptied by removals are dropped; nodes are not
// merged otherwise.
type arenaIndex struct {
	root  *arenaIndexNode
	count int // superblocks
}

// arenaIndexNode is a node of an arenaIndex: entries 0..n−1 in address order, each a child node
// (inner nodes) or a superblock (leaves).
type arenaIndexNode struct {
	maxw   [arenaIndexFan]int       // the largest free block below each entry
	addr   [arenaIndexFan]DevicePtr // the lowest superblock address below each entry
	kids   [arenaIndexFan]*arenaIndexNode
	sbs    [arenaIndexFan]*arenaSuperblock
	parent *arenaIndexNode
	pidx   int // the entry of parent that is this node
	n      int
	leaf   bool
}

// max returns the largest free block below x.
func (x *arenaIndexNode) max() int {
	m := 0
	for _, w := range x.maxw[:x.n] {
		m = max(m, w)
	}
	return m
}

// set makes entry i of x the child kid or the superblock sb, with its maximum and address.
func (x *arenaIndexNode) set(i int, w int, a DevicePtr, kid *arenaIndexNode, sb *arenaSuperblock) {
	x.maxw[i], x.addr[i], x.kids[i], x.sbs[i] = w, a, kid, sb
	if kid != nil {
		kid.parent, kid.pidx = x, i
	}
	if sb != nil {
		sb.ileaf, sb.islot = x, int32(i)
	}
}

// firstFit returns the lowest-addressed superblock whose largest free block holds w bytes, or
// nil.
func (t *arenaIndex) firstFit(w int) *arenaSuperblock {
	x := t.root
	if x == nil {
		return nil
	}
	for {
		i := 0
		for i < x.n && x.maxw[i] < w {
			i++
		}
		if i == x.n {
			return nil
		}
		if x.leaf {
			return x.sbs[i]
		}
		x = x.kids[i]
	}
}

// insert adds sb, whose range must not overlap any superblock of t.
func (t *arenaIndex) insert(sb *arenaSuperblock) {
	t.count++
	a := sb.addr()
	if t.root == nil {
		t.root = &arenaIndexNode{leaf: true}
	}
	x := t.root
	for !x.leaf {
		i := x.n - 1
		for i > 0 && x.addr[i] > a {
			i--
		}
		x = x.kids[i]
	}
	j := 0
	for j < x.n && x.addr[j] < a {
		j++
	}
	t.insertAt(x, j, sb.maxFree(), a, nil, sb)
}

// insertAt inserts an entry at position j of x, splitting x when it is full, and brings the
// addresses and maxima above up to date.
func (t *arenaIndex) insertAt(x *arenaIndexNode, j int, w int, a DevicePtr, kid *arenaIndexNode, sb *arenaSuperblock) {
	if x.n == arenaIndexFan {
		// Split: the upper half moves to a new node after x.
		y := &arenaIndexNode{leaf: x.leaf}
		h := arenaIndexFan / 2
		for i := h; i < arenaIndexFan; i++ {
			y.set(i-h, x.maxw[i], x.addr[i], x.kids[i], x.sbs[i])
			x.kids[i], x.sbs[i] = nil, nil
		}
		x.n, y.n = h, arenaIndexFan-h
		if x.parent == nil {
			r := &arenaIndexNode{n: 1}
			r.set(0, x.max(), x.addr[0], x, nil)
			t.root = r
		} else {
			t.refresh(x)
		}
		t.insertAt(x.parent, x.pidx+1, y.max(), y.addr[0], y, nil)
		if j > h {
			x, j = y, j-h
		}
	}
	for i := x.n; i > j; i-- {
		x.set(i, x.maxw[i-1], x.addr[i-1], x.kids[i-1], x.sbs[i-1])
	}
	x.set(j, w, a, kid, sb)
	x.n++
	t.refresh(x)
}

// refresh brings the address and maximum that the ancestors of x record for it up to date,
// climbing while they change.
func (t *arenaIndex) refresh(x *arenaIndexNode) {
	for p := x.parent; p != nil; x, p = p, p.parent {
		m, a := x.max(), x.addr[0]
		if p.maxw[x.pidx] == m && p.addr[x.pidx] == a {
			return
		}
		p.maxw[x.pidx], p.addr[x.pidx] = m, a
	}
}

// remove takes sb (which must be in t) out of t.
func (t *arenaIndex) remove(sb *arenaSuperblock) {
	x, j := sb.ileaf, int(sb.islot)
	if x == nil || j >= x.n || x.sbs[j] != sb {
		panic("rmm: arena index corrupted: superblock not found")
	}
	sb.ileaf = nil
	t.count--
	t.removeAt(x, j)
}

// removeAt removes entry j of x, dropping x when it empties, and brings the ancestors up to
// date.
func (t *arenaIndex) removeAt(x *arenaIndexNode, j int) {
	for i := j; i < x.n-1; i++ {
		x.set(i, x.maxw[i+1], x.addr[i+1], x.kids[i+1], x.sbs[i+1])
	}
	x.n--
	x.kids[x.n], x.sbs[x.n] = nil, nil
	switch {
	case x.n == 0 && x.parent == nil:
		t.root = nil
	case x.n == 0:
		t.removeAt(x.parent, x.pidx)
	case x.parent == nil && !x.leaf && x.n == 1:
		t.root = x.kids[0] // the root keeps one child: it becomes the root
		t.root.parent = nil
	default:
		t.refresh(x)
	}
}

// fix brings the index up to date after sb's largest free block changed.
func (t *arenaIndex) fix(sb *arenaSuperblock) {
	x, j := sb.ileaf, int(sb.islot)
	w := sb.maxFree()
	old := x.maxw[j]
	if old == w {
		return
	}
	x.maxw[j] = w
	// Climb while the maximum a parent records changes: an entry that rose to or above it is the
	// new maximum, one that was below it changes nothing, and only an entry that held the
	// maximum and fell needs the node's entries scanned.
	for p := x.parent; p != nil; x, p = p, p.parent {
		pm := p.maxw[x.pidx]
		var m int
		switch {
		case w >= pm:
			m = w
		case old < pm:
			return
		default:
			m = x.max()
		}
		if m == pm {
			return
		}
		p.maxw[x.pidx] = m
		old, w = pm, m
	}
}

// each calls f for the node of every superblock, in address order; f must not change t.
func (t *arenaIndex) each(f func(*arenaNode)) {
	var walk func(x *arenaIndexNode)
	walk = func(x *arenaIndexNode) {
		for i := 0; i < x.n; i++ {
			if x.leaf {
				f(&x.sbs[i].node)
			} else {
				walk(x.kids[i])
			}
		}
	}
	if t.root != nil {
		walk(t.root)
	}
}

// nodes returns the superblocks' nodes in address order.
func (t *arenaIndex) nodes() []*arenaNode {
	out := make([]*arenaNode, 0, t.count)
	t.each(func(n *arenaNode) { out = append(out, n) })
	return out
}

// check verifies the index: entries in address order without overlaps, the addresses and maxima
// recorded for every entry, parent and leaf links, leaves all at one depth, and the count.
func (t *arenaIndex) check() error {
	count, depth := 0, -1
	var prev *arenaSuperblock
	var walk func(x *arenaIndexNode, d int) (int, DevicePtr, error)
	walk = func(x *arenaIndexNode, d int) (int, DevicePtr, error) {
		if x.n < 1 || x.n > arenaIndexFan {
			return 0, 0, errorf("index node with %d entries", x.n)
		}
		m := 0
		for i := 0; i < x.n; i++ {
			var w int
			var a DevicePtr
			if x.leaf {
				sb := x.sbs[i]
				if sb == nil || sb.ileaf != x || int(sb.islot) != i {
					return 0, 0, errorf("index leaf entry %d does not link to its superblock", i)
				}
				if prev != nil && prev.end() > sb.addr() {
					return 0, 0, errorf("superblocks %#x and %#x out of order or overlapping", uintptr(prev.addr()), uintptr(sb.addr()))
				}
				prev = sb
				count++
				w, a = sb.maxFree(), sb.addr()
			} else {
				kid := x.kids[i]
				if kid == nil || kid.parent != x || kid.pidx != i {
					return 0, 0, errorf("index entry %d does not link to its child", i)
				}
				var err error
				if w, a, err = walk(kid, d+1); err != nil {
					return 0, 0, err
				}
			}
			if x.maxw[i] != w || x.addr[i] != a {
				return 0, 0, errorf("index entry %#x records maximum %d at %#x, holds %d at %#x", uintptr(a), x.maxw[i], uintptr(x.addr[i]), w, uintptr(a))
			}
			m = max(m, w)
		}
		if x.leaf {
			if depth < 0 {
				depth = d
			} else if depth != d {
				return 0, 0, errorf("index leaves at depths %d and %d", depth, d)
			}
		}
		return m, x.addr[0], nil
	}
	if t.root != nil {
		if t.root.parent != nil {
			return errorf("index root has a parent")
		}
		if _, _, err := walk(t.root, 0); err != nil {
			return err
		}
	}
	if count != t.count {
		return errorf("index counts %d superblocks, holds %d", t.count, count)
	}
	return nil
}
