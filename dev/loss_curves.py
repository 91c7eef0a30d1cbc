"""Loss curves of train_dit against the PyTorch reference (dev/dit_ref.py) on the same stream.

    python3 dev/loss_curves.py --out out/curves_cpu --steps 200            # CPU: exact and sage vs fp32
    python3 dev/loss_curves.py --device cuda --dtype bf16 --steps 2000 --seeds 1,2 --out out/curves_gpu

Both trainers start from the same weights and see the same batches, label drops, times t and
noise:
- train_dit runs once per --attn kind with --save-init; its OUT/ckpt_000000.safetensors (the
  initial weights) is what the reference loads.
- The reference draws every step from dit.c itself, through ctypes on build/libditc.so (`make
  lib`): the data loader (dataloader_open with train_dit's config: the same seed, flips,
  prefetch) and flow_matching_sample (layers/loss.c) on an Rng seeded with seed + 1, as
  train_dit does. So nothing is written to disk per step and no sampling logic is duplicated.
- The optimizer is dit_ref.make_optimizer (AdamW, decay on matrices only) with train_dit's
  learning rate schedule (linear warmup, computed in fp32 as train_dit does) and clipping.
- --dtype bf16: autocast bf16 with fp32 master weights (the usual mixed-precision recipe); fp32
  otherwise. On --device cuda, train_dit runs on the GPU (bf16 compute, fp32 master weights).
- --seeds A,B: the reference again for each seed s, from the same initial weights but with the
  stream of train_dit --seed s (data order and flips, drops, t, noise): the natural spread.

Writes OUT/loss_curves.csv (step, lr and one loss column per run), OUT/loss_curves.png (the raw
and smoothed curves; the smoothed difference of each run from the reference, with the seed
runs' band when there are any; the per-step relative difference from the reference), and OUT/summary.md (the table printed at the end: final smoothed
loss, largest deviation of the smoothed curve from the reference, largest per-step relative
deviation). Smoothing: the mean of the last --smooth steps. Exit status 1 when a run has a
non-finite loss.
"""
import argparse
import csv
import ctypes
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dit_ref  # noqa: E402
import safetensors_np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ERR_LEN = 512   # DIT_ERR_LEN in layers/common.h


# ---- dit.c through ctypes: the data loader and the per-step draws -----------------------------
class DataLoaderConfig(ctypes.Structure):   # dataloader/dataloader.h
    _fields_ = [("root", ctypes.c_char_p), ("image_size", ctypes.c_int), ("channels", ctypes.c_int),
                ("batch_size", ctypes.c_int), ("seed", ctypes.c_uint64), ("random_flip", ctypes.c_int),
                ("skip_bad_images", ctypes.c_int), ("prefetch", ctypes.c_int), ("max_image_pixels", ctypes.c_int)]


class Rng(ctypes.Structure):   # layers/common.h
    _fields_ = [("state", ctypes.c_uint64)]


def load_library(path):
    if not os.path.exists(path):
        sys.exit(f"loss_curves.py: {path} not found: build it with `make lib`")
    lib = ctypes.CDLL(path)
    P = ctypes.c_void_p
    lib.dataloader_open.argtypes = [ctypes.POINTER(P), ctypes.POINTER(DataLoaderConfig), ctypes.c_char_p]
    lib.dataloader_next_batch.argtypes = [P, P, P, ctypes.c_char_p]
    lib.dataloader_num_classes.argtypes = [P]
    lib.dataloader_close.argtypes = [P]
    lib.dataloader_close.restype = None
    lib.rng_seed.argtypes = [ctypes.POINTER(Rng), ctypes.c_uint64]
    lib.rng_seed.restype = None
    lib.flow_matching_sample.argtypes = [ctypes.POINTER(Rng), P, P, P, ctypes.c_int, ctypes.c_size_t,
                                         ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.flow_matching_sample.restype = None
    return lib


class Stream:
    """train_dit's per-step inputs: x0 (B, C, S, S), labels after the drops, t, noise."""

    def __init__(self, lib, args, cfg, seed):
        self.lib, self.err = lib, ctypes.create_string_buffer(ERR_LEN)
        self.root = args.data.encode()   # kept alive: the loader holds the pointer
        dcfg = DataLoaderConfig(root=self.root, image_size=cfg.image_size, channels=cfg.channels,
                                batch_size=args.batch, seed=seed, random_flip=0 if args.no_flip else 1,
                                skip_bad_images=0, prefetch=2, max_image_pixels=0)
        self.dl = ctypes.c_void_p()
        if lib.dataloader_open(ctypes.byref(self.dl), ctypes.byref(dcfg), self.err) != 0:
            sys.exit(f"loss_curves.py: dataloader_open: {self.err.value.decode()}")
        if lib.dataloader_num_classes(self.dl) != cfg.num_classes:
            sys.exit(f"loss_curves.py: --data {args.data} has {lib.dataloader_num_classes(self.dl)} classes, "
                     f"the initial checkpoint {cfg.num_classes}")
        self.rng = Rng()
        lib.rng_seed(ctypes.byref(self.rng), seed + 1)
        B, C, S = args.batch, cfg.channels, cfg.image_size
        self.x0 = np.empty((B, C, S, S), np.float32)
        self.noise = np.empty((B, C, S, S), np.float32)
        self.t = np.empty(B, np.float32)
        self.labels = np.empty(B, np.int32)
        self.B, self.n, self.null = B, C * S * S, cfg.num_classes
        self.dropout, self.uniform = args.label_dropout, int(args.t_sampling == "uniform")

    def next(self):
        if self.lib.dataloader_next_batch(self.dl, self.x0.ctypes.data, self.labels.ctypes.data, self.err) != 0:
            sys.exit(f"loss_curves.py: dataloader_next_batch: {self.err.value.decode()}")
        self.lib.flow_matching_sample(ctypes.byref(self.rng), self.labels.ctypes.data, self.t.ctypes.data,
                                      self.noise.ctypes.data, self.B, self.n, self.dropout, self.null, self.uniform)
        return self.x0, self.labels, self.t, self.noise

    def close(self):
        self.lib.dataloader_close(self.dl)


# ---- the two trainers ---------------------------------------------------------------------------
def learning_rates(args):
    # train_dit's learning_rate(): lr·step/(warmup + 1) in fp32 up to the warmup, then lr
    lr, steps = np.float32(args.lr), np.arange(1, args.steps + 1)
    warm = (lr * steps.astype(np.float32)) / np.float32(args.warmup + 1)
    return np.where(steps <= args.warmup, warm, lr).astype(np.float32)


def model_flags(args):
    flags = ["--model", args.model]
    for name in ("depth", "hidden", "heads", "patch", "image_size", "channels"):
        if getattr(args, name):
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return flags


def run_train_dit(args, attn, out_dir):
    cmd = [args.train_dit, "--device", "gpu" if args.device == "cuda" else "cpu", "--attn", attn,
           "--data", args.data, "--steps", str(args.steps), "--batch", str(args.batch), "--lr", repr(args.lr),
           "--warmup", str(args.warmup), "--weight-decay", repr(args.weight_decay), "--grad-clip", repr(args.grad_clip),
           "--label-dropout", repr(args.label_dropout), "--t-sampling", args.t_sampling, "--seed", str(args.seed),
           "--ckpt-every", "0", "--sample-every", str(args.sample_every), "--save-init", "--out", out_dir]
    cmd += model_flags(args) + (["--no-flip"] if args.no_flip else [])
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []   # progress as it happens
    with subprocess.Popen(line_buffered + cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:   # every line but the step lines, and steps 1, 100, 200, ... and the last
            step = int(line.split()[1].split("/")[0]) if line.startswith("step ") else 0
            if step in (0, 1, args.steps) or step % 100 == 0:
                print("  " + line.rstrip(), flush=True)
    if p.returncode != 0:
        sys.exit(f"loss_curves.py: train_dit --attn {attn} failed with status {p.returncode}")
    with open(os.path.join(out_dir, "train_log.csv")) as f:
        rows = list(csv.DictReader(f))
    losses = np.array([float(r["loss"]) for r in rows], np.float64)
    if len(losses) != args.steps:
        sys.exit(f"loss_curves.py: {out_dir}/train_log.csv has {len(losses)} steps, expected {args.steps}")
    print(f"  train_dit --attn {attn}: {args.steps} steps in {time.time() - t0:.1f} s", flush=True)
    return losses


def load_initial_model(path, device):
    tensors, meta = safetensors_np.load(path)
    cfg = dit_ref.DiTConfig.from_metadata(meta)
    model = dit_ref.make_model(cfg, device=device, dtype=torch.float32)
    weights = {k: torch.from_numpy(v) for k, v in tensors.items()
               if not k.startswith(("ema.", "adam_m.", "adam_v."))}
    model.load_state_dict(weights, strict=True)
    return cfg, model


def run_reference(args, lib, init_path, seed, name):
    cfg, model = load_initial_model(init_path, args.device)
    optimizer = dit_ref.make_optimizer(model, args.lr, (0.9, 0.999), 1e-8, args.weight_decay)
    stream, lrs = Stream(lib, args, cfg, seed), learning_rates(args)
    use_autocast = args.dtype == "bf16"
    losses = np.empty(args.steps, np.float64)
    t0 = time.time()
    for k in range(args.steps):
        x0, labels, t, noise = (torch.from_numpy(a).to(args.device) for a in stream.next())
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=use_autocast):
            loss, _ = dit_ref.flow_matching_loss(model, x0, t, labels.long(), noise)
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = float(lrs[k])
        dit_ref.clip_and_step(model, optimizer, args.grad_clip)
        losses[k] = loss.item()
        if k == 0 or (k + 1) % 100 == 0 or k + 1 == args.steps:
            print(f"  {name} step {k + 1:5d}/{args.steps} | loss {losses[k]:.6f} | "
                  f"{1e3 * (time.time() - t0) / (k + 1):.1f} ms/step", flush=True)
    stream.close()
    return losses


# ---- comparison ---------------------------------------------------------------------------------
def smooth(x, window):
    # the mean of the last `window` values (fewer at the start)
    c = np.concatenate([[0.0], np.cumsum(x)])
    i = np.arange(1, len(x) + 1)
    lo = np.maximum(0, i - window)
    return (c[i] - c[lo]) / (i - lo)


def summarize(runs, ref_name, window):
    """Rows of (name, final smoothed loss, max |smoothed - ref| over full windows, max per-step
    |loss - ref| / ref, first step where that exceeds 1e-3, finite)."""
    ref = runs[ref_name]
    ref_s = smooth(ref, window)
    full = slice(window - 1, None) if len(ref) >= window else slice(len(ref) - 1, None)
    rows = []
    for name, loss in runs.items():
        s = smooth(loss, window)
        rel = np.abs(loss - ref) / np.abs(ref)
        above = np.nonzero(rel > 1e-3)[0]
        rows.append((name, s[-1], np.max(np.abs(s - ref_s)[full]), np.max(rel),
                     int(above[0]) + 1 if len(above) else None, bool(np.all(np.isfinite(loss)))))
    return rows


def format_table(rows, ref_name, window, steps):
    lines = [f"| run | final loss (mean of last {window}) | max abs dev. of smoothed curve from {ref_name} "
             f"(steps {window}..{steps}) | max per-step rel. dev. | first step rel. dev. > 1e-3 | finite |",
             "|---|---|---|---|---|---|"]
    for name, final, dev, rel, first, finite in rows:
        lines.append(f"| {name} | {final:.5f} | {dev:.2e} | {rel:.2e} | {first if first else '-'} | "
                     f"{'yes' if finite else 'NO'} |")
    return "\n".join(lines)


def plot(path, runs, ref_name, seed_names, window, title):
    try:
        import matplotlib
    except ImportError:
        print(f"no matplotlib here: {path} not written (run --replot OUT where matplotlib is installed)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = np.arange(1, len(runs[ref_name]) + 1)
    fig, (top, bottom, rel) = plt.subplots(3, 1, figsize=(8, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]})
    colors = {}
    for i, (name, loss) in enumerate(runs.items()):
        colors[name] = f"C{i}"
        top.plot(steps, loss, color=colors[name], alpha=0.15, linewidth=0.6)
        top.plot(steps, smooth(loss, window), color=colors[name], linewidth=1.6, label=name)
    top.set_ylabel(f"loss (faint: per step; bold: mean of last {window})")
    top.legend(fontsize=8)
    top.set_title(title, fontsize=7.5)
    ref_s = smooth(runs[ref_name], window)
    if seed_names:
        spread = np.stack([smooth(runs[n], window) - ref_s for n in seed_names])
        bottom.fill_between(steps, spread.min(0), spread.max(0), color="0.85",
                            label="seed runs (other data/noise stream)")
    for name, loss in runs.items():
        if name != ref_name and name not in seed_names:
            bottom.plot(steps, smooth(loss, window) - ref_s, color=colors[name], linewidth=1.2, label=name)
    bottom.axhline(0, color="k", linewidth=0.5)
    bottom.set_ylabel(f"smoothed loss − {ref_name}")
    bottom.legend(fontsize=8)
    for name, loss in runs.items():
        if name != ref_name:
            rel.plot(steps, np.abs(loss - runs[ref_name]) / np.abs(runs[ref_name]), color=colors[name],
                     linewidth=0.8, alpha=0.4 if name in seed_names else 1.0, label=name)
    rel.set_yscale("log")
    rel.set_ylabel(f"per step |loss − {ref_name}| / {ref_name}", fontsize=8)
    rel.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/loss_curves", help="output folder (train_dit runs, CSV, PNG, summary)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where both trainers run (train_dit --device cpu / gpu)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                    help="the reference: fp32, or autocast bf16 (default: fp32 on cpu, bf16 on cuda)")
    ap.add_argument("--attn", default=None,
                    help="train_dit runs, comma-separated (default: exact,sage on cpu; sage,bf16 on cuda)")
    ap.add_argument("--seeds", default="", help="comma-separated stream seeds for extra reference runs (spread)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--data", default="data/fashion-mnist", help="image folder or 'synthetic' (train_dit --data)")
    ap.add_argument("--model", default="tiny")
    for name in ("depth", "hidden", "heads", "patch", "image-size", "channels"):
        ap.add_argument("--" + name, type=int, default=0, help="train_dit's override (0: the preset's)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--label-dropout", type=float, default=0.1)
    ap.add_argument("--t-sampling", choices=("logit-normal", "uniform"), default="logit-normal")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--no-flip", action="store_true")
    ap.add_argument("--sample-every", type=int, default=0, help="train_dit's sample grids (0: none)")
    ap.add_argument("--smooth", type=int, default=50, help="window of the smoothed curves and the table")
    ap.add_argument("--train-dit", default=os.path.join(REPO, "train_dit"))
    ap.add_argument("--lib", default=os.path.join(REPO, "build", "libditc.so"))
    ap.add_argument("--replot", metavar="OUT", help="only redo the plot and table from OUT/loss_curves.csv")
    args = ap.parse_args()
    if args.replot:
        return replot(args.replot, args.smooth)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    attns = (args.attn or ("sage,bf16" if args.device == "cuda" else "exact,sage")).split(",")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if not os.path.exists(args.train_dit):
        sys.exit(f"loss_curves.py: {args.train_dit} not found: build it with `make train_dit`")
    lib = load_library(args.lib)
    os.makedirs(args.out, exist_ok=True)

    runs, init_paths = {}, []
    for attn in attns:
        out_dir = os.path.join(args.out, f"train_dit_{attn}")
        runs[f"train_dit {attn}"] = run_train_dit(args, attn, out_dir)
        init_paths.append(os.path.join(out_dir, "ckpt_000000.safetensors"))
    init_path, init = init_paths[0], safetensors_np.load(init_paths[0])
    for path in init_paths[1:]:   # the same seed must give every train_dit run the same weights
        other = safetensors_np.load(path)[0]
        if other.keys() != init[0].keys() or any(not np.array_equal(a, init[0][k]) for k, a in other.items()):
            sys.exit(f"loss_curves.py: {path} and {init_path} differ: the runs did not start from the same weights")
    torch.manual_seed(0)
    ref_name = f"torch {args.dtype}"
    print(f"$ reference ({ref_name} on {args.device}, torch {torch.__version__}) from {init_path}", flush=True)
    runs[ref_name] = run_reference(args, lib, init_path, args.seed, ref_name)
    seed_names = []
    for s in seeds:
        name = f"torch {args.dtype} seed {s}"
        print(f"$ reference, stream seed {s}", flush=True)
        runs[name] = run_reference(args, lib, init_path, s, name)
        seed_names.append(name)

    names = list(runs)
    lrs = learning_rates(args)
    with open(os.path.join(args.out, "loss_curves.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "lr"] + names)
        for k in range(args.steps):
            w.writerow([k + 1, f"{lrs[k]:.7g}"] + [f"{runs[n][k]:.9g}" for n in names])
    cfg = dit_ref.DiTConfig.from_metadata(init[1])
    tokens = (cfg.image_size // cfg.patch) ** 2
    title = (f"depth {cfg.depth} hidden {cfg.hidden} heads {cfg.heads} patch {cfg.patch}, {cfg.channels}x"
             f"{cfg.image_size}x{cfg.image_size} ({tokens} tokens), batch {args.batch}, {args.data}, "
             f"lr {args.lr:g}, {args.device}")
    with open(os.path.join(args.out, "title.txt"), "w") as f:
        f.write(f"{title}; torch {torch.__version__}\n")
    return report(args.out, runs, ref_name, seed_names, args.smooth, title + f"; torch {torch.__version__}")


def report(out, runs, ref_name, seed_names, window, title):
    plot(os.path.join(out, "loss_curves.png"), runs, ref_name, seed_names, window, title)
    rows = summarize(runs, ref_name, window)
    table = format_table(rows, ref_name, window, len(runs[ref_name]))
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(f"{title}\n\n{table}\n")
    print(f"\n{title}\n{table}\nwrote {out}/loss_curves.csv, loss_curves.png, summary.md")
    return 0 if all(r[5] for r in rows) else 1


def replot(out, window):
    # the columns after step and lr: train_dit runs, the reference ("torch <dtype>"), seed runs
    with open(os.path.join(out, "loss_curves.csv")) as f:
        rows = list(csv.reader(f))
    names = rows[0][2:]
    runs = {n: np.array([float(r[2 + i]) for r in rows[1:]]) for i, n in enumerate(names)}
    ref_name = next(n for n in names if n.startswith("torch ") and " seed " not in n)
    with open(os.path.join(out, "title.txt")) as f:
        title = f.read().strip()
    return report(out, runs, ref_name, [n for n in names if " seed " in n], window, title)


if __name__ == "__main__":
    sys.exit(main())
