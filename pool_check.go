package rmm

import (
	"sort"
)

// PoolStats is a snapshot of a pool's state.
type PoolStats struct {
	PoolSize     int // bytes taken from the upstream
	PeakPoolSize int // the most bytes held at once since the pool was made
	// MaximumPoolSize is PoolOptions.MaximumPoolSize, 0 when unbounded. An expandable pool is
	// never unbounded: it reports the size of its reserved range, the maximum asked or by default
	// the device's total memory (the host's without a GPU; over a SimulatedMemoryResource, its
	// capacity), rounded up to the granularity.
	MaximumPoolSize  int
	LiveBytes        int // bytes of live allocations, each rounded up to 256
	LiveAllocations  int
	FreeBytes        int // PoolSize - LiveBytes
	FreeBlocks       int
	LargestFreeBlock int // bytes; the largest free block in any one list or cache (a request up to the free bytes may still be served without growing, once other streams' lists are merged)
	UpstreamBlocks   int // allocations held from the upstream (expandable: chunks mapped)
	Streams          int // streams with a free list
	// CachedBlocks and CachedBytes are the free blocks held in the streams' caches: a small freed
	// block (at most 1 MiB, of a size its stream recently asked for) stays in its stream's cache,
	// counted as free (in FreeBlocks, FreeBytes, LargestFreeBlock and PerStream) but not
	// coalesced, until an allocation on that stream that the cache cannot serve, the pool's
	// growth, Release or Close returns it to the free lists.
	CachedBlocks, CachedBytes int
	// PerStream is each stream's free list, the default stream first, then in order of first use.
	PerStream []StreamFreeStats
	// Expandable pools: the address space reserved (bytes), and the holes left in it by chunks
	// given back (count and bytes); growth maps memory into holes before the end of the range.
	Reserved, Holes, HoleBytes int
	// VMM counts an expandable pool's driver calls and stitched ranges since it was made; zero
	// for librmm's pool.
	VMM VMMStats
}

// VMMStats counts what an expandable pool asked of the driver's virtual memory management since
// the pool was made: each call that succeeded, once (a failed call is not counted). Over host
// memory or a [SimulatedMemoryResource] the same calls are counted on the host's stand-ins.
type VMMStats struct {
	Creates   int // cuMemCreate: physical handles made
	Maps      int // cuMemMap: handles mapped, in the pool's range or in a stitched range
	SetAccess int // cuMemSetAccess calls; one covers the adjacent mappings made together
	Unmaps    int // cuMemUnmap calls; one may unmap several adjacent mappings
	Releases  int // cuMemRelease: handles given back
	// Reserves and AddressFrees count cuMemAddressReserve and cuMemAddressFree: the pool's range
	// and one per stitched range. AddressReserved is the address space held now, in bytes.
	Reserves, AddressFrees, AddressReserved int
	// StitchedRanges counts the ranges a stitching pool ([PoolOptions.Stitch]) has made,
	// StitchedKept those mapped now (serving an allocation or kept for reuse), StitchedEvicted
	// those unmapped since (past the number kept, by Release, or before a handle they map went
	// back).
	StitchedRanges, StitchedKept, StitchedEvicted int
}

// Stats returns the pool's figures. It costs O(s log n) for s streams and n free blocks (plus the
// number of holes of an expandable pool), with no scan of the blocks.
func (p *PoolMemoryResource) Stats() PoolStats {
	if p.backing == nil {
		return PoolStats{} // not made by NewPoolMemoryResource: nothing held
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	st := PoolStats{
		PoolSize:        p.size,
		PeakPoolSize:    p.peakSize,
		MaximumPoolSize: p.maximum,
		LiveBytes:       p.liveBytes,
		LiveAllocations: p.live.len(),
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
	p.backing.stats(&st)
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
	if p.backing == nil {
		return errNotMade("CheckInvariants")
	}
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
	served := 0 // live blocks the backing served: outside every chain (poolBacking.freeServed)
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
		if b.served {
			served++
		}
	}
	held, err := p.checkCaches(all)
	if err != nil {
		return err
	}
	liveBytes += held
	slack, err := p.backing.checkServed(served, deps)
	if err != nil {
		return err
	}
	liveBytes += slack // a served block may hold more than its size
	for _, l := range p.lists {
		if l.depRefs != deps[l] {
			return errorf("list of %v counts %d blocks naming it among their deps, %d do", l.stream, l.depRefs, deps[l])
		}
	}
	if liveBytes != p.liveBytes {
		return errorf("live bytes counted %d, sum %d", p.liveBytes, liveBytes)
	}
	if freeBytes+liveBytes != p.size {
		return errorf("free %d + live %d bytes != pool size %d", freeBytes, liveBytes, p.size)
	}
	return p.backing.checkChain(all, served)
}
