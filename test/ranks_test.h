// Helpers of the multi-GPU tests whose ranks are forked processes (test_distributed_cuda.c,
// test_sp_model_cuda.c): a clock, the GPU count taken in a child (so that the parent does not
// initialize CUDA before it forks), and float arrays passed from the ranks to the parent in files.
#pragma once
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cuda_runtime_api.h>

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static inline int gpu_count_in_child(void) {
    pid_t pid = fork();
    if (pid == 0) {
        int n = 0;
        _exit(cudaGetDeviceCount(&n) == cudaSuccess ? (n > 100 ? 100 : n) : 0);
    }
    int status;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
}

static inline int write_floats(const char *path, const float *x, size_t n) {
    FILE *f = fopen(path, "wb");
    int ok = f && fwrite(x, sizeof(float), n, f) == n;
    if (f) ok = (fclose(f) == 0) && ok;
    return ok ? 0 : -1;
}

static inline float *read_floats(const char *path, size_t n) {
    float *x = malloc(n * sizeof(float));
    FILE *f = fopen(path, "rb");
    cr_assert(x && f, "%s: cannot read", path);
    cr_assert_eq(fread(x, sizeof(float), n, f), n, "%s: short", path);
    fclose(f);
    return x;
}
