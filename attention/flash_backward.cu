// BF16 flash attention recompute backward (FlashAttention-2) with mma.sync m16n8k16.
// flash_delta_kernel first: delta = rowsum(dO∘O) (fp32, from the bf16 O) and dq = 0.
// Then one CTA of 8 warps per (128-key block, head) keeps K and V in shared memory and loops over
// 64-query blocks (Q, dO, lse, delta double-buffered). Warp w owns keys 16w..16w+15 and computes
// the transposed tiles, so that Pᵀ and dSᵀ never leave its registers for dV and dK:
//   Sᵀ = K·Qᵀ, Pᵀ = exp2(Sᵀ·c - lse)   (c = log2(e)/sqrt(D); keys >= N masked to P = 0)
//   dV += bf16(Pᵀ)·dO
//   dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ - delta)
//   dK += bf16(dSᵀ)·Q                    (scaled by 1/sqrt(D) at the end)
//   dSᵀ -> shared memory (bf16); then dQ += dS·K/sqrt(D) for the whole 64×D block, warp w owning
//   queries 16(w%4).. × columns (w/4)·D/2.., added to the fp32 dq with atomics.
// Queries >= N are zero rows with lse = +inf, so their P (and dS) is 0.
#include "attention/flash_cuda.h"
#include "attention/sage_mma.cuh"
#include "layers/common.h"

#define BWD_WARPS 8
#define BWD_THREADS (BWD_WARPS * 32)
#define BWD_BLOCK_N (BWD_WARPS * 16)   // keys per CTA
#define BWD_BLOCK_M 64                 // queries per step

template <int D> struct FlashBwdSmem {
    static constexpr int STRIDE = 2 * D + 16;                // bytes per bf16 row of D
    static constexpr int DS_STRIDE = 2 * BWD_BLOCK_M + 16;   // bytes per bf16 row of dSᵀ
    static constexpr int QB_BYTES = BWD_BLOCK_M * STRIDE;
    // K | V | Q[2] | dO[2] | dSᵀ | lse[2] | delta[2]
    static constexpr int K = 0, V = K + BWD_BLOCK_N * STRIDE, Q = V + BWD_BLOCK_N * STRIDE;
    static constexpr int DO = Q + 2 * QB_BYTES, DS = DO + 2 * QB_BYTES;
    static constexpr int LSE = DS + BWD_BLOCK_N * DS_STRIDE, DELTA = LSE + 2 * BWD_BLOCK_M * 4;
    static constexpr int TOTAL = DELTA + 2 * BWD_BLOCK_M * 4;
};

// delta[row] = Σ_d dout[row, d]·out[row, d] in fp32, and dq[row, :] = 0. One warp per row.
__global__ void flash_delta_kernel(float *delta, float *dq, const __nv_bfloat16 *dout,
                                   const __nv_bfloat16 *out, size_t rows, int D) {
    size_t row = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    int lane = threadIdx.x % 32;
    float s = 0.0f;
    for (int d = lane * 2; d < D; d += 64) {
        float2 a = __bfloat1622float2(*(const __nv_bfloat162 *)(dout + row * D + d));
        float2 b = __bfloat1622float2(*(const __nv_bfloat162 *)(out + row * D + d));
        s += a.x * b.x + a.y * b.y;
    }
    for (int d = lane * 4; d < D; d += 128) *(float4 *)(dq + row * D + d) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) delta[row] = s;
}

// ldmatrix addresses, for lane = 8·mi + r8:
// A (16×16) from row-major smem (m rows, k contiguous):            row m0 + lane%16, col k0 + 8·(lane/16)
// A (16×16) from smem holding Aᵀ (k rows, m contiguous), .trans:    row k0 + 8·(mi/2) + r8, col m0 + 8·(mi%2)
// B pair (k16 × two n8) from smem (n rows, k contiguous):          row n0 + 8·(mi/2) + r8, col k0 + 8·(mi%2)
// B pair from smem (k rows, n contiguous), .trans:                  row k0 + 8·(mi%2) + r8, col n0 + 8·(mi/2)
template <int D>
__global__ void __launch_bounds__(BWD_THREADS, 1) flash_backward_kernel(
    float *dq, float *dk, float *dv, const __nv_bfloat16 *dout, const __nv_bfloat16 *q,
    const __nv_bfloat16 *k, const __nv_bfloat16 *v, const float *lse, const float *delta, int N) {
    using S = FlashBwdSmem<D>;
    constexpr int NT = D / 8;
    extern __shared__ __align__(16) uint8_t smem[];
    float *s_lse = (float *)(smem + S::LSE), *s_delta = (float *)(smem + S::DELTA);
    int bh = blockIdx.y, k0 = blockIdx.x * BWD_BLOCK_N, keys = min(BWD_BLOCK_N, N - k0);
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4, mi = lane / 8, r8 = lane % 8;
    size_t head = (size_t)bh * N * D;
    const uint8_t *qh = (const uint8_t *)(q + head), *doh = (const uint8_t *)(dout + head);
    const float *lse_h = lse + (size_t)bh * N, *delta_h = delta + (size_t)bh * N;
    const float c_log2 = 1.44269504f / sqrtf((float)D), inv_sqrt_d = 1.0f / sqrtf((float)D);
    const int nqb = (N + BWD_BLOCK_M - 1) / BWD_BLOCK_M;

    cp_async_rows<BWD_BLOCK_N, 2 * D, S::STRIDE, BWD_THREADS>(smem + S::K, (const uint8_t *)(k + head + (size_t)k0 * D),
                                                              2 * D, keys);
    cp_async_rows<BWD_BLOCK_N, 2 * D, S::STRIDE, BWD_THREADS>(smem + S::V, (const uint8_t *)(v + head + (size_t)k0 * D),
                                                              2 * D, keys);
    cp_async_rows<BWD_BLOCK_M, 2 * D, S::STRIDE, BWD_THREADS>(smem + S::Q, qh, 2 * D, N);
    cp_async_rows<BWD_BLOCK_M, 2 * D, S::STRIDE, BWD_THREADS>(smem + S::DO, doh, 2 * D, N);
    cp_async_commit();
    if (tid < BWD_BLOCK_M) s_lse[tid] = tid < N ? lse_h[tid] : INFINITY;
    else if (tid < 2 * BWD_BLOCK_M) s_delta[tid - BWD_BLOCK_M] = tid - BWD_BLOCK_M < N ? delta_h[tid - BWD_BLOCK_M] : 0.0f;

    const bool key_valid[2] = {warp * 16 + g < keys, warp * 16 + g + 8 < keys};
    const uint8_t *sKa = smem + S::K + (warp * 16 + lane % 16) * S::STRIDE + (lane / 16) * 16;
    const uint8_t *sVa = smem + S::V + (warp * 16 + lane % 16) * S::STRIDE + (lane / 16) * 16;
    const int dq_m0 = (warp % 4) * 16, dq_n0 = (warp / 4) * (D / 2);
    float dv_acc[NT][4] = {}, dk_acc[NT][4] = {};
    for (int qb = 0; qb < nqb; qb++) {
        int buf = qb & 1, q0 = qb * BWD_BLOCK_M;
        cp_async_wait<0>();
        __syncthreads();   // block qb landed; every warp is done with block qb-1 (its buffers and dSᵀ)
        float next_stat = 0.0f;   // lse (tid < 64) or delta (64 <= tid < 128) of block qb+1
        if (qb + 1 < nqb) {
            int q1 = q0 + BWD_BLOCK_M, nb = buf ^ 1;
            cp_async_rows<BWD_BLOCK_M, 2 * D, S::STRIDE, BWD_THREADS>(smem + S::Q + nb * S::QB_BYTES,
                                                                      qh + (size_t)q1 * 2 * D, 2 * D, N - q1);
            cp_async_rows<BWD_BLOCK_M, 2 * D, S::STRIDE, BWD_THREADS>(smem + S::DO + nb * S::QB_BYTES,
                                                                      doh + (size_t)q1 * 2 * D, 2 * D, N - q1);
            cp_async_commit();
            if (tid < BWD_BLOCK_M) next_stat = q1 + tid < N ? lse_h[q1 + tid] : INFINITY;
            else if (tid < 2 * BWD_BLOCK_M) next_stat = q1 + tid - BWD_BLOCK_M < N ? delta_h[q1 + tid - BWD_BLOCK_M] : 0.0f;
        }
        const uint8_t *sQ = smem + S::Q + buf * S::QB_BYTES, *sDO = smem + S::DO + buf * S::QB_BYTES;
        const float *lse_b = s_lse + buf * BWD_BLOCK_M, *delta_b = s_delta + buf * BWD_BLOCK_M;

        // Sᵀ = K·Qᵀ: 16 keys × 64 queries; then Pᵀ
        float pt[8][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[4];
            ldmatrix_x4(a, sKa + kk * 32);
#pragma unroll
            for (int np = 0; np < 4; np++) {
                uint32_t b[4];
                ldmatrix_x4(b, sQ + (np * 16 + (mi / 2) * 8 + r8) * S::STRIDE + (kk * 16 + (mi % 2) * 8) * 2);
                mma_bf16(pt[2 * np], a, b[0], b[1]);
                mma_bf16(pt[2 * np + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = exp2f(fmaf(pt[j][e], c_log2, -lse_b[8 * j + 2 * c + (e & 1)]));
                pt[j][e] = key_valid[e / 2] ? p : 0.0f;
            }

        // dV += Pᵀ·dO: the Pᵀ accumulators are the A fragments, 16 queries per k-step
#pragma unroll
        for (int t = 0; t < 4; t++) {
            uint32_t a[4] = {pack_bf162(pt[2 * t][0], pt[2 * t][1]), pack_bf162(pt[2 * t][2], pt[2 * t][3]),
                             pack_bf162(pt[2 * t + 1][0], pt[2 * t + 1][1]),
                             pack_bf162(pt[2 * t + 1][2], pt[2 * t + 1][3])};
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, sDO + (t * 16 + (mi % 2) * 8 + r8) * S::STRIDE + (np * 16 + (mi / 2) * 8) * 2);
                mma_bf16(dv_acc[2 * np], a, b[0], b[1]);
                mma_bf16(dv_acc[2 * np + 1], a, b[2], b[3]);
            }
        }

        // dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ - delta)
        float dst[8][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[4];
            ldmatrix_x4(a, sVa + kk * 32);
#pragma unroll
            for (int np = 0; np < 4; np++) {
                uint32_t b[4];
                ldmatrix_x4(b, sDO + (np * 16 + (mi / 2) * 8 + r8) * S::STRIDE + (kk * 16 + (mi % 2) * 8) * 2);
                mma_bf16(dst[2 * np], a, b[0], b[1]);
                mma_bf16(dst[2 * np + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) dst[j][e] = pt[j][e] * (dst[j][e] - delta_b[8 * j + 2 * c + (e & 1)]);

        // dK += dSᵀ·Q, and dSᵀ to shared memory for dQ
#pragma unroll
        for (int t = 0; t < 4; t++) {
            uint32_t a[4] = {pack_bf162(dst[2 * t][0], dst[2 * t][1]), pack_bf162(dst[2 * t][2], dst[2 * t][3]),
                             pack_bf162(dst[2 * t + 1][0], dst[2 * t + 1][1]),
                             pack_bf162(dst[2 * t + 1][2], dst[2 * t + 1][3])};
            uint8_t *ds_row = smem + S::DS + (warp * 16 + g) * S::DS_STRIDE + (16 * t + 2 * c) * 2;
            *(uint32_t *)ds_row = a[0];
            *(uint32_t *)(ds_row + 8 * S::DS_STRIDE) = a[1];
            *(uint32_t *)(ds_row + 16) = a[2];
            *(uint32_t *)(ds_row + 8 * S::DS_STRIDE + 16) = a[3];
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, sQ + (t * 16 + (mi % 2) * 8 + r8) * S::STRIDE + (np * 16 + (mi / 2) * 8) * 2);
                mma_bf16(dk_acc[2 * np], a, b[0], b[1]);
                mma_bf16(dk_acc[2 * np + 1], a, b[2], b[3]);
            }
        }
        if (qb + 1 < nqb) {   // the other buffer's statistics were last read in step qb-1
            if (tid < BWD_BLOCK_M) s_lse[(buf ^ 1) * BWD_BLOCK_M + tid] = next_stat;
            else if (tid < 2 * BWD_BLOCK_M) s_delta[(buf ^ 1) * BWD_BLOCK_M + tid - BWD_BLOCK_M] = next_stat;
        }
        __syncthreads();   // dSᵀ complete

        // dQ += dS·K/sqrt(D): queries dq_m0.. (16) × columns dq_n0.. (D/2), summed over the 128 keys
        float dq_acc[NT / 2][4] = {};
#pragma unroll
        for (int ks = 0; ks < BWD_BLOCK_N / 16; ks++) {
            uint32_t a[4];
            ldmatrix_x4_trans(a, smem + S::DS + (ks * 16 + (mi / 2) * 8 + r8) * S::DS_STRIDE + (dq_m0 + (mi % 2) * 8) * 2);
#pragma unroll
            for (int np = 0; np < NT / 4; np++) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, smem + S::K + (ks * 16 + (mi % 2) * 8 + r8) * S::STRIDE +
                                         (dq_n0 + np * 16 + (mi / 2) * 8) * 2);
                mma_bf16(dq_acc[2 * np], a, b[0], b[1]);
                mma_bf16(dq_acc[2 * np + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int row = q0 + dq_m0 + g + 8 * h;
            if (row >= N) continue;
            float *dst_row = dq + head + (size_t)row * D + dq_n0 + 2 * c;
#pragma unroll
            for (int j = 0; j < NT / 2; j++)
                atomic_add_f32x2(dst_row + 8 * j, dq_acc[j][2 * h] * inv_sqrt_d, dq_acc[j][2 * h + 1] * inv_sqrt_d);
        }
    }

#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (!key_valid[h]) continue;
        size_t at = head + (size_t)(k0 + warp * 16 + g + 8 * h) * D + 2 * c;
#pragma unroll
        for (int j = 0; j < NT; j++) {
            *(float2 *)(dv + at + 8 * j) = make_float2(dv_acc[j][2 * h], dv_acc[j][2 * h + 1]);
            *(float2 *)(dk + at + 8 * j) = make_float2(dk_acc[j][2 * h] * inv_sqrt_d, dk_acc[j][2 * h + 1] * inv_sqrt_d);
        }
    }
}

extern "C" size_t flash_cuda_backward_workspace_size(int B, int H, int N, int D) {
    (void)D;
    return (size_t)B * H * N * sizeof(float);
}

template <int D>
static int launch_backward(float *dq, float *dk, float *dv, const float *delta, const uint16_t *dout,
                           const uint16_t *q, const uint16_t *k, const uint16_t *v, const float *lse,
                           int BH, int N, cudaStream_t stream, char *err) {
    int bytes = FlashBwdSmem<D>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(flash_backward_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                    err, "cudaFuncSetAttribute(flash_backward_kernel max dynamic smem)");
    dim3 grid((N + BWD_BLOCK_N - 1) / BWD_BLOCK_N, BH);
    flash_backward_kernel<D><<<grid, BWD_THREADS, bytes, stream>>>(
        dq, dk, dv, (const __nv_bfloat16 *)dout, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k,
        (const __nv_bfloat16 *)v, lse, delta, N);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch flash_backward_kernel");
    return 0;
}

extern "C" int flash_backward_cuda(float *dq, float *dk, float *dv, void *workspace, const uint16_t *dout,
                                   const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                                   const float *lse, int B, int H, int N, int D, cudaStream_t stream, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535) {
        dit_set_error(err, "flash_backward_cuda: need D in {64, 128}, B, H, N >= 1, B·H <= 65535 "
                           "(got B=%d H=%d N=%d D=%d)", B, H, N, D);
        return -1;
    }
    size_t rows = (size_t)B * H * N;
    float *delta = (float *)workspace;
    flash_delta_kernel<<<(unsigned)((rows + 7) / 8), 256, 0, stream>>>(delta, dq, (const __nv_bfloat16 *)dout,
                                                                     (const __nv_bfloat16 *)out, rows, D);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch flash_delta_kernel");
    if (D == 64) return launch_backward<64>(dq, dk, dv, delta, dout, q, k, v, lse, B * H, N, stream, err);
    return launch_backward<128>(dq, dk, dv, delta, dout, q, k, v, lse, B * H, N, stream, err);
}
