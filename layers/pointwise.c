// Pointwise layers: gated residual, GELU (tanh), SiLU, add.
#include <math.h>
#include "layers/layers.h"

void gated_residual_forward(float *out, const float *res, const float *h, const float *gate,
                            int B, int T, int C, int mod_stride) {
    for (int b = 0; b < B; b++) {
        const float *g = gate + (size_t)b * mod_stride;
        for (int t = 0; t < T; t++) {
            size_t row = ((size_t)b * T + t) * C;
            for (int c = 0; c < C; c++) out[row + c] = res[row + c] + g[c] * h[row + c];
        }
    }
}

void gated_residual_backward(float *dres, float *dh, float *dgate,
                             const float *dout, const float *h, const float *gate,
                             int B, int T, int C, int mod_stride) {
    for (int b = 0; b < B; b++) {
        const float *g = gate + (size_t)b * mod_stride;
        float *dg = dgate + (size_t)b * mod_stride;
        for (int t = 0; t < T; t++) {
            size_t row = ((size_t)b * T + t) * C;
            for (int c = 0; c < C; c++) {
                float d = dout[row + c];
                if (dres) dres[row + c] += d;
                dh[row + c] += g[c] * d;
                dg[c] += d * h[row + c];
            }
        }
    }
}

#define GELU_SCALE 0.7978845608028654f   // sqrt(2/π)

void gelu_forward(float *out, const float *inp, size_t n) {
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        out[i] = 0.5f * x * (1.0f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x)));
    }
}

void gelu_backward(float *dinp, const float *inp, const float *dout, size_t n) {
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_SCALE * (x + 0.044715f * x * x * x);
        float th = tanhf(u);
        float du = GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
        float grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
        dinp[i] += grad * dout[i];
    }
}

void silu_forward(float *out, const float *inp, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = inp[i] / (1.0f + expf(-inp[i]));
}

void silu_backward(float *dinp, const float *inp, const float *dout, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float sig = 1.0f / (1.0f + expf(-inp[i]));
        dinp[i] += dout[i] * sig * (1.0f + inp[i] * (1.0f - sig));
    }
}

void add_forward(float *out, const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}
