package rmm

// Benchmarks W1–W4 and fill/copy of notes/benchmarks.md. On a GPU they run over the CUDA
// resources (the driver baselines CudaMemoryResource and CudaAsyncMemoryResource included); on a
// CPU over SystemMemoryResource and the address-only SimulatedMemoryResource. Compare runs with
// benchstat; quote ratios to the baselines of the same run.
//
//	go test -run '^$' -bench . -benchmem -count 5

import (
	"fmt"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// benchResource is a named resource factory; close releases what it holds.
type benchResource struct {
	name string
	make func(b *testing.B) (mr MemoryResource, close func())
}

// serves reports whether r's resource serves requests of size bytes: the fixed-size resource's
// refuse what exceeds their block (W1 leaves those sizes out).
func (r benchResource) serves(size int) bool {
	return !strings.HasPrefix(r.name, "fixed") || size <= fixedBenchBlock
}

func onGPU() bool { return CUDAAvailable() == nil }

// poolOver builds a pool with the given initial size over up.
func poolOver(up MemoryResource, initial int) func(b *testing.B) (MemoryResource, func()) {
	return func(b *testing.B) (MemoryResource, func()) {
		p, err := NewPoolMemoryResource(up, &PoolOptions{InitialPoolSize: initial})
		if err != nil {
			b.Fatal(err)
		}
		return p, func() { p.Close() }
	}
}

// benchResources are the resources of W1 and W3: the driver baselines and our sub-allocators
// (pool initial 8 GiB) on a GPU; host and address-only memory on a CPU.
func benchResources(b *testing.B) []benchResource {
	if onGPU() {
		cuda, err := NewCudaMemoryResource(0)
		if err != nil {
			b.Fatal(err)
		}
		return []benchResource{
			{"cuda", func(*testing.B) (MemoryResource, func()) { return cuda, func() {} }},
			{"async", func(b *testing.B) (MemoryResource, func()) {
				a, err := NewCudaAsyncMemoryResource(0, nil)
				if err != nil {
					b.Fatal(err)
				}
				return a, func() { a.Close() }
			}},
			{"pool", poolOver(cuda, 8<<30)},
			{"expandable", expandableOver(cuda, 8<<30)},
			{"stitching", stitchingOver(cuda, 8<<30)},
			{"arena", arenaOver(cuda, 8<<30)},
			{"binning", binningOverPool(cuda, 8<<30)},
			{"fixed", fixedOver(cuda)},
		}
	}
	sim, _ := NewSimulatedMemoryResource(1 << 40)
	return []benchResource{
		{"system", func(*testing.B) (MemoryResource, func()) { return NewSystemMemoryResource(), func() {} }},
		{"pool-system", poolOver(NewSystemMemoryResource(), 8<<30)},
		{"pool-simulated", poolOver(sim, 8<<30)},
		{"expandable-simulated", expandableOver(sim, 8<<30)},
		{"stitching-simulated", stitchingOver(sim, 8<<30)},
		{"arena-simulated", arenaOver(sim, 8<<30)},
		{"binning-simulated", binningOverPool(sim, 8<<30)},
		{"fixed-simulated", fixedOver(sim)},
	}
}

// fixedBenchBlock is the block size of W1's and W3's fixed-size resource.
const fixedBenchBlock = 1 << 20

// fixedOver builds a fixed-size resource of fixedBenchBlock blocks (128 to a chunk) over up.
func fixedOver(up MemoryResource) func(b *testing.B) (MemoryResource, func()) {
	return func(b *testing.B) (MemoryResource, func()) {
		f, err := NewFixedSizeMemoryResource(up, &FixedSizeOptions{BlockSize: fixedBenchBlock})
		if err != nil {
			b.Fatal(err)
		}
		return f, func() { f.Close() }
	}
}

// expandableOver builds an expandable pool (at most 64 GiB, or the initial size) with the given initial size, its
// memory from where up names (see PoolOptions.Expandable).
func expandableOver(up MemoryResource, initial int) func(b *testing.B) (MemoryResource, func()) {
	return kindOver(up, initial, ExpandablePool)
}

// stitchingOver builds the default pool, a stitching pool, as expandableOver does.
func stitchingOver(up MemoryResource, initial int) func(b *testing.B) (MemoryResource, func()) {
	return kindOver(up, initial, StitchingPool)
}

// kindOver builds a pool of kind k (expandable or stitching) as expandableOver describes.
func kindOver(up MemoryResource, initial int, k PoolKind) func(b *testing.B) (MemoryResource, func()) {
	return func(b *testing.B) (MemoryResource, func()) {
		o := k.Options()
		o.InitialPoolSize, o.MaximumPoolSize = initial, max(64<<30, (initial+2<<20-1)/(2<<20)*(2<<20))
		p, err := NewPoolMemoryResource(up, &o)
		if err != nil {
			b.Fatal(err)
		}
		return p, func() { p.Close() }
	}
}

// arenaOver builds an arena of size bytes over up.
func arenaOver(up MemoryResource, size int) func(b *testing.B) (MemoryResource, func()) {
	return func(b *testing.B) (MemoryResource, func()) {
		a, err := NewArenaMemoryResource(up, &ArenaOptions{ArenaSize: size})
		if err != nil {
			b.Fatal(err)
		}
		return a, func() { a.Close() }
	}
}

// binningOverPool builds librmm's benchmark binning set-up: bins 256 KiB … 4 MiB over a pool.
func binningOverPool(up MemoryResource, initial int) func(b *testing.B) (MemoryResource, func()) {
	return func(b *testing.B) (MemoryResource, func()) {
		p, err := NewPoolMemoryResource(up, &PoolOptions{InitialPoolSize: initial})
		if err != nil {
			b.Fatal(err)
		}
		bin, err := NewBinningMemoryResource(p, &BinningOptions{MinSizeExponent: 18, MaxSizeExponent: 22})
		if err != nil {
			b.Fatal(err)
		}
		return bin, func() { bin.Close(); p.Close() }
	}
}

// BenchmarkW1FixedSize is W1 over a FixedSizeMemoryResource whose block is the size asked.
func BenchmarkW1FixedSize(b *testing.B) {
	var up MemoryResource
	if onGPU() {
		up, _ = NewCudaMemoryResource(0)
	} else {
		up, _ = NewSimulatedMemoryResource(1 << 40)
	}
	for _, size := range []int{256, 64 << 10, 1 << 20, 64 << 20} {
		b.Run(sizeName(size), func(b *testing.B) {
			f, err := NewFixedSizeMemoryResource(up, &FixedSizeOptions{BlockSize: size, BlocksToPreallocate: 16})
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			s := benchStream(b)
			p, _ := f.Allocate(size, s)
			f.Deallocate(p, size, s)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				p, err := f.Allocate(size, s)
				if err != nil {
					b.Fatal(err)
				}
				if err := f.Deallocate(p, size, s); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func benchStream(b *testing.B) StreamView {
	s, err := NewStream(0, &StreamOptions{NonBlocking: true})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	return s.View()
}

// W1: one allocate+free pair in a loop on one non-blocking stream; ns/op is per pair.
func BenchmarkW1(b *testing.B) {
	for _, r := range benchResources(b) {
		for _, size := range []int{256, 64 << 10, 1 << 20, 64 << 20} {
			if !r.serves(size) {
				continue
			}
			b.Run(fmt.Sprintf("%s/%s", r.name, sizeName(size)), func(b *testing.B) {
				mr, closeMR := r.make(b)
				defer closeMR()
				benchW1Loop(b, mr, size, false)
			})
		}
	}
}

// benchW1Loop is W1's loop over mr: b.N pairs of an allocation of size bytes and its free, on a
// new non-blocking stream, after one pair to warm up; with cpuNs, it also reports the process's
// CPU time per pair as cpu-ns/op.
func benchW1Loop(b *testing.B, mr MemoryResource, size int, cpuNs bool) {
	s := benchStream(b)
	// Warm up once (a pool takes its first block from another stream's list).
	if p, err := mr.Allocate(size, s); err == nil {
		mr.Deallocate(p, size, s)
	}
	b.ResetTimer()
	cpu0, cpuOK := processCPUTime()
	for i := 0; i < b.N; i++ {
		p, err := mr.Allocate(size, s)
		if err != nil {
			b.Fatal(err)
		}
		if err := mr.Deallocate(p, size, s); err != nil {
			b.Fatal(err)
		}
	}
	cpu1, _ := processCPUTime()
	b.StopTimer()
	s.Synchronize()
	if cpuNs && cpuOK {
		b.ReportMetric(float64((cpu1-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
	}
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// w2Resources are W2's set-up, as librmm's benchmark: pool initial 50% of free memory; arena of
// the free memory less 64 MiB; binning over a 50% pool; async with defaults; cuda. On a CPU the
// same sizes over an address-only upstream as large as an H200's free memory (140 GiB).
func w2Resources(b *testing.B) []benchResource {
	if onGPU() {
		cuda, _ := NewCudaMemoryResource(0)
		half, err := PercentOfFreeDeviceMemory(50)
		if err != nil {
			b.Fatal(err)
		}
		return []benchResource{
			{"cuda", func(*testing.B) (MemoryResource, func()) { return cuda, func() {} }},
			{"async", func(b *testing.B) (MemoryResource, func()) {
				a, err := NewCudaAsyncMemoryResource(0, nil)
				if err != nil {
					b.Fatal(err)
				}
				return a, func() { a.Close() }
			}},
			{"pool", poolOver(cuda, half)},
			{"expandable", expandableOver(cuda, half)},
			{"stitching", stitchingOver(cuda, half)},
			{"arena", func(b *testing.B) (MemoryResource, func()) {
				free, _, err := AvailableDeviceMemory() // now, after the previous resource's Close
				if err != nil {
					b.Fatal(err)
				}
				return arenaOver(cuda, free-w2ArenaReserve)(b)
			}},
			{"binning", binningOverPool(cuda, half)},
		}
	}
	const free = 140 << 30
	sim, _ := NewSimulatedMemoryResource(free)
	return []benchResource{
		{"pool-simulated", poolOver(sim, free/2)},
		{"expandable-simulated", expandableOver(sim, free/2)},
		{"stitching-simulated", stitchingOver(sim, free/2)},
		{"arena-simulated", arenaOver(sim, free-w2ArenaReserve)},
		{"binning-simulated", binningOverPool(sim, free/2)},
	}
}

// w2ArenaReserve is the memory librmm's W2 leaves outside the arena: 64 MiB.
const w2ArenaReserve = 64 << 20

// W2: RMM's random_allocations workload, replicated draw for draw, on the default stream; the
// whole loop is timed including the draws; the ns/pair metric is per allocate+free pair.
func BenchmarkW2(b *testing.B) {
	for _, r := range w2Resources(b) {
		for _, cell := range [][2]int{{1000, 4096}, {10000, 64}, {100000, 1}} {
			n, maxMiB := cell[0], cell[1]
			if r.name == "cuda" && n == 100000 && testing.Short() {
				continue
			}
			b.Run(fmt.Sprintf("%s/N=%d/max=%dMiB", r.name, n, maxMiB), func(b *testing.B) {
				mr, closeMR := r.make(b)
				defer closeMR()
				s := DefaultStream
				var live []DevicePtr
				var sizes []int
				failures := 0
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					w2Run(n, maxMiB, false, func(size int) bool {
						p, err := mr.Allocate(size, s)
						if err != nil {
							failures++
							return false
						}
						live = append(live, p)
						sizes = append(sizes, size)
						return true
					}, func(idx int) {
						if err := mr.Deallocate(live[idx], sizes[idx], s); err != nil {
							b.Fatal(err)
						}
						last := len(live) - 1
						live[idx], sizes[idx] = live[last], sizes[last]
						live, sizes = live[:last], sizes[:last]
					})
				}
				b.StopTimer()
				Device(0).Synchronize()
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/pair")
				b.ReportMetric(float64(failures)/float64(b.N), "failures/run")
			})
		}
	}
}

// w3Goroutines are W3's goroutine counts.
var w3Goroutines = []int{1, 2, 4, 8, 16}

// w3Batch is how many pairs a W3 goroutine takes from the shared counter at once: enough that the
// counter costs well under 0.1 ns per pair, few enough (about 0.1 ms of work) that the goroutines
// finish within a batch of each other.
const w3Batch = 1024

// W3: g goroutines (w3Goroutines), each on its own non-blocking stream, run W1 at 64 KiB against
// one shared resource. The goroutines take b.N's pairs in batches of w3Batch from one counter (on
// a line of its own), so the counter is touched once per w3Batch pairs, not at every pair, and a
// goroutine that the operating system descheduled for a while does not hold up the others at the
// end (with quotas fixed in advance, the wall time was the slowest goroutine's); each goroutine
// makes one untimed pair first (a pool's first allocation on a stream takes the slow path) and
// all start together behind a barrier. ns/op is wall time per pair over all
// goroutines; pairs/s is the aggregate rate. GOMAXPROCS is the test binary's (-cpu): g above it
// oversubscribes. cpu-ns/pair is the CPU time the process used per pair (where it can be read):
// it stays flat as g grows when the goroutines share nothing, and rises with contention (lines
// moving between cores, spinning) even on a host whose other load hides it from the wall time.
//
// Resolving a 10% difference between two builds on a many-core host takes samples long enough
// that scheduling and the untimed set-up (streams, the resource's first chunk, a GC cycle) weigh
// little, a fixed count of pairs so that every sample of a cell does the same work, and enough
// samples for benchstat's confidence interval; alternate the builds rather than running one
// after the other (bench/paired.sh), since the host's load drifts:
//
//	go test -run '^$' -bench 'W3/(pool|expandable|stitching|arena|binning|fixed)/' -benchtime 6000000x -count 10 . > new.txt
//	benchstat old.txt new.txt
//
// (The driver's resources, cuda and async, allocate thousands of times slower: give them a
// -benchtime of their own.)
//
// Each resource is made anew for every sample and the heap is collected before the timer starts,
// so that no sample pays for garbage an earlier one left.
func BenchmarkW3(b *testing.B) {
	const size = 64 << 10
	for _, r := range benchResources(b) {
		for _, g := range w3Goroutines {
			b.Run(fmt.Sprintf("%s/g=%d", r.name, g), func(b *testing.B) {
				mr, closeMR := r.make(b)
				defer closeMR()
				streams := make([]StreamView, g)
				for i := range streams {
					streams[i] = benchStream(b)
				}
				var ready, done sync.WaitGroup
				start := make(chan struct{})
				var claimed struct {
					_ [64]byte
					n atomic.Int64 // pairs handed out so far
					_ [64]byte
				}
				for _, s := range streams {
					ready.Add(1)
					done.Add(1)
					go func() {
						defer done.Done()
						if p, err := mr.Allocate(size, s); err == nil {
							mr.Deallocate(p, size, s)
						}
						ready.Done()
						<-start
						for {
							hi := claimed.n.Add(w3Batch)
							n := min(w3Batch, int64(b.N)-(hi-w3Batch))
							if n <= 0 {
								return
							}
							for range n {
								p, err := mr.Allocate(size, s)
								if err != nil {
									b.Error(err)
									return
								}
								if err := mr.Deallocate(p, size, s); err != nil {
									b.Error(err)
									return
								}
							}
						}
					}()
				}
				ready.Wait()
				runtime.GC()
				b.ResetTimer()
				cpu0, cpuOK := processCPUTime()
				close(start)
				done.Wait()
				cpu1, _ := processCPUTime()
				b.StopTimer()
				for _, s := range streams {
					s.Synchronize()
				}
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pairs/s")
				if cpuOK {
					b.ReportMetric(float64((cpu1-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/pair")
				}
			})
		}
	}
}

// W4: replay of each bundled trace over a pool and an expandable pool (initial 0, no maximum
// beyond the device, over the GPU or host memory); ns/event over b.N passes on one pool, and
// peak reserved / peak live from a separate single pass on a fresh pool.
func BenchmarkW4(b *testing.B) {
	traces, _ := filepath.Glob(filepath.Join("testdata", "traces", "*.csv.gz"))
	var up MemoryResource = NewSystemMemoryResource()
	if onGPU() {
		up, _ = NewCudaMemoryResource(0)
	}
	for _, path := range traces {
		events, err := ReadLogFile(path)
		if err != nil {
			b.Fatal(err)
		}
		name := filepath.Base(path)
		name = name[:len(name)-len(".csv.gz")]
		for _, kind := range []string{"pool", "expandable"} {
			newPool := func() *PoolMemoryResource {
				var o *PoolOptions
				if kind == "expandable" {
					o = &PoolOptions{Expandable: true, MaximumPoolSize: 64 << 30}
				}
				pool, err := NewPoolMemoryResource(up, o)
				if err != nil {
					b.Fatal(err)
				}
				return pool
			}
			b.Run(name+"/"+kind, func(b *testing.B) {
				// Footprint: one pass on a fresh pool.
				pool := newPool()
				r, err := Replay(events, pool, nil)
				if err != nil || r.Failures > 0 {
					b.Fatalf("replay: %v, %d failures", err, r.Failures)
				}
				ratio := float64(pool.Stats().PeakPoolSize) / float64(r.PeakLiveBytes)
				pool.Close()
				pool = newPool()
				defer pool.Close()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if r, err = Replay(events, pool, nil); err != nil {
						b.Fatal(err)
					}
					if r.Failures > 0 {
						b.Fatalf("%d failures", r.Failures)
					}
				}
				b.StopTimer()
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(events)), "ns/event")
				b.ReportMetric(ratio, "reserved/live")
			})
		}
	}
}

// Growth and shrink of an expandable pool by one chunk, at each chunk size, beside cuMemAlloc and
// cuMemFree of the same size (GPU only): grow-µs is cuMemCreate + cuMemMap + cuMemSetAccess (or
// cuMemAlloc), shrink-µs is cuMemUnmap + cuMemRelease (or cuMemFree).
func BenchmarkGrowth(b *testing.B) {
	if !onGPU() {
		b.Skip("no CUDA device")
	}
	vm, err := newDeviceVMM(0)
	if err != nil {
		b.Fatal(err)
	}
	cuda, _ := NewCudaMemoryResource(0)
	for _, size := range []int{2 << 20, 32 << 20, 64 << 20, 256 << 20, 1 << 30} {
		b.Run(sizeName(size)+"/vmm", func(b *testing.B) {
			base, err := vm.reserve(size)
			if err != nil {
				b.Fatal(err)
			}
			defer vm.free(base, size)
			var grow, shrink time.Duration
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				h, err := vm.create(size)
				if err == nil {
					err = vm.mapAt(base, size, h)
				}
				if err == nil {
					err = vm.setAccess(base, size)
				}
				if err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				if err := vm.unmap(base, size); err != nil {
					b.Fatal(err)
				}
				if err := vm.release(h); err != nil {
					b.Fatal(err)
				}
				grow += t1.Sub(t0)
				shrink += time.Since(t1)
			}
			b.ReportMetric(float64(grow.Microseconds())/float64(b.N), "grow-µs")
			b.ReportMetric(float64(shrink.Microseconds())/float64(b.N), "shrink-µs")
		})
		b.Run(sizeName(size)+"/cuMemAlloc", func(b *testing.B) {
			var grow, shrink time.Duration
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				p, err := cuda.Allocate(size, DefaultStream)
				if err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				if err := cuda.Deallocate(p, size, DefaultStream); err != nil {
					b.Fatal(err)
				}
				grow += t1.Sub(t0)
				shrink += time.Since(t1)
			}
			b.ReportMetric(float64(grow.Microseconds())/float64(b.N), "grow-µs")
			b.ReportMetric(float64(shrink.Microseconds())/float64(b.N), "shrink-µs")
		})
	}
}

const fillCopyBytes = 4 << 30

// fillBench is the set-up BenchmarkFill and BenchmarkFillLaunchShape share: a 4 GiB buffer on a
// stream, and run, which times f (after one warm-up call) with the stream synchronised around it.
type fillBench struct {
	buf *DeviceBuffer
	s   StreamView
	ctx uintptr
}

func newFillBench(b *testing.B) *fillBench {
	if !onGPU() {
		b.Skip("no CUDA device")
	}
	cuda, _ := NewCudaMemoryResource(0)
	s := benchStream(b)
	buf, err := NewDeviceBuffer(fillCopyBytes, s, cuda)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { buf.Close() })
	ctx, _ := Device(0).ctx()
	return &fillBench{buf: buf, s: s, ctx: ctx}
}

func (fb *fillBench) run(b *testing.B, f func() error) {
	b.SetBytes(fillCopyBytes)
	if err := f(); err != nil { // warm-up (kernel load)
		b.Fatal(err)
	}
	fb.s.Synchronize()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := f(); err != nil {
			b.Fatal(err)
		}
	}
	fb.s.Synchronize()
}

// memsetD32 is the driver's baseline: cuMemsetD32Async over the buffer.
func (fb *fillBench) memsetD32(b *testing.B) {
	fb.run(b, func() error {
		return cuMemsetAsync(fb.ctx, fb.buf.Data(), 0x01020304, fillCopyBytes/4, 4, fb.s.cu())
	})
}

// Fill bandwidth of Uvector.Fill at every element width beside the driver's cuMemsetD32Async on
// the same 4 GiB buffer (GPU only); MB/s counts bytes written.
func BenchmarkFill(b *testing.B) {
	fb := newFillBench(b)
	run, buf, s := fb.run, fb.buf, fb.s
	b.Run("driver-memsetD32", fb.memsetD32)
	b.Run("w1", func(b *testing.B) { benchFill[uint8](b, run, buf, 7, s) })
	b.Run("w2", func(b *testing.B) { benchFill[uint16](b, run, buf, 7, s) })
	b.Run("w4", func(b *testing.B) { benchFill[float32](b, run, buf, 7, s) })
	b.Run("w8", func(b *testing.B) { benchFill[float64](b, run, buf, 7, s) })
	b.Run("w16", func(b *testing.B) { benchFill[complex128](b, run, buf, 7, s) })
	b.Run("w12", func(b *testing.B) { benchFill[[3]float32](b, run, buf, [3]float32{1, 2, 3}, s) })
}

// The fill kernel's launch shape: widths 8 and 12 at each threads-per-block and blocks-per-SM
// cap, beside cuMemsetD32Async (GPU only). For tuning launchBlock and launchBlocksPerSM.
func BenchmarkFillLaunchShape(b *testing.B) {
	fb := newFillBench(b)
	run, buf, s := fb.run, fb.buf, fb.s
	b.Run("driver-memsetD32", fb.memsetD32)
	defer func(bl, bps int) { launchBlock, launchBlocksPerSM = bl, bps }(launchBlock, launchBlocksPerSM)
	for _, bl := range []int{128, 256, 512, 1024} {
		for _, bps := range []int{2, 4, 8, 16, 32, 64} {
			launchBlock, launchBlocksPerSM = bl, bps
			b.Run(fmt.Sprintf("block=%d/perSM=%d/w8", bl, bps), func(b *testing.B) { benchFill[float64](b, run, buf, 7, s) })
			b.Run(fmt.Sprintf("block=%d/perSM=%d/w12", bl, bps), func(b *testing.B) { benchFill[[3]float32](b, run, buf, [3]float32{1, 2, 3}, s) })
		}
	}
}

func benchFill[T any](b *testing.B, run func(*testing.B, func() error), buf *DeviceBuffer, v T, s StreamView) {
	n := fillCopyBytes / sizeOf[T]()
	sp, err := NewDeviceSpan[T](buf.Data(), n, buf.Device(), buf.Access())
	if err != nil {
		b.Fatal(err)
	}
	run(b, func() error { return sp.Fill(v, s) })
}

// Device-to-device copy of a Uvector beside cuMemcpyDtoDAsync, 4 GiB; MB/s counts bytes read and
// written (2 × 4 GiB per copy), as the reference figure does.
func BenchmarkCopy(b *testing.B) {
	if !onGPU() {
		b.Skip("no CUDA device")
	}
	cuda, _ := NewCudaMemoryResource(0)
	s := benchStream(b)
	const n = fillCopyBytes / 4
	src, err := NewUvector[float32](n, s, cuda)
	if err != nil {
		b.Fatal(err)
	}
	defer src.Close()
	dst, err := NewUvector[float32](n, s, cuda)
	if err != nil {
		b.Fatal(err)
	}
	defer dst.Close()
	ctx, _ := Device(0).ctx()
	for _, c := range []struct {
		name string
		f    func() error
	}{
		{"driver-memcpyDtoD", func() error { return cuMemcpyDtoDAsync(ctx, dst.Data(), src.Data(), fillCopyBytes, s.cu()) }},
		{"uvector-CopyFrom", func() error { return dst.CopyFrom(src, s) }},
		{"copy-kernel", func() error { return deviceCopyKernel(0, dst.Data(), src.Data(), fillCopyBytes, s) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(2 * fillCopyBytes)
			c.f()
			s.Synchronize()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := c.f(); err != nil {
					b.Fatal(err)
				}
			}
			s.Synchronize()
		})
	}
}
