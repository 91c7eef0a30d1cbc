// The douts of the FP8 linears that layers compute, quantized by the passes that compute them
// (layers/linear_fp8_cuda.h; the machinery in layers/fp8_dout.cuh): the dGELU (the MLP's fc1) and the
// gated residual's dh (fc2, proj).
#include "layers/fp8_dout.cuh"

// dpre = bf16(GELU'(pre)·d), as rows_dbias_kernel<ROWS_DGELU> stores it; d: fc2's dinp GEMM output.
struct GeluGradSource {
    const bf16 *d, *pre;
    int C;
    bool vec;
    static constexpr bool SHUFFLES = false;
    static constexpr int BLOCKS_PER_SM = 4;   // (64 registers)
    struct Rows { Bf16x8 d[DOUT_LOAD_ROWS], pre[DOUT_LOAD_ROWS]; };
    __device__ __forceinline__ void load(Rows &r, int i, int m, int o, int n) const {
        if (n <= 0) return;
        r.d[i] = load_bf16x8_raw(d + (size_t)m * C + o, n, vec);
        r.pre[i] = load_bf16x8_raw(pre + (size_t)m * C + o, n, vec);
    }
    __device__ __forceinline__ void values(float v[VEC], const Rows &r, int i, int, int, int) const {
        float x[VEC], y[VEC];
        unpack_bf16x8(x, r.d[i]);
        unpack_bf16x8(y, r.pre[i]);
        for (int j = 0; j < VEC; j++) v[j] = bf16_rounded(gelu_grad(y[j]) * x[j]);
    }
};

// dh = bf16(gate_b·dout), b = m / T, as rows_dbias_kernel<ROWS_GATE> stores it.
struct GatedDhSource {
    const bf16 *dout, *gate;
    int C, T, mod_stride;
    bool vec, gate_vec;
    static constexpr bool SHUFFLES = false;
    static constexpr int BLOCKS_PER_SM = 4;
    struct Rows { Bf16x8 dout[DOUT_LOAD_ROWS], gate[DOUT_LOAD_ROWS]; };
    __device__ __forceinline__ void load(Rows &r, int i, int m, int o, int n) const {
        if (n <= 0) return;
        r.dout[i] = load_bf16x8_raw(dout + (size_t)m * C + o, n, vec);
        r.gate[i] = load_bf16x8_raw(gate + (size_t)(m / T) * mod_stride + o, n, gate_vec);
    }
    __device__ __forceinline__ void values(float v[VEC], const Rows &r, int i, int, int, int) const {
        float x[VEC], g[VEC];
        unpack_bf16x8(x, r.dout[i]);
        unpack_bf16x8(g, r.gate[i]);
        for (int j = 0; j < VEC; j++) v[j] = bf16_rounded(g[j] * x[j]);
    }
};

int gelu_backward_fp8_cuda(const Fp8Dout *out, const bf16 *d, const bf16 *pre, float *dbias, int M, int C,
                           Fp8Format format, const Fp8Scaling *scaling, const LayersCuda *ctx, cudaStream_t stream,
                           char *err) {
    GeluGradSource src = {d, pre, C, aligned16(d) && aligned16(pre)};
    return launch_fp8_dout("gelu_backward_fp8_cuda", src, M, C, out, dbias, format, scaling, ctx, stream, err);
}

int gated_dh_fp8_cuda(const Fp8Dout *dh, const bf16 *dout, const bf16 *gate, int B, int T, int C, int mod_stride,
                      float *dbias, Fp8Format format, const Fp8Scaling *scaling, const LayersCuda *ctx,
                      cudaStream_t stream, char *err) {
    if (B <= 0 || T <= 0 || mod_stride < C || (long long)B * T > INT32_MAX) {
        dit_set_error(err, "gated_dh_fp8_cuda: need B, T >= 1, B·T < 2^31 and mod_stride >= C (B=%d T=%d C=%d "
                      "mod_stride=%d)", B, T, C, mod_stride);
        return -1;
    }
    GatedDhSource src = {dout, gate, C, T, mod_stride, aligned16(dout), mod_stride % VEC == 0 && aligned16(gate)};
    return launch_fp8_dout("gated_dh_fp8_cuda", src, B * T, C, dh, dbias, format, scaling, ctx, stream, err);
}
