// CPU model of the FP8 linear layer's error against the bf16 one (layers/linear_fp8.c against
// layers/linear.c on the same bf16-rounded operands), at the IC × OC of config c's four linears
// with fewer tokens (the relative errors do not depend on M), operands from test/linear_fp8_data.h.
// For the backward both gradient formats are measured, e5m2 and e4m3, with gradients spread over
// tokens as e^N(0, 1) and ("wide") e^N(0, 2²).
// Prints rel L2 = ‖fp8 − ref‖/‖ref‖ and the cosine for out, dinp, dweight (dbias is not quantized).
//
// Build: gcc -O3 -std=c11 -D_GNU_SOURCE -I. -I/usr/local/cuda/include -fopenmp -o build/linear_fp8_accuracy
//          dev/linear_fp8_accuracy.c layers/linear.c layers/linear_fp8.c layers/common.c attention/sage_cpu.c -lm
// Run:   build/linear_fp8_accuracy [M]   (default 512)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "layers/fp8.h"
#include "layers/layers.h"
#include "test/compare.h"
#include "test/linear_fp8_data.h"

static float *floats(size_t n) {
    float *p = calloc(n, sizeof(float));
    if (!p) {
        fprintf(stderr, "out of memory (%zu floats)\n", n);
        exit(1);
    }
    return p;
}

static void row(const char *layer, const char *what, const float *x, const float *ref, size_t n) {
    printf("%-5s %-16s rel L2 %.4f  cosine %.6f\n", layer, what, rel_l2(x, ref, n), cosine(x, ref, n));
}

int main(int argc, char **argv) {
    int M = argc > 1 ? atoi(argv[1]) : 512, h = 2048;
    struct { const char *name; int IC, OC; Fp8DataKind kind; } layers[] = {
        {"qkv", h, 3 * h, FP8_DATA_MODULATED}, {"proj", h, h, FP8_DATA_ATTENTION},
        {"fc1", h, 4 * h, FP8_DATA_MODULATED}, {"fc2", 4 * h, h, FP8_DATA_GELU},
    };
    printf("M = %d tokens; reference: fp32 linear on the bf16 operands\n", M);
    for (int l = 0; l < 4; l++) {
        int IC = layers[l].IC, OC = layers[l].OC;
        Rng rng;
        rng_seed(&rng, 1234 + l);
        float *inp = floats((size_t)M * IC), *w = floats((size_t)OC * IC), *b = floats(OC);
        float *dout = floats((size_t)M * OC);
        fp8_data_input(&rng, inp, M, IC, layers[l].kind);
        fp8_data_weight(&rng, w, IC, OC);
        fp8_data_dout(&rng, dout, M, OC, 1.0f);
        float *ref = floats((size_t)M * OC), *out = floats((size_t)M * OC);
        linear_forward(ref, inp, w, b, M, IC, OC);
        linear_fp8_forward(out, inp, w, b, M, IC, OC);
        row(layers[l].name, "out", out, ref, (size_t)M * OC);
        float *dinp_ref = floats((size_t)M * IC), *dw_ref = floats((size_t)OC * IC);
        linear_backward(dinp_ref, dw_ref, NULL, dout, inp, w, M, IC, OC);
        for (int g = 0; g < 4; g++) {
            Fp8Format f = g % 2 == 0 ? FP8_E5M2 : FP8_E4M3;
            if (g == 2) {   // the same layer with a wider spread of gradients over tokens
                fp8_data_dout(&rng, dout, M, OC, 2.0f);
                memset(dinp_ref, 0, (size_t)M * IC * sizeof(float));
                memset(dw_ref, 0, (size_t)OC * IC * sizeof(float));
                linear_backward(dinp_ref, dw_ref, NULL, dout, inp, w, M, IC, OC);
            }
            float *dinp = floats((size_t)M * IC), *dw = floats((size_t)OC * IC);
            linear_fp8_backward(dinp, dw, NULL, dout, inp, w, M, IC, OC, f);
            char what[40];
            const char *fmt = g % 2 == 0 ? "e5m2" : "e4m3", *spread = g < 2 ? "" : ", wide";
            snprintf(what, sizeof what, "dinp (%s%s)", fmt, spread);
            row(layers[l].name, what, dinp, dinp_ref, (size_t)M * IC);
            snprintf(what, sizeof what, "dW   (%s%s)", fmt, spread);
            row(layers[l].name, what, dw, dw_ref, (size_t)OC * IC);
            free(dinp);
            free(dw);
        }
        free(inp), free(w), free(b), free(dout), free(ref), free(out), free(dinp_ref), free(dw_ref);
    }
    return 0;
}
