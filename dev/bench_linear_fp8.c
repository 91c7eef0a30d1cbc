// The FP8 linear layer (layers/linear_fp8_cuda.h) against the bf16 one (linear_forward_cuda /
// linear_backward_cuda) at config c's shapes: M = 16384 tokens, hidden 2048, the four linears of a
// block (qkv 2048→6144, proj 2048→2048, fc1 2048→8192, fc2 8192→2048). Per call the median of 50
// CUDA-event timed runs after 5 warm-up runs: forward (with bias) and backward (dinp, dweight,
// dbias) of each; for the FP8 layer also its quantization steps alone (fp8_quantize_cuda with the
// copies each call writes), so that GEMM time = call − quantization. The FP8 forward keeps inp's
// transposed copy (Fp8Saved) and the backward reads it, as in the model. TFLOP/s count 2·M·IC·OC
// per GEMM (forward 1 GEMM, backward 2); the quantization's bytes are its minimum traffic
// (amax: read 2 B/element; quantize: read 2, write 1 per copy). The per-step lines multiply by
// config c's depth 4 (one forward and one backward of each linear per block). Last, the FP8 GEMM
// alone at the forward shapes with fast accumulation off (as the layer) and on.
//
// Build: see dev/linear_fp8_model_gpu.sh prepare.  Run: bench_linear_fp8 [grad_format: e5m2 | e4m3]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>
#include "layers/common.h"
#include "layers/linear_fp8_cuda.h"
#include "dev/bench_cuda.h"

#define DEPTH 4

static char err[DIT_ERR_LEN];
static LayersCuda ctx;
static Fp8Format grad_format = FP8_E5M2;

typedef struct {
    int M, IC, OC;
    bf16 *x, *w, *b, *y, *dy, *dx;
    float *dw, *db, *scales;
    uint8_t *q0, *q1;   // quantization outputs of the quantize-only timings
    Fp8Saved saved;     // the FP8 forward's inpᵀ and scale, read by the FP8 backward
    void *ws;
    size_t ws_bytes;
} Case;

typedef void (*Op)(Case *);

// bf16 values N(0, 1)-ish (a uniform ±0.5 pattern: the speed does not depend on the values)
static bf16 *random_bf16(size_t n, float amplitude) {
    uint16_t *h = malloc(n * sizeof(uint16_t));
    if (!h) exit(1);
    uint32_t s = (uint32_t)n * 2654435761u + 12345u;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        h[i] = bf16_bits_from_float(amplitude * (((s >> 8) & 0xffff) / 65536.0f - 0.5f));
    }
    bf16 *d = NULL;
    CK(cudaMalloc((void **)&d, n * sizeof(bf16)));
    CK(cudaMemcpy(d, h, n * sizeof(bf16), cudaMemcpyHostToDevice));
    free(h);
    return d;
}

// op(cs) through bench_median_ms
typedef struct { Op op; Case *cs; } CaseCall;
static void run_case_call(void *p) { ((CaseCall *)p)->op(((CaseCall *)p)->cs); }
static double time_op(Op op, Case *cs) {
    CaseCall call = {op, cs};
    return bench_median_ms(run_case_call, &call);
}

static void bf16_forward(Case *c) { OK(linear_forward_cuda(c->y, c->x, c->w, c->b, c->M, c->IC, c->OC, &ctx, 0, err)); }
static void bf16_backward(Case *c) {
    OK(linear_backward_cuda(c->dx, 1.0f, c->dw, 1.0f, c->db, c->dy, c->x, c->w, c->M, c->IC, c->OC, &ctx, 0, err));
}
static void fp8_forward(Case *c) {
    OK(linear_fp8_forward_cuda(c->y, c->x, c->w, c->b, c->M, c->IC, c->OC, &c->saved, NULL, NULL, NULL, c->ws,
                               c->ws_bytes, &ctx, 0, err));
}
static void fp8_backward(Case *c) {
    OK(linear_fp8_backward_cuda(c->dx, 1.0f, c->dw, 1.0f, c->db, c->dy, &c->saved, c->w, NULL, c->M, c->IC, c->OC,
                                grad_format, NULL, NULL, c->ws, c->ws_bytes, &ctx, 0, err));
}
// the quantization the FP8 forward does: inp (M, IC) both copies (the transposed one kept), weight
// (OC, IC) row-major
static void quant_forward(Case *c) {
    OK(fp8_quantize_cuda(c->q0, c->saved.qt, c->scales, c->x, c->M, c->IC, FP8_E4M3, c->scales + 4, 0, err));
    OK(fp8_quantize_cuda(c->q1, NULL, c->scales + 1, c->w, c->OC, c->IC, FP8_E4M3, c->scales + 5, 0, err));
}
// the backward's: dout (M, OC) both copies, weight transposed (inp's copy is the forward's)
static void quant_backward(Case *c) {
    OK(fp8_quantize_cuda(c->q0, c->q1, c->scales + 2, c->dy, c->M, c->OC, grad_format, c->scales + 6, 0, err));
    OK(fp8_quantize_cuda(NULL, c->q1, c->scales + 1, c->w, c->OC, c->IC, FP8_E4M3, c->scales + 5, 0, err));
}

typedef struct { double bf16_f, bf16_b, fp8_f, fp8_b, qf, qb; } Times;

// One cuBLASLt matmul (D = Aᵀ·B, alpha 1, beta 0) with a chosen algorithm, for bench_median_ms.
typedef struct {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    const void *a, *b;
    void *d;
    cublasLtMatmulAlgo_t algo;
} RawGemm;

static void run_raw_gemm(void *p) {
    const RawGemm *g = p;
    const float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t s = cublasLtMatmul(ctx.lt, g->desc, &alpha, g->a, g->la, g->b, g->lb, &beta, g->d, g->ld, g->d,
                                      g->ld, &g->algo, ctx.lt_workspace, ctx.lt_workspace_bytes, 0);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "%s:%d: cublasLtMatmul: %s\n", __FILE__, __LINE__, cublasLtGetStatusString(s));
        exit(1);
    }
}

// The FP8 GEMM alone as the layer's forward issues it (outᵀ (m, n) = Aᵀ·B, A (k, m), B (k, n)
// e4m3, unit scales, bf16 out), FAST_ACCUM off (the layer) or on (Transformer Engine's forward
// setting): median ms.
static double raw_fp8_gemm_ms(int m, int n, int k, int8_t fast_accum) {
    uint8_t *a, *b;
    bf16 *d;
    float *one;
    const float h_one = 1.0f;
    CK(cudaMalloc((void **)&a, (size_t)k * m));
    CK(cudaMalloc((void **)&b, (size_t)k * n));
    CK(cudaMalloc((void **)&d, (size_t)m * n * sizeof(bf16)));
    CK(cudaMalloc((void **)&one, sizeof(float)));
    CK(cudaMemset(a, 0x38, (size_t)k * m));   // e4m3 1.0
    CK(cudaMemset(b, 0x38, (size_t)k * n));
    CK(cudaMemcpy(one, &h_one, sizeof h_one, cudaMemcpyHostToDevice));
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulPreference_t pref;
    cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    uint64_t ws = ctx.lt_workspace_bytes;
#define LT(call) do { cublasStatus_t s_ = (call); if (s_ != CUBLAS_STATUS_SUCCESS) { \
        fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cublasLtGetStatusString(s_)); exit(1); } } while (0)
    LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof fast_accum));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &one, sizeof one));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &one, sizeof one));
    LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, m, k));
    LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, n, k));
    LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m));
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(ctx.lt, desc, la, lb, ld, ld, pref, 1, &heur, &found));
    if (!found) {
        fprintf(stderr, "raw_fp8_gemm_ms: no algorithm\n");
        exit(1);
    }
#undef LT
    RawGemm g = {desc, la, lb, ld, a, b, d, heur.algo};
    double ms = bench_median_ms(run_raw_gemm, &g);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(ld), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(la);
    cublasLtMatmulDescDestroy(desc);
    void *bufs[] = {a, b, d, one};
    for (int i = 0; i < 4; i++) CK(cudaFree(bufs[i]));
    return ms;
}

static Times bench_layer(const char *name, int M, int IC, int OC) {
    Case c = {.M = M, .IC = IC, .OC = OC};
    size_t nx = (size_t)M * IC, nw = (size_t)OC * IC, ny = (size_t)M * OC;
    c.x = random_bf16(nx, 4.0f), c.w = random_bf16(nw, 0.05f), c.b = random_bf16(OC, 0.05f);
    c.dy = random_bf16(ny, 1e-3f), c.dx = random_bf16(nx, 1e-3f);
    CK(cudaMalloc((void **)&c.y, ny * sizeof(bf16)));
    CK(cudaMalloc((void **)&c.dw, nw * sizeof(float)));
    CK(cudaMalloc((void **)&c.db, OC * sizeof(float)));
    CK(cudaMalloc((void **)&c.scales, 8 * sizeof(float)));
    CK(cudaMalloc((void **)&c.q0, ny > nx ? ny : nx));
    CK(cudaMalloc((void **)&c.q1, ny > nw ? ny : nw));
    CK(cudaMalloc((void **)&c.saved.qt, (size_t)IC * fp8_padded_rows(M)));
    CK(cudaMalloc((void **)&c.saved.scale, sizeof(float)));
    CK(cudaMemset(c.dw, 0, nw * sizeof(float)));
    CK(cudaMemset(c.db, 0, OC * sizeof(float)));
    c.ws_bytes = linear_fp8_workspace_bytes(M, IC, OC);
    CK(cudaMalloc(&c.ws, c.ws_bytes));

    Times t;
    t.bf16_f = time_op(bf16_forward, &c);
    t.bf16_b = time_op(bf16_backward, &c);
    t.fp8_f = time_op(fp8_forward, &c);
    t.fp8_b = time_op(fp8_backward, &c);
    t.qf = time_op(quant_forward, &c);
    t.qb = time_op(quant_backward, &c);
    double gemm = 2.0 * M * IC * OC;   // FLOPs of one of the layer's GEMMs
    double qf_bytes = 6.0 * nx + 5.0 * nw, qb_bytes = 6.0 * ny + 5.0 * nw;
    printf("%-4s M=%d IC=%d OC=%d\n", name, M, IC, OC);
    printf("  forward   bf16 %7.3f ms %6.0f TFLOP/s | fp8 %7.3f ms %6.0f TFLOP/s (quantize %6.3f ms %5.0f GB/s, "
           "GEMM %7.3f ms %6.0f TFLOP/s) | fp8/bf16 %.2fx\n",
           t.bf16_f, gemm / t.bf16_f / 1e9, t.fp8_f, gemm / t.fp8_f / 1e9, t.qf, qf_bytes / t.qf / 1e6,
           t.fp8_f - t.qf, gemm / (t.fp8_f - t.qf) / 1e9, t.bf16_f / t.fp8_f);
    printf("  backward  bf16 %7.3f ms %6.0f TFLOP/s | fp8 %7.3f ms %6.0f TFLOP/s (quantize %6.3f ms %5.0f GB/s, "
           "GEMMs+dbias %7.3f ms %6.0f TFLOP/s) | fp8/bf16 %.2fx\n",
           t.bf16_b, 2 * gemm / t.bf16_b / 1e9, t.fp8_b, 2 * gemm / t.fp8_b / 1e9, t.qb, qb_bytes / t.qb / 1e6,
           t.fp8_b - t.qb, 2 * gemm / (t.fp8_b - t.qb) / 1e9, t.bf16_b / t.fp8_b);
    void *bufs[] = {c.x, c.w, c.b, c.dy, c.dx, c.y, c.dw, c.db, c.scales, c.q0, c.q1, c.saved.qt, c.saved.scale, c.ws};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) CK(cudaFree(bufs[i]));
    return t;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "e4m3") == 0) grad_format = FP8_E4M3;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("bench_linear_fp8: no CUDA GPU found\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("GPU: %s, %d SMs; median of %d runs after %d warm-up; output gradient %s\n", prop.name,
           prop.multiProcessorCount, BENCH_REPEATS, BENCH_WARMUP, grad_format == FP8_E4M3 ? "e4m3" : "e5m2");
    OK(layers_cuda_create(&ctx, (size_t)1 << 22, err));
    const int M = 16384, h = 2048;
    const struct { const char *name; int IC, OC; } layers[] = {
        {"qkv", h, 3 * h}, {"proj", h, h}, {"fc1", h, 4 * h}, {"fc2", 4 * h, h},
    };
    Times sum = {0};
    for (int l = 0; l < 4; l++) {
        Times t = bench_layer(layers[l].name, M, layers[l].IC, layers[l].OC);
        sum.bf16_f += t.bf16_f, sum.bf16_b += t.bf16_b, sum.fp8_f += t.fp8_f, sum.fp8_b += t.fp8_b;
        sum.qf += t.qf, sum.qb += t.qb;
    }
    printf("FP8 GEMM alone (forward layout, bf16 out), FAST_ACCUM off / on:\n");
    for (int l = 0; l < 4; l++) {
        int IC = layers[l].IC, OC = layers[l].OC;
        double off = raw_fp8_gemm_ms(OC, M, IC, 0), on = raw_fp8_gemm_ms(OC, M, IC, 1), f = 2.0 * M * IC * OC / 1e9;
        printf("  %-4s %7.3f ms %6.0f TFLOP/s | %7.3f ms %6.0f TFLOP/s\n", layers[l].name, off, f / off, on, f / on);
    }
    double bf16 = DEPTH * (sum.bf16_f + sum.bf16_b), fp8 = DEPTH * (sum.fp8_f + sum.fp8_b);
    double quant = DEPTH * (sum.qf + sum.qb);
    printf("per step (config c, depth %d, the 4 linears forward + backward):\n", DEPTH);
    printf("  bf16 %.2f ms | fp8 %.2f ms (of which quantization %.2f ms, GEMMs+dbias %.2f ms) | saving %.2f ms\n",
           bf16, fp8, quant, fp8 - quant, bf16 - fp8);
    layers_cuda_destroy(&ctx);
    return 0;
}
