// Tests of the CUDA layers (layers/layers_cuda.h) against the CPU fp32 reference (layers/layers.h).
// Every test skips when no CUDA GPU is found. Inputs are random (Rng, never zeros) and rounded to
// bf16 on the host, so the CPU and the GPU see the same numbers and only the compute differs.
// Outputs that a call writes are poisoned first (all bytes 0xFF: NaN in bf16 and fp32); gradients
// that a call accumulates into start from random values, the same on both sides.
//
// Tolerances, as ‖gpu - cpu‖/‖cpu‖:
// - TOL_BF16 1e-2: outputs stored in bf16 (rounding alone gives ~2e-3) and the cuBLASLt GELU/DGELU
//   epilogues;
// - TOL_GEMM_F32 1e-3: fp32 weight gradients from cuBLASLt (bf16 products, fp32 accumulation in
//   another order);
// - TOL_F32 1e-5: fp32 reductions and fp32 elementwise math (LayerNorm statistics, dshift, dscale,
//   dgate, dbias, loss, norm, AdamW, EMA): only the summation order and the fast-math division
//   and square root differ;
// - exact (0): data movement (reshapes, embedding lookup) and sums done in the same order.
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>
#include "layers/common.h"
#include "layers/layers.h"
#include "layers/layers_cuda.h"
#include "test/compare.h"
#include "test/cuda_test.h"

#define TOL_BF16 1e-2
#define TOL_GEMM_F32 1e-3
#define TOL_F32 1e-5

static float bf16_round(float x) { return float_from_bf16_bits(bf16_bits_from_float(x)); }

static void round_to_bf16(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = bf16_round(x[i]);
}

// N(0, std²) values rounded to bf16 (exactly representable on both sides).
static float *randn_bf16(Rng *rng, size_t n, float std) {
    float *x = host_floats(n);
    rng_fill_normal(rng, x, n, std);
    round_to_bf16(x, n);
    return x;
}

// Bit-exact against the CPU result rounded to bf16 (for pure data movement).
// Each argument is evaluated once.
#define EXPECT_EXACT_BF16(out, ref, n, name) do {                                             \
        const float *out_ = (out), *ref_ = (ref);                                              \
        size_t bad_ = 0;                                                                       \
        for (size_t i_ = 0; i_ < (n); i_++) bad_ += out_[i_] != bf16_round(ref_[i_]);         \
        cr_expect_eq(bad_, 0, "%s: %zu of %zu elements differ", name, bad_, (size_t)(n));      \
    } while (0)

static LayersCuda ctx;
static char err[DIT_ERR_LEN];

static void setup(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return;   // the test skips
    cr_assert_eq(layers_cuda_create(&ctx, 1u << 22, err), 0, "layers_cuda_create: %s", err);
}

static void teardown(void) {
    free_buffers();
    if (ctx.lt) layers_cuda_destroy(&ctx);
}

TestSuite(cuda, .init = setup, .fini = teardown);

// ---- linear ------------------------------------------------------------------------------

// Forward (with and without bias) and backward of one linear shape against linear_forward /
// linear_backward. M >= 128 exercises several row chunks of the bias-gradient reduction.
// beta0_bitwise: also dweight written (beta 0) bitwise the sum into zeros (one algorithm for both).
static void check_linear(int M, int IC, int OC, uint64_t seed, bool beta0_bitwise) {
    Rng rng;
    rng_seed(&rng, seed);
    size_t nx = (size_t)M * IC, nw = (size_t)OC * IC, ny = (size_t)M * OC;
    float *x = randn_bf16(&rng, nx, 1.0f), *w = randn_bf16(&rng, nw, 0.1f), *b = randn_bf16(&rng, OC, 0.1f);
    float *dy = randn_bf16(&rng, ny, 1.0f);
    float *dx0 = randn_bf16(&rng, nx, 1.0f), *dw0 = randn_bf16(&rng, nw, 1.0f), *db0 = randn_bf16(&rng, OC, 1.0f);
    bf16 *d_x = upload_bf16(x, nx), *d_w = upload_bf16(w, nw), *d_b = upload_bf16(b, OC), *d_dy = upload_bf16(dy, ny);
    char name[96];

    float *y_ref = host_floats(ny);
    linear_forward(y_ref, x, w, b, M, IC, OC);
    bf16 *d_y = poisoned(ny * sizeof(bf16));
    OK(linear_forward_cuda(d_y, d_x, d_w, d_b, M, IC, OC, &ctx, 0, err));
    snprintf(name, sizeof name, "linear forward M=%d IC=%d OC=%d", M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_y, ny), y_ref, ny, TOL_BF16, name);

    linear_forward(y_ref, x, w, NULL, M, IC, OC);
    CK(cudaMemset(d_y, 0xFF, ny * sizeof(bf16)));
    OK(linear_forward_cuda(d_y, d_x, d_w, NULL, M, IC, OC, &ctx, 0, err));
    snprintf(name, sizeof name, "linear forward (no bias) M=%d IC=%d OC=%d", M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_y, ny), y_ref, ny, TOL_BF16, name);

    float *dx = copy_floats(dx0, nx), *dw = copy_floats(dw0, nw), *db = copy_floats(db0, OC);
    linear_backward(dx, dw, db, dy, x, w, M, IC, OC);
    bf16 *d_dx = upload_bf16(dx0, nx);
    float *d_dw = upload_f32(dw0, nw), *d_db = upload_f32(db0, OC);
    OK(linear_backward_cuda(d_dx, 1.0f, d_dw, 1.0f, d_db, d_dy, d_x, d_w, M, IC, OC, &ctx, 0, err));
    snprintf(name, sizeof name, "linear backward dinp M=%d IC=%d OC=%d", M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_dx, nx), dx, nx, TOL_BF16, name);
    snprintf(name, sizeof name, "linear backward dweight M=%d IC=%d OC=%d", M, IC, OC);
    EXPECT_CLOSE(download_f32(d_dw, nw), dw, nw, TOL_GEMM_F32, name);
    snprintf(name, sizeof name, "linear backward dbias M=%d IC=%d OC=%d", M, IC, OC);
    EXPECT_CLOSE(download_f32(d_db, OC), db, OC, TOL_F32, name);

    // dinp_beta 0 writes dinp: the CPU's into a zeroed dinp, the GPU's poisoned (NaN if it were read)
    memset(dx, 0, nx * sizeof(float));
    linear_backward(dx, dw, NULL, dy, x, w, M, IC, OC);   // (dweight: the CPU's needs one; unused here)
    CK(cudaMemset(d_dx, 0xFF, nx * sizeof(bf16)));
    OK(linear_backward_cuda(d_dx, 0.0f, NULL, 1.0f, NULL, d_dy, d_x, d_w, M, IC, OC, &ctx, 0, err));
    snprintf(name, sizeof name, "linear backward dinp written (beta 0) M=%d IC=%d OC=%d", M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_dx, nx), dx, nx, TOL_BF16, name);

    // dweight_beta 0 writes dweight: bitwise the sum into zeros (the written one poisoned first)
    if (!beta0_bitwise) return;
    CK(cudaMemset(d_dw, 0, nw * sizeof(float)));
    OK(linear_backward_cuda(NULL, 1.0f, d_dw, 1.0f, NULL, d_dy, d_x, d_w, M, IC, OC, &ctx, 0, err));
    float *into_zeros = download_f32(d_dw, nw);
    CK(cudaMemset(d_dw, 0xFF, nw * sizeof(float)));
    OK(linear_backward_cuda(NULL, 1.0f, d_dw, 0.0f, NULL, d_dy, d_x, d_w, M, IC, OC, &ctx, 0, err));
    float *written = download_f32(d_dw, nw);
    cr_expect_eq(memcmp(written, into_zeros, nw * sizeof(float)), 0,
                 "linear backward dweight written (beta 0) M=%d IC=%d OC=%d: not bitwise the sum into zeros", M, IC,
                 OC);
}

Test(cuda, linear_shapes) {
    REQUIRE_GPU();
    check_linear(150, 96, 136, 1, true);   // a DiT block's shape, OC not a multiple of 32
    check_linear(600, 64, 40, 2, true);    // 3 chunks in the bias gradient
    check_linear(98, 4, 24, 3, true);      // patch embedding of 1-channel 2×2 patches: IC = 4
    check_linear(98, 48, 4, 4, true);      // final layer to 2×2×1 pixels: OC = 4
    check_linear(5000, 16, 300, 16, true); // OC not a multiple of 8 or 256: element-wise dbias, 78 chunks
    check_linear(8192, 16, 264, 17, true); // 16-byte dbias loads, 128 chunks, a partial column tile
}

// With GEMM tuning (layers_cuda_set_gemm_tuning) the same results within the same tolerances, at
// each shape's first call (its candidates timed; where the GEMM accumulates into D, dinp and dweight
// here, D put back before the real call: a timing run left in would add the product ~60 times) and
// at the second (the cached pick). The written-dweight check is left out: beta 0 and beta 1 are
// two shapes to the tuning and may get different algorithms.
Test(cuda, linear_with_gemm_tuning) {
    REQUIRE_GPU();
    OK(layers_cuda_set_gemm_tuning(&ctx, 1, err));
    for (int round = 0; round < 2; round++) {
        check_linear(150, 96, 136, 1, false);
        check_linear(600, 64, 40, 2, false);
        check_linear(1024, 512, 768, 18, false);   // big enough for cuBLASLt to offer several algorithms
    }
    OK(layers_cuda_set_gemm_tuning(&ctx, 0, err));
    cr_expect_null(ctx.gemm_tuning, "tuning off must forget the picks");
}

// linear_gelu_forward_cuda = GELU(linear_forward), pre-activation kept.
Test(cuda, linear_gelu_forward) {
    REQUIRE_GPU();
    int M = 150, IC = 64, OC = 256;
    Rng rng;
    rng_seed(&rng, 5);
    float *x = randn_bf16(&rng, (size_t)M * IC, 1.0f), *w = randn_bf16(&rng, (size_t)OC * IC, 0.15f);
    float *b = randn_bf16(&rng, OC, 0.5f);
    float *pre_ref = host_floats((size_t)M * OC), *out_ref = host_floats((size_t)M * OC);
    linear_forward(pre_ref, x, w, b, M, IC, OC);
    gelu_forward(out_ref, pre_ref, (size_t)M * OC);
    bf16 *d_out = poisoned((size_t)M * OC * sizeof(bf16)), *d_pre = poisoned((size_t)M * OC * sizeof(bf16));
    OK(linear_gelu_forward_cuda(d_out, d_pre, upload_bf16(x, (size_t)M * IC), upload_bf16(w, (size_t)OC * IC),
                                upload_bf16(b, OC), M, IC, OC, &ctx, 0, err));
    EXPECT_CLOSE(download_bf16(d_pre, (size_t)M * OC), pre_ref, (size_t)M * OC, TOL_BF16, "linear+GELU pre-activation");
    EXPECT_CLOSE(download_bf16(d_out, (size_t)M * OC), out_ref, (size_t)M * OC, TOL_BF16, "linear+GELU output");
}

// linear_dgelu_backward_cuda = linear_backward into a zeroed dh, then gelu_backward into a zeroed dpre.
Test(cuda, linear_dgelu_backward) {
    REQUIRE_GPU();
    int M = 600, IC = 192, OC = 48;   // the MLP's second layer: IC = hidden
    size_t nx = (size_t)M * IC, nw = (size_t)OC * IC, ny = (size_t)M * OC;
    Rng rng;
    rng_seed(&rng, 6);
    float *pre = randn_bf16(&rng, nx, 1.0f), *w = randn_bf16(&rng, nw, 0.1f), *dy = randn_bf16(&rng, ny, 1.0f);
    float *h = host_floats(nx);
    gelu_forward(h, pre, nx);
    round_to_bf16(h, nx);
    float *dw0 = randn_bf16(&rng, nw, 1.0f), *db0 = randn_bf16(&rng, OC, 1.0f);
    float *dh = host_floats(nx), *dpre = host_floats(nx), *dw = copy_floats(dw0, nw), *db = copy_floats(db0, OC);
    linear_backward(dh, dw, db, dy, h, w, M, IC, OC);
    gelu_backward(dpre, pre, dh, nx);
    bf16 *d_dpre = poisoned(nx * sizeof(bf16));
    float *d_dw = upload_f32(dw0, nw), *d_db = upload_f32(db0, OC);
    OK(linear_dgelu_backward_cuda(d_dpre, d_dw, 1.0f, d_db, upload_bf16(dy, ny), upload_bf16(h, nx), upload_bf16(pre, nx),
                                  upload_bf16(w, nw), M, IC, OC, &ctx, 0, err));
    EXPECT_CLOSE(download_bf16(d_dpre, nx), dpre, nx, TOL_BF16, "linear+DGELU backward dpre");
    EXPECT_CLOSE(download_f32(d_dw, nw), dw, nw, TOL_GEMM_F32, "linear+DGELU backward dweight");
    EXPECT_CLOSE(download_f32(d_db, OC), db, OC, TOL_F32, "linear+DGELU backward dbias");
}

// The cuBLASLt aux rule is reported, not crashed into (no GPU needed: checked before any call).
Test(cuda, linear_gelu_rejects_unaligned_width) {
    int rc = linear_gelu_forward_cuda(NULL, NULL, NULL, NULL, NULL, 4, 8, 12, NULL, 0, err);
    cr_assert_eq(rc, -1);
    cr_assert(strstr(err, "OC=12"), "message names the size: %s", err);
}

// ---- LayerNorm + modulation, gated residual ----------------------------------------------
// The modulation vectors are chunks of a (B, 6C) adaLN output, so mod_stride = 6C; shift is
// chunk 1, scale chunk 2, gate chunk 4, and the gradient tests compare the whole (B, 6C) buffer
// (the other chunks must stay untouched). Shapes (B, T, C):
// - (3, 37, 72): C not a multiple of 32, one block row per image (the sums go straight out);
// - (1, 16384, 264): one image of 16K tokens, the token sums split over 256 blocks and added by
//   the second pass; C a multiple of 8 (16-byte vectors) but not of the 256-column tile;
// - (2, 1000, 75): C not a multiple of 8 (element-wise loads, shift/scale unaligned), 15 splits;
// - (64, 256, 96): config a's batch layout (splits per image over many images).
static const int norm_shapes[][3] = {{3, 37, 72}, {1, 16384, 264}, {2, 1000, 75}, {64, 256, 96}};

static void check_layernorm_modulate(int B, int T, int C, uint64_t seed) {
    int mod_stride = 6 * C;
    size_t n = (size_t)B * T * C, nmod = (size_t)B * mod_stride, rows = (size_t)B * T;
    Rng rng;
    rng_seed(&rng, seed);
    float *x = host_floats(n);
    for (size_t i = 0; i < n; i++) x[i] = bf16_round(0.5f + 2.0f * rng_normal(&rng));   // non-zero mean
    float *mod = randn_bf16(&rng, nmod, 0.5f), *dy = randn_bf16(&rng, n, 1.0f);
    float *dx0 = randn_bf16(&rng, n, 1.0f), *dmod0 = randn_bf16(&rng, nmod, 1.0f);
    const float *shift = mod + C, *scale = mod + 2 * C;
    char name[128];

    float *y = host_floats(n), *mean = host_floats(rows), *rstd = host_floats(rows);
    layernorm_modulate_forward(y, mean, rstd, x, shift, scale, B, T, C, mod_stride);
    bf16 *d_x = upload_bf16(x, n), *d_mod = upload_bf16(mod, nmod);
    bf16 *d_y = poisoned(n * sizeof(bf16));
    float *d_mean = poisoned(rows * sizeof(float)), *d_rstd = poisoned(rows * sizeof(float));
    OK(layernorm_modulate_forward_cuda(d_y, d_mean, d_rstd, d_x, d_mod + C, d_mod + 2 * C, B, T, C, mod_stride, NULL, 0, err));
    snprintf(name, sizeof name, "layernorm_modulate forward out B=%d T=%d C=%d", B, T, C);
    EXPECT_CLOSE(download_bf16(d_y, n), y, n, TOL_BF16, name);
    snprintf(name, sizeof name, "layernorm_modulate forward mean B=%d T=%d C=%d", B, T, C);
    EXPECT_CLOSE(download_f32(d_mean, rows), mean, rows, TOL_F32, name);
    snprintf(name, sizeof name, "layernorm_modulate forward rstd B=%d T=%d C=%d", B, T, C);
    EXPECT_CLOSE(download_f32(d_rstd, rows), rstd, rows, TOL_F32, name);

    // backward from the CPU statistics on both sides
    float *dx = copy_floats(dx0, n), *dmod = copy_floats(dmod0, nmod);
    layernorm_modulate_backward(dx, dmod + C, dmod + 2 * C, dy, x, mean, rstd, scale, B, T, C, mod_stride);
    bf16 *d_dx = upload_bf16(dx0, n);
    float *d_dmod = upload_f32(dmod0, nmod);
    OK(layernorm_modulate_backward_cuda(d_dx, d_dmod + C, d_dmod + 2 * C, upload_bf16(dy, n), d_x,
                                        upload_f32(mean, rows), upload_f32(rstd, rows), d_mod + 2 * C,
                                        B, T, C, mod_stride, &ctx, 0, err));
    snprintf(name, sizeof name, "layernorm_modulate backward dinp B=%d T=%d C=%d", B, T, C);
    EXPECT_CLOSE(download_bf16(d_dx, n), dx, n, TOL_BF16, name);
    snprintf(name, sizeof name, "layernorm_modulate backward dshift|dscale B=%d T=%d C=%d", B, T, C);
    EXPECT_CLOSE(download_f32(d_dmod, nmod), dmod, nmod, TOL_F32, name);
}

Test(cuda, layernorm_modulate) {
    REQUIRE_GPU();
    for (size_t i = 0; i < sizeof norm_shapes / sizeof *norm_shapes; i++)
        check_layernorm_modulate(norm_shapes[i][0], norm_shapes[i][1], norm_shapes[i][2], 7 + i);
}

static void check_gated_residual(int B, int T, int C, uint64_t seed) {
    int mod_stride = 6 * C;
    size_t n = (size_t)B * T * C, nmod = (size_t)B * mod_stride;
    Rng rng;
    rng_seed(&rng, seed);
    float *res = randn_bf16(&rng, n, 1.0f), *h = randn_bf16(&rng, n, 1.0f), *mod = randn_bf16(&rng, nmod, 1.0f);
    float *dy = randn_bf16(&rng, n, 1.0f), *dres0 = randn_bf16(&rng, n, 1.0f);
    float *dmod0 = randn_bf16(&rng, nmod, 1.0f);
    const float *gate = mod + 4 * C;
    char name[128];

    float *y = host_floats(n);
    gated_residual_forward(y, res, h, gate, B, T, C, mod_stride);
    bf16 *d_h = upload_bf16(h, n), *d_mod = upload_bf16(mod, nmod), *d_y = poisoned(n * sizeof(bf16));
    OK(gated_residual_forward_cuda(d_y, upload_bf16(res, n), d_h, d_mod + 4 * C, B, T, C, mod_stride, 0, err));
    snprintf(name, sizeof name, "gated_residual forward B=%d T=%d C=%d", B, T, C);
    EXPECT_CLOSE(download_bf16(d_y, n), y, n, TOL_BF16, name);

    // dh is written on the GPU: the CPU's from a zeroed dh, the GPU's poisoned
    float *dres = copy_floats(dres0, n), *dh = host_floats(n), *dmod = copy_floats(dmod0, nmod);
    memset(dh, 0, n * sizeof(float));
    gated_residual_backward(dres, dh, dmod + 4 * C, dy, h, gate, B, T, C, mod_stride);
    bf16 *d_dres = upload_bf16(dres0, n), *d_dh = poisoned(n * sizeof(bf16));
    float *d_dmod = upload_f32(dmod0, nmod);
    OK(gated_residual_backward_cuda(d_dres, d_dh, d_dmod + 4 * C, upload_bf16(dy, n), d_h, d_mod + 4 * C,
                                    B, T, C, mod_stride, NULL, NULL, &ctx, 0, err));
    snprintf(name, sizeof name, "gated_residual backward dres B=%d T=%d C=%d", B, T, C);
    EXPECT_CLOSE(download_bf16(d_dres, n), dres, n, TOL_BF16, name);
    snprintf(name, sizeof name, "gated_residual backward dh B=%d T=%d C=%d", B, T, C);
    EXPECT_CLOSE(download_bf16(d_dh, n), dh, n, TOL_BF16, name);
    snprintf(name, sizeof name, "gated_residual backward dgate B=%d T=%d C=%d", B, T, C);
    EXPECT_CLOSE(download_f32(d_dmod, nmod), dmod, nmod, TOL_F32, name);
}

Test(cuda, gated_residual) {
    REQUIRE_GPU();
    for (size_t i = 0; i < sizeof norm_shapes / sizeof *norm_shapes; i++)
        check_gated_residual(norm_shapes[i][0], norm_shapes[i][1], norm_shapes[i][2], 20 + i);
}

// ---- gated residual, then LayerNorm-modulate, in one kernel -------------------------------

// The first element (of elem_bytes) where two device buffers of n elements differ, or -1.
static long first_difference(const void *d_a, const void *d_b, size_t n, size_t elem_bytes) {
    unsigned char *a = host_alloc(n * elem_bytes), *b = host_alloc(n * elem_bytes);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(a, d_a, n * elem_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b, d_b, n * elem_bytes, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++)
        if (memcmp(a + i * elem_bytes, b + i * elem_bytes, elem_bytes)) return (long)i;
    return -1;
}

#define EXPECT_SAME_BITS(d_a, d_b, n, elem_bytes, what) do {                                  \
        long i_ = first_difference(d_a, d_b, n, elem_bytes);                                   \
        cr_expect_eq(i_, -1, "%s %s: not bitwise the two kernels' (first difference at %ld)", \
                     name, what, i_);                                                          \
    } while (0)

// {B, T, C, gate_stride, mod_stride}: gate_b at b·gate_stride (its last C), shift_b and scale_b at
// b·mod_stride (its last 2C). A block's pair (one (B, 6C) modulation row per sample); the final
// layer's (the gate from a block's row, shift and scale from a (B, 2C) one); C not a multiple of 8
// (element-wise loads, the last vector of a row partial); C = 2048 (the model's at config c); C > 2048
// (16 vectors per lane), also not a multiple of 8, and C = 4096 (the largest); config a's batch layout.
static const int fused_shapes[][5] = {{3, 37, 72, 432, 432},      {2, 1000, 75, 450, 450},
                                      {3, 100, 96, 1152, 192},    {2, 64, 2048, 12288, 12288},
                                      {2, 40, 3001, 18006, 6002}, {2, 30, 4096, 24576, 8192},
                                      {64, 256, 96, 576, 576}};

// gated_residual_layernorm_modulate_forward_cuda against gated_residual_forward_cuda then
// layernorm_modulate_forward_cuda (every output poisoned first): x_new, out, mean, rstd and the amax
// bitwise theirs, with and without the amax. Against the CPU spec: x_new against gated_residual_forward;
// out, mean and rstd against layernorm_modulate_forward of the x_new the GPU stored (the CPU's own
// x_new differs by its bf16 rounding, which moves the row statistics by more than TOL_F32).
static void check_gated_residual_layernorm(int B, int T, int C, int gate_stride, int mod_stride, uint64_t seed) {
    size_t n = (size_t)B * T * C, rows = (size_t)B * T;
    Rng rng;
    rng_seed(&rng, seed);
    float *res = host_floats(n);
    for (size_t i = 0; i < n; i++) res[i] = bf16_round(0.5f + 2.0f * rng_normal(&rng));   // non-zero mean
    float *h = randn_bf16(&rng, n, 1.0f);
    float *gates = randn_bf16(&rng, (size_t)B * gate_stride, 0.5f), *mod = randn_bf16(&rng, (size_t)B * mod_stride, 0.5f);
    const float *gate = gates + gate_stride - C, *shift = mod + mod_stride - 2 * C, *scale = mod + mod_stride - C;
    bf16 *d_res = upload_bf16(res, n), *d_h = upload_bf16(h, n);
    bf16 *d_gates = upload_bf16(gates, (size_t)B * gate_stride), *d_mod = upload_bf16(mod, (size_t)B * mod_stride);
    const bf16 *d_gate = d_gates + gate_stride - C, *d_shift = d_mod + mod_stride - 2 * C;
    const bf16 *d_scale = d_mod + mod_stride - C;
    char name[160];
    snprintf(name, sizeof name, "gated_residual_layernorm_modulate B=%d T=%d C=%d gate_stride=%d mod_stride=%d",
             B, T, C, gate_stride, mod_stride);

    bf16 *two_x = poisoned(n * sizeof(bf16)), *two_out = poisoned(n * sizeof(bf16));
    float *two_mean = poisoned(rows * sizeof(float)), *two_rstd = poisoned(rows * sizeof(float));
    float *two_amax = device_alloc(sizeof(float));
    CK(cudaMemset(two_amax, 0, sizeof(float)));
    OK(gated_residual_forward_cuda(two_x, d_res, d_h, d_gate, B, T, C, gate_stride, 0, err));
    OK(layernorm_modulate_forward_cuda(two_out, two_mean, two_rstd, two_x, d_shift, d_scale, B, T, C, mod_stride,
                                       two_amax, 0, err));

    bf16 *x = device_alloc(n * sizeof(bf16)), *out = device_alloc(n * sizeof(bf16));
    float *mean = device_alloc(rows * sizeof(float)), *rstd = device_alloc(rows * sizeof(float));
    float *amax = device_alloc(sizeof(float));
    for (int with_amax = 0; with_amax < 2; with_amax++) {
        CK(cudaMemset(x, 0xFF, n * sizeof(bf16)));
        CK(cudaMemset(out, 0xFF, n * sizeof(bf16)));
        CK(cudaMemset(mean, 0xFF, rows * sizeof(float)));
        CK(cudaMemset(rstd, 0xFF, rows * sizeof(float)));
        CK(cudaMemset(amax, 0, sizeof(float)));
        OK(gated_residual_layernorm_modulate_forward_cuda(x, out, mean, rstd, d_res, d_h, d_gate, d_shift, d_scale,
                                                          B, T, C, gate_stride, mod_stride, with_amax ? amax : NULL,
                                                          0, err));
        EXPECT_SAME_BITS(x, two_x, n, sizeof(bf16), "x_new");
        EXPECT_SAME_BITS(out, two_out, n, sizeof(bf16), "out");
        EXPECT_SAME_BITS(mean, two_mean, rows, sizeof(float), "mean");
        EXPECT_SAME_BITS(rstd, two_rstd, rows, sizeof(float), "rstd");
        if (with_amax) EXPECT_SAME_BITS(amax, two_amax, 1, sizeof(float), "amax");
    }

    float *x_ref = host_floats(n), *out_ref = host_floats(n), *mean_ref = host_floats(rows);
    float *rstd_ref = host_floats(rows), *x_gpu = download_bf16(x, n);
    gated_residual_forward(x_ref, res, h, gate, B, T, C, gate_stride);
    EXPECT_CLOSE(x_gpu, x_ref, n, TOL_BF16, "gated_residual_layernorm_modulate x_new");
    layernorm_modulate_forward(out_ref, mean_ref, rstd_ref, x_gpu, shift, scale, B, T, C, mod_stride);
    float *out_gpu = download_bf16(out, n), amax_ref = 0.0f, amax_gpu;
    EXPECT_CLOSE(out_gpu, out_ref, n, TOL_BF16, "gated_residual_layernorm_modulate out");
    EXPECT_CLOSE(download_f32(mean, rows), mean_ref, rows, TOL_F32, "gated_residual_layernorm_modulate mean");
    EXPECT_CLOSE(download_f32(rstd, rows), rstd_ref, rows, TOL_F32, "gated_residual_layernorm_modulate rstd");
    for (size_t i = 0; i < n; i++) amax_ref = fmaxf(amax_ref, fabsf(out_gpu[i]));   // of the values stored
    CK(cudaMemcpy(&amax_gpu, amax, sizeof(float), cudaMemcpyDeviceToHost));
    cr_expect_eq(amax_gpu, amax_ref, "%s: amax %g, max |out| %g", name, amax_gpu, amax_ref);
}

Test(cuda, gated_residual_layernorm_modulate) {
    REQUIRE_GPU();
    for (size_t i = 0; i < sizeof fused_shapes / sizeof *fused_shapes; i++) {
        const int *s = fused_shapes[i];
        check_gated_residual_layernorm(s[0], s[1], s[2], s[3], s[4], 40 + i);
    }
}

// ---- pointwise ---------------------------------------------------------------------------
Test(cuda, pointwise) {
    REQUIRE_GPU();
    size_t n = 10007;
    Rng rng;
    rng_seed(&rng, 9);
    float *x = randn_bf16(&rng, n, 2.0f), *x2 = randn_bf16(&rng, n, 2.0f), *dy = randn_bf16(&rng, n, 1.0f);
    float *dx0 = randn_bf16(&rng, n, 1.0f);
    bf16 *d_x = upload_bf16(x, n), *d_dy = upload_bf16(dy, n), *d_out = poisoned(n * sizeof(bf16));
    float *ref = host_floats(n);

    gelu_forward(ref, x, n);
    OK(gelu_forward_cuda(d_out, d_x, n, NULL, 0, err));
    EXPECT_CLOSE(download_bf16(d_out, n), ref, n, TOL_BF16, "gelu forward");
    memcpy(ref, dx0, n * sizeof(float));
    gelu_backward(ref, x, dy, n);
    bf16 *d_dx = upload_bf16(dx0, n);
    OK(gelu_backward_cuda(d_dx, d_x, d_dy, n, 0, err));
    EXPECT_CLOSE(download_bf16(d_dx, n), ref, n, TOL_BF16, "gelu backward");

    CK(cudaMemset(d_out, 0xFF, n * sizeof(bf16)));
    silu_forward(ref, x, n);
    OK(silu_forward_cuda(d_out, d_x, n, 0, err));
    EXPECT_CLOSE(download_bf16(d_out, n), ref, n, TOL_BF16, "silu forward");
    memcpy(ref, dx0, n * sizeof(float));
    silu_backward(ref, x, dy, n);
    d_dx = upload_bf16(dx0, n);
    OK(silu_backward_cuda(d_dx, d_x, d_dy, n, 0, err));
    EXPECT_CLOSE(download_bf16(d_dx, n), ref, n, TOL_BF16, "silu backward");

    CK(cudaMemset(d_out, 0xFF, n * sizeof(bf16)));
    add_forward(ref, x, x2, n);
    OK(add_forward_cuda(d_out, d_x, upload_bf16(x2, n), n, 0, err));
    EXPECT_CLOSE(download_bf16(d_out, n), ref, n, TOL_BF16, "add forward");

    // casts: fp32 -> bf16 rounds to nearest even as bf16_bits_from_float; bf16 -> fp32 is exact
    float *xf = host_floats(n);
    rng_fill_normal(&rng, xf, n, 3.0f);
    CK(cudaMemset(d_out, 0xFF, n * sizeof(bf16)));
    OK(cast_float_to_bf16_cuda(d_out, upload_f32(xf, n), n, 0, err));
    EXPECT_EXACT_BF16(download_bf16(d_out, n), xf, n, "cast fp32 -> bf16");
    // a column slice: rows of 24 floats at stride 100 (one block's adaLN gradient in dada)
    int rows = 7, cols = 24, ld = 100;
    float *slice = host_floats((size_t)rows * cols);
    for (int r = 0; r < rows; r++) memcpy(slice + r * cols, xf + r * ld + 30, cols * sizeof(float));
    CK(cudaMemset(d_out, 0xFF, n * sizeof(bf16)));
    float *d_xf = upload_f32(xf, n);
    OK(cast_float_to_bf16_rows_cuda(d_out, d_xf + 30, rows, cols, ld, 0, err));
    EXPECT_EXACT_BF16(download_bf16(d_out, (size_t)rows * cols), slice, (size_t)rows * cols, "cast fp32 rows -> bf16");
    cr_expect_eq(cast_float_to_bf16_rows_cuda(d_out, d_xf, 1, 8, 4, 0, err), -1, "inp_stride < cols accepted");
    float *d_f = poisoned(n * sizeof(float));
    OK(cast_bf16_to_float_cuda(d_f, d_x, n, 0, err));
    float *back = download_f32(d_f, n);
    cr_expect_eq(memcmp(back, x, n * sizeof(float)), 0, "cast bf16 -> fp32 is not exact");
}

// ---- reshapes (bit-exact) ----------------------------------------------------------------
Test(cuda, patchify_unpatchify) {
    REQUIRE_GPU();
    int B = 2, Cin = 3, S = 8, p = 2, T = (S / p) * (S / p);
    size_t n = (size_t)B * Cin * S * S;
    Rng rng;
    rng_seed(&rng, 10);
    float *img = randn_bf16(&rng, n, 1.0f), *tok0 = randn_bf16(&rng, n, 1.0f);
    float *ref = host_floats(n);
    bf16 *d_img = upload_bf16(img, n), *d_out = poisoned(n * sizeof(bf16));

    patchify_forward(ref, img, B, Cin, S, p);
    OK(patchify_forward_cuda(d_out, d_img, B, Cin, S, p, 0, err));
    EXPECT_EXACT_BF16(download_bf16(d_out, n), ref, n, "patchify forward");

    CK(cudaMemset(d_out, 0xFF, n * sizeof(bf16)));
    unpatchify_forward(ref, tok0, B, Cin, S, p);
    OK(unpatchify_forward_cuda(d_out, upload_bf16(tok0, n), B, Cin, S, p, 0, err));
    EXPECT_EXACT_BF16(download_bf16(d_out, n), ref, n, "unpatchify forward");

    memcpy(ref, tok0, n * sizeof(float));
    unpatchify_backward(ref, img, B, Cin, S, p);   // dimg = img, accumulated onto tok0
    bf16 *d_dtok = upload_bf16(tok0, n);
    OK(unpatchify_backward_cuda(d_dtok, d_img, B, Cin, S, p, 0, err));
    EXPECT_EXACT_BF16(download_bf16(d_dtok, n), ref, n, "unpatchify backward");
    cr_assert_eq(n, (size_t)B * T * Cin * p * p);
}

// D a multiple of 8: 16-byte vectors; D = 6: element by element.
static void check_heads(int B, int T, int H, int D, uint64_t seed) {
    size_t nh = (size_t)B * T * H * D, nqkv = 3 * nh;
    Rng rng;
    rng_seed(&rng, seed);
    float *qkv = randn_bf16(&rng, nqkv, 1.0f), *g = randn_bf16(&rng, nqkv, 1.0f), *acc0 = randn_bf16(&rng, nqkv, 1.0f);
    float *q = host_floats(nh), *k = host_floats(nh), *v = host_floats(nh);
    split_heads_forward(q, k, v, qkv, B, T, H, D);
    bf16 *d_q = poisoned(nh * sizeof(bf16)), *d_k = poisoned(nh * sizeof(bf16)), *d_v = poisoned(nh * sizeof(bf16));
    OK(split_heads_forward_cuda(d_q, d_k, d_v, upload_bf16(qkv, nqkv), B, T, H, D, 0, err));
    EXPECT_EXACT_BF16(download_bf16(d_q, nh), q, nh, "split_heads forward q");
    EXPECT_EXACT_BF16(download_bf16(d_k, nh), k, nh, "split_heads forward k");
    EXPECT_EXACT_BF16(download_bf16(d_v, nh), v, nh, "split_heads forward v");

    float *dqkv = copy_floats(acc0, nqkv);
    split_heads_backward(dqkv, g, g + nh, g + 2 * nh, B, T, H, D);
    bf16 *d_g = upload_bf16(g, nqkv), *d_dqkv = upload_bf16(acc0, nqkv);
    OK(split_heads_backward_cuda(d_dqkv, d_g, d_g + nh, d_g + 2 * nh, B, T, H, D, 0, err));
    EXPECT_EXACT_BF16(download_bf16(d_dqkv, nqkv), dqkv, nqkv, "split_heads backward");

    float *out = host_floats(nh);
    merge_heads_forward(out, qkv, B, T, H, D);
    bf16 *d_out = poisoned(nh * sizeof(bf16)), *d_o = upload_bf16(qkv, nh);
    OK(merge_heads_forward_cuda(d_out, d_o, B, T, H, D, NULL, 0, err));
    EXPECT_EXACT_BF16(download_bf16(d_out, nh), out, nh, "merge_heads forward");

    float *do_ = copy_floats(acc0, nh);
    merge_heads_backward(do_, g, B, T, H, D);
    bf16 *d_do = upload_bf16(acc0, nh);
    OK(merge_heads_backward_cuda(d_do, d_g, B, T, H, D, 0, err));
    EXPECT_EXACT_BF16(download_bf16(d_do, nh), do_, nh, "merge_heads backward");
}

Test(cuda, split_merge_heads) {
    REQUIRE_GPU();
    check_heads(2, 5, 3, 8, 11);
    check_heads(2, 33, 4, 64, 12);
    check_heads(3, 7, 5, 6, 13);
}

// ---- conditioning ------------------------------------------------------------------------
Test(cuda, conditioning) {
    REQUIRE_GPU();
    int B = 6, C = 40, classes = 4;
    Rng rng;
    rng_seed(&rng, 12);
    float t[6];
    rng_fill_uniform(&rng, t, B, 0.0f, 1.0f);
    float *ref = host_floats((size_t)B * TIMESTEP_FREQ_DIM);
    timestep_embedding_forward(ref, t, B, TIMESTEP_FREQ_DIM);
    bf16 *d_temb = poisoned((size_t)B * TIMESTEP_FREQ_DIM * sizeof(bf16));
    OK(timestep_embedding_forward_cuda(d_temb, upload_f32(t, B), B, TIMESTEP_FREQ_DIM, 0, err));
    EXPECT_CLOSE(download_bf16(d_temb, (size_t)B * TIMESTEP_FREQ_DIM), ref, (size_t)B * TIMESTEP_FREQ_DIM, TOL_BF16,
                 "timestep embedding");

    int labels[6] = {2, 0, 2, 4, 1, 2};   // repeated labels, and the null class 4
    size_t ntab = (size_t)(classes + 1) * C;
    float *table = randn_bf16(&rng, ntab, 1.0f), *dy = randn_bf16(&rng, (size_t)B * C, 1.0f);
    float *dtab0 = randn_bf16(&rng, ntab, 1.0f), *emb = host_floats((size_t)B * C);
    int *d_labels = device_alloc(sizeof labels);
    CK(cudaMemcpy(d_labels, labels, sizeof labels, cudaMemcpyHostToDevice));
    embedding_forward(emb, table, labels, B, C);
    bf16 *d_emb = poisoned((size_t)B * C * sizeof(bf16));
    OK(embedding_forward_cuda(d_emb, upload_bf16(table, ntab), d_labels, B, C, 0, err));
    EXPECT_EXACT_BF16(download_bf16(d_emb, (size_t)B * C), emb, (size_t)B * C, "embedding forward");

    // the same fp32 additions in the same (sample) order: bit-exact
    float *dtab = copy_floats(dtab0, ntab), *d_dtab = upload_f32(dtab0, ntab);
    embedding_backward(dtab, dy, labels, B, C);
    OK(embedding_backward_cuda(d_dtab, upload_bf16(dy, (size_t)B * C), d_labels, B, C, 0, err));
    cr_expect_eq(memcmp(download_f32(d_dtab, ntab), dtab, ntab * sizeof(float)), 0, "embedding backward not bit-exact");

    int G = 6, CP = 64;
    float *pos = host_floats((size_t)G * G * CP);
    pos_embed_2d(pos, G, CP);
    bf16 *d_pos = poisoned((size_t)G * G * CP * sizeof(bf16));
    OK(pos_embed_2d_cuda(d_pos, G, CP, 0, err));
    EXPECT_CLOSE(download_bf16(d_pos, (size_t)G * G * CP), pos, (size_t)G * G * CP, TOL_BF16, "2D sin-cos positions");
}

// ---- loss --------------------------------------------------------------------------------
Test(cuda, flow_matching_loss) {
    REQUIRE_GPU();
    int B = 4, per = 300;
    size_t n = (size_t)B * per;
    Rng rng;
    rng_seed(&rng, 13);
    float t[4];
    rng_fill_uniform(&rng, t, B, 0.0f, 1.0f);
    float *x0 = host_floats(n), *noise = host_floats(n);
    rng_fill_normal(&rng, x0, n, 1.0f);
    rng_fill_normal(&rng, noise, n, 1.0f);
    float *xt = host_floats(n), *v = host_floats(n);
    flow_matching_inputs(xt, v, x0, noise, t, B, per);
    bf16 *d_xt = poisoned(n * sizeof(bf16));
    float *d_v = poisoned(n * sizeof(float));
    OK(flow_matching_inputs_cuda(d_xt, d_v, upload_f32(x0, n), upload_f32(noise, n), upload_f32(t, B), B, per, 0, err));
    EXPECT_CLOSE(download_bf16(d_xt, n), xt, n, TOL_BF16, "flow matching x_t");
    cr_expect_eq(memcmp(download_f32(d_v, n), v, n * sizeof(float)), 0, "v_target = noise - x0 not bit-exact");

    float *pred = randn_bf16(&rng, n, 1.0f), *dpred = host_floats(n);
    float loss = mse_loss_forward_backward(dpred, pred, v, n);
    bf16 *d_dpred = poisoned(n * sizeof(bf16));
    float *d_loss = poisoned(sizeof(float));
    OK(mse_loss_forward_backward_cuda(d_dpred, d_loss, upload_bf16(pred, n), d_v, n, &ctx, 0, err));
    EXPECT_CLOSE(download_f32(d_loss, 1), &loss, 1, TOL_F32, "mse loss");
    EXPECT_CLOSE(download_bf16(d_dpred, n), dpred, n, TOL_BF16, "mse dpred");
}

// ---- optimizer ---------------------------------------------------------------------------
Test(cuda, optimizer) {
    REQUIRE_GPU();
    size_t n = (1u << 20) + 7;
    Rng rng;
    rng_seed(&rng, 14);
    float *g = host_floats(n), *p0 = host_floats(n), *m0 = host_floats(n), *v0 = host_floats(n);
    rng_fill_normal(&rng, g, n, 1e-3f);
    rng_fill_normal(&rng, p0, n, 0.05f);
    rng_fill_normal(&rng, m0, n, 1e-3f);
    for (size_t i = 0; i < n; i++) v0[i] = 1e-6f * (0.1f + rng_uniform(&rng));
    float *d_g = upload_f32(g, n), *d_norm = poisoned(sizeof(float));
    float norm = global_norm(g, n);
    OK(sum_squares_cuda(d_norm, d_g, n, &ctx, 0, err));
    OK(sqrt_cuda(d_norm, d_norm, 0, err));
    EXPECT_CLOSE(download_f32(d_norm, 1), &norm, 1, TOL_F32, "global norm");

    // max_norm below the norm: the clipping scale is active
    float max_norm = 0.5f * norm, lr = 1e-3f;
    float *p = copy_floats(p0, n), *m = copy_floats(m0, n), *v = copy_floats(v0, n);
    adamw_update(p, g, m, v, n, lr, 0.9f, 0.95f, 1e-8f, 0.1f, clip_grad_scale(norm, max_norm), 3);
    float *d_p = upload_f32(p0, n), *d_m = upload_f32(m0, n), *d_v = upload_f32(v0, n);
    bf16 *d_pbf = poisoned(n * sizeof(bf16));
    OptimizerStepConstants k;
    OK(optimizer_step_constants(&k, lr, 0.9f, 0.95f, 3, 0.999f, err));
    const OptimizerStepConstants *d_k = (const OptimizerStepConstants *)upload_f32((const float *)&k, 4);
    float *ema = copy_floats(p0, n), *d_ema = upload_f32(p0, n);
    ema_update(ema, p, n, 0.999f);
    OK(adamw_update_cuda(d_p, d_pbf, d_g, d_m, d_v, d_ema, n, d_k, 0.9f, 0.95f, 1e-8f, 0.1f, d_norm, max_norm, 0, err));
    float *gp = download_f32(d_p, n);
    EXPECT_CLOSE(gp, p, n, TOL_F32, "adamw params");
    EXPECT_CLOSE(download_f32(d_m, n), m, n, TOL_F32, "adamw m");
    EXPECT_CLOSE(download_f32(d_v, n), v, n, TOL_F32, "adamw v");
    EXPECT_EXACT_BF16(download_bf16(d_pbf, n), gp, n, "adamw bf16 copy of the params");
    // the update itself (p - p0) is what AdamW computes: compare it too, not only p ≈ p0
    float *dp_gpu = host_floats(n), *dp_cpu = host_floats(n);
    for (size_t i = 0; i < n; i++) {
        dp_gpu[i] = gp[i] - p0[i];
        dp_cpu[i] = p[i] - p0[i];
    }
    EXPECT_CLOSE(dp_gpu, dp_cpu, n, 1e-3, "adamw update p - p0 (fp32 cancellation)");
    EXPECT_CLOSE(download_f32(d_ema, n), ema, n, TOL_F32, "ema (from the updated params)");
    // the EMA's own step, ema - p0 = (1 - decay)·(p - p0) ~ 1e-6: compared as such, not only
    // ema ≈ p0; one ulp of ema (~4e-9 at |p| ~ 0.05, fma or not) is ~0.4% of it, hence 1e-2
    float *de_gpu = download_f32(d_ema, n);
    for (size_t i = 0; i < n; i++) {
        de_gpu[i] -= p0[i];
        dp_cpu[i] = ema[i] - p0[i];
    }
    EXPECT_CLOSE(de_gpu, dp_cpu, n, 1e-2, "ema step ema - p0 (fp32 cancellation)");

    // a parameter group that starts one element in (not 16-byte aligned): the element-wise path
    size_t n1 = n - 1;
    p = copy_floats(p0, n), m = copy_floats(m0, n), v = copy_floats(v0, n);
    adamw_update(p + 1, g + 1, m + 1, v + 1, n1, lr, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 2);
    d_p = upload_f32(p0, n), d_m = upload_f32(m0, n), d_v = upload_f32(v0, n);
    OK(optimizer_step_constants(&k, lr, 0.9f, 0.95f, 2, 0.99f, err));
    d_k = (const OptimizerStepConstants *)upload_f32((const float *)&k, 4);
    ema = copy_floats(p0, n), d_ema = upload_f32(p0, n);
    ema_update(ema + 1, p + 1, n1, 0.99f);
    OK(adamw_update_cuda(d_p + 1, d_pbf + 1, d_g + 1, d_m + 1, d_v + 1, d_ema + 1, n1, d_k, 0.9f, 0.95f, 1e-8f, 0.1f,
                         NULL, 0.0f, 0, err));
    gp = download_f32(d_p, n);
    EXPECT_CLOSE(gp + 1, p + 1, n1, TOL_F32, "adamw params (unaligned group)");
    EXPECT_CLOSE(download_f32(d_v, n) + 1, v + 1, n1, TOL_F32, "adamw v (unaligned group)");
    EXPECT_EXACT_BF16(download_bf16(d_pbf, n) + 1, gp + 1, n1, "adamw bf16 copy (unaligned group)");
    EXPECT_CLOSE(download_f32(d_ema, n) + 1, ema + 1, n1, TOL_F32, "ema (unaligned)");
    // without an EMA buffer (ema NULL) the params are the same bits
    float *gp_ema = gp;
    d_p = upload_f32(p0, n), d_m = upload_f32(m0, n), d_v = upload_f32(v0, n);
    OK(adamw_update_cuda(d_p + 1, d_pbf + 1, d_g + 1, d_m + 1, d_v + 1, NULL, n1, d_k, 0.9f, 0.95f, 1e-8f, 0.1f, NULL,
                         0.0f, 0, err));
    cr_expect_eq(memcmp(download_f32(d_p, n) + 1, gp_ema + 1, n1 * sizeof(float)), 0,
                 "adamw without an EMA buffer changed the params");
    norm = global_norm(g + 1, n1);
    OK(sum_squares_cuda(d_norm, d_g + 1, n1, &ctx, 0, err));
    OK(sqrt_cuda(d_norm, d_norm, 0, err));
    EXPECT_CLOSE(download_f32(d_norm, 1), &norm, 1, TOL_F32, "global norm (unaligned)");
}

// ---- determinism: the reductions give the same bits when run again ------------------------
Test(cuda, reductions_are_deterministic) {
    REQUIRE_GPU();
    int M = 4096, IC = 64, OC = 96;
    size_t nx = (size_t)M * IC, ny = (size_t)M * OC, nw = (size_t)OC * IC;
    Rng rng;
    rng_seed(&rng, 15);
    bf16 *d_x = upload_bf16(randn_bf16(&rng, nx, 1.0f), nx), *d_dy = upload_bf16(randn_bf16(&rng, ny, 1.0f), ny);
    bf16 *d_w = upload_bf16(randn_bf16(&rng, nw, 0.1f), nw);
    float *d_dw = device_alloc(nw * sizeof(float)), *d_db = device_alloc(OC * sizeof(float));
    float *d_norm = device_alloc(sizeof(float));
    float *first_dw = NULL, *first_db = NULL, *first_norm = NULL;
    for (int run = 0; run < 2; run++) {
        CK(cudaMemset(d_dw, 0, nw * sizeof(float)));
        CK(cudaMemset(d_db, 0, OC * sizeof(float)));
        OK(linear_backward_cuda(NULL, 1.0f, d_dw, 1.0f, d_db, d_dy, d_x, d_w, M, IC, OC, &ctx, 0, err));
        OK(sum_squares_cuda(d_norm, d_dw, nw, &ctx, 0, err));
        OK(sqrt_cuda(d_norm, d_norm, 0, err));
        float *dw = download_f32(d_dw, nw), *db = download_f32(d_db, OC), *norm = download_f32(d_norm, 1);
        if (run == 0) {
            first_dw = dw;
            first_db = db;
            first_norm = norm;
            continue;
        }
        cr_expect_eq(memcmp(dw, first_dw, nw * sizeof(float)), 0, "dweight differs between runs");
        cr_expect_eq(memcmp(db, first_db, OC * sizeof(float)), 0, "dbias differs between runs");
        cr_expect_eq(memcmp(norm, first_norm, sizeof(float)), 0, "global norm differs between runs");
    }
}

// The token sums of dshift, dscale and dgate over one image of 16K tokens (split over many
// blocks, then a second pass) and the gradients next to them give the same bits on every run.
Test(cuda, token_reductions_are_deterministic) {
    REQUIRE_GPU();
    int B = 1, T = 16384, C = 2048, mod_stride = 6 * C;
    size_t n = (size_t)B * T * C, nmod = (size_t)B * mod_stride;
    Rng rng;
    rng_seed(&rng, 16);
    bf16 *d_x = upload_bf16(randn_bf16(&rng, n, 1.0f), n), *d_dy = upload_bf16(randn_bf16(&rng, n, 1.0f), n);
    bf16 *d_mod = upload_bf16(randn_bf16(&rng, nmod, 0.5f), nmod);
    bf16 *d_ln = device_alloc(n * sizeof(bf16)), *d_dx = device_alloc(n * sizeof(bf16));
    bf16 *d_dh = device_alloc(n * sizeof(bf16));
    float *d_mean = device_alloc(T * sizeof(float)), *d_rstd = device_alloc(T * sizeof(float));
    float *d_dmod = device_alloc(nmod * sizeof(float));
    OK(layernorm_modulate_forward_cuda(d_ln, d_mean, d_rstd, d_x, d_mod, d_mod + C, B, T, C, mod_stride, NULL, 0, err));
    float *first_dmod = NULL, *first_dx = NULL, *first_dh = NULL;
    for (int run = 0; run < 2; run++) {
        CK(cudaMemset(d_dmod, 0, nmod * sizeof(float)));
        CK(cudaMemset(d_dx, 0, n * sizeof(bf16)));
        OK(layernorm_modulate_backward_cuda(d_dx, d_dmod, d_dmod + C, d_dy, d_x, d_mean, d_rstd, d_mod + C,
                                            B, T, C, mod_stride, &ctx, 0, err));
        OK(gated_residual_backward_cuda(NULL, d_dh, d_dmod + 2 * C, d_dy, d_ln, d_mod + 2 * C, B, T, C, mod_stride, NULL,
                                        NULL, &ctx, 0, err));
        float *dmod = download_f32(d_dmod, nmod), *dx = download_bf16(d_dx, n), *dh = download_bf16(d_dh, n);
        if (run == 0) {
            first_dmod = dmod;
            first_dx = dx;
            first_dh = dh;
            continue;
        }
        cr_expect_eq(memcmp(dmod, first_dmod, nmod * sizeof(float)), 0, "dshift|dscale|dgate differ between runs");
        cr_expect_eq(memcmp(dx, first_dx, n * sizeof(float)), 0, "dinp differs between runs");
        cr_expect_eq(memcmp(dh, first_dh, n * sizeof(float)), 0, "dh differs between runs");
    }
}

// The split column sums (column_sums_store: the last block of a column tile adds the chunks'
// partials and sets the tile's arrival counter back to 0) over many calls on one context, each with
// new data, all into one bias gradient: a counter left off zero, or a block finishing before another's
// partial is stored, would show as a wrong sum. M = 4096 rows in 64 chunks, OC = 128 (one tile), 64
// calls against the CPU's double sum.
Test(cuda, split_column_sums_over_many_calls) {
    REQUIRE_GPU();
    enum { CALLS = 64 };
    int M = 4096, IC = 16, OC = 128;
    size_t ny = (size_t)M * OC;
    Rng rng;
    rng_seed(&rng, 17);
    float *dy = randn_bf16(&rng, ny * CALLS, 1.0f);
    bf16 *d_dy = upload_bf16(dy, ny * CALLS), *d_x = upload_bf16(randn_bf16(&rng, (size_t)M * IC, 1.0f), (size_t)M * IC);
    bf16 *d_w = upload_bf16(randn_bf16(&rng, (size_t)OC * IC, 0.1f), (size_t)OC * IC);
    float *d_dw = device_alloc((size_t)OC * IC * sizeof(float)), *d_db = device_alloc(OC * sizeof(float));
    CK(cudaMemset(d_db, 0, OC * sizeof(float)));
    for (int k = 0; k < CALLS; k++)
        OK(linear_backward_cuda(NULL, 1.0f, d_dw, 0.0f, d_db, d_dy + k * ny, d_x, d_w, M, IC, OC, &ctx, 0, err));
    float *db = download_f32(d_db, OC), *ref = host_floats(OC);
    for (int o = 0; o < OC; o++) {
        double sum = 0;
        for (size_t r = 0; r < (size_t)M * CALLS; r++) sum += dy[r * OC + o];
        ref[o] = (float)sum;
    }
    EXPECT_CLOSE(db, ref, OC, TOL_F32, "dbias summed over 64 calls of 64 chunks");
}
