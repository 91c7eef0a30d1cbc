"""Shared pieces of the attention benchmarks (bench_attention.py, bench_flash.py): the ctypes
argument types, the error buffer every dit.c call writes, CUDA-event timing, and PyTorch SDPA's
cuDNN and flash backends timed on the same inputs."""
import ctypes
import statistics

import torch

P = ctypes.c_void_p
I = ctypes.c_int
err = ctypes.create_string_buffer(512)   # the `char *err` of every dit.c call


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: {err.value.decode()}")


def median_ms(fn, iters, warmup=3):
    """Median over `iters` CUDA-event-timed calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_sdpa(q, k, v, dout, iters):
    """ms of PyTorch SDPA's forward and backward (dout: the output's gradient) with the cuDNN and
    flash backends: {"cudnn", "cudnn_bwd", "flash", "flash_bwd"}."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    t = {}
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(backend):
            t[name] = median_ms(lambda: F.scaled_dot_product_attention(q, k, v), iters)
            o = F.scaled_dot_product_attention(qg, kg, vg)
            t[name + "_bwd"] = median_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True), iters)
    return t
