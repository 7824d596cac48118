package rmm

import "sync"

// countingVMM counts the driver calls an expandable pool makes.
type countingVMM struct {
	vmm
	mu sync.Mutex
	vmmCounts
}

// vmmCounts are the calls counted so far, and the bytes of handles created.
type vmmCounts struct {
	creates, maps, unmaps, releases  int
	access, reserves, frees          int
	created, createdPeak, createdNow int // bytes
}

func (v *countingVMM) counts() vmmCounts {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.vmmCounts
}

func newCountingVMM(inner vmm) *countingVMM {
	return &countingVMM{vmm: inner}
}

func (v *countingVMM) create(n int) (vmmHandle, error) {
	h, err := v.vmm.create(n)
	if err == nil {
		v.mu.Lock()
		v.creates++
		v.created += n
		v.createdNow += n
		v.createdPeak = max(v.createdPeak, v.createdNow)
		v.mu.Unlock()
	}
	return h, err
}

func (v *countingVMM) mapAt(a DevicePtr, n int, h vmmHandle) error {
	err := v.vmm.mapAt(a, n, h)
	if err == nil {
		v.mu.Lock()
		v.maps++
		v.mu.Unlock()
	}
	return err
}

func (v *countingVMM) setAccess(a DevicePtr, n int) error {
	v.mu.Lock()
	v.access++
	v.mu.Unlock()
	return v.vmm.setAccess(a, n)
}

func (v *countingVMM) unmap(a DevicePtr, n int) error {
	err := v.vmm.unmap(a, n)
	if err == nil {
		v.mu.Lock()
		v.unmaps++
		v.mu.Unlock()
	}
	return err
}

func (v *countingVMM) release(h vmmHandle) error {
	n := 0
	if sv, ok := v.vmm.(*simVMM); ok {
		sv.mu.Lock()
		if hd := sv.handles[h]; hd != nil {
			n = hd.size
		}
		sv.mu.Unlock()
	}
	err := v.vmm.release(h)
	if err == nil {
		v.mu.Lock()
		v.releases++
		v.createdNow -= n
		v.mu.Unlock()
	}
	return err
}

func (v *countingVMM) reserve(n int) (DevicePtr, error) {
	a, err := v.vmm.reserve(n)
	if err == nil {
		v.mu.Lock()
		v.reserves++
		v.mu.Unlock()
	}
	return a, err
}

func (v *countingVMM) free(a DevicePtr, n int) error {
	err := v.vmm.free(a, n)
	if err == nil {
		v.mu.Lock()
		v.frees++
		v.mu.Unlock()
	}
	return err
}
