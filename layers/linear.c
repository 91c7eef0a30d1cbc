// Linear layer y = x·Wᵀ + b, forward and backward (the plain-C reference of the cuBLASLt GEMMs).
#include "layers/layers.h"

void linear_forward(float *out, const float *inp, const float *weight, const float *bias,
                    int M, int IC, int OC) {
    #pragma omp parallel for
    for (int m = 0; m < M; m++) {
        const float *x = inp + (size_t)m * IC;
        float *y = out + (size_t)m * OC;
        for (int o = 0; o < OC; o++) {
            const float *w = weight + (size_t)o * IC;
            float acc = 0.0f;
            #pragma omp simd reduction(+ : acc)
            for (int i = 0; i < IC; i++) acc += x[i] * w[i];
            if (bias) acc += bias[o];
            y[o] = acc;
        }
    }
}

void linear_backward(float *dinp, float *dweight, float *dbias,
                     const float *dout, const float *inp, const float *weight,
                     int M, int IC, int OC) {
    if (dinp) {
        // dinp (M, IC) += dout (M, OC) · weight (OC, IC)
        #pragma omp parallel for
        for (int m = 0; m < M; m++) {
            const float *dy = dout + (size_t)m * OC;
            float *dx = dinp + (size_t)m * IC;
            for (int o = 0; o < OC; o++) {
                const float *w = weight + (size_t)o * IC;
                float g = dy[o];
                #pragma omp simd
                for (int i = 0; i < IC; i++) dx[i] += g * w[i];
            }
        }
    }
    // dweight (OC, IC) += doutᵀ · inp; dbias (OC) += Σ_m dout
    #pragma omp parallel for
    for (int o = 0; o < OC; o++) {
        float *dw = dweight + (size_t)o * IC;
        float db = 0.0f;
        for (int m = 0; m < M; m++) {
            const float *x = inp + (size_t)m * IC;
            float g = dout[(size_t)m * OC + o];
            db += g;
            #pragma omp simd
            for (int i = 0; i < IC; i++) dw[i] += g * x[i];
        }
        if (dbias) dbias[o] += db;
    }
}
