package rmm

import (
	"cmp"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// binCounter passes calls to inner and counts them, zero-byte calls included.
type binCounter struct {
	inner                   MemoryResource
	allocs, frees           atomic.Int64
	zeroAllocs, zeroFrees   atomic.Int64
	lastAlloc, lastFreeSize atomic.Int64
}

func newBinCounter(inner MemoryResource) *binCounter { return &binCounter{inner: inner} }

func (c *binCounter) Allocate(n int, s StreamView) (DevicePtr, error) {
	c.allocs.Add(1)
	if n == 0 {
		c.zeroAllocs.Add(1)
	}
	c.lastAlloc.Store(int64(n))
	return c.inner.Allocate(n, s)
}

func (c *binCounter) Deallocate(p DevicePtr, n int, s StreamView) error {
	c.frees.Add(1)
	if n == 0 {
		c.zeroFrees.Add(1)
	}
	c.lastFreeSize.Store(int64(n))
	return c.inner.Deallocate(p, n, s)
}

func (c *binCounter) Access() Access { return AccessOf(c.inner) }

func TestBinningNoBins(t *testing.T) {
	for _, o := range []*BinningOptions{nil, {}, {MinSizeExponent: -1, MaxSizeExponent: -1}} {
		up := newBinCounter(arenaMustSim(t, 1<<40))
		b, err := NewBinningMemoryResource(up, o)
		require.NoError(t, err)
		require.Empty(t, b.binSizes())
		p, err := b.Allocate(100, DefaultStream)
		require.NoError(t, err)
		require.NoError(t, b.Deallocate(p, 100, DefaultStream))
		_, err = b.Allocate(0, DefaultStream)
		require.NoError(t, err)
		require.NoError(t, b.Deallocate(0, 0, DefaultStream))
		require.Equal(t, int64(2), up.allocs.Load(), "everything passes to the upstream")
		require.Equal(t, int64(1), up.zeroAllocs.Load(), "zero bytes too, when there is no bin")
		require.Equal(t, int64(2), up.frees.Load())
		require.Equal(t, up, b.Upstream())
		require.Equal(t, Access(0), b.Access())
		require.Equal(t, CurrentDevice(), b.Device())
		require.NoError(t, b.Close())
	}
}

func TestBinningOptionsValidation(t *testing.T) {
	sim := arenaMustSim(t, 1<<40)
	for _, o := range []BinningOptions{
		{MinSizeExponent: -1, MaxSizeExponent: 10},
		{MinSizeExponent: 10, MaxSizeExponent: -1},
		{MinSizeExponent: 12, MaxSizeExponent: 10},
		{MinSizeExponent: 10, MaxSizeExponent: 63},
		{MinSizeExponent: -2, MaxSizeExponent: -2},
	} {
		_, err := NewBinningMemoryResource(sim, &o)
		require.ErrorIs(t, err, ErrInvalidArgument, "%+v", o)
	}
	require.Zero(t, sim.UsedBytes())
	// A bin the upstream cannot fill fails the construction and gives back what was taken.
	small := arenaMustSim(t, 1<<20)
	_, err := NewBinningMemoryResource(small, &BinningOptions{MinSizeExponent: 10, MaxSizeExponent: 14})
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Zero(t, small.UsedBytes(), "the bins made before the failure were closed")
}

// Exponents 10..12 make fixed-size bins of 1, 2 and 4 KiB, each taking 128 blocks at once.
func TestBinningFromExponents(t *testing.T) {
	up := newFixedRecorder(t)
	b, err := NewBinningMemoryResource(up, &BinningOptions{MinSizeExponent: 10, MaxSizeExponent: 12})
	require.NoError(t, err)
	require.Equal(t, []int{1024, 2048, 4096}, b.binSizes())
	allocs, _ := up.calls()
	require.Len(t, allocs, 3)
	for i, want := range []int{128 << 10, 256 << 10, 512 << 10} {
		require.Equal(t, want, allocs[i].n)
	}
	inChunk := func(p DevicePtr, i int) bool {
		return p >= allocs[i].p && p < allocs[i].p+DevicePtr(allocs[i].n)
	}
	for _, c := range []struct{ n, chunk int }{{1, 0}, {1024, 0}, {1025, 1}, {2048, 1}, {2049, 2}, {4096, 2}} {
		p, err := b.Allocate(c.n, DefaultStream)
		require.NoError(t, err)
		require.True(t, inChunk(p, c.chunk), "%d bytes from bin %d", c.n, c.chunk)
		require.NoError(t, b.Deallocate(p, c.n, DefaultStream))
	}
	p, err := b.Allocate(4097, DefaultStream)
	require.NoError(t, err)
	allocs, _ = up.calls()
	require.Len(t, allocs, 4, "above the largest bin: straight to the upstream")
	require.Equal(t, fixedCall{p, 4097, DefaultStream}, allocs[3])
	require.NoError(t, b.Deallocate(p, 4097, DefaultStream))
	require.NoError(t, b.CheckInvariants())
	require.NoError(t, b.Release())
	require.NoError(t, b.Close())
	_, frees := up.calls()
	require.Len(t, frees, 4, "Release gave back the three bins' chunks")
	require.NoError(t, b.Close(), "closing twice")
}

// Selection: the smallest bin whose size is at least the requested (unrounded) byte count, at
// the exact boundaries; Deallocate uses the same rule; zero bytes reach the smallest bin.
func TestBinningSelection(t *testing.T) {
	sim := arenaMustSim(t, 1<<40)
	up := newBinCounter(sim)
	b, err := NewBinningMemoryResource(up, nil)
	require.NoError(t, err)
	bins := map[int]*binCounter{256: newBinCounter(sim), 1024: newBinCounter(sim), 65536: newBinCounter(sim)}
	for size, c := range bins {
		require.NoError(t, b.AddBin(size, c))
	}
	require.Equal(t, []int{256, 1024, 65536}, b.binSizes())
	for _, c := range []struct {
		n    int
		want *binCounter
	}{
		{1, bins[256]}, {255, bins[256]}, {256, bins[256]}, {257, bins[1024]}, {1023, bins[1024]},
		{1024, bins[1024]}, {1025, bins[65536]}, {65536, bins[65536]}, {65537, up}, {1 << 30, up},
	} {
		before := c.want.allocs.Load()
		p, err := b.Allocate(c.n, DefaultStream)
		require.NoError(t, err)
		require.Equal(t, before+1, c.want.allocs.Load(), "%d bytes", c.n)
		require.Equal(t, int64(c.n), c.want.lastAlloc.Load(), "the size is passed unrounded")
		freesBefore := c.want.frees.Load()
		require.NoError(t, b.Deallocate(p, c.n, DefaultStream))
		require.Equal(t, freesBefore+1, c.want.frees.Load(), "%d bytes freed by the same resource", c.n)
	}
	// Zero-byte calls reach the smallest bin, so that adaptors inside it see them.
	p, err := b.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, p)
	require.NoError(t, b.Deallocate(0, 0, DefaultStream))
	require.Equal(t, int64(1), bins[256].zeroAllocs.Load())
	require.Equal(t, int64(1), bins[256].zeroFrees.Load())
	require.Zero(t, up.zeroAllocs.Load())
	_, err = b.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Zero(t, sim.UsedBytes())
}

func TestBinningAddBin(t *testing.T) {
	up := newFixedRecorder(t)
	b, err := NewBinningMemoryResource(up, nil)
	require.NoError(t, err)
	defer b.Close()
	require.ErrorIs(t, b.AddBin(0, nil), ErrInvalidArgument)
	require.ErrorIs(t, b.AddBin(-256, nil), ErrInvalidArgument)
	require.ErrorIs(t, b.AddBin(int(^uint(0)>>1), nil), ErrInvalidArgument)

	// Without a resource: a fixed-size bin, rounded up to 256.
	require.NoError(t, b.AddBin(1000, nil))
	require.Equal(t, []int{1024}, b.binSizes())
	allocs, _ := up.calls()
	require.Len(t, allocs, 1)
	require.Equal(t, 128*1024, allocs[0].n)
	// Again at the same (rounded) size: nothing new.
	require.NoError(t, b.AddBin(1024, nil))
	require.NoError(t, b.AddBin(800, nil))
	allocs, _ = up.calls()
	require.Len(t, allocs, 1)

	// With a resource: replaces the bin of that size.
	c := newBinCounter(arenaMustSim(t, 1<<30))
	require.NoError(t, b.AddBin(1024, c))
	require.Equal(t, []int{1024}, b.binSizes())
	p, err := b.Allocate(1000, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, int64(1), c.allocs.Load())
	require.NoError(t, b.Deallocate(p, 1000, DefaultStream))
	// ...and a bin created without a resource does not replace it.
	require.NoError(t, b.AddBin(1024, nil))
	_, err = b.Allocate(1000, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, int64(2), c.allocs.Load())
	// Insertion keeps the order.
	d := newBinCounter(arenaMustSim(t, 1<<30))
	require.NoError(t, b.AddBin(300, d))
	require.NoError(t, b.AddBin(1<<20, nil))
	require.Equal(t, []int{512, 1024, 1 << 20}, b.binSizes())
	bins := b.Bins()
	require.Len(t, bins, 3)
	require.Equal(t, Bin{Size: 512, Resource: d}, bins[0])
	require.Equal(t, Bin{Size: 1024, Resource: c}, bins[1])
	require.Equal(t, 1<<20, bins[2].Size)
	fixed, ok := bins[2].Resource.(*FixedSizeMemoryResource)
	require.True(t, ok, "a bin AddBin made itself: %T", bins[2].Resource)
	require.Equal(t, 1<<20, fixed.BlockSize())
	require.NoError(t, b.CheckInvariants())

	// A bin whose first chunk the upstream refuses is not added.
	up.refuse = true
	require.ErrorIs(t, b.AddBin(8192, nil), ErrOutOfMemory)
	require.Equal(t, []int{512, 1024, 1 << 20}, b.binSizes())
}

func TestBinningInvalidFree(t *testing.T) {
	sim := arenaMustSim(t, 1<<40)
	b, err := NewBinningMemoryResource(sim, &BinningOptions{MinSizeExponent: 10, MaxSizeExponent: 11})
	require.NoError(t, err)
	defer b.Close()
	p, err := b.Allocate(1500, DefaultStream)
	require.NoError(t, err)
	q, err := b.Allocate(10000, DefaultStream)
	require.NoError(t, err)
	require.ErrorIs(t, b.Deallocate(p, 1000, DefaultStream), ErrInvalidFree, "another bin")
	require.ErrorIs(t, b.Deallocate(p, 1600, DefaultStream), ErrInvalidFree, "same bin, wrong size")
	require.ErrorIs(t, b.Deallocate(p, 5000, DefaultStream), ErrInvalidFree, "the upstream's range")
	require.ErrorIs(t, b.Deallocate(q, 2000, DefaultStream), ErrInvalidFree, "an upstream block into a bin")
	require.ErrorIs(t, b.Deallocate(0xdead00, 100, DefaultStream), ErrInvalidFree, "never handed out")
	require.NoError(t, b.Deallocate(p, 1500, DefaultStream))
	require.ErrorIs(t, b.Deallocate(p, 1500, DefaultStream), ErrInvalidFree, "double free")
	require.NoError(t, b.Deallocate(q, 10000, DefaultStream))
	require.ErrorIs(t, b.Deallocate(q, 10000, DefaultStream), ErrInvalidFree, "double free upstream")
	require.NoError(t, b.CheckInvariants())
}

// AddBin while goroutines allocate and free: the bin table is read atomically. The bins that
// serve the goroutines' sizes (up to 64 KiB) all share one address-only resource, so a free
// routed to a bin added after its allocation is still valid; the fixed-size bins the resource
// makes meanwhile are larger than any request.
func TestBinningConcurrentAddBin(t *testing.T) {
	sim := arenaMustSim(t, 1<<40)
	b, err := NewBinningMemoryResource(newBinCounter(sim), nil)
	require.NoError(t, err)
	top := newBinCounter(sim)
	require.NoError(t, b.AddBin(1<<16, top))
	added := make([]*binCounter, 0, 8)
	streams := []StreamView{DefaultStream, mustStream(t), mustStream(t)}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var ops atomic.Int64
	for g := 0; g < 8; g++ {
		wg.Go(func() {
			s := streams[g%len(streams)]
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				n := 1 + (i*7919+g*104729)%(1<<16)
				p, err := b.Allocate(n, s)
				if err == nil {
					err = b.Deallocate(p, n, s)
				}
				if err != nil {
					t.Error(err)
					return
				}
				ops.Add(1)
			}
		})
	}
	for ops.Load() < 100 && !t.Failed() {
		runtime.Gosched() // the goroutines are running before the first AddBin
	}
	for k := 15; k >= 8; k-- {
		c := newBinCounter(sim)
		added = append(added, c)
		require.NoError(t, b.AddBin(1<<k, c))
		require.NoError(t, b.AddBin(1<<17+k*256, nil)) // made by the resource, over the upstream
	}
	for target := ops.Load() + 2000; ops.Load() < target && !t.Failed(); {
		runtime.Gosched()
	}
	close(stop)
	wg.Wait()
	require.False(t, t.Failed())
	require.Len(t, b.binSizes(), 17)
	used := int64(0)
	for _, c := range added {
		used += c.allocs.Load()
	}
	require.Positive(t, used, "the bins added meanwhile served requests")
	want := 0
	for k := 8; k <= 15; k++ {
		want += 128 * (1<<17 + k*256) // the made bins' first chunks
	}
	require.Equal(t, want, sim.UsedBytes(), "every request freed")
	require.NoError(t, b.CheckInvariants())
	require.NoError(t, b.Close())
	require.Zero(t, sim.UsedBytes(), "every made bin closed")
}

func TestBinningBlocksToPreallocate(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 40)
	b, err := NewBinningMemoryResource(sim, &BinningOptions{MinSizeExponent: 18, MaxSizeExponent: 22, BlocksToPreallocate: 4})
	require.NoError(t, err)
	require.Equal(t, 4*(256+512+1024+2048+4096)<<10, sim.UsedBytes(), "4 blocks per bin, not 128")
	p, err := b.Allocate(100, DefaultStream)
	require.NoError(t, err)
	err = b.Deallocate(p, 2000, DefaultStream) // another bin than the allocation's
	require.ErrorIs(t, err, ErrInvalidFree)
	require.Contains(t, err.Error(), "BinningMemoryResource.Deallocate(2000 bytes, in the bin of 262144 bytes)")
	require.NoError(t, b.Deallocate(p, 100, DefaultStream))
	_, err = NewBinningMemoryResource(sim, &BinningOptions{BlocksToPreallocate: -1})
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.NoError(t, b.Close())
}

func TestBinningAfterClose(t *testing.T) {
	b, err := NewBinningMemoryResource(NewSystemMemoryResource(), &BinningOptions{MinSizeExponent: 10, MaxSizeExponent: 10, BlocksToPreallocate: 2})
	require.NoError(t, err)
	small, err := b.Allocate(300, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, b.Close())
	_, err = b.Allocate(300, DefaultStream)
	require.ErrorIs(t, err, ErrClosed)
	_, err = b.Allocate(5000, DefaultStream)
	require.ErrorIs(t, err, ErrClosed, "sizes above every bin too")
	require.ErrorIs(t, b.AddBin(512, nil), ErrClosed)
	require.NoError(t, b.Deallocate(small, 300, DefaultStream), "live allocations are still freed")
	require.NoError(t, b.Close())
}

// binSizes returns the bins' sizes in bytes, smallest first.
func (r *BinningMemoryResource) binSizes() []int {
	bins := r.bins.Load().bins
	out := make([]int, len(bins))
	for i, b := range bins {
		out[i] = b.size
	}
	return out
}

// The bin index (binTable.find) picks what a scan of the bins picks: the smallest bin of at least
// the requested bytes, for bins of powers of two and of other sizes, several in one octave, and
// requests at and around every bin's size and every power of two.
func TestBinningIndexAgainstScan(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 9))
	scan := func(bins []binningBin, n int) int {
		for i, b := range bins {
			if b.size >= n {
				return i
			}
		}
		return -1
	}
	for trial := range 300 {
		seen := map[int]bool{}
		var bins []binningBin
		for range r.IntN(12) {
			var size int
			switch r.IntN(3) {
			case 0:
				size = 1 << (8 + r.IntN(50))
			case 1:
				size = (1 + r.IntN(1<<20)) * Alignment
			default:
				size = (1 + r.IntN(1<<40)) * Alignment
			}
			if !seen[size] {
				seen[size] = true
				bins = append(bins, binningBin{size: size})
			}
		}
		slices.SortFunc(bins, func(x, y binningBin) int { return cmp.Compare(x.size, y.size) })
		tab := newBinTable(bins)
		var ns []int
		for k := range 63 {
			ns = append(ns, 1<<k-1, 1<<k, 1<<k+1)
		}
		for _, b := range bins {
			ns = append(ns, b.size-1, b.size, b.size+1)
		}
		ns = append(ns, 0, math.MaxInt, r.IntN(1<<50))
		for _, n := range ns {
			if n < 0 {
				continue
			}
			want := scan(bins, n)
			got := tab.find(n)
			if want < 0 {
				require.Nil(t, got, "trial %d, %d bytes", trial, n)
				continue
			}
			require.Same(t, &bins[want], got, "trial %d, %d bytes", trial, n)
		}
	}
}
