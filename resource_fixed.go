package rmm

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
)

// FixedSizeOptions configures [NewFixedSizeMemoryResource]. nil means the defaults.
type FixedSizeOptions struct {
	// BlockSize is the size of every block, in bytes, rounded up to a multiple of 256. Every
	// allocation of at most BlockSize bytes takes one whole block. Default 0: 1 MiB.
	BlockSize int
	// BlocksToPreallocate is the number of blocks in each chunk taken from the upstream: one
	// chunk at construction, another of the same size each time every block is in use.
	// Default 0: 128.
	BlocksToPreallocate int
}

// fixedStreams is the resource's registry of per-stream lists (stream_order.go), named so that
// go doc leaves the embedded field out, as it does any unexported field.
type fixedStreams = streamLists[*fixedList]

// FixedSizeMemoryResource hands out blocks of one fixed size, as librmm's
// fixed_size_memory_resource: memory is taken from the upstream in chunks of
// BlockSize × BlocksToPreallocate bytes (one at construction, on the default stream; another on
// the allocating stream whenever every block is in use) and cut into blocks. Every allocation
// of at most BlockSize bytes takes one block; larger requests fail with an [*OutOfMemoryError]
// whose Detail says "maximum allocation size exceeded".
//
// Free blocks are kept per stream, with the pool's stream-ordered rules: a block freed on stream
// A is reused at once by allocations on A; stream B takes it only after B waits (on the device)
// for an event recorded on A. The event is recorded lazily, when B takes the block, on streams
// whose lifetime the package knows ([DefaultStream] and our own Streams, whose Close records or
// synchronises first and moves their blocks to the default stream), and at every free on streams
// made from foreign handles. Allocate and Deallocate are O(1) when the stream has a free block
// and the block is freed on the stream that allocated it; taking a block from another stream and
// a free on another stream cost a scan of the streams.
//
// Deallocate detects a pointer the resource never handed out, a double free and a size other
// than the one allocated, and returns [ErrInvalidFree] without changing anything. Safe for
// concurrent use: each stream's list has a lock of its own, so goroutines that allocate and free
// on their own streams share no lock (see fixedList); growth, taking blocks from another stream,
// frees on another stream, invalid frees, Stats, Release and Close take the resource's mutex.
type FixedSizeMemoryResource struct {
	upstream    MemoryResource
	blockSize   int
	chunkBlocks int
	chunkSize   int
	// fast finds a stream's list without mu, for the fast paths: published under mu when a list
	// is made, and without it when it is dropped (a reader holding a dropped list finds it empty
	// and takes the slow path).
	fast atomic.Pointer[streamSet[*fixedList]]
	// The fields above are read by every call on every core; those below are written by the
	// slow paths.
	_ [64]byte

	mu sync.Mutex
	// The per-stream lists, with the device, its context and the driver (stream_order.go).
	fixedStreams
	chunks []fixedChunk // sorted by address
	// live holds the blocks handed out whose list no longer holds them: the list was dropped
	// (its stream closed), or the resource was closed (then every live block is here). Block ->
	// size asked.
	live   liveTable[int]
	closed bool
}

type fixedChunk struct {
	addr DevicePtr
	live int // live blocks; kept only after Close
}

// fixedList is one stream's free blocks and the blocks allocated on that stream and not freed
// yet, under a lock of its own: an allocation on the stream that finds a free block here, and the
// free on the same stream of a block allocated here, take mu alone (the fast paths). Everything
// else holds the resource's mutex first and then the lists' locks it needs (a list's lock is
// never held while waiting for the resource's mutex, and two lists are locked together only
// under the resource's mutex). The streamOrder's flags and event are under mu too, so that a
// free's dirty mark (or its event record) and a taker's record and wait stay in order.
//
// Laid out for the cache lines of a many-core host: the pads keep the fields written at every
// call off the lines of objects allocated next to the list (lists are made one after another),
// and the slices behind blocks and issued are kept at whole cache lines (newFixedList, liveTable
// grows by doubling from 128 bytes) so that two streams' tables never share one.
type fixedList struct {
	_ [64]byte
	streamOrder
	mu     sync.Mutex
	blocks []DevicePtr    // free blocks, the last one taken first
	issued liveTable[int] // allocated on this stream and not freed: block -> size asked
	_      [64]byte
}

// fixedListMinCap is the capacity a list's slice of free blocks starts with: one cache line, so
// that appends keep it at whole lines.
const fixedListMinCap = 64 / 8

func newFixedList(int) *fixedList {
	return &fixedList{blocks: make([]DevicePtr, 0, fixedListMinCap)}
}

// pop hands out the block l's stream freed last, for a request of asked bytes, recording it in
// l's table of blocks handed out; false when l has none (l locked).
func (l *fixedList) pop(asked int) (DevicePtr, bool) {
	k := len(l.blocks) - 1
	if k < 0 {
		return 0, false
	}
	p := l.blocks[k]
	l.blocks = l.blocks[:k]
	l.issued.put(p, asked)
	return p, true
}

func (l *fixedList) idle() bool { return len(l.blocks) == 0 }

// NewFixedSizeMemoryResource returns a fixed-size resource over upstream (nil opts: the
// defaults) and takes its first chunk now; that allocation's failure is returned. Negative sizes
// and a chunk size that overflows are [ErrInvalidArgument]. A nil upstream means the current
// device resource ([CurrentDeviceResource], read once, here); a nil pointer as upstream returns
// an error wrapping [ErrInvalidArgument].
func NewFixedSizeMemoryResource(upstream MemoryResource, opts *FixedSizeOptions) (*FixedSizeMemoryResource, error) {
	upstream, err := upstreamOf("NewFixedSizeMemoryResource", upstream)
	if err != nil {
		return nil, err
	}
	var o FixedSizeOptions
	if opts != nil {
		o = *opts
	}
	if o.BlockSize < 0 || o.BlocksToPreallocate < 0 {
		return nil, errorf("NewFixedSizeMemoryResource: negative BlockSize %d or BlocksToPreallocate %d: %w", o.BlockSize, o.BlocksToPreallocate, ErrInvalidArgument)
	}
	if o.BlockSize == 0 {
		o.BlockSize = 1 << 20
	}
	if o.BlocksToPreallocate == 0 {
		o.BlocksToPreallocate = 128
	}
	bs, ok := alignSize(o.BlockSize)
	if !ok || o.BlocksToPreallocate > int(^uint(0)>>1)/bs {
		return nil, errorf("NewFixedSizeMemoryResource: chunk of %d blocks of %s overflows: %w", o.BlocksToPreallocate, bytesText(o.BlockSize), ErrInvalidArgument)
	}
	f := &FixedSizeMemoryResource{
		upstream:    upstream,
		blockSize:   bs,
		chunkBlocks: o.BlocksToPreallocate,
		chunkSize:   bs * o.BlocksToPreallocate,
	}
	if err := f.initStreams("FixedSizeMemoryResource", DeviceOf(upstream), f, newFixedList); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	l, err := f.list(DefaultStream)
	if err != nil {
		return nil, err
	}
	p, err := f.grow(l, DefaultStream, f.chunkSize)
	if err != nil {
		f.destroyEvents()
		return nil, errorf("NewFixedSizeMemoryResource: taking the first chunk: %w", err)
	}
	l.mu.Lock()
	l.blocks = append(l.blocks, p)
	l.mu.Unlock()
	return f, nil
}

// Upstream returns the resource the blocks come from.
func (f *FixedSizeMemoryResource) Upstream() MemoryResource { return f.upstream }

func (*FixedSizeMemoryResource) insideUpstream() {}

// Device returns the device the resource belongs to (its upstream's).
func (f *FixedSizeMemoryResource) Device() Device { return f.dev }

// Access reports the upstream's access.
func (f *FixedSizeMemoryResource) Access() Access { return AccessOf(f.upstream) }

// BlockSize returns the size of every block in bytes (a multiple of 256).
func (f *FixedSizeMemoryResource) BlockSize() int { return f.blockSize }

// fastList returns s's list as last published, or nil.
func (f *FixedSizeMemoryResource) fastList(s StreamView) *fixedList {
	m := f.fast.Load()
	if m == nil {
		return nil
	}
	if len(m.ids) > streamSetScan {
		l, _ := m.lookup(s.id)
		return l
	}
	// streamSet.find's scan, spelt out as in the pool's cacheOf: on every allocation and free.
	for i, x := range m.ids {
		if x >= s.id {
			if x == s.id {
				return m.vals[i]
			}
			break
		}
	}
	return nil
}

// list is listFor (mu held), with the list published for the fast paths.
func (f *FixedSizeMemoryResource) list(s StreamView) (*fixedList, error) {
	l, err := f.listFor(s)
	if err != nil {
		return nil, err
	}
	f.publish(l)
	return l, nil
}

// publish makes l, a list of the registry, the one the fast paths find for its stream (mu held).
func (f *FixedSizeMemoryResource) publish(l *fixedList) {
	if old := f.fast.Load(); f.fastList(l.stream) != l {
		f.fast.Store(old.with(l.stream.id, l))
	}
}

// drop forgets list l (mu and l.mu held): its event is destroyed, it is unpublished, and the
// blocks allocated on it go to the live table. Its free blocks must have been moved.
func (f *FixedSizeMemoryResource) drop(l *fixedList) {
	if !l.dropped {
		f.dropList(l)
	}
	f.orphan(l)
}

// orphan unpublishes l, which was dropped (mu and l.mu held), and moves the blocks allocated on it
// to the live table.
func (f *FixedSizeMemoryResource) orphan(l *fixedList) {
	if old := f.fast.Load(); f.fastList(l.stream) == l {
		f.fast.Store(old.without(l.stream.id))
	}
	f.adopt(l)
}

// adopt moves the blocks allocated on l to the live table (mu and l.mu held).
func (f *FixedSizeMemoryResource) adopt(l *fixedList) {
	if l.issued.len() > 0 {
		l.issued.each(func(p DevicePtr, n int) { f.live.put(p, n) })
		l.issued = liveTable[int]{}
	}
}

// Allocate returns one block for a request of at most BlockSize bytes, ordered on s: a block
// freed on s, else one freed on another stream (after s waits on that stream's event), else a
// block of a new chunk taken from the upstream on s. A larger request, or a chunk the upstream
// refuses, returns an [*OutOfMemoryError] (errors.Is(err, [ErrOutOfMemory])) with the resource's
// figures: PoolSize (the chunks held), FreeBytes, LargestFreeBlock (BlockSize when a block is
// free, else 0), no MaximumSize and no Headroom (only the upstream bounds the resource), the
// upstream's error as Cause when it refused a chunk. Fragmented is set only for a request above
// the block size that the free blocks together would hold. After Close, and on a [Stream] that was
// closed, it returns [ErrClosed].
func (f *FixedSizeMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes <= 0 {
		if nbytes < 0 {
			return 0, invalidSize("FixedSizeMemoryResource", "Allocate", nbytes)
		}
		return 0, nil
	}
	if nbytes <= f.blockSize {
		// The fast path: a block s freed, under s's lock alone. A closed stream's list keeps its
		// blocks for other streams; Close and a dropped list leave the list empty.
		if l := f.fastList(s); l != nil {
			l.mu.Lock()
			if !l.closed {
				if p, ok := l.pop(nbytes); ok {
					l.mu.Unlock()
					return p, nil
				}
			}
			l.mu.Unlock()
		}
	}
	return f.allocateSlow(nbytes, s)
}

// allocateSlow is Allocate under the resource's mutex.
func (f *FixedSizeMemoryResource) allocateSlow(nbytes int, s StreamView) (DevicePtr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if nbytes > f.blockSize {
		return 0, f.oomError(nbytes, fmt.Sprintf("maximum allocation size exceeded: every block is %d bytes, and larger requests always fail", f.blockSize), nil)
	}
	if f.closed {
		return 0, errorf("FixedSizeMemoryResource.Allocate: called after Close: %w", ErrClosed)
	}
	l, err := f.list(s)
	if err != nil {
		return 0, err
	}
	l.mu.Lock()
	if p, ok := l.pop(nbytes); ok {
		l.mu.Unlock()
		return p, nil
	}
	l.mu.Unlock()
	p, err := f.take(l, s, nbytes)
	if err != nil {
		return 0, err
	}
	l.mu.Lock()
	l.issued.put(p, nbytes)
	l.mu.Unlock()
	return p, nil
}

// take returns a block for s, whose list l is empty (mu held, l.mu not): one taken from another
// stream's list after s waits for that stream, else the first block of a new chunk, whose other
// blocks go to l (for a request of nbytes).
func (f *FixedSizeMemoryResource) take(l *fixedList, s StreamView, nbytes int) (DevicePtr, error) {
	for _, o := range f.lists {
		if o == l {
			continue
		}
		o.mu.Lock()
		k := len(o.blocks) - 1
		if k < 0 {
			o.mu.Unlock()
			continue
		}
		if err := f.orderAfter(o, s); err != nil {
			o.mu.Unlock()
			return 0, errorf("FixedSizeMemoryResource.Allocate: ordering %v after %v: %w", s, o.stream, err)
		}
		p := o.blocks[k]
		o.blocks = o.blocks[:k]
		o.mu.Unlock()
		return p, nil
	}
	return f.grow(l, s, nbytes)
}

// grow takes a new chunk from the upstream on s (mu held, l.mu not), puts its blocks but the
// first in l, lowest address on top, and returns the first. The upstream's refusal becomes an
// *OutOfMemoryError for a request of nbytes.
func (f *FixedSizeMemoryResource) grow(l *fixedList, s StreamView, nbytes int) (DevicePtr, error) {
	p, err := f.upstream.Allocate(f.chunkSize, s)
	if err != nil {
		DebugLogger().Debug("rmm: FixedSizeMemoryResource failed to grow", "chunk", f.chunkSize, "pool_size", len(f.chunks)*f.chunkSize, "err", err)
		return 0, f.oomError(nbytes, fmt.Sprintf("growing by a chunk of %d blocks of %d bytes (%d bytes): %s refused it", f.chunkBlocks, f.blockSize, f.chunkSize, resourceName(f.upstream)), err)
	}
	i := sort.Search(len(f.chunks), func(i int) bool { return f.chunks[i].addr > p })
	f.chunks = append(f.chunks, fixedChunk{})
	copy(f.chunks[i+1:], f.chunks[i:])
	f.chunks[i] = fixedChunk{addr: p}
	l.mu.Lock()
	for k := f.chunkBlocks - 1; k >= 1; k-- {
		l.blocks = append(l.blocks, p+DevicePtr(k*f.blockSize))
	}
	l.mu.Unlock()
	return p, nil
}

// Deallocate returns p's block to the free list of stream s, for reuse at once by work ordered
// on s. nbytes must be the size given to Allocate. A pointer the resource did not hand out, a
// double free or another size returns [ErrInvalidFree] and changes nothing. A free on a [Stream]
// that was closed is ordered by a device synchronisation and goes to the default stream's list.
func (f *FixedSizeMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if p == 0 {
		return nil
	}
	// The fast path: a block allocated on s, freed on s, under s's lock alone.
	if l := f.fastList(s); l != nil {
		l.mu.Lock()
		if i := l.issued.find(p); i >= 0 && !l.closed {
			if n := l.issued.slots[i].v; n != nbytes {
				l.mu.Unlock()
				return f.wrongSize(p, nbytes, n)
			}
			if err := f.noteFree(l, s); err != nil {
				l.mu.Unlock()
				return err
			}
			l.issued.delAt(i)
			l.blocks = append(l.blocks, p)
			l.mu.Unlock()
			return nil
		}
		l.mu.Unlock()
	}
	return f.deallocateSlow(p, nbytes, s)
}

func (f *FixedSizeMemoryResource) wrongSize(p DevicePtr, nbytes, size int) error {
	return errorf("FixedSizeMemoryResource.Deallocate(%#x, %d): the block was allocated with %s: %w", uintptr(p), nbytes, bytesText(size), ErrInvalidFree)
}

// deallocateSlow is Deallocate under the resource's mutex: a block allocated on another stream,
// or on a list that was dropped, or after Close; else an invalid free.
func (f *FixedSizeMemoryResource) deallocateSlow(p DevicePtr, nbytes int, s StreamView) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	// Find the block and take it out of its table, so that a racing free of it (a double free)
	// finds it nowhere; it goes back when this free fails.
	var owner *fixedList // nil: the live table
	size, found := f.live.lookup(p)
	if found {
		if size != nbytes {
			return f.wrongSize(p, nbytes, size)
		}
		if f.closed {
			return f.deallocateAfterClose(p, s)
		}
		f.live.delAt(f.live.find(p))
	} else {
		for _, o := range f.lists {
			o.mu.Lock()
			if i := o.issued.find(p); i >= 0 {
				size, found = o.issued.slots[i].v, true
				if size == nbytes {
					o.issued.delAt(i)
					owner = o
				}
			}
			o.mu.Unlock()
			if found {
				break
			}
		}
		if !found {
			return errorf("FixedSizeMemoryResource.Deallocate(%#x, %d): the pointer was not allocated by this resource or was already freed: %w", uintptr(p), nbytes, ErrInvalidFree)
		}
		if size != nbytes {
			return f.wrongSize(p, nbytes, size)
		}
	}
	if err := f.freeInto(p, s); err != nil {
		if owner == nil {
			f.live.put(p, size)
		} else {
			owner.mu.Lock()
			owner.issued.put(p, size)
			owner.mu.Unlock()
		}
		return err
	}
	return nil
}

// freeInto puts p, freed on s, into s's list (mu held), or for a Stream that was closed into the
// default stream's list once the device was waited for (freeTo's rule).
func (f *FixedSizeMemoryResource) freeInto(p DevicePtr, s StreamView) error {
	l, err := f.list(s)
	if errors.Is(err, ErrClosed) {
		if err = f.syncClosed(s); err != nil {
			return err
		}
		s = DefaultStream
		l, err = f.list(s)
	}
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := f.noteFree(l, s); err != nil {
		return err
	}
	l.blocks = append(l.blocks, p)
	return nil
}

// streamClosing is called by Stream.Close before the stream is destroyed: the stream's free
// blocks move to the default stream's list, after the default stream waits (on the device) for
// the closing stream's work; its list and event are dropped (closeStream), and the blocks
// allocated on it go to the live table.
func (f *FixedSizeMemoryResource) streamClosing(s StreamView) {
	f.mu.Lock()
	defer f.mu.Unlock()
	l, ok := f.byStream[s.id]
	def, hasDef := f.byStream[DefaultStream.id]
	if ok {
		l.mu.Lock()
		defer l.mu.Unlock()
	}
	if hasDef && def != l {
		def.mu.Lock()
		defer def.mu.Unlock()
	}
	// closeStream may make the default stream's list: no other goroutine sees it before mu is
	// unlocked.
	d, _, move := f.closeStream(s, f.closed)
	if move {
		d.blocks = append(d.blocks, l.blocks...)
		l.blocks = l.blocks[:0]
		f.dropList(l)
	}
	if ok && l.dropped {
		f.orphan(l)
	}
	if d != nil && !hasDef {
		f.publish(d)
	}
}

// hostSync waits on the host for the work behind l's frees (mu and l.mu held).
func (f *FixedSizeMemoryResource) hostSync(l *fixedList) error {
	if !f.ordered(l) {
		return nil
	}
	record := l.claimRecord(false)
	if err := f.hostWait(l, record); err != nil {
		if record {
			l.unclaim()
		}
		return err
	}
	return nil
}

// chunkOf returns the index of the chunk holding p.
func (f *FixedSizeMemoryResource) chunkOf(p DevicePtr) int {
	return sort.Search(len(f.chunks), func(i int) bool { return f.chunks[i].addr > p }) - 1
}

// releaseWhole (mu held) waits for every stream's frees, gathers every free block in the default
// stream's list and returns the chunks whose blocks are all free to the upstream. Each list is
// waited for and emptied under its lock, so no block freed after the wait moves; the default
// stream's list stays locked until its chunks are gone. A list that has blocks allocated on it
// stays (empty), the others are dropped.
func (f *FixedSizeMemoryResource) releaseWhole() error {
	def, err := f.list(DefaultStream)
	if err != nil {
		return err
	}
	def.mu.Lock()
	defer def.mu.Unlock()
	if err := f.hostSync(def); err != nil {
		return errorf("FixedSizeMemoryResource: waiting for the streams: %w", err)
	}
	for _, o := range slices.Clone(f.lists) {
		if o == def || o.closed {
			continue
		}
		o.mu.Lock()
		if err := f.hostSync(o); err != nil {
			o.mu.Unlock()
			return errorf("FixedSizeMemoryResource: waiting for the streams: %w", err)
		}
		def.blocks = append(def.blocks, o.blocks...)
		o.blocks = o.blocks[:0]
		if o.issued.len() == 0 {
			f.drop(o)
		}
		o.mu.Unlock()
	}
	for _, o := range f.lists {
		if o.closed { // its blocks stay for takers that wait on its event; still waited for
			o.mu.Lock()
			err := f.hostSync(o)
			o.mu.Unlock()
			if err != nil {
				return errorf("FixedSizeMemoryResource: waiting for the streams: %w", err)
			}
		}
	}
	freeIn := make([]int, len(f.chunks))
	for _, p := range def.blocks {
		freeIn[f.chunkOf(p)]++
	}
	whole := make([]bool, len(f.chunks))
	var firstErr error
	for i, c := range f.chunks {
		if freeIn[i] != f.chunkBlocks {
			continue
		}
		if err := f.upstream.Deallocate(c.addr, f.chunkSize, DefaultStream); err != nil {
			if firstErr == nil {
				firstErr = errorf("FixedSizeMemoryResource: returning the chunk at %#x to %s: %w", uintptr(c.addr), resourceName(f.upstream), err)
			}
			continue
		}
		whole[i] = true
	}
	kept := def.blocks[:0]
	for _, p := range def.blocks {
		if !whole[f.chunkOf(p)] {
			kept = append(kept, p)
		}
	}
	def.blocks = kept
	chunks := f.chunks[:0]
	for i, c := range f.chunks {
		if !whole[i] {
			chunks = append(chunks, c)
		}
	}
	f.chunks = chunks
	return firstErr
}

// Release waits for the work behind every free, then returns every chunk whose blocks are all
// free to the upstream. O(n log c) for n free blocks and c chunks.
func (f *FixedSizeMemoryResource) Release() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil
	}
	return f.releaseWhole()
}

// Close waits for the work behind every free, returns every wholly free chunk to the upstream
// and destroys the events. Afterwards Allocate returns [ErrClosed]. Allocations still live stay
// valid: Deallocate keeps working (after synchronising the freeing stream) and each chunk goes
// back to the upstream when its last block is freed. Closing twice returns nil.
func (f *FixedSizeMemoryResource) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil
	}
	// Every list stays locked from its wait to the end, so that no free slips in after the wait.
	for i, l := range f.lists {
		l.mu.Lock()
		if err := f.hostSync(l); err != nil {
			for _, o := range f.lists[:i+1] {
				o.mu.Unlock()
			}
			return errorf("FixedSizeMemoryResource.Close: waiting for the streams: %w", err)
		}
	}
	f.destroyEvents()
	f.closed = true
	for _, l := range f.lists {
		l.blocks = l.blocks[:0]
		f.adopt(l)
		l.mu.Unlock()
	}
	f.live.each(func(p DevicePtr, _ int) { f.chunks[f.chunkOf(p)].live++ })
	var firstErr error
	chunks := f.chunks[:0]
	for _, c := range f.chunks {
		if c.live > 0 {
			chunks = append(chunks, c)
			continue
		}
		if err := f.upstream.Deallocate(c.addr, f.chunkSize, DefaultStream); err != nil && firstErr == nil {
			firstErr = errorf("FixedSizeMemoryResource.Close: returning the chunk at %#x to %s: %w", uintptr(c.addr), resourceName(f.upstream), err)
		}
	}
	f.chunks = chunks
	if n := f.live.len(); n > 0 {
		DebugLogger().Warn("rmm: FixedSizeMemoryResource closed with live allocations; their chunks go back as they are freed", "live_allocations", n, "block_size", f.blockSize)
	} else {
		f.dropHooks()
	}
	return firstErr
}

// deallocateAfterClose frees p, a block that outlived Close (mu held, p in the live table): the
// stream is synchronised, and the block's chunk goes back to the upstream when it was its last
// live block.
func (f *FixedSizeMemoryResource) deallocateAfterClose(p DevicePtr, s StreamView) error {
	if err := f.syncAfterClose(s); err != nil {
		return err
	}
	f.live.delAt(f.live.find(p))
	if f.live.len() == 0 {
		f.dropHooks() // the last block that outlived Close
	}
	i := f.chunkOf(p)
	f.chunks[i].live--
	if f.chunks[i].live > 0 {
		return nil
	}
	c := f.chunks[i]
	f.chunks = append(f.chunks[:i], f.chunks[i+1:]...)
	if err := f.upstream.Deallocate(c.addr, f.chunkSize, DefaultStream); err != nil {
		return errorf("FixedSizeMemoryResource: returning the chunk at %#x to %s: %w", uintptr(c.addr), resourceName(f.upstream), err)
	}
	return nil
}

// FixedSizeStats is a snapshot of a fixed-size resource's state. Sizes are in bytes.
type FixedSizeStats struct {
	BlockSize       int // bytes per block
	PoolSize        int // bytes held from the upstream (chunks × chunk size)
	MaximumSize     int // always 0: the resource grows for as long as its upstream gives chunks
	UpstreamBlocks  int // chunks held
	LiveAllocations int // blocks in use
	LiveBytes       int // LiveAllocations × BlockSize
	FreeBlocks      int
	FreeBytes       int // PoolSize - LiveBytes
	// LargestFreeBlock is the largest request served without growing: BlockSize when a block
	// is free, else 0.
	LargestFreeBlock int
	Streams          int // streams with a free list
	// PerStream is the free blocks of each stream's list, one entry per stream with a list
	// (empty ones included), by ascending [StreamView.ID]: [DefaultStream] first. The entries add up to FreeBlocks; before Close, to FreeBytes too.
	PerStream []StreamFreeStats
}

// Stats returns the resource's figures in O(s log s) for s streams (plus the blocks allocated on
// streams, counted in tables of their own).
func (f *FixedSizeMemoryResource) Stats() FixedSizeStats {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := FixedSizeStats{
		BlockSize:      f.blockSize,
		PoolSize:       len(f.chunks) * f.chunkSize,
		UpstreamBlocks: len(f.chunks),
		Streams:        len(f.lists),
		PerStream:      make([]StreamFreeStats, 0, len(f.lists)),
	}
	live := f.live.len()
	// A list's blocks move between its free list and its table under its lock alone, and
	// between lists only under mu: reading one list after another under mu is a snapshot.
	for _, l := range f.lists {
		l.mu.Lock()
		free := len(l.blocks)
		live += l.issued.len()
		l.mu.Unlock()
		st.FreeBlocks += free
		s := l.stream
		if s.id == 0 {
			s = DefaultStream
		}
		st.PerStream = append(st.PerStream, StreamFreeStats{Stream: s, FreeBlocks: free, FreeBytes: free * f.blockSize})
	}
	slices.SortFunc(st.PerStream, func(x, y StreamFreeStats) int { return cmp.Compare(x.Stream.ID(), y.Stream.ID()) })
	st.LiveAllocations = live
	st.LiveBytes = live * f.blockSize
	st.FreeBytes = st.PoolSize - st.LiveBytes
	if st.FreeBlocks > 0 {
		st.LargestFreeBlock = f.blockSize
	}
	return st
}

// counts returns the free blocks and the live blocks (mu held, no list's lock).
func (f *FixedSizeMemoryResource) counts() (free, live int) {
	live = f.live.len()
	for _, l := range f.lists {
		l.mu.Lock()
		free += len(l.blocks)
		live += l.issued.len()
		l.mu.Unlock()
	}
	return free, live
}

// oomError (f.mu held, no list's lock) returns the error for a request of nbytes that failed:
// the resource's figures (PoolSize: the chunks held; FreeBytes; LargestFreeBlock: BlockSize when
// a block is free; no MaximumSize and no Headroom, since only the upstream bounds the resource),
// the detail and the upstream's error as Cause. Fragmented is set when the free blocks together
// would hold the request (only a request above the block size can fail so).
func (f *FixedSizeMemoryResource) oomError(nbytes int, detail string, cause error) *OutOfMemoryError {
	free, live := f.counts()
	pool := len(f.chunks) * f.chunkSize
	e := OutOfMemoryError{
		Resource:  "FixedSizeMemoryResource",
		Requested: nbytes,
		PoolSize:  pool,
		FreeBytes: pool - live*f.blockSize,
		Detail:    detail,
		Cause:     cause,
	}
	if free > 0 {
		e.LargestFreeBlock = f.blockSize
	}
	n := f.blockSize // a request takes a whole block
	if nbytes > f.blockSize {
		var ok bool
		if n, ok = alignSize(nbytes); !ok {
			n = math.MaxInt
		}
		e.TooLarge = true
	}
	return newOutOfMemory(e, n)
}

// CheckInvariants verifies the resource's state and returns the first violation found: every
// list is indexed by its stream and published for the fast paths (a published list that is not
// indexed was dropped and is empty); every free and every live block starts on a block boundary
// inside a held chunk; no block is free twice, live twice or both free and live; free plus live
// blocks equal the chunks' blocks (before Close), and after Close every live block is in the
// resource's own table. O(n log c); meant for tests.
func (f *FixedSizeMemoryResource) CheckInvariants() (err error) {
	defer func() {
		if err != nil {
			err = errorf("FixedSizeMemoryResource.CheckInvariants: %w", err)
		}
	}()
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, l := range f.lists {
		l.mu.Lock()
		defer l.mu.Unlock()
	}
	for i := 1; i < len(f.chunks); i++ {
		if f.chunks[i-1].addr+DevicePtr(f.chunkSize) > f.chunks[i].addr {
			return errorf("chunks %#x and %#x overlap or are out of order", uintptr(f.chunks[i-1].addr), uintptr(f.chunks[i].addr))
		}
	}
	check := func(p DevicePtr) error {
		i := f.chunkOf(p)
		if i < 0 || p >= f.chunks[i].addr+DevicePtr(f.chunkSize) {
			return errorf("block %#x lies in no chunk", uintptr(p))
		}
		if int(p-f.chunks[i].addr)%f.blockSize != 0 {
			return errorf("block %#x is not on a block boundary of its chunk %#x", uintptr(p), uintptr(f.chunks[i].addr))
		}
		return nil
	}
	seen := map[DevicePtr]bool{}
	live := map[DevicePtr]bool{}
	addLive := func(p DevicePtr, n int) error {
		if err := check(p); err != nil {
			return err
		}
		if seen[p] {
			return errorf("block %#x is both free and live", uintptr(p))
		}
		if live[p] {
			return errorf("block %#x is live twice", uintptr(p))
		}
		live[p] = true
		if n <= 0 || n > f.blockSize {
			return errorf("block %#x was allocated with %s", uintptr(p), bytesText(n))
		}
		return nil
	}
	for _, l := range f.lists {
		if f.byStream[l.stream.id] != l {
			return errorf("list of %v is not indexed by its stream", l.stream)
		}
		if f.fastList(l.stream) != l && !f.closed {
			if len(f.fast.Load().all()) < streamSetMax {
				return errorf("list of %v is not published", l.stream)
			}
		}
		for _, p := range l.blocks {
			if err := check(p); err != nil {
				return err
			}
			if seen[p] {
				return errorf("block %#x is free twice", uintptr(p))
			}
			seen[p] = true
		}
	}
	for _, l := range f.fast.Load().all() {
		if f.byStream[l.stream.id] != l && (!l.dropped || len(l.blocks) > 0 || l.issued.len() > 0) {
			return errorf("list of %v is published, not indexed, and not dropped and empty", l.stream)
		}
	}
	if len(f.byStream) != len(f.lists) {
		return errorf("%d lists, %d indexed", len(f.lists), len(f.byStream))
	}
	for _, l := range f.lists {
		if err := l.issued.check(); err != nil {
			return errorf("blocks allocated on %v: %w", l.stream, err)
		}
		if f.closed && l.issued.len() > 0 {
			return errorf("list of %v has blocks allocated after Close", l.stream)
		}
		var err error
		l.issued.each(func(p DevicePtr, n int) {
			if err == nil {
				err = addLive(p, n)
			}
		})
		if err != nil {
			return err
		}
	}
	if err := f.live.check(); err != nil {
		return err
	}
	f.live.each(func(p DevicePtr, n int) {
		if err == nil {
			err = addLive(p, n)
		}
	})
	if err != nil {
		return err
	}
	if !f.closed && len(seen)+len(live) != len(f.chunks)*f.chunkBlocks {
		return errorf("%d free + %d live blocks != %d chunks × %d blocks", len(seen), len(live), len(f.chunks), f.chunkBlocks)
	}
	return nil
}
