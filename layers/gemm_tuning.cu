// GEMM algorithm tuning (LayersCuda.gemm_tuning): for each GEMM shape, time cuBLASLt's candidates
// once and keep the fastest, instead of taking the heuristic's first answer every call.
//
// cuBLASLt's heuristic ranks its algorithms without running them; at config c with every FP8 GEMM
// in fast accumulation its first answer is 3.9% slower than the fastest of its own eight candidates
// over one block's twelve GEMMs, 1.2x on fc2's dinp (dev/notes_step.md, session 23, call 8).
// The key is everything the heuristic sees: the descriptor's attributes, the three layouts, beta
// (zero or not: C is read or not) and the pointers' alignments. The timing runs write D, so when
// beta != 0 (D accumulates) D is saved to a temporary buffer first and put back before the real
// call. Timing needs a synchronizing stream: a stream being captured into a graph gets the cached
// choice, or the heuristic's first answer. The choice depends on timings, so two contexts (or two
// runs) may pick different algorithms and give different bits: tuning is off unless asked for.
#include <stdlib.h>
#include <string.h>
#include "layers/cuda_common.cuh"

#define TUNE_CANDIDATES 8
#define TUNE_WARMUP 2
#define TUNE_RUNS 5
#define TUNE_MARGIN 0.99f    // a candidate replaces the first answer only when 1% faster (stable picks)
#define TUNE_CACHE 128       // shapes per context (a DiT step has ~40)

typedef struct {
    int32_t a_type, b_type, d_type, trans_a, trans_b, epilogue, bias_type;
    int8_t fast_accum;
    uint64_t rows[3], cols[3];
    int64_t ld[3];
    int beta_nonzero;
    uint32_t align[3];
} GemmKey;

typedef struct {
    GemmKey key;
    cublasLtMatmulAlgo_t algo;
} GemmChoice;

struct GemmTuning {
    int count;
    GemmChoice choices[TUNE_CACHE];
};

GemmTuning *gemm_tuning_create(void) { return (GemmTuning *)calloc(1, sizeof(GemmTuning)); }

void gemm_tuning_destroy(GemmTuning *t) { free(t); }

// The key of a GEMM (attributes the descriptor or layouts lack stay 0).
static GemmKey gemm_key(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t layouts[3], float beta,
                        const void *pointers[3]) {
    GemmKey k;
    memset(&k, 0, sizeof k);   // compared with memcmp
    size_t got;
    cublasLtMatmulDescGetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &k.trans_a, sizeof k.trans_a, &got);
    cublasLtMatmulDescGetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &k.trans_b, sizeof k.trans_b, &got);
    cublasLtMatmulDescGetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &k.epilogue, sizeof k.epilogue, &got);
    cublasLtMatmulDescGetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &k.bias_type, sizeof k.bias_type, &got);
    cublasLtMatmulDescGetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &k.fast_accum, sizeof k.fast_accum, &got);
    int32_t *types[3] = {&k.a_type, &k.b_type, &k.d_type};
    for (int i = 0; i < 3; i++) {
        cublasLtMatrixLayoutGetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_TYPE, types[i], sizeof *types[i], &got);
        cublasLtMatrixLayoutGetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_ROWS, &k.rows[i], sizeof k.rows[i], &got);
        cublasLtMatrixLayoutGetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_COLS, &k.cols[i], sizeof k.cols[i], &got);
        cublasLtMatrixLayoutGetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_LD, &k.ld[i], sizeof k.ld[i], &got);
        k.align[i] = alignment_of(pointers[i]);
    }
    k.beta_nonzero = beta != 0.0f;
    return k;
}

// Median ms of TUNE_RUNS calls of one algorithm (after TUNE_WARMUP), or a negative value when it fails.
static float time_algo(const cublasLtMatmulAlgo_t *algo, cublasLtMatmulDesc_t desc, const void *a,
                       cublasLtMatrixLayout_t layout_a, const void *b, cublasLtMatrixLayout_t layout_b, void *d,
                       cublasLtMatrixLayout_t layout_d, float beta, const LayersCuda *ctx, cudaStream_t stream,
                       cudaEvent_t ev[2]) {
    float alpha = 1.0f, ms[TUNE_RUNS];
    for (int r = 0; r < TUNE_WARMUP + TUNE_RUNS; r++) {
        if (r >= TUNE_WARMUP && cudaEventRecord(ev[0], stream) != cudaSuccess) return -1.0f;
        if (cublasLtMatmul(ctx->lt, desc, &alpha, a, layout_a, b, layout_b, &beta, d, layout_d, d, layout_d, algo,
                           ctx->lt_workspace, ctx->lt_workspace_bytes, stream) != CUBLAS_STATUS_SUCCESS)
            return -1.0f;
        if (r >= TUNE_WARMUP) {
            if (cudaEventRecord(ev[1], stream) != cudaSuccess || cudaEventSynchronize(ev[1]) != cudaSuccess ||
                cudaEventElapsedTime(&ms[r - TUNE_WARMUP], ev[0], ev[1]) != cudaSuccess)
                return -1.0f;
        }
    }
    for (int i = 1; i < TUNE_RUNS; i++)   // insertion sort: 5 values
        for (int j = i; j > 0 && ms[j] < ms[j - 1]; j--) { float t = ms[j]; ms[j] = ms[j - 1]; ms[j - 1] = t; }
    return ms[TUNE_RUNS / 2];
}

// The tuned algorithm for this GEMM: 1 with *algo set (cached, or timed now), 0 when it is not tuned
// (the caller takes the heuristic's first answer: the stream is being captured, the cache is full,
// no room to save D), -1 when D could not be put back after the timing runs.
int gemm_tuned_algo(cublasLtMatmulAlgo_t *algo, cublasLtMatmulDesc_t desc, cublasLtMatmulPreference_t pref,
                    const void *a, cublasLtMatrixLayout_t layout_a, const void *b, cublasLtMatrixLayout_t layout_b,
                    void *d, cublasLtMatrixLayout_t layout_d, float beta, const LayersCuda *ctx,
                    cudaStream_t stream) {
    GemmTuning *t = ctx->gemm_tuning;
    cublasLtMatrixLayout_t layouts[3] = {layout_a, layout_b, layout_d};
    const void *pointers[3] = {a, b, d};
    GemmKey key = gemm_key(desc, layouts, beta, pointers);
    for (int i = 0; i < t->count; i++)
        if (memcmp(&t->choices[i].key, &key, sizeof key) == 0) {
            *algo = t->choices[i].algo;
            return 1;
        }
    cudaStreamCaptureStatus capturing;
    if (t->count == TUNE_CACHE || cudaStreamIsCapturing(stream, &capturing) != cudaSuccess ||
        capturing != cudaStreamCaptureStatusNone)
        return 0;
    cublasLtMatmulHeuristicResult_t found[TUNE_CANDIDATES];
    int n = 0;
    if (cublasLtMatmulAlgoGetHeuristic(ctx->lt, desc, layout_a, layout_b, layout_d, layout_d, pref, TUNE_CANDIDATES,
                                       found, &n) != CUBLAS_STATUS_SUCCESS || n == 0)
        return 0;
    // D's bytes, saved when the timing runs would accumulate into it; without the room (or events)
    // the GEMM is not tuned
    size_t elem = key.d_type == CUDA_R_32F ? 4 : 2, bytes = ((size_t)key.ld[2] * (key.cols[2] - 1) + key.rows[2]) * elem;
    void *saved = NULL;
    cudaEvent_t ev[2] = {NULL, NULL};
    if (cudaEventCreate(&ev[0]) != cudaSuccess || cudaEventCreate(&ev[1]) != cudaSuccess ||
        (key.beta_nonzero && (cudaMalloc(&saved, bytes) != cudaSuccess ||
                              cudaMemcpyAsync(saved, d, bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess))) {
        for (int i = 0; i < 2; i++) if (ev[i]) cudaEventDestroy(ev[i]);
        cudaFree(saved);
        cudaGetLastError();
        return 0;
    }
    int best = -1;
    float best_ms = 0.0f;
    for (int i = 0; i < n; i++) {
        float ms = time_algo(&found[i].algo, desc, a, layout_a, b, layout_b, d, layout_d, beta, ctx, stream, ev);
        if (ms < 0.0f) continue;   // a candidate that does not run is skipped
        if (best < 0 || ms < best_ms * (best == 0 ? TUNE_MARGIN : 1.0f)) {
            best = i;
            best_ms = ms;
        }
    }
    int restored = !saved || (cudaMemcpyAsync(d, saved, bytes, cudaMemcpyDeviceToDevice, stream) == cudaSuccess &&
                              cudaStreamSynchronize(stream) == cudaSuccess);
    cudaFree(saved);
    for (int i = 0; i < 2; i++) cudaEventDestroy(ev[i]);
    cudaGetLastError();   // a failed candidate leaves nothing behind for the next launch check
    if (!restored) return -1;
    if (best < 0) return 0;
    t->choices[t->count].key = key;
    t->choices[t->count].algo = found[best].algo;
    t->count++;
    *algo = found[best].algo;
    return 1;
}
