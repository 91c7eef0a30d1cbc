// Helpers shared by the GPU model tests (test_dit_gpu_cuda.c, test_distributed_cuda.c).
#pragma once
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "layers/common.h"
#include "layers/layers_cuda.h"
#include "model/dit.h"

static inline float bf16_round(float x) { return float_from_bf16_bits(bf16_bits_from_float(x)); }

// Every tensor random (weights N(0, 1/fan_in), vectors N(0, 0.1²)), rounded to bf16, EMA = weights:
// every gradient is nonzero (DiT's zero init would make most of them exactly zero).
static inline void randomize_params(Dit *m, uint64_t seed) {
    int n = dit_num_tensors(&m->cfg);
    DitTensorInfo *info = malloc(n * sizeof(DitTensorInfo));
    cr_assert(info);
    dit_tensor_infos(&m->cfg, info);
    Rng rng;
    rng_seed(&rng, seed);
    for (int i = 0; i < n; i++) {
        float *p = m->params_memory + info[i].offset;
        float std = info[i].ndim >= 2 ? 1.0f / sqrtf((float)(info[i].numel / info[i].shape[0])) : 0.1f;
        rng_fill_normal(&rng, p, info[i].numel, std);
        for (size_t j = 0; j < info[i].numel; j++) p[j] = bf16_round(p[j]);
    }
    memcpy(m->ema_memory, m->params_memory, m->num_params * sizeof(float));
    free(info);
}
