//go:build cgo

package callocator

import (
	"runtime"
	"testing"

	rmm "github.com/gormm/rmm"
	"github.com/gormm/rmm/callocator/internal/cthreads"
	"github.com/stretchr/testify/require"
)

// Eight C threads allocate, write, read back and free through the functions, over a pool on host
// memory: every call succeeds, no block is shared, and the statistics under the pool see every
// allocation and free.
func TestCThreadsOverPool(t *testing.T) {
	pool, err := rmm.NewPoolMemoryResource(rmm.NewSystemMemoryResource(), &rmm.PoolOptions{InitialPoolSize: 1 << 20})
	require.NoError(t, err)
	defer pool.Close()
	st, err := rmm.NewStatisticsResourceAdaptor(pool)
	require.NoError(t, err)
	a := New(st)
	defer a.Close()
	alloc, free, ctx := a.Funcs()
	failures, bad, msg := cthreads.Run(alloc, free, LastErrorFunc(), ctx, 8, 2000, true)
	require.Zero(t, failures, msg)
	require.Zero(t, bad)
	s := st.Stats()
	require.Equal(t, int64(16000), s.TotalCount)
	require.Zero(t, s.CurrentCount)
	require.Zero(t, s.CurrentBytes)
	require.NoError(t, pool.CheckInvariants())
	require.Zero(t, pool.Stats().LiveAllocations)
}

// Without a resource the functions use the device's (host memory here, without CUDA).
func TestCThreadsPerDeviceResource(t *testing.T) {
	if rmm.CUDAAvailable() == nil {
		t.Skip("writes the blocks from the host: host memory only")
	}
	st, err := rmm.NewStatisticsResourceAdaptor(rmm.NewSystemMemoryResource())
	require.NoError(t, err)
	prev, err := rmm.SetPerDeviceResource(0, st)
	require.NoError(t, err)
	defer rmm.SetPerDeviceResource(0, prev)
	a := New(nil)
	defer a.Close()
	alloc, free, ctx := a.Funcs()
	failures, bad, msg := cthreads.Run(alloc, free, LastErrorFunc(), ctx, 4, 500, true)
	require.Zero(t, failures, msg)
	require.Zero(t, bad)
	require.Equal(t, int64(2000), st.Stats().TotalCount)
	require.Zero(t, st.Stats().CurrentCount)
}

type panicky struct{ rmm.MemoryResource }

func (panicky) Allocate(int, rmm.StreamView) (rmm.DevicePtr, error) { panic("boom") }

// Failures come back as NULL and a message on the calling thread; nothing panics into C.
func TestErrors(t *testing.T) {
	runtime.LockOSThread() // the message is the calling thread's
	defer runtime.UnlockOSThread()
	lim, err := rmm.NewLimitingResourceAdaptor(rmm.NewSystemMemoryResource(), 1<<20, nil)
	require.NoError(t, err)
	a := New(lim)
	alloc, free, ctx := a.Funcs()
	lastErr := LastErrorFunc()

	p := cthreads.Alloc(alloc, ctx, 4096, 0, 0)
	require.NotZero(t, p)
	require.Zero(t, cthreads.Alloc(alloc, ctx, 2<<20, 0, 0))
	require.Contains(t, cthreads.LastError(lastErr), "out of memory")
	require.Zero(t, cthreads.Alloc(alloc, ctx, 64, 7, 0))
	require.Contains(t, cthreads.LastError(lastErr), "device 7, but the Allocator's resource is on device 0")
	require.Zero(t, cthreads.Alloc(alloc, ctx, 64, -1, 0))
	require.Contains(t, cthreads.LastError(lastErr), "device -1")
	st, err := rmm.NewStatisticsResourceAdaptor(lim)
	require.NoError(t, err)
	z := New(st)
	za, _, zctx := z.Funcs()
	require.Zero(t, cthreads.Alloc(za, zctx, 0, 0, 0), "0 bytes: NULL")
	require.Zero(t, st.Stats().TotalCount, "and the resource is not asked")
	z.Close()
	require.Contains(t, cthreads.LastError(lastErr), "device -1", "and no new error")

	cthreads.Free(free, ctx, p, 4095, 0, 0)
	require.Contains(t, cthreads.LastError(lastErr), "invalid free")
	cthreads.Free(free, ctx, p, 4096, 0, 0)
	require.Zero(t, lim.AllocatedBytes())
	cthreads.Free(free, ctx, 0, 64, 0, 0) // NULL: nothing

	a.Close()
	require.Zero(t, cthreads.Alloc(alloc, ctx, 64, 0, 0))
	require.Contains(t, cthreads.LastError(lastErr), "names no open Allocator")

	b := New(panicky{rmm.NewSystemMemoryResource()})
	defer b.Close()
	alloc, _, ctx = b.Funcs()
	require.Zero(t, cthreads.Alloc(alloc, ctx, 64, 0, 0))
	require.Contains(t, cthreads.LastError(lastErr), "panicked: boom")
}

// Errors are kept per thread: one thread's failure is not another's message.
func TestErrorsPerThread(t *testing.T) {
	lim, err := rmm.NewLimitingResourceAdaptor(rmm.NewSystemMemoryResource(), 1<<10, nil)
	require.NoError(t, err)
	a := New(lim)
	defer a.Close()
	alloc, _, ctx := a.Funcs()
	runtime.LockOSThread() // this goroutine's thread, held while the other one holds its own
	defer runtime.UnlockOSThread()
	before := cthreads.LastError(LastErrorFunc())
	failed, checked := make(chan string), make(chan struct{})
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		cthreads.Alloc(alloc, ctx, 12345, 0, 0)
		failed <- cthreads.LastError(LastErrorFunc())
		<-checked
	}()
	require.Contains(t, <-failed, "alloc(12345")
	require.Equal(t, before, cthreads.LastError(LastErrorFunc()), "not this thread's error")
	close(checked)
}
