// ZeRO-1 over the replicas: the step's collectives around dit_gpu_update (model/zero.h).
#include "model/zero.h"
#ifdef DIT_CUDA
#include "layers/common.h"

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

int zero_step_queue(DistComm *comm, DitGpu *m, float grad_scale, float loss_scale, float lr, float beta1, float beta2,
                    float eps, float weight_decay, float grad_clip, float ema_decay, int step, char *err) {
    if (!comm)
        return (dit_gpu_grad_sumsq(m, err) ||
                dit_gpu_update(m, lr, beta1, beta2, eps, weight_decay, grad_clip, ema_decay, step, err)) ? -1 : 0;
    if (check_shards(comm, m, "zero_step_queue", err) != 0) return -1;
    float *scalars[2] = {m->acts.loss, m->acts.grad_sumsq};
    size_t counts[2] = {1, 1};
    float scales[2] = {loss_scale, 1.0f};
    void *weights = m->params_bf16_memory;
    if (dist_reduce_scatter_scaled_queue(comm, m->grads_memory, m->shard_size, grad_scale, m->stream, err) ||
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
