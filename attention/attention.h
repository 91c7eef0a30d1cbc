// Attention, CPU fp32 reference: exact attention and the bit-defined sage (quantized) attention.
// This file is the spec the GPU kernels are tested against.
//
// Layout everywhere: q, k, v, out and their gradients are (B, H, N, D) contiguous fp32;
// lse is (B, H, N). Non-causal. Softmax scale is 1/sqrt(D).
// lse is in BASE 2 of the scaled logits: with s_ij = (1/sqrt(D))·log2(e)·q_i·k_j,
// lse_i = log2(sum_j 2^{s_ij}), so that P_ij = exp2(s_ij - lse_i).
// Backward functions ACCUMULATE into dq, dk, dv (+=), as every backward in dit.c does.
// Error handling: pure compute without a return code; the functions trust their arguments
// (B, H, N, D >= 1, buffers of the sizes given here, SageConfig blocks >= 1) and check nothing.
// The checked entry points (0 / -1 and a message, layers/common.h) are the CUDA versions
// (sage_cuda.h, flash_cuda.h), the data loader, the safetensors reader and the checkpoints.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---- exact attention -------------------------------------------------------
// out = softmax(q·kᵀ/sqrt(D))·v, lse as above.
void attention_forward(float *out, float *lse,
                       const float *q, const float *k, const float *v,
                       int B, int H, int N, int D);
// P = exp2(s - lse); D_i = rowsum(dout∘out); dv += Pᵀ·dout; dP = dout·vᵀ;
// dS = P∘(dP - D); dq += dS·k/sqrt(D); dk += dSᵀ·q/sqrt(D).
void attention_backward(float *dq, float *dk, float *dv,
                        const float *dout, const float *q, const float *k, const float *v,
                        const float *out, const float *lse,
                        int B, int H, int N, int D);

// ---- sage attention: the bit-defined quantized attention ----------------------
// Per (b, h):
//  1. K smoothing: k_mean[d] = mean_n k[n, d]; ks = k - k_mean (softmax is unchanged by it).
//  2. Q to INT8 per block of q_block consecutive tokens, softmax scale folded in:
//     x = q·c with c = (1/sqrtf(D))·1.44269504f (float); amax = max|x| over the block;
//     q_scale = amax/127; q8 = rintf(x·(127/amax)) (round half to even; amax = 0 gives 0).
//     K the same on ks, per block of k_block tokens, without c.
//  3. s_ij = (float)(Σ_d q8_id·k8_jd) · (q_scale_blk(i) · k_scale_blk(j))   (log2 domain).
//  4. Online softmax in base 2 over key blocks of k_block, in order:
//     m' = max(m, max_j s_ij); alpha = exp2(m - m'); P_ij = exp2(s_ij - m') (fp32);
//     l = l·alpha + Σ_j P_ij (from the unrounded P);
//     FP8:  acc_d = acc_d·alpha + Σ_j e4m3(P_ij·448)·e4m3(v_jd/v_scale_d)  (the block sum is
//           formed in fp32 and then added: two-level accumulation), v_scale_d = max_n|v_nd|/448
//           per channel (0 gives 0); out_d = acc_d·v_scale_d/448/l.
//           e4m3 rounding is round-to-nearest-even, saturating at ±448.
//     FP16: acc_d = acc_d·alpha + Σ_j fp16(P_ij)·fp16(v_jd); out_d = acc_d/l.
//  5. lse_i = m + log2(l): base 2, in the smoothed space (the backward recomputes the same s).
// Backward (quantizers are the identity for the gradient): recompute s from the same q8, k8;
// P = exp2(s - lse); Dr_i = rowsum(dout∘out); dv += Pᵀ·dout; dP = dout·vᵀ; dS = P∘(dP - Dr);
// dq += dS·ks/sqrt(D) (smoothed k: exact when rows of dS sum to 0, and robust to large k offsets
// when the quantized forward makes them not quite 0); dk += dSᵀ·q/sqrt(D).
// This is SAGE_BWD_FP32 (the default): P, dS, dout, q, ks enter the products in fp32 here (the
// GPU kernels round them to bf16), each term added to dq, dk, dv in fp32 in the loop order.
// INT8 backward (SageBwd-style): the three gradient products in INT8 with int32 sums.
// Per (b, h), query blocks I of q_block rows (outer loop) and key blocks J of k_block keys
// (inner loop), in order. "To INT8 over a set" is step 2's rule: amax = max|x| over the set,
// scale = amax/127, x8 = rintf(x·(127/amax)) (round half to even, |x8| <= 127; amax = 0 gives 0).
//  a. dout of block I to INT8 over the block's q_block × D values: do8, do_scale_I.
//  b. Block (I, J) in fp32 as above: P_ij = exp2f(s_ij - lse_i), dP_ij = Σ_d dout_id·v_jd (fp32,
//     not quantized), dS_ij = P_ij·(dP_ij - Dr_i). Then to INT8, with the sets of cfg.bwd:
//       SAGE_BWD_INT8_BLOCK: one set per block (I, J) for each of P, dS: p_scale_j = p_scale_IJ,
//         dsk_scale_j = dsq_scale_i = ds_scale_IJ (one ds8 serves dq and dk).
//       SAGE_BWD_INT8_TOKEN: P per key (column j over i ∈ I): p8, p_scale_j; dS per key for dk:
//         dsk8, dsk_scale_j; dS per query (row i over j ∈ J) for dq: dsq8, dsq_scale_i.
//  c. With r = 1/sqrtf(D) and u = r/c (c of step 2: q8·q_scale·u ≈ q/sqrt(D), log2(e) undone):
//     dv_jd += (float)(Σ_{i∈I} p8_ij·do8_id)   · (p_scale_j·do_scale_I)
//     dk_jd += (float)(Σ_{i∈I} dsk8_ij·q8_id)  · ((dsk_scale_j·q_scale_I)·u)
//     dq_id += (float)(Σ_{j∈J} dsq8_ij·k8_jd)  · ((dsq_scale_i·k_scale_J)·r)
//     int32 sums (exact), fp32 products left to right, one fp32 add per block into the outputs.
//  Every scale factors out of its product's sum (a per-row scale of the left operand), so each is
//  one multiply of the int32 tile. Accuracy (dev/notes_attention_cpu.md): TOKEN keeps dq, dk, dv
//  cosine >= 0.9998 against exact attention on Gaussian inputs; BLOCK gives 0.9988 for dq, dk.
// FP8 backward: the same three products with 8-bit float operands (the candidates for Hopper's
// FP8 wgmma; dev/notes_sage_fp8_bwd.md). Same loops and blocks (I, J) as the INT8 backward; dP
// stays fp32 and S is recomputed from q8, k8 as above. "To F over a set" (F = e4m3, largest
// value M = 448, or e5m2, M = 57344; round_to_e4m3 / round_to_e5m2): amax = max|x| over the
// set, scale = amax/M, x8 = F(x·(M/amax)) (nearest-even, saturating; amax = 0 gives 0).
//  a. Operands, per (b, h), all e4m3: dout -> do8, do_scale; q -> qe8, qe_scale (q itself, not
//     q8: 8-bit wgmma needs both operands FP8, and a kernel writes these transposed in a pre-pass
//     anyway); ks = k - k_mean -> ke8, ke_scale. The sets: TILE modes: per block of q_block
//     queries (dout, q) or k_block keys (ks); BOUND modes: the whole head (one scale each, so that
//     every scale factors out of every accumulation), with q replaced by q'_i = sigma_i·q_i below.
//  b. Block (I, J): P, dP, dS in fp32 exactly as the INT8 backward. p8_ij = e4m3(P_ij·448)
//     (static scale: P <= 1). dS to F_ds (e4m3 or e5m2 by mode, M_ds its largest value):
//       SAGE_BWD_FP8_TILE (F_ds e4m3), SAGE_BWD_FP8_E5M2_TILE (e5m2): one set per block (I, J):
//         ds8, sigma_i = ds_scale_IJ.
//       SAGE_BWD_FP8_BOUND (e4m3), SAGE_BWD_FP8_E5M2_BOUND (e5m2): no reduction over the tile: a
//         per-query bound b_i >= max_j |dS_ij|, b_i = 2^(m_i - lse_i)·(|dout_i|_2·vmax + |Dr_i|),
//         m_i = max_j s_ij over the nk keys given (P_ij <= 2^(m_i - lse_i); a kernel takes m_i
//         from the forward), vmax = max_j |v_j|_2 over the nk keys given (norms: fp32 sums in d
//         order, sqrtf); ds8_ij = F_ds(dS_ij·(M_ds/b_i)), sigma_i = b_i/M_ds (b_i = 0 gives 0).
//  c. With r = 1/sqrtf(D), fp32 sums of the exact products in index order:
//     dv_jd += (Σ_{i∈I} p8_ij·do8_id)  · (do_scale/448)
//     dk_jd += (Σ_{i∈I} ds8_ij·qe8_id) · ((sigma_i·qe_scale)·r)   TILE (sigma_i = ds_scale_IJ)
//     dk_jd += (Σ_{i∈I} ds8_ij·qe8_id) · (qe_scale·r)             BOUND (sigma_i is in qe8)
//     dq_id += (Σ_{j∈J} ds8_ij·ke8_jd) · ((sigma_i·ke_scale)·r)
//     each product of a block scaled once and added in fp32, as in the INT8 backward.
typedef enum { SAGE_PV_FP8 = 0, SAGE_PV_FP16 = 1 } SagePV;
typedef enum {
    SAGE_BWD_FP32 = 0, SAGE_BWD_INT8_BLOCK = 1, SAGE_BWD_INT8_TOKEN = 2,
    SAGE_BWD_FP8_TILE = 3, SAGE_BWD_FP8_E5M2_TILE = 4, SAGE_BWD_FP8_BOUND = 5, SAGE_BWD_FP8_E5M2_BOUND = 6
} SageBwd;
typedef struct {
    int q_block;   // tokens per Q scale (default 64)
    int k_block;   // tokens per K scale, and the key-block size of the online softmax (default 64)
    SagePV pv;     // precision of P·V
    int rotate;    // 1: q and k are first multiplied by the normalized Walsh-Hadamard matrix H
                   // (hadamard_rotate; S = (qH)(kH)ᵀ is unchanged in exact arithmetic, and outlier
                   // channels are spread over all channels before INT8 quantization); the backward
                   // rotates dq and dk back. D a power of two. Default 0 here; on the GPU the
                   // rotation is attention/hadamard_cuda.h, applied by the model (train_dit
                   // --sage-rotate, default 1).
    SageBwd bwd;   // precision of the backward's products (CPU definition only so far; default
                   // SAGE_BWD_FP32 = 0, so a zero-initialized or designated initializer keeps it;
                   // a value outside the enum: message on stderr and NaN gradients)
} SageConfig;
#define SAGE_CONFIG_DEFAULT ((SageConfig){64, 64, SAGE_PV_FP8, 0, SAGE_BWD_FP32})

// Quantized Q and K of one call, as the forward and backward see them.
// q8, k8: (B, H, N, D) int8; q_scale: (B, H, ceil(N/q_block)); k_scale: (B, H, ceil(N/k_block));
// k_mean: (B, H, D).
typedef struct {
    int8_t *q8, *k8;
    float *q_scale, *k_scale, *k_mean;
} SageQK;
void sage_quantize_qk(SageQK *qk, const float *q, const float *k,
                      int B, int H, int N, int D, SageConfig cfg);
void sage_forward(float *out, float *lse,
                  const float *q, const float *k, const float *v,
                  int B, int H, int N, int D, SageConfig cfg);
void sage_backward(float *dq, float *dk, float *dv,
                   const float *dout, const float *q, const float *k, const float *v,
                   const float *out, const float *lse,
                   int B, int H, int N, int D, SageConfig cfg);

// ---- sage attention in parts: the quantizers and the attention of quantized inputs -----------
// sage_forward is sage_quantize_qk, sage_v_scale (FP8), sage_quantize_v, then
// sage_forward_quantized; sage_backward is sage_quantize_qk, then sage_backward_quantized (bit
// for bit). A caller that holds a shard of the tokens (ring attention, sequence_parallel.h) calls
// the parts with the GLOBAL k_mean and v_scale and runs the queries of one shard against the
// keys of another. Here a tensor of n tokens is (B, H, n, D); nq query and nk key tokens.
// Step 2 for Q: q (B, H, n, D) -> q8 (B, H, n, D) int8, q_scale (B, H, ceil(n/q_block)).
void sage_quantize_q(int8_t *q8, float *q_scale, const float *q,
                     int B, int H, int n, int D, int q_block);
// Step 2 for K, smoothed with the given k_mean (B, H, D): k (B, H, n, D) -> k8 of k - k_mean
// (B, H, n, D) int8, k_scale (B, H, ceil(n/k_block)).
void sage_quantize_k(int8_t *k8, float *k_scale, const float *k, const float *k_mean,
                     int B, int H, int n, int D, int k_block);
// FP8 scale of step 4 over the n tokens given: v (B, H, n, D) -> v_scale (B, H, D).
void sage_v_scale(float *v_scale, const float *v, int B, int H, int n, int D);
// V as P·V sees it: v (B, H, n, D) -> v_q (B, H, n, D), FP8: e4m3(v/v_scale) with the given
// v_scale (B, H, D); FP16: fp16(v) (v_scale unused, may be NULL).
void sage_quantize_v(float *v_q, const float *v, const float *v_scale,
                     int B, int H, int n, int D, SagePV pv);
// Steps 3-5 from scratch (m = -inf, l = 0, acc = 0) over the nk keys given:
// q8 (B, H, nq, D), q_scale (B, H, ceil(nq/q_block)); k8 (B, H, nk, D),
// k_scale (B, H, ceil(nk/k_block)); v_q (B, H, nk, D); v_scale (B, H, D) (FP8; FP16: unused)
// -> out (B, H, nq, D), lse (B, H, nq). Query block i/q_block and key block j/k_block count
// from the start of the given tokens. Partial results over disjoint key sets combine exactly
// by their lse (ring_merge_partial).
void sage_forward_quantized(float *out, float *lse,
                            const int8_t *q8, const float *q_scale,
                            const int8_t *k8, const float *k_scale,
                            const float *v_q, const float *v_scale,
                            int B, int H, int nq, int nk, int D, SageConfig cfg);
// The backward's sum over the nk keys given: dout, q, out, dq (B, H, nq, D), lse (B, H, nq);
// k, v, dk, dv (B, H, nk, D); q8, q_scale, k8, k_scale as in sage_forward_quantized;
// k_mean (B, H, D). out and lse are those of the forward over ALL keys, so that the sums over
// key sets add up to sage_backward's. dq, dk, dv accumulate (+=).
void sage_backward_quantized(float *dq, float *dk, float *dv,
                             const float *dout, const float *q, const float *k, const float *v,
                             const float *out, const float *lse,
                             const int8_t *q8, const float *q_scale,
                             const int8_t *k8, const float *k_scale, const float *k_mean,
                             int B, int H, int nq, int nk, int D, SageConfig cfg);

// x (rows, D) in place: each row times the normalized Walsh-Hadamard matrix H (symmetric,
// orthogonal, so applying it twice gives x back). D a power of two.
void hadamard_rotate(float *x, size_t rows, int D);

// Rounding helpers of the definition (also used by tests).
float round_to_e4m3(float x);   // nearest-even, saturating at ±448
float round_to_e5m2(float x);   // nearest-even, saturating at ±57344
float round_to_fp16(float x);   // nearest-even

#ifdef __cplusplus
}
#endif
