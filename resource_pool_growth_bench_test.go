package rmm

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// slowUpstream stands in for cuMemAlloc and cuMemFree on a CPU: each Allocate and Deallocate
// takes delay (the calling goroutine sleeps, as a thread blocked in the driver does) before
// passing the call on.
type slowUpstream struct {
	MemoryResource
	delay time.Duration
}

func (u *slowUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	time.Sleep(u.delay)
	return u.MemoryResource.Allocate(n, s)
}

func (u *slowUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	time.Sleep(u.delay)
	return u.MemoryResource.Deallocate(p, n, s)
}

// BenchmarkPoolGrowthRace: allocators on their own streams allocate and free 2 MiB (above the
// per-stream caches' limit, so every call takes the pool's mutex) while one goroutine keeps
// growing the pool (it allocates 64 MiB that do not fit, frees them and calls Release, which
// gives them back). The upstream takes about 100 µs per call on a CPU (an address-only
// upstream behind a sleep), as cuMemAlloc and cuMemFree do; on a GPU it is the device itself
// (CudaMemoryResource; the expandable pool maps chunks). Reported: pairs/s of the allocators
// (all together), their p99, p99.9 and largest latency per pair, and growths/s of the grower.
// (On a CPU with fewer cores than goroutines, the grower's growths/s falls when the allocators
// no longer block: it competes with them for the cores.)
func BenchmarkPoolGrowthRace(b *testing.B) {
	const (
		small   = 2 << 20
		big     = 64 << 20
		initial = 64 << 20
	)
	type kind struct {
		name string
		make func(b *testing.B) *PoolMemoryResource
	}
	var kinds []kind
	if onGPU() {
		cuda, err := NewCudaMemoryResource(0)
		if err != nil {
			b.Fatal(err)
		}
		kinds = []kind{
			{"pool", func(b *testing.B) *PoolMemoryResource {
				p, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: initial})
				if err != nil {
					b.Fatal(err)
				}
				return p
			}},
			{"expandable", func(b *testing.B) *PoolMemoryResource {
				p, err := NewPoolMemoryResource(cuda, &PoolOptions{InitialPoolSize: initial, Expandable: true, MaximumPoolSize: 8 << 30})
				if err != nil {
					b.Fatal(err)
				}
				return p
			}},
		}
	} else {
		kinds = []kind{{"pool", func(b *testing.B) *PoolMemoryResource {
			sim, err := NewSimulatedMemoryResource(1 << 40)
			if err != nil {
				b.Fatal(err)
			}
			p, err := NewPoolMemoryResource(&slowUpstream{sim, 100 * time.Microsecond}, &PoolOptions{InitialPoolSize: initial})
			if err != nil {
				b.Fatal(err)
			}
			return p
		}}}
	}
	for _, k := range kinds {
		for _, workers := range []int{2, 4} {
			b.Run(fmt.Sprintf("%s/allocators=%d", k.name, workers), func(b *testing.B) {
				p := k.make(b)
				defer p.Close()
				streams := make([]*Stream, workers+1)
				for i := range streams {
					st, err := NewStream(p.Device(), nil)
					if err != nil {
						b.Fatal(err)
					}
					defer st.Close()
					streams[i] = st
				}
				per := max(1, b.N/workers)
				lat := make([][]time.Duration, workers)
				stop := make(chan struct{})
				var growths atomic.Int64
				var growErr atomic.Value
				growDone := make(chan struct{})
				b.ResetTimer()
				start := time.Now()
				go func() {
					defer close(growDone)
					s := streams[workers].View()
					for {
						select {
						case <-stop:
							return
						default:
						}
						ptr, err := p.Allocate(big, s)
						if err == nil {
							err = p.Deallocate(ptr, big, s)
						}
						if err == nil {
							err = p.Release()
						}
						if err != nil {
							growErr.Store(err)
							return
						}
						growths.Add(1)
					}
				}()
				var wg sync.WaitGroup
				for w := range workers {
					wg.Add(1)
					go func() {
						defer wg.Done()
						s := streams[w].View()
						l := make([]time.Duration, 0, per)
						for range per {
							t0 := time.Now()
							ptr, err := p.Allocate(small, s)
							if err != nil {
								b.Error(err)
								return
							}
							if err := p.Deallocate(ptr, small, s); err != nil {
								b.Error(err)
								return
							}
							l = append(l, time.Since(t0))
						}
						lat[w] = l
					}()
				}
				wg.Wait()
				elapsed := time.Since(start)
				close(stop)
				<-growDone
				b.StopTimer()
				if err, _ := growErr.Load().(error); err != nil {
					b.Fatal(err)
				}
				all := slices.Concat(lat...)
				slices.Sort(all)
				b.ReportMetric(float64(len(all))/elapsed.Seconds(), "pairs/s")
				if len(all) > 0 {
					b.ReportMetric(float64(all[len(all)*99/100].Nanoseconds()), "p99-ns")
					b.ReportMetric(float64(all[len(all)*999/1000].Nanoseconds()), "p99.9-ns")
					b.ReportMetric(float64(all[len(all)-1].Nanoseconds()), "max-ns")
				}
				b.ReportMetric(float64(growths.Load())/elapsed.Seconds(), "growths/s")
			})
		}
	}
}
