// ZeRO stage 1 over the replicas (dev/notes_sequence_parallel.md, "ZeRO-1 over the replicas"):
// every rank holds the whole model in bf16 for its forward and backward, but updates only its
// slice of the parameter buffer (DitGpu.shard_*, one slice per rank of comm, created with
// optimizer_shards = world, optimizer_rank = rank). After the backward, on m->stream:
//   reduce-scatter of the fp32 gradients (Σ over the ranks × grad_scale: the slice's sums)
//   -> Σ g² over the slice -> all-reduce of (loss × loss_scale, Σ g²) in one group
//   -> norm = sqrt(Σ g²), AdamW and EMA on the slice -> all-gather of the bf16 weights.
// Overlapped (bucket_floats > 0, a model created with zero_overlap; dev/notes_sequence_parallel.md,
// "ZeRO-1's reduction behind the backward"): the reduce-scatter is replaced by ncclReduces of the
// same sums to the same owners on m->reduce_stream, queued while the backward still runs: the
// blocks (adaLN weights included: that model computes them per block) from the last down, in
// buckets of consecutive blocks holding at least bucket_floats gradients (one block each at
// hidden 2048), each as soon as its lowest block's backward is done (m->block_grads_done; the
// first bucket also carries the final layer), then the embedders after the backward; m->stream
// waits for them before Σ g². On 2 ranks every sum is s·a + s·b either way, so the reduction is
// bitwise the reduce-scatter's.
// The fp32 master weights, moments and EMA of the other slices go stale on a rank:
// zero_gather_state brings them before they are read (checkpoints: all of them; sampling: EMA).
// AdamW and EMA are elementwise, so with every slice updated from the same summed gradients
// and the same norm, the parameters are those of the replicated update; only the norm's
// summation order differs (slices summed, then the slices' sums).
// comm NULL: one GPU; the same steps without the collectives (the slice is the whole buffer).
// Every function returns 0, or -1 with a message in err.
#pragma once
#ifdef DIT_CUDA
#include "model/distributed.h"
#include "model/dit_gpu.h"

#ifdef __cplusplus
extern "C" {
#endif

// The bucket of train_dit's overlapped reduction: 32 MB of fp32 gradients (PyTorch DDP's 25 MB
// order): DiT-S's 12 blocks (7 MB each) in 3 buckets, so a small step queues few NCCL groups.
#define ZERO_BUCKET_FLOATS ((size_t)8 << 20)
// train_dit's --zero-overlap auto: the overlap only from 64M parameters (256 MB of fp32
// gradients, ~0.5 ms of reduce-scatter per step on 2 H200s). Below, the step is small and
// host-bound and the extra NCCL groups cost more than they hide (DiT-S, 33M parameters, data
// parallel 2: 5.69 -> 6.36 ms per step); hidden 2048 / depth 4 (315M) is above.
#define ZERO_OVERLAP_MIN_FLOATS ((size_t)64 << 20)
// Call right after dit_gpu_backward: queues the step's reduction and update (arguments of the
// update as dit_gpu_update); returns without waiting (dist_wait_event on an event recorded
// after it). bucket_floats: 0, one reduce-scatter after the backward; > 0, the overlapped
// reduction above (1: one block per bucket), which needs m created with zero_overlap and several
// optimizer shards.
int zero_step_queue(DistComm *comm, DitGpu *m, size_t bucket_floats, float grad_scale, float loss_scale, float lr,
                    float beta1, float beta2, float eps, float weight_decay, float grad_clip, float ema_decay, int step,
                    char *err);
// Every rank calls it: all-gathers the fp32 weights, moments and EMA (ema_only: the EMA) of every
// slice, so this rank's copies are current everywhere; waits for it.
int zero_gather_state(DistComm *comm, DitGpu *m, int ema_only, char *err);

#ifdef __cplusplus
}
#endif
#endif
