// How much is left on the table by taking cuBLASLt's first heuristic answer (layers/linear_cuda.cu,
// lt_matmul_run)? For every GEMM of one DiT block's linears (qkv, proj, fc1, fc2: forward, dinp,
// dweight) at a given token count, in FP8 (e4m3, as layers/linear_fp8_cuda.cu calls them: "TN",
// bf16 D with a bf16 bias in the forward, fp32 D += in dweight; fp8fast: with FAST_ACCUM, as
// FP8_ACCUM_FAST_ALL runs them) or bf16, this asks cuBLASLt for up
// to ALGOS candidates, times each (median of RUNS after warm-up, CUDA events) and prints the first
// candidate's time against the fastest's. Not the trainer's exact calls (bf16's GELU epilogues and
// dbias are left out): an upper bound on what per-shape tuning could give.
//
//   nvcc -O2 -I. -o build/bench_gemm_algos dev/bench_gemm_algos.c -lcublasLt
//   build/bench_gemm_algos [fp8|fp8fast|bf16] [tokens] [hidden]        (defaults: fp8 16384 2048)
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "dev/bench_cuda.h"

#define ALGOS 16
#define RUNS 15
#define WARMUP 3
#define WORKSPACE (64u << 20)

#define LT_OK(x)                                                                                     \
    do {                                                                                             \
        cublasStatus_t s_ = (x);                                                                     \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                           \
            fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #x, (int)s_);      \
            exit(1);                                                                                 \
        }                                                                                            \
    } while (0)

typedef struct {
    const char *name;
    int m, n, k;      // column-major D (m, n) = op(A)·B, A (k, m) transposed, B (k, n)
    int bias, dw;     // forward: bf16 bias; dweight: fp32 D with beta = 1
    int grad;         // B is an output gradient (FP8: e5m2, the trainer's default)
} Gemm;

// One GEMM: every candidate's median ms; returns the first candidate's and sets *best, *best_i, *count.
static float sweep(cublasLtHandle_t lt, const Gemm *g, int fp8, int8_t fast, void *a, void *b, void *d, void *bias,
                   float *scale, void *ws, cudaStream_t s, float *best, int *best_i, int *count) {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cudaDataType_t in = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF, in_b = fp8 && g->grad ? CUDA_R_8F_E5M2 : in, out = g->dw ? CUDA_R_32F : CUDA_R_16BF;
    LT_OK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (fp8) {
        LT_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
        LT_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale, sizeof scale));
        LT_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale, sizeof scale));
    }
    if (g->bias) {
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        int32_t bt = CUDA_R_16BF;
        LT_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
        LT_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
        LT_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
    }
    LT_OK(cublasLtMatrixLayoutCreate(&la, in, g->k, g->m, g->k));
    LT_OK(cublasLtMatrixLayoutCreate(&lb, in_b, g->k, g->n, g->k));
    LT_OK(cublasLtMatrixLayoutCreate(&ld, out, g->m, g->n, g->m));
    cublasLtMatmulPreference_t pref;
    uint64_t wsb = WORKSPACE;
    LT_OK(cublasLtMatmulPreferenceCreate(&pref));
    LT_OK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    cublasLtMatmulHeuristicResult_t h[ALGOS];
    int found = 0;
    LT_OK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, ALGOS, h, &found));
    float alpha = 1.0f, beta = g->dw ? 1.0f : 0.0f, first = -1.0f;
    *best = 1e30f;
    *best_i = -1;
    *count = found;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < found; i++) {
        float t[RUNS];
        int ok = 1;
        for (int r = -WARMUP; r < RUNS && ok; r++) {
            CK(cudaEventRecord(e0, s));
            if (cublasLtMatmul(lt, desc, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &h[i].algo, ws, WORKSPACE, s) !=
                CUBLAS_STATUS_SUCCESS)
                ok = 0;
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            if (r >= 0) CK(cudaEventElapsedTime(&t[r], e0, e1));
        }
        if (!ok) continue;
        qsort(t, RUNS, sizeof(float), bench_cmp_float);
        float med = t[RUNS / 2];
        if (i == 0) first = med;
        if (med < *best) { *best = med; *best_i = i; }
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    return first;
}

int main(int argc, char **argv) {
    int fp8 = argc > 1 ? strcmp(argv[1], "bf16") != 0 : 1;
    int8_t fast = argc > 1 && !strcmp(argv[1], "fp8fast");
    int M = argc > 2 ? atoi(argv[2]) : 16384, h = argc > 3 ? atoi(argv[3]) : 2048;
    int Mp = (M + 15) / 16 * 16;   // dweight's k: the FP8 path pads the tokens to 16
    // (out features, in features) of qkv, proj, fc1, fc2
    int lin[4][2] = {{3 * h, h}, {h, h}, {4 * h, h}, {h, 4 * h}};
    const char *lname[4] = {"qkv", "proj", "fc1", "fc2"};
    Gemm g[12];
    for (int l = 0; l < 4; l++) {
        int OC = lin[l][0], IC = lin[l][1];
        g[3 * l] = (Gemm){lname[l], OC, M, IC, 1, 0, 0};                   // forward: outᵀ (OC, M)
        g[3 * l + 1] = (Gemm){lname[l], IC, M, OC, 0, 0, 1};               // dinpᵀ (IC, M)
        g[3 * l + 2] = (Gemm){lname[l], IC, OC, fp8 ? Mp : M, 0, 1, 1};    // dWᵀ (IC, OC) +=
    }
    size_t max_a = 0, max_b = 0, max_d = 0;
    for (int i = 0; i < 12; i++) {
        size_t a = (size_t)g[i].k * g[i].m, b = (size_t)g[i].k * g[i].n, d = (size_t)g[i].m * g[i].n;
        if (a > max_a) max_a = a;
        if (b > max_b) max_b = b;
        if (d > max_d) max_d = d;
    }
    void *a, *b, *d, *bias, *ws;
    float *scale, one = 1.0f;
    CK(cudaMalloc(&a, max_a * 2));
    CK(cudaMalloc(&b, max_b * 2));
    CK(cudaMalloc(&d, max_d * 4));
    CK(cudaMalloc(&bias, 4 * (size_t)h * 2));
    CK(cudaMalloc(&ws, WORKSPACE));
    CK(cudaMalloc((void **)&scale, sizeof(float)));
    CK(cudaMemcpy(scale, &one, sizeof one, cudaMemcpyHostToDevice));
    CK(cudaMemset(a, 0x38, max_a * 2));   // small finite values in fp8 and bf16
    CK(cudaMemset(b, 0x38, max_b * 2));
    CK(cudaMemset(d, 0, max_d * 4));
    CK(cudaMemset(bias, 0, 4 * (size_t)h * 2));
    cublasLtHandle_t lt;
    LT_OK(cublasLtCreate(&lt));
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    struct cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("%s, cuBLASLt %zu, %s GEMMs of one block, %d tokens, hidden %d; median of %d runs (ms)\n", p.name,
           cublasLtGetVersion(), fp8 ? (fast ? "FP8 e4m3 (FAST_ACCUM)" : "FP8 e4m3") : "bf16", M, h, RUNS);
    printf("| linear | GEMM | m | n | k | candidates | first | fastest (index) | first / fastest |\n|---|---|---|---|---|---|---|---|---|\n");
    const char *kind[3] = {"forward", "dinp", "dweight"};
    double sum_first = 0, sum_best = 0;
    for (int i = 0; i < 12; i++) {
        float best;
        int bi, n;
        float first = sweep(lt, &g[i], fp8, fast, a, b, d, bias, scale, ws, s, &best, &bi, &n);
        printf("| %s | %s | %d | %d | %d | %d | %.3f | %.3f (%d) | %.3f |\n", g[i].name, kind[i % 3], g[i].m, g[i].n,
               g[i].k, n, first, best, bi, first / best);
        sum_first += first;
        sum_best += best;
    }
    printf("block total: first %.3f ms, fastest %.3f ms (%.3f ms, %.1f%% less)\n", sum_first, sum_best,
           sum_first - sum_best, 100.0 * (1.0 - sum_best / sum_first));
    return 0;
}
