// Sage attention on the CPU: the executable form of the bit-level definition in attention.h
// (K smoothing, INT8 Q/K per token block, online base-2 softmax over key blocks, FP8 or FP16
// P·V with two-level accumulation), its backward, and the e4m3 / fp16 rounding helpers.
// Sums over d and over the keys of a block run in index order in fp32; a GPU kernel may sum
// in another order, which is the only freedom the definition leaves.
#include "attention/attention.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Nearest float8 e4m3 value (OCP "e4m3fn": 4 exponent bits with bias 7, 3 mantissa bits,
// subnormals in steps of 2^-9, largest finite 448, no infinities), ties to even mantissa.
// |x| >= 448 saturates to ±448 (the GPU's .satfinite conversion); NaN stays NaN.
float round_to_e4m3(float x) {
    if (isnan(x)) return x;
    float ax = fabsf(x);
    if (ax >= 448.0f) return copysignf(448.0f, x);
    int e;
    frexpf(ax, &e);                                   // ax = f·2^e, f in [0.5, 1)
    int step_exp = (e - 1 < -6 ? -6 : e - 1) - 3;     // spacing of e4m3 values around ax
    // scaling by powers of two is exact, so rintf (nearest-even) does the rounding
    float r = ldexpf(rintf(ldexpf(ax, -step_exp)), step_exp);
    return copysignf(r, x);                           // r <= 448: 448 is 14·2^5, ax/2^5 < 14
}

// Nearest IEEE binary16 value (10 mantissa bits, subnormals in steps of 2^-24, largest finite
// 65504), ties to even. As in IEEE, |x| >= 65520 (the tie above 65504) overflows to ±inf.
float round_to_fp16(float x) {
    if (isnan(x)) return x;
    float ax = fabsf(x);
    if (ax >= 65520.0f) return copysignf(INFINITY, x);
    int e;
    frexpf(ax, &e);
    int step_exp = (e - 1 < -14 ? -14 : e - 1) - 10;
    float r = ldexpf(rintf(ldexpf(ax, -step_exp)), step_exp);
    return copysignf(r, x);
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

// One block of n tokens x (n, D) to int8 with one scale: y = (x - shift)·mul (shift: (D),
// NULL for none); amax = max|y|; returns scale = amax/127 and q8 = rintf(y·(127/amax));
// amax = 0 gives scale 0 and q8 = 0.
static float quantize_block(int8_t *q8, const float *x, const float *shift, float mul,
                            int n, int D) {
    float amax = 0.0f;
    for (int t = 0; t < n; t++)
        for (int d = 0; d < D; d++)
            amax = fmaxf(amax, fabsf((x[(size_t)t * D + d] - (shift ? shift[d] : 0.0f)) * mul));
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int t = 0; t < n; t++)
        for (int d = 0; d < D; d++) {
            float y = (x[(size_t)t * D + d] - (shift ? shift[d] : 0.0f)) * mul;
            q8[(size_t)t * D + d] = (int8_t)rintf(y * inv);
        }
    return amax / 127.0f;
}

// q, k: (B, H, N, D). Fills the caller-allocated arrays of qk (sizes in attention.h):
// k_mean = mean_n k; K blocks of (k - k_mean), Q blocks of q·log2(e)/sqrt(D), each to int8
// with scale amax/127.
void sage_quantize_qk(SageQK *qk, const float *q, const float *k,
                      int B, int H, int N, int D, SageConfig cfg) {
    const float c = (1.0f / sqrtf((float)D)) * 1.44269504f;
    int nqb = ceil_div(N, cfg.q_block), nkb = ceil_div(N, cfg.k_block);
    for (int bh = 0; bh < B * H; bh++) {
        size_t head = (size_t)bh * N * D;
        float *mean = qk->k_mean + (size_t)bh * D;
        for (int d = 0; d < D; d++) {
            float sum = 0.0f;
            for (int n = 0; n < N; n++) sum += k[head + (size_t)n * D + d];
            mean[d] = sum / (float)N;
        }
        for (int b = 0; b < nqb; b++) {
            int t0 = b * cfg.q_block, n = N - t0 < cfg.q_block ? N - t0 : cfg.q_block;
            size_t at = head + (size_t)t0 * D;
            qk->q_scale[(size_t)bh * nqb + b] = quantize_block(qk->q8 + at, q + at, NULL, c, n, D);
        }
        for (int b = 0; b < nkb; b++) {
            int t0 = b * cfg.k_block, n = N - t0 < cfg.k_block ? N - t0 : cfg.k_block;
            size_t at = head + (size_t)t0 * D;
            qk->k_scale[(size_t)bh * nkb + b] = quantize_block(qk->k8 + at, k + at, mean, 1.0f, n, D);
        }
    }
}

// Scratch of one sage call: the quantized Q/K of all heads and, for the forward, one head's
// quantized V and the per-row work arrays.
typedef struct {
    SageQK qk;
    float *v_q;       // (N, D): e4m3(v/v_scale) for FP8, fp16(v) for FP16
    float *v_scale;   // (D): max_n|v|/448 (FP8 only)
    float *p;         // (k_block): P of one key block
    float *block_pv;  // (D): Σ_j P·V of one key block
    float *acc;       // (D)
} SageScratch;

static void scratch_free(SageScratch *s) {
    free(s->qk.q8); free(s->qk.k8); free(s->qk.q_scale); free(s->qk.k_scale); free(s->qk.k_mean);
    free(s->v_q); free(s->v_scale); free(s->p); free(s->block_pv); free(s->acc);
}

// Returns 0, or -1 when malloc fails (then nothing stays allocated).
static int scratch_alloc(SageScratch *s, int B, int H, int N, int D, SageConfig cfg, int forward) {
    memset(s, 0, sizeof(*s));
    size_t n_qkv = (size_t)B * H * N * D;
    s->qk.q8 = malloc(n_qkv);
    s->qk.k8 = malloc(n_qkv);
    s->qk.q_scale = malloc((size_t)B * H * ceil_div(N, cfg.q_block) * sizeof(float));
    s->qk.k_scale = malloc((size_t)B * H * ceil_div(N, cfg.k_block) * sizeof(float));
    s->qk.k_mean = malloc((size_t)B * H * D * sizeof(float));
    int ok = s->qk.q8 && s->qk.k8 && s->qk.q_scale && s->qk.k_scale && s->qk.k_mean;
    if (forward) {
        s->v_q = malloc((size_t)N * D * sizeof(float));
        s->v_scale = malloc((size_t)D * sizeof(float));
        s->p = malloc((size_t)cfg.k_block * sizeof(float));
        s->block_pv = malloc((size_t)D * sizeof(float));
        s->acc = malloc((size_t)D * sizeof(float));
        ok = ok && s->v_q && s->v_scale && s->p && s->block_pv && s->acc;
    }
    if (ok) return 0;
    scratch_free(s);
    return -1;
}

// The API has no error return: when scratch cannot be allocated, say so on stderr and make
// the outputs NaN, so that no caller can take them for a result.
static void fail_with_nan(const char *fn, float *a, size_t na, float *b, size_t nb,
                          float *c, size_t nc, int B, int H, int N, int D) {
    fprintf(stderr, "%s: out of memory for scratch (B=%d H=%d N=%d D=%d); outputs set to NaN\n",
            fn, B, H, N, D);
    for (size_t i = 0; i < na; i++) a[i] = NAN;
    for (size_t i = 0; i < nb; i++) b[i] = NAN;
    for (size_t i = 0; i < nc; i++) c[i] = NAN;
}

// One head's V as the P·V product sees it. FP8: v_scale_d = max_n|v_nd|/448 and
// v_q = e4m3(v/v_scale_d) (0 where v_scale_d = 0). FP16: v_q = fp16(v).
static void quantize_v(float *v_q, float *v_scale, const float *v, int N, int D, SagePV pv) {
    if (pv == SAGE_PV_FP16) {
        for (size_t i = 0; i < (size_t)N * D; i++) v_q[i] = round_to_fp16(v[i]);
        return;
    }
    for (int d = 0; d < D; d++) {
        float amax = 0.0f;
        for (int n = 0; n < N; n++) amax = fmaxf(amax, fabsf(v[(size_t)n * D + d]));
        v_scale[d] = amax / 448.0f;
    }
    for (int n = 0; n < N; n++)
        for (int d = 0; d < D; d++) {
            size_t at = (size_t)n * D + d;
            v_q[at] = v_scale[d] > 0.0f ? round_to_e4m3(v[at] / v_scale[d]) : 0.0f;
        }
}

static int32_t dot_i8(const int8_t *a, const int8_t *b, int D) {
    int32_t sum = 0;
    for (int d = 0; d < D; d++) sum += (int32_t)a[d] * b[d];
    return sum;
}

// q, k, v, out: (B, H, N, D); lse: (B, H, N). The forward of the definition in attention.h:
// per query row, key blocks of k_block in order with the running max m, sum l and
// accumulator acc; lse = m + log2(l) in the smoothed, quantized base-2 logits.
void sage_forward(float *out, float *lse,
                  const float *q, const float *k, const float *v,
                  int B, int H, int N, int D, SageConfig cfg) {
    SageScratch s;
    if (scratch_alloc(&s, B, H, N, D, cfg, 1) != 0) {
        fail_with_nan("sage_forward", out, (size_t)B * H * N * D, lse, (size_t)B * H * N,
                      NULL, 0, B, H, N, D);
        return;
    }
    sage_quantize_qk(&s.qk, q, k, B, H, N, D, cfg);
    int nqb = ceil_div(N, cfg.q_block), nkb = ceil_div(N, cfg.k_block);
    for (int bh = 0; bh < B * H; bh++) {
        size_t head = (size_t)bh * N * D;
        quantize_v(s.v_q, s.v_scale, v + head, N, D, cfg.pv);
        for (int i = 0; i < N; i++) {
            const int8_t *qi = s.qk.q8 + head + (size_t)i * D;
            float q_scale = s.qk.q_scale[(size_t)bh * nqb + i / cfg.q_block];
            float m = -INFINITY, l = 0.0f;
            memset(s.acc, 0, (size_t)D * sizeof(float));
            for (int b = 0; b < nkb; b++) {
                int j0 = b * cfg.k_block, n = N - j0 < cfg.k_block ? N - j0 : cfg.k_block;
                float qk_scale = q_scale * s.qk.k_scale[(size_t)bh * nkb + b];
                float m_new = m;
                for (int t = 0; t < n; t++) {
                    const int8_t *kj = s.qk.k8 + head + (size_t)(j0 + t) * D;
                    s.p[t] = (float)dot_i8(qi, kj, D) * qk_scale;
                    m_new = fmaxf(m_new, s.p[t]);
                }
                float alpha = exp2f(m - m_new);
                float row_sum = 0.0f;
                memset(s.block_pv, 0, (size_t)D * sizeof(float));
                for (int t = 0; t < n; t++) {
                    float p = exp2f(s.p[t] - m_new);
                    row_sum += p;
                    float p_q = cfg.pv == SAGE_PV_FP8 ? round_to_e4m3(p * 448.0f) : round_to_fp16(p);
                    const float *vj = s.v_q + (size_t)(j0 + t) * D;
                    for (int d = 0; d < D; d++) s.block_pv[d] += p_q * vj[d];
                }
                l = l * alpha + row_sum;
                for (int d = 0; d < D; d++) s.acc[d] = s.acc[d] * alpha + s.block_pv[d];
                m = m_new;
            }
            float *oi = out + head + (size_t)i * D;
            for (int d = 0; d < D; d++)
                oi[d] = cfg.pv == SAGE_PV_FP8 ? s.acc[d] * s.v_scale[d] / 448.0f / l : s.acc[d] / l;
            lse[(size_t)bh * N + i] = m + log2f(l);
        }
    }
    scratch_free(&s);
}

// Shapes as in sage_forward; out and lse are sage_forward's; dq, dk, dv accumulate (+=).
// s_ij recomputed from the same q8, k8 and scales; P_ij = 2^(s_ij - lse_i);
// Dr_i = Σ_d dout_id·out_id; dv_j += P_ij·dout_i; dS_ij = P_ij·(dout_i·v_j - Dr_i);
// dq_i += dS_ij·(k_j - k_mean)/sqrt(D); dk_j += dS_ij·q_i/sqrt(D).
void sage_backward(float *dq, float *dk, float *dv,
                   const float *dout, const float *q, const float *k, const float *v,
                   const float *out, const float *lse,
                   int B, int H, int N, int D, SageConfig cfg) {
    SageScratch s;
    if (scratch_alloc(&s, B, H, N, D, cfg, 0) != 0) {
        size_t n = (size_t)B * H * N * D;
        fail_with_nan("sage_backward", dq, n, dk, n, dv, n, B, H, N, D);
        return;
    }
    sage_quantize_qk(&s.qk, q, k, B, H, N, D, cfg);
    int nqb = ceil_div(N, cfg.q_block), nkb = ceil_div(N, cfg.k_block);
    const float scale = 1.0f / sqrtf((float)D);
    for (int bh = 0; bh < B * H; bh++) {
        size_t head = (size_t)bh * N * D;
        const float *mean = s.qk.k_mean + (size_t)bh * D;
        for (int i = 0; i < N; i++) {
            const int8_t *qi8 = s.qk.q8 + head + (size_t)i * D;
            const float *qi = q + head + (size_t)i * D;
            const float *doi = dout + head + (size_t)i * D;
            const float *oi = out + head + (size_t)i * D;
            float *dqi = dq + head + (size_t)i * D;
            float q_scale = s.qk.q_scale[(size_t)bh * nqb + i / cfg.q_block];
            float row_lse = lse[(size_t)bh * N + i];
            float dr = 0.0f;
            for (int d = 0; d < D; d++) dr += doi[d] * oi[d];
            for (int j = 0; j < N; j++) {
                const float *kj = k + head + (size_t)j * D;
                const float *vj = v + head + (size_t)j * D;
                float *dkj = dk + head + (size_t)j * D;
                float *dvj = dv + head + (size_t)j * D;
                float qk_scale = q_scale * s.qk.k_scale[(size_t)bh * nkb + j / cfg.k_block];
                float p = exp2f((float)dot_i8(qi8, s.qk.k8 + head + (size_t)j * D, D) * qk_scale - row_lse);
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
    scratch_free(&s);
}
