// CPU model of what --linear fp8 does to one training step of the whole DiT: the fp32 CPU model
// (model/dit.c) once as it is and once with its block linears (qkv, proj, fc1, fc2: M = B·T rows
// and those IC × OC) replaced by the CPU FP8 definition (layers/linear_fp8.c, e4m3 gradients as
// the GPU model), on the same random weights (every tensor random, as test/model_test.h) and
// batch (as test/test_dit_fp8_cuda.c). Prints the output's rel L2 and the loss difference, and
// every parameter gradient's rel L2 and cosine: the basis of test_dit_fp8_cuda.c's tolerances.
//
// Build: make lib && gcc -O3 -std=c11 -D_GNU_SOURCE -I. -fopenmp -o build/dit_fp8_accuracy
//          dev/dit_fp8_accuracy.c build/libditc.a -lm
//        (model/dit.c is compiled into this file with its linear layers renamed; the archive's
//        dit.o is not pulled in)
// Run:   build/dit_fp8_accuracy [hidden heads image_size]   (default 128 2 32: the GPU test's model)
#include <stdio.h>
#include <stdlib.h>
#include "layers/fp8.h"

#define linear_forward model_linear_forward
#define linear_backward model_linear_backward
#include "model/dit.c"
#undef linear_forward
#undef linear_backward
#include "test/compare.h"

void linear_forward(float *out, const float *inp, const float *weight, const float *bias, int M, int IC, int OC);
void linear_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                     const float *weight, int M, int IC, int OC);

static int fp8_on, fp8_rows, fp8_hidden;   // FP8 for the block linears: M = fp8_rows and these shapes

static int is_block_linear(int M, int IC, int OC) {
    int h = fp8_hidden;
    return fp8_on && M == fp8_rows && ((IC == h && (OC == 3 * h || OC == h || OC == 4 * h)) || (IC == 4 * h && OC == h));
}

void model_linear_forward(float *out, const float *inp, const float *weight, const float *bias, int M, int IC, int OC) {
    if (is_block_linear(M, IC, OC)) linear_fp8_forward(out, inp, weight, bias, M, IC, OC);
    else linear_forward(out, inp, weight, bias, M, IC, OC);
}

void model_linear_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                           const float *weight, int M, int IC, int OC) {
    if (is_block_linear(M, IC, OC)) linear_fp8_backward(dinp, dweight, dbias, dout, inp, weight, M, IC, OC, FP8_E4M3);
    else linear_backward(dinp, dweight, dbias, dout, inp, weight, M, IC, OC);
}

int main(int argc, char **argv) {
    DitConfig c = {.image_size = 32, .channels = 3, .patch = 2, .hidden = 128, .depth = 2, .heads = 2, .num_classes = 5};
    if (argc == 4) { c.hidden = atoi(argv[1]); c.heads = atoi(argv[2]); c.image_size = atoi(argv[3]); }
    int B = 2;
    char err[DIT_ERR_LEN];
    Dit m;
    if (dit_create(&m, &c, B, DIT_ATTN_EXACT, 1, err)) { fprintf(stderr, "%s\n", err); return 1; }
    fp8_rows = B * dit_tokens(&c);
    fp8_hidden = c.hidden;
    int n = dit_num_tensors(&c);
    DitTensorInfo *info = malloc(n * sizeof(DitTensorInfo));
    dit_tensor_infos(&c, info);
    Rng rng;
    rng_seed(&rng, 21);   // every tensor random as test/model_test.h's randomize_params
    for (int i = 0; i < n; i++) {
        float std = info[i].ndim >= 2 ? 1.0f / sqrtf((float)(info[i].numel / info[i].shape[0])) : 0.1f;
        rng_fill_normal(&rng, m.params_memory + info[i].offset, info[i].numel, std);
    }
    size_t img = (size_t)B * c.channels * c.image_size * c.image_size;
    float *x0 = malloc(img * 4), *noise = malloc(img * 4), *x_t = malloc(img * 4), *v = malloc(img * 4);
    float *dout = malloc(img * 4), *out[2], *grads[2], loss[2], t[2];
    int labels[2];
    rng_seed(&rng, 21 * 1000 + 1);   // the batch as test/test_dit_fp8_cuda.c's batch_fill
    rng_fill_normal(&rng, x0, img, 1.0f);
    rng_fill_normal(&rng, noise, img, 1.0f);
    for (int b = 0; b < B; b++) {
        t[b] = 0.05f + 0.9f * rng_uniform(&rng);
        labels[b] = (int)(rng_u32(&rng) % (uint32_t)(c.num_classes + 1));
    }
    flow_matching_inputs(x_t, v, x0, noise, t, B, (int)(img / B));
    for (fp8_on = 0; fp8_on < 2; fp8_on++) {
        dit_forward(&m, &m.params, x_t, t, labels, B);
        loss[fp8_on] = mse_loss_forward_backward(dout, m.acts.out, v, img);
        dit_zero_grad(&m);
        dit_backward(&m, dout, labels, B);
        out[fp8_on] = malloc(img * 4);
        grads[fp8_on] = malloc(m.num_params * 4);
        memcpy(out[fp8_on], m.acts.out, img * 4);
        memcpy(grads[fp8_on], m.grads_memory, m.num_params * 4);
    }
    printf("hidden %d heads %d, %d tokens, depth %d, batch %d: FP8 (e4m3) block linears against fp32\n", c.hidden,
           c.heads, dit_tokens(&c), c.depth, B);
    printf("output rel L2 %.4f | loss %.6f vs %.6f (rel %.2e)\n", rel_l2(out[1], out[0], img), loss[1], loss[0],
           fabs(loss[1] - loss[0]) / loss[0]);
    double worst = 0, worst_cos = 1;
    for (int i = 0; i < n; i++) {
        double e = rel_l2(grads[1] + info[i].offset, grads[0] + info[i].offset, info[i].numel);
        double cs = cosine(grads[1] + info[i].offset, grads[0] + info[i].offset, info[i].numel);
        printf("  grad %-28s rel L2 %.4f cosine %.6f\n", info[i].name, e, cs);
        worst = e > worst ? e : worst;
        worst_cos = cs < worst_cos ? cs : worst_cos;
    }
    printf("worst gradient rel L2 %.4f, cosine %.6f over %d tensors\n", worst, worst_cos, n);
    return 0;
}
