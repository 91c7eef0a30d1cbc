# Benchmark of the sage quantization pass (attention/sage_quant.cu) against main's three-launch
# pass, alone and inside the sm90 forward, with PyTorch SDPA's cuDNN forward in the same process.
# H = 16, B·N = 16K tokens (B = 1 from 16K), D = 64 and 128. Each time: median of 50 CUDA-event-timed
# runs after 5 warm-ups. GB/s = compulsory bytes (q, k, v read once as bf16; q8, k8 and the FP8
# v_t written once) / time; TOPS = 4·B·H·N²·D / time.
# The library (built by dev/sage_quant_gpu.sh prepare) holds the new pass (sage_*), main's pass
# renamed old_*, the new pass built with QUANT_MIN_CTAS=3 renamed v3_*, and the forward kernels.
#   python3 dev/bench_sage_quant.py LIB.so
import ctypes
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import I, P, check, err, median_ms  # noqa: E402

lib = ctypes.CDLL(sys.argv[1])
PASSES = ("old", "new", "v3")
quantize = {"old": lib.old_sage_quantize_cuda, "new": lib.sage_quantize_cuda, "v3": lib.v3_sage_quantize_cuda}
ws_size = {"old": lib.old_sage_cuda_forward_workspace_size, "new": lib.sage_cuda_forward_workspace_size,
           "v3": lib.v3_sage_cuda_forward_workspace_size}
for f in quantize.values():
    f.argtypes = [P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
for f in ws_size.values():
    f.restype = ctypes.c_size_t
    f.argtypes = [I, I, I, I, I]
lib.sage_forward_sm90_quantized_cuda.argtypes = [P, P, P, I, I, I, I, P, ctypes.c_char_p]
lib.sage_forward_sm90_available.restype = ctypes.c_int
FP8 = 0   # SAGE_PV_FP8 in attention/attention.h

print(f"# {torch.cuda.get_device_name()}, sm90 forward available: {lib.sage_forward_sm90_available()}, "
      f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
print("| D | N | B | MB | old pass ms (GB/s) | new pass ms (GB/s) | v3 pass ms | pass speed-up | "
      "fwd old ms (TOPS) | fwd new ms (TOPS) | fwd v3 ms | cuDNN ms (TOPS) | new / cuDNN |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
H, ITERS = 16, 50
for D in (64, 128):
    for N in (1024, 4096, 16384, 32768):
        B = max(16384 // N, 1)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
        ws = {p: torch.empty(ws_size[p](B, H, N, D, FP8), device="cuda", dtype=torch.uint8) for p in PASSES}
        ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731

        def run_pass(p):
            check(quantize[p](ptr(ws[p]), ptr(q), ptr(k), ptr(v), B, H, N, D, FP8, None, err), p + " pass")

        def run_fwd(p):
            run_pass(p)
            check(lib.sage_forward_sm90_quantized_cuda(ptr(out), ptr(lse), ptr(ws[p]), B, H, N, D, None, err),
                  "sm90 forward")

        t_pass = {p: median_ms(lambda: run_pass(p), ITERS, 5) for p in PASSES}
        t_fwd = {p: median_ms(lambda: run_fwd(p), ITERS, 5) for p in PASSES}
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = median_ms(lambda: F.scaled_dot_product_attention(q, k, v), ITERS, 5)
        n = B * H * N * D
        mb = (3 * n * 2 + 2 * n + B * H * D * ((N + 63) // 64 * 64)) / 1e6
        tops = lambda ms: 4 * B * H * N * N * D / ms / 1e9  # noqa: E731
        print(f"| {D} | {N} | {B} | {mb:.0f} | {t_pass['old']:.4f} ({mb / t_pass['old']:.0f}) | "
              f"{t_pass['new']:.4f} ({mb / t_pass['new']:.0f}) | {t_pass['v3']:.4f} | "
              f"{t_pass['old'] / t_pass['new']:.2f} | {t_fwd['old']:.3f} ({tops(t_fwd['old']):.0f}) | "
              f"{t_fwd['new']:.3f} ({tops(t_fwd['new']):.0f}) | {t_fwd['v3']:.3f} | "
              f"{t_cudnn:.3f} ({tops(t_cudnn):.0f}) | {t_cudnn / t_fwd['new']:.2f} |", flush=True)
        del q, k, v, out, lse, ws
