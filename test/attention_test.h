// Helpers shared by the attention kernels' GPU tests (test_sage_cuda.c, test_flash_cuda.c).
#pragma once
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "layers/common.h"
#include "test/compare.h"

#define SKIP_WITHOUT_GPU()                                                          \
    do {                                                                            \
        int n_ = 0;                                                                 \
        if (cudaGetDeviceCount(&n_) != cudaSuccess || n_ == 0) {                    \
            cudaGetLastError();                                                     \
            cr_skip_test("no CUDA GPU");                                            \
        }                                                                           \
    } while (0)

#define CUDA_OK(call) cr_assert_eq((call), cudaSuccess, "%s failed: %s", #call, cudaGetErrorString(cudaGetLastError()))

static uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void *xmalloc(size_t n) {
    void *p = calloc(n, 1);
    cr_assert(p, "out of host memory (%zu bytes)", n);
    return p;
}
static void *dmalloc(size_t n) {
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, n));
    CUDA_OK(cudaMemset(p, 0xff, n));   // poison: NaN for fp32 and bf16
    return p;
}

// n bf16 values on the device to floats in host memory dst.
static inline void bf16_to_host_floats(float *dst, const uint16_t *dev, size_t n) {
    uint16_t *bits = xmalloc(n * 2);
    CUDA_OK(cudaMemcpy(bits, dev, n * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) dst[i] = from_bf16(bits[i]);
    free(bits);
}

// n random bf16 values N(0, gain²) (never zero: 0.5 instead), as floats in *host (allocated) and
// on the device (returned).
static inline uint16_t *random_bf16(Rng *rng, size_t n, float gain, float **host) {
    uint16_t *bits = xmalloc(n * 2), *dev = dmalloc(n * 2);
    *host = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        float x = rng_normal(rng) * gain;
        bits[i] = to_bf16(x == 0.0f ? 0.5f : x);
        (*host)[i] = from_bf16(bits[i]);
    }
    CUDA_OK(cudaMemcpy(dev, bits, n * 2, cudaMemcpyHostToDevice));
    free(bits);
    return dev;
}

static inline void compare(double *rel, double *cos, const float *x, const float *ref, size_t n) {
    *rel = rel_l2(x, ref, n);
    *cos = cosine(x, ref, n);
}
