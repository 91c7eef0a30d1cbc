// Small things every part of dit.c shares: error messages and the random number generator.
#pragma once
#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// Library functions that can fail return 0 on success and -1 on failure, and then
// write a message naming the file / field / size and what was expected into `err`
// (a caller-owned buffer of DIT_ERR_LEN bytes; may be NULL). They never exit().
#define DIT_ERR_LEN 512
void dit_set_error(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// Random numbers: xorshift64* for bits, Box-Muller for normals. The whole state is one
// uint64, so a checkpoint can save it and a resumed run continues the same stream.
typedef struct { uint64_t state; } Rng;
void rng_seed(Rng *rng, uint64_t seed);
uint32_t rng_u32(Rng *rng);
float rng_uniform(Rng *rng);                 // [0, 1)
float rng_normal(Rng *rng);                  // N(0, 1)
void rng_fill_normal(Rng *rng, float *x, size_t n, float std);
void rng_fill_uniform(Rng *rng, float *x, size_t n, float lo, float hi);

#ifdef __cplusplus
}
#endif
