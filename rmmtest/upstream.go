package rmmtest

import (
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/gormm/rmm"
)

// span is an address range [addr, addr+size).
type span struct {
	addr rmm.DevicePtr
	size int
}

func (s span) end() rmm.DevicePtr { return s.addr + rmm.DevicePtr(s.size) }

func (s span) String() string { return fmt.Sprintf("[%#x, +%d)", uintptr(s.addr), s.size) }

func spansString(ss []span) string {
	if len(ss) > 8 {
		return fmt.Sprintf("%v ... (%d blocks)", ss[:8], len(ss))
	}
	return fmt.Sprint(ss)
}

// recordingUpstream is the upstream the suite hands to newResource. It forwards every call to
// inner and records the blocks it handed out and has not taken back. A free of a block it did not
// hand out, or with another size, is misuse by the resource under test: it is recorded, refused
// with rmm.ErrInvalidFree, and not passed on. It reports inner's access and device, and is not an
// rmm.Upstreamer, so that nothing walks past it to inner.
type recordingUpstream struct {
	inner rmm.MemoryResource

	mu       sync.Mutex
	held     map[rmm.DevicePtr]int
	grants   int
	refusals int
	retries  int // grants right after a refusal of a larger request (a resource's back-off)
	refused  int // the size of the last request if it was refused, else 0
	misuse   error
}

func newRecordingUpstream(inner rmm.MemoryResource) *recordingUpstream {
	return &recordingUpstream{inner: inner, held: map[rmm.DevicePtr]int{}}
}

// Allocate forwards to the inner resource and records the block.
func (u *recordingUpstream) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	p, err := u.inner.Allocate(n, s)
	u.mu.Lock()
	defer u.mu.Unlock()
	if err != nil {
		u.refusals++
		u.refused = n
		return p, err
	}
	if n < u.refused {
		u.retries++
	}
	u.refused = 0
	if n > 0 && p != 0 {
		if _, dup := u.held[p]; dup && u.misuse == nil {
			u.misuse = fmt.Errorf("the upstream %T handed out %#x twice", u.inner, uintptr(p))
		}
		u.held[p] = n
		u.grants++
	}
	return p, nil
}

// Deallocate checks the block against what was handed out and forwards the free.
func (u *recordingUpstream) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	if p == 0 {
		return u.inner.Deallocate(p, n, s)
	}
	u.mu.Lock()
	size, ok := u.held[p]
	if !ok || size != n {
		var err error
		if !ok {
			err = fmt.Errorf("%w: the resource freed %#x (%d bytes) to its upstream, which did not hand it out or already took it back", rmm.ErrInvalidFree, uintptr(p), n)
		} else {
			err = fmt.Errorf("%w: the resource freed %#x to its upstream with %d bytes; it was allocated with %d", rmm.ErrInvalidFree, uintptr(p), n, size)
		}
		if u.misuse == nil {
			u.misuse = err
		}
		u.mu.Unlock()
		return err
	}
	delete(u.held, p)
	u.mu.Unlock()
	if err := u.inner.Deallocate(p, n, s); err != nil {
		u.mu.Lock()
		u.held[p] = n // still held: the inner resource refused it
		u.mu.Unlock()
		return err
	}
	return nil
}

// Access reports the inner resource's access.
func (u *recordingUpstream) Access() rmm.Access { return rmm.AccessOf(u.inner) }

// Device reports the inner resource's device.
func (u *recordingUpstream) Device() rmm.Device { return rmm.DeviceOf(u.inner) }

func (u *recordingUpstream) String() string {
	return fmt.Sprintf("recording upstream over %T", u.inner)
}

// used reports whether the upstream ever handed out memory.
func (u *recordingUpstream) used() bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.grants > 0
}

// counts returns the requests refused, and the grants right after the refusal of a larger
// request.
func (u *recordingUpstream) counts() (refusals, retries int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.refusals, u.retries
}

// blocks returns the blocks held, in address order, and the first misuse seen.
func (u *recordingUpstream) blocks() ([]span, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	bs := make([]span, 0, len(u.held))
	for p, n := range u.held {
		bs = append(bs, span{p, n})
	}
	slices.SortFunc(bs, func(a, b span) int { return compareAddr(a.addr, b.addr) })
	return bs, u.misuse
}

// contains reports whether [p, p+n) lies inside one block held now.
func (u *recordingUpstream) contains(p rmm.DevicePtr, n int) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	for base, size := range u.held {
		if p >= base && uintptr(p)+uintptr(n) <= uintptr(base)+uintptr(size) {
			return true
		}
	}
	return false
}

func compareAddr(a, b rmm.DevicePtr) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// inside reports whether [p, p+n) lies inside one of the blocks bs (sorted by address).
func inside(bs []span, p rmm.DevicePtr, n int) bool {
	k := sort.Search(len(bs), func(k int) bool { return bs[k].addr > p }) - 1
	return k >= 0 && uintptr(p)+uintptr(n) <= uintptr(bs[k].end())
}

// heldString describes the held blocks for messages.
func heldString(bs []span) string {
	if len(bs) == 0 {
		return "none"
	}
	return spansString(bs)
}
