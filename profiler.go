package rmm

import (
	"cmp"
	"fmt"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
)

// ProfilerRecord is what a [Profiler] has recorded under one name: how many times the block ran,
// the bytes it allocated in all, and the most bytes it had allocated at once (the highest peak of
// any one run), as rmm.statistics.ProfilerRecords.Data.
type ProfilerRecord struct {
	NumCalls    int64
	MemoryTotal int64 // bytes, the sum of TotalBytes over the runs
	MemoryPeak  int64 // bytes, the largest PeakBytes of a run
}

// Profiler records the device memory used by named blocks of code, as librmm's Python
// rmm.statistics.profiler: each run of a block pushes a level of counters on the current device
// resource's [StatisticsResourceAdaptor], runs the block, pops the level and adds its figures to
// the block's record (NumCalls += 1, MemoryTotal += TotalBytes, MemoryPeak = max(MemoryPeak,
// PeakBytes)). [EnableStatistics] must have been called: without a StatisticsResourceAdaptor as the
// current device resource the blocks run and nothing is recorded, and Report says "No data, maybe
// profiling wasn't enabled?".
//
// Blocks may nest (a block's figures include those of the blocks it runs). The counter stack is
// the adaptor's, shared by every goroutine allocating through it: blocks run concurrently by
// several goroutines on one adaptor count each other's allocations and do not nest, which
// Profile and the stop function of Start detect and report as an error (wrapping
// [ErrInvalidArgument]) instead of recording wrong figures. The Profiler itself (its records,
// Report) is safe for concurrent use.
type Profiler struct {
	mu      sync.Mutex
	records map[string]*ProfilerRecord
	order   []string // names in the order they were first recorded
}

// NewProfiler returns a [Profiler] with no records.
func NewProfiler() *Profiler {
	return &Profiler{records: map[string]*ProfilerRecord{}}
}

var defaultProfiler = NewProfiler()

// DefaultProfiler returns the package's [Profiler] (rmm.statistics.default_profiler_records), for
// programs that need only one.
func DefaultProfiler() *Profiler { return defaultProfiler }

// Add adds one run with statistics st to the record named name: NumCalls += 1, MemoryTotal +=
// st.TotalBytes, MemoryPeak = max(MemoryPeak, st.PeakBytes).
func (p *Profiler) Add(name string, st Statistics) {
	p.mu.Lock()
	defer p.mu.Unlock()
	rec, ok := p.records[name]
	if !ok {
		rec = &ProfilerRecord{}
		p.records[name] = rec
		p.order = append(p.order, name)
	}
	rec.NumCalls++
	rec.MemoryTotal += st.TotalBytes
	rec.MemoryPeak = max(rec.MemoryPeak, st.PeakBytes)
}

// Records returns a copy of the records, by name.
func (p *Profiler) Records() map[string]ProfilerRecord {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]ProfilerRecord, len(p.records))
	for name, rec := range p.records {
		out[name] = *rec
	}
	return out
}

// Profile runs f as the block named name and adds the memory it allocated through the current
// device resource to the record (see the type's comment). An empty name names the block after f:
// "<file>:<line>(<function>)", where f is defined, as the Python decorator does. The figures are
// recorded also when f panics. The error, when statistics are enabled and the counter stack was
// not as deep after f as before it (f, or another goroutine, pushed or popped levels without
// balancing them), wraps [ErrInvalidArgument]; nothing is recorded then. Blocks profiled from
// several goroutines at once on one statistics adaptor do not nest and fail this way (each still
// removes its own level); see [WithStatistics].
func (p *Profiler) Profile(name string, f func()) (err error) {
	if name == "" {
		name = funcLocation(f)
	}
	stop := p.start(name)
	defer func() {
		if e := stop(); err == nil {
			err = e
		}
	}()
	f()
	return nil
}

// Start begins a block named name and returns the function that ends it and records it (see
// Profile), for blocks that are not a function of their own:
//
//	defer profiler.Start("load")()
//
// An empty name names the block after where Start was called: "<file>:<line>(<function>)". The
// stop function records once; calling it again does nothing and returns nil (it must not be
// called by two goroutines at once). It returns the error Profile would.
func (p *Profiler) Start(name string) (stop func() error) {
	if name == "" {
		name = callerLocation(1)
	}
	return p.start(name)
}

// start pushes a level on the current statistics adaptor and returns the function that pops it
// and records it; with no statistics adaptor both do nothing.
func (p *Profiler) start(name string) func() error {
	r, ok := currentStatistics()
	if !ok {
		return func() error { return nil }
	}
	scope := r.pushAt()
	done := false
	return func() error {
		if done {
			return nil
		}
		done = true
		st, err := r.popAt(scope)
		if err != nil {
			return errorf("Profiler: block %q: %w", name, err)
		}
		p.Add(name, st)
		return nil
	}
}

// funcLocation names a function value as "<file>:<line>(<function>)".
func funcLocation(f func()) string {
	fn := runtime.FuncForPC(reflect.ValueOf(f).Pointer())
	if fn == nil {
		return "unknown"
	}
	file, line := fn.FileLine(fn.Entry())
	return fmt.Sprintf("%s:%d(%s)", file, line, fn.Name())
}

// callerLocation names the caller skip frames above its caller as "<file>:<line>(<function>)".
func callerLocation(skip int) string {
	pc, file, line, ok := runtime.Caller(skip + 1)
	if !ok {
		return "unknown"
	}
	name := "?"
	if fn := runtime.FuncForPC(pc); fn != nil {
		name = fn.Name()
	}
	return fmt.Sprintf("%s:%d(%s)", file, line, name)
}

// Report orders for Profiler.Report.
var profilerOrders = map[string]func(ProfilerRecord) int64{
	"memory_peak":  func(r ProfilerRecord) int64 { return r.MemoryPeak },
	"num_calls":    func(r ProfilerRecord) int64 { return r.NumCalls },
	"memory_total": func(r ProfilerRecord) int64 { return r.MemoryTotal },
}

// Report formats the records as rmm.statistics.ProfilerRecords.report does, ordered by
// orderedBy, descending: "memory_peak" (also for ""), "num_calls" or "memory_total"; records that
// tie keep the order in which their names were first recorded. The text is a header, a legend,
// the order, and a table with one row per record — NumCalls right-aligned in 6 columns,
// MemoryPeak and MemoryTotal in 15, with thousands separators, then two spaces and the name —
// without a final newline. With no records it is the header and "No data, maybe profiling wasn't
// enabled?". Another orderedBy returns an error wrapping ErrInvalidArgument.
func (p *Profiler) Report(orderedBy string) (string, error) {
	if orderedBy == "" {
		orderedBy = "memory_peak"
	}
	key, ok := profilerOrders[orderedBy]
	if !ok {
		return "", errorf("Profiler.Report: cannot order by %q (memory_peak, num_calls or memory_total): %w", orderedBy, ErrInvalidArgument)
	}
	type row struct {
		name string
		rec  ProfilerRecord
	}
	p.mu.Lock()
	rows := make([]row, len(p.order))
	for i, name := range p.order {
		rows[i] = row{name, *p.records[name]}
	}
	p.mu.Unlock()
	slices.SortStableFunc(rows, func(x, y row) int { return cmp.Compare(key(y.rec), key(x.rec)) })

	var b strings.Builder
	b.WriteString("Memory Profiling\n================\n\n")
	if len(rows) == 0 {
		b.WriteString("No data, maybe profiling wasn't enabled?")
		return b.String(), nil
	}
	b.WriteString("Legends:\n")
	b.WriteString("  ncalls       - number of times the function or code block was called\n")
	b.WriteString("  memory_peak  - peak memory allocated in function or code block (in bytes)\n")
	b.WriteString("  memory_total - total memory allocated in function or code block (in bytes)\n")
	b.WriteString("\nOrdered by: " + orderedBy + "\n")
	b.WriteString("\nncalls     memory_peak    memory_total  filename:lineno(function)")
	for _, r := range rows {
		fmt.Fprintf(&b, "\n%6s %15s %15s  %s", groupThousands(r.rec.NumCalls), groupThousands(r.rec.MemoryPeak), groupThousands(r.rec.MemoryTotal), r.name)
	}
	return b.String(), nil
}

// String is Report("memory_peak").
func (p *Profiler) String() string {
	s, _ := p.Report("memory_peak")
	return s
}
