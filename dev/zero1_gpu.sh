#!/usr/bin/env bash
# ZeRO-1 over the replicas (model/zero.h; branch zero1) on 2 GPUs: the unit test against the
# replicated update (bitwise), checkpoints bit for bit against main's build, three planted bugs
# that must fail the unit test, then the step time against main's.
#
#   bash dev/zero1_gpu.sh prepare          here (no GPU): builds this branch and fills $DEV (default
#                                          /work/main/.devrun_zero1) with stripped binaries
#   bash .devrun_zero1/zero1_gpu.sh run    on nvidia-h200-x2 from the tree root, carry
#                                          [".devrun_zero1", ".devlibs"]; deadline 165 s inside
#
# prepare: main's train_dit (/work/main, must be current) as train_dit_main; this branch's
# train_dit, test_distributed_cuda and test_dit_gpu_cuda; test_distributed_cuda linked against
# this branch's library with one object rebuilt from a patched copy (each must FAIL zero1/*):
#   planted_nogather:  zero_step_queue skips the all-gather of the bf16 weights (the next forward
#                      runs on the other slice's old weights)
#   planted_offset:    rank r > 0 updates its slice from one block (64 elements) further on (the
#                      first block of its slice is never updated)
#   planted_localnorm: the all-reduce of the scalars carries the loss only: each rank's norm is its
#                      slice's (the weights stay bitwise without clipping: only the norm check sees it)
set -uo pipefail
MODE=${1:-}
DEV=${DEV:-/work/main/.devrun_zero1}
MAIN=${MAIN:-/work/main}

prepare() {
    set -e
    cd "$(dirname "$0")/.."
    [ -z "$(git status --porcelain -- attention layers model dataloader train_dit.c test)" ] ||
        { echo "prepare: commit the sources first"; exit 1; }
    [ -z "$(git -C "$MAIN" status --porcelain -- attention layers model dataloader train_dit.c)" ] ||
        { echo "prepare: $MAIN has uncommitted library changes; its build is not main's"; exit 1; }
    for f in "$MAIN"/attention/* "$MAIN"/layers/* "$MAIN"/model/* "$MAIN"/train_dit.c; do
        [ "$MAIN/train_dit" -nt "$f" ] || { echo "prepare: $MAIN/train_dit is older than $f"; exit 1; }
    done
    make -j2 train_dit build/test_distributed_cuda build/test_dit_gpu_cuda
    local tmp; tmp=$(mktemp -d)
    local CUDA=/usr/local/cuda
    local NV="$CUDA/bin/nvcc -O3 -std=c++17 -I. --use_fast_math -Xcompiler -Wall -DDIT_NCCL
              -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local F="-O3 -g -std=c11 -Wall -Wextra -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -DDIT_NCCL -I$CUDA/include"
    local L="-lm -lpthread -L$CUDA/lib64 -Wl,-rpath,$CUDA/lib64 -lcublasLt -lcublas -lcudart -lstdc++ -lnccl"
    # planted NAME OBJECT: test_distributed_cuda against this branch's library with OBJECT.o from
    # $tmp/NAME/OBJECT (the patched copy), as $DEV/test_distributed_NAME
    planted() {
        cp build/libditc.a "$tmp/$1/libditc.a"
        ar r "$tmp/$1/libditc.a" "$tmp/$1/$2.o"
        gcc $F -o "$DEV/test_distributed_$1" test/test_distributed_cuda.c "$tmp/$1/libditc.a" $L -lcriterion
    }
    mkdir -p "$tmp/nogather" "$tmp/offset" "$tmp/localnorm"
    sed 's/^        dist_all_gather_queue(comm, &weights, m->shard_size \* sizeof(bf16), 1, m->stream, err))$/        weights == NULL)/' \
        model/zero.c > "$tmp/nogather/zero.c"
    sed 's/^    \*lo = m->shard_rank \* m->shard_size;$/    *lo = m->shard_rank * m->shard_size + (m->shard_rank ? SHARD_ALIGN : 0);/' \
        model/dit_gpu.cu > "$tmp/offset/dit_gpu.cu"
    sed 's/dist_all_reduce_scaled_queue(comm, scalars, counts, scales, 2, m->stream, err)/dist_all_reduce_scaled_queue(comm, scalars, counts, scales, 1, m->stream, err)/' \
        model/zero.c > "$tmp/localnorm/zero.c"
    [ "$(diff model/zero.c "$tmp/nogather/zero.c" | grep -c '^>')" = 1 ] || { echo "prepare: nogather did not apply"; exit 1; }
    [ "$(diff model/dit_gpu.cu "$tmp/offset/dit_gpu.cu" | grep -c '^>')" = 1 ] || { echo "prepare: offset did not apply"; exit 1; }
    [ "$(diff model/zero.c "$tmp/localnorm/zero.c" | grep -c '^>')" = 1 ] || { echo "prepare: localnorm did not apply"; exit 1; }
    gcc $F -c -o "$tmp/nogather/zero.o" "$tmp/nogather/zero.c"
    gcc $F -c -o "$tmp/localnorm/zero.o" "$tmp/localnorm/zero.c"
    $NV -c -o "$tmp/offset/dit_gpu.o" "$tmp/offset/dit_gpu.cu"
    rm -rf "$DEV" && mkdir -p "$DEV"
    planted nogather zero; planted offset dit_gpu; planted localnorm zero
    cp train_dit "$DEV/train_dit"
    cp "$MAIN/train_dit" "$DEV/train_dit_main"
    cp build/test_distributed_cuda build/test_dit_gpu_cuda "$DEV/"
    strip "$DEV"/train_dit* "$DEV"/test_*
    cp dev/zero1_gpu.sh "$DEV/"
    { git rev-parse HEAD; git -C "$MAIN" rev-parse HEAD; } > "$DEV/commit.txt"
    rm -rf "$tmp"
    du -sh "$DEV" "$MAIN/.devlibs"
    echo "run from $MAIN: bash $(basename "$DEV")/zero1_gpu.sh run   (carry [\"$(basename "$DEV")\", \".devlibs\"])"
}

run() {
    local B; B=$(dirname "$0")
    local T0; T0=$(date +%s)
    local DEADLINE=$(( T0 + ${BUDGET_S:-165} ))
    : "${OUT:?OUT must be set (the device tool sets it)}"
    export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
    export LD_LIBRARY_PATH=$PWD/.devlibs:${LD_LIBRARY_PATH:-}
    local W=/tmp/zero1_logs S=/tmp/zero1_logs/summary.txt; rm -rf $W; mkdir -p $W
    # step NAME MAX_S CMD...: CMD under timeout min(MAX_S, time left), output to NAME.txt; skipped
    # (and listed) when less than 8 s are left
    step() {
        local name=$1 max=$2 left=$(( DEADLINE - $(date +%s) - 3 )); shift 2
        [ $left -lt $max ] && max=$left
        if [ $max -lt 8 ]; then echo "$name: SKIPPED (deadline)" >> $S; return 99; fi
        local t; t=$(date +%s)
        timeout $max "$@" > $W/$name.txt 2>&1
        local rc=$?
        echo "$name: rc=$rc in $(( $(date +%s) - t )) s" >> $W/steps.txt
        return $rc
    }
    { nvidia-smi -L; date -u; cat $B/commit.txt; ldd $B/train_dit | grep -E 'nccl|not found'; } > $W/env.txt 2>&1
    # 1. the unit test: ZeRO-1 vs the replicated update, bitwise (the rest of the suite in the
    #    background, beside the correctness runs; the fault tests, which wait for timeouts, last)
    step test_zero1 60 $B/test_distributed_cuda --jobs 1 --verbose --filter 'zero1/*'
    echo "test_distributed_cuda zero1/* rc=$? (want 0): $(grep Synthesis $W/test_zero1.txt)" >> $S
    ( step test_data_parallel 40 $B/test_distributed_cuda --jobs 1 --verbose --filter 'data_parallel/*'
      echo "test_distributed_cuda data_parallel/* rc=$? (want 0): $(grep Synthesis $W/test_data_parallel.txt)" >> $S
      step test_dit_gpu 45 $B/test_dit_gpu_cuda --jobs 2
      echo "test_dit_gpu_cuda rc=$? (want 0): $(grep Synthesis $W/test_dit_gpu.txt)" >> $S ) &
    local bg=$!
    # 2. checkpoints at steps 3 and 6 and the log, main vs branch. The default --grad-clip 1 acts at
    #    these steps (grad norm 1.3-4.0 on the CPU run), and the norm's last bits may differ: so
    #    --grad-clip 1e9 (clipping off) for the bitwise runs; the default clip once, as information.
    local small="--device gpu --data synthetic --model S --batch 8 --attn sage --steps 6 --ckpt-every 3 --seed 3 --deterministic"
    bitwise() {   # name clip args...
        local name=$1 clip=$2; shift 2
        local b
        for b in main new; do
            local bin=train_dit; [ $b = main ] && bin=train_dit_main
            step bit_${name}_$b 30 $B/$bin $small --grad-clip $clip "$@" --out $W/bit_${name}_$b
        done
        local a=$W/bit_${name}_main n=$W/bit_${name}_new verdict="EQUAL" f
        for f in ckpt_000003.safetensors ckpt_000006.safetensors $(cd $a 2>/dev/null && ls *.png 2>/dev/null); do
            [ -f $a/$f ] && [ -f $n/$f ] || { verdict="a run FAILED ($f missing)"; break; }
            cmp -s $a/$f $n/$f || verdict="DIFFERENT ($f: $(cmp -l $a/$f $n/$f | wc -l) bytes)"
        done
        local logs="identical"
        [ -f $a/train_log.csv ] && [ -f $n/train_log.csv ] || logs="missing"
        [ $logs = missing ] || diff -q <(cut -d, -f1-4 $a/train_log.csv 2>/dev/null) <(cut -d, -f1-4 $n/train_log.csv 2>/dev/null) > /dev/null ||
            logs="differ: $(diff <(cut -d, -f1-4 $a/train_log.csv) <(cut -d, -f1-4 $n/train_log.csv) | grep -c '^>') lines"
        echo "bitwise $name (--grad-clip $clip): checkpoints $verdict; step,loss,grad_norm,lr $logs" >> $S
    }
    bitwise ulysses2 1e9 --sample-every 0 --gpus 2 --sp-ulysses 2
    bitwise ring2 1e9 --sample-every 0 --gpus 2 --sp-ring 2
    # (samples at step 4, where no checkpoint gathered the slices: the EMA-only gather makes that grid)
    bitwise dp2_samples 1e9 --sample-every 4 --samples-per-class 1 --sample-steps 4 --gpus 2
    bitwise one_gpu 1 --sample-every 0
    # 3. planted bugs: zero1/* must FAIL (rc 1)
    local p pids=()
    for p in nogather offset localnorm; do
        step planted_$p 40 $B/test_distributed_$p --jobs 1 --verbose --filter 'zero1/sharded*' &
        pids+=($!)
    done
    wait "${pids[@]}"
    for p in nogather offset localnorm; do
        echo "planted_$p: zero1/sharded* $(grep -h Synthesis $W/planted_$p.txt 2>/dev/null || echo 'no result') (want Failing: 1)" >> $S
    done
    wait $bg
    echo "correctness done at $(( $(date +%s) - T0 )) s" >> $S
    # 4. time per step (no NCCL logging), main and branch interleaved: 30,976 then 16,384 tokens,
    #    then a second round at 30,976, DiT-S data parallel, the default clip's checkpoints
    #    (information), the fault tests
    local big="--device gpu --data synthetic --model S --hidden 2048 --heads 16 --depth 4 --batch 1 --attn sage --ckpt-every 0 --sample-every 0 --seed 1 --steps 10 --gpus 2"
    timed() {   # size rep mode
        local m=$3 args="--sp-ulysses 2"; [ $m = ring2 ] && args="--sp-ring 2"
        local b
        for b in main new; do
            local bin=train_dit; [ $b = main ] && bin=train_dit_main
            step t$1_${m}_${b}_$2 25 $B/$bin $big --image-size $1 $args --out $W/t$1_${m}_${b}_$2
        done
    }
    timed 352 1 ulysses2; timed 352 1 ring2; timed 256 1 ulysses2; timed 256 1 ring2
    timed 352 2 ulysses2; timed 352 2 ring2
    # the small step (host-bound: three NCCL calls per step instead of one), data parallel
    local b
    for b in main new; do
        local bin=train_dit; [ $b = main ] && bin=train_dit_main
        step s_dp2_$b 25 $B/$bin --device gpu --data synthetic --model S --batch 8 --attn sage --steps 30 --ckpt-every 0 \
            --sample-every 0 --seed 1 --gpus 2 --out $W/s_dp2_$b
        echo "time DiT-S batch 8 dp2 $b: median ms of steps 4-30 = $(awk -F, '$1 ~ /^[0-9]+$/ && $1 >= 4 {print $5}' \
            $W/s_dp2_$b/train_log.csv 2>/dev/null | sort -g | awk '{a[NR]=$1} END {print NR ? a[int((NR+1)/2)] : "no run"}')" >> $S
    done
    bitwise ulysses2_defaultclip 1 --sample-every 0 --gpus 2 --sp-ulysses 2
    step test_faults 60 $B/test_distributed_cuda --jobs 3 --verbose --filter 'faults/*'
    echo "test_distributed_cuda faults/* rc=$? (want 0): $(grep Synthesis $W/test_faults.txt)" >> $S
    local size m
    for size in 352 256; do
        for m in ulysses2 ring2; do
            for b in main new; do
                local all="" rep
                for rep in 1 2; do
                    local f=$W/t${size}_${m}_${b}_$rep/train_log.csv
                    [ -f $f ] && all="$all $(awk -F, '$1 ~ /^[0-9]+$/ && $1 >= 4 && $1 <= 10 {printf "%s ", $5}' $f)"
                done
                [ -z "${all// /}" ] && { echo "time $size $m $b: no run" >> $S; continue; }
                echo "time $size $m $b: median ms of steps 4-10 = $(echo $all | tr ' ' '\n' | sort -g | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2), "(" NR " steps)"}')" >> $S
            done
        done
    done
    echo "total $(( $(date +%s) - T0 )) s" >> $S
    tar czf $OUT/zero1_logs.tgz --exclude='*.safetensors' -C /tmp zero1_logs
    grep -h -E "ZeRO-1 vs|step [0-9]: loss|negative control|Synthesis" $W/test_zero1.txt | tail -24
    cat $W/steps.txt $S
}

case $MODE in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash dev/zero1_gpu.sh prepare | bash .devrun_zero1/zero1_gpu.sh run"; exit 2 ;;
esac
