// A program that embeds dit.c's library (not the DiT trainer): it trains one attention layer,
//   y = merge_heads(sage_attention(split_heads(x·Wqkvᵀ)))·Woᵀ,   loss = mean (y − y*)²,
// to reproduce, on one fixed batch, the outputs y* of a random "teacher" layer of the same shape
// with exact attention (overfitting one batch: the first check of any trainer), with AdamW and
// gradient clipping. Attention runs on the GPU (sage_cuda.h) when the library was built with
// CUDA and a GPU is present, else on the CPU (the sage definition of attention.h). Exits 1
// unless the loss falls below 1/50 of its first value (without the Q and K gradients, the
// output projection and V alone reach about 1/11).
// Build against an installed library:
//   cc $(pkg-config --cflags ditc) example_attention_layer.c $(pkg-config --libs ditc)
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "layers/common.h"
#include "layers/layers.h"
#include "attention/attention.h"
#ifdef DIT_CUDA
#include "attention/sage_cuda.h"
#include "layers/layers_cuda.h"   // bf16_bits_from_float, float_from_bf16_bits
#endif

enum { B = 4, T = 64, H = 2, D = 64, C = H * D, M = B * T, STEPS = 300 };
static const size_t NQKV = (size_t)3 * C * C, NW = (size_t)4 * C * C;   // weights: [Wqkv | Wo]

static int use_gpu;   // attention on the GPU
#ifdef DIT_CUDA
#define CUDA_OR_DIE(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_)); exit(1); } } while (0)
static SagePV gpu_pv;
static uint16_t *dq_, *dk_, *dv_, *dout_, *ddo_;   // device bf16 (B, H, T, D)
static float *dlse_, *dgq_, *dgk_, *dgv_;          // device lse (B, H, T), gradients (B, H, T, D)
static void *fwd_ws_, *bwd_ws_;
static void upload_bf16(uint16_t *dst, const float *src) {   // (B, H, T, D) floats -> device bf16
    static uint16_t h[B * H * T * D];
    for (size_t i = 0; i < sizeof h / 2; i++) h[i] = bf16_bits_from_float(src[i]);
    CUDA_OR_DIE(cudaMemcpy(dst, h, sizeof h, cudaMemcpyHostToDevice));
}
static void gpu_setup(void) {
    int n = 0, major = 0, minor = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return;
    CUDA_OR_DIE(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
    CUDA_OR_DIE(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
    gpu_pv = major * 10 + minor >= 89 ? SAGE_PV_FP8 : SAGE_PV_FP16;   // FP8 P·V needs 8.9+
    size_t e = (size_t)B * H * T * D;
    uint16_t **bf[] = {&dq_, &dk_, &dv_, &dout_, &ddo_};
    float **f32[] = {&dgq_, &dgk_, &dgv_};
    for (int i = 0; i < 5; i++) CUDA_OR_DIE(cudaMalloc((void **)bf[i], e * 2));
    for (int i = 0; i < 3; i++) CUDA_OR_DIE(cudaMalloc((void **)f32[i], e * 4));
    CUDA_OR_DIE(cudaMalloc((void **)&dlse_, (size_t)B * H * T * 4));
    CUDA_OR_DIE(cudaMalloc(&fwd_ws_, sage_cuda_forward_workspace_size(B, H, T, D, gpu_pv)));
    CUDA_OR_DIE(cudaMalloc(&bwd_ws_, sage_cuda_backward_workspace_size(B, H, T, D)));
    use_gpu = 1;
}
#endif

// o (B, H, T, D) = sage attention of q, k, v; lse kept for the backward.
static void attention_fwd(float *o, float *lse, const float *q, const float *k, const float *v) {
#ifdef DIT_CUDA
    if (use_gpu) {
        char err[DIT_ERR_LEN];
        upload_bf16(dq_, q); upload_bf16(dk_, k); upload_bf16(dv_, v);
        if (sage_forward_cuda(dout_, dlse_, fwd_ws_, dq_, dk_, dv_, B, H, T, D, gpu_pv, 0, err)) {
            fprintf(stderr, "%s\n", err); exit(1);
        }
        static uint16_t h[B * H * T * D];   // the backward reads the bf16 out the GPU made
        CUDA_OR_DIE(cudaMemcpy(h, dout_, sizeof h, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < sizeof h / 2; i++) o[i] = float_from_bf16_bits(h[i]);
        return;
    }
#endif
    (void)lse;
    sage_forward(o, lse, q, k, v, B, H, T, D, SAGE_CONFIG_DEFAULT);
}

// dq, dk, dv (written) = gradients of the attention given do_ = dLoss/do.
static void attention_bwd(float *dq, float *dk, float *dv, const float *do_, const float *q,
                          const float *k, const float *v, const float *o, const float *lse) {
    size_t e = (size_t)B * H * T * D;
#ifdef DIT_CUDA
    if (use_gpu) {
        char err[DIT_ERR_LEN];
        upload_bf16(ddo_, do_);
        if (sage_backward_cuda(dgq_, dgk_, dgv_, bwd_ws_, fwd_ws_, ddo_, dq_, dk_, dv_, dout_, dlse_,
                               NULL, B, H, T, D, gpu_pv, 0, err)) { fprintf(stderr, "%s\n", err); exit(1); }
        CUDA_OR_DIE(cudaMemcpy(dq, dgq_, e * 4, cudaMemcpyDeviceToHost));
        CUDA_OR_DIE(cudaMemcpy(dk, dgk_, e * 4, cudaMemcpyDeviceToHost));
        CUDA_OR_DIE(cudaMemcpy(dv, dgv_, e * 4, cudaMemcpyDeviceToHost));
        return;
    }
#endif
    memset(dq, 0, e * 4); memset(dk, 0, e * 4); memset(dv, 0, e * 4);   // the CPU backward accumulates
    sage_backward(dq, dk, dv, do_, q, k, v, o, lse, B, H, T, D, SAGE_CONFIG_DEFAULT);
}

int main(void) {
    size_t e = (size_t)M * C;
    float *w = malloc(NW * 4), *teacher = malloc(NW * 4), *gw = malloc(NW * 4);
    float *adam_m = calloc(NW, 4), *adam_v = calloc(NW, 4);
    float *x = malloc(e * 4), *qkv = malloc(3 * e * 4), *dqkv = malloc(3 * e * 4), *y = malloc(e * 4);
    float *target = malloc(e * 4), *dy = malloc(e * 4), *om = malloc(e * 4), *dom = malloc(e * 4);
    float *q = malloc(e * 4), *k = malloc(e * 4), *v = malloc(e * 4), *o = malloc(e * 4);
    float *dq = malloc(e * 4), *dk = malloc(e * 4), *dv = malloc(e * 4), *do_ = malloc(e * 4);
    float *lse = malloc((size_t)B * H * T * 4);
    Rng rng;
    rng_seed(&rng, 1);
    rng_fill_normal(&rng, teacher, NW, 1.0f / sqrtf(C));
    for (size_t i = 0; i < (size_t)2 * C * C; i++) teacher[i] *= 2.0f;   // sharper attention: Wq, Wk
    rng_fill_normal(&rng, w, NW, 1.0f / sqrtf(C));
    // the batch, and the teacher's answer with exact attention
    rng_fill_normal(&rng, x, e, 1.0f);
    linear_forward(qkv, x, teacher, NULL, M, C, 3 * C);
    split_heads_forward(q, k, v, qkv, B, T, H, D);
    attention_forward(o, lse, q, k, v, B, H, T, D);
    merge_heads_forward(om, o, B, T, H, D);
    linear_forward(target, om, teacher + NQKV, NULL, M, C, C);
#ifdef DIT_CUDA
    gpu_setup();
#endif
    printf("attention on the %s\n", use_gpu ? "GPU (sage_cuda.h)" : "CPU (attention.h's sage definition)");
    float first = 0.0f, last = 0.0f;
    for (int step = 1; step <= STEPS; step++) {
        // the student's forward with sage attention, and the loss
        linear_forward(qkv, x, w, NULL, M, C, 3 * C);
        split_heads_forward(q, k, v, qkv, B, T, H, D);
        attention_fwd(o, lse, q, k, v);
        merge_heads_forward(om, o, B, T, H, D);
        linear_forward(y, om, w + NQKV, NULL, M, C, C);
        float loss = mse_loss_forward_backward(dy, y, target, e);
        // backward, layer by layer in reverse (every backward accumulates: zero first)
        memset(gw, 0, NW * 4); memset(dom, 0, e * 4); memset(do_, 0, e * 4); memset(dqkv, 0, 3 * e * 4);
        linear_backward(dom, gw + NQKV, NULL, dy, om, w + NQKV, M, C, C);
        merge_heads_backward(do_, dom, B, T, H, D);
        attention_bwd(dq, dk, dv, do_, q, k, v, o, lse);
        split_heads_backward(dqkv, dq, dk, dv, B, T, H, D);
        linear_backward(NULL, gw, NULL, dqkv, x, w, M, C, 3 * C);
        // AdamW with the gradient clipped to norm 1
        float norm = global_norm(gw, NW);
        adamw_update(w, gw, adam_m, adam_v, NW, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f,
                     clip_grad_scale(norm, 1.0f), step);
        if (step == 1) first = loss;
        last = step == 1 ? loss : 0.9f * last + 0.1f * loss;
        if (step == 1 || step % 50 == 0) printf("step %3d  loss %.5f  grad norm %.4f\n", step, loss, norm);
    }
    int ok = isfinite(last) && last < first / 50.0f;
    printf("loss %.5f -> %.5f (smoothed): %s\n", first, last, ok ? "learned" : "did NOT learn");
    return ok ? 0 : 1;
}
