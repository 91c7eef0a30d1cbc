// Safetensors reader and writer, with a small strict JSON parser for the header.
#include "model/safetensors.h"
#include "layers/common.h"
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c reads and writes tensors in host byte order, which must be little-endian"
#endif

static const struct { const char *name; size_t size; } DTYPES[ST_NUM_DTYPES] = {
    [ST_F64] = {"F64", 8}, [ST_F32] = {"F32", 4}, [ST_F16] = {"F16", 2}, [ST_BF16] = {"BF16", 2},
    [ST_I64] = {"I64", 8}, [ST_I32] = {"I32", 4}, [ST_I8] = {"I8", 1},   [ST_U8] = {"U8", 1},
};

const char *st_dtype_name(StDtype dtype) {
    return (unsigned)dtype < ST_NUM_DTYPES ? DTYPES[dtype].name : "?";
}

size_t st_dtype_size(StDtype dtype) {
    return (unsigned)dtype < ST_NUM_DTYPES ? DTYPES[dtype].size : 0;
}

// Writes "[d0, d1, ...]" into buf (truncated to n bytes).
static void format_shape(char *buf, size_t n, const int64_t *shape, int ndim) {
    size_t used = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < n) snprintf(buf + used, n - used, "]");
}

// Number of elements of shape[0..ndim) times elem_size into *nbytes; -1 on uint64 overflow.
static int shape_nbytes(const int64_t *shape, int ndim, size_t elem_size, uint64_t *nbytes) {
    uint64_t total = elem_size;
    for (int i = 0; i < ndim; i++) {
        uint64_t d = (uint64_t)shape[i];
        if (d != 0 && total > UINT64_MAX / d) {
            // a later zero dim still makes it empty
            for (int j = i + 1; j < ndim; j++) if (shape[j] == 0) { *nbytes = 0; return 0; }
            return -1;
        }
        total *= d;
    }
    *nbytes = total;
    return 0;
}

// Length of the valid UTF-8 sequence at s (avail bytes left), or 0 when it is invalid
// (overlong forms, surrogates and code points above U+10FFFF are invalid).
static size_t utf8_sequence_length(const unsigned char *s, size_t avail) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    size_t len; unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    else return 0;
    if (avail < len || s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++) if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return len;
}

static int valid_utf8(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        size_t len = utf8_sequence_length(p + i, n - i);
        if (!len) return 0;
        i += len;
    }
    return 1;
}

// ============================================================================
// JSON: a tree of nodes in one array, linked by indices. Strings are decoded into an arena
// as large as the text (a decoded string plus its NUL never outgrows its quoted source).
// Numbers without fraction or exponent are J_INT (int64); others parse as J_FLOAT with no
// value, so that the validator can say "found a float". true/false/null parse likewise.
// ============================================================================
typedef enum { J_OBJECT, J_ARRAY, J_STRING, J_INT, J_FLOAT, J_BOOL, J_NULL } JsonKind;
#define JSON_MAX_DEPTH 32

static const char *json_kind_name(JsonKind kind) {
    static const char *names[] = {"an object", "an array", "a string", "an integer",
                                  "a float", "a boolean", "null"};
    return names[kind];
}

typedef struct {
    JsonKind kind;
    int32_t first, next;     // first child and next sibling, -1 when none
    int32_t count;           // number of children
    int64_t integer;         // J_INT
    const char *str;         // J_STRING: decoded, NUL-terminated
    const char *key;         // the member name when the parent is an object
} JsonNode;

typedef struct {
    const char *text; size_t len, pos;
    JsonNode *nodes; int32_t count, cap;
    char *arena; size_t arena_used;
    const char *file; char *err;
} JsonParser;

static int json_fail(JsonParser *p, const char *what) {
    dit_set_error(p->err, "%s: header is not valid JSON: at byte %zu: %s", p->file, p->pos, what);
    return -1;
}

static void json_skip_space(JsonParser *p) {
    while (p->pos < p->len && (p->text[p->pos] == ' ' || p->text[p->pos] == '\t' ||
                               p->text[p->pos] == '\n' || p->text[p->pos] == '\r'))
        p->pos++;
}

static int32_t json_new_node(JsonParser *p, JsonKind kind) {
    if (p->count == p->cap) {
        int32_t cap = p->cap ? p->cap * 2 : 64;
        JsonNode *nodes = realloc(p->nodes, (size_t)cap * sizeof(JsonNode));
        if (!nodes) { json_fail(p, "out of memory"); return -1; }
        p->nodes = nodes; p->cap = cap;
    }
    JsonNode *node = &p->nodes[p->count];
    memset(node, 0, sizeof(*node));
    node->kind = kind; node->first = node->next = -1;
    return p->count++;
}

static int json_hex4(JsonParser *p, uint32_t *out) {
    if (p->len - p->pos < 4) return json_fail(p, "truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p->text[p->pos++];
        int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (digit < 0) return json_fail(p, "bad hex digit in \\u escape");
        v = v * 16 + (uint32_t)digit;
    }
    *out = v;
    return 0;
}

static void arena_put_utf8(JsonParser *p, uint32_t cp) {
    char *o = p->arena + p->arena_used;
    if (cp < 0x80) { o[0] = (char)cp; p->arena_used += 1; }
    else if (cp < 0x800) { o[0] = (char)(0xC0 | cp >> 6); o[1] = (char)(0x80 | (cp & 0x3F)); p->arena_used += 2; }
    else if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12); o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F)); p->arena_used += 3;
    } else {
        o[0] = (char)(0xF0 | cp >> 18); o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F)); p->arena_used += 4;
    }
}

// A string at p->pos (the opening quote), decoded into the arena. \u escapes must form valid
// code points (surrogates in pairs), raw bytes must be UTF-8, and U+0000 is refused.
static int json_string(JsonParser *p, const char **out) {
    p->pos++;
    char *start = p->arena + p->arena_used;
    for (;;) {
        if (p->pos >= p->len) return json_fail(p, "unterminated string");
        unsigned char c = (unsigned char)p->text[p->pos];
        if (c == '"') { p->pos++; break; }
        if (c < 0x20) return json_fail(p, "control character in string");
        if (c != '\\') {
            size_t n = utf8_sequence_length((const unsigned char *)p->text + p->pos, p->len - p->pos);
            if (!n) return json_fail(p, "invalid UTF-8 in string");
            memcpy(p->arena + p->arena_used, p->text + p->pos, n);
            p->arena_used += n; p->pos += n;
            continue;
        }
        if (++p->pos >= p->len) return json_fail(p, "unterminated string");
        char e = p->text[p->pos++];
        const char *simple = strchr("\"\\/bfnrt", e);
        if (e && simple) {
            p->arena[p->arena_used++] = "\"\\/\b\f\n\r\t"[simple - "\"\\/bfnrt"];
            continue;
        }
        if (e != 'u') { p->pos--; return json_fail(p, "unknown escape in string"); }
        uint32_t cp;
        if (json_hex4(p, &cp)) return -1;
        if (cp >= 0xDC00 && cp <= 0xDFFF) return json_fail(p, "lone low surrogate in \\u escape");
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            uint32_t low;
            if (p->len - p->pos < 2 || p->text[p->pos] != '\\' || p->text[p->pos + 1] != 'u')
                return json_fail(p, "high surrogate not followed by a \\u low surrogate");
            p->pos += 2;
            if (json_hex4(p, &low)) return -1;
            if (low < 0xDC00 || low > 0xDFFF) return json_fail(p, "high surrogate not followed by a low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
        }
        if (cp == 0) return json_fail(p, "\\u0000 is not allowed in strings");
        arena_put_utf8(p, cp);
    }
    p->arena[p->arena_used++] = '\0';
    *out = start;
    return 0;
}

// A number per the JSON grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
static int json_number(JsonParser *p, int32_t node) {
    int negative = p->text[p->pos] == '-';
    if (negative) p->pos++;
    if (p->pos >= p->len || p->text[p->pos] < '0' || p->text[p->pos] > '9') return json_fail(p, "bad number");
    uint64_t magnitude = 0, limit = negative ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    int overflow = 0;
    if (p->text[p->pos] == '0') {
        p->pos++;
        if (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9')
            return json_fail(p, "leading zero in number");
    } else {
        while (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9') {
            uint64_t digit = (uint64_t)(p->text[p->pos++] - '0');
            if (magnitude > (limit - digit) / 10) overflow = 1;
            else magnitude = magnitude * 10 + digit;
        }
    }
    int is_float = 0;
    if (p->pos < p->len && p->text[p->pos] == '.') {
        p->pos++; is_float = 1;
        if (p->pos >= p->len || p->text[p->pos] < '0' || p->text[p->pos] > '9') return json_fail(p, "bad fraction");
        while (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9') p->pos++;
    }
    if (p->pos < p->len && (p->text[p->pos] == 'e' || p->text[p->pos] == 'E')) {
        p->pos++; is_float = 1;
        if (p->pos < p->len && (p->text[p->pos] == '+' || p->text[p->pos] == '-')) p->pos++;
        if (p->pos >= p->len || p->text[p->pos] < '0' || p->text[p->pos] > '9') return json_fail(p, "bad exponent");
        while (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9') p->pos++;
    }
    if (is_float) { p->nodes[node].kind = J_FLOAT; return 0; }
    if (overflow) return json_fail(p, "integer out of the int64 range");
    p->nodes[node].kind = J_INT;
    p->nodes[node].integer = negative ? (int64_t)(0 - magnitude) : (int64_t)magnitude;
    return 0;
}

static int32_t json_value(JsonParser *p, int depth);

// Appends child to parent's list; `last` tracks the tail.
static void json_link(JsonParser *p, int32_t parent, int32_t *last, int32_t child) {
    if (*last < 0) p->nodes[parent].first = child; else p->nodes[*last].next = child;
    *last = child;
    p->nodes[parent].count++;
}

static int32_t json_container(JsonParser *p, int depth, int is_object) {
    if (depth >= JSON_MAX_DEPTH) { json_fail(p, "nested too deeply"); return -1; }
    char close = is_object ? '}' : ']';
    int32_t node = json_new_node(p, is_object ? J_OBJECT : J_ARRAY), last = -1;
    if (node < 0) return -1;
    p->pos++;
    json_skip_space(p);
    if (p->pos < p->len && p->text[p->pos] == close) { p->pos++; return node; }
    for (;;) {
        const char *key = NULL;
        json_skip_space(p);
        if (is_object) {
            if (p->pos >= p->len || p->text[p->pos] != '"') { json_fail(p, "expected a string key"); return -1; }
            if (json_string(p, &key)) return -1;
            json_skip_space(p);
            if (p->pos >= p->len || p->text[p->pos] != ':') { json_fail(p, "expected ':'"); return -1; }
            p->pos++;
        }
        int32_t child = json_value(p, depth + 1);
        if (child < 0) return -1;
        p->nodes[child].key = key;
        json_link(p, node, &last, child);
        json_skip_space(p);
        if (p->pos < p->len && p->text[p->pos] == ',') { p->pos++; continue; }
        if (p->pos < p->len && p->text[p->pos] == close) { p->pos++; return node; }
        json_fail(p, is_object ? "expected ',' or '}'" : "expected ',' or ']'");
        return -1;
    }
}

static int32_t json_value(JsonParser *p, int depth) {
    json_skip_space(p);
    if (p->pos >= p->len) { json_fail(p, "unexpected end"); return -1; }
    char c = p->text[p->pos];
    if (c == '{' || c == '[') return json_container(p, depth, c == '{');
    int32_t node = json_new_node(p, J_NULL);
    if (node < 0) return -1;
    if (c == '"') {
        const char *s;
        if (json_string(p, &s)) return -1;
        p->nodes[node].kind = J_STRING; p->nodes[node].str = s;
        return node;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return json_number(p, node) ? -1 : node;
    static const struct { const char *word; JsonKind kind; } literals[] = {
        {"true", J_BOOL}, {"false", J_BOOL}, {"null", J_NULL}};
    for (size_t i = 0; i < sizeof(literals) / sizeof(literals[0]); i++) {
        size_t n = strlen(literals[i].word);
        if (p->len - p->pos >= n && !memcmp(p->text + p->pos, literals[i].word, n)) {
            p->pos += n; p->nodes[node].kind = literals[i].kind;
            return node;
        }
    }
    json_fail(p, "unexpected character");
    return -1;
}

// Parses text[0..len) as one JSON value followed only by whitespace. On success the caller owns
// p->nodes and p->arena; on failure they are freed.
static int json_parse(JsonParser *p, const char *text, size_t len, const char *file, char *err) {
    memset(p, 0, sizeof(*p));
    p->text = text; p->len = len; p->file = file; p->err = err;
    p->arena = malloc(len + 1);
    if (!p->arena) { dit_set_error(err, "%s: out of memory for a %zu-byte header", file, len); return -1; }
    int32_t root = json_value(p, 0);
    if (root >= 0) {
        json_skip_space(p);
        if (p->pos == p->len) return 0;
        json_fail(p, "trailing characters after the JSON value");
    }
    free(p->nodes); free(p->arena);
    p->nodes = NULL; p->arena = NULL;
    return -1;
}

// ============================================================================
// Reader
// ============================================================================
typedef struct { const char *key, *value; } StMeta;

struct SafetensorsFile {
    char *name;                     // the path, for messages
    unsigned char *bytes; size_t size;
    char *strings;                  // the JSON arena: tensor names and metadata live here
    StTensor *tensors; int count;   // ordered by data offset
    const StTensor **by_name;       // sorted by name
    StMeta *meta; int meta_count;   // sorted by key
};

static int compare_tensor_names(const void *a, const void *b) {
    return strcmp((*(const StTensor *const *)a)->name, (*(const StTensor *const *)b)->name);
}

static int compare_meta_keys(const void *a, const void *b) {
    return strcmp(((const StMeta *)a)->key, ((const StMeta *)b)->key);
}

// The tensor's byte range in the data buffer, recovered from its data pointer.
typedef struct { uint64_t begin, end; const StTensor *tensor; } StRange;

static int compare_ranges(const void *a, const void *b) {
    const StRange *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static int read_metadata(SafetensorsFile *f, const JsonNode *nodes, int32_t meta_node, char *err) {
    const JsonNode *m = &nodes[meta_node];
    if (m->kind != J_OBJECT) {
        dit_set_error(err, "%s: header: __metadata__ must be an object of strings, found %s",
                      f->name, json_kind_name(m->kind));
        return -1;
    }
    f->meta = calloc((size_t)m->count + 1, sizeof(StMeta));
    if (!f->meta) { dit_set_error(err, "%s: out of memory for metadata", f->name); return -1; }
    for (int32_t c = m->first; c >= 0; c = nodes[c].next) {
        if (nodes[c].kind != J_STRING) {
            dit_set_error(err, "%s: header: __metadata__ value for key \"%s\" must be a string, found %s",
                          f->name, nodes[c].key, json_kind_name(nodes[c].kind));
            return -1;
        }
        f->meta[f->meta_count++] = (StMeta){nodes[c].key, nodes[c].str};
    }
    qsort(f->meta, (size_t)f->meta_count, sizeof(StMeta), compare_meta_keys);
    for (int i = 1; i < f->meta_count; i++)
        if (!strcmp(f->meta[i - 1].key, f->meta[i].key)) {
            dit_set_error(err, "%s: header: duplicate __metadata__ key \"%s\"", f->name, f->meta[i].key);
            return -1;
        }
    return 0;
}

// Reads an array node of non-negative integers into out[0..max); returns its length or -1.
static int read_int_array(const SafetensorsFile *f, const JsonNode *nodes, int32_t arr,
                          const char *tensor, const char *field, int64_t *out, int max, char *err) {
    if (nodes[arr].kind != J_ARRAY) {
        dit_set_error(err, "%s: tensor \"%s\": %s must be an array of integers, found %s",
                      f->name, tensor, field, json_kind_name(nodes[arr].kind));
        return -1;
    }
    if (nodes[arr].count > max) {
        dit_set_error(err, "%s: tensor \"%s\": %s has %d entries, at most %d allowed",
                      f->name, tensor, field, nodes[arr].count, max);
        return -1;
    }
    int n = 0;
    for (int32_t c = nodes[arr].first; c >= 0; c = nodes[c].next, n++) {
        if (nodes[c].kind != J_INT) {
            dit_set_error(err, "%s: tensor \"%s\": %s[%d] must be an integer, found %s",
                          f->name, tensor, field, n, json_kind_name(nodes[c].kind));
            return -1;
        }
        if (nodes[c].integer < 0) {
            dit_set_error(err, "%s: tensor \"%s\": %s[%d] = %lld is negative",
                          f->name, tensor, field, n, (long long)nodes[c].integer);
            return -1;
        }
        out[n] = nodes[c].integer;
    }
    return n;
}

// Fills t from the entry node; checks that its byte range lies in the data buffer.
static int read_tensor_entry(SafetensorsFile *f, const JsonNode *nodes, int32_t entry,
                             const unsigned char *data, uint64_t data_size, StTensor *t, char *err) {
    const char *name = nodes[entry].key;
    t->name = name;
    if (nodes[entry].kind != J_OBJECT) {
        dit_set_error(err, "%s: tensor \"%s\": entry must be an object with dtype, shape and data_offsets, found %s",
                      f->name, name, json_kind_name(nodes[entry].kind));
        return -1;
    }
    static const char *fields[3] = {"dtype", "shape", "data_offsets"};
    int32_t found[3] = {-1, -1, -1};
    for (int32_t c = nodes[entry].first; c >= 0; c = nodes[c].next) {
        int k = 0;
        while (k < 3 && strcmp(nodes[c].key, fields[k])) k++;
        if (k == 3) {
            dit_set_error(err, "%s: tensor \"%s\": unknown field \"%s\" (expected dtype, shape, data_offsets)",
                          f->name, name, nodes[c].key);
            return -1;
        }
        if (found[k] >= 0) {
            dit_set_error(err, "%s: tensor \"%s\": duplicate field \"%s\"", f->name, name, fields[k]);
            return -1;
        }
        found[k] = c;
    }
    for (int k = 0; k < 3; k++)
        if (found[k] < 0) {
            dit_set_error(err, "%s: tensor \"%s\": missing \"%s\"", f->name, name, fields[k]);
            return -1;
        }

    const JsonNode *dtype = &nodes[found[0]];
    if (dtype->kind != J_STRING) {
        dit_set_error(err, "%s: tensor \"%s\": dtype must be a string, found %s",
                      f->name, name, json_kind_name(dtype->kind));
        return -1;
    }
    int d = 0;
    while (d < ST_NUM_DTYPES && strcmp(dtype->str, DTYPES[d].name)) d++;
    if (d == ST_NUM_DTYPES) {
        dit_set_error(err, "%s: tensor \"%s\": unsupported dtype \"%s\" (expected F64, F32, F16, BF16, I64, I32, I8 or U8)",
                      f->name, name, dtype->str);
        return -1;
    }
    t->dtype = (StDtype)d;

    t->ndim = read_int_array(f, nodes, found[1], name, "shape", t->shape, ST_MAX_DIMS, err);
    if (t->ndim < 0) return -1;
    uint64_t nbytes;
    if (shape_nbytes(t->shape, t->ndim, DTYPES[d].size, &nbytes) || nbytes > SIZE_MAX) {
        char shape[256];
        format_shape(shape, sizeof(shape), t->shape, t->ndim);
        dit_set_error(err, "%s: tensor \"%s\": shape %s overflows the byte count", f->name, name, shape);
        return -1;
    }
    t->nbytes = (size_t)nbytes;

    int64_t offsets[2];
    int n = read_int_array(f, nodes, found[2], name, "data_offsets", offsets, 2, err);
    if (n < 0) return -1;
    if (n != 2) {
        dit_set_error(err, "%s: tensor \"%s\": data_offsets must be [begin, end], found %d entries",
                      f->name, name, n);
        return -1;
    }
    uint64_t begin = (uint64_t)offsets[0], end = (uint64_t)offsets[1];
    if (begin > end) {
        dit_set_error(err, "%s: tensor \"%s\": data_offsets [%llu, %llu] has begin > end",
                      f->name, name, (unsigned long long)begin, (unsigned long long)end);
        return -1;
    }
    if (end > data_size) {
        dit_set_error(err, "%s: tensor \"%s\": data_offsets [%llu, %llu] lie outside the %llu-byte data buffer",
                      f->name, name, (unsigned long long)begin, (unsigned long long)end,
                      (unsigned long long)data_size);
        return -1;
    }
    if (end - begin != nbytes) {
        char shape[256];
        format_shape(shape, sizeof(shape), t->shape, t->ndim);
        dit_set_error(err, "%s: tensor \"%s\": data_offsets [%llu, %llu] span %llu bytes, but %s %s needs %llu",
                      f->name, name, (unsigned long long)begin, (unsigned long long)end,
                      (unsigned long long)(end - begin), DTYPES[d].name, shape, (unsigned long long)nbytes);
        return -1;
    }
    t->data = data + begin;
    return 0;
}

// Checks that the tensors tile the data buffer exactly, then orders f->tensors by offset.
static int check_layout(SafetensorsFile *f, const unsigned char *data, uint64_t data_size, char *err) {
    StRange *ranges = malloc(((size_t)f->count + 1) * sizeof(StRange));
    StTensor *ordered = malloc(((size_t)f->count + 1) * sizeof(StTensor));
    if (!ranges || !ordered) {
        free(ranges); free(ordered);
        dit_set_error(err, "%s: out of memory for %d tensors", f->name, f->count);
        return -1;
    }
    for (int i = 0; i < f->count; i++) {
        uint64_t begin = (uint64_t)((const unsigned char *)f->tensors[i].data - data);
        ranges[i] = (StRange){begin, begin + f->tensors[i].nbytes, &f->tensors[i]};
    }
    qsort(ranges, (size_t)f->count, sizeof(StRange), compare_ranges);
    uint64_t covered = 0;
    int rc = 0;
    for (int i = 0; i < f->count && !rc; i++) {
        if (ranges[i].begin < covered) {
            dit_set_error(err, "%s: tensors \"%s\" [%llu, %llu) and \"%s\" [%llu, %llu) overlap in the data buffer",
                          f->name, ranges[i - 1].tensor->name, (unsigned long long)ranges[i - 1].begin,
                          (unsigned long long)ranges[i - 1].end, ranges[i].tensor->name,
                          (unsigned long long)ranges[i].begin, (unsigned long long)ranges[i].end);
            rc = -1;
        } else if (ranges[i].begin > covered) {
            dit_set_error(err, "%s: gap in the data buffer: bytes [%llu, %llu) before tensor \"%s\" belong to no tensor",
                          f->name, (unsigned long long)covered, (unsigned long long)ranges[i].begin,
                          ranges[i].tensor->name);
            rc = -1;
        }
        covered = ranges[i].end;
    }
    if (!rc && covered != data_size) {
        dit_set_error(err, "%s: %llu trailing bytes after the last tensor in the %llu-byte data buffer",
                      f->name, (unsigned long long)(data_size - covered), (unsigned long long)data_size);
        rc = -1;
    }
    if (!rc) {
        for (int i = 0; i < f->count; i++) ordered[i] = *ranges[i].tensor;
        free(f->tensors);
        f->tensors = ordered;
        ordered = NULL;
    }
    free(ranges); free(ordered);
    return rc;
}

// Validates f->bytes and builds the tensor and metadata tables.
static int st_parse(SafetensorsFile *f, char *err) {
    if (f->size < 8) {
        dit_set_error(err, "%s: file is %zu bytes, shorter than the 8-byte header length", f->name, f->size);
        return -1;
    }
    uint64_t header_len;
    memcpy(&header_len, f->bytes, 8);
    if (header_len > ST_MAX_HEADER_BYTES) {
        dit_set_error(err, "%s: header length %llu exceeds the limit of %u bytes",
                      f->name, (unsigned long long)header_len, ST_MAX_HEADER_BYTES);
        return -1;
    }
    if (header_len > f->size - 8) {
        dit_set_error(err, "%s: header length %llu is larger than the %zu bytes that follow it in the file",
                      f->name, (unsigned long long)header_len, f->size - 8);
        return -1;
    }
    const unsigned char *data = f->bytes + 8 + header_len;
    uint64_t data_size = f->size - 8 - header_len;

    JsonParser p;
    if (json_parse(&p, (const char *)f->bytes + 8, (size_t)header_len, f->name, err)) return -1;
    f->strings = p.arena;
    const JsonNode *nodes = p.nodes;
    int rc = 0;
    if (nodes[0].kind != J_OBJECT) {
        dit_set_error(err, "%s: header is not a JSON object (found %s)", f->name, json_kind_name(nodes[0].kind));
        rc = -1;
    }
    if (!rc) {
        f->tensors = calloc((size_t)nodes[0].count + 1, sizeof(StTensor));
        if (!f->tensors) { dit_set_error(err, "%s: out of memory for %d tensors", f->name, nodes[0].count); rc = -1; }
    }
    int32_t meta_node = -1;
    for (int32_t c = rc ? -1 : nodes[0].first; c >= 0 && !rc; c = nodes[c].next) {
        if (!strcmp(nodes[c].key, "__metadata__")) {
            if (meta_node >= 0) { dit_set_error(err, "%s: header: duplicate __metadata__", f->name); rc = -1; }
            meta_node = c;
        } else {
            rc = read_tensor_entry(f, nodes, c, data, data_size, &f->tensors[f->count++], err);
        }
    }
    if (!rc && meta_node >= 0) rc = read_metadata(f, nodes, meta_node, err);
    free(p.nodes);
    if (rc) return -1;

    f->by_name = malloc(((size_t)f->count + 1) * sizeof(StTensor *));
    if (!f->by_name) { dit_set_error(err, "%s: out of memory for %d tensors", f->name, f->count); return -1; }
    for (int i = 0; i < f->count; i++) f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, (size_t)f->count, sizeof(StTensor *), compare_tensor_names);
    for (int i = 1; i < f->count; i++)
        if (!strcmp(f->by_name[i - 1]->name, f->by_name[i]->name)) {
            dit_set_error(err, "%s: duplicate tensor name \"%s\"", f->name, f->by_name[i]->name);
            return -1;
        }
    if (check_layout(f, data, data_size, err)) return -1;
    // check_layout reordered f->tensors: sort the name index again
    for (int i = 0; i < f->count; i++) f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, (size_t)f->count, sizeof(StTensor *), compare_tensor_names);
    return 0;
}

// A file struct that owns `bytes` (freed on failure); parses it.
static int st_open_owned(SafetensorsFile **out, unsigned char *bytes, size_t size, const char *name, char *err) {
    *out = NULL;
    SafetensorsFile *f = calloc(1, sizeof(*f));
    char *name_copy = strdup(name ? name : "(memory)");
    if (!f || !name_copy) {
        free(f); free(name_copy); free(bytes);
        dit_set_error(err, "%s: out of memory", name ? name : "(memory)");
        return -1;
    }
    f->name = name_copy; f->bytes = bytes; f->size = size;
    if (st_parse(f, err)) { st_close(f); return -1; }
    *out = f;
    return 0;
}

int st_open_memory(SafetensorsFile **f, const void *bytes, size_t size, const char *name, char *err) {
    unsigned char *copy = malloc(size ? size : 1);
    if (!copy) {
        *f = NULL;
        dit_set_error(err, "%s: out of memory for %zu bytes", name ? name : "(memory)", size);
        return -1;
    }
    if (size) memcpy(copy, bytes, size);
    return st_open_owned(f, copy, size, name, err);
}

int st_open(SafetensorsFile **f, const char *path, char *err) {
    *f = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) { dit_set_error(err, "%s: cannot open: %s", path, strerror(errno)); return -1; }
    struct stat st;
    if (fstat(fileno(fp), &st) || !S_ISREG(st.st_mode)) {
        dit_set_error(err, "%s: not a regular file", path);
        fclose(fp);
        return -1;
    }
    size_t size = (size_t)st.st_size;
    unsigned char *bytes = malloc(size ? size : 1);
    if (!bytes) {
        dit_set_error(err, "%s: out of memory for %zu bytes", path, size);
        fclose(fp);
        return -1;
    }
    size_t got = fread(bytes, 1, size, fp);
    int read_error = ferror(fp);
    fclose(fp);
    if (got != size) {
        dit_set_error(err, "%s: read %zu of %zu bytes%s", path, got, size, read_error ? ": read error" : "");
        free(bytes);
        return -1;
    }
    return st_open_owned(f, bytes, size, path, err);
}

void st_close(SafetensorsFile *f) {
    if (!f) return;
    free(f->name); free(f->bytes); free(f->strings);
    free(f->tensors); free(f->by_name); free(f->meta);
    free(f);
}

int st_count(const SafetensorsFile *f) { return f->count; }

const StTensor *st_tensor(const SafetensorsFile *f, int i) {
    return i >= 0 && i < f->count ? &f->tensors[i] : NULL;
}

const StTensor *st_find(const SafetensorsFile *f, const char *name) {
    int lo = 0, hi = f->count - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(name, f->by_name[mid]->name);
        if (!c) return f->by_name[mid];
        if (c < 0) hi = mid - 1; else lo = mid + 1;
    }
    return NULL;
}

int st_read_f32(const SafetensorsFile *f, const char *name, float *dst,
                const int64_t *expect_shape, int expect_ndim, char *err) {
    const StTensor *t = st_find(f, name);
    if (!t) { dit_set_error(err, "%s: tensor \"%s\" not found", f->name, name); return -1; }
    if (t->dtype != ST_F32) {
        dit_set_error(err, "%s: tensor \"%s\" has dtype %s, expected F32", f->name, name, st_dtype_name(t->dtype));
        return -1;
    }
    int same = t->ndim == expect_ndim;
    for (int i = 0; same && i < expect_ndim; i++) same = t->shape[i] == expect_shape[i];
    if (!same) {
        char found[256], expected[256];
        format_shape(found, sizeof(found), t->shape, t->ndim);
        if (expect_ndim < 0 || expect_ndim > ST_MAX_DIMS || (expect_ndim && !expect_shape))
            snprintf(expected, sizeof(expected), "(invalid: %d dims)", expect_ndim);
        else
            format_shape(expected, sizeof(expected), expect_shape, expect_ndim);
        dit_set_error(err, "%s: tensor \"%s\" has shape %s, expected %s", f->name, name, found, expected);
        return -1;
    }
    if (t->nbytes) memcpy(dst, t->data, t->nbytes);
    return 0;
}

const char *st_meta(const SafetensorsFile *f, const char *key) {
    StMeta probe = {key, NULL};
    const StMeta *m = f->meta_count ? bsearch(&probe, f->meta, (size_t)f->meta_count, sizeof(StMeta), compare_meta_keys) : NULL;
    return m ? m->value : NULL;
}

int st_meta_count(const SafetensorsFile *f) { return f->meta_count; }

void st_meta_at(const SafetensorsFile *f, int i, const char **key, const char **value) {
    int ok = i >= 0 && i < f->meta_count;
    *key = ok ? f->meta[i].key : NULL;
    *value = ok ? f->meta[i].value : NULL;
}

// ============================================================================
// Writer
// ============================================================================
typedef struct {
    char *name; StDtype dtype; int ndim; int64_t shape[ST_MAX_DIMS];
    size_t nbytes; const void *data;
} StWriterTensor;

struct SafetensorsWriter {
    StWriterTensor *tensors; int count, cap;
    StMeta *meta; int meta_count, meta_cap;    // strings owned (strdup)
    char error[DIT_ERR_LEN];                   // the first failure, reported by save
};

static int writer_fail(SafetensorsWriter *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int writer_fail(SafetensorsWriter *w, const char *fmt, ...) {
    if (!w->error[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(w->error, sizeof(w->error), fmt, ap);
        va_end(ap);
    }
    return -1;
}

SafetensorsWriter *st_writer_new(void) { return calloc(1, sizeof(SafetensorsWriter)); }

void st_writer_free(SafetensorsWriter *w) {
    if (!w) return;
    for (int i = 0; i < w->count; i++) free(w->tensors[i].name);
    for (int i = 0; i < w->meta_count; i++) { free((char *)w->meta[i].key); free((char *)w->meta[i].value); }
    free(w->tensors); free(w->meta);
    free(w);
}

int st_writer_add(SafetensorsWriter *w, const char *name, StDtype dtype,
                  const int64_t *shape, int ndim, const void *data) {
    if (!w) return -1;
    if (!name || !name[0] || !valid_utf8(name) || !strcmp(name, "__metadata__"))
        return writer_fail(w, "st_writer_add: tensor name \"%s\" must be non-empty UTF-8 and not __metadata__",
                           name ? name : "(null)");
    if ((unsigned)dtype >= ST_NUM_DTYPES)
        return writer_fail(w, "st_writer_add: tensor \"%s\": invalid dtype %d", name, (int)dtype);
    if (ndim < 0 || ndim > ST_MAX_DIMS || (ndim && !shape))
        return writer_fail(w, "st_writer_add: tensor \"%s\": ndim %d (0..%d with a shape) expected",
                           name, ndim, ST_MAX_DIMS);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0)
            return writer_fail(w, "st_writer_add: tensor \"%s\": shape[%d] = %lld is negative",
                               name, i, (long long)shape[i]);
    uint64_t nbytes;
    if (shape_nbytes(shape, ndim, DTYPES[dtype].size, &nbytes) || nbytes > SIZE_MAX)
        return writer_fail(w, "st_writer_add: tensor \"%s\": the shape overflows the byte count", name);
    if (nbytes && !data)
        return writer_fail(w, "st_writer_add: tensor \"%s\": NULL data for %llu bytes", name,
                           (unsigned long long)nbytes);
    if (w->count == w->cap) {
        int cap = w->cap ? 2 * w->cap : 16;
        StWriterTensor *tensors = realloc(w->tensors, (size_t)cap * sizeof(StWriterTensor));
        if (!tensors) return writer_fail(w, "st_writer_add: out of memory for %d tensors", cap);
        w->tensors = tensors; w->cap = cap;
    }
    StWriterTensor *t = &w->tensors[w->count];
    memset(t, 0, sizeof(*t));
    if (!(t->name = strdup(name))) return writer_fail(w, "st_writer_add: out of memory");
    t->dtype = dtype; t->ndim = ndim; t->nbytes = (size_t)nbytes; t->data = data;
    if (ndim) memcpy(t->shape, shape, (size_t)ndim * sizeof(int64_t));
    w->count++;
    return 0;
}

int st_writer_meta(SafetensorsWriter *w, const char *key, const char *value) {
    if (!w) return -1;
    if (!key || !value || !valid_utf8(key) || !valid_utf8(value))
        return writer_fail(w, "st_writer_meta: key \"%s\" and its value must be UTF-8 strings", key ? key : "(null)");
    for (int i = 0; i < w->meta_count; i++)
        if (!strcmp(w->meta[i].key, key)) return writer_fail(w, "st_writer_meta: duplicate key \"%s\"", key);
    if (w->meta_count == w->meta_cap) {
        int cap = w->meta_cap ? 2 * w->meta_cap : 8;
        StMeta *meta = realloc(w->meta, (size_t)cap * sizeof(StMeta));
        if (!meta) return writer_fail(w, "st_writer_meta: out of memory");
        w->meta = meta; w->meta_cap = cap;
    }
    char *k = strdup(key), *v = strdup(value);
    if (!k || !v) { free(k); free(v); return writer_fail(w, "st_writer_meta: out of memory"); }
    w->meta[w->meta_count++] = (StMeta){k, v};
    return 0;
}

// A growable text buffer; `failed` is set when an allocation fails.
typedef struct { char *s; size_t len, cap; int failed; } TextBuf;

static void text_put(TextBuf *b, const char *s, size_t n) {
    if (b->failed) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *grown = realloc(b->s, cap);
        if (!grown) { b->failed = 1; return; }
        b->s = grown; b->cap = cap;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

static void text_printf(TextBuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void text_printf(TextBuf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    text_put(b, tmp, (size_t)n);
}

// A JSON string literal: quotes, backslashes and control characters escaped.
static void text_json_string(TextBuf *b, const char *s) {
    text_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') { text_put(b, "\\", 1); text_put(b, s, 1); }
        else if (c < 0x20) text_printf(b, "\\u%04x", c);
        else text_put(b, s, 1);
    }
    text_put(b, "\"", 1);
}

// Largest dtype first, then in the order added: every tensor starts aligned to its dtype.
static int compare_write_order(const void *a, const void *b) {
    const StWriterTensor *x = *(const StWriterTensor *const *)a, *y = *(const StWriterTensor *const *)b;
    size_t sx = DTYPES[x->dtype].size, sy = DTYPES[y->dtype].size;
    if (sx != sy) return sx > sy ? -1 : 1;
    return x < y ? -1 : x > y;
}

static int compare_writer_names(const void *a, const void *b) {
    return strcmp((*(const StWriterTensor *const *)a)->name, (*(const StWriterTensor *const *)b)->name);
}

// The header JSON for the tensors in `order`, padded with spaces to a multiple of 8 bytes.
static int build_header(const SafetensorsWriter *w, const StWriterTensor **order, TextBuf *h) {
    text_put(h, "{", 1);
    int first = 1;
    if (w->meta_count) {
        text_put(h, "\"__metadata__\":{", 16);
        for (int i = 0; i < w->meta_count; i++) {
            if (i) text_put(h, ",", 1);
            text_json_string(h, w->meta[i].key);
            text_put(h, ":", 1);
            text_json_string(h, w->meta[i].value);
        }
        text_put(h, "}", 1);
        first = 0;
    }
    uint64_t offset = 0;
    for (int i = 0; i < w->count; i++) {
        const StWriterTensor *t = order[i];
        if (!first) text_put(h, ",", 1);
        first = 0;
        text_json_string(h, t->name);
        text_printf(h, ":{\"dtype\":\"%s\",\"shape\":[", DTYPES[t->dtype].name);
        for (int d = 0; d < t->ndim; d++) text_printf(h, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        text_printf(h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset,
                    (unsigned long long)(offset + t->nbytes));
        offset += t->nbytes;
    }
    text_put(h, "}", 1);
    while (!h->failed && h->len % 8) text_put(h, " ", 1);
    return h->failed ? -1 : 0;
}

int st_writer_save(const SafetensorsWriter *w, const char *path, char *err) {
    if (!w) { dit_set_error(err, "%s: no writer (st_writer_new ran out of memory)", path); return -1; }
    if (w->error[0]) { dit_set_error(err, "%s: %s", path, w->error); return -1; }
    const StWriterTensor **order = malloc(((size_t)w->count + 1) * sizeof(*order));
    TextBuf header = {0};
    char *tmp_path = malloc(strlen(path) + 5);
    FILE *fp = NULL;
    int rc = -1;
    if (!order || !tmp_path) { dit_set_error(err, "%s: out of memory", path); goto done; }
    for (int i = 0; i < w->count; i++) order[i] = &w->tensors[i];
    qsort(order, (size_t)w->count, sizeof(*order), compare_writer_names);
    for (int i = 1; i < w->count; i++)
        if (!strcmp(order[i - 1]->name, order[i]->name)) {
            dit_set_error(err, "%s: duplicate tensor name \"%s\"", path, order[i]->name);
            goto done;
        }
    qsort(order, (size_t)w->count, sizeof(*order), compare_write_order);
    if (build_header(w, order, &header)) { dit_set_error(err, "%s: out of memory for the header", path); goto done; }
    if (header.len > ST_MAX_HEADER_BYTES) {
        dit_set_error(err, "%s: header of %zu bytes exceeds the limit of %u", path, header.len, ST_MAX_HEADER_BYTES);
        goto done;
    }

    sprintf(tmp_path, "%s.tmp", path);
    fp = fopen(tmp_path, "wb");
    if (!fp) { dit_set_error(err, "%s: cannot create: %s", tmp_path, strerror(errno)); goto done; }
    uint64_t header_len = header.len;
    int ok = fwrite(&header_len, 8, 1, fp) == 1 && fwrite(header.s, 1, header.len, fp) == header.len;
    for (int i = 0; ok && i < w->count; i++)
        ok = !order[i]->nbytes || fwrite(order[i]->data, 1, order[i]->nbytes, fp) == order[i]->nbytes;
    ok = ok && fflush(fp) == 0 && fsync(fileno(fp)) == 0;
    int close_failed = fclose(fp);
    fp = NULL;
    if (!ok || close_failed) {
        dit_set_error(err, "%s: write failed: %s", tmp_path, strerror(errno));
        remove(tmp_path);
        goto done;
    }
    if (rename(tmp_path, path)) {
        dit_set_error(err, "%s: cannot rename %s to it: %s", path, tmp_path, strerror(errno));
        remove(tmp_path);
        goto done;
    }
    rc = 0;
done:
    free(order); free(header.s); free(tmp_path);
    return rc;
}
