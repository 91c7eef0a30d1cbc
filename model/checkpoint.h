// Checkpoints: the model's weights (DiT's names), EMA weights, AdamW moments and the training
// state in one safetensors file, loadable by PyTorch's safetensors.
//   "<name>"        weights, e.g. "blocks.0.attn.qkv.weight"
//   "ema.<name>"    EMA of the weights (sample from these)
//   "adam_m.<name>", "adam_v.<name>"  AdamW moments
//   __metadata__    format, model config, step, RNG state, data-loader position, class names
#pragma once
#include <stdint.h>
#include "model/dit.h"
#include "model/safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t step;                      // optimizer steps done
    uint64_t rng_state;                // the trainer's Rng (label drop, t, noise)
    uint64_t data_epoch, data_index, data_rng_state;   // the data loader's position
} TrainState;

int checkpoint_save(const char *path, const Dit *m, const TrainState *state,
                    const char *class_names, char *err);
// Reads only the model configuration (to create the model before loading).
int checkpoint_read_config(const char *path, DitConfig *cfg, char *err);
// Loads everything into a model created with the same configuration.
int checkpoint_load(const char *path, Dit *m, TrainState *state, char *err);
// Adds every parameter tensor of `memory` (a buffer laid out as m's parameters) to a writer,
// named prefix + DiT's name.
void checkpoint_add_params(SafetensorsWriter *w, const DitConfig *cfg, const DitTensorInfo *info,
                           const char *prefix, const float *memory);

#ifdef __cplusplus
}
#endif
