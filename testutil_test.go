package rmm

import (
	"fmt"
	"sync"
)

// limitedUpstream hands out address-only memory (a SimulatedMemoryResource) but refuses any
// allocation that would take its charged total above limit, charging each allocation rounded up
// to 256 bytes, as librmm's limiting adaptor does. It records every call.
type limitedUpstream struct {
	mu      sync.Mutex
	inner   *SimulatedMemoryResource
	limit   int
	charged int
	asked   []int // every size asked, granted or not
	granted []int
}

func newLimitedUpstream(limit int) *limitedUpstream {
	sim, _ := NewSimulatedMemoryResource(1 << 60)
	return &limitedUpstream{inner: sim, limit: limit}
}

func (u *limitedUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.asked = append(u.asked, n)
	c, _ := AlignUp(n, 256)
	if u.charged+c > u.limit {
		return 0, fmt.Errorf("%w: limited upstream: %d + %d > %d", ErrOutOfMemory, u.charged, c, u.limit)
	}
	p, err := u.inner.Allocate(n, s)
	if err != nil {
		return 0, err
	}
	u.charged += c
	u.granted = append(u.granted, n)
	return p, nil
}

func (u *limitedUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if err := u.inner.Deallocate(p, n, s); err != nil {
		return err
	}
	c, _ := AlignUp(n, 256)
	u.charged -= c
	return nil
}

func (u *limitedUpstream) Access() Access { return 0 }
