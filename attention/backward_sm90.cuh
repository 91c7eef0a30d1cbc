// Pieces shared by the Hopper (sm_90a) recompute backwards, sage_backward_sm90.cu and
// flash_backward_sm90.cu. Both run one CTA of two warpgroups per (128-key block, head), stream
// 64-query blocks through shared-memory stages, form dV and dK from register A fragments and add
// dQ through a shared-memory fp32 tile with a TMA reduce-add; they differ only in how Sᵀ is formed
// (int8 K̂·Q̂ᵀ × scales vs bf16 K·Qᵀ) and in which K tile dQ uses (k - k_mean vs k).
// Moved here unchanged from sage_backward_sm90.cu (tma_map_dq gained its `what` argument; sage's
// device code is byte-identical), plus store_dq_tile_folded (flash only, for now).
#pragma once
#include "attention/attention_backward.cuh"
#include "attention/wgmma.cuh"
#include "layers/common.h"

#define BWD90_THREADS 256   // two warpgroups
#define BWD90_KEYS 128      // keys per CTA, 64 per warpgroup
#define BWD90_QUERIES 64    // queries per step (= SAGE_CUDA_BLOCK: one q_scale per step)

// dq as a 3-D fp32 tensor map (D, N, BH) with boxes of 32 columns × 64 rows of one head, for the
// TMA reduce-add (rows >= N of a box are dropped). `what` names the kernel in the error message.
static inline int tma_map_dq(CUtensorMap *map, const float *dq, int D, int N, int BH, const char *what, char *err) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tma_map_encoder(err);
    if (!encode) return -1;
    cuuint64_t dims[3] = {(cuuint64_t)D, (cuuint64_t)N, (cuuint64_t)BH};
    cuuint64_t strides[2] = {(cuuint64_t)D * 4, (cuuint64_t)N * D * 4};
    cuuint32_t box[3] = {32, BWD90_QUERIES, 1}, elem_strides[3] = {1, 1, 1};
    CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, (void *)dq, dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        dit_set_error(err, "cuTensorMapEncodeTiled(%s: %d x %d x %d fp32) failed (%d)", what, D, N, BH, (int)r);
        return -1;
    }
    return 0;
}

#ifdef SAGE_SM90_DEVICE
// Thread tid < 128: lse (tid < 64) or delta of query qb·64 + tid % 64 of head bh (0 past N).
__device__ __forceinline__ float load_query_stat(const AttnBwdArgs &a, int bh, int qb, int tid) {
    int q = qb * BWD90_QUERIES + tid % BWD90_QUERIES;
    const float *src = tid < BWD90_QUERIES ? a.lse : a.delta;
    return q < a.N ? src[(size_t)bh * a.N + q] : 0.0f;
}

// d += a·B for one k16 step of dV or dK (m64nDk16, B MN-major with 64-column atoms 8 KB apart).
template <int D>
__device__ __forceinline__ void dkv_wgmma(float (&d)[D / 2], const uint32_t a[4], uint64_t desc_b) {
    if constexpr (D == 128) wgmma_bf16_m64n128k16_rs<1, 1>(d, a, desc_b);
    else wgmma_bf16_m64n64k16_rs<1, 1>(d, a, desc_b);
}

// dq·scale (this warpgroup's D/2 columns, m64n(D/2) accumulator layout) into the shared-memory
// dQ tile: box b = columns 32b..32b+31, 64 rows of 128 bytes, 128-byte swizzled as the TMA reads it.
template <int D>
__device__ __forceinline__ void store_dq_tile(uint8_t *tile, int wg, const float (&dq)[D / 4], float scale) {
    int warp = (threadIdx.x % 128) / 32, g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = 16 * warp + g + 8 * h;
#pragma unroll
        for (int j = 0; j < D / 16; j++) {
            int col = wg * (D / 2) + 8 * j + 2 * c;
            uint32_t off = (col / 32) * (BWD90_QUERIES * 128) + swizzle_offset<128>(row * 128 + (col % 32) * 4);
            *(float2 *)(tile + off) = make_float2(dq[4 * j + 2 * h] * scale, dq[4 * j + 2 * h + 1] * scale);
        }
    }
}

// store_dq_tile with the swizzle folded into one per-thread base, for register-tight kernels (flash
// at D = 128): the same addresses, 4 per-thread offsets instead of 16. Row 16·warp + g + 8h has
// row % 8 = g; column 8j + 2c of the warpgroup's half is box wg·D/64 + j/4, byte 32(j % 4) + 8c of
// the row, i.e. 16-byte chunk 2(j % 4) + c/2 (XOR g) and byte 8(c % 2) in it: XOR-ing 32(j % 4)
// into the base (which holds chunk c/2 XOR g) gives the swizzled chunk.
template <int D>
__device__ __forceinline__ void store_dq_tile_folded(uint8_t *tile, int wg, const float (&dq)[D / 4], float scale) {
    int warp = (threadIdx.x % 128) / 32, g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
    uint32_t base = wg * (D / 64) * (BWD90_QUERIES * 128) + (16 * warp + g) * 128 + ((c / 2) ^ g) * 16 + 8 * (c % 2);
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < D / 16; j++) {
            uint32_t off = (base ^ (32 * (j % 4))) + 1024 * h + (j / 4) * (BWD90_QUERIES * 128);
            *(float2 *)(tile + off) = make_float2(dq[4 * j + 2 * h] * scale, dq[4 * j + 2 * h + 1] * scale);
        }
}

// global (fp32) += the box at smem, at columns x.., rows y.. of head z; completes in a bulk group.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap *map, const void *smem, int x, int y, int z) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                 ::"l"(map), "r"(smem_addr(smem)), "r"(x), "r"(y), "r"(z) : "memory");
}
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until this thread's bulk groups are complete (their writes performed).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// d (=|+=) A·B for one k16 step of dQ (m64n(D/2)k16, A and B MN-major).
template <int D, int scale_d>
__device__ __forceinline__ void dq_wgmma(float (&d)[D / 4], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (D == 128) wgmma_bf16_m64n64k16_ss<scale_d, 1, 1>(d, desc_a, desc_b);
    else wgmma_bf16_m64n32k16_ss<scale_d, 1, 1>(d, desc_a, desc_b);
}
#endif
