package rmm

import "slices"

// streamSetMax bounds the entries of a streamSet; streams past it are found the slow way.
const streamSetMax = 256

// streamSet is a set of values keyed by stream id (StreamView.ID), published through an
// atomic.Pointer for the fast paths, which read it without a lock: the pool's per-stream caches,
// the arena's per-stream arenas and lazily recorded streams. It is never changed once published:
// with and without return changed copies, made under the lock that serialises the writers. The
// nil set is empty. Resources see few streams, so a copy per change costs little. A set of a few
// streams is scanned; a larger one is found through a hash index, as a bisection's mispredicted
// branches cost more than the lookup itself (W3 at 16 goroutines, one stream each: the bisection
// of 17 ids took a tenth of the time of a pair on the host).
type streamSet[T any] struct {
	ids  []uint64 // ascending
	vals []T
	// idx: with more than streamSetScan ids, the index into ids of each id, by the hash of the id
	// (open addressing, linear probing, -1 empty); at most half full.
	idx   []int32
	shift uint
}

// streamSetScan is the most ids a set scans rather than indexes.
const streamSetScan = 8

// find returns the value for id.
func (p *streamSet[T]) find(id uint64) (v T, ok bool) {
	if p == nil {
		return v, false
	}
	ids := p.ids
	if len(ids) > streamSetScan {
		return p.lookup(id)
	}
	// A scan of a few ids: no mispredicted branch of a bisection on the path of every
	// allocation (BENCHMARKS.md, "W1"), and small enough to inline.
	for i, x := range ids {
		if x >= id {
			if x == id {
				return p.vals[i], true
			}
			break
		}
	}
	return v, false
}

// streamSetHash mixes a stream id: its top bits choose the index slot.
func streamSetHash(id uint64) uint64 { return id * 0x9e3779b97f4a7c15 }

// lookup is find in a set of more than streamSetScan ids.
func (p *streamSet[T]) lookup(id uint64) (v T, ok bool) {
	mask := len(p.idx) - 1
	for h := int(streamSetHash(id) >> p.shift); ; h = (h + 1) & mask {
		j := p.idx[h]
		if j < 0 {
			return v, false
		}
		if p.ids[j] == id {
			return p.vals[j], true
		}
	}
}

// indexed returns p with its hash index built (p's ids and vals are p's own).
func (p *streamSet[T]) indexed() *streamSet[T] {
	if len(p.ids) <= streamSetScan {
		return p
	}
	n := 1
	for n < 2*len(p.ids) {
		n <<= 1
	}
	p.idx = make([]int32, n)
	for i := range p.idx {
		p.idx[i] = -1
	}
	p.shift = 64
	for m := n; m > 1; m >>= 1 {
		p.shift--
	}
	for j, id := range p.ids {
		h := int(streamSetHash(id) >> p.shift)
		for p.idx[h] >= 0 {
			h = (h + 1) & (n - 1)
		}
		p.idx[h] = int32(j)
	}
	return p
}

// with returns p with id set to v; p itself when it holds streamSetMax entries already
// (the caller's readers then miss id and take their slow path).
func (p *streamSet[T]) with(id uint64, v T) *streamSet[T] {
	q := &streamSet[T]{}
	if p != nil {
		if len(p.ids) >= streamSetMax {
			return p
		}
		q.ids, q.vals = slices.Clone(p.ids), slices.Clone(p.vals)
	}
	i, found := slices.BinarySearch(q.ids, id)
	if found {
		q.vals[i] = v
		return q.indexed()
	}
	q.ids = slices.Insert(q.ids, i, id)
	q.vals = slices.Insert(q.vals, i, v)
	return q.indexed()
}

// without returns p without id: p itself when id is not in it, nil when nothing is left.
func (p *streamSet[T]) without(id uint64) *streamSet[T] {
	if p == nil {
		return nil
	}
	i, found := slices.BinarySearch(p.ids, id)
	if !found {
		return p
	}
	if len(p.ids) == 1 {
		return nil
	}
	q := &streamSet[T]{
		ids:  slices.Delete(slices.Clone(p.ids), i, i+1),
		vals: slices.Delete(slices.Clone(p.vals), i, i+1),
	}
	return q.indexed()
}

// all returns the values, in ascending order of stream id (nil for the nil set). The caller must
// not change the slice.
func (p *streamSet[T]) all() []T {
	if p == nil {
		return nil
	}
	return p.vals
}
