// Would the block's weight-gradient GEMMs fill the attention backward's last wave? At config c
// (B = 1, 16 heads of 128, 16K tokens) the sm90 backward runs 2048 CTAs of one per SM on 132 SMs:
// 15.5 waves, the last one half empty (~3% of the kernel). The weight gradients of proj, fc1 and fc2
// do not feed the attention backward, so they could run beside it on a low-priority stream. This
// times, per block (median of RUNS after warm-up, CUDA events):
//   attention   sage_backward_merged_cuda alone
//   dW          the three weight-gradient GEMMs alone (bf16, cuBLAS, fp32 accumulation: the shapes
//               of proj, fc1, fc2 at 16K tokens; FP8 ones take ~0.8 ms, bf16 ~1.6)
//   serial      one after the other on one stream (today's order)
//   side        the attention on a high-priority stream and the GEMMs on a low-priority one,
//               enqueued GEMMs first or attention first, until both are done
//
//   make build/libditc.a
//   cc -O2 -std=c11 -D_GNU_SOURCE -I. -fopenmp -I/usr/local/cuda/include -o build/bench_bwd_fill
//      dev/bench_bwd_fill.c build/libditc.a -L/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart
//      -lstdc++ -lnccl -lm          (one command)
//   build/bench_bwd_fill                                  (one GPU of compute capability 9.0)
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attention/sage_cuda.h"
#include "dev/bench_cuda.h"

#define RUNS 11
#define WARMUP 2
enum { B = 1, H = 16, N = 16384, D = 128, HID = H * D };

static char err[512];

// bf16 values ~ N(0, scale²) from a fixed LCG (the backward's speed does not depend on them)
static void *random_bf16(size_t n, float scale, uint32_t seed) {
    uint16_t *h = (uint16_t *)malloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        float s = 0;
        for (int j = 0; j < 4; j++) {
            seed = seed * 1664525u + 1013904223u;
            s += (float)(seed >> 8) / 16777216.0f - 0.5f;
        }
        float x = s * 1.7320508f * scale;
        uint32_t u;
        memcpy(&u, &x, 4);
        h[i] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
    void *d;
    CK(cudaMalloc(&d, n * 2));
    CK(cudaMemcpy(d, h, n * 2, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

typedef struct {
    cublasHandle_t blas;
    void *x[3], *dy[3];
    float *dw[3];
    int ic[3], oc[3];
} Gemms;

// dWᵀ (IC, OC) += Xᵀ·dY over the N tokens, as the bf16 linear's backward
static void run_gemms(Gemms *g, cudaStream_t s) {
    const float one = 1.0f;
    cublasSetStream(g->blas, s);
    for (int i = 0; i < 3; i++)
        if (cublasGemmEx(g->blas, CUBLAS_OP_N, CUBLAS_OP_T, g->ic[i], g->oc[i], N, &one, g->x[i], CUDA_R_16BF,
                         g->ic[i], g->dy[i], CUDA_R_16BF, g->oc[i], &one, g->dw[i], CUDA_R_32F, g->ic[i],
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "cublasGemmEx failed\n");
            exit(1);
        }
}

int main(void) {
    size_t n = (size_t)B * H * N * D;
    void *q = random_bf16(n, 1.0f, 1), *k = random_bf16(n, 1.0f, 2), *v = random_bf16(n, 1.0f, 3);
    void *dout = random_bf16(n, 1.0f, 4), *out, *fws, *bws;
    float *lse, *dq;
    uint16_t *dkv;   // bf16 rows (B·N, 2·H·D) [dk | dv], as the model's merged backward writes them
    CK(cudaMalloc(&out, n * 2));
    CK(cudaMalloc((void **)&lse, (size_t)B * H * N * 4));
    CK(cudaMalloc((void **)&dq, n * 4));
    CK(cudaMalloc((void **)&dkv, 2 * n * 2));
    CK(cudaMalloc(&fws, sage_cuda_forward_workspace_size(B, H, N, D, SAGE_PV_FP8)));
    CK(cudaMalloc(&bws, sage_cuda_backward_workspace_size(B, H, N, D)));
    OK(sage_forward_merged_cuda((uint16_t *)out, lse, fws, (uint16_t *)q, (uint16_t *)k, (uint16_t *)v, B, H, N, D,
                                SAGE_PV_FP8, 0, err));
    Gemms g = {.ic = {HID, HID, 4 * HID}, .oc = {HID, 4 * HID, HID}};   // proj, fc1, fc2
    if (cublasCreate(&g.blas) != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "cublasCreate failed\n"); return 1; }
    for (int i = 0; i < 3; i++) {
        g.x[i] = random_bf16((size_t)N * g.ic[i], 1.0f, 10 + i);
        g.dy[i] = random_bf16((size_t)N * g.oc[i], 0.01f, 20 + i);
        CK(cudaMalloc((void **)&g.dw[i], (size_t)g.ic[i] * g.oc[i] * 4));
        CK(cudaMemset(g.dw[i], 0, (size_t)g.ic[i] * g.oc[i] * 4));
    }
    int lo, hi;
    CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    cudaStream_t main_s, high, low;
    CK(cudaStreamCreateWithPriority(&main_s, cudaStreamNonBlocking, lo));
    CK(cudaStreamCreateWithPriority(&high, cudaStreamNonBlocking, hi));
    CK(cudaStreamCreateWithPriority(&low, cudaStreamNonBlocking, lo));
    cudaEvent_t start, a_end, g_end;
    CK(cudaEventCreate(&start));
    CK(cudaEventCreate(&a_end));
    CK(cudaEventCreate(&g_end));
    const char *names[5] = {"attention alone", "dW GEMMs alone", "serial (one stream)",
                            "side, GEMMs enqueued first", "side, attention enqueued first"};
    float med[5];
    for (int mode = 0; mode < 5; mode++) {
        float t[RUNS];
        for (int it = -WARMUP; it < RUNS; it++) {
            CK(cudaDeviceSynchronize());
            cudaStream_t sa = mode >= 3 ? high : main_s, sg = mode >= 3 ? low : main_s;
            CK(cudaEventRecord(start, main_s));
            CK(cudaStreamWaitEvent(sa, start, 0));
            CK(cudaStreamWaitEvent(sg, start, 0));
            if (mode == 1 || mode == 3) run_gemms(&g, sg);
            if (mode != 1)
                OK(sage_backward_merged_cuda(dq, dkv, dkv + (size_t)H * D, 2 * (size_t)H * D, 1, NULL, bws, fws,
                                             (uint16_t *)dout, (uint16_t *)q, (uint16_t *)k, (uint16_t *)v,
                                             (uint16_t *)out, lse, NULL, B, H, N, D, SAGE_PV_FP8, sa, err));
            if (mode == 2 || mode == 4) run_gemms(&g, sg);
            CK(cudaEventRecord(a_end, sa));
            CK(cudaEventRecord(g_end, sg));
            CK(cudaDeviceSynchronize());
            float ta, tg;
            CK(cudaEventElapsedTime(&ta, start, a_end));
            CK(cudaEventElapsedTime(&tg, start, g_end));
            if (it >= 0) t[it] = ta > tg ? ta : tg;
        }
        qsort(t, RUNS, sizeof(float), bench_cmp_float);
        med[mode] = t[RUNS / 2];
    }
    struct cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("%s; sage backward (merged) B=%d H=%d N=%d D=%d and the bf16 dW GEMMs of proj, fc1, fc2 at %d tokens; "
           "median of %d (ms)\n", p.name, B, H, N, D, N, RUNS);
    for (int mode = 0; mode < 5; mode++) printf("  %-32s %.3f\n", names[mode], med[mode]);
    printf("  side against serial: %+.3f / %+.3f ms (gain if negative)\n", med[3] - med[2], med[4] - med[2]);
    return 0;
}
