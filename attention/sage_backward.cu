// Sage attention recompute backward on the GPU with mma.sync (FlashAttention-2 structure).
// One CTA of 4 warps per (64-key block, head) keeps K8, k - k_mean (bf16) and V in shared memory
// and loops over the 64-query blocks. Per query block:
//   S  = Q8·K8ᵀ (int8 mma, as the forward), s = (float)S·(q_scale·k_scale), P = exp2(s - lse)
//   dP = dO·Vᵀ (bf16 mma), dS = P∘(dP - delta); P and dS go to shared memory as bf16
//   dV += Pᵀ·dO, dK += dSᵀ·Q (bf16 mma, fp32 accumulators in registers; warp w owns keys 16w..)
//   dQ += dS·(K - k_mean)/sqrt(D): warp w owns queries 16w.., added to global fp32 with atomics.
// delta = rowsum(dO∘O) comes from sage_delta_kernel unless the caller passes it.
#include "attention/sage_cuda.h"
#include "attention/sage_mma.cuh"
#include "layers/common.h"

#define BWD_THREADS 128

template <int D> struct BwdSmem {
    static constexpr int I8_STRIDE = D + 16;        // bytes per int8 row
    static constexpr int BF_STRIDE = 2 * D + 16;    // bytes per bf16 row of D
    static constexpr int P_STRIDE = 2 * 64 + 16;    // bytes per bf16 row of 64
    static constexpr int I8_BYTES = 64 * I8_STRIDE, BF_BYTES = 64 * BF_STRIDE, P_BYTES = 64 * P_STRIDE;
    // K8 | Ks | V | Q8 | Q | dO | P | dS | lse | delta
    static constexpr int K8 = 0, KS = K8 + I8_BYTES, V = KS + BF_BYTES, Q8 = V + BF_BYTES;
    static constexpr int Q = Q8 + I8_BYTES, DO = Q + BF_BYTES, P = DO + BF_BYTES, DS = P + P_BYTES;
    static constexpr int LSE = DS + P_BYTES, DELTA = LSE + 64 * 4, TOTAL = DELTA + 64 * 4;
};

// delta[row] = Σ_d dout[row, d]·out[row, d] in fp32. One warp per row.
__global__ void sage_delta_kernel(float *delta, const __nv_bfloat16 *dout, const __nv_bfloat16 *out,
                                  size_t rows, int D) {
    size_t row = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    int lane = threadIdx.x % 32;
    float s = 0.0f;
    for (int d = lane * 2; d < D; d += 64) {
        float2 a = __bfloat1622float2(*(const __nv_bfloat162 *)(dout + row * D + d));
        float2 b = __bfloat1622float2(*(const __nv_bfloat162 *)(out + row * D + d));
        s += a.x * b.x + a.y * b.y;
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) delta[row] = s;
}

template <int ROW_BYTES, int STRIDE>
__device__ __forceinline__ void load_rows64(uint8_t *dst, const uint8_t *src, size_t src_stride, int valid_rows) {
    constexpr int CHUNKS = ROW_BYTES / 16;
    for (int i = threadIdx.x; i < 64 * CHUNKS; i += BWD_THREADS) {
        int r = i / CHUNKS, ch = i % CHUNKS;
        bool valid = r < valid_rows;
        cp_async16(dst + r * STRIDE + ch * 16, src + (valid ? r : 0) * src_stride + ch * 16, valid);
    }
}

// ldmatrix addresses, for lane = 8·mi + r:
// A (16×16) from row-major smem (m rows, k contiguous):            row m0 + lane%16, col k0 + 8·(lane/16)
// A (16×16) from smem holding Aᵀ (k rows, m contiguous), .trans:    row k0 + 8·(mi/2) + r, col m0 + 8·(mi%2)
// B pair (k16 × two n8) from smem (k rows, n contiguous), .trans:   row k0 + 8·(mi%2) + r, col n0 + 8·(mi/2)
// B pair from smem (n rows, k contiguous):                          row n0 + 8·(mi/2) + r, col k0 + 8·(mi%2)
template <int D>
__global__ void __launch_bounds__(BWD_THREADS) sage_backward_kernel(
    float *dq, float *dk, float *dv, SageCudaQuant qv, const __nv_bfloat16 *dout,
    const __nv_bfloat16 *q, const __nv_bfloat16 *k, const __nv_bfloat16 *v, const float *lse,
    const float *delta, int N) {
    using S = BwdSmem<D>;
    constexpr int NT = D / 8;
    extern __shared__ __align__(16) uint8_t smem[];
    float *s_lse = (float *)(smem + S::LSE), *s_delta = (float *)(smem + S::DELTA);
    int bh = blockIdx.y, kb = blockIdx.x, nblk = gridDim.x;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, mi = lane / 8, r8 = lane % 8;
    size_t head = (size_t)bh * N * D;
    int k0 = kb * 64, keys = min(64, N - k0);
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);

    load_rows64<D, S::I8_STRIDE>(smem + S::K8, (const uint8_t *)qv.k8 + head + (size_t)k0 * D, D, keys);
    load_rows64<2 * D, S::BF_STRIDE>(smem + S::V, (const uint8_t *)(v + head + (size_t)k0 * D), 2 * D, keys);
    cp_async_commit();
    const float *mean = qv.k_mean + (size_t)bh * D;
    for (int i = threadIdx.x; i < 64 * D / 8; i += BWD_THREADS) {
        int r = i / (D / 8), col = (i % (D / 8)) * 8;
        uint4 u = make_uint4(0, 0, 0, 0);
        if (r < keys) u = *(const uint4 *)(k + head + (size_t)(k0 + r) * D + col);
        __nv_bfloat162 *h = (__nv_bfloat162 *)&u;
        for (int e = 0; e < 4; e++) {
            float2 f = __bfloat1622float2(h[e]);
            h[e] = r < keys ? __floats2bfloat162_rn(f.x - mean[col + 2 * e], f.y - mean[col + 2 * e + 1])
                            : __floats2bfloat162_rn(0.0f, 0.0f);
        }
        *(uint4 *)(smem + S::KS + r * S::BF_STRIDE + col * 2) = u;
    }

    float dv_acc[NT][4] = {}, dk_acc[NT][4] = {};
    const float k_scale = qv.k_scale[(size_t)bh * nblk + kb];
    for (int qb = 0; qb < nblk; qb++) {
        int q0 = qb * 64, rows = min(64, N - q0);
        load_rows64<D, S::I8_STRIDE>(smem + S::Q8, (const uint8_t *)qv.q8 + head + (size_t)q0 * D, D, rows);
        load_rows64<2 * D, S::BF_STRIDE>(smem + S::Q, (const uint8_t *)(q + head + (size_t)q0 * D), 2 * D, rows);
        load_rows64<2 * D, S::BF_STRIDE>(smem + S::DO, (const uint8_t *)(dout + head + (size_t)q0 * D), 2 * D, rows);
        cp_async_commit();
        if (threadIdx.x < 64) {
            bool valid = (int)threadIdx.x < rows;
            s_lse[threadIdx.x] = valid ? lse[(size_t)bh * N + q0 + threadIdx.x] : 0.0f;
            s_delta[threadIdx.x] = valid ? delta[(size_t)bh * N + q0 + threadIdx.x] : 0.0f;
        }
        cp_async_wait<0>();
        __syncthreads();

        // S = Q8·K8ᵀ for queries 16w.. × 64 keys, then P
        int acc[8][4] = {};
        for (int ks = 0; ks < D / 32; ks++) {
            uint32_t a[4];
            ldmatrix_x4(a, smem + S::Q8 + (warp * 16 + (mi % 2) * 8 + r8) * S::I8_STRIDE + ks * 32 + (mi / 2) * 16);
            for (int np = 0; np < 4; np++) {
                uint32_t b[4];
                ldmatrix_x4(b, smem + S::K8 + (np * 16 + (mi / 2) * 8 + r8) * S::I8_STRIDE + ks * 32 + (mi % 2) * 16);
                mma_s8(acc[2 * np], a, b[0], b[1]);
                mma_s8(acc[2 * np + 1], a, b[2], b[3]);
            }
        }
        float scale = __fmul_rn(qv.q_scale[(size_t)bh * nblk + qb], k_scale);
        float p[8][4];
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++) {
                int row = warp * 16 + g + 8 * (e / 2), key = 8 * j + 2 * c + (e & 1);
                float s = __fmul_rn((float)acc[j][e], scale);
                p[j][e] = (row < rows && key < keys) ? exp2f(s - s_lse[row]) : 0.0f;
            }

        // dP = dO·Vᵀ, dS = P∘(dP - delta)
        float dp[8][4] = {};
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[4];
            ldmatrix_x4(a, smem + S::DO + (warp * 16 + lane % 16) * S::BF_STRIDE + (kk * 16 + (lane / 16) * 8) * 2);
            for (int np = 0; np < 4; np++) {
                uint32_t b[4];
                ldmatrix_x4(b, smem + S::V + (np * 16 + (mi / 2) * 8 + r8) * S::BF_STRIDE + (kk * 16 + (mi % 2) * 8) * 2);
                mma_bf16(dp[2 * np], a, b[0], b[1]);
                mma_bf16(dp[2 * np + 1], a, b[2], b[3]);
            }
        }
        for (int j = 0; j < 8; j++)
            for (int h = 0; h < 2; h++) {
                int row = warp * 16 + g + 8 * h, col = 8 * j + 2 * c;
                float d = s_delta[row];
                float ds0 = p[j][2 * h] * (dp[j][2 * h] - d), ds1 = p[j][2 * h + 1] * (dp[j][2 * h + 1] - d);
                *(uint32_t *)(smem + S::P + row * S::P_STRIDE + col * 2) = pack_bf162(p[j][2 * h], p[j][2 * h + 1]);
                *(uint32_t *)(smem + S::DS + row * S::P_STRIDE + col * 2) = pack_bf162(ds0, ds1);
            }
        __syncthreads();

        // dV += Pᵀ·dO and dK += dSᵀ·Q: keys 16w.. × D, summed over the 64 queries
        for (int ks = 0; ks < 4; ks++) {
            uint32_t ap[4], ads[4];
            int arow = ks * 16 + (mi / 2) * 8 + r8, acol = warp * 16 + (mi % 2) * 8;
            ldmatrix_x4_trans(ap, smem + S::P + arow * S::P_STRIDE + acol * 2);
            ldmatrix_x4_trans(ads, smem + S::DS + arow * S::P_STRIDE + acol * 2);
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b[4];
                int brow = ks * 16 + (mi % 2) * 8 + r8, bcol = np * 16 + (mi / 2) * 8;
                ldmatrix_x4_trans(b, smem + S::DO + brow * S::BF_STRIDE + bcol * 2);
                mma_bf16(dv_acc[2 * np], ap, b[0], b[1]);
                mma_bf16(dv_acc[2 * np + 1], ap, b[2], b[3]);
                ldmatrix_x4_trans(b, smem + S::Q + brow * S::BF_STRIDE + bcol * 2);
                mma_bf16(dk_acc[2 * np], ads, b[0], b[1]);
                mma_bf16(dk_acc[2 * np + 1], ads, b[2], b[3]);
            }
        }

        // dQ += dS·Ks/sqrt(D): queries 16w.. × D, in column chunks of 32
        uint32_t a_ds[4][4];
        for (int ks = 0; ks < 4; ks++)
            ldmatrix_x4(a_ds[ks], smem + S::DS + (warp * 16 + lane % 16) * S::P_STRIDE + (ks * 16 + (lane / 16) * 8) * 2);
        for (int nc = 0; nc < D / 32; nc++) {
            float dq_acc[4][4] = {};
            for (int ks = 0; ks < 4; ks++)
                for (int np = 0; np < 2; np++) {
                    uint32_t b[4];
                    int brow = ks * 16 + (mi % 2) * 8 + r8, bcol = nc * 32 + np * 16 + (mi / 2) * 8;
                    ldmatrix_x4_trans(b, smem + S::KS + brow * S::BF_STRIDE + bcol * 2);
                    mma_bf16(dq_acc[2 * np], a_ds[ks], b[0], b[1]);
                    mma_bf16(dq_acc[2 * np + 1], a_ds[ks], b[2], b[3]);
                }
            for (int h = 0; h < 2; h++) {
                int row = warp * 16 + g + 8 * h;
                if (row >= rows) continue;
                float *dst = dq + head + (size_t)(q0 + row) * D + nc * 32 + 2 * c;
                for (int j = 0; j < 4; j++) {
                    atomicAdd(dst + 8 * j, dq_acc[j][2 * h] * inv_sqrt_d);
                    atomicAdd(dst + 8 * j + 1, dq_acc[j][2 * h + 1] * inv_sqrt_d);
                }
            }
        }
        __syncthreads();
    }

    for (int h = 0; h < 2; h++) {
        int key = warp * 16 + g + 8 * h;
        if (key >= keys) continue;
        size_t at = head + (size_t)(k0 + key) * D + 2 * c;
        for (int j = 0; j < NT; j++) {
            *(float2 *)(dv + at + 8 * j) = make_float2(dv_acc[j][2 * h], dv_acc[j][2 * h + 1]);
            *(float2 *)(dk + at + 8 * j) = make_float2(dk_acc[j][2 * h] * inv_sqrt_d, dk_acc[j][2 * h + 1] * inv_sqrt_d);
        }
    }
}

extern "C" size_t sage_cuda_backward_workspace_size(int B, int H, int N, int D) {
    (void)D;
    return (size_t)B * H * N * sizeof(float);
}

template <int D>
static int launch_backward(float *dq, float *dk, float *dv, const SageCudaQuant *qv, const uint16_t *dout,
                           const uint16_t *q, const uint16_t *k, const uint16_t *v, const float *lse,
                           const float *delta, int BH, int N, cudaStream_t stream, char *err) {
    int bytes = BwdSmem<D>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(sage_backward_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                    err, "cudaFuncSetAttribute(sage_backward_kernel max dynamic smem)");
    dim3 grid((N + 63) / 64, BH);
    sage_backward_kernel<D><<<grid, BWD_THREADS, bytes, stream>>>(
        dq, dk, dv, *qv, (const __nv_bfloat16 *)dout, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k,
        (const __nv_bfloat16 *)v, lse, delta, N);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_backward_kernel");
    return 0;
}

extern "C" int sage_backward_cuda(float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                                  const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                                  const uint16_t *v, const uint16_t *out, const float *lse,
                                  const float *delta, int B, int H, int N, int D, SagePV pv,
                                  cudaStream_t stream, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1) {
        dit_set_error(err, "sage_backward_cuda: need D in {64, 128}, B, H, N >= 1 (got B=%d H=%d N=%d D=%d)",
                      B, H, N, D);
        return -1;
    }
    SageCudaQuant qv = sage_cuda_quant_view((void *)fwd_workspace, B, H, N, D, pv);
    size_t rows = (size_t)B * H * N;
    if (!delta) {
        float *d = (float *)workspace;
        sage_delta_kernel<<<(unsigned)((rows + 7) / 8), 256, 0, stream>>>(d, (const __nv_bfloat16 *)dout,
                                                                        (const __nv_bfloat16 *)out, rows, D);
        SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_delta_kernel");
        delta = d;
    }
    SAGE_CUDA_CHECK(cudaMemsetAsync(dq, 0, rows * D * sizeof(float), stream), err, "cudaMemsetAsync(dq)");
    if (D == 64) return launch_backward<64>(dq, dk, dv, &qv, dout, q, k, v, lse, delta, B * H, N, stream, err);
    return launch_backward<128>(dq, dk, dv, &qv, dout, q, k, v, lse, delta, B * H, N, stream, err);
}
