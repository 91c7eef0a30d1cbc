"""Training-step time of ./train_dit against the PyTorch reference (dev/dit_ref.py) on the same GPU,
for the same model config and batch, in one run: a markdown table (ms/step and images/s).

    python3 dev/bench_step.py [--configs a,b,c,d] [--steps 20] [--compile] [--fp8] [--fp8-fast] [--fp16] [--rounds 1]
                              [--no-gemm-tuning] [--train-dit PATH]

PyTorch: fp32 master weights, autocast bf16, SDPA (cuDNN backend where available), fused AdamW,
clip_grad_norm_, and the EMA of the weights updated every step (DiT's recipe: train_dit's step
does it too, inside its AdamW pass; PyTorch's as one torch._foreach_lerp_, the fastest form it has;
--no-ema leaves it out, the way this benchmark ran before 2026-11-30), eager and (--compile)
torch.compile of the model (default mode; the loss, clipping, AdamW and EMA stay eager); median step time over the steps
after the warm-up, timed with CUDA events. train_dit: its own per-step ms (log line: wall clock of
the whole step, batch and host RNG included), median over the same steps. Synthetic data on both
sides (the step does not depend on pixel values). --fp8 adds train_dit --attn sage --linear fp8
(FP8 GEMMs in the block linears) and its ratios; --fp8-fast the same with --fp8-fast-accum all (every
FP8 GEMM in fast accumulation, not only the forward's); --fp16 adds train_dit --attn sage-fp16 --linear
fp8 (the same with FP16 P·V, the accurate sage mode). Configs b, c, d run at depth 4: the step time
is linear in depth, so the ratios hold for the full model. A run that fails (out of memory, a
compile error, train_dit exiting) prints why on stderr and leaves "—" in its cell; the table goes on.
--rounds R measures each configuration R times in a row (every run of the row, then again), one
table row per round, so that the spread between rounds shows next to the ratios (3 decimals: the
targets sit on lines such as 1.2x).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dit_ref import DiTConfig, make_model, flow_matching_loss  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (image_size, patch, hidden, depth, heads, batch); tokens = (image_size / patch)^2
CONFIGS = {
    "a": (32, 2, 768, 12, 12, 64),     # DiT-B/2 at 256 tokens (full depth)
    "b": (128, 2, 1152, 4, 18, 4),     # DiT-XL width, head dim 64, at 4K tokens (depth 4 of 28)
    "c": (256, 2, 2048, 4, 16, 1),     # head dim 128 at 16K tokens (depth 4)
    "d": (362, 2, 2048, 4, 16, 1),     # head dim 128 at 32,761 tokens (depth 4)
}


def pytorch_training_step(cfg, batch, compile_model, ema=True):
    """One PyTorch training step as a function (fp32 master weights, autocast bf16, SDPA, fused
    AdamW, clipping, and with `ema` the EMA update ema += (1 - 0.9999)·(w - ema)) on a fixed
    synthetic batch; returns (step, release)."""
    torch.manual_seed(0)
    model = make_model(cfg, device="cuda", dtype=torch.float32, use_sdpa=True)
    forward = torch.compile(model) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    x0 = torch.randn(batch, cfg.channels, cfg.image_size, cfg.image_size, device="cuda")
    noise, t = torch.randn_like(x0), torch.rand(batch, device="cuda")
    y = torch.randint(0, cfg.num_classes, (batch,), device="cuda")
    params = list(model.parameters())
    ema_params = [p.detach().clone() for p in params] if ema else None

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = flow_matching_loss(forward, x0, t, y, noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if ema:
            with torch.no_grad():
                torch._foreach_lerp_(ema_params, params, 1.0 - 0.9999)

    def release():
        nonlocal model, forward, opt, params, ema_params
        del model, forward, opt, params, ema_params
        if compile_model:
            torch._dynamo.reset()
        torch.cuda.empty_cache()

    return step, release


def pytorch_step_ms(cfg, batch, steps, warmup, compile_model, ema):
    """Median ms of one PyTorch training step (CUDA events) after `warmup` steps."""
    step, release = pytorch_training_step(cfg, batch, compile_model, ema)
    times = []
    try:
        for i in range(warmup + steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end))
    finally:
        release()
    return statistics.median(times)


def train_dit_step_ms(train_dit, size, patch, hidden, depth, heads, batch, flags, steps, warmup):
    """Median of train_dit's logged step times after `warmup` steps (flags: e.g. ["--attn", "sage"]);
    raises RuntimeError with the reason when the run fails."""
    cmd = [train_dit, "--device", "gpu", "--data", "synthetic", *flags,
           "--image-size", str(size), "--patch", str(patch), "--hidden", str(hidden),
           "--depth", str(depth), "--heads", str(heads), "--batch", str(batch),
           "--steps", str(warmup + steps), "--ckpt-every", "0", "--sample-every", "0",
           "--out", "/tmp/bench_step_out"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stderr.strip() or out.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"exit status {out.returncode}: {tail}")
    ms = [float(m.group(1)) for m in re.finditer(r"\| ([0-9.]+) ms \|", out.stdout)]
    if len(ms) <= warmup:
        raise RuntimeError(f"{len(ms)} step lines in its output, expected {warmup + steps}")
    return statistics.median(ms[warmup:])


def measure(label, fn, *args):
    # fn(*args), or None with the reason on stderr when it fails
    try:
        return fn(*args)
    except Exception as e:   # noqa: BLE001 -- any failure becomes an empty cell and a message
        print(f"{label}: failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}",
              file=sys.stderr, flush=True)
        if not isinstance(e, (RuntimeError, torch.cuda.OutOfMemoryError)):
            traceback.print_exc()
        torch.cuda.empty_cache()
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="a,b,c,d")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="steps before timing (compile happens here)")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile")
    ap.add_argument("--fp8", action="store_true", help="also time train_dit --attn sage --linear fp8")
    ap.add_argument("--fp8-fast", action="store_true",
                    help="also time train_dit --attn sage --linear fp8 --fp8-fast-accum all")
    ap.add_argument("--fp16", action="store_true", help="also time train_dit --attn sage-fp16 --linear fp8")
    ap.add_argument("--no-gemm-tuning", action="store_true", help="every train_dit run with --gemm-tuning off")
    ap.add_argument("--no-ema", action="store_true", help="PyTorch without the EMA update (train_dit keeps its own)")
    ap.add_argument("--rounds", type=int, default=1, help="rows per configuration, measured one after the other")
    ap.add_argument("--train-dit", default=os.path.join(REPO, "train_dit"))
    args = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, median of {args.steps} steps "
          f"after {args.warmup}; PyTorch {'without' if args.no_ema else 'with'} the EMA update; cells: ms/step (images/s)",
          flush=True)
    # train_dit's runs; each but bf16 gets its ratios against PyTorch
    ours = {"train_dit sage": ["--attn", "sage"], "train_dit bf16": ["--attn", "bf16"]}
    if args.fp8:
        ours["train_dit sage fp8"] = ["--attn", "sage", "--linear", "fp8"]
    if args.fp8_fast:
        ours["train_dit sage fp8 fast"] = ["--attn", "sage", "--linear", "fp8", "--fp8-fast-accum", "all"]
    if args.fp16:
        ours["train_dit sage-fp16 fp8"] = ["--attn", "sage-fp16", "--linear", "fp8"]
    if args.no_gemm_tuning:
        ours = {name: flags + ["--gemm-tuning", "off"] for name, flags in ours.items()}
    runs = list(ours) + ["PyTorch eager"] + (["PyTorch compile"] if args.compile else [])
    ratio_of = [(f"{ref} / {ours_name[len('train_dit '):]}", f"PyTorch {ref}", ours_name)
                for ours_name in ours if ours_name != "train_dit bf16"
                for ref in ["eager"] + (["compile"] if args.compile else [])]
    ratios = [r[0] for r in ratio_of]
    print("| config | tokens | batch | depth | " + " | ".join(runs + ratios) + " |")
    print("|---" * (4 + len(runs) + len(ratios)) + "|", flush=True)
    for name in args.configs.split(","):
        if name not in CONFIGS:
            print(f"config {name}: unknown (expected one of {', '.join(CONFIGS)})", file=sys.stderr)
            continue
        size, patch, hidden, depth, heads, batch = CONFIGS[name]
        cfg = DiTConfig(image_size=size, channels=1, patch=patch, hidden=hidden, depth=depth,
                        heads=heads, num_classes=10)
        for r in range(args.rounds):
            ms = {}
            for run, flags in ours.items():
                ms[run] = measure(f"config {name}, train_dit {' '.join(flags)}", train_dit_step_ms, args.train_dit,
                                  size, patch, hidden, depth, heads, batch, flags, args.steps, args.warmup)
            ms["PyTorch eager"] = measure(f"config {name}, PyTorch eager", pytorch_step_ms, cfg, batch,
                                          args.steps, args.warmup, False, not args.no_ema)
            if args.compile:
                ms["PyTorch compile"] = measure(f"config {name}, PyTorch compile", pytorch_step_ms, cfg, batch,
                                                args.steps, args.warmup, True, not args.no_ema)
            cell = lambda v: f"{v:.1f} ({batch / (v / 1e3):.0f})" if v else "—"  # noqa: E731
            ratio = lambda a, b: f"{a / b:.3f}x" if a and b else "—"  # noqa: E731
            cells = [cell(ms[k]) for k in runs] + [ratio(ms[theirs], ms[mine]) for _, theirs, mine in ratio_of]
            label = f"{name} (h{hidden} H{heads})" + (f", round {r + 1}" if args.rounds > 1 else "")
            print(f"| {label} | {(size // patch) ** 2} | {batch} | {depth} | " + " | ".join(cells) + " |", flush=True)
    print("\nb, c, d run at depth 4 (a at DiT-B's full 12): the step time is linear in depth, so the ratios "
          "hold for deeper models. x/y: how many times faster train_dit is (sage, or sage with FP8 linears).")


if __name__ == "__main__":
    main()
