package rmm

// The CUDA driver calls of this package, with its types and errors, over internal/cuda (which
// holds the cgo binding and its no-cgo twin).

import (
	"sync"
	"unsafe"

	"github.com/gormm/rmm/internal/cuda"
)

// patternBytes is the largest fill pattern passed by value to the fill kernels; larger element
// types are filled by doubling device copies.
const patternBytes = cuda.PatternBytes

const cgoEnabled = cuda.Enabled

// errNoCgo is every driver call's error in a build without cgo; initDriver reports ErrNoDevice
// before any of them is reached.
var errNoCgo = &CUDAError{Op: "dlopen", Code: cudaErrorNoDevice, Name: "CUDA_ERROR_NO_DEVICE", Message: "built without cgo"}

var (
	errNameMu    sync.Mutex
	errNameCache = map[int][2]string{}
)

// loadDriver dlopens libcuda.so.1 and binds its symbols; "" on success, else why not.
func loadDriver() string { return cuda.Load() }

// cuErr converts a CUresult into nil or a *CUDAError naming op (errNoCgo without cgo).
func cuErr(op string, r cuda.Result) error {
	if r == 0 {
		return nil
	}
	if r == cuda.NoCgo {
		return errNoCgo
	}
	code := int(r)
	errNameMu.Lock()
	names, ok := errNameCache[code]
	if !ok {
		names[0], names[1] = cuErrorNames[code], ""
		if driverLoaded {
			if s, ok := cuda.ErrorName(r); ok {
				names[0] = s
			}
			if s, ok := cuda.ErrorString(r); ok {
				names[1] = s
			}
		}
		if names[0] == "" {
			names[0] = "CUDA_ERROR_UNKNOWN"
		}
		if r == cuda.Missing && names[1] == "" {
			names[1] = "operation not supported"
		}
		errNameCache[code] = names
	}
	errNameMu.Unlock()
	return &CUDAError{Op: op, Code: code, Name: names[0], Message: names[1]}
}

func cuInit() error { return cuErr("cuInit", cuda.Init()) }

func cuDriverVersion() (int, error) {
	v, r := cuda.DriverVersion()
	return v, cuErr("cuDriverGetVersion", r)
}

func cuDeviceCount() (int, error) {
	n, r := cuda.DeviceCount()
	return n, cuErr("cuDeviceGetCount", r)
}

func cuDeviceName(ord int) (string, error) {
	name, r := cuda.DeviceName(ord)
	if err := cuErr("cuDeviceGetName", r); err != nil {
		return "", err
	}
	return name, nil
}

func cuDeviceAttribute(ord, attr int) (int, error) {
	v, r := cuda.DeviceAttribute(ord, attr)
	return v, cuErr("cuDeviceGetAttribute", r)
}

func cuDeviceTotalMem(ord int) (int, error) {
	v, r := cuda.DeviceTotalMem(ord)
	return v, cuErr("cuDeviceTotalMem_v2", r)
}

func cuPrimaryCtxRetain(ord int) (uintptr, error) {
	ctx, r := cuda.PrimaryCtxRetain(ord)
	return ctx, cuErr("cuDevicePrimaryCtxRetain", r)
}

func cuCtxSynchronize(ctx uintptr) error {
	return cuErr("cuCtxSynchronize", cuda.CtxSynchronize(ctx))
}

func cuMemGetInfo(ctx uintptr) (free, total int, err error) {
	free, total, r := cuda.MemGetInfo(ctx)
	return free, total, cuErr("cuMemGetInfo_v2", r)
}

func cuMemAlloc(ctx uintptr, n int) (DevicePtr, error) {
	p, r := cuda.MemAlloc(ctx, n)
	return DevicePtr(p), cuErr("cuMemAlloc_v2", r)
}

func cuMemFree(ctx uintptr, p DevicePtr) error {
	return cuErr("cuMemFree_v2", cuda.MemFree(ctx, uintptr(p)))
}

func cuMemAllocManaged(ctx uintptr, n int, flags uint) (DevicePtr, error) {
	p, r := cuda.MemAllocManaged(ctx, n, flags)
	return DevicePtr(p), cuErr("cuMemAllocManaged", r)
}

func cuMemHostAlloc(ctx uintptr, n int, flags uint) (uintptr, error) {
	p, r := cuda.MemHostAlloc(ctx, n, flags)
	return p, cuErr("cuMemHostAlloc", r)
}

func cuMemFreeHost(ctx uintptr, p uintptr) error {
	return cuErr("cuMemFreeHost", cuda.MemFreeHost(ctx, p))
}

func cuMemPoolCreate(ctx uintptr, ord int, handleTypes int) (uintptr, error) {
	pool, r := cuda.MemPoolCreate(ctx, ord, handleTypes)
	return pool, cuErr("cuMemPoolCreate", r)
}

func cuMemPoolDestroy(ctx, pool uintptr) error {
	return cuErr("cuMemPoolDestroy", cuda.MemPoolDestroy(ctx, pool))
}

func cuMemPoolSetAttributeU64(ctx, pool uintptr, attr int, v uint64) error {
	return cuErr("cuMemPoolSetAttribute", cuda.MemPoolSetAttributeU64(ctx, pool, attr, v))
}

func cuMemPoolGetAttributeU64(ctx, pool uintptr, attr int) (uint64, error) {
	v, r := cuda.MemPoolGetAttributeU64(ctx, pool, attr)
	return v, cuErr("cuMemPoolGetAttribute", r)
}

func cuMemPoolTrimTo(ctx, pool uintptr, keep int) error {
	return cuErr("cuMemPoolTrimTo", cuda.MemPoolTrimTo(ctx, pool, keep))
}

// cuDeviceGetDefaultMemPool returns the handle of device ord's default memory pool.
func cuDeviceGetDefaultMemPool(ctx uintptr, ord int) (uintptr, error) {
	pool, r := cuda.DeviceGetDefaultMemPool(ctx, ord)
	return pool, cuErr("cuDeviceGetDefaultMemPool", r)
}

func cuMemAllocFromPoolAsync(ctx uintptr, n int, pool, stream uintptr) (DevicePtr, error) {
	p, r := cuda.MemAllocFromPoolAsync(ctx, n, pool, stream)
	return DevicePtr(p), cuErr("cuMemAllocFromPoolAsync", r)
}

func cuMemFreeAsync(ctx uintptr, p DevicePtr, stream uintptr) error {
	return cuErr("cuMemFreeAsync", cuda.MemFreeAsync(ctx, uintptr(p), stream))
}

// cuMemcpyAsync copies n bytes between any two CUDA-known addresses (unified addressing infers
// the direction), ordered on stream.
func cuMemcpyAsync(ctx uintptr, dst, src uintptr, n int, stream uintptr) error {
	return cuErr("cuMemcpyAsync", cuda.MemcpyAsync(ctx, dst, src, n, stream))
}

func cuMemcpyDtoDAsync(ctx uintptr, dst, src DevicePtr, n int, stream uintptr) error {
	return cuErr("cuMemcpyDtoDAsync_v2", cuda.MemcpyDtoDAsync(ctx, uintptr(dst), uintptr(src), n, stream))
}

// cuMemcpyHtoDSync copies n bytes of Go memory at src to dst in stream order and returns when
// stream has finished the copy.
func cuMemcpyHtoDSync(ctx uintptr, dst DevicePtr, src unsafe.Pointer, n int, stream uintptr) error {
	return cuErr("cuMemcpyHtoDAsync_v2", cuda.MemcpyHtoDSync(ctx, uintptr(dst), src, n, stream))
}

// cuMemcpyDtoHSync copies n bytes at src into Go memory at dst in stream order and returns when
// stream has finished the copy.
func cuMemcpyDtoHSync(ctx uintptr, dst unsafe.Pointer, src DevicePtr, n int, stream uintptr) error {
	return cuErr("cuMemcpyDtoHAsync_v2", cuda.MemcpyDtoHSync(ctx, dst, uintptr(src), n, stream))
}

// cuMemcpyHtoDAsyncPtr / cuMemcpyDtoHAsyncPtr copy to or from host memory outside the Go heap
// (pinned or malloc'd), without waiting.
func cuMemcpyHtoDAsyncPtr(ctx uintptr, dst DevicePtr, src uintptr, n int, stream uintptr) error {
	return cuErr("cuMemcpyHtoDAsync_v2", cuda.MemcpyHtoDAsyncPtr(ctx, uintptr(dst), src, n, stream))
}

func cuMemcpyDtoHAsyncPtr(ctx uintptr, dst uintptr, src DevicePtr, n int, stream uintptr) error {
	return cuErr("cuMemcpyDtoHAsync_v2", cuda.MemcpyDtoHAsyncPtr(ctx, dst, uintptr(src), n, stream))
}

// cuMemsetAsync sets n values of width 1, 2 or 4 bytes at dst to v.
func cuMemsetAsync(ctx uintptr, dst DevicePtr, v uint32, n int, width int, stream uintptr) error {
	op := "cuMemsetD32Async"
	switch width {
	case 1:
		op = "cuMemsetD8Async"
	case 2:
		op = "cuMemsetD16Async"
	}
	return cuErr(op, cuda.MemsetAsync(ctx, uintptr(dst), v, n, width, stream))
}

// cuMemPrefetchAsync prefetches managed memory to a device (locType 1) or the host (locType 2).
func cuMemPrefetchAsync(ctx uintptr, p DevicePtr, n int, locType, locID int, stream uintptr) error {
	return cuErr("cuMemPrefetchAsync_v2", cuda.MemPrefetchAsync(ctx, uintptr(p), n, locType, locID, stream))
}

// cuMemAdvise gives the driver advice (a CUmem_advise value) about [p, p+n) for a device
// (locType 1, locID the ordinal) or the host (locType 2).
func cuMemAdvise(ctx uintptr, p DevicePtr, n int, advice, locType, locID int) error {
	return cuErr("cuMemAdvise_v2", cuda.MemAdvise(ctx, uintptr(p), n, advice, locType, locID))
}

// cuMemPrefetchBound reports whether the driver exports cuMemPrefetchAsync_v2 (CUDA 12.2); without
// it cuMemPrefetchAsync answers CUDA_ERROR_NOT_SUPPORTED without calling the driver.
func cuMemPrefetchBound() bool { return driverLoaded && cuda.PrefetchBound() }

// cuPointerIsManaged reports whether p lies in managed memory (CU_POINTER_ATTRIBUTE_IS_MANAGED,
// read with cuPointerGetAttributes, which answers false without an error for an address the
// driver does not know).
func cuPointerIsManaged(ctx uintptr, p DevicePtr) (bool, error) {
	managed, r := cuda.PointerIsManaged(ctx, uintptr(p))
	return managed, cuErr("cuPointerGetAttributes", r)
}

// cuMemRangeGetAttributeInt reads a 4-byte attribute (a CUmem_range_attribute) of the managed
// range [p, p+n) with cuMemRangeGetAttribute.
func cuMemRangeGetAttributeInt(ctx uintptr, p DevicePtr, n, attr int) (int, error) {
	v, r := cuda.MemRangeGetAttributeInt(ctx, uintptr(p), n, attr)
	return v, cuErr("cuMemRangeGetAttribute", r)
}

func cuStreamCreate(ctx uintptr, flags uint) (uintptr, error) {
	s, r := cuda.StreamCreate(ctx, flags)
	return s, cuErr("cuStreamCreate", r)
}

func cuStreamDestroy(ctx, s uintptr) error {
	return cuErr("cuStreamDestroy_v2", cuda.StreamDestroy(ctx, s))
}

func cuStreamSynchronize(ctx, s uintptr) error {
	return cuErr("cuStreamSynchronize", cuda.StreamSynchronize(ctx, s))
}

// cuStreamQuery reports whether all work on s is done.
func cuStreamQuery(ctx, s uintptr) (bool, error) {
	r := cuda.StreamQuery(ctx, s)
	if r == cudaErrorNotReady {
		return false, nil
	}
	return r == 0, cuErr("cuStreamQuery", r)
}

func cuStreamWaitEvent(ctx, s, e uintptr) error {
	return cuErr("cuStreamWaitEvent", cuda.StreamWaitEvent(ctx, s, e))
}

// cuRecordAndWait records e on from and makes to wait on it, in one cgo call.
func cuRecordAndWait(ctx, e, from, to uintptr) error {
	return cuErr("cuEventRecord/cuStreamWaitEvent", cuda.RecordAndWait(ctx, e, from, to))
}

func cuStreamGetID(ctx, s uintptr) (uint64, error) {
	id, r := cuda.StreamGetID(ctx, s)
	return id, cuErr("cuStreamGetId", r)
}

func cuEventCreate(ctx uintptr, flags uint) (uintptr, error) {
	e, r := cuda.EventCreate(ctx, flags)
	return e, cuErr("cuEventCreate", r)
}

func cuEventRecord(ctx, e, s uintptr) error {
	return cuErr("cuEventRecord", cuda.EventRecord(ctx, e, s))
}

func cuEventSynchronize(ctx, e uintptr) error {
	return cuErr("cuEventSynchronize", cuda.EventSynchronize(ctx, e))
}

func cuEventQuery(ctx, e uintptr) (bool, error) {
	r := cuda.EventQuery(ctx, e)
	if r == cudaErrorNotReady {
		return false, nil
	}
	return r == 0, cuErr("cuEventQuery", r)
}

func cuEventDestroy(ctx, e uintptr) error {
	return cuErr("cuEventDestroy_v2", cuda.EventDestroy(ctx, e))
}

func cuEventElapsedTime(ctx, a, b uintptr) (float32, error) {
	ms, r := cuda.EventElapsedTime(ctx, a, b)
	return ms, cuErr("cuEventElapsedTime", r)
}

// cuModuleLoadData loads PTX text (a NUL is appended).
func cuModuleLoadData(ctx uintptr, ptx string) (uintptr, error) {
	m, r := cuda.ModuleLoadData(ctx, ptx)
	return m, cuErr("cuModuleLoadData", r)
}

func cuModuleGetFunction(ctx, mod uintptr, name string) (uintptr, error) {
	fn, r := cuda.ModuleGetFunction(ctx, mod, name)
	return fn, cuErr("cuModuleGetFunction", r)
}

// cuLaunchFill launches a fill kernel (dst, n, period, phase, pattern).
func cuLaunchFill(ctx, fn uintptr, grid, block int, stream uintptr, dst DevicePtr, n int, period, phase int, pattern []byte) error {
	return cuErr("cuLaunchKernel", cuda.LaunchFill(ctx, fn, grid, block, stream, uintptr(dst), n, period, phase, pattern))
}

// cuLaunchCopy launches a copy kernel (dst, src, n).
func cuLaunchCopy(ctx, fn uintptr, grid, block int, stream uintptr, dst, src DevicePtr, n int) error {
	return cuErr("cuLaunchKernel", cuda.LaunchCopy(ctx, fn, grid, block, stream, uintptr(dst), uintptr(src), n))
}

// vmmErr is cuErr for the virtual-memory calls: CUDA_ERROR_NOT_SUPPORTED (also what a driver
// without the symbol gives) additionally satisfies errors.Is(err, ErrNotSupported).
func vmmErr(op string, r cuda.Result) error {
	err := cuErr(op, r)
	if err != nil && int(r) == cudaErrorNotSupported {
		return errorf("%w: %w", err, ErrNotSupported)
	}
	return err
}

// cuVMMBound reports whether the driver exports every virtual-memory function the package uses
// (cuMemGetAllocationGranularity, cuMemAddressReserve/Free, cuMemCreate/Release, cuMemMap/Unmap,
// cuMemSetAccess; CUDA 10.2).
func cuVMMBound() bool { return driverLoaded && cuda.VMMBound() }

// cuMemGetAllocationGranularity returns the granularity in bytes of pinned device memory on
// device ord (option 0 MINIMUM, 1 RECOMMENDED).
func cuMemGetAllocationGranularity(ctx uintptr, ord, option int) (int, error) {
	g, r := cuda.MemGetAllocationGranularity(ctx, ord, option)
	return g, vmmErr("cuMemGetAllocationGranularity", r)
}

// cuMemAddressReserve reserves size bytes of address space aligned to align (0: the driver's
// default), with no hint and no flags.
func cuMemAddressReserve(ctx uintptr, size, align int) (DevicePtr, error) {
	p, r := cuda.MemAddressReserve(ctx, size, align)
	return DevicePtr(p), vmmErr("cuMemAddressReserve", r)
}

func cuMemAddressFree(ctx uintptr, p DevicePtr, size int) error {
	return vmmErr("cuMemAddressFree", cuda.MemAddressFree(ctx, uintptr(p), size))
}

// cuMemCreate creates size bytes of pinned memory on device ord and returns its handle;
// handleTypes is the CUmemAllocationHandleType bit set it may be exported as (0: none).
func cuMemCreate(ctx uintptr, size, ord, handleTypes int) (uint64, error) {
	h, r := cuda.MemCreate(ctx, size, ord, handleTypes)
	return h, vmmErr("cuMemCreate", r)
}

func cuMemRelease(ctx uintptr, h uint64) error {
	return vmmErr("cuMemRelease", cuda.MemRelease(ctx, h))
}

// cuMemMap maps size bytes of handle h, from its offset 0, at p.
func cuMemMap(ctx uintptr, p DevicePtr, size int, h uint64) error {
	return vmmErr("cuMemMap", cuda.MemMap(ctx, uintptr(p), size, h))
}

func cuMemUnmap(ctx uintptr, p DevicePtr, size int) error {
	return vmmErr("cuMemUnmap", cuda.MemUnmap(ctx, uintptr(p), size))
}

// cuMemSetAccess grants device ord read/write access to [p, p+size).
func cuMemSetAccess(ctx uintptr, p DevicePtr, size, ord int) error {
	return vmmErr("cuMemSetAccess", cuda.MemSetAccess(ctx, uintptr(p), size, ord))
}

// Interprocess sharing (ipc*.go).

// cuIPCBound reports which interprocess mechanisms the driver exports, as ipcBound* bits.
func cuIPCBound() int {
	if !driverLoaded {
		return 0
	}
	return cuda.IPCBound()
}

// cuDeviceUUID returns device ord's 16-byte UUID (cuDeviceGetUuid_v2, else cuDeviceGetUuid).
func cuDeviceUUID(ord int) ([16]byte, error) {
	u, r := cuda.DeviceUUID(ord)
	return u, cuErr("cuDeviceGetUuid", r)
}

// cuPointerInfo reads p's memory type, device ordinal, whether cuIpcGetMemHandle accepts its
// allocation and, with withPool, the memory pool it came from, in one cuPointerGetAttributes
// call (which succeeds with zeroed values for an address the driver does not know).
func cuPointerInfo(ctx uintptr, p DevicePtr, withPool bool) (ptrInfo, error) {
	in, r := cuda.PointerInfo(ctx, uintptr(p), withPool)
	return ptrInfo{memType: in.MemType, ordinal: in.Ordinal, legacyIPC: in.LegacyIPC, pool: in.Pool},
		cuErr("cuPointerGetAttributes", r)
}

// cuMemGetAddressRange returns the base and size of the allocation holding p.
func cuMemGetAddressRange(ctx uintptr, p DevicePtr) (DevicePtr, int, error) {
	base, size, r := cuda.MemGetAddressRange(ctx, uintptr(p))
	return DevicePtr(base), size, cuErr("cuMemGetAddressRange_v2", r)
}

// cuMemPoolExportFD exports pool as a new POSIX file descriptor, close-on-exec.
func cuMemPoolExportFD(ctx, pool uintptr) (int, error) {
	fd, r := driverFD(func() (int, cuda.Result) { return cuda.MemPoolExportFD(ctx, pool) })
	return fd, cuErr("cuMemPoolExportToShareableHandle", r)
}

// cuMemPoolImportFD imports the pool another process exported as fd.
func cuMemPoolImportFD(ctx uintptr, fd int) (uintptr, error) {
	pool, r := cuda.MemPoolImportFD(ctx, fd)
	return pool, cuErr("cuMemPoolImportFromShareableHandle", r)
}

func cuMemPoolExportPointer(ctx uintptr, p DevicePtr) ([64]byte, error) {
	d, r := cuda.MemPoolExportPointer(ctx, uintptr(p))
	return d, cuErr("cuMemPoolExportPointer", r)
}

func cuMemPoolImportPointer(ctx, pool uintptr, data *[64]byte) (DevicePtr, error) {
	p, r := cuda.MemPoolImportPointer(ctx, pool, data)
	return DevicePtr(p), cuErr("cuMemPoolImportPointer", r)
}

// cuMemExportFD exports the physical allocation h as a new POSIX file descriptor,
// close-on-exec.
func cuMemExportFD(ctx uintptr, h uint64) (int, error) {
	fd, r := driverFD(func() (int, cuda.Result) { return cuda.MemExportFD(ctx, h) })
	return fd, vmmErr("cuMemExportToShareableHandle", r)
}

// cuMemImportFD imports the physical allocation another process exported as fd.
func cuMemImportFD(ctx uintptr, fd int) (uint64, error) {
	h, r := cuda.MemImportFD(ctx, fd)
	return h, vmmErr("cuMemImportFromShareableHandle", r)
}

func cuIpcGetMemHandle(ctx uintptr, p DevicePtr) ([64]byte, error) {
	d, r := cuda.IpcGetMemHandle(ctx, uintptr(p))
	return d, cuErr("cuIpcGetMemHandle", r)
}

func cuIpcOpenMemHandle(ctx uintptr, data *[64]byte) (DevicePtr, error) {
	p, r := cuda.IpcOpenMemHandle(ctx, data)
	return DevicePtr(p), cuErr("cuIpcOpenMemHandle_v2", r)
}

func cuIpcCloseMemHandle(ctx uintptr, p DevicePtr) error {
	return cuErr("cuIpcCloseMemHandle", cuda.IpcCloseMemHandle(ctx, uintptr(p)))
}

func cuIpcGetEventHandle(ctx, e uintptr) ([64]byte, error) {
	d, r := cuda.IpcGetEventHandle(ctx, e)
	return d, cuErr("cuIpcGetEventHandle", r)
}

func cuIpcOpenEventHandle(ctx uintptr, data *[64]byte) (uintptr, error) {
	e, r := cuda.IpcOpenEventHandle(ctx, data)
	return e, cuErr("cuIpcOpenEventHandle", r)
}
