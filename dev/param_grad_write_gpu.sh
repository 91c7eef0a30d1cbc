#!/usr/bin/env bash
# Branch param-grad-write: dit_gpu_backward_fresh (= dit_gpu_zero_grad + dit_gpu_backward, bitwise)
# leaves the weight stacks of the block linears and of the adaLN projection to their GEMMs (beta 0:
# the new dweight_beta of linear_backward_cuda / linear_fp8_backward_cuda and their dGELU variants)
# instead of zeroing them first; train_dit's step (eager and CUDA graph) uses it. At c that takes
# 1.17 GB of the step's 1.26 GB gradient memset away (~0.35 ms by the count; a: ~0.15 ms).
#   here:  bash dev/param_grad_write_gpu.sh prepare DIR [BASE_DEVRUN]   (BASE_DEVRUN: main's .devrun)
#   GPU machine (two H200s: the ZeRO-1 and sequence-parallel tests need both):
#          bash DIR/param_grad_write_gpu.sh run DIR      (carry DIR and .devlibs; NCCL_NVLS_ENABLE=0)
# Merge rule (set before the run): every test passes (the new backward_fresh test, the layers'
# dweight_beta 0 tests, the CUDA-graph step byte-identical to eager zero_grad + backward, ZeRO-1 and
# sequence parallelism against one GPU); both planted builds fail (the memset after the last weight
# stack left out; fc1's weight gradient still accumulating into the poisoned buffer); checkpoints
# and deterministic losses equal main's; c and a with FP8 not slower than main (median of the two
# rounds' differences >= 0).
set -uo pipefail

prepare() {
    set -e
    local D=$1 BASE=${2:-.devrun}
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc} B
    local NVFLAGS="-O3 -std=c++17 --use_fast_math -Xcompiler -fPIC -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local CFLAGS="-O2 -std=c11 -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    local LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && { LIBS="$LIBS -lnccl"; CFLAGS="$CFLAGS -DDIT_NCCL"; }
    B=$(mktemp -d)
    rm -rf "$D" && mkdir -p "$D"
    make -j2 train_dit build/libditc.a build/libditc.so
    cp build/libditc.so "$D/libditc.so.0"
    for t in test_layers_cuda test_linear_fp8_cuda test_dit_gpu_cuda test_dit_fp8_cuda test_step_graph_cuda \
             test_distributed_cuda test_sp_model_cuda; do
        cc $CFLAGS -o "$D/$t" test/$t.c -L"$D" -l:libditc.so.0 -Wl,-rpath,'$ORIGIN' $LIBS -lcriterion
    done
    # planted 1: the gradients after the last weight stack not zeroed; planted 2: fc1's weight
    # gradient accumulating (beta 1) into the buffer the fresh backward did not zero
    python3 - "$B" <<'PY'
import sys
s = open("model/dit_gpu.cu").read()
old1 = "        size_t to = k < DIT_BLOCK_GRAD_RANGES ? offsets[k] : m->num_params;"
old2 = "dw->fc1_w + (size_t)l * 4 * h * h, wb,"
assert old1 in s and s.count(old2) == 1
open(sys.argv[1] + "/tail.cu", "w").write(s.replace(old1, "        size_t to = k < DIT_BLOCK_GRAD_RANGES ? offsets[k] : from;"))
open(sys.argv[1] + "/fc1.cu", "w").write(s.replace(old2, "dw->fc1_w + (size_t)l * 4 * h * h, 1.0f,"))
PY
    for p in tail fc1; do
        $NVCC $NVFLAGS -I. -c -o $B/$p.o -x cu $B/$p.cu
        cc $CFLAGS -o "$D/test_dit_gpu_planted_$p" test/test_dit_gpu_cuda.c $B/$p.o build/libditc.a $LIBS -lcriterion
    done
    cp train_dit "$D/"
    cp "$BASE/train_dit" "$D/train_dit_base"
    strip --strip-unneeded "$D"/*
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > "$D/HEAD"
    echo "main's $BASE" > "$D/BASE"
    cp dev/param_grad_write_gpu.sh dev/branch_check.sh "$D/"
    rm -rf $B
    du -sh "$D"
}

run() {
    : "${BUDGET_S:=420}"
    . "$1/branch_check.sh"
    bc_init "${1:-.devrun_pgw}"
    export CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0
    # 1. tests, and the planted builds (must FAIL: rc 1)
    bc_step dit_gpu 120 $O/tests.log $D/test_dit_gpu_cuda --jobs 2 --verbose
    bc_step planted_tail 60 $O/tests.log $D/test_dit_gpu_planted_tail --filter 'dit_gpu/backward_fresh*'
    bc_step planted_fc1 60 $O/tests.log $D/test_dit_gpu_planted_fc1 --filter 'dit_gpu/backward_fresh*'
    bc_step layers 90 $O/tests.log $D/test_layers_cuda --jobs 4
    bc_step linear_fp8 90 $O/tests.log $D/test_linear_fp8_cuda --jobs 4
    bc_step dit_fp8 60 $O/tests.log $D/test_dit_fp8_cuda --jobs 2
    bc_step step_graph 90 $O/tests.log $D/test_step_graph_cuda --jobs 2
    # 2. bitwise against main: checkpoints (DiT-S) and deterministic losses at hidden 2048 and 768
    bc_ckpt fp8 --attn sage --linear fp8
    bc_ckpt sage --attn sage --linear bf16
    bc_ckpt eager --attn sage --linear bf16 --cuda-graph off
    bc_losses c_fp8 $BC_C --linear fp8
    bc_losses a_fp8 $BC_A --linear fp8
    # 3. ms/step, new and main interleaved, two rounds of c and a with FP8
    bc_timed c_fp8_1 $BC_C --linear fp8
    bc_timed a_fp8_1 $BC_A --linear fp8
    bc_timed c_fp8_2 $BC_C --linear fp8
    bc_timed a_fp8_2 $BC_A --linear fp8
    bc_times c_fp8_1 c_fp8_2 a_fp8_1 a_fp8_2
    # 4. ZeRO-1 and sequence parallelism (both GPUs) against one GPU
    CUDA_VISIBLE_DEVICES=0,1 bc_step distributed 150 $O/sp.log $D/test_distributed_cuda --jobs 1
    CUDA_VISIBLE_DEVICES=0,1 bc_step sp_model 150 $O/sp.log $D/test_sp_model_cuda --jobs 1
    bc_done
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*) echo "usage: $0 prepare DIR [BASE_DEVRUN] | run DIR" >&2; exit 2 ;;
esac
