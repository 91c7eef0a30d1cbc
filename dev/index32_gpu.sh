#!/usr/bin/env bash
# Branch index32 on the GPU machine in one call: the head split and the dq/dk merge compute their row
# indices in 32 bits (no 64-bit division routine: 424 → 280 and 576 → 352 instructions of SASS).
#   here:  bash dev/index32_gpu.sh prepare DIR BASE_BIN
#   GPU machine (two H200s: the sequence-parallel model test needs both; everything else on GPU 0):
#          bash DIR/index32_gpu.sh run DIR      (carry DIR and .devlibs; NCCL_NVLS_ENABLE=0)
# Merge rule (set before the run): every test passes (rc 0), the planted build (the split's row
# index taking q, k, v from the wrong third) fails, checkpoints (sage + FP8, sage + bf16 linears, bf16
# attention) and the deterministic losses at hidden 2048 / 768 equal main's, and split_qkv_kernel
# + merge_qkv_grad_kernel take >= 0.1 ms less per step at c with FP8 than main's (CUPTI).
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
        build/test_layers_cuda build/test_linear_fp8_cuda build/test_sp_model_cuda
    # planted: the split's row index takes q, k, v from the wrong third (which mod 2)
    sed 's|h = r % H, which = (r / H) % 3, bt = r / (3 \* H)|h = r % H, which = (r / H) % 2, bt = r / (3 * H)|' model/dit_gpu.cu > $B/swap.cu
    cmp -s model/dit_gpu.cu $B/swap.cu && { echo "planted: sed changed nothing" >&2; exit 1; }
    mkdir -p $B/p/model && cp model/*.h $B/p/model/ && cp $B/swap.cu $B/p/model/dit_gpu.cu
    $NVCC $NVFLAGS -DDIT_NCCL -I$B/p -I. -c -o $B/p/dit_gpu.o $B/p/model/dit_gpu.cu
    cc $CFLAGS -o $D/test_dit_gpu_planted test/test_dit_gpu_cuda.c $B/p/dit_gpu.o build/libditc.a $LIBS -lcriterion
    # (not test_step_graph_cuda: with .devlibs the folder would pass the 64 MiB the device tool carries;
    # the deterministic checkpoints below run the step as a CUDA graph and compare it with main's)
    cp build/test_dit_gpu_cuda build/test_dit_fp8_cuda build/test_sp_model_cuda train_dit $D/
    cp "$BASE_BIN" $D/train_dit_base
    strip $D/*
    echo "$(git -C "$(dirname "$BASE_BIN")" rev-parse --short HEAD) ($BASE_BIN)" > $D/BASE
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > $D/HEAD
    cp dev/index32_gpu.sh dev/branch_check.sh $D/
    rm -rf $B
    du -sh "$D"
}

run() {
    : "${BUDGET_S:=380}"
    . "$1/branch_check.sh"
    bc_init "${1:-.devrun_ix}"
    export CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0
    # 1. tests, and the planted build (must FAIL: rc 1)
    bc_step planted 60 $O/tests.log $D/test_dit_gpu_planted --filter 'dit_gpu/one_step_output*'
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
    bc_peak c_fp8_1
    bc_kernels 'split_qkv|merge_qkv' $BC_C --linear fp8
    # 4. the sequence-parallel model (both GPUs): its head-major dout is still zeroed and accumulated
    CUDA_VISIBLE_DEVICES=0,1 bc_step sp_model 150 $O/sp.log $D/test_sp_model_cuda --jobs 1
    bc_done
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*) echo "usage: $0 prepare DIR [BASE_BIN] | run DIR" >&2; exit 2 ;;
esac
