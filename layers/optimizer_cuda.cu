// AdamW fused with the gradient-clipping scale and the EMA (fp32 master weights, moments and EMA,
// bf16 copy of the weights for compute), and the deterministic sum of squares of the gradients
// (the global norm's square: ranks that each hold a slice sum theirs before the square root).
#include <math.h>
#include "layers/cuda_common.cuh"
#include "layers/cuda_args.h"

#define CLIP_EPS 1e-6f   // as clip_grad_scale (layers/optimizer.c): torch's clip_grad_norm_

// Pass 1, REDUCE_PARTIALS blocks striding over g: partial[block] = Σ g². With vec (g 16-byte
// aligned) thread i reads the float4s i, i + grid threads, ... and the n % 4 last elements are
// added by the first threads; the order depends on n only (deterministic).
__global__ void norm_partial_kernel(float *partial, const float *g, size_t n, bool vec) {
    size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    float sum = 0.0f;
    if (vec) {
        for (size_t i = tid; i < n / 4; i += stride) {
            float4 x = ((const float4 *)g)[i];
            sum += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
        }
        if (tid < n % 4) sum += g[n / 4 * 4 + tid] * g[n / 4 * 4 + tid];
    } else {
        for (size_t i = tid; i < n; i += stride) sum += g[i] * g[i];
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// Pass 2, one block: *sumsq = Σ partial, fixed order.
__global__ void norm_finish_kernel(float *sumsq, const float *partial, int count) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partial[i];
    sum = block_sum(sum);
    if (threadIdx.x == 0) *sumsq = sum;
}

__global__ void sqrt_kernel(float *norm, const float *sumsq) { *norm = sqrtf(*sumsq); }

// One AdamW step of one parameter (see adamw_kernel).
__device__ inline void adamw_one(float *p, float *m, float *v, float g, float lr, float beta1, float beta2, float eps,
                                 float weight_decay, float bias1, float bias2) {
    *p -= lr * weight_decay * *p;
    *m = beta1 * *m + (1.0f - beta1) * g;
    *v = beta2 * *v + (1.0f - beta2) * g * g;
    *p -= lr * (*m / bias1) / (sqrtf(*v / bias2) + eps);
}

// ema = decay·ema + (1 - decay)·p, the roundings spelled out (one product, then one fma) so that
// every lane and every kernel that inlines it gives the same bits.
__device__ inline float ema_one(float ema, float p, float decay) {
    return __fmaf_rn(decay, ema, __fmul_rn(1.0f - decay, p));
}

// g = grad·scale, scale = min(1, max_norm/(‖grad‖ + 1e-6)) (1 without clipping);
// p -= lr·wd·p; m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²; p -= lr·(m/bias1)/(sqrt(v/bias2) + eps);
// p_bf16 = bf16(p); with ema: ema = decay·ema + (1 - decay)·p (the updated p, still in registers:
// 8 bytes per parameter less than a separate EMA pass). lr, bias1 = 1 - β1^step,
// bias2 = 1 - β2^step and the EMA's decay are read from k (device). Four parameters per thread:
// float4 loads and stores when vec (every fp32 pointer 16-byte aligned, params_bf16 8-byte aligned).
__global__ void adamw_kernel(float *params, bf16 *params_bf16, const float *grads, float *m, float *v, float *ema,
                             size_t n, const OptimizerStepConstants *k, float beta1, float beta2, float eps,
                             float weight_decay, const float *grad_norm, float max_norm, bool vec) {
    size_t i0 = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i0 >= n) return;
    const float lr = k->lr, bias1 = k->bias1, bias2 = k->bias2, decay = k->ema_decay;
    float scale = 1.0f;
    if (grad_norm && max_norm > 0.0f) scale = fminf(1.0f, max_norm / (*grad_norm + CLIP_EPS));
    if (vec && i0 + 4 <= n) {
        float4 p = *(float4 *)(params + i0), g = *(const float4 *)(grads + i0);
        float4 mi = *(float4 *)(m + i0), vi = *(float4 *)(v + i0);
        adamw_one(&p.x, &mi.x, &vi.x, g.x * scale, lr, beta1, beta2, eps, weight_decay, bias1, bias2);
        adamw_one(&p.y, &mi.y, &vi.y, g.y * scale, lr, beta1, beta2, eps, weight_decay, bias1, bias2);
        adamw_one(&p.z, &mi.z, &vi.z, g.z * scale, lr, beta1, beta2, eps, weight_decay, bias1, bias2);
        adamw_one(&p.w, &mi.w, &vi.w, g.w * scale, lr, beta1, beta2, eps, weight_decay, bias1, bias2);
        *(float4 *)(params + i0) = p;
        *(float4 *)(m + i0) = mi;
        *(float4 *)(v + i0) = vi;
        union { uint2 raw; __nv_bfloat162 pair[2]; } out;
        out.pair[0] = __floats2bfloat162_rn(p.x, p.y);
        out.pair[1] = __floats2bfloat162_rn(p.z, p.w);
        *(uint2 *)(params_bf16 + i0) = out.raw;
        if (ema) {
            float4 e = *(float4 *)(ema + i0);
            e.x = ema_one(e.x, p.x, decay);
            e.y = ema_one(e.y, p.y, decay);
            e.z = ema_one(e.z, p.z, decay);
            e.w = ema_one(e.w, p.w, decay);
            *(float4 *)(ema + i0) = e;
        }
        return;
    }
    // the same arithmetic as a float4 lane (on registers: through the pointers, which may alias,
    // the compiler contracts the moments' sums into other FMAs), so a slice edge (ZeRO-1) or a
    // tail changes no bit
    for (size_t i = i0; i < n && i < i0 + 4; i++) {
        float p = params[i], mi = m[i], vi = v[i];
        adamw_one(&p, &mi, &vi, grads[i] * scale, lr, beta1, beta2, eps, weight_decay, bias1, bias2);
        params[i] = p;
        m[i] = mi;
        v[i] = vi;
        params_bf16[i] = __float2bfloat16(p);
        if (ema) ema[i] = ema_one(ema[i], p, decay);
    }
}

int sum_squares_cuda(float *sumsq, const float *g, size_t n, const LayersCuda *ctx,
                     cudaStream_t stream, char *err) {
    if (n == 0 || ctx->scratch_floats < REDUCE_PARTIALS) {
        dit_set_error(err, "sum_squares_cuda: need n > 0 (n=%zu) and %d floats of scratch (have %zu)",
                      n, REDUCE_PARTIALS, ctx->scratch_floats);
        return -1;
    }
    norm_partial_kernel<<<REDUCE_PARTIALS, BLOCK_SIZE, 0, stream>>>(ctx->scratch, g, n, aligned16(g));
    LAUNCH_CHECK(err, "norm_partial_kernel", "n=%zu", n);
    norm_finish_kernel<<<1, BLOCK_SIZE, 0, stream>>>(sumsq, ctx->scratch, REDUCE_PARTIALS);
    LAUNCH_CHECK(err, "norm_finish_kernel", "%d partials", REDUCE_PARTIALS);
    return 0;
}

int sqrt_cuda(float *norm, const float *sumsq, cudaStream_t stream, char *err) {
    sqrt_kernel<<<1, 1, 0, stream>>>(norm, sumsq);
    LAUNCH_CHECK(err, "sqrt_kernel", "%s", "one float");
    return 0;
}

int optimizer_step_constants(OptimizerStepConstants *k, float lr, float beta1, float beta2, int step,
                             float ema_decay, char *err) {
    if (step < 1) {
        dit_set_error(err, "optimizer_step_constants: need step >= 1 (step=%d)", step);
        return -1;
    }
    *k = OptimizerStepConstants{lr, 1.0f - powf(beta1, (float)step), 1.0f - powf(beta2, (float)step), ema_decay};
    return 0;
}

int adamw_update_cuda(float *params, bf16 *params_bf16, const float *grads, float *m, float *v, float *ema, size_t n,
                      const OptimizerStepConstants *k, float beta1, float beta2, float eps, float weight_decay,
                      const float *grad_norm, float max_norm, cudaStream_t stream, char *err) {
    if (n == 0 || !k) {
        dit_set_error(err, "adamw_update_cuda: need n > 0 and the step constants (n=%zu, k %s)", n, k ? "set" : "NULL");
        return -1;
    }
    if (check_grid_x("adamw_update_cuda", n, BLOCK_SIZE, err)) return -1;
    bool vec = aligned16(params) && aligned16(grads) && aligned16(m) && aligned16(v) && (!ema || aligned16(ema)) &&
               (uintptr_t)params_bf16 % 8 == 0;
    adamw_kernel<<<blocks_for(n, BLOCK_SIZE * 4), BLOCK_SIZE, 0, stream>>>(params, params_bf16, grads, m, v, ema, n, k,
                                                                          beta1, beta2, eps, weight_decay, grad_norm,
                                                                          max_norm, vec);
    LAUNCH_CHECK(err, "adamw_kernel", "n=%zu", n);
    return 0;
}
