package rmmtest_test

import (
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/rmmtest"
	"github.com/stretchr/testify/require"
)

// The package's StatisticsResourceAdaptor counts a zero-byte allocation and its free (as
// librmm's does), with its Stats method in sight of the suite: the suite frees only the
// zero-byte allocations it made, each once, so the adaptor's counts come back to where they were.
func TestStatisticsAdaptorWithStats(t *testing.T) {
	build := func(up rmm.MemoryResource) (rmm.MemoryResource, error) { return rmm.NewStatisticsResourceAdaptor(up) }
	opts := rmmtest.Options{Upstream: bigSimulated, IgnoresStreams: true, HoldsNothingBack: true, MaxAllocationSize: 64 << 10, Sequences: 20}
	require.NoError(t, rmmtest.Check(build, &opts))
}

// callCounting passes everything to its upstream and counts the calls to Allocate, refused ones
// included, in its Stats.
type callCounting struct {
	up    rmm.MemoryResource
	calls *atomic.Int64
}

func (c callCounting) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	c.calls.Add(1)
	if n < 0 {
		return 0, fmt.Errorf("callCounting: size %d: %w", n, rmm.ErrInvalidArgument)
	}
	return c.up.Allocate(n, s)
}
func (c callCounting) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	return c.up.Deallocate(p, n, s)
}
func (c callCounting) Upstream() rmm.MemoryResource { return c.up }
func (c callCounting) Stats() int64                 { return c.calls.Load() }

// A Stats that counts refused calls fails, and the failure says why Stats is compared and how to
// leave a method out of the comparison.
func TestStatsCountingRefusedCallsFails(t *testing.T) {
	build := func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
		return callCounting{up, new(atomic.Int64)}, nil
	}
	opts := rmmtest.Options{Upstream: bigSimulated, IgnoresStreams: true, MaxAllocationSize: 64 << 10, Sequences: 5}
	err := rmmtest.Check(build, &opts)
	require.Error(t, err)
	require.Contains(t, err.Error(), "Check/NegativeSize: Allocate(-1, DefaultStream): rmmtest: Stats changed across a refused call, which must change nothing (the value of a Stats method with no arguments and one result, whatever its type, is compared before and after; a method that counts refused calls must be named otherwise")
}
