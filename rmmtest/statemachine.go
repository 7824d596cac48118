package rmmtest

import (
	"errors"
	"fmt"
	"math/rand"
	randv2 "math/rand/v2"
	"runtime/debug"
	"slices"
	"strings"

	"github.com/gormm/rmm"
	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/commands"
)

// The state machine: gopter's commands API drives a fresh resource per sequence with random
// commands; the system under test checks the resource against its model after every step, and
// gopter shrinks a failing sequence to a minimal one.
//
// The generator's state (smState) knows only what was asked: tags, sizes and streams, and the
// configuration of the sequence (smSeq). What happened (pointers, which allocations ran out of
// memory) lives in the system under test (smSystem), whose instance holds the model of the live
// allocations; a command naming an allocation that failed is skipped.

// smConfig is shared by every sequence of one run.
type smConfig struct {
	t        tester
	releaser bool // the resources are rmm.Releasers (a probe says)

	// What the sequences exercised.
	cov Coverage

	first, last *smTrace // the first failing sequence, and the last (the shrunk one)
	cleanup     *smTrace // the first passing sequence whose teardown failed
}

// smSeq is the configuration of one sequence: the suite (options and constructor) its resource
// is built with. Without RunConfigurations every sequence has the same.
type smSeq struct {
	s     *suite
	name  string // the configuration's name, "" without RunConfigurations
	views int    // DefaultStream + Streams
}

// describe gives the configuration for failure reports.
func (q *smSeq) describe() string {
	if q.name == "" {
		return q.s.describe()
	}
	return q.name + "; " + q.s.describe()
}

// smTrace is what one sequence did, up to its first failure.
type smTrace struct {
	config  string // the sequence's configuration
	steps   []string
	failure string
	at      int // index in steps of the failing step, -1 for a teardown failure
	total   int // commands in the sequence (steps holds those up to the failure)
}

type smAlloc struct{ tag, size, stream int }

type smState struct {
	cfg     *smConfig
	seq     *smSeq
	nextTag int
	allocs  []smAlloc // allocations asked for and not freed, in tag order
}

func (st *smState) clone() *smState {
	c := *st
	c.allocs = slices.Clone(st.allocs)
	return &c
}

func (st *smState) find(tag int) int {
	for i := range st.allocs {
		if st.allocs[i].tag == tag {
			return i
		}
	}
	return -1
}

func (st *smState) remove(tag int) *smState {
	c := st.clone()
	if i := c.find(tag); i >= 0 {
		c.allocs = slices.Delete(c.allocs, i, i+1)
	}
	return c
}

func (st *smState) String() string {
	return fmt.Sprintf("%d allocations (%s)", len(st.allocs), st.seq.describe())
}

// smHandle is an allocation of the sequence that succeeded: b is nil for zero bytes.
type smHandle struct {
	b      *block
	size   int
	stream int
}

// smSystem is the system under test of one sequence.
type smSystem struct {
	cfg  *smConfig
	seq  *smSeq
	in   *instance
	tags map[int]smHandle

	steps  []string
	failed bool
	trace  *smTrace

	// last is what the resource looked like at the end of the last step, which verified it (nil
	// when that step failed, or before the first): the next command's "before", since nothing
	// changes between steps. pending is what the command running observed at its end, which its
	// step then verifies rather than observing again (observing calls CheckInvariants).
	last, pending *observation
}

// before returns what the resource looks like before a command: as the last step left it.
func (sys *smSystem) before() observation {
	if sys.last != nil {
		return *sys.last
	}
	return sys.in.observe()
}

// after observes the resource at the end of a command, for its step to verify.
func (sys *smSystem) after() observation {
	o := sys.in.observe()
	sys.pending = &o
	return o
}

type smResult struct {
	err error
}

func streamName(i int) string {
	if i == 0 {
		return "DefaultStream"
	}
	return fmt.Sprintf("Stream%d", i)
}

// step runs f (which returns what the call returned, for the trace, and what was wrong), then
// verifies the resource against the model, and records the step.
func (sys *smSystem) step(c fmt.Stringer, f func() (string, error)) commands.Result {
	var desc string
	var err error
	func() {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("panic: %v\n%s", p, debug.Stack())
			}
		}()
		sys.pending = nil
		desc, err = f()
		o := sys.pending
		sys.last = nil
		if err == nil {
			if o == nil {
				x := sys.in.observe()
				o = &x
			}
			if err = sys.in.verifyObserved(*o); err == nil {
				sys.last = o
			}
		}
	}()
	sys.steps = append(sys.steps, c.String()+desc)
	if err != nil && !sys.failed {
		sys.failed = true
		sys.trace = &smTrace{config: sys.seq.describe(), steps: slices.Clone(sys.steps), failure: err.Error(), at: len(sys.steps) - 1}
	}
	return &smResult{err: err}
}

func skipped() (string, error) { return " (skipped: the allocation failed)", nil }

func postCondition(res commands.Result) *gopter.PropResult {
	if r := res.(*smResult); r.err != nil {
		return &gopter.PropResult{Status: gopter.PropFalse, Labels: []string{r.err.Error()}}
	}
	return &gopter.PropResult{Status: gopter.PropTrue}
}

// ---------------------------------------------------------------------------------------------
// Commands.

// allocCmd allocates size bytes on a stream; the allocation is #tag.
type allocCmd struct{ tag, size, stream int }

func (c allocCmd) String() string {
	return fmt.Sprintf("Allocate#%d(%d, %s)", c.tag, c.size, streamName(c.stream))
}

func (c allocCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*smSystem)
	return sys.step(c, func() (string, error) {
		in := sys.in
		before := sys.before()
		b, err, bad := in.allocate(c.size, c.stream)
		switch {
		case bad != nil:
			return "", bad
		case err == nil:
			sys.tags[c.tag] = smHandle{b: b, size: c.size, stream: c.stream}
			if b == nil {
				return " = 0", nil
			}
			sys.cfg.cov.Allocations++
			return fmt.Sprintf(" = %#x", uintptr(b.ptr)), nil
		case errors.Is(err, rmm.ErrOutOfMemory):
			sys.cfg.cov.OutOfMemory++
			desc := fmt.Sprintf(" = out of memory (%v)", err)
			_, live := in.liveCount()
			switch {
			case c.size == 0:
				return desc, errors.New("a zero-byte allocation failed: Allocate(0) must return (0, nil)")
			case in.cfg.capacity == 0 && !in.cfg.mayRunOutAnywhere:
				return desc, fmt.Errorf("out of memory with %d bytes live, but Options.Capacity is 0 (the resource is declared not to run out for sizes up to Options.MaxAllocationSize)", live)
			case in.cfg.strictCapacity && live+roundUp(c.size) <= in.cfg.capacity:
				return desc, fmt.Errorf("out of memory with %d bytes live, %d bytes asked (rounded up to 256): within Options.Capacity %d, and Options.StrictCapacity is set", live, roundUp(c.size), in.cfg.capacity)
			}
			if st, ok := before.stats.(rmm.PoolStats); ok && st.LargestFreeBlock >= roundUp(c.size) {
				return desc, fmt.Errorf("out of memory although Stats reported a free block of %d bytes before the call (%d asked, rounded up to 256)", st.LargestFreeBlock, roundUp(c.size))
			}
			return desc, unchangedAccounting(before, sys.after())
		}
		return fmt.Sprintf(" = %v", err), fmt.Errorf("Allocate(%d, %s): %w, want success or an error wrapping rmm.ErrOutOfMemory", c.size, streamName(c.stream), err)
	})
}

func (c allocCmd) NextState(s commands.State) commands.State {
	st := s.(*smState).clone()
	st.allocs = append(st.allocs, smAlloc(c))
	st.nextTag = max(st.nextTag, c.tag+1)
	return st
}

func (c allocCmd) PreCondition(s commands.State) bool {
	st := s.(*smState)
	return st.find(c.tag) < 0 && c.stream < st.seq.views
}

func (c allocCmd) PostCondition(_ commands.State, res commands.Result) *gopter.PropResult {
	return postCondition(res)
}

// freeCmd frees allocation #tag on a stream (its own or another).
type freeCmd struct{ tag, stream int }

func (c freeCmd) String() string { return fmt.Sprintf("Free#%d(%s)", c.tag, streamName(c.stream)) }

func (c freeCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*smSystem)
	h, ok := sys.tags[c.tag]
	if !ok {
		return sys.step(c, skipped)
	}
	return sys.step(c, func() (string, error) {
		delete(sys.tags, c.tag)
		if h.b == nil {
			if err := sys.in.mr.Deallocate(0, 0, sys.in.views[c.stream]); err != nil {
				return "", fmt.Errorf("Deallocate(0, 0, %s) = %v, want nil", streamName(c.stream), err)
			}
			return "", nil
		}
		if c.stream != h.stream {
			sys.cfg.cov.CrossStreamFrees++
		}
		return "", sys.in.free(h.b, c.stream)
	})
}

func (c freeCmd) NextState(s commands.State) commands.State { return s.(*smState).remove(c.tag) }

func (c freeCmd) PreCondition(s commands.State) bool {
	st := s.(*smState)
	return st.find(c.tag) >= 0 && c.stream < st.seq.views
}

func (c freeCmd) PostCondition(_ commands.State, res commands.Result) *gopter.PropResult {
	return postCondition(res)
}

// freeZeroBytes frees the zero-byte allocations of the sequence still live, each once, on the
// stream it was made on (a resource may count them: see unchangedByZero).
func (sys *smSystem) freeZeroBytes() error {
	for tag, h := range sys.tags {
		if h.b == nil {
			delete(sys.tags, tag)
			if err := sys.in.mr.Deallocate(0, 0, sys.in.views[h.stream]); err != nil {
				return fmt.Errorf("Deallocate(0, 0, %s) = %v, want nil", streamName(h.stream), err)
			}
		}
	}
	return nil
}

// zeroCmd allocates and frees zero bytes: (0, nil), then nil, and nothing changes but counts of
// calls (unchangedByZero).
type zeroCmd struct{ stream int }

func (c zeroCmd) String() string { return fmt.Sprintf("AllocateFreeZero(%s)", streamName(c.stream)) }

func (c zeroCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*smSystem)
	return sys.step(c, func() (string, error) {
		in, sv := sys.in, sys.in.views[c.stream]
		before := sys.before()
		p, err := in.mr.Allocate(0, sv)
		if err != nil || p != 0 {
			return "", fmt.Errorf("Allocate(0) = (%#x, %v), want (0, nil)", uintptr(p), err)
		}
		if err := in.mr.Deallocate(0, 0, sv); err != nil {
			return "", fmt.Errorf("Deallocate(0, 0) = %v, want nil", err)
		}
		return "", unchangedByZero(before, sys.after())
	})
}

func (c zeroCmd) NextState(s commands.State) commands.State { return s }

func (c zeroCmd) PreCondition(s commands.State) bool { return c.stream < s.(*smState).seq.views }

func (c zeroCmd) PostCondition(_ commands.State, res commands.Result) *gopter.PropResult {
	return postCondition(res)
}

// Kinds of invalid free.
const (
	badInterior   = iota // a pointer inside a live allocation
	badNotHanded         // a pointer the resource did not hand out
	badWrongSize         // a live pointer with another size
	badDoubleFree        // a valid free, then the same again
)

// badFreeCmd frees something invalid and expects ErrInvalidFree and no change. tag names the
// live allocation involved (not for badNotHanded); x picks the offset, address or size.
type badFreeCmd struct {
	kind, tag, stream int
	x                 uint32
}

func (c badFreeCmd) String() string {
	s := streamName(c.stream)
	switch c.kind {
	case badInterior:
		return fmt.Sprintf("FreeInterior#%d(x=%d, %s)", c.tag, c.x, s)
	case badNotHanded:
		return fmt.Sprintf("FreeNotHandedOut(x=%d, %s)", c.x, s)
	case badWrongSize:
		return fmt.Sprintf("FreeWrongSize#%d(x=%d, %s)", c.tag, c.x, s)
	}
	return fmt.Sprintf("DoubleFree#%d(%s)", c.tag, s)
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
		w = size + rmm.Alignment
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

// notHandedOut returns an address that is not the start of a live allocation, chosen by x: the
// start or the last 256 bytes of a block held from the upstream (or of a range the resource
// maps), the end of a live allocation, or a small address no resource hands out.
func (sys *smSystem) notHandedOut(x uint32) rmm.DevicePtr {
	in := sys.in
	held, _ := in.up.blocks()
	bs := in.liveBlocks()
	var cands []rmm.DevicePtr
	for _, h := range append(held, in.mappedSpans()...) {
		cands = append(cands, h.addr, h.addr+rmm.DevicePtr(rmm.AlignDown(h.size-1, rmm.Alignment)))
	}
	for _, b := range bs {
		cands = append(cands, b.ptr+rmm.DevicePtr(roundUp(b.size)))
	}
	cands = append(cands, rmm.DevicePtr(4096+rmm.Alignment*int(x%16)))
	for i := range cands {
		p := cands[(int(x/16)+i)%len(cands)]
		in.mu.Lock()
		_, live := in.live[p]
		in.mu.Unlock()
		if !live && p != 0 {
			return p
		}
	}
	return rmm.DevicePtr(4096)
}

func (c badFreeCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*smSystem)
	var h smHandle
	if c.kind != badNotHanded {
		var ok bool
		if h, ok = sys.tags[c.tag]; !ok || h.b == nil {
			return sys.step(c, skipped)
		}
	}
	return sys.step(c, func() (string, error) {
		in, stream := sys.in, c.stream
		sys.cfg.cov.InvalidFrees++
		before := sys.before()
		var p rmm.DevicePtr
		var n int
		switch c.kind {
		case badInterior:
			// Half of the time a 256-aligned offset, which a resource that looks up blocks by
			// alignment could mistake for a block start.
			off := 1 + int(c.x)%(roundUp(h.size)-1)
			if blocks := roundUp(h.size) / rmm.Alignment; c.x%2 == 0 && blocks > 1 {
				off = rmm.Alignment * (1 + int(c.x/2)%(blocks-1))
			}
			p, n = h.b.ptr+rmm.DevicePtr(off), h.size
		case badNotHanded:
			p, n = sys.notHandedOut(c.x), rmm.Alignment*(1+int(c.x%4))
		case badWrongSize:
			p, n = h.b.ptr, wrongSize(h.size, c.x)
		case badDoubleFree:
			delete(sys.tags, c.tag)
			if err := in.free(h.b, c.stream); err != nil {
				return "", fmt.Errorf("the first free: %w", err)
			}
			p, n = h.b.ptr, h.size
			stream = (c.stream + int(c.x)) % len(in.views)
			before = in.observe() // after the first free
		}
		err := in.mr.Deallocate(p, n, in.views[stream])
		desc := fmt.Sprintf(": Deallocate(%#x, %d, %s) = %v", uintptr(p), n, streamName(stream), err)
		if !errors.Is(err, rmm.ErrInvalidFree) {
			return desc, fmt.Errorf("Deallocate(%#x, %d, %s) = %v, want an error wrapping rmm.ErrInvalidFree (Options.DetectsInvalidFree is set)", uintptr(p), n, streamName(stream), err)
		}
		return desc, unchanged(before, sys.after())
	})
}

func (c badFreeCmd) NextState(s commands.State) commands.State {
	if c.kind == badDoubleFree {
		return s.(*smState).remove(c.tag)
	}
	return s
}

func (c badFreeCmd) PreCondition(s commands.State) bool {
	st := s.(*smState)
	if !st.seq.s.cfg.detectsInvalidFree || c.stream >= st.seq.views {
		return false
	}
	if c.kind == badNotHanded {
		return true
	}
	i := st.find(c.tag)
	return i >= 0 && st.allocs[i].size > 0
}

func (c badFreeCmd) PostCondition(_ commands.State, res commands.Result) *gopter.PropResult {
	return postCondition(res)
}

// tooBigCmd asks for more than is left of the capacity: Capacity - live + extra bytes.
type tooBigCmd struct{ extra, stream int }

func (c tooBigCmd) String() string {
	return fmt.Sprintf("AllocateBeyondCapacity(+%d, %s)", c.extra, streamName(c.stream))
}

func (c tooBigCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*smSystem)
	return sys.step(c, func() (string, error) {
		in, sv := sys.in, sys.in.views[c.stream]
		_, live := in.liveCount()
		capacity := in.cfg.capacity
		if live > capacity {
			return "", fmt.Errorf("%d bytes are live (each rounded up to 256), more than Options.Capacity %d", live, capacity)
		}
		n := capacity - live + c.extra
		sys.cfg.cov.BeyondCapacity++
		before := sys.before()
		p, err := in.mr.Allocate(n, sv)
		desc := fmt.Sprintf(": Allocate(%d) = (%#x, %v)", n, uintptr(p), err)
		if err == nil {
			if derr := in.mr.Deallocate(p, n, sv); derr != nil {
				return desc, fmt.Errorf("Allocate(%d) with %d bytes live succeeded beyond Options.Capacity %d, and freeing it failed: %v", n, live, capacity, derr)
			}
			return desc, fmt.Errorf("Allocate(%d) with %d bytes live succeeded beyond Options.Capacity %d", n, live, capacity)
		}
		if !errors.Is(err, rmm.ErrOutOfMemory) {
			return desc, fmt.Errorf("Allocate(%d) beyond Options.Capacity = %v, want an error wrapping rmm.ErrOutOfMemory", n, err)
		}
		if p != 0 {
			return desc, fmt.Errorf("Allocate(%d) failed but returned %#x, not 0", n, uintptr(p))
		}
		sys.cfg.cov.OutOfMemory++
		return desc, unchangedAccounting(before, sys.after())
	})
}

func (c tooBigCmd) NextState(s commands.State) commands.State { return s }

func (c tooBigCmd) PreCondition(s commands.State) bool {
	st := s.(*smState)
	return st.seq.s.cfg.capacity > 0 && c.stream < st.seq.views
}

func (c tooBigCmd) PostCondition(_ commands.State, res commands.Result) *gopter.PropResult {
	return postCondition(res)
}

// releaseCmd calls Release; with all set, it frees every live allocation first (on its own
// stream, or spread over the streams when mixed is set). Without a Releaser it only frees.
type releaseCmd struct{ all, mixed, release bool }

func (c releaseCmd) String() string {
	var parts []string
	if c.all {
		if c.mixed {
			parts = append(parts, "FreeAllOnMixedStreams")
		} else {
			parts = append(parts, "FreeAll")
		}
	}
	if c.release {
		parts = append(parts, "Release")
	}
	return strings.Join(parts, "+")
}

func (c releaseCmd) Run(sut commands.SystemUnderTest) commands.Result {
	sys := sut.(*smSystem)
	return sys.step(c, func() (string, error) {
		in := sys.in
		if c.all {
			if err := sys.freeZeroBytes(); err != nil {
				return "", err
			}
			err := in.freeAll(c.mixed)
			clear(sys.tags)
			if err != nil {
				return "", err
			}
			o := in.observe()
			if st, ok := o.stats.(rmm.PoolStats); ok && st.FreeBytes != st.PoolSize {
				return "", fmt.Errorf("everything freed, yet Stats reports %+v", st)
			}
		}
		if c.release {
			if in.releaser == nil {
				// This configuration's resource is not an rmm.Releaser, unlike the probe's.
				return " (not an rmm.Releaser: nothing to release)", nil
			}
			sys.cfg.cov.Releases++
			if err := in.releaser.Release(); err != nil {
				return "", fmt.Errorf("rmmtest: Release: %w", err)
			}
			if err := in.checkReleased(); err != nil {
				return "", err
			}
			if n, _ := in.liveCount(); n == 0 && in.holdsNothing() {
				sys.cfg.cov.ReleasesToNothing++
			}
		}
		return "", nil
	})
}

func (c releaseCmd) NextState(s commands.State) commands.State {
	if !c.all {
		return s
	}
	st := s.(*smState).clone()
	st.allocs = nil
	return st
}

func (c releaseCmd) PreCondition(s commands.State) bool {
	return !c.release || s.(*smState).cfg.releaser
}

func (c releaseCmd) PostCondition(_ commands.State, res commands.Result) *gopter.PropResult {
	return postCondition(res)
}

// ---------------------------------------------------------------------------------------------
// Generation and shrinking.

// drawSize draws an allocation size in [0, hi]: zero, small, multiples of 256 up to 64 KiB,
// log-uniform up to hi, and hi itself (and its neighbours).
func drawSize(r *rand.Rand, hi int) int {
	switch k := r.Intn(100); {
	case k < 4:
		return 0
	case k < 40:
		return 1 + r.Intn(min(hi, kiB))
	case k < 65:
		if hi < rmm.Alignment {
			return 1 + r.Intn(hi)
		}
		return rmm.Alignment * (1 + r.Intn(min(256, hi/rmm.Alignment)))
	case k < 95:
		return logUniform(r, 1, hi)
	}
	switch r.Intn(3) {
	case 0:
		return hi
	case 1:
		return max(1, hi-1)
	}
	return max(1, rmm.AlignDown(hi, rmm.Alignment))
}

// drawCommand draws a command that is valid in state st.
func drawCommand(r *rand.Rand, st *smState) commands.Command {
	cfg, views := st.cfg, st.seq.views
	c := st.seq.s.cfg
	stream := func() int { return r.Intn(views) }
	size := func() int { return drawSize(r, c.maxSize) }
	if c.drawSize != nil {
		size = func() int { return c.drawSize(randv2.New(r)) }
	}
	type choice struct {
		weight int
		make   func() commands.Command
	}
	choices := []choice{
		{30, func() commands.Command { return allocCmd{st.nextTag, size(), stream()} }},
		{2, func() commands.Command { return zeroCmd{stream()} }},
	}
	if c.capacity > 0 {
		choices = append(choices, choice{2, func() commands.Command { return tooBigCmd{1 + r.Intn(2*rmm.Alignment), stream()} }})
	}
	if cfg.releaser {
		choices = append(choices, choice{2, func() commands.Command { return releaseCmd{release: true} }})
	}
	if len(st.allocs) > 0 {
		a := st.allocs[r.Intn(len(st.allocs))]
		choices = append(choices,
			choice{22, func() commands.Command { return freeCmd{a.tag, a.stream} }},
			choice{2, func() commands.Command {
				return releaseCmd{all: true, mixed: r.Intn(2) == 0, release: cfg.releaser && r.Intn(2) == 0}
			}},
		)
		if views > 1 {
			other := (a.stream + 1 + r.Intn(views-1)) % views
			choices = append(choices, choice{8, func() commands.Command { return freeCmd{a.tag, other} }})
		}
	}
	if c.detectsInvalidFree {
		choices = append(choices, choice{2, func() commands.Command {
			return badFreeCmd{kind: badNotHanded, stream: stream(), x: r.Uint32()}
		}})
		var sized []smAlloc
		for _, a := range st.allocs {
			if a.size > 0 {
				sized = append(sized, a)
			}
		}
		if len(sized) > 0 {
			a := sized[r.Intn(len(sized))]
			choices = append(choices, choice{6, func() commands.Command {
				kinds := []int{badInterior, badWrongSize, badDoubleFree}
				return badFreeCmd{kind: kinds[r.Intn(len(kinds))], tag: a.tag, stream: stream(), x: r.Uint32()}
			}})
		}
	}
	total := 0
	for _, ch := range choices {
		total += ch.weight
	}
	k := r.Intn(total)
	for _, ch := range choices {
		if k < ch.weight {
			return ch.make()
		}
		k -= ch.weight
	}
	panic("unreachable")
}

// shrinkCommand offers simpler versions of a command: smaller sizes, DefaultStream, fewer
// options.
func shrinkCommand(v any) gopter.Shrink {
	var cands []any
	switch c := v.(type) {
	case allocCmd:
		for _, n := range []int{0, 1, rmm.Alignment, c.size / 2, rmm.AlignDown(c.size, rmm.Alignment)} {
			if n >= 0 && n < c.size {
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
	case zeroCmd:
		if c.stream != 0 {
			cands = append(cands, zeroCmd{0})
		}
	case badFreeCmd:
		if c.stream != 0 {
			d := c
			d.stream = 0
			cands = append(cands, d)
		}
		if c.x != 0 {
			d := c
			d.x = 0
			cands = append(cands, d)
		}
	case tooBigCmd:
		if c.stream != 0 {
			cands = append(cands, tooBigCmd{c.extra, 0})
		}
	case releaseCmd:
		if c.mixed {
			cands = append(cands, releaseCmd{all: true, release: c.release})
		}
		if c.all && c.release {
			cands = append(cands, releaseCmd{all: true, mixed: c.mixed})
		}
	}
	i := 0
	return func() (any, bool) {
		if i == len(cands) {
			return nil, false
		}
		i++
		return cands[i-1], true
	}
}

// ---------------------------------------------------------------------------------------------
// Running the state machine.

// testStateMachine is Run's StateMachine check: every sequence runs over a resource of s.
func (s *suite) testStateMachine(t tester) {
	seq := &smSeq{s: s, views: 1 + s.cfg.streams}
	runMachine(t, s.cfg, func(*rand.Rand) *smSeq { return seq }, s, false)
}

// runMachine runs the state machine as run says (seed, number and length of the sequences), each
// sequence over a resource in the configuration that next draws from the sequence's random source
// (next must depend only on it: gopter draws the initial state again whenever it replays a
// sequence). The resource probe builds, once, says whether the resources are rmm.Releasers;
// with release set, Release is called in any case (where a resource is not one, that step does
// nothing). It fails t on a failing sequence, and returns what the sequences exercised.
func runMachine(t tester, run *config, next func(r *rand.Rand) *smSeq, probe *suite, release bool) Coverage {
	// A probe says which optional commands apply.
	in := probe.newInstanceNoCleanup(t, 0)
	cfg := &smConfig{t: t, releaser: release || in.releaser != nil}
	if err := in.finish(); err != nil {
		t.Fatalf("tearing down a resource that was never used: %v", err)
	}

	proto := &commands.ProtoCommands{
		NewSystemUnderTestFunc: func(initial commands.State) commands.SystemUnderTest {
			cfg.cov.Sequences++
			seq := initial.(*smState).seq
			return &smSystem{cfg: cfg, seq: seq, in: seq.s.newInstanceNoCleanup(t, seq.s.cfg.streams), tags: map[int]smHandle{}}
		},
		DestroySystemUnderTestFunc: func(sut commands.SystemUnderTest) {
			sys := sut.(*smSystem)
			err := func() (err error) {
				defer func() {
					if p := recover(); p != nil {
						err = fmt.Errorf("panic: %v\n%s", p, debug.Stack())
					}
				}()
				return errors.Join(sys.freeZeroBytes(), sys.in.finish())
			}()
			refusals, retries := sys.in.up.counts()
			cfg.cov.UpstreamRefusals += refusals
			cfg.cov.UpstreamRetries += retries
			switch {
			case sys.failed:
				sys.trace.total = len(sys.steps)
				if cfg.first == nil {
					cfg.first = sys.trace
				}
				cfg.last = sys.trace
			case err != nil && cfg.cleanup == nil:
				cfg.cleanup = &smTrace{config: sys.seq.describe(), steps: sys.steps, failure: err.Error(), at: -1}
			}
		},
		InitialStateGen: func(p *gopter.GenParameters) *gopter.GenResult {
			return gopter.NewGenResult(&smState{cfg: cfg, seq: next(p.Rng)}, gopter.NoShrinker)
		},
		GenCommandFunc: func(state commands.State) gopter.Gen {
			st := state.(*smState)
			return func(p *gopter.GenParameters) *gopter.GenResult {
				return gopter.NewGenResult(drawCommand(p.Rng, st), shrinkCommand)
			}
		},
	}
	params := gopter.DefaultTestParametersWithSeed(run.seed)
	params.MinSuccessfulTests = run.sequences * run.scale
	params.MinSize = 1
	params.MaxSize = run.maxCommands
	params.MaxShrinkCount = 1000
	params.Workers = 1
	res := commands.Prop(proto).Check(params)

	c := cfg.cov
	t.Logf("%d sequences (%d passed): %d allocations, %d out of memory, %d beyond the capacity, %d frees on another stream, %d invalid frees, %d releases (%d to nothing), %d upstream refusals (%d smaller retries granted)",
		c.Sequences, res.Succeeded, c.Allocations, c.OutOfMemory, c.BeyondCapacity, c.CrossStreamFrees, c.InvalidFrees, c.Releases, c.ReleasesToNothing, c.UpstreamRefusals, c.UpstreamRetries)
	hint := replayHint(t, run.seed)
	switch {
	case res.Status == gopter.TestError:
		t.Fatalf("the state machine stopped after %d passing sequences: %v\n%s\nseed %d: %s", res.Succeeded, res.Error, res.ErrorStack, run.seed, hint)
	case !res.Passed() && cfg.last != nil:
		shrinks := 0
		if len(res.Args) > 0 {
			shrinks = res.Args[0].Shrinks
		}
		t.Fatalf("a sequence of %s fails (found after %d passing sequences; shrunk from %s in %d steps):\n%s\nseed %d: %s",
			plural(len(cfg.last.steps), "command"), res.Succeeded, plural(cfg.first.total, "command"), shrinks, cfg.last.format(), run.seed, hint)
	case !res.Passed():
		t.Fatalf("the state machine failed (%v) after %d passing sequences: %v %v\nseed %d: %s", res.Status, res.Succeeded, res.Labels, res.Args, run.seed, hint)
	case cfg.cleanup != nil:
		t.Fatalf("after a passing sequence, tearing the resource down failed:\n%s\nseed %d: %s", cfg.cleanup.format(), run.seed, hint)
	case c.Allocations == 0:
		t.Fatalf("no allocation of a non-zero size succeeded in %d sequences", c.Sequences)
	}
	return c
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// describe gives the configuration for failure reports.
func (s *suite) describe() string {
	c := s.cfg
	capacity := "0 (does not run out)"
	switch {
	case c.strictCapacity:
		capacity = fmt.Sprintf("%d (strict)", c.capacity)
	case c.capacity > 0:
		capacity = fmt.Sprint(c.capacity)
	}
	sizes := fmt.Sprintf("MaxAllocationSize %d", c.maxAllocationSize)
	if c.drawSize != nil {
		sizes = "sizes from Options.DrawSize"
	}
	return fmt.Sprintf("DefaultStream + %d Streams, %s, Capacity %s, DetectsInvalidFree %v", c.streams, sizes, capacity, c.detectsInvalidFree)
}

// format lists the steps, marking the failing one.
func (tr *smTrace) format() string {
	var b strings.Builder
	fmt.Fprintf(&b, "    configuration: %s\n", tr.config)
	for i, st := range tr.steps {
		mark := "  "
		if i == tr.at {
			mark = "=>"
		}
		fmt.Fprintf(&b, "  %s %2d. %s\n", mark, i+1, st)
	}
	if tr.at < 0 {
		fmt.Fprintf(&b, "  => teardown (free everything, Release, Close): %s", tr.failure)
	} else {
		fmt.Fprintf(&b, "  => %s", tr.failure)
	}
	return b.String()
}
