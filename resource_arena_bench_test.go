package rmm

import (
	"testing"
)

// arenaFastBenchArena returns an arena of size bytes over an address-only upstream. With fakeCtx
// its CUDA calls go to a fake device that only counts them (ctx 1 stands for a context), so the
// stream-ordering code runs as it does on a GPU; without, the arena has no context (as without
// CUDA, also where there is a GPU).
func arenaFastBenchArena(b *testing.B, size int, fakeCtx bool) (*ArenaMemoryResource, *arenaSyncFake) {
	b.Helper()
	sim, err := NewSimulatedMemoryResource(1 << 50)
	if err != nil {
		b.Fatal(err)
	}
	a, err := NewArenaMemoryResource(sim, &ArenaOptions{ArenaSize: size})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { a.Close() })
	var f *arenaSyncFake
	a.ctx = 0
	if fakeCtx {
		f = newArenaSyncFake(nil)
		f.quiet = true
		a.ctx, a.drv = 1, f.driver()
	}
	return a, f
}

// arenaFastBenchStream returns a view of a new non-blocking Stream; without CUDA it carries the
// fake handle h (with CUDA, the Stream's own handle, which its Close names to the arena).
func arenaFastBenchStream(b *testing.B, f *arenaSyncFake, h uintptr) StreamView {
	b.Helper()
	st, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { st.Close() })
	v := st.View()
	if v.h == 0 {
		v.h = h
	}
	if f != nil {
		f.name(v.h, "s")
	}
	return v
}

// BenchmarkArenaPairFakeCtx times one allocate+free pair on one of our Streams, as W1 does, with
// the stream-ordering code of a CUDA context running against a fake device (fake-ctx) and
// without it (no-ctx). 64 MiB is served by the global arena, 256 B and 1 MiB by the stream's
// arena. calls/op counts the CUDA calls made: none, since one stream allocates and frees alone.
func BenchmarkArenaPairFakeCtx(b *testing.B) {
	for _, ctx := range []struct {
		name string
		on   bool
	}{{"fake-ctx", true}, {"no-ctx", false}} {
		for _, size := range []int{256, 1 << 20, 64 << 20} {
			b.Run(ctx.name+"/"+sizeName(size), func(b *testing.B) {
				a, f := arenaFastBenchArena(b, 8<<30, ctx.on)
				s := arenaFastBenchStream(b, f, 0x10)
				if p, err := a.Allocate(size, s); err == nil {
					a.Deallocate(p, size, s)
				}
				calls := 0
				if f != nil {
					calls = f.calls
				}
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					p, err := a.Allocate(size, s)
					if err != nil {
						b.Fatal(err)
					}
					if err := a.Deallocate(p, size, s); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				if f != nil {
					f.mu.Lock()
					calls = f.calls - calls
					f.mu.Unlock()
				}
				b.ReportMetric(float64(calls)/float64(b.N), "calls/op")
			})
		}
	}
}
