package rmm

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// stitchTestPool is an expandable pool that stitches with 2 MiB pieces over an address-only VMM
// (or host memory), filled with sixteen 2 MiB blocks (one first growth of 32 MiB, sixteen
// handles), of which those at the indices free are freed.
type stitchTestPool struct {
	p    *PoolMemoryResource
	vm   *countingVMM
	sim  *simVMM
	ptrs []DevicePtr
}

func newStitchTestPool(t *testing.T, tune poolTuning, host bool, free ...int) *stitchTestPool {
	t.Helper()
	var inner vmm
	var sim *simVMM
	if host {
		hv, err := newHostVMMAliasing(hostVMMGranularity, 0)
		if err != nil {
			t.Skip("host VMM:", err)
		}
		inner = hv
	} else {
		sim = newSimVMM(hostVMMGranularity, 0)
		inner = sim
	}
	vm := newCountingVMM(inner)
	if tune.stitchPiece == 0 {
		tune.stitchPiece = 2 * mib
	}
	p := newTunedTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30}, tune)
	t.Cleanup(func() { p.Close() })
	ptrs := sixteenBlocksOfOneGrowth(t, p)
	require.Equal(t, 16, vm.counts().creates, "in 2 MiB handles")
	for _, i := range free {
		require.NoError(t, p.Deallocate(ptrs[i], 2*mib, DefaultStream))
	}
	require.NoError(t, p.CheckInvariants())
	return &stitchTestPool{p: p, vm: vm, sim: sim, ptrs: ptrs}
}

func (s *stitchTestPool) inPrimary(q DevicePtr) bool {
	e := s.p.expandable()
	return q >= e.base && q < e.base+DevicePtr(e.reserved)
}

// An 8 MiB request that no free block holds is served by the four free 2 MiB handles, mapped a
// second time back to back: no memory is created, the pool stays at 32 MiB; freed, the alias is
// kept and the next request of that size takes it again with no driver call at all.
func TestStitchServesAndReuses(t *testing.T) {
	s := newStitchTestPool(t, poolTuning{}, false, 1, 3, 5, 7)
	p, vm := s.p, s.vm
	before := vm.counts()
	r0 := s.vm.counts().reserves
	q, err := p.Allocate(8*mib, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.CheckInvariants())
	require.False(t, s.inPrimary(q), "the stitched range is a reservation of its own")
	require.Equal(t, 32*mib, p.PoolSize(), "no new memory")
	require.Equal(t, before.creates, vm.counts().creates)
	require.Equal(t, 4, vm.counts().maps-before.maps, "each free handle mapped once more")
	require.Equal(t, 1, vm.counts().access-before.access, "access over the four mappings in one call")
	r1 := s.vm.counts().reserves
	require.Equal(t, r0+1, r1)
	st := p.Stats()
	require.Equal(t, 32*mib, st.LiveBytes)
	require.Zero(t, st.FreeBytes)
	require.Equal(t, 13, st.LiveAllocations)
	// The stitched range maps exactly the freed handles, in the order chosen (same size: by
	// address).
	mappingAt := func(a DevicePtr) vmmMapping {
		m, ok := s.sim.mappingAt(a)
		require.True(t, ok && m.addr == a, "a mapping at %#x", uintptr(a))
		return m
	}
	for i, idx := range []int{1, 3, 5, 7} {
		ma := mappingAt(q + DevicePtr(i*2*mib))
		mp := mappingAt(s.ptrs[idx])
		require.Equal(t, mp.h, ma.h, "piece %d", i)
		require.True(t, ma.access)
	}

	require.NoError(t, p.Deallocate(q, 8*mib, DefaultStream))
	require.NoError(t, p.CheckInvariants())
	require.Equal(t, 8*mib, p.Stats().FreeBytes)
	require.Equal(t, 1, len(p.stitching().aliases), "kept")
	c0 := vm.counts()
	q2, err := p.Allocate(8*mib, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, q, q2, "the kept alias again")
	require.Equal(t, c0, vm.counts(), "no driver call")
	r2 := s.vm.counts().reserves
	require.Equal(t, r1, r2)
	require.NoError(t, p.CheckInvariants())

	// Smaller than 2 MiB, or held by a free block: never stitched.
	require.NoError(t, p.Deallocate(q2, 8*mib, DefaultStream))
	x, err := p.Allocate(2*mib, DefaultStream)
	require.NoError(t, err)
	require.True(t, s.inPrimary(x))
	require.NoError(t, p.Deallocate(x, 2*mib, DefaultStream))
}

// Chunks that lie back to back in the chain are lent as one block (a run): free handles 1-3 and
// 5 serve an 8 MiB request through two lent blocks, and the kept alias is found and lent again
// a run at a time; the blocks around them are unchanged.
func TestStitchLendsRuns(t *testing.T) {
	s := newStitchTestPool(t, poolTuning{}, false, 1, 2, 3, 5)
	p := s.p
	q, err := p.Allocate(8*mib, DefaultStream)
	require.NoError(t, err)
	a := p.stitching().aliases[q]
	require.NotNil(t, a)
	require.Len(t, a.chunks, 4)
	require.Equal(t, []vmChunk{{addr: s.ptrs[1], size: 6 * mib}, {addr: s.ptrs[5], size: 2 * mib}}, a.runs)
	require.Len(t, a.lent, 2)
	require.Equal(t, s.ptrs[1], a.lent[0].addr)
	require.Equal(t, 6*mib, a.lent[0].size)
	require.Equal(t, s.ptrs[5], a.lent[1].addr)
	require.Equal(t, 2*mib, a.lent[1].size)
	require.NoError(t, p.CheckInvariants())

	require.NoError(t, p.Deallocate(q, 8*mib, DefaultStream))
	require.NoError(t, p.CheckInvariants())
	require.Equal(t, 8*mib, p.Stats().FreeBytes, "the runs are free again")
	c0 := s.vm.counts()
	q2, err := p.Allocate(8*mib, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, q, q2, "the kept alias again")
	require.Equal(t, c0, s.vm.counts(), "no driver call")
	require.Len(t, a.lent, 2)
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(q2, 8*mib, DefaultStream))
}

// The same over host memory: bytes written through the stitched range are those of the handles'
// own addresses, and the other way round.
func TestStitchHostAliases(t *testing.T) {
	s := newStitchTestPool(t, poolTuning{}, true, 2, 9, 12)
	p := s.p
	q, err := p.Allocate(6*mib, DefaultStream)
	require.NoError(t, err)
	require.False(t, s.inPrimary(q))
	require.Equal(t, 32*mib, p.PoolSize())
	b := hostBytes(q, 6*mib)
	for i := range b {
		b[i] = byte(i*7 + i>>21)
	}
	for i, idx := range []int{2, 9, 12} {
		prim := hostBytes(s.ptrs[idx], 2*mib)
		for j := 0; j < 2*mib; j += 4093 {
			require.Equal(t, b[i*2*mib+j], prim[j], "piece %d byte %d", i, j)
		}
		prim[5] = 0xA5
		require.Equal(t, byte(0xA5), b[i*2*mib+5])
	}
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(q, 6*mib, DefaultStream))
	require.NoError(t, p.CheckInvariants())
}

// Release gives back the free handles only after unmapping the kept alias that maps them; Close
// frees every reservation.
func TestStitchReleaseWithKeptAlias(t *testing.T) {
	s := newStitchTestPool(t, poolTuning{}, false, 1, 3, 5, 7)
	p, vm := s.p, s.vm
	q, err := p.Allocate(8*mib, DefaultStream)
	require.NoError(t, err)
	// With the block live, Release gives nothing back: its handles are lent.
	require.NoError(t, p.Release())
	require.Equal(t, 32*mib, p.PoolSize())
	require.Len(t, p.stitching().aliases, 1)
	require.NoError(t, p.Deallocate(q, 8*mib, DefaultStream))
	c0 := vm.counts()
	require.NoError(t, p.Release())
	require.NoError(t, p.CheckInvariants())
	require.Equal(t, 24*mib, p.PoolSize())
	require.Empty(t, p.stitching().aliases)
	require.Equal(t, 1+4, vm.counts().unmaps-c0.unmaps, "the alias, then the four handles")
	require.Equal(t, 4, vm.counts().releases-c0.releases)
	charged, mappings, _, _ := s.sim.stats()
	require.Equal(t, 24*mib, charged, "the handles' memory is gone")
	require.Equal(t, 12, mappings)
	r, f := s.vm.counts().reserves, s.vm.counts().frees
	require.Equal(t, r-1, f, "only the pool's own reservation is left")

	// A new stitch after the release, then Close with it live and a free after Close.
	for _, i := range []int{0, 2, 4} {
		require.NoError(t, p.Deallocate(s.ptrs[i], 2*mib, DefaultStream))
	}
	q, err = p.Allocate(6*mib, DefaultStream)
	require.NoError(t, err)
	require.False(t, s.inPrimary(q))
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Close())
	for _, i := range []int{6, 8, 9, 10, 11, 12, 13, 14, 15} {
		require.NoError(t, p.Deallocate(s.ptrs[i], 2*mib, DefaultStream))
	}
	require.NoError(t, p.Deallocate(q, 6*mib, DefaultStream))
	charged, mappings, _, _ = s.sim.stats()
	require.Zero(t, charged)
	require.Zero(t, mappings)
	r, f = s.vm.counts().reserves, s.vm.counts().frees
	require.Equal(t, r, f, "every reservation freed")
}

// With stitchRest, free handles holding 6 MiB of an 8 MiB request: 2 MiB is grown at the end and
// the four handles stitched (34 MiB), where the pool would otherwise grow a step (stitchMinGrowth:
// 48 MiB).
func TestStitchRest(t *testing.T) {
	for _, rest := range []bool{false, true} {
		s := newStitchTestPool(t, poolTuning{stitchRest: rest}, false, 1, 3, 5)
		p, vm := s.p, s.vm
		c0 := vm.counts()
		q, err := p.Allocate(8*mib, DefaultStream)
		require.NoError(t, err)
		require.NoError(t, p.CheckInvariants())
		if !rest {
			require.True(t, s.inPrimary(q))
			require.Equal(t, 32*mib+stitchMinGrowth, p.PoolSize())
			continue
		}
		require.False(t, s.inPrimary(q))
		require.Equal(t, 34*mib, p.PoolSize())
		require.Equal(t, 1, vm.counts().creates-c0.creates)
		require.Equal(t, 1+4, vm.counts().maps-c0.maps, "the new handle at the end, then four into the alias")
		require.NoError(t, p.Deallocate(q, 8*mib, DefaultStream))
		require.NoError(t, p.CheckInvariants())
		require.Equal(t, 8*mib, p.Stats().FreeBytes)
	}
}

func TestStitchOptions(t *testing.T) {
	// Off by default: one handle per growth.
	vm := newCountingVMM(newSimVMM(hostVMMGranularity, 0))
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30})
	defer p.Close()
	q, err := p.Allocate(64*mib, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, 1, vm.counts().creates)
	require.Nil(t, p.stitching(), "no stitching backing")
	require.NoError(t, p.Deallocate(q, 64*mib, DefaultStream))
	// On: handles of at most the piece.
	vm = newCountingVMM(newSimVMM(hostVMMGranularity, 0))
	p2 := newTunedTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30}, poolTuning{stitchPiece: 8 * mib})
	defer p2.Close()
	q, err = p2.Allocate(64*mib, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, 8, vm.counts().creates)
	require.Equal(t, 1, vm.counts().access)
	require.NoError(t, p2.Deallocate(q, 64*mib, DefaultStream))
}

// PoolOptions.Stitch: refused without Expandable; on an expandable pool, growths map pieces of a
// granule or a 64th of the growth, and a request that no free block holds is stitched from them.
func TestStitchPublicOption(t *testing.T) {
	_, err := NewPoolMemoryResource(NewSystemMemoryResource(), &PoolOptions{Stitch: true})
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "Stitch applies to expandable pools")

	vm := newCountingVMM(newSimVMM(hostVMMGranularity, 0))
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30, Stitch: true})
	defer p.Close()
	// A first growth of 32 MiB: sixteen granules (a 64th of it is less than one).
	var ptrs []DevicePtr
	for range 16 {
		q, err := p.Allocate(2*mib, DefaultStream)
		require.NoError(t, err)
		ptrs = append(ptrs, q)
	}
	require.Equal(t, 16, vm.counts().creates)
	for _, i := range []int{2, 6, 10, 14} {
		require.NoError(t, p.Deallocate(ptrs[i], 2*mib, DefaultStream))
	}
	before := vm.counts()
	q, err := p.Allocate(8*mib, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, before.creates, vm.counts().creates, "stitched from the four free pieces")
	require.Equal(t, 32*mib, p.PoolSize())
	require.Equal(t, 1, p.stitching().stitches)
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(q, 8*mib, DefaultStream))
	// A growth of nearly 1 GiB (952 MiB: what the request lacks beyond the free tail) maps
	// pieces of a 64th of it, rounded down to the granule: 14 MiB.
	before = vm.counts()
	big, err := p.Allocate(1<<30-64*mib, DefaultStream)
	require.NoError(t, err)
	grown := p.PoolSize() - 32*mib
	require.Equal(t, 952*mib, grown)
	require.Equal(t, 68, vm.counts().creates-before.creates, "952 MiB in 14 MiB pieces")
	require.NoError(t, p.Deallocate(big, 1<<30-64*mib, DefaultStream))
	require.NoError(t, p.CheckInvariants())
}

// Over host memory (the SystemMemoryResource, as rmm-replay without a GPU), a stitching pool maps
// memfds, so that it stitches as on the device: the four free pieces serve an 8 MiB request with
// no growth, and the bytes written through the stitched range are those of the pieces. (It once
// mapped anonymous memory, which cannot be mapped twice: every stitch failed and the pool grew.)
func TestStitchOverHostMemory(t *testing.T) {
	p, err := NewPoolMemoryResource(NewSystemMemoryResource(), &PoolOptions{Expandable: true, Stitch: true, MaximumPoolSize: 1 << 30})
	if errors.Is(err, ErrNotSupported) {
		t.Skip(err) // host virtual memory management is implemented on Linux only
	}
	require.NoError(t, err)
	defer p.Close()
	ptrs := sixteenBlocksOfOneGrowth(t, p)
	for i, q := range ptrs {
		hostBytes(q, 2*mib)[0] = byte(i + 1)
	}
	for _, i := range []int{2, 6, 10, 14} {
		require.NoError(t, p.Deallocate(ptrs[i], 2*mib, DefaultStream))
	}
	q, err := p.Allocate(8*mib, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, 32*mib, p.PoolSize(), "stitched, not grown")
	require.Equal(t, 1, p.stitching().stitches)
	b := hostBytes(q, 8*mib)
	for k, i := range []int{2, 6, 10, 14} {
		require.Equal(t, byte(i+1), b[k*2*mib], "piece %d of the stitched range shows handle %d's bytes", k, i)
	}
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(q, 8*mib, DefaultStream))
	for i, q := range ptrs {
		if i%4 != 2 {
			require.NoError(t, p.Deallocate(q, 2*mib, DefaultStream))
		}
	}
}

// Past stitchKeep ranges, a new stitch first unmaps the least recently used one not live (after
// the host wait for the streams) and frees its reservation.
func TestStitchEvictsLeastRecentlyUsed(t *testing.T) {
	s := newStitchTestPool(t, poolTuning{stitchKeep: 2}, false, 1, 3, 5, 7)
	p, vm := s.p, s.vm
	var vas []DevicePtr
	for _, n := range []int{4 * mib, 6 * mib} {
		q, err := p.Allocate(n, DefaultStream)
		require.NoError(t, err)
		require.False(t, s.inPrimary(q))
		require.NoError(t, p.Deallocate(q, n, DefaultStream))
		vas = append(vas, q)
	}
	require.Len(t, p.stitching().aliases, 2)
	c0 := vm.counts()
	f0 := s.vm.counts().frees
	q, err := p.Allocate(8*mib, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.CheckInvariants())
	require.Len(t, p.stitching().aliases, 2)
	require.Nil(t, p.stitching().aliases[vas[0]], "the least recently used went")
	require.NotNil(t, p.stitching().aliases[vas[1]])
	require.NotNil(t, p.stitching().aliases[q])
	require.Equal(t, 1, vm.counts().unmaps-c0.unmaps)
	f1 := s.vm.counts().frees
	require.Equal(t, f0+1, f1)
	require.Equal(t, 1, p.stitching().evicted)
	require.NoError(t, p.Deallocate(q, 8*mib, DefaultStream))
}

// Release drops a kept alias (unlocked) before giving back the chunks under it; a block freed on
// the default stream meanwhile makes another chunk wholly free in the default list. Release gives
// back only the chunks whose frees it waited for: the model sees nothing given back before the
// work behind its free finished. (releaseChunks once took its candidates again from the default
// list after the alias's unmap, and gave that chunk back too.)
func TestStitchReleaseKeepsUnsyncedFree(t *testing.T) {
	vm, p, e, blocks, k := unsyncedFreeSetup(t)
	e.mustFree(k, 8*mib, DefaultStream, e.def) // the alias is kept
	require.Len(t, p.stitching().aliases, 1)

	vm.unmap_.shut(t)
	released := make(chan error, 1)
	go func() { released <- p.Release() }()
	require.Equal(t, "unmap", vm.unmap_.waitEntered(t)) // the alias's unmap, pool unlocked
	// Meanwhile: block 9 freed on the default stream (its work still pending on the device).
	e.mustFree(blocks[9], 2*mib, DefaultStream, e.def)
	vm.unmap_.open()
	require.NoError(t, <-released)
	require.Empty(t, vm.errs, "Release gave back memory whose free it never waited for")
	require.Equal(t, 24*mib, p.PoolSize(), "the four chunks freed before Release are given back, block 9's is not")
	for _, i := range []int{0, 2, 4, 6, 8, 10, 11, 12, 13, 14, 15} {
		e.mustFree(blocks[i], 2*mib, DefaultStream, e.def)
	}
	e.done()
}

// The same through the trim (ReleaseThreshold): a free that trims drops the kept alias unlocked;
// a default-stream free meanwhile is not given back.
func TestStitchTrimKeepsUnsyncedFree(t *testing.T) {
	vm, p, e, blocks, k := unsyncedFreeSetup(t)
	p.mu.Lock()
	p.expandable().threshold = 256 << 10 // as ReleaseThreshold: trim past 256 KiB free
	p.expandable().resetTrim(p.size - p.liveBytes)
	p.mu.Unlock()
	vm.unmap_.shut(t)
	freed := make(chan error, 1)
	go func() { freed <- e.free(k, 8*mib, DefaultStream, e.def) }() // frees 8 MiB of whole chunks: trims
	require.Equal(t, "unmap", vm.unmap_.waitEntered(t))
	e.mustFree(blocks[9], 2*mib, DefaultStream, e.def)
	vm.unmap_.open()
	require.NoError(t, <-freed)
	require.Empty(t, vm.errs, "the trim gave back memory whose free it never waited for")
	require.Equal(t, 24*mib, p.PoolSize(), "the trim gives back the four chunks under the stitched block, not block 9's")
}

// unsyncedFreeSetup: a stitching pool over the fake device, its unmaps checked by the model,
// holding sixteen 2 MiB blocks of the default stream (blocks; 1, 3, 5 and 7 freed) and k, an
// 8 MiB block stitched from those four.
func unsyncedFreeSetup(t *testing.T) (*gatedVMM, *PoolMemoryResource, *poolSyncEnv, []DevicePtr, DevicePtr) {
	vm := newGatedVMM(0)
	p := newTunedTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30}, poolTuning{stitchPiece: 2 * mib})
	e := newPoolSyncEnv(t, p)
	vm.check = e.checkReturned
	var blocks []DevicePtr
	for range 16 {
		blocks = append(blocks, e.mustAlloc(2*mib, DefaultStream, e.def))
	}
	require.Equal(t, 32*mib, p.PoolSize())
	for _, i := range []int{1, 3, 5, 7} {
		e.mustFree(blocks[i], 2*mib, DefaultStream, e.def)
	}
	k := e.mustAlloc(8*mib, DefaultStream, e.def)
	require.Equal(t, 1, p.stitching().stitches)
	return vm, p, e, blocks, k
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
