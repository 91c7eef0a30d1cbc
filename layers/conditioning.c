// Conditioning and position: timestep features, class embedding, 2D sin-cos positions.
#include <math.h>
#include "layers/layers.h"

void timestep_embedding_forward(float *out, const float *t, int B, int dim) {
    int half = dim / 2;
    for (int b = 0; b < B; b++) {
        float tau = 1000.0f * t[b];
        for (int k = 0; k < half; k++) {
            float freq = expf(-logf(10000.0f) * (float)k / (float)half);
            out[(size_t)b * dim + k] = cosf(tau * freq);
            out[(size_t)b * dim + half + k] = sinf(tau * freq);
        }
    }
}

void embedding_forward(float *out, const float *table, const int *labels, int B, int C) {
    for (int b = 0; b < B; b++)
        for (int c = 0; c < C; c++) out[(size_t)b * C + c] = table[(size_t)labels[b] * C + c];
}

void embedding_backward(float *dtable, const float *dout, const int *labels, int B, int C) {
    for (int b = 0; b < B; b++)
        for (int c = 0; c < C; c++) dtable[(size_t)labels[b] * C + c] += dout[(size_t)b * C + c];
}

void pos_embed_2d(float *out, int G, int C) {
    int quarter = C / 4;
    for (int i = 0; i < G; i++)
        for (int j = 0; j < G; j++) {
            float *e = out + ((size_t)i * G + j) * C;
            for (int k = 0; k < quarter; k++) {
                double omega = 1.0 / pow(10000.0, (double)k / quarter);
                e[k] = (float)sin(j * omega);                 // column, first half
                e[quarter + k] = (float)cos(j * omega);
                e[2 * quarter + k] = (float)sin(i * omega);   // row, second half
                e[3 * quarter + k] = (float)cos(i * omega);
            }
        }
}
