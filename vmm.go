package rmm

import "sync/atomic"

// Virtual memory management (VMM) for the expandable pool: one range of address space reserved
// up front, physical memory created in chunks and mapped back to back inside it, so that
// neighbouring free blocks always sit at adjacent addresses. The operations sit behind vmm so
// that the same pool code runs over the CUDA driver (deviceVMM) and over host memory (hostVMM,
// also the tests' fake, with a granularity as small as the page size).

// vmmHandle is a physical allocation (CUmemGenericAllocationHandle on the device); opaque.
type vmmHandle uint64

// vmm is the set of virtual-memory operations. Sizes and addresses are bytes and must be
// multiples of granularity(). Implementations are safe for concurrent use.
type vmm interface {
	// granularity is the unit of every size and address below, in bytes (2 MiB on the H200).
	granularity() int
	// reserve returns the base of a new range of size bytes of address space, with no memory
	// behind it (cuMemAddressReserve).
	reserve(size int) (DevicePtr, error)
	// free gives back the whole reservation at base; nothing may be mapped in it any more
	// (cuMemAddressFree).
	free(base DevicePtr, size int) error
	// create makes size bytes of physical memory, charged now; ErrOutOfMemory (errors.Is) when
	// there is not enough (cuMemCreate).
	create(size int) (vmmHandle, error)
	// mapAt maps the whole of h, whose size is size, at addr, which must be inside a reservation
	// and not mapped. The mapping gives no access yet (cuMemMap).
	mapAt(addr DevicePtr, size int, h vmmHandle) error
	// setAccess grants read/write access to the device (on the host fake: to the process) over
	// [addr, addr+size), which must be wholly mapped; it may span several mappings
	// (cuMemSetAccess).
	setAccess(addr DevicePtr, size int) error
	// unmap unmaps [addr, addr+size), which must be made of whole mappings. It does not wait for
	// work still using the memory: the caller must (cuMemUnmap).
	unmap(addr DevicePtr, size int) error
	// release drops the handle; its memory goes back once it is also unmapped (cuMemRelease).
	release(h vmmHandle) error
}

// vmmCheckSize validates a size given to op: positive and a multiple of gran.
func vmmCheckSize(impl, op string, size, gran int) error {
	if size <= 0 || size%gran != 0 {
		return errorf("%s.%s: size %d is not a positive multiple of the granularity %d: %w", impl, op, size, gran, ErrInvalidArgument)
	}
	return nil
}

// vmmCheckRange validates a range given to op: addr and size multiples of gran, size positive,
// and addr+size not wrapping around.
func vmmCheckRange(impl, op string, addr DevicePtr, size, gran int) error {
	if err := vmmCheckSize(impl, op, size, gran); err != nil {
		return err
	}
	if addr == 0 || uintptr(addr)%uintptr(gran) != 0 {
		return errorf("%s.%s: address %#x is not a non-zero multiple of the granularity %d: %w", impl, op, uintptr(addr), gran, ErrInvalidArgument)
	}
	if uintptr(addr)+uintptr(size) < uintptr(addr) {
		return errorf("%s.%s: range %#x + %s wraps around: %w", impl, op, uintptr(addr), bytesText(size), ErrInvalidArgument)
	}
	return nil
}

// vmmTally is the vmm an expandable pool calls: it counts the calls that succeed, for
// PoolStats.VMM. Atomic, since the pool makes driver calls unlocked while Stats may read.
type vmmTally struct {
	vmm
	creates, maps, setAccesses, unmaps, releases, reserves, frees atomic.Int64
	reservedNow                                                   atomic.Int64 // bytes
}

func (v *vmmTally) reserve(size int) (DevicePtr, error) {
	p, err := v.vmm.reserve(size)
	if err == nil {
		v.reserves.Add(1)
		v.reservedNow.Add(int64(size))
	}
	return p, err
}

func (v *vmmTally) free(base DevicePtr, size int) error {
	err := v.vmm.free(base, size)
	if err == nil {
		v.frees.Add(1)
		v.reservedNow.Add(-int64(size))
	}
	return err
}

func (v *vmmTally) create(size int) (vmmHandle, error) {
	h, err := v.vmm.create(size)
	if err == nil {
		v.creates.Add(1)
	}
	return h, err
}

func (v *vmmTally) mapAt(addr DevicePtr, size int, h vmmHandle) error {
	err := v.vmm.mapAt(addr, size, h)
	if err == nil {
		v.maps.Add(1)
	}
	return err
}

func (v *vmmTally) setAccess(addr DevicePtr, size int) error {
	err := v.vmm.setAccess(addr, size)
	if err == nil {
		v.setAccesses.Add(1)
	}
	return err
}

func (v *vmmTally) unmap(addr DevicePtr, size int) error {
	err := v.vmm.unmap(addr, size)
	if err == nil {
		v.unmaps.Add(1)
	}
	return err
}

func (v *vmmTally) release(h vmmHandle) error {
	err := v.vmm.release(h)
	if err == nil {
		v.releases.Add(1)
	}
	return err
}

// stats fills the call counts of st.
func (v *vmmTally) stats(st *VMMStats) {
	st.Creates = int(v.creates.Load())
	st.Maps = int(v.maps.Load())
	st.SetAccess = int(v.setAccesses.Load())
	st.Unmaps = int(v.unmaps.Load())
	st.Releases = int(v.releases.Load())
	st.Reserves = int(v.reserves.Load())
	st.AddressFrees = int(v.frees.Load())
	st.AddressReserved = int(v.reservedNow.Load())
}
