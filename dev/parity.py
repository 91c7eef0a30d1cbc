"""Parity of the C trainer with the PyTorch reference (dev/dit_ref.py), in fp32 on the CPU.

    python3 dev/parity.py                 # runs ./train_dit --dump-parity into a temp file, checks it
    python3 dev/parity.py --gpu           # train_dit on the GPU (bf16, --attn bf16) against the
                                          # reference in fp32 on the GPU, bf16 tolerances, 10 steps
    python3 dev/parity.py --file F        # checks an existing dump
    python3 dev/parity.py --plant-bug B   # the same with a bug planted in the reference: must fail
    python3 dev/parity.py --write-reference F [--init random]   # a dump made by the reference itself

The dump (safetensors, see dev/notes_parity.md) holds the initial weights `params.<name>`, the
inputs of every step `batch.{x0,labels,t,noise}`, the step-1 output, loss and gradients
`step1.{out,loss,grad.<name>}`, and `losses`, `grad_norms`, `lrs` of every step. The check loads the
weights (strict), recomputes step 1 and compares every tensor (‖c − ref‖ / ‖ref‖ ≤ 1e-4), then
trains all steps with AdamW at the file's per-step rates and compares each step's loss and
gradient norm. Any further `step<k>.{out,loss,grad.<name>}` and `final.params.<name>` in the file
are checked as well; a tensor parity.py does not know is an error. Exit status 1 on any failure.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dit_ref  # noqa: E402
import safetensors_np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-4          # fp32 against fp32 (the CPU run)
# train_dit on the GPU computes in bf16 (activations, weight copies; fp32 accumulation and master
# weights) against the fp32 reference: about 2x the errors test_dit_gpu_cuda measures (output
# 5.9e-3, worst gradient tensor 8.1e-3, loss 3e-4; each step's loss then drifts a little further).
GPU_TOLERANCE = {"tensor": 3e-2, "step": 1e-2}
META_INT = ("depth", "hidden", "heads", "patch", "image_size", "channels", "num_classes", "steps", "batch")
META_FLOAT = ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip")


# ---- planted bugs: each one a mistake the check must catch -----------------------------------
def _block_without_gate(self, x, c):
    shift_msa, scale_msa, _, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
    x = x + self.attn(dit_ref.modulate(self.norm1(x), shift_msa, scale_msa))
    return x + gate_mlp.unsqueeze(1) * self.mlp(dit_ref.modulate(self.norm2(x), shift_mlp, scale_mlp))


def _make_optimizer_decay_all(model, lr, betas, eps, weight_decay):
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


BUGS = {
    "gate": ("attention residual without gate_msa",
             lambda: setattr(dit_ref.DiTBlock, "forward", _block_without_gate)),
    "scale": ("modulate(x) = x*scale + shift instead of x*(1+scale) + shift",
              lambda: setattr(dit_ref, "modulate", lambda x, shift, scale: x * scale.unsqueeze(1) + shift.unsqueeze(1))),
    "gelu": ("exact erf GELU instead of the tanh approximation",
             lambda: setattr(dit_ref.Mlp, "forward", lambda self, x: self.fc2(F.gelu(self.fc1(x))))),
    "time": ("timestep features of t instead of 1000 t",
             lambda: setattr(dit_ref, "timestep_features",
                             lambda t, dim: _timestep_features(t / 1000.0, dim))),
    "pos": ("pos_embed halves swapped (gy first instead of DiT's gx first)", None),
    "decay": ("weight decay on every parameter (biases too)",
              lambda: setattr(dit_ref, "make_optimizer", _make_optimizer_decay_all)),
}
_timestep_features = dit_ref.timestep_features


def plant_bug_in_model(bug, model):
    if bug == "pos":
        half = model.cfg.hidden // 2
        model.pos_embed = torch.cat([model.pos_embed[..., half:], model.pos_embed[..., :half]], dim=-1)


# ---- comparison ------------------------------------------------------------------------------
class Report:
    """Collects rows of (name, max |c - ref|, ‖c - ref‖ / ‖ref‖, ok) and prints them llm.c-style."""

    def __init__(self, tolerance=TOLERANCE):
        self.failures = []
        self.zero_refs = []
        self.compared = 0
        self.tolerance = tolerance

    def compare(self, name, c, ref):
        c, ref = torch.from_numpy(np.asarray(c, dtype=np.float32)), ref.detach().float().cpu()
        if c.shape != ref.shape:
            print(f"{name:<52} shape {tuple(c.shape)} in the file, {tuple(ref.shape)} in the reference  NOT OK")
            self.failures.append(name)
            return
        self.compared += 1
        diff = c.double() - ref.double()
        ref_norm = ref.double().norm().item()
        if ref_norm > 0:
            rel = diff.norm().item() / ref_norm
        else:
            rel = 0.0 if diff.norm().item() == 0 else float("inf")
            self.zero_refs.append(name)
        ok = rel <= self.tolerance  # False for NaN
        max_abs = diff.abs().max().item() if diff.numel() else 0.0
        note = "  (both zero)" if ref_norm == 0 and ok else ""
        print(f"{name:<52} {max_abs:11.3e} {rel:11.3e}  {'OK' if ok else 'NOT OK'}{note}")
        if not ok:
            self.failures.append(name)

    def fail(self, message):
        print(f"NOT OK: {message}")
        self.failures.append(message)


def compare_qkv_bias(report, name, c, ref):
    # The key bias cannot change the output: q.(k + b) = q.k + q.b shifts every score of a query
    # by the same amount, and softmax ignores that. Its gradient is zero up to rounding (~1e-11),
    # which AdamW amplifies into updates that differ between implementations, so after training
    # only the query and value thirds are comparable; the key third is shown, not judged.
    h = ref.shape[0] // 3
    keep = np.r_[0:h, 2 * h:3 * h]
    report.compare(name + "[q,v]", np.asarray(c)[keep], ref.detach()[torch.from_numpy(keep)])
    k_diff = np.abs(np.asarray(c)[h:2 * h] - ref.detach().cpu().numpy()[h:2 * h]).max()
    print(f"{name + '[k]':<52} {k_diff:11.3e} {'':>11}  not judged: no effect on the output")


def header(title):
    print(f"\n{title}\n{'name':<52} {'max|diff|':>11} {'rel err':>11}")


# ---- the check -------------------------------------------------------------------------------
def load_reference(tensors, meta, report, bug, device):
    cfg = dit_ref.DiTConfig.from_metadata(meta)
    torch.manual_seed(0)
    model = dit_ref.DiT(cfg, use_sdpa=device != "cpu").to(device)
    if bug:
        plant_bug_in_model(bug, model)
    params = dict(model.named_parameters())
    in_file = {k[len("params."):] for k in tensors if k.startswith("params.")}
    for name in sorted(set(params) - in_file):
        report.fail(f"params.{name} missing from the file (reference shape {tuple(params[name].shape)})")
    for name in sorted(in_file - set(params)):
        report.fail(f"params.{name} in the file is not a parameter of the reference")
    with torch.no_grad():
        for name in sorted(in_file & set(params)):
            a = tensors["params." + name]
            if a.dtype != np.float32 or tuple(a.shape) != tuple(params[name].shape):
                report.fail(f"params.{name}: {a.dtype} {tuple(a.shape)} in the file, "
                            f"float32 {tuple(params[name].shape)} expected")
                continue
            params[name].copy_(torch.from_numpy(a).to(device))
    return cfg, model


def check_dump(path, bug=None, device="cpu"):
    """Returns the number of failures (0 = parity). device "cuda": the reference runs there in fp32
    and the file (train_dit on the GPU, bf16) is judged with GPU_TOLERANCE; the final parameters are
    shown, not judged (AdamW's normalized updates of near-zero gradients amplify bf16 rounding)."""
    tensors, meta = safetensors_np.load(path)
    tol = TOLERANCE if device == "cpu" else GPU_TOLERANCE["tensor"]
    step_tol = TOLERANCE if device == "cpu" else GPU_TOLERANCE["step"]
    report = Report(tol)
    missing = [k for k in META_INT + META_FLOAT if k not in meta]
    if missing:
        print(f"NOT OK: {path}: __metadata__ lacks {', '.join(missing)}")
        return 1
    steps, B = int(meta["steps"]), int(meta["batch"])
    hp = {k: float(meta[k]) for k in META_FLOAT}
    cfg, model = load_reference(tensors, meta, report, bug, device)
    S, C = cfg.image_size, cfg.channels
    print(f"{path}: depth {cfg.depth} hidden {cfg.hidden} heads {cfg.heads} patch {cfg.patch} "
          f"image {S} channels {C} classes {cfg.num_classes} | batch {B} steps {steps} | lr {hp['lr']:g} "
          f"betas ({hp['beta1']:g}, {hp['beta2']:g}) eps {hp['eps']:g} wd {hp['weight_decay']:g} "
          f"clip {hp['grad_clip']:g} | {sum(p.numel() for p in model.parameters())} parameters")
    if bug:
        print(f"PLANTED BUG '{bug}': {BUGS[bug][0]}")

    expected = {"batch.x0": ((steps, B, C, S, S), np.float32), "batch.noise": ((steps, B, C, S, S), np.float32),
                "batch.t": ((steps, B), np.float32), "batch.labels": ((steps, B), np.int32),
                "losses": ((steps,), np.float32), "grad_norms": ((steps,), np.float32)}
    for name, (shape, dtype) in expected.items():
        if name not in tensors or tensors[name].shape != shape or tensors[name].dtype != dtype:
            got = f"{tensors[name].dtype} {tensors[name].shape}" if name in tensors else "absent"
            report.fail(f"{name}: {np.dtype(dtype).name} {shape} expected, {got} in the file")
    lrs = tensors["lrs"] if "lrs" in tensors else np.full(steps, hp["lr"], dtype=np.float32)
    if lrs.shape != (steps,):
        report.fail(f"lrs: ({steps},) expected, {lrs.shape} in the file")
    known = re.compile(r"(params\.|final\.params\.|step\d+\.|batch\.(x0|noise|t|labels)$|(losses|grad_norms|lrs)$)")
    for name in sorted(tensors):
        if not known.match(name):
            report.fail(f"{name} in the file is unknown to parity.py, so it would go unchecked")
    if report.failures:
        print(f"\nPARITY FAILED: {len(report.failures)} problems with the file itself")
        return len(report.failures)
    labels = tensors["batch.labels"]
    if labels.min() < 0 or labels.max() > cfg.num_classes:
        report.fail(f"batch.labels outside [0, {cfg.num_classes}]: min {labels.min()} max {labels.max()}")
        return len(report.failures)

    # every step<k>.* in the file, by step
    step_checks = {}
    for name in tensors:
        m = re.match(r"step(\d+)\.(.+)$", name)
        if m:
            step_checks.setdefault(int(m.group(1)), []).append(m.group(2))
    if 1 not in step_checks:
        report.fail("the file holds no step1.* tensors")
    params = dict(model.named_parameters())
    optimizer = dit_ref.make_optimizer(model, hp["lr"], (hp["beta1"], hp["beta2"]), hp["eps"], hp["weight_decay"])
    losses, norms = [], []
    for k in range(steps):
        x0, noise, t = (torch.from_numpy(tensors[n][k]).to(device) for n in ("batch.x0", "batch.noise", "batch.t"))
        y = torch.from_numpy(labels[k].astype(np.int64)).to(device)
        loss, out = dit_ref.forward_backward(model, x0, t, y, noise)
        if k + 1 in step_checks:
            header(f"step {k + 1}: output, loss and gradients before clipping (tolerance {tol:g})")
            for key in sorted(step_checks[k + 1], key=lambda s: (s.startswith("grad."), s)):
                name = f"step{k + 1}.{key}"
                if key == "out":
                    report.compare(name, tensors[name], out)
                elif key == "loss":
                    report.compare(name, tensors[name], loss.reshape(1))
                elif key.startswith("grad.") and key[5:] in params:
                    g = params[key[5:]].grad
                    report.compare(name, tensors[name], g if g is not None else torch.zeros_like(params[key[5:]]))
                else:
                    report.fail(f"{name} in the file is not something the reference computes")
            for pname in params:
                if f"grad.{pname}" not in step_checks[k + 1]:
                    report.fail(f"step{k + 1}.grad.{pname} missing from the file")
            if "out" not in step_checks[k + 1] or "loss" not in step_checks[k + 1]:
                report.fail(f"step{k + 1}.out or step{k + 1}.loss missing from the file")
        for group in optimizer.param_groups:
            group["lr"] = float(lrs[k])
        norms.append(dit_ref.clip_and_step(model, optimizer, hp["grad_clip"]).item())
        losses.append(loss.item())

    print(f"\nevery step: loss and gradient norm before clipping (tolerance {step_tol:g} relative)")
    print(f"{'step':>4} {'lr':>9} {'loss C':>14} {'loss ref':>14} {'rel err':>10} {'norm C':>12} {'norm ref':>12} {'rel err':>10}")
    for k in range(steps):
        lc, lr_ = float(tensors["losses"][k]), losses[k]
        nc, nr = float(tensors["grad_norms"][k]), norms[k]
        el = abs(lc - lr_) / abs(lr_) if lr_ != 0 else abs(lc)
        en = abs(nc - nr) / abs(nr) if nr != 0 else abs(nc)
        ok = el <= step_tol and en <= step_tol
        print(f"{k + 1:>4} {lrs[k]:9.2e} {lc:14.8f} {lr_:14.8f} {el:10.2e} {nc:12.6f} {nr:12.6f} {en:10.2e}  {'OK' if ok else 'NOT OK'}")
        if not ok:
            report.failures.append(f"step {k + 1} loss/grad norm")

    final = sorted(k for k in tensors if k.startswith("final.params."))
    if final and device != "cpu":
        header(f"parameters after {steps} steps (shown, not judged on the GPU)")
        for name in final:
            pname = name[len("final.params."):]
            if pname in params:
                Report(float("inf")).compare(name, tensors[name], params[pname])
        final = []
    if final:
        header(f"parameters after {steps} steps (tolerance {tol:g})")
        for name in final:
            pname = name[len("final.params."):]
            if pname not in params:
                report.fail(f"{name} in the file is not a parameter of the reference")
            elif pname.endswith("attn.qkv.bias"):
                compare_qkv_bias(report, name, tensors[name], params[pname])
            else:
                report.compare(name, tensors[name], params[pname])

    for k in sorted(step_checks):
        zero = [n for n in report.zero_refs if n.startswith(f"step{k}.grad.")]
        if zero:
            print(f"\nnote: {len(zero)} of {len(params)} step-{k} gradients are exactly zero in the reference "
                  f"(DiT's zero init of adaLN and the final layer): they are covered by the later steps "
                  f"(losses, gradient norms{', later gradients' if max(step_checks) > k else ''}"
                  f"{', final parameters' if final else ''}).")
    if report.failures:
        print(f"\nPARITY FAILED: {len(report.failures)} of the checks above are NOT OK: "
              + ", ".join(report.failures[:8]) + (" ..." if len(report.failures) > 8 else ""))
    else:
        print(f"\nPARITY OK: {report.compared} tensors within {tol:g} and {steps} steps of loss and gradient "
              f"norm within {step_tol:g}")
    return len(report.failures)


# ---- a dump made by the reference itself (tests this script; shows the format) --------------
def write_reference(path, init, steps):
    cfg = dit_ref.DiTConfig(image_size=8, channels=3, patch=2, hidden=64, depth=2, heads=4, num_classes=10)
    B = 4
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)
    torch.manual_seed(1234)
    model = dit_ref.DiT(cfg)
    if init == "random":
        dit_ref.randomize_zero_init(model, 0.02)
    out = {f"params.{n}": p.detach().numpy().copy() for n, p in model.named_parameters()}
    rng = np.random.default_rng(1234)
    shape = (steps, B, cfg.channels, cfg.image_size, cfg.image_size)
    batch = {"batch.x0": rng.standard_normal(shape, dtype=np.float32),
             "batch.noise": rng.standard_normal(shape, dtype=np.float32),
             "batch.t": rng.random((steps, B), dtype=np.float32),
             "batch.labels": rng.integers(0, cfg.num_classes + 1, (steps, B)).astype(np.int32)}
    out.update(batch)
    optimizer = dit_ref.make_optimizer(model, hp["lr"], (hp["beta1"], hp["beta2"]), hp["eps"], hp["weight_decay"])
    losses, norms = [], []
    for k in range(steps):
        x0, noise, t = (torch.from_numpy(batch[n][k]) for n in ("batch.x0", "batch.noise", "batch.t"))
        y = torch.from_numpy(batch["batch.labels"][k].astype(np.int64))
        loss, o = dit_ref.forward_backward(model, x0, t, y, noise)
        if k in (0, steps - 1):
            out[f"step{k + 1}.out"] = o.numpy().copy()
            out[f"step{k + 1}.loss"] = loss.reshape(1).numpy().copy()
            for n, p in model.named_parameters():
                out[f"step{k + 1}.grad.{n}"] = p.grad.numpy().copy()
        losses.append(loss.item())
        norms.append(dit_ref.clip_and_step(model, optimizer, hp["grad_clip"]).item())
    out.update({f"final.params.{n}": p.detach().numpy().copy() for n, p in model.named_parameters()})
    out["lrs"] = np.full(steps, hp["lr"], dtype=np.float32)
    out["losses"] = np.array(losses, dtype=np.float32)
    out["grad_norms"] = np.array(norms, dtype=np.float32)
    meta = dict(depth=cfg.depth, hidden=cfg.hidden, heads=cfg.heads, patch=cfg.patch, image_size=cfg.image_size,
                channels=cfg.channels, num_classes=cfg.num_classes, steps=steps, batch=B, **hp)
    safetensors_np.save(path, out, {k: repr(v) if isinstance(v, float) else str(v) for k, v in meta.items()})
    print(f"wrote {path}: reference dump, {init} init, {steps} steps, final loss {losses[-1]:.6f}")


def run_train_dit(exe, path, steps, batch, grad_clip, gpu):
    if not os.path.exists(exe):
        sys.exit(f"parity.py: {exe} not found: build it first (make train_dit), or pass --file")
    # A short warmup (the reference replays the file's per-step `lrs`), then lr and weight decay
    # large enough that 20 steps move the zero-initialized layers and the decay groups far
    # beyond rounding. grad_clip 1 is above this run's gradient norms; `--grad-clip 0.5` makes
    # clipping act on every step (make test runs both; with clipping, fp32 rounding differences
    # that Adam amplifies in parameters whose gradients are near zero reach 2-4e-4 in the final
    # weights after 20 steps, so that run stops at 12 steps, where everything agrees within 1e-4).
    out_dir = os.path.join(os.path.dirname(path), "out")
    cmd = [exe, "--model", "tiny", "--data", "synthetic", "--attn", "bf16" if gpu else "exact",
           "--device", "gpu" if gpu else "cpu",
           "--steps", str(steps), "--batch", str(batch), "--lr", "1e-3", "--weight-decay", "0.1",
           "--warmup", "5", "--grad-clip", str(grad_clip), "--ckpt-every", "0", "--sample-every", "0", "--out", out_dir,
           "--dump-parity", path]
    print("$", " ".join(cmd), flush=True)
    run = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if run.returncode != 0 or not os.path.exists(path):
        print(run.stdout[-4000:])
        sys.exit(f"parity.py: {' '.join(cmd)} failed with status {run.returncode}")
    print("\n".join(run.stdout.splitlines()[-3:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", help="check this dump instead of running train_dit")
    ap.add_argument("--train-dit", default=os.path.join(REPO, "train_dit"), help="the trainer to run")
    ap.add_argument("--gpu", action="store_true",
                    help="train_dit on the GPU (bf16, --attn bf16), the reference in fp32 on the GPU")
    ap.add_argument("--steps", type=int, help="default 20 (CPU), 10 (--gpu)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="train_dit's --grad-clip")
    ap.add_argument("--plant-bug", choices=sorted(BUGS), help="break the reference on purpose: the check must fail")
    ap.add_argument("--write-reference", metavar="FILE", help="write a dump made by the reference and exit")
    ap.add_argument("--init", choices=("dit", "random"), default="dit",
                    help="for --write-reference: DiT's zero init, or random adaLN/final layer (all gradients nonzero)")
    args = ap.parse_args()

    torch.set_default_dtype(torch.float32)
    device = "cuda" if args.gpu else "cpu"
    steps = args.steps or (10 if args.gpu else 20)
    if args.gpu:   # the reference in true fp32 (no TF32) so that the errors measured are train_dit's
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.use_deterministic_algorithms(True)
    if args.write_reference:
        write_reference(args.write_reference, args.init, steps)
        return 0
    if args.plant_bug and BUGS[args.plant_bug][1]:
        BUGS[args.plant_bug][1]()
    if args.file:
        return 1 if check_dump(args.file, args.plant_bug, device) else 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "parity.safetensors")
        run_train_dit(args.train_dit, path, steps, args.batch, args.grad_clip, args.gpu)
        return 1 if check_dump(path, args.plant_bug, device) else 0


if __name__ == "__main__":
    sys.exit(main())
