// Sage attention on the GPU: the quantization pass (see sage_cuda.h for the layouts), two kernels
// after a memset of the per-head counters:
// 1. sage_stats_kernel: per (256-token chunk, head) the column sums of k and column max|v| into
//    the workspace's partials; the chunk that completes a head (atomic counter) sums the partials
//    in chunk order to k_mean = Σ / N and v_scale = max / 448.
// 2. sage_quantize_kernel: per (64-token block, head), in the reverse order of kernel 1 (so that
//    its first blocks find k and v still in L2), Q·c and K - k_mean to int8 with one scale per
//    block (amax/127, values rintf(x·(127/amax))), V to e4m3(v/v_scale) (its bytes, computed
//    without the division: times_inverse_scale) or fp16, transposed through shared memory without
//    bank conflicts. All loads of a block are issued up front.
// sage_quantize_qkv_cuda runs sage_split_stats_kernel in place of kernel 1: the same statistics in
// the same order, taken while it splits a qkv projection's output into q, k, v (and rotates q, k).
// Arithmetic uses the _rn intrinsics so that --use_fast_math cannot change the definition's
// roundings; only k_mean's summation order differs from the CPU (chunked instead of sequential).
#include "attention/sage_cuda.h"
#include "attention/hadamard.cuh"
#include "attention/sage_mma.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

#define STATS_CHUNK 256
#define STATS_THREADS 128
#define STATS_BATCH 8   // rows of k and v loaded per thread before they are summed
#ifndef QUANT_MIN_CTAS   // sage_quantize_kernel CTAs per SM at D = 128 (twice that at D = 64): 2 -> 128 registers
#define QUANT_MIN_CTAS 2
#endif

static int ceil_div(int a, int b) { return (a + b - 1) / b; }
static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

// Workspace: q8 | k8 | q_scale | k_scale | k_mean | v_scale | v_t | column partials (2 per chunk)
// | chunks done per head (BH counters).
enum { WS_PARTIALS = 7, WS_DONE = 8, WS_PARTS = 9 };
static size_t layout(SageCudaQuant *view, char **at, char *base, int B, int H, int N, int D, SagePV pv) {
    size_t BH = (size_t)B * H, nblk = ceil_div(N, SAGE_CUDA_BLOCK), off = 0;
    size_t npad = nblk * SAGE_CUDA_BLOCK, nchunk = ceil_div(N, STATS_CHUNK);
    size_t sizes[WS_PARTS] = {BH * N * D, BH * N * D, BH * nblk * 4, BH * nblk * 4, BH * D * 4, BH * D * 4,
                              BH * D * npad * (pv == SAGE_PV_FP8 ? 1 : 2), BH * nchunk * D * 2 * 4, BH * 4};
    char *local[WS_PARTS];
    if (!at) at = local;
    for (int i = 0; i < WS_PARTS; i++) { at[i] = base ? base + off : NULL; off += align256(sizes[i]); }
    if (view) {
        view->q8 = (int8_t *)at[0]; view->k8 = (int8_t *)at[1];
        view->q_scale = (float *)at[2]; view->k_scale = (float *)at[3];
        view->k_mean = (float *)at[4]; view->v_scale = (float *)at[5];
        view->v_t = at[6];
    }
    return off;
}

extern "C" size_t sage_cuda_forward_workspace_size(int B, int H, int N, int D, SagePV pv) {
    return layout(NULL, NULL, NULL, B, H, N, D, pv);
}

extern "C" SageCudaQuant sage_cuda_quant_view(void *workspace, int B, int H, int N, int D, SagePV pv) {
    SageCudaQuant view;
    layout(&view, NULL, (char *)workspace, B, H, N, D, pv);
    return view;
}

// bf16 -> fp32 is the 16 bits moved up: two 32-bit operations per word (the bf16 conversion
// intrinsics split the word into halves first).
__device__ __forceinline__ void bf16x8_to_float(float x[8], uint4 u) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    for (int i = 0; i < 4; i++) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// The end of a stats block (chunk `chunk` of head bh): the ROWS threads' column sums and maxima
// (thread (row0, vec) holds columns 8·vec..+7) summed in row order into the head's partials, and
// the CTA that completes head bh (done[bh] reaches nchunk) sums the chunks in chunk order:
// k_out[bh] = Σ / divisor, v_out[bh] = max / 448 (0 unless fp8).
template <int D>
__device__ void stats_block_end(float *k_out, float *v_out, float *part, unsigned *done, const float sum[8],
                                const float vmax[8], int bh, int chunk, int nchunk, float divisor, int fp8) {
    constexpr int VEC = D / 8, ROWS = STATS_THREADS / VEC;
    __shared__ float s_sum[ROWS][D], s_max[ROWS][D];
    __shared__ int s_last;
    int vec = threadIdx.x % VEC, row0 = threadIdx.x / VEC;
    for (int i = 0; i < 8; i++) { s_sum[row0][vec * 8 + i] = sum[i]; s_max[row0][vec * 8 + i] = vmax[i]; }
    __syncthreads();
    float *head_part = part + (size_t)bh * nchunk * 2 * D;
    for (int c = threadIdx.x; c < D; c += STATS_THREADS) {
        float s = 0.0f, m = 0.0f;
        for (int r = 0; r < ROWS; r++) { s += s_sum[r][c]; m = fmaxf(m, s_max[r][c]); }
        head_part[(size_t)chunk * 2 * D + c] = s;
        head_part[(size_t)chunk * 2 * D + D + c] = m;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(done + bh, 1u) == (unsigned)nchunk - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // the head's last chunk: Σ over chunks in chunk order (loads batched, sums in order)
    for (int i = threadIdx.x; i < 2 * D; i += STATS_THREADS) {
        int c = i % D, is_max = i / D;
        const float *p = head_part + is_max * D + c;
        float acc = 0.0f, val[16];
        for (int c0 = 0; c0 < nchunk; c0 += 16) {
#pragma unroll
            for (int j = 0; j < 16; j++) if (c0 + j < nchunk) val[j] = __ldcg(p + (size_t)(c0 + j) * 2 * D);
#pragma unroll
            for (int j = 0; j < 16; j++) if (c0 + j < nchunk) acc = is_max ? fmaxf(acc, val[j]) : acc + val[j];
        }
        if (is_max) v_out[(size_t)bh * D + c] = fp8 ? __fdiv_rn(acc, 448.0f) : 0.0f;
        else k_out[(size_t)bh * D + c] = __fdiv_rn(acc, divisor);
    }
}

// k, v: (BH, N, D). part: (BH, nchunk, 2, D): [0] Σ k over the chunk, [1] max |v| over the chunk.
// Grid (nchunk, BH), STATS_THREADS threads: each thread owns 8 columns and every ROWS-th row
// (summed in token order, STATS_BATCH rows of loads in flight), then stats_block_end.
template <int D>
__global__ void __launch_bounds__(STATS_THREADS) sage_stats_kernel(float *k_out, float *v_out, float *part,
                                                                   unsigned *done, const __nv_bfloat16 *k,
                                                                   const __nv_bfloat16 *v, int N, float divisor,
                                                                   int fp8) {
    constexpr int VEC = D / 8, ROWS = STATS_THREADS / VEC, PER = STATS_CHUNK / ROWS;
    int bh = blockIdx.y, chunk = blockIdx.x, vec = threadIdx.x % VEC, row0 = threadIdx.x / VEC;
    float sum[8] = {0}, vmax[8] = {0}, x[8];
    int t0 = chunk * STATS_CHUNK + row0, t_end = min(N, (chunk + 1) * STATS_CHUNK);
    int n_rows = t0 < t_end ? (t_end - t0 + ROWS - 1) / ROWS : 0;   // rows t0, t0 + ROWS, ... < t_end
    const __nv_bfloat16 *kp = k + ((size_t)bh * N + t0) * D + vec * 8, *vp = v + ((size_t)bh * N + t0) * D + vec * 8;
    for (int r0 = 0; r0 < PER; r0 += STATS_BATCH) {
        uint4 kr[STATS_BATCH], vr[STATS_BATCH];
#pragma unroll
        for (int r = 0; r < STATS_BATCH; r++) {
            if (r0 + r >= n_rows) continue;
            kr[r] = *(const uint4 *)(kp + (size_t)(r0 + r) * ROWS * D);
            vr[r] = *(const uint4 *)(vp + (size_t)(r0 + r) * ROWS * D);
        }
#pragma unroll
        for (int r = 0; r < STATS_BATCH; r++) {
            if (r0 + r >= n_rows) continue;
            bf16x8_to_float(x, kr[r]);
            for (int i = 0; i < 8; i++) sum[i] += x[i];
            bf16x8_to_float(x, vr[r]);
            for (int i = 0; i < 8; i++) vmax[i] = fmaxf(vmax[i], fabsf(x[i]));
        }
    }
    stats_block_end<D>(k_out, v_out, part, done, sum, vmax, bh, chunk, gridDim.x, divisor, fp8);
}

// sage_stats_kernel's statistics, taken while the same threads split qkv (B, N, 3·H·D) into q, k, v
// (BH, N, D): thread (row0, vec) moves the 8 values 8·vec.. of its rows of q, k and v (q and k
// multiplied by the Hadamard matrix first when rotate: walsh_hadamard over the row's D/8 lanes,
// which is why every lane runs every row step, valid or not) and sums the k it stores (bf16) and
// the max |v| in sage_stats_kernel's order. H: heads per image (bh = b·H + h).
template <int D>
__global__ void __launch_bounds__(STATS_THREADS) sage_split_stats_kernel(float *k_out, float *v_out, float *part,
                                                                         unsigned *done, __nv_bfloat16 *q,
                                                                         __nv_bfloat16 *k, __nv_bfloat16 *v,
                                                                         const __nv_bfloat16 *qkv, int H, int N,
                                                                         bool rotate, float norm, float divisor,
                                                                         int fp8) {
    constexpr int VEC = D / 8, ROWS = STATS_THREADS / VEC, PER = STATS_CHUNK / ROWS;
    int bh = blockIdx.y, chunk = blockIdx.x, vec = threadIdx.x % VEC, row0 = threadIdx.x / VEC;
    int b = bh / H, h = bh % H;
    float sum[8] = {0}, vmax[8] = {0};
    int t0 = chunk * STATS_CHUNK + row0, t_end = min(N, (chunk + 1) * STATS_CHUNK);
    int n_rows = t0 < t_end ? (t_end - t0 + ROWS - 1) / ROWS : 0;
    size_t head = ((size_t)bh * N + t0) * D + vec * 8, row_step = (size_t)ROWS * D;
    const __nv_bfloat16 *src = qkv + ((size_t)b * N + t0) * 3 * H * D + (size_t)h * D + vec * 8;
    const size_t src_step = (size_t)ROWS * 3 * H * D, part_step = (size_t)H * D;   // next row; q -> k -> v
    for (int r = 0; r < PER; r++) {
        bool valid = r < n_rows;
        uint4 in[3] = {};
        if (valid)
            for (int w = 0; w < 3; w++) in[w] = *(const uint4 *)(src + r * src_step + w * part_step);
        float x[3][8];
        for (int w = 0; w < 3; w++) bf16x8_to_float(x[w], in[w]);
        if (rotate) {   // (all lanes: the transform shuffles within the row's lanes)
            walsh_hadamard<D>(x[0], norm);
            walsh_hadamard<D>(x[1], norm);
        }
        if (!valid) continue;
        __nv_bfloat16 *dst[3] = {q, k, v};
        for (int w = 0; w < 3; w++) {
            union { uint4 raw; __nv_bfloat162 pair[4]; } u;
            for (int i = 0; i < 4; i++) u.pair[i] = __floats2bfloat162_rn(x[w][2 * i], x[w][2 * i + 1]);
            *(uint4 *)(dst[w] + head + r * row_step) = u.raw;
            if (w == 1) bf16x8_to_float(x[1], u.raw);   // k as stored
        }
        for (int i = 0; i < 8; i++) sum[i] += x[1][i];
        for (int i = 0; i < 8; i++) vmax[i] = fmaxf(vmax[i], fabsf(x[2][i]));
    }
    stats_block_end<D>(k_out, v_out, part, done, sum, vmax, bh, chunk, gridDim.x, divisor, fp8);
}

// int8 of y·inv, 8 values packed in two words (the byte of __float2int_rn as int8).
__device__ __forceinline__ uint2 pack_int8(const float y[8], float inv) {
    uint32_t w[2] = {0, 0};
    for (int i = 0; i < 8; i++)
        w[i / 4] |= (uint32_t)(uint8_t)(int8_t)__float2int_rn(__fmul_rn(y[i], inv)) << (8 * (i % 4));
    return make_uint2(w[0], w[1]);
}

// x / scale as the definition divides (0 where scale = 0).
__device__ __forceinline__ float divide_by_scale(float x, float scale) {
    return scale > 0.0f ? __fdiv_rn(x, scale) : 0.0f;
}
// x / scale without the division, for a v of the channel whose max |v| gave scale = max/448 >=
// 2^-80: q = x·inv (inv = 1/scale, rounded once) and one residual correction, written
// q − (q·scale − x)·inv so that x = −0 comes back −0 (q − (−0) would not). Its e4m3 byte equals the
// division's for every bf16 x with |x| <= max and every such scale, flush-to-zero included
// (dev/check_v_reciprocal.c tries all 10^9 pairs; the fp32 quotients themselves may differ).
__device__ __forceinline__ float times_inverse_scale(float x, float scale, float inv) {
    float q = __fmul_rn(x, inv);
    return __fmaf_rn(-__fmaf_rn(q, scale, -x), inv, q);
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
    return (uint32_t)__half_as_ushort(__float2half_rn(lo)) | (uint32_t)__half_as_ushort(__float2half_rn(hi)) << 16;
}

// One 64-token block per CTA, 2·D threads, blocks taken in the reverse order of the stats kernel
// (item = BH·nblk - 1 - blockIdx.x). Every thread loads 4 × 16 bytes of each of q, k, v up front.
// Q, K: thread i owns columns 8·(i % (D/8))..+7 of rows i/(D/8) + 16·j (j < 4); one barrier
// serves both block maxima (amax of x·q_mul and of k - k_mean) and the V transposition.
// V: thread i owns channels 8·cb..+7 (cb = i/16) of the tokens 16g + 2c + {0, 1, 8, 9} (c = i%4,
// g = i/4 % 4), which are the FP8 slots 4c..4c+3 of group g (one 32-bit word per channel); FP16
// keeps token order (two words per channel). Shared memory holds the block's v_t rows; the FP8
// thread stores channel e = i' ^ (cb & 1) at step i' and the FP16 thread XORs the word with
// 4·(cb & 1), so that the 32 lanes of a warp hit 32 different banks; rows leave as 16-byte stores.
template <int D, bool FP8>
__global__ void __launch_bounds__(2 * D, QUANT_MIN_CTAS * 128 / D) sage_quantize_kernel(
    SageCudaQuant qv, const __nv_bfloat16 *q, const __nv_bfloat16 *k, const __nv_bfloat16 *v,
    int N, int nblk, float q_mul) {
    constexpr int THREADS = 2 * D, VEC = D / 8, ROW_WORDS = FP8 ? 16 : 32;
    __shared__ float s_red[2][THREADS / 32];
    __shared__ __align__(16) uint32_t s_vt[D][ROW_WORDS];
    int item = (int)(gridDim.x - 1 - blockIdx.x), bh = item / nblk, blk = item % nblk, t0 = blk * SAGE_CUDA_BLOCK;
    int rows = min(SAGE_CUDA_BLOCK, N - t0), tid = threadIdx.x;
    size_t at = ((size_t)bh * N + t0) * D;
    int col = (tid % VEC) * 8, row0 = tid / VEC;
    int c = tid % 4, g = tid / 4 % 4, cb = tid / 16, flip = cb & 1;
    uint4 qr[4], kr[4], vr[4];
    for (int j = 0; j < 4; j++) {
        int row = row0 + 16 * j, tok = 16 * g + 2 * c + (j & 1) + 8 * (j >> 1);
        qr[j] = kr[j] = vr[j] = make_uint4(0, 0, 0, 0);
        if (row < rows) {
            qr[j] = __ldcs((const uint4 *)(q + at + (size_t)row * D + col));
            kr[j] = __ldcs((const uint4 *)(k + at + (size_t)row * D + col));
        }
        if (tok < rows) vr[j] = __ldcs((const uint4 *)(v + at + (size_t)tok * D + 8 * cb));
    }
    float mean[8], scale[8], y[8], qmax = 0.0f, kmax = 0.0f;
    bool tiny_scale = false;   // a channel of this thread below 2^-80 (or 0): the division for all
    for (int i = 0; i < 8; i++) {
        mean[i] = qv.k_mean[(size_t)bh * D + col + i];
        scale[i] = qv.v_scale[(size_t)bh * D + 8 * cb + i];
        tiny_scale |= !(scale[i] >= 0x1p-80f);
    }
    for (int j = 0; j < 4; j++) {
        if (row0 + 16 * j >= rows) continue;
        bf16x8_to_float(y, qr[j]);
        for (int i = 0; i < 8; i++) qmax = fmaxf(qmax, fabsf(__fmul_rn(y[i], q_mul)));
        bf16x8_to_float(y, kr[j]);   // (the definition's multiplier for k − k_mean is 1: left out)
        for (int i = 0; i < 8; i++) kmax = fmaxf(kmax, fabsf(__fsub_rn(y[i], mean[i])));
    }
    float x[4][8];   // V: token j, channel 8·cb + i (zero beyond N)
    for (int j = 0; j < 4; j++) bf16x8_to_float(x[j], vr[j]);
    uint32_t w[8];
    if (FP8) {
        // 1/scale of channel 8·cb + i: lane (lane & 16) + i computed it (the 16 lanes of a cb share
        // their 8 channels)
        float own_inv = __frcp_rn(qv.v_scale[(size_t)bh * D + 8 * cb + tid % 8]);
        for (int i = 0; i < 8; i++) {
            float y4[4], inv = __shfl_sync(0xffffffffu, own_inv, (tid & 16) | i);
            if (!tiny_scale) {
                for (int j = 0; j < 4; j++) y4[j] = times_inverse_scale(x[j][i], scale[i], inv);
            } else {
                for (int j = 0; j < 4; j++) y4[j] = divide_by_scale(x[j][i], scale[i]);
            }
            w[i] = (uint32_t)pack_e4m3x2(y4[0], y4[1]) | (uint32_t)pack_e4m3x2(y4[2], y4[3]) << 16;
        }
        for (int i = 0; i < 8; i++) s_vt[8 * cb + (i ^ flip)][4 * g + c] = flip ? w[i ^ 1] : w[i];
    } else {
        for (int i = 0; i < 8; i++) {
            s_vt[8 * cb + i][(8 * g + c) ^ (4 * flip)] = half2_bits(x[0][i], x[1][i]);
            s_vt[8 * cb + i][(8 * g + 4 + c) ^ (4 * flip)] = half2_bits(x[2][i], x[3][i]);
        }
    }
    qmax = warp_max(qmax);
    kmax = warp_max(kmax);
    if (tid % 32 == 0) { s_red[0][tid / 32] = qmax; s_red[1][tid / 32] = kmax; }
    __syncthreads();
    for (int wp = 0; wp < THREADS / 32; wp++) { qmax = fmaxf(qmax, s_red[0][wp]); kmax = fmaxf(kmax, s_red[1][wp]); }
    float qinv = qmax > 0.0f ? __fdiv_rn(127.0f, qmax) : 0.0f, kinv = kmax > 0.0f ? __fdiv_rn(127.0f, kmax) : 0.0f;
    for (int j = 0; j < 4; j++) {
        int row = row0 + 16 * j;
        if (row >= rows) continue;
        bf16x8_to_float(y, qr[j]);
        for (int i = 0; i < 8; i++) y[i] = __fmul_rn(y[i], q_mul);
        __stcs((uint2 *)(qv.q8 + at + (size_t)row * D + col), pack_int8(y, qinv));
        bf16x8_to_float(y, kr[j]);
        for (int i = 0; i < 8; i++) y[i] = __fsub_rn(y[i], mean[i]);
        __stcs((uint2 *)(qv.k8 + at + (size_t)row * D + col), pack_int8(y, kinv));
    }
    if (tid == 0) {
        qv.q_scale[(size_t)bh * nblk + blk] = __fdiv_rn(qmax, 127.0f);
        qv.k_scale[(size_t)bh * nblk + blk] = __fdiv_rn(kmax, 127.0f);
    }
    // v_t rows d = 0..D-1 of this block: ROW_WORDS / 4 chunks of 16 bytes each (FP16: chunk r of
    // row d sits at r ^ (d/8 & 1) in shared memory)
    constexpr int CHUNKS = ROW_WORDS / 4, ELT = FP8 ? 1 : 2;
    size_t npad = (size_t)nblk * SAGE_CUDA_BLOCK;
    uint8_t *vt = (uint8_t *)qv.v_t + ((size_t)bh * D * npad + (size_t)t0) * ELT;
    for (int i = tid; i < D * CHUNKS; i += THREADS) {
        int d = i / CHUNKS, r = i % CHUNKS, r_smem = FP8 ? r : r ^ (d / 8 & 1);
        __stcs((uint4 *)(vt + (size_t)d * npad * ELT + r * 16), *(const uint4 *)&s_vt[d][4 * r_smem]);
    }
}

static int check_shape(const char *fn, int B, int H, int N, int D, char *err) {
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535) {
        dit_set_error(err, "%s: need D in {64, 128}, B, H, N >= 1 and B·H <= 65535 "
                      "(got B=%d H=%d N=%d D=%d)", fn, B, H, N, D);
        return -1;
    }
    return 0;
}

// The memset of the per-head counters and kernel 1: k_out[bh][d] = (Σ_t k) / divisor and
// v_out[bh][d] = max_t |v| / 448 (0 in FP16 mode), through the workspace's column partials. With
// split (qkv, then q, k, v written, rotated when split->rotate), sage_split_stats_kernel.
typedef struct { const uint16_t *qkv; uint16_t *q; int rotate; } SplitQkv;
static int launch_stats(float *k_out, float *v_out, void *workspace, const uint16_t *k, const uint16_t *v,
                        const SplitQkv *split, int B, int H, int N, int D, SagePV pv, float divisor,
                        cudaStream_t stream, char *err) {
    char *at[WS_PARTS];
    layout(NULL, at, (char *)workspace, B, H, N, D, pv);
    int BH = B * H, fp8 = pv == SAGE_PV_FP8;
    float *part = (float *)at[WS_PARTIALS];
    unsigned *done = (unsigned *)at[WS_DONE];
    const __nv_bfloat16 *kb = (const __nv_bfloat16 *)k, *vb = (const __nv_bfloat16 *)v;
    SAGE_CUDA_CHECK(cudaMemsetAsync(done, 0, (size_t)BH * sizeof(unsigned), stream), err,
                    "cudaMemsetAsync(sage quantization counters)");
    dim3 grid(ceil_div(N, STATS_CHUNK), BH);
    if (split) {
        __nv_bfloat16 *qo = (__nv_bfloat16 *)split->q, *ko = (__nv_bfloat16 *)k, *vo = (__nv_bfloat16 *)v;
        const __nv_bfloat16 *src = (const __nv_bfloat16 *)split->qkv;
        float norm = 1.0f / sqrtf((float)D);   // (host arithmetic: the norm of hadamard_rotate_bf16_cuda)
        if (D == 64)
            sage_split_stats_kernel<64><<<grid, STATS_THREADS, 0, stream>>>(k_out, v_out, part, done, qo, ko, vo, src,
                                                                         H, N, split->rotate, norm, divisor, fp8);
        else
            sage_split_stats_kernel<128><<<grid, STATS_THREADS, 0, stream>>>(k_out, v_out, part, done, qo, ko, vo,
                                                                          src, H, N, split->rotate, norm, divisor,
                                                                          fp8);
        SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_split_stats_kernel");
        return 0;
    }
    if (D == 64) sage_stats_kernel<64><<<grid, STATS_THREADS, 0, stream>>>(k_out, v_out, part, done, kb, vb, N, divisor, fp8);
    else sage_stats_kernel<128><<<grid, STATS_THREADS, 0, stream>>>(k_out, v_out, part, done, kb, vb, N, divisor, fp8);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_stats_kernel");
    return 0;
}

// Kernel 2: Q, K (with the k_mean in qv) and V (with the v_scale in qv) per 64-token block.
static int launch_quantize(const SageCudaQuant *qv, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           int B, int H, int N, int D, SagePV pv, cudaStream_t stream, char *err) {
    const __nv_bfloat16 *qb = (const __nv_bfloat16 *)q, *kb = (const __nv_bfloat16 *)k,
                        *vb = (const __nv_bfloat16 *)v;
    float q_mul = (1.0f / sqrtf((float)D)) * 1.44269504f;   // host arithmetic, as the CPU definition
    int nblk = ceil_div(N, SAGE_CUDA_BLOCK);
    unsigned grid = (unsigned)((long long)nblk * B * H);
    bool fp8 = pv == SAGE_PV_FP8;
    if (D == 64 && fp8) sage_quantize_kernel<64, true><<<grid, 128, 0, stream>>>(*qv, qb, kb, vb, N, nblk, q_mul);
    if (D == 64 && !fp8) sage_quantize_kernel<64, false><<<grid, 128, 0, stream>>>(*qv, qb, kb, vb, N, nblk, q_mul);
    if (D == 128 && fp8) sage_quantize_kernel<128, true><<<grid, 256, 0, stream>>>(*qv, qb, kb, vb, N, nblk, q_mul);
    if (D == 128 && !fp8) sage_quantize_kernel<128, false><<<grid, 256, 0, stream>>>(*qv, qb, kb, vb, N, nblk, q_mul);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_quantize_kernel");
    return 0;
}

extern "C" int sage_quantize_cuda(void *workspace, const uint16_t *q, const uint16_t *k,
                                  const uint16_t *v, int B, int H, int N, int D, SagePV pv,
                                  cudaStream_t stream, char *err) {
    if (check_shape("sage_quantize_cuda", B, H, N, D, err) != 0) return -1;
    CHECK_DEVICE_ARGS("sage_quantize_cuda", err, DEVICE_ARG(workspace, 16), DEVICE_ARG(q, 16), DEVICE_ARG(k, 16),
                      DEVICE_ARG(v, 16));
    SageCudaQuant qv = sage_cuda_quant_view(workspace, B, H, N, D, pv);
    if (launch_stats(qv.k_mean, qv.v_scale, workspace, k, v, NULL, B, H, N, D, pv, (float)N, stream, err) != 0)
        return -1;
    return launch_quantize(&qv, q, k, v, B, H, N, D, pv, stream, err);
}

extern "C" int sage_quantize_qkv_cuda(void *workspace, uint16_t *q, uint16_t *k, uint16_t *v, const uint16_t *qkv,
                                      int rotate, int B, int H, int N, int D, SagePV pv, cudaStream_t stream,
                                      char *err) {
    if (check_shape("sage_quantize_qkv_cuda", B, H, N, D, err) != 0) return -1;
    CHECK_DEVICE_ARGS("sage_quantize_qkv_cuda", err, DEVICE_ARG(workspace, 16), DEVICE_ARG(q, 16), DEVICE_ARG(k, 16),
                      DEVICE_ARG(v, 16), DEVICE_ARG(qkv, 16));
    SageCudaQuant qv = sage_cuda_quant_view(workspace, B, H, N, D, pv);
    SplitQkv split = {qkv, q, rotate};
    if (launch_stats(qv.k_mean, qv.v_scale, workspace, k, v, &split, B, H, N, D, pv, (float)N, stream, err) != 0)
        return -1;
    return launch_quantize(&qv, q, k, v, B, H, N, D, pv, stream, err);
}

extern "C" int sage_kv_stats_cuda(float *k_sum, float *v_scale, void *workspace, const uint16_t *k,
                                  const uint16_t *v, int B, int H, int N, int D, SagePV pv,
                                  cudaStream_t stream, char *err) {
    if (check_shape("sage_kv_stats_cuda", B, H, N, D, err) != 0) return -1;
    CHECK_DEVICE_ARGS("sage_kv_stats_cuda", err, DEVICE_ARG(k_sum, 4), DEVICE_ARG(v_scale, 4),
                      DEVICE_ARG(workspace, 16), DEVICE_ARG(k, 16), DEVICE_ARG(v, 16));
    // divisor 1: the reduction's k_mean = Σ/1 is the sum, exactly
    return launch_stats(k_sum, v_scale, workspace, k, v, NULL, B, H, N, D, pv, 1.0f, stream, err);
}

extern "C" int sage_quantize_given_cuda(void *workspace, const uint16_t *q, const uint16_t *k,
                                        const uint16_t *v, const float *k_mean, const float *v_scale,
                                        int B, int H, int N, int D, SagePV pv, cudaStream_t stream,
                                        char *err) {
    if (check_shape("sage_quantize_given_cuda", B, H, N, D, err) != 0) return -1;
    CHECK_DEVICE_ARGS("sage_quantize_given_cuda", err, DEVICE_ARG(workspace, 16), DEVICE_ARG(q, 16),
                      DEVICE_ARG(k, 16), DEVICE_ARG(v, 16), DEVICE_ARG(k_mean, 4));
    if (pv == SAGE_PV_FP8) CHECK_DEVICE_ARGS("sage_quantize_given_cuda (FP8 P·V)", err, DEVICE_ARG(v_scale, 4));
    SageCudaQuant qv = sage_cuda_quant_view(workspace, B, H, N, D, pv);
    size_t bytes = (size_t)B * H * D * sizeof(float);
    if (qv.k_mean != k_mean)
        SAGE_CUDA_CHECK(cudaMemcpyAsync(qv.k_mean, k_mean, bytes, cudaMemcpyDeviceToDevice, stream), err,
                        "cudaMemcpyAsync(workspace k_mean <- given k_mean)");
    if (pv != SAGE_PV_FP8)
        SAGE_CUDA_CHECK(cudaMemsetAsync(qv.v_scale, 0, bytes, stream), err, "cudaMemsetAsync(workspace v_scale)");
    else if (qv.v_scale != v_scale)
        SAGE_CUDA_CHECK(cudaMemcpyAsync(qv.v_scale, v_scale, bytes, cudaMemcpyDeviceToDevice, stream), err,
                        "cudaMemcpyAsync(workspace v_scale <- given v_scale)");
    return launch_quantize(&qv, q, k, v, B, H, N, D, pv, stream, err);
}
