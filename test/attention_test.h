// Helpers shared by the attention kernels' GPU tests (test_sage_cuda.c, test_flash_cuda.c).
#pragma once
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attention/attention.h"
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

// Skips unless the device is sm_90 and the build has sm_90a code (for files that include
// attention/sage_cuda.h).
#define SKIP_WITHOUT_SM90()                                                                 \
    do {                                                                                    \
        SKIP_WITHOUT_GPU();                                                                 \
        if (!sage_forward_sm90_available()) cr_skip_test("no sm_90 device or no sm_90a code"); \
    } while (0)

// q, k, v (B, H, N, D) of N(0,1) rounded to bf16, as host floats and device bf16 bits. outliers:
// q and k ×8 on channels 3 and 17, k + 20 on every 4th channel (test_sage_cuda.c's OUTLIERS).
typedef struct {
    int B, H, N, D;
    size_t n, rows;
    float *q, *k, *v;
    uint16_t *q_dev, *k_dev, *v_dev;
} QkvInputs;

static inline QkvInputs make_qkv_inputs(int B, int H, int N, int D, int outliers, uint64_t seed) {
    QkvInputs in = {B, H, N, D, (size_t)B * H * N * D, (size_t)B * H * N, 0, 0, 0, 0, 0, 0};
    Rng rng;
    rng_seed(&rng, seed);
    float **host[3] = {&in.q, &in.k, &in.v};
    uint16_t **dev[3] = {&in.q_dev, &in.k_dev, &in.v_dev};
    uint16_t *bits = xmalloc(in.n * 2);
    for (int t = 0; t < 3; t++) {
        *host[t] = xmalloc(in.n * sizeof(float));
        for (size_t i = 0; i < in.n; i++) {
            int d = (int)(i % D);
            float x = rng_normal(&rng);
            if (outliers && t < 2 && (d == 3 || d == 17)) x *= 8.0f;
            if (outliers && t == 1 && d % 4 == 0) x += 20.0f;
            bits[i] = to_bf16(x);
            (*host[t])[i] = from_bf16(bits[i]);
        }
        *dev[t] = dmalloc(in.n * 2);
        CUDA_OK(cudaMemcpy(*dev[t], bits, in.n * 2, cudaMemcpyHostToDevice));
    }
    free(bits);
    return in;
}
static inline void free_qkv_inputs(QkvInputs *in) {
    free(in->q); free(in->k); free(in->v);
    cudaFree(in->q_dev); cudaFree(in->k_dev); cudaFree(in->v_dev);
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

// ---- the merged layout of out and dout (*_merged_cuda): (B, N, H, D) instead of (B, H, N, D) ----
// Element (b, h, t, d) sits at ((b·H + h)·N + t)·D + d head-major and at ((b·N + t)·H + h)·D + d
// merged.

// (B, H, N, D) of the merged-layout tests of sage and flash: N with tails (130, 1000, 77) and
// without (256: every tile full, the kernels' unmasked paths).
#define MERGED_LAYOUT_SHAPES 6
static const int merged_layout_shapes[MERGED_LAYOUT_SHAPES][4] = {
    {2, 3, 130, 64}, {2, 3, 130, 128}, {1, 4, 1000, 128}, {3, 2, 77, 64}, {2, 2, 256, 64}, {2, 2, 256, 128}};

// A new device copy of the head-major bf16 `head_major` (device) in the merged layout.
static inline uint16_t *merged_copy(const uint16_t *head_major, int B, int H, int N, int D) {
    size_t n = (size_t)B * H * N * D;
    uint16_t *from = xmalloc(n * 2), *to = xmalloc(n * 2), *dev = dmalloc(n * 2);
    CUDA_OK(cudaMemcpy(from, head_major, n * 2, cudaMemcpyDeviceToHost));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < N; t++)
                memcpy(to + (((size_t)b * N + t) * H + h) * D, from + (((size_t)b * H + h) * N + t) * D, D * 2);
    CUDA_OK(cudaMemcpy(dev, to, n * 2, cudaMemcpyHostToDevice));
    free(from);
    free(to);
    return dev;
}

// Bitwise comparisons of a merged-layout call's outputs with the head-major call's: each returns
// the number of elements that differ in any bit or are NaN (the poison left where neither call
// wrote), and fails the test at the first one with its coordinates and both values.

// out: the bf16 `merged` (device, (B, N, H, D)) against `head_major` (device, (B, H, N, D)).
static inline size_t count_merged_bf16_differences(const uint16_t *merged, const uint16_t *head_major, int B, int H,
                                                   int N, int D, const char *what) {
    size_t n = (size_t)B * H * N * D, differing = 0;
    uint16_t *got = xmalloc(n * 2), *want = xmalloc(n * 2);
    CUDA_OK(cudaMemcpy(got, merged, n * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(want, head_major, n * 2, cudaMemcpyDeviceToHost));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < N; t++)
                for (int d = 0; d < D; d++) {
                    size_t im = (((size_t)b * N + t) * H + h) * D + d, ih = (((size_t)b * H + h) * N + t) * D + d;
                    if (got[im] == want[ih] && !isnan(from_bf16(want[ih]))) continue;
                    if (differing++ == 0)
                        cr_expect_fail("%s: merged[%zu] (b=%d h=%d t=%d d=%d) = %g (0x%04x), head-major[%zu] = "
                                       "%g (0x%04x)", what, im, b, h, t, d, from_bf16(got[im]), got[im], ih,
                                       from_bf16(want[ih]), want[ih]);
                }
    free(got);
    free(want);
    return differing;
}

// The merged backwards' dk or dv: bf16 rows of the token-major `rows` (device; row b·N + t, columns
// [offset + h·D, + D) of head h, `stride` bf16 per row) against the head-major fp32 `want` (device),
// first multiplied by the Hadamard matrix (hadamard_rotate) when `rotate`, rounded to bf16. Counts
// the values that differ (or are NaN) and raises *most to max |those bf16|.
static inline size_t count_rows_differences(const uint16_t *rows, size_t stride, size_t offset, const float *want,
                                            int rotate, float *most, int B, int H, int N, int D, const char *what) {
    size_t n = (size_t)B * H * N * D, nrows = (size_t)B * N * stride, differing = 0;
    uint16_t *got = xmalloc(nrows * 2);
    float *w = xmalloc(n * 4);
    CUDA_OK(cudaMemcpy(got, rows, nrows * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(w, want, n * 4, cudaMemcpyDeviceToHost));
    if (rotate) hadamard_rotate(w, n / D, D);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < N; t++)
                for (int d = 0; d < D; d++) {
                    uint16_t g = got[((size_t)b * N + t) * stride + offset + (size_t)h * D + d];
                    uint16_t x = to_bf16(w[(((size_t)b * H + h) * N + t) * D + d]);
                    *most = fmaxf(*most, fabsf(from_bf16(x)));
                    if (g == x && !isnan(from_bf16(x))) continue;
                    if (differing++ == 0)
                        cr_expect_fail("%s: row %zu col %zu (b=%d h=%d t=%d d=%d) = %g (0x%04x), bf16 of the head-major "
                                       "value%s %g (0x%04x)", what, (size_t)b * N + t, offset + (size_t)h * D + d, b,
                                       h, t, d, from_bf16(g), g, rotate ? " rotated" : "", from_bf16(x), x);
                }
    free(got);
    free(w);
    return differing;
}

// The poison (0xffff) of the token-major `rows` outside columns [first, end) of every row: the count
// overwritten.
static inline size_t count_poison_overwritten(const uint16_t *rows, size_t nrows, size_t stride, size_t first,
                                              size_t end) {
    uint16_t *got = xmalloc(nrows * stride * 2);
    size_t overwritten = 0;
    CUDA_OK(cudaMemcpy(got, rows, nrows * stride * 2, cudaMemcpyDeviceToHost));
    for (size_t r = 0; r < nrows; r++)
        for (size_t col = 0; col < stride; col++)
            overwritten += (col < first || col >= end) && got[r * stride + col] != 0xffff;
    free(got);
    return overwritten;
}

// lse, dq, dk, dv: fp32 `got` and `want` (device) in the same layout (B, H, N, D); D = 1 for lse.
static inline size_t count_f32_differences(const float *got, const float *want, int B, int H, int N, int D,
                                           const char *what) {
    size_t n = (size_t)B * H * N * D, differing = 0;
    uint32_t *g = xmalloc(n * 4), *w = xmalloc(n * 4);
    CUDA_OK(cudaMemcpy(g, got, n * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(w, want, n * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) {
        float gf, wf;
        memcpy(&gf, &g[i], 4);
        memcpy(&wf, &w[i], 4);
        if (g[i] == w[i] && !isnan(wf)) continue;
        if (differing++ == 0)
            cr_expect_fail("%s: [%zu] (b=%d h=%d t=%d d=%d) merged call %.9g (0x%08x), head-major call %.9g "
                           "(0x%08x)", what, i, (int)(i / D / N / H), (int)(i / D / N % H), (int)(i / D % N),
                           (int)(i % D), gf, g[i], wf, w[i]);
    }
    free(g);
    free(w);
    return differing;
}

// Every output of a merged-layout call pair (sage or flash) against the head-major pair's, each as
// above: out (merged bf16), lse, dq (dq_m: the merged backward's; grads_h: the head-major one's dq,
// dk, dv, n values each), and dk and dv, written as bf16 rows of kv_rows (row stride; dK at column
// offset k_offset, rotated when rotate_dk, dV at k_offset + H·D; the other columns poison) with
// their amax. Logs the counts on stderr.
static inline void expect_merged_like_head_major(const uint16_t *out_m, const uint16_t *out_h, const float *lse_m,
                                                 const float *lse_h, const float *dq_m, const float *grads_h,
                                                 size_t n, const uint16_t *kv_rows, size_t stride, size_t k_offset,
                                                 int rotate_dk, const float *d_amax, int B, int H, int N, int D,
                                                 const char *what) {
    char name[200];
    size_t differing[5], hd = (size_t)H * D;
    float amax = 0.0f, want_amax = 0.0f;
    snprintf(name, sizeof name, "%s: out", what);
    differing[0] = count_merged_bf16_differences(out_m, out_h, B, H, N, D, name);
    snprintf(name, sizeof name, "%s: lse", what);
    differing[1] = count_f32_differences(lse_m, lse_h, B, H, N, 1, name);
    snprintf(name, sizeof name, "%s: dq", what);
    differing[2] = count_f32_differences(dq_m, grads_h, B, H, N, D, name);
    for (int t = 0; t < 2; t++) {
        snprintf(name, sizeof name, "%s: d%c rows", what, "kv"[t]);
        differing[3 + t] = count_rows_differences(kv_rows, stride, k_offset + t * hd, grads_h + (1 + t) * n,
                                                  t == 0 && rotate_dk, &want_amax, B, H, N, D, name);
    }
    size_t overwritten = count_poison_overwritten(kv_rows, (size_t)B * N, stride, k_offset, k_offset + 2 * hd);
    cr_expect(overwritten == 0, "%s: %zu poison values outside dk's and dv's columns overwritten", what, overwritten);
    CUDA_OK(cudaMemcpy(&amax, d_amax, 4, cudaMemcpyDeviceToHost));
    cr_expect(amax == want_amax, "%s: dk, dv amax %.9g, the values' max %.9g", what, amax, want_amax);
    fprintf(stderr, "%s vs head-major: differing out %zu, lse %zu, dq %zu, dk %zu, dv %zu; poison overwritten %zu, "
            "amax %s\n", what, differing[0], differing[1], differing[2], differing[3], differing[4], overwritten,
            amax == want_amax ? "equal" : "DIFFERS");
}
