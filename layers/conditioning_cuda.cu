// Conditioning and position: timestep features, class embedding, 2D sin-cos positions.
// The sines take arguments up to 1000 (τ = 1000·t), where the fast single-precision sine of
// --use_fast_math loses digits, so sin and cos are taken in double (tiny tensors).
#include "layers/cuda_common.cuh"
#include "layers/cuda_args.h"

// out (B, dim) = [cos(τ·f_k) | sin(τ·f_k)], τ = 1000·t_b, f_k = exp(-ln(10000)·k/half), k < half.
__global__ void timestep_embedding_kernel(bf16 *out, const float *t, int B, int half) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= B * half) return;
    int b = i / half, k = i % half;
    float freq = (float)exp(-log(10000.0) * k / half);
    double angle = (double)(1000.0f * t[b] * freq);   // the fp32 angle of the CPU reference
    out[(size_t)b * 2 * half + k] = __float2bfloat16((float)cos(angle));
    out[(size_t)b * 2 * half + half + k] = __float2bfloat16((float)sin(angle));
}

// out (B, C) = table[labels_b].
__global__ void embedding_forward_kernel(bf16 *out, const bf16 *table, const int *labels, int B, int C) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)B * C) return;
    int b = i / C, c = i % C;
    out[i] = table[(size_t)labels[b] * C + c];
}

// One thread per channel c, visiting the samples in order: dtable[labels_b][c] += dout[b][c].
// Repeated labels add up in sample order (deterministic, no atomics).
__global__ void embedding_backward_kernel(float *dtable, const bf16 *dout, const int *labels, int B, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int b = 0; b < B; b++)
        dtable[(size_t)labels[b] * C + c] += __bfloat162float(dout[(size_t)b * C + c]);
}

// out (G·G, C), token i·G + j: [sin(j·ω_k) | cos(j·ω_k) | sin(i·ω_k) | cos(i·ω_k)],
// ω_k = 10000^(-k/(C/4)), k < C/4; one thread per (token, k).
__global__ void pos_embed_2d_kernel(bf16 *out, int G, int C) {
    int quarter = C / 4;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= G * G * quarter) return;
    int token = idx / quarter, k = idx % quarter, i = token / G, j = token % G;
    double omega = 1.0 / pow(10000.0, (double)k / quarter);
    bf16 *e = out + (size_t)token * C;
    e[k] = __float2bfloat16((float)sin(j * omega));
    e[quarter + k] = __float2bfloat16((float)cos(j * omega));
    e[2 * quarter + k] = __float2bfloat16((float)sin(i * omega));
    e[3 * quarter + k] = __float2bfloat16((float)cos(i * omega));
}

int timestep_embedding_forward_cuda(bf16 *out, const float *t, int B, int dim,
                                    cudaStream_t stream, char *err) {
    if (B <= 0 || dim <= 0 || dim % 2) {
        dit_set_error(err, "timestep_embedding_forward_cuda: need B > 0 and an even dim > 0 (B=%d dim=%d)", B, dim);
        return -1;
    }
    if (check_product("timestep_embedding_forward_cuda", "B·dim/2", B, dim / 2, INT_MAX, err)) return -1;
    timestep_embedding_kernel<<<blocks_for((size_t)B * dim / 2, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(out, t, B, dim / 2);
    LAUNCH_CHECK(err, "timestep_embedding_kernel", "B=%d dim=%d", B, dim);
    return 0;
}

int embedding_forward_cuda(bf16 *out, const bf16 *table, const int *labels, int B, int C,
                           cudaStream_t stream, char *err) {
    if (B <= 0 || C <= 0) {
        dit_set_error(err, "embedding_forward_cuda: sizes must be positive (B=%d C=%d)", B, C);
        return -1;
    }
    if (check_grid_x("embedding_forward_cuda", (size_t)B * C, BLOCK_SIZE, err)) return -1;
    embedding_forward_kernel<<<blocks_for((size_t)B * C, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(out, table, labels, B, C);
    LAUNCH_CHECK(err, "embedding_forward_kernel", "B=%d C=%d", B, C);
    return 0;
}

int embedding_backward_cuda(float *dtable, const bf16 *dout, const int *labels, int B, int C,
                            cudaStream_t stream, char *err) {
    if (B <= 0 || C <= 0) {
        dit_set_error(err, "embedding_backward_cuda: sizes must be positive (B=%d C=%d)", B, C);
        return -1;
    }
    embedding_backward_kernel<<<blocks_for(C, BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(dtable, dout, labels, B, C);
    LAUNCH_CHECK(err, "embedding_backward_kernel", "B=%d C=%d", B, C);
    return 0;
}

int pos_embed_2d_cuda(bf16 *out, int G, int C, cudaStream_t stream, char *err) {
    if (G <= 0 || C <= 0 || C % 4) {
        dit_set_error(err, "pos_embed_2d_cuda: need G > 0 and C a positive multiple of 4 (G=%d C=%d)", G, C);
        return -1;
    }
    if (check_product("pos_embed_2d_cuda", "G·G·C/4", (long long)G * G, C / 4, INT_MAX, err)) return -1;
    pos_embed_2d_kernel<<<blocks_for((size_t)G * G * (C / 4), BLOCK_SIZE), BLOCK_SIZE, 0, stream>>>(out, G, C);
    LAUNCH_CHECK(err, "pos_embed_2d_kernel", "G=%d C=%d", G, C);
    return 0;
}
