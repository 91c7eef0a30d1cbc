#!/usr/bin/env bash
# fp8-fuse (dev/notes_linear_fp8.md, "fp8-fuse"): the amax of what the FP8 block linears quantize
# taken by the kernels that write it, validated and timed on one H200 in one device call, in
# priority order: the layer tests (each producer's amax exact, the layer given an amax writes the
# same bytes) and four planted bugs that must fail them; the model test (producers' amax against
# the linears' own passes: bitwise the same step) and a planted bug; 6 training steps
# (--deterministic, checkpoint at 6) with this tree's and main's train_dit, fp8 and bf16, whose
# checkpoints must be byte-identical; ms/step at config c and d, bf16 and fp8, this tree against
# main, interleaved twice; the layer benchmark if time is left.
#   here (nvcc, no GPU), from the tree root:  bash dev/fp8_fuse_gpu.sh prepare [DIR]
#       builds DIR (default /work/main/.devrun_fp8f, git-ignored there) with stripped binaries and
#       this script; BASE_BIN (default /work/main/train_dit) is main's train_dit, timed beside
#       this tree's (its commit: `git -C /work/main rev-parse HEAD`, written to DIR/BASE)
#   GPU machine, from /work/main, carrying DIR and .devlibs (Criterion's runtime libraries):
#       run(command="bash .devrun_fp8f/fp8_fuse_gpu.sh run .devrun_fp8f", kind="nvidia-h200",
#           carry=[".devrun_fp8f", ".devlibs"], timeout_s=240)
#   Every step runs under `timeout -k 3`, all within BUDGET_S (default 210 s); $OUT/summary.txt grows
#   step by step (a cut call still returns it); 5 text files come back (summary, report, tests.log,
#   train.log, bench.log), no checkpoints.
# Merge if: every test passes (rc 0) and every planted build fails (rc 1); the fp8 and bf16
# checkpoints EQUAL main's; config c with fp8 >= 0.8 ms/step faster than main in both rounds;
# bf16 within noise of main's (|difference| <= 0.5 ms at c).
set -uo pipefail

prepare() {
    set -e
    local D=${1:-/work/main/.devrun_fp8f}
    local BASE_BIN=${BASE_BIN:-/work/main/train_dit}
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
    local NVFLAGS="-O3 -std=c++17 -I. --use_fast_math -Xcompiler -Wall -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local CFLAGS="-O2 -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    local LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && LIBS="$LIBS -lnccl" && NVFLAGS="$NVFLAGS -DDIT_NCCL" && CFLAGS="$CFLAGS -DDIT_NCCL"
    local B=build/fp8_fuse_dev
    make -j2 train_dit build/libditc.a
    rm -rf "$D" "$B" && mkdir -p "$D" "$B/lastblock/layers"
    # the planted bugs, each checked to change its source:
    #   lastblock: block_amax_update drops the last block of every grid (the gelu, merge_heads and
    #          gated-residual layer tests must fail: their largest value sits in that block)
    #   lastrow: the LayerNorm-modulate kernel drops the last row's amax (its layer test must fail)
    #   ignored: the FP8 layer ignores a given amax and takes its own (given_amax test must fail)
    #   slot:  the model's fc2 backward reads fc1's dout amax slot (the model's bitwise test must fail)
    sed 's/if (threadIdx.x != 0) return;\(.*\)$/if (threadIdx.x != 0 || blockIdx.x == gridDim.x - 1) return;\1/' \
        layers/cuda_common.cuh > $B/lastblock/layers/cuda_common.cuh
    sed 's/if (AMAX) amax_update(out_amax, vmax);/if (AMAX \&\& row != rows - 1) amax_update(out_amax, vmax);/' \
        layers/norm_cuda.cu > $B/planted_lastrow.cu
    sed 's/const float \*amax = given_amax;/const float *amax = NULL;/' layers/linear_fp8_cuda.cu > $B/planted_ignored.cu
    sed 's/BT, 4 \* h, h, q8.dout_amax.fc2, q8.dout_amax.fc1, err));/BT, 4 * h, h, q8.dout_amax.fc1, q8.dout_amax.fc1, err));/' \
        model/dit_gpu.cu > $B/planted_slot.cu
    cmp -s layers/cuda_common.cuh $B/lastblock/layers/cuda_common.cuh && { echo "planted lastblock: sed changed nothing" >&2; exit 1; }
    cmp -s layers/norm_cuda.cu $B/planted_lastrow.cu && { echo "planted lastrow: sed changed nothing" >&2; exit 1; }
    cmp -s layers/linear_fp8_cuda.cu $B/planted_ignored.cu && { echo "planted ignored: sed changed nothing" >&2; exit 1; }
    cmp -s model/dit_gpu.cu $B/planted_slot.cu && { echo "planted slot: sed changed nothing" >&2; exit 1; }
    # lastblock: the producers' files compiled against the planted header (found first on -I)
    $NVCC -I$B/lastblock $NVFLAGS -c -o $B/lastblock_pointwise.o layers/pointwise_cuda.cu &
    $NVCC -I$B/lastblock $NVFLAGS -c -o $B/lastblock_reshape.o layers/reshape_cuda.cu &
    wait
    $NVCC $NVFLAGS -c -o $B/planted_lastrow.o $B/planted_lastrow.cu &
    $NVCC $NVFLAGS -c -o $B/planted_ignored.o $B/planted_ignored.cu &
    wait
    $NVCC $NVFLAGS -c -o $B/planted_slot.o $B/planted_slot.cu
    local LIB=build/libditc.a T=test/test_linear_fp8_cuda.c
    # the planted objects come first: the archive's own members are then never pulled in (a clash
    # would be a duplicate-symbol link error, not a silent pick)
    cc $CFLAGS -o $D/test_linear_fp8_cuda $T $LIB $LIBS -lcriterion
    cc $CFLAGS -o $D/test_linear_fp8_planted_lastblock $T $B/lastblock_pointwise.o $B/lastblock_reshape.o $LIB $LIBS -lcriterion
    cc $CFLAGS -o $D/test_linear_fp8_planted_lastrow $T $B/planted_lastrow.o $LIB $LIBS -lcriterion
    cc $CFLAGS -o $D/test_linear_fp8_planted_ignored $T $B/planted_ignored.o $LIB $LIBS -lcriterion
    cc $CFLAGS -o $D/test_dit_fp8_cuda test/test_dit_fp8_cuda.c $LIB $LIBS -lcriterion
    cc $CFLAGS -o $D/test_dit_fp8_planted_slot test/test_dit_fp8_cuda.c $B/planted_slot.o $LIB $LIBS -lcriterion
    cc $CFLAGS -o $D/test_layers_cuda test/test_layers_cuda.c $LIB $LIBS -lcriterion
    cc $CFLAGS -o $D/bench_linear_fp8 dev/bench_linear_fp8.c $LIB $LIBS
    cp train_dit $D/
    cp "$BASE_BIN" $D/train_dit_base
    strip $D/*
    echo "$(git -C "$(dirname "$BASE_BIN")" rev-parse HEAD) ($BASE_BIN)" > $D/BASE
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > $D/HEAD
    cp dev/fp8_fuse_gpu.sh $D/
    du -sh "$D"
}

run() {
    local D=${1:-.devrun_fp8f} O=${OUT:-fp8_fuse_out} L
    L=$(mktemp -d)
    mkdir -p $O
    export LD_LIBRARY_PATH=$PWD/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    local S=$O/summary.txt deadline=$((SECONDS + ${BUDGET_S:-210}))
    : > $S
    # step NAME SECONDS LOG COMMAND...: runs under timeout -k 3 (cut at the deadline), appends its
    # output to LOG, its rc and last line to the summary
    step() {
        local name=$1 t=$2 log=$3; shift 3
        [ $t -gt $((deadline - SECONDS)) ] && t=$((deadline - SECONDS))
        if [ $t -lt 2 ]; then echo "$name: skipped (deadline)" >> $S; return; fi
        echo "=== $name" >> $log
        timeout -k 3 $t "$@" >> $log 2>&1
        local rc=$?
        echo "$name: rc=$rc$([ $rc -ge 124 ] && echo ' (cut by timeout)') ($(tail -n 1 $log | cut -c1-200)) at $SECONDS s" >> $S
    }
    echo "binaries of $(cat $D/HEAD 2>/dev/null); base (main) $(cat $D/BASE 2>/dev/null)" >> $S
    timeout -k 3 10 nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $S 2>&1

    # 1. the layer: every test (the producers' amax, the given amax, and the earlier ones), the
    #    planted bugs (must FAIL: rc 1), the bf16 layers' tests (the producers' NULL path)
    step layer_tests 50 $O/tests.log $D/test_linear_fp8_cuda --verbose --jobs 4
    step layer_planted_lastblock 15 $O/tests.log $D/test_linear_fp8_planted_lastblock --filter 'linear_fp8/*_takes_the_amax*'
    step layer_planted_lastrow 15 $O/tests.log $D/test_linear_fp8_planted_lastrow --filter 'linear_fp8/layernorm*'
    step layer_planted_ignored 15 $O/tests.log $D/test_linear_fp8_planted_ignored --filter 'linear_fp8/given_amax*'
    step layers_cuda 30 $O/tests.log $D/test_layers_cuda --jobs 4

    # 2. the model: FP8 vs bf16 and producers' amax vs the linears' own (bitwise); planted slot
    step model_fp8 60 $O/tests.log $D/test_dit_fp8_cuda --verbose
    step model_planted_slot 25 $O/tests.log $D/test_dit_fp8_planted_slot --filter 'dit_fp8/producer_amax*'

    # 3. bitwise against main: 6 deterministic steps of DiT-S, checkpoint at 6, fp8 and bf16
    local CK="--device gpu --data synthetic --model S --batch 8 --image-size 32 --steps 6 --ckpt-every 6 --sample-every 0 --seed 5 --deterministic"
    for lin in fp8 bf16; do
        step ckpt_${lin}_new 25 $O/train.log $D/train_dit $CK --linear $lin --out $L/k_${lin}_new
        step ckpt_${lin}_base 25 $O/train.log $D/train_dit_base $CK --linear $lin --out $L/k_${lin}_base
        if cmp $L/k_${lin}_new/ckpt_000006.safetensors $L/k_${lin}_base/ckpt_000006.safetensors >> $S 2>&1; then
            echo "ckpt_${lin}_cmp: EQUAL" >> $S
        else
            echo "ckpt_${lin}_cmp: DIFFERENT (or missing)" >> $S
        fi
    done

    # 4. ms/step: config c (16K tokens) and d (32761), this tree (new) and main (base), interleaved
    local RUN="--device gpu --data synthetic --model S --attn sage --steps 12 --ckpt-every 0 --sample-every 0 --seed 1"
    local C="$RUN --hidden 2048 --heads 16 --depth 4 --batch 1 --image-size 256"
    local DD="$RUN --hidden 2048 --heads 16 --depth 4 --batch 1 --image-size 362"
    for k in 1 2; do
        for lin in fp8 bf16; do
            for who in new base; do
                local bin=$D/train_dit; [ $who = base ] && bin=$D/train_dit_base
                step c_${lin}_${who}_$k 30 $O/train.log $bin $C --linear $lin --out $L/c_${lin}_${who}_$k
            done
        done
    done
    # config d (its second round after the benchmark: the rule reads config c)
    for k in 1 2; do
        for lin in fp8 bf16; do
            for who in new base; do
                local bin=$D/train_dit; [ $who = base ] && bin=$D/train_dit_base
                step d_${lin}_${who}_$k 30 $O/train.log $bin $DD --linear $lin --out $L/d_${lin}_${who}_$k
            done
        done
        # 5. the layer benchmark (this tree)
        [ $k = 1 ] && step bench_linear_fp8 40 $O/bench.log $D/bench_linear_fp8
    done
    find $L -name '*.safetensors' -delete

    # the report: ms/step (median of steps 4..12 of train_log.csv's ms column) and the rule's numbers
    median_ms() { awk -F, 'NR > 1 && $1 >= 4 && $1 <= 12 {print $5}' $L/$1/train_log.csv 2>/dev/null | sort -g |
        awk '{v[NR] = $1} END {if (NR == 9) print v[5]; else print "n/a"}'; }
    loss_at() { awk -F, -v s=$2 'NR > 1 && $1 == s {print $2}' $L/$1/train_log.csv 2>/dev/null; }
    diff_or_na() { awk -v a="$1" -v b="$2" 'BEGIN {if (a + 0 == 0 || b + 0 == 0) print "n/a"; else printf "%.2f\n", a - b}'; }
    {
        echo "== ms/step (median of steps 4-12), base (main) - new per round: > 0 means this tree is faster"
        for cfg in c d; do
            for lin in fp8 bf16; do
                local n1=$(median_ms ${cfg}_${lin}_new_1) b1=$(median_ms ${cfg}_${lin}_base_1)
                local n2=$(median_ms ${cfg}_${lin}_new_2) b2=$(median_ms ${cfg}_${lin}_base_2)
                echo "$cfg $lin: new $n1 $n2 | base $b1 $b2 | base - new $(diff_or_na "$b1" "$n1") $(diff_or_na "$b2" "$n2") ms;" \
                     "loss at step 12: new $(loss_at ${cfg}_${lin}_new_1 12), base $(loss_at ${cfg}_${lin}_base_1 12)"
            done
        done
        echo "== checkpoints after 6 deterministic steps (must be EQUAL)"
        grep -E '^ckpt_' $S
        echo "== loss at step 6: fp8 new $(loss_at k_fp8_new 6) base $(loss_at k_fp8_base 6); bf16 new $(loss_at k_bf16_new 6) base $(loss_at k_bf16_base 6)"
        echo "== producers' amax vs the linears' own (model test)"
        grep -E "producers' amax" $O/tests.log
        echo "== planted tests (rc must be 1)"
        grep -E '^(layer|model)_planted' $S
        echo "== tests (rc must be 0)"
        grep -E '^(layer_tests|layers_cuda|model_fp8):' $S
    } > $O/report.txt 2>&1
    echo "=== summary"; cat $S; echo "=== report"; cat $O/report.txt
    echo "=== bench (tail)"; tail -n 14 $O/bench.log 2>/dev/null
    rm -rf $L
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash dev/fp8_fuse_gpu.sh prepare [DIR] | run [DIR]" >&2; exit 2 ;;
esac
