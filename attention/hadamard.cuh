// The fast Walsh-Hadamard transform of rows of D = 8·L values in registers, a row spread over L
// consecutive lanes (L = D/8 = 4, 8 or 16; a warp holds 32/L rows) with 8 values per lane, so that
// every lane moves 16 bytes of bf16 (or 32 of fp32) at once (sage's rotation,
// attention/hadamard_cuda.h), for the kernels that rotate rows on the way through:
// hadamard_cuda.cu (in place), sage's split of a qkv projection's output (sage_quant.cu) and the
// model's head split and dq merge (model/dit_gpu.cu).
// Lane l of a row holds the values 8l .. 8l + 7. Butterfly stage h pairs positions j and j + h
// (bit h of j clear):  v[j] = a + b,  v[j + h] = a - b  (a = v[j], b = v[j + h]).
// For h < 8 both are in the same lane; for h >= 8 they are in lanes l and l ^ (h/8) of the row's
// group, and the lane with that bit set holds v[j + h]. Then every value is multiplied by
// norm = 1/sqrt(D). The CPU's butterfly order (hadamard_rotate in attention/sage_cpu.c), each
// output from the same additions in the same order: fp32 results are bitwise the CPU's. All 32
// lanes of the warp must call it (lanes without a row compute on anything and store nothing).
#pragma once

#define HADAMARD_VALUES_PER_LANE 8   // one 16-byte vector of bf16 (VEC of layers/cuda_common.cuh)

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
