//go:build cgo

// Command rmm-python is a shared library that puts the Go memory resource of each device
// (rmm.PerDeviceResource; a stitching pool after rmm_reinitialize) under Python's GPU
// libraries: PyTorch, through torch.cuda.memory.CUDAPluggableAllocator, and CuPy, through
// cupy.cuda.set_allocator and the Python package gormm_rmm (python/ at the repository's root),
// which wraps this library with ctypes. Build it with
//
//	go build -buildmode=c-shared -o librmm_go.so ./cmd/rmm-python
//
// (pip install ./python does it for the package) and see README.md beside this file. Its C
// functions:
//
//	void *rmm_alloc(size_t size, int device, cudaStream_t stream);
//	void *rmm_torch_alloc(size_t size, int device, cudaStream_t stream);
//	void  rmm_free(void *ptr, size_t size, int device, cudaStream_t stream);
//	const char *rmm_last_error(void);
//	int   rmm_reinitialize(int pool, size_t initial_pool_size, size_t maximum_pool_size, int statistics);
//	int   rmm_statistics(int device, long long out[6]);
//	int   rmm_pool_stats(int device, long long out[RMM_POOL_STATS_LEN]);
//	int   rmm_pool_stats_len(void);
//	int   rmm_check_pool(int device);
//
// alloc and free are PyTorch's signatures (package callocator says what they do on failure:
// NULL, and a message for rmm_last_error on the same thread; a request of 0 bytes returns NULL
// without asking the resource, and a free of NULL does nothing). rmm_torch_alloc is rmm_alloc for
// PyTorch (torch_alloc.cpp): where rmm_alloc would return NULL for a request of at least a byte it
// throws a C++ std::bad_alloc whose what() is that message, since PyTorch takes a NULL as the
// allocation. reinitialize sets up device 0 as
// rmm.Reinitialize does (pool 0: no pool; 1: the default pool, a stitching pool where the
// driver's virtual memory management is available, rmm.StitchingPool; 2: rmm.ExpandablePool; 3:
// rmm.PlainPool, librmm's; another value is an error; the sizes 0 meaning the defaults) and,
// with statistics != 0, counts its allocations; it returns 0, or -1 with the message. statistics
// writes the current, peak and total bytes and counts (rmm.Statistics: CurrentBytes,
// CurrentCount, PeakBytes, PeakCount, TotalBytes, TotalCount) of the device's statistics
// adaptor. pool_stats writes RMM_POOL_STATS_LEN (17; rmm_pool_stats_len returns it) values of
// the PoolMemoryResource under the device's resource, in this order: the pool size, peak pool
// size, live bytes, live allocations (rmm.PoolStats), the pool's kind (1 stitching, 2
// expandable, 3 plain: the numbers reinitialize takes), the driver calls of rmm.PoolStats.VMM:
// creates, maps, unmaps, releases and stitched ranges made; then the maximum pool size and the
// free bytes (rmm.PoolStats), cuMemSetAccess calls, address reservations, the address space
// reserved in bytes, and the stitched ranges kept and evicted (the VMM figures all 0 for a plain
// pool). The array must hold that many; later versions may only append. Both return 0, or -1
// when there is none. check_pool runs that pool's CheckInvariants (every block accounted for,
// free neighbours coalesced, the figures consistent): 0, or -1 with what is wrong.
package main

/*
#include <stddef.h>

// The number of values rmm_pool_stats writes.
#define RMM_POOL_STATS_LEN 17

// rmm_alloc for PyTorch, in torch_alloc.cpp (C++): declared here so that the generated header
// declares it too, with C linkage for C++ callers.
#ifdef __cplusplus
extern "C" {
#endif
void *rmm_torch_alloc(size_t size, int device, void *stream);
#ifdef __cplusplus
}
#endif
*/
import "C"

import (
	"fmt"
	"strings"
	"unsafe"

	rmm "github.com/gormm/rmm"
	"github.com/gormm/rmm/callocator"
	"github.com/gormm/rmm/internal/errshape"
)

//export rmm_alloc
func rmm_alloc(size C.size_t, device C.int, stream unsafe.Pointer) unsafe.Pointer {
	return callocator.Allocate(nil, uintptr(size), int(device), uintptr(stream))
}

//export rmm_free
func rmm_free(ptr unsafe.Pointer, size C.size_t, device C.int, stream unsafe.Pointer) {
	callocator.Deallocate(nil, ptr, uintptr(size), int(device), uintptr(stream))
}

//export rmm_last_error
func rmm_last_error() *C.char { return (*C.char)(callocator.LastError()) }

//export rmm_reinitialize
func rmm_reinitialize(pool C.int, initial, maximum C.size_t, statistics C.int) C.int {
	// The sizes go to Reinitialize as given, which refuses them without a pool.
	o := &rmm.ReinitializeOptions{PoolAllocator: pool != 0, InitialPoolSize: int(initial), MaximumPoolSize: int(maximum)}
	if pool != 0 {
		k, err := poolKind(int(pool))
		if err != nil {
			callocator.SetError(err)
			return -1
		}
		o.Pool = k
	}
	if err := rmm.Reinitialize(o); err != nil {
		callocator.SetError(err)
		return -1
	}
	if statistics != 0 {
		mr, err := rmm.PerDeviceResource(0)
		var st *rmm.StatisticsResourceAdaptor
		if err == nil {
			st, err = rmm.NewStatisticsResourceAdaptor(mr)
		}
		if err == nil {
			_, err = rmm.SetPerDeviceResource(0, st)
		}
		if err != nil {
			callocator.SetError(err)
			return -1
		}
	}
	return 0
}

//export rmm_statistics
func rmm_statistics(device C.int, out *C.longlong) C.int {
	mr, err := rmm.PerDeviceResource(rmm.Device(device))
	if err != nil {
		callocator.SetError(errshape.Errorf("rmm_statistics: %w", err))
		return -1
	}
	st, ok := mr.(*rmm.StatisticsResourceAdaptor)
	if !ok {
		callocator.SetError(errshape.Errorf("rmm_statistics: device %d's resource counts nothing (a %s; rmm_reinitialize with statistics != 0 makes one that does): %w", int(device), strings.TrimPrefix(fmt.Sprintf("%T", mr), "*rmm."), rmm.ErrNotSupported))
		return -1
	}
	s := st.Stats()
	fill(out, s.CurrentBytes, s.CurrentCount, s.PeakBytes, s.PeakCount, s.TotalBytes, s.TotalCount)
	return 0
}

//export rmm_pool_stats_len
func rmm_pool_stats_len() C.int { return C.RMM_POOL_STATS_LEN }

//export rmm_pool_stats
func rmm_pool_stats(device C.int, out *C.longlong) C.int {
	p, err := poolOf(int(device), "rmm_pool_stats")
	if err != nil {
		callocator.SetError(err)
		return -1
	}
	fill(out, poolStatsRow(p.Kind(), p.Stats())...)
	return 0
}

// poolStatsRow is what rmm_pool_stats writes, in the order the package comment gives.
func poolStatsRow(k rmm.PoolKind, st rmm.PoolStats) []int64 {
	row := []int64{int64(st.PoolSize), int64(st.PeakPoolSize), int64(st.LiveBytes), int64(st.LiveAllocations),
		int64(poolNumber(k)), int64(st.VMM.Creates), int64(st.VMM.Maps), int64(st.VMM.Unmaps), int64(st.VMM.Releases),
		int64(st.VMM.StitchedRanges),
		int64(st.MaximumPoolSize), int64(st.FreeBytes), int64(st.VMM.SetAccess), int64(st.VMM.Reserves),
		int64(st.VMM.AddressReserved), int64(st.VMM.StitchedKept), int64(st.VMM.StitchedEvicted)}
	if len(row) != C.RMM_POOL_STATS_LEN {
		panic("rmm_pool_stats: the row and RMM_POOL_STATS_LEN disagree")
	}
	return row
}

//export rmm_check_pool
func rmm_check_pool(device C.int) C.int {
	p, err := poolOf(int(device), "rmm_check_pool")
	if err == nil {
		err = p.CheckInvariants()
	}
	if err != nil {
		callocator.SetError(err)
		return -1
	}
	return 0
}

// poolOf finds the PoolMemoryResource under device's resource.
func poolOf(device int, op string) (*rmm.PoolMemoryResource, error) {
	mr, err := rmm.PerDeviceResource(rmm.Device(device))
	if err != nil {
		return nil, errshape.Errorf("%s: %w", op, err)
	}
	for {
		if p, ok := mr.(*rmm.PoolMemoryResource); ok {
			return p, nil
		}
		u, ok := mr.(rmm.Upstreamer)
		if !ok {
			return nil, errshape.Errorf("%s: no pool under device %d's resource: %w", op, device, rmm.ErrNotSupported)
		}
		mr = u.Upstream()
	}
}

func fill(out *C.longlong, v ...int64) {
	dst := unsafe.Slice(out, len(v))
	for i, x := range v {
		dst[i] = C.longlong(x)
	}
}

func main() {}

// poolKind is the pool kind rmm_reinitialize's pool argument names: 1 the default (stitching),
// 2 expandable, 3 plain.
func poolKind(pool int) (rmm.PoolKind, error) {
	for _, k := range []rmm.PoolKind{rmm.StitchingPool, rmm.ExpandablePool, rmm.PlainPool} {
		if poolNumber(k) == pool {
			return k, nil
		}
	}
	return 0, errshape.Errorf("rmm_reinitialize: pool %d: want 0 (none), 1 (the default, stitching), 2 (expandable) or 3 (plain): %w", pool, rmm.ErrInvalidArgument)
}

// poolNumber is the number that names k in rmm_reinitialize and rmm_pool_stats: 1 stitching, 2
// expandable, 3 plain; 0 for a kind this library does not know.
func poolNumber(k rmm.PoolKind) int {
	switch k {
	case rmm.StitchingPool:
		return 1
	case rmm.ExpandablePool:
		return 2
	case rmm.PlainPool:
		return 3
	}
	return 0
}
