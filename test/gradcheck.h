// Central finite differences for gradient checks of the CPU layers (header-only, tests only).
// A check defines a scalar loss L = Σ_i w_i·forward(...)_i with random weights w: the forward runs
// in fp32, the sum is taken in double (gc_dot). gc_numeric_grad perturbs one tensor element by
// element and gives dL/dx in double; gc_rel_error compares an analytic gradient with it.
#pragma once
#include <math.h>
#include <stddef.h>

// Evaluates the forward of the layer under test on its current inputs and returns L.
typedef double (*gc_loss_fn)(void *ctx);

// Σ_i w_i·out_i, accumulated in double.
static inline double gc_dot(const float *w, const float *out, size_t n) {
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) sum += (double)w[i] * out[i];
    return sum;
}

// grad_i = (L(x + h·e_i) - L(x - h·e_i)) / (x_i⁺ - x_i⁻) for every element of x (n floats),
// dividing by the step actually taken in fp32. x is restored exactly afterwards.
static inline void gc_numeric_grad(double *grad, float *x, size_t n, float h,
                                   gc_loss_fn loss, void *ctx) {
    for (size_t i = 0; i < n; i++) {
        float saved = x[i];
        float plus = saved + h, minus = saved - h;
        x[i] = plus;
        double loss_plus = loss(ctx);
        x[i] = minus;
        double loss_minus = loss(ctx);
        x[i] = saved;
        grad[i] = (loss_plus - loss_minus) / ((double)plus - (double)minus);
    }
}

// ‖a - ref‖₂ / ‖ref‖₂ (‖a‖₂ when ref is all zeros, so that a zero reference still checks a).
static inline double gc_rel_error(const float *a, const double *ref, size_t n) {
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        diff += d * d;
        norm += ref[i] * ref[i];
    }
    return norm > 0.0 ? sqrt(diff / norm) : sqrt(diff);
}
