#!/usr/bin/env bash
# The quantization pass (attention/sage_quant.cu) on the GPU machine: byte identity with main's
# three-launch pass, a planted bug, the project's tests, and the timings (dev/notes_sage_quant.md).
#   here (nvcc, no GPU):  bash dev/sage_quant_gpu.sh prepare DIR [LIBDITC]
#       builds DIR/ (git-ignored, e.g. /work/main/.devrun_quant2): compare_sage_quant (new pass +
#       main's pass renamed old_*), compare_planted (the new pass with the stats over tokens
#       0..N-2 of each chunk's end: must FAIL), test_sage_cuda and test_sage_forward_sm90_cuda (the
#       new pass linked before LIBDITC, default build/libditc.a), test_sage_cuda_planted,
#       libsage_quant_bench.so (new pass, old_* pass, the new pass with QUANT_MIN_CTAS=3 as v3_*,
#       the forward kernels) for dev/bench_sage_quant.py, and this script.
#   GPU machine (carry DIR and .devlibs):  bash DIR/sage_quant_gpu.sh run DIR
#       writes $OUT/logs.tgz (gpu.txt, check.log, planted.log, tests.log, tests_fwd.log,
#       planted_tests.log, bench.log, tests_all.log) and $OUT/summary.txt; every step has its own
#       timeout (all within BUDGET_S, default 135 s), so a hang still returns logs.
set -uo pipefail

prepare() {
    set -e
    local D=$1 LIB=${2:-build/libditc.a}
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
    local FLAGS="-O3 -std=c++17 -I. --use_fast_math -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local CUDA_LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && CUDA_LIBS="$CUDA_LIBS -lnccl"
    local CFLAGS="-O2 -std=c11 -Wall -Wextra -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    local NAMES='sage_cuda_forward_workspace_size|sage_cuda_quant_view|sage_quantize_cuda|sage_kv_stats_cuda|sage_quantize_given_cuda|sage_stats_kernel|sage_stats_reduce_kernel|sage_quantize_kernel'
    local B=build/sage_quant_dev SRC=attention/sage_quant.cu
    rm -rf "$D" "$B" && mkdir -p "$D" "$B"
    git show main:attention/sage_quant.cu | sed -E "s/\\b($NAMES)\\b/old_\\1/g" > $B/old_sage_quant.cu
    sed -E "s/\\b($NAMES)\\b/v3_\\1/g" $SRC > $B/v3_sage_quant.cu
    grep -q 't_end = min(N, ' $SRC
    sed 's/t_end = min(N, /t_end = min(N - 1, /' $SRC > $B/planted.cu
    cmp -s $SRC $B/planted.cu && { echo "planted: sed changed nothing" >&2; exit 1; }
    $NVCC $FLAGS -c -o $B/old.o $B/old_sage_quant.cu &
    $NVCC $FLAGS -Xptxas -v -c -o $B/new.o $SRC 2> $B/ptxas.txt &
    $NVCC $FLAGS -c -o $B/planted.o $B/planted.cu &
    wait
    grep -E 'Compiling entry function|spill stores|Used [0-9]+ registers' $B/ptxas.txt | sed 's/ptxas info    : //' |
        cut -c1-110 > "$D/ptxas.txt"
    cc $CFLAGS -o "$D/compare_sage_quant" dev/compare_sage_quant.c $B/new.o $B/old.o "$LIB" $CUDA_LIBS
    cc $CFLAGS -o "$D/compare_planted" dev/compare_sage_quant.c $B/planted.o $B/old.o "$LIB" $CUDA_LIBS
    cc $CFLAGS -o "$D/test_sage_cuda" test/test_sage_cuda.c $B/new.o "$LIB" $CUDA_LIBS -lcriterion
    cc $CFLAGS -o "$D/test_sage_cuda_planted" test/test_sage_cuda.c $B/planted.o "$LIB" $CUDA_LIBS -lcriterion
    cc $CFLAGS -o "$D/test_sage_forward_sm90_cuda" test/test_sage_forward_sm90_cuda.c $B/new.o "$LIB" $CUDA_LIBS -lcriterion
    # the benchmark library: every object position-independent
    local PIC="$FLAGS -Xcompiler -fPIC"
    cc -O2 -fPIC -std=c11 -D_GNU_SOURCE -I. -c layers/common.c -o $B/common_pic.o
    $NVCC $PIC -c -o $B/new_pic.o $SRC &
    $NVCC $PIC -c -o $B/old_pic.o $B/old_sage_quant.cu &
    $NVCC $PIC -DQUANT_MIN_CTAS=3 -c -o $B/v3_pic.o $B/v3_sage_quant.cu &
    $NVCC $PIC -c -o $B/fwd_pic.o attention/sage_forward.cu &
    $NVCC $PIC -c -o $B/fwd90_pic.o attention/sage_forward_sm90.cu &
    wait
    $NVCC $FLAGS -shared -Xlinker --no-undefined -o "$D/libsage_quant_bench.so" $B/new_pic.o $B/old_pic.o $B/v3_pic.o \
        $B/fwd_pic.o $B/fwd90_pic.o $B/common_pic.o -lcuda
    cp dev/sage_quant_gpu.sh dev/bench_sage_quant.py dev/bench_common.py "$D/"
    du -sh "$D"
}

run() {
    local D=$1 O=${OUT:-sage_quant_logs} L
    L=$(mktemp -d)
    export LD_LIBRARY_PATH=$PWD/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $L/gpu.txt 2>&1; date -u >> $L/gpu.txt
    local deadline=$((SECONDS + ${BUDGET_S:-135}))
    step() {   # name timeout command...: log to $L/name.log, rc to the summary (all steps within BUDGET_S)
        local name=$1 t=$2; shift 2
        [ $t -gt $((deadline - SECONDS)) ] && t=$((deadline - SECONDS))
        [ $t -lt 1 ] && { echo "$name: skipped (no time left)" | tee -a $L/summary.txt; return; }
        timeout $t "$@" > $L/$name.log 2>&1
        echo "$name: rc=$? ($(tail -n 1 $L/$name.log))" | tee -a $L/summary.txt
    }
    step check 25 $D/compare_sage_quant check
    step planted 20 $D/compare_planted check
    step tests 25 $D/test_sage_cuda --jobs 8 --filter 'sage_cuda/quantize*'
    step tests_fwd 20 $D/test_sage_forward_sm90_cuda
    step planted_tests 15 $D/test_sage_cuda_planted --filter 'sage_cuda/quantize*'
    step bench 45 python3 $D/bench_sage_quant.py $D/libsage_quant_bench.so
    step tests_all 60 $D/test_sage_cuda --jobs 16
    cat $L/bench.log
    mkdir -p $O && cp $L/summary.txt $O/ && tar czf $O/logs.tgz -C $L .
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash dev/sage_quant_gpu.sh prepare DIR [LIBDITC] | run DIR" >&2; exit 2 ;;
esac
