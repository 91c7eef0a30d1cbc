#!/usr/bin/env bash
# Validation of the Hopper INT8 sage backward (attention/sage_backward_int8_sm90.cu) in ONE device call.
#   here (nvcc, no GPU):   bash dev/sage_int8_bwd_gpu.sh prepare
#       builds .devrun_i8bwd/ (git-ignored): test_sage_int8_bwd_cuda, libsage_int8_bench.so and two
#       planted-bug test binaries (sed-modified copies of the kernel's source linked before
#       libditc.a, never committed): "nodsqscale" ignores dS's per-query scale in dq (1/127 instead
#       of dsq_scale), "p127" quantizes P with the fixed scale 1/127 instead of its per-key max.
#   GPU machine (run tool, carry .devrun_i8bwd and .devlibs):   bash dev/sage_int8_bwd_gpu.sh run
#       writes $OUT/summary.txt (one line per step) and $OUT/logs.tgz: gpu.txt, test.log (all tests,
#       must pass), planted_*.log (must FAIL), bench.log (dev/bench_sage_int8_bwd.py), memcheck.log.
# Every step has its own timeout (285 s in all) so that a hang in the new kernel still returns logs.
set -uo pipefail
DIR=.devrun_i8bwd

prepare() {
    set -e
    make -j2 build/test_sage_int8_bwd_cuda build/libditc.a
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
    local FLAGS="-O3 -std=c++17 -I. --use_fast_math -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local CUDA_LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && CUDA_LIBS="$CUDA_LIBS -lnccl"
    local CFLAGS="-O3 -g -std=c11 -Wall -Wextra -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    rm -rf "$DIR" && mkdir -p "$DIR" build/planted_i8bwd
    cp build/test_sage_int8_bwd_cuda "$DIR/"
    gcc -O2 -fPIC -std=c11 -D_GNU_SOURCE -I. -c layers/common.c -o build/common_pic.o
    $NVCC $FLAGS -Xcompiler -fPIC -shared -o "$DIR/libsage_int8_bench.so" attention/sage_quant.cu \
        attention/sage_forward.cu attention/sage_forward_sm90.cu attention/sage_backward.cu \
        attention/sage_backward_sm90.cu attention/sage_backward_int8_sm90.cu build/common_pic.o
    # planted bugs: each sed must change the source (grep -q checks the pattern is there)
    local SRC=attention/sage_backward_int8_sm90.cu P=build/planted_i8bwd
    grep -q 'q_scale_dsq\[J \* BWD90_QUERIES + 16 \* warp + g + 8 \* h\]' $SRC
    sed 's/q_scale_dsq\[J \* BWD90_QUERIES + 16 \* warp + g + 8 \* h\]/(1.0f \/ 127.0f)/' $SRC > $P/nodsqscale.cu
    grep -q 'int8_scales(c == 0 ? p_max\[0\] : c == 1 ? p_max\[1\]' $SRC
    sed 's/int8_scales(c == 0 ? p_max\[0\] : c == 1 ? p_max\[1\]/int8_scales(c == 0 ? 1.0f : c == 1 ? 1.0f/' $SRC > $P/p127.cu
    for bug in nodsqscale p127; do
        cmp -s $SRC $P/$bug.cu && { echo "planted $bug: sed changed nothing" >&2; exit 1; }
        $NVCC $FLAGS -c -o $P/$bug.o $P/$bug.cu
        cc $CFLAGS -o "$DIR/test_sage_int8_bwd_cuda_$bug" test/test_sage_int8_bwd_cuda.c $P/$bug.o build/libditc.a \
            $CUDA_LIBS -lcriterion
    done
    du -sh "$DIR" .devlibs
}

run() {
    local O=${OUT:-sage_int8_bwd_logs} L
    L=$(mktemp -d)
    mkdir -p "$O"
    export LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
    { date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; git log -1 --oneline 2>/dev/null; } \
        > "$L/gpu.txt" 2>&1
    timeout -k 5 90 "$DIR/test_sage_int8_bwd_cuda" --verbose --jobs 8 > "$L/test.log" 2>&1
    echo "test_sage_int8_bwd_cuda rc=$? (want 0): $(grep Synthesis "$L/test.log")" >> "$O/summary.txt"
    grep -h 'int8 bwd' "$L/test.log" | sed 's/^/    /' >> "$O/summary.txt"
    for bug in nodsqscale p127; do
        timeout -k 5 35 "$DIR/test_sage_int8_bwd_cuda_$bug" --verbose \
            --filter 'sage_int8_bwd_cuda/tails_match_definition_and_exact' > "$L/planted_$bug.log" 2>&1
        echo "planted $bug rc=$? (want != 0): $(grep Synthesis "$L/planted_$bug.log")" >> "$O/summary.txt"
        grep -h -m 3 'vs definition' "$L/planted_$bug.log" | sed 's/^/    /' >> "$O/summary.txt"
    done
    timeout -k 5 80 python3 dev/bench_sage_int8_bwd.py "$DIR/libsage_int8_bench.so" > "$L/bench.log" 2>&1
    echo "bench rc=$?" >> "$O/summary.txt"
    grep '^|' "$L/bench.log" >> "$O/summary.txt"
    local SAN
    SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    timeout -k 5 45 "$SAN" --tool memcheck --error-exitcode 99 "$DIR/test_sage_int8_bwd_cuda" \
        --filter 'sage_int8_bwd_cuda/k_offset' -j1 > "$L/memcheck.log" 2>&1
    echo "memcheck k_offset rc=$? (want 0; 124 = timed out): $(grep 'ERROR SUMMARY' "$L/memcheck.log")" >> "$O/summary.txt"
    tar czf "$O/logs.tgz" -C "$L" .
    cat "$O/summary.txt"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash dev/sage_int8_bwd_gpu.sh prepare|run" >&2; exit 2 ;;
esac
