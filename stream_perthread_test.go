package rmm_test

import (
	"runtime"
	"sync"
	"testing"

	"github.com/gormm/rmm"
	"github.com/stretchr/testify/require"
)

// A goroutine locked to its OS thread gets the same per-thread default stream every time; another
// locked goroutine (another thread) gets another one. A pool keeps their memory apart, and work on
// each stream is ordered: a vector filled on one thread's stream reads back on it.
func TestPerThreadDefaultStream(t *testing.T) {
	if runtime.GOOS != "linux" {
		_, err := rmm.PerThreadDefaultStream()
		require.ErrorIs(t, err, rmm.ErrNotSupported)
		t.Skip("thread ids: Linux only")
	}
	pool, err := rmm.NewPoolMemoryResource(nil, &rmm.PoolOptions{Expandable: true, Stitch: true})
	require.NoError(t, err)
	defer pool.Close()

	const n = 4
	views := make([]rmm.StreamView, n)
	var wg, held sync.WaitGroup
	held.Add(n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			s, err := rmm.PerThreadDefaultStream()
			// Every goroutine holds its thread until all have their views: a thread a goroutine
			// let go of could serve the next one.
			held.Done()
			held.Wait()
			if err != nil {
				errs[i] = err
				return
			}
			again, _ := rmm.PerThreadDefaultStream()
			if again != s {
				errs[i] = errorString("two views on one locked thread differ")
				return
			}
			views[i] = s
			v, err := rmm.NewUvector[int32](1<<16, s, pool)
			if err != nil {
				errs[i] = err
				return
			}
			defer v.Close()
			if err := v.Fill(int32(i+1), s); err != nil {
				errs[i] = err
				return
			}
			got, err := v.ToSlice(s)
			if err != nil {
				errs[i] = err
				return
			}
			if got[0] != int32(i+1) || got[len(got)-1] != int32(i+1) {
				errs[i] = errorString("read back another value than filled")
			}
		}()
	}
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i], "goroutine %d", i)
		require.False(t, views[i].IsDefault())
		require.Contains(t, views[i].String(), "PerThreadDefaultStream(thread ")
		if rmm.CUDAAvailable() == nil {
			require.Equal(t, uintptr(2), views[i].Handle(), "CU_STREAM_PER_THREAD")
		}
		for j := range i {
			require.NotEqual(t, views[j], views[i], "threads %d and %d (locked goroutines run on different threads)", j, i)
		}
	}
	require.Zero(t, pool.Stats().LiveBytes)
	require.NoError(t, pool.CheckInvariants())
}

type errorString string

func (e errorString) Error() string { return string(e) }
