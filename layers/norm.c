// LayerNorm without affine parameters, fused with the adaLN modulation of DiT.
#include <math.h>
#include "layers/layers.h"

#define LAYERNORM_EPS 1e-6f

void layernorm_modulate_forward(float *out, float *mean, float *rstd,
                                const float *inp, const float *shift, const float *scale,
                                int B, int T, int C, int mod_stride) {
    #pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const float *x = inp + ((size_t)b * T + t) * C;
            const float *sh = shift + (size_t)b * mod_stride, *sc = scale + (size_t)b * mod_stride;
            float m = 0.0f;
            for (int c = 0; c < C; c++) m += x[c];
            m /= C;
            float var = 0.0f;
            for (int c = 0; c < C; c++) var += (x[c] - m) * (x[c] - m);
            float s = 1.0f / sqrtf(var / C + LAYERNORM_EPS);
            float *y = out + ((size_t)b * T + t) * C;
            for (int c = 0; c < C; c++) y[c] = (x[c] - m) * s * (1.0f + sc[c]) + sh[c];
            mean[(size_t)b * T + t] = m;
            rstd[(size_t)b * T + t] = s;
        }
}

void layernorm_modulate_backward(float *dinp, float *dshift, float *dscale,
                                 const float *dout, const float *inp, const float *mean,
                                 const float *rstd, const float *scale,
                                 int B, int T, int C, int mod_stride) {
    #pragma omp parallel for
    for (int b = 0; b < B; b++) {
        const float *sc = scale + (size_t)b * mod_stride;
        float *dsh = dshift + (size_t)b * mod_stride, *dsc = dscale + (size_t)b * mod_stride;
        for (int t = 0; t < T; t++) {
            size_t row = (size_t)b * T + t;
            const float *x = inp + row * C, *dy = dout + row * C;
            float m = mean[row], s = rstd[row];
            // the two means over channels that the normalization backward needs
            float mean_dxhat = 0.0f, mean_dxhat_xhat = 0.0f;
            for (int c = 0; c < C; c++) {
                float xhat = (x[c] - m) * s;
                float dxhat = dy[c] * (1.0f + sc[c]);
                mean_dxhat += dxhat;
                mean_dxhat_xhat += dxhat * xhat;
                dsh[c] += dy[c];
                dsc[c] += dy[c] * xhat;
            }
            mean_dxhat /= C;
            mean_dxhat_xhat /= C;
            if (!dinp) continue;
            float *dx = dinp + row * C;
            for (int c = 0; c < C; c++) {
                float xhat = (x[c] - m) * s;
                float dxhat = dy[c] * (1.0f + sc[c]);
                dx[c] += s * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat);
            }
        }
    }
}
