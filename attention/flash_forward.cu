// BF16 flash attention forward (FlashAttention-2) with mma.sync m16n8k16.
// One CTA of 8 warps per (128-query block, head); warp w owns query rows 16w..16w+15. Q stays in
// shared memory; K and V blocks of 64 keys are cp.async double-buffered. Per key block:
//   S = Q·Kᵀ              bf16 mma, fp32 accumulators (raw dot products)
//   m' = max(m, rowmax S·c), alpha = exp2(m - m'), P = exp2(S·c - m'), l = l·alpha + ΣP
//                         with c = log2(e)/sqrt(D): everything in base 2
//   O = O·alpha + bf16(P)·V   the S accumulators are the A fragments of the P·V mma
// Keys >= N (the last block's tail, zero-filled) get S = -inf. Finally out = O/l and
// lse = m + log2(l).
#include <limits.h>
#include <stdlib.h>
#include "attention/flash_cuda.h"
#include "attention/attention_rows.cuh"
#include "attention/sage_mma.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

#define FWD_WARPS 8
#define FWD_THREADS (FWD_WARPS * 32)
#define FWD_BLOCK_M (FWD_WARPS * 16)
#define FWD_BLOCK_N 64
// CTAs per SM that the register allocation must allow (2: at most 128 registers per thread).
#ifndef FLASH_FWD_MIN_BLOCKS
#define FLASH_FWD_MIN_BLOCKS 2
#endif

template <int D> struct FlashFwdSmem {
    static constexpr int STRIDE = 2 * D + 16;   // bytes per bf16 row (+16: conflict-free ldmatrix)
    static constexpr int Q = 0, K = Q + FWD_BLOCK_M * STRIDE;
    static constexpr int KV_BYTES = FWD_BLOCK_N * STRIDE;
    static constexpr int V = K + 2 * KV_BYTES, TOTAL = V + 2 * KV_BYTES;
};

// ldmatrix addresses, for lane = 8·mi + r8:
// A (16×16) from row-major smem (m rows, k contiguous):          row m0 + lane%16, col k0 + 8·(lane/16)
// B pair (k16 × two n8) from smem (n rows, k contiguous):        row n0 + 8·(mi/2) + r8, col k0 + 8·(mi%2)
// B pair from smem (k rows, n contiguous), .trans:                row k0 + 8·(mi%2) + r8, col n0 + 8·(mi/2)
template <int D>
__global__ void __launch_bounds__(FWD_THREADS, FLASH_FWD_MIN_BLOCKS) flash_forward_kernel(
    __nv_bfloat16 *out, float *lse, const __nv_bfloat16 *q, const __nv_bfloat16 *k,
    const __nv_bfloat16 *v, int N, int merged_heads) {
    using S = FlashFwdSmem<D>;
    constexpr int NT = D / 8;
    extern __shared__ __align__(16) uint8_t smem[];
    int bh = blockIdx.y, q0 = blockIdx.x * FWD_BLOCK_M;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, mi = lane / 8, r8 = lane % 8;
    size_t head = (size_t)bh * N * D;
    const uint8_t *kh = (const uint8_t *)(k + head), *vh = (const uint8_t *)(v + head);
    const float c_log2 = 1.44269504f / sqrtf((float)D);
    const int nkb = (N + FWD_BLOCK_N - 1) / FWD_BLOCK_N;

    cp_async_rows<FWD_BLOCK_M, 2 * D, S::STRIDE, FWD_THREADS>(smem + S::Q, (const uint8_t *)(q + head + (size_t)q0 * D),
                                                              2 * D, N - q0);
    cp_async_rows<FWD_BLOCK_N, 2 * D, S::STRIDE, FWD_THREADS>(smem + S::K, kh, 2 * D, N);
    cp_async_rows<FWD_BLOCK_N, 2 * D, S::STRIDE, FWD_THREADS>(smem + S::V, vh, 2 * D, N);
    cp_async_commit();

    float o[NT][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const uint8_t *sQ = smem + S::Q + (warp * 16 + lane % 16) * S::STRIDE + (lane / 16) * 16;
    for (int kb = 0; kb < nkb; kb++) {
        cp_async_wait<0>();
        __syncthreads();   // block kb landed; every warp is done with block kb-1's buffers
        if (kb + 1 < nkb) {
            int nb = (kb + 1) & 1, k1 = (kb + 1) * FWD_BLOCK_N;
            cp_async_rows<FWD_BLOCK_N, 2 * D, S::STRIDE, FWD_THREADS>(smem + S::K + nb * S::KV_BYTES,
                                                                      kh + (size_t)k1 * 2 * D, 2 * D, N - k1);
            cp_async_rows<FWD_BLOCK_N, 2 * D, S::STRIDE, FWD_THREADS>(smem + S::V + nb * S::KV_BYTES,
                                                                      vh + (size_t)k1 * 2 * D, 2 * D, N - k1);
            cp_async_commit();
        }
        const uint8_t *sK = smem + S::K + (kb & 1) * S::KV_BYTES, *sV = smem + S::V + (kb & 1) * S::KV_BYTES;

        // S = Q·Kᵀ: 16 rows × 64 keys
        float s[8][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[4];
            ldmatrix_x4(a, sQ + kk * 32);
#pragma unroll
            for (int np = 0; np < 4; np++) {
                uint32_t b[4];
                ldmatrix_x4(b, sK + (np * 16 + (mi / 2) * 8 + r8) * S::STRIDE + (kk * 16 + (mi % 2) * 8) * 2);
                mma_bf16(s[2 * np], a, b[0], b[1]);
                mma_bf16(s[2 * np + 1], a, b[2], b[3]);
            }
        }

        // online softmax; this thread holds rows g (e = 0, 1) and g + 8 (e = 2, 3)
        if ((kb + 1) * FWD_BLOCK_N > N) {
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (kb * FWD_BLOCK_N + 8 * j + 2 * c + (e & 1) >= N) s[j][e] = -INFINITY;
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = m[r];
#pragma unroll
            for (int j = 0; j < 8; j++) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]) * c_log2);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            alpha[r] = exp2f(m[r] - mx);
            m[r] = mx;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[j][e] = exp2f(fmaf(s[j][e], c_log2, -m[e / 2]));
                l[e / 2] += s[j][e];
            }
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[j][e] *= alpha[e / 2];

        // O += bf16(P)·V: 16 keys per k-step
#pragma unroll
        for (int t = 0; t < 4; t++) {
            uint32_t a[4] = {pack_bf162(s[2 * t][0], s[2 * t][1]), pack_bf162(s[2 * t][2], s[2 * t][3]),
                             pack_bf162(s[2 * t + 1][0], s[2 * t + 1][1]),
                             pack_bf162(s[2 * t + 1][2], s[2 * t + 1][3])};
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, sV + (t * 16 + (mi % 2) * 8 + r8) * S::STRIDE + (np * 16 + (mi / 2) * 8) * 2);
                mma_bf16(o[2 * np], a, b[0], b[1]);
                mma_bf16(o[2 * np + 1], a, b[2], b[3]);
            }
        }
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        int row = q0 + warp * 16 + g + 8 * r;
        if (row >= N) continue;
        float inv_l = 1.0f / l[r];
        __nv_bfloat16 *orow = out + attn_row_offset(bh, row, N, D, merged_heads) + 2 * c;
#pragma unroll
        for (int j = 0; j < NT; j++)
            *(__nv_bfloat162 *)(orow + 8 * j) = __floats2bfloat162_rn(o[j][2 * r] * inv_l, o[j][2 * r + 1] * inv_l);
        if (c == 0) lse[(size_t)bh * N + row] = m[r] + log2f(l[r]);
    }
}

template <int D>
static int launch_forward(uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                          int BH, int N, int merged_heads, cudaStream_t stream, char *err) {
    int bytes = FlashFwdSmem<D>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(flash_forward_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                    err, "cudaFuncSetAttribute(flash_forward_kernel max dynamic smem)");
    dim3 grid((N + FWD_BLOCK_M - 1) / FWD_BLOCK_M, BH);
    flash_forward_kernel<D><<<grid, FWD_THREADS, bytes, stream>>>(
        (__nv_bfloat16 *)out, lse, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k, (const __nv_bfloat16 *)v, N,
        merged_heads);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch flash_forward_kernel");
    return 0;
}

// flash_forward_cuda (merged_heads 0) and flash_forward_merged_cuda (merged_heads H).
static int forward(const char *fn, uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k,
                   const uint16_t *v, int B, int H, int N, int D, int merged_heads, cudaStream_t stream, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535) {
        dit_set_error(err, "%s: need D in {64, 128}, B, H, N >= 1, B·H <= 65535 (got B=%d H=%d N=%d D=%d)", fn,
                      B, H, N, D);
        return -1;
    }
    CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(out, 16), DEVICE_ARG(lse, 4), DEVICE_ARG(q, 16), DEVICE_ARG(k, 16),
                      DEVICE_ARG(v, 16));
    // Hopper: the wgmma kernel (flash_forward_sm90.cu); DIT_FLASH_MMA_SYNC=1 keeps this one.
    if (!getenv("DIT_FLASH_MMA_SYNC") && (long long)B * H * N <= INT_MAX && flash_forward_sm90_available())
        return flash_forward_sm90_rows(out, lse, q, k, v, B, H, N, D, merged_heads, stream, err);
    if (D == 64) return launch_forward<64>(out, lse, q, k, v, B * H, N, merged_heads, stream, err);
    return launch_forward<128>(out, lse, q, k, v, B * H, N, merged_heads, stream, err);
}

extern "C" int flash_forward_cuda(uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k,
                                  const uint16_t *v, int B, int H, int N, int D, cudaStream_t stream, char *err) {
    return forward("flash_forward_cuda", out, lse, q, k, v, B, H, N, D, 0, stream, err);
}

extern "C" int flash_forward_merged_cuda(uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k,
                                         const uint16_t *v, int B, int H, int N, int D, cudaStream_t stream,
                                         char *err) {
    return forward("flash_forward_merged_cuda", out, lse, q, k, v, B, H, N, D, H, stream, err);
}
