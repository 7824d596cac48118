package rmm

import (
	"errors"
	"math"
	"sync"
	"sync/atomic"
)

// How the pool works (see the type's doc for the contract).
//
// A freed block also coalesces at once with free neighbours in other streams' lists when the two
// make at least 1 MiB: the merged block goes to the list of the stream that freed it, and whoever
// takes it (on any stream) first waits, on the device, for an event recorded on each of the other
// streams whose memory it holds (cuEventRecord, cuStreamWaitEvent), as for a take from another
// stream's list.
//
// Allocate rounds the size up to 256 bytes and then, in order: (1) takes the best fit (smallest
// free block that is large enough, lowest address among equals) from the stream's own free list;
// (2) else takes a block that fits from another stream's list, after making the allocating stream
// wait (on the device, the host does not block) for an event recorded on that stream; (3) else
// merges other streams' whole lists into its own one by one, after the same wait, retrying after
// each; (4) else grows the pool by taking a new block from the upstream (growth policy as librmm:
// without a maximum, at least double the pool; with one, half the remaining headroom; a failing
// upstream is retried with halved sizes down to the request); (5) else, when the upstream refused
// even the request for want of memory or the maximum stopped the pool, gives every wholly free
// upstream block back (as Release does, after waiting on the host for the streams' work behind the
// frees) and tries (4) once more before it fails. Blocks from different upstream allocations never
// coalesce.
//
// Per-stream caches: the default stream and each of our own Streams have a small cache (up to 16
// blocks) under a lock of their own, so that goroutines allocating and freeing on their own
// streams do not contend for the pool's mutex. The rule: a freed block goes to the stream's cache
// when it is at most 1 MiB and the stream recently asked for that size (one of the last four
// sizes its cache could not serve); a request on that stream of exactly that rounded size takes
// it back. For example, a loop that allocates and frees 64 KiB on one stream takes the pool's
// mutex for its first allocation and free only. A cached block is free memory that has not
// coalesced yet: an allocation on the stream that its cache cannot serve first returns the
// stream's cached blocks to its list, so best fit sees them; before the pool looks at other
// streams' lists (so before it grows or fails), and in Release and Close, every cache returns its
// blocks; a Stream's Close returns its cache's blocks and moves its free list to DefaultStream's.
// Stats counts cached blocks as free (PoolStats.CachedBlocks).
//
// Events: on the default stream and on our own Streams, whose lifetime the package knows, the
// event is recorded only when another stream takes the blocks (Stream.Close records it first if
// needed); on streams made from foreign handles (NewStreamView) it is recorded at every free.
// Best fit is O(log n) in the number of free blocks (a treap per stream ordered by size and
// address); coalescing is O(1) plus the treap updates, since every block links to its address
// neighbours within its upstream allocation; a free finds its block in the live table
// (live_table.go), as a rule in one cache line.
//
// Expandable pools (PoolOptions.Expandable) keep all of the above but take their memory from one
// virtual address range reserved for the maximum size: growth maps a chunk of physical memory
// right after the end of what is mapped (or into a hole that Release left), so the free block at
// the end simply grows and free neighbours coalesce across growth steps. A growth maps one chunk
// of what the request needs beyond the free block it extends, but at least 32 MiB and at least a
// sixteenth of the pool (at most 1 GiB unless the request needs more), rounded up to the
// granularity (2 MiB on current GPUs) — or, when the pool's free bytes already hold the request
// (no free block is large enough), only what the request needs, at least 8 MiB; when the device
// refuses, the chunk is halved down to what the request needs. Release waits for the work behind
// every free, then unmaps and releases each
// chunk that lies wholly in free memory, leaving a hole (a hole at the end shortens the range);
// ReleaseThreshold does the same by itself past a threshold. Out-of-memory errors are
// *OutOfMemoryError with the pool's figures, and say whether the pool is exhausted or fragmented.
//
// Deallocate detects a pointer the pool never handed out, a double free and a size different from
// the one allocated, and returns ErrInvalidFree without changing anything. Safe for concurrent use
// (one mutex, plus one per stream cache; no CUDA call is made under them on the common path).
//
// The slow driver calls are made with the mutex unlocked: growth (the upstream's Allocate, or the
// expandable pool's cuMemCreate, cuMemMap and cuMemSetAccess), the record and wait of a
// cross-stream take or merge, and Release's and the trim's host synchronisation and frees
// (cuMemFree, cuMemUnmap, cuMemRelease). Allocations and frees that fit in free memory go on
// meanwhile; one growth or release runs at a time, and an allocation that needs to grow waits
// for the one in flight, then searches again. Still made under the mutex, being short or rare:
// the event record of each free on a stream made with NewStreamView, the first use of a stream
// (cuEventCreate) and the end of its list (cuEventDestroy), a Stream's Close (one record and
// wait), frees after Close (synchronisation), Close itself, and the synchronisation of a cached
// block's stream when it has no list.

// PoolOptions configures NewPoolMemoryResource. nil means the defaults.
type PoolOptions struct {
	// InitialPoolSize is the number of bytes taken from the upstream at construction, in one
	// allocation on the default stream. It must be a multiple of 256. Default 0: nothing is taken
	// until the first allocation. (librmm's Python API defaults to half the free device memory:
	// PercentOfFreeDeviceMemory(50) gives that.)
	InitialPoolSize int
	// MaximumPoolSize caps the bytes the pool takes from its upstream. It must be a multiple of 256
	// and at least InitialPoolSize. Default 0: no maximum, and PoolStats.MaximumPoolSize is 0 —
	// except for an expandable pool, which reserves its range for the device's total memory (the
	// host's without a GPU; over a SimulatedMemoryResource, its capacity). An expandable pool
	// reports the size it reserved (this, or that default), rounded up to the granularity.
	MaximumPoolSize int
	// Expandable makes the pool map its own memory into one virtual address range of
	// MaximumPoolSize bytes, reserved at construction (cuMemAddressReserve), growing by chunks of
	// physical memory (cuMemCreate, cuMemMap, cuMemSetAccess), so that free neighbours always
	// coalesce; Release gives back (cuMemUnmap, cuMemRelease) every chunk that holds no live
	// block. The upstream only names where the memory comes from: nil (the current device, or
	// host memory without CUDA), a [CudaMemoryResource], the [SystemMemoryResource] or a
	// [SimulatedMemoryResource] (addresses only); another is [ErrInvalidArgument]. Sizes are
	// rounded up to the granularity (2 MiB on current GPUs). Default false.
	Expandable bool
	// ReleaseThreshold (Expandable only, else [ErrInvalidArgument]) is the most free memory, in
	// bytes, the pool keeps mapped: a Deallocate that leaves more free (plus one minimum chunk)
	// waits on the host for the streams' work and gives back whole free chunks, highest first. A
	// trim that fails is written to the debug log; the free succeeds. Default 0: never by itself.
	ReleaseThreshold int
	// Stitch (Expandable only, else [ErrInvalidArgument]) keeps the memory mapped close to what
	// is live when request sizes keep changing, for a slower first pass: growths map several
	// pieces (of a granule at least, larger for large growths and large requests), and a request
	// that no free block holds is served by mapping free pieces a second time, back to back, into
	// a range of its own (kept for reuse; [ExportIPC] exports its pieces). Over host memory each
	// piece is a memfd, one open file descriptor, and pieces are made large enough that the pool
	// holds at most half of the process's limit on open files at its maximum size. Default false
	// ([StitchingPool] is the kind Reinitialize builds by default). BENCHMARKS.md gives the
	// footprints and the first pass's cost.
	Stitch bool
	// Exportable (Expandable over device memory only) creates the physical memory exportable as
	// POSIX file descriptors, for [PoolMemoryResource.ExportIPC]; [ErrNotSupported] when the
	// device, the driver or host memory cannot. Default false (a plain pool exports through its
	// upstream).
	Exportable bool
	// MemoryProfile, when set, makes the pool record a sample of its own allocations in it, as a
	// [MemoryProfileResourceAdaptor] over the pool would (each allocation of n bytes with
	// probability 1-exp(-n/rate)), at less cost; the stacks start at Allocate's caller. A profile
	// may be shared. Default nil: no profile.
	MemoryProfile *MemoryProfile
}

// poolBacking is where a pool's memory comes from and goes back to: upstream blocks
// (upstreamBacking), chunks mapped onto one reserved range (expandable) or pieces mapped onto one
// range plus stitched ranges (stitching). Placement calls it on its slow paths only, pool locked;
// a method may unlock the pool for driver calls where it says so, holding the busy token (see
// pool_placement.go).
type poolBacking interface {
	// grow makes room for an n-byte request on s, whose list l is pinned (placement found no free
	// block that holds it): it returns a free block of at least n bytes out of every list, or
	// nil when it grew but the request must search again (what it grew is then free in l). Busy
	// token held; it may unlock.
	grow(n int, s StreamView, l *freeList) (*block, error)
	// releaseMayHelp reports whether giving every wholly free range back could let a growth the
	// pool's maximum refused succeed (placement has checked the rest: see releaseMayHelp).
	releaseMayHelp() bool
	// release gives back what lies wholly in free blocks of def, into which every list was
	// merged after a host wait for the work behind the frees. Busy token held; without hold it
	// may unlock, the blocks it gives back out of every list meanwhile.
	release(def *freeList, hold bool) error
	// trim is called after a free that left the free block b while the pool's free bytes exceed
	// PoolMemoryResource.trimAt; it gives memory back as the backing's threshold says.
	trim(b *block)
	// releaseAfterClose gives back what it can after the free of b (now free in the one list
	// left after Close), pool locked throughout.
	releaseAfterClose(b *block) error
	// close gives back what the backing holds beyond the blocks (Close; every free waited for).
	close() error

	// serveAtEnd may serve an n-byte request on l's stream whose best fit is the free block t at
	// the end of the chain (tailLast pools) otherwise: it returns a live block marked served, or
	// nil. No unlock.
	serveAtEnd(n int, l *freeList, t *block) *block
	// freeServed frees a served block b (out of the live table) on l's stream, and returns the
	// last block it freed into l. servedFrom is the list a live served block was made for (nil:
	// none), restoreServedDeps gives back the deps a failed wait took from it.
	freeServed(l *freeList, b *block) *block
	servedFrom(b *block) *freeList
	restoreServedDeps(b *block, deps []*freeList)

	// stats fills in the backing's figures (UpstreamBlocks, Reserved, Holes, HoleBytes).
	stats(st *PoolStats)
	// checkServed verifies the served blocks (served of them live), adds the lists they name to
	// deps, and returns the bytes they hold beyond their sizes; checkChain verifies the chains
	// against every block of the pool, all (CheckInvariants).
	checkServed(served int, deps map[*freeList]int) (int, error)
	checkChain(all map[DevicePtr]*block, served int) error
	// exportIPC exports [ptr, ptr+n), which lies in one live allocation (ExportIPC).
	exportIPC(ptr DevicePtr, n int) (*IPCHandle, error)
}

// noServing is the part of poolBacking of a backing that serves no request otherwise.
type noServing struct{}

func (noServing) serveAtEnd(int, *freeList, *block) *block { return nil }
func (noServing) servedFrom(*block) *freeList              { return nil }
func (noServing) restoreServedDeps(*block, []*freeList)    {}

func (noServing) freeServed(*freeList, *block) *block {
	panic("rmm: internal error: a pool block marked served by a backing that serves none")
}

func (noServing) checkServed(served int, _ map[*freeList]int) (int, error) {
	if served > 0 {
		return 0, errorf("%d served blocks in a pool whose backing serves none", served)
	}
	return 0, nil
}

// poolStreams is the pool's registry of per-stream free lists (stream_order.go), named so that go
// doc leaves the embedded field out, as it does any unexported field.
type poolStreams = streamLists[*freeList]

// PoolMemoryResource is a coalescing best-fit sub-allocator with librmm's pool semantics: it
// takes memory in large blocks (from an upstream [MemoryResource], or mapped by itself with
// [PoolOptions].Expandable) and cuts it into allocations, rounded up to [Alignment] (256 bytes)
// and aligned to it. Memory freed on a stream is reused on that stream at once; on another
// stream only after that stream waits, on the device, for the freeing stream (cuEventRecord,
// cuStreamWaitEvent). When no free block holds a request the pool grows, and before it fails it
// gives back what is wholly free and tries once more: a failure is an *[OutOfMemoryError]
// ([ErrOutOfMemory]). Deallocate returns [ErrInvalidFree] for a pointer it did not hand out, a
// second free or another size, changing nothing; after [PoolMemoryResource.Close] Allocate
// returns [ErrClosed]; a pool not made by [NewPoolMemoryResource] returns [ErrInvalidArgument].
// Safe for concurrent use; the driver's slow calls are made without holding the pool's lock.
type PoolMemoryResource struct {
	upstream MemoryResource
	maximum  int // 0 = unbounded

	mu sync.Mutex
	// The per-stream free lists, with the device, its context and the driver (stream_order.go).
	poolStreams
	// lastList is the list byStream gave last (nil at first): while it is not dropped it is
	// still its stream's, so that a run of calls on one stream finds its list with no map
	// lookup (listOf).
	lastList   *freeList
	size       int        // bytes taken from upstream
	live       blockTable // allocated blocks by address
	liveBytes  int        // sum of the rounded sizes of live allocations
	peakLive   int        // the highest liveBytes seen
	spare      []*block
	closed     bool
	closedList *freeList // after Close: the one list left

	// backing is where the memory comes from and goes back to (poolBacking). Placement reaches
	// it only through that interface; what placement itself must do differently for a backing
	// is set below at construction.
	backing poolBacking
	name    string // for messages: "PoolMemoryResource", or with the backing's kind
	// chained: every block lies in one chain (a backing that maps one range), whose ends head
	// and tail link and unlink keep; else each upstream allocation is a chain of its own.
	chained    bool
	head, tail *block
	// tailLast: placement serves the free block at the end of the chain only when no other free
	// block holds the request (findEndLast), and asks the backing first (serveAtEnd).
	tailLast bool
	// trimAt: a free that leaves more free bytes than this asks the backing to trim (0: never).
	trimAt int

	// The slow paths that unlock the mutex for driver calls (pool_placement.go).
	busy    bool // a growth or release is in flight
	busyQ   []*busyWaiter
	pinned  int       // pins over all lists
	merging int       // merges in flight whose blocks are in no list
	cond    sync.Cond // on mu: progress of the above
	waiters int

	sizeAtomic atomic.Int64
	peakSize   int // the most bytes held at once

	// caches is read by every allocation and free on a stream's fast path; the fields around
	// it are written under mu. The pads keep it on a line of its own, so that the slow path of
	// one stream does not take that line from the cores running the fast paths of the others.
	_      [64]byte
	caches atomic.Pointer[streamSet[*poolCache]] // per-stream caches (pool_cache.go)
	// prof is PoolOptions.MemoryProfile, never changed after construction, read beside caches.
	prof *MemoryProfile
	_    [48]byte
	// profLeft is the bytes still to allocate, outside the caches, before the next sample
	// (pool locked; see MemoryProfile.take).
	profLeft int
}

// NewPoolMemoryResource returns a pool over upstream (nil: the current device resource; for an
// expandable pool nil names the current device itself, whatever resource is current, see
// PoolOptions.Expandable). Sizes
// are validated as librmm does: both multiples of 256 and initial ≤ maximum, else
// ErrInvalidArgument. When InitialPoolSize is positive that many bytes are taken from the upstream
// now; its failure is returned.
func NewPoolMemoryResource(upstream MemoryResource, opts *PoolOptions) (*PoolMemoryResource, error) {
	var o PoolOptions
	if opts != nil {
		o = *opts
	}
	given := upstream
	upstream = resourceOrCurrent(upstream)
	switch {
	case o.InitialPoolSize < 0 || o.MaximumPoolSize < 0:
		return nil, errorf("NewPoolMemoryResource: negative size (initial %d, maximum %d): %w", o.InitialPoolSize, o.MaximumPoolSize, ErrInvalidArgument)
	case o.InitialPoolSize%Alignment != 0:
		return nil, errorf("NewPoolMemoryResource: InitialPoolSize %d is not a multiple of %s: %w", o.InitialPoolSize, bytesText(Alignment), ErrInvalidArgument)
	case o.MaximumPoolSize%Alignment != 0:
		return nil, errorf("NewPoolMemoryResource: MaximumPoolSize %d is not a multiple of %s: %w", o.MaximumPoolSize, bytesText(Alignment), ErrInvalidArgument)
	case o.MaximumPoolSize > 0 && o.InitialPoolSize > o.MaximumPoolSize:
		return nil, errorf("NewPoolMemoryResource: InitialPoolSize %d exceeds MaximumPoolSize %d: %w", o.InitialPoolSize, o.MaximumPoolSize, ErrInvalidArgument)
	}
	if o.ReleaseThreshold < 0 {
		return nil, errorf("NewPoolMemoryResource: negative ReleaseThreshold %d: %w", o.ReleaseThreshold, ErrInvalidArgument)
	}
	if o.ReleaseThreshold > 0 && !o.Expandable {
		return nil, errorf("NewPoolMemoryResource: ReleaseThreshold needs an Expandable pool: %w", ErrInvalidArgument)
	}
	if o.Exportable && !o.Expandable {
		return nil, errorf("NewPoolMemoryResource: Exportable applies to expandable pools (a plain pool exports what its upstream can): %w", ErrInvalidArgument)
	}
	if o.Stitch && !o.Expandable {
		return nil, errorf("NewPoolMemoryResource: Stitch applies to expandable pools: %w", ErrInvalidArgument)
	}
	if o.Expandable {
		return newExpandablePool(given, nil, o, poolTuning{})
	}
	return newUpstreamPool(upstream, o)
}

// newPool makes the pool's placement over backing, with the pool's size limit maximum (0: none),
// for a memory on dev (pool not yet in use: no locking).
func newPool(upstream MemoryResource, maximum int, o PoolOptions, dev Device) (*PoolMemoryResource, error) {
	p := &PoolMemoryResource{
		upstream: upstream,
		maximum:  maximum,
		name:     "PoolMemoryResource",
		prof:     o.MemoryProfile,
		profLeft: o.MemoryProfile.nextSample(),
	}
	if err := p.initStreams("PoolMemoryResource", dev, p, newFreeList); err != nil {
		return nil, err
	}
	return p, nil
}

// errNotMade is the error of a method called on a PoolMemoryResource that NewPoolMemoryResource
// did not make (its zero value): it has no backing to take memory from.
func errNotMade(op string) error {
	return errorf("PoolMemoryResource.%s: the pool was not made by NewPoolMemoryResource: %w", op, ErrInvalidArgument)
}

// Upstream returns the resource the pool takes its memory from.
func (p *PoolMemoryResource) Upstream() MemoryResource { return p.upstream }

// Device returns the device the pool belongs to (its upstream's).
func (p *PoolMemoryResource) Device() Device { return p.dev }

// Access reports the upstream's access.
func (p *PoolMemoryResource) Access() Access { return AccessOf(p.upstream) }

// PoolSize returns the bytes the pool holds from its upstream (free and allocated); for an
// expandable pool, the bytes of physical memory mapped.
func (p *PoolMemoryResource) PoolSize() int { return int(p.sizeAtomic.Load()) }

// MaximumPoolSize returns the maximum size, 0 when unbounded (an expandable pool always has one:
// the size of its reserved range).
func (p *PoolMemoryResource) MaximumPoolSize() int { return p.maximum }

// Expandable reports whether the pool maps its own memory into one reserved address range
// (PoolOptions.Expandable), as Reinitialize's pool does where the device allows it.
func (p *PoolMemoryResource) Expandable() bool { return p.chained }

// Kind returns the kind of the pool: [StitchingPool] (PoolOptions.Stitch), [ExpandablePool] or
// [PlainPool].
func (p *PoolMemoryResource) Kind() PoolKind {
	switch p.backing.(type) {
	case *stitching:
		return StitchingPool
	case *expandable:
		return ExpandablePool
	}
	return PlainPool
}

// Allocate returns nbytes (rounded up to 256) ordered on s. See the type's documentation for
// where the memory comes from. Errors:
//   - Out of memory (the pool cannot grow, or the upstream refuses every size tried): an
//     *OutOfMemoryError (errors.Is ErrOutOfMemory) with the requested size, the pool size and
//     the maximum. The live allocations are as they were; free blocks may have moved between
//     streams' lists (other lists merged into s's before growing, or every list into
//     DefaultStream's when the pool gave memory back).
//   - A Stream that was closed: ErrClosed.
//
// Before failing, the pool gives memory back and grows once more, as Release does (a host wait
// for every stream's work behind the frees, then every wholly free upstream block, or chunk of an
// expandable pool, goes back):
//   - when the upstream (or the device) refused for want of memory, capped or not, whatever the
//     request: a request too large for the device empties the pool of free memory, initial
//     block included, as PyTorch's caching allocator does;
//   - when the maximum stopped a capped plain pool;
//   - in an expandable pool, also after mapping a chunk for the request that other goroutines'
//     allocations left too small (the chunk goes back while wholly free).
func (p *PoolMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes <= 0 {
		if nbytes < 0 {
			return 0, invalidSize("PoolMemoryResource", "Allocate", nbytes)
		}
		return 0, nil
	}
	n, ok := alignSize(nbytes)
	if ok && n <= poolCacheMaxBlock {
		if ptr, sb := p.allocateCached(n, nbytes, s); ptr != 0 {
			if sb != nil {
				p.prof.recordBlock(sb, nbytes)
			}
			return ptr, nil
		}
	}
	p.mu.Lock()
	if !ok {
		oom := p.oomErr(math.MaxInt, "the size overflows when rounded to 256 bytes", nil, false).(*OutOfMemoryError)
		p.mu.Unlock()
		oom.Requested, oom.TooLarge, oom.Fragmented = nbytes, true, false
		return 0, oom
	}
	if p.closed {
		p.mu.Unlock()
		return 0, errorf("PoolMemoryResource.Allocate: called after Close: %w", ErrClosed)
	}
	var err error
	l, ok := p.listOf(s.id) // listFor's common case, spelt out
	if !ok || l.closed {
		if p.backing == nil { // a pool has a list once it served an allocation
			p.mu.Unlock()
			return 0, errNotMade("Allocate")
		}
		if l, err = p.listFor(s); err != nil {
			p.mu.Unlock()
			return 0, err
		}
	}
	p.flushCache(l, s)
	l.noteAllocation(n)
	// The stream's own list first, as findBlock would: no unlock, so nothing to pin.
	var b *block
	var w takeWait
	if b = l.bestFit(n); b != nil && (!p.tailLast || b != p.tail) {
		b = p.takeFront(l, b, n) // findBlock's common case, spelt out (the end last: findEndLast)
	} else if b, w, l, err = p.allocateSlow(l, n, s); err != nil {
		p.mu.Unlock()
		var oom *OutOfMemoryError
		if errors.As(err, &oom) {
			oom.Requested = nbytes // the figures were computed for the rounded size
		}
		return 0, err
	}
	var dw []takeWait
	var deps []*freeList
	if len(b.deps()) > 0 {
		dw, deps = p.beginDepWaits(b, l, w.o)
	}
	b.free = false
	b.setReq(nbytes)
	p.live.put(b)
	p.liveBytes += n
	p.peakLive = max(p.peakLive, p.liveBytes)
	ptr := b.addr
	if w.o == nil && dw == nil {
		sampled := p.prof.take(&p.profLeft, nbytes)
		p.mu.Unlock()
		if sampled {
			p.prof.recordBlock(b, nbytes)
		}
		return ptr, nil
	}
	ptr, sampled, err := p.allocateWaited(b, l, w, dw, deps, s, n, nbytes)
	if err != nil {
		return 0, err
	}
	if sampled {
		p.prof.recordBlock(b, nbytes)
	}
	return ptr, nil
}

// listOf returns the list of the stream whose StreamView.ID is id, if the pool has one (pool
// locked). A list stays its stream's until dropped (dropList), and a stream gets a new list only
// once its old one was dropped: the list found last serves while it is not dropped.
func (p *PoolMemoryResource) listOf(id uint64) (*freeList, bool) {
	if l := p.lastList; l != nil && l.stream.id == id && !l.dropped {
		return l, true
	}
	l, ok := p.byStream[id]
	if ok {
		p.lastList = l
	}
	return l, ok
}

// allocateWaited ends an Allocate of nbytes (n rounded) on s, whose list is l, for the block b
// (allocated, in the live table) that must wait before the caller uses it: taken from another
// stream's list (w), or holding memory freed on other streams (dw, b's former deps being deps).
// It unlocks the pool for the waits and returns b's address, or the failed wait's error (b back
// in a list), and whether the allocation is sampled (pool locked; it unlocks). Kept out of
// Allocate, whose common path needs none of it.
func (p *PoolMemoryResource) allocateWaited(b *block, l *freeList, w takeWait, dw []takeWait, deps []*freeList, s StreamView, n, nbytes int) (DevicePtr, bool, error) {
	ptr := b.addr
	// Taken from another stream's list, or holding memory freed on other streams: the block is
	// allocated (no one else can see it) and reaches the caller only once s waits for the
	// freeing streams. If a wait fails the block goes back to home (w.o, pinned by beginWait, or
	// l) with its deps. l is pinned either way: the deps beginDepWaits skipped (l's own) are not
	// counted in l.depRefs meanwhile, so a merge of l into another stream's list would otherwise
	// drop it, and restoreDeps forget the name with nothing having ordered l's frees.
	home := w.o
	if home == nil {
		home = l
	}
	// A block the backing served may hold bytes beyond n whose deps s waits for here: a free of
	// the block on another stream returns them naming the list they came out of (from, s's),
	// whose event must then cover these waits (poolBacking.servedFrom).
	// (from is l, pinned below, unless l was remade since: the old list was then dropped, after
	// a host wait for every stream or the closing of its stream.)
	var from *freeList
	var fromEv uintptr
	if b.served && len(dw) > 0 && p.backing.servedFrom(b) == l {
		from = l
		if !l.lazy {
			fromEv = l.event
		}
	}
	p.pin(l)
	p.mu.Unlock()
	werr := p.doWait(w, s)
	for _, x := range dw {
		if werr == nil {
			werr = p.doWait(x, s)
		}
	}
	if werr == nil && fromEv != 0 {
		// A stream we hold only a view of records at every free (l is pinned: its event lives).
		werr = p.drv.eventRecord(p.ctx, fromEv, s.cu())
	}
	p.mu.Lock()
	if werr == nil && from != nil && from.lazy {
		from.dirty = true
	}
	if werr != nil {
		p.live.del(ptr)
		if b.served {
			p.backing.restoreServedDeps(b, deps)
			p.backing.freeServed(home, b)
		} else {
			p.liveBytes -= n
			p.restoreDeps(b, deps)
			p.freeInto(home, b) // home is pinned until endWait (or unpin): it still exists
		}
	}
	if werr == nil && l.lazy && p.byStream[s.id] == l {
		// s now runs after the frees those waits covered: the blocks in its own list need not
		// wait for them again (a taker from another stream waits on l's event, recorded after).
		p.coveredDeps(l, w)
		for _, x := range dw {
			p.coveredDeps(l, x)
		}
	}
	for _, x := range dw {
		p.endWait(x, werr)
	}
	p.unpin(l)
	p.endWait(w, werr)
	sampled := werr == nil && p.prof.take(&p.profLeft, nbytes)
	p.mu.Unlock()
	if werr != nil {
		return 0, false, werr
	}
	return ptr, sampled, nil
}

// Deallocate returns p's block to the free list of stream s, coalescing it with free neighbours
// of that list (never across upstream blocks). nbytes must be the size given to Allocate. A
// pointer the pool did not hand out, a double free or another size returns ErrInvalidFree and
// changes nothing. The memory may be handed out again at once to work ordered on s.
func (p *PoolMemoryResource) Deallocate(ptr DevicePtr, nbytes int, s StreamView) error {
	if ptr == 0 {
		return nil
	}
	// A cache hands out blocks of at most poolCacheMaxBlock bytes; a larger nbytes asked for one
	// of them is found by takeIssued below, and fails there as it would here.
	if nbytes <= poolCacheMaxBlock {
		if done, err := p.deallocateCached(ptr, nbytes, s); done || err != nil {
			return err
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	at, b := p.live.at(ptr) // at: b's slot while the table is unchanged; -1 otherwise
	if b == nil {
		b = p.takeIssued(ptr, nbytes)
	}
	if b == nil {
		if p.backing == nil {
			return errNotMade("Deallocate")
		}
		return errorf("PoolMemoryResource.Deallocate(%#x, %d): the pointer was not allocated by this pool or was already freed: %w", uintptr(ptr), nbytes, ErrInvalidFree)
	}
	if b.req() != nbytes {
		return errorf("PoolMemoryResource.Deallocate(%#x, %d): the block was allocated with %s: %w", uintptr(ptr), nbytes, bytesText(b.req()), ErrInvalidFree)
	}
	if p.closed {
		return p.deallocateAfterClose(b, s)
	}
	// A free on a Stream that was closed waits for the device first (freeTo). The wait is made
	// unlocked, the block out of the live table (a second free of it fails) and in no list
	// meanwhile; it counts as a merge in flight, so an allocation that would grow, and Close, wait
	// for it. A record (on a stream we hold only a view of) stays under the lock: once the block
	// is in l a taker may wait on l's event, which must hold this record by then (moving it out
	// would need the block kept out of l until the record is made, a second lock round trip on
	// every such free).
	l, ok := p.listOf(s.id)
	if ok && !l.closed && (l.lazy || p.ctx == 0) {
		l.dirty = true // freeTo's common case, spelt out: s's own list, no record to make
	} else {
		var err error
		at = -1
		if l, s, err = p.freeListOf(ptr, b, s); err != nil {
			return err
		}
	}
	if p.prof != nil { // only the pool's own profile samples its blocks
		b.dropSample()
	}
	if at >= 0 {
		p.live.delAt(at)
	} else {
		p.live.del(ptr)
	}
	if b.served {
		// Never cached: what it holds goes back into l (poolBacking.freeServed).
		b = p.backing.freeServed(l, b)
		if p.trimAt > 0 {
			p.backing.trim(b)
		}
		return nil
	}
	if b.size <= poolCacheMaxBlock && p.cacheFree(l, b, s) { // (cacheFree takes no larger block)
		return nil
	}
	p.liveBytes -= b.size
	b = p.freeInto(l, b)
	if p.trimAt > 0 {
		p.backing.trim(b)
	}
	return nil
}

// freeListOf returns the list the allocated block b at ptr is freed into on s, and the stream it is
// then ordered on (freeTo; pool locked, it may unlock). Kept out of Deallocate, whose common
// case needs none of it.
func (p *PoolMemoryResource) freeListOf(ptr DevicePtr, b *block, s StreamView) (*freeList, StreamView, error) {
	return p.freeTo(s, func() error {
		if p.ctx == 0 {
			return nil
		}
		p.live.del(ptr)
		p.merging++
		p.mu.Unlock()
		err := p.syncClosed(s)
		p.mu.Lock()
		p.merging--
		p.wake()
		p.live.put(b)
		return err
	})
}

// streamClosing is called by Stream.Close before the stream is destroyed. The stream's free
// blocks move to the default stream's list, after making the default stream wait (on the device)
// for the closing stream's work; the list and its event are dropped, so a pool used with many
// short-lived streams keeps no state for them.
func (p *PoolMemoryResource) streamClosing(s StreamView) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for l := p.byStream[s.id]; l != nil && l.pins > 0; l = p.byStream[s.id] {
		// A take, merge or growth in flight names the list's event or records on the stream:
		// the stream must outlive it.
		p.wait()
	}
	// The caches end only now, after the last unlock: a free on s while this waited may have
	// made s a new cache, whose blocks, flushed after the stream is gone, would reach another
	// stream with nothing ordering them after s's work. The blocks go to s's list (made again
	// if a merge dropped it: s is still hooked), which is handled below.
	p.dropCaches()
	// The record and wait (closeStream) stay under the lock: they run once per closing stream,
	// and a free into l made while unlocked would escape them.
	def, l, move := p.closeStream(s, p.closed)
	if !move {
		return
	}
	p.mergeInto(def, l)
	if p.retargetDeps(l, def) && p.ctx != 0 {
		// A block in flight (a merge waiting unlocked) still names l, and l's event goes with
		// it: wait for the stream's work on the host instead, so that the name can be dropped
		// (freeInto forgets dropped lists). Rare: it needs a merge in flight at the close.
		if err := p.drv.streamSynchronize(p.ctx, l.stream.cu()); err != nil {
			p.drv.ctxSynchronize(p.ctx)
		}
	}
	p.dropList(l)
}

// Release returns to the upstream every upstream block that is wholly free; an expandable pool
// unmaps and releases every chunk that holds no live block (the range stays reserved; a later
// growth maps memory there again). It first waits (on the host) for the work behind every free —
// an unmap does not wait for the device, and memory still in use would kill the context — then
// merges all free lists into the default stream's, so that a block freed in pieces on several
// streams counts as wholly free. The waits and the frees (unmaps) are made with the pool
// unlocked: other goroutines allocate and free meanwhile (an allocation that needs to grow waits
// for the Release to end), and memory freed during the Release stays in the pool.
func (p *PoolMemoryResource) Release() error {
	if p.backing == nil {
		return errNotMade("Release")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.acquireBusy()
	defer p.releaseBusy()
	if p.closed {
		return nil
	}
	_, err := p.releaseWhole(false)
	return err
}

// Close waits for the work behind every free, returns every wholly free upstream block to the
// upstream and destroys the pool's events. Afterwards Allocate returns ErrClosed. Allocations
// still live stay valid: Deallocate keeps working, and each upstream block goes back to the
// upstream as soon as its last allocation is freed (after a synchronisation of the freeing stream).
// Closing with live allocations writes a warning to the debug log. Closing twice returns nil.
func (p *PoolMemoryResource) Close() error {
	if p.backing == nil {
		return errNotMade("Close")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	// Close keeps the lock through its synchronisation and frees: it ends the pool, and
	// everything after it must see the pool closed. It waits for growths, releases and takes in
	// flight first.
	p.acquireBusy()
	defer p.releaseBusy()
	for p.pinned > 0 || p.merging > 0 {
		p.wait()
	}
	if p.closed {
		return nil
	}
	p.dropCaches() // blocks handed out by caches outlive Close in the live table
	def, err := p.releaseWhole(true)
	if def == nil {
		return errorf("PoolMemoryResource.Close: %w", err)
	}
	p.destroyEvents()
	p.closed = true
	p.closedList = def
	if ferr := p.backing.close(); ferr != nil && err == nil {
		err = ferr // every free was waited for
	}
	if n := p.live.len(); n > 0 {
		DebugLogger().Warn("rmm: PoolMemoryResource closed with live allocations; their upstream blocks go back as they are freed",
			"live_allocations", n, "live_bytes", p.liveBytes, "pool_size", p.size)
	} else {
		p.dropHooks()
	}
	if err != nil {
		return errorf("PoolMemoryResource.Close: %w", err)
	}
	return nil
}

// deallocateAfterClose frees an allocation that outlived Close: the stream is synchronised (the
// pool has no events any more; for a Stream that was closed, whose handle is gone, the device),
// the block is coalesced, and its upstream block is returned when wholly free.
func (p *PoolMemoryResource) deallocateAfterClose(b *block, s StreamView) error {
	if err := p.syncAfterClose(s); err != nil {
		return err
	}
	if p.prof != nil { // only the pool's own profile samples its blocks
		b.dropSample()
	}
	p.live.del(b.addr)
	if p.live.len() == 0 {
		p.dropHooks() // the last block that outlived Close
	}
	if b.served {
		b = p.backing.freeServed(p.closedList, b) // its stream is synchronised
	} else {
		p.liveBytes -= b.size
		b = p.freeInto(p.closedList, b)
	}
	return p.backing.releaseAfterClose(b)
}
