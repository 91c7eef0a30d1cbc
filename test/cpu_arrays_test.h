// Host arrays for the CPU attention tests (test_attention_cpu.c, test_sequence_parallel.c):
// N(0, std²) or zero floats, failing the test when memory runs out.
#pragma once
#include <criterion/criterion.h>
#include <stdlib.h>
#include "layers/common.h"

static inline float *normal_floats(Rng *rng, size_t n, float std) {
    float *x = malloc(n * sizeof(float));
    cr_assert(x != NULL, "malloc of %zu floats", n);
    rng_fill_normal(rng, x, n, std);
    return x;
}

static inline float *zero_floats(size_t n) {
    float *x = calloc(n, sizeof(float));
    cr_assert(x != NULL, "calloc of %zu floats", n);
    return x;
}
