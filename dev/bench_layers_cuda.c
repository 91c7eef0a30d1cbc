// Microbenchmark of the memory-bound layer kernels (layers/*_cuda.cu, and the FP8 douts' passes of
// layers/fp8_dout_cuda.cu against the bf16 passes plus a quantize pass) at the shapes of config a
// (DiT-B/2: hidden 768, 12 heads of 64, depth 12, 256 tokens × 64 images) and config c (hidden
// 2048, 16 heads of 128, depth 4, 16384 tokens × 1 image): per call the median of 50 CUDA-event
// timed runs after 5 warm-up runs, the bytes the call must move at least, GB/s and the share of
// the H200's ~4.0 TB/s; the per-step figure multiplies by the calls a training step makes.
// Inputs are random bf16/fp32 (the kernels' speed does not depend on the values).
//
// Build (the library's objects, or another version of them for a before/after comparison):
//   make -j2 build/libditc.a && gcc -O2 -std=c11 -D_GNU_SOURCE -I. -I/usr/local/cuda/include
//     -o build/bench_layers_cuda dev/bench_layers_cuda.c build/libditc.a -fopenmp
//     -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++ -lm
// Run: build/bench_layers_cuda [label]   (label: a word printed in every row, e.g. "new")
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>
#include "layers/common.h"
#include "layers/layers_cuda.h"
#include "layers/linear_fp8_cuda.h"
#include "dev/bench_cuda.h"

#define PEAK_GBS 4000.0

typedef struct {
    const char *name;
    int B, T, h, H, D, depth;
} Config;

static char err[DIT_ERR_LEN];
static LayersCuda ctx;
static const char *label = "run";

// A device buffer of `bytes` filled with a repeated 64 MiB pattern of 32-bit words whose low
// half is a random bf16 in [-0.5, 0.5) and high half 0x3a80 (so fp32 reads see ~1e-3 > 0).
#define PATTERN_WORDS (1u << 24)
static void *random_buffer(size_t bytes) {
    static uint32_t *pattern;
    if (!pattern) {
        pattern = malloc(PATTERN_WORDS * 4);
        uint32_t s = 12345;
        for (size_t i = 0; i < PATTERN_WORDS; i++) {
            s = s * 1664525u + 1013904223u;
            pattern[i] = bf16_bits_from_float(((s >> 8) & 0xffff) / 65536.0f - 0.5f) | (0x3a80u << 16);
        }
    }
    char *d = NULL;
    CK(cudaMalloc((void **)&d, bytes + 4));
    for (size_t done = 0; done < bytes; done += PATTERN_WORDS * 4) {
        size_t len = bytes - done < PATTERN_WORDS * 4 ? bytes - done : PATTERN_WORDS * 4;
        CK(cudaMemcpy(d + done, pattern, len, cudaMemcpyHostToDevice));
    }
    return d;
}

// Median ms of one call of `op` (a function of the case's buffers).
typedef struct {
    const Config *c;
    bf16 *x, *y, *dy, *dx, *mod, *q, *k, *v, *qkv;
    float *mean, *rstd, *dmod, *f0, *f1, *f2, *f3, *f4, *dw, *db;
    bf16 *pbf, *w;
    OptimizerStepConstants *step;   // the optimizer's per-step values (device)
    size_t nparams;
    int oc;   // the dbias case's width
    Fp8Dout d8;                // an FP8 dout (q, qt, scale) of the widest linear
    Fp8Scaling fused, alone;   // the guesses of the fused passes (headroom 3, as the model's douts)
                               // and of the quantize pass alone (0, current scaling)
    bf16 *wide;                // (M, 4h) bf16 for the quantize pass alone
} Case;

typedef void (*Op)(Case *);

// op(cs) through bench_median_ms
typedef struct { Op op; Case *cs; } CaseCall;
static void run_case_call(void *p) { ((CaseCall *)p)->op(((CaseCall *)p)->cs); }
static double time_op(Op op, Case *cs) {
    CaseCall call = {op, cs};
    return bench_median_ms(run_case_call, &call);
}

#define BTC(cs) (cs)->c->B, (cs)->c->T, (cs)->c->h
#define HEADS(cs) (cs)->c->B, (cs)->c->T, (cs)->c->H, (cs)->c->D

static void op_ln_forward(Case *cs) {
    int h = cs->c->h;
    OK(layernorm_modulate_forward_cuda(cs->y, cs->mean, cs->rstd, cs->x, cs->mod, cs->mod + h, BTC(cs), 6 * h, NULL, 0, err));
}
static void op_ln_dmod(Case *cs) {
    int h = cs->c->h;
    OK(layernorm_modulate_backward_cuda(NULL, cs->dmod, cs->dmod + h, cs->dy, cs->x, cs->mean, cs->rstd, cs->mod + h,
                                        BTC(cs), 6 * h, &ctx, 0, err));
}
static void op_ln_backward(Case *cs) {
    int h = cs->c->h;
    OK(layernorm_modulate_backward_cuda(cs->dx, cs->dmod, cs->dmod + h, cs->dy, cs->x, cs->mean, cs->rstd, cs->mod + h,
                                        BTC(cs), 6 * h, &ctx, 0, err));
}
static void op_gres_forward(Case *cs) {
    OK(gated_residual_forward_cuda(cs->y, cs->x, cs->dy, cs->mod + 2 * cs->c->h, BTC(cs), 6 * cs->c->h, 0, err));
}
static void op_gres_backward(Case *cs) {
    OK(gated_residual_backward_cuda(NULL, cs->dx, cs->dmod + 2 * cs->c->h, cs->dy, cs->x, cs->mod + 2 * cs->c->h, BTC(cs),
                                    6 * cs->c->h, NULL, NULL, &ctx, 0, err));
}
static void op_split_forward(Case *cs) { OK(split_heads_forward_cuda(cs->q, cs->k, cs->v, cs->qkv, HEADS(cs), 0, err)); }
static void op_split_backward(Case *cs) { OK(split_heads_backward_cuda(cs->qkv, cs->q, cs->k, cs->v, HEADS(cs), 0, err)); }
static void op_merge_forward(Case *cs) { OK(merge_heads_forward_cuda(cs->y, cs->q, HEADS(cs), NULL, 0, err)); }
static void op_merge_backward(Case *cs) { OK(merge_heads_backward_cuda(cs->q, cs->y, HEADS(cs), 0, err)); }
// linear backward with IC = 8: the dweight GEMM is small, the difference with/without dbias is the dbias
static void op_linear_dbias(Case *cs) {
    OK(linear_backward_cuda(NULL, 1.0f, cs->dw, 1.0f, cs->db, cs->dy, cs->x, cs->w, cs->c->B * cs->c->T, 8, cs->oc, &ctx, 0, err));
}
static void op_linear_nobias(Case *cs) {
    OK(linear_backward_cuda(NULL, 1.0f, cs->dw, 1.0f, NULL, cs->dy, cs->x, cs->w, cs->c->B * cs->c->T, 8, cs->oc, &ctx, 0, err));
}
static void op_adamw(Case *cs) {
    OK(adamw_update_cuda(cs->f0, cs->pbf, cs->f1, cs->f2, cs->f3, NULL, cs->nparams, cs->step, 0.9f, 0.95f, 1e-8f, 0.0f,
                         NULL, 0.0f, 0, err));
}
static void op_adamw_ema(Case *cs) {
    OK(adamw_update_cuda(cs->f0, cs->pbf, cs->f1, cs->f2, cs->f3, cs->f4, cs->nparams, cs->step, 0.9f, 0.95f, 1e-8f,
                         0.0f, NULL, 0.0f, 0, err));
}
// The FP8 douts: fc1's (M, 4h) by the dGELU and fc2's (M, h) by the gated residual's dh, each with
// its bias gradient: the bf16 pass (with the amax) plus the linear's own quantization pass, against
// one fused pass (layers/fp8_dout_cuda.cu). The guesses are right after the first call, as in
// training (the quantize pass alone reads unchanging data; the in-place dGELU's values drift, which
// its speed does not see).
static void op_dgelu_bf16(Case *cs) {
    OK(gelu_backward_inplace_dbias_cuda(cs->dx, cs->x, cs->db, cs->c->B * cs->c->T, 4 * cs->c->h, cs->alone.taken + 1,
                                        &ctx, 0, err));
}
static void op_quantize_wide(Case *cs) {
    OK(fp8_quantize_guessed_cuda(cs->d8.q, cs->d8.qt, cs->d8.scale, cs->wide, cs->c->B * cs->c->T, 4 * cs->c->h,
                                 FP8_E4M3, cs->alone.exponent, cs->alone.taken, 0, err));
}
static void op_dgelu_fp8(Case *cs) {
    int M = cs->c->B * cs->c->T, C = 4 * cs->c->h;
    OK(gelu_backward_fp8_cuda(&cs->d8, cs->dx, cs->x, cs->db, M, C, FP8_E4M3, &cs->fused, &ctx, 0, err));
}
static void op_gated_bf16(Case *cs) {   // dgate, then dh with its dbias and amax
    int h = cs->c->h;
    OK(gated_residual_backward_cuda(NULL, cs->dx, cs->dmod + 2 * h, cs->dy, cs->x, cs->mod + 2 * h, BTC(cs), 6 * h,
                                    cs->alone.taken + 1, cs->db, &ctx, 0, err));
}
static void op_quantize_h(Case *cs) {
    OK(fp8_quantize_guessed_cuda(cs->d8.q, cs->d8.qt, cs->d8.scale, cs->dx, cs->c->B * cs->c->T, cs->c->h, FP8_E4M3,
                                 cs->alone.exponent + 2, cs->alone.taken + 2, 0, err));
}
static void op_gated_fp8(Case *cs) {    // dgate, then the fused dh
    int h = cs->c->h;
    OK(gated_residual_backward_cuda(NULL, NULL, cs->dmod + 2 * h, cs->dy, cs->x, cs->mod + 2 * h, BTC(cs), 6 * h, NULL,
                                    NULL, &ctx, 0, err));
    OK(gated_dh_fp8_cuda(&cs->d8, cs->dy, cs->mod + 2 * h, BTC(cs), 6 * h, cs->db, FP8_E4M3, &cs->fused, &ctx, 0,
                         err));
}
// qkv's dout (M, 3h), written by the attention: the linear's quantization pass (its bias gradient
// is the "dbias OC=3h" row), against dout_fp8_cuda (both in one pass)
static void op_quantize_qkv(Case *cs) {
    OK(fp8_quantize_guessed_cuda(cs->d8.q, cs->d8.qt, cs->d8.scale, cs->wide, cs->c->B * cs->c->T, 3 * cs->c->h,
                                 FP8_E4M3, cs->alone.exponent + 4, cs->alone.taken + 3, 0, err));
}
static void op_qkv_fp8(Case *cs) {
    Fp8Scaling scaling = {NULL, cs->fused.exponent + 8, cs->fused.taken + 5, 3};
    OK(dout_fp8_cuda(&cs->d8, cs->wide, cs->db, cs->c->B * cs->c->T, 3 * cs->c->h, FP8_E4M3, &scaling, &ctx, 0, err));
}
static void op_norm(Case *cs) { OK(sum_squares_cuda(cs->f4 + cs->nparams, cs->f1, cs->nparams, &ctx, 0, err)); }

static void report(const Case *cs, const char *what, double ms, double bytes, int calls) {
    double gbs = bytes / (ms * 1e-3) / 1e9;
    printf("%-4s %s  %-22s %9.4f ms %8.0f GB/s %5.1f%%  x%-3d %8.3f ms/step  (%.0f MB)\n", label, cs->c->name, what, ms,
           gbs, 100.0 * gbs / PEAK_GBS, calls, ms * calls, bytes / 1e6);
}

static void bench_config(const Config *c) {
    Case cs = {.c = c};
    int L = c->depth, h = c->h;
    size_t N = (size_t)c->B * c->T * h, rows = (size_t)c->B * c->T, nh = N;   // H·D = h
    cs.nparams = (size_t)18 * h * h * L;   // the blocks' weights (qkv, proj, fc1, fc2, adaLN)
    cs.x = random_buffer(N * 2), cs.y = random_buffer(N * 2), cs.dy = random_buffer(N * 2), cs.dx = random_buffer(N * 2);
    cs.mod = random_buffer((size_t)c->B * 6 * h * 2);
    cs.dmod = random_buffer((size_t)c->B * 6 * h * 4);
    cs.mean = random_buffer(rows * 4), cs.rstd = random_buffer(rows * 4);
    cs.qkv = random_buffer(3 * nh * 2), cs.q = random_buffer(nh * 2), cs.k = random_buffer(nh * 2), cs.v = random_buffer(nh * 2);
    op_ln_forward(&cs);   // real statistics
    CK(cudaDeviceSynchronize());

    double ms = time_op(op_ln_forward, &cs);
    report(&cs, "layernorm fwd", ms, 4.0 * N + 8.0 * rows, 2 * L + 1);
    double dmod = time_op(op_ln_dmod, &cs);
    report(&cs, "layernorm bwd dmod", dmod, 4.0 * N + 8.0 * rows, 2 * L + 1);
    ms = time_op(op_ln_backward, &cs);
    report(&cs, "layernorm bwd dinp", ms - dmod, 8.0 * N + 8.0 * rows, 2 * L + 1);
    report(&cs, "layernorm bwd total", ms, 12.0 * N + 16.0 * rows, 2 * L + 1);
    ms = time_op(op_gres_forward, &cs);
    report(&cs, "gated_res fwd", ms, 6.0 * N, 2 * L);
    ms = time_op(op_gres_backward, &cs);
    report(&cs, "gated_res bwd (dgate+dh)", ms, 10.0 * N, 2 * L);
    ms = time_op(op_split_forward, &cs);
    report(&cs, "split_heads fwd", ms, 12.0 * nh, L);
    ms = time_op(op_split_backward, &cs);
    report(&cs, "split_heads bwd", ms, 18.0 * nh, 0);
    ms = time_op(op_merge_forward, &cs);
    report(&cs, "merge_heads fwd", ms, 4.0 * nh, L);
    ms = time_op(op_merge_backward, &cs);
    report(&cs, "merge_heads bwd", ms, 6.0 * nh, L);

    // dbias at the widths of a block's four linears (qkv 3h, proj h, fc1 4h, fc2 h)
    size_t M = rows;
    bf16 *dy_wide = random_buffer(M * 4 * h * 2);
    bf16 *saved_dy = cs.dy;
    cs.dy = dy_wide;
    cs.w = random_buffer((size_t)4 * h * 8 * 2);
    cs.dw = random_buffer((size_t)4 * h * 8 * 4), cs.db = random_buffer((size_t)4 * h * 4);
    const int widths[4] = {3 * h, h, 4 * h, h};
    double dbias_ms[4];
    for (int i = 0; i < 4; i++) {
        cs.oc = widths[i];
        double with = time_op(op_linear_dbias, &cs), without = time_op(op_linear_nobias, &cs);
        char what[32];
        snprintf(what, sizeof what, "dbias OC=%d", widths[i]);
        report(&cs, what, dbias_ms[i] = with - without, 2.0 * M * widths[i], L);
    }
    cs.dy = saved_dy;

    // the FP8 douts (x: fc1's pre-activation and dx: its dout, (M, 4h) here; dx is also the gated
    // residual's dh)
    bf16 *saved_x = cs.x, *saved_dx = cs.dx;
    cs.x = dy_wide, cs.dx = random_buffer(M * 4 * h * 2), cs.wide = random_buffer(M * 4 * h * 2);
    cs.d8 = (Fp8Dout){random_buffer(M * 4 * h), random_buffer((M + 16) * 4 * h), random_buffer(256)};
    int *guesses = random_buffer(10 * sizeof(int));
    float *taken = random_buffer(6 * sizeof(float));
    CK(cudaMemset(guesses, 0, 10 * sizeof(int)));
    CK(cudaMemset(taken, 0, 6 * sizeof(float)));
    cs.fused = (Fp8Scaling){NULL, guesses, taken, 3};
    cs.alone = (Fp8Scaling){NULL, guesses + 2, taken + 1, 0};
    double pass = time_op(op_dgelu_bf16, &cs), quantize = time_op(op_quantize_wide, &cs);
    double fused = time_op(op_dgelu_fp8, &cs);
    report(&cs, "dgelu (bf16) + dbias", pass, 24.0 * M * h, L);
    report(&cs, "  + quantize pass", pass + quantize, 24.0 * M * h + 16.0 * M * h, L);
    report(&cs, "dgelu fp8 (fused)", fused, 16.0 * M * h + 8.0 * M * h, L);
    cs.x = saved_x;
    pass = time_op(op_gated_bf16, &cs), quantize = time_op(op_quantize_h, &cs), fused = time_op(op_gated_fp8, &cs);
    report(&cs, "gated dgate+dh (bf16)", pass, 8.0 * N, 2 * L);
    report(&cs, "  + quantize pass", pass + quantize, 8.0 * N + 4.0 * N, 2 * L);
    report(&cs, "gated dgate+dh fp8", fused, 8.0 * N, 2 * L);
    quantize = time_op(op_quantize_qkv, &cs), fused = time_op(op_qkv_fp8, &cs);
    report(&cs, "qkv quantize + dbias", quantize + dbias_ms[0], 6.0 * N + 6.0 * N + 6.0 * N, L);
    report(&cs, "qkv dout fp8 (1 pass)", fused, 6.0 * N + 6.0 * N, L);
    void *fp8_bufs[] = {cs.dx, cs.wide, cs.d8.q, cs.d8.qt, cs.d8.scale, guesses, taken, dy_wide};
    for (size_t i = 0; i < sizeof fp8_bufs / sizeof *fp8_bufs; i++) CK(cudaFree(fp8_bufs[i]));
    cs.dx = saved_dx;

    // optimizer over the blocks' parameters (fp32 params, grads, m, v, ema; bf16 copy)
    cs.f0 = random_buffer(cs.nparams * 4), cs.f1 = random_buffer(cs.nparams * 4), cs.f2 = random_buffer(cs.nparams * 4);
    cs.f3 = random_buffer(cs.nparams * 4), cs.f4 = random_buffer((cs.nparams + 1) * 4);
    cs.pbf = random_buffer(cs.nparams * 2);
    CK(cudaMemset(cs.f3, 0, cs.nparams * 4));   // v >= 0
    OptimizerStepConstants k;
    OK(optimizer_step_constants(&k, 1e-4f, 0.9f, 0.95f, 10, 0.9999f, err));
    CK(cudaMalloc((void **)&cs.step, sizeof(k)));
    CK(cudaMemcpy(cs.step, &k, sizeof(k), cudaMemcpyHostToDevice));
    ms = time_op(op_adamw, &cs);
    report(&cs, "adamw", ms, 30.0 * cs.nparams, 1);
    ms = time_op(op_adamw_ema, &cs);
    report(&cs, "adamw + ema", ms, 38.0 * cs.nparams, 1);
    ms = time_op(op_norm, &cs);
    report(&cs, "sum_squares (norm)", ms, 4.0 * cs.nparams, 1);
    void *bufs[] = {cs.x, cs.y, cs.dy, cs.dx, cs.mod, cs.dmod, cs.mean, cs.rstd, cs.qkv, cs.q, cs.k, cs.v,
                    cs.w, cs.dw, cs.db, cs.f0, cs.f1, cs.f2, cs.f3, cs.f4, cs.pbf, cs.step};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) CK(cudaFree(bufs[i]));
}

int main(int argc, char **argv) {
    if (argc > 1) label = argv[1];
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("bench_layers_cuda: no CUDA GPU found\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("GPU: %s, %d SMs; median of %d runs after %d warm-up; %% of %.1f TB/s\n", prop.name,
           prop.multiProcessorCount, BENCH_REPEATS, BENCH_WARMUP, PEAK_GBS / 1000);
    OK(layers_cuda_create(&ctx, (size_t)1 << 22, err));
    const Config configs[] = {
        {"a", 64, 256, 768, 12, 64, 12},
        {"c", 1, 16384, 2048, 16, 128, 4},
    };
    for (size_t i = 0; i < sizeof configs / sizeof *configs; i++) bench_config(&configs[i]);
    layers_cuda_destroy(&ctx);
    return 0;
}
