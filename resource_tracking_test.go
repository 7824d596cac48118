package rmm

import (
	"fmt"
	"log/slog"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

func adpNewTracking(t *testing.T, up MemoryResource, stacks bool) *TrackingResourceAdaptor {
	t.Helper()
	r, err := NewTrackingResourceAdaptor(up, &TrackingOptions{CaptureStacks: stacks})
	require.NoError(t, err)
	return r
}

// adpCaptureLog sends the debug log to a recordHandler for the rest of the test.
func adpCaptureLog(t *testing.T) *recordHandler {
	t.Helper()
	h := &recordHandler{}
	prev := SetDebugLogger(slog.New(h))
	t.Cleanup(func() { SetDebugLogger(prev) })
	return h
}

func adpMessages(h *recordHandler, level slog.Level) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for _, r := range h.records {
		if r.Level == level {
			out = append(out, r.Message)
		}
	}
	return out
}

func TestTrackingEmpty(t *testing.T) {
	r := adpNewTracking(t, nil, false)
	require.Empty(t, r.OutstandingAllocations())
	require.Zero(t, r.AllocatedBytes())
	require.Empty(t, r.OutstandingAllocationsString())
}

func TestTrackingAllFreed(t *testing.T) {
	for _, u := range adpUpstreams() {
		t.Run(u.name, func(t *testing.T) {
			r := adpNewTracking(t, u.new(), false)
			var ps []DevicePtr
			for range 10 {
				ps = append(ps, adpAlloc(t, r, 10*kiB))
			}
			require.Equal(t, 100*kiB, r.AllocatedBytes())
			require.Len(t, r.OutstandingAllocations(), 10)
			for _, p := range ps {
				adpFree(t, r, p, 10*kiB)
			}
			require.Empty(t, r.OutstandingAllocations())
			require.Zero(t, r.AllocatedBytes())
		})
	}
}

// librmm's AllocationsLeftWithStacks / WithoutStacks: half freed; the other half is listed,
// sorted by pointer, with a stack exactly when stacks are captured.
func TestTrackingAllocationsLeft(t *testing.T) {
	for _, stacks := range []bool{false, true} {
		for _, u := range adpUpstreams() {
			t.Run(fmt.Sprintf("%s/stacks=%v", u.name, stacks), func(t *testing.T) {
				r := adpNewTracking(t, u.new(), stacks)
				var ps []DevicePtr
				for i := range 10 {
					ps = append(ps, adpAlloc(t, r, (i+1)*kiB))
				}
				want := map[DevicePtr]int{}
				for i, p := range ps {
					if i%2 == 0 {
						adpFree(t, r, p, (i+1)*kiB)
					} else {
						want[p] = (i + 1) * kiB
					}
				}
				out := r.OutstandingAllocations()
				require.Len(t, out, 5)
				require.Equal(t, (2+4+6+8+10)*kiB, r.AllocatedBytes())
				for i, a := range out {
					require.Equal(t, want[a.Ptr], a.Size)
					if i > 0 {
						require.Less(t, out[i-1].Ptr, a.Ptr, "sorted by pointer")
					}
					if !stacks {
						require.Nil(t, a.Stack)
						require.Nil(t, a.Frames())
						continue
					}
					require.NotEmpty(t, a.Stack)
					require.LessOrEqual(t, len(a.Stack), 64)
					frames := a.Frames()
					// The caller of Allocate is adpAlloc, a helper inside the package: Frames starts
					// at the first frame outside it, this test.
					require.Equal(t, "github.com/gormm/rmm.adpAlloc", runtime.FuncForPC(a.Stack[0]-1).Name())
					require.Contains(t, frames[0].Function, "TestTrackingAllocationsLeft")
					require.True(t, strings.HasSuffix(frames[0].File, "resource_tracking_test.go"), frames[0].File)
				}
				s := r.OutstandingAllocationsString()
				if stacks {
					require.Equal(t, 5, strings.Count(s, " : callstack:\n"))
					require.Regexp(t, `#0 in github.com/gormm/rmm\.TestTrackingAllocationsLeft\.func1 at .*resource_tracking_test\.go:\d+\n`, s)
				} else {
					require.Equal(t, 5, strings.Count(s, "\n"))
					require.NotContains(t, s, "callstack")
				}
			})
		}
	}
}

// The text: one line per allocation in ascending pointer order, "0x…: <size> B".
func TestTrackingOutstandingAllocationsString(t *testing.T) {
	up := newAdpScriptUpstream(0x7f0000001000, 0x300, 0xabc00)
	r := adpNewTracking(t, up, false)
	adpAlloc(t, r, 100)
	adpAlloc(t, r, 5)
	adpAlloc(t, r, 1<<20)
	require.Equal(t, "0x300: 5 B\n0xabc00: 1048576 B\n0x7f0000001000: 100 B\n", r.OutstandingAllocationsString())

	stacked := adpNewTracking(t, newAdpScriptUpstream(0x1000), true)
	adpAlloc(t, stacked, 7)
	s := stacked.OutstandingAllocationsString()
	require.Regexp(t, regexp.MustCompile(`^0x1000: 7 B : callstack:\n#0 in github\.com/gormm/rmm\.TestTrackingOutstandingAllocationsString at \S+resource_tracking_test\.go:\d+\n`), s)
	require.True(t, strings.HasSuffix(s, "\n"))
}

func TestTrackingLogOutstandingAllocations(t *testing.T) {
	h := adpCaptureLog(t)
	r := adpNewTracking(t, newAdpScriptUpstream(0x2000), false)
	p := adpAlloc(t, r, 10*miB)
	r.LogOutstandingAllocations()
	require.Equal(t, []string{"rmm: TrackingResourceAdaptor: Outstanding Allocations: 0x2000: 10485760 B\n"}, adpMessages(h, slog.LevelDebug))
	adpFree(t, r, p, 10*miB)

	// Nothing is written when Debug is off.
	var w adpCountingWriter
	prev := SetDebugLogger(slog.New(slog.NewTextHandler(&w, &slog.HandlerOptions{Level: slog.LevelWarn})))
	defer SetDebugLogger(prev)
	r.LogOutstandingAllocations()
	require.Zero(t, w.n)
}

type adpCountingWriter struct{ n int }

func (w *adpCountingWriter) Write(p []byte) (int, error) { w.n += len(p); return len(p), nil }

// librmm's MultiTracking and NegativeInnerTracking: stacked adaptors each record what goes
// through them; frees through the inner one of the outer one's memory are logged as untracked,
// change nothing in the inner one, and still reach the outer one.
func TestTrackingStackedAdaptors(t *testing.T) {
	h := adpCaptureLog(t)
	for _, u := range adpUpstreams() {
		t.Run(u.name, func(t *testing.T) {
			outer := adpNewTracking(t, u.new(), true)
			var ps []DevicePtr
			for range 10 {
				ps = append(ps, adpAlloc(t, outer, 10*kiB))
			}
			inner := adpNewTracking(t, outer, false)
			for range 5 {
				ps = append(ps, adpAlloc(t, inner, 10*kiB))
			}
			require.Len(t, outer.OutstandingAllocations(), 15)
			require.Len(t, inner.OutstandingAllocations(), 5)
			require.Equal(t, 150*kiB, outer.AllocatedBytes())
			require.Equal(t, 50*kiB, inner.AllocatedBytes())
			require.NotEmpty(t, outer.OutstandingAllocationsString())

			before := len(adpMessages(h, slog.LevelError))
			for _, p := range ps {
				adpFree(t, inner, p, 10*kiB)
			}
			require.Empty(t, outer.OutstandingAllocations())
			require.Empty(t, inner.OutstandingAllocations())
			require.Zero(t, outer.AllocatedBytes())
			require.Zero(t, inner.AllocatedBytes(), "untracked frees do not underflow")
			msgs := adpMessages(h, slog.LevelError)[before:]
			require.Len(t, msgs, 10)
			require.Equal(t, fmt.Sprintf("rmm: TrackingResourceAdaptor: Deallocating a pointer that was not tracked. Ptr: %#x [10240 B], Current Num. Allocations: 5", uintptr(ps[0])), msgs[0])
			require.Contains(t, msgs[9], "Current Num. Allocations: 5", "the outer allocations are freed first")
		})
	}
}

// librmm's DeallocWrongBytes: a wrong size is logged and the tracked one used, for the count and
// for the upstream's free (which checks it).
func TestTrackingWrongSize(t *testing.T) {
	h := adpCaptureLog(t)
	up := newTestResource()
	r := adpNewTracking(t, up, false)
	var ps []DevicePtr
	for range 10 {
		ps = append(ps, adpAlloc(t, r, 10*kiB))
	}
	for _, p := range ps {
		adpFree(t, r, p, 5*kiB)
	}
	require.Empty(t, r.OutstandingAllocations())
	require.Zero(t, r.AllocatedBytes())
	_, frees, live := up.counts()
	require.Equal(t, 10, frees)
	require.Zero(t, live)
	msgs := adpMessages(h, slog.LevelError)
	require.Len(t, msgs, 10)
	require.Equal(t, "rmm: TrackingResourceAdaptor: Alloc bytes (10240) and Dealloc bytes (5120) do not match", msgs[0])
}

func TestTrackingZeroSizesNotTracked(t *testing.T) {
	up := newAdpScriptUpstream()
	r := adpNewTracking(t, up, true)
	p := adpAlloc(t, r, 0)
	require.Zero(t, p)
	require.Empty(t, r.OutstandingAllocations())
	adpFree(t, r, 0, 0)
	require.Zero(t, r.AllocatedBytes())
	allocs, frees := up.calls()
	require.Equal(t, []adpCall{{0, 0}}, allocs)
	require.Equal(t, []adpCall{{0, 0}}, frees)

	_, err := r.Allocate(-1, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, r.Deallocate(0x100, -1, DefaultStream), ErrInvalidArgument)
}

// An upstream that hands out an address the adaptor still tracks (memory freed behind its back):
// the new memory goes back to the upstream and the error wraps ErrInvalidFree; nothing changes.
func TestTrackingDuplicatePointer(t *testing.T) {
	up := newAdpScriptUpstream(0x4000)
	r := adpNewTracking(t, up, false)
	p := adpAlloc(t, r, 512)
	require.NoError(t, up.Deallocate(p, 512, DefaultStream)) // behind the adaptor's back
	up.next = []DevicePtr{0x4000}
	_, err := r.Allocate(1024, DefaultStream)
	require.ErrorIs(t, err, ErrInvalidFree)
	require.ErrorContains(t, err, "already tracked")
	require.Zero(t, up.liveCount(), "the duplicate was given back")
	require.Equal(t, []TrackedAllocation{{Ptr: 0x4000, Size: 512}}, r.OutstandingAllocations())
	require.Equal(t, 512, r.AllocatedBytes())
}

// A free the upstream refuses leaves the record in place.
func TestTrackingUpstreamFreeFails(t *testing.T) {
	up := newAdpFaultUpstream(NewSystemMemoryResource())
	r := adpNewTracking(t, up, false)
	p := adpAlloc(t, r, 300)
	up.failNextFrees(1)
	require.ErrorIs(t, r.Deallocate(p, 300, DefaultStream), errAdpInjected)
	require.Equal(t, []TrackedAllocation{{Ptr: p, Size: 300}}, r.OutstandingAllocations())
	require.Equal(t, 300, r.AllocatedBytes())
	adpFree(t, r, p, 300)
	require.Zero(t, r.AllocatedBytes())

	up.failNextAllocs(1, nil)
	_, err := r.Allocate(300, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Empty(t, r.OutstandingAllocations())
}

// librmm's MultiThreaded (ABA): a free drops its record before the upstream can hand the address
// out again, so another goroutine's allocation of it is tracked without complaint.
func TestTrackingFreeBeforeUpstream(t *testing.T) {
	for _, size := range []int{0, 256} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			h := adpCaptureLog(t)
			up := newAdpReuseUpstream()
			r := adpNewTracking(t, up, false)
			p0, p1, errs := adpInterleave(r, up, size, nil)
			for _, err := range errs {
				require.NoError(t, err)
			}
			if size > 0 {
				require.Equal(t, p0, p1)
			}
			require.Empty(t, r.OutstandingAllocations())
			require.Zero(t, r.AllocatedBytes())
			require.Empty(t, adpMessages(h, slog.LevelError))
		})
	}
}

func TestTrackingConcurrent(t *testing.T) {
	up := newAdpReuseUpstream()
	r := adpNewTracking(t, up, true)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 500 {
				n := 256 * (1 + (g+i)%7)
				p, err := r.Allocate(n, DefaultStream)
				if err != nil {
					t.Error(err)
					return
				}
				if err := r.Deallocate(p, n, DefaultStream); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	require.Empty(t, r.OutstandingAllocations())
	require.Zero(t, r.AllocatedBytes())
}

func TestTrackingForwarding(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 20)
	r := adpNewTracking(t, sim, false)
	require.Same(t, sim, r.Upstream())
	require.Equal(t, Access(0), r.Access())
	require.Equal(t, CurrentDevice(), r.Device())
}

func TestTrackingNoAllocationWithoutStacks(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 30)
	r := adpNewTracking(t, sim, false)
	adpFree(t, r, adpAlloc(t, r, 4096), 4096)
	n := testing.AllocsPerRun(100, func() {
		p, err := r.Allocate(4096, DefaultStream)
		if err != nil {
			panic(err)
		}
		if err := r.Deallocate(p, 4096, DefaultStream); err != nil {
			panic(err)
		}
	})
	require.Zero(t, n)
}
