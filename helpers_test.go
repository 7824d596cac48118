package rmm

// The helpers the package's tests share: upstreams that script, fail, limit or count calls,
// and the GPU guards.
//
// Rule: no test asserts while it holds a lock of the code under test (a pool's, a cache's, an
// arena's mu, a recording sink's). A failing require stops the goroutine with the lock held, and
// the test then hangs until its timeout instead of reporting the failure. Read under the lock
// into a local, or through underLock, and assert after Unlock. TestNoAssertUnderLock checks the
// rule over every test file: between a line `x.mu.Lock()` (or `x.lock.Lock()`) and its
// `Unlock()`, or after `defer x.mu.Unlock()` to the end of the function, there is no
// `require.`, `assert.`, `t.Fatal` or `t.Error`.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// requireGPU skips the test when no CUDA device is usable.
func requireGPU(t testing.TB) {
	t.Helper()
	if err := CUDAAvailable(); err != nil {
		t.Skipf("no CUDA device: %v", err)
	}
}

// testResource wraps an upstream (host memory by default), counts calls, checks every free
// against what it handed out, and fails allocations on demand.
type testResource struct {
	up MemoryResource

	mu         sync.Mutex
	live       map[DevicePtr]int
	allocs     int
	frees      int
	lastFreeS  StreamView
	lastAllocS StreamView
	failNext   int  // fail this many following allocations
	failAll    bool // fail every allocation
	freed      chan DevicePtr
}

func newTestResource() *testResource {
	return &testResource{up: NewSystemMemoryResource(), live: map[DevicePtr]int{}, freed: make(chan DevicePtr, 64)}
}

func (r *testResource) Allocate(n int, s StreamView) (DevicePtr, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.failAll || r.failNext > 0 {
		if r.failNext > 0 {
			r.failNext--
		}
		return 0, outOfMemory("testResource", n, nil)
	}
	p, err := r.up.Allocate(n, s)
	if err != nil {
		return 0, err
	}
	if p != 0 {
		r.live[p] = n
		r.allocs++
	}
	r.lastAllocS = s
	return p, nil
}

func (r *testResource) Deallocate(p DevicePtr, n int, s StreamView) error {
	if p == 0 {
		return nil
	}
	r.mu.Lock()
	size, ok := r.live[p]
	if !ok || size != n {
		r.mu.Unlock()
		return fmt.Errorf("%w: testResource: free of %#x with %d bytes (live: %v, size %d)", ErrInvalidFree, uintptr(p), n, ok, size)
	}
	delete(r.live, p)
	r.frees++
	r.lastFreeS = s
	r.mu.Unlock()
	err := r.up.Deallocate(p, n, s)
	select {
	case r.freed <- p:
	default:
	}
	return err
}

func (r *testResource) Upstream() MemoryResource { return r.up }

func (r *testResource) counts() (allocs, frees, live int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.allocs, r.frees, len(r.live)
}

func (r *testResource) liveBytes() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, v := range r.live {
		n += v
	}
	return n
}

func (r *testResource) setFailNext(n int) {
	r.mu.Lock()
	r.failNext = n
	r.mu.Unlock()
}

// recordHandler is a slog.Handler that keeps every record.
type recordHandler struct {
	mu      sync.Mutex
	records []slog.Record
	count   atomic.Int64
}

func (h *recordHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *recordHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	h.records = append(h.records, r.Clone())
	h.mu.Unlock()
	h.count.Add(1)
	return nil
}
func (h *recordHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *recordHandler) WithGroup(string) slog.Handler      { return h }

func (h *recordHandler) all() []map[string]any {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []map[string]any
	for _, r := range h.records {
		m := map[string]any{"msg": r.Message, "level": r.Level}
		r.Attrs(func(a slog.Attr) bool {
			m[a.Key] = a.Value.Any()
			return true
		})
		out = append(out, m)
	}
	return out
}

// limitedUpstream hands out address-only memory (a SimulatedMemoryResource) but refuses any
// allocation that would take its charged total above limit, charging each allocation rounded up
// to 256 bytes, as librmm's limiting adaptor does. It records every call.
type limitedUpstream struct {
	mu      sync.Mutex
	inner   *SimulatedMemoryResource
	limit   int
	charged int
	asked   []int // every size asked, granted or not
	granted []int
}

func newLimitedUpstream(limit int) *limitedUpstream {
	sim, _ := NewSimulatedMemoryResource(1 << 60)
	return &limitedUpstream{inner: sim, limit: limit}
}

func (u *limitedUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.asked = append(u.asked, n)
	c, _ := AlignUp(n, 256)
	if u.charged+c > u.limit {
		return 0, fmt.Errorf("%w: limited upstream: %d + %d > %d", ErrOutOfMemory, u.charged, c, u.limit)
	}
	p, err := u.inner.Allocate(n, s)
	if err != nil {
		return 0, err
	}
	u.charged += c
	u.granted = append(u.granted, n)
	return p, nil
}

func (u *limitedUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if err := u.inner.Deallocate(p, n, s); err != nil {
		return err
	}
	c, _ := AlignUp(n, 256)
	u.charged -= c
	return nil
}

func (u *limitedUpstream) Access() Access { return 0 }

// Test upstreams for the adaptors' tests: one that hands out chosen addresses and records every
// call, one that fails on demand, and one that reuses freed addresses at once and can hold a free
// inside the upstream, to force the interleavings librmm provokes with its delayed resource.

// adpCall is one call an upstream saw.
type adpCall struct {
	ptr    DevicePtr
	nbytes int
}

// adpScriptUpstream hands out the addresses queued in next (then, when none are queued, 256-byte
// aligned addresses of its own from 1<<40 up), with no memory behind them, and records every call.
// Frees of addresses it did not hand out, or with another size, are ErrInvalidFree.
type adpScriptUpstream struct {
	mu     sync.Mutex
	next   []DevicePtr
	bump   DevicePtr
	live   map[DevicePtr]int
	allocs []adpCall
	frees  []adpCall
	access Access
}

func newAdpScriptUpstream(next ...DevicePtr) *adpScriptUpstream {
	return &adpScriptUpstream{next: next, bump: 1 << 40, live: map[DevicePtr]int{}, access: DeviceAccessible}
}

func (u *adpScriptUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.allocs = append(u.allocs, adpCall{0, n})
	if n == 0 {
		return 0, nil
	}
	var p DevicePtr
	if len(u.next) > 0 {
		p, u.next = u.next[0], u.next[1:]
	} else {
		p = u.bump
		u.bump += DevicePtr(roundUp(n))
	}
	u.allocs[len(u.allocs)-1].ptr = p
	u.live[p] = n
	return p, nil
}

func (u *adpScriptUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.frees = append(u.frees, adpCall{p, n})
	if p == 0 && n == 0 {
		return nil
	}
	if size, ok := u.live[p]; !ok || size != n {
		return fmt.Errorf("%w: adpScriptUpstream: free of %#x with %d bytes (live %v, size %d)", ErrInvalidFree, uintptr(p), n, ok, size)
	}
	delete(u.live, p)
	return nil
}

func (u *adpScriptUpstream) Access() Access { return u.access }

func (u *adpScriptUpstream) calls() (allocs, frees []adpCall) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]adpCall(nil), u.allocs...), append([]adpCall(nil), u.frees...)
}

func (u *adpScriptUpstream) liveCount() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.live)
}

// errAdpInjected is the non-memory error adpFaultUpstream returns when asked for one.
var errAdpInjected = errors.New("injected upstream failure")

// adpFaultUpstream forwards to inner but fails the next failAllocs allocations with allocErr
// (default: an ErrOutOfMemory error) and the next failFrees frees with errAdpInjected (the free
// is then not made). It counts the calls that reached it.
type adpFaultUpstream struct {
	inner MemoryResource

	mu           sync.Mutex
	failAllocs   int
	allocErr     error
	failFrees    int
	allocCalls   int
	deallocCalls int
}

func newAdpFaultUpstream(inner MemoryResource) *adpFaultUpstream {
	return &adpFaultUpstream{inner: inner}
}

func (u *adpFaultUpstream) failNextAllocs(n int, err error) {
	u.mu.Lock()
	u.failAllocs, u.allocErr = n, err
	u.mu.Unlock()
}

func (u *adpFaultUpstream) failNextFrees(n int) {
	u.mu.Lock()
	u.failFrees = n
	u.mu.Unlock()
}

func (u *adpFaultUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	u.mu.Lock()
	u.allocCalls++
	if u.failAllocs > 0 {
		u.failAllocs--
		err := u.allocErr
		u.mu.Unlock()
		if err == nil {
			err = outOfMemory("adpFaultUpstream", n, nil)
		}
		return 0, err
	}
	u.mu.Unlock()
	return u.inner.Allocate(n, s)
}

func (u *adpFaultUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	u.mu.Lock()
	u.deallocCalls++
	if u.failFrees > 0 {
		u.failFrees--
		u.mu.Unlock()
		return errAdpInjected
	}
	u.mu.Unlock()
	return u.inner.Deallocate(p, n, s)
}

func (u *adpFaultUpstream) Upstream() MemoryResource { return u.inner }

func (u *adpFaultUpstream) callCounts() (allocs, deallocs int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.allocCalls, u.deallocCalls
}

// adpReuseUpstream hands out addresses without memory and reuses a freed address at once for
// the next allocation (last freed, first reused), as a pool does. A free is made (the address
// becomes reusable) before onFree, when set, is called, still inside Deallocate: a hook that
// blocks holds the freeing goroutine in the window where the address can already be handed out
// again but the adaptor above has not returned from the free (librmm's delayed_memory_resource,
// without timing). It rejects frees of addresses that are not live, so an adaptor that forwards a
// free twice or with a wrong pointer is caught.
type adpReuseUpstream struct {
	mu     sync.Mutex
	free   []DevicePtr
	next   DevicePtr
	live   map[DevicePtr]int
	onFree func(p DevicePtr)
	reused int
}

func newAdpReuseUpstream() *adpReuseUpstream {
	return &adpReuseUpstream{next: 1<<41 + 256, live: map[DevicePtr]int{}}
}

// adpReuseSlot is the size of every address range handed out: enough for the tests'
// allocations. Ranges start 256 bytes past a 16 MiB boundary: 256-aligned, and no more.
const adpReuseSlot = 16 << 20

func (u *adpReuseUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	if n == 0 {
		return 0, nil
	}
	if n > adpReuseSlot {
		return 0, outOfMemory("adpReuseUpstream", n, nil)
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	var p DevicePtr
	if k := len(u.free); k > 0 {
		p, u.free = u.free[k-1], u.free[:k-1]
		u.reused++
	} else {
		p = u.next
		u.next += adpReuseSlot
	}
	u.live[p] = n
	return p, nil
}

func (u *adpReuseUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	if p == 0 {
		return nil
	}
	u.mu.Lock()
	size, ok := u.live[p]
	if !ok || size != n {
		u.mu.Unlock()
		return fmt.Errorf("%w: adpReuseUpstream: free of %#x with %d bytes (live %v, size %d)", ErrInvalidFree, uintptr(p), n, ok, size)
	}
	delete(u.live, p)
	u.free = append(u.free, p)
	hook := u.onFree
	u.mu.Unlock()
	if hook != nil {
		hook(p)
	}
	return nil
}

func (u *adpReuseUpstream) Access() Access { return 0 }

func (u *adpReuseUpstream) setOnFree(f func(DevicePtr)) {
	u.mu.Lock()
	u.onFree = f
	u.mu.Unlock()
}

func (u *adpReuseUpstream) counts() (live, reused int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.live), u.reused
}

// adpInterleave runs librmm's two-thread interleaving over mr, without timing:
//
//	goroutine 0: allocate; ... free (held inside the upstream after the address is freed) ...
//	goroutine 1:            allocate (gets the address back); free; done
//	goroutine 0: ... free returns
//
// up must be mr's upstream at the bottom (the one whose frees are held). It returns the two
// pointers and the errors of the four calls. check, when set, runs while goroutine 0 is held.
func adpInterleave(mr MemoryResource, up *adpReuseUpstream, nbytes int, check func()) (p0, p1 DevicePtr, errs [4]error) {
	held := make(chan struct{})
	release := make(chan struct{})
	var first atomic.Bool
	up.setOnFree(func(DevicePtr) {
		if first.CompareAndSwap(false, true) {
			close(held)
			<-release
		}
	})
	defer up.setOnFree(nil)
	done0 := make(chan struct{})
	p0, errs[0] = mr.Allocate(nbytes, DefaultStream)
	go func() {
		defer close(done0)
		errs[1] = mr.Deallocate(p0, nbytes, DefaultStream)
	}()
	if nbytes > 0 {
		<-held // goroutine 0 is inside the upstream's free, after the address was freed
	} else {
		// A zero-byte free never reaches the upstream's hook: let goroutine 0 finish.
		<-done0
	}
	p1, errs[2] = mr.Allocate(nbytes, DefaultStream)
	errs[3] = mr.Deallocate(p1, nbytes, DefaultStream)
	if check != nil {
		check()
	}
	close(release)
	<-done0
	return p0, p1, errs
}

// The adaptors' tests.

// adpUpstreams are the upstreams every adaptor is tested over: real host memory and addresses
// without memory (which lets sizes be large).
func adpUpstreams() []struct {
	name string
	new  func() MemoryResource
} {
	return []struct {
		name string
		new  func() MemoryResource
	}{
		{"system", func() MemoryResource { return NewSystemMemoryResource() }},
		{"simulated", func() MemoryResource { sim, _ := NewSimulatedMemoryResource(1 << 40); return sim }},
	}
}

func adpAlloc(t *testing.T, mr MemoryResource, n int) DevicePtr {
	t.Helper()
	p, err := mr.Allocate(n, DefaultStream)
	require.NoError(t, err)
	if n > 0 {
		require.NotZero(t, p)
	}
	return p
}

func adpFree(t *testing.T, mr MemoryResource, p DevicePtr, n int) {
	t.Helper()
	require.NoError(t, mr.Deallocate(p, n, DefaultStream))
}

// underLock returns f() computed with mu held, for a test to assert on after mu is unlocked.
func underLock[T any](mu sync.Locker, f func() T) T {
	mu.Lock()
	defer mu.Unlock()
	return f()
}
