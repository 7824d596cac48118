package rmm

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// adpUnsafeUpstream is a user's resource written without any locking: a plain map and counters.
// Used from several goroutines at once it races (the race detector reports it); behind a
// ThreadSafeResourceAdaptor it must not.
type adpUnsafeUpstream struct {
	next          DevicePtr
	live          map[DevicePtr]int
	allocs, frees int
}

func (u *adpUnsafeUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	if n == 0 {
		return 0, nil
	}
	u.next += DevicePtr(roundUp(n))
	u.live[u.next] = n
	u.allocs++
	return u.next, nil
}

func (u *adpUnsafeUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	if p == 0 {
		return nil
	}
	if u.live[p] != n {
		return ErrInvalidFree
	}
	delete(u.live, p)
	u.frees++
	return nil
}

func TestThreadSafeSerialisesAnUnsafeResource(t *testing.T) {
	up := &adpUnsafeUpstream{next: 1 << 30, live: map[DevicePtr]int{}}
	r, err := NewThreadSafeResourceAdaptor(up)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var held []adpCall
			for i := range 500 {
				n := 1 + (g+i)%1000
				p, err := r.Allocate(n, DefaultStream)
				if err != nil {
					t.Error(err)
					return
				}
				held = append(held, adpCall{p, n})
				if i%3 == 2 || i == 499 {
					for _, c := range held {
						if err := r.Deallocate(c.ptr, c.nbytes, DefaultStream); err != nil {
							t.Error(err)
							return
						}
					}
					held = held[:0]
				}
			}
		}()
	}
	wg.Wait()
	require.Equal(t, 8*500, up.allocs)
	require.Equal(t, 8*500, up.frees)
	require.Empty(t, up.live)
}

func TestThreadSafeForwards(t *testing.T) {
	up := newAdpFaultUpstream(newAdpScriptUpstream(0x5500))
	r, err := NewThreadSafeResourceAdaptor(up)
	require.NoError(t, err)
	require.Same(t, up, r.Upstream())
	require.Equal(t, DeviceAccessible, r.Access())
	require.Equal(t, CurrentDevice(), r.Device())
	p := adpAlloc(t, r, 77)
	require.Equal(t, DevicePtr(0x5500), p)
	up.failNextFrees(1)
	require.ErrorIs(t, r.Deallocate(p, 77, DefaultStream), errAdpInjected)
	adpFree(t, r, p, 77)
	up.failNextAllocs(1, nil)
	_, err = r.Allocate(10, DefaultStream)
	require.ErrorIs(t, err, ErrOutOfMemory)
}
