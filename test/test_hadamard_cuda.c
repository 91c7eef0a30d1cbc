// The Hadamard rotation on the GPU (attention/hadamard_cuda.h) against the CPU's hadamard_rotate,
// and what it buys: sage attention on the GPU with q, k rotated (and dq, dk rotated back) against
// exact attention, on inputs with outlier channels in Q and K. Skips without a GPU.
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attention/attention.h"
#include "attention/hadamard_cuda.h"
#include "attention/sage_cuda.h"
#include "layers/common.h"
#include "test/attention_test.h"

static void fill_normal(float *x, size_t n, uint64_t seed) {
    Rng rng;
    rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) x[i] = rng_normal(&rng);
}

// fp32: bitwise the CPU's result (same butterflies, same order). bf16: the CPU's result on the
// same values, rounded to bf16. Applying the rotation twice gives x back.
static void check_rotation(size_t rows, int D) {
    size_t n = rows * D;
    char err[DIT_ERR_LEN] = "";
    float *x = xmalloc(n * 4), *want = xmalloc(n * 4), *got = xmalloc(n * 4);
    fill_normal(x, n, 10 + rows + D);
    memcpy(want, x, n * 4);
    hadamard_rotate(want, rows, D);
    float *dx = dmalloc(n * 4);
    CUDA_OK(cudaMemcpy(dx, x, n * 4, cudaMemcpyHostToDevice));
    cr_assert_eq(hadamard_rotate_f32_cuda(dx, rows, D, 0, err), 0, "%s", err);
    CUDA_OK(cudaMemcpy(got, dx, n * 4, cudaMemcpyDeviceToHost));
    int fp32_equal = memcmp(got, want, n * 4) == 0;
    cr_expect(fp32_equal, "fp32 rotation differs from the CPU's (rows %zu D %d, rel %g)", rows, D, rel_l2(got, want, n));
    cr_assert_eq(hadamard_rotate_f32_cuda(dx, rows, D, 0, err), 0, "%s", err);
    CUDA_OK(cudaMemcpy(got, dx, n * 4, cudaMemcpyDeviceToHost));
    double back = rel_l2(got, x, n);
    cr_expect(back < 1e-6, "rotating twice: rel L2 %g from x (rows %zu D %d)", back, rows, D);

    uint16_t *bits = xmalloc(n * 2), *dbits = dmalloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        bits[i] = to_bf16(x[i]);
        want[i] = from_bf16(bits[i]);
    }
    hadamard_rotate(want, rows, D);
    CUDA_OK(cudaMemcpy(dbits, bits, n * 2, cudaMemcpyHostToDevice));
    cr_assert_eq(hadamard_rotate_bf16_cuda(dbits, rows, D, 0, err), 0, "%s", err);
    CUDA_OK(cudaMemcpy(bits, dbits, n * 2, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += bits[i] != to_bf16(want[i]);
    cr_expect_eq(bad, 0, "bf16 rotation: %zu of %zu values differ from the CPU's rounded to bf16", bad, n);
    fprintf(stderr, "hadamard rows=%zu D=%d: fp32 bitwise equal %s, twice rel %.1e, bf16 mismatches %zu\n", rows,
            D, fp32_equal ? "yes" : "NO", back, bad);
    free(x); free(want); free(got); free(bits);
    cudaFree(dx); cudaFree(dbits);
}

Test(hadamard_cuda, equals_the_cpu_rotation) {
    SKIP_WITHOUT_GPU();
    check_rotation(1000, 128);
    check_rotation(333, 64);
    check_rotation(17, 32);
}

Test(hadamard_cuda, bad_arguments_are_errors) {
    char err[DIT_ERR_LEN] = "";
    cr_expect_eq(hadamard_rotate_f32_cuda(NULL, 4, 64, 0, err), -1);
    cr_expect(strstr(err, "x must be a device pointer"), "%s", err);
    cr_expect_eq(hadamard_rotate_bf16_cuda((uint16_t *)(uintptr_t)64, 4, 96, 0, err), -1);
    cr_expect(strstr(err, "D=96"), "%s", err);
    cr_expect_eq(hadamard_rotate_f32_cuda((float *)(uintptr_t)68, 4, 64, 0, err), -1);
    cr_expect(strstr(err, "16-byte aligned"), "%s", err);
}

// ---- sage with the rotation, against exact attention ----------------------------------------
// Q and K with outlier channels (channels 3 and 17 ×8, as test_sage_cuda's OUTLIERS) and a
// per-channel offset of K (+20 on every 4th channel, which smoothing removes).
typedef struct { double out, dq, dk, dv; } Cosines;

static void to_device_bf16(uint16_t *dev, float *host, size_t n) {
    uint16_t *bits = xmalloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        bits[i] = to_bf16(host[i]);
        host[i] = from_bf16(bits[i]);
    }
    CUDA_OK(cudaMemcpy(dev, bits, n * 2, cudaMemcpyHostToDevice));
    free(bits);
}

// GPU sage forward + backward of (q, k, v, dout), with rotate: q, k rotated on the GPU first and
// dq, dk rotated back after. Returns host fp32 out, dq, dk, dv (4·n floats).
static float *gpu_sage(const float *q, const float *k, const float *v, const float *dout, int B, int H, int N,
                       int D, SagePV pv, int rotate) {
    size_t n = (size_t)B * H * N * D, rows = (size_t)B * H * N;
    char err[DIT_ERR_LEN] = "";
    float *tmp = xmalloc(n * 4);
    uint16_t *dq_in = dmalloc(n * 2), *dk_in = dmalloc(n * 2), *dv_in = dmalloc(n * 2), *ddout = dmalloc(n * 2);
    const float *src[4] = {q, k, v, dout};
    uint16_t *dst[4] = {dq_in, dk_in, dv_in, ddout};
    for (int t = 0; t < 4; t++) {
        memcpy(tmp, src[t], n * 4);
        to_device_bf16(dst[t], tmp, n);
    }
    if (rotate) {
        cr_assert_eq(hadamard_rotate_bf16_cuda(dq_in, rows, D, 0, err), 0, "%s", err);
        cr_assert_eq(hadamard_rotate_bf16_cuda(dk_in, rows, D, 0, err), 0, "%s", err);
    }
    void *fws = dmalloc(sage_cuda_forward_workspace_size(B, H, N, D, pv));
    void *bws = dmalloc(sage_cuda_backward_workspace_size(B, H, N, D));
    uint16_t *out = dmalloc(n * 2);
    float *lse = dmalloc(rows * 4), *grads = dmalloc(3 * n * 4);
    cr_assert_eq(sage_forward_cuda(out, lse, fws, dq_in, dk_in, dv_in, B, H, N, D, pv, 0, err), 0, "%s", err);
    cr_assert_eq(sage_backward_cuda(grads, grads + n, grads + 2 * n, bws, fws, ddout, dq_in, dk_in, dv_in, out, lse,
                                    NULL, B, H, N, D, pv, 0, err), 0, "%s", err);
    if (rotate) {
        cr_assert_eq(hadamard_rotate_f32_cuda(grads, rows, D, 0, err), 0, "%s", err);
        cr_assert_eq(hadamard_rotate_f32_cuda(grads + n, rows, D, 0, err), 0, "%s", err);
    }
    CUDA_OK(cudaDeviceSynchronize());
    float *h = xmalloc(4 * n * 4);
    uint16_t *bits = xmalloc(n * 2);
    CUDA_OK(cudaMemcpy(bits, out, n * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) h[i] = from_bf16(bits[i]);
    CUDA_OK(cudaMemcpy(h + n, grads, 3 * n * 4, cudaMemcpyDeviceToHost));
    free(tmp); free(bits);
    cudaFree(dq_in); cudaFree(dk_in); cudaFree(dv_in); cudaFree(ddout);
    cudaFree(fws); cudaFree(bws); cudaFree(out); cudaFree(lse); cudaFree(grads);
    return h;
}

static Cosines sage_vs_exact(int N, int D, SagePV pv, int rotate, uint64_t seed) {
    const int B = 1, H = 2;
    size_t n = (size_t)B * H * N * D, rows = (size_t)B * H * N;
    float *q = xmalloc(n * 4), *k = xmalloc(n * 4), *v = xmalloc(n * 4), *dout = xmalloc(n * 4);
    fill_normal(q, n, seed);
    fill_normal(k, n, seed + 1);
    fill_normal(v, n, seed + 2);
    fill_normal(dout, n, seed + 3);
    for (size_t i = 0; i < n; i++) {
        int d = (int)(i % D);
        if (d == 3 || d == 17) { q[i] *= 8.0f; k[i] *= 8.0f; }
        if (d % 4 == 0) k[i] += 20.0f;
        q[i] = from_bf16(to_bf16(q[i])); k[i] = from_bf16(to_bf16(k[i]));
        v[i] = from_bf16(to_bf16(v[i])); dout[i] = from_bf16(to_bf16(dout[i]));
    }
    float *got = gpu_sage(q, k, v, dout, B, H, N, D, pv, rotate);
    float *out = xmalloc(n * 4), *lse = xmalloc(rows * 4), *grads = xmalloc(3 * n * 4);
    attention_forward(out, lse, q, k, v, B, H, N, D);
    attention_backward(grads, grads + n, grads + 2 * n, dout, q, k, v, out, lse, B, H, N, D);
    Cosines c = {cosine(got, out, n), cosine(got + n, grads, n), cosine(got + 2 * n, grads + n, n),
                 cosine(got + 3 * n, grads + 2 * n, n)};
    fprintf(stderr, "sage %s N=%d D=%d outliers, %s: cosine vs exact out %.6f dq %.6f dk %.6f dv %.6f\n",
            pv == SAGE_PV_FP8 ? "fp8 " : "fp16", N, D, rotate ? "rotated  " : "unrotated", c.out, c.dq, c.dk, c.dv);
    free(q); free(k); free(v); free(dout); free(got); free(out); free(lse); free(grads);
    return c;
}

// FP16 P·V with the rotation meets the targets on outlier inputs (out >= 0.9995, every
// gradient >= 0.999; the CPU definition measured >= 0.9996, dev/sage_outlier_accuracy.c); the
// unrotated kernel does not (dq/dk 0.98-0.998 on the GPU). FP8: the rotation must not be worse.
Test(hadamard_cuda, rotation_makes_sage_accurate_with_outlier_channels, .timeout = 120) {
    SKIP_WITHOUT_GPU();
    const int dims[2] = {64, 128};
    for (int i = 0; i < 2; i++) {
        int D = dims[i];
        Cosines plain16 = sage_vs_exact(512, D, SAGE_PV_FP16, 0, 70 + D);
        Cosines rot16 = sage_vs_exact(512, D, SAGE_PV_FP16, 1, 70 + D);
        Cosines plain8 = sage_vs_exact(512, D, SAGE_PV_FP8, 0, 70 + D);
        Cosines rot8 = sage_vs_exact(512, D, SAGE_PV_FP8, 1, 70 + D);
        cr_expect(rot16.out >= 0.9995, "D=%d fp16 rotated out cosine %f < 0.9995", D, rot16.out);
        cr_expect(rot16.dq >= 0.999 && rot16.dk >= 0.999 && rot16.dv >= 0.999,
                  "D=%d fp16 rotated gradient cosines %f %f %f < 0.999", D, rot16.dq, rot16.dk, rot16.dv);
        cr_expect(rot16.dq > plain16.dq && rot16.dk > plain16.dk, "D=%d fp16: rotation did not help dq/dk", D);
        cr_expect(rot8.dq >= plain8.dq - 1e-4 && rot8.dk >= plain8.dk - 1e-4 && rot8.out >= plain8.out - 1e-4,
                  "D=%d fp8: rotation made it worse", D);
    }
}
