package rmm

import (
	"bufio"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// arenaSim returns an arena of size bytes over an address-only upstream, with one
// default-stream shard so that tests on DefaultStream are deterministic.
func arenaSim(t *testing.T, size int, opts *ArenaOptions) (*ArenaMemoryResource, *SimulatedMemoryResource) {
	t.Helper()
	sim, err := NewSimulatedMemoryResource(1 << 50)
	require.NoError(t, err)
	o := ArenaOptions{ArenaSize: size, DefaultStreamArenas: 1}
	if opts != nil {
		o = *opts
		o.ArenaSize = size
	}
	a, err := NewArenaMemoryResource(sim, &o)
	require.NoError(t, err)
	t.Cleanup(func() { a.Close() })
	return a, sim
}

func arenaAlloc(t *testing.T, a MemoryResource, n int, s StreamView) DevicePtr {
	t.Helper()
	p, err := a.Allocate(n, s)
	require.NoError(t, err, "Allocate(%d, %v)", n, s)
	require.NotZero(t, p)
	require.Zero(t, p%Alignment)
	return p
}

func arenaCheck(t *testing.T, a *ArenaMemoryResource) {
	t.Helper()
	require.NoError(t, a.CheckInvariants())
}

func TestArenaOptionsValidation(t *testing.T) {
	sim, err := NewSimulatedMemoryResource(1 << 40)
	require.NoError(t, err)
	for _, o := range []ArenaOptions{
		{ArenaSize: 256},
		{ArenaSize: 1<<20 - 1}, // rounds down to 1 MiB - 256
		{ArenaSize: -1 << 20},
		{ArenaSize: 1 << 20, DefaultStreamArenas: -1},
	} {
		_, err := NewArenaMemoryResource(sim, &o)
		require.ErrorIs(t, err, ErrInvalidArgument, "%+v", o)
	}
	require.Zero(t, sim.UsedBytes(), "a refused construction takes nothing")

	// Rounded down to 256: exactly 1 MiB is the minimum.
	a, err := NewArenaMemoryResource(sim, &ArenaOptions{ArenaSize: 1<<20 + 255})
	require.NoError(t, err)
	require.Equal(t, 1<<20, a.ArenaSize())
	require.Equal(t, 1<<20, sim.UsedBytes(), "one upstream allocation of the arena size")
	require.Equal(t, sim, a.Upstream())
	require.Equal(t, Access(0), a.Access())
	require.Equal(t, CurrentDevice(), a.Device())
	require.Equal(t, runtime.GOMAXPROCS(0), len(a.shards), "default: one default-stream arena per processor")
	require.NoError(t, a.Close())
	require.Zero(t, sim.UsedBytes(), "Close returns the arena")
	require.NoError(t, a.Close(), "closing twice")

	// The upstream cannot give the arena.
	small, _ := NewSimulatedMemoryResource(1 << 20)
	_, err = NewArenaMemoryResource(small, &ArenaOptions{ArenaSize: 2 << 20})
	require.ErrorIs(t, err, ErrOutOfMemory)
}

// The default size is half of the current device's free memory (the host's without CUDA).
func TestArenaDefaultSize(t *testing.T) {
	up := newRecordingUpstream(arenaMustSim(t, 1<<60))
	before, err := PercentOfFreeDeviceMemory(50)
	require.NoError(t, err)
	a, err := NewArenaMemoryResource(up, nil)
	require.NoError(t, err)
	defer a.Close()
	after, err := PercentOfFreeDeviceMemory(50)
	require.NoError(t, err)
	size := a.ArenaSize()
	require.Zero(t, size%Alignment)
	lo, hi := min(before, after), max(before, after)
	require.InDelta(t, float64(lo+hi)/2, float64(size), float64(hi-lo)+float64(hi)/20, "half the free memory")
	blocks, _ := up.blocks()
	require.Len(t, blocks, 1)
	require.Equal(t, size, blocks[0].size)
	st := a.Stats()
	require.Equal(t, size, st.FreeBytes)
	require.Equal(t, (size+arenaMaxSuperblockSize-1)/arenaMaxSuperblockSize, st.Superblocks)
	arenaCheck(t, a)
}

func arenaMustSim(t *testing.T, capacity int) *SimulatedMemoryResource {
	t.Helper()
	sim, err := NewSimulatedMemoryResource(capacity)
	require.NoError(t, err)
	return sim
}

// An arena above 1 TiB is cut into equal superblocks of at most 1 TiB.
func TestArenaLargerThanMaxSuperblock(t *testing.T) {
	size := 2*arenaMaxSuperblockSize + 3<<20
	a, _ := arenaSim(t, size, nil)
	st := a.Stats()
	require.Equal(t, 3, st.Superblocks)
	require.Equal(t, size, st.FreeBytes)
	require.LessOrEqual(t, st.LargestFreeBlock, arenaMaxSuperblockSize)
	arenaCheck(t, a)
	_, err := a.Allocate(arenaMaxSuperblockSize+256, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory, "nothing larger than a superblock")
	p := arenaAlloc(t, a, arenaMaxSuperblockSize/2, DefaultStream)
	require.NoError(t, a.Deallocate(p, arenaMaxSuperblockSize/2, DefaultStream))
	arenaCheck(t, a)
	require.Equal(t, 3, a.Stats().Superblocks, "empty neighbours stay within 1 TiB")
}

// ---- superblock and tree unit cases ----

func TestArenaSuperblockFirstFitAndCoalesce(t *testing.T) {
	const base = DevicePtr(1 << 20)
	const mb = arenaMinSuperblockSize
	fit := func(sb *arenaSuperblock, n int) DevicePtr {
		t.Helper()
		p, ok := sb.firstFit(n)
		require.True(t, ok, "firstFit(%d)", n)
		require.NoError(t, sb.free.check())
		return p
	}

	sb := newArenaSuperblock(base, mb)
	require.True(t, sb.empty())
	require.Equal(t, mb, sb.maxFree())
	p1 := fit(sb, 1024)
	require.Equal(t, base, p1)
	require.False(t, sb.empty())
	p2 := fit(sb, 2048)
	require.Equal(t, base+1024, p2)
	sb.coalesce(p1, 1024)
	p3 := fit(sb, 512)
	require.Equal(t, base, p3, "first fit takes the lowest address")
	require.Equal(t, 2, sb.free.count, "[512, 1 KiB) and the tail")

	// A full superblock coalesces back.
	sb = newArenaSuperblock(base, mb)
	h1 := fit(sb, mb/2)
	fit(sb, mb/2)
	require.Zero(t, sb.maxFree(), "full")
	_, ok := sb.firstFit(256)
	require.False(t, ok)
	sb.coalesce(h1, mb/2)
	require.Equal(t, mb/2, sb.maxFree())

	// Merge with the next free block.
	sb = newArenaSuperblock(base, mb)
	h1 = fit(sb, mb/2)
	sb.coalesce(h1, mb/2)
	require.True(t, sb.empty())
	require.Equal(t, 1, sb.free.count)
	require.Equal(t, mb, sb.maxFree())

	// Merge with the previous free block.
	sb = newArenaSuperblock(base, mb)
	a, b := fit(sb, 1024), fit(sb, 1024)
	fit(sb, 1024)
	sb.coalesce(a, 1024)
	sb.coalesce(b, 1024)
	require.Equal(t, base, fit(sb, 2048))

	// Merge with both.
	sb = newArenaSuperblock(base, mb)
	a, b = fit(sb, 1024), fit(sb, 1024)
	sb.coalesce(a, 1024)
	sb.coalesce(b, 1024)
	require.True(t, sb.empty())
	require.Equal(t, base, fit(sb, mb))

	// Largest free block.
	sb = newArenaSuperblock(base, mb)
	a = fit(sb, mb/4)
	fit(sb, mb/4)
	sb.coalesce(a, mb/4)
	require.Equal(t, mb/2, sb.maxFree())
	require.Equal(t, mb/4*3, sb.freeBytes)
}

func TestArenaSuperblockSplitAndMerge(t *testing.T) {
	const mb = arenaMinSuperblockSize
	base := DevicePtr(mb)
	sb := newArenaSuperblock(base, 2*mb)
	tail := sb.split(mb, nil)
	require.Equal(t, base, sb.addr())
	require.Equal(t, mb, sb.size())
	require.True(t, sb.empty())
	require.Equal(t, mb, sb.maxFree())
	require.Equal(t, base+mb, tail.addr())
	require.Equal(t, mb, tail.size())
	require.True(t, tail.empty())
	require.NoError(t, sb.free.check())
	require.NoError(t, tail.free.check())

	sb.absorb(tail)
	require.Equal(t, 2*mb, sb.size())
	require.True(t, sb.empty())
	require.Equal(t, 2*mb, sb.maxFree())
	require.Equal(t, 1, sb.free.count)
	require.NoError(t, sb.free.check())

	// Only empty superblocks split or merge.
	p, _ := sb.firstFit(256)
	require.Panics(t, func() { sb.split(mb, nil) })
	sb.coalesce(p, 256)
	other := newArenaSuperblock(base+3*mb, mb)
	require.Panics(t, func() { sb.absorb(other) }, "not adjacent")
}

// A superblock merged into its neighbour is reset and used again by a split, with its free-block
// nodes kept as spares; the node stored with it is never both a spare and in the tree.
func TestArenaSuperblockReuse(t *testing.T) {
	const mb = arenaMinSuperblockSize
	base := DevicePtr(mb)
	sb := newArenaSuperblock(base, mb)
	next := newArenaSuperblock(base+mb, mb)
	sb.nextSB, next.prevSB = next, sb
	// Leave next empty with its stored node among the spares: free the last block first (it
	// takes the stored node), then the first (a new node), then the middle one, which joins both
	// and drops the stored node.
	a, _ := next.firstFit(256)
	b, _ := next.firstFit(256)
	c, _ := next.firstFit(mb - 512)
	next.coalesce(c, mb-512)
	next.coalesce(a, 256)
	next.coalesce(b, 256)
	require.True(t, next.empty())
	require.NotSame(t, &next.first, next.free.root)
	sb.absorb(next)
	require.Nil(t, sb.nextSB)

	tail := sb.split(mb, next)
	require.Same(t, next, tail)
	require.Same(t, tail, sb.nextSB)
	require.Same(t, sb, tail.prevSB)
	require.Equal(t, base+mb, tail.addr())
	require.Equal(t, mb, tail.size())
	require.True(t, tail.empty())
	// Carve four blocks and free the first and third: two new free-block nodes from the spares.
	var ps []DevicePtr
	for range 4 {
		p, ok := tail.firstFit(256)
		require.True(t, ok)
		ps = append(ps, p)
	}
	tail.coalesce(ps[0], 256)
	tail.coalesce(ps[2], 256)
	require.NoError(t, tail.free.check())
	require.Equal(t, 3, tail.free.count)
	require.Equal(t, mb-512, tail.freeBytes)
	tail.coalesce(ps[1], 256)
	tail.coalesce(ps[3], 256)
	require.NoError(t, tail.free.check())
	require.Equal(t, 1, tail.free.count)
	require.True(t, tail.empty())
}

// The superblock's layout keeps what an allocation and a free read on two cache lines.
func TestArenaSuperblockLayout(t *testing.T) {
	var sb arenaSuperblock
	require.Equal(t, uintptr(256), unsafe.Sizeof(sb), "Go's 256-byte size class: 64-byte aligned")
	for _, end := range []uintptr{
		unsafe.Offsetof(sb.owner) + 8,
		unsafe.Offsetof(sb.free) + unsafe.Sizeof(sb.free),
		unsafe.Offsetof(sb.freeBytes) + 8,
		unsafe.Offsetof(sb.ileaf) + 8,
		unsafe.Offsetof(sb.islot) + 4,
	} {
		require.LessOrEqual(t, end, uintptr(64), "the first line")
	}
	require.Equal(t, uintptr(64), unsafe.Offsetof(sb.first), "the first free-block node starts the second line")
	require.LessOrEqual(t, unsafe.Offsetof(sb.first.parent)+8, uintptr(128), "its hot part fills it")
}

// The treap against a sorted-slice model: first fit, neighbours, sizes, after every step.
func TestArenaTreeAgainstModel(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	var tree arenaTree
	var model []*arenaNode // sorted by address
	const slot = 8192      // larger than any size: nodes never overlap
	slots := make([]bool, 512)
	for step := 0; step < 4000; step++ {
		if k := r.IntN(512); !slots[k] && r.IntN(3) > 0 {
			n := &arenaNode{addr: DevicePtr(k * slot), size: r.IntN(5000) + 1}
			tree.insert(n)
			i, _ := slices.BinarySearchFunc(model, n.addr, func(x *arenaNode, a DevicePtr) int { return int(x.addr) - int(a) })
			model = slices.Insert(model, i, n)
			slots[k] = true
		} else if len(model) > 0 {
			i := r.IntN(len(model))
			if r.IntN(2) == 0 {
				tree.remove(model[i])
				slots[model[i].addr/slot] = false
				model = slices.Delete(model, i, i+1)
			} else {
				model[i].size = r.IntN(5000) + 1
				tree.fix(model[i])
			}
		}
		require.NoError(t, tree.check(), "step %d", step)
		require.Equal(t, len(model), tree.count)
		w := r.IntN(5200) + 1
		var want *arenaNode
		for _, n := range model {
			if n.size >= w {
				want = n
				break
			}
		}
		require.Same(t, want, tree.firstFit(w), "firstFit(%d) at step %d", w, step)
		a := DevicePtr(r.IntN(512*slot+2*slot)) - slot
		var below, above *arenaNode
		for _, n := range model {
			if n.addr < a {
				below = n
			}
			if n.addr > a && above == nil {
				above = n
			}
		}
		gotBelow, gotAbove := tree.around(a)
		require.Same(t, below, gotBelow, "around(%#x)", a)
		require.Same(t, above, gotAbove, "around(%#x)", a)
	}
	require.Equal(t, model, tree.nodes())
}

// ---- the arena through its API (librmm's unit cases, on a 4 MiB arena) ----

// A 1 MiB request is small: it takes a 1 MiB superblock split off the global arena; the next
// request finds that superblock full and takes the next one.
func TestArenaAllocateTakesSuperblocks(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, sim := arenaSim(t, 4*mb, nil)
	base := arenaBase(t, sim)
	s := mustStream(t)
	require.Equal(t, base, arenaAlloc(t, a, mb, s))
	require.Equal(t, base+mb, arenaAlloc(t, a, 256, s))
	st := a.Stats()
	require.Equal(t, 3, st.Superblocks, "1 MiB + 1 MiB in the stream's arena, 2 MiB in the global one")
	require.Equal(t, 1, st.GlobalSuperblocks)
	require.Equal(t, 1, st.StreamArenas)
	require.Equal(t, 2*mb, st.LargestFreeBlock)
	require.Equal(t, 4*mb-mb-256, st.FreeBytes)
	arenaCheck(t, a)
}

// Each stream takes its own superblock; when the global arena is empty a fifth stream's request
// defragments and is served from the first superblock with room.
func TestArenaSuperblockPerStreamThenDefragment(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, sim := arenaSim(t, 4*mb, nil)
	base := arenaBase(t, sim)
	for i := 0; i < 4; i++ {
		require.Equal(t, base+DevicePtr(i*mb), arenaAlloc(t, a, 256+i*256, mustStream(t)))
	}
	st := a.Stats()
	require.Zero(t, st.GlobalSuperblocks)
	require.Equal(t, 4, st.StreamArenas)
	require.Zero(t, st.Defragmentations)
	p := arenaAlloc(t, a, 512, mustStream(t))
	require.Equal(t, base+256, p, "after defragmenting, first fit in the first superblock")
	st = a.Stats()
	require.Equal(t, 1, st.Defragmentations)
	require.Equal(t, 3, st.GlobalSuperblocks, "the other three stay in the global arena")
	arenaCheck(t, a)
}

// Large requests come from the global arena; an empty superblock is split only when the rest is
// at least 1 MiB; freed empty superblocks coalesce so the whole arena is one block again.
func TestArenaLargeSplitAndCoalesce(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, sim := arenaSim(t, 4*mb, nil)
	base := arenaBase(t, sim)
	p1 := arenaAlloc(t, a, 2*mb, DefaultStream)
	require.Equal(t, base, p1)
	st := a.Stats()
	require.Equal(t, 2, st.GlobalSuperblocks, "split into 2 MiB + 2 MiB")
	p2 := arenaAlloc(t, a, mb+256, DefaultStream)
	require.Equal(t, base+2*mb, p2)
	require.Equal(t, 2, a.Stats().GlobalSuperblocks, "2 MiB < (1 MiB + 256) + 1 MiB: not split")
	p3 := arenaAlloc(t, a, mb/2, DefaultStream)
	require.Equal(t, base+3*mb+256, p3, "the small request takes the superblock with room")
	require.NoError(t, a.Deallocate(p3, mb/2, DefaultStream))
	require.NoError(t, a.Deallocate(p1, 2*mb, DefaultStream))
	require.NoError(t, a.Deallocate(p2, mb+256, DefaultStream))
	arenaCheck(t, a)
	require.NoError(t, a.Release())
	st = a.Stats()
	require.Equal(t, 1, st.Superblocks, "everything coalesced")
	require.Equal(t, 4*mb, st.LargestFreeBlock)
	require.Equal(t, base, arenaAlloc(t, a, 4*mb, DefaultStream))
	arenaCheck(t, a)
}

// Freed large blocks coalesce in the global arena without a defragmentation (librmm's
// GlobalArenaDeallocateAlignUp).
func TestArenaGlobalFreesCoalesce(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, sim := arenaSim(t, 4*mb, nil)
	base := arenaBase(t, sim)
	p := arenaAlloc(t, a, mb+256, DefaultStream)
	q := arenaAlloc(t, a, mb+512, DefaultStream)
	require.NoError(t, a.Deallocate(p, mb+256, DefaultStream))
	require.NoError(t, a.Deallocate(q, mb+512, DefaultStream))
	require.Equal(t, base, arenaAlloc(t, a, 4*mb, DefaultStream))
	require.Zero(t, a.Stats().Defragmentations)
	arenaCheck(t, a)
}

func TestArenaStreamArenaMerges(t *testing.T) {
	for name, c := range map[string]struct {
		allocs int
		free   []int
		want   int // a request that must land at the base
	}{
		"previous":          {3, []int{0, 1}, 512},
		"next":              {3, []int{1, 0}, 512},
		"previous and next": {2, []int{0, 1}, 2048},
	} {
		t.Run(name, func(t *testing.T) {
			a, sim := arenaSim(t, 4*arenaMinSuperblockSize, nil)
			base := arenaBase(t, sim)
			s := mustStream(t)
			var ps []DevicePtr
			for i := 0; i < c.allocs; i++ {
				ps = append(ps, arenaAlloc(t, a, 256, s))
			}
			for _, i := range c.free {
				require.NoError(t, a.Deallocate(ps[i], 256, s))
				arenaCheck(t, a)
			}
			require.Equal(t, base, arenaAlloc(t, a, c.want, s))
		})
	}
	// A whole 1 MiB block freed and reused.
	a, sim := arenaSim(t, 4*arenaMinSuperblockSize, nil)
	base := arenaBase(t, sim)
	s := mustStream(t)
	p := arenaAlloc(t, a, arenaMinSuperblockSize, s)
	require.NoError(t, a.Deallocate(p, arenaMinSuperblockSize, s))
	q := arenaAlloc(t, a, 256, s)
	require.NoError(t, a.Deallocate(q, 256, s))
	require.Equal(t, base, arenaAlloc(t, a, arenaMinSuperblockSize, s))
}

// librmm's ArenaDefragment: four 1 MiB blocks in one stream's arena, freed; the whole arena is
// then served only after the empty superblocks go back to the global arena.
func TestArenaDefragmentEmptySuperblocks(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, sim := arenaSim(t, 4*mb, nil)
	base := arenaBase(t, sim)
	s := mustStream(t)
	var ps []DevicePtr
	for i := 0; i < 4; i++ {
		ps = append(ps, arenaAlloc(t, a, mb, s))
	}
	for _, p := range ps {
		require.NoError(t, a.Deallocate(p, mb, s))
	}
	st := a.Stats()
	require.Equal(t, 4, st.EmptySuperblocks, "empty superblocks stay in the stream's arena")
	require.Zero(t, st.GlobalSuperblocks)
	require.Equal(t, base, arenaAlloc(t, a, 4*mb, DefaultStream))
	st = a.Stats()
	require.Equal(t, 1, st.Defragmentations)
	require.Equal(t, 1, st.Superblocks)
	arenaCheck(t, a)
}

// A 1 MiB arena (the minimum) is one superblock: a 1 MiB request takes it whole.
func TestArenaMinimumSize(t *testing.T) {
	a, sim := arenaSim(t, arenaMinSuperblockSize, nil)
	base := arenaBase(t, sim)
	p := arenaAlloc(t, a, arenaMinSuperblockSize, DefaultStream)
	require.Equal(t, base, p)
	_, err := a.Allocate(256, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.NoError(t, a.Deallocate(p, arenaMinSuperblockSize, DefaultStream))
	p = arenaAlloc(t, a, 256, DefaultStream)
	require.Equal(t, base, p)
	arenaCheck(t, a)
}

// librmm's SmallMediumLarge: 256 B, 64 MiB and a third of the free bytes, over real host memory
// (with patterns written in every byte) and over the address-only upstream at the default size.
func TestArenaSmallMediumLarge(t *testing.T) {
	run := func(t *testing.T, a *ArenaMemoryResource, host bool) {
		small := arenaAlloc(t, a, 256, DefaultStream)
		medium := arenaAlloc(t, a, 64<<20, DefaultStream)
		free := a.Stats().FreeBytes
		large := arenaAlloc(t, a, free/3, DefaultStream)
		arenaCheck(t, a)
		st := a.Stats()
		require.Equal(t, 3, st.LiveAllocations)
		require.Equal(t, 256+64<<20+roundUp(free/3), st.LiveBytes)
		if host {
			spans := []struct {
				p DevicePtr
				n int
				v byte
			}{{small, 256, 1}, {medium, 64 << 20, 2}, {large, free / 3, 3}}
			for _, s := range spans {
				b := hostBytes(s.p, s.n)
				for i := range b {
					b[i] = s.v
				}
			}
			for _, s := range spans {
				b := hostBytes(s.p, s.n)
				for i := 0; i < s.n; i += 4093 {
					require.Equal(t, s.v, b[i])
				}
				require.Equal(t, s.v, b[s.n-1])
			}
		}
		require.NoError(t, a.Deallocate(small, 256, DefaultStream))
		require.NoError(t, a.Deallocate(medium, 64<<20, DefaultStream))
		require.NoError(t, a.Deallocate(large, free/3, DefaultStream))
		require.NoError(t, a.Release())
		st = a.Stats()
		require.Zero(t, st.LiveBytes)
		require.Equal(t, st.ArenaSize, st.FreeBytes)
		require.Equal(t, st.ArenaSize, st.LargestFreeBlock)
		arenaCheck(t, a)
	}
	t.Run("system", func(t *testing.T) {
		a, err := NewArenaMemoryResource(NewSystemMemoryResource(), &ArenaOptions{ArenaSize: 256 << 20})
		require.NoError(t, err)
		defer func() { require.NoError(t, a.Close()) }()
		run(t, a, true)
	})
	t.Run("simulated default size", func(t *testing.T) {
		a, err := NewArenaMemoryResource(arenaMustSim(t, 1<<60), nil)
		require.NoError(t, err)
		defer a.Close()
		if a.ArenaSize() < 256<<20 {
			t.Skipf("only %d bytes free", a.ArenaSize()*2)
		}
		run(t, a, false)
	})
}

// librmm's Defragment, with its numbers: a 4 MiB arena; 4 goroutines, each on its own Stream,
// allocate and free 32 KiB; each stream's arena keeps a 1 MiB superblock, so allocating the
// whole arena must defragment, and then succeeds.
func TestArenaDefragmentAcrossStreams(t *testing.T) {
	const arenaSize = 4 * arenaMinSuperblockSize
	a, sim := arenaSim(t, arenaSize, nil)
	base := arenaBase(t, sim)
	streams := make([]StreamView, 4)
	for i := range streams {
		streams[i] = mustStream(t) // open until the end: their arenas keep their superblocks
	}
	var wg sync.WaitGroup
	for _, s := range streams {
		wg.Go(func() {
			p, err := a.Allocate(32<<10, s)
			if err == nil {
				err = a.Deallocate(p, 32<<10, s)
			}
			if err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	st := a.Stats()
	require.Equal(t, 4, st.StreamArenas)
	require.Equal(t, 4, st.EmptySuperblocks)
	require.Zero(t, st.GlobalSuperblocks)
	p, err := a.Allocate(arenaSize, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, base, p)
	require.Equal(t, 1, a.Stats().Defragmentations)
	require.NoError(t, a.Deallocate(p, arenaSize, DefaultStream))
	arenaCheck(t, a)
}

// The same with the streams closed before the big request: closing a Stream hands its
// superblocks back, so no defragmentation is needed.
func TestArenaStreamCloseReturnsSuperblocks(t *testing.T) {
	const arenaSize = 4 * arenaMinSuperblockSize
	a, sim := arenaSim(t, arenaSize, nil)
	base := arenaBase(t, sim)
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Go(func() {
			s, err := NewStream(CurrentDevice(), nil)
			if err != nil {
				t.Error(err)
				return
			}
			defer s.Close()
			p, err := a.Allocate(32<<10, s.View())
			if err == nil {
				err = a.Deallocate(p, 32<<10, s.View())
			}
			if err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	st := a.Stats()
	require.Zero(t, st.StreamArenas, "closed streams' arenas are dropped")
	require.Equal(t, 1, st.Superblocks, "their superblocks merged back in the global arena")
	require.Equal(t, base, arenaAlloc(t, a, arenaSize, DefaultStream))
	require.Zero(t, a.Stats().Defragmentations)
	arenaCheck(t, a)

	// A closed Stream cannot allocate; freeing on it still works.
	s, err := NewStream(CurrentDevice(), nil)
	require.NoError(t, err)
	require.NoError(t, a.Deallocate(base, arenaSize, DefaultStream))
	p := arenaAlloc(t, a, 4096, s.View())
	require.NoError(t, s.Close())
	_, err = a.Allocate(256, s.View())
	require.ErrorIs(t, err, ErrClosed)
	_, err = a.Allocate(2*arenaMinSuperblockSize, s.View())
	require.ErrorIs(t, err, ErrClosed, "large requests too")
	require.NoError(t, a.Deallocate(p, 4096, s.View()))
	arenaCheck(t, a)
}

// The brief's exhaustion variant: 4 goroutines on their own Streams allocate 32 KiB until the
// 4 MiB arena refuses; whatever they got, a fifth stream then gets exactly the rest (the arena
// serves every free 32 KiB after defragmenting); everything is freed and the whole arena is
// allocated in one piece.
func TestArenaDefragmentAfterExhaustion(t *testing.T) {
	const arenaSize = 4 * arenaMinSuperblockSize
	const n = 32 << 10
	a, sim := arenaSim(t, arenaSize, nil)
	base := arenaBase(t, sim)
	type held struct {
		s  StreamView
		ps []DevicePtr
	}
	hs := make([]*held, 5)
	for i := range hs {
		hs[i] = &held{s: mustStream(t)}
	}
	var wg sync.WaitGroup
	for _, h := range hs[:4] {
		wg.Go(func() {
			for {
				p, err := a.Allocate(n, h.s)
				if errors.Is(err, ErrOutOfMemory) {
					return
				}
				if err != nil {
					t.Error(err)
					return
				}
				h.ps = append(h.ps, p)
			}
		})
	}
	wg.Wait()
	got := 0
	for _, h := range hs[:4] {
		got += len(h.ps)
	}
	require.LessOrEqual(t, got, arenaSize/n)
	for {
		p, err := a.Allocate(n, hs[4].s)
		if err != nil {
			require.ErrorIs(t, err, ErrOutOfMemory)
			break
		}
		hs[4].ps = append(hs[4].ps, p)
	}
	require.Equal(t, arenaSize/n, got+len(hs[4].ps), "every 32 KiB of the arena was handed out")
	st := a.Stats()
	require.Equal(t, arenaSize, st.LiveBytes)
	require.Zero(t, st.FreeBytes)
	arenaCheck(t, a)
	for _, h := range hs {
		for _, p := range h.ps {
			require.NoError(t, a.Deallocate(p, n, h.s))
		}
	}
	arenaCheck(t, a)
	p, err := a.Allocate(arenaSize, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, base, p)
	require.NoError(t, a.Deallocate(p, arenaSize, DefaultStream))
	arenaCheck(t, a)
}

// librmm's PerThreadToStreamDealloc: a block allocated on the default stream whose superblock
// went to the global arena (defragmentation) and then to another stream's arena is still freed
// correctly on the default stream.
func TestArenaFreeAfterSuperblockMoved(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, _ := arenaSim(t, 2*mb, nil)
	threadPtr := arenaAlloc(t, a, 256, DefaultStream)
	s := mustStream(t)
	p := arenaAlloc(t, a, 32<<10, s)
	require.NoError(t, a.Deallocate(p, 32<<10, s))
	require.Zero(t, a.Stats().GlobalSuperblocks, "the global arena is empty")
	b := mustStream(t)
	p1 := arenaAlloc(t, a, mb, b)
	require.Equal(t, 1, a.Stats().Defragmentations)
	p2 := arenaAlloc(t, a, 32<<10, b)
	st := a.Stats()
	require.Zero(t, st.GlobalSuperblocks)
	require.Equal(t, 2, st.Superblocks)
	// Both superblocks are in b's arena now, threadPtr's included.
	v, _ := a.streams.Load(b.id)
	require.Equal(t, 2, v.(*arenaSet).tree.count)
	require.NoError(t, a.Deallocate(threadPtr, 256, DefaultStream))
	require.NoError(t, a.Deallocate(p1, mb, b))
	require.NoError(t, a.Deallocate(p2, 32<<10, b))
	require.Zero(t, a.Stats().LiveAllocations)
	arenaCheck(t, a)
}

// Frees on another stream than the allocation's land in the superblock's arena, wherever it is.
func TestArenaCrossStreamFree(t *testing.T) {
	a, _ := arenaSim(t, 8*arenaMinSuperblockSize, &ArenaOptions{DefaultStreamArenas: 3})
	s1, s2 := mustStream(t), mustStream(t)
	p := arenaAlloc(t, a, 1000, s1)
	q := arenaAlloc(t, a, 2*arenaMinSuperblockSize, s1)
	r := arenaAlloc(t, a, 300, DefaultStream)
	require.NoError(t, a.Deallocate(p, 1000, s2))
	require.NoError(t, a.Deallocate(q, 2*arenaMinSuperblockSize, DefaultStream))
	require.NoError(t, a.Deallocate(r, 300, s1))
	st := a.Stats()
	require.Zero(t, st.LiveAllocations)
	require.Equal(t, st.ArenaSize, st.FreeBytes)
	arenaCheck(t, a)
}

// Arenas of foreign streams (views of handles made elsewhere) are dropped when the arena
// defragments, and made again on their next use.
func TestArenaForeignStreamArenaDropped(t *testing.T) {
	a, _ := arenaSim(t, 2*arenaMinSuperblockSize, nil)
	foreign := StreamView{h: 0x1234, id: foreignStreamBit | 77}
	require.False(t, foreign.lifetimeKnown())
	p := arenaAlloc(t, a, 4096, foreign)
	require.NoError(t, a.Deallocate(p, 4096, foreign))
	require.Equal(t, 1, a.Stats().StreamArenas)
	require.NoError(t, a.Release())
	st := a.Stats()
	require.Zero(t, st.StreamArenas)
	require.Equal(t, 1, st.Superblocks)
	p = arenaAlloc(t, a, 4096, foreign)
	require.Equal(t, 1, a.Stats().StreamArenas)
	require.NoError(t, a.Deallocate(p, 4096, foreign))
	arenaCheck(t, a)
}

func TestArenaInvalidFree(t *testing.T) {
	a, sim := arenaSim(t, 4*arenaMinSuperblockSize, nil)
	base := arenaBase(t, sim)
	s := mustStream(t)
	p := arenaAlloc(t, a, 1000, s)
	q := arenaAlloc(t, a, 3<<20, DefaultStream)
	before := a.Stats()
	for name, f := range map[string]func() error{
		"interior":          func() error { return a.Deallocate(p+256, 1000, s) },
		"never handed out":  func() error { return a.Deallocate(base+3<<20+4096, 256, s) },
		"outside the arena": func() error { return a.Deallocate(0xdead00, 256, s) },
		"wrong size":        func() error { return a.Deallocate(p, 999, s) },
		"rounded size":      func() error { return a.Deallocate(p, 1024, s) },
		"negative size":     func() error { return a.Deallocate(p, -1, s) },
		"large wrong size":  func() error { return a.Deallocate(q, 3<<20+1, DefaultStream) },
	} {
		require.ErrorIs(t, f(), ErrInvalidFree, name)
		require.Equal(t, before, a.Stats(), "%s changed nothing", name)
		arenaCheck(t, a)
	}
	require.NoError(t, a.Deallocate(p, 1000, s))
	err := a.Deallocate(p, 1000, s)
	require.ErrorIs(t, err, ErrInvalidFree, "double free")
	require.Contains(t, err.Error(), "already freed")
	require.NoError(t, a.Deallocate(q, 3<<20, DefaultStream))
	require.ErrorIs(t, a.Deallocate(q, 3<<20, DefaultStream), ErrInvalidFree, "double free of a large block")
	require.Zero(t, a.Stats().LiveAllocations)
	arenaCheck(t, a)
}

func TestArenaZeroNegativeAndHuge(t *testing.T) {
	a, sim := arenaSim(t, 4*arenaMinSuperblockSize, nil)
	p, err := a.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, p)
	require.NoError(t, a.Deallocate(0, 0, DefaultStream))
	_, err = a.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	used := sim.UsedBytes()
	_, err = a.Allocate(1<<50, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Contains(t, err.Error(), "1125899906842624")
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	require.Equal(t, OutOfMemoryError{Resource: "ArenaMemoryResource", Requested: 1 << 50, PoolSize: 4194304,
		FreeBytes: 4194304, LargestFreeBlock: 4194304, MaximumSize: 4194304, TooLarge: true,
		Detail: "the request is larger than the arena (4194304 bytes)"}, *oom)
	_, err = a.Allocate(int(^uint(0)>>1), DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory, "a size that overflows when rounded")
	require.ErrorAs(t, err, &oom)
	require.False(t, oom.Fragmented)
	require.Zero(t, a.Stats().Defragmentations, "hopeless requests do not defragment")
	require.Equal(t, used, sim.UsedBytes(), "the arena never grows")
	arenaAlloc(t, a, 4096, DefaultStream)
}

// The out-of-memory error says what was asked and what is left.
func TestArenaOutOfMemoryMessage(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, _ := arenaSim(t, 2*mb, nil)
	s := mustStream(t)
	p := arenaAlloc(t, a, mb/2, s)
	_, err := a.Allocate(2*mb, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	msg := err.Error()
	for _, want := range []string{"2097152 bytes", "pool size 2097152 (2 MiB), maximum 2097152 (2 MiB)", fmt.Sprintf("exhausted: %d bytes (1.5 MiB) free", 2*mb-mb/2), fmt.Sprintf("largest free block %d bytes (1 MiB)", mb), "no room in arena"} {
		require.Contains(t, msg, want)
	}
	require.Equal(t, 1, a.Stats().Defragmentations)
	require.NoError(t, a.Deallocate(p, mb/2, s))
	arenaAlloc(t, a, 2*mb, DefaultStream)
}

// arenaDumpRecords parses the dump file: one map of key=value per line.
func arenaDumpRecords(t *testing.T, path string) []map[string]string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var out []map[string]string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		m := map[string]string{}
		line := sc.Text()
		for len(line) > 0 {
			k, rest, ok := strings.Cut(line, "=")
			require.True(t, ok, "line %q", sc.Text())
			var v string
			if strings.HasPrefix(rest, `"`) {
				end := strings.Index(rest[1:], `"`) + 1
				v, rest = rest[1:end], rest[end+1:]
			} else {
				v, rest, _ = strings.Cut(rest, " ")
			}
			m[k] = v
			line = strings.TrimPrefix(rest, " ")
		}
		out = append(out, m)
	}
	require.NoError(t, sc.Err())
	return out
}

// librmm's DumpLogOnFailure: a failed allocation writes the dump, with the documented fields.
func TestArenaDumpLogOnFailure(t *testing.T) {
	const mb = arenaMinSuperblockSize
	t.Run("default file", func(t *testing.T) {
		t.Chdir(t.TempDir())
		a, _ := arenaSim(t, mb, &ArenaOptions{DumpLogOnFailure: true, DefaultStreamArenas: 1})
		var wg sync.WaitGroup
		for i := 0; i < 4; i++ { // make the log interesting
			wg.Go(func() {
				p, err := a.Allocate(32<<10, DefaultStream)
				if err == nil {
					err = a.Deallocate(p, 32<<10, DefaultStream)
				}
				if err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		_, err := os.Stat(arenaDumpLogFile)
		require.ErrorIs(t, err, os.ErrNotExist, "no dump before a failure")
		_, err = a.Allocate(8<<20, DefaultStream)
		require.ErrorIs(t, err, ErrOutOfMemory)
		recs := arenaDumpRecords(t, arenaDumpLogFile)
		require.Len(t, recs, 3)
		require.Equal(t, "INFO", recs[0]["level"])
		require.Equal(t, "8388608", recs[0]["requested_bytes"])
		require.Equal(t, "INFO", recs[1]["level"])
		require.Equal(t, "1048576", recs[1]["arena_size"])
		require.Equal(t, "1", recs[1]["superblocks"])
		require.Equal(t, "1048576", recs[1]["total_free"])
		require.Equal(t, "1048576", recs[1]["largest_free"])
		require.Equal(t, "0.00", recs[1]["fragmentation_percent"])
		require.Equal(t, "DEBUG", recs[2]["level"])
		require.Equal(t, "superblock", recs[2]["msg"])
		require.Equal(t, "true", recs[2]["empty"])
		require.Equal(t, "1048576", recs[2]["size"])
		require.Equal(t, "0", recs[2]["gap"])
	})
	t.Run("fragmented, own path", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "dump.log")
		a, sim := arenaSim(t, 2*mb, &ArenaOptions{DumpLogOnFailure: true, DumpLogPath: path})
		base := uintptr(arenaBase(t, sim))
		s := mustStream(t)
		var ps []DevicePtr
		for i := 0; i < 4; i++ {
			ps = append(ps, arenaAlloc(t, a, mb/4, s))
		}
		require.NoError(t, a.Deallocate(ps[1], mb/4, s))
		require.NoError(t, a.Deallocate(ps[3], mb/4, s))
		// Free: 2 × 256 KiB in the first superblock, 1 MiB in the second.
		_, err := a.Allocate(mb+mb/2, DefaultStream)
		require.ErrorIs(t, err, ErrOutOfMemory)
		recs := arenaDumpRecords(t, path)
		require.Len(t, recs, 4)
		require.Equal(t, "1572864", recs[0]["requested_bytes"])
		require.Equal(t, "2", recs[1]["superblocks"])
		require.Equal(t, "1572864", recs[1]["total_free"])
		require.Equal(t, "1048576", recs[1]["largest_free"])
		require.Equal(t, "33.33", recs[1]["fragmentation_percent"], "(1 - 1 MiB / 1.5 MiB) × 100")
		require.Equal(t, fmt.Sprintf("%#x", base), recs[2]["start"])
		require.Equal(t, fmt.Sprintf("%#x", base+mb), recs[2]["end"])
		require.Equal(t, "false", recs[2]["empty"])
		require.Equal(t, "2", recs[2]["free_blocks"])
		require.Equal(t, "262144", recs[2]["max_free"])
		require.Equal(t, "global", recs[2]["owner"], "defragmented before the dump")
		require.Equal(t, "true", recs[3]["empty"])
		require.Equal(t, "1048576", recs[3]["max_free"])
		// A second failure is appended.
		_, err = a.Allocate(mb+mb/2, DefaultStream)
		require.ErrorIs(t, err, ErrOutOfMemory)
		require.Len(t, arenaDumpRecords(t, path), 8)
	})
	t.Run("disabled", func(t *testing.T) {
		t.Chdir(t.TempDir())
		a, _ := arenaSim(t, mb, nil)
		_, err := a.Allocate(2*mb, DefaultStream)
		require.ErrorIs(t, err, ErrOutOfMemory)
		_, err = os.Stat(arenaDumpLogFile)
		require.ErrorIs(t, err, os.ErrNotExist)
	})
}

func TestArenaStats(t *testing.T) {
	const mb = arenaMinSuperblockSize
	a, _ := arenaSim(t, 8*mb, nil)
	st := a.Stats()
	require.Equal(t, ArenaStats{ArenaSize: 8 * mb, PoolSize: 8 * mb, MaximumSize: 8 * mb, FreeBytes: 8 * mb, FreeBlocks: 1, LargestFreeBlock: 8 * mb,
		Superblocks: 1, GlobalSuperblocks: 1, EmptySuperblocks: 1, GlobalFreeBlocks: 1, GlobalFreeBytes: 8 * mb,
		PerStream: []StreamFreeStats{{Stream: DefaultStream}}}, st)
	s := mustStream(t)
	p := arenaAlloc(t, a, 100, s)
	q := arenaAlloc(t, a, 3*mb, DefaultStream)
	st = a.Stats()
	require.Equal(t, ArenaStats{
		ArenaSize: 8 * mb, PoolSize: 8 * mb, MaximumSize: 8 * mb, LiveBytes: 256 + 3*mb, LiveAllocations: 2, FreeBytes: 8*mb - 256 - 3*mb,
		FreeBlocks: 2, LargestFreeBlock: 4 * mb, Superblocks: 3, GlobalSuperblocks: 2, EmptySuperblocks: 1,
		StreamArenas: 1, Fragmentation: (1 - float64(4*mb)/float64(8*mb-256-3*mb)) * 100,
		GlobalFreeBlocks: 1, GlobalFreeBytes: 4 * mb,
		PerStream: []StreamFreeStats{{Stream: DefaultStream}, {Stream: s, FreeBlocks: 1, FreeBytes: mb - 256}},
	}, st)
	require.NoError(t, a.Deallocate(p, 100, s))
	require.NoError(t, a.Deallocate(q, 3*mb, DefaultStream))
	arenaCheck(t, a)
}

func TestArenaClose(t *testing.T) {
	a, sim := arenaSim(t, 4*arenaMinSuperblockSize, nil)
	s := mustStream(t)
	p := arenaAlloc(t, a, 4096, s)
	q := arenaAlloc(t, a, 2<<20, DefaultStream)
	require.NoError(t, a.Close())
	_, err := a.Allocate(256, s)
	require.ErrorIs(t, err, ErrClosed)
	_, err = a.Allocate(2<<20, DefaultStream)
	require.ErrorIs(t, err, ErrClosed)
	require.Equal(t, 4<<20, sim.UsedBytes(), "held while allocations live")
	require.NoError(t, a.Deallocate(p, 4096, s))
	require.Equal(t, 4<<20, sim.UsedBytes())
	require.ErrorIs(t, a.Deallocate(p, 4096, s), ErrInvalidFree)
	require.NoError(t, a.Deallocate(q, 2<<20, DefaultStream))
	require.Zero(t, sim.UsedBytes(), "the last free returns the arena")
	require.NoError(t, a.Close())
	require.NoError(t, a.Release())
}

// Eight goroutines allocate and free on their own streams, on shared streams and on the
// default stream, sometimes freeing on another stream, with small and large sizes, while a ninth
// checks the invariants; over host memory every block holds its owner's pattern until freed.
func TestArenaConcurrent(t *testing.T) {
	for _, c := range []struct {
		name string
		up   func() MemoryResource
		size int
		host bool
	}{
		{"simulated", func() MemoryResource { return arenaMustSim(t, 1<<40) }, 256 << 20, false},
		{"system", func() MemoryResource { return NewSystemMemoryResource() }, 64 << 20, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, err := NewArenaMemoryResource(c.up(), &ArenaOptions{ArenaSize: c.size, DefaultStreamArenas: 4})
			require.NoError(t, err)
			defer func() { require.NoError(t, a.Close()) }()
			arenaConcurrent(t, a, c.host)
		})
	}
}

func arenaConcurrent(t *testing.T, a *ArenaMemoryResource, host bool) {
	const goroutines, ops = 8, 1500
	own := make([]StreamView, goroutines)
	for i := range own {
		own[i] = mustStream(t)
	}
	shared := []StreamView{DefaultStream, mustStream(t), mustStream(t)}
	var shadow liveSet
	var crossFrees, ooms atomic.Int64
	done := make(chan struct{})
	checker := make(chan error, 1)
	go func() {
		var first error
		for {
			select {
			case <-done:
				checker <- first
				return
			default:
			}
			if first == nil {
				if err := a.CheckInvariants(); err != nil {
					first = err
				}
			}
			runtime.Gosched()
		}
	}()
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 99))
			type alloc struct {
				p    DevicePtr
				n    int
				s    StreamView
				fill byte
			}
			var mine []alloc
			pick := func() StreamView {
				if r.IntN(2) == 0 {
					return own[g]
				}
				return shared[r.IntN(len(shared))]
			}
			free := func(i int) bool {
				x := mine[i]
				mine = slices.Delete(mine, i, i+1)
				if host {
					b := hostBytes(x.p, x.n)
					for k := 0; k < x.n; k += 251 {
						if b[k] != x.fill {
							t.Errorf("goroutine %d: byte %d of %#x changed to %#x", g, k, uintptr(x.p), b[k])
							return false
						}
					}
				}
				s := x.s
				if r.IntN(5) == 0 {
					s = pick()
					crossFrees.Add(1)
				}
				shadow.remove(x.p)
				if err := a.Deallocate(x.p, x.n, s); err != nil {
					t.Errorf("goroutine %d: Deallocate: %v", g, err)
					return false
				}
				return true
			}
			for k := 0; k < ops; k++ {
				if len(mine) == 0 || (len(mine) < 48 && r.IntN(100) < 55) {
					var n int
					switch v := r.IntN(100); {
					case v < 50:
						n = 1 + r.IntN(2048)
					case v < 90:
						n = 1 + r.IntN(256<<10)
					default:
						n = arenaMinSuperblockSize + 1 + r.IntN(3<<20)
					}
					s := pick()
					p, err := a.Allocate(n, s)
					if errors.Is(err, ErrOutOfMemory) {
						ooms.Add(1)
						if len(mine) > 0 && !free(r.IntN(len(mine))) {
							return
						}
						continue
					}
					if err != nil {
						t.Errorf("goroutine %d: Allocate(%d): %v", g, n, err)
						return
					}
					if err := shadow.add(p, roundUp(n)); err != nil {
						t.Errorf("goroutine %d: %v", g, err)
						return
					}
					fill := byte(g*31 + k)
					if host {
						b := hostBytes(p, n)
						for i := range b {
							b[i] = fill
						}
					}
					mine = append(mine, alloc{p, n, s, fill})
				} else if !free(r.IntN(len(mine))) {
					return
				}
			}
			for len(mine) > 0 {
				if !free(len(mine) - 1) {
					return
				}
			}
		})
	}
	wg.Wait()
	close(done)
	require.NoError(t, <-checker)
	require.False(t, t.Failed())
	require.Positive(t, crossFrees.Load())
	t.Logf("%d cross-stream frees, %d out-of-memory answers, %d defragmentations", crossFrees.Load(), ooms.Load(), a.Stats().Defragmentations)
	arenaCheck(t, a)
	require.NoError(t, a.Release())
	st := a.Stats()
	require.Zero(t, st.LiveAllocations)
	require.Equal(t, st.ArenaSize, st.FreeBytes)
	require.Equal(t, st.ArenaSize, st.LargestFreeBlock, "everything coalesced into one superblock")
	require.Equal(t, 1, st.Superblocks)
}

// arenaBase returns the address of the only live allocation of a simulated upstream (the arena).
func arenaBase(t *testing.T, sim *SimulatedMemoryResource) DevicePtr {
	t.Helper()
	sim.mu.Lock()
	live := make([]DevicePtr, 0, len(sim.live))
	for p := range sim.live {
		live = append(live, p)
	}
	sim.mu.Unlock()
	require.Len(t, live, 1)
	return live[0]
}

// The superblock index against a sorted-slice model: insertions and removals in any order (so
// that nodes split, empty and the root grows and shrinks), changes of a superblock's largest free
// block, first fit and the address order, after every step.
func TestArenaIndexAgainstModel(t *testing.T) {
	const mb = arenaMinSuperblockSize
	r := rand.New(rand.NewPCG(5, 9))
	var index arenaIndex
	var model []*arenaSuperblock // sorted by address
	carved := map[*arenaSuperblock][]DevicePtr{}
	slots := make([]bool, 600)
	deep := false // the index reached three levels
	for step := 0; step < 6000; step++ {
		switch k := r.IntN(len(slots)); {
		case !slots[k] && (r.IntN(3) > 0 || step < 1500):
			sb := newArenaSuperblock(DevicePtr(k+1)*mb, mb)
			index.insert(sb)
			i, _ := slices.BinarySearchFunc(model, sb.addr(), func(x *arenaSuperblock, a DevicePtr) int { return int(x.addr()) - int(a) })
			model = slices.Insert(model, i, sb)
			slots[k] = true
		case len(model) > 0 && r.IntN(2) == 0:
			i := r.IntN(len(model))
			index.remove(model[i])
			slots[model[i].addr()/mb-1] = false
			model = slices.Delete(model, i, i+1)
		case len(model) > 0:
			sb := model[r.IntN(len(model))]
			if ps := carved[sb]; len(ps) > 0 && r.IntN(2) == 0 {
				sb.coalesce(ps[len(ps)-1], 64<<10)
				carved[sb] = ps[:len(ps)-1]
			} else if p, ok := sb.firstFit(64 << 10); ok {
				carved[sb] = append(ps, p)
			}
			index.fix(sb)
		}
		require.NoError(t, index.check(), "step %d", step)
		require.Equal(t, len(model), index.count)
		if x := index.root; x != nil && !x.leaf && !x.kids[0].leaf {
			deep = true
		}
		w := (r.IntN(16) + 1) * 64 << 10
		var want *arenaSuperblock
		for _, sb := range model {
			if sb.maxFree() >= w {
				want = sb
				break
			}
		}
		require.Same(t, want, index.firstFit(w), "firstFit(%d) at step %d", w, step)
	}
	require.True(t, deep)
	var got []*arenaSuperblock
	index.each(func(x *arenaNode) { got = append(got, x.sb) })
	require.Equal(t, model, got)
	for len(model) > 0 {
		index.remove(model[0])
		model = model[1:]
		require.NoError(t, index.check())
	}
	require.Nil(t, index.root)
}

// One goroutine allocating on DefaultStream keeps one default-stream shard across garbage
// collections (which empty the per-processor hints) and however many processors there are: its
// memory is not spread over every shard.
func TestArenaDefaultStreamOneGoroutineOneShard(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(16))
	sim, err := NewSimulatedMemoryResource(1 << 34)
	require.NoError(t, err)
	a, err := NewArenaMemoryResource(sim, &ArenaOptions{ArenaSize: 1 << 32, DefaultStreamArenas: 16})
	require.NoError(t, err)
	defer a.Close()
	var ptrs []DevicePtr
	for i := 0; i < 200; i++ {
		p, err := a.Allocate(768<<10, DefaultStream) // one superblock each
		require.NoError(t, err)
		ptrs = append(ptrs, p)
		if i%10 == 0 {
			runtime.GC()
			runtime.Gosched()
		}
	}
	used := 0
	for i := range a.shards {
		if a.shards[i].tree.count > 0 {
			used++
			assert.Equal(t, 200, a.shards[i].tree.count, "shard %d", i)
		}
	}
	assert.Equal(t, 1, used, "default-stream shards holding superblocks")
	for _, p := range ptrs {
		require.NoError(t, a.Deallocate(p, 768<<10, DefaultStream))
	}
}
