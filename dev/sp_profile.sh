#!/usr/bin/env bash
# Per-rank GPU timelines of training steps on 1 GPU, Ulysses 2 and ring 2 (sage, hidden 2048,
# 16 heads of 128, depth 4, batch 1; dev/bench_sp.sh's model) at 30,976 and 16,384 tokens, and
# their line-by-line account against half of one GPU's step (dev/sp_timeline.py).
#
#   bash dev/sp_profile.sh prepare         here (no GPU): train_dit, libsp_trace.so (CUPTI) and
#                                          the scripts into .devrun_trace/ (self-contained)
#   bash .devrun_trace/sp_profile.sh run   on the 2-GPU machine, from the tree root, logs to $OUT
#     (run tool: kind nvidia-h200-x2, carry [".devrun_trace", ".devlibs"], timeout_s 300)
# Output: $OUT/sp_profile.tgz (the traces, logs and account_<size>.md: per rank the phase ×
# category table, communication, top gaps, then the account against 1 GPU / 2) and a summary.
# Re-analysis here: python3 dev/sp_timeline.py --run 1gpu=DIR --run ulysses2=DIR ... --skip 3
set -uo pipefail
MODE=${1:-}
DEV=.devrun_trace

prepare() {
    set -e
    cd "$(dirname "$0")/.."
    make -j2 train_dit
    local CUDA=/usr/local/cuda
    rm -rf "$DEV" && mkdir -p "$DEV"
    cp train_dit dev/sp_timeline.py dev/sp_profile.sh "$DEV/"
    gcc -O2 -Wall -Wextra -shared -fPIC -I$CUDA/include dev/sp_trace.c -o "$DEV/libsp_trace.so" \
        -L$CUDA/lib64 -Wl,-rpath,$CUDA/lib64 -lcupti -ldl -lpthread -lstdc++
    strip "$DEV/train_dit"
    python3 "$DEV/sp_timeline.py" --self-test | tail -1
    du -sh "$DEV"
}

run() {
    local B; B=$(dirname "$0")
    local T0; T0=$(date +%s)
    local DEADLINE=$(( T0 + ${BUDGET_S:-280} ))
    : "${OUT:?OUT must be set (the device tool sets it)}"
    export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
    local N; N=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
    export LD_LIBRARY_PATH=$PWD/.devlibs:${N:+$N:}${LD_LIBRARY_PATH:-}   # NCCL as dev/gpu_suite.sh finds it
    local W=/tmp/sp_profile; rm -rf $W; mkdir -p $W
    { nvidia-smi -L; date -u; ldd $B/train_dit | grep -E 'nccl|not found'; ldd $B/libsp_trace.so | grep -E 'cupti|not found'; } > $W/env.txt 2>&1
    python3 $B/sp_timeline.py --self-test > $W/self_test.txt 2>&1
    local MODEL="--device gpu --data synthetic --model S --hidden 2048 --heads 16 --depth 4 --batch 1 --attn sage --ckpt-every 0 --sample-every 0 --seed 1"
    traced() {   # name, image size, extra flags: one traced run of 8 steps
        local name=$1 size=$2 left=$(( DEADLINE - $(date +%s) )); shift 2
        [ $left -gt 90 ] && left=90
        if [ $left -lt 25 ]; then echo "$name: skipped (deadline)" | tee -a $W/skipped.txt; return; fi
        mkdir -p $W/$name
        local t=$(date +%s)
        SP_TRACE_DIR=$W/$name LD_PRELOAD=$PWD/$B/libsp_trace.so timeout $left $B/train_dit $MODEL --image-size $size \
            --steps 8 --out $W/$name/out "$@" > $W/$name/log.txt 2>&1 || echo "$name: FAILED or cut" | tee -a $W/skipped.txt
        echo "$name: $(( $(date +%s) - t )) s" >> $W/times.txt
    }
    for size in 352 256; do
        traced t${size}_1gpu $size
        traced t${size}_ulysses2 $size --gpus 2 --sp-ulysses 2
        traced t${size}_ring2 $size --gpus 2 --sp-ring 2
    done
    for s in 352 256; do
        local args=""
        for r in 1gpu ulysses2 ring2; do [ -d $W/t${s}_$r ] && args="$args --run ${r}=$W/t${s}_$r"; done
        [ -n "$args" ] && python3 $B/sp_timeline.py $args --skip 3 > $W/account_$s.md 2>&1
    done
    echo "total $(( $(date +%s) - T0 )) s" >> $W/times.txt
    tar czf $OUT/sp_profile.tgz -C /tmp sp_profile
    tail -1 $W/self_test.txt; cat $W/times.txt
    grep -E "^## |^### |sum of the differences" $W/account_352.md 2>/dev/null
}

case $MODE in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash dev/sp_profile.sh prepare | bash .devrun_trace/sp_profile.sh run"; exit 2 ;;
esac
