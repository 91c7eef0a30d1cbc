// Reading and decoding one image file (PNG, JPEG, BMP, TGA, GIF through stb_image) into the
// model's input layout (see image_preprocess.h). Every failure names the file and the reason.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The largest file image_read_file accepts for a pixel limit: 8 bytes per pixel (16-bit
// RGBA stored uncompressed) plus 16 MiB of headers and metadata.
size_t image_max_file_bytes(int64_t max_pixels);

// Reads the whole file at path into a malloc'd buffer (*data, *len; the caller frees).
// Fails for a missing or unreadable path (strerror), a directory, an empty (0-byte) file and
// a file larger than max_bytes.
int image_read_file(const char *path, size_t max_bytes, uint8_t **data, size_t *len, char *err);

// Decodes an encoded image from memory and preprocesses it to out (C, S, S) in [-1, 1].
// name is only used in messages. Fails (with stb_image's reason) for data that is not a
// supported image or is corrupt or truncated, and for images of more than max_pixels pixels
// (checked from the header, before the pixels are decoded).
int image_decode(const uint8_t *data, size_t len, const char *name, int64_t max_pixels,
                 int S, int C, int flip, float *out, char *err);

// image_read_file + image_decode.
int image_load(const char *path, int64_t max_pixels, int S, int C, int flip, float *out, char *err);

#ifdef __cplusplus
}
#endif
