// Package cuda is the rmm package's binding to the CUDA driver API. With cgo it dlopens
// libcuda.so.1 (cuda_cgo.go) and wraps each driver call the rmm package makes in one C call that
// first makes the given context current on the calling thread; built without cgo (cuda_nocgo.go)
// every call returns NoCgo.
//
// It speaks in plain values: uintptr for device pointers, contexts, streams, events, pools and
// other handles, int for sizes, and each call's CUresult as a Result. A function named after a
// driver call (MemAlloc for cuMemAlloc_v2, ...) makes that call; the rmm package turns the
// Results into its errors. Kept apart from the rmm package so that editing that package does
// not rerun cgo.
package cuda

// Result is a CUresult; 0 is CUDA_SUCCESS.
type Result int

const (
	// Missing is what a call returns when the driver lacks its (optional) symbol:
	// CUDA_ERROR_NOT_SUPPORTED, as the C side's RMM_MISSING.
	Missing Result = 801

	// NoCgo is what every call returns in a build without cgo. It is no CUresult.
	NoCgo Result = -1
)

// PtrInfo is what PointerInfo reads about a pointer.
type PtrInfo struct {
	MemType   int     // CUmemorytype; 0 for an address the driver does not know
	Ordinal   int     // the device; -2 for none
	LegacyIPC bool    // cuIpcGetMemHandle accepts its allocation
	Pool      uintptr // the CUmemoryPool it came from (when asked)
}
