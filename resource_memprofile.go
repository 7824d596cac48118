package rmm

import (
	"math"
	"math/bits"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/gormm/rmm/internal/fpwalk"
)

// DefaultMemoryProfileRate is the sampling rate, in bytes, of a [MemoryProfile] made without one:
// on average one allocation is recorded per 4 GiB allocated (an allocation of n bytes with
// probability 1-exp(-n/4 GiB): one of 64 MiB in 65, one of 1 GiB in 4.5, one of 16 GiB almost
// surely), 8192 times Go's own default ([runtime.MemProfileRate], 512 KiB). Device programs
// allocate far more bytes than Go programs do on their heap, and a sub-allocator hands out a
// block of any size in tens of nanoseconds, while a sample costs a walk of the stack and a
// record: 4 GiB is the power of two at which sampling stays a small part of the cost of a
// sub-allocator's allocations, the largest blocks of benchmark W1 included (BENCHMARKS.md, "W1").
// The price is detail: a profile holds about one sample per 4 GiB in use, so that 60 GiB held in
// blocks of 100 MiB are estimated from about 15 samples (a standard deviation of about a quarter;
// see [MemoryProfileResourceAdaptor]); set [MemoryProfileOptions].Rate lower for more.
const DefaultMemoryProfileRate = 4 << 30

// MemoryProfileOptions configures a [MemoryProfile] ([NewMemoryProfile]) or the one of a
// [MemoryProfileResourceAdaptor]. nil means the defaults.
type MemoryProfileOptions struct {
	// Rate is the sampling rate in bytes, as runtime.MemProfileRate is for Go's heap: an
	// allocation of n bytes is recorded with probability 1-exp(-n/Rate), so that on average one
	// allocation is recorded per Rate bytes allocated and an allocation of many times Rate bytes
	// is always recorded. 1 is the exception: it records every allocation, of any size (the
	// profile is then exact). 0 means
	// [DefaultMemoryProfileRate]; a negative rate is refused with [ErrInvalidArgument].
	Rate int
}

// MemoryProfileResourceAdaptor forwards every call to its upstream and records, for a sample of
// the allocations, the Go call stack that made them, so that device memory can be profiled as
// Go's heap is: WriteProfile writes a profile in pprof's format (go tool pprof reads it), with
// the sample types of Go's heap profile (alloc_objects, alloc_space, inuse_objects, inuse_space);
// [MemoryProfileHandler] serves it over HTTP; TopSites and Report sum it by call site.
//
// What is recorded. Allocations are sampled by size, as Go's heap profiler samples its own: an
// allocation of n bytes is recorded with probability p = 1-exp(-n/rate)
// ([MemoryProfileOptions.Rate], in bytes), independently of every other allocation (Go's runtime
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
// A negative size returns an error wrapping [ErrInvalidArgument] without calling the upstream. A
// free of a pointer that was not sampled (or that the adaptor never saw, or a double free) is
// passed to the upstream as it is, with its error, if any, returned as it is; when the upstream
// refuses the free of a sampled block, its record is kept. The size given to Deallocate is passed
// on unchanged. Memory freed behind the adaptor's back (through its upstream directly) stays
// counted as in use until its address is allocated and sampled again or freed through the
// adaptor.
//
// Cost. An allocation that is not sampled costs, besides passing the call on, a random draw of 32
// bits from the Go runtime's per-thread generator (a call, no atomic operation) and its test (a
// multiplication and a comparison), and its free a load from a table of counters indexed by the
// pointer's hash, which tells pointers that cannot have been sampled from those that may have been
// (those then look their record up under a lock): about as much again as passing the two calls
// through any adaptor costs, a small part of a pool's own allocation. A sampled allocation costs
// the walk of its stack by frame pointers (on amd64; elsewhere, and in Go called back from C, the
// stack is taken with runtime.Callers, several times slower), a lookup of the stack in a table
// that needs no lock, and an entry in a table under a lock until it is freed. Since one allocation
// is sampled per rate bytes on average, sampling costs at most that per rate bytes allocated,
// whatever the sizes (BenchmarkMemoryProfileSampled measures both paths; BENCHMARKS.md, "W1",
// gives them over the GPU's resources). Each distinct stack and size that is ever sampled keeps a
// record (about 100 bytes plus 8 per frame) for the life of the adaptor, as Go's heap profiler
// keeps its own; each sampled block not yet freed, an entry of 32 to 64 bytes; the adaptor itself
// takes about 18 KiB.
//
// Over a [PoolMemoryResource], [PoolOptions.MemoryProfile] gives the same profile for less: the pool
// counts bytes down to its next sample under the lock its allocation takes anyway and keeps a
// sampled block's record on the block, and no adaptor call is made, so it adds less to each
// allocation than this adaptor, half of whose cost is the two calls any adaptor passes on
// (BENCHMARKS.md, "W1").
//
// Why an adaptor of its own rather than an option of [TrackingResourceAdaptor]: the tracking
// adaptor's purpose is an entry for every outstanding allocation (to list leaks exactly), which
// is the cost this one exists to avoid; and this one's figures are estimates, not a list. Stack
// them when both are wanted.
//
// Safe for concurrent use by many goroutines.
type MemoryProfileResourceAdaptor struct {
	// MemoryProfile holds the samples: its methods (Profile, WriteProfile, TopSites, Report,
	// Rate) are the adaptor's, and MemoryProfileHandler serves it.
	*MemoryProfile

	upstream MemoryResource

	// shards hold the sampled blocks not yet freed, by pointer hash.
	shards [1 << memProfShardBits]memProfShard

	// maybe counts, for each slot (the top memProfFilterBits bits of a pointer's hash), the
	// sampled blocks not yet freed whose pointer falls into it: a free whose slot holds 0 was
	// not sampled.
	maybe [1 << memProfFilterBits]atomic.Uint32
}

// MemoryProfile is a profile of device memory by the Go call stacks that allocated it, sampled
// as Go's heap profile is: what a [MemoryProfileResourceAdaptor] records, and what a
// [PoolMemoryResource] made with [PoolOptions.MemoryProfile] records of its own allocations. Profile
// and WriteProfile give it in pprof's format, [MemoryProfileHandler] serves it over HTTP, TopSites
// and Report sum it by call site. See MemoryProfileResourceAdaptor for what is sampled and the
// estimates' error.
//
// One MemoryProfile may take the samples of several resources at once (the call stacks tell them
// apart only by their callers). Safe for concurrent use by many goroutines.
type MemoryProfile struct {
	rate int
	// step is ceil(2^64/rate) (MaxUint64 at rate 1): n*step bounds 2^64 times the probability
	// with which an allocation of n bytes is sampled, for n up to fastMax, MaxUint64/step,
	// beyond which the product overflows (see sample).
	step, fastMax uint64

	// testRand, when set (by tests, before any allocation), replaces the per-thread random
	// source so that a test's samples are reproducible. It is not safe for concurrent use.
	testRand *rand.Rand

	// buckets finds a bucket by its stack and size without a lock (see bucket); mu guards its
	// changes and all.
	buckets atomic.Pointer[memProfTable]
	mu      sync.Mutex
	all     []*memProfBucket // in the order they were made
}

const (
	memProfShardBits  = 5  // 32 shards of 64 bytes
	memProfFilterBits = 12 // 4096 counters of 4 bytes
)

// memProfShard is one shard of the sampled blocks, on a cache line of its own, so that goroutines
// recording or freeing sampled blocks of different shards do not share a line.
type memProfShard struct {
	mu   sync.Mutex // guards live
	live memProfLive
	_    [64 - 8 - unsafe.Sizeof(memProfLive{})]byte
}

// cheaprand is the Go runtime's per-thread generator (wyrand: a Weyl sequence mixed by a 128-bit
// product, on the thread's own state, so without an atomic operation), which the runtime keeps
// for packages that link to it (go.dev/issue/67401). It gives 32 bits a call.
//
// Why not math/rand/v2's rand.Uint64 (the runtime's per-thread ChaCha8): it runs a cipher over
// a buffer, which costs more per draw than cheaprand's one multiplication, on every allocation,
// sampled or not. And why not that atomic addition (on generators picked by the stack's
// address, as this adaptor did before): a locked instruction, which orders every store before it
// and costs several times an ordinary one on many processors, on a cache line that goroutines
// allocating at once may share. Go's own countdown of bytes to the next sample needs state of
// the thread's, which the runtime does not lend.
//
//go:linkname cheaprand runtime.cheaprand
func cheaprand() uint32

// draw returns a uniform 64-bit variate, made of two of cheaprand's (see sampleDraw for the
// use of its top half alone).
func draw() uint64 { return uint64(cheaprand())<<32 | uint64(cheaprand()) }

// memProfBucket sums the samples of one call stack and size.
type memProfBucket struct {
	stack  []uintptr // return PCs, innermost first, as fpwalk.Callers or runtime.Callers gives them
	size   int64
	hash   uint64       // of stack and size
	allocs atomic.Int64 // sampled allocations
	frees  atomic.Int64 // of which freed
}

// NewMemoryProfileResourceAdaptor returns an adaptor that samples the allocations made through it
// from upstream at [MemoryProfileOptions.Rate] (nil opts: [DefaultMemoryProfileRate]), into a
// [MemoryProfile] of its own. A negative rate returns an error wrapping [ErrInvalidArgument]. A
// nil upstream means the current device resource ([CurrentDeviceResource], read once, here); a
// nil pointer as upstream returns an error wrapping [ErrInvalidArgument].
func NewMemoryProfileResourceAdaptor(upstream MemoryResource, opts *MemoryProfileOptions) (*MemoryProfileResourceAdaptor, error) {
	upstream, err := upstreamOf("NewMemoryProfileResourceAdaptor", upstream)
	if err != nil {
		return nil, err
	}
	m, err := newMemoryProfile("NewMemoryProfileResourceAdaptor", opts)
	if err != nil {
		return nil, err
	}
	return &MemoryProfileResourceAdaptor{MemoryProfile: m, upstream: upstream}, nil
}

// NewMemoryProfile returns an empty profile that samples at opts.Rate (nil:
// [DefaultMemoryProfileRate]), for [PoolOptions.MemoryProfile]. A negative rate returns an error
// wrapping [ErrInvalidArgument].
func NewMemoryProfile(opts *MemoryProfileOptions) (*MemoryProfile, error) {
	return newMemoryProfile("NewMemoryProfile", opts)
}

func newMemoryProfile(op string, opts *MemoryProfileOptions) (*MemoryProfile, error) {
	rate := DefaultMemoryProfileRate
	if opts != nil {
		switch {
		case opts.Rate < 0:
			return nil, errorf("%s: negative sampling rate %d (bytes per sample; 1 records every allocation, 0 means the default %d): %w", op, opts.Rate, DefaultMemoryProfileRate, ErrInvalidArgument)
		case opts.Rate > 0:
			rate = opts.Rate
		}
	}
	m := &MemoryProfile{rate: rate, step: math.MaxUint64}
	m.buckets.Store(&memProfTable{slots: make([]atomic.Pointer[memProfBucket], 64)})
	if rate > 1 {
		// ceil(2^64/rate) = floor((2^64-1)/rate) + 1, for rate > 1: where rate divides 2^64 (a
		// power of two) the floor is one less than the quotient, elsewhere it is the quotient's.
		m.step = math.MaxUint64/uint64(rate) + 1
	}
	m.fastMax = math.MaxUint64 / m.step
	return m, nil
}

// Rate returns the sampling rate in bytes (1: every allocation is recorded).
func (m *MemoryProfile) Rate() int { return m.rate }

// memProfHash mixes a pointer's bits (they are multiples of 256) into the top bits.
func memProfHash(p DevicePtr) uint64 { return uint64(p) * 0x9e3779b97f4a7c15 }

// Allocate allocates nbytes from the upstream on stream s and, when the allocation is sampled,
// records its call stack (see the type's comment). A negative size returns an error wrapping
// [ErrInvalidArgument] without calling the upstream; the upstream's errors are returned unchanged
// and nothing is recorded then.
//
//go:noinline
func (r *MemoryProfileResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	// Never inlined: record's stack starts two frames up, at Allocate's caller.
	if nbytes < 0 {
		return 0, invalidSize("MemoryProfileResourceAdaptor", "Allocate", nbytes)
	}
	p, err := r.upstream.Allocate(nbytes, s)
	if err != nil || nbytes == 0 {
		return p, err
	}
	// The variate's top 32 bits decide the common case (see rejects); otherwise, with
	// probability about n/rate + 2^-32, its bottom 32 bits are drawn too and sample decides.
	if hi := cheaprand(); r.rejects(uint64(nbytes), hi) && r.testRand == nil {
		return p, nil
	} else if r.sampleDraw(uint64(nbytes), hi) {
		r.record(p, nbytes)
	}
	return p, nil
}

// rejects reports whether an allocation of n > 0 bytes whose variate's top 32 bits are hi is
// not sampled, whatever its bottom bits: when hi exceeds the top 32 bits of n*step (the bound
// on the threshold that sample tests first), since the variate is then at least
// (hi<<32) > n*step.
func (r *MemoryProfile) rejects(n uint64, hi uint32) bool {
	return n <= r.fastMax && uint64(hi) > n*r.step>>32
}

// sampleDraw is Allocate's test of an allocation of n > 0 bytes whose variate's top 32 bits,
// hi, the fast test did not reject (or with testRand set, which hi is then ignored for).
func (r *MemoryProfile) sampleDraw(n uint64, hi uint32) bool {
	if r.testRand != nil {
		return r.sample(n, r.testRand.Uint64())
	}
	return r.sample(n, uint64(hi)<<32|uint64(cheaprand()))
}

// sample reports whether an allocation of n > 0 bytes is sampled when the uniform 64-bit variate
// drawn for it is u: when u < t(n) = floor(2^64 p(n)), p(n) = 1-exp(-n/rate), so with
// probability p(n) to within 2^-64, independently of every other allocation. At rate 1 every
// allocation is.
func (r *MemoryProfile) sample(n, u uint64) bool {
	// p(n) <= n/rate, so t(n) <= n*step: a u above n*step, the common case, is not sampled, at
	// the cost of a multiplication. Where n*step would overflow, the bound says nothing.
	if n <= r.fastMax && u > n*r.step {
		return false
	}
	return r.sampleExact(n, u)
}

// sampleExact is sample's test of a variate u that the bound did not reject.
func (r *MemoryProfile) sampleExact(n, u uint64) bool {
	if r.rate == 1 {
		return true
	}
	// p(n) >= x - x^2/2, x = n/rate: a u below that, less a margin for the roundings, is
	// sampled without math.Expm1 (a call that costs more than the rest of the test), which is then needed with probability about x^2/2
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
	b := r.callerBucket(nbytes)
	h := memProfHash(p)
	sh := &r.shards[h>>(64-memProfShardBits)]
	sh.mu.Lock()
	old := sh.live.put(p, h, b)
	sh.mu.Unlock()
	if old != nil {
		// The upstream handed out a sampled block that was never freed through the adaptor: it
		// was freed behind its back. Count it freed now.
		old.frees.Add(1)
		return
	}
	r.maybe[h>>(64-memProfFilterBits)].Add(1)
}

// callerBucket counts a sampled allocation of nbytes in the bucket of its stack, which starts at
// the caller of Allocate, and returns the bucket. It is called by the function that Allocate
// called to record the sample (the adaptor's record, the pool's recordBlock).
//
//go:noinline
func (m *MemoryProfile) callerBucket(nbytes int) *memProfBucket {
	var pcs [maxTrackedFrames]uintptr
	// Frames 1 to 4: callerBucket, the recording function, Allocate, Allocate's caller. The walk
	// by frame pointers gives physical frames (see memProfLocations.stack); runtime.Callers, when
	// the walk stopped short, logical ones. Both start at Allocate's caller: none of the three
	// is inlined, and a wrapper between Allocate and its caller, which runtime.Callers skips and
	// the walk does not, is left out of the profile.
	n, complete := fpwalk.Callers(4, pcs[:])
	if !complete {
		n = runtime.Callers(4, pcs[:])
	}
	b := m.bucket(pcs[:n], int64(nbytes))
	b.allocs.Add(1)
	return b
}

// bucket returns the bucket of stack stk and size, making it the first time.
func (r *MemoryProfile) bucket(stk []uintptr, size int64) *memProfBucket {
	h := uint64(size) * 0x100000001b3
	for _, pc := range stk {
		h = (h ^ uint64(pc)) * 0x100000001b3
	}
	if b := r.buckets.Load().find(h, stk, size); b != nil {
		return b // the common case: without a lock
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	t := r.buckets.Load()
	if b := t.find(h, stk, size); b != nil {
		return b
	}
	b := &memProfBucket{stack: slices.Clone(stk), size: size, hash: h}
	r.all = append(r.all, b)
	if 2*len(r.all) > len(t.slots) {
		// Kept at most half full. Lookups running meanwhile in the old table, which is left as
		// it is, miss only the buckets made since, and come here for them.
		t = &memProfTable{slots: make([]atomic.Pointer[memProfBucket], 2*len(t.slots))}
		for _, b := range r.all {
			t.insert(b)
		}
		r.buckets.Store(t)
		return b
	}
	t.insert(b)
	return b
}

// memProfTable is a hash table of buckets by stack and size, with open addressing and linear
// probing, that buckets are only ever added to: a lookup needs no lock, since a slot, once set,
// holds the same bucket for the life of the table, and a bucket is set in a slot (atomically)
// only once it is complete.
type memProfTable struct {
	slots []atomic.Pointer[memProfBucket] // a power of two of them
}

// find returns the bucket of hash h, stack stk and size, or nil.
func (t *memProfTable) find(h uint64, stk []uintptr, size int64) *memProfBucket {
	mask := uint64(len(t.slots) - 1)
	for i := h >> (64 - bits.Len64(mask)); ; i = (i + 1) & mask {
		b := t.slots[i].Load()
		if b == nil || b.hash == h && b.size == size && slices.Equal(b.stack, stk) {
			return b
		}
	}
}

// insert puts b into the table (with mu held, and room left in the table).
func (t *memProfTable) insert(b *memProfBucket) {
	mask := uint64(len(t.slots) - 1)
	i := b.hash >> (64 - bits.Len64(mask))
	for t.slots[i].Load() != nil {
		i = (i + 1) & mask
	}
	t.slots[i].Store(b)
}

// memProfLive is one shard's table of the sampled blocks not yet freed, by pointer: open
// addressing with linear probing, from the pointer hash's bits below those that pick the shard,
// kept at most half full; a deletion shifts the entries after it back, so that it leaves no
// mark. (A Go map serves too, but costs more: an emptied map draws a new hash seed.) Its user
// holds the shard's lock.
type memProfLive struct {
	slots []memProfLiveSlot // a power of two of them, or none
	n     int               // entries
}

type memProfLiveSlot struct {
	p DevicePtr
	b *memProfBucket // nil: the slot is empty
}

// home returns the slot where the entry of a pointer whose hash is h starts its probe.
func (t *memProfLive) home(h uint64) uint64 {
	return h << memProfShardBits >> (64 - bits.Len64(uint64(len(t.slots)-1)))
}

// find returns the slot of p (hash h), or the empty slot where it would go.
func (t *memProfLive) find(p DevicePtr, h uint64) uint64 {
	mask := uint64(len(t.slots) - 1)
	i := t.home(h)
	for t.slots[i].b != nil && t.slots[i].p != p {
		i = (i + 1) & mask
	}
	return i
}

// put records p (hash h) in b and returns the bucket it was recorded in before, or nil.
func (t *memProfLive) put(p DevicePtr, h uint64, b *memProfBucket) *memProfBucket {
	if 2*(t.n+1) > len(t.slots) {
		old := t.slots
		t.slots, t.n = make([]memProfLiveSlot, max(16, 2*len(old))), 0
		for _, e := range old {
			if e.b != nil {
				t.put(e.p, memProfHash(e.p), e.b)
			}
		}
	}
	i := t.find(p, h)
	old := t.slots[i].b
	if old == nil {
		t.n++
	}
	t.slots[i] = memProfLiveSlot{p, b}
	return old
}

// get returns the bucket p (hash h) is recorded in, or nil.
func (t *memProfLive) get(p DevicePtr, h uint64) *memProfBucket {
	if t.n == 0 {
		return nil
	}
	return t.slots[t.find(p, h)].b
}

// delete drops p's entry (hash h) and returns its bucket, or nil when it has none.
func (t *memProfLive) delete(p DevicePtr, h uint64) *memProfBucket {
	if t.n == 0 {
		return nil
	}
	i := t.find(p, h)
	b := t.slots[i].b
	if b == nil {
		return nil
	}
	t.n--
	// Shift back each entry of the run after i that may move into the hole: one whose home is
	// not cyclically in (i, j].
	mask := uint64(len(t.slots) - 1)
	for j := (i + 1) & mask; t.slots[j].b != nil; j = (j + 1) & mask {
		k := t.home(memProfHash(t.slots[j].p))
		if (j-k)&mask >= (j-i)&mask {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = memProfLiveSlot{}
	return b
}

// Deallocate returns p to the upstream on stream s; when p was sampled, its record is dropped
// first (and put back when the upstream returns an error). A negative size returns an error
// wrapping [ErrInvalidArgument] without calling the upstream; the upstream's errors are returned
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
	b := sh.live.delete(p, h)
	sh.mu.Unlock()
	if b == nil {
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
		if sh.live.get(p, h) == nil { // a broken upstream may have handed p out again
			sh.live.put(p, h, b)
			slot.Add(1)
			b.frees.Add(-1)
		}
		sh.mu.Unlock()
	}
	return err
}

// Upstream returns the resource the adaptor forwards to.
func (r *MemoryProfileResourceAdaptor) Upstream() MemoryResource { return r.upstream }

func (*MemoryProfileResourceAdaptor) insideUpstream() {}

func (*MemoryProfileResourceAdaptor) passesPointersThrough() {}

// Access reports the upstream's accessibility ([AccessOf](Upstream())).
func (r *MemoryProfileResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the upstream's device ([DeviceOf](Upstream())).
func (r *MemoryProfileResourceAdaptor) Device() Device { return DeviceOf(r.upstream) }

// snapshot returns the buckets made so far, in the order they were made.
func (r *MemoryProfile) snapshot() []*memProfBucket {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clip(r.all)
}

// nextSample returns the bytes a pool allocates before its next sample: a variate of the
// exponential distribution of mean rate (0 at rate, and for a nil profile). A pool counts the
// bytes asked of it down from there and samples the allocation that takes the count below 0: an
// allocation of n bytes then covers a stretch of n bytes of a Poisson process of one point per
// rate bytes, and is sampled when a point falls into it, with probability 1-exp(-n/rate),
// independently of every other allocation (the stretches do not overlap), as the adaptor's draw
// samples it; Profile scales both alike. This is how Go's runtime samples its heap. The count is
// the pool's (or a per-stream cache's), kept under the lock the allocation holds anyway, so
// that an allocation not sampled costs a subtraction and a comparison.
func (m *MemoryProfile) nextSample() int {
	if m == nil || m.rate == 1 {
		return 0
	}
	var u uint64
	if m.testRand != nil {
		u = m.testRand.Uint64()
	} else {
		u = draw()
	}
	// -ln of a uniform variate in (0, 1]: 53 bits, so at most 36.7 times the rate, which past
	// MaxInt/36.7 may exceed what an int holds (float64(MaxInt) is 2^63).
	if x := -math.Log(float64(u>>11+1)*0x1p-53) * float64(m.rate); x < math.MaxInt {
		return int(x)
	}
	return math.MaxInt
}

// take counts an allocation of nbytes down *left, the bytes still to allocate before the next
// sample (a pool's or a stream cache's count, under the lock that guards it), and reports
// whether the allocation is sampled, drawing the next count when it is (see nextSample). A nil
// profile samples nothing.
func (m *MemoryProfile) take(left *int, nbytes int) bool {
	// Small enough to be inlined into the pool's paths.
	if m != nil {
		if *left -= nbytes; *left < 0 {
			*left = m.nextSample()
			return true
		}
	}
	return false
}

// recordBlock records the pool's sampled block b of nbytes with the stack of Allocate's caller,
// keeping the record's bucket on b for its free (dropSample).
//
//go:noinline
func (m *MemoryProfile) recordBlock(b *block, nbytes int) {
	// PoolMemoryResource.Allocate is never inlined either: it is far too large.
	b.rareFields().sample = m.callerBucket(nbytes)
}

// dropSample counts b's free in its sample's bucket, if it was sampled (b's list or cache
// locked, the free certain).
func (b *block) dropSample() {
	if r := b.rare; r != nil && r.sample != nil {
		r.sample.frees.Add(1)
		r.sample = nil
		b.tidyRare()
	}
}
