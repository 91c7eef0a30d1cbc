// The CPU definition of the FP8 linear layer (layers/fp8.h, layers/linear_fp8.c): the power-of-two
// scale and the guessed scale's headroom rule, the fake quantization (the e4m3 / e5m2 roundings are tested in test_attention_cpu.c),
// and the layer's error against the fp32 linear (it must round, and no coarser than e4m3 / e5m2
// should).
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include "attention/attention.h"
#include "layers/common.h"
#include "layers/fp8.h"
#include "layers/layers.h"
#include "test/compare.h"

Test(fp8, scale_exponent) {
    // e: the smallest with amax·2^-e <= 448 (e4m3) / 57344 (e5m2)
    cr_expect_eq(fp8_scale_exponent(448.0f, FP8_E4M3), 0);
    cr_expect_eq(fp8_scale_exponent(nextafterf(448.0f, 1e9f), FP8_E4M3), 1);
    cr_expect_eq(fp8_scale_exponent(224.0f, FP8_E4M3), -1);
    cr_expect_eq(fp8_scale_exponent(1.0f, FP8_E4M3), -8);
    cr_expect_eq(fp8_scale_exponent(57344.0f, FP8_E5M2), 0);
    cr_expect_eq(fp8_scale_exponent(1.0f, FP8_E5M2), -15);
    cr_expect_eq(fp8_scale_exponent(0.0f, FP8_E4M3), 0);
    cr_expect_eq(fp8_scale_exponent(INFINITY, FP8_E4M3), 0);
    cr_expect_eq(fp8_scale_exponent(1e-40f, FP8_E5M2), -126);
    Rng rng;
    rng_seed(&rng, 3);
    for (int i = 0; i < 10000; i++) {
        float amax = ldexpf(0.5f + rng_uniform(&rng), -40 + (int)(rng_u32(&rng) % 80));
        for (int f = 0; f < 2; f++) {
            float fmax = f == 0 ? 448.0f : 57344.0f;
            int e = fp8_scale_exponent(amax, (Fp8Format)f);
            cr_assert(ldexpf(amax, -e) <= fmax && ldexpf(amax, 1 - e) > fmax, "amax %g format %d: e %d", amax, f, e);
        }
    }
}

// The guessed scale with headroom (Fp8Scaling.headroom, layers/fp8.h): an exponent used is kept
// exactly when e <= used <= e + 2H (e of the amax), the next guess is e + H (at most 127); and what
// the claim that rests on it says: with any kept exponent no value saturates, and every value whose
// scaled magnitude is still in e4m3's normal range (>= 2^-6) rounds to the same number as with
// current scaling's e, so only the smallest values of a tensor can differ.
Test(fp8, headroom_rule) {
    for (int H = 0; H <= 3; H++)
        for (int d = -3; d <= 2 * H + 3; d++)
            cr_expect_eq(fp8_guess_kept(5 + d, 5, H), d >= 0 && d <= 2 * H, "H %d, used e%+d", H, d);
    cr_expect_eq(fp8_next_guess(-7, 3), -4);
    cr_expect_eq(fp8_next_guess(126, 3), 127);
    Rng rng;
    rng_seed(&rng, 4);
    int small = 0;
    for (int i = 0; i < 100000; i++) {
        float amax = ldexpf(0.5f + rng_uniform(&rng), -20 + (int)(rng_u32(&rng) % 40));
        float x = amax * rng_uniform(&rng) * ldexpf(1.0f, -(int)(rng_u32(&rng) % 16));
        int e = fp8_scale_exponent(amax, FP8_E4M3), used = e + (int)(rng_u32(&rng) % 7);   // kept with H = 3
        cr_assert(fp8_guess_kept(used, e, 3));
        float scaled = ldexpf(x, -used), current = round_to_e4m3(ldexpf(x, -e)) * ldexpf(1.0f, e);
        cr_assert(ldexpf(amax, -used) <= 448.0f, "amax %g saturates at e%+d", amax, used - e);
        if (fabsf(scaled) >= ldexpf(1.0f, -6))
            cr_assert_eq(round_to_e4m3(scaled) * ldexpf(1.0f, used), current, "x %g amax %g: e%+d rounds differently",
                         x, amax, used - e);
        else
            small++;
    }
    cr_expect(small > 1000 && small < 50000, "%d of 100000 values below the normal range: the test must see both",
              small);
}

Test(fp8, fake_quantize) {
    // amax 1: scale 2^-8 for e4m3; 1 stays exact, 0.3 rounds to 0.3125 (0.3·2^8 = 76.8, spacing 8
    // in [64, 128): 80) and 2^-20 underflows (2^-12 is below half of e4m3's smallest 2^-9).
    // e5m2: scale 2^-15, 0.3·2^15 = 9830.4 -> 10240 (spacing 2048), 2^-20 -> 2^-5 exactly.
    float x[4] = {1.0f, -0.3f, ldexpf(1, -20), 0.0f}, q[4];
    float s = fp8_fake_quantize(q, x, 4, FP8_E4M3);
    cr_expect_eq(s, ldexpf(1, -8));
    cr_expect(q[0] == 1.0f && q[1] == -0.3125f && q[2] == 0.0f && q[3] == 0.0f, "%g %g %g %g", q[0], q[1], q[2], q[3]);
    s = fp8_fake_quantize(q, x, 4, FP8_E5M2);
    cr_expect_eq(s, ldexpf(1, -15));
    cr_expect(q[1] == -0.3125f && q[2] == ldexpf(1, -20), "e5m2: %g %g", q[1], q[2]);
}

Test(fp8, linear_error_is_fp8_sized) {
    const int M = 64, IC = 96, OC = 48;
    Rng rng;
    rng_seed(&rng, 9);
    float *x = malloc(sizeof(float) * M * IC), *w = malloc(sizeof(float) * OC * IC), *dy = malloc(sizeof(float) * M * OC);
    float *y = calloc(M * OC, sizeof(float)), *y8 = calloc(M * OC, sizeof(float));
    float *dx = calloc(M * IC, sizeof(float)), *dx8 = calloc(M * IC, sizeof(float));
    float *dw = calloc(OC * IC, sizeof(float)), *dw8 = calloc(OC * IC, sizeof(float));
    float *db = calloc(OC, sizeof(float)), *db8 = calloc(OC, sizeof(float));
    rng_fill_normal(&rng, x, (size_t)M * IC, 1.0f);
    rng_fill_normal(&rng, w, (size_t)OC * IC, 0.1f);
    rng_fill_normal(&rng, dy, (size_t)M * OC, 1e-3f);
    linear_forward(y, x, w, NULL, M, IC, OC);
    linear_fp8_forward(y8, x, w, NULL, M, IC, OC);
    linear_backward(dx, dw, db, dy, x, w, M, IC, OC);
    // e4m3 keeps 3 mantissa bits (relative rms error ~2.2% per operand), e5m2 2 bits (~4.5%)
    double r = rel_l2(y8, y, (size_t)M * OC);
    cr_expect(r > 0.01 && r < 0.06, "forward rel L2 %g", r);
    for (int f = 0; f < 2; f++) {
        for (int i = 0; i < M * IC; i++) dx8[i] = 0.0f;
        for (int i = 0; i < OC * IC; i++) dw8[i] = 0.0f;
        for (int i = 0; i < OC; i++) db8[i] = 0.0f;
        linear_fp8_backward(dx8, dw8, db8, dy, x, w, M, IC, OC, (Fp8Format)f);
        double lo = f == FP8_E4M3 ? 0.01 : 0.03, hi = f == FP8_E4M3 ? 0.06 : 0.09;
        double rx = rel_l2(dx8, dx, (size_t)M * IC), rw = rel_l2(dw8, dw, (size_t)OC * IC);
        cr_expect(rx > lo && rx < hi, "format %d: dinp rel L2 %g", f, rx);
        cr_expect(rw > lo && rw < hi, "format %d: dweight rel L2 %g", f, rw);
        cr_expect(rel_l2(db8, db, OC) < 1e-6, "format %d: dbias is not quantized", f);
    }
    free(x), free(w), free(dy), free(y), free(y8), free(dx), free(dx8), free(dw), free(dw8), free(db), free(db8);
}
