// Tests of the FP8 block linears in the GPU model (dit_gpu_create_sp with DIT_LINEAR_FP8:
// train_dit --linear fp8) against the same model with bf16 linears (DIT_LINEAR_BF16, the default,
// which test_dit_gpu_cuda.c checks against the CPU). GPU tests skip without an sm_89+ GPU.
//
// One training step from the same random weights (every tensor, test/model_test.h) and batch,
// exact attention on both sides (the bf16 flash kernel) so that only the linears differ, at 256
// tokens and at 100 (B·T = 200 rows, not a multiple of 16: the layer pads inpᵀ, doutᵀ). The
// tolerances come from the CPU model of the same step (dev/dit_fp8_accuracy.c: the fp32 CPU
// model with its block linears replaced by the CPU FP8 definition; same config, weights and batch;
// 2026-11-30): output rel L2 0.0205, loss rel 2.1e-4, gradients worst rel L2 0.0487 and cosine
// 0.99882 over the 31 tensors (0.0166 / 3.3e-4 / 0.0429 at hidden 384; 0.0163 / 6.6e-4 / 0.0474
// at 64 tokens). The GPU bf16 model adds its own ~6e-3 (output) to ~8e-3 (gradients) against fp32.
// - TOL_OUT 0.05 (2.4x), TOL_LOSS 5e-3 (a signed sum: 7x the largest of the three measured),
//   TOL_GRAD 0.1 per tensor (2x) with cosine >= 1 - TOL_GRAD²/2 = 0.995;
// - MIN_OUT 5e-3 from below: the FP8 GEMMs really ran (bf16 against itself differs by 0).
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>
#include "layers/common.h"
#include "layers/layers.h"
#include "attention/flash_cuda.h"
#include "model/dit.h"
#include "model/dit_gpu.h"
#include "test/compare.h"
#include "test/cuda_test.h"
#include "test/model_test.h"

#define TOL_OUT 0.05
#define MIN_OUT 5e-3
#define TOL_LOSS 5e-3
#define TOL_GRAD 0.1

// 32×32 images, patch 2: 256 tokens, head dim 64; B·T = 512 rows.
static const DitConfig fp8_config = {.image_size = 32, .channels = 3, .patch = 2, .hidden = 128,
                                     .depth = 2, .heads = 2, .num_classes = 5};
enum { B = 2 };   // images per step

static void require_fp8_gpu(void) {
    int count = 0, major = 0, minor = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) cr_skip_test("no CUDA GPU found");
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
    if (major * 10 + minor < 89) cr_skip_test("FP8 GEMMs need sm_89+ (this GPU is sm_%d%d)", major, minor);
}

// One step (forward, loss, backward) of a model created with `linear` from cpu's weights: the
// output (n floats), the loss and every parameter gradient. fused: FP8's fp8_fused_inputs (1:
// create's default; 0: the linears read stored bf16 inputs and take their own amax); headroom: its
// fp8_grad_headroom (DIT_FP8_GRAD_HEADROOM: create's default).
static float gpu_step(const Dit *cpu, DitLinear linear, int fused, int headroom, const float *x0,
                      const float *noise, const float *t, const int *labels, float *out, float *grads) {
    char err[DIT_ERR_LEN];
    DitGpu m;
    float loss;
    OK(dit_gpu_create_sp(&m, &cpu->cfg, B, DIT_ATTN_EXACT, linear, NULL, err));
    if (linear == DIT_LINEAR_FP8) cr_assert_eq(m.fp8_fused_inputs, 1, "create must turn the fused inputs on");
    if (linear == DIT_LINEAR_FP8)
        cr_assert_eq(m.fp8_grad_headroom, DIT_FP8_GRAD_HEADROOM, "create must set the default dout headroom");
    cr_assert_eq(m.ctx.fp8_accumulation, DIT_FP8_ACCUMULATION, "create must set the FP8 GEMMs' accumulation");
    m.fp8_fused_inputs = fused;
    m.fp8_grad_headroom = headroom;
    OK(dit_gpu_upload(&m, cpu, err));
    OK(dit_gpu_set_flow_batch(&m, x0, noise, t, labels, B, err));
    OK(dit_gpu_forward(&m, &m.weights, B, err));
    OK(dit_gpu_loss(&m, B, err));
    OK(dit_gpu_zero_grad(&m, err));
    OK(dit_gpu_backward(&m, B, err));
    OK(dit_gpu_read_scalars(&m, &loss, NULL, err));
    OK(dit_gpu_download_output(&m, out, B, err));
    OK(dit_gpu_download_grads(&m, grads, err));
    dit_gpu_free(&m);
    return loss;
}

// cpu: the model of config c with random weights (seed); *x0 and *noise: a batch of B images of
// N(0, 1) pixels each (returned, n floats each), drawn from rng (seeded from seed, left after them
// for the caller's t and labels). Returns n.
static size_t make_model_and_batch(Dit *cpu, const DitConfig *c, uint64_t seed, float **x0, float **noise, Rng *rng) {
    char err[DIT_ERR_LEN];
    OK(dit_create(cpu, c, 1, DIT_ATTN_EXACT, seed, err));
    randomize_params(cpu, seed);
    size_t n = (size_t)B * c->channels * c->image_size * c->image_size;
    *x0 = malloc(n * sizeof(float));
    *noise = malloc(n * sizeof(float));
    cr_assert(*x0 && *noise);
    rng_seed(rng, seed * 1000 + 1);
    rng_fill_normal(rng, *x0, n, 1.0f);
    rng_fill_normal(rng, *noise, n, 1.0f);
    return n;
}

// One step of both models from the same weights and batch against the bounds above.
static void check_one_step(const DitConfig *c) {
    require_fp8_gpu();
    Dit cpu;
    Rng rng;
    float *x0, *noise, t[B];
    int labels[B];
    size_t n = make_model_and_batch(&cpu, c, 21, &x0, &noise, &rng);   // the batch as dev/dit_fp8_accuracy.c
    for (int b = 0; b < B; b++) {
        t[b] = 0.05f + 0.9f * rng_uniform(&rng);
        labels[b] = (int)(rng_u32(&rng) % (uint32_t)(c->num_classes + 1));
    }
    float *out[2], *grads[2], loss[2];
    for (int k = 0; k < 2; k++) {
        out[k] = malloc(n * sizeof(float));
        grads[k] = malloc(cpu.num_params * sizeof(float));
        cr_assert(out[k] && grads[k]);
        loss[k] = gpu_step(&cpu, k == 0 ? DIT_LINEAR_BF16 : DIT_LINEAR_FP8, 1, DIT_FP8_GRAD_HEADROOM, x0, noise, t,
                           labels, out[k], grads[k]);
    }

    double e_out = rel_l2(out[1], out[0], n), e_loss = fabs(loss[1] - loss[0]) / loss[0];
    fprintf(stderr, "fp8 vs bf16 linears, %d tokens: output rel L2 %.4f, loss %.6f vs %.6f (rel %.2e)\n",
            dit_tokens(c), e_out, loss[1], loss[0], e_loss);
    cr_expect(e_out < TOL_OUT, "output: rel L2 %.4f >= %g", e_out, TOL_OUT);
    cr_expect(e_out > MIN_OUT, "output: rel L2 %.2e <= %g: did the FP8 GEMMs run?", e_out, MIN_OUT);
    cr_expect(e_loss < TOL_LOSS, "loss: %g vs %g, rel %.3e >= %g", loss[1], loss[0], e_loss, TOL_LOSS);
    int count = dit_num_tensors(c);
    DitTensorInfo *info = malloc(count * sizeof(DitTensorInfo));
    cr_assert(info);
    dit_tensor_infos(c, info);
    double worst = 0, worst_cos = 1;
    for (int i = 0; i < count; i++) {
        const float *ref = grads[0] + info[i].offset, *g = grads[1] + info[i].offset;
        double e = rel_l2(g, ref, info[i].numel), cs = cosine(g, ref, info[i].numel);
        fprintf(stderr, "  grad %-40s rel L2 %.4f cosine %.6f\n", info[i].name, e, cs);
        cr_expect(global_norm(ref, info[i].numel) > 0, "%s: the bf16 gradient is zero", info[i].name);
        cr_expect(e < TOL_GRAD, "gradient %s: rel L2 %.4f >= %g", info[i].name, e, TOL_GRAD);
        cr_expect(cs >= 1 - TOL_GRAD * TOL_GRAD / 2, "gradient %s: cosine %.6f < %.6f", info[i].name, cs,
                  1 - TOL_GRAD * TOL_GRAD / 2);
        worst = e > worst ? e : worst;
        worst_cos = cs < worst_cos ? cs : worst_cos;
    }
    fprintf(stderr, "fp8 vs bf16 linears, %d tokens: worst gradient rel L2 %.4f, cosine %.6f over %d tensors\n",
            dit_tokens(c), worst, worst_cos, count);
    for (int k = 0; k < 2; k++) { free(out[k]); free(grads[k]); }
    free(info); free(x0); free(noise);
    dit_free(&cpu);
}

Test(dit_fp8, one_step_near_the_bf16_model) { check_one_step(&fp8_config); }

// 20×20 images, patch 2: 100 tokens (as test_dit_gpu_cuda's small model), B·T = 200 rows
Test(dit_fp8, one_step_near_the_bf16_model_100_tokens) {
    DitConfig c = fp8_config;
    c.image_size = 20;
    check_one_step(&c);
}

// Two steps of the FP8 model (step k with fp8_fused_inputs fused[k] and fp8_grad_headroom
// headroom[k]) from cpu's weights and one batch, the attention backward in its deterministic mode so
// that the two are comparable: out[k] (n floats), grads[k] (allocated here) and loss[k].
static void two_fp8_steps(const Dit *cpu, const float *x0, const float *noise, const float *t, const int *labels,
                          size_t n, const int fused[2], const int headroom[2], float *out[2], float *grads[2],
                          float loss[2]) {
    int was_deterministic = flash_backward_deterministic();
    flash_backward_set_deterministic(1);
    for (int k = 0; k < 2; k++) {
        out[k] = malloc(n * sizeof(float));
        grads[k] = malloc(cpu->num_params * sizeof(float));
        cr_assert(out[k] && grads[k]);
        loss[k] = gpu_step(cpu, DIT_LINEAR_FP8, fused[k], headroom[k], x0, noise, t, labels, out[k], grads[k]);
    }
    flash_backward_set_deterministic(was_deterministic);
}

// The fused inputs (fp8_fused_inputs, the default: the producers' amax, GELU(fc1) recomputed by fc2's
// quantization) with the douts quantized by their producers at headroom 0 (fp8_grad_headroom:
// current scaling's exponent) against stored bf16 inputs and douts and the linears' own amax passes
// and quantizations: the same values and scales, so bitwise the same output, loss and gradients (the
// attention backward in its deterministic mode, so that two runs of the same step are comparable).
static void check_fused_inputs_are_exact(const DitConfig *c) {
    require_fp8_gpu();
    Dit cpu;
    Rng rng;
    float *x0, *noise, t[B] = {0.3f, 0.8f};
    int labels[B] = {1, c->num_classes};
    size_t n = make_model_and_batch(&cpu, c, 22, &x0, &noise, &rng);
    float *out[2], *grads[2], loss[2];
    two_fp8_steps(&cpu, x0, noise, t, labels, n, (const int[2]){1, 0}, (const int[2]){0, 0}, out, grads, loss);
    fprintf(stderr, "fp8, fused inputs vs stored ones, %d tokens: loss %.9g vs %.9g\n", dit_tokens(c),
            loss[0], loss[1]);
    cr_expect(memcmp(&loss[0], &loss[1], sizeof(float)) == 0, "loss %.9g vs %.9g", loss[0], loss[1]);
    cr_expect(memcmp(out[0], out[1], n * sizeof(float)) == 0, "the outputs differ");
    size_t first = 0;
    while (first < cpu.num_params && memcmp(&grads[0][first], &grads[1][first], sizeof(float)) == 0) first++;
    cr_expect(first == cpu.num_params, "gradient %zu of %zu differs: %.9g vs %.9g", first, cpu.num_params,
              first < cpu.num_params ? grads[0][first] : 0.0f, first < cpu.num_params ? grads[1][first] : 0.0f);
    for (int k = 0; k < 2; k++) { free(out[k]); free(grads[k]); }
    free(x0); free(noise);
    dit_free(&cpu);
}

Test(dit_fp8, fused_inputs_give_bitwise_the_same_step) { check_fused_inputs_are_exact(&fp8_config); }

Test(dit_fp8, fused_inputs_give_bitwise_the_same_step_100_tokens) {
    DitConfig c = fp8_config;
    c.image_size = 20;
    check_fused_inputs_are_exact(&c);
}

// The douts' scales with headroom (fp8_grad_headroom DIT_FP8_GRAD_HEADROOM = 3: up to 6 binades above
// the current amax's; here 3, each guess starting wrong) against headroom 0: the forward untouched
// (output and loss bitwise), the gradients moved only by the douts' values that fall below e4m3's
// normal range (relative L2 per tensor <= 1e-2, against FP8's own 5e-2 from bf16), and moved
// somewhere (the headroom is applied).
Test(dit_fp8, grad_headroom_moves_only_the_smallest_values) {
    require_fp8_gpu();
    Dit cpu;
    Rng rng;
    float *x0, *noise, t[B] = {0.3f, 0.8f};
    int labels[B] = {1, fp8_config.num_classes};
    size_t n = make_model_and_batch(&cpu, &fp8_config, 23, &x0, &noise, &rng);
    float *out[2], *grads[2], loss[2];
    two_fp8_steps(&cpu, x0, noise, t, labels, n, (const int[2]){1, 1}, (const int[2]){0, DIT_FP8_GRAD_HEADROOM}, out,
                  grads, loss);
    cr_expect(memcmp(&loss[0], &loss[1], sizeof(float)) == 0, "loss %.9g vs %.9g", loss[0], loss[1]);
    cr_expect(memcmp(out[0], out[1], n * sizeof(float)) == 0, "the outputs differ");
    int count = dit_num_tensors(&fp8_config);
    DitTensorInfo *info = malloc(count * sizeof(DitTensorInfo));
    cr_assert(info);
    dit_tensor_infos(&fp8_config, info);
    double worst = 0;
    for (int i = 0; i < count; i++) {
        double e = rel_l2(grads[1] + info[i].offset, grads[0] + info[i].offset, info[i].numel);
        cr_expect(e <= 1e-2, "gradient %s: headroom %d vs 0 rel L2 %.3e > 1e-2", info[i].name, DIT_FP8_GRAD_HEADROOM,
                  e);
        worst = e > worst ? e : worst;
    }
    fprintf(stderr, "fp8, dout headroom %d vs 0: worst gradient rel L2 %.3e over %d tensors\n", DIT_FP8_GRAD_HEADROOM,
            worst, count);
    cr_expect(worst > 0, "no gradient moved: is the headroom applied?");
    free(info);
    for (int k = 0; k < 2; k++) { free(out[k]); free(grads[k]); }
    free(x0); free(noise);
    dit_free(&cpu);
}

// An unknown kind is refused before any CUDA call (no GPU needed); FP8 with 100 tokens is not
// refused for its size (without an sm_89+ GPU it fails later, at the device query or its check).
Test(dit_fp8, create_checks_the_linear_kind) {
    char err[DIT_ERR_LEN];
    DitGpu m;
    cr_expect_eq(dit_gpu_create_sp(&m, &fp8_config, 2, DIT_ATTN_EXACT, (DitLinear)7, NULL, err), -1);
    cr_expect(strstr(err, "unknown linear kind 7"), "message: %s", err);
    DitConfig c = fp8_config;
    c.image_size = 20;
    if (dit_gpu_create_sp(&m, &c, 2, DIT_ATTN_EXACT, DIT_LINEAR_FP8, NULL, err) == 0)
        dit_gpu_free(&m);
    else
        cr_expect(!strstr(err, "multiple"), "FP8 with 100 tokens refused for its size: %s", err);
}
