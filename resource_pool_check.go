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
// free list is a well-formed treap ordered by (size, address) whose counts match and whose blocks
// are free and name it; the live map holds exactly the allocated blocks, each 256-aligned and
// rounded; each upstream allocation is one chain of blocks linked to their address neighbours,
// covering it exactly, and together they hold every block; free bytes plus live bytes equal
// PoolSize; and no two neighbours are free in the same list (coalescing is complete). It takes
// O(n log n) time and is meant for tests.
func (p *PoolMemoryResource) CheckInvariants() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	all := map[DevicePtr]*block{}
	freeBytes := 0
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
			if t.list != l || !t.free {
				err = fmt.Errorf("block %#x is in the treap of %v but names another list or is not free", uintptr(t.addr), l.stream)
			}
			if all[t.addr] != nil {
				err = fmt.Errorf("block %#x is indexed twice", uintptr(t.addr))
			}
			all[t.addr] = t
			walk(t.right, t.prio, false)
		}
		walk(l.root, 0, true)
		if err != nil {
			return err
		}
		if n != l.count || bytes != l.bytes {
			return fmt.Errorf("list of %v counts %d blocks / %d bytes, holds %d / %d", l.stream, l.count, l.bytes, n, bytes)
		}
		freeBytes += bytes
	}
	liveBytes := 0
	for ptr, b := range p.live {
		n, _ := alignSize(b.req)
		switch {
		case b.addr != ptr:
			return fmt.Errorf("live block %#x is indexed at %#x", uintptr(b.addr), uintptr(ptr))
		case b.free || b.list != nil:
			return fmt.Errorf("live block %#x is marked free or listed", uintptr(ptr))
		case b.size != n:
			return fmt.Errorf("live block %#x of %d bytes was asked for %d", uintptr(ptr), b.size, b.req)
		case all[ptr] != nil:
			return fmt.Errorf("block %#x is both free and live", uintptr(ptr))
		}
		all[ptr] = b
		liveBytes += b.size
	}
	if liveBytes != p.liveBytes {
		return fmt.Errorf("live bytes counted %d, sum %d", p.liveBytes, liveBytes)
	}
	if freeBytes+liveBytes != p.size {
		return fmt.Errorf("free %d + live %d bytes != pool size %d", freeBytes, liveBytes, p.size)
	}
	total, visited := 0, 0
	ups := make([]DevicePtr, 0, len(p.upstreams))
	for a := range p.upstreams {
		ups = append(ups, a)
	}
	sort.Slice(ups, func(i, j int) bool { return ups[i] < ups[j] })
	for _, a := range ups {
		size := p.upstreams[a]
		total += size
		b := all[a]
		if b == nil {
			return fmt.Errorf("no block starts the upstream allocation %#x", uintptr(a))
		}
		if b.prev != nil {
			return fmt.Errorf("the first block of upstream allocation %#x has a previous neighbour", uintptr(a))
		}
		covered := 0
		for ; b != nil; b = b.next {
			visited++
			if b.addr%Alignment != 0 || b.size <= 0 {
				return fmt.Errorf("block %#x of %d bytes is not 256-aligned", uintptr(b.addr), b.size)
			}
			if all[b.addr] != b {
				return fmt.Errorf("block %#x is linked but neither free in a list nor live", uintptr(b.addr))
			}
			covered += b.size
			if nx := b.next; nx != nil {
				if nx.prev != b || nx.addr != b.end() {
					return fmt.Errorf("blocks %#x and %#x are badly linked", uintptr(b.addr), uintptr(nx.addr))
				}
				if b.free && nx.free && b.list == nx.list {
					return fmt.Errorf("free blocks %#x and %#x of one list are adjacent but not coalesced", uintptr(b.addr), uintptr(nx.addr))
				}
			}
		}
		if covered != size {
			return fmt.Errorf("upstream allocation %#x of %d bytes is covered by %d bytes of blocks", uintptr(a), size, covered)
		}
	}
	if visited != len(all) {
		return fmt.Errorf("%d blocks, %d of them in an upstream allocation's chain", len(all), visited)
	}
	if total != p.size {
		return fmt.Errorf("upstream blocks total %d bytes, pool size %d", total, p.size)
	}
	return nil
}
