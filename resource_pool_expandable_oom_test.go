package rmm

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// A device that refuses a chunk makes a capped expandable pool give back its wholly free chunks
// and try again; on a stream other than the default one the retry must still extend the free
// block at the end of the chain (which the release left in the default stream's list).
func TestExpandableReleaseRetryOnOtherStream(t *testing.T) {
	for _, onDefault := range []bool{true, false} {
		vm := newSimVMM(4*kiB, 64*miB)
		p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30})
		s1, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
		require.NoError(t, err)
		s := s1.View()
		if onDefault {
			s = DefaultStream
		}
		// chunk 0 [0, 32M) and chunk 1 [32M, 64M): the device's whole limit.
		a, err := p.Allocate(32*miB, DefaultStream)
		require.NoError(t, err)
		b, err := p.Allocate(16*miB, DefaultStream)
		require.NoError(t, err)
		require.Equal(t, 64*miB, p.PoolSize())
		require.NoError(t, p.Deallocate(a, 32*miB, DefaultStream)) // chunk 0 wholly free
		// 40 MiB: 16 MiB free at the end plus 24 MiB more, which the device has only once chunk 0
		// is given back.
		c, err := p.Allocate(40*miB, s)
		require.NoError(t, err, "on the default stream: %v", onDefault)
		require.Equal(t, b+16*miB, c)
		require.NoError(t, p.CheckInvariants())
		require.NoError(t, p.Deallocate(c, 40*miB, s))
		require.NoError(t, p.Deallocate(b, 16*miB, DefaultStream))
		require.NoError(t, s1.Close())
		require.NoError(t, p.CheckInvariants())
		expClosedClean(t, p, vm)
	}
}

// A request too large for any state of the pool is an out-of-memory error naming it TooLarge,
// whatever its size (no overflow when rounding to the granularity), and changes nothing.
func TestExpandableHugeRequests(t *testing.T) {
	vm := newSimVMM(2*miB, 0)
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 64 * miB})
	for _, n := range []int{64*miB + 1, 1 << 40, math.MaxInt - 2*miB, math.MaxInt - 255 - 256, math.MaxInt - 300, math.MaxInt} {
		_, err := p.Allocate(n, DefaultStream)
		require.ErrorIs(t, err, ErrOutOfMemory, "request %d", n)
		var oom *OutOfMemoryError
		if n < math.MaxInt-255 {
			require.ErrorAs(t, err, &oom, "request %d", n)
			require.True(t, oom.TooLarge, "request %d", n)
			require.False(t, oom.Fragmented)
		}
		require.NoError(t, p.CheckInvariants())
		require.Zero(t, p.PoolSize())
	}
	expClosedClean(t, p, vm)
}

// Holes left by Release, with free memory between them: once everything is freed, a capped pool
// still reaches its cap (the free chunks between the holes are given back so that the holes
// merge, and growth maps the whole range again).
func TestExpandableCapAcrossHoles(t *testing.T) {
	runExpCases(t, expFakeVMMs(), func(t *testing.T, vm vmm, g int) {
		const c = 32 * miB // one chunk per allocation
		p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 5 * c})
		var ptrs []DevicePtr
		for range 5 {
			ptr, err := p.Allocate(c, DefaultStream)
			require.NoError(t, err)
			ptrs = append(ptrs, ptr)
		}
		require.NoError(t, p.Deallocate(ptrs[1], c, DefaultStream))
		require.NoError(t, p.Deallocate(ptrs[3], c, DefaultStream))
		require.NoError(t, p.Release())
		require.Equal(t, 2, p.Stats().Holes)
		for _, i := range []int{0, 2, 4} {
			require.NoError(t, p.Deallocate(ptrs[i], c, DefaultStream))
		}
		require.NoError(t, p.CheckInvariants())
		// free | hole | free | hole | free: nothing is live, the whole cap must be servable.
		whole, err := p.Allocate(5*c, DefaultStream)
		require.NoError(t, err)
		require.Equal(t, ptrs[0], whole)
		require.Equal(t, 5*c, p.PoolSize())
		require.NoError(t, p.CheckInvariants())
		require.NoError(t, p.Deallocate(whole, 5*c, DefaultStream))
		expClosedClean(t, p, vm)
	})
}

// Over a SimulatedMemoryResource without MaximumPoolSize, the range is the simulated capacity,
// however little memory the machine replaying it has.
func TestExpandableSimulatedDefaultMaximum(t *testing.T) {
	const capacity = 1 << 50 // 1 PiB of addresses
	sim, err := NewSimulatedMemoryResource(capacity)
	require.NoError(t, err)
	p, err := NewPoolMemoryResource(sim, &PoolOptions{Expandable: true})
	require.NoError(t, err)
	require.Equal(t, capacity, p.MaximumPoolSize())
	a, err := p.Allocate(1<<45, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(a, 1<<45, DefaultStream))
	require.NoError(t, p.Close())
}
