#!/usr/bin/env bash
# Branch attn-token-out on the GPU machine in one call: the attention writes its output straight
# into the projection's input and reads dout from its gradient (*_merged_cuda, attention_rows.cuh).
#   here (nvcc, no GPU), in the branch's worktree:  bash dev/attn_merged_gpu.sh prepare DIR [BASE_BIN]
#       builds DIR/ (git-ignored, e.g. /work/main/.devrun_tok): this tree's GPU tests, two planted
#       builds of test_sage_cuda (attn_row_offset with batch and head swapped; the sm90 backward's dO
#       map with head-major token strides), train_dit, main's train_dit (BASE_BIN, default
#       /work/main/train_dit) as train_dit_base, and this script.
#   GPU machine (two H200s for the sequence-parallel model test), from the tree root:
#       bash DIR/attn_merged_gpu.sh run DIR      (carry DIR and .devlibs; NCCL_NVLS_ENABLE=0)
#       writes $OUT/summary.txt (one line per step, then the report) and the logs.
# Merge rule (set before the run): every test passes (rc 0), both planted builds fail (rc 1), the
# checkpoints after 6 deterministic steps are byte-identical to main's for sage, bf16 and sage + FP8
# (batch 8: B > 1), config c with FP8 is >= 0.3 ms/step faster than main in both rounds, and no
# timed row is more than 0.5 ms slower.
set -uo pipefail

prepare() {
    set -e
    local D=$1 BASE_BIN=${2:-/work/main/train_dit}
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc} B
    local NVFLAGS="-O3 -std=c++17 --use_fast_math -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local CFLAGS="-O2 -std=c11 -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    local LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && { LIBS="$LIBS -lnccl"; CFLAGS="$CFLAGS -DDIT_NCCL"; }
    B=$(mktemp -d)
    rm -rf "$D" && mkdir -p "$D"
    make -j2 train_dit build/libditc.a build/test_sage_cuda build/test_flash_cuda build/test_dit_gpu_cuda \
        build/test_dit_fp8_cuda build/test_step_graph_cuda build/test_attention_determinism_cuda \
        build/test_sage_forward_sm90_cuda build/test_hadamard_cuda build/test_sp_model_cuda
    # planted 1: batch and head swapped in the merged row offset (every merged call)
    sed 's|int b = bh / merged_heads, h = bh % merged_heads;|int b = bh % merged_heads, h = bh / merged_heads;|' \
        attention/attention_rows.cuh > $B/rows_swapped.cuh
    cmp -s attention/attention_rows.cuh $B/rows_swapped.cuh && { echo "planted swap: sed changed nothing" >&2; exit 1; }
    # planted 2: the sm90 backward's dO map steps one row of D per token also when merged
    sed 's|cuuint64_t strides\[3\] = {row \* h,|cuuint64_t strides[3] = {row,|' attention/backward_sm90.cuh > $B/bwd_stride.cuh
    cmp -s attention/backward_sm90.cuh $B/bwd_stride.cuh && { echo "planted stride: sed changed nothing" >&2; exit 1; }
    # each planted build: the attention sources compiled against the planted header (in a copy of
    # attention/), linked before the archive so that its members are never pulled in
    for p in swap stride; do
        local T=$B/tree_$p
        mkdir -p $T/attention $T/layers
        cp attention/*.cu attention/*.cuh attention/*.h $T/attention/
        cp layers/*.h layers/*.cuh $T/layers/
        [ $p = swap ] && cp $B/rows_swapped.cuh $T/attention/attention_rows.cuh
        [ $p = stride ] && cp $B/bwd_stride.cuh $T/attention/backward_sm90.cuh
        local objs=""
        for f in sage_quant sage_forward sage_forward_sm90 sage_backward sage_backward_sm90 flash_forward \
                 flash_forward_sm90 flash_backward flash_backward_sm90; do
            $NVCC $NVFLAGS -I$T -I. -c -o $T/$f.o $T/attention/$f.cu
            objs="$objs $T/$f.o"
        done
        cc $CFLAGS -o $D/test_sage_planted_$p test/test_sage_cuda.c $objs build/libditc.a $LIBS -lcriterion
    done
    cp build/test_sage_cuda build/test_flash_cuda build/test_dit_gpu_cuda build/test_dit_fp8_cuda \
        build/test_step_graph_cuda build/test_attention_determinism_cuda build/test_sage_forward_sm90_cuda \
        build/test_hadamard_cuda build/test_sp_model_cuda train_dit $D/
    cp "$BASE_BIN" $D/train_dit_base
    strip $D/*
    echo "$(git -C "$(dirname "$BASE_BIN")" rev-parse --short HEAD) ($BASE_BIN)" > $D/BASE
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > $D/HEAD
    cp dev/attn_merged_gpu.sh $D/
    rm -rf $B
    du -sh "$D"
}

run() {
    local D=${1:-.devrun_tok} O=${OUT:-attn_merged_out} L
    L=$(mktemp -d)
    mkdir -p $O
    export LD_LIBRARY_PATH=$PWD/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} NCCL_NVLS_ENABLE=0
    local S=$O/summary.txt deadline=$((SECONDS + ${BUDGET_S:-400}))
    : > $S
    step() {   # step NAME SECONDS LOG COMMAND...: rc and last line into the summary
        local name=$1 t=$2 log=$3; shift 3
        [ $t -gt $((deadline - SECONDS)) ] && t=$((deadline - SECONDS))
        if [ $t -lt 2 ]; then echo "$name: skipped (deadline)" >> $S; return; fi
        echo "=== $name" >> $log
        CUDA_VISIBLE_DEVICES=${GPU:-0} timeout -k 3 $t "$@" >> $log 2>&1
        local rc=$?
        echo "$name: rc=$rc$([ $rc -ge 124 ] && echo ' (cut by timeout)') ($(tail -n 1 $log | cut -c1-160)) at $SECONDS s" >> $S
    }
    echo "binaries of $(cat $D/HEAD 2>/dev/null); base (main) $(cat $D/BASE 2>/dev/null)" >> $S
    timeout -k 3 10 nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $S 2>&1

    # 1. on GPU 1, beside 2 and 3 on GPU 0: the merged calls against the head-major ones (bitwise),
    #    the planted builds (must FAIL: rc 1), then every other test of the attention and the model
    (
    export GPU=1
    step sage_merged 60 $O/tests.log $D/test_sage_cuda --verbose --filter 'sage_cuda/merged*'
    step flash_merged 60 $O/tests.log $D/test_flash_cuda --verbose --filter 'flash_cuda/merged*'
    step planted_swap 60 $O/tests.log $D/test_sage_planted_swap --filter 'sage_cuda/merged*'
    step planted_stride 60 $O/tests.log $D/test_sage_planted_stride --filter 'sage_cuda/merged*'
    step sage_all 90 $O/tests.log $D/test_sage_cuda --jobs 4
    step flash_all 60 $O/tests.log $D/test_flash_cuda --jobs 4
    step sage_sm90_fwd 40 $O/tests.log $D/test_sage_forward_sm90_cuda
    step determinism 60 $O/tests.log $D/test_attention_determinism_cuda
    step hadamard 40 $O/tests.log $D/test_hadamard_cuda
    step dit_gpu 90 $O/tests.log $D/test_dit_gpu_cuda --jobs 2
    step dit_fp8 60 $O/tests.log $D/test_dit_fp8_cuda --jobs 2
    step step_graph 60 $O/tests.log $D/test_step_graph_cuda
    ) &
    local tests=$!

    # 2. bitwise against main: 6 deterministic steps of DiT-S, batch 8, checkpoint at 6
    local CK="--device gpu --data synthetic --model S --batch 8 --image-size 32 --steps 6 --ckpt-every 6 --sample-every 0 --seed 5 --deterministic"
    for run in "sage --attn sage --linear bf16" "bf16 --attn bf16 --linear bf16" "fp8 --attn sage --linear fp8"; do
        set -- $run
        local name=$1; shift
        step ckpt_${name}_new 25 $O/train.log $D/train_dit $CK "$@" --out $L/k_${name}_new
        step ckpt_${name}_base 25 $O/train.log $D/train_dit_base $CK "$@" --out $L/k_${name}_base
        if cmp $L/k_${name}_new/ckpt_000006.safetensors $L/k_${name}_base/ckpt_000006.safetensors >> $S 2>&1; then
            echo "ckpt_${name}_cmp: EQUAL" >> $S
        else
            echo "ckpt_${name}_cmp: DIFFERENT (or missing)" >> $S
        fi
    done

    # 3. ms/step, new and main interleaved: config c (16K tokens) with FP8 linears, two rounds; config a
    #    (DiT-B/2, 256 tokens × 64) sage with FP8 and with bf16 linears; c bf16 one round
    local RUN="--device gpu --data synthetic --attn sage --steps 12 --ckpt-every 0 --sample-every 0 --seed 1"
    local C="$RUN --hidden 2048 --heads 16 --depth 4 --batch 1 --image-size 256 --patch 2"
    local A="$RUN --hidden 768 --heads 12 --depth 12 --batch 64 --image-size 32 --patch 2"
    timed() {   # timed NAME ARGS...: new then base
        local name=$1; shift
        step t_${name}_new 40 $O/train.log $D/train_dit "$@" --out $L/t_${name}_new
        step t_${name}_base 40 $O/train.log $D/train_dit_base "$@" --out $L/t_${name}_base
    }
    timed c_fp8_1 $C --linear fp8
    timed a_fp8_1 $A --linear fp8
    timed c_fp8_2 $C --linear fp8
    timed a_bf16_1 $A --linear bf16
    timed c_bf16_1 $C --linear bf16
    find $L -name '*.safetensors' -delete
    wait $tests
    # 4. the sequence-parallel model (both GPUs; its code path keeps the head-major layout)
    GPU=0,1 step sp_model 90 $O/sp.log $D/test_sp_model_cuda

    median_ms() { awk -F, 'NR > 1 && $1 >= 4 && $1 <= 12 {print $5}' $L/$1/train_log.csv 2>/dev/null | sort -g |
        awk '{v[NR] = $1} END {if (NR == 9) print v[5]; else print "n/a"}'; }
    {
        echo "== ms/step (median of steps 4-12): new | main | main - new (> 0: new faster)"
        for r in c_fp8_1 c_fp8_2 c_bf16_1 a_fp8_1 a_bf16_1; do
            local n=$(median_ms t_${r}_new) b=$(median_ms t_${r}_base)
            echo "$r: $n | $b | $(awk -v a="$b" -v b="$n" 'BEGIN {if (a + 0 == 0 || b + 0 == 0) print "n/a"; else printf "%+.2f\n", a - b}')"
        done
        echo "== memory plan (c, fp8): new, then main"
        grep -h "memory plan" $O/train.log | head -4 | cut -c1-400
    } >> $S
    cp -r $L/t_c_fp8_1_new/train_log.csv $O/c_fp8_new_log.csv 2>/dev/null
    rm -rf $L
    cat $S
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 prepare DIR [BASE_BIN] | run DIR" >&2; exit 2 ;;
esac
