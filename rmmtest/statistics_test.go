package rmmtest_test

import (
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
