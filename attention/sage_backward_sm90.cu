// Sage attention recompute backward for Hopper (sm_90a): wgmma tensor-core instructions fed by TMA.
// Same math as the mma.sync backward (attention_backward.cuh with SCORES_SAGE, the readable
// version): Sᵀ from the forward's int8 Q̂, K̂ and scales, products in bf16 with fp32 accumulation.
//
// One CTA of two warpgroups per (128-key block, head); warpgroup w owns keys 64w..64w+63 (one
// k_scale block) and keeps K̂ and V of the CTA in shared memory (TMA, once) with k - k_mean in bf16
// (written by the threads). Thread 0 streams the 64-query blocks (Q̂, Q, dO) through two
// shared-memory stages, each completing on its mbarrier; lse and delta of the block (64 floats each,
// at any offset: the TMA wants 16-byte aligned boxes) go through the same stage by the first 128
// threads, one block ahead. Per query block, in each warpgroup
// (m64 = its 64 keys, TRANSPOSED tiles so that Pᵀ and dSᵀ feed the next products from registers):
//   Sᵀ  = K̂·Q̂ᵀ         wgmma s8 m64n64k32 (both K-major, as the quantization pass stores them)
//   dPᵀ = V·dOᵀ         wgmma bf16 m64n64k16 (V and dO rows are K-major), same batch as Sᵀ
//   Pᵀ  = exp2(rn((float)Sᵀ·q_scale·k_scale) - lse), dSᵀ = Pᵀ∘(dPᵀ - delta)   (keys/queries >= N: 0)
//   dV += bf16(Pᵀ)·dO   wgmma m64nDk16, A from registers, dO rows as MN-major B
//   dK += bf16(dSᵀ)·Q   likewise
//   dSᵀ -> shared memory (bf16, swizzled), barrier over both warpgroups, then
//   dQ[:, w·D/2..] = dS·(k - k_mean) over all 128 keys   wgmma m64n(D/2)k16, both operands
//        MN-major in shared memory; scaled by 1/sqrt(D) into a shared-memory fp32 tile, which
//        thread 0 adds to dq with one TMA reduce-add per 32 columns (cp.reduce.async.bulk.tensor,
//        a 3-D map (D, N, B·H) that drops the rows past N), overlapping the next step.
// Deterministic dQ (attention_backward.cuh): thread 0 waits for the turn of block qb before it
// issues the reduce of block qb (end of step qb), and hands the turn on once the reduce is
// complete (before barrier A of step qb + 1, which also frees the tile for rewriting).
// At the end dV and dK/sqrt(D) are stored (rows < N). The shared memory tiles use the 128-byte
// swizzle (64-byte for the D = 64 int8 rows and the D = 64 k - k_mean boxes), see wgmma.cuh.
#include "attention/sage_cuda.h"
#include "attention/backward_sm90.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

// Shared memory of one CTA (after aligning its start to 1024 bytes). bf16 tiles of D = 128 are
// boxes of 64 columns (128-byte rows).
template <int D> struct Bwd90Smem {
    static constexpr int K8 = 0;                                  // K̂: 128 keys × D int8
    static constexpr int V = K8 + BWD90_KEYS * D;                 // V: D/64 boxes of 128 keys × 64 bf16
    static constexpr int KS = V + BWD90_KEYS * D * 2;             // k - k_mean: 2 boxes of 128 keys × D/2 bf16
    static constexpr int DS = KS + BWD90_KEYS * D * 2;            // dSᵀ: 128 keys × 64 queries bf16
    static constexpr int DQ = DS + BWD90_KEYS * BWD90_QUERIES * 2;  // dQ: D/32 boxes of 64 queries × 32 fp32
    static constexpr int STAGE0 = DQ + BWD90_QUERIES * D * 4;
    // one stage: Q̂ (64 × D int8) | Q | dO (D/64 boxes of 64 queries × 64 bf16) by the TMA, then
    // lse | delta (64 fp32 each) by the threads
    static constexpr int Q8 = 0, Q = BWD90_QUERIES * D, DO = Q + BWD90_QUERIES * D * 2;
    static constexpr int STAGE_TX = DO + BWD90_QUERIES * D * 2;   // bytes the TMA brings per stage
    static constexpr int LSE = STAGE_TX, DELTA = LSE + BWD90_QUERIES * 4;
    static constexpr int STAGE_BYTES = (DELTA + BWD90_QUERIES * 4 + 1023) / 1024 * 1024;
    static constexpr int TOTAL = 1024 + STAGE0 + 2 * STAGE_BYTES;   // + alignment slack
};

// k8, q8: int8 (D inner, B·H·N outer), boxes D × 128 and D × 64; v, q, dout: bf16 rows as bytes
// (2D inner, B·H·N outer), boxes 128 bytes × 128 (v) or × 64.
// dq: fp32 (D, N, B·H), box 32 × 64 × 1 (128-byte swizzle), for the TMA reduce-add.
typedef struct {
    CUtensorMap k8, v, q8, q, dout, dq;
} Bwd90Maps;

#ifdef SAGE_SM90_DEVICE
// Thread 0: query block qb of head bh into the stage at st, completing on bar.
template <int D>
__device__ __forceinline__ void load_query_stage(uint8_t *st, uint64_t *bar, const Bwd90Maps &m, int bh, int N, int qb) {
    using S = Bwd90Smem<D>;
    int row = bh * N + qb * BWD90_QUERIES;
    mbar_expect_bytes(bar, S::STAGE_TX);
    tma_load_2d(st + S::Q8, &m.q8, bar, 0, row);
    for (int b = 0; b < D / 64; b++) {
        tma_load_2d(st + S::Q + b * BWD90_QUERIES * 128, &m.q, bar, 128 * b, row);
        tma_load_2d(st + S::DO + b * BWD90_QUERIES * 128, &m.dout, bar, 128 * b, row);
    }
}
#endif

// Grid (ceil(N/128), B·H), BWD90_THREADS threads, Bwd90Smem<D>::TOTAL bytes of dynamic shared
// memory. a: from attention_backward_prepare (dq and the dQ turns zeroed), k (bf16, for k - k_mean),
// the forward's scales and k_mean, N.
template <int D>
__global__ void __launch_bounds__(BWD90_THREADS, 1)
    sage_backward_sm90_kernel(const __grid_constant__ Bwd90Maps maps, AttnBwdArgs a) {
#ifdef SAGE_SM90_DEVICE
    using S = Bwd90Smem<D>;
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
        mbar_expect_bytes(&bar_kv, BWD90_KEYS * D * 3);
        tma_load_2d(sm + S::K8, &maps.k8, &bar_kv, 0, bh * N + k0);
        for (int b = 0; b < D / 64; b++)
            tma_load_2d(sm + S::V + b * BWD90_KEYS * 128, &maps.v, &bar_kv, 128 * b, bh * N + k0);
        for (int s = 0; s < 2 && s < nqb; s++)
            load_query_stage<D>(sm + S::STAGE0 + s * S::STAGE_BYTES, &bar_q[s], maps, bh, N, s);
    }
    // k - k_mean in bf16 (zero rows past N), as the mma.sync path: box b holds columns b·D/2.. of
    // the 128 keys in rows of D bytes, swizzled as wgmma reads MN-major B.
    const float *mean = a.qv.k_mean + (size_t)bh * D;
    for (int i = tid; i < BWD90_KEYS * D / 8; i += BWD90_THREADS) {
        int r = i / (D / 8), col = (i % (D / 8)) * 8;
        uint4 u = make_uint4(0, 0, 0, 0);
        if (k0 + r < N) {
            u = *(const uint4 *)(a.k + head + (size_t)(k0 + r) * D + col);
            __nv_bfloat162 *h = (__nv_bfloat162 *)&u;
            for (int e = 0; e < 4; e++) {
                float2 f = __bfloat1622float2(h[e]);
                h[e] = __floats2bfloat162_rn(f.x - mean[col + 2 * e], f.y - mean[col + 2 * e + 1]);
            }
        }
        uint32_t off = (col / HALF) * (BWD90_KEYS * D) + swizzle_offset<D>(r * D + (col % HALF) * 2);
        *(uint4 *)(sm + S::KS + off) = u;
    }
    if (tid < 2 * BWD90_QUERIES)   // lse | delta of block 0 (adjacent in the stage)
        ((float *)(sm + S::STAGE0 + S::LSE))[tid] = load_query_stat(a, bh, 0, tid);
    fence_proxy_async();
    __syncthreads();

    const int key_base = k0 + 64 * wg;   // this warpgroup's 64 keys: one k_scale block
    const float k_scale = key_base < N ? a.qv.k_scale[(size_t)bh * nqb + key_base / 64] : 0.0f;
    const int kr = 64 * wg + 16 * warp + g;   // CTA key rows kr and kr + 8 of this thread
    const bool key_valid[2] = {k0 + kr < N, k0 + kr + 8 < N};
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);
    const uint64_t desc_k8 = smem_desc<D>(sm + S::K8 + 64 * wg * D);
    float dv[HALF] = {}, dk[HALF] = {};   // m64nD accumulators: keys × D
    mbar_wait(&bar_kv, 0);

    for (int qb = 0; qb < nqb; qb++) {
        const int stage = qb & 1, q0 = qb * BWD90_QUERIES;
        uint8_t *st = sm + S::STAGE0 + stage * S::STAGE_BYTES;
        float next_stat = 0.0f;   // lse or delta of block qb + 1, stored into the other stage below
        if (tid < 2 * BWD90_QUERIES && qb + 1 < nqb) next_stat = load_query_stat(a, bh, qb + 1, tid);
        int seen_turn = turn && tid == 0 ? ld_acquire_gpu(turn + qb) : 0;   // checked at the end of the step
        mbar_wait(&bar_q[stage], (qb >> 1) & 1);
        const float scale = __fmul_rn(a.qv.q_scale[(size_t)bh * nqb + qb], k_scale);

        // Sᵀ = K̂·Q̂ᵀ and dPᵀ = V·dOᵀ (64 keys × 64 queries each), one batch; bf16 k16 step kk
        // is in box kk/4 at +32 bytes per step inside its 128-byte rows
        int s_acc[32] = {};
        float dp[32] = {};
        const uint64_t desc_q8 = smem_desc<D>(st + S::Q8);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 32; ks++) {
            if (ks == 0) wgmma_s8_m64n64k32<0>(s_acc, desc_k8, desc_q8);
            else wgmma_s8_m64n64k32<1>(s_acc, desc_advance(desc_k8, 32 * ks), desc_advance(desc_q8, 32 * ks));
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
        reg_fence(s_acc);
        reg_fence(dp);

        // Pᵀ and dSᵀ; this thread holds keys kr (e < 2), kr + 8 and queries 8j + 2c + (e & 1)
        const float *s_lse = (const float *)(st + S::LSE), *s_delta = (const float *)(st + S::DELTA);
        float p[32];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int q = 8 * j + 2 * c;
            float2 lse = *(const float2 *)(s_lse + q), delta = *(const float2 *)(s_delta + q);
            const bool query_valid[2] = {q0 + q < N, q0 + q + 1 < N};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = __fmul_rn((float)s_acc[4 * j + e], scale) - (e & 1 ? lse.y : lse.x);
                p[4 * j + e] = key_valid[e / 2] && query_valid[e & 1] ? exp2f(x) : 0.0f;
                dp[4 * j + e] = p[4 * j + e] * (dp[4 * j + e] - (e & 1 ? delta.y : delta.x));
            }
        }
        // bf16 A fragments, k16 step t = queries 16t..16t+15 (accumulator columns 2t, 2t+1); dSᵀ
        // also to shared memory (rows = keys, 64 queries = 128 bytes), the MN-major A of dQ
        uint32_t pa[4][4], dsa[4][4];
#pragma unroll
        for (int t = 0; t < 4; t++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                pa[t][i] = pack_bf162(p[8 * t + 2 * i], p[8 * t + 2 * i + 1]);
                dsa[t][i] = pack_bf162(dp[8 * t + 2 * i], dp[8 * t + 2 * i + 1]);
                uint32_t off = (kr + 8 * (i & 1)) * 128 + (16 * t + 8 * (i / 2) + 2 * c) * 2;
                *(uint32_t *)(sm + S::DS + swizzle_offset<128>(off)) = dsa[t][i];
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

        // dQ[:, wg·D/2 ..] = dS·(k - k_mean) over the 128 keys, 16 keys per k-step
        float dq[D / 4] = {};
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BWD90_KEYS / 16; ks++) {
            uint64_t desc_a = smem_desc_mn<128>(sm + S::DS + ks * 2048, BWD90_QUERIES * 128);
            uint64_t desc_b = smem_desc_mn<D>(sm + S::KS + wg * BWD90_KEYS * D + ks * 16 * D, BWD90_KEYS * D);
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
        store_dq_tile<D>(sm + S::DQ, wg, dq, inv_sqrt_d);
        fence_proxy_async();
        if (turn && tid == 0) wait_dq_turn(turn + qb, kb, seen_turn);
        __syncthreads();   // (B) both warpgroups are done with this stage and with dSᵀ; dQ tile complete
        if (tid == 0) {
            if (turn) fence_proxy_async_global();   // the acquired turn before the async-proxy reduce
            for (int b = 0; b < D / 32; b++) tma_reduce_add_3d(&maps.dq, sm + S::DQ + b * BWD90_QUERIES * 128, 32 * b, q0, bh);
            bulk_commit();
            if (qb + 2 < nqb) load_query_stage<D>(st, &bar_q[stage], maps, bh, N, qb + 2);
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
    __trap();   // built without sm_90a code: sage_backward_sm90_available() says 0
#endif
}

extern "C" int sage_backward_sm90_available(void) {
    return sm90_kernel_available((const void *)sage_backward_sm90_kernel<128>);
}

template <int D>
static int launch_backward_sm90(const AttnBwdArgs &a, const uint16_t *dout, const uint16_t *q, const uint16_t *v,
                                int BH, cudaStream_t stream, char *err) {
    int N = a.N;
    uint64_t rows = (uint64_t)BH * N;
    Bwd90Maps m;
    if (tma_map_2d_bytes(&m.k8, a.qv.k8, D, rows, D, BWD90_KEYS, "sage_backward_sm90 k8", err) ||
        tma_map_2d_bytes(&m.q8, a.qv.q8, D, rows, D, BWD90_QUERIES, "sage_backward_sm90 q8", err) ||
        tma_map_2d_bytes(&m.v, v, 2 * D, rows, 128, BWD90_KEYS, "sage_backward_sm90 v", err) ||
        tma_map_2d_bytes(&m.q, q, 2 * D, rows, 128, BWD90_QUERIES, "sage_backward_sm90 q", err) ||
        tma_map_2d_bytes(&m.dout, dout, 2 * D, rows, 128, BWD90_QUERIES, "sage_backward_sm90 dout", err) ||
        tma_map_dq(&m.dq, a.dq, D, N, BH, "sage_backward_sm90 dq", err))
        return -1;
    int bytes = Bwd90Smem<D>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(sage_backward_sm90_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                    err, "cudaFuncSetAttribute(sage_backward_sm90_kernel max dynamic smem)");
    dim3 grid((N + BWD90_KEYS - 1) / BWD90_KEYS, BH);
    sage_backward_sm90_kernel<D><<<grid, BWD90_THREADS, bytes, stream>>>(m, a);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_backward_sm90_kernel");
    return 0;
}

extern "C" int sage_backward_sm90_cuda(float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                                       const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                                       const uint16_t *v, const uint16_t *out, const float *lse,
                                       const float *delta, int B, int H, int N, int D, SagePV pv,
                                       cudaStream_t stream, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535 ||
        (long long)B * H * N >= (1ll << 31)) {
        dit_set_error(err, "sage_backward_sm90_cuda: need D in {64, 128}, B, H, N >= 1, B·H <= 65535, "
                           "B·H·N < 2^31 (got B=%d H=%d N=%d D=%d)", B, H, N, D);
        return -1;
    }
    CHECK_DEVICE_ARGS("sage_backward_sm90_cuda", err, DEVICE_ARG(dq, 16), DEVICE_ARG(dk, 16), DEVICE_ARG(dv, 16),
                      DEVICE_ARG(fwd_workspace, 16), DEVICE_ARG(dout, 16), DEVICE_ARG(q, 16), DEVICE_ARG(k, 16),
                      DEVICE_ARG(v, 16), DEVICE_ARG(lse, 4));
    CHECK_DEVICE_ARGS("sage_backward_sm90_cuda", err, DEVICE_ARG(workspace, 4));
    if (delta) CHECK_DEVICE_ARGS("sage_backward_sm90_cuda", err, DEVICE_ARG(delta, 4));
    else CHECK_DEVICE_ARGS("sage_backward_sm90_cuda (delta = NULL: computed from out)", err, DEVICE_ARG(out, 16));
    if (!sage_backward_sm90_available()) {
        dit_set_error(err, "sage_backward_sm90_cuda: needs a compute capability 9.0 device and a build with "
                           "sm_90a code (-gencode=arch=compute_90a,code=sm_90a)");
        return -1;
    }
    AttnBwdArgs a = {dq, dk, dv, (const __nv_bfloat16 *)dout, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k,
                     (const __nv_bfloat16 *)v, lse, delta,
                     sage_cuda_quant_view((void *)fwd_workspace, B, H, N, D, pv), N, NULL};
    if (attention_backward_prepare(&a, workspace, out, B * H, D, sage_backward_deterministic(), stream, err) != 0)
        return -1;
    if (D == 64) return launch_backward_sm90<64>(a, dout, q, v, B * H, stream, err);
    return launch_backward_sm90<128>(a, dout, q, v, B * H, stream, err);
}
