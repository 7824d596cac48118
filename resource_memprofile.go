package rmm

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
)

// DefaultMemoryProfileRate is the sampling rate, in bytes, of a MemoryProfileResourceAdaptor made
// without one: on average one allocation is recorded per 128 MiB allocated, 256 times Go's own
// default (runtime.MemProfileRate, 512 KiB). Device programs allocate far more bytes than Go
// programs do on their heap, and a resource hands out a block of any size for about the same
// cost, while recording a sampled allocation (its call stack) costs about 0.5 µs whatever its
// size. 128 MiB is the smallest power of two at which benchmark W1 over host memory
// (SystemMemoryResource, 130-200 ns a pair below 64 MiB) cost at most 10% more through the
// adaptor at each of W1's sizes, 256 B to 64 MiB; at 64 MiB the pairs of 1 MiB cost 11% more
// (BenchmarkW1Profiled, which gives the figures). Over a sub-allocator (25-40 ns a pair) the
// adaptor costs more: 5-10 ns a pair that is not sampled, and allocations of tens of MiB are
// sampled often (see the type's comment). A profile at this rate holds about 8 samples per GiB
// in use; set MemoryProfileOptions.Rate lower for more detail.
const DefaultMemoryProfileRate = 128 << 20

// MemoryProfileOptions configures a MemoryProfileResourceAdaptor. nil means the defaults.
type MemoryProfileOptions struct {
	// Rate is the sampling rate in bytes, as runtime.MemProfileRate is for Go's heap: an
	// allocation of n bytes is recorded with probability 1-exp(-n/Rate), so that on average one
	// allocation is recorded per Rate bytes allocated and an allocation of many times Rate bytes
	// is always recorded. 1 records every allocation (the profile is then exact). 0 means
	// DefaultMemoryProfileRate; a negative rate is refused with ErrInvalidArgument.
	Rate int
}

// MemoryProfileResourceAdaptor forwards every call to its upstream and records, for a sample of
// the allocations, the Go call stack that made them, so that device memory can be profiled as
// Go's heap is: WriteProfile writes a profile in pprof's format (go tool pprof reads it), with
// the sample types of Go's heap profile (alloc_objects, alloc_space, inuse_objects, inuse_space);
// MemoryProfileHandler serves it over HTTP; TopSites and Report sum it by call site.
//
// What is recorded. Allocations are sampled by size, as Go's heap profiler samples its own: an
// allocation of n bytes is recorded with probability 1-exp(-n/rate) (MemoryProfileOptions.Rate,
// in bytes). As in Go's runtime, a countdown holds the bytes left to the next sample, drawn from
// an exponential distribution of mean rate; an allocation of n bytes takes n off it, and is
// recorded when the countdown is n or less, which draws a new one. Go keeps a countdown per
// processor; this adaptor keeps 32, each allocation using the one its pointer hashes to, so
// goroutines allocating at once seldom share one (the exponential distribution is memoryless, so
// any countdown gives every allocation the same probability). A sampled allocation records its
// call stack (up to 64 frames, starting at the caller of Allocate) and its size; the profile sums
// the samples by stack and size and scales them back to estimates of all allocations exactly as
// Go's heap profile does (each figure multiplied by 1/(1-exp(-size/rate))). A sampled block's free
// is counted when it is freed through the adaptor; the in-use figures are those of blocks
// allocated and not yet freed, now (Go's heap profile reports them as of its last garbage
// collection). Unsampled allocations leave no record: the adaptor keeps no entry per block.
//
// Units: bytes as asked of Allocate (not rounded up to the alignment); counts of allocations.
// Zero-byte allocations are never sampled.
//
// Streams: Allocate and Deallocate are forwarded with the caller's stream; the adaptor orders
// nothing itself and never waits for a stream.
//
// Errors. The upstream's errors are returned unchanged, and a failed allocation records nothing.
// A negative size returns an error wrapping ErrInvalidArgument without calling the upstream. A
// free of a pointer that was not sampled (or that the adaptor never saw, or a double free) is
// passed to the upstream as it is, with its error, if any, returned as it is; when the upstream
// refuses the free of a sampled block, its record is kept. The size given to Deallocate is passed
// on unchanged. Memory freed behind the adaptor's back (through its upstream directly) stays
// counted as in use until its address is allocated and sampled again or freed through the
// adaptor.
//
// Cost. An allocation that is not sampled costs one atomic compare-and-swap on its countdown,
// and its free one atomic load from a table of counters indexed by the pointer's hash, which
// tells pointers that cannot have been sampled from those that may have been (those then look
// their record up under a lock): 5-10 ns a pair in all on one goroutine, against a pool's
// 25-40 ns. A sampled allocation costs the capture of its stack (runtime.Callers, in proportion
// to its depth), a lookup of its stack in a table under a lock, and a map entry until it is
// freed: about 0.5 µs a pair on the benchmark host, so that through a pool allocations as large
// as the rate (mostly sampled) cost several times what they cost without the adaptor. Since at
// most one allocation is sampled per rate bytes on average, sampling costs at most that 0.5 µs
// per rate bytes allocated (4 ns per MiB at the default rate), whatever the sizes.
// Each distinct stack and size that is ever sampled keeps a record (about 100 bytes plus 8 per
// frame) for the life of the adaptor, as Go's heap profiler keeps its own; the adaptor itself
// takes about 24 KiB.
//
// Why an adaptor of its own rather than an option of TrackingResourceAdaptor: the tracking
// adaptor's purpose is an entry for every outstanding allocation (to list leaks exactly), which
// is the cost this one exists to avoid; and this one's figures are estimates, not a list. Stack
// them when both are wanted.
//
// Safe for concurrent use by many goroutines.
type MemoryProfileResourceAdaptor struct {
	upstream MemoryResource
	rate     int

	// testRand, when set (by tests, before any allocation), replaces the per-thread random
	// source so that a test's samples are reproducible. It is not safe for concurrent use.
	testRand *rand.Rand

	// shards hold the countdowns and the sampled blocks not yet freed, by pointer hash.
	shards [1 << memProfShardBits]memProfShard

	// maybe counts, for each slot (the top memProfFilterBits bits of a pointer's hash), the
	// sampled blocks not yet freed whose pointer falls into it: a free whose slot holds 0 was
	// not sampled.
	maybe [1 << memProfFilterBits]atomic.Uint32

	mu      sync.Mutex // guards buckets and all
	buckets map[uint64]*memProfBucket
	all     []*memProfBucket // in the order they were made
}

const (
	memProfShardBits  = 5  // 32 shards of 128 bytes
	memProfFilterBits = 12 // 4096 counters of 4 bytes
)

// memProfShard is one shard of the sampling state, on a cache line pair of its own, so that
// goroutines allocating pointers of different shards do not share a line.
type memProfShard struct {
	left atomic.Int64 // bytes left to the next sample
	mu   sync.Mutex   // guards live
	live map[DevicePtr]*memProfBucket
	_    [128 - 24]byte
}

// memProfBucket sums the samples of one call stack and size.
type memProfBucket struct {
	stack  []uintptr // return PCs, innermost first, as runtime.Callers gives them
	size   int64
	next   *memProfBucket // the next bucket with the same hash
	allocs atomic.Int64   // sampled allocations
	frees  atomic.Int64   // of which freed
}

// NewMemoryProfileResourceAdaptor returns an adaptor that samples the allocations made through it
// from upstream (nil: the current device resource) at opts.Rate (nil: DefaultMemoryProfileRate).
// A negative rate returns an error wrapping ErrInvalidArgument.
func NewMemoryProfileResourceAdaptor(upstream MemoryResource, opts *MemoryProfileOptions) (*MemoryProfileResourceAdaptor, error) {
	rate := DefaultMemoryProfileRate
	if opts != nil {
		switch {
		case opts.Rate < 0:
			return nil, fmt.Errorf("%w: NewMemoryProfileResourceAdaptor: negative sampling rate %d (bytes per sample; 1 records every allocation, 0 means the default %d)", ErrInvalidArgument, opts.Rate, DefaultMemoryProfileRate)
		case opts.Rate > 0:
			rate = opts.Rate
		}
	}
	r := &MemoryProfileResourceAdaptor{
		upstream: resourceOrCurrent(upstream),
		rate:     rate,
		buckets:  map[uint64]*memProfBucket{},
	}
	for i := range r.shards {
		r.shards[i].left.Store(r.draw())
		r.shards[i].live = map[DevicePtr]*memProfBucket{}
	}
	return r, nil
}

// Rate returns the sampling rate in bytes (1: every allocation is recorded).
func (r *MemoryProfileResourceAdaptor) Rate() int { return r.rate }

// memProfHash mixes a pointer's bits (they are multiples of 256) into the top bits.
func memProfHash(p DevicePtr) uint64 { return uint64(p) * 0x9e3779b97f4a7c15 }

// Allocate allocates nbytes from the upstream on stream s and, when the allocation is sampled,
// records its call stack (see the type's comment). A negative size returns an error wrapping
// ErrInvalidArgument without calling the upstream; the upstream's errors are returned unchanged
// and nothing is recorded then.
func (r *MemoryProfileResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("MemoryProfileResourceAdaptor", "Allocate", nbytes)
	}
	p, err := r.upstream.Allocate(nbytes, s)
	if err != nil || nbytes == 0 {
		return p, err
	}
	h := memProfHash(p)
	sh := &r.shards[h>>(64-memProfShardBits)]
	n := int64(nbytes)
	if left := sh.left.Load(); n < left && sh.left.CompareAndSwap(left, left-n) {
		return p, nil // not sampled: the common case, countDown's first attempt
	}
	if r.countDown(sh, n) {
		r.record(p, nbytes, h)
	}
	return p, nil
}

// countDown takes an allocation of n > 0 bytes off shard sh's countdown and reports whether it is
// sampled: when the countdown is n or less, which then starts again from a new draw. At rate 1
// every allocation is. (Allocate makes the first attempt of the common case itself.)
func (r *MemoryProfileResourceAdaptor) countDown(sh *memProfShard, n int64) bool {
	if r.rate == 1 {
		return true
	}
	for {
		left := sh.left.Load()
		if n < left {
			if sh.left.CompareAndSwap(left, left-n) {
				return false
			}
			continue
		}
		if sh.left.CompareAndSwap(left, r.draw()) {
			return true
		}
	}
}

// draw returns a distance in bytes to the next sample: an exponential variate of mean rate (by
// inversion of a uniform variate of 53 bits), rounded up, so that it is at most n, a whole number
// of bytes, with probability 1-exp(-n/rate); at most 2^62. At rate 1 it is 0.
func (r *MemoryProfileResourceAdaptor) draw() int64 {
	if r.rate == 1 {
		return 0
	}
	var u uint64
	if r.testRand == nil {
		u = rand.Uint64() // the calling thread's source
	} else {
		u = r.testRand.Uint64()
	}
	v := float64(u>>11+1) * 0x1p-53 // uniform in (0, 1]
	return int64(min(math.Ceil(-math.Log(v)*float64(r.rate)), 1<<62))
}

// record records the sampled allocation p of nbytes with the stack of Allocate's caller.
//
//go:noinline
func (r *MemoryProfileResourceAdaptor) record(p DevicePtr, nbytes int, h uint64) {
	var pcs [maxTrackedFrames]uintptr
	n := runtime.Callers(3, pcs[:]) // runtime.Callers, record, Allocate
	b := r.bucket(pcs[:n], int64(nbytes))
	b.allocs.Add(1)
	sh := &r.shards[h>>(64-memProfShardBits)]
	sh.mu.Lock()
	old, dup := sh.live[p]
	sh.live[p] = b
	sh.mu.Unlock()
	if dup {
		// The upstream handed out a sampled block that was never freed through the adaptor: it
		// was freed behind its back. Count it freed now.
		old.frees.Add(1)
		return
	}
	r.maybe[h>>(64-memProfFilterBits)].Add(1)
}

// bucket returns the bucket of stack stk and size, making it the first time.
func (r *MemoryProfileResourceAdaptor) bucket(stk []uintptr, size int64) *memProfBucket {
	h := uint64(size) * 0x100000001b3
	for _, pc := range stk {
		h = (h ^ uint64(pc)) * 0x100000001b3
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for b := r.buckets[h]; b != nil; b = b.next {
		if b.size == size && slices.Equal(b.stack, stk) {
			return b
		}
	}
	b := &memProfBucket{stack: slices.Clone(stk), size: size, next: r.buckets[h]}
	r.buckets[h] = b
	r.all = append(r.all, b)
	return b
}

// Deallocate returns p to the upstream on stream s; when p was sampled, its record is dropped
// first (and put back when the upstream returns an error). A negative size returns an error
// wrapping ErrInvalidArgument without calling the upstream; the upstream's errors are returned
// unchanged.
func (r *MemoryProfileResourceAdaptor) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if nbytes < 0 {
		return invalidSize("MemoryProfileResourceAdaptor", "Deallocate", nbytes)
	}
	h := memProfHash(p)
	if r.maybe[h>>(64-memProfFilterBits)].Load() == 0 {
		return r.upstream.Deallocate(p, nbytes, s)
	}
	return r.deallocateSampled(p, nbytes, s, h)
}

// deallocateSampled is Deallocate of a pointer that may have been sampled.
func (r *MemoryProfileResourceAdaptor) deallocateSampled(p DevicePtr, nbytes int, s StreamView, h uint64) error {
	sh := &r.shards[h>>(64-memProfShardBits)]
	sh.mu.Lock()
	b, found := sh.live[p]
	if found {
		delete(sh.live, p)
	}
	sh.mu.Unlock()
	if !found {
		return r.upstream.Deallocate(p, nbytes, s)
	}
	// Dropped before the upstream's free, so that an address it hands out again at once is
	// never recorded twice.
	slot := &r.maybe[h>>(64-memProfFilterBits)]
	slot.Add(^uint32(0))
	b.frees.Add(1)
	err := r.upstream.Deallocate(p, nbytes, s)
	if err != nil {
		sh.mu.Lock()
		if _, dup := sh.live[p]; !dup { // a broken upstream may have handed p out again
			sh.live[p] = b
			slot.Add(1)
			b.frees.Add(-1)
		}
		sh.mu.Unlock()
	}
	return err
}

// Upstream returns the resource the adaptor forwards to.
func (r *MemoryProfileResourceAdaptor) Upstream() MemoryResource { return r.upstream }

// Access reports the upstream's accessibility (AccessOf(Upstream())).
func (r *MemoryProfileResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the upstream's device (DeviceOf(Upstream())).
func (r *MemoryProfileResourceAdaptor) Device() Device { return DeviceOf(r.upstream) }

// snapshot returns the buckets made so far, in the order they were made.
func (r *MemoryProfileResourceAdaptor) snapshot() []*memProfBucket {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clip(r.all)
}
