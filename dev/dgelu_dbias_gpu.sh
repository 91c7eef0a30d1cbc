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
    cp dev/dgelu_dbias_gpu.sh dev/branch_check.sh $D/
    rm -rf $B
    du -sh "$D"
}

run() {
    : "${BUDGET_S:=330}"
    . "$1/branch_check.sh"
    bc_init "${1:-.devrun_gd}"
    # 1. tests, and the planted build (must FAIL: rc 1)
    bc_step layers 90 $O/tests.log $D/test_layers_cuda --jobs 4
    bc_step linear_fp8 90 $O/tests.log $D/test_linear_fp8_cuda --jobs 4
    bc_step planted 60 $O/tests.log $D/test_linear_fp8_planted --filter 'linear_fp8/dgelu_dbias*'
    bc_step dit_fp8 60 $O/tests.log $D/test_dit_fp8_cuda --verbose --jobs 2
    bc_step dit_gpu 90 $O/tests.log $D/test_dit_gpu_cuda --jobs 2
    # 2. bitwise against main: checkpoints (DiT-S) and deterministic losses at hidden 2048 and 768
    bc_ckpt fp8 --attn sage --linear fp8
    bc_ckpt sage --attn sage --linear bf16
    bc_ckpt bf16att --attn bf16 --linear bf16
    bc_losses c_fp8 $BC_C --linear fp8
    bc_losses c_bf16 $BC_C --linear bf16
    bc_losses a_fp8 $BC_A --linear fp8
    # 3. ms/step, new and main interleaved, two rounds of c and a with FP8, one of c with bf16 linears
    bc_timed c_fp8_1 $BC_C --linear fp8
    bc_timed a_fp8_1 $BC_A --linear fp8
    bc_timed c_fp8_2 $BC_C --linear fp8
    bc_timed a_fp8_2 $BC_A --linear fp8
    bc_timed c_bf16_1 $BC_C --linear bf16
    bc_times c_fp8_1 c_fp8_2 a_fp8_1 a_fp8_2 c_bf16_1
    bc_kernels 'gelu_backward|dbias_partial|column_partials_finish' $BC_C --linear fp8
    bc_done
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*) echo "usage: $0 prepare DIR [BASE_BIN] | run DIR" >&2; exit 2 ;;
esac
