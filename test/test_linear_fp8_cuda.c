// Tests of the FP8 linear layer (layers/linear_fp8_cuda.h):
// - the quantization kernel bit-exact against the CPU definition (layers/fp8.h, round_to_e4m3 /
//   round_to_e5m2): the same scale, the same fp8 value for every element, row-major and transposed,
//   and the transposed copy's pad columns (rows not a multiple of 16) zero;
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
#include "test/linear_fp8_data.h"

#define TOL_OUT 5e-3
#define TOL_GEMM_F32 1e-3
#define TOL_F32 1e-5

#define REQUIRE_GPU() do {                                                                     \
        int count_ = 0;                                                                        \
        if (cudaGetDeviceCount(&count_) != cudaSuccess || count_ == 0)                         \
            cr_skip_test("no CUDA GPU found");                                                 \
    } while (0)
#define CK(call) do {                                                                          \
        cudaError_t e_ = (call);                                                               \
        cr_assert_eq(e_, cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                \
    } while (0)
#define OK(call) cr_assert_eq((call), 0, "%s failed: %s", #call, err)

#define EXPECT_CLOSE(out, ref, n, tol, name) do {                                             \
        double r_ = rel_l2(out, ref, n);                                                       \
        cr_log_info("%s: rel L2 %.3g (tolerance %.0e)", name, r_, (double)(tol));              \
        cr_expect(r_ <= (tol), "%s: rel L2 error %.3g > %.0e", name, r_, (double)(tol));       \
    } while (0)

// ---- host and device buffers, freed after each test --------------------------------------
#define MAX_BUFFERS 256
static void *host_buffers[MAX_BUFFERS], *device_buffers[MAX_BUFFERS];
static int n_host, n_device;
static LayersCuda ctx;
static char err[DIT_ERR_LEN];
static void *workspace;
static size_t workspace_bytes;

static void *host_alloc(size_t bytes) {
    cr_assert(n_host < MAX_BUFFERS, "too many host buffers");
    void *p = calloc(1, bytes ? bytes : 1);
    cr_assert(p, "calloc of %zu bytes", bytes);
    return host_buffers[n_host++] = p;
}

static void *device_alloc(size_t bytes) {
    cr_assert(n_device < MAX_BUFFERS, "too many device buffers");
    void *p = NULL;
    CK(cudaMalloc(&p, bytes));
    return device_buffers[n_device++] = p;
}

static float *host_floats(size_t n) { return host_alloc(n * sizeof(float)); }

static float *copy_floats(const float *x, size_t n) {
    float *y = host_floats(n);
    memcpy(y, x, n * sizeof(float));
    return y;
}

// N(0, std²) rounded to bf16.
static float *randn_bf16(Rng *rng, size_t n, float std) {
    float *x = host_floats(n);
    rng_fill_normal(rng, x, n, std);
    for (size_t i = 0; i < n; i++) x[i] = fp8_data_bf16(x[i]);
    return x;
}

static bf16 *upload_bf16(const float *x, size_t n) {
    uint16_t *bits = host_alloc(n * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) bits[i] = bf16_bits_from_float(x[i]);
    bf16 *d = device_alloc(n * sizeof(bf16));
    CK(cudaMemcpy(d, bits, n * sizeof(bf16), cudaMemcpyHostToDevice));
    return d;
}

static float *upload_f32(const float *x, size_t n) {
    float *d = device_alloc(n * sizeof(float));
    CK(cudaMemcpy(d, x, n * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}

static void *poisoned(size_t bytes) {
    void *d = device_alloc(bytes);
    CK(cudaMemset(d, 0xFF, bytes));
    return d;
}

static float *download_bf16(const bf16 *d, size_t n) {
    uint16_t *bits = host_alloc(n * sizeof(uint16_t));
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(bits, d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    float *x = host_floats(n);
    for (size_t i = 0; i < n; i++) x[i] = float_from_bf16_bits(bits[i]);
    return x;
}

static float *download_f32(const float *d, size_t n) {
    float *x = host_floats(n);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(x, d, n * sizeof(float), cudaMemcpyDeviceToHost));
    return x;
}

// The value of an fp8 byte (OCP e4m3fn: bias 7, 0x7f/0xff NaN; e5m2: bias 15, IEEE-like).
static float fp8_value(uint8_t b, Fp8Format format) {
    int sign = b >> 7, mant_bits = format == FP8_E4M3 ? 3 : 2, bias = format == FP8_E4M3 ? 7 : 15;
    int e = (b & 0x7f) >> mant_bits, m = b & ((1 << mant_bits) - 1);
    float v;
    if (format == FP8_E4M3 && e == 15 && m == 7) v = NAN;
    else if (format == FP8_E5M2 && e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexpf((float)m, 1 - bias - mant_bits);
    else v = ldexpf((float)((1 << mant_bits) + m), e - bias - mant_bits);
    return sign ? -v : v;
}

static void setup(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return;   // the test skips
    cr_assert_eq(layers_cuda_create(&ctx, 1u << 22, err), 0, "layers_cuda_create: %s", err);
    workspace_bytes = linear_fp8_workspace_bytes(4096, 2048, 8192);
    cr_assert_eq(cudaMalloc(&workspace, workspace_bytes), cudaSuccess, "workspace of %zu bytes", workspace_bytes);
}

static void teardown(void) {
    for (int i = 0; i < n_host; i++) free(host_buffers[i]);
    for (int i = 0; i < n_device; i++) cudaFree(device_buffers[i]);
    n_host = n_device = 0;
    cudaFree(workspace);
    workspace = NULL;
    if (ctx.lt) layers_cuda_destroy(&ctx);
}

TestSuite(linear_fp8, .init = setup, .fini = teardown);

// ---- quantization: bit-exact ---------------------------------------------------------------

// The device copies of x (R, C) against the CPU's quantization: d_scale equal to its scale, every
// byte of d_q (R, C) (may be NULL) and d_qt (C, Rp) worth the CPU's value, qt's pad columns 0.
static void expect_quantized(const uint8_t *d_q, const uint8_t *d_qt, const float *d_scale, const float *x, int R,
                             int C, Fp8Format format, const char *name) {
    size_t n = (size_t)R * C, Rp = fp8_padded_rows(R), nt = (size_t)C * Rp;
    float *ref = host_floats(n), scale;
    float ref_scale = fp8_fake_quantize(ref, x, n, format);
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
    OK(linear_fp8_forward_cuda(d_y, d_x, d_w, d_b, M, IC, OC, &saved, workspace, workspace_bytes, &ctx, 0, err));
    snprintf(name, sizeof name, "fp8 forward M=%d IC=%d OC=%d", M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_y, ny), y_ref, ny, TOL_OUT, name);
    expect_quantized(NULL, saved.qt, saved.scale, x, M, IC, FP8_E4M3, "the forward's saved inp");
    linear_fp8_forward(y_ref, x, w, NULL, M, IC, OC);
    OK(linear_fp8_forward_cuda(d_y, d_x, d_w, NULL, M, IC, OC, NULL, workspace, workspace_bytes, &ctx, 0, err));
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
    OK(linear_fp8_backward_cuda(d_dx, d_dw, d_db, d_dy, &saved, d_w, M, IC, OC, grad_format, workspace,
                                workspace_bytes, &ctx, 0, err));
    const char *g = grad_format == FP8_E4M3 ? "e4m3" : "e5m2";
    snprintf(name, sizeof name, "fp8 backward (%s) dinp M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(download_bf16(d_dx, nx), dx, nx, TOL_OUT, name);
    float *dw = download_f32(d_dw, nw);
    for (size_t i = 0; i < nw; i++) dw[i] -= dw0[i];
    snprintf(name, sizeof name, "fp8 backward (%s) dweight increment M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(dw, dw_inc, nw, TOL_GEMM_F32, name);
    snprintf(name, sizeof name, "fp8 backward (%s) dbias M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(download_f32(d_db, OC), db, OC, TOL_F32, name);

    // without dinp and dbias: the dweight path alone
    CK(cudaMemcpy(d_dw, dw0, nw * sizeof(float), cudaMemcpyHostToDevice));
    OK(linear_fp8_backward_cuda(NULL, d_dw, NULL, d_dy, &saved, d_w, M, IC, OC, grad_format, workspace,
                                workspace_bytes, &ctx, 0, err));
    dw = download_f32(d_dw, nw);
    for (size_t i = 0; i < nw; i++) dw[i] -= dw0[i];
    snprintf(name, sizeof name, "fp8 backward (%s, dweight only) M=%d IC=%d OC=%d", g, M, IC, OC);
    EXPECT_CLOSE(dw, dw_inc, nw, TOL_GEMM_F32, name);

    // the MLP's layers: forward with GELU (pre_gelu and inp's copy kept), backward with dGELU (dpre
    // written over poison) against the CPU definition followed by gelu_forward / gelu_backward
    float *act_ref = host_floats(ny);
    linear_fp8_forward(y_ref, x, w, b, M, IC, OC);
    gelu_forward(act_ref, y_ref, ny);
    bf16 *d_act = poisoned(ny * sizeof(bf16));
    CK(cudaMemset(d_y, 0xFF, ny * sizeof(bf16)));
    Fp8Saved saved_gelu = poisoned_saved(M, IC);
    OK(linear_fp8_gelu_forward_cuda(d_act, d_y, d_x, d_w, d_b, M, IC, OC, &saved_gelu, workspace, workspace_bytes,
                                    &ctx, 0, err));
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
    OK(linear_fp8_dgelu_backward_cuda(d_dpre, d_dw, d_db, d_dy, &saved_gelu, upload_bf16(pre, nx), d_w, M, IC, OC,
                                      grad_format, workspace, workspace_bytes, &ctx, 0, err));
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
        OK(linear_fp8_forward_cuda(d_y, d_x, d_w, d_b, M, IC, OC, &saved, workspace, workspace_bytes, &ctx, 0, err));
        snprintf(name, sizeof name, "%s out (M=%d IC=%d OC=%d)", layers[l].name, M, IC, OC);
        expect_near_bf16(download_bf16(d_y, ny), y_ref, ny, 0.06, name);

        CK(cudaMemset(d_dx, 0, nx * sizeof(bf16)));
        CK(cudaMemset(d_dw, 0, nw * sizeof(float)));
        OK(linear_backward_cuda(d_dx, d_dw, NULL, d_dy, d_x, d_w, M, IC, OC, &ctx, 0, err));
        float *dx_ref = download_bf16(d_dx, nx), *dw_ref = download_f32(d_dw, nw);
        for (int f = 0; f < 2; f++) {
            Fp8Format grad = f == 0 ? FP8_E5M2 : FP8_E4M3;
            double bound = grad == FP8_E5M2 ? 0.095 : 0.06;
            CK(cudaMemset(d_dx, 0, nx * sizeof(bf16)));
            CK(cudaMemset(d_dw, 0, nw * sizeof(float)));
            OK(linear_fp8_backward_cuda(d_dx, d_dw, NULL, d_dy, &saved, d_w, M, IC, OC, grad, workspace,
                                        workspace_bytes, &ctx, 0, err));
            snprintf(name, sizeof name, "%s dinp (%s)", layers[l].name, f == 0 ? "e5m2" : "e4m3");
            expect_near_bf16(download_bf16(d_dx, nx), dx_ref, nx, bound, name);
            snprintf(name, sizeof name, "%s dweight (%s)", layers[l].name, f == 0 ? "e5m2" : "e4m3");
            expect_near_bf16(download_f32(d_dw, nw), dw_ref, nw, bound, name);
        }
    }
}

// ---- argument checks (no GPU needed: they fail before any CUDA call) -----------------------

Test(linear_fp8, rejects_bad_arguments) {
    LayersCuda fake = {.scratch = (float *)256, .scratch_floats = 1};
    bf16 *p = (bf16 *)4096;
    void *ws = (void *)8192;
    Fp8Saved saved = {(uint8_t *)4096, (float *)4352}, misaligned = {(uint8_t *)4104, (float *)4352};
    size_t need = linear_fp8_workspace_bytes(64, 64, 64);
    cr_expect_eq(linear_fp8_forward_cuda(p, p, p, NULL, 64, 100, 64, NULL, ws, need, &fake, 0, err), -1);
    cr_expect(strstr(err, "linear_fp8_forward_cuda") && strstr(err, "multiples of 16"), "message: %s", err);
    cr_expect_eq(linear_fp8_forward_cuda(p, p, p, NULL, 0, 64, 64, NULL, ws, need, &fake, 0, err), -1);
    cr_expect(strstr(err, "M >= 1"), "message: %s", err);
    cr_expect_eq(linear_fp8_forward_cuda(p, p, p, NULL, 64, 64, 64, NULL, ws, need - 1, &fake, 0, err), -1);
    cr_expect(strstr(err, "workspace"), "message: %s", err);
    cr_expect_eq(linear_fp8_forward_cuda(p, p, p, NULL, 64, 64, 64, &misaligned, ws, need, &fake, 0, err), -1);
    cr_expect(strstr(err, "save") && strstr(err, "16-byte aligned"), "message: %s", err);
    cr_expect_eq(linear_fp8_backward_cuda(p, (float *)p, NULL, p + 1, &saved, p, 64, 64, 64, FP8_E5M2, ws, need,
                                          &fake, 0, err), -1);
    cr_expect(strstr(err, "16-byte aligned"), "message: %s", err);
    cr_expect_eq(linear_fp8_backward_cuda(p, (float *)p, NULL, p, NULL, p, 64, 64, 64, FP8_E5M2, ws, need, &fake, 0,
                                          err), -1);
    cr_expect(strstr(err, "linear_fp8_backward_cuda: inp must be an Fp8Saved"), "message: %s", err);
    cr_expect_eq(linear_fp8_backward_cuda(p, (float *)p, NULL, p, &saved, p, 64, 64, 64, (Fp8Format)7, ws, need,
                                          &fake, 0, err), -1);
    cr_expect(strstr(err, "grad_format"), "message: %s", err);
    cr_expect_eq(linear_fp8_forward_cuda(p, p, p, NULL, 64, 64, 64, NULL, ws, need, NULL, 0, err), -1);
    cr_expect(strstr(err, "ctx"), "message: %s", err);
    cr_expect_eq(linear_fp8_dgelu_backward_cuda(p, (float *)p, NULL, p, &saved, p, p, 64, 64, 64, FP8_E4M3, ws,
                                                need - 1, &fake, 0, err), -1);
    cr_expect(strstr(err, "linear_fp8_dgelu_backward_cuda") && strstr(err, "workspace"), "message: %s", err);
}
