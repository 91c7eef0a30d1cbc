// BF16 flash attention on the GPU (CUDA): the exact-attention baseline (`--attn bf16`) that sage
// attention is measured against. FlashAttention-2 algorithm with mma.sync m16n8k16 bf16 (sm_80+):
// a tiled online-softmax forward that saves O and LSE, and a recompute backward with
// delta = rowsum(dO∘O). The math is attention_forward / attention_backward of attention/attention.h;
// the GPU rounds P (and dS) to bf16 before the tensor-core products and sums in fp32.
//
// Layout: q, k, v, out, dout are (B, H, N, D) contiguous bf16 on the device (passed as the raw
// 16-bit patterns; the *_merged_cuda calls take out and dout as (B, N, H, D));
// lse is (B, H, N) fp32 in BASE 2: lse_i = log2 Σ_j 2^{s_ij} with
// s_ij = q_i·k_j·log2(e)/sqrt(D). D is 64 or 128; any N >= 1 and any B·H. Non-causal.
// q, k, v, out, dout, dq, dk, dv and the workspace must be 16-byte aligned; a NULL or misaligned
// pointer returns -1.
// Every function returns 0, or -1 with a message in err (DIT_ERR_LEN bytes, may be NULL).
// Kernels run on `stream`; nothing synchronizes the host. The forward needs no workspace.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// out = softmax(q·kᵀ/sqrt(D))·v (bf16), lse (fp32, base 2). On Hopper it runs the wgmma kernel
// below (DIT_FLASH_MMA_SYNC=1 in the environment keeps the mma.sync kernel, flash_forward.cu).
int flash_forward_cuda(uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k,
                       const uint16_t *v, int B, int H, int N, int D, cudaStream_t stream, char *err);

// flash_forward_cuda with out in the layout of the projection that reads it, (B, N, H, D) ("merged"
// heads; see sage_forward_merged_cuda). Bitwise the values of flash_forward_cuda, transposed.
int flash_forward_merged_cuda(uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k,
                              const uint16_t *v, int B, int H, int N, int D, cudaStream_t stream, char *err);

// The Hopper forward (attention/flash_forward_sm90.cu): the same math with wgmma fed by TMA
// (B·H·N < 2^31). Available (1) on a compute capability 9.0 device when the build has sm_90a
// machine code; flash_forward_sm90_cuda returns -1 otherwise.
int flash_forward_sm90_available(void);
int flash_forward_sm90_cuda(uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k,
                            const uint16_t *v, int B, int H, int N, int D, cudaStream_t stream, char *err);

// Bytes of the backward workspace: delta = rowsum(dout∘out) ((B,H,N) fp32) and the counters that
// order the dq adds ((B,H,ceil(N/64)) int32).
size_t flash_cuda_backward_workspace_size(int B, int H, int N, int D);

// Recompute backward of flash_forward_cuda: P = exp2(s - lse), delta = rowsum(dout∘out) from the
// bf16 out, dv = Pᵀ·dout, dP = dout·vᵀ, dS = P∘(dP - delta), dq = dS·k/sqrt(D), dk = dSᵀ·q/sqrt(D).
// dq, dk, dv: (B,H,N,D) fp32, OVERWRITTEN (dq is zeroed and accumulated with fp32 atomics).
int flash_backward_cuda(float *dq, float *dk, float *dv, void *workspace, const uint16_t *dout,
                        const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                        const float *lse, int B, int H, int N, int D, cudaStream_t stream, char *err);

// flash_backward_cuda with dout and out in the merged layout (B, N, H, D); dq stays (B, H, N, D)
// fp32, and dk, dv are written as bf16 (16-bit patterns) into rows of a token-major tensor: dK of key
// t of head h of batch b at dk + (b·N + t)·row_stride + h·D, dV at dv + the same (row_stride >=
// H·D, even; e.g. the k and v columns of the qkv projection's input gradient, stride 3·H·D), max
// |dK|, |dV| raised into *amax (NULL: not taken); hadamard_dk as in sage_backward_merged_cuda.
// Bitwise the values of flash_backward_cuda on the transposed dout and out (dk, dv rounded to bf16;
// dq: in deterministic mode).
int flash_backward_merged_cuda(float *dq, uint16_t *dk, uint16_t *dv, size_t row_stride, int hadamard_dk, float *amax,
                               void *workspace, const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                               const uint16_t *v, const uint16_t *out, const float *lse, int B, int H, int N, int D,
                               cudaStream_t stream, char *err);

// Deterministic backward, off by default: with flash_backward_set_deterministic(1) the key blocks
// add their dq contributions in a fixed order, so the same inputs give bitwise the same dq, dk, dv
// in every run (costs 11–55%: dev/notes_attention_bwd.md). Off: unordered fp32 atomics, whose sum
// order varies from run to run with more than two 128-key blocks. Process-wide; returns the
// previous setting.
int flash_backward_set_deterministic(int on);
// The current setting of flash_backward_set_deterministic.
int flash_backward_deterministic(void);

// The Hopper backward (attention/flash_backward_sm90.cu): the same math and arguments as
// flash_backward_cuda (dq, dk, dv overwritten; the same workspace; honours
// flash_backward_set_deterministic), with wgmma fed by TMA: the structure of sage's Hopper backward
// (sage_backward_sm90.cu) with Sᵀ = K·Qᵀ in bf16. B·H·N < 2^31. Available (1) on a compute
// capability 9.0 device when the build has sm_90a machine code; flash_backward_sm90_cuda returns
// -1 otherwise. flash_backward_cuda dispatches to it on such a device (DIT_FLASH_MMA_SYNC=1 keeps
// the mma.sync kernel); validated on the H200 (dev/notes_flash.md).
int flash_backward_sm90_available(void);
int flash_backward_sm90_cuda(float *dq, float *dk, float *dv, void *workspace, const uint16_t *dout,
                             const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                             const float *lse, int B, int H, int N, int D, cudaStream_t stream, char *err);

#ifdef __cplusplus
}
#endif
