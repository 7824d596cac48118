package rmm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Blocks freed on two streams coalesce at once; the stream that takes the merged block waits for
// the other one first, even when the block is in its own list, and the model of stream order
// accepts every take. Once it has waited, the remainder in its list needs no wait.
func TestPoolCoalescesAcrossStreams(t *testing.T) {
	for _, expandable := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "expandable"}[expandable], func(t *testing.T) {
			var p *PoolMemoryResource
			if expandable {
				p = newExpTestPool(t, newGatedVMM(0), PoolOptions{MaximumPoolSize: 64 * mib})
			} else {
				p, _ = newSimPool(t, 1<<30, &PoolOptions{MaximumPoolSize: 8 * mib})
			}
			e := newPoolSyncEnv(t, p)
			sa, _, ia := e.stream(0xa, "A")
			sb, _, ib := e.stream(0xb, "B")
			x := e.mustAlloc(2*mib, sa, ia)
			y := e.mustAlloc(2*mib, sa, ia)
			z := e.mustAlloc(2*mib, sa, ia)
			e.mustFree(x, 2*mib, sa, ia)
			e.mustFree(y, 2*mib, sb, ib) // coalesces with x, in B's list, naming A's
			st := p.Stats()
			require.Equal(t, 4*mib, st.PerStream[len(st.PerStream)-1].FreeBytes, "x and y in B's list")
			require.Equal(t, 1, st.PerStream[len(st.PerStream)-1].FreeBlocks)
			require.NoError(t, p.CheckInvariants())
			la, lb := p.byStream[sa.id], p.byStream[sb.id]
			require.Equal(t, 1, la.depRefs)
			require.Zero(t, lb.depRefs)

			e.f.take()
			q := e.mustAlloc(3*mib, sb, ib) // B's own list; must wait for A
			calls := e.f.take()
			require.NotEmpty(t, calls)
			require.Equal(t, "record e1 on A, wait B", calls[len(calls)-1], "B waits on A's event")
			require.Equal(t, x, q)
			require.Zero(t, la.depRefs, "B waited for A: the 1 MiB remainder in B's list need not")
			r := e.mustAlloc(mib, sb, ib)
			require.Equal(t, y+mib, r)
			require.Empty(t, e.f.take(), "the remainder's take makes no call")
			e.mustFree(q, 3*mib, sb, ib)
			e.mustFree(r, mib, sb, ib)
			require.Zero(t, la.depRefs, "memory freed on B only: no wait")
			q = e.mustAlloc(4*mib, sb, ib)
			require.Empty(t, e.f.take())
			e.mustFree(q, 4*mib, sb, ib)
			e.mustFree(z, 2*mib, sa, ia)
			e.done()
		})
	}
}

// A stream closing while a block in another list names its list: the default stream waits for it
// and the block names the default stream's list instead; a take on B then waits for that.
func TestPoolCoalesceDepOnClosedStream(t *testing.T) {
	c := newCoalescedAcross(t)
	p, e, sa, stA, sb, ib := c.p, c.e, c.sa, c.stA, c.sb, c.ib
	require.NoError(t, p.CheckInvariants())
	e.f.take()
	require.NoError(t, stA.Close())
	require.Equal(t, []string{"create e3", "record e1 on A, wait default", "destroy e1"}, e.f.take())
	e.f.kill(sa.h)
	require.Nil(t, p.byStream[sa.id], "A's list is dropped")
	def := p.byStream[DefaultStream.id]
	require.NotNil(t, def)
	require.Equal(t, 1, def.depRefs, "the block names the default stream's list")
	require.NoError(t, p.CheckInvariants())
	q := e.mustAlloc(4*mib, sb, ib)
	require.Equal(t, []string{"record e3 on default, wait B"}, e.f.take(), "B waits on the default stream, which waited on A")
	require.Zero(t, def.depRefs)
	e.mustFree(q, 4*mib, sb, ib)
	e.done()
}

// A third stream takes part of a block that names another list: it waits for both streams, and
// the remainder, back in the list it came from, still names the other list (its owner has not
// waited for it).
func TestPoolCoalesceCrossTakeKeepsRemainderDeps(t *testing.T) {
	c := newCoalescedAcross(t)
	p, e, sa, sb, ib, x := c.p, c.e, c.sa, c.sb, c.ib, c.x
	sc, _, ic := e.stream(0xc, "C")
	la := p.byStream[sa.id]
	e.f.take()
	q := e.mustAlloc(mib, sc, ic)
	require.Equal(t, x, q)
	require.Equal(t, []string{"create e3", "record e2 on B, wait C", "record e1 on A, wait C"}, e.f.take(), "C waits for B's list and for A's")
	require.Equal(t, 1, la.depRefs, "the 3 MiB left in B's list still names A's")
	require.NoError(t, p.CheckInvariants())
	r := e.mustAlloc(3*mib, sb, ib)
	require.Equal(t, []string{"wait B on e1"}, e.f.take(), "B waits for A (whose event holds its frees already)")
	e.mustFree(q, mib, sc, ic)
	e.mustFree(r, 3*mib, sb, ib)
	e.done()
}

// coalescedAcross is a pool capped at 8 MiB on the fake device where x and y (2 MiB each,
// neighbours) were allocated on stream A, x freed on A and y on B: one 4 MiB block in B's list
// that names A's.
type coalescedAcross struct {
	p      *PoolMemoryResource
	e      *poolSyncEnv
	sa, sb StreamView
	stA    *Stream
	ib     int
	x      DevicePtr
}

func newCoalescedAcross(t *testing.T) coalescedAcross {
	p, _ := newSimPool(t, 1<<30, &PoolOptions{MaximumPoolSize: 8 * mib})
	e := newPoolSyncEnv(t, p)
	sa, stA, ia := e.stream(0xa, "A")
	sb, _, ib := e.stream(0xb, "B")
	x := e.mustAlloc(2*mib, sa, ia)
	y := e.mustAlloc(2*mib, sa, ia)
	e.mustFree(x, 2*mib, sa, ia)
	e.mustFree(y, 2*mib, sb, ib)
	return coalescedAcross{p: p, e: e, sa: sa, sb: sb, stA: stA, ib: ib, x: x}
}
