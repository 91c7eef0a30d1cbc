// The built-in synthetic dataset ("--data synthetic"): 10 classes of simple shapes and
// patterns with random positions, sizes and colors. Needs nothing on disk; image i is a
// pure function of (seed, i), so tests and CPU runs get a small learnable dataset.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SYNTHETIC_NUM_CLASSES 10
#define SYNTHETIC_NUM_IMAGES 10000

// Class names, sorted like an image folder would be: "0_disk" .. "9_two_blobs".
const char *synthetic_class_name(int label);
// Image i has label i % SYNTHETIC_NUM_CLASSES.
int synthetic_label(int64_t index);
// Draws image `index` of the dataset of `seed` at S x S into out (C, S, S) in [-1, 1]
// (C = 3: colors; C = 1: their luma); flip != 0 mirrors it left-right.
void synthetic_render(uint64_t seed, int64_t index, int S, int C, int flip, float *out);

#ifdef __cplusplus
}
#endif
