//go:build cgo

// Command rmm-torch-allocator is a shared library that makes a Go memory resource PyTorch's CUDA
// allocator, through torch.cuda.memory.CUDAPluggableAllocator: every tensor PyTorch allocates on
// a device then comes from that device's resource (rmm.PerDeviceResource; a stitching pool
// after rmm_torch_reinitialize), the pool any Go code in the process shares. Build it with
//
//	go build -buildmode=c-shared -o librmm_torch.so ./cmd/rmm-torch-allocator
//
// and see README.md beside this file for its use from Python. Its C functions:
//
//	void *rmm_torch_alloc(size_t size, int device, cudaStream_t stream);
//	void  rmm_torch_free(void *ptr, size_t size, int device, cudaStream_t stream);
//	const char *rmm_torch_last_error(void);
//	int   rmm_torch_reinitialize(int pool, size_t initial_pool_size, size_t maximum_pool_size, int statistics);
//	int   rmm_torch_statistics(int device, long long out[6]);
//	int   rmm_torch_pool_stats(int device, long long out[4]);
//	int   rmm_torch_check_pool(int device);
//
// alloc and free are PyTorch's signatures (package callocator says what they do on failure:
// NULL, and a message for rmm_torch_last_error on the same thread). reinitialize sets up device
// 0 as rmm.Reinitialize does (pool 0: no pool; 1: the default pool, a stitching pool where the
// driver's virtual memory management is available, rmm.StitchingPool; 2: rmm.ExpandablePool; 3:
// rmm.PlainPool, librmm's; another value is an error; the sizes 0 meaning the defaults) and,
// with statistics != 0, counts its allocations; it returns 0, or -1 with the message. statistics
// writes the current, peak and total bytes and counts (rmm.Statistics: CurrentBytes,
// CurrentCount, PeakBytes, PeakCount, TotalBytes, TotalCount) of the device's statistics
// adaptor; pool_stats the pool size, peak pool size, live bytes and live allocations of the
// PoolMemoryResource under the device's resource; both return 0, or -1 when there is none.
// check_pool runs that pool's CheckInvariants (every block accounted for, free neighbours
// coalesced, the figures consistent): 0, or -1 with what is wrong.
package main

/*
#include <stddef.h>
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

//export rmm_torch_alloc
func rmm_torch_alloc(size C.size_t, device C.int, stream unsafe.Pointer) unsafe.Pointer {
	return callocator.Allocate(nil, uintptr(size), int(device), uintptr(stream))
}

//export rmm_torch_free
func rmm_torch_free(ptr unsafe.Pointer, size C.size_t, device C.int, stream unsafe.Pointer) {
	callocator.Deallocate(nil, ptr, uintptr(size), int(device), uintptr(stream))
}

//export rmm_torch_last_error
func rmm_torch_last_error() *C.char { return (*C.char)(callocator.LastError()) }

//export rmm_torch_reinitialize
func rmm_torch_reinitialize(pool C.int, initial, maximum C.size_t, statistics C.int) C.int {
	// The sizes go to Reinitialize as given, which refuses them without a pool.
	o := &rmm.ReinitializeOptions{PoolAllocator: pool != 0, InitialPoolSize: int(initial), MaximumPoolSize: int(maximum)}
	if pool != 0 {
		k, err := torchPoolKind(int(pool))
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

//export rmm_torch_statistics
func rmm_torch_statistics(device C.int, out *C.longlong) C.int {
	mr, err := rmm.PerDeviceResource(rmm.Device(device))
	if err != nil {
		callocator.SetError(errshape.Errorf("rmm_torch_statistics: %w", err))
		return -1
	}
	st, ok := mr.(*rmm.StatisticsResourceAdaptor)
	if !ok {
		callocator.SetError(errshape.Errorf("rmm_torch_statistics: device %d's resource counts nothing (a %s; rmm_torch_reinitialize with statistics != 0 makes one that does): %w", int(device), strings.TrimPrefix(fmt.Sprintf("%T", mr), "*rmm."), rmm.ErrNotSupported))
		return -1
	}
	s := st.Stats()
	fill(out, s.CurrentBytes, s.CurrentCount, s.PeakBytes, s.PeakCount, s.TotalBytes, s.TotalCount)
	return 0
}

//export rmm_torch_pool_stats
func rmm_torch_pool_stats(device C.int, out *C.longlong) C.int {
	p, err := poolOf(int(device), "rmm_torch_pool_stats")
	if err != nil {
		callocator.SetError(err)
		return -1
	}
	st := p.Stats()
	fill(out, int64(st.PoolSize), int64(st.PeakPoolSize), int64(st.LiveBytes), int64(st.LiveAllocations))
	return 0
}

//export rmm_torch_check_pool
func rmm_torch_check_pool(device C.int) C.int {
	p, err := poolOf(int(device), "rmm_torch_check_pool")
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

// torchPoolKind is the pool kind rmm_torch_reinitialize's pool argument names: 1 the default
// (stitching), 2 expandable, 3 plain.
func torchPoolKind(pool int) (rmm.PoolKind, error) {
	switch pool {
	case 1:
		return rmm.StitchingPool, nil
	case 2:
		return rmm.ExpandablePool, nil
	case 3:
		return rmm.PlainPool, nil
	}
	return 0, errshape.Errorf("rmm_torch_reinitialize: pool %d: want 0 (none), 1 (the default, stitching), 2 (expandable) or 3 (plain): %w", pool, rmm.ErrInvalidArgument)
}
