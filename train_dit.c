// train_dit: trains a DiT (adaLN-Zero) with the flow-matching objective on an image folder.
// Read main() from top to bottom: one training step is
//   batch -> drop labels -> sample t and noise -> x_t -> forward -> MSE on the velocity ->
//   backward -> clip by global norm -> AdamW -> EMA -> log.
// The model runs on the CPU (model/dit.h, fp32) or the GPU (model/dit_gpu.h, bf16 compute with
// fp32 master weights) behind the same step functions (queue_step, wait_step, ...); the
// host does the rest (data, RNG, logging, checkpoints) the same way for both.
// Data parallel on several GPUs (--gpus N, mpirun, srun; model/distributed.h): every rank runs
// the same step on its own share of the batch; after the backward the ranks sum their gradients
// with ZeRO-1 (model/zero.h): each gets the sums of its slice of the parameters, updates that
// slice (AdamW, EMA) and the bf16 weights are all-gathered, so every rank has the same model.
// Rank 0 logs and writes checkpoints and samples.
// Sequence parallelism (--sp-ulysses U --sp-ring R): groups of U·R ranks share each image, every
// rank of a group holding T/(U·R) of its tokens (model/dit_gpu.h); the group reads one data
// stream (its data-parallel rank's) and data parallel runs over the world / (U·R) groups.
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "dataloader/dataloader.h"
#include "dataloader/image_grid.h"
#include "layers/common.h"
#include "layers/layers.h"
#include "model/checkpoint.h"
#include "model/distributed.h"
#include "model/dit.h"
#include "model/safetensors.h"
#include "model/sample.h"
#ifdef DIT_CUDA
#include <cuda_runtime_api.h>
#include "attention/flash_cuda.h"
#include "attention/sage_cuda.h"
#include "model/dit_gpu.h"
#include "model/zero.h"
#endif

#define DEFAULT_DATA "data/fashion-mnist"

typedef struct {
    const char *model, *data, *out, *resume, *device, *attn, *linear, *t_sampling, *dump_parity;
    int depth, hidden, heads, patch, image_size, channels;   // 0: the preset's value
    int steps, batch, warmup, ckpt_every, sample_every, sample_steps, samples_per_class;
    int skip_bad_images, preview_data, random_flip, save_init, deterministic;
    int sage_rotate;                                          // Hadamard rotation of q, k (--attn sage)
    int fp8_grad_headroom;                                    // --linear fp8: DitGpu.fp8_grad_headroom
    int fp8_fast_accum;                                       // --linear fp8: DitGpu.ctx.fp8_accumulation
                                                              // (an Fp8Accumulation: fp8_fast_accum_names)
    int gpus;                                                 // 0: not given
    int sp_ulysses, sp_ring;                                  // sequence parallelism (1: off)
    int sp_head_groups;                                       // Ulysses' attention pipeline (0: default)
    int cuda_graph;                                           // --cuda-graph: 1 on, 0 off, -1 not given
    int zero_overlap;                                         // --zero-overlap: 1 on, 0 off, -1 auto
    int gemm_tuning;                                          // --gemm-tuning: 1 on, 0 off, -1 not given
    float lr, weight_decay, grad_clip, ema_decay, label_dropout, cfg_scale, dist_timeout;
    uint64_t seed;
} TrainArgs;

// --fp8-fast-accum's words, indexed by Fp8Accumulation (layers/layers_cuda.h)
static const char *const fp8_fast_accum_names[3] = {"none", "forward", "all"};
#ifdef DIT_CUDA
_Static_assert(FP8_ACCUM_PROMOTED == 0 && FP8_ACCUM_FAST_FORWARD == 1 && FP8_ACCUM_FAST_ALL == 2,
               "fp8_fast_accum_names is indexed by Fp8Accumulation");
#endif

static const char *usage_text =
    "usage: ./train_dit [flags]\n"
    "model:\n"
    "  --model NAME          preset tiny | S | B | L | XL (default tiny)\n"
    "  --depth N --hidden N --heads N --patch N --image-size N --channels N   override the preset\n"
    "  --attn KIND           CPU: exact (fp32) | sage | sage-fp16 (the bit-defined quantized attention,\n"
    "                        FP8 or FP16 P·V); GPU: sage | sage-fp16 | bf16 (exact attention in bf16,\n"
    "                        FlashAttention) (default: sage on the GPU, exact on the CPU; sage-fp16 is\n"
    "                        more accurate, a little slower; on Hopper both run wgmma kernels)\n"
    "  --sage-rotate 0|1     sage: multiply q and k by a Hadamard matrix before quantizing (exact\n"
    "                        attention unchanged; outlier channels cost far less INT8 precision) (default 1)\n"
    "  --linear KIND         GPU: the blocks' qkv, proj, fc1, fc2 GEMMs in bf16 | fp8 (e4m3, per-tensor\n"
    "                        scales from the current amax; sm_89+) (default bf16)\n"
    "  --fp8-grad-headroom N fp8: the douts of fc1, fc2, proj quantized by the passes computing them, their\n"
    "                        scale guessed from the last step's amax and kept while within 2N binades\n"
    "                        above the current one's (0: exactly the current amax's scale, as -1;\n"
    "                        -1: quantized by the linears from stored bf16 douts) (default 3)\n"
    "  --fp8-fast-accum WHICH fp8: the GEMMs that accumulate in the tensor cores' fast mode rather than\n"
    "                        promoting to fp32: none | forward (as Transformer Engine and torchao) | all\n"
    "                        (the backward's too: 0.7-1.2 ms a step faster at 16K tokens) (default forward)\n"
    "  --device KIND         auto (the GPU if one is found) | cpu | gpu (default auto)\n"
    "data:\n"
    "  --data DIR            image folder DIR/<class>/*.png|jpg|..., or 'synthetic'\n"
    "                        (default " DEFAULT_DATA ", made by `make data`)\n"
    "  --skip-bad-images     log and skip unreadable images instead of stopping\n"
    "  --no-flip             no random horizontal flips\n"
    "  --preview-data        write OUT/data_preview.png (real training samples) and exit\n"
    "training:\n"
    "  --steps N             optimizer steps in total (default 2000)\n"
    "  --batch N             images per step (default 32)\n"
    "  --lr X                AdamW learning rate (default 3e-4), --warmup N linear warmup steps (default 100)\n"
    "  --weight-decay X      on weight matrices (default 0)\n"
    "  --grad-clip X         clip the global gradient norm (default 1; 0 = off)\n"
    "  --ema-decay X         EMA of the weights, used for sampling (default 0.999; warmup:\n"
    "                        min(X, (1 + step)/(10 + step)))\n"
    "  --label-dropout X     probability of the null label, for guidance (default 0.1)\n"
    "  --t-sampling KIND     logit-normal (t = sigmoid(N(0,1)), as SD3) | uniform (default logit-normal)\n"
    "  --seed N              seeds init, data order, noise (default 42)\n"
    "output:\n"
    "  --out DIR             train_log.csv, checkpoints, samples (default out)\n"
    "  --ckpt-every N        write OUT/ckpt_<step>.safetensors every N steps and at the end (default 500)\n"
    "  --save-init           also write OUT/ckpt_000000.safetensors, the initial weights, before step 1\n"
    "                        (dev/loss_curves.py starts PyTorch from it; --resume from it replays the run)\n"
    "  --resume FILE         continue bit-identically from a checkpoint (GPU: above 256 tokens only\n"
    "                        with --deterministic)\n"
    "  --deterministic       GPU: the attention backwards add dq in a fixed order, so runs and resumes\n"
    "                        are bitwise reproducible at any length (costs ~13% of the attention\n"
    "                        backward at 16K tokens; the CPU is always deterministic)\n"
    "  --cuda-graph on|off   GPU, one process: run the step's GPU work (forward, loss, backward, norm,\n"
    "                        AdamW, EMA) as one CUDA graph, captured at the second step and replayed\n"
    "                        (bitwise the same results, fewer launch gaps) (default on; several GPUs\n"
    "                        and --dump-parity run the step call by call: on is an error there, and\n"
    "                        with --device cpu)\n"
    "  --gemm-tuning on|off  GPU: each GEMM shape's algorithm the fastest of cuBLASLt's candidates, timed\n"
    "                        in the first step, rather than its heuristic's first answer (the picks\n"
    "                        depend on timings, so runs differ in the last bits) (default on; off\n"
    "                        with --deterministic, where on is an error, and with --device cpu)\n"
    "  --sample-every N      write OUT/samples_<step>.png every N steps and at the end (default 500)\n"
    "  --sample-steps N      Euler steps (default 25), --cfg-scale X guidance (default 2)\n"
    "  --samples-per-class N tiles per class in the grid (default 2)\n"
    "  --dump-parity FILE    write weights, batches, step-1 output and gradients and every loss,\n"
    "                        for dev/parity.py\n"
    "several GPUs (data parallel over NCCL):\n"
    "  --gpus N              start N processes, one per GPU of this machine (or launch one process per\n"
    "                        GPU with mpirun -np N / srun -n N, without --gpus); --batch is the global\n"
    "                        batch, split evenly; rank r reads its own data stream (seed mixed with r)\n"
    "  --sp-ulysses U        sequence parallelism: U consecutive GPUs share each image, attention by\n"
    "                        all-to-all over heads (heads % U == 0); default 1\n"
    "  --sp-head-groups G    Ulysses without ring: each block's attention in G groups of heads, one\n"
    "                        group's all-to-all beside another's attention (default 4; 1 to 16)\n"
    "  --sp-ring R           ... and R groups of them ring attention (tokens % (U·R) == 0; sage: T/R a\n"
    "                        multiple of 64); data parallel over the N / (U·R) groups; default 1\n"
    "  --zero-overlap auto|on|off  ZeRO-1's reduction of the gradients behind the backward: each\n"
    "                        bucket of blocks (>= 32 MB, adaLN included) reduced to its owners as soon as\n"
    "                        its backward is done, on a stream of its own; off: one reduce-scatter after\n"
    "                        the backward; auto (default): on when the gradients reach 256 MB (small,\n"
    "                        host-bound steps lose to the extra NCCL groups); one GPU: on is an error\n"
    "  --dist-timeout S      a rank that waits longer for the others (start, all-reduce) aborts with\n"
    "                        an error naming it (default 600; covers rank 0's sampling and checkpoints)\n";

// ---- command line ------------------------------------------------------------------------

static int parse_int(const char *flag, const char *text, int lo, int *out, char *err) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > 1 << 30) {
        dit_set_error(err, "%s: expected an integer >= %d, got '%s'", flag, lo, text);
        return -1;
    }
    *out = (int)v;
    return 0;
}

// "on" -> 1, "off" -> 0, anything else an error naming the flag.
static int parse_on_off(const char *flag, const char *text, int *out, char *err) {
    if (strcmp(text, "on") && strcmp(text, "off")) {
        dit_set_error(err, "%s: expected on or off, got '%s'", flag, text);
        return -1;
    }
    *out = !strcmp(text, "on");
    return 0;
}

static int parse_float(const char *flag, const char *text, float lo, float hi, float *out, char *err) {
    char *end;
    errno = 0;
    float v = strtof(text, &end);
    if (errno || end == text || *end || !(v >= lo && v <= hi)) {
        dit_set_error(err, "%s: expected a number in [%g, %g], got '%s'", flag, lo, hi, text);
        return -1;
    }
    *out = v;
    return 0;
}

// CUDA GPUs present: -1 when the build has no CUDA.
static int gpu_count(void) {
#ifdef DIT_CUDA
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
#else
    return -1;
#endif
}

static int parse_args(int argc, char **argv, TrainArgs *a, char *err) {
    *a = (TrainArgs){.model = "tiny", .data = DEFAULT_DATA, .out = "out", .device = "auto",
                     .attn = NULL, .linear = "bf16", .t_sampling = "logit-normal", .steps = 2000, .batch = 32,
                     .warmup = 100, .ckpt_every = 500, .sample_every = 500, .sample_steps = 25,
                     .samples_per_class = 2, .random_flip = 1, .lr = 3e-4f, .grad_clip = 1.0f,
                     .ema_decay = 0.999f, .label_dropout = 0.1f, .cfg_scale = 2.0f, .seed = 42,
                     .dist_timeout = 600.0f, .sp_ulysses = 1, .sp_ring = 1, .sage_rotate = 1, .cuda_graph = -1,
                     .zero_overlap = -1, .fp8_grad_headroom = 3,
                     .fp8_fast_accum = 1, .gemm_tuning = -1};
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i];
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) { fputs(usage_text, stdout); exit(0); }
        if (!strcmp(f, "--skip-bad-images")) { a->skip_bad_images = 1; continue; }
        if (!strcmp(f, "--preview-data")) { a->preview_data = 1; continue; }
        if (!strcmp(f, "--no-flip")) { a->random_flip = 0; continue; }
        if (!strcmp(f, "--save-init")) { a->save_init = 1; continue; }
        if (!strcmp(f, "--deterministic")) { a->deterministic = 1; continue; }
        if (strncmp(f, "--", 2) != 0 || i + 1 >= argc) {
            dit_set_error(err, "%s: %s (see --help)", f,
                          strncmp(f, "--", 2) ? "unexpected argument" : "missing value or unknown flag");
            return -1;
        }
        const char *v = argv[++i];
        int rc = 0, seed;
        if (!strcmp(f, "--model")) a->model = v;
        else if (!strcmp(f, "--data")) a->data = v;
        else if (!strcmp(f, "--out")) a->out = v;
        else if (!strcmp(f, "--resume")) a->resume = v;
        else if (!strcmp(f, "--device")) a->device = v;
        else if (!strcmp(f, "--attn")) a->attn = v;
        else if (!strcmp(f, "--linear")) a->linear = v;
        else if (!strcmp(f, "--t-sampling")) a->t_sampling = v;
        else if (!strcmp(f, "--dump-parity")) a->dump_parity = v;
        else if (!strcmp(f, "--sage-rotate")) {
            rc = parse_int(f, v, 0, &a->sage_rotate, err);
            if (!rc && a->sage_rotate > 1) {
                dit_set_error(err, "--sage-rotate: expected 0 or 1, got '%s'", v);
                rc = -1;
            }
        }
        else if (!strcmp(f, "--cuda-graph")) rc = parse_on_off(f, v, &a->cuda_graph, err);
        else if (!strcmp(f, "--zero-overlap")) {
            a->zero_overlap = !strcmp(v, "on") ? 1 : !strcmp(v, "off") ? 0 : -1;
            if (a->zero_overlap < 0 && strcmp(v, "auto")) {
                dit_set_error(err, "--zero-overlap: expected auto, on or off, got '%s'", v);
                rc = -1;
            }
        }
        else if (!strcmp(f, "--fp8-grad-headroom")) {
            rc = parse_int(f, v, -1, &a->fp8_grad_headroom, err);
            if (!rc && a->fp8_grad_headroom > 8) {
                dit_set_error(err, "--fp8-grad-headroom: expected -1 to 8 (binades), got '%s'", v);
                rc = -1;
            }
        }
        else if (!strcmp(f, "--fp8-fast-accum")) {
            a->fp8_fast_accum = -1;
            for (int k = 0; k < 3; k++)
                if (!strcmp(v, fp8_fast_accum_names[k])) a->fp8_fast_accum = k;
            if (a->fp8_fast_accum < 0) {
                dit_set_error(err, "--fp8-fast-accum: expected none, forward or all, got '%s'", v);
                rc = -1;
            }
        }
        else if (!strcmp(f, "--gemm-tuning")) rc = parse_on_off(f, v, &a->gemm_tuning, err);
        else if (!strcmp(f, "--depth")) rc = parse_int(f, v, 1, &a->depth, err);
        else if (!strcmp(f, "--hidden")) rc = parse_int(f, v, 4, &a->hidden, err);
        else if (!strcmp(f, "--heads")) rc = parse_int(f, v, 1, &a->heads, err);
        else if (!strcmp(f, "--patch")) rc = parse_int(f, v, 1, &a->patch, err);
        else if (!strcmp(f, "--image-size")) rc = parse_int(f, v, 1, &a->image_size, err);
        else if (!strcmp(f, "--channels")) rc = parse_int(f, v, 1, &a->channels, err);
        else if (!strcmp(f, "--steps")) rc = parse_int(f, v, 1, &a->steps, err);
        else if (!strcmp(f, "--batch")) rc = parse_int(f, v, 1, &a->batch, err);
        else if (!strcmp(f, "--gpus")) rc = parse_int(f, v, 1, &a->gpus, err);
        else if (!strcmp(f, "--sp-ulysses")) rc = parse_int(f, v, 1, &a->sp_ulysses, err);
        else if (!strcmp(f, "--sp-ring")) rc = parse_int(f, v, 1, &a->sp_ring, err);
        else if (!strcmp(f, "--sp-head-groups")) rc = parse_int(f, v, 1, &a->sp_head_groups, err);
        else if (!strcmp(f, "--dist-timeout")) rc = parse_float(f, v, 1.0f, 1e6f, &a->dist_timeout, err);
        else if (!strcmp(f, "--warmup")) rc = parse_int(f, v, 0, &a->warmup, err);
        else if (!strcmp(f, "--ckpt-every")) rc = parse_int(f, v, 0, &a->ckpt_every, err);
        else if (!strcmp(f, "--sample-every")) rc = parse_int(f, v, 0, &a->sample_every, err);
        else if (!strcmp(f, "--sample-steps")) rc = parse_int(f, v, 1, &a->sample_steps, err);
        else if (!strcmp(f, "--samples-per-class")) rc = parse_int(f, v, 0, &a->samples_per_class, err);
        else if (!strcmp(f, "--seed")) { rc = parse_int(f, v, 0, &seed, err); a->seed = (uint64_t)seed; }
        else if (!strcmp(f, "--lr")) rc = parse_float(f, v, 0.0f, 1.0f, &a->lr, err);
        else if (!strcmp(f, "--weight-decay")) rc = parse_float(f, v, 0.0f, 1.0f, &a->weight_decay, err);
        else if (!strcmp(f, "--grad-clip")) rc = parse_float(f, v, 0.0f, 1e9f, &a->grad_clip, err);
        else if (!strcmp(f, "--ema-decay")) rc = parse_float(f, v, 0.0f, 1.0f, &a->ema_decay, err);
        else if (!strcmp(f, "--label-dropout")) rc = parse_float(f, v, 0.0f, 1.0f, &a->label_dropout, err);
        else if (!strcmp(f, "--cfg-scale")) rc = parse_float(f, v, 0.0f, 100.0f, &a->cfg_scale, err);
        else { dit_set_error(err, "%s: unknown flag (see --help)", f); return -1; }
        if (rc) return -1;
    }
    if (strcmp(a->device, "auto") && strcmp(a->device, "cpu") && strcmp(a->device, "gpu")) {
        dit_set_error(err, "--device: expected auto, cpu or gpu, got '%s'", a->device);
        return -1;
    }
    if (!strcmp(a->device, "auto")) a->device = gpu_count() > 0 ? "gpu" : "cpu";
    if (!strcmp(a->device, "gpu") && gpu_count() == 0) {
        dit_set_error(err, "--device gpu: %s", gpu_count() < 0 ? "this build has no CUDA (nvcc was not found)"
                                                               : "no CUDA GPU found");
        return -1;
    }
    int on_gpu = !strcmp(a->device, "gpu");
    if (!a->attn) a->attn = on_gpu ? "sage" : "exact";
    if (strcmp(a->attn, on_gpu ? "bf16" : "exact") && strcmp(a->attn, "sage") && strcmp(a->attn, "sage-fp16")) {
        dit_set_error(err, "--attn: expected %s on the %s, got '%s'",
                      on_gpu ? "sage, sage-fp16 or bf16" : "exact, sage or sage-fp16", a->device, a->attn);
        return -1;
    }
    if (strcmp(a->linear, "bf16") && strcmp(a->linear, "fp8")) {
        dit_set_error(err, "--linear: expected bf16 or fp8, got '%s'", a->linear);
        return -1;
    }
    if (!strcmp(a->linear, "fp8") && !on_gpu) {
        dit_set_error(err, "--linear fp8: the FP8 linears run on the GPU only (device is %s)", a->device);
        return -1;
    }
    if (a->gemm_tuning < 0) a->gemm_tuning = on_gpu && !a->deterministic;
    if (a->gemm_tuning && (!on_gpu || a->deterministic)) {
        dit_set_error(err, "--gemm-tuning on: %s", on_gpu ? "its picks depend on timings, which --deterministic "
                      "runs must not (leave one of the two out)" : "the CPU has no cuBLASLt (--device cpu)");
        return -1;
    }
    if (a->cuda_graph == 1 && (!on_gpu || a->dump_parity)) {
        dit_set_error(err, "--cuda-graph on: %s (leave the flag out or pass off)",
                      on_gpu ? "--dump-parity runs the step call by call" : "the CPU has no CUDA graphs (--device cpu)");
        return -1;
    }
    if (strcmp(a->t_sampling, "logit-normal") && strcmp(a->t_sampling, "uniform")) {
        dit_set_error(err, "--t-sampling: expected logit-normal or uniform, got '%s'", a->t_sampling);
        return -1;
    }
    return 0;
}

static char die_prefix[32] = "";   // "rank R: " when several ranks train

static void die(const char *msg) {
    fprintf(stderr, "train_dit: %serror: %s\n", die_prefix, msg);
    exit(1);
}

// Several ranks: --gpus against the launcher's environment, the sequence-parallel mesh, and what
// data parallel supports. One rank without sequence parallelism: nothing to check.
static int check_distributed_args(const TrainArgs *a, const DistEnv *env, char *err) {
    if (a->gpus > 1 && env->world_size > 1 && a->gpus != env->world_size) {
        dit_set_error(err, "--gpus %d, but %s started %d ranks (under mpirun or srun, leave --gpus out)", a->gpus,
                      env->launcher, env->world_size);
        return -1;
    }
    int world = env->world_size > 1 ? env->world_size : a->gpus > 1 ? a->gpus : 1;
    DistMesh mesh;
    if (dist_mesh_make(&mesh, world, 0, a->sp_ulysses, a->sp_ring, err) != 0) return -1;
    if (world == 1 && a->zero_overlap == 1) {
        dit_set_error(err, "--zero-overlap on: several GPUs only (one process has no reduction over ranks to overlap; "
                           "leave the flag out or pass off)");
        return -1;
    }
    if (world == 1) return 0;
#ifndef DIT_NCCL
    dit_set_error(err, "%d ranks: this build has no NCCL (the Makefile found no nccl.h)", world);
    return -1;
#endif
    if (strcmp(a->device, "gpu")) {
        dit_set_error(err, "%d ranks need --device gpu (the CPU trains in one process)", world);
        return -1;
    }
    if (a->batch % mesh.dp) {
        dit_set_error(err, "--batch %d: the global batch must split evenly over %d data-parallel groups (%d ranks / "
                           "U·R = %d)", a->batch, mesh.dp, world, mesh.sp);
        return -1;
    }
    if (a->cuda_graph == 1) {
        dit_set_error(err, "--cuda-graph on: one GPU only; %d ranks run the step call by call (leave the flag out "
                           "or pass off)", world);
        return -1;
    }
    if (a->dump_parity || a->preview_data) {
        dit_set_error(err, "%s works in one process only (not with %d ranks)",
                      a->dump_parity ? "--dump-parity" : "--preview-data", world);
        return -1;
    }
    if (a->gpus > 1 && env->world_size == 1 && gpu_count() < a->gpus) {
        dit_set_error(err, "--gpus %d: only %d GPUs found", a->gpus, gpu_count());
        return -1;
    }
    return 0;
}

// --gpus N: this process starts the N ranks (this program again, with DIT_RANK, DIT_WORLD_SIZE,
// DIT_LOCAL_RANK and a fresh DIT_RUN_ID set) and waits for them; the first rank that fails stops
// the others (model/distributed.h).
static void launch_local_ranks(const TrainArgs *a, char **argv) {
    char err[DIT_ERR_LEN], run_id[64];
    snprintf(run_id, sizeof(run_id), "gpus-%d-%lld", (int)getpid(), (long long)time(NULL));
    printf("train_dit: starting %d ranks, one per GPU (run %s)\n", a->gpus, run_id);
    fflush(stdout);
    if (dist_launch_local(a->gpus, "/proc/self/exe", argv, run_id, 10.0, err) != 0) die(err);
}

// mkdir -p: creates the directory and its missing parents.
static int make_dirs(const char *path) {
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    return mkdir(buf, 0755) != 0 && errno != EEXIST ? -1 : 0;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// ---- the model on its device: the same step functions for the CPU and the GPU ------------

// On the CPU, `cpu` is the model. On the GPU, `cpu` (created for batch 1) is the host copy of the
// weights, EMA and AdamW moments: initialization and checkpoints happen there and are uploaded.
// Data parallel (world > 1, GPU only): `dist` is the communicator of the ranks, `rank` this one.
// cuda_graph: one GPU, the step's GPU work replayed as one CUDA graph (dit_gpu_train_step_graph).
// zero_overlap: several GPUs, ZeRO-1's reduction behind the backward (--zero-overlap, resolved).
typedef struct {
    int on_gpu, cuda_graph, zero_overlap;
    int rank, world;
    DistMesh mesh;                  // data parallel × sequence parallel (all 1 for one process)
    Dit cpu;
    float *x_t, *v_target, *dout;   // CPU: the batch's model input, target, dLoss/dout
#ifdef DIT_CUDA
    DitGpu gpu;
    DistComm *dist;                 // NULL for one process
#endif
} Trainer;

// `batch`: images per step of this rank (the global batch / data-parallel groups). Initial
// weights come from a->seed on every rank, so all ranks start equal. With sequence parallelism
// the communicator is split into the mesh's groups here.
static void trainer_create(Trainer *tr, const DitConfig *cfg, const TrainArgs *a, int batch, const DistMesh *mesh,
                           void *dist, char *err) {
    memset(tr, 0, sizeof(*tr));
    tr->on_gpu = !strcmp(a->device, "gpu");
    tr->cuda_graph = a->cuda_graph == 1 || (a->cuda_graph < 0 && tr->on_gpu && mesh->world == 1 && !a->dump_parity);
    tr->rank = mesh->rank;
    tr->world = mesh->world;
    tr->mesh = *mesh;
    // exact attention: fp32 on the CPU, bf16 flash attention on the GPU (--attn bf16)
    DitAttention attention = !strcmp(a->attn, "sage") ? DIT_ATTN_SAGE
                           : !strcmp(a->attn, "sage-fp16") ? DIT_ATTN_SAGE_FP16 : DIT_ATTN_EXACT;
    if (dit_create(&tr->cpu, cfg, tr->on_gpu ? 1 : batch, attention, a->seed, err) != 0) die(err);
    tr->cpu.sage.rotate = a->sage_rotate;
#ifdef DIT_CUDA
    tr->dist = dist;
    if (tr->on_gpu) {
        // --zero-overlap auto: on from ZERO_OVERLAP_MIN_FLOATS gradients (model/zero.h)
        tr->zero_overlap = mesh->world > 1 && (a->zero_overlap == 1 ||
                                               (a->zero_overlap < 0 && dit_num_params(cfg) >= ZERO_OVERLAP_MIN_FLOATS));
        DitGpuSeqParallel sp = {.ulysses = mesh->ulysses, .ring = mesh->ring, .ulysses_rank = mesh->ulysses_rank,
                                .ring_rank = mesh->ring_rank, .head_groups = a->sp_head_groups,
                                .optimizer_shards = mesh->world, .optimizer_rank = mesh->rank,
                                .zero_overlap = tr->zero_overlap};
        if (mesh->sp > 1 && dist_comm_split_mesh(tr->dist, mesh, &sp.sp_comm, &sp.ulysses_comm, &sp.ring_comm, err))
            die(err);
        DitLinear linear = !strcmp(a->linear, "fp8") ? DIT_LINEAR_FP8 : DIT_LINEAR_BF16;
        if (dit_gpu_create_sp(&tr->gpu, cfg, batch, attention, linear, &sp, err) != 0) die(err);
        tr->gpu.sage.rotate = a->sage_rotate;
        tr->gpu.fp8_grad_headroom = a->fp8_grad_headroom;
        tr->gpu.ctx.fp8_accumulation = (Fp8Accumulation)a->fp8_fast_accum;
        if (layers_cuda_set_gemm_tuning(&tr->gpu.ctx, a->gemm_tuning, err)) die(err);
        sage_backward_set_deterministic(a->deterministic);   // process-wide switches of the kernels
        flash_backward_set_deterministic(a->deterministic);
        return;
    }
#else
    (void)dist;
#endif
    size_t n = (size_t)batch * cfg->channels * cfg->image_size * cfg->image_size;
    tr->x_t = malloc(n * sizeof(float));
    tr->v_target = malloc(n * sizeof(float));
    tr->dout = malloc(n * sizeof(float));
    if (!tr->x_t || !tr->v_target || !tr->dout) die("out of memory for the batch");
}

static void trainer_free(Trainer *tr) {
#ifdef DIT_CUDA
    if (tr->on_gpu) dit_gpu_free(&tr->gpu);
    dist_comm_destroy(tr->dist);
#endif
    dit_free(&tr->cpu);
    free(tr->x_t); free(tr->v_target); free(tr->dout);
}

// After initialization or a checkpoint load into tr->cpu: copy it to the device that trains.
static void trainer_to_device(Trainer *tr) {
#ifdef DIT_CUDA
    char err[DIT_ERR_LEN];
    if (tr->on_gpu && dit_gpu_upload(&tr->gpu, &tr->cpu, err) != 0) die(err);
#else
    (void)tr;
#endif
}

// Before a checkpoint: the weights, EMA and moments into tr->cpu (several ranks: after trainer_gather).
static void trainer_to_host(Trainer *tr) {
#ifdef DIT_CUDA
    char err[DIT_ERR_LEN];
    if (tr->on_gpu && dit_gpu_download(&tr->gpu, &tr->cpu, err) != 0) die(err);
#else
    (void)tr;
#endif
}

// Several ranks: every rank calls it before the fp32 weights, moments or EMA (ema_only) are read:
// ZeRO-1 keeps them current only on each rank's slice (model/zero.h).
static void trainer_gather(Trainer *tr, int ema_only) {
#ifdef DIT_CUDA
    char err[DIT_ERR_LEN];
    if (tr->on_gpu && zero_gather_state(tr->dist, &tr->gpu, ema_only, err) != 0) die(err);
#else
    (void)tr; (void)ema_only;
#endif
}

// One training step: its batch on the host (pinned for the GPU) and, once it is done, its loss
// and gradient norm. Two slots alternate, so the host fills one with the next batch while the
// GPU still runs the step of the other.
typedef struct {
    int step;
    float lr;
    double started;          // wall time when the host began the step's batch
    float *x0, *noise, *t;   // (B, C, S, S), (B, C, S, S), (B)
    int *labels;             // (B)
    float *scalars;          // [0] loss, [1] gradient norm (GPU: valid once `done` has completed)
#ifdef DIT_CUDA
    cudaEvent_t done;
#endif
} StepSlot;

// x_t = (1 - t)·x0 + t·ε, target v = ε - x0; forward; MSE loss; zero grads; backward; then clip
// by the global gradient norm, AdamW, EMA. On the GPU this queues the work and returns (wait_step
// waits); on the CPU it runs it. Several ranks (ZeRO-1, model/zero.h): the loss becomes the mean
// over the ranks (each rank's is the mean over its images, the same on every rank of a
// sequence-parallel group, so this is the global batch's); the gradients are summed over the
// ranks and scaled by 1/dp: the sum over a sequence-parallel group completes each image's
// gradient (every rank back-propagated its tokens' share of the global loss), the 1/dp averages
// the data-parallel groups' images (dp = world without sequence parallelism: the mean). With
// tr->cuda_graph the work from the forward to the EMA is one CUDA graph (the same kernels); the
// batch upload before it and the copies of the loss and norm after it are queued call by call.
static void queue_step(Trainer *tr, const TrainArgs *a, StepSlot *s) {
    const DitConfig *c = &tr->cpu.cfg;
    int B = a->batch / tr->mesh.dp;
    float ema_decay = ema_decay_warmup(a->ema_decay, s->step);
#ifdef DIT_CUDA
    if (tr->on_gpu) {
        char err[DIT_ERR_LEN];
        DitGpu *g = &tr->gpu;
        int rc = dit_gpu_set_flow_batch(g, s->x0, s->noise, s->t, s->labels, B, err);
        if (!rc && tr->cuda_graph)
            rc = dit_gpu_train_step_graph(g, B, s->lr, 0.9f, 0.999f, 1e-8f, a->weight_decay, a->grad_clip, ema_decay,
                                          s->step, err);
        else if (!rc)
            rc = dit_gpu_forward(g, &g->weights, B, err) || dit_gpu_loss(g, B, err) ||
                 dit_gpu_backward_fresh(g, B, err) ||
                 zero_step_queue(tr->dist, g, tr->zero_overlap ? ZERO_BUCKET_FLOATS : 0, 1.0f / tr->mesh.dp,
                                 1.0f / tr->mesh.world, s->lr, 0.9f, 0.999f, 1e-8f, a->weight_decay, a->grad_clip,
                                 ema_decay, s->step, err);
        if (rc || dit_gpu_queue_scalars(g, &s->scalars[0], &s->scalars[1], s->done, err)) die(err);
        return;
    }
#endif
    Dit *m = &tr->cpu;
    size_t img = (size_t)c->channels * c->image_size * c->image_size;
    flow_matching_inputs(tr->x_t, tr->v_target, s->x0, s->noise, s->t, B, (int)img);
    dit_forward(m, &m->params, tr->x_t, s->t, s->labels, B);
    s->scalars[0] = mse_loss_forward_backward(tr->dout, m->acts.out, tr->v_target, B * img);
    dit_zero_grad(m);
    dit_backward(m, tr->dout, s->labels, B);
    float grad_norm = s->scalars[1] = global_norm(m->grads_memory, m->num_params);
    dit_adamw_step(m, s->lr, 0.9f, 0.999f, 1e-8f, a->weight_decay, clip_grad_scale(grad_norm, a->grad_clip), s->step);
    ema_update(m->ema_memory, m->params_memory, m->num_params, ema_decay);
}

// Waits until the step queued in s is done (several ranks: polling for NCCL errors and the
// timeout, so a dead rank ends the run with a message instead of a hang).
static void wait_step(Trainer *tr, StepSlot *s) {
#ifdef DIT_CUDA
    char err[DIT_ERR_LEN];
    if (!tr->on_gpu) return;
    if (tr->dist) {
        char what[64];
        snprintf(what, sizeof(what), "training step %d", s->step);
        if (dist_wait_event(tr->dist, s->done, what, err) != 0) die(err);
    } else if (cudaEventSynchronize(s->done) != cudaSuccess) {
        dit_set_error(err, "training step %d: %s", s->step, cudaGetErrorString(cudaGetLastError()));
        die(err);
    }
#else
    (void)tr; (void)s;
#endif
}

// The last step's output (B, C, S, S) and parameter gradients, for --dump-parity.
static void trainer_read_output_grads(Trainer *tr, float *out, float *grads, int B) {
    const DitConfig *c = &tr->cpu.cfg;
    size_t img = (size_t)c->channels * c->image_size * c->image_size;
#ifdef DIT_CUDA
    char err[DIT_ERR_LEN];
    if (tr->on_gpu) {
        if (dit_gpu_download_output(&tr->gpu, out, B, err) || dit_gpu_download_grads(&tr->gpu, grads, err)) die(err);
        return;
    }
#endif
    memcpy(out, tr->cpu.acts.out, B * img * sizeof(float));
    memcpy(grads, tr->cpu.grads_memory, tr->cpu.num_params * sizeof(float));
}

// The host buffers of a batch: page-locked on the GPU, so the copies to the device run at full
// speed and asynchronously.
static void *batch_alloc(const Trainer *tr, size_t bytes) {
    void *p = NULL;
#ifdef DIT_CUDA
    if (tr->on_gpu) {
        if (cudaMallocHost(&p, bytes) != cudaSuccess) die("cudaMallocHost: out of pinned host memory for the batch");
        return p;
    }
#endif
    (void)tr;
    if (!(p = malloc(bytes))) die("out of memory for the batch");
    return p;
}

static void batch_free(const Trainer *tr, void *p) {
#ifdef DIT_CUDA
    if (tr->on_gpu) {
        cudaFreeHost(p);
        return;
    }
#endif
    (void)tr;
    free(p);
}

static void slot_alloc(const Trainer *tr, StepSlot *s, size_t n_batch, int B) {
    memset(s, 0, sizeof(*s));
    s->x0 = batch_alloc(tr, n_batch * sizeof(float));
    s->noise = batch_alloc(tr, n_batch * sizeof(float));
    s->t = batch_alloc(tr, B * sizeof(float));
    s->labels = batch_alloc(tr, B * sizeof(int));
    s->scalars = batch_alloc(tr, 2 * sizeof(float));
#ifdef DIT_CUDA
    if (tr->on_gpu && cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming) != cudaSuccess)
        die("cudaEventCreate: the training step's end event");
#endif
}

static void slot_free(const Trainer *tr, StepSlot *s) {
    batch_free(tr, s->x0); batch_free(tr, s->noise); batch_free(tr, s->t); batch_free(tr, s->labels);
    batch_free(tr, s->scalars);
#ifdef DIT_CUDA
    if (s->done) cudaEventDestroy(s->done);
#endif
}

// Euler sampling with guidance from the EMA weights (model/sample.h).
static void trainer_sample(Trainer *tr, float *x, const int *labels, int n, const TrainArgs *a) {
    char err[DIT_ERR_LEN];
#ifdef DIT_CUDA
    if (tr->on_gpu) {
        if (dit_gpu_sample(&tr->gpu, x, labels, n, a->sample_steps, a->cfg_scale, err) != 0) die(err);
        return;
    }
#endif
    if (dit_sample(&tr->cpu, &tr->cpu.ema, x, labels, n, a->sample_steps, a->cfg_scale, err) != 0) die(err);
}

// The GPU's additions to the log: the memory plan at startup; tokens/s, MFU (model FLOPs from
// dit_train_flops over the GPU's dense bf16 peak) and the device memory in use on each step line.
#ifdef DIT_CUDA
// Dense bf16 tensor-core peak in FLOP/s (0: unknown GPU). H100 and H200 (SXM): 989 TFLOP/s.
static double gpu_peak_flops(void) {
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return 0;
    if (strstr(prop.name, "H100") || strstr(prop.name, "H200")) return 989e12;
    if (strstr(prop.name, "A100")) return 312e12;
    return 0;
}

static double gpu_memory_used_mib(void) {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
    return (total_bytes - free_bytes) / 1048576.0;
}
#endif

static void print_memory_plan(Trainer *tr) {
#ifdef DIT_CUDA
    if (!tr->on_gpu) return;
    struct cudaDeviceProp prop;
    size_t params_bytes, acts_bytes, ctx_bytes;
    dit_gpu_memory_plan(&tr->gpu, &params_bytes, &acts_bytes, &ctx_bytes);
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) prop.name[0] = 0;
    char fp8[128] = "";   // the FP8 linears' workspace and kept copies are part of the activations' allocation
    if (tr->gpu.linear == DIT_LINEAR_FP8)
        snprintf(fp8, sizeof fp8, ", FP8 linear workspace (%.1f MiB) and saved fp8 copies (%.1f MiB)",
                 tr->gpu.fp8_workspace_bytes / 1048576.0, tr->gpu.fp8_saved_bytes / 1048576.0);
    printf("gpu %s | memory plan: parameters, gradients, AdamW, EMA (fp32) + bf16 copies %.1f MiB | "
           "activations, their gradients, attention workspaces%s (batch %d) %.1f MiB | cuBLASLt and "
           "reductions %.1f MiB | in use now %.1f MiB\n", prop.name, params_bytes / 1048576.0, fp8, tr->gpu.batch,
           acts_bytes / 1048576.0, ctx_bytes / 1048576.0, gpu_memory_used_mib());
#else
    (void)tr;
#endif
}

static void format_device_stats(Trainer *tr, int B, double ms, char *text, size_t cap) {
    text[0] = 0;
#ifdef DIT_CUDA
    static double peak_mib = 0;
    if (!tr->on_gpu) return;
    double used = gpu_memory_used_mib(), peak = gpu_peak_flops() * tr->world;   // B is the global batch
    peak_mib = used > peak_mib ? used : peak_mib;
    double tokens = (double)B * dit_tokens(&tr->cpu.cfg), flops = dit_train_flops(&tr->cpu.cfg, B);
    char mfu[32] = "n/a";
    if (peak > 0) snprintf(mfu, sizeof(mfu), "%.1f%%", 100.0 * flops / (ms / 1e3) / peak);
    snprintf(text, cap, " | %.0f tokens/s | MFU %s | %.0f MiB peak", tokens / (ms / 1e3), mfu, peak_mib);
#else
    (void)tr; (void)B; (void)ms; (void)cap;
#endif
}

// ---- pieces of the training step ---------------------------------------------------------

// Linear warmup, then constant (as DiT, which trains at a constant rate).
static float learning_rate(const TrainArgs *a, int step) {
    return step <= a->warmup ? a->lr * step / (a->warmup + 1) : a->lr;
}

// A grid of samples_per_class tiles per class from the EMA weights, with fixed noise so that
// grids at different steps are comparable.
static void write_samples(Trainer *tr, const TrainArgs *a, DataLoader *dl, int step) {
    const Dit *m = &tr->cpu;
    int nc = m->cfg.num_classes, n = nc * a->samples_per_class;
    if (n == 0) return;
    size_t img = (size_t)m->cfg.channels * m->cfg.image_size * m->cfg.image_size;
    float *x = malloc(n * img * sizeof(float));
    int *labels = malloc(n * sizeof(int));
    const char **captions = malloc(n * sizeof(char *));
    if (!x || !labels || !captions) die("out of memory for the sample grid");
    Rng rng;
    rng_seed(&rng, a->seed + 7);
    rng_fill_normal(&rng, x, n * img, 1.0f);
    for (int i = 0; i < n; i++) {
        labels[i] = i % nc;
        captions[i] = dataloader_class_name(dl, labels[i]);
    }
    char err[DIT_ERR_LEN], path[1024];
    trainer_sample(tr, x, labels, n, a);
    snprintf(path, sizeof(path), "%s/samples_%06d.png", a->out, step);
    if (tr->rank == 0 && write_image_grid_png(path, x, n, m->cfg.channels, m->cfg.image_size, nc, captions, err) != 0)
        die(err);
    if (tr->rank == 0) printf("wrote %s\n", path);
    free(x); free(labels); free(captions);
}

// Several ranks: every rank's data position and training RNG (label drop, t, noise), gathered
// to rank 0 (a collective: every rank calls it) and written beside the checkpoint, which itself
// holds rank 0's, as the text file CKPT.ranks:
//   world_size W
//   <rank> <data_epoch> <data_index> <data_rng_state> <rng_state>      (one line per rank)
static void save_rank_positions(Trainer *tr, const char *ckpt_path, DataPosition pos, const Rng *rng) {
#ifdef DIT_CUDA
    char err[DIT_ERR_LEN], path[1100];
    uint64_t mine[4] = {pos.epoch, pos.index, pos.rng_state, rng->state};
    uint64_t *all = malloc(4 * (size_t)tr->world * sizeof(uint64_t));
    if (!all) die("out of memory for the ranks' data positions");
    if (dist_all_gather_u64(tr->dist, mine, 4, all, err) != 0) die(err);
    if (tr->rank == 0) {
        snprintf(path, sizeof(path), "%s.ranks", ckpt_path);
        FILE *f = fopen(path, "w");
        if (!f) {
            dit_set_error(err, "%s: cannot open for writing: %s", path, strerror(errno));
            die(err);
        }
        fprintf(f, "world_size %d\n", tr->world);
        for (int r = 0; r < tr->world; r++)
            fprintf(f, "%d %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", r, all[4 * r], all[4 * r + 1],
                    all[4 * r + 2], all[4 * r + 3]);
        if (fclose(f) != 0) {
            dit_set_error(err, "%s: write failed: %s", path, strerror(errno));
            die(err);
        }
    }
    free(all);
#else
    (void)tr; (void)ckpt_path; (void)pos; (void)rng;
#endif
}

// --resume with several ranks: this rank's data position and RNG state from CKPT.ranks.
static int read_rank_positions(const char *ckpt_path, int rank, int world, DataPosition *pos, uint64_t *rng_state,
                               char *err) {
    char path[1100];
    snprintf(path, sizeof(path), "%s.ranks", ckpt_path);
    FILE *f = fopen(path, "r");
    if (!f) {
        dit_set_error(err, "--resume with %d ranks needs %s (every rank's data position, written by a run with "
                           "%d ranks): %s", world, path, world, strerror(errno));
        return -1;
    }
    int saved_world = 0, found = 0, r;
    uint64_t v[4];
    if (fscanf(f, "world_size %d", &saved_world) != 1 || saved_world != world) {
        dit_set_error(err, "%s: expected 'world_size %d' on the first line (resume with as many ranks as saved)",
                      path, world);
        fclose(f);
        return -1;
    }
    while (!found && fscanf(f, "%d %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &r, &v[0], &v[1], &v[2], &v[3]) == 5)
        found = r == rank;
    fclose(f);
    if (!found) {
        dit_set_error(err, "%s: no line for rank %d", path, rank);
        return -1;
    }
    *pos = (DataPosition){v[0], v[1], v[2]};
    *rng_state = v[3];
    return 0;
}

// Every rank calls it (the ranks' positions and optimizer slices are gathered); rank 0 writes.
static void save_checkpoint(Trainer *tr, const TrainArgs *a, DataLoader *dl, const Rng *rng, int step) {
    char path[1024], err[DIT_ERR_LEN], names[4096] = "";
    snprintf(path, sizeof(path), "%s/ckpt_%06d.safetensors", a->out, step);
    DataPosition pos = dataloader_position(dl);
    if (tr->world > 1) save_rank_positions(tr, path, pos, rng);
    trainer_gather(tr, 0);
    if (tr->rank != 0) return;
    trainer_to_host(tr);
    const Dit *m = &tr->cpu;
    for (int c = 0; c < m->cfg.num_classes; c++) {
        size_t len = strlen(names);
        snprintf(names + len, sizeof(names) - len, "%s%s", c ? "," : "", dataloader_class_name(dl, c));
    }
    TrainState state = {.step = step, .rng_state = rng->state, .data_epoch = pos.epoch,
                        .data_index = pos.index, .data_rng_state = pos.rng_state};
    if (checkpoint_save(path, m, &state, names, err) != 0) die(err);
    printf("wrote %s\n", path);
}

// --dump-parity: everything dev/parity.py needs to replay the run in PyTorch. The output, loss
// and gradients are kept for the first step and for the last (when DiT's zero init makes most
// first-step gradients exactly zero, the last step's are not).
typedef struct {
    float *init_params, *x0, *noise, *t, *losses, *grad_norms, *lrs;
    int *labels;
    float *out[2], *grads[2], loss[2];   // [0]: step 1, [1]: the last step
} ParityDump;

static void parity_begin(ParityDump *p, const Dit *m, int steps, int batch, size_t n_batch) {
    size_t S = steps, P = m->num_params;
    p->init_params = malloc(P * sizeof(float));
    for (int k = 0; k < 2; k++) {
        p->grads[k] = malloc(P * sizeof(float));
        p->out[k] = malloc(n_batch * sizeof(float));
        if (!p->grads[k] || !p->out[k]) die("--dump-parity: out of memory");
    }
    p->x0 = malloc(S * n_batch * sizeof(float));
    p->noise = malloc(S * n_batch * sizeof(float));
    p->t = malloc(S * batch * sizeof(float));
    p->labels = malloc(S * batch * sizeof(int));
    p->losses = malloc(S * sizeof(float));
    p->grad_norms = malloc(S * sizeof(float));
    p->lrs = malloc(S * sizeof(float));
    if (!p->init_params || !p->x0 || !p->noise || !p->t || !p->labels || !p->losses || !p->grad_norms || !p->lrs)
        die("--dump-parity: out of memory (use fewer steps)");
    memcpy(p->init_params, m->params_memory, P * sizeof(float));
}

// After the step's update: its inputs, loss, gradient norm and learning rate; at the first and
// the last step also the model output and the gradients (the update leaves both in place).
static void parity_record(ParityDump *p, Trainer *tr, const TrainArgs *a, int step, const float *x0,
                          const float *noise, const float *t, const int *labels, float loss, float grad_norm,
                          float lr) {
    const DitConfig *c = &tr->cpu.cfg;
    size_t s = step - 1, n_batch = (size_t)a->batch * c->channels * c->image_size * c->image_size;
    memcpy(p->x0 + s * n_batch, x0, n_batch * sizeof(float));
    memcpy(p->noise + s * n_batch, noise, n_batch * sizeof(float));
    memcpy(p->t + s * a->batch, t, a->batch * sizeof(float));
    memcpy(p->labels + s * a->batch, labels, a->batch * sizeof(int));
    p->losses[s] = loss;
    p->grad_norms[s] = grad_norm;
    p->lrs[s] = lr;
    if (step == 1 || step == a->steps) {
        int k = step == 1 ? 0 : 1;
        trainer_read_output_grads(tr, p->out[k], p->grads[k], a->batch);
        p->loss[k] = loss;
    }
}

static void parity_free(ParityDump *p) {
    free(p->init_params); free(p->x0); free(p->noise); free(p->t); free(p->labels);
    free(p->out[0]); free(p->out[1]); free(p->grads[0]); free(p->grads[1]);
    free(p->losses); free(p->grad_norms); free(p->lrs);
}

// Waits for the step in s and checks it (a non-finite loss or norm ends the run); records it for
// --dump-parity; rank 0 logs it (console and train_log.csv). ms: the wall time since the previous
// step was done (or since this one began, if later), i.e. the time per step.
static void finish_step(Trainer *tr, const TrainArgs *a, StepSlot *s, FILE *log, ParityDump *parity,
                        double *last_done) {
    char err[DIT_ERR_LEN];
    wait_step(tr, s);
    double now = now_seconds(), ms = 1e3 * (now - (s->started > *last_done ? s->started : *last_done));
    *last_done = now;
    float loss = s->scalars[0], grad_norm = s->scalars[1];
    if (!isfinite(loss) || !isfinite(grad_norm)) {
        dit_set_error(err, "step %d: loss %g, grad norm %g: training diverged", s->step, loss, grad_norm);
        die(err);
    }
    if (a->dump_parity) parity_record(parity, tr, a, s->step, s->x0, s->noise, s->t, s->labels, loss, grad_norm, s->lr);
    if (tr->rank != 0) return;
    char device_stats[256];
    format_device_stats(tr, a->batch, ms, device_stats, sizeof(device_stats));
    printf("step %5d/%d | loss %.6f | grad norm %.4f | lr %.2e | %.1f ms | %.1f images/s%s\n", s->step, a->steps, loss,
           grad_norm, s->lr, ms, a->batch / (ms / 1e3), device_stats);
    fprintf(log, "%d,%.7g,%.7g,%.7g,%.3f,%.2f\n", s->step, loss, grad_norm, s->lr, ms, a->batch / (ms / 1e3));
    fflush(log);
}

static void parity_save(const ParityDump *p, const Dit *m, const TrainArgs *a) {
    const DitConfig *c = &m->cfg;
    int n = dit_num_tensors(c);
    DitTensorInfo *info = malloc(n * sizeof(DitTensorInfo));
    SafetensorsWriter *w = st_writer_new();
    if (!info || !w) die("out of memory for the parity dump");
    dit_tensor_infos(c, info);
    checkpoint_add_params(w, c, info, "params.", p->init_params);
    checkpoint_add_params(w, c, info, "final.params.", m->params_memory);   // after the last step
    int64_t S = a->steps, B = a->batch, C = c->channels, R = c->image_size;
    for (int k = 0; k < (S > 1 ? 2 : 1); k++) {
        char prefix[32], name[96];
        snprintf(prefix, sizeof(prefix), "step%d.", k ? a->steps : 1);
        snprintf(name, sizeof(name), "%sgrad.", prefix);
        checkpoint_add_params(w, c, info, name, p->grads[k]);
        snprintf(name, sizeof(name), "%sout", prefix);
        st_writer_add(w, name, ST_F32, (int64_t[]){B, C, R, R}, 4, p->out[k]);
        snprintf(name, sizeof(name), "%sloss", prefix);
        st_writer_add(w, name, ST_F32, (int64_t[]){1}, 1, &p->loss[k]);
    }
    st_writer_add(w, "batch.x0", ST_F32, (int64_t[]){S, B, C, R, R}, 5, p->x0);
    st_writer_add(w, "batch.noise", ST_F32, (int64_t[]){S, B, C, R, R}, 5, p->noise);
    st_writer_add(w, "batch.t", ST_F32, (int64_t[]){S, B}, 2, p->t);
    st_writer_add(w, "batch.labels", ST_I32, (int64_t[]){S, B}, 2, p->labels);
    st_writer_add(w, "losses", ST_F32, (int64_t[]){S}, 1, p->losses);
    st_writer_add(w, "grad_norms", ST_F32, (int64_t[]){S}, 1, p->grad_norms);
    st_writer_add(w, "lrs", ST_F32, (int64_t[]){S}, 1, p->lrs);
    char text[64];
    const struct { const char *key; double value; } meta[] = {
        {"depth", c->depth}, {"hidden", c->hidden}, {"heads", c->heads}, {"patch", c->patch},
        {"image_size", c->image_size}, {"channels", c->channels}, {"num_classes", c->num_classes},
        {"steps", a->steps}, {"batch", a->batch}, {"lr", a->lr}, {"beta1", 0.9}, {"beta2", 0.999},
        {"eps", 1e-8}, {"weight_decay", a->weight_decay}, {"grad_clip", a->grad_clip},
    };
    for (size_t i = 0; i < sizeof(meta) / sizeof(meta[0]); i++) {
        snprintf(text, sizeof(text), "%.9g", meta[i].value);
        st_writer_meta(w, meta[i].key, text);
    }
    char err[DIT_ERR_LEN];
    if (st_writer_save(w, a->dump_parity, err) != 0) die(err);
    printf("wrote %s\n", a->dump_parity);
    st_writer_free(w);
    free(info);
}

// ---- main --------------------------------------------------------------------------------

int main(int argc, char **argv) {
    char err[DIT_ERR_LEN];
    TrainArgs args;
    if (parse_args(argc, argv, &args, err) != 0) die(err);
    const TrainArgs *a = &args;
    DistEnv dist;
    if (dist_env_from_environ(&dist, err) != 0 || check_distributed_args(a, &dist, err) != 0) die(err);
    if (make_dirs(a->out) != 0) {
        dit_set_error(err, "--out %s: cannot create the directory: %s", a->out, strerror(errno));
        die(err);
    }
    if (a->gpus > 1 && dist.world_size == 1) {
        launch_local_ranks(a, argv);
        return 0;
    }
    // this process is rank `rank` of `world`, in data-parallel group mesh.dp_rank (whose data
    // stream it reads: the same on every rank of a sequence-parallel group), with B images of the
    // global batch per step
    int rank = dist.rank, world = dist.world_size;
    DistMesh mesh;
    if (dist_mesh_make(&mesh, world, rank, a->sp_ulysses, a->sp_ring, err) != 0) die(err);
    int B = a->batch / mesh.dp;
    if (world > 1) snprintf(die_prefix, sizeof(die_prefix), "rank %d: ", rank);

    // model configuration: a checkpoint's, or the preset with the overrides
    DitConfig cfg;
    if (a->resume) {
        if (checkpoint_read_config(a->resume, &cfg, err) != 0) die(err);
    } else {
        if (dit_config_preset(&cfg, a->model, err) != 0) die(err);
        if (a->depth) cfg.depth = a->depth;
        if (a->hidden) cfg.hidden = a->hidden;
        if (a->heads) cfg.heads = a->heads;
        if (a->patch) cfg.patch = a->patch;
        if (a->image_size) cfg.image_size = a->image_size;
        if (a->channels) cfg.channels = a->channels;
    }

    // data
    struct stat st;
    if (!strcmp(a->data, DEFAULT_DATA) && stat(DEFAULT_DATA, &st) != 0)
        die("the default dataset " DEFAULT_DATA " is missing: run `make data` (needs Debian's "
            "dataset-fashion-mnist package: sudo apt-get install dataset-fashion-mnist), or pass "
            "--data DIR for your own image folder, or --data synthetic");
    DataLoaderConfig dcfg = {.root = a->data, .image_size = cfg.image_size, .channels = cfg.channels,
                             .batch_size = B, .seed = dist_rank_seed(a->seed, mesh.dp_rank), .random_flip = a->random_flip,
                             .skip_bad_images = a->skip_bad_images, .prefetch = 2};
    DataLoader *dl;
    if (dataloader_open(&dl, &dcfg, err) != 0) die(err);
    if (a->preview_data) {
        char path[1024];
        snprintf(path, sizeof(path), "%s/data_preview.png", a->out);
        if (dataloader_preview_png(dl, path, 40, err) != 0) die(err);
        printf("wrote %s\n", path);
        dataloader_close(dl);
        return 0;
    }
    if (a->resume && cfg.num_classes != dataloader_num_classes(dl)) {
        dit_set_error(err, "--resume %s: the checkpoint has %d classes but --data %s has %d",
                 a->resume, cfg.num_classes, a->data, dataloader_num_classes(dl));
        die(err);
    }
    cfg.num_classes = dataloader_num_classes(dl);

    // model, optimizer state, and the training RNG (label drop, t, noise); with several ranks
    // first the communicator, which selects this rank's GPU
#ifdef DIT_CUDA
    DistComm *comm = NULL;
    if (world > 1 && dist_comm_create(&comm, &dist, a->out, a->dist_timeout, err) != 0) die(err);
#endif
    Trainer tr;
#ifdef DIT_CUDA
    trainer_create(&tr, &cfg, a, B, &mesh, comm, err);
#else
    trainer_create(&tr, &cfg, a, B, &mesh, NULL, err);
#endif
    const Dit *model = &tr.cpu;
    Rng rng;
    rng_seed(&rng, dist_rank_seed(a->seed, mesh.dp_rank) + 1);
    int first_step = 1;
    if (a->resume) {
        TrainState state;
        if (checkpoint_load(a->resume, &tr.cpu, &state, err) != 0) die(err);
        rng.state = state.rng_state;
        DataPosition pos = {state.data_epoch, state.data_index, state.data_rng_state};
        if (world > 1 && read_rank_positions(a->resume, rank, world, &pos, &rng.state, err) != 0) die(err);
        if (dataloader_seek(dl, pos, err) != 0) die(err);
        first_step = (int)state.step + 1;
    }
    trainer_to_device(&tr);
    if (rank == 0) {
        printf("dit.c | device %s%s | attention %s%s | depth %d hidden %d heads %d (head dim %d) patch %d | "
               "%dx%dx%d images, %d tokens | %d classes, %" PRId64 " images | %.2fM parameters\n",
               a->device, tr.cuda_graph ? " (the step as one CUDA graph)" : "", a->attn,
               strncmp(a->attn, "sage", 4) == 0 && a->sage_rotate ? " (Hadamard-rotated q, k)" : "",
               cfg.depth, cfg.hidden, cfg.heads, cfg.hidden / cfg.heads, cfg.patch, cfg.channels,
               cfg.image_size, cfg.image_size, dit_tokens(&cfg), cfg.num_classes, dataloader_num_images(dl),
               model->num_params / 1e6);
        if (!strcmp(a->linear, "fp8"))
            printf("block linears (qkv, proj, fc1, fc2): FP8 GEMMs (e4m3, per-tensor scales from the current amax%s; "
                   "fast accumulation: %s)\n",
                   a->fp8_grad_headroom > 0 ? "; the douts of fc1, fc2, proj within --fp8-grad-headroom of it" : "",
                   fp8_fast_accum_names[a->fp8_fast_accum]);
        if (tr.on_gpu)
            printf("GEMM algorithms: %s (--gemm-tuning %s)\n", a->gemm_tuning ? "the fastest of cuBLASLt's candidates, "
                   "timed in the first step" : "cuBLASLt's heuristic's first answer", a->gemm_tuning ? "on" : "off");
        if (world > 1)
            printf("data parallel: %d groups of %d ranks (%s), %d images per group and step, group g's data "
                   "stream from seed %" PRIu64 " mixed with g\n", mesh.dp, mesh.sp, dist.launcher, B, a->seed);
        if (world > 1)
            printf("ZeRO-1 over %d ranks: %.0f MB of gradients reduced %s (--zero-overlap %s)\n", world,
                   model->num_params * sizeof(float) / 1e6, tr.zero_overlap ? "behind the backward" : "after the backward",
                   a->zero_overlap < 0 ? "auto" : a->zero_overlap ? "on" : "off");
        if (mesh.sp > 1)
            printf("sequence parallel: Ulysses %d x ring %d, %d of the %d tokens of every image per rank\n",
                   mesh.ulysses, mesh.ring, dit_tokens(&cfg) / mesh.sp, dit_tokens(&cfg));
        print_memory_plan(&tr);
    }

    size_t img = (size_t)cfg.channels * cfg.image_size * cfg.image_size, n_batch = B * img;
    StepSlot slots[2];
    for (int i = 0; i < 2; i++) slot_alloc(&tr, &slots[i], n_batch, B);

    ParityDump parity = {0};
    if (a->dump_parity) parity_begin(&parity, model, a->steps, a->batch, n_batch);

    char log_path[1024];
    snprintf(log_path, sizeof(log_path), "%s/train_log.csv", a->out);
    FILE *log = rank == 0 ? fopen(log_path, a->resume ? "a" : "w") : NULL;
    if (rank == 0 && !log) {
        dit_set_error(err, "%s: cannot open for writing: %s", log_path, strerror(errno));
        die(err);
    }
    if (log && fseek(log, 0, SEEK_END) == 0 && ftell(log) == 0)   // a new log (also a resume into a new --out)
        fprintf(log, "step,loss,grad_norm,lr,ms,images_per_s\n");
    if (a->save_init && !a->resume) save_checkpoint(&tr, a, dl, &rng, 0);

    // One step in flight on the GPU: while it runs, the host draws the next step's batch and
    // queues that step, and only then waits for the running one and logs it. A step that writes a
    // checkpoint or samples (they read the weights it leaves), the last step and every step of
    // --dump-parity are waited for at once, as is every step on the CPU.
    StepSlot *in_flight = NULL;
    int overlap = tr.on_gpu && !a->dump_parity;   // the CPU runs the step inside queue_step
    double last_done = now_seconds();
    for (int step = first_step; step <= a->steps; step++) {
        StepSlot *s = &slots[step % 2];   // free: its previous step (step - 2) is done
        s->step = step;
        s->started = now_seconds();

        // 1. a batch of images and labels
        if (dataloader_next_batch(dl, s->x0, s->labels, err) != 0) die(err);

        // 2. drop labels to the null class for guidance; flow-matching time t and noise ε (the
        //    model makes x_t = (1 - t)·x0 + t·ε, v = ε - x0)
        flow_matching_sample(&rng, s->labels, s->t, s->noise, B, img, a->label_dropout, cfg.num_classes,
                             !strcmp(a->t_sampling, "uniform"));

        // 3. forward, loss, backward (several ranks: then the mean gradients and loss over the
        //    ranks); 4. clip by the global gradient norm, AdamW, EMA
        s->lr = learning_rate(a, step);
        queue_step(&tr, a, s);

        // 5. the previous step's loss and gradient norm: log
        if (in_flight) finish_step(&tr, a, in_flight, log, &parity, &last_done);
        in_flight = s;
        int last = step == a->steps, checkpoint = a->ckpt_every && (step % a->ckpt_every == 0 || last);
        int samples = a->sample_every && (step % a->sample_every == 0 || last);
        if (overlap && !checkpoint && !samples && !last) continue;
        finish_step(&tr, a, s, log, &parity, &last_done);
        in_flight = NULL;
        // 6. checkpoint (every rank: it gathers every rank's data position and optimizer slice),
        //    samples (every rank gathers the EMA; the ranks of rank 0's sequence-parallel group run
        //    the sampling's forwards together)
        if (checkpoint) save_checkpoint(&tr, a, dl, &rng, step);
        if (samples) trainer_gather(&tr, 1);
        if (samples && rank < mesh.sp) write_samples(&tr, a, dl, step);
        last_done = now_seconds();
    }
    if (a->dump_parity) {
        trainer_to_host(&tr);
        parity_save(&parity, model, a);
    }

    if (log) fclose(log);
    dataloader_close(dl);
    for (int i = 0; i < 2; i++) slot_free(&tr, &slots[i]);
    trainer_free(&tr);
    parity_free(&parity);
    return 0;
}
