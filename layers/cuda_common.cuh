// Device helpers shared by the layers' kernels: grid sizes and fixed-order reductions.
#pragma once
#include <cuda_bf16.h>
#include "layers/layers_cuda.h"
#include "layers/cuda_check.h"

#define BLOCK_SIZE 256

static inline unsigned int blocks_for(size_t n, int block_size) {
    return (unsigned int)((n + block_size - 1) / block_size);
}

// Sum over the 32 lanes of a warp by xor butterfly: every lane gets the same, order-fixed sum.
__device__ inline float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Column reductions use blocks of (COL_TILE, ROW_LANES) threads: thread (x, y) owns column
// tile·COL_TILE + x and visits rows y, y + ROW_LANES, ...; then the ROW_LANES partial sums of a
// column are added in the order y = 0, 1, ... (deterministic, no atomics).
#define COL_TILE 32
#define ROW_LANES 8

// Returns, in the threads with threadIdx.y == 0, the sum of v over threadIdx.y. `partial` is a
// __shared__ [ROW_LANES][COL_TILE] array of the calling kernel; every thread must call this.
__device__ inline float sum_over_row_lanes(float v, float (*partial)[COL_TILE]) {
    partial[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    float sum = 0.0f;
    if (threadIdx.y == 0)
        for (int i = 0; i < ROW_LANES; i++) sum += partial[i][threadIdx.x];
    __syncthreads();   // `partial` may be reused right after
    return sum;
}

// Sum of v over a block of BLOCK_SIZE threads (warp sums, then warp 0 adds them in order);
// valid in thread 0.
__device__ inline float block_sum(float v) {
    __shared__ float warp_sums[BLOCK_SIZE / 32];
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
    __syncthreads();
    float sum = 0.0f;
    if (threadIdx.x == 0)
        for (int i = 0; i < BLOCK_SIZE / 32; i++) sum += warp_sums[i];
    return sum;
}
