// Bitwise comparison of the sage Hopper backward (sage_backward_sm90_cuda, this tree) with a
// reference build of the same function from another commit, linked in under the name
// ref_sage_backward_sm90_cuda (dev/sage_bwd_step0_gpu.sh compiles the reference commit's
// attention/sage_backward_sm90.cu with its entry points renamed by -D). For changes that must not
// change a bit (dev/notes_bwd_plan.md, step 0): B·H = 2·4, D = 64 and 128, N = 77, 256, 1000,
// 4096, one sage forward (FP8 P·V) per case, then both backwards on its out, lse and workspace:
//   deterministic dQ (sage_backward_set_deterministic(1)): dq, dk, dv must be bitwise equal;
//   unordered dQ (the default): dk, dv bitwise equal (one CTA writes each row), dq within
//   ‖dq - dq_ref‖/‖dq_ref‖ < 1e-5 (fp32 atomics in a different order from run to run).
// K gets +4 on every 4th channel so that k_mean (subtracted in the dQ product) is far from 0.
// The outputs are poisoned (NaN) before each call; a non-finite value is a failure too.
// Prints one line per case and mode; exits 1 on any failure, 2 without an sm_90 device.
//   LD_LIBRARY_PATH=... .devrun_step0/compare_sage_bwd
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attention/sage_cuda.h"
#include "layers/common.h"
#include "layers/layers_cuda.h"

int ref_sage_backward_sm90_cuda(float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                                const uint16_t *dout, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                const uint16_t *out, const float *lse, const float *delta, int B, int H, int N,
                                int D, SagePV pv, cudaStream_t stream, char *err);

#define CUDA_OR_DIE(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_)); exit(1); } } while (0)

// Device bf16 (n values, D per row): N(0, 1), plus k_offset on channels d % 4 == 0.
static uint16_t *random_bf16_device(Rng *rng, size_t n, int D, float k_offset) {
    uint16_t *host = (uint16_t *)malloc(n * 2), *dev = NULL;
    for (size_t i = 0; i < n; i++) host[i] = bf16_bits_from_float(rng_normal(rng) + (i % D % 4 == 0 ? k_offset : 0.0f));
    CUDA_OR_DIE(cudaMalloc((void **)&dev, n * 2));
    CUDA_OR_DIE(cudaMemcpy(dev, host, n * 2, cudaMemcpyHostToDevice));
    free(host);
    return dev;
}

// One backward (this tree's or the reference's) into host dq | dk | dv; the device outputs are
// poisoned first. Returns the call's return code.
static int backward(int ref, float *host, float *grads, void *bwd_ws, const void *fwd_ws, uint16_t *const t[4],
                    const uint16_t *out, const float *lse, int B, int H, int N, int D, char *err) {
    size_t n = (size_t)B * H * N * D;
    CUDA_OR_DIE(cudaMemset(grads, 0xff, 3 * n * sizeof(float)));
    int (*fn)(float *, float *, float *, void *, const void *, const uint16_t *, const uint16_t *,
              const uint16_t *, const uint16_t *, const uint16_t *, const float *, const float *, int, int, int,
              int, SagePV, cudaStream_t, char *) = ref ? ref_sage_backward_sm90_cuda : sage_backward_sm90_cuda;
    int rc = fn(grads, grads + n, grads + 2 * n, bwd_ws, fwd_ws, t[3], t[0], t[1], t[2], out, lse, NULL, B, H, N, D,
                SAGE_PV_FP8, 0, err);
    CUDA_OR_DIE(cudaDeviceSynchronize());
    CUDA_OR_DIE(cudaMemcpy(host, grads, 3 * n * sizeof(float), cudaMemcpyDeviceToHost));
    return rc;
}

// Elements of x and y (n each) whose bits differ; rel = ‖x - y‖/‖y‖; nonfinite: of x or y.
static size_t differing(const float *x, const float *y, size_t n, double *rel, size_t *nonfinite) {
    size_t diff = 0;
    double num = 0, den = 0;
    *nonfinite = 0;
    for (size_t i = 0; i < n; i++) {
        diff += memcmp(&x[i], &y[i], 4) != 0;
        *nonfinite += !isfinite(x[i]) || !isfinite(y[i]);
        num += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        den += (double)y[i] * y[i];
    }
    *rel = den > 0 ? sqrt(num / den) : sqrt(num);
    return diff;
}

// One (N, D) case in both dQ modes; returns the number of failed checks.
static int run_case(int B, int H, int N, int D) {
    size_t n = (size_t)B * H * N * D, rows = (size_t)B * H * N;
    char err[DIT_ERR_LEN] = "";
    Rng rng;
    rng_seed(&rng, 4242 + 7 * N + D);
    uint16_t *t[4];   // q, k, v, dout
    for (int i = 0; i < 4; i++) t[i] = random_bf16_device(&rng, n, D, i == 1 ? 4.0f : 0.0f);
    uint16_t *out;
    float *lse, *grads;
    void *fwd_ws, *bwd_ws;
    CUDA_OR_DIE(cudaMalloc((void **)&out, n * 2));
    CUDA_OR_DIE(cudaMalloc((void **)&lse, rows * 4));
    CUDA_OR_DIE(cudaMalloc((void **)&grads, 3 * n * 4));
    CUDA_OR_DIE(cudaMalloc(&fwd_ws, sage_cuda_forward_workspace_size(B, H, N, D, SAGE_PV_FP8)));
    CUDA_OR_DIE(cudaMalloc(&bwd_ws, sage_cuda_backward_workspace_size(B, H, N, D)));
    if (sage_forward_cuda(out, lse, fwd_ws, t[0], t[1], t[2], B, H, N, D, SAGE_PV_FP8, 0, err) != 0) {
        fprintf(stderr, "sage_forward_cuda: %s\n", err);
        exit(1);
    }
    float *mine = (float *)malloc(3 * n * 4), *ref = (float *)malloc(3 * n * 4);
    int failures = 0;
    for (int det = 1; det >= 0; det--) {
        sage_backward_set_deterministic(det);
        if (backward(0, mine, grads, bwd_ws, fwd_ws, t, out, lse, B, H, N, D, err) != 0 ||
            backward(1, ref, grads, bwd_ws, fwd_ws, t, out, lse, B, H, N, D, err) != 0) {
            fprintf(stderr, "backward: %s\n", err);
            exit(1);
        }
        int ok = 1;
        printf("B=%d H=%d N=%4d D=%3d %-13s differing elements / rel L2 / non-finite:", B, H, N, D,
               det ? "deterministic" : "unordered");
        for (int g = 0; g < 3; g++) {
            double rel;
            size_t bad, diff = differing(mine + g * n, ref + g * n, n, &rel, &bad);
            printf("  d%c %zu / %.1e / %zu", "qkv"[g], diff, rel, bad);
            ok &= bad == 0 && (det || g > 0 ? diff == 0 : rel < 1e-5);
        }
        printf("  %s\n", ok ? "ok" : "FAIL");
        failures += !ok;
    }
    sage_backward_set_deterministic(0);
    free(mine); free(ref);
    for (int i = 0; i < 4; i++) cudaFree(t[i]);
    cudaFree(out); cudaFree(lse); cudaFree(grads); cudaFree(fwd_ws); cudaFree(bwd_ws);
    return failures;
}

int main(void) {
    if (!sage_backward_sm90_available()) {
        printf("no compute capability 9.0 device (or no sm_90a code): nothing compared\n");
        return 2;
    }
    const int Ns[4] = {77, 256, 1000, 4096}, Ds[2] = {64, 128};
    int failures = 0;
    for (int di = 0; di < 2; di++)
        for (int ni = 0; ni < 4; ni++) failures += run_case(2, 4, Ns[ni], Ds[di]);
    printf("%s: %d failed checks of 16\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
