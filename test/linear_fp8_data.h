// Realistic operands for measuring the FP8 linear layer against the bf16 one (test and dev code):
// the inputs of a DiT block's four linears as the block produces them, DiT's initial weight
// scale, and token-dependent output gradients. All values are rounded to bf16, so that the bf16
// and FP8 layers (and the CPU) see the same numbers.
#pragma once
#include <math.h>
#include "layers/common.h"
#include "layers/layers_cuda.h"

typedef enum {
    FP8_DATA_MODULATED,   // qkv, fc1: LayerNorm-ed rows of N(0, 1), then x̂·(1 + scale_c) + shift_c,
                          //   scale_c, shift_c ~ N(0, 0.5²) (adaLN), 1 channel in 512 times 10 (an outlier)
    FP8_DATA_ATTENTION,   // proj: attention output, N(0, 0.3²) times a per-token factor e^N(0, 0.5²)
    FP8_DATA_GELU,        // fc2: GELU(N(0, 1)) (fc1's output has unit-order spread)
} Fp8DataKind;

static inline float fp8_data_bf16(float x) { return float_from_bf16_bits(bf16_bits_from_float(x)); }

// x (M, C) of the given kind.
static inline void fp8_data_input(Rng *rng, float *x, int M, int C, Fp8DataKind kind) {
    size_t n = (size_t)M * C;
    rng_fill_normal(rng, x, n, 1.0f);
    if (kind == FP8_DATA_MODULATED) {
        float mod[2 * 8192];
        int Cm = C < 8192 ? C : 8192;
        rng_fill_normal(rng, mod, 2 * (size_t)Cm, 0.5f);
        for (int m = 0; m < M; m++) {
            float *r = x + (size_t)m * C;
            double mean = 0, var = 0;
            for (int c = 0; c < C; c++) mean += r[c];
            mean /= C;
            for (int c = 0; c < C; c++) var += (r[c] - mean) * (r[c] - mean);
            float rstd = (float)(1.0 / sqrt(var / C + 1e-6));
            for (int c = 0; c < C; c++) {
                float v = (float)(r[c] - mean) * rstd * (1.0f + mod[c % Cm]) + mod[Cm + c % Cm];
                r[c] = c % 512 == 7 ? 10.0f * v : v;
            }
        }
    } else if (kind == FP8_DATA_ATTENTION) {
        for (int m = 0; m < M; m++) {
            float f = 0.3f * expf(0.5f * rng_normal(rng));
            for (int c = 0; c < C; c++) x[(size_t)m * C + c] *= f;
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            float v = x[i];
            x[i] = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
        }
    }
    for (size_t i = 0; i < n; i++) x[i] = fp8_data_bf16(x[i]);
}

// weight (OC, IC): N(0, 2/(IC + OC)) (the variance of DiT's Xavier-uniform initialisation).
static inline void fp8_data_weight(Rng *rng, float *w, int IC, int OC) {
    size_t n = (size_t)OC * IC;
    rng_fill_normal(rng, w, n, sqrtf(2.0f / (IC + OC)));
    for (size_t i = 0; i < n; i++) w[i] = fp8_data_bf16(w[i]);
}

// dout (M, OC): N(0, 1e-3²) times a per-token factor e^N(0, token_sigma²) (gradients vary over
// tokens; token_sigma 1 spans ~400× between the 0.1% and 99.9% tokens, 2 spans ~1.6e5×).
static inline void fp8_data_dout(Rng *rng, float *g, int M, int OC, float token_sigma) {
    rng_fill_normal(rng, g, (size_t)M * OC, 1e-3f);
    for (int m = 0; m < M; m++) {
        float f = expf(token_sigma * rng_normal(rng));
        for (int o = 0; o < OC; o++) g[(size_t)m * OC + o] = fp8_data_bf16(g[(size_t)m * OC + o] * f);
    }
}
