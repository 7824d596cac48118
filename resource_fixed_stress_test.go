package rmm

import (
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// fixedStressAlloc is a block a stress goroutine holds: its pointer, the size asked, the stream
// it came from and the byte it was filled with.
type fixedStressAlloc struct {
	p    DevicePtr
	n    int
	s    StreamView
	fill byte
}

// fixedStressCounts counts what the stress goroutines did, so that the test fails when a path
// was never taken.
type fixedStressCounts struct {
	cross, shared, doubleRaces, invalid, closedStreamFrees, afterClose atomic.Int64
}

// fixedStressRun runs goroutines that allocate and free through mr (whose blocks serve at most
// maxSize bytes, over host memory) on their own Streams, on shared ones and on each other's
// (cross-stream frees), race two frees of one block (exactly one may succeed), make invalid frees
// (interior pointers, wrong sizes) that must change nothing, close their own Streams while the
// others run and free the blocks they still hold on them; the resource is closed while the last
// round of frees runs, when closeMR is set. Every block keeps its owner's bytes until freed and
// no two live blocks overlap.
func fixedStressRun(t *testing.T, mr MemoryResource, maxSize int, closeMR func() error) *fixedStressCounts {
	const goroutines, ops = 8, 1500
	own := make([]*Stream, goroutines)
	views := make([]StreamView, goroutines)
	for i := range own {
		s, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
		require.NoError(t, err)
		own[i], views[i] = s, s.View()
		t.Cleanup(func() { s.Close() })
	}
	shared := []StreamView{DefaultStream, mustStream(t)}
	var shadow liveSet
	var c fixedStressCounts
	var closed atomic.Bool
	// Racing frees of one block hold reuse off: once the first free succeeds, another goroutine's
	// Allocate could be handed the same block, and the second free would then rightly free that
	// goroutine's block. Allocations take the read side, the racing pair the write side.
	var reuse sync.RWMutex
	var wg, held sync.WaitGroup
	release := make(chan struct{})
	held.Add(goroutines)
	for g := range goroutines {
		wg.Go(func() {
			var once sync.Once
			defer once.Do(held.Done) // a goroutine that failed early holds nothing up
			r := rand.New(rand.NewPCG(uint64(g), 11))
			var mine []fixedStressAlloc
			pick := func() StreamView {
				switch r.IntN(6) {
				case 0:
					c.shared.Add(1)
					return shared[r.IntN(len(shared))]
				case 1:
					// Another goroutine's: one of those whose Streams stay open (a Stream is not
					// used by others while it closes).
					return views[r.IntN(goroutines/2)*2+1]
				}
				return views[g]
			}
			free := func(i int, s StreamView) bool {
				x := mine[i]
				mine[i] = mine[len(mine)-1]
				mine = mine[:len(mine)-1]
				if b := hostBytes(x.p, x.n); b[0] != x.fill || b[x.n-1] != x.fill {
					t.Errorf("goroutine %d: block %#x overwritten while live", g, uintptr(x.p))
					return false
				}
				if s != x.s {
					c.cross.Add(1)
				}
				if s.closed() {
					c.closedStreamFrees.Add(1)
				}
				if closed.Load() {
					c.afterClose.Add(1)
				}
				shadow.remove(x.p)
				if err := mr.Deallocate(x.p, x.n, s); err != nil {
					t.Errorf("goroutine %d: Deallocate(%#x, %d, %v): %v", g, uintptr(x.p), x.n, s, err)
					return false
				}
				return true
			}
			alloc := func(s StreamView) (fixedStressAlloc, bool) {
				n := 1 + r.IntN(maxSize)
				reuse.RLock()
				p, err := mr.Allocate(n, s)
				reuse.RUnlock()
				if err != nil {
					if errors.Is(err, ErrClosed) && (closed.Load() || s.closed()) {
						return fixedStressAlloc{}, false
					}
					t.Errorf("goroutine %d: Allocate(%d, %v): %v", g, n, s, err)
					return fixedStressAlloc{}, false
				}
				if err := shadow.add(p, n); err != nil {
					t.Errorf("goroutine %d: %v", g, err)
					return fixedStressAlloc{}, false
				}
				fill := byte(r.Uint32())
				b := hostBytes(p, n)
				b[0], b[n-1] = fill, fill
				return fixedStressAlloc{p, n, s, fill}, true
			}
			for k := 0; k < ops && !t.Failed(); k++ {
				switch v := r.IntN(100); {
				case len(mine) == 0 || (len(mine) < 24 && v < 50):
					if a, ok := alloc(pick()); ok {
						mine = append(mine, a)
					}
				case v < 90:
					i := r.IntN(len(mine))
					s := mine[i].s
					if r.IntN(3) == 0 {
						s = pick()
					}
					if !free(i, s) {
						return
					}
				case v < 95:
					// Two frees of one block race: exactly one succeeds (no allocation runs
					// meanwhile, see reuse).
					i := r.IntN(len(mine))
					x := mine[i]
					mine[i] = mine[len(mine)-1]
					mine = mine[:len(mine)-1]
					shadow.remove(x.p)
					var errs [2]error
					var race sync.WaitGroup
					reuse.Lock()
					for j := range errs {
						s := x.s
						if j == 1 {
							s = pick()
						}
						race.Go(func() { errs[j] = mr.Deallocate(x.p, x.n, s) })
					}
					race.Wait()
					reuse.Unlock()
					ok := 0
					for _, err := range errs {
						if err == nil {
							ok++
						} else if !errors.Is(err, ErrInvalidFree) {
							t.Errorf("goroutine %d: racing free: %v", g, err)
						}
					}
					if ok != 1 {
						t.Errorf("goroutine %d: %d of two racing frees of %#x succeeded", g, ok, uintptr(x.p))
						return
					}
					c.doubleRaces.Add(1)
				default:
					// Invalid frees of a live block: changes nothing, the block stays live. The
					// interior pointer is one byte in: a block may be only 256 bytes, so x.p+256
					// can be the start of another goroutine's block of the same size.
					x := mine[r.IntN(len(mine))]
					if err := mr.Deallocate(x.p+1, x.n, pick()); !errors.Is(err, ErrInvalidFree) {
						t.Errorf("goroutine %d: interior free: %v", g, err)
						return
					}
					wrong := x.n - 1
					if wrong == 0 {
						wrong = 2
					}
					if err := mr.Deallocate(x.p, wrong, x.s); !errors.Is(err, ErrInvalidFree) {
						t.Errorf("goroutine %d: free with the wrong size: %v", g, err)
						return
					}
					c.invalid.Add(1)
				}
			}
			// Close this goroutine's Stream while the others run; the blocks allocated on it are
			// freed on it afterwards (ordered by a device synchronisation).
			if g%2 == 0 {
				if err := own[g].Close(); err != nil {
					t.Errorf("goroutine %d: closing its stream: %v", g, err)
				}
			}
			once.Do(held.Done)
			<-release
			for len(mine) > 0 {
				if !free(len(mine)-1, mine[len(mine)-1].s) {
					return
				}
			}
		})
	}
	held.Wait()
	close(release)
	if closeMR != nil {
		closed.Store(true)
		require.NoError(t, closeMR())
	}
	wg.Wait()
	require.False(t, t.Failed())
	return &c
}

// Goroutines on their own, shared and each other's Streams race allocations, frees on other
// streams, double frees, invalid frees, Stream closes and the resource's Close.
func TestFixedSizeStress(t *testing.T) {
	for _, closing := range []bool{false, true} {
		up := NewSystemMemoryResource()
		f, err := NewFixedSizeMemoryResource(up, &FixedSizeOptions{BlockSize: 4096, BlocksToPreallocate: 8})
		require.NoError(t, err)
		var closeMR func() error
		if closing {
			closeMR = f.Close
		}
		c := fixedStressRun(t, f, 4096, closeMR)
		fixedCheck(t, f)
		st := f.Stats()
		require.Zero(t, st.LiveAllocations)
		if closing {
			require.Zero(t, st.PoolSize, "every chunk went back as its last block was freed")
		} else {
			require.Equal(t, st.PoolSize/4096, st.FreeBlocks)
			require.Greater(t, st.UpstreamBlocks, 1, "grew while the goroutines ran")
			require.NoError(t, f.Release())
			require.Zero(t, f.Stats().PoolSize)
			require.NoError(t, f.Close())
		}
		for name, n := range map[string]int64{"cross-stream frees": c.cross.Load(), "shared streams": c.shared.Load(),
			"racing double frees": c.doubleRaces.Load(), "invalid frees": c.invalid.Load(),
			"frees on closed Streams": c.closedStreamFrees.Load()} {
			require.Positive(t, n, name)
		}
		if closing {
			require.Positive(t, c.afterClose.Load(), "frees after Close")
		}
	}
}

// The same over a binning resource whose bins are fixed-size resources, over a pool for the
// larger requests.
func TestBinningStress(t *testing.T) {
	pool, err := NewPoolMemoryResource(NewSystemMemoryResource(), &PoolOptions{InitialPoolSize: 64 << 20})
	require.NoError(t, err)
	defer pool.Close()
	b, err := NewBinningMemoryResource(pool, &BinningOptions{MinSizeExponent: 8, MaxSizeExponent: 12, BlocksToPreallocate: 8})
	require.NoError(t, err)
	c := fixedStressRun(t, b, 8192, b.Close)
	require.NoError(t, b.CheckInvariants())
	st := b.Stats()
	require.Zero(t, st.LiveAllocations)
	require.Zero(t, st.PoolSize)
	require.Positive(t, c.cross.Load())
	require.Positive(t, c.doubleRaces.Load())
	require.Zero(t, pool.Stats().LiveBytes, "every bin's chunks went back to the pool")
}
