// The whole DiT on the CPU: DiT's zero-output initialization, finite-difference checks of every
// parameter tensor's gradient, checkpoint round trip and bad checkpoints, bit-identical resume, and
// train_dit's --cuda-graph and --zero-overlap flags.
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "layers/common.h"
#include "layers/layers.h"
#include "model/checkpoint.h"
#include "model/dit.h"
#include "test/gradcheck.h"
#include "test/compare.h"

// Small enough for finite differences of every sampled element: T = 16 tokens, head dim 8.
static const DitConfig micro = {.image_size = 8, .channels = 2, .patch = 2, .hidden = 16,
                                .depth = 2, .heads = 2, .num_classes = 3};
#define MICRO_B 2

typedef struct {
    Dit *m;
    const float *x, *t, *w;
    const int *labels;
    size_t n_out;
} ModelLoss;

// L = Σ w∘model(x, t, labels), in double.
static double model_loss(void *ctx) {
    ModelLoss *c = ctx;
    dit_forward(c->m, &c->m->params, c->x, c->t, c->labels, MICRO_B);
    return gc_dot(c->w, c->m->acts.out, c->n_out);
}

static void random_batch(Rng *rng, const DitConfig *cfg, float *x, float *t, int *labels, int B) {
    size_t img = (size_t)cfg->channels * cfg->image_size * cfg->image_size;
    rng_fill_normal(rng, x, B * img, 1.0f);
    for (int b = 0; b < B; b++) {
        t[b] = 0.1f + 0.8f * rng_uniform(rng);
        labels[b] = b % (cfg->num_classes + 1);   // includes the null label
    }
}

Test(model, initial_output_is_exactly_zero) {
    Dit m;
    char err[DIT_ERR_LEN];
    cr_assert_eq(dit_create(&m, &micro, MICRO_B, DIT_ATTN_EXACT, 1, err), 0, "%s", err);
    float x[MICRO_B * 2 * 64], t[MICRO_B];
    int labels[MICRO_B];
    Rng rng;
    rng_seed(&rng, 5);
    random_batch(&rng, &micro, x, t, labels, MICRO_B);
    memset(m.acts_memory, 0xFF, m.num_acts * sizeof(float));   // poison: NaN everywhere
    dit_forward(&m, &m.params, x, t, labels, MICRO_B);
    for (int i = 0; i < MICRO_B * 2 * 64; i++) cr_assert_eq(m.acts.out[i], 0.0f, "out[%d] = %g", i, m.acts.out[i]);
    // yet the network is not trivially zero inside: the residual stream carries the patch embedding
    cr_assert_gt(fabsf(m.acts.residual[0]) + fabsf(m.acts.residual[1]), 0.0f);
    dit_free(&m);
}

static void check_param_gradients(DitAttention attention) {
    Dit m;
    char err[DIT_ERR_LEN];
    cr_assert_eq(dit_create(&m, &micro, MICRO_B, attention, 1, err), 0, "%s", err);
    Rng rng;
    rng_seed(&rng, 11);
    // random weights everywhere (DiT's zero init would leave most gradients exactly zero)
    rng_fill_normal(&rng, m.params_memory, m.num_params, 0.3f);
    size_t img = (size_t)micro.channels * micro.image_size * micro.image_size, n_out = MICRO_B * img;
    float x[MICRO_B * 2 * 64], t[MICRO_B], w[MICRO_B * 2 * 64];
    int labels[MICRO_B];
    random_batch(&rng, &micro, x, t, labels, MICRO_B);
    rng_fill_normal(&rng, w, n_out, 1.0f);
    ModelLoss ctx = {&m, x, t, w, labels, n_out};

    dit_forward(&m, &m.params, x, t, labels, MICRO_B);
    dit_zero_grad(&m);
    dit_backward(&m, w, labels, MICRO_B);   // dL/dout = w
    float *analytic = malloc(m.num_params * sizeof(float));
    memcpy(analytic, m.grads_memory, m.num_params * sizeof(float));

    int n = dit_num_tensors(&micro);
    DitTensorInfo *info = malloc(n * sizeof(DitTensorInfo));
    dit_tensor_infos(&micro, info);
    for (int i = 0; i < n; i++) {
        // up to 6 elements spread over the tensor, compared as one vector
        enum { SAMPLES = 6 };
        float a[SAMPLES];
        double fd[SAMPLES];
        int k = 0;
        for (size_t e = 0; e < info[i].numel && k < SAMPLES; e += info[i].numel / SAMPLES + 1, k++) {
            size_t at = info[i].offset + e;
            gc_numeric_grad(&fd[k], m.params_memory + at, 1, 1e-2f, model_loss, &ctx);
            a[k] = analytic[at];
        }
        double rel = gc_rel_error(a, fd, k);
        cr_expect_lt(rel, 2e-2, "%s: relative error %.3g of %d sampled elements (analytic %g, numeric %g)",
                     info[i].name, rel, k, a[0], fd[0]);
    }
    free(info);
    free(analytic);
    dit_free(&m);
}

// Every parameter tensor, through exact attention: central differences in fp32 forward with
// h = 1e-2 agree to ~1e-3 (measured); the bound is 2e-2.
Test(model, parameter_gradients_match_finite_differences) { check_param_gradients(DIT_ATTN_EXACT); }

// The backward accumulates: two backward calls give twice the gradient.
Test(model, backward_accumulates) {
    Dit m;
    char err[DIT_ERR_LEN];
    cr_assert_eq(dit_create(&m, &micro, MICRO_B, DIT_ATTN_EXACT, 1, err), 0, "%s", err);
    Rng rng;
    rng_seed(&rng, 3);
    rng_fill_normal(&rng, m.params_memory, m.num_params, 0.3f);
    float x[MICRO_B * 2 * 64], t[MICRO_B], w[MICRO_B * 2 * 64];
    int labels[MICRO_B];
    random_batch(&rng, &micro, x, t, labels, MICRO_B);
    rng_fill_normal(&rng, w, MICRO_B * 2 * 64, 1.0f);
    dit_forward(&m, &m.params, x, t, labels, MICRO_B);
    dit_zero_grad(&m);
    dit_backward(&m, w, labels, MICRO_B);
    float *once = malloc(m.num_params * sizeof(float));
    memcpy(once, m.grads_memory, m.num_params * sizeof(float));
    dit_backward(&m, w, labels, MICRO_B);
    for (size_t i = 0; i < m.num_params; i++)
        cr_assert_float_eq(m.grads_memory[i], 2.0f * once[i], 1e-5f * (1.0f + fabsf(once[i])), "param %zu", i);
    free(once);
    dit_free(&m);
}

// The model with sage attention (kind DIT_ATTN_SAGE: FP8 P·V, or DIT_ATTN_SAGE_FP16; rotate = 1:
// the Hadamard rotation of q and k, as train_dit runs it) against the model with exact attention
// on the same weights and batch, and against plain sage (FP8, unrotated): a variant must change
// the result, and FP16 P·V must come closer to exact.
static void check_sage_close_to_exact(int head_dim, DitAttention kind, int rotate) {
    DitConfig cfg = {.image_size = 16, .channels = 1, .patch = 2, .hidden = 2 * head_dim,
                     .depth = 1, .heads = 2, .num_classes = 3};
    Dit exact, sage, plain;
    char err[DIT_ERR_LEN];
    cr_assert_eq(dit_create(&exact, &cfg, MICRO_B, DIT_ATTN_EXACT, 1, err), 0, "%s", err);
    cr_assert_eq(dit_create(&sage, &cfg, MICRO_B, kind, 1, err), 0, "%s", err);
    cr_assert_eq(sage.attention, DIT_ATTN_SAGE);
    cr_assert_eq(sage.sage.pv, kind == DIT_ATTN_SAGE_FP16 ? SAGE_PV_FP16 : SAGE_PV_FP8);
    cr_assert_eq(dit_create(&plain, &cfg, MICRO_B, DIT_ATTN_SAGE, 1, err), 0, "%s", err);
    sage.sage.rotate = rotate;
    Rng rng;
    rng_seed(&rng, 21);
    rng_fill_normal(&rng, exact.params_memory, exact.num_params, 0.05f);
    memcpy(sage.params_memory, exact.params_memory, exact.num_params * sizeof(float));
    memcpy(plain.params_memory, exact.params_memory, exact.num_params * sizeof(float));
    size_t n_out = MICRO_B * 16 * 16;
    float x[MICRO_B * 256], t[MICRO_B], w[MICRO_B * 256];
    int labels[MICRO_B];
    random_batch(&rng, &cfg, x, t, labels, MICRO_B);
    rng_fill_normal(&rng, w, n_out, 1.0f);
    Dit *models[3] = {&exact, &sage, &plain};
    for (int i = 0; i < 3; i++) {
        dit_forward(models[i], &models[i]->params, x, t, labels, MICRO_B);
        dit_zero_grad(models[i]);
        dit_backward(models[i], w, labels, MICRO_B);
    }
    double out_cos = cosine(sage.acts.out, exact.acts.out, n_out);
    double grad_cos = cosine(sage.grads_memory, exact.grads_memory, exact.num_params);
    cr_expect_gt(out_cos, 0.999, "head dim %d rotate %d: output cosine %.6f", head_dim, rotate, out_cos);
    cr_expect_gt(grad_cos, 0.99, "head dim %d rotate %d: gradient cosine %.6f", head_dim, rotate, grad_cos);
    cr_expect_neq(memcmp(sage.acts.out, exact.acts.out, n_out * sizeof(float)), 0,
                  "head dim %d: sage gave exactly the exact output: is it quantizing?", head_dim);
    if (rotate || kind == DIT_ATTN_SAGE_FP16)   // what is quantized changed: so must the result
        cr_expect_neq(memcmp(sage.acts.out, plain.acts.out, n_out * sizeof(float)), 0,
                      "head dim %d: the variant gave plain sage's output: is it used?", head_dim);
    if (kind == DIT_ATTN_SAGE_FP16) {
        double plain_cos = cosine(plain.acts.out, exact.acts.out, n_out);
        cr_expect_gt(out_cos, plain_cos, "head dim %d: FP16 P·V (cosine %.7f) not closer to exact than FP8 (%.7f)",
                     head_dim, out_cos, plain_cos);
    }
    dit_free(&exact);
    dit_free(&sage);
    dit_free(&plain);
}

Test(model, sage_close_to_exact_head_dim_64) { check_sage_close_to_exact(64, DIT_ATTN_SAGE, 0); }
Test(model, sage_close_to_exact_head_dim_128) { check_sage_close_to_exact(128, DIT_ATTN_SAGE, 0); }
Test(model, rotated_sage_close_to_exact_head_dim_64) { check_sage_close_to_exact(64, DIT_ATTN_SAGE, 1); }
Test(model, rotated_sage_close_to_exact_head_dim_128) { check_sage_close_to_exact(128, DIT_ATTN_SAGE, 1); }
Test(model, sage_fp16_close_to_exact_head_dim_64) { check_sage_close_to_exact(64, DIT_ATTN_SAGE_FP16, 0); }
Test(model, sage_fp16_close_to_exact_head_dim_128) { check_sage_close_to_exact(128, DIT_ATTN_SAGE_FP16, 1); }

// ---- checkpoints -------------------------------------------------------------------------

static void temp_path(char *path, size_t n, const char *name) {
    snprintf(path, n, "/tmp/ditc_test_%d_%s", (int)getpid(), name);
}

Test(checkpoint, round_trip_is_bit_exact) {
    Dit a, b;
    char err[DIT_ERR_LEN], path[256];
    temp_path(path, sizeof(path), "ckpt.safetensors");
    cr_assert_eq(dit_create(&a, &micro, 1, DIT_ATTN_EXACT, 1, err), 0, "%s", err);
    cr_assert_eq(dit_create(&b, &micro, 1, DIT_ATTN_EXACT, 2, err), 0, "%s", err);
    Rng rng;
    rng_seed(&rng, 9);
    rng_fill_normal(&rng, a.params_memory, 5 * a.num_params, 1.0f);   // weights, grads, EMA, m, v
    TrainState s = {.step = 1234, .rng_state = 0xFEEDFACECAFEBEEFull, .data_epoch = 3,
                    .data_index = 77, .data_rng_state = 0x123456789ull}, r;
    cr_assert_eq(checkpoint_save(path, &a, &s, "a,b,c", err), 0, "%s", err);
    DitConfig cfg;
    cr_assert_eq(checkpoint_read_config(path, &cfg, err), 0, "%s", err);
    cr_assert_eq(memcmp(&cfg, &micro, sizeof(cfg)), 0);
    cr_assert_eq(checkpoint_load(path, &b, &r, err), 0, "%s", err);
    cr_assert_eq(memcmp(a.params_memory, b.params_memory, a.num_params * sizeof(float)), 0);
    cr_assert_eq(memcmp(a.ema_memory, b.ema_memory, a.num_params * sizeof(float)), 0);
    cr_assert_eq(memcmp(a.adam_m_memory, b.adam_m_memory, a.num_params * sizeof(float)), 0);
    cr_assert_eq(memcmp(a.adam_v_memory, b.adam_v_memory, a.num_params * sizeof(float)), 0);
    cr_assert_eq(memcmp(&s, &r, sizeof(s)), 0);
    remove(path);
    dit_free(&a);
    dit_free(&b);
}

Test(checkpoint, wrong_model_config_is_rejected) {
    Dit a, b;
    char err[DIT_ERR_LEN], path[256];
    temp_path(path, sizeof(path), "ckpt_cfg.safetensors");
    DitConfig other = micro;
    other.depth = 3;
    cr_assert_eq(dit_create(&a, &micro, 1, DIT_ATTN_EXACT, 1, err), 0);
    cr_assert_eq(dit_create(&b, &other, 1, DIT_ATTN_EXACT, 1, err), 0);
    TrainState s = {0};
    cr_assert_eq(checkpoint_save(path, &a, &s, NULL, err), 0, "%s", err);
    cr_assert_eq(checkpoint_load(path, &b, &s, err), -1);
    cr_assert(strstr(err, "differs from the model") && strstr(err, path), "%s", err);
    remove(path);
    dit_free(&a);
    dit_free(&b);
}

Test(checkpoint, truncated_and_foreign_files_are_rejected) {
    Dit a;
    char err[DIT_ERR_LEN], path[256], bad[256];
    temp_path(path, sizeof(path), "ckpt_ok.safetensors");
    temp_path(bad, sizeof(bad), "ckpt_bad.safetensors");
    cr_assert_eq(dit_create(&a, &micro, 1, DIT_ATTN_EXACT, 1, err), 0);
    TrainState s = {0};
    cr_assert_eq(checkpoint_save(path, &a, &s, NULL, err), 0, "%s", err);
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    rewind(f);
    char *bytes = malloc(size);
    cr_assert_eq(fread(bytes, 1, size, f), (size_t)size);
    fclose(f);
    // cut anywhere: in the length, in the header, in the data
    long cuts[] = {0, 4, 8, 20, size / 2, size - 1};
    for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
        f = fopen(bad, "wb");
        fwrite(bytes, 1, cuts[i], f);
        fclose(f);
        err[0] = 0;
        cr_assert_eq(checkpoint_load(bad, &a, &s, err), -1, "cut at %ld accepted", cuts[i]);
        cr_assert(strstr(err, bad), "cut at %ld: the error does not name the file: %s", cuts[i], err);
    }
    // a valid safetensors file that is not a dit.c checkpoint
    SafetensorsWriter *w = st_writer_new();
    float one = 1.0f;
    st_writer_add(w, "x", ST_F32, (int64_t[]){1}, 1, &one);
    cr_assert_eq(st_writer_save(w, bad, err), 0, "%s", err);
    st_writer_free(w);
    cr_assert_eq(checkpoint_load(bad, &a, &s, err), -1);
    cr_assert(strstr(err, "not a dit.c checkpoint"), "%s", err);
    free(bytes);
    remove(path);
    remove(bad);
    dit_free(&a);
}

// ---- the trainer: resume continues bit-identically ---------------------------------------

static int read_losses(const char *csv, char lines[][256], int max) {
    FILE *f = fopen(csv, "r");
    if (!f) return -1;
    char line[256];
    int n = 0;
    while (fgets(line, sizeof(line), f) && n < max) {
        if (line[0] < '0' || line[0] > '9') continue;   // header
        // step,loss,grad_norm: the first three columns must match exactly (ms differ)
        char *third = strchr(strchr(strchr(line, ',') + 1, ',') + 1, ',');
        *third = 0;
        snprintf(lines[n++], 256, "%s", line);
    }
    fclose(f);
    return n;
}

Test(trainer, resume_gives_bit_identical_losses, .timeout = 300) {
    if (access("./train_dit", X_OK) != 0) cr_skip_test("./train_dit is not built");
    char dir[200], cmd[2048], csv[300];
    temp_path(dir, sizeof(dir), "resume");
    const char *common = "--data synthetic --model tiny --image-size 16 --patch 4 --batch 4 "
                         "--steps 6 --sample-every 0 --attn sage --warmup 2 > /dev/null";
    snprintf(cmd, sizeof(cmd), "rm -rf %s && ./train_dit %s --out %s/full --ckpt-every 3", dir, common, dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    snprintf(cmd, sizeof(cmd), "mkdir -p %s/resumed && cp %s/full/train_log.csv %s/resumed/ && "
             "sed -i '5,$d' %s/resumed/train_log.csv && ./train_dit %s --out %s/resumed --ckpt-every 0 "
             "--resume %s/full/ckpt_000003.safetensors", dir, dir, dir, dir, common, dir, dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    char full[8][256], resumed[8][256];
    snprintf(csv, sizeof(csv), "%s/full/train_log.csv", dir);
    cr_assert_eq(read_losses(csv, full, 8), 6);
    snprintf(csv, sizeof(csv), "%s/resumed/train_log.csv", dir);
    cr_assert_eq(read_losses(csv, resumed, 8), 6);
    for (int i = 0; i < 6; i++) cr_assert_str_eq(resumed[i], full[i], "step %d", i + 1);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

// ./train_dit with args; returns its exit status and its output (stdout and stderr) in out.
static int run_train_dit(const char *args, char *out, size_t cap) {
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "./train_dit %s 2>&1", args);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "%s", cmd);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// One step of a tiny model on the CPU with `flags`, in a temporary --out removed after: it must
// train; its output is left in out.
static void expect_one_cpu_step(const char *flags, char *out, size_t cap) {
    char dir[200], args[512];
    temp_path(dir, sizeof(dir), "one_step");
    snprintf(args, sizeof(args), "--device cpu %s --data synthetic --model tiny --image-size 16 --patch 4 --batch 2 "
             "--steps 1 --sample-every 0 --ckpt-every 0 --out %s", flags, dir);
    cr_assert_eq(run_train_dit(args, out, cap), 0, "%s: %s", flags, out);
    cr_expect(strstr(out, "step     1/1"), "%s: %s", flags, out);
    snprintf(args, sizeof(args), "rm -rf %s", dir);
    cr_assert_eq(system(args), 0);
}

// train_dit with `args` must stop with exit status 1, saying `says` (and `also_says` unless NULL).
static void expect_refused(const char *args, const char *says, const char *also_says) {
    char out[8192];
    cr_assert_eq(run_train_dit(args, out, sizeof(out)), 1, "%s: %s", args, out);
    cr_expect(strstr(out, says) && (!also_says || strstr(out, also_says)), "%s: %s", args, out);
}

// --cuda-graph takes on or off; on is refused where there is no single-GPU step to capture
// (--device cpu here; with several ranks and with --dump-parity alike); off trains on the CPU.
Test(trainer, cuda_graph_flag, .timeout = 120) {
    if (access("./train_dit", X_OK) != 0) cr_skip_test("./train_dit is not built");
    char out[8192];
    expect_refused("--cuda-graph maybe --data synthetic", "--cuda-graph: expected on or off, got 'maybe'", NULL);
    expect_refused("--device cpu --cuda-graph on --data synthetic", "--cuda-graph on", "--device cpu");
    expect_refused("--cuda-graph", "missing value", NULL);
    expect_one_cpu_step("--cuda-graph off", out, sizeof(out));
    cr_expect(!strstr(out, "CUDA graph"), "%s", out);
}

// --gemm-tuning takes on or off; on is refused on the CPU and with --deterministic (its picks depend
// on timings); off trains on the CPU.
Test(trainer, gemm_tuning_flag, .timeout = 120) {
    if (access("./train_dit", X_OK) != 0) cr_skip_test("./train_dit is not built");
    char out[8192];
    expect_refused("--gemm-tuning maybe --data synthetic", "--gemm-tuning: expected on or off, got 'maybe'", NULL);
    expect_refused("--device cpu --gemm-tuning on --data synthetic", "--gemm-tuning on", "--device cpu");
    expect_one_cpu_step("--gemm-tuning off", out, sizeof(out));
}

// --zero-overlap takes auto, on or off; on is refused in one process (no reduction over ranks to
// overlap); auto (the default) and off train on the CPU.
Test(trainer, zero_overlap_flag, .timeout = 120) {
    if (access("./train_dit", X_OK) != 0) cr_skip_test("./train_dit is not built");
    char out[8192];
    expect_refused("--zero-overlap yes --data synthetic", "--zero-overlap: expected auto, on or off, got 'yes'", NULL);
    expect_refused("--device cpu --zero-overlap on --data synthetic", "--zero-overlap on: several GPUs only", NULL);
    expect_refused("--zero-overlap", "missing value", NULL);
    expect_one_cpu_step("--zero-overlap auto", out, sizeof(out));
    expect_one_cpu_step("--zero-overlap off", out, sizeof(out));
}

// --linear bf16 | fp8: any other value, and fp8 on the CPU, stop before training with a message
// naming the flag, as does an unknown --fp8-fast-accum; bf16 (the default) trains on the CPU.
Test(trainer, linear_flag_is_checked, .timeout = 120) {
    if (access("./train_dit", X_OK) != 0) cr_skip_test("./train_dit is not built");
    char out[8192], dir[200], args[512];
    temp_path(dir, sizeof(dir), "linear_flag");
    const char *common = "--data synthetic --model tiny --image-size 16 --patch 4 --batch 2 --steps 1 "
                         "--sample-every 0 --ckpt-every 0 --warmup 0";
    snprintf(args, sizeof(args), "%s --out %s --linear fp9", common, dir);
    cr_expect_neq(run_train_dit(args, out, sizeof(out)), 0, "--linear fp9 was accepted");
    cr_expect(strstr(out, "--linear: expected bf16 or fp8, got 'fp9'"), "%s", out);
    snprintf(args, sizeof(args), "%s --out %s --device cpu --linear fp8", common, dir);
    cr_expect_neq(run_train_dit(args, out, sizeof(out)), 0, "--device cpu --linear fp8 was accepted");
    cr_expect(strstr(out, "--linear fp8") && strstr(out, "GPU only"), "%s", out);
    snprintf(args, sizeof(args), "%s --out %s --fp8-fast-accum some", common, dir);
    cr_expect_neq(run_train_dit(args, out, sizeof(out)), 0, "--fp8-fast-accum some was accepted");
    cr_expect(strstr(out, "--fp8-fast-accum: expected none, forward or all, got 'some'"), "%s", out);
    snprintf(args, sizeof(args), "%s --out %s --device cpu --linear bf16", common, dir);
    cr_expect_eq(run_train_dit(args, out, sizeof(out)), 0, "--linear bf16 failed: %s", out);
    snprintf(args, sizeof(args), "rm -rf %s", dir);
    cr_assert_eq(system(args), 0);
}
