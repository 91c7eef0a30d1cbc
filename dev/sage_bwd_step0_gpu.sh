#!/usr/bin/env bash
# Validation of step 0 of dev/notes_bwd_plan.md (E1 folded dQ-tile and dSᵀ stores, E3 the k - k_mean
# prologue with all global loads first, in attention/backward_sm90.cuh) in ONE device call. Both
# changes must keep the sage Hopper backward's results bitwise identical to the reference commit
# REF (default: the merge-base of main and HEAD, the commit the branch started from).
#   here (nvcc, no GPU):   bash dev/sage_bwd_step0_gpu.sh prepare
#       builds .devrun_step0/ (git-ignored) from this tree: test_sage_cuda,
#       test_attention_determinism_cuda, compare_sage_bwd (dev/compare_sage_bwd.c, linked with REF's
#       attention/sage_backward_sm90.cu built from `git archive REF` with its entry points renamed
#       ref_*), libsage_bench.so (this tree) and libsage_bench_ref.so (REF), and one planted-bug
#       build per change (sed-modified copies of backward_sm90.cuh, never committed) of
#       test_sage_cuda and compare_sage_bwd: "e1" XORs 16·(j % 4) instead of 32·(j % 4) in the
#       folded dQ-tile store, "e3" drops the last row of the k - k_mean stores.
#       LIBS (default /work/main/.devlibs): where Criterion's runtime libraries are copied from
#       into .devlibs/ if this tree has none.
#   GPU machine (run tool, carry .devrun_step0 and .devlibs):   bash .devrun_step0/sage_bwd_step0_gpu.sh run
#       (prepare copies this script and the Python it runs into .devrun_step0/, so the run needs
#       nothing from the tree: it works from a checkout of main too)
#       logs to $OUT: gpu.txt, compare.log (must PASS), planted_compare_{e1,e3}.log (must FAIL),
#       test_sage_cuda.log and test_attention_determinism_cuda.log (must pass),
#       planted_test_{e1,e3}.log (must FAIL), bench_ab.log (this tree vs REF, one process),
#       bench_attention.log (this tree next to cuDNN), memcheck.log; summary.txt.
# Every step has its own timeout (240 s in all, most steps should take a fraction) so that a hang
# still returns the logs; the steps run in order of importance.
set -uo pipefail
DIR=.devrun_step0

prepare() {
    set -e
    local REF=${REF:-$(git merge-base main HEAD)}
    make -j2 build/test_sage_cuda build/test_attention_determinism_cuda build/libditc.a
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
    local NVFLAGS="-O3 -std=c++17 --use_fast_math -Xcompiler -Wall -gencode=arch=compute_90a,code=sm_90a"
    local CUDA_LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && CUDA_LIBS="$CUDA_LIBS -lnccl"
    local CFLAGS="-O3 -g -std=c11 -Wall -Wextra -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    local RENAME="-Dattention_backward_sm90_kernel=ref_attention_backward_sm90_kernel
                  -Dsage_backward_sm90_cuda=ref_sage_backward_sm90_cuda
                  -Dsage_backward_sm90_available=ref_sage_backward_sm90_available"
    local B=build/step0
    rm -rf "$DIR" "$B" && mkdir -p "$DIR" "$B/ref" "$B/e1/attention" "$B/e3/attention"
    echo "$REF" > "$DIR/ref.txt"
    # the run step and its Python, so that `run` needs only the carried folders (any tree root)
    cp dev/sage_bwd_step0_gpu.sh dev/bench_sage_bwd_ab.py dev/bench_attention.py dev/bench_common.py "$DIR/"
    cp build/test_sage_cuda build/test_attention_determinism_cuda "$DIR/"

    # the reference: REF's attention/ and layers/ only (no -I.), entry points renamed
    git archive "$REF" attention layers | tar -x -C "$B/ref"
    $NVCC -I"$B/ref" $NVFLAGS $RENAME -c -o "$B/ref.o" "$B/ref/attention/sage_backward_sm90.cu"
    cc $CFLAGS -o "$DIR/compare_sage_bwd" dev/compare_sage_bwd.c "$B/ref.o" build/libditc.a $CUDA_LIBS

    # planted bugs: each pattern must occur exactly once (so that the edit is the intended one);
    # the copy of sage_backward_sm90.cu sits next to the edited header's folder, so that
    # "attention/backward_sm90.cuh" is found through -I$B/<bug> before the tree's.
    local H=attention/backward_sm90.cuh
    [ "$(grep -c 'uint32_t off = (base ^ (32 \* (j % 4)))' $H)" = 1 ]
    sed 's/uint32_t off = (base ^ (32 \* (j % 4)))/uint32_t off = (base ^ (16 * (j % 4)))/' $H > "$B/e1/$H"
    [ "$(grep -c 'for (int i = 0; i < KS_ROWS; i++) {' $H)" = 2 ]
    perl -0pe 's/for \(int i = 0; i < KS_ROWS; i\+\+\) \{(\n\s*int r = r0 \+ i \* ROW_STEP;\n\s*if \(k0 \+ r < N\) \{)/for (int i = 0; i < KS_ROWS - 1; i++) {$1/' \
        $H > "$B/e3/$H"
    [ "$(grep -c 'KS_ROWS - 1' "$B/e3/$H")" = 1 ]
    for bug in e1 e3; do
        if cmp -s $H "$B/$bug/$H"; then echo "planted $bug: the edit did not apply" >&2; exit 1; fi
        cp attention/sage_backward_sm90.cu "$B/$bug/attention/sage_backward_sm90_$bug.cu"
        $NVCC -I"$B/$bug" -I. $NVFLAGS -c -o "$B/$bug.o" "$B/$bug/attention/sage_backward_sm90_$bug.cu"
        cc $CFLAGS -o "$DIR/test_sage_cuda_$bug" test/test_sage_cuda.c "$B/$bug.o" build/libditc.a $CUDA_LIBS -lcriterion
        cc $CFLAGS -o "$DIR/compare_sage_bwd_$bug" dev/compare_sage_bwd.c "$B/$bug.o" "$B/ref.o" build/libditc.a $CUDA_LIBS
    done

    # the bench libraries (sm_90a only: the H200 runs no sm_80 code), this tree's and REF's
    local SAGE_CU="sage_quant.cu sage_forward.cu sage_forward_sm90.cu sage_backward.cu sage_backward_sm90.cu"
    gcc -O2 -fPIC -std=c11 -D_GNU_SOURCE -I. -c layers/common.c -o "$B/common_pic.o"
    $NVCC -I. $NVFLAGS -Xcompiler -fPIC -shared -o "$DIR/libsage_bench.so" $(printf 'attention/%s ' $SAGE_CU) "$B/common_pic.o"
    $NVCC -I"$B/ref" $NVFLAGS -Xcompiler -fPIC -shared -o "$DIR/libsage_bench_ref.so" \
        $(printf "$B/ref/attention/%s " $SAGE_CU) "$B/common_pic.o"

    if [ ! -d .devlibs ]; then cp -r "${LIBS:-/work/main/.devlibs}" .devlibs; fi
    du -sh "$DIR" .devlibs
    du -cb "$DIR" .devlibs | tail -1 | awk '{ if ($1 > 64 * 1024 * 1024) { print "carry over 64 MiB"; exit 1 } }'
}

run() {
    local L=${OUT:-step0_logs}
    mkdir -p "$L"
    export LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
    local S="$L/summary.txt"
    { date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; echo "REF $(cat $DIR/ref.txt)"; } \
        > "$L/gpu.txt" 2>&1
    timeout 25 "$DIR/compare_sage_bwd" > "$L/compare.log" 2>&1
    echo "compare (bitwise vs REF) rc=$? (want 0): $(tail -1 "$L/compare.log")" >> "$S"
    for bug in e1 e3; do
        timeout 15 "$DIR/compare_sage_bwd_$bug" > "$L/planted_compare_$bug.log" 2>&1
        echo "planted $bug compare rc=$? (want 1): $(tail -1 "$L/planted_compare_$bug.log")" >> "$S"
    done
    timeout 35 "$DIR/test_sage_cuda" --verbose --jobs 8 --filter 'sage_cuda/sm90_*' > "$L/test_sage_cuda.log" 2>&1
    echo "test_sage_cuda sm90_* rc=$? (want 0): $(grep Synthesis "$L/test_sage_cuda.log")" >> "$S"
    timeout 35 "$DIR/test_attention_determinism_cuda" --verbose --jobs 3 > "$L/test_attention_determinism_cuda.log" 2>&1
    echo "test_attention_determinism_cuda rc=$? (want 0): $(grep Synthesis "$L/test_attention_determinism_cuda.log")" >> "$S"
    for bug in e1 e3; do
        timeout 15 "$DIR/test_sage_cuda_$bug" --verbose --jobs 4 --filter 'sage_cuda/sm90_*backward*' \
            > "$L/planted_test_$bug.log" 2>&1
        echo "planted $bug test_sage_cuda rc=$? (want != 0): $(grep Synthesis "$L/planted_test_$bug.log")" >> "$S"
    done
    timeout 35 python3 "$DIR/bench_sage_bwd_ab.py" "$DIR/libsage_bench.so" "$DIR/libsage_bench_ref.so" > "$L/bench_ab.log" 2>&1
    echo "bench_ab rc=$? (A = this tree, B = REF; B/A > 1: this tree faster)" >> "$S"
    timeout 30 python3 "$DIR/bench_attention.py" "$DIR/libsage_bench.so" 64:1024,128:1024,64:16384,128:16384 \
        > "$L/bench_attention.log" 2>&1
    echo "bench_attention rc=$?" >> "$S"
    local SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    timeout 30 "$SAN" --tool memcheck --error-exitcode 99 "$DIR/test_sage_cuda" \
        --filter 'sage_cuda/sm90_backward_uses_given_delta' -j1 > "$L/memcheck.log" 2>&1
    echo "memcheck sm90_backward_uses_given_delta rc=$? (want 0; 124 = timed out): $(grep 'ERROR SUMMARY' "$L/memcheck.log")" >> "$S"
    cat "$S"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash dev/sage_bwd_step0_gpu.sh prepare|run" >&2; exit 2 ;;
esac
