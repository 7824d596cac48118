package rmm

import (
	"cmp"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// GPU tests of the arena, fixed-size and binning resources over CudaMemoryResource. Each
// cross-stream case follows TestGPUPoolCrossStreamReuse: stream A queues a long series of fills
// on a block, copies it to a result buffer and frees it; stream B then gets the same block and
// overwrites it at once. If B were not ordered after A's work, A's last fill or copy would run
// after B's fill, and either the result or the block would hold the wrong value.

// suballocQueueWork queues on s a long series of fills of a 256 MiB scratch buffer (so that what
// follows still waits when the host goes on), a few fills of x, the value 0x07 over x, and a
// copy of x to result.
func suballocQueueWork(t *testing.T, ctx uintptr, x, result DevicePtr, n int, s StreamView) {
	t.Helper()
	const scratchSize = 256 << 20
	scratch := suballocScratch(t)
	for i := 0; i < 200; i++ { // ~200 × 60 µs
		require.NoError(t, deviceFill(0, scratch, scratchSize, []byte{1, 2, 3, 4, 5, 6, 7, byte(i)}, s))
	}
	for i := 0; i < 8; i++ {
		require.NoError(t, deviceFill(0, x, n, []byte{8, 7, 6, 5, 4, 3, 2, byte(i)}, s))
	}
	require.NoError(t, deviceFill(0, x, n, le64(0x0707070707070707), s))
	require.NoError(t, cuMemcpyDtoDAsync(ctx, result, x, n, s.cu()))
}

var (
	suballocScratchPtr DevicePtr
	suballocScratchMu  sync.Mutex
)

// suballocScratch returns a 256 MiB device buffer shared by the tests (never freed: it lives
// as long as the test binary).
func suballocScratch(t *testing.T) DevicePtr {
	t.Helper()
	suballocScratchMu.Lock()
	defer suballocScratchMu.Unlock()
	if suballocScratchPtr == 0 {
		cuda, err := NewCudaMemoryResource(0)
		require.NoError(t, err)
		p, err := cuda.Allocate(256<<20, DefaultStream)
		require.NoError(t, err)
		suballocScratchPtr = p
	}
	return suballocScratchPtr
}

// suballocCheckEnds checks the first and last MiB (or all) of p against want.
func suballocCheckEnds(t *testing.T, ctx uintptr, p DevicePtr, n int, want byte) {
	t.Helper()
	k := min(n, 1<<20)
	checkAll(t, ctx, p, k, want)
	checkAll(t, ctx, p+DevicePtr(n-k), k, want)
}

func suballocCuda(t *testing.T) (*CudaMemoryResource, uintptr) {
	t.Helper()
	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	ctx, err := Device(0).ctx()
	require.NoError(t, err)
	return cuda, ctx
}

func suballocStreams(t *testing.T) (*Stream, *Stream) {
	t.Helper()
	a, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	b, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

func TestGPUSuballocRoundTrip(t *testing.T) {
	requireGPU(t)
	cuda, ctx := suballocCuda(t)
	arena, err := NewArenaMemoryResource(cuda, &ArenaOptions{ArenaSize: 256 << 20})
	require.NoError(t, err)
	defer arena.Close()
	fixed, err := NewFixedSizeMemoryResource(cuda, &FixedSizeOptions{BlockSize: 1 << 20, BlocksToPreallocate: 8})
	require.NoError(t, err)
	defer fixed.Close()
	binning, err := NewBinningMemoryResource(cuda, &BinningOptions{MinSizeExponent: 12, MaxSizeExponent: 16})
	require.NoError(t, err)
	defer binning.Close()
	s, _ := suballocStreams(t)
	for name, c := range map[string]struct {
		mr    MemoryResource
		sizes []int
	}{
		"arena":   {arena, []int{256, 100000, 1 << 20, 3<<20 + 256, 64 << 20}},
		"fixed":   {fixed, []int{1, 4096, 1 << 20}},
		"binning": {binning, []int{1, 4096, 4097, 1 << 16, 1<<16 + 1, 8 << 20}},
	} {
		t.Run(name, func(t *testing.T) {
			for _, n := range c.sizes {
				p, err := c.mr.Allocate(n, s.View())
				require.NoError(t, err)
				require.NotZero(t, p)
				require.Zero(t, p%256)
				src := make([]byte, n)
				for i := range src {
					src[i] = byte(i*13 + n)
				}
				require.NoError(t, cuMemcpyHtoDSync(ctx, p, unsafe.Pointer(&src[0]), n, s.View().cu()))
				dst := make([]byte, n)
				require.NoError(t, cuMemcpyDtoHSync(ctx, unsafe.Pointer(&dst[0]), p, n, s.View().cu()))
				require.Equal(t, src, dst, "%d bytes", n)
				// Freed on the default stream: another stream than the allocation's.
				require.NoError(t, s.Synchronize())
				require.NoError(t, c.mr.Deallocate(p, n, DefaultStream))
			}
			z, err := c.mr.Allocate(0, s.View())
			require.NoError(t, err)
			require.Zero(t, z)
			require.NoError(t, c.mr.Deallocate(0, 0, s.View()))
			if ci, ok := c.mr.(interface{ CheckInvariants() error }); ok {
				require.NoError(t, ci.CheckInvariants())
			}
		})
	}
}

// 1 PiB fails with ErrOutOfMemory, naming the size, and every resource keeps working.
func TestGPUSuballocOutOfMemory(t *testing.T) {
	requireGPU(t)
	cuda, _ := suballocCuda(t)
	arena, err := NewArenaMemoryResource(cuda, &ArenaOptions{ArenaSize: 64 << 20})
	require.NoError(t, err)
	defer arena.Close()
	fixed, err := NewFixedSizeMemoryResource(cuda, &FixedSizeOptions{BlocksToPreallocate: 4})
	require.NoError(t, err)
	defer fixed.Close()
	binning, err := NewBinningMemoryResource(cuda, &BinningOptions{MinSizeExponent: 10, MaxSizeExponent: 12})
	require.NoError(t, err)
	defer binning.Close()
	const pib = 1 << 50
	for name, mr := range map[string]MemoryResource{"arena": arena, "fixed": fixed, "binning": binning} {
		t.Run(name, func(t *testing.T) {
			_, err := mr.Allocate(pib, DefaultStream)
			require.ErrorIs(t, err, ErrOutOfMemory)
			require.Contains(t, err.Error(), "1125899906842624")
			var oom *OutOfMemoryError
			require.ErrorAs(t, err, &oom)
			require.Equal(t, pib, oom.Requested)
			require.False(t, oom.Fragmented, "more than the device holds")
			p, err := mr.Allocate(4096, DefaultStream)
			require.NoError(t, err, "still usable")
			require.NoError(t, mr.Deallocate(p, 4096, DefaultStream))
		})
	}
}

// librmm's SmallMediumLarge on the device: the default arena (half the free memory), 256 B,
// 64 MiB and a third of what the device has free then, all written on the GPU.
func TestGPUArenaSmallMediumLarge(t *testing.T) {
	requireGPU(t)
	cuda, ctx := suballocCuda(t)
	free0, _, err := AvailableDeviceMemory()
	require.NoError(t, err)
	arena, err := NewArenaMemoryResource(cuda, nil)
	require.NoError(t, err)
	defer func() { require.NoError(t, arena.Close()) }()
	require.InDelta(t, float64(free0)/2, float64(arena.ArenaSize()), float64(free0)/50)
	small := arenaAlloc(t, arena, 256, DefaultStream)
	medium := arenaAlloc(t, arena, 64<<20, DefaultStream)
	free, _, err := AvailableDeviceMemory()
	require.NoError(t, err)
	large := arenaAlloc(t, arena, free/3, DefaultStream)
	for i, x := range []struct {
		p DevicePtr
		n int
	}{{small, 256}, {medium, 64 << 20}, {large, AlignDown(free/3, 8)}} {
		require.NoError(t, deviceFill(0, x.p, x.n, le64(0x0101010101010101*uint64(i+1)), DefaultStream))
	}
	require.NoError(t, Device(0).Synchronize())
	suballocCheckEnds(t, ctx, small, 256, 1)
	suballocCheckEnds(t, ctx, medium, 64<<20, 2)
	suballocCheckEnds(t, ctx, large, AlignDown(free/3, 8), 3)
	require.NoError(t, arena.Deallocate(small, 256, DefaultStream))
	require.NoError(t, arena.Deallocate(medium, 64<<20, DefaultStream))
	require.NoError(t, arena.Deallocate(large, free/3, DefaultStream))
	require.NoError(t, arena.CheckInvariants())
}

// gpuCrossStreamRounds runs the cross-stream case over mr (whose upstream is the device's
// CudaMemoryResource cuda), rounds times: A allocates n bytes (at first, when first is not 0),
// queues suballocQueueWork on them and frees them; with fresh, A is a new stream closed (its work
// still running) before B allocates. B then allocates sizeB bytes (0: n), must get A's block,
// and overwrites it at once; after waiting for both (the device, with fresh), A's copy must hold
// 0x07 and B's block 0x09. after runs at the end of each round.
func gpuCrossStreamRounds(t *testing.T, mr MemoryResource, n, sizeB, rounds int, first DevicePtr, fresh bool, after func()) {
	t.Helper()
	cuda, ctx := suballocCuda(t)
	a, b := suballocStreams(t)
	result, err := cuda.Allocate(n, DefaultStream)
	require.NoError(t, err)
	defer cuda.Deallocate(result, n, DefaultStream)
	sizeB = cmp.Or(sizeB, n)
	for round := range rounds {
		if fresh {
			a, err = NewStream(0, &StreamOptions{NonBlocking: true})
			require.NoError(t, err)
		}
		x := arenaAlloc(t, mr, n, a.View())
		if first != 0 {
			require.Equal(t, first, x, "round %d", round)
		}
		suballocQueueWork(t, ctx, x, result, n, a.View())
		require.NoError(t, mr.Deallocate(x, n, a.View()))
		if fresh {
			require.NoError(t, a.Close())
		}
		y := arenaAlloc(t, mr, sizeB, b.View())
		require.Equal(t, x, y, "round %d: B gets A's block", round)
		require.NoError(t, deviceFill(0, y, n, le64(0x0909090909090909), b.View()))
		if fresh {
			require.NoError(t, Device(0).Synchronize())
		} else {
			require.NoError(t, a.Synchronize())
			require.NoError(t, b.Synchronize())
		}
		checkAll(t, ctx, result, n, 0x07)
		checkAll(t, ctx, y, n, 0x09)
		require.NoError(t, mr.Deallocate(y, sizeB, b.View()))
		if after != nil {
			after()
		}
	}
}

// A large block freed on A (into the global arena: the free does not wait, B waits on the device
// for A's work when it takes the block) is given to B.
func TestGPUArenaLargeCrossStreamReuse(t *testing.T) {
	requireGPU(t)
	cuda, _ := suballocCuda(t)
	const n = 256 << 20
	arena, err := NewArenaMemoryResource(cuda, &ArenaOptions{ArenaSize: 2 * n})
	require.NoError(t, err)
	defer arena.Close()
	gpuCrossStreamRounds(t, arena, n, 0, 3, arena.base, false, nil)
	require.NoError(t, arena.CheckInvariants())
}

// A small block freed on A stays in A's arena with A's work still running; closing A hands its
// superblocks to the global arena, and B, which takes them, must not overtake A's work.
func TestGPUArenaReuseAfterStreamClose(t *testing.T) {
	requireGPU(t)
	cuda, _ := suballocCuda(t)
	arena, err := NewArenaMemoryResource(cuda, &ArenaOptions{ArenaSize: 64 << 20})
	require.NoError(t, err)
	defer arena.Close()
	// B keeps its superblock; Release gives it back so the next round starts from the base again.
	gpuCrossStreamRounds(t, arena, 1<<20, 0, 3, arena.base, true, func() { require.NoError(t, arena.Release()) })
	require.NoError(t, arena.CheckInvariants())
}

// A block freed on A (its work still running) is reached by B's large request only through a
// defragmentation, which must wait for the device before handing A's superblock over.
func TestGPUArenaDefragmentOrdersPendingWork(t *testing.T) {
	requireGPU(t)
	cuda, ctx := suballocCuda(t)
	const mb = arenaMinSuperblockSize
	arena, err := NewArenaMemoryResource(cuda, &ArenaOptions{ArenaSize: 2 * mb})
	require.NoError(t, err)
	defer arena.Close()
	a, b := suballocStreams(t)
	result, err := cuda.Allocate(mb, DefaultStream)
	require.NoError(t, err)
	defer cuda.Deallocate(result, mb, DefaultStream)
	for round := 0; round < 3; round++ {
		x := arenaAlloc(t, arena, mb, a.View())
		require.Equal(t, arena.base, x)
		suballocQueueWork(t, ctx, x, result, mb, a.View())
		require.NoError(t, arena.Deallocate(x, mb, a.View()))
		defrags := arena.Stats().Defragmentations
		y := arenaAlloc(t, arena, 2*mb, b.View())
		require.Equal(t, x, y)
		require.Equal(t, defrags+1, arena.Stats().Defragmentations)
		require.NoError(t, deviceFill(0, y, 2*mb, le64(0x0909090909090909), b.View()))
		require.NoError(t, a.Synchronize())
		require.NoError(t, b.Synchronize())
		checkAll(t, ctx, result, mb, 0x07)
		checkAll(t, ctx, y, 2*mb, 0x09)
		require.NoError(t, arena.Deallocate(y, 2*mb, b.View()))
	}
	require.NoError(t, arena.CheckInvariants())
}

// The pool's case for the fixed-size resource: one block, freed on A with A's work running,
// taken by B after B waits on A's event.
func TestGPUFixedSizeCrossStreamReuse(t *testing.T) {
	requireGPU(t)
	cuda, _ := suballocCuda(t)
	const n = 256 << 20
	fixed, err := NewFixedSizeMemoryResource(cuda, &FixedSizeOptions{BlockSize: n, BlocksToPreallocate: 1})
	require.NoError(t, err)
	defer fixed.Close()
	gpuCrossStreamRounds(t, fixed, n, n-1000, 3, 0, false, nil)
	require.Equal(t, 1, fixed.Stats().UpstreamBlocks, "never grew")
	require.NoError(t, fixed.CheckInvariants())
}

// As above, with A closed (its work still running) before B allocates: A's blocks move to the
// default stream behind a device-side wait.
func TestGPUFixedSizeReuseAfterStreamClose(t *testing.T) {
	requireGPU(t)
	cuda, _ := suballocCuda(t)
	const n = 256 << 20
	fixed, err := NewFixedSizeMemoryResource(cuda, &FixedSizeOptions{BlockSize: n, BlocksToPreallocate: 1})
	require.NoError(t, err)
	defer fixed.Close()
	gpuCrossStreamRounds(t, fixed, n, 0, 2, 0, true, nil)
	require.NoError(t, fixed.CheckInvariants())
}

// Through a binning resource: the bin (a one-block fixed-size resource) orders B after A; a
// request above the bin goes to the CUDA upstream, outside the bin's chunk.
func TestGPUBinningCrossStreamReuse(t *testing.T) {
	requireGPU(t)
	cuda, ctx := suballocCuda(t)
	const n = 64 << 20
	bin, err := NewFixedSizeMemoryResource(cuda, &FixedSizeOptions{BlockSize: n, BlocksToPreallocate: 1})
	require.NoError(t, err)
	defer bin.Close()
	binning, err := NewBinningMemoryResource(cuda, nil)
	require.NoError(t, err)
	require.NoError(t, binning.AddBin(n, bin))
	gpuCrossStreamRounds(t, binning, n, n/2+1, 3, 0, false, nil)
	a, _ := suballocStreams(t)
	big, err := binning.Allocate(n+1, a.View())
	require.NoError(t, err)
	require.Equal(t, 1, bin.Stats().UpstreamBlocks)
	require.Zero(t, bin.Stats().LiveAllocations, "served by the upstream")
	require.NoError(t, deviceFill(0, big, n, []byte{5}, a.View()))
	require.NoError(t, a.Synchronize())
	suballocCheckEnds(t, ctx, big, n, 5)
	require.NoError(t, binning.Deallocate(big, n+1, a.View()))
	require.NoError(t, binning.CheckInvariants())
}
