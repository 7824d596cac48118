package rmm_test

import (
	"testing"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/rmmtest"
)

// The conformance suite (package rmmtest) over every resource and adaptor of the package. Adding
// one is one line in conformanceCases.

const (
	confMiB = 1 << 20
	confGiB = 1 << 30
)

// confCase is one resource held to the suite: newResource builds it over the suite's upstream.
type confCase struct {
	name        string
	gpu         bool // needs a CUDA device
	newResource func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource
	opts        *rmmtest.Options
}

var conformanceCases = []confCase{
	// Host memory and addresses without memory: run everywhere.
	{"System", false, func(*testing.T, rmm.MemoryResource) rmm.MemoryResource { return rmm.NewSystemMemoryResource() },
		&rmmtest.Options{DetectsInvalidFree: true}},
	{"Simulated", false, func(t *testing.T, _ rmm.MemoryResource) rmm.MemoryResource { return confOK(rmm.NewSimulatedMemoryResource(100 * confGiB))(t) },
		&rmmtest.Options{DetectsInvalidFree: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 40 * confGiB, Capacity: 100 * confGiB}},
	{"PoolOverSystem", false, func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource { return confOK(rmm.NewPoolMemoryResource(up, nil))(t) },
		&rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},
	{"PoolOverSimulated", false, func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource { return confOK(rmm.NewPoolMemoryResource(up, nil))(t) },
		&rmmtest.Options{DetectsInvalidFree: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 40 * confGiB, Capacity: 100 * confGiB}},
	{"PoolWithMaximumOverSimulated", false, func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
		return confOK(rmm.NewPoolMemoryResource(up, &rmm.PoolOptions{InitialPoolSize: 64 * confMiB, MaximumPoolSize: 8 * confGiB}))(t)
	}, &rmmtest.Options{DetectsInvalidFree: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 4 * confGiB, Capacity: 8 * confGiB}},
	{"LoggingOverPool", false, confLoggingOverPool, &rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},

	// On the GPU.
	{"Cuda", true, func(t *testing.T, _ rmm.MemoryResource) rmm.MemoryResource { return confOK(rmm.NewCudaMemoryResource(rmm.CurrentDevice()))(t) },
		&rmmtest.Options{MaxAllocationSize: 64 * confMiB}},
	{"CudaAsync", true, func(t *testing.T, _ rmm.MemoryResource) rmm.MemoryResource { return confOK(rmm.NewCudaAsyncMemoryResource(rmm.CurrentDevice(), nil))(t) },
		&rmmtest.Options{MaxAllocationSize: 64 * confMiB}},
	{"Managed", true, func(t *testing.T, _ rmm.MemoryResource) rmm.MemoryResource { return confOK(rmm.NewManagedMemoryResource(rmm.CurrentDevice()))(t) },
		&rmmtest.Options{MaxAllocationSize: 1 * confMiB}},
	{"PoolOverCuda", true, func(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource { return confOK(rmm.NewPoolMemoryResource(up, nil))(t) },
		&rmmtest.Options{DetectsInvalidFree: true, Upstream: confCuda, MaxAllocationSize: 64 * confMiB}},
}

func TestConformance(t *testing.T) {
	for _, c := range conformanceCases {
		t.Run(c.name, func(t *testing.T) {
			if c.gpu {
				if err := rmm.CUDAAvailable(); err != nil {
					t.Skipf("no CUDA device: %v", err)
				}
			}
			rmmtest.Run(t, c.newResource, c.opts)
		})
	}
}

// confOK passes a constructor's results on: called with t, it returns the resource or ends t
// with the error.
func confOK[R rmm.MemoryResource](mr R, err error) func(t *testing.T) rmm.MemoryResource {
	return func(t *testing.T) rmm.MemoryResource {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return mr
	}
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

// confLoggingOverPool logs a pool's events to a discarded buffer; the pool is closed with t.
func confLoggingOverPool(t *testing.T, up rmm.MemoryResource) rmm.MemoryResource {
	pool, err := rmm.NewPoolMemoryResource(up, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Close() })
	return confOK(rmm.NewLoggingResourceAdaptor(pool, confDiscard{}, nil))(t)
}

type confDiscard struct{}

func (confDiscard) Write(p []byte) (int, error) { return len(p), nil }
