package rmm

import (
	"errors"
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

// A Stream closes while the default stream has no free list and one cannot be made (its
// cuEventCreate fails): the closing stream's blocks stay in its list, and whoever takes them
// later must still be ordered after their frees.
func TestPoolUnlockStreamCloseWithoutDefaultList(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, nil)
	e := newPoolSyncEnv(t, p)
	sa, stA, ia := e.stream(0xa, "A")
	sb, _, ib := e.stream(0xb, "B")
	x := e.mustAlloc(4*mib, sa, ia)
	e.mustFree(x, 4*mib, sa, ia) // A's list: dirty, its event never recorded
	require.Nil(t, p.byStream[DefaultStream.id], "the default stream has no list yet")

	create := p.drv.eventCreate
	p.drv.eventCreate = func(ctx uintptr, flags uint) (uintptr, error) {
		return 0, errors.New("fake cuEventCreate failure")
	}
	require.NoError(t, stA.Close())
	e.f.kill(sa.h)
	p.drv.eventCreate = create

	y, err := e.alloc(4*mib, sb, ib)
	require.NoError(t, err, "B got A's block unordered after A's frees")
	e.mustFree(y, 4*mib, sb, ib)
	e.done()
}

// The trim after a free (ReleaseThreshold) fails to wait for the streams: the free itself has
// been done, so Deallocate reports no error (a caller that retried an erring free would get
// ErrInvalidFree), and the memory stays mapped until a later trim or Release.
func TestPoolUnlockTrimFailureIsNotAFailedFree(t *testing.T) {
	vm := newGatedVMM(0)
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30, ReleaseThreshold: 1})
	e := newPoolSyncEnv(t, p)
	vm.check = e.checkReturned
	sa, _, ia := e.stream(0xa, "A")
	x := e.mustAlloc(40*mib, sa, ia)
	mapped := p.PoolSize()

	sync := p.drv.eventSynchronize
	p.drv.eventSynchronize = func(ctx, ev uintptr) error { return errors.New("fake cuEventSynchronize failure") }
	require.NoError(t, e.free(x, 40*mib, sa, ia), "the block was freed")
	p.drv.eventSynchronize = sync
	require.ErrorIs(t, p.Deallocate(x, 40*mib, sa), ErrInvalidFree, "freed twice")
	st := p.Stats()
	require.Zero(t, st.LiveBytes)
	require.Equal(t, mapped, st.PoolSize, "the trim gave nothing back")

	require.NoError(t, p.Release())
	e.done()
	require.Empty(t, vm.errs)
	require.Zero(t, p.PoolSize())
}

// A Stream closes when its frees can be ordered neither on the device (the record of its event
// fails) nor by synchronising it: the pool waits for the device instead, so whoever takes its
// blocks later is ordered after their frees.
func TestPoolUnlockStreamCloseSyncFails(t *testing.T) {
	p, _ := newSimPool(t, 1<<30, nil)
	e := newPoolSyncEnv(t, p)
	sa, stA, ia := e.stream(0xa, "A")
	sb, _, ib := e.stream(0xb, "B")
	d := e.mustAlloc(4*mib, DefaultStream, e.def)
	e.mustFree(d, 4*mib, DefaultStream, e.def) // the default stream has a list
	x := e.mustAlloc(4*mib, sa, ia)
	e.mustFree(x, 4*mib, sa, ia) // A's list: dirty

	rw, ss := p.drv.recordAndWait, p.drv.streamSynchronize
	p.drv.recordAndWait = func(ctx, ev, from, to uintptr) error { return errors.New("fake record failure") }
	p.drv.streamSynchronize = func(ctx, s uintptr) error { return errors.New("fake synchronize failure") }
	require.NoError(t, stA.Close())
	e.f.kill(sa.h)
	p.drv.recordAndWait, p.drv.streamSynchronize = rw, ss

	var got []DevicePtr
	for range 2 {
		y, err := e.alloc(4*mib, sb, ib)
		require.NoError(t, err, "B got A's block unordered after A's free")
		got = append(got, y)
	}
	for _, y := range got {
		e.mustFree(y, 4*mib, sb, ib)
	}
	e.done()
}
