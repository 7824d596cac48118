package rmm

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// gcSlowSource is a SpanSource whose Span() lets the collector run (any user code may).
type gcSlowSource struct {
	src    DeviceSpan[uint8]
	during func()
}

func (s gcSlowSource) Span() DeviceSpan[uint8] {
	s.during()
	return s.src
}

//go:noinline
func gcCopyIntoDropped(pool MemoryResource, src SpanSource[uint8]) error {
	dst, err := NewUvector[uint8](4096, DefaultStream, pool)
	if err != nil {
		return err
	}
	return dst.CopyFrom(src, DefaultStream) // dst's last use; the caller never closes it (a leak)
}

// A container is collected while its own method runs: the cleanup frees its memory to the pool,
// another allocation receives it, and the method then writes into that other allocation.
func TestContainerKeptAliveDuringCopyFrom(t *testing.T) {
	pool, err := NewPoolMemoryResource(NewSystemMemoryResource(), nil)
	require.NoError(t, err)
	defer pool.Close()

	src, err := NewUvector[uint8](4096, DefaultStream, nil)
	require.NoError(t, err)
	defer src.Close()
	require.NoError(t, src.Fill(0xAA, DefaultStream))

	var victim *Uvector[uint8]
	during := func() {
		for i := 0; i < 100 && pool.Stats().LiveAllocations > 0; i++ {
			runtime.GC()
			time.Sleep(time.Millisecond)
		}
		// another goroutine's allocation, elsewhere in the program
		victim, err = NewUvector[uint8](4096, DefaultStream, pool)
		require.NoError(t, err)
		require.NoError(t, victim.Fill(0, DefaultStream))
	}
	require.NoError(t, gcCopyIntoDropped(pool, gcSlowSource{src.Span(), during}))
	defer victim.Close()
	got, err := victim.ToSlice(DefaultStream)
	require.NoError(t, err)
	require.Equal(t, uint8(0), got[0], "victim (never written after Fill(0)) was overwritten by a dead vector's CopyFrom")
}

// gcGCOnAlloc collects garbage before each allocation, as an OOM-retry adaptor that frees
// leaked containers would (RMM's failure_callback_resource_adaptor pattern).
type gcGCOnAlloc struct {
	MemoryResource
}

func (r *gcGCOnAlloc) Allocate(n int, s StreamView) (DevicePtr, error) {
	for i := 0; i < 5; i++ {
		runtime.GC()
		time.Sleep(2 * time.Millisecond)
	}
	return r.MemoryResource.Allocate(n, s)
}
func (r *gcGCOnAlloc) Access() Access { return HostAccessible }

//go:noinline
func gcGrowAndDrop(mr MemoryResource) error {
	v, err := NewUvector[int64](1000, DefaultStream, mr)
	if err != nil {
		return err
	}
	return v.Resize(100000, DefaultStream) // v's last use; v is never closed (a leak, reclaimed by its cleanup)
}

func TestContainerKeptAliveDuringResize(t *testing.T) {
	pool := gcPool(t, NewSystemMemoryResource(), nil)
	logs := captureDebugLog(t)
	mr := &gcGCOnAlloc{MemoryResource: pool}
	err := gcGrowAndDrop(mr)
	// let any later cleanup run
	for i := 0; i < 10; i++ {
		runtime.GC()
		time.Sleep(5 * time.Millisecond)
	}
	for _, r := range logs.all() {
		t.Logf("debug log: %v", r)
	}
	t.Logf("Resize returned %v; pool %+v", err, pool.Stats())
	require.NoError(t, err, "Resize of a vector failed because its own cleanup freed it mid-call")
	require.Zero(t, pool.Stats().LiveAllocations, "memory leaked for good: the cleanup ran before Resize installed the new allocation")
}

func gcPool(t *testing.T, up MemoryResource, o *PoolOptions) *PoolMemoryResource {
	t.Helper()
	p, err := NewPoolMemoryResource(up, o)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}
