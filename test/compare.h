// Error measures shared by the tests, accumulated in double. A NaN anywhere fails every
// threshold: rel_l2 and max_abs_diff return +inf, cosine returns -1.
#pragma once
#include <math.h>
#include <stddef.h>

// ‖x − ref‖₂ / ‖ref‖₂ (0 when both are zero, +inf when only ref is).
static inline double rel_l2(const float *x, const float *ref, size_t n) {
    double err = 0, norm = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)x[i] - ref[i];
        err += d * d;
        norm += (double)ref[i] * ref[i];
    }
    if (isnan(err) || isnan(norm)) return INFINITY;
    if (norm == 0) return err == 0 ? 0 : INFINITY;
    return sqrt(err / norm);
}

// ⟨x, ref⟩ / (‖x‖₂·‖ref‖₂)
static inline double cosine(const float *x, const float *ref, size_t n) {
    double xr = 0, xx = 0, rr = 0;
    for (size_t i = 0; i < n; i++) {
        xr += (double)x[i] * ref[i];
        xx += (double)x[i] * x[i];
        rr += (double)ref[i] * ref[i];
    }
    double c = xr / sqrt(xx * rr);
    return isnan(c) ? -1 : c;
}

// max_i |x_i − ref_i|
static inline double max_abs_diff(const float *x, const float *ref, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)x[i] - ref[i]);
        if (isnan(d)) return INFINITY;
        m = d > m ? d : m;
    }
    return m;
}
