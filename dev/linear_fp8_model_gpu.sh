#!/usr/bin/env bash
# The FP8 block linears (train_dit --linear fp8, dev/notes_linear_fp8.md) validated and timed on one
# H200 in one device call, in priority order: cuBLASLt's log of the first FP8 GEMMs; the layer's
# tests (M multiples of 16 and not; the backward through the forward's saved inpᵀ) and four
# planted bugs that must fail them; the model's FP8-vs-bf16 tests (256 and 100 tokens) and four
# planted bugs that must fail them (and the bf16 model against the CPU, unchanged); ms/step at
# config c (hidden 2048, 16 heads, 16K tokens, depth 4) and config d (the same at 32761 tokens, not
# a multiple of 16), bf16 and fp8 interleaved twice, config c also with the previous main's
# train_dit (BASE), and DiT-S/2 (256 tokens, batch 32); 300 steps of loss, bf16 vs fp8 at seed 3
# and bf16 at seed 4 (the seed spread); the layer benchmark if time is left.
#   here (nvcc, no GPU), from the tree root:  bash dev/linear_fp8_model_gpu.sh prepare [DIR]
#       builds DIR (default /work/main/.devrun_fp8n, git-ignored) with stripped binaries and this
#       script; BASE (default main) names the commit whose train_dit is timed beside this tree's
#   GPU machine, from the tree root, carrying DIR and .devlibs (Criterion's runtime libraries):
#       run(command="bash .devrun_fp8n/linear_fp8_model_gpu.sh run .devrun_fp8n", kind="nvidia-h200",
#           carry=[".devrun_fp8n", ".devlibs"], timeout_s=240)
#   Every step runs under `timeout -k 3`, all within BUDGET_S (default 210 s); $OUT/summary.txt grows
#   step by step (a cut call still returns it); at most 8 text files come back, no checkpoints.
set -uo pipefail

prepare() {
    set -e
    local D=${1:-/work/main/.devrun_fp8n}
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
    local NVFLAGS="-O3 -std=c++17 -I. --use_fast_math -Xcompiler -Wall -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local CFLAGS="-O2 -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    local LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && LIBS="$LIBS -lnccl" && NVFLAGS="$NVFLAGS -DDIT_NCCL" && CFLAGS="$CFLAGS -DDIT_NCCL"
    local B=build/linear_fp8_model_dev base
    base=$(git rev-parse --short "${BASE:-main}")
    make -j2 train_dit build/libditc.a
    rm -rf "$D" "$B" && mkdir -p "$D" "$B"
    # the planted bugs, each checked to change its source:
    #   scale: the quantize kernel converts x instead of x·2^-e (layer and model tests must fail)
    #   beta:  the dweight GEMM overwrites instead of accumulating (layer test must fail)
    #   saved_scale: the dweight GEMM scales the saved inpᵀ by the weight's scale, not by its own
    #          (layer and model tests must fail)
    #   saved_copy: the forward keeps the scale but never writes inpᵀ (layer and model tests must fail)
    #   dgelu: the model's fc2 backward takes GELU' at its input (the GELU output), not at the
    #          pre-activation (model test must fail: fc1's and the earlier gradients)
    local F=layers/linear_fp8_cuda.cu
    sed 's/__nv_cvt_float_to_fp8(v\[j\] \* down,/__nv_cvt_float_to_fp8(v[j],/' $F > $B/planted_scale.cu
    sed 's/ws.scale + T_DOUT, IC, OC, Mp, 1.0f,/ws.scale + T_DOUT, IC, OC, Mp, 0.0f,/' $F > $B/planted_beta.cu
    sed 's/inp->qt, CUDA_R_8F_E4M3, inp->scale, dout_qt/inp->qt, CUDA_R_8F_E4M3, ws.scale + T_WEIGHT, dout_qt/' \
        $F > $B/planted_saved_scale.cu
    sed 's/quantize(inp_q, save ? save->qt : NULL, inp_scale,/quantize(inp_q, NULL, inp_scale,/' $F > $B/planted_saved_copy.cu
    sed 's/linear_fp8_dgelu_backward_cuda(dpre, dweight, dbias, dout, saved, pre_gelu, weight,/linear_fp8_dgelu_backward_cuda(dpre, dweight, dbias, dout, saved, inp, weight,/' \
        model/dit_gpu.cu > $B/planted_dgelu.cu
    for p in scale beta saved_scale saved_copy; do
        cmp -s $F $B/planted_$p.cu && { echo "planted_$p: sed changed nothing" >&2; exit 1; }
    done
    cmp -s model/dit_gpu.cu $B/planted_dgelu.cu && { echo "planted_dgelu: sed changed nothing" >&2; exit 1; }
    $NVCC $NVFLAGS -c -o $B/planted_scale.o $B/planted_scale.cu &
    $NVCC $NVFLAGS -c -o $B/planted_beta.o $B/planted_beta.cu &
    wait
    $NVCC $NVFLAGS -c -o $B/planted_saved_scale.o $B/planted_saved_scale.cu &
    $NVCC $NVFLAGS -c -o $B/planted_saved_copy.o $B/planted_saved_copy.cu &
    wait
    $NVCC $NVFLAGS -c -o $B/planted_dgelu.o $B/planted_dgelu.cu
    local LIB=build/libditc.a
    # the planted object comes first: the archive's own member is then never pulled in (a clash
    # would be a duplicate-symbol link error, not a silent pick)
    cc $CFLAGS -o $D/test_linear_fp8_cuda test/test_linear_fp8_cuda.c $LIB $LIBS -lcriterion
    for p in scale beta saved_scale saved_copy; do
        cc $CFLAGS -o $D/test_linear_fp8_planted_$p test/test_linear_fp8_cuda.c $B/planted_$p.o $LIB $LIBS -lcriterion
    done
    cc $CFLAGS -o $D/test_dit_fp8_cuda test/test_dit_fp8_cuda.c $LIB $LIBS -lcriterion
    for p in scale saved_scale saved_copy dgelu; do
        cc $CFLAGS -o $D/test_dit_fp8_planted_$p test/test_dit_fp8_cuda.c $B/planted_$p.o $LIB $LIBS -lcriterion
    done
    cc $CFLAGS -o $D/test_dit_gpu_cuda test/test_dit_gpu_cuda.c $LIB $LIBS -lcriterion
    cc $CFLAGS -o $D/test_layers_cuda test/test_layers_cuda.c $LIB $LIBS -lcriterion
    cc $CFLAGS -o $D/bench_linear_fp8 dev/bench_linear_fp8.c $LIB $LIBS
    cp train_dit $D/
    # the previous main's train_dit, from a clean export of BASE (kept in build/base_<commit>)
    local BD=build/base_$base
    if [ ! -x $BD/train_dit ]; then
        rm -rf $BD && mkdir -p $BD
        git archive $base | tar -x -C $BD
        make -C $BD -j2 train_dit
    fi
    cp $BD/train_dit $D/train_dit_base
    strip $D/*
    echo "$base $(git -C . log -1 --format=%s $base | cut -c1-100)" > $D/BASE
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > $D/HEAD
    cp dev/linear_fp8_model_gpu.sh $D/
    du -sh "$D"
}

run() {
    local D=${1:-.devrun_fp8n} O=${OUT:-linear_fp8_model_out} L
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
    echo "binaries of $(cat $D/HEAD 2>/dev/null); base (previous main) $(cat $D/BASE 2>/dev/null)" >> $S
    timeout -k 3 10 nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $S 2>&1

    # 1. cuBLASLt's own account of the first FP8 GEMMs (the first 2 MB of its log come back)
    step lt_log 20 $L/lt.log env CUBLASLT_LOG_MASK=31 CUBLASLT_LOG_FILE=$L/cublaslt.%i.txt \
        $D/test_linear_fp8_cuda --jobs 1 --filter 'linear_fp8/matches_cpu_definition'
    cat $L/cublaslt.*.txt 2>/dev/null | head -c 2000000 > $O/cublaslt.txt

    # 2. the layer: tests (errors logged by --verbose), planted bugs (must FAIL: rc 1), the bf16
    #    linear's and the pointwise kernels' tests (dbias and the GELU code are shared)
    step layer_tests 45 $O/layer.log $D/test_linear_fp8_cuda --verbose --jobs 4
    step layer_planted_scale 15 $O/layer.log $D/test_linear_fp8_planted_scale --filter 'linear_fp8/*cpu*'
    step layer_planted_beta 15 $O/layer.log $D/test_linear_fp8_planted_beta --filter 'linear_fp8/matches_cpu_definition'
    step layer_planted_saved_scale 15 $O/layer.log $D/test_linear_fp8_planted_saved_scale \
        --filter 'linear_fp8/matches_cpu_definition'
    step layer_planted_saved_copy 15 $O/layer.log $D/test_linear_fp8_planted_saved_copy \
        --filter 'linear_fp8/matches_cpu_definition'
    step layers_cuda_linear 15 $O/layer.log $D/test_layers_cuda --filter 'cuda/linear*'
    step layers_cuda_pointwise 10 $O/layer.log $D/test_layers_cuda --filter 'cuda/pointwise'

    # 3. the model: FP8 against bf16 at 256 and 100 tokens (must pass), the planted bugs (must
    #    FAIL: rc 1), the bf16 model's one-step tests against the CPU (unchanged code path)
    step model_fp8 40 $O/model.log $D/test_dit_fp8_cuda --verbose
    for p in scale saved_scale saved_copy dgelu; do
        step model_planted_$p 25 $O/model.log $D/test_dit_fp8_planted_$p --filter 'dit_fp8/one_step*'
    done
    step model_bf16_vs_cpu 40 $O/model.log $D/test_dit_gpu_cuda --filter 'dit_gpu/one_step*'

    # 4. ms/step: config c (bf16, fp8, bf16, fp8; then the previous main's bf16 and fp8), config d
    #    (32761 tokens), DiT-S/2
    local RUN="--device gpu --data synthetic --model S --attn sage --steps 12 --ckpt-every 0 --sample-every 0 --seed 1"
    local C="$RUN --hidden 2048 --heads 16 --depth 4 --batch 1 --image-size 256"
    local DD="$RUN --hidden 2048 --heads 16 --depth 4 --batch 1 --image-size 362"
    local SMALL="$RUN --batch 32 --image-size 32"
    for k in 1 2; do
        for lin in bf16 fp8; do step c_${lin}_$k 45 $O/train.log $D/train_dit $C --linear $lin --out $L/c_${lin}_$k; done
    done
    for lin in bf16 fp8; do step c_${lin}_base 45 $O/train.log $D/train_dit_base $C --linear $lin --out $L/c_${lin}_base; done
    for k in 1 2; do
        for lin in bf16 fp8; do step d_${lin}_$k 60 $O/train.log $D/train_dit $DD --linear $lin --out $L/d_${lin}_$k; done
    done
    for k in 1 2; do
        for lin in bf16 fp8; do step s_${lin}_$k 30 $O/train.log $D/train_dit $SMALL --linear $lin --out $L/s_${lin}_$k; done
    done

    # 5. loss agreement: 300 steps at DiT-S/2 (256 tokens, batch 32)
    local LOSS="--device gpu --data synthetic --model S --batch 32 --image-size 32 --steps 300 --ckpt-every 0 --sample-every 0"
    step loss_bf16_seed3 45 $O/train.log $D/train_dit $LOSS --seed 3 --linear bf16 --out $L/l_bf16_3
    step loss_fp8_seed3 45 $O/train.log $D/train_dit $LOSS --seed 3 --linear fp8 --out $L/l_fp8_3
    step loss_bf16_seed4 45 $O/train.log $D/train_dit $LOSS --seed 4 --linear bf16 --out $L/l_bf16_4

    # 6. the layer benchmark (bf16 vs FP8 per linear at config c's shapes), if time is left
    step bench_linear_fp8 40 $O/bench.log $D/bench_linear_fp8
    find $L -name '*.safetensors' -delete

    # the report: ms/step (median of steps 4..12 of train_log.csv's ms column), the losses, and the
    # numbers of the decision rule (dev/notes_linear_fp8.md)
    median_ms() { awk -F, 'NR > 1 && $1 >= 4 && $1 <= 12 {print $5}' $L/$1/train_log.csv 2>/dev/null | sort -g |
        awk '{v[NR] = $1} END {if (NR == 9) print v[5]; else print "n/a"}'; }
    mean_last() { awk -F, 'NR > 1 && $1 > 250 {s += $2; n++} END {if (n == 50) printf "%.5f\n", s / n; else print "n/a"}' \
        $L/$1/train_log.csv 2>/dev/null; }
    loss_at() { awk -F, -v s=$2 'NR > 1 && $1 == s {print $2}' $L/$1/train_log.csv 2>/dev/null; }
    diff_or_na() { awk -v a="$1" -v b="$2" 'BEGIN {if (a + 0 == 0 || b + 0 == 0) print "n/a"; else printf "%.4f\n", a - b}'; }
    {
        echo "== ms/step (median of steps 4-12): run 1, run 2; saving = bf16 - fp8 per pair"
        for cfg in c d s; do
            local b1=$(median_ms ${cfg}_bf16_1) f1=$(median_ms ${cfg}_fp8_1) b2=$(median_ms ${cfg}_bf16_2) f2=$(median_ms ${cfg}_fp8_2)
            echo "$cfg: bf16 $b1 $b2 | fp8 $f1 $f2 | saving $(diff_or_na "$b1" "$f1") $(diff_or_na "$b2" "$f2") ms"
        done
        local bb=$(median_ms c_bf16_base) fb=$(median_ms c_fp8_base)
        echo "c, previous main ($(cut -d' ' -f1 $D/BASE 2>/dev/null)): bf16 $bb | fp8 $fb | this tree's fp8 faster by" \
             "$(diff_or_na "$fb" "$(median_ms c_fp8_1)") $(diff_or_na "$fb" "$(median_ms c_fp8_2)") ms; loss at step 12: fp8 base" \
             "$(loss_at c_fp8_base 12), this tree $(loss_at c_fp8_1 12) $(loss_at c_fp8_2 12); bf16 base $(loss_at c_bf16_base 12)," \
             "this tree $(loss_at c_bf16_1 12) $(loss_at c_bf16_2 12)"
        echo "== memory plan of the fp8 runs (c, d)"
        awk '/^=== (c|d)_fp8_1$/ {f = 1; next} /^===/ {f = 0} f && /memory plan/' $O/train.log | cut -c1-400
        echo "== loss every 50 steps: bf16 seed 3 | fp8 seed 3 | bf16 seed 4"
        for st in 1 50 100 150 200 250 300; do
            echo "$st $(loss_at l_bf16_3 $st) $(loss_at l_fp8_3 $st) $(loss_at l_bf16_4 $st)"
        done
        local m3=$(mean_last l_bf16_3) m8=$(mean_last l_fp8_3) m4=$(mean_last l_bf16_4)
        echo "mean of steps 251-300: bf16 seed 3 $m3 | fp8 seed 3 $m8 | bf16 seed 4 $m4"
        echo "fp8 - bf16 (seed 3): $(diff_or_na "$m8" "$m3") | seed spread bf16 seed 4 - seed 3: $(diff_or_na "$m4" "$m3")"
        echo "nan/inf losses in the fp8 run: $(awk -F, 'NR > 1 && ($2 ~ /nan|inf/) {n++} END {print n + 0}' $L/l_fp8_3/train_log.csv 2>/dev/null)"
        echo "== measured errors (model test)"
        awk '/^=== model_fp8$/ {f = 1; next} /^===/ {f = 0} f && /fp8 vs bf16/' $O/model.log
        echo "== planted tests (rc must be 1)"
        grep -E '^(layer|model)_planted' $S
        echo "== cuBLASLt errors"
        grep -i -E '\]\[error\]|not supported' $O/cublaslt.txt | cut -c1-300 | head -5
    } > $O/report.txt 2>&1
    echo "=== summary"; cat $S; echo "=== report"; cat $O/report.txt
    echo "=== bench (tail)"; tail -n 12 $O/bench.log 2>/dev/null
    rm -rf $L
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash dev/linear_fp8_model_gpu.sh prepare [DIR] | run [DIR]" >&2; exit 2 ;;
esac
