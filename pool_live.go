package rmm

// blockTable is the pool's index of live blocks by address: an open-addressing hash table with
// linear probing (Fibonacci hashing of the 256-aligned address), which reads as a rule one cache
// line per lookup where a Go map reads several. Deletion shifts the entries after the freed slot
// back instead of leaving tombstones, so probes stay short however long the pool lives. At most
// 3/4 full; grows by doubling.
type blockTable struct {
	slots []*block
	n     int
	shift uint // 64 - log2(len(slots))
}

func (t *blockTable) home(p DevicePtr) int {
	return int(uint64(p>>8) * 0x9e3779b97f4a7c15 >> t.shift)
}

// get returns the live block at p, or nil.
func (t *blockTable) get(p DevicePtr) *block {
	if t.n == 0 {
		return nil
	}
	mask := len(t.slots) - 1
	for i := t.home(p); ; i = (i + 1) & mask {
		b := t.slots[i]
		if b == nil || b.addr == p {
			return b
		}
	}
}

// put adds b, whose address must not be in the table.
func (t *blockTable) put(b *block) {
	if (t.n+1)*4 > len(t.slots)*3 {
		t.grow()
	}
	mask := len(t.slots) - 1
	i := t.home(b.addr)
	for t.slots[i] != nil {
		i = (i + 1) & mask
	}
	t.slots[i] = b
	t.n++
}

func (t *blockTable) grow() {
	old := t.slots
	size := max(16, 2*len(old))
	t.slots = make([]*block, size)
	t.shift = 64
	for s := size; s > 1; s >>= 1 {
		t.shift--
	}
	t.n = 0
	for _, b := range old {
		if b != nil {
			t.put(b)
		}
	}
}

// del removes the block at p, which must be in the table.
func (t *blockTable) del(p DevicePtr) {
	mask := len(t.slots) - 1
	i := t.home(p)
	for t.slots[i].addr != p {
		i = (i + 1) & mask
	}
	// Close the gap: each entry of the probe run after i whose home is not cyclically in (i, j]
	// moves back into it.
	for j := (i + 1) & mask; t.slots[j] != nil; j = (j + 1) & mask {
		h := t.home(t.slots[j].addr)
		if (i <= j && (h <= i || h > j)) || (i > j && h <= i && h > j) {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = nil
	t.n--
}

// len returns the number of live blocks.
func (t *blockTable) len() int { return t.n }

// each calls f for every live block, in no particular order.
func (t *blockTable) each(f func(*block)) {
	for _, b := range t.slots {
		if b != nil {
			f(b)
		}
	}
}
