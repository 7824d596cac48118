package rmm

import (
	"fmt"
	"testing"
	"time"
)

// memProfBenchRates are the sampling rates BenchmarkW1Profiled measures ("none": no adaptor;
// "forward": an adaptor that only passes the calls on, what any adaptor costs; "1B": every
// allocation sampled).
var memProfBenchRates = []struct {
	name string
	rate int // 0: no adaptor; -1: memProfForward
}{
	{"none", 0},
	{"forward", -1},
	{"1B", 1}, // every allocation sampled
	{"512KiB", 512 << 10},
	{"128MiB", 128 << 20},
	{"256MiB", 256 << 20},
	{"512MiB", 512 << 20},
	{"1GiB", 1 << 30},
	{"2GiB", 2 << 30},
	{"4GiB", 4 << 30},
}

// W1 (one allocate+free pair in a loop on one stream) through a MemoryProfileResourceAdaptor
// over each of W1's resources, at several sampling rates, beside the resource alone ("none") and
// behind an adaptor that only passes the calls on ("forward") in the same run. cpu-ns/op is the
// process's CPU time per pair, which a machine shared with other work disturbs less than the wall
// time. Compare with benchstat, a column per rate:
//
//	go test -run '^$' -bench W1Profiled -count 10 > w1prof.txt
//	benchstat -col /rate w1prof.txt
//
// Host figures (a host without a GPU: AMD EPYC, a 2-core virtual machine shared with other
// work, where cpu-ns/op still scatters by 10-50%; GPU-host figures are to be measured there).
// With the draw from the runtime's per-thread generator, over pool-simulated and
// expandable-simulated, medians of 10 runs interleaved with the previous revision's (a draw by
// an atomic addition): the pools cost 35-45 ns a pair alone below 64 MiB and 115-150 ns at 64
// MiB; at 1 GiB the adaptor added +7% in the geometric mean of the eight cases (-2% to +21%),
// "forward" +7%, the previous revision +23%, but another such pair of runs gave +14% and +10%:
// differences of a few ns are not resolved here, and BenchmarkMemoryProfileSampled (medians
// within 10-15%) puts what the adaptor adds to a pair not sampled at about 5 ns, 2.5 of them
// what "forward" costs, for both draws alike on this host.
//
// Earlier runs on that host (the previous draw; medians of cpu-ns/op over 6 interleaved runs,
// adaptor against the resource alone), when the pools (plain and expandable) cost 30-35 ns a pair
// alone below 64 MiB and 100-120 ns at 64 MiB, the arena 65-85 ns and 90-100 ns,
// SystemMemoryResource 170-190 ns and 13 µs:
//
//   - every allocation sampled (1B): 50-70 ns more a pair over the pools, 55-85 ns over the arena,
//     60-75 ns over host memory below 64 MiB;
//   - at 512 MiB, 1 GiB and 2 GiB: 3-10 ns more a pair over the pools at the sizes below 64 MiB
//     (7 ns in the median, +10% to +30%), the cost of an allocation not sampled, the same at every
//     rate; over the arena and host memory within the noise; at 64 MiB 0% to +25% over the pools
//     and the arena, not significant at this noise (the costs measured apart put them at about
//     12%, 9% and 7%);
//   - at 256 MiB, +19% to +52% at 64 MiB; at 128 MiB, +47% to +76%; at Go's 512 KiB, +50% to
//     +60% at 64 KiB and +270% to +365% at 1 MiB over the pools.
//
// Before the stack was walked by frame pointers (runtime.Callers), a sample cost 0.77-0.87 µs in
// W1 on that host (1.4 µs on an H200's), and at 128 MiB the pairs of 64 MiB cost 250-385% more;
// a sample now costs about 60 ns there, which puts it near 0.1 µs on the H200's host.
// BenchmarkMemoryProfileSampled gives the costs apart, over an upstream that does nothing.
func BenchmarkW1Profiled(b *testing.B) {
	for _, r := range benchResources(b) {
		for _, size := range []int{256, 64 << 10, 1 << 20, 64 << 20} {
			if !r.serves(size) {
				continue
			}
			// One resource for every rate of a size: the same instance (its memory, its tables'
			// placement) under each adaptor, so that what differs between the rates' figures is
			// the adaptor. Resources made apart differed by up to 40% in one run on the H200's
			// host, whatever the rate.
			var up MemoryResource
			closeMR := func() {}
			for _, rate := range memProfBenchRates {
				b.Run(fmt.Sprintf("mr=%s/size=%s/rate=%s", r.name, sizeName(size), rate.name), func(b *testing.B) {
					if up == nil {
						up, closeMR = r.make(b)
					}
					mr := up
					if rate.rate < 0 {
						mr = &memProfForward{up}
					}
					if rate.rate > 0 {
						prof, err := NewMemoryProfileResourceAdaptor(up, &MemoryProfileOptions{Rate: rate.rate})
						if err != nil {
							b.Fatal(err)
						}
						mr = prof
					}
					benchW1Loop(b, mr, size, true)
				})
			}
			closeMR()
		}
	}
}

// memProfForward is an adaptor that only passes the calls on: what any adaptor costs, the
// reference for what the profile's own work costs.
type memProfForward struct{ up MemoryResource }

func (f *memProfForward) Allocate(n int, s StreamView) (DevicePtr, error) {
	return f.up.Allocate(n, s)
}

func (f *memProfForward) Deallocate(p DevicePtr, n int, s StreamView) error {
	return f.up.Deallocate(p, n, s)
}

// The parts of a sampled allocation's cost: every allocation sampled (rate 1) or few of them (the
// default rate) over an upstream that does nothing, beside that upstream alone ("upstream") and
// an adaptor that only passes the calls on to it ("forward"), on one goroutine and from all of
// them.
func BenchmarkMemoryProfileSampled(b *testing.B) {
	for _, rate := range []int{0, -1, 1, DefaultMemoryProfileRate} {
		name := fmt.Sprintf("rate=%d", rate)
		mr := func() MemoryResource {
			up := &adpNullUpstream{}
			switch rate {
			case 0:
				return up
			case -1:
				return &memProfForward{up}
			}
			prof, _ := NewMemoryProfileResourceAdaptor(up, &MemoryProfileOptions{Rate: rate})
			return prof
		}
		switch rate {
		case 0:
			name = "upstream"
		case -1:
			name = "forward"
		}
		b.Run(name, func(b *testing.B) {
			mr := mr()
			b.ReportAllocs()
			cpu0, cpuOK := processCPUTime()
			for b.Loop() {
				p, _ := mr.Allocate(4096, DefaultStream)
				_ = mr.Deallocate(p, 4096, DefaultStream)
			}
			memProfReportCPU(b, cpu0, cpuOK)
		})
		b.Run(name+"-parallel", func(b *testing.B) {
			mr := mr()
			b.ReportAllocs()
			cpu0, cpuOK := processCPUTime()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					p, _ := mr.Allocate(4096, DefaultStream)
					_ = mr.Deallocate(p, 4096, DefaultStream)
				}
			})
			memProfReportCPU(b, cpu0, cpuOK)
		})
	}
}

// memProfReportCPU reports the process's CPU time per operation since cpu0 (all goroutines').
func memProfReportCPU(b *testing.B, cpu0 time.Duration, ok bool) {
	if cpu1, _ := processCPUTime(); ok && b.N > 0 {
		b.ReportMetric(float64((cpu1-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
	}
}

// w1PairBlock is how many pairs BenchmarkW1ProfiledPaired times at once: about 50 µs over a pool,
// long beside the clock's cost (two reads of about 25 ns), short beside the changes of speed of a
// shared host.
const w1PairBlock = 1024

// W1 through a MemoryProfileResourceAdaptor at DefaultMemoryProfileRate ("prof") and at 1 GiB
// ("prof1g", the default before 4 GiB), through an adaptor that only passes the calls on ("fwd") and, over the pools,
// through the pool's own PoolOptions.MemoryProfile at the default rate ("inpool": the same pool
// instance, its profile set for the block), each beside the resource alone ("base"), in one
// loop: blocks of w1PairBlock pairs alternate between them (each round starts with the next of
// them), and each block is timed on its own. A change of the host's speed during the run then
// falls on all alike; the cells of BenchmarkW1Profiled, run one after the other, fell near 55 or
// near 80 ns a pair on the H200's host whatever the rate. Metrics: ns a pair of each, and what
// each adds in percent of the resource alone (ns/op is a round: a block of each).
//
//	go test -run '^$' -bench W1ProfiledPaired -count 10 > paired.txt
//	benchstat paired.txt
func BenchmarkW1ProfiledPaired(b *testing.B) {
	for _, r := range benchResources(b) {
		for _, size := range []int{256, 64 << 10, 1 << 20, 64 << 20} {
			if !r.serves(size) {
				continue
			}
			b.Run(fmt.Sprintf("mr=%s/size=%s", r.name, sizeName(size)), func(b *testing.B) {
				up, closeMR := r.make(b)
				defer closeMR()
				prof, err := NewMemoryProfileResourceAdaptor(up, nil)
				if err != nil {
					b.Fatal(err)
				}
				prof1g, err := NewMemoryProfileResourceAdaptor(up, &MemoryProfileOptions{Rate: 1 << 30})
				if err != nil {
					b.Fatal(err)
				}
				type arm struct {
					name string
					mr   MemoryResource
					pool *PoolMemoryResource // inpool: the pool whose profile is set for the block
				}
				arms := []arm{{"base", up, nil}, {"prof", prof, nil}, {"fwd", &memProfForward{up}, nil}, {"prof1g", prof1g, nil}}
				inpool, err := NewMemoryProfile(nil)
				if err != nil {
					b.Fatal(err)
				}
				if p, ok := up.(*PoolMemoryResource); ok {
					arms = append(arms, arm{"inpool", up, p})
				}
				s := benchStream(b)
				block := func(a arm) time.Duration {
					if a.pool != nil {
						a.pool.prof = inpool // one goroutine: no allocation runs meanwhile
					}
					start := time.Now()
					for range w1PairBlock {
						p, err := a.mr.Allocate(size, s)
						if err != nil {
							b.Fatal(err)
						}
						if err := a.mr.Deallocate(p, size, s); err != nil {
							b.Fatal(err)
						}
					}
					d := time.Since(start)
					if a.pool != nil {
						a.pool.prof = nil
					}
					return d
				}
				for _, a := range arms { // warm up: first blocks, tables grown
					block(a)
				}
				spent := make([]time.Duration, len(arms))
				round := 0
				for b.Loop() {
					for i := range arms {
						k := (round + i) % len(arms)
						spent[k] += block(arms[k])
					}
					round++
				}
				s.Synchronize()
				pairs := float64(round * w1PairBlock)
				ns := func(k int) float64 { return float64(spent[k].Nanoseconds()) / pairs }
				b.ReportMetric(ns(0), "base-ns/pair")
				for k := 1; k < len(arms); k++ {
					b.ReportMetric(ns(k), arms[k].name+"-ns/pair")
					b.ReportMetric(100*(ns(k)/ns(0)-1), arms[k].name+"-%")
				}
			})
		}
	}
}
