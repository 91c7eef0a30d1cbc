// Helpers shared by the CUDA microbenchmarks (dev/bench_layers_cuda.c, dev/bench_linear_fp8.c,
// dev/bench_gemm_algos.c, dev/bench_a2a_ce.c, dev/bench_bwd_fill.c):
// exit with a message on a failed CUDA or library call (OK reads the including file's `err`),
// and the median time of a call on the default stream.
#pragma once
#include <stdio.h>
#include <stdlib.h>
#include <cuda_runtime_api.h>

#define BENCH_WARMUP 5
#define BENCH_REPEATS 50

#define CK(call) do {                                                                          \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)
#define OK(call) do {                                                                          \
        if ((call) != 0) {                                                                     \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, err);         \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

static int bench_cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

// Median ms of BENCH_REPEATS calls of call(arg), each timed by CUDA events on the default stream,
// after BENCH_WARMUP untimed calls.
static double bench_median_ms(void (*call)(void *), void *arg) {
    cudaEvent_t start, stop;
    CK(cudaEventCreate(&start));
    CK(cudaEventCreate(&stop));
    float ms[BENCH_REPEATS];
    for (int i = 0; i < BENCH_WARMUP; i++) call(arg);
    for (int i = 0; i < BENCH_REPEATS; i++) {
        CK(cudaEventRecord(start, 0));
        call(arg);
        CK(cudaEventRecord(stop, 0));
        CK(cudaEventSynchronize(stop));
        CK(cudaEventElapsedTime(&ms[i], start, stop));
    }
    CK(cudaEventDestroy(start));
    CK(cudaEventDestroy(stop));
    qsort(ms, BENCH_REPEATS, sizeof *ms, bench_cmp_float);
    return ms[BENCH_REPEATS / 2];
}
