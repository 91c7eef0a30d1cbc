// The Hadamard rotation of rows of D values (attention/hadamard_cuda.h): a fast Walsh-Hadamard
// transform in registers (attention/hadamard.cuh), D/8 lanes per row, 8 values per lane.
#include <cuda_bf16.h>
#include "attention/hadamard.cuh"
#include "attention/hadamard_cuda.h"
#include "layers/common.h"
#include "layers/cuda_args.h"
#include "layers/cuda_check.h"
#include "layers/cuda_common.cuh"

static_assert(HADAMARD_VALUES_PER_LANE == VEC, "a lane's values are one bf16 vector of cuda_common.cuh");

#define ROWS_PER_BLOCK_128 16   // 256 threads: rows of D = 128 take 16 lanes (D = 64: 32 rows, D = 32: 64)

// x (rows, D) of bf16 or fp32, in place; D/8 lanes per row, 256 threads per block.
template <typename T, int D>
__global__ void hadamard_kernel(T *x, size_t rows, float norm) {
    constexpr int L = D / HADAMARD_VALUES_PER_LANE;
    size_t row = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / L;
    const bool valid = row < rows;   // whole warps: the transform's shuffles need all 32 lanes
    T *p = x + (valid ? row : 0) * D + (threadIdx.x % L) * HADAMARD_VALUES_PER_LANE;
    float v[HADAMARD_VALUES_PER_LANE];
    if constexpr (sizeof(T) == 2) load_bf16x8(v, p, VEC, true);
    else load_f32x8(v, p);
    walsh_hadamard<D>(v, norm);
    if (!valid) return;
    if constexpr (sizeof(T) == 2) store_bf16x8(p, v, VEC, true);
    else store_f32x8(p, v);
}

// Checks shared by both entry points; blocks = number of thread blocks.
static int check_rotate_args(const char *fn, const void *x, size_t rows, int D, unsigned *blocks, char *err) {
    if (D != 32 && D != 64 && D != 128) {
        dit_set_error(err, "%s: D=%d: head dim must be 32, 64 or 128", fn, D);
        return -1;
    }
    CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(x, 16));
    size_t rows_per_block = ROWS_PER_BLOCK_128 * 128 / D, n_blocks = (rows + rows_per_block - 1) / rows_per_block;
    if (n_blocks > 2147483647u) {
        dit_set_error(err, "%s: rows=%zu: more than 2^31 - 1 blocks of %zu rows", fn, rows, rows_per_block);
        return -1;
    }
    *blocks = (unsigned)n_blocks;
    return 0;
}

// The rotation of rows of D values of type T (after check_rotate_args).
template <typename T>
static int launch_rotation(T *x, size_t rows, int D, unsigned blocks, cudaStream_t stream, char *err) {
    if (rows == 0) return 0;
    float norm = 1.0f / sqrtf((float)D);   // as the CPU's hadamard_rotate
    if (D == 128) hadamard_kernel<T, 128><<<blocks, 256, 0, stream>>>(x, rows, norm);
    else if (D == 64) hadamard_kernel<T, 64><<<blocks, 256, 0, stream>>>(x, rows, norm);
    else hadamard_kernel<T, 32><<<blocks, 256, 0, stream>>>(x, rows, norm);
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
