// Command rmm-replay replays an RMM CSV event log (written by librmm's logging_resource_adaptor
// or by rmm.LoggingResourceAdaptor) against a gormm/rmm memory resource, in the log's exact
// global order, and prints how fast it went and how much memory it took.
//
//	rmm-replay [flags] TRACE.csv[.gz]
//
// By default the resource is an expandable PoolMemoryResource over the GPU (device 0), or over
// host memory (SystemMemoryResource) where there is no CUDA device — librmm's pool
// (-expandable=false) where the GPU lacks virtual memory management; the first line of output
// names it. -simulate SIZE replaces the upstream with an address-only resource of SIZE
// bytes, so that a trace recorded on a large GPU replays anywhere.
//
// Flags:
//
//	-mr pool|cuda|async|managed|system   the resource to replay on (default pool)
//	-initial SIZE     pool initial size, or the async pool's priming size (default 0)
//	-maximum SIZE     pool maximum size (default none)
//	-simulate SIZE    replay the pool over an address-only upstream of SIZE bytes
//	-expandable       with -mr pool: an expandable pool (PoolOptions.Expandable), whose peak
//	                  mapped size is reported as its peak upstream (default true: false gives
//	                  librmm's pool, whose peak upstream is the most it held from the upstream)
//	-device N         CUDA device (default 0)
//	-passes N         replay N times on the same resource (a pool keeps what it grew in earlier
//	                  passes); report each wall time and the median (default 1)
//	-floor PAGE       also report the page floor: the most bytes of PAGE-sized pages (e.g. 2MiB,
//	                  the granularity of the driver's virtual memory on current GPUs; at least
//	                  4KiB) that held part of a live allocation at once, at the addresses the
//	                  resource gave out, over all passes — what a pool that could map and unmap
//	                  every page on its own would hold at least with the same placement. It
//	                  counts every page an allocation touches, so it slows the replay (more for
//	                  smaller pages): time it without
//	-v                print every allocation that fails during the replay
//
// Sizes take units: 1073741824, 1GiB, 1.5GB (SI units are powers of 1000, "i" units of 1024).
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/gormm/rmm"
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

// peakResource counts the bytes that pass through it to its upstream, current and peak.
type peakResource struct {
	rmm.MemoryResource
	cur, peak atomic.Int64
}

func (r *peakResource) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	p, err := r.MemoryResource.Allocate(n, s)
	if err == nil {
		c := r.cur.Add(int64(n))
		for {
			pk := r.peak.Load()
			if c <= pk || r.peak.CompareAndSwap(pk, c) {
				break
			}
		}
	}
	return p, err
}

func (r *peakResource) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	err := r.MemoryResource.Deallocate(p, n, s)
	if err == nil && p != 0 {
		r.cur.Add(-int64(n))
	}
	return err
}

func (r *peakResource) Upstream() rmm.MemoryResource { return r.MemoryResource }
func (r *peakResource) Access() rmm.Access           { return rmm.AccessOf(r.MemoryResource) }

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0) // -h: the usage was printed
		}
		fmt.Fprintln(os.Stderr, "rmm-replay:", err)
		switch {
		case errors.Is(err, errUsage):
			os.Exit(2)
		case errors.Is(err, errFailures):
			os.Exit(3)
		}
		os.Exit(1)
	}
}

var (
	// errUsage marks a bad command line.
	errUsage = errors.New("usage")
	// errFailures marks a replay in which allocations failed that the trace did not log as
	// failures (the report was printed).
	errFailures = errors.New("allocations failed")
)

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("rmm-replay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	mrName := fs.String("mr", "pool", "resource: pool, cuda, async, managed or system")
	var initial, maximum, simulate sizeFlag
	fs.Var(&initial, "initial", "pool initial size, or the async pool's priming size (default 0)")
	fs.Var(&maximum, "maximum", "pool maximum size (default none)")
	fs.Var(&simulate, "simulate", "replay the pool over an address-only upstream of this many bytes")
	expandable := fs.Bool("expandable", true, "with -mr pool: an expandable pool (one virtual range grown by mapped chunks); false: librmm's pool")
	device := fs.Int("device", 0, "CUDA device")
	passes := fs.Int("passes", 1, "replay this many times on the same resource (a pool keeps what it grew); report the median")
	verbose := fs.Bool("v", false, "print every allocation that fails during the replay")
	asJSON := fs.Bool("json", false, "write the result as one JSON object (see replayJSON) instead of text")
	allowFailures := fs.Bool("allow-failures", false, "exit 0 even when allocations the trace did not log as failures fail in the replay (default: exit 3)")
	var floor sizeFlag
	fs.Var(&floor, "floor", "also report the page floor for pages of this size (e.g. 2MiB; at least 4KiB): the most bytes of pages holding part of a live allocation at once, over all passes (slows the replay)")
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
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return fmt.Errorf("%w: need exactly one trace file", errUsage)
	}
	if *passes < 1 {
		return fmt.Errorf("%w: -passes %d: must be at least 1", errUsage, *passes)
	}
	if maximum.set && *mrName != "pool" {
		return fmt.Errorf("%w: -maximum works with -mr pool only (got -mr %s)", errUsage, *mrName)
	}
	if initial.set && *mrName != "pool" && *mrName != "async" {
		return fmt.Errorf("%w: -initial works with -mr pool or async only (got -mr %s)", errUsage, *mrName)
	}
	expSet := false
	fs.Visit(func(f *flag.Flag) { expSet = expSet || f.Name == "expandable" })
	if expSet && *expandable && *mrName != "pool" {
		return fmt.Errorf("%w: -expandable works with -mr pool only (got -mr %s)", errUsage, *mrName)
	}
	if *mrName != "pool" {
		*expandable = false
	}
	if simulate.set && simulate.n <= 0 {
		return fmt.Errorf("%w: -simulate %d: the simulated memory needs a positive size", errUsage, simulate.n)
	}
	if simulate.set && *mrName != "pool" {
		return fmt.Errorf("%w: -simulate works with -mr pool only (got -mr %s)", errUsage, *mrName)
	}
	if floor.set && floor.n < minFloorPage {
		return fmt.Errorf("%w: -floor %d: the page size must be at least %d bytes (4KiB)", errUsage, floor.n, minFloorPage)
	}
	path := fs.Arg(0)
	events, err := rmm.ReadLogFile(path)
	if err != nil {
		return err
	}

	dev := rmm.Device(*device)
	cudaErr := rmm.CUDAAvailable()
	where := ""
	if cudaErr != nil {
		where = "no CUDA device: " + strings.TrimPrefix(cudaErr.Error(), rmm.ErrNoDevice.Error()+": ")
	}
	if err := rmm.SetCurrentDevice(dev); err != nil {
		return fmt.Errorf("%w: -device %d: %w", errUsage, *device, err)
	}
	if cudaErr == nil {
		name, _ := dev.Name()
		where = fmt.Sprintf("device %d (%s)", *device, name)
	}

	var mr rmm.MemoryResource
	var upstream *peakResource
	var desc string
	var closer func() error
	switch *mrName {
	case "pool":
		var up rmm.MemoryResource
		switch {
		case simulate.set:
			sim, err := rmm.NewSimulatedMemoryResource(simulate.n)
			if err != nil {
				return err
			}
			up = sim
			desc = fmt.Sprintf("PoolMemoryResource over SimulatedMemoryResource (%d bytes, address-only)", simulate.n)
		case cudaErr == nil:
			cuda, err := rmm.NewCudaMemoryResource(dev)
			if err != nil {
				return err
			}
			up = cuda
			desc = "PoolMemoryResource over CudaMemoryResource on " + where
		default:
			up = rmm.NewSystemMemoryResource()
			desc = "PoolMemoryResource over SystemMemoryResource (host memory; " + where + ")"
		}
		opts := &rmm.PoolOptions{InitialPoolSize: initial.n, MaximumPoolSize: maximum.n, Expandable: *expandable}
		var pool *rmm.PoolMemoryResource
		var err error
		if *expandable {
			// The pool maps its own memory: its peak size is what it reserved.
			pool, err = rmm.NewPoolMemoryResource(up, opts)
			if err != nil && !expSet && errors.Is(err, rmm.ErrNotSupported) {
				// The default, on a GPU without virtual memory management: librmm's pool.
				*expandable = false
				opts.Expandable = false
			} else {
				desc = strings.Replace(desc, "PoolMemoryResource over", "expandable PoolMemoryResource over", 1)
			}
		}
		if !*expandable {
			// Its peak size (Stats) is what it took from the upstream at most: no counting
			// wrapper, whose type name would show in the pool's errors.
			pool, err = rmm.NewPoolMemoryResource(up, opts)
		}
		if err != nil {
			return err
		}
		mr, closer = pool, pool.Close
	case "cuda":
		cuda, err := rmm.NewCudaMemoryResource(dev)
		if err != nil {
			return err
		}
		upstream = &peakResource{MemoryResource: cuda}
		mr, desc = upstream, "CudaMemoryResource on "+where
	case "managed":
		m, err := rmm.NewManagedMemoryResource(dev)
		if err != nil {
			return err
		}
		upstream = &peakResource{MemoryResource: m}
		mr, desc = upstream, "ManagedMemoryResource on "+where
	case "async":
		a, err := rmm.NewCudaAsyncMemoryResource(dev, &rmm.CudaAsyncOptions{InitialPoolSize: initial.n, ReleaseThreshold: -1})
		if err != nil {
			return err
		}
		mr, desc, closer = a, "CudaAsyncMemoryResource on "+where, a.Close
	case "system":
		upstream = &peakResource{MemoryResource: rmm.NewSystemMemoryResource()}
		mr, desc = upstream, "SystemMemoryResource (host memory)"
	default:
		return fmt.Errorf("%w: -mr %q: want pool, cuda, async, managed or system", errUsage, *mrName)
	}
	if closer != nil {
		defer closer()
	}

	if !*asJSON {
		fmt.Fprintf(stdout, "rmm-replay: %s\n", desc)
	}
	opts := &rmm.ReplayOptions{}
	if *verbose {
		opts.OnFailure = func(e rmm.LogEvent, err error) {
			fmt.Fprintf(stderr, "line %d: allocate %d bytes: %v\n", e.Line, e.Size, err)
		}
	}
	target := mr
	var pages *floorResource
	if floor.set {
		pages = &floorResource{MemoryResource: mr, page: floor.n, refs: map[uintptr]int32{}}
		target = pages
	}
	var results []rmm.ReplayResult
	stop := startProgress(stderr, *passes, func() int { return len(results) })
	for i := 0; i < *passes; i++ {
		r, err := rmm.Replay(events, target, opts)
		if err != nil {
			stop()
			return err
		}
		progressMu.Lock()
		results = append(results, r)
		progressMu.Unlock()
	}
	stop()
	r := results[0]
	walls := make([]time.Duration, len(results))
	for i, x := range results {
		walls[i] = x.Wall
	}
	median := medianOf(walls)

	failures := 0
	for _, x := range results {
		failures += x.Failures
	}
	var reserved int64
	switch {
	case upstream != nil:
		reserved = upstream.peak.Load()
	case *mrName == "pool":
		reserved = int64(mr.(*rmm.PoolMemoryResource).Stats().PeakPoolSize)
	default:
		if a, ok := mr.(*rmm.CudaAsyncMemoryResource); ok {
			if v, err := a.ReservedBytesHigh(); err == nil {
				reserved = int64(v)
			}
		}
	}
	failErr := func() error {
		if failures > 0 && !*allowFailures {
			return fmt.Errorf("%w: %d allocations failed in %d passes that the trace did not log as failures (-allow-failures to exit 0)", errFailures, failures, len(results))
		}
		return nil
	}
	if *asJSON {
		j := replayJSON{
			Resource: desc, Trace: path, Events: r.Events, Allocations: r.Allocations, Frees: r.Frees,
			LoggedFailures: r.LoggedFailures, Threads: r.Threads, Failures: failures, Passes: len(results),
			MedianWallNs: median.Nanoseconds(), NsPerEvent: float64(median.Nanoseconds()) / float64(max(r.Events, 1)),
			PeakLiveBytes: r.PeakLiveBytes, PeakReservedBytes: reserved,
			LeftAllocations: r.LeftAllocations, LeftBytes: r.LeftBytes, UnmatchedFrees: r.UnmatchedFrees,
		}
		for _, x := range results {
			j.WallNs = append(j.WallNs, x.Wall.Nanoseconds())
		}
		if reserved > 0 {
			j.ReservedOverLive = float64(reserved) / float64(max(r.PeakLiveBytes, 1))
		}
		if pages != nil {
			f := int64(pages.peak) * int64(pages.page)
			j.PageFloorBytes, j.PageBytes = f, pages.page
		}
		if p, ok := mr.(*rmm.PoolMemoryResource); ok {
			st := p.Stats()
			j.PoolAtEnd = &poolJSON{st.PoolSize, st.PeakPoolSize, st.MaximumPoolSize, st.FreeBytes, st.FreeBlocks,
				st.LargestFreeBlock, st.UpstreamBlocks, st.Streams, st.Holes, st.HoleBytes}
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", " ")
		if err := enc.Encode(j); err != nil {
			return err
		}
		return failErr()
	}
	w := stdout
	fmt.Fprintf(w, "trace            %s\n", path)
	threads := "threads"
	if r.Threads == 1 {
		threads = "thread"
	}
	fmt.Fprintf(w, "events           %d (allocations %d, frees %d, logged failures %d; %d %s)\n", r.Events, r.Allocations, r.Frees, r.LoggedFailures, r.Threads, threads)
	fmt.Fprintf(w, "failures         %d\n", failures)
	if len(results) > 1 {
		fmt.Fprintf(w, "passes           %d, wall times", len(results))
		for _, x := range results {
			fmt.Fprintf(w, " %s", x.Wall.Round(time.Microsecond))
		}
		fmt.Fprintln(w)
	}
	label := "wall time       "
	if len(results) > 1 {
		label = "median wall time"
	}
	fmt.Fprintf(w, "%s %s (%.0f ns/event)\n", label, median.Round(time.Microsecond), float64(median.Nanoseconds())/float64(max(r.Events, 1)))
	fmt.Fprintf(w, "peak live        %d bytes (%s)\n", r.PeakLiveBytes, rmm.FormatBytes(r.PeakLiveBytes))
	if failures > 0 {
		fmt.Fprintf(w, "                 (the trace's peak: %d allocations failed, so less was live in the replay and the ratio below understates)\n", failures)
	}
	if reserved > 0 {
		fmt.Fprintf(w, "peak upstream    %d bytes (%s), %.3f x peak live\n", reserved, rmm.FormatBytes(reserved), float64(reserved)/float64(max(r.PeakLiveBytes, 1)))
	}
	if pages != nil {
		f := int64(pages.peak) * int64(pages.page)
		fmt.Fprintf(w, "page floor       %d bytes (%s), %.3f x peak live: the most %s pages holding live bytes at once\n", f, rmm.FormatBytes(f), float64(f)/float64(max(r.PeakLiveBytes, 1)), humanize.IBytes(uint64(pages.page)))
	}
	if p, ok := mr.(*rmm.PoolMemoryResource); ok {
		st := p.Stats()
		fmt.Fprintf(w, "pool at end      size %d bytes in %d upstream blocks, %d free blocks, largest %d bytes\n", st.PoolSize, st.UpstreamBlocks, st.FreeBlocks, st.LargestFreeBlock)
	}
	fmt.Fprintf(w, "left allocated   %d allocations, %d bytes (freed after the replay)\n", r.LeftAllocations, r.LeftBytes)
	if r.UnmatchedFrees > 0 {
		fmt.Fprintf(w, "unmatched frees  %d (skipped)\n", r.UnmatchedFrees)
	}
	return failErr()
}

// replayJSON is what -json writes: one object per run. Bytes are bytes, times nanoseconds;
// PeakReservedBytes is the most the resource took from its upstream (0 when unknown), and
// PoolAtEnd a pool's Stats after the last pass.
type replayJSON struct {
	Resource          string    `json:"resource"`
	Trace             string    `json:"trace"`
	Events            int       `json:"events"`
	Allocations       int       `json:"allocations"`
	Frees             int       `json:"frees"`
	LoggedFailures    int       `json:"logged_failures"`
	Threads           int       `json:"threads"`
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
	LeftAllocations   int       `json:"left_allocations"`
	LeftBytes         int64     `json:"left_bytes"`
	UnmatchedFrees    int       `json:"unmatched_frees"`
}

// progressMu guards what the progress line reads of the replay loop.
var progressMu sync.Mutex

// startProgress shows, on stderr when it is a terminal, a line with the passes done and the time
// spent, from a second after the start and every second after; the returned func erases it.
// Elsewhere (a file, a pipe, a test's buffer) it writes nothing.
func startProgress(stderr io.Writer, passes int, done func() int) (stop func()) {
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
				fmt.Fprintf(f, "\rrmm-replay: pass %d of %d, %s", min(n+1, passes), passes, time.Since(start).Round(time.Second))
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
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	m := d[len(d)/2]
	if len(d)%2 == 0 {
		m = (d[len(d)/2-1] + m) / 2
	}
	return m
}
