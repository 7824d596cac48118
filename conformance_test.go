package rmm_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"reflect"
	"strings"
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

// No case sets rmmtest.Options.OrdersCrossStreamFrees: no resource of the package orders a free
// on one stream after the allocation made on another (see MemoryResource), so the suite orders
// such frees itself, as a caller must. Over the driver's async resources an unordered one is a
// race that compute-sanitizer reports (free-before-alloc); over the sub-allocators it would lose
// the wait an allocation made its stream do for an earlier free.
var conformanceCases = []confCase{
	// Host memory and addresses without memory: run everywhere.
	{"System", false, confLeaf(confSystem), rmmtest.Options{IgnoresStreams: true, DetectsInvalidFree: true}},
	{"Simulated", false, confLeaf(confSimulated(100 * confGiB)), confSimulatedIgnoringStreams(100 * confGiB)},
	{"PoolOverSystem", false, confPool(nil), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},
	{"PoolOverSimulated", false, confPool(nil), confSimulatedOpts(100 * confGiB)},
	{"PoolWithMaximumOverSimulated", false, confPool(&rmm.PoolOptions{InitialPoolSize: 64 * confMiB, MaximumPoolSize: 8 * confGiB}),
		rmmtest.Options{DetectsInvalidFree: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 4 * confGiB, Capacity: 8 * confGiB}},
	{"LoggingOverPool", false, confLoggingOverPool, rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},
	// Adaptors. Over a pool, which detects invalid frees: the adaptors that hand frees on as they
	// are must keep the pool's verdict and change nothing. Over host memory they are declared not
	// to detect invalid frees, since they pass them on (tracking even corrects a wrong size, and
	// aligned cannot tell apart sizes that pad alike).
	{"StatisticsOverPool", false, confAdaptorOverPool(confStatistics), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},
	{"StatisticsOverSimulated", false, confStatistics, rmmtest.Options{IgnoresStreams: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 40 * confGiB, Capacity: 100 * confGiB}},
	{"TrackingOverSystem", false, confTracking, rmmtest.Options{IgnoresStreams: true, Upstream: confSystem}},
	{"LimitingOverPool", false, confAdaptorOverPool(confLimiting(64 * confMiB)), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem, MaxAllocationSize: 8 * confMiB, Capacity: 64 * confMiB}},
	{"LimitingOverSimulated", false, confLimiting(8 * confGiB), rmmtest.Options{IgnoresStreams: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 2 * confGiB, Capacity: 8 * confGiB}},
	{"FailureCallbackOverPool", false, confAdaptorOverPool(confFailureCallback), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},
	{"PrefetchOverSystem", false, confPrefetch, rmmtest.Options{IgnoresStreams: true, Upstream: confSystem}},
	{"AlignedOverSystem", false, confAligned(4096, 0), rmmtest.Options{IgnoresStreams: true, Upstream: confSystem}},
	{"AlignedOverSimulated", false, confAligned(1<<20, 64<<10), rmmtest.Options{IgnoresStreams: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 4 * confGiB}},
	{"ThreadSafeOverPool", false, confAdaptorOverPool(confThreadSafe), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},
	{"StreamStatisticsOverPool", false, confAdaptorOverPool(confStreamStatistics), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},
	{"StreamStatisticsOverSimulated", false, confStreamStatistics, rmmtest.Options{IgnoresStreams: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 40 * confGiB, Capacity: 100 * confGiB}},
	{"MemoryProfileEveryAllocationOverPool", false, confAdaptorOverPool(confMemoryProfile(1)), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},
	{"MemoryProfileSampledOverPool", false, confAdaptorOverPool(confMemoryProfile(64 << 10)), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},
	// Pools sampling their own allocations into a MemoryProfile (PoolOptions.MemoryProfile).
	{"PoolProfilingEveryAllocationOverSystem", false, confPool(&rmm.PoolOptions{MemoryProfile: confNewProfile(1)}), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem}},
	{"PoolProfilingSampledOverSimulated", false, confPool(&rmm.PoolOptions{MemoryProfile: confNewProfile(64 << 10)}), confSimulatedOpts(100 * confGiB)},
	{"ExpandablePoolProfilingOverHost", false, confExpandableProfiling(confGiB, confNewProfile(1)), rmmtest.Options{DetectsInvalidFree: true, MaxAllocationSize: 128 * confMiB, Capacity: confGiB}},

	// The other sub-allocators and resources.
	{"ArenaOverSystem", false, confArena(64 * confMiB), rmmtest.Options{DetectsInvalidFree: true, ReleaseKeepsMemory: true, Upstream: confSystem, MaxAllocationSize: 8 * confMiB, Capacity: 64 * confMiB}},
	{"ArenaOverSimulated", false, confArena(100 * confGiB), rmmtest.Options{DetectsInvalidFree: true, ReleaseKeepsMemory: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 40 * confGiB, Capacity: 100 * confGiB}},
	{"FixedSizeOverSystem", false, confFixed(confMiB, 16), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSystem, MaxAllocationSize: confMiB}},
	{"FixedSizeOverSimulated", false, confFixed(64*confMiB, 4), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 64 * confMiB, Capacity: 100 * confGiB}},
	{"BinningOverPool", false, confBinningOverPool, rmmtest.Options{DetectsInvalidFree: true, ReleaseKeepsMemory: true, Upstream: confSystem, MaxAllocationSize: 8 * confMiB}},
	{"CallbackOverSystem", false, confCallback, rmmtest.Options{IgnoresStreams: true, Upstream: confSystem}},
	// Expandable pools map their own memory (the suite's upstream is not used).
	{"ExpandablePoolOverHost", false, confExpandable(confSystem, 1*confGiB), rmmtest.Options{DetectsInvalidFree: true, MaxAllocationSize: 128 * confMiB, Capacity: confGiB}},
	{"ExpandablePoolOver4KiBGranularity", false, confExpandable4KiB(64 * confMiB), rmmtest.Options{DetectsInvalidFree: true, MaxAllocationSize: 16 * confMiB, Capacity: 64 * confMiB}},
	{"ExpandablePoolOverSimulated", false, confExpandable(confSimulated(100*confGiB), 100*confGiB), rmmtest.Options{DetectsInvalidFree: true, Upstream: confSimulated(100 * confGiB), MaxAllocationSize: 40 * confGiB, Capacity: 100 * confGiB, MayRunOutOfMemory: true}},
	{"Pinned", false, confPinned, rmmtest.Options{IgnoresStreams: true, DetectsInvalidFree: true}},

	// On the GPU.
	{"ArenaOverCuda", true, confArena(4 * confGiB), rmmtest.Options{DetectsInvalidFree: true, ReleaseKeepsMemory: true, Upstream: confCuda, MaxAllocationSize: 512 * confMiB, Capacity: 4 * confGiB}},
	{"FixedSizeOverCuda", true, confFixed(confMiB, 128), rmmtest.Options{DetectsInvalidFree: true, Upstream: confCuda, MaxAllocationSize: confMiB}},
	{"BinningOverPoolOverCuda", true, confBinningOverPool, rmmtest.Options{DetectsInvalidFree: true, ReleaseKeepsMemory: true, Upstream: confCuda, MaxAllocationSize: 64 * confMiB}},
	{"CudaAsyncViewOfDefaultPool", true, confAsyncView, rmmtest.Options{MaxAllocationSize: confGiB}},
	{"Cuda", true, confLeaf(confCuda), rmmtest.Options{IgnoresStreams: true, MaxAllocationSize: confGiB}},
	{"CudaAsync", true, confCudaAsync, rmmtest.Options{MaxAllocationSize: confGiB}},
	{"Managed", true, confManaged, rmmtest.Options{IgnoresStreams: true, MaxAllocationSize: confMiB}}, // small sizes: the host writes patterns
	{"PoolOverCuda", true, confPool(nil), rmmtest.Options{DetectsInvalidFree: true, Upstream: confCuda, MaxAllocationSize: 256 * confMiB}},
	// A pool growing by stream-ordered allocations (on the allocating stream) from the device's
	// default pool, and giving them back on DefaultStream.
	{"PoolOverCudaAsyncView", true, confPool(nil), rmmtest.Options{DetectsInvalidFree: true, Upstream: confAsyncViewUpstream, MaxAllocationSize: 256 * confMiB}},
	{"PrefetchOverManaged", true, confPrefetch, rmmtest.Options{IgnoresStreams: true, Upstream: confManagedUpstream, MaxAllocationSize: confMiB}},
	{"StatisticsOverCuda", true, confStatistics, rmmtest.Options{IgnoresStreams: true, Upstream: confCuda, MaxAllocationSize: confGiB}},
	{"ExpandablePoolOverCuda", true, confExpandable(confCuda, 8*confGiB), rmmtest.Options{DetectsInvalidFree: true, MaxAllocationSize: 512 * confMiB, Capacity: 8 * confGiB}},
	{"LimitingOverCuda", true, confLimiting(4 * confGiB), rmmtest.Options{IgnoresStreams: true, Upstream: confCuda, MaxAllocationSize: 512 * confMiB, Capacity: 4 * confGiB}},
}

func TestConformance(t *testing.T) {
	for _, c := range conformanceCases {
		t.Run(c.name, func(t *testing.T) {
			if c.gpu {
				if err := rmm.CUDAAvailable(); err != nil {
					t.Skipf("no CUDA device: %v", err)
				}
			} else {
				// The host cases run side by side, after the GPU ones (one at a time): rmmtest's
				// suites take turns at the current device resource.
				t.Parallel()
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

// confSimulatedIgnoringStreams is confSimulatedOpts for a resource that does not look at streams.
func confSimulatedIgnoringStreams(capacity int) rmmtest.Options {
	o := confSimulatedOpts(capacity)
	o.IgnoresStreams = true
	return o
}

// confLeaf builds a fresh leaf resource with newMR, ignoring the upstream.
func confLeaf(newMR func() rmm.MemoryResource) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(rmm.MemoryResource) (rmm.MemoryResource, error) { return newMR(), nil }
}

// confExpandable is an expandable pool of at most maximum bytes whose memory comes from where
// upstream() names (the pool never calls it).
func confExpandable(upstream func() rmm.MemoryResource, maximum int) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(rmm.MemoryResource) (rmm.MemoryResource, error) {
		return rmm.NewPoolMemoryResource(upstream(), &rmm.PoolOptions{Expandable: true, MaximumPoolSize: maximum})
	}
}

// confExpandable4KiB is an expandable pool over host memory mapped with a 4 KiB granularity.
func confExpandable4KiB(maximum int) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(rmm.MemoryResource) (rmm.MemoryResource, error) {
		return rmm.NewExpandablePoolOverHostVMM(4096, 0, rmm.PoolOptions{MaximumPoolSize: maximum})
	}
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

func confManagedUpstream() rmm.MemoryResource {
	mr, err := rmm.NewManagedMemoryResource(rmm.CurrentDevice())
	if err != nil {
		panic(err)
	}
	return mr
}

// confAdaptorOverPool builds an adaptor with newAdaptor over a pool over the suite's upstream.
func confAdaptorOverPool(newAdaptor func(rmm.MemoryResource) (rmm.MemoryResource, error)) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
		pool, err := rmm.NewPoolMemoryResource(up, nil)
		if err != nil {
			return nil, err
		}
		return newAdaptor(pool)
	}
}

// confStatistics builds a StatisticsResourceAdaptor, its Stats in sight of the suite: it counts
// a zero-byte allocation and its free, as rmm.MemoryResource's contract allows and the suite
// accepts.
func confStatistics(up rmm.MemoryResource) (rmm.MemoryResource, error) {
	return rmm.NewStatisticsResourceAdaptor(up)
}

func confTracking(up rmm.MemoryResource) (rmm.MemoryResource, error) {
	return rmm.NewTrackingResourceAdaptor(up, &rmm.TrackingOptions{CaptureStacks: true})
}

func confMemoryProfile(rate int) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
		return rmm.NewMemoryProfileResourceAdaptor(up, &rmm.MemoryProfileOptions{Rate: rate})
	}
}

// confExpandableProfiling is an expandable pool over host memory sampling into prof.
func confExpandableProfiling(maximum int, prof *rmm.MemoryProfile) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(rmm.MemoryResource) (rmm.MemoryResource, error) {
		return rmm.NewPoolMemoryResource(confSystem(), &rmm.PoolOptions{Expandable: true, MaximumPoolSize: maximum, MemoryProfile: prof})
	}
}

// confNewProfile is a MemoryProfile at rate, shared by every resource a case builds.
func confNewProfile(rate int) *rmm.MemoryProfile {
	m, err := rmm.NewMemoryProfile(&rmm.MemoryProfileOptions{Rate: rate})
	if err != nil {
		panic(err)
	}
	return m
}

func confLimiting(limit int) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
		return rmm.NewLimitingResourceAdaptor(up, limit, nil)
	}
}

func confFailureCallback(up rmm.MemoryResource) (rmm.MemoryResource, error) {
	return rmm.NewFailureCallbackResourceAdaptor(up, func(int, error) bool { return false }, nil)
}

func confPrefetch(up rmm.MemoryResource) (rmm.MemoryResource, error) {
	return rmm.NewPrefetchResourceAdaptor(up)
}

func confAligned(alignment, threshold int) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
		return rmm.NewAlignedResourceAdaptor(up, &rmm.AlignedOptions{Alignment: alignment, Threshold: threshold})
	}
}

func confThreadSafe(up rmm.MemoryResource) (rmm.MemoryResource, error) {
	return rmm.NewThreadSafeResourceAdaptor(up)
}

func confStreamStatistics(up rmm.MemoryResource) (rmm.MemoryResource, error) {
	return rmm.NewStreamStatisticsResourceAdaptor(up)
}

type confDiscard struct{}

func (confDiscard) Write(p []byte) (int, error) { return len(p), nil }

func confArena(size int) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
		return rmm.NewArenaMemoryResource(up, &rmm.ArenaOptions{ArenaSize: size})
	}
}

func confFixed(block, prealloc int) func(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
		return rmm.NewFixedSizeMemoryResource(up, &rmm.FixedSizeOptions{BlockSize: block, BlocksToPreallocate: prealloc})
	}
}

// confBinningOverPool bins 256 B … 64 KiB over a pool; larger requests go to the pool. Release
// returns the bins' chunks to the pool, which keeps them (the pool is released by the teardown).
func confBinningOverPool(up rmm.MemoryResource) (rmm.MemoryResource, error) {
	pool, err := rmm.NewPoolMemoryResource(up, nil)
	if err != nil {
		return nil, err
	}
	return rmm.NewBinningMemoryResource(pool, &rmm.BinningOptions{MinSizeExponent: 8, MaxSizeExponent: 16})
}

// confCallback forwards to the upstream through user functions.
func confCallback(up rmm.MemoryResource) (rmm.MemoryResource, error) {
	return rmm.NewCallbackMemoryResource(up.Allocate, up.Deallocate, &rmm.CallbackOptions{Access: rmm.AccessOf(up)})
}

func confPinned(rmm.MemoryResource) (rmm.MemoryResource, error) {
	return rmm.NewPinnedMemoryResource(rmm.CurrentDevice())
}

// confAsyncViewUpstream is a view of the current device's default memory pool (nothing to close).
func confAsyncViewUpstream() rmm.MemoryResource {
	mr, err := confAsyncView(nil)
	if err != nil {
		panic(err)
	}
	return mr
}

func confAsyncView(rmm.MemoryResource) (rmm.MemoryResource, error) {
	pool, err := rmm.DefaultMemPool(rmm.CurrentDevice())
	if err != nil {
		return nil, err
	}
	return rmm.NewCudaAsyncViewMemoryResource(rmm.CurrentDevice(), pool)
}

// Every exported adaptor type of the package is among the resources that conformanceCases' host
// cases build (each case over its suite's upstream, the chain followed through Upstream), so
// rmmtest checks every adaptor's contract on any machine.
func TestConformanceCoversEveryAdaptor(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			if g, ok := d.(*ast.GenDecl); ok && g.Tok == token.TYPE {
				for _, sp := range g.Specs {
					if n := sp.(*ast.TypeSpec).Name.Name; ast.IsExported(n) && strings.HasSuffix(n, "ResourceAdaptor") {
						want = append(want, n)
					}
				}
			}
		}
	}
	if len(want) == 0 {
		t.Fatal("no adaptor type found")
	}
	seen := map[string]bool{}
	for _, c := range conformanceCases {
		if c.gpu {
			continue
		}
		up := confSystem()
		if c.opts.Upstream != nil {
			up = c.opts.Upstream()
		}
		mr, err := c.new(up)
		if err != nil {
			t.Fatalf("building %s: %v", c.name, err)
		}
		var chain []rmm.MemoryResource
		for r := mr; r != nil && r != up; {
			chain = append(chain, r)
			seen[reflect.Indirect(reflect.ValueOf(r)).Type().Name()] = true
			u, ok := r.(rmm.Upstreamer)
			if !ok {
				break
			}
			r = u.Upstream()
		}
		for _, r := range chain {
			if c, ok := r.(interface{ Close() error }); ok {
				c.Close()
			}
		}
	}
	for _, n := range want {
		if !seen[n] {
			t.Errorf("no host case of conformanceCases (conformance_test.go) builds a %s: rmmtest does not check it", n)
		}
	}
}
