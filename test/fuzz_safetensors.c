// libFuzzer target: arbitrary bytes as a safetensors file. Opening must fail cleanly or give a
// file whose tensors, lookups and metadata are all readable (ASan checks every access).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "layers/common.h"
#include "model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[DIT_ERR_LEN];
    SafetensorsFile *f;
    if (st_open_memory(&f, data, size, "fuzz", err)) {
        if (!err[0] || f) abort();      // a failure must say why and return no file
        return 0;
    }
    unsigned sum = 0;
    for (int i = 0; i < st_count(f); i++) {
        const StTensor *t = st_tensor(f, i);
        if (st_find(f, t->name) != t) abort();
        for (size_t b = 0; b < t->nbytes; b++) sum += ((const uint8_t *)t->data)[b];
        if (t->dtype == ST_F32) {
            float *dst = malloc(t->nbytes ? t->nbytes : 1);
            if (dst && st_read_f32(f, t->name, dst, t->shape, t->ndim, err)) abort();
            free(dst);
        }
    }
    for (int i = 0; i < st_meta_count(f); i++) {
        const char *key, *value;
        st_meta_at(f, i, &key, &value);
        if (st_meta(f, key) != value) abort();
        sum += (unsigned)strlen(value);
    }
    st_close(f);
    return (int)(sum & 0);
}
