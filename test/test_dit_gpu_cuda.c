// Tests of the GPU model (model/dit_gpu.h) against the CPU fp32 model (model/dit.h) on the same
// weights and batches, and of its determinism. Skipped when no CUDA GPU is found.
//
// Both sides run sage attention with the same SageConfig (SAGE_CONFIG_DEFAULT: 64-token blocks,
// FP8 P·V), the CPU its bit-defined reference, the GPU its kernels; the one-step check also runs
// with exact attention (CPU fp32, GPU the bf16 flash kernel). Weights are random for every
// tensor (not DiT's zero init, so that every gradient is nonzero) and rounded to bf16, so both
// sides start from the same numbers; the GPU then computes with bf16 activations.
//
// Tolerances, as ‖gpu - cpu‖/‖cpu‖, about 2.5× the errors measured with sage on an H200 (given
// in brackets; dev/notes_dit_gpu.md has every tensor's):
// - TOL_OUT 1.5e-2 for the output [5.9e-3], TOL_LOSS 2e-3 for the loss [3.0e-4];
// - TOL_GRAD 2e-2 for every parameter gradient tensor [worst of 31: 8.1e-3] (bf16 activation
//   gradients through the whole backward, and sage's quantization of bf16 vs fp32 q, k), and for
//   the parameters after 10 steps [1.6e-3];
// - TOL_LOSS_10 1e-2 for each of the losses of 10 AdamW steps [worst 3.4e-3];
// - TOL_SAMPLE 2e-2 for images after 4 Euler steps with guidance 2 [4.3e-3].
// Resume: bitwise equality (memcmp) of losses and parameters. ZeRO-1's per-block adaLN gradients
// against the stacked GEMM: every other gradient bitwise, the adaLN ones within TOL_ADA_BLOCK.
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cuda_runtime_api.h>
#include "attention/flash_cuda.h"
#include "attention/sage_cuda.h"
#include "layers/common.h"
#include "layers/layers.h"
#include "model/checkpoint.h"
#include "model/dit.h"
#include "model/dit_gpu.h"
#include "model/sample.h"
#include "test/compare.h"
#include "test/cuda_test.h"
#include "test/model_test.h"

#define TOL_OUT 1.5e-2
#define TOL_LOSS 2e-3
#define TOL_GRAD 2e-2
#define TOL_LOSS_10 1e-2
#define TOL_SAMPLE 2e-2

// 20×20 images, patch 2: 100 tokens (a partial 64-token attention block), head dim 64.
static const DitConfig small_config = {.image_size = 20, .channels = 3, .patch = 2, .hidden = 128,
                                       .depth = 2, .heads = 2, .num_classes = 5};

// A training batch that depends only on (seed, step): x0, noise (B, C, S, S), t, labels.
typedef struct { float *x0, *noise, *t, *x_t, *v, *dout; int *labels; size_t n; int B; } Batch;

static Batch batch_new(const DitConfig *c, int B) {
    Batch b = {.n = (size_t)B * c->channels * c->image_size * c->image_size, .B = B};
    b.x0 = malloc(b.n * sizeof(float)); b.noise = malloc(b.n * sizeof(float));
    b.x_t = malloc(b.n * sizeof(float)); b.v = malloc(b.n * sizeof(float));
    b.dout = malloc(b.n * sizeof(float)); b.t = malloc(B * sizeof(float)); b.labels = malloc(B * sizeof(int));
    cr_assert(b.x0 && b.noise && b.x_t && b.v && b.dout && b.t && b.labels);
    return b;
}

static void batch_free(Batch *b) {
    free(b->x0); free(b->noise); free(b->x_t); free(b->v); free(b->dout); free(b->t); free(b->labels);
}

// Fills the batch of `step`; x_t and v as the GPU makes them (x_t rounded to bf16).
static void batch_fill(Batch *b, const DitConfig *c, uint64_t seed, int step) {
    Rng rng;
    rng_seed(&rng, seed * 1000 + step);
    rng_fill_normal(&rng, b->x0, b->n, 1.0f);
    rng_fill_normal(&rng, b->noise, b->n, 1.0f);
    for (int i = 0; i < b->B; i++) {
        b->t[i] = 0.05f + 0.9f * rng_uniform(&rng);
        b->labels[i] = (int)(rng_u32(&rng) % (uint32_t)(c->num_classes + 1));   // the null label too
    }
    flow_matching_inputs(b->x_t, b->v, b->x0, b->noise, b->t, b->B, (int)(b->n / b->B));
    for (size_t i = 0; i < b->n; i++) b->x_t[i] = bf16_round(b->x_t[i]);
}

// A CPU model with random weights and the GPU model uploaded from it.
static void make_models(Dit *cpu, DitGpu *gpu, const DitConfig *c, int B, uint64_t seed,
                        DitAttention attention, char *err) {
    OK(dit_create(cpu, c, B, attention, seed, err));
    randomize_params(cpu, seed);
    OK(dit_gpu_create(gpu, c, B, attention, err));
    OK(dit_gpu_upload(gpu, cpu, err));
}

// One training step on each side; returns the losses and gradient norms.
static float cpu_step(Dit *m, Batch *b, float lr, int step, float *grad_norm) {
    dit_forward(m, &m->params, b->x_t, b->t, b->labels, b->B);
    float loss = mse_loss_forward_backward(b->dout, m->acts.out, b->v, b->n);
    dit_zero_grad(m);
    dit_backward(m, b->dout, b->labels, b->B);
    *grad_norm = global_norm(m->grads_memory, m->num_params);
    dit_adamw_step(m, lr, 0.9f, 0.999f, 1e-8f, 0.1f, clip_grad_scale(*grad_norm, 1.0f), step);
    ema_update(m->ema_memory, m->params_memory, m->num_params, 0.99f);
    return loss;
}

static float gpu_step(DitGpu *m, Batch *b, float lr, int step, float *grad_norm) {
    char err[DIT_ERR_LEN];
    float loss;
    OK(dit_gpu_set_flow_batch(m, b->x0, b->noise, b->t, b->labels, b->B, err));
    OK(dit_gpu_forward(m, &m->weights, b->B, err));
    OK(dit_gpu_loss(m, b->B, err));
    OK(dit_gpu_zero_grad(m, err));
    OK(dit_gpu_backward(m, b->B, err));
    OK(dit_gpu_grad_sumsq(m, err));
    OK(dit_gpu_update(m, lr, 0.9f, 0.999f, 1e-8f, 0.1f, 1.0f, 0.99f, step, err));
    OK(dit_gpu_read_scalars(m, &loss, grad_norm, err));
    return loss;
}

// One forward, loss and backward on each side from the same weights and batch.
// rotate: sage with the Hadamard rotation of q, k on both sides (SageConfig.rotate, the CPU in
// fp32, the GPU in bf16: hadamard_cuda.h), as train_dit runs it by default.
static void check_one_step(DitAttention attention, int rotate) {
    char err[DIT_ERR_LEN];
    const DitConfig *c = &small_config;
    int B = 3;
    Dit cpu;
    DitGpu gpu;
    make_models(&cpu, &gpu, c, B, 11, attention, err);
    cpu.sage.rotate = gpu.sage.rotate = rotate;
    Batch b = batch_new(c, B);
    batch_fill(&b, c, 11, 1);

    // CPU: fp32 forward, loss, backward from the same (bf16-valued) x_t
    dit_forward(&cpu, &cpu.params, b.x_t, b.t, b.labels, B);
    float cpu_loss = mse_loss_forward_backward(b.dout, cpu.acts.out, b.v, b.n);
    dit_zero_grad(&cpu);
    dit_backward(&cpu, b.dout, b.labels, B);

    // GPU: the training path (x_t and v made on the device)
    float *gpu_out = malloc(b.n * sizeof(float)), *gpu_grads = malloc(cpu.num_params * sizeof(float));
    cr_assert(gpu_out && gpu_grads);
    memset(gpu_out, 0xff, b.n * sizeof(float));
    memset(gpu_grads, 0xff, cpu.num_params * sizeof(float));
    float gpu_loss;
    OK(dit_gpu_set_flow_batch(&gpu, b.x0, b.noise, b.t, b.labels, B, err));
    OK(dit_gpu_forward(&gpu, &gpu.weights, B, err));
    OK(dit_gpu_loss(&gpu, B, err));
    OK(dit_gpu_zero_grad(&gpu, err));
    OK(dit_gpu_backward(&gpu, B, err));
    OK(dit_gpu_read_scalars(&gpu, &gpu_loss, NULL, err));
    OK(dit_gpu_download_output(&gpu, gpu_out, B, err));
    OK(dit_gpu_download_grads(&gpu, gpu_grads, err));

    double e_out = rel_l2(gpu_out, cpu.acts.out, b.n), e_loss = fabs(gpu_loss - cpu_loss) / cpu_loss;
    const char *name = attention == DIT_ATTN_EXACT ? "exact/flash"
                     : attention == DIT_ATTN_SAGE_FP16 ? (rotate ? "sage fp16, rotated" : "sage fp16")
                     : (rotate ? "sage, rotated" : "sage");
    fprintf(stderr, "one step (%s): output rel L2 %.3e, loss %.6f vs %.6f (rel %.3e)\n", name, e_out, gpu_loss, cpu_loss, e_loss);
    cr_expect(e_out < TOL_OUT, "output: rel L2 %.3e >= %g", e_out, TOL_OUT);
    cr_expect(e_loss < TOL_LOSS, "loss: %g vs %g, rel %.3e >= %g", gpu_loss, cpu_loss, e_loss, TOL_LOSS);

    int n = dit_num_tensors(c);
    DitTensorInfo *info = malloc(n * sizeof(DitTensorInfo));
    cr_assert(info);
    dit_tensor_infos(c, info);
    double worst = 0;
    for (int i = 0; i < n; i++) {
        const float *ref = cpu.grads_memory + info[i].offset;
        double ref_norm = global_norm(ref, info[i].numel);
        double e = rel_l2(gpu_grads + info[i].offset, ref, info[i].numel);
        fprintf(stderr, "  grad %-42s rel L2 %.3e (|ref| %.3e)\n", info[i].name, e, ref_norm);
        cr_expect(ref_norm > 0, "%s: the CPU gradient is zero: the test would not see a GPU bug", info[i].name);
        cr_expect(e < TOL_GRAD, "gradient %s: rel L2 %.3e >= %g", info[i].name, e, TOL_GRAD);
        worst = e > worst ? e : worst;
    }
    fprintf(stderr, "one step (%s): worst gradient rel L2 %.3e over %d tensors\n", name, worst, n);
    free(info); free(gpu_out); free(gpu_grads);
    batch_free(&b);
    dit_gpu_free(&gpu);
    dit_free(&cpu);
}

Test(dit_gpu, one_step_output_loss_and_every_gradient_match_the_cpu) {
    REQUIRE_GPU();
    check_one_step(DIT_ATTN_SAGE, 0);
}

Test(dit_gpu, one_step_with_rotated_sage_matches_the_cpu) {
    REQUIRE_GPU();
    check_one_step(DIT_ATTN_SAGE, 1);
}

// FP16 P·V (train_dit --attn sage-fp16): the mma.sync forward on every GPU, with the rotation.
Test(dit_gpu, one_step_with_fp16_sage_matches_the_cpu) {
    REQUIRE_GPU();
    check_one_step(DIT_ATTN_SAGE_FP16, 1);
}

Test(dit_gpu, one_step_with_flash_attention_matches_the_cpu_exact_attention) {
    REQUIRE_GPU();
    check_one_step(DIT_ATTN_EXACT, 0);
}

// ZeRO-1's overlap (DitGpuSeqParallel.zero_overlap) computes each block's adaLN weight and bias
// gradients in that block's iteration: per block, dW_l (6h, h) = dada_lᵀ·c_silu and db_l = Σ_b dada_l,
// GEMMs of K = B, instead of rows l·6h .. (l + 1)·6h of one GEMM over all blocks after the loop.
// Same model, weights and batch (sage's backward deterministic): every other gradient must be
// bitwise the plain model's; the adaLN ones are the same sums over b, within TOL_ADA_BLOCK (rel L2
// per tensor); how many of their elements differ in any bit is printed (0 when cuBLASLt adds the B
// products in the same order for both shapes). A block's slice written to another block's place
// fails by far (rel L2 ~1).
#define TOL_ADA_BLOCK 1e-6
Test(dit_gpu, per_block_adaln_gradients_equal_the_stacked_gemm) {
    REQUIRE_GPU();
    char err[DIT_ERR_LEN];
    const DitConfig *c = &small_config;
    int B = 8;
    Dit cpu;
    DitGpu plain, per_block;
    make_models(&cpu, &plain, c, B, 13, DIT_ATTN_SAGE, err);
    DitGpuSeqParallel sp = {.ulysses = 1, .ring = 1, .zero_overlap = 1};
    OK(dit_gpu_create_sp(&per_block, c, B, DIT_ATTN_SAGE, DIT_LINEAR_BF16, &sp, err));
    OK(dit_gpu_upload(&per_block, &cpu, err));
    sage_backward_set_deterministic(1);
    Batch b = batch_new(c, B);
    batch_fill(&b, c, 13, 1);
    size_t n = cpu.num_params;
    DitGpu *models[2] = {&plain, &per_block};
    float *grads[2] = {malloc(n * sizeof(float)), malloc(n * sizeof(float))};
    cr_assert(grads[0] && grads[1]);
    for (int i = 0; i < 2; i++) {
        DitGpu *m = models[i];
        OK(dit_gpu_set_flow_batch(m, b.x0, b.noise, b.t, b.labels, B, err));
        OK(dit_gpu_forward(m, &m->weights, B, err));
        OK(dit_gpu_loss(m, B, err));
        OK(dit_gpu_zero_grad(m, err));
        OK(dit_gpu_backward(m, B, err));
        OK(dit_gpu_download_grads(m, grads[i], err));
    }
    int nt = dit_num_tensors(c);
    DitTensorInfo *info = malloc(nt * sizeof(DitTensorInfo));
    cr_assert(info);
    dit_tensor_infos(c, info);
    size_t ada_differing = 0, ada_total = 0;
    for (int i = 0; i < nt; i++) {
        const float *p = grads[1] + info[i].offset, *ref = grads[0] + info[i].offset;
        size_t d = 0;
        for (size_t k = 0; k < info[i].numel; k++) d += memcmp(&p[k], &ref[k], sizeof(float)) != 0;
        if (strncmp(info[i].name, "blocks.", 7) == 0 && strstr(info[i].name, "adaLN")) {
            double e = rel_l2(p, ref, info[i].numel);
            fprintf(stderr, "  per-block %-40s %zu of %zu elements differ, rel L2 %.3e\n", info[i].name, d,
                    info[i].numel, e);
            cr_expect(global_norm(ref, info[i].numel) > 0, "%s: the gradient is zero", info[i].name);
            cr_expect(e <= TOL_ADA_BLOCK, "%s: rel L2 %.3e > %g against the stacked GEMM", info[i].name, e,
                      TOL_ADA_BLOCK);
            ada_differing += d;
            ada_total += info[i].numel;
        } else {
            cr_expect_eq(d, 0, "%s: %zu elements differ, but zero_overlap changes only the adaLN gradients",
                         info[i].name, d);
        }
    }
    fprintf(stderr, "per-block adaLN gradients: %zu of %zu elements differ from the stacked GEMM's (B = %d)\n",
            ada_differing, ada_total, B);
    free(info); free(grads[0]); free(grads[1]);
    batch_free(&b);
    dit_gpu_free(&plain);
    dit_gpu_free(&per_block);
    dit_free(&cpu);
}

// dit_gpu_backward_fresh leaves the weight stacks of the block linears and of the adaLN projection
// to their GEMMs (beta 0) instead of zeroing them first: it must give the bytes of dit_gpu_zero_grad
// then dit_gpu_backward. The gradient buffer is poisoned (NaN) before the fresh backward, so a
// gradient that nothing writes shows. bf16 and FP8 block linears (FP8 where the GPU has it), and
// the adaLN weight gradients from one GEMM after the loop and per block (sp.zero_overlap).
Test(dit_gpu, backward_fresh_gives_the_bytes_of_zero_grad_then_backward) {
    REQUIRE_GPU();
    char err[DIT_ERR_LEN];
    const DitConfig *c = &small_config;
    int B = 3;
    Dit cpu;
    OK(dit_create(&cpu, c, B, DIT_ATTN_SAGE, 17, err));
    randomize_params(&cpu, 17);
    sage_backward_set_deterministic(1);
    Batch b = batch_new(c, B);
    batch_fill(&b, c, 17, 1);
    size_t n = cpu.num_params;
    float *zeroed = malloc(n * sizeof(float)), *fresh = malloc(n * sizeof(float));
    cr_assert(zeroed && fresh);
    const struct { DitLinear linear; int overlap; const char *name; } runs[3] = {
        {DIT_LINEAR_BF16, 0, "bf16 linears"}, {DIT_LINEAR_BF16, 1, "bf16 linears, per-block adaLN"},
        {DIT_LINEAR_FP8, 0, "FP8 linears"}};
    for (int r = 0; r < 3; r++) {
        DitGpu m;
        DitGpuSeqParallel sp = {.ulysses = 1, .ring = 1, .zero_overlap = runs[r].overlap};
        if (dit_gpu_create_sp(&m, c, B, DIT_ATTN_SAGE, runs[r].linear, &sp, err) != 0) {
            cr_expect(runs[r].linear == DIT_LINEAR_FP8, "%s: %s", runs[r].name, err);
            fprintf(stderr, "backward_fresh: %s skipped (%s)\n", runs[r].name, err);
            continue;
        }
        OK(dit_gpu_upload(&m, &cpu, err));
        OK(dit_gpu_set_flow_batch(&m, b.x0, b.noise, b.t, b.labels, B, err));
        for (int fresh_run = 0; fresh_run < 2; fresh_run++) {
            OK(dit_gpu_forward(&m, &m.weights, B, err));
            OK(dit_gpu_loss(&m, B, err));
            if (fresh_run) {
                CK(cudaMemset(m.grads_memory, 0xFF, n * sizeof(float)));
                OK(dit_gpu_backward_fresh(&m, B, err));
            } else {
                OK(dit_gpu_zero_grad(&m, err));
                OK(dit_gpu_backward(&m, B, err));
            }
            OK(dit_gpu_download_grads(&m, fresh_run ? fresh : zeroed, err));
        }
        size_t differ = 0, nonfinite = 0;
        for (size_t i = 0; i < n; i++) {
            differ += memcmp(&fresh[i], &zeroed[i], sizeof(float)) != 0;
            nonfinite += !isfinite(zeroed[i]);
        }
        fprintf(stderr, "backward_fresh (%s): %zu of %zu gradients differ from zero_grad + backward\n",
                runs[r].name, differ, n);
        cr_expect_eq(nonfinite, 0, "%s: zero_grad + backward gave %zu non-finite gradients", runs[r].name, nonfinite);
        cr_expect_eq(differ, 0, "%s: %zu gradients differ from zero_grad + backward", runs[r].name, differ);
        cr_expect(global_norm(zeroed, n) > 0, "%s: every gradient is zero: the test would show nothing", runs[r].name);
        dit_gpu_free(&m);
    }
    sage_backward_set_deterministic(0);
    free(zeroed); free(fresh);
    batch_free(&b);
    dit_free(&cpu);
}

Test(dit_gpu, ten_adamw_steps_follow_the_cpu_losses) {
    REQUIRE_GPU();
    char err[DIT_ERR_LEN];
    const DitConfig *c = &small_config;
    int B = 4;
    Dit cpu;
    DitGpu gpu;
    make_models(&cpu, &gpu, c, B, 12, DIT_ATTN_SAGE, err);
    Batch b = batch_new(c, B);
    for (int step = 1; step <= 10; step++) {
        batch_fill(&b, c, 12, step);
        float cpu_norm, gpu_norm;
        float cpu_loss = cpu_step(&cpu, &b, 1e-3f, step, &cpu_norm);
        float gpu_loss = gpu_step(&gpu, &b, 1e-3f, step, &gpu_norm);
        double e = fabs(gpu_loss - cpu_loss) / cpu_loss;
        fprintf(stderr, "step %2d: loss gpu %.6f cpu %.6f (rel %.2e) | grad norm gpu %.4f cpu %.4f\n",
                step, gpu_loss, cpu_loss, e, gpu_norm, cpu_norm);
        cr_expect(e < TOL_LOSS_10, "step %d: loss %g vs cpu %g, rel %.3e >= %g", step, gpu_loss, cpu_loss, e, TOL_LOSS_10);
    }
    // the weights moved alike (AdamW's update is sign-like, so this is a loose check)
    Dit host;
    OK(dit_create(&host, c, 1, DIT_ATTN_SAGE, 0, err));
    OK(dit_gpu_download(&gpu, &host, err));
    double e_params = rel_l2(host.params_memory, cpu.params_memory, cpu.num_params);
    fprintf(stderr, "after 10 steps: parameters rel L2 %.3e\n", e_params);
    cr_expect(e_params < TOL_GRAD, "parameters after 10 steps: rel L2 %.3e >= %g", e_params, TOL_GRAD);
    dit_free(&host);
    batch_free(&b);
    dit_gpu_free(&gpu);
    dit_free(&cpu);
}

// Train 3 steps, checkpoint (through a file), continue 3 steps; a fresh model loaded from the
// checkpoint continues the same 3 steps: the losses and final parameters are bitwise equal.
// (image_size/2)² tokens: 64 is one attention key block; 256 two blocks of 128 keys (two fp32
// adds onto zero commute, so even unordered dq atomics are exact there); 1024 tokens are 8 key
// blocks, bitwise only with the ordered dq of the attention backwards, which the test turns on
// (sage_backward_set_deterministic, flash_backward_set_deterministic: what --deterministic would do).
static void check_resume(int image_size, DitAttention attention) {
    REQUIRE_GPU();
    sage_backward_set_deterministic(1);
    flash_backward_set_deterministic(1);
    char err[DIT_ERR_LEN];
    DitConfig c = small_config;
    c.image_size = image_size;
    int B = 4;
    Dit cpu, host;
    DitGpu gpu;
    make_models(&cpu, &gpu, &c, B, 13, attention, err);
    Batch b = batch_new(&c, B);
    float norm, first[3], second[3];
    for (int step = 1; step <= 3; step++) {
        batch_fill(&b, &c, 13, step);
        gpu_step(&gpu, &b, 1e-3f, step, &norm);
    }
    char path[] = "/tmp/test_dit_gpu_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    OK(dit_gpu_download(&gpu, &cpu, err));
    TrainState state = {.step = 3};
    OK(checkpoint_save(path, &cpu, &state, "a,b,c,d,e", err));
    for (int step = 4; step <= 6; step++) {
        batch_fill(&b, &c, 13, step);
        first[step - 4] = gpu_step(&gpu, &b, 1e-3f, step, &norm);
    }
    OK(dit_gpu_download(&gpu, &cpu, err));
    dit_gpu_free(&gpu);

    OK(dit_create(&host, &c, 1, attention, 99, err));
    OK(checkpoint_load(path, &host, &state, err));
    unlink(path);
    cr_assert_eq(state.step, 3);
    OK(dit_gpu_create(&gpu, &c, B, attention, err));
    OK(dit_gpu_upload(&gpu, &host, err));
    for (int step = 4; step <= 6; step++) {
        batch_fill(&b, &c, 13, step);
        second[step - 4] = gpu_step(&gpu, &b, 1e-3f, step, &norm);
    }
    OK(dit_gpu_download(&gpu, &host, err));
    for (int i = 0; i < 3; i++)
        fprintf(stderr, "resume (%d tokens, %s): step %d loss %.9g vs %.9g\n", image_size * image_size / 4,
                attention == DIT_ATTN_SAGE ? "sage" : "bf16", i + 4, first[i], second[i]);
    cr_expect(memcmp(first, second, sizeof(first)) == 0, "the losses after resuming differ");
    cr_expect(memcmp(cpu.params_memory, host.params_memory, cpu.num_params * sizeof(float)) == 0,
              "the parameters after resuming differ");
    cr_expect(memcmp(cpu.adam_v_memory, host.adam_v_memory, cpu.num_params * sizeof(float)) == 0,
              "the AdamW second moments after resuming differ");
    batch_free(&b);
    dit_gpu_free(&gpu);
    dit_free(&host);
    dit_free(&cpu);
}

Test(dit_gpu, resume_from_a_checkpoint_is_bitwise_identical) { check_resume(16, DIT_ATTN_SAGE); }
Test(dit_gpu, resume_at_256_tokens_is_bitwise_identical) { check_resume(32, DIT_ATTN_SAGE); }
Test(dit_gpu, resume_at_1024_tokens_is_bitwise_identical, .timeout = 120) {
    check_resume(64, DIT_ATTN_SAGE);
    check_resume(64, DIT_ATTN_EXACT);
}

// Sampling from the EMA weights on the GPU follows the CPU sampler (same weights, same noise).
Test(dit_gpu, sampling_from_the_ema_follows_the_cpu) {
    REQUIRE_GPU();
    char err[DIT_ERR_LEN];
    const DitConfig *c = &small_config;
    int B = 2, n = 3;   // two chunks, the second partial
    Dit cpu;
    DitGpu gpu;
    make_models(&cpu, &gpu, c, B, 14, DIT_ATTN_SAGE, err);
    size_t img = (size_t)c->channels * c->image_size * c->image_size;
    float *x_cpu = malloc(n * img * sizeof(float)), *x_gpu = malloc(n * img * sizeof(float));
    cr_assert(x_cpu && x_gpu);
    Rng rng;
    rng_seed(&rng, 5);
    rng_fill_normal(&rng, x_cpu, n * img, 1.0f);
    for (size_t i = 0; i < n * img; i++) x_cpu[i] = bf16_round(x_cpu[i]);
    memcpy(x_gpu, x_cpu, n * img * sizeof(float));
    int labels[3] = {0, 4, 5};
    OK(dit_sample(&cpu, &cpu.ema, x_cpu, labels, n, 4, 2.0f, err));
    OK(dit_gpu_sample(&gpu, x_gpu, labels, n, 4, 2.0f, err));
    double e = rel_l2(x_gpu, x_cpu, n * img);
    fprintf(stderr, "sampling (4 Euler steps, cfg 2): rel L2 %.3e\n", e);
    cr_expect(e < TOL_SAMPLE, "samples: rel L2 %.3e >= %g", e, TOL_SAMPLE);
    free(x_cpu); free(x_gpu);
    dit_gpu_free(&gpu);
    dit_free(&cpu);
}

// Sizes the GPU model cannot run are refused by create before any CUDA call (no GPU needed):
// hidden above 4096 (the LayerNorm kernels keep a row in one warp's registers), head dim 128.
Test(dit_gpu, create_refuses_hidden_above_4096) {
    char err[DIT_ERR_LEN];
    DitGpu m;
    DitConfig c = {.image_size = 16, .channels = 1, .patch = 2, .hidden = 4224, .depth = 1, .heads = 33,
                   .num_classes = 2};
    cr_expect_eq(dit_gpu_create(&m, &c, 1, DIT_ATTN_SAGE, err), -1);
    cr_expect(strstr(err, "at most 4096") && strstr(err, "hidden 4224"), "message: %s", err);
}
