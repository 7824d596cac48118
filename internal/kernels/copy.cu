// Copy kernels for gormm/rmm. Compiled to PTX by gen.sh; the PTX is committed and embedded.
//
// Both take (dst, src, n); n counts 16-byte vectors for rmm_copy_v16 and bytes for
// rmm_copy_bytes. Source and destination must not overlap.

#include <stdint.h>

// rmm_copy_v16 copies n 16-byte vectors; dst and src must be 16-byte aligned. Each thread moves
// four vectors per iteration so that four loads are in flight before the stores.
extern "C" __global__ void rmm_copy_v16(uint4 *__restrict__ dst, const uint4 *__restrict__ src, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = src[i];
        uint4 b = src[i + stride];
        uint4 c = src[i + 2 * stride];
        uint4 d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
}

// rmm_copy_bytes copies n bytes, any alignment.
extern "C" __global__ void rmm_copy_bytes(unsigned char *__restrict__ dst, const unsigned char *__restrict__ src, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}
