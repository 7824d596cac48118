package rmm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// In a stitching pool the free block at the end of the chain, in another stream's list and too
// small for a request, moves into the allocating stream's list, where it coalesces with a free
// neighbour; when the two together hold the request, the request takes them, rather than grow
// the pool (here at its maximum: growing by nothing failed with a driver error).
func TestAttackStitchEndCoalescedServes(t *testing.T) {
	p := newExpTestPool(t, newSimVMM(64*kiB, 1*miB), PoolOptions{Stitch: true})
	defer func() { require.NoError(t, p.Close()) }()
	a, b := attackStream(t), attackStream(t)
	var err error
	var ptrs [4]DevicePtr
	for i := range ptrs {
		ptrs[i], err = p.Allocate(256*kiB, a.View())
		require.NoError(t, err)
	}
	require.Equal(t, 1*miB, p.PoolSize())
	require.Equal(t, ptrs[2]+256*kiB, ptrs[3], "the last block is the end of the chain")
	require.NoError(t, p.Deallocate(ptrs[2], 256*kiB, a.View()))
	require.NoError(t, p.Deallocate(ptrs[3], 256*kiB, b.View()))
	require.NoError(t, p.CheckInvariants())
	ptr, err := p.Allocate(300*kiB, a.View())
	require.NoError(t, err)
	require.Equal(t, ptrs[2], ptr)
	require.Equal(t, 1*miB, p.PoolSize())
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(ptr, 300*kiB, a.View()))
	for _, q := range ptrs[:2] {
		require.NoError(t, p.Deallocate(q, 256*kiB, a.View()))
	}
	require.NoError(t, p.CheckInvariants())
}

// Without a maximum, the same request grew the pool by a chunk it did not need.
func TestAttackStitchEndCoalescedNoGrowth(t *testing.T) {
	p := newExpTestPool(t, newSimVMM(64*kiB, 0), PoolOptions{Stitch: true, MaximumPoolSize: 64 * miB})
	defer func() { require.NoError(t, p.Close()) }()
	a, b := attackStream(t), attackStream(t)
	var err error
	first, err := p.Allocate(256*kiB, a.View())
	require.NoError(t, err)
	size := p.PoolSize()
	// Fill the pool up to its end with 256 KiB blocks.
	var ptrs []DevicePtr
	for used := 256 * kiB; used < size; used += 256 * kiB {
		q, err := p.Allocate(256*kiB, a.View())
		require.NoError(t, err)
		ptrs = append(ptrs, q)
	}
	require.Equal(t, size, p.PoolSize())
	n := len(ptrs)
	require.NoError(t, p.Deallocate(ptrs[n-2], 256*kiB, a.View()))
	require.NoError(t, p.Deallocate(ptrs[n-1], 256*kiB, b.View()))
	ptr, err := p.Allocate(300*kiB, a.View())
	require.NoError(t, err)
	require.Equal(t, ptrs[n-2], ptr)
	require.Equal(t, size, p.PoolSize(), "no growth: the free memory at the end holds the request")
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(ptr, 300*kiB, a.View()))
	for _, q := range append(ptrs[:n-2], first) {
		require.NoError(t, p.Deallocate(q, 256*kiB, a.View()))
	}
	require.NoError(t, p.CheckInvariants())
}

// With a granularity below half of poolCrossCoalesceMin, two chunks back to back may lie in free
// blocks of two streams' lists that did not coalesce; a stitch over both lent them as one run
// out of the first block alone, leaving the second free in its list while mapped in the live
// stitched range (handed out twice).
func TestAttackStitchRunOverTwoLists(t *testing.T) {
	p := newExpTestPool(t, newSimVMM(64*kiB, 48*miB), PoolOptions{Stitch: true})
	defer func() { require.NoError(t, p.Close()) }()
	var ss []StreamView
	for range 4 {
		s, err := NewStream(0, nil)
		require.NoError(t, err)
		defer s.Close()
		ss = append(ss, s.View())
	}
	alloc := func(n int, s StreamView) DevicePtr {
		t.Helper()
		ptr, err := p.Allocate(n, s)
		require.NoError(t, err)
		require.NoError(t, p.CheckInvariants())
		return ptr
	}
	free := func(ptr DevicePtr, n int, s StreamView) {
		t.Helper()
		require.NoError(t, p.Deallocate(ptr, n, s))
		require.NoError(t, p.CheckInvariants())
	}
	a := alloc(1437321, ss[1])
	alloc(65536, ss[1])
	free(a, 1437321, ss[2])
	require.NoError(t, p.Release())
	a = alloc(307200, ss[1])
	free(a, 307200, ss[2])
	b := alloc(65536, ss[2])
	c := alloc(3764995, ss[1]) // stitched
	free(c, 3764995, ss[0])
	free(b, 65536, ss[2]) // cached: its chunk lies beside a free block of ss[1]'s list
	d := alloc(5730908, ss[3])
	p.mu.Lock()
	al := p.stitching().aliases[d]
	var chunks []vmChunk
	if al != nil {
		chunks = append(chunks, al.chunks...)
	}
	p.mu.Unlock()
	require.NotNil(t, al)
	// The free memory left is not the stitched block's.
	for range 8 {
		q := alloc(64*kiB, ss[1])
		for _, c := range chunks {
			require.False(t, q >= c.addr && q < c.end(), "%#x is mapped in the live stitched block", uintptr(q))
		}
	}
}

// attackStream returns a new Stream, closed at the test's end.
func attackStream(t *testing.T) *Stream {
	t.Helper()
	s, err := NewStream(0, nil)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}
