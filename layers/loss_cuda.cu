// Flow-matching (rectified flow) inputs and the MSE loss on the predicted velocity; the loss is
// summed in fp32 in two passes over a fixed grid (deterministic).
#include "layers/cuda_common.cuh"
#include "layers/cuda_args.h"

// x_t = (1 - t_b)·x0 + t_b·ε (bf16); v_target = ε - x0 (fp32); sample b = i / n_per_sample.
__global__ void flow_matching_inputs_kernel(bf16 *x_t, float *v_target, const float *x0, const float *noise,
                                            const float *t, int n_per_sample, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float tb = t[i / n_per_sample];
    x_t[i] = __float2bfloat16((1.0f - tb) * x0[i] + tb * noise[i]);
    v_target[i] = noise[i] - x0[i];
}

// Pass 1, REDUCE_PARTIALS blocks striding over the elements: partial[block] = Σ (pred - v)²;
// dpred = 2·(pred - v)/n.
__global__ void mse_partial_kernel(float *partial, bf16 *dpred, const bf16 *pred, const float *target, size_t n) {
    float sum = 0.0f;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float diff = __bfloat162float(pred[i]) - target[i];
        sum += diff * diff;
        if (dpred) dpred[i] = __float2bfloat16(2.0f * diff / (float)n);
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// Pass 2, one block: *out = scale·Σ partial (fixed order).
__global__ void sum_partials_kernel(float *out, const float *partial, int count, float scale) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partial[i];
    sum = block_sum(sum);
    if (threadIdx.x == 0) *out = scale * sum;
}

int flow_matching_inputs_cuda(bf16 *x_t, float *v_target, const float *x0, const float *noise,
                              const float *t, int B, int n_per_sample, cudaStream_t stream, char *err) {
    if (B <= 0 || n_per_sample <= 0) {
        dit_set_error(err, "flow_matching_inputs_cuda: sizes must be positive (B=%d n_per_sample=%d)", B, n_per_sample);
        return -1;
    }
    size_t n = (size_t)B * n_per_sample;
    if (check_grid_x("flow_matching_inputs_cuda", n, BLOCK_SIZE, err)) return -1;
    flow_matching_inputs_kernel<<<blocks_for(n, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(x_t, v_target, x0, noise, t,
                                                                                     n_per_sample, n);
    LAUNCH_CHECK(err, "flow_matching_inputs_kernel", "B=%d n_per_sample=%d", B, n_per_sample);
    return 0;
}

int mse_loss_forward_backward_cuda(bf16 *dpred, float *loss, const bf16 *pred, const float *target,
                                   size_t n, const LayersCuda *ctx, cudaStream_t stream, char *err) {
    if (n == 0 || ctx->scratch_floats < REDUCE_PARTIALS) {
        dit_set_error(err, "mse_loss_forward_backward_cuda: need n > 0 (n=%zu) and %d floats of scratch (have %zu)",
                      n, REDUCE_PARTIALS, ctx->scratch_floats);
        return -1;
    }
    mse_partial_kernel<<<REDUCE_PARTIALS, BLOCK_SIZE, 0, stream>>>(ctx->scratch, dpred, pred, target, n);
    LAUNCH_CHECK(err, "mse_partial_kernel", "n=%zu", n);
    sum_partials_kernel<<<1, BLOCK_SIZE, 0, stream>>>(loss, ctx->scratch, REDUCE_PARTIALS, 1.0f / (float)n);
    LAUNCH_CHECK(err, "sum_partials_kernel", "%d partials", REDUCE_PARTIALS);
    return 0;
}
