# A/B benchmark of the sage Hopper backward (sage_backward_sm90_cuda) from two builds in one
# process, e.g. a branch's kernel against the commit it started from (dev/sage_bwd_step0_gpu.sh
# builds both libraries). Same inputs, one sage forward per size (library A's), unordered dQ (the
# default). Per size: REPS rounds, each timing A then B (median of `iters` CUDA-event-timed calls
# after warm-up); reported: the median over rounds of each, TOPS (2.5·4·B·H·N²·D per backward),
# and B/A time. Also checks that dk and dv are bitwise equal between A and B (each row is written
# by one CTA, so they are reproducible even with unordered dQ).
#   python3 dev/bench_sage_bwd_ab.py libA.so libB.so
import ctypes
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import I, P, check, err, median_ms  # noqa: E402

REPS = 5
# (D, N, B): N = 256 with B·H = 768 is the 256-token training step's shape (per layer), where the
# k - k_mean prologue matters; 1K and 16K tokens as in bench_attention.py.
SIZES = [(64, 256, 48), (128, 256, 48), (64, 1024, 16), (128, 1024, 16), (64, 16384, 1), (128, 16384, 1)]
H = 16
FP8 = 0


def load(path):
    lib = ctypes.CDLL(path)
    lib.sage_cuda_forward_workspace_size.restype = ctypes.c_size_t
    lib.sage_cuda_forward_workspace_size.argtypes = [I, I, I, I, I]
    lib.sage_cuda_backward_workspace_size.restype = ctypes.c_size_t
    lib.sage_cuda_backward_workspace_size.argtypes = [I, I, I, I]
    lib.sage_forward_cuda.argtypes = [P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
    lib.sage_backward_sm90_cuda.argtypes = [P, P, P, P, P, P, P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
    return lib


def main():
    a, b = load(sys.argv[1]), load(sys.argv[2])
    print(f"# {torch.cuda.get_device_name()}; A = {sys.argv[1]}, B = {sys.argv[2]}; sm90 backward, unordered dQ")
    print("| D | N | B·H | A ms | B ms | A TOPS | B TOPS | B/A time | dk, dv bitwise equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for D, N, B in SIZES:
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        stream = torch.cuda.current_stream().cuda_stream
        out = torch.empty_like(q)
        lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
        ws = torch.empty(a.sage_cuda_forward_workspace_size(B, H, N, D, FP8), device="cuda", dtype=torch.uint8)
        bws = torch.empty(a.sage_cuda_backward_workspace_size(B, H, N, D), device="cuda", dtype=torch.uint8)
        check(a.sage_forward_cuda(out.data_ptr(), lse.data_ptr(), ws.data_ptr(), q.data_ptr(), k.data_ptr(),
                                  v.data_ptr(), B, H, N, D, FP8, stream, err), "forward")
        grads = {lib: [torch.empty(B, H, N, D, device="cuda", dtype=torch.float32) for _ in range(3)]
                 for lib in (a, b)}

        def bwd(lib):
            dq, dk, dv = grads[lib]
            check(lib.sage_backward_sm90_cuda(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), bws.data_ptr(),
                                              ws.data_ptr(), do.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                              out.data_ptr(), lse.data_ptr(), None, B, H, N, D, FP8, stream, err),
                  "backward sm90")

        iters = 20 if N <= 4096 else 10
        ta, tb = [], []
        for _ in range(REPS):
            ta.append(median_ms(lambda: bwd(a), iters))
            tb.append(median_ms(lambda: bwd(b), iters))
        torch.cuda.synchronize()
        equal = all(torch.equal(x, y) for x, y in zip(grads[a][1:], grads[b][1:]))
        ma, mb = statistics.median(ta), statistics.median(tb)
        flops = 2.5 * 4 * B * H * N * N * D
        print(f"| {D} | {N} | {B * H} | {ma:.3f} | {mb:.3f} | {flops / ma / 1e9:.0f} | {flops / mb / 1e9:.0f} "
              f"| {mb / ma:.3f} | {equal} |", flush=True)
        del q, k, v, do, out, lse, ws, bws, grads
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
