# The sage forward (quantization included) of two builds of the attention library in one process,
# alternating: e.g. a branch's library against main's. Each library is loaded on its own (ctypes,
# RTLD_LOCAL), on the same inputs; 16 heads, B·N = 16K tokens and N = 32K, FP8 and FP16 P·V (and
# "bf16": our bf16 FlashAttention forward, flash_forward_cuda, for libraries that hold it), head
# dims D (default 128; a head dim whose kernel a change leaves alone times the noise); 5 rounds of
# `iters` CUDA-event-timed calls per library, the median of the round medians. Also checks that the
# two outputs and lse are bitwise equal (for changes that must not change results), gives each
# output's relative L2 error against fp32 attention (first two heads), and times cuDNN.
#   [PV=fp8,fp16,bf16] [DS=128,64] [NS=N:B,...] python3 dev/bench_sage_fwd_ab.py NEW.so BASE.so
# (libraries as in bench_attention.py; NS: the sequence lengths and batches, default
# 4096:4,8192:2,16384:1,32768:1)
import ctypes
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import I, P, check, err, median_ms  # noqa: E402

H = 16
PV = {"fp8": 0, "fp16": 1}   # SagePV; "bf16" (the flash forward) takes no workspace


def load(path):
    lib = ctypes.CDLL(os.path.abspath(path))
    if hasattr(lib, "sage_forward_cuda"):   # (libflash_bench.so holds the flash forward only)
        lib.sage_cuda_forward_workspace_size.restype = ctypes.c_size_t
        lib.sage_cuda_forward_workspace_size.argtypes = [I, I, I, I, I]
        lib.sage_forward_cuda.argtypes = [P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
    if hasattr(lib, "flash_forward_cuda"):
        lib.flash_forward_cuda.argtypes = [P, P, P, P, P, I, I, I, I, P, ctypes.c_char_p]
    return lib


def main():
    libs = {"new": load(sys.argv[1]), "base": load(sys.argv[2])}
    torch.manual_seed(0)
    print(f"# device: {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs; "
          f"new = {sys.argv[1]}, base = {sys.argv[2]}")
    print("| P·V | D | N | B | new ms (TOPS) | base ms (TOPS) | base / new | cuDNN ms (TOPS) | cuDNN / new | out, lse bitwise equal "
          "| rel L2 vs fp32: new / base |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    pvs = os.environ.get("PV", "fp8").split(",")
    dims = [int(d) for d in os.environ.get("DS", "128").split(",")]
    shapes = [tuple(int(x) for x in nb.split(":")) for nb in os.environ.get("NS", "4096:4,8192:2,16384:1,32768:1").split(",")]
    for pv, D, (N, B) in ((pv, D, nb) for pv in pvs for D in dims for nb in shapes):
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        stream = torch.cuda.current_stream().cuda_stream
        ws = {n: torch.empty(lib.sage_cuda_forward_workspace_size(B, H, N, D, PV[pv]), device="cuda", dtype=torch.uint8)
              for n, lib in libs.items()} if pv in PV else {}
        out = {n: torch.empty_like(q) for n in libs}
        lse = {n: torch.empty(B, H, N, device="cuda", dtype=torch.float32) for n in libs}

        def fwd(n):
            if pv == "bf16":
                check(libs[n].flash_forward_cuda(out[n].data_ptr(), lse[n].data_ptr(), q.data_ptr(), k.data_ptr(),
                                                 v.data_ptr(), B, H, N, D, stream, err), f"flash forward {n}")
                return
            check(libs[n].sage_forward_cuda(out[n].data_ptr(), lse[n].data_ptr(), ws[n].data_ptr(), q.data_ptr(),
                                            k.data_ptr(), v.data_ptr(), B, H, N, D, PV[pv], stream, err), f"forward {n}")

        iters = 50 if N <= 1024 else 20 if N <= 8192 else 10
        rounds = {n: [] for n in libs}
        for _ in range(5):
            for n in libs:
                rounds[n].append(median_ms(lambda: fwd(n), iters))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = median_ms(lambda: F.scaled_dot_product_attention(q, k, v), iters)
        torch.cuda.synchronize()
        equal = torch.equal(out["new"].view(torch.int16), out["base"].view(torch.int16)) and \
            torch.equal(lse["new"].view(torch.int32), lse["base"].view(torch.int32))
        ref = F.scaled_dot_product_attention(*(x[:1, :2].float() for x in (q, k, v)))
        err_l2 = {n: ((out[n][:1, :2].float() - ref).norm() / ref.norm()).item() for n in libs}
        flops = 4 * B * H * N * N * D
        tn, tb = statistics.median(rounds["new"]), statistics.median(rounds["base"])
        print(f"| {pv} | {D} | {N} | {B} | {tn:.3f} ({flops / tn / 1e9:.0f}) | {tb:.3f} ({flops / tb / 1e9:.0f}) | {tb / tn:.3f} | "
              f"{cudnn:.3f} ({flops / cudnn / 1e9:.0f}) | {cudnn / tn:.3f} | {'yes' if equal else 'NO'} "
              f"| {err_l2['new']:.3e} / {err_l2['base']:.3e} |", flush=True)


if __name__ == "__main__":
    main()
