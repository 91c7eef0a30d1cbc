// make data: converts Fashion-MNIST's train split (IDX files, gzip'd, from Debian's package
// dataset-fashion-mnist) into an image folder of 28x28 gray PNGs that the data loader reads:
//   OUT/<k>_<class_name>/<index>.png, k = 0..9 the official label, index = position in the file.
// usage: make_fashion_mnist [SRC_DIR (/usr/share/datasets/fashion-mnist)] [OUT (data/fashion-mnist)]
// The folder is written as OUT.partial and renamed at the end, so OUT is always complete.
#include "dataloader/image_grid.h"  // links the stb_image_write implementation
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stb/stb_image_write.h>

static const char *const class_names[10] = {
    "0_T-shirt_top", "1_Trouser", "2_Pullover", "3_Dress", "4_Coat",
    "5_Sandal", "6_Shirt", "7_Sneaker", "8_Bag", "9_Ankle_boot",
};

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "make_fashion_mnist: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

// Reads the whole gzip'd file through `gzip -dc` (no zlib dependency).
static uint8_t *read_gzip(const char *path, size_t *len) {
    if (access(path, R_OK) != 0) {
        die("cannot read %s (%s). Fashion-MNIST comes from Debian's package dataset-fashion-mnist: "
            "sudo apt-get install dataset-fashion-mnist", path, strerror(errno));
    }
    if (strchr(path, '\'')) die("%s: a path with a single quote is not supported", path);
    char cmd[4200];
    snprintf(cmd, sizeof(cmd), "gzip -dc '%s'", path);
    FILE *pipe = popen(cmd, "r");
    if (!pipe) die("cannot run %s: %s", cmd, strerror(errno));
    size_t cap = 1 << 20, n = 0, got;
    uint8_t *buf = malloc(cap);
    while (buf && (got = fread(buf + n, 1, cap - n, pipe)) > 0) {
        n += got;
        if (n == cap) buf = realloc(buf, cap *= 2);
    }
    if (!buf) die("out of memory reading %s", path);
    if (pclose(pipe) != 0) die("%s: gzip -dc failed (corrupt file?)", path);
    *len = n;
    return buf;
}

static uint32_t be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]; }

static void make_dir(const char *path) {
    if (mkdir(path, 0755) != 0 && errno != EEXIST) die("cannot create %s: %s", path, strerror(errno));
}

int main(int argc, char **argv) {
    const char *src = argc > 1 ? argv[1] : "/usr/share/datasets/fashion-mnist";
    const char *out = argc > 2 ? argv[2] : "data/fashion-mnist";
    struct stat st;
    if (stat(out, &st) == 0) {
        printf("make_fashion_mnist: %s already exists; remove it to convert again\n", out);
        return 0;
    }
    char images_path[2048], labels_path[2048], partial[2048], path[2300];
    snprintf(images_path, sizeof(images_path), "%s/train-images-idx3-ubyte.gz", src);
    snprintf(labels_path, sizeof(labels_path), "%s/train-labels-idx1-ubyte.gz", src);
    snprintf(partial, sizeof(partial), "%s.partial", out);
    size_t images_len, labels_len;
    uint8_t *images = read_gzip(images_path, &images_len);
    uint8_t *labels = read_gzip(labels_path, &labels_len);
    // IDX: magic 0x00000803 (uint8, 3 dims) n, rows, cols; labels 0x00000801 (uint8, 1 dim) n
    if (images_len < 16 || be32(images) != 0x803) die("%s: not an IDX file of 3-d uint8 images", images_path);
    if (labels_len < 8 || be32(labels) != 0x801) die("%s: not an IDX file of uint8 labels", labels_path);
    uint32_t n = be32(images + 4), rows = be32(images + 8), cols = be32(images + 12);
    if (rows != 28 || cols != 28 || images_len != 16 + (size_t)n * rows * cols)
        die("%s: expected 28x28 images filling the file", images_path);
    if (be32(labels + 4) != n || labels_len != 8 + (size_t)n)
        die("%s: the label count does not match %s", labels_path, images_path);

    // the parent of OUT (e.g. data/) may not exist yet
    char parent[2048];
    snprintf(parent, sizeof(parent), "%s", out);
    char *slash = strrchr(parent, '/');
    if (slash) { *slash = '\0'; make_dir(parent); }
    make_dir(partial);
    for (int k = 0; k < 10; k++) {
        snprintf(path, sizeof(path), "%s/%s", partial, class_names[k]);
        make_dir(path);
    }
    for (uint32_t i = 0; i < n; i++) {
        uint8_t label = labels[8 + i];
        if (label > 9) die("%s: a label is not in 0..9", labels_path);
        snprintf(path, sizeof(path), "%s/%s/%05u.png", partial, class_names[label], i);
        if (!stbi_write_png(path, 28, 28, 1, images + 16 + (size_t)i * 784, 28)) die("cannot write %s: %s", path, strerror(errno));
    }
    if (rename(partial, out) != 0) die("cannot rename %s to %s", partial, out);
    printf("make_fashion_mnist: wrote %u images in 10 class folders to %s\n", n, out);
    free(images);
    free(labels);
    return 0;
}
