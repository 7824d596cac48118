// Command rmm-replay replays an RMM CSV event log (written by librmm's logging_resource_adaptor
// or by rmm.LoggingResourceAdaptor) against a gormm/rmm memory resource, in the log's exact
// global order, and prints how fast it went and how much memory it took.
//
//	rmm-replay [flags] TRACE.csv[.gz]
//
// By default the resource is the pool a program gets by default (rmm.PoolKind's zero value): a
// stitching PoolMemoryResource over the GPU (device 0), or over host memory
// (SystemMemoryResource) where there is no CUDA device — librmm's pool where the GPU lacks
// virtual memory management; the first line of output names it. -simulate SIZE replaces the
// upstream with an address-only resource of SIZE bytes, so that a trace recorded on a large GPU
// replays anywhere.
//
// -mr takes several resources, separated by commas (-mr plain,stitching,async): each is made
// fresh and replayed in turn on the same trace, and the report is one table with a row per
// resource (with -json, a list of objects); those that need a GPU are left out, with a note on
// standard error, where there is none. -plot draws the bytes the trace holds live and each
// resource's reserved bytes along the trace.
//
// For an expandable pool (stitching or not) the report also counts what it asked of the driver's
// virtual memory management in each pass (rmm.VMMStats): the physical handles it made, mapped and
// gave back, the ranges it stitched, and the address space it held at the pass's end: a later
// pass makes none where the earlier ones mapped all it needs.
//
// Flags:
//
//	-mr LIST          the resources to replay on, separated by commas (default pool):
//	                  pool        the default pool: stitching, or plain where the GPU lacks
//	                              virtual memory management
//	                  stitching   an expandable pool that stitches (rmm.StitchingPool): free
//	                              pieces of physical memory are mapped again, back to back, to
//	                              serve a request that no free block holds, instead of growing
//	                  expandable  an expandable pool that does not stitch (rmm.ExpandablePool):
//	                              one address range grown by mapped chunks
//	                  plain       librmm's pool (rmm.PlainPool), which grows by allocations from
//	                              the upstream
//	                  cuda, async, managed   CudaMemoryResource, CudaAsyncMemoryResource,
//	                              ManagedMemoryResource: these need a GPU
//	                  system      SystemMemoryResource (host memory)
//	                  The pools run over the GPU, over host memory where there is none, or over
//	                  -simulate's memory. An expandable pool's peak reserved is its peak mapped
//	                  size; librmm's pool's the most it held from the upstream.
//	-initial SIZE     pool initial size, or the async pool's priming size (default 0); for
//	                  the pools a multiple of 256 bytes
//	-maximum SIZE     pool maximum size, a multiple of 256 bytes, at least -initial (default
//	                  none)
//	-simulate SIZE    replay the pools over an address-only upstream of SIZE bytes
//	-device N         CUDA device (default 0)
//	-passes N         replay N times on the same resource (a pool keeps what it grew in earlier
//	                  passes); report each wall time and the median (default 1)
//	-serial           replay every event from one goroutine, as librmm's replay benchmark does
//	                  single-threaded (rmm.ReplayOptions.Serial): the same calls in the same order,
//	                  without the hand-off between goroutines where the logged thread changes
//	                  (default: one goroutine per logged thread)
//	-floor PAGE       also report the page floor: the most bytes of PAGE-sized pages (e.g. 2MiB,
//	                  the granularity of the driver's virtual memory on current GPUs; at least
//	                  4KiB) that held part of a live allocation at once, at the addresses the
//	                  resource gave out, over all passes — what a pool that could map and unmap
//	                  every page on its own would hold at least with the same placement. It
//	                  counts every page an allocation touches, so it slows the replay (more for
//	                  smaller pages): time it without
//	-plot FILE        draw, into FILE.svg or FILE.png, the bytes the trace holds live (a grey
//	                  area) and each resource's reserved bytes (a line each: a pool's size, what
//	                  a plain resource handed out, the async pool's reserved memory) after every
//	                  event, over the trace's time (its event index where the times are not
//	                  usable), later passes after the first; each line keeps the largest value
//	                  of each of at most 1200 runs of events. Sampling slows the replay a little
//	-window N         also report figures per window of N events (at least 1), over all passes'
//	                  events in sequence (window k holds events kN to (k+1)N-1 of the passes
//	                  one after the other): the wall time per event, the bytes live and the
//	                  resource's reserved bytes at the window's end and at most over it, and for
//	                  an expandable pool the driver calls made in it and the stitched ranges and
//	                  address space it holds at its end; a table after the report (with -json,
//	                  "windows" in each resource's object). The wall time of a window leaves out
//	                  the first event of a pass, which starts before the clock can be read
//	-json             write the result as JSON: one object, or a list for several resources
//	-allow-failures   exit 0 even when allocations fail that the trace did not log as failures
//	-v                print every allocation that fails during the replay
//
// Sizes take units: 1073741824, 1GiB, 1.5GB (SI units are powers of 1000, "i" units of 1024).
//
// Exit status: 0; 1 on an error; 2 on a bad command line; 3 when allocations failed that the
// trace did not log as failures (on any of the resources), unless -allow-failures.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/internal/cli"
	"golang.org/x/term"
)

// sizeFlag is a byte count given with optional units.
type sizeFlag struct {
	n   int
	set bool
}

func (f *sizeFlag) String() string { return fmt.Sprint(f.n) }

func (f *sizeFlag) Set(s string) error {
	v, err := rmm.ParseBytes(s)
	if err != nil {
		return err
	}
	f.n, f.set = v, true
	return nil
}

func main() { cli.Main("rmm-replay", run, exitStatus) }

// exitStatus is the exit status for run's error: 0 for none (or -h), 2 for a bad command line, 3
// when allocations failed, 1 for any other error.
func exitStatus(err error) int {
	if errors.Is(err, errFailures) && !errors.Is(err, errUsage) {
		return 3
	}
	return cli.Status(err)
}

var (
	errUsage   = cli.ErrUsage
	errPrinted = cli.ErrPrinted
	// errFailures marks a replay in which allocations failed that the trace did not log as
	// failures (the report was printed).
	errFailures = errors.New("allocations failed")
)

var usagef = cli.Usagef

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("rmm-replay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	mrList := fs.String("mr", "pool", "resources to replay on, in turn, separated by commas: pool (the default pool: stitching, or plain where the GPU lacks virtual memory management), stitching, expandable, plain (librmm's pool), cuda, async, managed or system")
	var initial, maximum, simulate sizeFlag
	fs.Var(&initial, "initial", "pool initial size (a multiple of 256 bytes), or the async pool's priming size (default 0)")
	fs.Var(&maximum, "maximum", "pool maximum size: a multiple of 256 bytes, at least -initial (default none)")
	fs.Var(&simulate, "simulate", "replay the pools over an address-only upstream of this many bytes")
	device := fs.Int("device", 0, "CUDA device")
	passes := fs.Int("passes", 1, "replay this many times on the same resource (a pool keeps what it grew); report the median")
	serial := fs.Bool("serial", false, "replay every event from one goroutine (as librmm's replay benchmark does single-threaded), not one goroutine per logged thread")
	verbose := fs.Bool("v", false, "print every allocation that fails during the replay")
	asJSON := fs.Bool("json", false, "write the result as JSON instead of text: an object per resource (name, resource, trace, events, failures, passes, wall_ns, ns_per_event, peak_live_bytes, peak_reserved_bytes, reserved_over_live, pool_at_end, vmm, vmm_per_pass, windows, ...), a list of them when -mr names several; vmm counts a pool's driver calls since it was made (its range's reservation comes before the first pass), vmm_per_pass those of each pass")
	allowFailures := fs.Bool("allow-failures", false, "exit 0 even when allocations the trace did not log as failures fail in the replay (default: exit 3)")
	var floor sizeFlag
	fs.Var(&floor, "floor", "also report the page floor for pages of this size (e.g. 2MiB; at least 4KiB): the most bytes of pages holding part of a live allocation at once, over all passes (slows the replay)")
	plotPath := fs.String("plot", "", "draw the live bytes and each resource's reserved bytes along the trace into this file (.svg or .png)")
	window := fs.Int("window", 0, "also report figures per window of this many events, over all passes' events in sequence (a window may span two passes): wall time per event, live and reserved bytes at the end and at most, a pool's driver calls (default 0: no windows)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: rmm-replay [flags] TRACE.csv[.gz]")
		fmt.Fprintln(stderr, "Sizes are bytes, or a number and a unit: 1073741824, 4GiB, 512MiB, 1.5GB.")
		fmt.Fprintln(stderr, "Exit status: 0; 1 on an error; 2 on a bad command line; 3 when allocations failed (see -allow-failures).")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return cli.Printed(fmt.Errorf("%w: %w", errUsage, err))
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return usagef("need exactly one trace file")
	}
	if *passes < 1 {
		return usagef("-passes %d: must be at least 1", *passes)
	}
	names, err := parseMRList(*mrList)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	for _, n := range names {
		switch {
		case maximum.set && !isPool(n):
			return usagef("-maximum works with the pools only: -mr %s (got -mr %s)", poolNames, n)
		case initial.set && !isPool(n) && n != mrAsync:
			return usagef("-initial works with the pools or async only (got -mr %s)", n)
		case simulate.set && !isPool(n):
			return usagef("-simulate works with the pools only: -mr %s (got -mr %s)", poolNames, n)
		}
	}
	if slices.ContainsFunc(names, isPool) {
		// The pools' own checks, made here so that a bad size is a bad command line (exit 2)
		// found before the trace is read, not a resource that fails to build.
		for _, f := range []struct {
			name string
			size sizeFlag
		}{{"initial", initial}, {"maximum", maximum}} {
			if f.size.n%rmm.Alignment != 0 {
				return usagef("-%s %d: a pool's sizes must be multiples of %d bytes (e.g. 256, 4KiB, 1GiB)", f.name, f.size.n, rmm.Alignment)
			}
		}
		if maximum.n > 0 && initial.n > maximum.n {
			return usagef("-initial %d (%s) exceeds -maximum %d (%s)", initial.n, rmm.FormatBytes(int64(initial.n)), maximum.n, rmm.FormatBytes(int64(maximum.n)))
		}
	}
	if simulate.set && simulate.n <= 0 {
		return usagef("-simulate %d: the simulated memory needs a positive size", simulate.n)
	}
	if *window < 0 {
		return usagef("-window %d: a window holds at least 1 event (0: no windows)", *window)
	}
	if floor.set && floor.n < minFloorPage {
		return usagef("-floor %d: the page size must be at least %d bytes (4KiB)", floor.n, minFloorPage)
	}
	var format string
	if *plotPath != "" {
		if format, err = plotFormat(*plotPath); err != nil {
			return fmt.Errorf("%w: %w", errUsage, err)
		}
	}

	s := &setup{dev: rmm.Device(*device), cudaErr: rmm.CUDAAvailable(), initial: initial, maximum: maximum, simulate: simulate}
	if s.cudaErr != nil {
		s.where = "no CUDA device: " + noDeviceReason(s.cudaErr)
	}
	if err := rmm.SetCurrentDevice(s.dev); err != nil {
		return fmt.Errorf("%w: -device %d: %w", errUsage, *device, err)
	}
	if s.cudaErr == nil {
		name, _ := s.dev.Name()
		s.where = fmt.Sprintf("device %d (%s)", *device, name)
	}
	// A resource that cannot be made here (it needs a GPU) is left out with a note when others
	// can run; alone, it fails the run before the trace is read. The report keeps the shape -mr
	// asked for (a table, a JSON list) even when one resource is left.
	several := len(names) > 1
	var runnable []string
	var skipped error
	for _, n := range names {
		if err := s.unavailable(n); err != nil {
			skipped = err
			fmt.Fprintf(stderr, "rmm-replay: left out: %v\n", err)
			continue
		}
		runnable = append(runnable, n)
	}
	if len(runnable) == 0 {
		return skipped
	}
	names = runnable
	path := fs.Arg(0)
	events, err := rmm.ReadLogFile(path)
	if err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			err = fmt.Errorf("%w (the file is cut short)", err)
		}
		return err
	}

	var plotFile *os.File
	if *plotPath != "" {
		// Made now, so that a file that cannot be written fails before the replays.
		if plotFile, err = os.Create(*plotPath); err != nil {
			return fmt.Errorf("-plot: %w", err)
		}
		defer func() {
			if plotFile != nil { // not written: an error came first
				plotFile.Close()
				os.Remove(*plotPath)
			}
		}()
	}

	width := 0
	for _, n := range names {
		width = max(width, len(n))
	}
	rp := &replayer{events: events, passes: *passes, serial: *serial, window: *window, stderr: stderr, several: several}
	if floor.set {
		rp.floorPage = floor.n
	}
	if *verbose {
		rp.onFailure = func(name string, e rmm.LogEvent, err error) {
			if rp.several {
				fmt.Fprintf(stderr, "%s: ", name)
			}
			fmt.Fprintf(stderr, "line %d: allocate %d bytes: %v\n", e.Line, e.Size, err)
		}
	}
	var live *series // sampled on the first resource: the same on all
	if plotFile != nil {
		live = newSeries(len(events)**passes, maxPlotPoints)
	}
	var runs []*replayRun
	for i, n := range names {
		t, err := s.build(n)
		if err != nil {
			return err
		}
		if !*asJSON {
			if rp.several {
				fmt.Fprintf(stdout, "rmm-replay: %-*s  %s\n", width, n, t.desc)
			} else {
				fmt.Fprintf(stdout, "rmm-replay: %s\n", t.desc)
			}
		}
		var reserved *series
		if plotFile != nil {
			reserved = newSeries(len(events)**passes, maxPlotPoints)
		}
		progress := ""
		if rp.several {
			progress = fmt.Sprintf("%s (%d of %d), ", n, i+1, len(names))
		}
		sampleLive := live
		if i > 0 {
			sampleLive = nil
		}
		r, err := rp.replay(t, progress, sampleLive, reserved)
		if err != nil {
			return fmt.Errorf("-mr %s: replaying %s: %w", n, path, err)
		}
		runs = append(runs, r)
	}

	if plotFile != nil {
		f := footprintOf(path, s, runs, rp, live)
		err := f.write(plotFile, format)
		if cerr := plotFile.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(*plotPath)
			plotFile = nil
			return fmt.Errorf("-plot %s: %w", *plotPath, err)
		}
		plotFile = nil
	}

	failures := 0
	for _, r := range runs {
		failures += r.failures
	}
	var werr error
	switch {
	case *asJSON && !several:
		werr = writeJSON(stdout, runs[0].json(path))
	case *asJSON:
		list := make([]replayJSON, len(runs))
		for i, r := range runs {
			list[i] = r.json(path)
		}
		werr = writeJSON(stdout, list)
	case !several:
		runs[0].report(stdout, path)
	default:
		writeTable(stdout, path, runs)
	}
	if !*asJSON && rp.window > 0 {
		for _, r := range runs {
			fmt.Fprintln(stdout)
			writeWindows(stdout, r, rp.window, several)
		}
	}
	if werr != nil {
		return werr
	}
	if failures > 0 && !*allowFailures {
		var each []string
		for _, r := range runs {
			if r.failures > 0 && len(runs) > 1 {
				each = append(each, fmt.Sprintf("%d on %s", r.failures, r.name))
			}
		}
		on := ""
		if len(each) > 0 {
			on = " (" + strings.Join(each, ", ") + ")"
		}
		in := "in one pass"
		if *passes > 1 {
			in = fmt.Sprintf("over %d passes", *passes)
		}
		return fmt.Errorf("%w: %d allocations failed %s%s that the trace did not log as failures (-allow-failures to exit 0)", errFailures, failures, in, on)
	}
	return nil
}

// replayer replays the trace on one resource after another.
type replayer struct {
	events    []rmm.LogEvent
	passes    int
	serial    bool // -serial
	floorPage int  // -floor, or 0
	window    int  // -window, or 0
	onFailure func(name string, e rmm.LogEvent, err error)
	stderr    io.Writer
	several   bool // more than one resource
}

// replayRun is what the passes on one resource gave.
type replayRun struct {
	name, desc string
	legend     string // how a plot's legend names it
	serial     bool   // -serial
	results    []rmm.ReplayResult
	failures   int            // over all passes
	reserved   int64          // the most bytes the resource held (0: unknown)
	floor      *floorResource // with -floor
	pool       *rmm.PoolStats // a pool's figures after the last pass
	kind       rmm.PoolKind   // a pool's kind
	vmmPasses  []rmm.VMMStats // an expandable pool's driver calls in each pass
	windows    []window       // with -window
	series     *series        // reserved bytes along the passes, with -plot
}

// replay replays the passes on t and closes it. With -plot it samples the reserved bytes after
// every event into reserved and, when live is not nil, the live bytes into live; with -window it
// measures the windows. An expandable pool's driver calls are read before and after each pass.
func (rp *replayer) replay(t *target, progress string, live, reserved *series) (*replayRun, error) {
	if t.close != nil {
		defer t.close()
	}
	run := &replayRun{name: t.name, desc: t.desc, legend: t.legend(), serial: rp.serial}
	opts := &rmm.ReplayOptions{Serial: rp.serial}
	if rp.onFailure != nil {
		opts.OnFailure = func(e rmm.LogEvent, err error) { rp.onFailure(t.name, e, err) }
	}
	var vmm rmm.VMMStats
	if t.countsVMM() {
		vmm = t.pool.Stats().VMM
	}
	var pass int
	var win *windowSampler
	if rp.window > 0 {
		win = newWindowSampler(rp.window, len(rp.events), rp.passes, t, vmm)
	}
	if reserved != nil || win != nil {
		n := len(rp.events)
		opts.AfterEvent = func(i int, liveBytes int64) {
			if reserved != nil {
				k := pass*n + i
				if live != nil {
					live.add(k, liveBytes)
				}
				reserved.add(k, t.reservedNow())
			}
			if win != nil {
				win.after(pass, i, liveBytes)
			}
		}
	}
	target := t.mr
	if rp.floorPage > 0 {
		run.floor = &floorResource{MemoryResource: t.mr, page: rp.floorPage, refs: map[uintptr]int32{}}
		target = run.floor
	}
	stop := startProgress(rp.stderr, progress, rp.passes, func() int { return len(run.results) })
	for pass = 0; pass < rp.passes; pass++ {
		r, err := rmm.Replay(rp.events, target, opts)
		if err != nil {
			stop()
			return nil, err
		}
		if t.countsVMM() {
			now := t.pool.Stats().VMM
			run.vmmPasses = append(run.vmmPasses, vmmSince(vmm, now))
			vmm = now
		}
		progressMu.Lock()
		run.results = append(run.results, r)
		progressMu.Unlock()
		run.failures += r.Failures
	}
	stop()
	run.reserved = t.reservedPeak()
	if t.pool != nil {
		st := t.pool.Stats()
		run.pool, run.kind = &st, t.pool.Kind()
	}
	if reserved != nil && run.reserved > 0 {
		run.series = reserved
	}
	if win != nil {
		run.windows = win.windows
	}
	return run, nil
}

// median returns the median wall time of the passes.
func (r *replayRun) median() time.Duration {
	walls := make([]time.Duration, len(r.results))
	for i, x := range r.results {
		walls[i] = x.Wall
	}
	return medianOf(walls)
}

// floorBytes returns the page floor in bytes (0 without -floor).
func (r *replayRun) floorBytes() int64 {
	if r.floor == nil {
		return 0
	}
	return int64(r.floor.peak) * int64(r.floor.page)
}

// json returns the run's figures as -json writes them.
func (r *replayRun) json(path string) replayJSON {
	x := r.results[0]
	median := r.median()
	j := replayJSON{
		Name: r.name, Resource: r.desc, Trace: path, Events: x.Events, Allocations: x.Allocations, Frees: x.Frees,
		LoggedFailures: x.LoggedFailures, Threads: x.Threads, Serial: r.serial, Failures: r.failures, Passes: len(r.results),
		MedianWallNs: median.Nanoseconds(), NsPerEvent: float64(median.Nanoseconds()) / float64(max(x.Events, 1)),
		PeakLiveBytes: x.PeakLiveBytes, PeakReservedBytes: r.reserved,
		LeftAllocations: x.LeftAllocations, LeftBytes: x.LeftBytes, UnmatchedFrees: x.UnmatchedFrees,
		MismatchedFrees: x.MismatchedFrees, DuplicateAllocations: x.DuplicateAllocations,
	}
	for _, y := range r.results {
		j.WallNs = append(j.WallNs, y.Wall.Nanoseconds())
	}
	for i := range r.windows {
		j.Windows = append(j.Windows, r.windows[i].json())
	}
	if r.reserved > 0 {
		j.ReservedOverLive = float64(r.reserved) / float64(max(x.PeakLiveBytes, 1))
	}
	if r.floor != nil {
		j.PageFloorBytes, j.PageBytes = r.floorBytes(), r.floor.page
	}
	if st := r.pool; st != nil {
		j.PoolAtEnd = &poolJSON{st.PoolSize, st.PeakPoolSize, st.MaximumPoolSize, st.FreeBytes, st.FreeBlocks,
			st.LargestFreeBlock, st.UpstreamBlocks, st.Streams, st.Holes, st.HoleBytes}
		if len(r.vmmPasses) > 0 {
			v := vmmJSON(st.VMM)
			j.VMM = &v
			for _, p := range r.vmmPasses {
				j.VMMPerPass = append(j.VMMPerPass, vmmJSON(p))
			}
		}
	}
	return j
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", " ")
	return enc.Encode(v)
}

// report writes the text report of a run on one resource.
func (r *replayRun) report(w io.Writer, path string) {
	x := r.results[0]
	median := r.median()
	fmt.Fprintf(w, "trace            %s\n", path)
	fmt.Fprintf(w, "events           %s\n", eventCounts(x, r.serial))
	fmt.Fprintf(w, "failures         %d\n", r.failures)
	if len(r.results) > 1 {
		fmt.Fprintf(w, "passes           %d, wall times", len(r.results))
		for _, y := range r.results {
			fmt.Fprintf(w, " %s", y.Wall.Round(time.Microsecond))
		}
		fmt.Fprintln(w)
	}
	label := "wall time       "
	if len(r.results) > 1 {
		label = "median wall time"
	}
	fmt.Fprintf(w, "%s %s (%.0f ns/event)\n", label, median.Round(time.Microsecond), float64(median.Nanoseconds())/float64(max(x.Events, 1)))
	fmt.Fprintf(w, "peak live        %d bytes (%s)\n", x.PeakLiveBytes, rmm.FormatBytes(x.PeakLiveBytes))
	if r.failures > 0 {
		fmt.Fprintf(w, "                 (the trace's peak: %d allocations failed, so less was live in the replay and the ratio below understates)\n", r.failures)
	}
	if r.reserved > 0 {
		fmt.Fprintf(w, "peak reserved    %d bytes (%s), %.3f x peak live\n", r.reserved, rmm.FormatBytes(r.reserved), float64(r.reserved)/float64(max(x.PeakLiveBytes, 1)))
	}
	if r.floor != nil {
		f := r.floorBytes()
		fmt.Fprintf(w, "page floor       %d bytes (%s), %.3f x peak live: the most %s pages holding live bytes at once\n", f, rmm.FormatBytes(f), float64(f)/float64(max(x.PeakLiveBytes, 1)), rmm.FormatBytes(int64(r.floor.page)))
	}
	if st := r.pool; st != nil {
		fmt.Fprintf(w, "pool at end      size %d bytes in %d upstream blocks, %d free blocks, largest %d bytes\n", st.PoolSize, st.UpstreamBlocks, st.FreeBlocks, st.LargestFreeBlock)
	}
	writeVMM(w, []*replayRun{r}, false)
	fmt.Fprintf(w, "left allocated   %d allocations, %d bytes (freed after the replay)\n", x.LeftAllocations, x.LeftBytes)
	oddEvents(w, x)
}

// oddEvents writes the lines of a report for the events where the trace contradicts itself, and
// what the replay did with them; nothing for a trace that does not.
func oddEvents(w io.Writer, x rmm.ReplayResult) {
	if x.UnmatchedFrees > 0 {
		fmt.Fprintf(w, "unmatched frees  %d (skipped)\n", x.UnmatchedFrees)
	}
	if x.MismatchedFrees > 0 {
		fmt.Fprintf(w, "mismatched frees %d (a size other than the allocation's: freed with the allocation's size)\n", x.MismatchedFrees)
	}
	if x.DuplicateAllocations > 0 {
		fmt.Fprintf(w, "duplicate allocs %d (a pointer allocated again while live: the earlier allocation left allocated, counted above)\n", x.DuplicateAllocations)
	}
}

// eventCounts describes the trace's events as a replay counted them; serial: replayed from one
// goroutine (-serial).
func eventCounts(x rmm.ReplayResult, serial bool) string {
	threads := "threads"
	if x.Threads == 1 {
		threads = "thread"
	} else if serial {
		threads += ", replayed from one goroutine"
	}
	return fmt.Sprintf("%d (allocations %d, frees %d, logged failures %d; %d %s)", x.Events, x.Allocations, x.Frees, x.LoggedFailures, x.Threads, threads)
}

// writeTable writes the report of a run on several resources: what they share (the trace's
// figures), then a row per resource.
func writeTable(w io.Writer, path string, runs []*replayRun) {
	x := runs[0].results[0]
	fmt.Fprintf(w, "trace            %s\n", path)
	fmt.Fprintf(w, "events           %s\n", eventCounts(x, runs[0].serial))
	fmt.Fprintf(w, "passes           %d on each resource\n", len(runs[0].results))
	fmt.Fprintf(w, "peak live        %d bytes (%s)\n", x.PeakLiveBytes, rmm.FormatBytes(x.PeakLiveBytes))
	fmt.Fprintf(w, "left allocated   %d allocations, %d bytes (freed after each replay)\n", x.LeftAllocations, x.LeftBytes)
	oddEvents(w, x)
	fmt.Fprintln(w)
	floor := runs[0].floor != nil
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	wall := "wall time"
	if len(runs[0].results) > 1 {
		wall = "median wall time"
	}
	fmt.Fprintf(tw, "resource\tfailures\t%s\tns/event\tpeak live\tpeak reserved\treserved/live", wall)
	if floor {
		fmt.Fprintf(tw, "\tpage floor\tfloor/live")
	}
	fmt.Fprintln(tw)
	ratio := func(v int64) string {
		if v <= 0 {
			return "-"
		}
		return fmt.Sprintf("%.3f", float64(v)/float64(max(x.PeakLiveBytes, 1)))
	}
	size := func(v int64) string {
		if v <= 0 {
			return "-"
		}
		return shortBytes(v)
	}
	for _, r := range runs {
		m := r.median()
		fmt.Fprintf(tw, "%s\t%d\t%s\t%.0f\t%s\t%s\t%s", r.name, r.failures, m.Round(time.Microsecond),
			float64(m.Nanoseconds())/float64(max(x.Events, 1)), shortBytes(r.results[0].PeakLiveBytes), size(r.reserved), ratio(r.reserved))
		if floor {
			fmt.Fprintf(tw, "\t%s\t%s", size(r.floorBytes()), ratio(r.floorBytes()))
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
	for _, r := range runs {
		if r.failures > 0 {
			fmt.Fprintf(w, "%s: %d allocations failed, so less was live in its replay and its reserved/live understates\n", r.name, r.failures)
		}
	}
	if slices.ContainsFunc(runs, func(r *replayRun) bool { return len(r.vmmPasses) > 0 }) {
		fmt.Fprintln(w)
		writeVMM(w, runs, true)
	}
}

// binaryBytes writes a byte count in the largest binary unit it reaches, with as many decimals as
// it needs: "0", "768 MiB", "1.25 GiB". Tick values (multiples of a power of two) need two at most.
func binaryBytes(v float64) string {
	if v == 0 {
		return "0"
	}
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}
	u := 0
	for u < len(units)-1 && math.Abs(v) >= 1024 {
		v /= 1024
		u++
	}
	return strconv.FormatFloat(v, 'f', -1, 64) + " " + units[u]
}

// shortBytes writes a byte count in binary units to about four significant digits: "589.5 MiB".
func shortBytes(v int64) string {
	s := binaryBytes(float64(v))
	num, unit, _ := strings.Cut(s, " ")
	f, _ := strconv.ParseFloat(num, 64)
	switch {
	case f >= 100:
		num = strconv.FormatFloat(f, 'f', 1, 64)
	case f >= 10:
		num = strconv.FormatFloat(f, 'f', 2, 64)
	default:
		num = strconv.FormatFloat(f, 'f', 3, 64)
	}
	if unit == "B" || unit == "" {
		return s
	}
	return num + " " + unit
}

// replayJSON is what -json writes for each resource: one object, or a list of them in the order
// of -mr when it names several. Name is the resource as -mr names it, Resource what it is in
// words. Bytes are bytes, times nanoseconds; PeakReservedBytes is the most the resource took from
// its upstream (0 when unknown), and PoolAtEnd a pool's Stats after the last pass. VMM is an
// expandable pool's driver calls since it was made (its Stats' VMM after the last pass: the
// passes' calls and those made in making it, such as the reservation of its address range), and
// VMMPerPass those made in each pass; librmm's pool and the other resources have neither.
type replayJSON struct {
	Name              string    `json:"name"`
	Resource          string    `json:"resource"`
	Trace             string    `json:"trace"`
	Events            int       `json:"events"`
	Allocations       int       `json:"allocations"`
	Frees             int       `json:"frees"`
	LoggedFailures    int       `json:"logged_failures"`
	Threads           int       `json:"threads"`
	Serial            bool      `json:"serial,omitempty"`
	Failures          int       `json:"failures"`
	Passes            int       `json:"passes"`
	WallNs            []int64   `json:"wall_ns"`
	MedianWallNs      int64     `json:"median_wall_ns"`
	NsPerEvent        float64   `json:"ns_per_event"`
	PeakLiveBytes     int64     `json:"peak_live_bytes"`
	PeakReservedBytes int64     `json:"peak_reserved_bytes"`
	ReservedOverLive  float64   `json:"reserved_over_live,omitempty"`
	PageBytes         int       `json:"page_bytes,omitempty"`
	PageFloorBytes    int64     `json:"page_floor_bytes,omitempty"`
	PoolAtEnd         *poolJSON `json:"pool_at_end,omitempty"`
	VMM               *vmmJSON  `json:"vmm,omitempty"`
	VMMPerPass        []vmmJSON `json:"vmm_per_pass,omitempty"`
	LeftAllocations   int       `json:"left_allocations"`
	LeftBytes         int64     `json:"left_bytes"`
	UnmatchedFrees    int       `json:"unmatched_frees"`
	// Frees of another size than their allocation's (freed with the allocation's size), and
	// allocations of a pointer still live (the earlier allocation left allocated).
	MismatchedFrees      int `json:"mismatched_frees"`
	DuplicateAllocations int `json:"duplicate_allocations"`
	// With -window: the windows' figures (see windowJSON).
	Windows []windowJSON `json:"windows,omitempty"`
}

// progressMu guards what the progress line reads of the replay loop.
var progressMu sync.Mutex

// startProgress shows, on stderr when it is a terminal, a line with the label (the resource, when
// there are several), the passes done and the time spent, from a second after the start and every second after; the returned func erases it.
// Elsewhere (a file, a pipe, a test's buffer) it writes nothing.
func startProgress(stderr io.Writer, label string, passes int, done func() int) (stop func()) {
	f, ok := stderr.(*os.File)
	if !ok || !term.IsTerminal(int(f.Fd())) {
		return func() {}
	}
	start := time.Now()
	quit, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		shown := false
		for {
			select {
			case <-quit:
				if shown {
					fmt.Fprint(f, "\r\033[K")
				}
				return
			case <-tick.C:
				progressMu.Lock()
				n := done()
				progressMu.Unlock()
				fmt.Fprintf(f, "\rrmm-replay: %spass %d of %d, %s", label, min(n+1, passes), passes, time.Since(start).Round(time.Second))
				shown = true
			}
		}
	}()
	return func() {
		select {
		case <-quit:
		default:
			close(quit)
			<-finished
		}
	}
}

// poolJSON is a pool's Stats after the replay, in -json.
type poolJSON struct {
	PoolSize         int `json:"pool_size"`
	PeakPoolSize     int `json:"peak_pool_size"`
	MaximumPoolSize  int `json:"maximum_pool_size"`
	FreeBytes        int `json:"free_bytes"`
	FreeBlocks       int `json:"free_blocks"`
	LargestFreeBlock int `json:"largest_free_block"`
	UpstreamBlocks   int `json:"upstream_blocks"`
	Streams          int `json:"streams"`
	Holes            int `json:"holes"`
	HoleBytes        int `json:"hole_bytes"`
}

// minFloorPage is the smallest page -floor takes: it keeps one counter per page an allocation
// touches, so that smaller pages cost time and memory out of proportion (a 4 KiB page already
// takes seconds on a trace of 100 000 events).
const minFloorPage = 4 << 10

// floorResource counts, for the allocations that pass through it, the pages of page bytes that
// hold part of at least one live allocation, now and at most.
type floorResource struct {
	rmm.MemoryResource
	page int

	mu         sync.Mutex
	refs       map[uintptr]int32 // page index -> live allocations touching it
	live, peak int               // pages
}

func (r *floorResource) pagesOf(p rmm.DevicePtr, n int) (first, last uintptr) {
	return uintptr(p) / uintptr(r.page), (uintptr(p) + uintptr(n) - 1) / uintptr(r.page)
}

func (r *floorResource) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	p, err := r.MemoryResource.Allocate(n, s)
	if err != nil || n == 0 || p == 0 {
		return p, err
	}
	first, last := r.pagesOf(p, n)
	r.mu.Lock()
	for i := first; i <= last; i++ {
		r.refs[i]++
		if r.refs[i] == 1 {
			r.live++
		}
	}
	r.peak = max(r.peak, r.live)
	r.mu.Unlock()
	return p, nil
}

func (r *floorResource) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	if err := r.MemoryResource.Deallocate(p, n, s); err != nil || n == 0 || p == 0 {
		return err
	}
	first, last := r.pagesOf(p, n)
	r.mu.Lock()
	for i := first; i <= last; i++ {
		if r.refs[i]--; r.refs[i] == 0 {
			delete(r.refs, i)
			r.live--
		}
	}
	r.mu.Unlock()
	return nil
}

func (r *floorResource) Upstream() rmm.MemoryResource { return r.MemoryResource }
func (r *floorResource) Access() rmm.Access           { return rmm.AccessOf(r.MemoryResource) }

// medianOf returns the median of d (sorting d): the middle value, or the mean of the two middle
// values for an even count.
func medianOf(d []time.Duration) time.Duration {
	slices.Sort(d)
	m := d[len(d)/2]
	if len(d)%2 == 0 {
		m = (d[len(d)/2-1] + m) / 2
	}
	return m
}
