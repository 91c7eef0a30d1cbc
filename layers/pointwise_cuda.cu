// Pointwise layers (bf16 in and out, fp32 math): gated residual, GELU (tanh), SiLU, add, and
// the casts between fp32 and bf16.
#include "layers/cuda_common.cuh"
#include "layers/cuda_args.h"

// Index of gate_b[c] for element i of (B, T, C): b = i / (T·C), c = i % C.
__device__ inline size_t gate_index(size_t i, int TC, int C, int mod_stride) {
    return (i / TC) * mod_stride + i % C;
}

// g[j] = gate_b[c] of element i0 + j for j < count, 0 beyond (one vector when vec: the VEC
// elements are in one row).
__device__ inline void load_gates(float g[VEC], const bf16 *gate, size_t i0, int count, int TC, int C,
                                  int mod_stride, bool vec) {
    if (vec) {
        load_bf16x8(g, gate + gate_index(i0, TC, C, mod_stride), VEC, true);
        return;
    }
    for (int j = 0; j < VEC; j++) g[j] = j < count ? __bfloat162float(gate[gate_index(i0 + j, TC, C, mod_stride)]) : 0.0f;
}

// One thread per VEC consecutive elements i0 .. i0 + VEC - 1 of (B, T, C) (one row and one
// 16-byte vector each when vec: C a multiple of VEC): out = res + gate_b[c]·h.
__global__ void gated_residual_forward_kernel(bf16 *out, const bf16 *res, const bf16 *h, const bf16 *gate,
                                              size_t n, int TC, int C, int mod_stride, bool vec) {
    size_t i0 = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i0 >= n) return;
    int count = (int)min((size_t)VEC, n - i0);
    float r[VEC], hv[VEC], g[VEC];
    load_bf16x8(r, res + i0, count, vec);
    load_bf16x8(hv, h + i0, count, vec);
    load_gates(g, gate, i0, count, TC, C, mod_stride, vec);
    for (int j = 0; j < VEC; j++) r[j] += g[j] * hv[j];
    store_bf16x8(out + i0, r, count, vec);
}

// dres += dout; dh = gate_b[c]·dout, written (elementwise, VEC elements per thread as the forward).
// AMAX: *dh_amax = max(*dh_amax, max |dh|) of the values stored.
template <bool AMAX>
__global__ void gated_residual_dinp_kernel(bf16 *dres, bf16 *dh, float *dh_amax, const bf16 *dout, const bf16 *gate,
                                           size_t n, int TC, int C, int mod_stride, bool vec) {
    size_t i0 = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    float m = 0.0f;
    if (i0 < n) {
        int count = (int)min((size_t)VEC, n - i0);
        float d[VEC], acc[VEC], g[VEC];
        load_bf16x8(d, dout + i0, count, vec);
        load_gates(g, gate, i0, count, TC, C, mod_stride, vec);
        if (dres) {
            load_bf16x8(acc, dres + i0, count, vec);
            for (int j = 0; j < VEC; j++) acc[j] += d[j];
            store_bf16x8(dres + i0, acc, count, vec);
        }
        for (int j = 0; j < VEC; j++) acc[j] = g[j] * d[j];
        store_bf16x8(dh + i0, acc, count, vec);
        if (AMAX)
            for (int j = 0; j < count; j++) m = fmaxf(m, fabsf(bf16_rounded(acc[j])));
    }
    if (AMAX) block_amax_update(dh_amax, m);
}

// Block (column tile, image b, row range r) of the dgate sums (cuda_common.cuh's column
// layout): Σ dout·h over the rows of range r of image b, fixed order; straight into dgate_b
// when splits == 1, else through partial[(b·splits + r)·C + c] (column_sums_store).
__global__ void gated_residual_dgate_kernel(float *dgate, float *partial, unsigned *counters, const bf16 *dout,
                                            const bf16 *h, int T, int C, int mod_stride, int splits, int split_rows,
                                            bool vec) {
    __shared__ float lanes[COL_WARPS][COLS_PER_BLOCK];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int c = blockIdx.x * COLS_PER_BLOCK + lane * VEC, n = min(VEC, C - c);
    int b = blockIdx.y / splits, t_end = min(T, (int)(blockIdx.y % splits + 1) * split_rows);
    float sum[VEC] = {0};
    if (n > 0) {
#pragma unroll 4
        for (int t = (blockIdx.y % splits) * split_rows + warp; t < t_end; t += COL_WARPS) {
            size_t i = ((size_t)b * T + t) * C + c;
            float dy[VEC], hv[VEC];
            load_bf16x8(dy, dout + i, n, vec);
            load_bf16x8(hv, h + i, n, vec);
            for (int j = 0; j < VEC; j++) sum[j] += dy[j] * hv[j];
        }
    }
    float total = sum_over_warps(sum, lanes);
    column_sums_store(dgate, NULL, partial, counters, total, 0.0f, 1, b, blockIdx.y % splits, splits, C, mod_stride);
}

// (gelu(x): layers/cuda_common.cuh, shared with the FP8 linear's quantization)
// out = GELU(inp), VEC elements per thread (16-byte vectors when vec). GELU runs only in the FP8
// MLP (the bf16 one has it in the GEMM's epilogue), whose next linear quantizes out: AMAX:
// *amax = max(*amax, max |out|) on the way (VEC per thread keeps the blocks, and so the amax
// updates, 8x fewer than one element per thread).
template <bool AMAX>
__global__ void gelu_forward_kernel(bf16 *out, const bf16 *inp, float *amax, size_t n, bool vec) {
    size_t i0 = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    float m = 0.0f;
    if (i0 < n) {
        int count = (int)min((size_t)VEC, n - i0);
        float v[VEC];
        load_bf16x8(v, inp + i0, count, vec);
        for (int j = 0; j < VEC; j++) v[j] = gelu(v[j]);
        store_bf16x8(out + i0, v, count, vec);
        if (AMAX)
            for (int j = 0; j < count; j++) m = fmaxf(m, fabsf(bf16_rounded(v[j])));
    }
    if (AMAX) block_amax_update(amax, m);
}

// dinp += GELU'(inp)·dout.
__global__ void gelu_backward_kernel(bf16 *dinp, const bf16 *inp, const bf16 *dout, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float grad = gelu_grad(__bfloat162float(inp[i]));
    dinp[i] = __float2bfloat16(__bfloat162float(dinp[i]) + grad * __bfloat162float(dout[i]));
}

// d = GELU'(inp)·d, in place, VEC elements per thread as gelu_forward_kernel (the FP8 MLP's
// dGELU, whose result the previous linear quantizes: AMAX, *amax = max(*amax, max |d|)).
template <bool AMAX>
__global__ void gelu_backward_inplace_kernel(bf16 *d, const bf16 *inp, float *amax, size_t n, bool vec) {
    size_t i0 = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    float m = 0.0f;
    if (i0 < n) {
        int count = (int)min((size_t)VEC, n - i0);
        float x[VEC], v[VEC];
        load_bf16x8(x, inp + i0, count, vec);
        load_bf16x8(v, d + i0, count, vec);
        for (int j = 0; j < VEC; j++) v[j] = gelu_grad(x[j]) * v[j];
        store_bf16x8(d + i0, v, count, vec);
        if (AMAX)
            for (int j = 0; j < count; j++) m = fmaxf(m, fabsf(bf16_rounded(v[j])));
    }
    if (AMAX) block_amax_update(amax, m);
}

// The element-wise backward passes whose result is also the dout of a linear with a bias, in
// dbias_partial_kernel's layout (layers/linear_cuda.cu): block (column tile, chunk of rows) computes
// its elements on the rows [chunk·chunk_rows, ...) and sums the bf16 values it stores as
// dbias_partial_kernel would read and sum them (the same rows per warp in the same order, then
// sum_over_warps), so the bias gradient has the bits of a separate pass: straight into dbias with
// one chunk, else through partial[chunk·C + c] (column_sums_store).
//   ROWS_DGELU: out ∘= GELU'(a) in place (out: the dGELU's d, a: the pre-activation);
//   ROWS_GATE:  out = gate_b·a (a: the gated residual's dout, b = row / T; gate_b at
//               b·mod_stride), and res += a when res is given.
// AMAX: *amax = max(*amax, max |out|) of the values stored.
enum { ROWS_DGELU, ROWS_GATE };
template <int OP, bool AMAX>
__global__ void rows_dbias_kernel(bf16 *out, bf16 *res, const bf16 *a, const bf16 *gate, float *amax, float *dbias,
                                  float *partial, unsigned *counters, int M, int C, int T, int mod_stride, int chunks,
                                  int chunk_rows, bool vec, bool gate_vec) {
    __shared__ float lanes[COL_WARPS][COLS_PER_BLOCK];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int o = blockIdx.x * COLS_PER_BLOCK + lane * VEC, n = min(VEC, C - o);
    int row_end = min(M, (int)(blockIdx.y + 1) * chunk_rows);
    float sum[VEC] = {0}, most = 0.0f;
    if (n > 0) {
#pragma unroll 4
        for (int m = blockIdx.y * chunk_rows + warp; m < row_end; m += COL_WARPS) {
            size_t at = (size_t)m * C + o;
            float x[VEC], v[VEC];
            load_bf16x8(x, a + at, n, vec);
            if (OP == ROWS_DGELU) {
                load_bf16x8(v, out + at, n, vec);
                for (int j = 0; j < VEC; j++) v[j] = bf16_rounded(gelu_grad(x[j]) * v[j]);   // as stored
            } else {
                float g[VEC];
                load_bf16x8(g, gate + (size_t)(m / T) * mod_stride + o, n, gate_vec);
                for (int j = 0; j < VEC; j++) v[j] = bf16_rounded(g[j] * x[j]);
                if (res) {
                    float r[VEC];
                    load_bf16x8(r, res + at, n, vec);
                    for (int j = 0; j < VEC; j++) r[j] += x[j];
                    store_bf16x8(res + at, r, n, vec);
                }
            }
            store_bf16x8(out + at, v, n, vec);
            for (int j = 0; j < VEC; j++) sum[j] += v[j];
            if (AMAX)
                for (int j = 0; j < n; j++) most = fmaxf(most, fabsf(v[j]));
        }
    }
    float total = sum_over_warps(sum, lanes);
    if (AMAX) block_amax_update(amax, most);   // every thread of the block calls both
    column_sums_store(dbias, NULL, partial, counters, total, 0.0f, 1, 0, blockIdx.y, chunks, C, C);
}

// rows_dbias_kernel over (M, C) with its bias gradient; ctx->scratch holds the partial sums when the
// rows are split (the caller checks its size).
template <int OP>
static int launch_rows_dbias(const char *fn, bf16 *out, bf16 *res, const bf16 *a, const bf16 *gate, float *amax,
                             float *dbias, int M, int C, int T, int mod_stride, bool vec, bool gate_vec,
                             const LayersCuda *ctx, cudaStream_t stream, char *err) {
    int chunks = dbias_chunks(M, C), chunk_rows = dbias_chunk_rows(M, C);
    dim3 grid(blocks_for(C, COLS_PER_BLOCK), chunks);
    (amax ? rows_dbias_kernel<OP, true> : rows_dbias_kernel<OP, false>)<<<grid, BLOCK_SIZE, 0, stream>>>(
        out, res, a, gate, amax, dbias, ctx->scratch, ctx->tile_counters, M, C, T, mod_stride, chunks, chunk_rows, vec,
        gate_vec);
    LAUNCH_CHECK(err, "rows_dbias_kernel", "%s: M=%d C=%d chunks=%d", fn, M, C, chunks);
    return 0;
}

// 0, or -1 unless ctx's scratch holds the partial sums of a bias gradient of (M, C).
static int check_dbias_scratch(const char *fn, int M, int C, const LayersCuda *ctx, char *err) {
    if (linear_backward_scratch_floats(M, C) > ctx->scratch_floats) {
        dit_set_error(err, "%s: the bias gradient of M=%d C=%d needs %zu floats of scratch, the context has %zu",
                      fn, M, C, linear_backward_scratch_floats(M, C), ctx->scratch_floats);
        return -1;
    }
    return 0;
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

// out (rows, cols) = bf16(inp), inp's rows inp_stride floats apart (a column slice of a wider
// matrix); n = rows·cols.
__global__ void cast_float_to_bf16_rows_kernel(bf16 *out, const float *inp, int cols, size_t inp_stride, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16(inp[(i / cols) * inp_stride + i % cols]);
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
    // T·C is an int in the kernels; at most one thread per element of (B, T, C)
    return check_product(fn, "T·C", T, C, INT_MAX, err) || check_grid_x(fn, (size_t)B * T * C, BLOCK_SIZE, err)
               ? -1 : 0;
}

int gated_residual_forward_cuda(bf16 *out, const bf16 *res, const bf16 *h, const bf16 *gate,
                                int B, int T, int C, int mod_stride, cudaStream_t stream, char *err) {
    if (check_btc("gated_residual_forward_cuda", B, T, C, mod_stride, err)) return -1;
    size_t n = (size_t)B * T * C;
    bool vec = C % VEC == 0 && mod_stride % VEC == 0 && aligned16(out) && aligned16(res) && aligned16(h) &&
               aligned16(gate);
    gated_residual_forward_kernel<<<blocks_for(n, BLOCK_SIZE * VEC), BLOCK_SIZE, 0, stream>>>(
        out, res, h, gate, n, T * C, C, mod_stride, vec);
    LAUNCH_CHECK(err, "gated_residual_forward_kernel", "B=%d T=%d C=%d", B, T, C);
    return 0;
}

int gated_residual_backward_cuda(bf16 *dres, bf16 *dh, float *dgate,
                                 const bf16 *dout, const bf16 *h, const bf16 *gate,
                                 int B, int T, int C, int mod_stride, float *dh_amax, float *dh_dbias,
                                 const LayersCuda *ctx, cudaStream_t stream, char *err) {
    const char *fn = "gated_residual_backward_cuda";
    if (check_btc(fn, B, T, C, mod_stride, err) || check_product(fn, "grid.y B", B, 1, 65535, err) ||
        check_context(fn, ctx, err) || (dh_dbias && check_dbias_scratch(fn, B * T, C, ctx, err))) return -1;
    size_t n = (size_t)B * T * C;
    bool vec = C % VEC == 0 && aligned16(dout) && aligned16(h);
    int splits = column_splits(B, T, C, 1, ctx->scratch_floats), split_rows = (T + splits - 1) / splits;
    float *partial = ctx->scratch;   // (B, splits, C) when splits > 1
    dim3 grid(blocks_for(C, COLS_PER_BLOCK), B * splits);
    gated_residual_dgate_kernel<<<grid, BLOCK_SIZE, 0, stream>>>(dgate, partial, ctx->tile_counters, dout, h, T, C,
                                                                  mod_stride, splits, split_rows, vec);
    LAUNCH_CHECK(err, "gated_residual_dgate_kernel", "B=%d T=%d C=%d splits=%d", B, T, C, splits);
    if (!dh) {
        if (!dres) return 0;   // dgate only
        dit_set_error(err, "%s: dh is NULL but dres is not (B=%d T=%d C=%d)", fn, B, T, C);
        return -1;
    }
    if (dh_dbias) {   // dh with the next linear's bias gradient, in dbias_partial_kernel's layout
        bool rows_vec = vec && aligned16(dh) && (!dres || aligned16(dres));
        return launch_rows_dbias<ROWS_GATE>(fn, dh, dres, dout, gate, dh_amax, dh_dbias, B * T, C, T, mod_stride,
                                            rows_vec, mod_stride % VEC == 0 && aligned16(gate), ctx, stream, err);
    }
    vec = vec && mod_stride % VEC == 0 && aligned16(dh) && aligned16(gate) && (!dres || aligned16(dres));
    auto dinp_kernel = dh_amax ? gated_residual_dinp_kernel<true> : gated_residual_dinp_kernel<false>;
    dinp_kernel<<<blocks_for(n, BLOCK_SIZE * VEC), BLOCK_SIZE, 0, stream>>>(
        dres, dh, dh_amax, dout, gate, n, T * C, C, mod_stride, vec);
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

// GELU and the in-place dGELU: VEC elements per thread (vectors when n and both pointers allow),
// amax NULL or raised to max |result| (kernel<true>).
#define LAUNCH_VEC_AMAX(kernel, out, inp, amax, n) do {                                        \
        if ((n) == 0) return 0;                                                                \
        if (check_grid_x(__func__, n, BLOCK_SIZE, err)) return -1;   /* as the scalar kernels */ \
        bool vec = (n) % VEC == 0 && aligned16(out) && aligned16(inp);                         \
        auto launch = (amax) ? kernel<true> : kernel<false>;                                   \
        launch<<<blocks_for(n, BLOCK_SIZE * VEC), BLOCK_SIZE, 0, stream>>>(out, inp, amax, n, vec); \
        LAUNCH_CHECK(err, #kernel, "n=%zu amax=%s", (size_t)(n), (amax) ? "on" : "off");      \
        return 0;                                                                              \
    } while (0)

int gelu_forward_cuda(bf16 *out, const bf16 *inp, size_t n, float *amax, cudaStream_t stream, char *err) {
    LAUNCH_VEC_AMAX(gelu_forward_kernel, out, inp, amax, n);
}

int gelu_backward_cuda(bf16 *dinp, const bf16 *inp, const bf16 *dout, size_t n,
                       cudaStream_t stream, char *err) {
    LAUNCH_ELEMENTWISE(gelu_backward_kernel, n, dinp, inp, dout);
}

int gelu_backward_inplace_cuda(bf16 *d, const bf16 *inp, size_t n, float *amax, cudaStream_t stream, char *err) {
    LAUNCH_VEC_AMAX(gelu_backward_inplace_kernel, d, inp, amax, n);
}

int gelu_backward_inplace_dbias_cuda(bf16 *d, const bf16 *inp, float *dbias, int M, int C, float *amax,
                                     const LayersCuda *ctx, cudaStream_t stream, char *err) {
    const char *fn = "gelu_backward_inplace_dbias_cuda";
    if (M <= 0 || C <= 0) {
        dit_set_error(err, "%s: need positive M and C (M=%d C=%d)", fn, M, C);
        return -1;
    }
    if (check_context(fn, ctx, err) || check_dbias_scratch(fn, M, C, ctx, err)) return -1;
    CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(d, 2), DEVICE_ARG(inp, 2), DEVICE_ARG(dbias, 4));
    bool vec = C % VEC == 0 && aligned16(d) && aligned16(inp);
    return launch_rows_dbias<ROWS_DGELU>(fn, d, NULL, inp, NULL, amax, dbias, M, C, 1, 0, vec, false, ctx, stream,
                                         err);
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

int cast_float_to_bf16_rows_cuda(bf16 *out, const float *inp, int rows, int cols, size_t inp_stride,
                                 cudaStream_t stream, char *err) {
    if (rows < 0 || cols <= 0 || inp_stride < (size_t)cols) {
        dit_set_error(err, "cast_float_to_bf16_rows_cuda: need rows >= 0, cols > 0 and inp_stride >= cols "
                      "(rows=%d cols=%d inp_stride=%zu)", rows, cols, inp_stride);
        return -1;
    }
    LAUNCH_ELEMENTWISE(cast_float_to_bf16_rows_kernel, (size_t)rows * cols, out, inp, cols, inp_stride);
}

int cast_bf16_to_float_cuda(float *out, const bf16 *inp, size_t n, cudaStream_t stream, char *err) {
    LAUNCH_ELEMENTWISE(cast_bf16_to_float_kernel, n, out, inp);
}
