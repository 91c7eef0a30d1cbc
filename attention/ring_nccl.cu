// Ring attention over NCCL (attention/sequence_parallel_cuda.h), exact (bf16 flash) and sage,
// forward and backward: the GPU version of attention/ring_cpu.c, step for step.
//
// Streams and buffers, per local rank: what travels (k/v in bf16; for sage's forward the
// quantized k8, k_scale, v_t) lives in two slots, cur = slot[s % 2] at step s. At the start of
// step s the pass of cur into slot[(s+1) % 2] is posted on comm_stream, after an event that marks
// the end of step s-1's compute (the last reader of that slot); the step's compute runs on stream
// meanwhile, and step s+1 first waits for the pass's arrival event. The backward's (dk, dv)
// packets (fp32) travel the same way, but each pass must follow the compute that finishes the
// packet: step s computes its dk/dv into scratch (overlapping the arrival of the packet), then
// adds them into the arrived packet and sends it on. After the last step the return trip brings
// every packet to its owner.
// With R = 2 the backward takes a shorter road (ring2_backward): each shard's dk, dv are the sum
// of two terms, so the foreign term goes straight to its owner in one pass; the own step, split
// by heads, runs around the foreign one, so that both passes hide under it; bitwise the ring's
// result.
#include <stdio.h>
#include "attention/sequence_parallel_cuda.h"
#include "attention/flash_cuda.h"
#include "attention/sage_cuda.h"
#include "attention/sage_mma.cuh"
#include "attention/sp_nccl.cuh"
#include "attention/sp_comm_check.h"

#define MAX_LOCAL 64

// ---- kernels ------------------------------------------------------------------------------------

// acc (rows, D) fp32 = the bf16 x.
__global__ void bf16_to_f32_kernel(float *acc, const __nv_bfloat16 *x, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        acc[i] = __bfloat162float(x[i]);
}

// ring_merge_partial per row, one warp a row: m = max(lse, lse_s), a = 2^(lse - m),
// b = 2^(lse_s - m), acc' = a/(a+b)·acc + b/(a+b)·out_s, lse' = m + log2(a + b); fp32.
// out (or NULL): acc' rounded to bf16 (the last step).
__global__ void ring_merge_kernel(float *acc, float *lse, const __nv_bfloat16 *out_s, const float *lse_s,
                                  __nv_bfloat16 *out, size_t rows, int D) {
    size_t row = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    float l0 = lse[row], l1 = lse_s[row], m = fmaxf(l0, l1);
    float a = exp2f(l0 - m), b = exp2f(l1 - m), l = a + b, wa = a / l, wb = b / l;
    for (int d = lane; d < D; d += 32) {
        size_t at = row * D + d;
        float o = wa * acc[at] + wb * __bfloat162float(out_s[at]);
        acc[at] = o;
        if (out) out[at] = __float2bfloat16_rn(o);
    }
    __syncwarp();
    if (lane == 0) lse[row] = m + log2f(l);
}

// k_mean = sum / N (as sage_quantize_cuda's division).
__global__ void divide_kernel(float *x, size_t n, float divisor) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fdiv_rn(x[i], divisor);
}

// The end of the 2-rank backward, per element i < n (fp32, the ring's sums in the ring's order):
// dq = (dq + own_dq) + foreign_dq (the ring adds step 0's dq, then step 1's);
// dk = dk + (own_dk + back_dk), dv likewise (the ring's packet is the owner's term plus the
// peer's, added into dk on its return; a + b == b + a in fp32).
// own: (dq, dk, dv) of this rank's q against its own k/v; back: (dk, dv) the peer computed for
// this rank's k/v.
__global__ void ring2_finish_kernel(float *dq, float *dk, float *dv, const float *own, const float *foreign_dq,
                                    const float *back, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        dq[i] = (dq[i] + own[i]) + foreign_dq[i];
        dk[i] = dk[i] + (own[n + i] + back[i]);
        dv[i] = dv[i] + (own[2 * n + i] + back[n + i]);
    }
}

static unsigned grid_for(size_t n, unsigned threads) {
    size_t blocks = (n + threads - 1) / threads;
    return (unsigned)(blocks < 65535 ? blocks : 65535);
}

// ---- shared machinery ---------------------------------------------------------------------------

static int check_ring_shape(const SpCudaComm *c, int N, const SagePV *sage, const char *fn, char *err) {
    if (!c) return sp_check_comm(c, fn, err);   // names the missing SpCudaComm
    if (c->ranks < 1 || c->n_local < 1 || c->n_local > c->ranks || c->n_local > MAX_LOCAL) {
        dit_set_error(err, "%s: %d ranks with %d local, expected 1 <= local <= ranks and local <= %d", fn,
                      c->ranks, c->n_local, MAX_LOCAL);
        return -1;
    }
    if (N % c->ranks != 0) {
        dit_set_error(err, "%s: sequence length N=%d not divisible by the %d ring ranks", fn, N, c->ranks);
        return -1;
    }
    if (sage && (N / c->ranks) % SAGE_CUDA_BLOCK != 0) {
        dit_set_error(err, "%s: shard length N/R=%d must be a multiple of %d (so that the sage quantization "
                      "blocks are the single-GPU ones)", fn, N / c->ranks, SAGE_CUDA_BLOCK);
        return -1;
    }
    if (sp_check_comm(c, fn, err) != 0) return -1;
    if (!c->comm_stream) {
        dit_set_error(err, "%s: the ring needs a comm_stream array (got NULL)", fn);
        return -1;
    }
    return 0;
}

// Per local rank: one stream-ordered allocation and the events of the schedule.
typedef struct {
    char *block;
    cudaEvent_t ready, arrived, dkv_ready, dkv_arrived;
} RankState;

static int begin(const SpCudaComm *c, RankState *st, size_t bytes, const char *fn, char *err) {
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        SP_CUDA_CHECK(cudaMallocAsync((void **)&st[i].block, bytes, c->stream[i]), err,
                      "%s: cudaMallocAsync of %zu bytes on rank %d", fn, bytes, c->rank[i]);
        cudaEvent_t *ev[4] = {&st[i].ready, &st[i].arrived, &st[i].dkv_ready, &st[i].dkv_arrived};
        for (int e = 0; e < 4; e++)
            SP_CUDA_CHECK(cudaEventCreateWithFlags(ev[e], cudaEventDisableTiming), err,
                          "%s: cudaEventCreate on rank %d", fn, c->rank[i]);
    }
    return 0;
}

static int end(const SpCudaComm *c, RankState *st, const char *fn, char *err) {
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        SP_CUDA_CHECK(cudaFreeAsync(st[i].block, c->stream[i]), err, "%s: cudaFreeAsync on rank %d", fn, c->rank[i]);
        cudaEventDestroy(st[i].ready); cudaEventDestroy(st[i].arrived);
        cudaEventDestroy(st[i].dkv_ready); cudaEventDestroy(st[i].dkv_arrived);
    }
    return 0;
}

// Ring pass on comm_stream after the work so far on stream (event `ready`), of n_buf buffers per
// rank from send[i·n_buf + b] into recv[i·n_buf + b]; `arrived` marks the end of the pass.
static int pass_overlapped(const SpCudaComm *c, RankState *st, int dkv, int n_buf, void *const *recv,
                           const void *const *send, const size_t *bytes, char *err) {
    for (int i = 0; i < c->n_local; i++) {
        cudaEvent_t ready = dkv ? st[i].dkv_ready : st[i].ready;
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "cudaSetDevice(%d)", c->device[i]);
        SP_CUDA_CHECK(cudaEventRecord(ready, c->stream[i]), err, "cudaEventRecord(ready) on rank %d", c->rank[i]);
        SP_CUDA_CHECK(cudaStreamWaitEvent(c->comm_stream[i], ready, 0), err,
                      "cudaStreamWaitEvent(comm_stream, ready) on rank %d", c->rank[i]);
    }
    if (sp_cuda_ring_pass_on(c, c->comm_stream, n_buf, recv, send, bytes, err) != 0) return -1;
    for (int i = 0; i < c->n_local; i++) {
        cudaEvent_t arrived = dkv ? st[i].dkv_arrived : st[i].arrived;
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "cudaSetDevice(%d)", c->device[i]);
        SP_CUDA_CHECK(cudaEventRecord(arrived, c->comm_stream[i]), err, "cudaEventRecord(arrived) on rank %d",
                      c->rank[i]);
    }
    return 0;
}

// stream[i] waits for the last pass (of k/v, or of the dk/dv packets).
static int wait_arrival(const SpCudaComm *c, const RankState *st, int i, int dkv, char *err) {
    SP_CUDA_CHECK(cudaStreamWaitEvent(c->stream[i], dkv ? st[i].dkv_arrived : st[i].arrived, 0), err,
                  "cudaStreamWaitEvent(stream, arrived) on rank %d", c->rank[i]);
    return 0;
}

// ---- forward ------------------------------------------------------------------------------------

// sage == NULL: exact. Per rank the block holds: acc (shard fp32) | lse_s (rows fp32) |
// out_s (shard bf16) | two slots: exact k, v (bf16 each); sage two forward workspaces.
static int ring_forward(const SpCudaComm *c, uint16_t *const *out, float *const *lse, const uint16_t *const *q,
                        const uint16_t *const *k, const uint16_t *const *v, const float *const *k_mean,
                        const float *const *v_scale, int B, int H, int N, int D, const SagePV *sage,
                        const char *fn, char *err) {
    if (check_ring_shape(c, N, sage, fn, err) != 0) return -1;
    int R = c->ranks, L = c->n_local, n = N / R, BH = B * H;
    size_t shard = (size_t)BH * n * D, rows = (size_t)BH * n;
    size_t head_bytes = (shard * 4 + rows * 4 + shard * 2 + 255) & ~(size_t)255;
    size_t slot_bytes = sage ? sage_cuda_forward_workspace_size(B, H, n, D, *sage) : (2 * shard * 2 + 255) & ~(size_t)255;
    RankState st[MAX_LOCAL];
    if (begin(c, st, head_bytes + 2 * slot_bytes, fn, err) != 0) return -1;
    int n_buf = sage ? 3 : 2;
    size_t bytes[3];
    void *slot[2][MAX_LOCAL * 3];   // slot[j][i·n_buf + b]: buffer b of rank i's slot j
    for (int i = 0; i < L; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        for (int j = 0; j < 2; j++) {
            char *base = st[i].block + head_bytes + j * slot_bytes;
            if (sage) {
                SageCudaQuant qv = sage_cuda_quant_view(base, B, H, n, D, *sage);
                slot[j][i * 3] = qv.k8; slot[j][i * 3 + 1] = qv.k_scale; slot[j][i * 3 + 2] = qv.v_t;
                if (sage_quantize_given_cuda(base, q[i], k[i], v[i], k_mean[i], v_scale[i], B, H, n, D, *sage,
                                             c->stream[i], err) != 0) return -1;
            } else {
                slot[j][i * 2] = base; slot[j][i * 2 + 1] = base + shard * 2;
            }
        }
        if (!sage) {
            SP_CUDA_CHECK(cudaMemcpyAsync(slot[0][i * 2], k[i], shard * 2, cudaMemcpyDeviceToDevice, c->stream[i]),
                          err, "%s: copy k (%zu bf16) into slot 0 on rank %d", fn, shard, c->rank[i]);
            SP_CUDA_CHECK(cudaMemcpyAsync(slot[0][i * 2 + 1], v[i], shard * 2, cudaMemcpyDeviceToDevice, c->stream[i]),
                          err, "%s: copy v (%zu bf16) into slot 0 on rank %d", fn, shard, c->rank[i]);
        }
    }
    if (sage) {
        size_t nblk = (size_t)n / SAGE_CUDA_BLOCK;
        bytes[0] = shard; bytes[1] = (size_t)BH * nblk * 4;
        bytes[2] = (size_t)BH * D * n * (*sage == SAGE_PV_FP8 ? 1 : 2);
    } else {
        bytes[0] = bytes[1] = shard * 2;
    }
    for (int s = 0; s < R; s++) {
        int cur = s % 2;
        for (int i = 0; i < L && s > 0; i++) {
            SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
            if (wait_arrival(c, st, i, 0, err) != 0) return -1;
        }
        if (s < R - 1 && pass_overlapped(c, st, 0, n_buf, slot[1 - cur], (const void *const *)slot[cur], bytes, err) != 0)
            return -1;
        for (int i = 0; i < L; i++) {   // rank r holds the k/v of rank (r - s) mod R
            SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
            float *acc = (float *)st[i].block, *lse_s = acc + shard;
            uint16_t *out_s = (uint16_t *)(lse_s + rows);
            uint16_t *o = s == 0 ? out[i] : out_s;
            float *l = s == 0 ? lse[i] : lse_s;
            int rc = sage ? sage_forward_quantized_cuda(o, l, st[i].block + head_bytes + cur * slot_bytes, B, H, n, D,
                                                        *sage, c->stream[i], err)
                          : flash_forward_cuda(o, l, q[i], (const uint16_t *)slot[cur][i * 2],
                                               (const uint16_t *)slot[cur][i * 2 + 1], B, H, n, D, c->stream[i], err);
            if (rc != 0) return -1;
            if (s == 0 && R > 1) {
                bf16_to_f32_kernel<<<grid_for(shard, 256), 256, 0, c->stream[i]>>>(acc, (const __nv_bfloat16 *)out[i],
                                                                                    shard);
                SP_CUDA_CHECK(cudaGetLastError(), err, "%s: launch bf16_to_f32_kernel (%zu) on rank %d", fn, shard,
                              c->rank[i]);
            } else if (s > 0) {
                ring_merge_kernel<<<grid_for(rows * 32, 256), 256, 0, c->stream[i]>>>(
                    acc, lse[i], (const __nv_bfloat16 *)out_s, lse_s, s == R - 1 ? (__nv_bfloat16 *)out[i] : NULL,
                    rows, D);
                SP_CUDA_CHECK(cudaGetLastError(), err, "%s: launch ring_merge_kernel (%zu rows, D=%d) on rank %d", fn,
                              rows, D, c->rank[i]);
            }
        }
    }
    return end(c, st, fn, err);
}

extern "C" int ring_attention_forward_cuda(const SpCudaComm *c, uint16_t *const *out, float *const *lse,
                                           const uint16_t *const *q, const uint16_t *const *k,
                                           const uint16_t *const *v, int B, int H, int N, int D, char *err) {
    return ring_forward(c, out, lse, q, k, v, NULL, NULL, B, H, N, D, NULL, "ring_attention_forward_cuda", err);
}

extern "C" int ring_sage_forward_cuda(const SpCudaComm *c, uint16_t *const *out, float *const *lse,
                                      const uint16_t *const *q, const uint16_t *const *k, const uint16_t *const *v,
                                      const float *const *k_mean, const float *const *v_scale,
                                      int B, int H, int N, int D, SagePV pv, char *err) {
    return ring_forward(c, out, lse, q, k, v, k_mean, v_scale, B, H, N, D, &pv, "ring_sage_forward_cuda", err);
}

// ---- backward -----------------------------------------------------------------------------------

// Per rank the block holds: k/v slots 2 x (k, v bf16) | dk/dv slots 2 x (dk, dv fp32) |
// scratch (dq_s, dk_s, dv_s fp32) | backward workspace | for sage the step's forward workspace.
typedef struct { size_t kv, dkv, scratch, ws, sage_ws, total; } BwdLayout;

static BwdLayout bwd_layout(int B, int H, int n, int D, const SagePV *sage) {
    size_t shard = (size_t)B * H * n * D;
    BwdLayout l;
    l.kv = 0;
    l.dkv = l.kv + ((2 * 2 * shard * 2 + 255) & ~(size_t)255);
    l.scratch = l.dkv + 2 * 2 * shard * 4;
    l.ws = l.scratch + 3 * shard * 4;
    l.sage_ws = l.ws + ((sage_cuda_backward_workspace_size(B, H, n, D) + 255) & ~(size_t)255);
    l.total = l.sage_ws + (sage ? sage_cuda_forward_workspace_size(B, H, n, D, *sage) : 0);
    return l;
}

// The return trip: after the last step rank r holds the finished (dk, dv) packet of shard
// (r + 1) mod R in dkv slot R % 2. One more pass delivers each to its owner, which adds it into
// dk, dv.
static int return_trip(const SpCudaComm *c, RankState *st, void *const *dkv_slot[2], float *const *dk,
                       float *const *dv, size_t shard, char *err) {
    int R = c->ranks, last = (R - 1) % 2;
    size_t bytes = 2 * shard * 4;
    if (pass_overlapped(c, st, 1, 1, dkv_slot[1 - last], (const void *const *)dkv_slot[last], &bytes, err) != 0)
        return -1;
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "cudaSetDevice(%d)", c->device[i]);
        if (wait_arrival(c, st, i, 1, err) != 0) return -1;
        const float *packet = (const float *)dkv_slot[1 - last][i];
        if (sp_cuda_accumulate(dk[i], packet, shard, c->stream[i], err) != 0 ||
            sp_cuda_accumulate(dv[i], packet + shard, shard, c->stream[i], err) != 0) return -1;
    }
    return 0;
}

// One backward step on `stream` of q/dout/out/lse against the k/v shard (ks, vs) held:
// dq_s, dk_s, dv_s (B, H, n, D) fp32, overwritten; for sage the shard is first quantized with the
// global k_mean into fwd_ws (the owner's k8 bit for bit).
static int backward_step(cudaStream_t stream, float *dq_s, float *dk_s, float *dv_s, void *ws, void *fwd_ws,
                         const uint16_t *ks, const uint16_t *vs, const uint16_t *dout, const uint16_t *q,
                         const uint16_t *out, const float *lse, const float *k_mean, const float *v_scale,
                         int B, int H, int n, int D, const SagePV *sage, char *err) {
    if (!sage) return flash_backward_cuda(dq_s, dk_s, dv_s, ws, dout, q, ks, vs, out, lse, B, H, n, D, stream, err);
    if (sage_quantize_given_cuda(fwd_ws, q, ks, vs, k_mean, v_scale, B, H, n, D, *sage, stream, err) != 0) return -1;
    return sage_backward_cuda(dq_s, dk_s, dv_s, ws, fwd_ws, dout, q, ks, vs, out, lse, NULL, B, H, n, D, *sage, stream,
                              err);
}

// Rank i's own step (its q against its own k/v) on the heads h0 <= bh < h1 of the flattened B·H:
// into own (dq, dk, dv) (3 x (B, H, n, D) fp32). Every head is computed on its own, so the heads
// of two calls are bitwise those of one call over all (the kernels and the quantization are per
// head; the workspaces are sized for all heads).
static int own_heads(const SpCudaComm *c, int i, float *own, void *ws, void *fwd_ws, const uint16_t *const *dout,
                     const uint16_t *const *q, const uint16_t *const *k, const uint16_t *const *v,
                     const uint16_t *const *out, const float *const *lse, const float *const *k_mean,
                     const float *const *v_scale, int B, int H, int n, int D, int h0, int h1, const SagePV *sage,
                     char *err) {
    if (h1 <= h0) return 0;
    size_t shard = (size_t)B * H * n * D, at = (size_t)h0 * n * D, stats_at = (size_t)h0 * D;
    const float *km = sage ? k_mean[i] + stats_at : NULL;
    const float *vs = sage && v_scale[i] ? v_scale[i] + stats_at : NULL;
    return backward_step(c->stream[i], own + at, own + shard + at, own + 2 * shard + at, ws, fwd_ws, k[i] + at,
                         v[i] + at, dout[i] + at, q[i] + at, out[i] + at, lse[i] + (size_t)h0 * n, km, vs, 1, h1 - h0,
                         n, D, sage, err);
}

// The backward for R = 2, per rank r and its peer p = 1 - r, the own step split into two head
// groups: (1) the pass of k, v (bf16, straight from k[i], v[i]) on comm_stream, overlapped with
// (2) the own step on the first half of the heads; (3) after the arrival, the foreign step, rank r's
// q against k_p, v_p: foreign (dq, dk, dv); (4) the pass of foreign (dk, dv) (fp32) to their owner p
// on comm_stream, overlapped with (5) the own step on the other heads; (6) after the arrival of
// back (dk, dv) from p, ring2_finish_kernel adds everything into dq, dk, dv. Passes: 1 of k/v, 1 of
// dk/dv (the ring: 1 and 2), both under compute. Per rank the block holds: kv (k, v bf16) |
// foreign (dq, dk, dv fp32) | own (dq, dk, dv) | back (dk, dv) | backward workspace | for sage
// the step's forward workspace.
static int ring2_backward(const SpCudaComm *c, float *const *dq, float *const *dk, float *const *dv,
                          const uint16_t *const *dout, const uint16_t *const *q, const uint16_t *const *k,
                          const uint16_t *const *v, const uint16_t *const *out, const float *const *lse,
                          const float *const *k_mean, const float *const *v_scale, int B, int H, int n, int D,
                          const SagePV *sage, const char *fn, char *err) {
    int L = c->n_local, BH = B * H, half = BH / 2;
    size_t shard = (size_t)BH * n * D;
    size_t kv_at = 0, foreign_at = (2 * shard * 2 + 255) & ~(size_t)255, own_at = foreign_at + 3 * shard * 4;
    size_t back_at = own_at + 3 * shard * 4, ws_at = back_at + 2 * shard * 4;
    size_t fwd_ws_at = ws_at + ((sage_cuda_backward_workspace_size(B, H, n, D) + 255) & ~(size_t)255);
    size_t total = fwd_ws_at + (sage ? sage_cuda_forward_workspace_size(B, H, n, D, *sage) : 0);
    RankState st[MAX_LOCAL];
    if (begin(c, st, total, fn, err) != 0) return -1;
    void *kv_recv[MAX_LOCAL * 2], *back_recv[MAX_LOCAL];
    const void *kv_send[MAX_LOCAL * 2], *foreign_send[MAX_LOCAL];
    for (int i = 0; i < L; i++) {
        kv_recv[i * 2] = st[i].block + kv_at;
        kv_recv[i * 2 + 1] = st[i].block + kv_at + shard * 2;
        kv_send[i * 2] = k[i];
        kv_send[i * 2 + 1] = v[i];
        foreign_send[i] = st[i].block + foreign_at + shard * 4;   // the foreign (dk, dv)
        back_recv[i] = st[i].block + back_at;
    }
    size_t kv_bytes[2] = {shard * 2, shard * 2}, dkv_bytes = 2 * shard * 4;
    if (pass_overlapped(c, st, 0, 2, kv_recv, kv_send, kv_bytes, err) != 0) return -1;
    for (int i = 0; i < L; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        char *b = st[i].block;
        float *foreign = (float *)(b + foreign_at), *own = (float *)(b + own_at);
        if (own_heads(c, i, own, b + ws_at, b + fwd_ws_at, dout, q, k, v, out, lse, k_mean, v_scale, B, H, n, D, 0,
                      half, sage, err) != 0 ||
            wait_arrival(c, st, i, 0, err) != 0 ||
            backward_step(c->stream[i], foreign, foreign + shard, foreign + 2 * shard, b + ws_at, b + fwd_ws_at,
                          (const uint16_t *)kv_recv[i * 2], (const uint16_t *)kv_recv[i * 2 + 1], dout[i], q[i],
                          out[i], lse[i], sage ? k_mean[i] : NULL, sage ? v_scale[i] : NULL, B, H, n, D, sage,
                          err) != 0) return -1;
    }
    if (pass_overlapped(c, st, 1, 1, back_recv, foreign_send, &dkv_bytes, err) != 0) return -1;
    for (int i = 0; i < L; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        char *b = st[i].block;
        float *foreign = (float *)(b + foreign_at), *own = (float *)(b + own_at);
        if (own_heads(c, i, own, b + ws_at, b + fwd_ws_at, dout, q, k, v, out, lse, k_mean, v_scale, B, H, n, D, half,
                      BH, sage, err) != 0 ||
            wait_arrival(c, st, i, 1, err) != 0) return -1;
        ring2_finish_kernel<<<grid_for(shard, 256), 256, 0, c->stream[i]>>>(dq[i], dk[i], dv[i], own, foreign,
                                                                            (const float *)back_recv[i], shard);
        SP_CUDA_CHECK(cudaGetLastError(), err, "%s: launch ring2_finish_kernel (%zu) on rank %d", fn, shard,
                      c->rank[i]);
    }
    return end(c, st, fn, err);
}

static int ring_backward(const SpCudaComm *c, float *const *dq, float *const *dk, float *const *dv,
                         const uint16_t *const *dout, const uint16_t *const *q, const uint16_t *const *k,
                         const uint16_t *const *v, const uint16_t *const *out, const float *const *lse,
                         const float *const *k_mean, const float *const *v_scale, int B, int H, int N, int D,
                         const SagePV *sage, const char *fn, char *err) {
    if (check_ring_shape(c, N, sage, fn, err) != 0) return -1;
    int R = c->ranks, L = c->n_local, n = N / R;
    if (R == 2)
        return ring2_backward(c, dq, dk, dv, dout, q, k, v, out, lse, k_mean, v_scale, B, H, n, D, sage, fn, err);
    size_t shard = (size_t)B * H * n * D;
    BwdLayout lay = bwd_layout(B, H, n, D, sage);
    RankState st[MAX_LOCAL];
    if (begin(c, st, lay.total, fn, err) != 0) return -1;
    void *kv_slot[2][MAX_LOCAL * 2], *dkv_buf[2][MAX_LOCAL];
    for (int i = 0; i < L; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        for (int j = 0; j < 2; j++) {
            char *kv = st[i].block + lay.kv + j * 2 * shard * 2;
            kv_slot[j][i * 2] = kv;
            kv_slot[j][i * 2 + 1] = kv + shard * 2;
            dkv_buf[j][i] = st[i].block + lay.dkv + j * 2 * shard * 4;
        }
        SP_CUDA_CHECK(cudaMemcpyAsync(kv_slot[0][i * 2], k[i], shard * 2, cudaMemcpyDeviceToDevice, c->stream[i]),
                      err, "%s: copy k (%zu bf16) into slot 0 on rank %d", fn, shard, c->rank[i]);
        SP_CUDA_CHECK(cudaMemcpyAsync(kv_slot[0][i * 2 + 1], v[i], shard * 2, cudaMemcpyDeviceToDevice, c->stream[i]),
                      err, "%s: copy v (%zu bf16) into slot 0 on rank %d", fn, shard, c->rank[i]);
    }
    void *const *dkv_slot[2] = {dkv_buf[0], dkv_buf[1]};
    size_t kv_bytes[2] = {shard * 2, shard * 2}, dkv_bytes = 2 * shard * 4;
    for (int s = 0; s < R; s++) {
        int cur = s % 2;
        for (int i = 0; i < L && s > 0; i++) {
            SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
            if (wait_arrival(c, st, i, 0, err) != 0) return -1;
        }
        if (s < R - 1 &&
            pass_overlapped(c, st, 0, 2, kv_slot[1 - cur], (const void *const *)kv_slot[cur], kv_bytes, err) != 0)
            return -1;
        for (int i = 0; i < L; i++) {   // rank r holds k/v of rank (r - s) mod R and its dk/dv so far
            SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
            const uint16_t *ks = (const uint16_t *)kv_slot[cur][i * 2], *vs = (const uint16_t *)kv_slot[cur][i * 2 + 1];
            float *scratch = (float *)(st[i].block + lay.scratch);
            float *packet = (float *)dkv_buf[cur][i];
            float *dks = s == 0 ? packet : scratch + shard;   // step 0 starts the packet
            if (backward_step(c->stream[i], scratch, dks, dks + shard, st[i].block + lay.ws, st[i].block + lay.sage_ws,
                              ks, vs, dout[i], q[i], out[i], lse[i], sage ? k_mean[i] : NULL,
                              sage ? v_scale[i] : NULL, B, H, n, D, sage, err) != 0 ||
                sp_cuda_accumulate(dq[i], scratch, shard, c->stream[i], err) != 0) return -1;
            if (s > 0 && (wait_arrival(c, st, i, 1, err) != 0 ||
                          sp_cuda_accumulate(packet, scratch + shard, 2 * shard, c->stream[i], err) != 0))
                return -1;
        }
        if (s < R - 1 && pass_overlapped(c, st, 1, 1, dkv_slot[1 - cur], (const void *const *)dkv_slot[cur],
                                         &dkv_bytes, err) != 0)
            return -1;
    }
    if (return_trip(c, st, dkv_slot, dk, dv, shard, err) != 0) return -1;
    return end(c, st, fn, err);
}

extern "C" int ring_attention_backward_cuda(const SpCudaComm *c, float *const *dq, float *const *dk,
                                            float *const *dv, const uint16_t *const *dout,
                                            const uint16_t *const *q, const uint16_t *const *k,
                                            const uint16_t *const *v, const uint16_t *const *out,
                                            const float *const *lse, int B, int H, int N, int D, char *err) {
    return ring_backward(c, dq, dk, dv, dout, q, k, v, out, lse, NULL, NULL, B, H, N, D, NULL,
                         "ring_attention_backward_cuda", err);
}

extern "C" int ring_sage_backward_cuda(const SpCudaComm *c, float *const *dq, float *const *dk, float *const *dv,
                                       const uint16_t *const *dout, const uint16_t *const *q,
                                       const uint16_t *const *k, const uint16_t *const *v,
                                       const uint16_t *const *out, const float *const *lse,
                                       const float *const *k_mean, const float *const *v_scale,
                                       int B, int H, int N, int D, SagePV pv, char *err) {
    return ring_backward(c, dq, dk, dv, dout, q, k, v, out, lse, k_mean, v_scale, B, H, N, D, &pv,
                         "ring_sage_backward_cuda", err);
}

// ---- sage statistics ----------------------------------------------------------------------------

extern "C" int ring_sage_stats_cuda(const SpCudaComm *c, float *const *k_mean, float *const *v_scale,
                                    const uint16_t *const *k, const uint16_t *const *v,
                                    int B, int H, int N, int D, SagePV pv, char *err) {
    const char *fn = "ring_sage_stats_cuda";
    if (check_ring_shape(c, N, NULL, fn, err) != 0) return -1;
    int n = N / c->ranks;
    size_t count = (size_t)B * H * D;
    RankState st[MAX_LOCAL];
    if (begin(c, st, sage_cuda_forward_workspace_size(B, H, n, D, pv), fn, err) != 0) return -1;
    for (int i = 0; i < c->n_local; i++) {   // the shard's Σ k and max|v|/448
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        if (sage_kv_stats_cuda(k_mean[i], v_scale[i], st[i].block, k[i], v[i], B, H, n, D, pv, c->stream[i], err) != 0)
            return -1;
    }
    if (sp_cuda_all_reduce_sum(c, k_mean, count, err) != 0) return -1;
    if (pv == SAGE_PV_FP8 && sp_cuda_all_reduce_max(c, v_scale, count, err) != 0) return -1;
    for (int i = 0; i < c->n_local; i++) {
        SP_CUDA_CHECK(cudaSetDevice(c->device[i]), err, "%s: cudaSetDevice(%d)", fn, c->device[i]);
        divide_kernel<<<grid_for(count, 256), 256, 0, c->stream[i]>>>(k_mean[i], count, (float)N);
        SP_CUDA_CHECK(cudaGetLastError(), err, "%s: launch divide_kernel (%zu) on rank %d", fn, count, c->rank[i]);
    }
    return end(c, st, fn, err);
}
