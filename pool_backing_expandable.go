package rmm

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
)

// The expandable pool (PoolOptions.Expandable). Its memory is one range of address space
// reserved at construction for the maximum size; growing creates a chunk of physical memory and
// maps it right after what is already mapped (or into a hole left by Release), so that the chain
// of blocks covers one contiguous range and free neighbours coalesce whatever growth step they
// came from. Every block of the pool is in that one chain — allocated, free, or a hole: a range
// whose chunk was given back, which is never free and never coalesces with a free block.

// vmChunk is one mapped physical allocation of an expandable pool.
type vmChunk struct {
	addr DevicePtr
	size int
	h    vmmHandle
}

func (c vmChunk) end() DevicePtr { return c.addr + DevicePtr(c.size) }

// expandable is the backing of an expandable pool (PoolOptions.Expandable without Stitch).
type expandable struct {
	noServing
	p        *PoolMemoryResource
	st       *stitching // the stitching backing that wraps this one; nil when not stitching
	vm       vmm        // tally, over the driver or its stand-in
	tally    *vmmTally  // the calls made, for PoolStats.VMM
	source   string     // where the memory comes from, for messages: "the device", "the host", ...
	gran     int
	base     DevicePtr // the reservation
	reserved int       // bytes reserved: the maximum size
	top      DevicePtr // end of the chain (p.head, p.tail: its blocks)
	chunks   []vmChunk // mapped, by address
	holes    map[*block]struct{}

	// Growths map handles of at most piece bytes, or of k/pieceFrac, or of reqPiece, where that
	// is more, for a growth of k (pieceSize); 0: one handle per growth.
	piece     int
	pieceFrac int
	pieceReq  int // with piece: handles of at least n/pieceReq for an n-byte request (noteRequest); 0: none
	pieceCap  int // with pieceReq: those at most the pool's size/pieceCap; 0: no bound
	reqPiece  int // the least piece of the growth being mapped (noteRequest; busy token held)
	// Over host memory, stitching: each handle is a memfd. fdPiece is the least handle that keeps
	// the pool within maxHandles at its maximum size; growths are rounded up to it, and a growth
	// that would hold more than maxHandles handles fails as out of memory. 0: no such bound.
	fdPiece, maxHandles int
	minChunk            int // the least growth (expandableMinChunk unless poolTuning.minGrowth)
	growthDiv           int // a growth maps at least size/growthDiv (expandableGrowthDivisor unless poolTuning.growthDivisor)
	threshold           int // ReleaseThreshold; 0: never trim by itself
}

// newExpandablePool makes an expandable pool over vm (nil: the one upstream names, see vmmFor),
// tuned by tune (PoolOptions.Stitch sets what tune leaves zero to stitchTuning's values): its
// backing is an expandable, or a stitching wrapping one. upstream is the opts' upstream as the
// caller gave it (nil allowed).
func newExpandablePool(upstream MemoryResource, vm vmm, o PoolOptions, tune poolTuning) (*PoolMemoryResource, error) {
	var dev Device
	fds := false // pieces are memfds of this process's (vmmFor's host memory, stitching)
	if vm == nil {
		var err error
		if vm, dev, err = vmmFor(upstream, o.Stitch || tune.stitchPiece > 0); err != nil {
			return nil, err
		}
		hv, ok := vm.(*hostVMM)
		fds = ok && hv.aliasing
	} else {
		dev = DeviceOf(upstream)
	}
	if o.Exportable {
		if err := setVMMExportable(vm); err != nil {
			return nil, err
		}
	}
	if upstream == nil {
		upstream = CurrentDeviceResource()
	}
	if o.Stitch && tune.stitchPiece == 0 {
		tune.stitchPiece, tune.stitchRest = stitchTuning.stitchPiece, stitchTuning.stitchRest
		tune.stitchFrac = cmp.Or(tune.stitchFrac, stitchTuning.stitchFrac)
		tune.stitchReqDiv = cmp.Or(tune.stitchReqDiv, stitchTuning.stitchReqDiv)
		tune.stitchPieceCap = cmp.Or(tune.stitchPieceCap, stitchTuning.stitchPieceCap)
	}
	if tune.stitchPiece < 0 || tune.stitchMin < 0 || tune.stitchKeep < 0 || tune.stitchFrac < 0 || tune.stitchReqDiv < 0 || tune.stitchPieceCap < 0 || tune.minGrowth < 0 || tune.growthDivisor < 0 {
		return nil, errorf("NewPoolMemoryResource: negative stitching option: %w", ErrInvalidArgument)
	}
	e, maximum, err := newExpandable(vm, dev, o.MaximumPoolSize, o.ReleaseThreshold)
	if err != nil {
		return nil, err
	}
	minChunk, growthDiv := expandableMinChunk, expandableGrowthDivisor
	if tune.stitchPiece > 0 {
		minChunk, growthDiv = stitchMinGrowth, stitchGrowthDivisor
	}
	e.minChunk, e.growthDiv = cmp.Or(tune.minGrowth, minChunk), cmp.Or(tune.growthDivisor, growthDiv)
	p, err := newPool(upstream, maximum, o, dev)
	if err != nil {
		vm.free(e.base, e.reserved)
		return nil, err
	}
	e.p = p
	p.backing, p.chained, p.name = e, true, "PoolMemoryResource (expandable)"
	if tune.stitchPiece > 0 {
		e.piece, _ = alignUpChecked(tune.stitchPiece, e.gran)
		if budget := hostDescriptorBudget(); fds && budget > 0 {
			// A memfd per piece: at its maximum size the pool holds at most budget of them.
			if pc, ok := alignUpChecked((e.reserved+budget-1)/budget, e.gran); ok {
				e.piece = max(e.piece, pc)
				e.fdPiece, e.maxHandles = pc, budget
			}
		}
		e.pieceFrac = tune.stitchFrac
		e.pieceReq = tune.stitchReqDiv
		e.pieceCap = tune.stitchPieceCap
		p.backing = newStitching(e, tune)
		p.tailLast = true
		p.name = "PoolMemoryResource (stitching)"
	}
	e.resetTrim(0)
	if o.InitialPoolSize > 0 {
		p.mu.Lock()
		defer p.mu.Unlock()
		l, err := p.listFor(DefaultStream)
		if err == nil {
			var b *block
			p.busy = true
			if b, err = e.growExpandable(o.InitialPoolSize, l, 1); err == nil {
				if b == nil {
					err = errors.New("internal error: the initial chunk is smaller than the initial size")
				} else {
					p.freeInto(l, b)
				}
			}
			p.busy = false
		}
		if err != nil {
			e.releaseChunks(p.lists[0], -1, true)
			e.freeReservation()
			return nil, errorf("NewPoolMemoryResource: mapping the initial %s: %w", bytesText(o.InitialPoolSize), err)
		}
	}
	return p, nil
}

// grow maps memory for an n-byte request on l's stream (every other list merged into l and the
// caches flushed before). When the free bytes already hold the request, the pool is fragmented,
// not exhausted: it maps only what the request lacks beyond the free block at the end, but at
// least expandableFragmentedMin, as a growth step there would stay free beside the scattered free
// memory; the minimum keeps a run of such requests from mapping a sliver each. The price is more,
// smaller growths in a first pass (BENCHMARKS.md, the section on growth by what a fragmented
// pool lacks).
func (e *expandable) grow(n int, _ StreamView, l *freeList) (*block, error) {
	p := e.p
	exact := 0
	if p.size-p.liveBytes >= n {
		exact = expandableFragmentedMin
	}
	return e.growExpandable(n, l, exact)
}

// releaseMayHelp: an expandable pool stopped by its maximum gains from giving back only when it
// has holes. Growth fills a hole only together with the free blocks right next to it, and the
// free chunks given back between two holes (or between a hole and the end) merge them into one;
// without holes a chunk given back leaves a hole exactly where its free memory already was.
func (e *expandable) releaseMayHelp() bool { return len(e.holes) > 0 }

// release gives back (unmaps and releases) every chunk that lies wholly in free memory of def.
func (e *expandable) release(def *freeList, hold bool) error {
	return e.releaseChunks(def, -1, hold)
}

// releaseAfterClose gives back every chunk wholly free after a free that outlived Close, then
// the reservation once no chunk is left (pool locked throughout).
func (e *expandable) releaseAfterClose(*block) error {
	if err := e.releaseChunks(e.p.closedList, -1, true); err != nil {
		return err
	}
	return e.freeReservation()
}

// close frees the reservation once nothing is mapped (Close).
func (e *expandable) close() error { return e.freeReservation() }

func (e *expandable) stats(st *PoolStats) {
	st.UpstreamBlocks = len(e.chunks)
	st.Reserved = e.reserved
	e.tally.stats(&st.VMM)
	if e.st != nil {
		st.VMM.StitchedRanges = e.st.stitches
		st.VMM.StitchedKept = len(e.st.aliases)
		st.VMM.StitchedEvicted = e.st.evicted
	}
	st.Holes = len(e.holes)
	for h := range e.holes {
		st.HoleBytes += h.size
	}
}

func (e *expandable) exportIPC(ptr DevicePtr, n int) (*IPCHandle, error) {
	return e.exportVMM(ptr, n, nil)
}

// The chunk size: a growth maps what the request needs beyond the free block it extends, but at
// least a sixteenth of the pool and at least 32 MiB, at most 1 GiB unless the request needs more,
// rounded up to the granularity; one chunk (one physical allocation) per growth. (A fragmented
// pool, whose free bytes hold the request, maps only what it needs: see growAny.)
//
// Why: creating, mapping and granting access to a chunk costs about what cuMemAlloc costs for the
// same size, per mapping rather than per byte; so one chunk per growth keeps growth as cheap per
// byte as cuMemAlloc, and the step keeps the count of growths low while the unused tail stays
// under a sixteenth of the pool. Smaller chunks (many mappings per growth, so that Release could
// give back any free page) multiplied the growth calls and did not make the pools smaller
// (BENCHMARKS.md, "Growth of an expandable pool by one chunk, beside cuMemAlloc").
const (
	expandableGrowthDivisor = 16
	expandableMinChunk      = 32 << 20
	expandableMaxChunk      = 1 << 30
	// expandableFragmentedMin is the least a growth maps when the pool's free bytes already hold
	// the request (see growAny).
	expandableFragmentedMin = 8 << 20
)

// newExpandable reserves the range for an expandable pool of at most maximum bytes (0: the
// device's total memory) over vm, and returns it with the maximum rounded up to the granularity.
func newExpandable(vm vmm, dev Device, maximum, threshold int) (*expandable, int, error) {
	gran := vm.granularity()
	source := "the device"
	switch v := vm.(type) {
	case *simVMM:
		source = "the simulated memory"
		if maximum == 0 && v.limit > 0 {
			maximum = v.limit // the simulated capacity
		}
	case *hostVMM:
		source = "host memory"
	}
	if maximum == 0 {
		total, err := dev.TotalMemory()
		if err != nil {
			return nil, 0, errorf("NewPoolMemoryResource: expandable pool: the device's total memory: %w", err)
		}
		maximum = total
	}
	limit, ok := alignUpChecked(maximum, gran)
	if !ok {
		return nil, 0, errorf("NewPoolMemoryResource: MaximumPoolSize %d overflows when rounded up to the granularity %d: %w", maximum, gran, ErrInvalidArgument)
	}
	reserved := limit
	base, err := vm.reserve(reserved)
	if err != nil {
		return nil, 0, errorf("NewPoolMemoryResource: reserving %s of address space for the expandable pool: %w", bytesText(reserved), err)
	}
	// Counted from here on: the calls before (none) and the reservation itself.
	tally := &vmmTally{vmm: vm}
	tally.reserves.Store(1)
	tally.reservedNow.Store(int64(reserved))
	e := &expandable{vm: tally, tally: tally, source: source, gran: gran, base: base, reserved: reserved, top: base, holes: map[*block]struct{}{}, threshold: threshold}
	return e, limit, nil
}

// pieceSize is the size of the handles a growth of k bytes maps: when stitching, the stitch piece,
// or k/pieceFrac or the request's piece (noteRequest) where that is more; else k itself (one
// handle per growth).
func (e *expandable) pieceSize(k int) int {
	if e.piece == 0 {
		return k
	}
	piece := e.piece
	if e.pieceFrac > 0 {
		piece = max(piece, k/e.pieceFrac/e.gran*e.gran)
	}
	piece = e.fdRound(max(piece, e.reqPiece))
	return min(k, piece)
}

// fdRound rounds a growth of k bytes up to a multiple of fdPiece (when set), so that every handle
// it maps is at least fdPiece.
func (e *expandable) fdRound(k int) int {
	if e.fdPiece == 0 || k <= 0 {
		return k
	}
	if r, ok := alignUpChecked(k, e.fdPiece); ok {
		return r
	}
	return k
}

// noteRequest sets the least piece of the growth about to be mapped for an n-byte request: n/pieceReq,
// but at most the pool's size/pieceCap, rounded down to the granularity (pool locked, busy token
// held). See stitchReqDivDefault.
func (e *expandable) noteRequest(n int) {
	e.reqPiece = 0
	if e.pieceReq > 0 {
		r := n / e.pieceReq
		if e.pieceCap > 0 {
			r = min(r, e.p.size/e.pieceCap)
		}
		e.reqPiece = r / e.gran * e.gran
	}
}

func alignUpChecked(n, a int) (int, bool) {
	r := (n + a - 1) / a * a
	return r, r >= n
}

// resetTrim sets the free-bytes level at which Deallocate next trims: the threshold plus one
// minimum chunk, so that a pool hovering at its threshold does not synchronise at every free.
func (e *expandable) resetTrim(free int) {
	if e.threshold <= 0 {
		e.p.trimAt = 0
		return
	}
	e.p.trimAt = max(e.threshold, free) + max(e.gran, expandableMinChunk)
}

// chunkSize is the size to map for a growth that needs need more bytes, with size mapped now.
func (e *expandable) chunkSize(need, size int) int {
	step := min(max(size/e.growthDiv, e.minChunk), expandableMaxChunk)
	k, _ := alignUpChecked(max(need, step), e.gran)
	return k
}

// growExpandable maps new memory so that a free block of at least n bytes exists in list l (all
// other lists were merged into l before), and returns that block out of every list. With exact > 0
// it maps only what n needs, at least exact bytes (1 for the initial size,
// expandableFragmentedMin for a pool whose free bytes hold n), else a chunk of the growth
// policy's size.
//
// Pool locked, busy token held (nothing else maps, unmaps or changes the holes and the end of the
// chain), l pinned. The chunk is created and mapped unlocked, then linked in: the free
// neighbours it was sized to extend may have been taken (or freed into another list) meanwhile,
// so the new memory is freed into l, coalescing with whatever is free there now, and when the
// result is still smaller than n it stays there and growExpandable returns nil, nil: the caller
// searches again.
func (e *expandable) growExpandable(n int, l *freeList, exact int) (*block, error) {
	p := e.p
	if n > p.maximum {
		// Also keeps the sizes below from overflowing when rounded up to the granularity.
		return nil, p.oomErr(n, "the request exceeds the maximum pool size", nil, false)
	}
	free := func(b *block) int {
		if b != nil && b.free && b.list == l {
			return b.size
		}
		return 0
	}
	e.noteRequest(n)
	// What growing at the end of the chain would map: what the request needs beyond the free
	// block there, or a growth step (exact: only the need), within the room left.
	need := n - free(e.p.tail)
	kNeed, _ := alignUpChecked(need, e.gran)
	tailK := e.chunkSize(need, p.size)
	room := min(int(e.base+DevicePtr(e.reserved)-e.top), p.maximum-p.size)
	tailK = e.fdRound(tailK)
	if tailK > room {
		tailK = room / e.gran * e.gran
	}
	if exact > 0 {
		k, _ := alignUpChecked(max(need, exact), e.gran)
		tailK = min(tailK, e.fdRound(k))
	}
	if tailK < kNeed {
		tailK = math.MaxInt // no room at the end
	}
	// A hole, when filling it next to its free neighbours maps no more than that: only what the
	// request needs there, in the hole that needs the least.
	var best *block
	var bestAt DevicePtr
	bestK := 0
	for h := range e.holes {
		left, right := free(h.prev), free(h.next)
		if left+h.size+right < n {
			continue
		}
		var at DevicePtr
		var k int
		switch {
		case left+h.size >= n || right == 0:
			k, _ = alignUpChecked(max(n-left, 1), e.gran)
			k = min(e.fdRound(k), h.size)
			at = h.addr
		default: // fill from the right end, next to the free block after the hole
			k, _ = alignUpChecked(max(n-right, 1), e.gran)
			k = min(e.fdRound(k), h.size)
			at = h.end() - DevicePtr(k)
		}
		if k > tailK || (p.maximum > 0 && p.size+k > p.maximum) {
			continue
		}
		if best == nil || k < bestK || (k == bestK && h.addr < best.addr) {
			best, bestAt, bestK = h, at, k
		}
	}
	if best != nil {
		nb, err := e.mapChunk(bestAt, bestK)
		if err != nil {
			return nil, e.growErr(n, bestK, err)
		}
		e.logGrowth(nb)
		e.fillHole(best, nb)
		return e.takeGrown(nb, n, l)
	}
	// Else at the end of the chain, extending a free tail.
	if tailK == math.MaxInt {
		return nil, p.oomErr(n, maxDetail(n, kNeed, p.maximum-p.size, p.maximum), nil, false)
	}
	k := tailK
	at, size := e.top, p.size
	p.mu.Unlock()
	h, err := e.mapChunkUnlocked(at, k, size)
	for err != nil && errors.Is(err, ErrOutOfMemory) && k > kNeed {
		// Not enough memory for the whole step: halve it, down to what the request needs.
		k = max(kNeed, (k/2+e.gran-1)/e.gran*e.gran)
		h, err = e.mapChunkUnlocked(at, k, size)
	}
	p.mu.Lock()
	if err != nil {
		return nil, e.growErr(n, k, err)
	}
	return e.takeGrown(e.appendChunk(at, k, h), n, l)
}

// mapChunk maps k bytes of physical memory at addr and grants access, unlocking the pool around those calls (busy token held); it returns a new
// unlinked block over them (not free yet). On failure nothing new is left mapped or created.
func (e *expandable) mapChunk(addr DevicePtr, k int) (*block, error) {
	p := e.p
	size := p.size
	p.mu.Unlock()
	cs, err := e.mapChunkUnlocked(addr, k, size)
	p.mu.Lock()
	if err != nil {
		return nil, err
	}
	return e.addChunk(addr, k, cs), nil
}

// mapChunkUnlocked makes the driver calls of mapChunk (pool unlocked, busy token held; size is
// the pool's size, for messages) and returns the chunks mapped, by address: handles of
// pieceSize(k) bytes. On failure every handle it created is unmapped and released.
func (e *expandable) mapChunkUnlocked(addr DevicePtr, k, size int) ([]vmChunk, error) {
	piece := e.pieceSize(k)
	// The busy token keeps e.chunks from changing meanwhile.
	if held, more := len(e.chunks), (k+piece-1)/piece; e.maxHandles > 0 && held+more > e.maxHandles {
		return nil, errorf("PoolMemoryResource (expandable): mapping %s would make %d memfds, over half the open-file limit (%d): %w", bytesText(k), held+more, e.maxHandles, ErrOutOfMemory)
	}
	var cs []vmChunk
	undo := func() {
		for _, c := range cs {
			if err := e.vm.unmap(c.addr, c.size); err != nil {
				// Cannot be taken down: the handle stays mapped and is lost to the pool (the
				// same as a chunk whose access could not be granted; see below).
				DebugLogger().Warn("rmm: PoolMemoryResource (expandable): a chunk mapped for a failed growth could not be unmapped; its memory stays mapped",
					"address", fmt.Sprintf("%#x", uintptr(c.addr)), "bytes", c.size, "err", err)
				continue
			}
			e.vm.release(c.h)
		}
	}
	at := addr
	for left := k; left > 0; {
		m := min(left, piece)
		h, err := e.vm.create(m)
		if err != nil {
			DebugLogger().Debug("rmm: PoolMemoryResource (expandable) failed to create a chunk", "bytes", m, "pool_size", size, "err", err)
			undo()
			return nil, err
		}
		c := vmChunk{addr: at, size: m, h: h}
		if err := e.vm.mapAt(at, c.size, c.h); err != nil {
			e.vm.release(c.h)
			undo()
			return nil, errorf("PoolMemoryResource (expandable): mapping %s at %#x: %w", bytesText(c.size), uintptr(at), err)
		}
		cs = append(cs, c)
		at += DevicePtr(c.size)
		left -= c.size
	}
	if err := e.vm.setAccess(addr, k); err != nil {
		undo()
		return nil, errorf("PoolMemoryResource (expandable): granting access to %s at %#x: %w", bytesText(k), uintptr(addr), err)
	}
	return cs, nil
}

// addChunk records the chunks cs just mapped over [addr, addr+k) (pool locked) and returns a new
// unlinked block over them (not free yet).
func (e *expandable) addChunk(addr DevicePtr, k int, cs []vmChunk) *block {
	p := e.p
	i := sort.Search(len(e.chunks), func(i int) bool { return e.chunks[i].addr > addr })
	e.chunks = slices.Insert(e.chunks, i, cs...)
	p.size += k
	p.sizeAtomic.Store(int64(p.size))
	p.peakSize = max(p.peakSize, p.size)
	b := p.newBlock(addr, k)
	b.free = false
	return b
}

// appendChunk records the chunks cs just mapped over [addr, addr+k) at the top of the range
// (pool locked), logs the growth, and returns a new block over them linked at the chain's tail
// (not free yet).
func (e *expandable) appendChunk(addr DevicePtr, k int, cs []vmChunk) *block {
	nb := e.addChunk(addr, k, cs)
	e.logGrowth(nb)
	nb.prev = e.p.tail
	if e.p.tail != nil {
		e.p.tail.next = nb
	} else {
		e.p.head = nb
	}
	e.p.tail = nb
	e.top = nb.end()
	return nb
}

// logGrowth writes a growth by the block nb to the debug log.
func (e *expandable) logGrowth(nb *block) {
	p := e.p
	DebugLogger().Debug("rmm: PoolMemoryResource (expandable) grew", "bytes", nb.size, "address", fmt.Sprintf("%#x", uintptr(nb.addr)), "pool_size", p.size, "maximum", p.maximum)
}

// growErr is the error of a failed growth by k bytes for an n-byte request.
func (e *expandable) growErr(n, k int, err error) error {
	p := e.p
	if errors.Is(err, ErrOutOfMemory) {
		return p.oomErr(n, fmt.Sprintf("%s refused a chunk of %d bytes", e.source, k), err, true)
	}
	return err
}

// fillHole puts the new block nb, which lies at one end of hole h, into the chain in h's place.
func (e *expandable) fillHole(h, nb *block) {
	p := e.p
	if nb.size == h.size {
		nb.prev, nb.next = h.prev, h.next
		e.relink(h, nb)
		delete(e.holes, h)
		p.recycle(h)
		return
	}
	if nb.addr == h.addr { // nb, then the rest of the hole
		nb.prev, nb.next = h.prev, h
		if h.prev != nil {
			h.prev.next = nb
		} else {
			e.p.head = nb
		}
		h.prev = nb
		h.addr += DevicePtr(nb.size)
	} else { // the rest of the hole, then nb
		p.linkAfter(h, nb)
	}
	h.size -= nb.size
}

// relink makes old's neighbours (and head/tail) point at nb, which took old's place.
func (e *expandable) relink(old, nb *block) {
	if old.prev != nil {
		old.prev.next = nb
	} else {
		e.p.head = nb
	}
	if old.next != nil {
		old.next.prev = nb
	} else {
		e.p.tail = nb
	}
}

// takeGrown frees the fresh block nb into l (coalescing with free neighbours) and takes the
// resulting block out of l when it holds at least n bytes; else (the neighbours it was sized to
// extend were taken while the pool was unlocked) it leaves it there and returns nil.
func (e *expandable) takeGrown(nb *block, n int, l *freeList) (*block, error) {
	p := e.p
	b := p.freeInto(l, nb)
	if b.size < n {
		return nil, nil
	}
	l.remove(b)
	return b, nil
}

// releaseChunks gives back (unmaps and releases) chunks that lie wholly inside free blocks of
// list def, into which every other list was merged after the streams' work behind the frees was
// waited for. With limit ≥ 0 it stops once at most limit bytes are free, giving back the chunks at
// the highest addresses first. Each chunk given back becomes a hole in the chain (or, at the end,
// shortens it). Pool locked, busy token held (or the pool closed); without hold the unmaps are
// made unlocked, the free blocks holding the chunks out of every list meanwhile (still counted in
// the pool's size).
func (e *expandable) releaseChunks(def *freeList, limit int, hold bool) error {
	cands := e.releaseCands(def, limit)
	if e.st != nil {
		cands = e.st.unmapAliasesOver(def, cands, hold)
	}
	return e.unmapChunks(def, cands, hold)
}

// pullBlocks takes the free blocks holding the chunks cands (highest address first, so a block's
// chunks are next to each other) out of def and returns them, highest first.
func pullBlocks(def *freeList, cands []chunkCand) []*block {
	var blocks []*block
	for _, c := range cands {
		if len(blocks) == 0 || blocks[len(blocks)-1] != c.b {
			blocks = append(blocks, c.b)
			def.remove(c.b)
		}
	}
	return blocks
}

// chunksFreeIn returns the chunks of cands (highest address first) each with the free block of
// def that holds it now, in the same order; a chunk that no free block of def holds is left out.
func (e *expandable) chunksFreeIn(def *freeList, cands []chunkCand) []chunkCand {
	var bs []*block
	def.each(func(b *block) { bs = append(bs, b) })
	slices.SortFunc(bs, func(x, y *block) int { return cmp.Compare(x.addr, y.addr) })
	out := cands[:0]
	for _, c := range cands {
		if j := blockOf(bs, c.c, -1); j >= 0 {
			out = append(out, chunkCand{c.c, bs[j]})
		}
	}
	return out
}

// releaseCands returns the chunks releaseChunks gives back, highest address first.
func (e *expandable) releaseCands(def *freeList, limit int) []chunkCand {
	p := e.p
	var cands []chunkCand
	def.each(func(b *block) { cands = e.chunksIn(b, cands) })
	// Highest address first (see unmapChunks).
	sort.Slice(cands, func(x, y int) bool { return cands[x].c.addr > cands[y].c.addr })
	free := p.size - p.liveBytes
	for i, c := range cands {
		if limit >= 0 && free <= limit {
			cands = cands[:i]
			break
		}
		free -= c.c.size
	}
	return cands
}

// chunkCand is a chunk lying wholly in the free block b.
type chunkCand struct {
	c vmChunk
	b *block
}

// chunksIn appends to cs the chunks lying wholly in the free block b.
func (e *expandable) chunksIn(b *block, cs []chunkCand) []chunkCand {
	for i := e.firstChunkIn(b); i < len(e.chunks) && e.chunks[i].end() <= b.end(); i++ {
		cs = append(cs, chunkCand{e.chunks[i], b})
	}
	return cs
}

// unmapChunks unmaps and releases the chunks cands (each wholly in a free block of def; sorted by
// address, highest first: taking a chunk out of a free block leaves the block's lower part, with
// its lower chunks, in the same block) and turns their ranges into holes. The work behind the frees must be known done.
// Pool locked, busy token held (or the pool closed); without hold the unmaps are made unlocked,
// the free blocks holding the chunks out of every list meanwhile (still counted in the pool's
// size). A chunk that cannot be unmapped stays, free, where it was.
func (e *expandable) unmapChunks(def *freeList, cands []chunkCand, hold bool) error {
	p := e.p
	if len(cands) == 0 {
		return nil
	}
	// The blocks holding the chunks, highest first, out of def while the pool is unlocked.
	blocks := pullBlocks(def, cands)
	p.pin(def)
	p.unlockUnless(hold)
	var firstErr error
	unmapped := make([]bool, len(cands))
	for i, c := range cands {
		ch := c.c
		if err := e.vm.unmap(ch.addr, ch.size); err != nil {
			if firstErr == nil {
				firstErr = errorf("PoolMemoryResource (expandable): unmapping %s at %#x: %w", bytesText(ch.size), uintptr(ch.addr), err)
			}
			continue
		}
		unmapped[i] = true
		if err := e.vm.release(ch.h); err != nil && firstErr == nil {
			firstErr = errorf("PoolMemoryResource (expandable): releasing the chunk at %#x: %w", uintptr(ch.addr), err)
		}
	}
	p.relockUnless(hold)
	p.unpin(def)
	// Back into def, coalescing with what was freed meanwhile, and the chunks unmapped cut out
	// as holes: block by block from the highest, each block's chunks from the highest.
	released := map[DevicePtr]bool{}
	i := 0
	for _, b := range blocks {
		nb := p.freeInto(def, b)
		for ; i < len(cands) && cands[i].b == b; i++ {
			if unmapped[i] {
				ch := cands[i].c
				released[ch.addr] = true
				p.size -= ch.size
				e.makeHole(def, nb, ch.addr, ch.size)
			}
		}
	}
	if len(released) > 0 {
		kept := e.chunks[:0]
		for _, c := range e.chunks {
			if !released[c.addr] {
				kept = append(kept, c)
			}
		}
		e.chunks = kept
		p.sizeAtomic.Store(int64(p.size))
		e.trimTailHole()
	}
	return firstErr
}

// makeHole turns [addr, addr+size), which lies inside the free block b of def, into a hole,
// merged with adjacent holes.
func (e *expandable) makeHole(def *freeList, b *block, addr DevicePtr, size int) {
	p := e.p
	def.remove(b)
	end := addr + DevicePtr(size)
	if end < b.end() { // free remainder after the hole
		r := p.newBlock(end, int(b.end()-end))
		b.size -= r.size
		p.linkAfter(b, r)
		p.copyDeps(r, b) // b may have coalesced with memory freed on other streams since the wait
		def.insert(r)
	}
	h := b
	if addr > b.addr { // free part before the hole
		h = p.newBlock(addr, size)
		b.size = int(addr - b.addr)
		p.linkAfter(b, h)
		def.insert(b)
	} else {
		p.clearDeps(h) // a hole is no free memory
	}
	h.free, h.hole = false, true
	e.holes[h] = struct{}{}
	// Merge with holes on either side.
	if nx := h.next; nx != nil && isHole(nx) {
		delete(e.holes, nx)
		p.recycle(p.absorbNext(h))
	}
	if pr := h.prev; pr != nil && isHole(pr) {
		delete(e.holes, h)
		p.recycle(p.absorbNext(pr))
	}
}

// isHole reports whether b is a range whose chunk was given back.
//
// A flag of its own, not a mark in req: a cache writes req of the blocks it holds under its own
// lock, and the chain walks that look for holes hold only the pool's.
func isHole(b *block) bool { return b.hole }

// trimTailHole drops a hole at the end of the chain, so the chain ends at mapped memory and the
// next growth maps there.
func (e *expandable) trimTailHole() {
	p := e.p
	t := e.p.tail
	if t == nil || !isHole(t) {
		return
	}
	delete(e.holes, t)
	e.top = t.addr
	e.p.tail = t.prev
	if t.prev != nil {
		t.prev.next = nil
	} else {
		e.p.head = nil
	}
	p.recycle(t)
}

// trim is called after a free that left the free block b: past the trim level, or past the
// threshold when b holds a whole chunk, it waits for the streams' work behind the frees and gives
// back whole free chunks until at most ReleaseThreshold bytes are free. (The trim level rises
// after a trim that left memory mapped, so that a pool whose free memory lies in chunks that
// also hold live blocks does not synchronise at every free; a free that makes a chunk wholly
// free trims all the same.) A trim that fails is written to the debug log and leaves the memory
// mapped: the free that called it is done, and must not report an error.
func (e *expandable) trim(b *block) {
	p := e.p
	free := p.size - p.liveBytes
	if p.trimAt == 0 || free <= e.threshold || (free <= p.trimAt && !e.holdsChunk(b)) {
		return
	}
	if p.busy {
		// A growth (which needs the memory) or a release (which gives it back) is in flight:
		// the free after it that is still past the level trims.
		return
	}
	p.busy = true
	defer p.releaseBusy()
	def, err := p.mergeAllSynced(false)
	if err == nil {
		p.pin(def)
		err = e.releaseChunks(def, e.threshold, false)
		p.unpin(def)
	}
	e.resetTrim(p.size - p.liveBytes)
	if err != nil {
		// The block is free already (a caller told of an error would free it again, and get
		// ErrInvalidFree); what could not be given back stays mapped, for a later trim or Release.
		DebugLogger().Warn("rmm: PoolMemoryResource (expandable): trimming to the release threshold failed", "err", err)
	}
}

// holdsChunk reports whether the block b covers a whole mapped chunk.
func (e *expandable) holdsChunk(b *block) bool {
	i := e.firstChunkIn(b)
	return i < len(e.chunks) && e.chunks[i].end() <= b.end()
}

// firstChunkIn returns the index of the first chunk that starts inside b or after it
// (len(e.chunks) when b is smaller than a chunk can be); the chunks from there that end inside b
// lie wholly in b.
func (e *expandable) firstChunkIn(b *block) int {
	if b.size < e.gran {
		return len(e.chunks)
	}
	return sort.Search(len(e.chunks), func(i int) bool { return e.chunks[i].addr >= b.addr })
}

// freeReservation gives back the reservation once nothing is mapped.
func (e *expandable) freeReservation() error {
	if len(e.chunks) > 0 || e.reserved == 0 {
		return nil
	}
	err := e.vm.free(e.base, e.reserved)
	e.reserved = 0
	if err != nil {
		return errorf("PoolMemoryResource (expandable): freeing the reservation at %#x: %w", uintptr(e.base), err)
	}
	return nil
}

var errNotExpandableUpstream = errors.New("an expandable pool maps its own memory: its upstream only names where from, and must be nil, a CudaMemoryResource, the SystemMemoryResource or a SimulatedMemoryResource")

// vmmFor is the virtual memory an expandable pool over upstream uses: the device's for a
// CudaMemoryResource (or nil, when there is a CUDA device), host memory for the
// SystemMemoryResource (or nil without CUDA), and addresses only, within its capacity, for a
// SimulatedMemoryResource. A stitching pool over host memory maps memfds, which (as the device's
// handles) can be mapped at a second address; otherwise every stitch would fail and the pool
// grow instead, larger than over the device.
func vmmFor(upstream MemoryResource, stitch bool) (vmm, Device, error) {
	host := newHostVMM
	if stitch {
		host = newHostVMMAliasing
	}
	switch u := upstream.(type) {
	case nil:
		dev := CurrentDevice()
		if CUDAAvailable() == nil {
			vm, err := newDeviceVMM(dev)
			return vm, dev, err
		}
		vm, err := host(hostVMMGranularity, 0)
		return vm, dev, err
	case *CudaMemoryResource:
		vm, err := newDeviceVMM(u.Device())
		return vm, u.Device(), err
	case *SystemMemoryResource:
		vm, err := host(hostVMMGranularity, 0)
		return vm, DeviceOf(u), err
	case *SimulatedMemoryResource:
		return newSimVMM(hostVMMGranularity, u.capacity), DeviceOf(u), nil
	}
	return nil, 0, errorf("NewPoolMemoryResource: %v, not %s: %w", errNotExpandableUpstream, resourceName(upstream), ErrInvalidArgument)
}

// hostVMMGranularity is the granularity of the host-memory expandable pool: the device's, so that
// a pool behaves the same on the host as on the GPU.
const hostVMMGranularity = 2 << 20

// checkChain verifies an expandable pool's chain: one run of blocks from the reservation's
// base to top, each free, live or a hole, holes never adjacent, the chunks exactly the mapped
// (non-hole) ranges, their sizes summing to PoolSize.
func (e *expandable) checkChain(all map[DevicePtr]*block, stitched int) error {
	p := e.p
	if (p.head == nil) != (p.tail == nil) || (p.head == nil && e.top != e.base) {
		return errorf("empty chain with head %p, tail %p, top %#x (base %#x)", p.head, p.tail, uintptr(e.top), uintptr(e.base))
	}
	if e.top > e.base+DevicePtr(e.reserved) {
		return errorf("top %#x is past the reservation [%#x, +%d)", uintptr(e.top), uintptr(e.base), e.reserved)
	}
	visited, holes, mapped := 0, 0, 0
	var mappedRanges [][2]DevicePtr
	at := e.base
	var last *block
	for b := p.head; b != nil; b = b.next {
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
	if last != p.tail || at != e.top {
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
