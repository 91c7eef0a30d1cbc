// The Hadamard rotation of sage attention on the GPU (SageConfig.rotate of the CPU definition,
// attention/attention.h): x (rows, D) in place, each row times the normalized Walsh-Hadamard
// matrix H (symmetric and orthogonal). Sage quantizes q and k per block to INT8; a channel with
// outliers then costs every other channel of its row its precision. S = (qH)(kH)ᵀ = q·kᵀ, and
// qH spreads each outlier over all D channels, so rotating q and k before attention keeps the
// exact result and makes the INT8 rounding far smaller (dev/sage_outlier_accuracy.c). The
// gradients come back rotated: dq = dq'·H, dk = dk'·H (apply the same function to them).
//
// bf16 (raw 16-bit patterns) or fp32 rows, D = 32, 64 or 128, one warp per row, the CPU's
// butterfly order (hadamard_rotate): the fp32 version is bitwise equal to the CPU's, the bf16
// version is the CPU's result rounded to bf16 (round to nearest even). x must be 16-byte aligned.
// Returns 0, or -1 with a message in err (DIT_ERR_LEN bytes, may be NULL).
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

int hadamard_rotate_bf16_cuda(uint16_t *x, size_t rows, int D, cudaStream_t stream, char *err);
int hadamard_rotate_f32_cuda(float *x, size_t rows, int D, cudaStream_t stream, char *err);

#ifdef __cplusplus
}
#endif
