// Dev tool (GPU; built by dev/sage_quant_gpu.sh, not by the Makefile): the quantization pass of
// attention/sage_quant.cu against the three-launch pass it replaced (main's sage_quant.cu with its
// entry points renamed old_*, linked into the same binary).
//   compare_sage_quant check   every output byte of sage_quantize_cuda (q8, k8, q_scale, k_scale,
//                              k_mean, v_scale, v_t), sage_kv_stats_cuda and sage_quantize_given_cuda
//                              equal to the old pass's, on random bf16 inputs with per-channel
//                              offsets and outliers, several shapes; exit 1 on any difference.
// (Timings: dev/bench_sage_quant.py, with cuDNN in the same process.)
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attention/sage_cuda.h"
#include "layers/common.h"

size_t old_sage_cuda_forward_workspace_size(int B, int H, int N, int D, SagePV pv);
SageCudaQuant old_sage_cuda_quant_view(void *workspace, int B, int H, int N, int D, SagePV pv);
int old_sage_quantize_cuda(void *workspace, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           int B, int H, int N, int D, SagePV pv, cudaStream_t stream, char *err);
int old_sage_kv_stats_cuda(float *k_sum, float *v_scale, void *workspace, const uint16_t *k, const uint16_t *v,
                           int B, int H, int N, int D, SagePV pv, cudaStream_t stream, char *err);
int old_sage_quantize_given_cuda(void *workspace, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                 const float *k_mean, const float *v_scale, int B, int H, int N, int D,
                                 SagePV pv, cudaStream_t stream, char *err);

#define CK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); exit(2); } } while (0)
#define OK(call) do { if ((call) != 0) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, err); \
    exit(2); } } while (0)

static char err[DIT_ERR_LEN];
static uint64_t rng_state = 88172645463325252ull;
static uint64_t next_u64(void) { rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17; return rng_state; }
static float uniform(void) { return (float)((next_u64() >> 11) * (1.0 / 9007199254740992.0)); }
static float normal(void) { return sqrtf(-2.0f * logf(uniform() + 1e-12f)) * cosf(6.2831853f * uniform()); }
static uint16_t bf16(float x) { uint32_t u; memcpy(&u, &x, 4); return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }

// (B,H,N,D) bf16 on the device: N(0,1) · (1 + 7·[channel is an outlier channel]) + offset of the
// channel (K: up to ±30 on every 3rd channel), 1 in 5000 values ×50; the last head of V all zero
// in channel 1 (v_scale 0).
static uint16_t *random_tensor(int B, int H, int N, int D, int which) {
    size_t n = (size_t)B * H * N * D;
    uint16_t *h = malloc(n * 2), *d;
    float off[128];
    for (int c = 0; c < D; c++) off[c] = which == 1 && c % 3 == 0 ? 60.0f * (uniform() - 0.5f) : 0.0f;
    for (size_t i = 0; i < n; i++) {
        int c = (int)(i % D);
        size_t head = i / ((size_t)N * D);
        float x = normal() * (c == 5 || c == 40 ? 8.0f : 1.0f) + off[c];
        if (next_u64() % 5000 == 0) x *= 50.0f;
        if (which == 2 && head == (size_t)B * H - 1 && c == 1) x = 0.0f;
        h[i] = bf16(x);
    }
    CK(cudaMalloc((void **)&d, n * 2));
    CK(cudaMemcpy(d, h, n * 2, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

// Bytes that differ between n bytes at device pointers a and b.
static size_t diff_bytes(const void *a, const void *b, size_t n) {
    unsigned char *ha = malloc(n), *hb = malloc(n);
    CK(cudaMemcpy(ha, a, n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb, b, n, cudaMemcpyDeviceToHost));
    size_t d = 0;
    for (size_t i = 0; i < n; i++) d += ha[i] != hb[i];
    free(ha); free(hb);
    return d;
}

// Differing bytes of the seven quantized tensors of two workspaces (new layout vs old layout).
static size_t diff_views(const char *what, void *ws_new, void *ws_old, int B, int H, int N, int D, SagePV pv) {
    SageCudaQuant a = sage_cuda_quant_view(ws_new, B, H, N, D, pv), b = old_sage_cuda_quant_view(ws_old, B, H, N, D, pv);
    size_t BH = (size_t)B * H, nblk = (N + 63) / 64, n = BH * N * D;
    size_t vt = BH * D * nblk * 64 * (pv == SAGE_PV_FP8 ? 1 : 2);
    const char *names[7] = {"q8", "k8", "q_scale", "k_scale", "k_mean", "v_scale", "v_t"};
    const void *pa[7] = {a.q8, a.k8, a.q_scale, a.k_scale, a.k_mean, a.v_scale, a.v_t};
    const void *pb[7] = {b.q8, b.k8, b.q_scale, b.k_scale, b.k_mean, b.v_scale, b.v_t};
    size_t bytes[7] = {n, n, BH * nblk * 4, BH * nblk * 4, BH * D * 4, BH * D * 4, vt}, total = 0;
    printf("  %-9s", what);
    for (int i = 0; i < 7; i++) {
        size_t d = diff_bytes(pa[i], pb[i], bytes[i]);
        printf(" %s %zu/%zu", names[i], d, bytes[i]);
        total += d;
    }
    printf("\n");
    return total;
}

static size_t check_case(int B, int H, int N, int D, SagePV pv) {
    size_t n = (size_t)B * H * N * D, BH = (size_t)B * H, total = 0;
    uint16_t *q = random_tensor(B, H, N, D, 0), *k = random_tensor(B, H, N, D, 1), *v = random_tensor(B, H, N, D, 2);
    size_t ws_bytes = sage_cuda_forward_workspace_size(B, H, N, D, pv);
    size_t old_bytes = old_sage_cuda_forward_workspace_size(B, H, N, D, pv);
    void *ws_new, *ws_old;
    float *stats;   // k_sum new | v_scale new | k_sum old | v_scale old | given k_mean | given v_scale
    CK(cudaMalloc(&ws_new, ws_bytes));
    CK(cudaMalloc(&ws_old, old_bytes));
    CK(cudaMalloc((void **)&stats, 6 * BH * D * 4));
    CK(cudaMemset(ws_new, 0x5a, ws_bytes));   // garbage counters and outputs: the pass must not depend on them
    CK(cudaMemset(ws_old, 0xa5, old_bytes));
    printf("B=%d H=%d N=%d D=%d %s (new workspace %zu bytes, old %zu)\n", B, H, N, D,
           pv == SAGE_PV_FP8 ? "FP8" : "FP16", ws_bytes, old_bytes);
    OK(sage_quantize_cuda(ws_new, q, k, v, B, H, N, D, pv, 0, err));
    OK(old_sage_quantize_cuda(ws_old, q, k, v, B, H, N, D, pv, 0, err));
    CK(cudaDeviceSynchronize());
    total += diff_views("quantize", ws_new, ws_old, B, H, N, D, pv);
    OK(sage_kv_stats_cuda(stats, stats + BH * D, ws_new, k, v, B, H, N, D, pv, 0, err));
    OK(old_sage_kv_stats_cuda(stats + 2 * BH * D, stats + 3 * BH * D, ws_old, k, v, B, H, N, D, pv, 0, err));
    CK(cudaDeviceSynchronize());
    size_t ds = diff_bytes(stats, stats + 2 * BH * D, 2 * BH * D * 4);
    printf("  kv_stats  k_sum|v_scale %zu/%zu\n", ds, 2 * BH * D * 4);
    total += ds;
    // given statistics: the shard's sum / (N + 3) and v_scale · 1.5 (not the pass's own values)
    float *h = malloc(2 * BH * D * 4);
    CK(cudaMemcpy(h, stats, 2 * BH * D * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < BH * D; i++) { h[i] /= (float)(N + 3); h[BH * D + i] *= 1.5f; }
    CK(cudaMemcpy(stats + 4 * BH * D, h, 2 * BH * D * 4, cudaMemcpyHostToDevice));
    free(h);
    OK(sage_quantize_given_cuda(ws_new, q, k, v, stats + 4 * BH * D, stats + 5 * BH * D, B, H, N, D, pv, 0, err));
    OK(old_sage_quantize_given_cuda(ws_old, q, k, v, stats + 4 * BH * D, stats + 5 * BH * D, B, H, N, D, pv, 0, err));
    CK(cudaDeviceSynchronize());
    total += diff_views("given", ws_new, ws_old, B, H, N, D, pv);
    cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(ws_new); cudaFree(ws_old); cudaFree(stats);
    (void)n;
    return total;
}

static int check(void) {
    static const int shapes[][4] = {{1, 1, 1, 64}, {1, 1, 1, 128}, {1, 2, 77, 128}, {2, 2, 77, 64},
                                    {2, 3, 200, 64}, {1, 2, 1000, 128}, {3, 5, 333, 128}, {3, 5, 333, 64},
                                    {2, 2, 4097, 128}, {2, 2, 4097, 64}, {1, 4, 4096, 64}, {1, 3, 16385, 64},
                                    {1, 2, 16385, 128}, {1, 2, 33000, 128}, {1, 1, 33000, 64},
                                    {4, 16, 1024, 128}, {8, 8, 1024, 64}};
    size_t total = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int pv = 0; pv < 2; pv++)
            total += check_case(shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], (SagePV)pv);
    printf("%s: %zu differing bytes in all\n", total ? "FAIL" : "PASS", total);
    return total ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc != 2 || strcmp(argv[1], "check")) {
        fprintf(stderr, "usage: %s check\n", argv[0]);
        return 2;
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("no CUDA device: skipped\n");
        return 0;
    }
    return check();
}
