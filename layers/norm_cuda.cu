// LayerNorm without affine parameters fused with DiT's adaLN modulation (bf16 in and out,
// statistics and reductions in fp32), alone or after the gated residual that writes its input.
// Rows are read as 16-byte vectors of VEC bf16 where the sizes and pointers allow
// (layers/cuda_common.cuh), element by element otherwise.
#include "layers/cuda_common.cuh"
#include "layers/cuda_args.h"

#define LAYERNORM_EPS 1e-6f
#define ROW_BLOCK 128                     // threads per block of the row kernels: 4 rows (one warp each)
#define ROWS_PER_BLOCK (ROW_BLOCK / 32)

// Rows of up to LAYERNORM_MAX_C channels: one warp per row, lane l owns the vectors l, l + 32, ...
// (VPL of them, the template's compile-time count: 1, 2, 4, 8 or 16) and keeps them in registers
// between the passes, so each row is read from memory once, all its loads issued at once
// (ptxas, sm_90a: forward 126, gated residual + forward 128 and dinp 168 registers at VPL 8, no
// spill; dinp at VPL 16, C > 2048, spills 648 bytes).
#define LAYERNORM_MAX_C (32 * VEC * 16)

// One row, by the whole warp (rows leave by whole warps), its lane's vectors already in registers:
// x (0 beyond C) and the sample's shift and scale; y is the row of out.
// mean = Σx/C; rstd = 1/sqrt(Σ(x - mean)²/C + eps); x̂ = (x - mean)·rstd;
// out = x̂·(1 + scale_b) + shift_b, sample b = row / T.
// AMAX: *out_amax = max(*out_amax, max |out|) of the values stored (one update per row).
template <bool AMAX, int VPL>
__device__ __forceinline__ void layernorm_modulate_row(bf16 *y, float *mean, float *rstd, float *out_amax,
                                                       const Bf16x8 (&xr)[VPL], const Bf16x8 (&shr)[VPL],
                                                       const Bf16x8 (&scr)[VPL], int row, int lane, int C,
                                                       bool vec) {
    float v[VEC], sum = 0.0f;
#pragma unroll
    for (int k = 0; k < VPL; k++) {
        if ((lane + 32 * k) * VEC >= C) break;
        unpack_bf16x8(v, xr[k]);
        for (int j = 0; j < VEC; j++) sum += v[j];
    }
    float m = warp_sum(sum) / C, sq = 0.0f;
#pragma unroll
    for (int k = 0; k < VPL; k++) {
        int c = (lane + 32 * k) * VEC;
        if (c >= C) break;
        unpack_bf16x8(v, xr[k]);
        for (int j = 0; j < VEC; j++)
            if (c + j < C) sq += (v[j] - m) * (v[j] - m);
    }
    float s = rsqrtf(warp_sum(sq) / C + LAYERNORM_EPS);
    float vmax = 0.0f;
#pragma unroll
    for (int k = 0; k < VPL; k++) {
        int c = (lane + 32 * k) * VEC;
        if (c >= C) break;
        int n = min(VEC, C - c);
        float shv[VEC], scv[VEC];
        unpack_bf16x8(v, xr[k]);
        unpack_bf16x8(shv, shr[k]);
        unpack_bf16x8(scv, scr[k]);
        for (int j = 0; j < VEC; j++) v[j] = (v[j] - m) * s * (1.0f + scv[j]) + shv[j];
        store_bf16x8(y + c, v, n, vec);
        if (AMAX)
            for (int j = 0; j < VEC; j++)
                if (j < n) vmax = fmaxf(vmax, fabsf(bf16_rounded(v[j])));
    }
    if (AMAX) vmax = warp_max(vmax);   // the whole warp is here (rows leave by whole warps)
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
        if (AMAX) amax_update(out_amax, vmax);
    }
}

// One warp per row: the row of inp, shift_b and scale_b loaded, then layernorm_modulate_row.
template <bool AMAX, int VPL>
__global__ void layernorm_modulate_forward_kernel(bf16 *out, float *mean, float *rstd, float *out_amax,
                                                  const bf16 *inp, const bf16 *shift, const bf16 *scale,
                                                  int rows, int T, int C, int mod_stride, bool vec) {
    int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;   // whole warps leave together
    const bf16 *x = inp + (size_t)row * C;
    const bf16 *sh = shift + (size_t)(row / T) * mod_stride, *sc = scale + (size_t)(row / T) * mod_stride;
    Bf16x8 xr[VPL], shr[VPL], scr[VPL];   // every load of the row issued at once
#pragma unroll
    for (int k = 0; k < VPL; k++) {
        int c = (lane + 32 * k) * VEC;
        if (c < C) {
            xr[k] = load_bf16x8_raw(x + c, min(VEC, C - c), vec);
            shr[k] = load_bf16x8_raw(sh + c, min(VEC, C - c), vec);
            scr[k] = load_bf16x8_raw(sc + c, min(VEC, C - c), vec);
        }
    }
    layernorm_modulate_row<AMAX, VPL>(out + (size_t)row * C, mean, rstd, out_amax, xr, shr, scr, row, lane, C, vec);
}

// The gated residual and the LayerNorm-modulate of its result in one pass, one warp per row:
// x_new = res + gate_b·h with gated_residual_forward_kernel's float ops and its one rounding to bf16,
// stored; then layernorm_modulate_row on those bf16 values (the x_new a separate LayerNorm kernel
// would read back): x_new, out, mean, rstd and the amax bitwise those of the two kernels.
template <bool AMAX, int VPL>
__global__ void gated_residual_layernorm_modulate_forward_kernel(
    bf16 *x_new, bf16 *out, float *mean, float *rstd, float *out_amax, const bf16 *res, const bf16 *h,
    const bf16 *gate, const bf16 *shift, const bf16 *scale, int rows, int T, int C, int gate_stride,
    int mod_stride, bool vec) {
    int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;   // whole warps leave together
    size_t at = (size_t)row * C;
    const bf16 *g = gate + (size_t)(row / T) * gate_stride;
    const bf16 *sh = shift + (size_t)(row / T) * mod_stride, *sc = scale + (size_t)(row / T) * mod_stride;
    Bf16x8 xr[VPL], hr[VPL], gr[VPL], shr[VPL], scr[VPL];
#pragma unroll
    for (int k = 0; k < VPL; k++) {   // the streamed inputs: every load of the row issued at once
        int c = (lane + 32 * k) * VEC;
        if (c < C) {
            xr[k] = load_bf16x8_raw(res + at + c, min(VEC, C - c), vec);
            hr[k] = load_bf16x8_raw(h + at + c, min(VEC, C - c), vec);
            gr[k] = load_bf16x8_raw(g + c, min(VEC, C - c), vec);
        }
    }
#pragma unroll
    for (int k = 0; k < VPL; k++) {   // x_new into xr (0 beyond C, as a load gives) and memory
        int c = (lane + 32 * k) * VEC;
        if (c >= C) break;
        float r[VEC], hv[VEC], gv[VEC];
        unpack_bf16x8(r, xr[k]);
        unpack_bf16x8(hv, hr[k]);
        unpack_bf16x8(gv, gr[k]);
        for (int j = 0; j < VEC; j++) r[j] += gv[j] * hv[j];
        xr[k] = pack_bf16x8(r);
        store_bf16x8_raw(x_new + at + c, xr[k], min(VEC, C - c), vec);
    }
#pragma unroll
    for (int k = 0; k < VPL; k++) {   // shift and scale (small, cached) arrive during the row's sums
        int c = (lane + 32 * k) * VEC;
        if (c < C) {
            shr[k] = load_bf16x8_raw(sh + c, min(VEC, C - c), vec);
            scr[k] = load_bf16x8_raw(sc + c, min(VEC, C - c), vec);
        }
    }
    layernorm_modulate_row<AMAX, VPL>(out + at, mean, rstd, out_amax, xr, shr, scr, row, lane, C, vec);
}

// One warp per row (its x and dout in registers, as above): dx̂ = dout·(1 + scale_b);
// dinp += rstd·(dx̂ - mean_c(dx̂) - x̂·mean_c(dx̂·x̂)).
template <int VPL>
__global__ void layernorm_modulate_dinp_kernel(bf16 *dinp, const bf16 *dout, const bf16 *inp,
                                               const float *mean, const float *rstd, const bf16 *scale,
                                               int rows, int T, int C, int mod_stride, bool vec) {
    int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const bf16 *x = inp + (size_t)row * C, *dy = dout + (size_t)row * C;
    const bf16 *sc = scale + (size_t)(row / T) * mod_stride;
    float m = mean[row], s = rstd[row];
    bf16 *dx = dinp + (size_t)row * C;
    Bf16x8 xr[VPL], dyr[VPL], scr[VPL], dxr[VPL];   // every load of the row issued at once
#pragma unroll
    for (int k = 0; k < VPL; k++) {
        int c = (lane + 32 * k) * VEC;
        if (c < C) {
            xr[k] = load_bf16x8_raw(x + c, min(VEC, C - c), vec);
            dyr[k] = load_bf16x8_raw(dy + c, min(VEC, C - c), vec);
            scr[k] = load_bf16x8_raw(sc + c, min(VEC, C - c), vec);
            dxr[k] = load_bf16x8_raw(dx + c, min(VEC, C - c), vec);
        }
    }
    float xv[VEC], dyv[VEC], scv[VEC], sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
#pragma unroll
    for (int k = 0; k < VPL; k++) {
        int c = (lane + 32 * k) * VEC;
        if (c >= C) break;
        int n = min(VEC, C - c);
        unpack_bf16x8(xv, xr[k]);
        unpack_bf16x8(dyv, dyr[k]);
        unpack_bf16x8(scv, scr[k]);
        for (int j = 0; j < VEC; j++) {
            if (j >= n) break;
            float dxhat = dyv[j] * (1.0f + scv[j]);
            sum_dxhat += dxhat;
            sum_dxhat_xhat += dxhat * (xv[j] - m) * s;
        }
    }
    float mean_dxhat = warp_sum(sum_dxhat) / C, mean_dxhat_xhat = warp_sum(sum_dxhat_xhat) / C;
#pragma unroll
    for (int k = 0; k < VPL; k++) {
        int c = (lane + 32 * k) * VEC;
        if (c >= C) break;
        int n = min(VEC, C - c);
        float dxv[VEC];
        unpack_bf16x8(xv, xr[k]);
        unpack_bf16x8(dyv, dyr[k]);
        unpack_bf16x8(scv, scr[k]);
        unpack_bf16x8(dxv, dxr[k]);
        for (int j = 0; j < VEC; j++) {
            float xhat = (xv[j] - m) * s, dxhat = dyv[j] * (1.0f + scv[j]);
            dxv[j] += s * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat);
        }
        store_bf16x8(dx + c, dxv, n, vec);
    }
}

// Block (column tile, image b, row range r) of the dshift/dscale sums (cuda_common.cuh's column
// layout): Σ dout and Σ dout·x̂ over the rows t of range r of image b, fixed order. With one range
// per image (splits == 1) the sums go straight into dshift_b, dscale_b; otherwise through
// partial[((b·splits + r)·2 + {0, 1})·C + c] (column_sums_store).
__global__ void layernorm_modulate_dmod_kernel(float *dshift, float *dscale, float *partial, unsigned *counters,
                                               const bf16 *dout, const bf16 *inp, const float *mean,
                                               const float *rstd, int T, int C, int mod_stride, int splits,
                                               int split_rows, bool vec) {
    __shared__ float lanes[COL_WARPS][COLS_PER_BLOCK];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int c = blockIdx.x * COLS_PER_BLOCK + lane * VEC, n = min(VEC, C - c);
    int b = blockIdx.y / splits, t_end = min(T, (int)(blockIdx.y % splits + 1) * split_rows);
    float sum_dy[VEC] = {0}, sum_dy_xhat[VEC] = {0};
    if (n > 0) {
#pragma unroll 4
        for (int t = (blockIdx.y % splits) * split_rows + warp; t < t_end; t += COL_WARPS) {
            size_t row = (size_t)b * T + t;
            float dy[VEC], x[VEC], m = mean[row], s = rstd[row];
            load_bf16x8(dy, dout + row * C + c, n, vec);
            load_bf16x8(x, inp + row * C + c, n, vec);
            for (int j = 0; j < VEC; j++) {
                sum_dy[j] += dy[j];
                sum_dy_xhat[j] += dy[j] * ((x[j] - m) * s);
            }
        }
    }
    float total_dy = sum_over_warps(sum_dy, lanes), total_dy_xhat = sum_over_warps(sum_dy_xhat, lanes);
    column_sums_store(dshift, dscale, partial, counters, total_dy, total_dy_xhat, 2, b, blockIdx.y % splits, splits,
                      C, mod_stride);
}

static int check_sizes(const char *fn, int B, int T, int C, int mod_stride, char *err) {
    if (B <= 0 || T <= 0 || C <= 0 || C > LAYERNORM_MAX_C || mod_stride < C) {
        dit_set_error(err, "%s: need positive B, T, C <= %d (a row in one warp's registers) and mod_stride >= C "
                      "(B=%d T=%d C=%d mod_stride=%d)", fn, LAYERNORM_MAX_C, B, T, C, mod_stride);
        return -1;
    }
    return check_product(fn, "rows B·T", B, T, INT_MAX, err);   // rows are int in the kernels
}

// The vectors per lane a row of C channels needs, as one of the kernels' counts (C <= LAYERNORM_MAX_C).
static int vectors_per_lane(int C) {
    int vpl = 1;
    while (32 * VEC * vpl < C) vpl *= 2;
    return vpl;
}

#define LAUNCH_BY_VPL(kernel_for, C, grid, ...)                                                        \
    switch (vectors_per_lane(C)) {                                                                    \
    case 1: kernel_for(1)<<<grid, ROW_BLOCK, 0, stream>>>(__VA_ARGS__); break;                         \
    case 2: kernel_for(2)<<<grid, ROW_BLOCK, 0, stream>>>(__VA_ARGS__); break;                         \
    case 4: kernel_for(4)<<<grid, ROW_BLOCK, 0, stream>>>(__VA_ARGS__); break;                         \
    case 8: kernel_for(8)<<<grid, ROW_BLOCK, 0, stream>>>(__VA_ARGS__); break;                         \
    default: kernel_for(16)<<<grid, ROW_BLOCK, 0, stream>>>(__VA_ARGS__);                              \
    }

int layernorm_modulate_forward_cuda(bf16 *out, float *mean, float *rstd,
                                    const bf16 *inp, const bf16 *shift, const bf16 *scale,
                                    int B, int T, int C, int mod_stride, float *out_amax,
                                    cudaStream_t stream, char *err) {
    if (check_sizes("layernorm_modulate_forward_cuda", B, T, C, mod_stride, err)) return -1;
    int rows = B * T;
    bool vec = C % VEC == 0 && mod_stride % VEC == 0 && aligned16(out) && aligned16(inp) &&
               aligned16(shift) && aligned16(scale);
#define FORWARD(vpl) (out_amax ? layernorm_modulate_forward_kernel<true, vpl> : layernorm_modulate_forward_kernel<false, vpl>)
    LAUNCH_BY_VPL(FORWARD, C, blocks_for(rows, ROWS_PER_BLOCK), out, mean, rstd, out_amax, inp, shift, scale, rows,
                  T, C, mod_stride, vec);
#undef FORWARD
    LAUNCH_CHECK(err, "layernorm_modulate_forward_kernel", "B=%d T=%d C=%d", B, T, C);
    return 0;
}

int gated_residual_layernorm_modulate_forward_cuda(bf16 *x_new, bf16 *out, float *mean, float *rstd,
                                                   const bf16 *res, const bf16 *h, const bf16 *gate,
                                                   const bf16 *shift, const bf16 *scale, int B, int T, int C,
                                                   int gate_stride, int mod_stride, float *out_amax,
                                                   cudaStream_t stream, char *err) {
    const char *fn = "gated_residual_layernorm_modulate_forward_cuda";
    if (check_sizes(fn, B, T, C, mod_stride, err)) return -1;
    if (gate_stride < C) {
        dit_set_error(err, "%s: need gate_stride >= C (C=%d gate_stride=%d)", fn, C, gate_stride);
        return -1;
    }
    int rows = B * T;
    bool vec = C % VEC == 0 && gate_stride % VEC == 0 && mod_stride % VEC == 0 && aligned16(x_new) &&
               aligned16(out) && aligned16(res) && aligned16(h) && aligned16(gate) && aligned16(shift) &&
               aligned16(scale);
#define FUSED(vpl) (out_amax ? gated_residual_layernorm_modulate_forward_kernel<true, vpl>                     \
                             : gated_residual_layernorm_modulate_forward_kernel<false, vpl>)
    LAUNCH_BY_VPL(FUSED, C, blocks_for(rows, ROWS_PER_BLOCK), x_new, out, mean, rstd, out_amax, res, h, gate, shift,
                  scale, rows, T, C, gate_stride, mod_stride, vec);
#undef FUSED
    LAUNCH_CHECK(err, "gated_residual_layernorm_modulate_forward_kernel", "B=%d T=%d C=%d", B, T, C);
    return 0;
}

size_t modulation_backward_scratch_floats(int B, int T, int C) {
    int splits = column_splits(B, T, C, 2, (size_t)-1);
    return splits > 1 ? (size_t)B * splits * 2 * C : 0;
}

int layernorm_modulate_backward_cuda(bf16 *dinp, float *dshift, float *dscale,
                                     const bf16 *dout, const bf16 *inp, const float *mean,
                                     const float *rstd, const bf16 *scale,
                                     int B, int T, int C, int mod_stride,
                                     const LayersCuda *ctx, cudaStream_t stream, char *err) {
    if (check_sizes("layernorm_modulate_backward_cuda", B, T, C, mod_stride, err) ||
        check_product("layernorm_modulate_backward_cuda", "grid.y B", B, 1, 65535, err) ||
        check_context("layernorm_modulate_backward_cuda", ctx, err)) return -1;
    int rows = B * T;
    bool vec = C % VEC == 0 && aligned16(dout) && aligned16(inp);
    int splits = column_splits(B, T, C, 2, ctx->scratch_floats), split_rows = (T + splits - 1) / splits;
    float *partial = ctx->scratch;   // (B, splits, 2, C) when splits > 1
    dim3 grid(blocks_for(C, COLS_PER_BLOCK), B * splits);
    layernorm_modulate_dmod_kernel<<<grid, BLOCK_SIZE, 0, stream>>>(dshift, dscale, partial, ctx->tile_counters, dout,
                                                                     inp, mean, rstd, T, C, mod_stride, splits,
                                                                     split_rows, vec);
    LAUNCH_CHECK(err, "layernorm_modulate_dmod_kernel", "B=%d T=%d C=%d splits=%d", B, T, C, splits);
    if (!dinp) return 0;
    vec = vec && mod_stride % VEC == 0 && aligned16(dinp) && aligned16(scale);
#define DINP(vpl) layernorm_modulate_dinp_kernel<vpl>
    LAUNCH_BY_VPL(DINP, C, blocks_for(rows, ROWS_PER_BLOCK), dinp, dout, inp, mean, rstd, scale, rows, T, C,
                  mod_stride, vec);
#undef DINP
    LAUNCH_CHECK(err, "layernorm_modulate_dinp_kernel", "B=%d T=%d C=%d", B, T, C);
    return 0;
}
