#include "layers/common.h"
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

void dit_set_error(char *err, const char *fmt, ...) {
    if (!err) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, DIT_ERR_LEN, fmt, ap);
    va_end(ap);
}

void rng_seed(Rng *rng, uint64_t seed) {
    // splitmix64 of the seed, so that nearby seeds give unrelated streams; never zero
    uint64_t z = seed + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    rng->state = z ? z : 0x2545F4914F6CDD1Dull;
}

uint32_t rng_u32(Rng *rng) {
    uint64_t x = rng->state;
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    rng->state = x;
    return (uint32_t)((x * 0x2545F4914F6CDD1Dull) >> 32);
}

float rng_uniform(Rng *rng) { return (rng_u32(rng) >> 8) / 16777216.0f; }

float rng_normal(Rng *rng) {
    // Box-Muller; u1 in (0, 1] so the log is finite
    float u1 = 1.0f - rng_uniform(rng);
    float u2 = rng_uniform(rng);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

void rng_fill_normal(Rng *rng, float *x, size_t n, float std) {
    for (size_t i = 0; i < n; i++) x[i] = std * rng_normal(rng);
}

void rng_fill_uniform(Rng *rng, float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = lo + (hi - lo) * rng_uniform(rng);
}
