// Flow-matching (rectified flow) inputs and the MSE loss on the predicted velocity.
#include "layers/layers.h"

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
