// The fast Walsh-Hadamard transform of rows of D = 8·L values in registers, a row spread over L
// consecutive lanes (L = D/8 = 4, 8 or 16; a warp holds 32/L rows) with 8 values per lane, so that
// every lane moves 16 bytes of bf16 (or 32 of fp32) at once (sage's rotation,
// attention/hadamard_cuda.h), for the kernels that rotate rows on the way through:
// hadamard_cuda.cu (in place) and the model's head split and dq/dk merge (model/dit_gpu.cu).
// Lane l of a row holds the values 8l .. 8l + 7. Butterfly stage h pairs positions j and j + h
// (bit h of j clear):  v[j] = a + b,  v[j + h] = a - b  (a = v[j], b = v[j + h]).
// For h < 8 both are in the same lane; for h >= 8 they are in lanes l and l ^ (h/8) of the row's
// group, and the lane with that bit set holds v[j + h]. Then every value is multiplied by
// norm = 1/sqrt(D). The CPU's butterfly order (hadamard_rotate in attention/sage_cpu.c), each
// output from the same additions in the same order: fp32 results are bitwise the CPU's. All 32
// lanes of the warp must call it (lanes without a row compute on anything and store nothing).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#define HADAMARD_VALUES_PER_LANE 8

template <int D>
__device__ __forceinline__ void walsh_hadamard(float (&v)[HADAMARD_VALUES_PER_LANE], float norm) {
    constexpr int E = HADAMARD_VALUES_PER_LANE;
    static_assert(D % E == 0 && D / E <= 32 && (D & (D - 1)) == 0, "D = 8·L, L a power of two ≤ 32");
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int h = 1; h < E; h *= 2)
#pragma unroll
        for (int j = 0; j < E; j++)
            if (!(j & h)) {
                float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
#pragma unroll
    for (int h = E; h < D; h *= 2) {
        const int partner_bit = h / E;
        const bool high = lane & partner_bit;   // this lane holds the v[j + h] of the pairs
#pragma unroll
        for (int j = 0; j < E; j++) {
            float other = __shfl_xor_sync(0xffffffffu, v[j], partner_bit);
            v[j] = high ? other - v[j] : v[j] + other;
        }
    }
#pragma unroll
    for (int j = 0; j < E; j++) v[j] *= norm;
}

// 8 consecutive values as fp32 and back (p 16-byte aligned for bf16, 32-byte for fp32): bf16
// rounds to nearest even, fp32 is kept as is.
__device__ __forceinline__ void load8(float (&v)[8], const __nv_bfloat16 *p) {
    uint4 u = *(const uint4 *)p;
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = __bfloat1622float2(h[i]);
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void load8(float (&v)[8], const float *p) {
    float4 a = *(const float4 *)p, b = *(const float4 *)(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void store8(__nv_bfloat16 *p, const float (&v)[8]) {
    uint4 u;
    __nv_bfloat162 *h = (__nv_bfloat162 *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *(uint4 *)p = u;
}
__device__ __forceinline__ void store8(float *p, const float (&v)[8]) {
    *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]);
    *(float4 *)(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}
