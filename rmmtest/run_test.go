package rmmtest_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"testing"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/rmmtest"
	"github.com/stretchr/testify/require"
)

// The example's resource passes Run.
func TestBumpResource(t *testing.T) {
	rmmtest.Run(t, func(t *testing.T, upstream rmm.MemoryResource) rmm.MemoryResource {
		return NewBumpResource(upstream, 256<<20)
	}, &rmmtest.Options{DetectsInvalidFree: true, IgnoresStreams: true, MaxAllocationSize: 256 << 10, Capacity: 256 << 20})
}

// Run with nil options: the defaults (the current device resource as upstream, no invalid frees,
// no capacity, allocations on a closed Stream refused) over a pool, and over a leaf resource that
// ignores streams.
func TestRunDefaults(t *testing.T) {
	rmmtest.Run(t, func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
		mr, err := rmm.NewPoolMemoryResource(up, nil)
		if err != nil {
			t.Fatal(err)
		}
		return mr
	}, nil)
	rmmtest.Run(t, func(*testing.T, rmm.MemoryResource) rmm.MemoryResource {
		return rmm.NewSystemMemoryResource()
	}, &rmmtest.Options{IgnoresStreams: true})
}

// misaligning hands out its upstream's pointers plus 64 bytes for requests above 4 KiB.
type misaligning struct{ up rmm.MemoryResource }

func (m misaligning) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	if n <= 4096 {
		return m.up.Allocate(n, s)
	}
	p, err := m.up.Allocate(n+rmm.Alignment, s)
	return p + 64, err
}

func (m misaligning) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	if n <= 4096 {
		return m.up.Deallocate(p, n, s)
	}
	return m.up.Deallocate(p-64, n+rmm.Alignment, s)
}

const childEnv = "RMMTEST_FAILING_CHILD"

// TestRunFailingChild is run by TestRunFails in a child process: it fails on purpose.
func TestRunFailingChild(t *testing.T) {
	if os.Getenv(childEnv) != "1" {
		t.Skip("run by TestRunFails")
	}
	rmmtest.Run(t, func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
		return misaligning{up}
	}, &rmmtest.Options{Upstream: func() rmm.MemoryResource {
		sim, err := rmm.NewSimulatedMemoryResource(1 << 40)
		if err != nil {
			panic(err)
		}
		return sim
	}, MaxAllocationSize: 64 << 10, Seed: 99})
}

// Run fails a test whose resource breaks the contract, and says how to replay the shrunk
// sequence with go test.
func TestRunFails(t *testing.T) {
	if os.Getenv(childEnv) == "1" {
		t.Skip("in the child")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestRunFailingChild$", "-test.v")
	cmd.Env = append(os.Environ(), childEnv+"=1", rmmtest.SeedEnv+"=")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "the child passed:\n%s", out)
	s := string(out)
	require.Contains(t, s, "--- FAIL: TestRunFailingChild/Alignment")
	require.Contains(t, s, "--- FAIL: TestRunFailingChild/StateMachine")
	require.Contains(t, s, "--- PASS: TestRunFailingChild/DistinctPointers")
	require.Contains(t, s, "not aligned to 256 bytes")
	require.Regexp(t, regexp.MustCompile(`a sequence of 1 command fails`), s)
	require.Contains(t, s, fmt.Sprintf("seed 99: replay with %s=99 go test -run '^TestRunFailingChild$/^StateMachine$'", rmmtest.SeedEnv))
	require.Contains(t, s, fmt.Sprintf("replay with %s=99 go test -run '^TestRunFailingChild$/^RandomSizes$/^DefaultStream$'", rmmtest.SeedEnv))
}

// A bump allocator with a small block runs out long before half its capacity is live: it passes
// only when it declares MayRunOutOfMemory.
func TestMayRunOutOfMemory(t *testing.T) {
	const block = 8 << 20
	build := func(up rmm.MemoryResource) (rmm.MemoryResource, error) { return NewBumpResource(up, block), nil }
	opts := rmmtest.Options{DetectsInvalidFree: true, IgnoresStreams: true, MaxAllocationSize: 4 << 20, Capacity: block, Sequences: 30}
	if err := rmmtest.Check(build, &opts); err == nil {
		t.Fatal("a bump allocator that runs out early passed without MayRunOutOfMemory")
	}
	opts.MayRunOutOfMemory = true
	if err := rmmtest.Check(build, &opts); err != nil {
		t.Fatalf("with MayRunOutOfMemory: %v", err)
	}
}
