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

static void swap_blocks(void ***a, void ***b) {
    void **t = *a;
    *a = *b;
    *b = t;
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
    for (int r = 0; r < R; r++) {
        memcpy(kv_cur[r], k[r], shard * sizeof(float));
        memcpy((float *)kv_cur[r] + shard, v[r], shard * sizeof(float));
    }
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
        if (s < R - 1) {
            sp_ring_pass(comm, kv_next, (const void *const *)kv_cur, 2 * shard * sizeof(float));
            swap_blocks(&kv_cur, &kv_next);
        }
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
    for (int r = 0; r < R; r++) {
        memcpy(kv_cur[r], k[r], shard * sizeof(float));
        memcpy((float *)kv_cur[r] + shard, v[r], shard * sizeof(float));
    }
    for (int s = 0; s < R; s++) {
        for (int r = 0; r < R; r++) {   // rank r holds k/v of rank (r - s) mod R and its dk/dv so far
            const float *ks = kv_cur[r], *vs = (const float *)kv_cur[r] + shard;
            float *dks = dkv_cur[r], *dvs = (float *)dkv_cur[r] + shard;
            attention_backward(dq[r], dks, dvs, dout[r], q[r], ks, vs, out[r], lse[r], B, H, n, D);
        }
        if (s < R - 1) {
            sp_ring_pass(comm, kv_next, (const void *const *)kv_cur, 2 * shard * sizeof(float));
            sp_ring_pass(comm, dkv_next, (const void *const *)dkv_cur, 2 * shard * sizeof(float));
            swap_blocks(&kv_cur, &kv_next);
            swap_blocks(&dkv_cur, &dkv_next);
        }
    }
    // The return trip: rank r now holds the finished dk/dv of shard (r + 1) mod R. One more pass
    // of the dk/dv packets delivers each to its owner.
    sp_ring_pass(comm, dkv_next, (const void *const *)dkv_cur, 2 * shard * sizeof(float));
    swap_blocks(&dkv_cur, &dkv_next);
    for (int r = 0; r < R; r++) {
        const float *dks = dkv_cur[r], *dvs = (const float *)dkv_cur[r] + shard;
        for (size_t i = 0; i < shard; i++) { dk[r][i] += dks[i]; dv[r][i] += dvs[i]; }
    }
    rc = 0;
done:
    free_rank_blocks(kv_cur); free_rank_blocks(kv_next);
    free_rank_blocks(dkv_cur); free_rank_blocks(dkv_next);
    return rc;
}

// ---- sage attention ----------------------------------------------------------------------------
// The quantizers and the per-step loops below are those of sage_cpu.c, applied to one shard with
// the GLOBAL k_mean and v_scale (sage_cpu.c computes both from the tensor it is given). Tests
// check that with one rank the results are sage_forward's / sage_backward's bit for bit.

static int check_sage_shape(const SpComm *comm, int N, SageConfig cfg, const char *fn, char *err) {
    if (check_ring_shape(comm, N, fn, err) != 0) return -1;
    int n = N / comm->ranks;
    if (cfg.q_block < 1 || cfg.k_block < 1 || n % cfg.q_block != 0 || n % cfg.k_block != 0) {
        dit_set_error(err, "%s: shard length N/R=%d must be a multiple of q_block=%d and k_block=%d "
                      "(so that the quantization blocks are the single-process ones)",
                      fn, n, cfg.q_block, cfg.k_block);
        return -1;
    }
    return 0;
}

// One block of `count` tokens x (count, D) to int8: y = (x - shift)·mul (shift NULL: none);
// returns scale = amax/127, q8 = rintf(y·(127/amax)) (amax = 0 gives 0). As sage_cpu.c.
static float quantize_block(int8_t *q8, const float *x, const float *shift, float mul, int count, int D) {
    float amax = 0.0f;
    for (int t = 0; t < count; t++)
        for (int d = 0; d < D; d++)
            amax = fmaxf(amax, fabsf((x[(size_t)t * D + d] - (shift ? shift[d] : 0.0f)) * mul));
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int t = 0; t < count; t++)
        for (int d = 0; d < D; d++) {
            float y = (x[(size_t)t * D + d] - (shift ? shift[d] : 0.0f)) * mul;
            q8[(size_t)t * D + d] = (int8_t)rintf(y * inv);
        }
    return amax / 127.0f;
}

// x (BH, n, D) in blocks of `block` tokens (n a multiple of it) -> x8 (BH, n, D), scales
// (BH, n/block). shift: (BH, D) per head or NULL.
static void quantize_shard(int8_t *x8, float *scales, const float *x, const float *shift, float mul,
                           int BH, int n, int D, int block) {
    int nb = n / block;
    for (int bh = 0; bh < BH; bh++)
        for (int b = 0; b < nb; b++) {
            size_t at = ((size_t)bh * n + (size_t)b * block) * D;
            scales[(size_t)bh * nb + b] = quantize_block(x8 + at, x + at, shift ? shift + (size_t)bh * D : NULL,
                                                         mul, block, D);
        }
}

static int32_t dot_i8(const int8_t *a, const int8_t *b, int D) {
    int32_t sum = 0;
    for (int d = 0; d < D; d++) sum += (int32_t)a[d] * b[d];
    return sum;
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

// One step of the forward: the local q8 (BH, n, D) against the key shard in kv, the online
// softmax of attention.h over its k_block blocks. out_s (BH, n, D), lse_s (BH, n).
// v_scale: (BH, D), global (FP8 only). work: k_block + 2·D floats.
static void sage_step_forward(float *out_s, float *lse_s, const int8_t *q8, const float *q_scale,
                              SageKV kv, const float *v_scale, int BH, int n, int D, SageConfig cfg,
                              float *work) {
    float *p = work, *block_pv = p + cfg.k_block, *acc = block_pv + D;
    int nqb = n / cfg.q_block, nkb = n / cfg.k_block;
    for (int bh = 0; bh < BH; bh++) {
        size_t head = (size_t)bh * n * D;
        const float *vs = v_scale + (size_t)bh * D;
        for (int i = 0; i < n; i++) {
            const int8_t *qi = q8 + head + (size_t)i * D;
            float qs = q_scale[(size_t)bh * nqb + i / cfg.q_block];
            float m = -INFINITY, l = 0.0f;
            memset(acc, 0, (size_t)D * sizeof(float));
            for (int b = 0; b < nkb; b++) {
                int j0 = b * cfg.k_block;
                float qk_scale = qs * kv.k_scale[(size_t)bh * nkb + b];
                float m_new = m;
                for (int t = 0; t < cfg.k_block; t++) {
                    p[t] = (float)dot_i8(qi, kv.k8 + head + (size_t)(j0 + t) * D, D) * qk_scale;
                    m_new = fmaxf(m_new, p[t]);
                }
                float alpha = exp2f(m - m_new);
                float row_sum = 0.0f;
                memset(block_pv, 0, (size_t)D * sizeof(float));
                for (int t = 0; t < cfg.k_block; t++) {
                    float pt = exp2f(p[t] - m_new);
                    row_sum += pt;
                    float p_q = cfg.pv == SAGE_PV_FP8 ? round_to_e4m3(pt * 448.0f) : round_to_fp16(pt);
                    const float *vj = kv.v_q + head + (size_t)(j0 + t) * D;
                    for (int d = 0; d < D; d++) block_pv[d] += p_q * vj[d];
                }
                l = l * alpha + row_sum;
                for (int d = 0; d < D; d++) acc[d] = acc[d] * alpha + block_pv[d];
                m = m_new;
            }
            float *oi = out_s + head + (size_t)i * D;
            for (int d = 0; d < D; d++)
                oi[d] = cfg.pv == SAGE_PV_FP8 ? acc[d] * vs[d] / 448.0f / l : acc[d] / l;
            lse_s[(size_t)bh * n + i] = m + log2f(l);
        }
    }
}

// One step of the backward: the local rows (q, q8, dout, global out and lse) against the key
// shard held (k, k8 with k_scale, v); dq += (local), dk, dv += (the travelling accumulators).
static void sage_step_backward(float *dq, float *dk, float *dv, const float *dout,
                               const float *q, const int8_t *q8, const float *q_scale,
                               const float *out, const float *lse,
                               const float *k, const int8_t *k8, const float *k_scale, const float *v,
                               const float *k_mean, int BH, int n, int D, SageConfig cfg) {
    int nqb = n / cfg.q_block, nkb = n / cfg.k_block;
    const float scale = 1.0f / sqrtf((float)D);
    for (int bh = 0; bh < BH; bh++) {
        size_t head = (size_t)bh * n * D;
        const float *mean = k_mean + (size_t)bh * D;
        for (int i = 0; i < n; i++) {
            const int8_t *qi8 = q8 + head + (size_t)i * D;
            const float *qi = q + head + (size_t)i * D;
            const float *doi = dout + head + (size_t)i * D;
            const float *oi = out + head + (size_t)i * D;
            float *dqi = dq + head + (size_t)i * D;
            float qs = q_scale[(size_t)bh * nqb + i / cfg.q_block];
            float row_lse = lse[(size_t)bh * n + i];
            float dr = 0.0f;
            for (int d = 0; d < D; d++) dr += doi[d] * oi[d];
            for (int j = 0; j < n; j++) {
                const float *kj = k + head + (size_t)j * D;
                const float *vj = v + head + (size_t)j * D;
                float *dkj = dk + head + (size_t)j * D;
                float *dvj = dv + head + (size_t)j * D;
                float qk_scale = qs * k_scale[(size_t)bh * nkb + j / cfg.k_block];
                float p = exp2f((float)dot_i8(qi8, k8 + head + (size_t)j * D, D) * qk_scale - row_lse);
                float dp = 0.0f;
                for (int d = 0; d < D; d++) dp += doi[d] * vj[d];
                float ds = p * (dp - dr);
                for (int d = 0; d < D; d++) {
                    dvj[d] += p * doi[d];
                    dqi[d] += ds * scale * (kj[d] - mean[d]);
                    dkj[d] += ds * scale * qi[d];
                }
            }
        }
    }
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
    float *work = malloc(((size_t)cfg.k_block + 2 * (size_t)D) * sizeof(float));
    int rc = -1;
    if (!kv_cur || !kv_next || !q8 || !q_scale || !v_scale || !partial || !work) {
        dit_set_error(err, "ring_sage_forward: out of memory (%d ranks, shard of %zu floats)", R, shard);
        goto done;
    }
    // FP8: v_scale_d = max over ALL tokens of |v_d| / 448: shard maxima, all-reduce max
    if (cfg.pv == SAGE_PV_FP8) {
        for (int r = 0; r < R; r++) {
            float *amax = v_scale[r];
            for (int bh = 0; bh < BH; bh++)
                for (int t = 0; t < n; t++)
                    for (int d = 0; d < D; d++)
                        amax[(size_t)bh * D + d] = fmaxf(amax[(size_t)bh * D + d],
                                                         fabsf(v[r][((size_t)bh * n + t) * D + d]));
        }
        sp_all_reduce_max(comm, (float *const *)v_scale, (size_t)BH * D);
        for (int r = 0; r < R; r++)
            for (size_t i = 0; i < (size_t)BH * D; i++) ((float *)v_scale[r])[i] /= 448.0f;
    }
    // every rank quantizes its own shard once: q8, and the k8 / v_q that will travel
    const float c = (1.0f / sqrtf((float)D)) * 1.44269504f;
    for (int r = 0; r < R; r++) {
        SageKV kv = sage_kv_view(kv_cur[r], shard, n_k_scales);
        quantize_shard(q8[r], q_scale[r], q[r], NULL, c, BH, n, D, cfg.q_block);
        quantize_shard(kv.k8, kv.k_scale, k[r], k_mean[r], 1.0f, BH, n, D, cfg.k_block);
        const float *vs = v_scale[r];
        for (size_t i = 0; i < shard; i++) {
            float vs_d = vs[i / ((size_t)n * D) * D + i % D];
            kv.v_q[i] = cfg.pv == SAGE_PV_FP16 ? round_to_fp16(v[r][i])
                      : vs_d > 0.0f ? round_to_e4m3(v[r][i] / vs_d) : 0.0f;
        }
    }
    for (int s = 0; s < R; s++) {
        for (int r = 0; r < R; r++) {             // rank r holds the k/v of rank (r - s) mod R
            SageKV kv = sage_kv_view(kv_cur[r], shard, n_k_scales);
            if (s == 0) {
                sage_step_forward(out[r], lse[r], q8[r], q_scale[r], kv, v_scale[r], BH, n, D, cfg, work);
            } else {
                float *out_s = partial[r], *lse_s = out_s + shard;
                sage_step_forward(out_s, lse_s, q8[r], q_scale[r], kv, v_scale[r], BH, n, D, cfg, work);
                ring_merge_partial(out[r], lse[r], out_s, lse_s, rows, D);
            }
        }
        if (s < R - 1) {
            sp_ring_pass(comm, kv_next, (const void *const *)kv_cur, kv_bytes);
            swap_blocks(&kv_cur, &kv_next);
        }
    }
    rc = 0;
done:
    free_rank_blocks(kv_cur); free_rank_blocks(kv_next); free_rank_blocks(q8);
    free_rank_blocks(q_scale); free_rank_blocks(v_scale); free_rank_blocks(partial); free(work);
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
    const float c = (1.0f / sqrtf((float)D)) * 1.44269504f;
    for (int r = 0; r < R; r++) {
        quantize_shard(q8[r], q_scale[r], q[r], NULL, c, BH, n, D, cfg.q_block);
        memcpy(kv_cur[r], k[r], shard * sizeof(float));
        memcpy((float *)kv_cur[r] + shard, v[r], shard * sizeof(float));
    }
    for (int s = 0; s < R; s++) {
        for (int r = 0; r < R; r++) {   // rank r holds k/v of rank (r - s) mod R and its dk/dv so far
            const float *ks = kv_cur[r], *vs = (const float *)kv_cur[r] + shard;
            float *dks = dkv_cur[r], *dvs = (float *)dkv_cur[r] + shard;
            // the arriving k, quantized with the global k_mean: the owner's k8 bit for bit
            quantize_shard(k8[r], k_scale[r], ks, k_mean[r], 1.0f, BH, n, D, cfg.k_block);
            sage_step_backward(dq[r], dks, dvs, dout[r], q[r], q8[r], q_scale[r], out[r], lse[r],
                               ks, k8[r], k_scale[r], vs, k_mean[r], BH, n, D, cfg);
        }
        if (s < R - 1) {
            sp_ring_pass(comm, kv_next, (const void *const *)kv_cur, 2 * shard * sizeof(float));
            sp_ring_pass(comm, dkv_next, (const void *const *)dkv_cur, 2 * shard * sizeof(float));
            swap_blocks(&kv_cur, &kv_next);
            swap_blocks(&dkv_cur, &dkv_next);
        }
    }
    // The return trip: rank r now holds the finished dk/dv of shard (r + 1) mod R. One more pass
    // of the dk/dv packets delivers each to its owner.
    sp_ring_pass(comm, dkv_next, (const void *const *)dkv_cur, 2 * shard * sizeof(float));
    swap_blocks(&dkv_cur, &dkv_next);
    for (int r = 0; r < R; r++) {
        const float *dks = dkv_cur[r], *dvs = (const float *)dkv_cur[r] + shard;
        for (size_t i = 0; i < shard; i++) { dk[r][i] += dks[i]; dv[r][i] += dvs[i]; }
    }
    rc = 0;
done:
    free_rank_blocks(kv_cur); free_rank_blocks(kv_next);
    free_rank_blocks(dkv_cur); free_rank_blocks(dkv_next);
    free_rank_blocks(q8); free_rank_blocks(k8); free_rank_blocks(q_scale); free_rank_blocks(k_scale);
    return rc;
}
