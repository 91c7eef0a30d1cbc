# Benchmark of the Hopper sage forward's P·V modes at head dim D = 128 or 64 (issue 5: which is better
# for training): FP16 P·V on the wgmma kernel (sage_forward_sm90.cu, FP8 = false), FP8 P·V on the
# same kernel, FP16 P·V on the mma.sync kernel (sage_forward.cu, DIT_SAGE_MMA_SYNC=1: what
# --attn sage-fp16 ran before), and PyTorch SDPA's cuDNN backend in bf16. 16 heads, N = 4K, 16K,
# 32K with B·N = 16K tokens (B = 1 from 16K); FLOPs 4·B·H·N²·D. Each time: the median of `iters`
# CUDA-event-timed calls after 3 untimed ones, the whole forward (quantization pass + kernel) and
# the kernel alone (sage_forward_quantized_cuda on the quantized workspace). Accuracy on the same
# Gaussian inputs: cosine against fp32 attention (two heads).
#   python3 dev/bench_sage_fwd_fp16.py [path/to/libditc.so.0 [D]]     (D: 128 (default) or 64)
import ctypes
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import I, P, check, err, median_ms  # noqa: E402

lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1 else "build/libditc.so")
lib.sage_cuda_forward_workspace_size.restype = ctypes.c_size_t
lib.sage_cuda_forward_workspace_size.argtypes = [I, I, I, I, I]
lib.sage_forward_cuda.argtypes = [P, P, P, P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
lib.sage_forward_quantized_cuda.argtypes = [P, P, P, I, I, I, I, I, P, ctypes.c_char_p]
lib.sage_forward_sm90_available.restype = ctypes.c_int
FP8, FP16 = 0, 1


def cudnn_ms(q, k, v, iters):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return median_ms(lambda: F.scaled_dot_product_attention(q, k, v), iters)


def main():
    torch.manual_seed(0)
    print(f"# device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")
    print(f"# sm90 forward available: {lib.sage_forward_sm90_available() == 1}")
    H, D = 16, int(sys.argv[2]) if len(sys.argv) > 2 else 128
    print(f"# head dim {D}, {H} heads")
    # kernels: name -> (pv, DIT_SAGE_MMA_SYNC)
    kernels = {"fp16_sm90": (FP16, False), "fp8_sm90": (FP8, False), "fp16_mma": (FP16, True)}
    rows = []
    for N in (4096, 16384, 32768):
        B = max(1, 16384 // N)
        iters = 30 if N <= 8192 else 10
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        stream = torch.cuda.current_stream().cuda_stream
        out = torch.empty_like(q)
        lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
        ws = {pv: torch.empty(lib.sage_cuda_forward_workspace_size(B, H, N, D, pv), device="cuda", dtype=torch.uint8)
              for pv in (FP8, FP16)}
        ref = F.scaled_dot_product_attention(q.float()[:, :2], k.float()[:, :2], v.float()[:, :2])
        flops = 4 * B * H * N * N * D
        t, cos = {}, {}
        for name, (pv, mma) in kernels.items():
            if mma:
                os.environ["DIT_SAGE_MMA_SYNC"] = "1"   # read by each call
            else:
                os.environ.pop("DIT_SAGE_MMA_SYNC", None)

            def full():
                check(lib.sage_forward_cuda(out.data_ptr(), lse.data_ptr(), ws[pv].data_ptr(), q.data_ptr(),
                                            k.data_ptr(), v.data_ptr(), B, H, N, D, pv, stream, err), name)

            def kern():
                check(lib.sage_forward_quantized_cuda(out.data_ptr(), lse.data_ptr(), ws[pv].data_ptr(), B, H, N, D,
                                                      pv, stream, err), name + " kernel")
            t[name] = median_ms(full, iters)
            t[name + "_kernel"] = median_ms(kern, iters)
            cos[name] = F.cosine_similarity(out[:, :2].float().flatten(), ref.flatten(), dim=0).item()
        os.environ.pop("DIT_SAGE_MMA_SYNC", None)
        t["cudnn"] = cudnn_ms(q, k, v, iters)
        tops = {n: flops / (ms * 1e-3) / 1e12 for n, ms in t.items()}
        rows.append((N, B, t, tops, cos))
        print(f"N={N} B={B}: " + " ".join(f"{n} {ms:.3f}ms/{tops[n]:.0f}T" for n, ms in t.items())
              + " " + " ".join(f"cos({n}, fp32)={c:.6f}" for n, c in cos.items()), flush=True)
        del q, k, v, out, lse, ws, ref
        torch.cuda.empty_cache()
    print("\n| N | B | FP16 sm90 | FP8 sm90 | FP16 mma.sync | cuDNN bf16 | FP16 sm90 / FP8 sm90 | FP16 sm90 / mma.sync "
          "| FP16 sm90 / cuDNN | kernels alone: FP16 sm90, FP8 sm90, FP16 mma.sync |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for N, B, t, tops, cos in rows:
        print(f"| {N} | {B} | {tops['fp16_sm90']:.0f} T | {tops['fp8_sm90']:.0f} T | {tops['fp16_mma']:.0f} T "
              f"| {tops['cudnn']:.0f} T | {t['fp8_sm90'] / t['fp16_sm90']:.2f}× | {t['fp16_mma'] / t['fp16_sm90']:.2f}× "
              f"| {t['cudnn'] / t['fp16_sm90']:.2f}× | {tops['fp16_sm90_kernel']:.0f}, {tops['fp8_sm90_kernel']:.0f}, "
              f"{tops['fp16_mma_kernel']:.0f} T |")


if __name__ == "__main__":
    main()
