// Tests of the FP8 linear layer (layers/linear_fp8_cuda.h):
// - the quantization kernel bit-exact against the CPU definition (layers/fp8.h, round_to_e4m3 /
//   round_to_e5m2): the same scale, the same fp8 value for every element, row-major and transposed,
//   and the transposed copy's pad columns (rows not a multiple of 16) zero; likewise with a guessed
//   exponent (right, one off either way, far off), which must end as the right one, the amax taken
//   exact;
// - forward and backward, and the MLP's forward+GELU / backward+dGELU, against the CPU FP8
//   definition (linear_fp8_forward / _backward, gelu_forward / _backward), the backward through the
//   copy of inp the forward saved (checked bit-exact as above), at M multiples of 16 and not (97, 1,
//   4091: the workspace poisoned first, so that a pad left unwritten turns dweight into NaN): the
//   products are the same exact fp8 products, only the fp32 summation order and the bf16 output
//   rounding differ (TOL_OUT 5e-3 for bf16 outputs, TOL_GEMM_F32 1e-3 for the fp32 weight
//   gradient's increment, TOL_F32 1e-5 for dbias);
// - against the bf16 linear layer at config c's IC × OC (M = 4096 tokens) on realistic operands
//   (test/linear_fp8_data.h): rel L2 and cosine logged, bounded at 1.6× the CPU model's error
//   (dev/notes_linear_fp8.md: out 0.038, dinp/dW 0.059 with e5m2 gradients, 0.038 with e4m3);
// - fc2 reading GELU(pre_gelu) recomputed by its quantization against a stored GELU output:
//   bitwise the same out, saved inpᵀ and scale, with its own amax passes, given ones, or guessed
//   exponents (wrong, then right); a bias gradient taken in the pass that writes the
//   dout (the dGELU's, the gated residual's dh) against a separate dbias pass: bitwise the same;
// - fast accumulation (ctx.fp8_accumulation): each GEMM a level sets fast near the CPU definition
//   and not bitwise the promoting one, the others bitwise unchanged;
// - the weight's transpose kept by the forward and read by the backwards: bit-exact, and the same
//   gradients as the backwards quantizing the weight themselves, and as the backward from a dout
//   quantized beforehand (linear_fp8_backward_quantized_cuda);
// - the douts quantized by their producers (the dGELU, the gated residual's dh) byte for byte against
//   the bf16 pass and the CPU quantization at the exponent the headroom rule gives, their bias
//   gradients bitwise a separate pass's;
// - the argument checks (no GPU needed).
// GPU tests skip when no CUDA GPU is found. Outputs a call writes are poisoned first (0xFF bytes).
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>
#include "attention/attention.h"
#include "layers/common.h"
#include "layers/layers.h"
#include "layers/linear_fp8_cuda.h"
#include "test/compare.h"
#include "test/cuda_test.h"
#include "test/fp8_codes_test.h"
#include "test/linear_fp8_data.h"

#define TOL_OUT 5e-3
#define TOL_GEMM_F32 1e-3
#define TOL_F32 1e-5

static LayersCuda ctx;
static char err[DIT_ERR_LEN];
static void *workspace;
static size_t workspace_bytes;

// N(0, std²) rounded to bf16.
static float *randn_bf16(Rng *rng, size_t n, float std) {
    float *x = host_floats(n);
    rng_fill_normal(rng, x, n, std);
    for (size_t i = 0; i < n; i++) x[i] = fp8_data_bf16(x[i]);
    return x;
}

// max |x| (NaN skipped, as the GPU's fmaxf)
static float host_amax(const float *x, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    return m;
}

static void *zeroed(size_t bytes) {
    void *d = device_alloc(bytes);
    CK(cudaMemset(d, 0, bytes));
    return d;
}

static int *upload_i32(const int *x, size_t n) {
    int *d = device_alloc(n * sizeof(int));
    CK(cudaMemcpy(d, x, n * sizeof(int), cudaMemcpyHostToDevice));
    return d;
}

// The value of an fp8 byte in the given format.
static float fp8_value(uint8_t b, Fp8Format format) { return format == FP8_E4M3 ? e4m3_decode(b) : e5m2_decode(b); }

static void setup(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return;   // the test skips
    cr_assert_eq(layers_cuda_create(&ctx, 1u << 22, err), 0, "layers_cuda_create: %s", err);
    workspace_bytes = linear_fp8_workspace_bytes(4096, 2048, 8192);
    cr_assert_eq(cudaMalloc(&workspace, workspace_bytes), cudaSuccess, "workspace of %zu bytes", workspace_bytes);
}

static void teardown(void) {
    free_buffers();
    cudaFree(workspace);
    workspace = NULL;
    if (ctx.lt) layers_cuda_destroy(&ctx);
}

TestSuite(linear_fp8, .init = setup, .fini = teardown);

// ---- quantization: bit-exact ---------------------------------------------------------------

// The device copies of x (R, C) against the CPU's quantization with the scale 2^e: d_scale equal to
// it, every byte of d_q (R, C) (may be NULL) and d_qt (C, Rp) worth the CPU's value, qt's pad columns 0.
static void expect_quantized_at(const uint8_t *d_q, const uint8_t *d_qt, const float *d_scale, const float *x, int R,
                                int C, Fp8Format format, int e, const char *name) {
    size_t n = (size_t)R * C, Rp = fp8_padded_rows(R), nt = (size_t)C * Rp;
    float *ref = host_floats(n), scale, ref_scale = ldexpf(1.0f, e);
    for (size_t i = 0; i < n; i++) {
        float v = x[i] * ldexpf(1.0f, -e);
        ref[i] = (format == FP8_E4M3 ? round_to_e4m3(v) : round_to_e5m2(v)) * ref_scale;
    }
    uint8_t *q = host_alloc(n), *qt = host_alloc(nt);
    CK(cudaDeviceSynchronize());
    if (d_q) CK(cudaMemcpy(q, d_q, n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(qt, d_qt, nt, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&scale, d_scale, sizeof scale, cudaMemcpyDeviceToHost));
    cr_expect_eq(scale, ref_scale, "%s R=%d C=%d format %d: scale %g, CPU %g", name, R, C, (int)format, scale,
                 ref_scale);
    size_t bad = 0, bad_t = 0, bad_pad = 0, first = n;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            size_t i = (size_t)r * C + c;
            int wrong = d_q && fp8_value(q[i], format) * ref_scale != ref[i];
            bad += wrong;
            bad_t += fp8_value(qt[(size_t)c * Rp + r], format) * ref_scale != ref[i];
            if (wrong && first == n) first = i;
        }
    for (int c = 0; c < C; c++)
        for (size_t r = R; r < Rp; r++) bad_pad += qt[(size_t)c * Rp + r] != 0;
    cr_log_info("%s R=%d C=%d format %d: scale %g, %zu + %zu elements differ, %zu pad bytes not 0", name, R, C,
                (int)format, scale, bad, bad_t, bad_pad);
    cr_expect_eq(bad, 0, "%s R=%d C=%d format %d: %zu of %zu q differ (first at %zu: x %g, gpu %g, cpu %g)", name,
                 R, C, (int)format, bad, n, first, first < n ? x[first] : 0.0f,
                 first < n ? fp8_value(q[first], format) * ref_scale : 0.0f, first < n ? ref[first] : 0.0f);
    cr_expect_eq(bad_t, 0, "%s R=%d C=%d format %d: %zu of %zu qt differ", name, R, C, (int)format, bad_t, n);
    cr_expect_eq(bad_pad, 0, "%s R=%d C=%d: %zu of qt's %zu pad bytes are not 0", name, R, C, bad_pad,
                 (size_t)C * (Rp - R));
}

// expect_quantized_at with current scaling's exponent (of max |x|): fp8_fake_quantize's values.
static void expect_quantized(const uint8_t *d_q, const uint8_t *d_qt, const float *d_scale, const float *x, int R,
                             int C, Fp8Format format, const char *name) {
    expect_quantized_at(d_q, d_qt, d_scale, x, R, C, format, fp8_scale_exponent(host_amax(x, (size_t)R * C), format),
                        name);
}

// After a guessed quantization: the amax it took equal to the true one (d_amax) and the guess
// replaced by that amax's exponent.
static void expect_guess_outcome(const int *d_exponent, const float *d_taken, const float *d_amax, Fp8Format format,
                                 const char *what) {
    int exponent;
    float taken, amax;
    CK(cudaMemcpy(&exponent, d_exponent, sizeof exponent, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&taken, d_taken, sizeof taken, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&amax, d_amax, sizeof amax, cudaMemcpyDeviceToHost));
    cr_expect_eq(taken, amax, "%s: amax taken %g, true %g", what, taken, amax);
    cr_expect_eq(exponent, fp8_scale_exponent(amax, format), "%s: next guess %d, want %d", what, exponent,
                 fp8_scale_exponent(amax, format));
}

// x (R, C) with magnitudes spread over ~e^±8 below amax (normal, subnormal and zero fp8 values),
// one element set to -amax so that the scale's exponent is known; outputs poisoned.
static void check_quantize(int R, int C, Fp8Format format, float amax, uint64_t seed) {
    Rng rng;
    rng_seed(&rng, seed);
    size_t n = (size_t)R * C;
    float *x = host_floats(n), largest = 0.0f;
    for (size_t i = 0; i < n; i++) {
        x[i] = rng_normal(&rng) * expf(2.0f * rng_normal(&rng));
        largest = fmaxf(largest, fabsf(x[i]));
    }
    for (size_t i = 0; i < n; i++) x[i] = fp8_data_bf16(x[i] * (amax / largest));
    x[n / 3] = fp8_data_bf16(-amax);
    uint8_t *d_q = poisoned(n), *d_qt = poisoned((size_t)C * fp8_padded_rows(R));
    float *d_scale = poisoned(sizeof(float)), *d_amax = poisoned(sizeof(float));
    OK(fp8_quantize_cuda(d_q, d_qt, d_scale, upload_bf16(x, n), R, C, format, d_amax, 0, err));
    expect_quantized(d_q, d_qt, d_scale, x, R, C, format, "fp8_quantize_cuda");
    uint8_t *d_qt_only = poisoned((size_t)C * fp8_padded_rows(R));   // the transposed copy alone
    OK(fp8_quantize_cuda(NULL, d_qt_only, d_scale, upload_bf16(x, n), R, C, format, d_amax, 0, err));
    expect_quantized(NULL, d_qt_only, d_scale, x, R, C, format, "fp8_quantize_cuda (qt only)");
    // guessed: the right exponent, one off either way, far off (the bytes must not depend on it)
    float x_amax = host_amax(x, n);
    int right = fp8_scale_exponent(x_amax, format), guesses[4] = {right, right - 1, right + 1, right - 40};
    float *d_x_amax = upload_f32(&x_amax, 1);
    for (int g = 0; g < 4; g++) {
        int state[2] = {guesses[g], 12345};   // [1]: scratch, written before it is read
        int *d_exponent = upload_i32(state, 2);
        float *d_taken = zeroed(sizeof(float));
        uint8_t *d_gq = poisoned(n), *d_gqt = poisoned((size_t)C * fp8_padded_rows(R));
        char what[64];
        snprintf(what, sizeof what, "fp8_quantize_guessed_cuda (guess %+d)", guesses[g] - right);
        OK(fp8_quantize_guessed_cuda(d_gq, d_gqt, d_scale, upload_bf16(x, n), R, C, format, d_exponent, d_taken, 0,
                                     err));
        expect_quantized(d_gq, d_gqt, d_scale, x, R, C, format, what);
        expect_guess_outcome(d_exponent, d_taken, d_x_amax, format, what);
    }
}

Test(linear_fp8, quantize_matches_cpu) {
    REQUIRE_GPU();
    check_quantize(48, 80, FP8_E4M3, 3.0f, 1);       // partial tiles in both directions: scale 2^-7
    check_quantize(48, 80, FP8_E5M2, 3.0f, 2);       // 2^-14
    check_quantize(192, 128, FP8_E4M3, 450.0f, 3);   // amax just above 448: scale 2
    check_quantize(192, 128, FP8_E4M3, 448.0f, 4);   // amax = 448: scale 1
    check_quantize(192, 128, FP8_E5M2, 1e-3f, 5);    // 2^-25
    check_quantize(45, 80, FP8_E4M3, 3.0f, 6);       // rows not a multiple of 16: qt (80, 48), 3 pad columns
    check_quantize(131, 32, FP8_E5M2, 3.0f, 7);      // 13 pad columns, in a third row tile
    check_quantize(1, 16, FP8_E4M3, 3.0f, 8);        // one row: 15 pad columns
    check_quantize(300, 208, FP8_E4M3, 5.0f, 9);     // three 128-row tiles (the last with 44 rows), 16 columns in the last
    check_quantize(129, 64, FP8_E5M2, 0.7f, 10);     // one row in a second tile: 15 pad columns there
    check_quantize(4100, 1024, FP8_E4M3, 7.0f, 11);  // 528 tiles: a wrong guess's re-quantization loops (264 blocks)
}

// ---- against the CPU FP8 definition --------------------------------------------------------

// A poisoned place for the forward's copy of inp (M, IC): qt (IC, Mp) and the scale.
static Fp8Saved poisoned_saved(int M, int IC) {
    Fp8Saved saved = {poisoned((size_t)IC * fp8_padded_rows(M)), poisoned(sizeof(float))};
    return saved;
}

static void check_against_cpu(int M, int IC, int OC, Fp8Format grad_format, uint64_t seed) {
    Rng rng;
    rng_seed(&rng, seed);
    size_t nx = (size_t)M * IC, nw = (size_t)OC * IC, ny = (size_t)M * OC;
    float *x = randn_bf16(&rng, nx, 1.0f), *w = randn_bf16(&rng, nw, 0.05f), *b = randn_bf16(&rng, OC, 0.1f);
    float *dy = randn_bf16(&rng, ny, 1e-3f);
    bf16 *d_x = upload_bf16(x, nx), *d_w = upload_bf16(w, nw), *d_b = upload_bf16(b, OC), *d_dy = upload_bf16(dy, ny);
    char name[128];
    // NaN patterns (0xFF in e4m3 and e5m2) wherever a copy's pad could be read unwritten
    CK(cudaMemset(workspace, 0xFF, workspace_bytes));
    Fp8Saved saved = poisoned_saved(M, IC);

    // with bias, keeping inp's copy (its bytes and scale: the CPU's quantization of x), and without
    float *y_ref = host_floats(ny);
    linear_fp8_forward(y_ref, x, w, b, M, IC, OC);
    bf16 *d_y = poisoned(ny * sizeof(bf16));
    OK(linear_fp8_forward_cuda(d_y, d_x, d_w, d_b, M, IC, OC, &saved, NULL, NULL, NULL, workspace, workspace_bytes,
                               &ctx, 0, err));
    snprintf(name, sizeof name, "fp8 forward M=%d IC=%d OC=%d", M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_y, ny), y_ref, ny, TOL_OUT, name);
    expect_quantized(NULL, saved.qt, saved.scale, x, M, IC, FP8_E4M3, "the forward's saved inp");
    linear_fp8_forward(y_ref, x, w, NULL, M, IC, OC);
    OK(linear_fp8_forward_cuda(d_y, d_x, d_w, NULL, M, IC, OC, NULL, NULL, NULL, NULL, workspace, workspace_bytes, &ctx,
                               0, err));
    snprintf(name, sizeof name, "fp8 forward (no bias) M=%d IC=%d OC=%d", M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_y, ny), y_ref, ny, TOL_OUT, name);

    // the increments on the CPU (dbias from a random start), then dinp, dweight starting from
    // random values of about the increments' size; dweight is compared by its increment
    float *dx_inc = host_floats(nx), *dw_inc = host_floats(nw);
    float *db0 = randn_bf16(&rng, OC, 1.0f), *db = copy_floats(db0, OC);
    linear_fp8_backward(dx_inc, dw_inc, db, dy, x, w, M, IC, OC, grad_format);
    float *dx0 = randn_bf16(&rng, nx, 3e-4f), *dw0 = host_floats(nw), *dx = copy_floats(dx0, nx);
    rng_fill_normal(&rng, dw0, nw, 1e-3f);
    for (size_t i = 0; i < nx; i++) dx[i] += dx_inc[i];
    bf16 *d_dx = upload_bf16(dx0, nx);
    float *d_dw = upload_f32(dw0, nw), *d_db = upload_f32(db0, OC);
    OK(linear_fp8_backward_cuda(d_dx, 1.0f, d_dw, 1.0f, d_db, d_dy, &saved, d_w, NULL, M, IC, OC, grad_format, NULL,
                                NULL, workspace, workspace_bytes, &ctx, 0, err));
    const char *g = grad_format == FP8_E4M3 ? "e4m3" : "e5m2";
    snprintf(name, sizeof name, "fp8 backward (%s) dinp M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_dx, nx), dx, nx, TOL_OUT, name);
    float *dw = download_f32(d_dw, nw);
    for (size_t i = 0; i < nw; i++) dw[i] -= dw0[i];
    snprintf(name, sizeof name, "fp8 backward (%s) dweight increment M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(dw, dw_inc, nw, TOL_GEMM_F32, name);
    snprintf(name, sizeof name, "fp8 backward (%s) dbias M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(download_f32(d_db, OC), db, OC, TOL_F32, name);

    // dinp_beta 0 writes dinp (poisoned first: NaN if it were read): the increment alone
    CK(cudaMemset(d_dx, 0xFF, nx * sizeof(bf16)));
    OK(linear_fp8_backward_cuda(d_dx, 0.0f, d_dw, 1.0f, NULL, d_dy, &saved, d_w, NULL, M, IC, OC, grad_format, NULL,
                                NULL, workspace, workspace_bytes, &ctx, 0, err));   // (d_dw is reset below)
    snprintf(name, sizeof name, "fp8 backward (%s) dinp written (beta 0) M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_dx, nx), dx_inc, nx, TOL_OUT, name);

    // without dinp and dbias: the dweight path alone
    CK(cudaMemcpy(d_dw, dw0, nw * sizeof(float), cudaMemcpyHostToDevice));
    OK(linear_fp8_backward_cuda(NULL, 1.0f, d_dw, 1.0f, NULL, d_dy, &saved, d_w, NULL, M, IC, OC, grad_format, NULL,
                                NULL, workspace, workspace_bytes, &ctx, 0, err));
    dw = download_f32(d_dw, nw);
    for (size_t i = 0; i < nw; i++) dw[i] -= dw0[i];
    snprintf(name, sizeof name, "fp8 backward (%s, dweight only) M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(dw, dw_inc, nw, TOL_GEMM_F32, name);

    // dweight_beta 0 writes dweight: bitwise the sum into zeros (the written one poisoned first)
    CK(cudaMemset(d_dw, 0, nw * sizeof(float)));
    OK(linear_fp8_backward_cuda(NULL, 1.0f, d_dw, 1.0f, NULL, d_dy, &saved, d_w, NULL, M, IC, OC, grad_format, NULL,
                                NULL, workspace, workspace_bytes, &ctx, 0, err));
    float *into_zeros = download_f32(d_dw, nw);
    CK(cudaMemset(d_dw, 0xFF, nw * sizeof(float)));
    OK(linear_fp8_backward_cuda(NULL, 1.0f, d_dw, 0.0f, NULL, d_dy, &saved, d_w, NULL, M, IC, OC, grad_format, NULL,
                                NULL, workspace, workspace_bytes, &ctx, 0, err));
    cr_expect_eq(memcmp(download_f32(d_dw, nw), into_zeros, nw * sizeof(float)), 0,
                 "fp8 backward (%s) dweight written (beta 0) M=%d IC=%d OC=%d: not bitwise the sum into zeros", g, M,
                 IC, OC);

    // the MLP's layers: forward with GELU (pre_gelu and inp's copy kept), backward with dGELU (dpre
    // written over poison) against the CPU definition followed by gelu_forward / gelu_backward
    float *act_ref = host_floats(ny);
    linear_fp8_forward(y_ref, x, w, b, M, IC, OC);
    gelu_forward(act_ref, y_ref, ny);
    bf16 *d_act = poisoned(ny * sizeof(bf16));
    CK(cudaMemset(d_y, 0xFF, ny * sizeof(bf16)));
    Fp8Saved saved_gelu = poisoned_saved(M, IC);
    OK(linear_fp8_gelu_forward_cuda(d_act, d_y, d_x, d_w, d_b, M, IC, OC, &saved_gelu, NULL, NULL, NULL, NULL,
                                    workspace, workspace_bytes, &ctx, 0, err));
    snprintf(name, sizeof name, "fp8 forward+GELU pre-activation M=%d IC=%d OC=%d", M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_y, ny), y_ref, ny, TOL_OUT, name);
    snprintf(name, sizeof name, "fp8 forward+GELU output M=%d IC=%d OC=%d", M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_act, ny), act_ref, ny, TOL_OUT, name);
    float *pre = randn_bf16(&rng, nx, 1.0f), *dpre_ref = host_floats(nx);
    float *dx_only = host_floats(nx), *dw_unused = host_floats(nw);
    linear_fp8_backward(dx_only, dw_unused, NULL, dy, x, w, M, IC, OC, grad_format);
    gelu_backward(dpre_ref, pre, dx_only, nx);
    bf16 *d_dpre = poisoned(nx * sizeof(bf16));
    CK(cudaMemcpy(d_dw, dw0, nw * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_db, db0, OC * sizeof(float), cudaMemcpyHostToDevice));
    OK(linear_fp8_dgelu_backward_cuda(d_dpre, d_dw, 1.0f, d_db, d_dy, &saved_gelu, upload_bf16(pre, nx), d_w, NULL, M,
                                      IC, OC, grad_format, NULL, NULL, NULL, NULL, workspace, workspace_bytes, &ctx, 0,
                                      err));
    snprintf(name, sizeof name, "fp8 backward+dGELU (%s) dpre M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_dpre, nx), dpre_ref, nx, TOL_OUT, name);
    dw = download_f32(d_dw, nw);
    for (size_t i = 0; i < nw; i++) dw[i] -= dw0[i];
    snprintf(name, sizeof name, "fp8 backward+dGELU (%s) dweight increment M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(dw, dw_inc, nw, TOL_GEMM_F32, name);
    snprintf(name, sizeof name, "fp8 backward+dGELU (%s) dbias M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(download_f32(d_db, OC), db, OC, TOL_F32, name);
}

Test(linear_fp8, matches_cpu_definition) {
    REQUIRE_GPU();
    check_against_cpu(96, 128, 80, FP8_E5M2, 11);
    check_against_cpu(96, 128, 80, FP8_E4M3, 12);
    check_against_cpu(512, 64, 192, FP8_E5M2, 13);
    check_against_cpu(272, 336, 48, FP8_E4M3, 14);
}

// With GEMM tuning (layers_cuda_set_gemm_tuning): the FP8 GEMMs, promoted and fast, at their first
// call (timed; dinp and dweight accumulate, so D is put back before the real call) and their second.
Test(linear_fp8, matches_cpu_definition_with_gemm_tuning) {
    REQUIRE_GPU();
    OK(layers_cuda_set_gemm_tuning(&ctx, 1, err));
    for (int round = 0; round < 2; round++) {
        ctx.fp8_accumulation = round == 0 ? FP8_ACCUM_PROMOTED : FP8_ACCUM_FAST_ALL;
        check_against_cpu(1024, 512, 768, FP8_E4M3, 18);
        check_against_cpu(1024, 512, 768, FP8_E4M3, 18);
    }
    ctx.fp8_accumulation = FP8_ACCUM_PROMOTED;
    OK(layers_cuda_set_gemm_tuning(&ctx, 0, err));
}

// M not a multiple of 16: inpᵀ and doutᵀ padded to Mp (112, 16, 4096) with zeros (a test of its
// own: each test's buffers are freed at its end, and one test with all seven shapes ran out of
// host-buffer slots on the GPU)
Test(linear_fp8, matches_cpu_definition_any_token_count) {
    REQUIRE_GPU();
    check_against_cpu(97, 128, 80, FP8_E4M3, 15);
    check_against_cpu(1, 64, 48, FP8_E5M2, 16);
    check_against_cpu(4091, 64, 32, FP8_E4M3, 17);
}

// ---- against the bf16 linear at DiT shapes -------------------------------------------------

static void expect_near_bf16(const float *x, const float *ref, size_t n, double max_rel, const char *name) {
    double r = rel_l2(x, ref, n), c = cosine(x, ref, n);
    cr_log_info("%s: rel L2 %.4f cosine %.6f (bounds %.3f, %.4f)", name, r, c, max_rel, 1 - max_rel * max_rel);
    cr_expect(r <= max_rel, "%s: rel L2 %.4f > %.3f", name, r, max_rel);
    cr_expect(c >= 1 - max_rel * max_rel, "%s: cosine %.6f < %.6f", name, c, 1 - max_rel * max_rel);
}

Test(linear_fp8, near_bf16_linear_at_dit_shapes) {
    REQUIRE_GPU();
    const int M = 4096, h = 2048;
    struct { const char *name; int IC, OC; Fp8DataKind kind; } layers[] = {
        {"qkv", h, 3 * h, FP8_DATA_MODULATED}, {"proj", h, h, FP8_DATA_ATTENTION},
        {"fc1", h, 4 * h, FP8_DATA_MODULATED}, {"fc2", 4 * h, h, FP8_DATA_GELU},
    };
    for (int l = 0; l < 4; l++) {
        int IC = layers[l].IC, OC = layers[l].OC;
        size_t nx = (size_t)M * IC, nw = (size_t)OC * IC, ny = (size_t)M * OC;
        Rng rng;
        rng_seed(&rng, 100 + l);
        float *x = host_floats(nx), *w = host_floats(nw), *dy = host_floats(ny);
        fp8_data_input(&rng, x, M, IC, layers[l].kind);
        fp8_data_weight(&rng, w, IC, OC);
        fp8_data_dout(&rng, dy, M, OC, 1.0f);
        float *b = randn_bf16(&rng, OC, 0.02f);
        bf16 *d_x = upload_bf16(x, nx), *d_w = upload_bf16(w, nw), *d_b = upload_bf16(b, OC), *d_dy = upload_bf16(dy, ny);
        bf16 *d_y = poisoned(ny * sizeof(bf16)), *d_dx = device_alloc(nx * sizeof(bf16));
        float *d_dw = device_alloc(nw * sizeof(float));
        Fp8Saved saved = poisoned_saved(M, IC);
        char name[96];

        OK(linear_forward_cuda(d_y, d_x, d_w, d_b, M, IC, OC, &ctx, 0, err));
        float *y_ref = download_bf16(d_y, ny);
        CK(cudaMemset(d_y, 0xFF, ny * sizeof(bf16)));
        OK(linear_fp8_forward_cuda(d_y, d_x, d_w, d_b, M, IC, OC, &saved, NULL, NULL, NULL, workspace, workspace_bytes,
                                   &ctx, 0, err));
        snprintf(name, sizeof name, "%s out (M=%d IC=%d OC=%d)", layers[l].name, M, IC, OC);
        expect_near_bf16(download_bf16(d_y, ny), y_ref, ny, 0.06, name);

        CK(cudaMemset(d_dx, 0, nx * sizeof(bf16)));
        CK(cudaMemset(d_dw, 0, nw * sizeof(float)));
        OK(linear_backward_cuda(d_dx, 1.0f, d_dw, 1.0f, NULL, d_dy, d_x, d_w, M, IC, OC, &ctx, 0, err));
        float *dx_ref = download_bf16(d_dx, nx), *dw_ref = download_f32(d_dw, nw);
        for (int f = 0; f < 2; f++) {
            Fp8Format grad = f == 0 ? FP8_E5M2 : FP8_E4M3;
            double bound = grad == FP8_E5M2 ? 0.095 : 0.06;
            CK(cudaMemset(d_dx, 0, nx * sizeof(bf16)));
            CK(cudaMemset(d_dw, 0, nw * sizeof(float)));
            OK(linear_fp8_backward_cuda(d_dx, 1.0f, d_dw, 1.0f, NULL, d_dy, &saved, d_w, NULL, M, IC, OC, grad, NULL,
                                        NULL, workspace, workspace_bytes, &ctx, 0, err));
            snprintf(name, sizeof name, "%s dinp (%s)", layers[l].name, f == 0 ? "e5m2" : "e4m3");
            expect_near_bf16(download_bf16(d_dx, nx), dx_ref, nx, bound, name);
            snprintf(name, sizeof name, "%s dweight (%s)", layers[l].name, f == 0 ? "e5m2" : "e4m3");
            expect_near_bf16(download_f32(d_dw, nw), dw_ref, nw, bound, name);
        }
    }
}

// ctx.fp8_accumulation: each level against the CPU definition (the same fp8 products summed in
// fp32), on realistic operands at config c's qkv (IC 2048, dinp's k = OC 6144) and fc2 (IC 8192)
// with M = 256, and at M = 16384 tokens (dweight's k, as at 16K tokens) with IC = OC = 256 (the
// error depends on the sums' length, not on the matrix sizes). Logged per level and GEMM: rel L2
// and the systematic scale Σ y·ref / Σ ref² − 1 (< 0: the sums shrink). Bounds: a GEMM in fast
// mode gives other bits than promoted (the switch reaches cuBLASLt) and adds at most
// TOL_FAST_ACCUM of rel L2 to the promoted one's (against the FP8 quantization's own ~0.04 from the
// bf16 layer); a GEMM the level leaves promoted gives the promoted bits.
#define TOL_FAST_ACCUM 5e-3
static void expect_accumulation(const char *layer, const char *gemm, int fast, const float *y, const float *promoted,
                                const float *ref, size_t n) {
    double e = rel_l2(y, ref, n), e_promoted = rel_l2(promoted, ref, n), yr = 0, rr = 0;
    size_t differ = 0;
    for (size_t i = 0; i < n; i++) {
        yr += (double)y[i] * ref[i];
        rr += (double)ref[i] * ref[i];
        differ += y[i] != promoted[i];
    }
    cr_log_info("%s %s %s: rel L2 %.2e (promoted %.2e), scale %+.2e, %zu of %zu values differ from promoted",
                layer, gemm, fast ? "fast" : "promoted", e, e_promoted, yr / rr - 1, differ, n);
    if (fast) {
        cr_expect(differ > 0, "%s %s: fast mode gave the promoted bits: FAST_ACCUM not set?", layer, gemm);
        cr_expect(e <= e_promoted + TOL_FAST_ACCUM, "%s %s: fast rel L2 %.2e > %.2e + %.0e", layer, gemm, e,
                  e_promoted, TOL_FAST_ACCUM);
    } else {
        cr_expect(differ == 0, "%s %s: %zu values differ from promoted in a promoting level", layer, gemm, differ);
    }
}

Test(linear_fp8, fast_accumulation_levels) {
    REQUIRE_GPU();
    const int h = 2048;
    struct { const char *name; int M, IC, OC; Fp8DataKind kind; } layers[] = {
        {"qkv", 256, h, 3 * h, FP8_DATA_MODULATED}, {"fc2", 256, 4 * h, h, FP8_DATA_GELU},
        {"16K tokens", 16384, 256, 256, FP8_DATA_MODULATED},
    };
    for (int l = 0; l < 3; l++) {
        int M = layers[l].M, IC = layers[l].IC, OC = layers[l].OC;
        size_t nx = (size_t)M * IC, nw = (size_t)OC * IC, ny = (size_t)M * OC;
        Rng rng;
        rng_seed(&rng, 200 + l);
        float *x = host_floats(nx), *w = host_floats(nw), *dy = host_floats(ny);
        float *y_ref = host_floats(ny), *dx_ref = host_floats(nx), *dw_ref = host_floats(nw), *db = host_floats(OC);
        fp8_data_input(&rng, x, M, IC, layers[l].kind);
        fp8_data_weight(&rng, w, IC, OC);
        fp8_data_dout(&rng, dy, M, OC, 1.0f);
        float *b = randn_bf16(&rng, OC, 0.02f);
        linear_fp8_forward(y_ref, x, w, b, M, IC, OC);
        linear_fp8_backward(dx_ref, dw_ref, db, dy, x, w, M, IC, OC, FP8_E4M3);
        bf16 *d_x = upload_bf16(x, nx), *d_w = upload_bf16(w, nw), *d_b = upload_bf16(b, OC), *d_dy = upload_bf16(dy, ny);
        float *y[3], *dx[3], *dw[3];
        Fp8Accumulation levels[3] = {FP8_ACCUM_PROMOTED, FP8_ACCUM_FAST_FORWARD, FP8_ACCUM_FAST_ALL};
        for (int k = 0; k < 3; k++) {
            bf16 *d_y = poisoned(ny * sizeof(bf16)), *d_dx = poisoned(nx * sizeof(bf16));
            float *d_dw = poisoned(nw * sizeof(float));
            Fp8Saved saved = poisoned_saved(M, IC);
            ctx.fp8_accumulation = levels[k];
            int rc = linear_fp8_forward_cuda(d_y, d_x, d_w, d_b, M, IC, OC, &saved, NULL, NULL, NULL, workspace,
                                             workspace_bytes, &ctx, 0, err);
            if (rc == 0)
                rc = linear_fp8_backward_cuda(d_dx, 0.0f, d_dw, 0.0f, NULL, d_dy, &saved, d_w, NULL, M, IC, OC,
                                              FP8_E4M3, NULL, NULL, workspace, workspace_bytes, &ctx, 0, err);
            ctx.fp8_accumulation = FP8_ACCUM_PROMOTED;
            cr_assert_eq(rc, 0, "%s", err);
            y[k] = download_bf16(d_y, ny);
            dx[k] = download_bf16(d_dx, nx);
            dw[k] = download_f32(d_dw, nw);
        }
        const char *name = layers[l].name;
        for (int k = 1; k < 3; k++) {
            cr_log_info("%s (M=%d IC=%d OC=%d), level %s:", name, M, IC, OC, k == 1 ? "FAST_FORWARD" : "FAST_ALL");
            expect_accumulation(name, "out", 1, y[k], y[0], y_ref, ny);
            expect_accumulation(name, "dinp", k == 2, dx[k], dx[0], dx_ref, nx);
            expect_accumulation(name, "dweight", k == 2, dw[k], dw[0], dw_ref, nw);
        }
    }
}

// ---- argument checks (no GPU needed: they fail before any CUDA call) -----------------------

Test(linear_fp8, rejects_bad_arguments) {
    LayersCuda fake = {.scratch = (float *)256, .scratch_floats = 1, .tile_counters = (unsigned *)256};
    bf16 *p = (bf16 *)4096;
    void *ws = (void *)8192;
    Fp8Saved saved = {(uint8_t *)4096, (float *)4352}, misaligned = {(uint8_t *)4104, (float *)4352};
    size_t need = linear_fp8_workspace_bytes(64, 64, 64);
    cr_expect_eq(linear_fp8_forward_cuda(p, p, p, NULL, 64, 100, 64, NULL, NULL, NULL, NULL, ws, need, &fake, 0,
                                         err), -1);
    cr_expect(strstr(err, "linear_fp8_forward_cuda") && strstr(err, "multiples of 16"), "message: %s", err);
    cr_expect_eq(linear_fp8_forward_cuda(p, p, p, NULL, 0, 64, 64, NULL, NULL, NULL, NULL, ws, need, &fake, 0,
                                         err), -1);
    cr_expect(strstr(err, "M >= 1"), "message: %s", err);
    cr_expect_eq(linear_fp8_forward_cuda(p, p, p, NULL, 64, 64, 64, NULL, NULL, NULL, NULL, ws, need - 1, &fake, 0,
                                         err), -1);
    cr_expect(strstr(err, "workspace"), "message: %s", err);
    cr_expect_eq(linear_fp8_forward_cuda(p, p, p, NULL, 64, 64, 64, &misaligned, NULL, NULL, NULL, ws, need, &fake, 0,
                                         err), -1);
    cr_expect(strstr(err, "save") && strstr(err, "16-byte aligned"), "message: %s", err);
    cr_expect_eq(linear_fp8_backward_cuda(p, 1.0f, (float *)p, 1.0f, NULL, p + 1, &saved, p, NULL, 64, 64, 64, FP8_E5M2,
                                          NULL, NULL, ws, need, &fake, 0, err), -1);
    cr_expect(strstr(err, "16-byte aligned"), "message: %s", err);
    cr_expect_eq(linear_fp8_backward_cuda(p, 1.0f, (float *)p, 1.0f, NULL, p, NULL, p, NULL, 64, 64, 64, FP8_E5M2, NULL,
                                          NULL, ws, need, &fake, 0, err), -1);
    cr_expect(strstr(err, "linear_fp8_backward_cuda: inp must be an Fp8Saved"), "message: %s", err);
    cr_expect_eq(linear_fp8_backward_cuda(p, 1.0f, (float *)p, 1.0f, NULL, p, &saved, p, NULL, 64, 64, 64, (Fp8Format)7,
                                          NULL, NULL, ws, need, &fake, 0, err), -1);
    cr_expect(strstr(err, "grad_format"), "message: %s", err);
    cr_expect_eq(linear_fp8_forward_cuda(p, p, p, NULL, 64, 64, 64, NULL, NULL, NULL, NULL, ws, need, NULL, 0,
                                         err), -1);
    cr_expect(strstr(err, "ctx"), "message: %s", err);
    cr_expect_eq(linear_fp8_dgelu_backward_cuda(p, (float *)p, 1.0f, NULL, p, &saved, p, p, NULL, 64, 64, 64, FP8_E4M3,
                                                NULL, NULL, NULL, NULL, ws, need - 1, &fake, 0, err), -1);
    cr_expect(strstr(err, "linear_fp8_dgelu_backward_cuda") && strstr(err, "workspace"), "message: %s", err);
    cr_expect_eq(linear_fp8_forward_gelu_input_cuda(p, p + 1, p, NULL, 64, 64, 64, NULL, NULL, NULL, NULL, ws, need,
                                                    &fake, 0, err), -1);
    cr_expect(strstr(err, "linear_fp8_forward_gelu_input_cuda: pre_gelu and weight"), "message: %s", err);
    uint8_t *q = (uint8_t *)4096;
    cr_expect_eq(fp8_quantize_guessed_cuda(q, NULL, (float *)4352, p, 64, 64, FP8_E4M3, (int *)4098, (float *)4352, 0,
                                           err), -1);
    cr_expect(strstr(err, "exponent and taken, 4-byte aligned"), "message: %s", err);
    cr_expect_eq(fp8_quantize_guessed_cuda(q, NULL, (float *)4352, p, 64, 64, FP8_E4M3, (int *)4096, NULL, 0, err), -1);
    cr_expect(strstr(err, "exponent and taken"), "message: %s", err);
}

// ---- amax from the producers (exact) -------------------------------------------------------
// The kernels that write what an FP8 linear quantizes take its amax on the way (out_amax /
// dh_amax / amax arguments, layers/layers_cuda.h); the layer then skips its own amax pass
// (inp_amax / dout_amax). Both must be exact: the amax equals the host's max |x| of the bf16 values
// written, bit for bit, the written values equal the kernel's without amax, and the layer given
// that amax writes the same bytes as when it computes it. Each input has its largest value at
// its very end (the last block of every grid, the last row), where a partial block or warp is.

static float *zeroed_amax(void) {
    float *d = device_alloc(sizeof(float));
    CK(cudaMemset(d, 0, sizeof(float)));
    return d;
}


// Every byte of two device buffers equal.
static void expect_same_bytes(const void *d_a, const void *d_b, size_t bytes, const char *name) {
    uint8_t *a = host_alloc(bytes), *b = host_alloc(bytes);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(a, d_a, bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b, d_b, bytes, cudaMemcpyDeviceToHost));
    size_t i = 0;
    while (i < bytes && a[i] == b[i]) i++;
    cr_expect(i == bytes, "%s: byte %zu of %zu differs (0x%02x vs 0x%02x)", name, i, bytes, i < bytes ? a[i] : 0,
              i < bytes ? b[i] : 0);
}

// *d_amax equals the host's amax of the n bf16 at d_x, bit for bit, and is the planted outlier's.
static void expect_amax_of(const float *d_amax, const bf16 *d_x, size_t n, float outlier, const char *name) {
    float got = download_f32(d_amax, 1)[0], want = host_amax(download_bf16(d_x, n), n);
    cr_expect(memcmp(&got, &want, sizeof got) == 0, "%s: amax %.9g, the output's is %.9g", name, got, want);
    cr_expect(want == outlier, "%s: the planted largest value %.9g is not the amax %.9g", name, outlier, want);
}

// fp8_amax_stacked_cuda: each of three stacked tensors' amax into its slot (stride 4; the slots
// between untouched), raising what is there: slot 1 starts above its tensor's amax and keeps its
// value. Each tensor's largest value is planted at a different place (first, middle, last
// element), the stack's global max in tensor 2.
Test(linear_fp8, stacked_amax_raises_each_slot) {
    REQUIRE_GPU();
    Rng rng;
    rng_seed(&rng, 48);
    const int count = 3;
    const size_t n = 40000;            // a multiple of 8, not of the block's 2048
    float *x = randn_bf16(&rng, count * n, 1.0f);
    x[0] = -9.0f;                      // tensor 0: its first element, negative
    x[n + n / 2] = 7.5f;               // tensor 1: the middle
    x[3 * n - 1] = 12.0f;              // tensor 2: its last element
    float slots[4 * count];
    for (int i = 0; i < 4 * count; i++) slots[i] = -1.0f;
    slots[0] = 0.0f, slots[4] = 100.0f, slots[8] = 0.0f;
    float *d_slots = upload_f32(slots, 4 * count);
    OK(fp8_amax_stacked_cuda(d_slots, 4, upload_bf16(x, count * n), count, n, 0, err));
    float *got = download_f32(d_slots, 4 * count), want[3] = {9.0f, 100.0f, 12.0f};
    for (int t = 0; t < count; t++) {
        cr_expect(got[4 * t] == want[t], "tensor %d: amax slot %g, want %g", t, got[4 * t], want[t]);
        for (int j = 1; j < 4; j++) cr_expect(got[4 * t + j] == -1.0f, "slot %d between the strided ones changed", 4 * t + j);
    }
    cr_expect_eq(fp8_amax_stacked_cuda(d_slots, 4, upload_bf16(x, n), 1, 100, 0, err), -1);   // 100 % 8 != 0
    cr_expect(strstr(err, "fp8_amax_stacked_cuda") && strstr(err, "multiple of 8"), "message: %s", err);
}

Test(linear_fp8, gelu_takes_the_amax_of_its_output) {
    REQUIRE_GPU();
    Rng rng;
    rng_seed(&rng, 41);
    const size_t sizes[] = {8 * 3001, 24007};   // 16-byte vectors; element by element (odd n)
    for (int s = 0; s < 2; s++) {
        size_t n = sizes[s];
        float *x = randn_bf16(&rng, n, 2.0f), *d = randn_bf16(&rng, n, 1.0f);
        x[n - 1] = 30.0f;   // GELU(30) = 30: the largest output, the last element
        d[n - 1] = 64.0f;   // GELU'(x[n-1]) = 1: the largest dGELU
        bf16 *d_x = upload_bf16(x, n), *ref = poisoned(n * sizeof(bf16)), *out = poisoned(n * sizeof(bf16));
        float *amax = zeroed_amax();
        OK(gelu_forward_cuda(ref, d_x, n, NULL, 0, err));
        OK(gelu_forward_cuda(out, d_x, n, amax, 0, err));
        expect_same_bytes(out, ref, n * sizeof(bf16), "gelu_forward_cuda with amax");
        expect_amax_of(amax, out, n, 30.0f, "gelu_forward_cuda");
        bf16 *d_ref = upload_bf16(d, n), *d_out = upload_bf16(d, n);
        float *damax = zeroed_amax();
        OK(gelu_backward_inplace_cuda(d_ref, d_x, n, NULL, 0, err));
        OK(gelu_backward_inplace_cuda(d_out, d_x, n, damax, 0, err));
        expect_same_bytes(d_out, d_ref, n * sizeof(bf16), "gelu_backward_inplace_cuda with amax");
        expect_amax_of(damax, d_out, n, 64.0f, "gelu_backward_inplace_cuda");
    }
}

Test(linear_fp8, layernorm_modulate_takes_the_amax_of_its_output) {
    REQUIRE_GPU();
    Rng rng;
    rng_seed(&rng, 42);
    const int Cs[] = {136, 100};   // vectors; element by element (C % 8 != 0)
    for (int s = 0; s < 2; s++) {
        int B = 3, T = 37, C = Cs[s], stride = 6 * C;   // 111 rows: the last block has 7 of its 8 warps
        size_t n = (size_t)B * T * C;
        float *x = randn_bf16(&rng, n, 1.0f), *mod = randn_bf16(&rng, (size_t)B * stride, 0.3f);
        x[n - 1] = 1024.0f;   // the last row's x̂ at C-1 is ~sqrt(C): the largest output
        bf16 *d_x = upload_bf16(x, n), *d_mod = upload_bf16(mod, (size_t)B * stride);
        bf16 *ref = poisoned(n * sizeof(bf16)), *out = poisoned(n * sizeof(bf16));
        float *stats = device_alloc(4 * (size_t)B * T * sizeof(float)), *amax = zeroed_amax();
        OK(layernorm_modulate_forward_cuda(ref, stats, stats + B * T, d_x, d_mod, d_mod + C, B, T, C, stride, NULL,
                                           0, err));
        OK(layernorm_modulate_forward_cuda(out, stats + 2 * B * T, stats + 3 * B * T, d_x, d_mod, d_mod + C, B, T, C,
                                           stride, amax, 0, err));
        expect_same_bytes(out, ref, n * sizeof(bf16), "layernorm_modulate_forward_cuda with amax");
        expect_same_bytes(stats + 2 * B * T, stats, 2 * (size_t)B * T * sizeof(float), "mean and rstd with amax");
        float last = download_bf16(out + n - 1, 1)[0];
        expect_amax_of(amax, out, n, fabsf(last), "layernorm_modulate_forward_cuda");
    }
}

Test(linear_fp8, gated_residual_backward_takes_the_amax_of_dh) {
    REQUIRE_GPU();
    Rng rng;
    rng_seed(&rng, 43);
    const int Cs[] = {136, 100};
    for (int s = 0; s < 2; s++) {
        int B = 3, T = 37, C = Cs[s], stride = 6 * C;
        size_t n = (size_t)B * T * C;
        float *dy = randn_bf16(&rng, n, 1.0f), *h = randn_bf16(&rng, n, 1.0f);
        float *gate = randn_bf16(&rng, (size_t)B * stride, 0.5f);
        dy[n - 1] = 100.0f;
        gate[(size_t)(B - 1) * stride + C - 1] = 2.0f;   // dh's last element 200: the largest
        bf16 *d_dy = upload_bf16(dy, n), *d_h = upload_bf16(h, n), *d_gate = upload_bf16(gate, (size_t)B * stride);
        bf16 *ref = zeroed(n * sizeof(bf16)), *out = zeroed(n * sizeof(bf16));
        float *dgate = zeroed(2 * (size_t)B * stride * sizeof(float)), *amax = zeroed_amax();
        OK(gated_residual_backward_cuda(NULL, ref, dgate, d_dy, d_h, d_gate, B, T, C, stride, NULL, NULL, &ctx, 0, err));
        OK(gated_residual_backward_cuda(NULL, out, dgate + B * stride, d_dy, d_h, d_gate, B, T, C, stride, amax, NULL, &ctx,
                                        0, err));
        expect_same_bytes(out, ref, n * sizeof(bf16), "gated_residual_backward_cuda dh with amax");
        expect_same_bytes(dgate + B * stride, dgate, (size_t)B * stride * sizeof(float), "dgate with amax");
        expect_amax_of(amax, out, n, 200.0f, "gated_residual_backward_cuda");
    }
}

Test(linear_fp8, merge_heads_takes_the_amax_of_its_output) {
    REQUIRE_GPU();
    Rng rng;
    rng_seed(&rng, 44);
    const int Ds[] = {64, 12};   // vectors; element by element (D % 8 != 0)
    for (int s = 0; s < 2; s++) {
        int B = 2, T = 37, H = 3, D = Ds[s];
        size_t n = (size_t)B * T * H * D;
        float *o = randn_bf16(&rng, n, 1.0f);
        o[n - 1] = 50.0f;   // (B-1, H-1, T-1, D-1): out's last element too
        bf16 *d_o = upload_bf16(o, n), *ref = poisoned(n * sizeof(bf16)), *out = poisoned(n * sizeof(bf16));
        float *amax = zeroed_amax();
        OK(merge_heads_forward_cuda(ref, d_o, B, T, H, D, NULL, 0, err));
        OK(merge_heads_forward_cuda(out, d_o, B, T, H, D, amax, 0, err));
        expect_same_bytes(out, ref, n * sizeof(bf16), "merge_heads_forward_cuda with amax");
        expect_amax_of(amax, out, n, 50.0f, "merge_heads_forward_cuda");
    }
}

// The layer given the amax (the exact one: inp's or dout's, and the weight's) writes the bytes it
// writes when it takes the amax itself: the saved inpᵀ and scale, out, dinp, dweight, dbias, and the
// GELU variants' outputs, whose own amax (out_amax, dpre_amax) is exact. A given amax larger than
// the true one sets the scale (the layer uses it rather than computing its own): inp's, seen in the
// saved scale, and the weight's, seen in out (a factor 1024: the weights' small values lose bits).
Test(linear_fp8, given_amax_gives_the_same_bytes) {
    REQUIRE_GPU();
    Rng rng;
    rng_seed(&rng, 45);
    int M = 97, IC = 128, OC = 80, Mp = fp8_padded_rows(M);
    size_t nx = (size_t)M * IC, nw = (size_t)OC * IC, ny = (size_t)M * OC;
    float *x = randn_bf16(&rng, nx, 1.0f), *w = randn_bf16(&rng, nw, 0.05f), *b = randn_bf16(&rng, OC, 0.1f);
    float *dy = randn_bf16(&rng, ny, 0.01f);
    bf16 *d_x = upload_bf16(x, nx), *d_w = upload_bf16(w, nw), *d_b = upload_bf16(b, OC), *d_dy = upload_bf16(dy, ny);
    float x_amax = host_amax(x, nx), dy_amax = host_amax(dy, ny), w_amax = host_amax(w, nw), big = 4 * x_amax;
    float w_big = 1024 * w_amax;   // (4x would only shift the exponents: the same products)
    float *d_x_amax = upload_f32(&x_amax, 1), *d_dy_amax = upload_f32(&dy_amax, 1), *d_big = upload_f32(&big, 1);
    float *d_w_amax = upload_f32(&w_amax, 1), *d_w_big = upload_f32(&w_big, 1);
    Fp8Saved s[4] = {poisoned_saved(M, IC), poisoned_saved(M, IC), poisoned_saved(M, IC), poisoned_saved(M, IC)};
    bf16 *y[4];
    for (int k = 0; k < 4; k++) y[k] = poisoned(ny * sizeof(bf16));
    OK(linear_fp8_forward_cuda(y[0], d_x, d_w, d_b, M, IC, OC, &s[0], NULL, NULL, NULL, workspace, workspace_bytes,
                               &ctx, 0, err));
    Fp8Scaling x_known = {d_x_amax, NULL, NULL, 0}, w_known = {d_w_amax, NULL, NULL, 0};
    Fp8Scaling big_known = {d_big, NULL, NULL, 0};
    Fp8Scaling w_big_known = {d_w_big, NULL, NULL, 0};
    OK(linear_fp8_forward_cuda(y[1], d_x, d_w, d_b, M, IC, OC, &s[1], NULL, &x_known, &w_known, workspace,
                               workspace_bytes, &ctx, 0, err));
    OK(linear_fp8_forward_cuda(y[2], d_x, d_w, d_b, M, IC, OC, &s[2], NULL, &big_known, NULL, workspace,
                               workspace_bytes, &ctx, 0, err));
    OK(linear_fp8_forward_cuda(y[3], d_x, d_w, d_b, M, IC, OC, &s[3], NULL, NULL, &w_big_known, workspace,
                               workspace_bytes, &ctx, 0, err));
    expect_same_bytes(s[1].qt, s[0].qt, (size_t)IC * Mp, "forward's saved inpᵀ with inp_amax");
    expect_same_bytes(s[1].scale, s[0].scale, sizeof(float), "forward's saved scale with inp_amax");
    expect_same_bytes(y[1], y[0], ny * sizeof(bf16), "forward's out with inp_amax");
    float scale_big = download_f32(s[2].scale, 1)[0];
    cr_expect(scale_big == ldexpf(1.0f, fp8_scale_exponent(big, FP8_E4M3)),
              "a given amax %g must set the scale: got %g, want %g", big, scale_big,
              ldexpf(1.0f, fp8_scale_exponent(big, FP8_E4M3)));
    cr_expect(memcmp(download_bf16(y[3], ny), download_bf16(y[0], ny), ny * sizeof(bf16)) != 0,
              "a given weight amax 1024x the true one must change the weight's quantization (out the same)");

    // backward from the same saved copy, with and without dout_amax
    bf16 *dx[2];
    float *dw[2], *db[2];
    for (int k = 0; k < 2; k++) {
        dx[k] = zeroed(nx * sizeof(bf16));
        dw[k] = zeroed(nw * sizeof(float));
        db[k] = zeroed(OC * sizeof(float));
        OK(linear_fp8_backward_cuda(dx[k], 1.0f, dw[k], 1.0f, db[k], d_dy, &s[0], d_w, NULL, M, IC, OC, FP8_E4M3,
                                    k ? d_dy_amax : NULL, k ? d_w_amax : NULL, workspace, workspace_bytes, &ctx, 0,
                                    err));
    }
    expect_same_bytes(dx[1], dx[0], nx * sizeof(bf16), "dinp with dout_amax");
    expect_same_bytes(dw[1], dw[0], nw * sizeof(float), "dweight with dout_amax");
    expect_same_bytes(db[1], db[0], OC * sizeof(float), "dbias with dout_amax");

    // the MLP's variants: GELU's out_amax, then the dGELU backward with dout_amax and its dpre_amax
    bf16 *act[2], *pre[2], *dpre[2];
    float *act_amax = zeroed_amax(), *dpre_amax = zeroed_amax();
    for (int k = 0; k < 2; k++) {
        act[k] = poisoned(ny * sizeof(bf16));
        pre[k] = poisoned(ny * sizeof(bf16));
        OK(linear_fp8_gelu_forward_cuda(act[k], pre[k], d_x, d_w, d_b, M, IC, OC, &s[0], NULL, k ? &x_known : NULL,
                                        k ? &w_known : NULL, k ? act_amax : NULL, workspace, workspace_bytes, &ctx, 0,
                                        err));
    }
    expect_same_bytes(act[1], act[0], ny * sizeof(bf16), "GELU forward's out with amax");
    expect_same_bytes(pre[1], pre[0], ny * sizeof(bf16), "GELU forward's pre-activation with amax");
    expect_amax_of(act_amax, act[1], ny, host_amax(download_bf16(act[0], ny), ny), "GELU forward's out_amax");
    // (fc2 of the MLP: IC' = OC, OC' = IC; its saved input is GELU's output, quantized by a forward)
    Fp8Saved s_act = poisoned_saved(M, OC);
    bf16 *y2 = poisoned(nx * sizeof(bf16));
    float *dy2 = randn_bf16(&rng, nx, 0.01f), dy2_amax = host_amax(dy2, nx);
    bf16 *d_dy2 = upload_bf16(dy2, nx), *d_w2 = upload_bf16(w, nw);
    float *d_dy2_amax = upload_f32(&dy2_amax, 1);
    Fp8Scaling act_known = {act_amax, NULL, NULL, 0};
    OK(linear_fp8_forward_cuda(y2, act[0], d_w2, NULL, M, OC, IC, &s_act, NULL, &act_known, NULL, workspace,
                               workspace_bytes, &ctx, 0, err));
    for (int k = 0; k < 2; k++) {
        dpre[k] = poisoned(ny * sizeof(bf16));
        dw[k] = zeroed(nw * sizeof(float));
        OK(linear_fp8_dgelu_backward_cuda(dpre[k], dw[k], 1.0f, NULL, d_dy2, &s_act, pre[0], d_w2, NULL, M, OC, IC,
                                          FP8_E4M3, k ? d_dy2_amax : NULL, k ? d_w_amax : NULL, k ? dpre_amax : NULL,
                                          NULL, workspace, workspace_bytes, &ctx, 0, err));
    }
    expect_same_bytes(dpre[1], dpre[0], ny * sizeof(bf16), "dGELU backward's dpre with amax");
    expect_same_bytes(dw[1], dw[0], nw * sizeof(float), "dGELU backward's dweight with dout_amax");
    expect_amax_of(dpre_amax, dpre[1], ny, host_amax(download_bf16(dpre[0], ny), ny), "dGELU backward's dpre_amax");
}

// ---- the weight's transpose kept by the forward (save_weight / weight_saved) ----------------
// The forward's copy of weightᵀ bit-exact against the CPU quantization; the backward and the dGELU
// backward reading it write the same dinp (dpre), dweight and dbias bytes as when they quantize the
// weight themselves, and so does the backward from a dout quantized beforehand into
// linear_fp8_dout_slots (as the douts' producers write it). M = 97 rows, OC = 80 (the copy's rows),
// IC = 128.
Test(linear_fp8, kept_weight_gives_the_same_backward) {
    REQUIRE_GPU();
    Rng rng;
    rng_seed(&rng, 50);
    int M = 97, IC = 128, OC = 80;
    size_t nx = (size_t)M * IC, nw = (size_t)OC * IC, ny = (size_t)M * OC;
    float *x = randn_bf16(&rng, nx, 1.0f), *w = randn_bf16(&rng, nw, 0.05f), *dy = randn_bf16(&rng, ny, 0.01f);
    float *pre = randn_bf16(&rng, nx, 2.0f);
    bf16 *d_x = upload_bf16(x, nx), *d_w = upload_bf16(w, nw), *d_dy = upload_bf16(dy, ny);
    bf16 *d_pre = upload_bf16(pre, nx);
    Fp8Saved s = poisoned_saved(M, IC), wt = poisoned_saved(OC, IC);
    OK(linear_fp8_forward_cuda(poisoned(ny * sizeof(bf16)), d_x, d_w, NULL, M, IC, OC, &s, &wt, NULL, NULL, workspace,
                               workspace_bytes, &ctx, 0, err));
    expect_quantized(NULL, wt.qt, wt.scale, w, OC, IC, FP8_E4M3, "the forward's kept weightᵀ");
    bf16 *dx[3], *dpre[2];
    float *dw[3], *db[2];
    for (int k = 0; k < 3; k++) {
        dx[k] = poisoned(nx * sizeof(bf16));
        dw[k] = zeroed(nw * sizeof(float));
    }
    for (int k = 0; k < 2; k++) {
        db[k] = zeroed(OC * sizeof(float));
        OK(linear_fp8_backward_cuda(dx[k], 0.0f, dw[k], 1.0f, db[k], d_dy, &s, d_w, k ? &wt : NULL, M, IC, OC, FP8_E4M3,
                                    NULL, NULL, workspace, workspace_bytes, &ctx, 0, err));
    }
    Fp8Dout dout;
    OK(linear_fp8_dout_slots(&dout, workspace, workspace_bytes, M, IC, OC, err));
    OK(fp8_quantize_cuda(dout.q, dout.qt, dout.scale, d_dy, M, OC, FP8_E4M3, zeroed(sizeof(float)), 0, err));
    OK(linear_fp8_backward_quantized_cuda(dx[2], 0.0f, dw[2], 1.0f, &dout, &s, d_w, &wt, M, IC, OC, FP8_E4M3, NULL,
                                          workspace, workspace_bytes, &ctx, 0, err));
    expect_same_bytes(dx[1], dx[0], nx * sizeof(bf16), "dinp from the kept weightᵀ");
    expect_same_bytes(dw[1], dw[0], nw * sizeof(float), "dweight with the kept weightᵀ");
    expect_same_bytes(db[1], db[0], OC * sizeof(float), "dbias with the kept weightᵀ");
    expect_same_bytes(dx[2], dx[0], nx * sizeof(bf16), "dinp from the quantized dout");
    expect_same_bytes(dw[2], dw[0], nw * sizeof(float), "dweight from the quantized dout");
    cr_expect_eq(linear_fp8_backward_quantized_cuda(dx[2], 0.0f, dw[2], 1.0f, NULL, &s, d_w, &wt, M, IC, OC, FP8_E4M3,
                                                    NULL, workspace, workspace_bytes, &ctx, 0, err), -1);
    cr_expect(strstr(err, "dout is NULL"), "message: %s", err);
    for (int k = 0; k < 2; k++) {
        dpre[k] = poisoned(nx * sizeof(bf16));
        dw[k] = zeroed(nw * sizeof(float));
        OK(linear_fp8_dgelu_backward_cuda(dpre[k], dw[k], 1.0f, NULL, d_dy, &s, d_pre, d_w, k ? &wt : NULL, M, IC, OC,
                                          FP8_E4M3, NULL, NULL, NULL, NULL, workspace, workspace_bytes, &ctx, 0, err));
    }
    expect_same_bytes(dpre[1], dpre[0], nx * sizeof(bf16), "dGELU backward's dpre from the kept weightᵀ");
    expect_same_bytes(dw[1], dw[0], nw * sizeof(float), "dGELU backward's dweight with the kept weightᵀ");
}

// ---- fc2 reading GELU(pre_gelu) without it being stored ------------------------------------
// linear_fp8_forward_gelu_input_cuda writes the bytes that gelu_forward_cuda into a buffer and
// linear_fp8_forward_cuda from it write (out, the saved inpᵀ and its scale), with the amax given
// (gelu_forward_cuda's) or taken by the layer itself. M = 111 rows (not a multiple of 16).
Test(linear_fp8, gelu_input_gives_the_bytes_of_a_stored_gelu) {
    REQUIRE_GPU();
    Rng rng;
    rng_seed(&rng, 46);
    int M = 111, IC = 128, OC = 80;
    size_t n = (size_t)M * IC, ny = (size_t)M * OC;
    float *pre = randn_bf16(&rng, n, 2.0f), *w = randn_bf16(&rng, (size_t)OC * IC, 0.05f);
    float *b = randn_bf16(&rng, OC, 0.1f);
    bf16 *d_pre = upload_bf16(pre, n), *d_w = upload_bf16(w, (size_t)OC * IC), *d_b = upload_bf16(b, OC);
    bf16 *act = poisoned(n * sizeof(bf16)), *y_ref = poisoned(ny * sizeof(bf16));
    float *act_amax = zeroed_amax();
    Fp8Saved s_ref = poisoned_saved(M, IC);
    OK(gelu_forward_cuda(act, d_pre, n, act_amax, 0, err));
    float *w_amax = zeroed_amax();
    OK(fp8_amax_stacked_cuda(w_amax, 0, d_w, 1, (size_t)OC * IC, 0, err));
    OK(linear_fp8_forward_cuda(y_ref, act, d_w, d_b, M, IC, OC, &s_ref, NULL, NULL, NULL, workspace, workspace_bytes,
                               &ctx, 0, err));
    // k = 0: own amax passes; 1: amax given; 2, 3: guessed (exponents 0 and 3 off the right ones at
    // first: both re-quantized; then kept: the right ones, the guessing pass alone)
    Fp8Scaling act_known = {act_amax, NULL, NULL, 0}, w_known = {w_amax, NULL, NULL, 0};
    int wrong[4] = {0, 0, fp8_scale_exponent(host_amax(download_bf16(act, n), n), FP8_E4M3) + 3, 0};
    int *exponents = upload_i32(wrong, 4);
    float *taken = zeroed(2 * sizeof(float));
    Fp8Scaling act_guessed = {NULL, exponents, taken, 0}, w_guessed = {NULL, exponents + 2, taken + 1, 0};
    for (int k = 0; k < 4; k++) {
        bf16 *y = poisoned(ny * sizeof(bf16));
        Fp8Saved s = poisoned_saved(M, IC);
        if (k == 3) CK(cudaMemset(taken, 0, 2 * sizeof(float)));
        OK(linear_fp8_forward_gelu_input_cuda(y, d_pre, d_w, d_b, M, IC, OC, &s, NULL,
                                              k == 0 ? NULL : k == 1 ? &act_known : &act_guessed,
                                              k == 0 ? NULL : k == 1 ? &w_known : &w_guessed, workspace,
                                              workspace_bytes, &ctx, 0, err));
        const char *how = k == 0 ? "own amax" : k == 1 ? "amax given" : k == 2 ? "wrong guess" : "right guess";
        if (k >= 2) {   // the guesses end right, the amax taken exact
            char what[96];
            snprintf(what, sizeof what, "gelu input, %s: exponents and amax", how);
            expect_guess_outcome(exponents, taken, act_amax, FP8_E4M3, what);
            expect_guess_outcome(exponents + 2, taken + 1, w_amax, FP8_E4M3, what);
        }
        char what[96];
        snprintf(what, sizeof what, "gelu input, %s: out", how);
        expect_same_bytes(y, y_ref, ny * sizeof(bf16), what);
        snprintf(what, sizeof what, "gelu input, %s: saved inpᵀ", how);
        expect_same_bytes(s.qt, s_ref.qt, (size_t)IC * fp8_padded_rows(M), what);
        snprintf(what, sizeof what, "gelu input, %s: saved scale", how);
        expect_same_bytes(s.scale, s_ref.scale, sizeof(float), what);
    }
}

// ---- fc1's bias gradient in the dGELU pass (gelu_backward_inplace_dbias_cuda) ------------------
// The same d, amax and dbias bytes as gelu_backward_inplace_cuda followed by a linear backward's own
// dbias pass over d (linear_backward_cuda with dinp NULL), dbias starting from the same random
// values: at C with partial vectors (100), at one chunk of rows and at many (M = 16384, C = 512).
Test(linear_fp8, dgelu_dbias_gives_the_bytes_of_a_separate_dbias) {
    REQUIRE_GPU();
    Rng rng;
    rng_seed(&rng, 47);
    const int shapes[][2] = {{111, 100}, {97, 2048}, {16384, 512}};
    for (int s = 0; s < 3; s++) {
        int M = shapes[s][0], C = shapes[s][1], IC = 16;
        size_t n = (size_t)M * C;
        float *pre = randn_bf16(&rng, n, 2.0f), *d = randn_bf16(&rng, n, 1.0f), *db0 = randn_bf16(&rng, C, 1.0f);
        bf16 *d_pre = upload_bf16(pre, n), *d_ref = upload_bf16(d, n), *d_new = upload_bf16(d, n);
        float *db_ref = upload_f32(db0, C), *db_new = upload_f32(db0, C), *amax_ref = zeroed_amax();
        float *amax_new = zeroed_amax(), *dw_unused = zeroed((size_t)C * IC * sizeof(float));
        bf16 *x_unused = zeroed((size_t)M * IC * sizeof(bf16)), *w_unused = zeroed((size_t)C * IC * sizeof(bf16));
        OK(gelu_backward_inplace_cuda(d_ref, d_pre, n, amax_ref, 0, err));
        OK(linear_backward_cuda(NULL, 1.0f, dw_unused, 1.0f, db_ref, d_ref, x_unused, w_unused, M, IC, C, &ctx, 0, err));
        OK(gelu_backward_inplace_dbias_cuda(d_new, d_pre, db_new, M, C, amax_new, &ctx, 0, err));
        char what[96];
        snprintf(what, sizeof what, "dGELU + dbias M=%d C=%d: d", M, C);
        expect_same_bytes(d_new, d_ref, n * sizeof(bf16), what);
        snprintf(what, sizeof what, "dGELU + dbias M=%d C=%d: dbias", M, C);
        expect_same_bytes(db_new, db_ref, C * sizeof(float), what);
        snprintf(what, sizeof what, "dGELU + dbias M=%d C=%d: amax", M, C);
        expect_same_bytes(amax_new, amax_ref, sizeof(float), what);
    }
}

// The gated residual's dh with the next linear's bias gradient (gated_residual_backward_cuda's
// dh_dbias): the same dh, dres, dgate, amax and dbias bytes as without it followed by a linear
// backward's own dbias pass over dh; B = 3 samples with their own gates, C = 100 (partial vectors)
// and 2048, and 16384 rows (many chunks).
Test(linear_fp8, gated_dbias_gives_the_bytes_of_a_separate_dbias) {
    REQUIRE_GPU();
    Rng rng;
    rng_seed(&rng, 48);
    const int shapes[][3] = {{3, 37, 100}, {3, 37, 2048}, {2, 8192, 512}};
    for (int s = 0; s < 3; s++) {
        int B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], stride = 6 * C, M = B * T, IC = 16;
        size_t n = (size_t)M * C;
        float *dy = randn_bf16(&rng, n, 1.0f), *h = randn_bf16(&rng, n, 1.0f), *res = randn_bf16(&rng, n, 1.0f);
        float *gate = randn_bf16(&rng, (size_t)B * stride, 0.5f), *db0 = randn_bf16(&rng, C, 1.0f);
        bf16 *d_dy = upload_bf16(dy, n), *d_h = upload_bf16(h, n), *d_gate = upload_bf16(gate, (size_t)B * stride);
        bf16 *res_ref = upload_bf16(res, n), *res_new = upload_bf16(res, n);
        bf16 *dh_ref = poisoned(n * sizeof(bf16)), *dh_new = poisoned(n * sizeof(bf16));
        float *dgate = zeroed(2 * (size_t)B * stride * sizeof(float)), *amax_ref = zeroed_amax();
        float *amax_new = zeroed_amax(), *db_ref = upload_f32(db0, C), *db_new = upload_f32(db0, C);
        float *dw_unused = zeroed((size_t)C * IC * sizeof(float));
        bf16 *x_unused = zeroed((size_t)M * IC * sizeof(bf16)), *w_unused = zeroed((size_t)C * IC * sizeof(bf16));
        OK(gated_residual_backward_cuda(res_ref, dh_ref, dgate, d_dy, d_h, d_gate, B, T, C, stride, amax_ref, NULL,
                                        &ctx, 0, err));
        OK(linear_backward_cuda(NULL, 1.0f, dw_unused, 1.0f, db_ref, dh_ref, x_unused, w_unused, M, IC, C, &ctx, 0, err));
        OK(gated_residual_backward_cuda(res_new, dh_new, dgate + B * stride, d_dy, d_h, d_gate, B, T, C, stride,
                                        amax_new, db_new, &ctx, 0, err));
        char what[96];
        snprintf(what, sizeof what, "gated dh + dbias B=%d T=%d C=%d: dh", B, T, C);
        expect_same_bytes(dh_new, dh_ref, n * sizeof(bf16), what);
        snprintf(what, sizeof what, "gated dh + dbias B=%d T=%d C=%d: dres", B, T, C);
        expect_same_bytes(res_new, res_ref, n * sizeof(bf16), what);
        snprintf(what, sizeof what, "gated dh + dbias B=%d T=%d C=%d: dgate", B, T, C);
        expect_same_bytes(dgate + B * stride, dgate, (size_t)B * stride * sizeof(float), what);
        snprintf(what, sizeof what, "gated dh + dbias B=%d T=%d C=%d: dbias", B, T, C);
        expect_same_bytes(db_new, db_ref, C * sizeof(float), what);
        snprintf(what, sizeof what, "gated dh + dbias B=%d T=%d C=%d: amax", B, T, C);
        expect_same_bytes(amax_new, amax_ref, sizeof(float), what);
    }
}

// ---- douts quantized by their producers (layers/fp8_dout_cuda.cu) ----------------------------
// The dGELU (gelu_backward_fp8_cuda) and the gated residual's dh (gated_dh_fp8_cuda) quantized in
// the pass that computes them, against the bf16 pass (gelu_backward_inplace_cuda,
// gated_residual_backward_cuda) whose result the CPU quantizes, and a bf16 dout quantized with its
// bias gradient (dout_fp8_cuda) against the dout itself: every byte of q and qt (and qt's pad)
// worth the CPU's value at the exponent the guess rules give (fp8_guess_kept: the guess kept within
// [e, e + 2·headroom], else e + headroom, e of the amax), the scale, the amax taken, the next guess,
// and the bias gradient bitwise a linear backward's own pass over the bf16 values. Shapes: C = 112
// (one partial column tile) and 2048; M = 111 and 97 (qt pad), 5000 (chunks of 65 rows: qt written
// by bytes, pad rows past the last group) and 16384 (many 64-row groups); e4m3 and e5m2.
typedef struct { int B, T, C; } DoutShape;
enum { DGELU, GATED, COPY };

static void check_dout_fp8(int op, DoutShape sh, Fp8Format format, int headroom, int offset, Rng *rng) {
    int gate = op == GATED;
    int M = sh.B * sh.T, C = sh.C, stride = 6 * C, IC = 16, Rp = fp8_padded_rows(M);
    size_t n = (size_t)M * C;
    float *a = randn_bf16(rng, n, 1.0f), *b = randn_bf16(rng, gate ? (size_t)sh.B * stride : n, gate ? 0.5f : 2.0f);
    float *h = randn_bf16(rng, n, 1.0f), *db0 = randn_bf16(rng, C, 1.0f);
    bf16 *d_a = upload_bf16(a, n), *d_b = upload_bf16(b, gate ? (size_t)sh.B * stride : n);
    bf16 *ref = poisoned(n * sizeof(bf16));
    float *db_ref = upload_f32(db0, C), *db_new = upload_f32(db0, C);
    if (gate) {   // dh = gate·dout (dgate into scratch)
        float *dgate = zeroed((size_t)sh.B * stride * sizeof(float));
        OK(gated_residual_backward_cuda(NULL, ref, dgate, d_a, upload_bf16(h, n), d_b, sh.B, sh.T, C, stride, NULL,
                                        NULL, &ctx, 0, err));
    } else {      // dpre = GELU'(pre)·d, in place on a copy of d; or the copy itself
        CK(cudaMemcpy(ref, d_a, n * sizeof(bf16), cudaMemcpyDeviceToDevice));
        if (op == DGELU) OK(gelu_backward_inplace_cuda(ref, d_b, n, NULL, 0, err));
    }
    float *dw_unused = zeroed((size_t)C * IC * sizeof(float));
    bf16 *x_unused = zeroed((size_t)M * IC * sizeof(bf16)), *w_unused = zeroed((size_t)C * IC * sizeof(bf16));
    OK(linear_backward_cuda(NULL, 1.0f, dw_unused, 1.0f, db_ref, ref, x_unused, w_unused, M, IC, C, &ctx, 0, err));
    float *x = download_bf16(ref, n), amax = host_amax(x, n);
    int e = fp8_scale_exponent(amax, format), guess = e + offset;
    int used = fp8_guess_kept(guess, e, headroom) ? guess : fp8_next_guess(e, headroom);
    int state[2] = {guess, 12345};
    int *d_exponent = upload_i32(state, 2);
    Fp8Scaling scaling = {NULL, d_exponent, zeroed(sizeof(float)), headroom};
    Fp8Dout out = {poisoned(n), poisoned((size_t)C * Rp), poisoned(256)};
    if (op == GATED)
        OK(gated_dh_fp8_cuda(&out, d_a, d_b, sh.B, sh.T, C, stride, db_new, format, &scaling, &ctx, 0, err));
    else if (op == DGELU)
        OK(gelu_backward_fp8_cuda(&out, d_a, d_b, db_new, M, C, format, &scaling, &ctx, 0, err));
    else
        OK(dout_fp8_cuda(&out, d_a, db_new, M, C, format, &scaling, &ctx, 0, err));
    char what[128];
    snprintf(what, sizeof what, "%s M=%d C=%d format %d headroom %d guess %+d",
             (const char *[]){"gelu_backward_fp8_cuda", "gated_dh_fp8_cuda", "dout_fp8_cuda"}[op], M, C, (int)format,
             headroom, offset);
    expect_quantized_at(out.q, out.qt, out.scale, x, M, C, format, used, what);
    expect_same_bytes(db_new, db_ref, C * sizeof(float), what);
    float taken = download_f32(scaling.taken, 1)[0];
    int next;
    CK(cudaMemcpy(&next, d_exponent, sizeof next, cudaMemcpyDeviceToHost));
    cr_expect_eq(taken, amax, "%s: amax taken %g, true %g", what, taken, amax);
    cr_expect_eq(next, fp8_next_guess(e, headroom), "%s: next guess %d, want %d", what, next,
                 fp8_next_guess(e, headroom));
    free_buffers();
}

Test(linear_fp8, douts_quantized_by_their_producers) {
    REQUIRE_GPU();
    Rng rng;
    rng_seed(&rng, 49);
    const DoutShape shapes[] = {{3, 37, 112}, {1, 97, 2048}, {2, 2500, 512}};
    const int cases[][2] = {{0, 0}, {0, -1}, {0, 3}, {2, 0}, {2, 4}, {2, 5}, {2, -1}};   // headroom, guess - e
    for (int op = DGELU; op <= COPY; op++)
        for (int s = 0; s < 3; s++)
            for (int k = 0; k < 7; k++)
                check_dout_fp8(op, shapes[s], k % 2 ? FP8_E5M2 : FP8_E4M3, cases[k][0], cases[k][1], &rng);
    for (int op = DGELU; op <= COPY; op++) {   // many groups and chunks
        check_dout_fp8(op, (DoutShape){2, 8192, 512}, FP8_E4M3, 0, 0, &rng);
        check_dout_fp8(op, (DoutShape){2, 8192, 512}, FP8_E4M3, 2, 5, &rng);
    }
}
