package rmm

// AllocateSync allocates nbytes from mr (nil: the current device resource) so that the memory is
// usable on every stream once it returns (librmm's allocate_sync): it allocates on [DefaultStream]
// and waits for that stream (cuStreamSynchronize on the legacy default stream; nothing to wait
// for without CUDA). A stream-ordered resource's allocation is then complete before any other
// stream, non-blocking ones included, can use it. It works the same through every adaptor,
// since it asks only mr's Allocate. Errors: mr's, or the wait's ([*CUDAError]), after which the
// memory has been given back.
func AllocateSync(mr MemoryResource, nbytes int) (DevicePtr, error) {
	mr = resourceOrCurrent(mr)
	p, err := mr.Allocate(nbytes, DefaultStream)
	if err != nil || p == 0 {
		return p, err
	}
	if CUDAAvailable() == nil {
		if err := syncStream(DeviceOf(mr), DefaultStream); err != nil {
			if ferr := mr.Deallocate(p, nbytes, DefaultStream); ferr != nil {
				DebugLogger().Warn("rmm: AllocateSync could not give the memory back after a failed wait", "bytes", nbytes, "err", ferr)
			}
			return 0, errorf("AllocateSync(%d bytes): waiting for the default stream: %w", nbytes, err)
		}
	}
	return p, nil
}

// DeallocateSync frees p, nbytes from mr (nil: the current device resource), once all work
// queued on mr's device is done (cuCtxSynchronize; librmm's deallocate_sync): memory used on any
// stream can then be freed without naming one. It frees on [DefaultStream]. Errors: the wait's
// ([*CUDAError]; nothing is freed then), or mr's Deallocate.
func DeallocateSync(mr MemoryResource, p DevicePtr, nbytes int) error {
	mr = resourceOrCurrent(mr)
	if p == 0 {
		return mr.Deallocate(p, nbytes, DefaultStream)
	}
	if CUDAAvailable() == nil {
		if err := DeviceOf(mr).Synchronize(); err != nil {
			return errorf("DeallocateSync(%#x, %d bytes): waiting for the device: %w", uintptr(p), nbytes, err)
		}
	}
	return mr.Deallocate(p, nbytes, DefaultStream)
}
