// Ulysses sequence parallelism on simulated ranks: the all-to-all between sequence-sharded and
// head-sharded layouts (pack, exchange, unpack, as ncclAlltoAll sees it), and attention forward
// and backward around a local full-sequence attention on H/R heads.
#include "attention/sequence_parallel.h"
#include "layers/common.h"
#include <stdlib.h>
#include <string.h>

// R per-rank buffers of `count` floats in one block (zeroed); NULL when malloc fails.
// Freed with free_rank_buffers.
static float **alloc_rank_buffers(int R, size_t count) {
    float **x = malloc((size_t)R * sizeof(float *));
    float *block = calloc((size_t)R * count, sizeof(float));
    if (!x || !block) { free(x); free(block); return NULL; }
    for (int r = 0; r < R; r++) x[r] = block + (size_t)r * count;
    return x;
}

static void free_rank_buffers(float **x) {
    if (x) free(x[0]);
    free(x);
}

static int check_shape(const SpComm *comm, int H, int N, const char *fn, char *err) {
    int R = comm->ranks;
    if (R < 1) { dit_set_error(err, "%s: %d ranks, expected at least 1", fn, R); return -1; }
    if (H % R != 0) {
        dit_set_error(err, "%s: heads H=%d not divisible by the %d Ulysses ranks", fn, H, R);
        return -1;
    }
    if (N % R != 0) {
        dit_set_error(err, "%s: sequence length N=%d not divisible by the %d ranks", fn, N, R);
        return -1;
    }
    return 0;
}

// The exchange of ncclAlltoAll: send[r] and recv[p] hold R chunks of chunk_count floats each;
// chunk p of rank r's send buffer becomes chunk r of rank p's receive buffer.
static void all_to_all_exchange(SpComm *comm, float *const *recv, float *const *send,
                                size_t chunk_count) {
    int R = comm->ranks;
    for (int r = 0; r < R; r++)
        for (int p = 0; p < R; p++) {
            memcpy(recv[p] + (size_t)r * chunk_count, send[r] + (size_t)p * chunk_count,
                   chunk_count * sizeof(float));
            if (p != r && comm->bytes_sent) comm->bytes_sent[r] += chunk_count * sizeof(float);
        }
}

// src[r]: (B, H, n, D) with n = N/R; dst[r]: (B, H/R, N, D). Chunk for p, packed by rank r:
// (B, H/R, n, D) = heads p·H/R.. of src[r]; rank p unpacks the chunk of r at tokens r·n.
int ulysses_all_to_all(SpComm *comm, float *const *dst, const float *const *src,
                       int B, int H, int N, int D, char *err) {
    if (check_shape(comm, H, N, "ulysses_all_to_all", err) != 0) return -1;
    int R = comm->ranks, hs = H / R, n = N / R;
    size_t head_run = (size_t)n * D;                    // one head's tokens of one shard
    size_t chunk = (size_t)B * hs * head_run;
    float **send = alloc_rank_buffers(R, chunk * R), **recv = alloc_rank_buffers(R, chunk * R);
    if (!send || !recv) {
        free_rank_buffers(send); free_rank_buffers(recv);
        dit_set_error(err, "ulysses_all_to_all: out of memory for send/recv buffers (%d x %zu floats)",
                      R, chunk * R);
        return -1;
    }
    for (int r = 0; r < R; r++)          // pack: chunk p = heads of p, in (b, h) order
        for (int p = 0; p < R; p++)
            for (int b = 0; b < B; b++)
                for (int h = 0; h < hs; h++)
                    memcpy(send[r] + (size_t)p * chunk + ((size_t)b * hs + h) * head_run,
                           src[r] + ((size_t)b * H + p * hs + h) * head_run, head_run * sizeof(float));
    all_to_all_exchange(comm, recv, send, chunk);
    for (int p = 0; p < R; p++)          // unpack: chunk from r = tokens r·n .. r·n + n - 1
        for (int r = 0; r < R; r++)
            for (int b = 0; b < B; b++)
                for (int h = 0; h < hs; h++)
                    memcpy(dst[p] + (((size_t)b * hs + h) * N + (size_t)r * n) * D,
                           recv[p] + (size_t)r * chunk + ((size_t)b * hs + h) * head_run,
                           head_run * sizeof(float));
    free_rank_buffers(send); free_rank_buffers(recv);
    return 0;
}

// src[p]: (B, H/R, N, D); dst[r]: (B, H, n, D). Chunk for r, packed by rank p: tokens r·n.. of
// each of p's heads; rank r unpacks the chunk of p at heads p·H/R.
int ulysses_all_to_all_inverse(SpComm *comm, float *const *dst, const float *const *src,
                               int B, int H, int N, int D, char *err) {
    if (check_shape(comm, H, N, "ulysses_all_to_all_inverse", err) != 0) return -1;
    int R = comm->ranks, hs = H / R, n = N / R;
    size_t head_run = (size_t)n * D;
    size_t chunk = (size_t)B * hs * head_run;
    float **send = alloc_rank_buffers(R, chunk * R), **recv = alloc_rank_buffers(R, chunk * R);
    if (!send || !recv) {
        free_rank_buffers(send); free_rank_buffers(recv);
        dit_set_error(err, "ulysses_all_to_all_inverse: out of memory for send/recv buffers (%d x %zu floats)",
                      R, chunk * R);
        return -1;
    }
    for (int p = 0; p < R; p++)          // pack: chunk r = tokens of r, in (b, h) order
        for (int r = 0; r < R; r++)
            for (int b = 0; b < B; b++)
                for (int h = 0; h < hs; h++)
                    memcpy(send[p] + (size_t)r * chunk + ((size_t)b * hs + h) * head_run,
                           src[p] + (((size_t)b * hs + h) * N + (size_t)r * n) * D,
                           head_run * sizeof(float));
    all_to_all_exchange(comm, recv, send, chunk);
    for (int r = 0; r < R; r++)          // unpack: chunk from p = heads p·H/R ..
        for (int p = 0; p < R; p++)
            for (int b = 0; b < B; b++)
                for (int h = 0; h < hs; h++)
                    memcpy(dst[r] + ((size_t)b * H + p * hs + h) * head_run,
                           recv[r] + (size_t)p * chunk + ((size_t)b * hs + h) * head_run,
                           head_run * sizeof(float));
    free_rank_buffers(send); free_rank_buffers(recv);
    return 0;
}

int ulysses_saved_alloc(UlyssesSaved *saved, int R, int B, int H, int N, int D, char *err) {
    memset(saved, 0, sizeof(*saved));
    if (R < 1 || H % R != 0) {
        dit_set_error(err, "ulysses_saved_alloc: heads H=%d not divisible by the %d Ulysses ranks", H, R);
        return -1;
    }
    size_t count = (size_t)B * (H / R) * N * D;
    saved->q = alloc_rank_buffers(R, count);
    saved->k = alloc_rank_buffers(R, count);
    saved->v = alloc_rank_buffers(R, count);
    saved->out = alloc_rank_buffers(R, count);
    saved->lse = alloc_rank_buffers(R, (size_t)B * (H / R) * N);
    if (saved->q && saved->k && saved->v && saved->out && saved->lse) return 0;
    ulysses_saved_free(saved);
    dit_set_error(err, "ulysses_saved_alloc: out of memory (%d ranks x 4 x %zu floats)", R, count);
    return -1;
}

void ulysses_saved_free(UlyssesSaved *saved) {
    free_rank_buffers(saved->q); free_rank_buffers(saved->k); free_rank_buffers(saved->v);
    free_rank_buffers(saved->out); free_rank_buffers(saved->lse);
    memset(saved, 0, sizeof(*saved));
}

// Sequence-sharded q, k, v (B, H, N/R, D) -> out (B, H, N/R, D), lse (B, H, N/R); the
// head-sharded q, k, v, out, lse stay in saved for the backward.
int ulysses_attention_forward(SpComm *comm, float *const *out, float *const *lse,
                              const UlyssesSaved *saved,
                              const float *const *q, const float *const *k, const float *const *v,
                              int B, int H, int N, int D, const SageConfig *sage, char *err) {
    if (ulysses_all_to_all(comm, saved->q, q, B, H, N, D, err) != 0 ||
        ulysses_all_to_all(comm, saved->k, k, B, H, N, D, err) != 0 ||
        ulysses_all_to_all(comm, saved->v, v, B, H, N, D, err) != 0) return -1;
    int hs = H / comm->ranks;
    for (int r = 0; r < comm->ranks; r++) {
        if (sage) sage_forward(saved->out[r], saved->lse[r], saved->q[r], saved->k[r], saved->v[r],
                               B, hs, N, D, *sage);
        else attention_forward(saved->out[r], saved->lse[r], saved->q[r], saved->k[r], saved->v[r],
                               B, hs, N, D);
    }
    if (ulysses_all_to_all_inverse(comm, out, (const float *const *)saved->out, B, H, N, D, err) != 0 ||
        ulysses_all_to_all_inverse(comm, lse, (const float *const *)saved->lse, B, H, N, 1, err) != 0)
        return -1;
    return 0;
}

// dout (B, H, N/R, D) sequence-sharded; dq, dk, dv (B, H, N/R, D) accumulate (+=).
int ulysses_attention_backward(SpComm *comm, float *const *dq, float *const *dk, float *const *dv,
                               const float *const *dout, const UlyssesSaved *saved,
                               int B, int H, int N, int D, const SageConfig *sage, char *err) {
    if (check_shape(comm, H, N, "ulysses_attention_backward", err) != 0) return -1;
    int R = comm->ranks, hs = H / R;
    size_t count = (size_t)B * H * N * D / R;           // per rank, in either layout
    float **dout_heads = alloc_rank_buffers(R, count);
    float **grad_heads[3] = {alloc_rank_buffers(R, count), alloc_rank_buffers(R, count),
                             alloc_rank_buffers(R, count)};   // dq, dk, dv head-sharded, zeroed
    float **grad_seq = alloc_rank_buffers(R, count);
    int rc = -1;
    if (!dout_heads || !grad_heads[0] || !grad_heads[1] || !grad_heads[2] || !grad_seq) {
        dit_set_error(err, "ulysses_attention_backward: out of memory (%d ranks x 5 x %zu floats)", R, count);
        goto done;
    }
    if (ulysses_all_to_all(comm, dout_heads, dout, B, H, N, D, err) != 0) goto done;
    for (int r = 0; r < R; r++) {
        if (sage) sage_backward(grad_heads[0][r], grad_heads[1][r], grad_heads[2][r], dout_heads[r],
                                saved->q[r], saved->k[r], saved->v[r], saved->out[r], saved->lse[r],
                                B, hs, N, D, *sage);
        else attention_backward(grad_heads[0][r], grad_heads[1][r], grad_heads[2][r], dout_heads[r],
                                saved->q[r], saved->k[r], saved->v[r], saved->out[r], saved->lse[r],
                                B, hs, N, D);
    }
    float *const *grads[3] = {dq, dk, dv};
    for (int t = 0; t < 3; t++) {
        if (ulysses_all_to_all_inverse(comm, grad_seq, (const float *const *)grad_heads[t],
                                       B, H, N, D, err) != 0) goto done;
        for (int r = 0; r < R; r++)
            for (size_t i = 0; i < count; i++) grads[t][r][i] += grad_seq[r][i];
    }
    rc = 0;
done:
    free_rank_buffers(dout_heads); free_rank_buffers(grad_seq);
    for (int t = 0; t < 3; t++) free_rank_buffers(grad_heads[t]);
    return rc;
}
