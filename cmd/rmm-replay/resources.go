package main

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/gormm/rmm"
)

// The names -mr takes. pool is the pool a user gets by default (rmm.PoolKind's zero value, a
// stitching pool; librmm's where the GPU lacks virtual memory management); stitching, expandable
// and plain name one kind of pool each (rmm.ParsePoolKind's names), to compare them in one run.
const (
	mrPool       = "pool"
	mrStitching  = "stitching"
	mrExpandable = "expandable"
	mrPlain      = "plain"
	mrCuda       = "cuda"
	mrAsync      = "async"
	mrManaged    = "managed"
	mrSystem     = "system"
)

var mrNames = []string{mrPool, mrStitching, mrExpandable, mrPlain, mrCuda, mrAsync, mrManaged, mrSystem}

// poolNames lists the pools' names for messages: "pool, stitching, expandable or plain".
const poolNames = "pool, stitching, expandable or plain"

// poolKind returns the kind of pool name stands for, and false for a resource that is no pool.
// pool is the kind a user gets by default (before the fallback of buildPool).
func poolKind(name string) (rmm.PoolKind, bool) {
	if name == mrPool {
		var def rmm.PoolKind
		return def, true
	}
	k, err := rmm.ParsePoolKind(name)
	return k, err == nil
}

// isPool reports whether name is one of the pools (the resources -maximum and -simulate apply to).
func isPool(name string) bool {
	_, ok := poolKind(name)
	return ok
}

// needsGPU gives, for a resource that only exists on a CUDA device, the type it is built from;
// "" for the others (the pools and system run on host memory where there is no device).
func needsGPU(name string) string {
	switch name {
	case mrCuda:
		return "CudaMemoryResource"
	case mrAsync:
		return "CudaAsyncMemoryResource"
	case mrManaged:
		return "ManagedMemoryResource"
	}
	return ""
}

// parseMRList splits -mr's comma-separated list and checks the names: known, none twice, and no
// two that name the same resource (pool is the kind of pool it resolves to).
func parseMRList(list string) ([]string, error) {
	var names []string
	seen := map[string]string{} // resource -> the name that gave it
	for _, n := range strings.Split(list, ",") {
		n = strings.TrimSpace(n)
		if n == "" {
			return nil, fmt.Errorf("-mr %q: an empty name in the list (want names separated by commas, e.g. plain,stitching)", list)
		}
		if !slices.Contains(mrNames, n) {
			return nil, fmt.Errorf("-mr %q: want %s or %s (or several, separated by commas)", n, strings.Join(mrNames[:len(mrNames)-1], ", "), mrNames[len(mrNames)-1])
		}
		same := n
		if k, ok := poolKind(n); ok {
			same = k.String()
		}
		switch prev, dup := seen[same]; {
		case dup && prev == n:
			return nil, fmt.Errorf("-mr %s: %s is named twice", list, n)
		case dup:
			return nil, fmt.Errorf("-mr %s: %s and %s are the same resource (pool is the default pool, a %s pool)", list, prev, n, same)
		}
		seen[same] = n
		names = append(names, n)
	}
	return names, nil
}

// setup is what every resource of the run is built from.
type setup struct {
	dev      rmm.Device
	cudaErr  error  // why there is no CUDA device, or nil
	where    string // the device, or "no CUDA device: why"
	initial  sizeFlag
	maximum  sizeFlag
	simulate sizeFlag
}

// target is one resource of the run, built fresh for its turn.
type target struct {
	name     string // as given to -mr
	desc     string // what it is, in words
	mr       rmm.MemoryResource
	close    func() error                 // nil when there is nothing to close
	pool     *rmm.PoolMemoryResource      // the pools
	upstream *peakResource                // cuda, managed and system: counts what they hand out
	async    *rmm.CudaAsyncMemoryResource // async
}

// reservedNow returns the bytes the resource holds now: the pool's size, what the plain resources
// have handed out, or the async pool's reserved memory (0 when the driver does not say).
func (t *target) reservedNow() int64 {
	switch {
	case t.pool != nil:
		return int64(t.pool.PoolSize())
	case t.upstream != nil:
		return t.upstream.cur.Load()
	case t.async != nil:
		if v, err := t.async.ReservedBytes(); err == nil {
			return int64(v)
		}
	}
	return 0
}

// reservedPeak returns the most bytes the resource has held (0 when unknown).
func (t *target) reservedPeak() int64 {
	switch {
	case t.pool != nil:
		return int64(t.pool.Stats().PeakPoolSize)
	case t.upstream != nil:
		return t.upstream.peak.Load()
	case t.async != nil:
		if v, err := t.async.ReservedBytesHigh(); err == nil {
			return int64(v)
		}
	}
	return 0
}

// legend names the resource in a plot's legend: its -mr name, and what it is where the name
// does not say it.
func (t *target) legend() string {
	switch t.name {
	case mrPool:
		if t.pool != nil && t.pool.Kind() != rmm.PlainPool {
			return "pool (" + t.pool.Kind().String() + ")"
		}
		return "pool (librmm's)"
	case mrPlain:
		return "plain (librmm's pool)"
	case mrStitching:
		return "stitching pool"
	case mrExpandable:
		return "expandable pool"
	case mrCuda:
		return "cuda (cuMemAlloc)"
	case mrAsync:
		return "async (cudaMallocAsync)"
	case mrManaged:
		return "managed (cuMemAllocManaged)"
	case mrSystem:
		return "system (host memory)"
	}
	return t.name
}

// noDeviceReason is why rmm.CUDAAvailable says there is no device, in words: its error's text
// without the leading "rmm: " and the trailing sentinel ("no CUDA device"), which the caller says
// its own way.
func noDeviceReason(err error) string {
	msg := strings.TrimPrefix(err.Error(), "rmm: ")
	return strings.TrimSuffix(msg, ": "+strings.TrimPrefix(rmm.ErrNoDevice.Error(), "rmm: "))
}

// unavailable returns why the resource name stands for cannot be made here (it needs a GPU,
// and there is none), or nil.
func (s *setup) unavailable(name string) error {
	if typ := needsGPU(name); typ != "" && s.cudaErr != nil {
		why := noDeviceReason(s.cudaErr)
		return fmt.Errorf("-mr %s: %s needs a CUDA device, and there is none (%s); pool, stitching, expandable, plain and system run on host memory", name, typ, why)
	}
	return nil
}

// build makes the resource name stands for. Its errors name it.
func (s *setup) build(name string) (*target, error) {
	if err := s.unavailable(name); err != nil {
		return nil, err
	}
	t := &target{name: name}
	var err error
	switch name {
	case mrPool, mrStitching, mrExpandable, mrPlain:
		err = s.buildPool(t)
	case mrCuda:
		var c *rmm.CudaMemoryResource
		if c, err = rmm.NewCudaMemoryResource(s.dev); err == nil {
			t.upstream = &peakResource{MemoryResource: c}
			t.mr, t.desc = t.upstream, "CudaMemoryResource on "+s.where
		}
	case mrManaged:
		var m *rmm.ManagedMemoryResource
		if m, err = rmm.NewManagedMemoryResource(s.dev); err == nil {
			t.upstream = &peakResource{MemoryResource: m}
			t.mr, t.desc = t.upstream, "ManagedMemoryResource on "+s.where
		}
	case mrAsync:
		var a *rmm.CudaAsyncMemoryResource
		if a, err = rmm.NewCudaAsyncMemoryResource(s.dev, &rmm.CudaAsyncOptions{InitialPoolSize: s.initial.n, ReleaseThreshold: -1}); err == nil {
			t.async, t.mr, t.close = a, a, a.Close
			t.desc = "CudaAsyncMemoryResource on " + s.where
		}
	case mrSystem:
		t.upstream = &peakResource{MemoryResource: rmm.NewSystemMemoryResource()}
		t.mr, t.desc = t.upstream, "SystemMemoryResource (host memory)"
	default:
		err = fmt.Errorf("unknown resource") // parseMRList let it through: a bug
	}
	if err != nil {
		return nil, fmt.Errorf("-mr %s: %w", name, err)
	}
	return t, nil
}

// buildPool makes a pool over the GPU, host memory where there is no GPU, or simulated memory
// (-simulate), of the kind its name says.
func (s *setup) buildPool(t *target) error {
	var up rmm.MemoryResource
	var over string
	switch {
	case s.simulate.set:
		sim, err := rmm.NewSimulatedMemoryResource(s.simulate.n)
		if err != nil {
			return err
		}
		up, over = sim, fmt.Sprintf("SimulatedMemoryResource (%d bytes, address-only)", s.simulate.n)
	case s.cudaErr == nil:
		cuda, err := rmm.NewCudaMemoryResource(s.dev)
		if err != nil {
			return err
		}
		up, over = cuda, "CudaMemoryResource on "+s.where
	default:
		up, over = rmm.NewSystemMemoryResource(), "SystemMemoryResource (host memory; "+s.where+")"
	}
	kind, _ := poolKind(t.name)
	opts := kind.Options()
	opts.InitialPoolSize, opts.MaximumPoolSize = s.initial.n, s.maximum.n
	// An expandable pool maps its own memory: its peak size is what it reserved. A plain pool's
	// peak size (Stats) is the most it took from the upstream: no counting wrapper, whose type
	// name would show in the pool's errors.
	pool, err := rmm.NewPoolMemoryResource(up, &opts)
	if err != nil && t.name == mrPool && kind != rmm.PlainPool && errors.Is(err, rmm.ErrNotSupported) {
		// The default, on a GPU without virtual memory management: librmm's pool, as
		// rmm.Reinitialize falls back to it.
		opts = rmm.PlainPool.Options()
		opts.InitialPoolSize, opts.MaximumPoolSize = s.initial.n, s.maximum.n
		pool, err = rmm.NewPoolMemoryResource(up, &opts)
	}
	if err != nil {
		return err
	}
	t.desc = "PoolMemoryResource over " + over
	if k := pool.Kind(); k != rmm.PlainPool {
		t.desc = k.String() + " " + t.desc
		if _, host := up.(*rmm.SystemMemoryResource); host && k == rmm.StitchingPool {
			// Its pieces are memfds, made larger where the limit on open files is low: its
			// footprint can differ from the GPU's and -simulate's.
			t.desc += ", its pieces memfds sized to hold at most half of the open-file limit"
		}
	}
	t.pool, t.mr, t.close = pool, pool, pool.Close
	return nil
}

// peakResource counts the bytes that pass through it to its upstream, current and peak.
type peakResource struct {
	rmm.MemoryResource
	cur, peak atomic.Int64
}

func (r *peakResource) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	p, err := r.MemoryResource.Allocate(n, s)
	if err == nil {
		c := r.cur.Add(int64(n))
		for {
			pk := r.peak.Load()
			if c <= pk || r.peak.CompareAndSwap(pk, c) {
				break
			}
		}
	}
	return p, err
}

func (r *peakResource) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	err := r.MemoryResource.Deallocate(p, n, s)
	if err == nil && p != 0 {
		r.cur.Add(-int64(n))
	}
	return err
}

func (r *peakResource) Upstream() rmm.MemoryResource { return r.MemoryResource }
func (r *peakResource) Access() rmm.Access           { return rmm.AccessOf(r.MemoryResource) }
