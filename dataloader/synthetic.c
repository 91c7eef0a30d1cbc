#include "dataloader/synthetic.h"
#include "layers/common.h"
#include <math.h>

static const char *const class_names[SYNTHETIC_NUM_CLASSES] = {
    "0_disk", "1_square", "2_triangle", "3_ring", "4_cross",
    "5_h_stripes", "6_v_stripes", "7_diagonal_stripes", "8_checkerboard", "9_two_blobs",
};

const char *synthetic_class_name(int label) {
    return label >= 0 && label < SYNTHETIC_NUM_CLASSES ? class_names[label] : NULL;
}

int synthetic_label(int64_t index) { return (int)(index % SYNTHETIC_NUM_CLASSES); }

// Coverage in [0, 1] of the foreground at (u, v) in [0, 1)^2 (v grows downwards) for a class;
// p holds the image's random parameters: center (p[0], p[1]), size p[2], frequency p[3],
// phases p[4], p[5], and a second center (p[6], p[7]).
static float shape_mask(int label, float u, float v, const float *p) {
    float du = u - p[0], dv = v - p[1], r = p[2];
    switch (label) {
    case 0: return du * du + dv * dv < r * r;
    case 1: return fabsf(du) < r && fabsf(dv) < r;
    case 2: return dv > -r && dv < r && fabsf(du) < 0.5f * (dv + r);  // apex up
    case 3: { float d = sqrtf(du * du + dv * dv); return d < r && d > 0.6f * r; }
    case 4: return (fabsf(du) < r && fabsf(dv) < 0.3f * r) || (fabsf(dv) < r && fabsf(du) < 0.3f * r);
    case 5: return fmodf(v * p[3] + p[4], 1.0f) < 0.5f;
    case 6: return fmodf(u * p[3] + p[4], 1.0f) < 0.5f;
    case 7: return fmodf((u + v) * p[3] * 0.7f + p[4], 1.0f) < 0.5f;
    case 8: return ((int)floorf(u * p[3] + p[4]) + (int)floorf(v * p[3] + p[5])) % 2 == 0;
    default: {
        float s2 = 2.0f * (0.5f * r) * (0.5f * r);
        float d1 = du * du + dv * dv;
        float eu = u - p[6], ev = v - p[7], d2 = eu * eu + ev * ev;
        return fmaxf(expf(-d1 / s2), expf(-d2 / s2));
    }
    }
}

void synthetic_render(uint64_t seed, int64_t index, int S, int C, int flip, float *out) {
    Rng rng;
    rng_seed(&rng, seed ^ ((uint64_t)index * 0xD1B54A32D192ED03ull));
    int label = synthetic_label(index);
    // colors: a light background with a dark foreground or the reverse, so shapes always show
    int light = rng_u32(&rng) & 1;
    float bg[3], fg[3];
    for (int c = 0; c < 3; c++) {
        bg[c] = light ? 0.7f + 0.3f * rng_uniform(&rng) : 0.3f * rng_uniform(&rng);
        fg[c] = light ? 0.5f * rng_uniform(&rng) : 0.5f + 0.5f * rng_uniform(&rng);
    }
    float p[8];
    p[0] = 0.3f + 0.4f * rng_uniform(&rng);
    p[1] = 0.3f + 0.4f * rng_uniform(&rng);
    p[2] = 0.15f + 0.15f * rng_uniform(&rng);
    p[3] = 3.0f + 3.0f * rng_uniform(&rng);
    p[4] = rng_uniform(&rng);
    p[5] = rng_uniform(&rng);
    p[6] = 0.2f + 0.6f * rng_uniform(&rng);
    p[7] = 0.2f + 0.6f * rng_uniform(&rng);
    for (int y = 0; y < S; y++) {
        for (int x = 0; x < S; x++) {
            float u = (x + 0.5f) / S, v = (y + 0.5f) / S;
            float m = shape_mask(label, u, v, p);
            float rgb[3];
            for (int c = 0; c < 3; c++) rgb[c] = bg[c] + (fg[c] - bg[c]) * m;
            int ox = flip ? S - 1 - x : x;
            if (C == 1) {
                float luma = 0.299f * rgb[0] + 0.587f * rgb[1] + 0.114f * rgb[2];
                out[(size_t)y * S + ox] = 2.0f * luma - 1.0f;
            } else {
                for (int c = 0; c < 3; c++) out[((size_t)c * S + y) * S + ox] = 2.0f * rgb[c] - 1.0f;
            }
        }
    }
}
