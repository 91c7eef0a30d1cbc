// Safetensors reader and writer: round trips, malformed files, truncation and byte-flip sweeps,
// and interchange with independent Python code (a hand-built writer, a json+numpy reader).
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include "layers/common.h"
#include "model/safetensors.h"

#define PYTHON "/usr/bin/python3"

// A fresh scratch directory per test (tests run in parallel processes).
static void scratch_dir(char dir[64]) {
    snprintf(dir, 64, "/tmp/ditc_st_XXXXXX");
    cr_assert_not_null(mkdtemp(dir), "mkdtemp failed");
}

static void join(char out[256], const char *dir, const char *leaf) { snprintf(out, 256, "%s/%s", dir, leaf); }

static void write_file(const char *path, const void *bytes, size_t n) {
    FILE *fp = fopen(path, "wb");
    cr_assert_not_null(fp, "cannot create %s", path);
    cr_assert_eq(fwrite(bytes, 1, n, fp), n);
    fclose(fp);
}

// The whole file into a malloc'd buffer; *n its size.
static unsigned char *read_whole(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    cr_assert_not_null(fp, "cannot open %s", path);
    fseek(fp, 0, SEEK_END);
    *n = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    unsigned char *bytes = malloc(*n + 1);
    cr_assert_eq(fread(bytes, 1, *n, fp), *n);
    fclose(fp);
    return bytes;
}

// u64 length of header | header | data_len zero bytes, into a malloc'd buffer.
static unsigned char *raw_file(const char *header, size_t data_len, size_t *n) {
    uint64_t len = strlen(header);
    *n = 8 + len + data_len;
    unsigned char *bytes = calloc(1, *n);
    memcpy(bytes, &len, 8);
    memcpy(bytes + 8, header, len);
    return bytes;
}

static int python_available(void) { return access(PYTHON, X_OK) == 0; }

// ---- round trip ----------------------------------------------------------------
Test(safetensors, round_trip_dtypes_shapes_metadata_bit_exact) {
    char dir[64], path[256], err[DIT_ERR_LEN] = "";
    scratch_dir(dir);
    join(path, dir, "model.safetensors");

    float f32[2 * 3];        for (int i = 0; i < 6; i++) f32[i] = (float)i * 0.37f - 1.0f;
    f32[5] = -0.0f;
    double f64[3] = {1e-300, -2.5, 3.141592653589793};
    uint16_t f16[4] = {0x3C00, 0xB800, 0x7C00, 0x7E01};       // 1, -0.5, inf, a NaN payload
    uint16_t bf16[2 * 2 * 2] = {0x3F80, 0xC000, 0x0001, 0x7F80, 0xFF81, 0x4049, 0x0000, 0x8000};
    int32_t i32[2 * 2] = {INT32_MIN, -1, 0, INT32_MAX};
    int64_t i64[1] = {INT64_MIN + 7};
    uint8_t u8[5] = {0, 1, 127, 128, 255};                    // odd size: later tensors stay aligned
    int8_t i8[3] = {-128, 0, 127};
    float scalar = 42.5f;
    float eight_dims[2 * 1 * 2 * 1 * 1 * 2 * 1 * 2]; for (int i = 0; i < 16; i++) eight_dims[i] = (float)(i * i);
    int64_t s23[] = {2, 3}, s3[] = {3}, s4[] = {4}, s222[] = {2, 2, 2}, s22[] = {2, 2}, s1[] = {1}, s5[] = {5};
    int64_t s8[] = {2, 1, 2, 1, 1, 2, 1, 2};

    SafetensorsWriter *w = st_writer_new();
    cr_assert_not_null(w);
    st_writer_add(w, "u8", ST_U8, s5, 1, u8);                 // added first, written late (size 1)
    st_writer_add(w, "blocks.0.attn.qkv.weight", ST_F32, s23, 2, f32);
    st_writer_add(w, "f64", ST_F64, s3, 1, f64);
    st_writer_add(w, "f16", ST_F16, s4, 1, f16);
    st_writer_add(w, "bf16", ST_BF16, s222, 3, bf16);
    st_writer_add(w, "i32", ST_I32, s22, 2, i32);
    st_writer_add(w, "i64", ST_I64, s1, 1, i64);
    st_writer_add(w, "i8", ST_I8, s3, 1, i8);
    st_writer_add(w, "scalar", ST_F32, NULL, 0, &scalar);
    st_writer_add(w, "eight_dims", ST_F32, s8, 8, eight_dims);
    st_writer_meta(w, "step", "100");
    st_writer_meta(w, "escapes", "quote\" backslash\\ newline\n tab\t bell\x07 \xc3\xa9 \xf0\x9f\x98\x80");
    st_writer_meta(w, "empty", "");
    cr_assert_eq(st_writer_save(w, path, err), 0, "save: %s", err);
    st_writer_free(w);

    char tmp[300];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    cr_assert_neq(access(tmp, F_OK), 0, "%s left behind", tmp);

    size_t size;
    unsigned char *raw = read_whole(path, &size);
    uint64_t header_len;
    memcpy(&header_len, raw, 8);
    cr_assert_eq((8 + header_len) % 8, 0, "data buffer must start 8-byte aligned, header is %llu bytes",
                 (unsigned long long)header_len);
    free(raw);

    SafetensorsFile *f;
    cr_assert_eq(st_open(&f, path, err), 0, "open: %s", err);
    cr_assert_eq(st_count(f), 10);
    struct { const char *name; StDtype dtype; const int64_t *shape; int ndim; const void *data; size_t nbytes; } want[] = {
        {"u8", ST_U8, s5, 1, u8, sizeof(u8)},
        {"blocks.0.attn.qkv.weight", ST_F32, s23, 2, f32, sizeof(f32)},
        {"f64", ST_F64, s3, 1, f64, sizeof(f64)},
        {"f16", ST_F16, s4, 1, f16, sizeof(f16)},
        {"bf16", ST_BF16, s222, 3, bf16, sizeof(bf16)},
        {"i32", ST_I32, s22, 2, i32, sizeof(i32)},
        {"i64", ST_I64, s1, 1, i64, sizeof(i64)},
        {"i8", ST_I8, s3, 1, i8, sizeof(i8)},
        {"scalar", ST_F32, NULL, 0, &scalar, sizeof(scalar)},
        {"eight_dims", ST_F32, s8, 8, eight_dims, sizeof(eight_dims)},
    };
    const unsigned char *base = st_tensor(f, 0)->data;       // the first tensor in offset order starts the buffer
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        const StTensor *t = st_find(f, want[i].name);
        cr_assert_not_null(t, "tensor %s missing", want[i].name);
        cr_assert_str_eq(t->name, want[i].name);
        cr_assert_eq(t->dtype, want[i].dtype, "%s dtype", want[i].name);
        cr_assert_eq(t->ndim, want[i].ndim, "%s ndim", want[i].name);
        for (int d = 0; d < t->ndim; d++) cr_assert_eq(t->shape[d], want[i].shape[d], "%s shape[%d]", want[i].name, d);
        cr_assert_eq(t->nbytes, want[i].nbytes, "%s nbytes", want[i].name);
        cr_assert_eq(memcmp(t->data, want[i].data, t->nbytes), 0, "%s bytes differ", want[i].name);
        size_t offset = (size_t)((const unsigned char *)t->data - base);
        cr_assert_eq(offset % st_dtype_size(t->dtype), 0, "%s at offset %zu is not aligned", t->name, offset);
    }
    cr_assert_null(st_find(f, "missing"));
    cr_assert_null(st_find(f, "blocks.0.attn.qkv"));

    float back[6];
    cr_assert_eq(st_read_f32(f, "blocks.0.attn.qkv.weight", back, s23, 2, err), 0, "%s", err);
    cr_assert_eq(memcmp(back, f32, sizeof(f32)), 0);
    float back_scalar = 0;
    cr_assert_eq(st_read_f32(f, "scalar", &back_scalar, NULL, 0, err), 0, "%s", err);
    cr_assert_eq(back_scalar, 42.5f);

    cr_assert_eq(st_meta_count(f), 3);
    cr_assert_str_eq(st_meta(f, "step"), "100");
    cr_assert_str_eq(st_meta(f, "escapes"), "quote\" backslash\\ newline\n tab\t bell\x07 \xc3\xa9 \xf0\x9f\x98\x80");
    cr_assert_str_eq(st_meta(f, "empty"), "");
    cr_assert_null(st_meta(f, "absent"));
    const char *key, *value;
    st_meta_at(f, 0, &key, &value);
    cr_assert_str_eq(key, "empty");
    st_meta_at(f, 2, &key, &value);
    cr_assert_str_eq(key, "step");
    cr_assert_str_eq(value, "100");
    st_close(f);
    remove(path); rmdir(dir);
}

Test(safetensors, zero_size_tensors) {
    char dir[64], path[256], err[DIT_ERR_LEN] = "";
    scratch_dir(dir);
    join(path, dir, "empty.safetensors");
    float one = 7.0f;
    int64_t s0[] = {0}, s302[] = {3, 0, 2}, s1[] = {1};
    SafetensorsWriter *w = st_writer_new();
    st_writer_add(w, "empty_a", ST_F32, s0, 1, NULL);
    st_writer_add(w, "one", ST_F32, s1, 1, &one);
    st_writer_add(w, "empty_b", ST_I64, s302, 3, NULL);
    cr_assert_eq(st_writer_save(w, path, err), 0, "%s", err);
    st_writer_free(w);

    SafetensorsFile *f;
    cr_assert_eq(st_open(&f, path, err), 0, "%s", err);
    cr_assert_eq(st_count(f), 3);
    const StTensor *a = st_find(f, "empty_a"), *b = st_find(f, "empty_b");
    cr_assert(a && b);
    cr_assert_eq(a->nbytes, 0);
    cr_assert_eq(b->nbytes, 0);
    cr_assert_eq(b->ndim, 3);
    cr_assert_eq(b->shape[0], 3); cr_assert_eq(b->shape[1], 0); cr_assert_eq(b->shape[2], 2);
    float dummy = 123.0f, back = 0;
    cr_assert_eq(st_read_f32(f, "empty_a", &dummy, s0, 1, err), 0, "%s", err);
    cr_assert_eq(dummy, 123.0f, "a zero-size read must not write");
    cr_assert_eq(st_read_f32(f, "one", &back, s1, 1, err), 0, "%s", err);
    cr_assert_eq(back, 7.0f);
    st_close(f);

    // a file with no tensors at all, header padded with spaces
    size_t n;
    unsigned char *bytes = raw_file("{}      ", 0, &n);
    cr_assert_eq(st_open_memory(&f, bytes, n, "nothing", err), 0, "%s", err);
    cr_assert_eq(st_count(f), 0);
    cr_assert_eq(st_meta_count(f), 0);
    cr_assert_null(st_find(f, "x"));
    cr_assert_null(st_meta(f, "x"));
    st_close(f);
    free(bytes);
    remove(path); rmdir(dir);
}

Test(safetensors, escaped_names_decode_to_utf8) {
    char err[DIT_ERR_LEN] = "";
    const char *header = "{\"a\\u00e9\\ud83d\\ude00\\/\\\"\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
                         "\"__metadata__\":{\"k\\n\":\"v\\t\\u0041\"}}";
    size_t n;
    unsigned char *bytes = raw_file(header, 2, &n);
    bytes[n - 2] = 9; bytes[n - 1] = 250;
    SafetensorsFile *f;
    cr_assert_eq(st_open_memory(&f, bytes, n, "escapes", err), 0, "%s", err);
    const StTensor *t = st_find(f, "a\xc3\xa9\xf0\x9f\x98\x80/\"");
    cr_assert_not_null(t);
    cr_assert_eq(((const uint8_t *)t->data)[0], 9);
    cr_assert_eq(((const uint8_t *)t->data)[1], 250);
    cr_assert_str_eq(st_meta(f, "k\n"), "v\tA");
    st_close(f);
    free(bytes);
}

// ---- st_read_f32 errors ------------------------------------------------------------
Test(safetensors, read_f32_reports_dtype_shape_and_missing) {
    char dir[64], path[256], err[DIT_ERR_LEN] = "";
    scratch_dir(dir);
    join(path, dir, "ckpt.safetensors");
    float x[6] = {0};
    uint16_t h[6] = {0};
    int64_t s23[] = {2, 3}, s32[] = {3, 2}, s6[] = {6};
    SafetensorsWriter *w = st_writer_new();
    st_writer_add(w, "x", ST_F32, s23, 2, x);
    st_writer_add(w, "h", ST_F16, s23, 2, h);
    cr_assert_eq(st_writer_save(w, path, err), 0, "%s", err);
    st_writer_free(w);
    SafetensorsFile *f;
    cr_assert_eq(st_open(&f, path, err), 0, "%s", err);
    float dst[6];

    cr_assert_eq(st_read_f32(f, "x", dst, s32, 2, err), -1);
    cr_assert(strstr(err, path) && strstr(err, "\"x\"") && strstr(err, "shape [2, 3]") && strstr(err, "expected [3, 2]"),
              "message: %s", err);
    cr_assert_eq(st_read_f32(f, "x", dst, s6, 1, err), -1);
    cr_assert(strstr(err, "expected [6]"), "message: %s", err);
    cr_assert_eq(st_read_f32(f, "h", dst, s23, 2, err), -1);
    cr_assert(strstr(err, "\"h\"") && strstr(err, "dtype F16") && strstr(err, "expected F32"), "message: %s", err);
    cr_assert_eq(st_read_f32(f, "nope", dst, s23, 2, err), -1);
    cr_assert(strstr(err, path) && strstr(err, "\"nope\" not found"), "message: %s", err);
    st_close(f);
    remove(path); rmdir(dir);
}

// ---- writer errors ----------------------------------------------------------------
Test(safetensors, writer_rejects_bad_input_and_leaves_no_file) {
    char dir[64], path[256], err[DIT_ERR_LEN] = "";
    scratch_dir(dir);
    join(path, dir, "bad.safetensors");
    float x[4] = {0};
    int64_t s4[] = {4}, neg[] = {-2}, s9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    struct { const char *name; StDtype dtype; const int64_t *shape; int ndim; const void *data; const char *words; } cases[] = {
        {"__metadata__", ST_F32, s4, 1, x, "__metadata__"},
        {"", ST_F32, s4, 1, x, "non-empty"},
        {"bad\xff", ST_F32, s4, 1, x, "UTF-8"},
        {"neg", ST_F32, neg, 1, x, "shape[0] = -2 is negative"},
        {"nine", ST_F32, s9, 9, x, "ndim 9"},
        {"nodata", ST_F32, s4, 1, NULL, "NULL data"},
        {"dtype", (StDtype)99, s4, 1, x, "invalid dtype"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        SafetensorsWriter *w = st_writer_new();
        cr_assert_eq(st_writer_add(w, "ok", ST_F32, s4, 1, x), 0);
        cr_expect_eq(st_writer_add(w, cases[i].name, cases[i].dtype, cases[i].shape, cases[i].ndim, cases[i].data), -1,
                     "case %zu accepted", i);
        st_writer_add(w, "ok2", ST_F32, s4, 1, x);
        cr_expect_eq(st_writer_save(w, path, err), -1, "case %zu saved", i);
        cr_expect(strstr(err, path) && strstr(err, cases[i].words), "case %zu: message: %s", i, err);
        st_writer_free(w);
        cr_expect_neq(access(path, F_OK), 0, "case %zu left %s", i, path);
    }

    SafetensorsWriter *w = st_writer_new();
    st_writer_add(w, "same", ST_F32, s4, 1, x);
    st_writer_add(w, "same", ST_F32, s4, 1, x);
    cr_assert_eq(st_writer_save(w, path, err), -1);
    cr_assert(strstr(err, "duplicate tensor name \"same\""), "message: %s", err);
    st_writer_free(w);

    w = st_writer_new();
    cr_assert_eq(st_writer_meta(w, "step", "1"), 0);
    cr_assert_eq(st_writer_meta(w, "step", "2"), -1);
    cr_assert_eq(st_writer_save(w, path, err), -1);
    cr_assert(strstr(err, "duplicate key \"step\""), "message: %s", err);
    st_writer_free(w);

    char nodir[256];
    join(nodir, dir, "no/such/dir/x.safetensors");
    w = st_writer_new();
    st_writer_add(w, "ok", ST_F32, s4, 1, x);
    cr_assert_eq(st_writer_save(w, nodir, err), -1);
    cr_assert(strstr(err, "x.safetensors.tmp") && strstr(err, "cannot create"), "message: %s", err);
    st_writer_free(w);
    cr_assert_eq(st_writer_save(NULL, path, err), -1);
    rmdir(dir);
}

// ---- malformed files ----------------------------------------------------------------
Test(safetensors, file_level_errors) {
    char dir[64], path[256], err[DIT_ERR_LEN] = "";
    SafetensorsFile *f = (SafetensorsFile *)1;
    scratch_dir(dir);
    join(path, dir, "x.safetensors");

    cr_assert_eq(st_open(&f, path, err), -1);
    cr_assert_null(f);
    cr_assert(strstr(err, path) && strstr(err, "cannot open"), "message: %s", err);

    cr_assert_eq(st_open(&f, dir, err), -1);
    cr_assert(strstr(err, "not a regular file"), "message: %s", err);

    write_file(path, "\x02\0\0\0\0", 5);
    cr_assert_eq(st_open(&f, path, err), -1);
    cr_assert(strstr(err, path) && strstr(err, "5 bytes, shorter than the 8-byte header"), "message: %s", err);

    unsigned char longer[8 + 4] = {100, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' '};
    write_file(path, longer, sizeof(longer));
    cr_assert_eq(st_open(&f, path, err), -1);
    cr_assert(strstr(err, "header length 100 is larger than the 4 bytes"), "message: %s", err);

    unsigned char huge[8 + 2] = {0, 0, 0, 0, 0, 0, 0, 0x80, '{', '}'};
    write_file(path, huge, sizeof(huge));
    cr_assert_eq(st_open(&f, path, err), -1);
    cr_assert(strstr(err, "header length") && strstr(err, "exceeds the limit"), "message: %s", err);

    uint64_t just_over = ST_MAX_HEADER_BYTES + 1ull;
    memcpy(huge, &just_over, 8);
    write_file(path, huge, sizeof(huge));
    cr_assert_eq(st_open(&f, path, err), -1);
    cr_assert(strstr(err, "exceeds the limit"), "message: %s", err);
    remove(path); rmdir(dir);
}

typedef struct { const char *header; size_t data_len; const char *words[3]; } BadHeader;

static const BadHeader BAD_HEADERS[] = {
    // not JSON / not an object
    {"", 0, {"not valid JSON", "unexpected end"}},
    {"[1,2]", 0, {"not a JSON object", "an array"}},
    {"\"x\"", 0, {"not a JSON object", "a string"}},
    {"{\"a\":", 0, {"not valid JSON", "unexpected end"}},
    {"{} x", 0, {"trailing characters"}},
    {"{'a':1}", 0, {"expected a string key"}},
    {"{\"a\":1,}", 0, {"expected a string key"}},
    {"{\"a\" 1}", 0, {"expected ':'"}},
    {"{\"a\":[1 2]}", 0, {"expected ',' or ']'"}},
    {"{\"a\":{}  \"b\":{}}", 0, {"expected ',' or '}'"}},
    {"{\"a\":nul}", 0, {"unexpected character"}},
    {"{\"a", 0, {"unterminated string"}},
    {"{\"a\\x\":1}", 0, {"unknown escape"}},
    {"{\"a\\u12\":1}", 0, {"bad hex digit"}},
    {"{\"\\ud800\":1}", 0, {"high surrogate"}},
    {"{\"\\ud800\\u0041\":1}", 0, {"low surrogate"}},
    {"{\"\\udc00\":1}", 0, {"lone low surrogate"}},
    {"{\"\\u0000\":1}", 0, {"\\u0000"}},
    {"{\"a\nb\":1}", 0, {"control character"}},
    {"{\"a\xff\":1}", 0, {"invalid UTF-8"}},
    {"{\"a\xc0\xaf\":1}", 0, {"invalid UTF-8"}},         // overlong '/'
    {"{\"a\xed\xa0\x80\":1}", 0, {"invalid UTF-8"}},     // encoded surrogate
    {"{\"a\":01}", 0, {"leading zero"}},
    {"{\"a\":1.}", 0, {"bad fraction"}},
    {"{\"a\":1e}", 0, {"bad exponent"}},
    {"{\"a\":-}", 0, {"bad number"}},
    {"{\"a\":99999999999999999999}", 0, {"out of the int64 range"}},
    {"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]", 0,
     {"nested too deeply"}},
    // tensor entries
    {"{\"a\":[1]}", 0, {"\"a\"", "entry must be an object", "an array"}},
    {"{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, {"\"a\"", "missing \"dtype\""}},
    {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, {"\"a\"", "missing \"shape\""}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, {"\"a\"", "missing \"data_offsets\""}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"offsets\":1}}", 8, {"\"a\"", "unknown field \"offsets\""}},
    {"{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, {"\"a\"", "duplicate field \"dtype\""}},
    {"{\"a\":{\"dtype\":5,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, {"\"a\"", "dtype must be a string", "an integer"}},
    {"{\"a\":{\"dtype\":\"F8\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, {"\"a\"", "unsupported dtype \"F8\""}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,8]}}", 8, {"\"a\"", "shape must be an array", "a string"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8, {"\"a\"", "shape[0] must be an integer", "a float"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,true],\"data_offsets\":[0,8]}}", 8, {"shape[1] must be an integer", "a boolean"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[null],\"data_offsets\":[0,8]}}", 8, {"shape[0] must be an integer", "null"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,-1],\"data_offsets\":[0,8]}}", 8, {"\"a\"", "shape[1] = -1 is negative"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}", 8, {"\"a\"", "shape has 9 entries", "at most 8"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4611686018427387904],\"data_offsets\":[0,8]}}", 8,
     {"\"a\"", "overflows"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1099511627776],\"data_offsets\":[0,8]}}", 8,
     {"\"a\"", "span 8 bytes", "needs 4398046511104"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,4]}}", 8, {"\"a\"", "begin > end"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,16]}}", 8, {"\"a\"", "outside the 8-byte data buffer"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 8, {"\"a\"", "span 4 bytes", "needs 8"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, {"\"a\"", "must be [begin, end]"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4,8]}}", 8, {"\"a\"", "data_offsets has 3 entries"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-1,7]}}", 8, {"\"a\"", "data_offsets[0] = -1 is negative"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":{}}}", 8, {"\"a\"", "data_offsets must be an array", "an object"}},
    // layout of the data buffer
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
     12, {"\"a\" [0, 8)", "\"b\" [4, 12)", "overlap"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"z\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,4]}}",
     8, {"\"z\"", "overlap"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
     12, {"gap", "[4, 8)", "\"b\""}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, {"4 trailing bytes"}},
    {"{}", 3, {"3 trailing bytes"}},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
     8, {"duplicate tensor name \"a\""}},
    // metadata
    {"{\"__metadata__\":{\"step\":100}}", 0, {"__metadata__", "\"step\"", "must be a string"}},
    {"{\"__metadata__\":{\"a\":\"1\",\"b\":[]}}", 0, {"\"b\"", "must be a string", "an array"}},
    {"{\"__metadata__\":\"x\"}", 0, {"__metadata__ must be an object"}},
    {"{\"__metadata__\":null}", 0, {"__metadata__ must be an object", "null"}},
    {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, {"duplicate __metadata__ key \"k\""}},
    {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, {"duplicate __metadata__"}},
};

Test(safetensors, malformed_headers_give_clear_errors) {
    char dir[64], path[256], err[DIT_ERR_LEN];
    scratch_dir(dir);
    join(path, dir, "bad.safetensors");
    for (size_t i = 0; i < sizeof(BAD_HEADERS) / sizeof(BAD_HEADERS[0]); i++) {
        const BadHeader *b = &BAD_HEADERS[i];
        size_t n;
        unsigned char *bytes = raw_file(b->header, b->data_len, &n);
        write_file(path, bytes, n);
        free(bytes);
        SafetensorsFile *f = NULL;
        err[0] = '\0';
        int rc = st_open(&f, path, err);
        cr_expect_eq(rc, -1, "case %zu (%s) was accepted", i, b->header);
        cr_expect_null(f, "case %zu", i);
        if (rc == 0) { st_close(f); continue; }
        cr_expect(strstr(err, path) != NULL, "case %zu: message does not name the file: %s", i, err);
        for (int k = 0; k < 3 && b->words[k]; k++)
            cr_expect(strstr(err, b->words[k]) != NULL, "case %zu (%s): message lacks '%s': %s",
                      i, b->header, b->words[k], err);
    }
    remove(path); rmdir(dir);
}

// ---- robustness sweeps ------------------------------------------------------------
// A small valid file with metadata and several tensors, as bytes.
static unsigned char *small_valid_file(size_t *n) {
    char dir[64], path[256], err[DIT_ERR_LEN];
    scratch_dir(dir);
    join(path, dir, "small.safetensors");
    static const float w[6] = {1, 2, 3, 4, 5, 6};
    static const int64_t ids[2] = {-3, 1ll << 40};
    static const uint8_t bytes[3] = {1, 2, 3};
    int64_t s23[] = {2, 3}, s2[] = {2}, s3[] = {3}, s0[] = {0};
    SafetensorsWriter *wr = st_writer_new();
    st_writer_add(wr, "w", ST_F32, s23, 2, w);
    st_writer_add(wr, "ids", ST_I64, s2, 1, ids);
    st_writer_add(wr, "b\xc3\xa9", ST_U8, s3, 1, bytes);
    st_writer_add(wr, "none", ST_F16, s0, 1, NULL);
    st_writer_meta(wr, "step", "7");
    cr_assert_eq(st_writer_save(wr, path, err), 0, "%s", err);
    st_writer_free(wr);
    unsigned char *raw = read_whole(path, n);
    remove(path); rmdir(dir);
    return raw;
}

// Checks what an accepted file promises: lookups agree, sizes add up, data readable.
static void check_accepted(const SafetensorsFile *f, size_t file_size) {
    size_t total = 0;
    for (int i = 0; i < st_count(f); i++) {
        const StTensor *t = st_tensor(f, i);
        cr_assert_eq(st_find(f, t->name), t, "lookup of %s", t->name);
        size_t elems = 1;
        for (int d = 0; d < t->ndim; d++) elems *= (size_t)t->shape[d];
        cr_assert_eq(t->nbytes, elems * st_dtype_size(t->dtype));
        volatile unsigned char sink = 0;
        for (size_t b = 0; b < t->nbytes; b++) sink ^= ((const unsigned char *)t->data)[b];
        (void)sink;
        total += t->nbytes;
    }
    cr_assert_leq(total, file_size);
    for (int i = 0; i < st_meta_count(f); i++) {
        const char *key, *value;
        st_meta_at(f, i, &key, &value);
        cr_assert_eq(st_meta(f, key), value);
    }
}

Test(safetensors, every_truncation_is_an_error) {
    size_t n;
    unsigned char *bytes = small_valid_file(&n);
    char err[DIT_ERR_LEN], dir[64], path[256];
    SafetensorsFile *f;
    cr_assert_eq(st_open_memory(&f, bytes, n, "full", err), 0, "%s", err);
    check_accepted(f, n);
    st_close(f);
    scratch_dir(dir);
    join(path, dir, "cut.safetensors");
    for (size_t len = 0; len < n; len++) {
        err[0] = '\0';
        cr_assert_eq(st_open_memory(&f, bytes, len, "cut", err), -1, "truncated to %zu of %zu bytes accepted", len, n);
        cr_assert_null(f);
        cr_assert(strncmp(err, "cut: ", 5) == 0, "length %zu: message: %s", len, err);
        write_file(path, bytes, len);
        err[0] = '\0';
        cr_assert_eq(st_open(&f, path, err), -1, "file truncated to %zu bytes accepted", len);
        cr_assert(strstr(err, path), "length %zu: message: %s", len, err);
    }
    free(bytes);
    remove(path); rmdir(dir);
}

Test(safetensors, flipped_header_bytes_never_crash) {
    size_t n;
    unsigned char *bytes = small_valid_file(&n);
    uint64_t header_len;
    memcpy(&header_len, bytes, 8);
    unsigned char *copy = malloc(n);
    static const unsigned char masks[] = {0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xFF};
    int accepted = 0, rejected = 0;
    for (size_t pos = 0; pos < 8 + header_len; pos++) {
        for (size_t m = 0; m < sizeof(masks); m++) {
            memcpy(copy, bytes, n);
            copy[pos] ^= masks[m];
            char err[DIT_ERR_LEN] = "";
            SafetensorsFile *f;
            if (st_open_memory(&f, copy, n, "flip", err) == 0) {
                check_accepted(f, n);
                st_close(f);
                accepted++;
            } else {
                cr_assert(strncmp(err, "flip: ", 6) == 0, "byte %zu ^ %#x: message: %s", pos, masks[m], err);
                rejected++;
            }
        }
    }
    // random multi-byte damage of the header as well
    Rng rng;
    rng_seed(&rng, 1234);
    for (int iter = 0; iter < 20000; iter++) {
        memcpy(copy, bytes, n);
        int flips = 1 + (int)(rng_u32(&rng) % 8);
        for (int k = 0; k < flips; k++) copy[rng_u32(&rng) % (8 + header_len)] = (unsigned char)rng_u32(&rng);
        char err[DIT_ERR_LEN] = "";
        SafetensorsFile *f;
        if (st_open_memory(&f, copy, n, "rand", err) == 0) { check_accepted(f, n); st_close(f); accepted++; }
        else { cr_assert(err[0], "rejected without a message"); rejected++; }
    }
    cr_log_info("flip sweep: %d accepted (harmless changes), %d rejected", accepted, rejected);
    cr_assert_gt(rejected, 0);
    free(copy); free(bytes);
}

// ---- interchange with Python -----------------------------------------------------
// A file built by hand in Python (struct + json, the reference layout), read here.
Test(safetensors, reads_a_file_written_by_python) {
    if (!python_available()) cr_skip("no " PYTHON);
    char dir[64], path[256], script[256], cmd[800], err[DIT_ERR_LEN];
    scratch_dir(dir);
    join(path, dir, "py.safetensors");
    join(script, dir, "write.py");
    const char *py =
        "import json, struct, sys\n"
        "w = struct.pack('<6f', *[i * 0.25 - 1.0 for i in range(6)])\n"
        "h = struct.pack('<3e', 1.5, -2.0, 65504.0)\n"
        "ids = struct.pack('<2q', -5, 1 << 40)\n"
        "bf = struct.pack('<2H', 0x3F80, 0xC000)\n"
        "buf = ids + w + h + bf\n"
        "hdr = {'\\u00fcn\\u00ef': {'dtype': 'F16', 'shape': [3], 'data_offsets': [40, 46]},\n"
        "       'w': {'dtype': 'F32', 'shape': [2, 3], 'data_offsets': [16, 40]},\n"
        "       '__metadata__': {'step': '100', 'note': '\\u00e9 \"q\"'},\n"
        "       'bf': {'dtype': 'BF16', 'shape': [1, 2], 'data_offsets': [46, 50]},\n"
        "       'ids': {'dtype': 'I64', 'shape': [2], 'data_offsets': [0, 16]}}\n"
        "text = json.dumps(hdr).encode()\n"          // ensure_ascii: names arrive as \\u escapes
        "text += b' ' * (-len(text) % 8)\n"
        "open(sys.argv[1], 'wb').write(struct.pack('<Q', len(text)) + text + buf)\n";
    write_file(script, py, strlen(py));
    snprintf(cmd, sizeof(cmd), PYTHON " %s %s", script, path);
    cr_assert_eq(system(cmd), 0, "python writer failed");

    SafetensorsFile *f;
    cr_assert_eq(st_open(&f, path, err), 0, "%s", err);
    cr_assert_eq(st_count(f), 4);
    float w[6];
    int64_t s23[] = {2, 3};
    cr_assert_eq(st_read_f32(f, "w", w, s23, 2, err), 0, "%s", err);
    for (int i = 0; i < 6; i++) cr_assert_eq(w[i], i * 0.25f - 1.0f, "w[%d] = %g", i, w[i]);
    const StTensor *h = st_find(f, "\xc3\xbcn\xc3\xaf");
    cr_assert_not_null(h, "the \\u-escaped name was not decoded to UTF-8");
    cr_assert_eq(h->dtype, ST_F16);
    uint16_t hb[3];
    memcpy(hb, h->data, 6);
    cr_assert(hb[0] == 0x3E00 && hb[1] == 0xC000 && hb[2] == 0x7BFF, "f16 bits %04x %04x %04x", hb[0], hb[1], hb[2]);
    const StTensor *ids = st_find(f, "ids");
    int64_t iv[2];
    memcpy(iv, ids->data, 16);
    cr_assert(ids->dtype == ST_I64 && iv[0] == -5 && iv[1] == (1ll << 40));
    const StTensor *bf = st_find(f, "bf");
    uint16_t bb[2];
    memcpy(bb, bf->data, 4);
    cr_assert(bf->dtype == ST_BF16 && bf->ndim == 2 && bf->shape[0] == 1 && bf->shape[1] == 2 &&
              bb[0] == 0x3F80 && bb[1] == 0xC000);
    cr_assert_str_eq(st_meta(f, "step"), "100");
    cr_assert_str_eq(st_meta(f, "note"), "\xc3\xa9 \"q\"");
    st_close(f);
    remove(path); remove(script); rmdir(dir);
}

// A file written here, read by an independent json + numpy parser that checks layout and values.
Test(safetensors, python_reads_our_file) {
    if (!python_available()) cr_skip("no " PYTHON);
    char dir[64], path[256], script[256], cmd[800], err[DIT_ERR_LEN];
    scratch_dir(dir);
    join(path, dir, "ours.safetensors");
    join(script, dir, "read.py");

    float x[12];      for (int i = 0; i < 12; i++) x[i] = i * 0.5f - 2.0f;
    double y[2] = {1.0 / 3.0, -1e300};
    int32_t z[4] = {-7, 0, 7, 2147483647};
    uint8_t u[5] = {1, 2, 3, 254, 255};
    int8_t s[3] = {-128, -1, 127};
    uint16_t hf[2] = {0x3C00, 0xB800};                  // 1.0, -0.5
    uint16_t bf[3] = {0x3F80, 0x4049, 0xC000};          // raw bf16 bits
    int64_t l[1] = {-(1ll << 50)};
    int64_t s34[] = {3, 4}, s2[] = {2}, s22[] = {2, 2}, s5[] = {5}, s3[] = {3}, s13[] = {1, 3}, s1[] = {1}, s0[] = {0};
    SafetensorsWriter *w = st_writer_new();
    st_writer_add(w, "u", ST_U8, s5, 1, u);
    st_writer_add(w, "x", ST_F32, s34, 2, x);
    st_writer_add(w, "hf", ST_F16, s2, 1, hf);
    st_writer_add(w, "y", ST_F64, s2, 1, y);
    st_writer_add(w, "s", ST_I8, s3, 1, s);
    st_writer_add(w, "z", ST_I32, s22, 2, z);
    st_writer_add(w, "bf", ST_BF16, s13, 2, bf);
    st_writer_add(w, "l", ST_I64, s1, 1, l);
    st_writer_add(w, "empty", ST_F32, s0, 1, NULL);
    st_writer_meta(w, "step", "100");
    st_writer_meta(w, "text", "quote\" back\\ nl\n \xc3\xa9");
    cr_assert_eq(st_writer_save(w, path, err), 0, "%s", err);
    st_writer_free(w);

    const char *py =
        "import json, struct, sys\n"
        "try:\n"
        "    import numpy as np\n"
        "except ImportError:\n"
        "    sys.exit(77)\n"
        "raw = open(sys.argv[1], 'rb').read()\n"
        "n = struct.unpack('<Q', raw[:8])[0]\n"
        "assert (8 + n) % 8 == 0, 'header not padded to 8'\n"
        "hdr = json.loads(raw[8:8 + n].decode('utf-8'))\n"
        "buf = raw[8 + n:]\n"
        "meta = hdr.pop('__metadata__')\n"
        "assert meta == {'step': '100', 'text': 'quote\" back\\\\ nl\\n \\u00e9'}, meta\n"
        "spans = sorted(v['data_offsets'] for v in hdr.values())\n"
        "pos = 0\n"
        "for b, e in spans:\n"
        "    assert b == pos, ('gap or overlap', b, pos)\n"
        "    pos = e\n"
        "assert pos == len(buf), ('buffer not covered', pos, len(buf))\n"
        "types = {'F32': '<f4', 'F64': '<f8', 'F16': '<f2', 'BF16': '<u2', 'I32': '<i4', 'I64': '<i8', 'I8': 'i1', 'U8': 'u1'}\n"
        "def get(name):\n"
        "    t = hdr[name]\n"
        "    b, e = t['data_offsets']\n"
        "    a = np.frombuffer(buf[b:e], dtype=types[t['dtype']]).reshape(t['shape'])\n"
        "    assert b % a.itemsize == 0, (name, 'misaligned')\n"
        "    return t['dtype'], a\n"
        "want = {\n"
        "    'x': ('F32', np.arange(12, dtype=np.float32).reshape(3, 4) * np.float32(0.5) - np.float32(2)),\n"
        "    'y': ('F64', np.array([1.0 / 3.0, -1e300])),\n"
        "    'z': ('I32', np.array([[-7, 0], [7, 2147483647]], dtype=np.int32)),\n"
        "    'u': ('U8', np.array([1, 2, 3, 254, 255], dtype=np.uint8)),\n"
        "    's': ('I8', np.array([-128, -1, 127], dtype=np.int8)),\n"
        "    'hf': ('F16', np.array([1.0, -0.5], dtype=np.float16)),\n"
        "    'bf': ('BF16', np.array([[0x3F80, 0x4049, 0xC000]], dtype=np.uint16)),\n"
        "    'l': ('I64', np.array([-(1 << 50)], dtype=np.int64)),\n"
        "    'empty': ('F32', np.zeros((0,), dtype=np.float32)),\n"
        "}\n"
        "assert sorted(hdr) == sorted(want), sorted(hdr)\n"
        "for name, (dtype, ref) in want.items():\n"
        "    got_dtype, got = get(name)\n"
        "    assert got_dtype == dtype, (name, got_dtype)\n"
        "    assert got.shape == ref.shape, (name, got.shape, ref.shape)\n"
        "    assert got.tobytes() == ref.astype(got.dtype).tobytes(), (name, got, ref)\n"
        "print('python reader: ok')\n";
    write_file(script, py, strlen(py));
    snprintf(cmd, sizeof(cmd), PYTHON " %s %s", script, path);
    int status = system(cmd);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) cr_skip("numpy is not installed");
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the python reader rejected our file (status %d)", status);
    remove(path); remove(script); rmdir(dir);
}
