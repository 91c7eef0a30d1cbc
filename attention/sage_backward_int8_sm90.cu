// Sage attention recompute backward for Hopper (sm_90a) with INT8 gradient products: the
// definition's SAGE_BWD_INT8_TOKEN (attention/attention.h, executable in sage_cpu.c), with
// q_block = k_block = 64. Per (64-query block I, 64-key block J):
//   P = exp2(s - lse) from the forward's Q̂, K̂ (as every sage backward), dP = dO·Vᵀ (bf16 wgmma,
//   fp32), dS = P∘(dP - delta); then to INT8 ("amax over the set, scale amax/127, x8 =
//   rint(x·(127/amax))"): P per key over the 64 queries (p8, p_scale_j), dS per key (dsk8,
//   dsk_scale_j) and per query over the 64 keys (dsq8, dsq_scale_i); dO per query block over
//   64 × D (do8, do_scale_I, made by a pass before the kernel). Then, int32 sums of int8 wgmma:
//     dv_j += (float)(Σ_i p8_ij·do8_i)  · (p_scale_j·do_scale_I)
//     dk_j += (float)(Σ_i dsk8_ij·q8_i) · ((dsk_scale_j·q_scale_I)·u),   u = r/(r·log2 e)
//     dq_i += (float)(Σ_j dsq8_ij·k8_j) · ((dsq_scale_i·k_scale_J)·r),  r = 1/sqrt(D)
//   each int32 tile scaled once (the CPU's fp32 products, same operands and order of the two
//   multiplies) and added in fp32; the GPU sums the fp32 terms in another order.
//
// Structure: the SCORES_SAGE kernel of attention/backward_sm90.cuh (one CTA of two warpgroups per
// 128-key block and head, warpgroup w owns keys 64w..64w+63 = one key block J, so its 64 × 64
// tile of every step is exactly one definition block (I, J); K̂, V in shared memory; query blocks
// streamed through two TMA stages; dQ leaves by TMA reduce-add of a shared fp32 tile; optional
// ordered dQ). What changes: 8-bit wgmma takes shared-memory operands only K-major, so the three
// gradient products need Q̂ᵀ, dÔᵀ (K = queries) and K̂ᵀ (K = keys) rows. A pass before the kernel
// (int8_bwd_operands_kernel) writes them per 64-token block as D rows × 64 bytes:
//   Q̂ᵀ, dÔᵀ: slot s of a row holds query π(s) = 16(s/16) + 8((s%4)/2) + 2((s%16)/4) + s%2, the
//            order in which the Sᵀ accumulator's columns land in the int8 A fragment (a thread's
//            accumulator columns 8j + 2c + e become k-slots 4c.. of its register), so Pᵀ and dSᵀ
//            go from the accumulators to the A fragments of dV, dK without a shuffle;
//   K̂ᵀ:      slot s holds key σ(s) = 16(s/16) + (s%16)/2 + 8(s%2), so that the two keys a thread
//            holds (16·warp + g and + 8) are adjacent bytes of the dsq8 tile it writes.
// zero for tokens >= N. Per step, per warpgroup:
//   Sᵀ (int8) and dPᵀ (bf16) as the sage kernel; Pᵀ, dSᵀ (fp32, masked past N);
//   per-key amax of P and |dS| (a row of the accumulators: 16 values and 2 shuffles) -> p8, dsk8
//   packed as int8 A fragments; per-query amax of |dS| over the 64 keys (a column: 3 shuffles
//   over the 8 rows of a warp, then the 4 warps through shared memory and two named barriers)
//   -> dsq8 into shared memory (rows = queries, K-major);
//   dV += p8ᵀ·dÔᵀ and dK += dsk8ᵀ·Q̂ᵀ: int8 m64n64k32, A from registers, into int32 tiles that
//   are scaled and added to the fp32 accumulators (D = 128: two 64-column halves one after the
//   other, which keeps the int32 tiles at 64 registers);
//   after the CTA barrier, warpgroup w's dQ columns w·D/2.. = dsq8_J·K̂ᵀ_J for J = both key
//   blocks of the CTA (int8 m64n(D/2)k32, both operands in shared memory), each int32 tile
//   scaled by its per-query dsq_scale_i·k_scale_J·r and the two added, into the dQ tile.
// The kernel is NOT dispatched by sage_backward_cuda (sage_cuda.h says why).
#include "attention/sage_cuda.h"
#include "attention/backward_sm90.cuh"
#include "layers/common.h"
#include "layers/cuda_args.h"

#define I8BWD_BLOCK 64   // the definition's q_block = k_block; tokens per row of the transposed operands

// Shared memory of one CTA (after aligning its start to 1024 bytes).
template <int D> struct Int8BwdSmem {
    static constexpr int K8 = 0;                                  // K̂: 128 keys × D int8 (D-byte swizzle)
    static constexpr int V = K8 + BWD90_KEYS * D;                 // V: D/64 boxes of 128 keys × 64 bf16
    static constexpr int KT = V + BWD90_KEYS * D * 2;             // K̂ᵀ: 2 key blocks × D rows × 64 slots (σ)
    static constexpr int DSQ = KT + BWD90_KEYS * D;               // dsq8: 2 key blocks × 64 queries × 64 slots (σ)
    static constexpr int DQ = DSQ + 2 * BWD90_QUERIES * I8BWD_BLOCK;   // dQ: D/32 boxes of 64 queries × 32 fp32
    static constexpr int RED = DQ + BWD90_QUERIES * D * 4;        // per-query max|dS| of each warp: 2 × 4 × 64 fp32
    static constexpr int QINV = RED + 2 * 4 * BWD90_QUERIES * 4;  // 127/amax per query: 2 × 64 fp32
    static constexpr int QSCALE = QINV + 2 * BWD90_QUERIES * 4;   // dsq_scale = amax/127 per query: 2 × 64 fp32
    static constexpr int STAGE0 = (QSCALE + 2 * BWD90_QUERIES * 4 + 1023) / 1024 * 1024;
    // one stage: Q̂ (64 × D int8) | dO (D/64 boxes of 64 × 64 bf16) | Q̂ᵀ | dÔᵀ (D × 64 int8, π) by the
    // TMA, then lse | delta (64 fp32 each) by the threads
    static constexpr int Q8 = 0, DO = Q8 + BWD90_QUERIES * D, QT = DO + BWD90_QUERIES * D * 2;
    static constexpr int DOT = QT + D * I8BWD_BLOCK;
    static constexpr int STAGE_TX = DOT + D * I8BWD_BLOCK;
    static constexpr int LSE = STAGE_TX, DELTA = LSE + BWD90_QUERIES * 4;
    static constexpr int STAGE_BYTES = (DELTA + BWD90_QUERIES * 4 + 1023) / 1024 * 1024;
    static constexpr int TOTAL = 1024 + STAGE0 + 2 * STAGE_BYTES;   // + alignment slack
};

// k, q8: the forward's K̂, Q̂ (box D × 128 / D × 64); v, dout: bf16 rows as bytes (box 128 × 128 /
// 128 × 64); kt, qt, dot: the transposed operands, rows of 64 bytes (box 64 × 2D for the CTA's two
// key blocks, 64 × D per query block); dq: fp32 (D, N, B·H) for the TMA reduce-add.
typedef struct {
    CUtensorMap k, v, q8, dout, kt, qt, dot, dq;
} Int8BwdMaps;

// The kernel's inputs: a as for the sage kernel (delta, dq zeroed, turns), do_scale (B·H,
// ceil(N/64)) from int8_bwd_operands_kernel, r = 1/sqrtf(D) and u = r/(r·1.44269504f) as the
// CPU definition computes them (host float arithmetic).
typedef struct {
    AttnBwdArgs a;
    const float *do_scale;
    float r, u;
} Int8BwdArgs;

// Where the INT8 operands live in the backward workspace, after what attention_backward_prepare
// uses: do_scale (BH·nqb fp32) | Q̂ᵀ, dÔᵀ (BH·nqb blocks of D × 64) | K̂ᵀ (BH·nkb2 blocks of D × 64,
// nkb2 = 2·ceil(N/128): every CTA finds its two key blocks), each 128-byte aligned.
typedef struct {
    size_t do_scale, qt, dot, kt, total;
} Int8BwdLayout;

static Int8BwdLayout int8_bwd_layout(int BH, int N, int D) {
    size_t nqb = (N + I8BWD_BLOCK - 1) / I8BWD_BLOCK, nkb2 = 2 * (size_t)((N + BWD90_KEYS - 1) / BWD90_KEYS);
    size_t tile = (size_t)D * I8BWD_BLOCK;
    Int8BwdLayout l;
    l.do_scale = (attention_backward_workspace_bytes(BH, 1, N) + 127) / 128 * 128;
    l.qt = (l.do_scale + (size_t)BH * nqb * sizeof(float) + 127) / 128 * 128;
    l.dot = l.qt + (size_t)BH * nqb * tile;
    l.kt = l.dot + (size_t)BH * nqb * tile;
    l.total = l.kt + (size_t)BH * nkb2 * tile;
    return l;
}

extern "C" size_t sage_backward_int8_workspace_size(int B, int H, int N, int D) {
    return int8_bwd_layout(B * H, N, D).total;
}

// Slot s (0..63) of a transposed row: the query (π) or key (σ) of the block it holds.
__device__ __forceinline__ int query_of_slot(int s) { return 16 * (s / 16) + 8 * ((s % 4) / 2) + 2 * ((s % 16) / 4) + s % 2; }
__device__ __forceinline__ int key_of_slot(int s) { return 16 * (s / 16) + (s % 16) / 2 + 8 * (s % 2); }

// 64 tokens × D int8 rows in shared memory -> D rows × 64 slots at dst, slot s = token perm(s).
template <int D, bool KEYS>
__device__ __forceinline__ void store_transposed(int8_t *dst, const int8_t *tile) {
    for (int w = threadIdx.x; w < D * I8BWD_BLOCK / 4; w += blockDim.x) {
        int d = w / (I8BWD_BLOCK / 4), s0 = 4 * (w % (I8BWD_BLOCK / 4));
        uint32_t word = 0;
        for (int i = 0; i < 4; i++) {
            int t = KEYS ? key_of_slot(s0 + i) : query_of_slot(s0 + i);
            word |= (uint32_t)(uint8_t)tile[t * D + d] << (8 * i);
        }
        *(uint32_t *)(dst + (size_t)d * I8BWD_BLOCK + s0) = word;
    }
}

// 64 rows of D int8 from src (rows >= valid: zeros) into tile.
template <int D>
__device__ __forceinline__ void load_rows(int8_t *tile, const int8_t *src, int valid) {
    for (int i = threadIdx.x; i < I8BWD_BLOCK * D / 16; i += blockDim.x) {
        int row = i / (D / 16);
        uint4 u = row < valid ? *(const uint4 *)(src + (size_t)i * 16) : make_uint4(0, 0, 0, 0);
        *(uint4 *)(tile + i * 16) = u;
    }
}

// The operands of one 64-token block b of head bh (grid (max(nqb, nkb2), B·H), 256 threads):
// b < nqb: do_scale = amax/127 over the block's valid dout values, do8 = rint(dout·(127/amax)),
//          dÔᵀ and Q̂ᵀ (π order); b < nkb2: K̂ᵀ (σ order). Tokens >= N are zero.
template <int D>
__global__ void __launch_bounds__(256) int8_bwd_operands_kernel(int8_t *qt, int8_t *dot, int8_t *kt, float *do_scale,
                                                                const __nv_bfloat16 *dout, const int8_t *q8,
                                                                const int8_t *k8, int N) {
    __shared__ __align__(16) int8_t tile[I8BWD_BLOCK * D];
    __shared__ float warp_max[8];
    const int b = blockIdx.x, bh = blockIdx.y, tid = threadIdx.x;
    const int nqb = (N + I8BWD_BLOCK - 1) / I8BWD_BLOCK, nkb2 = 2 * ((N + BWD90_KEYS - 1) / BWD90_KEYS);
    const int t0 = b * I8BWD_BLOCK, valid = min(I8BWD_BLOCK, N - t0);   // valid <= 0 for padding key blocks
    const size_t head = (size_t)bh * N * D, tile_at = (size_t)D * I8BWD_BLOCK;
    if (b < nqb) {
        const __nv_bfloat162 *src = (const __nv_bfloat162 *)(dout + head + (size_t)t0 * D);
        float m = 0.0f;
        for (int i = tid; i < valid * D / 2; i += 256) {
            float2 f = __bfloat1622float2(src[i]);
            m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (tid % 32 == 0) warp_max[tid / 32] = m;
        __syncthreads();
        float amax = 0.0f;
        for (int w = 0; w < 8; w++) amax = fmaxf(amax, warp_max[w]);
        float inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
        if (tid == 0) do_scale[(size_t)bh * nqb + b] = __fdiv_rn(amax, 127.0f);
        for (int i = tid; i < I8BWD_BLOCK * D / 2; i += 256) {
            float2 f = i < valid * D / 2 ? __bfloat1622float2(src[i]) : make_float2(0.0f, 0.0f);
            tile[2 * i] = (int8_t)__float2int_rn(__fmul_rn(f.x, inv));
            tile[2 * i + 1] = (int8_t)__float2int_rn(__fmul_rn(f.y, inv));
        }
        __syncthreads();
        store_transposed<D, false>(dot + ((size_t)bh * nqb + b) * tile_at, tile);
        __syncthreads();
        load_rows<D>(tile, q8 + head + (size_t)t0 * D, valid);
        __syncthreads();
        store_transposed<D, false>(qt + ((size_t)bh * nqb + b) * tile_at, tile);
        __syncthreads();
    }
    if (b < nkb2) {
        load_rows<D>(tile, k8 + head + (size_t)t0 * D, valid);
        __syncthreads();
        store_transposed<D, true>(kt + ((size_t)bh * nkb2 + b) * tile_at, tile);
    }
}

#ifdef SAGE_SM90_DEVICE
// d (+)= A·B, int8 × int8 -> int32, m64n32k32, A and B K-major in shared memory (descriptors).
template <int scale_d>
__device__ __forceinline__ void wgmma_s8_m64n32k32(int d[16], uint64_t desc_a, uint64_t desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, %18;\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
                   "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15])
                 : "l"(desc_a), "l"(desc_b), "n"(scale_d));
}

// One k32 step of dQ (m64n(D/2)k32 int8, both operands K-major in shared memory).
template <int D, int scale_d>
__device__ __forceinline__ void dq_wgmma_s8(int (&d)[D / 4], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (D == 128) wgmma_s8_m64n64k32<scale_d>(d, desc_a, desc_b);
    else wgmma_s8_m64n32k32<scale_d>(d, desc_a, desc_b);
}

// The definition's "to INT8 over a set" for a set with max |x| = amax: inv = 127/amax (0 when
// amax = 0), scale = amax/127.
__device__ __forceinline__ void int8_scales(float amax, float *inv, float *scale) {
    *inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    *scale = __fdiv_rn(amax, 127.0f);
}
__device__ __forceinline__ int to_int8(float x, float inv) { return __float2int_rn(__fmul_rn(x, inv)); }
// Four int8 values (in range) packed, x0 in the lowest byte.
__device__ __forceinline__ uint32_t pack_s8x4(int x0, int x1, int x2, int x3) {
    return __byte_perm(__byte_perm(x0, x1, 0x0040), __byte_perm(x2, x3, 0x0040), 0x5410);
}

// k_scale of key block kb64 (64 keys) of head bh, 0 past N (nb = ceil(N/64) blocks per head).
__device__ __forceinline__ float k_scale_of(const AttnBwdArgs &a, int bh, int nb, int kb64) {
    return 64 * kb64 < a.N ? a.qv.k_scale[(size_t)bh * nb + kb64] : 0.0f;
}

// 4 bytes from global src to shared dst by cp.async (zeros when !valid; src must still be a valid address).
__device__ __forceinline__ void cp_async4(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}

// Thread 0: query block qb of head bh into the stage at st, completing on bar.
template <int D>
__device__ __forceinline__ void load_int8_stage(uint8_t *st, uint64_t *bar, const Int8BwdMaps &m, int bh, int N, int qb) {
    using S = Int8BwdSmem<D>;
    int row = bh * N + qb * BWD90_QUERIES, nqb = (N + I8BWD_BLOCK - 1) / I8BWD_BLOCK;
    int trow = (bh * nqb + qb) * D;
    mbar_expect_bytes(bar, S::STAGE_TX);
    tma_load_2d(st + S::Q8, &m.q8, bar, 0, row);
    for (int b = 0; b < D / 64; b++) tma_load_2d(st + S::DO + b * BWD90_QUERIES * 128, &m.dout, bar, 128 * b, row);
    tma_load_2d(st + S::QT, &m.qt, bar, 0, trow);
    tma_load_2d(st + S::DOT, &m.dot, bar, 0, trow);
}
#endif

// Grid (ceil(N/128), B·H), BWD90_THREADS threads, Int8BwdSmem<D>::TOTAL bytes of dynamic shared memory.
template <int D>
__global__ void __launch_bounds__(BWD90_THREADS, 1)
    sage_backward_int8_sm90_kernel(const __grid_constant__ Int8BwdMaps maps, Int8BwdArgs x) {
#ifdef SAGE_SM90_DEVICE
    using S = Int8BwdSmem<D>;
    const AttnBwdArgs &a = x.a;
    extern __shared__ uint8_t smem_raw[];
    __shared__ uint64_t bar_kv, bar_q[2];
    uint8_t *sm = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    const int N = a.N, nqb = (N + BWD90_QUERIES - 1) / BWD90_QUERIES, nkb2 = 2 * ((N + BWD90_KEYS - 1) / BWD90_KEYS);
    const int kb = blockIdx.x, bh = blockIdx.y, k0 = kb * BWD90_KEYS, tid = threadIdx.x;
    const int wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const size_t head = (size_t)bh * N * D;
    int *turn = a.dq_turn ? a.dq_turn + (size_t)bh * nqb : NULL;   // this head's dQ turns, or NULL

    if (tid == 0) {
        mbar_init(&bar_kv, 1);
        mbar_init(&bar_q[0], 1);
        mbar_init(&bar_q[1], 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0) {   // K̂, V, K̂ᵀ of both key blocks, and the first two query stages
        mbar_expect_bytes(&bar_kv, BWD90_KEYS * D * 4);
        tma_load_2d(sm + S::K8, &maps.k, &bar_kv, 0, bh * N + k0);
        for (int b = 0; b < D / 64; b++)
            tma_load_2d(sm + S::V + b * BWD90_KEYS * 128, &maps.v, &bar_kv, 128 * b, bh * N + k0);
        tma_load_2d(sm + S::KT, &maps.kt, &bar_kv, 0, (bh * nkb2 + 2 * kb) * D);
        for (int s = 0; s < 2 && s < nqb; s++)
            load_int8_stage<D>(sm + S::STAGE0 + s * S::STAGE_BYTES, &bar_q[s], maps, bh, N, s);
    }
    if (tid < 2 * BWD90_QUERIES)   // lse | delta of block 0 (adjacent in the stage)
        ((float *)(sm + S::STAGE0 + S::LSE))[tid] = load_query_stat(a, bh, 0, tid);
    __syncthreads();

    const float k_scale = k_scale_of(a, bh, nqb, 2 * kb + wg);   // of this warpgroup's key block (Sᵀ)
    const int kr = 64 * wg + 16 * warp + g;   // CTA key rows kr and kr + 8 of this thread
    const bool key_valid[2] = {k0 + kr < N, k0 + kr + 8 < N};
    float *red = (float *)(sm + S::RED), *q_inv = (float *)(sm + S::QINV), *q_scale_dsq = (float *)(sm + S::QSCALE);
    float dv[D / 2] = {}, dk[D / 2] = {};   // m64nD accumulators: keys × D
    mbar_wait(&bar_kv, 0);

    for (int qb = 0; qb < nqb; qb++) {
        const int stage = qb & 1, q0 = qb * BWD90_QUERIES;
        // the shared-memory base, opaque to the compiler within a step: the descriptors and addresses
        // made from it are computed where they are used instead of held in registers across steps
        int opaque_zero = 0;
        asm volatile("" : "+r"(opaque_zero));
        uint8_t *sp = sm + opaque_zero;
        uint8_t *st = sp + S::STAGE0 + stage * S::STAGE_BYTES;
        if (tid < 2 * BWD90_QUERIES && qb + 1 < nqb) {   // lse | delta of block qb + 1 into the other stage,
            // last read in step qb - 1 (cp.async: no register holds it; complete before barrier A)
            int q = q0 + BWD90_QUERIES + tid % BWD90_QUERIES;
            const float *src = (tid < BWD90_QUERIES ? a.lse : a.delta) + (size_t)bh * N + (q < N ? q : 0);
            cp_async4(sm + S::STAGE0 + (stage ^ 1) * S::STAGE_BYTES + S::LSE + 4 * tid, src, q < N);
            cp_async_commit();
        }
        int seen_turn = turn && tid == 0 ? ld_acquire_gpu(turn + qb) : 0;   // checked at the end of the step
        const float q_scale = a.qv.q_scale[(size_t)bh * nqb + qb], do_scale = x.do_scale[(size_t)bh * nqb + qb];
        mbar_wait(&bar_q[stage], (qb >> 1) & 1);
        const float scale = __fmul_rn(q_scale, k_scale);

        // Sᵀ = K̂·Q̂ᵀ (int8) and dPᵀ = V·dOᵀ (bf16), 64 keys × 64 queries each, one batch
        int s_acc[32];
        float p[32], dp[32];
        const uint64_t desc_k8 = smem_desc<D>(sp + S::K8 + 64 * wg * D), desc_q8 = smem_desc<D>(st + S::Q8), desc_v = smem_desc<128>(sp + S::V + 64 * wg * 128);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 32; ks++) {
            if (ks == 0) wgmma_s8_m64n64k32<0>(s_acc, desc_k8, desc_q8);
            else wgmma_s8_m64n64k32<1>(s_acc, desc_advance(desc_k8, 32 * ks), desc_advance(desc_q8, 32 * ks));
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint64_t da = desc_advance(desc_v, (kk / 4) * BWD90_KEYS * 128 + (kk % 4) * 32);
            uint64_t db = smem_desc<128>(st + S::DO + (kk / 4) * BWD90_QUERIES * 128 + (kk % 4) * 32);
            if (kk == 0) wgmma_bf16_m64n64k16_ss<0, 0, 0>(dp, da, db);
            else wgmma_bf16_m64n64k16_ss<1, 0, 0>(dp, da, db);
        }
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(s_acc);
        reg_fence(dp);

        // Pᵀ and dSᵀ (fp32); this thread holds keys kr (e < 2), kr + 8 and queries 8j + 2c + (e & 1)
        const float *s_lse = (const float *)(st + S::LSE), *s_delta = (const float *)(st + S::DELTA);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int q = 8 * j + 2 * c;
            float2 lse = *(const float2 *)(s_lse + q), delta = *(const float2 *)(s_delta + q);
            const bool query_valid[2] = {q0 + q < N, q0 + q + 1 < N};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float s = __fmul_rn((float)s_acc[4 * j + e], scale) - (e & 1 ? lse.y : lse.x);
                p[4 * j + e] = key_valid[e / 2] && query_valid[e & 1] ? exp2f(s) : 0.0f;
                dp[4 * j + e] = p[4 * j + e] * (dp[4 * j + e] - (e & 1 ? delta.y : delta.x));
            }
        }

        // Per key (row h of this thread: key kr + 8h) over the 64 queries: P -> p8, dS -> dsk8, as the
        // int8 A fragments of dV and dK (k32 step t, register i: row h = i & 1, k-slots 16(i/2) + 4c..,
        // holding accumulator columns j0 = 4t + 2(i/2) and j0 + 1, see query_of_slot)
        float p_max[2] = {0.0f, 0.0f}, ds_max[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < 32; i++) {
            p_max[(i / 2) % 2] = fmaxf(p_max[(i / 2) % 2], p[i]);
            ds_max[(i / 2) % 2] = fmaxf(ds_max[(i / 2) % 2], fabsf(dp[i]));
        }
        // the 4 lanes of a row quad share these 4 maxima: lane c makes the scales of one of them
        // (c = 0, 1: P of row c; 2, 3: dS of row c - 2), then the quad exchanges them
#pragma unroll
        for (int h = 0; h < 2; h++)
            for (int o = 1; o < 4; o <<= 1) {
                p_max[h] = fmaxf(p_max[h], __shfl_xor_sync(0xffffffffu, p_max[h], o));
                ds_max[h] = fmaxf(ds_max[h], __shfl_xor_sync(0xffffffffu, ds_max[h], o));
            }
        float my_inv, my_scale;
        int8_scales(c == 0 ? p_max[0] : c == 1 ? p_max[1] : c == 2 ? ds_max[0] : ds_max[1], &my_inv, &my_scale);
        const float my_factor = c < 2 ? __fmul_rn(my_scale, do_scale) : __fmul_rn(__fmul_rn(my_scale, q_scale), x.u);
        float p_inv[2], ds_inv[2], dv_factor[2], dk_factor[2];   // [h]; dv, dk: scale of the int32 tile rows
#pragma unroll
        for (int h = 0; h < 2; h++) {
            p_inv[h] = __shfl_sync(0xffffffffu, my_inv, (lane & ~3) + h);
            ds_inv[h] = __shfl_sync(0xffffffffu, my_inv, (lane & ~3) + 2 + h);
            dv_factor[h] = __shfl_sync(0xffffffffu, my_factor, (lane & ~3) + h);
            dk_factor[h] = __shfl_sync(0xffffffffu, my_factor, (lane & ~3) + 2 + h);
        }
        uint32_t pa[2][4], dsa[2][4];
#pragma unroll
        for (int t = 0; t < 2; t++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int h = i & 1, at = 4 * (4 * t + 2 * (i / 2)) + 2 * h;   // accumulator index of column j0, row h
                pa[t][i] = pack_s8x4(to_int8(p[at], p_inv[h]), to_int8(p[at + 1], p_inv[h]),
                                     to_int8(p[at + 4], p_inv[h]), to_int8(p[at + 5], p_inv[h]));
                dsa[t][i] = pack_s8x4(to_int8(dp[at], ds_inv[h]), to_int8(dp[at + 1], ds_inv[h]),
                                      to_int8(dp[at + 4], ds_inv[h]), to_int8(dp[at + 5], ds_inv[h]));
            }

        // Per query over the warpgroup's 64 keys: max |dS| of this thread's 2 rows, then over the warp's
        // 8 rows (the 8 lanes with this c: xor of lane bits 2-4), then over the 4 warps in shared memory
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float mx[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                mx[e] = fmaxf(fabsf(dp[4 * j + e]), fabsf(dp[4 * j + 2 + e]));
#pragma unroll
                for (int o = 4; o < 32; o <<= 1) mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], o));
            }
            if (g == j) *(float2 *)(red + (wg * 4 + warp) * BWD90_QUERIES + 8 * j + 2 * c) = make_float2(mx[0], mx[1]);
        }
        named_barrier_sync(1 + wg, 128);
        if (tid % 128 < BWD90_QUERIES) {   // query tid % 128: over the 4 warps
            int q = tid % 128;
            float amax = 0.0f;
            for (int w = 0; w < 4; w++) amax = fmaxf(amax, red[(wg * 4 + w) * BWD90_QUERIES + q]);
            int8_scales(amax, &q_inv[wg * BWD90_QUERIES + q], &q_scale_dsq[wg * BWD90_QUERIES + q]);
        }
        named_barrier_sync(1 + wg, 128);
        // dsq8 into this warpgroup's tile: row = query 8j + 2c + e, keys kr, kr + 8 at slots 16·warp + 2g,
        // + 1 (σ); 64-byte rows, 64-byte swizzle: swizzle_offset<64> of row·64 + slot is
        // 512j + 64e + 128c + (slot XOR 16c), since (row·64 >> 7) % 4 = c, one base per thread
        uint8_t *dsq_at = sp + S::DSQ + wg * BWD90_QUERIES * I8BWD_BLOCK + 128 * c + ((16 * warp + 2 * g) ^ (16 * c));
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float2 inv = *(const float2 *)(q_inv + wg * BWD90_QUERIES + 8 * j + 2 * c);
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float iv = e ? inv.y : inv.x;
                uint32_t pair = __byte_perm(to_int8(dp[4 * j + e], iv), to_int8(dp[4 * j + 2 + e], iv), 0x0040);
                *(uint16_t *)(dsq_at + 512 * j + 64 * e) = (uint16_t)pair;
            }
        }
        fence_proxy_async();
        if (tid < 2 * BWD90_QUERIES && qb + 1 < nqb) cp_async_wait<0>();   // the next block's lse, delta

        // dV += p8ᵀ·dÔᵀ, dK += dsk8ᵀ·Q̂ᵀ in 64-column halves (int32 tiles, then scaled per key and added)
        int tv[32], tk[32];
        const uint64_t desc_dot = smem_desc<64>(st + S::DOT), desc_qt = smem_desc<64>(st + S::QT);
#pragma unroll
        for (int hf = 0; hf < D / 64; hf++) {
            wgmma_fence();
#pragma unroll
            for (int t = 0; t < 2; t++) {
                uint64_t dv_b = desc_advance(desc_dot, hf * 64 * I8BWD_BLOCK + 32 * t);
                uint64_t dk_b = desc_advance(desc_qt, hf * 64 * I8BWD_BLOCK + 32 * t);
                if (t == 0) {
                    wgmma_s8_m64n64k32_rs<0>(tv, pa[t], dv_b);
                    wgmma_s8_m64n64k32_rs<0>(tk, dsa[t], dk_b);
                } else {
                    wgmma_s8_m64n64k32_rs<1>(tv, pa[t], dv_b);
                    wgmma_s8_m64n64k32_rs<1>(tk, dsa[t], dk_b);
                }
            }
            wgmma_commit();
            if (hf == 0) {
                if (tid == 0 && qb > 0) {   // the reduce of block qb - 1 is complete: the dQ tile is free
                    bulk_wait_all();
                    if (turn) hand_on_dq_turn(turn + qb - 1);
                }
                __syncthreads();   // (A) dsq8 and dsq_scale of both warpgroups (and the next lse, delta) in shared memory
            }
            wgmma_wait<0>();
            reg_fence(tv);
            reg_fence(tk);
#pragma unroll
            for (int t = 0; t < 2; t++) {
                reg_fence(pa[t]);
                reg_fence(dsa[t]);
            }
#pragma unroll
            for (int i = 0; i < 32; i++) {
                dv[32 * hf + i] += __fmul_rn((float)tv[i], dv_factor[(i / 2) % 2]);
                dk[32 * hf + i] += __fmul_rn((float)tk[i], dk_factor[(i / 2) % 2]);
            }
        }

        // dQ[:, wg·D/2 ..] = Σ_J (dsq8_J·K̂ᵀ_J)·(dsq_scale·k_scale_J·r): 64 queries × D/2, both key blocks
        int t0[D / 4], t1[D / 4];
        const uint64_t desc_dsq = smem_desc<64>(sp + S::DSQ), desc_kt = smem_desc<64>(sp + S::KT + wg * (D / 2) * I8BWD_BLOCK);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
            uint64_t a0 = desc_advance(desc_dsq, 32 * ks), a1 = desc_advance(desc_dsq, BWD90_QUERIES * I8BWD_BLOCK + 32 * ks);
            uint64_t b0 = desc_advance(desc_kt, 32 * ks), b1 = desc_advance(desc_kt, D * I8BWD_BLOCK + 32 * ks);
            if (ks == 0) {
                dq_wgmma_s8<D, 0>(t0, a0, b0);
                dq_wgmma_s8<D, 0>(t1, a1, b1);
            } else {
                dq_wgmma_s8<D, 1>(t0, a0, b0);
                dq_wgmma_s8<D, 1>(t1, a1, b1);
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(t0);
        reg_fence(t1);
        float dq_factor[2][2];   // [J][h]: query 16·warp + g + 8h
#pragma unroll
        for (int J = 0; J < 2; J++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                dq_factor[J][h] = __fmul_rn(__fmul_rn(q_scale_dsq[J * BWD90_QUERIES + 16 * warp + g + 8 * h], k_scale_of(a, bh, nqb, 2 * kb + J)), x.r);
        float dq[D / 4];
#pragma unroll
        for (int i = 0; i < D / 4; i++)
            dq[i] = __fmul_rn((float)t0[i], dq_factor[0][(i / 2) % 2]) + __fmul_rn((float)t1[i], dq_factor[1][(i / 2) % 2]);
        store_dq_tile_folded<D>(sp + S::DQ, wg, dq, 1.0f);
        fence_proxy_async();
        if (turn && tid == 0) wait_dq_turn(turn + qb, kb, seen_turn);
        __syncthreads();   // (B) both warpgroups are done with this stage, dsq8 and dsq_scale; dQ tile complete
        if (tid == 0) {
            if (turn) fence_proxy_async_global();   // the acquired turn before the async-proxy reduce
            for (int b = 0; b < D / 32; b++) tma_reduce_add_3d(&maps.dq, sm + S::DQ + b * BWD90_QUERIES * 128, 32 * b, q0, bh);
            bulk_commit();
            if (qb + 2 < nqb) load_int8_stage<D>(st, &bar_q[stage], maps, bh, N, qb + 2);
        }
    }
    finish_dv_dk<D>(a, tid, turn, nqb, head, k0, kr, c, key_valid, dv, dk, 1.0f);   // dv, dk fully scaled already
#else
    __trap();   // built without sm_90a code: sage_backward_int8_sm90_available() says 0
#endif
}

extern "C" int sage_backward_int8_sm90_available(void) {
    return sm90_kernel_available((const void *)sage_backward_int8_sm90_kernel<128>);
}

template <int D>
static int launch_int8_backward(const Int8BwdArgs &x, uint8_t *ws, const Int8BwdLayout &l, const uint16_t *dout,
                                const uint16_t *v, int BH, cudaStream_t stream, char *err) {
    const AttnBwdArgs &a = x.a;
    int N = a.N, nqb = (N + I8BWD_BLOCK - 1) / I8BWD_BLOCK, nkb2 = 2 * ((N + BWD90_KEYS - 1) / BWD90_KEYS);
    int8_t *qt = (int8_t *)(ws + l.qt), *dot = (int8_t *)(ws + l.dot), *kt = (int8_t *)(ws + l.kt);
    int8_bwd_operands_kernel<D><<<dim3(nkb2 > nqb ? nkb2 : nqb, BH), 256, 0, stream>>>(
        qt, dot, kt, (float *)(ws + l.do_scale), a.dout, a.qv.q8, a.qv.k8, N);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch int8_bwd_operands_kernel");
    uint64_t rows = (uint64_t)BH * N;
    Int8BwdMaps m;
    if (tma_map_2d_bytes(&m.k, a.qv.k8, D, rows, D, BWD90_KEYS, "sage_backward_int8_sm90 k8", err) ||
        tma_map_2d_bytes(&m.q8, a.qv.q8, D, rows, D, BWD90_QUERIES, "sage_backward_int8_sm90 q8", err) ||
        tma_map_2d_bytes(&m.v, v, 2 * D, rows, 128, BWD90_KEYS, "sage_backward_int8_sm90 v", err) ||
        tma_map_2d_bytes(&m.dout, dout, 2 * D, rows, 128, BWD90_QUERIES, "sage_backward_int8_sm90 dout", err) ||
        tma_map_2d_bytes(&m.kt, kt, I8BWD_BLOCK, (uint64_t)BH * nkb2 * D, I8BWD_BLOCK, 2 * D,
                         "sage_backward_int8_sm90 k8 transposed", err) ||
        tma_map_2d_bytes(&m.qt, qt, I8BWD_BLOCK, (uint64_t)BH * nqb * D, I8BWD_BLOCK, D,
                         "sage_backward_int8_sm90 q8 transposed", err) ||
        tma_map_2d_bytes(&m.dot, dot, I8BWD_BLOCK, (uint64_t)BH * nqb * D, I8BWD_BLOCK, D,
                         "sage_backward_int8_sm90 dout int8 transposed", err) ||
        tma_map_dq(&m.dq, a.dq, D, N, BH, "sage_backward_int8_sm90 dq", err))
        return -1;
    int bytes = Int8BwdSmem<D>::TOTAL;
    SAGE_CUDA_CHECK(cudaFuncSetAttribute(sage_backward_int8_sm90_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         bytes),
                    err, "cudaFuncSetAttribute(sage_backward_int8_sm90_kernel max dynamic smem)");
    sage_backward_int8_sm90_kernel<D><<<dim3((N + BWD90_KEYS - 1) / BWD90_KEYS, BH), BWD90_THREADS, bytes, stream>>>(m, x);
    SAGE_CUDA_CHECK(cudaGetLastError(), err, "launch sage_backward_int8_sm90_kernel");
    return 0;
}

extern "C" int sage_backward_int8_sm90_cuda(float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                                            const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                                            const uint16_t *v, const uint16_t *out, const float *lse,
                                            const float *delta, int B, int H, int N, int D, SagePV pv,
                                            cudaStream_t stream, char *err) {
    (void)q;   // the definition's gradient products use the forward's Q̂, K̂ instead of q, k
    (void)k;
    if ((D != 64 && D != 128) || B < 1 || H < 1 || N < 1 || (long long)B * H > 65535 ||
        (long long)B * H * (N + BWD90_KEYS) * D / 64 >= (1ll << 31)) {   // the transposed operands' TMA rows
        dit_set_error(err, "sage_backward_int8_sm90_cuda: need D in {64, 128}, B, H, N >= 1, B·H <= 65535, "
                           "B·H·(N + 128)·D/64 < 2^31 (got B=%d H=%d N=%d D=%d)", B, H, N, D);
        return -1;
    }
    CHECK_DEVICE_ARGS("sage_backward_int8_sm90_cuda", err, DEVICE_ARG(dq, 16), DEVICE_ARG(dk, 16), DEVICE_ARG(dv, 16),
                      DEVICE_ARG(workspace, 128), DEVICE_ARG(fwd_workspace, 16), DEVICE_ARG(dout, 16),
                      DEVICE_ARG(v, 16), DEVICE_ARG(lse, 4));
    if (delta) CHECK_DEVICE_ARGS("sage_backward_int8_sm90_cuda", err, DEVICE_ARG(delta, 4));
    else CHECK_DEVICE_ARGS("sage_backward_int8_sm90_cuda (delta = NULL: computed from out)", err, DEVICE_ARG(out, 16));
    if (!sage_backward_int8_sm90_available()) {
        dit_set_error(err, "sage_backward_int8_sm90_cuda: needs a compute capability 9.0 device and a build with "
                           "sm_90a code (-gencode=arch=compute_90a,code=sm_90a)");
        return -1;
    }
    Int8BwdArgs x;
    x.a = {dq, dk, dv, (const __nv_bfloat16 *)dout, NULL, NULL, (const __nv_bfloat16 *)v, lse, delta,
           sage_cuda_quant_view((void *)fwd_workspace, B, H, N, D, pv), N, NULL};
    x.r = 1.0f / sqrtf((float)D);
    x.u = x.r / (x.r * 1.44269504f);
    Int8BwdLayout l = int8_bwd_layout(B * H, N, D);
    x.do_scale = (const float *)((uint8_t *)workspace + l.do_scale);
    if (attention_backward_prepare(&x.a, workspace, out, B * H, D, sage_backward_deterministic(), stream, err) != 0)
        return -1;
    if (D == 64) return launch_int8_backward<64>(x, (uint8_t *)workspace, l, dout, v, B * H, stream, err);
    return launch_int8_backward<128>(x, (uint8_t *)workspace, l, dout, v, B * H, stream, err);
}
