package rmm

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Regression tests for carving's unlocked windows: the spare handles released while a grown block
// was out of every list, a create refused while a spare handle held the memory, and frees made
// while carve waited for the streams.

// hookVMM wraps a vmm with optional hooks run before each call (pool unlocked then).
type hookVMM struct {
	vmm
	mu        sync.Mutex
	onCreate  func(n int) error
	onMap     func(a DevicePtr, n int) error
	onAccess  func(a DevicePtr, n int) error
	onUnmap   func(a DevicePtr, n int) error
	onRelease func(h vmmHandle) error
}

func (v *hookVMM) get() (func(int) error, func(DevicePtr, int) error, func(DevicePtr, int) error, func(DevicePtr, int) error, func(vmmHandle) error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.onCreate, v.onMap, v.onAccess, v.onUnmap, v.onRelease
}

func (v *hookVMM) create(n int) (vmmHandle, error) {
	if f, _, _, _, _ := v.get(); f != nil {
		if err := f(n); err != nil {
			return 0, err
		}
	}
	return v.vmm.create(n)
}
func (v *hookVMM) mapAt(a DevicePtr, n int, h vmmHandle) error {
	if _, f, _, _, _ := v.get(); f != nil {
		if err := f(a, n); err != nil {
			return err
		}
	}
	return v.vmm.mapAt(a, n, h)
}
func (v *hookVMM) setAccess(a DevicePtr, n int) error {
	if _, _, f, _, _ := v.get(); f != nil {
		if err := f(a, n); err != nil {
			return err
		}
	}
	return v.vmm.setAccess(a, n)
}
func (v *hookVMM) unmap(a DevicePtr, n int) error {
	if _, _, _, f, _ := v.get(); f != nil {
		if err := f(a, n); err != nil {
			return err
		}
	}
	return v.vmm.unmap(a, n)
}
func (v *hookVMM) release(h vmmHandle) error {
	if _, _, _, _, f := v.get(); f != nil {
		if err := f(h); err != nil {
			return err
		}
	}
	return v.vmm.release(h)
}

// A growth into a hole that leaves spare handles unmapped releases them with the pool unlocked
// (dropSpares) while the grown block is out of every list; a free of the block after it meanwhile
// is not coalesced with the remainder split off after growAny returns.
func TestPoolCarveSparesDroppedAfterSplit(t *testing.T) {
	vm := &hookVMM{vmm: newSimVMM(hostVMMGranularity, 0)}
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30, carvePage: 2 * mib})
	defer p.Close()
	var b [16]DevicePtr
	for i := range b {
		q, err := p.Allocate(2*mib, DefaultStream)
		require.NoError(t, err)
		b[i] = q
	}
	require.Equal(t, 32*mib, p.PoolSize())
	// A hole at B2.
	require.NoError(t, p.Deallocate(b[2], 2*mib, DefaultStream))
	require.NoError(t, p.Release())
	require.Equal(t, 1, p.Stats().Holes)
	// Free B1 (left of the hole) and fragments B5, B7, B9.
	for _, i := range []int{1, 5, 7, 9} {
		require.NoError(t, p.Deallocate(b[i], 2*mib, DefaultStream))
	}
	require.NoError(t, p.CheckInvariants())
	var once sync.Once
	vm.onRelease = func(vmmHandle) error {
		once.Do(func() {
			// Pool unlocked in dropSpares: free B3, right after the grown block.
			require.NoError(t, p.Deallocate(b[3], 2*mib, DefaultStream))
		})
		return nil
	}
	q, err := p.Allocate(4*mib-256, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, b[1], q)
	require.NoError(t, p.CheckInvariants())
}

// At the device's limit: carving moves a 4 MiB page to spare, the growth goes into a hole that
// needs only 2 MiB, and creating that fails while the spare still holds the memory. The pool must
// release the spare and create again, not fail (the request fits once the spare is gone).
func TestPoolCarveReleasesSparesBeforeFailing(t *testing.T) {
	sim := newSimVMM(hostVMMGranularity, 0)
	p := newExpTestPool(t, sim, PoolOptions{MaximumPoolSize: 64 * mib, carvePage: 2 * mib})
	defer p.Close()
	big, err := p.Allocate(64*mib, DefaultStream) // one growth: sixteen 4 MiB pages
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(big, 64*mib, DefaultStream))
	alloc := func(n int) DevicePtr {
		q, err := p.Allocate(n, DefaultStream)
		require.NoError(t, err)
		return q
	}
	a0 := alloc(5 * mib) // [0,5)
	l := alloc(3 * mib)  // [5,8)
	h := alloc(4 * mib)  // [8,12): page 2
	_ = alloc(8 * mib)   // [12,20)
	f := alloc(4 * mib)  // [20,24): page 5
	_ = alloc(40 * mib)  // [24,64)
	require.Equal(t, a0+DevicePtr(8*mib), h)
	require.NoError(t, p.Deallocate(h, 4*mib, DefaultStream))
	require.NoError(t, p.Release()) // page 2 becomes a hole
	require.Equal(t, 60*mib, p.PoolSize())
	require.NoError(t, p.Deallocate(l, 3*mib, DefaultStream))
	require.NoError(t, p.Deallocate(f, 4*mib, DefaultStream))
	require.NoError(t, p.CheckInvariants())
	// The device now has no more room than what the pool holds.
	sim.mu.Lock()
	sim.limit = 60 * mib
	sim.mu.Unlock()

	q, err := p.Allocate(5*mib, DefaultStream)
	require.NoError(t, err, "the spare handle larger than the hole is released and the memory created anew")
	require.NotZero(t, q)
	require.NoError(t, p.CheckInvariants())
	// Now nothing is free and the device is full: a second request fails and changes nothing.
	size := p.PoolSize()
	_, err = p.Allocate(5*mib, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Equal(t, size, p.PoolSize())
	require.NoError(t, p.CheckInvariants())
}

// carve waits for the streams with the pool unlocked; frees made meanwhile can make the free
// tail hold the whole request. growExpandable must then map nothing: at the maximum (room 0) it
// "grew" by 0 bytes (setAccess(addr, 0)), below it mapped memory the request did not need.
// carveTailGrowsDuringSync fills a pool of the given maximum with sixteen 2 MiB blocks, frees
// two fragments, and asks for 4 MiB while the last two blocks are freed during carve's wait; it
// returns the request's result and the last two blocks' addresses.
func carveTailGrowsDuringSync(t *testing.T, vm vmm, maximum int) (*PoolMemoryResource, DevicePtr, DevicePtr, error) {
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: maximum, carvePage: 2 * mib})
	t.Cleanup(func() { p.Close() })
	e := newPoolSyncEnv(t, p)
	var b [16]DevicePtr
	for i := range b {
		b[i] = e.mustAlloc(2*mib, DefaultStream, e.def)
	}
	require.Equal(t, 32*mib, p.PoolSize())
	e.mustFree(b[1], 2*mib, DefaultStream, e.def)
	e.mustFree(b[3], 2*mib, DefaultStream, e.def)
	require.NoError(t, p.CheckInvariants())
	var once sync.Once
	e.f.mu.Lock()
	e.f.onCall = func(op string) {
		if op == "event-sync" {
			// Pool unlocked in carve's syncAll: another goroutine frees the last two blocks.
			once.Do(func() {
				e.mustFree(b[14], 2*mib, DefaultStream, e.def)
				e.mustFree(b[15], 2*mib, DefaultStream, e.def)
			})
		}
	}
	e.f.mu.Unlock()
	q, err := p.Allocate(4*mib, DefaultStream)
	return p, q, b[14], err
}

func TestPoolCarveFreesDuringWait(t *testing.T) {
	hv, err := newHostVMM(hostVMMGranularity, 0)
	require.NoError(t, err)
	for name, c := range map[string]struct {
		vm      vmm
		maximum int
	}{
		"sim at the maximum":    {newSimVMM(hostVMMGranularity, 0), 32 * mib},
		"host at the maximum":   {hv, 32 * mib},
		"sim below the maximum": {newSimVMM(hostVMMGranularity, 0), 64 * mib},
	} {
		t.Run(name, func(t *testing.T) {
			p, q, tail, err := carveTailGrowsDuringSync(t, c.vm, c.maximum)
			require.NoError(t, err, "the free tail holds the request")
			require.Equal(t, tail, q)
			require.NoError(t, p.CheckInvariants())
			require.Equal(t, 32*mib, p.PoolSize(), "no growth needed")
		})
	}
}

// A request above the maximum, or one that moving every free page could not serve within it,
// carves nothing: no page is unmapped for a request that fails anyway.
func TestPoolCarveNotForHopelessRequests(t *testing.T) {
	for _, c := range []struct{ max, n, page int }{{1 << 30, 2 << 30, 2 * mib}, {32 * mib, 16 * mib, 2 * mib}, {32 * mib, 16 * mib, 0}} {
		t.Run(fmt.Sprint(c), func(t *testing.T) {
			p, vm, _ := fragmentedCarvePoolWith(t, PoolOptions{MaximumPoolSize: c.max, carvePage: c.page})
			before, unmaps := p.Stats(), vm.counts().unmaps
			_, err := p.Allocate(c.n, DefaultStream)
			require.ErrorIs(t, err, ErrOutOfMemory)
			require.NoError(t, p.CheckInvariants())
			require.Equal(t, unmaps, vm.counts().unmaps, "free pages unmapped for a hopeless request")
			require.Equal(t, before.PoolSize, p.Stats().PoolSize)
		})
	}
}

// While a growth's spare handles are released (the pool unlocked), the requesting stream's list
// stays pinned: another stream merging it and dropping it then would leave the grown block to be
// freed into a dropped list when the requester's dependency wait fails. Layout: 2 MiB pages with
// a hole at B2 and B1, B5, B7, B9 free on stream A; A asks for 4 MiB, carving moves B9 and B7,
// B3 is freed on X during the unmap, the growth fills B2 and B1+B2+B3 coalesce (naming X); the
// spare left over is released while T takes A's list, and A's wait on X fails.
func TestPoolCarveSparesGoWhileTheListIsPinned(t *testing.T) {
	vm := &hookVMM{vmm: newSimVMM(hostVMMGranularity, 0)}
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 64 * mib, carvePage: 2 * mib})
	e := newPoolSyncEnv(t, p)
	var fail atomic.Bool
	drv := *p.drv
	wait := drv.recordAndWait
	drv.recordAndWait = func(ctx, ev, from, to uintptr) error {
		if fail.CompareAndSwap(true, false) {
			return errors.New("injected wait failure")
		}
		return wait(ctx, ev, from, to)
	}
	p.drv = &drv
	sa, _, ia := e.stream(0xa, "A")
	sx, _, ix := e.stream(0xb, "X")
	st, _, it := e.stream(0xc, "T")
	var b [16]DevicePtr
	for i := range b {
		b[i] = e.mustAlloc(2*mib, DefaultStream, e.def)
	}
	e.mustFree(b[2], 2*mib, DefaultStream, e.def)
	require.NoError(t, p.Release()) // hole at B2
	for _, i := range []int{1, 5, 7, 9} {
		e.mustFree(b[i], 2*mib, sa, ia)
	}
	var once1, once2 sync.Once
	tDone := make(chan error, 1)
	vm.onUnmap = func(DevicePtr, int) error { // in carve
		once1.Do(func() { e.mustFree(b[3], 2*mib, sx, ix) })
		return nil
	}
	vm.onRelease = func(vmmHandle) error { // in done()'s dropSpares
		once2.Do(func() {
			go func() { _, err := e.alloc(3*mib, st, it); tDone <- err }()
			for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(time.Millisecond) {
				p.mu.Lock()
				queued := len(p.busyQ) > 0
				p.mu.Unlock()
				if queued {
					break
				}
			}
			fail.Store(true)
		})
		return nil
	}
	_, err := p.Allocate(4*mib, sa)
	require.Error(t, err)
	require.NoError(t, <-tDone)
	vm.onUnmap, vm.onRelease = nil, nil
	p.mu.Lock()
	var home *freeList
	for x := p.exp.head; x != nil; x = x.next {
		if x.addr == b[1] {
			home = x.list
		}
	}
	lost := home != nil && !slices.Contains(p.lists, home)
	p.mu.Unlock()
	require.False(t, lost, "the block at B1 is free in a list the pool dropped")
	require.NoError(t, p.CheckInvariants())
}

// A carving pool at its maximum with no holes and its free memory in pieces gives back what is
// wholly free before failing (its reservation, twice the maximum, lets its end grow then), and the
// bound on moves does not keep it from carving when it cannot grow instead.
func TestPoolCarveGivesBackAtItsMaximum(t *testing.T) {
	p := newExpTestPool(t, newSimVMM(hostVMMGranularity, 0), PoolOptions{MaximumPoolSize: 32 * mib, carvePage: 2 * mib})
	defer p.Close()
	alloc := func(n int) DevicePtr {
		q, err := p.Allocate(n, DefaultStream)
		require.NoError(t, err)
		return q
	}
	free := func(q DevicePtr, n int) { require.NoError(t, p.Deallocate(q, n, DefaultStream)) }
	var b [16]DevicePtr
	for i := range b {
		b[i] = alloc(2 * mib)
	}
	for r := 0; r < 5 && float64(p.exp.moved) <= p.exp.churn*float64(p.PoolSize()); r++ {
		for _, i := range []int{1, 3, 5, 7} {
			free(b[i], 2*mib)
		}
		free(alloc(8*mib), 8*mib) // carves the four pages
		require.NoError(t, p.Release())
		for _, i := range []int{1, 3, 5, 7} {
			b[i] = alloc(2 * mib) // fills the holes
		}
	}
	require.Equal(t, 32*mib, p.PoolSize())
	require.Zero(t, p.Stats().Holes)
	for _, i := range []int{14, 15, 1, 3, 5} {
		free(b[i], 2*mib)
	}
	_, err := p.Allocate(8*mib, DefaultStream)
	require.NoError(t, err, "giving back the free pages serves it")
	require.NoError(t, p.CheckInvariants())
	require.LessOrEqual(t, p.PoolSize(), 32*mib)
}

// A growth that fails after carving (here its first cuMemMap) maps the carved pages back where
// they were: the failed Allocate leaves the pool's memory as it found it, holes and all.
func TestPoolCarveFailedGrowthMapsPagesBack(t *testing.T) {
	vm := &hookVMM{vmm: newSimVMM(hostVMMGranularity, 0)}
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30, carvePage: 2 * mib})
	defer p.Close()
	var b [16]DevicePtr
	for i := range b {
		b[i], _ = p.Allocate(2*mib, DefaultStream)
	}
	for i := 1; i < 8; i += 2 {
		require.NoError(t, p.Deallocate(b[i], 2*mib, DefaultStream))
	}
	before := p.Stats()
	var failed atomic.Bool
	vm.onMap = func(DevicePtr, int) error { // the growth's first map fails, the rest work
		if failed.CompareAndSwap(false, true) {
			return errExpRandInjected
		}
		return nil
	}
	_, err := p.Allocate(8*mib, DefaultStream)
	require.ErrorIs(t, err, errExpRandInjected)
	vm.onMap = nil
	require.NoError(t, p.CheckInvariants())
	require.Equal(t, before.PoolSize, p.Stats().PoolSize, "the failed Allocate released the carved fragments")
	require.Equal(t, before.Holes, p.Stats().Holes)
	require.Equal(t, before.FreeBytes, p.Stats().FreeBytes)
	q, err := p.Allocate(2*mib, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, b[1], q, "the first fragment is back in place and free")
}
