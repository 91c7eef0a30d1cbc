// The FP8 linear layer (layers/linear_fp8_cuda.h): per-tensor amax, quantization to e4m3 / e5m2
// with the transposed copies Hopper's FP8 GEMMs need, and cuBLASLt FP8 matmuls.
//
// cuBLASLt on Hopper runs FP8 only as "TN": A transposed and B not, i.e. both operands stored
// with K contiguous (a row-major (rows, K) matrix). In the column-major terms of linear_cuda.cu:
//   forward  outᵀ (OC, M)  = A: weight (OC, IC) · B: inp (M, IC)       m = OC, n = M,  k = IC
//   dinp     dinpᵀ (IC, M) = A: weightᵀ (IC, OC) · B: dout (M, OC)     m = IC, n = M,  k = OC
//   dweight  dWᵀ (IC, OC)  = A: inpᵀ (IC, M) · B: doutᵀ (OC, M)        m = IC, n = OC, k = M
// so the forward uses inp and weight as they are, the backward needs fp8 copies of weightᵀ,
// inpᵀ and both dout and doutᵀ: the quantize kernel writes the row-major copy, the transposed
// one, or both, in one pass over the bf16 tensor. inpᵀ is written by the forward (Fp8Saved) and
// read by the backward. M, the dweight GEMM's k, may be any size: inpᵀ and doutᵀ have Mp =
// fp8_padded_rows(M) columns whose pad is zero, and that GEMM reduces over Mp.
//
// Scaling is "current": each call takes the amax of the tensor it is about to quantize (one
// reduction kernel, 2 bytes read per element), so no value ever saturates and the result does not
// depend on earlier steps. Delayed scaling (Transformer Engine's default) would use a scale from
// the amax history of earlier steps and record this step's amax inside the quantize pass itself:
// it saves the separate amax read (1/3 of the quantization traffic of inp and weight, 1/4 of
// dout's) and the dependency between the two kernels, at the price of saturating whenever a
// tensor grows faster than the history predicts, and of state to carry between steps. A guessed
// exponent (Fp8Scaling) gets delayed scaling's single pass while keeping current scaling's bytes:
// the pass quantizes with the exponent of the tensor's previous quantization and takes the amax on
// the way, and a small second launch re-quantizes only when that amax has another exponent.
#include <cuda_fp8.h>
#include "layers/cuda_common.cuh"
#include "layers/linear_fp8_cuda.h"

#define AMAX_BLOCKS 1024   // grid of the amax reduction (grid-stride; the max is order-free)

// ---- the input: x, or GELU(x) recomputed ----------------------------------------------------
// The VEC values at x, or (GELU) the bf16 values gelu_forward_cuda would store for them.
template <bool GELU>
__device__ inline void load_input(float v[VEC], const bf16 *x) {
    load_bf16x8(v, x, VEC, true);
    if (GELU)
        for (int j = 0; j < VEC; j++) v[j] = bf16_rounded(gelu(v[j]));
}

// ---- amax ----------------------------------------------------------------------------------
// amax[y·stride] = max(amax[y·stride], max_i |x_i|) over the n bf16 x[y·n ..] (or GELU of them; n a
// multiple of VEC, x 16-byte aligned) for each y = blockIdx.y: one tensor, or a stack of them
// (fp8_amax_stacked_cuda). Exact and order-free (block_amax_update, layers/cuda_common.cuh). NaNs
// are skipped here (they reach the GEMM as fp8 NaN).
template <bool GELU>
__global__ void fp8_amax_kernel(float *amax, size_t stride, const bf16 *x, size_t n) {
    x += blockIdx.y * n;
    float m = 0.0f;
    for (size_t i = ((size_t)blockIdx.x * BLOCK_SIZE + threadIdx.x) * VEC; i < n; i += (size_t)gridDim.x * BLOCK_SIZE * VEC) {
        float v[VEC];
        load_input<GELU>(v, x + i);
        for (int j = 0; j < VEC; j++) m = fmaxf(m, fabsf(v[j]));
    }
    block_amax_update(amax + blockIdx.y * stride, m);
}

// The amax kernel over count tensors of n elements each, at most AMAX_BLOCKS blocks in all.
static int launch_amax(float *amax, size_t stride, const bf16 *x, bool gelu, int count, size_t n,
                       cudaStream_t stream, char *err) {
    unsigned int blocks = blocks_for(n / VEC, BLOCK_SIZE), cap = AMAX_BLOCKS / count > 0 ? AMAX_BLOCKS / count : 1;
    if (blocks > cap) blocks = cap;
    (gelu ? fp8_amax_kernel<true> : fp8_amax_kernel<false>)<<<dim3(blocks, count), BLOCK_SIZE, 0, stream>>>(
        amax, stride, x, n);
    LAUNCH_CHECK(err, "fp8_amax_kernel", "%d tensor(s) of %zu, gelu=%d", count, n, (int)gelu);
    return 0;
}

int fp8_amax_stacked_cuda(float *amax, size_t amax_stride, const bf16 *x, int count, size_t n,
                          cudaStream_t stream, char *err) {
    if (count < 1 || count > 65535 || n == 0 || n % VEC || !aligned16(x) || (uintptr_t)amax % 4) {
        dit_set_error(err, "fp8_amax_stacked_cuda: need 1 <= count <= 65535, n a positive multiple of %d, x 16-byte "
                      "and amax 4-byte aligned (count=%d n=%zu)", VEC, count, n);
        return -1;
    }
    return launch_amax(amax, amax_stride, x, false, count, n, stream, err);
}

// ---- quantize ------------------------------------------------------------------------------
// x (R, C) bf16 (or GELU of it) -> q (R, C) and/or qt (C, Rp) fp8 = fp8(x·2^-e), Rp =
// fp8_padded_rows(R), qt's columns R..Rp-1 zero, tile by tile of QTILE_R × QTILE_C. Each thread
// converts 4 rows × 8 columns (four 16-byte loads, four 8-byte stores into q), transposes the 4 × 8
// bytes in registers into 8 words (one column's 4 rows each) and puts them into the shared tile by
// column; then each thread stores two 16-row pieces of one column (16 bytes each; 4 threads cover
// 64 contiguous bytes of a qt row). Rows R.. are zeros (qt's pad). C a multiple of 16.
#define QTILE_R 128        // rows of a tile: 32 groups of 4
#define QTILE_C 64         // columns of a tile: 8 vectors of VEC
#define QTILE_WORDS (QTILE_R / 4 + 1)   // words per tile column (4 rows each), + 1 against bank conflicts
#define REQUANTIZE_BLOCKS 264           // grid of the guess's check (2 per SM on an H200): it exits at once
                                        // when the guess was right, else loops over the tiles
static_assert((QTILE_R / 4) * (QTILE_C / VEC) == BLOCK_SIZE && QTILE_C * 4 == BLOCK_SIZE,
              "one thread per 4 × VEC piece, and 4 per tile column");

// The tile at rows r0.., columns c0.. with the scale 2^e; returns max |x| over this thread's values
// (NaN skipped, as fp8_amax_kernel). With qt, the shared tile is busy until the caller's next
// __syncthreads.
template <bool GELU>
__device__ inline float quantize_tile(uint32_t (*tile)[QTILE_WORDS], uint8_t *q, uint8_t *qt, const bf16 *x,
                                      int R, int C, int r0, int c0, int e, Fp8Format format) {
    __nv_fp8_interpretation_t kind = format == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2;
    float down = ldexpf(1.0f, -e), m = 0.0f;
    int group = threadIdx.x / 8, cc = (threadIdx.x % 8) * VEC, c = c0 + cc;
    if (c < C) {                          // C % 16 == 0: a vector is whole or absent
        int r = r0 + 4 * group;
        bool whole = r + 3 < R;           // all four rows inside: the four loads unconditional
        float v[4][VEC];                  // rows R..: zeros, qt's pad
        for (int i = 0; i < 4; i++) {
            if (whole || r + i < R) load_input<GELU>(v[i], x + (size_t)(r + i) * C + c);
            else for (int j = 0; j < VEC; j++) v[i][j] = 0.0f;
            for (int j = 0; j < VEC; j++) m = fmaxf(m, fabsf(v[i][j]));
        }
        uint32_t lo[4], hi[4];            // row i's columns cc..cc+3 and cc+4..cc+7
        for (int i = 0; i < 4; i++) {
            uint16_t b[VEC / 2];
            for (int j = 0; j < VEC / 2; j++)
                b[j] = __nv_cvt_float2_to_fp8x2(make_float2(v[i][2 * j] * down, v[i][2 * j + 1] * down),
                                                __NV_SATFINITE, kind);
            lo[i] = b[0] | (uint32_t)b[1] << 16;
            hi[i] = b[2] | (uint32_t)b[3] << 16;
            if (q && r + i < R) *(uint2 *)(q + (size_t)(r + i) * C + c) = make_uint2(lo[i], hi[i]);
        }
        if (qt) {
            uint32_t col[VEC];
            transpose_4x4_bytes(col, lo[0], lo[1], lo[2], lo[3]);
            transpose_4x4_bytes(col + 4, hi[0], hi[1], hi[2], hi[3]);
            for (int j = 0; j < VEC; j++) tile[cc + j][group] = col[j];
        }
    }
    if (!qt) return m;
    __syncthreads();
    int cl = threadIdx.x / 4, Rp = fp8_padded_rows(R);   // the tile column; its rows 16k.. and 64 + 16k..
    c = c0 + cl;
    if (c < C) {
        for (int half = 0; half < 2; half++) {
            int w = half * (QTILE_R / 8) + (threadIdx.x % 4) * 4, r = r0 + 4 * w;
            if (r >= Rp) break;           // Rp % 16 == 0: 16 rows are whole or absent
            *(uint4 *)(qt + (size_t)c * Rp + r) =
                make_uint4(tile[cl][w], tile[cl][w + 1], tile[cl][w + 2], tile[cl][w + 3]);
        }
    }
    return m;
}

// One block per tile. The exponent: of *amax (known), or GUESSED: guess[0], which block (0, 0)
// records in guess[1] for fp8_requantize_kernel, and the pass raises *taken to max |x|.
// *scale = 2^e (block (0, 0)).
// (6 blocks per SM: the GELU instantiation's 32 tanhf per thread need the occupancy: 0.63 instead
// of 0.74 ms per step at c, dev/notes_linear_fp8.md)
template <bool GELU, bool GUESSED>
__global__ void __launch_bounds__(BLOCK_SIZE, 6)
    fp8_quantize_kernel(uint8_t *q, uint8_t *qt, float *scale, const bf16 *x, const float *amax, int *guess,
                        float *taken, int R, int C, Fp8Format format) {
    __shared__ uint32_t tile[QTILE_C][QTILE_WORDS];
    int e = GUESSED ? guess[0] : fp8_scale_exponent(*amax, format);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        *scale = ldexpf(1.0f, e);
        if (GUESSED) guess[1] = e;
    }
    float m = quantize_tile<GELU>(tile, q, qt, x, R, C, blockIdx.y * QTILE_R, blockIdx.x * QTILE_C, e, format);
    if (GUESSED) block_amax_update(taken, m);
}

// The check after a guessed pass: e = the exponent of the amax it took; block 0 keeps
// fp8_next_guess(e) as the next guess (guess[0]: read by no block of this kernel); unless the
// exponent the pass used (guess[1]) is kept (fp8_guess_kept), the whole tensor again with
// fp8_next_guess(e) (the tiles in turn over the grid) and *scale = 2^that.
template <bool GELU>
__global__ void __launch_bounds__(BLOCK_SIZE, 6)
    fp8_requantize_kernel(uint8_t *q, uint8_t *qt, float *scale, const bf16 *x, const float *amax, int *guess,
                          int headroom, int R, int C, Fp8Format format) {
    __shared__ uint32_t tile[QTILE_C][QTILE_WORDS];
    int e_amax = fp8_scale_exponent(*amax, format), kept = fp8_guess_kept(guess[1], e_amax, headroom);
    int e = fp8_next_guess(e_amax, headroom);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        guess[0] = e;
        if (!kept) *scale = ldexpf(1.0f, e);
    }
    if (kept) return;
    int tiles_c = (C + QTILE_C - 1) / QTILE_C, tiles = tiles_c * ((fp8_padded_rows(R) + QTILE_R - 1) / QTILE_R);
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        quantize_tile<GELU>(tile, q, qt, x, R, C, t / tiles_c * QTILE_R, t % tiles_c * QTILE_C, e, format);
        __syncthreads();                  // the shared tile is free again
    }
}

static int check_quantize_args(const char *fn, const uint8_t *q, const uint8_t *qt, const bf16 *x, int R, int C,
                               char *err) {
    if (R <= 0 || C <= 0 || C % 16) {
        dit_set_error(err, "%s: need R >= 1 and C a positive multiple of 16 (R=%d C=%d)", fn, R, C);
        return -1;
    }
    if (!aligned16(x) || (uintptr_t)q % 8 || !aligned16(qt)) {
        dit_set_error(err, "%s: x and qt must be 16-byte aligned, q 8-byte aligned (R=%d C=%d)", fn, R, C);
        return -1;
    }
    return 0;
}

// Without the argument check: scaling NULL or all NULL (amax = 0, the amax reduction into *amax_scratch, the
// quantization), known (the quantization with that amax) or guessed (the quantization with the
// guess, then its check: Fp8Scaling). gelu: the tensor quantized is GELU(x) (bf16-rounded as
// gelu_forward_cuda stores it), not x.
static int quantize(uint8_t *q, uint8_t *qt, float *scale, const bf16 *x, bool gelu, int R, int C, Fp8Format format,
                    const Fp8Scaling *scaling, float *amax_scratch, cudaStream_t stream, char *err) {
    const float *amax = scaling ? scaling->amax : NULL;
    int *guess = scaling && !amax ? scaling->exponent : NULL;
    float *taken = scaling && !amax ? scaling->taken : NULL;
    if (!guess != !taken || (uintptr_t)guess % 4 || (uintptr_t)taken % 4 || (guess && scaling->headroom < 0)) {
        dit_set_error(err, "fp8 quantization of (%d, %d): a guessed Fp8Scaling needs both exponent and taken, 4-byte "
                      "aligned, and a headroom >= 0 (got %p, %p, %d)", R, C, (void *)guess, (void *)taken,
                      scaling ? scaling->headroom : 0);
        return -1;
    }
    if (!amax && !guess) {
        CUDA_CHECK(err, cudaMemsetAsync(amax_scratch, 0, sizeof(float), stream), "fp8 amax of (%d, %d)", R, C);
        if (launch_amax(amax_scratch, 0, x, gelu, 1, (size_t)R * C, stream, err)) return -1;
        amax = amax_scratch;
    }
    dim3 grid(blocks_for(C, QTILE_C), blocks_for(fp8_padded_rows(R), QTILE_R));
    auto kernel = guess ? (gelu ? fp8_quantize_kernel<true, true> : fp8_quantize_kernel<false, true>)
                        : (gelu ? fp8_quantize_kernel<true, false> : fp8_quantize_kernel<false, false>);
    kernel<<<grid, BLOCK_SIZE, 0, stream>>>(q, qt, scale, x, amax, guess, taken, R, C, format);
    LAUNCH_CHECK(err, "fp8_quantize_kernel", "R=%d C=%d format=%d gelu=%d guessed=%d", R, C, (int)format, (int)gelu,
                 guess != NULL);
    if (!guess) return 0;
    unsigned int tiles = grid.x * grid.y;
    (gelu ? fp8_requantize_kernel<true> : fp8_requantize_kernel<false>)<<<
        tiles < REQUANTIZE_BLOCKS ? tiles : REQUANTIZE_BLOCKS, BLOCK_SIZE, 0, stream>>>(
        q, qt, scale, x, taken, guess, scaling->headroom, R, C, format);
    LAUNCH_CHECK(err, "fp8_requantize_kernel", "R=%d C=%d format=%d gelu=%d", R, C, (int)format, (int)gelu);
    return 0;
}

int fp8_quantize_cuda(uint8_t *q, uint8_t *qt, float *scale, const bf16 *x, int R, int C,
                      Fp8Format format, float *amax_scratch, cudaStream_t stream, char *err) {
    if (check_quantize_args("fp8_quantize_cuda", q, qt, x, R, C, err)) return -1;
    return quantize(q, qt, scale, x, false, R, C, format, NULL, amax_scratch, stream, err);
}

int fp8_quantize_guessed_cuda(uint8_t *q, uint8_t *qt, float *scale, const bf16 *x, int R, int C,
                              Fp8Format format, int *exponent, float *amax, cudaStream_t stream, char *err) {
    if (check_quantize_args("fp8_quantize_guessed_cuda", q, qt, x, R, C, err)) return -1;
    Fp8Scaling guessed = {NULL, exponent, amax, 0};
    return quantize(q, qt, scale, x, false, R, C, format, &guessed, NULL, stream, err);
}

// ---- workspace -----------------------------------------------------------------------------
// [0, HEADER_BYTES): amax and scale of inp, weight, dout, each float alone in a 256-byte slot (the
// alignment cudaMalloc gives, as in NVIDIA's FP8 samples: cuBLASLt reads the scales through
// device pointers, and session 6's 4-byte-aligned weight scale came with "not supported"); then
// the fp8 copies, each 256-byte aligned: forward inp_q (M, IC), w_q (OC, IC); backward (the same
// bytes) dout_q (M, OC), dout_qt (OC, Mp), w_qt (IC, OC). (inpᵀ is the caller's: Fp8Saved.)
#define SLOT_FLOATS 64                          // 256 bytes
#define HEADER_BYTES (6 * SLOT_FLOATS * 4)      // amax[3], scale[3]
enum { T_INP = 0, T_WEIGHT = SLOT_FLOATS, T_DOUT = 2 * SLOT_FLOATS };   // float offsets of the slots
static size_t round256(size_t n) { return (n + 255) / 256 * 256; }

size_t linear_fp8_workspace_bytes(int M, int IC, int OC) {
    size_t mi = round256((size_t)M * IC), mo = round256((size_t)M * OC), io = round256((size_t)IC * OC);
    size_t mpo = round256((size_t)fp8_padded_rows(M) * OC);
    size_t forward = mi + io, backward = mo + mpo + io;
    return HEADER_BYTES + (forward > backward ? forward : backward);
}

typedef struct {
    float *amax, *scale;   // indexed T_INP, T_WEIGHT, T_DOUT
    uint8_t *next;         // the next free byte of the fp8 copies
} Workspace;

// The slots and the first free byte of the 256-byte aligned workspace.
static Workspace workspace_at(void *workspace) {
    return (Workspace){(float *)workspace, (float *)workspace + 3 * SLOT_FLOATS, (uint8_t *)workspace + HEADER_BYTES};
}

static uint8_t *take(Workspace *ws, size_t bytes) {
    uint8_t *p = ws->next;
    ws->next += round256(bytes);
    return p;
}

// x: inp (the forward's) or dout (the backward's) bf16 operand.
static int check_args(const char *fn, const char *x_name, const bf16 *x, const bf16 *weight, int M, int IC, int OC,
                      void *workspace, size_t workspace_bytes, const LayersCuda *ctx, Workspace *ws, char *err) {
    if (check_context(fn, ctx, err)) return -1;
    if (M <= 0 || IC <= 0 || OC <= 0 || IC % 16 || OC % 16) {
        dit_set_error(err, "%s: need M >= 1 and IC, OC positive multiples of 16 (cuBLASLt FP8 leading dimensions; "
                      "M=%d IC=%d OC=%d)", fn, M, IC, OC);
        return -1;
    }
    if (!aligned16(x) || !aligned16(weight)) {
        dit_set_error(err, "%s: %s and weight must be 16-byte aligned (M=%d IC=%d OC=%d)", fn, x_name, M, IC, OC);
        return -1;
    }
    if (!workspace || (uintptr_t)workspace % 256 || workspace_bytes < linear_fp8_workspace_bytes(M, IC, OC)) {
        dit_set_error(err, "%s: workspace must be 256-byte aligned with at least %zu bytes (got %zu at %p; M=%d IC=%d OC=%d)",
                      fn, linear_fp8_workspace_bytes(M, IC, OC), workspace_bytes, workspace, M, IC, OC);
        return -1;
    }
    *ws = workspace_at(workspace);
    return 0;
}

// The saved input copy: required (the backward's) or optional (the forward's save).
static int check_saved(const char *fn, const char *name, const Fp8Saved *saved, bool required, int M, int IC,
                       char *err) {
    if (!saved && !required) return 0;
    if (!saved || !saved->qt || !aligned16(saved->qt) || !saved->scale || (uintptr_t)saved->scale % 4) {
        dit_set_error(err, "%s: %s must be an Fp8Saved with qt (IC=%d, Mp=%d) 16-byte aligned and a 4-byte "
                      "aligned scale (got %s%p, %p; M=%d)", fn, name, IC, fp8_padded_rows(M), saved ? "" : "NULL ",
                      saved ? (void *)saved->qt : NULL, saved ? (void *)saved->scale : NULL, M);
        return -1;
    }
    return 0;
}

// ---- FP8 matmul ----------------------------------------------------------------------------
// D (m, n) = scale_a·scale_b·Aᵀ·B + beta·D, column-major; A (k, m) and B (k, n) fp8, both with K
// contiguous (lda = ldb = k), fp32 accumulation (fast_accum: the tensor cores' own, FAST_ACCUM), D
// (and C) of d_type (bf16 or fp32); bias: an m-long bf16 vector added to each column in the epilogue
// (NULL: none).
// cuBLAS's FP8 rules (cublasLtMatmul, "To use FP8 kernels ..."), all met here: A transposed and B
// not ("TN"), CUBLAS_COMPUTE_32F, scale type CUDA_R_32F, every matrix pointer 16-byte aligned and
// the dimensions of "Tensor Core Usage" 16-byte multiples: k = lda = ldb (fp8) and m = ldd (bf16 or
// fp32) multiples of 16 (IC, OC, or the padded Mp: checked by the callers); n (= M in the forward
// and dinp GEMMs) is free, as in torch._scaled_mm; the type table's rows used: A e4m3 with
// B e4m3 or e5m2, C = D bf16 with a bf16 bias, or C = D fp32 without a bias. Tensor-wide scales
// (the default scale mode) through device pointers, each 256-byte aligned.
static int fp8_matmul(void *d, cudaDataType_t d_type, const uint8_t *a, cudaDataType_t a_type, const float *scale_a,
                      const uint8_t *b, cudaDataType_t b_type, const float *scale_b, int m, int n, int k, float beta,
                      const bf16 *bias, bool fast_accum, const char *what, const LayersCuda *ctx,
                      cudaStream_t stream, char *err) {
    int status = 0;
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatrixLayout_t layout_a = NULL, layout_b = NULL, layout_d = NULL;
    cublasOperation_t op_a = CUBLAS_OP_T, op_b = CUBLAS_OP_N;
    cublasLtEpilogue_t epilogue = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    int32_t bf16_type = CUDA_R_16BF;
    int8_t fast_accum_flag = fast_accum;
    uint32_t align_a = alignment_of(a), align_b = alignment_of(b), align_d = alignment_of(d);
    // every pointer's alignment, for the messages (cuBLASLt answers a misaligned one with "not supported")
    char where[224];
    snprintf(where, sizeof where, "m=%d n=%d k=%d; alignment A %u B %u D %u bias %u scales %u %u; FP8 needs sm_89+; "
             "CUBLASLT_LOG_MASK=31 logs cuBLASLt's reason", m, n, k, align_a, align_b, align_d,
             bias ? alignment_of(bias) : 0, alignment_of(scale_a), alignment_of(scale_b));
    if (align_a < 16 || align_b < 16 || align_d < 16 || (bias && alignment_of(bias) < 16)) {
        dit_set_error(err, "%s:%d: %s: FP8 GEMMs need 16-byte aligned matrices and bias (%s)", __FILE__, __LINE__,
                      what, where);
        return -1;
    }

    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "%s (%s)", what, where);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a),
                        "%s", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b),
                        "%s", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum_flag,
                                                            sizeof fast_accum_flag),
                        "%s", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof scale_a),
                        "%s: A scale", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof scale_b),
                        "%s: B scale", what);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue),
                        "%s: epilogue %d", what, (int)epilogue);
    if (bias) {
        CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
                            "%s: bias of %d", what, m);
        CUBLASLT_CHECK_GOTO(err, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bf16_type, sizeof bf16_type),
                            "%s: bf16 bias", what);
    }
    CUBLASLT_CHECK_GOTO(err, cublasLtMatrixLayoutCreate(&layout_a, a_type, k, m, k), "%s: A layout (m=%d k=%d)", what, m, k);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatrixLayoutCreate(&layout_b, b_type, k, n, k), "%s: B layout (k=%d n=%d)", what, k, n);
    CUBLASLT_CHECK_GOTO(err, cublasLtMatrixLayoutCreate(&layout_d, d_type, m, n, m), "%s: D layout (m=%d n=%d)", what, m, n);
    status = lt_matmul_run(desc, a, layout_a, b, layout_b, d, layout_d, beta, what, where, ctx, stream, err);
cleanup:
    if (layout_d) cublasLtMatrixLayoutDestroy(layout_d);
    if (layout_b) cublasLtMatrixLayoutDestroy(layout_b);
    if (layout_a) cublasLtMatrixLayoutDestroy(layout_a);
    if (desc) cublasLtMatmulDescDestroy(desc);
    return status;
}

// ---- the layer -----------------------------------------------------------------------------
// The forward of inp, or (gelu) of GELU(inp).
static int forward(const char *fn, bf16 *out, const bf16 *inp, bool gelu, const bf16 *weight, const bf16 *bias, int M,
                   int IC, int OC, const Fp8Saved *save, const Fp8Saved *save_weight, const Fp8Scaling *inp_scaling,
                   const Fp8Scaling *weight_scaling, void *workspace, size_t workspace_bytes, const LayersCuda *ctx,
                   cudaStream_t stream, char *err) {
    Workspace ws;
    if (check_args(fn, gelu ? "pre_gelu" : "inp", inp, weight, M, IC, OC, workspace, workspace_bytes, ctx, &ws, err) ||
        check_saved(fn, "save", save, false, M, IC, err) ||
        check_saved(fn, "save_weight", save_weight, false, OC, IC, err))
        return -1;
    uint8_t *inp_q = take(&ws, (size_t)M * IC), *w_q = take(&ws, (size_t)OC * IC);
    // inp_q (M, IC) for the GEMM and, to keep, inpᵀ (IC, Mp) from the same pass; one scale
    float *inp_scale = save ? save->scale : ws.scale + T_INP;
    if (quantize(inp_q, save ? save->qt : NULL, inp_scale, inp, gelu, M, IC, FP8_E4M3, inp_scaling,
                 ws.amax + T_INP, stream, err))
        return -1;
    // w_q (OC, IC) and, to keep, weightᵀ (IC, OC) likewise
    float *w_scale = save_weight ? save_weight->scale : ws.scale + T_WEIGHT;
    if (quantize(w_q, save_weight ? save_weight->qt : NULL, w_scale, weight, false, OC, IC, FP8_E4M3, weight_scaling,
                 ws.amax + T_WEIGHT, stream, err))
        return -1;
    // outᵀ (OC, M) = scale_w·scale_inp·w_q·inp_qᵀ + bias
    char what[128];
    snprintf(what, sizeof what, "%s M=%d IC=%d OC=%d", fn, M, IC, OC);
    return fp8_matmul(out, CUDA_R_16BF, w_q, CUDA_R_8F_E4M3, w_scale, inp_q, CUDA_R_8F_E4M3, inp_scale, OC, M, IC,
                      0.0f, bias, ctx->fp8_accumulation >= FP8_ACCUM_FAST_FORWARD, what, ctx, stream, err);
}

int linear_fp8_forward_cuda(bf16 *out, const bf16 *inp, const bf16 *weight, const bf16 *bias,
                            int M, int IC, int OC, const Fp8Saved *save, const Fp8Saved *save_weight,
                            const Fp8Scaling *inp_scaling, const Fp8Scaling *weight_scaling, void *workspace,
                            size_t workspace_bytes, const LayersCuda *ctx, cudaStream_t stream, char *err) {
    return forward("linear_fp8_forward_cuda", out, inp, false, weight, bias, M, IC, OC, save, save_weight, inp_scaling,
                   weight_scaling, workspace, workspace_bytes, ctx, stream, err);
}

int linear_fp8_forward_gelu_input_cuda(bf16 *out, const bf16 *pre_gelu, const bf16 *weight, const bf16 *bias,
                                       int M, int IC, int OC, const Fp8Saved *save, const Fp8Saved *save_weight,
                                       const Fp8Scaling *inp_scaling, const Fp8Scaling *weight_scaling,
                                       void *workspace, size_t workspace_bytes, const LayersCuda *ctx,
                                       cudaStream_t stream, char *err) {
    return forward("linear_fp8_forward_gelu_input_cuda", out, pre_gelu, true, weight, bias, M, IC, OC, save,
                   save_weight, inp_scaling, weight_scaling, workspace, workspace_bytes, ctx, stream, err);
}

int linear_fp8_gelu_forward_cuda(bf16 *out, bf16 *pre_gelu, const bf16 *inp, const bf16 *weight, const bf16 *bias,
                                 int M, int IC, int OC, const Fp8Saved *save, const Fp8Saved *save_weight,
                                 const Fp8Scaling *inp_scaling, const Fp8Scaling *weight_scaling, float *out_amax,
                                 void *workspace, size_t workspace_bytes, const LayersCuda *ctx, cudaStream_t stream,
                                 char *err) {
    if (linear_fp8_forward_cuda(pre_gelu, inp, weight, bias, M, IC, OC, save, save_weight, inp_scaling,
                                weight_scaling, workspace, workspace_bytes, ctx, stream, err))
        return -1;
    return gelu_forward_cuda(out, pre_gelu, (size_t)M * OC, out_amax, stream, err);
}

int linear_fp8_dout_slots(Fp8Dout *dout, void *workspace, size_t workspace_bytes, int M, int IC, int OC, char *err) {
    if (M <= 0 || IC <= 0 || OC <= 0 || !workspace || (uintptr_t)workspace % 256 ||
        workspace_bytes < linear_fp8_workspace_bytes(M, IC, OC)) {
        dit_set_error(err, "linear_fp8_dout_slots: need positive sizes and a 256-byte aligned workspace of at least "
                      "%zu bytes (got %zu at %p; M=%d IC=%d OC=%d)", M > 0 && IC > 0 && OC > 0 ?
                      linear_fp8_workspace_bytes(M, IC, OC) : 0, workspace_bytes, workspace, M, IC, OC);
        return -1;
    }
    Workspace ws = workspace_at(workspace);
    dout->q = take(&ws, (size_t)M * OC);   // where backward() takes them
    dout->qt = take(&ws, (size_t)fp8_padded_rows(M) * OC);
    dout->scale = ws.scale + T_DOUT;
    return 0;
}

// dinp (bf16) = dinp_beta·dinp + dout·weight (dinp may be NULL); dweight = dweight_beta·dweight +
// doutᵀ·inp (inp: the forward's saved inpᵀ and scale); dbias += Σ_m dout. dout_amax: max |dout| or
// NULL (computed here); weight_saved: weightᵀ as the forward kept it, or NULL: quantized here
// (weight_amax: max |weight|, or NULL). dout8: the dout already quantized (dout, dout_amax and dbias
// then unused), or NULL.
static int backward(const char *fn, bf16 *dinp, float dinp_beta, float *dweight, float dweight_beta, float *dbias,
                    const bf16 *dout, const Fp8Dout *dout8, const Fp8Saved *inp, const bf16 *weight,
                    const Fp8Saved *weight_saved, int M, int IC, int OC, Fp8Format grad_format,
                    const float *dout_amax, const float *weight_amax, void *workspace, size_t workspace_bytes,
                    const LayersCuda *ctx, cudaStream_t stream, char *err) {
    Workspace ws;
    if (grad_format != FP8_E4M3 && grad_format != FP8_E5M2) {
        dit_set_error(err, "%s: grad_format must be FP8_E4M3 or FP8_E5M2 (got %d)", fn, (int)grad_format);
        return -1;
    }
    if (dout8 && (!dout8->qt || !aligned16(dout8->qt) || (dinp && (!dout8->q || !aligned16(dout8->q))) ||
                  !dout8->scale || (uintptr_t)dout8->scale % 4)) {
        dit_set_error(err, "%s: dout must be an Fp8Dout with qt (and q, with dinp) 16-byte aligned and a scale "
                      "(M=%d IC=%d OC=%d)", fn, M, IC, OC);
        return -1;
    }
    if (check_args(fn, dout8 ? "weight" : "dout", dout8 ? weight : dout, weight, M, IC, OC, workspace,
                   workspace_bytes, ctx, &ws, err) ||
        check_saved(fn, "inp", inp, true, M, IC, err) ||
        check_saved(fn, "weight_saved", weight_saved, false, OC, IC, err))
        return -1;
    int Mp = fp8_padded_rows(M);
    uint8_t *dout_q = take(&ws, (size_t)M * OC), *dout_qt = take(&ws, (size_t)Mp * OC);
    uint8_t *w_qt = take(&ws, (size_t)IC * OC);
    const float *dout_scale = ws.scale + T_DOUT;
    cudaDataType_t grad_type = grad_format == FP8_E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
    Fp8Scaling dout_known = {dout_amax, NULL, NULL, 0}, weight_known = {weight_amax, NULL, NULL, 0};
    if (dout8) {
        dout_q = dout8->q;
        dout_qt = dout8->qt;
        dout_scale = dout8->scale;
        dbias = NULL;
    } else if (quantize(dinp ? dout_q : NULL, dout_qt, ws.scale + T_DOUT, dout, false, M, OC, grad_format,
                        dout_amax ? &dout_known : NULL, ws.amax + T_DOUT, stream, err)) {
        return -1;
    }
    char what[128];
    if (dinp) {
        // dinpᵀ (IC, M) = scale_w·scale_dout·w_qt·dout_qᵀ + dinp_beta·dinpᵀ
        const float *w_scale = ws.scale + T_WEIGHT;
        if (weight_saved) {
            w_qt = weight_saved->qt;
            w_scale = weight_saved->scale;
        } else if (quantize(NULL, w_qt, ws.scale + T_WEIGHT, weight, false, OC, IC, FP8_E4M3,
                            weight_amax ? &weight_known : NULL, ws.amax + T_WEIGHT, stream, err)) {
            return -1;
        }
        snprintf(what, sizeof what, "%s: dinp M=%d IC=%d OC=%d", fn, M, IC, OC);
        if (fp8_matmul(dinp, CUDA_R_16BF, w_qt, CUDA_R_8F_E4M3, w_scale, dout_q, grad_type,
                       dout_scale, IC, M, OC, dinp_beta, NULL, ctx->fp8_accumulation == FP8_ACCUM_FAST_ALL, what, ctx,
                       stream, err)) return -1;
    }
    // dWᵀ (IC, OC) = scale_inp·scale_dout·inp_qt·dout_qtᵀ + dweight_beta·dWᵀ in fp32, k = Mp (the pad is zero)
    snprintf(what, sizeof what, "%s: dweight M=%d (Mp=%d) IC=%d OC=%d", fn, M, Mp, IC, OC);
    if (fp8_matmul(dweight, CUDA_R_32F, inp->qt, CUDA_R_8F_E4M3, inp->scale, dout_qt, grad_type,
                   dout_scale, IC, OC, Mp, dweight_beta, NULL, ctx->fp8_accumulation == FP8_ACCUM_FAST_ALL, what, ctx,
                   stream, err)) return -1;
    return dbias ? linear_dbias_accumulate(dbias, dout, M, OC, ctx, stream, err) : 0;
}

int linear_fp8_backward_cuda(bf16 *dinp, float dinp_beta, float *dweight, float dweight_beta, float *dbias,
                             const bf16 *dout, const Fp8Saved *inp, const bf16 *weight, const Fp8Saved *weight_saved,
                             int M, int IC, int OC, Fp8Format grad_format, const float *dout_amax,
                             const float *weight_amax, void *workspace, size_t workspace_bytes,
                             const LayersCuda *ctx, cudaStream_t stream, char *err) {
    return backward("linear_fp8_backward_cuda", dinp, dinp_beta, dweight, dweight_beta, dbias, dout, NULL, inp,
                    weight, weight_saved, M, IC, OC, grad_format, dout_amax, weight_amax, workspace,
                    workspace_bytes, ctx, stream, err);
}

int linear_fp8_backward_quantized_cuda(bf16 *dinp, float dinp_beta, float *dweight, float dweight_beta,
                                       const Fp8Dout *dout, const Fp8Saved *inp, const bf16 *weight,
                                       const Fp8Saved *weight_saved, int M, int IC, int OC, Fp8Format grad_format,
                                       const float *weight_amax, void *workspace, size_t workspace_bytes,
                                       const LayersCuda *ctx, cudaStream_t stream, char *err) {
    if (!dout) {
        dit_set_error(err, "linear_fp8_backward_quantized_cuda: dout is NULL (M=%d IC=%d OC=%d)", M, IC, OC);
        return -1;
    }
    return backward("linear_fp8_backward_quantized_cuda", dinp, dinp_beta, dweight, dweight_beta, NULL, NULL, dout,
                    inp, weight, weight_saved, M, IC, OC, grad_format, NULL, weight_amax, workspace,
                    workspace_bytes, ctx, stream, err);
}

int linear_fp8_dgelu_backward_cuda(bf16 *dpre, float *dweight, float dweight_beta, float *dbias,
                                   const bf16 *dout, const Fp8Saved *inp, const bf16 *pre_gelu, const bf16 *weight,
                                   const Fp8Saved *weight_saved, int M, int IC, int OC, Fp8Format grad_format,
                                   const float *dout_amax, const float *weight_amax, float *dpre_amax,
                                   float *dpre_dbias, void *workspace, size_t workspace_bytes, const LayersCuda *ctx,
                                   cudaStream_t stream, char *err) {
    // dpre = dout·weight written (beta = 0), then dpre ∘= GELU'(pre_gelu) in place (its amax, and the
    // next layer's dbias in the same pass when asked)
    if (backward("linear_fp8_dgelu_backward_cuda", dpre, 0.0f, dweight, dweight_beta, dbias, dout, NULL, inp, weight,
                 weight_saved, M, IC, OC, grad_format, dout_amax, weight_amax, workspace, workspace_bytes, ctx,
                 stream, err))
        return -1;
    if (dpre_dbias)
        return gelu_backward_inplace_dbias_cuda(dpre, pre_gelu, dpre_dbias, M, IC, dpre_amax, ctx, stream, err);
    return gelu_backward_inplace_cuda(dpre, pre_gelu, (size_t)M * IC, dpre_amax, stream, err);
}
