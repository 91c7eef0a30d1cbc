# Benchmark of sage's Hopper INT8 backward (sage_backward_int8_sm90_cuda) against the bf16-product
# Hopper backward (sage_backward_sm90_cuda) and PyTorch SDPA's cuDNN backward, in one process on one
# GPU: 16 heads, D = 128 and 64, N = 4K, 16K, 32K with B·N = 16K tokens (B = 1 from 16K).
# Both sage backwards run on the same FP8 forward's out, lse and workspace; "det" is the INT8 one
# with sage_backward_set_deterministic(1). TFLOP/s with 2.5·4·B·H·N²·D per backward; each time is the
# median of `iters` CUDA-event-timed calls after 3 warm-ups. Accuracy: cosine of dq, dk, dv against
# fp32 SDPA's gradient on the first two heads of batch 0.
# Library (on a machine with nvcc; dev/sage_int8_bwd_gpu.sh prepare builds it):
#   gcc -O2 -fPIC -std=c11 -D_GNU_SOURCE -I. -c layers/common.c -o build/common_pic.o
#   nvcc -O3 -std=c++17 -I. --use_fast_math -Xcompiler -fPIC -gencode=arch=compute_80,code=sm_80 \
#        -gencode=arch=compute_90a,code=sm_90a -shared -o build/libsage_int8_bench.so \
#        attention/sage_quant.cu attention/sage_forward.cu attention/sage_forward_sm90.cu \
#        attention/sage_backward.cu attention/sage_backward_sm90.cu attention/sage_backward_int8_sm90.cu \
#        build/common_pic.o
#   python3 dev/bench_sage_int8_bwd.py build/libsage_int8_bench.so [D:N,...]
import ctypes
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import I, P, check, err, median_ms  # noqa: E402

lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1 else "build/libsage_int8_bench.so")
lib.sage_cuda_forward_workspace_size.restype = ctypes.c_size_t
lib.sage_cuda_forward_workspace_size.argtypes = [I, I, I, I, I]
lib.sage_cuda_backward_workspace_size.restype = ctypes.c_size_t
lib.sage_cuda_backward_workspace_size.argtypes = [I, I, I, I]
lib.sage_backward_int8_workspace_size.restype = ctypes.c_size_t
lib.sage_backward_int8_workspace_size.argtypes = [I, I, I, I]
lib.sage_forward_cuda.argtypes = [P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
BWD_ARGS = [P, P, P, P, P, P, P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
lib.sage_backward_sm90_cuda.argtypes = BWD_ARGS
lib.sage_backward_int8_sm90_cuda.argtypes = BWD_ARGS
lib.sage_backward_sm90_available.restype = ctypes.c_int
lib.sage_backward_int8_sm90_available.restype = ctypes.c_int
lib.sage_backward_set_deterministic.argtypes = [I]
lib.sage_backward_set_deterministic.restype = ctypes.c_int
FP8 = 0


def cosines(grads, ref):
    return [F.cosine_similarity(g[:1, :2].flatten(), r.flatten(), dim=0).item() for g, r in zip(grads, ref)]


def main():
    torch.manual_seed(0)
    print(f"# device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")
    if lib.sage_backward_int8_sm90_available() != 1 or lib.sage_backward_sm90_available() != 1:
        raise SystemExit("the Hopper backwards are not available on this device/build")
    only = {tuple(int(x) for x in dn.split(":")) for dn in sys.argv[2].split(",")} if len(sys.argv) > 2 else None
    H, rows = 16, []
    for D in (128, 64):
        for N in (4096, 16384, 32768):
            if only and (D, N) not in only:
                continue
            B = max(1, 16384 // N)
            iters = 20 if N <= 4096 else 10
            q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            stream = torch.cuda.current_stream().cuda_stream
            out = torch.empty_like(q)
            lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
            fws = torch.empty(lib.sage_cuda_forward_workspace_size(B, H, N, D, FP8), device="cuda", dtype=torch.uint8)
            bws = torch.empty(lib.sage_cuda_backward_workspace_size(B, H, N, D), device="cuda", dtype=torch.uint8)
            iws = torch.empty(lib.sage_backward_int8_workspace_size(B, H, N, D), device="cuda", dtype=torch.uint8)
            dq, dk, dv = (torch.empty(B, H, N, D, device="cuda", dtype=torch.float32) for _ in range(3))
            check(lib.sage_forward_cuda(out.data_ptr(), lse.data_ptr(), fws.data_ptr(), q.data_ptr(), k.data_ptr(),
                                        v.data_ptr(), B, H, N, D, FP8, stream, err), "forward")

            def backward(fn, ws, what):
                def call():
                    check(fn(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), ws.data_ptr(), fws.data_ptr(), do.data_ptr(),
                             q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), None,
                             B, H, N, D, FP8, stream, err), what)
                return call

            qr, kr, vr = (x[:1, :2].float().requires_grad_() for x in (q, k, v))
            ref = torch.autograd.grad(F.scaled_dot_product_attention(qr, kr, vr), (qr, kr, vr), do[:1, :2].float())
            t, cos = {}, {}
            for name, fn, ws in (("sm90", lib.sage_backward_sm90_cuda, bws),
                                 ("int8", lib.sage_backward_int8_sm90_cuda, iws)):
                call = backward(fn, ws, name)
                t[name] = median_ms(call, iters)
                cos[name] = cosines((dq, dk, dv), ref)
            previous = lib.sage_backward_set_deterministic(1)
            t["int8 det"] = median_ms(backward(lib.sage_backward_int8_sm90_cuda, iws, "int8 det"), iters)
            lib.sage_backward_set_deterministic(previous)
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qg, kg, vg)
                t["cuDNN"] = median_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True), iters)
            flops = 2.5 * 4 * B * H * N * N * D
            tops = {n: flops / (ms * 1e-3) / 1e12 for n, ms in t.items()}
            rows.append((D, N, B, tops, cos))
            print(f"D={D} N={N} B={B}: " + " ".join(f"{n} {ms:.3f}ms/{tops[n]:.0f}T" for n, ms in t.items())
                  + " " + " ".join(f"cos({n}: dq dk dv)=" + "/".join(f"{x:.6f}" for x in c) for n, c in cos.items()),
                  flush=True)
            del q, k, v, do, out, lse, fws, bws, iws, dq, dk, dv, qg, kg, vg, o, qr, kr, vr, ref
            torch.cuda.empty_cache()
    print("\n| D | N | B | sm90 bwd | INT8 bwd | INT8 det | cuDNN bwd | INT8/sm90 | INT8/cuDNN "
          "| cos dq/dk/dv sm90 | cos dq/dk/dv INT8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for D, N, B, tops, cos in rows:
        print(f"| {D} | {N} | {B} | {tops['sm90']:.0f} | {tops['int8']:.0f} | {tops['int8 det']:.0f} "
              f"| {tops['cuDNN']:.0f} | {tops['int8'] / tops['sm90']:.2f} | {tops['int8'] / tops['cuDNN']:.2f} "
              f"| {'/'.join(f'{x:.5f}' for x in cos['sm90'])} | {'/'.join(f'{x:.5f}' for x in cos['int8'])} |")
    print("(TFLOP/s; backward 2.5·4·B·H·N²·D; cosines vs fp32 SDPA on 2 heads)")


if __name__ == "__main__":
    main()
