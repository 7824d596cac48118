package rmm

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// A Stream closing while the arena first serves it: the arena must not keep an arena for the
// closed stream.
func TestArenaStreamClosingWhileFirstUsed(t *testing.T) {
	sim, _ := NewSimulatedMemoryResource(1 << 40)
	a, err := NewArenaMemoryResource(sim, &ArenaOptions{ArenaSize: 64 << 20})
	require.NoError(t, err)
	defer a.Close()
	for i := 0; i < 2000; i++ {
		st, _ := NewStream(0, nil)
		v := st.View()
		var wg sync.WaitGroup
		var p DevicePtr
		var aerr error
		wg.Add(2)
		go func() { defer wg.Done(); p, aerr = a.Allocate(512, v) }()
		go func() { defer wg.Done(); st.Close() }()
		wg.Wait()
		if aerr == nil {
			require.NoError(t, a.Deallocate(p, 512, v))
		} else {
			require.ErrorIs(t, aerr, ErrClosed)
		}
		require.Zero(t, a.Stats().StreamArenas, "iteration %d: an arena was kept for a closed stream", i)
	}
	require.NoError(t, a.CheckInvariants())
}
