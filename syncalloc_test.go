package rmm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Without CUDA AllocateSync and DeallocateSync are Allocate and Deallocate on the default stream,
// through any stack of adaptors; errors are the resource's.
func TestAllocateSyncHost(t *testing.T) {
	mr := newTestResource()
	st, err := NewStatisticsResourceAdaptor(mr)
	require.NoError(t, err)
	p, err := AllocateSync(st, 512)
	require.NoError(t, err)
	require.NotZero(t, p)
	require.Equal(t, int64(1), st.Stats().CurrentCount)
	require.Equal(t, DefaultStream, mr.lastAllocS)
	require.NoError(t, DeallocateSync(st, p, 512))
	require.Zero(t, st.Stats().CurrentCount)
	require.Equal(t, DefaultStream, mr.lastFreeS)
	p, err = AllocateSync(st, 0)
	require.NoError(t, err)
	require.Zero(t, p)
	require.NoError(t, DeallocateSync(st, 0, 0))
	_, err = AllocateSync(st, -1)
	require.ErrorIs(t, err, ErrInvalidArgument)
	mr.failNext = 1
	_, err = AllocateSync(st, 64)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.ErrorIs(t, DeallocateSync(st, 0x1234500, 64), ErrInvalidFree)
}

// librmm's scenario: 512 bytes allocated synchronously from a stream-ordered resource (directly
// and through adaptors), written by a kernel on a non-blocking stream S and freed on S. Run under
// compute-sanitizer --track-stream-ordered-races all, no race is reported (an allocation on the
// default stream that S used without the wait would be one).
func TestGPUAllocateSyncStreamOrder(t *testing.T) {
	requireGPU(t)
	async, err := NewCudaAsyncMemoryResource(0, nil)
	require.NoError(t, err)
	defer async.Close()
	pool, err := NewPoolMemoryResource(async, &PoolOptions{InitialPoolSize: 1 << 20})
	require.NoError(t, err)
	defer pool.Close()
	stats, err := NewStatisticsResourceAdaptor(async)
	require.NoError(t, err)
	lim, err := NewLimitingResourceAdaptor(async, 1<<20, nil)
	require.NoError(t, err)
	s, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	defer s.Close()
	ctx, _ := Device(0).ctx()
	for i, mr := range []MemoryResource{async, pool, stats, lim} {
		p, err := AllocateSync(mr, 512)
		require.NoError(t, err)
		require.NoError(t, deviceFill(0, p, 512, []byte{byte(0x40 + i)}, s.View()))
		require.NoError(t, s.Synchronize())
		checkAll(t, ctx, p, 512, byte(0x40+i))
		require.NoError(t, mr.Deallocate(p, 512, s.View()))
		q, err := AllocateSync(mr, 512)
		require.NoError(t, err)
		require.NoError(t, deviceFill(0, q, 512, []byte{1}, s.View()))
		require.NoError(t, DeallocateSync(mr, q, 512), "waits for S's fill before the free")
	}
	require.NoError(t, s.Synchronize())
	require.Zero(t, stats.Stats().CurrentCount)
	require.Zero(t, lim.AllocatedBytes())
}
