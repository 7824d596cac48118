package rmm

import (
	"errors"
	"fmt"
	"math/rand"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// poolRetryUpstream hands out address-only memory, optionally refusing past a limit, and keeps
// the live blocks and a count of frees.
type poolRetryUpstream struct {
	mu    sync.Mutex
	inner *SimulatedMemoryResource
	limit int // 0: none
	// onRefuse, when set, runs (unlocked, once) the next time the limit refuses an allocation
	onRefuse func()
	live     map[DevicePtr]int
	bytes    int
	frees    int
}

func (u *poolRetryUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.limit > 0 && u.bytes+n > u.limit {
		err := fmt.Errorf("%w: poolRetryUpstream: %d + %d > %d", ErrOutOfMemory, u.bytes, n, u.limit)
		if f := u.onRefuse; f != nil {
			u.onRefuse = nil
			u.mu.Unlock()
			f()
			u.mu.Lock()
		}
		return 0, err
	}
	p, err := u.inner.Allocate(n, s)
	if err != nil {
		return 0, err
	}
	u.live[p] = n
	u.bytes += n
	return p, nil
}

func (u *poolRetryUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.live[p] != n {
		return fmt.Errorf("%w: poolRetryUpstream: %#x of %d bytes is not live", ErrInvalidFree, uintptr(p), n)
	}
	delete(u.live, p)
	u.bytes -= n
	u.frees++
	return u.inner.Deallocate(p, n, s)
}

// holds reports whether [p, p+n) lies in one live upstream block.
func (u *poolRetryUpstream) holds(p DevicePtr, n int) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	for b, sz := range u.live {
		if p >= b && p+DevicePtr(n) <= b+DevicePtr(sz) {
			return true
		}
	}
	return false
}

// A plain pool, capped or not, over an upstream that may refuse: the pool never returns a block
// still in use, the upstream holds exactly the pool's size, an uncapped pool over an upstream that
// never refuses gives nothing back except at Release, and a capped pool over an upstream without limit fails only when neither a
// free block nor the headroom (after giving back its wholly free blocks) holds the request.
func TestPoolReleaseRetryRandomized(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	base := time.Now().UnixNano()
	for i := range shortOrLong(10, 40) {
		seed := base + int64(i)
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := rand.New(rand.NewSource(seed))
			sim, err := NewSimulatedMemoryResource(1 << 50)
			require.NoError(t, err)
			up := &poolRetryUpstream{inner: sim, live: map[DevicePtr]int{}}
			if r.Intn(3) == 0 {
				up.limit = 1 + r.Intn(64*miB)
			}
			o := PoolOptions{}
			if r.Intn(4) != 0 {
				o.MaximumPoolSize = 256 * (1 + r.Intn(64*miB/256))
			}
			if r.Intn(3) == 0 {
				o.InitialPoolSize = 256 * r.Intn(max(o.MaximumPoolSize, 4*miB)/256+1)
				if o.MaximumPoolSize > 0 && o.InitialPoolSize > o.MaximumPoolSize {
					_, err := NewPoolMemoryResource(up, &o)
					require.ErrorIs(t, err, ErrInvalidArgument)
					o.InitialPoolSize = o.MaximumPoolSize
				}
			}
			t.Logf("seed %d limit %d options %+v", seed, up.limit, o)
			p, err := NewPoolMemoryResource(up, &o)
			if err != nil {
				require.ErrorIs(t, err, ErrOutOfMemory)
				return
			}
			s1, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
			require.NoError(t, err)
			streams := []StreamView{DefaultStream, s1.View()}
			type al struct {
				n int
				s StreamView
			}
			live := map[DevicePtr]al{}
			for step := range 800 {
				freesBefore := up.frees
				switch k := r.Intn(10); {
				case k < 5:
					n := 1 + r.Intn(2*miB)
					if r.Intn(6) == 0 {
						n = 1 + r.Intn(max(o.MaximumPoolSize, 64*miB))
					}
					s := streams[r.Intn(2)]
					ptr, err := p.Allocate(n, s)
					if err != nil {
						var oom *OutOfMemoryError
						require.ErrorAs(t, err, &oom)
						rn, _ := alignSize(n)
						st := p.Stats()
						require.Equal(t, n, oom.Requested)
						require.Equal(t, st.PoolSize, oom.PoolSize)
						require.Equal(t, st.FreeBytes, oom.FreeBytes)
						require.Equal(t, o.MaximumPoolSize > 0 && rn > o.MaximumPoolSize, oom.TooLarge)
						if oom.Fragmented {
							require.LessOrEqual(t, rn, oom.FreeBytes+oom.Headroom)
						}
						require.Less(t, st.LargestFreeBlock, rn, "a free block held %d bytes", n)
						if o.MaximumPoolSize > 0 && up.limit == 0 {
							require.Greater(t, rn, o.MaximumPoolSize-st.PoolSize, "the headroom held %d bytes: %v", n, err)
						}
						if o.MaximumPoolSize == 0 && up.limit == 0 {
							require.Equal(t, freesBefore, up.frees, "an uncapped pool gave memory back at a failed Allocate")
						}
						break
					}
					_, dup := live[ptr]
					require.False(t, dup)
					live[ptr] = al{n, s}
				case k < 9:
					if len(live) == 0 {
						break
					}
					var ptrs []DevicePtr
					for q := range live {
						ptrs = append(ptrs, q)
					}
					sort.Slice(ptrs, func(i, j int) bool { return ptrs[i] < ptrs[j] })
					q := ptrs[r.Intn(len(ptrs))]
					require.NoError(t, p.Deallocate(q, live[q].n, streams[r.Intn(2)]))
					delete(live, q)
					require.Equal(t, freesBefore, up.frees, "Deallocate gave memory back")
				default:
					require.NoError(t, p.Release())
				}
				require.NoError(t, p.CheckInvariants(), "step %d", step)
				require.Equal(t, p.PoolSize(), up.bytes, "step %d: the upstream holds the pool's size", step)
				if o.MaximumPoolSize > 0 {
					require.LessOrEqual(t, p.PoolSize(), o.MaximumPoolSize)
				}
				var ptrs []DevicePtr
				for q := range live {
					ptrs = append(ptrs, q)
				}
				sort.Slice(ptrs, func(i, j int) bool { return ptrs[i] < ptrs[j] })
				var end DevicePtr
				for _, q := range ptrs {
					require.GreaterOrEqual(t, q, end, "live allocations overlap")
					end = q + DevicePtr(live[q].n)
					require.True(t, up.holds(q, live[q].n), "step %d: live %#x is not in a live upstream block", step, uintptr(q))
				}
			}
			for q, a := range live {
				require.NoError(t, p.Deallocate(q, a.n, a.s))
			}
			require.NoError(t, s1.Close())
			require.NoError(t, p.Close())
			require.Zero(t, up.bytes)
			require.Empty(t, up.live)
		})
	}
}

// poolRetryUnmapOnce fails its first unmap.
type poolRetryUnmapOnce struct {
	vmm
	failed bool
}

var errPoolRetryUnmap = errors.New("unmap refused")

func (v *poolRetryUnmapOnce) unmap(a DevicePtr, n int) error {
	if !v.failed {
		v.failed = true
		return errPoolRetryUnmap
	}
	return v.vmm.unmap(a, n)
}

// When the release before failing gives back some chunks but one unmap fails, the pool still
// retries with what it gave back, and the out-of-memory error it returns gives the figures of
// the pool as it is then, not as it was before the release.
func TestPoolReleaseRetryPartialRelease(t *testing.T) {
	const mib = 1 << 20
	sim := newSimVMM(4<<10, 0)
	vm := &poolRetryUnmapOnce{vmm: sim}
	p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 96 * mib})
	defer p.Close()
	a, err := p.Allocate(32*mib, DefaultStream) // chunk 1: [0, 32 MiB)
	require.NoError(t, err)
	b, err := p.Allocate(32*mib, DefaultStream) // chunk 2: [32, 64 MiB)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(a, 32*mib, DefaultStream))
	require.NoError(t, p.Deallocate(b, 32*mib, DefaultStream))
	sim.mu.Lock()
	sim.limit = 64 * mib // no more memory
	sim.mu.Unlock()

	// Growing by 16 or 32 MiB is refused; the release gives back chunk 1 (the unmap of chunk 2,
	// tried first, fails), and growing again is refused too.
	_, err = p.Allocate(80*mib, DefaultStream)
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	require.True(t, vm.failed)
	st := p.Stats()
	require.Equal(t, 32*mib, st.PoolSize, "chunk 1 was given back")
	require.Equal(t, st.PoolSize, oom.PoolSize)
	require.Equal(t, st.FreeBytes, oom.FreeBytes)
	require.Equal(t, 32*mib, oom.LargestFreeBlock)
	require.NoError(t, p.CheckInvariants())

	// The pool still serves what it holds.
	c, err := p.Allocate(32*mib, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(c, 32*mib, DefaultStream))
}

// An uncapped plain pool whose upstream refuses gives its wholly free upstream blocks back and
// tries once more before it fails: over an address-only upstream of 8 GiB, 2.5 GiB (A) and
// 2.5 GiB (B), B freed, then 5 GiB twice.
func TestPoolUncappedReleasesBeforeFailing(t *testing.T) {
	const gib = 1 << 30
	sim, err := NewSimulatedMemoryResource(8 * gib)
	require.NoError(t, err)
	up := &poolRetryUpstream{inner: sim, live: map[DevicePtr]int{}}
	p, err := NewPoolMemoryResource(up, &PoolOptions{})
	require.NoError(t, err)
	defer p.Close()

	a, err := p.Allocate(5*gib/2, DefaultStream)
	require.NoError(t, err)
	b, err := p.Allocate(5*gib/2, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(b, 5*gib/2, DefaultStream))
	sizeBefore := p.PoolSize()
	require.Equal(t, 5*gib, sizeBefore, "A and B each took an upstream block of their size")

	for i := range 2 {
		c, err := p.Allocate(5*gib, DefaultStream)
		require.NoError(t, err, "5 GiB, try %d", i+1)
		require.True(t, up.holds(c, 5*gib), "try %d: the block lies in one upstream block", i+1)
		require.NoError(t, p.CheckInvariants())
		require.Equal(t, up.bytes, p.PoolSize(), "the upstream holds the pool's size")
		require.LessOrEqual(t, p.PoolSize(), 8*gib)
		require.NoError(t, p.Deallocate(c, 5*gib, DefaultStream))
	}
	require.Equal(t, 1, up.frees, "B's block was given back once; the 5 GiB block stays in the pool")
	require.True(t, up.holds(a, 5*gib/2))
	require.NoError(t, p.Deallocate(a, 5*gib/2, DefaultStream))

	// With A live and nothing free, a request the upstream cannot hold still fails, and the pool
	// keeps what it had.
	a, err = p.Allocate(5*gib/2, DefaultStream)
	require.NoError(t, err)
	size := p.PoolSize()
	_, err = p.Allocate(6*gib, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.NoError(t, p.CheckInvariants())
	require.LessOrEqual(t, p.PoolSize(), size)
	require.NoError(t, p.Deallocate(a, 5*gib/2, DefaultStream))
}

// A block freed into a stream's cache while the pool grows unlocked (the upstream refusing)
// counts as free memory that giving back may turn into room: the pool gives it back and
// succeeds.
func TestPoolReleasesCachedBlockBeforeFailing(t *testing.T) {
	sim, err := NewSimulatedMemoryResource(1 << 40)
	require.NoError(t, err)
	up := &poolRetryUpstream{inner: sim, live: map[DevicePtr]int{}, limit: 2 * miB}
	p, err := NewPoolMemoryResource(up, &PoolOptions{})
	require.NoError(t, err)
	defer p.Close()
	s1, err := NewStream(CurrentDevice(), &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	defer s1.Close()

	// 1 MiB on DefaultStream, freed and asked for again, so that its next free is cached.
	a, err := p.Allocate(miB, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(a, miB, DefaultStream))
	a, err = p.Allocate(miB, DefaultStream)
	require.NoError(t, err)
	// 1.5 MiB on s1: the pool holds 1 MiB (live) and the upstream refuses 1.5 MiB more; meanwhile
	// the 1 MiB block is freed into DefaultStream's cache.
	up.onRefuse = func() { require.NoError(t, p.Deallocate(a, miB, DefaultStream)) }
	b, err := p.Allocate(3*miB/2, s1.View())
	require.NoError(t, err, "the cached block was given back and the upstream had room")
	require.Equal(t, 1, up.frees)
	require.True(t, up.holds(b, 3*miB/2))
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, p.Deallocate(b, 3*miB/2, s1.View()))
}

// A request that fails even after the pool gave its free memory back says so: its figures are
// the pool's after the release.
func TestPoolOutOfMemoryAfterGivingBackSaysSo(t *testing.T) {
	lim, err := NewLimitingResourceAdaptor(NewSystemMemoryResource(), 8<<20, nil)
	require.NoError(t, err)
	p, err := NewPoolMemoryResource(lim, &PoolOptions{InitialPoolSize: 4 << 20})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.Allocate(16<<20, DefaultStream)
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	require.Contains(t, oom.Error(), "on a second try, after giving back 4194304 bytes of free memory")
	require.Zero(t, oom.PoolSize)
	require.Zero(t, p.PoolSize())
}
