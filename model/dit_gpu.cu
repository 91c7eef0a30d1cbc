// The DiT on the GPU: memory layout, upload/download, forward, backward, optimizer step and
// sampling. Read it beside model/dit.c: dit_gpu_forward and dit_gpu_backward call the CUDA twin
// of every CPU layer in the same order; the differences are noted where they occur.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attention/flash_cuda.h"
#include "attention/hadamard.cuh"
#include "attention/sage_cuda.h"
#include "layers/cuda_common.cuh"
#include "layers/layers.h"
#include "layers/linear_fp8_cuda.h"
#include "model/dit_gpu.h"
#ifdef DIT_NCCL
#include "attention/sequence_parallel_cuda.h"
#endif

#define ALIGN_BYTES 256   // every buffer starts on a 256-byte boundary (cuBLASLt, vector loads)
#define SHARD_ALIGN 64    // optimizer slices start on 256 bytes of fp32 (128 of bf16)
#define FP8_SCALE_SLOT (ALIGN_BYTES / sizeof(float))   // floats: each saved FP8 scale alone in 256 bytes
#define FP8_GUESSES 10   // per block: the four weights, att_merged, GELU(fc1), the douts of fc1, fc2, proj, qkv

// Run a call that follows the error convention; return -1 from the caller if it fails.
#define TRY(call) do { if ((call) != 0) return -1; } while (0)

// ---- memory layout -----------------------------------------------------------------------

// Carves aligned buffers out of one allocation. With base NULL it only measures.
typedef struct { char *base; size_t used; } Arena;

static void *arena_take(Arena *a, size_t bytes) {
    size_t offset = (a->used + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES;
    a->used = offset + bytes;
    return a->base ? a->base + offset : NULL;
}
#define TAKE(arena, ptr, count) ((ptr) = (decltype(ptr))arena_take((arena), (size_t)(count) * sizeof(*(ptr))))

// Sequence parallelism: U·R ranks share an image; Ulysses' heads per rank and the ring's shard.
static int sp_size(const DitGpu *m) { return m->sp.ulysses * m->sp.ring; }
static int heads_here(const DitGpu *m) { return m->cfg.heads / m->sp.ulysses; }
static int ring_shard_tokens(const DitGpu *m) { return m->tokens * m->sp.ulysses; }   // T / R
// Without sequence parallelism the attention writes its output straight into the projection's
// input (B, T, H·D) and reads its gradient from there (the *_merged_cuda calls): no head merge or
// split pass, no head-major copies of out and dout.
static bool attention_merged(const DitGpu *m) { return sp_size(m) == 1; }
// Sage's Hadamard rotation of q and k (before the attention) and of their gradients (after it).
static bool sage_rotates(const DitGpu *m) { return m->attention == DIT_ATTN_SAGE && m->sage.rotate; }

// The Ulysses pipeline's groups for a batch of B: G = head_groups (at most the B·H/U pairs), and
// group g's (b, head) pairs first .. first + count of the flattened b·H/U + h' (sizes differ by
// at most one).
static int head_groups_for(const DitGpu *m, int B) {
    int pairs = B * heads_here(m);
    return m->head_groups < pairs ? m->head_groups : pairs;
}
static void group_pairs(int pairs, int G, int g, int *first, int *count) {
    *first = (int)((long long)g * pairs / G);
    *count = (int)((long long)(g + 1) * pairs / G) - *first;
}
// The most pairs a group of a batch up to m->batch has: ceil(batch·H/U / G).
static int group_capacity(const DitGpu *m) {
    return (m->batch * heads_here(m) + m->head_groups - 1) / m->head_groups;
}

// The attention workspace of one block's forward (read by its backward; flash needs none) and
// of the backward, for the attention this rank runs: H/U heads over all T tokens, as B·H/U
// pairs, or for the head groups (B = 1, H = pairs) G forward regions of group_capacity pairs
// each and one backward region per compute stream (two when G > 1). The ring (R > 1) allocates
// its own, stream-ordered.
static size_t attention_forward_workspace_bytes(const DitGpu *m, int B) {
    int D = m->cfg.hidden / m->cfg.heads, T = dit_tokens(&m->cfg);
    if (m->sp.ring > 1 || m->attention != DIT_ATTN_SAGE) return 0;
    if (m->sp.ulysses == 1) return sage_cuda_forward_workspace_size(B, heads_here(m), T, D, m->sage.pv);
    size_t region = sage_cuda_forward_workspace_size(1, group_capacity(m), T, D, m->sage.pv);
    return (size_t)m->head_groups * ((region + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES);
}
static size_t attention_backward_workspace_bytes(const DitGpu *m, int B) {
    int H = heads_here(m), D = m->cfg.hidden / m->cfg.heads, T = dit_tokens(&m->cfg);
    if (m->sp.ring > 1) return 0;
    if (m->sp.ulysses > 1) {   // one group at a time on each compute stream
        B = 1;
        H = group_capacity(m);
    }
    size_t region = m->attention == DIT_ATTN_SAGE ? sage_cuda_backward_workspace_size(B, H, T, D)
                                                  : flash_cuda_backward_workspace_size(B, H, T, D);
    return (region + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES;
}

// Lays out the activations, their gradients, the workspaces and the batch (as dit.c's
// activation_views, plus what the GPU adds); returns the bytes.
static size_t activation_layout(DitGpu *m, char *base) {
    const DitConfig *c = &m->cfg;
    size_t B = m->batch, h = c->hidden, L = c->depth, T = m->tokens, BT = B * T;
    size_t P = dit_patch_dim(c), img = B * c->channels * c->image_size * c->image_size;
    Arena arena = {base, 0}, *ar = &arena;
    DitGpuActivations *a = &m->acts;
    DitGpuGradActs *g = &m->grad_acts;
    TAKE(ar, a->x0, img); TAKE(ar, a->noise, img); TAKE(ar, a->v_target, img);
    TAKE(ar, a->t, B); TAKE(ar, a->labels, B); TAKE(ar, a->x_t, img);
    TAKE(ar, a->patches, BT * P); TAKE(ar, a->t_freq, B * TIMESTEP_FREQ_DIM);
    TAKE(ar, a->t_h, B * h); TAKE(ar, a->t_h_silu, B * h); TAKE(ar, a->t_emb, B * h);
    TAKE(ar, a->y_emb, B * h); TAKE(ar, a->c, B * h); TAKE(ar, a->c_silu, B * h);
    TAKE(ar, a->ada, B * L * 6 * h);
    TAKE(ar, a->residual, (L + 1) * BT * h);
    TAKE(ar, a->ln1, L * BT * h); TAKE(ar, a->ln1_mean, L * BT); TAKE(ar, a->ln1_rstd, L * BT);
    TAKE(ar, a->qkv, L * BT * 3 * h);
    TAKE(ar, a->q, L * BT * h); TAKE(ar, a->k, L * BT * h); TAKE(ar, a->v, L * BT * h);   // equal steps
    if (!attention_merged(m)) TAKE(ar, a->att, L * BT * h);   // head-major out: sequence parallel only
    TAKE(ar, a->att_lse, L * BT * c->heads);
    a->att_workspace = arena_take(ar, L * m->att_workspace_bytes);
    TAKE(ar, a->att_merged, L * BT * h); TAKE(ar, a->proj, L * BT * h); TAKE(ar, a->x_mid, L * BT * h);
    TAKE(ar, a->ln2, L * BT * h); TAKE(ar, a->ln2_mean, L * BT); TAKE(ar, a->ln2_rstd, L * BT);
    TAKE(ar, a->fc1, L * BT * 4 * h); TAKE(ar, a->fc2, L * BT * h);
    TAKE(ar, a->gelu, (m->linear == DIT_LINEAR_FP8 ? 1 : L) * BT * 4 * h);   // (gelu_block)
    TAKE(ar, a->final_ada, B * 2 * h);
    TAKE(ar, a->lnf, BT * h); TAKE(ar, a->lnf_mean, BT); TAKE(ar, a->lnf_rstd, BT);
    TAKE(ar, a->out_tokens, BT * P); TAKE(ar, a->out, img); TAKE(ar, a->out_float, img);
    TAKE(ar, a->loss, 1); TAKE(ar, a->grad_sumsq, 1); TAKE(ar, a->grad_norm, 1);
    TAKE(ar, m->step_constants, 1);
    TAKE(ar, m->pos_embed, (size_t)dit_tokens(c) * h);
    // gradients: the non-block ones, then one block's (accumulated ones contiguous)
    TAKE(ar, g->out, img); TAKE(ar, g->residual, BT * h); TAKE(ar, g->out_tokens, BT * P);
    TAKE(ar, g->lnf, BT * h); TAKE(ar, g->c_silu, B * h); TAKE(ar, g->c, B * h);
    TAKE(ar, g->t_h_silu, B * h); TAKE(ar, g->t_h, B * h);
    TAKE(ar, g->final_ada, B * 2 * h); TAKE(ar, g->ada, B * L * 6 * h);
    TAKE(ar, g->final_ada_bf16, B * 2 * h); TAKE(ar, g->ada_bf16, B * L * 6 * h);
    TAKE(ar, g->fc2, BT * h); TAKE(ar, g->ln2, BT * h); TAKE(ar, g->proj, BT * h);
    TAKE(ar, g->att_merged, BT * h);
    // head-major dout, sequence parallel only (zeroed before each block's backward:
    // merge_heads_backward adds into it)
    if (!attention_merged(m)) TAKE(ar, g->att, BT * h);
    TAKE(ar, g->ln1, BT * h);
    TAKE(ar, g->fc1, BT * 4 * h); TAKE(ar, g->qkv, BT * 3 * h);
    TAKE(ar, g->dq, BT * h);
    if (!attention_merged(m)) {   // merged: dk and dv go straight into g->qkv
        TAKE(ar, g->dk, BT * h); TAKE(ar, g->dv, BT * h);
    }
    g->att_workspace = arena_take(ar, (m->head_groups > 1 ? 2 : 1) * attention_backward_workspace_bytes(m, m->batch));
    if (m->linear == DIT_LINEAR_FP8) {   // (bf16: none of it, the layout of before)
        size_t Mp = fp8_padded_rows((int)BT), first;
        m->fp8_workspace = arena_take(ar, m->fp8_workspace_bytes);
        first = arena.used;
        TAKE(ar, a->ln1_fp8t, L * h * Mp); TAKE(ar, a->att_merged_fp8t, L * h * Mp);
        TAKE(ar, a->ln2_fp8t, L * h * Mp); TAKE(ar, a->gelu_fp8t, L * 4 * h * Mp);
        TAKE(ar, a->fp8_scales, 2 * L * 4 * FP8_SCALE_SLOT);   // the inputs', then the weights'
        TAKE(ar, a->weight_fp8t, L * 12 * h * h);
        TAKE(ar, a->fp8_amax, 3 * L * 4);
        TAKE(ar, a->fp8_guess, L * FP8_GUESSES * 2);
        m->fp8_saved_bytes = arena.used - first;
    }
    // sequence parallelism
    DitGpuSeqBuffers *sb = &m->sp_bufs;
    if (sp_size(m) > 1) {
        TAKE(ar, sb->tokens_full, B * dit_tokens(c) * P); TAKE(ar, sb->tokens_gather, BT * P * sp_size(m));
    }
    if (m->sp.ulysses > 1) {
        TAKE(ar, sb->q_local, BT * h); TAKE(ar, sb->k_local, BT * h); TAKE(ar, sb->v_local, BT * h);   // equal steps
        TAKE(ar, sb->att_local, BT * h); TAKE(ar, sb->dout_heads, BT * h);
        TAKE(ar, sb->dq_heads, BT * h); TAKE(ar, sb->dk_heads, BT * h); TAKE(ar, sb->dv_heads, BT * h);
        TAKE(ar, sb->dqkv_heads, 3 * BT * h); TAKE(ar, sb->dqkv_local, 3 * BT * h);
    }
    if (m->sp.ring > 1 && m->attention == DIT_ATTN_SAGE) {
        size_t stats = L * B * heads_here(m) * (h / c->heads);
        TAKE(ar, sb->k_mean, stats); TAKE(ar, sb->v_scale, stats);
    }
    return arena.used;
}

// bf16 views of a bf16 buffer laid out as the fp32 one whose views are f (base fbase).
static void bf16_views(const DitParams *f, const float *fbase, bf16 *base, DitGpuWeights *w) {
    const float *src[DIT_NUM_PARAM_TENSORS] = {
        f->patch_w, f->patch_b, f->t_w1, f->t_b1, f->t_w2, f->t_b2, f->y_table,
        f->ada_w, f->ada_b, f->qkv_w, f->qkv_b, f->proj_w, f->proj_b,
        f->fc1_w, f->fc1_b, f->fc2_w, f->fc2_b, f->final_ada_w, f->final_ada_b, f->final_w, f->final_b,
    };
    bf16 **dst[DIT_NUM_PARAM_TENSORS] = {
        &w->patch_w, &w->patch_b, &w->t_w1, &w->t_b1, &w->t_w2, &w->t_b2, &w->y_table,
        &w->ada_w, &w->ada_b, &w->qkv_w, &w->qkv_b, &w->proj_w, &w->proj_b,
        &w->fc1_w, &w->fc1_b, &w->fc2_w, &w->fc2_b, &w->final_ada_w, &w->final_ada_b, &w->final_w, &w->final_b,
    };
    for (int i = 0; i < DIT_NUM_PARAM_TENSORS; i++) *dst[i] = base + (src[i] - fbase);
}

// The largest scratch any linear backward's bias gradient needs (M = B·T or B rows).
static size_t linear_scratch_floats(const DitConfig *c, int B, int T) {
    size_t BT = (size_t)B * T, h = c->hidden, most = 0;
    size_t need[] = {
        linear_backward_scratch_floats((int)BT, 4 * h), linear_backward_scratch_floats((int)BT, 3 * h),
        linear_backward_scratch_floats((int)BT, dit_patch_dim(c)),
        linear_backward_scratch_floats(B, c->depth * 6 * h), linear_backward_scratch_floats(B, 2 * h),
        modulation_backward_scratch_floats(B, T, h),
    };
    for (size_t i = 0; i < sizeof(need) / sizeof(need[0]); i++) most = need[i] > most ? need[i] : most;
    return most;
}

// The sequence-parallel configuration against the model: sizes that divide, communicators present.
static int check_sequence_parallel(const DitConfig *cfg, DitAttention attention, const DitGpuSeqParallel *sp,
                                   char *err) {
    int U = sp->ulysses, R = sp->ring, T = dit_tokens(cfg);
#ifndef DIT_NCCL
    if (U * R > 1) {
        dit_set_error(err, "dit_gpu_create_sp: sequence parallelism (U=%d, R=%d) needs NCCL, and this build has "
                           "none (the Makefile found no nccl.h)", U, R);
        return -1;
    }
#endif
    if (U < 1 || R < 1 || sp->ulysses_rank < 0 || sp->ulysses_rank >= U || sp->ring_rank < 0 || sp->ring_rank >= R) {
        dit_set_error(err, "dit_gpu_create_sp: need U, R >= 1 and ranks inside them (U=%d rank %d, R=%d rank %d)",
                      U, sp->ulysses_rank, R, sp->ring_rank);
        return -1;
    }
    if (cfg->heads % U) {
        dit_set_error(err, "dit_gpu_create_sp: %d heads do not split over --sp-ulysses %d ranks (heads %% U != 0)",
                      cfg->heads, U);
        return -1;
    }
    if (T % (U * R)) {
        dit_set_error(err, "dit_gpu_create_sp: %d tokens ((image %d / patch %d)^2) do not split over U·R = %d ranks",
                      T, cfg->image_size, cfg->patch, U * R);
        return -1;
    }
    if (R > 1 && attention != DIT_ATTN_EXACT && (T / R) % SAGE_CUDA_BLOCK) {
        dit_set_error(err, "dit_gpu_create_sp: sage under ring needs shards of T/R tokens that are a multiple of "
                           "%d (T = %d, R = %d: %d)", SAGE_CUDA_BLOCK, T, R, T / R);
        return -1;
    }
    if (sp->head_groups < 0 || sp->head_groups > DIT_MAX_HEAD_GROUPS) {
        dit_set_error(err, "dit_gpu_create_sp: head_groups %d outside 0..%d (0: the default %d)", sp->head_groups,
                      DIT_MAX_HEAD_GROUPS, DIT_ULYSSES_HEAD_GROUPS);
        return -1;
    }
    if ((U * R > 1 && !sp->sp_comm) || (U > 1 && !sp->ulysses_comm) || (R > 1 && !sp->ring_comm)) {
        dit_set_error(err, "dit_gpu_create_sp: a communicator is missing (U=%d R=%d: sequence-parallel %s, Ulysses "
                           "%s, ring %s)", U, R, sp->sp_comm ? "set" : "NULL", sp->ulysses_comm ? "set" : "NULL",
                      sp->ring_comm ? "set" : "NULL");
        return -1;
    }
    return 0;
}

// Ulysses' group_stream, at the highest priority (its NCCL kernels take SMs as soon as the
// attention's blocks free them), odd_stream, and the events that order them against the model
// stream.
static int create_group_stream(DitGpu *m, char *err) {
    int least, greatest;
    CUDA_CHECK(err, cudaDeviceGetStreamPriorityRange(&least, &greatest), "dit_gpu_create_sp: stream priorities");
    CUDA_CHECK(err, cudaStreamCreateWithPriority(&m->group_stream, cudaStreamNonBlocking, greatest),
               "dit_gpu_create_sp: the Ulysses all-to-all stream (priority %d)", greatest);
    CUDA_CHECK(err, cudaStreamCreateWithFlags(&m->odd_stream, cudaStreamNonBlocking),
               "dit_gpu_create_sp: the stream of the odd head groups' attention");
    for (int i = 0; i < 2 * DIT_MAX_HEAD_GROUPS + 1; i++)
        CUDA_CHECK(err, cudaEventCreateWithFlags(&m->group_events[i], cudaEventDisableTiming),
                   "dit_gpu_create_sp: event %d of the Ulysses pipeline", i);
    return 0;
}

// ZeRO-1 over several shards: the reduction stream at the highest priority (as Ulysses'
// group_stream: the backward's grids would otherwise hold the SMs its NCCL kernels need) and the
// events that order it against the model stream.
static int create_reduce_stream(DitGpu *m, char *err) {
    int least, greatest, L = m->cfg.depth;
    CUDA_CHECK(err, cudaDeviceGetStreamPriorityRange(&least, &greatest), "dit_gpu_create_sp: stream priorities");
    CUDA_CHECK(err, cudaStreamCreateWithPriority(&m->reduce_stream, cudaStreamNonBlocking, greatest),
               "dit_gpu_create_sp: the gradients' reduction stream (priority %d)", greatest);
    m->block_grads_done = (cudaEvent_t *)calloc(L, sizeof(cudaEvent_t));
    if (!m->block_grads_done) {
        dit_set_error(err, "dit_gpu_create_sp: out of host memory for %d events", L);
        return -1;
    }
    for (int l = 0; l < L; l++)
        CUDA_CHECK(err, cudaEventCreateWithFlags(&m->block_grads_done[l], cudaEventDisableTiming),
                   "dit_gpu_create_sp: the event of block %d's gradients", l);
    CUDA_CHECK(err, cudaEventCreateWithFlags(&m->grads_ready, cudaEventDisableTiming),
               "dit_gpu_create_sp: the event of the backward's end");
    CUDA_CHECK(err, cudaEventCreateWithFlags(&m->grads_reduced, cudaEventDisableTiming),
               "dit_gpu_create_sp: the event of the reduction's end");
    return 0;
}

// FP8 block linears: an sm_89+ GPU; *workspace_bytes: what the largest of qkv, proj, fc1, fc2
// needs at the full batch. Any M = B·tokens works (the layer pads its transposed copies); IC and
// OC (h, 3h, 4h) are multiples of 16, as the layer needs, since h = heads·64 or heads·128.
static int check_fp8_linear(const DitConfig *cfg, int tokens, int batch, size_t *workspace_bytes, char *err) {
    int h = cfg->hidden, M = batch * tokens, device, major = 0, minor = 0;
    CUDA_CHECK(err, cudaGetDevice(&device), "dit_gpu_create: the current device");
    CUDA_CHECK(err, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
               "device %d's compute capability", device);
    CUDA_CHECK(err, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
               "device %d's compute capability", device);
    if (major * 10 + minor < 89) {
        dit_set_error(err, "dit_gpu_create: FP8 linears need an sm_89 or newer GPU (device %d is sm_%d%d)", device,
                      major, minor);
        return -1;
    }
    int shapes[4][2] = {{h, 3 * h}, {h, h}, {h, 4 * h}, {4 * h, h}};   // (IC, OC) of qkv, proj, fc1, fc2
    *workspace_bytes = 0;
    for (int i = 0; i < 4; i++) {
        size_t need = linear_fp8_workspace_bytes(M, shapes[i][0], shapes[i][1]);
        *workspace_bytes = need > *workspace_bytes ? need : *workspace_bytes;
    }
    return 0;
}

int dit_gpu_create(DitGpu *m, const DitConfig *cfg, int batch, DitAttention attention, char *err) {
    return dit_gpu_create_sp(m, cfg, batch, attention, DIT_LINEAR_BF16, NULL, err);
}

int dit_gpu_create_sp(DitGpu *m, const DitConfig *cfg, int batch, DitAttention attention, DitLinear linear,
                      const DitGpuSeqParallel *sp, char *err) {
    memset(m, 0, sizeof(*m));
    TRY(dit_config_validate(cfg, err));
    DitGpuSeqParallel one = {.ulysses = 1, .ring = 1};
    if (!sp) sp = &one;
    TRY(check_sequence_parallel(cfg, attention, sp, err));
    int shards = sp->optimizer_shards > 1 ? sp->optimizer_shards : 1;
    if (sp->optimizer_rank < 0 || sp->optimizer_rank >= shards) {
        dit_set_error(err, "dit_gpu_create_sp: optimizer_rank %d outside the %d optimizer shards", sp->optimizer_rank,
                      shards);
        return -1;
    }
    int D = cfg->hidden / cfg->heads;
    if (attention != DIT_ATTN_SAGE && attention != DIT_ATTN_SAGE_FP16 && attention != DIT_ATTN_EXACT) {
        dit_set_error(err, "dit_gpu_create: unknown attention %d (expected DIT_ATTN_EXACT, DIT_ATTN_SAGE or "
                      "DIT_ATTN_SAGE_FP16)", (int)attention);
        return -1;
    }
    if (D != 64 && D != 128) {
        dit_set_error(err, "dit_gpu_create: the GPU attention needs head dim 64 or 128, got hidden %d / heads %d = %d",
                      cfg->hidden, cfg->heads, D);
        return -1;
    }
    if (cfg->hidden % 8 != 0 || cfg->hidden > 4096 || batch <= 0) {
        dit_set_error(err, "dit_gpu_create: need hidden a multiple of 8 (cuBLASLt GELU epilogues) and at most 4096 "
                      "(the LayerNorm kernels keep a row in one warp's registers), and batch > 0 (hidden %d, "
                      "batch %d)", cfg->hidden, batch);
        return -1;
    }
    if (linear != DIT_LINEAR_BF16 && linear != DIT_LINEAR_FP8) {
        dit_set_error(err, "dit_gpu_create: unknown linear kind %d (expected DIT_LINEAR_BF16 or DIT_LINEAR_FP8)",
                      (int)linear);
        return -1;
    }
    m->cfg = *cfg;
    m->sp = *sp;
    m->tokens = dit_tokens(cfg) / sp_size(m);
    m->linear = linear;
    if (linear == DIT_LINEAR_FP8) TRY(check_fp8_linear(cfg, m->tokens, batch, &m->fp8_workspace_bytes, err));
    m->fp8_fused_inputs = linear == DIT_LINEAR_FP8;
    m->fp8_grad_headroom = DIT_FP8_GRAD_HEADROOM;
    m->token_offset = (sp->ring_rank * sp->ulysses + sp->ulysses_rank) * m->tokens;
    m->batch = batch;
    m->attention = attention == DIT_ATTN_SAGE_FP16 ? DIT_ATTN_SAGE : attention;
    m->sage = SAGE_CONFIG_DEFAULT;   // the P·V format sizes the attention workspaces below
    if (attention == DIT_ATTN_SAGE_FP16) m->sage.pv = SAGE_PV_FP16;
    m->num_params = dit_num_params(cfg);
    m->head_groups = 1;
    if (sp->ulysses > 1 && sp->ring == 1) {
        int pairs = batch * heads_here(m), G = sp->head_groups ? sp->head_groups : DIT_ULYSSES_HEAD_GROUPS;
        m->head_groups = G < pairs ? G : pairs;
    }
    m->shards = shards;
    m->shard_rank = sp->optimizer_rank;
    m->shard_size = ((m->num_params + shards - 1) / shards + SHARD_ALIGN - 1) / SHARD_ALIGN * SHARD_ALIGN;
    m->att_workspace_bytes = attention_forward_workspace_bytes(m, batch);
    m->att_workspace_bytes = (m->att_workspace_bytes + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES;

    // parameter-sized buffers: 5 fp32 + 2 bf16 copies, each padded to the shards
    size_t n = m->shard_size * shards, fbytes = (n * sizeof(float) + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES;
    size_t hbytes = (n * sizeof(bf16) + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES;
    m->params_bytes = 5 * fbytes + 2 * hbytes;
    m->acts_bytes = activation_layout(m, NULL);
    CUDA_CHECK(err, cudaStreamCreate(&m->stream), "the model's stream");
    if (sp->ring * sp->ulysses > 1 && cudaStreamCreateWithFlags(&m->comm_stream, cudaStreamNonBlocking) != cudaSuccess) {
        dit_set_error(err, "dit_gpu_create_sp: the sequence-parallel communication stream: %s",
                      cudaGetErrorString(cudaGetLastError()));
        dit_gpu_free(m);
        return -1;
    }
    if (sp->ulysses > 1 && create_group_stream(m, err) != 0) { dit_gpu_free(m); return -1; }
    if (shards > 1 && sp->zero_overlap && create_reduce_stream(m, err) != 0) { dit_gpu_free(m); return -1; }
    if (layers_cuda_create(&m->ctx, linear_scratch_floats(cfg, batch, m->tokens), err) != 0) { dit_gpu_free(m); return -1; }
    m->ctx.fp8_accumulation = DIT_FP8_ACCUMULATION;
    if (cudaMalloc(&m->params_alloc, m->params_bytes) != cudaSuccess ||
        cudaMalloc(&m->acts_alloc, m->acts_bytes) != cudaSuccess) {
        dit_set_error(err, "dit_gpu_create: cudaMalloc failed: %s (parameters %.1f MiB, activations %.1f MiB "
                      "for batch %d)", cudaGetErrorString(cudaGetLastError()), m->params_bytes / 1048576.0,
                      m->acts_bytes / 1048576.0, batch);
        dit_gpu_free(m);
        return -1;
    }
    if (cudaMemset(m->params_alloc, 0, m->params_bytes) != cudaSuccess) {
        dit_set_error(err, "dit_gpu_create: zeroing the parameter buffers (and their padding): %s",
                      cudaGetErrorString(cudaGetLastError()));
        dit_gpu_free(m);
        return -1;
    }
    char *p = (char *)m->params_alloc;
    m->params_memory = (float *)p;
    m->grads_memory = (float *)(p + fbytes);
    m->adam_m_memory = (float *)(p + 2 * fbytes);
    m->adam_v_memory = (float *)(p + 3 * fbytes);
    m->ema_memory = (float *)(p + 4 * fbytes);
    m->params_bf16_memory = (bf16 *)(p + 5 * fbytes);
    m->ema_bf16_memory = (bf16 *)(p + 5 * fbytes + hbytes);
    dit_param_views(cfg, m->params_memory, &m->params);
    dit_param_views(cfg, m->grads_memory, &m->grads);
    bf16_views(&m->params, m->params_memory, m->params_bf16_memory, &m->weights);
    bf16_views(&m->params, m->params_memory, m->ema_bf16_memory, &m->ema_weights);
    activation_layout(m, (char *)m->acts_alloc);
    // the FP8 exponent guesses start at 0 (any value is correct: a wrong guess costs a second pass)
    if (m->acts.fp8_guess &&
        cudaMemset(m->acts.fp8_guess, 0, (size_t)cfg->depth * FP8_GUESSES * 2 * sizeof(int)) != cudaSuccess) {
        dit_set_error(err, "dit_gpu_create: zeroing the FP8 exponent guesses: %s",
                      cudaGetErrorString(cudaGetLastError()));
        dit_gpu_free(m);
        return -1;
    }
    if (cudaMallocHost(&m->step_constants_host, 2 * sizeof(OptimizerStepConstants)) != cudaSuccess ||
        cudaEventCreateWithFlags(&m->step_copied[0], cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&m->step_copied[1], cudaEventDisableTiming) != cudaSuccess) {
        dit_set_error(err, "dit_gpu_create: the pinned step constants (cudaMallocHost) or their events "
                           "(cudaEventCreateWithFlags): %s", cudaGetErrorString(cudaGetLastError()));
        dit_gpu_free(m);
        return -1;
    }
    if (pos_embed_2d_cuda(m->pos_embed, cfg->image_size / cfg->patch, cfg->hidden, m->stream, err) != 0) {
        dit_gpu_free(m);
        return -1;
    }
    return 0;
}

// Destroys the step's CUDA graph, if any (dit_gpu_train_step_graph).
static int drop_step_graph(DitGpu *m, char *err) {
    DitGpuStepGraph *sg = &m->step_graph;
    if (sg->exec) CUDA_CHECK(err, cudaGraphExecDestroy(sg->exec), "cudaGraphExecDestroy of the step's graph");
    sg->exec = NULL;
    if (sg->graph) CUDA_CHECK(err, cudaGraphDestroy(sg->graph), "cudaGraphDestroy of the step's graph");
    sg->graph = NULL;
    return 0;
}

void dit_gpu_free(DitGpu *m) {
    char err[DIT_ERR_LEN];
    if (m->stream) cudaStreamSynchronize(m->stream);
    if (drop_step_graph(m, err) != 0) fprintf(stderr, "dit_gpu_free: %s\n", err);
    cudaFreeHost(m->step_constants_host);
    for (int i = 0; i < 2; i++)
        if (m->step_copied[i]) cudaEventDestroy(m->step_copied[i]);
    cudaFree(m->params_alloc);
    cudaFree(m->acts_alloc);
    layers_cuda_destroy(&m->ctx);
    if (m->stream) cudaStreamDestroy(m->stream);
    if (m->comm_stream) cudaStreamDestroy(m->comm_stream);
    if (m->group_stream) cudaStreamDestroy(m->group_stream);
    if (m->odd_stream) cudaStreamDestroy(m->odd_stream);
    for (int i = 0; i < 2 * DIT_MAX_HEAD_GROUPS + 1; i++)
        if (m->group_events[i]) cudaEventDestroy(m->group_events[i]);
    if (m->reduce_stream) cudaStreamDestroy(m->reduce_stream);
    for (int l = 0; m->block_grads_done && l < m->cfg.depth; l++)
        if (m->block_grads_done[l]) cudaEventDestroy(m->block_grads_done[l]);
    free(m->block_grads_done);
    if (m->grads_ready) cudaEventDestroy(m->grads_ready);
    if (m->grads_reduced) cudaEventDestroy(m->grads_reduced);
    memset(m, 0, sizeof(*m));
}

void dit_gpu_memory_plan(const DitGpu *m, size_t *params_bytes, size_t *acts_bytes, size_t *ctx_bytes) {
    *params_bytes = m->params_bytes;
    *acts_bytes = m->acts_bytes;
    *ctx_bytes = m->ctx.lt_workspace_bytes + m->ctx.scratch_floats * sizeof(float);
}

// ---- host <-> device ---------------------------------------------------------------------

static int check_same_config(const DitGpu *m, const Dit *cpu, const char *what, char *err) {
    if (memcmp(&m->cfg, &cpu->cfg, sizeof(DitConfig)) != 0 || cpu->num_params != m->num_params) {
        dit_set_error(err, "%s: the CPU model's config differs from the GPU model's (%zu vs %zu parameters)",
                      what, cpu->num_params, m->num_params);
        return -1;
    }
    return 0;
}

int dit_gpu_upload(DitGpu *m, const Dit *cpu, char *err) {
    TRY(check_same_config(m, cpu, "dit_gpu_upload", err));
    size_t bytes = m->num_params * sizeof(float);
    const float *src[4] = {cpu->params_memory, cpu->ema_memory, cpu->adam_m_memory, cpu->adam_v_memory};
    float *dst[4] = {m->params_memory, m->ema_memory, m->adam_m_memory, m->adam_v_memory};
    for (int i = 0; i < 4; i++)
        CUDA_CHECK(err, cudaMemcpyAsync(dst[i], src[i], bytes, cudaMemcpyHostToDevice, m->stream),
                   "upload of parameter buffer %d (%zu bytes)", i, bytes);
    TRY(cast_float_to_bf16_cuda(m->params_bf16_memory, m->params_memory, m->num_params, m->stream, err));
    CUDA_CHECK(err, cudaStreamSynchronize(m->stream), "after the upload of %zu parameters", m->num_params);
    return 0;
}

int dit_gpu_download(DitGpu *m, Dit *cpu, char *err) {
    TRY(check_same_config(m, cpu, "dit_gpu_download", err));
    size_t bytes = m->num_params * sizeof(float);
    const float *src[4] = {m->params_memory, m->ema_memory, m->adam_m_memory, m->adam_v_memory};
    float *dst[4] = {cpu->params_memory, cpu->ema_memory, cpu->adam_m_memory, cpu->adam_v_memory};
    for (int i = 0; i < 4; i++)
        CUDA_CHECK(err, cudaMemcpyAsync(dst[i], src[i], bytes, cudaMemcpyDeviceToHost, m->stream),
                   "download of parameter buffer %d (%zu bytes)", i, bytes);
    CUDA_CHECK(err, cudaStreamSynchronize(m->stream), "after the download of %zu parameters", m->num_params);
    return 0;
}

static int check_batch(const DitGpu *m, int B, const char *what, char *err) {
    if (B < 1 || B > m->batch) {
        dit_set_error(err, "%s: batch %d outside 1..%d (the batch the model was created for)", what, B, m->batch);
        return -1;
    }
    return 0;
}

static int upload_t_labels(DitGpu *m, const float *t, const int *labels, int B, char *err) {
    CUDA_CHECK(err, cudaMemcpyAsync(m->acts.t, t, B * sizeof(float), cudaMemcpyHostToDevice, m->stream),
               "upload of %d times", B);
    CUDA_CHECK(err, cudaMemcpyAsync(m->acts.labels, labels, B * sizeof(int), cudaMemcpyHostToDevice, m->stream),
               "upload of %d labels", B);
    return 0;
}

static size_t image_floats(const DitConfig *c, int B) { return (size_t)B * c->channels * c->image_size * c->image_size; }

int dit_gpu_set_inputs(DitGpu *m, const float *x_t, const float *t, const int *labels, int B, char *err) {
    TRY(check_batch(m, B, "dit_gpu_set_inputs", err));
    size_t n = image_floats(&m->cfg, B);
    CUDA_CHECK(err, cudaMemcpyAsync(m->acts.x0, x_t, n * sizeof(float), cudaMemcpyHostToDevice, m->stream),
               "upload of x_t (%zu floats)", n);
    TRY(cast_float_to_bf16_cuda(m->acts.x_t, m->acts.x0, n, m->stream, err));
    return upload_t_labels(m, t, labels, B, err);
}

int dit_gpu_set_flow_batch(DitGpu *m, const float *x0, const float *noise, const float *t,
                           const int *labels, int B, char *err) {
    TRY(check_batch(m, B, "dit_gpu_set_flow_batch", err));
    size_t n = image_floats(&m->cfg, B);
    CUDA_CHECK(err, cudaMemcpyAsync(m->acts.x0, x0, n * sizeof(float), cudaMemcpyHostToDevice, m->stream),
               "upload of x0 (%zu floats)", n);
    CUDA_CHECK(err, cudaMemcpyAsync(m->acts.noise, noise, n * sizeof(float), cudaMemcpyHostToDevice, m->stream),
               "upload of the noise (%zu floats)", n);
    TRY(upload_t_labels(m, t, labels, B, err));
    return flow_matching_inputs_cuda(m->acts.x_t, m->acts.v_target, m->acts.x0, m->acts.noise, m->acts.t,
                                     B, (int)(n / B), m->stream, err);
}

// ---- sequence-parallel communication ------------------------------------------------------
// One-rank views of this rank's groups for attention/sequence_parallel_cuda.h, and the moves of
// the model between its token shard and the attention's layout. Without NCCL nothing here is
// reached (dit_gpu_create_sp refuses U·R > 1); the functions then only report that.

#ifdef DIT_NCCL
typedef struct { int rank, device; ncclComm_t comm; SpCudaComm c; } SpView;

// ring = 0: the Ulysses group (U ranks), 1: the ring group (R ranks).
static void sp_view(const DitGpu *m, int ring, SpView *v) {
    v->rank = ring ? m->sp.ring_rank : m->sp.ulysses_rank;
    v->comm = ring ? m->sp.ring_comm : m->sp.ulysses_comm;
    if (cudaGetDevice(&v->device) != cudaSuccess) v->device = 0;
    v->c = (SpCudaComm){.ranks = ring ? m->sp.ring : m->sp.ulysses, .n_local = 1, .rank = &v->rank,
                        .device = &v->device, .comm = &v->comm, .stream = &m->stream,
                        .comm_stream = &m->comm_stream};
}

// Ulysses on group_stream (own runs copied on comm_stream): the (b, head) pairs first .. first +
// count of `tensors` bf16 tensors (steps apart, in bytes) to dst (B, H/U, T/R, D) head-sharded
// from this rank's src (B, H, T/(U·R), D), or back (to_heads 0).
static int ulysses_runs(const DitGpu *m, bf16 *dst, const bf16 *src, int tensors, size_t dst_step, size_t src_step,
                        int to_heads, int B, int first, int count, char *err) {
    SpView v;
    sp_view(m, 0, &v);
    v.c.stream = &m->group_stream;
    int H = m->cfg.heads, D = m->cfg.hidden / H, N = ring_shard_tokens(m);
    void *d = dst;
    const void *s = src;
    return ulysses_all_to_all_runs_cuda(&v.c, &d, &s, tensors, dst_step, src_step, B, H, N, D, sizeof(bf16), first,
                                        count, !to_heads, err);
}

// Ring attention over the ring group on H/U heads: forward (and for sage the global k_mean and
// v_scale of the layer's keys/values, kept for the backward) or backward.
static int ring_forward(DitGpu *m, uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k,
                        const uint16_t *v, float *k_mean, float *v_scale, int B, char *err) {
    SpView view;
    sp_view(m, 1, &view);
    int H = heads_here(m), D = m->cfg.hidden / m->cfg.heads, N = dit_tokens(&m->cfg);
    if (m->attention == DIT_ATTN_EXACT)
        return ring_attention_forward_cuda(&view.c, &out, &lse, &q, &k, &v, B, H, N, D, err);
    TRY(ring_sage_stats_cuda(&view.c, &k_mean, &v_scale, &k, &v, B, H, N, D, m->sage.pv, err));
    const float *km = k_mean, *vs = v_scale;
    return ring_sage_forward_cuda(&view.c, &out, &lse, &q, &k, &v, &km, &vs, B, H, N, D, m->sage.pv, err);
}

static int ring_backward(DitGpu *m, float *dq, float *dk, float *dv, const uint16_t *dout, const uint16_t *q,
                         const uint16_t *k, const uint16_t *v, const uint16_t *out, const float *lse,
                         const float *k_mean, const float *v_scale, int B, char *err) {
    SpView view;
    sp_view(m, 1, &view);
    int H = heads_here(m), D = m->cfg.hidden / m->cfg.heads, N = dit_tokens(&m->cfg);
    if (m->attention == DIT_ATTN_EXACT)
        return ring_attention_backward_cuda(&view.c, &dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse, B, H, N, D, err);
    return ring_sage_backward_cuda(&view.c, &dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse, &k_mean, &v_scale,
                                   B, H, N, D, m->sage.pv, err);
}

// tokens_full (B, T, P) = every rank's out_tokens (B, T/(U·R), P), all-gathered over the group.
static int gather_output_tokens(DitGpu *m, int B, char *err) {
    int S = sp_size(m), n = m->tokens, P = dit_patch_dim(&m->cfg);
    size_t chunk = (size_t)B * n * P, row = (size_t)n * P * sizeof(bf16);
    ncclResult_t r = ncclAllGather(m->acts.out_tokens, m->sp_bufs.tokens_gather, chunk * sizeof(bf16), ncclUint8,
                                   m->sp.sp_comm, m->stream);
    if (r != ncclSuccess) {
        dit_set_error(err, "gather_output_tokens: ncclAllGather of %zu bf16 per rank over %d ranks: %s", chunk, S,
                      ncclGetErrorString(r));
        return -1;
    }
    for (int p = 0; p < S; p++)
        CUDA_CHECK(err, cudaMemcpy2DAsync(m->sp_bufs.tokens_full + (size_t)p * n * P, (size_t)dit_tokens(&m->cfg) * P *
                                          sizeof(bf16), m->sp_bufs.tokens_gather + p * chunk, row, row, B,
                                          cudaMemcpyDeviceToDevice, m->stream),
                   "placing rank %d's output tokens", p);
    return 0;
}
#else
static int no_nccl(char *err) {
    dit_set_error(err, "sequence parallelism: this build has no NCCL");
    return -1;
}
static int ulysses_runs(const DitGpu *, bf16 *, const bf16 *, int, size_t, size_t, int, int, int, int, char *err) {
    return no_nccl(err);
}
static int ring_forward(DitGpu *, uint16_t *, float *, const uint16_t *, const uint16_t *, const uint16_t *, float *,
                        float *, int, char *err) { return no_nccl(err); }
static int ring_backward(DitGpu *, float *, float *, float *, const uint16_t *, const uint16_t *, const uint16_t *,
                         const uint16_t *, const uint16_t *, const float *, const float *, const float *, int,
                         char *err) { return no_nccl(err); }
static int gather_output_tokens(DitGpu *, int, char *err) { return no_nccl(err); }
#endif

// dst (B, n, P) = rows token_offset .. token_offset + n of each image's src (B, T, P): this
// rank's shard of a whole image's tokens.
static int take_token_shard(const DitGpu *m, bf16 *dst, const bf16 *src, int B, char *err) {
    int P = dit_patch_dim(&m->cfg);
    size_t row = (size_t)m->tokens * P * sizeof(bf16), pitch = (size_t)dit_tokens(&m->cfg) * P * sizeof(bf16);
    CUDA_CHECK(err, cudaMemcpy2DAsync(dst, row, src + (size_t)m->token_offset * P, pitch, row, B,
                                      cudaMemcpyDeviceToDevice, m->stream),
               "the token shard %d..%d of %d images", m->token_offset, m->token_offset + m->tokens, B);
    return 0;
}

// ---- attention: the one place that knows the kernel ----------------------------------------
// Block l's attention: att, lse from q, k, v; the forward may leave state for the backward in
// its workspace. Both kernels have the same shape (bf16 q, k, v, out; fp32 base-2 lse; fp32 dq,
// dk, dv written): sage (quantized) for DIT_ATTN_SAGE, and for DIT_ATTN_EXACT the bf16
// FlashAttention-2 kernel (exact attention computed in bf16). Shapes are this rank's part:
// (B, H/U, T/R, D) (Ulysses has already moved the heads); without ring the kernel sees all T
// tokens, with ring (R > 1) the ring functions run it over the R shards. A call covers the
// (b, head) pairs first .. first + count of the flattened b·H/U + h': all B·H/U of them as
// (B, H/U), or a group of them as B = 1, H = count (every kernel, sage's quantization and
// smoothing included, works per pair: the same bits either way).

// Head group g's stream (even groups on the model stream, odd ones on odd_stream: one group's
// kernels fill the SMs the other's last wave leaves idle), its forward workspace of block l and
// its backward workspace.
static cudaStream_t compute_stream(const DitGpu *m, int g) { return g % 2 ? m->odd_stream : m->stream; }
static void *forward_workspace(const DitGpu *m, int l, int g) {
    return (char *)m->acts.att_workspace + (size_t)l * m->att_workspace_bytes +
           (size_t)g * (m->att_workspace_bytes / m->head_groups);
}
static void *backward_workspace(const DitGpu *m, int g) {
    return (char *)m->grad_acts.att_workspace + (size_t)(g % 2) * attention_backward_workspace_bytes(m, m->batch);
}

// Group g's attention: the pairs first .. first + count (g = 0: all of them, or the first group).
static int attention_forward_gpu(DitGpu *m, int l, int B, int g, int first, int count, char *err) {
    int H = heads_here(m), D = m->cfg.hidden / m->cfg.heads, T = ring_shard_tokens(m);
    size_t blk = (size_t)B * m->tokens * m->cfg.hidden, stats = (size_t)B * H * D, pair = (size_t)T * D;
    int whole = first == 0 && count == B * H, Bc = whole ? B : 1, Hc = whole ? H : count;
    cudaStream_t stream = compute_stream(m, g);
    void *ws = forward_workspace(m, l, g);
    DitGpuActivations *a = &m->acts;
    float *lse = a->att_lse + (size_t)l * B * H * T + (size_t)first * T;
    const uint16_t *q = (const uint16_t *)(a->q + l * blk + first * pair);
    const uint16_t *k = (const uint16_t *)(a->k + l * blk + first * pair);
    const uint16_t *v = (const uint16_t *)(a->v + l * blk + first * pair);
    if (attention_merged(m))   // (whole: head groups are for Ulysses; flash only: sage_forward_from_qkv)
        return flash_forward_merged_cuda((uint16_t *)(a->att_merged + l * blk), lse, q, k, v, B, H, T, D, stream, err);
    uint16_t *out = (uint16_t *)(a->att + l * blk + first * pair);
    if (m->sp.ring > 1)   // (head_groups is 1 under ring: whole)
        return ring_forward(m, out, lse, q, k, v, m->sp_bufs.k_mean ? m->sp_bufs.k_mean + l * stats : NULL,
                            m->sp_bufs.v_scale ? m->sp_bufs.v_scale + l * stats : NULL, B, err);
    if (m->attention == DIT_ATTN_EXACT) return flash_forward_cuda(out, lse, q, k, v, Bc, Hc, T, D, stream, err);
    return sage_forward_cuda(out, lse, ws, q, k, v, Bc, Hc, T, D, m->sage.pv, stream, err);
}

// Without sequence parallelism, sage from the qkv projection's output: the head split (rotating q
// and k) and the quantization's statistics in one pass (sage_quantize_qkv_cuda; the same q, k, v as
// split_qkv), then the attention over the quantized workspace, its output into att_merged.
static int sage_forward_from_qkv(DitGpu *m, int l, const bf16 *qkv, int B, char *err) {
    int H = m->cfg.heads, D = m->cfg.hidden / H, T = m->tokens;
    size_t blk = (size_t)B * T * m->cfg.hidden;
    DitGpuActivations *a = &m->acts;
    void *ws = forward_workspace(m, l, 0);
    cudaStream_t stream = compute_stream(m, 0);
    TRY(sage_quantize_qkv_cuda(ws, (uint16_t *)(a->q + l * blk), (uint16_t *)(a->k + l * blk),
                               (uint16_t *)(a->v + l * blk), (const uint16_t *)qkv, sage_rotates(m), B, H, T, D,
                               m->sage.pv, stream, err));
    return sage_forward_quantized_merged_cuda((uint16_t *)(a->att_merged + l * blk), a->att_lse + (size_t)l * B * H * T,
                                              ws, B, H, T, D, m->sage.pv, stream, err);
}

// dq, dk, dv of the same pairs from dout (the layout of the forward's out: merged, or head-major;
// the pointers are the whole tensors'). Merged: dk (rotated back when sage rotates) and dv are
// written as bf16 into the k and v columns of dqkv (the qkv linear's input gradient, (B·T,
// 3·hidden)) with their amax raised into kv_amax (may be NULL), and dk, dv are not used (NULL).
static int attention_backward_gpu(DitGpu *m, int l, int B, int g, int first, int count, float *dq, float *dk,
                                  float *dv, bf16 *dqkv, float *kv_amax, const bf16 *dout, char *err) {
    int H = heads_here(m), D = m->cfg.hidden / m->cfg.heads, T = ring_shard_tokens(m);
    size_t blk = (size_t)B * m->tokens * m->cfg.hidden, stats = (size_t)B * H * D, pair = (size_t)T * D;
    int whole = first == 0 && count == B * H, Bc = whole ? B : 1, Hc = whole ? H : count;
    cudaStream_t stream = compute_stream(m, g);
    const void *fwd_ws = forward_workspace(m, l, g);
    void *ws = backward_workspace(m, g);
    DitGpuActivations *a = &m->acts;
    size_t at = l * blk + first * pair;
    const uint16_t *q = (const uint16_t *)(a->q + at), *k = (const uint16_t *)(a->k + at);
    const uint16_t *v = (const uint16_t *)(a->v + at);
    const uint16_t *out = (const uint16_t *)(attention_merged(m) ? a->att_merged + l * blk : a->att + at);
    const uint16_t *dy = (const uint16_t *)(dout + first * pair);
    const float *lse = a->att_lse + (size_t)l * B * H * T + (size_t)first * T;
    dq += first * pair;
    if (dk) dk += first * pair;
    if (dv) dv += first * pair;
    if (m->sp.ring > 1) {   // the ring accumulates
        CUDA_CHECK(err, cudaMemsetAsync(dq, 0, blk * sizeof(float), m->stream), "zeroing dq");
        CUDA_CHECK(err, cudaMemsetAsync(dk, 0, blk * sizeof(float), m->stream), "zeroing dk");
        CUDA_CHECK(err, cudaMemsetAsync(dv, 0, blk * sizeof(float), m->stream), "zeroing dv");
        TRY(ring_backward(m, dq, dk, dv, dy, q, k, v, out, lse,
                          m->sp_bufs.k_mean ? m->sp_bufs.k_mean + l * stats : NULL,
                          m->sp_bufs.v_scale ? m->sp_bufs.v_scale + l * stats : NULL, B, err));
    } else if (attention_merged(m)) {
        uint16_t *dk_rows = (uint16_t *)(dqkv + m->cfg.hidden), *dv_rows = (uint16_t *)(dqkv + 2 * m->cfg.hidden);
        size_t stride = 3 * (size_t)m->cfg.hidden;
        if (m->attention == DIT_ATTN_EXACT)
            return flash_backward_merged_cuda(dq, dk_rows, dv_rows, stride, 0, kv_amax, ws, dy, q, k, v, out, lse, B,
                                              H, T, D, stream, err);
        return sage_backward_merged_cuda(dq, dk_rows, dv_rows, stride, sage_rotates(m), kv_amax, ws, fwd_ws, dy, q, k,
                                         v, out, lse, NULL, B, H, T, D, m->sage.pv, stream, err);
    } else if (m->attention == DIT_ATTN_EXACT) {
        return flash_backward_cuda(dq, dk, dv, ws, dy, q, k, v, out, lse, Bc, Hc, T, D, stream, err);
    } else {
        TRY(sage_backward_cuda(dq, dk, dv, ws, fwd_ws, dy, q, k, v, out, lse, NULL, Bc, Hc, T, D, m->sage.pv, stream,
                               err));
    }
    return 0;
}

// ---- small kernels of the model (the layers are in layers/) --------------------------------

// x (B, T, C) += pos (T, C): the fixed positions after the patch embedding, VEC values per thread
// (vec: x and pos 16-byte aligned and C a multiple of VEC, so that the VEC values of x share one
// piece of pos; else one value at a time).
__global__ void add_positions_kernel(bf16 *x, const bf16 *pos, int T, int C, size_t n, bool vec) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC, tc = (size_t)T * C;
    if (i >= n) return;
    if (vec) {
        float a[VEC], b[VEC];
        load_bf16x8(a, x + i, VEC, true);
        load_bf16x8(b, pos + i % tc, VEC, true);
        for (int j = 0; j < VEC; j++) a[j] += b[j];
        store_bf16x8(x + i, a, VEC, true);
        return;
    }
    for (size_t j = i; j < i + VEC && j < n; j++)
        x[j] = __float2bfloat16(__bfloat162float(x[j]) + __bfloat162float(pos[j % tc]));
}

// The attention's head split and its adjoint, fused with sage's Hadamard rotation of q and k
// (attention/hadamard.cuh; on with rotate = sage with sage.rotate). A row (b, t, which, h) of D
// channels takes D/8 lanes, lane l of it holding channels 8l .. 8l + 7 (16-byte loads and stores);
// rows = B·T·3·H, in qkv's order (row r is qkv[r·D .. r·D + D - 1]). q = q'·H with H symmetric and
// orthogonal, so the gradient comes back as dq' = dq·H: the same transform.

// x·H (D channels) where yes, x unchanged elsewhere; every lane of the warp calls it (a warp holds
// 32/(D/8) rows, which may be q, k and v rows at once, and the transform shuffles).
template <int D>
__device__ __forceinline__ void rotate_if(float (&x)[HADAMARD_VALUES_PER_LANE], bool yes, float norm) {
    float y[HADAMARD_VALUES_PER_LANE];
#pragma unroll
    for (int j = 0; j < HADAMARD_VALUES_PER_LANE; j++) y[j] = x[j];
    walsh_hadamard<D>(y, norm);
    if (yes)
#pragma unroll
        for (int j = 0; j < HADAMARD_VALUES_PER_LANE; j++) x[j] = y[j];
}

// q, k, v (B, H, T, D) from qkv (B, T, 3·H·D): split_heads_forward (layers/reshape.c), q and k then
// multiplied by H when rotate: the values of split_heads_forward_cuda followed by
// hadamard_rotate_bf16_cuda on q and k (one rounding to bf16), in one pass.
template <int D>
__global__ void split_qkv_kernel(bf16 *q, bf16 *k, bf16 *v, const bf16 *qkv, int T, int H, bool rotate,
                                 float norm, size_t rows) {
    constexpr int L = D / HADAMARD_VALUES_PER_LANE;
    // 32-bit index arithmetic (split_qkv checks rows·L < 2^32): the 64-bit divisions cost more issue
    // slots than the row's 16 bytes take to move
    const unsigned row = (blockIdx.x * blockDim.x + threadIdx.x) / L;
    const bool valid = row < rows;   // whole warps: the transform's shuffles need all 32 lanes
    const unsigned r = valid ? row : 0, h = r % H, which = (r / H) % 3, bt = r / (3 * H), b = bt / T, t = bt % T;
    const int c = (threadIdx.x % L) * HADAMARD_VALUES_PER_LANE;
    float x[HADAMARD_VALUES_PER_LANE];
    load_bf16x8(x, qkv + (size_t)r * D + c, VEC, true);
    if (rotate) rotate_if<D>(x, which < 2, norm);
    if (valid)
        store_bf16x8((which == 0 ? q : which == 1 ? k : v) + ((size_t)(b * H + h) * T + t) * D + c, x, VEC, true);
}

// One row's 8 values of lane l (channels 8l .. 8l + 7) as fp32, from fp32 or bf16 gradients.
__device__ __forceinline__ void load_grad8(float (&x)[HADAMARD_VALUES_PER_LANE], const float *p) { load_f32x8(x, p); }
__device__ __forceinline__ void load_grad8(float (&x)[HADAMARD_VALUES_PER_LANE], const bf16 *p) {
    load_bf16x8(x, p, VEC, true);
}

// dqkv (B, T, 3·H·D) = [dq | dk | dv] with dq, dk, dv (B, H, T, D) fp32 (or bf16):
// split_heads_backward (layers/reshape.c) into a zeroed dqkv, dq and dk multiplied by H when
// rotate, rounded to bf16 once (bf16 inputs: copied bit for bit when rotate is off). parts 1: dq
// only (dk and dv are there already: the merged attention backward wrote them).
// AMAX: *amax = max(*amax, max |what it writes|) (the FP8 qkv linear's dout).
template <int D, bool AMAX, typename G>
__global__ void merge_qkv_grad_kernel(bf16 *dqkv, float *amax, const G *dq, const G *dk, const G *dv, int T, int H,
                                      int parts, bool rotate, float norm, size_t rows) {
    constexpr int L = D / HADAMARD_VALUES_PER_LANE;
    const unsigned row = (blockIdx.x * blockDim.x + threadIdx.x) / L;   // 32-bit, as split_qkv_kernel
    const bool valid = row < rows;
    const unsigned r = valid ? row : 0, h = r % H, which = (r / H) % parts, bt = r / (parts * H), b = bt / T,
                   t = bt % T;
    const int c = (threadIdx.x % L) * HADAMARD_VALUES_PER_LANE;
    float x[HADAMARD_VALUES_PER_LANE];
    load_grad8(x, (which == 0 ? dq : which == 1 ? dk : dv) + ((size_t)(b * H + h) * T + t) * D + c);
    if (rotate) rotate_if<D>(x, which < 2, norm);
    if (valid) store_bf16x8(dqkv + ((size_t)(bt * 3 + which) * H + h) * D + c, x, VEC, true);
    if (AMAX) {   // every thread of the block is here (rows past the end hold m = 0)
        float m = 0.0f;
        for (int j = 0; j < VEC && valid; j++) m = fmaxf(m, fabsf(bf16_rounded(x[j])));
        block_amax_update(amax, m);
    }
}

// Ulysses: the same rotation and rounding on the head-sharded gradients, before the all-to-all:
// out = [bf16(dq·H) | bf16(dk·H) | bf16(dv)] (H when rotate), rows of D values in the layout they
// come in (rows_per_tensor of each, out's tensors out_step rows apart). The values of
// merge_qkv_grad_kernel's (the same operations on the same row), so the exchange can move bf16
// instead of fp32.
template <int D>
__global__ void round_qkv_grad_kernel(bf16 *out, const float *dq, const float *dk, const float *dv,
                                      size_t rows_per_tensor, size_t out_step, bool rotate, float norm, size_t rows) {
    constexpr int L = D / HADAMARD_VALUES_PER_LANE;
    const size_t row = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / L;
    const bool valid = row < rows;
    const size_t r = valid ? row : 0;
    const int which = (int)(r / rows_per_tensor), c = (threadIdx.x % L) * HADAMARD_VALUES_PER_LANE;
    float x[HADAMARD_VALUES_PER_LANE];
    load_f32x8(x, (which == 0 ? dq : which == 1 ? dk : dv) + (r % rows_per_tensor) * D + c);
    if (rotate) rotate_if<D>(x, which < 2, norm);
    if (valid) store_bf16x8(out + (which * out_step + r % rows_per_tensor) * D + c, x, VEC, true);
}

// Launches either kernel over the B·T·3·H rows, 256 threads per block (D is 64 or 128:
// dit_gpu_create).
#define LAUNCH_HEAD_ROWS(kernel, D, rows, s, ...)                                                        \
    do {                                                                                               \
        size_t rows_per_block_ = 256 / ((D) / HADAMARD_VALUES_PER_LANE);                              \
        unsigned blocks_ = (unsigned)(((rows) + rows_per_block_ - 1) / rows_per_block_);               \
        if ((D) == 128) kernel<128><<<blocks_, 256, 0, s>>>(__VA_ARGS__, rows);                       \
        else kernel<64><<<blocks_, 256, 0, s>>>(__VA_ARGS__, rows);                                   \
    } while (0)

static int split_qkv(const DitGpu *m, bf16 *q, bf16 *k, bf16 *v, const bf16 *qkv, int B, char *err) {
    int T = m->tokens, H = m->cfg.heads, D = m->cfg.hidden / H;
    size_t rows = (size_t)B * T * 3 * H;
    if (rows * (D / HADAMARD_VALUES_PER_LANE) >= ((size_t)1 << 32)) {
        dit_set_error(err, "split_qkv: B·T·3·H = %zu rows of D = %d exceed the kernel's 32-bit indices", rows, D);
        return -1;
    }
    LAUNCH_HEAD_ROWS(split_qkv_kernel, D, rows, m->stream, q, k, v, qkv, T, H, sage_rotates(m), 1.0f / sqrtf((float)D));
    LAUNCH_CHECK(err, "split_qkv_kernel", "B·T=%d H=%d D=%d", B * T, H, D);
    return 0;
}

// rotate: sage's rotation of dq and dk here (off when round_qkv_grad has applied it already).
// amax: NULL, or raised to max |dqkv| (the kernel without it: the work of before). dk and dv NULL:
// dqkv's k and v columns are written already (the merged attention backward), only dq is merged.
template <typename G>
static int merge_qkv_grad(const DitGpu *m, bf16 *dqkv, const G *dq, const G *dk, const G *dv, bool rotate,
                          float *amax, int B, char *err) {
    int T = m->tokens, H = m->cfg.heads, D = m->cfg.hidden / H, parts = dk ? 3 : 1;
    if (!dk != !dv) {
        dit_set_error(err, "merge_qkv_grad: dk and dv must both be given or both be NULL");
        return -1;
    }
    size_t rows = (size_t)B * T * parts * H;
    if ((size_t)B * T * 3 * H * (D / HADAMARD_VALUES_PER_LANE) >= ((size_t)1 << 32)) {
        dit_set_error(err, "merge_qkv_grad: B·T·3·H = %zu rows of D = %d exceed the kernel's 32-bit indices",
                      (size_t)B * T * 3 * H, D);
        return -1;
    }
    // the grid of LAUNCH_HEAD_ROWS; the instance picked by D and by amax
    size_t rows_per_block = 256 / (D / HADAMARD_VALUES_PER_LANE);
    unsigned blocks = (unsigned)((rows + rows_per_block - 1) / rows_per_block);
    auto kernel = D == 128 ? (amax ? merge_qkv_grad_kernel<128, true, G> : merge_qkv_grad_kernel<128, false, G>)
                           : (amax ? merge_qkv_grad_kernel<64, true, G> : merge_qkv_grad_kernel<64, false, G>);
    kernel<<<blocks, 256, 0, m->stream>>>(dqkv, amax, dq, dk, dv, T, H, parts, rotate, 1.0f / sqrtf((float)D), rows);
    LAUNCH_CHECK(err, "merge_qkv_grad_kernel", "B·T=%d H=%d D=%d amax=%s", B * T, H, D, amax ? "on" : "off");
    return 0;
}

// out (3 tensors of B·T·H rows of D: this rank's share, head-sharded) from dq, dk, dv fp32 of
// the same layout, on the rows of the (b, head) pairs first .. first + count.
static int round_qkv_grad(const DitGpu *m, bf16 *out, const float *dq, const float *dk, const float *dv, int B,
                          int first, int count, cudaStream_t stream, char *err) {
    int H = m->cfg.heads, D = m->cfg.hidden / H, T = ring_shard_tokens(m);
    size_t at = (size_t)first * T * D, per_tensor = (size_t)count * T, rows = 3 * per_tensor;
    LAUNCH_HEAD_ROWS(round_qkv_grad_kernel, D, rows, stream, out + at, dq + at, dk + at, dv + at, per_tensor,
                     (size_t)B * m->tokens * H, sage_rotates(m), 1.0f / sqrtf((float)D));
    LAUNCH_CHECK(err, "round_qkv_grad_kernel", "%zu rows of D=%d", rows, D);
    return 0;
}

// ---- Ulysses attention pipelined by head groups -------------------------------------------
// Per block, the rank's B·H/U (b, head) pairs in G groups (head_groups_for). The all-to-alls run
// on group_stream x, group g's attention on c_g = compute_stream(g) (the model stream s for even
// g, odd_stream for odd g); events order them (ev[0] start and end, ev[1 + g] group g's input in
// place, ev[1 + G + g] group g's attention done):
//   s: produce the whole input, record ev[0]     x: wait ev[0]; in(0), record ev[1]; in(1), ...
//   c_g: wait ev[1 + g], attention(g), record ev[1 + G + g]
//   x: per g: wait ev[1 + G + g], out(g); record ev[0]       s: wait ev[0], consume the output
// so group g+1's input moves while group g computes, and group g's output while g+1 computes;
// groups g and g+1 on two streams let g+1's blocks start in g's last wave. Every buffer is
// written by one group's part and read after its event (the two compute streams share none);
// the next block's work on x and odd_stream starts after s has waited for all of this block's.

// `to` waits for the work queued on `from` so far.
static int stream_after(cudaStream_t to, cudaStream_t from, cudaEvent_t ev, char *err) {
    CUDA_CHECK(err, cudaEventRecord(ev, from), "record a pipeline event");
    CUDA_CHECK(err, cudaStreamWaitEvent(to, ev, 0), "wait for a pipeline event");
    return 0;
}

// Block l's forward from qkv: q, k, v (a->q/k/v, head-sharded), att and att_lse, and att_local
// (att sequence-sharded, for merge_heads).
static int ulysses_attention_forward(DitGpu *m, int l, const bf16 *qkv, int B, char *err) {
    DitGpuActivations *a = &m->acts;
    const DitGpuSeqBuffers *sb = &m->sp_bufs;
    cudaStream_t s = m->stream, x = m->group_stream;
    cudaEvent_t *ev = m->group_events;
    size_t blk = (size_t)B * m->tokens * m->cfg.hidden;
    size_t heads_step = (char *)a->k - (char *)a->q, local_step = (char *)sb->k_local - (char *)sb->q_local;
    int G = head_groups_for(m, B), pairs = B * heads_here(m), first, count;
    TRY(split_qkv(m, sb->q_local, sb->k_local, sb->v_local, qkv, B, err));
    TRY(stream_after(x, s, ev[0], err));
    for (int g = 0; g < G; g++) {   // q, k, v of group g: one exchange of the three
        group_pairs(pairs, G, g, &first, &count);
        TRY(ulysses_runs(m, a->q + l * blk, sb->q_local, 3, heads_step, local_step, 1, B, first, count, err));
        CUDA_CHECK(err, cudaEventRecord(ev[1 + g], x), "record group %d's q, k, v in place", g);
    }
    for (int g = 0; g < G; g++) {
        cudaStream_t c = compute_stream(m, g);
        group_pairs(pairs, G, g, &first, &count);
        CUDA_CHECK(err, cudaStreamWaitEvent(c, ev[1 + g], 0), "wait for group %d's q, k, v", g);
        TRY(attention_forward_gpu(m, l, B, g, first, count, err));
        TRY(stream_after(x, c, ev[1 + G + g], err));
        TRY(ulysses_runs(m, sb->att_local, a->att + l * blk, 1, 0, 0, 0, B, first, count, err));
    }
    return stream_after(s, x, ev[0], err);
}

// Block l's backward from dout (sequence-sharded): dq, dk, dv rotated, rounded to bf16 and
// sequence-sharded in dqkv_local ([dq | dk | dv]).
static int ulysses_attention_backward(DitGpu *m, int l, const bf16 *dout, int B, char *err) {
    const DitGpuSeqBuffers *sb = &m->sp_bufs;
    cudaStream_t s = m->stream, x = m->group_stream;
    cudaEvent_t *ev = m->group_events;
    size_t step = (size_t)B * m->tokens * m->cfg.hidden * sizeof(bf16);
    int G = head_groups_for(m, B), pairs = B * heads_here(m), first, count;
    TRY(stream_after(x, s, ev[0], err));
    for (int g = 0; g < G; g++) {
        group_pairs(pairs, G, g, &first, &count);
        TRY(ulysses_runs(m, sb->dout_heads, dout, 1, 0, 0, 1, B, first, count, err));
        CUDA_CHECK(err, cudaEventRecord(ev[1 + g], x), "record group %d's dout in place", g);
    }
    for (int g = 0; g < G; g++) {
        cudaStream_t c = compute_stream(m, g);
        group_pairs(pairs, G, g, &first, &count);
        CUDA_CHECK(err, cudaStreamWaitEvent(c, ev[1 + g], 0), "wait for group %d's dout", g);
        TRY(attention_backward_gpu(m, l, B, g, first, count, sb->dq_heads, sb->dk_heads, sb->dv_heads, NULL, NULL,
                                   sb->dout_heads, err));
        // rotation and rounding are per row of D values, the exchange moves whole rows: both
        // orders give the same bits, and this one moves bf16
        TRY(round_qkv_grad(m, sb->dqkv_heads, sb->dq_heads, sb->dk_heads, sb->dv_heads, B, first, count, c, err));
        TRY(stream_after(x, c, ev[1 + G + g], err));
        TRY(ulysses_runs(m, sb->dqkv_local, sb->dqkv_heads, 3, step, step, 0, B, first, count, err));
    }
    return stream_after(s, x, ev[0], err);
}

// ---- the block linears: bf16 or FP8 (m->linear) ------------------------------------------
// The FP8 gradients are e4m3, not Transformer Engine's e5m2: with scales from the current amax
// nothing needs e5m2's range, and e4m3 is 1.6x more accurate here (dev/notes_linear_fp8.md).
#define FP8_GRAD_FORMAT FP8_E4M3

// Block l's FP8 inputs saved by the forward for the backward (m->acts: ln1_fp8t .. fp8_scales):
// (IC, Mp) at block stride IC·Mp of the full batch, one scale slot per linear; and the amax slots
// (acts.fp8_amax) of the linears' inputs, weights and douts. bf16, or fp8_fused_inputs off: the amax
// pointers NULL (the producers run without it, the linears take their own); bf16: the saved
// copies NULL too, unused.
// The forwards find their scales (Fp8Scaling) from the inputs' producers (ln1, ln2, and att_merged
// when merged from the heads) or by guessing (the weights, GELU(fc1), and att_merged when the
// attention writes it: acts.fp8_guess), the guessed passes taking their amax into the slots, where
// the backward reads the weights'. The weights' forward quantization also writes their transposes,
// the operands of the backward's dinp GEMMs (which then quantize nothing of the weights).
typedef struct { float *qkv, *proj, *fc1, *fc2; } Fp8Amax;
typedef struct { Fp8Scaling qkv, proj, fc1, fc2; } Fp8Scalings;
typedef struct {
    Fp8Saved qkv, proj, fc1, fc2;
    Fp8Amax inp_amax, weight_amax, dout_amax;
    Fp8Scalings inp_scaling, weight_scaling;
    Fp8Scalings dout_scaling;   // the douts quantized by their producers (qkv's: with its bias gradient)
    struct { Fp8Saved qkv, proj, fc1, fc2; } weight_t;   // the weights' transposed copies (qt NULL: none)
} BlockFp8Inputs;

// A kept copy, or NULL (bf16, or FP8 without fused inputs: the linears quantize their weights themselves).
static const Fp8Saved *kept(const Fp8Saved *saved) { return saved->qt ? saved : NULL; }

// The amax slots of block l's linears: their inputs (which = 0), weights (1) or douts (2).
static Fp8Amax fp8_amax_slots(const DitGpu *m, int which, int l) {
    float *at = m->acts.fp8_amax + ((size_t)which * m->cfg.depth + l) * 4;
    return (Fp8Amax){at, at + 1, at + 2, at + 3};
}

static BlockFp8Inputs block_fp8_inputs(const DitGpu *m, int l) {
    BlockFp8Inputs in = {};
    if (m->linear != DIT_LINEAR_FP8) return in;
    const DitGpuActivations *a = &m->acts;
    size_t h = m->cfg.hidden, stride = (size_t)l * h * fp8_padded_rows(m->batch * m->tokens);
    float *scales = a->fp8_scales + (size_t)l * 4 * FP8_SCALE_SLOT;
    in.qkv = (Fp8Saved){a->ln1_fp8t + stride, scales};
    in.proj = (Fp8Saved){a->att_merged_fp8t + stride, scales + FP8_SCALE_SLOT};
    in.fc1 = (Fp8Saved){a->ln2_fp8t + stride, scales + 2 * FP8_SCALE_SLOT};
    in.fc2 = (Fp8Saved){a->gelu_fp8t + 4 * stride, scales + 3 * FP8_SCALE_SLOT};
    if (m->fp8_fused_inputs) {
        in.inp_amax = fp8_amax_slots(m, 0, l);
        in.weight_amax = fp8_amax_slots(m, 1, l);
        in.dout_amax = fp8_amax_slots(m, 2, l);
        int *guess = a->fp8_guess + (size_t)l * FP8_GUESSES * 2;   // two ints each (Fp8Scaling.exponent)
        const Fp8Amax *i = &in.inp_amax, *w = &in.weight_amax;
        in.inp_scaling.qkv = (Fp8Scaling){i->qkv, NULL, NULL, 0};
        in.inp_scaling.proj = attention_merged(m) ? (Fp8Scaling){NULL, guess + 8, i->proj, 0}
                                                  : (Fp8Scaling){i->proj, NULL, NULL, 0};
        in.inp_scaling.fc1 = (Fp8Scaling){i->fc1, NULL, NULL, 0};
        in.inp_scaling.fc2 = (Fp8Scaling){NULL, guess + 10, i->fc2, 0};
        in.weight_scaling.qkv = (Fp8Scaling){NULL, guess, w->qkv, 0};
        in.weight_scaling.proj = (Fp8Scaling){NULL, guess + 2, w->proj, 0};
        in.weight_scaling.fc1 = (Fp8Scaling){NULL, guess + 4, w->fc1, 0};
        in.weight_scaling.fc2 = (Fp8Scaling){NULL, guess + 6, w->fc2, 0};
        const Fp8Amax *d = &in.dout_amax;   // (taken: the douts' amax slots)
        int headroom = m->fp8_grad_headroom;
        in.dout_scaling.fc1 = (Fp8Scaling){NULL, guess + 12, d->fc1, headroom};
        in.dout_scaling.fc2 = (Fp8Scaling){NULL, guess + 14, d->fc2, headroom};
        in.dout_scaling.proj = (Fp8Scaling){NULL, guess + 16, d->proj, headroom};
        in.dout_scaling.qkv = (Fp8Scaling){NULL, guess + 18, d->qkv, headroom};
        // the weights' transposes (IC, OC), written by the forward's quantization, read by the backward
        uint8_t *wt = a->weight_fp8t + (size_t)l * 12 * h * h;
        float *wscales = a->fp8_scales + (size_t)(m->cfg.depth + l) * 4 * FP8_SCALE_SLOT;
        in.weight_t.qkv = (Fp8Saved){wt, wscales};
        in.weight_t.proj = (Fp8Saved){wt + 3 * h * h, wscales + FP8_SCALE_SLOT};
        in.weight_t.fc1 = (Fp8Saved){wt + 4 * h * h, wscales + 2 * FP8_SCALE_SLOT};
        in.weight_t.fc2 = (Fp8Saved){wt + 8 * h * h, wscales + 3 * FP8_SCALE_SLOT};
    }
    return in;
}

// FP8 with fp8_fused_inputs (else nothing): the forward's amax slots (inputs and weights) of every
// block zeroed, for the producers and the guessed quantizations. The backward reads the weights'
// slots as the forward left them (the weights do not change in between).
static int forward_fp8_amax(const DitGpu *m, char *err) {
    if (m->linear != DIT_LINEAR_FP8 || !m->fp8_fused_inputs) return 0;
    CUDA_CHECK(err, cudaMemsetAsync(m->acts.fp8_amax, 0, (size_t)2 * m->cfg.depth * 4 * sizeof(float), m->stream),
               "zeroing %d FP8 amax slots", 2 * m->cfg.depth * 4);
    return 0;
}

// FP8 with fp8_fused_inputs (else nothing): the douts' amax slots of every block zeroed, for the
// kernels that write the douts.
static int backward_fp8_amax(const DitGpu *m, char *err) {
    if (m->linear != DIT_LINEAR_FP8 || !m->fp8_fused_inputs) return 0;
    CUDA_CHECK(err, cudaMemsetAsync(fp8_amax_slots(m, 2, 0).qkv, 0, (size_t)m->cfg.depth * 4 * sizeof(float),
                                    m->stream), "zeroing %d FP8 amax slots", m->cfg.depth * 4);
    return 0;
}

// out (M, OC) = inp (M, IC)·weightᵀ + bias; FP8: inp's and weight's quantized transposed copies kept
// in *save and *save_weight (may be NULL) for the backward (also by the sampling forwards: harmless,
// every training step runs its own forward first); inp_scaling, weight_scaling: how FP8 finds their
// scales (block_fp8_inputs; all NULL: amax passes of its own)
static int block_linear_forward(const DitGpu *m, bf16 *out, const bf16 *inp, const bf16 *weight, const bf16 *bias,
                                int M, int IC, int OC, const Fp8Saved *save, const Fp8Saved *save_weight,
                                const Fp8Scaling *inp_scaling, const Fp8Scaling *weight_scaling, char *err) {
    if (m->linear == DIT_LINEAR_FP8)
        return linear_fp8_forward_cuda(out, inp, weight, bias, M, IC, OC, save, save_weight, inp_scaling,
                                       weight_scaling, m->fp8_workspace, m->fp8_workspace_bytes, &m->ctx, m->stream,
                                       err);
    return linear_forward_cuda(out, inp, weight, bias, M, IC, OC, &m->ctx, m->stream, err);
}

// Block l's GELU(fc1) in acts.gelu (blk = B·T·hidden): its own (bf16 linears, whose backward reads
// it), or the one buffer all blocks share (FP8: the backward reads fc2's quantized copy instead).
static bf16 *gelu_block(const DitGpu *m, int l, size_t blk) {
    return m->acts.gelu + (m->linear == DIT_LINEAR_FP8 ? 0 : (size_t)l * 4 * blk);
}

// pre_gelu = inp·weightᵀ + bias, out = GELU(pre_gelu); FP8 with fused inputs: out is not written (fc2
// recomputes it from pre_gelu: block_linear_gelu_input_forward)
static int block_linear_gelu_forward(const DitGpu *m, bf16 *out, bf16 *pre_gelu, const bf16 *inp, const bf16 *weight,
                                     const bf16 *bias, int M, int IC, int OC, const Fp8Saved *save,
                                     const Fp8Saved *save_weight, const Fp8Scaling *inp_scaling,
                                     const Fp8Scaling *weight_scaling, char *err) {
    if (m->linear == DIT_LINEAR_FP8 && m->fp8_fused_inputs)
        return block_linear_forward(m, pre_gelu, inp, weight, bias, M, IC, OC, save, save_weight, inp_scaling,
                                    weight_scaling, err);
    if (m->linear == DIT_LINEAR_FP8)
        return linear_fp8_gelu_forward_cuda(out, pre_gelu, inp, weight, bias, M, IC, OC, save, save_weight,
                                            inp_scaling, weight_scaling, NULL, m->fp8_workspace,
                                            m->fp8_workspace_bytes, &m->ctx, m->stream, err);
    return linear_gelu_forward_cuda(out, pre_gelu, inp, weight, bias, M, IC, OC, &m->ctx, m->stream, err);
}

// out = GELU(pre_gelu)·weightᵀ + bias, the MLP's second linear: from the stored gelu, or (FP8 with fused
// inputs) from pre_gelu, its quantization recomputing GELU
static int block_linear_gelu_input_forward(const DitGpu *m, bf16 *out, const bf16 *gelu, const bf16 *pre_gelu,
                                           const bf16 *weight, const bf16 *bias, int M, int IC, int OC,
                                           const Fp8Saved *save, const Fp8Saved *save_weight,
                                           const Fp8Scaling *inp_scaling, const Fp8Scaling *weight_scaling, char *err) {
    if (m->linear == DIT_LINEAR_FP8 && m->fp8_fused_inputs)
        return linear_fp8_forward_gelu_input_cuda(out, pre_gelu, weight, bias, M, IC, OC, save, save_weight,
                                                  inp_scaling, weight_scaling, m->fp8_workspace,
                                                  m->fp8_workspace_bytes, &m->ctx, m->stream, err);
    return block_linear_forward(m, out, gelu, weight, bias, M, IC, OC, save, save_weight, NULL, weight_scaling, err);
}

// dinp = dout·weight (written: a block linear's input gradient has no other contribution);
// dweight = wb·dweight + doutᵀ·inp (FP8: from the forward's saved copy; wb 1 accumulates, 0 writes);
// dbias += Σ dout; dout_amax: max |dout| from dout's producer, or NULL; weight_amax: the forward's
// max |weight|, or NULL; weight_saved: the forward's quantized weightᵀ, or NULL
static int block_linear_backward(const DitGpu *m, bf16 *dinp, float *dweight, float wb, float *dbias,
                                 const bf16 *dout, const bf16 *inp, const Fp8Saved *saved, const bf16 *weight,
                                 const Fp8Saved *weight_saved, int M, int IC, int OC, const float *dout_amax,
                                 const float *weight_amax, char *err) {
    if (m->linear == DIT_LINEAR_FP8)
        return linear_fp8_backward_cuda(dinp, 0.0f, dweight, wb, dbias, dout, saved, weight, weight_saved, M, IC, OC,
                                        FP8_GRAD_FORMAT, dout_amax, weight_amax, m->fp8_workspace,
                                        m->fp8_workspace_bytes, &m->ctx, m->stream, err);
    return linear_backward_cuda(dinp, 0.0f, dweight, wb, dbias, dout, inp, weight, M, IC, OC, &m->ctx, m->stream, err);
}

// dpre = (dout·weight)∘GELU'(pre_gelu) (written); dweight with wb and dbias as above; FP8:
// dpre_amax (or NULL) gets max |dpre|, and dpre_dbias (fc1's bias gradient) Σ_m dpre in the same
// pass (fc1's backward then skips it: fc1_dbias)
static int block_linear_dgelu_backward(const DitGpu *m, bf16 *dpre, float *dweight, float wb, float *dbias,
                                       const bf16 *dout, const bf16 *inp, const Fp8Saved *saved,
                                       const bf16 *pre_gelu, const bf16 *weight, const Fp8Saved *weight_saved, int M,
                                       int IC, int OC, const float *dout_amax, const float *weight_amax,
                                       float *dpre_amax, float *dpre_dbias, char *err) {
    if (m->linear == DIT_LINEAR_FP8)
        return linear_fp8_dgelu_backward_cuda(dpre, dweight, wb, dbias, dout, saved, pre_gelu, weight, weight_saved, M,
                                              IC, OC, FP8_GRAD_FORMAT, dout_amax, weight_amax, dpre_amax, dpre_dbias,
                                              m->fp8_workspace, m->fp8_workspace_bytes, &m->ctx, m->stream, err);
    return linear_dgelu_backward_cuda(dpre, dweight, wb, dbias, dout, inp, pre_gelu, weight, M, IC, OC, &m->ctx,
                                      m->stream, err);
}

// ---- forward -----------------------------------------------------------------------------

int dit_gpu_forward(DitGpu *m, const DitGpuWeights *w, int B, char *err) {
    TRY(check_batch(m, B, "dit_gpu_forward", err));
    const DitConfig *c = &m->cfg;
    DitGpuActivations *a = &m->acts;
    const LayersCuda *ctx = &m->ctx;
    cudaStream_t s = m->stream;
    int h = c->hidden, T = m->tokens, P = dit_patch_dim(c), H = c->heads, D = h / H;
    int BT = B * T, L = c->depth, stride = L * 6 * h;
    size_t blk = (size_t)BT * h, bt = (size_t)BT;
    int sequence_parallel = sp_size(m) > 1, ulysses = m->sp.ulysses > 1;
    const DitGpuSeqBuffers *sb = &m->sp_bufs;

    // patch embedding plus the fixed positions (sequence parallel: of this rank's tokens, whose
    // positions start at token_offset)
    if (sequence_parallel) {
        TRY(patchify_forward_cuda(sb->tokens_full, a->x_t, B, c->channels, c->image_size, c->patch, s, err));
        TRY(take_token_shard(m, a->patches, sb->tokens_full, B, err));
    } else {
        TRY(patchify_forward_cuda(a->patches, a->x_t, B, c->channels, c->image_size, c->patch, s, err));
    }
    TRY(linear_forward_cuda(a->residual, a->patches, w->patch_w, w->patch_b, BT, P, h, ctx, s, err));
    const bf16 *pos = m->pos_embed + (size_t)m->token_offset * h;
    bool vec = h % VEC == 0 && alignment_of(a->residual) >= 16 && alignment_of(pos) >= 16;
    add_positions_kernel<<<blocks_for(blk, BLOCK_SIZE * VEC), BLOCK_SIZE, 0, s>>>(a->residual, pos, T, h, blk, vec);
    LAUNCH_CHECK(err, "add_positions_kernel", "B·T=%d C=%d", BT, h);

    // conditioning c = MLP(timestep features) + class embedding; every adaLN reads SiLU(c)
    TRY(timestep_embedding_forward_cuda(a->t_freq, a->t, B, TIMESTEP_FREQ_DIM, s, err));
    TRY(linear_forward_cuda(a->t_h, a->t_freq, w->t_w1, w->t_b1, B, TIMESTEP_FREQ_DIM, h, ctx, s, err));
    TRY(silu_forward_cuda(a->t_h_silu, a->t_h, (size_t)B * h, s, err));
    TRY(linear_forward_cuda(a->t_emb, a->t_h_silu, w->t_w2, w->t_b2, B, h, h, ctx, s, err));
    TRY(embedding_forward_cuda(a->y_emb, w->y_table, a->labels, B, h, s, err));
    TRY(add_forward_cuda(a->c, a->t_emb, a->y_emb, (size_t)B * h, s, err));
    TRY(silu_forward_cuda(a->c_silu, a->c, (size_t)B * h, s, err));
    // the modulations of all blocks in one GEMM: (B, depth·6h); the final layer's shift and scale: (B, 2h)
    TRY(linear_forward_cuda(a->ada, a->c_silu, w->ada_w, w->ada_b, B, h, stride, ctx, s, err));
    TRY(linear_forward_cuda(a->final_ada, a->c_silu, w->final_ada_w, w->final_ada_b, B, h, 2 * h, ctx, s, err));

    // Each LayerNorm after the first reads the residual stream that the gated residual before it
    // writes: the two run as one kernel (gated_residual_layernorm_modulate_forward_cuda), which
    // writes both the new residual stream and the LayerNorm's output. Block 0's norm1 runs alone.
    TRY(forward_fp8_amax(m, err));
    TRY(layernorm_modulate_forward_cuda(a->ln1, a->ln1_mean, a->ln1_rstd, a->residual, a->ada, a->ada + h, B, T, h,
                                        stride, block_fp8_inputs(m, 0).inp_amax.qkv, s, err));
    for (int l = 0; l < L; l++) {
        const bf16 *ada = a->ada + (size_t)l * 6 * h;
        bf16 *x = a->residual + l * blk, *x_next = a->residual + (l + 1) * blk;
        bf16 *ln1 = a->ln1 + l * blk, *qkv = a->qkv + l * 3 * blk;
        bf16 *att_merged = a->att_merged + l * blk, *proj = a->proj + l * blk;
        bf16 *x_mid = a->x_mid + l * blk, *ln2 = a->ln2 + l * blk;
        bf16 *fc1 = a->fc1 + l * 4 * blk, *gelu = gelu_block(m, l, blk), *fc2 = a->fc2 + l * blk;
        // FP8: where the linears keep their quantized inputs, and the inputs' amax (from their producers)
        BlockFp8Inputs q8 = block_fp8_inputs(m, l);

        // x_mid = x + gate_msa·proj(attention(qkv(modulate(norm1(x), shift_msa, scale_msa))))
        // (ln1 = modulate(norm1(x), shift_msa, scale_msa) is already there: block 0's above, block l's
        // from the end of block l - 1)
        TRY(block_linear_forward(m, qkv, ln1, w->qkv_w + (size_t)l * 3 * h * h, w->qkv_b + (size_t)l * 3 * h,
                                 BT, h, 3 * h, &q8.qkv, kept(&q8.weight_t.qkv), &q8.inp_scaling.qkv,
                                 &q8.weight_scaling.qkv, err));
        // attention (Ulysses: q, k, v to H/U heads of the ring shard's tokens and the output back), its
        // output in att_merged: written there by the attention itself (attention_merged; proj then
        // guesses its scale), or merged from the heads (with the amax)
        if (ulysses) {
            TRY(ulysses_attention_forward(m, l, qkv, B, err));
        } else if (attention_merged(m) && m->attention == DIT_ATTN_SAGE) {
            TRY(sage_forward_from_qkv(m, l, qkv, B, err));
        } else {
            TRY(split_qkv(m, a->q + l * blk, a->k + l * blk, a->v + l * blk, qkv, B, err));
            TRY(attention_forward_gpu(m, l, B, 0, 0, B * heads_here(m), err));
        }
        if (!attention_merged(m))
            TRY(merge_heads_forward_cuda(att_merged, ulysses ? sb->att_local : a->att + l * blk, B, T, H, D,
                                         q8.inp_amax.proj, s, err));
        TRY(block_linear_forward(m, proj, att_merged, w->proj_w + (size_t)l * h * h, w->proj_b + (size_t)l * h,
                                 BT, h, h, &q8.proj, kept(&q8.weight_t.proj), &q8.inp_scaling.proj,
                                 &q8.weight_scaling.proj, err));
        // x_mid = x + gate_msa·proj, and ln2 = modulate(norm2(x_mid), shift_mlp, scale_mlp)
        TRY(gated_residual_layernorm_modulate_forward_cuda(x_mid, ln2, a->ln2_mean + l * bt, a->ln2_rstd + l * bt,
                                                           x, proj, ada + 2 * h, ada + 3 * h, ada + 4 * h, B, T,
                                                           h, stride, stride, q8.inp_amax.fc1, s, err));

        // x_next = x_mid + gate_mlp·fc2(gelu(fc1(ln2)))
        // (bf16: fc1 and the GELU are one GEMM with the GELU epilogue; fc1 keeps the pre-activation.
        // FP8 with fused inputs: GELU(fc1) is not stored, fc2's quantization recomputes it.)
        TRY(block_linear_gelu_forward(m, gelu, fc1, ln2, w->fc1_w + (size_t)l * 4 * h * h,
                                      w->fc1_b + (size_t)l * 4 * h, BT, h, 4 * h, &q8.fc1, kept(&q8.weight_t.fc1),
                                      &q8.inp_scaling.fc1, &q8.weight_scaling.fc1, err));
        TRY(block_linear_gelu_input_forward(m, fc2, gelu, fc1, w->fc2_w + (size_t)l * 4 * h * h,
                                            w->fc2_b + (size_t)l * h, BT, 4 * h, h, &q8.fc2, kept(&q8.weight_t.fc2),
                                            &q8.inp_scaling.fc2, &q8.weight_scaling.fc2, err));
        // x_next = x_mid + gate_mlp·fc2, and the LayerNorm that reads it: block l + 1's
        // ln1 = modulate(norm1(x_next), shift_msa, scale_msa), or after the last block the final layer's
        // lnf = modulate(norm(x_next), shift, scale)
        if (l + 1 < L) {
            const bf16 *ada_next = ada + 6 * h;
            TRY(gated_residual_layernorm_modulate_forward_cuda(
                x_next, a->ln1 + (l + 1) * blk, a->ln1_mean + (l + 1) * bt, a->ln1_rstd + (l + 1) * bt, x_mid, fc2,
                ada + 5 * h, ada_next, ada_next + h, B, T, h, stride, stride, block_fp8_inputs(m, l + 1).inp_amax.qkv,
                s, err));
        } else {
            TRY(gated_residual_layernorm_modulate_forward_cuda(x_next, a->lnf, a->lnf_mean, a->lnf_rstd, x_mid, fc2,
                                                               ada + 5 * h, a->final_ada, a->final_ada + h, B, T,
                                                               h, stride, 2 * h, NULL, s, err));
        }
    }

    // final layer: lnf (above) -> linear to p·p·C per token -> image
    TRY(linear_forward_cuda(a->out_tokens, a->lnf, w->final_w, w->final_b, BT, h, P, ctx, s, err));
    if (!sequence_parallel)
        return unpatchify_forward_cuda(a->out, a->out_tokens, B, c->channels, c->image_size, c->patch, s, err);
    // every rank gets the whole output image
    TRY(gather_output_tokens(m, B, err));
    return unpatchify_forward_cuda(a->out, sb->tokens_full, B, c->channels, c->image_size, c->patch, s, err);
}

int dit_gpu_loss(DitGpu *m, int B, char *err) {
    TRY(check_batch(m, B, "dit_gpu_loss", err));
    return mse_loss_forward_backward_cuda(m->grad_acts.out, m->acts.loss, m->acts.out, m->acts.v_target,
                                          image_floats(&m->cfg, B), &m->ctx, m->stream, err);
}

// ---- backward ----------------------------------------------------------------------------

int dit_gpu_zero_grad(DitGpu *m, char *err) {
    CUDA_CHECK(err, cudaMemsetAsync(m->grads_memory, 0, m->num_params * sizeof(float), m->stream),
               "zeroing %zu parameter gradients", m->num_params);
    return 0;
}

// dit_gpu_backward_fresh's zeroing: every parameter gradient but the weight stacks of the blocks'
// linears and of the adaLN projection (buffer order: dit_gpu_block_grad_ranges), which their
// GEMMs write whole (93% of the parameters at hidden 2048).
static int zero_accumulated_grads(DitGpu *m, char *err) {
    size_t offsets[DIT_BLOCK_GRAD_RANGES], numels[DIT_BLOCK_GRAD_RANGES], from = 0;
    dit_gpu_block_grad_ranges(m, 0, m->cfg.depth, offsets, numels);
    for (int k = 0; k <= DIT_BLOCK_GRAD_RANGES; k += 2) {   // the weight stacks: ranges 0, 2, 4, 6, 8
        size_t to = k < DIT_BLOCK_GRAD_RANGES ? offsets[k] : m->num_params;
        CUDA_CHECK(err, cudaMemsetAsync(m->grads_memory + from, 0, (to - from) * sizeof(float), m->stream),
                   "zeroing %zu parameter gradients", to - from);
        if (k < DIT_BLOCK_GRAD_RANGES) from = offsets[k] + numels[k];
    }
    return 0;
}

// ---- a block's MLP and attention projection backward ---------------------------------------
// Block l's buffers: its activations, weights and gradients at the block's offsets.
typedef struct {
    const bf16 *ada;
    float *dada;
    size_t o1, o4;   // offsets of (B, T, h) and (B, T, 4h) activations
} BlockAt;

static BlockAt block_at(const DitGpu *m, int l, int B) {
    size_t h = m->cfg.hidden, blk = (size_t)B * m->tokens * h;
    return (BlockAt){m->acts.ada + l * 6 * h, m->grad_acts.ada + l * 6 * h, l * blk, l * 4 * blk};
}

// FP8 douts quantized by the passes that compute them (DitGpu.fp8_grad_headroom)
static int fp8_douts_fused(const DitGpu *m) {
    return m->linear == DIT_LINEAR_FP8 && m->fp8_fused_inputs && m->fp8_grad_headroom >= 0;
}

// x_next = x_mid + gate_mlp·fc2(gelu(fc1(ln2))): g->residual (dL/dx_next) to g->ln2. fc2's backward and
// the GELU's are one GEMM (bf16). The bias gradients come with the passes that write the douts: fc2's
// with the gated residual's, fc1's (FP8) with the dGELU; the linears' backwards then take dbias NULL.
static int mlp_backward(DitGpu *m, int l, const BlockFp8Inputs *q8, int B, float wb, char *err) {
    const DitGpuActivations *a = &m->acts;
    DitGpuGradActs *g = &m->grad_acts;
    const DitGpuWeights *w = &m->weights;
    DitParams *dw = &m->grads;
    int h = m->cfg.hidden, T = m->tokens, BT = B * T, stride = m->cfg.depth * 6 * h;
    BlockAt at = block_at(m, l, B);
    TRY(gated_residual_backward_cuda(NULL, g->fc2, at.dada + 5 * h, g->residual, a->fc2 + at.o1, at.ada + 5 * h, B, T,
                                     h, stride, q8->dout_amax.fc2, dw->fc2_b + (size_t)l * h, &m->ctx, m->stream,
                                     err));
    float *fc1_dbias = dw->fc1_b + (size_t)l * 4 * h;
    int dbias_in_dgelu = m->linear == DIT_LINEAR_FP8;
    TRY(block_linear_dgelu_backward(m, g->fc1, dw->fc2_w + (size_t)l * 4 * h * h, wb, NULL, g->fc2,
                                    gelu_block(m, l, (size_t)BT * h), &q8->fc2, a->fc1 + at.o4,
                                    w->fc2_w + (size_t)l * 4 * h * h, kept(&q8->weight_t.fc2), BT, 4 * h, h,
                                    q8->dout_amax.fc2, q8->weight_amax.fc2, q8->dout_amax.fc1,
                                    dbias_in_dgelu ? fc1_dbias : NULL, err));
    return block_linear_backward(m, g->ln2, dw->fc1_w + (size_t)l * 4 * h * h, wb, dbias_in_dgelu ? NULL : fc1_dbias,
                                 g->fc1, a->ln2 + at.o1, &q8->fc1, w->fc1_w + (size_t)l * 4 * h * h,
                                 kept(&q8->weight_t.fc1), BT, h, 4 * h, q8->dout_amax.fc1, q8->weight_amax.fc1, err);
}

// A gated residual's backward (x_next = x + gate·h, the gate at columns gate·hidden.. of block l's
// modulation; h_act the block's h) with dh quantized as the next linear's FP8 dout: dgate, then dh
// into the FP8 workspace's dout slots for (B·T, IC, hidden), with that linear's bias gradient dbias.
static int gated_backward_fp8_dout(DitGpu *m, int l, int B, int gate, const bf16 *h_act, int IC, float *dbias,
                                   const Fp8Scaling *scaling, Fp8Dout *dout, char *err) {
    DitGpuGradActs *g = &m->grad_acts;
    int h = m->cfg.hidden, T = m->tokens, stride = m->cfg.depth * 6 * h;
    BlockAt at = block_at(m, l, B);
    TRY(gated_residual_backward_cuda(NULL, NULL, at.dada + gate * h, g->residual, h_act, at.ada + gate * h, B, T, h,
                                     stride, NULL, NULL, &m->ctx, m->stream, err));
    TRY(linear_fp8_dout_slots(dout, m->fp8_workspace, m->fp8_workspace_bytes, B * T, IC, h, err));
    return gated_dh_fp8_cuda(dout, g->residual, at.ada + gate * h, B, T, h, stride, dbias, FP8_GRAD_FORMAT, scaling,
                             &m->ctx, m->stream, err);
}

// mlp_backward with the FP8 douts quantized where they are computed: fc2's by the gated residual's dh
// pass, fc1's by the dGELU, each into the FP8 workspace's dout slots that the linear's backward reads.
static int mlp_backward_fp8_douts(DitGpu *m, int l, const BlockFp8Inputs *q8, int B, float wb, char *err) {
    const DitGpuActivations *a = &m->acts;
    DitGpuGradActs *g = &m->grad_acts;
    const DitGpuWeights *w = &m->weights;
    DitParams *dw = &m->grads;
    const LayersCuda *ctx = &m->ctx;
    int h = m->cfg.hidden, BT = B * m->tokens;
    BlockAt at = block_at(m, l, B);
    Fp8Dout dout;
    TRY(gated_backward_fp8_dout(m, l, B, 5, a->fc2 + at.o1, 4 * h, dw->fc2_b + (size_t)l * h, &q8->dout_scaling.fc2,
                                &dout, err));
    TRY(linear_fp8_backward_quantized_cuda(g->fc1, 0.0f, dw->fc2_w + (size_t)l * 4 * h * h, wb, &dout, &q8->fc2,
                                           w->fc2_w + (size_t)l * 4 * h * h, kept(&q8->weight_t.fc2), BT, 4 * h, h,
                                           FP8_GRAD_FORMAT, q8->weight_amax.fc2, m->fp8_workspace,
                                           m->fp8_workspace_bytes, ctx, m->stream, err));
    TRY(linear_fp8_dout_slots(&dout, m->fp8_workspace, m->fp8_workspace_bytes, BT, h, 4 * h, err));
    TRY(gelu_backward_fp8_cuda(&dout, g->fc1, a->fc1 + at.o4, dw->fc1_b + (size_t)l * 4 * h, BT, 4 * h,
                               FP8_GRAD_FORMAT, &q8->dout_scaling.fc1, ctx, m->stream, err));
    return linear_fp8_backward_quantized_cuda(g->ln2, 0.0f, dw->fc1_w + (size_t)l * 4 * h * h, wb, &dout, &q8->fc1,
                                              w->fc1_w + (size_t)l * 4 * h * h, kept(&q8->weight_t.fc1), BT, h,
                                              4 * h, FP8_GRAD_FORMAT, q8->weight_amax.fc1, m->fp8_workspace,
                                              m->fp8_workspace_bytes, ctx, m->stream, err);
}

// x_mid = x + gate_msa·proj(att_merged): g->residual to g->att_merged (proj's bias gradient with the
// gated residual's dh pass).
static int proj_backward(DitGpu *m, int l, const BlockFp8Inputs *q8, int B, float wb, char *err) {
    const DitGpuActivations *a = &m->acts;
    DitGpuGradActs *g = &m->grad_acts;
    int h = m->cfg.hidden, T = m->tokens, stride = m->cfg.depth * 6 * h;
    BlockAt at = block_at(m, l, B);
    TRY(gated_residual_backward_cuda(NULL, g->proj, at.dada + 2 * h, g->residual, a->proj + at.o1, at.ada + 2 * h, B,
                                     T, h, stride, q8->dout_amax.proj, m->grads.proj_b + (size_t)l * h, &m->ctx,
                                     m->stream, err));
    return block_linear_backward(m, g->att_merged, m->grads.proj_w + (size_t)l * h * h, wb, NULL, g->proj,
                                 a->att_merged + at.o1, &q8->proj, m->weights.proj_w + (size_t)l * h * h,
                                 kept(&q8->weight_t.proj), B * T, h, h, q8->dout_amax.proj, q8->weight_amax.proj,
                                 err);
}

// proj_backward with its FP8 dout quantized by the gated residual's dh pass (as mlp_backward_fp8_douts)
static int proj_backward_fp8_dout(DitGpu *m, int l, const BlockFp8Inputs *q8, int B, float wb, char *err) {
    int h = m->cfg.hidden, BT = B * m->tokens;
    BlockAt at = block_at(m, l, B);
    Fp8Dout dout;
    TRY(gated_backward_fp8_dout(m, l, B, 2, m->acts.proj + at.o1, h, m->grads.proj_b + (size_t)l * h,
                                &q8->dout_scaling.proj, &dout, err));
    return linear_fp8_backward_quantized_cuda(m->grad_acts.att_merged, 0.0f, m->grads.proj_w + (size_t)l * h * h, wb,
                                              &dout, &q8->proj, m->weights.proj_w + (size_t)l * h * h,
                                              kept(&q8->weight_t.proj), BT, h, h, FP8_GRAD_FORMAT,
                                              q8->weight_amax.proj, m->fp8_workspace, m->fp8_workspace_bytes,
                                              &m->ctx, m->stream, err);
}

// The qkv linear from its dout g->qkv (the attention's gradients, merged) to g->ln1.
static int qkv_backward(DitGpu *m, int l, const BlockFp8Inputs *q8, int B, float wb, char *err) {
    int h = m->cfg.hidden;
    BlockAt at = block_at(m, l, B);
    return block_linear_backward(m, m->grad_acts.ln1, m->grads.qkv_w + (size_t)l * 3 * h * h, wb,
                                 m->grads.qkv_b + (size_t)l * 3 * h, m->grad_acts.qkv, m->acts.ln1 + at.o1, &q8->qkv,
                                 m->weights.qkv_w + (size_t)l * 3 * h * h, kept(&q8->weight_t.qkv), B * m->tokens, h,
                                 3 * h, q8->dout_amax.qkv, q8->weight_amax.qkv, err);
}

// qkv_backward with its FP8 dout and bias gradient from one pass over g->qkv (dout_fp8_cuda)
static int qkv_backward_fp8_dout(DitGpu *m, int l, const BlockFp8Inputs *q8, int B, float wb, char *err) {
    int h = m->cfg.hidden, BT = B * m->tokens;
    Fp8Dout dout;
    TRY(linear_fp8_dout_slots(&dout, m->fp8_workspace, m->fp8_workspace_bytes, BT, h, 3 * h, err));
    TRY(dout_fp8_cuda(&dout, m->grad_acts.qkv, m->grads.qkv_b + (size_t)l * 3 * h, BT, 3 * h, FP8_GRAD_FORMAT,
                      &q8->dout_scaling.qkv, &m->ctx, m->stream, err));
    return linear_fp8_backward_quantized_cuda(m->grad_acts.ln1, 0.0f, m->grads.qkv_w + (size_t)l * 3 * h * h, wb,
                                              &dout, &q8->qkv, m->weights.qkv_w + (size_t)l * 3 * h * h,
                                              kept(&q8->weight_t.qkv), BT, h, 3 * h, FP8_GRAD_FORMAT,
                                              q8->weight_amax.qkv, m->fp8_workspace, m->fp8_workspace_bytes,
                                              &m->ctx, m->stream, err);
}

// Zeroes the activation gradients from `first` up to (not including) `end`: buffers that the
// backward accumulates into (every CUDA backward adds, as the CPU ones).
static int zero_range(DitGpu *m, const void *first, const void *end, char *err) {
    size_t bytes = (size_t)((const char *)end - (const char *)first);
    CUDA_CHECK(err, cudaMemsetAsync((void *)first, 0, bytes, m->stream), "zeroing %zu bytes of gradients", bytes);
    return 0;
}

// dit_gpu_backward (fresh 0) and dit_gpu_backward_fresh (1): wb, the weight stacks' GEMM beta.
static int backward(DitGpu *m, int B, int fresh, char *err) {
    TRY(check_batch(m, B, fresh ? "dit_gpu_backward_fresh" : "dit_gpu_backward", err));
    if (fresh) TRY(zero_accumulated_grads(m, err));
    const float wb = fresh ? 0.0f : 1.0f;
    const DitConfig *c = &m->cfg;
    const DitGpuActivations *a = &m->acts;
    DitGpuGradActs *g = &m->grad_acts;
    const DitGpuWeights *w = &m->weights;
    DitParams *dw = &m->grads;
    const LayersCuda *ctx = &m->ctx;
    cudaStream_t s = m->stream;
    int h = c->hidden, T = m->tokens, P = dit_patch_dim(c), H = c->heads, D = h / H;
    int BT = B * T, L = c->depth, stride = L * 6 * h;
    size_t blk = (size_t)BT * h, bt = (size_t)BT;
    int ulysses = m->sp.ulysses > 1;
    const DitGpuSeqBuffers *sb = &m->sp_bufs;
    // every accumulated non-block gradient (they are contiguous from residual to ada)
    TRY(zero_range(m, g->residual, g->ada + (size_t)m->batch * stride, err));

    // final layer (sequence parallel: dL/dout is the whole image's; this rank takes its tokens)
    if (sp_size(m) > 1) {   // (unpatchify's backward adds into its output, as every backward here)
        TRY(zero_range(m, sb->tokens_full, sb->tokens_full + (size_t)B * dit_tokens(c) * P, err));
        TRY(unpatchify_backward_cuda(sb->tokens_full, g->out, B, c->channels, c->image_size, c->patch, s, err));
        TRY(take_token_shard(m, g->out_tokens, sb->tokens_full, B, err));
    } else {
        TRY(unpatchify_backward_cuda(g->out_tokens, g->out, B, c->channels, c->image_size, c->patch, s, err));
    }
    TRY(linear_backward_cuda(g->lnf, 1.0f, dw->final_w, 1.0f, dw->final_b, g->out_tokens, a->lnf, w->final_w, BT, h,
                             P, ctx, s, err));
    TRY(layernorm_modulate_backward_cuda(g->residual, g->final_ada, g->final_ada + h, g->lnf, a->residual + L * blk,
                                         a->lnf_mean, a->lnf_rstd, a->final_ada + h, B, T, h, 2 * h, ctx, s, err));
    TRY(cast_float_to_bf16_cuda(g->final_ada_bf16, g->final_ada, (size_t)B * 2 * h, s, err));
    TRY(linear_backward_cuda(g->c_silu, 1.0f, dw->final_ada_w, 1.0f, dw->final_ada_b, g->final_ada_bf16, a->c_silu,
                             w->final_ada_w, B, h, 2 * h, ctx, s, err));

    TRY(backward_fp8_amax(m, err));
    // The blocks. g->residual holds dL/dx_next on entry and dL/dx on exit: the residual adds of
    // x_next = x_mid + … and x_mid = x + … pass the gradient through unchanged (dres = NULL),
    // and the LayerNorm backwards add their part into it.
    for (int l = L - 1; l >= 0; l--) {
        const bf16 *ada = a->ada + (size_t)l * 6 * h;
        float *dada = g->ada + (size_t)l * 6 * h;
        size_t o1 = l * blk, ost = l * bt;
        // FP8: the inputs the forward quantized, and the douts' amax (from the kernels writing them)
        BlockFp8Inputs q8 = block_fp8_inputs(m, l);
        // every activation gradient of the block is written by its one producer, except the head-major
        // dout of sequence parallelism, into which merge_heads_backward adds
        if (!attention_merged(m)) TRY(zero_range(m, g->att, g->att + blk, err));

        // x_next = x_mid + gate_mlp·fc2(gelu(fc1(...))), then x_mid = x + gate_msa·proj(attention(...))
        TRY(fp8_douts_fused(m) ? mlp_backward_fp8_douts(m, l, &q8, B, wb, err) : mlp_backward(m, l, &q8, B, wb, err));
        TRY(layernorm_modulate_backward_cuda(g->residual, dada + 3 * h, dada + 4 * h, g->ln2, a->x_mid + o1,
                                             a->ln2_mean + ost, a->ln2_rstd + ost, ada + 4 * h, B, T, h, stride,
                                             ctx, s, err));
        TRY(fp8_douts_fused(m) ? proj_backward_fp8_dout(m, l, &q8, B, wb, err) : proj_backward(m, l, &q8, B, wb, err));
        // the attention's dout: the projection's input gradient as it is (attention_merged), or split
        // into heads
        if (!attention_merged(m)) TRY(merge_heads_backward_cuda(g->att, g->att_merged, B, T, H, D, s, err));
        // qkv's dout: its amax taken by the passes that write it, or by the pass that quantizes it
        float *qkv_amax = fp8_douts_fused(m) ? NULL : q8.dout_amax.qkv;
        if (ulysses) {   // the adjoint of the forward's moves: dout to heads, the gradients back
            TRY(ulysses_attention_backward(m, l, g->att, B, err));
            TRY(merge_qkv_grad(m, g->qkv, sb->dqkv_local, sb->dqkv_local + blk, sb->dqkv_local + 2 * blk, false,
                               qkv_amax, B, err));
        } else {
            // (merged: dk and dv go straight into g->qkv's k and v columns, as bf16, with their amax;
            // g->dk and g->dv are NULL)
            TRY(attention_backward_gpu(m, l, B, 0, 0, B * heads_here(m), g->dq, g->dk, g->dv, g->qkv, qkv_amax,
                                       attention_merged(m) ? g->att_merged : g->att, err));
            TRY(merge_qkv_grad(m, g->qkv, g->dq, g->dk, g->dv, sage_rotates(m), qkv_amax, B, err));
        }
        TRY(fp8_douts_fused(m) ? qkv_backward_fp8_dout(m, l, &q8, B, wb, err) : qkv_backward(m, l, &q8, B, wb, err));
        TRY(layernorm_modulate_backward_cuda(g->residual, dada, dada + h, g->ln1, a->residual + o1,
                                             a->ln1_mean + ost, a->ln1_rstd + ost, ada + h, B, T, h, stride,
                                             ctx, s, err));
        // zero_overlap: block l's adaLN weight (6h, h) and bias (6h) gradients, now final:
        // dW_l += dada_lᵀ·c_silu, db_l += Σ_b dada_l, with dada_l (B, 6h) cast to bf16 in the first
        // B·6h of ada_bf16 (free until the cast after the loop); the same sums over b as the
        // stacked GEMM's rows l·6h .. (l + 1)·6h (dev/notes_sequence_parallel.md)
        if (m->sp.zero_overlap) {
            TRY(cast_float_to_bf16_rows_cuda(g->ada_bf16, dada, B, 6 * h, stride, s, err));
            TRY(linear_backward_cuda(NULL, 1.0f, dw->ada_w + (size_t)l * 6 * h * h, wb,
                                     dw->ada_b + (size_t)l * 6 * h, g->ada_bf16, a->c_silu, NULL, B, h, 6 * h, ctx,
                                     s, err));
        }
        // block l's weight gradients are final: ZeRO-1 may reduce them now (model/zero.h)
        if (m->block_grads_done)
            CUDA_CHECK(err, cudaEventRecord(m->block_grads_done[l], s), "record block %d's gradients done", l);
    }

    // conditioning: c_silu feeds every adaLN (their weight gradients here unless made per block);
    // c = t_emb + y_emb passes its gradient to both
    int stacked = !m->sp.zero_overlap;
    TRY(cast_float_to_bf16_cuda(g->ada_bf16, g->ada, (size_t)B * stride, s, err));
    TRY(linear_backward_cuda(g->c_silu, 1.0f, stacked ? dw->ada_w : NULL, wb, stacked ? dw->ada_b : NULL,
                             g->ada_bf16, a->c_silu, w->ada_w, B, h, stride, ctx, s, err));
    TRY(silu_backward_cuda(g->c, a->c, g->c_silu, (size_t)B * h, s, err));
    TRY(embedding_backward_cuda(dw->y_table, g->c, a->labels, B, h, s, err));
    TRY(linear_backward_cuda(g->t_h_silu, 1.0f, dw->t_w2, 1.0f, dw->t_b2, g->c, a->t_h_silu, w->t_w2, B, h, h, ctx,
                             s, err));
    TRY(silu_backward_cuda(g->t_h, a->t_h, g->t_h_silu, (size_t)B * h, s, err));
    TRY(linear_backward_cuda(NULL, 1.0f, dw->t_w1, 1.0f, dw->t_b1, g->t_h, a->t_freq, w->t_w1, B, TIMESTEP_FREQ_DIM,
                             h, ctx, s, err));

    // patch embedding (the positions are fixed)
    return linear_backward_cuda(NULL, 1.0f, dw->patch_w, 1.0f, dw->patch_b, g->residual, a->patches, w->patch_w, BT,
                                P, h, ctx, s, err);
}

int dit_gpu_backward(DitGpu *m, int B, char *err) { return backward(m, B, 0, err); }
int dit_gpu_backward_fresh(DitGpu *m, int B, char *err) { return backward(m, B, 1, err); }

void dit_gpu_block_grad_ranges(const DitGpu *m, int first, int count, size_t *offsets, size_t *numels) {
    size_t h = m->cfg.hidden;
    const DitParams *g = &m->grads;
    // (the stack, one block's floats) in buffer order
    const struct { const float *stack; size_t per_block; } kinds[DIT_BLOCK_GRAD_RANGES] = {
        {g->ada_w, 6 * h * h}, {g->ada_b, 6 * h}, {g->qkv_w, 3 * h * h}, {g->qkv_b, 3 * h},
        {g->proj_w, h * h}, {g->proj_b, h}, {g->fc1_w, 4 * h * h}, {g->fc1_b, 4 * h},
        {g->fc2_w, 4 * h * h}, {g->fc2_b, h},
    };
    for (int k = 0; k < DIT_BLOCK_GRAD_RANGES; k++) {
        offsets[k] = (size_t)(kinds[k].stack - m->grads_memory) + first * kinds[k].per_block;
        numels[k] = count * kinds[k].per_block;
    }
}

// ---- optimizer ---------------------------------------------------------------------------

// This rank's slice of the parameter buffer: [*lo, *hi) (empty when the padding is all of it).
static void shard_range(const DitGpu *m, size_t *lo, size_t *hi) {
    *lo = m->shard_rank * m->shard_size;
    *hi = *lo + m->shard_size < m->num_params ? *lo + m->shard_size : m->num_params;
    if (*lo > *hi) *lo = *hi;
}

int dit_gpu_grad_sumsq(DitGpu *m, char *err) {
    size_t lo, hi;
    shard_range(m, &lo, &hi);
    if (lo == hi) {
        CUDA_CHECK(err, cudaMemsetAsync(m->acts.grad_sumsq, 0, sizeof(float), m->stream), "an empty slice's Σ g²");
        return 0;
    }
    return sum_squares_cuda(m->acts.grad_sumsq, m->grads_memory + lo, hi - lo, &m->ctx, m->stream, err);
}

int dit_gpu_set_step(DitGpu *m, float lr, float beta1, float beta2, float ema_decay, int step, char *err) {
    OptimizerStepConstants k;
    TRY(optimizer_step_constants(&k, lr, beta1, beta2, step, ema_decay, err));
    int i = m->step_next;
    CUDA_CHECK(err, cudaEventSynchronize(m->step_copied[i]), "dit_gpu_set_step: entry %d's previous copy", i);
    m->step_constants_host[i] = k;
    CUDA_CHECK(err, cudaMemcpyAsync(m->step_constants, &m->step_constants_host[i], sizeof(k), cudaMemcpyHostToDevice,
                                    m->stream), "copy of the step constants (step %d)", step);
    CUDA_CHECK(err, cudaEventRecord(m->step_copied[i], m->stream), "record the copy of the step constants (step %d)", step);
    m->step_next = 1 - i;
    return 0;
}

// dit_gpu_update's kernels, after dit_gpu_set_step: the norm, then AdamW with the EMA in the same
// pass, reading the step's values from m->step_constants (what the step's graph captures).
static int queue_optimizer(DitGpu *m, float beta1, float beta2, float eps, float weight_decay, float grad_clip,
                           char *err) {
    cudaStream_t s = m->stream;
    TRY(sqrt_cuda(m->acts.grad_norm, m->acts.grad_sumsq, s, err));
    size_t lo, hi;
    shard_range(m, &lo, &hi);
    // AdamW + EMA over runs of consecutive tensors with the same weight decay (matrices or
    // vectors), cut to the slice: the per-block copies of a tensor are adjacent, so this is one
    // launch per tensor kind (and slice edge). The tensors tile the buffer without gaps.
    int n = dit_num_tensors(&m->cfg);
    DitTensorInfo *info = (DitTensorInfo *)malloc(n * sizeof(DitTensorInfo));
    if (!info) {
        dit_set_error(err, "dit_gpu_update: out of host memory for %d tensor infos", n);
        return -1;
    }
    dit_tensor_infos(&m->cfg, info);
    int status = 0;
    for (int i = 0; i < n && status == 0;) {
        int j = i + 1;
        while (j < n && (info[j].ndim >= 2) == (info[i].ndim >= 2)) j++;
        size_t o = info[i].offset, end = info[j - 1].offset + info[j - 1].numel;
        if (o < lo) o = lo;
        if (end > hi) end = hi;
        float wd = info[i].ndim >= 2 ? weight_decay : 0.0f;
        if (o < end)
            status = adamw_update_cuda(m->params_memory + o, m->params_bf16_memory + o, m->grads_memory + o,
                                       m->adam_m_memory + o, m->adam_v_memory + o, m->ema_memory + o, end - o,
                                       m->step_constants, beta1, beta2, eps, wd, m->acts.grad_norm, grad_clip, s, err);
        i = j;
    }
    free(info);
    return status;
}

int dit_gpu_update(DitGpu *m, float lr, float beta1, float beta2, float eps, float weight_decay,
                   float grad_clip, float ema_decay, int step, char *err) {
    TRY(dit_gpu_set_step(m, lr, beta1, beta2, ema_decay, step, err));
    return queue_optimizer(m, beta1, beta2, eps, weight_decay, grad_clip, err);
}

// ---- the training step as a CUDA graph ----------------------------------------------------

// What the graph holds: train_dit's eager calls from the forward to the update, without the
// copy of the step constants (dit_gpu_set_step, before the launch).
static int queue_train_step(DitGpu *m, int B, const DitGpuStepKey *k, char *err) {
    return (dit_gpu_forward(m, &m->weights, B, err) || dit_gpu_loss(m, B, err) || dit_gpu_backward_fresh(m, B, err) ||
            dit_gpu_grad_sumsq(m, err) ||
            queue_optimizer(m, k->beta1, k->beta2, k->eps, k->weight_decay, k->grad_clip, err)) ? -1 : 0;
}

// Captures queue_train_step into m->step_graph and instantiates it. Global capture mode: any
// call that cannot be captured (cudaMalloc, a synchronous copy or synchronization), from this
// thread or another, fails the capture instead of running outside the graph.
static int capture_step_graph(DitGpu *m, int B, char *err) {
    DitGpuStepGraph *sg = &m->step_graph;
    CUDA_CHECK(err, cudaStreamBeginCapture(m->stream, cudaStreamCaptureModeGlobal),
               "dit_gpu_train_step_graph: cudaStreamBeginCapture (batch %d)", B);
    char body_err[DIT_ERR_LEN] = "";
    int body = queue_train_step(m, B, &sg->key, body_err);
    cudaGraph_t graph = NULL;
    cudaError_t end = cudaStreamEndCapture(m->stream, &graph);   // always: the stream leaves capture mode
    if (body != 0 || end != cudaSuccess) {
        if (graph) cudaGraphDestroy(graph);
        dit_set_error(err, "dit_gpu_train_step_graph: capturing the training step (batch %d) failed: %s; "
                           "cudaStreamEndCapture: %s", B, body != 0 ? body_err : "every call succeeded",
                      cudaGetErrorString(end));
        return -1;
    }
    sg->graph = graph;
    CUDA_CHECK(err, cudaGraphInstantiate(&sg->exec, graph, 0), "dit_gpu_train_step_graph: cudaGraphInstantiate "
               "(batch %d)", B);
    sg->captures++;
    return 0;
}

int dit_gpu_train_step_graph(DitGpu *m, int B, float lr, float beta1, float beta2, float eps, float weight_decay,
                             float grad_clip, float ema_decay, int step, char *err) {
    TRY(check_batch(m, B, "dit_gpu_train_step_graph", err));
    if (sp_size(m) > 1 || m->shards > 1) {
        dit_set_error(err, "dit_gpu_train_step_graph: one GPU only (this model: sequence parallel over %d ranks, %d "
                           "optimizer shards); several ranks run the step eagerly", sp_size(m), m->shards);
        return -1;
    }
    DitGpuStepKey key;
    memset(&key, 0, sizeof(key));   // compared with memcmp
    key.B = B;
    key.sage = m->sage;
    key.sage_deterministic = sage_backward_deterministic();
    key.flash_deterministic = flash_backward_deterministic();
    key.fp8_fused_inputs = m->fp8_fused_inputs;
    key.fp8_grad_headroom = m->fp8_grad_headroom;
    key.fp8_accumulation = m->ctx.fp8_accumulation;
    key.beta1 = beta1;
    key.beta2 = beta2;
    key.eps = eps;
    key.weight_decay = weight_decay;
    key.grad_clip = grad_clip;
    DitGpuStepGraph *sg = &m->step_graph;
    if (memcmp(&key, &sg->key, sizeof(key)) != 0) {   // something the graph baked in changed
        TRY(drop_step_graph(m, err));
        sg->key = key;
        sg->warm = 0;
    }
    TRY(dit_gpu_set_step(m, lr, beta1, beta2, ema_decay, step, err));
    if (!sg->warm) {
        sg->warm = 1;
        return queue_train_step(m, B, &key, err);
    }
    if (!sg->exec) TRY(capture_step_graph(m, B, err));
    CUDA_CHECK(err, cudaGraphLaunch(sg->exec, m->stream), "dit_gpu_train_step_graph: cudaGraphLaunch (step %d, batch %d)",
               step, B);
    sg->launches++;
    return 0;
}

int dit_gpu_queue_scalars(DitGpu *m, float *loss, float *grad_norm, cudaEvent_t done, char *err) {
    if (loss)
        CUDA_CHECK(err, cudaMemcpyAsync(loss, m->acts.loss, sizeof(float), cudaMemcpyDeviceToHost, m->stream), "read the loss");
    if (grad_norm)
        CUDA_CHECK(err, cudaMemcpyAsync(grad_norm, m->acts.grad_norm, sizeof(float), cudaMemcpyDeviceToHost, m->stream),
                   "read the gradient norm");
    if (done) CUDA_CHECK(err, cudaEventRecord(done, m->stream), "record the step's end");
    return 0;
}

int dit_gpu_read_scalars(DitGpu *m, float *loss, float *grad_norm, char *err) {
    TRY(dit_gpu_queue_scalars(m, loss, grad_norm, NULL, err));
    CUDA_CHECK(err, cudaStreamSynchronize(m->stream), "the step's kernels");
    return 0;
}

int dit_gpu_download_output(DitGpu *m, float *out, int B, char *err) {
    TRY(check_batch(m, B, "dit_gpu_download_output", err));
    size_t n = image_floats(&m->cfg, B);
    TRY(cast_bf16_to_float_cuda(m->acts.out_float, m->acts.out, n, m->stream, err));
    CUDA_CHECK(err, cudaMemcpyAsync(out, m->acts.out_float, n * sizeof(float), cudaMemcpyDeviceToHost, m->stream),
               "download of the output (%zu floats)", n);
    CUDA_CHECK(err, cudaStreamSynchronize(m->stream), "download of the output");
    return 0;
}

int dit_gpu_download_grads(DitGpu *m, float *grads, char *err) {
    CUDA_CHECK(err, cudaMemcpyAsync(grads, m->grads_memory, m->num_params * sizeof(float), cudaMemcpyDeviceToHost,
                                    m->stream), "download of %zu gradients", m->num_params);
    CUDA_CHECK(err, cudaStreamSynchronize(m->stream), "download of the gradients");
    return 0;
}

// ---- sampling ----------------------------------------------------------------------------

int dit_gpu_sample(DitGpu *m, float *x, const int *labels, int n, int steps, float cfg_scale, char *err) {
    const DitConfig *c = &m->cfg;
    size_t img = image_floats(c, 1);
    int chunk = m->batch;
    float *t = (float *)malloc(chunk * sizeof(float));
    float *v_cond = (float *)malloc(chunk * img * sizeof(float));
    float *v_uncond = (float *)malloc(chunk * img * sizeof(float));
    int *null_labels = (int *)malloc(chunk * sizeof(int));
    int status = 0;
    if (!t || !v_cond || !v_uncond || !null_labels) {
        dit_set_error(err, "dit_gpu_sample: out of host memory for %d images", chunk);
        status = -1;
    }
    if (status == 0) status = cast_float_to_bf16_cuda(m->ema_bf16_memory, m->ema_memory, m->num_params, m->stream, err);
    for (int i = 0; status == 0 && i < chunk; i++) null_labels[i] = c->num_classes;
    for (int start = 0; status == 0 && start < n; start += chunk) {
        int B = n - start < chunk ? n - start : chunk;
        float *xb = x + start * img;
        for (int k = 0; status == 0 && k < steps; k++) {
            float t_now = 1.0f - (float)k / steps, dt = 1.0f / steps;
            for (int i = 0; i < B; i++) t[i] = t_now;
            status = dit_gpu_set_inputs(m, xb, t, labels + start, B, err) ||
                     dit_gpu_forward(m, &m->ema_weights, B, err) || dit_gpu_download_output(m, v_cond, B, err);
            if (status == 0 && cfg_scale != 1.0f) {
                status = dit_gpu_set_inputs(m, xb, t, null_labels, B, err) ||
                         dit_gpu_forward(m, &m->ema_weights, B, err) || dit_gpu_download_output(m, v_uncond, B, err);
                for (size_t j = 0; status == 0 && j < B * img; j++)
                    v_cond[j] = v_uncond[j] + cfg_scale * (v_cond[j] - v_uncond[j]);
            }
            for (size_t j = 0; status == 0 && j < B * img; j++) xb[j] -= dt * v_cond[j];
        }
    }
    free(t); free(v_cond); free(v_uncond); free(null_labels);
    return status ? -1 : 0;
}

// ---- FLOPs -------------------------------------------------------------------------------

double dit_train_flops(const DitConfig *c, int B) {
    // Forward matmul FLOPs (2 per multiply-add), then ×3 for forward + backward.
    // per token: patch embedding 2·P·h; per block qkv 6h², proj 2h², fc1 8h², fc2 8h² (= 24h²)
    //   and attention 4·T·h (Q·Kᵀ and P·V over T keys); final linear 2·h·P.
    // per image: timestep MLP 2·(256·h + h²), adaLN of all blocks 2·h·6h·depth, final adaLN 2·h·2h.
    double h = c->hidden, T = dit_tokens(c), P = dit_patch_dim(c), L = c->depth;
    double per_token = 2 * P * h + L * (24 * h * h + 4 * T * h) + 2 * h * P;
    double per_image = 2 * (TIMESTEP_FREQ_DIM * h + h * h) + 2 * h * 6 * h * L + 2 * h * 2 * h;
    return 3.0 * B * (T * per_token + per_image);
}
