#!/usr/bin/env bash
# Branch fwd-rows: the Hopper D = 128 sage forward runs the tiles of a last round that would leave
# half of the SMs idle as two units each, query blocks 0-1 and block 2 on two CTAs; every row is
# computed by the same instructions (the consumer loop's SASS is main's, instruction for
# instruction), so the results are bitwise main's. Counted at c (1376 tiles on 132 SMs, 56 in the
# 11th round): that round takes a CTA with two busy consumers instead of three, ~0.7 of a tile-time
# by session 3's per-consumer profile: ~2.7% of the forward, ~0.3 ms per step.
#   here:  bash dev/fwd_rows_gpu.sh prepare DIR [BASE_DEVRUN]   (BASE_DEVRUN: main's .devrun)
#   GPU machine (one H200): bash DIR/fwd_rows_gpu.sh run DIR    (carry DIR and .devlibs)
# Merge rule (set before the run): every test passes; both planted builds fail the split test (the
# second unit's busy consumer 1 instead of 2; the pairs mapped to the wrong tiles); checkpoints and
# deterministic losses equal main's; bench_sage_fwd_ab bitwise equal at every size, new faster than
# main by >= 2% at N = 8K and 16K and not slower than 1% at 4K and 32K; the forward's CUPTI time at c
# >= 0.2 ms per step lower.
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
    for t in test_sage_cuda test_dit_gpu_cuda test_dit_fp8_cuda test_attention_determinism_cuda; do
        cc $CFLAGS -o "$D/$t" test/$t.c -L"$D" -l:libditc.so.0 -Wl,-rpath,'$ORIGIN' $LIBS -lcriterion
    done
    # planted 1: the second unit's busy consumer is 1, not 2; planted 2: the pairs map to the wrong tiles
    python3 - "$B" <<'PY'
import sys
s = open("attention/sage_forward_sm90.cu").read()
old1 = "    return u < whole || ((u - whole) % 2 == 0 ? wg < 2 : wg == 2);"
old2 = "{ return u < whole ? u : whole + (u - whole) / 2; }"
assert old1 in s and old2 in s
open(sys.argv[1] + "/busy.cu", "w").write(s.replace(old1, "    return u < whole || ((u - whole) % 2 == 0 ? wg < 2 : wg == 1);"))
open(sys.argv[1] + "/tiles.cu", "w").write(s.replace(old2, "{ return u < whole ? u : whole + (u - whole) % 2; }"))
PY
    for p in busy tiles; do
        $NVCC $NVFLAGS -I. -c -o $B/$p.o -x cu $B/$p.cu
        cc $CFLAGS -o "$D/test_sage_planted_$p" test/test_sage_cuda.c $B/$p.o build/libditc.a $LIBS -lcriterion
    done
    gcc -O2 -fPIC -std=c11 -D_GNU_SOURCE -I. -c layers/common.c -o $B/common_pic.o
    $NVCC $NVFLAGS -I. -shared -o "$D/libsage_bench.so" attention/sage_quant.cu attention/sage_forward.cu \
        attention/sage_forward_sm90.cu attention/sage_backward.cu attention/sage_backward_sm90.cu $B/common_pic.o
    cp "$BASE/libsage_bench.so" "$D/libsage_bench_base.so"
    cp "$BASE/train_dit" "$D/train_dit_base"
    cp "$BASE/libkernel_times.so" "$D/"
    cp train_dit "$D/"
    strip --strip-unneeded "$D"/*
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > "$D/HEAD"
    echo "main's $BASE" > "$D/BASE"
    cp dev/fwd_rows_gpu.sh dev/branch_check.sh "$D/"
    rm -rf $B
    du -sh "$D"
}

run() {
    : "${BUDGET_S:=330}"
    . "$1/branch_check.sh"
    bc_init "${1:-.devrun_fr}"
    export CUDA_VISIBLE_DEVICES=0
    # 1. tests (the split test prints its counts to stderr: kept in tests.log), the planted builds (must FAIL)
    bc_step sage_split 60 $O/tests.log $D/test_sage_cuda --filter 'sage_cuda/sm90_forward*' --verbose
    bc_step planted_busy 60 $O/tests.log $D/test_sage_planted_busy --filter 'sage_cuda/sm90_forward_split*'
    bc_step planted_tiles 60 $O/tests.log $D/test_sage_planted_tiles --filter 'sage_cuda/sm90_forward_split*'
    bc_step sage 120 $O/tests.log $D/test_sage_cuda --jobs 4
    bc_step determinism 60 $O/tests.log $D/test_attention_determinism_cuda --jobs 2
    bc_step dit_fp8 60 $O/tests.log $D/test_dit_fp8_cuda --jobs 2
    bc_step dit_gpu 90 $O/tests.log $D/test_dit_gpu_cuda --jobs 2
    # 2. the forward alone, this branch's library against main's in one process
    bc_step bench_ab 120 $O/bench.log python3 dev/bench_sage_fwd_ab.py $D/libsage_bench.so $D/libsage_bench_base.so
    # 3. train_dit against main: bitwise, then ms/step interleaved, CUPTI of the forward
    bc_ckpt fp8 --attn sage --linear fp8
    bc_ckpt sage --attn sage --linear bf16
    bc_losses c_fp8 $BC_C --linear fp8
    bc_losses c_bf16 $BC_C --linear bf16
    bc_timed c_fp8_1 $BC_C --linear fp8
    bc_timed c_fp8_2 $BC_C --linear fp8
    bc_times c_fp8_1 c_fp8_2
    bc_kernels 'sage_forward' $BC_C --linear fp8
    bc_done
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*) echo "usage: $0 prepare DIR [BASE_DEVRUN] | run DIR" >&2; exit 2 ;;
esac
