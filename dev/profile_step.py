"""Where the time of one training step goes, for train_dit and for the PyTorch reference, on the
same GPU: GPU kernel time per step split into attention, GEMMs (cuBLAS/cuBLASLt/nvjet/cutlass)
and the rest (elementwise, norms, reductions, optimizer, copies).

    python3 dev/profile_step.py [--configs c,a] [--steps 10] [--compile] [--fp8] [--train-dit PATH]

train_dit runs with dev/kernel_times.c preloaded (CUPTI activity records: every kernel's GPU
time by name; build/libkernel_times.so, built by dev/devrun_prepare.sh); PyTorch (eager, and with
--compile also torch.compile of the model) runs under torch.profiler for `steps` steps after
warm-up. Both: sum of kernel durations / steps (kernels only: gaps between kernels are the step
time minus this sum). Prints each run's split and top kernels, then one markdown table of all.
--fp8 adds train_dit --attn sage --linear fp8 (its quantize kernels count as "the rest").
"""
import argparse
import os
import subprocess
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import CONFIGS, REPO, pytorch_training_step  # noqa: E402
from dit_ref import DiTConfig  # noqa: E402


def category(name):
    n = name.lower()
    if any(s in n for s in ("sage", "flash", "attention", "fmha", "sdpa", "cudnn", "ring_merge")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "triton_tem_")):
        return "gemm"
    return "rest"


def summarize(kernels, steps, label):
    """kernels: {name: total_ns}. Prints the split and the top kernels, per step; returns the ms
    per step of (total, attention, gemm, rest)."""
    by_cat = defaultdict(float)
    for name, ns in kernels.items():
        by_cat[category(name)] += ns
    total = sum(by_cat.values())
    print(f"\n## {label}: GPU kernel time per step {total / steps / 1e6:.1f} ms")
    for c in ("attention", "gemm", "rest"):
        print(f"  {c:9s} {by_cat[c] / steps / 1e6:8.2f} ms  ({100 * by_cat[c] / max(total, 1):.0f}%)")
    print("  top kernels (ms/step, category, name):")
    for name, ns in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]:
        print(f"    {ns / steps / 1e6:8.3f}  {category(name):9s} {name[:110]}")
    return tuple(v / steps / 1e6 for v in (total, by_cat["attention"], by_cat["gemm"], by_cat["rest"]))


def profile_train_dit(train_dit, name, flags, steps, lib):
    size, patch, hidden, depth, heads, batch = CONFIGS[name]
    cmd = [train_dit, "--device", "gpu", "--data", "synthetic", *flags,
           "--image-size", str(size), "--patch", str(patch), "--hidden", str(hidden), "--depth", str(depth),
           "--heads", str(heads), "--batch", str(batch), "--steps", str(steps + 1), "--ckpt-every", "0",
           "--sample-every", "0", "--out", "/tmp/profile_step_out"]
    what = " ".join(flags)
    report = f"/tmp/profile_step_{name}_{'_'.join(f.strip('-') for f in flags)}.txt"
    env = dict(os.environ, LD_PRELOAD=lib, KERNEL_TIMES_OUT=report)
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        print(f"train_dit {what}, config {name}: failed with status {run.returncode}\n"
              f"{run.stdout[-2000:]}{run.stderr[-2000:]}")
        return None
    kernels = {}
    for line in open(report):
        total_ns, _count, kernel = line.rstrip("\n").split(" ", 2)
        kernels[kernel] = float(total_ns)
    # steps + 1 steps ran; the first does the same kernels (plus one-time host work), so the mean
    # over steps + 1 is the per-step kernel time. Sampling is off, so nothing else runs.
    return summarize(kernels, steps + 1, f"train_dit {what}, config {name}")


def profile_pytorch(name, steps, compile_model, warmup=5):
    size, patch, hidden, depth, heads, batch = CONFIGS[name]
    cfg = DiTConfig(image_size=size, channels=1, patch=patch, hidden=hidden, depth=depth, heads=heads,
                    num_classes=10)
    step, release = pytorch_training_step(cfg, batch, compile_model)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name] += ev.time_range.elapsed_us() * 1e3  # us -> ns
    release()
    kind = "compile" if compile_model else "eager"
    return summarize(kernels, steps, f"PyTorch {kind} (bf16 autocast, SDPA), config {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="c")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="also torch.compile (compiles during the warm-up)")
    ap.add_argument("--fp8", action="store_true", help="also train_dit --attn sage --linear fp8")
    ap.add_argument("--lib", default=os.path.join(REPO, "build", "libkernel_times.so"))
    ap.add_argument("--train-dit", default=os.path.join(REPO, "train_dit"))
    args = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for name in args.configs.split(","):
        size, patch, hidden, depth, heads, batch = CONFIGS[name]
        label = f"{name} (h{hidden} d{depth}, {(size // patch) ** 2} tokens x {batch})"
        runs = {"sage": ["--attn", "sage"], "bf16": ["--attn", "bf16"]}
        if args.fp8:
            runs["sage fp8"] = ["--attn", "sage", "--linear", "fp8"]
        for run, flags in runs.items():
            rows.append((label, f"train_dit {run}",
                         profile_train_dit(os.path.abspath(args.train_dit), name, flags, args.steps,
                                           os.path.abspath(args.lib))))
        for compile_model in (False, True) if args.compile else (False,):
            try:
                split = profile_pytorch(name, args.steps, compile_model)
            except Exception as e:   # noqa: BLE001 -- a failed run leaves its row empty
                print(f"PyTorch {'compile' if compile_model else 'eager'}, config {name}: failed: "
                      f"{type(e).__name__}: {e}")
                split = None
            if compile_model:
                torch._dynamo.reset()
            torch.cuda.empty_cache()
            rows.append((label, f"PyTorch {'compile' if compile_model else 'eager'}", split))
    print("\n| config | run | kernel ms/step | attention | GEMM | rest |\n|---|---|---|---|---|---|")
    for label, run, split in rows:
        cells = " | ".join(f"{v:.1f}" for v in split) if split else "— | — | — | —"
        print(f"| {label} | {run} | {cells} |")


if __name__ == "__main__":
    main()
