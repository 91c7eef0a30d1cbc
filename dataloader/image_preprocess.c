#include "dataloader/image_preprocess.h"
#include "layers/common.h"
#include <math.h>
#include <stdlib.h>

// Resampling weights along one axis, source length m -> output length S.
// Output o reads source pixels first[o] .. first[o]+count[o]-1 with weights w[o*stride + k].
// m >= S: area filter, o covers the source interval [o m/S, (o+1) m/S), each pixel weighted
//         by its overlap with that interval divided by its length m/S (weights sum to 1).
// m <  S: bilinear, source coordinate (o + 0.5) m/S - 0.5, neighbours clamped to [0, m-1].
static void axis_weights(int m, int S, int stride, int *first, int *count, float *w) {
    double scale = (double)m / S;
    for (int o = 0; o < S; o++) {
        float *wo = w + (size_t)o * stride;
        if (m >= S) {
            double lo = o * scale, hi = (o + 1) * scale;
            int j0 = (int)floor(lo), j1 = (int)ceil(hi);
            if (j1 > m) j1 = m;
            first[o] = j0;
            count[o] = j1 - j0;
            for (int j = j0; j < j1; j++) {
                double overlap = fmin(hi, j + 1.0) - fmax(lo, (double)j);
                wo[j - j0] = (float)(overlap / scale);
            }
        } else {
            double src = (o + 0.5) * scale - 0.5;
            int j0 = (int)floor(src);
            int a = j0 < 0 ? 0 : j0, b = j0 + 1 > m - 1 ? m - 1 : j0 + 1;
            float t = (float)(src - j0);
            first[o] = a;
            if (a == b) { count[o] = 1; wo[0] = 1.0f; }
            else { count[o] = 2; wo[0] = 1.0f - t; wo[1] = t; }
        }
    }
}

int image_preprocess(const uint8_t *pixels, int w, int h, int in_channels,
                     int S, int out_channels, int flip, float *out, char *err) {
    if (w <= 0 || h <= 0 || in_channels < 1 || in_channels > 4 || S <= 0 ||
        (out_channels != 1 && out_channels != 3)) {
        dit_set_error(err, "image_preprocess: unsupported arguments (w=%d h=%d in_channels=%d "
                      "S=%d out_channels=%d); expected w, h, S > 0, in_channels 1-4, out_channels 1 or 3",
                      w, h, in_channels, S, out_channels);
        return -1;
    }
    int m = w < h ? w : h;
    int x0 = (w - m) / 2, y0 = (h - m) / 2;
    int color = in_channels >= 3 ? 3 : 1;  // channels kept before conversion (alpha dropped)
    int stride = m >= S ? (m + S - 1) / S + 1 : 2;
    int *first = malloc(sizeof(int) * 2 * S);
    float *wts = malloc(sizeof(float) * (size_t)S * stride);
    float *rows = malloc(sizeof(float) * (size_t)m * S * color);   // (m, S, color) after the x pass
    float *plane = malloc(sizeof(float) * (size_t)S * S * color);  // (S, S, color) after the y pass
    if (!first || !wts || !rows || !plane) {
        free(first); free(wts); free(rows); free(plane);
        dit_set_error(err, "image_preprocess: out of memory for a %dx%d crop resized to %dx%d", m, m, S, S);
        return -1;
    }
    int *count = first + S;
    axis_weights(m, S, stride, first, count, wts);  // same weights for x and y: the crop is square

    // x pass: rows[y][ox][c] = sum_k w[ox][k] * pixel[y0 + y][x0 + first[ox] + k][c]
    for (int y = 0; y < m; y++) {
        const uint8_t *src = pixels + ((size_t)(y0 + y) * w + x0) * in_channels;
        for (int ox = 0; ox < S; ox++) {
            const float *wo = wts + (size_t)ox * stride;
            for (int c = 0; c < color; c++) {
                float acc = 0.0f;
                for (int k = 0; k < count[ox]; k++) acc += wo[k] * src[(size_t)(first[ox] + k) * in_channels + c];
                rows[((size_t)y * S + ox) * color + c] = acc;
            }
        }
    }
    // y pass: plane[oy][ox][c] = sum_k w[oy][k] * rows[first[oy] + k][ox][c]
    for (int oy = 0; oy < S; oy++) {
        const float *wo = wts + (size_t)oy * stride;
        for (size_t i = 0; i < (size_t)S * color; i++) {
            float acc = 0.0f;
            for (int k = 0; k < count[oy]; k++) acc += wo[k] * rows[(size_t)(first[oy] + k) * S * color + i];
            plane[(size_t)oy * S * color + i] = acc;
        }
    }
    // channel conversion, flip, [0, 255] -> [-1, 1], (S, S, color) -> (out_channels, S, S)
    for (int oy = 0; oy < S; oy++) {
        for (int ox = 0; ox < S; ox++) {
            const float *p = plane + ((size_t)oy * S + (flip ? S - 1 - ox : ox)) * color;
            for (int c = 0; c < out_channels; c++) {
                float v;
                if (color == out_channels) v = p[c];
                else if (color == 1) v = p[0];
                else v = 0.299f * p[0] + 0.587f * p[1] + 0.114f * p[2];
                v = v * (2.0f / 255.0f) - 1.0f;
                out[((size_t)c * S + oy) * S + ox] = fminf(fmaxf(v, -1.0f), 1.0f);  // rounding of the weights
            }
        }
    }
    free(first); free(wts); free(rows); free(plane);
    return 0;
}
