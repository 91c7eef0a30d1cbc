// AdamW fused with the gradient-clipping scale (fp32 master weights and moments, bf16 copy of
// the weights for compute), the deterministic global gradient norm, and the EMA of the weights.
#include <math.h>
#include "layers/cuda_common.cuh"
#include "layers/cuda_args.h"

#define CLIP_EPS 1e-6f   // as clip_grad_scale (layers/optimizer.c): torch's clip_grad_norm_

// Pass 1, REDUCE_PARTIALS blocks striding over g: partial[block] = Σ g².
__global__ void norm_partial_kernel(float *partial, const float *g, size_t n) {
    float sum = 0.0f;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        sum += g[i] * g[i];
    sum = block_sum(sum);
    if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// Pass 2, one block: *norm = sqrt(Σ partial), fixed order.
__global__ void norm_finish_kernel(float *norm, const float *partial, int count) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partial[i];
    sum = block_sum(sum);
    if (threadIdx.x == 0) *norm = sqrtf(sum);
}

// g = grad·scale, scale = min(1, max_norm/(‖grad‖ + 1e-6)) (1 without clipping);
// p -= lr·wd·p; m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²; p -= lr·(m/bias1)/(sqrt(v/bias2) + eps);
// p_bf16 = bf16(p). bias1 = 1 - β1^step, bias2 = 1 - β2^step.
__global__ void adamw_kernel(float *params, bf16 *params_bf16, const float *grads, float *m, float *v, size_t n,
                             float lr, float beta1, float beta2, float eps, float weight_decay,
                             const float *grad_norm, float max_norm, float bias1, float bias2) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float scale = 1.0f;
    if (grad_norm && max_norm > 0.0f) scale = fminf(1.0f, max_norm / (*grad_norm + CLIP_EPS));
    float g = grads[i] * scale, p = params[i];
    p -= lr * weight_decay * p;
    float mi = beta1 * m[i] + (1.0f - beta1) * g;
    float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    p -= lr * (mi / bias1) / (sqrtf(vi / bias2) + eps);
    m[i] = mi;
    v[i] = vi;
    params[i] = p;
    params_bf16[i] = __float2bfloat16(p);
}

// ema = decay·ema + (1 - decay)·params.
__global__ void ema_kernel(float *ema, const float *params, size_t n, float decay) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) ema[i] = decay * ema[i] + (1.0f - decay) * params[i];
}

int global_norm_cuda(float *norm, const float *g, size_t n, const LayersCuda *ctx,
                     cudaStream_t stream, char *err) {
    if (n == 0 || ctx->scratch_floats < REDUCE_PARTIALS) {
        dit_set_error(err, "global_norm_cuda: need n > 0 (n=%zu) and %d floats of scratch (have %zu)",
                      n, REDUCE_PARTIALS, ctx->scratch_floats);
        return -1;
    }
    norm_partial_kernel<<<REDUCE_PARTIALS, BLOCK_SIZE, 0, stream>>>(ctx->scratch, g, n);
    LAUNCH_CHECK(err, "norm_partial_kernel", "n=%zu", n);
    norm_finish_kernel<<<1, BLOCK_SIZE, 0, stream>>>(norm, ctx->scratch, REDUCE_PARTIALS);
    LAUNCH_CHECK(err, "norm_finish_kernel", "%d partials", REDUCE_PARTIALS);
    return 0;
}

int adamw_update_cuda(float *params, bf16 *params_bf16, const float *grads, float *m, float *v,
                      size_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                      const float *grad_norm, float max_norm, int step, cudaStream_t stream, char *err) {
    if (n == 0 || step < 1) {
        dit_set_error(err, "adamw_update_cuda: need n > 0 and step >= 1 (n=%zu step=%d)", n, step);
        return -1;
    }
    if (check_grid_x("adamw_update_cuda", n, BLOCK_SIZE, err)) return -1;
    float bias1 = 1.0f - powf(beta1, (float)step), bias2 = 1.0f - powf(beta2, (float)step);
    adamw_kernel<<<blocks_for(n, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(params, params_bf16, grads, m, v, n, lr, beta1,
                                                                      beta2, eps, weight_decay, grad_norm, max_norm,
                                                                      bias1, bias2);
    LAUNCH_CHECK(err, "adamw_kernel", "n=%zu step=%d", n, step);
    return 0;
}

int ema_update_cuda(float *ema, const float *params, size_t n, float decay, cudaStream_t stream, char *err) {
    if (n == 0) return 0;
    if (check_grid_x("ema_update_cuda", n, BLOCK_SIZE, err)) return -1;
    ema_kernel<<<blocks_for(n, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(ema, params, n, decay);
    LAUNCH_CHECK(err, "ema_kernel", "n=%zu", n);
    return 0;
}
