package rmm

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Attacks on the default-stream shards of ArenaMemoryResource (lockShard, its per-processor
// hints and the shared start value settled): garbage-collection storms and GOMAXPROCS changes
// while many goroutines allocate and free on DefaultStream, frees on another goroutine, Stats,
// CheckInvariants, Release and Close running meanwhile, and shard counts of 1, 2 and 65536.

// brkShardOverlap records, per 256-byte granule of an arena, which allocation holds it, so that a
// block handed out twice (two live allocations sharing a byte) is seen at once.
type brkShardOverlap struct {
	base  DevicePtr
	owner []atomic.Uint32
	next  atomic.Uint32
}

func brkShardNewOverlap(a *ArenaMemoryResource) *brkShardOverlap {
	return &brkShardOverlap{base: a.base, owner: make([]atomic.Uint32, a.size/Alignment)}
}

// claim marks [p, p+n) as held by a new allocation and returns its tag; it fails when a granule
// is already held or lies outside the arena.
func (o *brkShardOverlap) claim(p DevicePtr, n int) (uint32, error) {
	tag := o.next.Add(1)
	if p < o.base || int(p-o.base)+n > len(o.owner)*Alignment || (p-o.base)%Alignment != 0 {
		return 0, fmt.Errorf("block %#x of %d bytes lies outside the arena or off the 256-byte grid", uintptr(p), n)
	}
	first := int(p-o.base) / Alignment
	for g := first; g < first+(n+Alignment-1)/Alignment; g++ {
		if !o.owner[g].CompareAndSwap(0, tag) {
			return 0, fmt.Errorf("block %#x of %d bytes overlaps a live allocation at %#x", uintptr(p), n, uintptr(o.base)+uintptr(g*Alignment))
		}
	}
	return tag, nil
}

// release unmarks [p, p+n), which tag must hold; it runs before the block is freed.
func (o *brkShardOverlap) release(p DevicePtr, n int, tag uint32) error {
	first := int(p-o.base) / Alignment
	for g := first; g < first+(n+Alignment-1)/Alignment; g++ {
		if !o.owner[g].CompareAndSwap(tag, 0) {
			return fmt.Errorf("block %#x of %d bytes: granule %#x changed hands while live", uintptr(p), n, uintptr(o.base)+uintptr(g*Alignment))
		}
	}
	return nil
}

type brkShardBlock struct {
	p   DevicePtr
	n   int
	tag uint32
}

// brkShardSize picks a request size: mostly small, some up to 1 MiB (the largest small
// request), a few large ones served by the global arena.
func brkShardSize(r *rand.Rand) int {
	switch k := r.IntN(100); {
	case k < 70:
		return 1 + r.IntN(4096)
	case k < 94:
		return 1 + r.IntN(64<<10)
	case k < 97:
		return arenaMinSuperblockSize - r.IntN(2)*r.IntN(1<<19)
	default:
		return arenaMinSuperblockSize + 1 + r.IntN(2<<20)
	}
}

// brkShardShardOf returns the index of the default-stream shard holding the small live block p,
// or -1 when the block's superblock is elsewhere.
func brkShardShardOf(a *ArenaMemoryResource, p DevicePtr) int {
	// The block is in the own table of the arena that allocated it, which its range's hint
	// names; that arena is not held by the caller (TryLock: a held one answers -1).
	if o := a.hint(p).Load(); o != nil && o.mu.TryLock() {
		defer o.mu.Unlock()
		if i := o.live.m.find(p); i >= 0 && o.kind == arenaShardKind && o.live.m.slots[i].v.sb.owner.Load() == o {
			return o.index
		}
		return -1
	}
	ls := a.liveShard(p)
	ls.mu.Lock()
	defer ls.mu.Unlock()
	i := ls.m.find(p)
	if i < 0 {
		return -1
	}
	o := ls.m.slots[i].v.sb.owner.Load()
	if o == nil || o.kind != arenaShardKind {
		return -1
	}
	return o.index
}

// brkShardUsed returns the number of default-stream shards holding superblocks.
func brkShardUsed(a *ArenaMemoryResource) int {
	_, unlock := a.lockArenas()
	defer unlock()
	used := 0
	for i := range a.shards {
		if a.shards[i].tree.count > 0 {
			used++
		}
	}
	return used
}

// brkShardCheckStats checks the figures of a Stats snapshot against each other.
func brkShardCheckStats(st ArenaStats) error {
	perStream := st.GlobalFreeBytes
	blocks := st.GlobalFreeBlocks
	for _, e := range st.PerStream {
		perStream += e.FreeBytes
		blocks += e.FreeBlocks
	}
	switch {
	case st.FreeBytes+st.LiveBytes != st.ArenaSize:
		return fmt.Errorf("free %d + live %d bytes != arena %d", st.FreeBytes, st.LiveBytes, st.ArenaSize)
	case perStream != st.FreeBytes || blocks != st.FreeBlocks:
		return fmt.Errorf("per-stream and global free figures (%d bytes, %d blocks) do not add up to %d bytes, %d blocks", perStream, blocks, st.FreeBytes, st.FreeBlocks)
	case st.LiveAllocations < 0 || st.LiveBytes < 0 || st.LiveBytes%Alignment != 0:
		return fmt.Errorf("live figures %d allocations, %d bytes", st.LiveAllocations, st.LiveBytes)
	case len(st.PerStream) == 0 || st.PerStream[0].Stream.ID() != DefaultStream.ID():
		return fmt.Errorf("the first per-stream entry is not DefaultStream")
	}
	return nil
}

type brkShardStormOpts struct {
	shards   int // DefaultStreamArenas
	workers  int
	ops      int  // per worker
	gc       bool // a goroutine calls runtime.GC in a loop
	procs    bool // a goroutine changes GOMAXPROCS in a loop
	observe  bool // a goroutine calls Stats, CheckInvariants and Release in a loop
	handoff  bool // some blocks are freed by another worker than the one that allocated them
	arenaMiB int
}

// brkShardStorm runs workers allocating and freeing on DefaultStream with the disturbances of
// o, checking every block against the live ones, then checks that everything is free again.
func brkShardStorm(t *testing.T, o brkShardStormOpts) {
	t.Helper()
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	sim, err := NewSimulatedMemoryResource(1 << 40)
	require.NoError(t, err)
	a, err := NewArenaMemoryResource(sim, &ArenaOptions{ArenaSize: o.arenaMiB << 20, DefaultStreamArenas: o.shards})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, a.Close())
		require.Zero(t, sim.UsedBytes(), "the arena went back to the upstream")
	})
	ov := brkShardNewOverlap(a)
	handoff := make(chan brkShardBlock, 4*o.workers)
	stop := make(chan struct{})
	var errMu sync.Mutex
	var errs []error
	fail := func(err error) {
		errMu.Lock()
		errs = append(errs, err)
		errMu.Unlock()
	}
	free := func(b brkShardBlock) {
		if err := ov.release(b.p, b.n, b.tag); err != nil {
			fail(err)
			return
		}
		if err := a.Deallocate(b.p, b.n, DefaultStream); err != nil {
			fail(err)
		}
	}
	var disturb sync.WaitGroup
	if o.gc {
		disturb.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				runtime.GC()
				runtime.Gosched()
			}
		})
	}
	if o.procs {
		disturb.Go(func() {
			ps := []int{1, 2, 3, 4, 8, 16, 32, 7}
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				runtime.GOMAXPROCS(ps[i%len(ps)])
				runtime.Gosched()
			}
		})
	}
	if o.observe {
		disturb.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if err := brkShardCheckStats(a.Stats()); err != nil {
					fail(fmt.Errorf("Stats while running: %w", err))
				}
				if err := a.CheckInvariants(); err != nil {
					fail(fmt.Errorf("CheckInvariants while running: %w", err))
				}
				if i%3 == 0 {
					if err := a.Release(); err != nil {
						fail(fmt.Errorf("Release while running: %w", err))
					}
				}
				runtime.Gosched()
			}
		})
	}
	var oom atomic.Int64
	var work sync.WaitGroup
	for w := range o.workers {
		work.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), uint64(o.shards)))
			var mine []brkShardBlock
			for range o.ops {
				if o.handoff {
					select {
					case b := <-handoff:
						free(b)
					default:
					}
				}
				if len(mine) < 24 && r.IntN(10) < 6 {
					n := brkShardSize(r)
					p, err := a.Allocate(n, DefaultStream)
					if err != nil {
						if errors.Is(err, ErrOutOfMemory) {
							oom.Add(1)
							continue
						}
						fail(err)
						return
					}
					tag, err := ov.claim(p, n)
					if err != nil {
						fail(err)
						return
					}
					mine = append(mine, brkShardBlock{p, n, tag})
					continue
				}
				if len(mine) == 0 {
					continue
				}
				k := r.IntN(len(mine))
				b := mine[k]
				mine[k] = mine[len(mine)-1]
				mine = mine[:len(mine)-1]
				if o.handoff && r.IntN(2) == 0 {
					select {
					case handoff <- b:
						continue
					default:
					}
				}
				free(b)
			}
			for _, b := range mine {
				free(b)
			}
		})
	}
	work.Wait()
	close(stop)
	disturb.Wait()
	close(handoff)
	for b := range handoff {
		free(b)
	}
	require.Empty(t, errs)
	t.Logf("%d out-of-memory failures", oom.Load())
	require.Less(t, oom.Load(), int64(o.workers*o.ops/10), "out-of-memory failures")
	require.NoError(t, a.CheckInvariants())
	st := a.Stats()
	require.NoError(t, brkShardCheckStats(st))
	require.Zero(t, st.LiveAllocations)
	require.Zero(t, st.LiveBytes)
	require.Equal(t, a.size, st.FreeBytes, "every byte is free again")
	require.NoError(t, a.Release())
	st = a.Stats()
	require.Equal(t, 1, st.Superblocks, "the empty arena coalesces into one superblock")
	require.Equal(t, 1, st.GlobalSuperblocks)
	require.Equal(t, a.size, st.LargestFreeBlock)
	require.Equal(t, a.size, st.GlobalFreeBytes)
	require.Zero(t, st.Fragmentation)
}

func brkShardOps(n int) int {
	if logRaceEnabled || testing.Short() {
		return n / 8
	}
	return n
}

// Many goroutines allocate and free on DefaultStream, handing some blocks to others to free,
// while garbage collections empty the hints, GOMAXPROCS changes, and Stats, CheckInvariants and
// Release run: no block is handed out twice, every figure adds up, and every byte is free again
// at the end, for 1, 2, the default and 65536 shards.
func TestShardStorm(t *testing.T) {
	for _, shards := range []int{1, 2, 0, 65536} {
		t.Run(fmt.Sprint(shards), func(t *testing.T) {
			brkShardStorm(t, brkShardStormOpts{
				shards: shards, workers: 8, ops: brkShardOps(4000), arenaMiB: 256,
				gc: true, procs: true, observe: true, handoff: true,
			})
		})
	}
}

// The same without observers and GOMAXPROCS changes: only garbage collections, so that the
// shards are not emptied by Release while the workers run.
func TestShardStormGCOnly(t *testing.T) {
	for _, shards := range []int{1, 2, 65536} {
		t.Run(fmt.Sprint(shards), func(t *testing.T) {
			brkShardStorm(t, brkShardStormOpts{
				shards: shards, workers: 16, ops: brkShardOps(4000), arenaMiB: 256,
				gc: true, handoff: true,
			})
		})
	}
}

// Goroutines that hold default-stream shards at once each get their own: with k of n shards
// held, the next lockShard takes a free one (never waits), whatever shard its hint starts at,
// across garbage collections and GOMAXPROCS changes.
func TestShardHeldShardsSpread(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, shards := range []int{1, 2, 3, 16, 65536} {
		t.Run(fmt.Sprint(shards), func(t *testing.T) {
			a, _ := arenaSim(t, 64<<20, &ArenaOptions{DefaultStreamArenas: shards})
			held := map[int]bool{}
			var locked []*arenaSet
			for k := range min(shards, 40) {
				if k%3 == 0 {
					runtime.GC()
				}
				runtime.GOMAXPROCS(1 + k%5)
				s := a.lockShard()
				require.Equal(t, arenaShardKind, s.kind)
				require.False(t, held[s.index], "shard %d handed out while held", s.index)
				held[s.index] = true
				locked = append(locked, s)
			}
			require.Len(t, held, min(shards, 40))
			// All but the held shards are free: a goroutine allocating now lands in one of them.
			if shards > len(held) {
				p := arenaAlloc(t, a, 4096, DefaultStream)
				i := brkShardShardOf(a, p)
				require.GreaterOrEqual(t, i, 0)
				require.False(t, held[i], "allocation in held shard %d", i)
				for _, s := range locked {
					s.mu.Unlock()
				}
				require.NoError(t, a.Deallocate(p, 4096, DefaultStream))
			} else {
				// Every shard is held: an allocation waits (on its hint's shard) and completes
				// once the shards are let go.
				done := make(chan error, 1)
				go func() {
					p, err := a.Allocate(4096, DefaultStream)
					if err == nil {
						err = a.Deallocate(p, 4096, DefaultStream)
					}
					done <- err
				}()
				for _, s := range locked {
					s.mu.Unlock()
				}
				require.NoError(t, <-done)
			}
			arenaCheck(t, a)
		})
	}
}

// A goroutine that moved off a busy shard keeps the shard it moved to: garbage collections
// (new hints start at settled) and GOMAXPROCS changes do not send it back or on.
func TestShardMovedGoroutineStays(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, shards := range []int{2, 7, 65536} {
		t.Run(fmt.Sprint(shards), func(t *testing.T) {
			a, _ := arenaSim(t, 256<<20, &ArenaOptions{DefaultStreamArenas: shards})
			const n = 768 << 10 // one superblock each
			first := arenaAlloc(t, a, n, DefaultStream)
			home := brkShardShardOf(a, first)
			require.GreaterOrEqual(t, home, 0)
			// Make home busy: the next allocation moves to another shard, which becomes settled.
			a.shards[home].mu.Lock()
			moved := arenaAlloc(t, a, n, DefaultStream)
			a.shards[home].mu.Unlock()
			to := brkShardShardOf(a, moved)
			require.Equal(t, (home+1)%shards, to, "moves to the next free shard")
			require.Equal(t, int32(to), a.settled.Load())
			ptrs := []DevicePtr{first, moved}
			for i := range 60 {
				if i%4 == 3 { // the first allocations keep the hint that moved
					runtime.GC()
					runtime.GC() // the victim cache too
				}
				if i >= 3 {
					runtime.GOMAXPROCS(1 + i%6) // a new size empties the hints too
				}
				p := arenaAlloc(t, a, n, DefaultStream)
				require.Equal(t, to, brkShardShardOf(a, p), "allocation %d", i)
				ptrs = append(ptrs, p)
			}
			require.Equal(t, 2, brkShardUsed(a))
			for _, p := range ptrs {
				require.NoError(t, a.Deallocate(p, n, DefaultStream))
			}
			arenaCheck(t, a)
		})
	}
}

// Close while goroutines allocate and free on DefaultStream (with garbage collections): every
// Allocate after Close fails with ErrClosed, every block allocated before frees cleanly, none is
// handed out twice, and the last free gives the arena back to the upstream.
func TestShardCloseWhileRunning(t *testing.T) {
	for _, shards := range []int{1, 2, 65536} {
		t.Run(fmt.Sprint(shards), func(t *testing.T) {
			sim, err := NewSimulatedMemoryResource(1 << 40)
			require.NoError(t, err)
			a, err := NewArenaMemoryResource(sim, &ArenaOptions{ArenaSize: 256 << 20, DefaultStreamArenas: shards})
			require.NoError(t, err)
			ov := brkShardNewOverlap(a)
			const workers = 8
			var started, closedSeen sync.WaitGroup
			started.Add(workers)
			closedSeen.Add(workers)
			errc := make(chan error, workers)
			var gcStop atomic.Bool
			gcDone := make(chan struct{})
			go func() {
				defer close(gcDone)
				for !gcStop.Load() {
					runtime.GC()
					runtime.Gosched()
				}
			}()
			for w := range workers {
				go func() {
					r := rand.New(rand.NewPCG(uint64(w), 7))
					var mine []brkShardBlock
					first := true
					err := func() error {
						for {
							n := brkShardSize(r)
							p, err := a.Allocate(n, DefaultStream)
							if first {
								first = false
								started.Done()
							}
							if errors.Is(err, ErrClosed) {
								return nil
							}
							if errors.Is(err, ErrOutOfMemory) {
								continue // fragmentation over many shards; the test is about Close
							}
							if err != nil {
								return err
							}
							tag, err := ov.claim(p, n)
							if err != nil {
								return err
							}
							mine = append(mine, brkShardBlock{p, n, tag})
							if len(mine) > 16 {
								b := mine[0]
								mine = mine[1:]
								if err := ov.release(b.p, b.n, b.tag); err != nil {
									return err
								}
								if err := a.Deallocate(b.p, b.n, DefaultStream); err != nil {
									return err
								}
							}
						}
					}()
					closedSeen.Done()
					if err == nil {
						closedSeen.Wait() // every worker saw Close: the frees below outlive it
						for _, b := range mine {
							if err = ov.release(b.p, b.n, b.tag); err != nil {
								break
							}
							if err = a.Deallocate(b.p, b.n, DefaultStream); err != nil {
								break
							}
						}
					}
					errc <- err
				}()
			}
			started.Wait()
			require.NoError(t, a.Close())
			for range workers {
				require.NoError(t, <-errc)
			}
			gcStop.Store(true)
			<-gcDone
			require.Zero(t, sim.UsedBytes(), "the last free gave the arena back")
			_, err = a.Allocate(256, DefaultStream)
			require.ErrorIs(t, err, ErrClosed)
			require.NoError(t, a.Close())
		})
	}
}

// Goroutines that take default-stream shards at the same time, each holding its shard until all
// have one, get distinct shards (none waits: fewer are held than there are), while garbage
// collections keep emptying the hints, so that every new hint starts at the same shard.
func TestShardConcurrentHoldersSpread(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(8))
	for _, shards := range []int{1, 2, 5, 16, 65536} {
		t.Run(fmt.Sprint(shards), func(t *testing.T) {
			a, _ := arenaSim(t, 64<<20, &ArenaOptions{DefaultStreamArenas: shards})
			var gcStop atomic.Bool
			gcDone := make(chan struct{})
			go func() {
				defer close(gcDone)
				for !gcStop.Load() {
					runtime.GC()
					runtime.Gosched()
				}
			}()
			k := min(shards, 12)
			for round := range 20 {
				var got sync.WaitGroup
				got.Add(k)
				release := make(chan struct{})
				idx := make([]int, k)
				var done sync.WaitGroup
				for g := range k {
					done.Go(func() {
						s := a.lockShard()
						idx[g] = s.index
						got.Done()
						<-release
						s.mu.Unlock()
					})
				}
				got.Wait()
				seen := map[int]bool{}
				for _, i := range idx {
					require.False(t, seen[i], "round %d: shard %d held twice: %v", round, i, idx)
					seen[i] = true
				}
				close(release)
				done.Wait()
			}
			gcStop.Store(true)
			<-gcDone
			s := a.settled.Load()
			require.True(t, s >= 0 && int(s) < shards, "settled %d", s)
			arenaCheck(t, a)
		})
	}
}

// One goroutine alone allocating and freeing on DefaultStream keeps one shard, with a garbage
// collection before every fourth allocation and GOMAXPROCS changing, for 1, 2 and 65536 shards.
func TestShardLoneGoroutineOneShard(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, shards := range []int{1, 2, 65536} {
		t.Run(fmt.Sprint(shards), func(t *testing.T) {
			a, _ := arenaSim(t, 1<<30, &ArenaOptions{DefaultStreamArenas: shards})
			r := rand.New(rand.NewPCG(uint64(shards), 3))
			var live []brkShardBlock
			home := -1
			for i := range 200 {
				if i%4 == 0 {
					runtime.GC()
				}
				runtime.GOMAXPROCS(1 + i%9)
				if len(live) > 0 && r.IntN(3) == 0 {
					k := r.IntN(len(live))
					require.NoError(t, a.Deallocate(live[k].p, live[k].n, DefaultStream))
					live = append(live[:k], live[k+1:]...)
				}
				n := 1 + r.IntN(arenaMinSuperblockSize)
				p := arenaAlloc(t, a, n, DefaultStream)
				at := brkShardShardOf(a, p)
				if home < 0 {
					home = at
				}
				require.Equal(t, home, at, "allocation %d", i)
				live = append(live, brkShardBlock{p: p, n: n})
			}
			require.Equal(t, 1, brkShardUsed(a))
			for _, b := range live {
				require.NoError(t, a.Deallocate(b.p, b.n, DefaultStream))
			}
			st := a.Stats()
			require.Zero(t, st.LiveBytes)
			require.Equal(t, a.size, st.FreeBytes)
			arenaCheck(t, a)
		})
	}
}

// A lone goroutine that finds its shard held by Stats (which locks every arena in turn) waits
// for it instead of moving: its memory stays in one shard while a monitor reads the figures.
func TestShardStatsMovesLoneGoroutine(t *testing.T) {
	a, _ := arenaSim(t, 1<<30, &ArenaOptions{DefaultStreamArenas: 4})
	const n = 768 << 10 // one superblock each
	var ptrs []DevicePtr
	ptrs = append(ptrs, arenaAlloc(t, a, n, DefaultStream))
	require.Equal(t, 0, brkShardShardOf(a, ptrs[0]))
	// Another goroutine is briefly in shard 1 (the test holds it) while Stats runs: Stats
	// takes shard 0, then waits for shard 1.
	a.shards[1].mu.Lock()
	statsDone := make(chan struct{})
	go func() { a.Stats(); close(statsDone) }()
	for a.shards[0].mu.TryLock() {
		a.shards[0].mu.Unlock()
		runtime.Gosched()
	}
	// The other goroutine leaves shard 1 a little later; meanwhile this goroutine allocates and
	// finds its shard 0 held by Stats.
	go func() {
		time.Sleep(20 * time.Millisecond)
		a.shards[1].mu.Unlock()
	}()
	ptrs = append(ptrs, arenaAlloc(t, a, n, DefaultStream))
	<-statsDone
	for i := range 20 {
		if i%5 == 4 {
			runtime.GC()
			runtime.GC()
		}
		ptrs = append(ptrs, arenaAlloc(t, a, n, DefaultStream))
	}
	shards := map[int]int{}
	for _, p := range ptrs {
		shards[brkShardShardOf(a, p)]++
	}
	require.Equal(t, map[int]int{0: len(ptrs)}, shards, "a lone goroutine's blocks stay in its shard")
	for _, p := range ptrs {
		require.NoError(t, a.Deallocate(p, n, DefaultStream))
	}
}
