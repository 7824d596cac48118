package rmmtest

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/gormm/rmm"
	"github.com/stretchr/testify/require"
)

// streamCheckingResource is brokenResource that, for kind "rejectsClosed", refuses allocations
// on a closed Stream with rmm.ErrClosed as the package's resources do, and for kind
// "freeFailsOnClosed" also refuses frees on one. A closed Stream is seen from outside the package
// through StreamView.Query.
type streamCheckingResource struct {
	*brokenResource
	freeFails bool
}

func isClosedView(s rmm.StreamView) bool {
	_, err := s.Query()
	return errors.Is(err, rmm.ErrClosed)
}

func (r streamCheckingResource) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	if n > 0 && isClosedView(s) {
		return 0, fmt.Errorf("%w: streamCheckingResource.Allocate on %v", rmm.ErrClosed, s)
	}
	return r.brokenResource.Allocate(n, s)
}

func (r streamCheckingResource) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	if r.freeFails && p != 0 && isClosedView(s) {
		return fmt.Errorf("%w: streamCheckingResource.Deallocate on %v", rmm.ErrClosed, s)
	}
	return r.brokenResource.Deallocate(p, n, s)
}

func newStreamChecking(freeFails bool) buildFunc {
	return func(t tester, up rmm.MemoryResource) rmm.MemoryResource {
		return streamCheckingResource{newBroken("")(t, up).(*brokenResource), freeFails}
	}
}

// runClosedStream runs the ClosedStream check alone on a recorder.
func runClosedStream(t *testing.T, build buildFunc, opts Options) *recorder {
	t.Helper()
	opts.Seed = 3
	c, err := resolve(&opts)
	require.NoError(t, err)
	root := newRecorder("T")
	s := &suite{cfg: c, build: build}
	root.run(func(tb tester) { tb.Run("ClosedStream", s.testClosedStream) })
	return root
}

// ClosedStream fails a resource that hands out memory on a closed Stream unless it declares that
// it ignores streams, and one whose free on a closed Stream fails; it passes one that refuses
// allocations there and frees there as anywhere else.
func TestClosedStreamChecks(t *testing.T) {
	for _, tc := range []struct {
		name    string
		build   buildFunc
		opts    Options
		failing map[string]string // sub-test of ClosedStream -> part of its message
	}{
		{"accepts", newBroken(""), Options{Upstream: simulated},
			map[string]string{"AllocateOnClosed": "succeeded, want an error wrapping rmm.ErrClosed"}},
		{"acceptsDeclared", newBroken(""), Options{Upstream: simulated, IgnoresStreams: true}, nil},
		{"rejects", newStreamChecking(false), Options{Upstream: simulated}, nil},
		{"rejectsDeclared", newStreamChecking(false), Options{Upstream: simulated, IgnoresStreams: true}, nil},
		// Over an address-only upstream of its own: the failing frees leave blocks behind,
		// which must not stay in the table every SystemMemoryResource shares.
		{"freeFails", newStreamChecking(true), Options{Upstream: simulated},
			map[string]string{"FreeOnClosed": "on the closed Stream: Deallocate"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := runClosedStream(t, tc.build, tc.opts)
			for _, name := range []string{"FreeOnClosed", "FreeThenReuse", "AllocateOnClosed", "ForeignHandle"} {
				sub := root.find("ClosedStream/" + name)
				require.NotNil(t, sub, name)
				want, fails := tc.failing[name]
				require.Equal(t, fails, sub.Failed(), "%s: %v", name, sub.msgs)
				if fails {
					require.Contains(t, strings.Join(sub.msgs, "\n"), want, name)
				}
			}
		})
	}
}

// crossCounter counts the frees it is given on another stream than the allocation's.
type crossCounter struct {
	rmm.MemoryResource
	mu    sync.Mutex
	on    map[rmm.DevicePtr]rmm.StreamView
	cross atomic.Int64
}

func (c *crossCounter) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	p, err := c.MemoryResource.Allocate(n, s)
	if err == nil && p != 0 {
		c.mu.Lock()
		c.on[p] = s
		c.mu.Unlock()
	}
	return p, err
}

func (c *crossCounter) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	c.mu.Lock()
	a, ok := c.on[p]
	delete(c.on, p)
	c.mu.Unlock()
	if ok && a != s {
		c.cross.Add(1)
	}
	return c.MemoryResource.Deallocate(p, n, s)
}

// Every free the suite makes on another stream than the allocation's is first ordered after the
// allocating stream, unless the resource declares that it orders such frees itself.
func TestCrossStreamFreesOrdered(t *testing.T) {
	var ordered atomic.Int64
	var wrong atomic.Value
	orderFreeHook = func(from, to rmm.StreamView) {
		ordered.Add(1)
		if from == to {
			wrong.Store(fmt.Sprintf("a free on %v ordered after its own stream", to))
		}
	}
	defer func() { orderFreeHook = nil }()
	for _, declared := range []bool{false, true} {
		ordered.Store(0)
		var counters []*crossCounter
		var mu sync.Mutex
		build := func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
			c := &crossCounter{MemoryResource: rmm.NewSystemMemoryResource(), on: map[rmm.DevicePtr]rmm.StreamView{}}
			mu.Lock()
			counters = append(counters, c)
			mu.Unlock()
			return c, nil
		}
		err := Check(build, &Options{IgnoresStreams: true, OrdersCrossStreamFrees: declared, Seed: 11, Sequences: 30})
		require.NoError(t, err)
		var cross int64
		for _, c := range counters {
			cross += c.cross.Load()
		}
		require.Positive(t, cross, "the suite made no free on another stream")
		if declared {
			require.Zero(t, ordered.Load(), "OrdersCrossStreamFrees is set, yet the suite ordered frees")
		} else {
			require.Equal(t, cross, ordered.Load(), "frees on another stream than the allocation's, and frees the suite ordered")
		}
		require.Nil(t, wrong.Load())
	}
}
