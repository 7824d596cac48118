package rmm

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The out-of-memory errors and the per-stream statistics of the arena, fixed-size and binning
// resources, over host upstreams (SimulatedMemoryResource), so that they run without a GPU.

// oomStatsStream returns a new Stream's view, closed at the end of the test.
func oomStatsStream(t *testing.T) (*Stream, StreamView) {
	t.Helper()
	s, err := NewStream(CurrentDevice(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s, s.View()
}

// oomStatsError returns err's *OutOfMemoryError, failing the test when there is none.
func oomStatsError(t *testing.T, err error) *OutOfMemoryError {
	t.Helper()
	require.ErrorIs(t, err, ErrOutOfMemory)
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	return oom
}

// Fill the arena with 256 KiB blocks and free every other one: half the arena is free, in
// blocks of 256 KiB, so 512 KiB (small) and 2 MiB (large) requests fail for fragmentation.
func TestArenaOutOfMemoryFragmented(t *testing.T) {
	const mb, q = arenaMinSuperblockSize, arenaMinSuperblockSize / 4
	a, _ := arenaSim(t, 4*mb, nil)
	var ps []DevicePtr
	for range 16 {
		ps = append(ps, arenaAlloc(t, a, q, DefaultStream))
	}
	for i := 0; i < len(ps); i += 2 {
		require.NoError(t, a.Deallocate(ps[i], q, DefaultStream))
	}
	for _, c := range []struct {
		n     int
		human string
	}{{2 * q, "512 KiB"}, {2 * mb, "2 MiB"}} {
		n := c.n
		_, err := a.Allocate(n, DefaultStream)
		oom := oomStatsError(t, err)
		require.Equal(t, OutOfMemoryError{
			Resource: "ArenaMemoryResource", Requested: n, PoolSize: 4 * mb, FreeBytes: 2 * mb,
			LargestFreeBlock: q, MaximumSize: 4 * mb, Headroom: 0, Fragmented: true,
			Detail: "no room in arena, also after defragmenting",
		}, *oom, "request of %d", n)
		require.Contains(t, err.Error(), fmt.Sprintf("rmm: ArenaMemoryResource.Allocate: failed to allocate %d bytes (%s): no room in arena, also after defragmenting; fragmentation: 2097152 bytes (2 MiB) free but the largest free block is 262144 bytes (256 KiB); pool size 4194304 (4 MiB), maximum 4194304 (4 MiB): out of memory", n, c.human))
		require.Nil(t, errors.Unwrap(oom))
	}
	st := a.Stats()
	require.Equal(t, 2*mb, st.FreeBytes, "the failures changed nothing")
	require.Equal(t, 8, st.FreeBlocks)
	require.Equal(t, 8, st.GlobalFreeBlocks, "defragmenting moved every superblock to the global arena")
	arenaCheck(t, a)
	for i := 1; i < len(ps); i += 2 {
		require.NoError(t, a.Deallocate(ps[i], q, DefaultStream))
	}
	arenaAlloc(t, a, 2*mb, DefaultStream)
}

func TestArenaOutOfMemoryExhausted(t *testing.T) {
	const mb, q = arenaMinSuperblockSize, arenaMinSuperblockSize / 4
	a, _ := arenaSim(t, 4*mb, nil)
	_, err := a.Allocate(5*mb, DefaultStream)
	oom := oomStatsError(t, err)
	require.Equal(t, OutOfMemoryError{
		Resource: "ArenaMemoryResource", Requested: 5 * mb, PoolSize: 4 * mb, FreeBytes: 4 * mb,
		LargestFreeBlock: 4 * mb, MaximumSize: 4 * mb, TooLarge: true, Detail: "the request is larger than the arena (4194304 bytes)",
	}, *oom)
	require.Contains(t, err.Error(), "the request is larger than the arena (4194304 bytes); 4194304 bytes (4 MiB) free")
	for range 15 {
		arenaAlloc(t, a, q, DefaultStream)
	}
	arenaAlloc(t, a, q-512, DefaultStream)
	_, err = a.Allocate(1000, DefaultStream) // 1024 once rounded; 512 bytes are free
	oom = oomStatsError(t, err)
	require.Equal(t, OutOfMemoryError{
		Resource: "ArenaMemoryResource", Requested: 1000, PoolSize: 4 * mb, FreeBytes: 512,
		LargestFreeBlock: 512, MaximumSize: 4 * mb, Fragmented: false,
		Detail: "no room in arena, also after defragmenting",
	}, *oom)
	require.Contains(t, err.Error(), "exhausted: 512 bytes free, largest free block 512 bytes; pool size 4194304 (4 MiB), maximum 4194304 (4 MiB): out of memory")
	arenaAlloc(t, a, 512, DefaultStream)
	arenaCheck(t, a)
}

// Frees on two streams stay in those streams' arenas; the global arena is reported apart.
func TestArenaStatsPerStream(t *testing.T) {
	const mb, q, k100 = arenaMinSuperblockSize, arenaMinSuperblockSize / 4, 100 << 10
	a, _ := arenaSim(t, 4*mb, nil)
	_, s1 := oomStatsStream(t)
	s2o, s2 := oomStatsStream(t)
	var p1 []DevicePtr
	for range 3 {
		p1 = append(p1, arenaAlloc(t, a, q, s1))
	}
	x := arenaAlloc(t, a, k100, s2)
	y := arenaAlloc(t, a, k100, s2)
	require.NoError(t, a.Deallocate(p1[0], q, s1))
	require.NoError(t, a.Deallocate(p1[2], q, s1))
	require.NoError(t, a.Deallocate(x, k100, s2))

	st := a.Stats()
	// s1 holds [0, 1 MiB): free [0, 256K) and [512K, 1M); s2 holds [1M, 2M): free [1M, 1M+100K)
	// and [1M+200K, 2M); the global arena the empty [2M, 4M).
	require.Equal(t, []StreamFreeStats{
		{Stream: DefaultStream},
		{Stream: s1, FreeBlocks: 2, FreeBytes: 3 * q},
		{Stream: s2, FreeBlocks: 2, FreeBytes: mb - k100},
	}, st.PerStream)
	require.Equal(t, 1, st.GlobalFreeBlocks)
	require.Equal(t, 2*mb, st.GlobalFreeBytes)
	require.Equal(t, 5, st.FreeBlocks)
	require.Equal(t, 3*q+mb-k100+2*mb, st.FreeBytes)
	require.Equal(t, 4*mb, st.PoolSize)
	require.Equal(t, 4*mb, st.MaximumSize)
	require.Equal(t, 2*mb, st.LargestFreeBlock)
	require.Equal(t, 2, st.StreamArenas)

	// Closing s2 sends its superblock (y still lives in it) to the global arena.
	require.NoError(t, s2o.Close())
	st = a.Stats()
	require.Equal(t, []StreamFreeStats{
		{Stream: DefaultStream},
		{Stream: s1, FreeBlocks: 2, FreeBytes: 3 * q},
	}, st.PerStream)
	require.Equal(t, 3, st.GlobalFreeBlocks)
	require.Equal(t, 2*mb+mb-k100, st.GlobalFreeBytes)
	require.NoError(t, a.Deallocate(y, k100, DefaultStream))
	require.NoError(t, a.Deallocate(p1[1], q, s1))

	// Default-stream shards are summed as one entry.
	b, _ := arenaSim(t, 4*mb, &ArenaOptions{DefaultStreamArenas: 4})
	var ps []DevicePtr
	for range 4 {
		ps = append(ps, arenaAlloc(t, b, q, DefaultStream))
	}
	require.NoError(t, b.Deallocate(ps[1], q, DefaultStream))
	st = b.Stats()
	free := 0
	for _, x := range st.PerStream {
		free += x.FreeBytes
	}
	require.Len(t, st.PerStream, 1)
	require.True(t, st.PerStream[0].Stream.IsDefault())
	require.Equal(t, st.FreeBytes, free+st.GlobalFreeBytes)
	require.Equal(t, st.FreeBlocks, st.PerStream[0].FreeBlocks+st.GlobalFreeBlocks)
	arenaCheck(t, b)
}

// A request above the largest superblock (1 TiB) fails at once, though the arena is larger.
func TestArenaOutOfMemoryAboveSuperblock(t *testing.T) {
	size := 2*arenaMaxSuperblockSize + 3<<20
	a, _ := arenaSim(t, size, nil)
	largest := a.Stats().LargestFreeBlock
	n := arenaMaxSuperblockSize + arenaMaxSuperblockSize/2
	_, err := a.Allocate(n, DefaultStream)
	oom := oomStatsError(t, err)
	require.Equal(t, OutOfMemoryError{
		Resource: "ArenaMemoryResource", Requested: n, PoolSize: size, FreeBytes: size,
		LargestFreeBlock: largest, MaximumSize: size, Fragmented: true,
		Detail: "the request is larger than the largest superblock (1 TiB)",
	}, *oom)
	require.Less(t, largest, arenaMaxSuperblockSize)
	require.Zero(t, a.Stats().Defragmentations)
}

// A fixed-size resource serves no request above its block size: the failure is TooLarge, never
// fragmentation, however many blocks are free.
func TestFixedSizeOutOfMemoryAboveBlockSize(t *testing.T) {
	const bs = 4096
	f := fixedNew(t, arenaMustSim(t, 1<<30), &FixedSizeOptions{BlockSize: bs, BlocksToPreallocate: 4})
	p, err := f.Allocate(100, DefaultStream)
	require.NoError(t, err)
	_, err = f.Allocate(2*bs, DefaultStream)
	oom := oomStatsError(t, err)
	require.Equal(t, OutOfMemoryError{
		Resource: "FixedSizeMemoryResource", Requested: 2 * bs, PoolSize: 4 * bs, FreeBytes: 3 * bs,
		LargestFreeBlock: bs, TooLarge: true,
		Detail: "maximum allocation size exceeded: every block is 4096 bytes, and larger requests always fail",
	}, *oom)
	require.Contains(t, err.Error(), "maximum allocation size exceeded: every block is 4096 bytes, and larger requests always fail; 12288 bytes (12 KiB) free, largest free block 4096 bytes (4 KiB); pool size 16384 (16 KiB), no maximum: out of memory")

	var ps []DevicePtr
	for range 3 {
		q, err := f.Allocate(bs, DefaultStream)
		require.NoError(t, err)
		ps = append(ps, q)
	}
	_, err = f.Allocate(bs+1, DefaultStream)
	oom = oomStatsError(t, err)
	require.Equal(t, OutOfMemoryError{
		Resource: "FixedSizeMemoryResource", Requested: bs + 1, PoolSize: 4 * bs, TooLarge: true,
		Detail: "maximum allocation size exceeded: every block is 4096 bytes, and larger requests always fail",
	}, *oom)
	require.Contains(t, err.Error(), "and larger requests always fail; 0 bytes free, largest free block 0 bytes")
	require.Equal(t, 1, f.Stats().UpstreamBlocks, "no growth for a request above the block size")
	require.NoError(t, f.Deallocate(p, 100, DefaultStream))
	for _, q := range ps {
		require.NoError(t, f.Deallocate(q, bs, DefaultStream))
	}
	fixedCheck(t, f)
}

// The upstream refuses a new chunk: exhaustion, with the upstream's error as the cause.
func TestFixedSizeOutOfMemoryExhausted(t *testing.T) {
	const bs = 4096
	sim := arenaMustSim(t, 4*bs)
	f := fixedNew(t, sim, &FixedSizeOptions{BlockSize: bs, BlocksToPreallocate: 4})
	for range 4 {
		_, err := f.Allocate(bs, DefaultStream)
		require.NoError(t, err)
	}
	before := f.Stats()
	_, err := f.Allocate(10, DefaultStream)
	oom := oomStatsError(t, err)
	require.NotNil(t, oom.Cause)
	require.Same(t, oom, err.(*OutOfMemoryError), "returned as it is")
	_, simErr := sim.Allocate(4*bs, DefaultStream)
	require.Equal(t, simErr.Error(), oom.Cause.Error(), "the upstream's own error")
	require.Equal(t, OutOfMemoryError{
		Resource: "FixedSizeMemoryResource", Requested: 10, PoolSize: 4 * bs,
		Detail: "growing by a chunk of 4 blocks of 4096 bytes (16384 bytes): SimulatedMemoryResource refused it",
		Cause:  oom.Cause,
	}, *oom)
	require.Equal(t, oom.Cause, errors.Unwrap(err))
	require.Contains(t, err.Error(), "rmm: FixedSizeMemoryResource.Allocate: failed to allocate 10 bytes (10 B): growing by a chunk of 4 blocks of 4096 bytes (16384 bytes): SimulatedMemoryResource refused it; exhausted: 0 bytes free, largest free block 0 bytes; pool size 16384 (16 KiB), no maximum: upstream: SimulatedMemoryResource.Allocate (capacity 16384, in use 16384): failed to allocate 16384 bytes (16 KiB): out of memory")
	require.Equal(t, 1, strings.Count(err.Error(), "out of memory"), "the sentinel's text once")
	require.Equal(t, 1, strings.Count(err.Error(), "rmm: "), "\"rmm: \" once")
	require.Equal(t, before, f.Stats(), "a failed call changes nothing")
	fixedCheck(t, f)

	// The first chunk refused at construction.
	_, err = NewFixedSizeMemoryResource(arenaMustSim(t, bs), &FixedSizeOptions{BlockSize: bs, BlocksToPreallocate: 4})
	oom = oomStatsError(t, err)
	require.Equal(t, 4*bs, oom.Requested)
	require.Zero(t, oom.PoolSize)
	require.False(t, oom.Fragmented)
	require.NotNil(t, oom.Cause)
}

// Frees on two streams go to those streams' lists.
func TestFixedSizeStatsPerStream(t *testing.T) {
	const bs = 4096
	f := fixedNew(t, arenaMustSim(t, 1<<30), &FixedSizeOptions{BlockSize: bs, BlocksToPreallocate: 4})
	_, s1 := oomStatsStream(t)
	s2o, s2 := oomStatsStream(t)
	a, err := f.Allocate(1, s1)
	require.NoError(t, err)
	b, err := f.Allocate(2, s2)
	require.NoError(t, err)
	c, err := f.Allocate(3, s2)
	require.NoError(t, err)
	d, err := f.Allocate(4, DefaultStream)
	require.NoError(t, err)
	st := f.Stats()
	require.Zero(t, st.LargestFreeBlock, "every block in use")
	require.Zero(t, st.FreeBlocks)
	require.NoError(t, f.Deallocate(a, 1, s1))
	require.NoError(t, f.Deallocate(b, 2, s2))
	require.NoError(t, f.Deallocate(c, 3, s2))
	st = f.Stats()
	require.Equal(t, FixedSizeStats{
		BlockSize: bs, PoolSize: 4 * bs, UpstreamBlocks: 1, LiveAllocations: 1, LiveBytes: bs,
		FreeBlocks: 3, FreeBytes: 3 * bs, LargestFreeBlock: bs, Streams: 3,
		PerStream: []StreamFreeStats{
			{Stream: DefaultStream},
			{Stream: s1, FreeBlocks: 1, FreeBytes: bs},
			{Stream: s2, FreeBlocks: 2, FreeBytes: 2 * bs},
		},
	}, st)
	// Closing s2 moves its blocks to the default stream's list.
	require.NoError(t, s2o.Close())
	require.Equal(t, []StreamFreeStats{
		{Stream: DefaultStream, FreeBlocks: 2, FreeBytes: 2 * bs},
		{Stream: s1, FreeBlocks: 1, FreeBytes: bs},
	}, f.Stats().PerStream)
	require.NoError(t, f.Deallocate(d, 4, DefaultStream))
	fixedCheck(t, f)
}

// A bin's resource that returns an *OutOfMemoryError has it returned as it is; other resources'
// out-of-memory errors are wrapped in one that names the bin.
func TestBinningOutOfMemory(t *testing.T) {
	const kb = 1024
	// Exactly the bins' first chunks: 2 blocks each of 1, 2 and 4 KiB.
	sim := arenaMustSim(t, 2*(1+2+4)*kb)
	b, err := NewBinningMemoryResource(sim, &BinningOptions{MinSizeExponent: 10, MaxSizeExponent: 12, BlocksToPreallocate: 2})
	require.NoError(t, err)
	defer b.Close()
	for range 2 {
		_, err := b.Allocate(1000, DefaultStream)
		require.NoError(t, err)
	}

	// Exhaustion in a fixed-size bin: its error as it is.
	_, err = b.Allocate(1000, DefaultStream)
	oom := oomStatsError(t, err)
	require.Same(t, oom, err.(*OutOfMemoryError))
	require.NotNil(t, oom.Cause)
	require.Equal(t, OutOfMemoryError{
		Resource: "FixedSizeMemoryResource", Requested: 1000, PoolSize: 2 * kb,
		Detail: "growing by a chunk of 2 blocks of 1024 bytes (2048 bytes): SimulatedMemoryResource refused it",
		Cause:  oom.Cause,
	}, *oom)

	// Fragmentation in a bin served by an arena: its error as it is. 128 KiB requests go to the
	// 256 KiB bin; freeing every other one leaves 512 KiB free in 128 KiB blocks.
	const q = arenaMinSuperblockSize / 8
	arena, _ := arenaSim(t, arenaMinSuperblockSize, nil)
	require.NoError(t, b.AddBin(2*q, arena))
	var ps []DevicePtr
	for range 8 {
		p, err := b.Allocate(q, DefaultStream)
		require.NoError(t, err)
		ps = append(ps, p)
	}
	for i := 0; i < len(ps); i += 2 {
		require.NoError(t, b.Deallocate(ps[i], q, DefaultStream))
	}
	_, err = b.Allocate(2*q, DefaultStream)
	oom = oomStatsError(t, err)
	require.Same(t, oom, err.(*OutOfMemoryError))
	require.Equal(t, OutOfMemoryError{
		Resource: "ArenaMemoryResource", Requested: 2 * q, PoolSize: 8 * q, FreeBytes: 4 * q,
		LargestFreeBlock: q, MaximumSize: 8 * q, Fragmented: true,
		Detail: "no room in arena, also after defragmenting",
	}, *oom)

	// A bin whose resource returns a plain ErrOutOfMemory, and the upstream: wrapped.
	small := arenaMustSim(t, 0)
	require.NoError(t, b.AddBin(1<<20, small))
	_, err = b.Allocate(600<<10, DefaultStream)
	oom = oomStatsError(t, err)
	require.Equal(t, OutOfMemoryError{
		Resource: "BinningMemoryResource", Requested: 600 << 10,
		Detail: "in the bin of 1048576 bytes, served by SimulatedMemoryResource",
		Cause:  oom.Cause,
	}, *oom)
	require.ErrorContains(t, oom.Cause, "SimulatedMemoryResource")
	require.Contains(t, err.Error(), "rmm: BinningMemoryResource.Allocate: failed to allocate 614400 bytes (600 KiB): in the bin of 1048576 bytes, served by SimulatedMemoryResource; exhausted: 0 bytes free, largest free block 0 bytes; pool size 0, no maximum: upstream: SimulatedMemoryResource.Allocate (capacity 0, in use 0): failed to allocate 614400 bytes (600 KiB): out of memory")
	require.Equal(t, 1, strings.Count(err.Error(), "out of memory"), "the sentinel's text once")
	require.Equal(t, 1, strings.Count(err.Error(), "rmm: "), "\"rmm: \" once")
	_, err = b.Allocate(2<<20, DefaultStream)
	oom = oomStatsError(t, err)
	require.Equal(t, "larger than every bin, to the upstream SimulatedMemoryResource", oom.Detail)
	require.Equal(t, 2<<20, oom.Requested)
	require.False(t, oom.Fragmented)
	require.NotNil(t, oom.Cause)

	// Other errors still name the bin.
	closed := fixedNew(t, arenaMustSim(t, 1<<30), &FixedSizeOptions{BlockSize: 2 << 20, BlocksToPreallocate: 1})
	require.NoError(t, closed.Close())
	require.NoError(t, b.AddBin(2<<20, closed))
	_, err = b.Allocate(2<<20, DefaultStream)
	require.ErrorIs(t, err, ErrClosed)
	require.NotErrorIs(t, err, ErrOutOfMemory)
	require.Contains(t, err.Error(), "BinningMemoryResource.Allocate(2097152 bytes, in the bin of 2097152 bytes)")
	for i := 1; i < len(ps); i += 2 {
		require.NoError(t, b.Deallocate(ps[i], q, DefaultStream))
	}
	require.NoError(t, b.CheckInvariants())
}

// Per-bin figures, totals and the per-stream sums over the fixed-size bins.
func TestBinningStats(t *testing.T) {
	const kb = 1024
	b, err := NewBinningMemoryResource(arenaMustSim(t, 1<<30), &BinningOptions{MinSizeExponent: 10, MaxSizeExponent: 11, BlocksToPreallocate: 2})
	require.NoError(t, err)
	defer b.Close()
	user := fixedNew(t, arenaMustSim(t, 1<<30), &FixedSizeOptions{BlockSize: 4 * kb, BlocksToPreallocate: 2})
	require.NoError(t, b.AddBin(4*kb, user))
	require.NoError(t, b.AddBin(8*kb, arenaMustSim(t, 1<<30)))
	_, s1 := oomStatsStream(t)
	_, s2 := oomStatsStream(t)

	type call struct {
		n int
		s StreamView
	}
	var frees []DevicePtr
	calls := []call{{1000, s1}, {1500, s2}, {1500, s2}, {3000, s2}}
	for _, c := range calls {
		p, err := b.Allocate(c.n, c.s)
		require.NoError(t, err)
		frees = append(frees, p)
	}
	live, err := b.Allocate(4000, DefaultStream) // the 4 KiB bin's default-stream block
	require.NoError(t, err)
	for i, c := range calls {
		require.NoError(t, b.Deallocate(frees[i], c.n, c.s))
	}

	st := b.Stats()
	require.Equal(t, "SimulatedMemoryResource", st.Upstream)
	require.Len(t, st.Bins, 4)
	require.Equal(t, BinStats{Size: kb, Resource: "FixedSizeMemoryResource", Owned: true, FixedSize: &FixedSizeStats{
		BlockSize: kb, PoolSize: 2 * kb, UpstreamBlocks: 1, FreeBlocks: 2, FreeBytes: 2 * kb, LargestFreeBlock: kb, Streams: 2,
		PerStream: []StreamFreeStats{{Stream: DefaultStream, FreeBlocks: 1, FreeBytes: kb}, {Stream: s1, FreeBlocks: 1, FreeBytes: kb}},
	}}, st.Bins[0])
	require.Equal(t, BinStats{Size: 2 * kb, Resource: "FixedSizeMemoryResource", Owned: true, FixedSize: &FixedSizeStats{
		BlockSize: 2 * kb, PoolSize: 4 * kb, UpstreamBlocks: 1, FreeBlocks: 2, FreeBytes: 4 * kb, LargestFreeBlock: 2 * kb, Streams: 2,
		PerStream: []StreamFreeStats{{Stream: DefaultStream}, {Stream: s2, FreeBlocks: 2, FreeBytes: 4 * kb}},
	}}, st.Bins[1])
	require.Equal(t, BinStats{Size: 4 * kb, Resource: "FixedSizeMemoryResource", Owned: false, FixedSize: &FixedSizeStats{
		BlockSize: 4 * kb, PoolSize: 8 * kb, UpstreamBlocks: 1, LiveAllocations: 1, LiveBytes: 4 * kb,
		FreeBlocks: 1, FreeBytes: 4 * kb, LargestFreeBlock: 4 * kb, Streams: 2,
		PerStream: []StreamFreeStats{{Stream: DefaultStream}, {Stream: s2, FreeBlocks: 1, FreeBytes: 4 * kb}},
	}}, st.Bins[2])
	require.Equal(t, BinStats{Size: 8 * kb, Resource: "SimulatedMemoryResource"}, st.Bins[3])
	require.Equal(t, 14*kb, st.PoolSize)
	require.Zero(t, st.MaximumSize)
	require.Equal(t, 1, st.LiveAllocations)
	require.Equal(t, 4*kb, st.LiveBytes)
	require.Equal(t, 5, st.FreeBlocks)
	require.Equal(t, 10*kb, st.FreeBytes)
	require.Equal(t, 4*kb, st.LargestFreeBlock)
	require.Equal(t, []StreamFreeStats{
		{Stream: DefaultStream, FreeBlocks: 1, FreeBytes: kb},
		{Stream: s1, FreeBlocks: 1, FreeBytes: kb},
		{Stream: s2, FreeBlocks: 3, FreeBytes: 8 * kb},
	}, st.PerStream)

	require.NoError(t, b.Deallocate(live, 4000, DefaultStream))
	st = b.Stats()
	require.Equal(t, 14*kb, st.FreeBytes)
	require.Equal(t, []StreamFreeStats{
		{Stream: DefaultStream, FreeBlocks: 2, FreeBytes: 5 * kb},
		{Stream: s1, FreeBlocks: 1, FreeBytes: kb},
		{Stream: s2, FreeBlocks: 3, FreeBytes: 8 * kb},
	}, st.PerStream)

	empty, err := NewBinningMemoryResource(arenaMustSim(t, 1<<20), nil)
	require.NoError(t, err)
	require.Equal(t, BinningStats{Bins: []BinStats{}, Upstream: "SimulatedMemoryResource"}, empty.Stats())
}
