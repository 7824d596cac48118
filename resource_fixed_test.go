package rmm

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// fixedRecorder passes calls to an address-only upstream (or inner) and records the size and
// stream of every allocation and free; refuse makes it refuse allocations.
type fixedRecorder struct {
	inner MemoryResource

	mu     sync.Mutex
	allocs []fixedCall
	frees  []fixedCall
	refuse bool
}

type fixedCall struct {
	p DevicePtr
	n int
	s StreamView
}

func newFixedRecorder(t *testing.T) *fixedRecorder {
	sim, err := NewSimulatedMemoryResource(1 << 50)
	require.NoError(t, err)
	return &fixedRecorder{inner: sim}
}

func (u *fixedRecorder) Allocate(n int, s StreamView) (DevicePtr, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.refuse {
		return 0, outOfMemory("fixedRecorder", n, nil)
	}
	p, err := u.inner.Allocate(n, s)
	if err == nil {
		u.allocs = append(u.allocs, fixedCall{p, n, s})
	}
	return p, err
}

func (u *fixedRecorder) Deallocate(p DevicePtr, n int, s StreamView) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	err := u.inner.Deallocate(p, n, s)
	if err == nil {
		u.frees = append(u.frees, fixedCall{p, n, s})
	}
	return err
}

func (u *fixedRecorder) Access() Access { return AccessOf(u.inner) }

func (u *fixedRecorder) calls() (allocs, frees []fixedCall) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return slices.Clone(u.allocs), slices.Clone(u.frees)
}

func fixedNew(t *testing.T, up MemoryResource, opts *FixedSizeOptions) *FixedSizeMemoryResource {
	t.Helper()
	f, err := NewFixedSizeMemoryResource(up, opts)
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	return f
}

func fixedCheck(t *testing.T, f *FixedSizeMemoryResource) {
	t.Helper()
	require.NoError(t, f.CheckInvariants())
}

// Defaults: 1 MiB blocks, 128 of them taken at construction in one upstream call.
func TestFixedSizeDefaults(t *testing.T) {
	up := newFixedRecorder(t)
	f := fixedNew(t, up, nil)
	allocs, _ := up.calls()
	require.Equal(t, []fixedCall{{allocs[0].p, 128 << 20, DefaultStream}}, allocs)
	require.Equal(t, 1<<20, f.BlockSize())
	st := f.Stats()
	require.Equal(t, FixedSizeStats{BlockSize: 1 << 20, PoolSize: 128 << 20, UpstreamBlocks: 1, FreeBlocks: 128, FreeBytes: 128 << 20,
		LargestFreeBlock: 1 << 20, Streams: 1,
		PerStream: []StreamFreeStats{{Stream: DefaultStream, FreeBlocks: 128, FreeBytes: 128 << 20}}}, st)
	require.Equal(t, up, f.Upstream())
	require.Equal(t, Access(0), f.Access())
	require.Equal(t, CurrentDevice(), f.Device())
	fixedCheck(t, f)
}

func TestFixedSizeOptions(t *testing.T) {
	up := newFixedRecorder(t)
	f := fixedNew(t, up, &FixedSizeOptions{BlockSize: 1000, BlocksToPreallocate: 3})
	require.Equal(t, 1024, f.BlockSize(), "rounded up to 256")
	allocs, _ := up.calls()
	require.Len(t, allocs, 1)
	require.Equal(t, 3*1024, allocs[0].n)
	for _, o := range []FixedSizeOptions{
		{BlockSize: -1},
		{BlocksToPreallocate: -5},
		{BlockSize: 1 << 40, BlocksToPreallocate: 1 << 30},
		{BlockSize: int(^uint(0) >> 1)},
	} {
		_, err := NewFixedSizeMemoryResource(up, &o)
		require.ErrorIs(t, err, ErrInvalidArgument, "%+v", o)
	}
	up.refuse = true
	_, err := NewFixedSizeMemoryResource(up, nil)
	require.ErrorIs(t, err, ErrOutOfMemory)
}

// Every allocation takes one block, lowest address first; a larger request is refused; when all
// blocks are in use another chunk of the same size is taken on the allocating stream.
func TestFixedSizeBlocksAndGrowth(t *testing.T) {
	up := newFixedRecorder(t)
	const bs, nb = 4096, 4
	f := fixedNew(t, up, &FixedSizeOptions{BlockSize: bs, BlocksToPreallocate: nb})
	allocs, _ := up.calls()
	base := allocs[0].p
	var ps []DevicePtr
	for i, n := range []int{1, bs, 300, bs - 1} {
		p, err := f.Allocate(n, DefaultStream)
		require.NoError(t, err)
		require.Equal(t, base+DevicePtr(i*bs), p, "blocks handed out in address order")
		ps = append(ps, p)
	}
	st := f.Stats()
	require.Equal(t, 4, st.LiveAllocations)
	require.Equal(t, 4*bs, st.LiveBytes, "each allocation takes a whole block")
	require.Zero(t, st.FreeBlocks)
	allocs, _ = up.calls()
	require.Len(t, allocs, 1, "no growth while a block was free")

	_, err := f.Allocate(bs+1, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Contains(t, err.Error(), "maximum allocation size exceeded")
	allocs, _ = up.calls()
	require.Len(t, allocs, 1, "a refused size never reaches the upstream")

	s := mustStream(t)
	p, err := f.Allocate(10, s)
	require.NoError(t, err)
	allocs, _ = up.calls()
	require.Len(t, allocs, 2)
	require.Equal(t, nb*bs, allocs[1].n, "a chunk of the same size")
	require.Equal(t, s, allocs[1].s, "taken on the allocating stream")
	require.Equal(t, allocs[1].p, p)
	st = f.Stats()
	require.Equal(t, 2, st.UpstreamBlocks)
	require.Equal(t, 2*nb*bs, st.PoolSize)
	require.Equal(t, nb-1, st.FreeBlocks)
	fixedCheck(t, f)

	// The upstream refuses the next chunk: out of memory, nothing changed.
	for i := 0; i < nb-1; i++ {
		_, err := f.Allocate(1, s)
		require.NoError(t, err)
	}
	up.refuse = true
	before := f.Stats()
	_, err = f.Allocate(1, s)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Equal(t, before, f.Stats())
	up.refuse = false
	for i, n := range []int{1, bs, 300, bs - 1} {
		require.NoError(t, f.Deallocate(ps[i], n, DefaultStream))
	}
	p, err = f.Allocate(1, s)
	require.NoError(t, err)
	require.Equal(t, ps[3], p, "taken from the default stream's list: the block freed last")
	fixedCheck(t, f)
}

// A block freed on a stream is reused there at once; another stream takes it only when it has
// no free block of its own and the default stream has none either.
func TestFixedSizeStreamOrderedReuse(t *testing.T) {
	up := newFixedRecorder(t)
	f := fixedNew(t, up, &FixedSizeOptions{BlockSize: 256, BlocksToPreallocate: 1})
	a, b := mustStream(t), mustStream(t)
	x, err := f.Allocate(256, a)
	require.NoError(t, err)
	require.NoError(t, f.Deallocate(x, 256, a))
	y, err := f.Allocate(100, a)
	require.NoError(t, err)
	require.Equal(t, x, y, "reused on the same stream")
	require.NoError(t, f.Deallocate(y, 100, a))
	z, err := f.Allocate(256, b)
	require.NoError(t, err)
	require.Equal(t, x, z, "taken from a's list")
	allocs, _ := up.calls()
	require.Len(t, allocs, 1, "no growth")
	require.NoError(t, f.Deallocate(z, 256, b))
	st := f.Stats()
	require.Equal(t, 3, st.Streams)
	require.Equal(t, 1, st.FreeBlocks)
	fixedCheck(t, f)
}

// Closing a Stream moves its free blocks to the default stream's list and drops its list; a
// closed Stream cannot allocate, and a free on it goes to the default stream.
func TestFixedSizeStreamClose(t *testing.T) {
	f := fixedNew(t, newFixedRecorder(t), &FixedSizeOptions{BlockSize: 512, BlocksToPreallocate: 4})
	s, err := NewStream(CurrentDevice(), nil)
	require.NoError(t, err)
	p, err := f.Allocate(512, s.View())
	require.NoError(t, err)
	q, err := f.Allocate(512, s.View())
	require.NoError(t, err)
	require.NoError(t, f.Deallocate(p, 512, s.View()))
	require.Equal(t, 2, f.Stats().Streams)
	require.NoError(t, s.Close())
	st := f.Stats()
	require.Equal(t, 1, st.Streams)
	require.Equal(t, 3, st.FreeBlocks)
	_, err = f.Allocate(512, s.View())
	require.ErrorIs(t, err, ErrClosed)
	require.NoError(t, f.Deallocate(q, 512, s.View()))
	require.Equal(t, 4, f.Stats().FreeBlocks)
	fixedCheck(t, f)
}

func TestFixedSizeInvalidFree(t *testing.T) {
	f := fixedNew(t, newFixedRecorder(t), &FixedSizeOptions{BlockSize: 1024, BlocksToPreallocate: 4})
	p, err := f.Allocate(700, DefaultStream)
	require.NoError(t, err)
	before := f.Stats()
	for name, err := range map[string]error{
		"interior":         f.Deallocate(p+256, 700, DefaultStream),
		"next block":       f.Deallocate(p+1024, 700, DefaultStream),
		"never handed out": f.Deallocate(0xdead00, 700, DefaultStream),
		"wrong size":       f.Deallocate(p, 1024, DefaultStream),
		"negative size":    f.Deallocate(p, -1, DefaultStream),
	} {
		require.ErrorIs(t, err, ErrInvalidFree, name)
	}
	require.Equal(t, before, f.Stats())
	fixedCheck(t, f)
	require.NoError(t, f.Deallocate(p, 700, DefaultStream))
	err = f.Deallocate(p, 700, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidFree, "double free")
	require.Contains(t, err.Error(), "already freed")
	fixedCheck(t, f)
}

func TestFixedSizeZeroAndNegative(t *testing.T) {
	up := newFixedRecorder(t)
	f := fixedNew(t, up, &FixedSizeOptions{BlockSize: 256, BlocksToPreallocate: 2})
	p, err := f.Allocate(0, DefaultStream)
	require.NoError(t, err)
	require.Zero(t, p)
	require.NoError(t, f.Deallocate(0, 0, DefaultStream))
	_, err = f.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = f.Allocate(1<<50, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Zero(t, f.Stats().LiveAllocations)
}

// Release returns the chunks whose blocks are all free, wherever (on whichever stream) they were
// freed; Close returns the rest as their last blocks are freed.
func TestFixedSizeReleaseAndClose(t *testing.T) {
	up := newFixedRecorder(t)
	f, err := NewFixedSizeMemoryResource(up, &FixedSizeOptions{BlockSize: 256, BlocksToPreallocate: 2})
	require.NoError(t, err)
	a, b := mustStream(t), mustStream(t)
	var ps []DevicePtr
	for i := 0; i < 6; i++ { // three chunks
		p, err := f.Allocate(256, a)
		require.NoError(t, err)
		ps = append(ps, p)
	}
	require.Equal(t, 3, f.Stats().UpstreamBlocks)
	// Chunk 0 freed on two streams, chunk 1 half freed, chunk 2 live.
	require.NoError(t, f.Deallocate(ps[0], 256, a))
	require.NoError(t, f.Deallocate(ps[1], 256, b))
	require.NoError(t, f.Deallocate(ps[2], 256, DefaultStream))
	require.NoError(t, f.Release())
	st := f.Stats()
	require.Equal(t, 2, st.UpstreamBlocks, "the wholly free chunk went back")
	require.Equal(t, 1, st.FreeBlocks)
	require.Equal(t, 3, st.LiveAllocations)
	_, frees := up.calls()
	require.Len(t, frees, 1)
	require.Equal(t, 512, frees[0].n)
	require.NoError(t, f.CheckInvariants())

	require.NoError(t, f.Close())
	_, err = f.Allocate(256, a)
	require.ErrorIs(t, err, ErrClosed)
	st = f.Stats()
	require.Equal(t, 2, st.UpstreamBlocks, "both chunks still have live blocks")
	require.NoError(t, f.Deallocate(ps[3], 256, a))
	require.Equal(t, 1, f.Stats().UpstreamBlocks, "chunk 1's last block freed")
	require.NoError(t, f.Deallocate(ps[4], 256, a))
	require.ErrorIs(t, f.Deallocate(ps[4], 256, a), ErrInvalidFree)
	require.NoError(t, f.Deallocate(ps[5], 256, b))
	require.Zero(t, f.Stats().PoolSize)
	_, frees = up.calls()
	require.Len(t, frees, 3)
	require.NoError(t, f.Close())
	require.NoError(t, f.Release())
	require.NoError(t, f.CheckInvariants())

	// Closed with nothing live: everything goes back at once.
	g, err := NewFixedSizeMemoryResource(up, &FixedSizeOptions{BlockSize: 256, BlocksToPreallocate: 2})
	require.NoError(t, err)
	require.NoError(t, g.Close())
	require.Zero(t, g.Stats().PoolSize)
}

// Eight goroutines on their own and shared streams allocate and free blocks (sometimes on
// another stream); over host memory every block keeps its owner's pattern until freed.
func TestFixedSizeConcurrent(t *testing.T) {
	for _, host := range []bool{false, true} {
		var up MemoryResource = newFixedRecorder(t)
		if host {
			up = NewSystemMemoryResource()
		}
		f, err := NewFixedSizeMemoryResource(up, &FixedSizeOptions{BlockSize: 4096, BlocksToPreallocate: 16})
		require.NoError(t, err)
		const goroutines, ops = 8, 2000
		own := make([]StreamView, goroutines)
		for i := range own {
			own[i] = mustStream(t)
		}
		shared := []StreamView{DefaultStream, mustStream(t)}
		var shadow liveSet
		var cross atomic.Int64
		var wg sync.WaitGroup
		for g := range goroutines {
			wg.Go(func() {
				r := rand.New(rand.NewPCG(uint64(g), 5))
				type alloc struct {
					p    DevicePtr
					n    int
					fill byte
				}
				var mine []alloc
				stream := func() StreamView {
					if r.IntN(3) == 0 {
						return shared[r.IntN(len(shared))]
					}
					return own[g]
				}
				free := func(i int) bool {
					x := mine[i]
					mine = slices.Delete(mine, i, i+1)
					if host && hostBytes(x.p, x.n)[x.n-1] != x.fill {
						t.Errorf("goroutine %d: block %#x overwritten", g, uintptr(x.p))
						return false
					}
					s := stream()
					if s != own[g] {
						cross.Add(1)
					}
					shadow.remove(x.p)
					if err := f.Deallocate(x.p, x.n, s); err != nil {
						t.Errorf("goroutine %d: %v", g, err)
						return false
					}
					return true
				}
				for k := 0; k < ops; k++ {
					if len(mine) == 0 || (len(mine) < 32 && r.IntN(100) < 55) {
						n := 1 + r.IntN(4096)
						p, err := f.Allocate(n, stream())
						if err != nil {
							t.Errorf("goroutine %d: Allocate(%d): %v", g, n, err)
							return
						}
						if err := shadow.add(p, 4096); err != nil {
							t.Errorf("goroutine %d: %v", g, err)
							return
						}
						fill := byte(k + g)
						if host {
							b := hostBytes(p, n)
							for i := range b {
								b[i] = fill
							}
						}
						mine = append(mine, alloc{p, n, fill})
					} else if !free(r.IntN(len(mine))) {
						return
					}
				}
				for len(mine) > 0 {
					if !free(0) {
						return
					}
				}
			})
		}
		wg.Wait()
		require.False(t, t.Failed())
		require.Positive(t, cross.Load())
		fixedCheck(t, f)
		st := f.Stats()
		require.Zero(t, st.LiveAllocations)
		require.Equal(t, st.PoolSize/4096, st.FreeBlocks)
		require.Greater(t, st.UpstreamBlocks, 1, "grew while the goroutines ran")
		require.NoError(t, f.Release())
		require.Zero(t, f.Stats().PoolSize)
		require.NoError(t, f.Close())
		if r, ok := up.(*fixedRecorder); ok {
			allocs, frees := r.calls()
			require.Equal(t, len(allocs), len(frees), "every chunk went back")
		}
	}
}

// The fixed-size resource's stream and event calls go through its cudaDriver, so a fake device
// shows them: a block freed on A and taken on B makes B wait for an event recorded on A, at the
// take; a second take on A waits for nothing.
func TestFixedSizeStreamOrderThroughDriver(t *testing.T) {
	sim, err := NewSimulatedMemoryResource(1 << 30)
	require.NoError(t, err)
	fx, err := NewFixedSizeMemoryResource(sim, &FixedSizeOptions{BlockSize: 1 << 20, BlocksToPreallocate: 1})
	require.NoError(t, err)
	f := newArenaSyncFake(nil)
	fx.ctx, fx.drv = 1, f.driver()
	defer fx.Close()
	sa, _ := arenaSyncStream(t, f, 0xa, "A")
	sb, _ := arenaSyncStream(t, f, 0xb, "B")

	p, err := fx.Allocate(4096, sa)
	require.NoError(t, err)
	require.NoError(t, fx.Deallocate(p, 4096, sa))
	f.mu.Lock()
	before := len(f.log)
	f.mu.Unlock()
	q, err := fx.Allocate(4096, sb)
	require.NoError(t, err)
	require.Equal(t, p, q, "the only block")
	f.mu.Lock()
	taken := slices.Clone(f.log[before:])
	f.mu.Unlock()
	require.Contains(t, taken, "record e1 on A, wait B", "B waits for A's work before it reuses the block")

	require.NoError(t, fx.Deallocate(q, 4096, sb))
	f.mu.Lock()
	before = len(f.log)
	f.mu.Unlock()
	r, err := fx.Allocate(4096, sb)
	require.NoError(t, err)
	require.NoError(t, fx.Deallocate(r, 4096, sb))
	f.mu.Lock()
	again := slices.Clone(f.log[before:])
	f.mu.Unlock()
	require.Empty(t, again, "a block reused on the stream that freed it needs no call")
}

// fixedSyncSim returns a fixed-size resource of 4 KiB blocks, 8 to a chunk, over an address-only
// upstream that checks every chunk given back against the model, with its CUDA calls going to a
// fake device (ctx 1 stands for a context) that follows the model of stream order.
func fixedSyncSim(t *testing.T) (*FixedSizeMemoryResource, *arenaSyncFake, *gatedUpstream) {
	t.Helper()
	u := newGatedUpstream(t, 1<<30)
	fx, err := NewFixedSizeMemoryResource(u, &FixedSizeOptions{BlockSize: 4096, BlocksToPreallocate: 8})
	require.NoError(t, err)
	f := newArenaSyncFake(nil)
	m := newArenaSyncModel()
	f.model = m
	fx.ctx, fx.drv = 1, f.driver()
	f.mu.Lock()
	m.stream(cuStreamLegacy)
	f.mu.Unlock()
	u.check = func(p DevicePtr, n int) error {
		f.mu.Lock()
		defer f.mu.Unlock()
		return m.returned(p, n)
	}
	// The default stream's list was made before the fake came (without CUDA, with no event):
	// give it one, as it would have on a device.
	if def := fx.byStream[DefaultStream.id]; def.event == 0 {
		def.event, err = fx.drv.eventCreate(fx.ctx, cuEventDisableTiming)
		require.NoError(t, err)
	}
	f.take()
	return fx, f, u
}

// Random work on DefaultStream, Streams that close and foreign streams that are destroyed,
// against the model of stream order: every block the fixed-size resource hands out is ordered
// after the work behind every earlier free of it, every chunk given back (Release, Close, frees
// after Close) after that work finished, and no call names a stream after its end. A closing
// Stream's blocks reach other streams through the default stream's wait alone (Stream.Close's own
// synchronisation is left out of the model).
func TestFixedSizeSyncAgainstModel(t *testing.T) {
	const bs = 4096
	for seed := range uint64(4) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			fx, f, u := fixedSyncSim(t)
			r := rand.New(rand.NewPCG(seed, 7))
			w := newModelStreams(t, f, r, 3, 2)
			for op := range 2000 {
				switch v := r.IntN(100); {
				case len(w.blocks) == 0 || (len(w.blocks) < 40 && v < 50):
					s := w.pick()
					n := 1 + r.IntN(bs)
					p, err := fx.Allocate(n, s.v)
					require.NoError(t, err)
					require.NoError(t, w.took(s, p, n, bs), "op %d", op)
				case v < 93:
					require.NoError(t, w.free(fx, r.IntN(len(w.blocks))))
				case v < 96:
					w.closeOne(func(s *modelStream) { require.NoError(t, s.st.Close()) })
				case v < 99:
					w.killOne()
				default:
					require.NoError(t, fx.Release())
				}
				require.Empty(t, f.errors(), "op %d", op)
				if op%100 == 0 {
					fixedCheck(t, fx)
				}
			}
			// Close with live blocks, then free them: each chunk goes back after its last free.
			require.NoError(t, fx.Close())
			for len(w.blocks) > 0 {
				require.NoError(t, w.free(fx, len(w.blocks)-1))
			}
			require.Empty(t, f.errors())
			held, _, _, errs := u.figures()
			require.Empty(t, errs)
			require.Zero(t, held, "every chunk went back")
			t.Logf("%d driver calls", f.calls)
		})
	}
}
