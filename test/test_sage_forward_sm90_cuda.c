// The Hopper sage forward (attention/sage_forward_sm90.cu) beyond test_sage_cuda.c: the persistent
// tile loop and the producer/consumer stage pipeline of its D = 128 kernel, which runs one CTA per
// SM over tiles of 192 queries (3 consumer warpgroups × 64) × one head. The D = 128 case has more
// tiles than the H200 has SMs (132), so CTAs loop over several tiles, and N not a multiple of 64
// (tiles whose last consumer warpgroups have no rows: test_sage_cuda's N = 70, 200, 1024, 4096);
// the D = 64 case (the one-warpgroup kernel) has many heads and a short tail block. Against the CPU
// definition (sage_cpu.c with q_block = k_block = 64) with test_sage_cuda's tolerances (rel L2 of
// the bf16 outputs < 2e-3, lse max abs diff < 1e-3), and run twice for bit-identical results (a
// race between the producer and the consumers would show up as a difference). Skips without an
// sm_90 device and sm_90a code.
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

static const SageConfig GPU_FP8 = {64, 64, SAGE_PV_FP8, 0, SAGE_BWD_FP32};

// One sm90 forward into host out bits (bf16) and lse; out and lse start as NaN (dmalloc's poison),
// so a row the kernel never writes fails every comparison.
static void sm90_forward(uint16_t *out_bits, float *lse, const QkvInputs *in) {
    char err[DIT_ERR_LEN] = "";
    void *ws = dmalloc(sage_cuda_forward_workspace_size(in->B, in->H, in->N, in->D, SAGE_PV_FP8));
    uint16_t *out_dev = dmalloc(in->n * 2);
    float *lse_dev = dmalloc(in->rows * 4);
    int rc = sage_forward_sm90_cuda(out_dev, lse_dev, ws, in->q_dev, in->k_dev, in->v_dev, in->B, in->H, in->N,
                                    in->D, 0, err);
    cr_assert_eq(rc, 0, "sage_forward_sm90_cuda: %s", err);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(out_bits, out_dev, in->n * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lse, lse_dev, in->rows * 4, cudaMemcpyDeviceToHost));
    cudaFree(ws); cudaFree(out_dev); cudaFree(lse_dev);
}

static void check_many_tiles(int B, int H, int N, int D) {
    QkvInputs in = make_qkv_inputs(B, H, N, D, 0, 5000 + N + D + H);
    uint16_t *bits = xmalloc(in.n * 2), *bits2 = xmalloc(in.n * 2);
    float *lse = xmalloc(in.rows * 4), *lse2 = xmalloc(in.rows * 4);
    sm90_forward(bits, lse, &in);
    sm90_forward(bits2, lse2, &in);
    size_t out_diffs = 0, lse_diffs = 0;
    for (size_t i = 0; i < in.n; i++) out_diffs += bits[i] != bits2[i];
    for (size_t i = 0; i < in.rows; i++) lse_diffs += memcmp(&lse[i], &lse2[i], 4) != 0;

    float *out = xmalloc(in.n * 4), *ref = xmalloc(in.n * 4), *ref_lse = xmalloc(in.rows * 4);
    for (size_t i = 0; i < in.n; i++) out[i] = from_bf16(bits[i]);
    sage_forward(ref, ref_lse, in.q, in.k, in.v, B, H, N, D, GPU_FP8);
    for (size_t i = 0; i < in.n; i++) ref[i] = from_bf16(to_bf16(ref[i]));   // the GPU writes bf16
    double rel, cosv, lse_err = max_abs_diff(lse, ref_lse, in.rows);
    compare(&rel, &cosv, out, ref, in.n);
    fprintf(stderr, "sm90 forward B=%d H=%d N=%d D=%d (%d blocks of 64 queries): vs definition rel L2 %.2e, "
                    "lse max diff %.1e; second run: %zu out / %zu lse values differ\n", B, H, N, D,
            B * H * ((N + 63) / 64), rel,
            lse_err, out_diffs, lse_diffs);
    cr_expect(rel < 2e-3, "rel L2 vs CPU definition %g >= 2e-3", rel);
    cr_expect(lse_err < 1e-3, "lse max abs diff vs CPU definition %g >= 1e-3", lse_err);
    cr_expect_eq(out_diffs + lse_diffs, 0, "two runs differ in %zu out and %zu lse values", out_diffs, lse_diffs);
    free(bits); free(bits2); free(lse); free(lse2); free(out); free(ref); free(ref_lse);
    free_qkv_inputs(&in);
}

// 150 tiles (one per head: three 64-query blocks, one per consumer warpgroup), N = 130: three key
// blocks, the last with 2 keys.
Test(sage_forward_sm90, many_tiles_odd_blocks_d128, .timeout = 120) {
    SKIP_WITHOUT_SM90();
    check_many_tiles(2, 75, 130, 128);
}

// 140 heads of 4 query blocks, N = 200: four key blocks, the last with 8 keys.
Test(sage_forward_sm90, many_tiles_tail_d64, .timeout = 120) {
    SKIP_WITHOUT_SM90();
    check_many_tiles(140, 1, 200, 64);
}
