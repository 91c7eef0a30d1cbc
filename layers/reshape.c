// Reshapes between images, tokens and attention heads (forward and backward).
#include "layers/layers.h"

void patchify_forward(float *patches, const float *img, int B, int Cin, int S, int p) {
    int G = S / p, T = G * G, P = Cin * p * p;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            int gy = t / G, gx = t % G;
            float *out = patches + ((size_t)b * T + t) * P;
            for (int c = 0; c < Cin; c++)
                for (int py = 0; py < p; py++)
                    for (int px = 0; px < p; px++)
                        *out++ = img[(((size_t)b * Cin + c) * S + gy * p + py) * S + gx * p + px];
        }
}

// Index of pixel (c, y, x) of image b inside the (py, px, c)-ordered token layout.
static size_t unpatchify_index(int b, int c, int y, int x, int Cout, int S, int p) {
    int G = S / p, t = (y / p) * G + x / p;
    return (((size_t)b * G * G + t) * p * p + (y % p) * p + x % p) * Cout + c;
}

void unpatchify_forward(float *img, const float *tokens, int B, int Cout, int S, int p) {
    for (int b = 0; b < B; b++)
        for (int c = 0; c < Cout; c++)
            for (int y = 0; y < S; y++)
                for (int x = 0; x < S; x++)
                    img[(((size_t)b * Cout + c) * S + y) * S + x] =
                        tokens[unpatchify_index(b, c, y, x, Cout, S, p)];
}

void unpatchify_backward(float *dtokens, const float *dimg, int B, int Cout, int S, int p) {
    for (int b = 0; b < B; b++)
        for (int c = 0; c < Cout; c++)
            for (int y = 0; y < S; y++)
                for (int x = 0; x < S; x++)
                    dtokens[unpatchify_index(b, c, y, x, Cout, S, p)] +=
                        dimg[(((size_t)b * Cout + c) * S + y) * S + x];
}

void split_heads_forward(float *q, float *k, float *v, const float *qkv, int B, int T, int H, int D) {
    int C = H * D;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++) {
                const float *src = qkv + ((size_t)b * T + t) * 3 * C + h * D;
                size_t dst = (((size_t)b * H + h) * T + t) * D;
                for (int d = 0; d < D; d++) {
                    q[dst + d] = src[d];
                    k[dst + d] = src[C + d];
                    v[dst + d] = src[2 * C + d];
                }
            }
}

void split_heads_backward(float *dqkv, const float *dq, const float *dk, const float *dv,
                          int B, int T, int H, int D) {
    int C = H * D;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++) {
                float *dst = dqkv + ((size_t)b * T + t) * 3 * C + h * D;
                size_t src = (((size_t)b * H + h) * T + t) * D;
                for (int d = 0; d < D; d++) {
                    dst[d] += dq[src + d];
                    dst[C + d] += dk[src + d];
                    dst[2 * C + d] += dv[src + d];
                }
            }
}

void merge_heads_forward(float *out, const float *o, int B, int T, int H, int D) {
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++)
                for (int d = 0; d < D; d++)
                    out[((size_t)b * T + t) * H * D + h * D + d] = o[(((size_t)b * H + h) * T + t) * D + d];
}

void merge_heads_backward(float *do_, const float *dout, int B, int T, int H, int D) {
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++)
                for (int d = 0; d < D; d++)
                    do_[(((size_t)b * H + h) * T + t) * D + d] += dout[((size_t)b * T + t) * H * D + h * D + d];
}
