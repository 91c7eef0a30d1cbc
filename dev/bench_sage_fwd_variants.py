# Forward-only timer of several builds of sage_forward_sm90 (one shared library each) against
# cuDNN's bf16 SDPA forward, all in one process. Per library and size: TOPS of the full forward
# (quantization + kernel), of the kernel alone (sage_forward_sm90_quantized_cuda), and rel L2 /
# lse max diff of its output against the first library's.
#   python3 dev/bench_sage_fwd_variants.py D:N,... name=lib.so [name=lib.so ...]
# Each lib.so is the sage sources built as in dev/devrun_prepare.sh (libsage_bench.so), from
# another commit (git show REV:attention/sage_forward_sm90.cu) or with other -D settings.
import ctypes, os, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import I, P, check, err, median_ms

os.environ["DIT_SAGE_MMA_SYNC"] = "1"
sizes = [tuple(int(x) for x in dn.split(":")) for dn in sys.argv[1].split(",")]
libs = []
for arg in sys.argv[2:]:
    name, path = arg.split("=")
    lib = ctypes.CDLL(os.path.abspath(path))
    lib.sage_cuda_forward_workspace_size.restype = ctypes.c_size_t
    lib.sage_cuda_forward_workspace_size.argtypes = [I, I, I, I, I]
    lib.sage_forward_sm90_cuda.argtypes = [P, P, P, P, P, P, I, I, I, I, P, ctypes.c_char_p]
    lib.sage_forward_sm90_quantized_cuda.argtypes = [P, P, P, I, I, I, I, P, ctypes.c_char_p]
    libs.append((name, lib))
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")
H = 16
rows = []
for D, N in sizes:
    B = max(1, 16384 // N)
    iters = 30 if N <= 8192 else 12
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    stream = torch.cuda.current_stream().cuda_stream
    flops = 4 * B * H * N * N * D
    tops = lambda ms: flops / (ms * 1e-3) / 1e12
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = tops(median_ms(lambda: F.scaled_dot_product_attention(q, k, v), iters))
    line = {"D": D, "N": N, "cudnn": cudnn}
    ref = None
    for name, lib in libs:
        out = torch.empty_like(q)
        lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
        ws = torch.empty(lib.sage_cuda_forward_workspace_size(B, H, N, D, 0), device="cuda", dtype=torch.uint8)
        full = lambda: check(lib.sage_forward_sm90_cuda(out.data_ptr(), lse.data_ptr(), ws.data_ptr(), q.data_ptr(),
                                                        k.data_ptr(), v.data_ptr(), B, H, N, D, stream, err), name)
        kern = lambda: check(lib.sage_forward_sm90_quantized_cuda(out.data_ptr(), lse.data_ptr(), ws.data_ptr(),
                                                                  B, H, N, D, stream, err), name)
        t_full = tops(median_ms(full, iters))
        t_kern = tops(median_ms(kern, iters))
        torch.cuda.synchronize()
        if ref is None:
            ref = (out.float().clone(), lse.clone())
            rel, dl = 0.0, 0.0
        else:
            rel = ((out.float() - ref[0]).norm() / ref[0].norm()).item()
            dl = (lse - ref[1]).abs().max().item()
        line[name] = (t_full, t_kern, rel, dl)
        print(f"D={D} N={N} {name}: full {t_full:.0f} kernel {t_kern:.0f} TOPS (x{t_full / cudnn:.2f} cuDNN {cudnn:.0f}); "
              f"vs {libs[0][0]} rel L2 {rel:.2e} lse {dl:.1e}", flush=True)
    rows.append(line)
    del q, k, v
    torch.cuda.empty_cache()
names = [n for n, _ in libs]
print("\n| D | N | cuDNN | " + " | ".join(f"{n} full / kernel / ×cuDNN" for n in names) + " |")
print("|---|---|---|" + "---|" * len(names))
for r in rows:
    print(f"| {r['D']} | {r['N']} | {r['cudnn']:.0f} | " +
          " | ".join(f"{r[n][0]:.0f} / {r[n][1]:.0f} / {r[n][0] / r['cudnn']:.2f}" for n in names) + " |")
