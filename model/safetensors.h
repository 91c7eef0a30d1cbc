// Safetensors files (https://github.com/huggingface/safetensors): checkpoints and debug dumps.
//
// Layout: u64 little-endian N | N bytes of JSON header | data buffer.
// Header: {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..],
//          "data_offsets": [begin, end]}, ...}; offsets are relative to the data buffer;
// tensors are contiguous, little-endian, row-major.
//
// The writer pads the header with spaces so the data buffer starts 8-byte aligned and orders
// tensors by dtype size (largest first, then in the order added), so every tensor is aligned
// to its dtype, as safetensors itself does. Files load with safetensors.torch.load_file.
//
// The reader is strict, like the reference implementation: the tensors must tile the data
// buffer exactly (no overlap, no gap, no trailing bytes), and every header problem (bad JSON,
// wrong types, unknown dtype, shape/size mismatch, duplicates, ...) is an error naming the
// file and the tensor or field, never a crash.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { ST_F64, ST_F32, ST_F16, ST_BF16, ST_I64, ST_I32, ST_I8, ST_U8, ST_NUM_DTYPES } StDtype;
#define ST_MAX_DIMS 8
#define ST_MAX_HEADER_BYTES (100u * 1000u * 1000u)

const char *st_dtype_name(StDtype dtype);   // "F32", ...; "?" for an invalid value
size_t st_dtype_size(StDtype dtype);        // bytes per element; 0 for an invalid value

typedef struct {
    const char *name;
    StDtype dtype;
    int ndim;                        // 0 for a scalar
    int64_t shape[ST_MAX_DIMS];
    size_t nbytes;                   // elements × dtype size
    const void *data;                // inside the file's buffer; may be unaligned: memcpy it
} StTensor;

// ---- writer ------------------------------------------------------------------
// Tensor data is referenced, not copied, until st_writer_save; names, shapes and metadata are
// copied. st_writer_add and st_writer_meta return 0 / -1; the first failure is remembered and
// st_writer_save then fails with its message, so call sites may ignore their results.
typedef struct SafetensorsWriter SafetensorsWriter;
SafetensorsWriter *st_writer_new(void);    // NULL when out of memory
int st_writer_add(SafetensorsWriter *w, const char *name, StDtype dtype,
                  const int64_t *shape, int ndim, const void *data);
int st_writer_meta(SafetensorsWriter *w, const char *key, const char *value);
// Writes "<path>.tmp", flushes it to disk and renames it to path.
int st_writer_save(const SafetensorsWriter *w, const char *path, char *err);
void st_writer_free(SafetensorsWriter *w);

// ---- reader ------------------------------------------------------------------
typedef struct SafetensorsFile SafetensorsFile;
// Reads the whole file and validates it; *f is NULL on failure.
int st_open(SafetensorsFile **f, const char *path, char *err);
// The same from bytes in memory (copied); `name` stands for the file in error messages.
int st_open_memory(SafetensorsFile **f, const void *bytes, size_t size, const char *name, char *err);
void st_close(SafetensorsFile *f);

int st_count(const SafetensorsFile *f);                          // number of tensors
const StTensor *st_tensor(const SafetensorsFile *f, int i);      // in file order of offsets
const StTensor *st_find(const SafetensorsFile *f, const char *name);  // NULL when absent
// Copies tensor `name` into dst after checking that it is F32 with shape
// expect_shape[0..expect_ndim) (expect_shape may be NULL for a scalar).
int st_read_f32(const SafetensorsFile *f, const char *name, float *dst,
                const int64_t *expect_shape, int expect_ndim, char *err);

const char *st_meta(const SafetensorsFile *f, const char *key);  // NULL when absent
int st_meta_count(const SafetensorsFile *f);
void st_meta_at(const SafetensorsFile *f, int i, const char **key, const char **value);  // sorted by key

#ifdef __cplusplus
}
#endif
