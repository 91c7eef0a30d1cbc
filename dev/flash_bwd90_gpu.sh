#!/usr/bin/env bash
# Validation of the Hopper bf16 backward (attention/flash_backward_sm90.cu) in ONE device call.
#   here (nvcc, no GPU):   bash dev/flash_bwd90_gpu.sh prepare
#       builds .devrun_flashbwd90/ (git-ignored): test_flash_cuda, libflash_bench.so and two
#       planted-bug test binaries (sed-modified copies of the kernel's sources linked before
#       libditc.a, never committed): "nodelta" drops delta (dSᵀ = Pᵀ∘dPᵀ), "unordered" ignores
#       flash_backward_set_deterministic (dq by unordered adds).
#   GPU machine (run tool, carry .devrun_flashbwd90 and .devlibs):   bash dev/flash_bwd90_gpu.sh run
#       logs to $OUT: gpu.txt, test_flash_cuda.log (all tests, must pass), planted_*.log (must
#       FAIL), bench_flash.log (sm90 bwd / sm90 det columns), memcheck.log; summary.txt.
# Every step has its own timeout (total < 560 s) so that a hang in the new kernel still returns logs.
set -uo pipefail
DIR=.devrun_flashbwd90

prepare() {
    set -e
    make -j2 build/test_flash_cuda build/libditc.a
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
    local FLAGS="-O3 -std=c++17 -I. --use_fast_math -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local CUDA_LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && CUDA_LIBS="$CUDA_LIBS -lnccl"
    local CFLAGS="-O3 -g -std=c11 -Wall -Wextra -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    rm -rf "$DIR" && mkdir -p "$DIR" build/planted
    cp build/test_flash_cuda "$DIR/"
    gcc -O2 -fPIC -std=c11 -D_GNU_SOURCE -I. -c layers/common.c -o build/common_pic.o
    $NVCC $FLAGS -Xcompiler -fPIC -shared -o "$DIR/libflash_bench.so" attention/flash_forward.cu \
        attention/flash_forward_sm90.cu attention/flash_backward.cu attention/flash_backward_sm90.cu build/common_pic.o
    # planted bugs: each sed must change the source (grep -q checks the pattern is there). The
    # kernel body is attention/backward_sm90.cuh: "nodelta" edits a copy of it next to a copy of
    # flash_backward_sm90.cu in build/planted/attention/ (found first through -Ibuild/planted).
    rm -rf build/planted/attention && mkdir -p build/planted/attention
    grep -q '(dp\[4 \* j + e\] - (e & 1 ? delta.y : delta.x))' attention/backward_sm90.cuh
    sed 's/(dp\[4 \* j + e\] - (e & 1 ? delta.y : delta.x))/dp[4 * j + e]/' attention/backward_sm90.cuh \
        > build/planted/attention/backward_sm90.cuh
    cp attention/flash_backward_sm90.cu build/planted/attention/flash_backward_sm90_nodelta.cu
    grep -q 'flash_backward_deterministic(), stream' attention/flash_backward_sm90.cu
    sed 's/flash_backward_deterministic(), stream/0, stream/' attention/flash_backward_sm90.cu \
        > build/planted/flash_backward_sm90_unordered.cu
    $NVCC -Ibuild/planted $FLAGS -c -o build/planted/nodelta.o build/planted/attention/flash_backward_sm90_nodelta.cu
    $NVCC $FLAGS -c -o build/planted/unordered.o build/planted/flash_backward_sm90_unordered.cu
    for bug in nodelta unordered; do
        cc $CFLAGS -o "$DIR/test_flash_cuda_$bug" test/test_flash_cuda.c build/planted/$bug.o build/libditc.a \
            $CUDA_LIBS -lcriterion
    done
    du -sh "$DIR" .devlibs
}

run() {
    local L=${OUT:-flash_bwd90_logs}
    mkdir -p "$L"
    export LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
    { date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; } > "$L/gpu.txt" 2>&1
    timeout 200 "$DIR/test_flash_cuda" --verbose --jobs 8 > "$L/test_flash_cuda.log" 2>&1
    echo "test_flash_cuda rc=$? (want 0): $(grep Synthesis "$L/test_flash_cuda.log")" >> "$L/summary.txt"
    timeout 60 "$DIR/test_flash_cuda_nodelta" --verbose --filter 'flash_cuda/sm90_backward' > "$L/planted_nodelta.log" 2>&1
    echo "planted nodelta rc=$? (want != 0): $(grep Synthesis "$L/planted_nodelta.log")" >> "$L/summary.txt"
    timeout 60 "$DIR/test_flash_cuda_unordered" --verbose --filter 'flash_cuda/sm90_backward_deterministic' \
        > "$L/planted_unordered.log" 2>&1
    echo "planted unordered rc=$? (want != 0): $(grep Synthesis "$L/planted_unordered.log")" >> "$L/summary.txt"
    timeout 180 python3 dev/bench_flash.py "$DIR/libflash_bench.so" > "$L/bench_flash.log" 2>&1
    echo "bench_flash rc=$?" >> "$L/summary.txt"
    local SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    timeout 60 "$SAN" --tool memcheck --error-exitcode 99 "$DIR/test_flash_cuda" --filter 'flash_cuda/sm90_backward' \
        -j1 > "$L/memcheck.log" 2>&1
    echo "memcheck sm90_backward rc=$? (want 0; 124 = timed out): $(grep 'ERROR SUMMARY' "$L/memcheck.log")" >> "$L/summary.txt"
    cat "$L/summary.txt"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash dev/flash_bwd90_gpu.sh prepare|run" >&2; exit 2 ;;
esac
