// The FP8 linear layer on the CPU: the definition its CUDA version (layers/linear_fp8_cuda.cu) is
// tested against. Operands are fake-quantized (rounded to fp8 with a power-of-two per-tensor scale,
// layers/fp8.h), then the fp32 reference linear runs on them: the GPU's FP8 GEMM computes the same
// products exactly, so only the order of the fp32 sums (and the GPU's bf16 output) differ.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "attention/attention.h"
#include "layers/fp8.h"
#include "layers/layers.h"

float fp8_fake_quantize(float *out, const float *x, size_t n, Fp8Format format) {
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    int e = fp8_scale_exponent(amax, format);
    float down = ldexpf(1.0f, -e), up = ldexpf(1.0f, e);
    for (size_t i = 0; i < n; i++) {
        float v = x[i] * down;
        out[i] = (format == FP8_E4M3 ? round_to_e4m3(v) : round_to_e5m2(v)) * up;
    }
    return up;
}

// A fake-quantized copy of x (n), NULL when out of memory.
static float *quantized_copy(const float *x, size_t n, Fp8Format format) {
    float *q = malloc(n * sizeof(float));
    if (q) fp8_fake_quantize(q, x, n, format);
    return q;
}

static void fill_nan(float *x, size_t n) {
    if (x)
        for (size_t i = 0; i < n; i++) x[i] = NAN;
}

void linear_fp8_forward(float *out, const float *inp, const float *weight, const float *bias,
                        int M, int IC, int OC) {
    float *inp_q = quantized_copy(inp, (size_t)M * IC, FP8_E4M3);
    float *w_q = quantized_copy(weight, (size_t)OC * IC, FP8_E4M3);
    if (!inp_q || !w_q) {
        fprintf(stderr, "linear_fp8_forward: out of memory (M=%d IC=%d OC=%d); output set to NaN\n", M, IC, OC);
        fill_nan(out, (size_t)M * OC);
    } else {
        linear_forward(out, inp_q, w_q, bias, M, IC, OC);
    }
    free(inp_q);
    free(w_q);
}

void linear_fp8_backward(float *dinp, float *dweight, float *dbias,
                         const float *dout, const float *inp, const float *weight,
                         int M, int IC, int OC, Fp8Format grad_format) {
    float *dout_q = quantized_copy(dout, (size_t)M * OC, grad_format);
    float *inp_q = quantized_copy(inp, (size_t)M * IC, FP8_E4M3);
    float *w_q = quantized_copy(weight, (size_t)OC * IC, FP8_E4M3);
    if (!dout_q || !inp_q || !w_q) {
        fprintf(stderr, "linear_fp8_backward: out of memory (M=%d IC=%d OC=%d); outputs set to NaN\n", M, IC, OC);
        fill_nan(dinp, (size_t)M * IC);
        fill_nan(dweight, (size_t)OC * IC);
        fill_nan(dbias, (size_t)OC);
    } else {
        // dinp and dweight from the quantized operands, dbias from the unquantized dout
        linear_backward(dinp, dweight, NULL, dout_q, inp_q, w_q, M, IC, OC);
        if (dbias)
            for (int m = 0; m < M; m++)
                for (int o = 0; o < OC; o++) dbias[o] += dout[(size_t)m * OC + o];
    }
    free(dout_q);
    free(inp_q);
    free(w_q);
}
