// AdamW, global gradient norm (for clipping) and the EMA of the weights.
#include <math.h>
#include "layers/layers.h"

float global_norm(const float *g, size_t n) {
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) sum += (double)g[i] * g[i];
    return (float)sqrt(sum);
}

float clip_grad_scale(float norm, float max_norm) {
    if (max_norm <= 0.0f) return 1.0f;
    float scale = max_norm / (norm + 1e-6f);
    return scale < 1.0f ? scale : 1.0f;
}

void adamw_update(float *params, const float *grads, float *m, float *v, size_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay,
                  float grad_scale, int step) {
    float bias1 = 1.0f - powf(beta1, (float)step);
    float bias2 = 1.0f - powf(beta2, (float)step);
    for (size_t i = 0; i < n; i++) {
        float g = grads[i] * grad_scale;
        params[i] -= lr * weight_decay * params[i];
        m[i] = beta1 * m[i] + (1.0f - beta1) * g;
        v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
        params[i] -= lr * (m[i] / bias1) / (sqrtf(v[i] / bias2) + eps);
    }
}

float ema_decay_warmup(float decay, int step) {
    float warm = (1.0f + step) / (10.0f + step);
    return warm < decay ? warm : decay;
}

void ema_update(float *ema, const float *params, size_t n, float decay) {
    for (size_t i = 0; i < n; i++) ema[i] = decay * ema[i] + (1.0f - decay) * params[i];
}
