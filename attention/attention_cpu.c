// Exact attention on the CPU in fp32: the reference the sage definition and the GPU kernels
// are compared with. Plain loops over (b, h) and query rows; no scratch memory.
#include "attention/attention.h"
#include <math.h>
#include <stddef.h>
#include <string.h>

static float dot(const float *a, const float *b, int D) {
    float sum = 0.0f;
    for (int d = 0; d < D; d++) sum += a[d] * b[d];
    return sum;
}

// q, k, v, out: (B, H, N, D); lse: (B, H, N).
// s_ij = c·q_i·k_j with c = log2(e)/sqrt(D) (base-2 logits); two passes per query row:
// m_i = max_j s_ij, then l_i = Σ_j 2^(s_ij - m_i), out_i = Σ_j 2^(s_ij - m_i)·v_j / l_i,
// lse_i = m_i + log2(l_i).
void attention_forward(float *out, float *lse,
                       const float *q, const float *k, const float *v,
                       int B, int H, int N, int D) {
    const float c = (1.0f / sqrtf((float)D)) * 1.44269504f;
    for (int bh = 0; bh < B * H; bh++) {
        const float *qh = q + (size_t)bh * N * D;
        const float *kh = k + (size_t)bh * N * D;
        const float *vh = v + (size_t)bh * N * D;
        for (int i = 0; i < N; i++) {
            const float *qi = qh + (size_t)i * D;
            float *oi = out + ((size_t)bh * N + i) * D;
            float m = -INFINITY;
            for (int j = 0; j < N; j++) m = fmaxf(m, c * dot(qi, kh + (size_t)j * D, D));
            float l = 0.0f;
            memset(oi, 0, (size_t)D * sizeof(float));
            for (int j = 0; j < N; j++) {
                float p = exp2f(c * dot(qi, kh + (size_t)j * D, D) - m);
                l += p;
                const float *vj = vh + (size_t)j * D;
                for (int d = 0; d < D; d++) oi[d] += p * vj[d];
            }
            for (int d = 0; d < D; d++) oi[d] /= l;
            lse[(size_t)bh * N + i] = m + log2f(l);
        }
    }
}

// Shapes as in attention_forward; dq, dk, dv are accumulated into (+=).
// Per row i: P_ij = 2^(s_ij - lse_i), Dr_i = Σ_d dout_id·out_id; for every key j:
// dv_j += P_ij·dout_i; dP_ij = dout_i·v_j; dS_ij = P_ij·(dP_ij - Dr_i);
// dq_i += dS_ij·k_j/sqrt(D); dk_j += dS_ij·q_i/sqrt(D).
void attention_backward(float *dq, float *dk, float *dv,
                        const float *dout, const float *q, const float *k, const float *v,
                        const float *out, const float *lse,
                        int B, int H, int N, int D) {
    const float c = (1.0f / sqrtf((float)D)) * 1.44269504f;
    const float scale = 1.0f / sqrtf((float)D);
    for (int bh = 0; bh < B * H; bh++) {
        size_t head = (size_t)bh * N * D;
        for (int i = 0; i < N; i++) {
            const float *qi = q + head + (size_t)i * D;
            const float *doi = dout + head + (size_t)i * D;
            float *dqi = dq + head + (size_t)i * D;
            float row_lse = lse[(size_t)bh * N + i];
            float dr = dot(doi, out + head + (size_t)i * D, D);
            for (int j = 0; j < N; j++) {
                const float *kj = k + head + (size_t)j * D;
                const float *vj = v + head + (size_t)j * D;
                float *dkj = dk + head + (size_t)j * D;
                float *dvj = dv + head + (size_t)j * D;
                float p = exp2f(c * dot(qi, kj, D) - row_lse);
                float ds = p * (dot(doi, vj, D) - dr);
                for (int d = 0; d < D; d++) {
                    dvj[d] += p * doi[d];
                    dqi[d] += ds * scale * kj[d];
                    dkj[d] += ds * scale * qi[d];
                }
            }
        }
    }
}
