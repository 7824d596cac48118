package rmm

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// Allocate on a view of a closed Stream returns ErrClosed before any driver call, so it runs
// without CUDA over resources whose pool handle is a stand-in (any driver call would fail or
// crash). The free on such a view is tested on the GPU (TestGPUFreeOnClosedStream).
func TestAsyncResourcesRefuseClosedStream(t *testing.T) {
	st, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	s := st.View()
	require.NoError(t, st.Close())

	async := &CudaAsyncMemoryResource{}
	async.pool.Store(0x1000)
	view := &CudaAsyncViewMemoryResource{pool: 0x1000}
	for name, mr := range map[string]MemoryResource{"CudaAsyncMemoryResource": async, "CudaAsyncViewMemoryResource": view} {
		p, err := mr.Allocate(2<<20, s)
		require.ErrorIs(t, err, ErrClosed, name)
		require.Zero(t, p, name)
		require.ErrorContains(t, err, name+".Allocate on "+s.String()+", which was closed")
		// Zero bytes touch nothing, on any stream.
		p, err = mr.Allocate(0, s)
		require.NoError(t, err, name)
		require.Zero(t, p, name)
		require.NoError(t, mr.Deallocate(0, 0, s), name)
	}
}

// Event.Record on a closed Stream's view returns ErrClosed, as WaitEvent does: its handle may
// already name another stream.
func TestEventRecordClosedStream(t *testing.T) {
	s, err := NewStream(0, nil)
	if err != nil {
		t.Fatal(err)
	}
	v := s.View()
	e, err := NewEvent(0, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.Record(v); err != nil {
		t.Fatalf("Record on a live Stream: %v", err)
	}
	s.Close()
	if err := e.Record(v); !errors.Is(err, ErrClosed) {
		t.Fatalf("Record on a closed Stream = %v, want ErrClosed", err)
	}
}

// StreamView.Closed tells a view of a closed Stream, and only that.
func TestStreamViewClosed(t *testing.T) {
	s, err := NewStream(0, nil)
	if err != nil {
		t.Fatal(err)
	}
	v := s.View()
	if v.Closed() || DefaultStream.Closed() {
		t.Fatalf("Closed() before Close: stream %v, default %v; want false", v.Closed(), DefaultStream.Closed())
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if !v.Closed() {
		t.Fatal("Closed() = false after Stream.Close")
	}
	if DefaultStream.Closed() {
		t.Fatal("DefaultStream.Closed() = true")
	}
}
