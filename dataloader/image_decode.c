#include "dataloader/image_decode.h"
#include "dataloader/image_preprocess.h"
#include "layers/common.h"
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

// The only translation unit with stb_image's implementation (the vendored v2.30: see the top
// of dataloader/stb_image.h); the formats of the issue only, so that no other decoder (PSD,
// HDR, PIC, PNM) sees untrusted files.
#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_ONLY_BMP
#define STBI_ONLY_TGA
#define STBI_ONLY_GIF
#define STBI_NO_STDIO
#define STBI_FAILURE_USERMSG
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"  // a PNG message unused with STBI_FAILURE_USERMSG
#include "dataloader/stb_image.h"
#pragma GCC diagnostic pop

size_t image_max_file_bytes(int64_t max_pixels) {
    return (size_t)max_pixels * 8 + ((size_t)16 << 20);
}

int image_read_file(const char *path, size_t max_bytes, uint8_t **data, size_t *len, char *err) {
    *data = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        dit_set_error(err, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        dit_set_error(err, "%s: cannot stat: %s", path, strerror(errno));
        fclose(f);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        dit_set_error(err, "%s: not a regular file (expected an image file)", path);
        fclose(f);
        return -1;
    }
    if (st.st_size == 0) {
        dit_set_error(err, "%s: empty file (0 bytes), expected an image", path);
        fclose(f);
        return -1;
    }
    if ((uint64_t)st.st_size > max_bytes) {
        dit_set_error(err, "%s: file is %lld bytes, more than the %zu bytes allowed for the image "
                      "pixel limit", path, (long long)st.st_size, max_bytes);
        fclose(f);
        return -1;
    }
    size_t n = (size_t)st.st_size;
    uint8_t *buf = malloc(n);
    if (!buf) {
        dit_set_error(err, "%s: out of memory reading %zu bytes", path, n);
        fclose(f);
        return -1;
    }
    size_t got = fread(buf, 1, n, f);
    int read_error = ferror(f);
    fclose(f);
    if (got != n) {
        dit_set_error(err, "%s: read %zu of %zu bytes%s%s", path, got, n,
                      read_error ? ": " : " (file changed while reading)", read_error ? strerror(errno) : "");
        free(buf);
        return -1;
    }
    *data = buf;
    *len = n;
    return 0;
}

// stb_image reads through these callbacks so that a decoder asking for bytes beyond the end
// of the data is seen: stb_image itself pads truncated JPEG, BMP and TGA files with zeros
// and reports success. stb_image reads in two ways: refills of its own buffer (the first
// read of all, into the same buffer each time; a short refill is normal at the end of the
// data, an empty one means the decoder wanted more) and stbi__getn of exactly the bytes it
// needs into another buffer (any short read means the data ended too early).
typedef struct {
    const uint8_t *data;
    size_t len, pos;
    const char *refill_buffer;
    int read_past_end;
} MemoryReader;

static int reader_read(void *user, char *out, int size) {
    MemoryReader *r = user;
    if (!r->refill_buffer) r->refill_buffer = out;
    size_t n = r->len - r->pos < (size_t)size ? r->len - r->pos : (size_t)size;
    if (n < (size_t)size && (n == 0 || out != r->refill_buffer)) r->read_past_end = 1;
    memcpy(out, r->data + r->pos, n);
    r->pos += n;
    return (int)n;
}

static void reader_skip(void *user, int n) {
    MemoryReader *r = user;
    if (n < 0) r->pos = (size_t)-n > r->pos ? 0 : r->pos - (size_t)-n;
    else r->pos = (size_t)n > r->len - r->pos ? r->len : r->pos + (size_t)n;
}

static int reader_eof(void *user) {
    MemoryReader *r = user;
    return r->pos >= r->len;
}

static const stbi_io_callbacks reader_callbacks = {reader_read, reader_skip, reader_eof};

// The format by its signature, or NULL for none (TGA has no signature).
static const char *signature_format(const uint8_t *data, size_t len) {
    if (len >= 8 && memcmp(data, "\x89PNG\r\n\x1a\n", 8) == 0) return "PNG";
    if (len >= 3 && data[0] == 0xFF && data[1] == 0xD8 && data[2] == 0xFF) return "JPEG";
    if (len >= 4 && memcmp(data, "GIF8", 4) == 0) return "GIF";
    if (len >= 2 && memcmp(data, "BM", 2) == 0) return "BMP";
    return NULL;
}

// stb_image's failure reason for a file of the given format. stb_image tries its decoders in
// turn and some failures set no reason, so the reason left may come from another format's
// signature test ("Corrupt JPEG" for a PNG); such a stale reason is not shown.
static const char *failure_reason(const char *format) {
    static const char *const formats[] = {"PNG", "JPEG", "GIF", "BMP", "TGA"};
    const char *reason = stbi_failure_reason();
    if (!reason) return "no reason given";
    for (size_t i = 0; format && i < sizeof(formats) / sizeof(formats[0]); i++) {
        if (strcmp(formats[i], format) != 0 && strstr(reason, formats[i]) && !strstr(reason, format))
            return "no reason given (invalid data)";
    }
    return reason;
}

int image_decode(const uint8_t *data, size_t len, const char *name, int64_t max_pixels,
                 int S, int C, int flip, float *out, char *err) {
    if (len == 0) {
        dit_set_error(err, "%s: empty (0 bytes), expected an image", name);
        return -1;
    }
    if (len > INT_MAX) {
        dit_set_error(err, "%s: %zu bytes is more than stb_image can decode (%d)", name, len, INT_MAX);
        return -1;
    }
    int w, h, c;
    const char *format = signature_format(data, len);
    MemoryReader header = {data, len, 0, NULL, 0};
    if (!stbi_info_from_callbacks(&reader_callbacks, &header, &w, &h, &c)) {
        if (format) {
            dit_set_error(err, "%s: cannot read the %s header (corrupt, truncated, or too large for stb_image): "
                          "stb_image: %s", name, format, failure_reason(format));
        } else {
            dit_set_error(err, "%s: not a PNG, JPEG, BMP, TGA or GIF image: stb_image: %s",
                          name, failure_reason(NULL));
        }
        return -1;
    }
    if ((int64_t)w * h > max_pixels) {
        dit_set_error(err, "%s: image is %dx%d = %lld pixels, more than the limit of %lld pixels",
                      name, w, h, (long long)w * h, (long long)max_pixels);
        return -1;
    }
    MemoryReader reader = {data, len, 0, NULL, 0};
    uint8_t *pixels = stbi_load_from_callbacks(&reader_callbacks, &reader, &w, &h, &c, 0);
    if (!format) format = "TGA";  // the only format without a signature that stbi_info accepts
    if (pixels && reader.read_past_end) {
        dit_set_error(err, "%s: truncated %dx%d %s image: the decoder needed more than the file's %zu bytes",
                      name, w, h, format, len);
        stbi_image_free(pixels);
        return -1;
    }
    if (!pixels) {
        dit_set_error(err, "%s: cannot decode this %dx%d %s image (corrupt or truncated): stb_image: %s",
                      name, w, h, format, failure_reason(format));
        return -1;
    }
    int rc = 0;
    if ((int64_t)w * h > max_pixels) {  // the header read by stbi_info disagreed with the decoder
        dit_set_error(err, "%s: image decodes to %dx%d pixels, more than the limit of %lld pixels",
                      name, w, h, (long long)max_pixels);
        rc = -1;
    } else {
        char why[DIT_ERR_LEN];
        if (image_preprocess(pixels, w, h, c, S, C, flip, out, why) != 0) {
            dit_set_error(err, "%s: %s", name, why);
            rc = -1;
        }
    }
    stbi_image_free(pixels);
    return rc;
}

int image_load(const char *path, int64_t max_pixels, int S, int C, int flip, float *out, char *err) {
    uint8_t *data;
    size_t len;
    if (image_read_file(path, image_max_file_bytes(max_pixels), &data, &len, err) != 0) return -1;
    int rc = image_decode(data, len, path, max_pixels, S, C, flip, out, err);
    free(data);
    return rc;
}
