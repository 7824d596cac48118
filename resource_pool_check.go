package rmm

import (
	"fmt"
	"sort"
)

// PoolStats is a snapshot of a pool's state.
type PoolStats struct {
	PoolSize         int // bytes taken from the upstream
	MaximumPoolSize  int // 0 when unbounded
	LiveBytes        int // bytes of live allocations, each rounded up to 256
	LiveAllocations  int
	FreeBytes        int // PoolSize - LiveBytes
	FreeBlocks       int
	LargestFreeBlock int // bytes; the largest request that can be served without growing
	UpstreamBlocks   int // allocations held from the upstream
	Streams          int // streams with a free list
}

// Stats returns the pool's figures. It costs O(s log n) for s streams and n free blocks.
func (p *PoolMemoryResource) Stats() PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := PoolStats{
		PoolSize:        p.size,
		MaximumPoolSize: p.maximum,
		LiveBytes:       p.liveBytes,
		LiveAllocations: len(p.live),
		FreeBytes:       p.size - p.liveBytes,
		UpstreamBlocks:  len(p.upstreams),
		Streams:         len(p.lists),
	}
	for _, l := range p.lists {
		st.FreeBlocks += l.count
		if b := l.largest(); b != nil && b.size > st.LargestFreeBlock {
			st.LargestFreeBlock = b.size
		}
	}
	return st
}

// CheckInvariants verifies the pool's internal state and returns the first violation found: every
// free list is a well-formed treap ordered by (size, address) whose counts match; the address
// maps index exactly the free blocks; free and live blocks are 256-aligned, do not overlap and lie
// inside the upstream blocks, whose total is PoolSize; free bytes plus live bytes equal PoolSize;
// and no two free blocks of one list are adjacent within one upstream block (coalescing is
// complete). It takes O(n log n) time and is meant for tests.
func (p *PoolMemoryResource) CheckInvariants() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	type span struct {
		addr DevicePtr
		size int
		free bool
		list *freeList
	}
	var spans []span
	freeCount, freeBytes := 0, 0
	for _, l := range p.lists {
		if p.byStream[l.stream.id] != l {
			return fmt.Errorf("list of %v is not indexed by its stream", l.stream)
		}
		n, bytes := 0, 0
		var prev *block
		var err error
		var walk func(t *block, parentPrio uint32, root bool)
		walk = func(t *block, parentPrio uint32, root bool) {
			if t == nil || err != nil {
				return
			}
			if !root && t.prio > parentPrio {
				err = fmt.Errorf("treap heap order broken at block %#x", uintptr(t.addr))
				return
			}
			walk(t.left, t.prio, false)
			if prev != nil && !prev.less(t) {
				err = fmt.Errorf("treap of %v out of order: (%d, %#x) before (%d, %#x)", l.stream, prev.size, uintptr(prev.addr), t.size, uintptr(t.addr))
				return
			}
			prev = t
			n++
			bytes += t.size
			if t.list != l {
				err = fmt.Errorf("block %#x is in the treap of %v but names another list", uintptr(t.addr), l.stream)
			}
			if p.byStart[t.addr] != t || p.byEnd[t.end()] != t {
				err = fmt.Errorf("block %#x (%d bytes) is not indexed by its start and end", uintptr(t.addr), t.size)
			}
			spans = append(spans, span{t.addr, t.size, true, l})
			walk(t.right, t.prio, false)
		}
		walk(l.root, 0, true)
		if err != nil {
			return err
		}
		if n != l.count || bytes != l.bytes {
			return fmt.Errorf("list of %v counts %d blocks / %d bytes, holds %d / %d", l.stream, l.count, l.bytes, n, bytes)
		}
		freeCount += n
		freeBytes += bytes
	}
	if len(p.byStart) != freeCount || len(p.byEnd) != freeCount {
		return fmt.Errorf("address maps hold %d/%d entries for %d free blocks", len(p.byStart), len(p.byEnd), freeCount)
	}
	liveBytes := 0
	for ptr, size := range p.live {
		n, _ := alignSize(size)
		liveBytes += n
		spans = append(spans, span{ptr, n, false, nil})
	}
	if liveBytes != p.liveBytes {
		return fmt.Errorf("live bytes counted %d, sum %d", p.liveBytes, liveBytes)
	}
	if freeBytes+liveBytes != p.size {
		return fmt.Errorf("free %d + live %d bytes != pool size %d", freeBytes, liveBytes, p.size)
	}
	type up struct {
		addr DevicePtr
		size int
	}
	ups := make([]up, 0, len(p.upstreams))
	total := 0
	for a, n := range p.upstreams {
		ups = append(ups, up{a, n})
		total += n
	}
	if total != p.size {
		return fmt.Errorf("upstream blocks total %d bytes, pool size %d", total, p.size)
	}
	sort.Slice(ups, func(i, j int) bool { return ups[i].addr < ups[j].addr })
	sort.Slice(spans, func(i, j int) bool { return spans[i].addr < spans[j].addr })
	u := 0
	for i, s := range spans {
		if s.addr%Alignment != 0 || s.size <= 0 || s.size%Alignment != 0 && !s.free {
			return fmt.Errorf("block %#x of %d bytes is not 256-aligned", uintptr(s.addr), s.size)
		}
		for u < len(ups) && ups[u].addr+DevicePtr(ups[u].size) <= s.addr {
			u++
		}
		if u == len(ups) || s.addr < ups[u].addr || s.addr+DevicePtr(s.size) > ups[u].addr+DevicePtr(ups[u].size) {
			return fmt.Errorf("block %#x of %d bytes is not inside one upstream block", uintptr(s.addr), s.size)
		}
		if i > 0 {
			q := spans[i-1]
			if q.addr+DevicePtr(q.size) > s.addr {
				return fmt.Errorf("blocks %#x (%d bytes) and %#x overlap", uintptr(q.addr), q.size, uintptr(s.addr))
			}
			if q.free && s.free && q.list == s.list && q.addr+DevicePtr(q.size) == s.addr {
				if _, head := p.upstreams[s.addr]; !head {
					return fmt.Errorf("free blocks %#x and %#x of one list are adjacent but not coalesced", uintptr(q.addr), uintptr(s.addr))
				}
			}
		}
	}
	return nil
}
