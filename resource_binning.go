package rmm

import (
	"cmp"
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
)

// BinningOptions configures [NewBinningMemoryResource]. nil means no bins.
type BinningOptions struct {
	// MinSizeExponent and MaxSizeExponent make one [FixedSizeMemoryResource] bin of 2^i bytes
	// (rounded up to 256) over the upstream for every i in [MinSizeExponent, MaxSizeExponent],
	// each with the default 128 blocks taken from the upstream at construction (18..22 gives bins
	// of 256 KiB to 4 MiB and takes 992 MiB). Both 0 (unset) or both -1: no bins. Otherwise both
	// must be in 0..62 with MinSizeExponent ≤ MaxSizeExponent.
	MinSizeExponent int
	MaxSizeExponent int
	// BlocksToPreallocate is the number of blocks each bin the resource makes (here and in
	// AddBin without a resource) takes from the upstream at a time
	// ([FixedSizeOptions.BlocksToPreallocate]). Default 0 means 128, librmm's.
	BlocksToPreallocate int
}

// BinningMemoryResource sends each request to a bin by size, as librmm's
// binning_memory_resource: the bin of the smallest size at least the requested (unrounded) byte
// count, or the upstream when the request is larger than every bin. Deallocate chooses by the
// same rule, so the size given to it must be the one given to Allocate. Zero-byte calls go to
// the smallest bin (to the upstream when there are no bins), so that adaptors inside the bins
// see them.
//
// Bins are FixedSizeMemoryResources made by the resource (from the options or AddBin without a
// resource) or any [MemoryResource] given to AddBin. AddBin may be called at any time, concurrently
// with allocations: the bin table is replaced as a whole (copy on write) and read atomically.
// Invalid frees are detected by the bins (and by the upstream for large sizes) and returned as
// they report them.
type BinningMemoryResource struct {
	upstream MemoryResource
	bins     atomic.Pointer[binTable]

	mu       sync.Mutex // AddBin, Close
	owned    []*FixedSizeMemoryResource
	prealloc int // blocks per bin made here; 0 = the fixed-size default
	closed   atomic.Bool
}

type binningBin struct {
	size int
	mr   MemoryResource
	// fixed is mr when it is a FixedSizeMemoryResource, called directly: a static call instead
	// of an interface's, on the path of every allocation and free.
	fixed *FixedSizeMemoryResource
}

// binTable is the bins, replaced as a whole when a bin is added, and an index that finds a
// request's bin in O(1) for bins of distinct powers of two (the bins the options make): a
// bisection's branches, which a predictor cannot learn when sizes vary, cost a noticeable part of
// a pair.
type binTable struct {
	bins []binningBin // sorted by size
	// first[k] is the index of the first bin larger than 2^(k-1) bytes (of at least 0 bytes for
	// k = 0), len(bins) when none: a request of n bytes, 2^(k-1) < n ≤ 2^k, goes to the first bin
	// from there of at least n bytes.
	first [64]int32
}

// newBinTable returns the table of bins, which are sorted by size.
func newBinTable(bins []binningBin) *binTable {
	t := &binTable{bins: bins}
	for k := range t.first {
		lo := 0
		if k > 0 {
			lo = 1 << (k - 1)
		}
		t.first[k] = int32(sort.Search(len(bins), func(i int) bool { return bins[i].size > lo }))
	}
	return t
}

// find returns the bin for a request of nbytes ≥ 0 bytes, nil when it is larger than every bin.
func (t *binTable) find(nbytes int) *binningBin {
	k := 0
	if nbytes > 1 {
		k = bits.Len(uint(nbytes - 1)) // nbytes ≤ 2^k
	}
	for i := int(t.first[k]); i < len(t.bins); i++ {
		if b := &t.bins[i]; b.size >= nbytes {
			return b
		}
	}
	return nil
}

// NewBinningMemoryResource returns a binning resource over upstream with the bins the options ask
// for (nil: no bins). Exponents out of range are [ErrInvalidArgument]; a bin whose first chunk the
// upstream refuses fails the construction (the bins made so far are closed). A nil upstream means
// the current device resource ([CurrentDeviceResource], read once, here); a nil pointer as
// upstream returns an error wrapping [ErrInvalidArgument].
func NewBinningMemoryResource(upstream MemoryResource, opts *BinningOptions) (*BinningMemoryResource, error) {
	upstream, err := upstreamOf("NewBinningMemoryResource", upstream)
	if err != nil {
		return nil, err
	}
	r := &BinningMemoryResource{upstream: upstream}
	r.bins.Store(newBinTable(nil))
	if opts == nil {
		return r, nil
	}
	if opts.BlocksToPreallocate < 0 {
		return nil, errorf("NewBinningMemoryResource: negative BlocksToPreallocate %d: %w", opts.BlocksToPreallocate, ErrInvalidArgument)
	}
	r.prealloc = opts.BlocksToPreallocate
	lo, hi := opts.MinSizeExponent, opts.MaxSizeExponent
	if (lo == 0 && hi == 0) || (lo == -1 && hi == -1) {
		return r, nil
	}
	if lo < 0 || hi < 0 || lo > hi || hi > 62 {
		return nil, errorf("NewBinningMemoryResource: size exponents %d..%d (want 0 ≤ min ≤ max ≤ 62, or both -1): %w", lo, hi, ErrInvalidArgument)
	}
	for i := lo; i <= hi; i++ {
		if err := r.AddBin(1<<i, nil); err != nil {
			r.Close()
			return nil, errorf("NewBinningMemoryResource: %w", err)
		}
	}
	return r, nil
}

// Upstream returns the resource that serves requests larger than every bin.
func (r *BinningMemoryResource) Upstream() MemoryResource { return r.upstream }

// Device returns the upstream's device.
func (r *BinningMemoryResource) Device() Device { return DeviceOf(r.upstream) }

// Access reports the upstream's access.
func (r *BinningMemoryResource) Access() Access { return AccessOf(r.upstream) }

// AddBin adds a bin of size bytes (rounded up to 256). With a resource, it serves the requests
// of that bin, replacing any bin of the same size (allocations from a replaced bin must not be
// freed afterwards: their frees would go to the new bin). Without one (nil), a
// [FixedSizeMemoryResource] of that block size over the upstream is made, only if there is no bin
// of that size yet; its first chunk's failure is returned. A size that is not positive is
// [ErrInvalidArgument]; after Close, [ErrClosed]. Safe for concurrent use with every other method.
//
// A new bin takes over the sizes between the next smaller bin and its own size from the resource
// that served them (a larger bin, or the upstream); the binning resource does not remember which
// resource served each allocation, so an allocation made before in that range would be freed to
// the new bin and refused with [ErrInvalidFree]. Add bins before allocating the sizes they cover.
func (r *BinningMemoryResource) AddBin(size int, mr MemoryResource) error {
	if r.closed.Load() {
		return errorf("BinningMemoryResource.AddBin: called after Close: %w", ErrClosed)
	}
	if size <= 0 {
		return errorf("BinningMemoryResource.AddBin: size %d must be positive: %w", size, ErrInvalidArgument)
	}
	n, ok := alignSize(size)
	if !ok {
		return errorf("BinningMemoryResource.AddBin: size %d overflows when rounded to 256: %w", size, ErrInvalidArgument)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	old := r.bins.Load().bins
	i := sort.Search(len(old), func(i int) bool { return old[i].size >= n })
	exists := i < len(old) && old[i].size == n
	if mr == nil {
		if exists {
			return nil
		}
		f, err := NewFixedSizeMemoryResource(r.upstream, &FixedSizeOptions{BlockSize: n, BlocksToPreallocate: r.prealloc})
		if err != nil {
			return errorf("BinningMemoryResource.AddBin(%d): %w", size, err)
		}
		r.owned = append(r.owned, f)
		mr = f
	}
	bins := make([]binningBin, 0, len(old)+1)
	bins = append(bins, old[:i]...)
	fixed, _ := mr.(*FixedSizeMemoryResource)
	bins = append(bins, binningBin{size: n, mr: mr, fixed: fixed})
	if exists {
		i++
	}
	bins = append(bins, old[i:]...)
	r.bins.Store(newBinTable(bins))
	return nil
}

// Bin is one bin of a [BinningMemoryResource]: the requests of more than the next smaller bin's
// size and at most Size bytes go to Resource.
type Bin struct {
	Size     int // bytes, a multiple of 256
	Resource MemoryResource
}

// Bins returns the bins, smallest first, with the resource serving each (RMM's bin_mrs; a bin
// AddBin made itself is a [*FixedSizeMemoryResource], owned and closed by r). Larger requests go to
// Upstream.
func (r *BinningMemoryResource) Bins() []Bin {
	bins := r.bins.Load().bins
	out := make([]Bin, len(bins))
	for i, b := range bins {
		out[i] = Bin{Size: b.size, Resource: b.mr}
	}
	return out
}

// binFor returns the bin nbytes goes to: its resource (called directly when it is a
// FixedSizeMemoryResource) and its size; the upstream and 0 when nbytes is larger than every bin.
func (r *BinningMemoryResource) binFor(nbytes int) (MemoryResource, *FixedSizeMemoryResource, int) {
	if b := r.bins.Load().find(nbytes); b != nil {
		return b.mr, b.fixed, b.size
	}
	return r.upstream, nil, 0
}

// binError says which bin an error came from: a free with the wrong size goes to another bin than
// its allocation, and the bin's own message cannot tell.
func binError(op string, nbytes, bin int, err error) error {
	if bin == 0 {
		return errorf("BinningMemoryResource.%s(%d bytes, larger than every bin, to the upstream): %w", op, nbytes, err)
	}
	return errorf("BinningMemoryResource.%s(%d bytes, in the bin of %d bytes): %w", op, nbytes, bin, err)
}

// Allocate passes the request to the smallest bin of at least nbytes bytes, or to the upstream
// when it is larger than every bin, and returns that resource's answer (its memory is ordered on
// s as that resource orders it). A negative size is [ErrInvalidArgument].
//
// Out of memory is an [*OutOfMemoryError] (errors.Is(err, [ErrOutOfMemory])): the one the bin's
// resource (or the upstream) returned, as it is, when it returned one (the bins the resource
// makes do: [FixedSizeMemoryResource] names its block size); else one for the binning resource
// whose Detail names the bin and whose Cause is that resource's error, with no figures (PoolSize,
// FreeBytes and LargestFreeBlock 0: the binning resource holds no memory of its own). Other
// errors are wrapped with the bin they came from.
func (r *BinningMemoryResource) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("BinningMemoryResource", "Allocate", nbytes)
	}
	if r.closed.Load() {
		return 0, errorf("BinningMemoryResource.Allocate: called after Close: %w", ErrClosed)
	}
	mr, fixed, bin := r.binFor(nbytes)
	var p DevicePtr
	var err error
	if fixed != nil {
		p, err = fixed.Allocate(nbytes, s)
	} else {
		p, err = mr.Allocate(nbytes, s)
	}
	if err != nil {
		var oom *OutOfMemoryError
		switch {
		case errors.As(err, &oom):
			return 0, err
		case errors.Is(err, ErrOutOfMemory):
			return 0, binOutOfMemory(nbytes, bin, mr, err)
		}
		return 0, binError("Allocate", nbytes, bin, err)
	}
	return p, nil
}

// binOutOfMemory is the *OutOfMemoryError for a bin's resource (the upstream when bin is 0),
// mr, that refused nbytes with an error of its own kind, err.
func binOutOfMemory(nbytes, bin int, mr MemoryResource, err error) *OutOfMemoryError {
	where := fmt.Sprintf("in the bin of %d bytes, served by %s", bin, resourceName(mr))
	if bin == 0 {
		where = fmt.Sprintf("larger than every bin, to the upstream %s", resourceName(mr))
	}
	return &OutOfMemoryError{
		Resource:  "BinningMemoryResource",
		Requested: nbytes,
		Detail:    where,
		Cause:     err,
	}
}

// Deallocate passes p to the resource that nbytes selects (the same rule as Allocate) and
// returns its answer, an error wrapped with the bin it came from.
func (r *BinningMemoryResource) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	mr, fixed, bin := r.binFor(nbytes)
	var err error
	if fixed != nil {
		err = fixed.Deallocate(p, nbytes, s)
	} else {
		err = mr.Deallocate(p, nbytes, s)
	}
	if err != nil {
		return binError("Deallocate", nbytes, bin, err)
	}
	return nil
}

// Release releases the bins the resource made ([FixedSizeMemoryResource.Release]) and returns the
// first error.
func (r *BinningMemoryResource) Release() error {
	r.mu.Lock()
	owned := append([]*FixedSizeMemoryResource(nil), r.owned...)
	r.mu.Unlock()
	var errs []error
	for _, f := range owned {
		errs = append(errs, f.Release())
	}
	return errors.Join(errs...)
}

// Close closes the bins the resource made (bins given to AddBin belong to the caller), and
// returns their errors joined. Allocations from those bins that are still live stay valid and
// can be freed through the binning resource. Closing twice returns nil.
func (r *BinningMemoryResource) Close() error {
	if r.closed.Swap(true) {
		return nil
	}
	r.mu.Lock()
	owned := append([]*FixedSizeMemoryResource(nil), r.owned...)
	r.mu.Unlock()
	var errs []error
	for _, f := range owned {
		errs = append(errs, f.Close())
	}
	return errors.Join(errs...)
}

// BinningStats is a snapshot of a binning resource's state. Sizes are in bytes. The totals are
// over the bins that are FixedSizeMemoryResources (made by the resource or given to AddBin);
// other bins' resources and the upstream are only named.
type BinningStats struct {
	Bins []BinStats // smallest first
	// Upstream names the resource that serves the requests larger than every bin; its figures
	// are not included.
	Upstream string
	// Totals over the fixed-size bins.
	PoolSize        int // bytes held from the upstream
	MaximumSize     int // always 0: fixed-size bins grow as long as the upstream gives
	LiveAllocations int
	LiveBytes       int
	FreeBlocks      int
	FreeBytes       int
	// LargestFreeBlock is the largest request the bins serve without growing: the size of the
	// largest fixed-size bin with a free block (a request of that size goes to that bin), else 0.
	LargestFreeBlock int
	// PerStream sums the bins' per-stream free blocks and bytes, by ascending [StreamView.ID]
	// ([DefaultStream] first), one entry per stream that has a free list in some bin.
	PerStream []StreamFreeStats
}

// BinStats is one bin of a [BinningStats].
type BinStats struct {
	Size     int    // the bin's size: it serves requests above the next smaller bin's size, up to Size
	Resource string // the type of the resource serving the bin, e.g. "FixedSizeMemoryResource"
	Owned    bool   // made by the binning resource (from its options or AddBin without a resource)
	// FixedSize is the bin resource's Stats when it is a [FixedSizeMemoryResource], else nil.
	FixedSize *FixedSizeStats
}

// Stats returns the bins' figures and their totals. It calls Stats on every fixed-size bin and
// costs O(bins × streams × log streams). It may run concurrently with every other method; each
// bin's figures are a snapshot of that bin, taken one bin after another.
func (r *BinningMemoryResource) Stats() BinningStats {
	r.mu.Lock()
	owned := make(map[*FixedSizeMemoryResource]bool, len(r.owned))
	for _, f := range r.owned {
		owned[f] = true
	}
	r.mu.Unlock()
	bins := r.bins.Load().bins
	st := BinningStats{Bins: make([]BinStats, len(bins)), Upstream: resourceName(r.upstream)}
	perStream := map[uint64]int{} // stream id -> index in st.PerStream
	for i, b := range bins {
		bs := BinStats{Size: b.size, Resource: resourceName(b.mr)}
		if f, ok := b.mr.(*FixedSizeMemoryResource); ok {
			bs.Owned = owned[f]
			fs := f.Stats()
			bs.FixedSize = &fs
			st.PoolSize += fs.PoolSize
			st.LiveAllocations += fs.LiveAllocations
			st.LiveBytes += fs.LiveBytes
			st.FreeBlocks += fs.FreeBlocks
			st.FreeBytes += fs.FreeBytes
			if fs.FreeBlocks > 0 {
				st.LargestFreeBlock = max(st.LargestFreeBlock, b.size)
			}
			for _, ps := range fs.PerStream {
				k, ok := perStream[ps.Stream.ID()]
				if !ok {
					k = len(st.PerStream)
					perStream[ps.Stream.ID()] = k
					st.PerStream = append(st.PerStream, StreamFreeStats{Stream: ps.Stream})
				}
				st.PerStream[k].FreeBlocks += ps.FreeBlocks
				st.PerStream[k].FreeBytes += ps.FreeBytes
			}
		}
		st.Bins[i] = bs
	}
	slices.SortFunc(st.PerStream, func(x, y StreamFreeStats) int { return cmp.Compare(x.Stream.ID(), y.Stream.ID()) })
	return st
}

// CheckInvariants checks that the bins are ordered by size without duplicates, and the
// invariants of every bin that has a CheckInvariants method. Meant for tests.
func (r *BinningMemoryResource) CheckInvariants() (err error) {
	defer func() {
		if err != nil {
			err = errorf("BinningMemoryResource.CheckInvariants: %w", err)
		}
	}()
	bins := r.bins.Load().bins
	for i, b := range bins {
		if b.size <= 0 || b.size%Alignment != 0 {
			return errorf("bin %d has size %d", i, b.size)
		}
		if i > 0 && bins[i-1].size >= b.size {
			return errorf("bins %d and %d out of order: %d, %d", i-1, i, bins[i-1].size, b.size)
		}
		if c, ok := b.mr.(interface{ CheckInvariants() error }); ok {
			if err := c.CheckInvariants(); err != nil {
				return errorf("bin of %s: %w", bytesText(b.size), err)
			}
		}
	}
	return nil
}
