// Is the int32 -> fp32 conversion of the INT8 score tiles (I2FP.F32.S32 in the sage kernels' SASS,
// one per score, as many as the MUFU.EX2 of the softmax) a quarter-rate instruction, and does it
// share the unit of MUFU.EX2? Every thread runs CHAINS independent chains per kind; results in
// operations per clock per SM (clock64 around the loop, one CTA of 1024 threads per SM).
// "magic": the same conversion as an integer add into the bits of 1.5·2^23 and an exact float
// subtraction (|x| < 2^22), which is what the kernels could use instead.
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o bench_i2f dev/bench_i2f.cu
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

#define ITERS 4096
#define CHAINS 8

enum { EX2, I2F, BOTH, MAGIC, MAGIC_EX2 };

template <int kind>
__global__ void bench(float *out, long long *cycles, float seed) {
    float y[CHAINS];
    int x[CHAINS];
    for (int c = 0; c < CHAINS; c++) { y[c] = seed * (threadIdx.x + c); x[c] = threadIdx.x * 977 + c; }
    long long t0 = clock64();
    for (int i = 0; i < ITERS; i++) {
#pragma unroll
        for (int c = 0; c < CHAINS; c++) {
            if (kind == EX2 || kind == BOTH || kind == MAGIC_EX2)
                asm volatile("{ .reg .f32 t; neg.f32 t, %0; ex2.approx.ftz.f32 %0, t; }" : "+f"(y[c]));
            if (kind == I2F || kind == BOTH) {
                float f;
                asm volatile("cvt.rn.f32.s32 %0, %1;" : "=f"(f) : "r"(x[c]));
                x[c] = __float_as_int(f) & 0x1fffff;
            }
            if (kind == MAGIC || kind == MAGIC_EX2) {
                float f;
                asm volatile("{ .reg .b32 t; add.s32 t, %1, 0x4B400000; sub.rn.f32 %0, t, 0f4B400000; }"
                             : "=f"(f) : "r"(x[c]));
                x[c] = __float_as_int(f) & 0x1fffff;
            }
        }
    }
    long long t1 = clock64();
    float s = 0;
    for (int c = 0; c < CHAINS; c++) s += y[c] + (float)x[c];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

static void launch(int k, int sms, int threads, float *out, long long *cyc) {
    void (*kernels[])(float *, long long *, float) = {bench<EX2>, bench<I2F>, bench<BOTH>, bench<MAGIC>,
                                                      bench<MAGIC_EX2>};
    kernels[k]<<<sms, threads>>>(out, cyc, 1e-4f);
}

int main(void) {
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const int threads = 1024;
    float *out;
    long long *cyc, host[1024];
    cudaMalloc(&out, (size_t)sms * threads * 4);
    cudaMalloc(&cyc, (size_t)sms * 8);
    const char *names[] = {"ex2 alone", "cvt.rn.f32.s32 alone", "ex2 + cvt (one each)", "magic add+sub alone",
                           "ex2 + magic (one each)"};
    for (int k = 0; k < 5; k++) {
        for (int rep = 0; rep < 3; rep++) launch(k, sms, threads, out, cyc);
        if (cudaDeviceSynchronize() != cudaSuccess) { printf("kernel failed\n"); return 1; }
        cudaMemcpy(host, cyc, (size_t)sms * 8, cudaMemcpyDeviceToHost);
        double mean = 0;
        for (int b = 0; b < sms; b++) mean += (double)host[b] / sms;
        double ops = (double)threads * ITERS * CHAINS;   // per kind
        printf("%-24s %10.0f cycles per SM: %.2f ops/clk/SM of each kind\n", names[k], mean, ops / mean);
    }
    return 0;
}
