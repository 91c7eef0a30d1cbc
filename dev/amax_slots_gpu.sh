#!/usr/bin/env bash
# Branch amax-slots: the FP8 block linears take their weights' amax from the model (one
# fp8_amax_stacked_cuda per weight stack at the start of the forward, into slots zeroed with the
# inputs' ones; the backward reads the same slots) and the attention output's amax from a pass
# into a zeroed slot: no per-call one-float memset (40 per step at c, 120 at a, each a graph node
# with ~2 µs of idle GPU around it: dev/kernel_times.c KERNEL_TIMES_GAPS) and no amax pass over the
# weights in the backward. Same scales, same bytes.
#   here:  bash dev/amax_slots_gpu.sh prepare DIR [BASE_DEVRUN]   (BASE_DEVRUN: main's .devrun)
#   GPU machine (two H200s): bash DIR/amax_slots_gpu.sh run DIR    (carry DIR and .devlibs)
# Merge rule (set before the run): every test passes (the layer's given weight amax, the stacked
# amax, the model's fused inputs against the plain path, the CUDA-graph step, ZeRO-1 and sequence
# parallelism on two GPUs); both planted builds fail (fc1's weight stack left out of the forward's
# amax; the layer ignoring a given weight amax); checkpoints and deterministic losses equal main's;
# c and a with FP8 not slower (median of the two rounds' differences >= 0), a faster by >= 0.2 ms.
# Also measured, not part of the rule: the idle time per step (new, main) and cuBLASLt without a
# workspace (ws0: whether the memset before each FP8 GEMM is cuBLASLt's workspace).
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
    # planted 1: fc1's weight stack left out of the forward's amax (its slots stay 0); planted 2: the
    # forward ignores a given weight amax; ws0: cuBLASLt without a workspace (a measurement)
    python3 - "$B" <<'PY'
import sys
m = open("model/dit_gpu.cu").read()
l = open("layers/linear_fp8_cuda.cu").read()
c = open("layers/linear_cuda.cu").read()
old1 = "    TRY(fp8_amax_stacked_cuda(wa.fc1, 4, w->fc1_w, L, 4 * h * h, m->stream, err));\n"
old2 = "FP8_E4M3, weight_amax, ws.amax + T_WEIGHT,\n                 stream, err))"
old3 = "ctx->lt_workspace_bytes = LT_WORKSPACE_BYTES;"
assert m.count(old1) == 1 and l.count(old2) == 1 and c.count(old3) == 1
open(sys.argv[1] + "/fc1.cu", "w").write(m.replace(old1, ""))
open(sys.argv[1] + "/ignore.cu", "w").write(l.replace(old2, "FP8_E4M3, NULL, ws.amax + T_WEIGHT,\n                 stream, err))"))
open(sys.argv[1] + "/ws0.cu", "w").write(c.replace(old3, "ctx->lt_workspace_bytes = 0;"))
PY
    $NVCC $NVFLAGS -I. -c -o $B/fc1.o -x cu $B/fc1.cu
    cc $CFLAGS -o "$D/test_dit_fp8_planted_fc1" test/test_dit_fp8_cuda.c $B/fc1.o build/libditc.a $LIBS -lcriterion
    $NVCC $NVFLAGS -I. -c -o $B/ignore.o -x cu $B/ignore.cu
    cc $CFLAGS -o "$D/test_linear_fp8_planted_ignore" test/test_linear_fp8_cuda.c $B/ignore.o build/libditc.a $LIBS -lcriterion
    $NVCC $NVFLAGS -I. -c -o $B/ws0.o -x cu $B/ws0.cu
    cc $CFLAGS -O3 -o "$D/train_dit_ws0" train_dit.c $B/ws0.o build/libditc.a $LIBS
    cp train_dit "$D/"
    cp "$BASE/train_dit" "$D/train_dit_base"
    cp build/libkernel_times.so "$D/" 2>/dev/null || cp "$BASE/libkernel_times.so" "$D/"
    strip --strip-unneeded "$D"/*
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > "$D/HEAD"
    echo "main's $BASE" > "$D/BASE"
    cp dev/amax_slots_gpu.sh dev/branch_check.sh "$D/"
    rm -rf $B
    du -sh "$D"
}

# idle time per step (KERNEL_TIMES_GAPS) of binary $1 with the train_dit arguments after it
gaps() {
    local b=$1 name=$2
    shift 2
    timeout 90 env LD_PRELOAD="$PWD/$D/libkernel_times.so" KERNEL_TIMES_OUT="$O/kernels_${name}.txt" \
        KERNEL_TIMES_GAPS="$O/gaps_${name}.txt" "$D/$b" "$@" --steps 11 --out "$L/g_$name" > /dev/null 2>&1
    echo "$name: $(head -1 "$O/gaps_${name}.txt") | kernels $(awk '{t += $1} END {printf "%.3f", t / 11e6}' "$O/kernels_${name}.txt")" >> "$S"
}

run() {
    : "${BUDGET_S:=420}"
    . "$1/branch_check.sh"
    bc_init "${1:-.devrun_as}"
    export CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0
    # 1. tests, and the planted builds (must FAIL: rc 1)
    bc_step linear_fp8 90 $O/tests.log $D/test_linear_fp8_cuda --jobs 4 --verbose
    bc_step planted_ignore 60 $O/tests.log $D/test_linear_fp8_planted_ignore --filter 'linear_fp8/given_amax*'
    bc_step dit_fp8 90 $O/tests.log $D/test_dit_fp8_cuda --jobs 2 --verbose
    bc_step planted_fc1 90 $O/tests.log $D/test_dit_fp8_planted_fc1 --jobs 2
    bc_step layers 90 $O/tests.log $D/test_layers_cuda --jobs 4
    bc_step dit_gpu 120 $O/tests.log $D/test_dit_gpu_cuda --jobs 2
    bc_step step_graph 90 $O/tests.log $D/test_step_graph_cuda --jobs 2
    # 2. bitwise against main
    bc_ckpt fp8 --attn sage --linear fp8
    bc_ckpt fp8_eager --attn sage --linear fp8 --cuda-graph off
    bc_losses c_fp8 $BC_C --linear fp8
    bc_losses a_fp8 $BC_A --linear fp8
    # 3. ms/step, new and main interleaved, two rounds
    bc_timed c_fp8_1 $BC_C --linear fp8
    bc_timed a_fp8_1 $BC_A --linear fp8
    bc_timed c_fp8_2 $BC_C --linear fp8
    bc_timed a_fp8_2 $BC_A --linear fp8
    bc_times c_fp8_1 c_fp8_2 a_fp8_1 a_fp8_2
    # 4. ZeRO-1 and sequence parallelism (both GPUs) against one GPU
    CUDA_VISIBLE_DEVICES=0,1 bc_step distributed 150 $O/sp.log $D/test_distributed_cuda --jobs 1
    CUDA_VISIBLE_DEVICES=0,1 bc_step sp_model 150 $O/sp.log $D/test_sp_model_cuda --jobs 1
    # 5. measurements: idle per step, new / main / cuBLASLt without workspace (on the new code)
    echo "== idle per step (KERNEL_TIMES_GAPS, steps 4-10 of 11)" >> "$S"
    gaps train_dit c_new $BC_C --linear fp8
    gaps train_dit_base c_main $BC_C --linear fp8
    gaps train_dit_ws0 c_ws0 $BC_C --linear fp8
    gaps train_dit a_new $BC_A --linear fp8
    gaps train_dit_base a_main $BC_A --linear fp8
    gaps train_dit_ws0 a_ws0 $BC_A --linear fp8
    bc_done
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*) echo "usage: $0 prepare DIR [BASE_DEVRUN] | run DIR" >&2; exit 2 ;;
esac
