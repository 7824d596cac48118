package rmm

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func adpNewStreamStats(t *testing.T, up MemoryResource) *StreamStatisticsResourceAdaptor {
	t.Helper()
	r, err := NewStreamStatisticsResourceAdaptor(up)
	require.NoError(t, err)
	return r
}

// sstStreams makes n streams on the current device (host streams without CUDA), closed when the
// test ends.
func sstStreams(t *testing.T, n int) []StreamView {
	t.Helper()
	views := make([]StreamView, n)
	for i := range views {
		s, err := NewStream(CurrentDevice(), nil)
		require.NoError(t, err)
		t.Cleanup(func() { s.Close() })
		views[i] = s.View()
	}
	return views
}

func sstAlloc(t *testing.T, mr MemoryResource, n int, s StreamView) DevicePtr {
	t.Helper()
	p, err := mr.Allocate(n, s)
	require.NoError(t, err)
	return p
}

func TestStreamStatisticsEmpty(t *testing.T) {
	r := adpNewStreamStats(t, nil)
	require.Same(t, CurrentDeviceResource(), r.Upstream())
	require.Empty(t, r.ByStream())
	require.Equal(t, Statistics{}, r.StreamStats(DefaultStream))
}

// Allocations are charged to their stream, each stream with its own current, peak and total
// figures; ByStream lists the streams seen, DefaultStream first.
func TestStreamStatisticsPerStream(t *testing.T) {
	for _, u := range adpUpstreams() {
		t.Run(u.name, func(t *testing.T) {
			r := adpNewStreamStats(t, u.new())
			ss := sstStreams(t, 2)
			a, b := ss[0], ss[1]

			d1 := sstAlloc(t, r, 1000, DefaultStream)
			a1 := sstAlloc(t, r, 4096, a)
			a2 := sstAlloc(t, r, 100, a)
			b1 := sstAlloc(t, r, 1<<20, b)
			require.Equal(t, Statistics{1000, 1, 1000, 1, 1000, 1}, r.StreamStats(DefaultStream))
			require.Equal(t, Statistics{4196, 2, 4196, 2, 4196, 2}, r.StreamStats(a))
			require.Equal(t, Statistics{1 << 20, 1, 1 << 20, 1, 1 << 20, 1}, r.StreamStats(b))

			require.NoError(t, r.Deallocate(a1, 4096, a))
			require.NoError(t, r.Deallocate(d1, 1000, DefaultStream))
			a3 := sstAlloc(t, r, 50, a)
			require.Equal(t, Statistics{0, 0, 1000, 1, 1000, 1}, r.StreamStats(DefaultStream))
			require.Equal(t, Statistics{150, 2, 4196, 2, 4246, 3}, r.StreamStats(a))

			got := r.ByStream()
			require.Len(t, got, 3)
			require.Equal(t, DefaultStream, got[0].Stream)
			require.Equal(t, a, got[1].Stream)
			require.Equal(t, b, got[2].Stream)
			require.Equal(t, r.StreamStats(a), got[1].Statistics)

			require.NoError(t, r.Deallocate(a2, 100, a))
			require.NoError(t, r.Deallocate(a3, 50, a))
			require.NoError(t, r.Deallocate(b1, 1<<20, b))
			for _, st := range r.ByStream() {
				require.Zero(t, st.CurrentBytes, "%v", st.Stream)
				require.Zero(t, st.CurrentCount, "%v", st.Stream)
			}
		})
	}
}

// A block freed on another stream than its own (after the caller ordered the free, as
// Uvector.SetStream before Close does) is taken off the stream it was allocated on.
func TestStreamStatisticsCrossStreamFree(t *testing.T) {
	r := adpNewStreamStats(t, NewSystemMemoryResource())
	ss := sstStreams(t, 2)
	a, b := ss[0], ss[1]
	p := sstAlloc(t, r, 3000, a)
	require.NoError(t, r.Deallocate(p, 3000, b))
	require.Equal(t, Statistics{0, 0, 3000, 1, 3000, 1}, r.StreamStats(a))
	require.Equal(t, Statistics{}, r.StreamStats(b), "the freeing stream is not charged")
	require.Len(t, r.ByStream(), 1)

	// The same through a container.
	v, err := NewUvector[float32](1000, a, r)
	require.NoError(t, err)
	v.SetStream(b)
	require.NoError(t, v.Close())
	require.Zero(t, r.StreamStats(a).CurrentBytes)
	require.Equal(t, int64(7000), r.StreamStats(a).TotalBytes)
}

// Memory allocated on a stream that is then closed stays charged to its view until freed.
func TestStreamStatisticsClosedStream(t *testing.T) {
	r := adpNewStreamStats(t, NewSystemMemoryResource())
	s, err := NewStream(CurrentDevice(), nil)
	require.NoError(t, err)
	v := s.View()
	p := sstAlloc(t, r, 512, v)
	require.NoError(t, s.Close())
	require.True(t, v.Closed())
	require.Equal(t, int64(512), r.StreamStats(v).CurrentBytes)
	require.NoError(t, r.Deallocate(p, 512, v))
	require.Equal(t, Statistics{0, 0, 512, 1, 512, 1}, r.StreamStats(v))
}

// Zero sizes count nothing; negative sizes are refused; a failed allocation changes nothing; a
// free the upstream refuses keeps the allocation charged; a pointer the adaptor never handed out
// is passed on and counts nothing.
func TestStreamStatisticsZeroBytesFailuresAndBadSizes(t *testing.T) {
	up := newAdpFaultUpstream(NewSystemMemoryResource())
	r := adpNewStreamStats(t, up)

	p := sstAlloc(t, r, 0, DefaultStream)
	require.Zero(t, p)
	require.NoError(t, r.Deallocate(0, 0, DefaultStream))
	require.Empty(t, r.ByStream())

	_, err := r.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "StreamStatisticsResourceAdaptor.Allocate")
	require.ErrorIs(t, r.Deallocate(1<<20, -1, DefaultStream), ErrInvalidArgument)

	up.failNextAllocs(1, nil)
	_, err = r.Allocate(1000, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Equal(t, Statistics{}, r.StreamStats(DefaultStream))
	allocs, deallocs := up.callCounts()
	require.Equal(t, 2, allocs, "the zero-byte allocation and the failed one reached the upstream")
	require.Equal(t, 1, deallocs)

	p = sstAlloc(t, r, 1000, DefaultStream)
	up.failNextFrees(1)
	require.ErrorIs(t, r.Deallocate(p, 1000, DefaultStream), errAdpInjected)
	require.Equal(t, Statistics{1000, 1, 1000, 1, 1000, 1}, r.StreamStats(DefaultStream), "a refused free keeps the charge")
	require.NoError(t, r.Deallocate(p, 1000, DefaultStream))
	require.Equal(t, Statistics{0, 0, 1000, 1, 1000, 1}, r.StreamStats(DefaultStream))

	// Not handed out through the adaptor: the upstream decides, nothing is counted.
	q, err := up.Allocate(256, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, r.Deallocate(q, 256, DefaultStream))
	require.Equal(t, Statistics{0, 0, 1000, 1, 1000, 1}, r.StreamStats(DefaultStream))
}

// A free with a wrong size takes off what was charged; the size is passed on as given, so a pool
// refuses it and the allocation stays charged.
func TestStreamStatisticsWrongSize(t *testing.T) {
	pool, err := NewPoolMemoryResource(NewSystemMemoryResource(), nil)
	require.NoError(t, err)
	defer pool.Close()
	r := adpNewStreamStats(t, pool)
	p := sstAlloc(t, r, 1000, DefaultStream)
	require.ErrorIs(t, r.Deallocate(p, 999, DefaultStream), ErrInvalidFree)
	require.Equal(t, int64(1000), r.StreamStats(DefaultStream).CurrentBytes)
	require.NoError(t, r.Deallocate(p, 1000, DefaultStream))
	require.Zero(t, r.StreamStats(DefaultStream).CurrentBytes)
}

// Memory freed through the upstream directly stays charged until its address comes back through
// the adaptor; the old record is then dropped.
func TestStreamStatisticsFreedBehindItsBack(t *testing.T) {
	up := newAdpReuseUpstream()
	r := adpNewStreamStats(t, up)
	ss := sstStreams(t, 1)
	p := sstAlloc(t, r, 4096, ss[0])
	require.NoError(t, up.Deallocate(p, 4096, ss[0]))
	require.Equal(t, int64(4096), r.StreamStats(ss[0]).CurrentBytes)
	q := sstAlloc(t, r, 100, DefaultStream)
	require.Equal(t, p, q, "the upstream handed the address out again")
	require.Equal(t, Statistics{0, 0, 4096, 1, 4096, 1}, r.StreamStats(ss[0]))
	require.Equal(t, Statistics{100, 1, 100, 1, 100, 1}, r.StreamStats(DefaultStream))
	require.NoError(t, r.Deallocate(q, 100, DefaultStream))
	require.Zero(t, r.StreamStats(DefaultStream).CurrentCount)
}

// Deallocate drops its record before it calls the upstream: while a free is held inside the
// upstream (after the address was freed), another goroutine's allocation of the same address is
// charged once, and both end at zero.
func TestStreamStatisticsFreeCountsDownBeforeUpstream(t *testing.T) {
	for _, size := range []int{0, 256} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			up := newAdpReuseUpstream()
			r := adpNewStreamStats(t, up)
			p0, p1, errs := adpInterleave(r, up, size, func() {
				st := r.StreamStats(DefaultStream)
				assert.Zero(t, st.CurrentBytes)
				assert.Zero(t, st.CurrentCount)
			})
			for _, err := range errs {
				require.NoError(t, err)
			}
			want := Statistics{}
			if size > 0 {
				require.Equal(t, p0, p1, "the upstream handed the freed address out again")
				want = Statistics{0, 0, int64(size), 1, 2 * int64(size), 2}
			}
			require.Equal(t, want, r.StreamStats(DefaultStream))
		})
	}
}

// Goroutines allocate on streams of their own and sometimes free each other's blocks (on their
// own stream); every stream ends at zero with totals that add up.
func TestStreamStatisticsConcurrent(t *testing.T) {
	up := newAdpReuseUpstream()
	r := adpNewStreamStats(t, up)
	const goroutines, rounds, size = 8, 2000, 256
	ss := sstStreams(t, goroutines)
	shared := make(chan DevicePtr, goroutines*4)
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 2))
			s := ss[g]
			var held []DevicePtr
			for range rounds {
				switch k := rng.IntN(4); {
				case k < 2 && len(held) < 4:
					p, err := r.Allocate(size, s)
					if !assert.NoError(t, err) {
						return
					}
					held = append(held, p)
				case k == 2 && len(held) > 0:
					select {
					case shared <- held[len(held)-1]:
						held = held[:len(held)-1]
					default:
					}
				default:
					var p DevicePtr
					select {
					case p = <-shared:
					default:
						if len(held) == 0 {
							continue
						}
						p, held = held[len(held)-1], held[:len(held)-1]
					}
					if !assert.NoError(t, r.Deallocate(p, size, s)) {
						return
					}
				}
				_ = r.StreamStats(s)
			}
			for _, p := range held {
				assert.NoError(t, r.Deallocate(p, size, s))
			}
		}()
	}
	wg.Wait()
	close(shared)
	for p := range shared {
		require.NoError(t, r.Deallocate(p, size, DefaultStream))
	}
	var total int64
	for _, st := range r.ByStream() {
		require.Zero(t, st.CurrentBytes, "%v", st.Stream)
		require.Zero(t, st.CurrentCount, "%v", st.Stream)
		require.Equal(t, st.TotalCount*size, st.TotalBytes)
		require.LessOrEqual(t, st.PeakCount, int64(4+goroutines*4))
		total += st.TotalCount
	}
	require.Positive(t, total)
	require.Zero(t, r.StreamStats(DefaultStream).TotalCount, "nothing was allocated on DefaultStream")
	live, reused := up.counts()
	require.Zero(t, live)
	require.Positive(t, reused)
}

func TestStreamStatisticsForwarding(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 20)
	r := adpNewStreamStats(t, sim)
	require.Same(t, sim, r.Upstream())
	require.Equal(t, Access(0), r.Access())
	require.Equal(t, CurrentDevice(), r.Device())
	sys := adpNewStreamStats(t, NewSystemMemoryResource())
	require.NotZero(t, sys.Access()&HostAccessible)
	// After the first allocation on a stream, a pair allocates only the record map's growth.
	p := sstAlloc(t, r, 4096, DefaultStream)
	require.NoError(t, r.Deallocate(p, 4096, DefaultStream))
	n := testing.AllocsPerRun(100, func() {
		p, err := r.Allocate(4096, DefaultStream)
		if err != nil {
			panic(err)
		}
		if err := r.Deallocate(p, 4096, DefaultStream); err != nil {
			panic(err)
		}
	})
	require.Zero(t, n)
}
