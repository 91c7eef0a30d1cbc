// Tests of dataloader/: preprocessing values on tiny known images, decoding of every format,
// label assignment, order per seed, resume, prefetch, the synthetic dataset, the image grid,
// and every bad-input case of issue 3. Image files are written by the tests into a fresh
// temporary folder with stb_image_write (and by hand for corrupt ones).
#include "dataloader/dataloader.h"
#include "dataloader/image_decode.h"
#include "dataloader/image_grid.h"
#include "dataloader/image_preprocess.h"
#include "dataloader/synthetic.h"
#include "layers/common.h"
#include <criterion/criterion.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "dataloader/stb_image.h"
#include <stb/stb_image_write.h>

// ---- helpers -----------------------------------------------------------------------------

static char tmp_root[256];

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    chmod(path, 0700);  // a permissions test may have left it unreadable
    return remove(path);
}

static void make_tmp(void) {
    snprintf(tmp_root, sizeof(tmp_root), "/tmp/ditc_test_dataloader_XXXXXX");
    cr_assert_not_null(mkdtemp(tmp_root));
}

static void remove_tmp(void) {
    if (tmp_root[0]) nftw(tmp_root, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    tmp_root[0] = '\0';
}

TestSuite(preprocess);
TestSuite(decode);
// a loader that loops forever fails by the timeout
TestSuite(loader, .init = make_tmp, .fini = remove_tmp, .timeout = 60);
TestSuite(bad_input, .init = make_tmp, .fini = remove_tmp, .timeout = 60);
TestSuite(synthetic);
TestSuite(grid, .init = make_tmp, .fini = remove_tmp);

// tmp_root/<rel>, creating the parent folder
static const char *tmp_path(const char *rel) {
    static char path[2][512];
    static int which;
    which ^= 1;
    snprintf(path[which], sizeof(path[which]), "%s/%s", tmp_root, rel);
    char dir[512];
    snprintf(dir, sizeof(dir), "%s", path[which]);
    for (char *slash = dir + strlen(tmp_root) + 1; (slash = strchr(slash, '/')) != NULL; slash++) {
        *slash = '\0';
        mkdir(dir, 0755);
        *slash = '/';
    }
    return path[which];
}

static void write_bytes(const char *rel, const void *data, size_t n) {
    FILE *f = fopen(tmp_path(rel), "wb");
    cr_assert_not_null(f, "cannot create %s", rel);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    fclose(f);
}

static void write_png(const char *rel, int w, int h, int c, const uint8_t *pixels) {
    cr_assert(stbi_write_png(tmp_path(rel), w, h, c, pixels, w * c), "cannot write %s", rel);
}

// a w x h image of c channels with every byte equal to value
static void write_flat_png(const char *rel, int w, int h, int c, uint8_t value) {
    uint8_t *pixels = malloc((size_t)w * h * c);
    memset(pixels, value, (size_t)w * h * c);
    write_png(rel, w, h, c, pixels);
    free(pixels);
}

static uint8_t *read_whole(const char *path, size_t *n) {
    uint8_t *data;
    char err[DIT_ERR_LEN];
    cr_assert_eq(image_read_file(path, (size_t)1 << 30, &data, n, err), 0, "%s", err);
    return data;
}

// stb_image is built without stdio (image_decode.c): decode a file through memory, as RGB
static uint8_t *load_rgb(const char *path, int *w, int *h) {
    size_t n;
    uint8_t *data = read_whole(path, &n);
    int c;
    uint8_t *pixels = stbi_load_from_memory(data, (int)n, w, h, &c, 3);
    cr_assert_not_null(pixels, "%s: %s", path, stbi_failure_reason());
    free(data);
    return pixels;
}

static float to_unit(float byte) { return byte / 255.0f * 2.0f - 1.0f; }

// ‖a − b‖ / ‖b‖ (‖a − b‖ when b = 0)
static double rel_err(const float *a, const float *b, size_t n) {
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        r += (double)b[i] * b[i];
    }
    return r > 0 ? sqrt(d / r) : sqrt(d);
}

static DataLoaderConfig config(const char *root, int S, int C, int B) {
    return (DataLoaderConfig){.root = root, .image_size = S, .channels = C, .batch_size = B, .seed = 1234};
}

static void assert_contains(const char *s, const char *part) {
    cr_assert(strstr(s, part) != NULL, "expected \"%s\" in the message: %s", part, s);
}

// ---- preprocessing values on tiny known images --------------------------------------------

Test(preprocess, area_filter_averages_blocks) {
    // 4x4 gray -> 2x2: each output is the mean of a 2x2 block
    const uint8_t px[16] = {0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150};
    float out[4];
    char err[DIT_ERR_LEN];
    cr_assert_eq(image_preprocess(px, 4, 4, 1, 2, 1, 0, out, err), 0, "%s", err);
    const float ref[4] = {to_unit(25), to_unit(45), to_unit(105), to_unit(125)};
    cr_assert(rel_err(out, ref, 4) < 1e-6, "rel err %g (tolerance 1e-6)", rel_err(out, ref, 4));
}

Test(preprocess, area_filter_fractional_scale_matches_exact_integral) {
    // 7x5 RGB -> center crop 5x5 (columns 1..5) -> 3x3. Reference: the exact box integral in
    // integer units where each source pixel is S=3 units wide and each output m=5 units.
    enum { W = 7, H = 5, C = 3, S = 3, M = 5 };
    uint8_t px[W * H * C];
    Rng rng;
    rng_seed(&rng, 7);
    for (int i = 0; i < W * H * C; i++) px[i] = (uint8_t)(rng_u32(&rng) & 255);
    float out[C * S * S], ref[C * S * S];
    char err[DIT_ERR_LEN];
    cr_assert_eq(image_preprocess(px, W, H, C, S, C, 0, out, err), 0, "%s", err);
    for (int c = 0; c < C; c++)
        for (int oy = 0; oy < S; oy++)
            for (int ox = 0; ox < S; ox++) {
                double sum = 0;
                for (int uy = oy * M; uy < (oy + 1) * M; uy++)
                    for (int ux = ox * M; ux < (ox + 1) * M; ux++)
                        sum += px[((uy / S) * W + 1 + ux / S) * C + c];
                ref[(c * S + oy) * S + ox] = to_unit((float)(sum / (M * M)));
            }
    cr_assert(rel_err(out, ref, C * S * S) < 1e-5, "rel err %g (tolerance 1e-5)", rel_err(out, ref, C * S * S));
}

Test(preprocess, center_crop_of_wide_and_tall_images) {
    // 6x2 wide: the crop is columns 2..3; 2x6 tall: rows 2..3
    uint8_t wide[12], tall[12];
    for (int y = 0; y < 2; y++)
        for (int x = 0; x < 6; x++) wide[y * 6 + x] = (uint8_t)(10 * x + 100 * y);
    for (int y = 0; y < 6; y++)
        for (int x = 0; x < 2; x++) tall[y * 2 + x] = (uint8_t)(10 * y + 100 * x);
    float out[4];
    char err[DIT_ERR_LEN];
    cr_assert_eq(image_preprocess(wide, 6, 2, 1, 2, 1, 0, out, err), 0, "%s", err);
    const float ref_wide[4] = {to_unit(20), to_unit(30), to_unit(120), to_unit(130)};
    cr_assert(rel_err(out, ref_wide, 4) < 1e-6);
    cr_assert_eq(image_preprocess(tall, 2, 6, 1, 2, 1, 0, out, err), 0, "%s", err);
    const float ref_tall[4] = {to_unit(20), to_unit(120), to_unit(30), to_unit(130)};
    cr_assert(rel_err(out, ref_tall, 4) < 1e-6);
}

Test(preprocess, bilinear_upscale_with_clamped_edges) {
    // 2x2 -> 4x4: source coordinates -0.25, 0.25, 0.75, 1.25 -> weights of pixel 1: 0, .25, .75, 1
    const uint8_t px[4] = {0, 200, 100, 40};
    const float t[4] = {0.0f, 0.25f, 0.75f, 1.0f};
    float out[16], ref[16];
    char err[DIT_ERR_LEN];
    cr_assert_eq(image_preprocess(px, 2, 2, 1, 4, 1, 0, out, err), 0, "%s", err);
    for (int y = 0; y < 4; y++)
        for (int x = 0; x < 4; x++) {
            float top = (1 - t[x]) * px[0] + t[x] * px[1], bottom = (1 - t[x]) * px[2] + t[x] * px[3];
            ref[y * 4 + x] = to_unit((1 - t[y]) * top + t[y] * bottom);
        }
    cr_assert(rel_err(out, ref, 16) < 1e-6, "rel err %g (tolerance 1e-6)", rel_err(out, ref, 16));
}

Test(preprocess, channel_conversions) {
    char err[DIT_ERR_LEN];
    float out[3];
    // RGB -> gray: luma
    const uint8_t rgb[3] = {200, 100, 50};
    cr_assert_eq(image_preprocess(rgb, 1, 1, 3, 1, 1, 0, out, err), 0, "%s", err);
    cr_assert_float_eq(out[0], to_unit(0.299f * 200 + 0.587f * 100 + 0.114f * 50), 1e-5);
    // gray -> RGB: copies
    const uint8_t gray[1] = {51};
    cr_assert_eq(image_preprocess(gray, 1, 1, 1, 1, 3, 0, out, err), 0, "%s", err);
    for (int c = 0; c < 3; c++) cr_assert_float_eq(out[c], to_unit(51), 1e-6);
    // RGBA -> RGB: alpha dropped (not premultiplied)
    const uint8_t rgba[4] = {10, 20, 30, 0};
    cr_assert_eq(image_preprocess(rgba, 1, 1, 4, 1, 3, 0, out, err), 0, "%s", err);
    for (int c = 0; c < 3; c++) cr_assert_float_eq(out[c], to_unit(rgba[c]), 1e-6);
    // gray+alpha -> gray
    const uint8_t gray_alpha[2] = {77, 255};
    cr_assert_eq(image_preprocess(gray_alpha, 1, 1, 2, 1, 1, 0, out, err), 0, "%s", err);
    cr_assert_float_eq(out[0], to_unit(77), 1e-6);
    // 0 and 255 map to -1 and 1, their average to 0
    const uint8_t ends[4] = {0, 255, 255, 0};
    cr_assert_eq(image_preprocess(ends, 1, 1, 1, 1, 1, 0, out, err), 0, "%s", err);
    cr_assert_eq(out[0], -1.0f);
    cr_assert_eq(image_preprocess(ends + 1, 1, 1, 1, 1, 1, 0, out, err), 0, "%s", err);
    cr_assert_eq(out[0], 1.0f);
    cr_assert_eq(image_preprocess(ends, 2, 2, 1, 1, 1, 0, out, err), 0, "%s", err);
    cr_assert_float_eq(out[0], 0.0f, 1e-6);
}

Test(preprocess, flip_mirrors_columns_of_every_channel) {
    uint8_t px[3 * 3 * 3];
    for (int i = 0; i < 27; i++) px[i] = (uint8_t)(9 * i);
    float plain[27], flipped[27];
    char err[DIT_ERR_LEN];
    cr_assert_eq(image_preprocess(px, 3, 3, 3, 3, 3, 0, plain, err), 0, "%s", err);
    cr_assert_eq(image_preprocess(px, 3, 3, 3, 3, 3, 1, flipped, err), 0, "%s", err);
    for (int c = 0; c < 3; c++)
        for (int y = 0; y < 3; y++)
            for (int x = 0; x < 3; x++) {
                cr_assert_eq(flipped[(c * 3 + y) * 3 + x], plain[(c * 3 + y) * 3 + 2 - x]);
                cr_assert_float_eq(plain[(c * 3 + y) * 3 + x], to_unit(px[(y * 3 + x) * 3 + c]), 1e-6);
            }
}

Test(preprocess, rejects_bad_arguments) {
    uint8_t px[4] = {0};
    float out[16];
    char err[DIT_ERR_LEN];
    cr_assert_eq(image_preprocess(px, 2, 2, 1, 2, 2, 0, out, err), -1);
    assert_contains(err, "out_channels 1 or 3");
    cr_assert_eq(image_preprocess(px, 0, 2, 1, 2, 1, 0, out, err), -1);
}

// ---- decoding every format ----------------------------------------------------------------

// A 1x1 GIF (no extension blocks) whose palette entry 0 is (0x40, 0x80, 0xC0); the LZW data
// 0x44 0x01 is: clear code, index 0, end code.
static const uint8_t tiny_gif[] = {
    'G', 'I', 'F', '8', '9', 'a', 1, 0, 1, 0, 0x80, 0, 0, 0x40, 0x80, 0xC0, 0, 0, 0,
    0x2C, 0, 0, 0, 0, 1, 0, 1, 0, 0, 2, 2, 0x44, 0x01, 0, 0x3B};

Test(decode, every_format_from_memory) {
    float out[3];
    char err[DIT_ERR_LEN];
    cr_assert_eq(image_decode(tiny_gif, sizeof(tiny_gif), "tiny.gif", 100, 1, 3, 0, out, err), 0, "%s", err);
    const float ref[3] = {to_unit(0x40), to_unit(0x80), to_unit(0xC0)};
    cr_assert(rel_err(out, ref, 3) < 1e-6, "gif rel err %g", rel_err(out, ref, 3));
}

static void write_fn(void *ctx, void *data, int size) {
    FILE *f = ctx;
    fwrite(data, 1, size, f);
}

Test(decode, png_bmp_tga_are_exact_and_jpeg_is_close) {
    enum { W = 8, H = 6, C = 3, S = 4 };
    uint8_t px[W * H * C];
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++)
            for (int c = 0; c < C; c++) px[(y * W + x) * C + c] = (uint8_t)(20 * x + 10 * y + 40 * c);
    float ref[C * S * S], out[C * S * S];
    char err[DIT_ERR_LEN];
    cr_assert_eq(image_preprocess(px, W, H, C, S, C, 0, ref, err), 0, "%s", err);
    for (int format = 0; format < 4; format++) {
        char *buf;
        size_t len;
        FILE *f = open_memstream(&buf, &len);
        int ok = format == 0 ? stbi_write_png_to_func(write_fn, f, W, H, C, px, W * C)
               : format == 1 ? stbi_write_bmp_to_func(write_fn, f, W, H, C, px)
               : format == 2 ? stbi_write_tga_to_func(write_fn, f, W, H, C, px)
                             : stbi_write_jpg_to_func(write_fn, f, W, H, C, px, 95);
        fclose(f);
        cr_assert(ok);
        cr_assert_eq(image_decode((uint8_t *)buf, len, "mem", 1000, S, C, 0, out, err), 0, "format %d: %s", format, err);
        double tol = format == 3 ? 0.05 : 1e-6;  // JPEG is lossy
        cr_assert(rel_err(out, ref, C * S * S) < tol, "format %d: rel err %g (tolerance %g)", format,
                  rel_err(out, ref, C * S * S), tol);
        free(buf);
    }
}

// Encodes px (w, h, c) as format 0 PNG, 1 BMP, 2 TGA with RLE, 3 TGA raw, 4 JPEG.
static uint8_t *encode(int format, int w, int h, int c, const uint8_t *px, size_t *len) {
    char *buf;
    FILE *f = open_memstream(&buf, len);
    stbi_write_tga_with_rle = format != 3;
    int ok = format == 0 ? stbi_write_png_to_func(write_fn, f, w, h, c, px, w * c)
           : format == 1 ? stbi_write_bmp_to_func(write_fn, f, w, h, c, px)
           : format <= 3 ? stbi_write_tga_to_func(write_fn, f, w, h, c, px)
                         : stbi_write_jpg_to_func(write_fn, f, w, h, c, px, 90);
    stbi_write_tga_with_rle = 1;
    fclose(f);
    cr_assert(ok);
    return (uint8_t *)buf;
}

// stb_image pads truncated JPEG, BMP and TGA data with zeros; image_decode must refuse every
// cut file, and accept every complete one (no false "truncated").
Test(decode, complete_files_decode_and_every_cut_file_fails) {
    static const char *const names[5] = {"PNG", "BMP", "TGA-RLE", "TGA", "JPEG"};
    uint8_t px[23 * 17 * 4];
    Rng rng;
    rng_seed(&rng, 3);
    for (size_t i = 0; i < sizeof(px); i++) px[i] = (uint8_t)(i % 29 < 9 ? 200 : rng_u32(&rng) & 255);
    float out[3 * 5 * 5];
    char err[DIT_ERR_LEN];
    for (int format = 0; format < 5; format++) {
        for (int c = 1; c <= 4; c++) {
            for (int w = 1; w <= 23; w += 11) {
                for (int h = 1; h <= 17; h += 8) {
                    if (format == 4 && (c == 2 || c == 4)) continue;  // JPEG has no alpha
                    size_t n;
                    uint8_t *data = encode(format, w, h, c, px, &n);
                    cr_assert_eq(image_decode(data, n, "complete", 1000, 5, 3, 0, out, err), 0,
                                 "%s %dx%dx%d: %s", names[format], w, h, c, err);
                    // cuts that remove pixel data (a PNG without its last chunk CRC or a BMP
                    // without its last row padding still holds every pixel)
                    for (size_t cut = 1; cut + 16 < n; cut++) {
                        cr_assert_eq(image_decode(data, cut, "cut", 1000, 5, 3, 0, out, err), -1,
                                     "%s %dx%dx%d cut to %zu of %zu bytes was accepted", names[format], w, h, c, cut, n);
                    }
                    free(data);
                }
            }
        }
    }
}

// ---- the loader over an image folder -------------------------------------------------------

// ROOT with classes "b_second" (3 images), "a_first" (2), "c_third" (4), written in that
// order; image k of class c is a flat 6x4 gray PNG of value 20 c + 5 k + 10 (so its content
// says where it came from), plus a README.txt and hidden files that must be ignored.
static const int class_count[3] = {2, 3, 4};
static const char *const class_dir[3] = {"a_first", "b_second", "c_third"};

static uint8_t folder_value(int c, int k) { return (uint8_t)(20 * c + 5 * k + 10); }

static void write_labelled_folder(void) {
    for (int c = 2; c >= 0; c--) {
        for (int k = 0; k < class_count[c]; k++) {
            char rel[128];
            snprintf(rel, sizeof(rel), "data/%s/img_%d.png", class_dir[c], k);
            write_flat_png(rel, 6, 4, 1, folder_value(c, k));
        }
    }
    write_bytes("data/a_first/README.txt", "not an image", 12);
    write_bytes("data/b_second/.hidden.png", "garbage", 7);
    write_bytes("data/notes.md", "a file at the top level", 23);
    mkdir(tmp_path("data/.cache/x"), 0755);
}

// The value an image was written with, from its preprocessed first pixel.
static int pixel_byte(const float *image) { return (int)lroundf((image[0] + 1.0f) * 127.5f); }

Test(loader, labels_follow_sorted_class_names_and_every_image_once_per_epoch) {
    write_labelled_folder();
    char root[512];
    snprintf(root, sizeof(root), "%s/data", tmp_root);
    DataLoaderConfig cfg = config(root, 3, 1, 9);
    DataLoader *dl;
    char err[DIT_ERR_LEN];
    cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
    cr_assert_eq(dataloader_num_classes(dl), 3);
    cr_assert_eq(dataloader_num_images(dl), 9);
    for (int c = 0; c < 3; c++) cr_assert_str_eq(dataloader_class_name(dl, c), class_dir[c]);
    cr_assert_null(dataloader_class_name(dl, 3));
    float images[9 * 9];
    int labels[9];
    for (int epoch = 0; epoch < 2; epoch++) {
        cr_assert_eq(dataloader_next_batch(dl, images, labels, err), 0, "%s", err);
        int seen[3][4] = {{0}};
        for (int b = 0; b < 9; b++) {
            int v = pixel_byte(images + b * 9), c = labels[b], k = (v - 10 - 20 * c) / 5;
            cr_assert(c >= 0 && c < 3 && k >= 0 && k < class_count[c] && v == folder_value(c, k),
                      "image of value %d has label %d", v, c);
            seen[c][k]++;
        }
        for (int c = 0; c < 3; c++)
            for (int k = 0; k < class_count[c]; k++) cr_assert_eq(seen[c][k], 1, "epoch %d: class %d image %d", epoch, c, k);
        DataPosition pos = dataloader_position(dl);
        cr_assert_eq(pos.epoch, (uint64_t)epoch + 1);
        cr_assert_eq(pos.index, 0);
    }
    dataloader_close(dl);
}

// Runs a loader for n batches (optionally from a position) and returns the images and labels.
static void run_batches(const DataLoaderConfig *cfg, const DataPosition *from, int n, float *images, int *labels) {
    DataLoader *dl;
    char err[DIT_ERR_LEN];
    cr_assert_eq(dataloader_open(&dl, cfg, err), 0, "%s", err);
    if (from) cr_assert_eq(dataloader_seek(dl, *from, err), 0, "%s", err);
    size_t image_floats = (size_t)cfg->channels * cfg->image_size * cfg->image_size;
    for (int i = 0; i < n; i++) {
        cr_assert_eq(dataloader_next_batch(dl, images + i * cfg->batch_size * image_floats,
                                           labels + i * cfg->batch_size, err), 0, "%s", err);
    }
    dataloader_close(dl);
}

// Distinct random RGB images of random sizes in ROOT/<class>/, for order and resume tests.
static const char *write_random_folder(int n_images) {
    Rng rng;
    rng_seed(&rng, 99);
    for (int i = 0; i < n_images; i++) {
        int w = 3 + rng_u32(&rng) % 6, h = 3 + rng_u32(&rng) % 6;
        uint8_t px[8 * 8 * 3];
        for (int j = 0; j < w * h * 3; j++) px[j] = (uint8_t)(rng_u32(&rng) & 255);
        char rel[128];
        snprintf(rel, sizeof(rel), "rand/class_%d/%03d.png", i % 3, i);
        write_png(rel, w, h, 3, px);
    }
    static char root[512];
    snprintf(root, sizeof(root), "%s/rand", tmp_root);
    return root;
}

enum { ORDER_IMAGES = 11, ORDER_B = 4, ORDER_S = 4, ORDER_BATCHES = 9, ORDER_FLOATS = ORDER_BATCHES * ORDER_B * 3 * ORDER_S * ORDER_S };

Test(loader, order_is_deterministic_per_seed_and_changes_per_epoch) {
    DataLoaderConfig cfg = config(write_random_folder(ORDER_IMAGES), ORDER_S, 3, ORDER_B);
    cfg.random_flip = 1;
    static float a[ORDER_FLOATS], b[ORDER_FLOATS];
    int la[ORDER_BATCHES * ORDER_B], lb[ORDER_BATCHES * ORDER_B];
    run_batches(&cfg, NULL, ORDER_BATCHES, a, la);
    run_batches(&cfg, NULL, ORDER_BATCHES, b, lb);
    cr_assert_eq(memcmp(a, b, sizeof(a)), 0, "same seed, different batches");
    cr_assert_eq(memcmp(la, lb, sizeof(la)), 0);
    cfg.seed = 4321;
    run_batches(&cfg, NULL, ORDER_BATCHES, b, lb);
    cr_assert_neq(memcmp(a, b, sizeof(a)), 0, "another seed gives the same batches");
    // without flips, epochs 0 and 1 (images 0..10 and 11..21 of the stream) are different orders
    cfg.random_flip = 0;
    run_batches(&cfg, NULL, ORDER_BATCHES, b, lb);
    size_t floats = 3 * ORDER_S * ORDER_S;
    cr_assert_neq(memcmp(b, b + ORDER_IMAGES * floats, ORDER_IMAGES * floats * sizeof(float)), 0);
}

Test(loader, seek_to_a_saved_position_continues_the_same_batches) {
    DataLoaderConfig cfg = config(write_random_folder(ORDER_IMAGES), ORDER_S, 3, ORDER_B);
    cfg.random_flip = 1;
    static float full[ORDER_FLOATS], resumed[ORDER_FLOATS];
    int full_labels[ORDER_BATCHES * ORDER_B], resumed_labels[ORDER_BATCHES * ORDER_B];
    run_batches(&cfg, NULL, ORDER_BATCHES, full, full_labels);
    size_t batch_floats = (size_t)ORDER_B * 3 * ORDER_S * ORDER_S;
    for (int prefetch = 0; prefetch <= 2; prefetch += 2) {
        for (int k = 1; k < ORDER_BATCHES; k += 3) {  // mid-epoch and across epoch boundaries
            DataLoader *dl;
            char err[DIT_ERR_LEN];
            cfg.prefetch = 0;
            cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
            for (int i = 0; i < k; i++) cr_assert_eq(dataloader_next_batch(dl, resumed, resumed_labels, err), 0, "%s", err);
            DataPosition saved = dataloader_position(dl);
            dataloader_close(dl);
            cfg.prefetch = prefetch;
            run_batches(&cfg, &saved, ORDER_BATCHES - k, resumed, resumed_labels);
            cr_assert_eq(memcmp(resumed, full + k * batch_floats, (ORDER_BATCHES - k) * batch_floats * sizeof(float)), 0,
                         "resumed after %d batches (prefetch %d): different images", k, prefetch);
            cr_assert_eq(memcmp(resumed_labels, full_labels + k * ORDER_B, (ORDER_BATCHES - k) * ORDER_B * sizeof(int)), 0);
        }
    }
}

Test(loader, prefetch_gives_the_same_batches_and_positions_as_inline_loading) {
    DataLoaderConfig cfg = config(write_random_folder(ORDER_IMAGES), ORDER_S, 3, ORDER_B);
    cfg.random_flip = 1;
    DataLoader *inline_dl, *prefetch_dl;
    char err[DIT_ERR_LEN];
    cr_assert_eq(dataloader_open(&inline_dl, &cfg, err), 0, "%s", err);
    cfg.prefetch = 3;
    cr_assert_eq(dataloader_open(&prefetch_dl, &cfg, err), 0, "%s", err);
    float a[ORDER_B * 3 * ORDER_S * ORDER_S], b[ORDER_B * 3 * ORDER_S * ORDER_S];
    int la[ORDER_B], lb[ORDER_B];
    for (int i = 0; i < 3 * ORDER_BATCHES; i++) {
        DataPosition pa = dataloader_position(inline_dl), pb = dataloader_position(prefetch_dl);
        cr_assert(pa.epoch == pb.epoch && pa.index == pb.index && pa.rng_state == pb.rng_state, "batch %d: positions differ", i);
        cr_assert_eq(dataloader_next_batch(inline_dl, a, la, err), 0, "%s", err);
        cr_assert_eq(dataloader_next_batch(prefetch_dl, b, lb, err), 0, "%s", err);
        cr_assert_eq(memcmp(a, b, sizeof(a)), 0, "batch %d differs", i);
        cr_assert_eq(memcmp(la, lb, sizeof(la)), 0, "labels of batch %d differ", i);
    }
    // a seek while batches are prefetched: both continue from the same position
    DataPosition back = {1, 5, dataloader_position(inline_dl).rng_state};
    cr_assert_eq(dataloader_seek(inline_dl, back, err), 0, "%s", err);
    cr_assert_eq(dataloader_seek(prefetch_dl, back, err), 0, "%s", err);
    cr_assert_eq(dataloader_next_batch(inline_dl, a, la, err), 0, "%s", err);
    cr_assert_eq(dataloader_next_batch(prefetch_dl, b, lb, err), 0, "%s", err);
    cr_assert_eq(memcmp(a, b, sizeof(a)), 0);
    dataloader_close(inline_dl);
    dataloader_close(prefetch_dl);  // with a full ring: the thread waits and must stop cleanly
}

Test(loader, close_right_after_open_stops_the_prefetch_thread) {
    DataLoaderConfig cfg = config(DATALOADER_SYNTHETIC, 8, 3, 2);
    cfg.prefetch = 4;
    for (int i = 0; i < 20; i++) {
        DataLoader *dl;
        char err[DIT_ERR_LEN];
        cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
        dataloader_close(dl);
    }
}

Test(loader, mixed_sizes_channels_and_formats_are_converted) {
    uint8_t px[9 * 7 * 4];
    for (size_t i = 0; i < sizeof(px); i++) px[i] = (uint8_t)(i * 13);
    write_png("mixed/a/gray.png", 8, 8, 1, px);
    write_png("mixed/a/gray_alpha.png", 4, 4, 2, px);
    write_png("mixed/a/rgb.png", 5, 3, 3, px);
    write_png("mixed/b/rgba.png", 3, 7, 4, px);
    cr_assert(stbi_write_bmp(tmp_path("mixed/b/rgb.BMP"), 9, 7, 3, px));
    cr_assert(stbi_write_tga(tmp_path("mixed/b/rgba.tga"), 6, 5, 4, px));
    cr_assert(stbi_write_jpg(tmp_path("mixed/c/gray.jpeg"), 7, 9, 1, px, 90));
    cr_assert(stbi_write_jpg(tmp_path("mixed/c/rgb.jpg"), 6, 6, 3, px, 90));
    write_bytes("mixed/c/tiny.gif", tiny_gif, sizeof(tiny_gif));
    char root[512];
    snprintf(root, sizeof(root), "%s/mixed", tmp_root);
    for (int C = 1; C <= 3; C += 2) {
        DataLoaderConfig cfg = config(root, 5, C, 9);
        DataLoader *dl;
        char err[DIT_ERR_LEN];
        cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
        cr_assert_eq(dataloader_num_images(dl), 9);
        float images[9 * 3 * 25];
        int labels[9];
        cr_assert_eq(dataloader_next_batch(dl, images, labels, err), 0, "C=%d: %s", C, err);
        for (int i = 0; i < 9 * C * 25; i++) cr_assert(images[i] >= -1.0f && images[i] <= 1.0f);
        dataloader_close(dl);
    }
}

Test(loader, config_errors_name_the_field) {
    DataLoaderConfig cfg = config(DATALOADER_SYNTHETIC, 8, 2, 4);
    DataLoader *dl;
    char err[DIT_ERR_LEN];
    cr_assert_eq(dataloader_open(&dl, &cfg, err), -1);
    assert_contains(err, "channels must be 1 or 3");
    cfg = config(DATALOADER_SYNTHETIC, 8, 3, 0);
    cr_assert_eq(dataloader_open(&dl, &cfg, err), -1);
    assert_contains(err, "batch_size");
    cfg = config(DATALOADER_SYNTHETIC, 8, 3, 1);
    cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
    cr_assert_eq(dataloader_seek(dl, (DataPosition){0, SYNTHETIC_NUM_IMAGES, 1}, err), -1);
    assert_contains(err, "index <");
    dataloader_close(dl);
}

// ---- bad input -------------------------------------------------------------------------------

// Opens ROOT=tmp/<rel> (must succeed) and returns the error of the first batch (must fail).
static void first_batch_error(const char *rel, int B, int64_t max_pixels, char *err) {
    char root[512];
    snprintf(root, sizeof(root), "%s/%s", tmp_root, rel);
    DataLoaderConfig cfg = config(root, 4, 3, B);
    cfg.max_image_pixels = (int)max_pixels;
    DataLoader *dl;
    cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
    float images[16 * 48];
    int labels[16];
    cr_assert_eq(dataloader_next_batch(dl, images, labels, err), -1, "a bad file was accepted");
    char again[DIT_ERR_LEN];
    cr_assert_eq(dataloader_next_batch(dl, images, labels, again), -1, "the error is not sticky");
    cr_assert_str_eq(again, err);
    dataloader_close(dl);
}

static void open_error(const char *root, int skip, char *err) {
    DataLoaderConfig cfg = config(root, 4, 3, 1);
    cfg.skip_bad_images = skip;
    DataLoader *dl = (DataLoader *)1;
    cr_assert_eq(dataloader_open(&dl, &cfg, err), -1, "open of %s succeeded", root);
    cr_assert_null(dl);
}

Test(bad_input, zero_byte_file) {
    write_bytes("d/a/empty.png", "", 0);
    char err[DIT_ERR_LEN];
    first_batch_error("d", 1, 0, err);
    assert_contains(err, "d/a/empty.png");
    assert_contains(err, "empty file (0 bytes)");
}

Test(bad_input, truncated_png_and_jpeg) {
    // the header survives, the pixel data is cut at 2/3
    uint8_t px[16 * 16 * 3];
    for (size_t i = 0; i < sizeof(px); i++) px[i] = (uint8_t)(i * 7);
    write_png("tp/a/cut.png", 16, 16, 3, px);
    cr_assert(stbi_write_jpg(tmp_path("tj/a/cut.jpg"), 16, 16, 3, px, 90));
    const char *roots[2] = {"tp", "tj"}, *files[2] = {"tp/a/cut.png", "tj/a/cut.jpg"};
    const char *formats[2] = {"16x16 PNG", "16x16 JPEG"};
    for (int f = 0; f < 2; f++) {
        size_t n;
        uint8_t *data = read_whole(tmp_path(files[f]), &n);
        write_bytes(files[f], data, n * 2 / 3);
        free(data);
        char err[DIT_ERR_LEN];
        first_batch_error(roots[f], 1, 0, err);
        assert_contains(err, files[f]);
        assert_contains(err, formats[f]);
        assert_contains(err, "truncated");
    }
}

Test(bad_input, corrupt_pixel_data_and_corrupt_header) {
    uint8_t px[8 * 8];
    for (int i = 0; i < 64; i++) px[i] = (uint8_t)(i * 3);
    write_png("c/a/bad_data.png", 8, 8, 1, px);
    size_t n;
    uint8_t *data = read_whole(tmp_path("c/a/bad_data.png"), &n);
    uint8_t *idat = memmem(data, n, "IDAT", 4);
    cr_assert_not_null(idat);
    uint32_t idat_len = (uint32_t)idat[-4] << 24 | idat[-3] << 16 | idat[-2] << 8 | idat[-1];
    memset(idat + 4 + 2, 0xFF, idat_len - 2);  // deflate blocks of the reserved type 3
    write_bytes("c/a/bad_data.png", data, n);
    free(data);
    char err[DIT_ERR_LEN];
    first_batch_error("c", 1, 0, err);
    assert_contains(err, "c/a/bad_data.png");
    assert_contains(err, "8x8 PNG image (corrupt or truncated): stb_image: no reason given (invalid data)");

    const char header[] = "\x89PNG\r\n\x1a\n garbage where the IHDR chunk should be";
    write_bytes("h/a/bad_header.png", header, sizeof(header));
    first_batch_error("h", 1, 0, err);
    assert_contains(err, "h/a/bad_header.png: cannot read the PNG header (corrupt, truncated, or too large for "
                         "stb_image): stb_image: ");
}

Test(bad_input, non_image_file_with_an_image_name) {
    const char text[] = "name,label\nshirt,6\n";
    write_bytes("n/a/table.jpg", text, sizeof(text) - 1);
    char err[DIT_ERR_LEN];
    first_batch_error("n", 1, 0, err);
    assert_contains(err, "n/a/table.jpg: not a PNG, JPEG, BMP, TGA or GIF image");
    assert_contains(err, "stb_image: ");
}

Test(bad_input, images_over_the_pixel_limit) {
    write_flat_png("big/a/wide.png", 100, 60, 3, 9);
    char err[DIT_ERR_LEN];
    first_batch_error("big", 1, 5000, err);
    assert_contains(err, "big/a/wide.png: image is 100x60 = 6000 pixels, more than the limit of 5000 pixels");
    // a PNG header claiming 60000 x 5000 pixels is refused before any decoding (no huge allocation)
    const uint8_t huge[] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n', 0, 0, 0, 13, 'I', 'H', 'D', 'R',
                            0, 0, 0xEA, 0x60, 0, 0, 0x13, 0x88, 8, 2, 0, 0, 0, 0, 0, 0, 0,
                            0, 0, 0, 0, 'I', 'E', 'N', 'D', 0xAE, 0x42, 0x60, 0x82};
    write_bytes("huge/a/claims_huge.png", huge, sizeof(huge));
    first_batch_error("huge", 1, 0, err);
    assert_contains(err, "huge/a/claims_huge.png: image is 60000x5000 = 300000000 pixels, more than the limit of 67108864");
}

Test(bad_input, unreadable_file_and_class_folder) {
    if (geteuid() == 0) cr_skip_test("running as root: root can read files whatever their permissions");
    write_flat_png("p/a/locked.png", 4, 4, 1, 0);
    chmod(tmp_path("p/a/locked.png"), 0);
    char err[DIT_ERR_LEN];
    first_batch_error("p", 1, 0, err);
    assert_contains(err, "p/a/locked.png: cannot open: Permission denied");
    write_flat_png("q/a/ok.png", 4, 4, 1, 0);
    chmod(tmp_path("q/a/ok.png"), 0644);
    chmod(tmp_path("q/a"), 0);
    char root[512];
    snprintf(root, sizeof(root), "%s/q", tmp_root);
    open_error(root, 0, err);
    assert_contains(err, "q/a: cannot open the class folder: Permission denied");
}

Test(bad_input, path_that_does_not_exist) {
    char root[512], err[DIT_ERR_LEN];
    snprintf(root, sizeof(root), "%s/no/such/folder", tmp_root);
    open_error(root, 0, err);
    assert_contains(err, "no/such/folder: cannot open the data folder: No such file or directory");
}

Test(bad_input, empty_class_folder) {
    write_flat_png("e/a_full/x.png", 4, 4, 1, 0);
    mkdir(tmp_path("e/b_empty/x"), 0755);
    write_bytes("e/b_empty/readme.txt", "no images here", 14);
    char root[512], err[DIT_ERR_LEN];
    snprintf(root, sizeof(root), "%s/e", tmp_root);
    open_error(root, 0, err);
    assert_contains(err, "e/b_empty: empty class folder: no image files");
    // skip_bad_images: a warning, and the class keeps its label
    DataLoaderConfig cfg = config(root, 4, 1, 1);
    cfg.skip_bad_images = 1;
    DataLoader *dl;
    cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
    cr_assert_eq(dataloader_num_classes(dl), 2);
    cr_assert_str_eq(dataloader_class_name(dl, 1), "b_empty");
    cr_assert_eq(dataloader_num_images(dl), 1);
    dataloader_close(dl);
}

Test(bad_input, dataset_without_images_or_class_folders) {
    char root[512], err[DIT_ERR_LEN];
    tmp_path("none/x");  // creates the folder "none" only
    snprintf(root, sizeof(root), "%s/none", tmp_root);
    open_error(root, 1, err);
    assert_contains(err, "none: no class folders; expected");
    write_bytes("none/a/a.txt", "x", 1);
    write_bytes("none/b/.b.png", "x", 1);
    open_error(root, 1, err);
    assert_contains(err, "none: dataset has no images: its 2 class folders contain no files ending in png");
}

// ROOT "s" with four good images (values 10, 20, 30, 40 in classes a, b) and two bad ones
static void write_folder_with_bad_files(void) {
    write_flat_png("s/a/1.png", 4, 4, 1, 10);
    write_flat_png("s/a/2.png", 4, 4, 1, 20);
    write_flat_png("s/b/3.png", 4, 4, 1, 30);
    write_flat_png("s/b/4.png", 4, 4, 1, 40);
    write_bytes("s/a/zero.png", "", 0);
    write_bytes("s/b/text.gif", "hello", 5);
}

Test(bad_input, stop_on_the_first_bad_file_by_default) {
    write_folder_with_bad_files();
    char err[DIT_ERR_LEN];
    first_batch_error("s", 6, 0, err);  // one batch visits every file
    cr_assert(strstr(err, "s/a/zero.png: empty file") || strstr(err, "s/b/text.gif: not a PNG"), "%s", err);
}

Test(bad_input, skip_bad_images_counts_per_epoch_and_keeps_prefetch_equal) {
    write_folder_with_bad_files();
    char root[512];
    snprintf(root, sizeof(root), "%s/s", tmp_root);
    float first[2][4 * 16];
    for (int prefetch = 0; prefetch <= 1; prefetch++) {
        DataLoaderConfig cfg = config(root, 4, 1, 2);
        cfg.skip_bad_images = 1;
        cfg.prefetch = prefetch;
        DataLoader *dl;
        char err[DIT_ERR_LEN];
        cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
        cr_assert_eq(dataloader_num_images(dl), 6);
        int seen[4] = {0};
        for (int batch = 0; batch < 2; batch++) {  // 4 good images = one epoch
            float images[2 * 16];
            int labels[2];
            cr_assert_eq(dataloader_next_batch(dl, images, labels, err), 0, "%s", err);
            memcpy(first[prefetch] + batch * 32, images, sizeof(images));
            for (int b = 0; b < 2; b++) {
                int v = pixel_byte(images + b * 16);
                cr_assert(v == 10 || v == 20 || v == 30 || v == 40, "a skipped image gave value %d", v);
                cr_assert_eq(labels[b], v / 30, "value %d label %d", v, labels[b]);
                seen[v / 10 - 1]++;
            }
        }
        for (int i = 0; i < 4; i++) cr_assert_eq(seen[i], 1);
        DataPosition pos = dataloader_position(dl);
        // the epoch ended at its last file unless the last file was bad and comes after the batch
        cr_assert(dataloader_num_skipped(dl) >= 1 && dataloader_num_skipped(dl) <= 2);
        if (pos.epoch == 1) cr_assert_eq(dataloader_num_skipped(dl), 2);
        float images[2 * 16];
        int labels[2];
        for (int batch = 0; batch < 4; batch++) cr_assert_eq(dataloader_next_batch(dl, images, labels, err), 0, "%s", err);
        cr_assert_geq(dataloader_num_skipped(dl), 4, "two epochs visited, skipped %lld", (long long)dataloader_num_skipped(dl));
        dataloader_close(dl);
    }
    cr_assert_eq(memcmp(first[0], first[1], sizeof(first[0])), 0, "prefetch changed the batches");
}

Test(bad_input, skip_bad_images_fails_when_every_image_is_bad) {
    write_bytes("allbad/a/zero.png", "", 0);
    write_bytes("allbad/a/text.png", "text", 4);
    write_bytes("allbad/b/half.bmp", "BM", 2);
    char root[512], err[DIT_ERR_LEN];
    snprintf(root, sizeof(root), "%s/allbad", tmp_root);
    for (int prefetch = 0; prefetch <= 2; prefetch += 2) {
        DataLoaderConfig cfg = config(root, 4, 3, 1);
        cfg.skip_bad_images = 1;
        cfg.prefetch = prefetch;
        DataLoader *dl;
        cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
        float images[48];
        int labels[1];
        cr_assert_eq(dataloader_next_batch(dl, images, labels, err), -1, "all bad, but a batch came back");
        assert_contains(err, "allbad: all 3 images of epoch 0 are bad; the last one: ");
        assert_contains(err, "allbad/");
        dataloader_close(dl);
    }
}

// ---- the synthetic dataset --------------------------------------------------------------

Test(synthetic, deterministic_labelled_and_in_range) {
    DataLoaderConfig cfg = config(DATALOADER_SYNTHETIC, 16, 3, 20);
    DataLoader *dl;
    char err[DIT_ERR_LEN];
    cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
    cr_assert_eq(dataloader_num_classes(dl), 10);
    cr_assert_eq(dataloader_num_images(dl), SYNTHETIC_NUM_IMAGES);
    cr_assert_str_eq(dataloader_class_name(dl, 0), "0_disk");
    cr_assert_str_eq(dataloader_class_name(dl, 9), "9_two_blobs");
    dataloader_close(dl);
    float a[3 * 16 * 16], b[3 * 16 * 16];
    synthetic_render(5, 123, 16, 3, 0, a);
    synthetic_render(5, 123, 16, 3, 0, b);
    cr_assert_eq(memcmp(a, b, sizeof(a)), 0);
    synthetic_render(6, 123, 16, 3, 0, b);
    cr_assert_neq(memcmp(a, b, sizeof(a)), 0, "the seed does not change the images");
    for (int i = 0; i < 3 * 256; i++) cr_assert(a[i] >= -1.0f && a[i] <= 1.0f);
    cr_assert_eq(synthetic_label(123), 3);
}

// Classes are learnable: a nearest-class-mean classifier on gray 16x16 images (features: the
// image and its horizontal and vertical gradients' magnitudes) beats chance (10%) by far.
Test(synthetic, classes_are_distinguishable) {
    enum { S = 16, P = S * S, F = 3 * P, TRAIN = 2000, TEST = 1000 };
    static double mean[10][F];
    static float img[P], feat[F];
    int count[10] = {0};
    for (int i = 0; i < TRAIN + TEST; i++) {
        synthetic_render(1, i, S, 1, 0, img);
        // contrast-normalized: the foreground is darker or lighter at random, so use |x - mean|
        double m = 0;
        for (int p = 0; p < P; p++) m += img[p] / P;
        for (int y = 0; y < S; y++)
            for (int x = 0; x < S; x++) {
                int p = y * S + x;
                feat[p] = fabsf(img[p] - (float)m);
                feat[P + p] = x + 1 < S ? fabsf(img[p + 1] - img[p]) : 0.0f;
                feat[2 * P + p] = y + 1 < S ? fabsf(img[p + S] - img[p]) : 0.0f;
            }
        int label = synthetic_label(i);
        if (i < TRAIN) {
            for (int f = 0; f < F; f++) mean[label][f] += feat[f];
            count[label]++;
            if (i == TRAIN - 1)
                for (int c = 0; c < 10; c++)
                    for (int f = 0; f < F; f++) mean[c][f] /= count[c];
            continue;
        }
        int best = -1;
        double best_d = INFINITY;
        for (int c = 0; c < 10; c++) {
            double d = 0;
            for (int f = 0; f < F; f++) d += (feat[f] - mean[c][f]) * (feat[f] - mean[c][f]);
            if (d < best_d) best_d = d, best = c;
        }
        count[label] += 1000 * (best == label);  // correct answers counted in thousands
    }
    int correct = 0;
    for (int c = 0; c < 10; c++) correct += count[c] / 1000;
    cr_assert_gt(correct, TEST * 3 / 10, "nearest-mean accuracy %d / %d (chance is 10%%)", correct, TEST);
}

// ---- the image grid and the data preview -------------------------------------------------

Test(grid, tiles_values_and_captions) {
    enum { N = 3, C = 3, S = 32, COLS = 2 };
    static float images[N * C * S * S];
    for (int i = 0; i < N * C * S * S; i++) images[i] = (float)((i % 7) - 3) / 3.0f;  // -1 .. 1
    const char *captions[N] = {"0_T-shirt_top", "9_Ankle_boot", "a_very_long_caption_that_gets_cut"};
    char err[DIT_ERR_LEN];
    const char *path = tmp_path("grid.png");
    cr_assert_eq(write_image_grid_png(path, images, N, C, S, COLS, captions, err), 0, "%s", err);
    int w, h;
    uint8_t *png = load_rgb(path, &w, &h);
    int zoom = 3, tile = S * zoom, pad = 2, band = 13;  // 96-pixel tiles for S = 32
    cr_assert_eq(w, COLS * (tile + pad) + pad);
    cr_assert_eq(h, 2 * (tile + band + pad) + pad);
    // image 2 (second row, first column), channel 1, pixel (y=5, x=7)
    int x0 = pad, y0 = pad + (tile + band + pad);
    float v = images[(2 * C + 1) * S * S + 5 * S + 7];
    int expect = (int)((v + 1.0f) * 127.5f + 0.5f);
    for (int dy = 0; dy < zoom; dy++)
        for (int dx = 0; dx < zoom; dx++)
            cr_assert_eq(png[((y0 + 5 * zoom + dy) * w + x0 + 7 * zoom + dx) * 3 + 1], expect);
    // caption bands: text pixels under every tile, none outside the text's box
    for (int i = 0; i < N; i++) {
        int bx = pad + (i % COLS) * (tile + pad), by = pad + (i / COLS) * (tile + band + pad) + tile;
        int text = 0;
        for (int y = by; y < by + band; y++)
            for (int x = bx; x < bx + tile; x++) text += png[(y * w + x) * 3] > 200;
        cr_assert_gt(text, 20, "caption %d has %d text pixels", i, text);
    }
    stbi_image_free(png);
    // without captions there is no band; a one-channel grid works too
    cr_assert_eq(write_image_grid_png(path, images, 4, 1, S, 4, NULL, err), 0, "%s", err);
    png = load_rgb(path, &w, &h);
    stbi_image_free(png);
    cr_assert_eq(h, tile + 2 * pad);
    cr_assert_eq(write_image_grid_png(path, images, 0, 1, S, 4, NULL, err), -1);
    cr_assert_eq(write_image_grid_png("/nonexistent/dir/grid.png", images, 1, 1, S, 1, NULL, err), -1);
    assert_contains(err, "/nonexistent/dir/grid.png: cannot write");
}

Test(grid, preview_writes_training_samples_and_keeps_the_position) {
    DataLoaderConfig cfg = config(DATALOADER_SYNTHETIC, 24, 3, 4);
    cfg.prefetch = 2;
    cfg.random_flip = 1;
    DataLoader *dl;
    char err[DIT_ERR_LEN];
    cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
    float batch[4 * 3 * 24 * 24];
    int labels[4];
    cr_assert_eq(dataloader_next_batch(dl, batch, labels, err), 0, "%s", err);
    DataPosition before = dataloader_position(dl);
    const char *path = tmp_path("preview.png");
    cr_assert_eq(dataloader_preview_png(dl, path, 10, err), 0, "%s", err);
    DataPosition after = dataloader_position(dl);
    cr_assert(before.epoch == after.epoch && before.index == after.index && before.rng_state == after.rng_state);
    int w, h;
    uint8_t *png = load_rgb(path, &w, &h);
    // 10 images: 4 columns of 24 * 4 = 96-pixel tiles, 3 rows; tile 0 is the first training image
    cr_assert_eq(w, 4 * 98 + 2);
    cr_assert_eq(h, 3 * (96 + 13 + 2) + 2);
    DataLoaderConfig fresh = cfg;
    fresh.prefetch = 0;
    DataLoader *dl2;
    cr_assert_eq(dataloader_open(&dl2, &fresh, err), 0, "%s", err);
    cr_assert_eq(dataloader_next_batch(dl2, batch, labels, err), 0, "%s", err);
    int expect = (int)((batch[0] + 1.0f) * 127.5f + 0.5f);
    cr_assert_eq(png[(2 * w + 2) * 3], expect);
    stbi_image_free(png);
    dataloader_close(dl2);
    dataloader_close(dl);
}

// ---- throughput (run by hand) ----------------------------------------------------------------
// DITC_BENCH_DATA=data/fashion-mnist build/test_dataloader --filter 'bench/*' --jobs 1
// prints decoded-and-preprocessed images/s, inline and with the prefetch thread, for 64 batches
// of 256 at S = 32 (RGB: the gray files are converted).

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

Test(bench, images_per_second, .timeout = 600) {
    const char *root = getenv("DITC_BENCH_DATA");
    if (!root) cr_skip_test("set DITC_BENCH_DATA=<image folder> to measure decoded images/s");
    enum { B = 256, S = 32, BATCHES = 64 };
    static float images[B * 3 * S * S];
    int labels[B];
    for (int prefetch = 0; prefetch <= 4; prefetch += 4) {
        DataLoaderConfig cfg = config(root, S, 3, B);
        cfg.random_flip = 1;
        cfg.prefetch = prefetch;
        DataLoader *dl;
        char err[DIT_ERR_LEN];
        cr_assert_eq(dataloader_open(&dl, &cfg, err), 0, "%s", err);
        double t0 = now_seconds();
        for (int i = 0; i < BATCHES; i++) cr_assert_eq(dataloader_next_batch(dl, images, labels, err), 0, "%s", err);
        double seconds = now_seconds() - t0;
        printf("bench: %s, prefetch %d: %d images in %.2f s = %.0f images/s\n", root, prefetch, B * BATCHES,
               seconds, B * BATCHES / seconds);
        dataloader_close(dl);
    }
}
