// The Hopper sage forward with FP16 P·V (sage_forward_sm90.cu: sage_forward_sm90_kernel<128, false>
// at D = 128, sage_forward_wg_kernel<64, false> at D = 64, which sage_forward_cuda and
// sage_forward_merged_cuda run for SAGE_PV_FP16 on sm_90; DIT_SAGE_MMA_SYNC=1 keeps them on the
// mma.sync kernel). Against the CPU definition
// (attention.h, SAGE_PV_FP16, q_block = k_block = 64) and against the mma.sync FP16 kernel, on
// random inputs (N(0,1), and the outliers of issue 5: q, k ×8 on channels 3 and 17, k + 20 on
// every 4th channel) with NaN-poisoned outputs (dmalloc): N not a multiple of 64 (masked tail keys),
// several heads and batches, the merged layout, and at D = 128 150 tiles of 192 queries (more than
// the H200's 132 SMs: a partial last round, run as split units). Tolerances: the outputs are bf16 on both
// sides, so what is left is bf16 rounding flips where the fp32 values differ in the last bits
// (summation order, MUFU exp2/log2, fp16(P) flips): rel L2 < 3e-4 and cosine > 0.99999 (the FP8
// kernel reaches ~5e-4 against its definition, its e4m3 P·V accumulating with fewer bits), lse
// max abs diff < 1e-4. Skips without an sm_90 device and sm_90a code.
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attention/attention.h"
#include "attention/sage_cuda.h"
#include "layers/common.h"
#include "test/attention_test.h"

static const SageConfig GPU_FP16 = {64, 64, SAGE_PV_FP16, 0, SAGE_BWD_FP32};
#define REL_TOL 3e-4
#define COS_TOL 0.99999
#define LSE_TOL 1e-4

// One FP16 forward (sage_forward_cuda, or sage_forward_merged_cuda when merged) into host out
// (bf16 bits, head-major: the merged output is transposed back) and lse; out and lse start as NaN.
static void forward_fp16(uint16_t *out_bits, float *lse, const QkvInputs *in, int merged) {
    char err[DIT_ERR_LEN] = "";
    void *ws = dmalloc(sage_cuda_forward_workspace_size(in->B, in->H, in->N, in->D, SAGE_PV_FP16));
    uint16_t *out_dev = dmalloc(in->n * 2);
    float *lse_dev = dmalloc(in->rows * 4);
    int rc = (merged ? sage_forward_merged_cuda : sage_forward_cuda)(out_dev, lse_dev, ws, in->q_dev, in->k_dev,
                                                                     in->v_dev, in->B, in->H, in->N, in->D,
                                                                     SAGE_PV_FP16, 0, err);
    cr_assert_eq(rc, 0, "sage_forward%s_cuda: %s", merged ? "_merged" : "", err);
    CUDA_OK(cudaDeviceSynchronize());
    uint16_t *bits = xmalloc(in->n * 2);
    CUDA_OK(cudaMemcpy(bits, out_dev, in->n * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lse, lse_dev, in->rows * 4, cudaMemcpyDeviceToHost));
    for (int b = 0; b < in->B; b++)   // merged (B, N, H, D) -> head-major (B, H, N, D)
        for (int h = 0; h < in->H; h++)
            for (int t = 0; t < in->N; t++) {
                size_t src = merged ? (((size_t)b * in->N + t) * in->H + h) * in->D
                                    : (((size_t)b * in->H + h) * in->N + t) * in->D;
                memcpy(out_bits + (((size_t)b * in->H + h) * in->N + t) * in->D, bits + src, in->D * 2);
            }
    free(bits);
    cudaFree(ws); cudaFree(out_dev); cudaFree(lse_dev);
}

// forward_fp16 (head-major) with the environment variable name set to value for the call (the
// dispatch reads it at call time).
static void forward_fp16_with(uint16_t *out_bits, float *lse, const QkvInputs *in, const char *name,
                              const char *value) {
    setenv(name, value, 1);
    forward_fp16(out_bits, lse, in, 0);
    unsetenv(name);
}

// Values of two runs' outputs (bf16 bits) and lse that differ in any bit.
static size_t count_differing(const uint16_t *bits_a, const float *lse_a, const uint16_t *bits_b,
                              const float *lse_b, const QkvInputs *in) {
    size_t diffs = 0;
    for (size_t i = 0; i < in->n; i++) diffs += bits_a[i] != bits_b[i];
    for (size_t i = 0; i < in->rows; i++) diffs += memcmp(&lse_a[i], &lse_b[i], 4) != 0;
    return diffs;
}

static void to_floats(float *x, const uint16_t *bits, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = from_bf16(bits[i]);
}
static double lse_max_diff(const float *a, const float *b, size_t n) {
    double e = 0;
    for (size_t i = 0; i < n; i++) e = fmax(e, fabs((double)a[i] - b[i]));
    return isnan(e) ? INFINITY : e;
}

// The sm90 FP16 forward (head-major and merged, the head-major one run twice) against the CPU
// definition: within tolerance, and the three runs bitwise equal (a race between the producer and
// the consumers, or a layout slip in the merged store, would show).
static void check_definition(int B, int H, int N, int D, int outliers) {
    QkvInputs in = make_qkv_inputs(B, H, N, D, outliers, 11000 + B * 100 + H + N);
    uint16_t *bits[3];
    float *lse[3];
    for (int r = 0; r < 3; r++) {
        bits[r] = xmalloc(in.n * 2);
        lse[r] = xmalloc(in.rows * 4);
        forward_fp16(bits[r], lse[r], &in, r == 2);
    }
    size_t diffs[2] = {count_differing(bits[1], lse[1], bits[0], lse[0], &in),
                       count_differing(bits[2], lse[2], bits[0], lse[0], &in)};
    float *out = xmalloc(in.n * 4), *ref = xmalloc(in.n * 4), *ref_lse = xmalloc(in.rows * 4);
    to_floats(out, bits[0], in.n);
    sage_forward(ref, ref_lse, in.q, in.k, in.v, B, H, N, D, GPU_FP16);
    for (size_t i = 0; i < in.n; i++) ref[i] = from_bf16(to_bf16(ref[i]));   // the GPU writes bf16
    double rel, cosv, lse_err = lse_max_diff(lse[0], ref_lse, in.rows);
    compare(&rel, &cosv, out, ref, in.n);
    int ctas = D == 128 ? B * H * (((N + 63) / 64 + 2) / 3) : B * H * ((N + 63) / 64);   // 192- or 64-query tiles
    fprintf(stderr, "sm90 fp16 forward B=%d H=%d N=%d D=%d %s (%d tiles): vs definition rel L2 %.2e cosine %.7f "
                    "lse max diff %.1e; differing values: second run %zu, merged layout %zu\n", B, H, N, D,
            outliers ? "outliers" : "gaussian", ctas, rel, cosv, lse_err, diffs[0], diffs[1]);
    cr_expect(rel < REL_TOL, "rel L2 vs definition %g >= %g", rel, REL_TOL);
    cr_expect(cosv > COS_TOL, "cosine vs definition %.7f <= %g", cosv, COS_TOL);
    cr_expect(lse_err < LSE_TOL, "lse max abs diff vs definition %g >= %g", lse_err, LSE_TOL);
    cr_expect_eq(diffs[0], 0, "a second run differs in %zu values", diffs[0]);
    cr_expect_eq(diffs[1], 0, "the merged layout differs from the head-major one in %zu values", diffs[1]);
    for (int r = 0; r < 3; r++) { free(bits[r]); free(lse[r]); }
    free(out); free(ref); free(ref_lse);
    free_qkv_inputs(&in);
}

Test(sage_forward_fp16_sm90, matches_definition, .timeout = 240) {
    SKIP_WITHOUT_SM90();
    check_definition(1, 1, 1, 128, 0);      // one key: the tail block is the only block
    check_definition(1, 1, 37, 128, 1);     // one short block
    check_definition(2, 3, 130, 128, 0);    // three key blocks, the last with 2 keys
    check_definition(1, 2, 70, 128, 1);
    check_definition(3, 2, 200, 128, 0);    // four query blocks: the second tile has one
    check_definition(1, 1, 1024, 128, 1);
    check_definition(2, 75, 130, 128, 1);   // 150 tiles on 132 SMs: the last round split
}

// D = 64: the one-warpgroup kernel (one CTA per 64-query block and head; three K̂/V̂ᵀ stages, so
// N = 200's four key blocks reuse a stage and N = 1024's sixteen go round five times).
Test(sage_forward_fp16_sm90, d64_matches_definition, .timeout = 240) {
    SKIP_WITHOUT_SM90();
    check_definition(1, 1, 1, 64, 0);
    check_definition(1, 1, 37, 64, 1);
    check_definition(2, 3, 130, 64, 0);
    check_definition(1, 2, 70, 64, 1);
    check_definition(3, 2, 200, 64, 1);
    check_definition(1, 1, 1024, 64, 0);
    check_definition(2, 4, 1024, 64, 1);
}

// Long sequences and many heads, against the mma.sync FP16 kernel (DIT_SAGE_MMA_SYNC=1), at D.
static void check_mma_sync_long(int D) {
    const int configs[4][3] = {{1, 2, 4096}, {1, 1, 16384}, {1, 16, 1111}, {4, 16, 1000}};
    for (int ci = 0; ci < 4; ci++) {
        int B = configs[ci][0], H = configs[ci][1], N = configs[ci][2];
        QkvInputs in = make_qkv_inputs(B, H, N, D, ci % 2, (D == 128 ? 12000 : 12500) + ci);
        uint16_t *bits_s = xmalloc(in.n * 2), *bits_m = xmalloc(in.n * 2);
        float *lse_s = xmalloc(in.rows * 4), *lse_m = xmalloc(in.rows * 4);
        forward_fp16(bits_s, lse_s, &in, 0);
        forward_fp16_with(bits_m, lse_m, &in, "DIT_SAGE_MMA_SYNC", "1");
        float *out_s = xmalloc(in.n * 4), *out_m = xmalloc(in.n * 4);
        to_floats(out_s, bits_s, in.n);
        to_floats(out_m, bits_m, in.n);
        double rel, cosv, lse_err = lse_max_diff(lse_s, lse_m, in.rows);
        compare(&rel, &cosv, out_s, out_m, in.n);
        fprintf(stderr, "sm90 fp16 vs mma.sync fp16 B=%d H=%d N=%d D=%d %s: rel L2 %.2e cosine %.7f lse max diff "
                        "%.1e\n", B, H, N, D, ci % 2 ? "outliers" : "gaussian", rel, cosv, lse_err);
        cr_expect(rel < REL_TOL, "vs mma.sync rel L2 %g >= %g (B=%d H=%d N=%d D=%d)", rel, REL_TOL, B, H, N, D);
        cr_expect(cosv > COS_TOL, "vs mma.sync cosine %.7f <= %g", cosv, COS_TOL);
        cr_expect(lse_err < 2 * LSE_TOL, "vs mma.sync lse max diff %g >= %g", lse_err, 2 * LSE_TOL);
        free(bits_s); free(bits_m); free(lse_s); free(lse_m); free(out_s); free(out_m);
        free_qkv_inputs(&in);
    }
}
Test(sage_forward_fp16_sm90, matches_mma_sync_long, .timeout = 240) {
    SKIP_WITHOUT_SM90();
    check_mma_sync_long(128);
}
Test(sage_forward_fp16_sm90, d64_matches_mma_sync_long, .timeout = 240) {
    SKIP_WITHOUT_SM90();
    check_mma_sync_long(64);
}

// The split last round (two units per tile) gives bitwise the results of whole tiles
// (DIT_SAGE_FWD_SPLIT=0), as for FP8: c's attention (16 heads × 16K) and 2 heads × 4K.
Test(sage_forward_fp16_sm90, split_rounds_are_bitwise_whole_tiles, .timeout = 120) {
    SKIP_WITHOUT_SM90();
    const int configs[2][3] = {{1, 16, 16384}, {1, 2, 4096}};
    for (int ci = 0; ci < 2; ci++) {
        QkvInputs in = make_qkv_inputs(configs[ci][0], configs[ci][1], configs[ci][2], 128, ci, 13000 + ci);
        uint16_t *bits_s = xmalloc(in.n * 2), *bits_w = xmalloc(in.n * 2);
        float *lse_s = xmalloc(in.rows * 4), *lse_w = xmalloc(in.rows * 4);
        forward_fp16(bits_s, lse_s, &in, 0);
        forward_fp16_with(bits_w, lse_w, &in, "DIT_SAGE_FWD_SPLIT", "0");
        size_t diffs = count_differing(bits_s, lse_s, bits_w, lse_w, &in);
        fprintf(stderr, "sm90 fp16 split rounds B=%d H=%d N=%d: %zu values differ from whole tiles\n", in.B, in.H,
                in.N, diffs);
        cr_expect_eq(diffs, 0, "split rounds differ from whole tiles in %zu values", diffs);
        free(bits_s); free(bits_w); free(lse_s); free(lse_w);
        free_qkv_inputs(&in);
    }
}
