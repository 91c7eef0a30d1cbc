// Sampling: integrate the learned velocity field from noise (t = 1) to data (t = 0).
#pragma once
#include "model/dit.h"

#ifdef __cplusplus
extern "C" {
#endif

// Euler steps of dx/dt = v(x, t) from t = 1 to t = 0 with classifier-free guidance:
// v = v_uncond + cfg_scale·(v_cond - v_uncond) (v_uncond uses the null label; cfg_scale = 1 is
// plain conditional sampling). x: (n, C, S, S), noise in, images out. Uses weights w
// (m->ema to sample from the EMA) and m's activations, in chunks of m->batch images.
int dit_sample(Dit *m, const DitParams *w, float *x, const int *labels, int n, int steps,
               float cfg_scale, char *err);

#ifdef __cplusplus
}
#endif
