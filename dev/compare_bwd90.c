// Bitwise comparison of the Hopper backward kernel (attention/backward_sm90.cuh) of this tree with a
// reference build of the same entry points from another commit, for BOTH score sources: sage
// (sage_backward_sm90_cuda) and bf16 flash (flash_backward_sm90_cuda). The reference commit's
// attention/sage_backward_sm90.cu and flash_backward_sm90.cu are compiled with their entry points
// (and the kernel) renamed ref_* by -D (dev/sage_bwd_step4_gpu.sh). For changes that must not
// change a bit (dev/notes_bwd_plan.md, steps 1-5): B·H = 2·4, D = 64 and 128, N = 77, 256, 1000,
// 1050 (the last 128-query step at D = 64 has one 64-query block), 4096, one forward per case
// (sage: FP8 P·V; flash: flash_forward_cuda), then both backwards on its out and lse:
//   deterministic dQ (*_set_deterministic(1)): dq, dk, dv must be bitwise equal;
//   unordered dQ (the default): dk, dv bitwise equal (one CTA writes each row), dq within
//   ‖dq - dq_ref‖/‖dq_ref‖ < 1e-5 (fp32 adds in a different order from run to run).
// K gets +4 on every 4th channel so that sage's k_mean (subtracted in the dQ product) is far from 0.
// The outputs are poisoned (NaN) before each call; a non-finite value is a failure too.
// Prints one line per case and mode; exits 1 on any failure, 2 without an sm_90 device.
//   LD_LIBRARY_PATH=... compare_bwd90 [sage|flash|both] [first|small]
// first: stop at the first failed check (planted bugs); small: N = 256 only (sanitizers).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attention/flash_cuda.h"
#include "attention/sage_cuda.h"
#include "layers/common.h"
#include "layers/layers_cuda.h"

int ref_sage_backward_sm90_cuda(float *dq, float *dk, float *dv, void *workspace, const void *fwd_workspace,
                                const uint16_t *dout, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                const uint16_t *out, const float *lse, const float *delta, int B, int H, int N,
                                int D, SagePV pv, cudaStream_t stream, char *err);
int ref_flash_backward_sm90_cuda(float *dq, float *dk, float *dv, void *workspace, const uint16_t *dout,
                                 const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                                 const float *lse, int B, int H, int N, int D, cudaStream_t stream, char *err);

#define CUDA_OR_DIE(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_)); exit(1); } } while (0)

typedef enum { SAGE, FLASH } Scores;

// Device bf16 (n values, D per row): N(0, 1), plus k_offset on channels d % 4 == 0.
static uint16_t *random_bf16_device(Rng *rng, size_t n, int D, float k_offset) {
    uint16_t *host = (uint16_t *)malloc(n * 2), *dev = NULL;
    for (size_t i = 0; i < n; i++) host[i] = bf16_bits_from_float(rng_normal(rng) + (i % D % 4 == 0 ? k_offset : 0.0f));
    CUDA_OR_DIE(cudaMalloc((void **)&dev, n * 2));
    CUDA_OR_DIE(cudaMemcpy(dev, host, n * 2, cudaMemcpyHostToDevice));
    free(host);
    return dev;
}

// One backward (this tree's or the reference's, of score source s) into host dq | dk | dv; the
// device outputs are poisoned first. t: q, k, v, dout. Returns the call's return code.
static int backward(Scores s, int ref, float *host, float *grads, void *bwd_ws, const void *fwd_ws,
                    uint16_t *const t[4], const uint16_t *out, const float *lse, int B, int H, int N, int D, char *err) {
    size_t n = (size_t)B * H * N * D;
    CUDA_OR_DIE(cudaMemset(grads, 0xff, 3 * n * sizeof(float)));
    int rc;
    if (s == SAGE)
        rc = (ref ? ref_sage_backward_sm90_cuda : sage_backward_sm90_cuda)(grads, grads + n, grads + 2 * n, bwd_ws, fwd_ws,
                                                                         t[3], t[0], t[1], t[2], out, lse, NULL, B, H,
                                                                         N, D, SAGE_PV_FP8, 0, err);
    else
        rc = (ref ? ref_flash_backward_sm90_cuda : flash_backward_sm90_cuda)(grads, grads + n, grads + 2 * n, bwd_ws,
                                                                           t[3], t[0], t[1], t[2], out, lse, B, H, N,
                                                                           D, 0, err);
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

static void set_deterministic(Scores s, int on) {
    if (s == SAGE) sage_backward_set_deterministic(on);
    else flash_backward_set_deterministic(on);
}

// One (score source, N, D) case in both dQ modes; returns the number of failed checks.
static int run_case(Scores s, int B, int H, int N, int D) {
    size_t n = (size_t)B * H * N * D, rows = (size_t)B * H * N;
    char err[DIT_ERR_LEN] = "";
    Rng rng;
    rng_seed(&rng, 4242 + 7 * N + D);
    uint16_t *t[4];   // q, k, v, dout
    for (int i = 0; i < 4; i++) t[i] = random_bf16_device(&rng, n, D, i == 1 ? 4.0f : 0.0f);
    uint16_t *out;
    float *lse, *grads;
    void *fwd_ws = NULL, *bwd_ws;
    CUDA_OR_DIE(cudaMalloc((void **)&out, n * 2));
    CUDA_OR_DIE(cudaMalloc((void **)&lse, rows * 4));
    CUDA_OR_DIE(cudaMalloc((void **)&grads, 3 * n * 4));
    int fwd;
    if (s == SAGE) {
        CUDA_OR_DIE(cudaMalloc(&fwd_ws, sage_cuda_forward_workspace_size(B, H, N, D, SAGE_PV_FP8)));
        CUDA_OR_DIE(cudaMalloc(&bwd_ws, sage_cuda_backward_workspace_size(B, H, N, D)));
        fwd = sage_forward_cuda(out, lse, fwd_ws, t[0], t[1], t[2], B, H, N, D, SAGE_PV_FP8, 0, err);
    } else {
        CUDA_OR_DIE(cudaMalloc(&bwd_ws, flash_cuda_backward_workspace_size(B, H, N, D)));
        fwd = flash_forward_cuda(out, lse, t[0], t[1], t[2], B, H, N, D, 0, err);
    }
    if (fwd != 0) {
        fprintf(stderr, "forward: %s\n", err);
        exit(1);
    }
    float *mine = (float *)malloc(3 * n * 4), *ref = (float *)malloc(3 * n * 4);
    int failures = 0;
    for (int det = 1; det >= 0; det--) {
        set_deterministic(s, det);
        if (backward(s, 0, mine, grads, bwd_ws, fwd_ws, t, out, lse, B, H, N, D, err) != 0 ||
            backward(s, 1, ref, grads, bwd_ws, fwd_ws, t, out, lse, B, H, N, D, err) != 0) {
            fprintf(stderr, "backward: %s\n", err);
            exit(1);
        }
        int ok = 1;
        printf("%-5s B=%d H=%d N=%4d D=%3d %-13s differing elements / rel L2 / non-finite:", s == SAGE ? "sage" : "flash",
               B, H, N, D, det ? "deterministic" : "unordered");
        for (int g = 0; g < 3; g++) {
            double rel;
            size_t bad, diff = differing(mine + g * n, ref + g * n, n, &rel, &bad);
            printf("  d%c %zu / %.1e / %zu", "qkv"[g], diff, rel, bad);
            ok &= bad == 0 && (det || g > 0 ? diff == 0 : rel < 1e-5);
        }
        printf("  %s\n", ok ? "ok" : "FAIL");
        fflush(stdout);
        failures += !ok;
    }
    set_deterministic(s, 0);
    free(mine); free(ref);
    for (int i = 0; i < 4; i++) cudaFree(t[i]);
    cudaFree(out); cudaFree(lse); cudaFree(grads); cudaFree(fwd_ws); cudaFree(bwd_ws);
    return failures;
}

int main(int argc, char **argv) {
    const char *which = argc > 1 ? argv[1] : "both", *mode = argc > 2 ? argv[2] : "";
    int sage = !strcmp(which, "sage") || !strcmp(which, "both"), flash = !strcmp(which, "flash") || !strcmp(which, "both");
    int first = !strcmp(mode, "first"), small = !strcmp(mode, "small");
    if ((!sage && !flash) || (*mode && !first && !small)) {
        fprintf(stderr, "usage: compare_bwd90 [sage|flash|both] [first|small]\n");
        return 2;
    }
    if (!sage_backward_sm90_available() || !flash_backward_sm90_available()) {
        printf("no compute capability 9.0 device (or no sm_90a code): nothing compared\n");
        return 2;
    }
    const int Ns[5] = {77, 256, 1000, 1050, 4096}, Ds[2] = {64, 128};
    int failures = 0, checks = 0;
    for (int s = SAGE; s <= FLASH; s++) {
        if ((s == SAGE && !sage) || (s == FLASH && !flash)) continue;
        for (int di = 0; di < 2; di++)
            for (int ni = 0; ni < 5; ni++) {
                if (small && Ns[ni] != 256) continue;
                if (first && failures) continue;
                failures += run_case((Scores)s, 2, 4, Ns[ni], Ds[di]);
                checks += 2;
            }
    }
    printf("%s: %d failed checks of %d\n", failures ? "FAIL" : "PASS", failures, checks);
    return failures ? 1 : 0;
}
