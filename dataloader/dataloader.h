// The training data loader: an image folder ROOT/<class>/*.{png,jpg,jpeg,bmp,tga,gif} or the
// built-in synthetic dataset, preprocessed to (B, C, S, S) floats in [-1, 1], in an order
// that is shuffled per epoch from the seed and can be saved and resumed exactly.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DATALOADER_SYNTHETIC "synthetic"
#define DATALOADER_DEFAULT_MAX_PIXELS (1 << 26)   // 64 Mpx: larger images are refused

typedef struct {
    const char *root;        // image folder ROOT/<class>/*.{png,jpg,jpeg,bmp,tga,gif}, or "synthetic"
    int image_size;          // output side S (square), 1..4096
    int channels;            // 1 or 3 (converted from whatever the file has)
    int batch_size;
    uint64_t seed;           // shuffle order, flips, and the synthetic images
    int random_flip;         // horizontal flip with probability 0.5
    int skip_bad_images;     // log and skip bad files (and allow empty class folders) instead of stopping
    int prefetch;            // batches a background thread keeps ready (0 = load inline)
    int max_image_pixels;    // refuse images with more pixels (0 = DATALOADER_DEFAULT_MAX_PIXELS)
} DataLoaderConfig;

typedef struct DataLoader DataLoader;

// Lists the dataset (the images are decoded later, batch by batch) and starts the prefetch
// thread. Fails for a bad config, a missing or unreadable root, no class folders, an empty
// class folder (unless skip_bad_images) and a dataset without images.
int dataloader_open(DataLoader **dl, const DataLoaderConfig *cfg, char *err);

// images: (B, C, S, S) in [-1, 1], labels: (B). Each epoch visits every image once in an
// order shuffled from (seed, epoch); a batch may span two epochs. A bad image stops with an
// error naming the file and the reason; with skip_bad_images it is logged and replaced by
// the next image, the end of each epoch reports the count, and an epoch where every image
// is bad is an error. After an error every later call returns the same error.
int dataloader_next_batch(DataLoader *dl, float *images, int *labels, char *err);

int dataloader_num_classes(const DataLoader *dl);
const char *dataloader_class_name(const DataLoader *dl, int label);   // NULL when out of range
int64_t dataloader_num_images(const DataLoader *dl);
// Bad images skipped while producing the batches returned since open or the last seek.
int64_t dataloader_num_skipped(const DataLoader *dl);

// Position of the next batch that dataloader_next_batch returns: saved in checkpoints.
typedef struct { uint64_t epoch, index, rng_state; } DataPosition;
DataPosition dataloader_position(const DataLoader *dl);
// Continues the exact batch sequence from a saved position (same dataset and config).
int dataloader_seek(DataLoader *dl, DataPosition pos, char *err);

// A PNG grid (image_grid.h) of the first n training samples of epoch 0 after preprocessing
// (flips included), captioned with their class names. Does not move the loader's position.
int dataloader_preview_png(DataLoader *dl, const char *path, int n, char *err);

void dataloader_close(DataLoader *dl);

#ifdef __cplusplus
}
#endif
