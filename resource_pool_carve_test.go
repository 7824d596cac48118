package rmm

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// countingVMM counts the driver calls an expandable pool makes.
type countingVMM struct {
	vmm
	mu       sync.Mutex
	mappedAt map[vmmHandle]DevicePtr
	vmmCounts
}

type vmmCounts struct {
	creates, maps, unmaps, releases  int
	remaps                           int // a handle mapped again at another address
	access                           int
	created, createdPeak, createdNow int // bytes
}

func (v *countingVMM) counts() vmmCounts {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.vmmCounts
}

func newCountingVMM(inner vmm) *countingVMM {
	return &countingVMM{vmm: inner, mappedAt: map[vmmHandle]DevicePtr{}}
}

func (v *countingVMM) create(n int) (vmmHandle, error) {
	h, err := v.vmm.create(n)
	if err == nil {
		v.mu.Lock()
		v.creates++
		v.created += n
		v.createdNow += n
		v.createdPeak = max(v.createdPeak, v.createdNow)
		v.mu.Unlock()
	}
	return h, err
}

func (v *countingVMM) mapAt(a DevicePtr, n int, h vmmHandle) error {
	err := v.vmm.mapAt(a, n, h)
	if err == nil {
		v.mu.Lock()
		v.maps++
		if at, ok := v.mappedAt[h]; ok && at != a {
			v.remaps++
		}
		v.mappedAt[h] = a
		v.mu.Unlock()
	}
	return err
}

func (v *countingVMM) setAccess(a DevicePtr, n int) error {
	v.mu.Lock()
	v.access++
	v.mu.Unlock()
	return v.vmm.setAccess(a, n)
}

func (v *countingVMM) unmap(a DevicePtr, n int) error {
	err := v.vmm.unmap(a, n)
	if err == nil {
		v.mu.Lock()
		v.unmaps++
		v.mu.Unlock()
	}
	return err
}

func (v *countingVMM) release(h vmmHandle) error {
	n := 0
	if sv, ok := v.vmm.(*simVMM); ok {
		sv.mu.Lock()
		if hd := sv.handles[h]; hd != nil {
			n = hd.size
		}
		sv.mu.Unlock()
	}
	err := v.vmm.release(h)
	if err == nil {
		v.mu.Lock()
		v.releases++
		v.createdNow -= n
		v.mu.Unlock()
	}
	return err
}

// fragmentedCarvePool fills a pool with sixteen 2 MiB blocks (one first growth of 32 MiB) and
// frees every other one of the first eight: 8 MiB free, in 2 MiB fragments with live blocks
// between them, so that an 8 MiB request fits nowhere.
func fragmentedCarvePool(t *testing.T, page int) (*PoolMemoryResource, *countingVMM, []DevicePtr) {
	return fragmentedCarvePoolWith(t, PoolOptions{MaximumPoolSize: 1 << 30, carvePage: page})
}

// sixteenBlocksOfOneGrowth allocates sixteen 2 MiB blocks on the default stream of an empty
// expandable pool: one growth of the minimum chunk (32 MiB).
func sixteenBlocksOfOneGrowth(t *testing.T, p *PoolMemoryResource) []DevicePtr {
	t.Helper()
	var ptrs []DevicePtr
	for range 16 {
		q, err := p.Allocate(2*mib, DefaultStream)
		require.NoError(t, err)
		ptrs = append(ptrs, q)
	}
	require.Equal(t, 32*mib, p.PoolSize(), "one growth of the minimum chunk (two of a stitching pool's)")
	return ptrs
}

func fragmentedCarvePoolWith(t *testing.T, o PoolOptions) (*PoolMemoryResource, *countingVMM, []DevicePtr) {
	t.Helper()
	vm := newCountingVMM(newSimVMM(hostVMMGranularity, 0))
	p := newExpTestPool(t, vm, o)
	t.Cleanup(func() { p.Close() })
	ptrs := sixteenBlocksOfOneGrowth(t, p)
	for i := 1; i < 8; i += 2 {
		require.NoError(t, p.Deallocate(ptrs[i], 2*mib, DefaultStream))
	}
	require.NoError(t, p.CheckInvariants())
	return p, vm, ptrs
}

// The 8 MiB request moves the four free 2 MiB pages to the end of the range instead of mapping
// new memory: the pool stays at 32 MiB, with four holes where the fragments were.
func TestPoolCarveMovesFragments(t *testing.T) {
	p, vm, ptrs := fragmentedCarvePool(t, 2*mib)
	require.Equal(t, 16, vm.creates, "the first growth maps 2 MiB pieces (a sixteenth of 32 MiB)")
	before := vm.counts()
	q, err := p.Allocate(8*mib, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.CheckInvariants())
	require.Equal(t, ptrs[15]+DevicePtr(2*mib), q, "placed at the end of the range")
	require.Equal(t, 32*mib, p.PoolSize(), "no new memory")
	require.Equal(t, before.creates, vm.counts().creates)
	require.Equal(t, 4, vm.counts().unmaps-before.unmaps)
	require.Equal(t, 4, vm.counts().remaps-before.remaps)
	require.Equal(t, before.releases, vm.counts().releases, "the handles moved, none was given back")
	st := p.Stats()
	require.Equal(t, 4, st.Holes)
	require.Equal(t, 8*mib, st.HoleBytes)
	require.Equal(t, 32*mib, vm.createdPeak)

	// The moved memory is usable and the holes never are: everything freed, the pool serves
	// 16 MiB of 2 MiB blocks out of the mapped memory only.
	require.NoError(t, p.Deallocate(q, 8*mib, DefaultStream))
	for i := 0; i < 16; i++ {
		if i >= 8 || i%2 == 0 {
			require.NoError(t, p.Deallocate(ptrs[i], 2*mib, DefaultStream))
		}
	}
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
	require.Zero(t, vm.createdNow, "every handle is given back")
}

// Without carving the same request maps new memory: the fragments stay where they are.
func TestPoolNoCarveGrowsForFragments(t *testing.T) {
	p, vm, _ := fragmentedCarvePool(t, 0)
	require.Equal(t, 1, vm.creates, "one handle per growth")
	_, err := p.Allocate(8*mib, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, 40*mib, p.PoolSize())
	require.Zero(t, vm.unmaps)
	require.Zero(t, p.Stats().Holes)
}

// Carving takes only what the request lacks beyond the free block at the end, smallest free
// blocks first, and never the free block at the end itself.
func TestPoolCarveTakesWhatTheRequestLacks(t *testing.T) {
	p, vm, ptrs := fragmentedCarvePool(t, 2*mib)
	// Free the last block (a free tail of 2 MiB) and blocks 9 and 10 (a 4 MiB fragment).
	require.NoError(t, p.Deallocate(ptrs[15], 2*mib, DefaultStream))
	require.NoError(t, p.Deallocate(ptrs[9], 2*mib, DefaultStream))
	require.NoError(t, p.Deallocate(ptrs[10], 2*mib, DefaultStream))
	before := vm.counts()
	// 6 MiB: fits in no free block (the largest is 4 MiB); needs 4 MiB beyond the free tail.
	q, err := p.Allocate(6*mib, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.CheckInvariants())
	require.Equal(t, ptrs[15], q, "extends the free tail")
	require.Equal(t, 2, vm.counts().unmaps-before.unmaps, "two pages: what the request lacks")
	// The growth itself maps the fragmented pool's minimum (8 MiB): the two pages moved and two
	// new ones.
	require.Equal(t, 2, vm.counts().creates-before.creates)
	require.Equal(t, 36*mib, p.PoolSize())
	// The two pages came from 2 MiB fragments (the smallest), not from the 4 MiB one.
	st := p.Stats()
	require.Equal(t, 2, st.Holes)
	sim := vm.vmm.(*simVMM)
	mapped := func(a DevicePtr, n int) bool {
		sim.mu.Lock()
		defer sim.mu.Unlock()
		_, ok := sim.covered(a, n)
		return ok
	}
	require.True(t, mapped(ptrs[9], 4*mib), "the 4 MiB fragment is still mapped")
	for _, i := range []int{1, 3, 5, 7} {
		require.Equal(t, i == 5 || i == 7, !mapped(ptrs[i], 2*mib), fmt.Sprintf("fragment %d", i))
	}
}

// Carving stops once it has moved more than carveChurn × the pool since the pool's last new peak
// size: the next growth maps new memory though free pages lie in fragments, and that growth, a
// new peak, lets the one after it carve again. Without the bound the same growth carves.
func TestPoolCarveChurnBound(t *testing.T) {
	for _, churn := range []float64{0.2, -1} {
		t.Run(fmt.Sprint(churn), func(t *testing.T) {
			p, vm, ptrs := fragmentedCarvePoolWith(t, PoolOptions{MaximumPoolSize: 1 << 30, carvePage: 2 * mib, carveChurn: churn})
			alloc := func(n int) {
				t.Helper()
				_, err := p.Allocate(n, DefaultStream)
				require.NoError(t, err)
				require.NoError(t, p.CheckInvariants())
			}
			// An 8 MiB request moves the four 2 MiB fragments: 8 MiB moved, a quarter of the
			// 32 MiB pool.
			alloc(8 * mib)
			c := vm.counts()
			require.Equal(t, 4, c.unmaps)
			require.Equal(t, 16, c.creates)
			require.Equal(t, 32*mib, p.PoolSize())
			free3 := func(from int) {
				for _, i := range []int{from, from + 2, from + 4} {
					require.NoError(t, p.Deallocate(ptrs[i], 2*mib, DefaultStream))
				}
			}
			free3(9) // three new fragments, 6 MiB
			// A 6 MiB request: a growth of at least 8 MiB (expandableFragmentedMin).
			alloc(6 * mib)
			d := vm.counts()
			if churn < 0 {
				require.Equal(t, 3, d.unmaps-c.unmaps, "no bound: three more pages moved")
				require.Equal(t, 1, d.creates-c.creates, "and 2 MiB created")
				require.Equal(t, 34*mib, p.PoolSize())
				return
			}
			require.Equal(t, c.unmaps, d.unmaps, "8 MiB moved > 0.2 x 32 MiB: no carving")
			require.Equal(t, 4, d.creates-c.creates, "an 8 MiB growth of new memory instead")
			require.Equal(t, 40*mib, p.PoolSize())
			// That growth was a new peak: the next one carves two of the fragments (the 4 MiB
			// it lacks beyond the 2 MiB free at the end) and creates what the 8 MiB minimum
			// asks beyond them.
			alloc(6 * mib)
			e := vm.counts()
			require.Equal(t, 2, e.unmaps-d.unmaps)
			require.Equal(t, 2, e.creates-d.creates)
			require.Equal(t, 44*mib, p.PoolSize())
		})
	}
}

// A pool that carving or Release left smaller than the most bytes once live at the same time
// grows with new memory rather than carve: staying under that figure raises no peak.
func TestPoolCarveNotBelowPeakLive(t *testing.T) {
	p, vm, ptrs := fragmentedCarvePool(t, 2*mib)
	// Give back the free pages (four holes) and free four more blocks: 16 MiB live of a 24 MiB
	// pool, 32 MiB once live.
	require.NoError(t, p.Release())
	require.Equal(t, 24*mib, p.PoolSize())
	for i := 9; i < 16; i += 2 {
		require.NoError(t, p.Deallocate(ptrs[i], 2*mib, DefaultStream))
	}
	before := vm.counts()
	_, err := p.Allocate(6*mib, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.CheckInvariants())
	after := vm.counts()
	require.Equal(t, before.unmaps, after.unmaps, "nothing moved")
	require.Greater(t, after.creates, before.creates, "new memory")
	require.LessOrEqual(t, p.PoolSize(), 32*mib)
}
