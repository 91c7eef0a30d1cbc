// The quantize kernel's V division by reciprocal (attention/sage_quant.cu, times_inverse_scale)
// against the definition's e4m3(v / v_scale) (attention/sage_cpu.c), exhaustively: every channel
// maximum m (each positive finite bf16 with m/448 >= 2^-80; smaller scales take the division on
// the GPU too) and every bf16 v with |v| <= m, with the GPU's flush-to-zero applied to each
// result. Prints the number of pairs whose e4m3 bytes differ and exits 1 if there are any.
//   gcc -O2 -std=c11 -fopenmp -ffp-contract=off -I. dev/check_v_reciprocal.c attention/sage_cpu.c -lm
//   ./a.out     (~20 s on two cores)
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "attention/attention.h"

static float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
// --use_fast_math's flush-to-zero: a denormal becomes a zero of its sign.
static float ftz(float f) { return fabsf(f) < 0x1p-126f ? copysignf(0.0f, f) : f; }

int main(void) {
    long long pairs = 0, quotient_differs = 0, byte_differs = 0;
#pragma omp parallel for schedule(dynamic) reduction(+ : pairs, quotient_differs, byte_differs)
    for (int mb = 1; mb < 0x7f80; mb++) {
        float m = from_bf16((uint16_t)mb), scale = m / 448.0f;
        if (scale < 0x1p-80f) continue;
        float inv = 1.0f / scale;   // __frcp_rn
        for (int vb = 0; vb < 0x10000; vb++) {
            float v = from_bf16((uint16_t)vb);
            if (!(fabsf(v) <= m)) continue;
            float division = v / scale;
            float vf = ftz(v);   // (flush-to-zero applies to the operands as well)
            float q = ftz(vf * inv), y = ftz(fmaf(-ftz(fmaf(q, scale, -vf)), inv, q));
            pairs++;
            quotient_differs += bits(y) != bits(division);
            byte_differs += bits(round_to_e4m3(y)) != bits(round_to_e4m3(division));
        }
    }
    printf("%lld (v, scale) pairs: fp32 quotients differ in %lld, e4m3 values in %lld\n", pairs,
           quotient_differs, byte_differs);
    return byte_differs != 0;
}
