// Measures the 8-bit backwards of sage attention (SageConfig.bwd, attention.h: INT8 and FP8) against
// the default fp32-operand backward: cosine and rel L2 of dq, dk, dv against exact attention's
// gradient (attention_forward / attention_backward in fp32), and rel L2 against SAGE_BWD_FP32's
// gradient from the same sage forward (the error of the backward's products alone), on
// (a) Gaussian inputs and (b) outliers (K + 20 on every 4th channel, q and k ×8 on channels 3 and
// D/2 + 6, as test_attention_cpu's sage_vs_exact), D = 64 and 128. Forward configurations:
// Gaussian without the Hadamard rotation, outliers with it (the only case where the fp32 backward
// reaches the 0.999 bar), each with FP8 and FP16 P·V; all = 1: all four for both inputs.
// Prints a markdown table (dev/notes_attention_cpu.md, dev/notes_sage_fp8_bwd.md). From the
// repository root:
//   make build/sage_bwd_int8_accuracy
//   build/sage_bwd_int8_accuracy [N=1024] [H=2] [D=0: both 64 and 128] [all=0]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attention/attention.h"
#include "layers/common.h"
#include "test/compare.h"

static float *floats(size_t n) {
    float *x = calloc(n, sizeof(float));
    if (!x) { fprintf(stderr, "sage_bwd_int8_accuracy: out of memory (%zu floats)\n", n); exit(1); }
    return x;
}

static const char *bwd_name(SageBwd bwd) {
    static const char *names[] = {"fp32", "INT8 block", "INT8 token", "FP8 tile", "FP8 e5m2 tile",
                                  "FP8 bound", "FP8 e5m2 bound"};
    return names[bwd];
}

int main(int argc, char **argv) {
    int N = argc > 1 ? atoi(argv[1]) : 1024;
    int H = argc > 2 ? atoi(argv[2]) : 2;
    int D_only = argc > 3 ? atoi(argv[3]) : 0;
    int all = argc > 4 ? atoi(argv[4]) : 0;
    const int B = 1, dims[2] = {64, 128}, n_bwd = SAGE_BWD_FP8_E5M2_BOUND + 1;
    printf("sage backward vs exact attention's gradient, B=%d H=%d N=%d, blocks of 64, seed 1234+D\n\n", B, H, N);
    printf("| inputs | rotate | P·V | D | backward | dq cos | dk cos | dv cos | dq rel L2 | dk rel L2 | dv rel L2 "
           "| vs fp32 bwd: dq / dk / dv rel L2 |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int outliers = 0; outliers < 2; outliers++)
        for (int di = 0; di < 2; di++) {
            int D = dims[di];
            if (D_only && D != D_only) continue;
            size_t n = (size_t)B * H * N * D, rows = (size_t)B * H * N;
            Rng rng;
            rng_seed(&rng, 1234 + D);
            float *q = floats(n), *k = floats(n), *v = floats(n), *dout = floats(n);
            rng_fill_normal(&rng, q, n, 1); rng_fill_normal(&rng, k, n, 1);
            rng_fill_normal(&rng, v, n, 1); rng_fill_normal(&rng, dout, n, 1);
            if (outliers)
                for (size_t i = 0; i < n; i++) {
                    int d = (int)(i % D);
                    if (d % 4 == 0) k[i] += 20;
                    if (d == 3 || d == D / 2 + 6) { q[i] *= 8; k[i] *= 8; }
                }
            float *out = floats(n), *lse = floats(rows), *g_ref[3] = {floats(n), floats(n), floats(n)};
            attention_forward(out, lse, q, k, v, B, H, N, D);
            attention_backward(g_ref[0], g_ref[1], g_ref[2], dout, q, k, v, out, lse, B, H, N, D);
            float *s_out = floats(n), *s_lse = floats(rows), *g[3] = {floats(n), floats(n), floats(n)};
            float *g32[3] = {floats(n), floats(n), floats(n)};
            for (int rotate = 0; rotate < 2; rotate++)
                for (int pv = 0; pv < 2; pv++) {
                    if (!all && rotate != outliers) continue;
                    SageConfig cfg = {64, 64, pv ? SAGE_PV_FP16 : SAGE_PV_FP8, rotate, SAGE_BWD_FP32};
                    sage_forward(s_out, s_lse, q, k, v, B, H, N, D, cfg);
                    for (int b = 0; b < n_bwd; b++) {
                        cfg.bwd = (SageBwd)b;
                        float **gb = b == SAGE_BWD_FP32 ? g32 : g;
                        for (int t = 0; t < 3; t++) memset(gb[t], 0, n * sizeof(float));
                        sage_backward(gb[0], gb[1], gb[2], dout, q, k, v, s_out, s_lse, B, H, N, D, cfg);
                        printf("| %s | %s | %s | %d | %s |", outliers ? "outliers" : "Gaussian",
                               rotate ? "yes" : "no", pv ? "FP16" : "FP8", D, bwd_name(cfg.bwd));
                        for (int t = 0; t < 3; t++) printf(" %.6f |", cosine(gb[t], g_ref[t], n));
                        for (int t = 0; t < 3; t++) printf(" %.2e |", rel_l2(gb[t], g_ref[t], n));
                        for (int t = 0; t < 3; t++) printf(" %.2e%s", rel_l2(gb[t], g32[t], n), t < 2 ? " /" : " |\n");
                        fflush(stdout);
                    }
                }
            free(q); free(k); free(v); free(dout); free(out); free(lse); free(s_out); free(s_lse);
            for (int t = 0; t < 3; t++) { free(g_ref[t]); free(g[t]); free(g32[t]); }
        }
    return 0;
}
