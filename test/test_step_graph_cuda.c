// The training step as one CUDA graph (dit_gpu_train_step_graph, train_dit --cuda-graph on)
// against the same step queued call by call (train_dit --cuda-graph off): two GPU models from the
// same weights train on the same batches, with the attention backwards deterministic (so two
// eager runs are bitwise equal too). After every step the loss and gradient norm, after the last
// the fp32 parameters, their bf16 copy, the AdamW moments and the EMA must be equal bit for bit,
// and the graph must really have been captured once and replayed. The second case changes the
// learning rate and the EMA decay at every step (warm-ups): a replay that read a stale step
// constant would differ. Skipped when no CUDA GPU is found.
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>
#include "attention/flash_cuda.h"
#include "attention/sage_cuda.h"
#include "layers/common.h"
#include "layers/layers.h"
#include "model/dit.h"
#include "model/dit_gpu.h"
#include "test/cuda_test.h"
#include "test/model_test.h"

// 16×16 images, patch 2: 64 tokens, head dim 64 (as test_dit_gpu_cuda's resume test).
static const DitConfig config = {.image_size = 16, .channels = 3, .patch = 2, .hidden = 128,
                                 .depth = 2, .heads = 2, .num_classes = 5};
#define MAX_B 4
#define WEIGHT_DECAY 0.1f
#define GRAD_CLIP 1.0f

// The optimizer's schedule: lr warm-up over `warmup` steps as train_dit's learning_rate, and the
// EMA decay ema_decay_warmup(ema_decay, step) (warmup_ema) or constant.
typedef struct { float lr; int warmup; float ema_decay; int warmup_ema; } Schedule;

static float schedule_lr(const Schedule *s, int step) {
    return step <= s->warmup ? s->lr * step / (s->warmup + 1) : s->lr;
}
static float schedule_ema(const Schedule *s, int step) {
    return s->warmup_ema ? ema_decay_warmup(s->ema_decay, step) : s->ema_decay;
}

// A training batch that depends only on the step: x0, noise, t, labels.
typedef struct { float x0[MAX_B * 3 * 16 * 16], noise[MAX_B * 3 * 16 * 16], t[MAX_B]; int labels[MAX_B]; } Batch;

static void batch_fill(Batch *b, int step) {
    Rng rng;
    rng_seed(&rng, 1000 + step);
    rng_fill_normal(&rng, b->x0, sizeof(b->x0) / sizeof(float), 1.0f);
    rng_fill_normal(&rng, b->noise, sizeof(b->noise) / sizeof(float), 1.0f);
    for (int i = 0; i < MAX_B; i++) {
        b->t[i] = 0.05f + 0.9f * rng_uniform(&rng);
        b->labels[i] = (int)(rng_u32(&rng) % (uint32_t)(config.num_classes + 1));   // the null label too
    }
}

// One step, eager (train_dit's calls without the graph) or through the graph; loss and norm out.
static void step_once(DitGpu *m, const Batch *b, int B, const Schedule *s, int step, int graph, float scalars[2]) {
    char err[DIT_ERR_LEN];
    float lr = schedule_lr(s, step), ema = schedule_ema(s, step);
    OK(dit_gpu_set_flow_batch(m, b->x0, b->noise, b->t, b->labels, B, err));
    if (graph) {
        OK(dit_gpu_train_step_graph(m, B, lr, 0.9f, 0.999f, 1e-8f, WEIGHT_DECAY, GRAD_CLIP, ema, step, err));
    } else {
        OK(dit_gpu_forward(m, &m->weights, B, err));
        OK(dit_gpu_loss(m, B, err));
        OK(dit_gpu_zero_grad(m, err));
        OK(dit_gpu_backward(m, B, err));
        OK(dit_gpu_grad_sumsq(m, err));
        OK(dit_gpu_update(m, lr, 0.9f, 0.999f, 1e-8f, WEIGHT_DECAY, GRAD_CLIP, ema, step, err));
    }
    OK(dit_gpu_read_scalars(m, &scalars[0], &scalars[1], err));
}

// Bitwise comparison of everything the optimizer keeps, eager model e against graph model g.
static void expect_same_state(DitGpu *e, DitGpu *g, const char *what) {
    char err[DIT_ERR_LEN];
    Dit he, hg;
    OK(dit_create(&he, &config, 1, DIT_ATTN_SAGE, 0, err));
    OK(dit_create(&hg, &config, 1, DIT_ATTN_SAGE, 0, err));
    OK(dit_gpu_download(e, &he, err));
    OK(dit_gpu_download(g, &hg, err));
    size_t bytes = he.num_params * sizeof(float);
    cr_expect(memcmp(he.params_memory, hg.params_memory, bytes) == 0, "%s: the parameters differ", what);
    cr_expect(memcmp(he.adam_m_memory, hg.adam_m_memory, bytes) == 0, "%s: the AdamW first moments differ", what);
    cr_expect(memcmp(he.adam_v_memory, hg.adam_v_memory, bytes) == 0, "%s: the AdamW second moments differ", what);
    cr_expect(memcmp(he.ema_memory, hg.ema_memory, bytes) == 0, "%s: the EMA differs", what);
    size_t half = he.num_params * sizeof(uint16_t);
    uint16_t *be = malloc(half), *bg = malloc(half);
    cr_assert(be && bg);
    cr_assert_eq(cudaMemcpy(be, e->params_bf16_memory, half, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(cudaMemcpy(bg, g->params_bf16_memory, half, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_expect(memcmp(be, bg, half) == 0, "%s: the bf16 weights differ", what);
    free(be); free(bg);
    dit_free(&he);
    dit_free(&hg);
}

// Trains `steps` steps on an eager and a graph model from the same random weights; batch[k] and
// rotate[k] are step k + 1's batch size and SageConfig.rotate; the graph model must have captured
// want_captures graphs and replayed them want_launches times.
static void check_graph_against_eager(DitAttention attention, const Schedule *s, int steps, const int *batch,
                                      const int *rotate, const char *what, int want_captures, int want_launches) {
    char err[DIT_ERR_LEN];
    sage_backward_set_deterministic(1);
    flash_backward_set_deterministic(1);
    Dit cpu;
    OK(dit_create(&cpu, &config, 1, attention, 21, err));
    randomize_params(&cpu, 21);
    DitGpu eager, graph;
    OK(dit_gpu_create(&eager, &config, MAX_B, attention, err));
    OK(dit_gpu_create(&graph, &config, MAX_B, attention, err));
    OK(dit_gpu_upload(&eager, &cpu, err));
    OK(dit_gpu_upload(&graph, &cpu, err));
    Batch *b = malloc(sizeof(Batch));
    cr_assert(b);
    for (int step = 1; step <= steps; step++) {
        batch_fill(b, step);
        eager.sage.rotate = graph.sage.rotate = rotate[step - 1];
        float se[2], sg[2];
        step_once(&eager, b, batch[step - 1], s, step, 0, se);
        step_once(&graph, b, batch[step - 1], s, step, 1, sg);
        fprintf(stderr, "%s step %d (B %d, lr %.3e, ema %.4f): loss %.9g / %.9g, grad norm %.9g / %.9g (eager / graph)\n",
                what, step, batch[step - 1], schedule_lr(s, step), schedule_ema(s, step), se[0], sg[0], se[1], sg[1]);
        cr_expect(memcmp(&se[0], &sg[0], sizeof(float)) == 0, "%s step %d: loss %.9g eager, %.9g graph", what, step,
                  se[0], sg[0]);
        cr_expect(memcmp(&se[1], &sg[1], sizeof(float)) == 0, "%s step %d: grad norm %.9g eager, %.9g graph", what,
                  step, se[1], sg[1]);
    }
    expect_same_state(&eager, &graph, what);
    fprintf(stderr, "%s: %d captures, %d replays\n", what, graph.step_graph.captures, graph.step_graph.launches);
    cr_expect_eq(graph.step_graph.captures, want_captures, "%s: %d captures, expected %d", what,
                 graph.step_graph.captures, want_captures);
    cr_expect_eq(graph.step_graph.launches, want_launches, "%s: %d replays, expected %d", what,
                 graph.step_graph.launches, want_launches);
    cr_expect_eq(eager.step_graph.captures, 0, "%s: the eager model captured a graph", what);
    free(b);
    dit_gpu_free(&eager);
    dit_gpu_free(&graph);
    dit_free(&cpu);
}

static const int batch_4[6] = {4, 4, 4, 4, 4, 4}, rotate_1[6] = {1, 1, 1, 1, 1, 1};
// lr warm-up over 3 steps (it changes at steps 1-4, then stays) and the EMA decay's warm-up (it
// changes at every step): each replay must read its own step's constants.
static const Schedule warmups = {.lr = 1e-3f, .warmup = 3, .ema_decay = 0.999f, .warmup_ema = 1};

// Step 1 runs eagerly (the warm-up), step 2 is captured and replayed, steps 3-6 replay.
Test(step_graph, six_steps_bitwise_equal_to_eager) {
    REQUIRE_GPU();
    Schedule s = {.lr = 1e-3f, .warmup = 0, .ema_decay = 0.99f, .warmup_ema = 0};
    check_graph_against_eager(DIT_ATTN_SAGE, &s, 6, batch_4, rotate_1, "sage, constant lr", 1, 5);
}

Test(step_graph, lr_and_ema_warmup_bitwise_equal_to_eager) {
    REQUIRE_GPU();
    check_graph_against_eager(DIT_ATTN_SAGE, &warmups, 6, batch_4, rotate_1, "sage, warm-ups", 1, 5);
}

Test(step_graph, flash_attention_bitwise_equal_to_eager) {
    REQUIRE_GPU();
    check_graph_against_eager(DIT_ATTN_EXACT, &warmups, 6, batch_4, rotate_1, "bf16 flash, warm-ups", 1, 5);
}

// A new batch size (step 4) and a new SageConfig (step 7: rotation off) each drop the graph: one
// eager step, then a new capture. Three captures, two replays per key.
Test(step_graph, a_changed_batch_or_sage_config_is_captured_again) {
    REQUIRE_GPU();
    static const int batch[9] = {4, 4, 4, 3, 3, 3, 3, 3, 3}, rotate[9] = {1, 1, 1, 1, 1, 1, 0, 0, 0};
    check_graph_against_eager(DIT_ATTN_SAGE, &warmups, 9, batch, rotate, "sage, batch and rotation changed", 3, 6);
}

// The graph is for one GPU: a model with optimizer shards (ZeRO-1) is refused with a message.
Test(step_graph, refuses_a_sharded_model) {
    REQUIRE_GPU();
    char err[DIT_ERR_LEN];
    DitGpu m;
    DitGpuSeqParallel sp = {.ulysses = 1, .ring = 1, .optimizer_shards = 2, .optimizer_rank = 0};
    OK(dit_gpu_create_sp(&m, &config, 2, DIT_ATTN_SAGE, DIT_LINEAR_BF16, &sp, err));
    cr_assert_eq(dit_gpu_train_step_graph(&m, 2, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1.0f, 0.99f, 1, err), -1);
    cr_expect(strstr(err, "one GPU only") && strstr(err, "2 optimizer shards"), "%s", err);
    dit_gpu_free(&m);
}
