#include "dataloader/dataloader.h"
#include "dataloader/image_decode.h"
#include "dataloader/image_folder.h"
#include "dataloader/image_grid.h"
#include "dataloader/synthetic.h"
#include "layers/common.h"
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Where the producer of batches stands: the epoch, the next index into that epoch's
// permutation, the flip RNG, and skip counts of the current epoch.
typedef struct {
    uint64_t epoch;
    int64_t index;
    Rng flip_rng;
    int64_t *order;           // (num_images) permutation of the current epoch
    int64_t visited, skipped; // images of this epoch visited / skipped since the epoch (or a seek) began
    int64_t total_skipped;
} Producer;

// One prefetched batch, the position after it and the producer's skip count after it.
typedef struct {
    float *images;
    int *labels;
    DataPosition end;
    int64_t total_skipped;
    int rc;
    char err[DIT_ERR_LEN];
} Slot;

struct DataLoader {
    DataLoaderConfig cfg;
    char *root;
    int synthetic;
    ImageFolder folder;
    int num_classes;
    int64_t num_images;
    size_t image_floats;      // C * S * S
    Producer producer;        // owned by the prefetch thread while it runs
    DataPosition position;    // of the next batch returned
    int64_t total_skipped;    // bad images skipped up to the end of the last batch returned
    int failed;               // sticky error of next_batch
    char error[DIT_ERR_LEN];
    // prefetch: a ring of cfg.prefetch slots filled by the thread, emptied by next_batch
    pthread_t thread;
    int thread_running, stop;
    pthread_mutex_t mutex;
    pthread_cond_t filled_cond, free_cond;
    Slot *slots;
    int head, filled;
};

static uint64_t order_seed(uint64_t seed, uint64_t epoch) { return seed ^ ((epoch + 1) * 0x9E3779B97F4A7C15ull); }
static uint64_t flip_seed(uint64_t seed) { return seed ^ 0xA0761D6478BD642Full; }

// order = Fisher-Yates shuffle of 0..n-1 from (seed, epoch).
static void build_order(int64_t *order, int64_t n, uint64_t seed, uint64_t epoch) {
    Rng rng;
    rng_seed(&rng, order_seed(seed, epoch));
    for (int64_t i = 0; i < n; i++) order[i] = i;
    for (int64_t i = n - 1; i > 0; i--) {
        uint64_t r = ((uint64_t)rng_u32(&rng) << 32) | rng_u32(&rng);
        int64_t j = (int64_t)(r % (uint64_t)(i + 1));
        int64_t t = order[i]; order[i] = order[j]; order[j] = t;
    }
}

static void producer_set(Producer *p, const DataLoader *dl, DataPosition pos) {
    p->epoch = pos.epoch;
    p->index = (int64_t)pos.index;
    p->flip_rng.state = pos.rng_state;
    p->visited = p->skipped = 0;
    build_order(p->order, dl->num_images, dl->cfg.seed, p->epoch);
}

static DataPosition producer_position(const Producer *p) {
    return (DataPosition){p->epoch, (uint64_t)p->index, p->flip_rng.state};
}

static int load_image(const DataLoader *dl, int64_t i, int flip, float *out, char *err) {
    int S = dl->cfg.image_size, C = dl->cfg.channels;
    if (dl->synthetic) {
        synthetic_render(dl->cfg.seed, i, S, C, flip, out);
        return 0;
    }
    return image_load(dl->folder.paths[i], dl->cfg.max_image_pixels, S, C, flip, out, err);
}

static int image_label(const DataLoader *dl, int64_t i) {
    return dl->synthetic ? synthetic_label(i) : dl->folder.labels[i];
}

// Closes the epoch when its last image was visited: reports skips, fails if all were bad.
static int finish_epoch(const DataLoader *dl, Producer *p, const char *last_error, char *err) {
    if (p->skipped > 0) {
        fprintf(stderr, "dataloader: epoch %llu done: skipped %lld of %lld images (bad files)\n",
                (unsigned long long)p->epoch, (long long)p->skipped, (long long)dl->num_images);
    }
    if (p->visited == dl->num_images && p->skipped == p->visited) {
        dit_set_error(err, "%s: all %lld images of epoch %llu are bad; the last one: %s", dl->root,
                      (long long)dl->num_images, (unsigned long long)p->epoch, last_error);
        return -1;
    }
    p->epoch++;
    p->index = 0;
    p->visited = p->skipped = 0;
    build_order(p->order, dl->num_images, dl->cfg.seed, p->epoch);
    return 0;
}

// Fills count images (count, C, S, S) and labels from the producer's position onwards.
static int produce(const DataLoader *dl, Producer *p, int count, float *images, int *labels, char *err) {
    char bad[DIT_ERR_LEN] = "";
    for (int b = 0; b < count;) {
        int64_t i = p->order[p->index++];
        p->visited++;
        int flip = dl->cfg.random_flip ? (int)(rng_u32(&p->flip_rng) & 1) : 0;  // drawn for bad images too
        int rc = load_image(dl, i, flip, images + (size_t)b * dl->image_floats, bad);
        if (rc == 0) {
            labels[b++] = image_label(dl, i);
        } else if (dl->cfg.skip_bad_images) {
            fprintf(stderr, "dataloader: skipping bad image: %s\n", bad);
            p->skipped++;
            p->total_skipped++;
        }
        if (p->index == dl->num_images && finish_epoch(dl, p, bad, err) != 0) return -1;
        if (rc != 0 && !dl->cfg.skip_bad_images) {
            dit_set_error(err, "%s", bad);
            return -1;
        }
    }
    return 0;
}

static void *prefetch_main(void *arg) {
    DataLoader *dl = arg;
    pthread_mutex_lock(&dl->mutex);
    for (;;) {
        while (!dl->stop && dl->filled == dl->cfg.prefetch) pthread_cond_wait(&dl->free_cond, &dl->mutex);
        if (dl->stop) break;
        Slot *slot = &dl->slots[(dl->head + dl->filled) % dl->cfg.prefetch];
        pthread_mutex_unlock(&dl->mutex);
        slot->rc = produce(dl, &dl->producer, dl->cfg.batch_size, slot->images, slot->labels, slot->err);
        slot->end = producer_position(&dl->producer);
        slot->total_skipped = dl->producer.total_skipped;
        pthread_mutex_lock(&dl->mutex);
        dl->filled++;
        pthread_cond_signal(&dl->filled_cond);
        if (slot->rc != 0) break;  // the consumer reports the error; nothing more is produced
    }
    pthread_mutex_unlock(&dl->mutex);
    return NULL;
}

static int start_prefetch(DataLoader *dl, char *err) {
    dl->head = dl->filled = 0;
    dl->stop = 0;
    if (pthread_create(&dl->thread, NULL, prefetch_main, dl) != 0) {
        dit_set_error(err, "dataloader: cannot start the prefetch thread");
        return -1;
    }
    dl->thread_running = 1;
    return 0;
}

static void stop_prefetch(DataLoader *dl) {
    if (!dl->thread_running) return;
    pthread_mutex_lock(&dl->mutex);
    dl->stop = 1;
    pthread_cond_broadcast(&dl->free_cond);
    pthread_mutex_unlock(&dl->mutex);
    pthread_join(dl->thread, NULL);
    dl->thread_running = 0;
}

static int check_config(const DataLoaderConfig *cfg, char *err) {
    const char *bad = NULL;
    if (!cfg->root || !cfg->root[0]) bad = "root must name a folder or \"synthetic\"";
    else if (cfg->image_size < 1 || cfg->image_size > 4096) bad = "image_size must be in 1..4096";
    else if (cfg->channels != 1 && cfg->channels != 3) bad = "channels must be 1 or 3";
    else if (cfg->batch_size < 1) bad = "batch_size must be >= 1";
    else if (cfg->prefetch < 0 || cfg->prefetch > 64) bad = "prefetch must be in 0..64";
    else if (cfg->max_image_pixels < 0) bad = "max_image_pixels must be >= 0 (0 = default)";
    if (bad) {
        dit_set_error(err, "dataloader config: %s (root=%s image_size=%d channels=%d batch_size=%d "
                      "prefetch=%d max_image_pixels=%d)", bad, cfg->root ? cfg->root : "(null)",
                      cfg->image_size, cfg->channels, cfg->batch_size, cfg->prefetch, cfg->max_image_pixels);
        return -1;
    }
    return 0;
}

int dataloader_open(DataLoader **out, const DataLoaderConfig *cfg, char *err) {
    if (!out || !cfg) {
        dit_set_error(err, "dataloader_open: the handle and the config must not be NULL");
        return -1;
    }
    *out = NULL;
    if (check_config(cfg, err) != 0) return -1;
    DataLoader *dl = calloc(1, sizeof(DataLoader));
    if (!dl) {
        dit_set_error(err, "dataloader: out of memory");
        return -1;
    }
    dl->cfg = *cfg;
    if (dl->cfg.max_image_pixels == 0) dl->cfg.max_image_pixels = DATALOADER_DEFAULT_MAX_PIXELS;
    dl->root = strdup(cfg->root);
    dl->cfg.root = dl->root;
    dl->synthetic = strcmp(cfg->root, DATALOADER_SYNTHETIC) == 0;
    dl->image_floats = (size_t)cfg->channels * cfg->image_size * cfg->image_size;
    pthread_mutex_init(&dl->mutex, NULL);
    pthread_cond_init(&dl->filled_cond, NULL);
    pthread_cond_init(&dl->free_cond, NULL);
    if (!dl->root) {
        dit_set_error(err, "dataloader: out of memory");
        goto fail;
    }
    if (dl->synthetic) {
        dl->num_classes = SYNTHETIC_NUM_CLASSES;
        dl->num_images = SYNTHETIC_NUM_IMAGES;
    } else {
        if (image_folder_scan(&dl->folder, cfg->root, cfg->skip_bad_images, err) != 0) goto fail;
        dl->num_classes = dl->folder.num_classes;
        dl->num_images = dl->folder.num_images;
    }
    dl->producer.order = malloc(sizeof(int64_t) * dl->num_images);
    if (!dl->producer.order) {
        dit_set_error(err, "%s: out of memory for the order of %lld images", cfg->root, (long long)dl->num_images);
        goto fail;
    }
    Rng flip_rng;
    rng_seed(&flip_rng, flip_seed(cfg->seed));
    dl->position = (DataPosition){0, 0, flip_rng.state};
    producer_set(&dl->producer, dl, dl->position);
    if (cfg->prefetch > 0) {
        dl->slots = calloc(cfg->prefetch, sizeof(Slot));
        if (!dl->slots) {
            dit_set_error(err, "dataloader: out of memory for %d prefetch slots", cfg->prefetch);
            goto fail;
        }
        for (int s = 0; s < cfg->prefetch; s++) {
            dl->slots[s].images = malloc(sizeof(float) * dl->image_floats * cfg->batch_size);
            dl->slots[s].labels = malloc(sizeof(int) * cfg->batch_size);
            if (!dl->slots[s].images || !dl->slots[s].labels) {
                dit_set_error(err, "dataloader: out of memory for %d prefetched batches of (%d, %d, %d, %d) floats",
                              cfg->prefetch, cfg->batch_size, cfg->channels, cfg->image_size, cfg->image_size);
                goto fail;
            }
        }
        if (start_prefetch(dl, err) != 0) goto fail;
    }
    *out = dl;
    return 0;
fail:
    dataloader_close(dl);
    return -1;
}

int dataloader_next_batch(DataLoader *dl, float *images, int *labels, char *err) {
    if (dl->failed) {
        dit_set_error(err, "%s", dl->error);
        return -1;
    }
    int B = dl->cfg.batch_size;
    if (dl->cfg.prefetch == 0) {
        if (produce(dl, &dl->producer, B, images, labels, dl->error) != 0) {
            dl->failed = 1;
            dit_set_error(err, "%s", dl->error);
            return -1;
        }
        dl->position = producer_position(&dl->producer);
        dl->total_skipped = dl->producer.total_skipped;
        return 0;
    }
    pthread_mutex_lock(&dl->mutex);
    while (dl->filled == 0) pthread_cond_wait(&dl->filled_cond, &dl->mutex);
    Slot *slot = &dl->slots[dl->head];
    pthread_mutex_unlock(&dl->mutex);
    if (slot->rc != 0) {
        dl->failed = 1;
        snprintf(dl->error, sizeof(dl->error), "%s", slot->err);
        dit_set_error(err, "%s", dl->error);
        return -1;
    }
    memcpy(images, slot->images, sizeof(float) * dl->image_floats * B);
    memcpy(labels, slot->labels, sizeof(int) * B);
    dl->position = slot->end;
    dl->total_skipped = slot->total_skipped;
    pthread_mutex_lock(&dl->mutex);
    dl->head = (dl->head + 1) % dl->cfg.prefetch;
    dl->filled--;
    pthread_cond_signal(&dl->free_cond);
    pthread_mutex_unlock(&dl->mutex);
    return 0;
}

int dataloader_num_classes(const DataLoader *dl) { return dl->num_classes; }

const char *dataloader_class_name(const DataLoader *dl, int label) {
    if (label < 0 || label >= dl->num_classes) return NULL;
    return dl->synthetic ? synthetic_class_name(label) : dl->folder.class_names[label];
}

int64_t dataloader_num_images(const DataLoader *dl) { return dl->num_images; }

int64_t dataloader_num_skipped(const DataLoader *dl) { return dl->total_skipped; }

DataPosition dataloader_position(const DataLoader *dl) { return dl->position; }

int dataloader_seek(DataLoader *dl, DataPosition pos, char *err) {
    if (pos.index >= (uint64_t)dl->num_images || pos.rng_state == 0) {
        dit_set_error(err, "%s: cannot seek to epoch %llu index %llu rng_state %llu: expected index < %lld "
                      "(the number of images) and a nonzero rng_state", dl->root, (unsigned long long)pos.epoch,
                      (unsigned long long)pos.index, (unsigned long long)pos.rng_state, (long long)dl->num_images);
        return -1;
    }
    stop_prefetch(dl);
    producer_set(&dl->producer, dl, pos);
    dl->producer.total_skipped = dl->total_skipped = 0;
    dl->position = pos;
    dl->failed = 0;
    return dl->cfg.prefetch > 0 ? start_prefetch(dl, err) : 0;
}

int dataloader_preview_png(DataLoader *dl, const char *path, int n, char *err) {
    if (n <= 0) {
        dit_set_error(err, "%s: preview needs n > 0 images (got %d)", path, n);
        return -1;
    }
    Producer p = {0};
    float *images = malloc(sizeof(float) * dl->image_floats * n);
    int *labels = malloc(sizeof(int) * n);
    const char **captions = malloc(sizeof(char *) * n);
    p.order = malloc(sizeof(int64_t) * dl->num_images);
    int rc = -1;
    if (!images || !labels || !captions || !p.order) {
        dit_set_error(err, "%s: out of memory for a preview of %d images", path, n);
    } else {
        Rng flip_rng;
        rng_seed(&flip_rng, flip_seed(dl->cfg.seed));
        producer_set(&p, dl, (DataPosition){0, 0, flip_rng.state});
        if (produce(dl, &p, n, images, labels, err) == 0) {
            for (int i = 0; i < n; i++) captions[i] = dataloader_class_name(dl, labels[i]);
            int cols = (int)ceil(sqrt((double)n));
            rc = write_image_grid_png(path, images, n, dl->cfg.channels, dl->cfg.image_size, cols, captions, err);
        }
    }
    free(images); free(labels); free(captions); free(p.order);
    return rc;
}

void dataloader_close(DataLoader *dl) {
    if (!dl) return;
    stop_prefetch(dl);
    for (int s = 0; dl->slots && s < dl->cfg.prefetch; s++) {
        free(dl->slots[s].images);
        free(dl->slots[s].labels);
    }
    free(dl->slots);
    free(dl->producer.order);
    if (!dl->synthetic) image_folder_free(&dl->folder);
    free(dl->root);
    pthread_mutex_destroy(&dl->mutex);
    pthread_cond_destroy(&dl->filled_cond);
    pthread_cond_destroy(&dl->free_cond);
    free(dl);
}
