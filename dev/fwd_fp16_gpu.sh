#!/usr/bin/env bash
# Branch fwd-fp16: FP16 P·V in the D = 128 warp-specialized Hopper forward (sage_forward_sm90.cu,
# sage_forward_sm90_kernel<128, false>: P16 from the S accumulators, m64n32k16 f16 wgmma over
# quarters of D; dispatched for SAGE_PV_FP16 at D = 128, so --attn sage-fp16 no longer falls back
# to the mma.sync forward). The FP8 instantiation's SASS is byte-identical to main's (checked here
# with cuobjdump), so FP8 results must not move.
#   here:  bash dev/fwd_fp16_gpu.sh prepare DIR BASE_DIR   (DIR absolute, e.g. /work/main/.devrun_fp16f;
#          BASE_DIR: main's train_dit and libkernel_times.so, /work/main/.devrun_base)
#   GPU machine (one H200): bash DIR/fwd_fp16_gpu.sh run DIR   (carry DIR and .devlibs)
# Rule (written before any run): adopt the kernel as sage-fp16's forward when
#   1. every test passes: test_sage_forward_fp16_sm90_cuda (vs the CPU definition: rel L2 < 3e-4,
#      cosine > 0.99999, lse < 1e-4; vs mma.sync FP16; split rounds and merged layout bitwise),
#      test_sage_forward_sm90_cuda and test_sage_cuda's forward and merged-layout tests;
#   2. both planted builds fail matches_definition (O not rescaled by alpha; P·V reading the wrong
#      quarter of V̂ᵀ);
#   3. the FP8 checkpoints (--attn sage) equal main's byte for byte;
#   4. the FP16 sm90 forward is faster than the FP16 mma.sync forward at N = 4K, 16K and 32K
#      (bench_sage_fwd_fp16.py), and --attn sage-fp16 at c is not slower than main's.
# Reported beside it, not part of the rule: its TFLOP/s next to FP8 sm90's and cuDNN's, the c step
# time of sage-fp16 vs sage (the cost of FP16 in training), and the losses of sage-fp16 vs main's
# (different kernels, so not equal: the largest relative difference). Whether FP16 becomes the
# default is a separate decision (accuracy: README "Sage attention accuracy"; speed: this run).
set -uo pipefail

prepare() {
    set -e
    local D=$1 BASE=$2
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc} B
    local NVFLAGS="-O3 -std=c++17 --use_fast_math -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a"
    local CFLAGS="-O2 -std=c11 -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    local LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && { LIBS="$LIBS -lnccl"; CFLAGS="$CFLAGS -DDIT_NCCL"; }
    B=$(mktemp -d)
    rm -rf "$D" && mkdir -p "$D"
    make -j2 train_dit build/libditc.a build/libditc.so
    cp build/libditc.so "$D/libditc.so.0"
    for t in test_sage_forward_fp16_sm90_cuda test_sage_forward_sm90_cuda test_sage_cuda; do
        cc $CFLAGS -o "$D/$t" test/$t.c -L"$D" -l:libditc.so.0 -Wl,-rpath,'$ORIGIN' $LIBS -lcriterion
    done
    # planted bugs, each a copy of sage_forward_sm90.cu linked before libditc.a
    python3 - "$B" <<'PY'
import sys
s = open("attention/sage_forward_sm90.cu").read()
bugs = {"norescale": ("o[16 * q + i] = o[16 * q + i] * alpha[(i % 4) / 2] + blk[i];",
                      "o[16 * q + i] = o[16 * q + i] + blk[i];"),
        "vquarter": ("smem_desc<128>(sV + q * 32 * 128)", "smem_desc<128>(sV + (q ^ 1) * 32 * 128)")}
for name, (old, new) in bugs.items():
    assert s.count(old) == 1, name
    open(f"{sys.argv[1]}/planted_{name}.cu", "w").write(s.replace(old, new))
PY
    for p in norescale vquarter; do
        $NVCC $NVFLAGS -I. -c -o $B/$p.o $B/planted_$p.cu
        cc $CFLAGS -o "$D/test_planted_$p" test/test_sage_forward_fp16_sm90_cuda.c $B/$p.o build/libditc.a $LIBS \
            -lcriterion
    done
    # the FP8 kernel's machine code against main's (the FP16 one is new)
    local CUOBJ=${CUOBJDUMP:-/tmp/cuobj/nvidia/cu13/bin/cuobjdump}
    if [ -x "$CUOBJ" ]; then
        mkdir -p $B/main_tree && git archive main attention layers | tar -x -C $B/main_tree
        $NVCC $NVFLAGS -I$B/main_tree -c -o $B/main_sm90.o $B/main_tree/attention/sage_forward_sm90.cu
        $NVCC $NVFLAGS -I. -c -o $B/new_sm90.o attention/sage_forward_sm90.cu
        local fp8_main fp8_new
        fp8_main=$("$CUOBJ" -sass -fun '_Z24sage_forward_sm90_kernelILi128EEv14CUtensorMap_stS0_S0_P13__nv_bfloat16Pf13SageCudaQuantiiii' $B/main_sm90.o | grep -v Function | md5sum | cut -c1-32)
        fp8_new=$("$CUOBJ" -sass -fun '_Z24sage_forward_sm90_kernelILi128ELb1EEv14CUtensorMap_stS0_S0_P13__nv_bfloat16Pf13SageCudaQuantiiii' $B/new_sm90.o | grep -v Function | md5sum | cut -c1-32)
        echo "FP8 D = 128 kernel SASS md5: main $fp8_main, branch $fp8_new" > "$D/SASS"
    fi
    cp train_dit "$D/"
    cp "$BASE/train_dit" "$D/train_dit_base"
    cp "$BASE/libkernel_times.so" "$D/" 2>/dev/null || true
    strip --strip-unneeded "$D"/test_* "$D"/train_dit* "$D"/libditc.so.0
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > "$D/HEAD"
    echo "main's $BASE" > "$D/BASE"
    cp dev/fwd_fp16_gpu.sh dev/branch_check.sh dev/bench_sage_fwd_fp16.py dev/bench_common.py "$D/"
    rm -rf $B
    cat "$D/SASS" 2>/dev/null
    du -sh "$D"
}

run() {
    : "${BUDGET_S:=270}"
    . "$1/branch_check.sh"
    bc_init "${1:-.devrun_fp16f}"
    cat "$D/SASS" >> "$S" 2>/dev/null
    bc_step fp16_sm90 90 $O/tests.log $D/test_sage_forward_fp16_sm90_cuda --jobs 4
    bc_step fp8_sm90 60 $O/tests.log $D/test_sage_forward_sm90_cuda --jobs 2
    bc_step sage_forward 90 $O/tests.log $D/test_sage_cuda --jobs 4 --filter 'sage_cuda/*forward*'
    bc_step sage_merged 60 $O/tests.log $D/test_sage_cuda --jobs 4 --filter 'sage_cuda/merged*'
    bc_step planted_norescale 40 $O/tests.log $D/test_planted_norescale --filter 'sage_forward_fp16_sm90/matches_definition'
    bc_step planted_vquarter 40 $O/tests.log $D/test_planted_vquarter --filter 'sage_forward_fp16_sm90/matches_definition'
    bc_step bench 90 $O/bench.txt python3 $D/bench_sage_fwd_fp16.py $D/libditc.so.0
    bc_ckpt fp8 --attn sage
    bc_timed c_fp16 $BC_C --attn sage-fp16
    bc_timed c_fp8 $BC_C
    bc_times c_fp16 c_fp8
    bc_losses c_fp16 $BC_C --attn sage-fp16
    grep -h "sm90 fp16" $O/tests.log | head -20 >> "$S"
    grep -A8 "^| N |" $O/bench.txt >> "$S"
    bc_done
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*) echo "usage: $0 prepare DIR BASE_DIR | run DIR" >&2; exit 2 ;;
esac
