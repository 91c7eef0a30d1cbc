// Sage attention recompute backward for Hopper (sm_90a): the wgmma + TMA kernel of
// attention/backward_sm90.cuh with SCORES_SAGE (Sᵀ from the forward's int8 Q̂, K̂ and scales, dQ from
// k - k_mean), the same math as the mma.sync backward (attention_backward.cuh, the readable
// version). This file makes its tensor maps and launches it.
#include "attention/sage_cuda.h"
#include "attention/backward_sm90.cuh"
#include "attention/attention_rows.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

extern "C" int sage_backward_sm90_available(void) {
    return sm90_kernel_available((const void *)attention_backward_sm90_kernel<128, SCORES_SAGE>);
}

template <int D>
static int launch_backward_sm90(const AttnBwdArgs &a, const uint16_t *dout, const uint16_t *q, const uint16_t *v,
                                int BH, cudaStream_t stream, char *err) {
    int N = a.N;
    uint64_t rows = (uint64_t)BH * N;
    Bwd90Maps m;
    if (tma_map_2d_bytes(&m.k, a.qv.k8, D, rows, D, BWD90_KEYS, "sage_backward_sm90 k8", err) ||
        tma_map_2d_bytes(&m.q8, a.qv.q8, D, rows, D, BWD90_QUERIES, "sage_backward_sm90 q8", err) ||
        tma_map_2d_bytes(&m.v, v, 2 * D, rows, 128, BWD90_KEYS, "sage_backward_sm90 v", err) ||
        tma_map_2d_bytes(&m.q, q, 2 * D, rows, 128, BWD90_QUERIES, "sage_backward_sm90 q", err) ||
        tma_map_head_rows(&m.dout, dout, D, N, BH, a.merged_heads, BWD90_QUERIES, "sage_backward_sm90 dout", err) ||
        tma_map_dq(&m.dq, a.dq, D, N, BH, "sage_backward_sm90 dq", err))
        return -1;
    int bytes = Bwd90Smem<D, SCORES_SAGE>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(attention_backward_sm90_kernel<D, SCORES_SAGE>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                    err, "cudaFuncSetAttribute(attention_backward_sm90_kernel (sage) max dynamic smem)");
    dim3 grid((N + BWD90_KEYS - 1) / BWD90_KEYS, BH);
    attention_backward_sm90_kernel<D, SCORES_SAGE><<<grid, BWD90_CTA_THREADS, bytes, stream>>>(m, a);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch attention_backward_sm90_kernel (sage)");
    return 0;
}

int sage_backward_sm90_rows(float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                            const uint16_t *dout, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                            const uint16_t *out, const float *lse, const float *delta, int B, int H, int N, int D,
                            SagePV pv, int merged_heads, const AttnKvRows *kv_rows, cudaStream_t stream,
                            char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535 ||
        (long long)B * H * N >= (1ll << 31)) {
        dit_set_error(err, "sage_backward_sm90_cuda: need D in {64, 128}, B, H, N >= 1, B·H <= 65535, "
                           "B·H·N < 2^31 (got B=%d H=%d N=%d D=%d)", B, H, N, D);
        return -1;
    }
    CHECK_DEVICE_ARGS("sage_backward_sm90_cuda", err, DEVICE_ARG(dq, 16), DEVICE_ARG(fwd_workspace, 16),
                      DEVICE_ARG(dout, 16), DEVICE_ARG(q, 16), DEVICE_ARG(k, 16), DEVICE_ARG(v, 16),
                      DEVICE_ARG(lse, 4));
    if (check_kv_out("sage_backward_sm90_cuda", dk, dv, kv_rows, H, D, err)) return -1;
    CHECK_DEVICE_ARGS("sage_backward_sm90_cuda", err, DEVICE_ARG(workspace, 4));
    if (delta) CHECK_DEVICE_ARGS("sage_backward_sm90_cuda", err, DEVICE_ARG(delta, 4));
    else CHECK_DEVICE_ARGS("sage_backward_sm90_cuda (delta = NULL: computed from out)", err, DEVICE_ARG(out, 16));
    if (!sage_backward_sm90_available()) {
        dit_set_error(err, "sage_backward_sm90_cuda: needs a compute capability 9.0 device and a build with "
                           "sm_90a code (-gencode=arch=compute_90a,code=sm_90a)");
        return -1;
    }
    AttnBwdArgs a = {dq, dk, dv, (const __nv_bfloat16 *)dout, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k,
                     (const __nv_bfloat16 *)v, lse, delta,
                     sage_cuda_quant_view((void *)fwd_workspace, B, H, N, D, pv), N, merged_heads, NULL};
    set_kv_rows(&a, kv_rows, D);
    if (attention_backward_prepare(&a, workspace, out, B * H, D, sage_backward_deterministic(), stream, err) != 0)
        return -1;
    if (D == 64) return launch_backward_sm90<64>(a, dout, q, v, B * H, stream, err);
    return launch_backward_sm90<128>(a, dout, q, v, B * H, stream, err);
}

extern "C" int sage_backward_sm90_cuda(float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                                       const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                                       const uint16_t *v, const uint16_t *out, const float *lse,
                                       const float *delta, int B, int H, int N, int D, SagePV pv,
                                       cudaStream_t stream, char *err) {
    return sage_backward_sm90_rows(dq, dk, dv, workspace, fwd_workspace, dout, q, k, v, out, lse, delta, B, H, N, D,
                                   pv, 0, NULL, stream, err);
}
