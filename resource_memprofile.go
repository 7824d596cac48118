package rmm

import (
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"
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
// allocation of n bytes is recorded with probability p = 1-exp(-n/rate)
// (MemoryProfileOptions.Rate, in bytes), independently of every other allocation (Go's runtime
// counts down the bytes to the next sample instead, which gives each allocation the same
// probability). A sampled allocation records its call stack (up to 64 frames, starting at the
// caller of Allocate) and its size; the profile sums the samples by stack and size and scales
// them back to estimates of all allocations exactly as Go's heap profile does (each figure
// multiplied by 1/p), which makes every estimate unbiased. Its error: N allocations of n bytes
// are estimated with a standard deviation of sqrt(N(1-p)/p) allocations, about 1/sqrt(Np) of N
// (one over the square root of the number of samples expected), and exactly once n is many
// times the rate (p is then 1). A sampled block's free is counted when it is freed through the
// adaptor; the in-use figures are those of blocks allocated and not yet freed, now (Go's heap
// profile reports them as of its last garbage collection). Unsampled allocations leave no record:
// the adaptor keeps no entry per block.
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
// Cost. An allocation that is not sampled costs, besides passing the call on, a random draw (an
// atomic addition and a multiplication) and its test (a multiplication), and its free a load from
// a table of counters indexed by the pointer's hash, which tells pointers that cannot have been
// sampled from those that may have been (those then look their record up under a lock): about
// 6.5 ns a pair over the upstream's own cost on the benchmark host (an AMD EPYC virtual machine;
// BenchmarkMemoryProfileSampled), of which about 5 ns is what passing two calls through any
// adaptor costs, against 30-35 ns a pair for a pool there. A sampled allocation costs the capture
// of its stack (runtime.Callers, in proportion to its depth), a lookup of its stack in a table
// under a lock, and a map entry until it is freed: about 0.5 µs a pair on the benchmark host, so
// that through a pool allocations as large as the rate (mostly sampled) cost several times what
// they cost without the adaptor. Since at most one allocation is sampled per rate bytes on
// average, sampling costs at most that 0.5 µs per rate bytes allocated (4 ns per MiB at the
// default rate), whatever the sizes. Each distinct stack and size that is ever sampled keeps a
// record (about 100 bytes plus 8 per frame) for the life of the adaptor, as Go's heap profiler
// keeps its own; the adaptor itself takes about 21 KiB.
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
	// step is ceil(2^64/rate) (MaxUint64 at rate 1): n*step bounds 2^64 times the probability
	// with which an allocation of n bytes is sampled, for n up to fastMax, MaxUint64/step,
	// beyond which the product overflows (see sample).
	step, fastMax uint64

	// testRand, when set (by tests, before any allocation), replaces the per-thread random
	// source so that a test's samples are reproducible. It is not safe for concurrent use.
	testRand *rand.Rand

	// gens are the random generators that sample allocations (see draw).
	gens [1 << memProfGenBits]memProfGen

	// shards hold the sampled blocks not yet freed, by pointer hash.
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
	memProfGenBits    = 5  // 32 generators of 64 bytes
	memProfShardBits  = 5  // 32 shards of 64 bytes
	memProfFilterBits = 12 // 4096 counters of 4 bytes
)

// memProfShard is one shard of the sampled blocks, on a cache line of its own, so that goroutines
// recording or freeing sampled blocks of different shards do not share a line.
type memProfShard struct {
	mu   sync.Mutex // guards live
	live map[DevicePtr]*memProfBucket
	_    [64 - 16]byte
}

// memProfGen is one of the adaptor's random generators, on a cache line of its own: wyrand, a
// Weyl sequence (a counter advanced by an odd constant, here by one atomic addition, so that
// goroutines sharing a generator each get a value of their own) mixed by a 128-bit product.
//
// Why not the runtime's per-thread generator (math/rand/v2's rand.Uint64), which needs no
// atomic operation: it cost 7 ns a call on the benchmark host, against 2.5 ns for the atomic
// addition, most of what an unsampled allocation costs beyond passing the call on. And why not
// Go's countdown of bytes to the next sample: shared between goroutines, it needs a
// compare-and-swap loop (the value written depends on the value read), no cheaper than the
// addition and retried under contention, where the addition never is.
type memProfGen struct {
	seq atomic.Uint64
	_   [64 - 8]byte
}

// draw returns a uniform 64-bit variate from the generator of the calling goroutine's stack.
func (r *MemoryProfileResourceAdaptor) draw() uint64 {
	// The generator is picked by the address of a local variable, so that a goroutine keeps to
	// one (while its stack stays where it is) and goroutines running at once seldom share one's
	// cache line. Any generator would give a correct draw.
	var local byte
	sp := uint64(uintptr(unsafe.Pointer(&local)))
	g := &r.gens[(sp>>12)*0x9e3779b97f4a7c15>>(64-memProfGenBits)]
	x := g.seq.Add(0xa0761d6478bd642f)
	hi, lo := bits.Mul64(x, x^0xe7037ed1a0b428db)
	return hi ^ lo
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
		step:     math.MaxUint64,
		buckets:  map[uint64]*memProfBucket{},
	}
	if rate > 1 {
		// ceil(2^64/rate) = floor((2^64-1)/rate) + 1, for rate > 1: where rate divides 2^64 (a
		// power of two) the floor is one less than the quotient, elsewhere it is the quotient's.
		r.step = math.MaxUint64/uint64(rate) + 1
	}
	r.fastMax = math.MaxUint64 / r.step
	for i := range r.gens {
		r.gens[i].seq.Store(rand.Uint64())
	}
	for i := range r.shards {
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
	var u uint64
	if r.testRand == nil {
		u = r.draw()
	} else {
		u = r.testRand.Uint64()
	}
	if r.sample(uint64(nbytes), u) {
		r.record(p, nbytes)
	}
	return p, nil
}

// sample reports whether an allocation of n > 0 bytes is sampled when the uniform 64-bit variate
// drawn for it is u: when u < t(n) = floor(2^64 p(n)), p(n) = 1-exp(-n/rate), so with
// probability p(n) to within 2^-64, independently of every other allocation. At rate 1 every
// allocation is.
func (r *MemoryProfileResourceAdaptor) sample(n, u uint64) bool {
	// p(n) <= n/rate, so t(n) <= n*step: a u above n*step, the common case, is not sampled, at
	// the cost of a multiplication. Where n*step would overflow, the bound says nothing.
	if n <= r.fastMax && u > n*r.step {
		return false
	}
	return r.sampleExact(n, u)
}

// sampleExact is sample's test of a variate u that the bound did not reject.
func (r *MemoryProfileResourceAdaptor) sampleExact(n, u uint64) bool {
	if r.rate == 1 {
		return true
	}
	// p(n) >= x - x^2/2, x = n/rate: a u below that, less a margin for the roundings, is
	// sampled without math.Expm1 (10 ns), which is then needed with probability about x^2/2
	// rather than x.
	x := float64(n) / float64(r.rate)
	if lb := x * (1 - 0.5*x) * (1 - 0x1p-50); lb > 0 && u < uint64(lb*0x1p64) {
		return true
	}
	p := -math.Expm1(-x)
	if p >= 1 { // n is over 37 times the rate
		return true
	}
	t := uint64(p * 0x1p64) // p < 1, so t < 2^64
	if n <= r.fastMax {
		// Never above the bound, which p's rounding might pass when n/rate is tiny, so that
		// sample's fast rejection is exact.
		t = min(t, n*r.step)
	}
	return u < t
}

// record records the sampled allocation p of nbytes with the stack of Allocate's caller.
//
//go:noinline
func (r *MemoryProfileResourceAdaptor) record(p DevicePtr, nbytes int) {
	var pcs [maxTrackedFrames]uintptr
	n := runtime.Callers(3, pcs[:]) // runtime.Callers, record, Allocate
	b := r.bucket(pcs[:n], int64(nbytes))
	b.allocs.Add(1)
	h := memProfHash(p)
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
