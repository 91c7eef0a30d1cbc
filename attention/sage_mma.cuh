// Warp-level building blocks of the sage kernels: cp.async tile loads, ldmatrix and the
// mma.sync shapes they feed. Fragment layouts (PTX ISA, "warp-level matrix fragments"),
// with lane = 4·g + c (g = lane/4 the group, c = lane%4):
//   C/D of m16n8 (fp32 or s32): {d0, d1} at row g, cols 2c, 2c+1; {d2, d3} at row g+8.
//   m16n8k32 8-bit A (row-major 16×32): a0 row g, k 4c..4c+3; a1 row g+8; a2 row g, k 16+4c..;
//     a3 row g+8, k 16+4c.. (lowest k in the lowest byte). B (32×8): b0 k 4c..4c+3 of col g; b1 k 16+4c...
//   m16n8k16 16-bit A: a0 row g, k 2c, 2c+1; a1 row g+8; a2 row g, k 8+2c..; a3 row g+8, k 8+2c..
//     B (16×8): b0 k 2c, 2c+1 of col g; b1 k 8+2c, 8+2c+1.
// ldmatrix (non-transposed) gives lane t the 4 bytes at row t/4, bytes 4(t%4).. of each 8×16-byte
// matrix, which is the fragment above for rows stored with k contiguous; .trans gives a 16-bit
// matrix transposed.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#define SAGE_CUDA_CHECK(call, err, what)                                                     \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            dit_set_error(err, "%s: %s (%s)", __func__, what, cudaGetErrorString(e_));       \
            return -1;                                                                       \
        }                                                                                    \
    } while (0)

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared; bytes past `valid` (0 or 16) are zero-filled.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int n> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(n));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// d += a·b, int8 × int8 -> int32, m16n8k32.
__device__ __forceinline__ void mma_s8(int d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a·b, e4m3 × e4m3 -> fp32, m16n8k32 (sm_89+; the caller guards).
__device__ __forceinline__ void mma_e4m3(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// d += a·b, fp16 × fp16 -> fp32, m16n8k16.
__device__ __forceinline__ void mma_f16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a·b, bf16 × bf16 -> fp32, m16n8k16.
__device__ __forceinline__ void mma_bf16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats to two e4m3 bytes (round to nearest even, saturating at ±448): lo in the low byte.
__device__ __forceinline__ uint16_t pack_e4m3x2(float lo, float hi) {
    return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *(uint32_t *)&h;
}
__device__ __forceinline__ uint32_t pack_bf162(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&h;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// ROWS rows of ROW_BYTES from src (row stride src_stride bytes) to smem rows of STRIDE bytes, by
// the THREADS threads of the CTA, 16 bytes per cp.async; rows >= valid_rows are zero-filled.
template <int ROWS, int ROW_BYTES, int STRIDE, int THREADS>
__device__ __forceinline__ void cp_async_rows(uint8_t *dst, const uint8_t *src, size_t src_stride,
                                              int valid_rows) {
    constexpr int CHUNKS = ROW_BYTES / 16, TOTAL = ROWS * CHUNKS;
#pragma unroll
    for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; it++) {
        int i = it * THREADS + threadIdx.x;
        if (TOTAL % THREADS != 0 && i >= TOTAL) break;
        int r = i / CHUNKS, ch = i % CHUNKS;
        bool valid = r < valid_rows;
        cp_async16(dst + r * STRIDE + ch * 16, src + (valid ? r : 0) * src_stride + ch * 16, valid);
    }
}

// p[0] += a, p[1] += b in global fp32 memory (one vector reduction on sm_90+, two before).
__device__ __forceinline__ void atomic_add_f32x2(float *p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd((float2 *)p, make_float2(a, b));
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}
