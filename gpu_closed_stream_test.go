package rmm

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// GPU tests of frees on a Stream that was closed. The failure they guard against: a container
// allocated on a non-blocking Stream, the Stream closed, then the container closed; the resource
// handed the destroyed stream's handle to the driver (cuMemFreeAsync), which crashed with
// SIGSEGV, or, when another stream had been created in between with the same handle value,
// ordered the free on that stream.

// closedStreamResources builds each kind of resource on device 0; the cleanup closes them.
var closedStreamResources = []struct {
	name string
	// ordered: the resource orders its work on streams, so Allocate on a closed Stream returns
	// ErrClosed (the others ignore the stream).
	ordered bool
	build   func(t *testing.T) MemoryResource
}{
	{"CudaAsync", true, func(t *testing.T) MemoryResource {
		mr, err := NewCudaAsyncMemoryResource(0, nil)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, mr.Close()) })
		return mr
	}},
	{"CudaAsyncView", true, func(t *testing.T) MemoryResource {
		pool, err := DefaultMemPool(0)
		require.NoError(t, err)
		mr, err := NewCudaAsyncViewMemoryResource(0, pool)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, mr.Close()) })
		return mr
	}},
	{"Managed", false, func(t *testing.T) MemoryResource {
		mr, err := NewManagedMemoryResource(0)
		require.NoError(t, err)
		return mr
	}},
	{"Cuda", false, func(t *testing.T) MemoryResource {
		mr, err := NewCudaMemoryResource(0)
		require.NoError(t, err)
		return mr
	}},
	{"PoolOverCudaAsync", true, func(t *testing.T) MemoryResource {
		async, err := NewCudaAsyncMemoryResource(0, nil)
		require.NoError(t, err)
		pool, err := NewPoolMemoryResource(async, nil)
		require.NoError(t, err)
		t.Cleanup(func() {
			require.NoError(t, pool.Close())
			require.NoError(t, async.Close())
		})
		return pool
	}},
	{"Arena", true, func(t *testing.T) MemoryResource {
		cuda, err := NewCudaMemoryResource(0)
		require.NoError(t, err)
		mr, err := NewArenaMemoryResource(cuda, &ArenaOptions{ArenaSize: 256 << 20})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, mr.Close()) })
		return mr
	}},
	{"FixedSize", true, func(t *testing.T) MemoryResource {
		cuda, err := NewCudaMemoryResource(0)
		require.NoError(t, err)
		mr, err := NewFixedSizeMemoryResource(cuda, &FixedSizeOptions{BlockSize: 2 << 20, BlocksToPreallocate: 4})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, mr.Close()) })
		return mr
	}},
	{"BinningOverPool", true, func(t *testing.T) MemoryResource {
		cuda, err := NewCudaMemoryResource(0)
		require.NoError(t, err)
		pool, err := NewPoolMemoryResource(cuda, nil)
		require.NoError(t, err)
		// Bins up to 2 MiB: the vector below is served by the largest bin.
		mr, err := NewBinningMemoryResource(pool, &BinningOptions{MinSizeExponent: 8, MaxSizeExponent: 21})
		require.NoError(t, err)
		t.Cleanup(func() {
			require.NoError(t, mr.Close())
			require.NoError(t, pool.Close())
		})
		return mr
	}},
}

// A 2 MiB vector on a non-blocking Stream, filled there behind a long queue of work, then the
// Stream closed and the vector closed: the free succeeds and is ordered after the Stream's work
// (the copy of the vector queued last on the Stream still reads its 0x07 bytes, although a new
// allocation on another stream, which may get the same memory, is overwritten at once); a second
// allocation works, on another Stream and on DefaultStream; Allocate on the closed Stream
// returns ErrClosed for the resources that order on streams.
func TestGPUFreeOnClosedStream(t *testing.T) {
	requireGPU(t)
	for _, rc := range closedStreamResources {
		t.Run(rc.name, func(t *testing.T) {
			mr := rc.build(t)
			cuda, ctx := suballocCuda(t)
			const n = 2 << 20
			result, err := cuda.Allocate(n, DefaultStream)
			require.NoError(t, err)
			defer cuda.Deallocate(result, n, DefaultStream)
			for round := 0; round < 2; round++ {
				s, err := NewStream(0, &StreamOptions{NonBlocking: true})
				require.NoError(t, err)
				v, err := NewUvector[byte](n, s.View(), mr)
				require.NoError(t, err)
				require.NoError(t, v.Fill(0x5a, s.View()))
				suballocQueueWork(t, ctx, v.Data(), result, n, s.View())
				require.NoError(t, s.Close())
				require.NoError(t, v.Close(), "closing a vector whose Stream was closed")

				p, err := mr.Allocate(256, s.View())
				if rc.ordered {
					require.ErrorIs(t, err, ErrClosed, "Allocate on the closed Stream")
					require.Zero(t, p)
				} else {
					require.NoError(t, err, "the resource ignores streams")
					require.NoError(t, mr.Deallocate(p, 256, s.View()))
				}

				// Another stream, perhaps with the destroyed handle's value, takes the memory
				// and overwrites it at once.
				other, err := NewStream(0, &StreamOptions{NonBlocking: true})
				require.NoError(t, err)
				w, err := NewUvector[byte](n, other.View(), mr)
				require.NoError(t, err)
				require.NoError(t, w.Fill(0x09, other.View()))
				require.NoError(t, Device(0).Synchronize())
				checkAll(t, ctx, result, n, 0x07)
				got, err := w.ToSlice(other.View())
				require.NoError(t, err)
				for i, b := range got {
					if b != 0x09 {
						t.Fatalf("round %d: byte %d of the second vector is %#x, want 0x09", round, i, b)
					}
				}
				require.NoError(t, w.Close())
				require.NoError(t, other.Close())

				d, err := NewUvector[byte](n, DefaultStream, mr)
				require.NoError(t, err)
				require.NoError(t, d.Fill(0x11, DefaultStream))
				x, err := d.Element(n-1, DefaultStream)
				require.NoError(t, err)
				require.Equal(t, byte(0x11), x)
				require.NoError(t, d.Close())
			}
		})
	}
}

// The logging adaptor logs a call on a closed Stream with stream 0, not the destroyed handle,
// and hands the view on: the pool under it frees the memory as on DefaultStream.
func TestGPULoggingClosedStream(t *testing.T) {
	requireGPU(t)
	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	pool, err := NewPoolMemoryResource(cuda, nil)
	require.NoError(t, err)
	defer pool.Close()
	var log strings.Builder
	mr, err := NewLoggingResourceAdaptor(pool, &log, &LoggingOptions{AutoFlush: true})
	require.NoError(t, err)
	s, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	handle := s.View().Handle()
	require.NotZero(t, handle)
	p, err := mr.Allocate(4096, s.View())
	require.NoError(t, err)
	require.NoError(t, s.Close())
	require.NoError(t, mr.Deallocate(p, 4096, s.View()))
	_, err = mr.Allocate(4096, s.View())
	require.ErrorIs(t, err, ErrClosed)
	require.NoError(t, mr.Close())
	events, err := ReadLog(strings.NewReader(log.String()))
	require.NoError(t, err)
	require.Len(t, events, 3)
	require.Equal(t, ActionAllocate, events[0].Action)
	require.Equal(t, handle, events[0].Stream, "the live Stream's handle")
	require.Equal(t, ActionFree, events[1].Action)
	require.Zero(t, events[1].Stream, "a free on the closed Stream")
	require.Equal(t, ActionAllocateFailure, events[2].Action)
	require.Zero(t, events[2].Stream, "an allocation on the closed Stream")
	require.Zero(t, pool.Stats().LiveAllocations)
}

// Stream.Close returns only once the work queued on the stream is done: an event recorded after
// that work reports it complete as soon as Close returns. (Without the wait, cuStreamDestroy
// returns at once and the 4 GiB memsets below, some milliseconds of work, are still running.)
func TestGPUStreamCloseWaitsForQueuedWork(t *testing.T) {
	requireGPU(t)
	cuda, err := NewCudaMemoryResource(0)
	require.NoError(t, err)
	const n = 4 << 30
	p, err := cuda.Allocate(n, DefaultStream)
	require.NoError(t, err)
	defer cuda.Deallocate(p, n, DefaultStream)
	ctx, err := Device(0).ctx()
	require.NoError(t, err)
	for round := 0; round < 3; round++ {
		s, err := NewStream(0, &StreamOptions{NonBlocking: true})
		require.NoError(t, err)
		for i := 0; i < 8; i++ {
			require.NoError(t, cuMemsetAsync(ctx, p, uint32(i), n, 1, s.View().cu()))
		}
		e, err := NewEvent(0, nil)
		require.NoError(t, err)
		require.NoError(t, e.Record(s.View()))
		require.NoError(t, s.Close())
		done, err := e.Query()
		require.NoError(t, err)
		require.True(t, done, "round %d: the work queued on the Stream is still running after Close returned", round)
		require.NoError(t, e.Close())
	}
}
