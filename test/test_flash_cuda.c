// BF16 flash attention on the GPU (attention/flash_cuda.h) against the CPU exact attention
// (attention_forward / attention_backward of attention/attention_cpu.c, fp32).
// Every test skips when no CUDA GPU is present. Inputs are random bf16 values (never zeros); the
// CPU gets the same values as floats. Device outputs are poisoned (NaN) before each call.
// Errors are ‖x - ref‖/‖ref‖ (rel L2) and cosine; lse is compared by max abs difference.
// Tolerances (bf16: 8 significant bits, unit roundoff 2^-9 ≈ 2e-3):
//   out:  rel L2 < 1e-2, cosine >= 0.99995 (out is stored in bf16 and P is rounded to bf16 for
//         the P·V product: each costs ~2^-9 relative per element)
//   lse:  max abs diff < 1e-3 (fp32 dot products of the same bf16 inputs)
//   dq, dk, dv: rel L2 < 2e-2, cosine >= 0.9998 (P, dS rounded to bf16; delta from the bf16 out)
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attention/attention.h"
#include "attention/flash_cuda.h"
#include "layers/common.h"
#include "test/attention_test.h"

#define OUT_REL_TOL 1e-2
#define OUT_MIN_COS 0.99995
#define LSE_TOL 1e-3
#define GRAD_REL_TOL 2e-2
#define GRAD_MIN_COS 0.9998

// One case: q, k, v, dout as host floats (bf16 values) and device bf16 copies.
// q is scaled by q_gain: 1 gives softmax logits of std ~1, 4 a peaked softmax.
typedef struct {
    int B, H, N, D;
    size_t n;
    float *host[4];        // q, k, v, dout
    uint16_t *dev[4];
} Case;

static Case make_case(int B, int H, int N, int D, float q_gain, uint64_t seed) {
    Case c = {B, H, N, D, (size_t)B * H * N * D, {0}, {0}};
    Rng rng;
    rng_seed(&rng, seed);
    for (int t = 0; t < 4; t++) c.dev[t] = random_bf16(&rng, c.n, t == 0 ? q_gain : 1.0f, &c.host[t]);
    return c;
}
static void free_case(Case *c) {
    for (int t = 0; t < 4; t++) { free(c->host[t]); cudaFree(c->dev[t]); }
}

// A backward with flash_backward_cuda's arguments: the default or the Hopper one.
typedef int (*FlashBackward)(float *dq, float *dk, float *dv, void *workspace, const uint16_t *dout,
                             const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                             const float *lse, int B, int H, int N, int D, cudaStream_t stream, char *err);

// Forward, then `backward`, on the GPU and on the CPU; checks out, lse, dq, dk, dv.
static void check_case_with(FlashBackward backward, const char *backward_name, int B, int H, int N, int D,
                            float q_gain, uint64_t seed) {
    Case c = make_case(B, H, N, D, q_gain, seed);
    size_t rows = (size_t)B * H * N;
    char err[DIT_ERR_LEN] = "";

    uint16_t *out_dev = dmalloc(c.n * 2);
    float *lse_dev = dmalloc(rows * 4);
    int rc = flash_forward_cuda(out_dev, lse_dev, c.dev[0], c.dev[1], c.dev[2], B, H, N, D, 0, err);
    cr_assert_eq(rc, 0, "flash_forward_cuda: %s", err);
    float *grads_dev = dmalloc(3 * c.n * sizeof(float));
    void *ws = dmalloc(flash_cuda_backward_workspace_size(B, H, N, D));
    rc = backward(grads_dev, grads_dev + c.n, grads_dev + 2 * c.n, ws, c.dev[3], c.dev[0], c.dev[1], c.dev[2],
                  out_dev, lse_dev, B, H, N, D, 0, err);
    cr_assert_eq(rc, 0, "%s: %s", backward_name, err);
    CUDA_OK(cudaDeviceSynchronize());

    float *out = xmalloc(c.n * 4), *lse = xmalloc(rows * 4), *grads = xmalloc(3 * c.n * 4);
    bf16_to_host_floats(out, out_dev, c.n);
    CUDA_OK(cudaMemcpy(lse, lse_dev, rows * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(grads, grads_dev, 3 * c.n * 4, cudaMemcpyDeviceToHost));

    float *ref_out = xmalloc(c.n * 4), *ref_lse = xmalloc(rows * 4), *ref_grads = xmalloc(3 * c.n * 4);
    attention_forward(ref_out, ref_lse, c.host[0], c.host[1], c.host[2], B, H, N, D);
    attention_backward(ref_grads, ref_grads + c.n, ref_grads + 2 * c.n, c.host[3], c.host[0], c.host[1],
                       c.host[2], ref_out, ref_lse, B, H, N, D);

    double rel, cosv, lse_err = 0;
    compare(&rel, &cosv, out, ref_out, c.n);
    for (size_t i = 0; i < rows; i++) {
        double d = fabs((double)lse[i] - ref_lse[i]);
        lse_err = isnan(d) ? INFINITY : fmax(lse_err, d);
    }
    printf("flash (%s forward, %s) B%d H%d N%d D%d q_gain %g: out rel L2 %.3e cos %.7f, lse max diff %.2e",
           !getenv("DIT_FLASH_MMA_SYNC") && flash_forward_sm90_available() ? "sm90" : "mma.sync", backward_name, B, H,
           N, D, q_gain, rel, cosv, lse_err);
    cr_expect(rel < OUT_REL_TOL, "out rel L2 %g >= %g", rel, OUT_REL_TOL);
    cr_expect(cosv >= OUT_MIN_COS, "out cosine %f < %g", cosv, OUT_MIN_COS);
    cr_expect(lse_err < LSE_TOL, "lse max abs diff %g >= %g", lse_err, LSE_TOL);
    const char *names[3] = {"dq", "dk", "dv"};
    for (int t = 0; t < 3; t++) {
        compare(&rel, &cosv, grads + t * c.n, ref_grads + t * c.n, c.n);
        printf(" | %s rel L2 %.3e cos %.7f", names[t], rel, cosv);
        cr_expect(rel < GRAD_REL_TOL, "%s rel L2 %g >= %g", names[t], rel, GRAD_REL_TOL);
        cr_expect(cosv >= GRAD_MIN_COS, "%s cosine %f < %g", names[t], cosv, GRAD_MIN_COS);
    }
    printf("\n");
    fflush(stdout);

    free(out); free(lse); free(grads); free(ref_out); free(ref_lse); free(ref_grads);
    cudaFree(out_dev); cudaFree(lse_dev); cudaFree(grads_dev); cudaFree(ws);
    free_case(&c);
}

static void check_case(int B, int H, int N, int D, float q_gain, uint64_t seed) {
    check_case_with(flash_backward_cuda, "flash_backward_cuda", B, H, N, D, q_gain, seed);
}

// Whole tiles (forward 128 queries × 64 keys, backward 128 keys × 64 queries), B·H > 1.
Test(flash_cuda, whole_tiles) {
    SKIP_WITHOUT_GPU();
    check_case(1, 2, 256, 64, 1.0f, 1);
    check_case(2, 2, 256, 128, 1.0f, 2);
}

// Tails: N not a multiple of any tile, N smaller than one tile, N = 3.
Test(flash_cuda, tails, .timeout = 120) {
    SKIP_WITHOUT_GPU();
    check_case(2, 1, 333, 128, 1.0f, 3);
    check_case(1, 3, 77, 64, 1.0f, 4);
    check_case(1, 2, 200, 64, 1.0f, 5);
    check_case(3, 1, 3, 128, 1.0f, 6);
    check_case(1, 1, 1000, 128, 1.0f, 7);
}

// A peaked softmax (q ×4: logits of std ~4) exercises the running max and the rescaling.
Test(flash_cuda, peaked_softmax, .timeout = 120) {
    SKIP_WITHOUT_GPU();
    check_case(1, 2, 520, 64, 4.0f, 8);
    check_case(1, 1, 700, 128, 4.0f, 9);
}

// Longer sequences: many key blocks in the forward, many query blocks in the backward.
Test(flash_cuda, long_sequence, .timeout = 300) {
    SKIP_WITHOUT_GPU();
    check_case(1, 1, 2048, 128, 1.0f, 10);
    check_case(1, 1, 2100, 64, 1.0f, 11);
}

// On Hopper flash_forward_cuda and flash_backward_cuda run the wgmma kernels (flash_*_sm90.cu);
// the mma.sync kernels, which other GPUs run, must pass the same checks there too.
Test(flash_cuda, mma_sync_kernels_too, .timeout = 120) {
    SKIP_WITHOUT_GPU();
    setenv("DIT_FLASH_MMA_SYNC", "1", 1);
    check_case(2, 1, 333, 128, 1.0f, 3);
    check_case(1, 3, 77, 64, 1.0f, 4);
    check_case(1, 2, 520, 64, 4.0f, 8);
}

// ---- the Hopper backward (flash_backward_sm90.cu), called directly -------------------------------
#define SKIP_WITHOUT_SM90_BACKWARD()                                                        \
    do {                                                                                    \
        SKIP_WITHOUT_GPU();                                                                 \
        if (!flash_backward_sm90_available()) cr_skip_test("no sm_90 device or no sm_90a code"); \
    } while (0)

static void check_case_sm90(int B, int H, int N, int D, float q_gain, uint64_t seed) {
    check_case_with(flash_backward_sm90_cuda, "flash_backward_sm90_cuda", B, H, N, D, q_gain, seed);
}

// The cases above (whole tiles, tails, peaked softmax, long sequences) on the Hopper backward.
Test(flash_cuda, sm90_backward, .timeout = 300) {
    SKIP_WITHOUT_SM90_BACKWARD();
    check_case_sm90(1, 2, 256, 64, 1.0f, 1);
    check_case_sm90(2, 2, 256, 128, 1.0f, 2);
    check_case_sm90(2, 1, 333, 128, 1.0f, 3);
    check_case_sm90(1, 3, 77, 64, 1.0f, 4);
    check_case_sm90(1, 2, 200, 64, 1.0f, 5);
    check_case_sm90(3, 1, 3, 128, 1.0f, 6);
    check_case_sm90(1, 1, 1000, 128, 1.0f, 7);
    check_case_sm90(1, 2, 520, 64, 4.0f, 8);
    check_case_sm90(1, 1, 700, 128, 4.0f, 9);
    check_case_sm90(1, 1, 2048, 128, 1.0f, 10);
    check_case_sm90(1, 1, 2100, 64, 1.0f, 11);
}

// Deterministic mode (flash_backward_set_deterministic(1)), at B = 2, H = 4, N = 2048 (16 key
// blocks per head add into each dq tile: unordered, dq's last bits change from run to run): RUNS
// Hopper backwards on one forward, outputs poisoned before each, must give bitwise the same dq, dk,
// dv; the first is compared with the mma.sync backward's (ordered too, validated against the CPU)
// with the gradient tolerances. Then the CPU-reference cases with tails, in deterministic mode.
#define RUNS 3
static void check_deterministic_sm90(int B, int H, int N, int D, uint64_t seed) {
    Rng rng;
    rng_seed(&rng, seed);
    size_t n = (size_t)B * H * N * D, rows = (size_t)B * H * N;
    float *host[4];
    uint16_t *dev[4];
    for (int t = 0; t < 4; t++) dev[t] = random_bf16(&rng, n, 1.0f, &host[t]);
    char err[DIT_ERR_LEN] = "";
    uint16_t *out_dev = dmalloc(n * 2);
    float *lse_dev = dmalloc(rows * 4), *grads_dev = dmalloc(3 * n * 4);
    void *ws = dmalloc(flash_cuda_backward_workspace_size(B, H, N, D));
    int rc = flash_forward_cuda(out_dev, lse_dev, dev[0], dev[1], dev[2], B, H, N, D, 0, err);
    cr_assert_eq(rc, 0, "flash_forward_cuda: %s", err);

    float *grads[RUNS + 1];   // RUNS Hopper backwards, then the mma.sync one
    for (int r = 0; r <= RUNS; r++) {
        FlashBackward backward = r < RUNS ? flash_backward_sm90_cuda : flash_backward_cuda;
        if (r == RUNS) setenv("DIT_FLASH_MMA_SYNC", "1", 1);   // the reference: the mma.sync kernel
        CUDA_OK(cudaMemset(grads_dev, 0xff, 3 * n * 4));
        rc = backward(grads_dev, grads_dev + n, grads_dev + 2 * n, ws, dev[3], dev[0], dev[1], dev[2], out_dev, lse_dev,
                      B, H, N, D, 0, err);
        cr_assert_eq(rc, 0, "%s: %s", r < RUNS ? "flash_backward_sm90_cuda" : "flash_backward_cuda", err);
        if (r == RUNS) unsetenv("DIT_FLASH_MMA_SYNC");
        CUDA_OK(cudaDeviceSynchronize());
        grads[r] = xmalloc(3 * n * 4);
        CUDA_OK(cudaMemcpy(grads[r], grads_dev, 3 * n * 4, cudaMemcpyDeviceToHost));
    }
    const char *names[3] = {"dq", "dk", "dv"};
    printf("flash sm90 backward, deterministic, B%d H%d N%d D%d:", B, H, N, D);
    for (int t = 0; t < 3; t++) {
        int differing = 0;
        for (int r = 1; r < RUNS; r++) differing += memcmp(grads[r] + t * n, grads[0] + t * n, n * 4) != 0;
        double rel, cosv;
        compare(&rel, &cosv, grads[0] + t * n, grads[RUNS] + t * n, n);
        printf(" | %s: %d of %d reruns differ, vs mma.sync rel L2 %.3e cos %.7f", names[t], differing, RUNS - 1, rel,
               cosv);
        cr_expect_eq(differing, 0, "%s differs from the first run in %d of %d reruns", names[t], differing, RUNS - 1);
        cr_expect(rel < GRAD_REL_TOL, "%s rel L2 vs mma.sync %g >= %g", names[t], rel, GRAD_REL_TOL);
        cr_expect(cosv >= GRAD_MIN_COS, "%s cosine vs mma.sync %f < %g", names[t], cosv, GRAD_MIN_COS);
    }
    printf("\n");
    fflush(stdout);
    for (int r = 0; r <= RUNS; r++) free(grads[r]);
    for (int t = 0; t < 4; t++) { free(host[t]); cudaFree(dev[t]); }
    cudaFree(out_dev); cudaFree(lse_dev); cudaFree(grads_dev); cudaFree(ws);
}

Test(flash_cuda, sm90_backward_deterministic, .timeout = 300) {
    SKIP_WITHOUT_SM90_BACKWARD();
    int before = flash_backward_set_deterministic(1);
    check_deterministic_sm90(2, 4, 2048, 128, 12);
    check_deterministic_sm90(2, 4, 2048, 64, 13);
    check_case_sm90(2, 1, 333, 128, 1.0f, 3);
    check_case_sm90(1, 3, 77, 64, 1.0f, 4);
    flash_backward_set_deterministic(before);
}

// ---- the merged layout (flash_forward_merged_cuda, flash_backward_merged_cuda) -------------------
// out and dout in (B, N, H, D), the layout of the projection around attention: the merged calls
// must give bitwise the head-major calls' values (out transposed; lse, dq, dk as they are, dq in
// deterministic mode; dv rounded to bf16 as (B, N, H·D) rows, the tight stride, with its amax),
// each call with its own workspace and NaN-poisoned outputs (dmalloc).
// B, H > 1 and N not a multiple of 64, so a batch/head swap, a token stride of D instead of H·D or
// a missed tail lands on other values or on the poison.
static void check_merged_layout(int B, int H, int N, int D, int rotate_dk, const char *dispatch, uint64_t seed) {
    Case c = make_case(B, H, N, D, 1.0f, seed);
    size_t rows = (size_t)B * H * N;
    char err[DIT_ERR_LEN] = "", what[160];
    snprintf(what, sizeof what, "flash merged layout B%d H%d N%d D%d%s (%s)", B, H, N, D,
             rotate_dk ? " hadamard_dk" : "", dispatch);
    size_t ws_bytes = flash_cuda_backward_workspace_size(B, H, N, D);
    void *ws_h = dmalloc(ws_bytes), *ws_m = dmalloc(ws_bytes);
    uint16_t *out_h = dmalloc(c.n * 2), *out_m = dmalloc(c.n * 2), *dout_m = merged_copy(c.dev[3], B, H, N, D);
    float *lse_h = dmalloc(rows * 4), *lse_m = dmalloc(rows * 4);
    float *grads_h = dmalloc(3 * c.n * 4), *dq_m = dmalloc(c.n * 4);   // dq, dk, dv; dq
    size_t stride = 2 * (size_t)H * D;
    uint16_t *kv_rows = dmalloc(2 * c.n * 2);
    float *kv_amax = dmalloc(4);
    CUDA_OK(cudaMemset(kv_amax, 0, 4));

    int rc = flash_forward_cuda(out_h, lse_h, c.dev[0], c.dev[1], c.dev[2], B, H, N, D, 0, err);
    cr_assert_eq(rc, 0, "flash_forward_cuda: %s", err);
    rc = flash_forward_merged_cuda(out_m, lse_m, c.dev[0], c.dev[1], c.dev[2], B, H, N, D, 0, err);
    cr_assert_eq(rc, 0, "flash_forward_merged_cuda: %s", err);
    rc = flash_backward_cuda(grads_h, grads_h + c.n, grads_h + 2 * c.n, ws_h, c.dev[3], c.dev[0], c.dev[1], c.dev[2],
                             out_h, lse_h, B, H, N, D, 0, err);
    cr_assert_eq(rc, 0, "flash_backward_cuda: %s", err);
    rc = flash_backward_merged_cuda(dq_m, kv_rows, kv_rows + (size_t)H * D, stride, rotate_dk, kv_amax, ws_m, dout_m,
                                    c.dev[0], c.dev[1], c.dev[2], out_m, lse_m, B, H, N, D, 0, err);
    cr_assert_eq(rc, 0, "flash_backward_merged_cuda: %s", err);
    CUDA_OK(cudaDeviceSynchronize());

    expect_merged_like_head_major(out_m, out_h, lse_m, lse_h, dq_m, grads_h, c.n, kv_rows, stride, 0, rotate_dk,
                                  kv_amax, B, H, N, D, what);
    cudaFree(ws_h); cudaFree(ws_m); cudaFree(out_h); cudaFree(out_m); cudaFree(dout_m);
    cudaFree(lse_h); cudaFree(lse_m); cudaFree(grads_h); cudaFree(dq_m); cudaFree(kv_rows); cudaFree(kv_amax);
    free_case(&c);
}

// The default dispatch (on sm_90: the Hopper kernels) and the mma.sync kernels
// (DIT_FLASH_MMA_SYNC=1, read at call time).
Test(flash_cuda, merged_layout_matches_head_major, .timeout = 120) {
    SKIP_WITHOUT_GPU();
    int deterministic_before = flash_backward_set_deterministic(1);
    for (int mma_sync = 0; mma_sync < 2; mma_sync++) {
        const char *dispatch = mma_sync ? "DIT_FLASH_MMA_SYNC=1" : "default dispatch";
        if (mma_sync) setenv("DIT_FLASH_MMA_SYNC", "1", 1);
        for (int s = 0; s < MERGED_LAYOUT_SHAPES; s++) {
            const int *x = merged_layout_shapes[s];
            check_merged_layout(x[0], x[1], x[2], x[3], s % 2, dispatch, 20 + s);
        }
        if (mma_sync) unsetenv("DIT_FLASH_MMA_SYNC");
    }
    flash_backward_set_deterministic(deterministic_before);
}

// Argument checks come before any CUDA call: this test runs without a GPU too.
Test(flash_cuda, rejects_bad_shapes) {
    char err[DIT_ERR_LEN] = "";
    cr_expect_eq(flash_forward_cuda(NULL, NULL, NULL, NULL, NULL, 1, 1, 16, 96, 0, err), -1);
    cr_expect(strstr(err, "D in {64, 128}") != NULL, "message: %s", err);
    err[0] = 0;
    cr_expect_eq(flash_backward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1, 1, 0, 64, 0, err), -1);
    cr_expect(strstr(err, "N >= 1") != NULL, "message: %s", err);
    err[0] = 0;
    cr_expect_eq(flash_backward_sm90_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1, 1, 16, 96, 0,
                                          err), -1);
    cr_expect(strstr(err, "D in {64, 128}") != NULL, "message: %s", err);
}
