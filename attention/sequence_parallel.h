// Sequence-parallel attention, CPU fp32 reference: Ulysses (all-to-all) and ring attention, for
// exact and sage attention, forward and backward. This file is the spec the NCCL version is
// tested against; every function here has a one-to-one GPU counterpart.
//
// The R ranks are SIMULATED inside one process. A per-rank tensor is an array of R pointers,
// x[r] being rank r's buffer. Functions move data between ranks only through the simulated
// collectives below (all-to-all, ring pass, all-reduce), exactly as the NCCL calls will.
//
// Sequence sharding: rank r holds the n = N/R consecutive tokens r·n .. r·n + n - 1 of q, k, v,
// out and their gradients, each (B, H, n, D), and of lse, (B, H, n). Conventions are those of
// attention.h: base-2 lse, softmax scale 1/sqrt(D), non-causal, backward ACCUMULATES (+=).
// Functions that can fail return 0 / -1 with a message in err (layers/common.h).
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "attention/attention.h"

#ifdef __cplusplus
extern "C" {
#endif

// The simulated communicator: `ranks` ranks; bytes_sent[r] (may be NULL) counts the bytes rank
// r puts on the wire (data a rank keeps for itself is not counted), so that tests can check the
// communication volume against the formulas in dev/notes_sequence_parallel.md.
typedef struct {
    int ranks;
    uint64_t *bytes_sent;   // (ranks) or NULL
} SpComm;

// ---- simulated collectives ------------------------------------------------------------------
// Ring pass (ncclSend to r+1, ncclRecv from r-1, in one group): recv[(r+1) mod R] = send[r],
// `bytes` bytes each. recv and send buffers must not overlap (the GPU version double-buffers).
void sp_ring_pass(SpComm *comm, void *const *recv, const void *const *send, size_t bytes);
// All-reduce in place over `count` floats per rank (ncclAllReduce): every rank receives the same
// sum (in rank order 0..R-1) or max. Counted as a ring all-reduce: 2·(R-1)/R·count·4 bytes per rank.
void sp_all_reduce_sum(SpComm *comm, float *const *x, size_t count);
void sp_all_reduce_max(SpComm *comm, float *const *x, size_t count);

// ---- Ulysses --------------------------------------------------------------------------------
// All-to-all from sequence-sharded to head-sharded: src[r] (B, H, N/R, D), tokens r·N/R..;
// dst[r] (B, H/R, N, D), heads r·H/R.., all N tokens. Rank r packs, for each destination p, the
// chunk (B, H/R heads of p, N/R, D) contiguously into its send buffer (ncclAlltoAll's layout),
// the chunks are exchanged, and rank p unpacks the chunk of each source r at tokens r·N/R..
// lse-shaped tensors use D = 1. Error when H or N is not divisible by R.
int ulysses_all_to_all(SpComm *comm, float *const *dst, const float *const *src,
                       int B, int H, int N, int D, char *err);
// The inverse: head-sharded src[r] (B, H/R, N, D) to sequence-sharded dst[r] (B, H, N/R, D).
// It is also the adjoint (the transpose) of ulysses_all_to_all, as for any permutation.
int ulysses_all_to_all_inverse(SpComm *comm, float *const *dst, const float *const *src,
                               int B, int H, int N, int D, char *err);

// What the forward keeps for the backward, head-sharded, each an array of R per-rank buffers:
// q, k, v, out (B, H/R, N, D), lse (B, H/R, N) (the local attention's saved activations, as in
// the single-GPU layer).
typedef struct { float **q, **k, **v, **out, **lse; } UlyssesSaved;
int ulysses_saved_alloc(UlyssesSaved *saved, int R, int B, int H, int N, int D, char *err);
void ulysses_saved_free(UlyssesSaved *saved);

// sage == NULL: exact attention; else sage attention with *sage (each head sees all N tokens,
// so the result is the single-process one, bit for bit).
// Forward: all-to-all q, k, v to head-sharded; local attention on H/R heads over all N tokens;
// inverse all-to-all of out and lse back to sequence shards. saved: ulysses_saved_alloc'd.
int ulysses_attention_forward(SpComm *comm, float *const *out, float *const *lse,
                              const UlyssesSaved *saved,
                              const float *const *q, const float *const *k, const float *const *v,
                              int B, int H, int N, int D, const SageConfig *sage, char *err);
// Backward (the adjoint of the forward): all-to-all dout to head-sharded; local backward with
// the saved head-sharded q, k, v, out, lse; inverse all-to-all of dq, dk, dv back to sequence
// shards, accumulated (+=) into dq, dk, dv.
int ulysses_attention_backward(SpComm *comm, float *const *dq, float *const *dk, float *const *dv,
                               const float *const *dout, const UlyssesSaved *saved,
                               int B, int H, int N, int D, const SageConfig *sage, char *err);

// ---- ring -----------------------------------------------------------------------------------
// Each rank keeps its q shard; the k/v shards travel the ring: at step s = 0..R-1 rank r holds
// the k/v of rank (r - s) mod R. All shards have the same length n = N/R.

// Exact merge of a partial result into the running one, per row (fp32, base 2):
// lse' = log2(2^lse + 2^lse_s); out' = 2^(lse - lse')·out + 2^(lse_s - lse')·out_s.
// Applied step after step this is out = Σ_s 2^(lse_s - lse)·out_s, lse = log2 Σ_s 2^lse_s.
// out, out_s: (rows, D); lse, lse_s: (rows).
void ring_merge_partial(float *out, float *lse, const float *out_s, const float *lse_s,
                        size_t rows, int D);

// Exact attention. Forward: per step, attention_forward of the local q shard against the k/v
// shard held, merged with ring_merge_partial; R-1 passes of k/v.
int ring_attention_forward(SpComm *comm, float *const *out, float *const *lse,
                           const float *const *q, const float *const *k, const float *const *v,
                           int B, int H, int N, int D, char *err);
// Backward, with the GLOBAL out and lse of the forward: per step, attention_backward of the
// local q/dout/out/lse against the k/v shard held (so Dr = rowsum(dout∘out) uses the global out
// and P = 2^(s - lse) the global lse); dq accumulates locally, dk/dv into accumulators that
// travel with the k/v shard. After the last step rank r holds the finished dk/dv of shard
// (r + 1) mod R: one more pass (the return trip) brings every shard's dk/dv to its owner, which
// adds them into dk, dv. Passes: R-1 of k/v, R of dk/dv.
int ring_attention_backward(SpComm *comm, float *const *dq, float *const *dk, float *const *dv,
                            const float *const *dout,
                            const float *const *q, const float *const *k, const float *const *v,
                            const float *const *out, const float *const *lse,
                            int B, int H, int N, int D, char *err);

// Sage attention under ring. K smoothing must use the mean of k over ALL N tokens (per b, h):
// each rank sums its shard, one all-reduce (B·H·D floats) gives the global sum, k_mean = sum/N.
// With a per-shard mean the logits of different key shards would be shifted by different
// per-row constants and the merge would weight the shards wrongly.
// k_mean[r]: (B, H, D) on every rank, the same values.
int ring_sage_k_mean(SpComm *comm, float *const *k_mean, const float *const *k,
                     int B, int H, int N, int D, char *err);
// Forward with the k_mean of ring_sage_k_mean. For FP8 P·V the per-channel v_scale is also a
// global quantity: one all-reduce (max) of the per-shard sage_v_scale (B·H·D floats). Every rank
// quantizes its own shard once (sage_quantize_q, sage_quantize_k with the global k_mean,
// sage_quantize_v with the global v_scale); the QUANTIZED k8, k_scale, v travel the ring. Per
// step, sage_forward_quantized of the local q8 against the shard held (the online softmax of
// attention.h over its k_block blocks) gives a partial (out_s, lse_s), merged with
// ring_merge_partial. Requires N/R to be a multiple of q_block and of k_block, so
// that every Q and K quantization block is the single-process one.
// Equal to sage_forward up to float rounding: k_mean's sum order differs, and the online
// softmax restarts per shard, so P is rounded (e4m3/fp16) relative to another running max.
int ring_sage_forward(SpComm *comm, float *const *out, float *const *lse,
                      const float *const *q, const float *const *k, const float *const *v,
                      const float *const *k_mean, int B, int H, int N, int D, SageConfig cfg,
                      char *err);
// Backward with the global out, lse and the forward's k_mean: as ring_attention_backward, with
// sage_backward_quantized as the step (s recomputed from q8 and from k8 re-quantized on arrival
// with the global k_mean; dq from k - k_mean). k/v travel in fp32, dk/dv travel with them and make the return trip.
int ring_sage_backward(SpComm *comm, float *const *dq, float *const *dk, float *const *dv,
                       const float *const *dout,
                       const float *const *q, const float *const *k, const float *const *v,
                       const float *const *out, const float *const *lse,
                       const float *const *k_mean, int B, int H, int N, int D, SageConfig cfg,
                       char *err);

#ifdef __cplusplus
}
#endif
