// Reshapes between images, tokens and attention heads: one thread per element (patchify) or per
// VEC elements (heads), each output element written by exactly one thread (the backward passes
// too, so += needs no atomics).
#include "layers/cuda_common.cuh"
#include "layers/cuda_args.h"

// patches (B, T, Cin·p·p), T = G², G = S/p, element (b, t, j), j = (c, py, px):
// patches = img[b, c, gy·p + py, gx·p + px], t = gy·G + gx.
__global__ void patchify_forward_kernel(bf16 *patches, const bf16 *img, int Cin, int S, int p, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int G = S / p, T = G * G, P = Cin * p * p;
    int j = i % P, t = (i / P) % T;
    size_t b = i / ((size_t)T * P);
    int c = j / (p * p), py = (j / p) % p, px = j % p, gy = t / G, gx = t % G;
    patches[i] = img[((b * Cin + c) * S + gy * p + py) * S + gx * p + px];
}

// Index of pixel i = (b, c, y, x) of (B, Cout, S, S) inside the tokens (B, T, p·p·Cout) ordered
// (py, px, c): token t = (y/p)·G + x/p, position ((y%p)·p + x%p)·Cout + c.
__device__ inline size_t unpatchify_index(size_t i, int Cout, int S, int p) {
    int x = i % S, y = (i / S) % S, c = (i / ((size_t)S * S)) % Cout;
    size_t b = i / ((size_t)S * S * Cout);
    int G = S / p, t = (y / p) * G + x / p;
    return ((b * G * G + t) * p * p + (y % p) * p + x % p) * Cout + c;
}

// img[i] = tokens[unpatchify_index(i)].
__global__ void unpatchify_forward_kernel(bf16 *img, const bf16 *tokens, int Cout, int S, int p, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) img[i] = tokens[unpatchify_index(i, Cout, S, p)];
}

// dtokens[unpatchify_index(i)] += dimg[i] (a bijection: one writer per element).
__global__ void unpatchify_backward_kernel(bf16 *dtokens, const bf16 *dimg, int Cout, int S, int p, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    size_t j = unpatchify_index(i, Cout, S, p);
    dtokens[j] = __float2bfloat16(__bfloat162float(dtokens[j]) + __bfloat162float(dimg[i]));
}

// Element i = (b, t, which, h, d) of qkv (B, T, 3·H·D) goes to q/k/v[which] at ((b·H + h)·T + t)·D + d.
__device__ inline size_t head_index(size_t i, int T, int H, int D, int *which) {
    int C = H * D, j = i % (3 * C);
    size_t bt = i / (3 * C), b = bt / T;
    int t = bt % T, h = (j % C) / D, d = j % D;
    *which = j / C;
    return ((b * H + h) * T + t) * D + d;
}

// The head kernels move VEC consecutive elements i0 .. i0 + VEC - 1 per thread. When vec (D a
// multiple of VEC, pointers 16-byte aligned) the VEC elements lie in one head of one token, so
// both sides are one 16-byte vector; otherwise each element is placed on its own.
__global__ void split_heads_forward_kernel(bf16 *q, bf16 *k, bf16 *v, const bf16 *qkv, int T, int H, int D, size_t n,
                                           bool vec) {
    size_t i0 = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i0 >= n) return;
    int count = (int)min((size_t)VEC, n - i0), which;
    for (int j = 0; j < count; j += vec ? VEC : 1) {
        size_t dst = head_index(i0 + j, T, H, D, &which);
        bf16 *out = which == 0 ? q : which == 1 ? k : v;
        copy_bf16x8(out + dst, qkv + i0 + j, vec ? VEC : 1, vec);
    }
}

// dqkv[i] += dq/dk/dv[head_index(i)].
__global__ void split_heads_backward_kernel(bf16 *dqkv, const bf16 *dq, const bf16 *dk, const bf16 *dv,
                                            int T, int H, int D, size_t n, bool vec) {
    size_t i0 = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i0 >= n) return;
    int count = (int)min((size_t)VEC, n - i0), which;
    for (int j = 0; j < count; j += vec ? VEC : 1) {
        int len = vec ? VEC : 1;
        size_t src = head_index(i0 + j, T, H, D, &which);
        const bf16 *g = which == 0 ? dq : which == 1 ? dk : dv;
        float acc[VEC], add[VEC];
        load_bf16x8(acc, dqkv + i0 + j, len, vec);
        load_bf16x8(add, g + src, len, vec);
        for (int e = 0; e < VEC; e++) acc[e] += add[e];
        store_bf16x8(dqkv + i0 + j, acc, len, vec);
    }
}

// Element i = (b, t, h, d) of out (B, T, H·D) comes from o (B, H, T, D) at ((b·H + h)·T + t)·D + d.
__device__ inline size_t merged_index(size_t i, int T, int H, int D) {
    int C = H * D, j = i % C, h = j / D, d = j % D;
    size_t bt = i / C, b = bt / T;
    int t = bt % T;
    return ((b * H + h) * T + t) * D + d;
}

// AMAX: *out_amax = max(*out_amax, max |out|) (an FP8 linear quantizes out).
template <bool AMAX>
__global__ void merge_heads_forward_kernel(bf16 *out, float *out_amax, const bf16 *o, int T, int H, int D, size_t n,
                                           bool vec) {
    size_t i0 = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    float m = 0.0f;
    if (i0 < n) {
        int count = (int)min((size_t)VEC, n - i0);
        for (int j = 0; j < count; j += vec ? VEC : 1) {
            const bf16 *src = o + merged_index(i0 + j, T, H, D);
            copy_bf16x8(out + i0 + j, src, vec ? VEC : 1, vec);
            if (AMAX) {
                float v[VEC];
                load_bf16x8(v, src, vec ? VEC : 1, vec);
                for (int e = 0; e < VEC; e++) m = fmaxf(m, fabsf(v[e]));   // (the zeros beyond count add nothing)
            }
        }
    }
    if (AMAX) block_amax_update(out_amax, m);
}

// do_[merged_index(i)] += dout[i] (a bijection: one writer per element).
__global__ void merge_heads_backward_kernel(bf16 *do_, const bf16 *dout, int T, int H, int D, size_t n, bool vec) {
    size_t i0 = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i0 >= n) return;
    int count = (int)min((size_t)VEC, n - i0);
    for (int j = 0; j < count; j += vec ? VEC : 1) {
        int len = vec ? VEC : 1;
        size_t dst = merged_index(i0 + j, T, H, D);
        float acc[VEC], add[VEC];
        load_bf16x8(acc, do_ + dst, len, vec);
        load_bf16x8(add, dout + i0 + j, len, vec);
        for (int e = 0; e < VEC; e++) acc[e] += add[e];
        store_bf16x8(do_ + dst, acc, len, vec);
    }
}

static int check_image(const char *fn, int B, int Cimg, int S, int p, char *err) {
    if (B <= 0 || Cimg <= 0 || p <= 0 || S <= 0 || S % p) {
        dit_set_error(err, "%s: need positive sizes and S a multiple of p (B=%d C=%d S=%d p=%d)", fn, B, Cimg, S, p);
        return -1;
    }
    // the kernels index a patch (C·p·p) and the pixels of one channel (S·S) with int
    return check_product(fn, "C·p·p", Cimg, (long long)p * p, INT_MAX, err) ||
           check_product(fn, "S·S", S, S, INT_MAX, err) ||
           check_grid_x(fn, (size_t)B * Cimg * S * S, BLOCK_SIZE, err) ? -1 : 0;
}

static int check_heads(const char *fn, int B, int T, int H, int D, char *err) {
    if (B <= 0 || T <= 0 || H <= 0 || D <= 0) {
        dit_set_error(err, "%s: sizes must be positive (B=%d T=%d H=%d D=%d)", fn, B, T, H, D);
        return -1;
    }
    // a row of qkv (3·H·D) is indexed with int; at most one thread per element of (B, T, 3·H·D)
    return check_product(fn, "3·H·D", 3LL * H, D, INT_MAX, err) ||
           check_grid_x(fn, (size_t)B * T * 3 * H * D, BLOCK_SIZE, err) ? -1 : 0;
}

int patchify_forward_cuda(bf16 *patches, const bf16 *img, int B, int Cin, int S, int p,
                          cudaStream_t stream, char *err) {
    if (check_image("patchify_forward_cuda", B, Cin, S, p, err)) return -1;
    size_t n = (size_t)B * Cin * S * S;
    patchify_forward_kernel<<<blocks_for(n, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(patches, img, Cin, S, p, n);
    LAUNCH_CHECK(err, "patchify_forward_kernel", "B=%d Cin=%d S=%d p=%d", B, Cin, S, p);
    return 0;
}

int unpatchify_forward_cuda(bf16 *img, const bf16 *tokens, int B, int Cout, int S, int p,
                            cudaStream_t stream, char *err) {
    if (check_image("unpatchify_forward_cuda", B, Cout, S, p, err)) return -1;
    size_t n = (size_t)B * Cout * S * S;
    unpatchify_forward_kernel<<<blocks_for(n, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(img, tokens, Cout, S, p, n);
    LAUNCH_CHECK(err, "unpatchify_forward_kernel", "B=%d Cout=%d S=%d p=%d", B, Cout, S, p);
    return 0;
}

int unpatchify_backward_cuda(bf16 *dtokens, const bf16 *dimg, int B, int Cout, int S, int p,
                             cudaStream_t stream, char *err) {
    if (check_image("unpatchify_backward_cuda", B, Cout, S, p, err)) return -1;
    size_t n = (size_t)B * Cout * S * S;
    unpatchify_backward_kernel<<<blocks_for(n, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(dtokens, dimg, Cout, S, p, n);
    LAUNCH_CHECK(err, "unpatchify_backward_kernel", "B=%d Cout=%d S=%d p=%d", B, Cout, S, p);
    return 0;
}

int split_heads_forward_cuda(bf16 *q, bf16 *k, bf16 *v, const bf16 *qkv, int B, int T, int H, int D,
                             cudaStream_t stream, char *err) {
    if (check_heads("split_heads_forward_cuda", B, T, H, D, err)) return -1;
    size_t n = (size_t)B * T * 3 * H * D;
    bool vec = D % VEC == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(qkv);
    split_heads_forward_kernel<<<blocks_for(n, BLOCK_SIZE * VEC), BLOCK_SIZE, 0, stream>>>(
        q, k, v, qkv, T, H, D, n, vec);
    LAUNCH_CHECK(err, "split_heads_forward_kernel", "B=%d T=%d H=%d D=%d", B, T, H, D);
    return 0;
}

int split_heads_backward_cuda(bf16 *dqkv, const bf16 *dq, const bf16 *dk, const bf16 *dv,
                              int B, int T, int H, int D, cudaStream_t stream, char *err) {
    if (check_heads("split_heads_backward_cuda", B, T, H, D, err)) return -1;
    size_t n = (size_t)B * T * 3 * H * D;
    bool vec = D % VEC == 0 && aligned16(dqkv) && aligned16(dq) && aligned16(dk) && aligned16(dv);
    split_heads_backward_kernel<<<blocks_for(n, BLOCK_SIZE * VEC), BLOCK_SIZE, 0, stream>>>(
        dqkv, dq, dk, dv, T, H, D, n, vec);
    LAUNCH_CHECK(err, "split_heads_backward_kernel", "B=%d T=%d H=%d D=%d", B, T, H, D);
    return 0;
}

int merge_heads_forward_cuda(bf16 *out, const bf16 *o, int B, int T, int H, int D, float *out_amax,
                             cudaStream_t stream, char *err) {
    if (check_heads("merge_heads_forward_cuda", B, T, H, D, err)) return -1;
    size_t n = (size_t)B * T * H * D;
    bool vec = D % VEC == 0 && aligned16(out) && aligned16(o);
    auto kernel = out_amax ? merge_heads_forward_kernel<true> : merge_heads_forward_kernel<false>;
    kernel<<<blocks_for(n, BLOCK_SIZE * VEC), BLOCK_SIZE, 0, stream>>>(out, out_amax, o, T, H, D, n, vec);
    LAUNCH_CHECK(err, "merge_heads_forward_kernel", "B=%d T=%d H=%d D=%d", B, T, H, D);
    return 0;
}

int merge_heads_backward_cuda(bf16 *do_, const bf16 *dout, int B, int T, int H, int D,
                              cudaStream_t stream, char *err) {
    if (check_heads("merge_heads_backward_cuda", B, T, H, D, err)) return -1;
    size_t n = (size_t)B * T * H * D;
    bool vec = D % VEC == 0 && aligned16(do_) && aligned16(dout);
    merge_heads_backward_kernel<<<blocks_for(n, BLOCK_SIZE * VEC), BLOCK_SIZE, 0, stream>>>(do_, dout, T, H, D, n, vec);
    LAUNCH_CHECK(err, "merge_heads_backward_kernel", "B=%d T=%d H=%d D=%d", B, T, H, D);
    return 0;
}
