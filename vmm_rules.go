package rmm

import (
	"fmt"
	"sort"
	"sync"
)

// vmmBook is the driver's rules, kept once for the fakes of vmm (simVMM, hostVMM): it keeps the
// reservations, the handles and the mappings, checks every call, counts, and leaves what lies
// behind the addresses to the fake's vmmMemory (nothing for simVMM; mmap, mprotect and memfds for
// hostVMM). A fake embeds a vmmBook, which gives it the methods of vmm.
//
// The rules (each broken one is ErrInvalidArgument naming the fake, the operation and the
// addresses; a failed call changes nothing):
//   - every size and address is a multiple of the granularity; sizes are positive;
//   - mapAt: inside one reservation, over no existing mapping, of a live (created, not released)
//     handle, with size equal to the handle's size (a mapping is one whole handle); with
//     oneMapping, a handle already mapped is ErrNotSupported;
//   - setAccess: over whole mappings, back to back, inside one reservation (stricter than the
//     device, which only asks for the range to be wholly mapped);
//   - unmap: inside one reservation, over whole mappings (several at once are fine); the unmapped
//     parts of the range are skipped, as the device silently accepts unmapping an unmapped range;
//   - free: exactly one whole reservation with nothing mapped in it;
//   - release: a live handle; its bytes are uncharged once it is also unmapped.
//
// create beyond limit is ErrOutOfMemory. Safe for concurrent use (one mutex, held across the
// calls to the memory side too).
type vmmBook struct {
	name       string // the fake's, in messages
	gran       int
	mem        vmmMemory
	oneMapping bool // a handle may be mapped at one address at a time

	mu       sync.Mutex
	limit    int               // bytes; 0: no limit
	res      []*vmmReservation // sorted by base
	handles  map[vmmHandle]*vmmBookHandle
	next     vmmHandle
	physical int
	nMaps    int
	counts   vmmStats // the counters only
}

// vmmMemory is the memory side of a fake vmm: what it does behind the addresses once vmmBook has
// checked a call. Each method is called with the book's mutex held; an error makes the call fail
// with nothing changed in the book.
type vmmMemory interface {
	// memReserve returns the base, a non-zero multiple of the granularity, of size bytes of
	// address space that no other reservation uses; mem is kept with the reservation.
	memReserve(size int) (base DevicePtr, mem []byte, err error)
	// memFree gives back the address space of r.
	memFree(r *vmmReservation) error
	// memCreate makes the memory of a new handle of size bytes: fd is kept with the handle (-1:
	// none).
	memCreate(size int) (fd int, err error)
	// memAccess grants access over ms, whole mappings back to back; on failure the ones that had
	// no access still have none.
	memAccess(ms []vmmMapping) error
	// memUnmap takes away the memory behind ms, whole mappings in address order, not overlapping.
	memUnmap(ms []vmmMapping) error
	// memGone drops the memory of a handle that is released and no longer mapped.
	memGone(hd *vmmBookHandle)
}

type vmmReservation struct {
	base DevicePtr
	size int
	mem  []byte       // the memory side's (hostVMM: the whole OS mapping)
	maps []vmmMapping // sorted by addr, not overlapping
}

type vmmMapping struct {
	addr   DevicePtr
	size   int
	h      vmmHandle
	access bool
}

type vmmBookHandle struct {
	size     int
	released bool
	maps     int // mappings of it
	fd       int // the memory side's (hostVMM aliasing: its memfd); -1: none
}

// vmmStats is a snapshot of a fake vmm, for tests.
type vmmStats struct {
	Physical     int // bytes created and not given back (given back: released and unmapped)
	Handles      int // handles not given back (including released ones still mapped)
	Mappings     int // live mappings
	Reservations int // live reservations
	Creates      int // successful creates, ever
	Releases     int // successful releases, ever
	Maps         int // successful mapAts, ever
	Unmaps       int // mappings removed by unmap, ever
}

// init sets up b, the book of a fake named name whose memory side is mem.
func (b *vmmBook) init(name string, gran, limit int, mem vmmMemory) {
	b.name, b.gran, b.limit, b.mem = name, gran, limit, mem
	b.handles = map[vmmHandle]*vmmBookHandle{}
}

func (b *vmmBook) granularity() int { return b.gran }

// reserve takes size bytes of address space from the memory side.
func (b *vmmBook) reserve(size int) (DevicePtr, error) {
	if err := vmmCheckSize(b.name, "reserve", size, b.gran); err != nil {
		return 0, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	base, mem, err := b.mem.memReserve(size)
	if err != nil {
		return 0, errorf("%s.reserve(%d bytes): %w", b.name, size, err)
	}
	r := &vmmReservation{base: base, size: size, mem: mem}
	i := sort.Search(len(b.res), func(i int) bool { return b.res[i].base > r.base })
	b.res = append(b.res, nil)
	copy(b.res[i+1:], b.res[i:])
	b.res[i] = r
	b.counts.Reservations++
	return r.base, nil
}

// free gives back the reservation at base; it must be the whole reservation and have nothing
// mapped in it.
func (b *vmmBook) free(base DevicePtr, size int) error {
	if err := vmmCheckRange(b.name, "free", base, size, b.gran); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	i := sort.Search(len(b.res), func(i int) bool { return b.res[i].base >= base })
	if i == len(b.res) || b.res[i].base != base || b.res[i].size != size {
		return errorf("%s.free(%#x, %d bytes): not a whole reservation: %w", b.name, uintptr(base), size, ErrInvalidArgument)
	}
	r := b.res[i]
	if len(r.maps) > 0 {
		return errorf("%s.free(%#x, %d bytes): %d mappings are left in the reservation, the first at %#x: %w", b.name, uintptr(base), size, len(r.maps), uintptr(r.maps[0].addr), ErrInvalidArgument)
	}
	if err := b.mem.memFree(r); err != nil {
		return errorf("%s.free(%#x, %d bytes): %w", b.name, uintptr(base), size, err)
	}
	b.res = append(b.res[:i], b.res[i+1:]...)
	b.counts.Reservations--
	return nil
}

// create charges size bytes against the limit and returns a new handle.
func (b *vmmBook) create(size int) (vmmHandle, error) {
	if err := vmmCheckSize(b.name, "create", size, b.gran); err != nil {
		return 0, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.limit > 0 && size > b.limit-b.physical {
		return 0, errorf("%s.create(%d bytes): %d of the limit of %s are already created: %w", b.name, size, b.physical, bytesText(b.limit), ErrOutOfMemory)
	}
	fd, err := b.mem.memCreate(size)
	if err != nil {
		return 0, errorf("%s.create(%d bytes): %w", b.name, size, err)
	}
	b.next++
	b.handles[b.next] = &vmmBookHandle{size: size, fd: fd}
	b.physical += size
	b.counts.Creates++
	return b.next, nil
}

// reservationOf returns the reservation holding all of [addr, addr+size), or nil (mu held).
func (b *vmmBook) reservationOf(addr DevicePtr, size int) *vmmReservation {
	i := sort.Search(len(b.res), func(i int) bool { return b.res[i].base > addr }) - 1
	if i < 0 {
		return nil
	}
	r := b.res[i]
	if uintptr(addr)+uintptr(size) > uintptr(r.base)+uintptr(r.size) {
		return nil
	}
	return r
}

// firstEndingAfter returns the index of the first mapping of r that ends after addr.
func (r *vmmReservation) firstEndingAfter(addr DevicePtr) int {
	return sort.Search(len(r.maps), func(i int) bool { return r.maps[i].addr+DevicePtr(r.maps[i].size) > addr })
}

// wholeMappings returns the index range [i, j) of the mappings of r inside [addr, end), or an
// error text when a mapping straddles addr or end, or (if contiguous) when part of the range is
// not mapped.
func (r *vmmReservation) wholeMappings(addr, end DevicePtr, contiguous bool) (i, j int, why string) {
	i = r.firstEndingAfter(addr)
	if i < len(r.maps) && r.maps[i].addr < addr {
		return 0, 0, fmt.Sprintf("the mapping [%#x, %#x) straddles the start", uintptr(r.maps[i].addr), uintptr(r.maps[i].addr)+uintptr(r.maps[i].size))
	}
	cursor := addr
	for j = i; j < len(r.maps) && r.maps[j].addr < end; j++ {
		m := r.maps[j]
		if contiguous && m.addr != cursor {
			return 0, 0, fmt.Sprintf("[%#x, %#x) is not mapped", uintptr(cursor), uintptr(m.addr))
		}
		if m.addr+DevicePtr(m.size) > end {
			return 0, 0, fmt.Sprintf("the mapping [%#x, %#x) straddles the end", uintptr(m.addr), uintptr(m.addr)+uintptr(m.size))
		}
		cursor = m.addr + DevicePtr(m.size)
	}
	if contiguous && cursor != end {
		return 0, 0, fmt.Sprintf("[%#x, %#x) is not mapped", uintptr(cursor), uintptr(end))
	}
	return i, j, ""
}

// wholeMappings checks the range [addr, addr+size) given to op: aligned, inside one reservation r,
// and made of the whole mappings r.maps[i:j] (back to back if contiguous). Call with mu held.
func (b *vmmBook) wholeMappings(op string, addr DevicePtr, size int, contiguous bool) (r *vmmReservation, i, j int, err error) {
	if err := vmmCheckRange(b.name, op, addr, size, b.gran); err != nil {
		return nil, 0, 0, err
	}
	if r = b.reservationOf(addr, size); r == nil {
		return nil, 0, 0, errorf("%s.%s(%#x, %d bytes): not inside a reservation: %w", b.name, op, uintptr(addr), size, ErrInvalidArgument)
	}
	i, j, why := r.wholeMappings(addr, addr+DevicePtr(size), contiguous)
	if why != "" {
		return nil, 0, 0, errorf("%s.%s(%#x, %d bytes): not whole mappings: %s: %w", b.name, op, uintptr(addr), size, why, ErrInvalidArgument)
	}
	return r, i, j, nil
}

// mapAt records the mapping of the whole of h at addr; it has no access until setAccess.
func (b *vmmBook) mapAt(addr DevicePtr, size int, h vmmHandle) error {
	if err := vmmCheckRange(b.name, "mapAt", addr, size, b.gran); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	bad := func(format string, a ...any) error {
		return errorf("%s.mapAt(%#x, %s, handle %d): %s: %w", b.name, uintptr(addr), bytesText(size), uint64(h), fmt.Sprintf(format, a...), ErrInvalidArgument)
	}
	r := b.reservationOf(addr, size)
	if r == nil {
		return bad("not inside a reservation")
	}
	hd := b.handles[h]
	switch {
	case hd == nil:
		return bad("unknown handle")
	case hd.released:
		return bad("the handle was released")
	case hd.size != size:
		return bad("the handle has %d bytes and a mapping is one whole handle", hd.size)
	}
	i := r.firstEndingAfter(addr)
	if i < len(r.maps) && r.maps[i].addr < addr+DevicePtr(size) {
		m := r.maps[i]
		return bad("overlaps the mapping [%#x, %#x)", uintptr(m.addr), uintptr(m.addr)+uintptr(m.size))
	}
	if hd.maps > 0 && b.oneMapping {
		return errorf("%s.mapAt(%#x, %s, handle %d): the handle is already mapped, and host memory cannot show one handle at two addresses: %w", b.name, uintptr(addr), bytesText(size), uint64(h), ErrNotSupported)
	}
	r.maps = append(r.maps, vmmMapping{})
	copy(r.maps[i+1:], r.maps[i:])
	r.maps[i] = vmmMapping{addr: addr, size: size, h: h}
	hd.maps++
	b.nMaps++
	b.counts.Maps++
	return nil
}

// setAccess grants access over [addr, addr+size), whole mappings back to back.
func (b *vmmBook) setAccess(addr DevicePtr, size int) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	r, i, j, err := b.wholeMappings("setAccess", addr, size, true)
	if err != nil {
		return err
	}
	if err := b.mem.memAccess(r.maps[i:j]); err != nil {
		return errorf("%s.setAccess(%#x, %d bytes): %w", b.name, uintptr(addr), size, err)
	}
	for k := i; k < j; k++ {
		r.maps[k].access = true
	}
	return nil
}

// unmap removes the whole mappings inside [addr, addr+size); a handle released and no longer
// mapped is given back.
func (b *vmmBook) unmap(addr DevicePtr, size int) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	r, i, j, err := b.wholeMappings("unmap", addr, size, false)
	if err != nil {
		return err
	}
	if i == j {
		return nil
	}
	if err := b.mem.memUnmap(r.maps[i:j]); err != nil {
		return errorf("%s.unmap(%#x, %d bytes): %w", b.name, uintptr(addr), size, err)
	}
	for _, m := range r.maps[i:j] {
		hd := b.handles[m.h]
		hd.maps--
		if hd.released && hd.maps == 0 {
			b.gone(m.h, hd)
		}
	}
	r.maps = append(r.maps[:i], r.maps[j:]...)
	b.nMaps -= j - i
	b.counts.Unmaps += j - i
	return nil
}

// release drops h; its bytes are uncharged now if it is not mapped, else at its last unmap.
func (b *vmmBook) release(h vmmHandle) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	hd := b.handles[h]
	if hd == nil || hd.released {
		return errorf("%s.release(handle %d): unknown or already released handle: %w", b.name, uint64(h), ErrInvalidArgument)
	}
	if hd.maps > 0 {
		hd.released = true
	} else {
		b.gone(h, hd)
	}
	b.counts.Releases++
	return nil
}

// gone forgets the handle h, released and no longer mapped, and uncharges its bytes (mu held).
func (b *vmmBook) gone(h vmmHandle, hd *vmmBookHandle) {
	b.mem.memGone(hd)
	delete(b.handles, h)
	b.physical -= hd.size
}

// stats returns the counters.
func (b *vmmBook) stats() vmmStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.counts
	s.Physical = b.physical
	s.Handles = len(b.handles)
	s.Mappings = b.nMaps
	return s
}

// mappingAt returns the mapping holding addr.
func (b *vmmBook) mappingAt(addr DevicePtr) (vmmMapping, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	r := b.reservationOf(addr, 1)
	if r == nil {
		return vmmMapping{}, false
	}
	i := r.firstEndingAfter(addr)
	if i == len(r.maps) || r.maps[i].addr > addr {
		return vmmMapping{}, false
	}
	return r.maps[i], true
}

// mapped reports whether addr lies in a mapping.
func (b *vmmBook) mapped(addr DevicePtr) bool {
	_, ok := b.mappingAt(addr)
	return ok
}

// accessible reports whether addr lies in a mapping that was given access.
func (b *vmmBook) accessible(addr DevicePtr) bool {
	m, ok := b.mappingAt(addr)
	return ok && m.access
}
