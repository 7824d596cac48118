package rmm

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// streamHooks returns a copy of the close hooks s holds.
func streamHooks(s *Stream) []streamCloseHook {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.hooks)
}

// hookedOn reports whether s holds h among its close hooks.
func hookedOn(s *Stream, h streamCloseHook) bool {
	return slices.Contains(streamHooks(s), h)
}

// A long-lived Stream used by resources that are made and closed one after another (a resource
// per request, over a stream of a StreamPool) must not keep every closed resource reachable
// through its close hooks.
func TestStreamCloseHooksDoNotAccumulateClosedResources(t *testing.T) {
	s, err := NewStream(0, nil)
	require.NoError(t, err)
	defer s.Close()
	host := NewSystemMemoryResource()
	for range 100 {
		f, err := NewFixedSizeMemoryResource(host, &FixedSizeOptions{BlockSize: 256, BlocksToPreallocate: 4})
		require.NoError(t, err)
		p, err := f.Allocate(256, s.View())
		require.NoError(t, err)
		require.NoError(t, f.Deallocate(p, 256, s.View()))
		require.NoError(t, f.Close())

		pool, err := NewPoolMemoryResource(host, &PoolOptions{InitialPoolSize: 1 << 20})
		require.NoError(t, err)
		p, err = pool.Allocate(256, s.View())
		require.NoError(t, err)
		require.NoError(t, pool.Deallocate(p, 256, s.View()))
		require.NoError(t, pool.Close())
	}
	s.mu.Lock()
	n := len(s.hooks)
	s.mu.Unlock()
	require.LessOrEqual(t, n, 2, "close hooks held by the stream after 200 resources were closed")
}

// hookKind makes one kind of resource that hooks the Streams it orders frees on.
type hookKind struct {
	name string
	make func(t *testing.T) MemoryResource
	// hooks returns the values the resource hooks with (a binning resource hooks through its bins).
	hooks func(mr MemoryResource) []streamCloseHook
}

func self(mr MemoryResource) []streamCloseHook { return []streamCloseHook{mr.(streamCloseHook)} }

func hookKinds() []hookKind {
	host := NewSystemMemoryResource()
	must := func(t *testing.T, mr MemoryResource, err error) MemoryResource {
		t.Helper()
		if errors.Is(err, ErrNotSupported) {
			t.Skip(err) // host virtual memory management is implemented on Linux only
		}
		require.NoError(t, err)
		return mr
	}
	return []hookKind{
		{"fixed", func(t *testing.T) MemoryResource {
			f, err := NewFixedSizeMemoryResource(host, &FixedSizeOptions{BlockSize: 256, BlocksToPreallocate: 4})
			return must(t, f, err)
		}, self},
		{"pool", func(t *testing.T) MemoryResource {
			p, err := NewPoolMemoryResource(host, &PoolOptions{InitialPoolSize: 1 << 20})
			return must(t, p, err)
		}, self},
		{"expandable pool", func(t *testing.T) MemoryResource {
			sim, err := NewSimulatedMemoryResource(1 << 30)
			require.NoError(t, err)
			p, err := NewPoolMemoryResource(sim, &PoolOptions{Expandable: true, MaximumPoolSize: 1 << 30})
			return must(t, p, err)
		}, self},
		{"stitching pool", func(t *testing.T) MemoryResource {
			p, err := NewPoolMemoryResource(host, &PoolOptions{Expandable: true, Stitch: true, MaximumPoolSize: 1 << 30})
			return must(t, p, err)
		}, self},
		{"arena", func(t *testing.T) MemoryResource {
			sim, err := NewSimulatedMemoryResource(1 << 50)
			require.NoError(t, err)
			a, err := NewArenaMemoryResource(sim, &ArenaOptions{ArenaSize: 64 << 20, DefaultStreamArenas: 1})
			return must(t, a, err)
		}, self},
		{"binning", func(t *testing.T) MemoryResource {
			b, err := NewBinningMemoryResource(host, &BinningOptions{MinSizeExponent: 8, MaxSizeExponent: 10, BlocksToPreallocate: 4})
			return must(t, b, err)
		}, func(mr MemoryResource) []streamCloseHook {
			b := mr.(*BinningMemoryResource)
			b.mu.Lock()
			defer b.mu.Unlock()
			var hs []streamCloseHook
			for _, f := range b.owned {
				hs = append(hs, f)
			}
			return hs
		}},
	}
}

// hookUse allocates and frees on s so that mr hooks s: small blocks, and for the arena a
// large one too (the global arena's stream records); one allocation is left live.
func hookUse(t *testing.T, mr MemoryResource, s StreamView) (live DevicePtr) {
	t.Helper()
	sizes := []int{256, 128}
	if _, ok := mr.(*ArenaMemoryResource); ok {
		sizes = append(sizes, 2<<20)
	}
	for _, n := range sizes {
		p, err := mr.Allocate(n, s)
		require.NoError(t, err)
		require.NoError(t, mr.Deallocate(p, n, s))
	}
	p, err := mr.Allocate(256, s)
	require.NoError(t, err)
	return p
}

// Every resource that hooks our Streams takes its hook off once it is closed and nothing it
// handed out is live: at Close, or at the last free after Close. Until then the hook stays, and a
// Stream closed meanwhile still tells the resource.
func TestStreamCloseHooksRemovedByEveryResource(t *testing.T) {
	for _, k := range hookKinds() {
		t.Run(k.name, func(t *testing.T) {
			s, err := NewStream(0, nil)
			require.NoError(t, err)
			defer s.Close()
			for range 20 {
				mr := k.make(t)
				p := hookUse(t, mr, s.View())
				hs := k.hooks(mr)
				require.NotEmpty(t, hs)
				require.True(t, slices.ContainsFunc(hs, func(h streamCloseHook) bool { return hookedOn(s, h) }), "the resource did not hook the stream")
				require.NoError(t, mr.Deallocate(p, 256, s.View()))
				require.NoError(t, mr.(interface{ Close() error }).Close())
				for _, h := range hs {
					require.False(t, hookedOn(s, h), "a closed resource is still among the stream's hooks")
				}
			}
			require.Empty(t, streamHooks(s))

			// Closed with an allocation live: the hook stays until that allocation is freed.
			mr := k.make(t)
			p := hookUse(t, mr, s.View())
			hs := k.hooks(mr)
			require.NoError(t, mr.(interface{ Close() error }).Close())
			require.True(t, slices.ContainsFunc(hs, func(h streamCloseHook) bool { return hookedOn(s, h) }), "the hook went while an allocation outlived Close")
			require.NoError(t, mr.Deallocate(p, 256, s.View()))
			require.Empty(t, streamHooks(s))
			// An invalid free afterwards names no stream and hooks nothing.
			require.ErrorIs(t, mr.Deallocate(p, 256, s.View()), ErrInvalidFree)
			require.Empty(t, streamHooks(s))
		})
	}
}

// Streams closing while the resources that used them close, free and allocate, over a fake
// device that follows the model of stream order: no panic, no deadlock, no call naming a
// destroyed stream, every block taken after a Stream's Close ordered after the frees made on it
// before, and no closed resource left among a long-lived Stream's hooks. A resource closed with a
// block live keeps its hooks until that block is freed; its free after Close, racing the Close
// of its stream, synchronises that stream while it still exists.
func TestStreamCloseRacesResourceClose(t *testing.T) {
	const bs = 4096
	sim, err := NewSimulatedMemoryResource(1 << 40)
	require.NoError(t, err)
	f := newArenaSyncFake(nil)
	m := newArenaSyncModel()
	f.model = m
	f.mu.Lock()
	m.stream(cuStreamLegacy)
	f.mu.Unlock()
	h := uintptr(0x100)
	stream := func(name string) (StreamView, *Stream, int) {
		h++
		v, st := arenaSyncStream(t, f, h, name)
		f.mu.Lock()
		defer f.mu.Unlock()
		return v, st, m.stream(v.h)
	}
	closeStream := func(st *Stream, v StreamView) {
		require.NoError(t, st.Close())
		f.kill(v.h)
	}
	// took checks in the model that stream i may use the block p.
	took := func(i int, p DevicePtr) error {
		f.mu.Lock()
		defer f.mu.Unlock()
		return m.allocated(i, p, bs)
	}
	// noteFree tells the model that stream i frees p (before the Deallocate).
	noteFree := func(i int, p DevicePtr) {
		f.mu.Lock()
		m.free(i, p, bs)
		f.mu.Unlock()
	}
	lv, long, li := stream("long")
	defer closeStream(long, lv)

	for round := range 40 {
		av, a, ai := stream(fmt.Sprint("A", round))
		bv, b, bi := stream(fmt.Sprint("B", round))
		var mrs []MemoryResource
		for k := range 4 {
			if k%2 == 0 {
				fx, err := NewFixedSizeMemoryResource(sim, &FixedSizeOptions{BlockSize: bs, BlocksToPreallocate: 2})
				require.NoError(t, err)
				fx.ctx, fx.drv = 1, f.driver()
				def := fx.byStream[DefaultStream.id]
				def.event, err = fx.drv.eventCreate(fx.ctx, cuEventDisableTiming)
				require.NoError(t, err)
				mrs = append(mrs, fx)
			} else {
				p, err := NewPoolMemoryResource(sim, nil)
				require.NoError(t, err)
				p.ctx, p.drv = 1, f.driver()
				mrs = append(mrs, p)
			}
		}
		// Before the race: every resource frees a block on A and on the long-lived stream.
		for _, mr := range mrs {
			for _, s := range []struct {
				v StreamView
				i int
			}{{av, ai}, {lv, li}} {
				p, err := mr.Allocate(bs, s.v)
				require.NoError(t, err)
				require.NoError(t, took(s.i, p))
				noteFree(s.i, p)
				require.NoError(t, mr.Deallocate(p, bs, s.v))
			}
		}
		var wg sync.WaitGroup
		wg.Go(func() { closeStream(a, av) })
		wg.Go(func() { closeStream(b, bv) })
		errs := make(chan error, len(mrs))
		for k, mr := range mrs {
			wg.Go(func() {
				errs <- func() error {
					// Take blocks on B (A's, once A closed or through A's event) until one
					// is refused as B closed; keep the last one live over Close on odd rounds.
					var live []DevicePtr
					for range 3 {
						p, err := mr.Allocate(bs, bv)
						if errors.Is(err, ErrClosed) {
							break
						}
						if err != nil {
							return err
						}
						if err := took(bi, p); err != nil {
							return err
						}
						live = append(live, p)
					}
					keep := (round+k)%2 == 1 && len(live) > 0
					for i, p := range live {
						if keep && i == len(live)-1 {
							break
						}
						noteFree(bi, p)
						if err := mr.Deallocate(p, bs, bv); err != nil {
							return err
						}
					}
					if err := mr.(interface{ Close() error }).Close(); err != nil {
						return err
					}
					if keep {
						// A free after Close on B, which may be closing meanwhile.
						p := live[len(live)-1]
						noteFree(bi, p)
						if err := mr.Deallocate(p, bs, bv); err != nil {
							return err
						}
					}
					return nil
				}()
			})
		}
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Fatalf("round %d: deadlock: Stream.Close and the resources' Close did not return", round)
		}
		close(errs)
		for err := range errs {
			require.NoError(t, err, "round %d", round)
		}
		require.Empty(t, f.errors(), "round %d", round)
		for _, mr := range mrs {
			require.False(t, hookedOn(long, mr.(streamCloseHook)), "round %d: a closed resource is among the long-lived stream's hooks", round)
		}
		require.Empty(t, streamHooks(long), "round %d", round)
	}
}
