// Checkpoint save and load (format in checkpoint.h). Every field read back is validated and a
// failure names the file and the field.
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "layers/common.h"
#include "model/checkpoint.h"

#define CHECKPOINT_FORMAT "dit.c checkpoint v1"
#define NAME_LEN 96

void checkpoint_add_params(SafetensorsWriter *w, const DitConfig *cfg, const DitTensorInfo *info,
                           const char *prefix, const float *memory) {
    int n = dit_num_tensors(cfg);
    for (int i = 0; i < n; i++) {
        char name[NAME_LEN];
        snprintf(name, sizeof(name), "%s%s", prefix, info[i].name);
        st_writer_add(w, name, ST_F32, info[i].shape, info[i].ndim, memory + info[i].offset);
    }
}

static void meta_u64(SafetensorsWriter *w, const char *key, uint64_t value) {
    char text[32];
    snprintf(text, sizeof(text), "%" PRIu64, value);
    st_writer_meta(w, key, text);
}

int checkpoint_save(const char *path, const Dit *m, const TrainState *s, const char *class_names, char *err) {
    const DitConfig *c = &m->cfg;
    int n = dit_num_tensors(c);
    DitTensorInfo *info = malloc(n * sizeof(DitTensorInfo));
    SafetensorsWriter *w = st_writer_new();
    if (!info || !w) {
        dit_set_error(err, "%s: out of memory while building the checkpoint", path);
        free(info);
        st_writer_free(w);
        return -1;
    }
    dit_tensor_infos(c, info);
    checkpoint_add_params(w, c, info, "", m->params_memory);
    checkpoint_add_params(w, c, info, "ema.", m->ema_memory);
    checkpoint_add_params(w, c, info, "adam_m.", m->adam_m_memory);
    checkpoint_add_params(w, c, info, "adam_v.", m->adam_v_memory);
    st_writer_meta(w, "format", CHECKPOINT_FORMAT);
    meta_u64(w, "image_size", c->image_size);
    meta_u64(w, "channels", c->channels);
    meta_u64(w, "patch", c->patch);
    meta_u64(w, "hidden", c->hidden);
    meta_u64(w, "depth", c->depth);
    meta_u64(w, "heads", c->heads);
    meta_u64(w, "num_classes", c->num_classes);
    meta_u64(w, "step", (uint64_t)s->step);
    meta_u64(w, "rng_state", s->rng_state);
    meta_u64(w, "data_epoch", s->data_epoch);
    meta_u64(w, "data_index", s->data_index);
    meta_u64(w, "data_rng_state", s->data_rng_state);
    if (class_names) st_writer_meta(w, "class_names", class_names);
    int rc = st_writer_save(w, path, err);
    st_writer_free(w);
    free(info);
    return rc;
}

// Parses metadata `key` as an unsigned integer no larger than `max`.
static int read_meta_u64(const SafetensorsFile *f, const char *path, const char *key, uint64_t max,
                         uint64_t *out, char *err) {
    const char *text = st_meta(f, key);
    if (!text) {
        dit_set_error(err, "%s: checkpoint metadata has no '%s'", path, key);
        return -1;
    }
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || end == text || *end != '\0' || text[0] == '-' || v > max) {
        dit_set_error(err, "%s: checkpoint metadata '%s' = '%s' is not an integer in 0..%" PRIu64,
                      path, key, text, max);
        return -1;
    }
    *out = v;
    return 0;
}

static int read_config(const SafetensorsFile *f, const char *path, DitConfig *cfg, char *err) {
    const char *format = st_meta(f, "format");
    if (!format || strcmp(format, CHECKPOINT_FORMAT) != 0) {
        dit_set_error(err, "%s: not a dit.c checkpoint (metadata 'format' is '%s', expected '%s')",
                      path, format ? format : "(missing)", CHECKPOINT_FORMAT);
        return -1;
    }
    const char *keys[] = {"image_size", "channels", "patch", "hidden", "depth", "heads", "num_classes"};
    int *fields[] = {&cfg->image_size, &cfg->channels, &cfg->patch, &cfg->hidden, &cfg->depth,
                     &cfg->heads, &cfg->num_classes};
    for (int i = 0; i < 7; i++) {
        uint64_t v;
        if (read_meta_u64(f, path, keys[i], 1u << 20, &v, err) != 0) return -1;
        *fields[i] = (int)v;
    }
    char why[DIT_ERR_LEN];
    if (dit_config_validate(cfg, why) != 0) {
        dit_set_error(err, "%s: %s", path, why);
        return -1;
    }
    return 0;
}

int checkpoint_read_config(const char *path, DitConfig *cfg, char *err) {
    SafetensorsFile *f;
    if (st_open(&f, path, err) != 0) return -1;
    int rc = read_config(f, path, cfg, err);
    st_close(f);
    return rc;
}

int checkpoint_load(const char *path, Dit *m, TrainState *s, char *err) {
    SafetensorsFile *f;
    if (st_open(&f, path, err) != 0) return -1;
    DitConfig cfg;
    int n = dit_num_tensors(&m->cfg);
    DitTensorInfo *info = malloc(n * sizeof(DitTensorInfo));
    int rc = -1;
    if (!info) {
        dit_set_error(err, "%s: out of memory", path);
        goto done;
    }
    if (read_config(f, path, &cfg, err) != 0) goto done;
    if (memcmp(&cfg, &m->cfg, sizeof(cfg)) != 0) {
        dit_set_error(err, "%s: the checkpoint's model config (depth %d, hidden %d, heads %d, patch %d, "
                      "image_size %d, channels %d, num_classes %d) differs from the model's", path,
                      cfg.depth, cfg.hidden, cfg.heads, cfg.patch, cfg.image_size, cfg.channels, cfg.num_classes);
        goto done;
    }
    dit_tensor_infos(&m->cfg, info);
    const char *prefixes[] = {"", "ema.", "adam_m.", "adam_v."};
    float *buffers[] = {m->params_memory, m->ema_memory, m->adam_m_memory, m->adam_v_memory};
    for (int b = 0; b < 4; b++)
        for (int i = 0; i < n; i++) {
            char name[NAME_LEN];
            snprintf(name, sizeof(name), "%s%s", prefixes[b], info[i].name);
            if (st_read_f32(f, name, buffers[b] + info[i].offset, info[i].shape, info[i].ndim, err) != 0)
                goto done;
        }
    uint64_t step;
    if (read_meta_u64(f, path, "step", INT64_MAX, &step, err) != 0 ||
        read_meta_u64(f, path, "rng_state", UINT64_MAX, &s->rng_state, err) != 0 ||
        read_meta_u64(f, path, "data_epoch", UINT64_MAX, &s->data_epoch, err) != 0 ||
        read_meta_u64(f, path, "data_index", UINT64_MAX, &s->data_index, err) != 0 ||
        read_meta_u64(f, path, "data_rng_state", UINT64_MAX, &s->data_rng_state, err) != 0)
        goto done;
    s->step = (int64_t)step;
    rc = 0;
done:
    free(info);
    st_close(f);
    return rc;
}
