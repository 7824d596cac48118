// Fill kernels for gormm/rmm. Compiled to PTX by gen.sh; the PTX is committed and embedded.
//
// Every fill kernel has the same parameters, so one launcher serves all of them:
//   dst     destination address
//   n       count of units written (16-byte vectors for rmm_fill_v16, bytes for rmm_fill_bytes)
//   period  length of the repeating pattern in bytes (1..256)
//   phase   offset into the pattern of the first byte written (0..period-1)
//   pat     the pattern, by value (its first `period` bytes are used)

#include <stdint.h>

struct Pattern {
    unsigned char b[256];
};

// rmm_fill_v16 writes n 16-byte vectors at dst, which must be 16-byte aligned, with 16-byte stores.
// Byte j of the output (counting from dst) is pat.b[(phase + j) % period].
extern "C" __global__ void rmm_fill_v16(uint4 *dst, size_t n, unsigned int period, unsigned int phase, Pattern pat)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    if (16 % period == 0) {
        // The pattern divides 16 bytes: every vector is the same.
        union { unsigned char b[16]; uint4 v; } u;
        for (int k = 0; k < 16; k++) u.b[k] = pat.b[(phase + k) % period];
        uint4 v = u.v;
        for (; i < n; i += stride) dst[i] = v;
        return;
    }
    // General period: window of 16 bytes starting at any pattern offset, from shared memory.
    __shared__ unsigned char sh[256 + 16];
    for (unsigned int k = threadIdx.x; k < period + 16; k += blockDim.x) sh[k] = pat.b[k % period];
    __syncthreads();
    if (i >= n) return;
    unsigned int start = (unsigned int)((phase + (i % period) * 16) % period);
    unsigned int delta = (unsigned int)(((stride % period) * 16) % period);
    for (; i < n; i += stride) {
        union { unsigned char b[16]; uint4 v; } u;
#pragma unroll
        for (int k = 0; k < 16; k++) u.b[k] = sh[start + k];
        dst[i] = u.v;
        start += delta;
        if (start >= period) start -= period;
    }
}

// rmm_fill_bytes writes n bytes at dst (any alignment): byte j is pat.b[(phase + j) % period].
// Used for the unaligned head and tail around rmm_fill_v16.
extern "C" __global__ void rmm_fill_bytes(unsigned char *dst, size_t n, unsigned int period, unsigned int phase, Pattern pat)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dst[i] = pat.b[(phase + i) % period];
    }
}
