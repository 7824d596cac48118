//go:build !cgo

package rmm

// Built with CGO_ENABLED=0: the CUDA driver cannot be loaded. Every driver entry point returns
// errNoCgo; initDriver reports ErrNoDevice before any of them is reached, so they exist only to
// keep one API. Host memory for SystemMemoryResource comes from anonymous mmap on Unix
// (hostalloc_nocgo_unix.go) and from the Go heap elsewhere.

import "unsafe"

const cgoEnabled = false

const patternBytes = 256

var errNoCgo = &CUDAError{Op: "dlopen", Code: cudaErrorNoDevice, Name: "CUDA_ERROR_NO_DEVICE", Message: "built without cgo"}

func loadDriver() string { return "built without cgo" }

func cuInit() error                              { return errNoCgo }
func cuDriverVersion() (int, error)              { return 0, errNoCgo }
func cuDeviceCount() (int, error)                { return 0, errNoCgo }
func cuDeviceName(int) (string, error)           { return "", errNoCgo }
func cuDeviceAttribute(int, int) (int, error)    { return 0, errNoCgo }
func cuDeviceTotalMem(int) (int, error)          { return 0, errNoCgo }
func cuPrimaryCtxRetain(int) (uintptr, error)    { return 0, errNoCgo }
func cuCtxSynchronize(uintptr) error             { return errNoCgo }
func cuMemGetInfo(uintptr) (int, int, error)     { return 0, 0, errNoCgo }
func cuMemAlloc(uintptr, int) (DevicePtr, error) { return 0, errNoCgo }
func cuMemFree(uintptr, DevicePtr) error         { return errNoCgo }
func cuMemAllocManaged(uintptr, int, uint) (DevicePtr, error) {
	return 0, errNoCgo
}
func cuMemHostAlloc(uintptr, int, uint) (uintptr, error) { return 0, errNoCgo }
func cuMemFreeHost(uintptr, uintptr) error               { return errNoCgo }
func cuMemPoolCreate(uintptr, int, int) (uintptr, error) { return 0, errNoCgo }
func cuMemPoolDestroy(uintptr, uintptr) error            { return errNoCgo }
func cuMemPoolSetAttributeU64(uintptr, uintptr, int, uint64) error {
	return errNoCgo
}
func cuMemPoolGetAttributeU64(uintptr, uintptr, int) (uint64, error) {
	return 0, errNoCgo
}
func cuMemPoolTrimTo(uintptr, uintptr, int) error { return errNoCgo }
func cuMemAllocFromPoolAsync(uintptr, int, uintptr, uintptr) (DevicePtr, error) {
	return 0, errNoCgo
}
func cuDeviceGetDefaultMemPool(uintptr, int) (uintptr, error)     { return 0, errNoCgo }
func cuMemAdvise(uintptr, DevicePtr, int, int, int, int) error    { return errNoCgo }
func cuMemFreeAsync(uintptr, DevicePtr, uintptr) error            { return errNoCgo }
func cuMemcpyAsync(uintptr, uintptr, uintptr, int, uintptr) error { return errNoCgo }
func cuMemcpyDtoDAsync(uintptr, DevicePtr, DevicePtr, int, uintptr) error {
	return errNoCgo
}
func cuMemcpyHtoDSync(uintptr, DevicePtr, unsafe.Pointer, int, uintptr) error {
	return errNoCgo
}
func cuMemcpyDtoHSync(uintptr, unsafe.Pointer, DevicePtr, int, uintptr) error {
	return errNoCgo
}
func cuMemcpyHtoDAsyncPtr(uintptr, DevicePtr, uintptr, int, uintptr) error {
	return errNoCgo
}
func cuMemcpyDtoHAsyncPtr(uintptr, uintptr, DevicePtr, int, uintptr) error {
	return errNoCgo
}
func cuMemsetAsync(uintptr, DevicePtr, uint32, int, int, uintptr) error { return errNoCgo }
func cuMemPrefetchAsync(uintptr, DevicePtr, int, int, int, uintptr) error {
	return errNoCgo
}
func cuMemPrefetchBound() bool                            { return false }
func cuPointerIsManaged(uintptr, DevicePtr) (bool, error) { return false, errNoCgo }
func cuMemRangeGetAttributeInt(uintptr, DevicePtr, int, int) (int, error) {
	return 0, errNoCgo
}
func cuStreamCreate(uintptr, uint) (uintptr, error)            { return 0, errNoCgo }
func cuStreamDestroy(uintptr, uintptr) error                   { return errNoCgo }
func cuStreamSynchronize(uintptr, uintptr) error               { return errNoCgo }
func cuStreamQuery(uintptr, uintptr) (bool, error)             { return false, errNoCgo }
func cuStreamWaitEvent(uintptr, uintptr, uintptr) error        { return errNoCgo }
func cuRecordAndWait(uintptr, uintptr, uintptr, uintptr) error { return errNoCgo }
func cuStreamGetID(uintptr, uintptr) (uint64, error)           { return 0, errNoCgo }
func cuEventCreate(uintptr, uint) (uintptr, error)             { return 0, errNoCgo }
func cuEventRecord(uintptr, uintptr, uintptr) error            { return errNoCgo }
func cuEventSynchronize(uintptr, uintptr) error                { return errNoCgo }
func cuEventQuery(uintptr, uintptr) (bool, error)              { return false, errNoCgo }
func cuEventDestroy(uintptr, uintptr) error                    { return errNoCgo }
func cuEventElapsedTime(uintptr, uintptr, uintptr) (float32, error) {
	return 0, errNoCgo
}
func cuModuleLoadData(uintptr, string) (uintptr, error)             { return 0, errNoCgo }
func cuModuleGetFunction(uintptr, uintptr, string) (uintptr, error) { return 0, errNoCgo }
func cuLaunchFill(uintptr, uintptr, int, int, uintptr, DevicePtr, int, int, int, []byte) error {
	return errNoCgo
}
func cuLaunchCopy(uintptr, uintptr, int, int, uintptr, DevicePtr, DevicePtr, int) error {
	return errNoCgo
}

func cuVMMBound() bool                                             { return false }
func cuMemGetAllocationGranularity(uintptr, int, int) (int, error) { return 0, errNoCgo }
func cuMemAddressReserve(uintptr, int, int) (DevicePtr, error)     { return 0, errNoCgo }
func cuMemAddressFree(uintptr, DevicePtr, int) error               { return errNoCgo }
func cuMemCreate(uintptr, int, int, int) (uint64, error)           { return 0, errNoCgo }
func cuMemRelease(uintptr, uint64) error                           { return errNoCgo }
func cuMemMap(uintptr, DevicePtr, int, uint64) error               { return errNoCgo }
func cuMemUnmap(uintptr, DevicePtr, int) error                     { return errNoCgo }
func cuMemSetAccess(uintptr, DevicePtr, int, int) error            { return errNoCgo }

func cuIPCBound() int                                         { return 0 }
func cuDeviceUUID(int) ([16]byte, error)                      { return [16]byte{}, errNoCgo }
func cuPointerInfo(uintptr, DevicePtr, bool) (ptrInfo, error) { return ptrInfo{}, errNoCgo }
func cuMemGetAddressRange(uintptr, DevicePtr) (DevicePtr, int, error) {
	return 0, 0, errNoCgo
}
func cuMemPoolExportFD(uintptr, uintptr) (int, error)             { return -1, errNoCgo }
func cuMemPoolImportFD(uintptr, int) (uintptr, error)             { return 0, errNoCgo }
func cuMemPoolExportPointer(uintptr, DevicePtr) ([64]byte, error) { return [64]byte{}, errNoCgo }
func cuMemPoolImportPointer(uintptr, uintptr, *[64]byte) (DevicePtr, error) {
	return 0, errNoCgo
}
func cuMemExportFD(uintptr, uint64) (int, error)               { return -1, errNoCgo }
func cuMemImportFD(uintptr, int) (uint64, error)               { return 0, errNoCgo }
func cuIpcGetMemHandle(uintptr, DevicePtr) ([64]byte, error)   { return [64]byte{}, errNoCgo }
func cuIpcOpenMemHandle(uintptr, *[64]byte) (DevicePtr, error) { return 0, errNoCgo }
func cuIpcCloseMemHandle(uintptr, DevicePtr) error             { return errNoCgo }
func cuIpcGetEventHandle(uintptr, uintptr) ([64]byte, error)   { return [64]byte{}, errNoCgo }
func cuIpcOpenEventHandle(uintptr, *[64]byte) (uintptr, error) { return 0, errNoCgo }
