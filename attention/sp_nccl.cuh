// Error checks shared by the NCCL sequence-parallel files (sp_collectives_nccl.cu,
// ulysses_nccl.cu, ring_nccl.cu): the message names the function, the operation and its sizes.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>
#include "layers/common.h"

#define SP_CUDA_CHECK(call, err, ...)                                                        \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            char what_[256];                                                                 \
            snprintf(what_, sizeof(what_), __VA_ARGS__);                                     \
            dit_set_error(err, "%s: %s: %s", __func__, what_, cudaGetErrorString(e_));       \
            return -1;                                                                       \
        }                                                                                    \
    } while (0)

#define SP_NCCL_CHECK(call, err, ...)                                                        \
    do {                                                                                     \
        ncclResult_t r_ = (call);                                                            \
        if (r_ != ncclSuccess) {                                                             \
            char what_[256];                                                                 \
            snprintf(what_, sizeof(what_), __VA_ARGS__);                                     \
            dit_set_error(err, "%s: %s: %s", __func__, what_, ncclGetErrorString(r_));       \
            return -1;                                                                       \
        }                                                                                    \
    } while (0)
