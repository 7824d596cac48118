package rmm

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

func adpNewAligned(t *testing.T, up MemoryResource, alignment, threshold int) *AlignedResourceAdaptor {
	t.Helper()
	r, err := NewAlignedResourceAdaptor(up, &AlignedOptions{Alignment: alignment, Threshold: threshold})
	require.NoError(t, err)
	return r
}

// librmm's ThrowOnInvalidAllocationAlignment: 255 and 768 are refused, 256 accepted.
func TestAlignedOptions(t *testing.T) {
	for _, a := range []int{255, 768, 3, -4096} {
		_, err := NewAlignedResourceAdaptor(nil, &AlignedOptions{Alignment: a})
		require.ErrorIs(t, err, ErrInvalidArgument, "alignment %d", a)
	}
	_, err := NewAlignedResourceAdaptor(nil, &AlignedOptions{Alignment: 4096, Threshold: -1})
	require.ErrorIs(t, err, ErrInvalidArgument)
	r, err := NewAlignedResourceAdaptor(nil, nil)
	require.NoError(t, err)
	require.Equal(t, 256, r.Alignment())
	require.Zero(t, r.Threshold())
	require.Same(t, CurrentDeviceResource(), r.Upstream())
	r = adpNewAligned(t, nil, 256, 0)
	require.Equal(t, 256, r.Alignment())
	for _, a := range []int{1, 32, 64, 128} {
		require.Equal(t, 256, adpNewAligned(t, nil, a, 0).Alignment(), "alignments below 256 give 256")
	}
}

// librmm's DefaultAllocationAlignmentPassthrough and BelowAlignmentThresholdPassthrough: the
// upstream sees the original size and its pointer comes back unchanged.
func TestAlignedPassThrough(t *testing.T) {
	up := newAdpScriptUpstream(123)
	r := adpNewAligned(t, up, 0, 0)
	p := adpAlloc(t, r, 5)
	require.Equal(t, DevicePtr(123), p)
	adpFree(t, r, p, 5)

	up = newAdpScriptUpstream(123, 456)
	r = adpNewAligned(t, up, 4096, 65536)
	p = adpAlloc(t, r, 3)
	require.Equal(t, DevicePtr(123), p)
	adpFree(t, r, p, 3)
	q := adpAlloc(t, r, 65528)
	require.Equal(t, DevicePtr(456), q)
	adpFree(t, r, q, 65528)
	z := adpAlloc(t, r, 0)
	require.Zero(t, z)
	adpFree(t, r, 0, 0)
	allocs, frees := up.calls()
	require.Equal(t, []adpCall{{123, 3}, {456, 65528}, {0, 0}}, allocs)
	require.Equal(t, []adpCall{{123, 3}, {456, 65528}, {0, 0}}, frees)
}

// librmm's UpstreamAddressAlreadyAligned, AlignUpstreamAddress and AlignMultiple: A = 4096,
// threshold 65536; a request of 65536 asks the upstream for 69376 bytes; its pointer is rounded
// up to 4096, and the free gives the upstream its own pointer and size back.
func TestAlignedLibrmmExamples(t *testing.T) {
	t.Run("already aligned", func(t *testing.T) {
		up := newAdpScriptUpstream(4096)
		r := adpNewAligned(t, up, 4096, 65536)
		p := adpAlloc(t, r, 65536)
		require.Equal(t, DevicePtr(4096), p)
		adpFree(t, r, p, 65536)
		allocs, frees := up.calls()
		require.Equal(t, []adpCall{{4096, 69376}}, allocs)
		require.Equal(t, []adpCall{{4096, 69376}}, frees)
	})
	t.Run("rounded up", func(t *testing.T) {
		up := newAdpScriptUpstream(256)
		r := adpNewAligned(t, up, 4096, 65536)
		p := adpAlloc(t, r, 65536)
		require.Equal(t, DevicePtr(4096), p)
		adpFree(t, r, p, 65536)
		allocs, frees := up.calls()
		require.Equal(t, []adpCall{{256, 69376}}, allocs)
		require.Equal(t, []adpCall{{256, 69376}}, frees)
	})
	t.Run("multiple", func(t *testing.T) {
		up := newAdpScriptUpstream(256, 131584, 263168)
		r := adpNewAligned(t, up, 4096, 65536)
		sizes := []int{65536, 73728, 77800}
		var ps []DevicePtr
		for _, n := range sizes {
			ps = append(ps, adpAlloc(t, r, n))
		}
		require.Equal(t, []DevicePtr{4096, 135168, 266240}, ps)
		for i, n := range sizes {
			adpFree(t, r, ps[i], n)
		}
		allocs, frees := up.calls()
		want := []adpCall{{256, 69376}, {131584, 77568}, {263168, 81664}}
		require.Equal(t, want, allocs)
		require.Equal(t, want, frees)
	})
}

// Real memory: every pointer is aligned, the whole range is writable, and nothing leaks.
func TestAlignedRealMemory(t *testing.T) {
	for _, a := range []int{32, 256, 512, 4096, 1 << 16} {
		t.Run(fmt.Sprint(a), func(t *testing.T) {
			up := newTestResource()
			r := adpNewAligned(t, up, a, 0)
			rng := rand.New(rand.NewPCG(uint64(a), 7))
			type alloc struct {
				p DevicePtr
				n int
			}
			var live []alloc
			for range 100 {
				if len(live) > 0 && rng.IntN(3) == 0 {
					k := rng.IntN(len(live))
					adpFree(t, r, live[k].p, live[k].n)
					live = append(live[:k], live[k+1:]...)
					continue
				}
				n := 1 + rng.IntN(3*a)
				p := adpAlloc(t, r, n)
				require.Zero(t, uintptr(p)%uintptr(max(a, 256)), "%#x not aligned to %d", uintptr(p), a)
				b := hostBytes(p, n)
				for i := range b {
					b[i] = byte(i)
				}
				live = append(live, alloc{p, n})
			}
			for _, x := range live {
				b := hostBytes(x.p, x.n)
				for i := range b {
					if b[i] != byte(i) {
						t.Fatalf("allocation %#x+%d: byte %d is %d, want %d (overlapping allocations)", uintptr(x.p), x.n, i, b[i], byte(i))
					}
				}
				adpFree(t, r, x.p, x.n)
			}
			_, _, n := up.counts()
			require.Zero(t, n, "every upstream allocation was freed with its own pointer and size")
		})
	}
}

// Over address-only memory: every aligned range lies inside what the upstream handed out.
func TestAlignedInsideUpstreamRange(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 40)
	r := adpNewAligned(t, sim, 1<<20, 4096)
	for _, n := range []int{4096, 4097, 1 << 20, 1<<20 + 1, 3 << 20, 100 << 20} {
		p := adpAlloc(t, r, n)
		require.Zero(t, uintptr(p)%(1<<20))
		require.True(t, sim.Contains(p, n), "[%#x, +%d) is inside one upstream allocation", uintptr(p), n)
		adpFree(t, r, p, n)
	}
	require.Zero(t, sim.UsedBytes())
	// Below the threshold: no padding.
	p := adpAlloc(t, r, 4095)
	require.Equal(t, 4096, sim.UsedBytes())
	adpFree(t, r, p, 4095)
	// A size whose padded size overflows is refused.
	_, err := r.Allocate(int(^uint(0)>>1)-100, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	_, err = r.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
}

// A free the upstream refuses keeps the aligned pointer known, so that a later free works.
func TestAlignedUpstreamFreeFails(t *testing.T) {
	up := newAdpFaultUpstream(newAdpScriptUpstream(256))
	r := adpNewAligned(t, up, 4096, 0)
	p := adpAlloc(t, r, 100)
	require.Equal(t, DevicePtr(4096), p)
	up.failNextFrees(1)
	require.ErrorIs(t, r.Deallocate(p, 100, DefaultStream), errAdpInjected)
	adpFree(t, r, p, 100)
	_, frees := up.inner.(*adpScriptUpstream).calls()
	require.Equal(t, []adpCall{{256, 4096 + 4096 - 256}}, frees)
}

// librmm's MultiThreaded (ABA): the aligned pointer is forgotten before the upstream's free, so
// a second goroutine that gets the same upstream address aligns it without a clash.
func TestAlignedFreeBeforeUpstream(t *testing.T) {
	for _, size := range []int{0, 256} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			up := newAdpReuseUpstream()
			// The reuse upstream's addresses are 256-aligned and no more, so every aligned
			// allocation records its upstream pointer.
			r := adpNewAligned(t, up, 4096, 0)
			p0, p1, errs := adpInterleave(r, up, size, nil)
			for _, err := range errs {
				require.NoError(t, err)
			}
			require.Equal(t, p0, p1)
			live, _ := up.counts()
			require.Zero(t, live)
		})
	}
}

func TestAlignedConcurrent(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 40)
	r := adpNewAligned(t, sim, 8192, 1000)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 500 {
				n := 1 + (g*131+i*977)%20000
				p, err := r.Allocate(n, DefaultStream)
				if err != nil {
					t.Error(err)
					return
				}
				if n >= 1000 && uintptr(p)%8192 != 0 {
					t.Errorf("%#x not aligned", uintptr(p))
				}
				if err := r.Deallocate(p, n, DefaultStream); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	require.Zero(t, sim.UsedBytes())
}

func TestAlignedForwarding(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 20)
	r := adpNewAligned(t, sim, 4096, 0)
	require.Same(t, sim, r.Upstream())
	require.Equal(t, Access(0), r.Access())
	require.Equal(t, CurrentDevice(), r.Device())
}
