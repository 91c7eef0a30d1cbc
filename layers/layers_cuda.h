// The layers of a DiT in CUDA: the twin of every forward/backward of layers/layers.h, same
// argument order, names with a _cuda suffix, then (where needed) the LayersCuda context, the
// stream and the error buffer. Every function returns 0, or -1 with a message in `err` naming
// the call and the sizes (layers/common.h's convention); launches are asynchronous on `stream`.
//
// Precision (as llm.c):
// - activations, activation gradients and the weights used in compute: bf16 (`bf16`);
// - parameter gradients, master weights, AdamW moments: fp32;
// - LayerNorm statistics, every reduction (dshift, dscale, dgate, dbias, norms) and the loss:
//   fp32, with a fixed summation order (no float atomics): the same inputs give the same bits.
// - matrix products: cuBLASLt, bf16 inputs, fp32 accumulation.
// Backward passes accumulate (+=) into gradients, as the CPU reference, except where a comment
// says the output is written. All pointers are device pointers unless a comment says otherwise.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>
#include <cublasLt.h>

#ifdef __CUDACC__
#include <cuda_bf16.h>
typedef __nv_bfloat16 bf16;
#else
typedef struct { uint16_t bits; } bf16;   // host view of __nv_bfloat16: the same 2 bytes
#endif

#ifdef __cplusplus
extern "C" {
#endif

// Host-side bf16 conversions (round to nearest even; NaN stays NaN).
static inline uint16_t bf16_bits_from_float(float f) {
    union { float f; uint32_t u; } x = { f };
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}
static inline float float_from_bf16_bits(uint16_t h) {
    union { uint32_t u; float f; } x = { (uint32_t)h << 16 };
    return x.f;
}

// ---- context: the cuBLASLt handle and workspace, and the scratch of the reductions --------
// The layers' kernels that use a context's workspace, scratch or counters must run one after the
// other: give each stream that runs layers concurrently a context of its own.
// How the FP8 linears' GEMMs (layers/linear_fp8_cuda.h) accumulate. Hopper's FP8 tensor cores add
// each instruction's products in an adder of fewer bits than fp32; cuBLASLt's kernels either promote
// the partial sums into fp32 registers every few k-steps or, with FAST_ACCUM, leave them in that
// adder for the whole sum (faster; dev/notes_step.md session 23 measures what it costs).
typedef enum {
    FP8_ACCUM_PROMOTED = 0,       // every FP8 GEMM promotes (the context's default)
    FP8_ACCUM_FAST_FORWARD = 1,   // the forward's GEMM fast, the backward's promote: Transformer
                                  // Engine's and torchao's defaults
    FP8_ACCUM_FAST_ALL = 2,       // the backward's dinp and dweight GEMMs fast too
} Fp8Accumulation;
typedef struct GemmTuning GemmTuning;   // layers/gemm_tuning.cu
typedef struct {
    cublasLtHandle_t lt;
    void *lt_workspace;
    size_t lt_workspace_bytes;
    float *scratch;              // partial sums of the deterministic reductions
    size_t scratch_floats;
    unsigned *tile_counters;     // LAYERS_TILE_COUNTERS arrival counts of the split column sums
                                 // (zero between calls: the last block of a tile resets its own)
    Fp8Accumulation fp8_accumulation;   // FP8_ACCUM_PROMOTED after create
    GemmTuning *gemm_tuning;     // NULL after create: every GEMM takes cuBLASLt's first heuristic
                                 // answer; layers_cuda_set_gemm_tuning: the fastest of its candidates
} LayersCuda;
// Column tiles (image × 256 columns) a split column sum (dbias, dshift, dscale, dgate) may have:
// the sums split their rows only while the tiles are fewer than the 512 blocks they aim for.
#define LAYERS_TILE_COUNTERS 512
// scratch_floats: at least the largest linear_backward_scratch_floats() and REDUCE_PARTIALS.
int layers_cuda_create(LayersCuda *ctx, size_t scratch_floats, char *err);
void layers_cuda_destroy(LayersCuda *ctx);
// on: from now on each GEMM shape's algorithm is the fastest of cuBLASLt's candidates, timed at the
// shape's first call outside a graph capture (the heuristic's first answer unless another is 1%
// faster; layers/gemm_tuning.cu). The pick depends on timings: two contexts may pick differently and
// give other bits. off: the heuristic's first answer again (the picks are forgotten).
int layers_cuda_set_gemm_tuning(LayersCuda *ctx, int on, char *err);
// Partial sums a linear backward with a bias gradient needs in ctx->scratch.
size_t linear_backward_scratch_floats(int M, int OC);
// Partial sums layernorm_modulate_backward_cuda and gated_residual_backward_cuda use in
// ctx->scratch for their fastest split of the token sums (less scratch: fewer splits, slower).
size_t modulation_backward_scratch_floats(int B, int T, int C);
// Number of per-block partials of the global norm and the loss (a fixed grid: fixed order).
#define REDUCE_PARTIALS 1024

// ---- casts -------------------------------------------------------------------------------
int cast_float_to_bf16_cuda(bf16 *out, const float *inp, size_t n, cudaStream_t stream, char *err);
// out (rows, cols) contiguous = bf16 of rows·cols floats whose rows lie inp_stride apart (a column
// slice of a wider matrix, e.g. one block's part of the adaLN gradient).
int cast_float_to_bf16_rows_cuda(bf16 *out, const float *inp, int rows, int cols, size_t inp_stride,
                                 cudaStream_t stream, char *err);
int cast_bf16_to_float_cuda(float *out, const bf16 *inp, size_t n, cudaStream_t stream, char *err);

// ---- reshapes (pure data movement: bit-exact) ---------------------------------------------
int patchify_forward_cuda(bf16 *patches, const bf16 *img, int B, int Cin, int S, int p,
                          cudaStream_t stream, char *err);
int unpatchify_forward_cuda(bf16 *img, const bf16 *tokens, int B, int Cout, int S, int p,
                            cudaStream_t stream, char *err);
int unpatchify_backward_cuda(bf16 *dtokens, const bf16 *dimg, int B, int Cout, int S, int p,
                             cudaStream_t stream, char *err);
int split_heads_forward_cuda(bf16 *q, bf16 *k, bf16 *v, const bf16 *qkv, int B, int T, int H, int D,
                             cudaStream_t stream, char *err);
int split_heads_backward_cuda(bf16 *dqkv, const bf16 *dq, const bf16 *dk, const bf16 *dv,
                              int B, int T, int H, int D, cudaStream_t stream, char *err);
// out_amax (here and in the producers below): NULL, or a device float raised to
// max(*out_amax, max |out|) on the way (exact; for an FP8 linear that quantizes out:
// layers/linear_fp8_cuda.h). NULL runs the kernel of before (a template instance without it).
int merge_heads_forward_cuda(bf16 *out, const bf16 *o, int B, int T, int H, int D, float *out_amax,
                             cudaStream_t stream, char *err);
int merge_heads_backward_cuda(bf16 *do_, const bf16 *dout, int B, int T, int H, int D,
                              cudaStream_t stream, char *err);

// ---- linear (cuBLASLt) -------------------------------------------------------------------
// out (M, OC) = inp (M, IC) · weightᵀ (OC, IC) + bias (OC), bias in the epilogue; bias may be NULL.
int linear_forward_cuda(bf16 *out, const bf16 *inp, const bf16 *weight, const bf16 *bias,
                        int M, int IC, int OC, const LayersCuda *ctx, cudaStream_t stream, char *err);
// The MLP's first layer: pre_gelu = inp·weightᵀ + bias (kept for the backward), out = GELU(pre_gelu),
// one GEMM with the GELU_AUX_BIAS epilogue. OC must be a multiple of 8 (cuBLASLt's aux rule).
int linear_gelu_forward_cuda(bf16 *out, bf16 *pre_gelu, const bf16 *inp, const bf16 *weight,
                             const bf16 *bias, int M, int IC, int OC,
                             const LayersCuda *ctx, cudaStream_t stream, char *err);
// dinp (bf16) = dinp_beta·dinp + dout·weight (1: accumulate, the CPU spec's +=; 0: write, dinp's
// old values unread, for a dinp with no other contribution); dweight (fp32) = dweight_beta·dweight
// + doutᵀ·inp (likewise); dbias (fp32) += Σ_m dout. dinp, dweight and dbias may each be NULL. dbias
// needs linear_backward_scratch_floats(M, OC) of scratch.
int linear_backward_cuda(bf16 *dinp, float dinp_beta, float *dweight, float dweight_beta, float *dbias,
                         const bf16 *dout, const bf16 *inp, const bf16 *weight,
                         int M, int IC, int OC, const LayersCuda *ctx, cudaStream_t stream, char *err);
// The MLP's second layer, whose input is GELU(pre_gelu): dpre (M, IC) = (dout·weight)∘GELU'(pre_gelu)
// is WRITTEN (the DGELU epilogue; the pre-activation has one consumer); dweight (with dweight_beta)
// and dbias as in linear_backward_cuda. Equals linear_backward into a zeroed dinp, then
// gelu_backward. IC must be a multiple of 8.
int linear_dgelu_backward_cuda(bf16 *dpre, float *dweight, float dweight_beta, float *dbias,
                               const bf16 *dout, const bf16 *inp, const bf16 *pre_gelu,
                               const bf16 *weight, int M, int IC, int OC,
                               const LayersCuda *ctx, cudaStream_t stream, char *err);

// ---- LayerNorm (no affine, eps 1e-6) fused with adaLN modulation --------------------------
// out (bf16) = x̂·(1 + scale_b) + shift_b; mean, rstd (B, T) fp32. shift, scale: bf16, sample b
// at b·mod_stride (slices of the adaLN projection's output). C <= 4096 (a row in one warp's
// registers; also for the backward).
int layernorm_modulate_forward_cuda(bf16 *out, float *mean, float *rstd,
                                    const bf16 *inp, const bf16 *shift, const bf16 *scale,
                                    int B, int T, int C, int mod_stride, float *out_amax,
                                    cudaStream_t stream, char *err);
// A gated residual and the LayerNorm-modulate of its result, in one pass over the rows (a DiT
// block's x_mid = x + gate_msa·proj, then norm2(x_mid)): x_new (bf16) = res + gate_b·h, as
// gated_residual_forward_cuda stores it; then out, mean, rstd (and out_amax) of
// layernorm_modulate_forward_cuda on that x_new. Bitwise the two calls. gate: sample b at
// b·gate_stride; shift, scale at b·mod_stride (C <= 4096, as above).
int gated_residual_layernorm_modulate_forward_cuda(bf16 *x_new, bf16 *out, float *mean, float *rstd,
                                                   const bf16 *res, const bf16 *h, const bf16 *gate,
                                                   const bf16 *shift, const bf16 *scale, int B, int T, int C,
                                                   int gate_stride, int mod_stride, float *out_amax,
                                                   cudaStream_t stream, char *err);
// dinp (bf16, may be NULL) += rstd·(dx̂ - mean_c(dx̂) - x̂·mean_c(dx̂·x̂)); dshift_b, dscale_b
// (fp32, sample b at b·mod_stride) += Σ_t dout, Σ_t dout·x̂. The token sums are split over
// blocks of rows whose partial sums go to ctx->scratch (as many splits as it holds, so the
// result depends only on the shapes and the scratch size: bitwise the same run to run).
int layernorm_modulate_backward_cuda(bf16 *dinp, float *dshift, float *dscale,
                                     const bf16 *dout, const bf16 *inp, const float *mean,
                                     const float *rstd, const bf16 *scale,
                                     int B, int T, int C, int mod_stride,
                                     const LayersCuda *ctx, cudaStream_t stream, char *err);

// ---- gated residual: out = res + gate_b·h ------------------------------------------------
int gated_residual_forward_cuda(bf16 *out, const bf16 *res, const bf16 *h, const bf16 *gate,
                                int B, int T, int C, int mod_stride, cudaStream_t stream, char *err);
// dres (bf16, may be NULL) += dout; dh (bf16) = gate·dout, WRITTEN (not added: in a DiT block h
// has no other consumer; the CPU's gated_residual_backward into a zeroed dh); dgate_b (fp32) +=
// Σ_t dout·h (token sums split as in layernorm_modulate_backward_cuda, partials in ctx->scratch).
// dres must not alias dout. dh_amax: NULL, or raised to max |dh| (as out_amax above). dh_dbias:
// NULL, or the bias gradient of the linear whose dout dh is (the block's proj and fc2): += Σ over
// the B·T rows of dh, in the same pass and bitwise as that linear's backward would add it (which
// then takes dbias NULL); needs linear_backward_scratch_floats(B·T, C) of ctx->scratch. dh and
// dres both NULL: dgate only (the FP8 model quantizes dh in a pass of its own: gated_dh_fp8_cuda).
int gated_residual_backward_cuda(bf16 *dres, bf16 *dh, float *dgate,
                                 const bf16 *dout, const bf16 *h, const bf16 *gate,
                                 int B, int T, int C, int mod_stride, float *dh_amax, float *dh_dbias,
                                 const LayersCuda *ctx, cudaStream_t stream, char *err);

// ---- pointwise (bf16 in and out, fp32 math) -----------------------------------------------
// GELU and the in-place dGELU (the FP8 MLP's; amax: NULL, or raised to max |result|, as out_amax).
int gelu_forward_cuda(bf16 *out, const bf16 *inp, size_t n, float *amax, cudaStream_t stream, char *err);
int gelu_backward_cuda(bf16 *dinp, const bf16 *inp, const bf16 *dout, size_t n,
                       cudaStream_t stream, char *err);
// d = GELU'(inp)·d in place (WRITTEN, not accumulated: the FP8 MLP's dGELU after its dinp GEMM).
int gelu_backward_inplace_cuda(bf16 *d, const bf16 *inp, size_t n, float *amax, cudaStream_t stream, char *err);
// The same on d (M, C), which is also the dout of a linear with a bias (the MLP's fc1): in the same
// pass dbias (fp32, C) += Σ_m d of the bf16 values written, summed as linear_backward_cuda sums its
// dbias (the same chunks of rows in the same order: bitwise its result), so that linear's backward
// can skip its own dbias pass. Needs linear_backward_scratch_floats(M, C) of ctx->scratch.
int gelu_backward_inplace_dbias_cuda(bf16 *d, const bf16 *inp, float *dbias, int M, int C, float *amax,
                                     const LayersCuda *ctx, cudaStream_t stream, char *err);
int silu_forward_cuda(bf16 *out, const bf16 *inp, size_t n, cudaStream_t stream, char *err);
int silu_backward_cuda(bf16 *dinp, const bf16 *inp, const bf16 *dout, size_t n,
                       cudaStream_t stream, char *err);
int add_forward_cuda(bf16 *out, const bf16 *a, const bf16 *b, size_t n, cudaStream_t stream, char *err);

// ---- conditioning ------------------------------------------------------------------------
// t: B fp32 flow-matching times; out (B, dim) bf16.
int timestep_embedding_forward_cuda(bf16 *out, const float *t, int B, int dim,
                                    cudaStream_t stream, char *err);
// labels: B device ints in [0, num_classes]; table bf16; dtable fp32 (sums in sample order).
int embedding_forward_cuda(bf16 *out, const bf16 *table, const int *labels, int B, int C,
                           cudaStream_t stream, char *err);
int embedding_backward_cuda(float *dtable, const bf16 *dout, const int *labels, int B, int C,
                            cudaStream_t stream, char *err);
int pos_embed_2d_cuda(bf16 *out, int G, int C, cudaStream_t stream, char *err);

// ---- flow-matching loss ------------------------------------------------------------------
// x_t (bf16) = (1 - t_b)·x0 + t_b·ε; v_target (fp32) = ε - x0; x0, noise, t fp32.
int flow_matching_inputs_cuda(bf16 *x_t, float *v_target, const float *x0, const float *noise,
                              const float *t, int B, int n_per_sample, cudaStream_t stream, char *err);
// *loss (one device float) = mean (pred - v)²; dpred (bf16, may be NULL) = 2·(pred - v)/n, written.
int mse_loss_forward_backward_cuda(bf16 *dpred, float *loss, const bf16 *pred, const float *target,
                                   size_t n, const LayersCuda *ctx, cudaStream_t stream, char *err);

// ---- optimizer (fp32) --------------------------------------------------------------------
// *sumsq (one device float) = Σ g², two passes over a fixed grid of REDUCE_PARTIALS blocks; the
// global norm ‖g‖₂ is then sqrt_cuda of it (several ranks: of the sum of their sums).
int sum_squares_cuda(float *sumsq, const float *g, size_t n, const LayersCuda *ctx,
                     cudaStream_t stream, char *err);
// *norm = sqrt(*sumsq) (device floats; may be the same).
int sqrt_cuda(float *norm, const float *sumsq, cudaStream_t stream, char *err);
// The optimizer's values that change from step to step, which its kernels read from device
// memory (so that a CUDA graph of the training step, model/dit_gpu.h, reads each step's own):
// AdamW's learning rate and bias corrections bias1 = 1 - β1^step, bias2 = 1 - β2^step, and the
// EMA's decay. optimizer_step_constants fills one on the host (the corrections with the host's
// powf, as adamw_update); the caller copies it to the device. Error: step < 1.
typedef struct { float lr, bias1, bias2, ema_decay; } OptimizerStepConstants;
int optimizer_step_constants(OptimizerStepConstants *k, float lr, float beta1, float beta2, int step,
                             float ema_decay, char *err);
// AdamW as adamw_update with lr, bias1, bias2 read from k (device) and the clipping scale read on
// the device: grad_scale = min(1, max_norm / (*grad_norm + 1e-6)) as
// torch.nn.utils.clip_grad_norm_; grad_norm NULL or max_norm <= 0: no clipping. Updates the fp32
// params and writes their bf16 copy params_bf16; ema (NULL: none) then gets ema_update's step
// from the updated params with k->ema_decay, in the same pass.
int adamw_update_cuda(float *params, bf16 *params_bf16, const float *grads, float *m, float *v, float *ema, size_t n,
                      const OptimizerStepConstants *k, float beta1, float beta2, float eps, float weight_decay,
                      const float *grad_norm, float max_norm, cudaStream_t stream, char *err);

#ifdef __cplusplus
}
#endif
