package rmm

import (
	"io"
	"math"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/google/pprof/profile"
)

// Profile returns the samples as a profile in pprof's model, as Go's heap profile
// (runtime/pprof's "heap"):
//
//   - sample types alloc_objects/count, alloc_space/bytes, inuse_objects/count and
//     inuse_space/bytes, in that order, the default being inuse_space; PeriodType space/bytes
//     and Period the sampling rate;
//   - one sample per call stack and allocation size, its values the counts and bytes of the
//     sampled allocations made there (alloc_*) and of those not yet freed (inuse_*), scaled to
//     estimates of all allocations as runtime/pprof scales its own: each multiplied by
//     1/(1-exp(-size/rate)), or left as they are at rate 1; a numeric label "bytes" holds the
//     allocation size;
//   - its locations innermost first, starting at the caller of Allocate (the adaptor's or the
//     pool's), with functions, files
//     and lines from runtime.CallersFrames, inlined calls folded into their caller's location
//     and the wrappers the compiler generates left out (as runtime.Callers leaves them out);
//     one mapping, the executable (os.Executable), marked as already symbolized.
//
// The profile is the caller's to change.
func (r *MemoryProfile) Profile() *profile.Profile {
	p := &profile.Profile{
		SampleType: []*profile.ValueType{
			{Type: "alloc_objects", Unit: "count"},
			{Type: "alloc_space", Unit: "bytes"},
			{Type: "inuse_objects", Unit: "count"},
			{Type: "inuse_space", Unit: "bytes"},
		},
		DefaultSampleType: "inuse_space",
		PeriodType:        &profile.ValueType{Type: "space", Unit: "bytes"},
		Period:            int64(r.rate),
		TimeNanos:         time.Now().UnixNano(),
	}
	lb := memProfLocations{p: p, locs: map[string]*profile.Location{}, funcs: map[[2]string]*profile.Function{}}
	for _, b := range r.snapshot() {
		frees := b.frees.Load() // before allocs: a free is counted after its allocation
		allocs := b.allocs.Load()
		if allocs == 0 {
			continue
		}
		inuse := max(allocs-frees, 0)
		v := make([]int64, 4)
		v[0], v[1] = scaleHeapSample(allocs, allocs*b.size, int64(r.rate))
		v[2], v[3] = scaleHeapSample(inuse, inuse*b.size, int64(r.rate))
		p.Sample = append(p.Sample, &profile.Sample{
			Location: lb.stack(b.stack),
			Value:    v,
			NumLabel: map[string][]int64{"bytes": {b.size}},
		})
	}
	lb.mapping()
	return p
}

// scaleHeapSample is runtime/pprof's: it turns the count and bytes sampled at rate from
// allocations of one size into estimates of all of them.
func scaleHeapSample(count, size, rate int64) (int64, int64) {
	if count == 0 || size == 0 {
		return 0, 0
	}
	if rate <= 1 {
		// At rate 1 every allocation was recorded.
		return count, size
	}
	avgSize := float64(size) / float64(count)
	scale := 1 / (1 - math.Exp(-avgSize/float64(rate)))
	return int64(float64(count) * scale), int64(float64(size) * scale)
}

// WriteProfile writes Profile() to w in pprof's format (gzip-compressed protocol buffers), as
// runtime/pprof writes Go's heap profile; go tool pprof reads it.
func (r *MemoryProfile) WriteProfile(w io.Writer) error {
	return r.Profile().Write(w)
}

// memProfLocations builds the locations and functions of a profile from stacks of return PCs.
type memProfLocations struct {
	p     *profile.Profile
	locs  map[string]*profile.Location    // by the PCs of its frames
	funcs map[[2]string]*profile.Function // by name and file
}

// stack returns the locations of stk, innermost first. stk holds return PCs: one per frame on
// the stack (fpwalk.Callers), or one per logical frame, inlined calls included
// (runtime.Callers); runtime.CallersFrames expands both to the same logical frames. A logical
// frame inlined into its caller shares its caller's location (as runtime/pprof does): the
// location holds one line per function, the inlined ones first. runtime.goexit and the wrappers
// the compiler generates are left out, as runtime.Callers leaves them out (see memProfWrapper).
func (lb *memProfLocations) stack(stk []uintptr) []*profile.Location {
	var out []*profile.Location
	var frames []runtime.Frame
	flush := func() {
		// The wrappers go after the grouping, since a wrapper can be the physical frame that
		// holds the calls inlined into it.
		kept := frames[:0]
		for _, f := range frames {
			if !memProfWrapper(f) {
				kept = append(kept, f)
			}
		}
		if len(kept) > 0 {
			out = append(out, lb.location(kept))
		}
		frames = frames[:0]
	}
	it := runtime.CallersFrames(stk)
	for more := len(stk) > 0; more; {
		var f runtime.Frame
		f, more = it.Next()
		if f.PC == 0 || f.Function == "runtime.goexit" {
			continue
		}
		if n := len(frames); n > 0 {
			last := frames[n-1]
			// A location holds the frames of one physical call: the next frame joins it while
			// the last is inlined (Func is nil) into the same function (entry) and the next is
			// not a recursive call of it.
			if last.Func != nil || last.Entry == 0 || last.Entry != f.Entry || last.Function == f.Function {
				flush()
			}
		}
		frames = append(frames, f)
	}
	flush()
	return out
}

// memProfWrapper reports whether f is the frame of a function the compiler generated to adapt a
// call, which runtime.Callers leaves out of stacks (the runtime marks them as wrappers, which
// runtime.Frame does not tell) and a stack taken by frame pointers does not: methods promoted
// from embedded fields and other method wrappers, method values (names ending "-fm"; these are
// in the file "<autogenerated>"), the closures of go and defer statements with arguments (names
// ending ".gowrapN" and ".deferwrapN") and runtime.deferreturn.
func memProfWrapper(f runtime.Frame) bool {
	if f.File == "<autogenerated>" || f.Function == "runtime.deferreturn" {
		return true
	}
	name := strings.TrimRight(f.Function, "0123456789")
	return len(name) < len(f.Function) && (strings.HasSuffix(name, ".gowrap") || strings.HasSuffix(name, ".deferwrap"))
}

// location returns the location of frames, one physical call's (innermost first).
func (lb *memProfLocations) location(frames []runtime.Frame) *profile.Location {
	var key strings.Builder
	for _, f := range frames {
		key.WriteString(strconv.FormatUint(uint64(f.PC), 16))
		key.WriteByte(' ')
	}
	if l, ok := lb.locs[key.String()]; ok {
		return l
	}
	l := &profile.Location{ID: uint64(len(lb.p.Location) + 1), Address: uint64(frames[0].PC)}
	for _, f := range frames {
		l.Line = append(l.Line, profile.Line{Function: lb.function(f), Line: int64(f.Line)})
	}
	lb.p.Location = append(lb.p.Location, l)
	lb.locs[key.String()] = l
	return l
}

// mapping gives the locations one mapping, the executable's, from the lowest of their addresses
// to the highest, marked as symbolized (functions, files, lines and inlined calls), so that
// pprof names the program and does not look for its binary.
func (lb *memProfLocations) mapping() {
	if len(lb.p.Location) == 0 {
		return
	}
	m := &profile.Mapping{ID: 1, Start: math.MaxUint64, HasFunctions: true, HasFilenames: true, HasLineNumbers: true, HasInlineFrames: true}
	m.File, _ = os.Executable()
	for _, l := range lb.p.Location {
		m.Start = min(m.Start, l.Address)
		m.Limit = max(m.Limit, l.Address+1)
		l.Mapping = m
	}
	lb.p.Mapping = []*profile.Mapping{m}
}

// function returns the function of frame f.
func (lb *memProfLocations) function(f runtime.Frame) *profile.Function {
	k := [2]string{f.Function, f.File}
	if fn, ok := lb.funcs[k]; ok {
		return fn
	}
	fn := &profile.Function{ID: uint64(len(lb.p.Function) + 1), Name: f.Function, SystemName: f.Function, Filename: f.File}
	lb.p.Function = append(lb.p.Function, fn)
	lb.funcs[k] = fn
	return fn
}
