// Measures the INT8 backward of sage attention (SageConfig.bwd, attention.h) against the default
// fp32-operand backward: cosine and rel L2 of dq, dk, dv against exact attention's gradient
// (attention_forward / attention_backward in fp32), on (a) Gaussian inputs and (b) outliers
// (K + 20 on every 4th channel, q and k ×8 on channels 3 and D/2 + 6, as test_attention_cpu's
// sage_vs_exact), without and with the Hadamard rotation, FP8 and FP16 P·V, D = 64 and 128.
// Prints a markdown table (dev/notes_attention_cpu.md). Build and run from the repository root:
//   cc -O2 -std=c11 -D_GNU_SOURCE -I. -o build/sage_bwd_int8_accuracy dev/sage_bwd_int8_accuracy.c
//      attention/attention_cpu.c attention/sage_cpu.c layers/common.c -lm
//   build/sage_bwd_int8_accuracy [N=1024] [H=2] [D=0: both 64 and 128]
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
    return bwd == SAGE_BWD_FP32 ? "fp32" : bwd == SAGE_BWD_INT8_BLOCK ? "INT8 block" : "INT8 token";
}

int main(int argc, char **argv) {
    int N = argc > 1 ? atoi(argv[1]) : 1024;
    int H = argc > 2 ? atoi(argv[2]) : 2;
    int D_only = argc > 3 ? atoi(argv[3]) : 0;
    const int B = 1, dims[2] = {64, 128};
    const SageBwd bwds[3] = {SAGE_BWD_FP32, SAGE_BWD_INT8_BLOCK, SAGE_BWD_INT8_TOKEN};
    printf("sage backward vs exact attention's gradient, B=%d H=%d N=%d, blocks of 64, seed 1234+D\n\n", B, H, N);
    printf("| inputs | rotate | P·V | D | backward | dq cos | dq rel L2 | dk cos | dk rel L2 | dv cos | dv rel L2 |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
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
            for (int rotate = 0; rotate < 2; rotate++)
                for (int pv = 0; pv < 2; pv++) {
                    SageConfig cfg = {64, 64, pv ? SAGE_PV_FP16 : SAGE_PV_FP8, rotate, SAGE_BWD_FP32};
                    sage_forward(s_out, s_lse, q, k, v, B, H, N, D, cfg);
                    for (int b = 0; b < 3; b++) {
                        cfg.bwd = bwds[b];
                        for (int t = 0; t < 3; t++) memset(g[t], 0, n * sizeof(float));
                        sage_backward(g[0], g[1], g[2], dout, q, k, v, s_out, s_lse, B, H, N, D, cfg);
                        printf("| %s | %s | %s | %d | %s |", outliers ? "outliers" : "Gaussian",
                               rotate ? "yes" : "no", pv ? "FP16" : "FP8", D, bwd_name(bwds[b]));
                        for (int t = 0; t < 3; t++)
                            printf(" %.6f | %.2e |", cosine(g[t], g_ref[t], n), rel_l2(g[t], g_ref[t], n));
                        printf("\n");
                        fflush(stdout);
                    }
                }
            free(q); free(k); free(v); free(dout); free(out); free(lse); free(s_out); free(s_lse);
            for (int t = 0; t < 3; t++) { free(g_ref[t]); free(g[t]); }
        }
    return 0;
}
