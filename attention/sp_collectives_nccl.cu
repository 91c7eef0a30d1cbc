// The collectives of sequence parallelism over NCCL (attention/sequence_parallel_cuda.h): ring
// pass (grouped ncclSend/ncclRecv), all-reduce, and the fp32 accumulation the ring backward uses.
#include <stdio.h>
#include "attention/sequence_parallel_cuda.h"
#include "attention/sp_nccl.cuh"
#include "attention/sp_comm_check.h"

// Inside ncclGroupStart: every local rank sends its n_buf buffers to r+1 and receives from r-1.
static int post_ring_pass(const SpCudaComm *c, const cudaStream_t *streams, int n_buf, void *const *recv,
                          const void *const *send, const size_t *bytes, char *err) {
    int R = c->ranks;
    for (int i = 0; i < c->n_local; i++) {
        int r = c->rank[i], next = (r + 1) % R, prev = (r + R - 1) % R;
        for (int b = 0; b < n_buf; b++) {
            SP_NCCL_CHECK(ncclSend(send[i * n_buf + b], bytes[b], ncclChar, next, c->comm[i], streams[i]), err,
                          "ncclSend of buffer %d (%zu bytes) from rank %d to rank %d", b, bytes[b], r, next);
            SP_NCCL_CHECK(ncclRecv(recv[i * n_buf + b], bytes[b], ncclChar, prev, c->comm[i], streams[i]), err,
                          "ncclRecv of buffer %d (%zu bytes) on rank %d from rank %d", b, bytes[b], r, prev);
        }
    }
    return 0;
}

extern "C" int sp_cuda_ring_pass_on(const SpCudaComm *c, const cudaStream_t *streams, int n_buf,
                                    void *const *recv, const void *const *send, const size_t *bytes, char *err) {
    if (sp_check_comm(c, "sp_cuda_ring_pass_on", err) != 0) return -1;
    if (n_buf < 1 || !streams || !recv || !send || !bytes) {
        dit_set_error(err, "sp_cuda_ring_pass_on: need n_buf >= 1 and streams, recv, send and bytes arrays "
                           "(n_buf=%d streams=%p recv=%p send=%p bytes=%p)", n_buf, (const void *)streams,
                      (const void *)recv, (const void *)send, (const void *)bytes);
        return -1;
    }
    SP_NCCL_CHECK(ncclGroupStart(), err, "ncclGroupStart (ring pass of %d buffers)", n_buf);
    int rc = post_ring_pass(c, streams, n_buf, recv, send, bytes, err);
    ncclResult_t end = ncclGroupEnd();   // always closes the group, also after a failed post
    if (rc != 0) return -1;
    SP_NCCL_CHECK(end, err, "ncclGroupEnd (ring pass of %d buffers, %zu bytes in the first, %d ranks)", n_buf,
                  bytes[0], c->ranks);
    return 0;
}

extern "C" int sp_cuda_ring_pass(const SpCudaComm *c, void *const *recv, const void *const *send, size_t bytes,
                                 char *err) {
    return sp_cuda_ring_pass_on(c, c->stream, 1, recv, send, &bytes, err);
}

static int all_reduce(const SpCudaComm *c, float *const *x, size_t count, ncclRedOp_t op, char *err) {
    const char *fn = op == ncclSum ? "sp_cuda_all_reduce_sum" : "sp_cuda_all_reduce_max";
    if (sp_check_comm(c, fn, err) != 0) return -1;
    if (!x) {
        dit_set_error(err, "%s: x (one device pointer per local rank) must not be NULL", fn);
        return -1;
    }
    SP_NCCL_CHECK(ncclGroupStart(), err, "ncclGroupStart (all-reduce of %zu floats)", count);
    int rc = 0;
    for (int i = 0; i < c->n_local && rc == 0; i++) {
        ncclResult_t r = ncclAllReduce(x[i], x[i], count, ncclFloat32, op, c->comm[i], c->stream[i]);
        if (r != ncclSuccess) {
            dit_set_error(err, "sp_cuda_all_reduce_%s: ncclAllReduce of %zu floats on rank %d: %s",
                          op == ncclSum ? "sum" : "max", count, c->rank[i], ncclGetErrorString(r));
            rc = -1;
        }
    }
    ncclResult_t end = ncclGroupEnd();
    if (rc != 0) return -1;
    SP_NCCL_CHECK(end, err, "ncclGroupEnd (all-reduce %s of %zu floats, %d ranks)", op == ncclSum ? "sum" : "max",
                  count, c->ranks);
    return 0;
}

extern "C" int sp_cuda_all_reduce_sum(const SpCudaComm *c, float *const *x, size_t count, char *err) {
    return all_reduce(c, x, count, ncclSum, err);
}
extern "C" int sp_cuda_all_reduce_max(const SpCudaComm *c, float *const *x, size_t count, char *err) {
    return all_reduce(c, x, count, ncclMax, err);
}

__global__ void accumulate_kernel(float *y, const float *x, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] += x[i];
}

extern "C" int sp_cuda_accumulate(float *y, const float *x, size_t n, cudaStream_t stream, char *err) {
    if (n == 0) return 0;
    if (!y || !x) {
        dit_set_error(err, "sp_cuda_accumulate: y=%p and x=%p must be device pointers (n=%zu)", (void *)y,
                      (const void *)x, n);
        return -1;
    }
    size_t blocks = (n + 255) / 256;
    accumulate_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, stream>>>(y, x, n);
    SP_CUDA_CHECK(cudaGetLastError(), err, "launch accumulate_kernel (%zu floats)", n);
    return 0;
}
