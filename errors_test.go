package rmm

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Errors of resources, adaptors, containers and the rest read in the one shape, "rmm: Op: what
// went wrong: cause", with "rmm: " once at the start (also where one rmm error wraps another),
// and still wrap their sentinel.
func TestErrorShape(t *testing.T) {
	sim := func(capacity int) *SimulatedMemoryResource {
		r, err := NewSimulatedMemoryResource(capacity)
		require.NoError(t, err)
		return r
	}
	closedVector := func() error {
		v, err := NewUvector[int32](4, DefaultStream, sim(1<<20))
		require.NoError(t, err)
		require.NoError(t, v.Close())
		return v.Resize(8, DefaultStream)
	}
	poolOverSim := func() error {
		_, err := NewPoolMemoryResource(sim(1<<20), &PoolOptions{InitialPoolSize: 4 << 20})
		return err
	}
	fixedGrowth := func() error {
		f, err := NewFixedSizeMemoryResource(sim(16384), &FixedSizeOptions{BlockSize: 4096, BlocksToPreallocate: 4})
		require.NoError(t, err)
		t.Cleanup(func() { f.Close() })
		for range 4 {
			_, err := f.Allocate(10, DefaultStream)
			require.NoError(t, err)
		}
		_, err = f.Allocate(10, DefaultStream)
		return err
	}
	limited := func() error {
		l, err := NewLimitingResourceAdaptor(sim(1<<20), 1000, nil)
		require.NoError(t, err)
		_, err = l.Allocate(2000, DefaultStream)
		return err
	}
	popLast := func() error {
		r, err := NewStatisticsResourceAdaptor(sim(1 << 20))
		if err != nil {
			return err
		}
		_, err = r.PopCounters()
		return err
	}
	badHandle := func() error {
		var h IPCHandle
		return h.UnmarshalBinary([]byte("RMMH\x07"))
	}
	badLog := func() error {
		_, err := ReadLog(strings.NewReader(LogHeader + "\n1,00:00:00.000000,allocate,0x100,x,0\n"))
		return err
	}
	doubleFree := func() error {
		s := sim(1 << 20)
		p, err := s.Allocate(256, DefaultStream)
		require.NoError(t, err)
		require.NoError(t, s.Deallocate(p, 256, DefaultStream))
		return s.Deallocate(p, 256, DefaultStream)
	}
	cudaOOM := &CUDAError{Op: "cuMemAlloc_v2", Code: cudaErrorOutOfMemory, Name: "CUDA_ERROR_OUT_OF_MEMORY", Message: "out of memory"}
	for _, tc := range []struct {
		name     string
		err      error
		sentinel error
		want     string // the whole message
	}{
		{"container", func() error { _, err := NewUvector[int32](-1, DefaultStream, sim(1<<20)); return err }(), ErrInvalidArgument,
			"rmm: NewUvector[int32]: negative element count -1: invalid argument"},
		{"closed container", closedVector(), ErrClosed,
			"rmm: Uvector[int32].Resize: called after Close: use after close"},
		{"pool over an upstream that refuses", poolOverSim(), ErrOutOfMemory,
			"rmm: NewPoolMemoryResource: taking the initial 4194304 bytes (4 MiB) from SimulatedMemoryResource: SimulatedMemoryResource.Allocate (capacity 1048576, in use 0): failed to allocate 4194304 bytes (4 MiB): out of memory"},
		{"sub-allocator growth", fixedGrowth(), ErrOutOfMemory,
			"rmm: FixedSizeMemoryResource.Allocate: failed to allocate 10 bytes (10 B): growing by a chunk of 4 blocks of 4096 bytes (16384 bytes): SimulatedMemoryResource refused it; exhausted: 0 bytes free, largest free block 0 bytes; pool size 16384 (16 KiB), no maximum: upstream: SimulatedMemoryResource.Allocate (capacity 16384, in use 16384): failed to allocate 16384 bytes (16 KiB): out of memory"},
		{"limiting adaptor", limited(), ErrOutOfMemory,
			"rmm: LimitingResourceAdaptor.Allocate (limit 1000, allocated 0): failed to allocate 2000 bytes (1.953 KiB): exceeded memory limit; the request is larger than the limit: out of memory"},
		{"statistics adaptor", popLast(), ErrOutOfRange,
			"rmm: StatisticsResourceAdaptor.PopCounters: cannot pop the last level of counters: index out of range"},
		{"invalid free", doubleFree(), ErrInvalidFree,
			""}, // "rmm: SimulatedMemoryResource.Deallocate: 0x… was not allocated here or was already freed: invalid free"
		{"IPC handle", badHandle(), ErrInvalidIPCHandle,
			"rmm: IPCHandle.UnmarshalBinary: 5 bytes: version 7; this package reads version 1: invalid IPC handle"},
		{"event log", badLog(), ErrMalformedLog,
			"rmm: line 2: column Size: \"x\" is not a decimal byte count: malformed event log"},
		{"size", func() error { _, err := ParseBytes("lots"); return err }(), ErrInvalidArgument,
			"rmm: ParseBytes: not a size: \"lots\" (examples: 1073741824, 4GiB, 512MiB, 1.5GB): invalid argument"},
		{"device", SetCurrentDevice(Device(DeviceCount() + 7)), ErrInvalidArgument, ""}, // "rmm: SetCurrentDevice: device 7 does not exist (…): invalid argument"
		{"driver error under a resource's", outOfMemory("CudaMemoryResource", 1<<50, cudaOOM), ErrOutOfMemory,
			"rmm: CudaMemoryResource.Allocate: failed to allocate 1125899906842624 bytes (1 PiB): out of memory: cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"},
		{"wrapped twice", errorf("Outer.Op: doing it: %w", errorf("Inner.Op: %w", ErrNotSupported)), ErrNotSupported,
			"rmm: Outer.Op: doing it: Inner.Op: not supported"},
		{"bare sentinel", ErrClosed, ErrClosed, "rmm: use after close"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Error(t, tc.err)
			msg := tc.err.Error()
			require.ErrorIs(t, tc.err, tc.sentinel, msg)
			require.True(t, strings.HasPrefix(msg, "rmm: "), msg)
			require.Equal(t, 1, strings.Count(msg, "rmm: "), "\"rmm: \" once: %s", msg)
			require.NotContains(t, msg, "%!", msg)
			// The sentinel is the cause: its text (without "rmm: ") ends a part of the message.
			require.Contains(t, msg+":", strings.TrimPrefix(tc.sentinel.Error(), "rmm: ")+":", msg)
			if tc.want != "" {
				require.Equal(t, tc.want, msg)
			}
			if errors.Is(tc.err, ErrOutOfMemory) {
				var oom *OutOfMemoryError
				var ce *CUDAError
				require.True(t, errors.As(tc.err, &oom) || errors.As(tc.err, &ce) || strings.Contains(msg, "failed to allocate"), msg)
			}
		})
	}
}
