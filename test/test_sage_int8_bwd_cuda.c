// Sage's Hopper backward with INT8 gradient products (sage_backward_int8_sm90_cuda,
// attention/sage_cuda.h) against the CPU definition it implements (SAGE_BWD_INT8_TOKEN,
// sage_backward_quantized in sage_cpu.c, run on the GPU forward's own q8, k8, scales, k_mean, out
// and lse) and against exact attention's gradient computed in fp64. GPU tests skip without an
// sm_90 device (or a build without sm_90a code); rejects_bad_shapes needs no GPU.
// Inputs are random bf16 values (never zero); outputs and workspaces are poisoned (NaN) first.
// Errors are ‖x - ref‖/‖ref‖ (rel L2) and cosine.
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

static const SageConfig INT8_TOKEN = {64, 64, SAGE_PV_FP8, 0, SAGE_BWD_INT8_TOKEN};

#define SKIP_WITHOUT_SM90()                                                                  \
    do {                                                                                     \
        SKIP_WITHOUT_GPU();                                                                  \
        if (!sage_backward_int8_sm90_available()) cr_skip_test("no sm_90 device or sm_90a build"); \
    } while (0)

// One case: q (N(0, q_gain²)), k (N(0,1) + k_offset on every 4th channel), v, dout, as bf16 on the
// device and as the same values in float on the host.
typedef struct {
    int B, H, N, D;
    size_t n;
    float *q, *k, *v, *dout;
    uint16_t *q_dev, *k_dev, *v_dev, *dout_dev;
} Case;

static uint16_t *upload_bf16(float *x, size_t n) {
    uint16_t *bits = xmalloc(n * 2), *dev = dmalloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        bits[i] = to_bf16(x[i] == 0.0f ? 0.5f : x[i]);
        x[i] = from_bf16(bits[i]);
    }
    CUDA_OK(cudaMemcpy(dev, bits, n * 2, cudaMemcpyHostToDevice));
    free(bits);
    return dev;
}

static Case make_case(int B, int H, int N, int D, float q_gain, float k_offset, uint64_t seed) {
    Case c = {B, H, N, D, (size_t)B * H * N * D, 0, 0, 0, 0, 0, 0, 0, 0};
    Rng rng;
    rng_seed(&rng, seed);
    float **host[4] = {&c.q, &c.k, &c.v, &c.dout};
    uint16_t **dev[4] = {&c.q_dev, &c.k_dev, &c.v_dev, &c.dout_dev};
    for (int t = 0; t < 4; t++) {
        float *x = xmalloc(c.n * sizeof(float));
        for (size_t i = 0; i < c.n; i++) {
            x[i] = rng_normal(&rng) * (t == 0 ? q_gain : 1.0f);
            if (t == 1 && i % D % 4 == 0) x[i] += k_offset;
        }
        *dev[t] = upload_bf16(x, c.n);
        *host[t] = x;
    }
    return c;
}

static void free_case(Case *c) {
    free(c->q); free(c->k); free(c->v); free(c->dout);
    cudaFree(c->q_dev); cudaFree(c->k_dev); cudaFree(c->v_dev); cudaFree(c->dout_dev);
}

// The GPU forward (FP8, the sage forward the trainer runs): its workspace and out (bf16), lse on
// the device; out (as floats), lse and the workspace on the host.
typedef struct {
    void *ws;
    uint16_t *out_dev;
    float *lse_dev;
    float *out, *lse;
    char *ws_host;
    SageCudaQuant qv;   // views into ws_host
} Fwd;

static Fwd gpu_forward(const Case *c) {
    Fwd f;
    char err[DIT_ERR_LEN] = "";
    size_t rows = (size_t)c->B * c->H * c->N, ws_bytes = sage_cuda_forward_workspace_size(c->B, c->H, c->N, c->D, SAGE_PV_FP8);
    f.ws = dmalloc(ws_bytes);
    f.out_dev = dmalloc(c->n * 2);
    f.lse_dev = dmalloc(rows * 4);
    int rc = sage_forward_cuda(f.out_dev, f.lse_dev, f.ws, c->q_dev, c->k_dev, c->v_dev, c->B, c->H, c->N, c->D,
                               SAGE_PV_FP8, 0, err);
    cr_assert_eq(rc, 0, "sage_forward_cuda: %s", err);
    CUDA_OK(cudaDeviceSynchronize());
    f.out = xmalloc(c->n * sizeof(float));
    bf16_to_host_floats(f.out, f.out_dev, c->n);
    f.lse = xmalloc(rows * 4);
    CUDA_OK(cudaMemcpy(f.lse, f.lse_dev, rows * 4, cudaMemcpyDeviceToHost));
    f.ws_host = xmalloc(ws_bytes);
    CUDA_OK(cudaMemcpy(f.ws_host, f.ws, ws_bytes, cudaMemcpyDeviceToHost));
    f.qv = sage_cuda_quant_view(f.ws_host, c->B, c->H, c->N, c->D, SAGE_PV_FP8);
    return f;
}

static void free_fwd(Fwd *f) {
    cudaFree(f->ws); cudaFree(f->out_dev); cudaFree(f->lse_dev);
    free(f->out); free(f->lse); free(f->ws_host);
}

// The INT8 backward on the device into host dq | dk | dv (3·n floats); outputs and workspace poisoned.
static float *gpu_backward_int8(const Case *c, const Fwd *f) {
    char err[DIT_ERR_LEN] = "";
    float *d = dmalloc(3 * c->n * sizeof(float));
    void *ws = dmalloc(sage_backward_int8_workspace_size(c->B, c->H, c->N, c->D));
    int rc = sage_backward_int8_sm90_cuda(d, d + c->n, d + 2 * c->n, ws, f->ws, c->dout_dev, c->q_dev, c->k_dev,
                                          c->v_dev, f->out_dev, f->lse_dev, NULL, c->B, c->H, c->N, c->D,
                                          SAGE_PV_FP8, 0, err);
    cr_assert_eq(rc, 0, "sage_backward_int8_sm90_cuda: %s", err);
    CUDA_OK(cudaDeviceSynchronize());
    float *h = xmalloc(3 * c->n * sizeof(float));
    CUDA_OK(cudaMemcpy(h, d, 3 * c->n * sizeof(float), cudaMemcpyDeviceToHost));
    cudaFree(d);
    cudaFree(ws);
    return h;
}

// The definition on the GPU forward's quantized tensors, out and lse: dq | dk | dv (3·n floats).
static float *cpu_definition(const Case *c, const Fwd *f) {
    float *ref = xmalloc(3 * c->n * sizeof(float));   // zeroed: the CPU backward accumulates
    sage_backward_quantized(ref, ref + c->n, ref + 2 * c->n, c->dout, c->q, c->k, c->v, f->out, f->lse,
                            f->qv.q8, f->qv.q_scale, f->qv.k8, f->qv.k_scale, f->qv.k_mean,
                            c->B, c->H, c->N, c->N, c->D, INT8_TOKEN);
    return ref;
}

// Exact attention's gradient in fp64 per head: S = q·kᵀ/sqrt(D), P = softmax(S), dv = Pᵀ·dout,
// dP = dout·vᵀ, dS = P∘(dP - rowsum(P∘dP)), dq = dS·k/sqrt(D), dk = dSᵀ·q/sqrt(D). Returns
// dq | dk | dv as floats (3·n).
static float *exact_gradient_fp64(const Case *c) {
    int N = c->N, D = c->D;
    double *p = xmalloc((size_t)N * N * sizeof(double)), *ds = xmalloc((size_t)N * N * sizeof(double));
    double *g = xmalloc(3 * (size_t)D * N * sizeof(double));
    float *out = xmalloc(3 * c->n * sizeof(float));
    const double r = 1.0 / sqrt((double)D);
    for (int bh = 0; bh < c->B * c->H; bh++) {
        size_t at = (size_t)bh * N * D;
        const float *q = c->q + at, *k = c->k + at, *v = c->v + at, *dout = c->dout + at;
        for (int i = 0; i < N; i++) {
            double m = -INFINITY, l = 0, dr = 0;
            for (int j = 0; j < N; j++) {
                double s = 0;
                for (int d = 0; d < D; d++) s += (double)q[i * D + d] * k[j * D + d];
                p[(size_t)i * N + j] = s * r;
                m = fmax(m, s * r);
            }
            for (int j = 0; j < N; j++) l += p[(size_t)i * N + j] = exp(p[(size_t)i * N + j] - m);
            for (int j = 0; j < N; j++) {
                double dp = 0;
                for (int d = 0; d < D; d++) dp += (double)dout[i * D + d] * v[j * D + d];
                p[(size_t)i * N + j] /= l;
                ds[(size_t)i * N + j] = dp;
                dr += p[(size_t)i * N + j] * dp;
            }
            for (int j = 0; j < N; j++) ds[(size_t)i * N + j] = p[(size_t)i * N + j] * (ds[(size_t)i * N + j] - dr);
        }
        memset(g, 0, 3 * (size_t)D * N * sizeof(double));
        double *dq = g, *dk = g + (size_t)N * D, *dv = g + 2 * (size_t)N * D;
        for (int i = 0; i < N; i++)
            for (int j = 0; j < N; j++) {
                double pij = p[(size_t)i * N + j], dsij = ds[(size_t)i * N + j] * r;
                for (int d = 0; d < D; d++) {
                    dv[j * D + d] += pij * dout[i * D + d];
                    dq[i * D + d] += dsij * k[j * D + d];
                    dk[j * D + d] += dsij * q[i * D + d];
                }
            }
        for (int t = 0; t < 3; t++)
            for (size_t x = 0; x < (size_t)N * D; x++) out[t * c->n + at + x] = (float)g[t * (size_t)N * D + x];
    }
    free(p); free(ds); free(g);
    return out;
}

static const char *NAMES[3] = {"dq", "dk", "dv"};

// GPU vs the definition: rel L2 < 2e-3 for each gradient. What may differ: the order of the fp32
// sums (dP, delta, the int32 tiles' scaled adds), exp2 of the special-function unit (a few ulp), and
// through them a rare ±1 in an int8 P or dS. The two planted bugs of dev/sage_int8_bwd_gpu.sh,
// simulated on the CPU definition (dev/notes_sage_int8_bwd.md): P scaled by 1/127 instead of by
// its max, 2e-2..4e-1 in dv; dS's per-query scale ignored, 0.8..3.5 in dq.
// vs exact (fp64): cosine >= min_cos (the definition measured on the CPU: 0.9998 for Gaussian and
// K-offset inputs, 0.9986 for dq with q×4, where the forward's INT8 Q/K already costs as much).
static void check_case(int B, int H, int N, int D, float q_gain, float k_offset, double min_cos) {
    Case c = make_case(B, H, N, D, q_gain, k_offset, 7000 + 31 * N + D + (uint64_t)(q_gain * 10) + (uint64_t)k_offset);
    Fwd f = gpu_forward(&c);
    float *g = gpu_backward_int8(&c, &f);
    float *ref = cpu_definition(&c, &f);
    double rel[3], cosv[3];
    for (int t = 0; t < 3; t++) compare(&rel[t], &cosv[t], g + t * c.n, ref + t * c.n, c.n);
    fprintf(stderr, "int8 bwd B=%d H=%d N=%d D=%d q×%g k+%g vs definition: rel L2 dq %.2e dk %.2e dv %.2e\n", B, H, N,
            D, q_gain, k_offset, rel[0], rel[1], rel[2]);
    for (int t = 0; t < 3; t++) cr_expect(rel[t] < 2e-3, "%s rel L2 vs CPU definition %g >= 2e-3", NAMES[t], rel[t]);
    free(ref);
    ref = exact_gradient_fp64(&c);
    for (int t = 0; t < 3; t++) compare(&rel[t], &cosv[t], g + t * c.n, ref + t * c.n, c.n);
    fprintf(stderr, "int8 bwd B=%d H=%d N=%d D=%d q×%g k+%g vs exact fp64: cosine dq %.6f dk %.6f dv %.6f\n", B, H, N,
            D, q_gain, k_offset, cosv[0], cosv[1], cosv[2]);
    for (int t = 0; t < 3; t++) cr_expect(cosv[t] >= min_cos, "%s cosine vs exact %f < %g", NAMES[t], cosv[t], min_cos);
    free(g); free(ref);
    free_fwd(&f);
    free_case(&c);
}

Test(sage_int8_bwd_cuda, tails_match_definition_and_exact, .timeout = 120) {
    SKIP_WITHOUT_SM90();
    check_case(1, 3, 77, 64, 1.0f, 0.0f, 0.999);
    check_case(1, 3, 77, 128, 1.0f, 0.0f, 0.999);
    check_case(1, 2, 200, 64, 1.0f, 0.0f, 0.999);
    check_case(1, 2, 200, 128, 1.0f, 0.0f, 0.999);
    check_case(2, 1, 333, 64, 1.0f, 0.0f, 0.999);
    check_case(2, 1, 333, 128, 1.0f, 0.0f, 0.999);
    check_case(1, 1, 3, 64, 1.0f, 0.0f, 0.999);   // fewer keys than one 64-block: the CTA's second half empty
}

Test(sage_int8_bwd_cuda, whole_tiles_and_longer, .timeout = 120) {
    SKIP_WITHOUT_SM90();
    check_case(2, 2, 256, 128, 1.0f, 0.0f, 0.999);
    check_case(2, 2, 256, 64, 1.0f, 0.0f, 0.999);
    check_case(1, 1, 1024, 128, 1.0f, 0.0f, 0.999);
    check_case(1, 1, 1000, 64, 1.0f, 0.0f, 0.999);
}

Test(sage_int8_bwd_cuda, peaked_softmax, .timeout = 120) {
    SKIP_WITHOUT_SM90();
    check_case(1, 2, 256, 128, 4.0f, 0.0f, 0.998);
    check_case(1, 2, 520, 64, 4.0f, 0.0f, 0.998);
}

Test(sage_int8_bwd_cuda, k_offset, .timeout = 120) {
    SKIP_WITHOUT_SM90();
    check_case(1, 2, 300, 128, 1.0f, 20.0f, 0.999);
    check_case(1, 2, 130, 64, 1.0f, 20.0f, 0.999);
}

// sage_backward_set_deterministic(1): at B=2, H=2, N=1024 (8 key blocks of 128 per head) three
// runs give bitwise the same dq, dk, dv, and the first matches the definition as above.
Test(sage_int8_bwd_cuda, deterministic, .timeout = 120) {
    SKIP_WITHOUT_SM90();
    int before = sage_backward_set_deterministic(1);
    for (int D = 64; D <= 128; D += 64) {
        Case c = make_case(2, 2, 1024, D, 1.0f, 0.0f, 9100 + D);
        Fwd f = gpu_forward(&c);
        float *first = gpu_backward_int8(&c, &f);
        for (int run = 1; run < 3; run++) {
            float *again = gpu_backward_int8(&c, &f);
            for (int t = 0; t < 3; t++) {
                size_t differ = 0;
                for (size_t i = 0; i < c.n; i++) differ += memcmp(&again[t * c.n + i], &first[t * c.n + i], 4) != 0;
                cr_expect_eq(differ, 0, "D=%d run %d: %s differs from the first run in %zu of %zu values", D, run,
                             NAMES[t], differ, c.n);
            }
            free(again);
        }
        float *ref = cpu_definition(&c, &f);
        double rel[3], cosv[3];
        for (int t = 0; t < 3; t++) compare(&rel[t], &cosv[t], first + t * c.n, ref + t * c.n, c.n);
        fprintf(stderr, "int8 bwd deterministic D=%d vs definition: rel L2 dq %.2e dk %.2e dv %.2e\n", D, rel[0],
                rel[1], rel[2]);
        for (int t = 0; t < 3; t++) cr_expect(rel[t] < 2e-3, "%s rel L2 vs CPU definition %g", NAMES[t], rel[t]);
        free(first); free(ref);
        free_fwd(&f);
        free_case(&c);
    }
    sage_backward_set_deterministic(before);
}

// Argument checks run before any CUDA call: no GPU needed.
Test(sage_int8_bwd_cuda, rejects_bad_shapes) {
    char err[DIT_ERR_LEN] = "";
    float *f = (float *)(uintptr_t)256;   // aligned stand-ins, never dereferenced
    void *ws = (void *)(uintptr_t)1024;
    const uint16_t *h = (const uint16_t *)(uintptr_t)512;
    const int shapes[4][4] = {{1, 1, 64, 96}, {1, 1, 0, 64}, {0, 1, 64, 64}, {300, 300, 64, 128}};
    for (int s = 0; s < 4; s++) {
        int rc = sage_backward_int8_sm90_cuda(f, f, f, ws, ws, h, h, h, h, h, f, NULL, shapes[s][0], shapes[s][1],
                                              shapes[s][2], shapes[s][3], SAGE_PV_FP8, 0, err);
        cr_expect_eq(rc, -1, "shape %d accepted", s);
        cr_expect(strstr(err, "sage_backward_int8_sm90_cuda: need D in {64, 128}") != NULL, "message: %s", err);
    }
    cr_expect_eq(sage_backward_int8_sm90_cuda(NULL, f, f, ws, ws, h, h, h, h, h, f, NULL, 1, 1, 64, 64, SAGE_PV_FP8,
                                              0, err), -1);
    cr_expect(strstr(err, "dq must be a device pointer, got NULL") != NULL, "message: %s", err);
    cr_expect_eq(sage_backward_int8_sm90_cuda(f, f, f, (char *)ws + 16, ws, h, h, h, h, h, f, NULL, 1, 1, 64, 64,
                                              SAGE_PV_FP8, 0, err), -1);
    cr_expect(strstr(err, "must be 128-byte aligned") != NULL, "message: %s", err);
    cr_expect_eq(sage_backward_int8_sm90_cuda(f, f, f, ws, ws, h, h, h, h, NULL, f, NULL, 1, 1, 64, 64, SAGE_PV_FP8,
                                              0, err), -1);
    cr_expect(strstr(err, "out must be a device pointer") != NULL, "message: %s", err);
    // the INT8 operands come on top of the fp32 backward's workspace
    cr_expect_gt(sage_backward_int8_workspace_size(2, 3, 333, 128), sage_cuda_backward_workspace_size(2, 3, 333, 128));
}
