// Device helpers shared by the layers' kernels: grid sizes and fixed-order reductions.
#pragma once
#include <cuda_bf16.h>
#include "layers/layers_cuda.h"
#include "layers/cuda_check.h"

#define BLOCK_SIZE 256

static inline unsigned int blocks_for(size_t n, int block_size) {
    return (unsigned int)((n + block_size - 1) / block_size);
}

// Sum over the 32 lanes of a warp by xor butterfly: every lane gets the same, order-fixed sum.
__device__ inline float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum of v over a block of BLOCK_SIZE threads (warp sums, then warp 0 adds them in order);
// valid in thread 0.
__device__ inline float block_sum(float v) {
    __shared__ float warp_sums[BLOCK_SIZE / 32];
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
    __syncthreads();
    float sum = 0.0f;
    if (threadIdx.x == 0)
        for (int i = 0; i < BLOCK_SIZE / 32; i++) sum += warp_sums[i];
    return sum;
}

// ---- amax: max |x| for the FP8 layers' scales (layers/linear_fp8_cuda.h) ----------------------
// A producer of a tensor that an FP8 linear quantizes can take its amax on the way: each thread
// folds |x| of the bf16 values it stores into m (fmaxf: NaN skipped), then one of these folds m
// into *amax. *amax and m are non-negative floats, whose bits order as unsigned ints: atomicMax
// on the bits is exact and order-free, so the amax (and the scale) are bitwise those of a
// separate pass. The read first skips the atomic when *amax is already >= m (a stale read is
// smaller, never larger: it only costs an atomic); __ldcg reads L2, where the atomics land.
__device__ inline void amax_update(float *amax, float m) {
    if (m > __ldcg(amax)) atomicMax((unsigned int *)amax, __float_as_uint(m));
}

// The float the bf16 store of x holds (round to nearest even, as store_bf16x8).
__device__ inline float bf16_rounded(float x) { return __bfloat162float(__float2bfloat16(x)); }

// GELU(x) = 0.5·x·(1 + tanh(u)), u = sqrt(2/π)·(x + 0.044715·x³): gelu_forward_cuda's, and the FP8
// linear's whose input is GELU(x) (linear_fp8_forward_gelu_input_cuda): one expression, the same bits.
#define GELU_SCALE 0.7978845608028654f   // sqrt(2/π)
__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.0f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x)));
}

// GELU'(x) = 0.5·(1 + tanh u) + 0.5·x·(1 - tanh² u)·sqrt(2/π)·(1 + 3·0.044715·x²): the dGELU passes'
// (layers/pointwise_cuda.cu, and fp8_dout_cuda.cu's, which quantizes the result).
__device__ __forceinline__ float gelu_grad(float x) {
    float th = tanhf(GELU_SCALE * (x + 0.044715f * x * x * x));
    float du = GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}

// The 4 × 4 bytes r0..r3 (byte k of r_i: row i, column k) as 4 words by column (byte i of col[k]:
// row i): the FP8 quantizations' transposes in registers.
__device__ inline void transpose_4x4_bytes(uint32_t col[4], uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    uint32_t t0 = __byte_perm(r0, r1, 0x5140), t1 = __byte_perm(r0, r1, 0x7362);   // r0,r1 interleaved
    uint32_t t2 = __byte_perm(r2, r3, 0x5140), t3 = __byte_perm(r2, r3, 0x7362);   // r2,r3 interleaved
    col[0] = __byte_perm(t0, t2, 0x5410);
    col[1] = __byte_perm(t0, t2, 0x7632);
    col[2] = __byte_perm(t1, t3, 0x5410);
    col[3] = __byte_perm(t1, t3, 0x7632);
}

// Max over the 32 lanes of a warp (all active).
__device__ inline float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// *amax = max(*amax, m over the block): every thread of a block of BLOCK_SIZE calls it.
__device__ inline void block_amax_update(float *amax, float m) {
    __shared__ float warp_maxes[BLOCK_SIZE / 32];
    m = warp_max(m);
    if (threadIdx.x % 32 == 0) warp_maxes[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < BLOCK_SIZE / 32; w++) m = fmaxf(m, warp_maxes[w]);
    amax_update(amax, m);
}

// ---- 16-byte vectors of VEC bf16 -----------------------------------------------------------
// The memory-bound kernels move VEC consecutive bf16 per thread: one 16-byte load or store when
// the caller's `vec` flag says every row start is 16-byte aligned (sizes multiples of VEC,
// pointers aligned), element by element otherwise (odd sizes, tails, unaligned slices).
#define VEC 8

static inline bool aligned16(const void *p) { return (uintptr_t)p % 16 == 0; }

// ---- cuBLASLt ------------------------------------------------------------------------------
// Largest power of two (≤ 256) dividing the address: tells cuBLASLt's heuristic which kernels
// may touch the buffer (its default assumes 256-byte alignment).
static inline uint32_t alignment_of(const void *p) {
    uint32_t align = 256;
    while (align > 1 && (uintptr_t)p % align) align >>= 1;
    return align;
}

// The last part of every GEMM of the layers (linear_cuda.cu, linear_fp8_cuda.cu): cuBLASLt's first
// algorithm for desc and the layouts (C = D in place) under ctx's workspace and the real alignments
// of a, b and d (or, with ctx->gemm_tuning, the fastest of its candidates: gemm_tuned_algo), then
// D = op(A)·op(B) + beta·D on stream. where: the sizes (and what else helps) for the error messages.
// Returns 0, or -1 with a message in err.
int lt_matmul_run(cublasLtMatmulDesc_t desc, const void *a, cublasLtMatrixLayout_t layout_a, const void *b,
                  cublasLtMatrixLayout_t layout_b, void *d, cublasLtMatrixLayout_t layout_d, float beta,
                  const char *what, const char *where, const LayersCuda *ctx, cudaStream_t stream, char *err);

// layers/gemm_tuning.cu
GemmTuning *gemm_tuning_create(void);
void gemm_tuning_destroy(GemmTuning *t);   // NULL: nothing
int gemm_tuned_algo(cublasLtMatmulAlgo_t *algo, cublasLtMatmulDesc_t desc, cublasLtMatmulPreference_t pref,
                    const void *a, cublasLtMatrixLayout_t layout_a, const void *b, cublasLtMatrixLayout_t layout_b,
                    void *d, cublasLtMatrixLayout_t layout_d, float beta, const LayersCuda *ctx,
                    cudaStream_t stream);

// x[j] = p[j] for j < n (n <= VEC), 0 for j >= n.
__device__ inline void load_bf16x8(float x[VEC], const bf16 *p, int n, bool vec) {
    if (vec && n == VEC) {
        union { int4 raw; __nv_bfloat162 pair[VEC / 2]; } u;
        u.raw = *(const int4 *)p;
        for (int j = 0; j < VEC / 2; j++) {
            float2 f = __bfloat1622float2(u.pair[j]);
            x[2 * j] = f.x;
            x[2 * j + 1] = f.y;
        }
        return;
    }
    for (int j = 0; j < VEC; j++) x[j] = j < n ? __bfloat162float(p[j]) : 0.0f;
}

// VEC bf16 kept as their raw 16 bytes (4 registers instead of 8 floats), so that a row a kernel
// reads more than once can stay in registers: element 2j in the low half of word j, 2j + 1 in the
// high half. load_bf16x8_raw then unpack_bf16x8 give load_bf16x8's floats.
typedef struct { uint4 raw; } Bf16x8;

// p[j] for j < n (n <= VEC), 0 for j >= n.
__device__ inline Bf16x8 load_bf16x8_raw(const bf16 *p, int n, bool vec) {
    Bf16x8 u;
    if (vec && n == VEC) {
        u.raw = *(const uint4 *)p;
        return u;
    }
    uint32_t w[VEC / 2] = {};
    for (int j = 0; j < VEC; j++)
        if (j < n) w[j / 2] |= (uint32_t)__bfloat16_as_ushort(p[j]) << (16 * (j % 2));
    u.raw = make_uint4(w[0], w[1], w[2], w[3]);
    return u;
}

__device__ inline void unpack_bf16x8(float x[VEC], Bf16x8 u) {
    uint32_t w[VEC / 2] = {u.raw.x, u.raw.y, u.raw.z, u.raw.w};
    for (int j = 0; j < VEC / 2; j++) {
        x[2 * j] = __uint_as_float(w[j] << 16);
        x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

// bf16(x[j]) packed as load_bf16x8_raw packs (round to nearest even, as store_bf16x8 rounds).
__device__ inline Bf16x8 pack_bf16x8(const float x[VEC]) {
    union { uint4 raw; __nv_bfloat162 pair[VEC / 2]; } u;
    for (int j = 0; j < VEC / 2; j++) u.pair[j] = __floats2bfloat162_rn(x[2 * j], x[2 * j + 1]);
    Bf16x8 packed;
    packed.raw = u.raw;
    return packed;
}

// p[j] = element j of u for j < n (n <= VEC): the raw twin of store_bf16x8.
__device__ inline void store_bf16x8_raw(bf16 *p, Bf16x8 u, int n, bool vec) {
    if (vec && n == VEC) {
        *(uint4 *)p = u.raw;
        return;
    }
    uint32_t w[VEC / 2] = {u.raw.x, u.raw.y, u.raw.z, u.raw.w};
    for (int j = 0; j < n; j++) p[j] = __ushort_as_bfloat16((unsigned short)(w[j / 2] >> (16 * (j % 2))));
}

// p[j] = bf16(x[j]) for j < n (n <= VEC).
__device__ inline void store_bf16x8(bf16 *p, const float x[VEC], int n, bool vec) {
    if (vec && n == VEC) {
        union { int4 raw; __nv_bfloat162 pair[VEC / 2]; } u;
        for (int j = 0; j < VEC / 2; j++) u.pair[j] = __floats2bfloat162_rn(x[2 * j], x[2 * j + 1]);
        *(int4 *)p = u.raw;
        return;
    }
    for (int j = 0; j < n; j++) p[j] = __float2bfloat16(x[j]);
}

// x[j] = p[j] and p[j] = x[j], j < VEC, for fp32 (p 16-byte aligned: two 16-byte accesses).
__device__ inline void load_f32x8(float x[VEC], const float *p) {
    float4 a = *(const float4 *)p, b = *(const float4 *)(p + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
__device__ inline void store_f32x8(float *p, const float x[VEC]) {
    *(float4 *)p = make_float4(x[0], x[1], x[2], x[3]);
    *(float4 *)(p + 4) = make_float4(x[4], x[5], x[6], x[7]);
}

// Raw copy of n <= VEC bf16 (bit-exact data movement).
__device__ inline void copy_bf16x8(bf16 *dst, const bf16 *src, int n, bool vec) {
    if (vec && n == VEC) {
        *(int4 *)dst = *(const int4 *)src;
        return;
    }
    for (int j = 0; j < n; j++) dst[j] = src[j];
}

// ---- column sums over many rows (dshift, dscale, dgate, dbias) -----------------------------
// A block of BLOCK_SIZE threads owns a tile of COLS_PER_BLOCK = 32·VEC columns: lane l of each
// warp holds columns l·VEC .. l·VEC + VEC - 1 (a warp reads 512 contiguous bytes of a row) and
// warp w visits rows w, w + COL_WARPS, ... of the block's row range. Then sum_over_warps adds
// the COL_WARPS partial sums of a column in the order w = 0, 1, ... (fixed: no atomics).
#define COL_WARPS (BLOCK_SIZE / 32)
#define COLS_PER_BLOCK (32 * VEC)
static_assert(COLS_PER_BLOCK == BLOCK_SIZE, "after sum_over_warps thread x owns column x of the tile");

// Returns in thread x the sum over the warps of column x of the tile, acc being the calling
// thread's VEC column sums. `lanes` is a __shared__ [COL_WARPS][COLS_PER_BLOCK] array of the
// calling kernel; every thread of the block must call this.
__device__ inline float sum_over_warps(const float acc[VEC], float (*lanes)[COLS_PER_BLOCK]) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int j = 0; j < VEC; j++) lanes[warp][lane * VEC + j] = acc[j];
    __syncthreads();
    float sum = 0.0f;
    for (int w = 0; w < COL_WARPS; w++) sum += lanes[w][threadIdx.x];
    __syncthreads();   // `lanes` may be reused right after
    return sum;
}

// 0, or -1 unless ctx is a created context (its scratch holds the reductions' partial sums).
static inline int check_context(const char *fn, const LayersCuda *ctx, char *err) {
    if (!ctx || !ctx->scratch || ctx->scratch_floats < 1 || !ctx->tile_counters) {
        dit_set_error(err, "%s: ctx must be a LayersCuda made by layers_cuda_create (got %s)", fn,
                      ctx ? "one without scratch or tile counters" : "NULL");
        return -1;
    }
    return 0;
}

// The per-image column sums over T rows (dshift, dscale, dgate) split each image's rows into
// `splits` ranges of split_rows, one block row per (image, range), when one block per (column
// tile, image) would leave the GPU idle (B = 1, T = 16K): enough blocks for COL_TARGET_BLOCKS,
// ranges of at least COL_MIN_SPLIT_ROWS rows, and the partial sums (B·splits·sums·C floats)
// within `capacity` (the caller's LayersCuda scratch). The split depends on the sizes and the
// capacity only, so the order of the additions, hence the bits, are the same on every run and GPU.
#define COL_TARGET_BLOCKS 512
static_assert(LAYERS_TILE_COUNTERS >= COL_TARGET_BLOCKS, "split column sums have B·tiles < COL_TARGET_BLOCKS");
#define COL_MIN_SPLIT_ROWS 64

static inline int column_splits(int B, int T, int C, int sums, size_t capacity) {
    long long tiles = (C + COLS_PER_BLOCK - 1) / COLS_PER_BLOCK;
    long long splits = (COL_TARGET_BLOCKS + tiles * B - 1) / (tiles * B);
    long long most_by_rows = T / COL_MIN_SPLIT_ROWS, most_by_space = (long long)(capacity / ((size_t)B * sums * C));
    if (splits > most_by_rows) splits = most_by_rows;
    if (splits > most_by_space) splits = most_by_space;
    if (splits > 65535 / B) splits = 65535 / B;   // grid.y = B·splits
    return splits < 2 ? 1 : (int)splits;
}

// The end of every block of a split column sum: block (column tile blockIdx.x, image b, split s of
// `splits`) whose thread x holds sum_k (k < sums) of column col = blockIdx.x·COLS_PER_BLOCK + x.
// One split: out_k[b·stride + col] += sum_k. Else the block stores its sums in
// partial[((b·splits + s)·sums + k)·C + col], and the last of the tile's splits to arrive
// (counters[b·gridDim.x + blockIdx.x], below COL_TARGET_BLOCKS since only that few tiles split;
// it sets it back to 0) adds Σ_s partial, s = 0, 1, ... in order, into out_k: the same bits whichever
// block is last (the order of a second pass over the partials, without its launch). out1 is used
// when sums == 2. Every thread of the block calls it.
__device__ inline void column_sums_store(float *out0, float *out1, float *partial, unsigned *counters, float sum0,
                                         float sum1, int sums, int b, int s, int splits, int C, int stride) {
    __shared__ bool last;
    int col = blockIdx.x * COLS_PER_BLOCK + threadIdx.x;
    if (splits == 1) {
        if (col < C) {
            out0[(size_t)b * stride + col] += sum0;
            if (sums == 2) out1[(size_t)b * stride + col] += sum1;
        }
        return;
    }
    if (col < C) {
        float *p = partial + (size_t)(b * splits + s) * sums * C + col;
        p[0] = sum0;
        if (sums == 2) p[C] = sum1;
    }
    __threadfence();   // the partials visible to every block before this one is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned *counter = counters + (size_t)b * gridDim.x + blockIdx.x;
        last = atomicAdd(counter, 1u) == (unsigned)splits - 1;
        if (last) *counter = 0;   // every split has arrived: ready for the next call
    }
    __syncthreads();
    if (!last || col >= C) return;
    __threadfence();
    float total0 = 0.0f, total1 = 0.0f;
    for (int r = 0; r < splits; r++) {
        const float *p = partial + (size_t)(b * splits + r) * sums * C + col;
        total0 += __ldcg(p);   // (L2: the other blocks' stores)
        if (sums == 2) total1 += __ldcg(p + C);
    }
    out0[(size_t)b * stride + col] += total0;
    if (sums == 2) out1[(size_t)b * stride + col] += total1;
}

// Row chunks of a bias gradient: column_splits of the M rows (one chunk, no scratch, when M is small
// or OC wide enough to fill the GPU by itself), each of dbias_chunk_rows rows (the last one fewer): a
// multiple of DBIAS_ROW_ALIGN, the groups in which fp8_dout_cuda.cu writes the transposed FP8 dout.
// linear_dbias_accumulate, gelu_backward_inplace_dbias_cuda and the FP8 douts' passes sum over the
// same chunks in the same order.
#define DBIAS_ROW_ALIGN 64
static inline int dbias_chunk_rows(int M, int OC) {
    int chunks = column_splits(1, M, OC, 1, SIZE_MAX), rows = (M + chunks - 1) / chunks;
    return (rows + DBIAS_ROW_ALIGN - 1) / DBIAS_ROW_ALIGN * DBIAS_ROW_ALIGN;
}
static inline int dbias_chunks(int M, int OC) { return (M + dbias_chunk_rows(M, OC) - 1) / dbias_chunk_rows(M, OC); }

// dbias (OC) += Σ_m dout (M, OC) in a fixed order (layers/linear_cuda.cu; the bf16 and FP8 linear
// backward share it). Needs linear_backward_scratch_floats(M, OC) of ctx->scratch.
int linear_dbias_accumulate(float *dbias, const bf16 *dout, int M, int OC,
                            const LayersCuda *ctx, cudaStream_t stream, char *err);
