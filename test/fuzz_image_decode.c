// libFuzzer target over the decode-and-preprocess path of the data loader (image_decode):
// any bytes must give either a valid (C, S, S) image in [-1, 1] or an error message, never a
// crash, a leak or an over-large allocation.
// Input: byte 0 picks the output (S = 1 + bits 0-5, C = 3 if bit 6 else 1, flip = bit 7);
// the rest is the encoded image. The seed corpus (test/corpus/image_decode) holds small PNG,
// JPEG, BMP, TGA and GIF files with such a first byte.
#include "dataloader/image_decode.h"
#include "layers/common.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_MAX_PIXELS (1 << 20)  // keeps every allocation small under AddressSanitizer

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int S = 1 + (data[0] & 63), C = (data[0] & 64) ? 3 : 1, flip = data[0] >> 7;
    float *out = malloc(sizeof(float) * C * S * S);
    char err[DIT_ERR_LEN];
    if (image_decode(data + 1, size - 1, "fuzz", FUZZ_MAX_PIXELS, S, C, flip, out, err) == 0) {
        for (int i = 0; i < C * S * S; i++) {
            if (!(out[i] >= -1.0f && out[i] <= 1.0f)) __builtin_trap();  // out of range or NaN
        }
    } else if (err[0] == '\0' || memchr(err, '\0', sizeof(err)) == NULL) {
        __builtin_trap();  // a failure must say why
    }
    free(out);
    return 0;
}
