// Measures sage attention (CPU definition, FP8 and FP16 P·V) against exact attention:
// relative L2 error and cosine of out, dq, dk, dv, on Gaussian inputs and on Gaussian inputs
// whose K has a large offset (+20) on every 4th channel. Prints a markdown table.
// Build and run (see dev/notes_attention_cpu.md):
//   cc -O2 -std=c11 -D_GNU_SOURCE -I. -o build/sage_cpu_accuracy dev/sage_cpu_accuracy.c attention/attention_cpu.c attention/sage_cpu.c layers/common.c -lm
//   build/sage_cpu_accuracy [N=1024] [H=2]
#include "attention/attention.h"
#include "layers/common.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void compare(double *rel_l2, double *cosine, const float *x, const float *ref, size_t n) {
    double err = 0, ref2 = 0, x2 = 0, xr = 0;
    for (size_t i = 0; i < n; i++) {
        err += ((double)x[i] - ref[i]) * ((double)x[i] - ref[i]);
        ref2 += (double)ref[i] * ref[i];
        x2 += (double)x[i] * x[i];
        xr += (double)x[i] * ref[i];
    }
    *rel_l2 = sqrt(err / ref2);
    *cosine = xr / sqrt(x2 * ref2);
}

static float *alloc_floats(size_t n) {
    float *x = calloc(n, sizeof(float));
    if (!x) { fprintf(stderr, "sage_cpu_accuracy: out of memory (%zu floats)\n", n); exit(1); }
    return x;
}

int main(int argc, char **argv) {
    int N = argc > 1 ? atoi(argv[1]) : 1024;
    int H = argc > 2 ? atoi(argv[2]) : 2;
    const int B = 1;
    printf("sage vs exact attention, B=%d H=%d N=%d, q_block=k_block=64, inputs N(0,1)\n\n", B, H, N);
    printf("| K input | D | P·V | out rel L2 | out cos | dq rel L2 | dq cos | dk rel L2 | dk cos | dv rel L2 | dv cos |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    const int dims[2] = {64, 128};
    for (int offset_k = 0; offset_k < 2; offset_k++) {
        for (int di = 0; di < 2; di++) {
            int D = dims[di];
            size_t n = (size_t)B * H * N * D, nr = (size_t)B * H * N;
            Rng rng;
            rng_seed(&rng, 1234 + D);
            float *q = alloc_floats(n), *k = alloc_floats(n), *v = alloc_floats(n), *dout = alloc_floats(n);
            rng_fill_normal(&rng, q, n, 1.0f);
            rng_fill_normal(&rng, k, n, 1.0f);
            rng_fill_normal(&rng, v, n, 1.0f);
            rng_fill_normal(&rng, dout, n, 1.0f);
            if (offset_k)
                for (size_t i = 0; i < n; i++) if (i % D % 4 == 0) k[i] += 20.0f;
            float *out = alloc_floats(n), *lse = alloc_floats(nr);
            float *grads = alloc_floats(3 * n);
            attention_forward(out, lse, q, k, v, B, H, N, D);
            attention_backward(grads, grads + n, grads + 2 * n, dout, q, k, v, out, lse, B, H, N, D);
            for (int pv = 0; pv < 2; pv++) {
                SageConfig cfg = SAGE_CONFIG_DEFAULT;
                cfg.pv = pv ? SAGE_PV_FP16 : SAGE_PV_FP8;
                float *s_out = alloc_floats(n), *s_lse = alloc_floats(nr), *s_grads = alloc_floats(3 * n);
                sage_forward(s_out, s_lse, q, k, v, B, H, N, D, cfg);
                sage_backward(s_grads, s_grads + n, s_grads + 2 * n, dout, q, k, v, s_out, s_lse,
                              B, H, N, D, cfg);
                double rel[4], cos[4];
                compare(&rel[0], &cos[0], s_out, out, n);
                for (int g = 0; g < 3; g++) compare(&rel[g + 1], &cos[g + 1], s_grads + g * n, grads + g * n, n);
                printf("| %s | %d | %s |", offset_k ? "+20 on every 4th channel" : "Gaussian", D,
                       pv ? "FP16" : "FP8");
                for (int t = 0; t < 4; t++) printf(" %.2e | %.6f |", rel[t], cos[t]);
                printf("\n");
                free(s_out); free(s_lse); free(s_grads);
            }
            free(q); free(k); free(v); free(dout); free(out); free(lse); free(grads);
        }
    }
    return 0;
}
