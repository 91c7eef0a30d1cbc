"""Shared pieces of the attention benchmarks (bench_attention.py, bench_flash.py): the ctypes
argument types, the error buffer every dit.c call writes, and CUDA-event timing."""
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
