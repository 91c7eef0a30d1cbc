// Pointwise layers (bf16 in and out, fp32 math): gated residual, GELU (tanh), SiLU, add, and
// the casts between fp32 and bf16.
#include "layers/cuda_common.cuh"
#include "layers/cuda_args.h"

#define GELU_SCALE 0.7978845608028654f   // sqrt(2/π)

// One thread per element of (B, T, C), sample b = i / (T·C), channel c = i % C:
// out = res + gate_b[c]·h.
__global__ void gated_residual_forward_kernel(bf16 *out, const bf16 *res, const bf16 *h, const bf16 *gate,
                                              size_t n, int TC, int C, int mod_stride) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = __bfloat162float(gate[(i / TC) * mod_stride + i % C]);
    out[i] = __float2bfloat16(__bfloat162float(res[i]) + g * __bfloat162float(h[i]));
}

// dres += dout; dh += gate_b[c]·dout (elementwise).
__global__ void gated_residual_dinp_kernel(bf16 *dres, bf16 *dh, const bf16 *dout, const bf16 *gate,
                                           size_t n, int TC, int C, int mod_stride) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float d = __bfloat162float(dout[i]);
    float g = __bfloat162float(gate[(i / TC) * mod_stride + i % C]);
    if (dres) dres[i] = __float2bfloat16(__bfloat162float(dres[i]) + d);
    dh[i] = __float2bfloat16(__bfloat162float(dh[i]) + g * d);
}

// Block (COL_TILE, ROW_LANES) per (channel tile, sample b): dgate_b[c] += Σ_t dout·h, fixed order.
__global__ void gated_residual_dgate_kernel(float *dgate, const bf16 *dout, const bf16 *h,
                                            int T, int C, int mod_stride) {
    __shared__ float lanes[ROW_LANES][COL_TILE];
    int c = blockIdx.x * COL_TILE + threadIdx.x, b = blockIdx.y;
    float sum = 0.0f;
    if (c < C)
        for (int t = threadIdx.y; t < T; t += ROW_LANES) {
            size_t i = ((size_t)b * T + t) * C + c;
            sum += __bfloat162float(dout[i]) * __bfloat162float(h[i]);
        }
    sum = sum_over_row_lanes(sum, lanes);
    if (threadIdx.y == 0 && c < C) dgate[(size_t)b * mod_stride + c] += sum;
}

// GELU(x) = 0.5·x·(1 + tanh(u)), u = sqrt(2/π)·(x + 0.044715·x³).
__global__ void gelu_forward_kernel(bf16 *out, const bf16 *inp, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = __bfloat162float(inp[i]);
    out[i] = __float2bfloat16(0.5f * x * (1.0f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x))));
}

// GELU'(x) = 0.5·(1 + tanh u) + 0.5·x·(1 - tanh² u)·sqrt(2/π)·(1 + 3·0.044715·x²); dinp += GELU'·dout.
__global__ void gelu_backward_kernel(bf16 *dinp, const bf16 *inp, const bf16 *dout, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = __bfloat162float(inp[i]);
    float th = tanhf(GELU_SCALE * (x + 0.044715f * x * x * x));
    float du = GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
    float grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
    dinp[i] = __float2bfloat16(__bfloat162float(dinp[i]) + grad * __bfloat162float(dout[i]));
}

// SiLU(x) = x·σ(x).
__global__ void silu_forward_kernel(bf16 *out, const bf16 *inp, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = __bfloat162float(inp[i]);
    out[i] = __float2bfloat16(x / (1.0f + expf(-x)));
}

// SiLU'(x) = σ(x)·(1 + x·(1 - σ(x))); dinp += SiLU'·dout.
__global__ void silu_backward_kernel(bf16 *dinp, const bf16 *inp, const bf16 *dout, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = __bfloat162float(inp[i]);
    float sig = 1.0f / (1.0f + expf(-x));
    dinp[i] = __float2bfloat16(__bfloat162float(dinp[i]) + __bfloat162float(dout[i]) * sig * (1.0f + x * (1.0f - sig)));
}

// out = a + b.
__global__ void add_forward_kernel(bf16 *out, const bf16 *a, const bf16 *b, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = __float2bfloat16(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

// out = bf16(inp), round to nearest even.
__global__ void cast_float_to_bf16_kernel(bf16 *out, const float *inp, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16(inp[i]);
}

// out = float(inp), exact.
__global__ void cast_bf16_to_float_kernel(float *out, const bf16 *inp, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __bfloat162float(inp[i]);
}

static int check_btc(const char *fn, int B, int T, int C, int mod_stride, char *err) {
    if (B <= 0 || T <= 0 || C <= 0 || mod_stride < C) {
        dit_set_error(err, "%s: need positive B, T, C and mod_stride >= C (B=%d T=%d C=%d mod_stride=%d)",
                      fn, B, T, C, mod_stride);
        return -1;
    }
    // T·C is an int in the kernels; one thread per element of (B, T, C)
    return check_product(fn, "T·C", T, C, INT_MAX, err) || check_grid_x(fn, (size_t)B * T * C, BLOCK_SIZE, err)
               ? -1 : 0;
}

int gated_residual_forward_cuda(bf16 *out, const bf16 *res, const bf16 *h, const bf16 *gate,
                                int B, int T, int C, int mod_stride, cudaStream_t stream, char *err) {
    if (check_btc("gated_residual_forward_cuda", B, T, C, mod_stride, err)) return -1;
    size_t n = (size_t)B * T * C;
    gated_residual_forward_kernel<<<blocks_for(n, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(
        out, res, h, gate, n, T * C, C, mod_stride);
    LAUNCH_CHECK(err, "gated_residual_forward_kernel", "B=%d T=%d C=%d", B, T, C);
    return 0;
}

int gated_residual_backward_cuda(bf16 *dres, bf16 *dh, float *dgate,
                                 const bf16 *dout, const bf16 *h, const bf16 *gate,
                                 int B, int T, int C, int mod_stride, cudaStream_t stream, char *err) {
    if (check_btc("gated_residual_backward_cuda", B, T, C, mod_stride, err) ||
        check_product("gated_residual_backward_cuda", "grid.y B", B, 1, 65535, err)) return -1;
    size_t n = (size_t)B * T * C;
    dim3 grid(blocks_for(C, COL_TILE), B), block(COL_TILE, ROW_LANES);
    gated_residual_dgate_kernel<<<grid, block, 0, stream>>>(dgate, dout, h, T, C, mod_stride);
    LAUNCH_CHECK(err, "gated_residual_dgate_kernel", "B=%d T=%d C=%d", B, T, C);
    gated_residual_dinp_kernel<<<blocks_for(n, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(
        dres, dh, dout, gate, n, T * C, C, mod_stride);
    LAUNCH_CHECK(err, "gated_residual_dinp_kernel", "B=%d T=%d C=%d", B, T, C);
    return 0;
}

// The elementwise wrappers: n == 0 is a no-op (a zero-block launch would be an error).
#define LAUNCH_ELEMENTWISE(kernel, n, ...) do {                                                \
        if ((n) == 0) return 0;                                                                \
        if (check_grid_x(__func__, n, BLOCK_SIZE, err)) return -1;                             \
        kernel<<<blocks_for(n, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(__VA_ARGS__, n);          \
        LAUNCH_CHECK(err, #kernel, "n=%zu", (size_t)(n));                                      \
        return 0;                                                                              \
    } while (0)

int gelu_forward_cuda(bf16 *out, const bf16 *inp, size_t n, cudaStream_t stream, char *err) {
    LAUNCH_ELEMENTWISE(gelu_forward_kernel, n, out, inp);
}

int gelu_backward_cuda(bf16 *dinp, const bf16 *inp, const bf16 *dout, size_t n,
                       cudaStream_t stream, char *err) {
    LAUNCH_ELEMENTWISE(gelu_backward_kernel, n, dinp, inp, dout);
}

int silu_forward_cuda(bf16 *out, const bf16 *inp, size_t n, cudaStream_t stream, char *err) {
    LAUNCH_ELEMENTWISE(silu_forward_kernel, n, out, inp);
}

int silu_backward_cuda(bf16 *dinp, const bf16 *inp, const bf16 *dout, size_t n,
                       cudaStream_t stream, char *err) {
    LAUNCH_ELEMENTWISE(silu_backward_kernel, n, dinp, inp, dout);
}

int add_forward_cuda(bf16 *out, const bf16 *a, const bf16 *b, size_t n, cudaStream_t stream, char *err) {
    LAUNCH_ELEMENTWISE(add_forward_kernel, n, out, a, b);
}

int cast_float_to_bf16_cuda(bf16 *out, const float *inp, size_t n, cudaStream_t stream, char *err) {
    LAUNCH_ELEMENTWISE(cast_float_to_bf16_kernel, n, out, inp);
}

int cast_bf16_to_float_cuda(float *out, const bf16 *inp, size_t n, cudaStream_t stream, char *err) {
    LAUNCH_ELEMENTWISE(cast_bf16_to_float_kernel, n, out, inp);
}
