#include "dataloader/image_folder.h"
#include "layers/common.h"
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#define IMAGE_EXTENSIONS "png, jpg, jpeg, bmp, tga, gif"

int image_folder_has_image_extension(const char *name) {
    static const char *const extensions[] = {".png", ".jpg", ".jpeg", ".bmp", ".tga", ".gif"};
    size_t n = strlen(name);
    for (size_t i = 0; i < sizeof(extensions) / sizeof(extensions[0]); i++) {
        size_t e = strlen(extensions[i]);
        if (n > e && strcasecmp(name + n - e, extensions[i]) == 0) return 1;
    }
    return 0;
}

// A growable list of malloc'd strings.
typedef struct { char **items; int64_t count, capacity; } StringList;

static int string_list_push(StringList *list, char *s) {
    if (!s) return -1;
    if (list->count == list->capacity) {
        int64_t capacity = list->capacity ? 2 * list->capacity : 64;
        char **items = realloc(list->items, sizeof(char *) * capacity);
        if (!items) { free(s); return -1; }
        list->items = items;
        list->capacity = capacity;
    }
    list->items[list->count++] = s;
    return 0;
}

static void string_list_free(StringList *list) {
    for (int64_t i = 0; i < list->count; i++) free(list->items[i]);
    free(list->items);
    *list = (StringList){0};
}

static int compare_strings(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static char *join_path(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *s = malloc(n);
    if (s) snprintf(s, n, "%s/%s", dir, name);
    return s;
}

// Names in dir that are not hidden and pass keep(dir, name), sorted.
static int list_dir(const char *dir, int (*keep)(const char *dir, const char *name),
                    StringList *out, const char *what, char *err) {
    DIR *d = opendir(dir);
    if (!d) {
        dit_set_error(err, "%s: cannot open the %s: %s", dir, what, strerror(errno));
        return -1;
    }
    struct dirent *entry;
    errno = 0;
    while ((entry = readdir(d)) != NULL) {
        if (entry->d_name[0] == '.' || !keep(dir, entry->d_name)) continue;
        if (string_list_push(out, strdup(entry->d_name)) != 0) {
            dit_set_error(err, "%s: out of memory listing the %s", dir, what);
            closedir(d);
            return -1;
        }
        errno = 0;
    }
    int read_errno = errno;
    closedir(d);
    if (read_errno) {
        dit_set_error(err, "%s: cannot read the %s: %s", dir, what, strerror(read_errno));
        return -1;
    }
    qsort(out->items, out->count, sizeof(char *), compare_strings);
    return 0;
}

static int is_directory(const char *dir, const char *name) {
    char *path = join_path(dir, name);
    struct stat st;
    int yes = path && stat(path, &st) == 0 && S_ISDIR(st.st_mode);
    free(path);
    return yes;
}

static int is_image_name(const char *dir, const char *name) {
    (void)dir;
    return image_folder_has_image_extension(name);
}

int image_folder_scan(ImageFolder *folder, const char *root, int allow_empty_classes, char *err) {
    *folder = (ImageFolder){0};
    StringList classes = {0}, paths = {0};
    int *labels = NULL;
    int64_t labels_capacity = 0;
    if (list_dir(root, is_directory, &classes, "data folder", err) != 0) goto fail;
    if (classes.count == 0) {
        dit_set_error(err, "%s: no class folders; expected %s/<class_name>/*.{%s}", root, root, IMAGE_EXTENSIONS);
        goto fail;
    }
    for (int64_t c = 0; c < classes.count; c++) {
        char *class_dir = join_path(root, classes.items[c]);
        StringList files = {0};
        int rc = class_dir ? list_dir(class_dir, is_image_name, &files, "class folder", err) : -1;
        if (!class_dir) dit_set_error(err, "%s: out of memory", root);
        if (rc == 0 && files.count == 0) {
            if (!allow_empty_classes) {
                dit_set_error(err, "%s: empty class folder: no image files (%s)", class_dir, IMAGE_EXTENSIONS);
                rc = -1;
            } else {
                fprintf(stderr, "dataloader: warning: %s: empty class folder (label %lld has no images)\n",
                        class_dir, (long long)c);
            }
        }
        for (int64_t i = 0; rc == 0 && i < files.count; i++) {
            if (paths.count == labels_capacity) {
                labels_capacity = labels_capacity ? 2 * labels_capacity : 64;
                int *grown = realloc(labels, sizeof(int) * labels_capacity);
                if (grown) labels = grown;
                else rc = -1;
            }
            if (rc == 0) {
                labels[paths.count] = (int)c;
                rc = string_list_push(&paths, join_path(class_dir, files.items[i]));
            }
            if (rc != 0) dit_set_error(err, "%s: out of memory listing images", class_dir);
        }
        string_list_free(&files);
        free(class_dir);
        if (rc != 0) goto fail;
    }
    if (paths.count == 0) {
        dit_set_error(err, "%s: dataset has no images: its %lld class folders contain no files ending in %s",
                      root, (long long)classes.count, IMAGE_EXTENSIONS);
        goto fail;
    }
    folder->num_classes = (int)classes.count;
    folder->class_names = classes.items;
    folder->num_images = paths.count;
    folder->paths = paths.items;
    folder->labels = labels;
    return 0;
fail:
    string_list_free(&classes);
    string_list_free(&paths);
    free(labels);
    return -1;
}

void image_folder_free(ImageFolder *folder) {
    for (int c = 0; c < folder->num_classes; c++) free(folder->class_names[c]);
    for (int64_t i = 0; i < folder->num_images; i++) free(folder->paths[i]);
    free(folder->class_names);
    free(folder->paths);
    free(folder->labels);
    *folder = (ImageFolder){0};
}
