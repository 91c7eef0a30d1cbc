// Sage attention on the CPU: the executable form of the bit-level definition in attention.h
// (K smoothing, INT8 Q/K per token block, online base-2 softmax over key blocks, FP8 or FP16
// P·V with two-level accumulation), its backward, and the e4m3 / e5m2 / fp16 rounding helpers.
// The steps are exported one by one (quantizers, then attention on quantized inputs) so that
// ring attention runs the same code on shards with the global k_mean and v_scale; sage_forward
// and sage_backward are their composition.
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

// Nearest float8 e5m2 value (OCP: 5 exponent bits with bias 15, 2 mantissa bits, subnormals in
// steps of 2^-16, largest finite 57344), ties to even mantissa. |x| >= 57344 saturates to ±57344
// (the GPU's .satfinite conversion: the format's infinities are never produced); NaN stays NaN.
float round_to_e5m2(float x) {
    if (isnan(x)) return x;
    float ax = fabsf(x);
    if (ax >= 57344.0f) return copysignf(57344.0f, x);
    int e;
    frexpf(ax, &e);
    int step_exp = (e - 1 < -14 ? -14 : e - 1) - 2;
    float r = ldexpf(rintf(ldexpf(ax, -step_exp)), step_exp);
    return copysignf(r, x);                           // r <= 57344 = 7·2^13: ax/2^13 < 7
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

void hadamard_rotate(float *x, size_t rows, int D) {
    float norm = 1.0f / sqrtf((float)D);
    for (size_t r = 0; r < rows; r++) {
        float *v = x + r * D;
        for (int h = 1; h < D; h *= 2)   // fast Walsh-Hadamard transform: log2(D) butterfly stages
            for (int i = 0; i < D; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    float a = v[j], b = v[j + h];
                    v[j] = a + b;
                    v[j + h] = a - b;
                }
        for (int j = 0; j < D; j++) v[j] *= norm;
    }
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The API has no error return: when scratch cannot be allocated, say so on stderr and make
// the outputs NaN, so that no caller can take them for a result.
static void fill_nan(float *a, size_t na, float *b, size_t nb, float *c, size_t nc) {
    for (size_t i = 0; i < na; i++) a[i] = NAN;
    for (size_t i = 0; i < nb; i++) b[i] = NAN;
    for (size_t i = 0; i < nc; i++) c[i] = NAN;
}

static void fail_with_nan(const char *fn, float *a, size_t na, float *b, size_t nb,
                          float *c, size_t nc, int B, int H, int N, int D) {
    fprintf(stderr, "%s: out of memory for scratch (B=%d H=%d N=%d D=%d); outputs set to NaN\n",
            fn, B, H, N, D);
    fill_nan(a, na, b, nb, c, nc);
}

// ---- steps 1-2: quantization ----------------------------------------------------------------

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

// x (BH, n, D) in blocks of `block` tokens (the last one may be shorter) -> x8 (BH, n, D),
// scales (BH, ceil(n/block)). shift: (BH, D), one row per head, or NULL.
static void quantize_blocks(int8_t *x8, float *scales, const float *x, const float *shift,
                            float mul, int BH, int n, int D, int block) {
    int nb = ceil_div(n, block);
    for (int bh = 0; bh < BH; bh++)
        for (int b = 0; b < nb; b++) {
            int t0 = b * block, count = n - t0 < block ? n - t0 : block;
            size_t at = ((size_t)bh * n + t0) * D;
            scales[(size_t)bh * nb + b] = quantize_block(x8 + at, x + at,
                                                         shift ? shift + (size_t)bh * D : NULL,
                                                         mul, count, D);
        }
}

// Q blocks of q·log2(e)/sqrt(D) to int8 with scale amax/127.
void sage_quantize_q(int8_t *q8, float *q_scale, const float *q,
                     int B, int H, int n, int D, int q_block) {
    const float c = (1.0f / sqrtf((float)D)) * 1.44269504f;
    quantize_blocks(q8, q_scale, q, NULL, c, B * H, n, D, q_block);
}

// K blocks of (k - k_mean) to int8 with scale amax/127.
void sage_quantize_k(int8_t *k8, float *k_scale, const float *k, const float *k_mean,
                     int B, int H, int n, int D, int k_block) {
    quantize_blocks(k8, k_scale, k, k_mean, 1.0f, B * H, n, D, k_block);
}

// q, k: (B, H, N, D). Fills the caller-allocated arrays of qk (sizes in attention.h):
// k_mean = mean_n k (fp32 sum in token order, then / N), then Q and K as above.
void sage_quantize_qk(SageQK *qk, const float *q, const float *k,
                      int B, int H, int N, int D, SageConfig cfg) {
    for (int bh = 0; bh < B * H; bh++)
        for (int d = 0; d < D; d++) {
            float sum = 0.0f;
            for (int n = 0; n < N; n++) sum += k[((size_t)bh * N + n) * D + d];
            qk->k_mean[(size_t)bh * D + d] = sum / (float)N;
        }
    sage_quantize_q(qk->q8, qk->q_scale, q, B, H, N, D, cfg.q_block);
    sage_quantize_k(qk->k8, qk->k_scale, k, qk->k_mean, B, H, N, D, cfg.k_block);
}

// v_scale[bh, d] = max_t |v[bh, t, d]| / 448.
void sage_v_scale(float *v_scale, const float *v, int B, int H, int n, int D) {
    for (int bh = 0; bh < B * H; bh++)
        for (int d = 0; d < D; d++) {
            float amax = 0.0f;
            for (int t = 0; t < n; t++) amax = fmaxf(amax, fabsf(v[((size_t)bh * n + t) * D + d]));
            v_scale[(size_t)bh * D + d] = amax / 448.0f;
        }
}

// FP8: v_q = e4m3(v/v_scale_d) (0 where v_scale_d = 0). FP16: v_q = fp16(v).
void sage_quantize_v(float *v_q, const float *v, const float *v_scale,
                     int B, int H, int n, int D, SagePV pv) {
    for (size_t i = 0; i < (size_t)B * H * n * D; i++) {
        if (pv == SAGE_PV_FP16) {
            v_q[i] = round_to_fp16(v[i]);
        } else {
            float vs = v_scale[i / ((size_t)n * D) * D + i % D];   // head i/(n·D), channel i%D
            v_q[i] = vs > 0.0f ? round_to_e4m3(v[i] / vs) : 0.0f;
        }
    }
}

// ---- steps 3-5: attention of quantized inputs ------------------------------------------------

static int32_t dot_i8(const int8_t *a, const int8_t *b, int D) {
    int32_t sum = 0;
    for (int d = 0; d < D; d++) sum += (int32_t)a[d] * b[d];
    return sum;
}

// Per query row: key blocks of k_block in order with the running max m, sum l and
// accumulator acc; lse = m + log2(l) in the smoothed, quantized base-2 logits.
// Shapes in attention.h.
void sage_forward_quantized(float *out, float *lse,
                            const int8_t *q8, const float *q_scale,
                            const int8_t *k8, const float *k_scale,
                            const float *v_q, const float *v_scale,
                            int B, int H, int nq, int nk, int D, SageConfig cfg) {
    float *p = malloc((size_t)cfg.k_block * sizeof(float));   // P of one key block
    float *block_pv = malloc((size_t)D * sizeof(float));       // Σ_j P·V of one key block
    float *acc = malloc((size_t)D * sizeof(float));
    if (!p || !block_pv || !acc) {
        fail_with_nan("sage_forward_quantized", out, (size_t)B * H * nq * D, lse, (size_t)B * H * nq,
                      NULL, 0, B, H, nq, D);
        free(p); free(block_pv); free(acc);
        return;
    }
    int nqb = ceil_div(nq, cfg.q_block), nkb = ceil_div(nk, cfg.k_block);
    for (int bh = 0; bh < B * H; bh++) {
        const int8_t *k8_head = k8 + (size_t)bh * nk * D;
        const float *v_head = v_q + (size_t)bh * nk * D;
        for (int i = 0; i < nq; i++) {
            size_t row = (size_t)bh * nq + i;
            const int8_t *qi = q8 + row * D;
            float qs = q_scale[(size_t)bh * nqb + i / cfg.q_block];
            float m = -INFINITY, l = 0.0f;
            memset(acc, 0, (size_t)D * sizeof(float));
            for (int b = 0; b < nkb; b++) {
                int j0 = b * cfg.k_block, n = nk - j0 < cfg.k_block ? nk - j0 : cfg.k_block;
                float qk_scale = qs * k_scale[(size_t)bh * nkb + b];
                float m_new = m;
                for (int t = 0; t < n; t++) {
                    p[t] = (float)dot_i8(qi, k8_head + (size_t)(j0 + t) * D, D) * qk_scale;
                    m_new = fmaxf(m_new, p[t]);
                }
                float alpha = exp2f(m - m_new);
                float row_sum = 0.0f;
                memset(block_pv, 0, (size_t)D * sizeof(float));
                for (int t = 0; t < n; t++) {
                    float pt = exp2f(p[t] - m_new);
                    row_sum += pt;
                    float p_q = cfg.pv == SAGE_PV_FP8 ? round_to_e4m3(pt * 448.0f) : round_to_fp16(pt);
                    const float *vj = v_head + (size_t)(j0 + t) * D;
                    for (int d = 0; d < D; d++) block_pv[d] += p_q * vj[d];
                }
                l = l * alpha + row_sum;
                for (int d = 0; d < D; d++) acc[d] = acc[d] * alpha + block_pv[d];
                m = m_new;
            }
            float *oi = out + row * D;
            const float *vs = cfg.pv == SAGE_PV_FP8 ? v_scale + (size_t)bh * D : NULL;
            for (int d = 0; d < D; d++) oi[d] = vs ? acc[d] * vs[d] / 448.0f / l : acc[d] / l;
            lse[row] = m + log2f(l);
        }
    }
    free(p); free(block_pv); free(acc);
}

// x (n, m) to int8 with one scale per column j: amax_j = max_t |x_tj|, scale[j] = amax_j/127,
// x8_tj = rintf(x_tj·(127/amax_j)) (amax_j = 0 gives 0): quantize_block's rule per column.
static void quantize_columns(int8_t *x8, float *scale, const float *x, int n, int m) {
    for (int j = 0; j < m; j++) {
        float amax = 0.0f;
        for (int t = 0; t < n; t++) amax = fmaxf(amax, fabsf(x[t * m + j]));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int t = 0; t < n; t++) x8[t * m + j] = (int8_t)rintf(x[t * m + j] * inv);
        scale[j] = amax / 127.0f;
    }
}

// x (n, m) to int8 for a product that sums over columns (by_column 0: scale per row, n of them) or
// over rows (by_column 1: scale per column, m of them). SAGE_BWD_INT8_TOKEN: those per-row or
// per-column scales; SAGE_BWD_INT8_BLOCK: one scale for the whole tile, written into every entry.
static void quantize_tile(int8_t *x8, float *scale, const float *x, int n, int m, int by_column, SageBwd bwd) {
    int n_scale = by_column ? m : n;
    if (bwd == SAGE_BWD_INT8_BLOCK) {
        float s = quantize_block(x8, x, NULL, 1.0f, n, m);
        for (int t = 0; t < n_scale; t++) scale[t] = s;
    } else if (by_column) {
        quantize_columns(x8, scale, x, n, m);
    } else {
        for (int t = 0; t < n; t++) scale[t] = quantize_block(x8 + t * m, x + t * m, NULL, 1.0f, 1, m);
    }
}

// Scratch of the 8-bit backwards: one block of q_block queries × k_block keys and, for FP8, the
// operands of one head (nq queries, nk keys).
typedef struct {
    float *p, *ds, *dr;                 // P, dS (q_block, k_block); Dr of the block's rows (q_block)
    float *sum;                         // one product tile in fp32 (max(q_block, k_block), D)
    // INT8
    int8_t *p8, *dsq8, *dsk8;           // (q_block, k_block)
    float *p_scale, *dsk_scale;         // per key (k_block)
    float *dsq_scale;                   // per query (q_block)
    int8_t *do8;                        // dout of the query block (q_block, D)
    int32_t *isum;                      // one product tile (max(q_block, k_block), D)
    // FP8: the 8-bit float values, held in floats
    float *p8f, *ds8f;                  // (q_block, k_block)
    float *qe8, *do8f, *ke8;            // (nq, D), (nq, D), (nk, D)
    float *qe_scale, *do_scale, *ke_scale;   // per block (TILE modes) or one per head (BOUND modes)
    float *sigma, *ds_inv;              // BOUND: b_i/M_ds and M_ds/b_i per query (nq)
    float *tmp;                         // (max(nq, nk), D): ks, then q', before quantization
} Bwd8Scratch;

static void bwd8_scratch_free(Bwd8Scratch *w) {
    free(w->p); free(w->ds); free(w->dr); free(w->sum);
    free(w->p8); free(w->dsq8); free(w->dsk8); free(w->p_scale); free(w->dsk_scale); free(w->dsq_scale);
    free(w->do8); free(w->isum);
    free(w->p8f); free(w->ds8f); free(w->qe8); free(w->do8f); free(w->ke8);
    free(w->qe_scale); free(w->do_scale); free(w->ke_scale); free(w->sigma); free(w->ds_inv); free(w->tmp);
}

static int bwd_is_fp8(SageBwd b) { return b >= SAGE_BWD_FP8_TILE; }
static int bwd_is_bound(SageBwd b) { return b == SAGE_BWD_FP8_BOUND || b == SAGE_BWD_FP8_E5M2_BOUND; }
static int bwd_ds_e5m2(SageBwd b) { return b == SAGE_BWD_FP8_E5M2_TILE || b == SAGE_BWD_FP8_E5M2_BOUND; }

// Returns 0, or -1 when malloc fails (then nothing stays allocated).
static int bwd8_scratch_alloc(Bwd8Scratch *w, int qb, int kb, int nq, int nk, int D, SageBwd bwd) {
    memset(w, 0, sizeof(*w));
    size_t tile = (size_t)qb * kb, rows = qb > kb ? qb : kb, tokens = nq > nk ? nq : nk;
    int ok = (w->p = malloc(tile * sizeof(float))) && (w->ds = malloc(tile * sizeof(float))) &&
             (w->dr = malloc((size_t)qb * sizeof(float))) && (w->sum = malloc(rows * D * sizeof(float)));
    if (ok && !bwd_is_fp8(bwd))
        ok = (w->p8 = malloc(tile)) && (w->dsq8 = malloc(tile)) && (w->dsk8 = malloc(tile)) &&
             (w->p_scale = malloc((size_t)kb * sizeof(float))) && (w->dsk_scale = malloc((size_t)kb * sizeof(float))) &&
             (w->dsq_scale = malloc((size_t)qb * sizeof(float))) && (w->do8 = malloc((size_t)qb * D)) &&
             (w->isum = malloc(rows * D * sizeof(int32_t)));
    if (ok && bwd_is_fp8(bwd))
        ok = (w->p8f = malloc(tile * sizeof(float))) && (w->ds8f = malloc(tile * sizeof(float))) &&
             (w->qe8 = malloc((size_t)nq * D * sizeof(float))) && (w->do8f = malloc((size_t)nq * D * sizeof(float))) &&
             (w->ke8 = malloc((size_t)nk * D * sizeof(float))) &&
             (w->qe_scale = malloc((size_t)ceil_div(nq, qb) * sizeof(float))) &&
             (w->do_scale = malloc((size_t)ceil_div(nq, qb) * sizeof(float))) &&
             (w->ke_scale = malloc((size_t)ceil_div(nk, kb) * sizeof(float))) &&
             (w->sigma = malloc((size_t)nq * sizeof(float))) && (w->ds_inv = malloc((size_t)nq * sizeof(float))) &&
             (w->tmp = malloc(tokens * D * sizeof(float)));
    if (ok) return 0;
    bwd8_scratch_free(w);
    return -1;
}

// sum (nj, D) = aᵀ·b with a (ni, nj) and b (ni, D) int8: int32 sums over the ni rows (acc), then
// each converted to fp32.
static void int8_product_tn(float *sum, int32_t *acc, const int8_t *a, const int8_t *b, int ni, int nj, int D) {
    memset(acc, 0, (size_t)nj * D * sizeof(int32_t));
    for (int i = 0; i < ni; i++)
        for (int j = 0; j < nj; j++) {
            int32_t aij = a[i * nj + j];
            for (int d = 0; d < D; d++) acc[(size_t)j * D + d] += aij * b[(size_t)i * D + d];
        }
    for (size_t t = 0; t < (size_t)nj * D; t++) sum[t] = (float)acc[t];
}

// sum (ni, D) = a·b with a (ni, nj) and b (nj, D) int8: int32 sums over the nj columns, then fp32.
static void int8_product_nn(float *sum, int32_t *acc, const int8_t *a, const int8_t *b, int ni, int nj, int D) {
    memset(acc, 0, (size_t)ni * D * sizeof(int32_t));
    for (int i = 0; i < ni; i++)
        for (int j = 0; j < nj; j++) {
            int32_t aij = a[i * nj + j];
            for (int d = 0; d < D; d++) acc[(size_t)i * D + d] += aij * b[(size_t)j * D + d];
        }
    for (size_t t = 0; t < (size_t)ni * D; t++) sum[t] = (float)acc[t];
}

// The FP8 products: the same shapes with 8-bit float values (exact products), fp32 sums in order.
static void fp8_product_tn(float *sum, const float *a, const float *b, int ni, int nj, int D) {
    memset(sum, 0, (size_t)nj * D * sizeof(float));
    for (int i = 0; i < ni; i++)
        for (int j = 0; j < nj; j++)
            for (int d = 0; d < D; d++) sum[(size_t)j * D + d] += a[i * nj + j] * b[(size_t)i * D + d];
}

static void fp8_product_nn(float *sum, const float *a, const float *b, int ni, int nj, int D) {
    memset(sum, 0, (size_t)ni * D * sizeof(float));
    for (int i = 0; i < ni; i++)
        for (int j = 0; j < nj; j++)
            for (int d = 0; d < D; d++) sum[(size_t)i * D + d] += a[i * nj + j] * b[(size_t)j * D + d];
}

// y (rows, D) += sum · ((row_scale[r]·a)·b) in fp32, one factor per row r (row_scale NULL: 1).
static void add_scaled_rows(float *y, const float *sum, const float *row_scale, float a, float b, int rows, int D) {
    for (int r = 0; r < rows; r++) {
        float f = ((row_scale ? row_scale[r] : 1.0f) * a) * b;
        for (int d = 0; d < D; d++) y[(size_t)r * D + d] += sum[(size_t)r * D + d] * f;
    }
}

// n values x to e4m3 (largest M = 448) or e5m2 (M = 57344) over one set: amax = max|x|,
// y = F(x·(M/amax)); returns amax/M (amax = 0 gives y = 0 and 0).
static float quantize_fp8(float *y, const float *x, size_t n, int e5m2) {
    float big = e5m2 ? 57344.0f : 448.0f, amax = 0.0f;
    for (size_t t = 0; t < n; t++) amax = fmaxf(amax, fabsf(x[t]));
    float inv = amax > 0.0f ? big / amax : 0.0f;
    for (size_t t = 0; t < n; t++) y[t] = e5m2 ? round_to_e5m2(x[t] * inv) : round_to_e4m3(x[t] * inv);
    return amax / big;
}

// x (n, D) to e4m3 in sets of `block` tokens (the last may be shorter) -> y (n, D), scales (ceil(n/block)).
static void quantize_fp8_blocks(float *y, float *scales, const float *x, int n, int D, int block) {
    for (int t0 = 0; t0 < n; t0 += block) {
        int count = n - t0 < block ? n - t0 : block;
        scales[t0 / block] = quantize_fp8(y + (size_t)t0 * D, x + (size_t)t0 * D, (size_t)count * D, 0);
    }
}

static float dot_f32(const float *a, const float *b, int D) {
    float sum = 0.0f;
    for (int d = 0; d < D; d++) sum += a[d] * b[d];
    return sum;
}

// Step a of the FP8 backward for one head: dout, q, out (nq, D), lse (nq); k, v (nk, D); k_mean (D);
// q8, q_scale, k8, k_scale of the head (for m_i). Fills w's qe8, do8f, ke8, their scales and,
// BOUND, sigma and ds_inv.
static void fp8_head_operands(Bwd8Scratch *w, const float *dout, const float *q, const float *out, const float *lse,
                              const float *k, const float *v, const float *k_mean,
                              const int8_t *q8, const float *q_scale, const int8_t *k8, const float *k_scale,
                              int nq, int nk, int D, SageConfig cfg) {
    int bound = bwd_is_bound(cfg.bwd), qblk = bound ? nq : cfg.q_block, kblk = bound ? nk : cfg.k_block;
    for (int j = 0; j < nk; j++)
        for (int d = 0; d < D; d++) w->tmp[(size_t)j * D + d] = k[(size_t)j * D + d] - k_mean[d];
    quantize_fp8_blocks(w->ke8, w->ke_scale, w->tmp, nk, D, kblk);
    quantize_fp8_blocks(w->do8f, w->do_scale, dout, nq, D, qblk);
    if (!bound) {
        quantize_fp8_blocks(w->qe8, w->qe_scale, q, nq, D, qblk);
        return;
    }
    // b_i = 2^(m_i - lse_i)·(|dout_i|·vmax + |Dr_i|) >= |dS_ij|; q'_i = sigma_i·q_i
    float big = bwd_ds_e5m2(cfg.bwd) ? 57344.0f : 448.0f, vmax = 0.0f;
    for (int j = 0; j < nk; j++) vmax = fmaxf(vmax, sqrtf(dot_f32(v + (size_t)j * D, v + (size_t)j * D, D)));
    for (int i = 0; i < nq; i++) {
        const float *doi = dout + (size_t)i * D;
        float qs = q_scale[i / cfg.q_block], m = -INFINITY;
        for (int j = 0; j < nk; j++)
            m = fmaxf(m, (float)dot_i8(q8 + (size_t)i * D, k8 + (size_t)j * D, D) * (qs * k_scale[j / cfg.k_block]));
        float b = exp2f(m - lse[i]) * (sqrtf(dot_f32(doi, doi, D)) * vmax + fabsf(dot_f32(doi, out + (size_t)i * D, D)));
        w->sigma[i] = b / big;
        w->ds_inv[i] = b > 0.0f ? big / b : 0.0f;
        for (int d = 0; d < D; d++) w->tmp[(size_t)i * D + d] = w->sigma[i] * q[(size_t)i * D + d];
    }
    quantize_fp8_blocks(w->qe8, w->qe_scale, w->tmp, nq, D, nq);
}

// Steps b (quantization) and c of the INT8 backward for block (I, J) from w->p, w->ds; do8 and
// do_scale of block I are in w. Blocks of dv, dk (nj, D) and dq (ni, D); q8, k8 of the blocks.
static void int8_block_products(Bwd8Scratch *w, float *dq, float *dk, float *dv, const int8_t *q8, float qs,
                                const int8_t *k8, float ks, float do_scale, int ni, int nj, int D, float r, float u,
                                SageBwd bwd) {
    quantize_tile(w->p8, w->p_scale, w->p, ni, nj, 1, bwd);
    quantize_tile(w->dsq8, w->dsq_scale, w->ds, ni, nj, 0, bwd);
    quantize_tile(w->dsk8, w->dsk_scale, w->ds, ni, nj, 1, bwd);
    int8_product_tn(w->sum, w->isum, w->p8, w->do8, ni, nj, D);   // dv_J += p8ᵀ·do8
    add_scaled_rows(dv, w->sum, w->p_scale, do_scale, 1.0f, nj, D);
    int8_product_tn(w->sum, w->isum, w->dsk8, q8, ni, nj, D);     // dk_J += ds8ᵀ·q8_I
    add_scaled_rows(dk, w->sum, w->dsk_scale, qs, u, nj, D);
    int8_product_nn(w->sum, w->isum, w->dsq8, k8, ni, nj, D);     // dq_I += ds8·k8_J
    add_scaled_rows(dq, w->sum, w->dsq_scale, ks, r, ni, D);
}

// Steps b (quantization) and c of the FP8 backward for block (I, J) of query block bi (first query
// i0) and key block bj (first key j0) from w->p, w->ds and the head's operands in w.
static void fp8_block_products(Bwd8Scratch *w, float *dq, float *dk, float *dv, int bi, int i0, int bj, int j0,
                               int ni, int nj, int D, float r, SageBwd bwd) {
    int bound = bwd_is_bound(bwd), e5m2 = bwd_ds_e5m2(bwd);
    float qe_scale = w->qe_scale[bound ? 0 : bi], do_scale = w->do_scale[bound ? 0 : bi];
    float ke_scale = w->ke_scale[bound ? 0 : bj], ds_scale = 1.0f;
    for (int t = 0; t < ni * nj; t++) w->p8f[t] = round_to_e4m3(w->p[t] * 448.0f);
    if (bound) {
        for (int i = 0; i < ni; i++)
            for (int j = 0; j < nj; j++) {
                float x = w->ds[i * nj + j] * w->ds_inv[i0 + i];
                w->ds8f[i * nj + j] = e5m2 ? round_to_e5m2(x) : round_to_e4m3(x);
            }
    } else {
        ds_scale = quantize_fp8(w->ds8f, w->ds, (size_t)ni * nj, e5m2);
    }
    const float *qe8 = w->qe8 + (size_t)i0 * D, *do8 = w->do8f + (size_t)i0 * D, *ke8 = w->ke8 + (size_t)j0 * D;
    fp8_product_tn(w->sum, w->p8f, do8, ni, nj, D);    // dv_J += p8ᵀ·do8
    add_scaled_rows(dv, w->sum, NULL, do_scale / 448.0f, 1.0f, nj, D);
    fp8_product_tn(w->sum, w->ds8f, qe8, ni, nj, D);   // dk_J += ds8ᵀ·qe8_I
    add_scaled_rows(dk, w->sum, NULL, bound ? qe_scale : ds_scale * qe_scale, r, nj, D);
    fp8_product_nn(w->sum, w->ds8f, ke8, ni, nj, D);   // dq_I += ds8·ke8_J
    add_scaled_rows(dq, w->sum, bound ? w->sigma + i0 : NULL, bound ? ke_scale : ds_scale * ke_scale, r, ni, D);
}

// The INT8 and FP8 backwards of attention.h (cfg.bwd != SAGE_BWD_FP32) over the nk keys given.
// dout, q, out, dq: (B, H, nq, D); lse (B, H, nq); k, v, dk, dv: (B, H, nk, D); q8/k8 and scales as
// in sage_forward_quantized; k_mean (B, H, D). Block (I, J): P, dS (ni × nj) in fp32, then 8-bit
// with the scales of cfg.bwd; dv_J += p8ᵀ·do8, dk_J += ds8ᵀ·q8_I, dq_I += ds8·k8_J, each block's
// product scaled once and added in fp32.
static void backward_8bit(float *dq, float *dk, float *dv,
                          const float *dout, const float *q, const float *k, const float *v,
                          const float *out, const float *lse,
                          const int8_t *q8, const float *q_scale, const int8_t *k8, const float *k_scale,
                          const float *k_mean, int B, int H, int nq, int nk, int D, SageConfig cfg) {
    int qb = cfg.q_block, kb = cfg.k_block, nqb = ceil_div(nq, qb), nkb = ceil_div(nk, kb), fp8 = bwd_is_fp8(cfg.bwd);
    const float r = 1.0f / sqrtf((float)D);
    const float u = r / (r * 1.44269504f);   // undoes sage_quantize_q's c = (1/sqrtf(D))·log2(e)
    Bwd8Scratch w;
    if (bwd8_scratch_alloc(&w, qb, kb, nq, nk, D, cfg.bwd) != 0) {
        size_t n_q = (size_t)B * H * nq * D, n_k = (size_t)B * H * nk * D;
        fail_with_nan("sage_backward_quantized", dq, n_q, dk, n_k, dv, n_k, B, H, nq, D);
        return;
    }
    for (int bh = 0; bh < B * H; bh++) {
        size_t q_head = (size_t)bh * nq * D, k_head = (size_t)bh * nk * D;
        if (fp8)
            fp8_head_operands(&w, dout + q_head, q + q_head, out + q_head, lse + (size_t)bh * nq, k + k_head,
                              v + k_head, k_mean + (size_t)bh * D, q8 + q_head, q_scale + (size_t)bh * nqb,
                              k8 + k_head, k_scale + (size_t)bh * nkb, nq, nk, D, cfg);
        for (int bi = 0; bi < nqb; bi++) {
            int i0 = bi * qb, ni = nq - i0 < qb ? nq - i0 : qb;
            const float *do_blk = dout + q_head + (size_t)i0 * D;
            const int8_t *q8_blk = q8 + q_head + (size_t)i0 * D;
            float *dq_blk = dq + q_head + (size_t)i0 * D;
            float qs = q_scale[(size_t)bh * nqb + bi];
            float do_scale = fp8 ? 0.0f : quantize_block(w.do8, do_blk, NULL, 1.0f, ni, D);
            for (int i = 0; i < ni; i++)
                w.dr[i] = dot_f32(do_blk + (size_t)i * D, out + q_head + (size_t)(i0 + i) * D, D);
            for (int bj = 0; bj < nkb; bj++) {
                int j0 = bj * kb, nj = nk - j0 < kb ? nk - j0 : kb;
                const int8_t *k8_blk = k8 + k_head + (size_t)j0 * D;
                const float *v_blk = v + k_head + (size_t)j0 * D;
                float *dk_blk = dk + k_head + (size_t)j0 * D, *dv_blk = dv + k_head + (size_t)j0 * D;
                float ks = k_scale[(size_t)bh * nkb + bj];
                for (int i = 0; i < ni; i++) {
                    const float *doi = do_blk + (size_t)i * D;
                    float lse_i = lse[(size_t)bh * nq + i0 + i];
                    for (int j = 0; j < nj; j++) {
                        float s = (float)dot_i8(q8_blk + (size_t)i * D, k8_blk + (size_t)j * D, D) * (qs * ks);
                        float p = exp2f(s - lse_i);
                        float dp = dot_f32(doi, v_blk + (size_t)j * D, D);
                        w.p[i * nj + j] = p;
                        w.ds[i * nj + j] = p * (dp - w.dr[i]);
                    }
                }
                if (fp8)
                    fp8_block_products(&w, dq_blk, dk_blk, dv_blk, bi, i0, bj, j0, ni, nj, D, r, cfg.bwd);
                else
                    int8_block_products(&w, dq_blk, dk_blk, dv_blk, q8_blk, qs, k8_blk, ks, do_scale, ni, nj, D, r, u,
                                        cfg.bwd);
            }
        }
    }
    bwd8_scratch_free(&w);
}

// s_ij recomputed from q8, k8 and their scales; P_ij = 2^(s_ij - lse_i);
// Dr_i = Σ_d dout_id·out_id; dv_j += P_ij·dout_i; dS_ij = P_ij·(dout_i·v_j - Dr_i);
// dq_i += dS_ij·(k_j - k_mean)/sqrt(D); dk_j += dS_ij·q_i/sqrt(D). Shapes in attention.h.
void sage_backward_quantized(float *dq, float *dk, float *dv,
                             const float *dout, const float *q, const float *k, const float *v,
                             const float *out, const float *lse,
                             const int8_t *q8, const float *q_scale,
                             const int8_t *k8, const float *k_scale, const float *k_mean,
                             int B, int H, int nq, int nk, int D, SageConfig cfg) {
    if ((unsigned)cfg.bwd > SAGE_BWD_FP8_E5M2_BOUND) {
        fprintf(stderr, "sage_backward_quantized: SageConfig.bwd = %d is not a SageBwd (0..%d); gradients set to NaN\n",
                (int)cfg.bwd, (int)SAGE_BWD_FP8_E5M2_BOUND);
        fill_nan(dq, (size_t)B * H * nq * D, dk, (size_t)B * H * nk * D, dv, (size_t)B * H * nk * D);
        return;
    }
    if (cfg.bwd != SAGE_BWD_FP32) {
        backward_8bit(dq, dk, dv, dout, q, k, v, out, lse, q8, q_scale, k8, k_scale, k_mean, B, H, nq, nk, D, cfg);
        return;
    }
    int nqb = ceil_div(nq, cfg.q_block), nkb = ceil_div(nk, cfg.k_block);
    const float scale = 1.0f / sqrtf((float)D);
    for (int bh = 0; bh < B * H; bh++) {
        size_t k_head = (size_t)bh * nk * D;
        const float *mean = k_mean + (size_t)bh * D;
        for (int i = 0; i < nq; i++) {
            size_t row = (size_t)bh * nq + i;
            const int8_t *qi8 = q8 + row * D;
            const float *qi = q + row * D, *doi = dout + row * D, *oi = out + row * D;
            float *dqi = dq + row * D;
            float qs = q_scale[(size_t)bh * nqb + i / cfg.q_block];
            float dr = 0.0f;
            for (int d = 0; d < D; d++) dr += doi[d] * oi[d];
            for (int j = 0; j < nk; j++) {
                size_t at = k_head + (size_t)j * D;
                const float *kj = k + at, *vj = v + at;
                float *dkj = dk + at, *dvj = dv + at;
                float qk_scale = qs * k_scale[(size_t)bh * nkb + j / cfg.k_block];
                float p = exp2f((float)dot_i8(qi8, k8 + at, D) * qk_scale - lse[row]);
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

// ---- the whole: sage_forward and sage_backward --------------------------------------------------

// Scratch of one sage call: the quantized Q/K and, for the forward, V as P·V sees it.
typedef struct {
    SageQK qk;
    float *v_q;       // (B, H, N, D): e4m3(v/v_scale) for FP8, fp16(v) for FP16
    float *v_scale;   // (B, H, D): max_n|v|/448 (FP8 only)
    float *q_rot, *k_rot, *dq_rot, *dk_rot;   // cfg.rotate: qH, kH and their gradients, (B, H, N, D)
} SageScratch;

static void scratch_free(SageScratch *s) {
    free(s->qk.q8); free(s->qk.k8); free(s->qk.q_scale); free(s->qk.k_scale); free(s->qk.k_mean);
    free(s->v_q); free(s->v_scale);
    free(s->q_rot); free(s->k_rot); free(s->dq_rot); free(s->dk_rot);
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
        s->v_q = malloc(n_qkv * sizeof(float));
        s->v_scale = malloc((size_t)B * H * D * sizeof(float));
        ok = ok && s->v_q && s->v_scale;
    }
    if (cfg.rotate) {
        s->q_rot = malloc(n_qkv * sizeof(float));
        s->k_rot = malloc(n_qkv * sizeof(float));
        ok = ok && s->q_rot && s->k_rot;
        if (!forward) {
            s->dq_rot = calloc(n_qkv, sizeof(float));
            s->dk_rot = calloc(n_qkv, sizeof(float));
            ok = ok && s->dq_rot && s->dk_rot;
        }
    }
    if (ok) return 0;
    scratch_free(s);
    return -1;
}

// cfg.rotate: points *q, *k at rotated copies qH, kH in the scratch.
static void rotate_qk(SageScratch *s, const float **q, const float **k, size_t rows, int D) {
    memcpy(s->q_rot, *q, rows * D * sizeof(float));
    memcpy(s->k_rot, *k, rows * D * sizeof(float));
    hadamard_rotate(s->q_rot, rows, D);
    hadamard_rotate(s->k_rot, rows, D);
    *q = s->q_rot;
    *k = s->k_rot;
}

// q, k, v, out: (B, H, N, D); lse: (B, H, N). Steps 1-2 (sage_quantize_qk; v_scale and V
// rounding of step 4), then steps 3-5 over all N keys.
void sage_forward(float *out, float *lse,
                  const float *q, const float *k, const float *v,
                  int B, int H, int N, int D, SageConfig cfg) {
    SageScratch s;
    if (scratch_alloc(&s, B, H, N, D, cfg, 1) != 0) {
        fail_with_nan("sage_forward", out, (size_t)B * H * N * D, lse, (size_t)B * H * N,
                      NULL, 0, B, H, N, D);
        return;
    }
    if (cfg.rotate) rotate_qk(&s, &q, &k, (size_t)B * H * N, D);
    sage_quantize_qk(&s.qk, q, k, B, H, N, D, cfg);
    if (cfg.pv == SAGE_PV_FP8) sage_v_scale(s.v_scale, v, B, H, N, D);
    sage_quantize_v(s.v_q, v, s.v_scale, B, H, N, D, cfg.pv);
    sage_forward_quantized(out, lse, s.qk.q8, s.qk.q_scale, s.qk.k8, s.qk.k_scale, s.v_q, s.v_scale,
                           B, H, N, N, D, cfg);
    scratch_free(&s);
}

// Shapes as in sage_forward; out and lse are sage_forward's; dq, dk, dv accumulate (+=).
// The same q8, k8 and scales as the forward, then the backward over all N keys.
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
    size_t rows = (size_t)B * H * N;
    if (cfg.rotate) rotate_qk(&s, &q, &k, rows, D);
    sage_quantize_qk(&s.qk, q, k, B, H, N, D, cfg);
    sage_backward_quantized(cfg.rotate ? s.dq_rot : dq, cfg.rotate ? s.dk_rot : dk, dv, dout, q, k, v, out, lse,
                            s.qk.q8, s.qk.q_scale, s.qk.k8, s.qk.k_scale, s.qk.k_mean,
                            B, H, N, N, D, cfg);
    if (cfg.rotate) {   // the gradients of q = q'Hᵀ, k = k'Hᵀ: dq = dq'H, dk = dk'H (H = Hᵀ)
        hadamard_rotate(s.dq_rot, rows, D);
        hadamard_rotate(s.dk_rot, rows, D);
        for (size_t i = 0; i < rows * D; i++) {
            dq[i] += s.dq_rot[i];
            dk[i] += s.dk_rot[i];
        }
    }
    scratch_free(&s);
}
