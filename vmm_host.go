package rmm

import (
	"syscall"
)

// hostVMM is vmm over host memory: the tests' fake of deviceVMM (with a granularity as small as
// the page size) and the expandable pool's backing when there is no GPU. Its vmmBook checks the
// device's rules and keeps the books; hostVMM is the memory behind the addresses.
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
// Only on Linux; elsewhere newHostVMM returns ErrNotSupported.
type hostVMM struct {
	vmmBook
	aliasing bool // handles are memfds (newHostVMMAliasing)
}

var _ vmm = (*hostVMM)(nil)

const hostVMMName = "hostVMM"

// newHostVMM returns a hostVMM whose sizes and addresses are multiples of granularity bytes (a
// positive multiple of the OS page size) and which lets at most physicalLimit bytes be created
// and not yet given back (0: no limit). The error wraps ErrInvalidArgument for a bad granularity
// or a negative limit, and ErrNotSupported on an OS other than Linux.
func newHostVMM(granularity int, physicalLimit int) (*hostVMM, error) {
	if !hostVMMSupported {
		return nil, errorf("%s: host virtual memory management is implemented on Linux only: %w", hostVMMName, ErrNotSupported)
	}
	page := syscall.Getpagesize()
	if granularity <= 0 || granularity%page != 0 {
		return nil, errorf("%s: granularity %d is not a positive multiple of the page size %d: %w", hostVMMName, granularity, page, ErrInvalidArgument)
	}
	if physicalLimit < 0 {
		return nil, errorf("%s: negative physical limit %d: %w", hostVMMName, physicalLimit, ErrInvalidArgument)
	}
	v := &hostVMM{}
	v.init(hostVMMName, granularity, physicalLimit, v)
	v.oneMapping = true
	return v, nil
}

// newHostVMMAliasing is newHostVMM whose handles are memfds: a handle may be mapped at several
// addresses, all seeing its bytes, and keeps them across unmap (see hostVMM).
func newHostVMMAliasing(granularity int, physicalLimit int) (*hostVMM, error) {
	v, err := newHostVMM(granularity, physicalLimit)
	if err == nil {
		v.aliasing = true
		v.oneMapping = false
	}
	return v, err
}

// memReserve maps size bytes of inaccessible address space (mmap PROT_NONE); ErrOutOfMemory
// when the OS refuses.
func (v *hostVMM) memReserve(size int) (DevicePtr, []byte, error) {
	base, mem, err := hostVMMOSReserve(size, v.gran)
	return DevicePtr(base), mem, err
}

// memFree unmaps the reservation (munmap).
func (v *hostVMM) memFree(r *vmmReservation) error { return hostVMMOSFree(r.mem) }

// memCreate touches no memory; aliasing, it makes the handle's memfd.
func (v *hostVMM) memCreate(size int) (int, error) {
	if !v.aliasing {
		return -1, nil
	}
	return hostVMMOSMemfd(size)
}

// memAccess makes the mappings readable and writable by the process (mprotect); aliasing, it
// maps each one's memfd there (one already shown is shown again: the same bytes).
func (v *hostVMM) memAccess(ms []vmmMapping) error {
	if v.aliasing {
		for k, m := range ms {
			if err := hostVMMOSMapShared(uintptr(m.addr), m.size, v.handles[m.h].fd); err != nil {
				for _, m := range ms[:k] {
					if !m.access {
						_ = hostVMMOSPlaceholder(uintptr(m.addr), m.size)
					}
				}
				return err
			}
		}
		return nil
	}
	last := ms[len(ms)-1]
	if err := hostVMMOSProtect(uintptr(ms[0].addr), int(last.addr-ms[0].addr)+last.size, true); err != nil {
		// Put back the mappings that had no access.
		for _, m := range ms {
			if !m.access {
				_ = hostVMMOSProtect(uintptr(m.addr), m.size, false)
			}
		}
		return err
	}
	return nil
}

// memUnmap drops the pages of each run of adjacent mappings in one call (mprotect PROT_NONE,
// madvise MADV_DONTNEED); aliasing, it puts the reservation's placeholder back.
func (v *hostVMM) memUnmap(ms []vmmMapping) error {
	drop := hostVMMOSDrop
	if v.aliasing {
		drop = hostVMMOSPlaceholder
	}
	for k := 0; k < len(ms); {
		start, end := ms[k].addr, ms[k].addr+DevicePtr(ms[k].size)
		for k++; k < len(ms) && ms[k].addr == end; k++ {
			end += DevicePtr(ms[k].size)
		}
		if err := drop(uintptr(start), int(end-start)); err != nil {
			return err
		}
	}
	return nil
}

// memGone closes the handle's memfd.
func (v *hostVMM) memGone(hd *vmmBookHandle) {
	if hd.fd >= 0 {
		_ = hostVMMOSClose(hd.fd)
	}
}
