// The DiT on the GPU: the twin of model/dit.h (same parameter buffer layout, same forward and
// backward, layer by layer), built from layers/layers_cuda.h and the GPU attention kernels.
//
// Precision as llm.c: fp32 master weights, AdamW moments, EMA and parameter gradients; a bf16
// copy of the weights and bf16 activations for compute; fp32 LayerNorm statistics, attention
// LSE, loss and reductions. Parameter gradients are sums in a fixed order (no float atomics).
// Attention: sage (quantized) or exact attention computed in bf16 (FlashAttention-2 kernel).
// Memory: one device allocation holds every parameter-sized buffer, one holds the activations,
// their gradients, the attention workspaces and the batch (plus the LayersCuda context's own).
//
// Initialization and checkpoints stay on the CPU: a DitGpu is created from a CPU Dit (which can
// be made with batch 1: only its parameters and optimizer state are read), uploaded from it and
// downloaded back into it. Every function returns 0, or -1 with a message in err; work is queued
// on m->stream and only the download/read functions wait for it.
#pragma once
#include <stddef.h>
#include "layers/layers_cuda.h"
#include "model/dit.h"

#ifdef __cplusplus
extern "C" {
#endif

// Sequence parallelism (dev/notes_sequence_parallel.md, "Sequence parallelism in the model"):
// this rank is rank sp_rank = ring_rank·U + ulysses_rank of a group of U·R ranks that share every
// image; it holds the tokens sp_rank·T/(U·R) .. of each one (its shard of the residual stream and
// of every per-token activation). The conditioning (t, y, adaLN) is per image and replicated; the
// attention runs Ulysses over `ulysses_comm` (all-to-all to H/U heads) and ring attention over
// `ring_comm` (key/value shards of T/R tokens); the output tokens are all-gathered over `sp_comm`
// so every rank has the whole output image, and the loss (a mean over the GLOBAL elements) and
// dL/dout are the single-GPU ones. Parameter gradients are then this rank's share: the caller
// sums them over the group (and averages over data parallel), e.g. dist_all_reduce_scaled.
// Ulysses without ring pipelines each block's attention over G groups of this rank's (b, head)
// pairs: the all-to-alls of one group run on group_stream while another group's attention runs
// (head_groups = G, 0: DIT_ULYSSES_HEAD_GROUPS; at most B·H/U groups are used; 1 under ring).
//
// ZeRO-1 (model/zero.h): the optimizer state is sharded over optimizer_shards ranks (0 or 1:
// none, the whole buffer is this rank's); this rank updates slice optimizer_rank of the padded
// parameter buffer (DitGpu.shard_size elements each). zero_overlap = 1 readies the model for
// ZeRO-1's reduction behind the backward: the backward computes each block's adaLN weight and
// bias gradients in that block's iteration (one GEMM per block instead of one over all blocks
// after the loop), so every gradient of a block is final when its iteration ends; with several
// shards it also creates reduce_stream and records block_grads_done (below). 0: the one-GPU
// backward as it always was.
// The block linears (qkv, proj, fc1, fc2): bf16 cuBLASLt GEMMs (layers/layers_cuda.h), or FP8 GEMMs
// (layers/linear_fp8_cuda.h: e4m3 activations, weights and gradients, per-tensor scales from the
// current amax, the forward GEMMs in fast accumulation by default (ctx.fp8_accumulation); fc1's GELU
// and fc2's dGELU as separate passes). The patch
// embedding, timestep MLP, adaLN and final layer stay bf16. dev/notes_linear_fp8.md.
typedef enum { DIT_LINEAR_BF16 = 0, DIT_LINEAR_FP8 = 1 } DitLinear;
#define DIT_FP8_GRAD_HEADROOM 3   // DitGpu.fp8_grad_headroom from create
#define DIT_FP8_ACCUMULATION FP8_ACCUM_FAST_FORWARD   // DitGpu.ctx.fp8_accumulation from create

struct ncclComm;   // ncclComm_t
#define DIT_ULYSSES_HEAD_GROUPS 4
#define DIT_MAX_HEAD_GROUPS 16
typedef struct {
    int ulysses, ring;                 // U, R (1: that kind is off)
    int ulysses_rank, ring_rank;
    struct ncclComm *sp_comm, *ulysses_comm, *ring_comm;  // NULL where the group has one rank
    int head_groups;                   // G of the Ulysses pipeline (0: the default)
    int optimizer_shards, optimizer_rank;
    int zero_overlap;                  // 1: per-block adaLN gradients (and, sharded, the events)
} DitGpuSeqParallel;

// bf16 views of one parameter buffer (the weights, or the EMA for sampling), as DitParams.
typedef struct {
    bf16 *patch_w, *patch_b, *t_w1, *t_b1, *t_w2, *t_b2, *y_table;
    bf16 *ada_w, *ada_b, *qkv_w, *qkv_b, *proj_w, *proj_b, *fc1_w, *fc1_b, *fc2_w, *fc2_b;
    bf16 *final_ada_w, *final_ada_b, *final_w, *final_b;
} DitGpuWeights;

// Activations of one forward (batch ≤ m->batch), kept for the backward; shapes as DitActivations
// with T = m->tokens (this rank's tokens; q, k, v, att, att_lse head-sharded under Ulysses).
typedef struct {
    float *x0, *noise, *v_target;      // (B, C, S, S) fp32: the flow-matching batch and target
    float *t;                          // (B) flow-matching times
    int *labels;                       // (B)
    bf16 *x_t;                         // (B, C, S, S): the model input
    bf16 *patches, *t_freq, *t_h, *t_h_silu, *t_emb, *y_emb, *c, *c_silu, *ada;
    bf16 *residual;                    // (depth + 1, B, T, h)
    bf16 *ln1, *qkv, *q, *k, *v, *att, *att_merged, *proj, *x_mid, *ln2;
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd;  // (depth, B, T)
    float *att_lse;                    // (depth, B, H, T), base 2 (attention/attention.h)
    void *att_workspace;               // depth × att_workspace_bytes: what the attention's
                                       // backward reads (sage: the quantized Q, K, V; Ulysses:
                                       // one region per head group)
    bf16 *fc1, *gelu, *fc2;            // fc1 is the pre-GELU activation (depth, B, T, 4h); gelu: with
                                       // DIT_LINEAR_FP8 one block's (B, T, 4h), written only with
                                       // fp8_fused_inputs 0 (the FP8 backward reads fc2's quantized copy)
    // DIT_LINEAR_FP8 only (else NULL): the block linears' inputs as their forwards quantized them,
    // for the backwards' dweight GEMMs (layers/linear_fp8_cuda.h, Fp8Saved): e4m3 transposed copies
    // (depth, IC, Mp), Mp = fp8_padded_rows(B·T), of ln1 (qkv), att_merged (proj), ln2 (fc1) and
    // gelu (fc2) (each scale alone in a 256-byte slot)
    uint8_t *ln1_fp8t, *att_merged_fp8t, *ln2_fp8t, *gelu_fp8t;
    // and the weights as their forwards quantized them, for the backwards' dinp GEMMs: e4m3 weightᵀ
    // (IC, OC) of qkv, proj, fc1, fc2, one after the other per block (depth, 12·hidden²)
    uint8_t *weight_fp8t;
    float *fp8_scales;                 // the saved inputs' scales, then the weights' (2, depth, 4 linears)
    // DIT_LINEAR_FP8 only: max |x| of what the block linears quantize, (3, depth, 4 linears: qkv,
    // proj, fc1, fc2): [0] their inputs (ln1, att_merged, ln2, GELU(fc1)), taken by the kernels
    // that write them, or (att_merged when the attention writes it, GELU(fc1)) by the guessed
    // quantization; [1] their weights, taken by the forward's guessed quantization and read by the
    // backward too; [2] their douts, taken by the kernels that write them. [0] and [1] are zeroed
    // at the start of each forward, [2] of each backward
    float *fp8_amax;
    // DIT_LINEAR_FP8 only: (depth, 6, 2) ints, the Fp8Scaling.exponent pairs of the tensors whose
    // scale the forward guesses (the four weights, att_merged, GELU(fc1)), kept from step to step
    int *fp8_guess;
    bf16 *final_ada, *lnf, *out_tokens, *out;
    float *lnf_mean, *lnf_rstd;
    float *out_float;                  // (B, C, S, S): the output as fp32, for downloads
    float *loss, *grad_sumsq, *grad_norm;  // one float each (grad_sumsq: Σ g² of this rank's slice)
} DitGpuActivations;

// Gradients of the activations. The block buffers hold one block and are reused by every block
// (the backward walks the blocks one at a time); `residual` carries dL/d(residual stream).
typedef struct {
    bf16 *out;                         // (B, C, S, S): dL/dout, written by the loss
    bf16 *residual, *out_tokens, *lnf, *c_silu, *c, *t_h_silu, *t_h;
    float *final_ada, *ada;            // fp32 sums of dshift/dscale/dgate, (B, 2h), (B, depth·6h)
    bf16 *final_ada_bf16, *ada_bf16;   // their bf16 copies, the GEMMs' input
    // one block, each written by its one producer (att: sequence parallel only, zeroed per block and
    // accumulated into by merge_heads_backward)
    bf16 *fc2, *ln2, *proj, *att_merged, *att, *ln1;
    bf16 *fc1, *qkv;
    float *dq, *dk, *dv;               // (B, H, T, D) fp32 from the attention backward (dv: sequence parallel
                                       // only; without it dv goes as bf16 straight into qkv's v columns)
    void *att_workspace;               // the attention backward's workspace (Ulysses with head
                                       // groups: one per compute stream)
} DitGpuGradActs;

// Buffers of sequence parallelism (NULL when unused). Head-sharded tensors are (B, H/U, T/R, D).
typedef struct {
    bf16 *tokens_full;                 // (B, T, P): the whole image's patches / output tokens / their gradient
    bf16 *tokens_gather;               // (U·R, B, T/(U·R), P): the all-gathered output tokens
    bf16 *q_local, *k_local, *v_local; // (B, H, T/(U·R), D): split_heads' output before the all-to-all
    bf16 *att_local;                   // (B, H, T/(U·R), D): the attention output after the inverse
    bf16 *dout_heads;                  // head-sharded dL/d(attention output)
    float *dq_heads, *dk_heads, *dv_heads;  // head-sharded attention gradients
    bf16 *dqkv_heads, *dqkv_local;     // [dq | dk | dv] rotated and rounded, head- and sequence-sharded
    float *k_mean, *v_scale;           // (depth, B, H/U, D): sage under ring, kept for the backward
} DitGpuSeqBuffers;

// The training step as one CUDA graph (dit_gpu_train_step_graph). The key holds everything its
// kernels were captured with that may change between calls; the pointers (one allocation each
// for parameters and activations, fixed at create), the attention kind and its P·V format
// (fixed at create) and the kernel choices read from the environment once per process
// (DIT_SAGE_MMA_SYNC, ...) cannot.
typedef struct {
    int B;
    SageConfig sage;                   // rotate may be set any time
    int sage_deterministic, flash_deterministic;   // the attention backwards' process-wide switches
    int fp8_fused_inputs, fp8_grad_headroom;   // DitGpu's FP8 settings
    Fp8Accumulation fp8_accumulation;
    float beta1, beta2, eps, weight_decay, grad_clip;
} DitGpuStepKey;

typedef struct {
    DitGpuStepKey key;                 // of the eager warm-up step and of the graph captured after it
    int warm;                          // a step with `key` has run eagerly (lazy initialisations done)
    cudaGraph_t graph;
    cudaGraphExec_t exec;              // NULL until captured
    int captures, launches;            // counts, for the tests
} DitGpuStepGraph;

typedef struct {
    DitConfig cfg;
    size_t num_params;
    // sequence parallelism (sp.ulysses = sp.ring = 1 without): this rank's tokens
    // token_offset .. token_offset + tokens of the dit_tokens(cfg) of an image
    DitGpuSeqParallel sp;
    int tokens, token_offset;
    DitGpuSeqBuffers sp_bufs;
    cudaStream_t comm_stream;          // ring passes, Ulysses' own-run copies (U·R > 1)
    cudaStream_t group_stream;         // Ulysses' all-to-alls (U > 1; highest priority)
    cudaStream_t odd_stream;           // the attention of Ulysses' odd head groups (U > 1)
    cudaEvent_t group_events[2 * DIT_MAX_HEAD_GROUPS + 1];  // its order against `stream`
    int head_groups;                   // G of the Ulysses pipeline (1 without Ulysses or with ring)
    int batch;                         // activations are allocated for this batch size
    DitAttention attention;            // DIT_ATTN_SAGE: sage kernels (P·V format in sage.pv); DIT_ATTN_EXACT:
                                       // bf16 flash attention
    SageConfig sage;                   // the sage kernels fix q_block = k_block = 64; pv is fixed at create
                                       // (workspace sizes); rotate (Hadamard of q, k) may be set any time
    DitLinear linear;                  // the block linears' GEMMs (fixed at create)
    void *fp8_workspace;               // DIT_LINEAR_FP8: the FP8 layer's workspace (in the activations'
    size_t fp8_workspace_bytes;        // allocation), linear_fp8_workspace_bytes of the largest linear
    size_t fp8_saved_bytes;            // DIT_LINEAR_FP8: bytes of acts' kept fp8 copies (ln1_fp8t .. fp8_guess)
    int fp8_fused_inputs;              // DIT_LINEAR_FP8 (1 from create): the linears' inputs fused with
                                       // their producers: the kernels that write them take their amax
                                       // (acts.fp8_amax), or their quantization guesses the exponent
                                       // (the weights, att_merged, GELU(fc1): acts.fp8_guess); GELU(fc1)
                                       // is not stored at all (fc2's quantization recomputes it), and the
                                       // weights' transposes are kept for the backward. 0: each linear
                                       // reads a stored bf16 input and takes its amax in a pass of its
                                       // own (bitwise the same results: test_dit_fp8_cuda compares them)
    int fp8_grad_headroom;             // DIT_LINEAR_FP8 with fused inputs: >= 0 (DIT_FP8_GRAD_HEADROOM from
                                       // create): the douts of fc2, fc1 and proj are quantized by the passes
                                       // that compute them (the gated residual's dh, the dGELU:
                                       // layers/fp8_dout_cuda.cu) with a guessed exponent kept while within
                                       // 2·headroom binades above its current amax's (Fp8Scaling.headroom;
                                       // 0: current scaling's exact bytes, bitwise the -1 path);
                                       // -1: stored in bf16 and quantized by the linears
    // parameter-sized buffers, one allocation: fp32 params, grads, AdamW m and v, EMA; bf16
    // copies of the params (updated by AdamW) and of the EMA (made before sampling). Each is
    // shards·shard_size elements (num_params padded with zeros; shard_size a multiple of 64);
    // the optimizer updates slice shard_rank: [shard_rank·shard_size, + shard_size) ∩ [0, num_params).
    int shards, shard_rank;
    size_t shard_size;
    void *params_alloc;
    size_t params_bytes;
    float *params_memory, *grads_memory, *adam_m_memory, *adam_v_memory, *ema_memory;
    bf16 *params_bf16_memory, *ema_bf16_memory;
    DitParams params, grads;           // fp32 views (device pointers)
    DitGpuWeights weights, ema_weights;// bf16 views for compute
    // activations, their gradients, workspaces and the batch, one allocation
    void *acts_alloc;
    size_t acts_bytes, att_workspace_bytes;
    DitGpuActivations acts;
    DitGpuGradActs grad_acts;
    bf16 *pos_embed;                   // (T, h), fixed
    LayersCuda ctx;                    // fp8_accumulation: DIT_FP8_ACCUMULATION from create (may be changed
                                       // between steps, as the FP8 settings above)
    cudaStream_t stream;
    // The optimizer's per-step values (lr, bias corrections, EMA decay), which its kernels read
    // from the device: dit_gpu_set_step copies them from two pinned host entries used in turn,
    // each reused once its previous copy has run (the event step_copied[i] says so).
    OptimizerStepConstants *step_constants;       // device, in the activations' allocation
    OptimizerStepConstants *step_constants_host;  // pinned, 2 entries
    cudaEvent_t step_copied[2];
    int step_next;                                // the entry the next dit_gpu_set_step fills
    DitGpuStepGraph step_graph;
    // ZeRO-1 over several shards with sp.zero_overlap (model/zero.h; else NULL): the gradients'
    // reduction may run on reduce_stream (highest priority, so its NCCL kernels are not starved by
    // the backward's grids) behind the backward. dit_gpu_backward records block_grads_done[l] (depth events) on
    // `stream` once block l's parameter gradients are final (dit_gpu_block_grad_ranges);
    // grads_ready and grads_reduced order the rest of the reduction against `stream`.
    cudaStream_t reduce_stream;
    cudaEvent_t *block_grads_done;
    cudaEvent_t grads_ready, grads_reduced;
} DitGpu;

// Allocates everything for batches of up to `batch` images. attention: DIT_ATTN_SAGE or
// DIT_ATTN_SAGE_FP16 (sage kernels with FP8 or FP16 P·V, attention/sage_cuda.h) or DIT_ATTN_EXACT
// (bf16 flash attention, attention/flash_cuda.h).
int dit_gpu_create(DitGpu *m, const DitConfig *cfg, int batch, DitAttention attention, char *err);
// The same for one rank of a sequence-parallel group and/or of the ZeRO-1 optimizer shards (sp
// NULL: one GPU), with the block linears' kind (dit_gpu_create: DIT_LINEAR_BF16). Errors: no NCCL
// in the build, heads % U, tokens % (U·R), sage under ring with T/R not a multiple of 64, a
// communicator missing for a group larger than one, optimizer_rank outside [0, optimizer_shards);
// DIT_LINEAR_FP8 on a GPU below sm_89 (any token count: the FP8 layer pads what needs padding).
int dit_gpu_create_sp(DitGpu *m, const DitConfig *cfg, int batch, DitAttention attention, DitLinear linear,
                      const DitGpuSeqParallel *sp, char *err);
void dit_gpu_free(DitGpu *m);
// Bytes of each part, for the memory plan: parameter-sized buffers, activations (incl. gradients
// and workspaces), and the LayersCuda context (cuBLASLt workspace and reduction scratch).
void dit_gpu_memory_plan(const DitGpu *m, size_t *params_bytes, size_t *acts_bytes, size_t *ctx_bytes);

// Copies the weights, EMA and AdamW moments of a CPU model with the same config to the GPU
// (and makes the bf16 copy of the weights); the download copies them back (for checkpoints).
int dit_gpu_upload(DitGpu *m, const Dit *cpu, char *err);
int dit_gpu_download(DitGpu *m, Dit *cpu, char *err);

// Inputs of a forward from the host: x_t (B, C, S, S) (rounded to bf16), t (B), labels (B).
int dit_gpu_set_inputs(DitGpu *m, const float *x_t, const float *t, const int *labels, int B, char *err);
// A training batch from the host: x0, noise (B, C, S, S), t, labels; x_t = (1 - t)·x0 + t·ε and
// the target v = ε - x0 are made on the GPU.
int dit_gpu_set_flow_batch(DitGpu *m, const float *x0, const float *noise, const float *t,
                           const int *labels, int B, char *err);

// Forward of the inputs with weights w (&m->weights, or &m->ema_weights): output in acts.out.
int dit_gpu_forward(DitGpu *m, const DitGpuWeights *w, int B, char *err);
// acts.loss = mean (out - v_target)², grad_acts.out = dLoss/dout (the whole image, also under
// sequence parallelism).
int dit_gpu_loss(DitGpu *m, int B, char *err);
int dit_gpu_zero_grad(DitGpu *m, char *err);
// Backward of the last forward (with m->weights) from grad_acts.out; parameter gradients
// accumulate into m->grads. sp.zero_overlap: block l's adaLN gradients in its iteration, and with
// several optimizer shards m->block_grads_done[l] recorded after it.
int dit_gpu_backward(DitGpu *m, int B, char *err);
// dit_gpu_zero_grad then dit_gpu_backward, bitwise, without zeroing the weight stacks of the
// blocks and of the adaLN projection first: their GEMMs write them (beta 0) instead of adding to
// zeros (a GEMM's fp32 result is never -0, so 0 + x and x have the same bits). At hidden 2048
// that leaves 7% of the gradient memset.
int dit_gpu_backward_fresh(DitGpu *m, int B, char *err);
// The parameter gradients that the backward of blocks first .. first + count - 1 makes and no
// later kernel of the backward touches, with sp.zero_overlap, as DIT_BLOCK_GRAD_RANGES ranges of
// grads_memory in buffer order (offset, numel in floats): the blocks' slices of the adaLN, qkv,
// proj, fc1 and fc2 weight and bias stacks. (Without zero_overlap the adaLN slices are written
// after the loop, by one GEMM over all blocks.)
#define DIT_BLOCK_GRAD_RANGES 10
void dit_gpu_block_grad_ranges(const DitGpu *m, int first, int count, size_t *offsets, size_t *numels);
// The optimizer step, in two parts around the sum over the ranks of the slices' squares (ZeRO-1,
// model/zero.h; one GPU: nothing between them). dit_gpu_grad_sumsq: acts.grad_sumsq = Σ g² over
// this rank's slice. dit_gpu_update: dit_gpu_set_step, then acts.grad_norm = sqrt(acts.grad_sumsq);
// on the slice only, AdamW (weight decay on tensors with ndim ≥ 2) with the clip scale min(1,
// grad_clip/(norm + 1e-6)) read on the device (grad_clip 0: off) and the bf16 weights; then ema =
// ema_decay·ema + (1 - ema_decay)·params. The other slices' fp32 state and bf16 weights are left
// as they were.
int dit_gpu_grad_sumsq(DitGpu *m, char *err);
int dit_gpu_update(DitGpu *m, float lr, float beta1, float beta2, float eps, float weight_decay,
                   float grad_clip, float ema_decay, int step, char *err);
// Queues the copy of the optimizer's per-step values (lr, the bias corrections of `step`,
// ema_decay: OptimizerStepConstants, computed on the host) to m->step_constants, which the
// AdamW and EMA kernels read. Eager only: never inside a capture.
int dit_gpu_set_step(DitGpu *m, float lr, float beta1, float beta2, float ema_decay, int step, char *err);
// One GPU (no sequence parallelism, no optimizer shards): the training step's work after
// dit_gpu_set_flow_batch (forward, loss, zero-grad, backward, Σ g², AdamW, EMA: the kernels of
// dit_gpu_forward … dit_gpu_update, with the same arguments) as one CUDA graph on m->stream.
// dit_gpu_set_step runs first, eagerly, so every replay reads its own step's values. The first
// call with a given DitGpuStepKey (batch, SageConfig, deterministic switches, optimizer
// constants) runs the step eagerly (cuBLASLt and the kernels' lazy set-up); the next captures it
// (cudaStreamCaptureModeGlobal) and instantiates the graph; later calls with that key replay it,
// and a call with another key drops it and starts again. The results are bitwise those of the
// eager calls. The graph is destroyed by dit_gpu_free.
int dit_gpu_train_step_graph(DitGpu *m, int B, float lr, float beta1, float beta2, float eps, float weight_decay,
                             float grad_clip, float ema_decay, int step, char *err);
int dit_gpu_queue_scalars(DitGpu *m, float *loss, float *grad_norm, cudaEvent_t done, char *err);
// Waits for the queued work and reads the last loss and gradient norm (either may be NULL).
int dit_gpu_read_scalars(DitGpu *m, float *loss, float *grad_norm, char *err);
// Waits and copies out: the output (B, C, S, S) as fp32; all parameter gradients (num_params).
int dit_gpu_download_output(DitGpu *m, float *out, int B, char *err);
int dit_gpu_download_grads(DitGpu *m, float *grads, char *err);

// Euler sampling with classifier-free guidance from the EMA weights, as dit_sample (model/sample.h):
// x (n, C, S, S) on the host, noise in, images out, in chunks of m->batch.
int dit_gpu_sample(DitGpu *m, float *x, const int *labels, int n, int steps, float cfg_scale, char *err);

// Model FLOPs of one training step (forward + backward = 3 × forward matmul FLOPs, attention
// included, no recomputation counted) for B images: the numerator of MFU.
double dit_train_flops(const DitConfig *cfg, int B);

#ifdef __cplusplus
}
#endif
