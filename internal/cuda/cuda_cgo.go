//go:build cgo

package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#define RMM_PATTERN_BYTES 256

// Our own declarations of the driver API (no CUDA headers needed): plain C types on LP64.
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUmemoryPool;

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
	int allocType;
	int handleTypes;
	CUmemLocation location;
	void *win32SecurityAttributes;
	size_t maxSize;
	unsigned short usage;
	unsigned char reserved[54];
} CUmemPoolProps; // 88 bytes

// Virtual memory management.
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
	int type;
	int requestedHandleTypes;
	CUmemLocation location;
	void *win32HandleMetaData;
	unsigned char compressionType;
	unsigned char gpuDirectRDMACapable;
	unsigned short usage;
	unsigned char reserved[4];
} CUmemAllocationProp; // 32 bytes
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc; // 12 bytes
typedef char rmm_check_prop_size[sizeof(CUmemAllocationProp) == 32 ? 1 : -1];
typedef char rmm_check_access_size[sizeof(CUmemAccessDesc) == 12 ? 1 : -1];

static void *rmm_lib;
static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDriverGetVersion)(int *);
static CUresult (*p_cuGetErrorName)(CUresult, const char **);
static CUresult (*p_cuGetErrorString)(CUresult, const char **);
static CUresult (*p_cuDeviceGetCount)(int *);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDeviceGetName)(char *, int, CUdevice);
static CUresult (*p_cuDeviceGetAttribute)(int *, int, CUdevice);
static CUresult (*p_cuDeviceTotalMem)(size_t *, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuCtxGetCurrent)(CUcontext *);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuCtxSynchronize)(void);
static CUresult (*p_cuMemGetInfo)(size_t *, size_t *);
static CUresult (*p_cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree)(CUdeviceptr);
static CUresult (*p_cuMemAllocManaged)(CUdeviceptr *, size_t, unsigned int);
static CUresult (*p_cuMemHostAlloc)(void **, size_t, unsigned int);
static CUresult (*p_cuMemFreeHost)(void *);
static CUresult (*p_cuMemAllocAsync)(CUdeviceptr *, size_t, CUstream);
static CUresult (*p_cuMemFreeAsync)(CUdeviceptr, CUstream);
static CUresult (*p_cuMemPoolCreate)(CUmemoryPool *, const CUmemPoolProps *);
static CUresult (*p_cuMemPoolDestroy)(CUmemoryPool);
static CUresult (*p_cuMemAllocFromPoolAsync)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
static CUresult (*p_cuMemPoolSetAttribute)(CUmemoryPool, int, void *);
static CUresult (*p_cuMemPoolGetAttribute)(CUmemoryPool, int, void *);
static CUresult (*p_cuMemPoolTrimTo)(CUmemoryPool, size_t);
static CUresult (*p_cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
static CUresult (*p_cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*p_cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
static CUresult (*p_cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
static CUresult (*p_cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
static CUresult (*p_cuMemsetD16Async)(CUdeviceptr, unsigned short, size_t, CUstream);
static CUresult (*p_cuMemsetD32Async)(CUdeviceptr, unsigned int, size_t, CUstream);
static CUresult (*p_cuMemPrefetchAsync_v2)(CUdeviceptr, size_t, CUmemLocation, unsigned int, CUstream);
static CUresult (*p_cuMemAdvise_v2)(CUdeviceptr, size_t, int, CUmemLocation);
static CUresult (*p_cuPointerGetAttributes)(unsigned int, int *, void **, CUdeviceptr);
static CUresult (*p_cuMemRangeGetAttribute)(void *, size_t, int, CUdeviceptr, size_t);
static CUresult (*p_cuDeviceGetDefaultMemPool)(CUmemoryPool *, CUdevice);
static CUresult (*p_cuMemGetDefaultMemPool)(CUmemoryPool *, CUmemLocation *, int);
static CUresult (*p_cuStreamCreate)(CUstream *, unsigned int);
static CUresult (*p_cuStreamDestroy)(CUstream);
static CUresult (*p_cuStreamSynchronize)(CUstream);
static CUresult (*p_cuStreamQuery)(CUstream);
static CUresult (*p_cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
static CUresult (*p_cuStreamGetId)(CUstream, unsigned long long *);
static CUresult (*p_cuEventCreate)(CUevent *, unsigned int);
static CUresult (*p_cuEventRecord)(CUevent, CUstream);
static CUresult (*p_cuEventSynchronize)(CUevent);
static CUresult (*p_cuEventQuery)(CUevent);
static CUresult (*p_cuEventDestroy)(CUevent);
static CUresult (*p_cuEventElapsedTime)(float *, CUevent, CUevent);
static CUresult (*p_cuModuleLoadData)(CUmodule *, const void *);
static CUresult (*p_cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
static CUresult (*p_cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
static CUresult (*p_cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
static CUresult (*p_cuMemAddressFree)(CUdeviceptr, size_t);
static CUresult (*p_cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
static CUresult (*p_cuMemRelease)(CUmemGenericAllocationHandle);
static CUresult (*p_cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
static CUresult (*p_cuMemUnmap)(CUdeviceptr, size_t);
static CUresult (*p_cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
static CUresult (*p_cuLaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int,
	unsigned int, unsigned int, unsigned int, unsigned int, CUstream, void **, void **);

// Interprocess sharing. CUipcMemHandle, CUipcEventHandle and CUmemPoolPtrExportData are all
// 64 opaque bytes; a CUuuid is 16 bytes.
typedef struct { unsigned char b[64]; } rmm_opaque64;
typedef char rmm_check_opaque_size[sizeof(rmm_opaque64) == 64 ? 1 : -1];
static CUresult (*p_cuDeviceGetUuid)(unsigned char *, CUdevice);
static CUresult (*p_cuMemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
static CUresult (*p_cuMemPoolExportToShareableHandle)(void *, CUmemoryPool, int, unsigned long long);
static CUresult (*p_cuMemPoolImportFromShareableHandle)(CUmemoryPool *, void *, int, unsigned long long);
static CUresult (*p_cuMemPoolExportPointer)(rmm_opaque64 *, CUdeviceptr);
static CUresult (*p_cuMemPoolImportPointer)(CUdeviceptr *, CUmemoryPool, rmm_opaque64 *);
static CUresult (*p_cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
static CUresult (*p_cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
static CUresult (*p_cuIpcGetMemHandle)(rmm_opaque64 *, CUdeviceptr);
static CUresult (*p_cuIpcOpenMemHandle)(CUdeviceptr *, rmm_opaque64, unsigned int);
static CUresult (*p_cuIpcCloseMemHandle)(CUdeviceptr);
static CUresult (*p_cuIpcGetEventHandle)(rmm_opaque64 *, CUevent);
static CUresult (*p_cuIpcOpenEventHandle)(CUevent *, rmm_opaque64);

static char rmm_load_err[512];

#define RMM_SYM(var, name, required) do { \
	*(void **)(&var) = dlsym(rmm_lib, name); \
	if (!var && required) { \
		snprintf(rmm_load_err, sizeof rmm_load_err, "libcuda.so.1 lacks %s (driver too old)", name); \
		return rmm_load_err; \
	} } while (0)

// rmm_load opens the driver and binds every symbol. It returns NULL or a static error text. The
// dlopen/dlsym/dlerror sequence stays inside this one C call, so dlerror's per-thread state is
// read on the thread that set it.
static const char *rmm_load(void) {
	rmm_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!rmm_lib) {
		const char *e = dlerror();
		snprintf(rmm_load_err, sizeof rmm_load_err, "cannot load the CUDA driver: %s", e ? e : "libcuda.so.1 not found");
		return rmm_load_err;
	}
	RMM_SYM(p_cuInit, "cuInit", 1);
	RMM_SYM(p_cuDriverGetVersion, "cuDriverGetVersion", 1);
	RMM_SYM(p_cuGetErrorName, "cuGetErrorName", 1);
	RMM_SYM(p_cuGetErrorString, "cuGetErrorString", 1);
	RMM_SYM(p_cuDeviceGetCount, "cuDeviceGetCount", 1);
	RMM_SYM(p_cuDeviceGet, "cuDeviceGet", 1);
	RMM_SYM(p_cuDeviceGetName, "cuDeviceGetName", 1);
	RMM_SYM(p_cuDeviceGetAttribute, "cuDeviceGetAttribute", 1);
	RMM_SYM(p_cuDeviceTotalMem, "cuDeviceTotalMem_v2", 1);
	RMM_SYM(p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 1);
	RMM_SYM(p_cuCtxGetCurrent, "cuCtxGetCurrent", 1);
	RMM_SYM(p_cuCtxSetCurrent, "cuCtxSetCurrent", 1);
	RMM_SYM(p_cuCtxSynchronize, "cuCtxSynchronize", 1);
	RMM_SYM(p_cuMemGetInfo, "cuMemGetInfo_v2", 1);
	RMM_SYM(p_cuMemAlloc, "cuMemAlloc_v2", 1);
	RMM_SYM(p_cuMemFree, "cuMemFree_v2", 1);
	RMM_SYM(p_cuMemAllocManaged, "cuMemAllocManaged", 1);
	RMM_SYM(p_cuMemHostAlloc, "cuMemHostAlloc", 1);
	RMM_SYM(p_cuMemFreeHost, "cuMemFreeHost", 1);
	RMM_SYM(p_cuMemcpyAsync, "cuMemcpyAsync", 1);
	RMM_SYM(p_cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", 1);
	RMM_SYM(p_cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", 1);
	RMM_SYM(p_cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", 1);
	RMM_SYM(p_cuMemsetD8Async, "cuMemsetD8Async", 1);
	RMM_SYM(p_cuMemsetD16Async, "cuMemsetD16Async", 1);
	RMM_SYM(p_cuMemsetD32Async, "cuMemsetD32Async", 1);
	RMM_SYM(p_cuPointerGetAttributes, "cuPointerGetAttributes", 1);
	RMM_SYM(p_cuStreamCreate, "cuStreamCreate", 1);
	RMM_SYM(p_cuStreamDestroy, "cuStreamDestroy_v2", 1);
	RMM_SYM(p_cuStreamSynchronize, "cuStreamSynchronize", 1);
	RMM_SYM(p_cuStreamQuery, "cuStreamQuery", 1);
	RMM_SYM(p_cuStreamWaitEvent, "cuStreamWaitEvent", 1);
	RMM_SYM(p_cuEventCreate, "cuEventCreate", 1);
	RMM_SYM(p_cuEventRecord, "cuEventRecord", 1);
	RMM_SYM(p_cuEventSynchronize, "cuEventSynchronize", 1);
	RMM_SYM(p_cuEventQuery, "cuEventQuery", 1);
	RMM_SYM(p_cuEventDestroy, "cuEventDestroy_v2", 1);
	RMM_SYM(p_cuModuleLoadData, "cuModuleLoadData", 1);
	RMM_SYM(p_cuModuleGetFunction, "cuModuleGetFunction", 1);
	RMM_SYM(p_cuLaunchKernel, "cuLaunchKernel", 1);
	// Optional: the stream-ordered allocator (11.2), stream ids (12.0), prefetch v2 (12.2),
	// elapsed time v2 (12.8, falling back to v1).
	RMM_SYM(p_cuMemAllocAsync, "cuMemAllocAsync", 0);
	RMM_SYM(p_cuMemFreeAsync, "cuMemFreeAsync", 0);
	RMM_SYM(p_cuMemPoolCreate, "cuMemPoolCreate", 0);
	RMM_SYM(p_cuMemPoolDestroy, "cuMemPoolDestroy", 0);
	RMM_SYM(p_cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 0);
	RMM_SYM(p_cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 0);
	RMM_SYM(p_cuMemPoolGetAttribute, "cuMemPoolGetAttribute", 0);
	RMM_SYM(p_cuMemPoolTrimTo, "cuMemPoolTrimTo", 0);
	RMM_SYM(p_cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 0);
	// Optional: per-location default pools, managed memory pools among them (13.0).
	RMM_SYM(p_cuMemGetDefaultMemPool, "cuMemGetDefaultMemPool", 0);
	RMM_SYM(p_cuMemAdvise_v2, "cuMemAdvise_v2", 0);
	RMM_SYM(p_cuMemRangeGetAttribute, "cuMemRangeGetAttribute", 0);
	RMM_SYM(p_cuStreamGetId, "cuStreamGetId", 0);
	RMM_SYM(p_cuMemPrefetchAsync_v2, "cuMemPrefetchAsync_v2", 0);
	RMM_SYM(p_cuEventElapsedTime, "cuEventElapsedTime_v2", 0);
	if (!p_cuEventElapsedTime) RMM_SYM(p_cuEventElapsedTime, "cuEventElapsedTime", 0);
	// Optional: virtual memory management (10.2); no _v2 names.
	RMM_SYM(p_cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", 0);
	RMM_SYM(p_cuMemAddressReserve, "cuMemAddressReserve", 0);
	RMM_SYM(p_cuMemAddressFree, "cuMemAddressFree", 0);
	RMM_SYM(p_cuMemCreate, "cuMemCreate", 0);
	RMM_SYM(p_cuMemRelease, "cuMemRelease", 0);
	RMM_SYM(p_cuMemMap, "cuMemMap", 0);
	RMM_SYM(p_cuMemUnmap, "cuMemUnmap", 0);
	RMM_SYM(p_cuMemSetAccess, "cuMemSetAccess", 0);
	// Optional: interprocess sharing (device UUIDs 9.2/11.4, cuIpc* 4.1 with the v2 open of 11.0,
	// VMM export 10.2, pool export 11.2).
	RMM_SYM(p_cuDeviceGetUuid, "cuDeviceGetUuid_v2", 0);
	if (!p_cuDeviceGetUuid) RMM_SYM(p_cuDeviceGetUuid, "cuDeviceGetUuid", 0);
	RMM_SYM(p_cuMemGetAddressRange, "cuMemGetAddressRange_v2", 0);
	RMM_SYM(p_cuMemPoolExportToShareableHandle, "cuMemPoolExportToShareableHandle", 0);
	RMM_SYM(p_cuMemPoolImportFromShareableHandle, "cuMemPoolImportFromShareableHandle", 0);
	RMM_SYM(p_cuMemPoolExportPointer, "cuMemPoolExportPointer", 0);
	RMM_SYM(p_cuMemPoolImportPointer, "cuMemPoolImportPointer", 0);
	RMM_SYM(p_cuMemExportToShareableHandle, "cuMemExportToShareableHandle", 0);
	RMM_SYM(p_cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", 0);
	RMM_SYM(p_cuIpcGetMemHandle, "cuIpcGetMemHandle", 0);
	RMM_SYM(p_cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2", 0);
	RMM_SYM(p_cuIpcCloseMemHandle, "cuIpcCloseMemHandle", 0);
	RMM_SYM(p_cuIpcGetEventHandle, "cuIpcGetEventHandle", 0);
	RMM_SYM(p_cuIpcOpenEventHandle, "cuIpcOpenEventHandle", 0);
	return NULL;
}

// CUDA_ERROR_NOT_SUPPORTED: returned by a trampoline whose optional symbol is missing.
#define RMM_MISSING 801

// use_ctx makes ctx current on the calling OS thread unless it already is. Every trampoline
// calls it first, inside the same C call as the work, because a goroutine may run on another
// thread at its next cgo call.
static inline CUresult use_ctx(uintptr_t ctx) {
	CUcontext cur = 0;
	CUresult r = p_cuCtxGetCurrent(&cur);
	if (r) return r;
	if ((uintptr_t)cur != ctx) return p_cuCtxSetCurrent((CUcontext)ctx);
	return 0;
}

typedef struct { CUresult r; uintptr_t v; } rmm_res;
typedef struct { CUresult r; size_t a; size_t b; } rmm_res2;

static CUresult rmm_init(void) { return p_cuInit(0); }
static rmm_res rmm_driver_version(void) { int v = 0; rmm_res o; o.r = p_cuDriverGetVersion(&v); o.v = (uintptr_t)v; return o; }
static const char *rmm_error_name(CUresult c) { const char *s = NULL; if (p_cuGetErrorName(c, &s)) return NULL; return s; }
static const char *rmm_error_string(CUresult c) { const char *s = NULL; if (p_cuGetErrorString(c, &s)) return NULL; return s; }
static rmm_res rmm_device_count(void) { int n = 0; rmm_res o; o.r = p_cuDeviceGetCount(&n); o.v = (uintptr_t)n; return o; }
static CUresult rmm_device_name(int ord, char *buf, int len) {
	CUdevice d; CUresult r = p_cuDeviceGet(&d, ord); if (r) return r;
	return p_cuDeviceGetName(buf, len, d);
}
static rmm_res rmm_device_attribute(int ord, int attr) {
	rmm_res o = {0, 0}; CUdevice d; int v = 0;
	o.r = p_cuDeviceGet(&d, ord); if (o.r) return o;
	o.r = p_cuDeviceGetAttribute(&v, attr, d); o.v = (uintptr_t)(intptr_t)v; return o;
}
static rmm_res rmm_device_total_mem(int ord) {
	rmm_res o = {0, 0}; CUdevice d; size_t v = 0;
	o.r = p_cuDeviceGet(&d, ord); if (o.r) return o;
	o.r = p_cuDeviceTotalMem(&v, d); o.v = v; return o;
}
static rmm_res rmm_primary_ctx_retain(int ord) {
	rmm_res o = {0, 0}; CUdevice d; CUcontext c = 0;
	o.r = p_cuDeviceGet(&d, ord); if (o.r) return o;
	o.r = p_cuDevicePrimaryCtxRetain(&c, d); o.v = (uintptr_t)c; return o;
}
static CUresult rmm_ctx_synchronize(uintptr_t ctx) { CUresult r = use_ctx(ctx); if (r) return r; return p_cuCtxSynchronize(); }
static rmm_res2 rmm_mem_get_info(uintptr_t ctx) {
	rmm_res2 o = {0, 0, 0}; o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemGetInfo(&o.a, &o.b); return o;
}
static rmm_res rmm_mem_alloc(uintptr_t ctx, size_t n) {
	rmm_res o = {0, 0}; CUdeviceptr p = 0; o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemAlloc(&p, n); o.v = (uintptr_t)p; return o;
}
static CUresult rmm_mem_free(uintptr_t ctx, uintptr_t p) { CUresult r = use_ctx(ctx); if (r) return r; return p_cuMemFree((CUdeviceptr)p); }
static rmm_res rmm_mem_alloc_managed(uintptr_t ctx, size_t n, unsigned int flags) {
	rmm_res o = {0, 0}; CUdeviceptr p = 0; o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemAllocManaged(&p, n, flags); o.v = (uintptr_t)p; return o;
}
static rmm_res rmm_mem_host_alloc(uintptr_t ctx, size_t n, unsigned int flags) {
	rmm_res o = {0, 0}; void *p = 0; o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemHostAlloc(&p, n, flags); o.v = (uintptr_t)p; return o;
}
static CUresult rmm_mem_free_host(uintptr_t ctx, uintptr_t p) { CUresult r = use_ctx(ctx); if (r) return r; return p_cuMemFreeHost((void *)p); }
static rmm_res rmm_mem_pool_create(uintptr_t ctx, int ord, int handle_types) {
	rmm_res o = {RMM_MISSING, 0}; CUmemoryPool pool = 0; CUmemPoolProps props;
	if (!p_cuMemPoolCreate) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	memset(&props, 0, sizeof props);
	props.allocType = 1; props.handleTypes = handle_types; props.location.type = 1; props.location.id = ord;
	o.r = p_cuMemPoolCreate(&pool, &props); o.v = (uintptr_t)pool; return o;
}
static CUresult rmm_mem_pool_destroy(uintptr_t ctx, uintptr_t pool) {
	CUresult r = use_ctx(ctx); if (r) return r; return p_cuMemPoolDestroy((CUmemoryPool)pool);
}
static CUresult rmm_mem_pool_set_u64(uintptr_t ctx, uintptr_t pool, int attr, unsigned long long v) {
	CUresult r = use_ctx(ctx); if (r) return r; return p_cuMemPoolSetAttribute((CUmemoryPool)pool, attr, &v);
}
static rmm_res rmm_mem_pool_get_u64(uintptr_t ctx, uintptr_t pool, int attr) {
	rmm_res o = {0, 0}; unsigned long long v = 0; o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemPoolGetAttribute((CUmemoryPool)pool, attr, &v); o.v = (uintptr_t)v; return o;
}
static CUresult rmm_mem_pool_trim(uintptr_t ctx, uintptr_t pool, size_t keep) {
	CUresult r = use_ctx(ctx); if (r) return r; return p_cuMemPoolTrimTo((CUmemoryPool)pool, keep);
}
static rmm_res rmm_device_default_mem_pool(uintptr_t ctx, int ord) {
	rmm_res o = {RMM_MISSING, 0}; CUmemoryPool pool = 0; CUdevice d;
	if (!p_cuDeviceGetDefaultMemPool) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuDeviceGet(&d, ord); if (o.r) return o;
	o.r = p_cuDeviceGetDefaultMemPool(&pool, d); o.v = (uintptr_t)pool; return o;
}
// rmm_mem_default_mem_pool returns the default pool of allocation type typ (CUmemAllocationType)
// located on device ord.
static rmm_res rmm_mem_default_mem_pool(uintptr_t ctx, int ord, int typ) {
	rmm_res o = {RMM_MISSING, 0}; CUmemoryPool pool = 0; CUmemLocation loc;
	if (!p_cuMemGetDefaultMemPool) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	loc.type = 1; loc.id = ord; // CU_MEM_LOCATION_TYPE_DEVICE
	o.r = p_cuMemGetDefaultMemPool(&pool, &loc, typ); o.v = (uintptr_t)pool; return o;
}
static rmm_res rmm_mem_alloc_from_pool(uintptr_t ctx, size_t n, uintptr_t pool, uintptr_t s) {
	rmm_res o = {0, 0}; CUdeviceptr p = 0; o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemAllocFromPoolAsync(&p, n, (CUmemoryPool)pool, (CUstream)s); o.v = (uintptr_t)p; return o;
}
static CUresult rmm_mem_free_async(uintptr_t ctx, uintptr_t p, uintptr_t s) {
	CUresult r = use_ctx(ctx); if (r) return r; return p_cuMemFreeAsync((CUdeviceptr)p, (CUstream)s);
}
static CUresult rmm_memcpy_async(uintptr_t ctx, uintptr_t dst, uintptr_t src, size_t n, uintptr_t s) {
	CUresult r = use_ctx(ctx); if (r) return r; return p_cuMemcpyAsync((CUdeviceptr)dst, (CUdeviceptr)src, n, (CUstream)s);
}
static CUresult rmm_memcpy_dtod_async(uintptr_t ctx, uintptr_t dst, uintptr_t src, size_t n, uintptr_t s) {
	CUresult r = use_ctx(ctx); if (r) return r; return p_cuMemcpyDtoDAsync((CUdeviceptr)dst, (CUdeviceptr)src, n, (CUstream)s);
}
// The two host copies below take Go memory: they finish before returning (the copy is queued on
// s, then s is synchronised), so the driver holds no Go pointer afterwards.
static CUresult rmm_memcpy_htod_sync(uintptr_t ctx, uintptr_t dst, const void *src, size_t n, uintptr_t s) {
	CUresult r = use_ctx(ctx); if (r) return r;
	r = p_cuMemcpyHtoDAsync((CUdeviceptr)dst, src, n, (CUstream)s); if (r) return r;
	return p_cuStreamSynchronize((CUstream)s);
}
static CUresult rmm_memcpy_dtoh_sync(uintptr_t ctx, void *dst, uintptr_t src, size_t n, uintptr_t s) {
	CUresult r = use_ctx(ctx); if (r) return r;
	r = p_cuMemcpyDtoHAsync(dst, (CUdeviceptr)src, n, (CUstream)s); if (r) return r;
	return p_cuStreamSynchronize((CUstream)s);
}
static CUresult rmm_memcpy_htod_async_ptr(uintptr_t ctx, uintptr_t dst, uintptr_t src, size_t n, uintptr_t s) {
	CUresult r = use_ctx(ctx); if (r) return r;
	return p_cuMemcpyHtoDAsync((CUdeviceptr)dst, (const void *)src, n, (CUstream)s);
}
static CUresult rmm_memcpy_dtoh_async_ptr(uintptr_t ctx, uintptr_t dst, uintptr_t src, size_t n, uintptr_t s) {
	CUresult r = use_ctx(ctx); if (r) return r;
	return p_cuMemcpyDtoHAsync((void *)dst, (CUdeviceptr)src, n, (CUstream)s);
}
static CUresult rmm_memset_async(uintptr_t ctx, uintptr_t dst, unsigned int v, size_t n, int width, uintptr_t s) {
	CUresult r = use_ctx(ctx); if (r) return r;
	switch (width) {
	case 1: return p_cuMemsetD8Async((CUdeviceptr)dst, (unsigned char)v, n, (CUstream)s);
	case 2: return p_cuMemsetD16Async((CUdeviceptr)dst, (unsigned short)v, n, (CUstream)s);
	default: return p_cuMemsetD32Async((CUdeviceptr)dst, v, n, (CUstream)s);
	}
}
static CUresult rmm_mem_prefetch(uintptr_t ctx, uintptr_t p, size_t n, int loc_type, int loc_id, uintptr_t s) {
	CUmemLocation loc; CUresult r;
	if (!p_cuMemPrefetchAsync_v2) return RMM_MISSING;
	r = use_ctx(ctx); if (r) return r;
	loc.type = loc_type; loc.id = loc_id;
	return p_cuMemPrefetchAsync_v2((CUdeviceptr)p, n, loc, 0, (CUstream)s);
}
static CUresult rmm_mem_advise(uintptr_t ctx, uintptr_t p, size_t n, int advice, int loc_type, int loc_id) {
	CUmemLocation loc; CUresult r;
	if (!p_cuMemAdvise_v2) return RMM_MISSING;
	r = use_ctx(ctx); if (r) return r;
	loc.type = loc_type; loc.id = loc_id;
	return p_cuMemAdvise_v2((CUdeviceptr)p, n, advice, loc);
}
static int rmm_prefetch_bound(void) { return p_cuMemPrefetchAsync_v2 != NULL; }
// cuPointerGetAttributes (plural) answers CUDA_SUCCESS with the attribute zeroed for an address
// the driver does not know, where cuPointerGetAttribute fails: asking about any pointer is no
// failing call. CU_POINTER_ATTRIBUTE_IS_MANAGED (8) is a 4-byte boolean.
static rmm_res rmm_pointer_is_managed(uintptr_t ctx, uintptr_t p) {
	rmm_res o = {0, 0}; int attr = 8; unsigned int managed = 0; void *data = &managed;
	o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuPointerGetAttributes(1, &attr, &data, (CUdeviceptr)p);
	o.v = managed; return o;
}
// A 4-byte attribute of the managed range [p, p+n) (CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION
// is 4: a device ordinal, -1 for the host, -2 for none).
static rmm_res rmm_mem_range_attribute_int(uintptr_t ctx, uintptr_t p, size_t n, int attr) {
	rmm_res o = {0, 0}; int v = 0;
	if (!p_cuMemRangeGetAttribute) { o.r = RMM_MISSING; return o; }
	o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemRangeGetAttribute(&v, sizeof v, attr, (CUdeviceptr)p, n);
	o.v = (uintptr_t)(intptr_t)v; return o;
}
static rmm_res rmm_stream_create(uintptr_t ctx, unsigned int flags) {
	rmm_res o = {0, 0}; CUstream s = 0; o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuStreamCreate(&s, flags); o.v = (uintptr_t)s; return o;
}
static CUresult rmm_stream_destroy(uintptr_t ctx, uintptr_t s) { CUresult r = use_ctx(ctx); if (r) return r; return p_cuStreamDestroy((CUstream)s); }
static CUresult rmm_stream_synchronize(uintptr_t ctx, uintptr_t s) { CUresult r = use_ctx(ctx); if (r) return r; return p_cuStreamSynchronize((CUstream)s); }
static CUresult rmm_stream_query(uintptr_t ctx, uintptr_t s) { CUresult r = use_ctx(ctx); if (r) return r; return p_cuStreamQuery((CUstream)s); }
static CUresult rmm_stream_wait_event(uintptr_t ctx, uintptr_t s, uintptr_t e) {
	CUresult r = use_ctx(ctx); if (r) return r; return p_cuStreamWaitEvent((CUstream)s, (CUevent)e, 0);
}
// Records e on from, then makes to wait for it: the whole cross-stream hand-over in one call.
static CUresult rmm_record_and_wait(uintptr_t ctx, uintptr_t e, uintptr_t from, uintptr_t to) {
	CUresult r = use_ctx(ctx); if (r) return r;
	r = p_cuEventRecord((CUevent)e, (CUstream)from); if (r) return r;
	return p_cuStreamWaitEvent((CUstream)to, (CUevent)e, 0);
}
static rmm_res rmm_stream_get_id(uintptr_t ctx, uintptr_t s) {
	rmm_res o = {RMM_MISSING, 0}; unsigned long long id = 0;
	if (!p_cuStreamGetId) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuStreamGetId((CUstream)s, &id); o.v = (uintptr_t)id; return o;
}
static rmm_res rmm_event_create(uintptr_t ctx, unsigned int flags) {
	rmm_res o = {0, 0}; CUevent e = 0; o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuEventCreate(&e, flags); o.v = (uintptr_t)e; return o;
}
static CUresult rmm_event_record(uintptr_t ctx, uintptr_t e, uintptr_t s) { CUresult r = use_ctx(ctx); if (r) return r; return p_cuEventRecord((CUevent)e, (CUstream)s); }
static CUresult rmm_event_synchronize(uintptr_t ctx, uintptr_t e) { CUresult r = use_ctx(ctx); if (r) return r; return p_cuEventSynchronize((CUevent)e); }
static CUresult rmm_event_query(uintptr_t ctx, uintptr_t e) { CUresult r = use_ctx(ctx); if (r) return r; return p_cuEventQuery((CUevent)e); }
static CUresult rmm_event_destroy(uintptr_t ctx, uintptr_t e) { CUresult r = use_ctx(ctx); if (r) return r; return p_cuEventDestroy((CUevent)e); }
typedef struct { CUresult r; float ms; } rmm_resf;
static rmm_resf rmm_event_elapsed(uintptr_t ctx, uintptr_t a, uintptr_t b) {
	rmm_resf o = {RMM_MISSING, 0}; if (!p_cuEventElapsedTime) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuEventElapsedTime(&o.ms, (CUevent)a, (CUevent)b); return o;
}
// image must be NUL-terminated PTX text.
static rmm_res rmm_module_load(uintptr_t ctx, const char *image) {
	rmm_res o = {0, 0}; CUmodule m = 0; o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuModuleLoadData(&m, image); o.v = (uintptr_t)m; return o;
}
static rmm_res rmm_module_get_function(uintptr_t ctx, uintptr_t m, const char *name) {
	rmm_res o = {0, 0}; CUfunction f = 0; o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuModuleGetFunction(&f, (CUmodule)m, name); o.v = (uintptr_t)f; return o;
}

// Virtual memory management. Each trampoline answers RMM_MISSING when the driver lacks its
// symbol. Allocations are pinned device memory on device ord; access is read/write for ord.
static int rmm_vmm_bound(void) {
	return p_cuMemGetAllocationGranularity && p_cuMemAddressReserve && p_cuMemAddressFree && p_cuMemCreate &&
		p_cuMemRelease && p_cuMemMap && p_cuMemUnmap && p_cuMemSetAccess;
}
static void rmm_vmm_prop(CUmemAllocationProp *prop, int ord) {
	memset(prop, 0, sizeof *prop);
	prop->type = 1;          // CU_MEM_ALLOCATION_TYPE_PINNED
	prop->location.type = 1; // CU_MEM_LOCATION_TYPE_DEVICE
	prop->location.id = ord;
}
typedef struct { CUresult r; unsigned long long v; } rmm_res64;
static rmm_res64 rmm_mem_granularity(uintptr_t ctx, int ord, int option) {
	rmm_res64 o = {RMM_MISSING, 0}; CUmemAllocationProp prop; size_t g = 0;
	if (!p_cuMemGetAllocationGranularity) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	rmm_vmm_prop(&prop, ord);
	o.r = p_cuMemGetAllocationGranularity(&g, &prop, option); o.v = g; return o;
}
static rmm_res64 rmm_mem_address_reserve(uintptr_t ctx, size_t size, size_t align) {
	rmm_res64 o = {RMM_MISSING, 0}; CUdeviceptr p = 0;
	if (!p_cuMemAddressReserve) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemAddressReserve(&p, size, align, 0, 0); o.v = p; return o;
}
static CUresult rmm_mem_address_free(uintptr_t ctx, unsigned long long p, size_t size) {
	CUresult r; if (!p_cuMemAddressFree) return RMM_MISSING;
	r = use_ctx(ctx); if (r) return r; return p_cuMemAddressFree((CUdeviceptr)p, size);
}
// handle_types is the CUmemAllocationHandleType bit set the memory may be exported as (0: none).
static rmm_res64 rmm_mem_create(uintptr_t ctx, size_t size, int ord, int handle_types) {
	rmm_res64 o = {RMM_MISSING, 0}; CUmemAllocationProp prop; CUmemGenericAllocationHandle h = 0;
	if (!p_cuMemCreate) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	rmm_vmm_prop(&prop, ord);
	prop.requestedHandleTypes = handle_types;
	o.r = p_cuMemCreate(&h, size, &prop, 0); o.v = h; return o;
}
static CUresult rmm_mem_release(uintptr_t ctx, unsigned long long h) {
	CUresult r; if (!p_cuMemRelease) return RMM_MISSING;
	r = use_ctx(ctx); if (r) return r; return p_cuMemRelease((CUmemGenericAllocationHandle)h);
}
static CUresult rmm_mem_map(uintptr_t ctx, unsigned long long p, size_t size, unsigned long long h) {
	CUresult r; if (!p_cuMemMap) return RMM_MISSING;
	r = use_ctx(ctx); if (r) return r; return p_cuMemMap((CUdeviceptr)p, size, 0, (CUmemGenericAllocationHandle)h, 0);
}
static CUresult rmm_mem_unmap(uintptr_t ctx, unsigned long long p, size_t size) {
	CUresult r; if (!p_cuMemUnmap) return RMM_MISSING;
	r = use_ctx(ctx); if (r) return r; return p_cuMemUnmap((CUdeviceptr)p, size);
}
static CUresult rmm_mem_set_access(uintptr_t ctx, unsigned long long p, size_t size, int ord) {
	CUmemAccessDesc d; CUresult r;
	if (!p_cuMemSetAccess) return RMM_MISSING;
	r = use_ctx(ctx); if (r) return r;
	d.location.type = 1; d.location.id = ord; d.flags = 3; // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
	return p_cuMemSetAccess((CUdeviceptr)p, size, &d, 1);
}

// Interprocess sharing. Each trampoline answers RMM_MISSING when the driver lacks its symbol.
// POSIX file descriptors (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1) come out through an int *
// and go in as the pointer value itself.
static int rmm_ipc_bound(void) {
	int b = 0;
	if (p_cuIpcGetMemHandle && p_cuIpcOpenMemHandle && p_cuIpcCloseMemHandle && p_cuMemGetAddressRange) b |= 1;
	if (p_cuMemPoolExportToShareableHandle && p_cuMemPoolImportFromShareableHandle && p_cuMemPoolExportPointer &&
		p_cuMemPoolImportPointer && p_cuMemPoolDestroy) b |= 2;
	if (p_cuMemExportToShareableHandle && p_cuMemImportFromShareableHandle && rmm_vmm_bound()) b |= 4;
	if (p_cuIpcGetEventHandle && p_cuIpcOpenEventHandle) b |= 8;
	if (p_cuDeviceGetUuid) b |= 16;
	return b;
}
static CUresult rmm_device_uuid(int ord, unsigned char *out) {
	CUdevice d; CUresult r;
	if (!p_cuDeviceGetUuid) return RMM_MISSING;
	r = p_cuDeviceGet(&d, ord); if (r) return r;
	return p_cuDeviceGetUuid(out, d);
}
// CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2), DEVICE_ORDINAL (9), IS_LEGACY_CUDA_IPC_CAPABLE (10) and,
// with with_pool, MEMPOOL_HANDLE (17, CUDA 11.2), in one cuPointerGetAttributes call, which
// answers success with zeroed values for an address the driver does not know.
typedef struct { CUresult r; unsigned int memtype; int ordinal; int legacy_ipc; uintptr_t pool; } rmm_ptr_info;
static rmm_ptr_info rmm_pointer_info(uintptr_t ctx, uintptr_t p, int with_pool) {
	rmm_ptr_info o; int attrs[4] = {2, 9, 10, 17}; void *data[4];
	unsigned int memtype = 0, legacy = 0; int ordinal = -2; CUmemoryPool pool = 0;
	memset(&o, 0, sizeof o);
	o.r = use_ctx(ctx); if (o.r) return o;
	data[0] = &memtype; data[1] = &ordinal; data[2] = &legacy; data[3] = &pool;
	o.r = p_cuPointerGetAttributes(with_pool ? 4 : 3, attrs, data, (CUdeviceptr)p);
	o.memtype = memtype; o.ordinal = ordinal; o.legacy_ipc = legacy != 0; o.pool = (uintptr_t)pool;
	return o;
}
static rmm_res2 rmm_mem_address_range(uintptr_t ctx, uintptr_t p) {
	rmm_res2 o = {RMM_MISSING, 0, 0}; CUdeviceptr base = 0; size_t size = 0;
	if (!p_cuMemGetAddressRange) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemGetAddressRange(&base, &size, (CUdeviceptr)p); o.a = (size_t)base; o.b = size; return o;
}
static rmm_res rmm_mem_pool_export_fd(uintptr_t ctx, uintptr_t pool) {
	rmm_res o = {RMM_MISSING, 0}; int fd = -1;
	if (!p_cuMemPoolExportToShareableHandle) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemPoolExportToShareableHandle(&fd, (CUmemoryPool)pool, 1, 0); o.v = (uintptr_t)(intptr_t)fd; return o;
}
static rmm_res rmm_mem_pool_import_fd(uintptr_t ctx, int fd) {
	rmm_res o = {RMM_MISSING, 0}; CUmemoryPool pool = 0;
	if (!p_cuMemPoolImportFromShareableHandle) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemPoolImportFromShareableHandle(&pool, (void *)(uintptr_t)fd, 1, 0); o.v = (uintptr_t)pool; return o;
}
static CUresult rmm_mem_pool_export_pointer(uintptr_t ctx, uintptr_t p, unsigned char *out) {
	rmm_opaque64 d; CUresult r;
	if (!p_cuMemPoolExportPointer) return RMM_MISSING;
	r = use_ctx(ctx); if (r) return r;
	memset(&d, 0, sizeof d);
	r = p_cuMemPoolExportPointer(&d, (CUdeviceptr)p); if (r) return r;
	memcpy(out, d.b, sizeof d.b); return 0;
}
static rmm_res rmm_mem_pool_import_pointer(uintptr_t ctx, uintptr_t pool, const unsigned char *in) {
	rmm_res o = {RMM_MISSING, 0}; rmm_opaque64 d; CUdeviceptr p = 0;
	if (!p_cuMemPoolImportPointer) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	memcpy(d.b, in, sizeof d.b);
	o.r = p_cuMemPoolImportPointer(&p, (CUmemoryPool)pool, &d); o.v = (uintptr_t)p; return o;
}
static rmm_res rmm_mem_export_fd(uintptr_t ctx, unsigned long long h) {
	rmm_res o = {RMM_MISSING, 0}; int fd = -1;
	if (!p_cuMemExportToShareableHandle) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemExportToShareableHandle(&fd, (CUmemGenericAllocationHandle)h, 1, 0); o.v = (uintptr_t)(intptr_t)fd; return o;
}
static rmm_res64 rmm_mem_import_fd(uintptr_t ctx, int fd) {
	rmm_res64 o = {RMM_MISSING, 0}; CUmemGenericAllocationHandle h = 0;
	if (!p_cuMemImportFromShareableHandle) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	o.r = p_cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, 1); o.v = h; return o;
}
static CUresult rmm_ipc_get_mem_handle(uintptr_t ctx, uintptr_t p, unsigned char *out) {
	rmm_opaque64 d; CUresult r;
	if (!p_cuIpcGetMemHandle) return RMM_MISSING;
	r = use_ctx(ctx); if (r) return r;
	memset(&d, 0, sizeof d);
	r = p_cuIpcGetMemHandle(&d, (CUdeviceptr)p); if (r) return r;
	memcpy(out, d.b, sizeof d.b); return 0;
}
// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (1): the memory may be opened on another device than the
// one it lives on, peer access being enabled when needed.
static rmm_res rmm_ipc_open_mem_handle(uintptr_t ctx, const unsigned char *in) {
	rmm_res o = {RMM_MISSING, 0}; rmm_opaque64 d; CUdeviceptr p = 0;
	if (!p_cuIpcOpenMemHandle) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	memcpy(d.b, in, sizeof d.b);
	o.r = p_cuIpcOpenMemHandle(&p, d, 1); o.v = (uintptr_t)p; return o;
}
static CUresult rmm_ipc_close_mem_handle(uintptr_t ctx, uintptr_t p) {
	CUresult r; if (!p_cuIpcCloseMemHandle) return RMM_MISSING;
	r = use_ctx(ctx); if (r) return r; return p_cuIpcCloseMemHandle((CUdeviceptr)p);
}
static CUresult rmm_ipc_get_event_handle(uintptr_t ctx, uintptr_t e, unsigned char *out) {
	rmm_opaque64 d; CUresult r;
	if (!p_cuIpcGetEventHandle) return RMM_MISSING;
	r = use_ctx(ctx); if (r) return r;
	memset(&d, 0, sizeof d);
	r = p_cuIpcGetEventHandle(&d, (CUevent)e); if (r) return r;
	memcpy(out, d.b, sizeof d.b); return 0;
}
static rmm_res rmm_ipc_open_event_handle(uintptr_t ctx, const unsigned char *in) {
	rmm_res o = {RMM_MISSING, 0}; rmm_opaque64 d; CUevent e = 0;
	if (!p_cuIpcOpenEventHandle) return o;
	o.r = use_ctx(ctx); if (o.r) return o;
	memcpy(d.b, in, sizeof d.b);
	o.r = p_cuIpcOpenEventHandle(&e, d); o.v = (uintptr_t)e; return o;
}

// Kernel launches. The parameter array lives on the C stack; cuLaunchKernel copies the values.
// Every kernel of internal/kernels/*.cu takes (dst, src_or_pattern..., n) as below.
typedef struct { unsigned char b[RMM_PATTERN_BYTES]; } rmm_pattern;
static CUresult rmm_launch_fill(uintptr_t ctx, uintptr_t fn, unsigned int grid, unsigned int block, uintptr_t s,
		uintptr_t dst, size_t n, unsigned int period, unsigned int phase, const void *pattern, size_t patlen) {
	rmm_pattern pat; unsigned long long d = dst; size_t nn = n;
	void *params[5];
	CUresult r = use_ctx(ctx); if (r) return r;
	memset(&pat, 0, sizeof pat);
	memcpy(pat.b, pattern, patlen < sizeof pat.b ? patlen : sizeof pat.b);
	params[0] = &d; params[1] = &nn; params[2] = &period; params[3] = &phase; params[4] = &pat;
	return p_cuLaunchKernel((CUfunction)fn, grid, 1, 1, block, 1, 1, 0, (CUstream)s, params, NULL);
}
static CUresult rmm_launch_copy(uintptr_t ctx, uintptr_t fn, unsigned int grid, unsigned int block, uintptr_t s,
		uintptr_t dst, uintptr_t src, size_t n) {
	unsigned long long d = dst, sr = src; size_t nn = n;
	void *params[3];
	CUresult r = use_ctx(ctx); if (r) return r;
	params[0] = &d; params[1] = &sr; params[2] = &nn;
	return p_cuLaunchKernel((CUfunction)fn, grid, 1, 1, block, 1, 1, 0, (CUstream)s, params, NULL);
}

// Host memory for SystemMemoryResource: 256-byte aligned, outside the Go heap.
static rmm_res rmm_host_malloc(size_t n) {
	rmm_res o = {0, 0}; void *p = NULL;
	if (posix_memalign(&p, 256, n)) { o.r = 2; return o; }
	o.v = (uintptr_t)p; return o;
}
static void rmm_host_free(uintptr_t p) { free((void *)p); }
*/
import "C"

import "unsafe"

// Enabled: this build can load the CUDA driver.
const Enabled = true

// PatternBytes is the largest fill pattern LaunchFill passes by value to the fill kernels.
const PatternBytes = C.RMM_PATTERN_BYTES

// Load dlopens libcuda.so.1 and binds its symbols; "" on success, else why not.
func Load() string {
	if e := C.rmm_load(); e != nil {
		return C.GoString(e)
	}
	return ""
}

// ErrorName returns the driver's name for r (cuGetErrorName); false when the driver has none.
// Only after a successful Load.
func ErrorName(r Result) (string, bool) {
	if s := C.rmm_error_name(C.CUresult(r)); s != nil {
		return C.GoString(s), true
	}
	return "", false
}

// ErrorString returns the driver's description of r (cuGetErrorString); false when the driver
// has none. Only after a successful Load.
func ErrorString(r Result) (string, bool) {
	if s := C.rmm_error_string(C.CUresult(r)); s != nil {
		return C.GoString(s), true
	}
	return "", false
}

func Init() Result { return Result(C.rmm_init()) }

func DriverVersion() (int, Result) {
	r := C.rmm_driver_version()
	return int(r.v), Result(r.r)
}

func DeviceCount() (int, Result) {
	r := C.rmm_device_count()
	return int(r.v), Result(r.r)
}

func DeviceName(ord int) (string, Result) {
	var buf [256]C.char
	if r := C.rmm_device_name(C.int(ord), &buf[0], C.int(len(buf))); r != 0 {
		return "", Result(r)
	}
	return C.GoString(&buf[0]), 0
}

func DeviceAttribute(ord, attr int) (int, Result) {
	r := C.rmm_device_attribute(C.int(ord), C.int(attr))
	return int(int32(r.v)), Result(r.r)
}

func DeviceTotalMem(ord int) (int, Result) {
	r := C.rmm_device_total_mem(C.int(ord))
	return int(r.v), Result(r.r)
}

func PrimaryCtxRetain(ord int) (uintptr, Result) {
	r := C.rmm_primary_ctx_retain(C.int(ord))
	return uintptr(r.v), Result(r.r)
}

func CtxSynchronize(ctx uintptr) Result {
	return Result(C.rmm_ctx_synchronize(C.uintptr_t(ctx)))
}

func MemGetInfo(ctx uintptr) (free, total int, r Result) {
	o := C.rmm_mem_get_info(C.uintptr_t(ctx))
	return int(o.a), int(o.b), Result(o.r)
}

func MemAlloc(ctx uintptr, n int) (uintptr, Result) {
	r := C.rmm_mem_alloc(C.uintptr_t(ctx), C.size_t(n))
	return uintptr(r.v), Result(r.r)
}

func MemFree(ctx, p uintptr) Result {
	return Result(C.rmm_mem_free(C.uintptr_t(ctx), C.uintptr_t(p)))
}

func MemAllocManaged(ctx uintptr, n int, flags uint) (uintptr, Result) {
	r := C.rmm_mem_alloc_managed(C.uintptr_t(ctx), C.size_t(n), C.uint(flags))
	return uintptr(r.v), Result(r.r)
}

func MemHostAlloc(ctx uintptr, n int, flags uint) (uintptr, Result) {
	r := C.rmm_mem_host_alloc(C.uintptr_t(ctx), C.size_t(n), C.uint(flags))
	return uintptr(r.v), Result(r.r)
}

func MemFreeHost(ctx, p uintptr) Result {
	return Result(C.rmm_mem_free_host(C.uintptr_t(ctx), C.uintptr_t(p)))
}

func MemPoolCreate(ctx uintptr, ord, handleTypes int) (uintptr, Result) {
	r := C.rmm_mem_pool_create(C.uintptr_t(ctx), C.int(ord), C.int(handleTypes))
	return uintptr(r.v), Result(r.r)
}

func MemPoolDestroy(ctx, pool uintptr) Result {
	return Result(C.rmm_mem_pool_destroy(C.uintptr_t(ctx), C.uintptr_t(pool)))
}

func MemPoolSetAttributeU64(ctx, pool uintptr, attr int, v uint64) Result {
	return Result(C.rmm_mem_pool_set_u64(C.uintptr_t(ctx), C.uintptr_t(pool), C.int(attr), C.ulonglong(v)))
}

func MemPoolGetAttributeU64(ctx, pool uintptr, attr int) (uint64, Result) {
	r := C.rmm_mem_pool_get_u64(C.uintptr_t(ctx), C.uintptr_t(pool), C.int(attr))
	return uint64(r.v), Result(r.r)
}

func MemPoolTrimTo(ctx, pool uintptr, keep int) Result {
	return Result(C.rmm_mem_pool_trim(C.uintptr_t(ctx), C.uintptr_t(pool), C.size_t(keep)))
}

func DeviceGetDefaultMemPool(ctx uintptr, ord int) (uintptr, Result) {
	r := C.rmm_device_default_mem_pool(C.uintptr_t(ctx), C.int(ord))
	return uintptr(r.v), Result(r.r)
}

// MemGetDefaultMemPool is cuMemGetDefaultMemPool for device ord's location and allocation type
// typ; Missing when the driver lacks the symbol.
func MemGetDefaultMemPool(ctx uintptr, ord, typ int) (uintptr, Result) {
	r := C.rmm_mem_default_mem_pool(C.uintptr_t(ctx), C.int(ord), C.int(typ))
	return uintptr(r.v), Result(r.r)
}

func MemAllocFromPoolAsync(ctx uintptr, n int, pool, stream uintptr) (uintptr, Result) {
	r := C.rmm_mem_alloc_from_pool(C.uintptr_t(ctx), C.size_t(n), C.uintptr_t(pool), C.uintptr_t(stream))
	return uintptr(r.v), Result(r.r)
}

func MemFreeAsync(ctx, p, stream uintptr) Result {
	return Result(C.rmm_mem_free_async(C.uintptr_t(ctx), C.uintptr_t(p), C.uintptr_t(stream)))
}

func MemcpyAsync(ctx, dst, src uintptr, n int, stream uintptr) Result {
	return Result(C.rmm_memcpy_async(C.uintptr_t(ctx), C.uintptr_t(dst), C.uintptr_t(src), C.size_t(n), C.uintptr_t(stream)))
}

func MemcpyDtoDAsync(ctx, dst, src uintptr, n int, stream uintptr) Result {
	return Result(C.rmm_memcpy_dtod_async(C.uintptr_t(ctx), C.uintptr_t(dst), C.uintptr_t(src), C.size_t(n), C.uintptr_t(stream)))
}

// MemcpyHtoDSync copies n bytes of Go memory at src to dst on stream and waits for stream.
func MemcpyHtoDSync(ctx, dst uintptr, src unsafe.Pointer, n int, stream uintptr) Result {
	return Result(C.rmm_memcpy_htod_sync(C.uintptr_t(ctx), C.uintptr_t(dst), src, C.size_t(n), C.uintptr_t(stream)))
}

// MemcpyDtoHSync copies n bytes at src into Go memory at dst on stream and waits for stream.
func MemcpyDtoHSync(ctx uintptr, dst unsafe.Pointer, src uintptr, n int, stream uintptr) Result {
	return Result(C.rmm_memcpy_dtoh_sync(C.uintptr_t(ctx), dst, C.uintptr_t(src), C.size_t(n), C.uintptr_t(stream)))
}

func MemcpyHtoDAsyncPtr(ctx, dst, src uintptr, n int, stream uintptr) Result {
	return Result(C.rmm_memcpy_htod_async_ptr(C.uintptr_t(ctx), C.uintptr_t(dst), C.uintptr_t(src), C.size_t(n), C.uintptr_t(stream)))
}

func MemcpyDtoHAsyncPtr(ctx, dst, src uintptr, n int, stream uintptr) Result {
	return Result(C.rmm_memcpy_dtoh_async_ptr(C.uintptr_t(ctx), C.uintptr_t(dst), C.uintptr_t(src), C.size_t(n), C.uintptr_t(stream)))
}

// MemsetAsync sets n values of width 1, 2 or 4 bytes at dst to v (cuMemsetD8/D16/D32Async).
func MemsetAsync(ctx, dst uintptr, v uint32, n, width int, stream uintptr) Result {
	return Result(C.rmm_memset_async(C.uintptr_t(ctx), C.uintptr_t(dst), C.uint(v), C.size_t(n), C.int(width), C.uintptr_t(stream)))
}

func MemPrefetchAsync(ctx, p uintptr, n, locType, locID int, stream uintptr) Result {
	return Result(C.rmm_mem_prefetch(C.uintptr_t(ctx), C.uintptr_t(p), C.size_t(n), C.int(locType), C.int(locID), C.uintptr_t(stream)))
}

func MemAdvise(ctx, p uintptr, n, advice, locType, locID int) Result {
	return Result(C.rmm_mem_advise(C.uintptr_t(ctx), C.uintptr_t(p), C.size_t(n), C.int(advice), C.int(locType), C.int(locID)))
}

// PrefetchBound reports whether the loaded driver exports cuMemPrefetchAsync_v2.
func PrefetchBound() bool { return C.rmm_prefetch_bound() != 0 }

func PointerIsManaged(ctx, p uintptr) (bool, Result) {
	r := C.rmm_pointer_is_managed(C.uintptr_t(ctx), C.uintptr_t(p))
	return r.v != 0, Result(r.r)
}

func MemRangeGetAttributeInt(ctx, p uintptr, n, attr int) (int, Result) {
	r := C.rmm_mem_range_attribute_int(C.uintptr_t(ctx), C.uintptr_t(p), C.size_t(n), C.int(attr))
	return int(int32(r.v)), Result(r.r)
}

func StreamCreate(ctx uintptr, flags uint) (uintptr, Result) {
	r := C.rmm_stream_create(C.uintptr_t(ctx), C.uint(flags))
	return uintptr(r.v), Result(r.r)
}

func StreamDestroy(ctx, s uintptr) Result {
	return Result(C.rmm_stream_destroy(C.uintptr_t(ctx), C.uintptr_t(s)))
}

func StreamSynchronize(ctx, s uintptr) Result {
	return Result(C.rmm_stream_synchronize(C.uintptr_t(ctx), C.uintptr_t(s)))
}

func StreamQuery(ctx, s uintptr) Result {
	return Result(C.rmm_stream_query(C.uintptr_t(ctx), C.uintptr_t(s)))
}

func StreamWaitEvent(ctx, s, e uintptr) Result {
	return Result(C.rmm_stream_wait_event(C.uintptr_t(ctx), C.uintptr_t(s), C.uintptr_t(e)))
}

// RecordAndWait records e on from and makes to wait on it, in one cgo call.
func RecordAndWait(ctx, e, from, to uintptr) Result {
	return Result(C.rmm_record_and_wait(C.uintptr_t(ctx), C.uintptr_t(e), C.uintptr_t(from), C.uintptr_t(to)))
}

func StreamGetID(ctx, s uintptr) (uint64, Result) {
	r := C.rmm_stream_get_id(C.uintptr_t(ctx), C.uintptr_t(s))
	return uint64(r.v), Result(r.r)
}

func EventCreate(ctx uintptr, flags uint) (uintptr, Result) {
	r := C.rmm_event_create(C.uintptr_t(ctx), C.uint(flags))
	return uintptr(r.v), Result(r.r)
}

func EventRecord(ctx, e, s uintptr) Result {
	return Result(C.rmm_event_record(C.uintptr_t(ctx), C.uintptr_t(e), C.uintptr_t(s)))
}

func EventSynchronize(ctx, e uintptr) Result {
	return Result(C.rmm_event_synchronize(C.uintptr_t(ctx), C.uintptr_t(e)))
}

func EventQuery(ctx, e uintptr) Result {
	return Result(C.rmm_event_query(C.uintptr_t(ctx), C.uintptr_t(e)))
}

func EventDestroy(ctx, e uintptr) Result {
	return Result(C.rmm_event_destroy(C.uintptr_t(ctx), C.uintptr_t(e)))
}

func EventElapsedTime(ctx, a, b uintptr) (float32, Result) {
	r := C.rmm_event_elapsed(C.uintptr_t(ctx), C.uintptr_t(a), C.uintptr_t(b))
	return float32(r.ms), Result(r.r)
}

// ModuleLoadData loads PTX text (a NUL is appended here).
func ModuleLoadData(ctx uintptr, ptx string) (uintptr, Result) {
	cs := C.CString(ptx)
	defer C.free(unsafe.Pointer(cs))
	r := C.rmm_module_load(C.uintptr_t(ctx), cs)
	return uintptr(r.v), Result(r.r)
}

func ModuleGetFunction(ctx, mod uintptr, name string) (uintptr, Result) {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	r := C.rmm_module_get_function(C.uintptr_t(ctx), C.uintptr_t(mod), cs)
	return uintptr(r.v), Result(r.r)
}

// LaunchFill launches a fill kernel (dst, n, period, phase, pattern); pattern is copied, up to
// PatternBytes, into the launch's parameters.
func LaunchFill(ctx, fn uintptr, grid, block int, stream, dst uintptr, n, period, phase int, pattern []byte) Result {
	var p unsafe.Pointer
	if len(pattern) > 0 {
		p = unsafe.Pointer(&pattern[0])
	}
	return Result(C.rmm_launch_fill(C.uintptr_t(ctx), C.uintptr_t(fn), C.uint(grid), C.uint(block), C.uintptr_t(stream),
		C.uintptr_t(dst), C.size_t(n), C.uint(period), C.uint(phase), p, C.size_t(len(pattern))))
}

// LaunchCopy launches a copy kernel (dst, src, n).
func LaunchCopy(ctx, fn uintptr, grid, block int, stream, dst, src uintptr, n int) Result {
	return Result(C.rmm_launch_copy(C.uintptr_t(ctx), C.uintptr_t(fn), C.uint(grid), C.uint(block), C.uintptr_t(stream),
		C.uintptr_t(dst), C.uintptr_t(src), C.size_t(n)))
}

// VMMBound reports whether the loaded driver exports every virtual-memory function used here.
func VMMBound() bool { return C.rmm_vmm_bound() != 0 }

func MemGetAllocationGranularity(ctx uintptr, ord, option int) (int, Result) {
	r := C.rmm_mem_granularity(C.uintptr_t(ctx), C.int(ord), C.int(option))
	return int(r.v), Result(r.r)
}

func MemAddressReserve(ctx uintptr, size, align int) (uintptr, Result) {
	r := C.rmm_mem_address_reserve(C.uintptr_t(ctx), C.size_t(size), C.size_t(align))
	return uintptr(r.v), Result(r.r)
}

func MemAddressFree(ctx, p uintptr, size int) Result {
	return Result(C.rmm_mem_address_free(C.uintptr_t(ctx), C.ulonglong(p), C.size_t(size)))
}

func MemCreate(ctx uintptr, size, ord, handleTypes int) (uint64, Result) {
	r := C.rmm_mem_create(C.uintptr_t(ctx), C.size_t(size), C.int(ord), C.int(handleTypes))
	return uint64(r.v), Result(r.r)
}

func MemRelease(ctx uintptr, h uint64) Result {
	return Result(C.rmm_mem_release(C.uintptr_t(ctx), C.ulonglong(h)))
}

func MemMap(ctx, p uintptr, size int, h uint64) Result {
	return Result(C.rmm_mem_map(C.uintptr_t(ctx), C.ulonglong(p), C.size_t(size), C.ulonglong(h)))
}

func MemUnmap(ctx, p uintptr, size int) Result {
	return Result(C.rmm_mem_unmap(C.uintptr_t(ctx), C.ulonglong(p), C.size_t(size)))
}

func MemSetAccess(ctx, p uintptr, size, ord int) Result {
	return Result(C.rmm_mem_set_access(C.uintptr_t(ctx), C.ulonglong(p), C.size_t(size), C.int(ord)))
}

// HostMalloc returns n bytes of 256-byte-aligned C heap memory (posix_memalign).
func HostMalloc(n int) (uintptr, bool) {
	r := C.rmm_host_malloc(C.size_t(n))
	return uintptr(r.v), r.r == 0
}

// HostFree frees memory from HostMalloc.
func HostFree(p uintptr) { C.rmm_host_free(C.uintptr_t(p)) }

// IPCBound reports which interprocess mechanisms the loaded driver exports, as a bit set: 1
// cuIpc*MemHandle and cuMemGetAddressRange, 2 pool export, 4 VMM export, 8 cuIpc*EventHandle,
// 16 cuDeviceGetUuid.
func IPCBound() int { return int(C.rmm_ipc_bound()) }

func DeviceUUID(ord int) ([16]byte, Result) {
	var u [16]byte
	r := C.rmm_device_uuid(C.int(ord), (*C.uchar)(unsafe.Pointer(&u[0])))
	return u, Result(r)
}

func PointerInfo(ctx, p uintptr, withPool bool) (PtrInfo, Result) {
	wp := C.int(0)
	if withPool {
		wp = 1
	}
	r := C.rmm_pointer_info(C.uintptr_t(ctx), C.uintptr_t(p), wp)
	return PtrInfo{MemType: int(r.memtype), Ordinal: int(r.ordinal), LegacyIPC: r.legacy_ipc != 0, Pool: uintptr(r.pool)},
		Result(r.r)
}

func MemGetAddressRange(ctx, p uintptr) (uintptr, int, Result) {
	r := C.rmm_mem_address_range(C.uintptr_t(ctx), C.uintptr_t(p))
	return uintptr(r.a), int(r.b), Result(r.r)
}

func MemPoolExportFD(ctx, pool uintptr) (int, Result) {
	r := C.rmm_mem_pool_export_fd(C.uintptr_t(ctx), C.uintptr_t(pool))
	return int(int32(r.v)), Result(r.r)
}

func MemPoolImportFD(ctx uintptr, fd int) (uintptr, Result) {
	r := C.rmm_mem_pool_import_fd(C.uintptr_t(ctx), C.int(fd))
	return uintptr(r.v), Result(r.r)
}

func MemPoolExportPointer(ctx, p uintptr) ([64]byte, Result) {
	var d [64]byte
	r := C.rmm_mem_pool_export_pointer(C.uintptr_t(ctx), C.uintptr_t(p), (*C.uchar)(unsafe.Pointer(&d[0])))
	return d, Result(r)
}

func MemPoolImportPointer(ctx, pool uintptr, data *[64]byte) (uintptr, Result) {
	r := C.rmm_mem_pool_import_pointer(C.uintptr_t(ctx), C.uintptr_t(pool), (*C.uchar)(unsafe.Pointer(&data[0])))
	return uintptr(r.v), Result(r.r)
}

func MemExportFD(ctx uintptr, h uint64) (int, Result) {
	r := C.rmm_mem_export_fd(C.uintptr_t(ctx), C.ulonglong(h))
	return int(int32(r.v)), Result(r.r)
}

func MemImportFD(ctx uintptr, fd int) (uint64, Result) {
	r := C.rmm_mem_import_fd(C.uintptr_t(ctx), C.int(fd))
	return uint64(r.v), Result(r.r)
}

func IpcGetMemHandle(ctx, p uintptr) ([64]byte, Result) {
	var d [64]byte
	r := C.rmm_ipc_get_mem_handle(C.uintptr_t(ctx), C.uintptr_t(p), (*C.uchar)(unsafe.Pointer(&d[0])))
	return d, Result(r)
}

func IpcOpenMemHandle(ctx uintptr, data *[64]byte) (uintptr, Result) {
	r := C.rmm_ipc_open_mem_handle(C.uintptr_t(ctx), (*C.uchar)(unsafe.Pointer(&data[0])))
	return uintptr(r.v), Result(r.r)
}

func IpcCloseMemHandle(ctx, p uintptr) Result {
	return Result(C.rmm_ipc_close_mem_handle(C.uintptr_t(ctx), C.uintptr_t(p)))
}

func IpcGetEventHandle(ctx, e uintptr) ([64]byte, Result) {
	var d [64]byte
	r := C.rmm_ipc_get_event_handle(C.uintptr_t(ctx), C.uintptr_t(e), (*C.uchar)(unsafe.Pointer(&d[0])))
	return d, Result(r)
}

func IpcOpenEventHandle(ctx uintptr, data *[64]byte) (uintptr, Result) {
	r := C.rmm_ipc_open_event_handle(C.uintptr_t(ctx), (*C.uchar)(unsafe.Pointer(&data[0])))
	return uintptr(r.v), Result(r.r)
}
