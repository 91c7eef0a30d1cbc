"""Training-step time of ./train_dit against the PyTorch reference (dev/dit_ref.py) on the same GPU,
for the same model config and batch, in one run.

    python3 dev/bench_step.py [--configs a,c] [--steps 30] [--compile]

PyTorch: fp32 master weights, autocast bf16, SDPA (cuDNN backend where available), fused AdamW,
clip_grad_norm_ (the usual mixed-precision recipe); median step time over the steps after the
warm-up, timed with CUDA events. train_dit: its own per-step ms (log line), median over the same
steps. Synthetic data on both sides (the step does not depend on pixel values).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dit_ref import DiTConfig, make_model, flow_matching_loss  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (image_size, patch, hidden, depth, heads, batch); tokens = (image_size / patch)^2
CONFIGS = {
    "a": (32, 2, 768, 12, 12, 64),     # DiT-B/2 at 256 tokens
    "b": (128, 2, 1152, 4, 18, 4),     # head dim 64 at 4K tokens (depth 4)
    "c": (256, 2, 2048, 4, 16, 1),     # head dim 128 at 16K tokens (depth 4)
    "d": (362, 2, 2048, 4, 16, 1),     # head dim 128 at 32,761 tokens (depth 4)
}


def time_pytorch(cfg, batch, steps, warmup, compile_model):
    torch.manual_seed(0)
    model = make_model(cfg, device="cuda", dtype=torch.float32, use_sdpa=True)
    if compile_model:
        model = torch.compile(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, fused=True)
    x0 = torch.randn(batch, cfg.channels, cfg.image_size, cfg.image_size, device="cuda")
    noise = torch.randn_like(x0)
    t = torch.rand(batch, device="cuda")
    y = torch.randint(0, cfg.num_classes, (batch,), device="cuda")
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = flow_matching_loss(model, x0, t, y, noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    del model, opt
    torch.cuda.empty_cache()
    return statistics.median(times)


def time_train_dit(size, patch, hidden, depth, heads, batch, attn, steps, warmup):
    cmd = [os.path.join(REPO, "train_dit"), "--device", "gpu", "--data", "synthetic", "--attn", attn,
           "--image-size", str(size), "--patch", str(patch), "--hidden", str(hidden),
           "--depth", str(depth), "--heads", str(heads), "--batch", str(batch),
           "--steps", str(warmup + steps), "--ckpt-every", "0", "--sample-every", "0",
           "--out", "/tmp/bench_step_out"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return None, out.stderr.strip().splitlines()[-1] if out.stderr else "failed"
    ms = [float(m.group(1)) for m in re.finditer(r"\| ([0-9.]+) ms \|", out.stdout)]
    return statistics.median(ms[warmup:]), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="a,c")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile")
    args = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, median of {args.steps} steps "
          f"after {args.warmup}")
    print("| config | tokens | batch | train_dit sage ms | train_dit bf16 ms | PyTorch eager ms |"
          + (" PyTorch compile ms |" if args.compile else "") + " eager / sage | eager / bf16 |")
    print("|---|---|---|---|---|---|" + ("---|" if args.compile else "") + "---|---|")
    for name in args.configs.split(","):
        size, patch, hidden, depth, heads, batch = CONFIGS[name]
        cfg = DiTConfig(image_size=size, channels=1, patch=patch, hidden=hidden, depth=depth,
                        heads=heads, num_classes=10)
        ours = {}
        for attn in ("sage", "bf16"):
            ms, why = time_train_dit(size, patch, hidden, depth, heads, batch, attn, args.steps, args.warmup)
            ours[attn] = ms
            if why:
                print(f"train_dit --attn {attn} on config {name}: {why}", file=sys.stderr)
        eager = time_pytorch(cfg, batch, args.steps, args.warmup, False)
        compiled = time_pytorch(cfg, batch, args.steps, args.warmup, True) if args.compile else None
        fmt = lambda v: f"{v:.1f}" if v else "—"  # noqa: E731
        ratio = lambda v: f"{eager / v:.2f}x" if v else "—"  # noqa: E731
        print(f"| {name} (h{hidden} d{depth} H{heads}) | {(size // patch) ** 2} | {batch} | {fmt(ours['sage'])} | "
              f"{fmt(ours['bf16'])} | {eager:.1f} |" + (f" {compiled:.1f} |" if args.compile else "")
              + f" {ratio(ours['sage'])} | {ratio(ours['bf16'])} |", flush=True)


if __name__ == "__main__":
    main()
