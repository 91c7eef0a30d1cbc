#!/usr/bin/env bash
# Validation of train_dit's one-step-in-flight loop (branch step-pipeline) on the 2-GPU machine:
# the same checkpoints and logged losses as main's synchronous loop (1 GPU, Ulysses 2, ring 2,
# data parallel 2), the NCCL fault tests (a dead rank ends the other's queued step), and the time
# per step of both binaries (1 GPU, Ulysses 2, ring 2 at 16K and 31K tokens; no NCCL logging).
#   here:  bash dev/step_pipeline_gpu.sh prepare          (fills /work/main/.devrun_pipe)
#   there: bash .devrun_pipe/step_pipeline_gpu.sh run     (nvidia-h200-x2, carry .devrun_pipe, .devlibs)
set -uo pipefail
DIR=.devrun_pipe

prepare() {
    make -j2 train_dit build/test_distributed_cuda build/test_dit_gpu_cuda
    rm -rf /work/main/$DIR && mkdir -p /work/main/$DIR
    cp /work/main/train_dit /work/main/$DIR/train_dit_main
    cp train_dit /work/main/$DIR/train_dit_new
    cp build/test_distributed_cuda build/test_dit_gpu_cuda dev/step_pipeline_gpu.sh /work/main/$DIR/
    # planted: finish_step reads the scalars without waiting for the step (must change the logs)
    sed 's/^    wait_step(tr, s);$/    (void)wait_step;/' train_dit.c > build/train_dit_planted.c
    grep -q '(void)wait_step;' build/train_dit_planted.c || { echo "planting failed" >&2; exit 1; }
    cc -O3 -std=c11 -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include -DDIT_NCCL \
        -o /work/main/$DIR/train_dit_planted build/train_dit_planted.c build/libditc.a -lm -lpthread \
        -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++ -lnccl
    strip /work/main/$DIR/train_dit_* /work/main/$DIR/test_*
    du -sh /work/main/$DIR
}

run() {
    export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
    local L=/tmp/pipe_logs S=/tmp/pipe_logs/summary.txt T0=$SECONDS
    rm -rf $L && mkdir -p $L
    { nvidia-smi -L; date -u; } > $L/gpu.txt
    # bitwise: checkpoints and the step,loss,grad_norm columns, main vs new
    local small="--device gpu --data synthetic --steps 6 --ckpt-every 3 --sample-every 0 --seed 3 --deterministic"
    for cfg in "one --attn sage --image-size 32 --patch 2 --hidden 384 --heads 6 --depth 2 --batch 8" \
               "one_samples --attn sage --image-size 32 --patch 2 --hidden 384 --heads 6 --depth 2 --batch 8 --sample-every 4 --samples-per-class 1" \
               "ulysses2 --attn sage --model S --batch 8 --gpus 2 --sp-ulysses 2" \
               "ring2 --attn sage --model S --batch 8 --gpus 2 --sp-ring 2" \
               "dp2 --attn sage --model S --batch 8 --gpus 2"; do
        set -- $cfg; local name=$1; shift
        for b in main new; do
            timeout 60 $DIR/train_dit_$b $small "$@" --out $L/bit_${name}_$b > $L/bit_${name}_$b.log 2>&1
        done
        local verdict="EQUAL" f
        for f in ckpt_000003.safetensors ckpt_000006.safetensors; do
            cmp -s $L/bit_${name}_main/$f $L/bit_${name}_new/$f || verdict="DIFFERENT ($f)"
        done
        [ -f $L/bit_${name}_main/ckpt_000006.safetensors ] || verdict="main run FAILED"
        [ -f $L/bit_${name}_new/ckpt_000006.safetensors ] || verdict="new run FAILED"
        diff -q <(cut -d, -f1-4 $L/bit_${name}_main/train_log.csv) <(cut -d, -f1-4 $L/bit_${name}_new/train_log.csv) \
            > /dev/null 2>&1 || verdict="$verdict; logs differ"
        if [ "$name" = one_samples ]; then
            for f in $(cd $L/bit_${name}_main && ls *.png 2>/dev/null); do
                cmp -s $L/bit_${name}_main/$f $L/bit_${name}_new/$f || verdict="$verdict; $f differs"
            done
        fi
        echo "bitwise $name: $verdict" >> $S
    done
    timeout 60 $DIR/train_dit_planted $small --attn sage --model S --batch 8 --gpus 2 --sp-ulysses 2 \
        --out $L/planted > $L/planted.log 2>&1
    diff -q <(cut -d, -f1-4 $L/bit_ulysses2_main/train_log.csv) <(cut -d, -f1-4 $L/planted/train_log.csv) > /dev/null 2>&1 \
        && echo "planted (no wait before the read): logs EQUAL (the check cannot see it)" >> $S \
        || echo "planted (no wait before the read): logs differ (want: differ)" >> $S
    echo "bitwise done at $((SECONDS - T0)) s" >> $S
    timeout 150 $DIR/test_distributed_cuda --jobs 1 --verbose > $L/test_distributed.log 2>&1
    echo "test_distributed_cuda rc=$?: $(grep Synthesis $L/test_distributed.log)" >> $S
    timeout 60 $DIR/test_dit_gpu_cuda --jobs 4 > $L/test_dit_gpu.log 2>&1
    echo "test_dit_gpu_cuda rc=$?: $(grep Synthesis $L/test_dit_gpu.log)" >> $S
    # time per step, interleaved main/new
    local big="--device gpu --data synthetic --model S --hidden 2048 --heads 16 --depth 4 --batch 1 --attn sage --ckpt-every 0 --sample-every 0 --seed 1 --steps 10"
    for size in 352 256; do
        for mode in "1gpu" "ulysses2 --gpus 2 --sp-ulysses 2" "ring2 --gpus 2 --sp-ring 2"; do
            set -- $mode; local m=$1; shift
            for b in main new; do
                [ $((SECONDS - T0)) -gt 330 ] && { echo "t${size}_${m}_$b: skipped (time)" >> $S; continue; }
                timeout 60 $DIR/train_dit_$b $big --image-size $size "$@" --out $L/t${size}_${m}_$b > $L/t${size}_${m}_$b.log 2>&1
                local med=$(tail -n +5 $L/t${size}_${m}_$b/train_log.csv 2>/dev/null | cut -d, -f5 | sort -g | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print "FAILED"}')
                echo "t${size} $m $b: median ms/step (steps 4-10) $med" >> $S
            done
        done
    done
    echo "total $((SECONDS - T0)) s" >> $S
    tar czf $OUT/pipe_logs.tgz --exclude='*.safetensors' -C /tmp pipe_logs
    cat $S
}

case "${1:-}" in prepare) prepare ;; run) run ;; *) echo "usage: $0 prepare|run" >&2; exit 2 ;; esac
