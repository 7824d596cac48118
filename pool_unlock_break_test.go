package rmm

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Expandable pool: a growth maps a chunk sized to extend the free tail, the tail is taken while
// the chunk is created, and the growth that the request then needs passes the maximum. The
// request fails, and the pool does not keep the chunk it mapped for it (wholly free): a failed
// Allocate leaves the pool no larger than it found it.
func TestPoolUnlockExpandableFailedGrowthKeepsNothing(t *testing.T) {
	vm := newGatedVMM(0)
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 64 * mib})
	e := newPoolSyncEnv(t, p)
	vm.check = e.checkReturned
	sa, _, ia := e.stream(0xa, "A")

	x := e.mustAlloc(12*mib, sa, ia) // maps 32 MiB: 20 MiB free at the end
	require.Equal(t, 32*mib, p.PoolSize())

	vm.create_.shut(t)
	var bigErr error
	growing := make(chan struct{})
	go func() {
		defer close(growing)
		_, bigErr = e.alloc(40*mib, sa, ia) // needs 20 MiB beyond the free tail: a 32 MiB chunk
	}()
	require.Equal(t, "create", vm.create_.waitEntered(t))
	var tail DevicePtr
	ok, _ := within(func() { tail = e.mustAlloc(20*mib, sa, ia) }, 5*time.Second)
	require.True(t, ok)
	vm.create_.open()
	<-growing
	require.ErrorIs(t, bigErr, ErrOutOfMemory, "40 MiB more cannot fit under the maximum")
	require.NoError(t, p.CheckInvariants())
	require.Equal(t, 32*mib, p.PoolSize(), "the failed request left the chunk it mapped in the pool")

	e.mustFree(tail, 20*mib, sa, ia)
	e.mustFree(x, 12*mib, sa, ia)
	require.NoError(t, p.Release())
	e.done()
	require.Empty(t, vm.errs)
	require.Equal(t, 0, p.PoolSize())
}
