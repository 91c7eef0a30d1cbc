// The Hopper (sm_90a) recompute backward shared by sage (sage_backward_sm90.cu) and bf16 flash
// attention (flash_backward_sm90.cu): wgmma tensor-core instructions fed by TMA. Same math as the
// mma.sync body attention_backward.cuh (the readable version), with the same score sources:
//   SCORES_SAGE: Sᵀ = K̂·Q̂ᵀ from the forward's int8 Q̂, K̂ (wgmma s8 m64n64k32, both K-major as the
//                quantization pass stores them; each warpgroup's K̂ held in registers as the A
//                operand, loaded once per CTA), s = (float)Sᵀ·q_scale·k_scale; dQ from k - k_mean
//   SCORES_BF16: Sᵀ = K·Qᵀ (wgmma bf16 m64n64k16, both K-major), s = Sᵀ·c with c = log2(e)/sqrt(D);
//                dQ from k
//
// One CTA per (128-key block, head) of three warpgroups (FA3's structure): two consumers, warpgroup
// w owning keys 64w..64w+63 (for sage one k_scale block), and a producer (setmaxnreg: 24 registers,
// the consumers 240). K (K̂ too for sage) and V of the CTA stay in shared memory (TMA, once; sage's
// k - k_mean is written by the consumers). The producer's warp 0 (the loader) streams the query
// steps (QS = 64 queries, 128 for bf16 at D = 64: H = QS/64 blocks of 64; Q̂ for sage, Q, dO by
// the TMA; lse and delta, QS floats each at any offset, which the TMA cannot take, by its lanes)
// through two shared-memory stages with full and empty mbarriers; its warp 1 (the dQ writer) adds
// the consumers' dQ tiles to dq. Per step, in each consumer warpgroup (m64 = its 64 keys,
// TRANSPOSED tiles so that Pᵀ and dSᵀ feed the next products from registers), in FA3's order:
//   Sᵀ, then dPᵀ = V·dOᵀ, per 64-query block (wgmma m64n64, V and dO rows K-major), two groups
//   Pᵀ = exp2(s - lse) once Sᵀ is done, while dPᵀ runs; dSᵀ = Pᵀ∘(dPᵀ - delta)  (keys/queries
//        >= N: 0); dSᵀ -> shared memory (bf16, swizzled; two buffers, one for sage at D = 128)
//   dV += bf16(Pᵀ)·dO   wgmma m64nDk16, A from registers, dO rows as MN-major B
//   one named barrier over both consumer warpgroups (the only one per step), then
//   dQ = dS·K over all 128 keys (K: k - k_mean for sage), both operands MN-major in shared
//        memory: H = 1: columns w·D/2.. (m64n(D/2)k16); H = 2: all D columns of block w (m64nDk16)
//   dK += bf16(dSᵀ)·Q   like dV, issued once dV is done
//   once dQ is done, while dK runs: dQ·1/sqrt(D) into the warpgroup's half of a shared-memory fp32
//        tile (once the writer has read the previous one), handed to the writer in the next step
//        once its Sᵀ and dPᵀ are issued (the proxy fence waits for the stores), which adds it to dq
//        with one TMA reduce-add per 64 rows × 32 columns (cp.reduce.async.bulk.tensor, a 3-D map
//        (D, N, B·H) that drops the rows past N), overlapping the next step; once dK is done the
//        stage goes back to the loader (ordered dQ: before the tile handshake).
// The writer hands a tile half back once the TMA has READ it (cp.async.bulk.wait_group.read).
// Deterministic dQ (attention_backward.cuh): the writer waits for the turn of a 64-query block
// before it issues its reduces, waits until they are complete and hands the turn on.
// At the end dV and dK/sqrt(D) are stored (rows < N). The bf16 K tile for dQ is 2 boxes of 128
// keys × D/2 columns in rows of D bytes (D-byte swizzle): flash's TMA loads K so and also reads it
// K-major for Sᵀ (k16 step kk at byte 32kk of a row: box 32kk / D, +32kk % D inside it). The other
// tiles use the 128-byte swizzle (64-byte for the D = 64 int8 rows), see wgmma.cuh.
#pragma once
#include "attention/attention_backward.cuh"
#include "attention/wgmma.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

#define BWD90_THREADS 256   // the two consumer warpgroups (the whole CTA of sage_backward_int8_sm90.cu)
#define BWD90_CTA_THREADS 384   // + the producer warpgroup
// setmaxnreg: the CTA starts with 168 registers per thread (65536 / 384, in steps of 8); the
// consumers can only take what the producer gives back: 168 + (168 - 24) / 2 = 240.
#define BWD90_PRODUCER_REGS 24
#define BWD90_CONSUMER_REGS 240
// Named barriers (0 is __syncthreads): dSᵀ of both consumer warpgroups stored (256 threads); the
// single dSᵀ buffer free again (256, sage D = 128 only); per consumer warpgroup w, its half of the
// dQ tile complete (+ w) and read by the TMA again (+ w), each 128 consumer + 32 writer threads.
#define BWD90_BAR_DS 1
#define BWD90_BAR_DS_FREE 2
#define BWD90_BAR_DQ_FULL 3
#define BWD90_BAR_DQ_EMPTY 5
#define BWD90_KEYS 128      // keys per CTA, 64 per warpgroup
#define BWD90_QUERIES 64    // queries per block (= SAGE_CUDA_BLOCK: one q_scale; one dQ turn; dq TMA box rows)

// Shared memory of one CTA (after aligning its start to 1024 bytes). bf16 tiles of D = 128 are
// boxes of 64 columns (128-byte rows). SCORES_BF16 has no int8 tiles. A step takes QS queries,
// H = QS / 64 blocks of 64: 128 (FA3's 128 × 128 tile) for bf16 at D = 64 only; at D = 128 the
// registers allow 64, and sage at D = 64 spills with 128 (15% slower on the H200, notes_bwd_plan).
template <int D, int SCORES> struct Bwd90Smem {
    static constexpr int QS = D == 64 && SCORES == SCORES_BF16 ? 2 * BWD90_QUERIES : BWD90_QUERIES;
    static constexpr int H = QS / BWD90_QUERIES;
    static constexpr int I8 = SCORES == SCORES_SAGE;               // 1: the int8 K̂, Q̂ tiles exist
    static constexpr int K8 = 0;                                   // K̂: 128 keys × D int8
    static constexpr int V = K8 + I8 * BWD90_KEYS * D;             // V: D/64 boxes of 128 keys × 64 bf16
    static constexpr int KS = V + BWD90_KEYS * D * 2;              // K (sage: k - k_mean): 2 boxes of 128 keys × D/2 bf16
    // dSᵀ: DS_BUFS buffers (step qs uses qs % DS_BUFS) of H blocks (DS_BLOCK bytes apart) of 128
    // keys × 64 queries bf16; two do not fit next to sage's int8 tiles at D = 128 (232,448 bytes
    // is the limit)
    static constexpr int DS_BUFS = I8 && D == 128 ? 1 : 2, DS_BLOCK = BWD90_KEYS * BWD90_QUERIES * 2, DS_BYTES = H * DS_BLOCK;
    static constexpr int DS = KS + BWD90_KEYS * D * 2;
    static constexpr int DQ = DS + DS_BUFS * DS_BYTES;              // dQ: H·D/32 boxes of 64 queries × 32 fp32
    static constexpr int STAGE0 = DQ + QS * D * 4;
    // one stage: Q̂ (QS × D int8, sage) | Q | dO (D/64 boxes of QS queries × 64 bf16) by the TMA,
    // then lse | delta (QS fp32 each) by the threads
    static constexpr int Q8 = 0, Q = I8 * QS * D, DO = Q + QS * D * 2;
    static constexpr int STAGE_TX = DO + QS * D * 2;   // bytes the TMA brings per stage
    static constexpr int LSE = STAGE_TX, DELTA = LSE + QS * 4;
    static constexpr int STAGE_BYTES = (DELTA + QS * 4 + 1023) / 1024 * 1024;
    static constexpr int TOTAL = 1024 + STAGE0 + 2 * STAGE_BYTES;   // + alignment slack
    static_assert(TOTAL + 64 <= 232448, "dynamic + static (barriers) shared memory over the sm_90 limit");
};

// The CTA's mbarriers (static shared memory).
struct Bwd90Barriers {
    uint64_t kv;        // K̂/K and V landed (TMA bytes)
    uint64_t full[2];   // stage s: Q̂/Q/dO landed (TMA bytes), lse | delta stored (the loader's 32 lanes)
    uint64_t empty[2];  // stage s: every consumer thread is done with it
};

// k: sage's K̂ (int8, D inner, B·H·N outer, box D × 128) or flash's K (bf16 rows as bytes, box D
// bytes × 128, D-byte swizzle); q8: sage's Q̂ (box D × 64; unused by flash); v, q: bf16 rows as
// bytes (2D inner, B·H·N outer), boxes 128 bytes × 128 (v) or × 64; dout: tma_map_head_rows (wgmma.cuh).
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
// Index t < 2·QS: lse (t < QS) or delta of query q0 + t % QS of head bh (0 past N).
template <int QS>
__device__ __forceinline__ float load_query_stat(const AttnBwdArgs &a, int bh, int q0, int t) {
    int q = q0 + t % QS;
    const float *src = t < QS ? a.lse : a.delta;
    return q < a.N ? src[(size_t)bh * a.N + q] : 0.0f;
}

// d += a·B for one k16 step of dV or dK (m64nDk16, B MN-major with 64-column atoms 8 KB apart).
template <int D>
__device__ __forceinline__ void dkv_wgmma(float (&d)[D / 2], const uint32_t a[4], uint64_t desc_b) {
    if constexpr (D == 128) wgmma_bf16_m64n128k16_rs<1, 1>(d, a, desc_b);
    else wgmma_bf16_m64n64k16_rs<1, 1>(d, a, desc_b);
}

// dq·scale (this warpgroup's 64 queries × NCOL columns, m64nNCOL accumulator layout) into the
// shared-memory dQ tile: boxes of 64 rows × 32 columns (rows of 128 bytes, 128-byte swizzled as the
// TMA reads them), the warpgroup's NCOL/32 boxes from box wg·NCOL/32 on. The swizzle is folded into
// one per-thread base (few live addresses: no spill at D = 128). Row 16·warp + g + 8h has row % 8
// = g; column 8j + 2c is box wg·NCOL/32 + j/4, byte 32(j % 4) + 8c of the row, i.e. 16-byte chunk
// 2(j % 4) + c/2 (XOR g) and byte 8(c % 2) in it: XOR-ing 32(j % 4) into the base (which holds
// chunk c/2 XOR g) gives the swizzled chunk.
template <int NCOL>
__device__ __forceinline__ void store_dq_tile_folded(uint8_t *tile, int wg, const float (&dq)[NCOL / 2], float scale) {
    int warp = (threadIdx.x % 128) / 32, g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
    uint32_t base = wg * (NCOL / 32) * (BWD90_QUERIES * 128) + (16 * warp + g) * 128 + ((c / 2) ^ g) * 16 + 8 * (c % 2);
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < NCOL / 8; j++) {
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

// threadIdx.x / 128 read afresh (thread_index): for the named-barrier ids of the dQ hand-over.
__device__ __forceinline__ int warpgroup_now() { return thread_index() / 128; }

// Pᵀ = exp2(s - lse) of this thread's 32 elements: keys kr (e < 2), kr + 8, queries
// q0 + 8j + 2c + (e & 1); s = (float)s_acc·scale (sage) or p·c_log2 (flash: Sᵀ in p). s - lse is
// one FFMA, rounded once where the definition rounds s first (~1e-7 relative in P, as the forward's
// exponent): one instruction less per score, the sage backward ~1% faster (dev/notes_bwd_plan.md).
// MASK: 0 at keys or queries >= N (not needed when the whole tile is inside).
template <bool SAGE, bool MASK>
__device__ __forceinline__ void exp2_scores(float (&p)[32], const int (&s_acc)[32], float scale, float c_log2,
                                            const float *s_lse, int c, int q0, int N, const bool (&key_valid)[2]) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int q = 8 * j + 2 * c;
        float2 lse = *(const float2 *)(s_lse + q);
        const bool query_valid[2] = {q0 + q < N, q0 + q + 1 < N};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float s = SAGE ? (float)s_acc[4 * j + e] : p[4 * j + e];
            float x = fmaf(s, SAGE ? scale : c_log2, -(e & 1 ? lse.y : lse.x));
            p[4 * j + e] = !MASK || (key_valid[e / 2] && query_valid[e & 1]) ? exp2f(x) : 0.0f;
        }
    }
}

// After the dK product of a step (its last wgmma reading the stage: wait for it; dk and its A
// fragments dsa are then final): every consumer thread arrives on the stage's empty barrier after
// its own last read of it (lse, delta). One arrival per warp after a __syncwarp is as correct,
// but racecheck cannot follow the ordering through the warp barrier and reports the loader's
// next lse stores.
template <int n, int T>
__device__ __forceinline__ void release_stage(uint64_t *empty, float (&dk)[n], uint32_t (&dsa)[T][4]) {
    wgmma_wait<0>();
    reg_fence(dk);
#pragma unroll
    for (int t = 0; t < T; t++) reg_fence(dsa[t]);
    mbar_arrive(empty);
}

// dq·scale of step qs into this warpgroup's half of the dQ tile, once the writer has read the
// previous one (qs > 0). Handed to the writer later (publish_dq_half): the fence waits until the
// stores are done, which would hold up the next step's products.
template <int NCOL>
__device__ __forceinline__ void store_dq_half(uint8_t *tile, int wg, const float (&dq)[NCOL / 2], float scale, int qs) {
    if (qs > 0) named_barrier_sync(BWD90_BAR_DQ_EMPTY + warpgroup_now(), 160);
    store_dq_tile_folded<NCOL>(tile, wg, dq, scale);
}
// The stored half to the writer: visible to the TMA (async proxy), then DQ_FULL.
__device__ __forceinline__ void publish_dq_half() {
    fence_proxy_async();
    named_barrier_arrive(BWD90_BAR_DQ_FULL + warpgroup_now(), 160);
}

// d (=|+=) A·B for one k16 step of dQ (m64nNCOLk16, A and B MN-major).
template <int NCOL, int scale_d>
__device__ __forceinline__ void dq_wgmma(float (&d)[NCOL / 2], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (NCOL == 64) wgmma_bf16_m64n64k16_ss<scale_d, 1, 1>(d, desc_a, desc_b);
    else wgmma_bf16_m64n32k16_ss<scale_d, 1, 1>(d, desc_a, desc_b);
}
#endif

#ifdef SAGE_SM90_DEVICE
// One thread (the loader's lane 0): Q̂/Q/dO of the QS queries of step qs of head bh into the stage
// at st (the TMA boxes hold 64 rows: H of them per tile, 64 rows apart), completing on bar (with
// one arrival).
template <int D, int SCORES>
__device__ __forceinline__ void load_query_stage(uint8_t *st, uint64_t *bar, const Bwd90Maps &m, int bh, int N,
                                                 int merged_heads, int qs) {
    using S = Bwd90Smem<D, SCORES>;
    const int head = merged_heads ? bh % merged_heads : 0, batch = merged_heads ? bh / merged_heads : bh;
    mbar_expect_bytes(bar, S::STAGE_TX);
    for (int h = 0; h < S::H; h++) {
        int t = qs * S::QS + h * BWD90_QUERIES, row = bh * N + t;
        if constexpr (SCORES == SCORES_SAGE) tma_load_2d(st + S::Q8 + h * BWD90_QUERIES * D, &m.q8, bar, 0, row);
        for (int b = 0; b < D / 64; b++) {
            tma_load_2d(st + S::Q + b * S::QS * 128 + h * BWD90_QUERIES * 128, &m.q, bar, 128 * b, row);
            tma_load_4d(st + S::DO + b * S::QS * 128 + h * BWD90_QUERIES * 128, &m.dout, bar, 128 * b, t, head, batch);
        }
    }
}

// The producer warpgroup's two jobs (warps 2, 3 of it have none).
// Loader, producer warp 0 (all lanes; lane 0 issues the TMA): K̂/K and V once, then per step qs
// its stage (qs % 2), once every consumer thread has released the stage's previous step (empty):
// Q̂/Q/dO by the TMA and lse | delta (2·QS floats, 2·QS/32 per lane) by ordinary loads and stores;
// every lane arrives on full (33 arrivals with lane 0's expect_tx).
template <int D, int SCORES>
__device__ void load_stages(Bwd90Barriers *bar, uint8_t *sm, const Bwd90Maps &m, const AttnBwdArgs &a, int bh,
                            int k0, int nsteps, int lane) {
    using S = Bwd90Smem<D, SCORES>;
    const int N = a.N;
    if (lane == 0) {
        if constexpr (SCORES == SCORES_SAGE) {   // K̂ and V
            mbar_expect_bytes(&bar->kv, BWD90_KEYS * D * 3);
            tma_load_2d(sm + S::K8, &m.k, &bar->kv, 0, bh * N + k0);
        } else {                                 // K (two column halves) and V
            mbar_expect_bytes(&bar->kv, BWD90_KEYS * D * 4);
            for (int b = 0; b < 2; b++) tma_load_2d(sm + S::KS + b * BWD90_KEYS * D, &m.k, &bar->kv, D * b, bh * N + k0);
        }
        for (int b = 0; b < D / 64; b++)
            tma_load_2d(sm + S::V + b * BWD90_KEYS * 128, &m.v, &bar->kv, 128 * b, bh * N + k0);
    }
    for (int qs = 0; qs < nsteps; qs++) {
        const int stage = qs & 1;
        uint8_t *st = sm + S::STAGE0 + stage * S::STAGE_BYTES;
        if (qs >= 2) mbar_wait(&bar->empty[stage], ((qs >> 1) - 1) & 1);
        if (lane == 0) load_query_stage<D, SCORES>(st, &bar->full[stage], m, bh, N, a.merged_heads, qs);
#pragma unroll
        for (int i = 0; i < 2 * S::QS / 32; i++) {   // lse | delta are adjacent in the stage
            int t = lane + 32 * i;
            ((float *)(st + S::LSE))[t] = load_query_stat<S::QS>(a, bh, qs * S::QS, t);
        }
        mbar_arrive(&bar->full[stage]);
    }
}

// dQ writer, producer warp 1 (all lanes: the named barriers are per warp; lane 0 issues): per
// step qs and consumer warpgroup w, once w says its half of the dQ tile is complete
// (BWD90_BAR_DQ_FULL + w), its boxes of 64 rows × 32 columns into dq by TMA reduce-adds (one bulk
// group per half): H = 1: columns w·D/2.. of the step's block; H = 2: all D columns of block
// 2qs + w (none if that block starts past N). Each half goes back to its warpgroup
// (BWD90_BAR_DQ_EMPTY + w, not after the last step) once the TMA has READ it. Ordered dQ: the
// reduces of block b wait for its turn (the first one loaded early), and the turns are handed on
// once they are complete. nqb: 64-query blocks of the head.
template <int D, int H>
__device__ void write_dq(const CUtensorMap *map, uint8_t *tile, int *turn, int kb, int bh, int nsteps, int nqb,
                         int lane) {
    constexpr int BOXES = H * D / 64;   // per warpgroup
    for (int qs = 0; qs < nsteps; qs++) {
        int seen_turn = turn && lane == 0 ? ld_acquire_gpu(turn + H * qs) : 0;
        for (int w = 0; w < 2; w++) {
            named_barrier_sync(BWD90_BAR_DQ_FULL + w, 160);
            const int block = H * qs + (H == 2 ? w : 0);
            if (lane == 0 && block < nqb) {
                if (turn && (w == 0 || H == 2)) {
                    wait_dq_turn(turn + block, kb, w == 0 ? seen_turn : -1);
                    fence_proxy_async_global();   // the acquired turn before the async-proxy reduce
                }
                for (int b = w * BOXES; b < (w + 1) * BOXES; b++)
                    tma_reduce_add_3d(map, tile + b * BWD90_QUERIES * 128, 32 * (b % (D / 32)), block * BWD90_QUERIES, bh);
            }
            if (lane == 0) bulk_commit();
            __syncwarp();   // the warp reconverges before the next (warp-wide) named barrier
        }
        if (lane == 0) bulk_wait_read<1>();   // warpgroup 0's half has been read
        __syncwarp();
        if (qs + 1 < nsteps) named_barrier_arrive(BWD90_BAR_DQ_EMPTY + 0, 160);
        if (lane == 0) bulk_wait_read<0>();
        __syncwarp();
        if (qs + 1 < nsteps) named_barrier_arrive(BWD90_BAR_DQ_EMPTY + 1, 160);
        if (turn && lane == 0) {
            bulk_wait_all();
            for (int h = 0; h < H; h++)
                if (H * qs + h < nqb) hand_on_dq_turn(turn + H * qs + h);
        }
    }
    if (lane == 0) bulk_wait_all();
}

#endif

// Grid (ceil(N/128), B·H), BWD90_CTA_THREADS threads (warpgroups 0, 1: consumers, 2: producer),
// Bwd90Smem<D, SCORES>::TOTAL bytes of dynamic shared memory. a: from attention_backward_prepare
// (delta computed or given, dq and the dQ turns zeroed), N; for sage k (bf16, for k - k_mean) and
// the forward's scales and k_mean.
template <int D, int SCORES>
__global__ void __launch_bounds__(BWD90_CTA_THREADS, 1)
    attention_backward_sm90_kernel(const __grid_constant__ Bwd90Maps maps, AttnBwdArgs a) {
#ifdef SAGE_SM90_DEVICE
    using S = Bwd90Smem<D, SCORES>;
    constexpr bool SAGE = SCORES == SCORES_SAGE;
    constexpr int HALF = D / 2;
    extern __shared__ uint8_t smem_raw[];
    __shared__ Bwd90Barriers bar;
    uint8_t *sm = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    constexpr int QS = S::QS, H = S::H;   // queries per step, 64-query blocks per step
    // dQ columns per warpgroup: H = 1: D/2 of the step's 64 queries; H = 2: all D of its block
    constexpr int NCOL = H == 2 ? D : D / 2;
    const int N = a.N, nqb = (N + BWD90_QUERIES - 1) / BWD90_QUERIES, nsteps = (N + QS - 1) / QS;
    const int kb = blockIdx.x, bh = blockIdx.y, k0 = kb * BWD90_KEYS, tid = threadIdx.x;
    // flash: wg shuffled, so that the compiler sees it warp-uniform and keeps the wgmma descriptors
    // that depend on it in uniform registers (4-7% faster at D = 64); sage keeps tid / 128 (shuffled,
    // it measured 0-3% slower at D = 128: dev/notes_bwd_plan.md)
    const int wg = SAGE ? tid / 128 : __shfl_sync(0xffffffffu, tid / 128, 0);
    const int warp = (tid % 128) / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const size_t head = (size_t)bh * N * D;

    if (tid == 0) {
        mbar_init(&bar.kv, 1);
        for (int s = 0; s < 2; s++) {
            mbar_init(&bar.full[s], 1 + 32);   // the loader's expect_tx + one arrival per lane
            mbar_init(&bar.empty[s], BWD90_THREADS);   // one arrival per consumer thread
        }
        mbar_init_fence();
    }
    __syncthreads();   // the last CTA-wide barrier: from here on the roles synchronize by name
    if (wg == 2) {
        setmaxnreg_dec<BWD90_PRODUCER_REGS>();
        if (warp == 0) load_stages<D, SCORES>(&bar, sm, maps, a, bh, k0, nsteps, lane);
        else if (warp == 1)
            write_dq<D, H>(&maps.dq, sm + S::DQ, a.dq_turn ? a.dq_turn + (size_t)bh * nqb : NULL, kb, bh, nsteps, nqb, lane);
        return;
    }
    setmaxnreg_inc<BWD90_CONSUMER_REGS>();
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
    if constexpr (SAGE) fence_proxy_async();   // k - k_mean before the tensor cores read it (after BWD90_BAR_DS of step 0)

    const int key_base = k0 + 64 * wg;   // this warpgroup's 64 keys: sage's k_scale block
    const float k_scale = SAGE && key_base < N ? a.qv.k_scale[(size_t)bh * nqb + key_base / 64] : 0.0f;
    const int kr = 64 * wg + 16 * warp + g;   // CTA key rows kr and kr + 8 of this thread
    const bool key_valid[2] = {k0 + kr < N, k0 + kr + 8 < N};
    const float inv_sqrt_d = 1.0f / sqrtf((float)D), c_log2 = 1.44269504f / sqrtf((float)D);
    // dSᵀ store base: row kr, queries 2c.., chunk 0 swizzled (see the store below)
    const uint32_t ds_row = kr * 128 + 16 * g + 4 * c;
    float dv[HALF] = {}, dk[HALF] = {};   // m64nD accumulators: keys × D
    mbar_wait(&bar.kv, 0);
    uint32_t k8_frag[SAGE ? D / 32 : 1][4];   // sage: this warpgroup's K̂ as Sᵀ's register A operand
    if constexpr (SAGE) load_s8_a_fragments<D>(k8_frag, sm + S::K8 + 64 * wg * D, warp, g, c);

    for (int qs = 0; qs < nsteps; qs++) {
        const int stage = qs & 1, q0 = qs * QS;
        uint8_t *st = sm + S::STAGE0 + stage * S::STAGE_BYTES;
        uint8_t *ds = sm + S::DS + (qs % S::DS_BUFS) * S::DS_BYTES;   // this step's dSᵀ buffer
        mbar_wait(&bar.full[stage], (qs >> 1) & 1);
        float scale[H];   // sage: q_scale of block H·qs + h times k_scale (0 for a block past N)
#pragma unroll
        for (int h = 0; h < H; h++)
            scale[h] = SAGE && H * qs + h < nqb ? __fmul_rn(a.qv.q_scale[(size_t)bh * nqb + H * qs + h], k_scale) : 0.0f;

        // Sᵀ (K̂·Q̂ᵀ or K·Qᵀ) and dPᵀ = V·dOᵀ (64 keys × 64 queries per block h) in two groups, so
        // that Pᵀ = exp2(..) runs while dPᵀ is still in the tensor cores; bf16 k16 step kk of the
        // 128-byte-row tiles (Q, dO, V) is in box kk/4 at +32 bytes per step in its rows; block h
        // of Q, dO is 64 rows further
        // Sᵀ of block h: sage's int32 products in sp[h].i, flash's fp32 in sp[h].f; then Pᵀ in sp[h].f
        // (one set of registers for both)
        union { int i[32]; float f[32]; } sp[H];
        float dp[H][32] = {};
        wgmma_fence();
#pragma unroll
        for (int h = 0; h < H; h++) {
            if constexpr (SAGE) {
                const uint64_t desc_q8 = smem_desc<D>(st + S::Q8 + h * BWD90_QUERIES * D);
                wgmma_s8_scores_rs<D>(sp[h].i, k8_frag, desc_q8);
            } else {
#pragma unroll
                for (int kk = 0; kk < D / 16; kk++) {
                    uint64_t da = smem_desc<D>(sm + S::KS + (32 * kk / D) * BWD90_KEYS * D + 64 * wg * D + (32 * kk) % D);
                    uint64_t db = smem_desc<128>(st + S::Q + (kk / 4) * QS * 128 + h * BWD90_QUERIES * 128 + (kk % 4) * 32);
                    if (kk == 0) wgmma_bf16_m64n64k16_ss<0, 0, 0>(sp[h].f, da, db);
                    else wgmma_bf16_m64n64k16_ss<1, 0, 0>(sp[h].f, da, db);
                }
            }
        }
        wgmma_commit();
#pragma unroll
        for (int h = 0; h < H; h++)
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint64_t da = smem_desc<128>(sm + S::V + (kk / 4) * BWD90_KEYS * 128 + 64 * wg * 128 + (kk % 4) * 32);
                uint64_t db = smem_desc<128>(st + S::DO + (kk / 4) * QS * 128 + h * BWD90_QUERIES * 128 + (kk % 4) * 32);
                if (kk == 0) wgmma_bf16_m64n64k16_ss<0, 0, 0>(dp[h], da, db);
                else wgmma_bf16_m64n64k16_ss<1, 0, 0>(dp[h], da, db);
            }
        wgmma_commit();
        if (qs > 0) publish_dq_half();   // the previous step's dQ, while Sᵀ and dPᵀ run
        wgmma_wait<1>();   // Sᵀ done, dPᵀ may still run
#pragma unroll
        for (int h = 0; h < H; h++) {
            if constexpr (SAGE) reg_fence(sp[h].i);
            else reg_fence(sp[h].f);
        }

        // Pᵀ, then (once dPᵀ is done) dSᵀ; in block h this thread holds keys kr (e < 2), kr + 8 and
        // queries 64h + 8j + 2c + (e & 1)
        const float *s_lse = (const float *)(st + S::LSE), *s_delta = (const float *)(st + S::DELTA);
        // no masks needed (H = 2: not worth its registers)
        const bool inside = k0 + BWD90_KEYS <= N && q0 + QS <= N;
#pragma unroll
        for (int h = 0; h < H; h++) {
            const float *lse_h = s_lse + h * BWD90_QUERIES;
            const int q0_h = q0 + h * BWD90_QUERIES;
            if (H == 1 && inside) exp2_scores<SAGE, false>(sp[h].f, sp[h].i, scale[h], c_log2, lse_h, c, q0_h, N, key_valid);
            else exp2_scores<SAGE, true>(sp[h].f, sp[h].i, scale[h], c_log2, lse_h, c, q0_h, N, key_valid);
            reg_fence(sp[h].f);   // the exp2 before the wait in the PTX (ptxas may still move some after it)
        }
        wgmma_wait<0>();   // dPᵀ done
#pragma unroll
        for (int h = 0; h < H; h++) {
            reg_fence(dp[h]);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float2 delta = *(const float2 *)(s_delta + h * BWD90_QUERIES + 8 * j + 2 * c);
#pragma unroll
                for (int e = 0; e < 4; e++)
                    dp[h][4 * j + e] = sp[h].f[4 * j + e] * (dp[h][4 * j + e] - (e & 1 ? delta.y : delta.x));
            }
        }
        // bf16 A fragments, k16 step t = queries 16t..16t+15 (block t/4, accumulator columns
        // 2(t % 4), 2(t % 4) + 1); dSᵀ also to shared memory (per block: rows = keys, 64 queries =
        // 128 bytes), the MN-major A of dQ. One buffer (sage D = 128: no room for two): the other
        // warpgroup's dQ of step qs - 1 must be done reading it first.
        if (S::DS_BUFS == 1 && qs > 0) named_barrier_sync(BWD90_BAR_DS_FREE, BWD90_THREADS);
        uint32_t pa[4 * H][4], dsa[4 * H][4];
#pragma unroll
        for (int t = 0; t < 4 * H; t++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int h = t / 4, u = t % 4;
                pa[t][i] = pack_bf162(sp[h].f[8 * u + 2 * i], sp[h].f[8 * u + 2 * i + 1]);
                dsa[t][i] = pack_bf162(dp[h][8 * u + 2 * i], dp[h][8 * u + 2 * i + 1]);
                // row kr + 8(i & 1) (row % 8 = g), queries 16u + 8(i/2) + 2c of block h: 16-byte
                // chunk 2u + i/2 XOR g
                *(uint32_t *)(ds + h * S::DS_BLOCK + (ds_row ^ (32 * u + 16 * (i / 2))) + 1024 * (i & 1)) = dsa[t][i];
            }

        // FA3's order: dV (RS); the one barrier (dSᵀ of both warpgroups in shared memory); dQ (SS);
        // wait for dV; dK (RS); wait for dQ and store it while dK runs. dO and Q rows are the
        // MN-major B of dV and dK (16 queries = 2 groups of 8 rows; the H blocks are contiguous).
        // dV reads no dSᵀ, so it is issued before the proxy fence, which waits for the dSᵀ stores.
        wgmma_fence();
#pragma unroll
        for (int t = 0; t < 4 * H; t++) dkv_wgmma<D>(dv, pa[t], smem_desc_mn<128>(st + S::DO + t * 2048, QS * 128));
        wgmma_commit();
        fence_proxy_async();   // the dSᵀ stores before the other warpgroup's dQ wgmma reads them
        named_barrier_sync(BWD90_BAR_DS, BWD90_THREADS);

        // dQ over the 128 keys (sage: k - k_mean), 16 keys per k-step. H = 1: dQ[:, wg·D/2 ..] of
        // the step's 64 queries (K box wg); H = 2: all D columns of block wg (dSᵀ block wg, both
        // K boxes, BWD90_KEYS·D bytes apart)
        float dq[NCOL / 2] = {};
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BWD90_KEYS / 16; ks++) {
            uint64_t desc_a = smem_desc_mn<128>(ds + (H == 2 ? wg * S::DS_BLOCK : 0) + ks * 2048, BWD90_QUERIES * 128);
            uint64_t desc_b = smem_desc_mn<D>(sm + S::KS + (H == 1 ? wg * BWD90_KEYS * D : 0) + ks * 16 * D, BWD90_KEYS * D);
            if (ks == 0) dq_wgmma<NCOL, 0>(dq, desc_a, desc_b);
            else dq_wgmma<NCOL, 1>(dq, desc_a, desc_b);
        }
        wgmma_commit();
        wgmma_wait<1>();   // dV done
        reg_fence(dv);
#pragma unroll
        for (int t = 0; t < 4 * H; t++) reg_fence(pa[t]);
        wgmma_fence();
#pragma unroll
        for (int t = 0; t < 4 * H; t++) dkv_wgmma<D>(dk, dsa[t], smem_desc_mn<128>(st + S::Q + t * 2048, QS * 128));
        wgmma_commit();
        wgmma_wait<1>();   // dQ done, dK may still run
        reg_fence(dq);
        // The stage goes back to the loader once dK is done. Unordered dQ: our half of the dQ tile
        // is normally free again, so it is stored while dK runs; ordered dQ: the writer hands it
        // back only after the turn of the previous step's block came, so the stage is released
        // before waiting. Either way it is published in the next step (or after the last).
        if (a.dq_turn) {
            release_stage(&bar.empty[stage], dk, dsa);
            store_dq_half<NCOL>(sm + S::DQ, wg, dq, inv_sqrt_d, qs);
        } else {
            store_dq_half<NCOL>(sm + S::DQ, wg, dq, inv_sqrt_d, qs);
            release_stage(&bar.empty[stage], dk, dsa);
        }
    }
    publish_dq_half();   // the last step's

    store_key_block_grads<D>(a, bh, k0 + kr, key_valid, dk, dv, inv_sqrt_d);
#else
    __trap();   // built without sm_90a code: *_backward_sm90_available() says 0
#endif
}
