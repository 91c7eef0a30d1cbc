#!/usr/bin/env bash
# Branch dgelu-dbias on the GPU machine in one call: with FP8 linears, fc1's bias gradient is summed in
# the dGELU pass that writes fc1's dout (gelu_backward_inplace_dbias_cuda: dbias_partial_kernel's
# chunks and order, so the same bits), instead of a separate pass reading that dout again (256 MB per
# block at c: ~0.25 ms per step by the count).
#   here:  bash dev/dgelu_dbias_gpu.sh prepare DIR BASE_BIN
#   GPU machine (one H200):  bash DIR/dgelu_dbias_gpu.sh run DIR      (carry DIR and .devlibs)
# Merge rule (set before the run): every test passes (rc 0), the planted build (the dbias sums the
# values before their bf16 rounding) fails, checkpoints (sage + FP8, sage + bf16 linears, bf16
# attention) and the deterministic losses at hidden 2048 / 768 equal main's, and the dGELU pass plus
# every dbias pass take >= 0.1 ms less kernel time per step at c with FP8 than main's (CUPTI).
set -uo pipefail

prepare() {
    set -e
    local D=$1 BASE_BIN=${2:-/work/wt-base/train_dit}
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc} B
    local NVFLAGS="-O3 -std=c++17 --use_fast_math -Xcompiler -fPIC -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local CFLAGS="-O2 -std=c11 -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    local LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && { LIBS="$LIBS -lnccl"; CFLAGS="$CFLAGS -DDIT_NCCL"; }
    B=$(mktemp -d)
    rm -rf "$D" && mkdir -p "$D"
    make -j2 train_dit build/libditc.a build/test_dit_gpu_cuda build/test_dit_fp8_cuda build/test_step_graph_cuda \
        build/test_layers_cuda build/test_linear_fp8_cuda
    # planted: the dbias sums the dGELU values before their bf16 rounding (not what is stored)
    python3 - "$B" <<'PY'
import sys
s = open("layers/pointwise_cuda.cu").read()
old = "            for (int j = 0; j < VEC; j++) v[j] = bf16_rounded(gelu_grad(x[j]) * v[j]);   // as stored"
assert old in s
s = s.replace(old, "            for (int j = 0; j < VEC; j++) v[j] = gelu_grad(x[j]) * v[j];")
open(sys.argv[1] + "/pointwise_cuda.cu", "w").write(s)
PY
    mkdir -p $B/p/layers && cp layers/*.h layers/*.cuh $B/p/layers/ && cp $B/pointwise_cuda.cu $B/p/layers/
    $NVCC $NVFLAGS -I$B/p -I. -c -o $B/p/pointwise_cuda.o $B/p/layers/pointwise_cuda.cu
    cc $CFLAGS -o $D/test_linear_fp8_planted test/test_linear_fp8_cuda.c $B/p/pointwise_cuda.o build/libditc.a $LIBS \
        -lcriterion
    # (not test_step_graph_cuda nor test_sp_model_cuda: the 64 MiB the device tool carries; the
    # deterministic checkpoints below run the step as a CUDA graph and compare it with main's)
    cp build/test_dit_gpu_cuda build/test_dit_fp8_cuda build/test_layers_cuda build/test_linear_fp8_cuda \
        train_dit $D/
    cp "$BASE_BIN" $D/train_dit_base
    strip $D/*
    echo "$(git -C "$(dirname "$BASE_BIN")" rev-parse --short HEAD) ($BASE_BIN)" > $D/BASE
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > $D/HEAD
    cp dev/dgelu_dbias_gpu.sh $D/
    rm -rf $B
    du -sh "$D"
}

run() {
    local D=${1:-.devrun_gd} O=${OUT:-dgelu_dbias_out} L
    L=$(mktemp -d)
    mkdir -p $O
    export LD_LIBRARY_PATH=$PWD/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    local S=$O/summary.txt deadline=$((SECONDS + ${BUDGET_S:-300}))
    : > $S
    step() {   # step NAME SECONDS LOG COMMAND...: rc and last line into the summary
        local name=$1 t=$2 log=$3; shift 3
        [ $t -gt $((deadline - SECONDS)) ] && t=$((deadline - SECONDS))
        if [ $t -lt 2 ]; then echo "$name: skipped (deadline)" >> $S; return; fi
        echo "=== $name" >> $log
        timeout -k 3 $t "$@" >> $log 2>&1
        local rc=$?
        echo "$name: rc=$rc$([ $rc -ge 124 ] && echo ' (cut by timeout)') ($(tail -n 1 $log | cut -c1-160)) at $SECONDS s" >> $S
    }
    echo "binaries of $(cat $D/HEAD 2>/dev/null); base (main) $(cat $D/BASE 2>/dev/null)" >> $S
    timeout -k 3 10 nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $S 2>&1

    # 1. tests, and the planted builds (must FAIL: rc 1)
    step layers 90 $O/tests.log $D/test_layers_cuda --jobs 4
    step linear_fp8 90 $O/tests.log $D/test_linear_fp8_cuda --jobs 4
    step planted 60 $O/tests.log $D/test_linear_fp8_planted --filter 'linear_fp8/dgelu_dbias*'
    step dit_fp8 60 $O/tests.log $D/test_dit_fp8_cuda --verbose --jobs 2
    step dit_gpu 90 $O/tests.log $D/test_dit_gpu_cuda --jobs 2

    # 2. bitwise against main: 6 deterministic steps of DiT-S, batch 8, checkpoint at 6
    local CK="--device gpu --data synthetic --model S --batch 8 --image-size 32 --steps 6 --ckpt-every 6 --sample-every 0 --seed 5 --deterministic"
    for run in "fp8 --attn sage --linear fp8" "sage --attn sage --linear bf16" "bf16att --attn bf16 --linear bf16"; do
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

    # 3. ms/step, new and main interleaved: config c (16K tokens) and config a (DiT-B/2, 256 tokens × 64)
    #    with FP8 linears, two rounds each
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
    timed a_fp8_2 $A --linear fp8
    timed c_bf16_1 $C --linear bf16
    find $L -name '*.safetensors' -delete

    # loss and grad norm (7 digits) of 4 deterministic steps at hidden 2048 (c) and 768 (a), new against main
    for r in "c_fp8 $C --linear fp8" "c_bf16 $C --linear bf16" "a_fp8 $A --linear fp8"; do
        set -- $r
        local name=$1; shift
        step det_${name}_new 40 $O/train.log $D/train_dit "$@" --deterministic --steps 4 --out $L/d_${name}_new
        step det_${name}_base 40 $O/train.log $D/train_dit_base "$@" --deterministic --steps 4 --out $L/d_${name}_base
        if cmp -s <(cut -d, -f1-3 $L/d_${name}_new/train_log.csv) <(cut -d, -f1-3 $L/d_${name}_base/train_log.csv); then
            echo "losses_${name}: EQUAL ($(wc -l < $L/d_${name}_new/train_log.csv) lines)" >> $S
        else
            echo "losses_${name}: DIFFERENT" >> $S
        fi
    done
    median_ms() { awk -F, 'NR > 1 && $1 >= 4 && $1 <= 12 {print $5}' $L/$1/train_log.csv 2>/dev/null | sort -g |
        awk '{v[NR] = $1} END {if (NR == 9) print v[5]; else print "n/a"}'; }
    {
        echo "== ms/step (median of steps 4-12): new | main | main - new (> 0: new faster)"
        for r in c_fp8_1 c_fp8_2 a_fp8_1 a_fp8_2 c_bf16_1; do
            local n=$(median_ms t_${r}_new) b=$(median_ms t_${r}_base)
            echo "$r: $n | $b | $(awk -v a="$b" -v b="$n" 'BEGIN {if (a + 0 == 0 || b + 0 == 0) print "n/a"; else printf "%+.2f\n", a - b}')"
        done
        echo "== peak memory of c fp8 round 1 (the last step line): new, main"
        for k in new base; do
            awk -v sec="=== t_c_fp8_1_$k" '$0 == sec {on = 1; next} /^===/ {on = 0} on && /MiB peak/ {last = $0}
                END {n = split(last, f, "|"); print f[n]}' $O/train.log
        done
    } >> $S
    # 4. kernel time per step (CUPTI sums over 12 steps / 12, dev/kernel_times.c), new and main: the
    #    kernels this branch touches and the total (env inside timeout: a preloaded timeout would
    #    write its own empty list over the trainer's)
    if [ -f $D/libkernel_times.so ]; then
        echo "== kernel ms/step (new, then main): dGELU, dbias passes, total" >> $S
        for cfg in c; do
            local args=$C
            [ $cfg = a ] && args=$A
            for b in train_dit train_dit_base; do
                timeout 60 env LD_PRELOAD=$PWD/$D/libkernel_times.so KERNEL_TIMES_OUT=$O/k_${cfg}_$b.txt $D/$b $args \
                    --linear fp8 --steps 11 --out $L/p > /dev/null 2>&1
                awk -v what="$cfg $b" '{t += $1} /gelu_backward|dbias_partial|column_partials_finish/ {
                        k = $0; sub(/^[^ ]* [^ ]* (void )?/, "", k); sub(/\(.*/, "", k); s[k] += $1}
                    END {line = what ":"; for (k in s) line = line sprintf(" %s %.3f", k, s[k] / 11e6);
                         printf "%s | total %.3f\n", line, t / 11e6}' $O/k_${cfg}_$b.txt >> $S
            done
        done
    fi
    rm -rf $L
    cat $S
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*) echo "usage: $0 prepare DIR [BASE_BIN] | run DIR" >&2; exit 2 ;;
esac
