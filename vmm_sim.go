package rmm

import (
	"fmt"
	"sync"
)

// simulatedVMMBase is where simulated reservations start: above the 47-bit user address space,
// like SimulatedMemoryResource's addresses, and apart from them.
const simulatedVMMBase = uintptr(1) << 56

// simVMM is an address-only vmm: it hands out addresses and checks the driver's rules
// (granularity, a mapping is one whole handle, no double mapping, access only over mapped memory,
// whole mappings unmapped, nothing mapped when the reservation is freed), with a limit on the
// physical bytes created. No memory is behind the addresses: it is the expandable pool's
// counterpart of SimulatedMemoryResource, to replay traces of a large GPU anywhere, and the
// tests' fake.
type simVMM struct {
	mu       sync.Mutex
	gran     int
	limit    int // physical bytes; 0: none
	next     DevicePtr
	resv     map[DevicePtr]int
	handles  map[vmmHandle]int  // size
	released map[vmmHandle]bool // released but maybe still mapped
	maps     map[DevicePtr]simMapping
	hnext    vmmHandle
	charged  int // bytes of handles not yet gone (released and unmapped)
	creates  int
	unmaps   int
	failNext int // tests: fail the next create(s) with out of memory
}

type simMapping struct {
	size   int
	h      vmmHandle
	access bool
}

func newSimVMM(gran, limit int) *simVMM {
	return &simVMM{gran: gran, limit: limit, next: DevicePtr(simulatedVMMBase), resv: map[DevicePtr]int{}, handles: map[vmmHandle]int{},
		released: map[vmmHandle]bool{}, maps: map[DevicePtr]simMapping{}, hnext: 1}
}

func (v *simVMM) granularity() int { return v.gran }

func (v *simVMM) aligned(op string, a DevicePtr, n int) error {
	if int(a)%v.gran != 0 || n <= 0 || n%v.gran != 0 {
		return fmt.Errorf("%w: simulated VMM: %s(%#x, %d): off the granularity %d", ErrInvalidArgument, op, uintptr(a), n, v.gran)
	}
	return nil
}

func (v *simVMM) reserve(n int) (DevicePtr, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.aligned("reserve", v.next, n); err != nil {
		return 0, err
	}
	b := v.next
	v.resv[b] = n
	v.next += DevicePtr(n) + DevicePtr(v.gran)
	return b, nil
}

func (v *simVMM) inReservation(a DevicePtr, n int) bool {
	for b, sz := range v.resv {
		if a >= b && a+DevicePtr(n) <= b+DevicePtr(sz) {
			return true
		}
	}
	return false
}

func (v *simVMM) free(b DevicePtr, n int) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.resv[b] != n {
		return fmt.Errorf("%w: simulated VMM: free(%#x, %d): not a whole reservation", ErrInvalidArgument, uintptr(b), n)
	}
	for a := range v.maps {
		if a >= b && a < b+DevicePtr(n) {
			return fmt.Errorf("%w: simulated VMM: free(%#x, %d): %#x is still mapped", ErrInvalidArgument, uintptr(b), n, uintptr(a))
		}
	}
	delete(v.resv, b)
	return nil
}

func (v *simVMM) create(n int) (vmmHandle, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.aligned("create", 0, n); err != nil {
		return 0, err
	}
	if v.failNext > 0 {
		v.failNext--
		return 0, fmt.Errorf("%w: simulated VMM: create(%d): refused", ErrOutOfMemory, n)
	}
	if v.limit > 0 && v.charged+n > v.limit {
		return 0, fmt.Errorf("%w: simulated VMM: create(%d): %d of %d bytes charged", ErrOutOfMemory, n, v.charged, v.limit)
	}
	h := v.hnext
	v.hnext++
	v.handles[h] = n
	v.charged += n
	v.creates++
	return h, nil
}

func (v *simVMM) mappedAt(h vmmHandle) bool {
	for _, m := range v.maps {
		if m.h == h {
			return true
		}
	}
	return false
}

func (v *simVMM) mapAt(a DevicePtr, n int, h vmmHandle) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.aligned("mapAt", a, n); err != nil {
		return err
	}
	if v.handles[h] != n || v.released[h] {
		return fmt.Errorf("%w: simulated VMM: mapAt(%#x, %d, %d): not a live handle of that size", ErrInvalidArgument, uintptr(a), n, h)
	}
	if !v.inReservation(a, n) {
		return fmt.Errorf("%w: simulated VMM: mapAt(%#x, %d): outside every reservation", ErrInvalidArgument, uintptr(a), n)
	}
	for b, m := range v.maps {
		if a < b+DevicePtr(m.size) && b < a+DevicePtr(n) {
			return fmt.Errorf("%w: simulated VMM: mapAt(%#x, %d): overlaps the mapping at %#x", ErrInvalidArgument, uintptr(a), n, uintptr(b))
		}
	}
	v.maps[a] = simMapping{size: n, h: h}
	return nil
}

// covered returns the mappings tiling [a, a+n) exactly, or false.
func (v *simVMM) covered(a DevicePtr, n int) ([]DevicePtr, bool) {
	var got []DevicePtr
	for at := a; at < a+DevicePtr(n); {
		m, ok := v.maps[at]
		if !ok {
			return nil, false
		}
		got = append(got, at)
		at += DevicePtr(m.size)
		if at > a+DevicePtr(n) {
			return nil, false
		}
	}
	return got, true
}

func (v *simVMM) setAccess(a DevicePtr, n int) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	ms, ok := v.covered(a, n)
	if !ok {
		return fmt.Errorf("%w: simulated VMM: setAccess(%#x, %d): not wholly mapped", ErrInvalidArgument, uintptr(a), n)
	}
	for _, at := range ms {
		m := v.maps[at]
		m.access = true
		v.maps[at] = m
	}
	return nil
}

func (v *simVMM) unmap(a DevicePtr, n int) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	ms, ok := v.covered(a, n)
	if !ok {
		return fmt.Errorf("%w: simulated VMM: unmap(%#x, %d): not whole mappings", ErrInvalidArgument, uintptr(a), n)
	}
	for _, at := range ms {
		m := v.maps[at]
		delete(v.maps, at)
		if v.released[m.h] && !v.mappedAt(m.h) {
			v.charged -= v.handles[m.h]
			delete(v.handles, m.h)
			delete(v.released, m.h)
		}
	}
	v.unmaps++
	return nil
}

func (v *simVMM) release(h vmmHandle) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if _, ok := v.handles[h]; !ok || v.released[h] {
		return fmt.Errorf("%w: simulated VMM: release(%d): unknown handle", ErrInvalidArgument, h)
	}
	if v.mappedAt(h) {
		v.released[h] = true
		return nil
	}
	v.charged -= v.handles[h]
	delete(v.handles, h)
	return nil
}

func (v *simVMM) stats() (charged, mappings, creates, unmaps int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.charged, len(v.maps), v.creates, v.unmaps
}
