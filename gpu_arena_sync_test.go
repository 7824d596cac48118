package rmm

import (
	"regexp"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// GPU tests of the arena's stream-ordered reuse of the global arena: a free there does not wait,
// and the stream that takes the memory waits on the device for the freeing stream's work. Each
// case follows TestGPUPoolCrossStreamReuse: stream A queues long work over a block, then a fill
// of 0x07 and a copy of the block to a result buffer (gpuBusyThenCopy), and frees it; stream B
// gets the same memory and fills it with 0x09 at once. Had B not waited, A's fills would land
// after B's (the block would not hold 0x09) or B's before A's copy (the result would not hold
// 0x07). The arena's CUDA calls go through arenaSyncFake, which passes them on and logs them.

// arenaSyncGPU returns an arena of size bytes over the device, whose CUDA calls are logged.
func arenaSyncGPU(t *testing.T, size int) (*ArenaMemoryResource, *arenaSyncFake, *CudaMemoryResource, uintptr) {
	t.Helper()
	cuda, ctx := suballocCuda(t)
	arena, err := NewArenaMemoryResource(cuda, &ArenaOptions{ArenaSize: size})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, arena.Close()) })
	f := newArenaSyncFake(&cudaCalls)
	arena.drv = f.driver()
	return arena, f, cuda, ctx
}

// arenaSyncResult returns an n-byte device buffer freed at the end of the test.
func arenaSyncResult(t *testing.T, cuda *CudaMemoryResource, n int) DevicePtr {
	t.Helper()
	p, err := cuda.Allocate(n, DefaultStream)
	require.NoError(t, err)
	t.Cleanup(func() { cuda.Deallocate(p, n, DefaultStream) })
	return p
}

// arenaSyncHas reports whether a call of the log matches the regular expression re.
func arenaSyncHas(log []string, re string) bool {
	m := regexp.MustCompile("^" + re + "$")
	return slices.ContainsFunc(log, m.MatchString)
}

// A large block freed on A with A's work still queued, taken by B's large request.
func TestGPUArenaSyncLargeCrossStream(t *testing.T) {
	requireGPU(t)
	const n = 256 << 20
	arena, f, cuda, ctx := arenaSyncGPU(t, 2*n)
	a, b := suballocStreams(t)
	f.name(a.View().h, "A")
	f.name(b.View().h, "B")
	result := arenaSyncResult(t, cuda, n)
	for round := 0; round < 3; round++ {
		x := arenaAlloc(t, arena, n, a.View())
		require.Equal(t, arena.base, x)
		gpuBusyThenCopy(t, ctx, x, n, result, a.View())
		f.take()
		require.NoError(t, arena.Deallocate(x, n, a.View()))
		require.Empty(t, f.take(), "the free neither synchronises nor records")
		y := arenaAlloc(t, arena, n, b.View())
		require.Equal(t, x, y)
		log := f.take()
		require.True(t, arenaSyncHas(log, `record e\d+ on A, wait B`), "%q", log)
		require.NoError(t, deviceFill(0, y, n, le64(0x0909090909090909), b.View()))
		require.NoError(t, a.Synchronize())
		require.NoError(t, b.Synchronize())
		checkAll(t, ctx, result, n, 0x07)
		checkAll(t, ctx, y, n, 0x09)
		require.NoError(t, arena.Deallocate(y, n, b.View()))
	}
	require.Empty(t, f.errors())
	require.NoError(t, arena.CheckInvariants())
}

// The same memory taken by a small request on B: the superblock moves into B's arena after B
// waits for A.
func TestGPUArenaSyncTakeSuperblock(t *testing.T) {
	requireGPU(t)
	const n = 256 << 20
	const mb = arenaMinSuperblockSize
	arena, f, cuda, ctx := arenaSyncGPU(t, 2*n)
	a, b := suballocStreams(t)
	f.name(a.View().h, "A")
	f.name(b.View().h, "B")
	result := arenaSyncResult(t, cuda, n)
	for round := 0; round < 3; round++ {
		x := arenaAlloc(t, arena, n, a.View())
		require.Equal(t, arena.base, x)
		gpuBusyThenCopy(t, ctx, x, n, result, a.View())
		require.NoError(t, arena.Deallocate(x, n, a.View()))
		f.take()
		y := arenaAlloc(t, arena, mb, b.View())
		require.Equal(t, x, y, "B's arena took the first megabyte of A's memory")
		log := f.take()
		require.True(t, arenaSyncHas(log, `record e\d+ on A, wait B`), "%q", log)
		require.NoError(t, deviceFill(0, y, mb, le64(0x0909090909090909), b.View()))
		require.NoError(t, a.Synchronize())
		require.NoError(t, b.Synchronize())
		checkAll(t, ctx, result, n, 0x07)
		checkAll(t, ctx, y, mb, 0x09)
		require.NoError(t, arena.Deallocate(y, mb, b.View()))
		require.NoError(t, arena.CheckInvariants())
		// B keeps its superblock; give it back so the next round starts from the base again.
		require.NoError(t, arena.Release())
	}
	require.Empty(t, f.errors())
}

// A foreign stream frees (its event is recorded then) and is destroyed with its work still
// running; B and DefaultStream then take the memory, waiting on the event only.
func TestGPUArenaSyncForeignStreamDestroyed(t *testing.T) {
	requireGPU(t)
	const n = 256 << 20
	arena, f, cuda, ctx := arenaSyncGPU(t, 2*n)
	_, b := suballocStreams(t)
	f.name(b.View().h, "B")
	result := arenaSyncResult(t, cuda, n)
	for round := 0; round < 2; round++ {
		raw, err := cuStreamCreate(ctx, cuStreamNonBlocking)
		require.NoError(t, err)
		fv, err := NewStreamView(0, raw)
		require.NoError(t, err)
		require.False(t, fv.lifetimeKnown())
		f.name(raw, "F")
		x := arenaAlloc(t, arena, n, fv)
		gpuBusyThenCopy(t, ctx, x, n, result, fv)
		f.take()
		require.NoError(t, arena.Deallocate(x, n, fv))
		log := f.take()
		require.True(t, arenaSyncHas(log, `record e\d+ on F`), "%q", log)
		require.NoError(t, cuStreamDestroy(ctx, raw))
		f.kill(raw)
		y := arenaAlloc(t, arena, n, b.View())
		require.Equal(t, x, y)
		require.NoError(t, deviceFill(0, y, n, le64(0x0909090909090909), b.View()))
		z := arenaAlloc(t, arena, 4096, DefaultStream) // from the tail, which remembers F too
		require.NoError(t, deviceFill(0, z, 4096, []byte{1}, DefaultStream))
		log = f.take()
		require.True(t, arenaSyncHas(log, `wait B on e\d+`), "%q", log)
		require.True(t, arenaSyncHas(log, `wait default on e\d+`), "%q", log)
		require.NoError(t, Device(0).Synchronize())
		checkAll(t, ctx, result, n, 0x07)
		checkAll(t, ctx, y, n, 0x09)
		require.NoError(t, arena.Deallocate(y, n, b.View()))
		require.NoError(t, arena.Deallocate(z, 4096, DefaultStream))
		require.NoError(t, arena.Release()) // drops F's record and event
		require.True(t, arenaSyncHas(f.take(), `destroy e\d+`))
		require.NoError(t, arena.CheckInvariants())
	}
	require.Empty(t, f.errors(), "no call named the destroyed stream")
}

// A Stream closes after freeing into the global arena (Close synchronises it); B then takes the
// memory without touching the dead stream.
func TestGPUArenaSyncStreamClosed(t *testing.T) {
	requireGPU(t)
	const n = 256 << 20
	arena, f, cuda, ctx := arenaSyncGPU(t, 2*n)
	_, b := suballocStreams(t)
	f.name(b.View().h, "B")
	result := arenaSyncResult(t, cuda, n)
	for round := 0; round < 3; round++ {
		a, err := NewStream(0, &StreamOptions{NonBlocking: true})
		require.NoError(t, err)
		av := a.View()
		f.name(av.h, "A")
		x := arenaAlloc(t, arena, n, av)
		require.Equal(t, arena.base, x)
		gpuBusyThenCopy(t, ctx, x, n, result, av)
		require.NoError(t, arena.Deallocate(x, n, av))
		f.take()
		require.NoError(t, a.Close())
		require.True(t, arenaSyncHas(f.take(), `sync A`), "Close synchronised A")
		f.kill(av.h)
		y := arenaAlloc(t, arena, n, b.View())
		require.Equal(t, x, y)
		require.NoError(t, deviceFill(0, y, n, le64(0x0909090909090909), b.View()))
		require.NoError(t, b.Synchronize())
		checkAll(t, ctx, result, n, 0x07)
		checkAll(t, ctx, y, n, 0x09)
		require.NoError(t, arena.Deallocate(y, n, b.View()))
		require.Empty(t, f.errors(), "no call named the closed stream")
	}
	require.NoError(t, arena.CheckInvariants())
}

// On one stream, allocating and freeing blocks of any size (64 MiB as in benchmark W1, up to
// 1 GiB) makes no CUDA call: the arena neither synchronises nor records an event.
func TestGPUArenaSyncOneStreamNoCalls(t *testing.T) {
	requireGPU(t)
	own, _ := suballocStreams(t)
	for _, s := range []StreamView{DefaultStream, own.View()} {
		arena, f, _, _ := arenaSyncGPU(t, 4<<30)
		for i := 0; i < 1000; i++ {
			p := arenaAlloc(t, arena, 64<<20, s)
			require.NoError(t, arena.Deallocate(p, 64<<20, s))
		}
		for i := 0; i < 10; i++ {
			for _, n := range []int{256, 100000, 1 << 20, 3<<20 + 256, 1 << 30} {
				p := arenaAlloc(t, arena, n, s)
				require.NoError(t, deviceFill(0, p, n, []byte{byte(i)}, s))
				require.NoError(t, arena.Deallocate(p, n, s))
			}
		}
		require.Empty(t, f.take(), "%v", s)
		require.NoError(t, s.Synchronize())
		require.NoError(t, arena.CheckInvariants())
	}
}
