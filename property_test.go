// Property tests of PoolMemoryResource: gopter state-machine (commands) tests and a concurrent
// stress test.
//
// A generic model drives a MemoryResource with random command sequences: allocate (sizes from a
// mix of 0, 1..300 bytes, multiples of 256 and up to MiB or tens of GiB), free on the allocating
// stream or on another one, zero-byte allocate and free, invalid frees (interior pointer, pointer
// not handed out, double free, wrong size), Release, free everything, and requests larger than
// the resource can ever hold. The system under test is a resource built by a constructor over a
// recording upstream, plus 3 or 4 Streams and DefaultStream; the model's state is the live
// allocations (pointer, size, stream) and the statistics they imply. After every step the
// property checks: CheckInvariants returns nil; every live pointer is 256-aligned and non-zero;
// no two live allocations overlap; every live allocation lies inside one block the upstream
// handed out; Stats equals the model (LiveAllocations, LiveBytes as the sum of sizes rounded to
// 256, FreeBytes = PoolSize - LiveBytes, PoolSize = the bytes held from the upstream, at most
// the maximum); a failed call leaves Stats, CheckInvariants and the upstream as they were; after
// Release every upstream block still held contains a live allocation, so that with nothing live
// the pool's size is 0. Over host memory every byte of every allocation holds a pattern derived
// from its id, verified after every step, which catches overlaps in real memory.
//
// On failure gopter shrinks the sequence to a minimal one; the report shows the configuration,
// the shrunk commands, what was wrong and the seed.
//
// Replaying a failure: every property test takes its seed from RMM_PROPERTY_SEED when set (and
// logs the seed it used with -v), so
//
//	RMM_PROPERTY_SEED=1234 go test -race -run '^TestPoolPropertySimulated$' .
//
// draws the same sequences again. RMM_PROPERTY_SCALE=k runs k times as many sequences (a longer
// search; the default run is sized for a few seconds per test under -race).

package rmm

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand"
	randv2 "math/rand/v2"
	"os"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/commands"
	"github.com/stretchr/testify/require"
)

const (
	kiB = 1 << 10
	miB = 1 << 20
	giB = 1 << 30
)

// ---------------------------------------------------------------------------------------------
// The generic model.

// resourceConfig is what one command sequence runs against, drawn once per sequence.
type resourceConfig struct {
	Streams         int // owned Streams besides DefaultStream
	InitialPoolSize int
	MaximumPoolSize int // 0: none
	UpstreamLimit   int // bytes the upstream grants in all (0: its own capacity)
	CarvePage       int // expandable pools: PoolOptions.carvePage (0: no carving)
}

// conformanceSpec describes a MemoryResource to the state machine: how to build one for a
// sequence and what it can be checked for.
type conformanceSpec struct {
	name string
	// genConfig draws the configuration of a sequence from r (deterministically).
	genConfig func(r *rand.Rand) resourceConfig
	// newUpstream returns a fresh upstream for one sequence (the model wraps it in a recorder).
	newUpstream func(cfg resourceConfig) MemoryResource
	// newResource builds the resource under test over up.
	newResource func(up MemoryResource, cfg resourceConfig) (MemoryResource, error)
	// size draws the size in bytes of an ordinary allocation.
	size func(r *rand.Rand, cfg resourceConfig) int
	// capacity is the most bytes the upstream can ever hand out (rounded to 256). Requests above
	// what is left of the limit (see limit) must fail with ErrOutOfMemory.
	capacity int
	// mayRunOut: ordinary allocations may fail with ErrOutOfMemory even without a maximum or an
	// upstream limit (sizes close to the capacity).
	mayRunOut bool

	// What the resource can be checked for.
	detectsInvalidFree bool // returns ErrInvalidFree for bad frees and changes nothing
	hasInvariants      bool // CheckInvariants() error
	hasStats           bool // Stats() PoolStats
	hasMaximum         bool // honours resourceConfig.MaximumPoolSize
	hostMemory         bool // host-accessible memory: write and verify patterns
	keepsUpstream      bool // Release gives nothing back (an arena holds its one upstream allocation until Close)
	mergedUpstream     bool // the recorded upstream blocks are maximal mapped ranges, not Stats' UpstreamBlocks (expandable pool)
}

// limit returns the most bytes (each allocation rounded to 256) that can be live at once.
func (sp *conformanceSpec) limit(cfg resourceConfig) int {
	l := sp.capacity
	if cfg.UpstreamLimit > 0 {
		l = min(l, AlignDown(cfg.UpstreamLimit, Alignment))
	}
	if sp.hasMaximum && cfg.MaximumPoolSize > 0 {
		l = min(l, cfg.MaximumPoolSize)
	}
	return l
}

// canRunOut reports whether ordinary allocations may fail under cfg.
func (sp *conformanceSpec) canRunOut(cfg resourceConfig) bool {
	return sp.mayRunOut || cfg.UpstreamLimit > 0 || (sp.hasMaximum && cfg.MaximumPoolSize > 0)
}

type allocStatus uint8

const (
	allocPending allocStatus = iota // drawn, not run (while generating)
	allocLive
	allocFailed // the allocation returned ErrOutOfMemory: freeing it is a no-op
)

// modelAlloc is one allocation of the model, known by its tag (unique in a sequence, kept when
// the sequence is shrunk).
type modelAlloc struct {
	tag    int
	size   int
	stream int // 0: DefaultStream, i: the i-th Stream
	ptr    DevicePtr
	status allocStatus
}

// propState is the model's state. Pointers are only known once a command has run, so PostCondition
// records them (and whether the allocation succeeded) in the state of the current run, which
// NextState copies forward; generation only looks at tags, sizes and streams.
type propState struct {
	spec    *conformanceSpec
	cfg     resourceConfig
	nextTag int
	allocs  []modelAlloc // in tag order
}

func (st *propState) clone() *propState {
	c := *st
	c.allocs = slices.Clone(st.allocs)
	return &c
}

func (st *propState) find(tag int) int {
	for i := range st.allocs {
		if st.allocs[i].tag == tag {
			return i
		}
	}
	return -1
}

func (st *propState) remove(tag int) {
	if i := st.find(tag); i >= 0 {
		st.allocs = slices.Delete(st.allocs, i, i+1)
	}
}

// live returns the allocations that succeeded and are not freed, and their count and bytes
// (rounded to 256) as Stats reports them (zero-byte allocations count for nothing).
func (st *propState) live() (allocs []modelAlloc, count, nbytes int) {
	for _, a := range st.allocs {
		if a.status != allocLive {
			continue
		}
		allocs = append(allocs, a)
		if a.size > 0 {
			count++
			nbytes += roundUp(a.size)
		}
	}
	return allocs, count, nbytes
}

func (st *propState) String() string {
	return fmt.Sprintf("%s{%s}", st.spec.name, st.cfg)
}

func (c resourceConfig) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "streams: default+%d, initial: %d", c.Streams, c.InitialPoolSize)
	if c.MaximumPoolSize > 0 {
		fmt.Fprintf(&b, ", maximum: %d", c.MaximumPoolSize)
	}
	if c.UpstreamLimit > 0 {
		fmt.Fprintf(&b, ", upstream limit: %d", c.UpstreamLimit)
	}
	return b.String()
}

func roundUp(n int) int {
	r, _ := AlignUp(n, Alignment)
	return r
}

// ---------------------------------------------------------------------------------------------
// The system under test.

// propCoverage counts what the sequences of one property exercised, so that a test fails when
// its generators stop reaching a path.
type propCoverage struct {
	allocs, oom, crossFrees, invalidFrees, releasesToZero, upstreamRefusals, backoffGrants atomic.Int64
	leaks                                                                                  atomic.Int64 // sequences after which Close and freeing the live allocations left upstream memory
}

type propHandle struct {
	ptr     DevicePtr
	size    int
	stream  int
	pattern []byte // one period of the allocation's pattern, repeated (host memory only)
}

type propSystem struct {
	spec    *conformanceSpec
	cfg     resourceConfig
	cov     *propCoverage
	up      *recordingUpstream
	mr      MemoryResource
	streams []*Stream
	views   []StreamView // 0: DefaultStream
	handles map[int]*propHandle
}

func newPropSystem(spec *conformanceSpec, cfg resourceConfig, cov *propCoverage) *propSystem {
	sys := &propSystem{spec: spec, cfg: cfg, cov: cov, handles: map[int]*propHandle{}, views: []StreamView{DefaultStream}}
	sys.up = newRecordingUpstream(spec.newUpstream(cfg))
	for range cfg.Streams {
		s, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
		if err != nil {
			panic(fmt.Sprintf("NewStream: %v", err))
		}
		sys.streams = append(sys.streams, s)
		sys.views = append(sys.views, s.View())
	}
	mr, err := spec.newResource(sys.up, cfg)
	if err != nil {
		panic(fmt.Sprintf("building %s over %s: %v", spec.name, cfg, err))
	}
	sys.mr = mr
	if spec.hasInvariants {
		_ = mr.(interface{ CheckInvariants() error })
	}
	if spec.hasStats {
		_ = mr.(interface{ Stats() PoolStats })
	}
	if spec.hostMemory && AccessOf(mr)&HostAccessible == 0 {
		panic(fmt.Sprintf("%s: host memory expected, access is %v", spec.name, AccessOf(mr)))
	}
	return sys
}

func (sys *propSystem) destroy() {
	if c, ok := sys.mr.(interface{ Close() error }); ok {
		if err := c.Close(); err != nil {
			sys.cov.leaks.Add(1)
		}
		// Allocations live at Close stay valid; freeing them afterwards returns the rest.
		for _, h := range sys.handles {
			if h.ptr != 0 {
				if err := sys.mr.Deallocate(h.ptr, h.size, sys.views[h.stream]); err != nil {
					sys.cov.leaks.Add(1)
				}
			}
		}
		if n, _ := sys.up.held(); n != 0 {
			sys.cov.leaks.Add(1)
		}
	}
	for _, s := range sys.streams {
		s.Close()
	}
	refused, backoff := sys.up.counts()
	sys.cov.upstreamRefusals.Add(int64(refused))
	sys.cov.backoffGrants.Add(int64(backoff))
}

// snapshot is what the system looks like between two steps.
type snapshot struct {
	stats      PoolStats
	poolSize   int   // PoolSize(), -1 when the resource has none
	invariants error // CheckInvariants()
	upstream   []upstreamBlock
	upErr      error // first misuse of the upstream seen so far
}

func (sys *propSystem) snapshot() snapshot {
	var s snapshot
	if sys.spec.hasStats {
		s.stats = sys.mr.(interface{ Stats() PoolStats }).Stats()
	}
	s.poolSize = -1
	if p, ok := sys.mr.(interface{ PoolSize() int }); ok {
		s.poolSize = p.PoolSize()
	}
	if sys.spec.hasInvariants {
		s.invariants = sys.mr.(interface{ CheckInvariants() error }).CheckInvariants()
	}
	s.upstream, s.upErr = sys.up.blocks()
	return s
}

// stepResult is what Run observed.
type stepResult struct {
	err, err2  error // the operation's errors (err2: the second call of two-call commands)
	ptr        DevicePtr
	nbytes     int  // the size actually asked (commands that compute it when they run)
	skipped    bool // the allocation the command names failed earlier: nothing was called
	before     snapshot
	mid        snapshot // between the two calls of two-call commands
	after      snapshot
	patternErr error // a live allocation's bytes changed
}

func (sys *propSystem) begin() *stepResult { return &stepResult{before: sys.snapshot()} }

func (sys *propSystem) end(r *stepResult) *stepResult {
	r.after = sys.snapshot()
	if sys.spec.hostMemory {
		r.patternErr = sys.verifyPatterns()
	}
	return r
}

func (sys *propSystem) liveBytes() int {
	n := 0
	for _, h := range sys.handles {
		if h.size > 0 {
			n += roundUp(h.size)
		}
	}
	return n
}

// patternUnit returns the 64-byte period of allocation tag's pattern.
func patternUnit(tag int) []byte {
	u := make([]byte, 64)
	x := uint64(tag)*0x9e3779b97f4a7c15 + 0x632be59bd9b4e019
	for i := 0; i < 64; i += 8 {
		// splitmix64
		x += 0x9e3779b97f4a7c15
		z := x
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
		z = (z ^ (z >> 27)) * 0x94d049bb133111eb
		z ^= z >> 31
		for j := range 8 {
			u[i+j] = byte(z >> (8 * j))
		}
	}
	return u
}

const patternChunk = 64 * kiB

func (sys *propSystem) writePattern(tag int, h *propHandle) {
	if h.size == 0 {
		return
	}
	h.pattern = bytes.Repeat(patternUnit(tag), min(patternChunk, roundUp(h.size))/64)
	mem := hostBytes(h.ptr, h.size)
	for off := 0; off < len(mem); off += len(h.pattern) {
		copy(mem[off:], h.pattern)
	}
}

func (sys *propSystem) verifyPatterns() error {
	tags := make([]int, 0, len(sys.handles))
	for tag := range sys.handles {
		tags = append(tags, tag)
	}
	sort.Ints(tags)
	for _, tag := range tags {
		h := sys.handles[tag]
		if h.size == 0 {
			continue
		}
		mem := hostBytes(h.ptr, h.size)
		for off := 0; off < len(mem); off += len(h.pattern) {
			chunk := mem[off:min(len(mem), off+len(h.pattern))]
			if !bytes.Equal(chunk, h.pattern[:len(chunk)]) {
				for i := range chunk {
					if chunk[i] != h.pattern[i] {
						return fmt.Errorf("allocation #%d (%#x, %d bytes): byte %d is %#02x, its pattern says %#02x (overwritten by another allocation?)",
							tag, uintptr(h.ptr), h.size, off+i, chunk[i], h.pattern[i])
					}
				}
			}
		}
	}
	return nil
}

// ---------------------------------------------------------------------------------------------
// Commands.

// allocCmd allocates size bytes on a stream; the model calls the allocation #tag.
type allocCmd struct{ tag, size, stream int }

func (c allocCmd) String() string { return fmt.Sprintf("Alloc#%d(%d, s%d)", c.tag, c.size, c.stream) }

func (c allocCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*propSystem)
	r := sys.begin()
	r.ptr, r.err = sys.mr.Allocate(c.size, sys.views[c.stream])
	r.nbytes = c.size
	if r.err == nil {
		h := &propHandle{ptr: r.ptr, size: c.size, stream: c.stream}
		sys.handles[c.tag] = h
		if sys.spec.hostMemory && c.size > 0 && r.ptr != 0 {
			sys.writePattern(c.tag, h)
		}
		sys.cov.allocs.Add(1)
	} else if errors.Is(r.err, ErrOutOfMemory) {
		sys.cov.oom.Add(1)
	}
	return sys.end(r)
}

func (c allocCmd) NextState(s commands.State) commands.State {
	st := s.(*propState).clone()
	st.allocs = append(st.allocs, modelAlloc{tag: c.tag, size: c.size, stream: c.stream})
	st.nextTag = max(st.nextTag, c.tag+1)
	return st
}

func (c allocCmd) PreCondition(s commands.State) bool {
	st := s.(*propState)
	return st.find(c.tag) < 0 && c.stream <= st.cfg.Streams
}

func (c allocCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*propState), res.(*stepResult)
	a := &st.allocs[st.find(c.tag)]
	n := roundUp(c.size)
	var err error
	switch {
	case r.err == nil:
		a.status, a.ptr = allocLive, r.ptr
		if c.size == 0 && r.ptr != 0 {
			err = fmt.Errorf("zero-byte allocation returned %#x, want 0", uintptr(r.ptr))
		} else if c.size > 0 && r.ptr == 0 {
			err = errors.New("allocation returned a nil pointer and no error")
		}
	case errors.Is(r.err, ErrOutOfMemory):
		a.status = allocFailed
		_, _, live := st.live()
		switch {
		case c.size == 0:
			err = fmt.Errorf("zero-byte allocation failed: %v", r.err)
		case !st.spec.canRunOut(st.cfg) && n+live <= st.spec.limit(st.cfg):
			err = fmt.Errorf("out of memory where the resource cannot run out (%d bytes live): %v", live, r.err)
		case st.spec.hasStats && r.before.stats.LargestFreeBlock >= n:
			err = fmt.Errorf("out of memory although a free block of %d bytes fits: %v", r.before.stats.LargestFreeBlock, r.err)
		default:
			err = unchangedAccounting(r.before, r.after)
		}
	default:
		a.status = allocFailed
		err = fmt.Errorf("unexpected error: %v", r.err)
	}
	return postCheck(c, st, r, err)
}

// freeCmd frees allocation #tag on a stream: its own, or another.
type freeCmd struct{ tag, stream int }

func (c freeCmd) String() string { return fmt.Sprintf("Free#%d(s%d)", c.tag, c.stream) }

func (c freeCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*propSystem)
	h := sys.handles[c.tag]
	if h == nil {
		return &stepResult{skipped: true}
	}
	r := sys.begin()
	r.err = sys.mr.Deallocate(h.ptr, h.size, sys.views[c.stream])
	if r.err == nil {
		delete(sys.handles, c.tag)
		if c.stream != h.stream {
			sys.cov.crossFrees.Add(1)
		}
	}
	return sys.end(r)
}

func (c freeCmd) NextState(s commands.State) commands.State {
	st := s.(*propState).clone()
	st.remove(c.tag)
	return st
}

func (c freeCmd) PreCondition(s commands.State) bool {
	st := s.(*propState)
	return st.find(c.tag) >= 0 && c.stream <= st.cfg.Streams
}

func (c freeCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*propState), res.(*stepResult)
	if r.skipped {
		return &gopter.PropResult{Status: gopter.PropTrue}
	}
	var err error
	if r.err != nil {
		err = fmt.Errorf("free failed: %v", r.err)
	}
	return postCheck(c, st, r, err)
}

// zeroCmd allocates and frees zero bytes on a stream: (0, nil), then nil, nothing changes.
type zeroCmd struct{ stream int }

func (c zeroCmd) String() string { return fmt.Sprintf("Zero(s%d)", c.stream) }

func (c zeroCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*propSystem)
	r := sys.begin()
	r.ptr, r.err = sys.mr.Allocate(0, sys.views[c.stream])
	r.err2 = sys.mr.Deallocate(0, 0, sys.views[c.stream])
	return sys.end(r)
}

func (c zeroCmd) NextState(s commands.State) commands.State { return s }

func (c zeroCmd) PreCondition(s commands.State) bool {
	return c.stream <= s.(*propState).cfg.Streams
}

func (c zeroCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*propState), res.(*stepResult)
	var err error
	switch {
	case r.err != nil || r.ptr != 0:
		err = fmt.Errorf("Allocate(0) = (%#x, %v), want (0, nil)", uintptr(r.ptr), r.err)
	case r.err2 != nil:
		err = fmt.Errorf("Deallocate(0, 0) = %v, want nil", r.err2)
	default:
		err = unchangedAll(r.before, r.after)
	}
	return postCheck(c, st, r, err)
}

// Kinds of invalid free.
const (
	badInterior   = iota // a pointer inside a live allocation
	badNotHanded         // a pointer the resource did not hand out
	badWrongSize         // a live pointer with another size
	badDoubleFree        // a valid free, then the same again
)

// badFreeCmd frees something invalid and expects ErrInvalidFree and no change. tag names the
// live allocation involved (not for badNotHanded); x parameterises the offset, address or size.
type badFreeCmd struct {
	kind, tag, stream int
	x                 uint32
}

func (c badFreeCmd) String() string {
	switch c.kind {
	case badInterior:
		return fmt.Sprintf("FreeInterior#%d(x%d, s%d)", c.tag, c.x, c.stream)
	case badNotHanded:
		return fmt.Sprintf("FreeNotHandedOut(x%d, s%d)", c.x, c.stream)
	case badWrongSize:
		return fmt.Sprintf("FreeWrongSize#%d(x%d, s%d)", c.tag, c.x, c.stream)
	default:
		return fmt.Sprintf("DoubleFree#%d(s%d)", c.tag, c.stream)
	}
}

// wrongSize returns a size other than size, chosen by x.
func wrongSize(size int, x uint32) int {
	var w int
	switch x % 5 {
	case 0:
		w = size + 1
	case 1:
		w = size - 1
	case 2:
		w = size + Alignment
	case 3:
		w = roundUp(size) // the same once rounded, unless already a multiple
	default:
		w = 0
	}
	if w == size {
		w = size + 1
	}
	return w
}

// notHandedOut returns an address that is not the start of a live allocation: a small one no
// resource hands out, or, chosen by x, the start or the last 256 bytes of an upstream block.
func (sys *propSystem) notHandedOut(x uint32) DevicePtr {
	live := map[DevicePtr]bool{}
	for _, h := range sys.handles {
		live[h.ptr] = true
	}
	blocks, _ := sys.up.blocks()
	if x%3 != 0 && len(blocks) > 0 {
		b := blocks[int(x/3)%len(blocks)]
		for _, p := range []DevicePtr{b.addr + DevicePtr(AlignDown(b.size-1, Alignment)), b.addr} {
			if !live[p] {
				return p
			}
		}
	}
	return DevicePtr(4096 + Alignment*int(x%16))
}

func (c badFreeCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*propSystem)
	s := sys.views[c.stream]
	var h *propHandle
	if c.kind != badNotHanded {
		if h = sys.handles[c.tag]; h == nil {
			return &stepResult{skipped: true}
		}
	}
	r := sys.begin()
	switch c.kind {
	case badInterior:
		off := 1 + int(c.x)%(roundUp(h.size)-1)
		r.ptr, r.nbytes = h.ptr+DevicePtr(off), h.size
		r.err = sys.mr.Deallocate(r.ptr, r.nbytes, s)
	case badNotHanded:
		r.ptr, r.nbytes = sys.notHandedOut(c.x), Alignment*(1+int(c.x%4))
		r.err = sys.mr.Deallocate(r.ptr, r.nbytes, s)
	case badWrongSize:
		r.ptr, r.nbytes = h.ptr, wrongSize(h.size, c.x)
		r.err = sys.mr.Deallocate(r.ptr, r.nbytes, s)
	case badDoubleFree:
		r.ptr, r.nbytes = h.ptr, h.size
		r.err = sys.mr.Deallocate(h.ptr, h.size, s)
		if r.err == nil {
			delete(sys.handles, c.tag)
		}
		r.mid = sys.snapshot()
		r.err2 = sys.mr.Deallocate(h.ptr, h.size, sys.views[(c.stream+int(c.x))%len(sys.views)])
	}
	sys.cov.invalidFrees.Add(1)
	return sys.end(r)
}

func (c badFreeCmd) NextState(s commands.State) commands.State {
	if c.kind != badDoubleFree {
		return s
	}
	st := s.(*propState).clone()
	st.remove(c.tag)
	return st
}

func (c badFreeCmd) PreCondition(s commands.State) bool {
	st := s.(*propState)
	if !st.spec.detectsInvalidFree || c.stream > st.cfg.Streams {
		return false
	}
	if c.kind == badNotHanded {
		return true
	}
	i := st.find(c.tag)
	return i >= 0 && st.allocs[i].size > 0
}

func (c badFreeCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*propState), res.(*stepResult)
	if r.skipped {
		return &gopter.PropResult{Status: gopter.PropTrue}
	}
	var err error
	call := fmt.Sprintf("Deallocate(%#x, %d)", uintptr(r.ptr), r.nbytes)
	if c.kind == badDoubleFree {
		switch {
		case r.err != nil:
			err = fmt.Errorf("first free failed: %v", r.err)
		case !errors.Is(r.err2, ErrInvalidFree):
			err = fmt.Errorf("second %s = %v, want ErrInvalidFree", call, r.err2)
		default:
			err = unchangedAll(r.mid, r.after)
		}
	} else {
		if !errors.Is(r.err, ErrInvalidFree) {
			err = fmt.Errorf("%s = %v, want ErrInvalidFree", call, r.err)
		} else {
			err = unchangedAll(r.before, r.after)
		}
	}
	return postCheck(c, st, r, err)
}

// tooBigCmd asks for more than can ever be live beside what is: limit - live + extra bytes.
type tooBigCmd struct{ extra, stream int }

func (c tooBigCmd) String() string { return fmt.Sprintf("AllocTooBig(+%d, s%d)", c.extra, c.stream) }

func (c tooBigCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*propSystem)
	r := sys.begin()
	r.nbytes = sys.spec.limit(sys.cfg) - sys.liveBytes() + c.extra
	r.ptr, r.err = sys.mr.Allocate(r.nbytes, sys.views[c.stream])
	if r.err == nil {
		// Wrong; give it back so that the model stays in step, and report.
		r.err2 = sys.mr.Deallocate(r.ptr, r.nbytes, sys.views[c.stream])
	} else {
		sys.cov.oom.Add(1)
	}
	return sys.end(r)
}

func (c tooBigCmd) NextState(s commands.State) commands.State { return s }

func (c tooBigCmd) PreCondition(s commands.State) bool {
	return c.stream <= s.(*propState).cfg.Streams
}

func (c tooBigCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*propState), res.(*stepResult)
	var err error
	if !errors.Is(r.err, ErrOutOfMemory) {
		err = fmt.Errorf("Allocate(%d) beyond the limit of %d = (%#x, %v), want ErrOutOfMemory", r.nbytes, st.spec.limit(st.cfg), uintptr(r.ptr), r.err)
	} else {
		err = unchangedAccounting(r.before, r.after)
	}
	return postCheck(c, st, r, err)
}

// releaseCmd calls Release, after freeing every live allocation when all is set (on its own
// stream, or on stream tag%streams when mixed is set).
type releaseCmd struct{ all, mixed bool }

func (c releaseCmd) String() string {
	switch {
	case c.all && c.mixed:
		return "FreeAllMixedStreams+Release"
	case c.all:
		return "FreeAll+Release"
	}
	return "Release"
}

func (c releaseCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*propSystem)
	r := sys.begin()
	if c.all {
		tags := make([]int, 0, len(sys.handles))
		for tag := range sys.handles {
			tags = append(tags, tag)
		}
		sort.Ints(tags)
		for _, tag := range tags {
			h := sys.handles[tag]
			s := h.stream
			if c.mixed {
				s = tag % len(sys.views)
			}
			if err := sys.mr.Deallocate(h.ptr, h.size, sys.views[s]); err != nil {
				r.err = fmt.Errorf("freeing #%d: %w", tag, err)
				break
			}
			delete(sys.handles, tag)
		}
	}
	if r.err == nil {
		r.err2 = sys.mr.(Releaser).Release()
		if n, _ := sys.up.held(); r.err2 == nil && n == 0 && len(sys.handles) == 0 {
			sys.cov.releasesToZero.Add(1)
		}
	}
	return sys.end(r)
}

func (c releaseCmd) NextState(s commands.State) commands.State {
	if !c.all {
		return s
	}
	st := s.(*propState).clone()
	st.allocs = nil
	return st
}

func (c releaseCmd) PreCondition(s commands.State) bool { return true }

func (c releaseCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*propState), res.(*stepResult)
	var err error
	switch {
	case r.err != nil:
		err = r.err
	case r.err2 != nil:
		err = fmt.Errorf("Release: %v", r.err2)
	default:
		err = releasedEverythingFree(st, r.after)
	}
	return postCheck(c, st, r, err)
}

// releasedEverythingFree checks the state after Release: every upstream block still held
// contains a live allocation (so with nothing live, nothing is held).
func releasedEverythingFree(st *propState, after snapshot) error {
	if st.spec.keepsUpstream {
		return nil
	}
	live, count, _ := st.live()
	if count == 0 {
		if len(after.upstream) != 0 || (st.spec.hasStats && after.stats.PoolSize != 0) {
			return fmt.Errorf("nothing live, yet after Release the pool holds %d bytes in %d upstream blocks", after.stats.PoolSize, len(after.upstream))
		}
		return nil
	}
	for _, b := range after.upstream {
		used := false
		for _, a := range live {
			if a.size > 0 && a.ptr >= b.addr && a.ptr < b.addr+DevicePtr(b.size) {
				used = true
				break
			}
		}
		if !used {
			return fmt.Errorf("after Release the wholly free upstream block %#x (%d bytes) is still held", uintptr(b.addr), b.size)
		}
	}
	return nil
}

// unchangedAll checks that a failed call changed nothing: statistics, invariants, upstream.
func unchangedAll(before, after snapshot) error {
	if !reflect.DeepEqual(before.stats, after.stats) {
		return fmt.Errorf("a failed call changed Stats: %+v -> %+v", before.stats, after.stats)
	}
	return unchangedUpstream(before, after)
}

// unchangedAccounting is unchangedAll for a failed allocation, which may rearrange the free
// lists (a pool merges other streams' lists before it grows) and may give wholly free memory
// back to its upstream before it fails (a pool does so before it gives up), but must not change
// the live figures, nor hold anything it did not hold before.
func unchangedAccounting(before, after snapshot) error {
	b, a := before.stats, after.stats
	if b.LiveBytes != a.LiveBytes || b.LiveAllocations != a.LiveAllocations || b.MaximumPoolSize != a.MaximumPoolSize ||
		a.PoolSize > b.PoolSize || a.PoolSize-a.FreeBytes != b.PoolSize-b.FreeBytes {
		return fmt.Errorf("a failed allocation changed Stats: %+v -> %+v", b, a)
	}
	if a.PoolSize == b.PoolSize && a.UpstreamBlocks == b.UpstreamBlocks {
		return unchangedUpstream(before, after)
	}
	if (before.invariants == nil) != (after.invariants == nil) {
		return fmt.Errorf("a failed call changed CheckInvariants: %v -> %v", before.invariants, after.invariants)
	}
	for _, x := range after.upstream {
		inside := false
		for _, y := range before.upstream {
			if y.addr <= x.addr && x.addr+DevicePtr(x.size) <= y.addr+DevicePtr(y.size) {
				inside = true
				break
			}
		}
		if !inside {
			return fmt.Errorf("a failed allocation took new upstream memory %v (held before: %v)", x, before.upstream)
		}
	}
	return nil
}

func unchangedUpstream(before, after snapshot) error {
	if (before.invariants == nil) != (after.invariants == nil) {
		return fmt.Errorf("a failed call changed CheckInvariants: %v -> %v", before.invariants, after.invariants)
	}
	if !slices.Equal(before.upstream, after.upstream) {
		return fmt.Errorf("a failed call changed the upstream blocks held: %v -> %v", before.upstream, after.upstream)
	}
	return nil
}

// postCheck returns the property's verdict on a step: the command's own check (opErr), then the
// checks made after every step.
func postCheck(c commands.Command, st *propState, r *stepResult, opErr error) *gopter.PropResult {
	err := opErr
	if err == nil {
		err = checkStep(st, r)
	}
	if err != nil {
		return &gopter.PropResult{Status: gopter.PropFalse, Labels: []string{fmt.Sprintf("after %v: %v", c, err)}}
	}
	return &gopter.PropResult{Status: gopter.PropTrue}
}

// checkStep compares the system after a step with the model.
func checkStep(st *propState, r *stepResult) error {
	a := r.after
	if a.invariants != nil {
		return fmt.Errorf("CheckInvariants: %v", a.invariants)
	}
	if a.upErr != nil {
		return fmt.Errorf("upstream misused: %v", a.upErr)
	}
	if r.patternErr != nil {
		return r.patternErr
	}
	live, count, liveBytes := st.live()
	var spans []modelAlloc
	for _, x := range live {
		switch {
		case x.size == 0 && x.ptr != 0:
			return fmt.Errorf("zero-byte allocation #%d has pointer %#x", x.tag, uintptr(x.ptr))
		case x.size == 0:
			continue
		case x.ptr == 0:
			return fmt.Errorf("allocation #%d of %d bytes has a nil pointer", x.tag, x.size)
		case x.ptr%Alignment != 0:
			return fmt.Errorf("allocation #%d at %#x is not 256-aligned", x.tag, uintptr(x.ptr))
		}
		spans = append(spans, x)
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].ptr < spans[j].ptr })
	for i, x := range spans {
		end := x.ptr + DevicePtr(roundUp(x.size))
		if i+1 < len(spans) && spans[i+1].ptr < end {
			y := spans[i+1]
			return fmt.Errorf("allocations #%d [%#x, %#x) and #%d at %#x overlap", x.tag, uintptr(x.ptr), uintptr(end), y.tag, uintptr(y.ptr))
		}
		// The upstream block holding x: the last one starting at or below x.ptr.
		k := sort.Search(len(a.upstream), func(k int) bool { return a.upstream[k].addr > x.ptr }) - 1
		if k < 0 || end > a.upstream[k].addr+DevicePtr(a.upstream[k].size) {
			return fmt.Errorf("allocation #%d [%#x, %#x) is not inside one upstream block (held: %v)", x.tag, uintptr(x.ptr), uintptr(end), a.upstream)
		}
	}
	if !st.spec.hasStats {
		return nil
	}
	s := a.stats
	held := 0
	for _, b := range a.upstream {
		held += b.size
	}
	switch {
	case s.LiveAllocations != count || s.LiveBytes != liveBytes:
		return fmt.Errorf("Stats: %d live allocations of %d bytes, model %d of %d", s.LiveAllocations, s.LiveBytes, count, liveBytes)
	case s.PoolSize != held || (s.UpstreamBlocks != len(a.upstream) && !st.spec.mergedUpstream):
		return fmt.Errorf("Stats: pool size %d in %d upstream blocks, the upstream handed out %d in %d", s.PoolSize, s.UpstreamBlocks, held, len(a.upstream))
	case a.poolSize >= 0 && a.poolSize != s.PoolSize:
		return fmt.Errorf("PoolSize() = %d, Stats().PoolSize = %d", a.poolSize, s.PoolSize)
	case s.FreeBytes != s.PoolSize-s.LiveBytes:
		return fmt.Errorf("Stats: free bytes %d != pool size %d - live bytes %d", s.FreeBytes, s.PoolSize, s.LiveBytes)
	case st.spec.hasMaximum && s.MaximumPoolSize != st.cfg.MaximumPoolSize:
		return fmt.Errorf("Stats: maximum %d, configured %d", s.MaximumPoolSize, st.cfg.MaximumPoolSize)
	case st.spec.hasMaximum && st.cfg.MaximumPoolSize > 0 && s.PoolSize > st.cfg.MaximumPoolSize:
		return fmt.Errorf("pool size %d exceeds the maximum %d", s.PoolSize, st.cfg.MaximumPoolSize)
	case s.LargestFreeBlock > s.FreeBytes:
		return fmt.Errorf("Stats: largest free block %d > free bytes %d", s.LargestFreeBlock, s.FreeBytes)
	}
	return nil
}

// ---------------------------------------------------------------------------------------------
// Generation and shrinking.

func newPropCommands(spec *conformanceSpec, cov *propCoverage) *commands.ProtoCommands {
	return &commands.ProtoCommands{
		NewSystemUnderTestFunc: func(initial commands.State) commands.SystemUnderTest {
			st := initial.(*propState)
			return newPropSystem(spec, st.cfg, cov)
		},
		DestroySystemUnderTestFunc: func(sut commands.SystemUnderTest) { sut.(*propSystem).destroy() },
		InitialStateGen: func(p *gopter.GenParameters) *gopter.GenResult {
			return gopter.NewGenResult(&propState{spec: spec, cfg: spec.genConfig(p.Rng)}, gopter.NoShrinker)
		},
		GenCommandFunc: func(s commands.State) gopter.Gen {
			st := s.(*propState)
			return func(p *gopter.GenParameters) *gopter.GenResult {
				return gopter.NewGenResult(drawCommand(p.Rng, st), shrinkCommand)
			}
		},
	}
}

// drawCommand draws a command that is valid in state st.
func drawCommand(r *rand.Rand, st *propState) commands.Command {
	spec, nviews := st.spec, st.cfg.Streams+1
	stream := func() int { return r.Intn(nviews) }
	pick := func(sized bool) (modelAlloc, bool) {
		var c []modelAlloc
		for _, a := range st.allocs {
			if !sized || a.size > 0 {
				c = append(c, a)
			}
		}
		if len(c) == 0 {
			return modelAlloc{}, false
		}
		return c[r.Intn(len(c))], true
	}
	type choice struct {
		weight int
		make   func() commands.Command
	}
	choices := []choice{
		{30, func() commands.Command { return allocCmd{st.nextTag, spec.size(r, st.cfg), stream()} }},
		{2, func() commands.Command { return zeroCmd{stream()} }},
		{2, func() commands.Command { return tooBigCmd{1 + r.Intn(2*Alignment), stream()} }},
		{2, func() commands.Command { return releaseCmd{} }},
	}
	if len(st.allocs) > 0 {
		a, _ := pick(false)
		other := (a.stream + 1 + r.Intn(nviews-1)) % nviews
		choices = append(choices,
			choice{22, func() commands.Command { return freeCmd{tag: a.tag, stream: a.stream} }},
			choice{8, func() commands.Command { return freeCmd{tag: a.tag, stream: other} }},
			choice{2, func() commands.Command { return releaseCmd{all: true, mixed: r.Intn(2) == 0} }},
		)
	}
	if spec.detectsInvalidFree {
		choices = append(choices, choice{2, func() commands.Command {
			return badFreeCmd{kind: badNotHanded, stream: stream(), x: r.Uint32()}
		}})
		if a, ok := pick(true); ok {
			choices = append(choices, choice{6, func() commands.Command {
				kinds := []int{badInterior, badWrongSize, badDoubleFree}
				return badFreeCmd{kind: kinds[r.Intn(len(kinds))], tag: a.tag, stream: stream(), x: r.Uint32()}
			}})
		}
	}
	total := 0
	for _, c := range choices {
		total += c.weight
	}
	k := r.Intn(total)
	for _, c := range choices {
		if k < c.weight {
			return c.make()
		}
		k -= c.weight
	}
	panic("unreachable")
}

// shrinkCommand offers simpler versions of a command: smaller sizes, the default stream.
func shrinkCommand(v interface{}) gopter.Shrink {
	var cands []interface{}
	switch c := v.(type) {
	case allocCmd:
		for _, n := range []int{1, Alignment, c.size / 2} {
			if n > 0 && n < c.size {
				d := c
				d.size = n
				cands = append(cands, d)
			}
		}
		if c.stream != 0 {
			d := c
			d.stream = 0
			cands = append(cands, d)
		}
	case freeCmd:
		if c.stream != 0 {
			d := c
			d.stream = 0
			cands = append(cands, d)
		}
	case releaseCmd:
		if c.mixed {
			cands = append(cands, releaseCmd{all: true})
		}
	}
	i := 0
	return func() (interface{}, bool) {
		if i == len(cands) {
			return nil, false
		}
		i++
		return cands[i-1], true
	}
}

// ---------------------------------------------------------------------------------------------
// Running a property.

// propertySeed returns RMM_PROPERTY_SEED, or a fresh seed.
func propertySeed(t *testing.T) int64 {
	if s := os.Getenv("RMM_PROPERTY_SEED"); s != "" {
		seed, err := strconv.ParseInt(s, 10, 64)
		require.NoError(t, err, "RMM_PROPERTY_SEED")
		return seed
	}
	return time.Now().UnixNano()
}

func propertyScale(t *testing.T) int {
	if s := os.Getenv("RMM_PROPERTY_SCALE"); s != "" {
		k, err := strconv.Atoi(s)
		require.NoError(t, err, "RMM_PROPERTY_SCALE")
		require.Positive(t, k, "RMM_PROPERTY_SCALE")
		return k
	}
	return 1
}

// runConformance checks spec's state machine on sequences of up to maxCommands commands and
// returns what they exercised. On failure it reports the shrunk sequence and the seed.
func runConformance(t *testing.T, spec *conformanceSpec, sequences, maxCommands int) *propCoverage {
	t.Helper()
	seed := propertySeed(t)
	t.Logf("seed %d (replay with RMM_PROPERTY_SEED=%d)", seed, seed)
	params := gopter.DefaultTestParametersWithSeed(seed)
	params.MinSuccessfulTests = sequences * propertyScale(t)
	params.MinSize = 1
	params.MaxSize = maxCommands
	params.MaxShrinkCount = 2000
	cov := &propCoverage{}
	props := gopter.NewProperties(params)
	props.Property(spec.name, commands.Prop(newPropCommands(spec, cov)))
	var out bytes.Buffer
	if !props.Run(gopter.NewFormatedReporter(true, 160, &out)) {
		t.Fatalf("%s\nseed %d: replay with RMM_PROPERTY_SEED=%d go test -race -run '^%s$'", out.String(), seed, seed, t.Name())
	}
	t.Log(strings.TrimSpace(out.String()))
	require.Zero(t, cov.leaks.Load(), "Close left upstream memory held")
	return cov
}

// logUniform returns a size in [lo, hi) drawn uniformly in log scale.
func logUniform(r *rand.Rand, lo, hi int) int {
	e := math.Log2(float64(lo)) + r.Float64()*(math.Log2(float64(hi))-math.Log2(float64(lo)))
	return max(lo, min(hi-1, int(math.Exp2(e))))
}

// smallSize draws from the mix every instance shares: 0, 1..300, multiples of 256 up to 64 KiB,
// anything up to 64 KiB.
func smallSize(r *rand.Rand) int {
	switch k := r.Intn(100); {
	case k < 4:
		return 0
	case k < 45:
		return 1 + r.Intn(300)
	case k < 75:
		return Alignment * (1 + r.Intn(256))
	default:
		return 1 + r.Intn(64*kiB)
	}
}

func newPool(up MemoryResource, cfg resourceConfig) (MemoryResource, error) {
	return NewPoolMemoryResource(up, &PoolOptions{InitialPoolSize: cfg.InitialPoolSize, MaximumPoolSize: cfg.MaximumPoolSize})
}

// poolSpec fills in what every pool instance shares.
func poolSpec(s conformanceSpec) *conformanceSpec {
	s.newResource = newPool
	s.detectsInvalidFree, s.hasInvariants, s.hasStats, s.hasMaximum = true, true, true, true
	return &s
}

// alignedUpTo draws a multiple of 256 in [lo, hi] (lo, hi multiples of 256).
func alignedUpTo(r *rand.Rand, lo, hi int) int {
	return lo + Alignment*int(r.Int63n(int64((hi-lo)/Alignment+1)))
}

// ---------------------------------------------------------------------------------------------
// The instances.

// Over real host memory: patterns in every byte catch overlaps in memory.
func TestPoolPropertySystem(t *testing.T) {
	spec := poolSpec(conformanceSpec{
		name: "pool over SystemMemoryResource",
		genConfig: func(r *rand.Rand) resourceConfig {
			c := resourceConfig{Streams: 3 + r.Intn(2)}
			if r.Intn(2) == 0 {
				c.InitialPoolSize = alignedUpTo(r, Alignment, 4*miB)
			}
			if r.Intn(4) == 0 {
				c.MaximumPoolSize = alignedUpTo(r, max(c.InitialPoolSize, Alignment), c.InitialPoolSize+8*miB)
			}
			return c
		},
		newUpstream: func(resourceConfig) MemoryResource { return NewSystemMemoryResource() },
		size: func(r *rand.Rand, _ resourceConfig) int {
			if r.Intn(12) == 0 {
				return logUniform(r, 64*kiB, 4*miB+1)
			}
			return smallSize(r)
		},
		// More than the 47-bit user address space (and more than a Go slice may be): a request
		// beyond it fails in malloc rather than after exhausting the machine.
		capacity:   1 << 49,
		hostMemory: true,
	})
	cov := runConformance(t, spec, 300, 120)
	require.Positive(t, cov.allocs.Load())
	require.Positive(t, cov.crossFrees.Load())
	require.Positive(t, cov.invalidFrees.Load())
	require.Positive(t, cov.oom.Load())
}

// Over an address-only upstream of 100 GiB: initial pools up to 100 GiB, maximums, allocations
// of tens of GiB, so growth runs into the upstream's capacity and the maximum.
func TestPoolPropertySimulated(t *testing.T) {
	const capacity = 100 * giB
	spec := poolSpec(conformanceSpec{
		name: "pool over a 100 GiB address-only upstream",
		genConfig: func(r *rand.Rand) resourceConfig {
			c := resourceConfig{Streams: 3 + r.Intn(2)}
			switch r.Intn(3) {
			case 0:
			case 1:
				c.InitialPoolSize = alignedUpTo(r, Alignment, capacity)
			default:
				c.InitialPoolSize = roundUp(logUniform(r, 1*miB, capacity))
			}
			if r.Intn(3) == 0 {
				c.MaximumPoolSize = alignedUpTo(r, max(c.InitialPoolSize, Alignment), capacity)
			}
			return c
		},
		newUpstream: func(resourceConfig) MemoryResource {
			sim, _ := NewSimulatedMemoryResource(capacity)
			return sim
		},
		size: func(r *rand.Rand, _ resourceConfig) int {
			switch r.Intn(10) {
			case 0, 1:
				return logUniform(r, 64*kiB, 40*giB)
			case 2:
				return giB * (1 + r.Intn(40))
			}
			return smallSize(r)
		},
		capacity:  capacity,
		mayRunOut: true,
	})
	cov := runConformance(t, spec, 800, 120)
	require.Positive(t, cov.oom.Load())
	require.Positive(t, cov.releasesToZero.Load())
	require.Positive(t, cov.upstreamRefusals.Load(), "growth never ran into the upstream's capacity")
}

// Over an upstream that grants only a few KiB to a MiB in all (the limiting adaptor of librmm's
// tests): growth fails, the halving back-off runs, maximums are small.
func TestPoolPropertyCappedUpstream(t *testing.T) {
	spec := poolSpec(conformanceSpec{
		name: "pool over a capped upstream",
		genConfig: func(r *rand.Rand) resourceConfig {
			c := resourceConfig{Streams: 3 + r.Intn(2)}
			c.UpstreamLimit = logUniform(r, 2*kiB, 1*miB)
			if r.Intn(3) == 0 {
				c.InitialPoolSize = alignedUpTo(r, Alignment, AlignDown(c.UpstreamLimit/2, Alignment))
			}
			if r.Intn(2) == 0 {
				c.MaximumPoolSize = alignedUpTo(r, max(c.InitialPoolSize, Alignment), 2*c.UpstreamLimit)
			}
			return c
		},
		newUpstream: func(cfg resourceConfig) MemoryResource { return newLimitedUpstream(cfg.UpstreamLimit) },
		size: func(r *rand.Rand, cfg resourceConfig) int {
			if r.Intn(4) == 0 {
				return 1 + r.Intn(cfg.UpstreamLimit)
			}
			return smallSize(r) % (cfg.UpstreamLimit/2 + 1)
		},
		capacity: 1 << 60,
	})
	cov := runConformance(t, spec, 800, 120)
	require.Positive(t, cov.oom.Load())
	require.Positive(t, cov.upstreamRefusals.Load(), "growth never failed")
	require.Positive(t, cov.backoffGrants.Load(), "the halving back-off never succeeded")
}

// Found by TestPoolPropertyCappedUpstream, shrunk to: maximum 1280 bytes, Alloc(1), Alloc(628).
// Growing by half the headroom unaligned (640 bytes) and then rounding the headroom left up to 256
// took the pool to 1408 bytes, past its maximum. Growth under a maximum now stays on the 256-byte
// grid: 512 bytes first, then the 768 that exactly reach the maximum.
func TestPoolGrowthKeepsToMaximum(t *testing.T) {
	p, sim := newSimPool(t, 1<<30, &PoolOptions{MaximumPoolSize: 1280})
	_, err := p.Allocate(1, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, 512, p.PoolSize(), "grown by half the headroom, rounded down to 256")
	_, err = p.Allocate(628, DefaultStream)
	require.NoError(t, err, "768 bytes: 256 are free and 768 left below the maximum")
	require.Equal(t, 1280, p.PoolSize())
	require.LessOrEqual(t, sim.UsedBytes(), 1280)
	_, err = p.Allocate(257, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory, "512 bytes: 256 are free and the pool is at its maximum")
	_, err = p.Allocate(256, DefaultStream)
	require.NoError(t, err, "the last 256 bytes")
	require.NoError(t, p.CheckInvariants())
}

// ---------------------------------------------------------------------------------------------
// The recording upstream.

type upstreamBlock struct {
	addr DevicePtr
	size int
}

func (b upstreamBlock) String() string { return fmt.Sprintf("[%#x+%d]", uintptr(b.addr), b.size) }

// recordingUpstream passes calls to inner and records the blocks handed out and not yet taken
// back, the refusals, and the refusals followed by a smaller request that was granted (the
// pool's back-off). A free of a block it did not hand out, or with another size, is recorded as
// misuse and refused.
type recordingUpstream struct {
	inner MemoryResource

	mu          sync.Mutex
	live        map[DevicePtr]int
	misuse      error
	refused     int
	backoff     int
	lastRefused int // size of the last refused request, 0 after a grant
}

func newRecordingUpstream(inner MemoryResource) *recordingUpstream {
	return &recordingUpstream{inner: inner, live: map[DevicePtr]int{}}
}

func (u *recordingUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	p, err := u.inner.Allocate(n, s)
	u.mu.Lock()
	defer u.mu.Unlock()
	if err != nil {
		u.refused++
		u.lastRefused = n
		return 0, err
	}
	if n > 0 {
		if _, dup := u.live[p]; dup && u.misuse == nil {
			u.misuse = fmt.Errorf("the upstream handed out %#x twice", uintptr(p))
		}
		u.live[p] = n
	}
	if u.lastRefused > n {
		u.backoff++
	}
	u.lastRefused = 0
	return p, nil
}

func (u *recordingUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	if p != 0 {
		u.mu.Lock()
		size, ok := u.live[p]
		if !ok || size != n {
			err := fmt.Errorf("%w: recording upstream: Deallocate(%#x, %d): handed out with size %d (0: not handed out)", ErrInvalidFree, uintptr(p), n, size)
			if u.misuse == nil {
				u.misuse = err
			}
			u.mu.Unlock()
			return err
		}
		delete(u.live, p)
		u.mu.Unlock()
	}
	return u.inner.Deallocate(p, n, s)
}

func (u *recordingUpstream) Access() Access { return AccessOf(u.inner) }

// blocks returns the blocks held, in address order, and the first misuse seen.
func (u *recordingUpstream) blocks() ([]upstreamBlock, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	bs := make([]upstreamBlock, 0, len(u.live))
	for p, n := range u.live {
		bs = append(bs, upstreamBlock{p, n})
	}
	sort.Slice(bs, func(i, j int) bool { return bs[i].addr < bs[j].addr })
	return bs, u.misuse
}

// held returns the bytes and blocks held.
func (u *recordingUpstream) held() (nbytes, count int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, n := range u.live {
		nbytes += n
	}
	return nbytes, len(u.live)
}

func (u *recordingUpstream) counts() (refused, backoff int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.refused, u.backoff
}

// ---------------------------------------------------------------------------------------------
// Concurrency.

// liveSet is the set of address ranges live at once across goroutines; a range is in it only
// between Allocate's return and the call to Deallocate, so any overlap is the resource's fault.
type liveSet struct {
	mu    sync.Mutex
	spans []upstreamBlock // sorted by address
}

func (l *liveSet) add(p DevicePtr, n int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	i := sort.Search(len(l.spans), func(i int) bool { return l.spans[i].addr >= p })
	if i < len(l.spans) && l.spans[i].addr < p+DevicePtr(n) {
		return fmt.Errorf("[%#x, +%d) overlaps live %v", uintptr(p), n, l.spans[i])
	}
	if i > 0 && l.spans[i-1].addr+DevicePtr(l.spans[i-1].size) > p {
		return fmt.Errorf("[%#x, +%d) overlaps live %v", uintptr(p), n, l.spans[i-1])
	}
	l.spans = slices.Insert(l.spans, i, upstreamBlock{p, n})
	return nil
}

func (l *liveSet) remove(p DevicePtr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	i := sort.Search(len(l.spans), func(i int) bool { return l.spans[i].addr >= p })
	l.spans = slices.Delete(l.spans, i, i+1)
}

// Eight goroutines allocate and free at random on their own streams, sometimes freeing on
// another goroutine's stream, while a ninth checks the pool's invariants; no two live ranges may
// ever overlap, and at the end everything coalesces and Release gives everything back.
func TestPoolPropertyConcurrent(t *testing.T) {
	const goroutines, ops = 8, 2000
	seed := propertySeed(t)
	t.Logf("seed %d (replay the draws with RMM_PROPERTY_SEED=%d; the interleaving differs)", seed, seed)
	sim, err := NewSimulatedMemoryResource(1 << 40)
	require.NoError(t, err)
	up := newRecordingUpstream(sim)
	p, err := NewPoolMemoryResource(up, &PoolOptions{InitialPoolSize: 4 * miB})
	require.NoError(t, err)
	views := make([]StreamView, goroutines)
	for i := range views {
		views[i] = mustStream(t)
	}
	var shadow liveSet
	var crossFrees, checks atomic.Int64
	done := make(chan struct{})
	checker := make(chan error, 1)
	go func() {
		var first error
		for first == nil {
			select {
			case <-done:
				checker <- nil
				return
			default:
			}
			if err := p.CheckInvariants(); err != nil {
				first = fmt.Errorf("CheckInvariants while running: %w", err)
			} else if st := p.Stats(); st.FreeBytes != st.PoolSize-st.LiveBytes {
				first = fmt.Errorf("Stats while running: %+v", st)
			}
			checks.Add(1)
			time.Sleep(100 * time.Microsecond) // leave the lock to the workers most of the time
		}
		<-done
		checker <- first
	}()
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := randv2.New(randv2.NewPCG(uint64(seed), uint64(g)))
			type alloc struct {
				ptr  DevicePtr
				size int
			}
			var mine []alloc
			free := func(i int) bool {
				a := mine[i]
				mine = slices.Delete(mine, i, i+1)
				s := views[g]
				if r.IntN(5) == 0 {
					s = views[(g+1+r.IntN(goroutines-1))%goroutines]
					crossFrees.Add(1)
				}
				shadow.remove(a.ptr)
				if err := p.Deallocate(a.ptr, a.size, s); err != nil {
					t.Errorf("goroutine %d: Deallocate(%#x, %d): %v", g, uintptr(a.ptr), a.size, err)
					return false
				}
				return true
			}
			for range ops {
				if len(mine) == 0 || (len(mine) < 64 && r.IntN(100) < 55) {
					var n int
					switch k := r.IntN(100); {
					case k < 40:
						n = 1 + r.IntN(300)
					case k < 75:
						n = Alignment * (1 + r.IntN(64))
					case k < 97:
						n = 1 + r.IntN(256*kiB)
					default:
						n = 1 + r.IntN(8*miB)
					}
					ptr, err := p.Allocate(n, views[g])
					if err != nil {
						t.Errorf("goroutine %d: Allocate(%d): %v", g, n, err)
						return
					}
					if ptr%Alignment != 0 {
						t.Errorf("goroutine %d: Allocate(%d) = %#x, not 256-aligned", g, n, uintptr(ptr))
						return
					}
					if err := shadow.add(ptr, roundUp(n)); err != nil {
						t.Errorf("goroutine %d: Allocate(%d): %v", g, n, err)
						return
					}
					mine = append(mine, alloc{ptr, n})
				} else if !free(r.IntN(len(mine))) {
					return
				}
			}
			for len(mine) > 0 {
				if !free(len(mine) - 1) {
					return
				}
			}
		}()
	}
	wg.Wait()
	close(done)
	require.NoError(t, <-checker)
	require.False(t, t.Failed())
	require.Positive(t, crossFrees.Load())
	require.Positive(t, checks.Load())

	require.NoError(t, p.CheckInvariants())
	st := p.Stats()
	require.Zero(t, st.LiveAllocations)
	require.Zero(t, st.LiveBytes)
	require.Equal(t, st.PoolSize, st.FreeBytes, "everything freed: free bytes equal the pool size")
	held, blocks := up.held()
	require.Equal(t, held, st.PoolSize)
	require.Equal(t, blocks, st.UpstreamBlocks)
	require.Greater(t, st.UpstreamBlocks, 1, "the pool grew while the goroutines ran")
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize(), "after Release nothing is held")
	held, blocks = up.held()
	require.Zero(t, held)
	require.Zero(t, blocks)
	_, misuse := up.blocks()
	require.NoError(t, misuse)
	require.NoError(t, p.CheckInvariants())
}
