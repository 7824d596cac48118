//go:build !cgo

package cuda

// Built with CGO_ENABLED=0: the CUDA driver cannot be loaded. Load says so, and every driver
// call returns NoCgo (the rmm package reports ErrNoDevice before reaching any of them), so they
// exist only to keep one API.

import "unsafe"

// Enabled: this build can load the CUDA driver.
const Enabled = false

// PatternBytes is the largest fill pattern LaunchFill passes by value to the fill kernels.
const PatternBytes = 256

func Load() string { return "built without cgo" }

func ErrorName(Result) (string, bool)   { return "", false }
func ErrorString(Result) (string, bool) { return "", false }

func Init() Result                            { return NoCgo }
func DriverVersion() (int, Result)            { return 0, NoCgo }
func DeviceCount() (int, Result)              { return 0, NoCgo }
func DeviceName(int) (string, Result)         { return "", NoCgo }
func DeviceAttribute(int, int) (int, Result)  { return 0, NoCgo }
func DeviceTotalMem(int) (int, Result)        { return 0, NoCgo }
func PrimaryCtxRetain(int) (uintptr, Result)  { return 0, NoCgo }
func CtxSynchronize(uintptr) Result           { return NoCgo }
func MemGetInfo(uintptr) (int, int, Result)   { return 0, 0, NoCgo }
func MemAlloc(uintptr, int) (uintptr, Result) { return 0, NoCgo }
func MemFree(uintptr, uintptr) Result         { return NoCgo }
func MemAllocManaged(uintptr, int, uint) (uintptr, Result) {
	return 0, NoCgo
}
func MemHostAlloc(uintptr, int, uint) (uintptr, Result) { return 0, NoCgo }
func MemFreeHost(uintptr, uintptr) Result               { return NoCgo }
func MemPoolCreate(uintptr, int, int) (uintptr, Result) { return 0, NoCgo }
func MemPoolDestroy(uintptr, uintptr) Result            { return NoCgo }
func MemPoolSetAttributeU64(uintptr, uintptr, int, uint64) Result {
	return NoCgo
}
func MemPoolGetAttributeU64(uintptr, uintptr, int) (uint64, Result) {
	return 0, NoCgo
}
func MemPoolTrimTo(uintptr, uintptr, int) Result { return NoCgo }
func MemAllocFromPoolAsync(uintptr, int, uintptr, uintptr) (uintptr, Result) {
	return 0, NoCgo
}
func DeviceGetDefaultMemPool(uintptr, int) (uintptr, Result)     { return 0, NoCgo }
func MemGetDefaultMemPool(uintptr, int, int) (uintptr, Result)   { return 0, NoCgo }
func MemAdvise(uintptr, uintptr, int, int, int, int) Result      { return NoCgo }
func MemFreeAsync(uintptr, uintptr, uintptr) Result              { return NoCgo }
func MemcpyAsync(uintptr, uintptr, uintptr, int, uintptr) Result { return NoCgo }
func MemcpyDtoDAsync(uintptr, uintptr, uintptr, int, uintptr) Result {
	return NoCgo
}
func MemcpyHtoDSync(uintptr, uintptr, unsafe.Pointer, int, uintptr) Result {
	return NoCgo
}
func MemcpyDtoHSync(uintptr, unsafe.Pointer, uintptr, int, uintptr) Result {
	return NoCgo
}
func MemcpyHtoDAsyncPtr(uintptr, uintptr, uintptr, int, uintptr) Result {
	return NoCgo
}
func MemcpyDtoHAsyncPtr(uintptr, uintptr, uintptr, int, uintptr) Result {
	return NoCgo
}
func MemsetAsync(uintptr, uintptr, uint32, int, int, uintptr) Result { return NoCgo }
func MemPrefetchAsync(uintptr, uintptr, int, int, int, uintptr) Result {
	return NoCgo
}
func PrefetchBound() bool                              { return false }
func PointerIsManaged(uintptr, uintptr) (bool, Result) { return false, NoCgo }
func MemRangeGetAttributeInt(uintptr, uintptr, int, int) (int, Result) {
	return 0, NoCgo
}
func StreamCreate(uintptr, uint) (uintptr, Result)            { return 0, NoCgo }
func StreamDestroy(uintptr, uintptr) Result                   { return NoCgo }
func StreamSynchronize(uintptr, uintptr) Result               { return NoCgo }
func StreamQuery(uintptr, uintptr) Result                     { return NoCgo }
func StreamWaitEvent(uintptr, uintptr, uintptr) Result        { return NoCgo }
func RecordAndWait(uintptr, uintptr, uintptr, uintptr) Result { return NoCgo }
func StreamGetID(uintptr, uintptr) (uint64, Result)           { return 0, NoCgo }
func EventCreate(uintptr, uint) (uintptr, Result)             { return 0, NoCgo }
func EventRecord(uintptr, uintptr, uintptr) Result            { return NoCgo }
func EventSynchronize(uintptr, uintptr) Result                { return NoCgo }
func EventQuery(uintptr, uintptr) Result                      { return NoCgo }
func EventDestroy(uintptr, uintptr) Result                    { return NoCgo }
func EventElapsedTime(uintptr, uintptr, uintptr) (float32, Result) {
	return 0, NoCgo
}
func ModuleLoadData(uintptr, string) (uintptr, Result)             { return 0, NoCgo }
func ModuleGetFunction(uintptr, uintptr, string) (uintptr, Result) { return 0, NoCgo }
func LaunchFill(uintptr, uintptr, int, int, uintptr, uintptr, int, int, int, []byte) Result {
	return NoCgo
}
func LaunchCopy(uintptr, uintptr, int, int, uintptr, uintptr, uintptr, int) Result {
	return NoCgo
}

func VMMBound() bool                                              { return false }
func MemGetAllocationGranularity(uintptr, int, int) (int, Result) { return 0, NoCgo }
func MemAddressReserve(uintptr, int, int) (uintptr, Result)       { return 0, NoCgo }
func MemAddressFree(uintptr, uintptr, int) Result                 { return NoCgo }
func MemCreate(uintptr, int, int, int) (uint64, Result)           { return 0, NoCgo }
func MemRelease(uintptr, uint64) Result                           { return NoCgo }
func MemMap(uintptr, uintptr, int, uint64) Result                 { return NoCgo }
func MemUnmap(uintptr, uintptr, int) Result                       { return NoCgo }
func MemSetAccess(uintptr, uintptr, int, int) Result              { return NoCgo }

func IPCBound() int                                        { return 0 }
func DeviceUUID(int) ([16]byte, Result)                    { return [16]byte{}, NoCgo }
func PointerInfo(uintptr, uintptr, bool) (PtrInfo, Result) { return PtrInfo{}, NoCgo }
func MemGetAddressRange(uintptr, uintptr) (uintptr, int, Result) {
	return 0, 0, NoCgo
}
func MemPoolExportFD(uintptr, uintptr) (int, Result)           { return -1, NoCgo }
func MemPoolImportFD(uintptr, int) (uintptr, Result)           { return 0, NoCgo }
func MemPoolExportPointer(uintptr, uintptr) ([64]byte, Result) { return [64]byte{}, NoCgo }
func MemPoolImportPointer(uintptr, uintptr, *[64]byte) (uintptr, Result) {
	return 0, NoCgo
}
func MemExportFD(uintptr, uint64) (int, Result)               { return -1, NoCgo }
func MemImportFD(uintptr, int) (uint64, Result)               { return 0, NoCgo }
func IpcGetMemHandle(uintptr, uintptr) ([64]byte, Result)     { return [64]byte{}, NoCgo }
func IpcOpenMemHandle(uintptr, *[64]byte) (uintptr, Result)   { return 0, NoCgo }
func IpcCloseMemHandle(uintptr, uintptr) Result               { return NoCgo }
func IpcGetEventHandle(uintptr, uintptr) ([64]byte, Result)   { return [64]byte{}, NoCgo }
func IpcOpenEventHandle(uintptr, *[64]byte) (uintptr, Result) { return 0, NoCgo }
