package rmm

// The gopter state machine of property_test.go over the arena, fixed-size and binning
// resources: random allocate/free/stream sequences with invalid frees, zero-byte calls,
// requests beyond what can ever be live, Release and freeing everything, checked after every
// step (CheckInvariants, alignment, no overlaps, every block inside the upstream's memory, failed
// calls change nothing, patterns intact over host memory).

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"
)

func suballocStreams3or4(r *rand.Rand) resourceConfig { return resourceConfig{Streams: 3 + r.Intn(2)} }

func TestArenaPropertySystem(t *testing.T) {
	const size = 16 * miB
	spec := &conformanceSpec{
		name:      "arena of 16 MiB over SystemMemoryResource",
		genConfig: suballocStreams3or4,
		newUpstream: func(resourceConfig) MemoryResource {
			return NewSystemMemoryResource()
		},
		newResource: func(up MemoryResource, _ resourceConfig) (MemoryResource, error) {
			return NewArenaMemoryResource(up, &ArenaOptions{ArenaSize: size, DefaultStreamArenas: 2})
		},
		size: func(r *rand.Rand, _ resourceConfig) int {
			if r.Intn(8) == 0 {
				return logUniform(r, ArenaMinSuperblockSize, 6*miB)
			}
			return smallSize(r)
		},
		capacity:           size,
		mayRunOut:          true,
		detectsInvalidFree: true,
		hasInvariants:      true,
		hostMemory:         true,
		keepsUpstream:      true,
	}
	cov := runConformance(t, spec, 120, 120)
	require.Positive(t, cov.allocs.Load())
	require.Positive(t, cov.crossFrees.Load())
	require.Positive(t, cov.invalidFrees.Load())
	require.Positive(t, cov.oom.Load())
}

func TestArenaPropertySimulated(t *testing.T) {
	const size = 1 * giB
	spec := &conformanceSpec{
		name:      "arena of 1 GiB over an address-only upstream",
		genConfig: suballocStreams3or4,
		newUpstream: func(resourceConfig) MemoryResource {
			sim, _ := NewSimulatedMemoryResource(2 * giB)
			return sim
		},
		newResource: func(up MemoryResource, _ resourceConfig) (MemoryResource, error) {
			return NewArenaMemoryResource(up, &ArenaOptions{ArenaSize: size, DefaultStreamArenas: 2})
		},
		size: func(r *rand.Rand, _ resourceConfig) int {
			switch r.Intn(10) {
			case 0, 1:
				return logUniform(r, 64*kiB, 400*miB)
			case 2:
				return ArenaMinSuperblockSize * (1 + r.Intn(3))
			}
			return smallSize(r)
		},
		capacity:           size,
		mayRunOut:          true,
		detectsInvalidFree: true,
		hasInvariants:      true,
		keepsUpstream:      true,
	}
	cov := runConformance(t, spec, 300, 120)
	require.Positive(t, cov.oom.Load())
	require.Positive(t, cov.invalidFrees.Load())
}

func TestFixedSizePropertySystem(t *testing.T) {
	spec := &conformanceSpec{
		name:        "fixed-size (64 KiB × 4) over SystemMemoryResource",
		genConfig:   suballocStreams3or4,
		newUpstream: func(resourceConfig) MemoryResource { return NewSystemMemoryResource() },
		newResource: func(up MemoryResource, _ resourceConfig) (MemoryResource, error) {
			return NewFixedSizeMemoryResource(up, &FixedSizeOptions{BlockSize: 64 * kiB, BlocksToPreallocate: 4})
		},
		size:               func(r *rand.Rand, _ resourceConfig) int { return smallSize(r) }, // ≤ 64 KiB
		capacity:           1 << 49,
		detectsInvalidFree: true,
		hasInvariants:      true,
		hostMemory:         true,
	}
	cov := runConformance(t, spec, 200, 120)
	require.Positive(t, cov.allocs.Load())
	require.Positive(t, cov.crossFrees.Load())
	require.Positive(t, cov.invalidFrees.Load())
	require.Positive(t, cov.releasesToZero.Load())
}

func TestFixedSizePropertySimulated(t *testing.T) {
	spec := &conformanceSpec{
		name: "fixed-size (1 MiB × 3) over a capped address-only upstream",
		genConfig: func(r *rand.Rand) resourceConfig {
			return resourceConfig{Streams: 3 + r.Intn(2), UpstreamLimit: 3 * miB * (1 + r.Intn(4))}
		},
		newUpstream: func(cfg resourceConfig) MemoryResource {
			return newLimitedUpstream(cfg.UpstreamLimit)
		},
		newResource: func(up MemoryResource, _ resourceConfig) (MemoryResource, error) {
			return NewFixedSizeMemoryResource(up, &FixedSizeOptions{BlockSize: miB, BlocksToPreallocate: 3})
		},
		size:     func(r *rand.Rand, _ resourceConfig) int { return logUniform(r, 1, miB+1) },
		capacity: 1 << 40,
		// A block holds any request up to 1 MiB, so the limit counts blocks, not bytes: the
		// model cannot say exactly when the upstream refuses a chunk.
		mayRunOut:          true,
		detectsInvalidFree: true,
		hasInvariants:      true,
	}
	cov := runConformance(t, spec, 300, 120)
	require.Positive(t, cov.oom.Load())
	require.Positive(t, cov.upstreamRefusals.Load(), "growth never ran into the upstream's limit")
}

func TestBinningPropertySystem(t *testing.T) {
	spec := &conformanceSpec{
		name:        "binning (256 B – 16 KiB bins) over SystemMemoryResource",
		genConfig:   suballocStreams3or4,
		newUpstream: func(resourceConfig) MemoryResource { return NewSystemMemoryResource() },
		newResource: func(up MemoryResource, _ resourceConfig) (MemoryResource, error) {
			return NewBinningMemoryResource(up, &BinningOptions{MinSizeExponent: 8, MaxSizeExponent: 14})
		},
		// Requests above the largest bin reach the upstream as they are; the model counts every
		// allocation as its size rounded up to 256 inside an upstream block, so those are drawn
		// as multiples of 256.
		size: func(r *rand.Rand, _ resourceConfig) int {
			n := smallSize(r)
			if r.Intn(8) == 0 {
				n = logUniform(r, 16*kiB, miB)
			}
			if n > 16*kiB {
				n = roundUp(n)
			}
			return n
		},
		capacity:      1 << 49,
		hasInvariants: true,
		hostMemory:    true,
	}
	cov := runConformance(t, spec, 100, 120)
	require.Positive(t, cov.allocs.Load())
	require.Positive(t, cov.crossFrees.Load())
}
