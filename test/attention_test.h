// Helpers shared by the attention kernels' GPU tests (test_sage_cuda.c, test_flash_cuda.c).
#pragma once
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

static inline void compare(double *rel, double *cos, const float *x, const float *ref, size_t n) {
    *rel = rel_l2(x, ref, n);
    *cos = cosine(x, ref, n);
}
