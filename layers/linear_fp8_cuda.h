// The FP8 linear layer in CUDA: the shapes and semantics of linear_forward_cuda /
// linear_backward_cuda (layers/layers_cuda.h, bf16 in and out, fp32 weight gradients), with the
// matrix products done by cuBLASLt in FP8 (fp32 accumulation, or the tensor cores' faster one as
// ctx->fp8_accumulation says: layers/layers_cuda.h) on operands
// quantized per tensor with a power-of-two scale from the tensor's current amax (layers/fp8.h):
// inp and weight to e4m3, dout to e5m2 or e4m3. The CPU definition is linear_fp8_forward/_backward.
//
// Each call quantizes what it needs (an amax reduction, then one pass per tensor writing the
// row-major and/or transposed fp8 copies that Hopper's K-major "TN" FP8 GEMMs need) into the
// caller's workspace, and passes the scales to cuBLASLt as device pointers (no host sync). The
// forward can also keep its quantized input and weight for the backward (Fp8Saved), which then
// reads those copies instead of quantizing inp and weight again. A caller whose kernel wrote inp (or
// dout) can take its amax on the way (layers/cuda_common.cuh, amax_update) and pass it
// (Fp8Scaling.amax, dout_amax): the call then skips its own amax pass; the scale, the bytes and the
// result are the same. Likewise the backward's weight_amax (the forward's, when it took it). NULL:
// the call computes the amax itself (a one-float memset, then the reduction).
// The forwards can also guess (Fp8Scaling.exponent): quantize with the exponent the same tensor's
// scale had at its previous quantization, taking the amax in the same pass; a second launch then
// compares the exponent of that amax with the guess and, only when they differ, quantizes again
// with the right one. The bytes and the scale are those of current scaling whatever the guess (a
// wrong one costs a second pass, never a wrong byte); a tensor whose amax keeps its power of two
// from step to step (weights, activations of a training run) costs one pass instead of two. (Not
// gradients: with one sample's loss per step their amax crosses a power of two almost every step,
// dev/notes_step.md, session 19.)
// ±inf saturates to ±FP8_MAX (as round_to_e4m3 / round_to_e5m2); NaN stays NaN.
// Requirements: M >= 1 (any M: the dweight GEMM reduces over M, and its transposed operands have
// Mp = fp8_padded_rows(M) columns, the pad columns zero), IC and OC multiples of 16 (cuBLASLt FP8
// leading dimensions), inp, weight and dout 16-byte aligned, the workspace 256-byte aligned and at
// least linear_fp8_workspace_bytes. FP8 GEMMs need sm_89 or newer; elsewhere cuBLASLt finds no
// algorithm and the call fails.
#pragma once
#include "layers/fp8.h"
#include "layers/layers_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

// M rounded up to a multiple of 16: the leading dimension of the transposed copies (C, M) that
// the dweight GEMM reduces over (cuBLASLt FP8 needs k and the leading dimensions multiples of 16).
static inline FP8_HOST_DEVICE int fp8_padded_rows(int M) { return (M + 15) / 16 * 16; }

// The forward's quantized input, kept for the backward's dweight GEMM: qt = inpᵀ (IC, Mp) e4m3
// (Mp = fp8_padded_rows(M), columns M..Mp-1 zero: they add nothing to dweight; IC·Mp bytes,
// 16-byte aligned) and scale = 2^e of inp (one device float, 4-byte aligned; the model gives each
// its own 256-byte slot, as the workspace's scales). Likewise its weight (OC, IC), for the dinp
// GEMM: qt = weightᵀ (IC, OC).
typedef struct {
    uint8_t *qt;
    float *scale;
} Fp8Saved;

// How a forward finds the scale of an operand it quantizes. NULL (or every field NULL): an amax
// pass of its own first.
// amax: max |x| from x's producer (exact), used as is. Or, amax NULL, guessed: exponent[0] is the
// guess, the exponent (layers/fp8.h) of x's scale at its last quantization, which the call replaces
// by this one's (kept by the caller between calls; any int at first), exponent[1] scratch; taken is
// where the quantization pass takes max |x| (zeroed by the caller; afterwards the exact amax, which
// the backward can take as its weight_amax). Each pointer 4-byte aligned. headroom (guessed only):
// 0, the scale of the amax taken exactly (a guess that differs costs a second pass, never a
// different byte); H > 0, any exponent within H·2 binades above it is kept (fp8_guess_kept,
// layers/fp8.h): fewer second passes for tensors whose amax moves from step to step (gradients),
// at the price of up to 2H binades of e4m3's range unused at the bottom.
typedef struct {
    const float *amax;
    int *exponent;
    float *taken;
    int headroom;
} Fp8Scaling;

// Bytes of workspace one forward or backward call of these sizes needs (the larger of the two).
size_t linear_fp8_workspace_bytes(int M, int IC, int OC);

// out (M, OC) = inp (M, IC)·weightᵀ (OC, IC) + bias (OC); bias (bf16, may be NULL) in the epilogue.
// save: NULL, or where to keep inp's quantized transposed copy and scale for the backward (the
// same quantization pass writes both copies: 1 byte more per element than without); save_weight:
// likewise for weight (qt = weightᵀ (IC, OC)), which the backward then takes as weight_saved.
// inp_scaling, weight_scaling: how the scales of inp and weight are found (Fp8Scaling), or NULL.
int linear_fp8_forward_cuda(bf16 *out, const bf16 *inp, const bf16 *weight, const bf16 *bias,
                            int M, int IC, int OC, const Fp8Saved *save, const Fp8Saved *save_weight,
                            const Fp8Scaling *inp_scaling, const Fp8Scaling *weight_scaling, void *workspace,
                            size_t workspace_bytes, const LayersCuda *ctx, cudaStream_t stream, char *err);
// The MLP's second layer reading GELU(pre_gelu) (M, IC) without it being stored: the same as
// gelu_forward_cuda into a buffer and linear_fp8_forward_cuda from it, bit for bit, but the
// quantization passes recompute GELU (and its bf16 rounding) from pre_gelu. inp_scaling: of
// GELU(pre_gelu).
int linear_fp8_forward_gelu_input_cuda(bf16 *out, const bf16 *pre_gelu, const bf16 *weight, const bf16 *bias,
                                       int M, int IC, int OC, const Fp8Saved *save, const Fp8Saved *save_weight,
                                       const Fp8Scaling *inp_scaling, const Fp8Scaling *weight_scaling,
                                       void *workspace, size_t workspace_bytes, const LayersCuda *ctx,
                                       cudaStream_t stream, char *err);
// The MLP's first layer as linear_gelu_forward_cuda: pre_gelu = inp·weightᵀ + bias (FP8 GEMM, bf16
// output), then out = GELU(pre_gelu) by gelu_forward_cuda: a separate pass, as Transformer Engine's
// FP8 MLP (whether cuBLASLt's FP8 kernels take GELU_AUX_BIAS / DGELU with a bf16 D is not yet
// checked on a GPU: dev/notes_linear_fp8.md). out_amax: NULL, or a device float that the GELU pass
// raises to max(*out_amax, max |out|) (for the next FP8 linear, which reads out).
int linear_fp8_gelu_forward_cuda(bf16 *out, bf16 *pre_gelu, const bf16 *inp, const bf16 *weight, const bf16 *bias,
                                 int M, int IC, int OC, const Fp8Saved *save, const Fp8Saved *save_weight,
                                 const Fp8Scaling *inp_scaling, const Fp8Scaling *weight_scaling, float *out_amax,
                                 void *workspace, size_t workspace_bytes, const LayersCuda *ctx, cudaStream_t stream,
                                 char *err);
// dinp (bf16) = dinp_beta·dinp + dout·weight (1: accumulate; 0: write, as linear_backward_cuda);
// dweight (fp32) = dweight_beta·dweight + doutᵀ·inp (likewise); dbias (fp32) += Σ_m dout (from the bf16
// dout, as linear_backward_cuda). inp: what the forward of the same inp and M saved (its e4m3
// copy is the dweight GEMM's operand, as if quantized here). dout is quantized to grad_format
// (FP8_E5M2 as Transformer Engine, or FP8_E4M3: dev/notes_linear_fp8.md compares them). dinp and
// dbias may be NULL; dbias needs linear_backward_scratch_floats(M, OC) of ctx->scratch.
// dout_amax: NULL, or a device float holding max |dout|; weight_amax: NULL, or max |weight|.
// weight_saved: NULL (weight quantized here), or what the forward of the same weight kept
// (save_weight): its e4m3 weightᵀ is the dinp GEMM's operand (weight and weight_amax then unused).
int linear_fp8_backward_cuda(bf16 *dinp, float dinp_beta, float *dweight, float dweight_beta, float *dbias,
                             const bf16 *dout, const Fp8Saved *inp, const bf16 *weight, const Fp8Saved *weight_saved,
                             int M, int IC, int OC, Fp8Format grad_format, const float *dout_amax,
                             const float *weight_amax, void *workspace, size_t workspace_bytes,
                             const LayersCuda *ctx, cudaStream_t stream, char *err);

// The MLP's second layer as linear_dgelu_backward_cuda: dpre (M, IC) = (dout·weight)∘GELU'(pre_gelu)
// is WRITTEN (the FP8 dinp GEMM with beta = 0, then gelu_backward_inplace_cuda); dweight (with
// dweight_beta) and dbias as in linear_fp8_backward_cuda (inp: the forward's saved copy of GELU(pre_gelu)).
// dpre_amax: NULL, or a device float that the dGELU pass raises to max(*dpre_amax, max |dpre|).
// dpre_dbias: NULL, or the bias gradient of the layer whose dout dpre is (the MLP's fc1): the dGELU
// pass adds Σ_m dpre into it, bitwise as that layer's backward would (gelu_backward_inplace_dbias_cuda),
// and that backward then takes dbias NULL.
int linear_fp8_dgelu_backward_cuda(bf16 *dpre, float *dweight, float dweight_beta, float *dbias,
                                   const bf16 *dout, const Fp8Saved *inp, const bf16 *pre_gelu, const bf16 *weight,
                                   const Fp8Saved *weight_saved, int M, int IC, int OC, Fp8Format grad_format,
                                   const float *dout_amax, const float *weight_amax, float *dpre_amax,
                                   float *dpre_dbias, void *workspace, size_t workspace_bytes, const LayersCuda *ctx,
                                   cudaStream_t stream, char *err);

// ---- a dout quantized by the pass that computes it (layers/fp8_dout_cuda.cu) ---------------
// q (M, OC) and qt (OC, Mp) as the backward's own quantization writes them (qt's pad columns zero),
// in grad_format with the scale *scale = 2^e (a device float, 256-byte aligned: cuBLASLt reads it).
typedef struct {
    uint8_t *q, *qt;
    float *scale;
} Fp8Dout;

// The room linear_fp8_backward_cuda of these sizes would quantize its dout into (within workspace),
// for a producer to write the dout there before linear_fp8_backward_quantized_cuda reads it.
int linear_fp8_dout_slots(Fp8Dout *dout, void *workspace, size_t workspace_bytes, int M, int IC, int OC, char *err);

// linear_fp8_backward_cuda from a dout its producer quantized (dout: q used when dinp is given, qt
// always); the bias gradient is the producer's.
int linear_fp8_backward_quantized_cuda(bf16 *dinp, float dinp_beta, float *dweight, float dweight_beta,
                                       const Fp8Dout *dout, const Fp8Saved *inp, const bf16 *weight,
                                       const Fp8Saved *weight_saved, int M, int IC, int OC, Fp8Format grad_format,
                                       const float *weight_amax, void *workspace, size_t workspace_bytes,
                                       const LayersCuda *ctx, cudaStream_t stream, char *err);

// The MLP's dGELU quantized as fc1's dout: out = fp8(bf16(GELU'(pre)·d)·2^-e) (M, C), both copies, e
// guessed (scaling: exponent, taken and headroom; amax NULL); dbias (may be NULL) += Σ_m of the bf16
// values, bitwise linear_dbias_accumulate's. The same bytes, scale, amax and guess as
// gelu_backward_inplace_cuda then fp8_quantize_guessed_cuda of its result (headroom 0), without the bf16
// result. C a multiple of 16; dbias needs linear_backward_scratch_floats(M, C) of ctx->scratch.
int gelu_backward_fp8_cuda(const Fp8Dout *out, const bf16 *d, const bf16 *pre, float *dbias, int M, int C,
                           Fp8Format format, const Fp8Scaling *scaling, const LayersCuda *ctx, cudaStream_t stream,
                           char *err);

// The gated residual's dh = gate_b·dout (b = row / T, gate_b at b·mod_stride) quantized likewise as the
// next linear's dout (gated_residual_backward_cuda's dh, dh_dbias and dh_amax; its dgate is computed
// there with dh NULL).
int gated_dh_fp8_cuda(const Fp8Dout *dh, const bf16 *dout, const bf16 *gate, int B, int T, int C, int mod_stride,
                      float *dbias, Fp8Format format, const Fp8Scaling *scaling, const LayersCuda *ctx,
                      cudaStream_t stream, char *err);

// A bf16 dout (M, C) quantized likewise, with its bias gradient, in one pass: for a dout whose
// producer cannot quantize it (the attention's qkv gradient). At headroom 0 the same bytes, scale,
// amax and guess as fp8_quantize_guessed_cuda, and dbias bitwise linear_dbias_accumulate's.
int dout_fp8_cuda(const Fp8Dout *out, const bf16 *dout, float *dbias, int M, int C, Fp8Format format,
                  const Fp8Scaling *scaling, const LayersCuda *ctx, cudaStream_t stream, char *err);

// The quantization step by itself (for tests and for callers that keep fp8 copies): x (R, C) bf16
// -> q (R, C) and/or qt (C, Rp) = fp8(x·2^-e) (either may be NULL; Rp = fp8_padded_rows(R), qt's
// columns R..Rp-1 zero), *scale = 2^e (a device float), e from the amax of x (layers/fp8.h).
// R >= 1, C a multiple of 16, x and qt 16-byte aligned, q 8.
// amax_scratch: one device float of scratch.
int fp8_quantize_cuda(uint8_t *q, uint8_t *qt, float *scale, const bf16 *x, int R, int C,
                      Fp8Format format, float *amax_scratch, cudaStream_t stream, char *err);

// fp8_quantize_cuda with a guessed exponent (Fp8Scaling): exponent[0] the guess, replaced by the
// right one; exponent[1] scratch; *amax (zeroed by the caller) raised to max |x|. The same q, qt
// and scale as fp8_quantize_cuda whatever the guess. exponent and amax 4-byte aligned.
int fp8_quantize_guessed_cuda(uint8_t *q, uint8_t *qt, float *scale, const bf16 *x, int R, int C,
                              Fp8Format format, int *exponent, float *amax, cudaStream_t stream, char *err);

// amax[i·amax_stride] = max(amax[i·amax_stride], max |x[i·n .. (i+1)·n)|) for i < count: the amax
// of count tensors of n bf16 each, stored one after another (a stack of per-block weights), in one
// launch. It raises what is there: the caller zeroes the slots first (one memset for many), and the
// result is exact (the max is order-free). n a multiple of 8, x 16-byte aligned, count <= 65535.
int fp8_amax_stacked_cuda(float *amax, size_t amax_stride, const bf16 *x, int count, size_t n,
                          cudaStream_t stream, char *err);

#ifdef __cplusplus
}
#endif
