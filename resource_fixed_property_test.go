// A gopter state-machine (commands) test of FixedSizeMemoryResource against a model.
//
// Random sequences allocate on the default stream and two Streams (sizes 0 to past the block),
// free on the allocating stream or another one (sometimes with a wrong size), free a pointer
// twice, free pointers never handed out, close one Stream, release, and close the resource. The
// model keeps the live allocations, which Streams are closed and whether the resource is. After
// every step: a call fails exactly when the model says so, with the error it names, and a failed
// call changes nothing; every live pointer is a distinct block of the resource; Stats counts the
// model's live blocks, the free blocks make up the rest of the chunks held (before Close), the
// upstream holds exactly the chunks, and CheckInvariants passes.
//
// RMM_PROPERTY_SEED and RMM_PROPERTY_SCALE work as for the pool's property tests.

package rmm

import (
	"errors"
	"fmt"
	"math/rand"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/commands"
	"github.com/stretchr/testify/require"
)

const (
	fxpBlock   = 4096
	fxpChunk   = 4 // blocks
	fxpStreams = 3 // 0: DefaultStream; 1, 2: Streams (2 may be closed)
)

type fxpAlloc struct{ tag, size, stream int }

type fxpState struct {
	nextTag      int
	live         []fxpAlloc
	freed        []int // tags freed, for double frees
	streamClosed bool  // stream 2
	closed       bool
}

func (st *fxpState) clone() *fxpState {
	c := *st
	c.live = slices.Clone(st.live)
	c.freed = slices.Clone(st.freed)
	return &c
}

func (st *fxpState) find(tag int) int {
	return slices.IndexFunc(st.live, func(a fxpAlloc) bool { return a.tag == tag })
}

// fxpSystem is the resource under test and what it handed out.
type fxpSystem struct {
	up      *fixedRecorder
	f       *FixedSizeMemoryResource
	streams [fxpStreams]StreamView
	owned   []*Stream
	ptrs    map[int]DevicePtr // by tag, freed ones included
	live    map[int]bool      // tags allocated and not freed, as the calls' results say
	// closed and streamClosed follow the calls made, for the coverage counts.
	closed, streamClosed bool
	cov                  *fxpCoverage
}

type fxpCoverage struct {
	cross, doubles, reusedDoubles, bogus, wrongSize, closedStream, afterClose, grown atomic.Int64
}

func newFxpSystem(t *testing.T, cov *fxpCoverage) *fxpSystem {
	sys := &fxpSystem{up: newFixedRecorder(t), ptrs: map[int]DevicePtr{}, live: map[int]bool{}, cov: cov}
	var err error
	sys.f, err = NewFixedSizeMemoryResource(sys.up, &FixedSizeOptions{BlockSize: fxpBlock, BlocksToPreallocate: fxpChunk})
	if err != nil {
		panic(err)
	}
	sys.streams[0] = DefaultStream
	for i := 1; i < fxpStreams; i++ {
		s, err := NewStream(CurrentDevice(), nil)
		if err != nil {
			panic(err)
		}
		sys.owned = append(sys.owned, s)
		sys.streams[i] = s.View()
	}
	return sys
}

func (sys *fxpSystem) destroy() {
	sys.f.Close()
	for _, s := range sys.owned {
		s.Close()
	}
}

// isLive reports whether p is the block of a live tag.
func (sys *fxpSystem) isLive(p DevicePtr) bool {
	for tag := range sys.live {
		if sys.ptrs[tag] == p {
			return true
		}
	}
	return false
}

type fxpResult struct {
	err           error
	skipped       bool
	before, after FixedSizeStats
	held          int // upstream bytes after the call
	invariants    error
	ptrs          error // live blocks held twice
	ptr           DevicePtr
}

func (sys *fxpSystem) finish(r *fxpResult) *fxpResult {
	r.after = sys.f.Stats()
	allocs, frees := sys.up.calls()
	for _, c := range allocs {
		r.held += c.n
	}
	for _, c := range frees {
		r.held -= c.n
	}
	r.invariants = sys.f.CheckInvariants()
	seen := map[DevicePtr]int{}
	for tag := range sys.live {
		p := sys.ptrs[tag]
		if other, ok := seen[p]; ok && p != 0 {
			r.ptrs = fmt.Errorf("tags %d and %d hold %#x", tag, other, uintptr(p))
		}
		seen[p] = tag
	}
	return r
}

// fxpCheck compares the resource with the model after a call.
func fxpCheck(st *fxpState, r *fxpResult) error {
	if r.invariants != nil {
		return r.invariants
	}
	if r.ptrs != nil {
		return r.ptrs
	}
	a := r.after
	if a.LiveAllocations != len(st.live) || a.LiveBytes != len(st.live)*fxpBlock {
		return fmt.Errorf("%d live blocks (%d bytes), model %d", a.LiveAllocations, a.LiveBytes, len(st.live))
	}
	if a.PoolSize != r.held || a.PoolSize != a.UpstreamBlocks*fxpChunk*fxpBlock {
		return fmt.Errorf("pool %d bytes in %d chunks, upstream holds %d", a.PoolSize, a.UpstreamBlocks, r.held)
	}
	if !st.closed && a.FreeBlocks+a.LiveAllocations != a.UpstreamBlocks*fxpChunk {
		return fmt.Errorf("%d free + %d live blocks in %d chunks", a.FreeBlocks, a.LiveAllocations, a.UpstreamBlocks)
	}
	if st.closed && a.FreeBlocks != 0 {
		return fmt.Errorf("%d free blocks after Close", a.FreeBlocks)
	}
	return nil
}

func fxpUnchanged(r *fxpResult) error {
	if !statsEqual(r.before, r.after) {
		return fmt.Errorf("a failed call changed the resource: %+v -> %+v", r.before, r.after)
	}
	return nil
}

func statsEqual(a, b FixedSizeStats) bool {
	return a.PoolSize == b.PoolSize && a.LiveAllocations == b.LiveAllocations && a.FreeBlocks == b.FreeBlocks &&
		a.Streams == b.Streams && slices.Equal(a.PerStream, b.PerStream)
}

func fxpVerdict(c commands.Command, err error) *gopter.PropResult {
	if err != nil {
		return &gopter.PropResult{Status: gopter.PropFalse, Labels: []string{fmt.Sprintf("after %v: %v", c, err)}}
	}
	return &gopter.PropResult{Status: gopter.PropTrue}
}

// ---- commands ----

type fxpAllocCmd struct{ tag, size, stream int }

func (c fxpAllocCmd) String() string {
	return fmt.Sprintf("Alloc#%d(%d on %d)", c.tag, c.size, c.stream)
}

func (c fxpAllocCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*fxpSystem)
	r := &fxpResult{before: sys.f.Stats()}
	r.ptr, r.err = sys.f.Allocate(c.size, sys.streams[c.stream])
	if r.err == nil && r.ptr != 0 {
		sys.ptrs[c.tag] = r.ptr
		sys.live[c.tag] = true
	}
	sys.finish(r)
	if r.after.UpstreamBlocks > r.before.UpstreamBlocks {
		sys.cov.grown.Add(1)
	}
	return r
}

// want is the error the model expects (nil: success).
func (c fxpAllocCmd) want(st *fxpState) error {
	switch {
	case c.size > fxpBlock:
		return ErrOutOfMemory
	case c.size == 0:
		return nil
	case st.closed || (c.stream == 2 && st.streamClosed):
		return ErrClosed
	}
	return nil
}

func (c fxpAllocCmd) NextState(s commands.State) commands.State {
	st := s.(*fxpState).clone()
	st.nextTag = max(st.nextTag, c.tag+1)
	if c.want(st) == nil && c.size > 0 {
		st.live = append(st.live, fxpAlloc(c))
	}
	return st
}

func (c fxpAllocCmd) PreCondition(s commands.State) bool { return s.(*fxpState).find(c.tag) < 0 }

func (c fxpAllocCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*fxpState), res.(*fxpResult)
	var err error
	want := c.want(st)
	switch {
	case want == nil && r.err != nil:
		err = fmt.Errorf("failed, the model says it succeeds: %v", r.err)
	case want != nil && !errors.Is(r.err, want):
		err = fmt.Errorf("returned %v, want %v", r.err, want)
	case want != nil:
		err = fxpUnchanged(r)
	case c.size == 0 && r.ptr != 0:
		err = fmt.Errorf("a zero-byte allocation returned %#x", uintptr(r.ptr))
	}
	if err == nil {
		err = fxpCheck(st, r)
	}
	return fxpVerdict(c, err)
}

// fxpFreeCmd frees a live tag, allocated with size bytes on stream from, on stream, with the
// size off by delta.
type fxpFreeCmd struct{ tag, size, from, stream, delta int }

func (c fxpFreeCmd) String() string {
	return fmt.Sprintf("Free#%d(on %d, size%+d)", c.tag, c.stream, c.delta)
}

func (c fxpFreeCmd) Run(s commands.SystemUnderTest) commands.Result {
	sys := s.(*fxpSystem)
	r := &fxpResult{before: sys.f.Stats()}
	if c.stream != c.from {
		sys.cov.cross.Add(1)
	}
	if c.delta != 0 {
		sys.cov.wrongSize.Add(1)
	}
	if c.stream == 2 && sys.streamClosed {
		sys.cov.closedStream.Add(1)
	}
	if sys.closed {
		sys.cov.afterClose.Add(1)
	}
	r.err = sys.f.Deallocate(sys.ptrs[c.tag], c.size+c.delta, sys.streams[c.stream])
	if r.err == nil {
		delete(sys.live, c.tag)
	}
	return sys.finish(r)
}

func (c fxpFreeCmd) NextState(s commands.State) commands.State {
	st := s.(*fxpState).clone()
	if c.delta == 0 {
		i := st.find(c.tag)
		st.live = slices.Delete(st.live, i, i+1)
		st.freed = append(st.freed, c.tag)
	}
	return st
}

func (c fxpFreeCmd) PreCondition(s commands.State) bool {
	st := s.(*fxpState)
	i := st.find(c.tag)
	return i >= 0 && st.live[i].size == c.size && st.live[i].stream == c.from && c.size+c.delta > 0
}

func (c fxpFreeCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*fxpState), res.(*fxpResult)
	var err error
	switch {
	case c.delta == 0 && r.err != nil:
		err = r.err
	case c.delta != 0 && !errors.Is(r.err, ErrInvalidFree):
		err = fmt.Errorf("a free with the wrong size returned %v", r.err)
	case c.delta != 0:
		err = fxpUnchanged(r)
	}
	if err == nil {
		err = fxpCheck(st, r)
	}
	return fxpVerdict(c, err)
}

// fxpBadFreeCmd frees a freed tag's pointer again (when no later allocation took the block), or
// with interior set a pointer inside a live block.
type fxpBadFreeCmd struct {
	tag, stream int
	interior    bool
}

func (c fxpBadFreeCmd) String() string {
	if c.interior {
		return fmt.Sprintf("FreeInterior#%d(on %d)", c.tag, c.stream)
	}
	return fmt.Sprintf("DoubleFree#%d(on %d)", c.tag, c.stream)
}

func (c fxpBadFreeCmd) Run(s commands.SystemUnderTest) commands.Result {
	sys := s.(*fxpSystem)
	r := &fxpResult{before: sys.f.Stats()}
	p := sys.ptrs[c.tag]
	if c.interior {
		p += Alignment
		sys.cov.bogus.Add(1)
	} else if sys.isLive(p) {
		// The block was handed out again: freeing it now would be a valid free of another tag.
		r.skipped = true
		sys.cov.reusedDoubles.Add(1)
		return sys.finish(r)
	} else {
		sys.cov.doubles.Add(1)
	}
	r.err = sys.f.Deallocate(p, 1, sys.streams[c.stream])
	return sys.finish(r)
}

func (c fxpBadFreeCmd) NextState(s commands.State) commands.State { return s }

func (c fxpBadFreeCmd) PreCondition(s commands.State) bool {
	st := s.(*fxpState)
	if c.interior {
		return st.find(c.tag) >= 0
	}
	return slices.Contains(st.freed, c.tag)
}

func (c fxpBadFreeCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*fxpState), res.(*fxpResult)
	var err error
	if !r.skipped {
		if !errors.Is(r.err, ErrInvalidFree) {
			err = fmt.Errorf("returned %v, want ErrInvalidFree", r.err)
		} else {
			err = fxpUnchanged(r)
		}
	}
	if err == nil {
		err = fxpCheck(st, r)
	}
	return fxpVerdict(c, err)
}

// fxpOpCmd is a call on the resource or a stream: "release", "close" or "closeStream".
type fxpOpCmd struct{ op string }

func (c fxpOpCmd) String() string { return c.op }

func (c fxpOpCmd) Run(s commands.SystemUnderTest) commands.Result {
	sys := s.(*fxpSystem)
	r := &fxpResult{before: sys.f.Stats()}
	switch c.op {
	case "release":
		r.err = sys.f.Release()
	case "close":
		r.err = sys.f.Close()
		sys.closed = true
	case "closeStream":
		r.err = sys.owned[1].Close()
		sys.streamClosed = true
	}
	return sys.finish(r)
}

func (c fxpOpCmd) NextState(s commands.State) commands.State {
	st := s.(*fxpState).clone()
	switch c.op {
	case "close":
		st.closed = true
	case "closeStream":
		st.streamClosed = true
	}
	return st
}

func (c fxpOpCmd) PreCondition(s commands.State) bool {
	return c.op != "closeStream" || !s.(*fxpState).streamClosed
}

func (c fxpOpCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*fxpState), res.(*fxpResult)
	err := r.err
	if err == nil {
		err = fxpCheck(st, r)
	}
	return fxpVerdict(c, err)
}

// ---- generation ----

func fxpDraw(r *rand.Rand, st *fxpState) commands.Command {
	stream := r.Intn(fxpStreams)
	k := r.Intn(100)
	switch {
	case k < 45 || len(st.live) == 0 && k < 80:
		n := 1 + r.Intn(fxpBlock)
		switch r.Intn(12) {
		case 0:
			n = 0
		case 1:
			n = fxpBlock + 1 + r.Intn(fxpBlock)
		}
		return fxpAllocCmd{st.nextTag, n, stream}
	case k < 80:
		a := st.live[r.Intn(len(st.live))]
		if r.Intn(2) == 0 {
			stream = a.stream
		}
		delta := 0
		if r.Intn(10) == 0 {
			delta = []int{-1, 1, fxpBlock}[r.Intn(3)]
		}
		return fxpFreeCmd{a.tag, a.size, a.stream, stream, delta}
	case k < 88 && len(st.freed) > 0:
		return fxpBadFreeCmd{st.freed[r.Intn(len(st.freed))], stream, false}
	case k < 92 && len(st.live) > 0:
		return fxpBadFreeCmd{st.live[r.Intn(len(st.live))].tag, stream, true}
	case k < 95:
		return fxpOpCmd{"release"}
	case k < 98:
		return fxpOpCmd{"closeStream"}
	default:
		return fxpOpCmd{"close"}
	}
}

func TestFixedSizeProperty(t *testing.T) {
	seed := propertySeed(t)
	t.Logf("seed %d (replay with RMM_PROPERTY_SEED=%d)", seed, seed)
	params := gopter.DefaultTestParametersWithSeed(seed)
	params.MinSuccessfulTests = 200 * propertyScale(t)
	params.MinSize = 1
	params.MaxSize = 100
	params.MaxShrinkCount = 1000
	cov := &fxpCoverage{}
	cmds := &commands.ProtoCommands{
		NewSystemUnderTestFunc: func(initial commands.State) commands.SystemUnderTest {
			return newFxpSystem(t, cov)
		},
		DestroySystemUnderTestFunc: func(s commands.SystemUnderTest) { s.(*fxpSystem).destroy() },
		InitialStateGen: func(p *gopter.GenParameters) *gopter.GenResult {
			return gopter.NewGenResult(&fxpState{}, gopter.NoShrinker)
		},
		GenCommandFunc: func(s commands.State) gopter.Gen {
			st := s.(*fxpState)
			return func(p *gopter.GenParameters) *gopter.GenResult {
				return gopter.NewGenResult(fxpDraw(p.Rng, st), gopter.NoShrinker)
			}
		},
	}
	runCommandsProperty(t, seed, params, "fixed-size resource against its model", cmds)
	require.Positive(t, cov.cross.Load(), "no free on another stream")
	require.Positive(t, cov.doubles.Load(), "no double free")
	require.Positive(t, cov.bogus.Load(), "no free of a pointer never handed out")
	require.Positive(t, cov.wrongSize.Load(), "no free with a wrong size")
	require.Positive(t, cov.closedStream.Load(), "no free on a closed Stream")
	require.Positive(t, cov.afterClose.Load(), "no free after Close")
	require.Positive(t, cov.grown.Load(), "the resource never grew")
}
