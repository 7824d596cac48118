package rmm

import (
	"fmt"
	"testing"
)

// One allocate+free pair repeated over an address-only upstream, on one goroutine and on
// GOMAXPROCS goroutines (RunParallel) sharing the default stream: the arena's sharded
// default-stream arenas against the pool's one lock.
func BenchmarkSuballocAllocFree(b *testing.B) {
	resources := []struct {
		name string
		make func(b *testing.B) MemoryResource
	}{
		{"pool", func(b *testing.B) MemoryResource {
			sim, _ := NewSimulatedMemoryResource(1 << 40)
			p, err := NewPoolMemoryResource(sim, &PoolOptions{InitialPoolSize: 1 << 30})
			if err != nil {
				b.Fatal(err)
			}
			return p
		}},
		{"arena", func(b *testing.B) MemoryResource {
			sim, _ := NewSimulatedMemoryResource(1 << 40)
			a, err := NewArenaMemoryResource(sim, &ArenaOptions{ArenaSize: 1 << 30})
			if err != nil {
				b.Fatal(err)
			}
			return a
		}},
		{"fixed", func(b *testing.B) MemoryResource {
			sim, _ := NewSimulatedMemoryResource(1 << 40)
			f, err := NewFixedSizeMemoryResource(sim, &FixedSizeOptions{BlockSize: 64 << 10, BlocksToPreallocate: 1024})
			if err != nil {
				b.Fatal(err)
			}
			return f
		}},
		{"binning", func(b *testing.B) MemoryResource {
			sim, _ := NewSimulatedMemoryResource(1 << 40)
			r, err := NewBinningMemoryResource(sim, &BinningOptions{MinSizeExponent: 8, MaxSizeExponent: 16})
			if err != nil {
				b.Fatal(err)
			}
			return r
		}},
	}
	for _, res := range resources {
		for _, n := range []int{256, 64 << 10} {
			b.Run(fmt.Sprintf("%s/%d/serial", res.name, n), func(b *testing.B) {
				mr := res.make(b)
				b.ReportAllocs()
				for b.Loop() {
					p, err := mr.Allocate(n, DefaultStream)
					if err != nil {
						b.Fatal(err)
					}
					if err := mr.Deallocate(p, n, DefaultStream); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run(fmt.Sprintf("%s/%d/parallel", res.name, n), func(b *testing.B) {
				mr := res.make(b)
				b.ReportAllocs()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						p, err := mr.Allocate(n, DefaultStream)
						if err != nil {
							b.Error(err)
							return
						}
						if err := mr.Deallocate(p, n, DefaultStream); err != nil {
							b.Error(err)
							return
						}
					}
				})
			})
		}
	}
}
