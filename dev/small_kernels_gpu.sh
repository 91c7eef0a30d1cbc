#!/usr/bin/env bash
# Branch small-kernels: the FP8 quantize kernel at 6 blocks per SM (__launch_bounds__; measured in
# session 12: the GELU instantiation 0.74 -> 0.63 ms per step at c) and the attention delta kernel
# with 32-bit row arithmetic (no 64-bit divisions; attention_backward_prepare refuses B·H·N >= 2^31).
# Same arithmetic: bitwise the same results. Then the step table of the README, with this binary.
#   here:  bash dev/small_kernels_gpu.sh prepare DIR BASE_DIR   (BASE_DIR: main's train_dit, libkernel_times.so)
#   GPU machine (one H200): bash DIR/small_kernels_gpu.sh run DIR    (carry DIR and .devlibs)
# Merge rule (set before the run): every test passes; the planted build fails (delta from the next
# row's query index); checkpoints and deterministic losses equal main's; the two kernels' CUPTI time
# at c not higher than main's (sum), c and a ms/step not slower beyond 0.1 ms.
set -uo pipefail

prepare() {
    set -e
    local D=$1 BASE=$2
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc} B
    local NVFLAGS="-O3 -std=c++17 --use_fast_math -Xcompiler -fPIC -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local CFLAGS="-O2 -std=c11 -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    local LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && { LIBS="$LIBS -lnccl"; CFLAGS="$CFLAGS -DDIT_NCCL"; }
    B=$(mktemp -d)
    rm -rf "$D" && mkdir -p "$D"
    make -j2 train_dit build/libditc.a build/libditc.so
    cp build/libditc.so "$D/libditc.so.0"
    for t in test_linear_fp8_cuda test_sage_cuda test_flash_cuda test_attention_determinism_cuda test_dit_fp8_cuda; do
        cc $CFLAGS -o "$D/$t" test/$t.c -L"$D" -l:libditc.so.0 -Wl,-rpath,'$ORIGIN' $LIBS -lcriterion
    done
    python3 - "$B" <<'PY'
import sys
s = open("attention/attention_backward.cuh").read()
old = "int lane = threadIdx.x % 32, q = row % N;\n    size_t at = attn_row_offset(row / N, q, N, D, merged_heads);"
assert s.count(old) == 1
open(sys.argv[1] + "/attention_backward.cuh", "w").write(s.replace(old,
    "int lane = threadIdx.x % 32, q = row % N;\n    size_t at = attn_row_offset(row / N, (q + 1) % N, N, D, merged_heads);"))
PY
    mkdir -p $B/p/attention && cp attention/*.cu attention/*.cuh attention/*.h $B/p/attention/
    cp $B/attention_backward.cuh $B/p/attention/
    $NVCC $NVFLAGS -I$B/p -I. -c -o $B/p.o $B/p/attention/sage_backward_sm90.cu
    cc $CFLAGS -o "$D/test_sage_planted_delta" test/test_sage_cuda.c $B/p.o build/libditc.a $LIBS -lcriterion
    cp train_dit "$D/"
    cp "$BASE/train_dit" "$D/train_dit_base"
    cp "$BASE/libkernel_times.so" "$D/"
    strip --strip-unneeded "$D"/*
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > "$D/HEAD"
    echo "main's $BASE" > "$D/BASE"
    cp dev/small_kernels_gpu.sh dev/branch_check.sh "$D/"
    rm -rf $B
    du -sh "$D"
}

run() {
    : "${BUDGET_S:=560}"
    . "$1/branch_check.sh"
    bc_init "${1:-.devrun_sk}"
    bc_step linear_fp8 90 $O/tests.log $D/test_linear_fp8_cuda --jobs 4
    bc_step sage 200 $O/tests.log $D/test_sage_cuda --jobs 4 --filter 'sage_cuda/sm90_backward*'
    bc_step planted_delta 200 $O/tests.log $D/test_sage_planted_delta --jobs 4 --filter 'sage_cuda/sm90_backward_matches*'
    bc_step flash 120 $O/tests.log $D/test_flash_cuda --jobs 4
    bc_step determinism 120 $O/tests.log $D/test_attention_determinism_cuda --jobs 2
    bc_step dit_fp8 90 $O/tests.log $D/test_dit_fp8_cuda --jobs 2
    bc_ckpt fp8 --attn sage --linear fp8
    bc_losses c_fp8 $BC_C --linear fp8
    bc_kernels 'fp8_quantize|attention_delta' $BC_C --linear fp8
    bc_timed c_fp8_1 $BC_C --linear fp8
    bc_timed a_fp8_1 $BC_A --linear fp8
    bc_times c_fp8_1 a_fp8_1
    bc_done
    # the step table (dev/bench_step.py: train_dit sage / bf16 / sage fp8, PyTorch eager and compile)
    timeout 400 python3 dev/bench_step.py --configs c,a --compile --fp8 --rounds 1 --train-dit "$D/train_dit" \
        > "$O/bench_step.txt" 2>&1
    echo "bench_step rc=$?"; tail -25 "$O/bench_step.txt"
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*) echo "usage: $0 prepare DIR BASE_DIR | run DIR" >&2; exit 2 ;;
esac
