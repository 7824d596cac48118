package rmm

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestAllocator(t *testing.T) {
	mr := newTestResource()
	s := newHostStream(t)
	a, err := NewAllocator[uint16](mr)
	require.NoError(t, err)
	assert.Same(t, mr, a.MemoryResource())

	sp, err := a.Allocate(100, s)
	require.NoError(t, err)
	assert.Equal(t, 100, sp.Len())
	assert.Equal(t, 200, sp.SizeBytes())
	assert.Zero(t, sp.Data()%Alignment)
	assert.Equal(t, 200, mr.liveBytes())
	assert.Equal(t, AccessOf(mr), sp.Access())
	assert.Equal(t, DeviceOf(mr), sp.Device())
	// The span is usable memory.
	require.NoError(t, sp.Fill(0xABCD, s))
	got := make([]uint16, 100)
	require.NoError(t, sp.CopyToHost(got, s))
	for i, g := range got {
		require.Equal(t, uint16(0xABCD), g, "element %d", i)
	}
	b := a // copies allocate from the same resource
	require.NoError(t, b.Deallocate(sp, s))
	assert.Zero(t, mr.liveBytes())
	assert.Equal(t, s, mr.lastFreeS)

	z, err := a.Allocate(0, s)
	require.NoError(t, err)
	assert.True(t, z.IsEmpty())
	assert.Zero(t, z.Data())
	require.NoError(t, a.Deallocate(z, s))
	allocs, frees, _ := mr.counts()
	assert.Equal(t, []int{1, 1}, []int{allocs, frees}, "zero-size spans never reach the resource")

	_, err = a.Allocate(-1, s)
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.Contains(t, err.Error(), "Allocator[uint16].Allocate(-1)")
	_, err = a.Allocate(math.MaxInt/2+1, s)
	require.ErrorIs(t, err, ErrInvalidArgument)
	mr.setFailNext(1)
	_, err = a.Allocate(10, s)
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.Contains(t, err.Error(), "Allocator[uint16].Allocate(10)")

	// A span the resource did not hand out: its error comes back.
	bogus, err := a.Allocate(4, s)
	require.NoError(t, err)
	half, _ := bogus.Subspan(0, 2)
	err = a.Deallocate(half, s)
	require.ErrorIs(t, err, ErrInvalidFree)
	assert.Contains(t, err.Error(), "Allocator[uint16].Deallocate")
	require.NoError(t, a.Deallocate(bogus, s))

	var zero Allocator[int]
	_, err = zero.Allocate(1, s)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, zero.Deallocate(DeviceSpan[int]{}, s), ErrInvalidArgument)

	cur, err := NewAllocator[int](nil)
	require.NoError(t, err)
	assert.Equal(t, CurrentDeviceResource(), cur.MemoryResource())
}

func TestStreamAllocator(t *testing.T) {
	mr := newTestResource()
	s := newHostStream(t)
	sa, err := NewStreamAllocator[triple](mr, s)
	require.NoError(t, err)
	assert.Equal(t, s, sa.Stream())
	assert.Same(t, mr, sa.MemoryResource())
	assert.Same(t, mr, sa.Allocator().MemoryResource())
	sp, err := sa.Allocate(10)
	require.NoError(t, err)
	assert.Equal(t, 120, mr.liveBytes())
	require.NoError(t, sp.Fill(triple{1, 2, 3}, sa.Stream()))
	require.NoError(t, sa.Deallocate(sp))
	assert.Zero(t, mr.liveBytes())
	assert.Equal(t, s, mr.lastFreeS, "frees are ordered on the bound stream")
	_, err = sa.Allocate(-2)
	assert.ErrorIs(t, err, ErrInvalidArgument)
}
