package rmm

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
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
