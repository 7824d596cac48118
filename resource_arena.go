package rmm

import (
	"cmp"
	"fmt"
	"log/slog"
	"math"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
)

// The arena, as implemented here (ArenaMemoryResource's contract is on the type):
//
//   - Sizes are rounded up to 256 bytes. Requests above 1 MiB are large: served by the global
//     arena directly, from the lowest-addressed superblock with a free block large enough; an
//     empty superblock of at least max(1 MiB, n) + 1 MiB is split first and its head used.
//   - Requests up to 1 MiB are small: first fit (lowest address) among the superblocks of the
//     arena of the allocating stream; when none fits, the lowest-addressed superblock of the
//     global arena that fits moves to the stream's arena (an empty superblock of 2 MiB or more
//     is split and exactly 1 MiB moves).
//   - Each stream gets its own arena, keyed by the stream's identity (StreamView.ID). When one
//     of our Streams is closed, it is synchronised (if its arena holds superblocks or it freed
//     into the global arena) and its superblocks go back to the global arena; the arenas of
//     views of foreign streams (NewStreamView) are emptied and dropped at each defragmentation.
//     Allocations on DefaultStream use one of DefaultStreamArenas sharded arenas: each
//     processor (GOMAXPROCS) keeps the shard it used last and moves to the next idle one only
//     when that one is busy, so goroutines that contend spread over the shards while one
//     goroutine alone keeps one shard (and its memory in one place) however the runtime moves
//     it. Empty superblocks otherwise stay in their arena, as in librmm.
//   - Deallocate frees the block in the superblock that holds it, wherever that superblock is
//     now, coalescing with free neighbours; empty superblocks in the global arena coalesce with
//     empty neighbours. A free on a stream other than the one of the arena holding the block
//     first synchronises the freeing stream (cuStreamSynchronize).
//   - A free into the global arena does not wait: memory there is reused in stream order, as
//     in PoolMemoryResource. The superblock remembers the streams that freed into it (at most
//     four; a fifth is synchronised on the host before its free, and a merge of two empty
//     superblocks synchronises the streams that do not fit), and a stream that takes memory
//     from it, by a large request or by moving it into its arena, first waits on the device for
//     an event of each of those streams (cuStreamWaitEvent: the host does not block; skipped
//     when DefaultStream or one of our Streams already waits for that event as recorded). A
//     superblock moved into a stream's arena forgets them: what is ordered on that stream comes
//     after them. So a block is never reused by another stream before the work queued before its
//     free ends, and allocating and freeing on one stream makes no CUDA call. librmm instead
//     synchronises the freeing stream at every free into the global arena: a driver call on
//     every free of a large block, and a host wait while the stream is busy.
//   - Events: on DefaultStream and our own Streams, whose lifetime the package knows, the event
//     is recorded only when another stream waits for it; a Stream that closes is synchronised
//     first, so superblocks still naming it can ignore it. On streams made from foreign handles
//     (NewStreamView) it is recorded at every free into the global arena, while the stream
//     surely exists; their events are dropped at each defragmentation. The CUDA calls that order
//     one stream after another are made under the global arena's lock.
//   - When an allocation fails, the arena defragments: it synchronises the device
//     (cuCtxSynchronize), returns every arena's superblocks, empty or not, to the global arena,
//     where no stream is pending any more, coalesces empty neighbours and retries once (Release
//     does the same). Every arena stays locked from before the synchronisation until the
//     superblocks have moved, so that no block whose work is still queued can slip into the
//     global arena. If the retry fails too it writes the dump (when
//     enabled) and returns an *OutOfMemoryError (errors.Is(err, ErrOutOfMemory) holds) that
//     gives the size asked, the arena size (as PoolSize and MaximumSize: the arena never grows,
//     so Headroom is 0), the free bytes and the largest free block, and whether the free bytes
//     would have held the request (Fragmented) or not.
//
//
// First fit, superblock moves, coalescing and finding a pointer's superblock are O(log n) or
// O(1).

const (
	// arenaMinSuperblockSize is the smallest superblock, and the smallest arena: 1 MiB.
	// Requests above it are large and served from the global arena directly.
	arenaMinSuperblockSize = 1 << 20
	// arenaMaxSuperblockSize is the largest superblock: 1 TiB. Larger requests always fail.
	arenaMaxSuperblockSize = 1 << 40

	// arenaDumpLogFile is the file, in the working directory, that an arena writes its state to
	// when an allocation fails and ArenaOptions.DumpLogOnFailure is set (and DumpLogPath is not).
	arenaDumpLogFile = "rmm_arena_memory_dump.log"

	arenaLiveShards = 64 // a power of two
	// arenaHintMax bounds the 1 MiB ranges that ArenaMemoryResource.whose tells apart (a power
	// of two): beyond, ranges share hints.
	arenaHintMax = 1 << 18
	// arenaLiveRegionShift gives the size of the ranges of the arena that the shards of the live
	// index take in turn: 1 MiB, the size of the superblocks that small requests take.
	arenaLiveRegionShift = 20
)

// ArenaOptions configures [NewArenaMemoryResource]. nil means the defaults.
type ArenaOptions struct {
	// ArenaSize is the number of bytes taken from the upstream at construction, in one
	// allocation on the default stream; the arena never grows. It is rounded down to a multiple
	// of 256 and must then be at least 1 MiB. Default 0: half of the
	// current device's free memory ([PercentOfFreeDeviceMemory](50)), as librmm.
	ArenaSize int
	// DumpLogOnFailure writes the arena's state to a file when an allocation fails: after
	// defragmentation did not help, or at once for a request larger than the arena. It records
	// the size asked, the arena size, the number of superblocks, the total free
	// bytes, the largest free block and the fragmentation (1 − largest free / total free) × 100
	// with two decimals, as Info records, then one Debug record per superblock (owner, start,
	// end, size, empty, free blocks, largest free block, gap to the previous one), in log/slog's
	// text format. Default false.
	DumpLogOnFailure bool
	// DumpLogPath is the file the dump goes to. Default "": rmm_arena_memory_dump.log in the working
	// directory, librmm's name. The resource's first dump truncates the file; later dumps are appended.
	DumpLogPath string
	// DefaultStreamArenas is the number of arenas that small allocations on [DefaultStream] are
	// spread over, so that many goroutines allocating on the default stream do not share one
	// lock. Default 0: runtime.GOMAXPROCS(0) at construction. At most 65536.
	DefaultStreamArenas int
}

// ArenaMemoryResource is librmm's arena allocator: one upstream allocation of
// [ArenaOptions.ArenaSize] bytes, made at construction on [DefaultStream] and never grown, divided
// into superblocks of 1 MiB to 1 TiB that
// move between a global arena and one arena per stream, so that goroutines allocating on their
// own streams do not contend.
//
// Sizes are rounded up to 256 bytes; every pointer returned is 256-byte aligned. Requests of at
// most 1 MiB are small and served from the allocating stream's arena; larger ones from the
// global arena.
//
// Streams: memory freed on stream s is reused at once by allocations on s; another stream takes
// it only after waiting on the device for an event recorded on s (cuStreamWaitEvent; the host
// does not block), so a block is never reused before the work queued before its free ends.
// Allocating and freeing on one stream make no CUDA call. A free on a stream other than the
// one of the arena holding the block synchronises the freeing stream first
// (cuStreamSynchronize). After a [Stream] is closed, its superblocks return to the global arena;
// a free on its view waits for the device.
//
// Errors: when an allocation fails, the arena synchronises the device (cuCtxSynchronize),
// returns every superblock to the global arena, coalesces and retries once ([ArenaMemoryResource.Release] does the
// same); if that fails too it returns an [*OutOfMemoryError] (errors.Is(err, [ErrOutOfMemory]))
// that gives the size asked, the arena size, the free bytes and the largest free block, and
// whether the free bytes would have held the request (Fragmented), and writes the dump when
// [ArenaOptions.DumpLogOnFailure] is set. Deallocate returns [ErrInvalidFree], changing nothing,
// for a pointer the arena never handed out, a double free and a size other than the one
// allocated. A negative size is [ErrInvalidArgument].
//
// Cost: allocations and frees are O(log n) in the superblocks of an arena, or O(1). Safe for
// concurrent use: each arena has its own lock, the global arena another.
//
// How it works is described at the top of resource_arena.go.
type ArenaMemoryResource struct {
	upstream MemoryResource
	dev      Device
	ctx      uintptr     // 0 without CUDA: no synchronisation is needed
	drv      *cudaDriver // the CUDA calls (&cudaCalls; tests use fakes)
	base     DevicePtr
	size     int
	dumpPath string // "" when no dump is wanted
	// The fields above are read on every allocation and free and never written after
	// construction; the global arena's lock below is taken at every move of a superblock.
	_ [64]byte

	global   arenaSet
	spareSBs []*arenaSuperblock // merged superblocks kept for reuse (under global.mu)
	// putOff is an empty superblock of the global arena whose merge with its empty next
	// neighbour is put off (see freedEmpty); nil when none. Under global.mu.
	putOff *arenaSuperblock
	shards []arenaShard
	// lockingAll is non-zero while lockArenas holds or takes every arena's lock: a busy shard
	// then says nothing about contention, and lockShard waits for its own shard.
	lockingAll atomic.Int32
	// hints holds, per processor, the default-stream shard it used last. The runtime empties
	// it at garbage collections; a new hint starts at settled, the shard a hint last moved to
	// (see lockShard).
	hints     sync.Pool // *arenaHint
	_         [64]byte  // settled is written while goroutines contend: off the line of hints
	settled   atomic.Int32
	_         [60]byte
	streams   sync.Map   // stream id -> *arenaSet
	streamsMu sync.Mutex // creating stream arenas and stream records
	recs      sync.Map   // stream id -> *arenaStream, for streams that freed into the global arena
	// hooked holds the Streams whose Close will tell the arena (under streamsMu): the ones
	// streamArena or streamRec hooked, until they close or dropHooks takes the hooks off. The
	// arena keeps them apart from streams and recs, which forget a stream at other times
	// (dropRecs), so that it can find every Stream it is hooked on and hooks none twice.
	hooked map[uint64]bool
	// arenas and lazyRecs publish the stream arenas in streams and the records of our Streams
	// in recs (at most streamSetMax of each) for the fast paths, which read them without a
	// lock; streamsMu serialises their changes. With closed, they are read on every allocation
	// and free and written almost never: the pads keep them off the lines of the fields around
	// them, which the slow paths write (defRec at frees into the global arena on DefaultStream).
	_        [64]byte
	arenas   atomic.Pointer[streamSet[*arenaSet]]
	lazyRecs atomic.Pointer[streamSet[*arenaStream]]
	closed   atomic.Bool
	_        [64]byte
	defRec   arenaStream
	multiMu  sync.Mutex // serialises the operations that lock every arena
	// live is the live allocations of up to 1 MiB that no arena's own table holds: those whose
	// superblock went back to the global arena while they were live (see arenaSet.live).
	live [arenaLiveShards]arenaLiveShard
	// whose holds, per 1 MiB range of the arena (wrapping around past arenaHintMax ranges), the
	// arena that last allocated a small block there: where a free looks for the block first. A
	// hint only; the tables are the truth (see Deallocate).
	whose []atomic.Pointer[arenaSet]
	// large is the live allocations above 1 MiB (large requests), under the global arena's lock,
	// which a large request and a free into the global arena hold anyway.
	large   arenaLiveSet
	defrags atomic.Int64

	closeMu sync.Mutex
	held    bool // the upstream allocation is still held (under closeMu)

	dumpMu sync.Mutex
	dumped bool
}

type arenaKind uint8

const (
	arenaGlobal arenaKind = iota
	arenaShardKind
	arenaStreamKind
)

// arenaSet is an arena: a set of superblocks under one lock. The global arena, the sharded
// default-stream arenas and the stream arenas are all arenaSets.
type arenaSet struct {
	mu   sync.Mutex
	tree arenaIndex // superblocks by address, with their largest free blocks
	// live is the live small allocations made from this arena (never the global arena's, which
	// has none), under its lock: an allocation and a free on the arena's stream take that lock
	// alone. An entry stays while its superblock is in the arena; when the superblock goes back
	// to the global arena (moveAllToGlobal) the arena's entries move to the resource's shards,
	// under streamsMu, and never back. So every small live block is in exactly one table: its
	// superblock owner's, or its shard.
	live    arenaLiveSet
	kind    arenaKind
	index   int        // shard number
	stream  StreamView // the stream whose work is ordered before reuse (DefaultStream for shards)
	retired bool       // dropped from the resource: look the stream's arena up again
}

func (a *arenaSet) name() string {
	switch a.kind {
	case arenaGlobal:
		return "global"
	case arenaShardKind:
		return fmt.Sprintf("default#%d", a.index)
	}
	return a.stream.String()
}

// arenaShard keeps each default-stream arena on its own cache lines.
type arenaShard struct {
	arenaSet
	_ [64]byte
}

// arenaStreamSet keeps a stream's arena on its own cache lines. Stream arenas are small objects
// made one after another (often by one goroutine), so without the pads the lock of one stream's
// arena, written at every allocation and free on that stream, would share a line with the
// fields of its neighbours' arenas that their own streams read.
type arenaStreamSet struct {
	_ [64]byte
	arenaSet
	_ [64]byte
}

type arenaHint struct{ shard int }

// arenaLive is a live allocation: its superblock and the size asked.
type arenaLive struct {
	sb   *arenaSuperblock
	size int
}

// arenaLiveSet is a table of live allocations with their count and bytes.
type arenaLiveSet struct {
	m     arenaLiveTable
	count int
	bytes int // rounded sizes
}

// add records the live allocation p of asked bytes (n once rounded) in superblock sb.
func (l *arenaLiveSet) add(p DevicePtr, sb *arenaSuperblock, asked, n int) {
	l.m.put(p, arenaLive{sb: sb, size: asked})
	l.count++
	l.bytes += n
}

// remove deletes the entry in slot i (from m.find), of n bytes once rounded.
func (l *arenaLiveSet) remove(i, n int) {
	l.m.delAt(i)
	l.count--
	l.bytes -= n
}

// arenaLiveShard is one shard of the index of small live allocations, chosen by a hash of the
// pointer.
type arenaLiveShard struct {
	mu sync.Mutex
	arenaLiveSet
	_ [64]byte
}

// NewArenaMemoryResource returns an arena over upstream (nil opts: the defaults), taking
// [ArenaOptions.ArenaSize] bytes from it now (on [DefaultStream]); that allocation's failure is
// returned. Options are validated as librmm does: a size below 1 MiB after rounding down to 256
// is [ErrInvalidArgument]. A nil upstream means the current device resource
// ([CurrentDeviceResource], read once, here); a nil pointer as upstream returns an error wrapping
// [ErrInvalidArgument].
func NewArenaMemoryResource(upstream MemoryResource, opts *ArenaOptions) (*ArenaMemoryResource, error) {
	upstream, err := upstreamOf("NewArenaMemoryResource", upstream)
	if err != nil {
		return nil, err
	}
	var o ArenaOptions
	if opts != nil {
		o = *opts
	}
	switch {
	case o.ArenaSize < 0:
		return nil, errorf("NewArenaMemoryResource: negative ArenaSize %d: %w", o.ArenaSize, ErrInvalidArgument)
	case o.DefaultStreamArenas < 0 || o.DefaultStreamArenas > 1<<16:
		return nil, errorf("NewArenaMemoryResource: DefaultStreamArenas %d is outside 0..65536: %w", o.DefaultStreamArenas, ErrInvalidArgument)
	}
	size := o.ArenaSize
	if size == 0 {
		half, err := PercentOfFreeDeviceMemory(50)
		if err != nil {
			return nil, errorf("NewArenaMemoryResource: default size (half the free memory): %w", err)
		}
		size = half
	}
	size = AlignDown(size, Alignment)
	if size < arenaMinSuperblockSize {
		return nil, errorf("NewArenaMemoryResource: arena size %d bytes (rounded down to 256) is below the %d-byte minimum: %w", size, arenaMinSuperblockSize, ErrInvalidArgument)
	}
	nshards := o.DefaultStreamArenas
	if nshards == 0 {
		nshards = runtime.GOMAXPROCS(0)
	}
	r := &ArenaMemoryResource{
		upstream: upstream,
		dev:      DeviceOf(upstream),
		drv:      &cudaCalls,
		size:     size,
		shards:   make([]arenaShard, nshards),
		hooked:   map[uint64]bool{},
	}
	hints := 1
	for hints < size>>arenaLiveRegionShift+1 && hints < arenaHintMax {
		hints <<= 1
	}
	r.whose = make([]atomic.Pointer[arenaSet], hints)
	r.defRec = arenaStream{stream: DefaultStream.deviceView(r.dev), lazy: true}
	if o.DumpLogOnFailure {
		r.dumpPath = o.DumpLogPath
		if r.dumpPath == "" {
			r.dumpPath = arenaDumpLogFile
		}
	}
	if CUDAAvailable() == nil {
		ctx, err := r.dev.ctx()
		if err != nil {
			return nil, err
		}
		r.ctx = ctx
	}
	r.global.kind = arenaGlobal
	r.large.m.half = true
	for i := range r.shards {
		a := &r.shards[i].arenaSet
		a.kind, a.index, a.stream = arenaShardKind, i, DefaultStream.deviceView(r.dev)
	}
	ptr, err := upstream.Allocate(size, DefaultStream)
	if err != nil {
		return nil, errorf("NewArenaMemoryResource: taking the %d-byte arena from %s: %w", size, resourceName(upstream), err)
	}
	r.base, r.held = ptr, true
	// One superblock for the whole arena, or equal pieces of at most 1 TiB.
	pieces := (size + arenaMaxSuperblockSize - 1) / arenaMaxSuperblockSize
	piece, _ := AlignUp((size+pieces-1)/pieces, Alignment)
	var prev *arenaSuperblock
	for off := 0; off < size; off += piece {
		sb := newArenaSuperblock(ptr+DevicePtr(off), min(piece, size-off))
		if prev != nil {
			prev.nextSB, sb.prevSB = sb, prev
		}
		prev = sb
		sb.owner.Store(&r.global)
		r.global.tree.insert(sb)
	}
	r.hints.New = func() any { return &arenaHint{shard: int(r.settled.Load())} }
	return r, nil
}

// Upstream returns the resource the arena took its memory from.
func (r *ArenaMemoryResource) Upstream() MemoryResource { return r.upstream }

func (*ArenaMemoryResource) insideUpstream() {}

// Device returns the device the arena belongs to (its upstream's).
func (r *ArenaMemoryResource) Device() Device { return r.dev }

// Access reports the upstream's access.
func (r *ArenaMemoryResource) Access() Access { return AccessOf(r.upstream) }

// ArenaSize returns the bytes the arena holds from its upstream.
func (r *ArenaMemoryResource) ArenaSize() int { return r.size }

// Allocate returns nbytes (rounded up to 256) ordered on s; see the type's documentation for
// where the memory comes from. Out of memory (also after defragmenting) is an [*OutOfMemoryError]
// (errors.Is(err, [ErrOutOfMemory])); a request larger than the arena or than 1 TiB fails at once,
// without defragmenting, with the same error type. After Close, and on a [Stream] that was closed,
// it returns [ErrClosed].
func (r *ArenaMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes <= 0 {
		if nbytes < 0 {
			return 0, invalidSize("ArenaMemoryResource", "Allocate", nbytes)
		}
		return 0, nil
	}
	if r.closed.Load() {
		return 0, errArenaClosed
	}
	n, ok := alignSize(nbytes)
	switch {
	case !ok || n > r.size:
		if !ok {
			n = math.MaxInt
		}
		return 0, r.fail(nbytes, n, fmt.Sprintf("the request is larger than the arena (%d bytes)", r.size))
	case n > arenaMaxSuperblockSize:
		return 0, r.fail(nbytes, n, "the request is larger than the largest superblock (1 TiB)")
	}
	p, err := r.allocate(n, nbytes, s)
	if err != nil || p != 0 {
		return p, err
	}
	if err := r.defragment(); err != nil {
		return 0, errorf("ArenaMemoryResource.Allocate(%d): defragmenting: %w", nbytes, err)
	}
	p, err = r.allocate(n, nbytes, s)
	if err != nil || p != 0 {
		return p, err
	}
	return 0, r.fail(nbytes, n, "no room in arena, also after defragmenting")
}

var errArenaClosed = errorf("ArenaMemoryResource.Allocate: called after Close: %w", ErrClosed)

// allocate tries once to carve n bytes (rounded; asked is the caller's size) for s. It returns
// (0, nil) when there is no room.
func (r *ArenaMemoryResource) allocate(n, asked int, s StreamView) (DevicePtr, error) {
	if n > arenaMinSuperblockSize {
		return r.allocateLarge(n, asked, s)
	}
	a, err := r.lockArena(s)
	if err != nil {
		return 0, err
	}
	p, err := r.allocateFrom(a, n, asked)
	a.mu.Unlock()
	return p, err
}

// allocateLarge serves a large request from the global arena; see allocate. s first waits on
// the device for the streams that freed into the superblock (waitPending). The live entry goes
// to r.large, under the global arena's lock already held.
func (r *ArenaMemoryResource) allocateLarge(n, asked int, s StreamView) (DevicePtr, error) {
	// A record of s that is not done proves s open: Stream.Close marks it done (under the
	// global arena's lock) before the Stream counts as closed.
	x := r.lazyRec(s)
	if x == nil && s.closed() {
		return 0, errStreamClosed("ArenaMemoryResource.Allocate", s)
	}
	g := &r.global
	g.mu.Lock()
	defer g.mu.Unlock()
	if r.closed.Load() {
		return 0, errArenaClosed
	}
	if x != nil && x.done && s.closed() {
		return 0, errStreamClosed("ArenaMemoryResource.Allocate", s)
	}
	sb := g.tree.firstFit(n)
	head := max(arenaMinSuperblockSize, n)
	reuse := false // sb is the superblock whose merge was put off, and this split would undo it
	if a := r.putOff; a != nil && (sb == nil || sb.addr() >= a.addr()) {
		// A fit below a is the same merged or not. Merged, a would be found where it is, and
		// split into itself and its neighbour when the head is a's size. Otherwise merge now:
		// a, empty, is then the first fit if it holds n; if not, sb still is (it cannot be the
		// neighbour a absorbed, which holds less than n).
		if reuse = sb == a && head == a.size(); !reuse {
			r.settle()
			if a.size() >= n {
				sb = a
			}
		}
	}
	if sb == nil {
		return 0, nil
	}
	if err := r.waitPending(sb.pend, s); err != nil {
		return 0, errorf("ArenaMemoryResource.Allocate(%d): %w", asked, err)
	}
	var tail *arenaSuperblock
	switch {
	case reuse:
		r.putOff = nil
		copyPending(sb.nextSB, sb) // as the split gives the tail the merged superblock's streams
	case sb.empty() && sb.size() >= head+arenaMinSuperblockSize:
		tail = sb.split(head, r.spareSuperblock())
		copyPending(tail, sb)
	}
	p, _ := sb.firstFit(n)
	g.tree.fix(sb)
	if tail != nil {
		tail.owner.Store(g)
		g.tree.insert(tail)
	}
	r.large.add(p, sb, asked, n)
	return p, nil
}

// allocateFrom serves a small request from arena a (locked); see allocate.
func (r *ArenaMemoryResource) allocateFrom(a *arenaSet, n, asked int) (DevicePtr, error) {
	if r.closed.Load() {
		return 0, errArenaClosed
	}
	sb := a.tree.firstFit(n)
	if sb == nil {
		var err error
		if sb, err = r.takeSuperblock(a, n, asked); sb == nil {
			return 0, err
		}
	}
	p, _ := sb.firstFit(n)
	a.tree.fix(sb)
	a.live.add(p, sb, asked, n)
	if h := r.hint(p); h.Load() != a {
		h.Store(a)
	}
	return p, nil
}

// takeSuperblock moves the lowest-addressed superblock of the global arena that can serve n
// bytes (asked: the caller's size) into arena a (locked), splitting off exactly 1 MiB of an
// empty superblock of 2 MiB or more; the tail left in the global arena keeps the pending streams.
// a's stream first waits on the device for the streams that freed into the superblock
// (waitPending); the superblock then forgets them, since everything later ordered on a's
// stream comes after them. It returns nil when the global arena has none, or when the wait
// fails (with its error).
func (r *ArenaMemoryResource) takeSuperblock(a *arenaSet, n, asked int) (*arenaSuperblock, error) {
	g := &r.global
	r.lockGlobal()
	defer g.mu.Unlock()
	sb := g.tree.firstFit(n)
	if sb == nil {
		return nil, nil
	}
	if err := r.waitPending(sb.pend, a.stream); err != nil {
		return nil, errorf("ArenaMemoryResource.Allocate(%d): %w", asked, err)
	}
	g.tree.remove(sb)
	if sb.empty() && sb.size() >= 2*arenaMinSuperblockSize {
		tail := sb.split(arenaMinSuperblockSize, r.spareSuperblock())
		copyPending(tail, sb)
		tail.owner.Store(g)
		g.tree.insert(tail)
	}
	clearPending(sb)
	sb.owner.Store(a)
	a.tree.insert(sb)
	return sb, nil
}

// lockArena returns s's arena, locked: a shard for DefaultStream, else the stream's own arena.
func (r *ArenaMemoryResource) lockArena(s StreamView) (*arenaSet, error) {
	if s.id == 0 {
		return r.lockShard(), nil
	}
	for {
		a, err := r.streamArena(s)
		if err != nil {
			return nil, err
		}
		a.mu.Lock()
		if !a.retired {
			return a, nil
		}
		a.mu.Unlock()
	}
}

// lockShard locks a default-stream arena: the one this processor used last if it is free,
// else the next free one, else (all busy) waits for the preferred one. While lockArenas locks
// every arena (Stats, CheckInvariants, Release, Close), it waits for the preferred one: a shard
// held there is no sign of contention, and moving would spread a lone goroutine's memory.
func (r *ArenaMemoryResource) lockShard() *arenaSet {
	h := r.hints.Get().(*arenaHint)
	n := len(r.shards)
	if r.lockingAll.Load() != 0 {
		n = 0 // wait for the preferred shard below
	}
	for k := 0; k < n; k++ {
		i := h.shard + k
		if i >= n {
			i -= n
		}
		if a := &r.shards[i].arenaSet; a.mu.TryLock() {
			if i != h.shard {
				h.shard = i
				r.settled.Store(int32(i))
			}
			r.hints.Put(h)
			return a
		}
	}
	a := &r.shards[h.shard].arenaSet
	r.hints.Put(h)
	a.mu.Lock()
	return a
}

// streamArena returns s's arena, creating it on first use. For our own Streams it asks to be
// told when the stream closes; a closed Stream returns ErrClosed.
func (r *ArenaMemoryResource) streamArena(s StreamView) (*arenaSet, error) {
	if a, ok := r.arenas.Load().find(s.id); ok {
		return a, nil
	}
	if v, ok := r.streams.Load(s.id); ok {
		return v.(*arenaSet), nil
	}
	r.streamsMu.Lock()
	defer r.streamsMu.Unlock()
	if v, ok := r.streams.Load(s.id); ok {
		return v.(*arenaSet), nil
	}
	if r.closed.Load() {
		// Close set closed under streamsMu (lockArenas): no Stream is hooked after it, so that
		// dropHooks finds every hook.
		return nil, errArenaClosed
	}
	a := &(&arenaStreamSet{arenaSet: arenaSet{kind: arenaStreamKind, stream: s.deviceView(r.dev)}}).arenaSet
	if err := r.hook(s); err != nil {
		return nil, err
	}
	r.streams.Store(s.id, a)
	r.arenas.Store(r.arenas.Load().with(s.id, a))
	return a, nil
}

// hook asks to be told of s's Close, unless s is a foreign stream or already hooked (streamsMu
// held, the arena not closed). A Stream that was closed returns ErrClosed.
func (r *ArenaMemoryResource) hook(s StreamView) error {
	if s.id == 0 || !s.lifetimeKnown() || r.hooked[s.id] {
		return nil
	}
	if !addStreamCloseHook(s, r) {
		return errStreamClosed("ArenaMemoryResource.Allocate", s)
	}
	r.hooked[s.id] = true
	return nil
}

// dropHooks takes the arena's close hook off every Stream it is on, once the arena is closed and
// nothing allocated from it is live (returnUpstream): Allocate fails from then on and a Deallocate
// can only be an invalid free, so no call names a stream again and a Stream's Close has nothing
// left to tell the arena; without it a long-lived Stream would keep every arena it served
// reachable. The Stream's lock is a leaf, taken under streamsMu as hook takes it. A Stream whose
// Close took its hooks before this still tells the arena afterwards; streamClosing copes, as it
// does for any Stream closed after the arena.
func (r *ArenaMemoryResource) dropHooks() {
	r.streamsMu.Lock()
	defer r.streamsMu.Unlock()
	for id := range r.hooked {
		removeStreamCloseHook(id, r)
	}
	clear(r.hooked)
}

// liveShard returns the shard of the live index that holds the small block p once its entry has
// left its arena's own table: the shards take the arena's 1 MiB ranges in turn, so the blocks of
// one superblock of a small request lie in one shard (two when the superblock straddles a range),
// and frees of blocks of different superblocks seldom share a shard's lock.
func (r *ArenaMemoryResource) liveShard(p DevicePtr) *arenaLiveShard {
	return &r.live[uint64(p-r.base)>>arenaLiveRegionShift&(arenaLiveShards-1)]
}

// hint returns the slot of whose for p, which must lie in the arena.
func (r *ArenaMemoryResource) hint(p DevicePtr) *atomic.Pointer[arenaSet] {
	return &r.whose[uint64(p-r.base)>>arenaLiveRegionShift&uint64(len(r.whose)-1)]
}

// liveCount returns the number of live allocations. It locks every arena.
func (r *ArenaMemoryResource) liveCount() int {
	arenas, unlock := r.lockArenas()
	defer unlock()
	r.lockGlobal()
	n := r.large.count
	r.global.mu.Unlock()
	for _, a := range arenas {
		n += a.live.count
	}
	for i := range r.live {
		ls := &r.live[i]
		ls.mu.Lock()
		n += ls.count
		ls.mu.Unlock()
	}
	return n
}

// Deallocate returns p's block to the superblock that holds it, coalescing with its free
// neighbours. nbytes must be the size given to Allocate. The block may be handed out again at
// once to work ordered on s, and to other streams only behind that work:
//
//   - When the superblock is in the global arena (every block above 1 MiB, and small blocks whose
//     superblock went back there), the free does not wait. The superblock notes s: on
//     [DefaultStream] and our own Streams no CUDA call is made; on a foreign stream ([NewStreamView])
//     an event is recorded on s now (cuEventRecord). Another stream that takes the memory waits
//     on the device for s's work first (see the type's documentation). A superblock notes at
//     most four streams: a free by a fifth synchronises s (cuStreamQuery, then
//     cuStreamSynchronize) instead.
//   - When the superblock is in the arena of another stream than s, s is synchronised first
//     (cuStreamQuery, then cuStreamSynchronize).
//   - On a [Stream] that was closed, the device is synchronised instead (cuCtxSynchronize).
//
// A pointer the arena did not hand out, a double free or another size returns [ErrInvalidFree]
// and changes nothing. Allocations that outlive Close are freed as usual; the last one gives the
// arena back to the upstream.
func (r *ArenaMemoryResource) Deallocate(ptr DevicePtr, nbytes int, s StreamView) error {
	if ptr == 0 {
		return nil
	}
	if nbytes > arenaMinSuperblockSize {
		return r.deallocateLarge(ptr, nbytes, s)
	}
	// Common case: the block is in the table of the arena that last allocated in its 1 MiB
	// range, and the free is on that arena's stream: that arena's lock is the only one taken.
	a := r.hint(ptr).Load()
	if a != nil {
		if found, err := r.freeOwned(a, ptr, nbytes, s, false); found {
			return err
		}
	}
	// Next, s's own arena (another arena may have allocated in the range since).
	if s.id != 0 {
		if b, ok := r.arenas.Load().find(s.id); ok && b != a {
			if found, err := r.freeOwned(b, ptr, nbytes, s, false); found {
				return err
			}
		}
	}
	return r.deallocateShared(ptr, nbytes, s, false)
}

// freeOwned frees ptr when arena a's own table holds it, and reports whether it did; false means
// nothing was changed. synced: s was synchronised already.
func (r *ArenaMemoryResource) freeOwned(a *arenaSet, ptr DevicePtr, nbytes int, s StreamView, synced bool) (bool, error) {
	a.mu.Lock()
	i := a.live.m.find(ptr)
	if i < 0 {
		a.mu.Unlock()
		return false, nil
	}
	return true, r.freeFound(a, i, ptr, nbytes, s, synced)
}

// freeFound frees ptr, in slot i of the table of arena a (locked, and unlocked here), whose
// superblock a therefore holds. synced: s was synchronised already.
func (r *ArenaMemoryResource) freeFound(a *arenaSet, i int, ptr DevicePtr, nbytes int, s StreamView, synced bool) error {
	e := a.live.m.slots[i].v
	if e.size != nbytes {
		a.mu.Unlock()
		return arenaWrongSize(ptr, nbytes, e.size)
	}
	n, _ := alignSize(nbytes)
	if !synced && r.crossArena(a, s) {
		// A block of another stream's arena: s is synchronised first, without a lock held, then
		// the block is looked up again, wherever it is by then.
		a.mu.Unlock()
		if err := r.syncStream(s); err != nil {
			return errorf("ArenaMemoryResource.Deallocate: synchronising %v before freeing into another arena: %w", s, err)
		}
		if found, err := r.freeOwned(a, ptr, nbytes, s, true); found {
			return err
		}
		return r.deallocateShared(ptr, nbytes, s, true)
	}
	a.live.remove(i, n)
	return r.freeIn(a, e.sb, ptr, n)
}

// findOwned looks for the small block ptr in every arena's own table; it returns the arena that
// holds it, locked, and the slot, or nil. Under streamsMu no table's entries move to the shards
// (moveAllToGlobal runs under it), and every arena whose table may hold entries is listed, so
// ptr, live all along, is found here or, afterwards, in its shard (whose entries stay until
// freed).
func (r *ArenaMemoryResource) findOwned(ptr DevicePtr) (*arenaSet, int) {
	r.streamsMu.Lock()
	defer r.streamsMu.Unlock()
	var found *arenaSet
	i := -1
	look := func(a *arenaSet) bool {
		a.mu.Lock()
		if i = a.live.m.find(ptr); i >= 0 {
			found = a
			return false
		}
		a.mu.Unlock()
		return true
	}
	for k := range r.shards {
		if !look(&r.shards[k].arenaSet) {
			return found, i
		}
	}
	r.streams.Range(func(_, v any) bool { return look(v.(*arenaSet)) })
	return found, i
}

// deallocateShared is Deallocate of a small block that neither the arena of its range's hint
// nor s's arena holds: one whose superblock went back to the global arena while it was live (in
// its shard of r.live), one of another arena, or no live block. synced: s was synchronised
// already.
func (r *ArenaMemoryResource) deallocateShared(ptr DevicePtr, nbytes int, s StreamView, synced bool) error {
	ls := r.liveShard(ptr)
	ls.mu.Lock()
	i := ls.m.find(ptr)
	if i < 0 {
		ls.mu.Unlock()
		if a, i := r.findOwned(ptr); a != nil {
			return r.freeFound(a, i, ptr, nbytes, s, synced)
		}
		ls.mu.Lock()
	}
	i, e, err := r.findLive(&ls.arenaLiveSet, ptr, nbytes, false, &ls.mu)
	if err != nil {
		return err
	}
	n, _ := alignSize(nbytes)
	sb := e.sb
	// Common case here: the owner's lock is free, and the free needs neither a synchronisation
	// nor a CUDA call nor a stream record to make (a free into s's own arena, or into the global
	// arena on DefaultStream or on one of our Streams whose record is published in lazyRecs). The
	// lock order is the owner's lock, then the live shard's; TryLock never waits, so it may be
	// taken while the shard is held, and the entry found stays valid.
	if o := sb.owner.Load(); o != nil && !synced {
		if x, ok := r.freeFast(o, s); ok && o.mu.TryLock() {
			r.settleIn(o)
			if sb.owner.Load() == o && r.noteLazy(o, sb, x) {
				ls.remove(i, n)
				ls.mu.Unlock()
				return r.freeIn(o, sb, ptr, n)
			}
			o.mu.Unlock()
		}
	}
	ls.mu.Unlock()
	return r.deallocateSlow(ptr, nbytes, n, s, e, &ls.arenaLiveSet, &ls.mu, synced)
}

// deallocateLarge is Deallocate of a block above 1 MiB, whose live entry is in r.large. Its
// common case, a free into the global arena on a stream with a lazy record, takes the global
// arena's lock once and no other.
func (r *ArenaMemoryResource) deallocateLarge(ptr DevicePtr, nbytes int, s StreamView) error {
	g := &r.global
	r.lockGlobal()
	l := &r.large
	i, e, err := r.findLive(l, ptr, nbytes, true, &g.mu)
	if err != nil {
		return err
	}
	n, _ := alignSize(nbytes)
	sb := e.sb
	// A superblock changes owner only under the global arena's lock: o stays sb's owner. The
	// lock order is an arena's lock, then the global arena's; TryLock never waits, so it may be
	// taken while the global arena is held.
	o := sb.owner.Load()
	if x, ok := r.freeFast(o, s); ok {
		switch {
		case o == g:
			if r.noteLazy(o, sb, x) {
				l.remove(i, n)
				return r.freeIn(o, sb, ptr, n)
			}
		case o.mu.TryLock():
			l.remove(i, n)
			g.mu.Unlock()
			return r.freeIn(o, sb, ptr, n)
		}
	}
	g.mu.Unlock()
	return r.deallocateSlow(ptr, nbytes, n, s, e, l, nil, false)
}

// lockLive locks the live table of deallocateSlow: mu, or when mu is nil (the table of large
// blocks) the global arena, unless o, locked, is the global arena.
func (r *ArenaMemoryResource) lockLive(mu *sync.Mutex, o *arenaSet) {
	switch {
	case mu != nil:
		mu.Lock()
	case o != &r.global:
		r.lockGlobal()
	}
}

// unlockLive undoes lockLive.
func (r *ArenaMemoryResource) unlockLive(mu *sync.Mutex, o *arenaSet) {
	switch {
	case mu != nil:
		mu.Unlock()
	case o != &r.global:
		r.global.mu.Unlock()
	}
}

// deallocateSlow is Deallocate past its common case: it looks s's record up, synchronises s
// where that is due, and waits for the owner's lock. e is the live entry found for ptr (n: its
// rounded size) in l, a shard of small blocks guarded by mu or, when mu is nil, the table of
// large blocks guarded by the global arena's lock; neither is held. synced: s was synchronised
// already, so the free needs no ordering any more.
func (r *ArenaMemoryResource) deallocateSlow(ptr DevicePtr, nbytes, n int, s StreamView, e arenaLive, l *arenaLiveSet, mu *sync.Mutex, synced bool) error {
	sb := e.sb
	large := mu == nil
	var x *arenaStream // s's record, once the superblock is seen in the global arena
	for {
		o := sb.owner.Load()
		if o == nil {
			return r.notAllocated(ptr, nbytes, large) // freed (and its superblock merged) meanwhile
		}
		toGlobal := !synced && r.ctx != 0 && o.kind == arenaGlobal && !r.closed.Load()
		if toGlobal && x == nil && !s.closed() {
			var err error
			if x, err = r.streamRec(s); err != nil {
				return errorf("ArenaMemoryResource.Deallocate: %w", err)
			}
		}
		if (toGlobal && x == nil) || (!synced && r.crossArena(o, s)) {
			// A closed Stream (the device is synchronised), or a small block of another stream's
			// arena.
			if err := r.syncStream(s); err != nil {
				return errorf("ArenaMemoryResource.Deallocate: synchronising %v before freeing into another arena: %w", s, err)
			}
			synced = true
		}
		o.mu.Lock()
		r.settleIn(o)
		if sb.owner.Load() != o {
			o.mu.Unlock()
			continue
		}
		note := !synced && r.ctx != 0 && o.kind == arenaGlobal && !r.closed.Load()
		if note && (x == nil || x.done) {
			// The superblock reached the global arena, or s's record was dropped, meanwhile.
			o.mu.Unlock()
			x = nil
			continue
		}
		r.lockLive(mu, o)
		i := l.m.find(ptr)
		if i < 0 || l.m.slots[i].v != e {
			r.unlockLive(mu, o)
			o.mu.Unlock()
			return r.notAllocated(ptr, nbytes, large)
		}
		if note {
			// The entry stays while o is locked (only a holder of the owner's lock removes it),
			// so the shard need not be held over the CUDA call notePending may make (the table
			// of large blocks is guarded by o, the global arena, itself).
			r.unlockLive(mu, o)
			ok, err := r.notePending(sb, x)
			if err != nil {
				o.mu.Unlock()
				return err
			}
			if !ok {
				// The superblock already waits for arenaPendingMax other streams.
				o.mu.Unlock()
				if err := r.syncStream(s); err != nil {
					return errorf("ArenaMemoryResource.Deallocate: synchronising %v before freeing into the global arena: %w", s, err)
				}
				synced = true
				continue
			}
			r.lockLive(mu, o)
			i = l.m.find(ptr)
		}
		l.remove(i, n)
		r.unlockLive(mu, o)
		return r.freeIn(o, sb, ptr, n)
	}
}

// freeFast reports whether a free on s into arena o may take Deallocate's common path: without
// CUDA always; into another arena on its own stream; into the global arena on a stream with a
// lazy record (DefaultStream, or one of our Streams in lazyRecs), which it returns for noteLazy.
func (r *ArenaMemoryResource) freeFast(o *arenaSet, s StreamView) (*arenaStream, bool) {
	if r.ctx == 0 {
		return nil, true
	}
	if o.kind == arenaGlobal {
		x := r.lazyRec(s)
		return x, x != nil
	}
	return nil, o.stream.id == s.id
}

// noteLazy notes the stream of x, a lazy record from freeFast, as pending on sb when its owner o
// (locked) is the global arena (see notePending; no CUDA call). It returns false when x is done
// (its Stream closed: the slow path synchronises the device) or sb cannot note one more stream.
func (r *ArenaMemoryResource) noteLazy(o *arenaSet, sb *arenaSuperblock, x *arenaStream) bool {
	if r.ctx == 0 || o.kind != arenaGlobal || r.closed.Load() {
		return true
	}
	if x.done {
		return false
	}
	ok, _ := r.notePending(sb, x) // lazy: never an error
	return ok
}

// crossArena reports whether a free on s into arena o must first synchronise s: o is another
// stream's arena (never without CUDA). Frees into the global arena are ordered by notePending.
func (r *ArenaMemoryResource) crossArena(o *arenaSet, s StreamView) bool {
	return r.ctx != 0 && o.kind != arenaGlobal && o.stream.id != s.id
}

// freeIn returns [ptr, ptr+n) to sb, whose owner o is locked (and is unlocked here), after its
// live entry was removed.
func (r *ArenaMemoryResource) freeIn(o *arenaSet, sb *arenaSuperblock, ptr DevicePtr, n int) error {
	sb.coalesce(ptr, n)
	o.tree.fix(sb)
	if o.kind == arenaGlobal && sb.empty() {
		r.freedEmpty(sb)
	}
	o.mu.Unlock()
	if r.closed.Load() {
		return r.finishClose()
	}
	return nil
}

// notAllocated returns the error for a free of ptr that the live table of its size (large:
// above 1 MiB) does not hold; when the other table holds ptr, the error gives the size
// allocated.
// findLive looks up the live block ptr, freed with nbytes, in l (large: the table of blocks above
// 1 MiB), which mu, held by the caller, guards: its slot and entry. When ptr is not there or was
// allocated with another size it unlocks mu and returns the ErrInvalidFree error.
func (r *ArenaMemoryResource) findLive(l *arenaLiveSet, ptr DevicePtr, nbytes int, large bool, mu *sync.Mutex) (int, arenaLive, error) {
	i := l.m.find(ptr)
	if i < 0 {
		mu.Unlock()
		return -1, arenaLive{}, r.notAllocated(ptr, nbytes, large)
	}
	e := l.m.slots[i].v
	if e.size != nbytes {
		mu.Unlock()
		return -1, arenaLive{}, arenaWrongSize(ptr, nbytes, e.size)
	}
	return i, e, nil
}

// notAllocated is the error for ptr, not found in the live table it belongs in by nbytes (large:
// the table of large blocks): a wrong size when the other table holds it, else a pointer this
// arena did not hand out or that was freed already.
func (r *ArenaMemoryResource) notAllocated(ptr DevicePtr, nbytes int, large bool) error {
	var l *arenaLiveSet
	if large {
		if a, i := r.findOwned(ptr); a != nil {
			size := a.live.m.slots[i].v.size
			a.mu.Unlock()
			return arenaWrongSize(ptr, nbytes, size)
		}
		ls := r.liveShard(ptr)
		ls.mu.Lock()
		defer ls.mu.Unlock()
		l = &ls.arenaLiveSet
	} else {
		r.lockGlobal()
		defer r.global.mu.Unlock()
		l = &r.large
	}
	if i := l.m.find(ptr); i >= 0 {
		return arenaWrongSize(ptr, nbytes, l.m.slots[i].v.size)
	}
	return errorf("ArenaMemoryResource.Deallocate(%#x, %d): the pointer was not allocated by this arena or was already freed: %w", uintptr(ptr), nbytes, ErrInvalidFree)
}

func arenaWrongSize(ptr DevicePtr, nbytes, size int) error {
	return errorf("ArenaMemoryResource.Deallocate(%#x, %d): the block was allocated with %s: %w", uintptr(ptr), nbytes, bytesText(size), ErrInvalidFree)
}

// syncStream waits for the work queued on s; for a closed Stream, for the whole device. A stream
// with nothing left to run is answered by cuStreamQuery, which only reads the stream's state,
// where cuStreamSynchronize goes through the driver's wait even on an idle stream.
func (r *ArenaMemoryResource) syncStream(s StreamView) error {
	if s.closed() {
		return r.drv.ctxSynchronize(r.ctx)
	}
	if done, err := r.drv.streamQuery(r.ctx, s.cu()); err == nil && done {
		return nil
	}
	return r.drv.streamSynchronize(r.ctx, s.cu())
}

// globalAdd puts sb into the global arena (locked), merging it with empty neighbours when empty.
func (r *ArenaMemoryResource) globalAdd(sb *arenaSuperblock) {
	g := &r.global
	sb.owner.Store(g)
	g.tree.insert(sb)
	if sb.empty() {
		r.mergeEmpty(sb)
	}
}

// mergeEmpty merges the empty superblock sb of the global arena (locked) with the empty
// superblocks right before and after it, as long as the result stays within 1 TiB. The merged
// superblock waits for the pending streams of both (mergePending).
func (r *ArenaMemoryResource) mergeEmpty(sb *arenaSuperblock) {
	if prev := sb.prevSB; r.mergeable(prev, sb) {
		r.mergeNext(prev)
		sb = prev
	}
	if r.mergeable(sb, sb.nextSB) {
		r.mergeNext(sb)
	}
}

// mergeable reports whether the superblocks sb and next, address neighbours (either may be nil),
// are both empty and in the global arena (locked), and together within 1 TiB.
func (r *ArenaMemoryResource) mergeable(sb, next *arenaSuperblock) bool {
	g := &r.global
	return sb != nil && next != nil && sb.owner.Load() == g && next.owner.Load() == g &&
		sb.empty() && next.empty() && sb.size()+next.size() <= arenaMaxSuperblockSize
}

// mergeNext merges sb's next neighbour into sb (see mergeable; global arena locked).
func (r *ArenaMemoryResource) mergeNext(sb *arenaSuperblock) {
	g := &r.global
	next := sb.nextSB
	g.tree.remove(next)
	r.mergePending(sb, next)
	sb.absorb(next)
	g.tree.fix(sb)
	r.keepSpare(next)
}

// freedEmpty merges sb, which a free in the global arena (locked) has just emptied, with its
// empty neighbours, as mergeEmpty does, except that a merge with the next neighbour alone is put
// off: when the next large request takes exactly sb, as when one stream allocates and frees a
// block of one size in a loop, the split that would undo the merge is saved too. Until then sb
// holds the merged superblock's pending streams (the merge's host waits, if any, are made now)
// and its neighbour none, or the same ones; every other holder of the global arena's lock first
// completes the merge (settle), so that the put-off merge is never seen.
func (r *ArenaMemoryResource) freedEmpty(sb *arenaSuperblock) {
	if r.mergeable(sb.prevSB, sb) || !r.mergeable(sb, sb.nextSB) {
		r.mergeEmpty(sb)
		return
	}
	if next := sb.nextSB; !samePending(sb, next) {
		r.mergePending(sb, next)
	} // else what next names is in sb already: the merge adds nothing
	r.putOff = sb
}

// settle completes the merge that freedEmpty put off, if any (global arena locked). It makes no
// CUDA call: the merged superblock already holds every pending stream.
func (r *ArenaMemoryResource) settle() {
	if sb := r.putOff; sb != nil {
		r.putOff = nil
		r.mergeNext(sb)
	}
}

// settleIn settles when o, just locked, is the global arena.
func (r *ArenaMemoryResource) settleIn(o *arenaSet) {
	if o == &r.global && r.putOff != nil {
		r.settle()
	}
}

// lockGlobal locks the global arena and completes a put-off merge (settle). Every holder of the
// global arena's lock takes it this way (or settles right after taking it), except
// allocateLarge, which may use the put-off superblock as it is.
func (r *ArenaMemoryResource) lockGlobal() {
	r.global.mu.Lock()
	r.settle()
}

// arenaSpareSuperblocks bounds the superblocks kept for reuse after merges.
const arenaSpareSuperblocks = 64

// keepSpare keeps the superblock sb, just merged into its neighbour, for a later split (global
// arena locked).
func (r *ArenaMemoryResource) keepSpare(sb *arenaSuperblock) {
	if len(r.spareSBs) < arenaSpareSuperblocks {
		r.spareSBs = append(r.spareSBs, sb)
	}
}

// spareSuperblock returns a superblock kept by keepSpare, or nil (global arena locked).
func (r *ArenaMemoryResource) spareSuperblock() *arenaSuperblock {
	k := len(r.spareSBs)
	if k == 0 {
		return nil
	}
	sb := r.spareSBs[k-1]
	r.spareSBs[k-1] = nil
	r.spareSBs = r.spareSBs[:k-1]
	return sb
}

// moveAllToGlobal returns every superblock of a (locked, with the global arena locked) to the
// global arena.
func (r *ArenaMemoryResource) moveAllToGlobal(a *arenaSet) {
	nodes := a.tree.nodes()
	a.tree = arenaIndex{}
	for _, x := range nodes {
		r.globalAdd(x.sb)
	}
	r.unown(a)
}

// unown moves the entries of a's own table to the shards, a's superblocks having gone to the
// global arena (a and the global arena locked, with streamsMu held: see findOwned).
func (r *ArenaMemoryResource) unown(a *arenaSet) {
	if a.live.count == 0 {
		return
	}
	var ls *arenaLiveShard
	a.live.m.each(func(p DevicePtr, e arenaLive) {
		if next := r.liveShard(p); next != ls {
			if ls != nil {
				ls.mu.Unlock()
			}
			ls = next
			ls.mu.Lock()
		}
		n, _ := alignSize(e.size)
		ls.add(p, e.sb, e.size, n)
	})
	ls.mu.Unlock()
	a.live = arenaLiveSet{}
}

// lockArenas takes multiMu and every arena's lock (not the global arena's) and returns the
// arenas and the function that unlocks them. No stream arena is made until then.
func (r *ArenaMemoryResource) lockArenas() ([]*arenaSet, func()) {
	r.multiMu.Lock()
	r.lockingAll.Add(1)
	r.streamsMu.Lock()
	arenas := make([]*arenaSet, 0, len(r.shards)+8)
	for i := range r.shards {
		arenas = append(arenas, &r.shards[i].arenaSet)
	}
	r.streams.Range(func(_, v any) bool {
		arenas = append(arenas, v.(*arenaSet))
		return true
	})
	for _, a := range arenas {
		a.mu.Lock()
	}
	return arenas, func() {
		for _, a := range arenas {
			a.mu.Unlock()
		}
		r.lockingAll.Add(-1)
		r.streamsMu.Unlock()
		r.multiMu.Unlock()
	}
}

// defragment waits for the device, then returns every arena's superblocks (empty or not) to
// the global arena, where empty neighbours coalesce. No stream is pending on any superblock
// afterwards. Arenas and records of foreign streams are dropped (they are made again on their
// next use). Every arena, the global one included, stays locked from before the synchronisation
// to the end, so that no free can slip a block whose work is still queued into the global arena,
// or note a stream there that the synchronisation does not cover.
func (r *ArenaMemoryResource) defragment() error {
	arenas, unlock := r.lockArenas()
	defer unlock()
	g := &r.global
	r.lockGlobal()
	if r.ctx != 0 {
		if err := r.drv.ctxSynchronize(r.ctx); err != nil {
			g.mu.Unlock()
			return err
		}
	}
	r.forgetPending()
	for _, a := range arenas {
		r.moveAllToGlobal(a)
		if a.kind == arenaStreamKind && !a.stream.lifetimeKnown() {
			a.retired = true
			r.streams.Delete(a.stream.id)
			r.arenas.Store(r.arenas.Load().without(a.stream.id))
		}
	}
	g.mu.Unlock()
	r.defrags.Add(1)
	return nil
}

// streamClosing is called by Stream.Close before the stream is destroyed. When the stream's
// arena holds superblocks, or the stream freed into the global arena, the stream is
// synchronised (cuStreamSynchronize; the device if that fails), its superblocks go back to the
// global arena, and its record is marked done and its event destroyed: superblocks that still
// name it as pending ignore it from then on, so nothing refers to the dead handle.
func (r *ArenaMemoryResource) streamClosing(s StreamView) {
	// streamsMu orders this after a streamArena or streamRec that registered the hook but has
	// not stored the arena or record yet. It is held until the superblocks are in the global
	// arena: lockArenas (Stats, CheckInvariants, Release) finds the arenas under it, and would
	// otherwise miss the superblocks of an arena already dropped from r.streams and not yet
	// emptied.
	r.streamsMu.Lock()
	defer r.streamsMu.Unlock()
	delete(r.hooked, s.id)
	v, ok := r.streams.LoadAndDelete(s.id)
	xv, xok := r.recs.LoadAndDelete(s.id)
	if ok {
		r.arenas.Store(r.arenas.Load().without(s.id))
	}
	if xok {
		// Readers of an older copy find the record done once the global arena's lock orders
		// them after its drop below.
		r.lazyRecs.Store(r.lazyRecs.Load().without(s.id))
	}
	var a *arenaSet
	if ok {
		a = v.(*arenaSet)
		a.mu.Lock()
		defer a.mu.Unlock()
		a.retired = true
		if a.tree.count == 0 {
			a = nil
		}
	}
	if a == nil && !xok {
		return
	}
	if r.ctx != 0 {
		if err := r.drv.streamSynchronize(r.ctx, s.cu()); err != nil {
			DebugLogger().Warn("rmm: ArenaMemoryResource: synchronising a closing stream failed; synchronising the device", "stream", s.String(), "err", err)
			if err := r.drv.ctxSynchronize(r.ctx); err != nil {
				DebugLogger().Error("rmm: ArenaMemoryResource: synchronising the device failed", "err", err)
			}
		}
	}
	r.lockGlobal()
	if xok {
		r.dropRec(xv.(*arenaStream))
	}
	if a != nil {
		r.moveAllToGlobal(a)
	}
	r.global.mu.Unlock()
}

// Release waits for the device and returns every arena's superblocks to the global arena,
// coalescing empty neighbours, as the defragmentation before a retry does: afterwards memory
// freed on any stream is available to every stream and to large requests. The arena is one
// upstream allocation, held until Close, so nothing goes back to the upstream.
func (r *ArenaMemoryResource) Release() error {
	if r.closed.Load() {
		return nil
	}
	return r.defragment()
}

// Close makes Allocate return [ErrClosed] and, when nothing is live, waits for the device and
// returns the arena to the upstream. Allocations still live stay valid: Deallocate keeps working
// and the last one returns the arena (a warning goes to the debug log). Closing twice returns
// nil.
func (r *ArenaMemoryResource) Close() error {
	r.closeMu.Lock()
	defer r.closeMu.Unlock()
	if r.closed.Load() {
		return nil
	}
	_, unlock := r.lockArenas()
	r.lockGlobal()
	r.closed.Store(true)
	r.global.mu.Unlock()
	unlock()
	if n := r.liveCount(); n > 0 {
		DebugLogger().Warn("rmm: ArenaMemoryResource closed with live allocations; the arena goes back to the upstream when they are freed", "live_allocations", n, "arena_size", r.size)
		return nil
	}
	return r.returnUpstream()
}

// finishClose returns the arena to the upstream once the last allocation outliving Close is
// freed.
func (r *ArenaMemoryResource) finishClose() error {
	r.closeMu.Lock()
	defer r.closeMu.Unlock()
	if !r.held || r.liveCount() > 0 {
		return nil
	}
	return r.returnUpstream()
}

// returnUpstream (closeMu held) waits for the device, destroys the events of the stream
// records and frees the arena's upstream allocation.
func (r *ArenaMemoryResource) returnUpstream() error {
	if !r.held {
		return nil
	}
	r.dropHooks()
	if r.ctx != 0 {
		if err := r.drv.ctxSynchronize(r.ctx); err != nil {
			return errorf("ArenaMemoryResource.Close: synchronising the device: %w", err)
		}
		r.dropRecs()
	}
	if err := r.upstream.Deallocate(r.base, r.size, DefaultStream); err != nil {
		return errorf("ArenaMemoryResource.Close: returning the %d-byte arena to %s: %w", r.size, resourceName(r.upstream), err)
	}
	r.held = false
	return nil
}

// ArenaStats is a snapshot of an arena's state. Sizes are in bytes.
type ArenaStats struct {
	ArenaSize         int     // bytes taken from the upstream
	PoolSize          int     // ArenaSize, named as in [OutOfMemoryError]
	MaximumSize       int     // ArenaSize: the arena never grows
	LiveBytes         int     // bytes of live allocations, each rounded up to 256
	LiveAllocations   int     // live allocations
	FreeBytes         int     // ArenaSize - LiveBytes
	FreeBlocks        int     // free blocks over all superblocks
	LargestFreeBlock  int     // bytes; the largest free block in any superblock now (a defragmentation may coalesce larger)
	Fragmentation     float64 // percent: (1 - LargestFreeBlock/FreeBytes) × 100; 0 when nothing is free
	Superblocks       int     // superblocks in all arenas
	GlobalSuperblocks int     // superblocks in the global arena
	EmptySuperblocks  int     // superblocks with nothing allocated
	StreamArenas      int     // arenas of streams (not counting the default stream's shards)
	Defragmentations  int     // times an allocation failure (or Release) made the arena defragment
	// GlobalFreeBlocks and GlobalFreeBytes are the free blocks and bytes of the superblocks in
	// the global arena, which belongs to no stream: large requests and arenas short of room take
	// from it.
	GlobalFreeBlocks int
	GlobalFreeBytes  int
	// PerStream is the free memory of each stream's arena (the superblocks it holds): first
	// [DefaultStream], its DefaultStreamArenas shards summed as one entry, then every stream arena by ascending [StreamView.ID], empty ones included. With
	// GlobalFreeBlocks and GlobalFreeBytes the entries add up to FreeBlocks and FreeBytes.
	PerStream []StreamFreeStats
}

// Stats returns the arena's figures. It locks every arena and costs O(superblocks + stream
// arenas × log(stream arenas)).
func (r *ArenaMemoryResource) Stats() ArenaStats {
	arenas, unlock := r.lockArenas()
	defer unlock()
	r.lockGlobal()
	defer r.global.mu.Unlock()
	st := ArenaStats{ArenaSize: r.size, PoolSize: r.size, MaximumSize: r.size, Defragmentations: int(r.defrags.Load())}
	st.PerStream = make([]StreamFreeStats, 1, len(arenas)-len(r.shards)+1)
	st.PerStream[0].Stream = DefaultStream
	for _, a := range append(arenas, &r.global) {
		var entry *StreamFreeStats
		switch a.kind {
		case arenaShardKind:
			entry = &st.PerStream[0]
		case arenaStreamKind:
			st.StreamArenas++
			st.PerStream = append(st.PerStream, StreamFreeStats{Stream: a.stream})
			entry = &st.PerStream[len(st.PerStream)-1]
		}
		a.tree.each(func(x *arenaNode) {
			sb := x.sb
			st.Superblocks++
			if a.kind == arenaGlobal {
				st.GlobalSuperblocks++
				st.GlobalFreeBlocks += sb.free.count
				st.GlobalFreeBytes += sb.freeBytes
			} else {
				entry.FreeBlocks += sb.free.count
				entry.FreeBytes += sb.freeBytes
			}
			if sb.empty() {
				st.EmptySuperblocks++
			}
			st.FreeBytes += sb.freeBytes
			st.FreeBlocks += sb.free.count
			st.LargestFreeBlock = max(st.LargestFreeBlock, sb.maxFree())
		})
	}
	slices.SortFunc(st.PerStream[1:], func(x, y StreamFreeStats) int { return cmp.Compare(x.Stream.ID(), y.Stream.ID()) })
	st.LiveAllocations, st.LiveBytes = r.large.count, r.large.bytes
	for _, a := range arenas {
		st.LiveAllocations += a.live.count
		st.LiveBytes += a.live.bytes
	}
	for i := range r.live {
		ls := &r.live[i]
		ls.mu.Lock()
		st.LiveAllocations += ls.count
		st.LiveBytes += ls.bytes
		ls.mu.Unlock()
	}
	st.Fragmentation = fragmentation(st.LargestFreeBlock, st.FreeBytes)
	return st
}

func fragmentation(largest, free int) float64 {
	if free == 0 {
		return 0
	}
	return (1 - float64(largest)/float64(free)) * 100
}

// fail writes the dump when enabled and returns the out-of-memory error for an nbytes request
// (n bytes once rounded to 256; math.MaxInt when rounding overflows): an *OutOfMemoryError with
// the arena's figures (the arena is its own maximum and never grows, so Headroom is 0) and detail
// saying what failed.
func (r *ArenaMemoryResource) fail(nbytes, n int, detail string) error {
	st := r.Stats()
	if r.dumpPath != "" {
		r.dump(nbytes)
	}
	DebugLogger().Debug("rmm: ArenaMemoryResource out of memory", "request", nbytes, "arena_size", st.ArenaSize, "free", st.FreeBytes, "largest_free", st.LargestFreeBlock)
	return newOutOfMemory(OutOfMemoryError{
		Resource:         "ArenaMemoryResource",
		Requested:        nbytes,
		PoolSize:         st.PoolSize,
		FreeBytes:        st.FreeBytes,
		LargestFreeBlock: st.LargestFreeBlock,
		MaximumSize:      st.MaximumSize,
		Detail:           detail,
	}, n)
}

type arenaDumpLine struct {
	owner                   string
	start, end              DevicePtr
	size, freeBlocks, maxFr int
	empty                   bool
}

// dump writes the arena's state after a failed nbytes request to the dump file.
func (r *ArenaMemoryResource) dump(nbytes int) {
	arenas, unlock := r.lockArenas()
	r.lockGlobal()
	var lines []arenaDumpLine
	totalFree, largest := 0, 0
	for _, a := range append(arenas, &r.global) {
		a.tree.each(func(x *arenaNode) {
			sb := x.sb
			lines = append(lines, arenaDumpLine{a.name(), sb.addr(), sb.end(), sb.size(), sb.free.count, sb.maxFree(), sb.empty()})
			totalFree += sb.freeBytes
			largest = max(largest, sb.maxFree())
		})
	}
	r.global.mu.Unlock()
	unlock()
	slices.SortFunc(lines, func(x, y arenaDumpLine) int { return cmp.Compare(x.start, y.start) })

	r.dumpMu.Lock()
	defer r.dumpMu.Unlock()
	flags := os.O_CREATE | os.O_WRONLY | os.O_APPEND
	if !r.dumped {
		flags |= os.O_TRUNC
	}
	f, err := os.OpenFile(r.dumpPath, flags, 0o644)
	if err != nil {
		DebugLogger().Warn("rmm: ArenaMemoryResource: cannot write the memory dump", "path", r.dumpPath, "err", err)
		return
	}
	defer f.Close()
	r.dumped = true
	l := slog.New(slog.NewTextHandler(f, &slog.HandlerOptions{Level: slog.LevelDebug}))
	l.Info("arena out of memory", "requested_bytes", nbytes, "requested", FormatBytes(int64(nbytes)))
	l.Info("arena state", "arena_size", r.size, "superblocks", len(lines), "total_free", totalFree,
		"largest_free", largest, "fragmentation_percent", fmt.Sprintf("%.2f", fragmentation(largest, totalFree)))
	prevEnd := r.base
	for i, x := range lines {
		l.Debug("superblock", "index", i, "owner", x.owner, "start", fmt.Sprintf("%#x", uintptr(x.start)),
			"end", fmt.Sprintf("%#x", uintptr(x.end)), "size", x.size, "empty", x.empty,
			"free_blocks", x.freeBlocks, "max_free", x.maxFr, "gap", int(x.start-prevEnd))
		prevEnd = x.end
	}
}

// CheckInvariants verifies the arena's internal state and returns the first violation found:
// every arena's index is well formed, records each superblock's largest free block, and its
// superblocks name it as their owner; superblocks tile the arena exactly, link to their address
// neighbours and are between 1 MiB and 1 TiB; in each superblock the free blocks are
// 256-aligned, ordered, never adjacent (coalescing is complete) and their total is its free
// bytes; live allocations lie in their superblock and overlap nothing; free plus live bytes
// equal each superblock's size; no two empty neighbours in the global arena are left unmerged;
// only superblocks of the global arena name pending streams, each at most once; the live tables
// are well formed, blocks above 1 MiB in the table of large blocks and the others in the shards
// or in the own table of the arena that holds their superblock.
// It locks everything (completing a merge put off by a free, as every use of the global arena
// does), takes O(n log n) time and is meant for tests.
func (r *ArenaMemoryResource) CheckInvariants() (err error) {
	defer func() {
		if err != nil {
			err = errorf("ArenaMemoryResource.CheckInvariants: %w", err)
		}
	}()
	arenas, unlock := r.lockArenas()
	defer unlock()
	r.lockGlobal()
	defer r.global.mu.Unlock()
	for i := range r.live {
		r.live[i].mu.Lock()
		defer r.live[i].mu.Unlock()
	}
	var sbs []*arenaSuperblock
	for _, a := range append(arenas, &r.global) {
		if err := a.tree.check(); err != nil {
			return errorf("arena %s: %w", a.name(), err)
		}
		var err error
		a.tree.each(func(x *arenaNode) {
			if err != nil {
				return
			}
			sb := x.sb
			switch {
			case sb == nil || &sb.node != x:
				err = errorf("arena %s: node %#x is not a superblock's", a.name(), uintptr(x.addr))
			case sb.owner.Load() != a:
				err = errorf("superblock %#x is in arena %s but names another owner", uintptr(sb.addr()), a.name())
			case a != &r.global && sb.pend.len() > 0:
				err = errorf("superblock %#x in arena %s still names %d pending streams", uintptr(sb.addr()), a.name(), sb.pend.len())
			case sb.pend.len() > 0:
				if e := sb.pend.check(); e != nil {
					err = errorf("superblock %#x: %w", uintptr(sb.addr()), e)
				}
			}
			sbs = append(sbs, sb)
		})
		if err != nil {
			return err
		}
	}
	slices.SortFunc(sbs, func(x, y *arenaSuperblock) int { return cmp.Compare(x.addr(), y.addr()) })
	live := map[*arenaSuperblock][]arenaNode{}
	liveCount := 0
	for i := 0; i <= len(r.live)+len(arenas); i++ {
		ls, name := &r.large, "the table of large blocks"
		var own *arenaSet // the arena whose own table ls is
		switch {
		case i < len(r.live):
			ls, name = &r.live[i].arenaLiveSet, fmt.Sprintf("live shard %d", i)
		case i < len(r.live)+len(arenas):
			own = arenas[i-len(r.live)]
			ls, name = &own.live, "the table of arena "+own.name()
		}
		c, b := 0, 0
		var err error
		ls.m.each(func(p DevicePtr, e arenaLive) {
			n, _ := alignSize(e.size)
			if large := n > arenaMinSuperblockSize; large != (ls == &r.large) && err == nil {
				err = errorf("%s holds the allocation %#x of %s", name, uintptr(p), bytesText(e.size))
			}
			if own != nil && e.sb.owner.Load() != own && err == nil {
				err = errorf("%s holds the allocation %#x, whose superblock %#x is not in that arena", name, uintptr(p), uintptr(e.sb.addr()))
			}
			live[e.sb] = append(live[e.sb], arenaNode{addr: p, size: n})
			c++
			b += n
		})
		if err != nil {
			return err
		}
		if err := ls.m.check(); err != nil {
			return errorf("%s: %w", name, err)
		}
		if c != ls.count || b != ls.bytes {
			return errorf("%s counts %d allocations of %s, holds %d of %d", name, ls.count, bytesText(ls.bytes), c, b)
		}
		liveCount += c
	}
	next := r.base
	seen := 0
	for i, sb := range sbs {
		switch {
		case sb.addr() != next:
			return errorf("superblock %#x does not start where the previous one ends (%#x)", uintptr(sb.addr()), uintptr(next))
		case sb.size() < arenaMinSuperblockSize:
			return errorf("superblock %#x of %s is below 1 MiB", uintptr(sb.addr()), bytesText(sb.size()))
		case sb.size() > arenaMaxSuperblockSize:
			return errorf("superblock %#x of %s is above 1 TiB", uintptr(sb.addr()), bytesText(sb.size()))
		}
		var before, after *arenaSuperblock
		if i > 0 {
			before = sbs[i-1]
		}
		if i+1 < len(sbs) {
			after = sbs[i+1]
		}
		if sb.prevSB != before || sb.nextSB != after {
			return errorf("superblock %#x does not link to its address neighbours", uintptr(sb.addr()))
		}
		next = sb.end()
		if err := sb.free.check(); err != nil {
			return errorf("superblock %#x: free blocks: %w", uintptr(sb.addr()), err)
		}
		spans := sb.free.nodes()
		free := 0
		for k, b := range spans {
			if b.addr%Alignment != 0 || b.size%Alignment != 0 || b.size <= 0 {
				return errorf("superblock %#x: free block %#x of %s is not on the 256-byte grid", uintptr(sb.addr()), uintptr(b.addr), bytesText(b.size))
			}
			if k > 0 && spans[k-1].end() == b.addr {
				return errorf("superblock %#x: free blocks %#x and %#x are adjacent but not coalesced", uintptr(sb.addr()), uintptr(spans[k-1].addr), uintptr(b.addr))
			}
			free += b.size
		}
		if free != sb.freeBytes {
			return errorf("superblock %#x: free bytes counted %d, blocks hold %d", uintptr(sb.addr()), sb.freeBytes, free)
		}
		ls := live[sb]
		seen += len(ls)
		used := 0
		for _, b := range ls {
			used += b.size
		}
		if free+used != sb.size() {
			return errorf("superblock %#x: %d free + %d live bytes != its %s", uintptr(sb.addr()), free, used, bytesText(sb.size()))
		}
		for k := range ls {
			b := &ls[k]
			spans = append(spans, b)
		}
		slices.SortFunc(spans, func(x, y *arenaNode) int { return cmp.Compare(x.addr, y.addr) })
		for k, b := range spans {
			if b.addr < sb.addr() || b.end() > sb.end() {
				return errorf("block %#x of %s lies outside its superblock %#x", uintptr(b.addr), bytesText(b.size), uintptr(sb.addr()))
			}
			if k > 0 && spans[k-1].end() > b.addr {
				return errorf("blocks %#x and %#x overlap", uintptr(spans[k-1].addr), uintptr(b.addr))
			}
		}
		if i > 0 {
			prev := sbs[i-1]
			if prev.owner.Load() == &r.global && sb.owner.Load() == &r.global && prev.empty() && sb.empty() &&
				prev.size()+sb.size() <= arenaMaxSuperblockSize {
				return errorf("empty superblocks %#x and %#x of the global arena are not merged", uintptr(prev.addr()), uintptr(sb.addr()))
			}
		}
	}
	if len(sbs) > 0 && next != r.base+DevicePtr(r.size) {
		return errorf("superblocks end at %#x, the arena at %#x", uintptr(next), uintptr(r.base+DevicePtr(r.size)))
	}
	if seen != liveCount {
		return errorf("%d live allocations name a superblock that is in no arena", liveCount-seen)
	}
	return nil
}
