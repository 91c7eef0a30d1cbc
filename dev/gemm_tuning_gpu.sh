#!/usr/bin/env bash
# The device check of branch gemm-tuning (one H200, ~4 min): the tuning tests, then config c's step
# with --gemm-tuning off / on under --fp8-fast-accum forward and all (three interleaved rounds,
# median ms of steps 9-30), and the losses of the tuned run against the untuned (they may differ in
# the last digits: other algorithms). BIN holds train_dit and the test binaries (dev/devrun_prepare.sh).
#   BIN=.devrun LOGS=/tmp/logs bash dev/gemm_tuning_gpu.sh; tar czf $OUT/logs.tgz -C /tmp/logs .
# Rule, written before the run: merge with --gemm-tuning on as train_dit's default (off under
# --deterministic) if the tests pass and tuning is >= 0.2 ms faster at c with `all` in all three rounds
# and not slower with `forward`; else keep the flag off by default or leave the branch.
set -u
BIN=${BIN:-.devrun}; LOGS=${LOGS:-/tmp/logs}; mkdir -p "$LOGS"; S=$LOGS/summary.txt
export LD_LIBRARY_PATH=$PWD/.devlibs:${LD_LIBRARY_PATH:-}
"$BIN/test_layers_cuda" --verbose --filter 'cuda/linear*' > "$LOGS/layers.log" 2>&1; echo "layers rc=$?" >> "$S"
"$BIN/test_linear_fp8_cuda" --verbose --filter 'linear_fp8/matches*' > "$LOGS/fp8.log" 2>&1; echo "fp8 rc=$?" >> "$S"
grep -h Synthesis "$LOGS/layers.log" "$LOGS/fp8.log" >> "$S"
C="--device gpu --data synthetic --image-size 256 --patch 2 --hidden 2048 --depth 4 --heads 16 --batch 1 --ckpt-every 0 --sample-every 0 --attn sage --linear fp8 --steps 30 --out /tmp/o"
median() { python3 -c "import re,statistics,sys; ms=[float(m) for m in re.findall(r'\| ([0-9.]+) ms \|', open(sys.argv[1]).read())]; print(f'{statistics.median(ms[8:30]):.2f}')" "$1"; }
for r in 1 2 3; do
    for fa in forward all; do
        for tune in off on; do
            f=$LOGS/step_${fa}_${tune}_$r.log
            timeout 120 "$BIN/train_dit" $C --fp8-fast-accum $fa --gemm-tuning $tune > "$f" 2>&1
            echo "round $r $fa tuning $tune: $(median "$f") ms, step 1 $(grep '^step     1/' "$f" | cut -d'|' -f5), loss 30 $(grep '^step    30' "$f" | cut -d'|' -f2)" >> "$S"
        done
    done
done
cat "$S"
