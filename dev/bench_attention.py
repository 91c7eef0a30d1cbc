# Benchmark: our sage attention (attention/sage_*.cu) forward and backward against PyTorch SDPA
# (cuDNN and flash backends), all in one process on one GPU. 16 heads, head dims 64 and 128,
# N = 1K..32K with B·N = 16K tokens (B = 1 from 16K). FLOPs: 4·B·H·N²·D forward, 2.5× that
# backward. Each time is the median of `iters` CUDA-event-timed runs after warm-up (bench_common:
# queued behind a GPU sleep, without the host's launch overhead). The headline pair, our Hopper
# forward (quantization included) and backward against cuDNN's, is timed in ROUNDS (default 5)
# interleaved rounds (order reversed every other round: the H200 runs power-limited, so its clock
# drifts over a run); their times are the medians over rounds and their ratios the medians of the
# rounds' ratios, with the rounds' range beside them.
# Where the cudnn frontend's Python package is importable (dev/cudnn_fp8.py), cuDNN's own FP8
# attention (per-tensor e4m3 scales) is timed on the same inputs too, and the cosine against fp32
# attention of its and our outputs and gradients (first two heads) is printed beside it.
# Build the shared library first (on a machine with nvcc):
#   gcc -O2 -fPIC -std=c11 -D_GNU_SOURCE -I. -c layers/common.c -o build/common_pic.o
#   nvcc -O3 -std=c++17 -I. --use_fast_math -Xcompiler -fPIC -gencode=arch=compute_80,code=sm_80 \
#        -gencode=arch=compute_90a,code=sm_90a -shared -o build/libsage_bench.so \
#        attention/sage_quant.cu attention/sage_forward.cu attention/sage_forward_sm90.cu \
#        attention/sage_backward.cu attention/sage_backward_sm90.cu build/common_pic.o
#   python3 dev/bench_attention.py [build/libsage_bench.so [D:N,...]]
import ctypes
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import I, P, check, err, median_ms, sdpa_calls, time_sdpa  # noqa: E402

try:
    from cudnn_fp8 import Fp8Attention
except Exception as e:   # the package is optional (and loads cuDNN 9 itself): no FP8 columns then
    Fp8Attention = None
    print(f"# cuDNN FP8 attention not measured: {e}")

# "sage_fp8"/"sage_fp16" time the mma.sync kernel (sage_forward.cu), "sm90" the wgmma kernel
# (sage_forward_sm90.cu, FP8 P·V), which sage_forward_cuda otherwise picks on an sm_90 device.
# "sage_bwd" times the mma.sync backward (sage_backward_cuda under DIT_SAGE_MMA_SYNC=1), "sm90_bwd"
# the wgmma backward (sage_backward_sm90.cu), both on the same forward's out, lse and workspace.
os.environ["DIT_SAGE_MMA_SYNC"] = "1"
ROUNDS = int(os.environ.get("ROUNDS", 5))
lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1 else "build/libsage_bench.so")
lib.sage_cuda_forward_workspace_size.restype = ctypes.c_size_t
lib.sage_cuda_forward_workspace_size.argtypes = [I, I, I, I, I]
lib.sage_cuda_backward_workspace_size.restype = ctypes.c_size_t
lib.sage_cuda_backward_workspace_size.argtypes = [I, I, I, I]
lib.sage_quantize_cuda.argtypes = [P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
lib.sage_forward_cuda.argtypes = [P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
lib.sage_forward_sm90_available.restype = ctypes.c_int
lib.sage_forward_sm90_cuda.argtypes = [P, P, P, P, P, P, I, I, I, I, P, ctypes.c_char_p]
lib.sage_backward_cuda.argtypes = [P, P, P, P, P, P, P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
lib.sage_backward_sm90_available.restype = ctypes.c_int
lib.sage_backward_sm90_cuda.argtypes = lib.sage_backward_cuda.argtypes
FP8, FP16 = 0, 1


def cosine(x, ref):
    return F.cosine_similarity(x.float().flatten(), ref.float().flatten(), dim=0).item()


def time_cudnn_fp8(q, k, v, do, iters, ref_out, sage_grads, sage_is_sm90):
    """ms of cuDNN's FP8 forward and backward ({"cudnn_fp8", "cudnn_fp8_bwd"}, none where cuDNN
    refuses the graph); prints the cosines against fp32 attention on the first two heads: cuDNN
    FP8's out and gradients, and our sage backward's gradients (sage_grads, from the last timed
    backward: sm90 when sage_is_sm90)."""
    try:
        fp8 = Fp8Attention(q, k, v, do)
    except Exception as e:   # cuDNN's refusals come as several exception types
        print(f"  cuDNN FP8: not supported here ({type(e).__name__}: {str(e)[:200]})")
        return {}
    t = {"cudnn_fp8": median_ms(fp8.forward, iters), "cudnn_fp8_bwd": median_ms(fp8.backward, iters)}
    qf, kf, vf = (x.float()[:, :2].detach().requires_grad_() for x in (q, k, v))
    of = F.scaled_dot_product_attention(qf, kf, vf)
    ref_g = torch.autograd.grad(of, (qf, kf, vf), do.float()[:, :2])
    fp8_g = fp8.grads()
    print("  cos vs fp32: cuDNN FP8 out %.6f dq %.6f dk %.6f dv %.6f; sage %s bwd dq %.6f dk %.6f dv %.6f" % (
        cosine(fp8.out()[:, :2], ref_out), *(cosine(g[:, :2], r) for g, r in zip(fp8_g, ref_g)),
        "sm90" if sage_is_sm90 else "mma.sync", *(cosine(g[:, :2], r) for g, r in zip(sage_grads, ref_g))),
        flush=True)
    del fp8, qf, kf, vf, of, ref_g, fp8_g
    return t


def main():
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    print(f"# device: {dev}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")
    H = 16
    rows = []
    sm90 = lib.sage_forward_sm90_available() == 1
    bwd90 = lib.sage_backward_sm90_available() == 1
    print(f"# sm90 wgmma kernels available: forward {sm90}, backward {bwd90}")
    # optional second argument: only these "D:N" sizes, comma-separated (e.g. 128:16384,64:16384)
    only = {tuple(int(x) for x in dn.split(":")) for dn in sys.argv[2].split(",")} if len(sys.argv) > 2 else None
    for D in (64, 128):
        for N in (1024, 2048, 4096, 8192, 16384, 32768):
            if only and (D, N) not in only:
                continue
            B = max(1, 16384 // N)
            iters = 30 if N <= 8192 else 10
            q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            stream = torch.cuda.current_stream().cuda_stream
            out = torch.empty_like(q)
            lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
            ws = {pv: torch.empty(lib.sage_cuda_forward_workspace_size(B, H, N, D, pv), device="cuda",
                                  dtype=torch.uint8) for pv in (FP8, FP16)}
            bws = torch.empty(lib.sage_cuda_backward_workspace_size(B, H, N, D), device="cuda", dtype=torch.uint8)
            dq, dk, dv = (torch.empty(B, H, N, D, device="cuda", dtype=torch.float32) for _ in range(3))

            def quant(pv):
                check(lib.sage_quantize_cuda(ws[pv].data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                             B, H, N, D, pv, stream, err), "quantize")

            def fwd(pv):
                check(lib.sage_forward_cuda(out.data_ptr(), lse.data_ptr(), ws[pv].data_ptr(), q.data_ptr(),
                                            k.data_ptr(), v.data_ptr(), B, H, N, D, pv, stream, err), "forward")

            def fwd_sm90():
                check(lib.sage_forward_sm90_cuda(out.data_ptr(), lse.data_ptr(), ws[FP8].data_ptr(), q.data_ptr(),
                                                 k.data_ptr(), v.data_ptr(), B, H, N, D, stream, err), "forward sm90")

            def bwd():
                check(lib.sage_backward_cuda(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), bws.data_ptr(),
                                             ws[FP8].data_ptr(), do.data_ptr(), q.data_ptr(), k.data_ptr(),
                                             v.data_ptr(), out.data_ptr(), lse.data_ptr(), None,
                                             B, H, N, D, FP8, stream, err), "backward")

            def bwd_sm90():
                check(lib.sage_backward_sm90_cuda(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), bws.data_ptr(),
                                                  ws[FP8].data_ptr(), do.data_ptr(), q.data_ptr(), k.data_ptr(),
                                                  v.data_ptr(), out.data_ptr(), lse.data_ptr(), None,
                                                  B, H, N, D, FP8, stream, err), "backward sm90")

            flops = 4 * B * H * N * N * D
            t = {}
            t["quant"] = median_ms(lambda: quant(FP8), iters)
            t["sage_fp16"] = median_ms(lambda: fwd(FP16), iters)
            t["sage_fp8"] = median_ms(lambda: fwd(FP8), iters)
            ref = F.scaled_dot_product_attention(q.float()[:, :2], k.float()[:, :2], v.float()[:, :2])
            cos = cosine(out[:, :2], ref)
            cos90 = float("nan")
            if sm90:
                fwd_sm90()
                cos90 = cosine(out[:, :2], ref)
            t["sage_bwd"] = median_ms(bwd, iters)
            bwd_diff = float("nan")   # max over dq, dk, dv of rel L2(sm90 - mma.sync)
            if bwd90:
                ref_g = [x.clone() for x in (dq, dk, dv)]
                bwd_sm90()
                bwd_diff = max(((x - r).norm() / r.norm()).item() for x, r in zip((dq, dk, dv), ref_g))
                del ref_g
            headline = sm90 and bwd90   # our Hopper pair and cuDNN's, timed below in interleaved rounds
            t.update(time_sdpa(q, k, v, do, iters, ("flash",) if headline else ("cudnn", "flash")))
            ratios = {}
            if headline:
                cudnn_fwd, cudnn_bwd = sdpa_calls(q, k, v, do, SDPBackend.CUDNN_ATTENTION)
                calls = [("sm90", fwd_sm90), ("cudnn", cudnn_fwd), ("sm90_bwd", bwd_sm90), ("cudnn_bwd", cudnn_bwd)]
                rounds = [{n: median_ms(fn, iters) for n, fn in (calls if r % 2 == 0 else calls[::-1])}
                          for r in range(ROUNDS)]
                for n, _ in calls:
                    t[n] = statistics.median(x[n] for x in rounds)
                ratios = {"fwd": [x["cudnn"] / x["sm90"] for x in rounds],
                          "bwd": [x["cudnn_bwd"] / x["sm90_bwd"] for x in rounds]}
            if Fp8Attention is not None:
                t.update(time_cudnn_fp8(q, k, v, do, iters, ref, (dq, dk, dv), bwd90))
            tops = {n: (2.5 if n.endswith("bwd") else 1) * flops / (ms * 1e-3) / 1e12 for n, ms in t.items()}
            rows.append((D, N, B, t, tops, cos, ratios))
            print(f"D={D} N={N} B={B}: " + " ".join(f"{n} {ms:.3f}ms/{tops[n]:.0f}T" for n, ms in t.items())
                  + f" cos(sage_fp8, fp32 sdpa)={cos:.6f} cos(sm90, fp32 sdpa)={cos90:.6f}"
                  + f" rel(sm90 bwd, sage bwd)={bwd_diff:.2e}", flush=True)
            del q, k, v, do, out, lse, ws, bws, dq, dk, dv
            torch.cuda.empty_cache()
    if any("cudnn_fp8" in t for _, _, _, t, _, _, _ in rows):
        print("\n| D | N | B | sm90 fwd | cuDNN bf16 fwd | cuDNN FP8 fwd | sm90/cuDNN FP8 | sm90 bwd | cuDNN bf16 bwd "
              "| cuDNN FP8 bwd | sm90 bwd/cuDNN FP8 |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for D, N, B, t, tops, cos, ratios in rows:
            nan = float("nan")
            f8, b8 = tops.get("cudnn_fp8", nan), tops.get("cudnn_fp8_bwd", nan)
            t90, b90 = tops.get("sm90", nan), tops.get("sm90_bwd", nan)
            print(f"| {D} | {N} | {B} | {t90:.0f} | {tops['cudnn']:.0f} | {f8:.0f} | {t90 / f8:.2f} | {b90:.0f} "
                  f"| {tops['cudnn_bwd']:.0f} | {b8:.0f} | {b90 / b8:.2f} |")
    print("\n| D | N | B | sm90 fwd | sage fp8 fwd | sage fp16 fwd | (quant ms) | cuDNN fwd | flash fwd "
          "| sm90/cuDNN | fp8/cuDNN | sage bwd | sm90 bwd | cuDNN bwd | flash bwd | bwd/cuDNN | sm90 bwd/cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for D, N, B, t, tops, cos, ratios in rows:
        t90 = tops.get("sm90", float("nan"))
        b90 = tops.get("sm90_bwd", float("nan"))
        print(f"| {D} | {N} | {B} | {t90:.0f} | {tops['sage_fp8']:.0f} | {tops['sage_fp16']:.0f} | {t['quant']:.3f} "
              f"| {tops['cudnn']:.0f} | {tops['flash']:.0f} | {t90 / tops['cudnn']:.2f} "
              f"| {tops['sage_fp8'] / tops['cudnn']:.2f} "
              f"| {tops['sage_bwd']:.0f} | {b90:.0f} | {tops['cudnn_bwd']:.0f} | {tops['flash_bwd']:.0f} "
              f"| {tops['sage_bwd'] / tops['cudnn_bwd']:.2f} | {b90 / tops['cudnn_bwd']:.2f} |")
    print("(TOPS; forward 4·B·H·N²·D, backward 2.5× that; sage fwd includes the quantization pass)")
    print(f"\nThe headline ratios, {ROUNDS} interleaved rounds (median [min, max] of the rounds' cuDNN / ours):")
    print("| D | N | B | sm90 fwd TOPS | cuDNN fwd TOPS | fwd ratio | sm90 bwd TOPS | cuDNN bwd TOPS | bwd ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for D, N, B, t, tops, cos, ratios in rows:
        if not ratios:
            continue
        f, b = ratios["fwd"], ratios["bwd"]
        print(f"| {D} | {N} | {B} | {tops['sm90']:.0f} | {tops['cudnn']:.0f} | {statistics.median(f):.2f} "
              f"[{min(f):.2f}, {max(f):.2f}] | {tops['sm90_bwd']:.0f} | {tops['cudnn_bwd']:.0f} "
              f"| {statistics.median(b):.2f} [{min(b):.2f}, {max(b):.2f}] |")


if __name__ == "__main__":
    main()
