// Sequence-parallel attention over NCCL: Ulysses (all-to-all) and ring attention, exact (bf16
// flash) and sage, forward and backward. The GPU counterpart of attention/sequence_parallel.h,
// function for function; the CPU file is the spec and dev/notes_sequence_parallel.md the design.
//
// A process drives n_local of the R ranks of one communicator group: one (a process per GPU) or
// all R (one process, ncclCommInitAll, as the tests do). Every per-rank argument is an array of
// n_local entries, entry i belonging to rank rank[i] on device device[i]; all NCCL calls of one
// collective are issued inside one ncclGroupStart/End over the local ranks.
//
// Sequence sharding as in the CPU spec: rank r holds tokens r·N/R .. of q, k, v, out, dout
// (B, H, N/R, D) bf16 (raw 16-bit patterns) and of lse (B, H, N/R) fp32 base 2; gradients
// dq, dk, dv (B, H, N/R, D) fp32 ACCUMULATE (+=). Non-causal; D 64 or 128 (the kernels').
// Ordering: every function is ordered after the work already on stream[i] and the work enqueued
// on stream[i] afterwards is ordered after it; the ring (communication overlapped with compute)
// and the Ulysses all-to-all (its own runs' copy) also use comm_stream[i]. Buffers are allocated
// stream-ordered (cudaMallocAsync) and freed the same way; nothing synchronizes the host.
// Every function returns 0, or -1 with a message in err (DIT_ERR_LEN bytes, may be NULL) naming
// the operation, sizes and rank.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include "attention/attention.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int ranks;                   // R, the size of the group
    int n_local;                 // ranks driven by this process
    const int *rank;             // (n_local) rank of each local entry, 0..R-1
    const int *device;           // (n_local) its CUDA device
    const ncclComm_t *comm;      // (n_local) its communicator (of R ranks)
    const cudaStream_t *stream;  // (n_local) compute stream
    const cudaStream_t *comm_stream;   // (n_local) second stream for overlapped communication
} SpCudaComm;

// ---- collectives (each the model of one CPU simulated collective) ----------------------------
// Ring pass on the given streams (stream[i] or comm_stream[i]): for each of n_buf buffers b,
// rank r sends send[i·n_buf + b] (bytes[b] bytes) to rank (r+1) mod R and receives
// recv[i·n_buf + b] from rank (r-1) mod R, all in one group. recv must not overlap send.
int sp_cuda_ring_pass_on(const SpCudaComm *c, const cudaStream_t *streams, int n_buf, void *const *recv,
                         const void *const *send, const size_t *bytes, char *err);
// One buffer on stream[i]: recv[(r+1) mod R] = send[r] (sp_ring_pass).
int sp_cuda_ring_pass(const SpCudaComm *c, void *const *recv, const void *const *send, size_t bytes,
                      char *err);
// In-place all-reduce of `count` floats per rank on stream[i] (sp_all_reduce_sum / _max).
int sp_cuda_all_reduce_sum(const SpCudaComm *c, float *const *x, size_t count, char *err);
int sp_cuda_all_reduce_max(const SpCudaComm *c, float *const *x, size_t count, char *err);
// y[0..n) += x[0..n) (fp32) on `stream` of the current device.
int sp_cuda_accumulate(float *y, const float *x, size_t n, cudaStream_t stream, char *err);

// ---- Ulysses --------------------------------------------------------------------------------
// All-to-all from sequence-sharded src[i] (B, H, N/R, D) to head-sharded dst[i] (B, H/R, N, D)
// (heads rank·H/R..), elements of elem_bytes bytes (2: bf16, 4: fp32; lse uses D = 1): for each
// (b, head h of p's H/R) rank r sends its run of N/R·D elements straight from src to rank p,
// which receives it straight into its dst at tokens r·N/R (grouped ncclSend/ncclRecv, no pack or
// unpack); r's own runs are copied on comm_stream[i] meanwhile. Error when H or N % R != 0.
int ulysses_all_to_all_cuda(const SpCudaComm *c, void *const *dst, const void *const *src,
                            int B, int H, int N, int D, size_t elem_bytes, char *err);
// The inverse (and adjoint): head-sharded src (B, H/R, N, D) to sequence-sharded dst (B, H, N/R, D).
int ulysses_all_to_all_inverse_cuda(const SpCudaComm *c, void *const *dst, const void *const *src,
                                    int B, int H, int N, int D, size_t elem_bytes, char *err);
// A part of either, for attention pipelined by groups of heads: only the runs of the
// head-sharded pairs j = b·H/R + h' in [first, first + count) (of the B·H/R pairs of every rank;
// for B = 1 a range of heads), of each of `tensors` tensors, tensor t at dst[i] + t·dst_step and
// src[i] + t·src_step bytes (e.g. dq, dk, dv in one call). inverse 0: sequence- to head-sharded,
// 1: back. tensors = 1, first = 0, count = B·H/R is ulysses_all_to_all_cuda (_inverse_cuda).
// Error when the range is outside [0, B·H/R) or empty.
int ulysses_all_to_all_runs_cuda(const SpCudaComm *c, void *const *dst, const void *const *src,
                                 int tensors, size_t dst_step, size_t src_step, int B, int H, int N, int D,
                                 size_t elem_bytes, int first, int count, int inverse, char *err);

// What the forward keeps for the backward, per local rank, head-sharded: q, k, v, out
// (B, H/R, N, D) bf16, lse (B, H/R, N) fp32, and for sage the forward workspace (NULL for exact).
typedef struct { uint16_t **q, **k, **v, **out; float **lse; void **sage_ws; int n_local; } UlyssesCudaSaved;
// cudaMalloc on each local device; sage == NULL: exact.
int ulysses_cuda_saved_alloc(UlyssesCudaSaved *saved, const SpCudaComm *c, int B, int H, int N, int D,
                             const SagePV *sage, char *err);
void ulysses_cuda_saved_free(UlyssesCudaSaved *saved, const SpCudaComm *c);

// sage == NULL: flash_forward_cuda / flash_backward_cuda on H/R heads over all N tokens; else
// sage_forward_cuda / sage_backward_cuda with *sage (bitwise the single-GPU forward per head).
int ulysses_attention_forward_cuda(const SpCudaComm *c, uint16_t *const *out, float *const *lse,
                                   const UlyssesCudaSaved *saved, const uint16_t *const *q,
                                   const uint16_t *const *k, const uint16_t *const *v,
                                   int B, int H, int N, int D, const SagePV *sage, char *err);
int ulysses_attention_backward_cuda(const SpCudaComm *c, float *const *dq, float *const *dk, float *const *dv,
                                    const uint16_t *const *dout, const UlyssesCudaSaved *saved,
                                    int B, int H, int N, int D, const SagePV *sage, char *err);

// ---- ring -----------------------------------------------------------------------------------
// At step s rank r holds the k/v of rank (r - s) mod R, double-buffered: the pass of step s+1's
// k/v runs on comm_stream while step s computes on stream.
// Forward: per step a partial (out_s bf16, lse_s) from flash_forward_cuda, merged into an fp32
// running out and lse (ring_merge_partial's formula); out is rounded to bf16 once at the end.
int ring_attention_forward_cuda(const SpCudaComm *c, uint16_t *const *out, float *const *lse,
                                const uint16_t *const *q, const uint16_t *const *k, const uint16_t *const *v,
                                int B, int H, int N, int D, char *err);
// Backward with the GLOBAL out and lse: per step flash_backward_cuda of the local q/dout/out/lse
// against the k/v held; dq accumulates locally; the step's dk/dv are added into the fp32 (dk, dv)
// packet that travels with the k/v shard, and after the last step one more pass (the return trip)
// brings each finished packet to its owner, which adds it into dk, dv. Passes: R-1 of k/v, R of dk/dv.
int ring_attention_backward_cuda(const SpCudaComm *c, float *const *dq, float *const *dk, float *const *dv,
                                 const uint16_t *const *dout, const uint16_t *const *q,
                                 const uint16_t *const *k, const uint16_t *const *v,
                                 const uint16_t *const *out, const float *const *lse,
                                 int B, int H, int N, int D, char *err);

// Sage under ring: the global k_mean (B, H, D) = Σ over all N tokens / N (each rank's
// sage_kv_stats_cuda sums, one ncclAllReduce sum) and, for FP8, the global v_scale (B, H, D)
// (all-reduce max of the shards' max|v|/448; zeros for FP16). Computed once per layer and passed
// to forward and backward (ring_sage_k_mean + the forward's v_scale all-reduce of the CPU spec).
int ring_sage_stats_cuda(const SpCudaComm *c, float *const *k_mean, float *const *v_scale,
                         const uint16_t *const *k, const uint16_t *const *v,
                         int B, int H, int N, int D, SagePV pv, char *err);
// Forward: each rank quantizes its shard once with the global k_mean/v_scale
// (sage_quantize_given_cuda) into two workspaces; the quantized k8, k_scale, v_t travel; per step
// sage_forward_quantized_cuda gives a partial merged as in the exact ring. N/R must be a multiple
// of SAGE_CUDA_BLOCK (64) so that every quantization block is a single-GPU block.
int ring_sage_forward_cuda(const SpCudaComm *c, uint16_t *const *out, float *const *lse,
                           const uint16_t *const *q, const uint16_t *const *k, const uint16_t *const *v,
                           const float *const *k_mean, const float *const *v_scale,
                           int B, int H, int N, int D, SagePV pv, char *err);
// Backward: as ring_attention_backward_cuda with sage_backward_cuda as the step; k/v travel in
// bf16 and the arriving shard is re-quantized with the global k_mean (the owner's k8 bit for bit).
int ring_sage_backward_cuda(const SpCudaComm *c, float *const *dq, float *const *dk, float *const *dv,
                            const uint16_t *const *dout, const uint16_t *const *q,
                            const uint16_t *const *k, const uint16_t *const *v,
                            const uint16_t *const *out, const float *const *lse,
                            const float *const *k_mean, const float *const *v_scale,
                            int B, int H, int N, int D, SagePV pv, char *err);

#ifdef __cplusplus
}
#endif
