package rmmtest_test

import (
	"errors"
	"os"
	"os/exec"
	"regexp"
	"testing"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/rmmtest"
	"github.com/stretchr/testify/require"
)

// leaky passes every allocation to its upstream but drops the frees of more than 4 KiB: that
// memory stays held from the upstream for good. It has neither Release nor Close.
type leaky struct{ up rmm.MemoryResource }

func (l leaky) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) { return l.up.Allocate(n, s) }

func (l leaky) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	if n > 4096 {
		return nil
	}
	return l.up.Deallocate(p, n, s)
}

// leakyAdaptor is leaky with an Upstream method, so that the suite reaches its upstream through
// it and knows that nothing can give the memory back.
type leakyAdaptor struct{ leaky }

func (l leakyAdaptor) Upstream() rmm.MemoryResource { return l.up }

func bigSimulated() rmm.MemoryResource {
	sim, err := rmm.NewSimulatedMemoryResource(1 << 40)
	if err != nil {
		panic(err)
	}
	return sim
}

// TestLeakyChild is run by TestLeakyFails in a child process: it fails on purpose.
func TestLeakyChild(t *testing.T) {
	if os.Getenv(childEnv) != "1" {
		t.Skip("run by TestLeakyFails")
	}
	rmmtest.Run(t, func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
		return leaky{up}
	}, &rmmtest.Options{Upstream: bigSimulated, IgnoresStreams: true, HoldsNothingBack: true, MaxAllocationSize: 64 << 10, Seed: 99})
}

// A resource that declares it holds nothing back (Options.HoldsNothingBack) and keeps memory it
// was told to free fails Run, at the step that kept it: the state machine shrinks the sequence
// to an allocation above 4 KiB and its free; the fixed checks that free such sizes fail too.
func TestLeakyFails(t *testing.T) {
	if os.Getenv(childEnv) == "1" {
		t.Skip("in the child")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestLeakyChild$", "-test.v")
	cmd.Env = append(os.Environ(), childEnv+"=1", rmmtest.SeedEnv+"=")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "the child passed:\n%s", out)
	s := string(out)
	require.Contains(t, s, "--- FAIL: TestLeakyChild/StateMachine")
	require.Contains(t, s, "--- FAIL: TestLeakyChild/RandomSizes")
	require.Contains(t, s, "--- PASS: TestLeakyChild/DistinctPointers", "8-byte frees are passed on")
	require.Contains(t, s, "which holds no live allocation, is still held")
	require.Contains(t, s, "Options.HoldsNothingBack")
	require.Regexp(t, regexp.MustCompile(`a sequence of 2 commands fails`), s)
	require.Regexp(t, regexp.MustCompile(`=> +2\. Free#`), s, "the free is the step that fails")
}

// Without HoldsNothingBack, the leak is found once everything is freed, when the suite reaches
// the upstream through the resource (rmm.Upstreamer) and nothing on the way has Release or Close
// to give memory back; ReleaseKeepsMemory declares such a reserve kept for good.
func TestLeakWithoutReleaseOrCloseFails(t *testing.T) {
	opts := rmmtest.Options{Upstream: bigSimulated, IgnoresStreams: true, MaxAllocationSize: 64 << 10, Sequences: 20}
	err := rmmtest.Check(func(up rmm.MemoryResource) (rmm.MemoryResource, error) { return leakyAdaptor{leaky{up}}, nil }, &opts)
	require.Error(t, err)
	require.Contains(t, err.Error(), "StateMachine")
	require.Contains(t, err.Error(), "everything freed, yet the upstream still holds")
	require.Contains(t, err.Error(), "has neither Release nor Close")

	opts.ReleaseKeepsMemory = true
	require.NoError(t, rmmtest.Check(func(up rmm.MemoryResource) (rmm.MemoryResource, error) { return leakyAdaptor{leaky{up}}, nil }, &opts))
}

// The package's resources that pass every free on (its adaptors over an upstream, a leaf, and a
// resource that gives its block back when its last allocation is freed) pass with
// HoldsNothingBack; a pool, which keeps freed memory until Release, fails with it and passes
// without it.
func TestHoldsNothingBackPasses(t *testing.T) {
	adaptors := map[string]func(up rmm.MemoryResource) (rmm.MemoryResource, error){
		"StreamStatistics": func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
			return rmm.NewStreamStatisticsResourceAdaptor(up)
		},
		"MemoryProfile": func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
			return rmm.NewMemoryProfileResourceAdaptor(up, &rmm.MemoryProfileOptions{Rate: 1})
		},
		"Tracking": func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
			return rmm.NewTrackingResourceAdaptor(up, nil)
		},
		"Limiting": func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
			return rmm.NewLimitingResourceAdaptor(up, 1<<30, nil)
		},
		"Aligned": func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
			return rmm.NewAlignedResourceAdaptor(up, &rmm.AlignedOptions{Alignment: 4096})
		},
		"Bump": func(up rmm.MemoryResource) (rmm.MemoryResource, error) { return NewBumpResource(up, 1<<30), nil },
		"System": func(rmm.MemoryResource) (rmm.MemoryResource, error) {
			return rmm.NewSystemMemoryResource(), nil
		},
	}
	for name, build := range adaptors {
		t.Run(name, func(t *testing.T) {
			opts := rmmtest.Options{Upstream: bigSimulated, IgnoresStreams: true, HoldsNothingBack: true, MaxAllocationSize: 64 << 10, Sequences: 20}
			if name == "System" {
				opts.Upstream = nil
			}
			if name == "Bump" {
				opts.Capacity, opts.DetectsInvalidFree = 1<<30, true
			}
			require.NoError(t, rmmtest.Check(build, &opts))
		})
	}
	pool := func(up rmm.MemoryResource) (rmm.MemoryResource, error) { return rmm.NewPoolMemoryResource(up, nil) }
	opts := rmmtest.Options{Upstream: bigSimulated, MaxAllocationSize: 64 << 10, Sequences: 20}
	require.NoError(t, rmmtest.Check(pool, &opts))
	opts.HoldsNothingBack = true
	err := rmmtest.Check(pool, &opts)
	require.Error(t, err)
	require.Contains(t, err.Error(), "which holds no live allocation, is still held")
}
