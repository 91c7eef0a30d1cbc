// An image-folder dataset on disk: ROOT/<class_name>/*.{png,jpg,jpeg,bmp,tga,gif}.
// Classes sorted by name give the labels 0, 1, ...; files are sorted by name within a class.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int num_classes;
    char **class_names;    // (num_classes) folder names, sorted by strcmp
    int64_t num_images;
    char **paths;          // (num_images) "ROOT/<class>/<file>", grouped by class, sorted
    int *labels;           // (num_images) class index of each path
} ImageFolder;

// 1 when the file name ends in an image extension (case-insensitive), else 0.
int image_folder_has_image_extension(const char *name);

// Lists ROOT. Hidden entries (".name") are ignored, and so are files whose extension is not
// an image extension. Fails for a root that does not exist or cannot be read, a root without
// class folders, a class folder that cannot be read, a class folder without images (unless
// allow_empty_classes: then a warning on stderr and the class keeps its label), and a dataset
// without any image.
int image_folder_scan(ImageFolder *folder, const char *root, int allow_empty_classes, char *err);
void image_folder_free(ImageFolder *folder);

#ifdef __cplusplus
}
#endif
