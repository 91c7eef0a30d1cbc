// Hopper (sm_90a) building blocks of the wgmma sage kernels, named after what they do:
// shared-memory matrix descriptors, wgmma calls and fences, TMA tile loads and mbarriers (PTX for
// sm_90a, compiled only under SAGE_SM90_DEVICE), and at the end the host side of TMA: tensor maps.
//
// Layouts (PTX ISA, "asynchronous warpgroup level matrix"), per warpgroup of 128 threads,
// warp w = (thread % 128) / 32 owns rows 16w..16w+15; lane = 4·g + c:
//   accumulator of m64nN (s32 or f32): d[4j + e] for j < N/8 is row 16w + g (e = 0, 1) or
//     16w + g + 8 (e = 2, 3), column 8j + 2c + (e & 1): the mma.sync m16n8 C layout, N/8 times.
//   8-bit A from registers (m64nNk32): a[0] row 16w + g, k 4c..4c+3 (lowest k in the lowest
//     byte); a[1] row 16w + g + 8, same k; a[2], a[3] the same rows at k 16 + 4c..: the mma.sync
//     m16n8k32 A layout of attention/sage_mma.cuh.
//   Shared-memory operands of 8-bit wgmma are K-major only: each of the M (or N) rows holds its
//     K bytes contiguously. With TMA's 128-byte (64-byte) swizzle a tile of rows of 128 (64) bytes
//     lands in the canonical swizzled layout: 8-row atoms of 1024 (512) bytes, the 16-byte chunks
//     of row r XOR-permuted by r % 8. Its descriptor: start address, stride between 8-row atoms
//     (SBO = 8 · row bytes) and the swizzle mode; the k32 step inside a row is +32 bytes on the
//     start address (the hardware applies the swizzle to the address it forms).
#pragma once
#include <cuda.h>
#include <stdint.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SAGE_SM90_DEVICE 1
#endif

#ifdef SAGE_SM90_DEVICE

// ---- matrix descriptors ----------------------------------------------------------------------
// K-major tile at `smem` (aligned to its swizzle atom) with rows of ROW_BYTES = 128 or 64 bytes,
// swizzled as TMA writes it (CU_TENSOR_MAP_SWIZZLE_128B / _64B).
template <int ROW_BYTES>
__device__ __forceinline__ uint64_t smem_desc(const void *smem) {
    static_assert(ROW_BYTES == 128 || ROW_BYTES == 64, "swizzled rows of 128 or 64 bytes");
    uint64_t addr = (uint32_t)__cvta_generic_to_shared(smem);
    uint64_t desc = (addr & 0x3ffff) >> 4;                   // bits 0-13: start address / 16
    desc |= (uint64_t)1 << 16;                               // bits 16-29: LBO (unused when swizzled)
    desc |= (uint64_t)((8 * ROW_BYTES) >> 4) << 32;          // bits 32-45: SBO / 16
    desc |= (uint64_t)(ROW_BYTES == 128 ? 1 : 2) << 62;      // bits 62-63: 128B (1) or 64B (2) swizzle
    return desc;
}
// The same descriptor moved `bytes` further: along K (bytes < ROW_BYTES, a multiple of 16), or to
// another tile of the same layout (a multiple of the 1024-byte swizzle atom). Shared addresses are
// below 256 KB, so the start address field (bits 0-13) never carries into the LBO.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, int bytes) { return desc + (bytes >> 4); }

// ---- wgmma ordering ---------------------------------------------------------------------------
// Before the first wgmma of a batch: orders this thread's register writes (A fragments,
// accumulators) before the asynchronous reads of the tensor cores.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Closes the batch of wgmma issued since the last commit into one group.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most n committed groups are still in flight (0: all done, results readable).
template <int n> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(n) : "memory");
}
// Keeps the compiler from moving accesses of wgmma registers (accumulators, A fragments) across
// the wait that completes them: call it on each after wgmma_wait.
template <int n> __device__ __forceinline__ void reg_fence(float (&d)[n]) {
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(d[i])::"memory");
}
template <int n> __device__ __forceinline__ void reg_fence(int (&d)[n]) {
    for (int i = 0; i < n; i++) asm volatile("" : "+r"(d[i])::"memory");
}
template <int n> __device__ __forceinline__ void reg_fence(uint32_t (&d)[n]) {
    for (int i = 0; i < n; i++) asm volatile("" : "+r"(d[i])::"memory");
}

// The online softmax's O *= alpha (alpha per row: this thread's rows g and g + 8 of its warp, in
// the m64nN accumulator layout) before a P·V wgmma accumulates into O, skipped when every alpha of
// the warp is 1 (no row maximum of its 16 rows moved: multiplying by 1 would change no bit). The
// register fence keeps the multiplications ahead of the caller's wgmma_fence (inside the wgmma's
// pipeline stage ptxas would serialize the wgmmas, C7513).
template <int n> __device__ __forceinline__ void rescale_o(float (&o)[n], const float (&alpha)[2]) {
    if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
        for (int i = 0; i < n; i++) o[i] *= alpha[(i % 4) / 2];
    }
    reg_fence(o);
}

// ---- mbarriers -------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t *bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"((uint32_t)__cvta_generic_to_shared(bar)),
                 "r"(count));
}
// Makes initialized barriers visible to the other threads and to the TMA unit.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
__device__ __forceinline__ void mbar_expect_bytes(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 ::"r"((uint32_t)__cvta_generic_to_shared(bar)), "r"(bytes) : "memory");
}
// Blocks until the phase with the given parity (0, 1, 0, ... per completed phase) has completed.
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
    asm volatile("{\n"
                 ".reg .pred done;\n"
                 "WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n"
                 "}\n" ::"r"((uint32_t)__cvta_generic_to_shared(bar)), "r"(parity) : "memory");
}

// threadIdx.x read afresh (volatile): an index derived from it (a named-barrier id, an epilogue's
// offsets) costs an instruction or two where a value kept from the kernel's start holds a register
// through the main loop (and spilled there at D = 128).
__device__ __forceinline__ int thread_index() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
    return t;
}

// ---- TMA ---------------------------------------------------------------------------------------
// Box of the 2-D tensor map at element coordinates (x = inner, y = outer) into shared memory;
// completion is counted in bytes on `bar`. Out-of-bounds elements arrive as zeros.
__device__ __forceinline__ void tma_load_2d(void *smem, const CUtensorMap *map, uint64_t *bar, int x, int y) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%3, %4}], [%2];\n"
                 ::"r"((uint32_t)__cvta_generic_to_shared(smem)), "l"((uint64_t)map),
                   "r"((uint32_t)__cvta_generic_to_shared(bar)), "r"(x), "r"(y) : "memory");
}

// The same for a 4-D tensor map, coordinates (x, y, z, w) from the innermost.
__device__ __forceinline__ void tma_load_4d(void *smem, const CUtensorMap *map, uint64_t *bar, int x, int y, int z,
                                            int w) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%3, %4, %5, %6}], [%2];\n"
                 ::"r"((uint32_t)__cvta_generic_to_shared(smem)), "l"((uint64_t)map),
                   "r"((uint32_t)__cvta_generic_to_shared(bar)), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}

// The box at shared address smem into the 4-D tensor map at coordinates (x, y, z, w) from the
// innermost (rows outside the tensor are not written); completes in this thread's bulk group
// (bulk_commit).
__device__ __forceinline__ void tma_store_4d(const CUtensorMap *map, uint32_t smem, int x, int y, int z, int w) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"((uint64_t)map), "r"(smem), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
// Closes this thread's bulk group of TMA stores (and reduce-adds) issued since the last one.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until this thread's bulk groups are complete (their writes performed).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Until at most n of this thread's bulk groups have not yet read their shared-memory sources (the
// others' sources may be rewritten; their global writes may still be in flight).
template <int n> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(n) : "memory");
}

// ---- wgmma shapes of the sage forward ------------------------------------------------------------
// d (+)= A·B, int8 × int8 -> int32, m64n64k32; A and B K-major in shared memory (descriptors).
// scale_d = 0 overwrites d, 1 accumulates. d: 32 registers per thread (accumulator layout above).
template <int scale_d>
__device__ __forceinline__ void wgmma_s8_m64n64k32(int d[32], uint64_t desc_a, uint64_t desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, %34;\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
                   "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
                   "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
                   "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
                 : "l"(desc_a), "l"(desc_b), "n"(scale_d));
}

// The same with A from registers (4 per thread, the 8-bit A fragment above).
template <int scale_d>
__device__ __forceinline__ void wgmma_s8_m64n64k32_rs(int d[32], const uint32_t a[4], uint64_t desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, %37;\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
                   "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
                   "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
                   "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(scale_d));
}

// d (+)= A·B, e4m3 × e4m3 -> fp32, m64n64k32; A from registers (4 per thread, the 8-bit A
// fragment above), B K-major in shared memory. scale_d = 0 overwrites d, 1 accumulates.
template <int scale_d>
__device__ __forceinline__ void wgmma_e4m3_m64n64k32(float d[32], const uint32_t a[4], uint64_t desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, %37, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(scale_d));
}

// d (+)= A·B, fp16 × fp16 -> fp32, m64n64k16; A from registers (4 per thread: each warp's 16 rows
// in the m16n8k16 A layout of sage_mma.cuh: a[0] row g, k 2c, 2c+1; a[1] row g + 8; a[2], a[3] the
// same rows at k 8 + 2c), B K-major in shared memory (rows of 16-bit elements along K). d: 32
// registers. The FP16 P·V of the D = 64 sage forward.
template <int scale_d>
__device__ __forceinline__ void wgmma_f16_m64n64k16_rs(float d[32], const uint32_t a[4], uint64_t desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, %37, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(scale_d));
}

// The same, m64n128k16 (d: 64 registers): the FP16 P·V of the D = 128 sage forward.
template <int scale_d>
__device__ __forceinline__ void wgmma_f16_m64n128k16_rs(float d[64], const uint32_t a[4], uint64_t desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, %69, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(scale_d));
}

// ---- the sage backward: bf16 wgmma, MN-major operands, ordering -------------------------------
// 16-bit operands in shared memory may be K-major (trans 0) or MN-major (trans 1: each of the K
// rows holds its M (or N) elements contiguously). MN-major with the 128-byte (64-byte) swizzle:
// atoms of 8 K-rows × 64 (32) elements, 1024 (512) bytes, the 16-byte chunks of each row
// XOR-permuted as in the K-major case; SBO = stride between groups of 8 K-rows, LBO = stride
// between atoms along M (N); a k16 step is +2 groups of 8 K-rows on the start address.
template <int ROW_BYTES>
__device__ __forceinline__ uint64_t smem_desc_mn(const void *smem, uint32_t lbo_bytes) {
    static_assert(ROW_BYTES == 128 || ROW_BYTES == 64, "swizzled rows of 128 or 64 bytes");
    uint64_t addr = (uint32_t)__cvta_generic_to_shared(smem);
    uint64_t desc = (addr & 0x3ffff) >> 4;                   // bits 0-13: start address / 16
    desc |= (uint64_t)((lbo_bytes >> 4) & 0x3fff) << 16;     // bits 16-29: LBO / 16 (atoms along M/N)
    desc |= (uint64_t)((8 * ROW_BYTES) >> 4) << 32;          // bits 32-45: SBO / 16 (8 K-rows)
    desc |= (uint64_t)(ROW_BYTES == 128 ? 1 : 2) << 62;      // bits 62-63: 128B (1) or 64B (2) swizzle
    return desc;
}

// Byte offset `off` (from a tile aligned to 1024 bytes) of the unswizzled layout with rows of
// ROW_BYTES = 128 (64) bytes, moved to where the 128-byte (64-byte) swizzle puts it: the 16-byte
// chunk index XOR the row index mod 8 (128 B rows) or (row / 2) mod 4 (64 B rows), i.e. address
// bits 4-6 (4-5) XOR bits 7-9 (7-8). For ordinary stores into tiles that wgmma reads.
template <int ROW_BYTES> __device__ __forceinline__ uint32_t swizzle_offset(uint32_t off) {
    static_assert(ROW_BYTES == 128 || ROW_BYTES == 64, "swizzled rows of 128 or 64 bytes");
    return off ^ (((off >> 7) & (ROW_BYTES == 128 ? 7u : 3u)) << 4);
}

// A 64-row tile of int8 rows of D bytes (D = 128 or 64, swizzled as TMA writes it) as the D/32 k32
// A fragments of warp wq's 16 rows (the 8-bit A layout at the top of this file): a[ks][0] row
// 16wq + g, bytes 32ks + 4c..+3; a[ks][1] row + 8; a[ks][2], a[ks][3] the same rows 16 bytes on.
// For an int8 wgmma whose A operand stays the same over many products (the forward's Q̂, the
// backward's K̂).
template <int D>
__device__ __forceinline__ void load_s8_a_fragments(uint32_t (&a)[D / 32][4], const uint8_t *tile, int wq, int g, int c) {
#pragma unroll
    for (int ks = 0; ks < D / 32; ks++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int row = 16 * wq + g + 8 * (i & 1), col = 32 * ks + 16 * (i / 2) + 4 * c;
            a[ks][i] = *(const uint32_t *)(tile + swizzle_offset<D>(row * D + col));
        }
}

// The 64 × 64 int32 scores of those A fragments against a K-major int8 tile B (rows of D bytes,
// desc_b) over the D/32 k32 steps: the forward's S = Q̂·K̂ᵀ, the backward's Sᵀ = K̂·Q̂ᵀ.
template <int D>
__device__ __forceinline__ void wgmma_s8_scores_rs(int (&d)[32], const uint32_t (&a)[D / 32][4], uint64_t desc_b) {
#pragma unroll
    for (int ks = 0; ks < D / 32; ks++) {
        if (ks == 0) wgmma_s8_m64n64k32_rs<0>(d, a[0], desc_b);
        else wgmma_s8_m64n64k32_rs<1>(d, a[ks], desc_advance(desc_b, 32 * ks));
    }
}

// Orders this thread's ordinary shared-memory writes before later reads by the tensor cores or
// the TMA unit (the async proxy); a barrier must follow before another thread's wgmma reads them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d (+)= A·B, bf16 -> fp32, m64n32k16, A and B in shared memory (descriptors); TRANS_A / TRANS_B
// = 1 for MN-major operands. scale_d = 0 overwrites d, 1 accumulates. d: 16 registers per thread.
template <int scale_d, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_bf16_m64n32k16_ss(float d[16], uint64_t desc_a, uint64_t desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, %18, 1, 1, %19, %20;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "l"(desc_a), "l"(desc_b), "n"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}

// d (+)= A·B, bf16 -> fp32, m64n64k16, A and B in shared memory (descriptors); TRANS_A / TRANS_B
// = 1 for MN-major operands. scale_d = 0 overwrites d, 1 accumulates. d: 32 registers per thread.
template <int scale_d, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_bf16_m64n64k16_ss(float d[32], uint64_t desc_a, uint64_t desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, %34, 1, 1, %35, %36;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(desc_a), "l"(desc_b), "n"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}

// d (+)= A·B, bf16 -> fp32, m64n64k16, A from registers (4 per thread: each warp's 16 rows in the
// m16n8k16 A layout of sage_mma.cuh), B in shared memory, MN-major if TRANS_B. d: 32 registers.
template <int scale_d, int TRANS_B>
__device__ __forceinline__ void wgmma_bf16_m64n64k16_rs(float d[32], const uint32_t a[4], uint64_t desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, %37, 1, 1, %38;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(scale_d), "n"(TRANS_B));
}

// d (+)= A·B, bf16 -> fp32, m64n128k16, A from registers (4 per thread: each warp's 16 rows in the
// m16n8k16 A layout of sage_mma.cuh), B in shared memory, MN-major if TRANS_B. d: 64 registers.
template <int scale_d, int TRANS_B>
__device__ __forceinline__ void wgmma_bf16_m64n128k16_rs(float d[64], const uint32_t a[4], uint64_t desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, %69, 1, 1, %70;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(scale_d), "n"(TRANS_B));
}

#endif  // SAGE_SM90_DEVICE

// ---- host side: TMA tensor maps ---------------------------------------------------------------
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include "layers/common.h"

// cuTensorMapEncodeTiled from the driver, through the runtime (no -lcuda needed).
static inline PFN_cuTensorMapEncodeTiled_v12000 tma_map_encoder(char *err) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = NULL;
    if (!encode) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult found;
        cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
        if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || !fn) {
            dit_set_error(err, "cuTensorMapEncodeTiled not found in the driver (%s)", cudaGetErrorString(e));
            return NULL;
        }
        encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }
    return encode;
}

// 2-D tensor map of bytes over `base` (inner × outer, row stride = inner), box box_inner ×
// box_outer swizzled by its row length (128 or 64 bytes). Elements outside arrive as zeros.
// `what` names the kernel and tensor in the error message.
static inline int tma_map_2d_bytes(CUtensorMap *map, const void *base, uint64_t inner, uint64_t outer,
                                   uint32_t box_inner, uint32_t box_outer, const char *what, char *err) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tma_map_encoder(err);
    if (!encode) return -1;
    cuuint64_t dims[2] = {inner, outer}, strides[1] = {inner};
    cuuint32_t box[2] = {box_inner, box_outer}, elem_strides[2] = {1, 1};
    CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, (void *)base, dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE,
                        box_inner == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        dit_set_error(err, "cuTensorMapEncodeTiled(%s: %llu x %llu bytes, box %u x %u) failed (%d)", what,
                      (unsigned long long)inner, (unsigned long long)outer, box_inner, box_outer, (int)r);
        return -1;
    }
    return 0;
}

// One head's rows of a bf16 (B, H, N, D) tensor, head-major, or of a merged (B, N, H, D) one
// (merged_heads = H; attention_rows.cuh), as a 4-D map of bytes (2D, N, heads, batches): merged,
// (2D, N, H, B) with rows H·D apart; head-major, (2D, N, 1, B·H). Boxes of 128 bytes × box_rows
// rows of one head, 128-byte swizzled; coordinates (x, t, bh % H, bh / H), or (x, t, 0, bh)
// head-major. Rows >= N arrive as zeros (loads) or are not written (stores).
static inline int tma_map_head_rows(CUtensorMap *map, const void *base, int D, int N, int BH, int merged_heads,
                                    int box_rows, const char *what, char *err) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tma_map_encoder(err);
    if (!encode) return -1;
    uint64_t row = (uint64_t)2 * D, h = merged_heads ? (uint64_t)merged_heads : 1;
    cuuint64_t dims[4] = {row, (cuuint64_t)N, h, (cuuint64_t)BH / h};
    cuuint64_t strides[3] = {row * h, merged_heads ? row : row * N, row * h * N};
    cuuint32_t box[4] = {128, (cuuint32_t)box_rows, 1, 1}, elem_strides[4] = {1, 1, 1, 1};
    CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, (void *)base, dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        dit_set_error(err, "cuTensorMapEncodeTiled(%s: D=%d N=%d B·H=%d merged_heads=%d) failed (%d)", what, D, N, BH,
                      merged_heads, (int)r);
        return -1;
    }
    return 0;
}

// 1 when the current device is compute capability 9.0 and `kernel` (any instantiation of an sm90
// kernel) was built as sm_90a machine code, not JIT-compiled from older PTX.
static inline int sm90_kernel_available(const void *kernel) {
    int dev, major, minor;
    cudaFuncAttributes attr;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    if (major != 9 || minor != 0) return 0;
    if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return attr.binaryVersion >= 90 && attr.ptxVersion >= 90;
}

// ---- the warp-specialized kernels: consumer releases, named barriers, register reallocation --
#ifdef SAGE_SM90_DEVICE
// One plain arrival on an mbarrier (a consumer saying "I am done with this buffer").
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"((uint32_t)__cvta_generic_to_shared(bar))
                 : "memory");
}

// Named CTA barriers 1..15 (0 is __syncthreads) over `count` threads (a multiple of 32): sync
// waits for count arrivals including its own; arrive counts itself and goes on.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Register reallocation between the warpgroups of a CTA (whole warpgroup executes it): a
// producer gives registers back, consumers take them.
template <int regs> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(regs));
}
template <int regs> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(regs));
}
#endif  // SAGE_SM90_DEVICE
