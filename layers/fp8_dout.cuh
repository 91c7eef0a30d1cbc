// The machinery of a dout quantized by the pass that computes it (layers/linear_fp8_cuda.h,
// Fp8Dout), shared by the layers' passes (layers/fp8_dout_cuda.cu: the dGELU, the gated residual's
// dh) and the model's (model/dit_gpu.cu: the qkv gradient merged from the attention's dq, dk, dv).
// The pass writes the e4m3/e5m2 row-major and transposed copies the backward's GEMMs read, with a
// guessed exponent and headroom (Fp8Scaling), sums the bias gradient of the bf16 values it quantizes
// in linear_dbias_accumulate's order (the same bits), and takes their amax; the bf16 dout itself is
// never stored (against a bf16 pass plus the linear's own quantization: 2 bytes read and 2 written
// per element fewer).
//
// A source says where the values come from: BLOCKS_PER_SM, the kernels' launch bound; `Rows`, the
// registers of DOUT_LOAD_ROWS rows' loads;
// `load(r, i, m, o, n)`, row m's loads for this lane's columns o .. o + n - 1 into slot i (n <= 0:
// none); `values(v, r, i, m, o, n)`, their bf16-rounded values as the bf16 pass stores them, called
// for rows below the chunk's end and columns below C, or, where SHUFFLES, by every lane of the warp
// for a row below the chunk's end (v to be left as it is, zeros, where n <= 0).
//
// Layout: dbias_partial_kernel's (layers/linear_cuda.cu): block (column tile of COLS_PER_BLOCK,
// chunk of rows), lane l of warp w holds columns 8l..8l+7 and visits rows w, w + 8, ... of the chunk,
// in groups of DOUT_GROUP rows. Per group each lane has 8 rows × 8 columns of fp8 bytes; it stores the
// row-major bytes, transposes the 8 × 8 bytes in registers and puts each column's 8 bytes (its rows
// g0 + w + 8k, k = 0..7) into a shared tile as "unit" w of that column; then four threads per column
// gather the bytes of 16 rows each from the 8 units and store them as one 16-byte piece of the
// transposed copy (the chunks start at multiples of DBIAS_ROW_ALIGN rows, so every piece is whole).
// Two tiles, one barrier per group. (dev/notes_step.md, session 21: 2 rows loaded at a time with 4
// blocks per SM, and the 4-threads-per-column stores, were the fastest of the variants measured.)
#pragma once
#include <cuda_fp8.h>
#include "layers/cuda_common.cuh"
#include "layers/linear_fp8_cuda.h"

#define DOUT_GROUP 64          // rows per group: 8 per warp
#define TILE_PITCH 80          // bytes per tile column: 64 + 16 (the unit slots swizzled by column / 8)
#define DOUT_LOAD_ROWS 2       // rows of a group each thread loads before it uses them (of 8)
static_assert(DOUT_GROUP == 8 * COL_WARPS, "a group is 8 rows of each warp");
static_assert(2 * COLS_PER_BLOCK * TILE_PITCH >= sizeof(float) * COL_WARPS * COLS_PER_BLOCK, "lanes fit the tiles");
static_assert(DBIAS_ROW_ALIGN % DOUT_GROUP == 0, "the bias gradient's chunks are whole groups");

// Where a pass writes (M, C): the copies and scale (Fp8Dout), the bias gradient (NULL: none) and its
// partial sums, the guess (Fp8Scaling), and the chunks of linear_dbias_accumulate.
typedef struct {
    uint8_t *q, *qt;
    float *scale, *dbias, *partial, *taken;
    unsigned *counters;
    int *guess;
    int headroom, M, C, chunks, chunk_rows;
    Fp8Format format;
} DoutTarget;

// One group: the values at rows g0 + warp + 8k (k < 8; zero at rows >= end or columns >= C; loaded
// DOUT_LOAD_ROWS rows at a time before any is used: the q stores below may alias, uint8_t may alias
// anything), quantized with 2^-e into q (rows < end) and the shared tile; with `first`, each lane
// adds them to its column sums (rows in order: the dbias order). Returns max |value|.
template <class Src>
__device__ inline float dout_group(uint8_t (*tile)[TILE_PITCH], const Src &src, const DoutTarget &t, int g0, int end,
                                   int o, int n, float down, float sum[VEC], bool first) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __nv_fp8_interpretation_t kind = t.format == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2;
    float most = 0.0f;
    uint32_t lo[8], hi[8];   // row k's columns 0..3 and 4..7
#pragma unroll
    for (int k0 = 0; k0 < 8; k0 += DOUT_LOAD_ROWS) {
        typename Src::Rows r;
#pragma unroll
        for (int i = 0; i < DOUT_LOAD_ROWS; i++) {
            int m = g0 + warp + 8 * (k0 + i);
            if (m < end) src.load(r, i, m, o, n);
        }
#pragma unroll
        for (int i = 0; i < DOUT_LOAD_ROWS; i++) {
            int k = k0 + i, m = g0 + warp + 8 * k;
            bool here = n > 0 && m < end;
            float v[VEC] = {0};
            if (Src::SHUFFLES ? m < end : here) src.values(v, r, i, m, o, n);   // (m < end: warp-uniform)
            if (here)
                for (int j = 0; j < VEC; j++) {
                    if (first) sum[j] += v[j];
                    most = fmaxf(most, fabsf(v[j]));
                }
            uint16_t b[VEC / 2];
            for (int j = 0; j < VEC / 2; j++)
                b[j] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * j] * down, v[2 * j + 1] * down), __NV_SATFINITE,
                                                kind);
            lo[k] = b[0] | (uint32_t)b[1] << 16;
            hi[k] = b[2] | (uint32_t)b[3] << 16;
            if (t.q && here) *(uint2 *)(t.q + (size_t)m * t.C + o) = make_uint2(lo[k], hi[k]);
        }
    }
    // column j's rows k = 0..3 and 4..7 as two words; unit `warp` of the column, at slot warp ^ (lane % 8)
    uint32_t c0[4], c1[4], c2[4], c3[4];
    transpose_4x4_bytes(c0, lo[0], lo[1], lo[2], lo[3]);
    transpose_4x4_bytes(c1, lo[4], lo[5], lo[6], lo[7]);
    transpose_4x4_bytes(c2, hi[0], hi[1], hi[2], hi[3]);
    transpose_4x4_bytes(c3, hi[4], hi[5], hi[6], hi[7]);
    int slot = 8 * (warp ^ (lane % 8));
    for (int j = 0; j < 4; j++) {
        *(uint2 *)&tile[lane * VEC + j][slot] = make_uint2(c0[j], c1[j]);
        *(uint2 *)&tile[lane * VEC + 4 + j][slot] = make_uint2(c2[j], c3[j]);
    }
    return most;
}

// The transposed copy's rows g0 .. limit - 1 (g0 and limit multiples of 16, limit <= g0 + 64) of the
// block's columns from the shared tile (unit w of a column, at slot w ^ (column / 8 % 8), holds its
// rows g0 + w + 8k as bytes k). Four threads per column, thread x storing the 16 rows g0 + 16p ..
// (p = x % 4) of columns x / 4 + 64i: rows 8n .. 8n + 3 are bytes n of units 0..3, rows 8n + 4 ..
// 8n + 7 bytes n of units 4..7, n = 2p and 2p + 1.
__device__ inline void store_qt_group(uint8_t *qt, uint8_t (*tile)[TILE_PITCH], int col0, int C, int Rp, int g0,
                                      int limit) {
    int p = threadIdx.x % 4, r = g0 + 16 * p;
    if (r >= limit) return;
    unsigned b = 2 * p % 4, lo = b | (b + 4) << 4, hi = (b + 1) | (b + 5) << 4;   // byte b (b + 1) of two words
#pragma unroll
    for (int i = 0; i < COLS_PER_BLOCK / 64; i++) {
        int cl = threadIdx.x / 4 + 64 * i, c = col0 + cl, s = cl / 8 % 8;
        if (c >= C) break;
        uint32_t h[8];   // the half of unit w holding bytes n = 2p, 2p + 1
        for (int w = 0; w < 8; w++) h[w] = *(const uint32_t *)&tile[cl][8 * (w ^ s) + 4 * (p / 2)];
        uint32_t e0 = __byte_perm(__byte_perm(h[0], h[1], lo), __byte_perm(h[2], h[3], lo), 0x5410);
        uint32_t o0 = __byte_perm(__byte_perm(h[4], h[5], lo), __byte_perm(h[6], h[7], lo), 0x5410);
        uint32_t e1 = __byte_perm(__byte_perm(h[0], h[1], hi), __byte_perm(h[2], h[3], hi), 0x5410);
        uint32_t o1 = __byte_perm(__byte_perm(h[4], h[5], hi), __byte_perm(h[6], h[7], hi), 0x5410);
        *(uint4 *)(qt + (size_t)c * Rp + r) = make_uint4(e0, o0, e1, o1);
    }
}

// The block's chunk with the scale 2^e: q's rows, qt's rows (and its pad rows M .. Rp - 1 in the last
// chunk: chunks start at multiples of 64 rows, so the last group reaches Rp), the column sums with
// `first`. Returns max |value|.
template <class Src>
__device__ float quantize_chunk(uint8_t (*tiles)[COLS_PER_BLOCK][TILE_PITCH], const Src &src, const DoutTarget &t,
                                int e, float sum[VEC], bool first) {
    float down = ldexpf(1.0f, -e), most = 0.0f;
    int lane = threadIdx.x % 32, col0 = blockIdx.x * COLS_PER_BLOCK, o = col0 + lane * VEC, n = min(VEC, t.C - o);
    int begin = blockIdx.y * t.chunk_rows, end = min(t.M, begin + t.chunk_rows), Rp = fp8_padded_rows(t.M);
    bool last = blockIdx.y == t.chunks - 1;
    int limit = last ? Rp : end;
    for (int g0 = begin, g = 0; g0 < end; g0 += DOUT_GROUP, g ^= 1) {   // two tiles: one barrier per group
        most = fmaxf(most, dout_group(tiles[g], src, t, g0, end, o, n, down, sum, first));
        __syncthreads();
        store_qt_group(t.qt, tiles[g], col0, t.C, Rp, g0, min(limit, g0 + DOUT_GROUP));
    }
    __syncthreads();   // the tiles free again
    return most;
}

// The pass: exponent guess[0] (block (0, 0) records it in guess[1] and sets *scale), the bias
// gradient (column_sums_store) and the amax taken.
template <class Src>
__global__ void __launch_bounds__(BLOCK_SIZE, Src::BLOCKS_PER_SM) fp8_dout_kernel(Src src, DoutTarget t) {
    __shared__ __align__(16) uint8_t tiles[2][COLS_PER_BLOCK][TILE_PITCH];   // (then sum_over_warps' lanes)
    int e = t.guess[0];
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        *t.scale = ldexpf(1.0f, e);
        t.guess[1] = e;
    }
    float sum[VEC] = {0};
    float most = quantize_chunk(tiles, src, t, e, sum, true);
    block_amax_update(t.taken, most);
    float total = sum_over_warps(sum, (float (*)[COLS_PER_BLOCK])tiles);
    if (t.dbias)
        column_sums_store(t.dbias, NULL, t.partial, t.counters, total, 0.0f, 1, 0, blockIdx.y, t.chunks, t.C, t.C);
}

// The check after it (as fp8_requantize_kernel): the next guess into guess[0]; unless the exponent
// used is kept, the whole dout again with fp8_next_guess of the amax taken.
template <class Src>
__global__ void __launch_bounds__(BLOCK_SIZE, Src::BLOCKS_PER_SM) fp8_dout_requantize_kernel(Src src, DoutTarget t) {
    __shared__ __align__(16) uint8_t tiles[2][COLS_PER_BLOCK][TILE_PITCH];
    int e_amax = fp8_scale_exponent(*t.taken, t.format), kept = fp8_guess_kept(t.guess[1], e_amax, t.headroom);
    int e = fp8_next_guess(e_amax, t.headroom);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        t.guess[0] = e;
        if (!kept) *t.scale = ldexpf(1.0f, e);
    }
    if (kept) return;
    float unused[VEC];
    quantize_chunk(tiles, src, t, e, unused, false);
}

// The pass and its check over (M, C) into out, with scaling's guess and dbias (may be NULL); fn names
// the caller in the messages. Returns 0, or -1 with a message in err.
template <class Src>
static int launch_fp8_dout(const char *fn, const Src &src, int M, int C, const Fp8Dout *out, float *dbias,
                           Fp8Format format, const Fp8Scaling *scaling, const LayersCuda *ctx, cudaStream_t stream,
                           char *err) {
    if (check_context(fn, ctx, err)) return -1;
    if (M <= 0 || C <= 0 || C % 16) {
        dit_set_error(err, "%s: need M >= 1 and C a positive multiple of 16 (M=%d C=%d)", fn, M, C);
        return -1;
    }
    if (!out || !out->qt || !aligned16(out->qt) || (uintptr_t)out->q % 8 || !out->scale ||
        (uintptr_t)out->scale % 4) {
        dit_set_error(err, "%s: out must be an Fp8Dout with qt 16-byte aligned, q NULL or 8-byte aligned and a "
                      "scale (M=%d C=%d)", fn, M, C);
        return -1;
    }
    if (!scaling || scaling->amax || !scaling->exponent || !scaling->taken || (uintptr_t)scaling->exponent % 4 ||
        (uintptr_t)scaling->taken % 4 || scaling->headroom < 0) {
        dit_set_error(err, "%s: scaling must be a guessed Fp8Scaling (amax NULL, exponent and taken 4-byte aligned, "
                      "headroom >= 0; M=%d C=%d)", fn, M, C);
        return -1;
    }
    if (format != FP8_E4M3 && format != FP8_E5M2) {
        dit_set_error(err, "%s: format must be FP8_E4M3 or FP8_E5M2 (got %d)", fn, (int)format);
        return -1;
    }
    if (dbias && linear_backward_scratch_floats(M, C) > ctx->scratch_floats) {
        dit_set_error(err, "%s: the bias gradient of M=%d C=%d needs %zu floats of scratch, the context has %zu", fn,
                      M, C, linear_backward_scratch_floats(M, C), ctx->scratch_floats);
        return -1;
    }
    DoutTarget t = {out->q, out->qt, out->scale, dbias, ctx->scratch, scaling->taken, ctx->tile_counters,
                    scaling->exponent, scaling->headroom, M, C, dbias_chunks(M, C), dbias_chunk_rows(M, C), format};
    dim3 grid(blocks_for(C, COLS_PER_BLOCK), t.chunks);
    fp8_dout_kernel<<<grid, BLOCK_SIZE, 0, stream>>>(src, t);
    LAUNCH_CHECK(err, "fp8_dout_kernel", "%s: M=%d C=%d chunks=%d", fn, M, C, t.chunks);
    fp8_dout_requantize_kernel<<<grid, BLOCK_SIZE, 0, stream>>>(src, t);
    LAUNCH_CHECK(err, "fp8_dout_requantize_kernel", "%s: M=%d C=%d chunks=%d", fn, M, C, t.chunks);
    return 0;
}
