// Sage attention recompute backward: the API of sage_cuda.h over the backward shared with bf16
// flash attention (attention/attention_backward.cuh, SCORES_SAGE: Sᵀ recomputed with the int8 mma
// from the forward's q8, k8 and scales, as the forward; dQ from k - k_mean). delta = rowsum(dO∘O)
// from the bf16 O (computed here, with dq = 0) unless the caller passes it.
#include <stdio.h>
#include "attention/sage_cuda.h"
#include "attention/attention_backward.cuh"
#include "attention/attention_rows.cuh"
#include "layers/cuda_args.h"

static int sage_deterministic = 0;   // sage_backward_set_deterministic

extern "C" int sage_backward_set_deterministic(int on) {
    int before = sage_deterministic;
    sage_deterministic = on != 0;
    return before;
}

extern "C" int sage_backward_deterministic(void) { return sage_deterministic; }

extern "C" size_t sage_cuda_backward_workspace_size(int B, int H, int N, int D) {
    (void)D;
    return attention_backward_workspace_bytes(B, H, N);
}

// sage_backward_cuda (merged_heads 0, fp32 dk, dv) and sage_backward_merged_cuda (merged_heads H, kv_rows).
static int backward(const char *fn, float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                    const uint16_t *dout, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                    const uint16_t *out, const float *lse, const float *delta, int B, int H, int N, int D, SagePV pv,
                    int merged_heads, const AttnKvRows *kv_rows, cudaStream_t stream, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535) {
        dit_set_error(err, "%s: need D in {64, 128}, B, H, N >= 1, B·H <= 65535 (got B=%d H=%d N=%d D=%d)", fn, B,
                      H, N, D);
        return -1;
    }
    CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(dq, 16), DEVICE_ARG(fwd_workspace, 16),
                      DEVICE_ARG(dout, 16), DEVICE_ARG(q, 16), DEVICE_ARG(k, 16), DEVICE_ARG(v, 16),
                      DEVICE_ARG(lse, 4));
    if (check_kv_out(fn, dk, dv, kv_rows, H, D, err)) return -1;
    CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(workspace, 4));
    if (delta) CHECK_DEVICE_ARGS(fn, err, DEVICE_ARG(delta, 4));
    else {
        char what[96];
        snprintf(what, sizeof what, "%s (delta = NULL: computed from out)", fn);
        CHECK_DEVICE_ARGS(what, err, DEVICE_ARG(out, 16));
    }
    // Hopper: the wgmma kernel (sage_backward_sm90.cu); DIT_SAGE_MMA_SYNC=1 keeps this one.
    if (!getenv("DIT_SAGE_MMA_SYNC") && (long long)B * H * N < (1ll << 31) &&
        sage_backward_sm90_available())
        return sage_backward_sm90_rows(dq, dk, dv, workspace, fwd_workspace, dout, q, k, v, out, lse, delta, B, H, N,
                                       D, pv, merged_heads, kv_rows, stream, err);
    AttnBwdArgs a = {dq, dk, dv, (const __nv_bfloat16 *)dout, (const __nv_bfloat16 *)q, (const __nv_bfloat16 *)k,
                     (const __nv_bfloat16 *)v, lse, delta,
                     sage_cuda_quant_view((void *)fwd_workspace, B, H, N, D, pv), N, merged_heads, NULL};
    set_kv_rows(&a, kv_rows, D);
    if (attention_backward_prepare(&a, workspace, out, B * H, D, sage_deterministic, stream, err) != 0) return -1;
    if (D == 64) return launch_attention_backward<64, SCORES_SAGE>(a, B * H, stream, err);
    return launch_attention_backward<128, SCORES_SAGE>(a, B * H, stream, err);
}

extern "C" int sage_backward_cuda(float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                                  const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                                  const uint16_t *v, const uint16_t *out, const float *lse,
                                  const float *delta, int B, int H, int N, int D, SagePV pv,
                                  cudaStream_t stream, char *err) {
    return backward("sage_backward_cuda", dq, dk, dv, workspace, fwd_workspace, dout, q, k, v, out, lse, delta, B, H,
                    N, D, pv, 0, NULL, stream, err);
}

extern "C" int sage_backward_merged_cuda(float *dq, uint16_t *dk, uint16_t *dv, size_t row_stride, int hadamard_dk,
                                         float *amax, void *workspace, const void *fwd_workspace, const uint16_t *dout,
                                         const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                         const uint16_t *out, const float *lse, const float *delta, int B, int H,
                                         int N, int D, SagePV pv, cudaStream_t stream, char *err) {
    AttnKvRows rows = {dk, dv, row_stride, hadamard_dk, amax};
    return backward("sage_backward_merged_cuda", dq, NULL, NULL, workspace, fwd_workspace, dout, q, k, v, out, lse,
                    delta, B, H, N, D, pv, H, &rows, stream, err);
}
