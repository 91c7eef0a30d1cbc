// Sage attention on the GPU (CUDA): the quantization pass, the forward (INT8 Q·Kᵀ with mma.sync,
// online base-2 softmax, FP8 e4m3 or FP16 P·V with two-level fp32 accumulation) and the recompute
// backward. The math is the sage definition in attention/attention.h with q_block = k_block = 64;
// the GPU sums in other orders than the CPU, which is the only freedom the definition leaves
// (plus exp2/log2 from the special-function unit, a few ulp from the CPU's exp2f/log2f).
//
// Layout: q, k, v, out, dout are (B, H, N, D) contiguous bf16 on the device (passed as the raw
// 16-bit patterns; the *_merged_cuda calls take out and dout as (B, N, H, D));
// lse is (B, H, N) fp32 in base 2, in the smoothed space (as the definition).
// D is 64 or 128; any N >= 1 and any B·H. Non-causal. FP8 P·V needs compute capability 8.9+;
// FP16 P·V runs on 8.0+. q, k, v, out, dout, dq, dk, dv and the workspaces must be 16-byte
// aligned; a NULL or misaligned pointer returns -1.
// Every function returns 0, or -1 with a message in err (DIT_ERR_LEN bytes, may be NULL).
// Kernels run on `stream`; nothing synchronizes the host.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include "attention/attention.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SAGE_CUDA_BLOCK 64   // q_block = k_block = tile size of the GPU kernels

// The quantized Q, K, V of one forward, as views into the forward workspace.
//   q8, k8: (B, H, N, D) int8 (same layout and values as the CPU's SageQK)
//   q_scale, k_scale: (B, H, ceil(N/64)); k_mean: (B, H, D)
//   v_t: (B, H, D, n_pad) with n_pad = 64·ceil(N/64): V transposed, FP8 e4m3 of v/v_scale
//        (1 byte) or FP16 of v (2 bytes); zero for tokens >= N. In FP8 mode the tokens of
//        each group of 16 are stored in the order of the e4m3 mma's A fragment (slot 4c+i
//        holds token 2c+i for i < 2 and 8+2c+i-2 for i >= 2); FP16 keeps token order.
//   v_scale: (B, H, D), max_n|v|/448 (FP8 mode only; zeros in FP16 mode)
typedef struct {
    int8_t *q8, *k8;
    float *q_scale, *k_scale, *k_mean, *v_scale;
    void *v_t;
} SageCudaQuant;

// Bytes of the forward workspace (quantized tensors + reduction scratch).
size_t sage_cuda_forward_workspace_size(int B, int H, int N, int D, SagePV pv);
// Views of the quantized tensors inside a forward workspace.
SageCudaQuant sage_cuda_quant_view(void *workspace, int B, int H, int N, int D, SagePV pv);

// The quantization pass alone (the forward calls it): fills the workspace's quantized tensors
// from q, k, v. A memset of per-head counters and two launches: per-chunk column sums of k and
// column max|v| (the last chunk of a head reduces them to k_mean and v_scale), then one CTA per
// 64-token block quantizes Q, K and V.
int sage_quantize_cuda(void *workspace, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                       int B, int H, int N, int D, SagePV pv, cudaStream_t stream, char *err);

// For sequence parallelism (attention/sequence_parallel_cuda.h), where k_mean and v_scale are
// global quantities over the shards of all ranks:
// sage_kv_stats_cuda: the statistics of one shard, k (B,H,N,D) and v: k_sum (B,H,D) = Σ_t k in
// fp32 (the chunked sum of sage_quantize_cuda, not divided by N) and v_scale (B,H,D) =
// max_t |v| / 448 in FP8 mode, zeros in FP16 mode. Uses the scratch of `workspace` (a forward
// workspace for these B, H, N, D, pv).
int sage_kv_stats_cuda(float *k_sum, float *v_scale, void *workspace, const uint16_t *k, const uint16_t *v,
                       int B, int H, int N, int D, SagePV pv, cudaStream_t stream, char *err);
// sage_quantize_given_cuda: the quantization pass with the GIVEN k_mean (B,H,D) and, in FP8 mode,
// v_scale (B,H,D) (device pointers; v_scale may be NULL in FP16 mode): copies them into the
// workspace and quantizes Q, K - k_mean and V / v_scale exactly as sage_quantize_cuda does.
int sage_quantize_given_cuda(void *workspace, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                             const float *k_mean, const float *v_scale, int B, int H, int N, int D,
                             SagePV pv, cudaStream_t stream, char *err);
// sage_quantize_qkv_cuda: sage_quantize_cuda on the q, k, v of a qkv projection's output, qkv
// (B, N, 3·H·D) ([q | k | v] per token, head h at columns h·D of each), which it writes head-major
// into q, k, v (B,H,N,D) for the backward, q and k multiplied by the normalized Hadamard matrix
// first when rotate (hadamard_cuda.h), taking k's and v's statistics in the same pass (one read of
// k and v fewer than the split, the rotation and sage_quantize_cuda; bitwise their values).
int sage_quantize_qkv_cuda(void *workspace, uint16_t *q, uint16_t *k, uint16_t *v, const uint16_t *qkv, int rotate,
                           int B, int H, int N, int D, SagePV pv, cudaStream_t stream, char *err);
// sage_forward_quantized_cuda: the forward's attention over an already quantized workspace (no
// quantization pass): the q8 and scales of the queries, the k8, k_scale, v_t of the keys, the
// k_mean and v_scale in the workspace as they are. Dispatches like sage_forward_cuda (the Hopper
// kernel for FP8 and FP16 on sm_90a unless DIT_SAGE_MMA_SYNC=1).
int sage_forward_quantized_cuda(uint16_t *out, float *lse, const void *workspace, int B, int H, int N, int D,
                                SagePV pv, cudaStream_t stream, char *err);
// ... with out in the merged layout (B, N, H, D) of sage_forward_merged_cuda.
int sage_forward_quantized_merged_cuda(uint16_t *out, float *lse, const void *workspace, int B, int H, int N, int D,
                                       SagePV pv, cudaStream_t stream, char *err);
int sage_forward_sm90_quantized_cuda(uint16_t *out, float *lse, const void *workspace, int B, int H, int N,
                                     int D, cudaStream_t stream, char *err);

// out = sage attention of q, k, v (bf16, (B,H,N,D)); lse (B,H,N) fp32 base 2.
// Quantizes into `workspace` (sage_cuda_forward_workspace_size bytes), which the backward reads.
int sage_forward_cuda(uint16_t *out, float *lse, void *workspace,
                      const uint16_t *q, const uint16_t *k, const uint16_t *v,
                      int B, int H, int N, int D, SagePV pv, cudaStream_t stream, char *err);

// sage_forward_cuda with out in the layout of the projection that reads it: (B, N, H, D), the
// (B·N, H·D) activations of a linear layer ("merged" heads), so no head-merge pass is needed. q, k,
// v and lse keep their layouts. Bitwise the values of sage_forward_cuda, transposed.
int sage_forward_merged_cuda(uint16_t *out, float *lse, void *workspace,
                             const uint16_t *q, const uint16_t *k, const uint16_t *v,
                             int B, int H, int N, int D, SagePV pv, cudaStream_t stream, char *err);

// The Hopper forward (attention/sage_forward_sm90.cu): wgmma INT8 Q·Kᵀ and FP8 P·V fed by TMA,
// the same math as sage_forward_cuda with SAGE_PV_FP8 (and the same workspace, so the backward
// works after either). sage_forward_cuda and sage_forward_merged_cuda also run its FP16 P·V
// variant for SAGE_PV_FP16 (not these two entry points, which are FP8). Available (1)
// on a compute capability 9.0 device when the build has sm_90a machine code; sage_forward_sm90_cuda
// returns -1 otherwise. At D = 128 the full tiles of a last round that would leave half of the SMs
// idle run as two units on two CTAs, with bitwise the same results; DIT_SAGE_FWD_SPLIT=0 keeps
// every tile on one CTA.
int sage_forward_sm90_available(void);
int sage_forward_sm90_cuda(uint16_t *out, float *lse, void *workspace,
                           const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           int B, int H, int N, int D, cudaStream_t stream, char *err);

// Bytes of the backward workspace: delta = rowsum(dout∘out) ((B,H,N) fp32) and the counters that
// order the dq adds ((B,H,ceil(N/64)) int32). Needed also when the caller passes delta.
size_t sage_cuda_backward_workspace_size(int B, int H, int N, int D);

// Recompute backward of sage_forward_cuda: s from the forward's q8, k8 and scales (fwd_workspace),
// P = exp2(s - lse), dv = Pᵀ·dout, dP = dout·vᵀ, dS = P∘(dP - delta), dq = dS·(k - k_mean)/sqrt(D),
// dk = dSᵀ·q/sqrt(D); products in bf16 mma with fp32 accumulation (P, dS, k - k_mean rounded to
// bf16). dq, dk, dv: (B,H,N,D) fp32, OVERWRITTEN (dq is zeroed and accumulated with atomics).
// delta: (B,H,N) fp32 given by the caller, or NULL to compute rowsum(dout∘out) from the bf16 out.
int sage_backward_cuda(float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                       const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                       const uint16_t *v, const uint16_t *out, const float *lse,
                       const float *delta, int B, int H, int N, int D, SagePV pv,
                       cudaStream_t stream, char *err);

// sage_backward_cuda with dout and out in the merged layout (B, N, H, D) of sage_forward_merged_cuda
// (dout: the projection's input gradient as it comes). dq stays (B, H, N, D) fp32; dk and dv are
// written as bf16 (16-bit patterns) into rows of a token-major tensor: dK of key t of head h of
// batch b at dk + (b·N + t)·row_stride + h·D, dV at dv + the same (row_stride >= H·D, even; e.g.
// the k and v columns of the qkv projection's input gradient, stride 3·H·D), max |dK|, |dV| raised
// into *amax (NULL: not taken). hadamard_dk = 1: dK multiplied by the normalized Hadamard matrix
// before rounding (hadamard_cuda.h's transform: the gradient of the k before a rotation the caller
// applied to q and k). Bitwise the values of sage_backward_cuda on the transposed dout and out (dk,
// dv rounded to bf16, dk after hadamard_rotate_f32_cuda when hadamard_dk; dq: in deterministic mode).
int sage_backward_merged_cuda(float *dq, uint16_t *dk, uint16_t *dv, size_t row_stride, int hadamard_dk, float *amax,
                              void *workspace, const void *fwd_workspace, const uint16_t *dout, const uint16_t *q,
                              const uint16_t *k, const uint16_t *v, const uint16_t *out, const float *lse,
                              const float *delta, int B, int H, int N, int D, SagePV pv,
                              cudaStream_t stream, char *err);

// Deterministic backward, off by default: with sage_backward_set_deterministic(1) both sage
// backwards add the key blocks' dq contributions in a fixed order (a counter per (head, 64-query
// block) in the workspace), so the same inputs give bitwise the same dq, dk, dv in every run, at
// any B, H, N; train, checkpoint, resume then reproduces the losses bit for bit. Costs 13–55% of
// the backward (13% at N = 16K, D = 128 on an H200; more with few heads or D = 64:
// dev/notes_attention_bwd.md). Off: unordered fp32 atomics, whose sum order (dq's last bits)
// varies from run to run with more than two 128-key blocks. Process-wide; returns the previous
// setting. sage_backward_deterministic() tells the current one.
int sage_backward_set_deterministic(int on);
int sage_backward_deterministic(void);

// The Hopper backward (attention/sage_backward_sm90.cu): the same math as sage_backward_cuda with
// wgmma tensor-core products fed by TMA (same arguments; B·H·N < 2^31). Available (1) on a
// compute capability 9.0 device when the build has sm_90a machine code; sage_backward_sm90_cuda
// returns -1 otherwise. sage_backward_cuda dispatches to it where it is
// available and B·H·N fits; DIT_SAGE_MMA_SYNC=1 keeps the mma.sync kernel.
int sage_backward_sm90_available(void);
int sage_backward_sm90_cuda(float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                            const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                            const uint16_t *v, const uint16_t *out, const float *lse,
                            const float *delta, int B, int H, int N, int D, SagePV pv,
                            cudaStream_t stream, char *err);

#ifdef __cplusplus
}
#endif
