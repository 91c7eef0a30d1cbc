// Linear layers through cuBLASLt (bf16 inputs, fp32 accumulation) with fused epilogues, the
// deterministic bias-gradient reduction, and the LayersCuda context they run in.
//
// Row-major (M, IC)·(OC, IC)ᵀ products are written as cuBLASLt column-major products: a row-major
// (R, K) matrix is a column-major (K, R) one, so
//   forward  outᵀ (OC, M)  = W (OC, IC)·inpᵀ (IC, M):    m = OC, n = M,  k = IC, A = weight (T)
//   dinp     dinpᵀ (IC, M) = Wᵀ (IC, OC)·doutᵀ (OC, M):  m = IC, n = M,  k = OC
//   dweight  dWᵀ (IC, OC)  = inpᵀ (IC, M)·dout (M, OC):   m = IC, n = OC, k = M,  B = dout (T)
#include <stdbool.h>
#include "layers/cuda_common.cuh"

#define LT_WORKSPACE_BYTES (32u << 20)   // cuBLASLt workspace (32 MiB, as llm.c)

void layers_cuda_destroy(LayersCuda *ctx) {
    gemm_tuning_destroy(ctx->gemm_tuning);
    if (ctx->lt) cublasLtDestroy(ctx->lt);
    cudaFree(ctx->lt_workspace);
    cudaFree(ctx->scratch);
    cudaFree(ctx->tile_counters);
    *ctx = LayersCuda{};
}

static int layers_cuda_alloc(LayersCuda *ctx, size_t scratch_floats, char *err) {
    cublasStatus_t st = cublasLtCreate(&ctx->lt);
    if (st != CUBLAS_STATUS_SUCCESS) {
        dit_set_error(err, "layers_cuda_create: cublasLtCreate failed: %s", cublasLtGetStatusString(st));
        return -1;
    }
    CUDA_CHECK(err, cudaMalloc(&ctx->lt_workspace, LT_WORKSPACE_BYTES),
               "cuBLASLt workspace of %u bytes", LT_WORKSPACE_BYTES);
    ctx->lt_workspace_bytes = LT_WORKSPACE_BYTES;
    CUDA_CHECK(err, cudaMalloc(&ctx->scratch, scratch_floats * sizeof(float)),
               "reduction scratch of %zu floats", scratch_floats);
    ctx->scratch_floats = scratch_floats;
    CUDA_CHECK(err, cudaMalloc(&ctx->tile_counters, LAYERS_TILE_COUNTERS * sizeof(unsigned)),
               "%d column-tile counters", LAYERS_TILE_COUNTERS);
    CUDA_CHECK(err, cudaMemset(ctx->tile_counters, 0, LAYERS_TILE_COUNTERS * sizeof(unsigned)),
               "zeroing the column-tile counters");
    return 0;
}

int layers_cuda_create(LayersCuda *ctx, size_t scratch_floats, char *err) {
    *ctx = LayersCuda{};
    if (scratch_floats < REDUCE_PARTIALS) scratch_floats = REDUCE_PARTIALS;
    if (layers_cuda_alloc(ctx, scratch_floats, err)) {
        layers_cuda_destroy(ctx);
        return -1;
    }
    return 0;
}

int layers_cuda_set_gemm_tuning(LayersCuda *ctx, int on, char *err) {
    if (!on) {
        gemm_tuning_destroy(ctx->gemm_tuning);
        ctx->gemm_tuning = NULL;
    } else if (!ctx->gemm_tuning && !(ctx->gemm_tuning = gemm_tuning_create())) {
        dit_set_error(err, "layers_cuda_set_gemm_tuning: out of host memory for the algorithm cache");
        return -1;
    }
    return 0;
}

size_t linear_backward_scratch_floats(int M, int OC) { return (size_t)dbias_chunks(M, OC) * OC; }

int lt_matmul_run(cublasLtMatmulDesc_t desc, const void *a, cublasLtMatrixLayout_t layout_a, const void *b,
                  cublasLtMatrixLayout_t layout_b, void *d, cublasLtMatrixLayout_t layout_d, float beta,
                  const char *what, const char *where, const LayersCuda *ctx, cudaStream_t stream, char *err) {
    int status = 0, found = 0;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t heuristic;
    uint64_t workspace_bytes = ctx->lt_workspace_bytes;
    uint32_t align_a = alignment_of(a), align_b = alignment_of(b), align_d = alignment_of(d);
    float alpha = 1.0f;
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulPreferenceCreate(&pref), "%s", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof workspace_bytes),
                        "%s", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof align_a),
                        "%s", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof align_b),
                        "%s", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof align_d),
                        "%s", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof align_d),
                        "%s", what);
    if (ctx->gemm_tuning) {
        found = gemm_tuned_algo(&heuristic.algo, desc, pref, a, layout_a, b, layout_b, d, layout_d, beta, ctx, stream);
        if (found < 0) {
            dit_set_error(err, "%s:%d: %s: the GEMM tuning could not restore D after timing (%s)", __FILE__, __LINE__,
                          what, where);
            status = -1;
            goto cleanup;
        }
    }
    if (!found)
        CUBLASLT_CHECK_GOTO(err, cublasLtMatmulAlgoGetHeuristic(ctx->lt, desc, layout_a, layout_b, layout_d, layout_d, pref, 1,
                                                                &heuristic, &found),
                            "%s (%s)", what, where);
    if (found == 0) {
        dit_set_error(err, "%s:%d: cuBLASLt has no algorithm for %s (%s)", __FILE__, __LINE__, what, where);
        status = -1;
        goto cleanup;
    }
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmul(ctx->lt, desc, &alpha, a, layout_a, b, layout_b, &beta, d, layout_d,
                                            d, layout_d, &heuristic.algo, ctx->lt_workspace, ctx->lt_workspace_bytes, stream),
                        "%s (%s)", what, where);
cleanup:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    return status;
}

// D (m, n) = op(A)·op(B) + beta·D, column-major, op = transpose where trans_*; A, B bf16, D of
// d_type (bf16 or fp32), fp32 accumulation, then the epilogue (bias: OC-long bf16 vector added
// to each column; aux: the GELU pre-activation, ld = m, written by GELU_AUX_BIAS, read by DGELU).
static int matmul(void *d, cudaDataType_t d_type, const bf16 *a, const bf16 *b,
                  int m, int n, int k, bool trans_a, bool trans_b, float beta,
                  cublasLtEpilogue_t epilogue, const bf16 *bias, const bf16 *aux,
                  const char *what, const LayersCuda *ctx, cudaStream_t stream, char *err) {
    int status = 0;
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatrixLayout_t layout_a = NULL, layout_b = NULL, layout_d = NULL;
    cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    int32_t bf16_type = CUDA_R_16BF;
    int64_t aux_ld = m;
    char where[64];
    snprintf(where, sizeof where, "m=%d n=%d k=%d, epilogue %d", m, n, k, (int)epilogue);

    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "%s (%s)", what, where);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a),
                        "%s", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b),
                        "%s", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue),
                        "%s: epilogue %d", what, (int)epilogue);
    if (bias) {
        CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
                            "%s: bias of %d", what, m);
        CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bf16_type, sizeof bf16_type),
                            "%s: bf16 bias", what);
    }
    if (aux) {
        CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux),
                            "%s: aux (%d, %d)", what, m, n);
        CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld),
                            "%s: aux ld %d", what, m);
        CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &bf16_type, sizeof bf16_type),
                            "%s: bf16 aux", what);
    }
    CUBLASLT_CHECK_GOTO(err, cublasLtMatrixLayoutCreate(&layout_a, CUDA_R_16BF, trans_a ? k : m, trans_a ? m : k, trans_a ? k : m),
                        "%s: A layout (m=%d k=%d)", what, m, k);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatrixLayoutCreate(&layout_b, CUDA_R_16BF, trans_b ? n : k, trans_b ? k : n, trans_b ? n : k),
                        "%s: B layout (k=%d n=%d)", what, k, n);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatrixLayoutCreate(&layout_d, d_type, m, n, m),
                        "%s: D layout (m=%d n=%d)", what, m, n);
    status = lt_matmul_run(desc, a, layout_a, b, layout_b, d, layout_d, beta, what, where, ctx, stream, err);
cleanup:
    if (layout_d) cublasLtMatrixLayoutDestroy(layout_d);
    if (layout_b) cublasLtMatrixLayoutDestroy(layout_b);
    if (layout_a) cublasLtMatrixLayoutDestroy(layout_a);
    if (desc) cublasLtMatmulDescDestroy(desc);
    return status;
}

// Block (column tile, chunk) of the bias gradient (cuda_common.cuh's column layout): the sum of
// dout over rows [chunk·chunk_rows, (chunk + 1)·chunk_rows), fixed order; straight into dbias
// when there is one chunk, else through partial[chunk·OC + o] (column_sums_store).
__global__ void dbias_partial_kernel(float *dbias, float *partial, unsigned *counters, const bf16 *dout, int M, int OC,
                                     int chunks, int chunk_rows, bool vec) {
    __shared__ float lanes[COL_WARPS][COLS_PER_BLOCK];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int o = blockIdx.x * COLS_PER_BLOCK + lane * VEC, n = min(VEC, OC - o);
    int row_end = min(M, (int)(blockIdx.y + 1) * chunk_rows);
    float sum[VEC] = {0};
    if (n > 0) {
#pragma unroll 4
        for (int m = blockIdx.y * chunk_rows + warp; m < row_end; m += COL_WARPS) {
            float dy[VEC];
            load_bf16x8(dy, dout + (size_t)m * OC + o, n, vec);
            for (int j = 0; j < VEC; j++) sum[j] += dy[j];
        }
    }
    float total = sum_over_warps(sum, lanes);
    column_sums_store(dbias, NULL, partial, counters, total, 0.0f, 1, 0, blockIdx.y, chunks, OC, OC);
}

// dbias (OC) += Σ_m dout (M, OC) over a fixed chunking of the rows (deterministic).
int linear_dbias_accumulate(float *dbias, const bf16 *dout, int M, int OC,
                            const LayersCuda *ctx, cudaStream_t stream, char *err) {
    int chunks = dbias_chunks(M, OC), chunk_rows = dbias_chunk_rows(M, OC);
    if (linear_backward_scratch_floats(M, OC) > ctx->scratch_floats) {
        dit_set_error(err, "linear_backward_cuda: bias gradient of M=%d OC=%d needs %zu floats of scratch, the context has %zu",
                      M, OC, linear_backward_scratch_floats(M, OC), ctx->scratch_floats);
        return -1;
    }
    dim3 grid(blocks_for(OC, COLS_PER_BLOCK), chunks);
    dbias_partial_kernel<<<grid, BLOCK_SIZE, 0, stream>>>(dbias, ctx->scratch, ctx->tile_counters, dout, M, OC, chunks,
                                                           chunk_rows, OC % VEC == 0 && aligned16(dout));
    LAUNCH_CHECK(err, "dbias_partial_kernel", "M=%d OC=%d chunks=%d", M, OC, chunks);
    return 0;
}

static int check_sizes(const char *fn, int M, int IC, int OC, char *err) {
    if (M <= 0 || IC <= 0 || OC <= 0) {
        dit_set_error(err, "%s: sizes must be positive (M=%d IC=%d OC=%d)", fn, M, IC, OC);
        return -1;
    }
    return 0;
}

int linear_forward_cuda(bf16 *out, const bf16 *inp, const bf16 *weight, const bf16 *bias,
                        int M, int IC, int OC, const LayersCuda *ctx, cudaStream_t stream, char *err) {
    if (check_sizes("linear_forward_cuda", M, IC, OC, err)) return -1;
    char what[128];
    snprintf(what, sizeof what, "linear forward M=%d IC=%d OC=%d", M, IC, OC);
    return matmul(out, CUDA_R_16BF, weight, inp, OC, M, IC, true, false, 0.0f,
                  bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT, bias, NULL,
                  what, ctx, stream, err);
}

int linear_gelu_forward_cuda(bf16 *out, bf16 *pre_gelu, const bf16 *inp, const bf16 *weight,
                             const bf16 *bias, int M, int IC, int OC,
                             const LayersCuda *ctx, cudaStream_t stream, char *err) {
    if (check_sizes("linear_gelu_forward_cuda", M, IC, OC, err)) return -1;
    if (OC % 8 || !bias) {
        dit_set_error(err, "linear_gelu_forward_cuda: needs a bias and OC a multiple of 8 (OC=%d)", OC);
        return -1;
    }
    char what[128];
    snprintf(what, sizeof what, "linear+GELU forward M=%d IC=%d OC=%d", M, IC, OC);
    return matmul(out, CUDA_R_16BF, weight, inp, OC, M, IC, true, false, 0.0f,
                  CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias, pre_gelu, what, ctx, stream, err);
}

// dweight (OC, IC) += doutᵀ·inp in fp32 (beta = 1); then dbias (each skipped when NULL).
static int weight_bias_backward(float *dweight, float dweight_beta, float *dbias, const bf16 *dout, const bf16 *inp,
                                int M, int IC, int OC, const LayersCuda *ctx, cudaStream_t stream, char *err) {
    char what[128];
    snprintf(what, sizeof what, "linear backward dweight M=%d IC=%d OC=%d", M, IC, OC);
    if (dweight && matmul(dweight, CUDA_R_32F, inp, dout, IC, OC, M, false, true, dweight_beta,
                          CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, what, ctx, stream, err)) return -1;
    return dbias ? linear_dbias_accumulate(dbias, dout, M, OC, ctx, stream, err) : 0;
}

int linear_backward_cuda(bf16 *dinp, float dinp_beta, float *dweight, float dweight_beta, float *dbias,
                         const bf16 *dout, const bf16 *inp, const bf16 *weight,
                         int M, int IC, int OC, const LayersCuda *ctx, cudaStream_t stream, char *err) {
    if (check_sizes("linear_backward_cuda", M, IC, OC, err)) return -1;
    if (dinp) {
        // dinp (M, IC) = dinp_beta·dinp + dout·weight (beta 1 accumulates into the bf16 gradient)
        char what[128];
        snprintf(what, sizeof what, "linear backward dinp M=%d IC=%d OC=%d", M, IC, OC);
        if (matmul(dinp, CUDA_R_16BF, weight, dout, IC, M, OC, false, false, dinp_beta,
                   CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, what, ctx, stream, err)) return -1;
    }
    return weight_bias_backward(dweight, dweight_beta, dbias, dout, inp, M, IC, OC, ctx, stream, err);
}

int linear_dgelu_backward_cuda(bf16 *dpre, float *dweight, float dweight_beta, float *dbias,
                               const bf16 *dout, const bf16 *inp, const bf16 *pre_gelu,
                               const bf16 *weight, int M, int IC, int OC,
                               const LayersCuda *ctx, cudaStream_t stream, char *err) {
    if (check_sizes("linear_dgelu_backward_cuda", M, IC, OC, err)) return -1;
    if (IC % 8) {
        dit_set_error(err, "linear_dgelu_backward_cuda: IC must be a multiple of 8 (IC=%d)", IC);
        return -1;
    }
    // dpre (M, IC) = (dout·weight)∘GELU'(pre_gelu): the DGELU epilogue, beta = 0
    char what[128];
    snprintf(what, sizeof what, "linear backward dinp+DGELU M=%d IC=%d OC=%d", M, IC, OC);
    if (matmul(dpre, CUDA_R_16BF, weight, dout, IC, M, OC, false, false, 0.0f,
               CUBLASLT_EPILOGUE_DGELU, NULL, pre_gelu, what, ctx, stream, err)) return -1;
    return weight_bias_backward(dweight, dweight_beta, dbias, dout, inp, M, IC, OC, ctx, stream, err);
}
