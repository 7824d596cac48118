package rmm

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// A Stream closed while another goroutine reads the arena's figures: the closing stream's
// superblocks, on their way to the global arena, are always seen in one arena or the other, so
// CheckInvariants holds and Stats' free and live bytes add up to the arena at every instant.
func TestArenaStreamCloseWhileCheckingFigures(t *testing.T) {
	arena, err := NewArenaMemoryResource(NewSystemMemoryResource(), &ArenaOptions{ArenaSize: 64 << 20, DefaultStreamArenas: 1})
	require.NoError(t, err)
	defer arena.Close()
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer stop.Store(true)
		for i := 0; i < 3000 && !t.Failed(); i++ {
			st, err := NewStream(0, nil)
			if !assertNoErr(t, err) {
				return
			}
			// One block stays live over the Close, so that the stream's arena holds its
			// superblock until the Close moves it.
			p, err := arena.Allocate(4096, st.View())
			if !assertNoErr(t, err) {
				return
			}
			assertNoErr(t, st.Close())
			assertNoErr(t, arena.Deallocate(p, 4096, DefaultStream))
		}
	}()
	for !stop.Load() {
		if err := arena.CheckInvariants(); err != nil {
			t.Errorf("CheckInvariants while a Stream closes: %v", err)
			break
		}
		st := arena.Stats()
		if st.FreeBytes+st.LiveBytes != st.ArenaSize {
			t.Errorf("Stats while a Stream closes: free %d + live %d bytes, arena %d", st.FreeBytes, st.LiveBytes, st.ArenaSize)
			break
		}
	}
	wg.Wait()
}

func assertNoErr(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}
