// Issue rate of the conversions in the attention kernels' softmax (dev/notes_bwd_plan.md left it
// open): I2FP.F32.S32 (int32 score -> float, one per score in sage's forward and backward),
// F2FP...E4M3...PACK (two floats -> e4m3x2, P for the FP8 P·V), F2FP.BF16.F32.PACK_AB (two floats
// -> bf16x2, Pᵀ/dSᵀ in the backward), against FADD and LOP3 as full-rate references. Every thread
// runs 8 independent chains of one instruction kind (plus, for the packs, one LOP3 that turns the
// packed bits back into a float); results in instructions per clock per SM (clock64 around the
// loop of each CTA, one CTA of 1024 threads per SM). 128 = the FP32 pipe's rate, 64 = half rate,
// 16 = the quarter-rate unit (as MUFU.EX2 measured 16.00 in session 9).
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o bench_cvt_rate dev/bench_cvt_rate.cu
// Check the SASS (cuobjdump -sass) for the instruction names before reading the rates.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

#define ITERS 4096
#define CHAINS 8

enum { I2FP = 0, PACK_E4M3, PACK_BF16, FADD, LOP3, KINDS };
static const char *kind_name[KINDS] = {"I2FP.F32.S32 (cvt.rn.f32.s32)", "F2FP e4m3x2 pack + LOP3",
                                       "F2FP bf16x2 pack + LOP3", "FADD + LOP3", "LOP3"};

template <int KIND> __device__ __forceinline__ void step(uint32_t &x) {
    if (KIND == I2FP) {   // x <- bits of (float)(int)x: stays near 1.3e9, one I2FP per step
        float f;
        asm volatile("cvt.rn.f32.s32 %0, %1;" : "=f"(f) : "r"(x));
        x = __float_as_uint(f);
    } else if (KIND == PACK_E4M3) {
        uint16_t p;
        float f = __uint_as_float(x);
        asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(p) : "f"(f));
        asm volatile("lop3.b32 %0, %1, 0x3f000000, 0x0000ffff, 0xf8;" : "=r"(x) : "r"((uint32_t)p));
    } else if (KIND == PACK_BF16) {
        uint32_t p;
        float f = __uint_as_float(x);
        asm volatile("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(p) : "f"(f));
        asm volatile("lop3.b32 %0, %1, 0x3f000000, 0x0000ffff, 0xf8;" : "=r"(x) : "r"(p));
    } else if (KIND == FADD) {
        float f;
        asm volatile("add.f32 %0, %1, 0f3F800000;" : "=f"(f) : "f"(__uint_as_float(x)));
        x = __float_as_uint(f) & 0x3fffffff;   // one LOP3 (keeps the chain bounded)
    } else {
        asm volatile("lop3.b32 %0, %0, 0x3f000000, 0x0000ffff, 0xf8;" : "+r"(x));
    }
}

template <int KIND> __global__ void chains(uint32_t *out, long long *cycles, uint32_t seed) {
    uint32_t x[CHAINS];
    for (int c = 0; c < CHAINS; c++) x[c] = 0x3f000000u + seed * (threadIdx.x + c);
    long long t0 = clock64();
    for (int i = 0; i < ITERS; i++)
#pragma unroll
        for (int c = 0; c < CHAINS; c++) step<KIND>(x[c]);
    long long t1 = clock64();
    uint32_t s = 0;
    for (int c = 0; c < CHAINS; c++) s ^= x[c];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int KIND> static double rate(int sms, uint32_t *out, long long *cyc) {
    const int threads = 1024;
    for (int rep = 0; rep < 3; rep++) chains<KIND><<<sms, threads>>>(out, cyc, 7u);
    if (cudaDeviceSynchronize() != cudaSuccess) { printf("kernel failed\n"); return -1; }
    static long long host[1024];
    cudaMemcpy(host, cyc, (size_t)sms * 8, cudaMemcpyDeviceToHost);
    double mean = 0;
    for (int b = 0; b < sms; b++) mean += (double)host[b] / sms;
    return (double)threads * ITERS * CHAINS / mean;   // chain steps per clock per SM
}

int main(void) {
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    uint32_t *out;
    long long *cyc;
    cudaMalloc(&out, (size_t)sms * 1024 * 4);
    cudaMalloc(&cyc, (size_t)sms * 8);
    double r[KINDS] = {rate<I2FP>(sms, out, cyc), rate<PACK_E4M3>(sms, out, cyc), rate<PACK_BF16>(sms, out, cyc),
                       rate<FADD>(sms, out, cyc), rate<LOP3>(sms, out, cyc)};
    for (int k = 0; k < KINDS; k++) printf("%-32s %7.2f steps/clk/SM\n", kind_name[k], r[k]);
    // a pack or FADD step is that instruction and one LOP3: its own rate from 1/r = 1/r_own + 1/r_lop3
    // (exact if the two share one pipe's issue; a lower bound of the own rate otherwise)
    for (int k = PACK_E4M3; k <= FADD; k++)
        printf("  %-30s %7.2f instr/clk/SM (LOP3's share removed)\n", kind_name[k], 1.0 / (1.0 / r[k] - 1.0 / r[LOP3]));
    return 0;
}
