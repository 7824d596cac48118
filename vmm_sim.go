package rmm

// simulatedVMMBase is where simulated reservations start: above the 47-bit user address space,
// like SimulatedMemoryResource's addresses, and apart from them.
const simulatedVMMBase = uintptr(1) << 56

// simVMM is an address-only vmm: its vmmBook hands out handles and checks the driver's rules
// (granularity, a mapping is one whole handle, no double mapping, access only over mapped memory,
// whole mappings unmapped, nothing mapped when the reservation is freed), with a limit on the
// physical bytes created; simVMM itself only hands out the reservations' addresses. No memory is
// behind them: it is the expandable pool's counterpart of SimulatedMemoryResource, to replay
// traces of a large GPU anywhere, and the tests' fake. Like the device, it maps a handle at
// several addresses at once.
type simVMM struct {
	vmmBook
	nextBase DevicePtr // the next reservation's base (mu held)
	failNext int       // tests: fail the next create(s) with out of memory (mu held)
}

var _ vmm = (*simVMM)(nil)

func newSimVMM(gran, limit int) *simVMM {
	v := &simVMM{nextBase: DevicePtr(simulatedVMMBase)}
	v.init("simVMM", gran, limit, v)
	return v
}

// memReserve hands out the next addresses, leaving a granule unused after each reservation.
func (v *simVMM) memReserve(size int) (DevicePtr, []byte, error) {
	b := v.nextBase
	v.nextBase += DevicePtr(size) + DevicePtr(v.gran)
	return b, nil, nil
}

func (v *simVMM) memFree(*vmmReservation) error { return nil }

func (v *simVMM) memCreate(size int) (int, error) {
	if v.failNext > 0 {
		v.failNext--
		return -1, errorf("refused: %w", ErrOutOfMemory)
	}
	return -1, nil
}

func (v *simVMM) memAccess([]vmmMapping) error { return nil }
func (v *simVMM) memUnmap([]vmmMapping) error  { return nil }
func (v *simVMM) memGone(*vmmBookHandle)       {}

// stats returns the bytes charged, the live mappings, and the creates and the mappings unmapped
// so far.
func (v *simVMM) stats() (charged, mappings, creates, unmaps int) {
	s := v.vmmBook.stats()
	return s.Physical, s.Mappings, s.Creates, s.Unmaps
}
