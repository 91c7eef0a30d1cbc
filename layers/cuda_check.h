// Error checks for the CUDA code of the layers. Each macro returns -1 from the calling function
// after writing into `err` the failed call, the error string, and a printf-style description of
// the sizes involved (layers/common.h's convention: no exit() in library code).
#pragma once
#include <stdio.h>
#include <cuda_runtime_api.h>
#include <cublasLt.h>
#include "layers/common.h"

// A CUDA runtime call: CUDA_CHECK(err, cudaMalloc(&p, bytes), "scratch of %zu bytes", bytes);
#define CUDA_CHECK(err, call, ...) do {                                                        \
        cudaError_t status_ = (call);                                                          \
        if (status_ != cudaSuccess) {                                                          \
            char what_[256];                                                                   \
            snprintf(what_, sizeof what_, __VA_ARGS__);                                        \
            dit_set_error(err, "%s:%d: %s failed: %s (%s)", __FILE__, __LINE__, #call,         \
                          cudaGetErrorString(status_), what_);                                 \
            return -1;                                                                         \
        }                                                                                      \
    } while (0)

// After a kernel launch: catches bad launch configurations (and earlier asynchronous errors).
#define LAUNCH_CHECK(err, kernel_name, ...) do {                                               \
        cudaError_t status_ = cudaGetLastError();                                              \
        if (status_ != cudaSuccess) {                                                          \
            char what_[256];                                                                   \
            snprintf(what_, sizeof what_, __VA_ARGS__);                                        \
            dit_set_error(err, "%s:%d: launch of %s failed: %s (%s)", __FILE__, __LINE__,      \
                          kernel_name, cudaGetErrorString(status_), what_);                    \
            return -1;                                                                         \
        }                                                                                      \
    } while (0)

// A cuBLASLt call inside a function that owns descriptors: on failure sets `status = -1` and
// jumps to `cleanup`, where the function frees them.
#define CUBLASLT_CHECK_GOTO(err, call, ...) do {                                               \
        cublasStatus_t status_ = (call);                                                       \
        if (status_ != CUBLAS_STATUS_SUCCESS) {                                                \
            char what_[256];                                                                   \
            snprintf(what_, sizeof what_, __VA_ARGS__);                                        \
            dit_set_error(err, "%s:%d: %s failed: %s (%d) (%s)", __FILE__, __LINE__, #call,    \
                          cublasLtGetStatusString(status_), (int)status_, what_);              \
            status = -1;                                                                       \
            goto cleanup;                                                                      \
        }                                                                                      \
    } while (0)
