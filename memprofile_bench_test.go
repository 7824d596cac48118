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
	{"16MiB", 16 << 20},
	{"32MiB", 32 << 20},
	{"64MiB", 64 << 20},
}

// W1 (one allocate+free pair in a loop on one stream) through a MemoryProfileResourceAdaptor
// over each of W1's resources, at several sampling rates, beside the resource alone ("none") in
// the same run. cpu-ns/op is the process's CPU time per pair, which a machine shared with other
// work disturbs less than the wall time. Compare with benchstat, a column per rate:
//
//	go test -run '^$' -bench W1Profiled -count 10 > w1prof.txt
//	benchstat -col /rate w1prof.txt
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
					s := benchStream(b)
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
					if cpuOK {
						b.ReportMetric(float64((cpu1-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
					}
				})
			}
		}
	}
}

// The parts of a sampled allocation's cost: every allocation sampled (rate 1) over an upstream
// that does nothing, on one goroutine and from all of them.
func BenchmarkMemoryProfileSampled(b *testing.B) {
	for _, rate := range []int{1, DefaultMemoryProfileRate} {
		b.Run(fmt.Sprintf("rate=%d", rate), func(b *testing.B) {
			prof, _ := NewMemoryProfileResourceAdaptor(&adpNullUpstream{}, &MemoryProfileOptions{Rate: rate})
			b.ReportAllocs()
			for b.Loop() {
				p, _ := prof.Allocate(4096, DefaultStream)
				_ = prof.Deallocate(p, 4096, DefaultStream)
			}
		})
		b.Run(fmt.Sprintf("rate=%d-parallel", rate), func(b *testing.B) {
			prof, _ := NewMemoryProfileResourceAdaptor(&adpNullUpstream{}, &MemoryProfileOptions{Rate: rate})
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					p, _ := prof.Allocate(4096, DefaultStream)
					_ = prof.Deallocate(p, 4096, DefaultStream)
				}
			})
		})
	}
}
