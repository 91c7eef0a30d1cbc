// The DiT model (Peebles & Xie, adaLN-Zero blocks) on the CPU in fp32: configuration, parameters
// in one buffer, activations in one buffer, forward and backward built from layers/ and attention/.
// Parameter names and layouts are those of facebookresearch/DiT, so weights are interchangeable.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "attention/attention.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int image_size;   // S: images are S×S
    int channels;     // C: image channels (in = out; the model predicts a velocity)
    int patch;        // p: patch side; T = (S/p)² tokens
    int hidden;       // h: width of the residual stream
    int depth;        // number of DiT blocks
    int heads;        // attention heads; head dim = hidden/heads
    int num_classes;  // class labels 0..num_classes-1; num_classes is the null label
} DitConfig;

// Presets "tiny" (tests), "S", "B", "L", "XL" (DiT's depth/hidden/heads); image size, channels,
// patch and classes are filled with defaults for the built-in dataset and can be overridden.
int dit_config_preset(DitConfig *cfg, const char *name, char *err);
int dit_config_validate(const DitConfig *cfg, char *err);
static inline int dit_tokens(const DitConfig *c) { return (c->image_size / c->patch) * (c->image_size / c->patch); }
static inline int dit_patch_dim(const DitConfig *c) { return c->channels * c->patch * c->patch; }

// ---- parameters: named views into one contiguous buffer; per-block tensors stacked (depth, …) ----
typedef struct {
    float *patch_w, *patch_b;         // (h, C·p·p), (h)          x_embedder.proj
    float *t_w1, *t_b1;               // (h, 256), (h)            t_embedder.mlp.0
    float *t_w2, *t_b2;               // (h, h), (h)              t_embedder.mlp.2
    float *y_table;                   // (num_classes + 1, h)     y_embedder.embedding_table
    float *ada_w, *ada_b;             // (depth, 6h, h), (depth, 6h)  blocks.i.adaLN_modulation.1
    float *qkv_w, *qkv_b;             // (depth, 3h, h), (depth, 3h)  blocks.i.attn.qkv
    float *proj_w, *proj_b;           // (depth, h, h), (depth, h)    blocks.i.attn.proj
    float *fc1_w, *fc1_b;             // (depth, 4h, h), (depth, 4h)  blocks.i.mlp.fc1
    float *fc2_w, *fc2_b;             // (depth, h, 4h), (depth, h)   blocks.i.mlp.fc2
    float *final_ada_w, *final_ada_b; // (2h, h), (2h)            final_layer.adaLN_modulation.1
    float *final_w, *final_b;         // (p·p·C, h), (p·p·C)      final_layer.linear
} DitParams;
#define DIT_NUM_PARAM_TENSORS 21

// One parameter tensor as stored in a checkpoint (per-block tensors appear once per block).
typedef struct {
    char name[64];        // DiT's state_dict name, e.g. "blocks.3.attn.qkv.weight"
    int ndim;
    int64_t shape[4];
    size_t offset, numel; // position in the parameter buffer, in floats
} DitTensorInfo;
// Fills `info` (capacity dit_num_tensors(cfg)) and returns the count.
int dit_num_tensors(const DitConfig *cfg);
int dit_tensor_infos(const DitConfig *cfg, DitTensorInfo *info);
size_t dit_num_params(const DitConfig *cfg);
void dit_param_views(const DitConfig *cfg, float *memory, DitParams *p);

// ---- activations of one forward pass (batch B), kept for the backward ----------------------
typedef struct {
    float *patches;                  // (B, T, C·p·p)
    float *t_freq;                   // (B, 256)
    float *t_h, *t_h_silu, *t_emb;   // (B, h) each
    float *y_emb, *c, *c_silu;       // (B, h) each: c = t_emb + y_emb
    float *ada;                      // (B, depth·6h): all blocks' modulation, one GEMM
    float *residual;                 // (depth + 1, B, T, h): input of each block, and the last output
    float *ln1, *ln1_mean, *ln1_rstd;// (depth, B, T, h), (depth, B, T) ×2
    float *qkv;                      // (depth, B, T, 3h)
    float *q, *k, *v;                // (depth, B, H, T, D) each
    float *att, *att_lse;            // (depth, B, H, T, D), (depth, B, H, T)
    float *att_merged, *proj;        // (depth, B, T, h) each
    float *x_mid;                    // (depth, B, T, h): after the attention residual
    float *ln2, *ln2_mean, *ln2_rstd;// (depth, B, T, h), (depth, B, T) ×2
    float *fc1, *gelu;               // (depth, B, T, 4h) each
    float *fc2;                      // (depth, B, T, h)
    float *final_ada;                // (B, 2h)
    float *lnf, *lnf_mean, *lnf_rstd;// (B, T, h), (B, T) ×2
    float *out_tokens;               // (B, T, p·p·C)
    float *out;                      // (B, C, S, S): the predicted velocity
} DitActivations;

// The attention of the blocks: exact, or sage with FP8 P·V (the fast one on Hopper) or with FP16
// P·V (more accurate). A model stores DIT_ATTN_SAGE for both sage kinds and the P·V format in
// its SageConfig (m->sage.pv).
typedef enum { DIT_ATTN_EXACT = 0, DIT_ATTN_SAGE = 1, DIT_ATTN_SAGE_FP16 = 2 } DitAttention;

typedef struct {
    DitConfig cfg;
    size_t num_params;
    float *params_memory, *grads_memory, *ema_memory, *adam_m_memory, *adam_v_memory;
    DitParams params, grads, ema;
    int batch;                       // activations are allocated for this batch size
    size_t num_acts;
    float *acts_memory, *grad_acts_memory;
    DitActivations acts, grad_acts;
    float *pos_embed;                // (T, h), fixed
    DitAttention attention;
    SageConfig sage;
} Dit;

// Allocates everything for batches of up to `batch` images and applies DiT's initialization
// (xavier-uniform linears, N(0, 0.02) embeddings, zero adaLN and final layer: output exactly 0).
int dit_create(Dit *m, const DitConfig *cfg, int batch, DitAttention attention, uint64_t seed, char *err);
void dit_free(Dit *m);
// Forward of B ≤ m->batch images with the given weights (m->params, or m->ema for sampling):
// x_t (B, C, S, S), t (B) in [0, 1], labels (B) in 0..num_classes. Output in m->acts.out.
void dit_forward(Dit *m, const DitParams *w, const float *x_t, const float *t, const int *labels, int B);
// Backward of the last forward (with m->params): dout (B, C, S, S) = dLoss/dout.
// Parameter gradients ACCUMULATE into m->grads (call dit_zero_grad first).
void dit_backward(Dit *m, const float *dout, const int *labels, int B);
void dit_zero_grad(Dit *m);
// AdamW on every tensor (weight decay only for tensors with ndim ≥ 2), gradients times grad_scale.
void dit_adamw_step(Dit *m, float lr, float beta1, float beta2, float eps, float weight_decay,
                    float grad_scale, int step);

#ifdef __cplusplus
}
#endif
