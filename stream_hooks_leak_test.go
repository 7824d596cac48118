package rmm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A long-lived Stream used by resources that are made and closed one after another (a resource
// per request, over a stream of a StreamPool) must not keep every closed resource reachable
// through its close hooks.
func TestStreamCloseHooksDoNotAccumulateClosedResources(t *testing.T) {
	s, err := NewStream(0, nil)
	require.NoError(t, err)
	defer s.Close()
	host := NewSystemMemoryResource()
	for range 100 {
		f, err := NewFixedSizeMemoryResource(host, &FixedSizeOptions{BlockSize: 256, BlocksToPreallocate: 4})
		require.NoError(t, err)
		p, err := f.Allocate(256, s.View())
		require.NoError(t, err)
		require.NoError(t, f.Deallocate(p, 256, s.View()))
		require.NoError(t, f.Close())

		pool, err := NewPoolMemoryResource(host, &PoolOptions{InitialPoolSize: 1 << 20})
		require.NoError(t, err)
		p, err = pool.Allocate(256, s.View())
		require.NoError(t, err)
		require.NoError(t, pool.Deallocate(p, 256, s.View()))
		require.NoError(t, pool.Close())
	}
	s.mu.Lock()
	n := len(s.hooks)
	s.mu.Unlock()
	require.LessOrEqual(t, n, 2, "close hooks held by the stream after 200 resources were closed")
}
