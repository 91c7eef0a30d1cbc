// A PNG grid of images with a caption under each tile: the data preview and the trainer's
// sample grids.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// images: (n, C, S, S) in [-1, 1] (values outside are clipped), C = 1 (gray) or 3 (RGB).
// Writes an RGB PNG of ceil(n / cols) rows of cols tiles. Tiles smaller than 96 pixels are
// scaled up by an integer factor (nearest neighbour) so captions fit; captions (n strings, or
// NULL for none) are drawn in a small bitmap font (stb_easy_font) under each tile and cut
// to the tile width.
int write_image_grid_png(const char *path, const float *images, int n, int C, int S, int cols,
                         const char *const *captions, char *err);

#ifdef __cplusplus
}
#endif
