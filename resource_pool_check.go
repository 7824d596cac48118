package rmm

import (
	"sort"
)

// PoolStats is a snapshot of a pool's state.
type PoolStats struct {
	PoolSize         int // bytes taken from the upstream
	PeakPoolSize     int // the most bytes held at once since the pool was made
	MaximumPoolSize  int // 0 when unbounded
	LiveBytes        int // bytes of live allocations, each rounded up to 256
	LiveAllocations  int
	FreeBytes        int // PoolSize - LiveBytes
	FreeBlocks       int
	LargestFreeBlock int // bytes; the largest free block in any one list or cache (a request up to the free bytes may still be served without growing, once other streams' lists are merged)
	UpstreamBlocks   int // allocations held from the upstream (expandable: chunks mapped)
	Streams          int // streams with a free list
	// CachedBlocks and CachedBytes are the free blocks held in the streams' caches, for reuse by
	// an allocation of the same size on the same stream (see PoolMemoryResource); they are
	// counted in FreeBlocks, FreeBytes, LargestFreeBlock and PerStream, and coalesce with their
	// neighbours when the pool would otherwise grow, or on Release.
	CachedBlocks, CachedBytes int
	// PerStream is each stream's free list, the default stream first, then in order of first use.
	PerStream []StreamFreeStats
	// Expandable pools: the address space reserved (bytes), and the holes left in it by chunks
	// given back (count and bytes); growth maps memory into holes before the end of the range.
	Reserved, Holes, HoleBytes int
}

// Stats returns the pool's figures. It costs O(s log n) for s streams and n free blocks (plus the
// number of holes of an expandable pool), with no scan of the blocks.
func (p *PoolMemoryResource) Stats() PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := PoolStats{
		PoolSize:        p.size,
		PeakPoolSize:    p.peakSize,
		MaximumPoolSize: p.maximum,
		LiveBytes:       p.liveBytes,
		LiveAllocations: p.live.len(),
		UpstreamBlocks:  len(p.upstreams),
		Streams:         len(p.lists),
	}
	cached := p.cachedByStream()
	for _, l := range p.lists {
		st.FreeBlocks += l.count
		if b := l.largest(); b != nil && b.size > st.LargestFreeBlock {
			st.LargestFreeBlock = b.size
		}
		s := l.stream
		if s.id == 0 {
			s = DefaultStream
		}
		c := cached[s.id]
		st.PerStream = append(st.PerStream, StreamFreeStats{Stream: s, FreeBlocks: l.count + c.blocks, FreeBytes: l.bytes + c.bytes})
	}
	for _, c := range p.cachesWithoutList(cached) {
		// A stream whose list was merged into another one's keeps its cache.
		st.PerStream = append(st.PerStream, StreamFreeStats{Stream: c.stream, FreeBlocks: c.blocks, FreeBytes: c.bytes})
	}
	for _, c := range cached {
		st.LiveAllocations += c.issued
		st.LiveBytes -= c.bytes
		st.FreeBlocks += c.blocks
		st.CachedBlocks += c.blocks
		st.CachedBytes += c.bytes
		st.LargestFreeBlock = max(st.LargestFreeBlock, c.largest)
	}
	st.FreeBytes = st.PoolSize - st.LiveBytes
	sort.SliceStable(st.PerStream, func(i, j int) bool { return st.PerStream[i].Stream.id == 0 && st.PerStream[j].Stream.id != 0 })
	if e := p.exp; e != nil {
		st.UpstreamBlocks = len(e.chunks)
		st.Reserved = e.reserved
		st.Holes = len(e.holes)
		for h := range e.holes {
			st.HoleBytes += h.size
		}
	}
	return st
}

// CheckInvariants verifies the pool's internal state and returns the first violation found: every
// free list is well formed (freeList.check: size classes of treaps ordered by (size, address),
// counts that match) and its blocks are free and name it; the live map holds exactly the allocated blocks, each 256-aligned and
// rounded; each upstream allocation is one chain of blocks linked to their address neighbours,
// covering it exactly, and together they hold every block; free bytes plus live bytes equal
// PoolSize; and no two neighbours are free in the same list (coalescing is complete). It first
// waits for growths, releases and cross-stream takes in flight to end. It takes O(n log n) time
// and is meant for tests.
func (p *PoolMemoryResource) CheckInvariants() (err error) {
	defer func() {
		if err != nil {
			err = errorf("PoolMemoryResource.CheckInvariants: %w", err)
		}
	}()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.quiesce() // blocks in flight between lists are in none
	all := map[DevicePtr]*block{}
	deps := map[*freeList]int{}
	freeBytes := 0
	for _, l := range p.lists {
		if p.byStream[l.stream.id] != l {
			return errorf("list of %v is not indexed by its stream", l.stream)
		}
		bytes := 0
		err := l.check(func(t *block) error {
			bytes += t.size
			if t.list != l || !t.free {
				return errorf("block %#x is in the free list of %v but names another list or is not free", uintptr(t.addr), l.stream)
			}
			if all[t.addr] != nil {
				return errorf("block %#x is indexed twice", uintptr(t.addr))
			}
			for _, o := range t.deps() {
				if o == l || p.byStream[o.stream.id] != o {
					return errorf("free block %#x of %v names its own list or a list the pool dropped (%v) among its deps", uintptr(t.addr), l.stream, o.stream)
				}
				deps[o]++
			}
			all[t.addr] = t
			return nil
		})
		if err != nil {
			return err
		}
		freeBytes += bytes
	}
	if p.exp != nil {
		for _, a := range p.exp.aliases {
			if a.b != nil && a.from != nil {
				deps[a.from]++ // a live stitched range names the list its chunks were lent out of
			}
		}
	}
	for _, l := range p.lists {
		if l.depRefs != deps[l] {
			return errorf("list of %v counts %d blocks naming it among their deps, %d do", l.stream, l.depRefs, deps[l])
		}
	}
	liveBytes, counted := 0, 0
	var liveErr error
	p.live.each(func(b *block) {
		counted++
		if liveErr == nil && p.live.get(b.addr) != b {
			liveErr = errorf("live block %#x is not found from its home slot", uintptr(b.addr))
		}
	})
	if liveErr != nil {
		return liveErr
	}
	if counted != p.live.len() {
		return errorf("live table counts %d blocks, holds %d", p.live.len(), counted)
	}
	var lives []*block
	stitched := 0 // live stitched blocks: outside every chain (resource_pool_stitch.go)
	p.live.each(func(b *block) { lives = append(lives, b) })
	for _, b := range lives {
		ptr := b.addr
		n, _ := alignSize(b.req())
		switch {
		case b.free || b.list != nil:
			return errorf("live block %#x is marked free or listed", uintptr(ptr))
		case b.size != n:
			return errorf("live block %#x of %s was asked for %d", uintptr(ptr), bytesText(b.size), b.req())
		case all[ptr] != nil:
			return errorf("block %#x is both free and live", uintptr(ptr))
		}
		all[ptr] = b
		liveBytes += b.size
		if b.stitched {
			stitched++
		}
	}
	held, err := p.checkCaches(all)
	if err != nil {
		return err
	}
	liveBytes += held
	if stitched > 0 && (p.exp == nil || p.exp.aliases == nil) {
		return errorf("%d stitched blocks in a pool that does not stitch", stitched)
	}
	lentSeen := map[*block]bool{}
	if p.exp != nil {
		for b := p.exp.head; b != nil; b = b.next {
			if b.lent {
				lentSeen[b] = true
			}
		}
		slack, err := p.checkStitches(lentSeen)
		if err != nil {
			return err
		}
		liveBytes += slack // a live stitched block holds the whole of its chunks
	}
	if liveBytes != p.liveBytes {
		return errorf("live bytes counted %d, sum %d", p.liveBytes, liveBytes)
	}
	if freeBytes+liveBytes != p.size {
		return errorf("free %d + live %d bytes != pool size %d", freeBytes, liveBytes, p.size)
	}
	if p.exp != nil {
		return p.checkExpandable(all, stitched)
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
			return errorf("no block starts the upstream allocation %#x", uintptr(a))
		}
		if b.prev != nil {
			return errorf("the first block of upstream allocation %#x has a previous neighbour", uintptr(a))
		}
		covered := 0
		for ; b != nil; b = b.next {
			visited++
			if b.addr%Alignment != 0 || b.size <= 0 {
				return errorf("block %#x of %s is not 256-aligned", uintptr(b.addr), bytesText(b.size))
			}
			if all[b.addr] != b {
				return errorf("block %#x is linked but neither free in a list nor live", uintptr(b.addr))
			}
			covered += b.size
			if nx := b.next; nx != nil {
				if nx.prev != b || nx.addr != b.end() {
					return errorf("blocks %#x and %#x are badly linked", uintptr(b.addr), uintptr(nx.addr))
				}
				if adjacentUncoalesced(b, nx) {
					return errorf("free blocks %#x and %#x are adjacent but not coalesced", uintptr(b.addr), uintptr(nx.addr))
				}
			}
		}
		if covered != size {
			return errorf("upstream allocation %#x of %s is covered by %s of blocks", uintptr(a), bytesText(size), bytesText(covered))
		}
	}
	if visited != len(all) {
		return errorf("%d blocks, %d of them in an upstream allocation's chain", len(all), visited)
	}
	if total != p.size {
		return errorf("upstream blocks total %s, pool size %d", bytesText(total), p.size)
	}
	return nil
}

// checkExpandable verifies an expandable pool's chain: one run of blocks from the reservation's
// base to top, each free, live or a hole, holes never adjacent, the chunks exactly the mapped
// (non-hole) ranges, their sizes summing to PoolSize.
func (p *PoolMemoryResource) checkExpandable(all map[DevicePtr]*block, stitched int) error {
	e := p.exp
	if (e.head == nil) != (e.tail == nil) || (e.head == nil && e.top != e.base) {
		return errorf("empty chain with head %p, tail %p, top %#x (base %#x)", e.head, e.tail, uintptr(e.top), uintptr(e.base))
	}
	if e.top > e.base+DevicePtr(e.reserved) {
		return errorf("top %#x is past the reservation [%#x, +%d)", uintptr(e.top), uintptr(e.base), e.reserved)
	}
	visited, holes, mapped := 0, 0, 0
	var mappedRanges [][2]DevicePtr
	at := e.base
	var last *block
	for b := e.head; b != nil; b = b.next {
		if b.addr != at || b.size <= 0 || b.addr%Alignment != 0 {
			return errorf("block %#x of %s found where %#x was expected", uintptr(b.addr), bytesText(b.size), uintptr(at))
		}
		if b.prev != last {
			return errorf("block %#x has a wrong previous neighbour", uintptr(b.addr))
		}
		hole := isHole(b)
		if hole {
			holes++
			if _, ok := e.holes[b]; !ok {
				return errorf("hole %#x is not indexed", uintptr(b.addr))
			}
			if last != nil && isHole(last) {
				return errorf("holes %#x and %#x are adjacent", uintptr(last.addr), uintptr(b.addr))
			}
			if b.addr%DevicePtr(e.gran) != 0 || b.size%e.gran != 0 {
				return errorf("hole %#x of %s is off the granularity %d", uintptr(b.addr), bytesText(b.size), e.gran)
			}
		} else {
			if b.lent {
				if b.free || b.list != nil || all[b.addr] != nil {
					return errorf("lent block %#x is free, listed or live", uintptr(b.addr))
				}
			} else {
				visited++
				if all[b.addr] != b {
					return errorf("block %#x is linked but neither free in a list nor live", uintptr(b.addr))
				}
			}
			mapped += b.size
			if n := len(mappedRanges); n > 0 && mappedRanges[n-1][1] == b.addr {
				mappedRanges[n-1][1] = b.end()
			} else {
				mappedRanges = append(mappedRanges, [2]DevicePtr{b.addr, b.end()})
			}
		}
		if last != nil && adjacentUncoalesced(last, b) {
			return errorf("free blocks %#x and %#x are adjacent but not coalesced", uintptr(last.addr), uintptr(b.addr))
		}
		at = b.end()
		last = b
	}
	if last != e.tail || at != e.top {
		return errorf("the chain ends at %#x, top is %#x", uintptr(at), uintptr(e.top))
	}
	if last != nil && isHole(last) {
		return errorf("the chain ends with a hole at %#x", uintptr(last.addr))
	}
	if holes != len(e.holes) {
		return errorf("%d holes in the chain, %d indexed", holes, len(e.holes))
	}
	if visited+stitched != len(all) {
		return errorf("%d blocks, %d of them in the chain and %d stitched", len(all), visited, stitched)
	}
	if mapped != p.size {
		return errorf("mapped blocks total %s, pool size %d", bytesText(mapped), p.size)
	}
	// The chunks, in address order, tile exactly the mapped ranges.
	ci := 0
	for _, r := range mappedRanges {
		for a := r[0]; a < r[1]; {
			if ci >= len(e.chunks) || e.chunks[ci].addr != a {
				return errorf("no chunk starts at mapped address %#x", uintptr(a))
			}
			a = e.chunks[ci].end()
			ci++
			if a > r[1] {
				return errorf("chunk ending %#x runs past the mapped range ending %#x", uintptr(a), uintptr(r[1]))
			}
		}
	}
	if ci != len(e.chunks) {
		return errorf("%d chunks, %d of them cover mapped blocks", len(e.chunks), ci)
	}
	return nil
}
