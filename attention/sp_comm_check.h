// The argument check every NCCL sequence-parallel entry point (sp_collectives_nccl.cu,
// ulysses_nccl.cu, ring_nccl.cu) runs first, host-only and before any CUDA or NCCL call: the
// SpCudaComm and its rank, device, comm and stream arrays are present, 1 <= n_local <= ranks,
// and every local rank is in 0..ranks-1 with a communicator of `ranks` ranks (ncclCommCount, a
// host query).
#pragma once
#include <nccl.h>
#include "attention/sequence_parallel_cuda.h"
#include "layers/common.h"

static inline int sp_check_comm(const SpCudaComm *c, const char *fn, char *err) {
    if (!c || !c->rank || !c->device || !c->comm || !c->stream) {
        dit_set_error(err, "%s: the SpCudaComm and its rank, device, comm and stream arrays must not be NULL "
                           "(c=%p)", fn, (const void *)c);
        return -1;
    }
    if (c->ranks < 1 || c->n_local < 1 || c->n_local > c->ranks) {
        dit_set_error(err, "%s: %d ranks with %d local, expected 1 <= local <= ranks", fn, c->ranks, c->n_local);
        return -1;
    }
    for (int i = 0; i < c->n_local; i++) {
        if (c->rank[i] < 0 || c->rank[i] >= c->ranks) {
            dit_set_error(err, "%s: local entry %d has rank %d, expected 0..%d", fn, i, c->rank[i], c->ranks - 1);
            return -1;
        }
        if (!c->comm[i]) {
            dit_set_error(err, "%s: local entry %d (rank %d) has a NULL communicator", fn, i, c->rank[i]);
            return -1;
        }
    }
    for (int i = 0; i < c->n_local; i++) {
        int count = 0;
        if (ncclCommCount(c->comm[i], &count) != ncclSuccess || count != c->ranks) {
            dit_set_error(err, "%s: the communicator of rank %d has %d ranks, the SpCudaComm says ranks=%d", fn,
                          c->rank[i], count, c->ranks);
            return -1;
        }
    }
    return 0;
}
