// BF16 flash attention forward for Hopper (sm_90a): wgmma tensor-core instructions fed by TMA.
// The same math as flash_forward.cu (the readable mma.sync FlashAttention-2 kernel); it exists
// because on Hopper mma.sync reaches about half of the bf16 tensor rate and only wgmma the rest.
//
// One CTA = one warpgroup (128 threads) per (64-query block, head); two CTAs share an SM (D = 128)
// and overlap each other's softmax with their tensor-core work. Thread 0 drives the TMA unit:
// Q once, then K and V tiles of 64 keys through FLASH90_STAGES shared-memory stages, each
// completing on its own mbarrier. Rows are D bf16 = D/64 boxes of 64 elements (128 bytes, the
// 128-byte swizzle). Per key block kb, with c = log2(e)/sqrt(D) (everything in base 2):
//   S = Q·Kᵀ                 wgmma bf16 m64n64k16, Q and K K-major in shared memory, fp32
//   m' = max(m, rowmax S·c), alpha = exp2(m - m'), P = exp2(S·c - m'), l = l·alpha + ΣP
//   O = O·alpha + bf16(P)·V  wgmma m64nDk16, P from registers (the S accumulators are the A
//                            fragments), V as the MN-major B operand (its rows are keys)
// then thread 0 refills the stage with key block kb + FLASH90_STAGES. Keys >= N (the tail block:
// the next head's rows or TMA's zeros) get S = -inf. Finally out = O/l and lse = m + log2(l).
#include <limits.h>
#include <math.h>
#include "attention/flash_cuda.h"
#include "attention/attention_rows.cuh"
#include "attention/sage_mma.cuh"
#include "attention/wgmma.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

#define FLASH90_THREADS 128   // one warpgroup: 64 query rows
#define FLASH90_BLOCK 64      // queries per CTA, keys per step
#define FLASH90_STAGES 2      // K/V tiles in flight
#define BOX_BYTES (FLASH90_BLOCK * 128)   // one TMA box: 64 rows × 64 bf16

// Shared memory of one CTA: Q, then the K and V tiles of each stage, each D/64 boxes.
template <int D> struct Flash90Smem {
    static constexpr int TILE_BYTES = D / 64 * BOX_BYTES;   // 64 rows × D bf16
    static constexpr int STAGE_BYTES = 2 * TILE_BYTES;      // K | V
    static constexpr int TOTAL = 1024 + TILE_BYTES + FLASH90_STAGES * STAGE_BYTES;   // + alignment slack
};

#ifdef SAGE_SM90_DEVICE
// Thread 0: the D/64 boxes of 64 rows starting at `row` into `tile`, counted on bar.
template <int D>
__device__ __forceinline__ void load_tile(uint8_t *tile, const CUtensorMap *map, uint64_t *bar, int row) {
#pragma unroll
    for (int b = 0; b < D / 64; b++) tma_load_2d(tile + b * BOX_BYTES, map, bar, 128 * b, row);
}

// o (+)= a·V for one k16 step of 16 keys; V's rows (keys) start at desc_v. D/2 accumulators.
template <int D>
__device__ __forceinline__ void pv_wgmma(float (&o)[D / 2], const uint32_t a[4], uint64_t desc_v) {
    if constexpr (D == 128) wgmma_bf16_m64n128k16_rs<1, 1>(o, a, desc_v);
    else wgmma_bf16_m64n64k16_rs<1, 1>(o, a, desc_v);
}

// Online softmax of one 64 × 64 block, in place: s (raw Q·Kᵀ, accumulator layout: this thread
// holds keys 8j + 2c + (e & 1) of rows g (e < 2) and g + 8 (e >= 2) in s[4j + e]) becomes P, and
// alpha, m, l of the thread's two rows are updated (l is this thread's partial row sum). `valid`:
// keys of the block below N.
__device__ __forceinline__ void online_softmax(float (&s)[32], float (&alpha)[2], float (&m)[2], float (&l)[2],
                                               float c_log2, int valid, int c) {
    if (valid < FLASH90_BLOCK) {
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (8 * (i / 4) + 2 * c + (i & 1) >= valid) s[i] = -INFINITY;
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = m[r];
#pragma unroll
        for (int j = 0; j < 8; j++) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]) * c_log2);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        alpha[r] = exp2f(m[r] - mx);
        m[r] = mx;
        l[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < 32; i++) {
        s[i] = exp2f(fmaf(s[i], c_log2, -m[(i % 4) / 2]));
        l[(i % 4) / 2] += s[i];
    }
}
#endif

// map_q, map_k, map_v: q, k, v as bytes (2D inner, B·H·N outer), box 128 bytes × 64 rows.
// Grid (ceil(N/64), B·H), FLASH90_THREADS threads, Flash90Smem<D>::TOTAL bytes.
template <int D>
__global__ void __launch_bounds__(FLASH90_THREADS, 2)
    flash_forward_sm90_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                              const __grid_constant__ CUtensorMap map_v, __nv_bfloat16 *out, float *lse, int N,
                              int merged_heads) {
#ifdef SAGE_SM90_DEVICE
    using S = Flash90Smem<D>;
    extern __shared__ uint8_t smem_raw[];
    __shared__ uint64_t bar_q, bar_kv[FLASH90_STAGES];
    uint8_t *sQ = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t *sKV = sQ + S::TILE_BYTES;   // stage s: K at sKV + s·STAGE_BYTES, V TILE_BYTES after it
    int bh = blockIdx.y, qb = blockIdx.x, tid = threadIdx.x;
    int warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const int nkb = (N + FLASH90_BLOCK - 1) / FLASH90_BLOCK;
    const float c_log2 = 1.44269504f / sqrtf((float)D);

    if (tid == 0) {
        mbar_init(&bar_q, 1);
        for (int s = 0; s < FLASH90_STAGES; s++) mbar_init(&bar_kv[s], 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0) {
        mbar_expect_bytes(&bar_q, S::TILE_BYTES);
        load_tile<D>(sQ, &map_q, &bar_q, bh * N + qb * FLASH90_BLOCK);
        for (int s = 0; s < FLASH90_STAGES && s < nkb; s++) {
            mbar_expect_bytes(&bar_kv[s], S::STAGE_BYTES);
            load_tile<D>(sKV + s * S::STAGE_BYTES, &map_k, &bar_kv[s], bh * N + s * FLASH90_BLOCK);
            load_tile<D>(sKV + s * S::STAGE_BYTES + S::TILE_BYTES, &map_v, &bar_kv[s], bh * N + s * FLASH90_BLOCK);
        }
    }

    float o[D / 2] = {};   // accumulator layout of m64nD (wgmma.cuh)
    float s[32];           // accumulator layout of m64n64
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};   // rows g and g + 8 of this warp
    mbar_wait(&bar_q, 0);

    for (int kb = 0; kb < nkb; kb++) {
        int stage = kb % FLASH90_STAGES;
        uint8_t *sK = sKV + stage * S::STAGE_BYTES, *sV = sK + S::TILE_BYTES;
        mbar_wait(&bar_kv[stage], (kb / FLASH90_STAGES) & 1);

        // S = Q·Kᵀ: 64 × 64, D/16 steps of k16 (4 per 128-byte box, +32 bytes each)
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            int off = (ks / 4) * BOX_BYTES + (ks % 4) * 32;
            if (ks == 0) wgmma_bf16_m64n64k16_ss<0, 0, 0>(s, smem_desc<128>(sQ + off), smem_desc<128>(sK + off));
            else wgmma_bf16_m64n64k16_ss<1, 0, 0>(s, smem_desc<128>(sQ + off), smem_desc<128>(sK + off));
        }
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(s);

        float alpha[2];
        online_softmax(s, alpha, m, l, c_log2, N - kb * FLASH90_BLOCK, c);
#pragma unroll
        for (int i = 0; i < D / 2; i++) o[i] *= alpha[(i % 4) / 2];
        uint32_t a[4][4];   // bf16(P) as four k16 A fragments (keys 16t..16t+15)
#pragma unroll
        for (int t = 0; t < 4; t++)
#pragma unroll
            for (int h = 0; h < 4; h++) a[t][h] = pack_bf162(s[8 * t + 2 * h], s[8 * t + 2 * h + 1]);

        // O += bf16(P)·V: 4 steps of 16 keys (+2 groups of 8 key rows = 2048 bytes each); the
        // boxes of 64 channels are LBO = BOX_BYTES apart
        wgmma_fence();
#pragma unroll
        for (int t = 0; t < 4; t++) pv_wgmma<D>(o, a[t], smem_desc_mn<128>(sV + t * 2048, BOX_BYTES));
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(o);
#pragma unroll
        for (int t = 0; t < 4; t++) reg_fence(a[t]);
        if (tid == 0 && kb + FLASH90_STAGES < nkb) {   // the stage is free: both wgmma batches completed
            int row = bh * N + (kb + FLASH90_STAGES) * FLASH90_BLOCK;
            mbar_expect_bytes(&bar_kv[stage], S::STAGE_BYTES);
            load_tile<D>(sK, &map_k, &bar_kv[stage], row);
            load_tile<D>(sV, &map_v, &bar_kv[stage], row);
        }
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        int row = qb * FLASH90_BLOCK + warp * 16 + g + 8 * r;
        if (row >= N) continue;
        float inv_l = 1.0f / l[r];
        __nv_bfloat16 *orow = out + attn_row_offset(bh, row, N, D, merged_heads) + 2 * c;
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            *(__nv_bfloat162 *)(orow + 8 * j) = __floats2bfloat162_rn(o[4 * j + 2 * r] * inv_l,
                                                                      o[4 * j + 2 * r + 1] * inv_l);
        if (c == 0) lse[(size_t)bh * N + row] = m[r] + log2f(l[r]);
    }
#endif
}

extern "C" int flash_forward_sm90_available(void) {
    return sm90_kernel_available((const void *)flash_forward_sm90_kernel<128>);
}

template <int D>
static int launch_sm90(uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k, const uint16_t *v, int BH,
                       int N, int merged_heads, cudaStream_t stream, char *err) {
    uint64_t rows = (uint64_t)BH * N;
    CUtensorMap map_q, map_k, map_v;
    if (tma_map_2d_bytes(&map_q, q, 2 * D, rows, 128, FLASH90_BLOCK, "flash_forward_sm90 q", err) ||
        tma_map_2d_bytes(&map_k, k, 2 * D, rows, 128, FLASH90_BLOCK, "flash_forward_sm90 k", err) ||
        tma_map_2d_bytes(&map_v, v, 2 * D, rows, 128, FLASH90_BLOCK, "flash_forward_sm90 v", err))
        return -1;
    int bytes = Flash90Smem<D>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(flash_forward_sm90_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         bytes),
                    err, "cudaFuncSetAttribute(flash_forward_sm90_kernel max dynamic smem)");
    dim3 grid((N + FLASH90_BLOCK - 1) / FLASH90_BLOCK, BH);
    flash_forward_sm90_kernel<D><<<grid, FLASH90_THREADS, bytes, stream>>>(map_q, map_k, map_v,
                                                                            (__nv_bfloat16 *)out, lse, N,
                                                                            merged_heads);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch flash_forward_sm90_kernel");
    return 0;
}

int flash_forward_sm90_rows(uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                            int B, int H, int N, int D, int merged_heads, cudaStream_t stream, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535 ||
        (long long)B * H * N > INT_MAX) {
        dit_set_error(err, "flash_forward_sm90_cuda: need D in {64, 128}, B, H, N >= 1, B·H <= 65535 and "
                           "B·H·N < 2^31 (got B=%d H=%d N=%d D=%d)", B, H, N, D);
        return -1;
    }
    CHECK_DEVICE_ARGS("flash_forward_sm90_cuda", err, DEVICE_ARG(out, 16), DEVICE_ARG(lse, 4), DEVICE_ARG(q, 16),
                      DEVICE_ARG(k, 16), DEVICE_ARG(v, 16));
    if (!flash_forward_sm90_available()) {
        dit_set_error(err, "flash_forward_sm90_cuda: needs a compute capability 9.0 device and a build with "
                           "sm_90a code (-gencode=arch=compute_90a,code=sm_90a)");
        return -1;
    }
    if (D == 64) return launch_sm90<64>(out, lse, q, k, v, B * H, N, merged_heads, stream, err);
    return launch_sm90<128>(out, lse, q, k, v, B * H, N, merged_heads, stream, err);
}

extern "C" int flash_forward_sm90_cuda(uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k,
                                       const uint16_t *v, int B, int H, int N, int D, cudaStream_t stream,
                                       char *err) {
    return flash_forward_sm90_rows(out, lse, q, k, v, B, H, N, D, 0, stream, err);
}
