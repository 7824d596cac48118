package rmm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// The records of our Streams are published for the fast paths once a Stream frees into the
// global arena, and withdrawn when it closes. A closed Stream cannot allocate, large blocks
// included, and a free on it synchronises the device, also when a fast path still reads an older
// copy of the published records (which names the Stream's record, marked done).
func TestArenaFastStreamRecords(t *testing.T) {
	const n = 4 << 20
	a, f := arenaSyncSim(t, 8*n)
	sa, sta := arenaSyncStream(t, f, 0xa, "A")
	sb, stb := arenaSyncStream(t, f, 0xb, "B")
	require.Nil(t, a.lazyRec(sa), "no record before a free into the global arena")
	require.Same(t, &a.defRec, a.lazyRec(DefaultStream))
	require.Nil(t, a.lazyRec(arenaSyncForeign(f, 0xf, 7, "F")), "foreign streams are never published")

	for _, s := range []StreamView{sb, sa} {
		p := arenaAlloc(t, a, n, s)
		require.NoError(t, a.Deallocate(p, n, s))
	}
	xa, xb := a.lazyRec(sa), a.lazyRec(sb)
	require.NotNil(t, xa)
	require.NotNil(t, xb)
	require.Equal(t, sa.ID(), xa.stream.ID())
	require.Equal(t, sb.ID(), xb.stream.ID())
	require.Len(t, *a.lazyRecs.Load(), 2)
	require.Equal(t, []string{"create e1", "record e1 on B, wait A"}, f.take(), "A takes what B freed")

	// The pair on A again, from the fast paths: the superblock still names B, whose event as
	// last recorded A waits on.
	p := arenaAlloc(t, a, n, sa)
	require.NoError(t, a.Deallocate(p, n, sa))
	require.Equal(t, []string{"wait A on e1"}, f.take())

	old := a.lazyRecs.Load()
	require.NoError(t, sta.Close())
	f.kill(0xa)
	require.Nil(t, a.lazyRec(sa), "withdrawn at Close")
	require.Same(t, xb, a.lazyRec(sb))
	require.Len(t, *a.lazyRecs.Load(), 1)
	f.take()

	cur := a.lazyRecs.Load()
	for _, stale := range []bool{false, true} {
		if stale {
			a.lazyRecs.Store(old) // a reader of the copy published before Close
			require.Same(t, xa, a.lazyRec(sa))
		}
		_, err := a.Allocate(n, sa)
		require.ErrorIs(t, err, ErrClosed, "stale %v", stale)
		_, err = a.Allocate(4096, sa)
		require.ErrorIs(t, err, ErrClosed, "stale %v", stale)
		p := arenaAlloc(t, a, n, sb)
		f.take()
		require.NoError(t, a.Deallocate(p, n, sa))
		require.Equal(t, []string{"ctx-sync"}, f.take(), "stale %v: a free on a closed Stream synchronises the device", stale)
		arenaCheck(t, a)
	}
	a.lazyRecs.Store(cur)
	require.NoError(t, stb.Close())
	require.Nil(t, a.lazyRecs.Load(), "no Stream left with a record")
	require.Empty(t, f.errors())
	require.NoError(t, a.Close())
}
