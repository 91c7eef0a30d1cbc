// The recompute backward (FlashAttention-2, mma.sync) shared by bf16 flash attention
// (flash_backward.cu) and sage attention (sage_backward.cu). One kernel body, templated on the head
// dim D, the warps per CTA and the score source, the only thing in which the two differ:
//   SCORES_BF16: Sᵀ = K·Qᵀ (bf16 m16n8k16), Pᵀ = exp2(Sᵀ·c - lse) with c = log2(e)/sqrt(D);
//                dQ uses K.
//   SCORES_SAGE: Sᵀ = K̂·Q̂ᵀ (int8 m16n8k32 on the forward's q8, k8), s = (float)Sᵀ·(q_scale·k_scale)
//                rounded, Pᵀ = exp2(s - lse) (the definition's s, as the sage forward);
//                dQ uses k - k_mean (bf16 of the fp32 difference), the "K" tile below.
// attention_delta_kernel first: delta = rowsum(dO∘O) (fp32, from the bf16 O) and dq = 0.
// Then one CTA of WARPS warps per (16·WARPS-key block, head) keeps K (sage: k - k_mean, and K̂) and V
// in shared memory and loops over 64-query blocks (Q, dO, lse, delta and sage's Q̂ double-buffered).
// Warp w owns keys 16w..16w+15 and computes TRANSPOSED tiles, so that Pᵀ and dSᵀ never leave its
// registers for dV and dK:
//   Pᵀ as above        (keys >= N masked to P = 0; queries >= N are zero rows with lse = +inf: P = 0)
//   dV += bf16(Pᵀ)·dO
//   dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ - delta)
//   dK += bf16(dSᵀ)·Q   (scaled by 1/sqrt(D) at the end)
//   dSᵀ -> shared memory (bf16); then dQ += dS·K/sqrt(D) for the 64×D block as 8 tiles of
//   16 queries × D/2 columns spread over the warps, added to the fp32 dq with atomics.
// Deterministic dQ (ORDERED, opt-in: sage_backward_set_deterministic, flash_backward_set_deterministic):
// the key blocks of a head add their dQ tile of a query block in the order of the key blocks, so dq
// is the same sum in the same order in every run. One counter
// per (head, query block) in the workspace (the "turn", zeroed with dq) says how many key blocks
// have added; key block kb adds its tile when the turn is kb, then increments it (see
// wait_dq_turn, hand_on_dq_turn). Key block kb - 1 of a head has a lower linear block index than
// kb (grid (key blocks, B·H)), so it was launched first and the wait cannot deadlock. Each key block
// runs about one query step behind the one before it: the CTAs of a head launched together start
// staggered, and any delay of one CTA holds up the key blocks after it: 11–55% slower than the
// unordered atomics (dev/notes_attention_bwd.md), which stay the default (their sum order, and so
// dq's last bits, vary from run to run with more than two key blocks per head).
#pragma once
#include <stdlib.h>
#include <string.h>
#include <type_traits>
#include "attention/sage_cuda.h"
#include "attention/attention_rows.cuh"
#include "attention/sage_mma.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

#define BWD_BLOCK_M 64   // queries per step (= SAGE_CUDA_BLOCK: one q_scale per step)

enum { SCORES_BF16 = 0, SCORES_SAGE = 1 };

// Inputs and outputs of one backward, (B,H,N,D) / (B,H,N) as in flash_cuda.h and sage_cuda.h, but
// dout (and the out of the delta) in the layout merged_heads says (attention_rows.cuh).
// qv: the sage forward's quantized tensors (q8, k8, q_scale, k_scale, k_mean); unused for SCORES_BF16.
// dK and dV go to dk, dv (fp32, (B,H,N,D)), or, with kv_rows (merged layout only), as bf16 into the
// rows of a token-major tensor: dK of key t of head h of batch b at dk_rows + (b·N + t)·row_stride +
// h·D (the k part of the qkv projection's input gradient), multiplied by the normalized Hadamard
// matrix first when dk_hadamard_norm != 0 (= 1/sqrt(D): the gradient of a k the caller rotated), dV
// likewise at dv_rows, with max |dK|, |dV| (of the bf16 values) raised into *kv_amax when that is
// not NULL.
typedef struct {
    float *dq, *dk, *dv;
    const __nv_bfloat16 *dout, *q, *k, *v;
    const float *lse, *delta;
    SageCudaQuant qv;
    int N, merged_heads;
    int *dq_turn;   // (B·H, ceil(N/64)) counters, zeroed: ordered dQ adds; NULL: unordered atomics
    __nv_bfloat16 *dk_rows, *dv_rows;
    size_t row_stride;
    float dk_hadamard_norm;
    float *kv_amax;
} AttnBwdArgs;

// a's dK, dV destination from the call's AttnKvRows (NULL: the fp32 dk, dv already in a).
static inline void set_kv_rows(AttnBwdArgs *a, const AttnKvRows *r, int D) {
    if (!r) return;
    a->dk_rows = (__nv_bfloat16 *)r->dk;
    a->dv_rows = (__nv_bfloat16 *)r->dv;
    a->row_stride = r->row_stride;
    a->dk_hadamard_norm = r->hadamard_dk ? 1.0f / sqrtf((float)D) : 0.0f;   // (host: merge_qkv_grad's norm)
    a->kv_amax = r->amax;
}

// The checks of a call's dK, dV destination: fp32 dk, dv 16-byte aligned, or rows 4-byte aligned
// (bf16 pairs), row_stride >= H·D and even, amax NULL or 4-byte aligned.
static inline int check_kv_out(const char *fn, const float *dk, const float *dv, const AttnKvRows *r, int H, int D,
                               char *err) {
    if (!r) {
        CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(dk, 16), DEVICE_ARG(dv, 16));
        return 0;
    }
    if (r->row_stride < (size_t)H * D || r->row_stride % 2) {
        dit_set_error(err, "%s: row_stride must be even and at least H·D = %d (got %zu)", fn, H * D, r->row_stride);
        return -1;
    }
    const uint16_t *dk_rows = r->dk, *dv_rows = r->dv;
    CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(dk_rows, 4), DEVICE_ARG(dv_rows, 4));
    if (r->amax) {
        const float *amax = r->amax;
        CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(amax, 4));
    }
    return 0;
}

// The Walsh-Hadamard transform of the rows held by quads, times norm: lane c = lane % 4 of a quad
// holds columns 8j + 2c + e of one row at x[4j + e] (j < D/8, e < 2; the m16n8 and wgmma
// accumulator layout, a second row at x[4j + 2 + e], transformed alike). The butterflies of
// walsh_hadamard (hadamard.cuh) in its order (stage h pairs columns i and i + h: a + b, a - b), so
// each value is bitwise walsh_hadamard's. Every lane of the warp calls it.
template <int D>
__device__ __forceinline__ void walsh_hadamard_quads(float *x, float norm) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < D / 2; i += 2) {   // h = 1: the lane's column pairs
        float a = x[i], b = x[i + 1];
        x[i] = a + b;
        x[i + 1] = a - b;
    }
#pragma unroll
    for (int bit = 1; bit <= 2; bit *= 2) {   // h = 2, 4: the partner lane is lane ^ bit
        const bool high = lane & bit;
#pragma unroll
        for (int i = 0; i < D / 2; i++) {
            float other = __shfl_xor_sync(0xffffffffu, x[i], bit);
            x[i] = high ? other - x[i] : x[i] + other;
        }
    }
#pragma unroll
    for (int hj = 1; hj < D / 8; hj *= 2)   // h = 8·hj: columns 8j and 8(j + hj) of the lane
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            if (!(j & hj))
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float a = x[4 * j + e], b = x[4 * (j + hj) + e];
                    x[4 * j + e] = a + b;
                    x[4 * (j + hj) + e] = a - b;
                }
#pragma unroll
    for (int i = 0; i < D / 2; i++) x[i] *= norm;
}

// The end of a key block: dK·dk_scale and dV of this thread's keys t0 and t0 + 8 (valid[r]: key
// t0 + 8r < N) of head bh, held as in walsh_hadamard_quads (dk[4j + 2r + e], dv likewise), where
// AttnBwdArgs says (dk is overwritten). Every lane of the warp calls it.
template <int D>
__device__ __forceinline__ void store_key_block_grads(const AttnBwdArgs &a, int bh, int t0, const bool valid[2],
                                                      float *dk, const float *dv, float dk_scale) {
    const int c = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < D / 2; i++) dk[i] = __fmul_rn(dk[i], dk_scale);   // (no FMA with the transform's adds)
    if (!a.dv_rows) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (!valid[r]) continue;
            size_t at = ((size_t)bh * a.N + t0 + 8 * r) * D + 2 * c;
#pragma unroll
            for (int j = 0; j < D / 8; j++) {
                *(float2 *)(a.dk + at + 8 * j) = make_float2(dk[4 * j + 2 * r], dk[4 * j + 2 * r + 1]);
                *(float2 *)(a.dv + at + 8 * j) = make_float2(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
            }
        }
        return;
    }
    if (a.dk_hadamard_norm != 0.0f) walsh_hadamard_quads<D>(dk, a.dk_hadamard_norm);
    const int b = bh / a.merged_heads, h = bh % a.merged_heads;
    float most = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (!valid[r]) continue;
        size_t at = ((size_t)b * a.N + t0 + 8 * r) * a.row_stride + (size_t)h * D + 2 * c;
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            __nv_bfloat162 k2 = __floats2bfloat162_rn(dk[4 * j + 2 * r], dk[4 * j + 2 * r + 1]);
            __nv_bfloat162 v2 = __floats2bfloat162_rn(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
            *(__nv_bfloat162 *)(a.dk_rows + at + 8 * j) = k2;
            *(__nv_bfloat162 *)(a.dv_rows + at + 8 * j) = v2;
            most = fmaxf(most, fmaxf(fmaxf(fabsf(__low2float(k2)), fabsf(__high2float(k2))),
                                     fmaxf(fabsf(__low2float(v2)), fabsf(__high2float(v2)))));
        }
    }
    // *a.kv_amax = max(*a.kv_amax, the warp's most) (most >= 0: its bits order as unsigned ints,
    // so atomicMax on them is exact and order-free)
    if (!a.kv_amax) return;
    unsigned int warp_most = __reduce_max_sync(0xffffffffu, __float_as_uint(most));
    if (threadIdx.x % 32 == 0 && warp_most > __float_as_uint(__ldcg(a.kv_amax)))
        atomicMax((unsigned int *)a.kv_amax, warp_most);
}

template <int D, int WARPS, int SRC> struct AttnBwdSmem {
    static constexpr int BLOCK_N = 16 * WARPS;               // keys per CTA
    static constexpr int STRIDE = 2 * D + 16;                // bytes per bf16 row of D
    static constexpr int I8_STRIDE = D + 16;                 // bytes per int8 row of D
    static constexpr int DS_STRIDE = 2 * BWD_BLOCK_M + 16;   // bytes per bf16 row of dSᵀ
    static constexpr int QB_BYTES = BWD_BLOCK_M * STRIDE, Q8B_BYTES = BWD_BLOCK_M * I8_STRIDE;
    // K | V | Q[2] | dO[2] | dSᵀ | lse[2] | delta[2], and for sage K̂ | Q̂[2]
    static constexpr int K = 0, V = K + BLOCK_N * STRIDE, Q = V + BLOCK_N * STRIDE;
    static constexpr int DO = Q + 2 * QB_BYTES, DS = DO + 2 * QB_BYTES;
    static constexpr int LSE = DS + BLOCK_N * DS_STRIDE, DELTA = LSE + 2 * BWD_BLOCK_M * 4;
    static constexpr int K8 = DELTA + 2 * BWD_BLOCK_M * 4, Q8 = K8 + BLOCK_N * I8_STRIDE;
    static constexpr int TOTAL = SRC == SCORES_SAGE ? Q8 + 2 * Q8B_BYTES : K8;
};

// The backward workspace: delta (B·H·N fp32) | the dQ turns (B·H·ceil(N/64) int32), 16-byte aligned.
static inline size_t attention_backward_turns_offset(int B, int H, int N) {
    return ((size_t)B * H * N * sizeof(float) + 15) / 16 * 16;
}
static inline size_t attention_backward_workspace_bytes(int B, int H, int N) {
    return attention_backward_turns_offset(B, H, N) + (size_t)B * H * ((N + BWD_BLOCK_M - 1) / BWD_BLOCK_M) * sizeof(int);
}

// delta[row] = Σ_d dout[row, d]·out[row, d] in fp32, dq[row, :] = 0, and the dQ turn of the query
// block that starts at row (rows = B·H·N, N per head) = 0 (turn may be NULL). One warp per row;
// dout and out rows where merged_heads places them.
static __global__ void attention_delta_kernel(float *delta, float *dq, int *turn, const __nv_bfloat16 *dout,
                                              const __nv_bfloat16 *out, size_t rows, int N, int D,
                                              int merged_heads) {
    // rows < 2^31 (attention_backward_prepare): 32-bit index arithmetic, no 64-bit divisions
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= (int)rows) return;
    int lane = threadIdx.x % 32, q = row % N;
    size_t at = attn_row_offset(row / N, q, N, D, merged_heads);
    float s = 0.0f;
    for (int d = lane * 2; d < D; d += 64) {
        float2 a = __bfloat1622float2(*(const __nv_bfloat162 *)(dout + at + d));
        float2 b = __bfloat1622float2(*(const __nv_bfloat162 *)(out + at + d));
        s += a.x * b.x + a.y * b.y;
    }
    for (int d = lane * 4; d < D; d += 128) *(float4 *)(dq + (size_t)row * D + d) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) delta[row] = s;
    if (turn && lane == 0 && q % BWD_BLOCK_M == 0)
        turn[row / N * ((N + BWD_BLOCK_M - 1) / BWD_BLOCK_M) + q / BWD_BLOCK_M] = 0;
}

// What every backward needs before its kernel, for a.N and BH = B·H heads of D: a.delta = the
// caller's delta (dq is then zeroed here), or rowsum(dout∘out) computed into the workspace by
// attention_delta_kernel (which also zeroes dq); a.dq_turn = the zeroed turns in the workspace, or
// NULL unless `deterministic`. a.dq must be set.
static inline int attention_backward_prepare(AttnBwdArgs *a, void *workspace, const uint16_t *out, int BH, int D,
                                             int deterministic, cudaStream_t stream, char *err) {
    int N = a->N;
    size_t rows = (size_t)BH * N;
    if (rows >= (1ull << 31)) {
        dit_set_error(err, "attention backward: need B·H·N < 2^31 rows (got B·H=%d N=%d)", BH, N);
        return -1;
    }
    a->dq_turn = deterministic ? (int *)((uint8_t *)workspace + attention_backward_turns_offset(BH, 1, N)) : NULL;
    if (a->delta) {
        SAGE_CUDA_CHECK(cudaMemsetAsync(a->dq, 0, rows * D * sizeof(float), stream), err, "cudaMemsetAsync(dq)");
        if (a->dq_turn)
            SAGE_CUDA_CHECK(cudaMemsetAsync(a->dq_turn, 0, (size_t)BH * ((N + BWD_BLOCK_M - 1) / BWD_BLOCK_M) * sizeof(int),
                                            stream), err, "cudaMemsetAsync(dq turns)");
        return 0;
    }
    float *d = (float *)workspace;
    attention_delta_kernel<<<(unsigned)((rows + 7) / 8), 256, 0, stream>>>(d, a->dq, a->dq_turn, a->dout,
                                                                         (const __nv_bfloat16 *)out, rows, N, D,
                                                                         a->merged_heads);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch attention_delta_kernel");
    a->delta = d;
    return 0;
}

// Ordered dQ (a.dq_turn != NULL), run by thread 0 of a CTA. A turn counts the key blocks that have
// added their dQ tile of one query block. wait_dq_turn: until key block kb may add (turn == kb);
// seen: the turn as loaded before (ld_acquire_gpu issued early hides its latency).
// hand_on_dq_turn: after every thread's adds of the block were issued and a CTA barrier (bar.sync
// makes them part of what the release fence orders): the next key block's turn.
__device__ __forceinline__ int ld_acquire_gpu(const int *p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void wait_dq_turn(const int *turn, int kb, int seen) {
    while (seen != kb) seen = ld_acquire_gpu(turn);
}
__device__ __forceinline__ void hand_on_dq_turn(int *turn) {
    asm volatile("fence.acq_rel.gpu;\n"
                 "red.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(turn) : "memory");
}

// Q, dO (and sage's Q̂) of the 64 queries from q0 of head bh (head = bh·N·D) into buffer buf, as
// one cp.async group; rows >= N are zero-filled.
template <int D, int WARPS, int SRC>
__device__ __forceinline__ void load_query_block(uint8_t *smem, int buf, const AttnBwdArgs &a, int bh, size_t head,
                                                 int q0) {
    using S = AttnBwdSmem<D, WARPS, SRC>;
    constexpr int THREADS = WARPS * 32;
    int rows = a.N - q0;
    cp_async_rows<BWD_BLOCK_M, 2 * D, S::STRIDE, THREADS>(smem + S::Q + buf * S::QB_BYTES,
                                                          (const uint8_t *)(a.q + head + (size_t)q0 * D), 2 * D, rows);
    cp_async_rows<BWD_BLOCK_M, 2 * D, S::STRIDE, THREADS>(
        smem + S::DO + buf * S::QB_BYTES, (const uint8_t *)(a.dout + attn_row_offset(bh, q0, a.N, D, a.merged_heads)),
        2 * attn_row_stride(D, a.merged_heads), rows);
    if constexpr (SRC == SCORES_SAGE)
        cp_async_rows<BWD_BLOCK_M, D, S::I8_STRIDE, THREADS>(smem + S::Q8 + buf * S::Q8B_BYTES,
                                                             (const uint8_t *)a.qv.q8 + head + (size_t)q0 * D, D, rows);
    cp_async_commit();
}

// Pᵀ of the warp's 16 keys × the 64 queries in buffer buf, in the m16n8 C layout (pt[j][e]: key
// 16·warp + g + 8·(e/2), query 8j + 2c + (e&1)). bf16: exp2(Sᵀ·scale - lse) with one FFMA;
// sage: exp2(rn((float)Sᵀ·scale) - lse), scale = q_scale·k_scale.
// ldmatrix addresses, for lane = 8·mi + r8 (32 bytes per k-step for bf16 k16 and int8 k32 alike):
// A from row-major smem (m rows, k contiguous): row m0 + lane%16, bytes 16·(lane/16)
// B pair from smem (n rows, k contiguous):     row n0 + 8·(mi/2) + r8, bytes 16·(mi%2)
template <int D, int WARPS, int SRC>
__device__ __forceinline__ void probs_transposed(float pt[8][4], const uint8_t *smem, int buf, const float *lse_b,
                                                 float scale, const bool key_valid[2]) {
    using S = AttnBwdSmem<D, WARPS, SRC>;
    constexpr bool SAGE = SRC == SCORES_SAGE;
    constexpr int ROW = SAGE ? S::I8_STRIDE : S::STRIDE, KSTEPS = SAGE ? D / 32 : D / 16;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c = lane % 4, mi = lane / 8, r8 = lane % 8;
    const uint8_t *sk = smem + (SAGE ? S::K8 : S::K) + (warp * 16 + lane % 16) * ROW + (lane / 16) * 16;
    const uint8_t *sq = smem + (SAGE ? S::Q8 + buf * S::Q8B_BYTES : S::Q + buf * S::QB_BYTES) +
                        ((mi / 2) * 8 + r8) * ROW + (mi % 2) * 16;
    typename std::conditional<SAGE, int, float>::type st[8][4] = {};
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {
        uint32_t a[4];
        ldmatrix_x4(a, sk + kk * 32);
#pragma unroll
        for (int np = 0; np < 4; np++) {
            uint32_t b[4];
            ldmatrix_x4(b, sq + np * 16 * ROW + kk * 32);
            if constexpr (SAGE) {
                mma_s8(st[2 * np], a, b[0], b[1]);
                mma_s8(st[2 * np + 1], a, b[2], b[3]);
            } else {
                mma_bf16(st[2 * np], a, b[0], b[1]);
                mma_bf16(st[2 * np + 1], a, b[2], b[3]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        float2 lse = *(const float2 *)(lse_b + 8 * j + 2 * c);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float l = e & 1 ? lse.y : lse.x;
            float x = SAGE ? __fmul_rn((float)st[j][e], scale) - l : fmaf((float)st[j][e], scale, -l);
            pt[j][e] = key_valid[e / 2] ? exp2f(x) : 0.0f;
        }
    }
}

// ldmatrix addresses used below, for lane = 8·mi + r8:
// A (16×16) from row-major smem (m rows, k contiguous):            row m0 + lane%16, col k0 + 8·(lane/16)
// A (16×16) from smem holding Aᵀ (k rows, m contiguous), .trans:    row k0 + 8·(mi/2) + r8, col m0 + 8·(mi%2)
// B pair (k16 × two n8) from smem (n rows, k contiguous):          row n0 + 8·(mi/2) + r8, col k0 + 8·(mi%2)
// B pair from smem (k rows, n contiguous), .trans:                  row k0 + 8·(mi%2) + r8, col n0 + 8·(mi/2)
// ORDERED: deterministic dQ through a.dq_turn (compiled out otherwise, which keeps the unordered
// kernel as fast as before).
template <int D, int WARPS, int SRC, bool ORDERED>
__global__ void __launch_bounds__(WARPS * 32, 1) attention_backward_kernel(AttnBwdArgs a) {
    using S = AttnBwdSmem<D, WARPS, SRC>;
    constexpr int THREADS = WARPS * 32, BLOCK_N = S::BLOCK_N, NT = D / 8;
    static_assert(WARPS == 4 || WARPS == 8, "lse/delta staging needs 128 threads; dQ tiles are 8");
    extern __shared__ __align__(16) uint8_t smem[];
    float *s_lse = (float *)(smem + S::LSE), *s_delta = (float *)(smem + S::DELTA);
    const int N = a.N;
    int kb = blockIdx.x, bh = blockIdx.y, k0 = kb * BLOCK_N, keys = min(BLOCK_N, N - k0);
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4, mi = lane / 8, r8 = lane % 8;
    size_t head = (size_t)bh * N * D;
    const float *lse_h = a.lse + (size_t)bh * N, *delta_h = a.delta + (size_t)bh * N;
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);
    const int nqb = (N + BWD_BLOCK_M - 1) / BWD_BLOCK_M;
    int *turn = ORDERED ? a.dq_turn + (size_t)bh * nqb : NULL;   // this head's dQ turns

    if constexpr (SRC == SCORES_SAGE)
        cp_async_rows<BLOCK_N, D, S::I8_STRIDE, THREADS>(smem + S::K8, (const uint8_t *)a.qv.k8 + head + (size_t)k0 * D,
                                                        D, keys);
    else
        cp_async_rows<BLOCK_N, 2 * D, S::STRIDE, THREADS>(smem + S::K, (const uint8_t *)(a.k + head + (size_t)k0 * D),
                                                          2 * D, keys);
    cp_async_rows<BLOCK_N, 2 * D, S::STRIDE, THREADS>(smem + S::V, (const uint8_t *)(a.v + head + (size_t)k0 * D),
                                                      2 * D, keys);
    load_query_block<D, WARPS, SRC>(smem, 0, a, bh, head, 0);
    if (tid < BWD_BLOCK_M) s_lse[tid] = tid < N ? lse_h[tid] : INFINITY;
    else if (tid < 2 * BWD_BLOCK_M) s_delta[tid - BWD_BLOCK_M] = tid - BWD_BLOCK_M < N ? delta_h[tid - BWD_BLOCK_M] : 0.0f;
    float score_scale = 1.44269504f / sqrtf((float)D);   // bf16: c; sage: k_scale here, q_scale per block
    if constexpr (SRC == SCORES_SAGE) {
        // K tile = bf16(k - k_mean) (zero rows past N); k_scale of the warp's 64-key quantization block
        const float *mean = a.qv.k_mean + (size_t)bh * D;
        for (int i = tid; i < BLOCK_N * D / 8; i += THREADS) {
            int r = i / (D / 8), col = (i % (D / 8)) * 8;
            uint4 u = make_uint4(0, 0, 0, 0);
            if (r < keys) {
                u = *(const uint4 *)(a.k + head + (size_t)(k0 + r) * D + col);
                __nv_bfloat162 *h = (__nv_bfloat162 *)&u;
                for (int e = 0; e < 4; e++) {
                    float2 f = __bfloat1622float2(h[e]);
                    h[e] = __floats2bfloat162_rn(f.x - mean[col + 2 * e], f.y - mean[col + 2 * e + 1]);
                }
            }
            *(uint4 *)(smem + S::K + r * S::STRIDE + col * 2) = u;
        }
        int kblock = (k0 + warp * 16) / SAGE_CUDA_BLOCK;
        score_scale = kblock < nqb ? a.qv.k_scale[(size_t)bh * nqb + kblock] : 0.0f;
    }

    const bool key_valid[2] = {warp * 16 + g < keys, warp * 16 + g + 8 < keys};
    const uint8_t *sVa = smem + S::V + (warp * 16 + lane % 16) * S::STRIDE + (lane / 16) * 16;
    float dv_acc[NT][4] = {}, dk_acc[NT][4] = {};
    for (int qb = 0; qb < nqb; qb++) {
        int buf = qb & 1, q0 = qb * BWD_BLOCK_M;
        cp_async_wait<0>();
        __syncthreads();   // block qb landed; every warp is done with block qb-1 (its buffers, dSᵀ, dQ adds)
        int seen_turn = 0;
        if (ORDERED && tid == 0) seen_turn = ld_acquire_gpu(turn + qb);
        float next_stat = 0.0f;   // lse (tid < 64) or delta (64 <= tid < 128) of block qb+1
        if (qb + 1 < nqb) {
            int q1 = q0 + BWD_BLOCK_M;
            load_query_block<D, WARPS, SRC>(smem, buf ^ 1, a, bh, head, q1);
            if (tid < BWD_BLOCK_M) next_stat = q1 + tid < N ? lse_h[q1 + tid] : INFINITY;
            else if (tid < 2 * BWD_BLOCK_M) next_stat = q1 + tid - BWD_BLOCK_M < N ? delta_h[q1 + tid - BWD_BLOCK_M] : 0.0f;
        }
        const uint8_t *sQ = smem + S::Q + buf * S::QB_BYTES, *sDO = smem + S::DO + buf * S::QB_BYTES;
        const float *lse_b = s_lse + buf * BWD_BLOCK_M, *delta_b = s_delta + buf * BWD_BLOCK_M;

        // Pᵀ: 16 keys × 64 queries
        float pt[8][4];
        float scale = score_scale;
        if constexpr (SRC == SCORES_SAGE) scale = __fmul_rn(a.qv.q_scale[(size_t)bh * nqb + qb], score_scale);
        probs_transposed<D, WARPS, SRC>(pt, smem, buf, lse_b, scale, key_valid);

        // dV += Pᵀ·dO: the Pᵀ accumulators are the A fragments, 16 queries per k-step
#pragma unroll
        for (int t = 0; t < 4; t++) {
            uint32_t af[4] = {pack_bf162(pt[2 * t][0], pt[2 * t][1]), pack_bf162(pt[2 * t][2], pt[2 * t][3]),
                              pack_bf162(pt[2 * t + 1][0], pt[2 * t + 1][1]),
                              pack_bf162(pt[2 * t + 1][2], pt[2 * t + 1][3])};
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, sDO + (t * 16 + (mi % 2) * 8 + r8) * S::STRIDE + (np * 16 + (mi / 2) * 8) * 2);
                mma_bf16(dv_acc[2 * np], af, b[0], b[1]);
                mma_bf16(dv_acc[2 * np + 1], af, b[2], b[3]);
            }
        }

        // dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ - delta)
        float dst[8][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t af[4];
            ldmatrix_x4(af, sVa + kk * 32);
#pragma unroll
            for (int np = 0; np < 4; np++) {
                uint32_t b[4];
                ldmatrix_x4(b, sDO + (np * 16 + (mi / 2) * 8 + r8) * S::STRIDE + (kk * 16 + (mi % 2) * 8) * 2);
                mma_bf16(dst[2 * np], af, b[0], b[1]);
                mma_bf16(dst[2 * np + 1], af, b[2], b[3]);
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) dst[j][e] = pt[j][e] * (dst[j][e] - delta_b[8 * j + 2 * c + (e & 1)]);

        // dK += dSᵀ·Q, and dSᵀ to shared memory for dQ
#pragma unroll
        for (int t = 0; t < 4; t++) {
            uint32_t af[4] = {pack_bf162(dst[2 * t][0], dst[2 * t][1]), pack_bf162(dst[2 * t][2], dst[2 * t][3]),
                              pack_bf162(dst[2 * t + 1][0], dst[2 * t + 1][1]),
                              pack_bf162(dst[2 * t + 1][2], dst[2 * t + 1][3])};
            uint8_t *ds_row = smem + S::DS + (warp * 16 + g) * S::DS_STRIDE + (16 * t + 2 * c) * 2;
            *(uint32_t *)ds_row = af[0];
            *(uint32_t *)(ds_row + 8 * S::DS_STRIDE) = af[1];
            *(uint32_t *)(ds_row + 16) = af[2];
            *(uint32_t *)(ds_row + 8 * S::DS_STRIDE + 16) = af[3];
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, sQ + (t * 16 + (mi % 2) * 8 + r8) * S::STRIDE + (np * 16 + (mi / 2) * 8) * 2);
                mma_bf16(dk_acc[2 * np], af, b[0], b[1]);
                mma_bf16(dk_acc[2 * np + 1], af, b[2], b[3]);
            }
        }
        if (qb + 1 < nqb) {   // the other buffer's statistics were last read in step qb-1
            if (tid < BWD_BLOCK_M) s_lse[(buf ^ 1) * BWD_BLOCK_M + tid] = next_stat;
            else if (tid < 2 * BWD_BLOCK_M) s_delta[(buf ^ 1) * BWD_BLOCK_M + tid - BWD_BLOCK_M] = next_stat;
        }
        if (ORDERED && tid == 0) {   // block qb - 1 to the next key block; wait for our turn at block qb
            if (qb > 0) hand_on_dq_turn(turn + qb - 1);
            wait_dq_turn(turn + qb, kb, seen_turn);
        }
        __syncthreads();   // dSᵀ complete (and dQ of block qb may be added)

        // dQ += dS·K/sqrt(D): tile t = queries 16(t%4).. × columns (t/4)·D/2.., summed over the keys
#pragma unroll
        for (int i = 0; i < 8 / WARPS; i++) {
            const int tile = warp + i * WARPS, dq_m0 = (tile % 4) * 16, dq_n0 = (tile / 4) * (D / 2);
            float dq_acc[NT / 2][4] = {};
#pragma unroll
            for (int ks = 0; ks < BLOCK_N / 16; ks++) {
                uint32_t af[4];
                ldmatrix_x4_trans(af, smem + S::DS + (ks * 16 + (mi / 2) * 8 + r8) * S::DS_STRIDE + (dq_m0 + (mi % 2) * 8) * 2);
#pragma unroll
                for (int np = 0; np < NT / 4; np++) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, smem + S::K + (ks * 16 + (mi % 2) * 8 + r8) * S::STRIDE +
                                             (dq_n0 + np * 16 + (mi / 2) * 8) * 2);
                    mma_bf16(dq_acc[2 * np], af, b[0], b[1]);
                    mma_bf16(dq_acc[2 * np + 1], af, b[2], b[3]);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int row = q0 + dq_m0 + g + 8 * h;
                if (row >= N) continue;
                float *dq_row = a.dq + head + (size_t)row * D + dq_n0 + 2 * c;
#pragma unroll
                for (int j = 0; j < NT / 2; j++)
                    atomic_add_f32x2(dq_row + 8 * j, dq_acc[j][2 * h] * inv_sqrt_d, dq_acc[j][2 * h + 1] * inv_sqrt_d);
            }
        }
    }
    if (ORDERED) {
        __syncthreads();
        if (tid == 0) hand_on_dq_turn(turn + nqb - 1);
    }

    store_key_block_grads<D>(a, bh, k0 + warp * 16 + g, key_valid, &dk_acc[0][0], &dv_acc[0][0], inv_sqrt_d);
}

template <int D, int WARPS, int SRC, bool ORDERED>
static int launch_attention_backward_kernel(const AttnBwdArgs &a, int BH, cudaStream_t stream, char *err) {
    int bytes = AttnBwdSmem<D, WARPS, SRC>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(attention_backward_kernel<D, WARPS, SRC, ORDERED>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                    err, "cudaFuncSetAttribute(attention_backward_kernel max dynamic smem)");
    dim3 grid((a.N + 16 * WARPS - 1) / (16 * WARPS), BH);
    attention_backward_kernel<D, WARPS, SRC, ORDERED><<<grid, WARPS * 32, bytes, stream>>>(a);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch attention_backward_kernel");
    return 0;
}
template <int D, int WARPS, int SRC>
static int launch_attention_backward_warps(const AttnBwdArgs &a, int BH, cudaStream_t stream, char *err) {
    if (a.dq_turn) return launch_attention_backward_kernel<D, WARPS, SRC, true>(a, BH, stream, err);
    return launch_attention_backward_kernel<D, WARPS, SRC, false>(a, BH, stream, err);
}

// The backward kernel for B·H = BH heads (a from attention_backward_prepare). 8 warps (128 keys) per CTA,
// or 4 (64 keys) where the device's shared memory per block is too small for 8 (e.g. sage at
// D = 128 on sm_80: 196 KB > 163 KB); DIT_ATTN_BWD_WARPS=4 picks 4 anyway (tests that path).
template <int D, int SRC>
static int launch_attention_backward(const AttnBwdArgs &a, int BH, cudaStream_t stream, char *err) {
    int device = 0, smem_max = 0;
    SAGE_CUDA_CHECK(cudaGetDevice(&device), err, "cudaGetDevice");
    SAGE_CUDA_CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), err,
                    "cudaDeviceGetAttribute(max shared memory per block)");
    const char *force = getenv("DIT_ATTN_BWD_WARPS");
    bool four = force && strcmp(force, "4") == 0;
    if (!four && AttnBwdSmem<D, 8, SRC>::TOTAL <= smem_max) return launch_attention_backward_warps<D, 8, SRC>(a, BH, stream, err);
    if (AttnBwdSmem<D, 4, SRC>::TOTAL <= smem_max) return launch_attention_backward_warps<D, 4, SRC>(a, BH, stream, err);
    dit_set_error(err, "attention backward (D=%d, %s): needs %d bytes of shared memory per block, the device has %d",
                  D, SRC == SCORES_SAGE ? "sage" : "bf16", AttnBwdSmem<D, 4, SRC>::TOTAL, smem_max);
    return -1;
}
