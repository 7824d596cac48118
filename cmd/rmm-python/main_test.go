//go:build cgo

package main

import (
	"testing"

	rmm "github.com/gormm/rmm"
	"github.com/stretchr/testify/require"
)

// rmm_reinitialize's pool argument: 1, 2 and 3 name the three kinds, the default first;
// any other value is refused with a message that lists them.
func TestPoolKind(t *testing.T) {
	for pool, want := range map[int]rmm.PoolKind{1: rmm.StitchingPool, 2: rmm.ExpandablePool, 3: rmm.PlainPool} {
		k, err := poolKind(pool)
		require.NoError(t, err)
		require.Equal(t, want, k, "pool %d", pool)
	}
	for _, pool := range []int{-1, 4, 100} {
		_, err := poolKind(pool)
		require.ErrorIs(t, err, rmm.ErrInvalidArgument)
		require.ErrorContains(t, err, "1 (the default, stitching)")
	}
}

// rmm_pool_stats's row: the figures in the documented order, the kind as reinitialize numbers
// it, and as many values as RMM_POOL_STATS_LEN says.
func TestPoolStatsRow(t *testing.T) {
	st := rmm.PoolStats{PoolSize: 1, PeakPoolSize: 2, LiveBytes: 3, LiveAllocations: 4, MaximumPoolSize: 10, FreeBytes: 11,
		VMM: rmm.VMMStats{Creates: 5, Maps: 6, Unmaps: 7, Releases: 8, StitchedRanges: 9, SetAccess: 12, Reserves: 13,
			AddressFrees: 100, AddressReserved: 14, StitchedKept: 15, StitchedEvicted: 16}}
	require.Equal(t, []int64{1, 2, 3, 4, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, poolStatsRow(rmm.ExpandablePool, st))
	require.Len(t, poolStatsRow(rmm.PlainPool, rmm.PoolStats{}), int(rmm_pool_stats_len()))
	for k, n := range map[rmm.PoolKind]int{rmm.StitchingPool: 1, rmm.ExpandablePool: 2, rmm.PlainPool: 3} {
		require.Equal(t, n, poolNumber(k))
	}
}
