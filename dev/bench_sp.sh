#!/usr/bin/env bash
# Sequence parallelism on 2 GPUs against 1 GPU: training throughput of train_dit at ~16K and
# ~31K tokens (hidden 2048, 16 heads of dim 128, depth 4, batch 1, sage attention), Ulysses 2 and
# ring 2; and the bytes each rank sends per step, measured from NCCL's own log of every call
# (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL: one log line per call, hundreds per step) in separate
# short runs, beside the formulas of dev/notes_sequence_parallel.md. The timed runs have no NCCL
# logging (it costs host time on every call).
#
#   BIN=.devrun LOGS=$OUT bash dev/bench_sp.sh        (on a machine with 2 GPUs and NCCL)
#   optional: SIZES="352 256" RUNS="ulysses2 ring2 1gpu ulysses2g8" STEPS=10 BYTES_STEPS=3 ATTN=sage|bf16,
#             DEADLINE=<epoch seconds> (runs that would start later than 5 s before it are skipped)
#
# Image sizes: 256 (patch 2: 128² = 16,384 tokens) and 352 (176² = 30,976 tokens: 32,768 is no
# square, and sage under ring needs T/2 to be a multiple of 64, so the side a multiple of 16).
# Time per step: the median of train_log.csv's ms over steps 4..STEPS (the first are warm-up).
# ulysses2g8: Ulysses 2 with 8 head groups instead of the default 4 (a line under the table).
set -uo pipefail
BIN=${BIN:-.}
LOGS=${LOGS:-bench_sp_out}
STEPS=${STEPS:-10}
BYTES_STEPS=${BYTES_STEPS:-3}
ATTN=${ATTN:-sage}
mkdir -p "$LOGS"
MODEL="--data synthetic --model S --hidden 2048 --heads 16 --depth 4 --batch 1 --attn $ATTN --ckpt-every 0 --sample-every 0 --seed 1"

SIZES=${SIZES:-256 352}
RUNS=${RUNS:-1gpu ulysses2 ring2 ulysses2g8}
DEADLINE=${DEADLINE:-$(( $(date +%s) + 100000 ))}

run() {   # name, image size, extra flags
    local name=$1 size=$2 left=$(( DEADLINE - $(date +%s) )); shift 2
    [ $left -gt 120 ] && left=120
    if [ $left -lt 5 ]; then echo "$name: skipped (deadline)"; return; fi
    timeout $left "$BIN/train_dit" $MODEL --image-size "$size" --steps "$STEPS" --out "$LOGS/$name" "$@" \
        > "$LOGS/$name.log" 2>&1 || { echo "$name: FAILED or cut (see $LOGS/$name.log)"; tail -2 "$LOGS/$name.log"; }
}

# the timed runs: no NCCL logging
for size in $SIZES; do
    for r in $RUNS; do
        case $r in
            1gpu) run "t${size}_1gpu" "$size" ;;
            ulysses2) run "t${size}_ulysses2" "$size" --gpus 2 --sp-ulysses 2 ;;
            ring2) run "t${size}_ring2" "$size" --gpus 2 --sp-ring 2 ;;
            ulysses2g8) run "t${size}_ulysses2g8" "$size" --gpus 2 --sp-ulysses 2 --sp-head-groups 8 ;;
        esac
    done
done
# the bytes: short runs with NCCL's log of every call (BYTES_STEPS steps, not timed)
for size in $SIZES; do
    for r in $RUNS; do
        case $r in
            ulysses2) NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL NCCL_DEBUG_FILE=$LOGS/b${size}_ulysses2.nccl.%p \
                      STEPS=$BYTES_STEPS run "b${size}_ulysses2" "$size" --gpus 2 --sp-ulysses 2 ;;
            ring2) NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL NCCL_DEBUG_FILE=$LOGS/b${size}_ring2.nccl.%p \
                   STEPS=$BYTES_STEPS run "b${size}_ring2" "$size" --gpus 2 --sp-ring 2 ;;
        esac
    done
done

python3 - "$LOGS" "$STEPS" "$ATTN" "$BYTES_STEPS" <<'EOF'
import csv, glob, os, re, statistics, sys
logs, steps, attn, bytes_steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])

def ms_per_step(name):
    path = os.path.join(logs, name, "train_log.csv")
    if not os.path.exists(path): return None
    rows = [r for r in csv.DictReader(open(path)) if int(r["step"]) >= 4]
    if len(rows) < steps - 3: return None   # cut short
    return statistics.median(float(r["ms"]) for r in rows)

print(f"## throughput ({attn} attention, hidden 2048, 16 heads, depth 4, batch 1; median ms/step of steps 4..{steps})")
print("| tokens | 1 GPU ms | Ulysses 2 ms | speed-up | ring 2 ms | speed-up |")
print("|---|---|---|---|---|---|")
for size in (256, 352):
    T = (size // 2) ** 2
    one, uly, ring = (ms_per_step(f"t{size}_{k}") for k in ("1gpu", "ulysses2", "ring2"))
    f = lambda x: f"{x:.1f}" if x else "not run"
    s = lambda x: f"{one / x:.2f}x" if (one and x) else "-"
    print(f"| {T:,} | {f(one)} | {f(uly)} | {s(uly)} | {f(ring)} | {s(ring)} |")
for size in (256, 352):
    g8 = ms_per_step(f"t{size}_ulysses2g8")
    one = ms_per_step(f"t{size}_1gpu")
    if g8: print(f"Ulysses 2 with 8 head groups, {(size // 2) ** 2:,} tokens: {g8:.1f} ms" + (f" ({one / g8:.2f}x)" if one else ""))

# Bytes sent per rank in one step, from NCCL's log: Send (not to itself), AllGather (n-1)·count
# (count per rank), ReduceScatter (n-1)·count (count per rank), AllReduce 2(n-1)/n·count (ring
# algorithm), Reduce count by every rank but the root, by operation. ZeRO-1 (model/zero.h): the
# gradients' reduce-scatter (or, with --zero-overlap on, one Reduce per piece of a block's gradients,
# to its owner: the pieces cover the buffer once per step) and the bf16 weights' all-gather are the
# large ones (> 1e6 elements).
size_of = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}
line_re = re.compile(r"\[(\d+)\] NCCL INFO (\w+): opCount \S+ sendbuff \S+ recvbuff \S+ count (\d+) "
                     r"datatype (\d+) op \d+ root (-?\d+) comm \S+ \[nranks=(\d+)\]")
B, H, D, depth, h, P = 1, 16, 128, 4, 2048, 4
params = None
reduced = {}   # (size, kind): elements reduced to an owner, summed over the logged steps (rank 0's lines)
for size, kind in ((s, k) for s in (256, 352) for k in ("ulysses", "ring")):
    T = (size // 2) ** 2
    n = T // 2                       # tokens per rank
    Te = B * H * n * D               # elements of one (B, H, T/2, D) shard
    paths = glob.glob(os.path.join(logs, f"b{size}_{kind}2.nccl.*"))   # one file per rank (NCCL_DEBUG_FILE)
    if not paths: continue
    sent = {}
    for line in (l for p in paths for l in open(p, errors="replace")):
        m = line_re.search(line)
        if not m: continue
        dev, op, count, dtype, root, nranks = int(m[1]), m[2], int(m[3]), int(m[4]), int(m[5]), int(m[6])
        b = count * size_of.get(dtype, 1)
        if op == "Send": b = 0 if root == dev else b
        elif op == "AllGather":
            op = "AllGather (weights)" if count > 1e6 else "AllGather"
            b *= nranks - 1
        elif op == "ReduceScatter":
            if count > 1e6: params = count * nranks
            op = "ReduceScatter (gradients)"
            b *= nranks - 1
        elif op == "Reduce":
            if dev == 0: reduced[(size, kind)] = reduced.get((size, kind), 0) + count
            op = "Reduce (gradients)"
            b = 0 if root == dev else b
        elif op == "AllReduce":
            op = "AllReduce (large)" if count > 1e6 else "AllReduce (small)"
            b = b * 2 * (nranks - 1) / nranks
        else: continue
        sent.setdefault(dev, {}).setdefault(op, 0)
        sent[dev][op] += b / bytes_steps
    if kind == "ulysses":   # a2a q, k, v, out (bf16); backward dout, dq, dk, dv (bf16, rotated before)
        fwd, bwd = 4 * 2 * Te / 2, 4 * 2 * Te / 2
    else:                   # sage ring FP8: (R-1) passes of k8, v e4m3, k_scale + 2 stats all-reduces;
        fwd = (2 * Te + 4 * B * H * n // 64) + 2 * 4 * B * H * D   # backward (R = 2): k, v bf16 once,
        bwd = 4 * Te + 8 * Te                                       # the foreign dk, dv fp32 once
        if attn != "sage": fwd = 4 * Te
    print(f"\n## bytes sent per rank and step, {kind} 2, {T:,} tokens (NCCL_DEBUG=INFO COLL, {bytes_steps} steps)")
    for dev in sorted(sent):
        print(f"rank {dev}: " + ", ".join(f"{op} {v / 1e6:.2f} MB" for op, v in sorted(sent[dev].items())))
    att = sum(v for op, v in sent.get(0, {}).items() if op in ("Send",)) + \
          (sum(v for op, v in sent.get(0, {}).items() if op == "AllReduce (small)") if kind == "ring" else 0)
    print(f"attention per layer, measured: {att / depth / 1e6:.2f} MB "
          f"(Send{' + stats all-reduces' if kind == 'ring' else ''}, rank 0, / depth {depth}); computed: forward "
          f"{fwd / 1e6:.2f} + backward {bwd / 1e6:.2f} = {(fwd + bwd) / 1e6:.2f} MB")
    if reduced.get((size, kind)): params = round(reduced[(size, kind)] / bytes_steps)
    zero = (f"the fp32 gradients to their owners (reduce-scatter, or Reduces with --zero-overlap on) {params * 4 / 2 / 1e6:.1f} MB + all-gather of the bf16 weights "
            f"{params * 2 / 2 / 1e6:.1f} MB computed for {params:,} parameters (padded to 2 slices)" if params else "(not seen)")
    print(f"per step besides attention: output tokens all-gather computed {B * n * P * 2 / 1e6:.3f} MB; ZeRO-1 {zero}")
EOF
