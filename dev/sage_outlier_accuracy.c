// Experiment: what fixes sage attention's accuracy when Q and K have outlier channels?
// Inputs N(0,1) with two channels of q and k scaled ×8 and k + 20 on every 4th channel (the case
// of test_sage_cuda's OUTLIERS); cosine of out, dq, dk, dv of the CPU sage definition against
// exact attention, for (1) finer Q scales (q_block 64 / 16 / 4 / 1) and (2) a Hadamard rotation
// of q and k (SageConfig.rotate: S = (qH)(kH)ᵀ exactly, H orthogonal; the rotation spreads the
// outlier channels over all channels before INT8 quantization; dq, dk are rotated back). Build and run:
//   cc -O2 -std=c11 -D_GNU_SOURCE -I. -o build/sage_outlier_accuracy dev/sage_outlier_accuracy.c
//      attention/attention_cpu.c attention/sage_cpu.c layers/common.c -lm
//   build/sage_outlier_accuracy
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attention/attention.h"
#include "layers/common.h"
#include "test/compare.h"

enum { B = 1, H = 2, N = 512, D = 128 };

static float *floats(size_t n) {
    float *x = calloc(n, sizeof(float));
    if (!x) { fprintf(stderr, "out of memory\n"); exit(1); }
    return x;
}

int main(void) {
    size_t n = (size_t)B * H * N * D, rows = n / D;
    float *q = floats(n), *k = floats(n), *v = floats(n), *dout = floats(n);
    float *out = floats(n), *lse = floats(rows), *out_ref = floats(n), *lse_ref = floats(rows);
    float *g[3] = {floats(n), floats(n), floats(n)}, *g_ref[3] = {floats(n), floats(n), floats(n)};
    Rng rng;
    rng_seed(&rng, 5);
    rng_fill_normal(&rng, q, n, 1); rng_fill_normal(&rng, k, n, 1);
    rng_fill_normal(&rng, v, n, 1); rng_fill_normal(&rng, dout, n, 1);
    for (size_t i = 0; i < n; i++) {
        int d = i % D;
        if (d == 3 || d == 70) { q[i] *= 8; k[i] *= 8; }
        if (d % 4 == 0) k[i] += 20;
    }
    attention_forward(out_ref, lse_ref, q, k, v, B, H, N, D);
    attention_backward(g_ref[0], g_ref[1], g_ref[2], dout, q, k, v, out_ref, lse_ref, B, H, N, D);

    printf("B=%d H=%d N=%d D=%d, outlier channels; cosine against exact attention\n\n", B, H, N, D);
    printf("| Q/K | P·V | q_block | out | dq | dk | dv |\n|---|---|---|---|---|---|---|\n");
    const int q_blocks[4] = {64, 16, 4, 1};
    for (int rotate = 0; rotate < 2; rotate++)
        for (int pv = 0; pv < 2; pv++)
            for (int b = 0; b < (rotate ? 1 : 4); b++) {
                SageConfig cfg = {q_blocks[b], 64, pv ? SAGE_PV_FP16 : SAGE_PV_FP8, rotate, SAGE_BWD_FP32};
                sage_forward(out, lse, q, k, v, B, H, N, D, cfg);
                for (int i = 0; i < 3; i++) memset(g[i], 0, n * sizeof(float));
                sage_backward(g[0], g[1], g[2], dout, q, k, v, out, lse, B, H, N, D, cfg);
                printf("| %s | %s | %d | %.6f | %.6f | %.6f | %.6f |\n", rotate ? "Hadamard" : "plain",
                       pv ? "FP16" : "FP8", q_blocks[b], cosine(out, out_ref, n), cosine(g[0], g_ref[0], n),
                       cosine(g[1], g_ref[1], n), cosine(g[2], g_ref[2], n));
            }
    return 0;
}
