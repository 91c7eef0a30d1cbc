// Sage attention forward for Hopper (sm_90a): wgmma tensor-core instructions fed by TMA tile loads.
// Same math as the mma.sync kernel of sage_forward.cu in FP8 mode (q_block = k_block = 64, so the
// CPU definition with its defaults is the reference); it exists because on Hopper the e4m3
// mma.sync is emulated through f16 HMMA and only wgmma runs 8-bit operands at the 8-bit rate.
// Per 64-query block (one q_scale block) and key block kb (64 keys, one k_scale block):
//   S = Q8·K8ᵀ     wgmma m64n64k32 s8, int32 accumulators
//   online softmax in base 2 over the 64-key step of the definition (softmax_max, softmax_exp),
//   P8 = e4m3(448·p) packed in registers straight from the S accumulators (pack_p8): the
//        quantization pass stores V̂ᵀ with the tokens of each group of 16 in the A-fragment
//        order (sage_cuda.h)
//   blk = P8·V8    wgmma m64n64k32 e4m3 per 64 channels of D, A from registers, V̂ᵀ (K-major)
//                  from shared memory
//   O = O·alpha + blk   (the definition's two-level fp32 accumulation)
// and finally out = O·v_scale/l' and lse = m + log2(l') − log2 448, with l' = Σ p' = 448·l.
// FP16 P·V (SAGE_PV_FP16; the FP8 parts above are the template's FP8 = true): p =
// exp2(s − m) without the 448, P16 = fp16(p) packed from the S accumulators into the four k16 A
// fragments (the m64n64 accumulator layout is the m64n64k16 A layout, so V̂ᵀ = fp16(v)ᵀ keeps token
// order), V̂ᵀ rows of 64 tokens × 2 bytes; O = O·alpha + P16·V16 with the product added in place
// to O's registers by wgmma f16 (fp32 accumulation: the definition's sum to float rounding; O·alpha
// skipped when no row maximum of a warp moved), out = O/l, lse = m + log2(l).
//
// Two CTA layouts, each measured faster at its head dim (dev/notes_sage_fwd.md):
// D = 128: sage_forward_sm90_kernel, persistent and warp-specialized (the FA3 structure), one
//   CTA per SM looping over tiles of 192 queries × one head:
//   producer warpgroup (registers given back by setmaxnreg): one thread drives the TMA unit:
//     the tile's Q̂ (3 × 64 rows), then K̂ and V̂ᵀ tiles of 64 keys through SM90_STAGES shared
//     stages, each with a "full" mbarrier (TMA bytes landed) and an "empty" one (every consumer
//     is done with it); the next tile's Q̂ once every consumer's last S of the tile has completed.
//   The schedule (Sm90Schedule) takes every head's full tiles first and the heads' last, partial
//   tiles (nblk not a multiple of 3: one or two query blocks, the other consumers only release
//   the stages) after them, so that the light tiles fill the last round instead of whole CTAs
//   getting only full ones. When the full tiles' last round would leave at least half of the SMs
//   idle (c: 1360 full tiles on 132 SMs, 40 in the 11th round), each of its tiles runs as two
//   units on two CTAs: query blocks 0 and 1 (consumers 0 and 1; consumer 2 only releases the
//   stages) and query block 2 (consumer 2 alone). Every row is computed by the same instructions
//   in the same order: the results are bitwise those of whole tiles in any order.
//   3 consumer warpgroups (three warps per scheduler, so that one's softmax overlaps another's
//     wgmmas), 64 query rows each, 160 registers: FP8 keeps Q̂ in shared memory (S wgmma with both
//     operands there; no registers left beside blk) and P·V runs as two m64n64 halves of D (blk
//     holds 32 columns); FP16 holds Q̂ in registers as S's A operand (load_s8_a_fragments). Per key block
//     kb: S_kb and the first half of blk = P8_{kb-1}·V8 are issued together; the row max of S_kb
//     runs while that half is in the tensor core; then O[:, 0:64] = O·alpha_{kb-1} + blk, the
//     second half is issued, the exp2s of S_kb run while it is in the tensor core, and
//     O[:, 64:128] = O·alpha_{kb-1} + blk. FP16: O·alpha_{kb-1}, then S_kb and P16_{kb-1}·V16
//     (into O, m64n128k16) issued together, the row max and exp2s of S_kb while both run.
//   The epilogue (stage_tile) writes out's bf16 tile into the consumer's shared-memory tile and one
//   thread hands it to the TMA unit (two stores, async): as 32 scattered 4-byte global stores per
//   thread it took ~8,300 cycles a tile, 5 key blocks' time (dev/notes_sage_fwd.md, session 24).
// D = 64: sage_forward_wg_kernel, one warpgroup CTA per (64-query block, head), 5 CTAs per SM
//   that overlap each other's softmax and tensor work; its thread 0 issues the TMA loads (Q̂ once,
//   K̂/V̂ᵀ through SM90_WG_STAGES stages, at the end the TMA store of out, staged where K̂ was),
//   and S, softmax, P·V run one after the other (FP8 and FP16 alike; FP8: 29 KB of shared memory,
//   held to 96 registers by its launch bounds, 1.7–3.7% faster than at its free 120 and 4 CTAs;
//   FP16: 41 KB and 90 registers: dev/notes_sage_fwd.md).
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include "attention/sage_cuda.h"
#include "attention/attention_rows.cuh"
#include "attention/sage_mma.cuh"
#include "attention/wgmma.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

#define SM90_STAGES 4         // K̂/V̂ tiles in flight (warp-specialized kernel)
#define SM90_WG_STAGES 3      // K̂/V̂ tiles in flight (one-warpgroup kernel)
#define SM90_PRODUCER_REGS 24 // what the producer warpgroup keeps (setmaxnreg)

// The warp-specialized CTA's shape and shared memory; every tile is a whole number of 1024-byte
// swizzle atoms. A D = 128 consumer holds O (64 registers), half of blk (32), S or p' (32) and P8
// (8): 157 registers with the rest, so 3 consumers (FP16: no blk, P16 of 16 in place of P8). The
// CTA starts with LAUNCH_REGS per thread
// (the SM's 64K registers over THREADS, in steps of 8); setmaxnreg can only hand the consumers
// what the producer warpgroup gives back (LAUNCH_REGS − 24 per thread; a consumer asking for more
// waits forever), so CONSUMER_REGS = LAUNCH_REGS + (LAUNCH_REGS − 24)/CONSUMERS: 128 → 160.
template <int D, bool FP8> struct Sm90Smem {
    static constexpr int CONSUMERS = 3;
    static constexpr int THREADS = 128 * (CONSUMERS + 1);
    static constexpr int TILE_Q = SAGE_CUDA_BLOCK * CONSUMERS;   // query rows of one tile
    static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
    static constexpr int CONSUMER_REGS = (LAUNCH_REGS + (LAUNCH_REGS - SM90_PRODUCER_REGS) / CONSUMERS) / 8 * 8;
    static constexpr int Q_BYTES = SAGE_CUDA_BLOCK * D;    // 64 queries × D int8 per consumer, rows of D bytes
    static constexpr int K_BYTES = SAGE_CUDA_BLOCK * D;    // 64 keys × D int8
    static constexpr int V_ROW_BYTES = SAGE_CUDA_BLOCK * (FP8 ? 1 : 2);   // 64 keys e4m3 or fp16
    static constexpr int V_BYTES = D * V_ROW_BYTES;        // D channels × 64 keys
    static constexpr int STAGE_BYTES = K_BYTES + V_BYTES;
    static constexpr int O_BYTES = SAGE_CUDA_BLOCK * D * 2;   // a consumer's bf16 output tile for the TMA store
    // (+ 1024: alignment slack)
    static constexpr int TOTAL = 1024 + CONSUMERS * (Q_BYTES + O_BYTES) + SM90_STAGES * STAGE_BYTES;
};

// Shared memory of the one-warpgroup kernel: Q̂ and SM90_WG_STAGES stages of K̂, V̂ᵀ (the stage
// layout of load_kv).
template <int D, bool FP8> struct Sm90WgSmem {
    static constexpr int Q_BYTES = SAGE_CUDA_BLOCK * D, K_BYTES = Sm90Smem<D, FP8>::K_BYTES;
    static constexpr int V_ROW_BYTES = Sm90Smem<D, FP8>::V_ROW_BYTES, V_BYTES = Sm90Smem<D, FP8>::V_BYTES;
    static constexpr int STAGE_BYTES = K_BYTES + V_BYTES;
    static constexpr int TOTAL = 1024 + Q_BYTES + SM90_WG_STAGES * STAGE_BYTES;   // + alignment slack
};

// The D = 128 kernel's work list (made by sm90_schedule on the host). Tiles in order o: the
// `full` tiles of 3 query blocks, head by head (o → head o / (nblk/3), query tile o % (nblk/3)),
// then each head's partial last tile when nblk % 3 != 0 (o ≥ full: head o − full). Units u: below
// `whole` the tiles o = u; from `whole` to `split_end` pairs, the two halves of tile whole +
// (u − whole) / 2 (half 0 its query blocks 0 and 1, half 1 block 2); from `split_end` on tiles
// again, o = u − (split_end − whole) / 2. CTA b takes units b, b + gridDim.x, ...
typedef struct {
    int full, whole, split_end, units;
} Sm90Schedule;

// The CTA's mbarriers (static shared memory).
struct Sm90Barriers {
    uint64_t q_full;                  // the tile's Q̂ landed (TMA bytes)
    uint64_t q_empty;                 // every consumer warp's S wgmmas of the tile have completed
    uint64_t kv_full[SM90_STAGES];    // K̂, V̂ᵀ of a key block landed (TMA bytes)
    uint64_t kv_empty[SM90_STAGES];   // every consumer warp is done with the stage
};

#ifdef SAGE_SM90_DEVICE
#define LOG2_448 8.807354922057604f

// Online softmax of one 64 × 64 block (this thread holds keys 8j + 2c + (e & 1) of rows g (e < 2)
// and g + 8 (e >= 2) in s[4j + e]): the definition's per-64-key step, in two halves so that the
// caller can put the previous block's O update between them (the row max and its shuffles need S
// only; the exp2s and the O update then share the issue slots while the ex2 unit is busy).
// softmax_max: the row statistics m, alpha (and l *= alpha) and the exp2 offset;
// softmax_exp: p'[i] = 448·p (floats, same layout) and l += Σ p'. FP16 (FP8 = false): offset −m,
// so p' = p and l' = l.
// Few instructions per element (the kernel is issue-bound; the definition's order of operations
// cost ~12 per element, this ~7.5 at D = 128): the row max is taken on the int32 S (rn is monotonic
// and scale >= 0, so rn(max S · scale) is the definition's max, bit for bit), and
// p' = exp2(S·scale − (m − log2 448)) comes from one FFMA and one ex2 per element, so P8 = e4m3(p')
// needs no ×448 and l' = Σ p' = 448·l (the epilogue divides by l' and subtracts log2 448 from the
// lse). Differences from the definition: S·scale − m rounded once instead of twice (~1e-7
// relative in p). Keys >= N are handled only in the tail block (`valid` < 64): left out of the
// max, p' = 0 after the exp2.
template <bool FP8>
__device__ __forceinline__ void softmax_max(float (&offset)[2], float (&alpha)[2], float (&m)[2], float (&l)[2],
                                            const int (&s)[32], float scale, int valid, int c) {
    int smax[2] = {INT_MIN, INT_MIN};
    if (valid < SAGE_CUDA_BLOCK) {
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (8 * (i / 4) + 2 * c + (i & 1) < valid) smax[(i % 4) / 2] = max(smax[(i % 4) / 2], s[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 32; i++) smax[(i % 4) / 2] = max(smax[(i % 4) / 2], s[i]);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        smax[r] = max(smax[r], __shfl_xor_sync(0xffffffffu, smax[r], 1));
        smax[r] = max(smax[r], __shfl_xor_sync(0xffffffffu, smax[r], 2));
        float m_new = fmaxf(m[r], __fmul_rn((float)smax[r], scale));
        alpha[r] = exp2f(m[r] - m_new);
        m[r] = m_new;
        l[r] *= alpha[r];
        offset[r] = FP8 ? LOG2_448 - m_new : -m_new;
    }
}
__device__ __forceinline__ void softmax_exp(float (&p)[32], float (&l)[2], const int (&s)[32], float scale,
                                            const float (&offset)[2], int valid, int c) {
#pragma unroll
    for (int i = 0; i < 32; i++) p[i] = exp2f(fmaf((float)s[i], scale, offset[(i % 4) / 2]));
    if (valid < SAGE_CUDA_BLOCK) {
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (8 * (i / 4) + 2 * c + (i & 1) >= valid) p[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 32; i++) l[(i % 4) / 2] += p[i];
}

// P8 = e4m3(p') packed straight from the accumulator layout into the two k32 A fragments of the
// P·V wgmma: a[t][2h] row g, a[t][2h + 1] row g + 8, key chunks 4t+2h, 4t+2h+1 (the V̂ᵀ token
// order of the quantization pass makes this the right key order).
__device__ __forceinline__ void pack_p8(uint32_t (&a)[2][4], const float (&p)[32]) {
#pragma unroll
    for (int t = 0; t < 2; t++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float *p0 = p + 4 * (4 * t + 2 * h), *p1 = p0 + 4;
            a[t][2 * h] = pack_e4m3x2(p0[0], p0[1]) | (uint32_t)pack_e4m3x2(p1[0], p1[1]) << 16;
            a[t][2 * h + 1] = pack_e4m3x2(p0[2], p0[3]) | (uint32_t)pack_e4m3x2(p1[2], p1[3]) << 16;
        }
}

// P16 = fp16(p) packed straight from the accumulator layout into the four k16 A fragments of the
// P·V wgmma: a[t][e] holds elements 8t + 2e and 8t + 2e + 1 (rows and keys: softmax_exp_p16_pairs).
__device__ __forceinline__ void pack_p16(uint32_t (&a)[4][4], const float (&p)[32]) {
#pragma unroll
    for (int i = 0; i < 32; i += 2) a[i / 8][(i % 8) / 2] = pack_half2(p[i], p[i + 1]);
}

// FP16 at D = 64 (offset −m from softmax_max<false>): p = exp2(s − m) of the block's 32 elements
// of the accumulator layout, l += Σ p (fp32, unrounded), and P16 = fp16(p) packed straight into the
// k16 A fragments of the P·V wgmma as it goes (pack_p16's layout: a[t][0] row g, keys 16t + 2c, +1;
// a[t][1] row g + 8; a[t][2], a[t][3] the same rows at keys 16t + 8 + 2c; the m64n64 accumulator
// layout is the k16 A layout: token order, no permutation of V̂ᵀ). (One exp2 loop shared with
// FP8's softmax_exp, then pack_p16, measured 2-5% slower here: dev/notes_sage_fwd.md.)
template <bool TAIL>
__device__ __forceinline__ void softmax_exp_p16_pairs(uint32_t (&a)[4][4], float (&l)[2], const int (&s)[32],
                                                      float scale, const float (&offset)[2], int valid, int c) {
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
        float p0 = exp2f(fmaf((float)s[i], scale, offset[(i % 4) / 2]));
        float p1 = exp2f(fmaf((float)s[i + 1], scale, offset[(i % 4) / 2]));
        if (TAIL) {
            int key = 8 * (i / 4) + 2 * c;
            if (key >= valid) p0 = 0.0f;
            if (key + 1 >= valid) p1 = 0.0f;
        }
        l[(i % 4) / 2] += p0 + p1;
        a[i / 8][(i % 8) / 2] = pack_half2(p0, p1);
    }
}
// The tail test outside the loop (inside it, the masks' key indices were computed on every block:
// the D = 128 forward 5-6% slower, dev/notes_sage_fwd.md).
__device__ __forceinline__ void softmax_exp_p16(uint32_t (&a)[4][4], float (&l)[2], const int (&s)[32], float scale,
                                                const float (&offset)[2], int valid, int c) {
    if (valid < SAGE_CUDA_BLOCK)
        softmax_exp_p16_pairs<true>(a, l, s, scale, offset, valid, c);
    else
        softmax_exp_p16_pairs<false>(a, l, s, scale, offset, valid, c);
}

// TMA thread: key block `kb` of head `bh`, K̂ (rows of D bytes) and V̂ᵀ (rows of 64 keys: 64 bytes
// e4m3, 128 bytes fp16), into `stage`.
template <int D, bool FP8>
__device__ __forceinline__ void load_kv(uint8_t *sK, uint8_t *sV, uint64_t *full, const CUtensorMap *map_k,
                                        const CUtensorMap *map_v, int bh, int N, int kb) {
    using S = Sm90Smem<D, FP8>;
    mbar_expect_bytes(full, S::STAGE_BYTES);
    tma_load_2d(sK, map_k, full, 0, bh * N + kb * SAGE_CUDA_BLOCK);
    tma_load_2d(sV, map_v, full, kb * S::V_ROW_BYTES, bh * D);
}

// S = Q8·K8ᵀ (64 × 64 int32) over D/32 k32 steps, Q̂ and K̂ (one stage) from shared memory.
template <int D>
__device__ __forceinline__ void qk_wgmma(int (&s)[32], uint64_t desc_q, uint64_t desc_k) {
    wgmma_s8_m64n64k32<0>(s, desc_q, desc_k);
#pragma unroll
    for (int ks = 1; ks < D / 32; ks++)
        wgmma_s8_m64n64k32<1>(s, desc_advance(desc_q, 32 * ks), desc_advance(desc_k, 32 * ks));
}

// FP16 at D = 128: Q̂ as the register A operand of the S wgmma (load_s8_a_fragments; the FP8
// consumer has no registers left for it beside blk; the FP16 one has, and S then reads only K̂ from
// shared memory: 1.3-3.0% faster, dev/notes_sage_fwd.md); S by wgmma_s8_scores_rs.
// S of the D = 128 consumer: Q̂ from shared memory (FP8) or from registers (FP16).
template <int D, bool FP8>
__device__ __forceinline__ void consumer_qk_wgmma(int (&s)[32], const uint32_t (&q)[D / 32][4], uint64_t desc_q,
                                                  uint64_t desc_k) {
    if constexpr (FP8)
        qk_wgmma<D>(s, desc_q, desc_k);
    else
        wgmma_s8_scores_rs<D>(s, q, desc_k);
}

// blk = P8·V8 for 64 output channels over one block's 64 keys (two k32 steps, m64n64k32 e4m3):
// desc_v addresses those channels' 64 rows of V̂ᵀ (rows of 64 bytes, K-major) in one stage. The
// D = 64 kernel takes all of V̂ᵀ at once.
__device__ __forceinline__ void pv_wgmma(float (&blk)[32], const uint32_t (&p)[2][4], uint64_t desc_v) {
    wgmma_e4m3_m64n64k32<0>(blk, p[0], desc_v);
    wgmma_e4m3_m64n64k32<1>(blk, p[1], desc_advance(desc_v, 32));
}
// Half h (channels 64h..64h + 63, 4096 bytes into the stage's V̂ᵀ, whose descriptor is desc_v) of a
// D = 128 P·V; blk[i] is then o[32h + i] of the m64n128 accumulator layout. (Per output value the
// same 64-term dot product as one m64n128 wgmma; the tensor core's fp32 rounding inside a k32 step
// can differ in the last bit: O within rel L2 5e-7 of the m64n128 version, dev/notes_sage_fwd.md.)
__device__ __forceinline__ void pv_half_wgmma(float (&blk)[32], const uint32_t (&p)[2][4], uint64_t desc_v, int h) {
    pv_wgmma(blk, p, desc_advance(desc_v, h * 64 * SAGE_CUDA_BLOCK));
}
// FP16: O += P16·V16 over one block's 64 keys, accumulated in place in O's fp32 wgmma registers
// (m64nD accumulator layout): four k16 steps of m64nDk16 f16 over V̂ᵀ rows of 128 bytes (64 fp16
// tokens; desc_v addresses the stage; a k16 step is 32 bytes along the row). An f16 wgmma adds in
// fp32, so this is the definition's O·alpha + blk to float rounding, with no blk registers and no
// O update instructions (the FP8 accumulator is narrower: FP8 keeps blk, pv_wgmma).
template <int D>
__device__ __forceinline__ void pv_f16_accumulate(float (&o)[D / 2], const uint32_t (&p)[4][4], uint64_t desc_v) {
#pragma unroll
    for (int t = 0; t < 4; t++) {
        if constexpr (D == 128)
            wgmma_f16_m64n128k16_rs<1>(o, p[t], desc_advance(desc_v, 32 * t));
        else
            wgmma_f16_m64n64k16_rs<1>(o, p[t], desc_advance(desc_v, 32 * t));
    }
}

__device__ __forceinline__ void store_shared_b32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// The epilogue of both kernels: O (64 × D, this thread's accumulator registers) as bf16 into a tile
// in shared memory, laid out as the TMA store reads it (tma_map_head_rows): D / 64 boxes (channels
// 0-63, 64-127) of 64 rows × 128 bytes, 128-byte swizzled; lse of rows < N straight to global
// memory (row0: the tile's first row). o = 448·Σ p·v̂ and l = 448·Σ p, so out = o·v_scale/l and
// lse = m + log2 l − log2 448; FP16 (vs unused): out = o/l and lse = m + log2 l. Thread (warp wq,
// g = lane / 4, c = lane % 4) holds rows 16wq + g and + 8 (row % 8 = g) at channels 8j + 2c, +1:
// box j / 8, 16-byte chunk (j % 8) XOR g, byte 4c (the 32 lanes of a store hit 32 banks). (As 32
// scattered 4-byte global stores per thread, the D = 128 epilogue took ~8,300 cycles a tile.)
template <int D, bool FP8>
__device__ __forceinline__ void stage_tile(uint32_t tile, float *lse, const float (&o)[D / 2], float (&l)[2],
                                           const float (&m)[2], const float *vs, int bh, int N, int row0) {
    int t = thread_index() % 128, wq = t / 32, g = t % 32 / 4, c = t % 4;
    // one per-thread base with the swizzle folded in: row 16wq + g, chunk g, byte 4c; row + 8 is
    // 1024 bytes on and chunk j % 8 an XOR (bits 4-6 of the base hold g alone)
    uint32_t base = (16 * wq + g) * 128 + (g << 4) + 4 * c;
    float inv_l[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv_l[r] = 1.0f / l[r];
        int row = row0 + 16 * wq + g + 8 * r;
        if (c == 0 && row < N) lse[(size_t)bh * N + row] = FP8 ? m[r] + (log2f(l[r]) - LOG2_448) : m[r] + log2f(l[r]);
    }
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        int col = 8 * j + 2 * c;
        float v0 = FP8 ? vs[col] : 1.0f, v1 = FP8 ? vs[col + 1] : 1.0f;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            __nv_bfloat162 pair =
                FP8 ? __floats2bfloat162_rn(o[4 * j + 2 * r] * v0 * inv_l[r], o[4 * j + 2 * r + 1] * v1 * inv_l[r])
                    : __floats2bfloat162_rn(o[4 * j + 2 * r] * inv_l[r], o[4 * j + 2 * r + 1] * inv_l[r]);
            store_shared_b32(tile + ((base ^ ((j % 8) << 4)) + (j / 8) * (SAGE_CUDA_BLOCK * 128) + 1024 * r),
                             *(uint32_t *)&pair);
        }
    }
}

// Unit u's tile as bh · ntq + query tile, and its half (-1: the whole tile).
__device__ __forceinline__ int unit_tile(int u, const Sm90Schedule &s, int nblk, int ntq) {
    int o = u < s.whole ? u : u < s.split_end ? s.whole + (u - s.whole) / 2 : u - (s.split_end - s.whole) / 2;
    int per_head = nblk / Sm90Smem<128, true>::CONSUMERS;   // full tiles of a head
    return o < s.full ? o / per_head * ntq + o % per_head : (o - s.full) * ntq + per_head;
}
__device__ __forceinline__ int unit_half(int u, const Sm90Schedule &s) {
    return u >= s.whole && u < s.split_end ? (u - s.whole) % 2 : -1;
}
// Whether consumer wg computes in unit u of query tile qt (the others only release the unit's
// stages): its query block exists and is in the unit's half.
__device__ __forceinline__ bool unit_consumer_busy(int u, const Sm90Schedule &s, int qt, int nblk, int wg) {
    int half = unit_half(u, s);
    return qt * Sm90Smem<128, true>::CONSUMERS + wg < nblk && (half < 0 || (half == 0 ? wg < 2 : wg == 2));
}

// The producer thread's whole life: for each tile of this CTA, Q̂ (once every S wgmma of the
// consumers' previous tile has completed), then every key block through the stages. `it` counts key
// blocks over all tiles: stage it % SM90_STAGES, round it / SM90_STAGES.
template <int D, bool FP8>
__device__ void produce(Sm90Barriers *bar, uint8_t *sQ, uint8_t *sK, uint8_t *sV, const CUtensorMap *map_q,
                        const CUtensorMap *map_k, const CUtensorMap *map_v, int N, int nblk, int ntq,
                        const Sm90Schedule &sch) {
    using S = Sm90Smem<D, FP8>;
    int it = 0, round_q = 0;
    for (int u = blockIdx.x; u < sch.units; u += gridDim.x, round_q++) {
        int tile = unit_tile(u, sch, nblk, ntq), bh = tile / ntq, qt = tile % ntq, half = unit_half(u, sch);
        if (round_q > 0) mbar_wait(&bar->q_empty, (round_q - 1) & 1);
        int nq = min(S::CONSUMERS, nblk - qt * S::CONSUMERS);   // query blocks in this tile
        int w0 = 0, w1 = nq;   // the query blocks whose Q̂ the unit needs (unit_consumer_busy)
        if (half == 0) w1 = min(nq, 2);
        if (half == 1) w0 = 2;
        mbar_expect_bytes(&bar->q_full, max(w1 - w0, 0) * S::Q_BYTES);
        for (int w = w0; w < w1; w++)
            tma_load_2d(sQ + w * S::Q_BYTES, map_q, &bar->q_full, 0, bh * N + qt * S::TILE_Q + w * SAGE_CUDA_BLOCK);
        for (int kb = 0; kb < nblk; kb++, it++) {
            int stage = it % SM90_STAGES;
            if (it >= SM90_STAGES) mbar_wait(&bar->kv_empty[stage], (it / SM90_STAGES - 1) & 1);
            load_kv<D, FP8>(sK + stage * S::K_BYTES, sV + stage * S::V_BYTES, &bar->kv_full[stage], map_k, map_v, bh,
                            N, kb);
        }
    }
}

// The consumers' output tiles (Sm90Smem::O_BYTES each) after the K̂/V̂ᵀ stages, from the 1024-aligned
// base of dynamic shared memory (Q̂ tiles, K̂ stages, V̂ᵀ stages, output tiles).
extern __shared__ uint8_t smem_raw[];
template <int D, bool FP8> __device__ __forceinline__ uint8_t *sm90_output_tiles() {
    using S = Sm90Smem<D, FP8>;
    uint8_t *base = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    return base + S::CONSUMERS * S::Q_BYTES + SM90_STAGES * S::STAGE_BYTES;
}

// Consumer warpgroup `wg`: rows 64·wg.. of each of this CTA's tiles.
template <int D, bool FP8>
__device__ void consume(Sm90Barriers *bar, const uint8_t *sQ, const uint8_t *sK, const uint8_t *sV,
                        const CUtensorMap *map_o, float *lse, const SageCudaQuant &qv, int N, int merged_heads,
                        int nblk, int ntq, const Sm90Schedule &sch, int wg) {
    static_assert(D == 128, "the warp-specialized kernel is the D = 128 layout (two P·V halves)");
    using S = Sm90Smem<D, FP8>;
    constexpr int BN = SAGE_CUDA_BLOCK;
    int t = threadIdx.x % 128, lane = t % 32, c = lane % 4;
    // `it` unsigned: stage and round are a mask and a shift; the stages' descriptors are offsets
    // from the first's (a few uniform instructions per key block instead of a dozen each)
    unsigned it = 0;
    int round_q = 0;
    const uint64_t desc_k0 = smem_desc<D>(sK), desc_v0 = smem_desc<S::V_ROW_BYTES>(sV);
    for (int u = blockIdx.x; u < sch.units; u += gridDim.x, round_q++) {
        int tile = unit_tile(u, sch, nblk, ntq), bh = tile / ntq, qt = tile % ntq;
        // (the shuffle tells the compiler what holds anyway, that the branch is uniform per warp:
        // otherwise the loop's stage counter leaves the uniform registers and the loop spills)
        if (!__shfl_sync(0xffffffffu, unit_consumer_busy(u, sch, qt, nblk, wg), 0)) {   // release the stages
            mbar_wait(&bar->q_full, round_q & 1);
            for (int kb = 0; kb < nblk; kb++, it++) {
                unsigned stage = it % SM90_STAGES;
                mbar_wait(&bar->kv_full[stage], (it / SM90_STAGES) & 1);
                __syncwarp();
                if (lane == 0) mbar_arrive(&bar->kv_empty[stage]);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&bar->q_empty);
            continue;
        }
        int qb = qt * S::CONSUMERS + wg;   // this warpgroup's 64 query rows: quantization block qb
        const float q_scale = qv.q_scale[(size_t)bh * nblk + qb];
        const float *k_scale = qv.k_scale + (size_t)bh * nblk;
        mbar_wait(&bar->q_full, round_q & 1);
        // (shuffled so that the compiler sees it warp-uniform and keeps it in uniform registers:
        // otherwise each S wgmma copies it over from vector registers)
        const uint64_t desc_q = __shfl_sync(0xffffffffu, smem_desc<D>(sQ + wg * S::Q_BYTES), 0);
        uint32_t q_frag[D / 32][4];        // FP16 only: Q̂ as S's register A operand
        if constexpr (!FP8) load_s8_a_fragments<D>(q_frag, sQ + wg * S::Q_BYTES, t / 32, lane / 4, c);

        float o[D / 2] = {};               // accumulator layout of m64nD (wgmma.cuh)
        int s[32];                         // accumulator layout of m64n64
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, alpha[2];

        // key block 0: S only
        unsigned stage = it % SM90_STAGES;
        mbar_wait(&bar->kv_full[stage], (it / SM90_STAGES) & 1);
        wgmma_fence();
        consumer_qk_wgmma<D, FP8>(s, q_frag, desc_q, desc_advance(desc_k0, stage * S::K_BYTES));
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(s);
        float offset[2], scale = __fmul_rn(q_scale, k_scale[0]);
        softmax_max<FP8>(offset, alpha, m, l, s, scale, N, c);
        if constexpr (FP8) {
            float blk[32];                 // accumulator layout of m64n64
            float pf[32];                  // p' of block kb, accumulator layout
            uint32_t p[2][4];              // P8 of block kb - 1 as k32 A fragments
            float alpha_next[2];           // alpha of block kb while blk still needs that of kb - 1
            softmax_exp(pf, l, s, scale, offset, N, c);
            pack_p8(p, pf);

            for (int kb = 1; kb < nblk; kb++) {
                unsigned prev = stage;
                it++;
                stage = it % SM90_STAGES;
                mbar_wait(&bar->kv_full[stage], (it / SM90_STAGES) & 1);
                wgmma_fence();
                qk_wgmma<D>(s, desc_q, desc_advance(desc_k0, stage * S::K_BYTES));
                wgmma_commit();
                const uint64_t desc_v = desc_advance(desc_v0, prev * S::V_BYTES);
                pv_half_wgmma(blk, p, desc_v, 0);
                wgmma_commit();
                wgmma_wait<1>();   // S of block kb done; the first half of P·V of block kb - 1 may still run
                reg_fence(s);
                scale = __fmul_rn(q_scale, k_scale[kb]);
                softmax_max<FP8>(offset, alpha_next, m, l, s, scale, N - kb * BN, c);
                wgmma_wait<0>();
                reg_fence(blk);
#pragma unroll
                for (int i = 0; i < 32; i++) o[i] = o[i] * alpha[(i % 4) / 2] + blk[i];
                wgmma_fence();   // orders the reads of blk above before the second half overwrites it
                pv_half_wgmma(blk, p, desc_v, 1);
                wgmma_commit();
                softmax_exp(pf, l, s, scale, offset, N - kb * BN, c);
                wgmma_wait<0>();
                reg_fence(blk);
                reg_fence(p[0]);
                reg_fence(p[1]);
                if (lane == 0) mbar_arrive(&bar->kv_empty[prev]);
#pragma unroll
                for (int i = 0; i < 32; i++) o[32 + i] = o[32 + i] * alpha[(i % 4) / 2] + blk[i];
#pragma unroll
                for (int r = 0; r < 2; r++) alpha[r] = alpha_next[r];
                pack_p8(p, pf);   // the P·V that read p has completed
            }

            // the last block's P·V
#pragma unroll
            for (int h = 0; h < 2; h++) {
                wgmma_fence();
                pv_half_wgmma(blk, p, desc_advance(desc_v0, stage * S::V_BYTES), h);
                wgmma_commit();
                wgmma_wait<0>();
                reg_fence(blk);
#pragma unroll
                for (int i = 0; i < 32; i++) o[32 * h + i] = o[32 * h + i] * alpha[(i % 4) / 2] + blk[i];
            }
            reg_fence(p[0]);
            reg_fence(p[1]);
        } else {
            // FP16: P·V accumulates in place in O (pv_f16_accumulate). Per key block kb: O *=
            // alpha_{kb-1}, then S_kb and P16_{kb-1}·V16 issued together; the row max and the exp2s
            // of S_kb run while both are in the tensor core, and p is packed into P16 once the P·V
            // that read the previous P16 has completed (packing while it runs, ptxas gave the new
            // P16 the old one's registers and serialized every wgmma, C7513).
            float pf[32];                  // p of block kb (accumulator layout)
            uint32_t p[4][4];              // P16 of block kb - 1 as k16 A fragments
            softmax_exp(pf, l, s, scale, offset, N, c);
            pack_p16(p, pf);

            for (int kb = 1; kb < nblk; kb++) {
                unsigned prev = stage;
                it++;
                stage = it % SM90_STAGES;
                rescale_o(o, alpha);
                mbar_wait(&bar->kv_full[stage], (it / SM90_STAGES) & 1);
                wgmma_fence();
                wgmma_s8_scores_rs<D>(s, q_frag, desc_advance(desc_k0, stage * S::K_BYTES));
                wgmma_commit();
                pv_f16_accumulate<D>(o, p, desc_advance(desc_v0, prev * S::V_BYTES));
                wgmma_commit();
                wgmma_wait<1>();   // S of block kb done; the P·V of block kb - 1 may still run
                reg_fence(s);
                scale = __fmul_rn(q_scale, k_scale[kb]);
                softmax_max<FP8>(offset, alpha, m, l, s, scale, N - kb * BN, c);
                softmax_exp(pf, l, s, scale, offset, N - kb * BN, c);
                wgmma_wait<0>();
                reg_fence(o);
#pragma unroll
                for (int k = 0; k < 4; k++) reg_fence(p[k]);
                if (lane == 0) mbar_arrive(&bar->kv_empty[prev]);
                pack_p16(p, pf);   // the P·V that read p has completed
            }

            // the last block's P·V
            rescale_o(o, alpha);
            wgmma_fence();
            pv_f16_accumulate<D>(o, p, desc_advance(desc_v0, stage * S::V_BYTES));
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(o);
#pragma unroll
            for (int k = 0; k < 4; k++) reg_fence(p[k]);
        }
        __syncwarp();
        if (lane == 0) {
            mbar_arrive(&bar->kv_empty[stage]);
            mbar_arrive(&bar->q_empty);   // every S of this tile has completed
        }
        it++;
        // the epilogue: O through this consumer's shared tile and two TMA stores (rows >= N not
        // written)
        int row0 = qt * S::TILE_Q + wg * BN;
        uint32_t staged = smem_addr(sm90_output_tiles<D, FP8>() + wg * S::O_BYTES);   // (no register in the loop)
        bool leader = thread_index() % 128 == 0;
        if (leader) bulk_wait_read<0>();   // the previous tile's stores have read the tile
        named_barrier_sync(1 + wg, 128);
        stage_tile<D, FP8>(staged, lse, o, l, m, qv.v_scale + (size_t)bh * D, bh, N, row0);
        fence_proxy_async();
        named_barrier_sync(1 + wg, 128);
        if (leader && row0 < N) {
            int z = merged_heads ? bh % merged_heads : 0, w = merged_heads ? bh / merged_heads : bh;
            tma_store_4d(map_o, staged, 0, row0, z, w);
            tma_store_4d(map_o, staged + BN * 128, 128, row0, z, w);
            bulk_commit();
        }
    }
    if (thread_index() % 128 == 0) bulk_wait_all();   // the last stores done before the CTA's shared memory goes
}
#endif

// map_q, map_k: q8, k8 as 2-D (D inner, B·H·N outer), box D × 64; map_v: v_t as bytes (n_pad
// (FP16: 2·n_pad) inner, B·H·D outer), box 64 (128) × D. Persistent: grid of at most one CTA per SM over the B·H·ceil(N/192)
// tiles (query tiles of one head next to each other, so a head's K̂/V̂ᵀ stay in L2) as `units`
// units (Sm90Schedule), Sm90Smem<D, FP8>::THREADS
// threads, Sm90Smem<D, FP8>::TOTAL bytes.
template <int D, bool FP8>
__global__ void __launch_bounds__(Sm90Smem<D, FP8>::THREADS, 1)
    sage_forward_sm90_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                             const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_o,
                             float *lse, SageCudaQuant qv, int N, int merged_heads, Sm90Schedule sch) {
#ifdef SAGE_SM90_DEVICE
    using S = Sm90Smem<D, FP8>;
    extern __shared__ uint8_t smem_raw[];
    __shared__ Sm90Barriers bar;
    uint8_t *sQ = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t *sK = sQ + S::CONSUMERS * S::Q_BYTES, *sV = sK + SM90_STAGES * S::K_BYTES;
    int nblk = (N + SAGE_CUDA_BLOCK - 1) / SAGE_CUDA_BLOCK, ntq = (nblk + S::CONSUMERS - 1) / S::CONSUMERS;
    int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        mbar_init(&bar.q_full, 1);
        mbar_init(&bar.q_empty, 4 * S::CONSUMERS);
        for (int s = 0; s < SM90_STAGES; s++) {
            mbar_init(&bar.kv_full[s], 1);
            mbar_init(&bar.kv_empty[s], 4 * S::CONSUMERS);
        }
        mbar_init_fence();
    }
    __syncthreads();
    if (wg == S::CONSUMERS) {   // the producer warpgroup: one thread issues every TMA load
        setmaxnreg_dec<SM90_PRODUCER_REGS>();
        if (threadIdx.x == S::CONSUMERS * 128)
            produce<D, FP8>(&bar, sQ, sK, sV, &map_q, &map_k, &map_v, N, nblk, ntq, sch);
    } else {
        setmaxnreg_inc<S::CONSUMER_REGS>();
        consume<D, FP8>(&bar, sQ, sK, sV, &map_o, lse, qv, N, merged_heads, nblk, ntq, sch, wg);
    }
#else
    __trap();   // built without sm_90a code: sage_forward_sm90_available() says 0
#endif
}

// D = 64: one warpgroup per (64-query block qb = blockIdx.x, head bh = blockIdx.y), 128 threads,
// Sm90WgSmem<D, FP8>::TOTAL bytes; maps as above. Thread 0 loads Q̂ once and refills each stage
// with key block kb + SM90_WG_STAGES when both wgmma batches of block kb have completed. FP16
// (FP8 = false): P16 (16 registers) in place of p' and P8, and P·V as four m64n64k16 f16 steps.
template <int D, bool FP8>
__global__ void __launch_bounds__(128, FP8 ? 5 : 2)
    sage_forward_wg_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                           const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_o,
                           float *lse, SageCudaQuant qv, int N, int merged_heads) {
#ifdef SAGE_SM90_DEVICE
    static_assert(D == 64, "the one-warpgroup kernel is the D = 64 layout (P·V over all 64 channels at once)");
    using S = Sm90WgSmem<D, FP8>;
    constexpr int BN = SAGE_CUDA_BLOCK;
    extern __shared__ uint8_t smem_raw[];
    __shared__ uint64_t bar_q, bar_kv[SM90_WG_STAGES];
    uint8_t *sQ = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t *sK = sQ + S::Q_BYTES, *sV = sK + SM90_WG_STAGES * S::K_BYTES;
    int bh = blockIdx.y, qb = blockIdx.x, nblk = gridDim.x, tid = threadIdx.x;
    int c = tid % 4;   // lane % 4: this thread's column pair in every 8 columns of the accumulators

    if (tid == 0) {
        mbar_init(&bar_q, 1);
        for (int s = 0; s < SM90_WG_STAGES; s++) mbar_init(&bar_kv[s], 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0) {
        mbar_expect_bytes(&bar_q, S::Q_BYTES);
        tma_load_2d(sQ, &map_q, &bar_q, 0, bh * N + qb * BN);
        for (int s = 0; s < SM90_WG_STAGES && s < nblk; s++)
            load_kv<D, FP8>(sK + s * S::K_BYTES, sV + s * S::V_BYTES, &bar_kv[s], &map_k, &map_v, bh, N, s);
    }

    const float q_scale = qv.q_scale[(size_t)bh * nblk + qb];
    const float *k_scale = qv.k_scale + (size_t)bh * nblk;
    float o[D / 2] = {}, blk[D / 2];   // accumulator layout of m64nD (wgmma.cuh); blk: FP8 only
    int s_acc[32];                     // accumulator layout of m64n64
    float pf[32];                      // FP8: p' (accumulator layout)
    uint32_t p[FP8 ? 2 : 4][4];        // P8 as k32 / P16 as k16 A fragments
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, alpha[2];
    mbar_wait(&bar_q, 0);
    const uint64_t desc_q = smem_desc<D>(sQ);

    for (int kb = 0; kb < nblk; kb++) {
        int stage = kb % SM90_WG_STAGES;
        mbar_wait(&bar_kv[stage], (kb / SM90_WG_STAGES) & 1);
        const uint64_t desc_k = smem_desc<D>(sK + stage * S::K_BYTES);
        const uint64_t desc_v = smem_desc<S::V_ROW_BYTES>(sV + stage * S::V_BYTES);

        wgmma_fence();
        qk_wgmma<D>(s_acc, desc_q, desc_k);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(s_acc);

        float offset[2], scale = __fmul_rn(q_scale, k_scale[kb]);
        softmax_max<FP8>(offset, alpha, m, l, s_acc, scale, N - kb * BN, c);
        if constexpr (FP8) {
            softmax_exp(pf, l, s_acc, scale, offset, N - kb * BN, c);
            pack_p8(p, pf);
            wgmma_fence();
            pv_wgmma(blk, p, desc_v);
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(blk);
            reg_fence(p[0]);
            reg_fence(p[1]);
        } else {
            softmax_exp_p16(p, l, s_acc, scale, offset, N - kb * BN, c);
            rescale_o(o, alpha);
            wgmma_fence();
            pv_f16_accumulate<D>(o, p, desc_v);
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(o);
#pragma unroll
            for (int k = 0; k < 4; k++) reg_fence(p[k]);
        }
        if (tid == 0 && kb + SM90_WG_STAGES < nblk)   // the stage is free: both wgmma batches completed
            load_kv<D, FP8>(sK + stage * S::K_BYTES, sV + stage * S::V_BYTES, &bar_kv[stage], &map_k, &map_v,
                            bh, N, kb + SM90_WG_STAGES);
        if constexpr (FP8) {
#pragma unroll
            for (int i = 0; i < D / 2; i++) o[i] = o[i] * alpha[(i % 4) / 2] + blk[i];
        }
    }
    // out through shared memory and one TMA store: the tile goes where K̂ stages 0 and 1 were (free
    // once every warp's wgmmas have completed; no load is in flight past the last key block)
    __syncthreads();
    uint32_t staged = smem_addr(sK);
    stage_tile<D, FP8>(staged, lse, o, l, m, qv.v_scale + (size_t)bh * D, bh, N, qb * BN);
    fence_proxy_async();
    __syncthreads();
    if (tid == 0) {
        tma_store_4d(&map_o, staged, 0, qb * BN, merged_heads ? bh % merged_heads : 0,
                     merged_heads ? bh / merged_heads : bh);
        bulk_commit();
        bulk_wait_read<0>();   // shared memory lives as long as the CTA
    }
#else
    __trap();   // built without sm_90a code: sage_forward_sm90_available() says 0
#endif
}

extern "C" int sage_forward_sm90_available(void) {
    return sm90_kernel_available((const void *)sage_forward_sm90_kernel<128, true>);
}

// The tensor maps of q8, k8 and v_t (the layouts the kernels expect, see above); v_t's rows are
// 64·elt bytes per key block (elt = 1 for e4m3, 2 for fp16).
template <int D>
static int make_maps(CUtensorMap maps[3], const SageCudaQuant *qv, int BH, int N, int elt, char *err) {
    uint64_t npad = (uint64_t)(N + SAGE_CUDA_BLOCK - 1) / SAGE_CUDA_BLOCK * SAGE_CUDA_BLOCK, rows = (uint64_t)BH * N;
    if (tma_map_2d_bytes(&maps[0], qv->q8, D, rows, D, SAGE_CUDA_BLOCK, "sage_forward_sm90 q8", err) ||
        tma_map_2d_bytes(&maps[1], qv->k8, D, rows, D, SAGE_CUDA_BLOCK, "sage_forward_sm90 k8", err) ||
        tma_map_2d_bytes(&maps[2], qv->v_t, npad * elt, (uint64_t)BH * D, SAGE_CUDA_BLOCK * elt, D,
                         "sage_forward_sm90 v_t", err))
        return -1;
    return 0;
}

// The work list of sage_forward_sm90_kernel (Sm90Schedule) for BH heads of nblk query blocks on
// sms SMs: full tiles, then partial ones; the full tiles of a last round that would leave at least
// half of the SMs idle run as two units each (DIT_SAGE_FWD_SPLIT=0: never).
static Sm90Schedule sm90_schedule(int BH, int nblk, int sms) {
    const int consumers = Sm90Smem<128, true>::CONSUMERS;
    int full = BH * (nblk / consumers), tiles = BH * ((nblk + consumers - 1) / consumers);
    int last = full % sms;   // full tiles past the last whole round
    Sm90Schedule s = {full, tiles, tiles, tiles};
    const char *split = getenv("DIT_SAGE_FWD_SPLIT");
    if ((!split || strcmp(split, "0") != 0) && last > 0 && 2 * last <= sms) {
        s.whole = full - last;
        s.split_end = full + last;
        s.units = tiles + last;
    }
    return s;
}

// D = 128: the persistent warp-specialized kernel, at most one CTA per SM.
template <bool FP8>
static int launch_warp_specialized(uint16_t *out, float *lse, const SageCudaQuant *qv, int BH, int N,
                                   int merged_heads, cudaStream_t stream, char *err) {
    constexpr int D = 128;
    using S = Sm90Smem<D, FP8>;
    CUtensorMap maps[4];
    int bytes = S::TOTAL, dev, sms, nblk = (N + SAGE_CUDA_BLOCK - 1) / SAGE_CUDA_BLOCK;
    if (make_maps<D>(maps, qv, BH, N, FP8 ? 1 : 2, err) ||
        tma_map_head_rows(&maps[3], out, D, N, BH, merged_heads, SAGE_CUDA_BLOCK, "sage_forward_sm90 out", err))
        return -1;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(sage_forward_sm90_kernel<D, FP8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         bytes),
                    err, "cudaFuncSetAttribute(sage_forward_sm90_kernel max dynamic smem)");
    SAGE_CUDA_CHECK(cudaGetDevice(&dev), err, "cudaGetDevice");
    SAGE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), err,
                    "cudaDeviceGetAttribute(multiprocessor count)");
    Sm90Schedule sch = sm90_schedule(BH, nblk, sms);
    int grid = sch.units < sms ? sch.units : sms;
    sage_forward_sm90_kernel<D, FP8><<<grid, S::THREADS, bytes, stream>>>(maps[0], maps[1], maps[2], maps[3], lse,
                                                                          *qv, N, merged_heads, sch);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_forward_sm90_kernel");
    return 0;
}

// D = 64: the one-warpgroup kernel, one CTA per (64-query block, head).
template <bool FP8>
static int launch_one_warpgroup(uint16_t *out, float *lse, const SageCudaQuant *qv, int BH, int N,
                                int merged_heads, cudaStream_t stream, char *err) {
    constexpr int D = 64;
    CUtensorMap maps[4];
    int bytes = Sm90WgSmem<D, FP8>::TOTAL, nblk = (N + SAGE_CUDA_BLOCK - 1) / SAGE_CUDA_BLOCK;
    static_assert(SM90_WG_STAGES * Sm90WgSmem<D, FP8>::K_BYTES >= SAGE_CUDA_BLOCK * D * 2,
                  "out's tile fits in the K̂ stages");
    if (make_maps<D>(maps, qv, BH, N, FP8 ? 1 : 2, err) ||
        tma_map_head_rows(&maps[3], out, D, N, BH, merged_heads, SAGE_CUDA_BLOCK, "sage_forward_sm90 out", err))
        return -1;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(sage_forward_wg_kernel<D, FP8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         bytes),
                    err, "cudaFuncSetAttribute(sage_forward_wg_kernel max dynamic smem)");
    sage_forward_wg_kernel<D, FP8><<<dim3(nblk, BH), 128, bytes, stream>>>(maps[0], maps[1], maps[2], maps[3], lse,
                                                                           *qv, N, merged_heads);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_forward_wg_kernel");
    return 0;
}

// The kernel for D and pv over the quantized tensors of qv.
static int launch(uint16_t *out, float *lse, const SageCudaQuant *qv, int BH, int N, int D, SagePV pv,
                  int merged_heads, cudaStream_t stream, char *err) {
    if (D == 64)
        return pv == SAGE_PV_FP8 ? launch_one_warpgroup<true>(out, lse, qv, BH, N, merged_heads, stream, err)
                                 : launch_one_warpgroup<false>(out, lse, qv, BH, N, merged_heads, stream, err);
    return pv == SAGE_PV_FP8 ? launch_warp_specialized<true>(out, lse, qv, BH, N, merged_heads, stream, err)
                             : launch_warp_specialized<false>(out, lse, qv, BH, N, merged_heads, stream, err);
}

// The checks every sm90 entry point makes before its device work (fn names it in the message).
static int check_sm90_call(const char *fn, int B, int H, int N, int D, SagePV pv, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535 ||
        !sage_forward_sm90_takes(pv, D)) {
        dit_set_error(err, "%s: need D in {64, 128}, pv FP8 or FP16, B, H, N >= 1 and B·H <= 65535 "
                           "(got B=%d H=%d N=%d D=%d pv=%d)", fn, B, H, N, D, (int)pv);
        return -1;
    }
    return 0;
}
static int check_sm90_device(const char *fn, char *err) {
    if (!sage_forward_sm90_available()) {
        dit_set_error(err, "%s: needs a compute capability 9.0 device and a build with sm_90a code "
                           "(-gencode=arch=compute_90a,code=sm_90a)", fn);
        return -1;
    }
    return 0;
}

int sage_forward_sm90_rows(uint16_t *out, float *lse, void *workspace, const uint16_t *q, const uint16_t *k,
                           const uint16_t *v, int B, int H, int N, int D, SagePV pv, int merged_heads,
                           cudaStream_t stream, char *err) {
    if (check_sm90_call("sage_forward_sm90_cuda", B, H, N, D, pv, err) != 0) return -1;
    CHECK_DEVICE_ARGS("sage_forward_sm90_cuda", err, DEVICE_ARG(out, 16), DEVICE_ARG(lse, 4),
                      DEVICE_ARG(workspace, 16), DEVICE_ARG(q, 16), DEVICE_ARG(k, 16), DEVICE_ARG(v, 16));
    if (check_sm90_device("sage_forward_sm90_cuda", err) != 0) return -1;
    if (sage_quantize_cuda(workspace, q, k, v, B, H, N, D, pv, stream, err) != 0) return -1;
    SageCudaQuant qv = sage_cuda_quant_view(workspace, B, H, N, D, pv);
    return launch(out, lse, &qv, B * H, N, D, pv, merged_heads, stream, err);
}

int sage_forward_sm90_quantized_rows(uint16_t *out, float *lse, const void *workspace, int B, int H, int N, int D,
                                     SagePV pv, int merged_heads, cudaStream_t stream, char *err) {
    if (check_sm90_call("sage_forward_sm90_quantized_cuda", B, H, N, D, pv, err) != 0) return -1;
    CHECK_DEVICE_ARGS("sage_forward_sm90_quantized_cuda", err, DEVICE_ARG(out, 16), DEVICE_ARG(lse, 4),
                      DEVICE_ARG(workspace, 16));
    if (check_sm90_device("sage_forward_sm90_quantized_cuda", err) != 0) return -1;
    SageCudaQuant qv = sage_cuda_quant_view((void *)workspace, B, H, N, D, pv);
    return launch(out, lse, &qv, B * H, N, D, pv, merged_heads, stream, err);
}

extern "C" int sage_forward_sm90_cuda(uint16_t *out, float *lse, void *workspace, const uint16_t *q,
                                      const uint16_t *k, const uint16_t *v, int B, int H, int N, int D,
                                      cudaStream_t stream, char *err) {
    return sage_forward_sm90_rows(out, lse, workspace, q, k, v, B, H, N, D, SAGE_PV_FP8, 0, stream, err);
}

extern "C" int sage_forward_sm90_quantized_cuda(uint16_t *out, float *lse, const void *workspace, int B, int H,
                                                int N, int D, cudaStream_t stream, char *err) {
    return sage_forward_sm90_quantized_rows(out, lse, workspace, B, H, N, D, SAGE_PV_FP8, 0, stream, err);
}
