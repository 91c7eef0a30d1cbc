// Sage attention on the GPU: the quantization pass (see sage_cuda.h for the layouts).
// 1. sage_stats_kernel: per (chunk of 256 tokens, head) the column sums of k and column max|v|.
// 2. sage_stats_reduce_kernel: per head, k_mean = Σ chunks / N and v_scale = max / 448.
// 3. sage_quantize_kernel: per (64-token block, head) Q·c and K - k_mean to int8 with one scale
//    per block (amax/127, values rintf(x·(127/amax))), V to e4m3(v/v_scale) or fp16, transposed.
// Arithmetic uses the _rn intrinsics so that --use_fast_math cannot change the definition's
// roundings; only k_mean's summation order differs from the CPU (chunked instead of sequential).
#include "attention/sage_cuda.h"
#include "attention/sage_mma.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

#define STATS_CHUNK 256
#define QUANT_THREADS 256

static int ceil_div(int a, int b) { return (a + b - 1) / b; }
static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

// Workspace: q8 | k8 | q_scale | k_scale | k_mean | v_scale | v_t | column partials (2 per chunk).
static size_t layout(SageCudaQuant *view, char *base, int B, int H, int N, int D, SagePV pv) {
    size_t BH = (size_t)B * H, nblk = ceil_div(N, SAGE_CUDA_BLOCK), off = 0;
    size_t npad = nblk * SAGE_CUDA_BLOCK, nchunk = ceil_div(N, STATS_CHUNK);
    size_t sizes[8] = {BH * N * D, BH * N * D, BH * nblk * 4, BH * nblk * 4, BH * D * 4, BH * D * 4,
                       BH * D * npad * (pv == SAGE_PV_FP8 ? 1 : 2), BH * nchunk * D * 2 * 4};
    char *at[8];
    for (int i = 0; i < 8; i++) { at[i] = base ? base + off : NULL; off += align256(sizes[i]); }
    if (view) {
        view->q8 = (int8_t *)at[0]; view->k8 = (int8_t *)at[1];
        view->q_scale = (float *)at[2]; view->k_scale = (float *)at[3];
        view->k_mean = (float *)at[4]; view->v_scale = (float *)at[5];
        view->v_t = at[6];
    }
    return off;
}

static float *partials(void *workspace, int B, int H, int N, int D, SagePV pv) {
    size_t BH = (size_t)B * H, nchunk = ceil_div(N, STATS_CHUNK);
    return (float *)((char *)workspace + layout(NULL, NULL, B, H, N, D, pv) -
                     align256(BH * nchunk * D * 2 * 4));
}

extern "C" size_t sage_cuda_forward_workspace_size(int B, int H, int N, int D, SagePV pv) {
    return layout(NULL, NULL, B, H, N, D, pv);
}

extern "C" SageCudaQuant sage_cuda_quant_view(void *workspace, int B, int H, int N, int D, SagePV pv) {
    SageCudaQuant view;
    layout(&view, (char *)workspace, B, H, N, D, pv);
    return view;
}

__device__ __forceinline__ void load_bf16x8(float x[8], const __nv_bfloat16 *p) {
    uint4 u = *(const uint4 *)p;
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
    for (int i = 0; i < 4; i++) {
        float2 f = __bfloat1622float2(h[i]);
        x[2 * i] = f.x; x[2 * i + 1] = f.y;
    }
}

// k, v: (BH, N, D). part: (BH, nchunk, 2, D): [0] Σ k over the chunk, [1] max |v| over the chunk.
// Grid (nchunk, BH), 128 threads: each thread owns 8 columns and every rows_per_pass-th row.
template <int D>
__global__ void __launch_bounds__(128) sage_stats_kernel(float *part, const __nv_bfloat16 *k,
                                                         const __nv_bfloat16 *v, int N) {
    constexpr int VEC = D / 8, ROWS = 128 / VEC;
    __shared__ float s_sum[ROWS][D], s_max[ROWS][D];
    int bh = blockIdx.y, chunk = blockIdx.x, vec = threadIdx.x % VEC, row0 = threadIdx.x / VEC;
    float sum[8] = {0}, vmax[8] = {0}, x[8];
    int t_end = min(N, (chunk + 1) * STATS_CHUNK);
    for (int t = chunk * STATS_CHUNK + row0; t < t_end; t += ROWS) {
        size_t at = ((size_t)bh * N + t) * D + vec * 8;
        load_bf16x8(x, k + at);
        for (int i = 0; i < 8; i++) sum[i] += x[i];
        load_bf16x8(x, v + at);
        for (int i = 0; i < 8; i++) vmax[i] = fmaxf(vmax[i], fabsf(x[i]));
    }
    for (int i = 0; i < 8; i++) { s_sum[row0][vec * 8 + i] = sum[i]; s_max[row0][vec * 8 + i] = vmax[i]; }
    __syncthreads();
    if (threadIdx.x < D) {
        float s = 0.0f, m = 0.0f;
        for (int r = 0; r < ROWS; r++) { s += s_sum[r][threadIdx.x]; m = fmaxf(m, s_max[r][threadIdx.x]); }
        float *p = part + ((size_t)bh * gridDim.x + chunk) * 2 * D;
        p[threadIdx.x] = s;
        p[D + threadIdx.x] = m;
    }
}

// k_mean[bh][d] = (Σ_chunks part sums) / divisor (N, or 1 for the sum); v_scale[bh][d] = max/448. Grid BH, D threads.
__global__ void sage_stats_reduce_kernel(float *k_mean, float *v_scale, const float *part,
                                         int nchunk, float divisor, int D, int fp8) {
    int bh = blockIdx.x, d = threadIdx.x;
    float s = 0.0f, m = 0.0f;
    for (int c = 0; c < nchunk; c++) {
        const float *p = part + ((size_t)bh * nchunk + c) * 2 * D;
        s += p[d];
        m = fmaxf(m, p[D + d]);
    }
    k_mean[(size_t)bh * D + d] = __fdiv_rn(s, divisor);
    v_scale[(size_t)bh * D + d] = fp8 ? __fdiv_rn(m, 448.0f) : 0.0f;
}

__device__ float block_max(float x, float *s_red) {
    x = warp_max(x);
    if (threadIdx.x % 32 == 0) s_red[threadIdx.x / 32] = x;
    __syncthreads();
    float m = s_red[0];
    for (int w = 1; w < QUANT_THREADS / 32; w++) m = fmaxf(m, s_red[w]);
    __syncthreads();
    return m;
}

// One 64-token block of x (rows >= N absent) to int8: y = (x - shift)·mul, scale = amax/127.
template <int D>
__device__ void quantize_block(int8_t *q8, float *scale, const __nv_bfloat16 *x, const float *shift,
                               float mul, int rows, float *s_red) {
    constexpr int VEC = D / 8, PER_THREAD = SAGE_CUDA_BLOCK * VEC / QUANT_THREADS;
    float y[PER_THREAD][8], amax = 0.0f;
    for (int j = 0; j < PER_THREAD; j++) {
        int vid = threadIdx.x + j * QUANT_THREADS, row = vid / VEC, col = (vid % VEC) * 8;
        if (row >= rows) continue;
        load_bf16x8(y[j], x + (size_t)row * D + col);
        for (int i = 0; i < 8; i++) {
            y[j][i] = __fmul_rn(shift ? __fsub_rn(y[j][i], shift[col + i]) : y[j][i], mul);
            amax = fmaxf(amax, fabsf(y[j][i]));
        }
    }
    amax = block_max(amax, s_red);
    float inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    for (int j = 0; j < PER_THREAD; j++) {
        int vid = threadIdx.x + j * QUANT_THREADS, row = vid / VEC, col = (vid % VEC) * 8;
        if (row >= rows) continue;
        uint32_t w[2] = {0, 0};
        for (int i = 0; i < 8; i++)
            w[i / 4] |= (uint32_t)(uint8_t)(int8_t)__float2int_rn(__fmul_rn(y[j][i], inv)) << (8 * (i % 4));
        *(uint2 *)(q8 + (size_t)row * D + col) = make_uint2(w[0], w[1]);
    }
    if (threadIdx.x == 0) *scale = __fdiv_rn(amax, 127.0f);
}

// Slot of token u (0..15) in a group of 16 of the FP8 v_t layout (inverse of sage_cuda.h's map).
__device__ __forceinline__ int fp8_slot(int u) { return 4 * ((u % 8) / 2) + (u % 2) + 2 * (u / 8); }

// Grid (nblk, BH), QUANT_THREADS threads. Quantizes Q, K and V of one 64-token block.
template <int D, bool FP8>
__global__ void __launch_bounds__(QUANT_THREADS) sage_quantize_kernel(
    SageCudaQuant qv, const __nv_bfloat16 *q, const __nv_bfloat16 *k, const __nv_bfloat16 *v,
    int N, float q_mul) {
    constexpr int VEC = D / 8, ELT = FP8 ? 1 : 2, ROW_BYTES = SAGE_CUDA_BLOCK * ELT;
    __shared__ float s_red[QUANT_THREADS / 32];
    __shared__ __align__(16) uint8_t s_vt[D][ROW_BYTES];
    int bh = blockIdx.y, blk = blockIdx.x, nblk = gridDim.x, t0 = blk * SAGE_CUDA_BLOCK;
    int rows = min(SAGE_CUDA_BLOCK, N - t0);
    size_t at = ((size_t)bh * N + t0) * D;
    quantize_block<D>(qv.q8 + at, qv.q_scale + (size_t)bh * nblk + blk, q + at, NULL, q_mul, rows, s_red);
    quantize_block<D>(qv.k8 + at, qv.k_scale + (size_t)bh * nblk + blk, k + at,
                      qv.k_mean + (size_t)bh * D, 1.0f, rows, s_red);
    const float *vs = qv.v_scale + (size_t)bh * D;
    for (int vid = threadIdx.x; vid < SAGE_CUDA_BLOCK * VEC; vid += QUANT_THREADS) {
        int row = vid / VEC, col = (vid % VEC) * 8;
        float x[8] = {0};
        if (row < rows) load_bf16x8(x, v + at + (size_t)row * D + col);
        for (int i = 0; i < 8; i++) {
            int d = col + i;
            if (FP8) {
                float y = vs[d] > 0.0f ? __fdiv_rn(x[i], vs[d]) : 0.0f;
                int slot = (row / 16) * 16 + fp8_slot(row % 16);
                s_vt[d][slot] = (uint8_t)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
            } else {
                ((__half *)s_vt[d])[row] = __float2half_rn(x[i]);
            }
        }
    }
    __syncthreads();
    size_t npad = (size_t)nblk * SAGE_CUDA_BLOCK;
    uint8_t *vt = (uint8_t *)qv.v_t + ((size_t)bh * D * npad + (size_t)blk * SAGE_CUDA_BLOCK) * ELT;
    for (int i = threadIdx.x; i < D * ROW_BYTES / 16; i += QUANT_THREADS) {
        int d = i / (ROW_BYTES / 16), c = i % (ROW_BYTES / 16);
        *(uint4 *)(vt + (size_t)d * npad * ELT + c * 16) = *(const uint4 *)(s_vt[d] + c * 16);
    }
}

static int check_shape(const char *fn, int B, int H, int N, int D, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535) {
        dit_set_error(err, "%s: need D in {64, 128}, B, H, N >= 1 and B·H <= 65535 "
                      "(got B=%d H=%d N=%d D=%d)", fn, B, H, N, D);
        return -1;
    }
    return 0;
}

// Launches 1 and 2 of the quantization pass: k_mean[bh][d] = (Σ_t k) / divisor and
// v_scale[bh][d] = max_t |v| / 448 (0 in FP16 mode), through the workspace's column partials.
static int launch_stats(float *k_mean, float *v_scale, void *workspace, const uint16_t *k, const uint16_t *v,
                        int B, int H, int N, int D, SagePV pv, float divisor, cudaStream_t stream, char *err) {
    float *part = partials(workspace, B, H, N, D, pv);
    int BH = B * H, nchunk = ceil_div(N, STATS_CHUNK);
    const __nv_bfloat16 *kb = (const __nv_bfloat16 *)k, *vb = (const __nv_bfloat16 *)v;
    dim3 stats_grid(nchunk, BH);
    if (D == 64) sage_stats_kernel<64><<<stats_grid, 128, 0, stream>>>(part, kb, vb, N);
    else sage_stats_kernel<128><<<stats_grid, 128, 0, stream>>>(part, kb, vb, N);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_stats_kernel");
    sage_stats_reduce_kernel<<<BH, D, 0, stream>>>(k_mean, v_scale, part, nchunk, divisor, D, pv == SAGE_PV_FP8);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_stats_reduce_kernel");
    return 0;
}

// Launch 3: Q, K (with the k_mean in qv) and V (with the v_scale in qv) per 64-token block.
static int launch_quantize(const SageCudaQuant *qv, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           int B, int H, int N, int D, SagePV pv, cudaStream_t stream, char *err) {
    const __nv_bfloat16 *qb = (const __nv_bfloat16 *)q, *kb = (const __nv_bfloat16 *)k,
                        *vb = (const __nv_bfloat16 *)v;
    float q_mul = (1.0f / sqrtf((float)D)) * 1.44269504f;   // host arithmetic, as the CPU definition
    dim3 quant_grid(ceil_div(N, SAGE_CUDA_BLOCK), B * H);
    bool fp8 = pv == SAGE_PV_FP8;
    if (D == 64 && fp8) sage_quantize_kernel<64, true><<<quant_grid, QUANT_THREADS, 0, stream>>>(*qv, qb, kb, vb, N, q_mul);
    if (D == 64 && !fp8) sage_quantize_kernel<64, false><<<quant_grid, QUANT_THREADS, 0, stream>>>(*qv, qb, kb, vb, N, q_mul);
    if (D == 128 && fp8) sage_quantize_kernel<128, true><<<quant_grid, QUANT_THREADS, 0, stream>>>(*qv, qb, kb, vb, N, q_mul);
    if (D == 128 && !fp8) sage_quantize_kernel<128, false><<<quant_grid, QUANT_THREADS, 0, stream>>>(*qv, qb, kb, vb, N, q_mul);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_quantize_kernel");
    return 0;
}

extern "C" int sage_quantize_cuda(void *workspace, const uint16_t *q, const uint16_t *k,
                                  const uint16_t *v, int B, int H, int N, int D, SagePV pv,
                                  cudaStream_t stream, char *err) {
    if (check_shape("sage_quantize_cuda", B, H, N, D, err) != 0) return -1;
    CHECK_DEVICE_ARGS("sage_quantize_cuda", err, DEVICE_ARG(workspace, 16), DEVICE_ARG(q, 16), DEVICE_ARG(k, 16),
                      DEVICE_ARG(v, 16));
    SageCudaQuant qv = sage_cuda_quant_view(workspace, B, H, N, D, pv);
    if (launch_stats(qv.k_mean, qv.v_scale, workspace, k, v, B, H, N, D, pv, (float)N, stream, err) != 0) return -1;
    return launch_quantize(&qv, q, k, v, B, H, N, D, pv, stream, err);
}

extern "C" int sage_kv_stats_cuda(float *k_sum, float *v_scale, void *workspace, const uint16_t *k,
                                  const uint16_t *v, int B, int H, int N, int D, SagePV pv,
                                  cudaStream_t stream, char *err) {
    if (check_shape("sage_kv_stats_cuda", B, H, N, D, err) != 0) return -1;
    CHECK_DEVICE_ARGS("sage_kv_stats_cuda", err, DEVICE_ARG(k_sum, 4), DEVICE_ARG(v_scale, 4),
                      DEVICE_ARG(workspace, 16), DEVICE_ARG(k, 16), DEVICE_ARG(v, 16));
    // divisor 1: the reduction's k_mean = Σ/1 is the sum, exactly
    return launch_stats(k_sum, v_scale, workspace, k, v, B, H, N, D, pv, 1.0f, stream, err);
}

extern "C" int sage_quantize_given_cuda(void *workspace, const uint16_t *q, const uint16_t *k,
                                        const uint16_t *v, const float *k_mean, const float *v_scale,
                                        int B, int H, int N, int D, SagePV pv, cudaStream_t stream,
                                        char *err) {
    if (check_shape("sage_quantize_given_cuda", B, H, N, D, err) != 0) return -1;
    CHECK_DEVICE_ARGS("sage_quantize_given_cuda", err, DEVICE_ARG(workspace, 16), DEVICE_ARG(q, 16),
                      DEVICE_ARG(k, 16), DEVICE_ARG(v, 16), DEVICE_ARG(k_mean, 4));
    if (pv == SAGE_PV_FP8) CHECK_DEVICE_ARGS("sage_quantize_given_cuda (FP8 P·V)", err, DEVICE_ARG(v_scale, 4));
    SageCudaQuant qv = sage_cuda_quant_view(workspace, B, H, N, D, pv);
    size_t bytes = (size_t)B * H * D * sizeof(float);
    if (qv.k_mean != k_mean)
        SAGE_CUDA_CHECK(cudaMemcpyAsync(qv.k_mean, k_mean, bytes, cudaMemcpyDeviceToDevice, stream), err,
                        "cudaMemcpyAsync(workspace k_mean <- given k_mean)");
    if (pv != SAGE_PV_FP8)
        SAGE_CUDA_CHECK(cudaMemsetAsync(qv.v_scale, 0, bytes, stream), err, "cudaMemsetAsync(workspace v_scale)");
    else if (qv.v_scale != v_scale)
        SAGE_CUDA_CHECK(cudaMemcpyAsync(qv.v_scale, v_scale, bytes, cudaMemcpyDeviceToDevice, stream), err,
                        "cudaMemcpyAsync(workspace v_scale <- given v_scale)");
    return launch_quantize(&qv, q, k, v, B, H, N, D, pv, stream, err);
}
