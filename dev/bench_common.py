"""Shared pieces of the attention benchmarks (bench_attention.py, bench_flash.py): the ctypes
argument types, the error buffer every dit.c call writes, CUDA-event timing, and PyTorch SDPA's
cuDNN and flash backends timed on the same inputs."""
import ctypes
import os
import statistics

import torch

P = ctypes.c_void_p
I = ctypes.c_int
err = ctypes.create_string_buffer(512)   # the `char *err` of every dit.c call


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: {err.value.decode()}")


# Each timed call is queued behind a GPU sleep of QUEUE_CYCLES clocks (default 4M, ~2 ms): the start
# event and fn's launches reach the stream while the GPU is still busy, so the time runs from the
# event to the end of fn's last kernel and leaves out the host's work between launches (0.1-0.4 ms
# for a PyTorch SDPA call, which an idle GPU would count as the callee's time). BENCH_QUEUED=cycles
# sets the sleep; 0: the call starts on an idle GPU (these scripts' timing before 2026-12-02).
QUEUE_CYCLES = int(os.environ.get("BENCH_QUEUED", 4_000_000))


def median_ms(fn, iters, warmup=3):
    """Median over `iters` CUDA-event-timed calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if QUEUE_CYCLES:
            torch.cuda._sleep(QUEUE_CYCLES)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def sdpa_calls(q, k, v, dout, backend):
    """PyTorch SDPA's forward and backward (dout: the output's gradient) with one backend, as two
    functions to time."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(qg, kg, vg)

    def forward():
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v)

    def backward():
        torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)
    return forward, backward


def time_sdpa(q, k, v, dout, iters, backends=("cudnn", "flash")):
    """ms of PyTorch SDPA's forward and backward (dout: the output's gradient) with the cuDNN and
    flash backends (or those of `backends`): {"cudnn", "cudnn_bwd", "flash", "flash_bwd"}."""
    from torch.nn.attention import SDPBackend
    t = {}
    for name in backends:
        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name]
        forward, backward = sdpa_calls(q, k, v, dout, backend)
        t[name] = median_ms(forward, iters)
        t[name + "_bwd"] = median_ms(backward, iters)
    return t
