#!/usr/bin/env bash
# Branch quant-fast: the FP8 quantize kernel (layers/linear_fp8_cuda.cu) transposes in registers
# (4 rows × 8 columns per thread, byte permutes) and moves words through shared memory instead of
# single bytes (main: 16 byte loads and 8 byte stores per thread and 16 elements), with packed
# two-value conversions; 128 × 64 tiles. Same conversion instruction, same bytes. At c its two
# instantiations take ~2.96 ms of kernel time per step for ~9.6 GB (~3.3 TB/s).
#   here:  bash dev/quant_fast_gpu.sh prepare DIR [BASE_DEVRUN]   (BASE_DEVRUN: main's .devrun)
#   GPU machine (one H200): bash DIR/quant_fast_gpu.sh run DIR    (carry DIR and .devlibs)
# Merge rule (set before the run): every test passes (quantize_matches_cpu with the new shapes and
# the transposed copy alone); both planted builds fail (two transposed columns swapped; the second
# half of a tile column stored at the first half's rows); checkpoints and deterministic losses equal
# main's; the fp8_quantize kernels' CUPTI time at c >= 0.2 ms per step lower than main's; c and a
# with FP8 not slower (median of the two rounds' differences >= 0).
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
    for t in test_layers_cuda test_linear_fp8_cuda test_dit_gpu_cuda test_dit_fp8_cuda test_step_graph_cuda; do
        cc $CFLAGS -o "$D/$t" test/$t.c -L"$D" -l:libditc.so.0 -Wl,-rpath,'$ORIGIN' $LIBS -lcriterion
    done
    # planted 1: two columns of the register transpose swapped; planted 2: a tile column's second
    # half (rows 64..127) stored at the first half's rows
    python3 - "$B" <<'PY2'
import sys
s = open("layers/linear_fp8_cuda.cu").read()
old1 = "    col[1] = __byte_perm(t0, t2, 0x7632);\n    col[2] = __byte_perm(t1, t3, 0x5410);"
old2 = "int w = half * (QTILE_R / 8) + (threadIdx.x % 4) * 4"
assert s.count(old1) == 1 and s.count(old2) == 1
open(sys.argv[1] + "/swap.cu", "w").write(s.replace(old1, "    col[2] = __byte_perm(t0, t2, 0x7632);\n    col[1] = __byte_perm(t1, t3, 0x5410);"))
open(sys.argv[1] + "/half.cu", "w").write(s.replace(old2, "int w = (threadIdx.x % 4) * 4"))
PY2
    for p in swap half; do
        $NVCC $NVFLAGS -I. -c -o $B/$p.o -x cu $B/$p.cu
        cc $CFLAGS -o "$D/test_linear_fp8_planted_$p" test/test_linear_fp8_cuda.c $B/$p.o build/libditc.a $LIBS -lcriterion
    done
    cp train_dit "$D/"
    cp "$BASE/train_dit" "$D/train_dit_base"
    cp "$BASE/libkernel_times.so" "$D/"
    strip --strip-unneeded "$D"/*
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > "$D/HEAD"
    echo "main's $BASE" > "$D/BASE"
    cp dev/quant_fast_gpu.sh dev/branch_check.sh "$D/"
    rm -rf $B
    du -sh "$D"
}

run() {
    : "${BUDGET_S:=300}"
    . "$1/branch_check.sh"
    bc_init "${1:-.devrun_qf}"
    # 1. tests, and the planted builds (must FAIL: rc 1)
    bc_step linear_fp8 90 $O/tests.log $D/test_linear_fp8_cuda --jobs 4 --verbose
    bc_step planted_swap 60 $O/tests.log $D/test_linear_fp8_planted_swap --filter 'linear_fp8/quantize_matches_cpu'
    bc_step planted_half 60 $O/tests.log $D/test_linear_fp8_planted_half --filter 'linear_fp8/quantize_matches_cpu'
    bc_step layers 90 $O/tests.log $D/test_layers_cuda --jobs 4
    bc_step dit_fp8 60 $O/tests.log $D/test_dit_fp8_cuda --jobs 2
    bc_step dit_gpu 120 $O/tests.log $D/test_dit_gpu_cuda --jobs 2
    bc_step step_graph 90 $O/tests.log $D/test_step_graph_cuda --jobs 2
    # 2. bitwise against main: checkpoints (DiT-S) and deterministic losses at hidden 2048 and 768
    bc_ckpt fp8 --attn sage --linear fp8
    bc_losses c_fp8 $BC_C --linear fp8
    bc_losses a_fp8 $BC_A --linear fp8
    # 3. the quantize kernels' CUPTI time at c, then ms/step, new and main interleaved, two rounds
    bc_kernels 'fp8_quantize|fp8_amax' $BC_C --linear fp8
    bc_timed c_fp8_1 $BC_C --linear fp8
    bc_timed a_fp8_1 $BC_A --linear fp8
    bc_timed c_fp8_2 $BC_C --linear fp8
    bc_timed a_fp8_2 $BC_A --linear fp8
    bc_times c_fp8_1 c_fp8_2 a_fp8_1 a_fp8_2
    bc_done
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*) echo "usage: $0 prepare DIR [BASE_DEVRUN] | run DIR" >&2; exit 2 ;;
esac
