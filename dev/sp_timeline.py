"""Where the time of one training step goes on each rank, from the per-process timelines that
dev/sp_trace.c writes (CUPTI kernels, memcpys, memsets, CUDA API calls; NCCL launches seen from
the host), and how a 2-GPU step differs from half of a 1-GPU step, line by line.

    python3 dev/sp_timeline.py --run 1gpu=DIR [--run ulysses2=DIR --run ring2=DIR ...] [--skip 3]
    python3 dev/sp_timeline.py --self-test

DIR holds trace.rank<r>.<pid>.tsv (one file per process; files without kernels, such as the
launcher's, are ignored). The first run is the reference: its step time / world size of the
other run is the ideal, and every line of the account is (this run's time) - (reference / 2).

Steps: a step ends with the 4-byte device-to-host copy of the gradient norm (the first such copy
after an adamw_kernel, which also updates the EMA). The first --skip steps are warm-up; the rest are averaged.

Every nanosecond of a step is given to exactly one line (so the lines sum to the step time): where
a compute kernel runs, to its category (attention, GEMM, head split/merge, rest); else where a
device copy (memcpy D2D, the all-to-all's pack and unpack) runs, to "copies"; else where an NCCL
kernel runs, to its communication category (exposed communication); else memsets, host copies;
else "idle". Phases: forward (to the loss kernel), backward (to the gradient all-reduce), reduce
(to the optimizer's first kernel, norm_partial_kernel), update (the rest of the step).
Communication is also reported whole: kernel time per category, how much of it ran under compute
(overlap), bytes sent per rank (from the NCCL launch records) and the rate they imply. An NCCL
kernel's time includes waiting for the peer, so kernel time / bytes is a lower bound on the wire
rate, not the wire rate.

Idle time is split into gaps (intervals with nothing on the GPU): each gap is charged to the pair
(kernel before -> kernel after) and called "host" when the next work was launched by the host
after the GPU went idle (the host was late: the API calls it was in are listed) or "device"
when it had been launched in time (a wait on another stream or on the peer).
Numpy only.
"""
import argparse
import bisect
import glob
import os
import re
import sys
from collections import defaultdict

import numpy as np

COMPUTE = ("attention", "gemm", "heads", "rest")
COPY = ("copy D2D",)
COMM = ("ulysses all-to-all", "ring send/recv", "grad all-reduce", "comm other")
LOW = ("memset", "copy host")
CLASSES = COMPUTE + COPY + COMM + LOW        # exclusive attribution: the first active one wins
PHASES = ("forward", "backward", "reduce", "update")
LABEL = {"attention": "attention kernels", "gemm": "GEMM (cuBLAS)", "heads": "head split/merge (split_qkv...)",
         "rest": "rest (norms, elementwise, optimizer)", "copy D2D": "copies D2D (a2a pack/unpack, shards)",
         "ulysses all-to-all": "Ulysses all-to-all, exposed", "ring send/recv": "ring send/recv, exposed",
         "grad all-reduce": "gradient all-reduce, exposed", "comm other": "other NCCL (loss, stats, gather), exposed",
         "memset": "memsets", "copy host": "host<->device copies", "idle": "GPU idle"}


def short_name(name):
    """'void ns::foo<4>(float*, int)' -> 'foo'."""
    depth, out = 0, []
    for ch in name:
        if ch == "(" and depth == 0:
            break
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).split()[-1].split("::")[-1] if "".join(out).split() else name


def kernel_class(short):
    n = short.lower()
    if n.startswith("nccl"):
        return "comm"
    if any(s in n for s in ("sage", "flash", "attention", "ring_merge", "bf16_to_f32", "divide_kernel",
                            "accumulate_kernel", "hadamard")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "splitkreduce")):
        return "gemm"
    if any(s in n for s in ("split_qkv", "merge_qkv", "merge_heads", "split_heads")):
        return "heads"
    return "rest"


class Trace:
    """One process's records. GPU records: arrays start, end, stream, corr, cls (index into
    CLASSES), name (short), bytes, plus per NCCL kernel its launch (index into self.nccl)."""

    def __init__(self, path):
        self.path, self.rank, self.dropped = path, "x", 0
        gpu, api, api_list, nccl = [], {}, [], []
        for line in open(path, errors="replace"):
            f = line.rstrip("\n").split("\t")
            if line.startswith("#"):
                m = re.search(r"rank (\S+) pid \d+ dropped (\d+)", line)
                if m:
                    self.rank, self.dropped = m[1], int(m[2])
            elif f[0] == "K":
                gpu.append((int(f[1]), int(f[2]), int(f[3]), int(f[4]), "K", short_name(f[5]), 0, 0))
            elif f[0] == "M":
                gpu.append((int(f[1]), int(f[2]), int(f[3]), int(f[4]), "M", "memcpy", int(f[5]), int(f[6])))
            elif f[0] == "S":
                gpu.append((int(f[1]), int(f[2]), int(f[3]), int(f[4]), "S", "memset", int(f[5]), 0))
            elif f[0] in ("R", "D"):
                api[int(f[3])] = (int(f[1]), int(f[2]), int(f[4]), f[5])
                api_list.append((int(f[1]), int(f[2]), int(f[4]), f[5]))
            elif f[0] == "N":
                nccl.append((int(f[1]), int(f[2]), int(f[3]), f[4], int(f[5]), int(f[6]), int(f[7]), int(f[8])))
        gpu.sort()
        self.n_kernels = sum(1 for g in gpu if g[4] == "K")
        self.start = np.array([g[0] for g in gpu], dtype=np.int64)
        self.end = np.array([g[1] for g in gpu], dtype=np.int64)
        self.stream = np.array([g[2] for g in gpu], dtype=np.int64)
        self.corr = np.array([g[3] for g in gpu], dtype=np.int64)
        copy = {1: "memcpy HtoD", 2: "memcpy DtoH", 8: "memcpy DtoD", 10: "memcpy PtoP"}
        self.name = [g[5] if g[4] == "K" else (copy.get(g[7], f"memcpy kind {g[7]}") if g[4] == "M" else "memset")
                     for g in gpu]
        self.api = api
        api_list.sort()
        self.api_start = np.array([a[0] for a in api_list], dtype=np.int64)
        self.api_end = np.array([a[1] for a in api_list], dtype=np.int64)
        self.api_name = [a[3] for a in api_list]
        self.nccl = sorted(nccl)
        counts = defaultdict(int)
        for g in gpu:
            if g[4] == "K":
                counts[g[2]] += 1
        self.main_stream = max(counts, key=counts.get) if counts else -1
        self.launch = np.full(len(gpu), -1, dtype=np.int64)
        self._match_nccl(gpu)
        self.cls = np.array([self._classify(i, g) for i, g in enumerate(gpu)], dtype=np.int64)

    def launch_time(self, i):
        a = self.api.get(int(self.corr[i]))
        return a[0] if a else None

    def _match_nccl(self, gpu):
        """Each NCCL kernel belongs to the latest NCCL launch on its stream whose host call started
        before the kernel's launch API call (or, without that call, before the kernel)."""
        by_stream = defaultdict(lambda: ([], []))
        for j, n in enumerate(self.nccl):
            by_stream[n[2]][0].append(n[0])
            by_stream[n[2]][1].append(j)
        self.unmatched_nccl = 0
        for i, g in enumerate(gpu):
            if g[4] != "K" or not g[5].lower().startswith("nccl"):
                continue
            t = self.launch_time(i)
            t = g[0] if t is None else t
            starts, ids = by_stream.get(g[2], ([], []))
            k = bisect.bisect_right(starts, t) - 1
            if k >= 0:
                self.launch[i] = ids[k]
            else:
                self.unmatched_nccl += 1

    def _classify(self, i, g):
        kind, short = g[4], g[5]
        if kind == "S":
            return CLASSES.index("memset")
        if kind == "M":
            return CLASSES.index("copy D2D") if g[7] in (8, 10) else CLASSES.index("copy host")
        c = kernel_class(short)
        if c != "comm":
            return CLASSES.index(c)
        j = self.launch[i]
        if j < 0:
            return CLASSES.index("comm other")
        _, _, stream, ops, sent, recvd, payload, _ = self.nccl[j]
        if "AllReduce" in ops and payload >= 4 << 20:
            return CLASSES.index("grad all-reduce")
        if "Send" in ops or "Recv" in ops:
            return CLASSES.index("ulysses all-to-all" if stream == self.main_stream else "ring send/recv")
        return CLASSES.index("comm other")

    def steps(self):
        """[(start, end)] of every step: from the end of one gradient-norm read to the next."""
        bounds, armed = [], False
        for i in range(len(self.start)):
            if self.name[i] == "adamw_kernel":
                armed = True
            elif armed and self.name[i] == "memcpy DtoH":
                bounds.append(int(self.end[i]))
                armed = False
        first = int(self.start[0]) if len(self.start) else 0
        return list(zip([first] + bounds[:-1], bounds))


def first_start(tr, lo, hi, pred):
    idx = np.nonzero((tr.start >= lo) & (tr.start < hi))[0]
    for i in idx:
        if pred(i):
            return int(tr.start[i])
    return None


def analyze_step(tr, lo, hi):
    """Exclusive ns per (phase, class or 'idle'), communication totals, overlap and the idle gaps
    of the step [lo, hi)."""
    sel = np.nonzero((tr.end > lo) & (tr.start < hi))[0]
    s, e, c = np.clip(tr.start[sel], lo, hi), np.clip(tr.end[sel], lo, hi), tr.cls[sel]
    cuts = np.unique(np.concatenate([s, e, [lo, hi]]))
    seg = np.diff(cuts)
    active = np.zeros((len(CLASSES), len(seg)), dtype=bool)
    for k in range(len(CLASSES)):
        m = c == k
        if not m.any():
            continue
        d = np.zeros(len(cuts) + 1, dtype=np.int64)
        np.add.at(d, np.searchsorted(cuts, s[m]), 1)
        np.add.at(d, np.searchsorted(cuts, e[m]), -1)
        active[k] = np.cumsum(d)[:len(seg)] > 0
    owner = np.full(len(seg), len(CLASSES), dtype=np.int64)   # len(CLASSES) = idle
    for k in reversed(range(len(CLASSES))):
        owner[active[k]] = k
    # phase boundaries
    is_grad_ar = lambda i: tr.cls[i] == CLASSES.index("grad all-reduce")
    loss = first_start(tr, lo, hi, lambda i: tr.name[i] == "mse_partial_kernel")
    update = first_start(tr, lo, hi, lambda i: tr.name[i] == "norm_partial_kernel")
    reduce = first_start(tr, lo, hi, is_grad_ar)
    loss = lo if loss is None else loss
    update = hi if update is None else update
    reduce = update if reduce is None or reduce > update else reduce
    bounds = np.array([lo, loss, reduce, update])
    phase = np.searchsorted(bounds, cuts[:-1], side="right") - 1
    out = defaultdict(float)
    for p in range(len(PHASES)):
        for k in range(len(CLASSES) + 1):
            m = (phase == p) & (owner == k)
            if m.any():
                out[(PHASES[p], (CLASSES + ("idle",))[k])] += float(seg[m].sum())
    comp_any = active[:len(COMPUTE)].any(axis=0)
    comm = {}
    for name in COMM:
        k = CLASSES.index(name)
        m = c == k
        launches = set(int(j) for j in tr.launch[sel][m] if j >= 0)
        sent = sum(tr.nccl[j][4] for j in launches)
        payload = sum(tr.nccl[j][6] for j in launches)
        comm[name] = dict(kernel=float((e[m] - s[m]).sum()), union=float(seg[active[k]].sum()),
                          hidden=float(seg[active[k] & comp_any].sum()), count=int(m.sum()),
                          sent=sent, payload=payload)
    gaps = idle_gaps(tr, cuts, seg, owner == len(CLASSES), lo, hi)
    return out, comm, gaps, hi - lo


def idle_gaps(tr, cuts, seg, idle, lo, hi):
    """[(ns, before, after, host_late_ns, host calls)] of each maximal idle interval."""
    gaps, i, n = [], 0, len(seg)
    in_step = np.nonzero((tr.api_end > lo) & (tr.api_start < hi))[0]
    a0, a1 = tr.api_start[in_step], tr.api_end[in_step]
    ends_sorted = np.argsort(tr.end, kind="stable")
    ends = tr.end[ends_sorted]
    while i < n:
        if not idle[i]:
            i += 1
            continue
        j = i
        while j + 1 < n and idle[j + 1]:
            j += 1
        g0, g1 = int(cuts[i]), int(cuts[j + 1])
        p = np.searchsorted(ends, g0, side="right") - 1
        before = tr.name[ends_sorted[p]] if p >= 0 else "(start)"
        q = np.searchsorted(tr.start, g1, side="left")
        after, late, calls = "(end)", 0, {}
        if q < len(tr.start):
            after = tr.name[q]
            launch = tr.launch_time(q)
            if launch is not None and launch > g0:
                late = min(launch, g1) - g0
                for k in np.nonzero((a1 > g0) & (a0 < launch))[0]:
                    nm = tr.api_name[in_step[k]]
                    calls[nm] = calls.get(nm, 0) + int(min(a1[k], launch) - max(a0[k], g0))
        gaps.append((g1 - g0, before, after, late, calls))
        i = j + 1
    return gaps


def analyze(tr, skip):
    """Means over the steps after the first `skip`."""
    steps = tr.steps()[skip:]
    if not steps:
        return None
    acc, comm_acc, gap_acc, total = defaultdict(float), defaultdict(lambda: defaultdict(float)), defaultdict(lambda: [0, 0.0, 0.0, defaultdict(float)]), 0.0
    for lo, hi in steps:
        out, comm, gaps, span = analyze_step(tr, lo, hi)
        total += span
        for k, v in out.items():
            acc[k] += v
        for name, d in comm.items():
            for k, v in d.items():
                comm_acc[name][k] += v
        for ns, before, after, late, calls in gaps:
            g = gap_acc[(before, after)]
            g[0] += 1; g[1] += ns; g[2] += late
            for nm, t in calls.items():
                g[3][nm] += t
    n = len(steps)
    return dict(n=n, step=total / n, lines={k: v / n for k, v in acc.items()},
                comm={k: {kk: vv / n for kk, vv in d.items()} for k, d in comm_acc.items()},
                gaps={k: (g[0] / n, g[1] / n, g[2] / n, {nm: t / n for nm, t in g[3].items()}) for k, g in gap_acc.items()},
                step_ms=[(hi - lo) / 1e6 for lo, hi in steps])


def load_run(d):
    traces = []
    for p in sorted(glob.glob(os.path.join(d, "trace.rank*.tsv"))):
        t = Trace(p)
        if t.n_kernels:
            traces.append(t)
    return traces


def ms(ns):
    return ns / 1e6


def line_total(a, cls):
    return sum(v for (p, c), v in a["lines"].items() if c == cls)


def report_rank(label, tr, a):
    print(f"\n## {label}, rank {tr.rank} ({os.path.basename(tr.path)}): {a['n']} steps, "
          f"mean {ms(a['step']):.2f} ms/step (each: {', '.join(f'{x:.1f}' for x in a['step_ms'])})")
    if tr.dropped or tr.unmatched_nccl:
        print(f"WARNING: {tr.dropped} CUPTI records dropped, {tr.unmatched_nccl} NCCL kernels without a launch record")
    print("| ms per step (exclusive) | " + " | ".join(PHASES) + " | total |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    for cls in CLASSES + ("idle",):
        row = [a["lines"].get((p, cls), 0.0) for p in PHASES]
        if sum(row) == 0:
            continue
        print(f"| {LABEL[cls]} | " + " | ".join(f"{ms(x):.2f}" for x in row) + f" | {ms(sum(row)):.2f} |")
    col = [sum(v for (p, c), v in a["lines"].items() if p == ph) for ph in PHASES]
    print("| step | " + " | ".join(f"{ms(x):.2f}" for x in col) + f" | {ms(sum(col)):.2f} |")
    print("\ncommunication per step: kernels, kernel ms, of which under compute, bytes sent to other ranks "
          "(collectives: payload), sent/kernel time")
    for name, d in a["comm"].items():
        if d["count"] == 0:
            continue
        b = d["sent"] if d["sent"] else d["payload"]
        rate = b / d["kernel"] if d["kernel"] else 0.0     # bytes/ns = GB/s
        print(f"  {name:20s} {d['count']:6.1f} kernels  {ms(d['kernel']):7.2f} ms  (busy {ms(d['union']):.2f}, "
              f"hidden {ms(d['hidden']):.2f} = {100 * d['hidden'] / max(d['union'], 1):.0f}%)  "
              f"{b / 1e6:9.1f} MB{' payload' if not d['sent'] else ''}  {rate:6.1f} GB/s")
    gaps = sorted(a["gaps"].items(), key=lambda kv: -kv[1][1])
    idle = sum(g[1] for _, g in gaps)
    late = sum(g[2] for _, g in gaps)
    print(f"\nGPU idle {ms(idle):.2f} ms per step in {sum(g[0] for _, g in gaps):.0f} gaps; of it "
          f"{ms(late):.2f} ms with the next work launched late by the host. Largest (per step):")
    for (before, after), (count, ns, lt, calls) in gaps[:12]:
        top = ", ".join(f"{nm} {ms(t):.2f}" for nm, t in sorted(calls.items(), key=lambda kv: -kv[1])[:3])
        print(f"  {ms(ns):7.3f} ms  {count:5.1f}x  {before[:40]:40s} -> {after[:40]:40s} host-late {ms(lt):.3f}"
              f"{'  host in: ' + top if top else ''}")


def account(ref_label, ref, label, a, world):
    """The line-by-line gap of run a to the ideal ref / world."""
    print(f"\n### {label} against {ref_label} / {world}: ideal {ms(ref['step']) / world:.2f} ms, "
          f"measured {ms(a['step']):.2f} ms, gap {ms(a['step'] - ref['step'] / world):+.2f} ms")
    print(f"| line (ms per step) | {ref_label} / {world} | {label} | difference |\n|---|---|---|---|")
    total = 0.0
    keys = [(p, cls) for cls in CLASSES + ("idle",) for p in PHASES]
    for p, cls in keys:
        r, x = ref["lines"].get((p, cls), 0.0) / world, a["lines"].get((p, cls), 0.0)
        if abs(x - r) < 5e3 and max(x, r) < 5e4:
            total += x - r
            continue
        total += x - r
        print(f"| {p}: {LABEL[cls]} | {ms(r):.2f} | {ms(x):.2f} | {ms(x - r):+.2f} |")
    print(f"| sum of the differences (= the gap) | | | {ms(total):+.2f} |")
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", default=[], help="label=DIR; the first is the reference (1 GPU)")
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    results = []
    for spec in args.run:
        label, d = spec.split("=", 1)
        traces = load_run(d)
        if not traces:
            print(f"{label}: no trace with kernels in {d}")
            continue
        per_rank = []
        for tr in traces:
            a = analyze(tr, args.skip)
            if a is None:
                print(f"{label}, {tr.path}: fewer than {args.skip + 1} steps found")
                continue
            report_rank(label, tr, a)
            per_rank.append((tr, a))
        results.append((label, per_rank))
    if len(results) >= 2 and results[0][1]:
        ref_label, ref = results[0][0], results[0][1][0][1]
        for label, per_rank in results[1:]:
            for tr, a in per_rank:
                account(ref_label, ref, f"{label} rank {tr.rank}", a, len(per_rank))
    return 0


# ---- self-test: hand-made traces whose answer is known ----------------------------------

def _write(path, lines, rank):
    with open(path, "w") as f:
        for ln in lines:
            f.write("\t".join(str(x) for x in ln) + "\n")
        f.write(f"# rank {rank} pid 1 dropped 0\n")


def _step(t0, two_gpu, n):
    """One step starting at t0 (µs units ×1000 = ns). Main stream 7, comm stream 9. Returns the
    records and the next t0; correlation ids are 100·n + k (unique, as CUPTI's). Layout (µs after t0):
      0-10 GEMM, 10-30 sage forward, [2 GPU: 30-40 Ulysses SendRecv on stream 7], loss 40-41,
      idle 41-50 (next kernel launched by the host at 48: 7 µs host-late, host in
      cudaStreamSynchronize 41-48), 50-70 attention backward, ring SendRecv on stream 9 55-65
      (hidden under the backward) and 70-75 (exposed), memcpy D2D 75-77, [2 GPU: grad
      all-reduce 77-87], norm 87-88, adamw 88-92, ema 92-93, DtoH 4 bytes 93-94."""
    us = lambda x: t0 + int(x * 1000)
    K = lambda a, b, name, corr, st=7: ("K", us(a), us(b), st, 100 * n + corr, name)
    recs = [K(0, 10, "void nvjet_hsh_gemm(int)", 1), K(10, 30, "void sage_forward_sm90_kernel<128>(int)", 2)]
    if two_gpu:
        recs += [("N", us(29), us(29.5), 7, "Send,Recv", 1000, 1000, 0, 2),
                 K(30, 40, "ncclDevKernel_SendRecv(int)", 3)]
    recs += [K(40, 41, "mse_partial_kernel(float*)", 4),
             ("R", us(41), us(48), 99, 1, "cudaStreamSynchronize"),
             ("R", us(48), us(48.5), 100 * n + 5, 1, "cudaLaunchKernel"),
             K(50, 70, "attention_backward_sm90_kernel(int)", 5)]
    if two_gpu:
        recs += [("N", us(49), us(49.2), 9, "Send,Recv", 2000, 2000, 0, 2),
                 ("D", us(49.1), us(49.15), 100 * n + 6, 1, "cuLaunchKernelEx"),
                 K(55, 65, "ncclDevKernel_SendRecv(int)", 6, 9),
                 ("N", us(49.3), us(49.4), 9, "Send,Recv", 500, 500, 0, 2),
                 ("D", us(49.35), us(49.38), 100 * n + 7, 1, "cuLaunchKernelEx"),
                 K(70, 75, "ncclDevKernel_SendRecv(int)", 7, 9)]
    recs += [("M", us(75), us(77), 7, 100 * n + 8, 4096, 8)]
    if two_gpu:
        recs += [("N", us(76), us(76.5), 7, "AllReduce", 0, 0, 40 << 20, 2),
                 K(77, 87, "ncclDevKernel_AllReduce_Sum_f32_RING_LL(int)", 9)]
    recs += [K(87, 88, "norm_partial_kernel(float*)", 10), K(88, 90, "adamw_kernel(float*)", 11),
             K(90, 93, "adamw_kernel(float*)", 12), ("M", us(93), us(94), 7, 100 * n + 13, 4, 2)]
    return recs, us(100)


def self_test():
    import tempfile
    d = tempfile.mkdtemp()
    ok, runs = True, {}
    for two_gpu in (False, True):
        recs, t0 = [], 1_000_000
        for n in range(5):
            r, t0 = _step(t0, two_gpu, n)
            recs += r
        sub = os.path.join(d, "two" if two_gpu else "one")
        os.makedirs(sub)
        _write(os.path.join(sub, "trace.rank0.1.tsv"), recs, 0)
        tr = load_run(sub)[0]
        a = analyze(tr, 1)
        runs[two_gpu] = (tr, a)
        L = lambda p, c: a["lines"].get((p, c), 0.0) / 1e3   # µs
        # steps 2..4 (after the skipped first) span 100 µs each: from the DtoH's end (94) to the next (194)
        expect = {("forward", "gemm"): 10, ("forward", "attention"): 20, ("backward", "rest"): 1,
                  ("backward", "attention"): 20, ("backward", "copy D2D"): 2, ("update", "rest"): 6,
                  ("update", "copy host"): 1}
        # idle: 94..100 of the previous step (6) in the forward, the 41-50 gap (9) in the backward;
        # 1 GPU: 30-40, 70-75 and 77-87 are idle too (no NCCL kernels there)
        if two_gpu:
            expect.update({("forward", "idle"): 6, ("backward", "idle"): 9, ("forward", "ulysses all-to-all"): 10,
                           ("backward", "ring send/recv"): 5, ("reduce", "grad all-reduce"): 10})
        else:
            expect.update({("forward", "idle"): 6 + 10, ("backward", "idle"): 9 + 5 + 10})
        got = {k: round(v / 1e3, 6) for k, v in a["lines"].items()}
        checks = [(f"{p}/{c}", L(p, c), v) for (p, c), v in expect.items()]
        checks.append(("sum of lines = step", sum(a["lines"].values()) / 1e3, 100))
        checks.append(("steps", a["n"], 4))
        extra = [k for k in got if k not in expect and got[k] != 0]
        if two_gpu:
            rs = a["comm"]["ring send/recv"]
            checks += [("ring kernel µs", rs["kernel"] / 1e3, 15), ("ring hidden µs", rs["hidden"] / 1e3, 10),
                       ("ring bytes", rs["sent"], 2500), ("ulysses bytes", a["comm"]["ulysses all-to-all"]["sent"], 1000),
                       ("grad all-reduce payload", a["comm"]["grad all-reduce"]["payload"], 40 << 20)]
        gap = a["gaps"][("mse_partial_kernel", "attention_backward_sm90_kernel")]
        checks += [("gap loss->bwd µs", gap[1] / 1e3, 9), ("host-late µs", gap[2] / 1e3, 7),
                   ("host in cudaStreamSynchronize µs", gap[3].get("cudaStreamSynchronize", 0) / 1e3, 7)]
        for name, x, want in checks:
            good = abs(x - want) < 1e-6
            ok &= good
            if not good:
                print(f"self-test {'2 GPU' if two_gpu else '1 GPU'}: {name} = {x}, expected {want}")
        if extra:
            ok = False
            print(f"self-test {'2 GPU' if two_gpu else '1 GPU'}: unexpected lines {extra}")
    # the printed report and the account: the lines' differences must sum to the gap
    for two_gpu, (tr, a) in runs.items():
        report_rank("synthetic", tr, a)
    gap = account("one", runs[False][1], "two", runs[True][1], 2)
    want = runs[True][1]["step"] - runs[False][1]["step"] / 2
    if abs(gap - want) > 1e-3:
        ok = False
        print(f"self-test: the account sums to {gap} ns, the gap is {want} ns")
    print("self-test:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
