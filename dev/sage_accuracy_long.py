# Issue 5's accuracy table at long sequences: sage attention on the GPU (sage_forward_cuda and
# sage_backward_cuda, whichever kernels the device dispatches to) against exact attention computed
# in float64 on the same GPU, with its autograd gradients. Cosine and rel L2 of out, dq, dk, dv.
#   inputs: "gaussian": q, k, v, dout N(0, 1); "outliers": q and k ×8 on channels 3 and 17, k + 20
#   on every 4th channel (test/attention_test.h's recipe), as real DiT activations have; "rotated":
#   the outliers through the Hadamard rotation the model applies before sage (q·R, k·R with R the
#   normalized Walsh-Hadamard matrix, dq and dk rotated back: qkᵀ is unchanged, so the reference is
#   the unrotated attention). All inputs rounded to bf16 first, and the reference takes those values.
#   B = 1, H = 2 heads, N = 4K, 16K, 32K, head dims 64 and 128, P·V in FP8 and FP16.
# Build the library as dev/bench_attention.py says, then (one H200: ~1 min):
#   python3 dev/sage_accuracy_long.py build/libsage_bench.so [N,N,...]
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import I, P, check, err  # noqa: E402

lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1 else "build/libsage_bench.so")
lib.sage_cuda_forward_workspace_size.restype = ctypes.c_size_t
lib.sage_cuda_forward_workspace_size.argtypes = [I, I, I, I, I]
lib.sage_cuda_backward_workspace_size.restype = ctypes.c_size_t
lib.sage_cuda_backward_workspace_size.argtypes = [I, I, I, I]
lib.sage_forward_cuda.argtypes = [P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
lib.sage_backward_cuda.argtypes = [P, P, P, P, P, P, P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
SIZES = [int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4096, 16384, 32768]
PV = {"FP8": 0, "FP16": 1}
B, H = 1, 2


def hadamard(D):
    """The normalized D × D Walsh-Hadamard matrix (Sylvester's construction), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / D ** 0.5).cuda()


def inputs(N, D, outliers, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g) for _ in range(4))
    if outliers:
        for x in (q, k):
            x[..., [3, 17]] *= 8.0
        k[..., ::4] += 20.0
    return [x.bfloat16() for x in (q, k, v, do)]


def exact(q, k, v, do):
    """float64 attention of each head and its gradients: out, dq, dk, dv."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    results = []
    for h in range(H):
        qh, kh, vh = q[:, h], k[:, h], v[:, h]
        out = torch.softmax(qh @ kh.transpose(-1, -2) / qh.shape[-1] ** 0.5, dim=-1) @ vh
        dq, dk, dv = torch.autograd.grad(out, (qh, kh, vh), do[:, h].double())
        results.append([t.detach() for t in (out, dq, dk, dv)])
        del out
    return [torch.stack([r[i] for r in results], 1) for i in range(4)]


def sage(q, k, v, do, pv):
    """Our forward and backward: out (bf16 → float64), dq, dk, dv."""
    N, D = q.shape[2], q.shape[3]
    stream = torch.cuda.current_stream().cuda_stream
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
    ws = torch.empty(lib.sage_cuda_forward_workspace_size(B, H, N, D, pv), device="cuda", dtype=torch.uint8)
    bws = torch.empty(lib.sage_cuda_backward_workspace_size(B, H, N, D), device="cuda", dtype=torch.uint8)
    grads = [torch.full((B, H, N, D), float("nan"), device="cuda") for _ in range(3)]   # poisoned
    check(lib.sage_forward_cuda(out.data_ptr(), lse.data_ptr(), ws.data_ptr(), q.data_ptr(), k.data_ptr(),
                                v.data_ptr(), B, H, N, D, pv, stream, err), "sage forward")
    check(lib.sage_backward_cuda(*(g.data_ptr() for g in grads), bws.data_ptr(), ws.data_ptr(), do.data_ptr(),
                                 q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), None,
                                 B, H, N, D, pv, stream, err), "sage backward")
    torch.cuda.synchronize()
    return [out.double()] + [g.double() for g in grads]


def compare(x, ref):
    x, ref = x.flatten(), ref.flatten()
    cos = torch.dot(x, ref) / (x.norm() * ref.norm())
    return cos.item(), ((x - ref).norm() / ref.norm()).item()


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; sage vs float64 attention, "
          f"B = {B}, H = {H}; cells: cosine (rel L2)")
    print("| D | N | inputs | P·V | out | dq | dk | dv |")
    print("|---|---|---|---|---|---|---|---|")
    for D in (128, 64):
        R = hadamard(D)
        for N in SIZES:
            for kind in ("gaussian", "outliers", "rotated"):
                q, k, v, do = inputs(N, D, kind != "gaussian", seed=N + D)
                ref = exact(q, k, v, do)
                if kind == "rotated":   # what the model feeds sage: q·R, k·R (bf16), and dq·Rᵀ, dk·Rᵀ back
                    q, k = ((x.double() @ R).bfloat16() for x in (q, k))
                for name, pv in PV.items():
                    out, dq, dk, dv = sage(q, k, v, do, pv)
                    if kind == "rotated":
                        dq, dk = dq @ R.T, dk @ R.T
                    cells = [compare(t, r) for t, r in zip((out, dq, dk, dv), ref)]
                    assert all(c == c for c, _ in cells), "NaN in sage's results (a gradient left unwritten?)"
                    print(f"| {D} | {N} | {kind} | {name} | "
                          + " | ".join(f"{c:.6f} ({r:.2e})" for c, r in cells) + " |", flush=True)
                del q, k, v, do, ref
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
