package rmm

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"
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
// made from foreign handles. Allocate and Deallocate are O(1) (plus a scan of the streams when
// the allocating stream has no free block).
//
// Deallocate detects a pointer the resource never handed out, a double free and a size other
// than the one allocated, and returns [ErrInvalidFree] without changing anything. Safe for
// concurrent use (one mutex).
type FixedSizeMemoryResource struct {
	upstream    MemoryResource
	blockSize   int
	chunkBlocks int
	chunkSize   int

	mu sync.Mutex
	// The per-stream lists, with the device, its context and the driver (stream_order.go).
	fixedStreams
	chunks []fixedChunk      // sorted by address
	live   map[DevicePtr]int // allocated block -> size asked
	closed bool
}

type fixedChunk struct {
	addr DevicePtr
	live int // live blocks; kept only after Close
}

// fixedList is the free blocks ordered on one stream.
type fixedList struct {
	streamOrder
	blocks []DevicePtr
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
		live:        map[DevicePtr]int{},
	}
	if err := f.initStreams("FixedSizeMemoryResource", DeviceOf(upstream), f, func(int) *fixedList { return new(fixedList) }); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	l, err := f.listFor(DefaultStream)
	if err != nil {
		return nil, err
	}
	if err := f.grow(l, DefaultStream, f.chunkSize); err != nil {
		f.destroyEvents()
		return nil, errorf("NewFixedSizeMemoryResource: taking the first chunk: %w", err)
	}
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
	if nbytes > f.blockSize {
		f.mu.Lock()
		defer f.mu.Unlock()
		return 0, f.oomError(nbytes, fmt.Sprintf("maximum allocation size exceeded: every block is %d bytes, and larger requests always fail", f.blockSize), nil)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return 0, errorf("FixedSizeMemoryResource.Allocate: called after Close: %w", ErrClosed)
	}
	l, err := f.listFor(s)
	if err != nil {
		return 0, err
	}
	if len(l.blocks) == 0 {
		if err := f.refill(l, s, nbytes); err != nil {
			return 0, err
		}
	}
	k := len(l.blocks) - 1
	p := l.blocks[k]
	l.blocks = l.blocks[:k]
	f.live[p] = nbytes
	return p, nil
}

// refill puts at least one free block into s's empty list l: one taken from another stream's
// list after s waits for that stream, else a new chunk (for a request of nbytes).
func (f *FixedSizeMemoryResource) refill(l *fixedList, s StreamView, nbytes int) error {
	for _, o := range f.lists {
		if o == l || len(o.blocks) == 0 {
			continue
		}
		if err := f.orderAfter(o, s); err != nil {
			return errorf("FixedSizeMemoryResource.Allocate: ordering %v after %v: %w", s, o.stream, err)
		}
		k := len(o.blocks) - 1
		l.blocks = append(l.blocks, o.blocks[k])
		o.blocks = o.blocks[:k]
		return nil
	}
	return f.grow(l, s, nbytes)
}

// grow takes a new chunk from the upstream on s and puts its blocks in l, lowest address on top.
// The upstream's refusal becomes an *OutOfMemoryError for a request of nbytes.
func (f *FixedSizeMemoryResource) grow(l *fixedList, s StreamView, nbytes int) error {
	p, err := f.upstream.Allocate(f.chunkSize, s)
	if err != nil {
		DebugLogger().Debug("rmm: FixedSizeMemoryResource failed to grow", "chunk", f.chunkSize, "pool_size", len(f.chunks)*f.chunkSize, "err", err)
		return f.oomError(nbytes, fmt.Sprintf("growing by a chunk of %d blocks of %d bytes (%d bytes): %s refused it", f.chunkBlocks, f.blockSize, f.chunkSize, resourceName(f.upstream)), err)
	}
	i := sort.Search(len(f.chunks), func(i int) bool { return f.chunks[i].addr > p })
	f.chunks = append(f.chunks, fixedChunk{})
	copy(f.chunks[i+1:], f.chunks[i:])
	f.chunks[i] = fixedChunk{addr: p}
	for k := f.chunkBlocks - 1; k >= 0; k-- {
		l.blocks = append(l.blocks, p+DevicePtr(k*f.blockSize))
	}
	return nil
}

// Deallocate returns p's block to the free list of stream s, for reuse at once by work ordered
// on s. nbytes must be the size given to Allocate. A pointer the resource did not hand out, a
// double free or another size returns [ErrInvalidFree] and changes nothing. A free on a [Stream]
// that was closed is ordered by a device synchronisation and goes to the default stream's list.
func (f *FixedSizeMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if p == 0 {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	size, ok := f.live[p]
	if !ok {
		return errorf("FixedSizeMemoryResource.Deallocate(%#x, %d): the pointer was not allocated by this resource or was already freed: %w", uintptr(p), nbytes, ErrInvalidFree)
	}
	if size != nbytes {
		return errorf("FixedSizeMemoryResource.Deallocate(%#x, %d): the block was allocated with %s: %w", uintptr(p), nbytes, bytesText(size), ErrInvalidFree)
	}
	if f.closed {
		return f.deallocateAfterClose(p, s)
	}
	l, _, err := f.freeTo(s, nil)
	if err != nil {
		return err
	}
	delete(f.live, p)
	l.blocks = append(l.blocks, p)
	return nil
}

// streamClosing is called by Stream.Close before the stream is destroyed: the stream's free
// blocks move to the default stream's list, after the default stream waits (on the device) for
// the closing stream's work; its list and event are dropped (closeStream).
func (f *FixedSizeMemoryResource) streamClosing(s StreamView) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if def, l, move := f.closeStream(s, f.closed); move {
		def.blocks = append(def.blocks, l.blocks...)
		f.dropList(l)
	}
}

// syncAll waits (on the host) for the work behind every list's frees.
func (f *FixedSizeMemoryResource) syncAll() error {
	for _, l := range f.lists {
		if !f.ordered(l) {
			continue
		}
		record := l.claimRecord(false)
		if err := f.hostWait(l, record); err != nil {
			if record {
				l.unclaim()
			}
			return err
		}
	}
	return nil
}

// chunkOf returns the index of the chunk holding p.
func (f *FixedSizeMemoryResource) chunkOf(p DevicePtr) int {
	return sort.Search(len(f.chunks), func(i int) bool { return f.chunks[i].addr > p }) - 1
}

// releaseWhole waits for every stream's frees, gathers every free block in the default stream's
// list and returns the chunks whose blocks are all free to the upstream.
func (f *FixedSizeMemoryResource) releaseWhole() error {
	if err := f.syncAll(); err != nil {
		return errorf("FixedSizeMemoryResource: waiting for the streams: %w", err)
	}
	def, err := f.listFor(DefaultStream)
	if err != nil {
		return err
	}
	for _, o := range append([]*fixedList(nil), f.lists...) {
		if o != def && !o.closed {
			def.blocks = append(def.blocks, o.blocks...)
			o.blocks = nil
			f.dropList(o)
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
	if err := f.syncAll(); err != nil {
		return errorf("FixedSizeMemoryResource.Close: waiting for the streams: %w", err)
	}
	f.destroyEvents()
	f.closed = true
	for _, l := range f.lists {
		l.blocks = nil
	}
	for p := range f.live {
		f.chunks[f.chunkOf(p)].live++
	}
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
	if n := len(f.live); n > 0 {
		DebugLogger().Warn("rmm: FixedSizeMemoryResource closed with live allocations; their chunks go back as they are freed", "live_allocations", n, "block_size", f.blockSize)
	}
	return firstErr
}

// deallocateAfterClose frees a block that outlived Close: the stream is synchronised, and the
// block's chunk goes back to the upstream when it was its last live block.
func (f *FixedSizeMemoryResource) deallocateAfterClose(p DevicePtr, s StreamView) error {
	if err := f.syncAfterClose(s); err != nil {
		return err
	}
	delete(f.live, p)
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

// Stats returns the resource's figures in O(s log s) for s streams.
func (f *FixedSizeMemoryResource) Stats() FixedSizeStats {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := FixedSizeStats{
		BlockSize:       f.blockSize,
		PoolSize:        len(f.chunks) * f.chunkSize,
		UpstreamBlocks:  len(f.chunks),
		LiveAllocations: len(f.live),
		LiveBytes:       len(f.live) * f.blockSize,
		Streams:         len(f.lists),
		PerStream:       make([]StreamFreeStats, 0, len(f.lists)),
	}
	for _, l := range f.lists {
		st.FreeBlocks += len(l.blocks)
		s := l.stream
		if s.id == 0 {
			s = DefaultStream
		}
		st.PerStream = append(st.PerStream, StreamFreeStats{Stream: s, FreeBlocks: len(l.blocks), FreeBytes: len(l.blocks) * f.blockSize})
	}
	slices.SortFunc(st.PerStream, func(x, y StreamFreeStats) int { return cmp.Compare(x.Stream.ID(), y.Stream.ID()) })
	st.FreeBytes = st.PoolSize - st.LiveBytes
	if st.FreeBlocks > 0 {
		st.LargestFreeBlock = f.blockSize
	}
	return st
}

// oomError (f.mu held) returns the error for a request of nbytes that failed: the resource's
// figures (PoolSize: the chunks held; FreeBytes; LargestFreeBlock: BlockSize when a block is
// free; no MaximumSize and no Headroom, since only the upstream bounds the resource), the detail
// and the upstream's error as Cause. Fragmented is set when the free blocks together would hold
// the request (only a request above the block size can fail so).
func (f *FixedSizeMemoryResource) oomError(nbytes int, detail string, cause error) *OutOfMemoryError {
	free := 0
	for _, l := range f.lists {
		free += len(l.blocks)
	}
	pool := len(f.chunks) * f.chunkSize
	e := OutOfMemoryError{
		Resource:  "FixedSizeMemoryResource",
		Requested: nbytes,
		PoolSize:  pool,
		FreeBytes: pool - len(f.live)*f.blockSize,
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
// list is indexed by its stream; every free and every live block starts on a block boundary
// inside a held chunk; no block is free twice or both free and live; free plus live blocks equal
// the chunks' blocks (before Close). O(n log c); meant for tests.
func (f *FixedSizeMemoryResource) CheckInvariants() (err error) {
	defer func() {
		if err != nil {
			err = errorf("FixedSizeMemoryResource.CheckInvariants: %w", err)
		}
	}()
	f.mu.Lock()
	defer f.mu.Unlock()
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
	for _, l := range f.lists {
		if f.byStream[l.stream.id] != l {
			return errorf("list of %v is not indexed by its stream", l.stream)
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
	if len(f.byStream) != len(f.lists) {
		return errorf("%d lists, %d indexed", len(f.lists), len(f.byStream))
	}
	for p, n := range f.live {
		if err := check(p); err != nil {
			return err
		}
		if seen[p] {
			return errorf("block %#x is both free and live", uintptr(p))
		}
		if n <= 0 || n > f.blockSize {
			return errorf("block %#x was allocated with %s", uintptr(p), bytesText(n))
		}
	}
	if !f.closed && len(seen)+len(f.live) != len(f.chunks)*f.chunkBlocks {
		return errorf("%d free + %d live blocks != %d chunks × %d blocks", len(seen), len(f.live), len(f.chunks), f.chunkBlocks)
	}
	return nil
}
