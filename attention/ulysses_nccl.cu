// Ulysses sequence parallelism over NCCL (attention/sequence_parallel_cuda.h): the all-to-all
// between sequence-sharded and head-sharded layouts (pack with cudaMemcpy2DAsync, grouped
// ncclSend/ncclRecv with every rank, unpack), and attention forward and backward around the
// single-GPU flash or sage kernels on H/R heads. The GPU version of attention/ulysses_cpu.c.
#include <stdio.h>
#include "attention/sequence_parallel_cuda.h"
#include "attention/flash_cuda.h"
#include "attention/sage_cuda.h"
#include "attention/sp_nccl.cuh"
#include "attention/sp_comm_check.h"

// The saved tensors of a forward: present and for the same local ranks as c.
static int check_saved(const SpCudaComm *c, const UlyssesCudaSaved *saved, const char *fn, char *err) {
    if (!saved || !saved->q || saved->n_local != c->n_local) {
        dit_set_error(err, "%s: saved must come from ulysses_cuda_saved_alloc for the %d local ranks (saved=%p, "
                           "its n_local=%d)", fn, c->n_local, (const void *)saved, saved ? saved->n_local : 0);
        return -1;
    }
    return 0;
}

static int check_shape(const SpCudaComm *c, int H, int N, const char *fn, char *err) {
    if (!c) return sp_check_comm(c, fn, err);   // names the missing SpCudaComm
    int R = c->ranks;
    if (R < 1 || c->n_local < 1 || c->n_local > R) {
        dit_set_error(err, "%s: %d ranks with %d local, expected 1 <= local <= ranks", fn, R, c->n_local);
        return -1;
    }
    if (H % R != 0) {
        dit_set_error(err, "%s: heads H=%d not divisible by the %d Ulysses ranks", fn, H, R);
        return -1;
    }
    if (N % R != 0) {
        dit_set_error(err, "%s: sequence length N=%d not divisible by the %d ranks", fn, N, R);
        return -1;
    }
    return sp_check_comm(c, fn, err);
}

// A strided copy of `rows` runs of `width` bytes on `stream` (device to device).
static int copy_runs(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t rows,
                     cudaStream_t stream, const char *what, int rank, char *err) {
    SP_CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDeviceToDevice, stream), err,
                  "%s on rank %d: cudaMemcpy2DAsync of %zu runs of %zu bytes", what, rank, rows, width);
    return 0;
}

// The exchange of ncclAlltoAll: chunk p of every rank's send buffer goes to rank p, which
// receives it as chunk r (r the sender). chunk_bytes per chunk.
static int exchange(const SpCudaComm *c, char *const *recv, char *const *send, size_t chunk_bytes, char *err) {
    SP_NCCL_CHECK(ncclGroupStart(), err, "ncclGroupStart (all-to-all, %zu bytes per chunk)", chunk_bytes);
    int rc = 0;
    for (int i = 0; i < c->n_local && rc == 0; i++)
        for (int p = 0; p < c->ranks && rc == 0; p++) {
            ncclResult_t s = ncclSend(send[i] + (size_t)p * chunk_bytes, chunk_bytes, ncclChar, p, c->comm[i],
                                      c->stream[i]);
            ncclResult_t r = s == ncclSuccess ? ncclRecv(recv[i] + (size_t)p * chunk_bytes, chunk_bytes, ncclChar,
                                                         p, c->comm[i], c->stream[i]) : s;
            if (r != ncclSuccess) {
                dit_set_error(err, "ulysses all-to-all: %s of %zu bytes between rank %d and rank %d: %s",
                              s != ncclSuccess ? "ncclSend" : "ncclRecv", chunk_bytes, c->rank[i], p,
                              ncclGetErrorString(r));
                rc = -1;
            }
        }
    ncclResult_t end = ncclGroupEnd();
    if (rc != 0) return -1;
    SP_NCCL_CHECK(end, err, "ncclGroupEnd (all-to-all of %d ranks, %zu bytes per chunk)", c->ranks, chunk_bytes);
    return 0;
}

// inverse = 0: src (B, H, n, D) -> dst (B, H/R, N, D); inverse = 1: the other way.
static int all_to_all(const SpCudaComm *c, void *const *dst, const void *const *src, int B, int H, int N, int D,
                      size_t eb, int inverse, char *err) {
    const char *fn = inverse ? "ulysses_all_to_all_inverse_cuda" : "ulysses_all_to_all_cuda";
    if (check_shape(c, H, N, fn, err) != 0) return -1;
    if (!dst || !src) {
        dit_set_error(err, "%s: dst and src (one device pointer per local rank) must not be NULL", fn);
        return -1;
    }
    int R = c->ranks, hs = H / R, n = N / R;
    size_t run = (size_t)n * D * eb;                 // one head's tokens of one shard, bytes
    size_t chunk = (size_t)B * hs * run;
    char *send[64], *recv[64];
    if (c->n_local > 64) { dit_set_error(err, "%s: at most 64 local ranks (got %d)", fn, c->n_local); return -1; }
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        SP_CUDA_CHECK(cudaMallocAsync((void **)&send[i], 2 * chunk * R, c->stream[i]), err,
                      "%s: cudaMallocAsync of 2 x %d chunks of %zu bytes on rank %d", fn, R, chunk, c->rank[i]);
        recv[i] = send[i] + chunk * R;
        for (int p = 0; p < R; p++) {
            int rc = inverse
                ? copy_runs(send[i] + p * chunk, run, (const char *)src[i] + p * run, (size_t)N * D * eb, run,
                            (size_t)B * hs, c->stream[i], "pack (tokens of p)", c->rank[i], err)
                : copy_runs(send[i] + p * chunk, hs * run, (const char *)src[i] + p * hs * run, H * run, hs * run,
                            (size_t)B, c->stream[i], "pack (heads of p)", c->rank[i], err);
            if (rc != 0) return -1;
        }
    }
    if (exchange(c, recv, send, chunk, err) != 0) return -1;
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        for (int p = 0; p < R; p++) {
            int rc = inverse
                ? copy_runs((char *)dst[i] + p * hs * run, H * run, recv[i] + p * chunk, hs * run, hs * run,
                            (size_t)B, c->stream[i], "unpack (heads of p)", c->rank[i], err)
                : copy_runs((char *)dst[i] + p * run, (size_t)N * D * eb, recv[i] + p * chunk, run, run,
                            (size_t)B * hs, c->stream[i], "unpack (tokens of p)", c->rank[i], err);
            if (rc != 0) return -1;
        }
        SP_CUDA_CHECK(cudaFreeAsync(send[i], c->stream[i]), err, "%s: cudaFreeAsync on rank %d", fn, c->rank[i]);
    }
    return 0;
}

extern "C" int ulysses_all_to_all_cuda(const SpCudaComm *c, void *const *dst, const void *const *src,
                                       int B, int H, int N, int D, size_t elem_bytes, char *err) {
    return all_to_all(c, dst, src, B, H, N, D, elem_bytes, 0, err);
}

extern "C" int ulysses_all_to_all_inverse_cuda(const SpCudaComm *c, void *const *dst, const void *const *src,
                                               int B, int H, int N, int D, size_t elem_bytes, char *err) {
    return all_to_all(c, dst, src, B, H, N, D, elem_bytes, 1, err);
}

extern "C" int ulysses_cuda_saved_alloc(UlyssesCudaSaved *s, const SpCudaComm *c, int B, int H, int N, int D,
                                        const SagePV *sage, char *err) {
    memset(s, 0, sizeof(*s));
    if (check_shape(c, H, N, "ulysses_cuda_saved_alloc", err) != 0) return -1;
    int L = c->n_local, hs = H / c->ranks;
    s->n_local = L;
    s->q = (uint16_t **)calloc(L, sizeof(void *)); s->k = (uint16_t **)calloc(L, sizeof(void *));
    s->v = (uint16_t **)calloc(L, sizeof(void *)); s->out = (uint16_t **)calloc(L, sizeof(void *));
    s->lse = (float **)calloc(L, sizeof(void *)); s->sage_ws = (void **)calloc(L, sizeof(void *));
    if (!s->q || !s->k || !s->v || !s->out || !s->lse || !s->sage_ws) {
        ulysses_cuda_saved_free(s, c);
        dit_set_error(err, "ulysses_cuda_saved_alloc: out of host memory for %d pointers", 6 * L);
        return -1;
    }
    size_t count = (size_t)B * hs * N * D;
    for (int i = 0; i < L; i++) {
        uint16_t **t[4] = {&s->q[i], &s->k[i], &s->v[i], &s->out[i]};
        cudaError_t e = cudaSetDevice(c->device[i]);
        for (int j = 0; j < 4 && e == cudaSuccess; j++) e = cudaMalloc((void **)t[j], count * 2);
        if (e == cudaSuccess) e = cudaMalloc((void **)&s->lse[i], (size_t)B * hs * N * sizeof(float));
        if (e == cudaSuccess && sage)
            e = cudaMalloc(&s->sage_ws[i], sage_cuda_forward_workspace_size(B, hs, N, D, *sage));
        if (e != cudaSuccess) {
            ulysses_cuda_saved_free(s, c);
            dit_set_error(err, "ulysses_cuda_saved_alloc: cudaMalloc on rank %d (device %d), 4 x %zu bf16 + lse%s: %s",
                          c->rank[i], c->device[i], count, sage ? " + sage workspace" : "", cudaGetErrorString(e));
            return -1;
        }
    }
    return 0;
}

extern "C" void ulysses_cuda_saved_free(UlyssesCudaSaved *s, const SpCudaComm *c) {
    for (int i = 0; i < s->n_local; i++) {
        cudaSetDevice(c->device[i]);
        if (s->q) cudaFree(s->q[i]);
        if (s->k) cudaFree(s->k[i]);
        if (s->v) cudaFree(s->v[i]);
        if (s->out) cudaFree(s->out[i]);
        if (s->lse) cudaFree(s->lse[i]);
        if (s->sage_ws) cudaFree(s->sage_ws[i]);
    }
    free(s->q); free(s->k); free(s->v); free(s->out); free(s->lse); free(s->sage_ws);
    memset(s, 0, sizeof(*s));
}

extern "C" int ulysses_attention_forward_cuda(const SpCudaComm *c, uint16_t *const *out, float *const *lse,
                                              const UlyssesCudaSaved *saved, const uint16_t *const *q,
                                              const uint16_t *const *k, const uint16_t *const *v,
                                              int B, int H, int N, int D, const SagePV *sage, char *err) {
    if (check_shape(c, H, N, "ulysses_attention_forward_cuda", err) != 0 ||
        check_saved(c, saved, "ulysses_attention_forward_cuda", err) != 0)
        return -1;
    if (ulysses_all_to_all_cuda(c, (void *const *)saved->q, (const void *const *)q, B, H, N, D, 2, err) != 0 ||
        ulysses_all_to_all_cuda(c, (void *const *)saved->k, (const void *const *)k, B, H, N, D, 2, err) != 0 ||
        ulysses_all_to_all_cuda(c, (void *const *)saved->v, (const void *const *)v, B, H, N, D, 2, err) != 0)
        return -1;
    int hs = H / c->ranks;
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "cudaSetDevice(%d)", c->device[i]);
        int rc = sage ? sage_forward_cuda(saved->out[i], saved->lse[i], saved->sage_ws[i], saved->q[i], saved->k[i],
                                          saved->v[i], B, hs, N, D, *sage, c->stream[i], err)
                      : flash_forward_cuda(saved->out[i], saved->lse[i], saved->q[i], saved->k[i], saved->v[i],
                                           B, hs, N, D, c->stream[i], err);
        if (rc != 0) return -1;
    }
    if (ulysses_all_to_all_inverse_cuda(c, (void *const *)out, (const void *const *)saved->out, B, H, N, D, 2,
                                        err) != 0 ||
        ulysses_all_to_all_inverse_cuda(c, (void *const *)lse, (const void *const *)saved->lse, B, H, N, 1, 4,
                                        err) != 0)
        return -1;
    return 0;
}

// Per local rank, stream-ordered: dout head-sharded (bf16), the local backward's dq, dk, dv
// head-sharded, their sequence-sharded copies (fp32), and the backward workspace.
typedef struct { uint16_t *dout; float *grad_heads, *grad_seq; void *ws; } UlyssesBwdBufs;

extern "C" int ulysses_attention_backward_cuda(const SpCudaComm *c, float *const *dq, float *const *dk,
                                               float *const *dv, const uint16_t *const *dout,
                                               const UlyssesCudaSaved *saved, int B, int H, int N, int D,
                                               const SagePV *sage, char *err) {
    if (check_shape(c, H, N, "ulysses_attention_backward_cuda", err) != 0 ||
        check_saved(c, saved, "ulysses_attention_backward_cuda", err) != 0)
        return -1;
    if (c->n_local > 64) { dit_set_error(err, "ulysses_attention_backward_cuda: at most 64 local ranks"); return -1; }
    int R = c->ranks, hs = H / R;
    size_t count = (size_t)B * H * N * D / R;        // per rank, in either layout
    size_t ws_bytes = sage ? sage_cuda_backward_workspace_size(B, hs, N, D) : flash_cuda_backward_workspace_size(B, hs, N, D);
    UlyssesBwdBufs b[64];
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "cudaSetDevice(%d)", c->device[i]);
        char *block;
        SP_CUDA_CHECK(cudaMallocAsync((void **)&block, count * 2 + 6 * count * sizeof(float) + ws_bytes + 512,
                                      c->stream[i]), err,
                      "cudaMallocAsync of the backward buffers (%zu elements per tensor) on rank %d", count, c->rank[i]);
        b[i].grad_heads = (float *)block;
        b[i].grad_seq = b[i].grad_heads + 3 * count;
        b[i].dout = (uint16_t *)(b[i].grad_seq + 3 * count);
        b[i].ws = (char *)block + ((6 * count * sizeof(float) + count * 2 + 255) & ~(size_t)255);
    }
    uint16_t *dout_heads[64];
    for (int i = 0; i < c->n_local; i++) dout_heads[i] = b[i].dout;
    if (ulysses_all_to_all_cuda(c, (void *const *)dout_heads, (const void *const *)dout, B, H, N, D, 2, err) != 0)
        return -1;
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "cudaSetDevice(%d)", c->device[i]);
        float *g = b[i].grad_heads;
        int rc = sage ? sage_backward_cuda(g, g + count, g + 2 * count, b[i].ws, saved->sage_ws[i], b[i].dout,
                                           saved->q[i], saved->k[i], saved->v[i], saved->out[i], saved->lse[i],
                                           NULL, B, hs, N, D, *sage, c->stream[i], err)
                      : flash_backward_cuda(g, g + count, g + 2 * count, b[i].ws, b[i].dout, saved->q[i],
                                            saved->k[i], saved->v[i], saved->out[i], saved->lse[i], B, hs, N, D,
                                            c->stream[i], err);
        if (rc != 0) return -1;
    }
    float *heads[64], *seq[64];
    float *const *grads[3] = {dq, dk, dv};
    for (int t = 0; t < 3; t++) {
        for (int i = 0; i < c->n_local; i++) {
            heads[i] = b[i].grad_heads + t * count;
            seq[i] = b[i].grad_seq + t * count;
        }
        if (ulysses_all_to_all_inverse_cuda(c, (void *const *)seq, (const void *const *)heads, B, H, N, D,
                                            sizeof(float), err) != 0)
            return -1;
        for (int i = 0; i < c->n_local; i++) {
            SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "cudaSetDevice(%d)", c->device[i]);
            if (sp_cuda_accumulate(grads[t][i], seq[i], count, c->stream[i], err) != 0) return -1;
        }
    }
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "cudaSetDevice(%d)", c->device[i]);
        SP_CUDA_CHECK(cudaFreeAsync(b[i].grad_heads, c->stream[i]), err, "cudaFreeAsync on rank %d", c->rank[i]);
    }
    return 0;
}
