// Where the rows of out and dout live. Every attention kernel here reads q, k, v as (B, H, N, D);
// out (written by the forwards, read by the backwards' delta = rowsum(dO∘O)) and dout come in one of
// two layouts: head-major (B, H, N, D) like q, k, v, or merged (B, N, H, D), the (B·N, H·D)
// activations of the projection after the attention (the *_merged_cuda calls), which saves the
// head merge of out and the head split of dout. merged_heads: 0 for head-major, H for merged.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include "attention/attention.h"

// The element offset of row t (D values) of head bh = b·H + h.
__host__ __device__ __forceinline__ size_t attn_row_offset(int bh, int t, int N, int D, int merged_heads) {
    if (!merged_heads) return ((size_t)bh * N + t) * D;
    int b = bh / merged_heads, h = bh % merged_heads;
    return (((size_t)b * N + t) * merged_heads + h) * D;
}

// Elements between consecutive rows t, t + 1 of one head.
__host__ __device__ __forceinline__ size_t attn_row_stride(int D, int merged_heads) {
    return merged_heads ? (size_t)merged_heads * D : (size_t)D;
}

// dK and dV as bf16 rows of a token-major tensor (the merged backward calls, sage_cuda.h): dK of key
// t of head h of batch b at dk + (b·N + t)·row_stride + h·D, dV likewise at dv; dK multiplied by the
// normalized Hadamard matrix first when hadamard_dk; max |dK|, |dV| raised into *amax (may be NULL).
typedef struct {
    uint16_t *dk, *dv;
    size_t row_stride;
    int hadamard_dk;
    float *amax;
} AttnKvRows;

// The calls behind the public entry points, with the layout of out (and dout) as an argument
// (the public ones pass 0, the *_merged_cuda ones H) and, for the backwards, where dK and dV go
// (NULL: fp32 dk, dv; the merged calls: their AttnKvRows). Arguments and checks as in sage_cuda.h and
// flash_cuda.h.
// The Hopper sage forward computes both P·V modes (FP8, FP16) at both head dims (64, 128).
static inline int sage_forward_sm90_takes(SagePV pv, int D) {
    return (pv == SAGE_PV_FP8 || pv == SAGE_PV_FP16) && (D == 64 || D == 128);
}
int sage_forward_sm90_rows(uint16_t *out, float *lse, void *workspace, const uint16_t *q, const uint16_t *k,
                           const uint16_t *v, int B, int H, int N, int D, SagePV pv, int merged_heads,
                           cudaStream_t stream, char *err);
int sage_forward_sm90_quantized_rows(uint16_t *out, float *lse, const void *workspace, int B, int H, int N, int D,
                                     SagePV pv, int merged_heads, cudaStream_t stream, char *err);
int sage_backward_sm90_rows(float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                            const uint16_t *dout, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                            const uint16_t *out, const float *lse, const float *delta, int B, int H, int N, int D,
                            SagePV pv, int merged_heads, const AttnKvRows *kv_rows, cudaStream_t stream, char *err);
int flash_forward_sm90_rows(uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                            int B, int H, int N, int D, int merged_heads, cudaStream_t stream, char *err);
int flash_backward_sm90_rows(float *dq, float *dk, float *dv, void *workspace, const uint16_t *dout,
                             const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                             const float *lse, int B, int H, int N, int D, int merged_heads,
                             const AttnKvRows *kv_rows, cudaStream_t stream, char *err);
