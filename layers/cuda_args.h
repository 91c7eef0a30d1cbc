// Host-side argument checks of the CUDA entry points (attention/*.cu, layers/*.cu), run before
// any CUDA call: a NULL or misaligned device pointer comes back as -1 and a message naming the
// function, the argument and its value (layers/common.h's convention) instead of a kernel fault
// that kills the CUDA context. Needs no GPU.
#pragma once
#include <limits.h>
#include <stdint.h>
#include "layers/common.h"

// One device-pointer argument: its name, its value and the alignment in bytes its kernels need
// (16 where they load or store 16-byte vectors, cp.async 16 bytes or build TMA maps).
typedef struct { const char *name; const void *ptr; unsigned align; } DeviceArg;
#define DEVICE_ARG(p, align) {#p, (const void *)(p), (align)}

// 0, or -1 with a message naming fn and the first argument that is NULL or misaligned.
static inline int check_device_args(const char *fn, const DeviceArg *args, int n, char *err) {
    for (int i = 0; i < n; i++) {
        if (!args[i].ptr) {
            dit_set_error(err, "%s: %s must be a device pointer, got NULL", fn, args[i].name);
            return -1;
        }
        if ((uintptr_t)args[i].ptr % args[i].align != 0) {
            dit_set_error(err, "%s: %s=%p must be %u-byte aligned", fn, args[i].name, args[i].ptr, args[i].align);
            return -1;
        }
    }
    return 0;
}

// Returns -1 from the calling function unless every DEVICE_ARG(...) passes check_device_args.
#define CHECK_DEVICE_ARGS(fn, err, ...) do {                                                    \
        const DeviceArg args_[] = {__VA_ARGS__};                                                 \
        if (check_device_args(fn, args_, (int)(sizeof args_ / sizeof *args_), err)) return -1;  \
    } while (0)

// 0, or -1 unless `count` threads in blocks of `block` fit a grid's x extent (2^31 - 1 blocks).
static inline int check_grid_x(const char *fn, size_t count, int block, char *err) {
    if (count / block + (count % block != 0) > 2147483647u) {
        dit_set_error(err, "%s: %zu elements need more than 2^31 - 1 blocks of %d threads", fn, count, block);
        return -1;
    }
    return 0;
}

// 0, or -1 unless a·b <= limit (an index the kernels compute in int, or a grid extent); `name`
// spells the product, e.g. "B·T".
static inline int check_product(const char *fn, const char *name, long long a, long long b, long long limit,
                                char *err) {
    if (a * b > limit) {
        dit_set_error(err, "%s: %s = %lld·%lld = %lld exceeds %lld, the most its kernels index", fn, name, a, b,
                      a * b, limit);
        return -1;
    }
    return 0;
}
