#!/usr/bin/env bash
# Branch grln: in dit_gpu_forward every gated residual and the LayerNorm-modulate that reads its
# output (block l's x_mid -> norm2, its x_next -> block l + 1's norm1 or the final layer's norm) run
# as one kernel, gated_residual_layernorm_modulate_forward_cuda (layers/norm_cuda.cu): the LayerNorm
# no longer reads back the residual stream just written, one 64 MB read less per pair at c (8 pairs a
# step, ~0.15 ms by the count). Same float ops in the same order: bitwise the same results.
#   here:  bash dev/grln_gpu.sh prepare DIR BASE_DIR   (BASE_DIR: main's train_dit, libkernel_times.so)
#   GPU machine (one H200): bash DIR/grln_gpu.sh run DIR    (carry DIR and .devlibs)
# Merge rule (set before the run): every test passes (the fused kernel's own test, test_layers_cuda,
# test_dit_gpu_cuda, test_dit_fp8_cuda); the planted build (the fused kernel reading the next
# sample's gate) fails; checkpoints (bf16 and fp8 linears) and the deterministic losses at c equal
# main's; at c with --linear fp8 the CUPTI time per step of the forward's residual and LayerNorm
# kernels (new: the fused kernel + block 0's layernorm_modulate_forward_kernel; main:
# gated_residual_forward_kernel + layernorm_modulate_forward_kernel) below main's; c and a (fp8)
# ms/step not slower than main's by more than 0.1 ms.
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
    for t in test_layers_cuda test_dit_gpu_cuda test_dit_fp8_cuda; do
        cc $CFLAGS -o "$D/$t" test/$t.c -L"$D" -l:libditc.so.0 -Wl,-rpath,'$ORIGIN' $LIBS -lcriterion
    done
    # planted: the fused kernel takes the gate of the next sample (b + 1 mod B)
    python3 - "$B" <<'PY'
import sys
s = open("layers/norm_cuda.cu").read()
old = "const bf16 *g = gate + (size_t)(row / T) * gate_stride;"
assert s.count(old) == 1
open(sys.argv[1] + "/norm_cuda.cu", "w").write(s.replace(old,
    "const bf16 *g = gate + (size_t)((row / T + 1) % (rows / T)) * gate_stride;"))
PY
    mkdir -p $B/p/layers && cp layers/*.cu layers/*.cuh layers/*.h $B/p/layers/
    cp $B/norm_cuda.cu $B/p/layers/
    $NVCC $NVFLAGS -I$B/p -I. -c -o $B/p.o $B/p/layers/norm_cuda.cu
    cc $CFLAGS -o "$D/test_layers_planted_gate" test/test_layers_cuda.c $B/p.o build/libditc.a $LIBS -lcriterion
    cp train_dit "$D/"
    cp "$BASE/train_dit" "$D/train_dit_base"
    cp "$BASE/libkernel_times.so" "$D/"
    strip --strip-unneeded "$D"/*
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')" > "$D/HEAD"
    echo "main's $BASE ($(cat "$BASE/HEAD" 2>/dev/null))" > "$D/BASE"
    cp dev/grln_gpu.sh dev/branch_check.sh "$D/"
    rm -rf $B
    du -sh "$D"
}

# ms per step (11 steps) of the forward's residual and LayerNorm kernels in bc_kernels' CUPTI lists
forward_pairs() {
    local b n m
    echo "== forward residual + LayerNorm kernels, ms/step (launches/step): new | main | main - new" >> "$S"
    for b in train_dit train_dit_base; do
        awk '$0 ~ /gated_residual_forward_kernel|layernorm_modulate_forward_kernel/ {t += $1; c += $2}
             END {printf "%.3f (%.1f)\n", t / 11e6, c / 11}' "$O/kernels_$b.txt" 2>/dev/null
    done | paste -sd' ' | awk '{printf "%s %s | %s %s | %+.3f\n", $1, $2, $3, $4, $3 - $1}' >> "$S"
}

run() {
    : "${BUDGET_S:=285}"
    . "$1/branch_check.sh"
    bc_init "${1:-.devrun_grln}"
    bc_step fused 60 $O/tests.log $D/test_layers_cuda --jobs 4 --filter 'cuda/gated_residual_layernorm_modulate'
    bc_step planted_gate 60 $O/tests.log $D/test_layers_planted_gate --jobs 4 \
        --filter 'cuda/gated_residual_layernorm_modulate'
    bc_step layers 90 $O/tests.log $D/test_layers_cuda --jobs 4
    bc_step dit_gpu 120 $O/tests.log $D/test_dit_gpu_cuda --jobs 2
    bc_step dit_fp8 90 $O/tests.log $D/test_dit_fp8_cuda --jobs 2
    bc_ckpt bf16 --attn sage
    bc_ckpt fp8 --attn sage --linear fp8
    bc_losses c_fp8 $BC_C --linear fp8
    bc_kernels 'gated_residual|layernorm_modulate_forward' $BC_C --linear fp8
    forward_pairs
    bc_timed c_fp8_1 $BC_C --linear fp8
    bc_timed a_fp8_1 $BC_A --linear fp8
    bc_times c_fp8_1 a_fp8_1
    bc_done
}

case "${1:-}" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*) echo "usage: $0 prepare DIR BASE_DIR | run DIR" >&2; exit 2 ;;
esac
