// The DiT model on the CPU: parameter layout, initialization, forward and backward.
// Read dit_forward and dit_backward side by side: the backward walks the forward in reverse.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "layers/common.h"
#include "layers/layers.h"
#include "model/dit.h"

// ---- configuration -----------------------------------------------------------------------

int dit_config_preset(DitConfig *cfg, const char *name, char *err) {
    // DiT's model sizes (Table 1 of the paper); image defaults fit the built-in 32×32 dataset.
    // "tiny" trains on a CPU in minutes (patch 4: 64 tokens on 32×32 images; head dim 64, which
    // the GPU kernels support); the others are DiT-*/2.
    static const struct { const char *name; int depth, hidden, heads, patch; } presets[] = {
        {"tiny", 2, 128, 2, 4}, {"S", 12, 384, 6, 2}, {"B", 12, 768, 12, 2},
        {"L", 24, 1024, 16, 2}, {"XL", 28, 1152, 16, 2},
    };
    for (size_t i = 0; i < sizeof(presets) / sizeof(presets[0]); i++) {
        if (strcmp(presets[i].name, name) != 0) continue;
        *cfg = (DitConfig){.image_size = 32, .channels = 1, .patch = presets[i].patch, .hidden = presets[i].hidden,
                           .depth = presets[i].depth, .heads = presets[i].heads, .num_classes = 10};
        return 0;
    }
    dit_set_error(err, "--model: unknown preset '%s' (expected tiny, S, B, L or XL)", name);
    return -1;
}

int dit_config_validate(const DitConfig *c, char *err) {
    if (c->image_size <= 0 || c->channels <= 0 || c->patch <= 0 || c->hidden <= 0 ||
        c->depth <= 0 || c->heads <= 0 || c->num_classes <= 0) {
        dit_set_error(err, "model config: every size must be positive (image_size %d, channels %d, "
                      "patch %d, hidden %d, depth %d, heads %d, num_classes %d)", c->image_size,
                      c->channels, c->patch, c->hidden, c->depth, c->heads, c->num_classes);
        return -1;
    }
    // upper bounds keep every token count and buffer offset within int / size_t arithmetic
    if (c->image_size > 8192 || c->channels > 64 || c->hidden > 65536 || c->depth > 1024 ||
        c->num_classes > 1000000 || (c->image_size / c->patch) * (c->image_size / c->patch) > (1 << 20)) {
        dit_set_error(err, "model config: too large (image_size %d ≤ 8192, channels %d ≤ 64, hidden %d ≤ 65536, "
                      "depth %d ≤ 1024, num_classes %d ≤ 1000000, tokens (image_size/patch)² ≤ 1048576)",
                      c->image_size, c->channels, c->hidden, c->depth, c->num_classes);
        return -1;
    }
    if (c->image_size % c->patch != 0) {
        dit_set_error(err, "model config: image_size %d is not a multiple of patch %d", c->image_size, c->patch);
        return -1;
    }
    if (c->hidden % c->heads != 0) {
        dit_set_error(err, "model config: hidden %d is not a multiple of heads %d", c->hidden, c->heads);
        return -1;
    }
    if (c->hidden % 4 != 0) {
        dit_set_error(err, "model config: hidden %d must be a multiple of 4 (2D sin-cos positions)", c->hidden);
        return -1;
    }
    return 0;
}

// ---- parameter layout --------------------------------------------------------------------

// The parameter tensors in buffer order. Per-block tensors are stacked (depth, …) in the buffer
// and named once per block in checkpoints.
typedef struct { const char *name; int per_block; int ndim; int64_t shape[2]; } ParamSpec;

static void param_specs(const DitConfig *c, ParamSpec spec[DIT_NUM_PARAM_TENSORS]) {
    int64_t h = c->hidden, P = dit_patch_dim(c), out = (int64_t)c->patch * c->patch * c->channels;
    ParamSpec s[DIT_NUM_PARAM_TENSORS] = {
        {"x_embedder.proj.weight", 0, 2, {h, P}},  {"x_embedder.proj.bias", 0, 1, {h, 0}},
        {"t_embedder.mlp.0.weight", 0, 2, {h, TIMESTEP_FREQ_DIM}}, {"t_embedder.mlp.0.bias", 0, 1, {h, 0}},
        {"t_embedder.mlp.2.weight", 0, 2, {h, h}}, {"t_embedder.mlp.2.bias", 0, 1, {h, 0}},
        {"y_embedder.embedding_table.weight", 0, 2, {c->num_classes + 1, h}},
        {"adaLN_modulation.1.weight", 1, 2, {6 * h, h}}, {"adaLN_modulation.1.bias", 1, 1, {6 * h, 0}},
        {"attn.qkv.weight", 1, 2, {3 * h, h}}, {"attn.qkv.bias", 1, 1, {3 * h, 0}},
        {"attn.proj.weight", 1, 2, {h, h}}, {"attn.proj.bias", 1, 1, {h, 0}},
        {"mlp.fc1.weight", 1, 2, {4 * h, h}}, {"mlp.fc1.bias", 1, 1, {4 * h, 0}},
        {"mlp.fc2.weight", 1, 2, {h, 4 * h}}, {"mlp.fc2.bias", 1, 1, {h, 0}},
        {"final_layer.adaLN_modulation.1.weight", 0, 2, {2 * h, h}},
        {"final_layer.adaLN_modulation.1.bias", 0, 1, {2 * h, 0}},
        {"final_layer.linear.weight", 0, 2, {out, h}}, {"final_layer.linear.bias", 0, 1, {out, 0}},
    };
    memcpy(spec, s, sizeof(s));
}

static size_t spec_numel(const ParamSpec *s) { return (size_t)s->shape[0] * (s->ndim == 2 ? (size_t)s->shape[1] : 1); }

size_t dit_num_params(const DitConfig *cfg) {
    ParamSpec spec[DIT_NUM_PARAM_TENSORS];
    param_specs(cfg, spec);
    size_t n = 0;
    for (int i = 0; i < DIT_NUM_PARAM_TENSORS; i++) n += spec_numel(&spec[i]) * (spec[i].per_block ? cfg->depth : 1);
    return n;
}

void dit_param_views(const DitConfig *cfg, float *memory, DitParams *p) {
    ParamSpec spec[DIT_NUM_PARAM_TENSORS];
    param_specs(cfg, spec);
    float **views[DIT_NUM_PARAM_TENSORS] = {
        &p->patch_w, &p->patch_b, &p->t_w1, &p->t_b1, &p->t_w2, &p->t_b2, &p->y_table,
        &p->ada_w, &p->ada_b, &p->qkv_w, &p->qkv_b, &p->proj_w, &p->proj_b,
        &p->fc1_w, &p->fc1_b, &p->fc2_w, &p->fc2_b,
        &p->final_ada_w, &p->final_ada_b, &p->final_w, &p->final_b,
    };
    for (int i = 0; i < DIT_NUM_PARAM_TENSORS; i++) {
        *views[i] = memory;
        memory += spec_numel(&spec[i]) * (spec[i].per_block ? cfg->depth : 1);
    }
}

int dit_num_tensors(const DitConfig *cfg) {
    ParamSpec spec[DIT_NUM_PARAM_TENSORS];
    param_specs(cfg, spec);
    int n = 0;
    for (int i = 0; i < DIT_NUM_PARAM_TENSORS; i++) n += spec[i].per_block ? cfg->depth : 1;
    return n;
}

int dit_tensor_infos(const DitConfig *cfg, DitTensorInfo *info) {
    ParamSpec spec[DIT_NUM_PARAM_TENSORS];
    param_specs(cfg, spec);
    int n = 0;
    size_t offset = 0;
    for (int i = 0; i < DIT_NUM_PARAM_TENSORS; i++) {
        int copies = spec[i].per_block ? cfg->depth : 1;
        for (int l = 0; l < copies; l++) {
            DitTensorInfo *t = &info[n++];
            if (spec[i].per_block) snprintf(t->name, sizeof(t->name), "blocks.%d.%s", l, spec[i].name);
            else snprintf(t->name, sizeof(t->name), "%s", spec[i].name);
            t->ndim = spec[i].ndim;
            t->shape[0] = spec[i].shape[0];
            t->shape[1] = spec[i].shape[1];
            if (i == 0) {   // the patch embedding is a Conv2d: (h, C, p, p)
                t->ndim = 4;
                t->shape[1] = cfg->channels;
                t->shape[2] = t->shape[3] = cfg->patch;
            }
            t->numel = spec_numel(&spec[i]);
            t->offset = offset;
            offset += t->numel;
        }
    }
    return n;
}

// ---- activation layout -------------------------------------------------------------------

static size_t activation_views(const DitConfig *c, int B, float *memory, DitActivations *a) {
    size_t h = c->hidden, L = c->depth, T = dit_tokens(c), BT = (size_t)B * T;
    size_t P = dit_patch_dim(c), img = (size_t)B * c->channels * c->image_size * c->image_size;
    struct { float **view; size_t n; } list[] = {
        {&a->patches, BT * P}, {&a->t_freq, B * (size_t)TIMESTEP_FREQ_DIM},
        {&a->t_h, B * h}, {&a->t_h_silu, B * h}, {&a->t_emb, B * h},
        {&a->y_emb, B * h}, {&a->c, B * h}, {&a->c_silu, B * h}, {&a->ada, B * L * 6 * h},
        {&a->residual, (L + 1) * BT * h},
        {&a->ln1, L * BT * h}, {&a->ln1_mean, L * BT}, {&a->ln1_rstd, L * BT},
        {&a->qkv, L * BT * 3 * h}, {&a->q, L * BT * h}, {&a->k, L * BT * h}, {&a->v, L * BT * h},
        {&a->att, L * BT * h}, {&a->att_lse, L * BT * c->heads},
        {&a->att_merged, L * BT * h}, {&a->proj, L * BT * h}, {&a->x_mid, L * BT * h},
        {&a->ln2, L * BT * h}, {&a->ln2_mean, L * BT}, {&a->ln2_rstd, L * BT},
        {&a->fc1, L * BT * 4 * h}, {&a->gelu, L * BT * 4 * h}, {&a->fc2, L * BT * h},
        {&a->final_ada, B * 2 * h}, {&a->lnf, BT * h}, {&a->lnf_mean, BT}, {&a->lnf_rstd, BT},
        {&a->out_tokens, BT * P}, {&a->out, img},
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof(list) / sizeof(list[0]); i++) {
        if (memory) *list[i].view = memory + total;
        total += list[i].n;
    }
    return total;
}

// ---- creation and DiT's initialization ---------------------------------------------------

static void xavier_uniform(Rng *rng, float *w, int64_t fan_out, int64_t fan_in) {
    float bound = sqrtf(6.0f / (float)(fan_in + fan_out));
    rng_fill_uniform(rng, w, (size_t)(fan_out * fan_in), -bound, bound);
}

static void dit_initialize(Dit *m, uint64_t seed) {
    const DitConfig *c = &m->cfg;
    DitParams *p = &m->params;
    int64_t h = c->hidden, L = c->depth;
    Rng rng;
    rng_seed(&rng, seed);
    memset(m->params_memory, 0, m->num_params * sizeof(float));   // biases, adaLN, final layer: 0
    xavier_uniform(&rng, p->patch_w, h, dit_patch_dim(c));          // Conv2d viewed as (h, C·p·p)
    rng_fill_normal(&rng, p->t_w1, (size_t)(h * TIMESTEP_FREQ_DIM), 0.02f);
    rng_fill_normal(&rng, p->t_w2, (size_t)(h * h), 0.02f);
    rng_fill_normal(&rng, p->y_table, (size_t)((c->num_classes + 1) * h), 0.02f);
    for (int64_t l = 0; l < L; l++) {
        xavier_uniform(&rng, p->qkv_w + l * 3 * h * h, 3 * h, h);
        xavier_uniform(&rng, p->proj_w + l * h * h, h, h);
        xavier_uniform(&rng, p->fc1_w + l * 4 * h * h, 4 * h, h);
        xavier_uniform(&rng, p->fc2_w + l * 4 * h * h, h, 4 * h);
    }
    memcpy(m->ema_memory, m->params_memory, m->num_params * sizeof(float));
}

int dit_create(Dit *m, const DitConfig *cfg, int batch, DitAttention attention, uint64_t seed, char *err) {
    memset(m, 0, sizeof(*m));
    if (dit_config_validate(cfg, err) != 0) return -1;
    if (batch <= 0) {
        dit_set_error(err, "--batch: must be positive, got %d", batch);
        return -1;
    }
    m->cfg = *cfg;
    m->batch = batch;
    m->attention = attention == DIT_ATTN_SAGE_FP16 ? DIT_ATTN_SAGE : attention;
    m->sage = SAGE_CONFIG_DEFAULT;
    if (attention == DIT_ATTN_SAGE_FP16) m->sage.pv = SAGE_PV_FP16;
    m->num_params = dit_num_params(cfg);
    m->num_acts = activation_views(cfg, batch, NULL, &m->acts);
    size_t T = dit_tokens(cfg);
    // parameters, gradients, EMA, AdamW m and v: five buffers of num_params floats
    float *all = calloc(5 * m->num_params, sizeof(float));
    m->acts_memory = calloc(m->num_acts, sizeof(float));
    m->grad_acts_memory = calloc(m->num_acts, sizeof(float));
    m->pos_embed = malloc(T * cfg->hidden * sizeof(float));
    if (!all || !m->acts_memory || !m->grad_acts_memory || !m->pos_embed) {
        dit_set_error(err, "out of memory: %zu parameters ×5 and %zu activations ×2 (floats)",
                      m->num_params, m->num_acts);
        free(all);
        dit_free(m);
        return -1;
    }
    m->params_memory = all;
    m->grads_memory = all + m->num_params;
    m->ema_memory = all + 2 * m->num_params;
    m->adam_m_memory = all + 3 * m->num_params;
    m->adam_v_memory = all + 4 * m->num_params;
    dit_param_views(cfg, m->params_memory, &m->params);
    dit_param_views(cfg, m->grads_memory, &m->grads);
    dit_param_views(cfg, m->ema_memory, &m->ema);
    activation_views(cfg, batch, m->acts_memory, &m->acts);
    activation_views(cfg, batch, m->grad_acts_memory, &m->grad_acts);
    pos_embed_2d(m->pos_embed, cfg->image_size / cfg->patch, cfg->hidden);
    dit_initialize(m, seed);
    return 0;
}

void dit_free(Dit *m) {
    free(m->params_memory);
    free(m->acts_memory);
    free(m->grad_acts_memory);
    free(m->pos_embed);
    memset(m, 0, sizeof(*m));
}

// ---- forward -----------------------------------------------------------------------------

static void attention_forward_dispatch(const Dit *m, float *out, float *lse, const float *q,
                                       const float *k, const float *v, int B, int T) {
    int H = m->cfg.heads, D = m->cfg.hidden / H;
    if (m->attention == DIT_ATTN_SAGE) sage_forward(out, lse, q, k, v, B, H, T, D, m->sage);
    else attention_forward(out, lse, q, k, v, B, H, T, D);
}

void dit_forward(Dit *m, const DitParams *w, const float *x_t, const float *t, const int *labels, int B) {
    const DitConfig *c = &m->cfg;
    DitActivations *a = &m->acts;
    int h = c->hidden, T = dit_tokens(c), P = dit_patch_dim(c), H = c->heads, D = h / H;
    int BT = B * T, stride = c->depth * 6 * h;   // distance between samples in a->ada
    size_t blk = (size_t)BT * h;                 // one block's (B, T, h) activation

    // patch embedding (a Conv2d with kernel = stride = p) plus the fixed positions
    patchify_forward(a->patches, x_t, B, c->channels, c->image_size, c->patch);
    linear_forward(a->residual, a->patches, w->patch_w, w->patch_b, BT, P, h);
    for (int i = 0; i < BT; i++)
        for (int j = 0; j < h; j++) a->residual[(size_t)i * h + j] += m->pos_embed[(size_t)(i % T) * h + j];

    // conditioning c = MLP(timestep features) + class embedding; every adaLN reads SiLU(c)
    timestep_embedding_forward(a->t_freq, t, B, TIMESTEP_FREQ_DIM);
    linear_forward(a->t_h, a->t_freq, w->t_w1, w->t_b1, B, TIMESTEP_FREQ_DIM, h);
    silu_forward(a->t_h_silu, a->t_h, (size_t)B * h);
    linear_forward(a->t_emb, a->t_h_silu, w->t_w2, w->t_b2, B, h, h);
    embedding_forward(a->y_emb, w->y_table, labels, B, h);
    add_forward(a->c, a->t_emb, a->y_emb, (size_t)B * h);
    silu_forward(a->c_silu, a->c, (size_t)B * h);
    // the modulations of all blocks in one linear: (B, depth·6h), chunks per block
    // shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
    linear_forward(a->ada, a->c_silu, w->ada_w, w->ada_b, B, h, c->depth * 6 * h);

    for (int l = 0; l < c->depth; l++) {
        const float *ada = a->ada + (size_t)l * 6 * h;
        float *x = a->residual + l * blk, *x_next = a->residual + (l + 1) * blk;
        float *ln1 = a->ln1 + l * blk, *qkv = a->qkv + l * 3 * blk;
        float *q = a->q + l * blk, *k = a->k + l * blk, *v = a->v + l * blk;
        float *att = a->att + l * blk, *lse = a->att_lse + (size_t)l * BT * H;
        float *att_merged = a->att_merged + l * blk, *proj = a->proj + l * blk;
        float *x_mid = a->x_mid + l * blk, *ln2 = a->ln2 + l * blk;
        float *fc1 = a->fc1 + l * 4 * blk, *gelu = a->gelu + l * 4 * blk, *fc2 = a->fc2 + l * blk;

        // x_mid = x + gate_msa·proj(attention(qkv(modulate(norm1(x), shift_msa, scale_msa))))
        layernorm_modulate_forward(ln1, a->ln1_mean + (size_t)l * BT, a->ln1_rstd + (size_t)l * BT,
                                   x, ada, ada + h, B, T, h, stride);
        linear_forward(qkv, ln1, w->qkv_w + (size_t)l * 3 * h * h, w->qkv_b + (size_t)l * 3 * h, BT, h, 3 * h);
        split_heads_forward(q, k, v, qkv, B, T, H, D);
        attention_forward_dispatch(m, att, lse, q, k, v, B, T);
        merge_heads_forward(att_merged, att, B, T, H, D);
        linear_forward(proj, att_merged, w->proj_w + (size_t)l * h * h, w->proj_b + (size_t)l * h, BT, h, h);
        gated_residual_forward(x_mid, x, proj, ada + 2 * h, B, T, h, stride);

        // x_next = x_mid + gate_mlp·fc2(gelu(fc1(modulate(norm2(x_mid), shift_mlp, scale_mlp))))
        layernorm_modulate_forward(ln2, a->ln2_mean + (size_t)l * BT, a->ln2_rstd + (size_t)l * BT,
                                   x_mid, ada + 3 * h, ada + 4 * h, B, T, h, stride);
        linear_forward(fc1, ln2, w->fc1_w + (size_t)l * 4 * h * h, w->fc1_b + (size_t)l * 4 * h, BT, h, 4 * h);
        gelu_forward(gelu, fc1, 4 * blk);
        linear_forward(fc2, gelu, w->fc2_w + (size_t)l * 4 * h * h, w->fc2_b + (size_t)l * h, BT, 4 * h, h);
        gated_residual_forward(x_next, x_mid, fc2, ada + 5 * h, B, T, h, stride);
    }

    // final layer: modulate(norm(x), shift, scale) -> linear to p·p·C per token -> image
    const float *x_last = a->residual + (size_t)c->depth * blk;
    linear_forward(a->final_ada, a->c_silu, w->final_ada_w, w->final_ada_b, B, h, 2 * h);
    layernorm_modulate_forward(a->lnf, a->lnf_mean, a->lnf_rstd, x_last, a->final_ada,
                               a->final_ada + h, B, T, h, 2 * h);
    linear_forward(a->out_tokens, a->lnf, w->final_w, w->final_b, BT, h, P);
    unpatchify_forward(a->out, a->out_tokens, B, c->channels, c->image_size, c->patch);
}

// ---- backward ----------------------------------------------------------------------------

void dit_zero_grad(Dit *m) { memset(m->grads_memory, 0, m->num_params * sizeof(float)); }

void dit_backward(Dit *m, const float *dout, const int *labels, int B) {
    const DitConfig *c = &m->cfg;
    const DitActivations *a = &m->acts;
    DitActivations *g = &m->grad_acts;
    const DitParams *w = &m->params;
    DitParams *dw = &m->grads;
    int h = c->hidden, T = dit_tokens(c), P = dit_patch_dim(c), H = c->heads, D = h / H;
    int BT = B * T, stride = c->depth * 6 * h;
    size_t blk = (size_t)BT * h;
    memset(m->grad_acts_memory, 0, m->num_acts * sizeof(float));

    // final layer
    size_t last = (size_t)c->depth * blk;
    unpatchify_backward(g->out_tokens, dout, B, c->channels, c->image_size, c->patch);
    linear_backward(g->lnf, dw->final_w, dw->final_b, g->out_tokens, a->lnf, w->final_w, BT, h, P);
    layernorm_modulate_backward(g->residual + last, g->final_ada, g->final_ada + h, g->lnf,
                                a->residual + last, a->lnf_mean, a->lnf_rstd, a->final_ada + h, B, T, h, 2 * h);
    linear_backward(g->c_silu, dw->final_ada_w, dw->final_ada_b, g->final_ada, a->c_silu, w->final_ada_w, B, h, 2 * h);

    for (int l = c->depth - 1; l >= 0; l--) {
        const float *ada = a->ada + (size_t)l * 6 * h;
        float *dada = g->ada + (size_t)l * 6 * h;
        size_t o1 = l * blk, o3 = l * 3 * blk, o4 = l * 4 * blk, ost = (size_t)l * BT;
        const float *lse = a->att_lse + (size_t)l * BT * H;

        // x_next = x_mid + gate_mlp·fc2(...)
        gated_residual_backward(g->x_mid + o1, g->fc2 + o1, dada + 5 * h, g->residual + (l + 1) * blk,
                                a->fc2 + o1, ada + 5 * h, B, T, h, stride);
        linear_backward(g->gelu + o4, dw->fc2_w + (size_t)l * 4 * h * h, dw->fc2_b + (size_t)l * h,
                        g->fc2 + o1, a->gelu + o4, w->fc2_w + (size_t)l * 4 * h * h, BT, 4 * h, h);
        gelu_backward(g->fc1 + o4, a->fc1 + o4, g->gelu + o4, 4 * blk);
        linear_backward(g->ln2 + o1, dw->fc1_w + (size_t)l * 4 * h * h, dw->fc1_b + (size_t)l * 4 * h,
                        g->fc1 + o4, a->ln2 + o1, w->fc1_w + (size_t)l * 4 * h * h, BT, h, 4 * h);
        layernorm_modulate_backward(g->x_mid + o1, dada + 3 * h, dada + 4 * h, g->ln2 + o1, a->x_mid + o1,
                                    a->ln2_mean + ost, a->ln2_rstd + ost, ada + 4 * h, B, T, h, stride);

        // x_mid = x + gate_msa·proj(attention(...))
        gated_residual_backward(g->residual + o1, g->proj + o1, dada + 2 * h, g->x_mid + o1,
                                a->proj + o1, ada + 2 * h, B, T, h, stride);
        linear_backward(g->att_merged + o1, dw->proj_w + (size_t)l * h * h, dw->proj_b + (size_t)l * h,
                        g->proj + o1, a->att_merged + o1, w->proj_w + (size_t)l * h * h, BT, h, h);
        merge_heads_backward(g->att + o1, g->att_merged + o1, B, T, H, D);
        if (m->attention == DIT_ATTN_SAGE)
            sage_backward(g->q + o1, g->k + o1, g->v + o1, g->att + o1, a->q + o1, a->k + o1, a->v + o1,
                          a->att + o1, lse, B, H, T, D, m->sage);
        else
            attention_backward(g->q + o1, g->k + o1, g->v + o1, g->att + o1, a->q + o1, a->k + o1,
                               a->v + o1, a->att + o1, lse, B, H, T, D);
        split_heads_backward(g->qkv + o3, g->q + o1, g->k + o1, g->v + o1, B, T, H, D);
        linear_backward(g->ln1 + o1, dw->qkv_w + (size_t)l * 3 * h * h, dw->qkv_b + (size_t)l * 3 * h,
                        g->qkv + o3, a->ln1 + o1, w->qkv_w + (size_t)l * 3 * h * h, BT, h, 3 * h);
        layernorm_modulate_backward(g->residual + o1, dada, dada + h, g->ln1 + o1, a->residual + o1,
                                    a->ln1_mean + ost, a->ln1_rstd + ost, ada + h, B, T, h, stride);
    }

    // conditioning: c_silu feeds every adaLN; c = t_emb + y_emb passes its gradient to both
    linear_backward(g->c_silu, dw->ada_w, dw->ada_b, g->ada, a->c_silu, w->ada_w, B, h, c->depth * 6 * h);
    silu_backward(g->c, a->c, g->c_silu, (size_t)B * h);
    embedding_backward(dw->y_table, g->c, labels, B, h);
    linear_backward(g->t_h_silu, dw->t_w2, dw->t_b2, g->c, a->t_h_silu, w->t_w2, B, h, h);
    silu_backward(g->t_h, a->t_h, g->t_h_silu, (size_t)B * h);
    linear_backward(NULL, dw->t_w1, dw->t_b1, g->t_h, a->t_freq, w->t_w1, B, TIMESTEP_FREQ_DIM, h);

    // patch embedding (the positions are fixed)
    linear_backward(NULL, dw->patch_w, dw->patch_b, g->residual, a->patches, w->patch_w, BT, P, h);
}

void dit_adamw_step(Dit *m, float lr, float beta1, float beta2, float eps, float weight_decay,
                    float grad_scale, int step) {
    int n = dit_num_tensors(&m->cfg);
    DitTensorInfo *info = malloc(n * sizeof(DitTensorInfo));
    dit_tensor_infos(&m->cfg, info);
    for (int i = 0; i < n; i++) {
        size_t o = info[i].offset;
        float wd = info[i].ndim >= 2 ? weight_decay : 0.0f;
        adamw_update(m->params_memory + o, m->grads_memory + o, m->adam_m_memory + o,
                     m->adam_v_memory + o, info[i].numel, lr, beta1, beta2, eps, wd, grad_scale, step);
    }
    free(info);
}
