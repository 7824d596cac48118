package rmm

import (
	"cmp"
	"fmt"
	"slices"
	"sort"
)

// Stitching (expandable pools with PoolOptions.Stitch, or poolTuning.stitchPiece > 0).
//
// With PoolOptions.Stitch (stitchTuning), growths map physical memory in pieces of the
// granularity, or a stitchFracDefault-th of the growth, or a stitchReqDivDefault-th of the request
// grown for (at most a stitchPieceCapDefault-th of the pool), where that is more; a growth maps
// what the request needs but at least stitchMinGrowth and a stitchGrowthDivisor-th of the pool
// (instead of the plain expandable pool's step); and a request of stitchMinDefault or more that no free
// block holds is stitched from the pieces lying in free memory (cuMemAddressReserve, cuMemMap,
// cuMemSetAccess), after growing only what they lack. The range is kept, and serves a later
// request with no driver call once its pieces are free again; kept ranges are unmapped after a
// host wait for the streams' work (at Release, Close, or past stitchKeepDefault of them). Over
// host memory each piece is a memfd (Linux: memfd_create), which can be mapped at a second
// address.
//
// An expandable pool's free memory ends up scattered between live blocks: a request that no free
// block holds makes the pool grow although its free bytes may hold the request several times. A
// physical chunk can be mapped at a second address, and both addresses see the same bytes; so
// stitching serves such a request from the chunks that lie wholly in free memory: it maps them a
// second time, back to back, into a range of their own (an alias), and hands out the start of
// that range. Their ranges in the pool's chain become lent blocks, which are neither free nor
// holes, never coalesce and are never taken, until the stitched block is freed: they then return
// to the freeing stream's list as a free of that size would. The alias stays mapped, and serves a
// later request its chunks hold (when they are all free again) with no driver call at all.
//
// For free memory to hold whole chunks, growths map handles of at most stitchPiece bytes
// (pieceSize); cuMemSetAccess covers the adjacent mappings of a growth in one call.
//
// Stream order: the chunks come from free blocks of any list (the lists are not merged before a
// stitching pool grows: findEndLast): a chunk lent out of another stream's list names that list
// among the stitched block's deps, which Allocate makes the allocating stream wait for. Where a free block names other streams' lists among
// its deps (memory coalesced across streams, pool_placement.go), the stitched block names them too,
// and Allocate makes the allocating stream wait for them before it returns the block, as for a
// block taken whole; its free returns the chunks to the freeing stream's list as any free does.
// The chunks' bytes beyond the request were never used, so a free on another stream does not
// order them: the chunks holding them then name the allocating stream's list among their deps
// (stitchAlias.from, counted in its depRefs while the block is live; freeStitched).
// An alias is unmapped (evicted, or before one of its handles is given back, or at Close) only
// after a host wait for the work behind every free, as Release waits before it unmaps chunks:
// unmap does not wait for the device.
//
// Why it is the default pool (PoolKind, Reinitialize): it keeps the memory it maps close to the
// live bytes on every bundled trace, makes few driver calls after the first pass (none on most),
// and later passes cost about the same with or without it. Its price is the first pass, which
// makes more mappings than the plain expandable pool's (each a driver call that serialises): the
// pieces sized from the request (stitchReqDivDefault) keep that within a small multiple. Growing
// only the rest of a request the free pieces do not hold (stitchRest) matters: without it some
// training traces end up larger than without stitching. BENCHMARKS.md, "Stitching", gives the
// figures.

// poolTuning holds an expandable pool's parameters that are not options: the package's own
// knobs, for tests and measurements (newExpandablePool; a zero field takes its default).
type poolTuning struct {
	// stitchPiece: when > 0, growths map handles of at most stitchPiece bytes (rounded up to the
	// granularity), and a request that no free block holds is served, when the chunks lying
	// wholly in free memory hold it, by mapping them a second time back to back.
	stitchPiece int
	// stitchMin (with stitchPiece): the least request stitched; 0: stitchMinDefault.
	stitchMin int
	// stitchRest (with stitchPiece): also stitch when the free chunks hold only part of the
	// request, growing the rest first, when that maps less than growing for the request would.
	stitchRest bool
	// stitchKeep (with stitchPiece): the most stitched ranges kept; 0: stitchKeepDefault.
	stitchKeep int
	// stitchFrac (with stitchPiece): a growth of k bytes maps handles of at least k/stitchFrac
	// bytes (and of at least stitchPiece); 0: of stitchPiece.
	stitchFrac int
	// stitchReqDiv (with stitchPiece): a growth for an n-byte request maps handles of at least
	// n/stitchReqDiv bytes (within stitchPieceCap); 0: no such bound.
	stitchReqDiv int
	// stitchPieceCap (with stitchReqDiv): the handles stitchReqDiv asks for are at most the
	// pool's size (before the growth) divided by this; 0: no bound.
	stitchPieceCap int
	// stitchNoDeps (with stitchPiece): lend no chunk of a free block that names other lists
	// among its deps.
	stitchNoDeps bool
	// minGrowth: the least growth, rounded up to the granularity; 0: expandableMinChunk, or
	// stitchMinGrowth with stitchPiece.
	minGrowth int
	// growthDivisor: a growth maps at least the pool's size divided by this; 0:
	// expandableGrowthDivisor, or stitchGrowthDivisor with stitchPiece.
	growthDivisor int
}

// stitchTuning is what PoolOptions.Stitch sets: pieces of one granule, whatever the device's
// (stitchPiece is rounded up to it), or a stitchFracDefault-th of the growth, or a
// stitchReqDivDefault-th of the request grown for (at most a stitchPieceCapDefault-th of the
// pool), where that is more; the rest of a request grown when the free chunks hold only part of
// it.
var stitchTuning = poolTuning{stitchPiece: 1, stitchRest: true, stitchFrac: stitchFracDefault, stitchReqDiv: stitchReqDivDefault, stitchPieceCap: stitchPieceCapDefault}

// stitching is the backing of a stitching pool (PoolOptions.Stitch): an expandable backing whose
// growths map handles of at most a piece, and which serves a request no free block holds by
// mapping the chunks lying in free memory a second time, back to back, in an alias of their own.
type stitching struct {
	*expandable
	stitchMin  int  // the least request stitched
	stitchRest bool // the free chunks may hold only most of a request: the rest is grown first
	keepMax    int  // the most aliases kept
	noDepLend  bool
	// stitchedDeps counts the stitched blocks that named other lists (Allocate waited for them).
	stitchedDeps int
	aliases      map[DevicePtr]*stitchAlias
	bySize       []*stitchAlias // the aliases sorted by size, then age (aliasOrder; keptFor)
	blockScratch []*block       // scratch for freeByAddr
	// endIndex: the aliases that hold each stitchEnd among their ends (keptAtEnd).
	endIndex   map[stitchEnd][]*stitchAlias
	stitchTick uint64
	stitches   int // aliases made
	evicted    int // aliases unmapped
}

// newStitching wraps the expandable backing e, tuned by tune (stitchPiece > 0).
func newStitching(e *expandable, tune poolTuning) *stitching {
	st := &stitching{
		expandable: e,
		stitchMin:  cmp.Or(tune.stitchMin, stitchMinDefault),
		stitchRest: tune.stitchRest,
		keepMax:    cmp.Or(tune.stitchKeep, stitchKeepDefault),
		noDepLend:  tune.stitchNoDeps,
		aliases:    map[DevicePtr]*stitchAlias{},
	}
	e.st = st
	return st
}

// grow serves an n-byte request that no free block holds (findEndLast searched every list, the
// caches flushed) with a stitched block when the chunks lying in free memory hold it, else grows
// as an expandable pool does.
func (e *stitching) grow(n int, s StreamView, l *freeList) (*block, error) {
	if n >= e.stitchMin {
		if b, again := e.stitch(n, l); b != nil || again {
			return b, nil
		}
	}
	return e.expandable.grow(n, s, l)
}

// serveAtEnd serves a request whose best fit is the end of the chain with a kept alias
// (keptAtEnd).
func (e *stitching) serveAtEnd(n int, l *freeList, t *block) *block { return e.keptAtEnd(n, l, t) }

// freeServed frees a stitched block (freeStitched); after Close, with its stream synchronised,
// its alias goes at once, before its chunks can.
func (e *stitching) freeServed(l *freeList, b *block) *block {
	if !e.p.closed {
		return e.freeStitched(l, b)
	}
	a := e.aliases[b.addr]
	b = e.freeStitched(l, b)
	e.dropAliases([]*stitchAlias{a}, true)
	return b
}

// servedFrom is the list the chunks of the live stitched block b were lent out of.
func (e *stitching) servedFrom(b *block) *freeList { return e.aliases[b.addr].from }

func (e *stitching) restoreServedDeps(b *block, deps []*freeList) { e.restoreLentDeps(b, deps) }

// checkServed verifies the stitched blocks (checkStitches) and counts the lists live stitched
// ranges name among the deps.
func (e *stitching) checkServed(served int, deps map[*freeList]int) (int, error) {
	for _, a := range e.aliases {
		if a.b != nil && a.from != nil {
			deps[a.from]++ // a live stitched range names the list its chunks were lent out of
		}
	}
	lentSeen := map[*block]bool{}
	for b := e.p.head; b != nil; b = b.next {
		if b.lent {
			lentSeen[b] = true
		}
	}
	return e.checkStitches(lentSeen)
}

// close unmaps every alias not live (every free was waited for), then frees the reservation
// once nothing is mapped.
func (e *stitching) close() error {
	e.dropIdleAliases(true)
	return e.expandable.close()
}

// exportIPC exports the pieces under a stitched block, else those of the chain.
func (e *stitching) exportIPC(ptr DevicePtr, n int) (*IPCHandle, error) {
	return e.exportVMM(ptr, n, e.stitchedPieces)
}

// stitchAlias is a range of address space into which chunks of the pool are mapped back to back.
// While its block is live the chunks are lent; once freed it is kept, for a later request that
// its chunks hold when they are free again, until evicted or until one of its chunks is given
// back.
type stitchAlias struct {
	va     DevicePtr // the start of its own reservation, of size bytes
	seq    int       // the aliases made before it (expandable.stitches): its age, for aliasOrder
	size   int       // the bytes of its chunks
	chunks []vmChunk // mapped from va on, in order; addr: where the chunk lies in the chain
	// runs: the chunks grouped into runs, in the same order: each the longest sequence of
	// consecutive chunks that also lie back to back in the chain (its addr and size; h unused).
	// Chunks are lent and looked up a run at a time (aliasRuns).
	runs []vmChunk
	// lent: while live, the chain's lent block over each run, in the same order.
	lent []*block
	b    *block // while live: the stitched block (in the live table); nil when kept
	used uint64 // when last stitched (expandable.stitchTick)
	// ends: where the chain's end stood the last few times the alias was stitched, for which
	// request (see keptAtEnd); a zero at marks an unused slot.
	ends    [stitchEnds]stitchEnd
	endNext int
	// from: while live, the list the chunks were lent out of (the allocating stream's), counted
	// in its depRefs. The chunks' bytes beyond the block were never used: a free on another
	// stream returns them naming from among their deps (freeStitched).
	from *freeList
}

// stitchEnd records that an alias was stitched for an n-byte request while the free block at the
// end of the chain started at at (or, with no free block there, the chain ended at at).
type stitchEnd struct {
	at DevicePtr
	n  int
}

const (
	// stitchEnds is the count of stitchEnd an alias keeps, the oldest replaced first: enough for
	// the few ends a training loop's steps leave (see keptAtEnd); fewer made later passes map
	// again, more changed nothing over the bundled traces.
	stitchEnds = 4
	// stitchMinDefault is the least request stitching serves (poolTuning.stitchMin 0): one
	// granule, the least a chunk can be; below it a growth maps little. (TestStitchTraces
	// -rmm.stitchmin -1 replays with the piece size instead.)
	stitchMinDefault = 2 << 20
	// stitchKeepDefault bounds the aliases kept (live or not; poolTuning.stitchKeep 0). Past
	// it, a new stitch first evicts the least recently used quarter of the aliases not live,
	// after waiting (on the host) for the work behind every free: an unmap does not wait for the
	// device. An alias holds address space only, so the bound is far above what a training loop
	// keeps; it is there for a workload whose placement changes at every step, which would
	// otherwise make a new alias each time.
	stitchKeepDefault = 1024
	// stitchReuseSlack: a kept alias serves requests down to its size less a sixteenth, less one
	// granule (the model in bench/experiments/aliasmodel, whose footprints the option was
	// measured against, used the same).
	stitchReuseSlack = 16
	// stitchFracDefault: with PoolOptions.Stitch, a growth of k bytes maps pieces of at least
	// k/stitchFracDefault (and at least a granule): a large growth then maps far fewer handles
	// than in granules, while its pieces stay small enough for the free memory between live
	// blocks to hold whole ones. Larger fractions cost footprint on the multi-stream traces
	// (TestStitchTraces -rmm.stitchfrac replays with another).
	stitchFracDefault = 64
	// stitchMinGrowth and stitchGrowthDivisor replace expandableMinChunk and
	// expandableGrowthDivisor in a stitching pool: a growth maps what the request lacks but at
	// least 16 MiB and a 64th of the pool. The step of the plain expandable pool keeps the count of
	// mappings low; here a growth maps pieces of at least a granule, so the mappings follow the
	// bytes mapped whatever the step, and a large step only leaves memory unused at the top: at
	// the peak, a small pool's footprint follows where its last growth falls. The plain
	// expandable pool keeps its step, which there maps fewer chunks. (TestStitchTraces
	// -rmm.mingrowth -rmm.growthdiv replays with others.)
	stitchMinGrowth     = 16 << 20
	stitchGrowthDivisor = 64
	// stitchReqDivDefault and stitchPieceCapDefault: with PoolOptions.Stitch, a growth for an
	// n-byte request maps pieces of at least n/stitchReqDivDefault, but of at most the pool's
	// size/stitchPieceCapDefault. Every piece costs a mapping when it is grown and another each
	// time it is stitched, and a mapping costs the driver about the same whatever its size: in
	// pieces of a granule, the first pass of a trace whose large requests change size at every
	// step (dynamic padding, variable crops) spent most of its time mapping. Memory grown for a
	// large request is freed, later, in spans about as large, which hold such pieces whole; so
	// a large request grows in a few pieces and a later one of that size is stitched from a few.
	// The bound by the pool's size keeps pieces small where the pool is small, since there a
	// piece too large to lie wholly in the free memory between live blocks makes the pool grow
	// instead of stitching; smaller divisors left small pools larger, larger ones (or a larger
	// share of the request) mapped more (TestFirstPass -rmm.firstpasstune reqdiv=,cap= replays
	// with others).
	stitchReqDivDefault   = 2
	stitchPieceCapDefault = 128
)

// stitchCands returns the chunks lying wholly in free blocks of any list (of l alone with
// noDepLend). Those of another list, or of blocks that name other lists among their deps, are
// lent too: the stitched block then names those lists (newAlias), and Allocate makes the
// allocating stream wait for them before it hands the block out, as it does for a block taken
// whole.
func (e *stitching) stitchCands(l *freeList) []chunkCand {
	p := e.p
	var cs []chunkCand
	add := func(b *block) {
		if len(b.deps()) == 0 || !e.noDepLend {
			cs = e.chunksIn(b, cs)
		}
	}
	// Only blocks of a granule or more can hold a chunk.
	if e.noDepLend {
		l.eachAtLeast(e.gran, add)
		return cs
	}
	for _, o := range p.lists {
		o.eachAtLeast(e.gran, add)
	}
	return cs
}

// stitch serves an n-byte request on l's stream with a stitched block when no free block of any
// list holds it (the caches were flushed before, and the end of the chain, if free, moved into
// l: findEndLast): it returns the
// block (size n, outside the chain, not free yet; liveBytes already counts the bytes of its
// chunks beyond n) or nil when the pool should grow instead. again reports that it grew the rest
// of the request at the end of the chain: the caller searches again, and stitches the next time.
//
// Pool locked, busy token held, l pinned; it may unlock and relock.
func (e *stitching) stitch(n int, l *freeList) (b *block, again bool) {
	if a, pick := e.keptFor(n, l); a != nil {
		return e.lendAlias(a, n, l, pick), false
	}
	cands := e.stitchCands(l)
	if len(e.aliases) >= e.keepMax && e.evictAliases() {
		cands = e.stitchCands(l) // the pool was unlocked
	}
	pick, sum := pickChunks(cands, n)
	if sum < n {
		if !e.stitchRest || sum == 0 {
			return nil, false
		}
		// Grow only the rest, when that maps less than a growth for the whole request would
		// (what it lacks beyond the free block at the end), however little the free chunks
		// hold: a bound on that share (say, half of the request) left a request much larger
		// than the free chunks to grow in full, and the pool larger (TestStitchTraces).
		k, _ := alignUpChecked(n-sum, e.gran)
		need := n
		if t := e.p.tail; t != nil && t.free && t.list == l {
			need -= t.size
		}
		kNeed, _ := alignUpChecked(need, e.gran)
		if k >= kNeed {
			return nil, false
		}
		e.noteRequest(n)
		return nil, e.growTail(k, l)
	}
	return e.newAlias(pick, n, l), false
}

// pickChunks chooses chunks among cands holding at least n bytes: the largest first while they
// fit in n, then the smallest of the others that covers what is left; sum < n when all of them
// hold less.
func pickChunks(cands []chunkCand, n int) ([]chunkCand, int) {
	sort.Slice(cands, func(x, y int) bool {
		if cands[x].c.size != cands[y].c.size {
			return cands[x].c.size > cands[y].c.size
		}
		return cands[x].c.addr < cands[y].c.addr
	})
	var pick []chunkCand
	sum, over := 0, -1
	for i, c := range cands {
		if sum+c.c.size <= n {
			pick = append(pick, c)
			sum += c.c.size
		} else if over < 0 || c.c.size < cands[over].c.size {
			over = i
		}
	}
	if sum < n && over >= 0 {
		// Every chunk left out is larger than what was left then, so covers what is left now.
		pick = append(pick, cands[over])
		sum += cands[over].c.size
	}
	return pick, sum
}

// keptFor returns the smallest kept alias (the oldest of that size: aliasOrder), not live, that
// serves n bytes and whose chunks all lie wholly in free blocks that may lend them (as
// stitchCands lists them), with those chunks in its order and their blocks; nil when none does.
func (e *stitching) keptFor(n int, l *freeList) (*stitchAlias, []chunkCand) {
	if len(e.aliases) == 0 {
		return nil, nil
	}
	var bs []*block
	i, _ := slices.BinarySearchFunc(e.bySize, n, func(a *stitchAlias, n int) int { return cmp.Compare(a.size, n) })
	for _, a := range e.bySize[i:] {
		if a.size > n+n/stitchReuseSlack+e.gran {
			break
		}
		if a.b != nil {
			continue
		}
		if bs == nil {
			src := l // nil: every list (the lists lent out of are among the deps: lendAlias)
			if !e.noDepLend {
				src = nil
			}
			bs = e.freeByAddr(src)
			defer e.dropScratch()
		}
		if pick := pickIn(a, bs); pick != nil {
			return a, pick
		}
	}
	return nil, nil
}

// aliasOrder orders aliases by size, then by when they were made (expandable.bySize).
//
// Not by address: where the driver places a new reservation is its own choice (the address-only
// VMM places each above the last, the device's need not), and with the alias of equal size
// chosen by address a pass on the device could lend another alias than the same pass over the
// address-only VMM, and stitch a new one where the replay maps none.
func aliasOrder(x, y *stitchAlias) int {
	return cmp.Or(cmp.Compare(x.size, y.size), cmp.Compare(x.seq, y.seq))
}

// addAlias enters a among the aliases: in aliases, bySize and, by its ends, endIndex.
func (e *stitching) addAlias(a *stitchAlias) {
	e.aliases[a.va] = a
	i, _ := slices.BinarySearchFunc(e.bySize, a, aliasOrder)
	e.bySize = slices.Insert(e.bySize, i, a)
	e.indexEnds(a, false)
}

// removeAlias takes a out of the aliases (addAlias).
func (e *stitching) removeAlias(a *stitchAlias) {
	delete(e.aliases, a.va)
	if i, ok := slices.BinarySearchFunc(e.bySize, a, aliasOrder); ok {
		e.bySize = slices.Delete(e.bySize, i, i+1)
	}
	e.indexEnds(a, true)
}

// endAt returns where the chain's end stands for stitchEnd: the start of the free block at the
// end of the chain, or the end of the chain when the block there is not free.
func (e *stitching) endAt() DevicePtr {
	if t := e.p.tail; t != nil && t.free {
		return t.addr
	}
	return e.top
}

// noteEnd records r in a.ends, replacing its oldest, and in the pool's endIndex.
func (e *stitching) noteEnd(a *stitchAlias, r stitchEnd) {
	if old := a.ends[a.endNext]; old.at != 0 {
		e.unindexEnd(a, old)
	}
	a.ends[a.endNext] = r
	a.endNext = (a.endNext + 1) % stitchEnds
	if e.endIndex == nil {
		e.endIndex = map[stitchEnd][]*stitchAlias{}
	}
	if !slices.Contains(e.endIndex[r], a) { // the same end may be recorded twice
		e.endIndex[r] = append(e.endIndex[r], a)
	}
}

// unindexEnd takes a out of endIndex[r] unless another of its ends is r.
func (e *stitching) unindexEnd(a *stitchAlias, r stitchEnd) {
	k := 0
	for _, x := range a.ends {
		if x == r {
			k++
		}
	}
	if k > 1 {
		return
	}
	e.dropIndexed(a, r)
}

// dropIndexed takes a out of endIndex[r].
func (e *stitching) dropIndexed(a *stitchAlias, r stitchEnd) {
	as := slices.DeleteFunc(e.endIndex[r], func(x *stitchAlias) bool { return x == a })
	if len(as) == 0 {
		delete(e.endIndex, r)
	} else {
		e.endIndex[r] = as
	}
}

// indexEnds adds (with drop false) or takes out the ends of a in endIndex, as a enters or leaves
// the aliases.
func (e *stitching) indexEnds(a *stitchAlias, drop bool) {
	for i, r := range a.ends {
		if r.at == 0 || slices.Contains(a.ends[:i], r) {
			continue
		}
		if drop {
			e.dropIndexed(a, r)
		} else {
			e.endIndex[r] = append(e.endIndex[r], a)
		}
	}
}

// keptAtEnd serves an n-byte request on l's stream, whose best fit (in l, or in another stream's
// list when l holds none) is the free block at the end of the chain (t), with a kept alias when
// one was stitched for n bytes while the end stood where it stands now, and its chunks all lie
// in free blocks of the lists; else it returns nil. Chunks lent out of another stream's list
// name that list among the stitched block's deps (lendAlias). No driver call.
//
// Why: a training loop replays the same requests at every step, but its first step grows the
// pool, and the later ones find the memory those growths mapped free at the end of the chain.
// Where the first step stitched a request (the end then held too little), a later step would
// take it from the end instead; every placement after that differs from the first step's, the
// aliases the first step made no longer find their chunks free, and the second step stitches
// new ones (mapping every chunk again) that later steps reuse. Taking the alias again where
// the end stands where it stood keeps the second step's placement that of the first. Some
// traces still map again in their second pass, where placement differs for other reasons (small
// requests that the first step placed in what a growth left free at the end, which later steps
// place elsewhere: see findEndLast).
//
// Where several streams allocate, a later pass, which does not grow, may find the end of the
// chain in another stream's list and the alias's chunks spread over several lists: so the
// request is taken from another list, and the chunks lent out of any.
//
// Pool locked; it does not unlock (so l need not be pinned). The busy token need not be held:
// lending makes no driver call, and a growth, release or eviction that unlocks keeps what it
// works on out of the lists and out of the aliases meanwhile.
func (e *stitching) keptAtEnd(n int, l *freeList, t *block) *block {
	if len(e.aliases) == 0 || n < e.stitchMin || t != e.p.tail {
		return nil
	}
	var best *stitchAlias
	for _, a := range e.endIndex[stitchEnd{t.addr, n}] {
		if a.b != nil || a.size < n || a.size > n+n/stitchReuseSlack+e.gran {
			continue
		}
		if best == nil || aliasOrder(a, best) < 0 {
			best = a
		}
	}
	if best == nil {
		return nil
	}
	var src *freeList // nil: every list
	if e.noDepLend {
		src = l // lending out of another list names it among the deps
	}
	pick := pickIn(best, e.freeByAddr(src))
	e.dropScratch()
	if pick == nil {
		return nil
	}
	return e.lendAlias(best, n, l, pick)
}

// freeByAddr returns the free blocks of a granule or more that may lend chunks (those
// stitchCands lists chunks of) of l, or of every list when l is nil, sorted by address: the
// pool's scratch slice, valid until the next call; dropScratch clears it after use.
func (e *stitching) freeByAddr(l *freeList) []*block {
	p := e.p
	bs := e.blockScratch[:0]
	add := func(b *block) {
		if len(b.deps()) == 0 || !e.noDepLend {
			bs = append(bs, b)
		}
	}
	if l != nil {
		l.eachAtLeast(e.gran, add)
	} else {
		for _, o := range p.lists {
			o.eachAtLeast(e.gran, add)
		}
	}
	slices.SortFunc(bs, func(x, y *block) int { return cmp.Compare(x.addr, y.addr) })
	e.blockScratch = bs
	return bs
}

// dropScratch clears freeByAddr's slice, so that it holds no block.
func (e *stitching) dropScratch() { clear(e.blockScratch) }

// pickIn returns the runs of the alias a (stitchAlias.runs), in its order, each with the block
// of bs (sorted by address) it lies wholly in; nil when one lies in none. A run's chunks lie back
// to back, and two free blocks of a granule or more never do (they coalesce, across lists too:
// joins, where the granularity is at least half of poolCrossCoalesceMin): so the run lies in one
// block when each of its chunks lies in one (below that, a run over two blocks is found in
// none, and the alias is not reused). Looking each run up
// among the free blocks costs less than listing every chunk of every free block (stitchCands) in
// a pool of many chunks, and lending a run as one block less than lending its chunks one by one;
// an alias's chunks, mapped by a few growths, form far fewer runs than chunks.
func pickIn(a *stitchAlias, bs []*block) []chunkCand {
	// First whether every run lies in one (most aliases looked at do not), then the blocks.
	at := -1
	for _, r := range a.runs {
		if at = blockOf(bs, r, at); at < 0 {
			return nil
		}
	}
	pick := make([]chunkCand, len(a.runs))
	at = -1
	for i, r := range a.runs {
		at = blockOf(bs, r, at)
		pick[i] = chunkCand{r, bs[at]}
	}
	return pick
}

// runsOf merges the chunks pick (in an alias's order, each with its free block or none) into the
// alias's runs (stitchAlias.runs), each with the block of its first chunk (a run's chunks lie in
// one where the granularity is at least half of poolCrossCoalesceMin: see pickIn and lendRuns).
func runsOf(pick []chunkCand) []chunkCand { return mergeRuns(pick, false) }

// mergeRuns is runsOf; with byBlock, only chunks of the same free block are merged.
func mergeRuns(pick []chunkCand, byBlock bool) []chunkCand {
	var runs []chunkCand
	for i, c := range pick {
		if i > 0 {
			if last := &runs[len(runs)-1]; last.c.end() == c.c.addr && (!byBlock || last.b == c.b) {
				last.c.size += c.c.size
				continue
			}
		}
		runs = append(runs, chunkCand{vmChunk{addr: c.c.addr, size: c.c.size}, c.b})
	}
	return runs
}

// aliasRuns returns the runs of the alias chunks (stitchAlias.runs).
func aliasRuns(chunks []vmChunk) []vmChunk {
	cs := make([]chunkCand, len(chunks))
	for i, c := range chunks {
		cs[i].c = c
	}
	return runChunks(runsOf(cs))
}

// runChunks returns the runs of runs without their blocks.
func runChunks(runs []chunkCand) []vmChunk {
	rs := make([]vmChunk, len(runs))
	for i, r := range runs {
		rs[i] = r.c
	}
	return rs
}

// blockOf returns the index of the block of bs (sorted by address, disjoint) that holds the
// chunk c wholly, or -1. hint is the index the previous chunk of an alias was found at (or -1):
// an alias's chunks often lie in one block, or in address order.
func blockOf(bs []*block, c vmChunk, hint int) int {
	lo, hi := 0, len(bs) // the last block starting at or below c.addr is in [lo-1, hi)
	if hint >= 0 {
		if bs[hint].addr <= c.addr {
			lo = hint + 1
		} else {
			hi = hint
		}
	}
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if bs[m].addr <= c.addr {
			lo = m + 1
		} else {
			hi = m
		}
	}
	j := lo - 1
	if j < 0 || c.end() > bs[j].end() {
		return -1
	}
	return j
}

// lendAlias makes the kept alias a live again for an n-byte request on l's stream: its chunks,
// listed in pick in its order as runs with the free blocks they lie in (pickIn), are lent out of
// those blocks' lists. A run lent out of another stream's list names that list among the deps
// that pass to the stitched block (Allocate makes l's stream wait for them). No driver call.
func (e *stitching) lendAlias(a *stitchAlias, n int, l *freeList, pick []chunkCand) *block {
	end := e.endAt()
	a.lent = e.lendNaming(pick, l)
	return e.stitchedBlock(a, n, l, end)
}

// stitchedBlock makes the block of the alias a, whose chunks were just lent out of l, for n
// bytes; end is where the chain's end stood before they were (endAt). The lent blocks' deps
// pass to it (Allocate waits for them; restoreLentDeps gives them back if a wait fails).
func (e *stitching) stitchedBlock(a *stitchAlias, n int, l *freeList, end DevicePtr) *block {
	p := e.p
	b := p.newBlock(a.va, n)
	b.free, b.served = false, true
	for _, h := range a.lent {
		p.forgetDropped(h)
		p.mergeDeps(b, h)
	}
	if len(b.deps()) > 0 {
		e.stitchedDeps++
	}
	a.b = b
	a.from = l
	l.depRefs++
	e.stitchTick++
	a.used = e.stitchTick
	e.noteEnd(a, stitchEnd{end, n})
	// Allocate counts n: the chunks' bytes beyond it are held too (PoolSize = free + live).
	p.liveBytes += a.size - n
	return b
}

// lendNaming lends the runs of chunks pick for l's stream (lendChunks); a block lent out of
// another stream's list names that list among its deps, which pass to the stitched block
// (stitchedBlock): Allocate waits for them.
func (e *stitching) lendNaming(pick []chunkCand, l *freeList) []*block {
	p := e.p
	var from []*freeList // by index in pick: the other stream's list it is lent out of
	for i, c := range pick {
		if o := c.b.list; o != l {
			if from == nil {
				from = make([]*freeList, len(pick))
			}
			from[i] = o
		}
	}
	lent := e.lendChunks(pick)
	for i, o := range from {
		if o != nil {
			p.addDep(lent[i], o)
		}
	}
	return lent
}

// lendChunks takes the runs of chunks pick (each wholly in the free block given beside it, as
// listed when chosen, with no unlock since) out of their blocks' lists and returns the lent block
// over each, in the order of pick. The parts of their free blocks around them stay free in the
// same lists.
func (e *stitching) lendChunks(pick []chunkCand) []*block {
	p := e.p
	order := make([]int, len(pick))
	for i := range order {
		order[i] = i
	}
	// Highest address first: lending a chunk out of a free block leaves the block's lower part,
	// with its lower chunks, in the same block (as unmapChunks does).
	slices.SortFunc(order, func(x, y int) int { return cmp.Compare(pick[y].c.addr, pick[x].c.addr) })
	lent := make([]*block, len(pick))
	for _, i := range order {
		c, b := pick[i].c, pick[i].b
		l := b.list
		l.remove(b)
		if end := c.end(); end < b.end() {
			r := p.newBlock(end, int(b.end()-end))
			b.size -= r.size
			p.linkAfter(b, r)
			p.copyDeps(r, b)
			l.insert(r)
		}
		h := b
		if c.addr > b.addr {
			h = p.newBlock(c.addr, c.size)
			b.size = int(c.addr - b.addr)
			p.linkAfter(b, h)
			p.copyDeps(h, b)
			l.insert(b)
		}
		h.free, h.lent = false, true
		lent[i] = h
	}
	return lent
}

// restoreLentDeps gives the blocks lent under the stitched block b the deps in deps that are still
// lists of the pool (Allocate's wait for them failed: the chunks go back unused).
func (e *stitching) restoreLentDeps(b *block, deps []*freeList) {
	p := e.p
	for _, h := range e.aliases[b.addr].lent {
		p.restoreDeps(h, deps)
	}
}

// unlend frees the lent blocks into l, as a free of their memory on l's stream.
func (e *stitching) unlend(lent []*block, l *freeList) *block {
	p := e.p
	var last *block
	for _, h := range lent {
		h.lent = false
		last = p.freeInto(l, h)
	}
	return last
}

// lendRuns lends the runs (runsOf(pick)) of the chunks pick for l's stream (lendNaming) and
// returns the lent block over each. Two free blocks of a granule or more that lie back to back
// coalesce, across lists too, only when they make poolCrossCoalesceMin together (joins): with a
// granularity below half of that, a run's chunks may lie in free blocks of two lists. Such a run
// is lent block by block, and the lent pieces joined into one lent block with their deps; lent
// as the block of its first chunk, the rest of the run would stay free in its list, mapped in
// the stitched range and handed out again.
func (e *stitching) lendRuns(pick, runs []chunkCand, l *freeList) []*block {
	parts := mergeRuns(pick, true)
	if len(parts) == len(runs) {
		return e.lendNaming(runs, l)
	}
	p := e.p
	pieces := e.lendNaming(parts, l)
	lent := make([]*block, 0, len(runs))
	j := 0
	for _, r := range runs {
		h := pieces[j]
		for j++; h.end() < r.c.end(); j++ {
			p.mergeDeps(h, pieces[j]) // pieces[j] is h.next: the next piece of the run
			p.recycle(p.absorbNext(h))
		}
		lent = append(lent, h)
	}
	return lent
}

// newAlias lends the chunks pick (holding at least n bytes) out of their lists for l's stream
// (another stream's list named among the stitched block's deps), maps them back to back into a
// new reservation and returns the stitched block over it; nil when a driver call failed (the
// chunks are then free in l again, with those deps, and the caller grows). The driver calls are made unlocked,
// the lent blocks out of every list meanwhile.
func (e *stitching) newAlias(pick []chunkCand, n int, l *freeList) *block {
	p := e.p
	chunks := make([]vmChunk, len(pick))
	size := 0
	for i, c := range pick {
		chunks[i] = c.c
		size += c.c.size
	}
	end := e.endAt()
	runs := runsOf(pick)
	lent := e.lendRuns(pick, runs, l)
	p.mu.Unlock()
	va, err := e.vm.reserve(size)
	if err == nil {
		at := va
		for _, c := range chunks {
			if err = e.vm.mapAt(at, c.size, c.h); err != nil {
				break
			}
			at += DevicePtr(c.size)
		}
		if err == nil {
			err = e.vm.setAccess(va, size)
		}
		if err != nil {
			if at > va {
				if uerr := e.vm.unmap(va, int(at-va)); uerr != nil {
					// The handles stay mapped there: the reservation cannot be freed either, and
					// both are lost to the pool (the memory itself stays in the chain).
					DebugLogger().Warn("rmm: PoolMemoryResource (expandable): a stitched range could not be unmapped after a failed stitch", "address", fmt.Sprintf("%#x", uintptr(va)), "bytes", size, "err", uerr)
					at = va
				}
			}
			if at > va || e.vm.free(va, size) != nil {
				va = 0
			}
		}
	}
	p.mu.Lock()
	if err != nil {
		DebugLogger().Debug("rmm: PoolMemoryResource (expandable): stitching failed; growing instead", "request", n, "bytes", size, "err", err)
		e.unlend(lent, l)
		return nil
	}
	a := &stitchAlias{va: va, seq: e.stitches, size: size, chunks: chunks, runs: runChunks(runs), lent: lent}
	e.addAlias(a)
	e.stitches++
	return e.stitchedBlock(a, n, l, end)
}

// freeStitched frees the stitched block b on l's stream (out of the live table; Deallocate has
// made the event or dirty flag cover the free): its chunks return to l as free memory, the alias
// is kept. It returns the last block freed into l.
//
// The free orders l's stream after the uses of b's n bytes only: the chunks' bytes beyond them
// (the last chunk's tail) were never used, and their last frees, which the allocating stream
// was made to wait for (the merges into its list before stitching, the deps of the lent
// blocks), may be other streams' frees that l's stream is not ordered after. Freed on another
// stream than the allocating one, a chunk holding such bytes names the allocating stream's
// list among its deps (whose event, recorded after those waits, covers them), as a block
// coalesced across streams does; after Close every stream was synchronised.
func (e *stitching) freeStitched(l *freeList, b *block) *block {
	p := e.p
	a := e.aliases[b.addr]
	p.liveBytes -= a.size // b.size, and the chunks' bytes beyond it (stitchedBlock)
	lent, from := a.lent, a.from
	a.lent, a.b, a.from = nil, nil, nil
	if from != nil {
		if from != l && !p.closed {
			at := 0 // the lent blocks lie back to back in the alias
			for _, h := range lent {
				at += h.size
				if at > b.size {
					p.addDep(h, from)
				}
			}
		}
		from.depRefs--
	}
	p.recycle(b)
	return e.unlend(lent, l)
}

// growTail maps k more bytes at the end of the chain (within the reservation and the maximum)
// and frees them into l, where they coalesce with a free block at the end. It reports whether
// it did. Pool locked, busy token held, l pinned; the driver calls are made unlocked.
func (e *stitching) growTail(k int, l *freeList) bool {
	p := e.p
	if room := min(int(e.base+DevicePtr(e.reserved)-e.top), p.maximum-p.size); k > room {
		return false
	}
	at, size := e.top, p.size
	p.mu.Unlock()
	cs, err := e.mapChunkUnlocked(at, k, size)
	p.mu.Lock()
	if err != nil {
		DebugLogger().Debug("rmm: PoolMemoryResource (expandable): growing the rest of a stitch failed", "bytes", k, "err", err)
		return false
	}
	p.freeInto(l, e.appendChunk(at, k, cs))
	return true
}

// evictAliases unmaps the least recently used quarter of the kept aliases that are not live,
// after waiting (on the host) for the work behind every free, since an unmap does not wait for
// the device and the work of the stream that freed a stitched block may still use its range. It
// reports whether it unlocked the pool. Pool locked, busy token held.
func (e *stitching) evictAliases() bool {
	p := e.p
	var idle []*stitchAlias
	for _, a := range e.aliases {
		if a.b == nil {
			idle = append(idle, a)
		}
	}
	if len(idle) == 0 {
		return false
	}
	if err := p.syncAll(false); err != nil {
		DebugLogger().Debug("rmm: PoolMemoryResource (expandable): waiting for the streams before evicting stitched ranges failed; keeping them", "err", err)
		return true
	}
	p.clearAllDeps() // every stream's work behind the frees is done
	slices.SortFunc(idle, func(x, y *stitchAlias) int { return cmp.Compare(x.used, y.used) })
	idle = idle[:min(len(idle), max(1, len(e.aliases)/4))]
	var victims []*stitchAlias
	for _, a := range idle {
		if a.b == nil { // not stitched again while syncAll unlocked (keptAtEnd needs no token)
			victims = append(victims, a)
		}
	}
	e.dropAliases(victims, false)
	return true
}

// dropAliases unmaps the aliases as (none live; the work behind their last frees known done) and
// frees their reservations; without hold the calls are made unlocked (busy token held). An alias
// that cannot be unmapped stays, kept.
func (e *stitching) dropAliases(as []*stitchAlias, hold bool) {
	p := e.p
	if len(as) == 0 {
		return
	}
	for _, a := range as {
		e.removeAlias(a)
	}
	p.unlockUnless(hold)
	failed := make([]bool, len(as))
	for i, a := range as {
		err := e.vm.unmap(a.va, a.size)
		if err == nil {
			err = e.vm.free(a.va, a.size)
			if err != nil {
				// Unmapped: the handles are no longer in it, only the address space is lost.
				DebugLogger().Warn("rmm: PoolMemoryResource (expandable): freeing a stitched range's reservation failed", "address", fmt.Sprintf("%#x", uintptr(a.va)), "bytes", a.size, "err", err)
			}
			continue
		}
		failed[i] = true
		DebugLogger().Warn("rmm: PoolMemoryResource (expandable): unmapping a stitched range failed; it stays", "address", fmt.Sprintf("%#x", uintptr(a.va)), "bytes", a.size, "err", err)
	}
	p.relockUnless(hold)
	for i, a := range as {
		if failed[i] {
			e.addAlias(a)
		} else {
			e.evicted++
		}
	}
}

// unmapAliasesOver unmaps the kept aliases that map one of the chunks cands, which
// releaseChunks is to give back (a handle goes back only once every alias of it is unmapped),
// and returns the chunks that can go: cands less those of an alias that could not be unmapped,
// each with the free block of def it lies in now. Pool locked, busy token held; without hold it
// unlocks.
func (e *stitching) unmapAliasesOver(def *freeList, cands []chunkCand, hold bool) []chunkCand {
	p := e.p
	if as := e.aliasesOver(cands); len(as) > 0 {
		// The kept aliases over them go first, unlocked without hold. Meanwhile the blocks
		// holding the chunks stay out of def, as unmapChunks keeps them: memory freed into def
		// then (on the default stream, or merged from a closing stream's list), whose work no
		// wait covered, must neither be given back with them nor coalesce into them, and no
		// one may take them, or lend them through an alias.
		blocks := pullBlocks(def, cands)
		p.pin(def)
		e.dropAliases(as, hold)
		p.unpin(def)
		for _, b := range blocks {
			p.freeInto(def, b)
		}
		// The same chunks, in the free blocks they lie in now; those of an alias that could
		// not be unmapped stay.
		cands = e.unaliased(e.chunksFreeIn(def, cands))
	}
	return cands
}

// aliasesOver returns the aliases (not live) that map one of the chunks cands: before those are
// given back, these must be unmapped (dropAliases), as a handle goes back only once every alias
// of it is unmapped.
func (e *stitching) aliasesOver(cands []chunkCand) []*stitchAlias {
	if len(e.aliases) == 0 || len(cands) == 0 {
		return nil
	}
	in := make(map[vmmHandle]bool, len(cands))
	for _, c := range cands {
		in[c.c.h] = true
	}
	var as []*stitchAlias
	for _, a := range e.aliases {
		if a.b != nil {
			continue
		}
		for _, c := range a.chunks {
			if in[c.h] {
				as = append(as, a)
				break
			}
		}
	}
	return as
}

// unaliased returns cands less the chunks an alias still maps.
func (e *stitching) unaliased(cands []chunkCand) []chunkCand {
	if len(e.aliases) == 0 {
		return cands
	}
	mapped := map[vmmHandle]bool{}
	for _, a := range e.aliases {
		for _, c := range a.chunks {
			mapped[c.h] = true
		}
	}
	return slices.DeleteFunc(cands, func(c chunkCand) bool { return mapped[c.c.h] })
}

// dropIdleAliases drops every alias not live (Close; the work behind every free waited for).
func (e *stitching) dropIdleAliases(hold bool) {
	var as []*stitchAlias
	for _, a := range e.aliases {
		if a.b == nil {
			as = append(as, a)
		}
	}
	e.dropAliases(as, hold)
}

// stitchedPieces returns, for [ptr, ptr+n) inside a live stitched block, where its alias starts
// and the handles mapped there (for ExportIPC); nil pieces when ptr is in no stitched range.
func (e *stitching) stitchedPieces(ptr DevicePtr, n int) (DevicePtr, []vmmPiece, error) {
	p := e.p
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, a := range e.aliases {
		if ptr < a.va || ptr >= a.va+DevicePtr(a.size) {
			continue
		}
		if err := p.checkLiveRange(ptr, n); err != nil {
			return 0, nil, err
		}
		pieces := make([]vmmPiece, len(a.chunks))
		off := 0
		for i, c := range a.chunks {
			pieces[i] = vmmPiece{offset: off, size: c.size, h: c.h}
			off += c.size
		}
		return a.va, pieces, nil
	}
	return 0, nil, nil
}

// checkStitches verifies the stitched blocks and the lent blocks (CheckInvariants): every live
// alias's block is live and stitched, its lent blocks are in the chain exactly over its chunks,
// no chunk is lent twice, every lent block of the chain belongs to a live alias, every chunk of
// an alias is a chunk of the pool; it returns the bytes live aliases hold beyond their blocks.
func (e *stitching) checkStitches(lentSeen map[*block]bool) (int, error) {
	p := e.p
	owner := map[*block]*stitchAlias{}
	slack := 0
	chunkAt := make(map[DevicePtr]vmChunk, len(e.chunks))
	for _, c := range e.chunks {
		chunkAt[c.addr] = c
	}
	stitchedLive := 0
	for va, a := range e.aliases {
		if a.va != va {
			return 0, errorf("stitched range %#x indexed at %#x", uintptr(a.va), uintptr(va))
		}
		sum := 0
		for _, c := range a.chunks {
			if pc, ok := chunkAt[c.addr]; !ok || pc.h != c.h || pc.size != c.size {
				return 0, errorf("stitched range %#x maps a handle at %#x that is not the pool's chunk there", uintptr(va), uintptr(c.addr))
			}
			sum += c.size
		}
		if sum != a.size {
			return 0, errorf("stitched range %#x holds %s of chunks, says %d", uintptr(va), bytesText(sum), a.size)
		}
		if !slices.Equal(a.runs, aliasRuns(a.chunks)) {
			return 0, errorf("stitched range %#x: its runs are not those of its chunks", uintptr(va))
		}
		if a.b == nil {
			if a.lent != nil || a.from != nil {
				return 0, errorf("kept stitched range %#x has lent blocks or names a list", uintptr(va))
			}
			continue
		}
		if a.from == nil {
			return 0, errorf("live stitched range %#x names no list", uintptr(va))
		}
		stitchedLive++
		if p.live.get(va) != a.b || !a.b.served || a.b.size > a.size {
			return 0, errorf("stitched range %#x: its block is not live, not stitched or larger than it", uintptr(va))
		}
		slack += a.size - a.b.size
		if len(a.lent) != len(a.runs) {
			return 0, errorf("stitched range %#x has %d lent blocks for %d runs of chunks", uintptr(va), len(a.lent), len(a.runs))
		}
		for i, h := range a.lent {
			if owner[h] != nil {
				return 0, errorf("block %#x is lent to two stitched ranges", uintptr(h.addr))
			}
			owner[h] = a
			if !h.lent || h.free || h.addr != a.runs[i].addr || h.size != a.runs[i].size || !lentSeen[h] {
				return 0, errorf("stitched range %#x: lent block %#x is not its run's, or not in the chain", uintptr(va), uintptr(h.addr))
			}
		}
	}
	for h := range lentSeen {
		if owner[h] == nil {
			return 0, errorf("lent block %#x belongs to no live stitched range", uintptr(h.addr))
		}
	}
	if len(e.bySize) != len(e.aliases) || !slices.IsSortedFunc(e.bySize, aliasOrder) {
		return 0, errorf("the %d stitched ranges by size are not the %d stitched ranges, sorted", len(e.bySize), len(e.aliases))
	}
	for _, a := range e.bySize {
		if e.aliases[a.va] != a {
			return 0, errorf("stitched range %#x is listed by size but not kept", uintptr(a.va))
		}
	}
	for r, as := range e.endIndex {
		for _, a := range as {
			if e.aliases[a.va] != a || !slices.Contains(a.ends[:], r) {
				return 0, errorf("stitched range %#x indexed under an end it does not hold", uintptr(a.va))
			}
		}
	}
	for _, a := range e.aliases {
		for _, r := range a.ends {
			if r.at != 0 && !slices.Contains(e.endIndex[r], a) {
				return 0, errorf("stitched range %#x: an end it holds is not indexed", uintptr(a.va))
			}
		}
	}
	stitchedBlocks := 0
	p.live.each(func(b *block) {
		if b.served {
			stitchedBlocks++
		}
	})
	if stitchedBlocks != stitchedLive {
		return 0, errorf("%d stitched blocks live, %d stitched ranges live", stitchedBlocks, stitchedLive)
	}
	return slack, nil
}
