// BF16 flash attention recompute backward for Hopper (sm_90a): the wgmma + TMA kernel of
// attention/backward_sm90.cuh with SCORES_BF16 (Sᵀ = K·Qᵀ from the bf16 K and Q, P = exp2(Sᵀ·c - lse)
// with c = log2(e)/sqrt(D), dQ from K itself), the same math as flash_backward.cu (the readable
// mma.sync kernel, attention_backward.cuh with SCORES_BF16). This file makes its tensor maps and
// launches it; K's map delivers the tile that serves both Sᵀ (K-major) and dQ (MN-major).
#include <limits.h>
#include "attention/flash_cuda.h"
#include "attention/backward_sm90.cuh"
#include "attention/attention_rows.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

extern "C" int flash_backward_sm90_available(void) {
    return sm90_kernel_available((const void *)attention_backward_sm90_kernel<128, SCORES_BF16>);
}

// Tensor maps over a's q, k, v, dout and dq, then the kernel on B·H = BH heads.
template <int D>
static int launch_flash_backward_sm90(const AttnBwdArgs &a, int BH, cudaStream_t stream, char *err) {
    int N = a.N;
    uint64_t rows = (uint64_t)BH * N;
    Bwd90Maps m = {};   // q8 unused
    if (tma_map_2d_bytes(&m.k, a.k, 2 * D, rows, D, BWD90_KEYS, "flash_backward_sm90 k", err) ||
        tma_map_2d_bytes(&m.v, a.v, 2 * D, rows, 128, BWD90_KEYS, "flash_backward_sm90 v", err) ||
        tma_map_2d_bytes(&m.q, a.q, 2 * D, rows, 128, BWD90_QUERIES, "flash_backward_sm90 q", err) ||
        tma_map_head_rows(&m.dout, a.dout, D, N, BH, a.merged_heads, BWD90_QUERIES, "flash_backward_sm90 dout", err) ||
        tma_map_dq(&m.dq, a.dq, D, N, BH, "flash_backward_sm90 dq", err))
        return -1;
    int bytes = Bwd90Smem<D, SCORES_BF16>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(attention_backward_sm90_kernel<D, SCORES_BF16>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                    err, "cudaFuncSetAttribute(attention_backward_sm90_kernel (flash) max dynamic smem)");
    dim3 grid((N + BWD90_KEYS - 1) / BWD90_KEYS, BH);
    attention_backward_sm90_kernel<D, SCORES_BF16><<<grid, BWD90_CTA_THREADS, bytes, stream>>>(m, a);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch attention_backward_sm90_kernel (flash)");
    return 0;
}

int flash_backward_sm90_rows(float *dq, float *dk, float *dv, void *workspace, const uint16_t *dout,
                             const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                             const float *lse, int B, int H, int N, int D, int merged_heads,
                             const AttnKvRows *kv_rows, cudaStream_t stream, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535 ||
        (long long)B * H * N > INT_MAX) {
        dit_set_error(err, "flash_backward_sm90_cuda: need D in {64, 128}, B, H, N >= 1, B·H <= 65535 and "
                           "B·H·N < 2^31 (got B=%d H=%d N=%d D=%d)", B, H, N, D);
        return -1;
    }
    CHECK_DEVICE_ARGS("flash_backward_sm90_cuda", err, DEVICE_ARG(dq, 16), DEVICE_ARG(workspace, 4),
                      DEVICE_ARG(dout, 16), DEVICE_ARG(q, 16), DEVICE_ARG(k, 16), DEVICE_ARG(v, 16),
                      DEVICE_ARG(out, 16), DEVICE_ARG(lse, 4));
    if (check_kv_out("flash_backward_sm90_cuda", dk, dv, kv_rows, H, D, err)) return -1;
    if (!flash_backward_sm90_available()) {
        dit_set_error(err, "flash_backward_sm90_cuda: needs a compute capability 9.0 device and a build with "
                           "sm_90a code (-gencode=arch=compute_90a,code=sm_90a)");
        return -1;
    }
    AttnBwdArgs a = {dq, dk, dv, (const __nv_bfloat16 *)dout, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k,
                     (const __nv_bfloat16 *)v, lse, NULL, {}, N, merged_heads, NULL};
    set_kv_rows(&a, kv_rows, D);
    if (attention_backward_prepare(&a, workspace, out, B * H, D, flash_backward_deterministic(), stream, err) != 0)
        return -1;
    if (D == 64) return launch_flash_backward_sm90<64>(a, B * H, stream, err);
    return launch_flash_backward_sm90<128>(a, B * H, stream, err);
}

extern "C" int flash_backward_sm90_cuda(float *dq, float *dk, float *dv, void *workspace, const uint16_t *dout,
                                        const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                                        const float *lse, int B, int H, int N, int D, cudaStream_t stream, char *err) {
    return flash_backward_sm90_rows(dq, dk, dv, workspace, dout, q, k, v, out, lse, B, H, N, D, 0, NULL, stream, err);
}
