// The Hadamard rotation of rows of D values (attention/hadamard_cuda.h): a fast Walsh-Hadamard
// transform in registers (attention/hadamard.cuh), one warp per row.
#include <cuda_bf16.h>
#include "attention/hadamard.cuh"
#include "attention/hadamard_cuda.h"
#include "layers/common.h"
#include "layers/cuda_args.h"
#include "layers/cuda_check.h"

#define ROWS_PER_BLOCK 8   // one warp per row

// A row's values as fp32 and back: bf16 rounds to nearest even, fp32 is kept as is.
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ void store_f32(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_f32(float *p, float v) { *p = v; }

// x (rows, 32·E) of bf16 or fp32, in place; one warp per row.
template <typename T, int E>
__global__ void hadamard_kernel(T *x, size_t rows, float norm) {
    size_t row = (size_t)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= rows) return;
    T *p = x + row * (32 * E) + (threadIdx.x % 32) * E;
    float v[E];
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = to_f32(p[j]);
    walsh_hadamard<E>(v, norm);
#pragma unroll
    for (int j = 0; j < E; j++) store_f32(p + j, v[j]);
}

// Checks shared by both entry points; blocks = number of thread blocks.
static int check_rotate_args(const char *fn, const void *x, size_t rows, int D, unsigned *blocks, char *err) {
    if (D != 32 && D != 64 && D != 128) {
        dit_set_error(err, "%s: D=%d: head dim must be 32, 64 or 128", fn, D);
        return -1;
    }
    CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(x, 16));
    size_t n_blocks = (rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
    if (n_blocks > 2147483647u) {
        dit_set_error(err, "%s: rows=%zu: more than 2^31 - 1 blocks of %d rows", fn, rows, ROWS_PER_BLOCK);
        return -1;
    }
    *blocks = (unsigned)n_blocks;
    return 0;
}

// The rotation of rows of D = 32·E values of type T (after check_rotate_args).
template <typename T>
static int launch_rotation(T *x, size_t rows, int D, unsigned blocks, cudaStream_t stream, char *err) {
    if (rows == 0) return 0;
    float norm = 1.0f / sqrtf((float)D);   // as the CPU's hadamard_rotate
    if (D == 128) hadamard_kernel<T, 4><<<blocks, 32 * ROWS_PER_BLOCK, 0, stream>>>(x, rows, norm);
    else if (D == 64) hadamard_kernel<T, 2><<<blocks, 32 * ROWS_PER_BLOCK, 0, stream>>>(x, rows, norm);
    else hadamard_kernel<T, 1><<<blocks, 32 * ROWS_PER_BLOCK, 0, stream>>>(x, rows, norm);
    LAUNCH_CHECK(err, "hadamard_kernel", "rows=%zu D=%d, %zu-byte values", rows, D, sizeof(T));
    return 0;
}

extern "C" int hadamard_rotate_bf16_cuda(uint16_t *x, size_t rows, int D, cudaStream_t stream, char *err) {
    unsigned blocks;
    if (check_rotate_args("hadamard_rotate_bf16_cuda", x, rows, D, &blocks, err)) return -1;
    return launch_rotation((__nv_bfloat16 *)x, rows, D, blocks, stream, err);
}

extern "C" int hadamard_rotate_f32_cuda(float *x, size_t rows, int D, cudaStream_t stream, char *err) {
    unsigned blocks;
    if (check_rotate_args("hadamard_rotate_f32_cuda", x, rows, D, &blocks, err)) return -1;
    return launch_rotation(x, rows, D, blocks, stream, err);
}
