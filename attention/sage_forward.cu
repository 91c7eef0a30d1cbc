// Sage attention forward on the GPU with mma.sync (the plain, readable kernel).
// One CTA of 4 warps per (64-query block, head); each warp owns 16 query rows. Per 64-key block
// (cp.async double-buffered in shared memory):
//   S = Q8·K8ᵀ      int8 m16n8k32, int32 accumulators; s = (float)S · (q_scale·k_scale)
//   online softmax  m' = max(m, rowmax s), alpha = exp2(m - m'), P = exp2(s - m'), l = l·alpha + ΣP
//   FP8:  O = O·alpha + [e4m3(P·448) · V8]     e4m3 m16n8k32 into a fresh fp32 block sum (two levels)
//   FP16: O = O·alpha + fp16(P) · fp16(V)       f16 m16n8k16 straight into O (full fp32 accumulation)
// P stays in registers: the S accumulator layout is the P·V A fragment, up to the token order of
// each 16-key group, which the quantization pass bakes into v_t (FP8; see sage_cuda.h).
// Finally out = O·v_scale/448/l (FP8) or O/l, lse = m + log2(l).
#include <stdlib.h>
#include "attention/sage_cuda.h"
#include "attention/attention_rows.cuh"
#include "attention/sage_mma.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

#define FWD_THREADS 128

template <int D, bool FP8> struct FwdSmem {
    static constexpr int QK_STRIDE = D + 16;                          // bytes per int8 row
    static constexpr int V_STRIDE = SAGE_CUDA_BLOCK * (FP8 ? 1 : 2) + 16;   // bytes per v_t row
    static constexpr int Q_BYTES = SAGE_CUDA_BLOCK * QK_STRIDE;
    static constexpr int K_BYTES = SAGE_CUDA_BLOCK * QK_STRIDE;
    static constexpr int V_BYTES = D * V_STRIDE;
    static constexpr int TOTAL = Q_BYTES + 2 * K_BYTES + 2 * V_BYTES;
};

// 64 rows of `row_bytes` from src (row stride row_bytes; rows >= valid_rows zero-filled) to smem.
template <int ROW_BYTES, int STRIDE>
__device__ __forceinline__ void load_rows(uint8_t *dst, const uint8_t *src, size_t src_stride,
                                          int rows, int valid_rows) {
    constexpr int CHUNKS = ROW_BYTES / 16;
    for (int i = threadIdx.x; i < rows * CHUNKS; i += FWD_THREADS) {
        int r = i / CHUNKS, ch = i % CHUNKS;
        bool valid = r < valid_rows;
        cp_async16(dst + r * STRIDE + ch * 16, src + (valid ? r : 0) * src_stride + ch * 16, valid);
    }
}

template <int D, bool FP8>
__global__ void __launch_bounds__(FWD_THREADS) sage_forward_kernel(__nv_bfloat16 *out, float *lse,
                                                                   SageCudaQuant qv, int N,
                                                                   int merged_heads) {
    using S = FwdSmem<D, FP8>;
    constexpr int BN = SAGE_CUDA_BLOCK, ELT = FP8 ? 1 : 2, NT = D / 8;
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t *sQ = smem, *sK = smem + S::Q_BYTES, *sV = sK + 2 * S::K_BYTES;
    int bh = blockIdx.y, qb = blockIdx.x, nblk = gridDim.x;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, mi = lane / 8;
    size_t npad = (size_t)nblk * BN;
    const uint8_t *q8 = (const uint8_t *)qv.q8 + (size_t)bh * N * D;
    const uint8_t *k8 = (const uint8_t *)qv.k8 + (size_t)bh * N * D;
    const uint8_t *vt = (const uint8_t *)qv.v_t + (size_t)bh * D * npad * ELT;
    const float q_scale = qv.q_scale[(size_t)bh * nblk + qb];
    const float *k_scale = qv.k_scale + (size_t)bh * nblk;

    load_rows<D, S::QK_STRIDE>(sQ, q8 + (size_t)qb * BN * D, D, BN, N - qb * BN);
    load_rows<D, S::QK_STRIDE>(sK, k8, D, BN, N);
    load_rows<BN * ELT, S::V_STRIDE>(sV, vt, npad * ELT, D, D);
    cp_async_commit();

    uint32_t qf[D / 32][4];
    float o[NT][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    for (int kb = 0; kb < nblk; kb++) {
        if (kb + 1 < nblk) {
            int nb = (kb + 1) & 1;
            load_rows<D, S::QK_STRIDE>(sK + nb * S::K_BYTES, k8 + (size_t)(kb + 1) * BN * D, D, BN,
                                       N - (kb + 1) * BN);
            load_rows<BN * ELT, S::V_STRIDE>(sV + nb * S::V_BYTES, vt + (size_t)(kb + 1) * BN * ELT,
                                             npad * ELT, D, D);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint8_t *sKb = sK + (kb & 1) * S::K_BYTES, *sVb = sV + (kb & 1) * S::V_BYTES;
        if (kb == 0)
            for (int ks = 0; ks < D / 32; ks++)
                ldmatrix_x4(qf[ks], sQ + (warp * 16 + (mi % 2) * 8 + lane % 8) * S::QK_STRIDE +
                                        ks * 32 + (mi / 2) * 16);

        // S = Q8·K8ᵀ for this warp's 16 rows × 64 keys
        int acc[8][4] = {};
        for (int ks = 0; ks < D / 32; ks++)
            for (int np = 0; np < 4; np++) {
                uint32_t b[4];
                ldmatrix_x4(b, sKb + (np * 16 + (mi / 2) * 8 + lane % 8) * S::QK_STRIDE + ks * 32 +
                                   (mi % 2) * 16);
                mma_s8(acc[2 * np], qf[ks], b[0], b[1]);
                mma_s8(acc[2 * np + 1], qf[ks], b[2], b[3]);
            }

        // online softmax: thread holds rows g (e = 0, 1) and g + 8 (e = 2, 3)
        float scale = __fmul_rn(q_scale, k_scale[kb]);
        float p[8][4], mx[2] = {-INFINITY, -INFINITY};
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++) {
                int key = kb * BN + 8 * j + 2 * c + (e & 1);
                p[j][e] = key < N ? __fmul_rn((float)acc[j][e], scale) : -INFINITY;
                mx[e / 2] = fmaxf(mx[e / 2], p[j][e]);
            }
        float alpha[2];
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            float m_new = fmaxf(m[r], mx[r]);
            alpha[r] = exp2f(m[r] - m_new);
            m[r] = m_new;
            l[r] *= alpha[r];
        }
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++) {
                p[j][e] = exp2f(p[j][e] - m[e / 2]);
                l[e / 2] += p[j][e];
            }

        if (FP8) {
            float blk[NT][4] = {};
            for (int t = 0; t < 2; t++) {   // 32 keys per e4m3 mma
                uint32_t a[4];
                for (int h = 0; h < 2; h++) {   // a0/a1: ntiles 4t, 4t+1; a2/a3: 4t+2, 4t+3
                    int j = 4 * t + 2 * h;
                    a[2 * h] = pack_e4m3x2(p[j][0] * 448.0f, p[j][1] * 448.0f) |
                               (uint32_t)pack_e4m3x2(p[j + 1][0] * 448.0f, p[j + 1][1] * 448.0f) << 16;
                    a[2 * h + 1] = pack_e4m3x2(p[j][2] * 448.0f, p[j][3] * 448.0f) |
                                   (uint32_t)pack_e4m3x2(p[j + 1][2] * 448.0f, p[j + 1][3] * 448.0f) << 16;
                }
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t b[4];
                    ldmatrix_x4(b, sVb + (np * 16 + (mi / 2) * 8 + lane % 8) * S::V_STRIDE + t * 32 +
                                       (mi % 2) * 16);
                    mma_e4m3(blk[2 * np], a, b[0], b[1]);
                    mma_e4m3(blk[2 * np + 1], a, b[2], b[3]);
                }
            }
            for (int j = 0; j < NT; j++)
                for (int e = 0; e < 4; e++) o[j][e] = o[j][e] * alpha[e / 2] + blk[j][e];
        } else {
            for (int j = 0; j < NT; j++)
                for (int e = 0; e < 4; e++) o[j][e] *= alpha[e / 2];
            for (int t = 0; t < 4; t++) {   // 16 keys per f16 mma
                uint32_t a[4] = {pack_half2(p[2 * t][0], p[2 * t][1]), pack_half2(p[2 * t][2], p[2 * t][3]),
                                 pack_half2(p[2 * t + 1][0], p[2 * t + 1][1]),
                                 pack_half2(p[2 * t + 1][2], p[2 * t + 1][3])};
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t b[4];
                    ldmatrix_x4(b, sVb + (np * 16 + (mi / 2) * 8 + lane % 8) * S::V_STRIDE + t * 32 +
                                       (mi % 2) * 16);
                    mma_f16(o[2 * np], a, b[0], b[1]);
                    mma_f16(o[2 * np + 1], a, b[2], b[3]);
                }
            }
        }
        __syncthreads();
    }

    const float *vs = qv.v_scale + (size_t)bh * D;
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        int row = qb * BN + warp * 16 + g + 8 * r;
        if (row >= N) continue;
        __nv_bfloat16 *orow = out + attn_row_offset(bh, row, N, D, merged_heads);
        for (int j = 0; j < NT; j++) {
            int col = 8 * j + 2 * c;
            float x0 = o[j][2 * r], x1 = o[j][2 * r + 1];
            if (FP8) {
                x0 = __fdiv_rn(__fmul_rn(x0, vs[col]), 448.0f);
                x1 = __fdiv_rn(__fmul_rn(x1, vs[col + 1]), 448.0f);
            }
            *(__nv_bfloat162 *)(orow + col) = __floats2bfloat162_rn(__fdiv_rn(x0, l[r]), __fdiv_rn(x1, l[r]));
        }
        if (c == 0) lse[(size_t)bh * N + row] = m[r] + log2f(l[r]);
    }
}

template <int D, bool FP8>
static int launch_forward(uint16_t *out, float *lse, const SageCudaQuant *qv, int BH, int N, int merged_heads,
                          cudaStream_t stream, char *err) {
    int bytes = FwdSmem<D, FP8>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(sage_forward_kernel<D, FP8>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                    err, "cudaFuncSetAttribute(sage_forward_kernel max dynamic smem)");
    dim3 grid((N + SAGE_CUDA_BLOCK - 1) / SAGE_CUDA_BLOCK, BH);
    sage_forward_kernel<D, FP8><<<grid, FWD_THREADS, bytes, stream>>>((__nv_bfloat16 *)out, lse, *qv, N,
                                                                                      merged_heads);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_forward_kernel");
    return 0;
}

// FP8 P·V needs compute capability 8.9+ on the current device.
static int check_fp8_capability(const char *fn, char *err) {
    int dev, major, minor;
    SAGE_CUDA_CHECK(cudaGetDevice(&dev), err, "cudaGetDevice");
    SAGE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), err,
                    "cudaDeviceGetAttribute(major)");
    SAGE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), err,
                    "cudaDeviceGetAttribute(minor)");
    if (major * 10 + minor < 89) {
        dit_set_error(err, "%s: FP8 P·V needs compute capability 8.9+ (device %d is %d.%d); "
                           "use SAGE_PV_FP16", fn, dev, major, minor);
        return -1;
    }
    return 0;
}

// The shape and P·V precision every sage forward needs (before any device query).
static int check_forward_shape(const char *fn, int B, int H, int N, int D, SagePV pv, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535) {
        dit_set_error(err, "%s: need D in {64, 128}, B, H, N >= 1 and B·H <= 65535 (got B=%d H=%d N=%d D=%d)", fn,
                      B, H, N, D);
        return -1;
    }
    if (pv != SAGE_PV_FP8 && pv != SAGE_PV_FP16) {
        dit_set_error(err, "%s: pv must be SAGE_PV_FP8 or SAGE_PV_FP16 (got pv=%d)", fn, (int)pv);
        return -1;
    }
    return 0;
}

// The mma.sync forward over the quantized tensors of `workspace`; out's rows as attn_row_offset
// places them.
static int launch_forward_quantized(uint16_t *out, float *lse, const void *workspace, int B, int H, int N,
                                    int D, SagePV pv, int merged_heads, cudaStream_t stream, char *err) {
    SageCudaQuant qv = sage_cuda_quant_view((void *)workspace, B, H, N, D, pv);
    int BH = B * H, mh = merged_heads;
    if (D == 64) return pv == SAGE_PV_FP8 ? launch_forward<64, true>(out, lse, &qv, BH, N, mh, stream, err)
                                          : launch_forward<64, false>(out, lse, &qv, BH, N, mh, stream, err);
    return pv == SAGE_PV_FP8 ? launch_forward<128, true>(out, lse, &qv, BH, N, mh, stream, err)
                             : launch_forward<128, false>(out, lse, &qv, BH, N, mh, stream, err);
}

// sage_forward_cuda (merged_heads 0) and sage_forward_merged_cuda (merged_heads H).
static int forward(const char *fn, uint16_t *out, float *lse, void *workspace, const uint16_t *q, const uint16_t *k,
                   const uint16_t *v, int B, int H, int N, int D, SagePV pv, int merged_heads, cudaStream_t stream,
                   char *err) {
    if (check_forward_shape(fn, B, H, N, D, pv, err) != 0) return -1;
    CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(out, 16), DEVICE_ARG(lse, 4), DEVICE_ARG(workspace, 16),
                      DEVICE_ARG(q, 16), DEVICE_ARG(k, 16), DEVICE_ARG(v, 16));
    // Hopper: the wgmma kernel (sage_forward_sm90.cu, FP8 and FP16); DIT_SAGE_MMA_SYNC=1 keeps this
    // one.
    if (sage_forward_sm90_takes(pv, D) && !getenv("DIT_SAGE_MMA_SYNC") && sage_forward_sm90_available())
        return sage_forward_sm90_rows(out, lse, workspace, q, k, v, B, H, N, D, pv, merged_heads, stream, err);
    if (pv == SAGE_PV_FP8 && check_fp8_capability(fn, err) != 0) return -1;
    if (sage_quantize_cuda(workspace, q, k, v, B, H, N, D, pv, stream, err) != 0) return -1;
    return launch_forward_quantized(out, lse, workspace, B, H, N, D, pv, merged_heads, stream, err);
}

extern "C" int sage_forward_cuda(uint16_t *out, float *lse, void *workspace,
                                 const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                 int B, int H, int N, int D, SagePV pv, cudaStream_t stream, char *err) {
    return forward("sage_forward_cuda", out, lse, workspace, q, k, v, B, H, N, D, pv, 0, stream, err);
}

extern "C" int sage_forward_merged_cuda(uint16_t *out, float *lse, void *workspace,
                                        const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                        int B, int H, int N, int D, SagePV pv, cudaStream_t stream, char *err) {
    return forward("sage_forward_merged_cuda", out, lse, workspace, q, k, v, B, H, N, D, pv, H, stream, err);
}

// sage_forward_quantized_cuda (merged_heads 0) and sage_forward_quantized_merged_cuda (merged_heads H).
static int forward_quantized(const char *fn, uint16_t *out, float *lse, const void *workspace, int B, int H, int N,
                             int D, SagePV pv, int merged_heads, cudaStream_t stream, char *err) {
    if (check_forward_shape(fn, B, H, N, D, pv, err) != 0) return -1;
    CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(out, 16), DEVICE_ARG(lse, 4), DEVICE_ARG(workspace, 16));
    if (sage_forward_sm90_takes(pv, D) && !getenv("DIT_SAGE_MMA_SYNC") && sage_forward_sm90_available())
        return sage_forward_sm90_quantized_rows(out, lse, workspace, B, H, N, D, pv, merged_heads, stream, err);
    if (pv == SAGE_PV_FP8 && check_fp8_capability(fn, err) != 0) return -1;
    return launch_forward_quantized(out, lse, workspace, B, H, N, D, pv, merged_heads, stream, err);
}

extern "C" int sage_forward_quantized_cuda(uint16_t *out, float *lse, const void *workspace, int B, int H, int N,
                                           int D, SagePV pv, cudaStream_t stream, char *err) {
    return forward_quantized("sage_forward_quantized_cuda", out, lse, workspace, B, H, N, D, pv, 0, stream, err);
}

extern "C" int sage_forward_quantized_merged_cuda(uint16_t *out, float *lse, const void *workspace, int B, int H,
                                                  int N, int D, SagePV pv, cudaStream_t stream, char *err) {
    return forward_quantized("sage_forward_quantized_merged_cuda", out, lse, workspace, B, H, N, D, pv, H, stream,
                             err);
}
