package rmm

import (
	"sort"
	"sync"
)

// Constructors for the property tests (property_test.go, package rmm_test), which drive the
// conformance suite over resources that need the package's unexported fakes: an expandable pool
// over a VMM whose mappings the suite must see, and a pool whose CUDA calls go to a fake device.

// MappedRange is one maximal range of memory mapped by a TrackedVMM.
type MappedRange struct {
	Addr DevicePtr
	Size int
}

// TrackedVMM passes every call to a VMM (address-only or host memory) and keeps the ranges
// mapped, so that a test can hold an expandable pool's allocations to the memory it maps.
type TrackedVMM struct {
	vmm
	mu   sync.Mutex
	maps map[DevicePtr]int // every mapping: address -> size
}

func (v *TrackedVMM) mapAt(a DevicePtr, n int, h vmmHandle) error {
	if err := v.vmm.mapAt(a, n, h); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	v.maps[a] = n
	return nil
}

func (v *TrackedVMM) unmap(a DevicePtr, n int) error {
	if err := v.vmm.unmap(a, n); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	for at := range v.maps {
		if at >= a && at < a+DevicePtr(n) {
			delete(v.maps, at)
		}
	}
	return nil
}

// Ranges returns the memory mapped now as maximal ranges, in address order.
func (v *TrackedVMM) Ranges() []MappedRange {
	v.mu.Lock()
	defer v.mu.Unlock()
	as := make([]DevicePtr, 0, len(v.maps))
	for a := range v.maps {
		as = append(as, a)
	}
	sort.Slice(as, func(i, j int) bool { return as[i] < as[j] })
	var rs []MappedRange
	for _, a := range as {
		if k := len(rs) - 1; k >= 0 && rs[k].Addr+DevicePtr(rs[k].Size) == a {
			rs[k].Size += v.maps[a]
			continue
		}
		rs = append(rs, MappedRange{a, v.maps[a]})
	}
	return rs
}

// NewTrackedExpandablePool builds an expandable pool over a TrackedVMM of the given granularity
// and physical limit (0: none), over host memory when host is set, else over addresses without
// memory. upstream is the pool's upstream (only its accessibility matters: the pool maps its
// memory itself).
func NewTrackedExpandablePool(upstream MemoryResource, host bool, granularity, physicalLimit int, opts PoolOptions) (*PoolMemoryResource, *TrackedVMM, error) {
	var inner vmm
	if host {
		h, err := newHostVMM(granularity, physicalLimit)
		if err != nil {
			return nil, nil, err
		}
		inner = h
	} else {
		inner = newSimVMM(granularity, physicalLimit)
	}
	vm := &TrackedVMM{vmm: inner, maps: map[DevicePtr]int{}}
	opts.Expandable = true
	p, err := newExpandablePool(upstream, vm, opts, poolTuning{})
	if err != nil {
		return nil, nil, err
	}
	return p, vm, nil
}

// NewPoolOverFakeDevice builds a pool over upstream whose CUDA calls (events, waits,
// synchronisations) go to a fake device: every take from another stream's list, merge, Release
// and stream Close then unlocks the pool for them.
func NewPoolOverFakeDevice(upstream MemoryResource, opts *PoolOptions) (*PoolMemoryResource, error) {
	p, err := NewPoolMemoryResource(upstream, opts)
	if err != nil {
		return nil, err
	}
	f := newArenaSyncFake(nil)
	f.quiet = true
	p.ctx, p.drv = 1, f.driver()
	return p, nil
}
