#!/usr/bin/env bash
# One-call GPU validation of branch rot-wide: the Hadamard rotation (hadamard_cuda.cu) and the
# model's fused head split / gradient merge (model/dit_gpu.cu) with 8 values per lane and D/8
# lanes per row (16-byte accesses) instead of one warp per row.
#   here:  bash dev/rot_wide_gpu.sh prepare     (builds .devrun_rot/ in /work/main, from this tree
#          and from main's build: train_dit_main, the kernel-time library)
#   there: run(command="bash .devrun_rot/rot_wide_gpu.sh run", carry=[".devrun_rot", ".devlibs"],
#          timeout_s=150)
# Checks, in order (each under its own timeout): test_hadamard_cuda (the transform bitwise against
# the CPU, D = 32/64/128, partial warps), test_dit_gpu_cuda (one step against the CPU, rotated
# cases), a planted build (v rotated too) that must FAIL the rotated one-step test, then the
# end-to-end bit check: 4 steps of train_dit --deterministic from main and from this branch,
# checkpoints compared byte for byte (D = 64 with 6 heads: warps holding q, k and v rows at once;
# D = 128), and the kernel time per step of split_qkv_kernel / merge_qkv_grad_kernel in both
# (CUPTI, dev/kernel_times.c) at config a of bench_step (DiT-B/2, 256 tokens × 64).
set -uo pipefail
DIR=.devrun_rot
prepare() {
    set -e
    local MAIN=${MAIN:-/work/main}
    local OUTDIR=$MAIN/$DIR
    make -j2 train_dit build/test_hadamard_cuda build/test_dit_gpu_cuda build/libditc.a
    rm -rf "$OUTDIR" && mkdir -p "$OUTDIR" build/planted_rot
    cp train_dit "$OUTDIR/train_dit_new"
    cp "$MAIN/train_dit" "$OUTDIR/train_dit_main"
    cp build/test_hadamard_cuda build/test_dit_gpu_cuda dev/rot_wide_gpu.sh "$OUTDIR/"
    cp "$MAIN/build/libkernel_times.so" "$OUTDIR/"
    # planted: v rows rotated too (the select in rotate_if ignored)
    local SRC=model/dit_gpu.cu
    grep -q 'if (rotate) rotate_if<D>(x, which < 2, norm);' $SRC
    sed 's/if (rotate) rotate_if<D>(x, which < 2, norm);/if (rotate) rotate_if<D>(x, true, norm);/' $SRC > build/planted_rot/dit_gpu.cu
    cmp -s $SRC build/planted_rot/dit_gpu.cu && { echo "planted: sed changed nothing" >&2; exit 1; }
    /usr/local/cuda/bin/nvcc -O3 -std=c++17 -I. --use_fast_math -gencode=arch=compute_90a,code=sm_90a -DDIT_NCCL \
        -c -o build/planted_rot/dit_gpu.o build/planted_rot/dit_gpu.cu
    cc -O2 -std=c11 -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include -DDIT_NCCL \
        -o "$OUTDIR/test_dit_gpu_cuda_planted" test/test_dit_gpu_cuda.c build/planted_rot/dit_gpu.o build/libditc.a \
        -lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++ -lnccl -lcriterion
    strip "$OUTDIR"/test_* "$OUTDIR"/train_dit_*
    du -sh "$OUTDIR"
}
run() {
    local L=/tmp/rotlogs S=$OUT/summary.txt
    mkdir -p $L
    export LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
    step() { local name=$1 limit=$2; shift 2; timeout -k 5 $limit "$@" > $L/$name.log 2>&1; local rc=$?
        echo "$name rc=$rc: $(grep -E 'Synthesis|differ|identical' $L/$name.log | tail -1)" >> $S; }
    { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; } > $L/gpu.txt
    step test_hadamard 30 $DIR/test_hadamard_cuda --verbose                    # want 0
    step test_dit_gpu 60 $DIR/test_dit_gpu_cuda --verbose --jobs 4            # want 0
    step planted 30 $DIR/test_dit_gpu_cuda_planted --verbose --filter 'dit_gpu/*rotated*'   # want != 0
    local common="--device gpu --data synthetic --attn sage --steps 4 --ckpt-every 4 --sample-every 0 --deterministic --seed 3"
    for cfg in "d64 --image-size 32 --patch 2 --hidden 384 --heads 6 --depth 2 --batch 8" \
               "d128 --image-size 64 --patch 2 --hidden 512 --heads 4 --depth 2 --batch 2"; do
        set -- $cfg; local name=$1; shift
        for b in main new; do timeout 60 $DIR/train_dit_$b $common "$@" --out $L/${name}_$b > $L/${name}_$b.log 2>&1; done
        if [ ! -f $L/${name}_main/ckpt_000004.safetensors ] || [ ! -f $L/${name}_new/ckpt_000004.safetensors ]; then
            echo "bitwise $name: a run failed (see ${name}_*.log)" >> $S
        elif cmp -s $L/${name}_main/ckpt_000004.safetensors $L/${name}_new/ckpt_000004.safetensors; then
            echo "bitwise $name: checkpoints identical (want identical)" >> $S
        else echo "bitwise $name: checkpoints differ" >> $S; fi
    done
    for b in main new; do
        LD_PRELOAD=$DIR/libkernel_times.so KERNEL_TIMES_OUT=$L/kt_$b.txt timeout 90 $DIR/train_dit_$b --device gpu \
            --data synthetic --attn sage --image-size 32 --patch 2 --hidden 768 --depth 12 --heads 12 --batch 64 \
            --steps 9 --ckpt-every 0 --sample-every 0 --out $L/a_$b > $L/a_$b.log 2>&1
        echo "config a, $b: ns over 9 steps: $(grep -E 'split_qkv|merge_qkv|hadamard' $L/kt_$b.txt | awk '{printf "%s %s; ", $1, $3}')" >> $S
        echo "config a, $b: step ms (train_dit log, steps 5-9): $(tail -5 $L/a_$b/train_log.csv | cut -d, -f5 | tr '\n' ' ')" >> $S
    done
    tar czf $OUT/logs.tgz -C /tmp rotlogs; cat $S
}
case "${1:-}" in prepare) prepare ;; run) run ;; *) echo "usage: $0 prepare|run" >&2; exit 2 ;; esac
