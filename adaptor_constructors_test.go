package rmm

import (
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// adaptorConstructors builds every adaptor and sub-allocator of the package over up, by the name
// of its constructor, with arguments that are otherwise valid.
func adaptorConstructors(t *testing.T) map[string]func(up MemoryResource) (Upstreamer, error) {
	logPath := filepath.Join(t.TempDir(), "log.csv")
	return map[string]func(up MemoryResource) (Upstreamer, error){
		"NewStatisticsResourceAdaptor": func(up MemoryResource) (Upstreamer, error) { return NewStatisticsResourceAdaptor(up) },
		"NewStreamStatisticsResourceAdaptor": func(up MemoryResource) (Upstreamer, error) {
			return NewStreamStatisticsResourceAdaptor(up)
		},
		"NewThreadSafeResourceAdaptor": func(up MemoryResource) (Upstreamer, error) { return NewThreadSafeResourceAdaptor(up) },
		"NewTrackingResourceAdaptor":   func(up MemoryResource) (Upstreamer, error) { return NewTrackingResourceAdaptor(up, nil) },
		"NewAlignedResourceAdaptor":    func(up MemoryResource) (Upstreamer, error) { return NewAlignedResourceAdaptor(up, nil) },
		"NewFailureCallbackResourceAdaptor": func(up MemoryResource) (Upstreamer, error) {
			return NewFailureCallbackResourceAdaptor(up, func(int, error) bool { return false }, nil)
		},
		"NewLimitingResourceAdaptor": func(up MemoryResource) (Upstreamer, error) { return NewLimitingResourceAdaptor(up, 1<<20, nil) },
		"NewLoggingResourceAdaptor": func(up MemoryResource) (Upstreamer, error) {
			return NewLoggingResourceAdaptor(up, io.Discard, nil)
		},
		"NewLoggingResourceAdaptorFile": func(up MemoryResource) (Upstreamer, error) {
			return NewLoggingResourceAdaptorFile(up, logPath, nil)
		},
		"NewMemoryProfileResourceAdaptor": func(up MemoryResource) (Upstreamer, error) {
			return NewMemoryProfileResourceAdaptor(up, nil)
		},
		"NewPrefetchResourceAdaptor": func(up MemoryResource) (Upstreamer, error) { return NewPrefetchResourceAdaptor(up) },
		"NewArenaMemoryResource": func(up MemoryResource) (Upstreamer, error) {
			return NewArenaMemoryResource(up, &ArenaOptions{ArenaSize: 1 << 20})
		},
		"NewFixedSizeMemoryResource": func(up MemoryResource) (Upstreamer, error) {
			return NewFixedSizeMemoryResource(up, &FixedSizeOptions{BlockSize: 4096, BlocksToPreallocate: 1})
		},
		"NewBinningMemoryResource": func(up MemoryResource) (Upstreamer, error) { return NewBinningMemoryResource(up, nil) },
	}
}

// Every adaptor constructor reads a nil upstream as the current device resource at the time of
// the call, and keeps it when the current resource changes later.
func TestAdaptorConstructorNilUpstreamIsCurrentResource(t *testing.T) {
	sim, err := NewSimulatedMemoryResource(1 << 30)
	require.NoError(t, err)
	prev := SetCurrentDeviceResource(sim)
	defer SetCurrentDeviceResource(prev)
	for name, build := range adaptorConstructors(t) {
		t.Run(name, func(t *testing.T) {
			r, err := build(nil)
			require.NoError(t, err)
			other := SetCurrentDeviceResource(NewSystemMemoryResource())
			require.Same(t, sim, other)
			require.Same(t, sim, r.Upstream(), "the current resource at construction")
			SetCurrentDeviceResource(sim)
			if c, ok := r.(interface{ Close() error }); ok {
				require.NoError(t, c.Close())
			}
		})
	}
}

// A nil pointer passed as upstream is refused at construction, naming the constructor and the
// type, and nothing is made (the logging constructor creates no file).
func TestAdaptorConstructorNilPointerUpstream(t *testing.T) {
	var nilSim *SimulatedMemoryResource
	for name, build := range adaptorConstructors(t) {
		t.Run(name, func(t *testing.T) {
			r, err := build(nilSim)
			require.ErrorIs(t, err, ErrInvalidArgument)
			require.ErrorContains(t, err, name+": upstream is a nil *rmm.SimulatedMemoryResource")
			require.Nil(t, r)
		})
	}
	// The logging constructor refuses it before creating its file.
	path := filepath.Join(t.TempDir(), "log.csv")
	_, err := NewLoggingResourceAdaptorFile(nilSim, path, nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = os.Stat(path)
	require.ErrorIs(t, err, os.ErrNotExist)
}
