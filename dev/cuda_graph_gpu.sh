#!/usr/bin/env bash
# The training step as one CUDA graph (branch cuda-graph, dev/notes_step.md "The step as one CUDA
# graph") on one H200: the unit test (graph vs eager, bitwise), a planted bug that must fail it,
# train_dit's checkpoints eager vs graph (and vs main's build), then the step time of configs a
# and c, graph vs eager.
#
#   bash dev/cuda_graph_gpu.sh prepare            here (no GPU): builds this branch and fills $DEV
#                                                 (default /work/main/.devrun_graph)
#   bash .devrun_graph/cuda_graph_gpu.sh run      on nvidia-h200 from /work/main, carry
#                                                 [".devrun_graph", ".devlibs"]; deadline 180 s inside
#
# prepare: this branch's train_dit and test_step_graph_cuda; main's train_dit (/work/main's, if it
# is newer than every source there) as train_dit_main; and the planted build:
#   test_step_graph_planted: test_step_graph_cuda against this branch's library with dit_gpu.o
#     rebuilt from a copy in which dit_gpu_train_step_graph skips dit_gpu_set_step once the graph
#     exists (every replay reads the capture step's lr, bias corrections and EMA decay): must FAIL.
# run: $OUT/summary.txt grows line by line (a call cut short still returns it); the other files in
# $OUT are small text logs; checkpoints and images stay in /tmp and are deleted.
set -uo pipefail
MODE=${1:-}
DEV=${DEV:-/work/main/.devrun_graph}
MAIN=${MAIN:-/work/main}

prepare() {
    set -e
    cd "$(dirname "$0")/.."
    [ -z "$(git status --porcelain -- attention layers model dataloader train_dit.c test)" ] ||
        { echo "prepare: commit the sources first"; exit 1; }
    make -j2 train_dit build/test_step_graph_cuda
    local tmp; tmp=$(mktemp -d)
    local CUDA=/usr/local/cuda
    local NV="$CUDA/bin/nvcc -O3 -std=c++17 -I. --use_fast_math -Xcompiler -Wall -DDIT_NCCL
              -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local F="-O3 -g -std=c11 -Wall -Wextra -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -DDIT_NCCL -I$CUDA/include"
    local L="-lm -lpthread -L$CUDA/lib64 -Wl,-rpath,$CUDA/lib64 -lcublasLt -lcublas -lcudart -lstdc++ -lnccl"
    # the planted bug: inside dit_gpu_train_step_graph only, the step constants are copied only
    # while there is no graph yet
    sed '/^int dit_gpu_train_step_graph(/,/^}/ s/^    TRY(dit_gpu_set_step(\(.*\)));$/    if (!sg->exec) TRY(dit_gpu_set_step(\1));/' \
        model/dit_gpu.cu > "$tmp/dit_gpu.cu"
    [ "$(diff model/dit_gpu.cu "$tmp/dit_gpu.cu" | grep -c '^>')" = 1 ] || { echo "prepare: the plant did not apply"; exit 1; }
    $NV -c -o "$tmp/dit_gpu.o" "$tmp/dit_gpu.cu"
    cp build/libditc.a "$tmp/libditc.a"
    ar r "$tmp/libditc.a" "$tmp/dit_gpu.o"
    rm -rf "$DEV" && mkdir -p "$DEV"
    gcc $F -o "$DEV/test_step_graph_planted" test/test_step_graph_cuda.c "$tmp/libditc.a" $L -lcriterion
    cp train_dit build/test_step_graph_cuda "$DEV/"
    local main_ok=1 f
    for f in "$MAIN"/attention/* "$MAIN"/layers/* "$MAIN"/model/* "$MAIN"/dataloader/* "$MAIN"/train_dit.c; do
        [ "$MAIN/train_dit" -nt "$f" ] || { main_ok=0; echo "prepare: $MAIN/train_dit is older than $f: not taken"; break; }
    done
    [ $main_ok = 1 ] && cp "$MAIN/train_dit" "$DEV/train_dit_main"
    strip "$DEV"/train_dit* "$DEV"/test_*
    cp dev/cuda_graph_gpu.sh "$DEV/"
    { echo "branch $(git rev-parse HEAD)"; echo "main $(git -C "$MAIN" rev-parse HEAD)"; } > "$DEV/commit.txt"
    rm -rf "$tmp"
    du -sh "$DEV" "$MAIN/.devlibs"
    echo "run from $MAIN: bash $(basename "$DEV")/cuda_graph_gpu.sh run   (carry [\"$(basename "$DEV")\", \".devlibs\"])"
}

run() {
    local B; B=$(dirname "$0")
    local T0; T0=$(date +%s)
    local DEADLINE=$(( T0 + ${BUDGET_S:-180} ))
    : "${OUT:?OUT must be set (the device tool sets it)}"
    export LD_LIBRARY_PATH=$PWD/.devlibs:${LD_LIBRARY_PATH:-}
    local W=/tmp/graph_runs S=$OUT/summary.txt; rm -rf $W; mkdir -p $W
    say() { echo "$*" >> $S; }
    # step NAME MAX_S LOG CMD...: CMD under timeout -k 3 min(MAX_S, time left), its output appended
    # to LOG; skipped (and said so) when less than 8 s are left
    step() {
        local name=$1 max=$2 log=$3 left=$(( DEADLINE - $(date +%s) - 5 )); shift 3
        [ $left -lt $max ] && max=$left
        if [ $max -lt 8 ]; then say "$name: SKIPPED (deadline)"; return 99; fi
        local t; t=$(date +%s)
        echo "== $name: $*" >> $log
        timeout -k 3 $max "$@" >> $log 2>&1
        local rc=$?
        echo "== $name: rc=$rc in $(( $(date +%s) - t )) s" >> $log
        return $rc
    }
    { nvidia-smi -L; date -u; cat $B/commit.txt; } > $OUT/env.txt 2>&1
    say "cuda_graph_gpu.sh run, $(date -u), $(head -1 $B/commit.txt)"

    # 1. the unit test: graph vs eager bitwise (want rc 0)
    step test 60 $OUT/test.txt $B/test_step_graph_cuda --jobs 1 --verbose
    say "1. test_step_graph_cuda rc=$? (want 0): $(grep -h Synthesis $OUT/test.txt | tail -1)"

    # 2. the planted bug (step constants not copied after the capture): want Failing > 0
    step planted 60 $OUT/planted.txt $B/test_step_graph_planted --jobs 1 --verbose
    say "2. planted (no step constants after capture) rc=$? (want 1): $(grep -h Synthesis $OUT/planted.txt | tail -1)"

    # 3. train_dit: 6 deterministic steps eager vs graph (and main's eager build), checkpoints at 3
    #    and 6, samples at 3 and 6 (sampling runs eagerly between the graph's steps); lr and EMA
    #    decay change at every step (warm-ups), clipping by the default norm 1
    local small="--device gpu --deterministic --ckpt-every 3 --steps 6 --model S --batch 8 --data synthetic --seed 3
                 --sample-every 3 --samples-per-class 1 --sample-steps 4"
    local run bin
    for run in eager graph main; do
        case $run in eager) bin="$B/train_dit --cuda-graph off";; graph) bin="$B/train_dit --cuda-graph on";;
                     main) bin=$B/train_dit_main;; esac
        [ $run = main ] && [ ! -x $B/train_dit_main ] && { say "3. main's build not prepared: skipped"; continue; }
        step bit_$run 40 $OUT/bitwise.txt $bin $small --out $W/bit_$run
    done
    compare() {   # a b
        local a=$W/bit_$1 b=$W/bit_$2 verdict="EQUAL" f logs="identical"
        for f in ckpt_000003.safetensors ckpt_000006.safetensors samples_000003.png samples_000006.png; do
            [ -f $a/$f ] && [ -f $b/$f ] || { verdict="a run FAILED ($f missing)"; break; }
            cmp -s $a/$f $b/$f || verdict="DIFFERENT ($f first)"
            [ "$verdict" = EQUAL ] || break
        done
        if [ -f $a/train_log.csv ] && [ -f $b/train_log.csv ]; then
            diff -q <(cut -d, -f1-3 $a/train_log.csv) <(cut -d, -f1-3 $b/train_log.csv) > /dev/null ||
                logs="differ in $(diff <(cut -d, -f1-3 $a/train_log.csv) <(cut -d, -f1-3 $b/train_log.csv) | grep -c '^>') lines"
        else
            logs="missing"
        fi
        say "3. train_dit $1 vs $2: checkpoints and samples $verdict; train_log step,loss,grad_norm $logs"
    }
    compare eager graph
    [ -d $W/bit_main ] && compare main graph
    grep -h "CUDA graph" $OUT/bitwise.txt | head -1 | cut -c1-100 | sed 's/^/   graph run: /' >> $S
    rm -f $W/bit_*/*.safetensors $W/bit_*/*.png

    # 4. time per step, eager and graph interleaved twice: config a (DiT-B/2, 256 tokens x 64)
    #    and c (16K tokens, depth 4) as dev/bench_step.py runs them; median ms of steps 4..N
    local a_args="--image-size 32 --patch 2 --hidden 768 --depth 12 --heads 12 --batch 64 --steps 30"
    local c_args="--image-size 256 --patch 2 --hidden 2048 --depth 4 --heads 16 --batch 1 --steps 20"
    local common="--device gpu --data synthetic --attn sage --ckpt-every 0 --sample-every 0"
    local cfg rep mode
    for cfg in a c; do
        local args=$a_args; [ $cfg = c ] && args=$c_args
        for rep in 1 2; do
            for mode in off on; do
                step t_${cfg}_${mode}_$rep 30 $W/timing_runs.txt $B/train_dit $common $args --cuda-graph $mode \
                    --out $W/t_${cfg}_${mode}_$rep
            done
        done
    done
    median() { sort -g | awk '{a[NR]=$1} END {print NR ? (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2) " (" NR " steps)" : "no run"}'; }
    for cfg in a c; do
        for mode in off on; do
            local all="" per=""
            for rep in 1 2; do
                local f=$W/t_${cfg}_${mode}_$rep/train_log.csv
                [ -f $f ] || continue
                { echo "# $cfg $mode rep $rep"; cat $f; } >> $OUT/timing.txt
                local ms; ms=$(awk -F, '$1 ~ /^[0-9]+$/ && $1 >= 4 {print $5}' $f)
                all="$all $ms"
                per="$per rep$rep $(echo $ms | tr ' ' '\n' | median)"
            done
            say "4. time $cfg cuda-graph $mode: median ms of steps 4..N = $(echo $all | tr ' ' '\n' | grep . | median) |$per"
        done
    done
    grep -h "train_dit: error\|error:" $W/timing_runs.txt 2>/dev/null | head -3 | sed 's/^/   timing error: /' >> $S
    rm -rf $W
    say "total $(( $(date +%s) - T0 )) s"
    cat $S
}

case $MODE in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash dev/cuda_graph_gpu.sh prepare | bash .devrun_graph/cuda_graph_gpu.sh run"; exit 2 ;;
esac
