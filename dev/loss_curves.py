"""Loss curves of train_dit against the PyTorch reference (dev/dit_ref.py) on the same stream.

    python3 dev/loss_curves.py --out out/curves_cpu --steps 200            # CPU: exact and sage vs fp32
    python3 dev/loss_curves.py --device cuda --parallel --steps 2000 --seeds 1,2 --sample-every 2000 --out out/gpu

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
Every run is a subprocess (train_dit, or this script with --worker for a reference run) writing
its losses as it goes into OUT/<run>/; --parallel starts them all at once (the references as soon
as train_dit has written the initial weights), else one after another. --time-limit stops what
is still running and keeps the steps that every run finished.

--sample-every N: train_dit writes OUT/train_dit_<attn>/samples_<step>.png (its EMA weights, Euler
steps with guidance, fixed noise from seed + 7); the main reference run keeps the EMA the way
train_dit does and writes it as a train_dit checkpoint, and train_dit's own sampler draws its grid
(OUT/torch/samples/samples_000001.png: resume with lr 0 for one step, which changes no weight),
so the grids differ only by the weights. samples_side_by_side.png stacks the final grids.

Writes OUT/loss_curves.csv (step, lr and one loss column per run), OUT/loss_curves.png (the raw
and smoothed curves; the smoothed difference of each run from the reference, with the seed
runs' band when there are any; the per-step relative difference from the reference), and
OUT/summary.md (the table printed at the end: final smoothed loss, largest deviation of the
smoothed curve from the reference, largest per-step relative deviation; then each train_dit
run's largest deviation against the seed-to-seed spread). Smoothing: the mean of the last
--smooth steps. Exit status 1 when a run has a non-finite loss.
"""
import argparse
import csv
import ctypes
import os
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


def train_dit_command(args, extra):
    cmd = [args.train_dit, "--device", "gpu" if args.device == "cuda" else "cpu", "--data", args.data,
           "--batch", str(args.batch), "--seed", str(args.seed), "--samples-per-class", str(args.samples_per_class)]
    return cmd + extra + (["--no-flip"] if args.no_flip else [])


def run_kind_flags(kind):
    """train_dit's flags for one run kind: an --attn kind, optionally "+fp8" for FP8 block linears
    (e.g. "sage+fp8" -> --attn sage --linear fp8) or "+fp8all" for FP8 block linears with every FP8
    GEMM in fast accumulation (--fp8-fast-accum all)."""
    attn, plus, linear = kind.partition("+")
    if plus and linear not in ("fp8", "fp8all"):
        sys.exit(f"loss_curves.py: run kind {kind!r}: expected ATTN, ATTN+fp8 or ATTN+fp8all")
    return ["--attn", attn] + (["--linear", "fp8"] if plus else []) + (["--fp8-fast-accum", "all"] if linear == "fp8all" else [])


def start_train_dit(args, attn, out_dir):
    """Starts one train_dit run (its output in out_dir/stdout.txt); returns the Popen."""
    cmd = train_dit_command(args, run_kind_flags(attn) + [
        "--steps", str(args.steps), "--lr", repr(args.lr), "--warmup", str(args.warmup),
        "--weight-decay", repr(args.weight_decay), "--grad-clip", repr(args.grad_clip),
        "--label-dropout", repr(args.label_dropout), "--t-sampling", args.t_sampling, "--ema-decay",
        repr(args.ema_decay), "--ckpt-every", "0", "--sample-every", str(args.sample_every), "--save-init",
        "--out", out_dir] + model_flags(args))
    os.makedirs(out_dir, exist_ok=True)
    print("$", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(os.path.join(out_dir, "stdout.txt"), "w"),
                            stderr=subprocess.STDOUT)


def read_losses(path):
    # the "loss" column of the steps logged so far (train_dit's train_log.csv and the reference's
    # losses.csv are flushed every step)
    if not os.path.exists(path):
        return np.empty(0)
    with open(path) as f:
        return np.array([float(r["loss"]) for r in csv.DictReader(f) if r.get("loss")], np.float64)


def read_train_dit_losses(out_dir):
    return read_losses(os.path.join(out_dir, "train_log.csv"))


def load_initial_model(path, device):
    tensors, meta = safetensors_np.load(path)
    cfg = dit_ref.DiTConfig.from_metadata(meta)
    model = dit_ref.make_model(cfg, device=device, dtype=torch.float32)
    weights = {k: torch.from_numpy(v) for k, v in tensors.items()
               if not k.startswith(("ema.", "adam_m.", "adam_v."))}
    model.load_state_dict(weights, strict=True)
    return cfg, model


def ema_decay_warmup(decay, step):
    # train_dit's ema_decay_warmup (layers/optimizer.c), in fp32
    warm = np.float32(1 + step) / np.float32(10 + step)
    return float(min(warm, np.float32(decay)))


def save_ema_checkpoint(path, init_path, ema):
    """A train_dit checkpoint with the reference's EMA weights as both the weights and the EMA,
    AdamW moments zero, everything else (step 0, RNG and data position) from the initial one:
    `train_dit --resume path --steps 1 --lr 0` then samples from exactly these weights."""
    tensors, meta = safetensors_np.load(init_path)
    for name in tensors:
        base = name.split(".", 1)[1] if name.startswith(("ema.", "adam_m.", "adam_v.")) else name
        if name.startswith(("adam_m.", "adam_v.")):
            tensors[name] = np.zeros_like(tensors[name])
        else:
            tensors[name] = ema[base].detach().float().cpu().numpy().reshape(tensors[name].shape)
    safetensors_np.save(path, tensors, meta)


def reference_worker(args):
    """One reference run (a subprocess of the main script): writes OUT/<tag>/losses.csv as it goes
    and, with --sample-every, for the main stream, OUT/<tag>/ema.safetensors at the end (its EMA
    as train_dit keeps it: decay ema_decay_warmup(step) after every step)."""
    out_dir = os.path.join(args.out, args.worker)
    os.makedirs(out_dir, exist_ok=True)
    lib = load_library(args.lib)
    torch.manual_seed(0)
    cfg, model = load_initial_model(args.init, args.device)
    optimizer = dit_ref.make_optimizer(model, args.lr, (0.9, 0.999), 1e-8, args.weight_decay)
    stream, lrs = Stream(lib, args, cfg, args.worker_seed), learning_rates(args)
    named = dict(model.named_parameters())
    ema = {n: p.detach().clone() for n, p in named.items()}
    use_autocast, keep_ema = args.dtype == "bf16", bool(args.sample_every) and args.worker_seed == args.seed
    print(f"{args.worker}: torch {torch.__version__}, {args.dtype} on {args.device}, stream seed "
          f"{args.worker_seed}, from {args.init}", flush=True)
    t0 = time.time()
    with open(os.path.join(out_dir, "losses.csv"), "w") as log:
        log.write("step,loss\n")
        for k in range(args.steps):
            x0, labels, t, noise = (torch.from_numpy(a).to(args.device) for a in stream.next())
            model.zero_grad(set_to_none=True)
            with torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=use_autocast):
                loss, _ = dit_ref.flow_matching_loss(model, x0, t, labels.long(), noise)
            loss.backward()
            for group in optimizer.param_groups:
                group["lr"] = float(lrs[k])
            dit_ref.clip_and_step(model, optimizer, args.grad_clip)
            if keep_ema:
                decay = ema_decay_warmup(args.ema_decay, k + 1)
                with torch.no_grad():
                    for n, p in named.items():
                        ema[n].mul_(decay).add_(p.detach(), alpha=1.0 - decay)
            value = loss.item()
            log.write(f"{k + 1},{value:.9g}\n")
            log.flush()   # a run stopped at --time-limit keeps every step it finished
            if k == 0 or (k + 1) % 100 == 0 or k + 1 == args.steps:
                print(f"  {args.worker} step {k + 1:5d}/{args.steps} | loss {value:.6f} | "
                      f"{1e3 * (time.time() - t0) / (k + 1):.1f} ms/step", flush=True)
    stream.close()
    if keep_ema:
        save_ema_checkpoint(os.path.join(out_dir, "ema.safetensors"), args.init, ema)
    return 0


def start_reference(args, tag, seed, init_path):
    """Starts reference_worker in a subprocess (its output in OUT/<tag>/stdout.txt)."""
    out_dir = os.path.join(args.out, tag)
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:] + [
        "--worker", tag, "--worker-seed", str(seed), "--init", init_path]
    print(f"$ reference {tag}: stream seed {seed}", flush=True)
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(os.path.join(out_dir, "stdout.txt"), "w"),
                            stderr=subprocess.STDOUT)


def read_reference_losses(out_dir):
    return read_losses(os.path.join(out_dir, "losses.csv"))


def sample_reference(args, tag):
    """The reference's sample grid through train_dit's own sampler (same Euler steps, guidance and
    fixed noise as train_dit's grids): resume from OUT/<tag>/ema.safetensors with lr 0 for one
    step, which leaves the weights and the EMA as they are, and write the grid at that step."""
    ckpt = os.path.join(args.out, tag, "ema.safetensors")
    out_dir = os.path.join(args.out, tag, "samples")
    os.makedirs(out_dir, exist_ok=True)
    cmd = train_dit_command(args, ["--attn", "bf16" if args.device == "cuda" else "exact", "--resume", ckpt,
                                   "--steps", "1", "--lr", "0", "--warmup", "0", "--ckpt-every", "0",
                                   "--sample-every", "1", "--out", out_dir])
    print("$", " ".join(cmd), flush=True)
    run = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if run.returncode != 0:
        print(f"sampling the reference failed (status {run.returncode}):\n{run.stdout[-2000:]}", flush=True)
        return None
    return os.path.join(out_dir, "samples_000001.png")


def wait_all(procs, deadline):
    """Waits for every Popen in procs (name -> Popen) or the deadline (time.time() value or None);
    at the deadline the remaining ones are stopped. Returns name -> exit status (None: stopped)."""
    status = {}
    while len(status) < len(procs):
        for name, p in procs.items():
            if name not in status and p.poll() is not None:
                status[name] = p.returncode
                print(f"  {name}: finished with status {p.returncode}", flush=True)
        if deadline and time.time() > deadline:
            for name, p in procs.items():
                if name not in status:
                    p.terminate()
                    p.wait()
                    status[name] = None
                    print(f"  {name}: stopped at the time limit", flush=True)
        time.sleep(0.5)
    return status


def wait_for_init(procs, out_dirs):
    # train_dit writes ckpt_000000 before step 1, so one logged step means the file is complete
    while True:
        for name, out_dir in out_dirs.items():
            if len(read_train_dit_losses(out_dir)) >= 1:
                return os.path.join(out_dir, "ckpt_000000.safetensors")
        if all(p.poll() is not None for p in procs.values()):
            sys.exit("loss_curves.py: every train_dit run stopped before its first step (see its stdout.txt)")
        time.sleep(0.2)


def check_same_init(paths):
    # the same seed must give every train_dit run the same initial weights
    first = safetensors_np.load(paths[0])[0]
    for path in paths[1:]:
        other = safetensors_np.load(path)[0]
        if other.keys() != first.keys() or any(not np.array_equal(a, first[k]) for k, a in other.items()):
            sys.exit(f"loss_curves.py: {path} and {paths[0]} differ: the runs did not start from the same weights")


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
                    help="train_dit runs, comma-separated --attn kinds, each optionally +fp8 for --linear fp8 (+fp8all: "
                         "and --fp8-fast-accum all) (default: exact,sage on cpu; sage,bf16 on cuda)")
    ap.add_argument("--seeds", default="", help="comma-separated stream seeds for extra reference runs (spread)")
    ap.add_argument("--parallel", action="store_true",
                    help="all runs at once (a GPU that small models leave mostly idle); else one after another")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="seconds; runs still going then are stopped and the steps every run finished are used")
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
    ap.add_argument("--ema-decay", type=float, default=0.999)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--no-flip", action="store_true")
    ap.add_argument("--sample-every", type=int, default=0,
                    help="train_dit's sample grids (0: none); nonzero: also the reference's grid at the end")
    ap.add_argument("--samples-per-class", type=int, default=2)
    ap.add_argument("--smooth", type=int, default=50, help="window of the smoothed curves and the table")
    ap.add_argument("--train-dit", default=os.path.join(REPO, "train_dit"))
    ap.add_argument("--lib", default=os.path.join(REPO, "build", "libditc.so"))
    ap.add_argument("--replot", metavar="OUT", help="only redo the plot, table and sample panel from OUT")
    ap.add_argument("--worker", help=argparse.SUPPRESS)        # internal: one reference run, OUT/<worker>/
    ap.add_argument("--worker-seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replot:
        return replot(args.replot, args.smooth)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.train_dit, args.lib, args.out = (os.path.abspath(p) for p in (args.train_dit, args.lib, args.out))
    if args.worker:
        return reference_worker(args)
    attns = (args.attn or ("sage,bf16" if args.device == "cuda" else "exact,sage")).split(",")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if not os.path.exists(args.train_dit):
        sys.exit(f"loss_curves.py: {args.train_dit} not found: build it with `make train_dit`")
    load_library(args.lib)
    os.makedirs(args.out, exist_ok=True)
    deadline = time.time() + args.time_limit if args.time_limit else None

    ref_name, ref_tag = f"torch {args.dtype}", "torch"
    streams = [(ref_tag, ref_name, args.seed)] + [(f"torch_seed{s}", f"torch {args.dtype} seed {s}", s) for s in seeds]
    t_dirs = {f"train_dit {attn}": os.path.join(args.out, f"train_dit_{attn}") for attn in attns}
    t0 = time.time()
    if args.parallel:
        procs = {name: start_train_dit(args, attn, d) for (name, d), attn in zip(t_dirs.items(), attns)}
        init_path = wait_for_init(procs, t_dirs)
        for tag, name, seed in streams:
            procs[name] = start_reference(args, tag, seed, init_path)
        status = wait_all(procs, deadline)
    else:
        status = {}
        for (name, d), attn in zip(t_dirs.items(), attns):
            status.update(wait_all({name: start_train_dit(args, attn, d)}, deadline))
        init_path = wait_for_init({}, t_dirs)
        for tag, name, seed in streams:
            status.update(wait_all({name: start_reference(args, tag, seed, init_path)}, deadline))
    print(f"all runs done in {time.time() - t0:.1f} s", flush=True)
    check_same_init([os.path.join(d, "ckpt_000000.safetensors") for d in t_dirs.values()
                     if len(read_train_dit_losses(d)) >= 1])
    runs = {name: read_train_dit_losses(d) for name, d in t_dirs.items()}
    runs.update({name: read_reference_losses(os.path.join(args.out, tag)) for tag, name, _ in streams})
    notes = [f"{name}: exit status {s}" for name, s in status.items() if s not in (0, None)]
    runs = {name: loss for name, loss in runs.items() if len(loss)}
    steps = min(len(loss) for loss in runs.values())
    if steps < args.steps:
        notes.append(f"stopped after {steps} of {args.steps} steps (time limit or a failed run)")
    runs = {name: loss[:steps] for name, loss in runs.items()}
    if args.sample_every and status.get(ref_name) == 0:
        sample_reference(args, ref_tag)

    names = list(runs)
    lrs = learning_rates(args)
    with open(os.path.join(args.out, "loss_curves.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "lr"] + names)
        for k in range(steps):
            w.writerow([k + 1, f"{lrs[k]:.7g}"] + [f"{runs[n][k]:.9g}" for n in names])
    cfg = dit_ref.DiTConfig.from_metadata(safetensors_np.load(init_path)[1])
    tokens = (cfg.image_size // cfg.patch) ** 2
    title = (f"depth {cfg.depth} hidden {cfg.hidden} heads {cfg.heads} patch {cfg.patch}, {cfg.channels}x"
             f"{cfg.image_size}x{cfg.image_size} ({tokens} tokens), batch {args.batch}, "
             f"{os.path.basename(args.data.rstrip('/'))}, lr {args.lr:g}, {args.device}; torch {torch.__version__}")
    with open(os.path.join(args.out, "title.txt"), "w") as f:
        f.write(title + "\n" + "".join(n + "\n" for n in notes))
    return report(args.out, runs, ref_name if ref_name in runs else names[0],
                  [n for n in names if " seed " in n], args.smooth, title, notes)


def spread_summary(runs, ref_name, seed_names, window):
    """Lines comparing each train_dit run's deviation with the natural spread: the largest
    |smoothed difference| between any two reference runs on different streams (the reference and
    the seed runs), over the steps with a full window."""
    full = slice(window - 1, None)
    s = {name: smooth(loss, window)[full] for name, loss in runs.items()}
    torch_runs = [ref_name] + list(seed_names)
    lines = []
    if len(torch_runs) < 2 or ref_name not in s or len(s[ref_name]) == 0:
        return lines
    pairs = [(a, b) for i, a in enumerate(torch_runs) for b in torch_runs[i + 1:]]
    spread = max(np.max(np.abs(s[a] - s[b])) for a, b in pairs)
    finals = [s[n][-1] for n in torch_runs]
    lines.append(f"- seed-to-seed spread ({', '.join(torch_runs)}; different data/noise streams): largest "
                 f"|smoothed difference| {spread:.2e}; final smoothed losses {min(finals):.5f} .. {max(finals):.5f} "
                 f"(width {max(finals) - min(finals):.2e})")
    others = [n for n in runs if n.startswith("train_dit ")]
    for name in others:
        dev = np.max(np.abs(s[name] - s[ref_name]))
        line = f"- {name}: largest |smoothed − {ref_name}| {dev:.2e} = {dev / spread:.2g} × the spread"
        for exact in ("train_dit bf16", "train_dit exact"):   # sage against exact attention
            if name in ("train_dit sage", "train_dit sage+fp8", "train_dit sage+fp8all") and exact in s:
                dev_exact = np.max(np.abs(s[name] - s[exact]))
                line += f"; largest |smoothed − {exact}| {dev_exact:.2e} = {dev_exact / spread:.2g} × the spread"
        lines.append(line)
    return lines


def sample_panel(out, path):
    """Puts the final sample grids one above the other (train_dit runs, then the reference through
    train_dit's sampler) into one PNG when they exist; returns the names used."""
    grids = []
    for name in sorted(os.listdir(out)):
        folder = os.path.join(out, name)
        if name.startswith("train_dit_"):
            found = sorted(f for f in os.listdir(folder) if f.startswith("samples_") and f.endswith(".png"))
            if found:
                flags = " ".join(run_kind_flags(name[len("train_dit_"):]))
                grids.append((f"train_dit {flags}", os.path.join(folder, found[-1])))
    ref = os.path.join(out, "torch", "samples", "samples_000001.png")
    if os.path.exists(ref):
        grids.append(("PyTorch (EMA weights, train_dit's sampler)", ref))
    if len(grids) < 2:
        return []
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    images = [plt.imread(p) for _, p in grids]
    height, width = images[0].shape[:2]   # one grid per row: grids are wide (a column per class)
    fig, axes = plt.subplots(len(grids), 1, figsize=(9, len(grids) * (9 * height / width + 0.35)))
    for ax, (label, _), image in zip(axes, grids, images):
        ax.imshow(image, cmap="gray", interpolation="nearest")
        ax.set_title(label, fontsize=9)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [label for label, _ in grids]


def report(out, runs, ref_name, seed_names, window, title, notes=()):
    plot(os.path.join(out, "loss_curves.png"), runs, ref_name, seed_names, window, title)
    rows = summarize(runs, ref_name, window)
    table = format_table(rows, ref_name, window, len(runs[ref_name]))
    text = "\n".join([table, ""] + spread_summary(runs, ref_name, seed_names, window) + [f"- {n}" for n in notes])
    panel = sample_panel(out, os.path.join(out, "samples_side_by_side.png"))
    if panel:
        text += f"\n- samples_side_by_side.png: {', '.join(panel)}"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(f"{title}\n\n{text}\n")
    print(f"\n{title}\n{text}\nwrote {out}/loss_curves.csv, loss_curves.png, summary.md")
    return 0 if all(r[5] for r in rows) else 1


def replot(out, window):
    # the columns after step and lr: train_dit runs, the reference ("torch <dtype>"), seed runs
    with open(os.path.join(out, "loss_curves.csv")) as f:
        rows = list(csv.reader(f))
    names = rows[0][2:]
    runs = {n: np.array([float(r[2 + i]) for r in rows[1:]]) for i, n in enumerate(names)}
    ref_name = next(n for n in names if n.startswith("torch ") and " seed " not in n)
    with open(os.path.join(out, "title.txt")) as f:
        title, *notes = f.read().strip().splitlines()
    return report(out, runs, ref_name, [n for n in names if " seed " in n], window, title, notes)


if __name__ == "__main__":
    sys.exit(main())
