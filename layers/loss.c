// Flow-matching (rectified flow): the per-step randomness, the inputs, and the MSE loss on the
// predicted velocity.
#include <math.h>
#include "layers/layers.h"

void flow_matching_sample(Rng *rng, int *labels, float *t, float *noise, int B, size_t n_per_sample,
                          float label_dropout, int null_label, int uniform_t) {
    for (int b = 0; b < B; b++)
        if (rng_uniform(rng) < label_dropout) labels[b] = null_label;
    for (int b = 0; b < B; b++)
        t[b] = uniform_t ? rng_uniform(rng) : 1.0f / (1.0f + expf(-rng_normal(rng)));
    rng_fill_normal(rng, noise, (size_t)B * n_per_sample, 1.0f);
}

void flow_matching_inputs(float *x_t, float *v_target, const float *x0, const float *noise,
                          const float *t, int B, int n_per_sample) {
    for (int b = 0; b < B; b++)
        for (int i = 0; i < n_per_sample; i++) {
            size_t j = (size_t)b * n_per_sample + i;
            x_t[j] = (1.0f - t[b]) * x0[j] + t[b] * noise[j];
            v_target[j] = noise[j] - x0[j];
        }
}

float mse_loss_forward_backward(float *dpred, const float *pred, const float *target, size_t n) {
    double loss = 0.0;
    for (size_t i = 0; i < n; i++) {
        float diff = pred[i] - target[i];
        loss += (double)diff * diff;
        if (dpred) dpred[i] = 2.0f * diff / (float)n;
    }
    return (float)(loss / n);
}
