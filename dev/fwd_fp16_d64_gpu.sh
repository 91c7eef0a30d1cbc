#!/usr/bin/env bash
# Branch fwd-fp16-d64: FP16 P·V in the D = 64 one-warpgroup Hopper forward (sage_forward_sm90.cu,
# sage_forward_wg_kernel<64, false>: P16 from the S accumulators, four m64n64k16 f16 wgmmas over
# V̂ᵀ rows of 128 bytes; dispatched for SAGE_PV_FP16 at D = 64, so --attn sage-fp16 at head dim 64
# no longer falls back to the mma.sync forward). The FP8 instantiation's SASS and both D = 128
# kernels' are byte-identical to main's (checked here with cuobjdump), so FP8 results must not move.
#   here:  bash dev/fwd_fp16_d64_gpu.sh prepare DIR BASE_DIR   (DIR absolute, e.g. /work/main/.devrun_fp16d64;
#          BASE_DIR: main's train_dit and libkernel_times.so (or build/libkernel_times.so), e.g.
#          /work/main/.devrun_base or an up-to-date /work/main)
#   GPU machine (one H200): bash DIR/fwd_fp16_d64_gpu.sh run DIR   (carry DIR and .devlibs)
# Rule (written before any run): adopt the kernel as sage-fp16's forward at D = 64 when
#   1. every test passes: test_sage_forward_fp16_sm90_cuda (D = 64 and 128 vs the CPU definition:
#      rel L2 < 3e-4, cosine > 0.99999, lse < 1e-4; vs mma.sync FP16 at 4K, 16K, 16 × 1111,
#      4 × 16 × 1000; second runs and the merged layout bitwise), test_sage_forward_sm90_cuda and
#      test_sage_cuda's forward and merged-layout tests;
#   2. both planted builds fail d64_matches_definition (O not rescaled by alpha; P·V pairing the
#      P of keys 0-31 with V̂ᵀ of keys 32-63 and back);
#   3. the FP8 SASS md5s (D = 64 and D = 128) equal main's, and the FP8 checkpoints (--attn sage,
#      DiT-S: D = 64) equal main's byte for byte;
#   4. the FP16 sm90 forward is faster than the FP16 mma.sync forward at D = 64, N = 4K, 16K and
#      32K (bench_sage_fwd_fp16.py, whole forward), and --attn sage-fp16 at b (4096 tokens, D = 64)
#      is not slower than main's (median ms/step, both rounds).
# Reported beside it, not part of the rule: TFLOP/s next to FP8 sm90's and cuDNN's at D = 64; the
# sage-fp16 forward kernel's CUPTI ms per step at b, new and main; the b step of sage (FP8, unchanged
# code); the losses of sage-fp16 at b vs main's (different forward kernels, so equal only at the
# printed precision or close: the largest relative difference).
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
bugs = {"norescale": [("for (int i = 0; i < D / 2; i++) o[i] = o[i] * alpha[(i % 4) / 2] + blk[i];",
                       "for (int i = 0; i < D / 2; i++) o[i] = o[i] + blk[i];")],
        "vhalf": [("wgmma_f16_m64n64k16_rs<0>(blk, p[0], desc_v);",
                   "wgmma_f16_m64n64k16_rs<0>(blk, p[0], desc_advance(desc_v, 64));"),
                  ("wgmma_f16_m64n64k16_rs<1>(blk, p[t], desc_advance(desc_v, 32 * t));",
                   "wgmma_f16_m64n64k16_rs<1>(blk, p[t], desc_advance(desc_v, 32 * (t ^ 2)));")]}
for name, edits in bugs.items():
    t = s
    for old, new in edits:
        assert t.count(old) == 1, name
        t = t.replace(old, new)
    open(f"{sys.argv[1]}/planted_{name}.cu", "w").write(t)
PY
    for p in norescale vhalf; do
        $NVCC $NVFLAGS -I. -c -o $B/$p.o $B/planted_$p.cu
        cc $CFLAGS -o "$D/test_planted_$p" test/test_sage_forward_fp16_sm90_cuda.c $B/$p.o build/libditc.a $LIBS \
            -lcriterion
    done
    # the FP8 kernels' machine code (and the D = 128 FP16 one's) against main's
    local CUOBJ=${CUOBJDUMP:-/tmp/cuobj/nvidia/cu13/bin/cuobjdump}
    if [ -x "$CUOBJ" ]; then
        mkdir -p $B/main_tree && git archive main attention layers | tar -x -C $B/main_tree
        $NVCC $NVFLAGS -I$B/main_tree -c -o $B/main_sm90.o $B/main_tree/attention/sage_forward_sm90.cu
        $NVCC $NVFLAGS -I. -c -o $B/new_sm90.o attention/sage_forward_sm90.cu
        local args='v14CUtensorMap_stS0_S0_P13__nv_bfloat16Pf13SageCudaQuant' k main new
        sass_md5() { "$CUOBJ" -sass -fun "$2" "$1" | grep -v Function | md5sum | cut -c1-32; }
        : > "$D/SASS"
        for k in "FP8 D = 64|_Z22sage_forward_wg_kernelILi64EE${args}ii|_Z22sage_forward_wg_kernelILi64ELb1EE${args}ii" \
                 "FP8 D = 128|_Z24sage_forward_sm90_kernelILi128ELb1EE${args}iiii|_Z24sage_forward_sm90_kernelILi128ELb1EE${args}iiii" \
                 "FP16 D = 128|_Z24sage_forward_sm90_kernelILi128ELb0EE${args}iiii|_Z24sage_forward_sm90_kernelILi128ELb0EE${args}iiii"; do
            main=$(sass_md5 $B/main_sm90.o "$(echo "$k" | cut -d'|' -f2)")
            new=$(sass_md5 $B/new_sm90.o "$(echo "$k" | cut -d'|' -f3)")
            echo "$(echo "$k" | cut -d'|' -f1) kernel SASS md5: main $main, branch $new $([ "$main" = "$new" ] && echo EQUAL || echo DIFFERENT)" >> "$D/SASS"
        done
    fi
    cp train_dit "$D/"
    cp "$BASE/train_dit" "$D/train_dit_base"
    cp "$BASE/libkernel_times.so" "$D/" 2>/dev/null || cp "$BASE/build/libkernel_times.so" "$D/" 2>/dev/null || true
    strip --strip-unneeded "$D"/test_* "$D"/train_dit* "$D"/libditc.so.0
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > "$D/HEAD"
    echo "main's $BASE ($(cat "$BASE/HEAD" 2>/dev/null || git -C "$BASE" rev-parse --short HEAD))" > "$D/BASE"
    cp dev/fwd_fp16_d64_gpu.sh dev/branch_check.sh dev/bench_sage_fwd_fp16.py dev/bench_common.py "$D/"
    rm -rf $B
    cat "$D/SASS" 2>/dev/null
    du -sh "$D"
}

run() {
    : "${BUDGET_S:=240}"
    . "$1/branch_check.sh"
    bc_init "${1:-.devrun_fp16d64}"
    local BC_B="$BC_RUN --hidden 1152 --heads 18 --depth 4 --batch 4 --image-size 128 --patch 2"   # b: 4096 tokens, D = 64
    cat "$D/SASS" >> "$S" 2>/dev/null
    bc_step fp16_sm90 90 $O/tests.log $D/test_sage_forward_fp16_sm90_cuda --jobs 4
    bc_step fp8_sm90 60 $O/tests.log $D/test_sage_forward_sm90_cuda --jobs 2
    bc_step sage_forward 90 $O/tests.log $D/test_sage_cuda --jobs 4 --filter 'sage_cuda/*forward*'
    bc_step sage_merged 60 $O/tests.log $D/test_sage_cuda --jobs 4 --filter 'sage_cuda/merged*'
    bc_step planted_norescale 30 $O/tests.log $D/test_planted_norescale --filter 'sage_forward_fp16_sm90/d64_matches_definition'
    bc_step planted_vhalf 30 $O/tests.log $D/test_planted_vhalf --filter 'sage_forward_fp16_sm90/d64_matches_definition'
    bc_step bench 60 $O/bench.txt python3 $D/bench_sage_fwd_fp16.py $D/libditc.so.0 64
    bc_ckpt fp8 --attn sage
    bc_timed b_fp16 $BC_B --attn sage-fp16
    bc_timed b_fp8 $BC_B
    bc_timed b_fp16_r2 $BC_B --attn sage-fp16
    bc_times b_fp16 b_fp16_r2 b_fp8
    bc_losses b_fp16 $BC_B --attn sage-fp16
    bc_kernels 'sage_forward' $BC_B --attn sage-fp16
    grep -h "sm90 fp16" $O/tests.log | grep "D=64" | head -20 >> "$S"
    grep -h "FAIL\|Synthesis" $O/tests.log | head -20 >> "$S"
    grep -A5 "^| N |" $O/bench.txt >> "$S"
    bc_done
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*) echo "usage: $0 prepare DIR BASE_DIR | run DIR" >&2; exit 2 ;;
esac
