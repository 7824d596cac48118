package rmm

import (
	"fmt"
	"sort"
	"sync"
	"syscall"
)

// hostVMM is vmm over host memory: the tests' fake of deviceVMM (with a granularity as small as
// the page size) and the expandable pool's backing when there is no GPU.
//
// A reservation is an anonymous private mapping with no access (mmap PROT_NONE, MAP_NORESERVE),
// its base aligned to the granularity. create only charges bytes against physicalLimit: the
// pages come from the kernel when first touched after setAccess (mprotect read/write), and
// unmap gives them back (mprotect PROT_NONE, then madvise MADV_DONTNEED). So, unlike on the
// device, a handle's contents are not kept across unmap, and a handle can be mapped at one
// address at a time (a second mapping is ErrNotSupported) — unless the hostVMM was made with
// newHostVMMAliasing: each handle is then a memfd of its size, setAccess maps it there (mmap
// MAP_SHARED over the reservation), and unmap puts the reservation's inaccessible placeholder
// back; a handle then keeps its contents across unmap and may be mapped at several addresses,
// which all see the same bytes, as on the device.
//
// It enforces the device's rules, so that tests catch misuse (each is ErrInvalidArgument naming
// the operation and the addresses; a failed call changes nothing):
//   - every size and address is a multiple of the granularity; sizes are positive;
//   - mapAt: inside one reservation, over no existing mapping, of a live (created, not released)
//     handle, with size equal to the handle's size (a mapping is one whole handle);
//   - setAccess: over whole mappings, back to back, inside one reservation (stricter than the
//     device, which only asks for the range to be wholly mapped);
//   - unmap: inside one reservation, over whole mappings (several at once are fine); the unmapped
//     parts of the range are skipped, as the device silently accepts unmapping an unmapped range;
//   - free: exactly one whole reservation with nothing mapped in it;
//   - release: a live handle; its bytes are uncharged once it is also unmapped.
//
// create beyond physicalLimit is ErrOutOfMemory. Safe for concurrent use (one mutex). Only on
// Linux; elsewhere newHostVMM returns ErrNotSupported.
type hostVMM struct {
	gran     int
	limit    int  // bytes; 0: no limit
	aliasing bool // handles are memfds (newHostVMMAliasing)

	mu       sync.Mutex
	res      []*hostVMMReservation // sorted by base
	handles  map[vmmHandle]*hostVMMHandle
	next     vmmHandle
	physical int
	nMaps    int
	counts   hostVMMStats // the counters only
}

type hostVMMReservation struct {
	base DevicePtr
	size int
	mem  []byte           // the whole OS mapping (the base may lie inside it, for alignment)
	maps []hostVMMMapping // sorted by addr, not overlapping
}

type hostVMMMapping struct {
	addr   DevicePtr
	size   int
	h      vmmHandle
	access bool
}

type hostVMMHandle struct {
	size     int
	released bool
	maps     int // mappings of it
	fd       int // aliasing: its memfd
}

// hostVMMStats is a snapshot of a hostVMM, for tests.
type hostVMMStats struct {
	Physical     int // bytes created and not given back (given back: released and unmapped)
	Handles      int // handles not given back (including released ones still mapped)
	Mappings     int // live mappings
	Reservations int // live reservations
	Creates      int // successful creates, ever
	Releases     int // successful releases, ever
	Maps         int // successful mapAts, ever
	Unmaps       int // mappings removed by unmap, ever
}

var _ vmm = (*hostVMM)(nil)

const hostVMMName = "hostVMM"

// newHostVMM returns a hostVMM whose sizes and addresses are multiples of granularity bytes (a
// positive multiple of the OS page size) and which lets at most physicalLimit bytes be created
// and not yet given back (0: no limit). The error wraps ErrInvalidArgument for a bad granularity
// or a negative limit, and ErrNotSupported on an OS other than Linux.
func newHostVMM(granularity int, physicalLimit int) (*hostVMM, error) {
	if !hostVMMSupported {
		return nil, fmt.Errorf("%w: %s: host virtual memory management is implemented on Linux only", ErrNotSupported, hostVMMName)
	}
	page := syscall.Getpagesize()
	if granularity <= 0 || granularity%page != 0 {
		return nil, fmt.Errorf("%w: %s: granularity %d is not a positive multiple of the page size %d", ErrInvalidArgument, hostVMMName, granularity, page)
	}
	if physicalLimit < 0 {
		return nil, fmt.Errorf("%w: %s: negative physical limit %d", ErrInvalidArgument, hostVMMName, physicalLimit)
	}
	return &hostVMM{gran: granularity, limit: physicalLimit, handles: map[vmmHandle]*hostVMMHandle{}}, nil
}

// newHostVMMAliasing is newHostVMM whose handles are memfds: a handle may be mapped at several
// addresses, all seeing its bytes, and keeps them across unmap (see hostVMM).
func newHostVMMAliasing(granularity int, physicalLimit int) (*hostVMM, error) {
	v, err := newHostVMM(granularity, physicalLimit)
	if err == nil {
		v.aliasing = true
	}
	return v, err
}

func (v *hostVMM) granularity() int { return v.gran }

// reserve maps size bytes of inaccessible address space (mmap PROT_NONE); ErrOutOfMemory when
// the OS refuses.
func (v *hostVMM) reserve(size int) (DevicePtr, error) {
	if err := vmmCheckSize(hostVMMName, "reserve", size, v.gran); err != nil {
		return 0, err
	}
	base, mem, err := hostVMMOSReserve(size, v.gran)
	if err != nil {
		return 0, fmt.Errorf("%s.reserve(%d bytes): %w", hostVMMName, size, err)
	}
	r := &hostVMMReservation{base: DevicePtr(base), size: size, mem: mem}
	v.mu.Lock()
	i := sort.Search(len(v.res), func(i int) bool { return v.res[i].base > r.base })
	v.res = append(v.res, nil)
	copy(v.res[i+1:], v.res[i:])
	v.res[i] = r
	v.counts.Reservations++
	v.mu.Unlock()
	return r.base, nil
}

// free unmaps the reservation at base (munmap); it must be the whole reservation and have
// nothing mapped in it.
func (v *hostVMM) free(base DevicePtr, size int) error {
	if err := vmmCheckRange(hostVMMName, "free", base, size, v.gran); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	i := sort.Search(len(v.res), func(i int) bool { return v.res[i].base >= base })
	if i == len(v.res) || v.res[i].base != base || v.res[i].size != size {
		return fmt.Errorf("%w: %s.free(%#x, %d bytes): not a whole reservation", ErrInvalidArgument, hostVMMName, uintptr(base), size)
	}
	r := v.res[i]
	if len(r.maps) > 0 {
		return fmt.Errorf("%w: %s.free(%#x, %d bytes): %d mappings are left in the reservation, the first at %#x", ErrInvalidArgument, hostVMMName, uintptr(base), size, len(r.maps), uintptr(r.maps[0].addr))
	}
	if err := hostVMMOSFree(r.mem); err != nil {
		return fmt.Errorf("%s.free(%#x, %d bytes): %w", hostVMMName, uintptr(base), size, err)
	}
	v.res = append(v.res[:i], v.res[i+1:]...)
	v.counts.Reservations--
	return nil
}

// create charges size bytes against the physical limit and returns a new handle; no memory is
// touched.
func (v *hostVMM) create(size int) (vmmHandle, error) {
	if err := vmmCheckSize(hostVMMName, "create", size, v.gran); err != nil {
		return 0, err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.limit > 0 && size > v.limit-v.physical {
		return 0, fmt.Errorf("%w: %s.create(%d bytes): %d of the limit of %d bytes are already created", ErrOutOfMemory, hostVMMName, size, v.physical, v.limit)
	}
	hd := &hostVMMHandle{size: size, fd: -1}
	if v.aliasing {
		fd, err := hostVMMOSMemfd(size)
		if err != nil {
			return 0, fmt.Errorf("%s.create(%d bytes): %w", hostVMMName, size, err)
		}
		hd.fd = fd
	}
	v.next++
	v.handles[v.next] = hd
	v.physical += size
	v.counts.Creates++
	return v.next, nil
}

// reservationOf returns the reservation holding all of [addr, addr+size), or nil. Call with mu
// held.
func (v *hostVMM) reservationOf(addr DevicePtr, size int) *hostVMMReservation {
	i := sort.Search(len(v.res), func(i int) bool { return v.res[i].base > addr }) - 1
	if i < 0 {
		return nil
	}
	r := v.res[i]
	if uintptr(addr)+uintptr(size) > uintptr(r.base)+uintptr(r.size) {
		return nil
	}
	return r
}

// firstEndingAfter returns the index of the first mapping of r that ends after addr.
func (r *hostVMMReservation) firstEndingAfter(addr DevicePtr) int {
	return sort.Search(len(r.maps), func(i int) bool { return r.maps[i].addr+DevicePtr(r.maps[i].size) > addr })
}

// wholeMappings returns the index range [i, j) of the mappings of r inside [addr, end), or an
// error text when a mapping straddles addr or end, or (if contiguous) when part of the range is
// not mapped.
func (r *hostVMMReservation) wholeMappings(addr, end DevicePtr, contiguous bool) (i, j int, why string) {
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

// mapAt records the mapping; the memory stays inaccessible until setAccess.
func (v *hostVMM) mapAt(addr DevicePtr, size int, h vmmHandle) error {
	if err := vmmCheckRange(hostVMMName, "mapAt", addr, size, v.gran); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s.mapAt(%#x, %d bytes, handle %d): %s", ErrInvalidArgument, hostVMMName, uintptr(addr), size, uint64(h), fmt.Sprintf(format, a...))
	}
	r := v.reservationOf(addr, size)
	if r == nil {
		return bad("not inside a reservation")
	}
	hd := v.handles[h]
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
	if hd.maps > 0 && !v.aliasing {
		return fmt.Errorf("%w: %s.mapAt(%#x, %d bytes, handle %d): the handle is already mapped, and host memory cannot show one handle at two addresses", ErrNotSupported, hostVMMName, uintptr(addr), size, uint64(h))
	}
	r.maps = append(r.maps, hostVMMMapping{})
	copy(r.maps[i+1:], r.maps[i:])
	r.maps[i] = hostVMMMapping{addr: addr, size: size, h: h}
	hd.maps++
	v.nMaps++
	v.counts.Maps++
	return nil
}

// setAccess makes [addr, addr+size) readable and writable by the process (mprotect).
func (v *hostVMM) setAccess(addr DevicePtr, size int) error {
	if err := vmmCheckRange(hostVMMName, "setAccess", addr, size, v.gran); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	r := v.reservationOf(addr, size)
	if r == nil {
		return fmt.Errorf("%w: %s.setAccess(%#x, %d bytes): not inside a reservation", ErrInvalidArgument, hostVMMName, uintptr(addr), size)
	}
	i, j, why := r.wholeMappings(addr, addr+DevicePtr(size), true)
	if why != "" {
		return fmt.Errorf("%w: %s.setAccess(%#x, %d bytes): not whole mappings: %s", ErrInvalidArgument, hostVMMName, uintptr(addr), size, why)
	}
	if v.aliasing {
		// Each mapping shows its handle's memfd; one already shown is shown again (the same
		// bytes).
		for k := i; k < j; k++ {
			m := r.maps[k]
			if err := hostVMMOSMapShared(uintptr(m.addr), m.size, v.handles[m.h].fd); err != nil {
				for _, m := range r.maps[i:k] {
					if !m.access {
						_ = hostVMMOSPlaceholder(uintptr(m.addr), m.size)
					}
				}
				return fmt.Errorf("%s.setAccess(%#x, %d bytes): %w", hostVMMName, uintptr(addr), size, err)
			}
		}
	} else if err := hostVMMOSProtect(uintptr(addr), size, true); err != nil {
		// Put back the mappings that had no access.
		for _, m := range r.maps[i:j] {
			if !m.access {
				_ = hostVMMOSProtect(uintptr(m.addr), m.size, false)
			}
		}
		return fmt.Errorf("%s.setAccess(%#x, %d bytes): %w", hostVMMName, uintptr(addr), size, err)
	}
	for k := i; k < j; k++ {
		r.maps[k].access = true
	}
	return nil
}

// unmap removes the whole mappings inside [addr, addr+size) and drops their pages (mprotect
// PROT_NONE, madvise MADV_DONTNEED).
func (v *hostVMM) unmap(addr DevicePtr, size int) error {
	if err := vmmCheckRange(hostVMMName, "unmap", addr, size, v.gran); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	r := v.reservationOf(addr, size)
	if r == nil {
		return fmt.Errorf("%w: %s.unmap(%#x, %d bytes): not inside a reservation", ErrInvalidArgument, hostVMMName, uintptr(addr), size)
	}
	i, j, why := r.wholeMappings(addr, addr+DevicePtr(size), false)
	if why != "" {
		return fmt.Errorf("%w: %s.unmap(%#x, %d bytes): not whole mappings: %s", ErrInvalidArgument, hostVMMName, uintptr(addr), size, why)
	}
	// Drop the pages of each run of adjacent mappings in one call.
	for k := i; k < j; {
		start, end := r.maps[k].addr, r.maps[k].addr+DevicePtr(r.maps[k].size)
		for k++; k < j && r.maps[k].addr == end; k++ {
			end += DevicePtr(r.maps[k].size)
		}
		drop := hostVMMOSDrop
		if v.aliasing {
			drop = hostVMMOSPlaceholder
		}
		if err := drop(uintptr(start), int(end-start)); err != nil {
			return fmt.Errorf("%s.unmap(%#x, %d bytes): %w", hostVMMName, uintptr(addr), size, err)
		}
	}
	for _, m := range r.maps[i:j] {
		hd := v.handles[m.h]
		hd.maps--
		if hd.released && hd.maps == 0 {
			v.gone(m.h, hd)
		}
	}
	r.maps = append(r.maps[:i], r.maps[j:]...)
	v.nMaps -= j - i
	v.counts.Unmaps += j - i
	return nil
}

// release drops h; its bytes are uncharged now if it is not mapped, else at its unmap.
func (v *hostVMM) release(h vmmHandle) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	hd := v.handles[h]
	if hd == nil || hd.released {
		return fmt.Errorf("%w: %s.release(handle %d): unknown or already released handle", ErrInvalidArgument, hostVMMName, uint64(h))
	}
	if hd.maps > 0 {
		hd.released = true
	} else {
		v.gone(h, hd)
	}
	v.counts.Releases++
	return nil
}

// gone forgets the handle h, released and no longer mapped, and uncharges its bytes (mu held).
func (v *hostVMM) gone(h vmmHandle, hd *hostVMMHandle) {
	if hd.fd >= 0 {
		_ = hostVMMOSClose(hd.fd)
	}
	delete(v.handles, h)
	v.physical -= hd.size
}

// stats returns the counters.
func (v *hostVMM) stats() hostVMMStats {
	v.mu.Lock()
	defer v.mu.Unlock()
	s := v.counts
	s.Physical = v.physical
	s.Handles = len(v.handles)
	s.Mappings = v.nMaps
	return s
}

// mappingAt returns the mapping holding addr.
func (v *hostVMM) mappingAt(addr DevicePtr) (hostVMMMapping, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	r := v.reservationOf(addr, 1)
	if r == nil {
		return hostVMMMapping{}, false
	}
	i := r.firstEndingAfter(addr)
	if i == len(r.maps) || r.maps[i].addr > addr {
		return hostVMMMapping{}, false
	}
	return r.maps[i], true
}

// mapped reports whether addr lies in a mapping.
func (v *hostVMM) mapped(addr DevicePtr) bool {
	_, ok := v.mappingAt(addr)
	return ok
}

// accessible reports whether addr lies in a mapping that was given access.
func (v *hostVMM) accessible(addr DevicePtr) bool {
	m, ok := v.mappingAt(addr)
	return ok && m.access
}
