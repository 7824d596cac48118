package rmm

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// A small block sits in the own table of the arena that allocated it. A free on another stream
// synchronises that stream first (and only then frees); a free on the arena's stream makes no
// call; a wrong size, also one that names a large block, changes nothing.
func TestArenaOwnTableFreeOnAnotherStream(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, f := arenaSyncSim(t, 32*mb)
	sa, _ := arenaSyncStream(t, f, 0xa, "A")
	sb, _ := arenaSyncStream(t, f, 0xb, "B")
	p := arenaAlloc(t, a, 4096, sa)
	q := arenaAlloc(t, a, 4096, sa)
	d := arenaAlloc(t, a, 4096, DefaultStream)
	f.take()
	require.Equal(t, 3, a.Stats().LiveAllocations)

	require.ErrorIs(t, a.Deallocate(p, 2*mb, sb), ErrInvalidFree)
	require.ErrorIs(t, a.Deallocate(p, 4096+256, sb), ErrInvalidFree)
	require.Empty(t, f.take(), "a rejected free makes no driver call")

	require.NoError(t, a.Deallocate(p, 4096, sb))
	require.Equal(t, []string{"query B", "sync B"}, f.take(), "a free into A's arena on B waits for B")
	require.ErrorIs(t, a.Deallocate(p, 4096, sb), ErrInvalidFree, "double free")
	require.ErrorIs(t, a.Deallocate(p, 4096, sa), ErrInvalidFree, "double free")

	require.NoError(t, a.Deallocate(d, 4096, sa))
	require.Equal(t, []string{"query A", "sync A"}, f.take(), "a free into a default-stream arena on A waits for A")
	require.NoError(t, a.Deallocate(q, 4096, sa))
	require.Empty(t, f.take(), "a free on the arena's own stream makes no call")
	st := a.Stats()
	require.Zero(t, st.LiveAllocations)
	require.Zero(t, st.LiveBytes)
	arenaCheck(t, a)
}

// Release returns the superblocks holding live blocks to the global arena: their entries leave
// the arena's own table for the shards, and the blocks are freed from there, on any stream,
// exactly once.
func TestArenaOwnTableAfterRelease(t *testing.T) {
	a, _ := arenaSim(t, 64*arenaMinSuperblockSize, nil)
	s1, s2 := poolCacheTestStream(t), poolCacheTestStream(t)
	var ps []DevicePtr
	for i := range 40 {
		s := []StreamView{s1, s2, DefaultStream}[i%3]
		ps = append(ps, arenaAlloc(t, a, 64<<10, s))
	}
	require.NoError(t, a.Release())
	arenaCheck(t, a)
	st := a.Stats()
	require.Equal(t, 40, st.LiveAllocations)
	require.Equal(t, 40*64<<10, st.LiveBytes)
	for i, p := range ps {
		s := []StreamView{s2, DefaultStream, s1}[i%3]
		require.ErrorIs(t, a.Deallocate(p, 64<<10-256, s), ErrInvalidFree)
		require.NoError(t, a.Deallocate(p, 64<<10, s))
		require.ErrorIs(t, a.Deallocate(p, 64<<10, s), ErrInvalidFree)
		// New blocks go to the own tables again while old ones are in the shards.
		q := arenaAlloc(t, a, 64<<10, s)
		require.NoError(t, a.Deallocate(q, 64<<10, s))
	}
	require.Zero(t, a.Stats().LiveAllocations)
	arenaCheck(t, a)
}

// Goroutines on several streams free the same block at once while others allocate and free in
// the same superblocks and a defragmentation moves the tables' entries: exactly one free
// succeeds each time, the rest report ErrInvalidFree.
func TestArenaOwnTableDoubleFreeRace(t *testing.T) {
	a, _ := arenaSim(t, 64*arenaMinSuperblockSize, nil)
	streams := []StreamView{poolCacheTestStream(t), poolCacheTestStream(t), DefaultStream}
	for round := range 200 {
		p := arenaAlloc(t, a, 256, streams[round%3])
		var ok, bad atomic.Int32
		var wg sync.WaitGroup
		for g := range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s := streams[g%3]
				if g == 5 && round%10 == 0 {
					a.Release()
				}
				q, err := a.Allocate(512, s)
				if err == nil {
					defer a.Deallocate(q, 512, s)
				}
				switch err := a.Deallocate(p, 256, s); {
				case err == nil:
					ok.Add(1)
				case err != nil:
					require.ErrorIs(t, err, ErrInvalidFree)
					bad.Add(1)
				}
			}()
		}
		wg.Wait()
		require.Equal(t, int32(1), ok.Load())
		require.Equal(t, int32(5), bad.Load())
	}
	require.Zero(t, a.Stats().LiveAllocations)
	arenaCheck(t, a)
}
