# Benchmark: our BF16 flash attention (attention/flash_*.cu) forward and backward against PyTorch
# SDPA (cuDNN and flash backends), all in one process on one GPU. 16 heads, head dims 64 and 128,
# N = 1K..32K with B·N = 16K tokens (B = 1 from 16K). FLOPs: 4·B·H·N²·D forward, 2.5× that
# backward. Each time is the median of `iters` CUDA-event-timed runs after warm-up. Also checks
# our out and gradients against fp32 SDPA on the first head (cosine).
# Libraries that export flash_backward_sm90_cuda (the Hopper backward, not yet the default) and
# whose device runs it get two more backward columns: "sm90 bwd" (unordered dq) and "sm90 det"
# (flash_backward_set_deterministic(1)); its gradients are checked against SDPA too.
# Build the shared library first (on a machine with nvcc); more libraries (builds of the same
# sources with other -D settings) add forward/backward columns:
#   gcc -O2 -fPIC -std=c11 -D_GNU_SOURCE -I. -c layers/common.c -o build/common_pic.o
#   nvcc -O3 -std=c++17 -I. --use_fast_math -Xcompiler -fPIC -gencode=arch=compute_80,code=sm_80 \
#        -gencode=arch=compute_90a,code=sm_90a -shared -o build/libflash_bench.so \
#        attention/flash_forward.cu attention/flash_forward_sm90.cu attention/flash_backward.cu \
#        attention/flash_backward_sm90.cu build/common_pic.o
#   python3 dev/bench_flash.py build/libflash_bench.so [build/libflash_other.so ...]
import ctypes
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import I, P, check, err, median_ms, time_sdpa  # noqa: E402


def load(path):
    lib = ctypes.CDLL(path)
    lib.flash_forward_cuda.argtypes = [P, P, P, P, P, I, I, I, I, P, ctypes.c_char_p]
    lib.flash_cuda_backward_workspace_size.restype = ctypes.c_size_t
    lib.flash_cuda_backward_workspace_size.argtypes = [I, I, I, I]
    lib.flash_backward_cuda.argtypes = [P, P, P, P, P, P, P, P, P, P, I, I, I, I, P, ctypes.c_char_p]
    if hasattr(lib, "flash_backward_sm90_cuda"):
        lib.flash_backward_sm90_cuda.argtypes = lib.flash_backward_cuda.argtypes
        lib.flash_backward_set_deterministic.argtypes = [I]
    return lib


def has_sm90_backward(lib):
    """The library exports the Hopper backward and this device can run it."""
    return hasattr(lib, "flash_backward_sm90_cuda") and lib.flash_backward_sm90_available() == 1


def cos(x, y):
    return F.cosine_similarity(x.float().flatten(), y.float().flatten(), dim=0).item()


def main():
    libs = [(os.path.basename(p).removesuffix(".so"), load(p)) for p in (sys.argv[1:] or ["build/libflash_bench.so"])]
    main_name = libs[0][0]
    sm90 = has_sm90_backward(libs[0][1])
    torch.manual_seed(0)
    print(f"# device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")
    H = 16
    rows = []
    for D in (64, 128):
        for N in (1024, 2048, 4096, 8192, 16384, 32768):
            B = max(1, 16384 // N)
            iters = 30 if N <= 8192 else 10
            q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            stream = torch.cuda.current_stream().cuda_stream
            out = torch.empty_like(q)
            lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
            dq, dk, dv = (torch.empty(B, H, N, D, device="cuda", dtype=torch.float32) for _ in range(3))
            t = {}
            grads = {}   # backward -> its dq, dk, dv of head 0 after its timed runs
            for name, lib in libs:
                ws = torch.empty(lib.flash_cuda_backward_workspace_size(B, H, N, D), device="cuda", dtype=torch.uint8)

                def fwd():
                    check(lib.flash_forward_cuda(out.data_ptr(), lse.data_ptr(), q.data_ptr(), k.data_ptr(),
                                                 v.data_ptr(), B, H, N, D, stream, err), "forward")

                def bwd():
                    check(lib.flash_backward_cuda(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), ws.data_ptr(),
                                                  do.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                  out.data_ptr(), lse.data_ptr(), B, H, N, D, stream, err),
                          "backward")

                t[name] = median_ms(fwd, iters)
                t[name + "_bwd"] = median_ms(bwd, iters)
                grads[name + "_bwd"] = tuple(x[:1, :1].clone() for x in (dq, dk, dv))
                if has_sm90_backward(lib):
                    def bwd90():
                        check(lib.flash_backward_sm90_cuda(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), ws.data_ptr(),
                                                           do.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                           out.data_ptr(), lse.data_ptr(), B, H, N, D, stream, err),
                              "sm90 backward")

                    t[name + "_sm90_bwd"] = median_ms(bwd90, iters)
                    grads[name + "_sm90_bwd"] = tuple(x[:1, :1].clone() for x in (dq, dk, dv))
                    before = lib.flash_backward_set_deterministic(1)
                    t[name + "_sm90det_bwd"] = median_ms(bwd90, iters)
                    lib.flash_backward_set_deterministic(before)
            # accuracy of the last library's out and of each backward's grads on head 0 against fp32
            # SDPA (efficient backend)
            q1, k1, v1 = (x[:1, :1].float().requires_grad_() for x in (q, k, v))
            ref = F.scaled_dot_product_attention(q1, k1, v1)
            ref.backward(do[:1, :1].float())
            acc = {n: ",".join(f"{cos(g, r):.6f}" for g, r in zip(gs, (q1.grad, k1.grad, v1.grad)))
                   for n, gs in grads.items()}
            out_cos = cos(out[:1, :1], ref)
            lse_ref = torch.logsumexp((q1 @ k1.transpose(-1, -2)) / D ** 0.5, dim=-1) / torch.log(torch.tensor(2.0))
            lse_err = (lse[:1, :1] - lse_ref).abs().max().item()
            del q1, k1, v1, ref, lse_ref
            t.update(time_sdpa(q, k, v, do, iters))
            flops = 4 * B * H * N * N * D
            tops = {n: (2.5 if n.endswith("bwd") else 1) * flops / (ms * 1e-3) / 1e12 for n, ms in t.items()}
            rows.append((D, N, B, tops))
            print(f"D={D} N={N} B={B}: " + " ".join(f"{n} {ms:.3f}ms/{tops[n]:.0f}T" for n, ms in t.items())
                  + f" cos vs fp32 sdpa, head 0: out {out_cos:.6f}, dq,dk,dv "
                  + " ".join(f"{n} {a}" for n, a in acc.items()) + f" lse max diff {lse_err:.2e}", flush=True)
            del q, k, v, do, out, lse, dq, dk, dv, ws
            torch.cuda.empty_cache()
    extra = [n for n, _ in libs[1:]]
    sm90_head = " sm90 bwd | sm90/cuDNN | sm90 det |" if sm90 else ""
    print("\n| D | N | B | ours fwd | cuDNN fwd | flash fwd | ours/cuDNN | ours bwd | cuDNN bwd | flash bwd "
          "| ours/cuDNN |" + sm90_head + "".join(f" {n} fwd | {n} bwd |" for n in extra))
    print("|---" * (11 + 3 * sm90 + 2 * len(extra)) + "|")
    for D, N, B, tops in rows:
        sm90_cols = (f" {tops[main_name + '_sm90_bwd']:.0f} | {tops[main_name + '_sm90_bwd'] / tops['cudnn_bwd']:.2f} "
                     f"| {tops[main_name + '_sm90det_bwd']:.0f} |") if sm90 else ""
        print(f"| {D} | {N} | {B} | {tops[main_name]:.0f} | {tops['cudnn']:.0f} | {tops['flash']:.0f} "
              f"| {tops[main_name] / tops['cudnn']:.2f} | {tops[main_name + '_bwd']:.0f} | {tops['cudnn_bwd']:.0f} "
              f"| {tops['flash_bwd']:.0f} | {tops[main_name + '_bwd'] / tops['cudnn_bwd']:.2f} |" + sm90_cols
              + "".join(f" {tops[n]:.0f} | {tops[n + '_bwd']:.0f} |" for n in extra))
    print(f"(TFLOP/s; forward 4·B·H·N²·D, backward 2.5× that; ours = {main_name})")


if __name__ == "__main__":
    main()
