package rmm_test

import (
	"testing"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/rmmtest"
)

// The conformance suite (package rmmtest) over every resource and adaptor of the package. Adding
// a resource is one entry in conformanceCases: its constructor over the suite's upstream, and
// what it promises.

const (
	confMiB = 1 << 20
	confGiB = 1 << 30
)

// confCase is one resource held to the suite.
type confCase struct {
	name string
	gpu  bool // needs a CUDA device
	// new builds the resource over up; leaf resources ignore up. The suite closes what it builds
	// (the resource, and any resource between it and up).
	new  func(up rmm.MemoryResource) (rmm.MemoryResource, error)
	opts rmmtest.Options
}

var conformanceCases = []confCase{
	// Host memory and addresses without memory: run everywhere.
	{"System", false, confLeaf(confSystem), rmmtest.Options{DetectsInvalidFree: true}},
	{"Simulated", false, confLeaf(confSimulated(100 * confGiB)), confSimulatedOpts(100 * confGiB)},
	{"PoolOverSystem", false, confPool(nil), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},
	{"PoolOverSimulated", false, confPool(nil), confSimulatedOpts(100 * confGiB)},
	{"PoolWithMaximumOverSimulated", false, confPool(&rmm.PoolOptions{InitialPoolSize: 64 * confMiB, MaximumPoolSize: 8 * confGiB}),
		rmmtest.Options{DetectsInvalidFree: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 4 * confGiB, Capacity: 8 * confGiB}},
	{"LoggingOverPool", false, confLoggingOverPool, rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},

	// On the GPU.
	{"Cuda", true, confLeaf(confCuda), rmmtest.Options{MaxAllocationSize: confGiB}},
	{"CudaAsync", true, confCudaAsync, rmmtest.Options{MaxAllocationSize: confGiB}},
	{"Managed", true, confManaged, rmmtest.Options{MaxAllocationSize: confMiB}}, // small sizes: the host writes patterns
	{"PoolOverCuda", true, confPool(nil), rmmtest.Options{DetectsInvalidFree: true, Upstream: confCuda, MaxAllocationSize: 256 * confMiB}},
}

func TestConformance(t *testing.T) {
	for _, c := range conformanceCases {
		t.Run(c.name, func(t *testing.T) {
			if c.gpu {
				if err := rmm.CUDAAvailable(); err != nil {
					t.Skipf("no CUDA device: %v", err)
				}
			}
			rmmtest.Run(t, func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
				mr, err := c.new(up)
				if err != nil {
					t.Fatalf("building %s: %v", c.name, err)
				}
				return mr
			}, &c.opts)
		})
	}
}

// confSimulatedOpts declares a resource over (or being) an address-only range of capacity bytes:
// huge sizes, and running out of memory.
func confSimulatedOpts(capacity int) rmmtest.Options {
	return rmmtest.Options{DetectsInvalidFree: true, Upstream: confSimulated(capacity), MaxAllocationSize: 2 * capacity / 5, Capacity: capacity}
}

// confLeaf builds a fresh leaf resource with newMR, ignoring the upstream.
func confLeaf(newMR func() rmm.MemoryResource) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(rmm.MemoryResource) (rmm.MemoryResource, error) { return newMR(), nil }
}

func confPool(opts *rmm.PoolOptions) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(up rmm.MemoryResource) (rmm.MemoryResource, error) { return rmm.NewPoolMemoryResource(up, opts) }
}

// confLoggingOverPool logs a pool's events to a discarded writer.
func confLoggingOverPool(up rmm.MemoryResource) (rmm.MemoryResource, error) {
	pool, err := rmm.NewPoolMemoryResource(up, nil)
	if err != nil {
		return nil, err
	}
	return rmm.NewLoggingResourceAdaptor(pool, confDiscard{}, nil)
}

func confCudaAsync(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return rmm.NewCudaAsyncMemoryResource(rmm.CurrentDevice(), nil)
}

func confManaged(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return rmm.NewManagedMemoryResource(rmm.CurrentDevice())
}

// confSimulated returns an upstream factory: a fresh address-only resource of capacity bytes.
func confSimulated(capacity int) func() rmm.MemoryResource {
	return func() rmm.MemoryResource {
		sim, err := rmm.NewSimulatedMemoryResource(capacity)
		if err != nil {
			panic(err)
		}
		return sim
	}
}

func confSystem() rmm.MemoryResource { return rmm.NewSystemMemoryResource() }

func confCuda() rmm.MemoryResource {
	mr, err := rmm.NewCudaMemoryResource(rmm.CurrentDevice())
	if err != nil {
		panic(err)
	}
	return mr
}

type confDiscard struct{}

func (confDiscard) Write(p []byte) (int, error) { return len(p), nil }
