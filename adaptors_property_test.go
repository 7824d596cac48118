// A gopter state-machine (commands) test of a stack of adaptors against a model:
//
//	StatisticsResourceAdaptor → TrackingResourceAdaptor → LimitingResourceAdaptor →
//	AlignedResourceAdaptor → SimulatedMemoryResource
//
// Random sequences allocate (sizes 0 to past the limit), free (sometimes with a wrong size, which
// the statistics count as given and the tracking adaptor corrects for everything below it), push
// and pop statistics levels (popping the last one must fail), and ask for more than the limit
// leaves. The model keeps the live allocations and its own counter stack, folded with the rule of
// PopCounters written out separately here. After every step: the statistics' top level and depth
// equal the model's; the tracking adaptor's outstanding allocations are exactly the live non-empty
// ones, with their sizes; the limiting adaptor's charge is the sum of the live sizes rounded up to
// 256 and never above the limit; an allocation fails exactly when the model says it goes past
// the limit, and then changes nothing; every live pointer is aligned as the aligned adaptor
// promises and lies inside one upstream allocation; the upstream holds exactly the padded sizes
// the aligned adaptor must have asked for.
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

// adpPropConfig is what one sequence runs against.
type adpPropConfig struct {
	limit, alignment, threshold int
}

// adpLevel is the model's copy of one statistics level.
type adpLevel struct {
	bytes, count [3]int64 // value, peak, total
}

func (l adpLevel) stats() Statistics {
	return Statistics{l.bytes[0], l.count[0], l.bytes[1], l.count[1], l.bytes[2], l.count[2]}
}

func adpModelAdd(c *[3]int64, n int64) {
	c[0] += n
	c[2] += n
	c[1] = max(c[1], c[0])
}

// adpModelFold folds popped counter t into parent p.
func adpModelFold(p *[3]int64, t [3]int64) {
	p[1] = max(p[1], p[0]+t[1])
	p[0] += t[0]
	p[2] += t[2]
}

type adpPropAlloc struct{ tag, size int }

type adpPropState struct {
	cfg     adpPropConfig
	nextTag int
	live    []adpPropAlloc // successful, not freed
	levels  []adpLevel     // bottom first
}

func (st *adpPropState) clone() *adpPropState {
	c := *st
	c.live = slices.Clone(st.live)
	c.levels = slices.Clone(st.levels)
	return &c
}

func (st *adpPropState) top() *adpLevel { return &st.levels[len(st.levels)-1] }

func (st *adpPropState) charged() int {
	n := 0
	for _, a := range st.live {
		n += roundUp(a.size)
	}
	return n
}

func (st *adpPropState) find(tag int) int {
	return slices.IndexFunc(st.live, func(a adpPropAlloc) bool { return a.tag == tag })
}

func (st *adpPropState) String() string {
	return fmt.Sprintf("limit %d, alignment %d, threshold %d", st.cfg.limit, st.cfg.alignment, st.cfg.threshold)
}

// adpPropSystem is the stack under test.
type adpPropSystem struct {
	cfg     adpPropConfig
	sim     *SimulatedMemoryResource
	aligned *AlignedResourceAdaptor
	lim     *LimitingResourceAdaptor
	track   *TrackingResourceAdaptor
	stats   *StatisticsResourceAdaptor
	ptrs    map[int]DevicePtr
	sizes   map[int]int
	cov     *adpPropCoverage
}

// adpPropCoverage counts what the sequences exercised, so that the test fails when its
// generators stop reaching a path.
type adpPropCoverage struct {
	refused, wrongFrees, lastPops, pops, padded atomic.Int64
}

func newAdpPropSystem(cfg adpPropConfig, cov *adpPropCoverage) *adpPropSystem {
	sys := &adpPropSystem{cfg: cfg, ptrs: map[int]DevicePtr{}, sizes: map[int]int{}, cov: cov}
	sys.sim, _ = NewSimulatedMemoryResource(1 << 40)
	var err error
	if sys.aligned, err = NewAlignedResourceAdaptor(sys.sim, &AlignedOptions{Alignment: cfg.alignment, Threshold: cfg.threshold}); err != nil {
		panic(err)
	}
	if sys.lim, err = NewLimitingResourceAdaptor(sys.aligned, cfg.limit, nil); err != nil {
		panic(err)
	}
	if sys.track, err = NewTrackingResourceAdaptor(sys.lim, nil); err != nil {
		panic(err)
	}
	if sys.stats, err = NewStatisticsResourceAdaptor(sys.track); err != nil {
		panic(err)
	}
	return sys
}

// adpPropSnapshot is what the stack looks like after a step.
type adpPropSnapshot struct {
	stats       Statistics
	depth       int
	tracked     []TrackedAllocation
	trackBytes  int
	charged     int
	upstreamUse int
	live        map[DevicePtr]int // what the system believes is live (size > 0)
	layoutErr   error
}

func (sys *adpPropSystem) snapshot() adpPropSnapshot {
	s := adpPropSnapshot{
		stats: sys.stats.Stats(), depth: sys.stats.Depth(),
		tracked: sys.track.OutstandingAllocations(), trackBytes: sys.track.AllocatedBytes(),
		charged: sys.lim.AllocatedBytes(), upstreamUse: sys.sim.UsedBytes(),
		live: map[DevicePtr]int{},
	}
	for tag, p := range sys.ptrs {
		n := sys.sizes[tag]
		if n == 0 {
			if p != 0 {
				s.layoutErr = fmt.Errorf("zero-byte allocation #%d has pointer %#x", tag, uintptr(p))
			}
			continue
		}
		s.live[p] = n
		want := Alignment
		if n >= sys.cfg.threshold {
			want = max(sys.cfg.alignment, Alignment)
		}
		switch {
		case uintptr(p)%uintptr(want) != 0:
			s.layoutErr = fmt.Errorf("allocation #%d of %d bytes at %#x is not %d-aligned", tag, n, uintptr(p), want)
		case !sys.sim.Contains(p, n):
			s.layoutErr = fmt.Errorf("allocation #%d [%#x, +%d) is not inside one upstream allocation", tag, uintptr(p), n)
		}
	}
	return s
}

// upstreamBytes is what the simulated upstream holds for an allocation of n bytes: the aligned
// adaptor's request, rounded to 256.
func (cfg adpPropConfig) upstreamBytes(n int) int {
	a := max(cfg.alignment, Alignment)
	if n == 0 || a == Alignment || n < cfg.threshold {
		return roundUp(n)
	}
	padded, _ := AlignUp(n, a)
	return roundUp(padded + a - Alignment)
}

type adpPropResult struct {
	err    error
	before adpPropSnapshot
	after  adpPropSnapshot
}

// adpPropCheck compares the system with the model after a step.
func adpPropCheck(st *adpPropState, r *adpPropResult) error {
	a := r.after
	if a.layoutErr != nil {
		return a.layoutErr
	}
	if want := st.top().stats(); a.stats != want {
		return fmt.Errorf("statistics top level %+v, model %+v", a.stats, want)
	}
	if a.depth != len(st.levels) {
		return fmt.Errorf("statistics depth %d, model %d", a.depth, len(st.levels))
	}
	sumSizes, upstream := 0, 0
	sizes := []int{}
	for _, x := range st.live {
		sumSizes += x.size
		upstream += st.cfg.upstreamBytes(x.size)
		if x.size > 0 {
			sizes = append(sizes, x.size)
		}
	}
	if a.trackBytes != sumSizes {
		return fmt.Errorf("tracking: %d bytes allocated, model %d", a.trackBytes, sumSizes)
	}
	if len(a.tracked) != len(a.live) || len(a.live) != len(sizes) {
		return fmt.Errorf("tracking: %d outstanding, the system holds %d, model %d", len(a.tracked), len(a.live), len(sizes))
	}
	for _, t := range a.tracked {
		if a.live[t.Ptr] != t.Size {
			return fmt.Errorf("tracking: %#x with %d bytes outstanding, live with %d", uintptr(t.Ptr), t.Size, a.live[t.Ptr])
		}
	}
	if a.charged != st.charged() || a.charged > st.cfg.limit {
		return fmt.Errorf("limiting: %d bytes charged, model %d, limit %d", a.charged, st.charged(), st.cfg.limit)
	}
	if a.upstreamUse != upstream {
		return fmt.Errorf("upstream holds %d bytes, model %d", a.upstreamUse, upstream)
	}
	return nil
}

// adpUnchanged checks that a failed call changed nothing.
func adpUnchanged(r *adpPropResult) error {
	b, a := r.before, r.after
	if b.stats != a.stats || b.depth != a.depth || b.trackBytes != a.trackBytes || b.charged != a.charged ||
		b.upstreamUse != a.upstreamUse || len(b.tracked) != len(a.tracked) {
		return fmt.Errorf("a failed call changed the stack: %+v -> %+v", b, a)
	}
	return nil
}

func adpVerdict(c commands.Command, err error) *gopter.PropResult {
	if err != nil {
		return &gopter.PropResult{Status: gopter.PropFalse, Labels: []string{fmt.Sprintf("after %v: %v", c, err)}}
	}
	return &gopter.PropResult{Status: gopter.PropTrue}
}

// ---- commands ----

type adpAllocCmd struct{ tag, size int }

func (c adpAllocCmd) String() string { return fmt.Sprintf("Alloc#%d(%d)", c.tag, c.size) }

func (c adpAllocCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*adpPropSystem)
	r := &adpPropResult{before: sys.snapshot()}
	var p DevicePtr
	p, r.err = sys.stats.Allocate(c.size, DefaultStream)
	if r.err == nil {
		sys.ptrs[c.tag], sys.sizes[c.tag] = p, c.size
		if sys.cfg.upstreamBytes(c.size) > roundUp(c.size) {
			sys.cov.padded.Add(1)
		}
	} else {
		sys.cov.refused.Add(1)
	}
	r.after = sys.snapshot()
	return r
}

// fits reports whether the model lets the allocation through the limit.
func (c adpAllocCmd) fits(st *adpPropState) bool { return st.charged()+roundUp(c.size) <= st.cfg.limit }

func (c adpAllocCmd) NextState(s commands.State) commands.State {
	st := s.(*adpPropState).clone()
	st.nextTag = max(st.nextTag, c.tag+1)
	if c.fits(st) {
		st.live = append(st.live, adpPropAlloc(c))
		adpModelAdd(&st.top().bytes, int64(c.size))
		adpModelAdd(&st.top().count, 1)
	}
	return st
}

func (c adpAllocCmd) PreCondition(s commands.State) bool { return s.(*adpPropState).find(c.tag) < 0 }

func (c adpAllocCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*adpPropState), res.(*adpPropResult)
	succeeded := st.find(c.tag) >= 0 // the model's verdict
	var err error
	switch {
	case succeeded && r.err != nil:
		err = fmt.Errorf("failed, the model says it fits: %v", r.err)
	case !succeeded && r.err == nil:
		err = errors.New("succeeded past the limit")
	case !succeeded && !errors.Is(r.err, ErrOutOfMemory):
		err = fmt.Errorf("refused with %v, want ErrOutOfMemory", r.err)
	case !succeeded:
		err = adpUnchanged(r)
	}
	if err == nil {
		err = adpPropCheck(st, r)
	}
	return adpVerdict(c, err)
}

// adpFreeCmd frees allocation #tag with its size plus delta (delta ≠ 0 only for non-empty ones).
type adpFreeCmd struct{ tag, delta int }

func (c adpFreeCmd) String() string {
	if c.delta != 0 {
		return fmt.Sprintf("Free#%d(size%+d)", c.tag, c.delta)
	}
	return fmt.Sprintf("Free#%d", c.tag)
}

func (c adpFreeCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*adpPropSystem)
	r := &adpPropResult{before: sys.snapshot()}
	r.err = sys.stats.Deallocate(sys.ptrs[c.tag], sys.sizes[c.tag]+c.delta, DefaultStream)
	if c.delta != 0 {
		sys.cov.wrongFrees.Add(1)
	}
	if r.err == nil {
		delete(sys.ptrs, c.tag)
		delete(sys.sizes, c.tag)
	}
	r.after = sys.snapshot()
	return r
}

func (c adpFreeCmd) NextState(s commands.State) commands.State {
	st := s.(*adpPropState).clone()
	i := st.find(c.tag)
	n := st.live[i].size + c.delta
	st.live = slices.Delete(st.live, i, i+1)
	st.top().bytes[0] -= int64(n)
	st.top().count[0]--
	return st
}

func (c adpFreeCmd) PreCondition(s commands.State) bool {
	st := s.(*adpPropState)
	i := st.find(c.tag)
	return i >= 0 && (c.delta == 0 || (st.live[i].size > 0 && st.live[i].size+c.delta >= 0))
}

func (c adpFreeCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	r := res.(*adpPropResult)
	err := r.err
	if err == nil {
		err = adpPropCheck(s.(*adpPropState), r)
	}
	return adpVerdict(c, err)
}

type adpPushCmd struct{}

func (adpPushCmd) String() string { return "Push" }

func (adpPushCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*adpPropSystem)
	r := &adpPropResult{before: sys.snapshot()}
	pushed := sys.stats.PushCounters()
	if pushed != r.before.stats {
		r.err = fmt.Errorf("PushCounters returned %+v, the top level was %+v", pushed, r.before.stats)
	}
	r.after = sys.snapshot()
	return r
}

func (adpPushCmd) NextState(s commands.State) commands.State {
	st := s.(*adpPropState).clone()
	st.levels = append(st.levels, adpLevel{})
	return st
}

func (adpPushCmd) PreCondition(commands.State) bool { return true }

func (c adpPushCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	r := res.(*adpPropResult)
	err := r.err
	if err == nil {
		err = adpPropCheck(s.(*adpPropState), r)
	}
	return adpVerdict(c, err)
}

// adpPopCmd pops a level; with one level left it must fail and change nothing.
type adpPopCmd struct{}

type adpPopResult struct {
	adpPropResult
	popped Statistics
}

func (adpPopCmd) String() string { return "Pop" }

func (adpPopCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*adpPropSystem)
	r := &adpPopResult{adpPropResult: adpPropResult{before: sys.snapshot()}}
	r.popped, r.err = sys.stats.PopCounters()
	if r.before.depth == 1 {
		sys.cov.lastPops.Add(1)
	} else {
		sys.cov.pops.Add(1)
	}
	r.after = sys.snapshot()
	return r
}

func (adpPopCmd) NextState(s commands.State) commands.State {
	st := s.(*adpPropState).clone()
	if len(st.levels) == 1 {
		return st
	}
	t := st.levels[len(st.levels)-1]
	st.levels = st.levels[:len(st.levels)-1]
	adpModelFold(&st.top().bytes, t.bytes)
	adpModelFold(&st.top().count, t.count)
	return st
}

func (adpPopCmd) PreCondition(commands.State) bool { return true }

func (c adpPopCmd) PostCondition(s commands.State, res commands.Result) *gopter.PropResult {
	st, r := s.(*adpPropState), res.(*adpPopResult)
	var err error
	switch {
	case r.before.depth == 1 && !errors.Is(r.err, ErrOutOfRange):
		err = fmt.Errorf("popping the last level returned %v, want ErrOutOfRange", r.err)
	case r.before.depth == 1:
		err = adpUnchanged(&r.adpPropResult)
	case r.err != nil:
		err = r.err
	case r.popped != r.before.stats:
		err = fmt.Errorf("PopCounters returned %+v, the top level was %+v", r.popped, r.before.stats)
	}
	if err == nil {
		err = adpPropCheck(st, &r.adpPropResult)
	}
	return adpVerdict(c, err)
}

// ---- generation ----

func adpDrawCommand(r *rand.Rand, st *adpPropState) commands.Command {
	k := r.Intn(100)
	switch {
	case k < 40 || len(st.live) == 0 && k < 75:
		var n int
		switch r.Intn(10) {
		case 0:
			n = 0
		case 1, 2:
			n = 1 + r.Intn(st.cfg.limit) // may not fit
		default:
			n = smallSize(r) % (st.cfg.limit/4 + 1)
		}
		return adpAllocCmd{st.nextTag, n}
	case k < 75:
		a := st.live[r.Intn(len(st.live))]
		delta := 0
		if a.size > 0 && r.Intn(8) == 0 {
			delta = r.Intn(2*a.size+1) - a.size
		}
		return adpFreeCmd{a.tag, delta}
	case k < 85:
		return adpPushCmd{}
	case k < 95:
		return adpPopCmd{}
	default:
		// More than the limit leaves.
		return adpAllocCmd{st.nextTag, st.cfg.limit - st.charged() + 1 + r.Intn(Alignment)}
	}
}

func adpShrinkCommand(v interface{}) gopter.Shrink {
	var cands []interface{}
	switch c := v.(type) {
	case adpAllocCmd:
		for _, n := range []int{0, 1, c.size / 2} {
			if n < c.size {
				cands = append(cands, adpAllocCmd{c.tag, n})
			}
		}
	case adpFreeCmd:
		if c.delta != 0 {
			cands = append(cands, adpFreeCmd{c.tag, 0})
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

func TestAdaptorStackProperty(t *testing.T) {
	seed := propertySeed(t)
	t.Logf("seed %d (replay with RMM_PROPERTY_SEED=%d)", seed, seed)
	params := gopter.DefaultTestParametersWithSeed(seed)
	params.MinSuccessfulTests = 400 * propertyScale(t)
	params.MinSize = 1
	params.MaxSize = 80
	params.MaxShrinkCount = 2000
	cov := &adpPropCoverage{}
	cmds := &commands.ProtoCommands{
		NewSystemUnderTestFunc: func(initial commands.State) commands.SystemUnderTest {
			return newAdpPropSystem(initial.(*adpPropState).cfg, cov)
		},
		InitialStateGen: func(p *gopter.GenParameters) *gopter.GenResult {
			r := p.Rng
			cfg := adpPropConfig{
				limit:     logUniform(r, 4*kiB, 4*miB),
				alignment: []int{0, 64, 256, 512, 4096, 64 * kiB}[r.Intn(6)],
				threshold: []int{0, 0, 300, 5000}[r.Intn(4)],
			}
			return gopter.NewGenResult(&adpPropState{cfg: cfg, levels: []adpLevel{{}}}, gopter.NoShrinker)
		},
		GenCommandFunc: func(s commands.State) gopter.Gen {
			st := s.(*adpPropState)
			return func(p *gopter.GenParameters) *gopter.GenResult {
				return gopter.NewGenResult(adpDrawCommand(p.Rng, st), adpShrinkCommand)
			}
		},
	}
	runCommandsProperty(t, seed, params, "statistics over tracking over limiting over aligned", cmds)
	require.Positive(t, cov.refused.Load(), "no allocation went past the limit")
	require.Positive(t, cov.wrongFrees.Load(), "no free with a wrong size")
	require.Positive(t, cov.lastPops.Load(), "the last level was never popped")
	require.Positive(t, cov.pops.Load(), "no level was popped")
	require.Positive(t, cov.padded.Load(), "no allocation was padded for alignment")
}
