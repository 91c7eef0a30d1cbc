// Sage attention forward for Hopper (sm_90a): wgmma tensor-core instructions fed by TMA tile loads.
// Same math as the mma.sync kernel of sage_forward.cu in FP8 mode (q_block = k_block = 64, so the
// CPU definition with its defaults is the reference); it exists because on Hopper the e4m3
// mma.sync is emulated through f16 HMMA and only wgmma runs 8-bit operands at the 8-bit rate.
//
// One CTA = one warpgroup (128 threads) per (64-query block, head); several CTAs share an SM and
// overlap each other's softmax with their tensor-core work. Thread 0 drives the TMA unit: Q once,
// then K̂ and V̂ tiles of 64 keys through SM90_STAGES shared-memory stages, each completing on its
// own mbarrier. Per key block kb:
//   S = Q8·K8ᵀ     wgmma m64n64k32 s8 (Q and K from shared memory), int32 accumulators
//   online softmax in base 2 over the 64-key step of the definition (softmax_fused): row max on the
//        int32 S, p' = exp2(S·q_scale·k_scale − m + log2 448) = 448·p by one FFMA and one ex2
//   P8 = e4m3(p') packed in registers straight from the S accumulators: the quantization pass
//        stores V̂ᵀ with the tokens of each group of 16 in the A-fragment order (sage_cuda.h)
//   blk = P8·V8     wgmma m64nDk32 e4m3, A from registers, V̂ᵀ (K-major) from shared memory
//   O = O·alpha + blk   (the definition's two-level fp32 accumulation)
// then thread 0 refills the stage with key block kb + SM90_STAGES. Finally out = O·v_scale/l'
// and lse = m + log2(l') − log2 448, with l' = Σ p' = 448·l.
#include <limits.h>
#include "attention/sage_cuda.h"
#include "attention/sage_mma.cuh"
#include "attention/wgmma.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

#define SM90_THREADS 128   // one warpgroup: 64 query rows
#define SM90_STAGES 3      // K̂/V̂ tiles in flight

// Shared memory of one CTA; every tile is a whole number of 1024-byte swizzle atoms.
template <int D> struct Sm90Smem {
    static constexpr int Q_BYTES = SAGE_CUDA_BLOCK * D;    // 64 queries × D int8, rows of D bytes
    static constexpr int K_BYTES = SAGE_CUDA_BLOCK * D;    // 64 keys × D int8
    static constexpr int V_BYTES = D * SAGE_CUDA_BLOCK;    // D channels × 64 keys e4m3, rows of 64 bytes
    static constexpr int STAGE_BYTES = K_BYTES + V_BYTES;
    static constexpr int TOTAL = 1024 + Q_BYTES + SM90_STAGES * STAGE_BYTES;   // + alignment slack
};

#ifdef SAGE_SM90_DEVICE
// blk (=|+=) a·V for one k32 step; D/2 accumulator registers.
template <int D, int scale_d>
__device__ __forceinline__ void pv_wgmma(float (&blk)[D / 2], const uint32_t a[4], uint64_t desc_v) {
    if constexpr (D == 128) wgmma_e4m3_m64n128k32<scale_d>(blk, a, desc_v);
    else wgmma_e4m3_m64n64k32<scale_d>(blk, a, desc_v);
}

#define LOG2_448 8.807354922057604f

// Online softmax of one 64 × 64 block (this thread holds keys 8j + 2c + (e & 1) of rows g (e < 2)
// and g + 8 (e >= 2) in s[4j + e]), then P8 packed into the two k32 A fragments: a[t][2h] row g,
// a[t][2h + 1] row g + 8, key chunks 4t+2h, 4t+2h+1. Few instructions per element (the kernel is
// issue-bound; the definition's order of operations cost ~12 per element, this ~7.5 at D = 128):
// the row max is taken on the int32 S (rn is monotonic and scale >= 0, so rn(max S · scale) is
// the definition's max, bit for bit), and p' = exp2(S·scale − (m − log2 448)) = 448·p comes from
// one FFMA and one ex2 per element, so P8 = e4m3(p') needs no ×448 and l' = Σ p' = 448·l (the
// epilogue divides by l' and subtracts log2 448 from the lse). Differences from the definition:
// S·scale − m rounded once instead of twice (~1e-7 relative in p). Keys >= N are handled only in
// the tail block (`valid` < 64): S = INT_MIN there for the max, p' = 0 after the exp2.
__device__ __forceinline__ void softmax_fused(uint32_t (&a)[2][4], float (&alpha)[2], float (&m)[2], float (&l)[2],
                                              int (&s)[32], float scale, int valid, int c) {
    if (valid < SAGE_CUDA_BLOCK) {
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (8 * (i / 4) + 2 * c + (i & 1) >= valid) s[i] = INT_MIN;
    }
    int smax[2] = {INT_MIN, INT_MIN};
#pragma unroll
    for (int i = 0; i < 32; i++) smax[(i % 4) / 2] = max(smax[(i % 4) / 2], s[i]);
    float offset[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        smax[r] = max(smax[r], __shfl_xor_sync(0xffffffffu, smax[r], 1));
        smax[r] = max(smax[r], __shfl_xor_sync(0xffffffffu, smax[r], 2));
        float m_new = fmaxf(m[r], __fmul_rn((float)smax[r], scale));
        alpha[r] = exp2f(m[r] - m_new);
        m[r] = m_new;
        l[r] *= alpha[r];
        offset[r] = LOG2_448 - m_new;
    }
    float p[32];
#pragma unroll
    for (int i = 0; i < 32; i++) p[i] = exp2f(fmaf((float)s[i], scale, offset[(i % 4) / 2]));
    if (valid < SAGE_CUDA_BLOCK) {
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (8 * (i / 4) + 2 * c + (i & 1) >= valid) p[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 32; i++) l[(i % 4) / 2] += p[i];
#pragma unroll
    for (int t = 0; t < 2; t++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float *p0 = p + 4 * (4 * t + 2 * h), *p1 = p0 + 4;
            a[t][2 * h] = pack_e4m3x2(p0[0], p0[1]) | (uint32_t)pack_e4m3x2(p1[0], p1[1]) << 16;
            a[t][2 * h + 1] = pack_e4m3x2(p0[2], p0[3]) | (uint32_t)pack_e4m3x2(p1[2], p1[3]) << 16;
        }
}

// Thread 0: key block `tile` of K̂ (rows of D bytes) and V̂ᵀ (rows of 64 bytes) into `stage`.
template <int D>
__device__ __forceinline__ void load_kv(uint8_t *sK, uint8_t *sV, uint64_t *bar, const CUtensorMap *map_k,
                                        const CUtensorMap *map_v, int bh, int N, int tile) {
    using S = Sm90Smem<D>;
    mbar_expect_bytes(bar, S::STAGE_BYTES);
    tma_load_2d(sK, map_k, bar, 0, bh * N + tile * SAGE_CUDA_BLOCK);
    tma_load_2d(sV, map_v, bar, tile * SAGE_CUDA_BLOCK, bh * D);
}
#endif

// map_q, map_k: q8, k8 as 2-D (D inner, B·H·N outer), box D × 64; map_v: v_t as (n_pad inner,
// B·H·D outer), box 64 × D. Grid (ceil(N/64), B·H), SM90_THREADS threads, Sm90Smem<D>::TOTAL bytes.
template <int D>
__global__ void __launch_bounds__(SM90_THREADS, 2)
    sage_forward_sm90_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                             const __grid_constant__ CUtensorMap map_v, __nv_bfloat16 *out, float *lse,
                             SageCudaQuant qv, int N) {
#ifdef SAGE_SM90_DEVICE
    using S = Sm90Smem<D>;
    constexpr int BN = SAGE_CUDA_BLOCK;
    extern __shared__ uint8_t smem_raw[];
    __shared__ uint64_t bar_q, bar_kv[SM90_STAGES];
    uint8_t *sQ = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t *sK = sQ + S::Q_BYTES, *sV = sK + SM90_STAGES * S::K_BYTES;
    int bh = blockIdx.y, qb = blockIdx.x, nblk = gridDim.x, tid = threadIdx.x;
    int warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;

    if (tid == 0) {
        mbar_init(&bar_q, 1);
        for (int s = 0; s < SM90_STAGES; s++) mbar_init(&bar_kv[s], 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0) {
        mbar_expect_bytes(&bar_q, S::Q_BYTES);
        tma_load_2d(sQ, &map_q, &bar_q, 0, bh * N + qb * BN);
        for (int s = 0; s < SM90_STAGES && s < nblk; s++)
            load_kv<D>(sK + s * S::K_BYTES, sV + s * S::V_BYTES, &bar_kv[s], &map_k, &map_v, bh, N, s);
    }

    const float q_scale = qv.q_scale[(size_t)bh * nblk + qb];
    const float *k_scale = qv.k_scale + (size_t)bh * nblk;
    float o[D / 2] = {}, blk[D / 2] = {};   // accumulator layout of m64nD (wgmma.cuh)
    int s_acc[32] = {};                     // accumulator layout of m64n64
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};   // rows g and g + 8 of this warp
    mbar_wait(&bar_q, 0);
    const uint64_t desc_q = smem_desc<D>(sQ);

    for (int kb = 0; kb < nblk; kb++) {
        int stage = kb % SM90_STAGES;
        mbar_wait(&bar_kv[stage], (kb / SM90_STAGES) & 1);
        const uint64_t desc_k = smem_desc<D>(sK + stage * S::K_BYTES);
        const uint64_t desc_v = smem_desc<BN>(sV + stage * S::V_BYTES);

        // S = Q8·K8ᵀ: 64 × 64, D/32 steps of k32
        wgmma_fence();
        wgmma_s8_m64n64k32<0>(s_acc, desc_q, desc_k);
#pragma unroll
        for (int ks = 1; ks < D / 32; ks++)
            wgmma_s8_m64n64k32<1>(s_acc, desc_advance(desc_q, 32 * ks), desc_advance(desc_k, 32 * ks));
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(s_acc);

        float alpha[2];
        uint32_t a[2][4];   // P8 as two k32 A fragments
        softmax_fused(a, alpha, m, l, s_acc, __fmul_rn(q_scale, k_scale[kb]), N - kb * BN, c);

        // blk = P8·V8 over the block's 64 keys, then the two-level accumulation
        wgmma_fence();
        pv_wgmma<D, 0>(blk, a[0], desc_v);
        pv_wgmma<D, 1>(blk, a[1], desc_advance(desc_v, 32));
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(blk);
        reg_fence(a[0]);
        reg_fence(a[1]);
        if (tid == 0 && kb + SM90_STAGES < nblk)   // the stage is free: both wgmma batches completed
            load_kv<D>(sK + stage * S::K_BYTES, sV + stage * S::V_BYTES, &bar_kv[stage], &map_k, &map_v, bh,
                       N, kb + SM90_STAGES);
#pragma unroll
        for (int i = 0; i < D / 2; i++) o[i] = o[i] * alpha[(i % 4) / 2] + blk[i];
    }

    const float *vs = qv.v_scale + (size_t)bh * D;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        int row = qb * BN + warp * 16 + g + 8 * r;
        if (row >= N) continue;
        __nv_bfloat16 *orow = out + ((size_t)bh * N + row) * D;
        // o = 448·Σ p·v̂ and l = 448·Σ p: out = o·v_scale/l
        float inv_l = 1.0f / l[r];
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            int col = 8 * j + 2 * c;
            *(__nv_bfloat162 *)(orow + col) = __floats2bfloat162_rn(o[4 * j + 2 * r] * vs[col] * inv_l,
                                                                    o[4 * j + 2 * r + 1] * vs[col + 1] * inv_l);
        }
        if (c == 0) lse[(size_t)bh * N + row] = m[r] + (log2f(l[r]) - LOG2_448);
    }
#else
    __trap();   // built without sm_90a code: sage_forward_sm90_available() says 0
#endif
}

extern "C" int sage_forward_sm90_available(void) {
    return sm90_kernel_available((const void *)sage_forward_sm90_kernel<128>);
}

template <int D>
static int launch_sm90(uint16_t *out, float *lse, const SageCudaQuant *qv, int BH, int N, cudaStream_t stream,
                       char *err) {
    int nblk = (N + SAGE_CUDA_BLOCK - 1) / SAGE_CUDA_BLOCK;
    uint64_t npad = (uint64_t)nblk * SAGE_CUDA_BLOCK, rows = (uint64_t)BH * N;
    CUtensorMap map_q, map_k, map_v;
    if (tma_map_2d_bytes(&map_q, qv->q8, D, rows, D, SAGE_CUDA_BLOCK, "sage_forward_sm90 q8", err) ||
        tma_map_2d_bytes(&map_k, qv->k8, D, rows, D, SAGE_CUDA_BLOCK, "sage_forward_sm90 k8", err) ||
        tma_map_2d_bytes(&map_v, qv->v_t, npad, (uint64_t)BH * D, SAGE_CUDA_BLOCK, D, "sage_forward_sm90 v_t", err))
        return -1;
    int bytes = Sm90Smem<D>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(sage_forward_sm90_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         bytes),
                    err, "cudaFuncSetAttribute(sage_forward_sm90_kernel max dynamic smem)");
    dim3 grid(nblk, BH);
    sage_forward_sm90_kernel<D><<<grid, SM90_THREADS, bytes, stream>>>(map_q, map_k, map_v,
                                                                              (__nv_bfloat16 *)out, lse, *qv, N);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_forward_sm90_kernel");
    return 0;
}

extern "C" int sage_forward_sm90_cuda(uint16_t *out, float *lse, void *workspace, const uint16_t *q,
                                      const uint16_t *k, const uint16_t *v, int B, int H, int N, int D,
                                      cudaStream_t stream, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535) {
        dit_set_error(err, "sage_forward_sm90_cuda: need D in {64, 128}, B, H, N >= 1 and B·H <= 65535 "
                           "(got B=%d H=%d N=%d D=%d)", B, H, N, D);
        return -1;
    }
    CHECK_DEVICE_ARGS("sage_forward_sm90_cuda", err, DEVICE_ARG(out, 16), DEVICE_ARG(lse, 4),
                      DEVICE_ARG(workspace, 16), DEVICE_ARG(q, 16), DEVICE_ARG(k, 16), DEVICE_ARG(v, 16));
    if (!sage_forward_sm90_available()) {
        dit_set_error(err, "sage_forward_sm90_cuda: needs a compute capability 9.0 device and a build with "
                           "sm_90a code (-gencode=arch=compute_90a,code=sm_90a)");
        return -1;
    }
    if (sage_quantize_cuda(workspace, q, k, v, B, H, N, D, SAGE_PV_FP8, stream, err) != 0) return -1;
    SageCudaQuant qv = sage_cuda_quant_view(workspace, B, H, N, D, SAGE_PV_FP8);
    return D == 64 ? launch_sm90<64>(out, lse, &qv, B * H, N, stream, err)
                   : launch_sm90<128>(out, lse, &qv, B * H, N, stream, err);
}

extern "C" int sage_forward_sm90_quantized_cuda(uint16_t *out, float *lse, const void *workspace, int B, int H,
                                                int N, int D, cudaStream_t stream, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535) {
        dit_set_error(err, "sage_forward_sm90_quantized_cuda: need D in {64, 128}, B, H, N >= 1 and "
                           "B·H <= 65535 (got B=%d H=%d N=%d D=%d)", B, H, N, D);
        return -1;
    }
    CHECK_DEVICE_ARGS("sage_forward_sm90_quantized_cuda", err, DEVICE_ARG(out, 16), DEVICE_ARG(lse, 4),
                      DEVICE_ARG(workspace, 16));
    if (!sage_forward_sm90_available()) {
        dit_set_error(err, "sage_forward_sm90_quantized_cuda: needs a compute capability 9.0 device and a build "
                           "with sm_90a code (-gencode=arch=compute_90a,code=sm_90a)");
        return -1;
    }
    SageCudaQuant qv = sage_cuda_quant_view((void *)workspace, B, H, N, D, SAGE_PV_FP8);
    return D == 64 ? launch_sm90<64>(out, lse, &qv, B * H, N, stream, err)
                   : launch_sm90<128>(out, lse, &qv, B * H, N, stream, err);
}
