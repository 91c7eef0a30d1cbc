// The layers of a DiT, CPU fp32 reference: one forward/backward pair per layer.
// This is the spec every CUDA kernel is tested against.
//
// Conventions (as llm.c):
// - Tensors are contiguous row-major fp32; shapes are given in the comments, B = batch,
//   T = tokens per image, C = channels of the hidden state.
// - A backward ACCUMULATES (+=) into the gradients of its inputs and parameters, because a
//   tensor may feed several consumers. Only the gradient pointers marked "may be NULL" below
//   may be NULL (an input that needs no gradient).
// - Per-sample modulation vectors (shift, scale, gate) come from the adaLN projection, whose
//   output holds several chunks per sample: `mod_stride` is the distance in floats from one
//   sample's vector to the next.
// - Error handling: these are pure compute functions without a return code. They trust their
//   arguments (positive sizes, buffers of the sizes given here, no NULL except where marked) and
//   check nothing. The checked entry points, which return 0 / -1 with a message (layers/common.h),
//   are the CUDA functions (layers_cuda.h, attention/sage_cuda.h, attention/flash_cuda.h), the
//   data loader, the safetensors reader and the checkpoint functions; validate shapes there, or
//   with dit_config_validate, before calling these.
#pragma once
#include <stdint.h>
#include <stddef.h>
#include "layers/common.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- reshapes ----------------------------------------------------------------------------
// patchify: img (B, Cin, S, S) -> patches (B, T, Cin·p·p), T = (S/p)², token t = gy·(S/p) + gx,
// patch vector ordered (c, py, px): a Conv2d with kernel = stride = p is then a linear layer.
// (The input images need no gradient, so there is no backward.)
void patchify_forward(float *patches, const float *img, int B, int Cin, int S, int p);
// unpatchify: tokens (B, T, p·p·Cout) ordered (py, px, c) as DiT's final layer -> img (B, Cout, S, S)
void unpatchify_forward(float *img, const float *tokens, int B, int Cout, int S, int p);
void unpatchify_backward(float *dtokens, const float *dimg, int B, int Cout, int S, int p);
// split_heads: qkv (B, T, 3·H·D) laid out [q | k | v] per token, head h at h·D in each
// -> q, k, v (B, H, T, D) each (torch: qkv.reshape(B,T,3,H,D).permute(2,0,3,1,4)).
void split_heads_forward(float *q, float *k, float *v, const float *qkv, int B, int T, int H, int D);
void split_heads_backward(float *dqkv, const float *dq, const float *dk, const float *dv,
                          int B, int T, int H, int D);
// merge_heads: o (B, H, T, D) -> out (B, T, H·D)
void merge_heads_forward(float *out, const float *o, int B, int T, int H, int D);
void merge_heads_backward(float *do_, const float *dout, int B, int T, int H, int D);

// ---- linear ------------------------------------------------------------------------------
// out (M, OC) = inp (M, IC) · weightᵀ (OC, IC) + bias (OC); bias may be NULL.
void linear_forward(float *out, const float *inp, const float *weight, const float *bias,
                    int M, int IC, int OC);
// dinp += dout·weight; dweight += doutᵀ·inp; dbias += Σ_m dout. dinp and dbias may be NULL.
void linear_backward(float *dinp, float *dweight, float *dbias,
                     const float *dout, const float *inp, const float *weight,
                     int M, int IC, int OC);

// ---- LayerNorm (no affine, eps 1e-6) fused with adaLN modulation --------------------------
// For each sample b and token t: x̂ = (x - mean)·rstd; out = x̂·(1 + scale_b) + shift_b.
// inp, out (B, T, C); shift, scale: C floats per sample, sample b at b·mod_stride.
// mean, rstd (B, T) are kept for the backward.
void layernorm_modulate_forward(float *out, float *mean, float *rstd,
                                const float *inp, const float *shift, const float *scale,
                                int B, int T, int C, int mod_stride);
// dx̂ = dout·(1 + scale); dinp += rstd·(dx̂ - mean_c(dx̂) - x̂·mean_c(dx̂·x̂));
// dshift_b += Σ_t dout; dscale_b += Σ_t dout·x̂. dinp may be NULL.
void layernorm_modulate_backward(float *dinp, float *dshift, float *dscale,
                                 const float *dout, const float *inp, const float *mean,
                                 const float *rstd, const float *scale,
                                 int B, int T, int C, int mod_stride);

// ---- gated residual: out = res + gate_b·h ------------------------------------------------
// res, h, out (B, T, C); gate: C floats per sample at b·mod_stride.
void gated_residual_forward(float *out, const float *res, const float *h, const float *gate,
                            int B, int T, int C, int mod_stride);
// dres += dout; dh += gate·dout; dgate_b += Σ_t dout·h. dres may be NULL.
void gated_residual_backward(float *dres, float *dh, float *dgate,
                             const float *dout, const float *h, const float *gate,
                             int B, int T, int C, int mod_stride);

// ---- pointwise ---------------------------------------------------------------------------
// GELU, tanh approximation: 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))).
void gelu_forward(float *out, const float *inp, size_t n);
void gelu_backward(float *dinp, const float *inp, const float *dout, size_t n);
// SiLU: x·σ(x); derivative σ(x)·(1 + x·(1 - σ(x))).
void silu_forward(float *out, const float *inp, size_t n);
void silu_backward(float *dinp, const float *inp, const float *dout, size_t n);
// out = a + b (elementwise); the backward is dout into both, done by the caller.
void add_forward(float *out, const float *a, const float *b, size_t n);

// ---- conditioning ------------------------------------------------------------------------
// Sinusoidal timestep features (DiT): out (B, 2·half) = [cos(τ·f_k) | sin(τ·f_k)],
// f_k = exp(-ln(10000)·k/half), τ = 1000·t with the flow-matching t in [0, 1]. DiT uses half = 128.
// t needs no gradient, so there is no backward.
#define TIMESTEP_FREQ_DIM 256
void timestep_embedding_forward(float *out, const float *t, int B, int dim);
// Class embedding: out (B, C) = table[labels_b] (table (num_classes + 1, C); the extra row is the
// "null" class used for classifier-free guidance).
void embedding_forward(float *out, const float *table, const int *labels, int B, int C);
void embedding_backward(float *dtable, const float *dout, const int *labels, int B, int C);
// Fixed 2D sin-cos positional embedding (DiT/MAE): out (G·G, C), token i·G + j (row i, column j);
// the first C/2 features encode column j, the last C/2 row i, each as
// [sin(pos·ω_k) | cos(pos·ω_k)], ω_k = 10000^(-k/(C/4)), k < C/4. C must be a multiple of 4.
void pos_embed_2d(float *out, int G, int C);

// ---- flow-matching loss ------------------------------------------------------------------
// One training step's randomness, drawn from rng in this order: B uniforms u_b, label b becomes
// null_label where u_b < label_dropout (classifier-free guidance; labels (B) are read and
// overwritten); B times t_b, uniform in [0, 1) or logit-normal σ(N(0, 1)) (SD3: the middle of
// the path) when uniform_t is 0; noise (B, n_per_sample) ~ N(0, 1) by rng_fill_normal.
// train_dit and dev/loss_curves.py (through ctypes) both draw their steps with it.
void flow_matching_sample(Rng *rng, int *labels, float *t, float *noise, int B, size_t n_per_sample,
                          float label_dropout, int null_label, int uniform_t);
// Rectified flow: x_t = (1 - t)·x0 + t·ε, target velocity v = ε - x0.
void flow_matching_inputs(float *x_t, float *v_target, const float *x0, const float *noise,
                          const float *t, int B, int n_per_sample);
// loss = mean over all B·n elements of (pred - v)²; dpred = 2·(pred - v)/(B·n) (written, not
// accumulated: the loss starts the backward; may be NULL). Returns the loss.
float mse_loss_forward_backward(float *dpred, const float *pred, const float *target, size_t n);

// ---- optimizer ---------------------------------------------------------------------------
// Global L2 norm of a gradient vector (accumulated in double).
float global_norm(const float *g, size_t n);
// The clipping scale of torch.nn.utils.clip_grad_norm_: min(1, max_norm / (norm + 1e-6));
// 1 when max_norm <= 0 (no clipping).
float clip_grad_scale(float norm, float max_norm);
// AdamW as torch.optim.AdamW, gradient multiplied by grad_scale first (for clipping):
// p -= lr·wd·p; m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²;
// p -= lr·(m/(1-β1^step)) / (sqrt(v/(1-β2^step)) + eps). step starts at 1.
void adamw_update(float *params, const float *grads, float *m, float *v, size_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay,
                  float grad_scale, int step);
// EMA of weights: ema = decay·ema + (1 - decay)·params.
// The decay of step `step` (from 1) with warmup: min(decay, (1 + step)/(10 + step)), so that early
// in training the average forgets the initial weights quickly (with a fixed 0.999, 22% of DiT's
// zero-initialized output layers would still be in the EMA after 1500 steps: noise samples).
float ema_decay_warmup(float decay, int step);
void ema_update(float *ema, const float *params, size_t n, float decay);

#ifdef __cplusplus
}
#endif
