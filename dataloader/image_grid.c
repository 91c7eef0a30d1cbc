#include "dataloader/image_grid.h"
#include "layers/common.h"
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// The only translation unit with stb_image_write's implementation.
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb/stb_image_write.h>
#include <stb/stb_easy_font.h>

#define GRID_PAD 2            // pixels between tiles and around the grid
#define GRID_MIN_TILE 96      // tiles are scaled up to at least this many pixels
#define CAPTION_HEIGHT 13     // stb_easy_font glyphs span 10 pixels with descenders
#define CAPTION_MAX_CHARS 64
#define QUAD_BYTES_PER_CHAR 300  // stb_easy_font uses ~270 bytes of quads per character
#define BACKGROUND 40
#define TEXT_COLOR 235

static uint8_t to_byte(float x) {
    float v = (x + 1.0f) * 127.5f + 0.5f;
    return v <= 0.0f ? 0 : v >= 255.0f ? 255 : (uint8_t)v;
}

// Draws text centered in the box (x0, y0, width), cut to the width; rgb is (height, stride) x 3.
static void draw_caption(uint8_t *rgb, int stride, int height, int x0, int y0, int width, const char *text) {
    char buf[CAPTION_MAX_CHARS + 1];
    snprintf(buf, sizeof(buf), "%s", text);
    size_t len = strlen(buf);
    while (len > 0 && stb_easy_font_width(buf) > width) buf[--len] = '\0';
    if (len == 0) return;
    char quads[CAPTION_MAX_CHARS * QUAD_BYTES_PER_CHAR];
    int x_text = x0 + (width - stb_easy_font_width(buf)) / 2;
    int num_quads = stb_easy_font_print((float)x_text, (float)y0, buf, NULL, quads,
                                        (int)sizeof(quads));
    for (int q = 0; q < num_quads; q++) {
        // each quad: 4 vertices of (x, y, z float, rgba) = 16 bytes; vertices 0 and 2 are opposite corners
        float v0[2], v2[2];
        memcpy(v0, quads + (size_t)(4 * q) * 16, sizeof(v0));
        memcpy(v2, quads + (size_t)(4 * q + 2) * 16, sizeof(v2));
        for (int y = (int)v0[1]; y < (int)v2[1]; y++) {
            for (int x = (int)v0[0]; x < (int)v2[0]; x++) {
                if (x < 0 || y < 0 || x >= stride || y >= height) continue;
                memset(rgb + ((size_t)y * stride + x) * 3, TEXT_COLOR, 3);
            }
        }
    }
}

int write_image_grid_png(const char *path, const float *images, int n, int C, int S, int cols,
                         const char *const *captions, char *err) {
    if (n <= 0 || (C != 1 && C != 3) || S <= 0 || cols <= 0) {
        dit_set_error(err, "%s: image grid needs n > 0, C 1 or 3, S > 0, cols > 0 (got n=%d C=%d S=%d cols=%d)",
                      path, n, C, S, cols);
        return -1;
    }
    if (cols > n) cols = n;
    int rows = (n + cols - 1) / cols;
    int zoom = S >= GRID_MIN_TILE ? 1 : (GRID_MIN_TILE + S - 1) / S;
    int tile = S * zoom;
    int caption = captions ? CAPTION_HEIGHT : 0;
    int64_t width = (int64_t)cols * (tile + GRID_PAD) + GRID_PAD;
    int64_t height = (int64_t)rows * (tile + caption + GRID_PAD) + GRID_PAD;
    if (width * height > ((int64_t)1 << 28)) {
        dit_set_error(err, "%s: image grid of %lldx%lld pixels is too large (n=%d, S=%d, cols=%d)",
                      path, (long long)width, (long long)height, n, S, cols);
        return -1;
    }
    uint8_t *rgb = malloc((size_t)(width * height * 3));
    if (!rgb) {
        dit_set_error(err, "%s: out of memory for a %lldx%lld image grid", path, (long long)width, (long long)height);
        return -1;
    }
    memset(rgb, BACKGROUND, (size_t)(width * height * 3));
    for (int i = 0; i < n; i++) {
        int x0 = GRID_PAD + (i % cols) * (tile + GRID_PAD);
        int y0 = GRID_PAD + (i / cols) * (tile + caption + GRID_PAD);
        const float *img = images + (size_t)i * C * S * S;
        for (int y = 0; y < tile; y++) {
            for (int x = 0; x < tile; x++) {
                uint8_t *px = rgb + ((size_t)(y0 + y) * width + x0 + x) * 3;
                size_t src = (size_t)(y / zoom) * S + x / zoom;
                for (int c = 0; c < 3; c++) px[c] = to_byte(img[(size_t)(C == 3 ? c : 0) * S * S + src]);
            }
        }
        if (captions && captions[i]) draw_caption(rgb, (int)width, (int)height, x0, y0 + tile + 2, tile, captions[i]);
    }
    errno = 0;
    int ok = stbi_write_png(path, (int)width, (int)height, 3, rgb, (int)width * 3);
    free(rgb);
    if (!ok) {
        dit_set_error(err, "%s: cannot write the PNG image grid: %s", path, errno ? strerror(errno) : "stbi_write_png failed");
        return -1;
    }
    return 0;
}
