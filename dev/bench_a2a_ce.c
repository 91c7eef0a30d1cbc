// Does NCCL's copy-engine all-to-all free the SMs for the attention that runs beside Ulysses'
// exchange? (issue 6: on two H200s the all-to-all kernels slow the attention forward they overlap by
// ~1.3 ms per step at 30,976 tokens, dev/notes_sequence_parallel.md.) NCCL >= 2.28 runs
// ncclAlltoAll on the copy engines, with no CTA, when the communicator's CTA policy is
// NCCL_CTA_POLICY_ZERO and both buffers lie in windows registered with NCCL_WIN_COLL_SYMMETRIC
// (ncclMemAlloc + ncclCommWindowRegister), on one node with direct P2P (src/enqueue.cc, taskAppend).
//
// Two processes (fork), one GPU each. Per variant and block size, medians of REPS timed runs after
// warm-up (CUDA events):
//   a2a alone    REPEAT back-to-back ncclAlltoAll of `block` bytes per rank pair
//   gemm alone   a bf16 GEMM (cuBLAS, tensor cores: compute-bound like the attention)
//   both         the GEMM on one stream and the REPEAT all-to-alls on another, started together
//                (enqueued GEMM first, then all-to-alls first): each one's own time from the common
//                start, and the time until both are done
// Variants: kernel (default CTA policy, cudaMalloc buffers: what train_dit's NCCL calls do today)
// and ce (CTA policy zero, buffers in symmetric windows). The all-to-all's result is checked
// (every element from the right rank and place) in both variants.
//
//   nvcc -O2 -I. -x cu -o build/bench_a2a_ce dev/bench_a2a_ce.c -lnccl -lcublas
//   NCCL_NVLS_ENABLE=0 build/bench_a2a_ce [block MiB ...]       (needs two GPUs)
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "dev/bench_cuda.h"

#define REPS 9
#define WARMUP 2
#define REPEAT 8                       // all-to-alls per timed run (about one GEMM's time)
#define GEMM_M 16384
#define GEMM_N 8192
#define GEMM_K 8192

static int g_rank;

#define NCCL_OK(x)                                                                                   \
    do {                                                                                             \
        ncclResult_t r_ = (x);                                                                       \
        if (r_ != ncclSuccess) {                                                                     \
            fprintf(stderr, "rank %d: %s:%d: %s: %s\n", g_rank, __FILE__, __LINE__, #x, ncclGetErrorString(r_)); \
            exit(1);                                                                                 \
        }                                                                                            \
    } while (0)
#define CUBLAS_OK(x)                                                                                 \
    do {                                                                                             \
        cublasStatus_t s_ = (x);                                                                     \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                           \
            fprintf(stderr, "rank %d: %s:%d: %s: cuBLAS status %d\n", g_rank, __FILE__, __LINE__, #x, (int)s_); \
            exit(1);                                                                                 \
        }                                                                                            \
    } while (0)

static float median(float *v, int n) {
    qsort(v, n, sizeof(float), bench_cmp_float);
    return v[n / 2];
}

// x[i] = rank·2^24 + i (as uint32): the receiver can tell where every element came from
__global__ void fill_kernel(uint32_t *x, size_t n, int rank) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = ((uint32_t)rank << 24) + (uint32_t)(i & 0xffffff);
}
// recv block p must be rank p's send block `me`: elements me·count + j of p's buffer
__global__ void check_kernel(const uint32_t *y, size_t count, int nranks, int me, unsigned long long *bad) {
    size_t n = count * nranks;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t p = i / count, j = i % count;
        uint32_t want = ((uint32_t)p << 24) + (uint32_t)((me * count + j) & 0xffffff);
        if (y[i] != want) atomicAdd(bad, 1ull);
    }
}

typedef struct {
    ncclComm_t comm;
    cudaStream_t gemm_stream, comm_stream;
    cublasHandle_t blas;
    void *a, *b, *c;   // the GEMM's bf16 operands
} Ctx;

static void run_gemm(Ctx *x) {
    const float one = 1.0f, zero = 0.0f;
    CUBLAS_OK(cublasGemmEx(x->blas, CUBLAS_OP_N, CUBLAS_OP_N, GEMM_M, GEMM_N, GEMM_K, &one, x->a, CUDA_R_16BF,
                           GEMM_M, x->b, CUDA_R_16BF, GEMM_K, &zero, x->c, CUDA_R_16BF, GEMM_M, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT));
}
static void run_a2a(Ctx *x, const void *send, void *recv, size_t count) {
    for (int i = 0; i < REPEAT; i++) NCCL_OK(ncclAlltoAll(send, recv, count, ncclUint32, x->comm, x->comm_stream));
}

// One variant at one block size: prints a line on rank 0. "both": the GEMM and the all-to-alls
// started together, enqueued GEMM first (it fills the SMs before NCCL's kernels get any) or
// all-to-alls first; times from the common start.
static void measure(Ctx *x, const char *variant, const void *send, void *recv, size_t count) {
    cudaEvent_t start, gemm_end, a2a_end;
    CK(cudaEventCreate(&start));
    CK(cudaEventCreate(&gemm_end));
    CK(cudaEventCreate(&a2a_end));
    enum { A2A, GEMM, GEMM_FIRST, A2A_FIRST, MODES };
    float t_gemm[MODES][REPS], t_a2a[MODES][REPS], t_all[MODES][REPS];
    for (int mode = 0; mode < MODES; mode++)
        for (int it = -WARMUP; it < REPS; it++) {
            NCCL_OK(ncclAllReduce(send, recv, 1, ncclUint32, ncclMax, x->comm, x->comm_stream));   // line the ranks up
            CK(cudaStreamSynchronize(x->comm_stream));
            CK(cudaEventRecord(start, x->comm_stream));
            CK(cudaStreamWaitEvent(x->gemm_stream, start, 0));
            if (mode == A2A_FIRST) run_a2a(x, send, recv, count);
            if (mode != A2A) run_gemm(x);
            CK(cudaEventRecord(gemm_end, x->gemm_stream));
            if (mode == A2A || mode == GEMM_FIRST) run_a2a(x, send, recv, count);
            CK(cudaEventRecord(a2a_end, x->comm_stream));
            CK(cudaDeviceSynchronize());
            if (it < 0) continue;
            float g, a;
            CK(cudaEventElapsedTime(&g, start, gemm_end));
            CK(cudaEventElapsedTime(&a, start, a2a_end));
            t_gemm[mode][it] = g;
            t_a2a[mode][it] = a;
            t_all[mode][it] = g > a ? g : a;
        }
    double bytes = (double)count * 4 * REPEAT;   // sent to the peer per rank (2 ranks: one block)
    float ma = median(t_a2a[A2A], REPS), mg = median(t_gemm[GEMM], REPS);
    for (int mode = GEMM_FIRST; mode <= A2A_FIRST && g_rank == 0; mode++) {
        float bg = median(t_gemm[mode], REPS), ba = median(t_a2a[mode], REPS), bb = median(t_all[mode], REPS);
        printf("| %s | %s | %.0f | %.3f (%.0f GB/s) | %.3f | %.3f | %.3f | %.3f | %+.1f%% | %+.3f |\n", variant,
               mode == GEMM_FIRST ? "GEMM" : "all-to-alls", count * 4.0 / (1 << 20), ma, bytes / ma / 1e6, mg, bg,
               ba, bb, 100.0 * (bg / mg - 1.0), bb - (ma > mg ? ma : mg));
    }
    fflush(stdout);
    cudaEventDestroy(start);
    cudaEventDestroy(gemm_end);
    cudaEventDestroy(a2a_end);
}

static void check_result(Ctx *x, const char *variant, void *send, void *recv, size_t count, int nranks) {
    unsigned long long *bad, h = 0;
    CK(cudaMalloc(&bad, sizeof(*bad)));
    CK(cudaMemset(bad, 0, sizeof(*bad)));
    CK(cudaMemset(recv, 0xff, count * 4 * nranks));   // poison
    fill_kernel<<<1024, 256, 0, x->comm_stream>>>((uint32_t *)send, count * nranks, g_rank);
    NCCL_OK(ncclAlltoAll(send, recv, count, ncclUint32, x->comm, x->comm_stream));
    check_kernel<<<1024, 256, 0, x->comm_stream>>>((const uint32_t *)recv, count, nranks, g_rank, bad);
    CK(cudaStreamSynchronize(x->comm_stream));
    CK(cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost));
    cudaFree(bad);
    printf("rank %d, %s, block %zu bytes: all-to-all result %s (%llu wrong elements)\n", g_rank, variant, count * 4,
           h ? "WRONG" : "correct", h);
    if (h) exit(1);
}

static int run_rank(int rank, const ncclUniqueId *ids, const double *mib, int n_sizes) {
    g_rank = rank;
    const int nranks = 2;
    CK(cudaSetDevice(rank));
    size_t max_count = 0;
    for (int s = 0; s < n_sizes; s++) {
        size_t cnt = (size_t)(mib[s] * (1 << 20)) / 4;
        if (cnt > max_count) max_count = cnt;
    }
    size_t buf_bytes = max_count * 4 * nranks;
    Ctx x;
    CK(cudaStreamCreateWithFlags(&x.gemm_stream, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&x.comm_stream, cudaStreamNonBlocking));
    CUBLAS_OK(cublasCreate(&x.blas));
    CUBLAS_OK(cublasSetStream(x.blas, x.gemm_stream));
    CK(cudaMalloc(&x.a, (size_t)GEMM_M * GEMM_K * 2));
    CK(cudaMalloc(&x.b, (size_t)GEMM_K * GEMM_N * 2));
    CK(cudaMalloc(&x.c, (size_t)GEMM_M * GEMM_N * 2));
    CK(cudaMemset(x.a, 0x3c, (size_t)GEMM_M * GEMM_K * 2));   // bf16 ~0.0115: finite products
    CK(cudaMemset(x.b, 0x3c, (size_t)GEMM_K * GEMM_N * 2));

    for (int variant = 0; variant < 2; variant++) {
        const char *name = variant ? "ce" : "kernel";
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        if (variant) config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
        NCCL_OK(ncclCommInitRankConfig(&x.comm, nranks, ids[variant], rank, &config));   // one id per communicator
        void *send, *recv;
        ncclWindow_t wins[2] = {NULL, NULL};
        if (variant) {
            NCCL_OK(ncclMemAlloc(&send, buf_bytes));
            NCCL_OK(ncclMemAlloc(&recv, buf_bytes));
            NCCL_OK(ncclCommWindowRegister(x.comm, send, buf_bytes, &wins[0], NCCL_WIN_COLL_SYMMETRIC));
            NCCL_OK(ncclCommWindowRegister(x.comm, recv, buf_bytes, &wins[1], NCCL_WIN_COLL_SYMMETRIC));
        } else {
            CK(cudaMalloc(&send, buf_bytes));
            CK(cudaMalloc(&recv, buf_bytes));
        }
        for (int s = 0; s < n_sizes; s++) {
            size_t count = (size_t)(mib[s] * (1 << 20)) / 4;
            check_result(&x, name, send, recv, count, nranks);
            measure(&x, name, send, recv, count);
        }
        CK(cudaDeviceSynchronize());
        if (variant) {
            NCCL_OK(ncclCommWindowDeregister(x.comm, wins[0]));
            NCCL_OK(ncclCommWindowDeregister(x.comm, wins[1]));
            NCCL_OK(ncclMemFree(send));
            NCCL_OK(ncclMemFree(recv));
        } else {
            CK(cudaFree(send));
            CK(cudaFree(recv));
        }
        NCCL_OK(ncclCommDestroy(x.comm));
    }
    return 0;
}

int main(int argc, char **argv) {
    double mib[8] = {32, 96};
    int n_sizes = 2;
    if (argc > 1) {
        n_sizes = 0;
        for (int i = 1; i < argc && n_sizes < 8; i++) mib[n_sizes++] = atof(argv[i]);
    }
    int fds[2];
    if (pipe(fds) != 0) { perror("pipe"); return 1; }
    pid_t child = fork();
    if (child < 0) { perror("fork"); return 1; }
    ncclUniqueId ids[2];
    if (child == 0) {   // rank 1
        close(fds[1]);
        if (read(fds[0], ids, sizeof(ids)) != (ssize_t)sizeof(ids)) { fprintf(stderr, "rank 1: no NCCL ids\n"); return 1; }
    } else {
        close(fds[0]);
        for (int i = 0; i < 2; i++) NCCL_OK(ncclGetUniqueId(&ids[i]));
        if (write(fds[1], ids, sizeof(ids)) != (ssize_t)sizeof(ids)) { perror("write"); return 1; }
        int ver;
        NCCL_OK(ncclGetVersion(&ver));
        printf("NCCL %d; GEMM bf16 %d x %d x %d; %d all-to-alls per timed run; median of %d runs (ms)\n", ver, GEMM_M,
               GEMM_N, GEMM_K, REPEAT, REPS);
        printf("| variant | enqueued first | block MiB | a2a alone | gemm alone | gemm beside a2a | a2a beside gemm | "
               "both done | gemm slowdown | both − max(alone) |\n|---|---|---|---|---|---|---|---|---|---|\n");
        fflush(stdout);
    }
    int rc = run_rank(child == 0 ? 1 : 0, ids, mib, n_sizes);
    if (child != 0) {
        int status = 0;
        if (waitpid(child, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "rank 1 failed (status %d)\n", status);
            return 1;
        }
    }
    return rc;
}
