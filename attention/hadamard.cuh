// The fast Walsh-Hadamard transform of one row of D = 32·E values in a warp's registers (sage's
// rotation, attention/hadamard_cuda.h), for the kernels that rotate rows on the way through:
// hadamard_cuda.cu (in place) and the model's head split and dq/dk merge (model/dit_gpu.cu).
// Lane l holds the E contiguous values l·E .. l·E + E - 1. Butterfly stage h pairs positions j
// and j + h (bit h of j clear):  v[j] = a + b,  v[j + h] = a - b  (a = v[j], b = v[j + h]).
// For h < E both are in the same lane; for h >= E they are in lanes l and l ^ (h/E), and the
// lane with that bit set holds v[j + h]. Then every value is multiplied by norm = 1/sqrt(D).
// The CPU's butterfly order (hadamard_rotate in attention/sage_cpu.c): fp32 results are bitwise
// the CPU's. All 32 lanes of the warp must call it.
#pragma once

template <int E>
__device__ __forceinline__ void walsh_hadamard(float (&v)[E], float norm) {
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
    for (int h = E; h < 32 * E; h *= 2) {
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
