// Helpers shared by the CUDA layer tests (test_layers_cuda.c, test_linear_fp8_cuda.c, and the
// macros by the GPU model tests): skip without a GPU, check CUDA and layer calls, and host and
// device buffers that the suite's teardown frees (free_buffers) after each test. OK() reads the
// including file's `err` (char[DIT_ERR_LEN]).
#pragma once
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>
#include "layers/common.h"
#include "layers/layers_cuda.h"
#include "test/compare.h"

#define REQUIRE_GPU() do {                                                                     \
        int count_ = 0;                                                                        \
        if (cudaGetDeviceCount(&count_) != cudaSuccess || count_ == 0)                         \
            cr_skip_test("no CUDA GPU found");                                                 \
    } while (0)

// A CUDA runtime call in a test; OK() a layer call (its message is in the test's `err`).
#define CK(call) do {                                                                          \
        cudaError_t e_ = (call);                                                               \
        cr_assert_eq(e_, cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                \
    } while (0)
#define OK(call) cr_assert_eq((call), 0, "%s failed: %s", #call, err)

// rel_l2 ≤ tol, the value logged (--verbose); each argument is evaluated once.
#define EXPECT_CLOSE(out, ref, n, tol, name) do {                                             \
        double r_ = rel_l2(out, ref, n);                                                       \
        cr_log_info("%s: rel L2 %.3g (tolerance %.0e)", name, r_, (double)(tol));              \
        cr_expect(r_ <= (tol), "%s: rel L2 error %.3g > %.0e", name, r_, (double)(tol));       \
    } while (0)

// ---- host and device buffers, freed after each test --------------------------------------
#define MAX_BUFFERS 512
static void *host_buffers[MAX_BUFFERS], *device_buffers[MAX_BUFFERS];
static int n_host, n_device;

static inline void free_buffers(void) {
    for (int i = 0; i < n_host; i++) free(host_buffers[i]);
    for (int i = 0; i < n_device; i++) cudaFree(device_buffers[i]);
    n_host = n_device = 0;
}

static inline void *host_alloc(size_t bytes) {
    cr_assert(n_host < MAX_BUFFERS, "too many host buffers");
    void *p = calloc(1, bytes ? bytes : 1);
    cr_assert(p, "calloc of %zu bytes", bytes);
    return host_buffers[n_host++] = p;
}

static inline void *device_alloc(size_t bytes) {
    cr_assert(n_device < MAX_BUFFERS, "too many device buffers");
    void *p = NULL;
    CK(cudaMalloc(&p, bytes));
    return device_buffers[n_device++] = p;
}

static inline float *host_floats(size_t n) { return host_alloc(n * sizeof(float)); }

static inline float *copy_floats(const float *x, size_t n) {
    float *y = host_floats(n);
    memcpy(y, x, n * sizeof(float));
    return y;
}

static inline bf16 *upload_bf16(const float *x, size_t n) {
    uint16_t *bits = host_alloc(n * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) bits[i] = bf16_bits_from_float(x[i]);
    bf16 *d = device_alloc(n * sizeof(bf16));
    CK(cudaMemcpy(d, bits, n * sizeof(bf16), cudaMemcpyHostToDevice));
    return d;
}

static inline float *upload_f32(const float *x, size_t n) {
    float *d = device_alloc(n * sizeof(float));
    CK(cudaMemcpy(d, x, n * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}

// A device buffer filled with 0xFF bytes: NaN in bf16 and in fp32.
static inline void *poisoned(size_t bytes) {
    void *d = device_alloc(bytes);
    CK(cudaMemset(d, 0xFF, bytes));
    return d;
}

static inline float *download_bf16(const bf16 *d, size_t n) {
    uint16_t *bits = host_alloc(n * sizeof(uint16_t));
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(bits, d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    float *x = host_floats(n);
    for (size_t i = 0; i < n; i++) x[i] = float_from_bf16_bits(bits[i]);
    return x;
}

static inline float *download_f32(const float *d, size_t n) {
    float *x = host_floats(n);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(x, d, n * sizeof(float), cudaMemcpyDeviceToHost));
    return x;
}
