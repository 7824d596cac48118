package rmm

import (
	"errors"
	"fmt"
	"math/rand"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

type attackAlloc struct {
	ptr DevicePtr
	n   int
}

// attackPools makes each kind of pool, capped at limit bytes.
func attackPools(t *testing.T, limit int) map[string]func() *PoolMemoryResource {
	return map[string]func() *PoolMemoryResource{
		"plain": func() *PoolMemoryResource {
			sim, err := NewSimulatedMemoryResource(limit)
			require.NoError(t, err)
			p, err := NewPoolMemoryResource(sim, &PoolOptions{MaximumPoolSize: limit})
			require.NoError(t, err)
			return p
		},
		"plain-uncapped": func() *PoolMemoryResource {
			sim, err := NewSimulatedMemoryResource(limit)
			require.NoError(t, err)
			p, err := NewPoolMemoryResource(sim, nil)
			require.NoError(t, err)
			return p
		},
		"expandable": func() *PoolMemoryResource {
			return newExpTestPool(t, newSimVMM(64*kiB, limit), PoolOptions{})
		},
		"expandable-threshold": func() *PoolMemoryResource {
			return newExpTestPool(t, newSimVMM(64*kiB, limit), PoolOptions{ReleaseThreshold: 1 << 20})
		},
		"stitch": func() *PoolMemoryResource {
			return newExpTestPool(t, newSimVMM(64*kiB, limit), PoolOptions{Stitch: true})
		},
		"stitch-threshold": func() *PoolMemoryResource {
			return newExpTestPool(t, newSimVMM(64*kiB, limit), PoolOptions{Stitch: true, ReleaseThreshold: 512 << 10})
		},
	}
}

func attackSize(r *rand.Rand) int {
	switch r.Intn(8) {
	case 0:
		return 1 + r.Intn(8<<20)
	case 1, 2:
		return 1 + r.Intn(1<<20)
	case 3:
		return 256 * (1 + r.Intn(4))
	default:
		return []int{1000, 4096, 64 << 10, 300 << 10}[r.Intn(4)]
	}
}

// Goroutines on their own streams allocate and free, hand blocks to each other to free on their
// streams, and a Release, Stats and CheckInvariants run alongside. At the end every block is
// freed and Release empties the pool.
func TestAttackPoolConcurrentStreams(t *testing.T) {
	const workers, ops = 6, 400
	for name, mk := range attackPools(t, 48<<20) {
		t.Run(name, func(t *testing.T) {
			p := mk()
			streams := make([]*Stream, workers)
			for i := range streams {
				s, err := NewStream(0, nil)
				require.NoError(t, err)
				streams[i] = s
			}
			hand := make(chan attackAlloc, 64)
			var wg sync.WaitGroup
			errs := make(chan error, workers+2)
			done := make(chan struct{})
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func(w int) {
					defer wg.Done()
					r := rand.New(rand.NewSource(int64(w) + 1))
					s := streams[w].View()
					if w == 0 {
						s = DefaultStream
					}
					var live []attackAlloc
					for i := 0; i < ops; i++ {
						switch op := r.Intn(10); {
						case op < 5 || len(live) == 0:
							n := attackSize(r)
							ptr, err := p.Allocate(n, s)
							if err != nil {
								if !errors.Is(err, ErrOutOfMemory) {
									errs <- fmt.Errorf("worker %d Allocate(%d): %w", w, n, err)
									return
								}
								continue
							}
							live = append(live, attackAlloc{ptr, n})
						case op < 8:
							j := r.Intn(len(live))
							a := live[j]
							live[j] = live[len(live)-1]
							live = live[:len(live)-1]
							if err := p.Deallocate(a.ptr, a.n, s); err != nil {
								errs <- fmt.Errorf("worker %d Deallocate: %w", w, err)
								return
							}
						default:
							j := r.Intn(len(live))
							select {
							case hand <- live[j]:
								live[j] = live[len(live)-1]
								live = live[:len(live)-1]
							case a := <-hand:
								if err := p.Deallocate(a.ptr, a.n, s); err != nil {
									errs <- fmt.Errorf("worker %d Deallocate of a handed block: %w", w, err)
									return
								}
							default:
							}
						}
					}
					for _, a := range live {
						if err := p.Deallocate(a.ptr, a.n, s); err != nil {
							errs <- fmt.Errorf("worker %d final Deallocate: %w", w, err)
							return
						}
					}
				}(w)
			}
			var side sync.WaitGroup
			side.Add(1)
			go func() {
				defer side.Done()
				for {
					select {
					case <-done:
						return
					default:
					}
					if err := p.Release(); err != nil {
						errs <- fmt.Errorf("Release: %w", err)
						return
					}
					st := p.Stats()
					if st.FreeBytes < 0 || st.LiveBytes < 0 || st.PoolSize > 48<<20 {
						errs <- fmt.Errorf("Stats: %+v", st)
						return
					}
					if err := p.CheckInvariants(); err != nil {
						errs <- err
						return
					}
				}
			}()
			wg.Wait()
			close(done)
			side.Wait()
			close(hand)
			for a := range hand {
				require.NoError(t, p.Deallocate(a.ptr, a.n, DefaultStream))
			}
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			require.NoError(t, p.CheckInvariants())
			for _, s := range streams {
				require.NoError(t, s.Close())
			}
			require.NoError(t, p.CheckInvariants())
			require.NoError(t, p.Release())
			st := p.Stats()
			require.Zero(t, st.LiveAllocations, "%+v", st)
			require.Zero(t, st.LiveBytes)
			require.Zero(t, st.PoolSize, "%+v", st)
			require.NoError(t, p.Close())
		})
	}
}

// Streams close while other goroutines free blocks allocated on them (on the closed stream's
// view and on their own).
func TestAttackPoolStreamCloseWhileFreeing(t *testing.T) {
	for name, mk := range attackPools(t, 64<<20) {
		t.Run(name, func(t *testing.T) {
			p := mk()
			r := rand.New(rand.NewSource(7))
			for round := 0; round < 20; round++ {
				s, err := NewStream(0, nil)
				require.NoError(t, err)
				var blocks []attackAlloc
				for i := 0; i < 40; i++ {
					n := attackSize(r) / 4
					if n == 0 {
						n = 1
					}
					ptr, err := p.Allocate(n, s.View())
					if errors.Is(err, ErrOutOfMemory) {
						continue
					}
					require.NoError(t, err)
					blocks = append(blocks, attackAlloc{ptr, n})
				}
				// Some freed (and cached) on s before it closes.
				for len(blocks) > 30 {
					a := blocks[len(blocks)-1]
					blocks = blocks[:len(blocks)-1]
					require.NoError(t, p.Deallocate(a.ptr, a.n, s.View()))
				}
				var wg sync.WaitGroup
				half := len(blocks) / 2
				other, err := NewStream(0, nil)
				require.NoError(t, err)
				wg.Add(3)
				errs := make([]error, 3)
				go func() {
					defer wg.Done()
					for _, a := range blocks[:half] {
						if err := p.Deallocate(a.ptr, a.n, s.View()); err != nil {
							errs[0] = err
							return
						}
					}
				}()
				go func() {
					defer wg.Done()
					for _, a := range blocks[half:] {
						if err := p.Deallocate(a.ptr, a.n, other.View()); err != nil {
							errs[1] = err
							return
						}
					}
				}()
				go func() {
					defer wg.Done()
					errs[2] = s.Close()
				}()
				wg.Wait()
				for _, err := range errs {
					require.NoError(t, err)
				}
				_, err = p.Allocate(256, s.View())
				require.ErrorIs(t, err, ErrClosed)
				require.NoError(t, p.CheckInvariants())
				require.NoError(t, other.Close())
				require.NoError(t, p.CheckInvariants())
				st := p.Stats()
				require.Zero(t, st.LiveAllocations, "round %d: %+v", round, st)
				require.Equal(t, 1, st.Streams, "round %d: only the default stream's list is left: %+v", round, st)
			}
			require.NoError(t, p.Release())
			require.Zero(t, p.PoolSize())
			require.NoError(t, p.Close())
		})
	}
}

// Close runs while goroutines allocate and free: every Allocate either succeeds (and its free
// works after Close) or fails with ErrClosed or ErrOutOfMemory; once everything is freed the
// pool holds nothing.
func TestAttackPoolCloseDuringAllocations(t *testing.T) {
	for name, mk := range attackPools(t, 32<<20) {
		t.Run(name, func(t *testing.T) {
			for round := 0; round < 5; round++ {
				p := mk()
				const workers = 4
				var wg sync.WaitGroup
				start := make(chan struct{})
				lives := make([][]attackAlloc, workers)
				errs := make([]error, workers+1)
				streams := make([]*Stream, workers)
				for w := range streams {
					s, err := NewStream(0, nil)
					require.NoError(t, err)
					streams[w] = s
				}
				for w := 0; w < workers; w++ {
					wg.Add(1)
					go func(w int) {
						defer wg.Done()
						r := rand.New(rand.NewSource(int64(100*round + w)))
						s := streams[w].View()
						<-start
						closed := 0
						for i := 0; i < 300 && closed < 20; i++ {
							if len(lives[w]) > 0 && r.Intn(3) == 0 {
								a := lives[w][len(lives[w])-1]
								lives[w] = lives[w][:len(lives[w])-1]
								if err := p.Deallocate(a.ptr, a.n, s); err != nil {
									errs[w] = err
									return
								}
								continue
							}
							n := attackSize(r) / 2
							if n == 0 {
								n = 1
							}
							ptr, err := p.Allocate(n, s)
							switch {
							case err == nil:
								lives[w] = append(lives[w], attackAlloc{ptr, n})
							case errors.Is(err, ErrClosed):
								closed++
							case errors.Is(err, ErrOutOfMemory):
							default:
								errs[w] = err
								return
							}
						}
					}(w)
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					for i := 0; i < round*50; i++ {
						_ = p.Stats()
					}
					errs[workers] = p.Close()
				}()
				close(start)
				wg.Wait()
				for _, err := range errs {
					require.NoError(t, err)
				}
				require.NoError(t, p.CheckInvariants())
				_, err := p.Allocate(256, DefaultStream)
				require.ErrorIs(t, err, ErrClosed)
				for w, live := range lives {
					for i, a := range live {
						s := streams[w].View()
						if i%2 == 1 {
							s = DefaultStream
						}
						require.NoError(t, p.Deallocate(a.ptr, a.n, s))
						require.ErrorIs(t, p.Deallocate(a.ptr, a.n, s), ErrInvalidFree)
					}
					require.NoError(t, streams[w].Close())
				}
				require.NoError(t, p.CheckInvariants())
				st := p.Stats()
				require.Zero(t, st.LiveAllocations, "%+v", st)
				require.Zero(t, st.PoolSize, "%+v", st)
			}
		})
	}
}

// One goroutine, several streams, Release now and then: the invariants hold after every call,
// every free of a pointer freed already fails with ErrInvalidFree and changes nothing, and the
// pool empties at the end.
func TestAttackPoolSequentialStreams(t *testing.T) {
	for name, mk := range attackPools(t, 48<<20) {
		t.Run(name, func(t *testing.T) {
			for seed := int64(1); seed <= 30; seed++ {
				p := mk()
				r := rand.New(rand.NewSource(seed))
				var streams []*Stream
				views := []StreamView{DefaultStream}
				for range 4 {
					s, err := NewStream(0, nil)
					require.NoError(t, err)
					streams = append(streams, s)
					views = append(views, s.View())
				}
				var live, freed []attackAlloc
				for i := 0; i < 200; i++ {
					s := views[r.Intn(len(views))]
					switch op := r.Intn(12); {
					case op == 0:
						require.NoError(t, p.Release())
					case op == 1 && len(freed) > 0:
						a := freed[r.Intn(len(freed))]
						if p.live.get(a.ptr) != nil || p.takeIssuedPeek(a.ptr) {
							continue // handed out again since
						}
						before := p.Stats()
						require.ErrorIs(t, p.Deallocate(a.ptr, a.n, s), ErrInvalidFree, "seed %d op %d", seed, i)
						require.Equal(t, before, p.Stats())
					case op < 7 || len(live) == 0:
						n := attackSize(r)
						ptr, err := p.Allocate(n, s)
						if err != nil {
							require.ErrorIs(t, err, ErrOutOfMemory, "seed %d op %d", seed, i)
							continue
						}
						live = append(live, attackAlloc{ptr, n})
					default:
						j := r.Intn(len(live))
						a := live[j]
						live[j] = live[len(live)-1]
						live = live[:len(live)-1]
						require.NoError(t, p.Deallocate(a.ptr, a.n, s), "seed %d op %d", seed, i)
						freed = append(freed, a)
					}
					require.NoError(t, p.CheckInvariants(), "seed %d op %d", seed, i)
				}
				for _, a := range live {
					require.NoError(t, p.Deallocate(a.ptr, a.n, DefaultStream))
				}
				for _, s := range streams {
					require.NoError(t, s.Close())
				}
				require.NoError(t, p.Release())
				st := p.Stats()
				require.Zero(t, st.PoolSize, "seed %d: %+v", seed, st)
				require.NoError(t, p.Close())
			}
		})
	}
}

// takeIssuedPeek reports whether a stream's cache handed ptr out (test helper, no change).
func (p *PoolMemoryResource) takeIssuedPeek(ptr DevicePtr) bool {
	m := p.caches.Load()
	if m == nil {
		return false
	}
	for _, c := range m.all() {
		c.mu.Lock()
		b := c.issued.get(ptr)
		c.mu.Unlock()
		if b != nil {
			return true
		}
	}
	return false
}
