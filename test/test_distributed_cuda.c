// Tests of data-parallel training over NCCL (model/distributed.h with model/dit_gpu.h) on 2 GPUs,
// each rank a forked process that makes its communicator as train_dit does (unique id through a
// file, ncclCommInitRank). The test process itself touches CUDA only after its children have
// exited (CUDA does not survive fork). Skipped with fewer than 2 GPUs or without NCCL.
//
// 1. One data-parallel step on two half-batches equals one single-GPU step on the full batch:
//    mean loss, averaged gradients, parameters after AdamW, and both ranks' parameters are
//    bitwise equal. AdamW runs with eps = 1 so that its update is ≈ lr·g (with eps 1e-8 the first
//    update is lr·sign(g), which hides the gradient's scale and flips on near-zero elements).
//    Tolerances (estimates, not yet measured on a GPU): every per-image computation is the same
//    on both sides (attention, LayerNorm and the loss are per image; dL/dout differs by the exact
//    factor 2), so differences come from fp32 sums in another order (cuBLASLt's choice for M = B·T
//    rows vs B·T/2, the weight-gradient sums over the rows, the loss mean) and the bf16 roundings
//    they flip: TOL_LOSS 1e-4, TOL_GRAD 2e-3 (relative L2 over all gradients), TOL_UPDATE 5e-3
//    on the update p_after - p_before, TOL_PARAMS 1e-5 on the parameters.
//    Negative control: rank 0's own gradient (its half-batch, before the all-reduce) must differ
//    from the full batch's by more than 0.1, so the comparison can tell (a missing all-reduce or a
//    sum without the 1/world also fail: the gradients would be off by ~0.7 and 1.0).
// 2. A rank that exits after joining makes the other's all-reduce fail within the timeout, with
//    an error naming the rank; a rank that never starts makes the other's communicator creation fail.
// 3. ZeRO-1 (model/zero.h) equals the replicated update: ZERO_STEPS data-parallel steps, each rank
//    once with the gradients all-reduced and the whole buffer updated (what train_dit did before),
//    for the plain model and for one created with zero_overlap (adaLN gradients per block), then
//    with zero_step_queue called right after the backward as train_dit does, three times: the
//    reduce-scatter after the backward (plain model), the reduction behind the backward with one
//    block per bucket (each block's ncclReduces, its adaLN slice included, wait for its own event)
//    and with train_dit's bucket (the test model's 2 blocks in one), each against the replicated
//    run of its model; the shard boundary falls inside block 1's qkv weight, so a range
//    is cut there and both roots get pieces (checked). Clipping not acting (grad_clip 1e9), sage's backward
//    deterministic (both paths must see the same gradients bit for bit). AdamW and EMA are elementwise
//    and with 2 ranks a·s + b·s is the same sum whichever collective makes it, so after
//    zero_gather_state the fp32 weights, EMA, both moments, the bf16 weights and the losses must be
//    BITWISE the replicated ones, on both ranks (the EMA also after the EMA-only gather that
//    sampling does); the norm (Σ g² summed per slice, then over the slices) within 1e-6 relative. Negative control: before the gather, rank 0's fp32 weights of
//    rank 1's slice are stale (differ from the gathered ones).
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cuda_runtime_api.h>
#include "attention/sage_cuda.h"
#include "layers/common.h"
#include "layers/layers.h"
#include "model/distributed.h"
#include "model/dit.h"
#include "model/dit_gpu.h"
#include "model/zero.h"
#include "test/compare.h"
#include "test/model_test.h"
#include "test/ranks_test.h"

#ifndef DIT_NCCL
Test(data_parallel, needs_nccl) { cr_skip_test("this build has no NCCL (nccl.h not found)"); }
#else

#define TOL_LOSS 1e-4
#define TOL_GRAD 2e-3
#define TOL_UPDATE 5e-3
#define TOL_PARAMS 1e-5
#define NEGATIVE_CONTROL 0.1
#define TOL_ZERO_NORM 1e-6

// 20×20 images, patch 2: 100 tokens, head dim 64 (as test_dit_gpu_cuda).
static const DitConfig config = {.image_size = 20, .channels = 3, .patch = 2, .hidden = 128,
                                 .depth = 2, .heads = 2, .num_classes = 5};
enum { FULL_BATCH = 8, WORLD = 2 };
static const float LR = 1e-2f, EPS = 1.0f, WEIGHT_DECAY = 0.1f;

#define REQUIRE_2_GPUS() do {                                                                  \
        if (gpu_count_in_child() < 2) cr_skip_test("fewer than 2 CUDA GPUs");                   \
    } while (0)

// The full batch (x0, noise, t, labels) from a fixed seed; rank r takes images r·B/2 .. .
typedef struct { float x0[FULL_BATCH * 1200], noise[FULL_BATCH * 1200], t[FULL_BATCH]; int labels[FULL_BATCH]; } FullBatch;
static const size_t IMG = 3 * 20 * 20;

static void full_batch(FullBatch *b) {
    Rng rng;
    rng_seed(&rng, 1234);
    rng_fill_normal(&rng, b->x0, FULL_BATCH * IMG, 1.0f);
    rng_fill_normal(&rng, b->noise, FULL_BATCH * IMG, 1.0f);
    for (int i = 0; i < FULL_BATCH; i++) {
        b->t[i] = 0.05f + 0.9f * rng_uniform(&rng);
        b->labels[i] = (int)(rng_u32(&rng) % (uint32_t)(config.num_classes + 1));
    }
}

// What one step gives: the loss, the gradients before and after the all-reduce, the parameters.
typedef struct { float loss; float *grads_local, *grads, *params_before, *params; size_t n; } StepResult;

// One step on the current device: images [first, first + B) of the full batch; with comm, the
// gradients and loss are averaged over the ranks before the update (as train_dit). Fills r.
static int one_step(DistComm *comm, int first, int B, StepResult *r, char *err) {
    static FullBatch b;
    full_batch(&b);
    Dit cpu;
    DitGpu gpu;
    if (dit_create(&cpu, &config, 1, DIT_ATTN_SAGE, 7, err) != 0) return -1;
    randomize_params(&cpu, 7);
    r->n = cpu.num_params;
    r->grads_local = malloc(r->n * sizeof(float));
    r->grads = malloc(r->n * sizeof(float));
    r->params_before = malloc(r->n * sizeof(float));
    r->params = malloc(r->n * sizeof(float));
    memcpy(r->params_before, cpu.params_memory, r->n * sizeof(float));
    int rc = dit_gpu_create(&gpu, &config, B, DIT_ATTN_SAGE, err) || dit_gpu_upload(&gpu, &cpu, err) ||
             dit_gpu_set_flow_batch(&gpu, b.x0 + first * IMG, b.noise + first * IMG, b.t + first, b.labels + first,
                                    B, err) ||
             dit_gpu_forward(&gpu, &gpu.weights, B, err) || dit_gpu_loss(&gpu, B, err) ||
             dit_gpu_zero_grad(&gpu, err) || dit_gpu_backward(&gpu, B, err) ||
             dit_gpu_download_grads(&gpu, r->grads_local, err);
    if (rc == 0 && comm) {
        float *buffers[2] = {gpu.grads_memory, gpu.acts.loss};
        size_t counts[2] = {gpu.num_params, 1};
        rc = dist_all_reduce_mean(comm, buffers, counts, 2, gpu.stream, err);
    }
    rc = rc || dit_gpu_read_scalars(&gpu, &r->loss, NULL, err) || dit_gpu_download_grads(&gpu, r->grads, err) ||
         dit_gpu_grad_sumsq(&gpu, err) || dit_gpu_update(&gpu, LR, 0.9f, 0.999f, EPS, WEIGHT_DECAY, 0.0f, 0.99f, 1, err) ||
         dit_gpu_download(&gpu, &cpu, err);
    if (rc == 0) memcpy(r->params, cpu.params_memory, r->n * sizeof(float));
    dit_gpu_free(&gpu);
    dit_free(&cpu);
    return rc ? -1 : 0;
}

static DistEnv rank_env(int rank, const char *run_id) {
    DistEnv env = {.rank = rank, .world_size = WORLD, .local_rank = rank, .local_world_size = WORLD,
                   .master_port = DIST_DEFAULT_PORT};
    snprintf(env.launcher, sizeof(env.launcher), "test");
    snprintf(env.run_id, sizeof(env.run_id), "%s", run_id);
    return env;
}

// Waits for the children until the deadline (then kills them); statuses[r] = the exit status,
// or -1 when killed or crashed. Returns the seconds waited.
static double wait_children(const pid_t *pids, int n, double timeout_s, int *statuses) {
    double start = now_s();
    int left = n;
    for (int r = 0; r < n; r++) statuses[r] = -2;
    while (left > 0) {
        for (int r = 0; r < n; r++) {
            int st;
            if (statuses[r] != -2 || waitpid(pids[r], &st, WNOHANG) != pids[r]) continue;
            statuses[r] = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
            left--;
        }
        if (left > 0 && now_s() - start > timeout_s) {
            for (int r = 0; r < n; r++) if (statuses[r] == -2) kill(pids[r], SIGKILL);
            timeout_s = INFINITY;   // reap them on the next rounds
        }
        usleep(20000);
    }
    return now_s() - start;
}

// ---- 1. data parallel = single GPU ---------------------------------------------------------

static void dp_rank(int rank, const char *dir) {
    char err[DIT_ERR_LEN], path[512], run_id[64];
    snprintf(run_id, sizeof(run_id), "dp-%d", (int)getppid());
    DistEnv env = rank_env(rank, run_id);
    DistComm *comm;
    StepResult r;
    if (dist_comm_create(&comm, &env, dir, 60.0, err) != 0 ||
        one_step(comm, rank * FULL_BATCH / WORLD, FULL_BATCH / WORLD, &r, err) != 0) {
        fprintf(stderr, "rank %d: %s\n", rank, err);
        _exit(1);
    }
    const struct { const char *name; const float *x; size_t n; } out[] = {
        {"loss", &r.loss, 1}, {"grads_local", r.grads_local, r.n}, {"grads", r.grads, r.n}, {"params", r.params, r.n}};
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof(path), "%s/rank%d_%s", dir, rank, out[i].name);
        if (write_floats(path, out[i].x, out[i].n) != 0) _exit(1);
    }
    dist_comm_destroy(comm);
    _exit(0);
}

// Runs rank_main(r, dir) in WORLD forked children; each must exit with 0 within 200 s.
static void run_ranks(void (*rank_main)(int, const char *), const char *dir) {
    fflush(NULL);
    pid_t pids[WORLD];
    for (int r = 0; r < WORLD; r++)
        if ((pids[r] = fork()) == 0) rank_main(r, dir);
    int statuses[WORLD];
    double took = wait_children(pids, WORLD, 200.0, statuses);
    for (int r = 0; r < WORLD; r++)
        cr_assert_eq(statuses[r], 0, "rank %d exited with %d after %.1f s (see its stderr)", r, statuses[r], took);
}

Test(data_parallel, two_half_batches_equal_one_full_batch, .timeout = 300) {
    REQUIRE_2_GPUS();
    char dir[] = "/tmp/test_distributed_cuda_XXXXXX", path[512], err[DIT_ERR_LEN];
    cr_assert(mkdtemp(dir));
    run_ranks(dp_rank, dir);

    // the reference, now that the children are gone: one GPU, the full batch
    StepResult ref;
    cr_assert_eq(cudaSetDevice(0), cudaSuccess);
    cr_assert_eq(one_step(NULL, 0, FULL_BATCH, &ref, err), 0, "%s", err);
    size_t n = ref.n;
    float *dp[WORLD][4];
    const char *names[4] = {"loss", "grads_local", "grads", "params"};
    for (int r = 0; r < WORLD; r++)
        for (int i = 0; i < 4; i++) {
            snprintf(path, sizeof(path), "%s/rank%d_%s", dir, r, names[i]);
            dp[r][i] = read_floats(path, i == 0 ? 1 : n);
        }
    float *update_dp = malloc(n * sizeof(float)), *update_ref = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        update_dp[i] = dp[0][3][i] - ref.params_before[i];
        update_ref[i] = ref.params[i] - ref.params_before[i];
    }
    double e_loss = fabs((double)dp[0][0][0] - ref.loss) / fabs(ref.loss);
    double e_grad = rel_l2(dp[0][2], ref.grads, n), e_local = rel_l2(dp[0][1], ref.grads, n);
    double e_update = rel_l2(update_dp, update_ref, n), e_params = rel_l2(dp[0][3], ref.params, n);
    fprintf(stderr, "data parallel (2 ranks x %d) vs one GPU (%d images): loss %.3g (%.6f vs %.6f), grads %.3g, "
            "update %.3g, params %.3g; rank 0's own gradient %.3g (negative control)\n", FULL_BATCH / WORLD,
            FULL_BATCH, e_loss, dp[0][0][0], ref.loss, e_grad, e_update, e_params, e_local);
    cr_assert_eq(memcmp(dp[0][3], dp[1][3], n * sizeof(float)), 0, "the ranks' parameters differ after the update");
    cr_assert_eq(memcmp(dp[0][0], dp[1][0], sizeof(float)), 0, "the ranks' losses differ");
    cr_expect(e_loss < TOL_LOSS, "loss %.3g >= %g", e_loss, TOL_LOSS);
    cr_expect(e_grad < TOL_GRAD, "gradients %.3g >= %g", e_grad, TOL_GRAD);
    cr_expect(e_update < TOL_UPDATE, "update %.3g >= %g", e_update, TOL_UPDATE);
    cr_expect(e_params < TOL_PARAMS, "parameters %.3g >= %g", e_params, TOL_PARAMS);
    cr_expect(e_local > NEGATIVE_CONTROL, "rank 0's half-batch gradient is within %.3g of the full batch's: "
              "the comparison cannot tell", e_local);
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    system(cmd);
}

// ---- 2. no hang when a rank goes away ------------------------------------------------------

// Exit codes of the surviving rank: 2 = failed as expected with an error naming it, 3 = failed
// with another message, 4 = succeeded (it should not have), 1 = setup failed. do_all_reduce: 0 none,
// 1 dist_all_reduce_mean (waits), 2 dist_all_reduce_scaled_queue then dist_wait_event on an event
// recorded after it (train_dit's step).
static void survivor(int rank, const char *dir, const char *run_id, double timeout_s, int do_all_reduce) {
    char err[DIT_ERR_LEN] = "";
    DistEnv env = rank_env(rank, run_id);
    DistComm *comm;
    int rc = dist_comm_create(&comm, &env, dir, timeout_s, err);
    if (rc == 0 && do_all_reduce) {
        float *x;
        cudaStream_t s;
        if (cudaMalloc((void **)&x, (1 << 20) * sizeof(float)) != cudaSuccess ||
            cudaStreamCreate(&s) != cudaSuccess || cudaMemset(x, 0, (1 << 20) * sizeof(float)) != cudaSuccess)
            _exit(1);
        size_t count = 1 << 20;
        float scale = 0.5f;
        cudaEvent_t done;
        if (do_all_reduce == 1) {
            rc = dist_all_reduce_mean(comm, &x, &count, 1, s, err);
        } else {
            if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess) _exit(1);
            rc = dist_all_reduce_scaled_queue(comm, &x, &count, &scale, 1, s, err);
            if (rc == 0 && cudaEventRecord(done, s) != cudaSuccess) _exit(1);
            if (rc == 0) rc = dist_wait_event(comm, done, "the queued step", err);
        }
    }
    fprintf(stderr, "surviving rank %d: %s\n", rank, rc ? err : "(no error)");
    char expect[32];
    snprintf(expect, sizeof(expect), "rank %d of 2", rank);
    _exit(rc == 0 ? 4 : strstr(err, expect) ? 2 : 3);
}

// mode: survivor's do_all_reduce (1 or 2)
static void exit_after_joining(int mode) {
    char dir[] = "/tmp/test_distributed_cuda_XXXXXX", run_id[64];
    cr_assert(mkdtemp(dir));
    snprintf(run_id, sizeof(run_id), "exit-%d", (int)getpid());
    fflush(NULL);
    pid_t pids[WORLD];
    if ((pids[0] = fork()) == 0) survivor(0, dir, run_id, 20.0, mode);
    if ((pids[1] = fork()) == 0) {
        char err[DIT_ERR_LEN];
        DistEnv env = rank_env(1, run_id);
        DistComm *comm;
        _exit(dist_comm_create(&comm, &env, dir, 60.0, err) == 0 ? 0 : 1);   // joins, then leaves
    }
    int statuses[WORLD];
    double took = wait_children(pids, WORLD, 150.0, statuses);
    fprintf(stderr, "rank 0 ended %.1f s after the start (timeout 20 s)\n", took);
    cr_assert_eq(statuses[1], 0, "rank 1 did not join (status %d)", statuses[1]);
    cr_assert_eq(statuses[0], 2, "rank 0: status %d (2: failed naming the rank; 3: other message; 4: no error; "
                 "-1: killed after 150 s, a hang)", statuses[0]);
    cr_assert(took < 100.0, "took %.1f s", took);
}

Test(faults, a_rank_that_exits_after_joining_fails_the_other_within_the_timeout, .timeout = 200) {
    REQUIRE_2_GPUS();
    exit_after_joining(1);
}

Test(faults, a_rank_that_exits_fails_the_others_queued_step_within_the_timeout, .timeout = 200) {
    REQUIRE_2_GPUS();
    exit_after_joining(2);
}

Test(faults, a_rank_that_never_starts_fails_the_other_within_the_timeout, .timeout = 200) {
    REQUIRE_2_GPUS();
    char dir[] = "/tmp/test_distributed_cuda_XXXXXX", run_id[64];
    cr_assert(mkdtemp(dir));
    snprintf(run_id, sizeof(run_id), "absent-%d", (int)getpid());
    fflush(NULL);
    pid_t pid;
    if ((pid = fork()) == 0) survivor(0, dir, run_id, 10.0, 0);
    int status;
    double took = wait_children(&pid, 1, 150.0, &status);
    fprintf(stderr, "rank 0 alone ended after %.1f s (timeout 10 s)\n", took);
    cr_assert_eq(status, 2, "rank 0: status %d (2: failed naming the rank; 3: other message; 4: no error; "
                 "-1: killed after 150 s, a hang)", status);
    cr_assert(took < 60.0, "took %.1f s", took);
}

// ---- 3. ZeRO-1 = the replicated update, bitwise -------------------------------------------

enum { ZERO_STEPS = 3 };
static const float NO_CLIP = 1e9f;
// Per rank and path: the fp32 weights, EMA, moments, the bf16 weights (as floats), the losses and
// norms of the steps, and (ZeRO) the fp32 weights before any gather and the EMA after the
// EMA-only gather (what sampling does).
static const char *const zero_names[] = {"params", "ema", "m", "v", "weights", "loss", "norm", "stale", "ema_only"};
enum { Z_PARAMS, Z_EMA, Z_M, Z_V, Z_WEIGHTS, Z_LOSS, Z_NORM, Z_STALE, Z_EMA_ONLY };

static int write_result(const char *dir, int rank, const char *path_kind, int what, const float *x, size_t n) {
    char path[512];
    snprintf(path, sizeof(path), "%s/rank%d_%s_%s", dir, rank, path_kind, zero_names[what]);
    return write_floats(path, x, n);
}

// The runs of each rank: the replicated update, of the plain model and of one created with
// zero_overlap (its adaLN gradients per block), then ZeRO-1 with each of its reductions
// (zero_step_queue's bucket_floats: 0 after the backward, else behind it), each compared with the
// replicated run `ref` of the same model.
typedef struct { const char *name; int sharded, overlap; size_t bucket_floats; const char *ref; } ZeroRun;
static const ZeroRun zero_runs[] = {
    {"replicated", 0, 0, 0, NULL},
    {"replicated_overlap", 0, 1, 0, NULL},
    {"zero_after", 1, 0, 0, "replicated"},
    {"zero_per_block", 1, 1, 1, "replicated_overlap"},
    {"zero_bucket", 1, 1, ZERO_BUCKET_FLOATS, "replicated_overlap"},
};
enum { N_ZERO_RUNS = sizeof(zero_runs) / sizeof(zero_runs[0]) };

// ZERO_STEPS steps of this rank's half-batch; sharded: ZeRO-1, else all-reduce + whole update.
static int zero_or_replicated(DistComm *comm, int rank, const ZeroRun *run, const char *dir, char *err) {
    static FullBatch b;
    full_batch(&b);
    Dit cpu;
    DitGpu gpu;
    memset(&gpu, 0, sizeof(gpu));   // freed below also when an allocation failed first
    if (dit_create(&cpu, &config, 1, DIT_ATTN_SAGE, 7, err) != 0) return -1;
    randomize_params(&cpu, 7);
    size_t n = cpu.num_params;
    int B = FULL_BATCH / WORLD, first = rank * B;
    const char *kind = run->name;
    int sharded = run->sharded;
    DitGpuSeqParallel par = {.ulysses = 1, .ring = 1, .optimizer_shards = sharded ? WORLD : 1,
                             .optimizer_rank = sharded ? rank : 0, .zero_overlap = run->overlap};
    float loss[ZERO_STEPS], norm[ZERO_STEPS], *x = malloc(n * sizeof(float));
    bf16 *w = malloc(n * sizeof(bf16));
    if (!x || !w) dit_set_error(err, "out of host memory for %zu parameters", n);
    int rc = !x || !w || dit_gpu_create_sp(&gpu, &config, B, DIT_ATTN_SAGE, DIT_LINEAR_BF16, &par, err) ||
             dit_gpu_upload(&gpu, &cpu, err);
    for (int k = 0; rc == 0 && k < ZERO_STEPS; k++) {
        rc = dit_gpu_set_flow_batch(&gpu, b.x0 + first * IMG, b.noise + first * IMG, b.t + first, b.labels + first, B,
                                    err) ||
             dit_gpu_forward(&gpu, &gpu.weights, B, err) || dit_gpu_loss(&gpu, B, err) ||
             dit_gpu_zero_grad(&gpu, err) || dit_gpu_backward(&gpu, B, err);
        if (rc == 0 && sharded) {
            rc = zero_step_queue(comm, &gpu, run->bucket_floats, 1.0f / WORLD, 1.0f / WORLD, 1e-3f, 0.9f, 0.999f, 1e-8f, WEIGHT_DECAY,
                                 NO_CLIP, 0.99f, k + 1, err);
        } else if (rc == 0) {
            float *buffers[2] = {gpu.grads_memory, gpu.acts.loss};
            size_t counts[2] = {n, 1};
            float scales[2] = {1.0f / WORLD, 1.0f / WORLD};
            rc = dist_all_reduce_scaled(comm, buffers, counts, scales, 2, gpu.stream, err) ||
                 dit_gpu_grad_sumsq(&gpu, err) ||
                 dit_gpu_update(&gpu, 1e-3f, 0.9f, 0.999f, 1e-8f, WEIGHT_DECAY, NO_CLIP, 0.99f, k + 1, err);
        }
        rc = rc || dit_gpu_read_scalars(&gpu, &loss[k], &norm[k], err);
    }
    if (rc == 0 && sharded) {
        rc = dit_gpu_download(&gpu, &cpu, err) || write_result(dir, rank, kind, Z_STALE, cpu.params_memory, n) ||
             zero_gather_state(comm, &gpu, 1, err) || dit_gpu_download(&gpu, &cpu, err) ||
             write_result(dir, rank, kind, Z_EMA_ONLY, cpu.ema_memory, n) || zero_gather_state(comm, &gpu, 0, err);
    }
    rc = rc || dit_gpu_download(&gpu, &cpu, err);
    if (rc == 0 && cudaMemcpy(w, gpu.params_bf16_memory, n * sizeof(bf16), cudaMemcpyDeviceToHost) != cudaSuccess) {
        dit_set_error(err, "download of the bf16 weights");
        rc = -1;
    }
    for (size_t i = 0; rc == 0 && i < n; i++) x[i] = float_from_bf16_bits(w[i].bits);
    const float *state[4] = {cpu.params_memory, cpu.ema_memory, cpu.adam_m_memory, cpu.adam_v_memory};
    for (int i = 0; rc == 0 && i < 4; i++) rc = write_result(dir, rank, kind, i, state[i], n);
    rc = rc || write_result(dir, rank, kind, Z_WEIGHTS, x, n) ||
         write_result(dir, rank, kind, Z_LOSS, loss, ZERO_STEPS) || write_result(dir, rank, kind, Z_NORM, norm, ZERO_STEPS);
    dit_gpu_free(&gpu);
    dit_free(&cpu);
    free(x);
    free(w);
    return rc ? -1 : 0;
}

static void zero_rank(int rank, const char *dir) {
    char err[DIT_ERR_LEN], run_id[64];
    snprintf(run_id, sizeof(run_id), "zero-%d", (int)getppid());
    DistEnv env = rank_env(rank, run_id);
    DistComm *comm;
    sage_backward_set_deterministic(1);
    int rc = dist_comm_create(&comm, &env, dir, 60.0, err);
    for (int i = 0; rc == 0 && i < N_ZERO_RUNS; i++) rc = zero_or_replicated(comm, rank, &zero_runs[i], dir, err);
    if (rc != 0) {
        fprintf(stderr, "rank %d: %s\n", rank, err);
        _exit(1);
    }
    dist_comm_destroy(comm);
    _exit(0);
}

// The overlapped reduction cuts a range at the shard boundary and sends each piece to its owner:
// with the test model, block 1's qkv weight straddles the boundary (so a planted off-by-one there
// changes a sum), and the blocks' ranges lie on both sides of it (both ranks are roots).
static void cut_ranges_are_exercised(void) {
    char err[DIT_ERR_LEN];
    DitGpu gpu;
    DitGpuSeqParallel par = {.ulysses = 1, .ring = 1, .optimizer_shards = WORLD, .optimizer_rank = 0,
                             .zero_overlap = 1};
    cr_assert_eq(dit_gpu_create_sp(&gpu, &config, 1, DIT_ATTN_SAGE, DIT_LINEAR_BF16, &par, err), 0, "%s", err);
    size_t S = gpu.shard_size, offsets[DIT_BLOCK_GRAD_RANGES], numels[DIT_BLOCK_GRAD_RANGES];
    int straddles = 0, below = 0, above = 0;
    for (int l = 0; l < config.depth; l++) {
        dit_gpu_block_grad_ranges(&gpu, l, 1, offsets, numels);
        for (int k = 0; k < DIT_BLOCK_GRAD_RANGES; k++) {
            straddles += offsets[k] < S && S < offsets[k] + numels[k];
            below += offsets[k] < S;
            above += offsets[k] + numels[k] > S;
        }
    }
    fprintf(stderr, "shard size %zu: %d block ranges straddle the boundary, %d start below it, %d end above it\n", S,
            straddles, below, above);
    cr_expect(straddles > 0 && below > 0 && above > 0, "the test model does not exercise the cut at the shard boundary");
    dit_gpu_free(&gpu);
}

static size_t count_differing(const float *a, const float *b, size_t n) {
    size_t d = 0;
    for (size_t i = 0; i < n; i++) d += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return d;
}

static float *read_result(const char *dir, int rank, const char *kind, int what, size_t n) {
    char path[512];
    snprintf(path, sizeof(path), "%s/rank%d_%s_%s", dir, rank, kind, zero_names[what]);
    return read_floats(path, n);
}

Test(zero1, sharded_update_equals_the_replicated_one_bitwise, .timeout = 300) {
    REQUIRE_2_GPUS();
    char dir[] = "/tmp/test_distributed_cuda_XXXXXX";
    cr_assert(mkdtemp(dir));
    run_ranks(zero_rank, dir);
    Dit cpu;
    char err[DIT_ERR_LEN];
    cr_assert_eq(dit_create(&cpu, &config, 1, DIT_ATTN_SAGE, 7, err), 0, "%s", err);
    size_t n = cpu.num_params;
    dit_free(&cpu);
    cut_ranges_are_exercised();
    // the two replicated runs: the adaLN gradients per block against one GEMM over the blocks
    // (information here; test_dit_gpu_cuda checks the gradients themselves)
    for (int r = 0; r < WORLD; r++) {
        float *a = read_result(dir, r, "replicated_overlap", Z_PARAMS, n), *b = read_result(dir, r, "replicated", Z_PARAMS, n);
        fprintf(stderr, "replicated_overlap vs replicated, rank %d, params: %zu of %zu elements differ\n", r,
                count_differing(a, b, n), n);
        free(a);
        free(b);
    }
    for (int z = 0; z < N_ZERO_RUNS; z++) {
        const char *zk = zero_runs[z].name, *rk = zero_runs[z].ref;
        if (!rk) continue;
        float *z0_params = read_result(dir, 0, zk, Z_PARAMS, n);
        for (int r = 0; r < WORLD; r++) {
            for (int i = Z_PARAMS; i <= Z_WEIGHTS; i++) {
                float *zv = read_result(dir, r, zk, i, n), *ref = read_result(dir, r, rk, i, n);
                size_t d = count_differing(zv, ref, n);
                fprintf(stderr, "%s vs %s, rank %d, %s: %zu of %zu elements differ\n", zk, rk, r, zero_names[i], d,
                        n);
                cr_expect_eq(d, 0, "%s, rank %d, %s: %zu of %zu elements differ from %s", zk, r, zero_names[i], d,
                             n, rk);
                if (i == Z_PARAMS)
                    cr_expect_eq(count_differing(zv, z0_params, n), 0, "%s: rank %d's gathered weights differ from "
                                 "rank 0's", zk, r);
                free(zv);
                free(ref);
            }
            float *zl = read_result(dir, r, zk, Z_LOSS, ZERO_STEPS), *rl = read_result(dir, r, rk, Z_LOSS, ZERO_STEPS);
            float *zn = read_result(dir, r, zk, Z_NORM, ZERO_STEPS), *rn = read_result(dir, r, rk, Z_NORM, ZERO_STEPS);
            for (int k = 0; k < ZERO_STEPS; k++) {
                double e = fabs((double)zn[k] - rn[k]) / rn[k];
                fprintf(stderr, "%s, rank %d step %d: loss %.9g vs %.9g, norm %.9g vs %.9g (%.3g relative)\n", zk, r,
                        k + 1, zl[k], rl[k], zn[k], rn[k], e);
                cr_expect_eq(memcmp(&zl[k], &rl[k], sizeof(float)), 0, "%s, rank %d step %d: loss %.9g vs %.9g", zk, r,
                             k + 1, zl[k], rl[k]);
                cr_expect(e <= TOL_ZERO_NORM, "%s, rank %d step %d: norm %.9g vs %.9g (%.3g > %g)", zk, r, k + 1, zn[k],
                          rn[k], e, TOL_ZERO_NORM);
                cr_expect(rn[k] < NO_CLIP, "step %d: norm %g: clipping would act", k + 1, rn[k]);
            }
            free(zl); free(rl); free(zn); free(rn);
            float *ema_only = read_result(dir, r, zk, Z_EMA_ONLY, n), *ref = read_result(dir, r, rk, Z_EMA, n);
            size_t d = count_differing(ema_only, ref, n);
            cr_expect_eq(d, 0, "%s, rank %d: the EMA after the EMA-only gather differs in %zu elements", zk, r, d);
            free(ema_only);
            free(ref);
        }
        float *stale = read_result(dir, 0, zk, Z_STALE, n);
        size_t d = count_differing(stale, z0_params, n);
        fprintf(stderr, "negative control, %s: rank 0's fp32 weights before the gather: %zu of %zu elements stale\n",
                zk, d, n);
        cr_expect(d > n / 4, "%s: only %zu of %zu elements of rank 0's weights were stale before the gather: the "
                  "test cannot tell whether the gather works", zk, d, n);
        free(stale);
        free(z0_params);
    }
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    system(cmd);
}

// The model's check of the shard (no GPU needed: it comes before any allocation).
Test(zero1, an_optimizer_rank_outside_the_shards_is_an_error) {
    char err[DIT_ERR_LEN];
    DitGpu m;
    DitGpuSeqParallel outside = {.ulysses = 1, .ring = 1, .optimizer_shards = 2, .optimizer_rank = 2};
    cr_assert_eq(dit_gpu_create_sp(&m, &config, 1, DIT_ATTN_SAGE, DIT_LINEAR_BF16, &outside, err), -1);
    cr_assert(strstr(err, "optimizer_rank 2 outside the 2 optimizer shards"), "%s", err);
    DitGpuSeqParallel unsharded = {.ulysses = 1, .ring = 1, .optimizer_rank = 1};
    cr_assert_eq(dit_gpu_create_sp(&m, &config, 1, DIT_ATTN_SAGE, DIT_LINEAR_BF16, &unsharded, err), -1);
    cr_assert(strstr(err, "optimizer_rank 1 outside the 1 optimizer shards"), "%s", err);
}

#endif
