// The douts of the FP8 linears quantized by the passes that compute them (layers/linear_fp8_cuda.h,
// Fp8Dout): the dGELU (the MLP's fc1) and the gated residual's dh (fc2, proj); and a bf16 dout
// quantized with its bias gradient in one pass (qkv, whose dout the attention writes). Each pass writes the
// e4m3/e5m2 row-major and transposed copies the backward's GEMMs read, with a guessed exponent and
// headroom (Fp8Scaling), sums the bias gradient of the bf16 values it quantizes in
// linear_dbias_accumulate's order (the same bits), and takes their amax; the bf16 dout itself is never
// stored. Against the bf16 pass plus the linear's own quantization: 2 bytes read and 2 written per
// element fewer (at config c 3.2 GB per step: 201M dout elements per block, 4 blocks).
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
#include <cuda_fp8.h>
#include "layers/cuda_common.cuh"
#include "layers/linear_fp8_cuda.h"

#define DOUT_GROUP 64          // rows per group: 8 per warp
#define TILE_PITCH 80          // bytes per tile column: 64 + 16 (the unit slots swizzled by column / 8)
#define DOUT_LOAD_ROWS 2       // rows of a group each thread loads before it uses them (of 8)
#define DOUT_BLOCKS_PER_SM 4   // (64 registers)
static_assert(DOUT_GROUP == 8 * COL_WARPS, "a group is 8 rows of each warp");
static_assert(2 * COLS_PER_BLOCK * TILE_PITCH >= sizeof(float) * COL_WARPS * COLS_PER_BLOCK, "lanes fit the tiles");
static_assert(DBIAS_ROW_ALIGN % DOUT_GROUP == 0, "the bias gradient's chunks are whole groups");

enum { DOUT_DGELU, DOUT_GATE, DOUT_COPY };

typedef struct {
    uint8_t *q, *qt;
    float *scale;
    const bf16 *a, *b;          // DGELU: a = d (dout·weight), b = the pre-activation; GATE: a = the gated
                                // residual's dout, b = the gate (image m / T at (m / T)·mod_stride);
                                // COPY: a = the dout, b unused
    float *dbias, *partial;     // dbias NULL: none
    unsigned *counters;
    int *guess;                 // Fp8Scaling.exponent
    float *taken;
    int headroom, M, C, T, mod_stride, chunks, chunk_rows;
    bool vec, gate_vec;
    Fp8Format format;
} DoutArgs;

// One group: the dout's bf16 values at rows g0 + warp + 8k (k < 8; zero at rows >= end or columns
// >= C; loaded DOUT_LOAD_ROWS rows at a time before any is used: the q stores below may alias,
// uint8_t may alias anything), computed as the bf16 passes store them (rows_dbias_kernel), quantized
// with 2^-e into q (rows < end) and the shared tile; with `first`, each lane adds them to its column
// sums (rows in order: the dbias order). Returns max |value|.
template <int OP>
__device__ inline float dout_group(uint8_t (*tile)[TILE_PITCH], const DoutArgs &a, int g0, int end, int o, int n,
                                   float down, float sum[VEC], bool first) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __nv_fp8_interpretation_t kind = a.format == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2;
    float most = 0.0f;
    uint32_t lo[8], hi[8];   // row k's columns 0..3 and 4..7
#pragma unroll
    for (int k0 = 0; k0 < 8; k0 += DOUT_LOAD_ROWS) {
        Bf16x8 ra[DOUT_LOAD_ROWS], rb[DOUT_LOAD_ROWS];
#pragma unroll
        for (int i = 0; i < DOUT_LOAD_ROWS; i++) {
            int m = g0 + warp + 8 * (k0 + i);
            if (n <= 0 || m >= end) continue;
            ra[i] = load_bf16x8_raw(a.a + (size_t)m * a.C + o, n, a.vec);
            if (OP == DOUT_DGELU) rb[i] = load_bf16x8_raw(a.b + (size_t)m * a.C + o, n, a.vec);
            if (OP == DOUT_GATE) rb[i] = load_bf16x8_raw(a.b + (size_t)(m / a.T) * a.mod_stride + o, n, a.gate_vec);
        }
#pragma unroll
        for (int i = 0; i < DOUT_LOAD_ROWS; i++) {
            int k = k0 + i, m = g0 + warp + 8 * k;
            bool here = n > 0 && m < end;
            float v[VEC] = {0}, x[VEC], y[VEC];
            if (here) {
                unpack_bf16x8(x, ra[i]);
                if (OP != DOUT_COPY) unpack_bf16x8(y, rb[i]);
                for (int j = 0; j < VEC; j++) {
                    v[j] = OP == DOUT_COPY ? x[j] : bf16_rounded(OP == DOUT_DGELU ? gelu_grad(y[j]) * x[j] : y[j] * x[j]);
                    if (first) sum[j] += v[j];
                    most = fmaxf(most, fabsf(v[j]));
                }
            }
            uint16_t b[VEC / 2];
            for (int j = 0; j < VEC / 2; j++)
                b[j] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * j] * down, v[2 * j + 1] * down), __NV_SATFINITE,
                                                kind);
            lo[k] = b[0] | (uint32_t)b[1] << 16;
            hi[k] = b[2] | (uint32_t)b[3] << 16;
            if (a.q && here) *(uint2 *)(a.q + (size_t)m * a.C + o) = make_uint2(lo[k], hi[k]);
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
template <int OP>
__device__ float quantize_chunk(uint8_t (*tiles)[COLS_PER_BLOCK][TILE_PITCH], const DoutArgs &a, int e, float sum[VEC],
                                bool first) {
    float down = ldexpf(1.0f, -e), most = 0.0f;
    int lane = threadIdx.x % 32, col0 = blockIdx.x * COLS_PER_BLOCK, o = col0 + lane * VEC, n = min(VEC, a.C - o);
    int begin = blockIdx.y * a.chunk_rows, end = min(a.M, begin + a.chunk_rows), Rp = fp8_padded_rows(a.M);
    bool last = blockIdx.y == a.chunks - 1;
    int limit = last ? Rp : end;
    for (int g0 = begin, g = 0; g0 < end; g0 += DOUT_GROUP, g ^= 1) {   // two tiles: one barrier per group
        most = fmaxf(most, dout_group<OP>(tiles[g], a, g0, end, o, n, down, sum, first));
        __syncthreads();
        store_qt_group(a.qt, tiles[g], col0, a.C, Rp, g0, min(limit, g0 + DOUT_GROUP));
    }
    __syncthreads();   // the tiles free again
    return most;
}

// The pass: exponent guess[0] (block (0, 0) records it in guess[1] and sets *scale), the bias
// gradient (column_sums_store) and the amax taken.
template <int OP>
__global__ void __launch_bounds__(BLOCK_SIZE, DOUT_BLOCKS_PER_SM) fp8_dout_kernel(DoutArgs a) {
    __shared__ __align__(16) uint8_t tiles[2][COLS_PER_BLOCK][TILE_PITCH];   // (then sum_over_warps' lanes)
    int e = a.guess[0];
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        *a.scale = ldexpf(1.0f, e);
        a.guess[1] = e;
    }
    float sum[VEC] = {0};
    float most = quantize_chunk<OP>(tiles, a, e, sum, true);
    block_amax_update(a.taken, most);
    float total = sum_over_warps(sum, (float (*)[COLS_PER_BLOCK])tiles);
    if (a.dbias)
        column_sums_store(a.dbias, NULL, a.partial, a.counters, total, 0.0f, 1, 0, blockIdx.y, a.chunks, a.C, a.C);
}

// The check after it (as fp8_requantize_kernel): the next guess into guess[0]; unless the exponent
// used is kept, the whole dout again with fp8_next_guess of the amax taken.
template <int OP>
__global__ void __launch_bounds__(BLOCK_SIZE, DOUT_BLOCKS_PER_SM) fp8_dout_requantize_kernel(DoutArgs a) {
    __shared__ __align__(16) uint8_t tiles[2][COLS_PER_BLOCK][TILE_PITCH];
    int e_amax = fp8_scale_exponent(*a.taken, a.format), kept = fp8_guess_kept(a.guess[1], e_amax, a.headroom);
    int e = fp8_next_guess(e_amax, a.headroom);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        a.guess[0] = e;
        if (!kept) *a.scale = ldexpf(1.0f, e);
    }
    if (kept) return;
    float unused[VEC];
    quantize_chunk<OP>(tiles, a, e, unused, false);
}

static int launch_dout(const char *fn, int op, DoutArgs *a, const Fp8Dout *out, const Fp8Scaling *scaling,
                       const LayersCuda *ctx, cudaStream_t stream, char *err) {
    if (check_context(fn, ctx, err)) return -1;
    if (a->M <= 0 || a->C <= 0 || a->C % 16) {
        dit_set_error(err, "%s: need M >= 1 and C a positive multiple of 16 (M=%d C=%d)", fn, a->M, a->C);
        return -1;
    }
    if (!out || !out->qt || !aligned16(out->qt) || (uintptr_t)out->q % 8 || !out->scale ||
        (uintptr_t)out->scale % 4) {
        dit_set_error(err, "%s: out must be an Fp8Dout with qt 16-byte aligned, q NULL or 8-byte aligned and a "
                      "scale (M=%d C=%d)", fn, a->M, a->C);
        return -1;
    }
    if (!scaling || scaling->amax || !scaling->exponent || !scaling->taken || (uintptr_t)scaling->exponent % 4 ||
        (uintptr_t)scaling->taken % 4 || scaling->headroom < 0) {
        dit_set_error(err, "%s: scaling must be a guessed Fp8Scaling (amax NULL, exponent and taken 4-byte aligned, "
                      "headroom >= 0; M=%d C=%d)", fn, a->M, a->C);
        return -1;
    }
    if (a->format != FP8_E4M3 && a->format != FP8_E5M2) {
        dit_set_error(err, "%s: format must be FP8_E4M3 or FP8_E5M2 (got %d)", fn, (int)a->format);
        return -1;
    }
    if (a->dbias && linear_backward_scratch_floats(a->M, a->C) > ctx->scratch_floats) {
        dit_set_error(err, "%s: the bias gradient of M=%d C=%d needs %zu floats of scratch, the context has %zu", fn,
                      a->M, a->C, linear_backward_scratch_floats(a->M, a->C), ctx->scratch_floats);
        return -1;
    }
    a->q = out->q;
    a->qt = out->qt;
    a->scale = out->scale;
    a->guess = scaling->exponent;
    a->taken = scaling->taken;
    a->headroom = scaling->headroom;
    a->partial = ctx->scratch;
    a->counters = ctx->tile_counters;
    a->chunks = dbias_chunks(a->M, a->C);
    a->chunk_rows = dbias_chunk_rows(a->M, a->C);   // linear_dbias_accumulate's chunks
    dim3 grid(blocks_for(a->C, COLS_PER_BLOCK), a->chunks);
    void (*const pass[])(DoutArgs) = {fp8_dout_kernel<DOUT_DGELU>, fp8_dout_kernel<DOUT_GATE>,
                                      fp8_dout_kernel<DOUT_COPY>};
    void (*const check[])(DoutArgs) = {fp8_dout_requantize_kernel<DOUT_DGELU>, fp8_dout_requantize_kernel<DOUT_GATE>,
                                       fp8_dout_requantize_kernel<DOUT_COPY>};
    pass[op]<<<grid, BLOCK_SIZE, 0, stream>>>(*a);
    LAUNCH_CHECK(err, "fp8_dout_kernel", "%s: M=%d C=%d chunks=%d", fn, a->M, a->C, a->chunks);
    check[op]<<<grid, BLOCK_SIZE, 0, stream>>>(*a);
    LAUNCH_CHECK(err, "fp8_dout_requantize_kernel", "%s: M=%d C=%d chunks=%d", fn, a->M, a->C, a->chunks);
    return 0;
}

int gelu_backward_fp8_cuda(const Fp8Dout *out, const bf16 *d, const bf16 *pre, float *dbias, int M, int C,
                           Fp8Format format, const Fp8Scaling *scaling, const LayersCuda *ctx, cudaStream_t stream,
                           char *err) {
    DoutArgs a = {};
    a.a = d;
    a.b = pre;
    a.dbias = dbias;
    a.M = M;
    a.C = C;
    a.T = 1;
    a.vec = aligned16(d) && aligned16(pre);
    a.format = format;
    return launch_dout("gelu_backward_fp8_cuda", DOUT_DGELU, &a, out, scaling, ctx, stream, err);
}

int gated_dh_fp8_cuda(const Fp8Dout *dh, const bf16 *dout, const bf16 *gate, int B, int T, int C, int mod_stride,
                      float *dbias, Fp8Format format, const Fp8Scaling *scaling, const LayersCuda *ctx,
                      cudaStream_t stream, char *err) {
    if (B <= 0 || T <= 0 || mod_stride < C || (long long)B * T > INT32_MAX) {
        dit_set_error(err, "gated_dh_fp8_cuda: need B, T >= 1, B·T < 2^31 and mod_stride >= C (B=%d T=%d C=%d "
                      "mod_stride=%d)", B, T, C, mod_stride);
        return -1;
    }
    DoutArgs a = {};
    a.a = dout;
    a.b = gate;
    a.dbias = dbias;
    a.M = B * T;
    a.C = C;
    a.T = T;
    a.mod_stride = mod_stride;
    a.vec = aligned16(dout);
    a.gate_vec = mod_stride % VEC == 0 && aligned16(gate);
    a.format = format;
    return launch_dout("gated_dh_fp8_cuda", DOUT_GATE, &a, dh, scaling, ctx, stream, err);
}

int dout_fp8_cuda(const Fp8Dout *out, const bf16 *dout, float *dbias, int M, int C, Fp8Format format,
                  const Fp8Scaling *scaling, const LayersCuda *ctx, cudaStream_t stream, char *err) {
    DoutArgs a = {};
    a.a = dout;
    a.dbias = dbias;
    a.M = M;
    a.C = C;
    a.T = 1;
    a.vec = aligned16(dout);
    a.format = format;
    return launch_dout("dout_fp8_cuda", DOUT_COPY, &a, out, scaling, ctx, stream, err);
}
