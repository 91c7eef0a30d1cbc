// ZeRO-1 over the replicas: the step's collectives around dit_gpu_update (model/zero.h).
#include "model/zero.h"
#ifdef DIT_CUDA
#include "layers/common.h"
#include "layers/cuda_check.h"

// comm's ranks must be m's optimizer shards, in the same order.
static int check_shards(DistComm *comm, const DitGpu *m, const char *what, char *err) {
    int rank, world;
    dist_comm_rank(comm, &rank, &world);
    if (m->shards != world || m->shard_rank != rank) {
        dit_set_error(err, "%s: the model was created for optimizer shard %d of %d, the communicator is rank %d of %d",
                      what, m->shard_rank, m->shards, rank, world);
        return -1;
    }
    return 0;
}

// The overlapped reduction (model/zero.h), queued after dit_gpu_backward: on m->reduce_stream,
// buckets of blocks from the last down, each after its lowest block's event, the first with the
// final layer too (its backward runs before the blocks'), then the embedders after the whole
// backward; m->stream then waits for all of it. Every rank queues the same calls in the same order.
static int reduce_behind_backward(DistComm *comm, DitGpu *m, size_t bucket_floats, float grad_scale, char *err) {
    cudaStream_t r = m->reduce_stream;
    int L = m->cfg.depth, K = DIT_BLOCK_GRAD_RANGES;
    size_t offsets[DIT_BLOCK_GRAD_RANGES + 1], numels[DIT_BLOCK_GRAD_RANGES + 1], block_floats = 0;
    // the blocks' stacks lie one after the other (dit_param_views): the embedders before them,
    // the final layer from `tail` on
    dit_gpu_block_grad_ranges(m, 0, L, offsets, numels);
    size_t head = offsets[0], tail = offsets[K - 1] + numels[K - 1];
    dit_gpu_block_grad_ranges(m, 0, 1, offsets, numels);
    for (int k = 0; k < K; k++) block_floats += numels[k];
    size_t blocks = (bucket_floats + block_floats - 1) / block_floats;   // per bucket, ≥ 1
    int per_bucket = blocks < (size_t)L ? (int)blocks : L;
    for (int last = L - 1; last >= 0; last -= per_bucket) {
        int first = last - per_bucket + 1 > 0 ? last - per_bucket + 1 : 0, n = K;
        dit_gpu_block_grad_ranges(m, first, last - first + 1, offsets, numels);
        if (last == L - 1 && tail < m->num_params) {
            offsets[n] = tail;
            numels[n++] = m->num_params - tail;
        }
        CUDA_CHECK(err, cudaStreamWaitEvent(r, m->block_grads_done[first], 0),
                   "the reduction waits for blocks %d..%d's backward", first, last);
        if (dist_reduce_ranges_scaled_queue(comm, m->grads_memory, m->shard_size, offsets, numels, n, grad_scale, r,
                                            err) != 0)
            return -1;
    }
    // the embedders, [0, head): final at the backward's end
    size_t zero = 0;
    CUDA_CHECK(err, cudaEventRecord(m->grads_ready, m->stream), "record the backward's end");
    CUDA_CHECK(err, cudaStreamWaitEvent(r, m->grads_ready, 0), "the reduction waits for the backward's end");
    if (dist_reduce_ranges_scaled_queue(comm, m->grads_memory, m->shard_size, &zero, &head, 1, grad_scale, r, err) != 0)
        return -1;
    CUDA_CHECK(err, cudaEventRecord(m->grads_reduced, r), "record the reduction's end");
    CUDA_CHECK(err, cudaStreamWaitEvent(m->stream, m->grads_reduced, 0), "the update waits for the reduction");
    return 0;
}

int zero_step_queue(DistComm *comm, DitGpu *m, size_t bucket_floats, float grad_scale, float loss_scale, float lr,
                    float beta1, float beta2, float eps, float weight_decay, float grad_clip, float ema_decay, int step,
                    char *err) {
    if (!comm)
        return (dit_gpu_grad_sumsq(m, err) ||
                dit_gpu_update(m, lr, beta1, beta2, eps, weight_decay, grad_clip, ema_decay, step, err)) ? -1 : 0;
    if (check_shards(comm, m, "zero_step_queue", err) != 0) return -1;
    float *scalars[2] = {m->acts.loss, m->acts.grad_sumsq};
    size_t counts[2] = {1, 1};
    float scales[2] = {loss_scale, 1.0f};
    void *weights = m->params_bf16_memory;
    if (bucket_floats > 0 && !m->reduce_stream) {
        dit_set_error(err, "zero_step_queue: bucket_floats %zu needs a model created with zero_overlap (and %d "
                      "optimizer shards)", bucket_floats, m->shards);
        return -1;
    }
    int reduced = bucket_floats > 0
                      ? reduce_behind_backward(comm, m, bucket_floats, grad_scale, err)
                      : dist_reduce_scatter_scaled_queue(comm, m->grads_memory, m->shard_size, grad_scale, m->stream, err);
    if (reduced != 0 ||
        dit_gpu_grad_sumsq(m, err) || dist_all_reduce_scaled_queue(comm, scalars, counts, scales, 2, m->stream, err) ||
        dit_gpu_update(m, lr, beta1, beta2, eps, weight_decay, grad_clip, ema_decay, step, err) ||
        dist_all_gather_queue(comm, &weights, m->shard_size * sizeof(bf16), 1, m->stream, err))
        return -1;
    return 0;
}

int zero_gather_state(DistComm *comm, DitGpu *m, int ema_only, char *err) {
    if (!comm) return 0;
    if (check_shards(comm, m, "zero_gather_state", err) != 0) return -1;
    void *state[4] = {m->ema_memory, m->params_memory, m->adam_m_memory, m->adam_v_memory};
    return dist_all_gather(comm, state, m->shard_size * sizeof(float), ema_only ? 1 : 4, m->stream, err);
}
#endif
