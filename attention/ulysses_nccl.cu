// Ulysses sequence parallelism over NCCL (attention/sequence_parallel_cuda.h): the all-to-all
// between sequence-sharded and head-sharded layouts (grouped ncclSend/ncclRecv of every run of
// one head's tokens straight from its place in one layout to its place in the other, no staging),
// and attention forward and backward around the single-GPU flash or sage kernels on H/R heads.
// The GPU version of attention/ulysses_cpu.c.
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

// The offset, in bytes, of run (b, h') of peer p's share in the two layouts, `run` = n·D·eb
// bytes (one head's tokens of one shard): sequence-sharded (B, H, n, D), heads p·H/R + h' of
// batch b; head-sharded (B, H/R, N, D), tokens p·n.. of head h' of batch b.
static size_t seq_offset(int b, int p, int h, int H, int hs, size_t run) { return ((size_t)b * H + (size_t)p * hs + h) * run; }
static size_t head_offset(int b, int p, int h, int hs, int R, size_t run) { return (((size_t)b * hs + h) * R + p) * run; }

// NCCL allows 2048 operations in one group; the exchange is split into groups of whole runs
// under half of that (every rank splits the same way, so sends and receives still pair up).
#define A2A_GROUP_OPS 1024

// Which runs a call moves: of each of `tensors` tensors (tensor t at dst/src + t·dst_step/src_step
// bytes), the (b, h') pairs j = b·hs + h' in [first, first + count) of the B·hs head-sharded ones.
// Selected run k in [0, tensors·count) is tensor k / count, pair first + k % count.
typedef struct { int tensors, first, count, H, hs; size_t run, dst_step, src_step; } Runs;

static void run_offsets(const Runs *sel, int k, int p, int R, int inverse, size_t *send_off, size_t *recv_off) {
    int t = k / sel->count, j = sel->first + k % sel->count, b = j / sel->hs, h = j % sel->hs;
    size_t seq = seq_offset(b, p, h, sel->H, sel->hs, sel->run), head = head_offset(b, p, h, sel->hs, R, sel->run);
    *send_off = t * sel->src_step + (inverse ? head : seq);
    *recv_off = t * sel->dst_step + (inverse ? seq : head);
}

// Selected runs k in [k0, k1) with every other rank, one ncclGroupStart/End over the local
// ranks: rank r sends its run for p to each p != r, which receives it at its place for r;
// n_local·(R-1)·2·(k1-k0) operations.
static int exchange_runs(const SpCudaComm *c, void *const *dst, const void *const *src, const Runs *sel,
                         int inverse, int k0, int k1, char *err) {
    int R = c->ranks;
    SP_NCCL_CHECK(ncclGroupStart(), err, "ncclGroupStart (all-to-all runs %d..%d of %zu bytes)", k0, k1, sel->run);
    int rc = 0;
    for (int i = 0; i < c->n_local && rc == 0; i++)
        for (int p = 0; p < R && rc == 0; p++) {
            if (p == c->rank[i]) continue;
            for (int k = k0; k < k1 && rc == 0; k++) {
                size_t send_off, recv_off;
                run_offsets(sel, k, p, R, inverse, &send_off, &recv_off);
                ncclResult_t s = ncclSend((const char *)src[i] + send_off, sel->run, ncclChar, p, c->comm[i],
                                          c->stream[i]);
                ncclResult_t r = s == ncclSuccess ? ncclRecv((char *)dst[i] + recv_off, sel->run, ncclChar, p,
                                                             c->comm[i], c->stream[i]) : s;
                if (r != ncclSuccess) {
                    dit_set_error(err, "ulysses all-to-all: %s of selected run %d of %zu bytes between rank %d "
                                  "and rank %d: %s", s != ncclSuccess ? "ncclSend" : "ncclRecv", k, sel->run,
                                  c->rank[i], p, ncclGetErrorString(r));
                    rc = -1;
                }
            }
        }
    ncclResult_t end = ncclGroupEnd();
    if (rc != 0) return -1;
    SP_NCCL_CHECK(end, err, "ncclGroupEnd (all-to-all of %d ranks, runs %d..%d of %zu bytes)", R, k0, k1, sel->run);
    return 0;
}

// Local entry i's own share of the selected runs, src -> dst on `stream`: one strided copy per
// tensor and batch b of the selected heads of b (sequence-sharded runs are `run` apart,
// head-sharded ones R·run).
static int copy_own_runs(const SpCudaComm *c, int i, void *dst, const void *src, const Runs *sel, int inverse,
                         cudaStream_t stream, char *err) {
    int R = c->ranks, r = c->rank[i];
    size_t seq_pitch = sel->run, head_pitch = (size_t)R * sel->run;
    for (int k = 0; k < sel->tensors * sel->count;) {
        int h = (sel->first + k % sel->count) % sel->hs, left = sel->count - k % sel->count;
        int n = sel->hs - h < left ? sel->hs - h : left;   // runs of this tensor and batch
        size_t send_off, recv_off;
        run_offsets(sel, k, r, R, inverse, &send_off, &recv_off);
        SP_CUDA_CHECK(cudaMemcpy2DAsync((char *)dst + recv_off, inverse ? seq_pitch : head_pitch,
                                        (const char *)src + send_off, inverse ? head_pitch : seq_pitch, sel->run, n,
                                        cudaMemcpyDeviceToDevice, stream), err,
                      "own runs of rank %d, selected run %d: cudaMemcpy2DAsync of %d runs of %zu bytes", r, k, n,
                      sel->run);
        k += n;
    }
    return 0;
}

// inverse = 0: src (B, H, n, D) -> dst (B, H/R, N, D); inverse = 1: the other way; the runs
// selected by tensors, first, count. No staging: every run of n·D elements goes from its place in
// src straight to its place in dst, the other ranks' over NCCL on stream[i], the rank's own by
// copy_own_runs on comm_stream[i] meanwhile (forked after and joined before stream[i]'s work).
static int all_to_all(const SpCudaComm *c, void *const *dst, const void *const *src, int tensors, size_t dst_step,
                      size_t src_step, int B, int H, int N, int D, size_t eb, int first, int count, int inverse,
                      char *err) {
    const char *fn = inverse ? "ulysses_all_to_all_inverse_cuda" : "ulysses_all_to_all_cuda";
    if (check_shape(c, H, N, fn, err) != 0) return -1;
    if (!dst || !src) {
        dit_set_error(err, "%s: dst and src (one device pointer per local rank) must not be NULL", fn);
        return -1;
    }
    if (!c->comm_stream) {
        dit_set_error(err, "%s: the all-to-all needs a comm_stream array (its own runs are copied there)", fn);
        return -1;
    }
    if (c->n_local > 64) { dit_set_error(err, "%s: at most 64 local ranks (got %d)", fn, c->n_local); return -1; }
    int R = c->ranks, hs = H / R;
    if (tensors < 1 || first < 0 || count < 1 || first + count > B * hs) {
        dit_set_error(err, "%s: runs %d..%d of %d tensors outside the B·H/R = %d (b, head) pairs (expected "
                           "tensors >= 1, 0 <= first < first + count <= %d)", fn, first, first + count, tensors,
                      B * hs, B * hs);
        return -1;
    }
    Runs sel = {.tensors = tensors, .first = first, .count = count, .H = H, .hs = hs,
                .run = (size_t)(N / R) * D * eb, .dst_step = dst_step, .src_step = src_step};
    int runs = tensors * count;
    cudaEvent_t joined[64];
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        cudaEvent_t ready;
        SP_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), err, "%s: cudaEventCreate", fn);
        SP_CUDA_CHECK(cudaEventRecord(ready, c->stream[i]), err, "%s: cudaEventRecord(ready) on rank %d", fn, c->rank[i]);
        SP_CUDA_CHECK(cudaStreamWaitEvent(c->comm_stream[i], ready, 0), err,
                      "%s: cudaStreamWaitEvent(comm_stream, ready) on rank %d", fn, c->rank[i]);
        SP_CUDA_CHECK(cudaEventDestroy(ready), err, "%s: cudaEventDestroy(ready)", fn);
        if (copy_own_runs(c, i, dst[i], src[i], &sel, inverse, c->comm_stream[i], err) != 0) return -1;
        SP_CUDA_CHECK(cudaEventCreateWithFlags(&joined[i], cudaEventDisableTiming), err, "%s: cudaEventCreate", fn);
        SP_CUDA_CHECK(cudaEventRecord(joined[i], c->comm_stream[i]), err, "%s: cudaEventRecord(joined) on rank %d",
                      fn, c->rank[i]);
    }
    if (R > 1) {
        int per_group = A2A_GROUP_OPS / (2 * (R - 1) * c->n_local);
        if (per_group < 1) per_group = 1;
        for (int k0 = 0; k0 < runs; k0 += per_group) {
            int k1 = k0 + per_group < runs ? k0 + per_group : runs;
            if (exchange_runs(c, dst, src, &sel, inverse, k0, k1, err) != 0) return -1;
        }
    }
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        SP_CUDA_CHECK(cudaStreamWaitEvent(c->stream[i], joined[i], 0), err,
                      "%s: cudaStreamWaitEvent(stream, joined) on rank %d", fn, c->rank[i]);
        SP_CUDA_CHECK(cudaEventDestroy(joined[i]), err, "%s: cudaEventDestroy(joined)", fn);
    }
    return 0;
}

extern "C" int ulysses_all_to_all_runs_cuda(const SpCudaComm *c, void *const *dst, const void *const *src,
                                            int tensors, size_t dst_step, size_t src_step, int B, int H, int N,
                                            int D, size_t elem_bytes, int first, int count, int inverse,
                                            char *err) {
    return all_to_all(c, dst, src, tensors, dst_step, src_step, B, H, N, D, elem_bytes, first, count, inverse != 0,
                      err);
}

extern "C" int ulysses_all_to_all_cuda(const SpCudaComm *c, void *const *dst, const void *const *src,
                                       int B, int H, int N, int D, size_t elem_bytes, char *err) {
    int hs = c && c->ranks > 0 ? H / c->ranks : 0;
    return all_to_all(c, dst, src, 1, 0, 0, B, H, N, D, elem_bytes, 0, B * hs, 0, err);
}

extern "C" int ulysses_all_to_all_inverse_cuda(const SpCudaComm *c, void *const *dst, const void *const *src,
                                               int B, int H, int N, int D, size_t elem_bytes, char *err) {
    int hs = c && c->ranks > 0 ? H / c->ranks : 0;
    return all_to_all(c, dst, src, 1, 0, 0, B, H, N, D, elem_bytes, 0, B * hs, 1, err);
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
