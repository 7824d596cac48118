package rmm

import "fmt"

// The arena's index of live allocations: pointer → (superblock, size asked). Blocks up to 1 MiB
// are sharded by the 1 MiB range of the arena they lie in (liveShard), each shard under its own
// lock; blocks above 1 MiB are in one table under the global arena's lock. Each is an
// open-addressing hash table with linear probing. A lookup hashes the pointer once and reads, as
// a rule, one cache line; a deletion shifts the entries after it back instead of leaving
// tombstones, so probes stay short however long the arena lives.

// arenaLiveHash mixes a 256-aligned pointer (Fibonacci hashing): its top bits choose the slot.
func arenaLiveHash(p DevicePtr) uint64 { return uint64(p>>8) * 0x9e3779b97f4a7c15 }

// arenaLiveEntry is a slot of an arenaLiveTable; p == 0 marks it empty (no allocation is at 0).
type arenaLiveEntry struct {
	p DevicePtr
	arenaLive
}

// arenaLiveTable is a table of live allocations. Its length is 0 or a power of two, at most 3/4
// full, or half full when half is set.
type arenaLiveTable struct {
	slots []arenaLiveEntry
	n     int
	shift uint // 64 - log2(len(slots))
	// half keeps the table at most half full: shorter probe runs, so that a deletion moves fewer
	// entries, for twice the slots. The table of large blocks (at most one per MiB of the arena)
	// sets it; the shards, which may hold millions of small blocks, do not.
	half bool
}

// home returns the slot p's probe starts at.
func (t *arenaLiveTable) home(p DevicePtr) int {
	return int(arenaLiveHash(p) >> t.shift)
}

// find returns the slot holding p, or -1.
func (t *arenaLiveTable) find(p DevicePtr) int {
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

// put adds p, which must not be in the table.
func (t *arenaLiveTable) put(p DevicePtr, v arenaLive) {
	if (t.n+1)*4 > len(t.slots)*3 || (t.half && (t.n+1)*2 > len(t.slots)) {
		t.grow()
	}
	mask := len(t.slots) - 1
	i := t.home(p)
	for t.slots[i].p != 0 {
		i = (i + 1) & mask
	}
	t.slots[i] = arenaLiveEntry{p: p, arenaLive: v}
	t.n++
}

// grow doubles the table (8 slots at first) and re-inserts every entry.
func (t *arenaLiveTable) grow() {
	old := t.slots
	size := max(8, 2*len(old))
	t.slots = make([]arenaLiveEntry, size)
	t.shift = 64
	for s := size; s > 1; s >>= 1 {
		t.shift--
	}
	t.n = 0
	for i := range old {
		if e := &old[i]; e.p != 0 {
			t.put(e.p, e.arenaLive)
		}
	}
}

// del empties slot i (from find) and closes the gap: each entry of the probe run after it whose
// home slot is not cyclically after the gap moves back into it.
func (t *arenaLiveTable) del(i int) {
	mask := len(t.slots) - 1
	for j := (i + 1) & mask; t.slots[j].p != 0; j = (j + 1) & mask {
		h := t.home(t.slots[j].p)
		// Entry j may move to i unless its home lies in (i, j], cyclically.
		if (i <= j && (h <= i || h > j)) || (i > j && h <= i && h > j) {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = arenaLiveEntry{}
	t.n--
}

// each calls f for every entry.
func (t *arenaLiveTable) each(f func(p DevicePtr, v arenaLive)) {
	for i := range t.slots {
		if e := &t.slots[i]; e.p != 0 {
			f(e.p, e.arenaLive)
		}
	}
}

// check verifies the table: its count, and that every entry is found from its home slot (no
// empty slot lies between the two).
func (t *arenaLiveTable) check() error {
	n := 0
	for i := range t.slots {
		p := t.slots[i].p
		if p == 0 {
			continue
		}
		n++
		if j := t.find(p); j != i {
			return fmt.Errorf("live allocation %#x in slot %d is found at %d", uintptr(p), i, j)
		}
	}
	if n != t.n {
		return fmt.Errorf("live table counts %d entries, holds %d", t.n, n)
	}
	return nil
}
