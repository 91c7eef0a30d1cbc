// Tests of the CPU layers in layers/layers.h.
// - grad/*: every backward against central finite differences (test/gradcheck.h) of
//   L = Σ w∘forward(...) with random w; forward in fp32, L in double, step h = GRAD_H.
//   Per tensor ‖analytic - numeric‖/‖numeric‖ ≤ GRAD_TOL. Each backward is also called twice on
//   zeroed buffers (the gradients must double: backwards accumulate) and with the NULL gradient
//   pointers the implementation accepts.
// - forward/*: forwards against independent formulas (direct convolution, DiT's einsum unpatchify,
//   DiT's numpy get_2d_sincos_pos_embed run by /usr/bin/python3, double-precision transcriptions).
// - forward/flow_matching_sample_*: the per-step draws (order, determinism, statistics).
// - optim/*: AdamW against a double transcription of torch.optim.AdamW, EMA, global norm.
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "layers/common.h"
#include "layers/layers.h"
#include "test/gradcheck.h"

// Finite-difference step and tolerance. With the forward in fp32 and L in double, the rounding
// noise of a central difference is about ε_fp32·|out|/h ≈ 1e-4 relative at h = 1e-3, and the
// truncation error O(h²) is smaller still; measured errors are 1e-7 .. 1e-5 (see the --verbose log).
#define GRAD_H 1e-3f
#define GRAD_TOL 1e-3
// Calling a backward twice on zeroed buffers must give twice the gradient of one call
// (only the order of the fp32 additions differs).
#define ACCUM_TOL 1e-6

// ---- helpers -----------------------------------------------------------------------------

static float *randn(Rng *rng, size_t n, float std) {
    float *x = malloc(n * sizeof(float));
    cr_assert(x, "malloc of %zu floats", n);
    rng_fill_normal(rng, x, n, std);
    return x;
}

static float *zeros(size_t n) {
    float *x = calloc(n, sizeof(float));
    cr_assert(x, "calloc of %zu floats", n);
    return x;
}

static double *dzeros(size_t n) {
    double *x = calloc(n, sizeof(double));
    cr_assert(x, "calloc of %zu doubles", n);
    return x;
}

// ‖a - ref‖/‖ref‖ for two fp32 tensors.
static double rel_error_f(const float *a, const float *ref, size_t n) {
    double *r = dzeros(n);
    for (size_t i = 0; i < n; i++) r[i] = ref[i];
    double err = gc_rel_error(a, r, n);
    free(r);
    return err;
}

// gc_numeric_grad with one OpenMP thread: its thousands of tiny forwards would otherwise spend
// most of their time in thread barriers when the tests run in parallel on a loaded machine.
// The analytic backwards keep the default thread count.
static void numeric_grad_serial(double *grad, float *x, size_t n, float h, gc_loss_fn loss, void *ctx) {
#ifdef _OPENMP
    int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    gc_numeric_grad(grad, x, n, h, loss, ctx);
    omp_set_num_threads(threads);
#else
    gc_numeric_grad(grad, x, n, h, loss, ctx);
#endif
}

// Checks the analytic gradient `grad` of the tensor x (n floats) against central differences.
static void check_grad(const char *name, const float *grad, float *x, size_t n,
                       gc_loss_fn loss, void *ctx) {
    double *numeric = dzeros(n);
    numeric_grad_serial(numeric, x, n, GRAD_H, loss, ctx);
    double err = gc_rel_error(grad, numeric, n);
    cr_log_info("%-28s rel error %.2e (tol %.0e)", name, err, GRAD_TOL);
    cr_expect(err <= GRAD_TOL, "%s: |analytic - numeric|/|numeric| = %.3e > %.0e", name, err, GRAD_TOL);
    free(numeric);
}

// Checks that `twice` (two backward calls into zeroed buffers) equals 2·`once`.
static void check_doubled(const char *name, const float *twice, const float *once, size_t n) {
    double *ref = dzeros(n);
    for (size_t i = 0; i < n; i++) ref[i] = 2.0 * once[i];
    double err = gc_rel_error(twice, ref, n);
    cr_expect(err <= ACCUM_TOL, "%s: two backward calls give %.3e (rel) away from twice one call: "
              "the backward must accumulate (+=)", name, err);
    free(ref);
}

// Copies the C-float chunk at `offset` of each sample's modulation vector (stride floats apart).
static void gather_chunk(float *dst, const float *mod, int B, int C, int stride, int offset) {
    for (int b = 0; b < B; b++) memcpy(dst + (size_t)b * C, mod + (size_t)b * stride + offset, C * sizeof(float));
}

// Checks that every modulation chunk except those at the listed offsets is still zero.
static void check_other_chunks_zero(const char *name, const float *dmod, int B, int C, int stride,
                                    int used_a, int used_b) {
    for (int b = 0; b < B; b++)
        for (int off = 0; off < stride; off += C) {
            if (off == used_a || off == used_b) continue;
            for (int c = 0; c < C; c++)
                cr_expect(dmod[(size_t)b * stride + off + c] == 0.0f,
                          "%s: gradient written into the chunk at offset %d of sample %d", name, off, b);
        }
}

// ---- grad: reshapes ----------------------------------------------------------------------

typedef struct { float *img, *tokens, *w; int B, Cout, S, p; } UnpatchifyCtx;

static double unpatchify_loss(void *p) {
    UnpatchifyCtx *c = p;
    unpatchify_forward(c->img, c->tokens, c->B, c->Cout, c->S, c->p);
    return gc_dot(c->w, c->img, (size_t)c->B * c->Cout * c->S * c->S);
}

Test(grad, unpatchify) {
    Rng rng; rng_seed(&rng, 1);
    UnpatchifyCtx c = { .B = 2, .Cout = 3, .S = 6, .p = 2 };
    size_t n = (size_t)c.B * c.Cout * c.S * c.S;   // tokens and image hold the same elements
    c.img = zeros(n); c.tokens = randn(&rng, n, 1.0f); c.w = randn(&rng, n, 1.0f);
    float *dtokens = zeros(n);
    unpatchify_backward(dtokens, c.w, c.B, c.Cout, c.S, c.p);
    check_grad("unpatchify dtokens", dtokens, c.tokens, n, unpatchify_loss, &c);
    float *twice = zeros(n);
    unpatchify_backward(twice, c.w, c.B, c.Cout, c.S, c.p);
    unpatchify_backward(twice, c.w, c.B, c.Cout, c.S, c.p);
    check_doubled("unpatchify dtokens", twice, dtokens, n);
    free(c.img); free(c.tokens); free(c.w); free(dtokens); free(twice);
}

typedef struct { float *q, *k, *v, *qkv, *wq, *wk, *wv; int B, T, H, D; } SplitCtx;

static double split_heads_loss(void *p) {
    SplitCtx *c = p;
    size_t n = (size_t)c->B * c->H * c->T * c->D;
    split_heads_forward(c->q, c->k, c->v, c->qkv, c->B, c->T, c->H, c->D);
    return gc_dot(c->wq, c->q, n) + gc_dot(c->wk, c->k, n) + gc_dot(c->wv, c->v, n);
}

Test(grad, split_heads) {
    Rng rng; rng_seed(&rng, 2);
    SplitCtx c = { .B = 2, .T = 5, .H = 3, .D = 4 };
    size_t n = (size_t)c.B * c.H * c.T * c.D;
    c.q = zeros(n); c.k = zeros(n); c.v = zeros(n); c.qkv = randn(&rng, 3 * n, 1.0f);
    c.wq = randn(&rng, n, 1.0f); c.wk = randn(&rng, n, 1.0f); c.wv = randn(&rng, n, 1.0f);
    float *dqkv = zeros(3 * n), *twice = zeros(3 * n);
    split_heads_backward(dqkv, c.wq, c.wk, c.wv, c.B, c.T, c.H, c.D);
    check_grad("split_heads dqkv", dqkv, c.qkv, 3 * n, split_heads_loss, &c);
    split_heads_backward(twice, c.wq, c.wk, c.wv, c.B, c.T, c.H, c.D);
    split_heads_backward(twice, c.wq, c.wk, c.wv, c.B, c.T, c.H, c.D);
    check_doubled("split_heads dqkv", twice, dqkv, 3 * n);
    free(c.q); free(c.k); free(c.v); free(c.qkv); free(c.wq); free(c.wk); free(c.wv);
    free(dqkv); free(twice);
}

typedef struct { float *out, *o, *w; int B, T, H, D; } MergeCtx;

static double merge_heads_loss(void *p) {
    MergeCtx *c = p;
    merge_heads_forward(c->out, c->o, c->B, c->T, c->H, c->D);
    return gc_dot(c->w, c->out, (size_t)c->B * c->T * c->H * c->D);
}

Test(grad, merge_heads) {
    Rng rng; rng_seed(&rng, 3);
    MergeCtx c = { .B = 2, .T = 5, .H = 3, .D = 4 };
    size_t n = (size_t)c.B * c.H * c.T * c.D;
    c.out = zeros(n); c.o = randn(&rng, n, 1.0f); c.w = randn(&rng, n, 1.0f);
    float *d_o = zeros(n), *twice = zeros(n);
    merge_heads_backward(d_o, c.w, c.B, c.T, c.H, c.D);
    check_grad("merge_heads do", d_o, c.o, n, merge_heads_loss, &c);
    merge_heads_backward(twice, c.w, c.B, c.T, c.H, c.D);
    merge_heads_backward(twice, c.w, c.B, c.T, c.H, c.D);
    check_doubled("merge_heads do", twice, d_o, n);
    free(c.out); free(c.o); free(c.w); free(d_o); free(twice);
}

// ---- grad: linear ------------------------------------------------------------------------

typedef struct { float *out, *inp, *weight, *bias, *w; int M, IC, OC; } LinearCtx;

static double linear_loss(void *p) {
    LinearCtx *c = p;
    linear_forward(c->out, c->inp, c->weight, c->bias, c->M, c->IC, c->OC);
    return gc_dot(c->w, c->out, (size_t)c->M * c->OC);
}

Test(grad, linear) {
    Rng rng; rng_seed(&rng, 4);
    LinearCtx c = { .M = 5, .IC = 7, .OC = 6 };
    size_t n_in = (size_t)c.M * c.IC, n_w = (size_t)c.OC * c.IC, n_out = (size_t)c.M * c.OC;
    c.out = zeros(n_out); c.inp = randn(&rng, n_in, 1.0f); c.weight = randn(&rng, n_w, 0.5f);
    c.bias = randn(&rng, c.OC, 1.0f); c.w = randn(&rng, n_out, 1.0f);
    float *dinp = zeros(n_in), *dweight = zeros(n_w), *dbias = zeros(c.OC);
    linear_backward(dinp, dweight, dbias, c.w, c.inp, c.weight, c.M, c.IC, c.OC);
    check_grad("linear dinp", dinp, c.inp, n_in, linear_loss, &c);
    check_grad("linear dweight", dweight, c.weight, n_w, linear_loss, &c);
    check_grad("linear dbias", dbias, c.bias, c.OC, linear_loss, &c);

    float *dinp2 = zeros(n_in), *dweight2 = zeros(n_w), *dbias2 = zeros(c.OC);
    for (int call = 0; call < 2; call++)
        linear_backward(dinp2, dweight2, dbias2, c.w, c.inp, c.weight, c.M, c.IC, c.OC);
    check_doubled("linear dinp", dinp2, dinp, n_in);
    check_doubled("linear dweight", dweight2, dweight, n_w);
    check_doubled("linear dbias", dbias2, dbias, c.OC);

    // the first layer of a network needs no dinp, and a layer without bias no dbias
    float *dweight3 = zeros(n_w);
    linear_backward(NULL, dweight3, NULL, c.w, c.inp, c.weight, c.M, c.IC, c.OC);
    cr_expect(rel_error_f(dweight3, dweight, n_w) <= ACCUM_TOL, "linear dweight with dinp = dbias = NULL");
    free(c.out); free(c.inp); free(c.weight); free(c.bias); free(c.w);
    free(dinp); free(dweight); free(dbias); free(dinp2); free(dweight2); free(dbias2); free(dweight3);
}

// The forward with and without bias against a double-precision matrix product.
Test(forward, linear_bias_and_no_bias) {
    Rng rng; rng_seed(&rng, 5);
    int M = 9, IC = 13, OC = 11;
    float *inp = randn(&rng, (size_t)M * IC, 1.0f), *weight = randn(&rng, (size_t)OC * IC, 1.0f);
    float *bias = randn(&rng, OC, 1.0f), *out = zeros((size_t)M * OC);
    double *ref = dzeros((size_t)M * OC);
    for (int with_bias = 0; with_bias <= 1; with_bias++) {
        linear_forward(out, inp, weight, with_bias ? bias : NULL, M, IC, OC);
        for (int m = 0; m < M; m++)
            for (int o = 0; o < OC; o++) {
                double acc = with_bias ? bias[o] : 0.0;
                for (int i = 0; i < IC; i++) acc += (double)inp[m * IC + i] * weight[o * IC + i];
                ref[m * OC + o] = acc;
            }
        double err = gc_rel_error(out, ref, (size_t)M * OC);
        cr_expect(err <= 1e-6, "linear forward (bias %s): rel error %.3e > 1e-6",
                  with_bias ? "given" : "NULL", err);
    }
    free(inp); free(weight); free(bias); free(out); free(ref);
}

// ---- grad: layernorm with adaLN modulation ----------------------------------------------

// The modulation tensor has DiT's (B, 6C) layout: shift at offset 0, scale at offset C.
#define MOD_CHUNKS 6
#define SHIFT_OFFSET(C) 0
#define SCALE_OFFSET(C) (C)
#define GATE_OFFSET(C) (2 * (C))

typedef struct { float *out, *mean, *rstd, *inp, *mod, *w; int B, T, C; } LayerNormCtx;

static double layernorm_loss(void *p) {
    LayerNormCtx *c = p;
    layernorm_modulate_forward(c->out, c->mean, c->rstd, c->inp, c->mod + SHIFT_OFFSET(c->C),
                               c->mod + SCALE_OFFSET(c->C), c->B, c->T, c->C, MOD_CHUNKS * c->C);
    return gc_dot(c->w, c->out, (size_t)c->B * c->T * c->C);
}

Test(grad, layernorm_modulate) {
    Rng rng; rng_seed(&rng, 6);
    LayerNormCtx c = { .B = 2, .T = 3, .C = 8 };
    int B = c.B, C = c.C, stride = MOD_CHUNKS * C;
    size_t n = (size_t)B * c.T * C, n_mod = (size_t)B * stride;
    c.out = zeros(n); c.mean = zeros((size_t)B * c.T); c.rstd = zeros((size_t)B * c.T);
    c.inp = randn(&rng, n, 2.0f);
    for (size_t i = 0; i < n; i++) c.inp[i] += 0.5f;   // a nonzero mean to subtract
    c.mod = randn(&rng, n_mod, 0.5f); c.w = randn(&rng, n, 1.0f);

    layernorm_loss(&c);   // mean and rstd for the backward
    float *dinp = zeros(n), *dmod = zeros(n_mod);
    layernorm_modulate_backward(dinp, dmod + SHIFT_OFFSET(C), dmod + SCALE_OFFSET(C), c.w, c.inp,
                                c.mean, c.rstd, c.mod + SCALE_OFFSET(C), B, c.T, C, stride);
    check_grad("layernorm dinp", dinp, c.inp, n, layernorm_loss, &c);

    // numeric gradient of the whole modulation tensor, compared chunk by chunk
    double *num_mod = dzeros(n_mod);
    numeric_grad_serial(num_mod, c.mod, n_mod, GRAD_H, layernorm_loss, &c);
    float *got = zeros((size_t)B * C);
    double *want = dzeros((size_t)B * C);
    const char *names[2] = { "layernorm dshift", "layernorm dscale" };
    int offsets[2] = { SHIFT_OFFSET(C), SCALE_OFFSET(C) };
    for (int k = 0; k < 2; k++) {
        gather_chunk(got, dmod, B, C, stride, offsets[k]);
        for (int b = 0; b < B; b++)
            for (int i = 0; i < C; i++) want[b * C + i] = num_mod[(size_t)b * stride + offsets[k] + i];
        double err = gc_rel_error(got, want, (size_t)B * C);
        cr_log_info("%-28s rel error %.2e (tol %.0e)", names[k], err, GRAD_TOL);
        cr_expect(err <= GRAD_TOL, "%s: rel error %.3e > %.0e", names[k], err, GRAD_TOL);
    }
    check_other_chunks_zero("layernorm dmod", dmod, B, C, stride, SHIFT_OFFSET(C), SCALE_OFFSET(C));

    float *dinp2 = zeros(n), *dmod2 = zeros(n_mod);
    for (int call = 0; call < 2; call++)
        layernorm_modulate_backward(dinp2, dmod2 + SHIFT_OFFSET(C), dmod2 + SCALE_OFFSET(C), c.w, c.inp,
                                    c.mean, c.rstd, c.mod + SCALE_OFFSET(C), B, c.T, C, stride);
    check_doubled("layernorm dinp", dinp2, dinp, n);
    check_doubled("layernorm dmod", dmod2, dmod, n_mod);

    // dinp = NULL (the input of the first block's norm needs a gradient, but a caller may skip it)
    float *dmod3 = zeros(n_mod);
    layernorm_modulate_backward(NULL, dmod3 + SHIFT_OFFSET(C), dmod3 + SCALE_OFFSET(C), c.w, c.inp,
                                c.mean, c.rstd, c.mod + SCALE_OFFSET(C), B, c.T, C, stride);
    cr_expect(rel_error_f(dmod3, dmod, n_mod) <= ACCUM_TOL, "layernorm dmod with dinp = NULL");

    free(c.out); free(c.mean); free(c.rstd); free(c.inp); free(c.mod); free(c.w);
    free(dinp); free(dmod); free(num_mod); free(got); free(want); free(dinp2); free(dmod2); free(dmod3);
}

// The forward (and its saved mean, rstd) against a double transcription of
// F.layer_norm(x, eps=1e-6, no affine)·(1 + scale) + shift.
Test(forward, layernorm_modulate) {
    Rng rng; rng_seed(&rng, 7);
    int B = 3, T = 4, C = 24, stride = MOD_CHUNKS * C;
    size_t n = (size_t)B * T * C;
    float *inp = randn(&rng, n, 3.0f), *mod = randn(&rng, (size_t)B * stride, 1.0f);
    for (size_t i = 0; i < n; i++) inp[i] -= 1.5f;
    // one row of variance ~1e-4, where the eps (1e-6, not torch's default 1e-5) shows
    for (int i = 0; i < C; i++) inp[C + i] = 0.25f + 0.01f * rng_normal(&rng);
    float *out = zeros(n), *mean = zeros((size_t)B * T), *rstd = zeros((size_t)B * T);
    double *ref = dzeros(n), *ref_mean = dzeros((size_t)B * T), *ref_rstd = dzeros((size_t)B * T);
    layernorm_modulate_forward(out, mean, rstd, inp, mod + SHIFT_OFFSET(C), mod + SCALE_OFFSET(C),
                               B, T, C, stride);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const float *x = inp + ((size_t)b * T + t) * C;
            double m = 0.0, var = 0.0;
            for (int i = 0; i < C; i++) m += x[i];
            m /= C;
            for (int i = 0; i < C; i++) var += (x[i] - m) * (x[i] - m);
            double s = 1.0 / sqrt(var / C + 1e-6);
            ref_mean[b * T + t] = m;
            ref_rstd[b * T + t] = s;
            for (int i = 0; i < C; i++)
                ref[((size_t)b * T + t) * C + i] = (x[i] - m) * s * (1.0 + mod[b * stride + SCALE_OFFSET(C) + i])
                                                   + mod[b * stride + SHIFT_OFFSET(C) + i];
        }
    cr_expect(gc_rel_error(out, ref, n) <= 1e-6, "layernorm_modulate out: rel error %.3e", gc_rel_error(out, ref, n));
    cr_expect(gc_rel_error(mean, ref_mean, (size_t)B * T) <= 1e-6, "layernorm_modulate mean");
    cr_expect(gc_rel_error(rstd, ref_rstd, (size_t)B * T) <= 1e-6, "layernorm_modulate rstd");
    free(inp); free(mod); free(out); free(mean); free(rstd); free(ref); free(ref_mean); free(ref_rstd);
}

// ---- grad: gated residual ----------------------------------------------------------------

typedef struct { float *out, *res, *h, *mod, *w; int B, T, C; } GatedCtx;

static double gated_loss(void *p) {
    GatedCtx *c = p;
    gated_residual_forward(c->out, c->res, c->h, c->mod + GATE_OFFSET(c->C), c->B, c->T, c->C,
                           MOD_CHUNKS * c->C);
    return gc_dot(c->w, c->out, (size_t)c->B * c->T * c->C);
}

Test(grad, gated_residual) {
    Rng rng; rng_seed(&rng, 8);
    GatedCtx c = { .B = 2, .T = 3, .C = 5 };
    int B = c.B, C = c.C, stride = MOD_CHUNKS * C;
    size_t n = (size_t)B * c.T * C, n_mod = (size_t)B * stride;
    c.out = zeros(n); c.res = randn(&rng, n, 1.0f); c.h = randn(&rng, n, 1.0f);
    c.mod = randn(&rng, n_mod, 1.0f); c.w = randn(&rng, n, 1.0f);

    float *dres = zeros(n), *dh = zeros(n), *dmod = zeros(n_mod);
    gated_residual_backward(dres, dh, dmod + GATE_OFFSET(C), c.w, c.h, c.mod + GATE_OFFSET(C), B, c.T, C, stride);
    check_grad("gated_residual dres", dres, c.res, n, gated_loss, &c);
    check_grad("gated_residual dh", dh, c.h, n, gated_loss, &c);
    check_grad("gated_residual dmod (gate)", dmod, c.mod, n_mod, gated_loss, &c);
    check_other_chunks_zero("gated_residual dmod", dmod, B, C, stride, GATE_OFFSET(C), GATE_OFFSET(C));

    float *dres2 = zeros(n), *dh2 = zeros(n), *dmod2 = zeros(n_mod);
    for (int call = 0; call < 2; call++)
        gated_residual_backward(dres2, dh2, dmod2 + GATE_OFFSET(C), c.w, c.h, c.mod + GATE_OFFSET(C),
                                B, c.T, C, stride);
    check_doubled("gated_residual dres", dres2, dres, n);
    check_doubled("gated_residual dh", dh2, dh, n);
    check_doubled("gated_residual dmod", dmod2, dmod, n_mod);

    // dres = NULL: the residual stream's gradient is passed on by the caller directly
    float *dh3 = zeros(n), *dmod3 = zeros(n_mod);
    gated_residual_backward(NULL, dh3, dmod3 + GATE_OFFSET(C), c.w, c.h, c.mod + GATE_OFFSET(C), B, c.T, C, stride);
    cr_expect(rel_error_f(dh3, dh, n) <= ACCUM_TOL, "gated_residual dh with dres = NULL");
    cr_expect(rel_error_f(dmod3, dmod, n_mod) <= ACCUM_TOL, "gated_residual dgate with dres = NULL");

    free(c.out); free(c.res); free(c.h); free(c.mod); free(c.w);
    free(dres); free(dh); free(dmod); free(dres2); free(dh2); free(dmod2); free(dh3); free(dmod3);
}

// ---- grad: pointwise ---------------------------------------------------------------------

typedef void (*pointwise_forward_fn)(float *out, const float *inp, size_t n);
typedef void (*pointwise_backward_fn)(float *dinp, const float *inp, const float *dout, size_t n);
typedef struct { float *out, *inp, *w; size_t n; pointwise_forward_fn forward; } PointwiseCtx;

static double pointwise_loss(void *p) {
    PointwiseCtx *c = p;
    c->forward(c->out, c->inp, c->n);
    return gc_dot(c->w, c->out, c->n);
}

// Gradient check of a pointwise layer on inputs spread over [-6, 6] and its forward against
// the double formula `ref`.
static void check_pointwise(const char *name, pointwise_forward_fn forward, pointwise_backward_fn backward,
                            double (*ref)(double), uint64_t seed) {
    Rng rng; rng_seed(&rng, seed);
    PointwiseCtx c = { .n = 97, .forward = forward };
    c.out = zeros(c.n); c.inp = zeros(c.n); c.w = randn(&rng, c.n, 1.0f);
    rng_fill_uniform(&rng, c.inp, c.n, -6.0f, 6.0f);
    double *want = dzeros(c.n);
    forward(c.out, c.inp, c.n);
    for (size_t i = 0; i < c.n; i++) want[i] = ref(c.inp[i]);
    double err = gc_rel_error(c.out, want, c.n);
    cr_expect(err <= 1e-6, "%s forward: rel error %.3e > 1e-6", name, err);

    float *dinp = zeros(c.n), *twice = zeros(c.n);
    backward(dinp, c.inp, c.w, c.n);
    char label[64];
    snprintf(label, sizeof label, "%s dinp", name);
    check_grad(label, dinp, c.inp, c.n, pointwise_loss, &c);
    backward(twice, c.inp, c.w, c.n);
    backward(twice, c.inp, c.w, c.n);
    check_doubled(label, twice, dinp, c.n);
    free(c.out); free(c.inp); free(c.w); free(want); free(dinp); free(twice);
}

static double gelu_tanh_ref(double x) {
    return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}
static double silu_ref(double x) { return x / (1.0 + exp(-x)); }

Test(grad, gelu) { check_pointwise("gelu", gelu_forward, gelu_backward, gelu_tanh_ref, 9); }
Test(grad, silu) { check_pointwise("silu", silu_forward, silu_backward, silu_ref, 10); }

Test(forward, add) {
    Rng rng; rng_seed(&rng, 11);
    size_t n = 33;
    float *a = randn(&rng, n, 1.0f), *b = randn(&rng, n, 1.0f), *out = zeros(n);
    add_forward(out, a, b, n);
    for (size_t i = 0; i < n; i++) cr_expect(out[i] == a[i] + b[i], "add_forward element %zu", i);
    free(a); free(b); free(out);
}

// ---- grad: class embedding ---------------------------------------------------------------

typedef struct { float *out, *table, *w; const int *labels; int B, C; } EmbeddingCtx;

static double embedding_loss(void *p) {
    EmbeddingCtx *c = p;
    embedding_forward(c->out, c->table, c->labels, c->B, c->C);
    return gc_dot(c->w, c->out, (size_t)c->B * c->C);
}

Test(grad, embedding_repeated_labels) {
    Rng rng; rng_seed(&rng, 12);
    // 4 classes + the null class (row 4); class 3 appears three times, class 2 never
    static const int labels[6] = { 3, 1, 3, 4, 3, 0 };
    int rows = 5;
    EmbeddingCtx c = { .B = 6, .C = 7, .labels = labels };
    size_t n_table = (size_t)rows * c.C, n_out = (size_t)c.B * c.C;
    c.out = zeros(n_out); c.table = randn(&rng, n_table, 1.0f); c.w = randn(&rng, n_out, 1.0f);
    embedding_forward(c.out, c.table, labels, c.B, c.C);
    for (int b = 0; b < c.B; b++)
        cr_expect(memcmp(c.out + b * c.C, c.table + labels[b] * c.C, c.C * sizeof(float)) == 0,
                  "embedding_forward row %d is not table[%d]", b, labels[b]);
    float *dtable = zeros(n_table), *twice = zeros(n_table);
    embedding_backward(dtable, c.w, labels, c.B, c.C);
    check_grad("embedding dtable", dtable, c.table, n_table, embedding_loss, &c);
    for (int i = 0; i < c.C; i++) cr_expect(dtable[2 * c.C + i] == 0.0f, "unused class 2 got a gradient");
    embedding_backward(twice, c.w, labels, c.B, c.C);
    embedding_backward(twice, c.w, labels, c.B, c.C);
    check_doubled("embedding dtable", twice, dtable, n_table);
    free(c.out); free(c.table); free(c.w); free(dtable); free(twice);
}

// ---- grad: MSE loss ----------------------------------------------------------------------

typedef struct { float *pred, *target; size_t n; } MseCtx;

static double mse_loss(void *p) {
    MseCtx *c = p;
    return mse_loss_forward_backward(NULL, c->pred, c->target, c->n);
}

Test(grad, mse_loss) {
    Rng rng; rng_seed(&rng, 13);
    MseCtx c = { .n = 24 };
    c.pred = randn(&rng, c.n, 1.0f); c.target = randn(&rng, c.n, 1.0f);
    double want = 0.0;
    for (size_t i = 0; i < c.n; i++) want += ((double)c.pred[i] - c.target[i]) * ((double)c.pred[i] - c.target[i]);
    want /= c.n;
    // dpred is written (=), not accumulated: the loss is where the backward starts
    float *dpred = zeros(c.n);
    for (size_t i = 0; i < c.n; i++) dpred[i] = 7.0f;
    float loss = mse_loss_forward_backward(dpred, c.pred, c.target, c.n);
    cr_expect(fabs(loss - want) <= 1e-6 * want, "mse loss %.9g, want %.9g", loss, want);
    cr_expect(mse_loss_forward_backward(NULL, c.pred, c.target, c.n) == loss, "mse loss with dpred = NULL");
    // L is the returned fp32 loss here (no weights), so the difference uses a larger step; a central
    // difference of a quadratic has no truncation error.
    double *numeric = dzeros(c.n);
    gc_numeric_grad(numeric, c.pred, c.n, 0.1f, mse_loss, &c);
    double err = gc_rel_error(dpred, numeric, c.n);
    cr_log_info("%-28s rel error %.2e (tol %.0e)", "mse dpred", err, GRAD_TOL);
    cr_expect(err <= GRAD_TOL, "mse dpred: rel error %.3e > %.0e", err, GRAD_TOL);
    free(c.pred); free(c.target); free(dpred); free(numeric);
}

// ---- forward: reshapes against independent formulas --------------------------------------

// Linear on patchify's output = Conv2d(Cin, OC, kernel = stride = p) computed directly, with the
// conv weight (OC, Cin, p, p) used as the linear weight (OC, Cin·p·p) as in torch.
static void check_patchify_conv(int B, int Cin, int S, int p, int OC, uint64_t seed) {
    Rng rng; rng_seed(&rng, seed);
    int G = S / p, T = G * G, P = Cin * p * p;
    float *img = randn(&rng, (size_t)B * Cin * S * S, 1.0f), *weight = randn(&rng, (size_t)OC * P, 1.0f);
    float *bias = randn(&rng, OC, 1.0f);
    float *patches = zeros((size_t)B * T * P), *out = zeros((size_t)B * T * OC);
    double *ref = dzeros((size_t)B * T * OC);
    patchify_forward(patches, img, B, Cin, S, p);
    linear_forward(out, patches, weight, bias, B * T, P, OC);
    for (int b = 0; b < B; b++)
        for (int o = 0; o < OC; o++)
            for (int gy = 0; gy < G; gy++)
                for (int gx = 0; gx < G; gx++) {
                    double acc = bias[o];
                    for (int c = 0; c < Cin; c++)
                        for (int ky = 0; ky < p; ky++)
                            for (int kx = 0; kx < p; kx++)
                                acc += (double)weight[((o * Cin + c) * p + ky) * p + kx] *
                                       img[(((size_t)b * Cin + c) * S + gy * p + ky) * S + gx * p + kx];
                    ref[((size_t)b * T + gy * G + gx) * OC + o] = acc;
                }
    double err = gc_rel_error(out, ref, (size_t)B * T * OC);
    cr_expect(err <= 1e-6, "linear(patchify) vs conv (B %d Cin %d S %d p %d): rel error %.3e", B, Cin, S, p, err);
    free(img); free(weight); free(bias); free(patches); free(out); free(ref);
}

Test(forward, patchify_is_conv) {
    check_patchify_conv(2, 3, 8, 2, 5, 14);
    check_patchify_conv(1, 4, 8, 4, 3, 15);
    check_patchify_conv(2, 1, 6, 3, 2, 16);
}

// unpatchify as DiT's FinalLayer output is unpatchified:
// x.reshape(N, h, w, p, p, c); einsum('nhwpqc->nchpwq'); reshape(N, c, h·p, w·p).
Test(forward, unpatchify_dit_einsum) {
    Rng rng; rng_seed(&rng, 17);
    int B = 2, Cout = 3, S = 6, p = 2, G = S / p;
    size_t n = (size_t)B * Cout * S * S;
    float *tokens = randn(&rng, n, 1.0f), *img = zeros(n), *ref = zeros(n);
    unpatchify_forward(img, tokens, B, Cout, S, p);
    size_t src = 0;   // walks the tokens in memory order n, h, w, p, q, c
    for (int b = 0; b < B; b++)
        for (int h = 0; h < G; h++)
            for (int w = 0; w < G; w++)
                for (int py = 0; py < p; py++)
                    for (int px = 0; px < p; px++)
                        for (int c = 0; c < Cout; c++)
                            ref[(((size_t)b * Cout + c) * S + h * p + py) * S + w * p + px] = tokens[src++];
    cr_expect(memcmp(img, ref, n * sizeof(float)) == 0, "unpatchify differs from DiT's einsum order");
    free(tokens); free(img); free(ref);
}

// patchify orders a patch (c, py, px), unpatchify (py, px, c): after reordering each patch vector
// they are inverses.
Test(forward, patchify_unpatchify_roundtrip_with_reorder) {
    Rng rng; rng_seed(&rng, 18);
    int B = 2, C = 3, S = 8, p = 4, T = (S / p) * (S / p);
    size_t n = (size_t)B * C * S * S;
    float *img = randn(&rng, n, 1.0f), *patches = zeros(n), *tokens = zeros(n), *back = zeros(n);
    patchify_forward(patches, img, B, C, S, p);
    for (int bt = 0; bt < B * T; bt++)
        for (int c = 0; c < C; c++)
            for (int py = 0; py < p; py++)
                for (int px = 0; px < p; px++)
                    tokens[(size_t)bt * C * p * p + (py * p + px) * C + c] =
                        patches[(size_t)bt * C * p * p + (c * p + py) * p + px];
    unpatchify_forward(back, tokens, B, C, S, p);
    cr_expect(memcmp(back, img, n * sizeof(float)) == 0, "unpatchify(reorder(patchify(img))) != img");
    free(img); free(patches); free(tokens); free(back);
}

Test(forward, split_merge_heads_torch_layout) {
    Rng rng; rng_seed(&rng, 19);
    int B = 2, T = 3, H = 4, D = 5, C = H * D;
    size_t n = (size_t)B * H * T * D;
    float *qkv = randn(&rng, 3 * n, 1.0f), *q = zeros(n), *k = zeros(n), *v = zeros(n), *out = zeros(n);
    split_heads_forward(q, k, v, qkv, B, T, H, D);
    // qkv.reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4): [s][b][h][t][d] = qkv[b][t][s][h][d]
    float *qkv_heads[3] = { q, k, v };
    for (int s = 0; s < 3; s++)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int t = 0; t < T; t++)
                    for (int d = 0; d < D; d++)
                        cr_expect(qkv_heads[s][(((size_t)b * H + h) * T + t) * D + d] ==
                                  qkv[(((size_t)b * T + t) * 3 + s) * C + h * D + d],
                                  "split_heads chunk %d b %d h %d t %d d %d", s, b, h, t, d);
    // merge_heads(q) is o.transpose(1, 2).reshape(B, T, C): q's rows back in place
    merge_heads_forward(out, q, B, T, H, D);
    for (int bt = 0; bt < B * T; bt++)
        cr_expect(memcmp(out + (size_t)bt * C, qkv + (size_t)bt * 3 * C, C * sizeof(float)) == 0,
                  "merge_heads(split q) row %d", bt);
    free(qkv); free(q); free(k); free(v); free(out);
}

// ---- forward: conditioning ---------------------------------------------------------------

// DiT's TimestepEmbedder.timestep_embedding with τ = 1000·t, in double:
// [cos(τ·f_k) | sin(τ·f_k)], f_k = exp(-ln(10000)·k/half). The fp32 argument τ·f_k ≤ 1000 carries
// an error up to ~1e-4, hence the absolute tolerance.
Test(forward, timestep_embedding) {
    static const float t[5] = { 0.0f, 0.001f, 0.25f, 0.5f, 1.0f };
    int B = 5;
    int dims[2] = { TIMESTEP_FREQ_DIM, 8 };
    for (int di = 0; di < 2; di++) {
        int dim = dims[di], half = dim / 2;
        float *out = zeros((size_t)B * dim);
        timestep_embedding_forward(out, t, B, dim);
        double max_err = 0.0;
        for (int b = 0; b < B; b++)
            for (int k = 0; k < half; k++) {
                double arg = 1000.0 * t[b] * exp(-log(10000.0) * k / half);
                max_err = fmax(max_err, fabs(out[b * dim + k] - cos(arg)));
                max_err = fmax(max_err, fabs(out[b * dim + half + k] - sin(arg)));
            }
        cr_expect(max_err <= 5e-4, "timestep_embedding dim %d: max abs error %.3e > 5e-4", dim, max_err);
        // known values: t = 0 gives [1 … 1 | 0 … 0]; t = 0.25, k = 0 gives [cos 250 | sin 250]
        for (int k = 0; k < half; k++)
            cr_expect(out[k] == 1.0f && out[half + k] == 0.0f, "timestep_embedding(t = 0) at k %d", k);
        cr_expect(fabs(out[2 * dim] - cos(250.0)) <= 1e-6 && fabs(out[2 * dim + half] - sin(250.0)) <= 1e-6,
                  "timestep_embedding(t = 0.25), k = 0: (%g, %g), want (cos 250, sin 250) = (%g, %g)",
                  out[2 * dim], out[2 * dim + half], cos(250.0), sin(250.0));
        free(out);
    }
}

// DiT's get_2d_sincos_pos_embed (models/pos_embed.py, from MAE), transcribed verbatim and run by
// numpy. meshgrid(grid_w, grid_h) puts the column index in grid[0], so the first half encodes it.
static const char POS_EMBED_PY[] =
    "import sys, numpy as np\n"
    "def get_1d_sincos_pos_embed_from_grid(embed_dim, pos):\n"
    "    omega = np.arange(embed_dim // 2, dtype=np.float64)\n"
    "    omega /= embed_dim / 2.\n"
    "    omega = 1. / 10000**omega\n"
    "    pos = pos.reshape(-1)\n"
    "    out = np.einsum('m,d->md', pos, omega)\n"
    "    return np.concatenate([np.sin(out), np.cos(out)], axis=1)\n"
    "def get_2d_sincos_pos_embed(embed_dim, grid_size):\n"
    "    grid_h = np.arange(grid_size, dtype=np.float32)\n"
    "    grid_w = np.arange(grid_size, dtype=np.float32)\n"
    "    grid = np.meshgrid(grid_w, grid_h)\n"
    "    grid = np.stack(grid, axis=0).reshape([2, 1, grid_size, grid_size])\n"
    "    emb_h = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[0])\n"
    "    emb_w = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[1])\n"
    "    return np.concatenate([emb_h, emb_w], axis=1)\n"
    "G, C = int(sys.argv[1]), int(sys.argv[2])\n"
    "print(' '.join(repr(float(x)) for x in get_2d_sincos_pos_embed(C, G).reshape(-1)))\n";

static void check_pos_embed_numpy(int G, int C) {
    char path[] = "/tmp/test_layers_pos_embed_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0, "mkstemp for the numpy script");
    FILE *script = fdopen(fd, "w");
    fputs(POS_EMBED_PY, script);
    fclose(script);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s %d %d 2>/dev/null", path, G, C);
    FILE *py = popen(cmd, "r");
    size_t n = (size_t)G * G * C, got = 0;
    double *ref = dzeros(n);
    while (py && got < n && fscanf(py, "%lf", &ref[got]) == 1) got++;
    int status = py ? pclose(py) : -1;
    remove(path);
    if (status != 0 || got != n) {
        free(ref);
        cr_skip_test("no /usr/bin/python3 with numpy (read %zu of %zu values)", got, n);
    }
    float *out = zeros(n);
    pos_embed_2d(out, G, C);
    double err = gc_rel_error(out, ref, n);
    cr_log_info("pos_embed_2d G %d C %d vs numpy: rel error %.2e", G, C, err);
    cr_expect(err <= 1e-6, "pos_embed_2d (G %d, C %d) vs DiT's numpy: rel error %.3e > 1e-6", G, C, err);
    free(ref); free(out);
}

Test(forward, pos_embed_2d_numpy) {
    check_pos_embed_numpy(4, 16);
    check_pos_embed_numpy(3, 8);
}

// Without python: token (row 1, column 0) is [sin 0 | cos 0 | sin ω_k | cos ω_k].
Test(forward, pos_embed_2d_column_first) {
    int G = 2, C = 8, quarter = C / 4;
    float out[2 * 2 * 8];
    pos_embed_2d(out, G, C);
    const float *e = out + (1 * G + 0) * C;
    for (int k = 0; k < quarter; k++) {
        double omega = pow(10000.0, -(double)k / quarter);
        cr_expect(e[k] == 0.0f && e[quarter + k] == 1.0f, "column half of token (1, 0), k %d", k);
        cr_expect(fabs(e[2 * quarter + k] - sin(omega)) <= 1e-7 && fabs(e[3 * quarter + k] - cos(omega)) <= 1e-7,
                  "row half of token (1, 0), k %d", k);
    }
}

// ---- forward: flow matching --------------------------------------------------------------

Test(forward, flow_matching_inputs) {
    Rng rng; rng_seed(&rng, 20);
    static const float t[4] = { 0.0f, 0.3f, 0.77f, 1.0f };
    int B = 4, n = 10;
    size_t total = (size_t)B * n;
    float *x0 = randn(&rng, total, 1.0f), *noise = randn(&rng, total, 1.0f);
    float *x_t = zeros(total), *v = zeros(total);
    double *ref_x = dzeros(total), *ref_v = dzeros(total);
    flow_matching_inputs(x_t, v, x0, noise, t, B, n);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < n; i++) {
            size_t j = (size_t)b * n + i;
            ref_x[j] = (1.0 - t[b]) * x0[j] + (double)t[b] * noise[j];
            ref_v[j] = (double)noise[j] - x0[j];
        }
    cr_expect(gc_rel_error(x_t, ref_x, total) <= 1e-6, "flow matching x_t: rel error %.3e", gc_rel_error(x_t, ref_x, total));
    cr_expect(gc_rel_error(v, ref_v, total) <= 1e-6, "flow matching v: rel error %.3e", gc_rel_error(v, ref_v, total));
    cr_expect(memcmp(x_t, x0, n * sizeof(float)) == 0, "t = 0 must give x_t = x0 exactly");
    cr_expect(memcmp(x_t + 3 * n, noise + 3 * n, n * sizeof(float)) == 0, "t = 1 must give x_t = noise exactly");
    free(x0); free(noise); free(x_t); free(v); free(ref_x); free(ref_v);
}

// flow_matching_sample: the draws in the documented order (so that a resumed run and
// dev/loss_curves.py, which replays them through ctypes, see the same stream), determinism for a
// seed, and the statistics of B = 20000 draws. Bounds (N = 20000, noise 4N values): drop rate
// 0.1 ± 0.01 (binomial sd 0.0021, ~5 sd); logit-normal t: mean of logit(t) 0 ± 0.05 and variance
// 1 ± 0.05 (sd 0.007 and 0.010); uniform t: mean 0.5 ± 0.01 (sd 0.002), P(t < 0.25) 0.25 ± 0.01;
// noise: mean 0 ± 0.01, variance 1 ± 0.02 (sd 0.0035 and 0.005).
#define FM_B 20000
#define FM_N 4

static void fm_draw(uint64_t seed, int *labels, float *t, float *noise, float dropout, int uniform_t) {
    Rng rng; rng_seed(&rng, seed);
    for (int b = 0; b < FM_B; b++) labels[b] = b % 10;
    flow_matching_sample(&rng, labels, t, noise, FM_B, FM_N, dropout, 10, uniform_t);
}

Test(forward, flow_matching_sample_order_and_determinism) {
    int *labels = malloc(FM_B * sizeof(int)), *labels2 = malloc(FM_B * sizeof(int));
    float *t = zeros(FM_B), *t2 = zeros(FM_B), *noise = zeros(FM_B * FM_N), *noise2 = zeros(FM_B * FM_N);
    cr_assert(labels && labels2);
    for (int uniform_t = 0; uniform_t <= 1; uniform_t++) {
        fm_draw(5, labels, t, noise, 0.3f, uniform_t);
        // the same seed: the same draws, bit for bit
        fm_draw(5, labels2, t2, noise2, 0.3f, uniform_t);
        cr_expect(memcmp(labels, labels2, FM_B * sizeof(int)) == 0 && memcmp(t, t2, FM_B * sizeof(float)) == 0 &&
                  memcmp(noise, noise2, FM_B * FM_N * sizeof(float)) == 0, "seed 5 twice must draw the same");
        // the documented order: B uniforms for the drops, B times, then the noise
        Rng rng; rng_seed(&rng, 5);
        for (int b = 0; b < FM_B; b++) labels2[b] = rng_uniform(&rng) < 0.3f ? 10 : b % 10;
        for (int b = 0; b < FM_B; b++)
            t2[b] = uniform_t ? rng_uniform(&rng) : 1.0f / (1.0f + expf(-rng_normal(&rng)));
        rng_fill_normal(&rng, noise2, FM_B * FM_N, 1.0f);
        cr_expect(memcmp(labels, labels2, FM_B * sizeof(int)) == 0, "label drops in order (uniform_t %d)", uniform_t);
        cr_expect(memcmp(t, t2, FM_B * sizeof(float)) == 0, "t in order (uniform_t %d)", uniform_t);
        cr_expect(memcmp(noise, noise2, FM_B * FM_N * sizeof(float)) == 0, "noise in order (uniform_t %d)", uniform_t);
        // another seed: other draws
        fm_draw(6, labels2, t2, noise2, 0.3f, uniform_t);
        cr_expect(memcmp(t, t2, FM_B * sizeof(float)) != 0 && memcmp(noise, noise2, FM_B * FM_N * sizeof(float)) != 0,
                  "seeds 5 and 6 must draw differently");
    }
    free(labels); free(labels2); free(t); free(t2); free(noise); free(noise2);
}

Test(forward, flow_matching_sample_statistics) {
    int *labels = malloc(FM_B * sizeof(int));
    float *t = zeros(FM_B), *noise = zeros(FM_B * FM_N);
    cr_assert(labels);
    for (int uniform_t = 0; uniform_t <= 1; uniform_t++) {
        fm_draw(11 + uniform_t, labels, t, noise, 0.1f, uniform_t);
        int dropped = 0, changed = 0, below_quarter = 0;
        double sum = 0, sum2 = 0;
        for (int b = 0; b < FM_B; b++) {
            dropped += labels[b] == 10;
            changed += labels[b] != 10 && labels[b] != b % 10;
            cr_assert(t[b] >= 0.0f && t[b] <= 1.0f, "t[%d] = %g outside [0, 1]", b, t[b]);
            double x = uniform_t ? t[b] : log(t[b] / (1.0 - t[b]));
            sum += x; sum2 += x * x;
            below_quarter += t[b] < 0.25f;
        }
        double rate = (double)dropped / FM_B, mean = sum / FM_B, var = sum2 / FM_B - mean * mean;
        cr_expect(fabs(rate - 0.1) <= 0.01, "label drop rate %.4f, expected 0.1 ± 0.01", rate);
        cr_expect(changed == 0, "%d labels changed to something else than the null label", changed);
        if (uniform_t) {
            double quarter = (double)below_quarter / FM_B;
            cr_expect(fabs(mean - 0.5) <= 0.01, "uniform t: mean %.4f, expected 0.5 ± 0.01", mean);
            cr_expect(fabs(quarter - 0.25) <= 0.01, "uniform t: P(t < 0.25) = %.4f, expected 0.25 ± 0.01", quarter);
        } else {
            cr_expect(fabs(mean) <= 0.05, "logit-normal t: mean of logit(t) %.4f, expected 0 ± 0.05", mean);
            cr_expect(fabs(var - 1.0) <= 0.05, "logit-normal t: variance of logit(t) %.4f, expected 1 ± 0.05", var);
        }
        sum = sum2 = 0;
        for (int i = 0; i < FM_B * FM_N; i++) { sum += noise[i]; sum2 += (double)noise[i] * noise[i]; }
        mean = sum / (FM_B * FM_N); var = sum2 / (FM_B * FM_N) - mean * mean;
        cr_expect(fabs(mean) <= 0.01 && fabs(var - 1.0) <= 0.02, "noise: mean %.4f variance %.4f, expected 0 and 1", mean, var);
    }
    for (int b = 0; b < FM_B; b++) labels[b] = b % 10;
    Rng rng; rng_seed(&rng, 13);
    flow_matching_sample(&rng, labels, t, noise, FM_B, FM_N, 0.0f, 10, 1);
    int kept = 0;
    for (int b = 0; b < FM_B; b++) kept += labels[b] == b % 10;
    cr_expect(kept == FM_B, "label_dropout 0 must keep every label (%d of %d kept)", kept, FM_B);
    flow_matching_sample(&rng, labels, t, noise, FM_B, FM_N, 1.0f, 10, 1);
    for (int b = 0; b < FM_B; b++) kept -= labels[b] == 10;
    cr_expect(kept == 0, "label_dropout 1 must drop every label (%d kept)", kept);
    free(labels); free(t); free(noise);
}

// ---- optimizer ---------------------------------------------------------------------------

// torch.optim.AdamW (torch 1.13 _single_tensor_adamw) in double, after clip_grad_norm_ has
// multiplied the gradient by grad_scale.
static void adamw_reference(double *p, double *m, double *v, const float *grad, size_t n,
                            double lr, double beta1, double beta2, double eps, double wd,
                            double grad_scale, int step) {
    double bias_correction1 = 1.0 - pow(beta1, step);
    double bias_correction2 = 1.0 - pow(beta2, step);
    double step_size = lr / bias_correction1;
    for (size_t i = 0; i < n; i++) {
        double g = grad[i] * grad_scale;
        p[i] *= 1.0 - lr * wd;                          // param.mul_(1 - lr * weight_decay)
        m[i] += (g - m[i]) * (1.0 - beta1);             // exp_avg.lerp_(grad, 1 - beta1)
        v[i] = v[i] * beta2 + (1.0 - beta2) * g * g;    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
        double denom = sqrt(v[i]) / sqrt(bias_correction2) + eps;
        p[i] -= step_size * m[i] / denom;               // param.addcdiv_(exp_avg, denom, value=-step_size)
    }
}

Test(optim, adamw_matches_torch) {
    Rng rng; rng_seed(&rng, 21);
    size_t n = 200;
    int steps = 6;
    // the hyperparameters as the fp32 values adamw_update receives (0.999f = 0.99900001287..., whose
    // 1 - β2 differs from torch's double 0.999 by 1.3e-5 relative: a property of the fp32 API)
    double lr = 1e-2f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, wd = 0.1f, grad_scale = 0.5f;
    float *p = randn(&rng, n, 1.0f), *m = zeros(n), *v = zeros(n), *grad = zeros(n);
    double *p_ref = dzeros(n), *m_ref = dzeros(n), *v_ref = dzeros(n), *delta_ref = dzeros(n);
    float *p0 = zeros(n), *delta = zeros(n);
    memcpy(p0, p, n * sizeof(float));
    for (size_t i = 0; i < n; i++) p_ref[i] = p[i];
    for (int step = 1; step <= steps; step++) {
        rng_fill_normal(&rng, grad, n, 1.0f);
        grad[0] = 0.0f;   // an element that never gets a gradient moves by weight decay only
        adamw_update(p, grad, m, v, n, (float)lr, (float)beta1, (float)beta2, (float)eps, (float)wd,
                     (float)grad_scale, step);   // exact: the doubles hold fp32 values
        adamw_reference(p_ref, m_ref, v_ref, grad, n, lr, beta1, beta2, eps, wd, grad_scale, step);
    }
    // compare the change of the parameters (≈ steps·lr), not the parameters, so the check is sensitive
    for (size_t i = 0; i < n; i++) { delta[i] = p[i] - p0[i]; delta_ref[i] = p_ref[i] - p0[i]; }
    double err_p = gc_rel_error(delta, delta_ref, n), err_m = gc_rel_error(m, m_ref, n), err_v = gc_rel_error(v, v_ref, n);
    cr_log_info("adamw: rel error of the update %.2e, m %.2e, v %.2e", err_p, err_m, err_v);
    cr_expect(err_p <= 1e-4, "adamw parameter update vs torch: rel error %.3e > 1e-4", err_p);
    cr_expect(err_m <= 1e-6, "adamw m vs torch: rel error %.3e > 1e-6", err_m);
    cr_expect(err_v <= 1e-6, "adamw v vs torch: rel error %.3e > 1e-6", err_v);
    free(p); free(m); free(v); free(grad); free(p_ref); free(m_ref); free(v_ref); free(delta_ref);
    free(p0); free(delta);
}

Test(optim, ema_update) {
    Rng rng; rng_seed(&rng, 22);
    size_t n = 50;
    float *ema = randn(&rng, n, 1.0f), *params = randn(&rng, n, 1.0f);
    double *ref = dzeros(n);
    float decays[2] = { 0.9999f, 0.5f };
    for (int k = 0; k < 2; k++) {
        for (size_t i = 0; i < n; i++) ref[i] = (double)decays[k] * ema[i] + (1.0 - decays[k]) * params[i];
        ema_update(ema, params, n, decays[k]);
        cr_expect(gc_rel_error(ema, ref, n) <= 1e-6, "ema_update decay %g: rel error %.3e", decays[k],
                  gc_rel_error(ema, ref, n));
    }
    free(ema); free(params); free(ref);
}

// EMA warmup: (1 + step)/(10 + step) early, then the configured decay (values by hand); after
// 1500 steps of warmup-0.999 the initial weights keep a weight of Π decay_s that is tiny, while a
// fixed 0.999 keeps 0.999^1500 = 0.22 of them.
Test(optim, ema_decay_warmup) {
    cr_expect_float_eq(ema_decay_warmup(0.999f, 1), 2.0f / 11.0f, 1e-7f);
    cr_expect_float_eq(ema_decay_warmup(0.999f, 90), 91.0f / 100.0f, 1e-7f);
    cr_expect_float_eq(ema_decay_warmup(0.999f, 8991), 0.999f, 1e-7f);   // 8992/9001 > 0.999
    cr_expect_float_eq(ema_decay_warmup(0.5f, 1), 2.0f / 11.0f, 1e-7f);  // warmup below the decay
    cr_expect_float_eq(ema_decay_warmup(0.5f, 100), 0.5f, 1e-7f);
    double keep_warm = 1.0, keep_fixed = 1.0;
    for (int step = 1; step <= 1500; step++) {
        keep_warm *= ema_decay_warmup(0.999f, step);
        keep_fixed *= 0.999;
    }
    cr_expect(keep_warm < 1e-3 && keep_fixed > 0.2, "initial weights kept: warmup %.3g, fixed %.3g",
              keep_warm, keep_fixed);
}

Test(optim, global_norm) {
    Rng rng; rng_seed(&rng, 23);
    size_t n = 1000;
    float *g = randn(&rng, n, 3.0f);
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) sum += (double)g[i] * g[i];
    cr_expect(fabs(global_norm(g, n) - sqrt(sum)) <= 1e-6 * sqrt(sum), "global_norm of random vector");
    free(g);
    // 2^12 followed by 2^20 ones: Σg² = 2^24 + 2^20; an fp32 accumulator stops at 2^24 (norm 4096)
    size_t big = 1 + ((size_t)1 << 20);
    float *ones = malloc(big * sizeof(float));
    cr_assert(ones);
    ones[0] = 4096.0f;
    for (size_t i = 1; i < big; i++) ones[i] = 1.0f;
    double want = sqrt(16777216.0 + 1048576.0);
    float got = global_norm(ones, big);
    cr_expect(fabs(got - want) <= 1e-6 * want, "global_norm must accumulate in double: %.6f, want %.6f", got, want);
    free(ones);
}
