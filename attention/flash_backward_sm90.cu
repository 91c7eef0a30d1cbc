// BF16 flash attention recompute backward for Hopper (sm_90a): wgmma tensor-core instructions fed
// by TMA. Same math as flash_backward.cu (the readable mma.sync kernel, attention_backward.cuh
// with SCORES_BF16); the structure of sage's Hopper backward (sage_backward_sm90.cu) with Sᵀ from
// the bf16 K and Q and dQ from K itself. With c = log2(e)/sqrt(D) (lse in base 2):
//
// One CTA of two warpgroups per (128-key block, head); warpgroup w owns keys 64w..64w+63. Thread 0
// loads K and V of the CTA once (TMA) and streams the 64-query blocks (Q, dO) through two
// shared-memory stages, each completing on its mbarrier; lse and delta of a block (64 floats each)
// go into the same stage by the first 128 threads, one block ahead. Per query block, in each
// warpgroup (m64 = its 64 keys, TRANSPOSED tiles so that Pᵀ and dSᵀ feed the next products from
// registers):
//   Sᵀ  = K·Qᵀ          wgmma bf16 m64n64k16, K and Q rows K-major        } one batch
//   dPᵀ = V·dOᵀ         wgmma bf16 m64n64k16, V and dO rows K-major       }
//   Pᵀ  = exp2(Sᵀ·c - lse), dSᵀ = Pᵀ∘(dPᵀ - delta)   (keys or queries >= N: 0)
//   dV += bf16(Pᵀ)·dO   wgmma m64nDk16, A from registers, dO rows as MN-major B
//   dK += bf16(dSᵀ)·Q   likewise
//   dSᵀ -> shared memory (bf16, swizzled), barrier over both warpgroups, then
//   dQ[:, w·D/2..] = dS·K over all 128 keys   wgmma m64n(D/2)k16, dSᵀ and K MN-major in shared
//        memory; scaled by 1/sqrt(D) into a shared-memory fp32 tile, which thread 0 adds to dq with
//        one TMA reduce-add per 32 columns (rows past N dropped), overlapping the next step.
// Deterministic dQ (flash_backward_set_deterministic): thread 0 waits for the turn of block qb
// before it issues the reduce of block qb, and hands the turn on once the reduce is complete, as
// in sage_backward_sm90.cu. At the end dV and dK/sqrt(D) are stored (rows < N).
//
// K's layout serves both of its products: 2 boxes of 128 keys × D/2 columns (rows of D bytes,
// D-byte swizzle: 128 B at D = 128, 64 B at D = 64). Sᵀ reads it K-major (k16 step kk = bytes
// 32·kk.. of a key's row: box 32kk / D, +32kk % D inside it); dQ reads box w MN-major (n = D/2
// columns = one swizzle atom wide). Q, dO, V: boxes of 64 columns (128-byte rows), as the forward.
#include <limits.h>
#include "attention/flash_cuda.h"
#include "attention/backward_sm90.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

// Shared memory of one CTA (after aligning its start to 1024 bytes).
template <int D> struct FlashBwd90Smem {
    static constexpr int K = 0;                                     // K: 2 boxes of 128 keys × D/2 bf16
    static constexpr int V = K + BWD90_KEYS * D * 2;                // V: D/64 boxes of 128 keys × 64 bf16
    static constexpr int DS = V + BWD90_KEYS * D * 2;               // dSᵀ: 128 keys × 64 queries bf16
    static constexpr int DQ = DS + BWD90_KEYS * BWD90_QUERIES * 2;  // dQ: D/32 boxes of 64 queries × 32 fp32
    static constexpr int STAGE0 = DQ + BWD90_QUERIES * D * 4;
    // one stage: Q | dO (D/64 boxes of 64 queries × 64 bf16) by the TMA, then lse | delta (64 fp32
    // each) by the threads
    static constexpr int Q = 0, DO = Q + BWD90_QUERIES * D * 2;
    static constexpr int STAGE_TX = DO + BWD90_QUERIES * D * 2;    // bytes the TMA brings per stage
    static constexpr int LSE = STAGE_TX, DELTA = LSE + BWD90_QUERIES * 4;
    static constexpr int STAGE_BYTES = (DELTA + BWD90_QUERIES * 4 + 1023) / 1024 * 1024;
    static constexpr int TOTAL = 1024 + STAGE0 + 2 * STAGE_BYTES;   // + alignment slack
};

// k: bf16 rows as bytes (2D inner, B·H·N outer), box D bytes × 128 rows (D-byte swizzle);
// v, q, dout: the same, box 128 bytes × 128 (v) or × 64 rows; dq: fp32 (D, N, B·H), box 32 × 64 × 1.
typedef struct {
    CUtensorMap k, v, q, dout, dq;
} FlashBwd90Maps;

#ifdef SAGE_SM90_DEVICE
// Thread 0: Q and dO of query block qb of head bh into the stage at st, completing on bar.
template <int D>
__device__ __forceinline__ void load_flash_query_stage(uint8_t *st, uint64_t *bar, const FlashBwd90Maps &m, int bh,
                                                       int N, int qb) {
    using S = FlashBwd90Smem<D>;
    int row = bh * N + qb * BWD90_QUERIES;
    mbar_expect_bytes(bar, S::STAGE_TX);
    for (int b = 0; b < D / 64; b++) {
        tma_load_2d(st + S::Q + b * BWD90_QUERIES * 128, &m.q, bar, 128 * b, row);
        tma_load_2d(st + S::DO + b * BWD90_QUERIES * 128, &m.dout, bar, 128 * b, row);
    }
}
#endif

// Grid (ceil(N/128), B·H), BWD90_THREADS threads, FlashBwd90Smem<D>::TOTAL bytes of dynamic shared
// memory. a: from attention_backward_prepare (delta computed, dq and the dQ turns zeroed), N.
template <int D>
__global__ void __launch_bounds__(BWD90_THREADS, 1)
    flash_backward_sm90_kernel(const __grid_constant__ FlashBwd90Maps maps, AttnBwdArgs a) {
#ifdef SAGE_SM90_DEVICE
    using S = FlashBwd90Smem<D>;
    constexpr int HALF = D / 2;
    extern __shared__ uint8_t smem_raw[];
    __shared__ uint64_t bar_kv, bar_q[2];
    uint8_t *sm = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    const int N = a.N, nqb = (N + BWD90_QUERIES - 1) / BWD90_QUERIES;
    const int kb = blockIdx.x, bh = blockIdx.y, k0 = kb * BWD90_KEYS, tid = threadIdx.x;
    const int wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const size_t head = (size_t)bh * N * D;
    int *turn = a.dq_turn ? a.dq_turn + (size_t)bh * nqb : NULL;   // this head's dQ turns, or NULL

    if (tid == 0) {
        mbar_init(&bar_kv, 1);
        mbar_init(&bar_q[0], 1);
        mbar_init(&bar_q[1], 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0) {
        mbar_expect_bytes(&bar_kv, BWD90_KEYS * D * 4);
        for (int b = 0; b < 2; b++)
            tma_load_2d(sm + S::K + b * BWD90_KEYS * D, &maps.k, &bar_kv, D * b, bh * N + k0);
        for (int b = 0; b < D / 64; b++)
            tma_load_2d(sm + S::V + b * BWD90_KEYS * 128, &maps.v, &bar_kv, 128 * b, bh * N + k0);
        for (int s = 0; s < 2 && s < nqb; s++)
            load_flash_query_stage<D>(sm + S::STAGE0 + s * S::STAGE_BYTES, &bar_q[s], maps, bh, N, s);
    }
    if (tid < 2 * BWD90_QUERIES)   // lse | delta of block 0 (adjacent in the stage)
        ((float *)(sm + S::STAGE0 + S::LSE))[tid] = load_query_stat(a, bh, 0, tid);
    __syncthreads();

    const int kr = 64 * wg + 16 * warp + g;   // CTA key rows kr and kr + 8 of this thread
    const bool key_valid[2] = {k0 + kr < N, k0 + kr + 8 < N};
    const uint32_t ds_row = kr * 128 + 16 * g + 4 * c;   // dSᵀ of row kr, queries 2c.., chunk 0 swizzled
    const float inv_sqrt_d = 1.0f / sqrtf((float)D), c_log2 = 1.44269504f / sqrtf((float)D);
    float dv[HALF] = {}, dk[HALF] = {};   // m64nD accumulators: keys × D
    mbar_wait(&bar_kv, 0);

    for (int qb = 0; qb < nqb; qb++) {
        const int stage = qb & 1, q0 = qb * BWD90_QUERIES;
        uint8_t *st = sm + S::STAGE0 + stage * S::STAGE_BYTES;
        float next_stat = 0.0f;   // lse or delta of block qb + 1, stored into the other stage below
        if (tid < 2 * BWD90_QUERIES && qb + 1 < nqb) next_stat = load_query_stat(a, bh, qb + 1, tid);
        int seen_turn = turn && tid == 0 ? ld_acquire_gpu(turn + qb) : 0;   // checked at the end of the step
        mbar_wait(&bar_q[stage], (qb >> 1) & 1);

        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (64 keys × 64 queries each), one batch; k16 step kk of the
        // 128-byte-row tiles (Q, dO, V) is in box kk/4 at +32 bytes per step inside its rows
        float s[32], dp[32];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint64_t da = smem_desc<D>(sm + S::K + (32 * kk / D) * BWD90_KEYS * D + 64 * wg * D + (32 * kk) % D);
            uint64_t db = smem_desc<128>(st + S::Q + (kk / 4) * BWD90_QUERIES * 128 + (kk % 4) * 32);
            if (kk == 0) wgmma_bf16_m64n64k16_ss<0, 0, 0>(s, da, db);
            else wgmma_bf16_m64n64k16_ss<1, 0, 0>(s, da, db);
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint64_t da = smem_desc<128>(sm + S::V + (kk / 4) * BWD90_KEYS * 128 + 64 * wg * 128 + (kk % 4) * 32);
            uint64_t db = smem_desc<128>(st + S::DO + (kk / 4) * BWD90_QUERIES * 128 + (kk % 4) * 32);
            if (kk == 0) wgmma_bf16_m64n64k16_ss<0, 0, 0>(dp, da, db);
            else wgmma_bf16_m64n64k16_ss<1, 0, 0>(dp, da, db);
        }
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(s);
        reg_fence(dp);

        // Pᵀ (in s) and dSᵀ (in dp); this thread holds keys kr (e < 2), kr + 8 and queries
        // 8j + 2c + (e & 1)
        const float *s_lse = (const float *)(st + S::LSE), *s_delta = (const float *)(st + S::DELTA);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int q = 8 * j + 2 * c;
            float2 lse = *(const float2 *)(s_lse + q), delta = *(const float2 *)(s_delta + q);
            const bool query_valid[2] = {q0 + q < N, q0 + q + 1 < N};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = fmaf(s[4 * j + e], c_log2, -(e & 1 ? lse.y : lse.x));
                s[4 * j + e] = key_valid[e / 2] && query_valid[e & 1] ? exp2f(x) : 0.0f;
                dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - (e & 1 ? delta.y : delta.x));
            }
        }
        // bf16 A fragments, k16 step t = queries 16t..16t+15 (accumulator columns 2t, 2t+1); dSᵀ
        // also to shared memory (rows = keys, 64 queries = 128 bytes), the MN-major A of dQ.
        // swizzle_offset<128> of byte 2·(16t + 8(i/2) + 2c) of row kr + 8(i & 1), whose row % 8 = g:
        // 16-byte chunk 2t + i/2 XOR g, written as ds_row XOR the chunk (8 offsets, not 16)
        uint32_t pa[4][4], dsa[4][4];
#pragma unroll
        for (int t = 0; t < 4; t++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                pa[t][i] = pack_bf162(s[8 * t + 2 * i], s[8 * t + 2 * i + 1]);
                dsa[t][i] = pack_bf162(dp[8 * t + 2 * i], dp[8 * t + 2 * i + 1]);
                *(uint32_t *)(sm + S::DS + (ds_row ^ (32 * t + 16 * (i / 2))) + 1024 * (i & 1)) = dsa[t][i];
            }
        fence_proxy_async();
        if (tid < 2 * BWD90_QUERIES && qb + 1 < nqb)   // the other stage's statistics were last read in step qb - 1
            ((float *)(sm + S::STAGE0 + (stage ^ 1) * S::STAGE_BYTES + S::LSE))[tid] = next_stat;

        // dV += Pᵀ·dO and dK += dSᵀ·Q: dO and Q rows are MN-major B (16 queries = 2 groups of 8 rows)
        wgmma_fence();
#pragma unroll
        for (int t = 0; t < 4; t++) {
            dkv_wgmma<D>(dv, pa[t], smem_desc_mn<128>(st + S::DO + t * 2048, BWD90_QUERIES * 128));
            dkv_wgmma<D>(dk, dsa[t], smem_desc_mn<128>(st + S::Q + t * 2048, BWD90_QUERIES * 128));
        }
        wgmma_commit();
        if (tid == 0 && qb > 0) {   // the reduce of block qb - 1 is complete: the dQ tile is free
            bulk_wait_all();
            if (turn) hand_on_dq_turn(turn + qb - 1);
        }
        __syncthreads();   // (A) dSᵀ of both warpgroups (and the next block's lse, delta) in shared memory

        // dQ[:, wg·D/2 ..] = dS·K over the 128 keys, 16 keys per k-step
        float dq[D / 4];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BWD90_KEYS / 16; ks++) {
            uint64_t desc_a = smem_desc_mn<128>(sm + S::DS + ks * 2048, BWD90_QUERIES * 128);
            uint64_t desc_b = smem_desc_mn<D>(sm + S::K + wg * BWD90_KEYS * D + ks * 16 * D, BWD90_KEYS * D);
            if (ks == 0) dq_wgmma<D, 0>(dq, desc_a, desc_b);
            else dq_wgmma<D, 1>(dq, desc_a, desc_b);
        }
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(dv);
        reg_fence(dk);
        reg_fence(dq);
#pragma unroll
        for (int t = 0; t < 4; t++) {
            reg_fence(pa[t]);
            reg_fence(dsa[t]);
        }
        store_dq_tile_folded<D>(sm + S::DQ, wg, dq, inv_sqrt_d);
        fence_proxy_async();
        if (turn && tid == 0) wait_dq_turn(turn + qb, kb, seen_turn);
        __syncthreads();   // (B) both warpgroups are done with this stage and with dSᵀ; dQ tile complete
        if (tid == 0) {
            if (turn) fence_proxy_async_global();   // the acquired turn before the async-proxy reduce
            for (int b = 0; b < D / 32; b++) tma_reduce_add_3d(&maps.dq, sm + S::DQ + b * BWD90_QUERIES * 128, 32 * b, q0, bh);
            bulk_commit();
            if (qb + 2 < nqb) load_flash_query_stage<D>(st, &bar_q[stage], maps, bh, N, qb + 2);
        }
    }
    if (tid == 0) {
        bulk_wait_all();
        if (turn) hand_on_dq_turn(turn + nqb - 1);
    }

#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (!key_valid[h]) continue;
        size_t at = head + (size_t)(k0 + kr + 8 * h) * D + 2 * c;
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            *(float2 *)(a.dv + at + 8 * j) = make_float2(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
            *(float2 *)(a.dk + at + 8 * j) = make_float2(dk[4 * j + 2 * h] * inv_sqrt_d, dk[4 * j + 2 * h + 1] * inv_sqrt_d);
        }
    }
#else
    __trap();   // built without sm_90a code: flash_backward_sm90_available() says 0
#endif
}

extern "C" int flash_backward_sm90_available(void) {
    return sm90_kernel_available((const void *)flash_backward_sm90_kernel<128>);
}

// Tensor maps over a's q, k, v, dout and dq, then the kernel on B·H = BH heads.
template <int D>
static int launch_flash_backward_sm90(const AttnBwdArgs &a, int BH, cudaStream_t stream, char *err) {
    int N = a.N;
    uint64_t rows = (uint64_t)BH * N;
    FlashBwd90Maps m;
    if (tma_map_2d_bytes(&m.k, a.k, 2 * D, rows, D, BWD90_KEYS, "flash_backward_sm90 k", err) ||
        tma_map_2d_bytes(&m.v, a.v, 2 * D, rows, 128, BWD90_KEYS, "flash_backward_sm90 v", err) ||
        tma_map_2d_bytes(&m.q, a.q, 2 * D, rows, 128, BWD90_QUERIES, "flash_backward_sm90 q", err) ||
        tma_map_2d_bytes(&m.dout, a.dout, 2 * D, rows, 128, BWD90_QUERIES, "flash_backward_sm90 dout", err) ||
        tma_map_dq(&m.dq, a.dq, D, N, BH, "flash_backward_sm90 dq", err))
        return -1;
    int bytes = FlashBwd90Smem<D>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(flash_backward_sm90_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         bytes),
                    err, "cudaFuncSetAttribute(flash_backward_sm90_kernel max dynamic smem)");
    dim3 grid((N + BWD90_KEYS - 1) / BWD90_KEYS, BH);
    flash_backward_sm90_kernel<D><<<grid, BWD90_THREADS, bytes, stream>>>(m, a);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch flash_backward_sm90_kernel");
    return 0;
}

extern "C" int flash_backward_sm90_cuda(float *dq, float *dk, float *dv, void *workspace, const uint16_t *dout,
                                        const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                                        const float *lse, int B, int H, int N, int D, cudaStream_t stream, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535 ||
        (long long)B * H * N > INT_MAX) {
        dit_set_error(err, "flash_backward_sm90_cuda: need D in {64, 128}, B, H, N >= 1, B·H <= 65535 and "
                           "B·H·N < 2^31 (got B=%d H=%d N=%d D=%d)", B, H, N, D);
        return -1;
    }
    CHECK_DEVICE_ARGS("flash_backward_sm90_cuda", err, DEVICE_ARG(dq, 16), DEVICE_ARG(dk, 16), DEVICE_ARG(dv, 16),
                      DEVICE_ARG(workspace, 4), DEVICE_ARG(dout, 16), DEVICE_ARG(q, 16), DEVICE_ARG(k, 16),
                      DEVICE_ARG(v, 16), DEVICE_ARG(out, 16), DEVICE_ARG(lse, 4));
    if (!flash_backward_sm90_available()) {
        dit_set_error(err, "flash_backward_sm90_cuda: needs a compute capability 9.0 device and a build with "
                           "sm_90a code (-gencode=arch=compute_90a,code=sm_90a)");
        return -1;
    }
    AttnBwdArgs a = {dq, dk, dv, (const __nv_bfloat16 *)dout, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k,
                     (const __nv_bfloat16 *)v, lse, NULL, {}, N, NULL};
    if (attention_backward_prepare(&a, workspace, out, B * H, D, flash_backward_deterministic(), stream, err) != 0)
        return -1;
    if (D == 64) return launch_flash_backward_sm90<64>(a, B * H, stream, err);
    return launch_flash_backward_sm90<128>(a, B * H, stream, err);
}
