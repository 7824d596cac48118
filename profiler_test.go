package rmm

import (
	"fmt"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// adpEnableStatistics makes a fresh StatisticsResourceAdaptor over host memory the current device
// resource for the rest of the test.
func adpEnableStatistics(t *testing.T) *StatisticsResourceAdaptor {
	t.Helper()
	adpSwapCurrent(t, NewSystemMemoryResource())
	return EnableStatistics()
}

// librmm's Python test_profiler, with buffers of the sizes it asks (10 and 100 bytes; its old
// figures were padded to 16 and 112):
//
//   - f1 allocates two buffers, frees the first and keeps the second: per call peak 20, total 20;
//     called twice → {2 calls, total 40, peak 20}.
//   - f2 allocates b1 and calls g2 (profiled as "g2"), which allocates b2 and frees b1: g2 per call
//     peak 10, total 10; f2 per call peak max(10, 10+10) = 20, total 20; three calls each →
//     f2 {3, 60, 20}, g2 {3, 30, 10}.
//   - f3 allocates 100 buffers of 100 bytes → {1, 10000, 10000}.
//   - On the default profiler: f4 allocates 10 buffers of 10 → {1, 100, 100}; a block "b1 and b2"
//     allocates two of 100 and, inside a nested block "del b1 and b2", frees them →
//     {1, 200, 200} and {1, 0, 0}.
var defaultProfilerRuns atomic.Int64

func TestProfilerLibrmmSequence(t *testing.T) {
	adpEnableStatistics(t)
	mr := CurrentDeviceResource()
	alloc := func(n int) DevicePtr { return adpAlloc(t, mr, n) }
	free := func(p DevicePtr, n int) { adpFree(t, mr, p, n) }

	prof := NewProfiler()
	require.Empty(t, prof.Records())
	require.Contains(t, prof.String(), "No data")

	var kept []DevicePtr
	f1 := func() {
		b1 := alloc(10)
		b2 := alloc(10)
		free(b1, 10)
		kept = append(kept, b2)
	}
	require.NoError(t, prof.Profile("f1", f1))
	require.NoError(t, prof.Profile("f1", f1))

	f2 := func() {
		b1 := alloc(10)
		require.NoError(t, prof.Profile("g2", func() {
			kept = append(kept, alloc(10))
			free(b1, 10)
		}))
	}
	require.NoError(t, prof.Profile("f2", f2))
	require.NoError(t, prof.Profile("f2", f2))
	for _, p := range kept {
		free(p, 10)
	}
	kept = nil
	require.NoError(t, prof.Profile("f2", f2))

	var big []DevicePtr
	require.NoError(t, prof.Profile("f3", func() {
		for range 100 {
			big = append(big, alloc(100))
		}
	}))

	require.Equal(t, map[string]ProfilerRecord{
		"f1": {NumCalls: 2, MemoryTotal: 40, MemoryPeak: 20},
		"f2": {NumCalls: 3, MemoryTotal: 60, MemoryPeak: 20},
		"g2": {NumCalls: 3, MemoryTotal: 30, MemoryPeak: 10},
		"f3": {NumCalls: 1, MemoryTotal: 10000, MemoryPeak: 10000},
	}, prof.Records())

	// The default profiler lives as long as the process: names of this run's own, so that the
	// test also holds under -count.
	def := DefaultProfiler()
	run := fmt.Sprint(defaultProfilerRuns.Add(1))
	var f4 []DevicePtr
	require.NoError(t, def.Profile("adp f4"+run, func() {
		for range 10 {
			f4 = append(f4, alloc(10))
		}
	}))
	func() {
		defer def.Start("adp b1 and b2" + run)()
		b1 := alloc(100)
		b2 := alloc(100)
		func() {
			defer def.Start("adp del b1 and b2" + run)()
			free(b1, 100)
			free(b2, 100)
		}()
	}()
	rec := def.Records()
	require.Equal(t, ProfilerRecord{1, 100, 100}, rec["adp f4"+run])
	require.Equal(t, ProfilerRecord{1, 200, 200}, rec["adp b1 and b2"+run])
	require.Equal(t, ProfilerRecord{1, 0, 0}, rec["adp del b1 and b2"+run])

	for _, p := range kept {
		free(p, 10)
	}
	for _, p := range big {
		free(p, 100)
	}
	for _, p := range f4 {
		free(p, 10)
	}
	st, _ := GetStatistics()
	require.Zero(t, st.CurrentBytes)
	require.Equal(t, 1, CurrentDeviceResource().(*StatisticsResourceAdaptor).Depth())
}

// The report, byte for byte: header, legend, order, columns of 6, 15 and 15 with thousands
// separators, two spaces, the name; no final newline; descending, ties in first-recorded order.
func TestProfilerReport(t *testing.T) {
	p := NewProfiler()
	empty, err := p.Report("")
	require.NoError(t, err)
	require.Equal(t, "Memory Profiling\n================\n\nNo data, maybe profiling wasn't enabled?", empty)

	p.Add("a.go:10(main.small)", Statistics{PeakBytes: 512, TotalBytes: 1024})
	p.Add("b.go:20(main.big)", Statistics{PeakBytes: 1234567890, TotalBytes: 9876543210})
	p.Add("b.go:20(main.big)", Statistics{PeakBytes: 1000, TotalBytes: 1})
	p.Add("c.go:30(main.tie)", Statistics{PeakBytes: 512, TotalBytes: 1024})
	for range 1234 {
		p.Add("d.go:40(main.many)", Statistics{PeakBytes: 1, TotalBytes: 1})
	}

	const header = "Memory Profiling\n" +
		"================\n" +
		"\n" +
		"Legends:\n" +
		"  ncalls       - number of times the function or code block was called\n" +
		"  memory_peak  - peak memory allocated in function or code block (in bytes)\n" +
		"  memory_total - total memory allocated in function or code block (in bytes)\n" +
		"\n"
	const columns = "\n" +
		"ncalls     memory_peak    memory_total  filename:lineno(function)\n"
	rows := map[string]string{
		"small": "     1             512           1,024  a.go:10(main.small)",
		"big":   "     2   1,234,567,890   9,876,543,211  b.go:20(main.big)",
		"tie":   "     1             512           1,024  c.go:30(main.tie)",
		"many":  " 1,234               1           1,234  d.go:40(main.many)",
	}
	for _, tc := range []struct {
		order string
		rows  []string
	}{
		{"memory_peak", []string{"big", "small", "tie", "many"}},
		{"", []string{"big", "small", "tie", "many"}},
		{"num_calls", []string{"many", "big", "small", "tie"}},
		{"memory_total", []string{"big", "many", "small", "tie"}},
	} {
		got, err := p.Report(tc.order)
		require.NoError(t, err)
		order := tc.order
		if order == "" {
			order = "memory_peak"
		}
		var want []string
		for _, r := range tc.rows {
			want = append(want, rows[r])
		}
		require.Equal(t, header+"Ordered by: "+order+"\n"+columns+strings.Join(want, "\n"), got, "ordered by %q", tc.order)
	}
	require.Equal(t, func() string { s, _ := p.Report("memory_peak"); return s }(), p.String())

	_, err = p.Report("memory")
	require.ErrorIs(t, err, ErrInvalidArgument)
}

// Names: an empty name is "<file>:<line>(<function>)" of f, or of the caller of Start.
func TestProfilerNames(t *testing.T) {
	adpEnableStatistics(t)
	p := NewProfiler()
	require.NoError(t, p.Profile("", adpProfiledFunction))
	stop := p.Start("")
	require.NoError(t, stop())
	require.NoError(t, stop(), "a second stop does nothing")
	var names []string
	for name, rec := range p.Records() {
		names = append(names, name)
		require.Equal(t, int64(1), rec.NumCalls)
	}
	require.Len(t, names, 2)
	require.Contains(t, names, fmt.Sprintf("%s:%d(github.com/gormm/rmm.adpProfiledFunction)", adpThisFile(), adpProfiledFunctionLine))
	found := false
	for _, n := range names {
		if strings.HasPrefix(n, adpThisFile()+":") && strings.HasSuffix(n, "(github.com/gormm/rmm.TestProfilerNames)") {
			found = true
		}
	}
	require.True(t, found, "%v", names)
	require.Equal(t, ProfilerRecord{1, 64, 64}, p.Records()[fmt.Sprintf("%s:%d(github.com/gormm/rmm.adpProfiledFunction)", adpThisFile(), adpProfiledFunctionLine)])
}

// adpProfiledFunctionLine is the line of adpProfiledFunction's declaration, as the runtime gives
// it (not written out, so that edits above it do not break the test).
var adpProfiledFunctionLine = func() int {
	_, line := runtime.FuncForPC(reflect.ValueOf(adpProfiledFunction).Pointer()).FileLine(reflect.ValueOf(adpProfiledFunction).Pointer())
	return line
}()

func adpProfiledFunction() {
	mr := CurrentDeviceResource()
	p, _ := mr.Allocate(64, DefaultStream)
	_ = mr.Deallocate(p, 64, DefaultStream)
}

func adpThisFile() string {
	name := callerLocation(0)
	return name[:strings.LastIndex(name[:strings.LastIndex(name, "(")], ":")]
}

// Without statistics enabled the blocks run and nothing is recorded.
func TestProfilerDisabled(t *testing.T) {
	adpSwapCurrent(t, NewSystemMemoryResource())
	p := NewProfiler()
	ran := false
	require.NoError(t, p.Profile("x", func() { ran = true }))
	require.True(t, ran)
	require.NoError(t, p.Start("y")())
	require.Empty(t, p.Records())
	require.Contains(t, p.String(), "No data, maybe profiling wasn't enabled?")
}

// Blocks that do not nest (a level pushed inside and left, or popped from under the block) are
// reported and not recorded; a panicking block is still recorded.
func TestProfilerUnbalanced(t *testing.T) {
	r := adpEnableStatistics(t)
	p := NewProfiler()
	err := p.Profile("pushes", func() { r.PushCounters() })
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, `block "pushes"`)
	require.Equal(t, 2, r.Depth(), "the block removed its own level; the one pushed inside stays")
	_, _ = r.PopCounters()
	require.Equal(t, 1, r.Depth())

	stop := p.Start("popped")
	_, _ = r.PopCounters()
	require.ErrorIs(t, stop(), ErrInvalidArgument)
	require.Empty(t, p.Records())

	func() {
		defer func() { require.Equal(t, "boom", recover()) }()
		_ = p.Profile("panics", func() {
			adpFree(t, r, adpAlloc(t, r, 300), 300)
			panic("boom")
		})
	}()
	require.Equal(t, ProfilerRecord{1, 300, 300}, p.Records()["panics"])
	require.Equal(t, 1, r.Depth())
}

func TestProfilerConcurrentAdd(t *testing.T) {
	p := NewProfiler()
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 1000 {
				p.Add(fmt.Sprint("block", i%4), Statistics{PeakBytes: int64(g*1000 + i), TotalBytes: 2})
				if i%100 == 0 {
					_, _ = p.Report("num_calls")
				}
			}
		}()
	}
	wg.Wait()
	rec := p.Records()
	require.Len(t, rec, 4)
	for i := range 4 {
		r := rec[fmt.Sprint("block", i)]
		require.Equal(t, int64(2000), r.NumCalls)
		require.Equal(t, int64(4000), r.MemoryTotal)
		require.Equal(t, int64(7000+996+i), r.MemoryPeak)
	}
}
