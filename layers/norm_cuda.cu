// LayerNorm without affine parameters fused with DiT's adaLN modulation (bf16 in and out,
// statistics and reductions in fp32).
#include "layers/cuda_common.cuh"
#include "layers/cuda_args.h"

#define LAYERNORM_EPS 1e-6f
#define ROWS_PER_BLOCK (BLOCK_SIZE / 32)   // one warp per (b, t) row

// One warp per row of C channels, sample b = row / T:
// mean = Σx/C; rstd = 1/sqrt(Σ(x - mean)²/C + eps); x̂ = (x - mean)·rstd;
// out = x̂·(1 + scale_b) + shift_b.
__global__ void layernorm_modulate_forward_kernel(bf16 *out, float *mean, float *rstd,
                                                  const bf16 *inp, const bf16 *shift, const bf16 *scale,
                                                  int rows, int T, int C, int mod_stride) {
    int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;   // whole warps leave together
    const bf16 *x = inp + (size_t)row * C;
    const bf16 *sh = shift + (size_t)(row / T) * mod_stride, *sc = scale + (size_t)(row / T) * mod_stride;
    float sum = 0.0f;
    for (int c = lane; c < C; c += 32) sum += __bfloat162float(x[c]);
    float m = warp_sum(sum) / C;
    float sq = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float d = __bfloat162float(x[c]) - m;
        sq += d * d;
    }
    float s = rsqrtf(warp_sum(sq) / C + LAYERNORM_EPS);
    bf16 *y = out + (size_t)row * C;
    for (int c = lane; c < C; c += 32) {
        float xhat = (__bfloat162float(x[c]) - m) * s;
        y[c] = __float2bfloat16(xhat * (1.0f + __bfloat162float(sc[c])) + __bfloat162float(sh[c]));
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

// One warp per row: dx̂ = dout·(1 + scale_b);
// dinp += rstd·(dx̂ - mean_c(dx̂) - x̂·mean_c(dx̂·x̂)).
__global__ void layernorm_modulate_dinp_kernel(bf16 *dinp, const bf16 *dout, const bf16 *inp,
                                               const float *mean, const float *rstd, const bf16 *scale,
                                               int rows, int T, int C, int mod_stride) {
    int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const bf16 *x = inp + (size_t)row * C, *dy = dout + (size_t)row * C;
    const bf16 *sc = scale + (size_t)(row / T) * mod_stride;
    float m = mean[row], s = rstd[row];
    float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float xhat = (__bfloat162float(x[c]) - m) * s;
        float dxhat = __bfloat162float(dy[c]) * (1.0f + __bfloat162float(sc[c]));
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * xhat;
    }
    float mean_dxhat = warp_sum(sum_dxhat) / C, mean_dxhat_xhat = warp_sum(sum_dxhat_xhat) / C;
    bf16 *dx = dinp + (size_t)row * C;
    for (int c = lane; c < C; c += 32) {
        float xhat = (__bfloat162float(x[c]) - m) * s;
        float dxhat = __bfloat162float(dy[c]) * (1.0f + __bfloat162float(sc[c]));
        dx[c] = __float2bfloat16(__bfloat162float(dx[c]) + s * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat));
    }
}

// Block (COL_TILE, ROW_LANES) per (channel tile, sample b), summing over the T tokens in a
// fixed order: dshift_b[c] += Σ_t dout; dscale_b[c] += Σ_t dout·x̂.
__global__ void layernorm_modulate_dmod_kernel(float *dshift, float *dscale, const bf16 *dout,
                                               const bf16 *inp, const float *mean, const float *rstd,
                                               int T, int C, int mod_stride) {
    __shared__ float lanes[ROW_LANES][COL_TILE];
    int c = blockIdx.x * COL_TILE + threadIdx.x, b = blockIdx.y;
    float sum_dy = 0.0f, sum_dy_xhat = 0.0f;
    if (c < C)
        for (int t = threadIdx.y; t < T; t += ROW_LANES) {
            size_t row = (size_t)b * T + t;
            float dy = __bfloat162float(dout[row * C + c]);
            float xhat = (__bfloat162float(inp[row * C + c]) - mean[row]) * rstd[row];
            sum_dy += dy;
            sum_dy_xhat += dy * xhat;
        }
    sum_dy = sum_over_row_lanes(sum_dy, lanes);
    sum_dy_xhat = sum_over_row_lanes(sum_dy_xhat, lanes);
    if (threadIdx.y == 0 && c < C) {
        dshift[(size_t)b * mod_stride + c] += sum_dy;
        dscale[(size_t)b * mod_stride + c] += sum_dy_xhat;
    }
}

static int check_sizes(const char *fn, int B, int T, int C, int mod_stride, char *err) {
    if (B <= 0 || T <= 0 || C <= 0 || mod_stride < C) {
        dit_set_error(err, "%s: need positive B, T, C and mod_stride >= C (B=%d T=%d C=%d mod_stride=%d)",
                      fn, B, T, C, mod_stride);
        return -1;
    }
    return check_product(fn, "rows B·T", B, T, INT_MAX, err);   // rows are int in the kernels
}

int layernorm_modulate_forward_cuda(bf16 *out, float *mean, float *rstd,
                                    const bf16 *inp, const bf16 *shift, const bf16 *scale,
                                    int B, int T, int C, int mod_stride,
                                    cudaStream_t stream, char *err) {
    if (check_sizes("layernorm_modulate_forward_cuda", B, T, C, mod_stride, err)) return -1;
    int rows = B * T;
    layernorm_modulate_forward_kernel<<<blocks_for(rows, ROWS_PER_BLOCK), BLOCK_SIZE, 0, stream>>>(
        out, mean, rstd, inp, shift, scale, rows, T, C, mod_stride);
    LAUNCH_CHECK(err, "layernorm_modulate_forward_kernel", "B=%d T=%d C=%d", B, T, C);
    return 0;
}

int layernorm_modulate_backward_cuda(bf16 *dinp, float *dshift, float *dscale,
                                     const bf16 *dout, const bf16 *inp, const float *mean,
                                     const float *rstd, const bf16 *scale,
                                     int B, int T, int C, int mod_stride,
                                     cudaStream_t stream, char *err) {
    if (check_sizes("layernorm_modulate_backward_cuda", B, T, C, mod_stride, err) ||
        check_product("layernorm_modulate_backward_cuda", "grid.y B", B, 1, 65535, err)) return -1;
    int rows = B * T;
    dim3 grid(blocks_for(C, COL_TILE), B), block(COL_TILE, ROW_LANES);
    layernorm_modulate_dmod_kernel<<<grid, block, 0, stream>>>(dshift, dscale, dout, inp, mean, rstd,
                                                               T, C, mod_stride);
    LAUNCH_CHECK(err, "layernorm_modulate_dmod_kernel", "B=%d T=%d C=%d", B, T, C);
    if (!dinp) return 0;
    layernorm_modulate_dinp_kernel<<<blocks_for(rows, ROWS_PER_BLOCK), BLOCK_SIZE, 0, stream>>>(
        dinp, dout, inp, mean, rstd, scale, rows, T, C, mod_stride);
    LAUNCH_CHECK(err, "layernorm_modulate_dinp_kernel", "B=%d T=%d C=%d", B, T, C);
    return 0;
}
