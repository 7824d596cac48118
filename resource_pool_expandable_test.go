package rmm

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// newExpTestPool builds an expandable pool over vm with the given options.
func newExpTestPool(t testing.TB, vm vmm, o PoolOptions) *PoolMemoryResource {
	t.Helper()
	return newTunedTestPool(t, vm, o, poolTuning{})
}

// expandable returns the backing of an expandable pool (of a stitching pool, the expandable it
// wraps); nil for a plain pool.
func (p *PoolMemoryResource) expandable() *expandable {
	switch b := p.backing.(type) {
	case *expandable:
		return b
	case *stitching:
		return b.expandable
	}
	return nil
}

// stitching returns the backing of a stitching pool; nil for another pool.
func (p *PoolMemoryResource) stitching() *stitching {
	st, _ := p.backing.(*stitching)
	return st
}

// newTunedTestPool is newExpTestPool with the package's knobs set to tune.
func newTunedTestPool(t testing.TB, vm vmm, o PoolOptions, tune poolTuning) *PoolMemoryResource {
	t.Helper()
	o.Expandable = true
	p, err := newExpandablePool(NewSystemMemoryResource(), vm, o, tune)
	require.NoError(t, err)
	return p
}

// ---------------------------------------------------------------------------------------------
// The cases.

// The cases run over each VMM: the address-only fake and host memory with a 4 KiB
// granularity here, the device's virtual memory on a GPU (gpu_expandable_test.go). Sizes are in
// units of the granularity g where it matters.

// expVMMCase is a VMM to run the cases over.
type expVMMCase struct {
	name string
	gran int
	new  func(t *testing.T) vmm
}

func expFakeVMMs() []expVMMCase {
	return []expVMMCase{
		{"sim", 4 * kiB, func(*testing.T) vmm { return newSimVMM(4*kiB, 0) }},
		{"host", 4 * kiB, func(t *testing.T) vmm {
			vm, err := newHostVMM(4*kiB, 0)
			require.NoError(t, err)
			return vm
		}},
	}
}

func runExpCases(t *testing.T, vms []expVMMCase, f func(t *testing.T, vm vmm, g int)) {
	for _, c := range vms {
		t.Run(c.name, func(t *testing.T) { f(t, c.new(t), c.gran) })
	}
}

// expClosedClean closes p and checks that nothing is left mapped or reserved.
func expClosedClean(t *testing.T, p *PoolMemoryResource, vm vmm) {
	require.NoError(t, p.Close())
	require.Empty(t, p.expandable().chunks)
	require.Zero(t, p.expandable().reserved, "the reservation is freed at Close")
	if sv, ok := vm.(*simVMM); ok {
		charged, mappings, _, _ := sv.stats()
		require.Zero(t, charged)
		require.Zero(t, mappings)
		require.Empty(t, sv.res)
	}
}

// A pool capped at C takes equal-size requests until their rounded total reaches C, all of them;
// after freeing everything, one allocation of the whole cap succeeds.
func expCaseReachesCap(t *testing.T, vm vmm, g int) {
	C := 64 * g
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: C})
	s1, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	for _, req := range []int{g/4 + 1000, g, 5*g/2 + 12345, 16 * g} {
		n, _ := alignSize(req)
		var ptrs []DevicePtr
		total := 0
		for i := 0; total+n <= C; i++ {
			s := DefaultStream
			if i%3 == 1 {
				s = s1.View()
			}
			ptr, err := p.Allocate(req, s)
			require.NoError(t, err, "request %d of %d bytes, %d of %d allocated", i, req, total, C)
			ptrs = append(ptrs, ptr)
			total += n
		}
		require.Equal(t, C/n, len(ptrs))
		_, err = p.Allocate(req, DefaultStream)
		var oom *OutOfMemoryError
		require.ErrorAs(t, err, &oom)
		require.NoError(t, p.CheckInvariants())
		for i, ptr := range ptrs {
			s := DefaultStream
			if i%2 == 1 {
				s = s1.View()
			}
			require.NoError(t, p.Deallocate(ptr, req, s))
		}
		whole, err := p.Allocate(C, s1.View())
		require.NoError(t, err, "the whole cap after freeing everything (request %d)", req)
		require.Equal(t, C, p.PoolSize())
		require.NoError(t, p.CheckInvariants())
		require.NoError(t, p.Deallocate(whole, C, s1.View()))
	}
	require.NoError(t, s1.Close())
	expClosedClean(t, p, vm)
}

// Blocks freed on two streams next to each other coalesce into one before the pool grows.
func expCaseCoalescesAcrossStreams(t *testing.T, vm vmm, g int) {
	p := newExpTestPool(t, vm, PoolOptions{InitialPoolSize: 2 * g, MaximumPoolSize: 64 * g})
	s1, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	a, err := p.Allocate(g, DefaultStream)
	require.NoError(t, err)
	b, err := p.Allocate(g, s1.View())
	require.NoError(t, err)
	require.Equal(t, a+DevicePtr(g), b)
	require.Equal(t, 2*g, p.PoolSize())
	require.NoError(t, p.Deallocate(a, g, DefaultStream))
	require.NoError(t, p.Deallocate(b, g, s1.View()))
	chunks := len(p.expandable().chunks)
	c, err := p.Allocate(2*g, s1.View())
	require.NoError(t, err)
	require.Equal(t, a, c, "the two halves coalesced")
	require.Equal(t, 2*g, p.PoolSize(), "without growing")
	require.Equal(t, chunks, len(p.expandable().chunks))
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(c, 2*g, s1.View()))
	require.NoError(t, s1.Close())
	expClosedClean(t, p, vm)
}

// Free space from different growth steps coalesces: after everything was freed, a request larger
// than any one chunk takes the chunks together, without growing.
func expCaseCoalescesAcrossGrowthSteps(t *testing.T, vm vmm, g int) {
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 256 * miB})
	var ptrs []DevicePtr
	for range 5 {
		ptr, err := p.Allocate(40*miB, DefaultStream)
		require.NoError(t, err)
		ptrs = append(ptrs, ptr)
	}
	require.Greater(t, len(p.expandable().chunks), 1)
	for _, ptr := range ptrs {
		require.NoError(t, p.Deallocate(ptr, 40*miB, DefaultStream))
	}
	size := p.PoolSize()
	big, err := p.Allocate(200*miB, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, ptrs[0], big)
	require.Equal(t, size, p.PoolSize(), "no growth: the free space of all steps is one block")
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(big, 200*miB, DefaultStream))
	expClosedClean(t, p, vm)
}

// Release leaves exactly the chunks that hold live blocks; growth maps into the holes again.
func expCaseReleaseKeepsOnlyLiveChunks(t *testing.T, vm vmm, g int) {
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30})
	// Allocations large enough that every growth maps one chunk per allocation.
	var ptrs []DevicePtr
	for range 6 {
		ptr, err := p.Allocate(40*miB, DefaultStream)
		require.NoError(t, err)
		ptrs = append(ptrs, ptr)
	}
	small, err := p.Allocate(1000, DefaultStream) // a chunk of its own
	require.NoError(t, err)
	chunksBefore := len(p.expandable().chunks)
	// Free 1, 2 and 4; 0, 3, 5 (and small) stay live.
	for _, i := range []int{1, 2, 4} {
		require.NoError(t, p.Deallocate(ptrs[i], 40*miB, DefaultStream))
	}
	require.NoError(t, p.Release())
	require.NoError(t, p.CheckInvariants())
	live := [][2]DevicePtr{}
	for _, i := range []int{0, 3, 5} {
		live = append(live, [2]DevicePtr{ptrs[i], ptrs[i] + 40*miB})
	}
	live = append(live, [2]DevicePtr{small, small + 1024})
	for _, c := range p.expandable().chunks {
		used := false
		for _, l := range live {
			if l[0] < c.end() && c.addr < l[1] {
				used = true
			}
		}
		require.True(t, used, "chunk %#x (%d bytes) holds no live block", uintptr(c.addr), c.size)
	}
	st := p.Stats()
	require.Equal(t, chunksBefore-3, st.UpstreamBlocks, "the three freed 40 MiB chunks went back")
	require.Equal(t, 2, st.Holes, "1 and 2 make one hole of 80 MiB, 4 one of 40 MiB")
	require.Equal(t, 120*miB, st.HoleBytes)
	require.Equal(t, st.PoolSize+st.HoleBytes, int(p.expandable().top-p.expandable().base))
	if sv, ok := vm.(*simVMM); ok {
		_, mappings, _, _ := sv.stats()
		require.Equal(t, st.UpstreamBlocks, mappings)
	}
	// Growth fills a hole rather than map past the end, when that maps no more: with the free
	// rest of small's chunk at the end taken, the end would map 40 MiB too.
	fill, err := p.Allocate(p.Stats().LargestFreeBlock, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, small+1024, fill)
	top := p.expandable().top
	again, err := p.Allocate(40*miB, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, ptrs[1], again, "mapped into the hole")
	require.Equal(t, top, p.expandable().top)
	require.NoError(t, p.CheckInvariants())
	for _, i := range []int{0, 3, 5} {
		require.NoError(t, p.Deallocate(ptrs[i], 40*miB, DefaultStream))
	}
	require.NoError(t, p.Deallocate(small, 1000, DefaultStream))
	require.NoError(t, p.Deallocate(again, 40*miB, DefaultStream))
	require.NoError(t, p.Deallocate(fill, int(top-fill), DefaultStream))
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
	require.Zero(t, p.Stats().Holes)
	require.Equal(t, p.expandable().base, p.expandable().top)
	require.NoError(t, p.CheckInvariants())
	expClosedClean(t, p, vm)
}

// A hole is filled only when that maps no more than growing at the end of the chain: a request a
// little larger than the free block at the end extends it, rather than taking a whole new chunk
// in a hole with no free neighbour.
func expCaseHoleOnlyWhenCheaper(t *testing.T, vm vmm, g int) {
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30})
	var ptrs []DevicePtr
	for range 5 { // one 40 MiB chunk each
		ptr, err := p.Allocate(40*miB, DefaultStream)
		require.NoError(t, err)
		ptrs = append(ptrs, ptr)
	}
	require.NoError(t, p.Deallocate(ptrs[1], 40*miB, DefaultStream))
	require.NoError(t, p.Deallocate(ptrs[2], 40*miB, DefaultStream))
	require.NoError(t, p.Release()) // an 80 MiB hole between 0 and 3
	require.NoError(t, p.Deallocate(ptrs[4], 40*miB, DefaultStream))
	st := p.Stats()
	require.Equal(t, 1, st.Holes)
	require.Equal(t, 80*miB, st.HoleBytes)
	size := st.PoolSize

	// 44 MiB: the hole would map 44 MiB; the end maps one minimum chunk (32 MiB) after the
	// free 40 MiB there.
	q, err := p.Allocate(44*miB, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, ptrs[4], q, "the free block at the end grew")
	require.Equal(t, size+expandableMinChunk, p.PoolSize())
	require.Equal(t, 80*miB, p.Stats().HoleBytes, "the hole is untouched")
	require.NoError(t, p.CheckInvariants())

	// 80 MiB: the end has 28 MiB free and maps the 52 MiB missing; the hole would map 80.
	size = p.PoolSize()
	r, err := p.Allocate(80*miB, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, q+44*miB, r)
	require.Equal(t, size+52*miB, p.PoolSize())
	// 40 MiB with nothing free at the end: the hole maps no more than the end would (40 MiB).
	u, err := p.Allocate(40*miB, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, ptrs[1], u, "mapped into the hole")
	require.Equal(t, 40*miB, p.Stats().HoleBytes)
	require.NoError(t, p.CheckInvariants())
	for _, x := range []struct {
		p DevicePtr
		n int
	}{{ptrs[0], 40 * miB}, {ptrs[3], 40 * miB}, {q, 44 * miB}, {r, 80 * miB}, {u, 40 * miB}} {
		require.NoError(t, p.Deallocate(x.p, x.n, DefaultStream))
	}
	expClosedClean(t, p, vm)
}

// Out-of-memory errors carry the figures, and say fragmentation or exhaustion; Stats gives the
// same figures.
func expCaseOutOfMemoryFigures(t *testing.T, vm vmm, g int) {
	C := 256 * g
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: C})
	// 16 blocks of 16g fill the cap; free every other one: 128g free in pieces of 16g.
	var ptrs []DevicePtr
	for range 16 {
		ptr, err := p.Allocate(16*g, DefaultStream)
		require.NoError(t, err)
		ptrs = append(ptrs, ptr)
	}
	for i := 0; i < 16; i += 2 {
		require.NoError(t, p.Deallocate(ptrs[i], 16*g, DefaultStream))
	}
	_, err := p.Allocate(32*g, DefaultStream)
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Equal(t, OutOfMemoryError{
		Resource: "PoolMemoryResource (expandable)", Requested: 32 * g, PoolSize: C, FreeBytes: 128 * g,
		LargestFreeBlock: 16 * g, MaximumSize: C, Headroom: 0, Fragmented: true,
		Detail: "maximum pool size reached",
	}, *oom)
	require.Contains(t, err.Error(), "fragmentation")
	// Exhaustion: more than everything free.
	_, err = p.Allocate(130*g, DefaultStream)
	require.ErrorAs(t, err, &oom)
	require.False(t, oom.Fragmented)
	require.Equal(t, 128*g, oom.FreeBytes)
	require.Contains(t, err.Error(), "exhausted")
	require.NoError(t, p.CheckInvariants())
	st := p.Stats()
	require.Equal(t, C, st.PoolSize)
	require.Equal(t, 128*g, st.FreeBytes)
	require.Equal(t, 16*g, st.LargestFreeBlock)
	require.Equal(t, 8, st.FreeBlocks)
	require.Equal(t, []StreamFreeStats{{Stream: DefaultStream, FreeBlocks: 8, FreeBytes: 128 * g}}, st.PerStream)
	for i := 1; i < 16; i += 2 {
		require.NoError(t, p.Deallocate(ptrs[i], 16*g, DefaultStream))
	}
	expClosedClean(t, p, vm)
}

func TestExpandablePoolReachesItsCap(t *testing.T) { runExpCases(t, expFakeVMMs(), expCaseReachesCap) }
func TestExpandablePoolCoalescesAcrossStreamsBeforeGrowing(t *testing.T) {
	runExpCases(t, expFakeVMMs(), expCaseCoalescesAcrossStreams)
}
func TestExpandablePoolCoalescesAcrossGrowthSteps(t *testing.T) {
	runExpCases(t, expFakeVMMs(), expCaseCoalescesAcrossGrowthSteps)
}
func TestExpandablePoolReleaseKeepsOnlyLiveChunks(t *testing.T) {
	runExpCases(t, expFakeVMMs(), expCaseReleaseKeepsOnlyLiveChunks)
}
func TestExpandablePoolFillsAHoleOnlyWhenCheaper(t *testing.T) {
	runExpCases(t, expFakeVMMs(), expCaseHoleOnlyWhenCheaper)
}
func TestExpandablePoolOutOfMemoryFigures(t *testing.T) {
	runExpCases(t, expFakeVMMs(), expCaseOutOfMemoryFigures)
}

// The device refusing a chunk: exhaustion with the device's error, headroom 0.
func TestExpandablePoolDeviceRefuses(t *testing.T) {
	const gran = 4 * kiB
	vm := newSimVMM(gran, 256*kiB)
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 16 * miB})
	a, err := p.Allocate(200*kiB, DefaultStream)
	require.NoError(t, err)
	_, err = p.Allocate(100*kiB, DefaultStream)
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	require.Zero(t, oom.Headroom)
	require.False(t, oom.Fragmented)
	require.Equal(t, 256*kiB, oom.PoolSize, "the step was halved down to what the device had")
	require.True(t, errors.Is(oom.Cause, ErrOutOfMemory))
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(a, 200*kiB, DefaultStream))
	b, err := p.Allocate(256*kiB, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(b, 256*kiB, DefaultStream))
}

// ReleaseThreshold trims free chunks at the next free past the threshold.
func TestExpandablePoolReleaseThreshold(t *testing.T) {
	const gran = 4 * kiB
	vm := newSimVMM(gran, 0)
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30, ReleaseThreshold: 8 * miB})
	var ptrs []DevicePtr
	for range 4 {
		ptr, err := p.Allocate(40*miB, DefaultStream)
		require.NoError(t, err)
		ptrs = append(ptrs, ptr)
	}
	for _, ptr := range ptrs[1:] {
		require.NoError(t, p.Deallocate(ptr, 40*miB, DefaultStream))
	}
	st := p.Stats()
	require.LessOrEqual(t, st.FreeBytes, 8*miB+expandableMinChunk, "trimmed down near the threshold")
	require.GreaterOrEqual(t, st.PoolSize, 40*miB)
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(ptrs[0], 40*miB, DefaultStream))
	require.NoError(t, p.CheckInvariants())
	require.LessOrEqual(t, p.Stats().FreeBytes, 8*miB+expandableMinChunk)
}

func TestExpandablePoolOptionErrors(t *testing.T) {
	_, err := NewPoolMemoryResource(NewSystemMemoryResource(), &PoolOptions{ReleaseThreshold: 10})
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = NewPoolMemoryResource(NewSystemMemoryResource(), &PoolOptions{Expandable: true, ReleaseThreshold: -1})
	require.ErrorIs(t, err, ErrInvalidArgument)
	inner, err := NewPoolMemoryResource(NewSystemMemoryResource(), nil)
	require.NoError(t, err)
	_, err = NewPoolMemoryResource(inner, &PoolOptions{Expandable: true})
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "PoolMemoryResource")
	// Over a SimulatedMemoryResource: addresses only, its capacity the physical limit.
	sim, err := NewSimulatedMemoryResource(64 << 20)
	require.NoError(t, err)
	p, err := NewPoolMemoryResource(sim, &PoolOptions{Expandable: true, MaximumPoolSize: 1 << 30})
	require.NoError(t, err)
	a, err := p.Allocate(48<<20, DefaultStream)
	require.NoError(t, err)
	_, err = p.Allocate(48<<20, DefaultStream)
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	require.Equal(t, 48<<20, oom.PoolSize, "the simulated capacity has no room for a second 48 MiB chunk")
	require.False(t, oom.Fragmented)
	require.NoError(t, p.Deallocate(a, 48<<20, DefaultStream))
	require.NoError(t, p.Close())
}
