// The Hopper (sm_90a) recompute backward shared by sage (sage_backward_sm90.cu) and bf16 flash
// attention (flash_backward_sm90.cu): wgmma tensor-core instructions fed by TMA. Same math as the
// mma.sync body attention_backward.cuh (the readable version), with the same score sources:
//   SCORES_SAGE: Sᵀ = K̂·Q̂ᵀ from the forward's int8 Q̂, K̂ (wgmma s8 m64n64k32, both K-major as the
//                quantization pass stores them), s = rn((float)Sᵀ·q_scale·k_scale); dQ from k - k_mean
//   SCORES_BF16: Sᵀ = K·Qᵀ (wgmma bf16 m64n64k16, both K-major), s = Sᵀ·c with c = log2(e)/sqrt(D);
//                dQ from k
//
// One CTA of two warpgroups per (128-key block, head); warpgroup w owns keys 64w..64w+63 (for sage
// one k_scale block). K (K̂ too for sage) and V of the CTA stay in shared memory (TMA, once; sage's
// k - k_mean is written by the threads). Thread 0 streams the 64-query blocks (Q̂ for sage, Q, dO)
// through two shared-memory stages, each completing on its mbarrier; lse and delta of the block (64
// floats each, at any offset: the TMA wants 16-byte aligned boxes) go through the same stage by the
// first 128 threads, one block ahead. Per query block, in each warpgroup (m64 = its 64 keys,
// TRANSPOSED tiles so that Pᵀ and dSᵀ feed the next products from registers):
//   Sᵀ, and dPᵀ = V·dOᵀ  (wgmma bf16 m64n64k16, V and dO rows K-major), one batch
//   Pᵀ = exp2(s - lse), dSᵀ = Pᵀ∘(dPᵀ - delta)   (keys/queries >= N: 0)
//   dV += bf16(Pᵀ)·dO   wgmma m64nDk16, A from registers, dO rows as MN-major B
//   dK += bf16(dSᵀ)·Q   likewise
//   dSᵀ -> shared memory (bf16, swizzled), barrier over both warpgroups, then
//   dQ[:, w·D/2..] = dS·K over all 128 keys (K: k - k_mean for sage)   wgmma m64n(D/2)k16, both
//        operands MN-major in shared memory; scaled by 1/sqrt(D) into a shared-memory fp32 tile,
//        which thread 0 adds to dq with one TMA reduce-add per 32 columns (cp.reduce.async.bulk.
//        tensor, a 3-D map (D, N, B·H) that drops the rows past N), overlapping the next step.
// Before barrier A of step qb + 1 (which frees the tile for rewriting) thread 0 waits until the
// reduce of block qb has READ the tile (cp.async.bulk.wait_group.read); its adds may still be in
// flight. Deterministic dQ (attention_backward.cuh): thread 0 waits for the turn of block qb
// before it issues the reduce of block qb (end of step qb), and there waits until the reduce is
// complete and hands the turn on.
// At the end dV and dK/sqrt(D) are stored (rows < N). The bf16 K tile for dQ is 2 boxes of 128
// keys × D/2 columns in rows of D bytes (D-byte swizzle): flash's TMA loads K so and also reads it
// K-major for Sᵀ (k16 step kk at byte 32kk of a row: box 32kk / D, +32kk % D inside it). The other
// tiles use the 128-byte swizzle (64-byte for the D = 64 int8 rows), see wgmma.cuh.
#pragma once
#include "attention/attention_backward.cuh"
#include "attention/wgmma.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

#define BWD90_THREADS 256   // two warpgroups
#define BWD90_KEYS 128      // keys per CTA, 64 per warpgroup
#define BWD90_QUERIES 64    // queries per step (= SAGE_CUDA_BLOCK: one q_scale per step)

// Shared memory of one CTA (after aligning its start to 1024 bytes). bf16 tiles of D = 128 are
// boxes of 64 columns (128-byte rows). SCORES_BF16 has no int8 tiles.
template <int D, int SCORES> struct Bwd90Smem {
    static constexpr int I8 = SCORES == SCORES_SAGE;               // 1: the int8 K̂, Q̂ tiles exist
    static constexpr int K8 = 0;                                   // K̂: 128 keys × D int8
    static constexpr int V = K8 + I8 * BWD90_KEYS * D;             // V: D/64 boxes of 128 keys × 64 bf16
    static constexpr int KS = V + BWD90_KEYS * D * 2;              // K (sage: k - k_mean): 2 boxes of 128 keys × D/2 bf16
    static constexpr int DS = KS + BWD90_KEYS * D * 2;             // dSᵀ: 128 keys × 64 queries bf16
    static constexpr int DQ = DS + BWD90_KEYS * BWD90_QUERIES * 2;  // dQ: D/32 boxes of 64 queries × 32 fp32
    static constexpr int STAGE0 = DQ + BWD90_QUERIES * D * 4;
    // one stage: Q̂ (64 × D int8, sage) | Q | dO (D/64 boxes of 64 queries × 64 bf16) by the TMA,
    // then lse | delta (64 fp32 each) by the threads
    static constexpr int Q8 = 0, Q = I8 * BWD90_QUERIES * D, DO = Q + BWD90_QUERIES * D * 2;
    static constexpr int STAGE_TX = DO + BWD90_QUERIES * D * 2;   // bytes the TMA brings per stage
    static constexpr int LSE = STAGE_TX, DELTA = LSE + BWD90_QUERIES * 4;
    static constexpr int STAGE_BYTES = (DELTA + BWD90_QUERIES * 4 + 1023) / 1024 * 1024;
    static constexpr int TOTAL = 1024 + STAGE0 + 2 * STAGE_BYTES;   // + alignment slack
};

// k: sage's K̂ (int8, D inner, B·H·N outer, box D × 128) or flash's K (bf16 rows as bytes, box D
// bytes × 128, D-byte swizzle); q8: sage's Q̂ (box D × 64; unused by flash); v, q, dout: bf16 rows
// as bytes (2D inner, B·H·N outer), boxes 128 bytes × 128 (v) or × 64.
// dq: fp32 (D, N, B·H), box 32 × 64 × 1 (128-byte swizzle), for the TMA reduce-add.
typedef struct {
    CUtensorMap k, v, q8, q, dout, dq;
} Bwd90Maps;

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
// The swizzle is folded into one per-thread base (few live addresses: no spill at D = 128). Row
// 16·warp + g + 8h has row % 8 = g; column 8j + 2c of the warpgroup's half is box wg·D/64 + j/4,
// byte 32(j % 4) + 8c of the row, i.e. 16-byte chunk 2(j % 4) + c/2 (XOR g) and byte 8(c % 2) in
// it: XOR-ing 32(j % 4) into the base (which holds chunk c/2 XOR g) gives the swizzled chunk.
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
// Until this thread's bulk groups have read their shared-memory sources (which may be rewritten);
// their global writes may still be in flight.
__device__ __forceinline__ void bulk_wait_all_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

// d (=|+=) A·B for one k16 step of dQ (m64n(D/2)k16, A and B MN-major).
template <int D, int scale_d>
__device__ __forceinline__ void dq_wgmma(float (&d)[D / 4], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (D == 128) wgmma_bf16_m64n64k16_ss<scale_d, 1, 1>(d, desc_a, desc_b);
    else wgmma_bf16_m64n32k16_ss<scale_d, 1, 1>(d, desc_a, desc_b);
}
#endif

#ifdef SAGE_SM90_DEVICE
// Thread 0: query block qb of head bh into the stage at st, completing on bar.
template <int D, int SCORES>
__device__ __forceinline__ void load_query_stage(uint8_t *st, uint64_t *bar, const Bwd90Maps &m, int bh, int N, int qb) {
    using S = Bwd90Smem<D, SCORES>;
    int row = bh * N + qb * BWD90_QUERIES;
    mbar_expect_bytes(bar, S::STAGE_TX);
    if constexpr (SCORES == SCORES_SAGE) tma_load_2d(st + S::Q8, &m.q8, bar, 0, row);
    for (int b = 0; b < D / 64; b++) {
        tma_load_2d(st + S::Q + b * BWD90_QUERIES * 128, &m.q, bar, 128 * b, row);
        tma_load_2d(st + S::DO + b * BWD90_QUERIES * 128, &m.dout, bar, 128 * b, row);
    }
}

// After the last query block: thread 0 waits for the last dQ reduce and hands on its turn (turn
// NULL: unordered dQ); then every thread stores its two key rows k0 + kr and k0 + kr + 8 of dv and
// of dk·dk_scale (rows < N: key_valid), from the m64nD accumulator fragments.
template <int D>
__device__ __forceinline__ void finish_dv_dk(const AttnBwdArgs &a, int tid, int *turn, int nqb, size_t head, int k0,
                                             int kr, int c, const bool (&key_valid)[2], const float (&dv)[D / 2],
                                             const float (&dk)[D / 2], float dk_scale) {
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
            *(float2 *)(a.dk + at + 8 * j) = make_float2(dk[4 * j + 2 * h] * dk_scale, dk[4 * j + 2 * h + 1] * dk_scale);
        }
    }
}
#endif

// Grid (ceil(N/128), B·H), BWD90_THREADS threads, Bwd90Smem<D, SCORES>::TOTAL bytes of dynamic
// shared memory. a: from attention_backward_prepare (delta computed or given, dq and the dQ turns
// zeroed), N; for sage k (bf16, for k - k_mean) and the forward's scales and k_mean.
template <int D, int SCORES>
__global__ void __launch_bounds__(BWD90_THREADS, 1)
    attention_backward_sm90_kernel(const __grid_constant__ Bwd90Maps maps, AttnBwdArgs a) {
#ifdef SAGE_SM90_DEVICE
    using S = Bwd90Smem<D, SCORES>;
    constexpr bool SAGE = SCORES == SCORES_SAGE;
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
        if constexpr (SAGE) {   // K̂ and V
            mbar_expect_bytes(&bar_kv, BWD90_KEYS * D * 3);
            tma_load_2d(sm + S::K8, &maps.k, &bar_kv, 0, bh * N + k0);
        } else {                // K (two column halves) and V
            mbar_expect_bytes(&bar_kv, BWD90_KEYS * D * 4);
            for (int b = 0; b < 2; b++)
                tma_load_2d(sm + S::KS + b * BWD90_KEYS * D, &maps.k, &bar_kv, D * b, bh * N + k0);
        }
        for (int b = 0; b < D / 64; b++)
            tma_load_2d(sm + S::V + b * BWD90_KEYS * 128, &maps.v, &bar_kv, 128 * b, bh * N + k0);
        for (int s = 0; s < 2 && s < nqb; s++)
            load_query_stage<D, SCORES>(sm + S::STAGE0 + s * S::STAGE_BYTES, &bar_q[s], maps, bh, N, s);
    }
    if constexpr (SAGE) {
        // k - k_mean in bf16 (zero rows past N), as the mma.sync path: box b holds columns b·D/2..
        // of the 128 keys in rows of D bytes, swizzled as wgmma reads MN-major B. Each thread owns
        // the same 8 columns in KS_ROWS rows: all its global loads are issued before any is used
        // (one round trip per CTA, not one per row).
        constexpr int KS_ROWS = BWD90_KEYS * D / 8 / BWD90_THREADS, ROW_STEP = BWD90_THREADS / (D / 8);
        const int col = (tid % (D / 8)) * 8, r0 = tid / (D / 8);
        const float *mean = a.qv.k_mean + (size_t)bh * D + col;
        float m[8];
        uint4 u[KS_ROWS];
#pragma unroll
        for (int e = 0; e < 8; e++) m[e] = mean[e];
#pragma unroll
        for (int i = 0; i < KS_ROWS; i++) {
            int r = r0 + i * ROW_STEP;
            u[i] = k0 + r < N ? *(const uint4 *)(a.k + head + (size_t)(k0 + r) * D + col) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < KS_ROWS; i++) {
            int r = r0 + i * ROW_STEP;
            if (k0 + r < N) {
                __nv_bfloat162 *h = (__nv_bfloat162 *)&u[i];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float2 f = __bfloat1622float2(h[e]);
                    h[e] = __floats2bfloat162_rn(f.x - m[2 * e], f.y - m[2 * e + 1]);
                }
            }
            uint32_t off = (col / HALF) * (BWD90_KEYS * D) + swizzle_offset<D>(r * D + (col % HALF) * 2);
            *(uint4 *)(sm + S::KS + off) = u[i];
        }
    }
    if (tid < 2 * BWD90_QUERIES)   // lse | delta of block 0 (adjacent in the stage)
        ((float *)(sm + S::STAGE0 + S::LSE))[tid] = load_query_stat(a, bh, 0, tid);
    if constexpr (SAGE) fence_proxy_async();   // k - k_mean before the tensor cores read it
    __syncthreads();

    const int key_base = k0 + 64 * wg;   // this warpgroup's 64 keys: sage's k_scale block
    const float k_scale = SAGE && key_base < N ? a.qv.k_scale[(size_t)bh * nqb + key_base / 64] : 0.0f;
    const int kr = 64 * wg + 16 * warp + g;   // CTA key rows kr and kr + 8 of this thread
    const bool key_valid[2] = {k0 + kr < N, k0 + kr + 8 < N};
    const float inv_sqrt_d = 1.0f / sqrtf((float)D), c_log2 = 1.44269504f / sqrtf((float)D);
    const uint64_t desc_k8 = SAGE ? smem_desc<D>(sm + S::K8 + 64 * wg * D) : 0;
    // dSᵀ store base: row kr, queries 2c.., chunk 0 swizzled (see the store below)
    const uint32_t ds_row = kr * 128 + 16 * g + 4 * c;
    float dv[HALF] = {}, dk[HALF] = {};   // m64nD accumulators: keys × D
    mbar_wait(&bar_kv, 0);

    for (int qb = 0; qb < nqb; qb++) {
        const int stage = qb & 1, q0 = qb * BWD90_QUERIES;
        uint8_t *st = sm + S::STAGE0 + stage * S::STAGE_BYTES;
        float next_stat = 0.0f;   // lse or delta of block qb + 1, stored into the other stage below
        if (tid < 2 * BWD90_QUERIES && qb + 1 < nqb) next_stat = load_query_stat(a, bh, qb + 1, tid);
        int seen_turn = turn && tid == 0 ? ld_acquire_gpu(turn + qb) : 0;   // checked at the end of the step
        mbar_wait(&bar_q[stage], (qb >> 1) & 1);
        const float scale = SAGE ? __fmul_rn(a.qv.q_scale[(size_t)bh * nqb + qb], k_scale) : 0.0f;

        // Sᵀ (K̂·Q̂ᵀ or K·Qᵀ) and dPᵀ = V·dOᵀ (64 keys × 64 queries each), one batch; bf16 k16 step
        // kk of the 128-byte-row tiles (Q, dO, V) is in box kk/4 at +32 bytes per step in its rows
        int s_acc[32] = {};         // sage's Sᵀ
        float p[32], dp[32] = {};   // flash's Sᵀ; then Pᵀ
        const uint64_t desc_q8 = SAGE ? smem_desc<D>(st + S::Q8) : 0;
        wgmma_fence();
        if constexpr (SAGE) {
#pragma unroll
            for (int ks = 0; ks < D / 32; ks++) {
                if (ks == 0) wgmma_s8_m64n64k32<0>(s_acc, desc_k8, desc_q8);
                else wgmma_s8_m64n64k32<1>(s_acc, desc_advance(desc_k8, 32 * ks), desc_advance(desc_q8, 32 * ks));
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint64_t da = smem_desc<D>(sm + S::KS + (32 * kk / D) * BWD90_KEYS * D + 64 * wg * D + (32 * kk) % D);
                uint64_t db = smem_desc<128>(st + S::Q + (kk / 4) * BWD90_QUERIES * 128 + (kk % 4) * 32);
                if (kk == 0) wgmma_bf16_m64n64k16_ss<0, 0, 0>(p, da, db);
                else wgmma_bf16_m64n64k16_ss<1, 0, 0>(p, da, db);
            }
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
        if constexpr (SAGE) reg_fence(s_acc);
        else reg_fence(p);
        reg_fence(dp);

        // Pᵀ and dSᵀ; this thread holds keys kr (e < 2), kr + 8 and queries 8j + 2c + (e & 1)
        const float *s_lse = (const float *)(st + S::LSE), *s_delta = (const float *)(st + S::DELTA);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int q = 8 * j + 2 * c;
            float2 lse = *(const float2 *)(s_lse + q), delta = *(const float2 *)(s_delta + q);
            const bool query_valid[2] = {q0 + q < N, q0 + q + 1 < N};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = SAGE ? __fmul_rn((float)s_acc[4 * j + e], scale) - (e & 1 ? lse.y : lse.x)
                               : fmaf(p[4 * j + e], c_log2, -(e & 1 ? lse.y : lse.x));
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
                // row kr + 8(i & 1) (row % 8 = g), queries 16t + 8(i/2) + 2c: 16-byte chunk 2t + i/2 XOR g
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
        if (tid == 0 && qb > 0) {   // the dQ tile is free once the reduce of block qb - 1 has read it;
            if (turn) {             // ordered dQ hands the turn on only once the adds are complete
                bulk_wait_all();
                hand_on_dq_turn(turn + qb - 1);
            } else {
                bulk_wait_all_read();
            }
        }
        __syncthreads();   // (A) dSᵀ of both warpgroups (and the next block's lse, delta) in shared memory

        // dQ[:, wg·D/2 ..] = dS·K over the 128 keys (sage: k - k_mean), 16 keys per k-step
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
        store_dq_tile_folded<D>(sm + S::DQ, wg, dq, inv_sqrt_d);
        fence_proxy_async();
        if (turn && tid == 0) wait_dq_turn(turn + qb, kb, seen_turn);
        __syncthreads();   // (B) both warpgroups are done with this stage and with dSᵀ; dQ tile complete
        if (tid == 0) {
            if (turn) fence_proxy_async_global();   // the acquired turn before the async-proxy reduce
            for (int b = 0; b < D / 32; b++) tma_reduce_add_3d(&maps.dq, sm + S::DQ + b * BWD90_QUERIES * 128, 32 * b, q0, bh);
            bulk_commit();
            if (qb + 2 < nqb) load_query_stage<D, SCORES>(st, &bar_q[stage], maps, bh, N, qb + 2);
        }
    }
    finish_dv_dk<D>(a, tid, turn, nqb, head, k0, kr, c, key_valid, dv, dk, inv_sqrt_d);
#else
    __trap();   // built without sm_90a code: *_backward_sm90_available() says 0
#endif
}
