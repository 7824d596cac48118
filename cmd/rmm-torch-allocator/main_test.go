//go:build cgo

package main

import (
	"testing"

	rmm "github.com/gormm/rmm"
	"github.com/stretchr/testify/require"
)

// rmm_torch_reinitialize's pool argument: 1, 2 and 3 name the three kinds, the default first;
// any other value is refused with a message that lists them.
func TestTorchPoolKind(t *testing.T) {
	for pool, want := range map[int]rmm.PoolKind{1: rmm.StitchingPool, 2: rmm.ExpandablePool, 3: rmm.PlainPool} {
		k, err := torchPoolKind(pool)
		require.NoError(t, err)
		require.Equal(t, want, k, "pool %d", pool)
	}
	for _, pool := range []int{-1, 4, 100} {
		_, err := torchPoolKind(pool)
		require.ErrorIs(t, err, rmm.ErrInvalidArgument)
		require.ErrorContains(t, err, "1 (the default, stitching)")
	}
}
