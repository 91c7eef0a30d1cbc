# A/B/C benchmark of the Hopper attention backward (sage_backward_sm90_cuda and
# flash_backward_sm90_cuda) from several builds in one process (e.g. main, a reference commit and a
# branch: dev/sage_bwd_step4_gpu.sh builds them), next to PyTorch SDPA's cuDNN
# backward on the same inputs. H = 16, D = 64 and 128, N = 4K, 16K, 32K with B·N = 16K tokens.
# Per size and kernel (sage, flash) and dQ mode (unordered, deterministic): REPS rounds, each timing
# every library in turn (median of `iters` CUDA-event-timed calls after warm-up); reported: the
# median over rounds, TOPS (2.5·4·B·H·N²·D per backward) and time relative to the first library.
# Also checks that dk, dv (and dq in deterministic mode) are bitwise equal to the first library's.
#   [REPS=3] python3 dev/bench_bwd90_abc.py name=lib.so [name=lib.so ...]
import ctypes
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import I, P, check, err, median_ms, time_sdpa  # noqa: E402

REPS = int(os.environ.get("REPS", 3))   # rounds per row
H = 16
FP8 = 0
SIZES = [(D, N, max(1, 16384 // N)) for D in (64, 128) for N in (4096, 16384, 32768)]


def load(path):
    lib = ctypes.CDLL(path)
    lib.sage_cuda_forward_workspace_size.restype = ctypes.c_size_t
    lib.sage_cuda_forward_workspace_size.argtypes = [I, I, I, I, I]
    lib.sage_cuda_backward_workspace_size.restype = ctypes.c_size_t
    lib.sage_cuda_backward_workspace_size.argtypes = [I, I, I, I]
    lib.flash_cuda_backward_workspace_size.restype = ctypes.c_size_t
    lib.flash_cuda_backward_workspace_size.argtypes = [I, I, I, I]
    lib.sage_forward_cuda.argtypes = [P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
    lib.sage_backward_sm90_cuda.argtypes = [P, P, P, P, P, P, P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
    lib.flash_forward_cuda.argtypes = [P, P, P, P, P, I, I, I, I, P, ctypes.c_char_p]
    lib.flash_backward_sm90_cuda.argtypes = [P, P, P, P, P, P, P, P, P, P, I, I, I, I, P, ctypes.c_char_p]
    lib.sage_backward_set_deterministic.argtypes = [I]
    lib.flash_backward_set_deterministic.argtypes = [I]
    return lib


def main():
    libs = [(a.split("=", 1)[0], load(a.split("=", 1)[1])) for a in sys.argv[1:]]
    names = [n for n, _ in libs]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}; "
          f"libraries: {', '.join(a for a in sys.argv[1:])}; relative time = lib / {names[0]}")
    print("| kernel | dQ | D | N | B | " + " | ".join(f"{n} ms (TOPS)" for n in names) + " | "
          + " | ".join(f"{n}/{names[0]}" for n in names[1:]) + " | cuDNN bwd ms (TOPS) | bitwise vs first |")
    print("|---" * (7 + 2 * len(names) - 1) + "|")
    torch.manual_seed(0)
    stream = torch.cuda.current_stream().cuda_stream
    for D, N, B in SIZES:
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out = torch.empty_like(q)
        lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
        first = libs[0][1]
        ws = torch.empty(first.sage_cuda_forward_workspace_size(B, H, N, D, FP8), device="cuda", dtype=torch.uint8)
        bws = torch.empty(max(first.sage_cuda_backward_workspace_size(B, H, N, D),
                              first.flash_cuda_backward_workspace_size(B, H, N, D)), device="cuda", dtype=torch.uint8)
        grads = {n: [torch.empty(B, H, N, D, device="cuda", dtype=torch.float32) for _ in range(3)] for n in names}
        flops = 2.5 * 4 * B * H * N * N * D
        iters = 20 if N <= 4096 else 8
        cudnn_ms = time_sdpa(q, k, v, do, iters)["cudnn_bwd"]
        for kernel in ("sage", "flash"):
            if kernel == "sage":
                check(first.sage_forward_cuda(out.data_ptr(), lse.data_ptr(), ws.data_ptr(), q.data_ptr(), k.data_ptr(),
                                              v.data_ptr(), B, H, N, D, FP8, stream, err), "sage forward")
            else:
                check(first.flash_forward_cuda(out.data_ptr(), lse.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                               B, H, N, D, stream, err), "flash forward")

            def bwd(name, lib):
                dq, dk, dv = grads[name]
                if kernel == "sage":
                    check(lib.sage_backward_sm90_cuda(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), bws.data_ptr(),
                                                      ws.data_ptr(), do.data_ptr(), q.data_ptr(), k.data_ptr(),
                                                      v.data_ptr(), out.data_ptr(), lse.data_ptr(), None, B, H, N, D,
                                                      FP8, stream, err), f"{name} sage backward sm90")
                else:
                    check(lib.flash_backward_sm90_cuda(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), bws.data_ptr(),
                                                       do.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                       out.data_ptr(), lse.data_ptr(), B, H, N, D, stream, err),
                          f"{name} flash backward sm90")

            for det in (0, 1):
                for _, lib in libs:
                    (lib.sage_backward_set_deterministic if kernel == "sage" else lib.flash_backward_set_deterministic)(det)
                t = {n: [] for n in names}
                for _ in range(REPS):
                    for n, lib in libs:
                        t[n].append(median_ms(lambda: bwd(n, lib), iters))
                torch.cuda.synchronize()
                ref = grads[names[0]]
                equal = all(all(torch.equal(x, y) for x, y in zip(grads[n][1 - det:], ref[1 - det:])) for n in names[1:])
                ms = {n: statistics.median(t[n]) for n in names}
                print(f"| {kernel} | {'det' if det else 'unord'} | {D} | {N} | {B} | "
                      + " | ".join(f"{ms[n]:.3f} ({flops / ms[n] / 1e9:.0f})" for n in names) + " | "
                      + " | ".join(f"{ms[n] / ms[names[0]]:.3f}" for n in names[1:])
                      + f" | {cudnn_ms:.3f} ({flops / cudnn_ms / 1e9:.0f}) | {equal} |", flush=True)
            for _, lib in libs:
                (lib.sage_backward_set_deterministic if kernel == "sage" else lib.flash_backward_set_deterministic)(0)
        del q, k, v, do, out, lse, ws, bws, grads
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
