package rmm

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// poolSnapshot is what a failed call must leave unchanged.
type poolSnapshot struct {
	st PoolStats
}

func snapPool(t *testing.T, p *PoolMemoryResource) poolSnapshot {
	t.Helper()
	require.NoError(t, p.CheckInvariants())
	return poolSnapshot{st: p.Stats()}
}

func (s poolSnapshot) requireSame(t *testing.T, p *PoolMemoryResource, what string) {
	t.Helper()
	require.NoError(t, p.CheckInvariants(), what)
	require.Equal(t, s.st, p.Stats(), what)
}

func TestAttackPoolZeroValue(t *testing.T) {
	var p PoolMemoryResource
	for _, n := range []int{-1, 0, 1, 256, math.MaxInt, math.MaxInt - 255} {
		ptr, err := p.Allocate(n, DefaultStream)
		require.Zero(t, ptr, "Allocate(%d)", n)
		if n == 0 {
			require.NoError(t, err)
			continue
		}
		require.Error(t, err, "Allocate(%d)", n)
		if n > 0 && n < math.MaxInt-255 {
			require.ErrorIs(t, err, ErrInvalidArgument, "Allocate(%d)", n)
		}
	}
	require.ErrorIs(t, p.Deallocate(0x1000, 256, DefaultStream), ErrInvalidArgument)
	require.NoError(t, p.Deallocate(0, 256, DefaultStream))
	require.ErrorIs(t, p.Release(), ErrInvalidArgument)
	require.ErrorIs(t, p.CheckInvariants(), ErrInvalidArgument)
	_, err := p.ExportIPC(0x1000, 256)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Equal(t, PoolStats{}, p.Stats())
	require.Zero(t, p.PoolSize())
	require.Zero(t, p.MaximumPoolSize())
	require.False(t, p.Expandable())
	require.Nil(t, p.Upstream())
	_ = p.Device()
	_ = p.Access()
	require.ErrorIs(t, p.Close(), ErrInvalidArgument)
	// Still unusable (and not panicking) after the failed Close.
	_, err = p.Allocate(256, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
}

func TestAttackPoolZeroValueOverflowSize(t *testing.T) {
	var p PoolMemoryResource
	_, err := p.Allocate(math.MaxInt, DefaultStream)
	require.Error(t, err)
}

func TestAttackPoolZeroValueOwnStream(t *testing.T) {
	var p PoolMemoryResource
	s, err := NewStream(0, nil)
	require.NoError(t, err)
	defer s.Close()
	_, err = p.Allocate(256, s.View())
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, p.Deallocate(0x1000, 256, s.View()), ErrInvalidArgument)
}

func TestAttackPoolBadOptions(t *testing.T) {
	cases := []PoolOptions{
		{InitialPoolSize: -256},
		{MaximumPoolSize: -256},
		{InitialPoolSize: 100},
		{MaximumPoolSize: 1000},
		{InitialPoolSize: 512, MaximumPoolSize: 256},
		{InitialPoolSize: math.MinInt},
		{MaximumPoolSize: math.MinInt},
		{ReleaseThreshold: -1, Expandable: true},
		{ReleaseThreshold: 256},
		{Stitch: true},
		{Exportable: true},
		{Expandable: true, MaximumPoolSize: math.MaxInt - 255},
		{Expandable: true, MaximumPoolSize: math.MaxInt &^ 255},
	}
	for _, o := range cases {
		p, err := NewPoolMemoryResource(NewSystemMemoryResource(), &o)
		require.ErrorIs(t, err, ErrInvalidArgument, "%+v", o)
		require.Nil(t, p)
	}
	// An expandable pool over a resource that names no memory it can map.
	lim, err := NewLimitingResourceAdaptor(NewSystemMemoryResource(), 1<<20, nil)
	if err == nil {
		_, err = NewPoolMemoryResource(lim, &PoolOptions{Expandable: true})
		require.ErrorIs(t, err, ErrInvalidArgument)
	}
}

func TestAttackPoolInitialTooLarge(t *testing.T) {
	sim, err := NewSimulatedMemoryResource(1 << 20)
	require.NoError(t, err)
	_, err = NewPoolMemoryResource(sim, &PoolOptions{InitialPoolSize: 2 << 20})
	require.ErrorIs(t, err, ErrOutOfMemory)
	// Nothing leaked from the upstream.
	p, err := NewPoolMemoryResource(sim, &PoolOptions{InitialPoolSize: 1 << 20})
	require.NoError(t, err)
	require.Equal(t, 1<<20, p.PoolSize())
	require.NoError(t, p.Close())
}

func TestAttackPoolBadSizes(t *testing.T) {
	sim, err := NewSimulatedMemoryResource(64 << 20)
	require.NoError(t, err)
	p, err := NewPoolMemoryResource(sim, &PoolOptions{InitialPoolSize: 1 << 20, MaximumPoolSize: 8 << 20})
	require.NoError(t, err)
	defer p.Close()
	keep, err := p.Allocate(1000, DefaultStream)
	require.NoError(t, err)
	snap := snapPool(t, p)
	for _, n := range []int{-1, -256, math.MinInt} {
		ptr, err := p.Allocate(n, DefaultStream)
		require.Zero(t, ptr)
		require.ErrorIs(t, err, ErrInvalidArgument, "Allocate(%d)", n)
		snap.requireSame(t, p, "negative")
	}
	ptr, err := p.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, ptr)
	for _, n := range []int{math.MaxInt, math.MaxInt - 255, math.MaxInt &^ 255, 8<<20 + 1, 1 << 40} {
		ptr, err := p.Allocate(n, DefaultStream)
		require.Zero(t, ptr)
		require.ErrorIs(t, err, ErrOutOfMemory, "Allocate(%d)", n)
		var oom *OutOfMemoryError
		require.True(t, errors.As(err, &oom))
		require.Equal(t, n, oom.Requested)
		require.NoError(t, p.CheckInvariants())
	}
	// The failures may give free memory back, but live memory stays.
	st := p.Stats()
	require.Equal(t, 1, st.LiveAllocations)
	require.Equal(t, 1024, st.LiveBytes)
	require.NoError(t, p.Deallocate(keep, 1000, DefaultStream))
	require.NoError(t, p.CheckInvariants())
}

func TestAttackPoolBadSizesExpandable(t *testing.T) {
	p := newExpTestPool(t, newSimVMM(64*kiB, 4*miB), PoolOptions{})
	defer p.Close()
	keep, err := p.Allocate(1000, DefaultStream)
	require.NoError(t, err)
	for _, n := range []int{math.MaxInt, math.MaxInt - 255, math.MaxInt &^ 255, 4*miB + 1, 1 << 40} {
		ptr, err := p.Allocate(n, DefaultStream)
		require.Zero(t, ptr)
		require.ErrorIs(t, err, ErrOutOfMemory, "Allocate(%d)", n)
		require.NoError(t, p.CheckInvariants())
	}
	_, err = p.Allocate(-5, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.NoError(t, p.Deallocate(keep, 1000, DefaultStream))
	require.NoError(t, p.CheckInvariants())
}

// badFrees runs every kind of invalid free against p (holding the live allocations ptrs of the
// sizes sizes, on s), checking that each fails with ErrInvalidFree and changes nothing.
func badFrees(t *testing.T, p *PoolMemoryResource, ptrs []DevicePtr, sizes []int, s StreamView) {
	t.Helper()
	snap := snapPool(t, p)
	try := func(ptr DevicePtr, n int, st StreamView, what string) {
		t.Helper()
		err := p.Deallocate(ptr, n, st)
		require.ErrorIs(t, err, ErrInvalidFree, "%s: Deallocate(%#x, %d)", what, uintptr(ptr), n)
		snap.requireSame(t, p, what)
	}
	for i, ptr := range ptrs {
		n := sizes[i]
		try(ptr, n+256, s, "larger size")
		try(ptr, n+1<<20, s, "much larger size")
		if n > 1 {
			try(ptr, n-1, s, "smaller size")
		}
		try(ptr, 0, s, "zero size")
		try(ptr, -1, s, "negative size")
		try(ptr, math.MaxInt, s, "huge size")
		try(ptr+256, n, s, "inside the block")
		try(ptr+1, n, s, "unaligned")
		try(ptr-256, n, s, "before the block")
		try(ptr, n+256, DefaultStream, "larger size, default stream")
	}
	try(0xdead00, 256, s, "never allocated")
	try(DevicePtr(math.MaxUint64&^255), 256, s, "top of the address space")
}

func TestAttackPoolBadFrees(t *testing.T) {
	sim, err := NewSimulatedMemoryResource(256 << 20)
	require.NoError(t, err)
	for _, kind := range []string{"plain", "expandable", "stitch"} {
		t.Run(kind, func(t *testing.T) {
			p := attackPoolOf(t, kind, sim)
			defer func() { require.NoError(t, p.Close()) }()
			s, err := NewStream(0, nil)
			require.NoError(t, err)
			defer s.Close()
			sizes := []int{1, 300, 4096, 64 << 10, 1 << 20, 3 << 20}
			var ptrs []DevicePtr
			for _, n := range sizes {
				// Twice, freed and allocated again, so that the cache holds and hands out the block.
				ptr, err := p.Allocate(n, s.View())
				require.NoError(t, err)
				require.NoError(t, p.Deallocate(ptr, n, s.View()))
				ptr, err = p.Allocate(n, s.View())
				require.NoError(t, err)
				ptrs = append(ptrs, ptr)
			}
			badFrees(t, p, ptrs, sizes, s.View())
			// Real frees, then each one again.
			for i, ptr := range ptrs {
				require.NoError(t, p.Deallocate(ptr, sizes[i], s.View()))
			}
			snap := snapPool(t, p)
			for i, ptr := range ptrs {
				require.ErrorIs(t, p.Deallocate(ptr, sizes[i], s.View()), ErrInvalidFree)
				require.ErrorIs(t, p.Deallocate(ptr, sizes[i], DefaultStream), ErrInvalidFree)
				snap.requireSame(t, p, "double free")
			}
			require.NoError(t, p.Release())
			require.NoError(t, p.CheckInvariants())
		})
	}
}

// A block handed out by one stream's cache, freed with a wrong size on another stream, and
// twice across streams.
func TestAttackPoolCachedBlockCrossStreamFrees(t *testing.T) {
	sim, err := NewSimulatedMemoryResource(256 << 20)
	require.NoError(t, err)
	p, err := NewPoolMemoryResource(sim, &PoolOptions{InitialPoolSize: 4 << 20})
	require.NoError(t, err)
	defer p.Close()
	a, err := NewStream(0, nil)
	require.NoError(t, err)
	defer a.Close()
	b, err := NewStream(0, nil)
	require.NoError(t, err)
	defer b.Close()
	ptr, err := p.Allocate(4096, a.View())
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(ptr, 4096, a.View()))
	ptr2, err := p.Allocate(4096, a.View()) // from a's cache
	require.NoError(t, err)
	require.Equal(t, ptr, ptr2)
	snap := snapPool(t, p)
	require.ErrorIs(t, p.Deallocate(ptr, 4000, b.View()), ErrInvalidFree)
	snap.requireSame(t, p, "wrong size on another stream")
	require.ErrorIs(t, p.Deallocate(ptr, 2<<20, b.View()), ErrInvalidFree)
	snap.requireSame(t, p, "large wrong size on another stream")
	require.NoError(t, p.Deallocate(ptr, 4096, b.View()))
	require.NoError(t, p.CheckInvariants())
	snap = snapPool(t, p)
	require.ErrorIs(t, p.Deallocate(ptr, 4096, a.View()), ErrInvalidFree)
	require.ErrorIs(t, p.Deallocate(ptr, 4096, b.View()), ErrInvalidFree)
	snap.requireSame(t, p, "double free across streams")
}

func TestAttackPoolAfterClose(t *testing.T) {
	sim, err := NewSimulatedMemoryResource(256 << 20)
	require.NoError(t, err)
	for _, kind := range []string{"plain", "expandable", "stitch"} {
		t.Run(kind, func(t *testing.T) {
			p := attackPoolOf(t, kind, sim)
			s, err := NewStream(0, nil)
			require.NoError(t, err)
			sizes := []int{256, 4096, 1 << 20, 5 << 20}
			var ptrs []DevicePtr
			for _, n := range sizes {
				ptr, err := p.Allocate(n, s.View())
				require.NoError(t, err)
				require.NoError(t, p.Deallocate(ptr, n, s.View()))
				ptr, err = p.Allocate(n, s.View())
				require.NoError(t, err)
				ptrs = append(ptrs, ptr)
			}
			require.NoError(t, p.Close())
			require.NoError(t, p.Close())
			require.NoError(t, p.Release())
			for _, st := range []StreamView{DefaultStream, s.View()} {
				_, err = p.Allocate(256, st)
				require.ErrorIs(t, err, ErrClosed)
			}
			_, err = p.Allocate(-1, DefaultStream)
			require.ErrorIs(t, err, ErrInvalidArgument)
			badFrees(t, p, ptrs, sizes, s.View())
			require.NoError(t, s.Close())
			// Free one on the closed stream, the others on the default stream.
			require.NoError(t, p.Deallocate(ptrs[0], sizes[0], s.View()))
			require.NoError(t, p.CheckInvariants())
			require.ErrorIs(t, p.Deallocate(ptrs[0], sizes[0], s.View()), ErrInvalidFree)
			for i := 1; i < len(ptrs); i++ {
				require.NoError(t, p.Deallocate(ptrs[i], sizes[i], DefaultStream))
				require.NoError(t, p.CheckInvariants())
			}
			st := p.Stats()
			require.Zero(t, st.LiveAllocations)
			require.Zero(t, st.PoolSize, "every block goes back once free after Close")
			require.Zero(t, p.PoolSize())
		})
	}
}

// attackPoolOf makes the pool of kind ("plain" over sim with 4 MiB taken at once, "expandable"
// or "stitch" over a 64 MiB address-only VMM of 64 KiB granules).
func attackPoolOf(t *testing.T, kind string, sim *SimulatedMemoryResource) *PoolMemoryResource {
	t.Helper()
	switch kind {
	case "plain":
		p, err := NewPoolMemoryResource(sim, &PoolOptions{InitialPoolSize: 4 << 20})
		require.NoError(t, err)
		return p
	case "expandable":
		return newExpTestPool(t, newSimVMM(64*kiB, 64*miB), PoolOptions{})
	}
	return newExpTestPool(t, newSimVMM(64*kiB, 64*miB), PoolOptions{Stitch: true})
}
