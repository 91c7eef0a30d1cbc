// Per-tensor FP8 scaling, shared by the CPU definition (layers/linear_fp8.c) and the CUDA kernels
// (layers/linear_fp8_cuda.cu) so that both compute the same scale from the same amax.
//
// A tensor x is stored as q = fp8(x·2^-e) with the power-of-two scale s = 2^e, e the smallest
// integer with amax(|x|)·2^-e <= FP8_MAX (448 for e4m3, 57344 for e5m2), clamped to [-126, 127];
// e = 0 when amax is 0 or not finite. A power of two makes x·2^-e and the dequantization q·s exact
// in fp32, so the only rounding is the fp8 one (and the GPU's bytes equal the CPU's), at the cost
// of at most one binade of e4m3's range left unused at the top (the largest |x| lands in
// (FP8_MAX/2, FP8_MAX]).
#pragma once
#include <math.h>

#ifdef __CUDACC__
#define FP8_HOST_DEVICE __host__ __device__
#else
#define FP8_HOST_DEVICE
#endif

typedef enum { FP8_E4M3 = 0, FP8_E5M2 = 1 } Fp8Format;

// The exponent e of the scale 2^e for a tensor whose largest magnitude is amax.
static inline FP8_HOST_DEVICE int fp8_scale_exponent(float amax, Fp8Format format) {
    if (!(amax > 0.0f) || isinf(amax)) return 0;
    int ea;
    float f = frexpf(amax, &ea);                     // amax = f·2^ea, f in [0.5, 1)
    // FP8_MAX = 0.875·2^9 (e4m3: 448) or 0.875·2^16 (e5m2: 57344)
    int e = ea - (format == FP8_E4M3 ? 9 : 16) + (f > 0.875f ? 1 : 0);
    return e < -126 ? -126 : e > 127 ? 127 : e;
}

// A guessed scale with headroom (Fp8Scaling.headroom = H >= 0, layers/linear_fp8_cuda.h): a pass
// quantizes with a guessed exponent and keeps it when it lies in [e, e + 2H], e =
// fp8_scale_exponent of the amax the pass took (no value saturates: amax·2^-used <= FP8_MAX;
// at most 2H binades of range left unused at the bottom); otherwise it quantizes again with e + H.
// The next guess is e + H. H = 0 is current scaling exactly.
static inline FP8_HOST_DEVICE int fp8_guess_kept(int used, int e, int headroom) {
    return used >= e && used <= e + 2 * headroom;
}
static inline FP8_HOST_DEVICE int fp8_next_guess(int e, int headroom) {
    return e + headroom > 127 ? 127 : e + headroom;
}

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---- CPU definition (layers/linear_fp8.c): the spec of layers/linear_fp8_cuda.h -------------
// out (n) = fp8(x·2^-e)·2^e, the values an FP8 GEMM multiplies (exact in fp32); returns the scale
// 2^e. out may be x. Rounding: round_to_e4m3 / round_to_e5m2 (attention/sage_cpu.c).
float fp8_fake_quantize(float *out, const float *x, size_t n, Fp8Format format);

// The FP8 linear layer: linear_forward / linear_backward (layers/layers.h) on the fake-quantized
// operands, fp32 sums; Q4 = e4m3, Qg = grad_format (the GPU uses e5m2), each with its own
// per-tensor scale from the tensor's current amax.
// out (M, OC) = Q4(inp)·Q4(weight)ᵀ + bias (bias (OC) in full precision, may be NULL).
void linear_fp8_forward(float *out, const float *inp, const float *weight, const float *bias,
                        int M, int IC, int OC);
// dinp += Qg(dout)·Q4(weight); dweight += Qg(dout)ᵀ·Q4(inp); dbias += Σ_m dout (not quantized).
// dinp and dbias may be NULL. On out-of-memory for the quantized copies: a message on stderr and
// NaN in every output.
void linear_fp8_backward(float *dinp, float *dweight, float *dbias,
                         const float *dout, const float *inp, const float *weight,
                         int M, int IC, int OC, Fp8Format grad_format);

#ifdef __cplusplus
}
#endif
