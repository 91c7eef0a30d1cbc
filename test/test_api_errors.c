// Bad arguments to the library's checked entry points return -1 with a message that names the
// function and the bad value (layers/common.h's convention), and a NULL err is allowed. The CUDA
// argument checks run before any CUDA call, so these tests need no GPU (built when the library
// has CUDA). The CPU layer and attention functions take trusted shapes and are not tested here.
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>
#include "layers/common.h"
#include "dataloader/dataloader.h"
#include "model/dit.h"
#include "model/checkpoint.h"
#include "model/safetensors.h"
#ifdef DIT_CUDA
#include "layers/layers_cuda.h"
#include "attention/sage_cuda.h"
#include "attention/flash_cuda.h"
#endif
#ifdef DIT_NCCL
#include "attention/sequence_parallel_cuda.h"
#endif

// rc must be -1 and err must contain every one of the given fragments.
#define EXPECT_ERROR(rc, err, ...) do {                                                          \
        cr_assert_eq((rc), -1, "expected an error, got %d", (rc));                               \
        const char *frags_[] = {__VA_ARGS__};                                                    \
        for (size_t i_ = 0; i_ < sizeof frags_ / sizeof *frags_; i_++)                           \
            cr_assert(strstr((err), frags_[i_]), "message \"%s\" lacks \"%s\"", (err), frags_[i_]); \
    } while (0)

// ---- data loader, model config, safetensors, checkpoints ----------------------------------

Test(cpu_api, dataloader_rejects_bad_sizes_and_a_null_root) {
    char err[DIT_ERR_LEN];
    DataLoader *dl = (DataLoader *)1;
    DataLoaderConfig cfg = {.root = DATALOADER_SYNTHETIC, .image_size = 8, .channels = 1, .batch_size = 2};
    cfg.image_size = 5000;
    EXPECT_ERROR(dataloader_open(&dl, &cfg, err), err, "image_size must be in 1..4096", "image_size=5000");
    cr_assert_null(dl, "the handle is cleared on failure");
    cfg.image_size = 8;
    cfg.prefetch = 65;
    EXPECT_ERROR(dataloader_open(&dl, &cfg, err), err, "prefetch must be in 0..64");
    cfg.prefetch = 0;
    cfg.root = NULL;
    EXPECT_ERROR(dataloader_open(&dl, &cfg, err), err, "root must name a folder", "root=(null)");
    cr_assert_eq(dataloader_open(&dl, &cfg, NULL), -1, "err may be NULL");
}

Test(cpu_api, model_config_and_batch_errors_name_the_field) {
    char err[DIT_ERR_LEN];
    DitConfig cfg;
    cr_assert_eq(dit_config_preset(&cfg, "tiny", err), 0, "%s", err);
    EXPECT_ERROR(dit_config_preset(&cfg, "huge", err), err, "huge");
    DitConfig bad = cfg;
    bad.heads = 3;
    EXPECT_ERROR(dit_config_validate(&bad, err), err, "not a multiple of heads 3");
    bad = cfg;
    bad.patch = 0;
    EXPECT_ERROR(dit_config_validate(&bad, err), err, "every size must be positive", "patch 0");
    bad = cfg;
    bad.image_size = cfg.patch * 3 + 1;
    EXPECT_ERROR(dit_config_validate(&bad, err), err, "not a multiple of patch");
    Dit m;
    EXPECT_ERROR(dit_create(&m, &cfg, 0, DIT_ATTN_EXACT, 1, err), err, "batch", "got 0");
    cr_assert_eq(dit_config_validate(&bad, NULL), -1, "err may be NULL");
}

Test(cpu_api, safetensors_and_checkpoint_errors_name_the_file) {
    char err[DIT_ERR_LEN];
    SafetensorsFile *f = (SafetensorsFile *)1;
    EXPECT_ERROR(st_open(&f, "/nonexistent/dir/x.safetensors", err), err, "/nonexistent/dir/x.safetensors",
                 "cannot open");
    cr_assert_null(f);
    EXPECT_ERROR(st_open_memory(&f, "", 0, "empty", err), err, "empty");
    cr_assert_null(f);
    // a shape whose byte count overflows 64 bits
    const char header[] = "{\"t\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}";
    unsigned char bytes[8 + sizeof header - 1];
    uint64_t n = sizeof header - 1;
    for (int i = 0; i < 8; i++) bytes[i] = (unsigned char)(n >> (8 * i));
    memcpy(bytes + 8, header, n);
    EXPECT_ERROR(st_open_memory(&f, bytes, sizeof bytes, "big", err), err, "big", "\"t\"", "overflows");
    DitConfig cfg;
    EXPECT_ERROR(checkpoint_read_config("/nonexistent/ckpt.safetensors", &cfg, err), err,
                 "/nonexistent/ckpt.safetensors");
    cr_assert_eq(st_open(&f, "/nonexistent/x", NULL), -1, "err may be NULL");
}

#ifdef DIT_CUDA
// ---- attention kernels: head dim, sizes, the B·H grid limit --------------------------------

Test(cuda_api, flash_attention_rejects_head_dim_sizes_and_grid_overflow) {
    char err[DIT_ERR_LEN];
    EXPECT_ERROR(flash_forward_cuda(NULL, NULL, NULL, NULL, NULL, 1, 2, 64, 96, 0, err), err,
                 "flash_forward_cuda", "D in {64, 128}", "D=96");
    EXPECT_ERROR(flash_forward_cuda(NULL, NULL, NULL, NULL, NULL, 1, 2, 0, 64, 0, err), err, "N=0");
    EXPECT_ERROR(flash_forward_cuda(NULL, NULL, NULL, NULL, NULL, 65536, 65536, 64, 64, 0, err), err,
                 "B·H <= 65535", "B=65536 H=65536");
    EXPECT_ERROR(flash_backward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                     1, 1, 64, 32, 0, err), err, "flash_backward_cuda", "D=32");
    EXPECT_ERROR(flash_backward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                     300, 300, 64, 64, 0, err), err, "B=300 H=300");
    EXPECT_ERROR(flash_forward_merged_cuda(NULL, NULL, NULL, NULL, NULL, 1, 2, 64, 96, 0, err), err,
                 "flash_forward_merged_cuda", "D in {64, 128}", "D=96");
    EXPECT_ERROR(flash_backward_merged_cuda(NULL, NULL, NULL, 0, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                            300, 300, 64, 64, 0, err), err, "flash_backward_merged_cuda",
                 "B=300 H=300");
    cr_assert_eq(flash_forward_cuda(NULL, NULL, NULL, NULL, NULL, 1, 1, 1, 96, 0, NULL), -1, "err may be NULL");
}

Test(cuda_api, sage_attention_rejects_head_dim_sizes_and_grid_overflow) {
    char err[DIT_ERR_LEN];
    EXPECT_ERROR(sage_quantize_cuda(NULL, NULL, NULL, NULL, 1, 2, 64, 96, SAGE_PV_FP8, 0, err), err,
                 "sage_quantize_cuda", "D=96");
    EXPECT_ERROR(sage_quantize_cuda(NULL, NULL, NULL, NULL, 0, 2, 64, 64, SAGE_PV_FP8, 0, err), err, "B=0");
    EXPECT_ERROR(sage_forward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, 1, 2, 64, 96, SAGE_PV_FP16, 0, err), err,
                 "D=96");
    EXPECT_ERROR(sage_backward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                    1, 2, 64, 96, SAGE_PV_FP8, 0, err), err, "sage_backward_cuda", "D=96");
    EXPECT_ERROR(sage_backward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                    65536, 65536, 64, 64, SAGE_PV_FP8, 0, err), err, "B·H <= 65535");
    EXPECT_ERROR(sage_forward_merged_cuda(NULL, NULL, NULL, NULL, NULL, NULL, 1, 2, 64, 96, SAGE_PV_FP16, 0, err),
                 err, "sage_forward_merged_cuda", "D=96");
    EXPECT_ERROR(sage_backward_merged_cuda(NULL, NULL, NULL, 0, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                           NULL, 65536, 65536, 64, 64, SAGE_PV_FP8, 0, err), err,
                 "sage_backward_merged_cuda", "B·H <= 65535");
}

// ---- attention kernels: NULL and misaligned device pointers, checked before any CUDA call ----
// `dev` stands in for device buffers: 16-byte aligned and never dereferenced, since every call
// below fails a check first; dev + 2 and dev + 8 are misaligned for 16-byte vector loads.

static _Alignas(16) uint8_t dev_bytes[64];
#define DEV ((void *)dev_bytes)

Test(cuda_api, attention_rejects_null_device_pointers_by_name) {
    char err[DIT_ERR_LEN];
    uint16_t *b = DEV;
    float *f = DEV;
    EXPECT_ERROR(flash_forward_cuda(b, f, NULL, b, b, 1, 2, 64, 64, 0, err), err, "flash_forward_cuda",
                 "q must be a device pointer, got NULL");
    EXPECT_ERROR(flash_backward_cuda(f, f, f, DEV, NULL, b, b, b, b, f, 1, 2, 64, 64, 0, err), err,
                 "flash_backward_cuda", "dout must be", "NULL");
    EXPECT_ERROR(sage_forward_cuda(b, NULL, DEV, b, b, b, 1, 2, 64, 64, SAGE_PV_FP8, 0, err), err,
                 "sage_forward_cuda", "lse must be", "NULL");
    EXPECT_ERROR(sage_forward_quantized_cuda(NULL, f, DEV, 1, 2, 64, 64, SAGE_PV_FP16, 0, err), err,
                 "sage_forward_quantized_cuda", "out must be", "NULL");
    EXPECT_ERROR(sage_forward_sm90_cuda(b, f, DEV, b, NULL, b, 1, 2, 64, 128, 0, err), err,
                 "sage_forward_sm90_cuda", "k must be", "NULL");
    EXPECT_ERROR(sage_backward_cuda(NULL, f, f, DEV, DEV, b, b, b, b, b, f, NULL, 1, 2, 64, 64, SAGE_PV_FP8, 0, err),
                 err, "sage_backward_cuda", "dq must be", "NULL");
    EXPECT_ERROR(sage_backward_sm90_cuda(f, f, f, DEV, NULL, b, b, b, b, b, f, NULL, 1, 2, 64, 64, SAGE_PV_FP8, 0,
                                         err), err, "sage_backward_sm90_cuda", "fwd_workspace must be", "NULL");
    // delta = NULL: the backward computes it from out into workspace, so both are required
    EXPECT_ERROR(sage_backward_cuda(f, f, f, DEV, DEV, b, b, b, b, NULL, f, NULL, 1, 2, 64, 64, SAGE_PV_FP8, 0, err),
                 err, "sage_backward_cuda (delta = NULL", "out must be", "NULL");
    EXPECT_ERROR(sage_quantize_cuda(DEV, b, NULL, b, 1, 2, 64, 64, SAGE_PV_FP8, 0, err), err,
                 "sage_quantize_cuda", "k must be", "NULL");
    EXPECT_ERROR(sage_quantize_qkv_cuda(DEV, b, b, b, NULL, 1, 1, 2, 64, 64, SAGE_PV_FP8, 0, err), err,
                 "sage_quantize_qkv_cuda", "qkv must be", "NULL");
    EXPECT_ERROR(sage_forward_quantized_merged_cuda(b, NULL, DEV, 1, 2, 64, 64, SAGE_PV_FP8, 0, err), err,
                 "sage_forward_quantized_merged_cuda", "lse must be", "NULL");
    // the merged calls check every pointer, out and dout (whose layout differs) included
    EXPECT_ERROR(flash_forward_merged_cuda(NULL, f, b, b, b, 1, 2, 64, 64, 0, err), err, "flash_forward_merged_cuda",
                 "out must be", "NULL");
    EXPECT_ERROR(flash_backward_merged_cuda(f, b, b, 128, 0, NULL, DEV, NULL, b, b, b, b, f, 1, 2, 64, 64, 0, err), err,
                 "flash_backward_merged_cuda", "dout must be", "NULL");
    // and dk's and dv's rows: a stride below H·D, or odd; NULL rows
    EXPECT_ERROR(flash_backward_merged_cuda(f, b, b, 127, 0, NULL, DEV, b, b, b, b, b, f, 1, 2, 64, 64, 0, err), err,
                 "flash_backward_merged_cuda", "row_stride", "H·D = 128", "got 127");
    EXPECT_ERROR(sage_backward_merged_cuda(f, b, b, 385, 1, f, DEV, DEV, b, b, b, b, b, f, NULL, 1, 2, 64, 64,
                                           SAGE_PV_FP8, 0, err), err, "sage_backward_merged_cuda", "row_stride",
                 "got 385");
    EXPECT_ERROR(sage_backward_merged_cuda(f, NULL, b, 384, 1, f, DEV, DEV, b, b, b, b, b, f, NULL, 1, 2, 64, 64,
                                           SAGE_PV_FP8, 0, err), err, "sage_backward_merged_cuda", "dk_rows must be",
                 "NULL");
    EXPECT_ERROR(sage_forward_merged_cuda(b, f, DEV, NULL, b, b, 1, 2, 64, 64, SAGE_PV_FP8, 0, err), err,
                 "sage_forward_merged_cuda", "q must be", "NULL");
    EXPECT_ERROR(sage_backward_merged_cuda(f, b, b, 384, 0, NULL, DEV, DEV, b, b, b, b, NULL, f, NULL, 1, 2, 64, 64,
                                           SAGE_PV_FP8, 0, err), err, "sage_backward_merged_cuda", "out must be",
                 "NULL");
    EXPECT_ERROR(sage_quantize_given_cuda(DEV, b, b, b, f, NULL, 1, 2, 64, 64, SAGE_PV_FP8, 0, err), err,
                 "sage_quantize_given_cuda (FP8", "v_scale must be", "NULL");
    EXPECT_ERROR(sage_kv_stats_cuda(NULL, f, DEV, b, b, 1, 2, 64, 64, SAGE_PV_FP8, 0, err), err,
                 "sage_kv_stats_cuda", "k_sum must be", "NULL");
    cr_assert_eq(flash_forward_cuda(NULL, f, b, b, b, 1, 2, 64, 64, 0, NULL), -1, "err may be NULL");
}

Test(cuda_api, attention_rejects_misaligned_vector_buffers) {
    char err[DIT_ERR_LEN];
    uint16_t *b = DEV, *b2 = (uint16_t *)(dev_bytes + 2);
    float *f = DEV, *f8 = (float *)(dev_bytes + 8);
    EXPECT_ERROR(flash_forward_cuda(b, f, b2, b, b, 1, 2, 64, 64, 0, err), err, "flash_forward_cuda", "q=",
                 "must be 16-byte aligned");
    EXPECT_ERROR(flash_backward_cuda(f8, f, f, DEV, b, b, b, b, b, f, 1, 2, 64, 64, 0, err), err,
                 "flash_backward_cuda", "dq=", "16-byte aligned");
    EXPECT_ERROR(sage_forward_cuda(b2, f, DEV, b, b, b, 1, 2, 64, 64, SAGE_PV_FP16, 0, err), err,
                 "sage_forward_cuda", "out=", "16-byte aligned");
    // the mma.sync backward cp.asyncs 16 bytes of dout too: an error, not a fallback from the TMA kernel
    EXPECT_ERROR(sage_backward_cuda(f, f, f, DEV, DEV, b2, b, b, b, b, f, NULL, 1, 2, 64, 64, SAGE_PV_FP8, 0, err),
                 err, "sage_backward_cuda", "dout=", "16-byte aligned");
    EXPECT_ERROR(sage_backward_sm90_cuda(f, f, f, DEV, DEV, b, b, b, b2, b, f, NULL, 1, 2, 64, 64, SAGE_PV_FP8, 0,
                                         err), err, "sage_backward_sm90_cuda", "v=", "16-byte aligned");
    EXPECT_ERROR(sage_quantize_cuda(dev_bytes + 8, b, b, b, 1, 2, 64, 64, SAGE_PV_FP8, 0, err), err,
                 "sage_quantize_cuda", "workspace=", "16-byte aligned");
    EXPECT_ERROR(flash_forward_merged_cuda(b2, f, b, b, b, 1, 2, 64, 64, 0, err), err, "flash_forward_merged_cuda",
                 "out=", "16-byte aligned");
    EXPECT_ERROR(flash_backward_merged_cuda(f, b, b, 128, 0, NULL, DEV, b2, b, b, b, b, f, 1, 2, 64, 64, 0, err), err,
                 "flash_backward_merged_cuda", "dout=", "16-byte aligned");
    EXPECT_ERROR(flash_backward_merged_cuda(f, b, b + 1, 128, 0, NULL, DEV, b, b, b, b, b, f, 1, 2, 64, 64, 0, err),
                 err, "flash_backward_merged_cuda", "dv_rows=", "4-byte aligned");
    EXPECT_ERROR(flash_backward_merged_cuda(f, b + 1, b, 128, 1, NULL, DEV, b, b, b, b, b, f, 1, 2, 64, 64, 0, err),
                 err, "flash_backward_merged_cuda", "dk_rows=", "4-byte aligned");
    EXPECT_ERROR(sage_forward_merged_cuda(b2, f, DEV, b, b, b, 1, 2, 64, 64, SAGE_PV_FP16, 0, err), err,
                 "sage_forward_merged_cuda", "out=", "16-byte aligned");
    EXPECT_ERROR(sage_backward_merged_cuda(f, b, b, 384, 0, NULL, DEV, DEV, b2, b, b, b, b, f, NULL, 1, 2, 64, 64,
                                           SAGE_PV_FP8, 0, err), err, "sage_backward_merged_cuda", "dout=",
                 "16-byte aligned");
}

Test(cuda_api, sage_forward_checks_shapes_before_querying_the_device) {
    char err[DIT_ERR_LEN];
    uint16_t *b = DEV;
    float *f = DEV;
    // FP8 dispatches on the device's compute capability: the head dim must be rejected first
    EXPECT_ERROR(sage_forward_cuda(b, f, DEV, b, b, b, 1, 2, 64, 96, SAGE_PV_FP8, 0, err), err,
                 "sage_forward_cuda", "D in {64, 128}", "D=96");
    EXPECT_ERROR(sage_forward_cuda(b, f, DEV, b, b, b, 1, 2, 64, 64, (SagePV)7, 0, err), err,
                 "sage_forward_cuda", "pv=7");
    EXPECT_ERROR(sage_forward_merged_cuda(b, f, DEV, b, b, b, 1, 2, 64, 96, SAGE_PV_FP8, 0, err), err,
                 "sage_forward_merged_cuda", "D in {64, 128}", "D=96");
    EXPECT_ERROR(sage_forward_merged_cuda(b, f, DEV, b, b, b, 1, 2, 64, 64, (SagePV)7, 0, err), err,
                 "sage_forward_merged_cuda", "pv=7");
    EXPECT_ERROR(sage_forward_sm90_cuda(b, f, DEV, b, b, b, 1, 2, 64, 96, 0, err), err,
                 "sage_forward_sm90_cuda", "D=96");
    EXPECT_ERROR(sage_backward_sm90_cuda(f, f, f, DEV, DEV, b, b, b, b, b, f, NULL, 2, 1, 1 << 30, 64,
                                         SAGE_PV_FP8, 0, err), err, "sage_backward_sm90_cuda", "N=1073741824");
}

// ---- layers: sizes, alignment rules of the cuBLASLt epilogues, scratch ---------------------

Test(cuda_api, layers_reject_bad_sizes_before_touching_the_device) {
    char err[DIT_ERR_LEN];
    LayersCuda ctx = {0};   // never used: the checks come first
    EXPECT_ERROR(linear_forward_cuda(NULL, NULL, NULL, NULL, 0, 8, 8, &ctx, 0, err), err,
                 "linear_forward_cuda", "M=0");
    EXPECT_ERROR(linear_gelu_forward_cuda(NULL, NULL, NULL, NULL, (const bf16 *)&ctx, 4, 8, 12, &ctx, 0, err),
                 err, "multiple of 8", "OC=12");
    EXPECT_ERROR(linear_gelu_forward_cuda(NULL, NULL, NULL, NULL, NULL, 4, 8, 16, &ctx, 0, err), err,
                 "needs a bias");
    EXPECT_ERROR(linear_dgelu_backward_cuda(NULL, NULL, 1.0f, NULL, NULL, NULL, NULL, NULL, 4, 12, 8, &ctx, 0, err),
                 err, "IC=12");
    EXPECT_ERROR(layernorm_modulate_forward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, 2, 4, 8, 4, NULL, 0, err), err,
                 "mod_stride >= C", "mod_stride=4");
    EXPECT_ERROR(layernorm_modulate_forward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, 2, 4, 4104, 4104, NULL, 0, err),
                 err, "C <= 4096", "C=4104");
    EXPECT_ERROR(layernorm_modulate_backward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 2, 4, 4104, 4104,
                                                  NULL, 0, err), err, "layernorm_modulate_backward_cuda", "C=4104");
    EXPECT_ERROR(gated_residual_layernorm_modulate_forward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                                                2, 4, 8, 4, 8, NULL, 0, err),
                 err, "gated_residual_layernorm_modulate_forward_cuda", "gate_stride >= C", "gate_stride=4");
    EXPECT_ERROR(gated_residual_layernorm_modulate_forward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                                                2, 4, 8, 8, 4, NULL, 0, err),
                 err, "gated_residual_layernorm_modulate_forward_cuda", "mod_stride >= C", "mod_stride=4");
    EXPECT_ERROR(gated_residual_layernorm_modulate_forward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                                                2, 4, 4104, 4104, 4104, NULL, 0, err),
                 err, "gated_residual_layernorm_modulate_forward_cuda", "C <= 4096", "C=4104");
    EXPECT_ERROR(gated_residual_backward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, 2, 0, 8, 8, NULL, NULL, NULL, 0, err), err,
                 "gated_residual_backward_cuda", "T=0");
    EXPECT_ERROR(patchify_forward_cuda(NULL, NULL, 1, 3, 10, 4, 0, err), err, "S a multiple of p", "S=10 p=4");
    EXPECT_ERROR(split_heads_forward_cuda(NULL, NULL, NULL, NULL, 1, 4, 0, 8, 0, err), err, "H=0");
    EXPECT_ERROR(timestep_embedding_forward_cuda(NULL, NULL, 2, 255, 0, err), err, "dim=255");
    EXPECT_ERROR(pos_embed_2d_cuda(NULL, 4, 6, 0, err), err, "multiple of 4", "C=6");
    EXPECT_ERROR(embedding_backward_cuda(NULL, NULL, NULL, 2, 0, 0, err), err, "C=0");
    EXPECT_ERROR(flow_matching_inputs_cuda(NULL, NULL, NULL, NULL, NULL, 0, 8, 0, err), err, "B=0");
    EXPECT_ERROR(mse_loss_forward_backward_cuda(NULL, NULL, NULL, NULL, 16, &ctx, 0, err), err,
                 "floats of scratch", "have 0");
    EXPECT_ERROR(sum_squares_cuda(NULL, NULL, 0, &ctx, 0, err), err, "n > 0");
    OptimizerStepConstants k;
    EXPECT_ERROR(optimizer_step_constants(&k, 1e-3f, 0.9f, 0.999f, 0, 0.99f, err), err, "step >= 1", "step=0");
    EXPECT_ERROR(adamw_update_cuda(NULL, NULL, NULL, NULL, NULL, NULL, 16, NULL, 0.9f, 0.999f, 1e-8f, 0.0f, NULL, 1.0f,
                                   0, err), err, "adamw_update_cuda", "step constants");
    cr_assert_eq(pos_embed_2d_cuda(NULL, 4, 6, 0, NULL), -1, "err may be NULL");
}

Test(cuda_api, layers_reject_sizes_whose_int_indices_overflow) {
    char err[DIT_ERR_LEN];
    EXPECT_ERROR(layernorm_modulate_forward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, 65536, 65536, 8, 8, NULL, 0, err),
                 err, "layernorm_modulate_forward_cuda", "B·T = 65536·65536");
    EXPECT_ERROR(layernorm_modulate_backward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 70000, 1, 8, 8, NULL,
                                                  0, err), err, "layernorm_modulate_backward_cuda", "grid.y B = 70000");
    EXPECT_ERROR(gated_residual_forward_cuda(NULL, NULL, NULL, NULL, 1, 65536, 65536, 65536, 0, err), err,
                 "gated_residual_forward_cuda", "T·C = 65536·65536");
    EXPECT_ERROR(gated_residual_layernorm_modulate_forward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                                                65536, 65536, 8, 8, 8, NULL, 0, err),
                 err, "gated_residual_layernorm_modulate_forward_cuda", "B·T = 65536·65536");
    EXPECT_ERROR(gated_residual_backward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, 70000, 1, 8, 8, NULL, NULL, NULL, 0, err), err,
                 "gated_residual_backward_cuda", "grid.y B = 70000");
    EXPECT_ERROR(patchify_forward_cuda(NULL, NULL, 1, 3, 65536, 1, 0, err), err, "patchify_forward_cuda",
                 "S·S = 65536·65536");
    EXPECT_ERROR(unpatchify_forward_cuda(NULL, NULL, 1, 1 << 20, 64, 64, 0, err), err, "C·p·p = 1048576·4096");
    EXPECT_ERROR(split_heads_forward_cuda(NULL, NULL, NULL, NULL, 1, 4, 1 << 20, 1024, 0, err), err,
                 "split_heads_forward_cuda", "3·H·D");
    EXPECT_ERROR(timestep_embedding_forward_cuda(NULL, NULL, 1 << 20, 1 << 13, 0, err), err, "B·dim/2");
    EXPECT_ERROR(pos_embed_2d_cuda(NULL, 50000, 4096, 0, err), err, "pos_embed_2d_cuda", "G·G·C/4");
    EXPECT_ERROR(gelu_forward_cuda(NULL, NULL, (size_t)1 << 40, NULL, 0, err), err, "gelu_forward_cuda",
                 "1099511627776 elements", "2^31 - 1 blocks");
    OptimizerStepConstants k = {0};   // never read: the size check comes first
    EXPECT_ERROR(adamw_update_cuda(NULL, NULL, NULL, NULL, NULL, NULL, (size_t)1 << 40, &k, 0.9f, 0.999f, 1e-8f, 0.0f,
                                   NULL, 1.0f, 0, err), err, "adamw_update_cuda", "2^31 - 1 blocks");
}
#endif

#ifdef DIT_NCCL
// ---- sequence parallelism: the SpCudaComm, checked before any CUDA or NCCL call ------------

Test(cuda_api, sequence_parallel_rejects_a_missing_or_inconsistent_comm) {
    char err[DIT_ERR_LEN];
    float *x[1] = {NULL};
    EXPECT_ERROR(sp_cuda_all_reduce_sum(NULL, x, 4, err), err, "sp_cuda_all_reduce_sum", "SpCudaComm",
                 "must not be NULL");
    int rank[1] = {5}, device[1] = {0};
    ncclComm_t comm[1] = {(ncclComm_t)DEV};   // never used: every call below fails a check first
    cudaStream_t stream[1] = {0};
    SpCudaComm c = {2, 1, rank, device, comm, stream, NULL};
    EXPECT_ERROR(sp_cuda_ring_pass(&c, (void *const *)x, (const void *const *)x, 4, err), err,
                 "sp_cuda_ring_pass_on", "local entry 0 has rank 5", "expected 0..1");
    rank[0] = 1;
    comm[0] = NULL;
    EXPECT_ERROR(ulysses_all_to_all_cuda(&c, (void *const *)x, (const void *const *)x, 1, 2, 4, 64, 2, err), err,
                 "ulysses_all_to_all_cuda", "rank 1", "NULL communicator");
    c.n_local = 3;
    EXPECT_ERROR(sp_cuda_all_reduce_max(&c, x, 4, err), err, "sp_cuda_all_reduce_max", "2 ranks with 3 local");
    c.n_local = 1;
    EXPECT_ERROR(ring_attention_forward_cuda(&c, NULL, NULL, NULL, NULL, NULL, 1, 2, 4, 64, err), err,
                 "ring_attention_forward_cuda", "rank 1", "NULL communicator");
    c.comm = NULL;
    EXPECT_ERROR(ring_sage_stats_cuda(&c, NULL, NULL, NULL, NULL, 1, 2, 4, 64, SAGE_PV_FP8, err), err,
                 "ring_sage_stats_cuda", "SpCudaComm", "must not be NULL");
    EXPECT_ERROR(ring_attention_backward_cuda(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1, 2, 4, 64,
                                              err), err, "ring_attention_backward_cuda", "c=(nil)");
    EXPECT_ERROR(sp_cuda_accumulate(NULL, NULL, 4, 0, err), err, "sp_cuda_accumulate", "n=4");
}
#endif
