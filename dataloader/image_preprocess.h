// Preprocessing of one decoded 8-bit image into the model's input: channel conversion,
// center crop to a square, resize to S x S, optional horizontal flip, map to [-1, 1],
// channel-major float layout (C, S, S).
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// pixels: (h, w, in_channels) interleaved uint8, in_channels 1 (gray), 2 (gray+alpha),
// 3 (RGB) or 4 (RGBA). out: (out_channels, S, S) floats in [-1, 1], out_channels 1 or 3.
// Channels: gray -> RGB copies gray to R, G, B; RGB -> gray is the luma
// 0.299 R + 0.587 G + 0.114 B; alpha is dropped.
// Geometry: the centered square of side m = min(w, h) (integer offsets (w-m)/2, (h-m)/2) is
// resized to S x S: area (box) filter when m >= S, bilinear (pixel centers aligned,
// edges clamped) when m < S. flip != 0 mirrors the output left-right.
// Values: v / 255 * 2 - 1 (clipped to [-1, 1] against rounding). Returns 0, or -1 with err for unsupported arguments.
int image_preprocess(const uint8_t *pixels, int w, int h, int in_channels,
                     int S, int out_channels, int flip, float *out, char *err);

#ifdef __cplusplus
}
#endif
