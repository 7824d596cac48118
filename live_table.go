package rmm

// liveTable is an index of live allocations by address, used by the pool (its live blocks and
// each stream cache's issued blocks) and by the arena (its live shards and large blocks): an
// open-addressing hash table with linear probing over Fibonacci hashing of the 256-aligned
// address. A lookup hashes the pointer once and reads, as a rule, one cache line, where a Go map
// reads several; the address is kept in the slot, so a probe never touches the value. A deletion
// shifts the entries after the freed slot back instead of leaving tombstones, so probes stay
// short however long the table lives. Address 0 marks an empty slot (nothing is allocated at 0).
// The length of slots is 0 or a power of two; the table is at most 3/4 full, or half full when
// half is set. Not safe for concurrent use: its owner locks.
type liveTable[V any] struct {
	slots []liveEntry[V]
	n     int
	shift uint // 64 - log2(len(slots))
	// half keeps the table at most half full: shorter probe runs, so that a deletion moves fewer
	// entries, for twice the slots. The arena's table of large blocks (at most one per MiB of the
	// arena) sets it; tables that may hold millions of small blocks do not.
	half bool
}

type liveEntry[V any] struct {
	p DevicePtr
	v V
}

// liveHash mixes a 256-aligned pointer: its top bits choose the slot.
func liveHash(p DevicePtr) uint64 { return uint64(p>>8) * 0x9e3779b97f4a7c15 }

// home returns the slot p's probe starts at.
func (t *liveTable[V]) home(p DevicePtr) int { return int(liveHash(p) >> t.shift) }

// find returns the slot holding p, or -1.
func (t *liveTable[V]) find(p DevicePtr) int {
	if t.n == 0 {
		return -1
	}
	mask := len(t.slots) - 1
	for i := t.home(p); ; i = (i + 1) & mask {
		switch t.slots[i].p {
		case p:
			return i
		case 0:
			return -1
		}
	}
}

// lookup returns the value at p and whether p is in the table.
func (t *liveTable[V]) lookup(p DevicePtr) (V, bool) {
	if i := t.find(p); i >= 0 {
		return t.slots[i].v, true
	}
	var zero V
	return zero, false
}

// put adds p, which must not be 0 nor in the table, with value v.
func (t *liveTable[V]) put(p DevicePtr, v V) {
	if (t.n+1)*4 > len(t.slots)*3 || (t.half && (t.n+1)*2 > len(t.slots)) {
		t.grow()
	}
	mask := len(t.slots) - 1
	i := t.home(p)
	for t.slots[i].p != 0 {
		i = (i + 1) & mask
	}
	t.slots[i] = liveEntry[V]{p: p, v: v}
	t.n++
}

// grow doubles the table (8 slots at first) and re-inserts every entry.
func (t *liveTable[V]) grow() {
	old := t.slots
	size := max(8, 2*len(old))
	t.slots = make([]liveEntry[V], size)
	t.shift = 64
	for s := size; s > 1; s >>= 1 {
		t.shift--
	}
	t.n = 0
	for i := range old {
		if e := &old[i]; e.p != 0 {
			t.put(e.p, e.v)
		}
	}
}

// delAt empties slot i (from find) and closes the gap: each entry of the probe run after it
// whose home slot is not cyclically in (gap, entry] moves back into the gap.
func (t *liveTable[V]) delAt(i int) {
	mask := len(t.slots) - 1
	for j := (i + 1) & mask; t.slots[j].p != 0; j = (j + 1) & mask {
		h := t.home(t.slots[j].p)
		if (i <= j && (h <= i || h > j)) || (i > j && h <= i && h > j) {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = liveEntry[V]{}
	t.n--
}

// len returns the number of entries.
func (t *liveTable[V]) len() int { return t.n }

// each calls f for every entry, in no particular order.
func (t *liveTable[V]) each(f func(p DevicePtr, v V)) {
	for i := range t.slots {
		if e := &t.slots[i]; e.p != 0 {
			f(e.p, e.v)
		}
	}
}

// check verifies the table: its count, and that every entry is found from its home slot (no
// empty slot lies between the two).
func (t *liveTable[V]) check() error {
	n := 0
	for i := range t.slots {
		p := t.slots[i].p
		if p == 0 {
			continue
		}
		n++
		if j := t.find(p); j != i {
			return errorf("live allocation %#x in slot %d is found at %d", uintptr(p), i, j)
		}
	}
	if n != t.n {
		return errorf("live table counts %d entries, holds %d", t.n, n)
	}
	return nil
}

// blockTable is the pool's live table: blocks by their address.
type blockTable struct{ t liveTable[*block] }

// get returns the block at p, or nil.
func (bt *blockTable) get(p DevicePtr) *block {
	b, _ := bt.t.lookup(p)
	return b
}

// at returns the slot of the block at p and the block; -1 and nil when p is not in the table.
// The slot stays valid until the table next changes.
func (bt *blockTable) at(p DevicePtr) (int, *block) {
	if i := bt.t.find(p); i >= 0 {
		return i, bt.t.slots[i].v
	}
	return -1, nil
}

// delAt removes the block in slot i (from at, the table unchanged since).
func (bt *blockTable) delAt(i int) { bt.t.delAt(i) }

// put adds b, whose address must not be in the table.
func (bt *blockTable) put(b *block) { bt.t.put(b.addr, b) }

// del removes the block at p, which must be in the table.
func (bt *blockTable) del(p DevicePtr) { bt.t.delAt(bt.t.find(p)) }

// len returns the number of blocks.
func (bt *blockTable) len() int { return bt.t.len() }

// each calls f for every block, in no particular order.
func (bt *blockTable) each(f func(*block)) { bt.t.each(func(_ DevicePtr, b *block) { f(b) }) }
