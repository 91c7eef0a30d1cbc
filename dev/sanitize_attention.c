// Every attention kernel once, on small shapes with tails, for compute-sanitizer (dev/sanitize.sh
// kernels): the Hadamard rotation, sage quantization + forward (Hopper wgmma and mma.sync, FP8
// and FP16) + backward (Hopper and mma.sync, unordered and deterministic dQ, fp32 dK/dV and bf16
// rows with the Hadamard and amax), and the bf16 flash forward and backward (Hopper and mma.sync).
// The Criterion suites check the values; this program only drives each kernel so that memcheck,
// racecheck and synccheck see it at a size they finish in seconds (the suites' N = 2048..32K cases
// take hours under racecheck). Exits 1 on any error.
//   build/sanitize_attention                       (prints one line per kernel call)
//   compute-sanitizer --tool racecheck build/sanitize_attention
#include <stdio.h>
#include <stdlib.h>
#include "attention/flash_cuda.h"
#include "attention/hadamard_cuda.h"
#include "attention/sage_cuda.h"
#include "layers/common.h"
#include "layers/layers_cuda.h"

#define CUDA_OR_DIE(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_)); exit(1); } } while (0)

static int failures = 0;

static void report(int rc, const char *what, int N, int D, const char *err) {
    cudaError_t e = cudaDeviceSynchronize();
    if (rc != 0 || e != cudaSuccess) {
        failures++;
        printf("FAIL %-36s N=%4d D=%3d: %s%s\n", what, N, D, rc ? err : "", e ? cudaGetErrorString(e) : "");
    } else {
        printf("ok   %-36s N=%4d D=%3d\n", what, N, D);
    }
}

// Device bf16 (n values) from a uniform [-1, 1) host sequence.
static uint16_t *random_bf16_device(size_t n, unsigned *state) {
    uint16_t *host = (uint16_t *)malloc(n * 2), *dev = NULL;
    for (size_t i = 0; i < n; i++) {
        *state = *state * 1664525u + 1013904223u;
        host[i] = bf16_bits_from_float((float)(*state >> 8) / (1 << 23) - 1.0f);
    }
    CUDA_OR_DIE(cudaMalloc((void **)&dev, n * 2));
    CUDA_OR_DIE(cudaMemcpy(dev, host, n * 2, cudaMemcpyHostToDevice));
    free(host);
    return dev;
}

// One (N, D) shape with B = 1, H = 2 through every kernel; env switches select the mma.sync paths.
static void run_shape(int N, int D) {
    const int B = 1, H = 2;
    size_t n = (size_t)B * H * N * D, rows = (size_t)B * H * N;
    unsigned state = 12345u + N + D;
    uint16_t *q = random_bf16_device(n, &state), *k = random_bf16_device(n, &state);
    uint16_t *v = random_bf16_device(n, &state), *dout = random_bf16_device(n, &state), *out;
    float *lse, *grads, *rot, *amax;
    uint16_t *kv_rows;   // dK, dV as bf16 rows of a qkv gradient (row stride 3·H·D)
    const size_t stride = 3 * (size_t)H * D;
    void *fwd_ws, *bwd_ws;
    size_t fwd_bytes = sage_cuda_forward_workspace_size(B, H, N, D, SAGE_PV_FP16);
    size_t fp8_bytes = sage_cuda_forward_workspace_size(B, H, N, D, SAGE_PV_FP8);
    size_t bwd_bytes = sage_cuda_backward_workspace_size(B, H, N, D);
    size_t flash_bytes = flash_cuda_backward_workspace_size(B, H, N, D);
    CUDA_OR_DIE(cudaMalloc((void **)&out, n * 2));
    CUDA_OR_DIE(cudaMalloc((void **)&lse, rows * 4));
    CUDA_OR_DIE(cudaMalloc((void **)&grads, 3 * n * 4));
    CUDA_OR_DIE(cudaMalloc((void **)&rot, n * 4));
    CUDA_OR_DIE(cudaMemset(rot, 0, n * 4));
    CUDA_OR_DIE(cudaMalloc((void **)&kv_rows, (size_t)B * N * stride * 2));
    CUDA_OR_DIE(cudaMalloc((void **)&amax, 4));
    CUDA_OR_DIE(cudaMemset(amax, 0, 4));
    CUDA_OR_DIE(cudaMalloc(&fwd_ws, fwd_bytes > fp8_bytes ? fwd_bytes : fp8_bytes));
    CUDA_OR_DIE(cudaMalloc(&bwd_ws, bwd_bytes > flash_bytes ? bwd_bytes : flash_bytes));
    float *dq = grads, *dk = grads + n, *dv = grads + 2 * n;
    char err[DIT_ERR_LEN] = "";

    report(hadamard_rotate_bf16_cuda(q, rows, D, 0, err), "hadamard_rotate_bf16_cuda", N, D, err);
    report(hadamard_rotate_f32_cuda(rot, rows, D, 0, err), "hadamard_rotate_f32_cuda", N, D, err);

    const SagePV pvs[2] = {SAGE_PV_FP8, SAGE_PV_FP16};
    for (int p = 0; p < 2; p++) {
        for (int mma_sync = 0; mma_sync < 2; mma_sync++) {   // Hopper, then mma.sync
            if (mma_sync) setenv("DIT_SAGE_MMA_SYNC", "1", 1); else unsetenv("DIT_SAGE_MMA_SYNC");
            const char *path = mma_sync ? "mma.sync" : "sm90";
            char what[64];
            snprintf(what, sizeof what, "sage_forward_cuda %s %s", pvs[p] == SAGE_PV_FP8 ? "fp8" : "fp16", path);
            report(sage_forward_cuda(out, lse, fwd_ws, q, k, v, B, H, N, D, pvs[p], 0, err), what, N, D, err);
            for (int det = 0; det < 2; det++) {
                sage_backward_set_deterministic(det);
                snprintf(what, sizeof what, "sage_backward_cuda %s%s", path, det ? " deterministic" : "");
                report(sage_backward_cuda(dq, dk, dv, bwd_ws, fwd_ws, dout, q, k, v, out, lse, NULL, B, H, N, D,
                                          pvs[p], 0, err), what, N, D, err);
            }
            sage_backward_set_deterministic(0);
            snprintf(what, sizeof what, "sage_backward_merged_cuda %s", path);   // (dout, out as merged: any values)
            report(sage_backward_merged_cuda(dq, kv_rows + H * D, kv_rows + 2 * H * D, stride, 1, amax, bwd_ws, fwd_ws,
                                             dout, q, k, v, out, lse, NULL, B, H, N, D, pvs[p], 0, err),
                   what, N, D, err);
        }
    }
    unsetenv("DIT_SAGE_MMA_SYNC");

    for (int mma_sync = 0; mma_sync < 2; mma_sync++) {
        if (mma_sync) setenv("DIT_FLASH_MMA_SYNC", "1", 1); else unsetenv("DIT_FLASH_MMA_SYNC");
        const char *path = mma_sync ? "mma.sync" : "sm90";
        char what[64];
        snprintf(what, sizeof what, "flash_forward_cuda %s", path);
        report(flash_forward_cuda(out, lse, q, k, v, B, H, N, D, 0, err), what, N, D, err);
        for (int det = 0; det < 2; det++) {
            flash_backward_set_deterministic(det);
            snprintf(what, sizeof what, "flash_backward_cuda %s%s", path, det ? " deterministic" : "");
            report(flash_backward_cuda(dq, dk, dv, bwd_ws, dout, q, k, v, out, lse, B, H, N, D, 0, err), what, N, D,
                   err);
        }
        flash_backward_set_deterministic(0);
        snprintf(what, sizeof what, "flash_backward_merged_cuda %s", path);
        report(flash_backward_merged_cuda(dq, kv_rows + H * D, kv_rows + 2 * H * D, stride, 1, amax, bwd_ws, dout, q,
                                          k, v, out, lse, B, H, N, D, 0, err),
               what, N, D, err);
    }
    unsetenv("DIT_FLASH_MMA_SYNC");

    uint16_t *bf[5] = {q, k, v, dout, out};
    for (int i = 0; i < 5; i++) CUDA_OR_DIE(cudaFree(bf[i]));
    CUDA_OR_DIE(cudaFree(lse));
    CUDA_OR_DIE(cudaFree(grads));
    CUDA_OR_DIE(cudaFree(rot));
    CUDA_OR_DIE(cudaFree(kv_rows));
    CUDA_OR_DIE(cudaFree(amax));
    CUDA_OR_DIE(cudaFree(fwd_ws));
    CUDA_OR_DIE(cudaFree(bwd_ws));
}

int main(void) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        printf("sanitize_attention: no GPU\n");
        return 1;
    }
    // Two 128-key blocks and a tail (the sm90 kernels' tiles), and a single partial block.
    const int shapes[3][2] = {{300, 128}, {300, 64}, {77, 64}};
    for (int s = 0; s < 3; s++) run_shape(shapes[s][0], shapes[s][1]);
    printf("%s: %d failing calls\n", failures ? "FAILED" : "all kernels ran", failures);
    return failures ? 1 : 0;
}
