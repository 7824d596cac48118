package rmm

import "slices"

// streamSetMax bounds the entries of a streamSet; streams past it are found the slow way.
const streamSetMax = 256

// streamSet is a set of values keyed by stream id (StreamView.ID), published through an
// atomic.Pointer for the fast paths, which read it without a lock: the pool's per-stream caches,
// the arena's per-stream arenas and lazily recorded streams. It is never changed once published:
// with and without return changed copies, made under the lock that serialises the writers. The
// nil set is empty. Resources see few streams, so a copy per change costs little, and a binary
// search of a short slice finds a stream sooner than a map.
type streamSet[T any] struct {
	ids  []uint64 // ascending
	vals []T
}

// find returns the value for id.
func (p *streamSet[T]) find(id uint64) (v T, ok bool) {
	if p == nil {
		return v, false
	}
	ids := p.ids
	if len(ids) > 8 {
		return p.bisect(id)
	}
	// A scan of a few ids: no mispredicted branch of a bisection (W1 on one stream costs about
	// 1 ns less a pair over a pool on the host), and small enough to inline.
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

// bisect is find in a set of more than a few ids.
func (p *streamSet[T]) bisect(id uint64) (v T, ok bool) {
	ids := p.ids
	lo, hi := 0, len(ids)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if ids[m] < id {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if lo < len(ids) && ids[lo] == id {
		return p.vals[lo], true
	}
	return v, false
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
		return q
	}
	q.ids = slices.Insert(q.ids, i, id)
	q.vals = slices.Insert(q.vals, i, v)
	return q
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
	return &streamSet[T]{
		ids:  slices.Delete(slices.Clone(p.ids), i, i+1),
		vals: slices.Delete(slices.Clone(p.vals), i, i+1),
	}
}

// all returns the values, in ascending order of stream id (nil for the nil set). The caller must
// not change the slice.
func (p *streamSet[T]) all() []T {
	if p == nil {
		return nil
	}
	return p.vals
}
