package rmm

import (
	"fmt"
	"testing"
)

// memProfBenchRates are the sampling rates BenchmarkW1Profiled measures ("none": no adaptor).
var memProfBenchRates = []struct {
	name string
	rate int // 0: no adaptor
}{
	{"none", 0},
	{"512KiB", 512 << 10},
	{"8MiB", 8 << 20},
	{"32MiB", 32 << 20},
	{"64MiB", 64 << 20},
	{"128MiB", 128 << 20},
}

// W1 (one allocate+free pair in a loop on one stream) through a MemoryProfileResourceAdaptor
// over each of W1's resources, at several sampling rates, beside the resource alone ("none") in
// the same run. cpu-ns/op is the process's CPU time per pair, which a machine shared with other
// work disturbs less than the wall time. Compare with benchstat, a column per rate:
//
//	go test -run '^$' -bench W1Profiled -count 10 > w1prof.txt
//	benchstat -col /rate w1prof.txt
//
// On a host without a GPU (AMD EPYC, two virtual cores shared with other work, where wall times
// scattered by 30-90%), the medians of cpu-ns/op over 10 interleaved runs, adaptor against the
// resource alone:
//
//   - SystemMemoryResource (130-200 ns a pair up to 1 MiB, 11-13 µs at 64 MiB): at 128 MiB no
//     size cost significantly more (-13% to +4%; in 30 runs of none against 128 MiB: +11%, -1%,
//     +9% and +5% for 256 B, 64 KiB, 1 MiB and 64 MiB, only the last significant, and the wall
//     times +2%, -2%, +1%, +7%). At 64 MiB the 1 MiB pairs cost 11% more (+11.5% in 30 runs, p <
//     0.001), at 32 MiB 15%, at 8 MiB 62%, at Go's 512 KiB 387%. Hence
//     DefaultMemoryProfileRate.
//   - The sub-allocators (pool, expandable pool, arena, binning; 25-40 ns a pair, 60-135 ns for
//     arena and binning): 5-10 ns more a pair at 256 B at every rate (the cost of an allocation
//     not sampled), and about 0.5 µs per sampled allocation: at 128 MiB, +20% to +37% at 1 MiB
//     and +230% to +370% at 64 MiB (two allocations of 64 MiB in five are sampled).
//
// BenchmarkMemoryProfileSampled gives the two costs apart: about 10 ns a pair through the
// adaptor over an upstream that does nothing (5 ns without it), 420-540 ns a pair at rate 1.
func BenchmarkW1Profiled(b *testing.B) {
	for _, r := range benchResources(b) {
		for _, size := range []int{256, 64 << 10, 1 << 20, 64 << 20} {
			for _, rate := range memProfBenchRates {
				b.Run(fmt.Sprintf("mr=%s/size=%s/rate=%s", r.name, sizeName(size), rate.name), func(b *testing.B) {
					up, closeMR := r.make(b)
					defer closeMR()
					mr := up
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
		}
	}
}

// The parts of a sampled allocation's cost: every allocation sampled (rate 1) or few of them (the
// default rate) over an upstream that does nothing, beside that upstream alone ("upstream"), on
// one goroutine and from all of them.
func BenchmarkMemoryProfileSampled(b *testing.B) {
	for _, rate := range []int{0, 1, DefaultMemoryProfileRate} {
		name := fmt.Sprintf("rate=%d", rate)
		mr := func() MemoryResource {
			up := &adpNullUpstream{}
			if rate == 0 {
				return up
			}
			prof, _ := NewMemoryProfileResourceAdaptor(up, &MemoryProfileOptions{Rate: rate})
			return prof
		}
		if rate == 0 {
			name = "upstream"
		}
		b.Run(name, func(b *testing.B) {
			mr := mr()
			b.ReportAllocs()
			for b.Loop() {
				p, _ := mr.Allocate(4096, DefaultStream)
				_ = mr.Deallocate(p, 4096, DefaultStream)
			}
		})
		b.Run(name+"-parallel", func(b *testing.B) {
			mr := mr()
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					p, _ := mr.Allocate(4096, DefaultStream)
					_ = mr.Deallocate(p, 4096, DefaultStream)
				}
			})
		})
	}
}
