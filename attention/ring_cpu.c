// Ring attention on simulated ranks: the simulated ring pass and all-reduces, the exact merge
// of partial (out, lse) results, and ring forward/backward for exact and sage attention.
//
// Buffers that travel are "packets": one block per rank holding everything that moves together
// (k and v; dk and dv; for sage's forward the quantized k8, k_scale and v). Each rank has two of
// each, cur and next: a pass sends cur to the next rank's next, and the two are swapped. On the
// GPU the k/v pass of step s+1 is posted before the compute of step s (double buffering, compute
// and communication on separate streams); the dk/dv pass can only follow the compute that
// finishes the accumulator it carries.
#include "attention/sequence_parallel.h"
#include "layers/common.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

// ---- per-rank buffers ---------------------------------------------------------------------------

// R per-rank blocks of `bytes` bytes each (zeroed, 16-byte aligned sizes); NULL when malloc fails.
static void **alloc_rank_blocks(int R, size_t bytes) {
    size_t stride = (bytes + 15) / 16 * 16;
    void **x = malloc((size_t)R * sizeof(void *));
    char *block = calloc((size_t)R * stride + 1, 1);
    if (!x || !block) { free(x); free(block); return NULL; }
    for (int r = 0; r < R; r++) x[r] = block + (size_t)r * stride;
    return x;
}

static void free_rank_blocks(void **x) {
    if (x) free(x[0]);
    free(x);
}

// One ring pass of the packets `cur` (sp_ring_pass into `next`), then cur and next swap roles:
// afterwards cur holds what arrived.
static void pass_packets(SpComm *comm, void ***cur, void ***next, size_t bytes) {
    sp_ring_pass(comm, *next, (const void *const *)*cur, bytes);
    void **t = *cur;
    *cur = *next;
    *next = t;
}

// The k/v packets of step 0: rank r's k then v, fp32, each `shard` floats.
static void pack_kv(void **kv, const float *const *k, const float *const *v, int R, size_t shard) {
    for (int r = 0; r < R; r++) {
        memcpy(kv[r], k[r], shard * sizeof(float));
        memcpy((float *)kv[r] + shard, v[r], shard * sizeof(float));
    }
}

// The return trip of the backward: after the last step rank r holds the finished dk/dv packet
// (dk then dv, `shard` floats each) of shard (r + 1) mod R. One more pass delivers each to its
// owner, which adds it into dk, dv.
static void return_trip(SpComm *comm, void ***dkv_cur, void ***dkv_next,
                        float *const *dk, float *const *dv, size_t shard) {
    pass_packets(comm, dkv_cur, dkv_next, 2 * shard * sizeof(float));
    for (int r = 0; r < comm->ranks; r++) {
        const float *dks = (*dkv_cur)[r], *dvs = (const float *)(*dkv_cur)[r] + shard;
        for (size_t i = 0; i < shard; i++) { dk[r][i] += dks[i]; dv[r][i] += dvs[i]; }
    }
}

static int check_ring_shape(const SpComm *comm, int N, const char *fn, char *err) {
    if (comm->ranks < 1) { dit_set_error(err, "%s: %d ranks, expected at least 1", fn, comm->ranks); return -1; }
    if (N % comm->ranks != 0) {
        dit_set_error(err, "%s: sequence length N=%d not divisible by the %d ring ranks", fn, N, comm->ranks);
        return -1;
    }
    return 0;
}

// ---- simulated collectives ----------------------------------------------------------------------

void sp_ring_pass(SpComm *comm, void *const *recv, const void *const *send, size_t bytes) {
    int R = comm->ranks;
    for (int r = 0; r < R; r++) {
        memcpy(recv[(r + 1) % R], send[r], bytes);
        if (R > 1 && comm->bytes_sent) comm->bytes_sent[r] += bytes;
    }
}

// Reduction into rank 0's order-defined result, then the same values to every rank.
static void all_reduce(SpComm *comm, float *const *x, size_t count, int is_max) {
    int R = comm->ranks;
    for (size_t i = 0; i < count; i++) {
        float acc = x[0][i];
        for (int r = 1; r < R; r++) acc = is_max ? fmaxf(acc, x[r][i]) : acc + x[r][i];
        for (int r = 0; r < R; r++) x[r][i] = acc;
    }
    if (comm->bytes_sent)
        for (int r = 0; r < R; r++) comm->bytes_sent[r] += 2 * (uint64_t)(R - 1) * count * sizeof(float) / R;
}

void sp_all_reduce_sum(SpComm *comm, float *const *x, size_t count) { all_reduce(comm, x, count, 0); }
void sp_all_reduce_max(SpComm *comm, float *const *x, size_t count) { all_reduce(comm, x, count, 1); }

// ---- merge ------------------------------------------------------------------------------------------

// Per row: m = max(lse, lse_s); a = 2^(lse - m), b = 2^(lse_s - m); lse' = m + log2(a + b);
// out' = a/(a+b)·out + b/(a+b)·out_s (a/(a+b) = 2^(lse - lse')).
void ring_merge_partial(float *out, float *lse, const float *out_s, const float *lse_s,
                        size_t rows, int D) {
    for (size_t i = 0; i < rows; i++) {
        float m = fmaxf(lse[i], lse_s[i]);
        float a = exp2f(lse[i] - m), b = exp2f(lse_s[i] - m);
        float l = a + b, wa = a / l, wb = b / l;
        float *o = out + i * D;
        const float *os = out_s + i * D;
        for (int d = 0; d < D; d++) o[d] = wa * o[d] + wb * os[d];
        lse[i] = m + log2f(l);
    }
}

// ---- exact attention ----------------------------------------------------------------------------

// q, k, v, out: per rank (B, H, n, D), n = N/R; lse (B, H, n).
int ring_attention_forward(SpComm *comm, float *const *out, float *const *lse,
                           const float *const *q, const float *const *k, const float *const *v,
                           int B, int H, int N, int D, char *err) {
    if (check_ring_shape(comm, N, "ring_attention_forward", err) != 0) return -1;
    int R = comm->ranks, n = N / R;
    size_t shard = (size_t)B * H * n * D, rows = (size_t)B * H * n;
    void **kv_cur = alloc_rank_blocks(R, 2 * shard * sizeof(float));   // k then v
    void **kv_next = alloc_rank_blocks(R, 2 * shard * sizeof(float));
    void **partial = alloc_rank_blocks(R, (shard + rows) * sizeof(float));   // out_s then lse_s
    int rc = -1;
    if (!kv_cur || !kv_next || !partial) {
        dit_set_error(err, "ring_attention_forward: out of memory (%d ranks x 5 x %zu floats)", R, shard);
        goto done;
    }
    pack_kv(kv_cur, k, v, R, shard);
    for (int s = 0; s < R; s++) {
        for (int r = 0; r < R; r++) {             // rank r holds the k/v of rank (r - s) mod R
            const float *ks = kv_cur[r], *vs = (const float *)kv_cur[r] + shard;
            if (s == 0) {
                attention_forward(out[r], lse[r], q[r], ks, vs, B, H, n, D);
            } else {
                float *out_s = partial[r], *lse_s = out_s + shard;
                attention_forward(out_s, lse_s, q[r], ks, vs, B, H, n, D);
                ring_merge_partial(out[r], lse[r], out_s, lse_s, rows, D);
            }
        }
        if (s < R - 1) pass_packets(comm, &kv_cur, &kv_next, 2 * shard * sizeof(float));
    }
    rc = 0;
done:
    free_rank_blocks(kv_cur); free_rank_blocks(kv_next); free_rank_blocks(partial);
    return rc;
}

// Shapes as in ring_attention_forward; out and lse are the forward's (global) results;
// dq, dk, dv accumulate (+=).
int ring_attention_backward(SpComm *comm, float *const *dq, float *const *dk, float *const *dv,
                            const float *const *dout,
                            const float *const *q, const float *const *k, const float *const *v,
                            const float *const *out, const float *const *lse,
                            int B, int H, int N, int D, char *err) {
    if (check_ring_shape(comm, N, "ring_attention_backward", err) != 0) return -1;
    int R = comm->ranks, n = N / R;
    size_t shard = (size_t)B * H * n * D;
    void **kv_cur = alloc_rank_blocks(R, 2 * shard * sizeof(float));    // k then v
    void **kv_next = alloc_rank_blocks(R, 2 * shard * sizeof(float));
    void **dkv_cur = alloc_rank_blocks(R, 2 * shard * sizeof(float));   // dk then dv, zeroed
    void **dkv_next = alloc_rank_blocks(R, 2 * shard * sizeof(float));
    int rc = -1;
    if (!kv_cur || !kv_next || !dkv_cur || !dkv_next) {
        dit_set_error(err, "ring_attention_backward: out of memory (%d ranks x 8 x %zu floats)", R, shard);
        goto done;
    }
    pack_kv(kv_cur, k, v, R, shard);
    for (int s = 0; s < R; s++) {
        for (int r = 0; r < R; r++) {   // rank r holds k/v of rank (r - s) mod R and its dk/dv so far
            const float *ks = kv_cur[r], *vs = (const float *)kv_cur[r] + shard;
            float *dks = dkv_cur[r], *dvs = (float *)dkv_cur[r] + shard;
            attention_backward(dq[r], dks, dvs, dout[r], q[r], ks, vs, out[r], lse[r], B, H, n, D);
        }
        if (s < R - 1) {
            pass_packets(comm, &kv_cur, &kv_next, 2 * shard * sizeof(float));
            pass_packets(comm, &dkv_cur, &dkv_next, 2 * shard * sizeof(float));
        }
    }
    return_trip(comm, &dkv_cur, &dkv_next, dk, dv, shard);
    rc = 0;
done:
    free_rank_blocks(kv_cur); free_rank_blocks(kv_next);
    free_rank_blocks(dkv_cur); free_rank_blocks(dkv_next);
    return rc;
}

// ---- sage attention ----------------------------------------------------------------------------
// The quantizers and the attention of quantized inputs are sage_cpu.c's, applied to one shard
// with the GLOBAL k_mean and v_scale. Tests check that with one rank the results are
// sage_forward's / sage_backward's bit for bit.

static int check_sage_shape(const SpComm *comm, int N, SageConfig cfg, const char *fn, char *err) {
    if (check_ring_shape(comm, N, fn, err) != 0) return -1;
    if (cfg.rotate || cfg.bwd != SAGE_BWD_FP32) {
        dit_set_error(err, "%s: SageConfig.%s is not supported by the ring yet", fn,
                      cfg.rotate ? "rotate" : "bwd (the 8-bit backwards)");
        return -1;
    }
    int n = N / comm->ranks;
    if (cfg.q_block < 1 || cfg.k_block < 1 || n % cfg.q_block != 0 || n % cfg.k_block != 0) {
        dit_set_error(err, "%s: shard length N/R=%d must be a multiple of q_block=%d and k_block=%d "
                      "(so that the quantization blocks are the single-process ones)",
                      fn, n, cfg.q_block, cfg.k_block);
        return -1;
    }
    return 0;
}

// What travels in sage's forward, in one packet: v_q (BH, n, D) (e4m3 or fp16 values; on the
// GPU 1 or 2 bytes each), k_scale (BH, n/k_block), k8 (BH, n, D).
typedef struct { float *v_q, *k_scale; int8_t *k8; } SageKV;

static size_t sage_kv_bytes(size_t shard, size_t n_k_scales) {
    return (shard + n_k_scales) * sizeof(float) + shard;
}

static SageKV sage_kv_view(void *packet, size_t shard, size_t n_k_scales) {
    SageKV kv;
    kv.v_q = packet;
    kv.k_scale = kv.v_q + shard;
    kv.k8 = (int8_t *)(kv.k_scale + n_k_scales);
    return kv;
}

// k (B, H, n, D) per rank -> k_mean (B, H, D) per rank: shard sums (fp32, token order),
// all-reduce sum, divided by N.
int ring_sage_k_mean(SpComm *comm, float *const *k_mean, const float *const *k,
                     int B, int H, int N, int D, char *err) {
    if (check_ring_shape(comm, N, "ring_sage_k_mean", err) != 0) return -1;
    int n = N / comm->ranks;
    for (int r = 0; r < comm->ranks; r++)
        for (int bh = 0; bh < B * H; bh++)
            for (int d = 0; d < D; d++) {
                float sum = 0.0f;
                for (int t = 0; t < n; t++) sum += k[r][((size_t)bh * n + t) * D + d];
                k_mean[r][(size_t)bh * D + d] = sum;
            }
    size_t count = (size_t)B * H * D;
    sp_all_reduce_sum(comm, k_mean, count);
    for (int r = 0; r < comm->ranks; r++)
        for (size_t i = 0; i < count; i++) k_mean[r][i] /= (float)N;
    return 0;
}

int ring_sage_forward(SpComm *comm, float *const *out, float *const *lse,
                      const float *const *q, const float *const *k, const float *const *v,
                      const float *const *k_mean, int B, int H, int N, int D, SageConfig cfg,
                      char *err) {
    if (check_sage_shape(comm, N, cfg, "ring_sage_forward", err) != 0) return -1;
    int R = comm->ranks, n = N / R, BH = B * H;
    size_t shard = (size_t)BH * n * D, rows = (size_t)BH * n;
    size_t n_q_scales = (size_t)BH * (n / cfg.q_block), n_k_scales = (size_t)BH * (n / cfg.k_block);
    size_t kv_bytes = sage_kv_bytes(shard, n_k_scales);
    void **kv_cur = alloc_rank_blocks(R, kv_bytes), **kv_next = alloc_rank_blocks(R, kv_bytes);
    void **q8 = alloc_rank_blocks(R, shard);
    void **q_scale = alloc_rank_blocks(R, n_q_scales * sizeof(float));
    void **v_scale = alloc_rank_blocks(R, (size_t)BH * D * sizeof(float));
    void **partial = alloc_rank_blocks(R, (shard + rows) * sizeof(float));   // out_s then lse_s
    int rc = -1;
    if (!kv_cur || !kv_next || !q8 || !q_scale || !v_scale || !partial) {
        dit_set_error(err, "ring_sage_forward: out of memory (%d ranks, shard of %zu floats)", R, shard);
        goto done;
    }
    // FP8: v_scale_d = max over ALL tokens of |v_d| / 448: the shards' scales, all-reduce max
    // (x -> x/448 is monotonic in fp32, so the max of the quotients is the quotient of the max)
    if (cfg.pv == SAGE_PV_FP8) {
        for (int r = 0; r < R; r++) sage_v_scale(v_scale[r], v[r], B, H, n, D);
        sp_all_reduce_max(comm, (float *const *)v_scale, (size_t)BH * D);
    }
    // every rank quantizes its own shard once: q8, and the k8 / v_q that will travel
    for (int r = 0; r < R; r++) {
        SageKV kv = sage_kv_view(kv_cur[r], shard, n_k_scales);
        sage_quantize_q(q8[r], q_scale[r], q[r], B, H, n, D, cfg.q_block);
        sage_quantize_k(kv.k8, kv.k_scale, k[r], k_mean[r], B, H, n, D, cfg.k_block);
        sage_quantize_v(kv.v_q, v[r], v_scale[r], B, H, n, D, cfg.pv);
    }
    for (int s = 0; s < R; s++) {
        for (int r = 0; r < R; r++) {             // rank r holds the k/v of rank (r - s) mod R
            SageKV kv = sage_kv_view(kv_cur[r], shard, n_k_scales);
            if (s == 0) {
                sage_forward_quantized(out[r], lse[r], q8[r], q_scale[r], kv.k8, kv.k_scale, kv.v_q,
                                       v_scale[r], B, H, n, n, D, cfg);
            } else {
                float *out_s = partial[r], *lse_s = out_s + shard;
                sage_forward_quantized(out_s, lse_s, q8[r], q_scale[r], kv.k8, kv.k_scale, kv.v_q,
                                       v_scale[r], B, H, n, n, D, cfg);
                ring_merge_partial(out[r], lse[r], out_s, lse_s, rows, D);
            }
        }
        if (s < R - 1) pass_packets(comm, &kv_cur, &kv_next, kv_bytes);
    }
    rc = 0;
done:
    free_rank_blocks(kv_cur); free_rank_blocks(kv_next); free_rank_blocks(q8);
    free_rank_blocks(q_scale); free_rank_blocks(v_scale); free_rank_blocks(partial);
    return rc;
}

int ring_sage_backward(SpComm *comm, float *const *dq, float *const *dk, float *const *dv,
                       const float *const *dout,
                       const float *const *q, const float *const *k, const float *const *v,
                       const float *const *out, const float *const *lse,
                       const float *const *k_mean, int B, int H, int N, int D, SageConfig cfg,
                       char *err) {
    if (check_sage_shape(comm, N, cfg, "ring_sage_backward", err) != 0) return -1;
    int R = comm->ranks, n = N / R, BH = B * H;
    size_t shard = (size_t)BH * n * D;
    size_t n_q_scales = (size_t)BH * (n / cfg.q_block), n_k_scales = (size_t)BH * (n / cfg.k_block);
    void **kv_cur = alloc_rank_blocks(R, 2 * shard * sizeof(float));    // k then v, fp32
    void **kv_next = alloc_rank_blocks(R, 2 * shard * sizeof(float));
    void **dkv_cur = alloc_rank_blocks(R, 2 * shard * sizeof(float));   // dk then dv, zeroed
    void **dkv_next = alloc_rank_blocks(R, 2 * shard * sizeof(float));
    void **q8 = alloc_rank_blocks(R, shard), **k8 = alloc_rank_blocks(R, shard);
    void **q_scale = alloc_rank_blocks(R, n_q_scales * sizeof(float));
    void **k_scale = alloc_rank_blocks(R, n_k_scales * sizeof(float));
    int rc = -1;
    if (!kv_cur || !kv_next || !dkv_cur || !dkv_next || !q8 || !k8 || !q_scale || !k_scale) {
        dit_set_error(err, "ring_sage_backward: out of memory (%d ranks, shard of %zu floats)", R, shard);
        goto done;
    }
    for (int r = 0; r < R; r++) sage_quantize_q(q8[r], q_scale[r], q[r], B, H, n, D, cfg.q_block);
    pack_kv(kv_cur, k, v, R, shard);
    for (int s = 0; s < R; s++) {
        for (int r = 0; r < R; r++) {   // rank r holds k/v of rank (r - s) mod R and its dk/dv so far
            const float *ks = kv_cur[r], *vs = (const float *)kv_cur[r] + shard;
            float *dks = dkv_cur[r], *dvs = (float *)dkv_cur[r] + shard;
            // the arriving k, quantized with the global k_mean: the owner's k8 bit for bit
            sage_quantize_k(k8[r], k_scale[r], ks, k_mean[r], B, H, n, D, cfg.k_block);
            sage_backward_quantized(dq[r], dks, dvs, dout[r], q[r], ks, vs, out[r], lse[r],
                                    q8[r], q_scale[r], k8[r], k_scale[r], k_mean[r], B, H, n, n, D, cfg);
        }
        if (s < R - 1) {
            pass_packets(comm, &kv_cur, &kv_next, 2 * shard * sizeof(float));
            pass_packets(comm, &dkv_cur, &dkv_next, 2 * shard * sizeof(float));
        }
    }
    return_trip(comm, &dkv_cur, &dkv_next, dk, dv, shard);
    rc = 0;
done:
    free_rank_blocks(kv_cur); free_rank_blocks(kv_next);
    free_rank_blocks(dkv_cur); free_rank_blocks(dkv_next);
    free_rank_blocks(q8); free_rank_blocks(k8); free_rank_blocks(q_scale); free_rank_blocks(k_scale);
    return rc;
}
