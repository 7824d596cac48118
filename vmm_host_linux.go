//go:build linux

package rmm

import (
	"errors"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

const hostVMMSupported = true

// hostVMMOSReserve maps size bytes of inaccessible address space (mmap PROT_NONE, private,
// anonymous, MAP_NORESERVE) whose base is a multiple of align bytes; mem is the whole mapping,
// for hostVMMOSFree.
func hostVMMOSReserve(size, align int) (base uintptr, mem []byte, err error) {
	page := syscall.Getpagesize()
	n := size
	if align > page {
		if size > int(^uint(0)>>1)-(align-page) {
			return 0, nil, errorf("%s aligned to %d overflow: %w", bytesText(size), align, ErrInvalidArgument)
		}
		n += align - page
	}
	mem, err = syscall.Mmap(-1, 0, n, syscall.PROT_NONE, syscall.MAP_PRIVATE|syscall.MAP_ANON|syscall.MAP_NORESERVE)
	if err != nil {
		return 0, nil, hostVMMErrno("mmap", err)
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	a := uintptr(align)
	return (p + a - 1) / a * a, mem, nil
}

// hostVMMOSFree unmaps a reservation (munmap).
func hostVMMOSFree(mem []byte) error {
	if err := syscall.Munmap(mem); err != nil {
		return hostVMMErrno("munmap", err)
	}
	return nil
}

// hostVMMOSProtect makes [addr, addr+size) readable and writable, or inaccessible (mprotect).
func hostVMMOSProtect(addr uintptr, size int, rw bool) error {
	prot := syscall.PROT_NONE
	if rw {
		prot = syscall.PROT_READ | syscall.PROT_WRITE
	}
	if err := syscall.Mprotect(hostBytes(DevicePtr(addr), size), prot); err != nil {
		return hostVMMErrno("mprotect", err)
	}
	return nil
}

// hostVMMOSDrop makes [addr, addr+size) inaccessible and gives its pages back to the OS
// (mprotect PROT_NONE, madvise MADV_DONTNEED): what is mapped there next reads zeros.
func hostVMMOSDrop(addr uintptr, size int) error {
	b := hostBytes(DevicePtr(addr), size)
	if err := syscall.Mprotect(b, syscall.PROT_NONE); err != nil {
		return hostVMMErrno("mprotect", err)
	}
	if err := syscall.Madvise(b, syscall.MADV_DONTNEED); err != nil {
		return hostVMMErrno("madvise", err)
	}
	return nil
}

// hostVMMErrno wraps a failed system call: ENOMEM as ErrOutOfMemory, anything else as
// ErrInvalidArgument.
func hostVMMErrno(call string, err error) error {
	// Out of descriptors counts as out of memory: the pool then gives back what it can (closing
	// memfds) and tries again, as for memory.
	if errors.Is(err, syscall.ENOMEM) || errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
		return errorf("%s: %w: %w", call, err, ErrOutOfMemory)
	}
	return errorf("%s: %w: %w", call, err, ErrInvalidArgument)
}

// hostVMMOSMemfd returns a memfd of size bytes (memfd_create, ftruncate): the memory of one handle
// of an aliasing hostVMM, its pages taken when first touched.
func hostVMMOSMemfd(size int) (int, error) {
	fd, err := unix.MemfdCreate("rmm-hostvmm", unix.MFD_CLOEXEC)
	if err != nil {
		return -1, hostVMMErrno("memfd_create", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return -1, hostVMMErrno("ftruncate", err)
	}
	return fd, nil
}

// hostVMMOSMapShared maps the memfd fd, readable and writable, over [addr, addr+size) of a
// reservation (mmap MAP_SHARED|MAP_FIXED).
func hostVMMOSMapShared(addr uintptr, size, fd int) error {
	_, _, errno := unix.Syscall6(unix.SYS_MMAP, addr, uintptr(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED, uintptr(fd), 0)
	if errno != 0 {
		return hostVMMErrno("mmap", errno)
	}
	return nil
}

// hostVMMOSPlaceholder puts the reservation's inaccessible anonymous placeholder back over
// [addr, addr+size) (mmap PROT_NONE, MAP_FIXED), dropping whatever was mapped there.
func hostVMMOSPlaceholder(addr uintptr, size int) error {
	_, _, errno := unix.Syscall6(unix.SYS_MMAP, addr, uintptr(size), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANON|unix.MAP_FIXED|unix.MAP_NORESERVE, ^uintptr(0), 0)
	if errno != 0 {
		return hostVMMErrno("mmap", errno)
	}
	return nil
}

// hostVMMOSClose closes a handle's memfd.
func hostVMMOSClose(fd int) error { return unix.Close(fd) }

// hostDescriptorBudget is the most memfds a stitching pool over host memory may hold: half of
// the process's limit on open files (Go raises the soft limit to the hard one at start), so that
// the program keeps the other half. 0 when the limit cannot be read or is unlimited.
func hostDescriptorBudget() int {
	var r unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &r); err != nil || r.Cur == unix.RLIM_INFINITY || r.Cur > 1<<40 {
		return 0
	}
	return int(r.Cur / 2)
}
