// Euler sampler with classifier-free guidance.
#include <stdlib.h>
#include <string.h>
#include "layers/common.h"
#include "model/sample.h"

int dit_sample(Dit *m, const DitParams *w, float *x, const int *labels, int n, int steps,
               float cfg_scale, char *err) {
    const DitConfig *c = &m->cfg;
    size_t img = (size_t)c->channels * c->image_size * c->image_size;
    int chunk = m->batch;
    float *t = malloc(chunk * sizeof(float));
    float *v_cond = malloc(chunk * img * sizeof(float));
    int *null_labels = malloc(chunk * sizeof(int));
    if (!t || !v_cond || !null_labels) {
        dit_set_error(err, "sampling: out of memory for %d images", chunk);
        free(t); free(v_cond); free(null_labels);
        return -1;
    }
    for (int i = 0; i < chunk; i++) null_labels[i] = c->num_classes;
    for (int start = 0; start < n; start += chunk) {
        int B = n - start < chunk ? n - start : chunk;
        float *xb = x + start * img;
        for (int s = 0; s < steps; s++) {
            float t_now = 1.0f - (float)s / steps, dt = 1.0f / steps;
            for (int i = 0; i < B; i++) t[i] = t_now;
            dit_forward(m, w, xb, t, labels + start, B);
            memcpy(v_cond, m->acts.out, B * img * sizeof(float));
            if (cfg_scale != 1.0f) {
                dit_forward(m, w, xb, t, null_labels, B);
                const float *v_uncond = m->acts.out;
                for (size_t j = 0; j < B * img; j++)
                    v_cond[j] = v_uncond[j] + cfg_scale * (v_cond[j] - v_uncond[j]);
            }
            for (size_t j = 0; j < B * img; j++) xb[j] -= dt * v_cond[j];
        }
    }
    free(t); free(v_cond); free(null_labels);
    return 0;
}
