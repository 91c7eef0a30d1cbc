#!/usr/bin/env bash
# Validation of steps 1-3 of dev/notes_bwd_plan.md (attention/backward_sm90.cuh: the dQ tile freed
# on cp.async.bulk.wait_group.read; a producer warpgroup with the loader and the dQ writer, two
# consumer warpgroups with one named barrier per step, two dSᵀ buffers except sage D = 128) in ONE
# device call. Results must stay bitwise identical to REF (default: the merge-base of main and HEAD,
# main's GPU-validated kernel) for BOTH score sources, sage and bf16 flash.
#   here (nvcc, no GPU):   bash dev/sage_bwd_step23_gpu.sh prepare
#       builds .devrun_step23/ (git-ignored) from this tree: compare_bwd90 (dev/compare_bwd90.c,
#       linked with REF's sage_backward_sm90.cu and flash_backward_sm90.cu built from
#       `git archive REF` with the entry points and the kernel renamed ref_*), planted-bug builds of
#       it (sed-modified copies of backward_sm90.cuh, never committed):
#         noempty  the loader does not wait for the consumers to release a stage    (must FAIL or hang)
#         nods     the consumers skip the named barrier before dQ reads dSᵀ           (must FAIL)
#         nodsfree sage D = 128 (one dSᵀ buffer) skips the barrier before rewriting it (must FAIL)
#         norelease the consumers never release a stage: the loader waits forever   (must time out, rc 124)
#       test_flash_cuda, test_sage_cuda, test_attention_determinism_cuda, and the bench libraries
#       (sm_90a only; sage and flash sources) of this tree, REF and REF0 (default: branch
#       sage-bwd-step0) for dev/bench_bwd90_abc.py. LIBS (default /work/main/.devlibs): Criterion's
#       runtime libraries, copied to .devlibs/ if this tree has none.
#   device call (run tool; its repository root is /work/main, so first
#       `rm -rf /work/main/.devrun_step23 && cp -r .devrun_step23 /work/main/`):
#       run(command="bash .devrun_step23/sage_bwd_step23_gpu.sh run", carry=[".devrun_step23", ".devlibs"], timeout_s=290)
#       logs to $OUT: gpu.txt, compare.log (must PASS 32/32), planted_*.log, test_*.log,
#       synccheck.log, racecheck.log, bench_abc.log; summary.txt.
# Every step has its own timeout and the whole run stops starting steps at 270 s, so that a
# deadlock ends in a timeout with the logs; the steps run in order of importance.
set -uo pipefail
DIR=.devrun_step23

prepare() {
    set -e
    local REF=${REF:-$(git merge-base main HEAD)} REF0=${REF0:-sage-bwd-step0}
    make -j2 build/test_flash_cuda build/test_sage_cuda build/test_attention_determinism_cuda build/libditc.a
    local NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
    local NVFLAGS="-O3 -std=c++17 --use_fast_math -Xcompiler -Wall -gencode=arch=compute_90a,code=sm_90a"
    local CUDA_LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++"
    [ -f /usr/local/cuda/include/nccl.h ] && CUDA_LIBS="$CUDA_LIBS -lnccl"
    local CFLAGS="-O3 -std=c11 -Wall -Wextra -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include"
    local RENAME="-Dattention_backward_sm90_kernel=ref_attention_backward_sm90_kernel
                  -Dsage_backward_sm90_cuda=ref_sage_backward_sm90_cuda
                  -Dsage_backward_sm90_available=ref_sage_backward_sm90_available
                  -Dflash_backward_sm90_cuda=ref_flash_backward_sm90_cuda
                  -Dflash_backward_sm90_available=ref_flash_backward_sm90_available"
    local B=build/step23 H=attention/backward_sm90.cuh
    rm -rf "$DIR" "$B" && mkdir -p "$DIR" "$B/ref" "$B/ref0"
    { echo "REF $REF $(git rev-parse "$REF")"; echo "REF0 $REF0 $(git rev-parse "$REF0")"; echo "HEAD $(git rev-parse HEAD)"; } > "$DIR/refs.txt"
    cp dev/sage_bwd_step23_gpu.sh dev/bench_bwd90_abc.py dev/bench_common.py "$DIR/"
    cp build/test_flash_cuda build/test_sage_cuda build/test_attention_determinism_cuda "$DIR/"

    # the reference: REF's attention/ and layers/ only (no -I.), entry points and kernel renamed
    git archive "$REF" attention layers | tar -x -C "$B/ref"
    git archive "$REF0" attention layers | tar -x -C "$B/ref0"
    for f in sage flash; do
        $NVCC -I"$B/ref" $NVFLAGS $RENAME -c -o "$B/ref_$f.o" "$B/ref/attention/${f}_backward_sm90.cu"
    done
    cc $CFLAGS -o "$DIR/compare_bwd90" dev/compare_bwd90.c "$B/ref_sage.o" "$B/ref_flash.o" build/libditc.a $CUDA_LIBS

    # planted bugs: each pattern must occur exactly once; the copies of the two .cu files sit next
    # to the edited header's folder, so "attention/backward_sm90.cuh" is found in -I$B/<bug> first
    plant() {   # plant <bug> <perl substitution> <pattern that must occur exactly once>
        mkdir -p "$B/$1/attention"
        [ "$(grep -cF -- "$3" $H)" = 1 ] || { echo "planted $1: pattern count $(grep -cF -- "$3" $H)" >&2; exit 1; }
        perl -pe "$2" $H > "$B/$1/$H"
        if cmp -s $H "$B/$1/$H"; then echo "planted $1: the edit did not apply" >&2; exit 1; fi
        for f in sage flash; do
            cp attention/${f}_backward_sm90.cu "$B/$1/attention/${f}_backward_sm90_$1.cu"
            $NVCC -I"$B/$1" -I. $NVFLAGS -c -o "$B/$1_$f.o" "$B/$1/attention/${f}_backward_sm90_$1.cu"
        done
        cc $CFLAGS -o "$DIR/compare_bwd90_$1" dev/compare_bwd90.c "$B/$1_sage.o" "$B/$1_flash.o" \
            "$B/ref_sage.o" "$B/ref_flash.o" build/libditc.a $CUDA_LIBS
    }
    plant noempty 's/if \(qb >= 2\) mbar_wait\(&bar->empty\[stage\]/if (0) mbar_wait(&bar->empty[stage]/' \
        'if (qb >= 2) mbar_wait(&bar->empty[stage]'
    plant nods 's/^(\s*)named_barrier_sync\(BWD90_BAR_DS, BWD90_THREADS\);/$1;/' \
        'named_barrier_sync(BWD90_BAR_DS, BWD90_THREADS);'
    plant nodsfree 's/if \(S::DS_BUFS == 1 && qb > 0\) named_barrier_sync/if (0) named_barrier_sync/' \
        'if (S::DS_BUFS == 1 && qb > 0) named_barrier_sync'
    plant norelease 's/^(\s*)mbar_arrive\(&bar.empty\[stage\]\);/$1;/' \
        'mbar_arrive(&bar.empty[stage]);'

    # the bench libraries (sm_90a only: the H200 runs no sm_80 code): this tree, REF, REF0
    local CU="sage_quant.cu sage_forward.cu sage_forward_sm90.cu sage_backward.cu sage_backward_sm90.cu
              flash_forward.cu flash_forward_sm90.cu flash_backward.cu flash_backward_sm90.cu"
    gcc -O2 -fPIC -std=c11 -D_GNU_SOURCE -I. -c layers/common.c -o "$B/common_pic.o"
    $NVCC -I. $NVFLAGS -Xcompiler -fPIC -shared -o "$DIR/lib_step23.so" $(printf 'attention/%s ' $CU) "$B/common_pic.o"
    for r in ref ref0; do
        $NVCC -I"$B/$r" $NVFLAGS -Xcompiler -fPIC -shared -o "$DIR/lib_$r.so" $(printf "$B/$r/attention/%s " $CU) "$B/common_pic.o"
    done
    strip "$DIR"/compare_bwd90* "$DIR"/test_* "$DIR"/*.so

    if [ ! -d .devlibs ] && [ "$PWD" != /work/main ]; then cp -r "${LIBS:-/work/main/.devlibs}" .devlibs; fi
    du -sh "$DIR" .devlibs
    du -cb "$DIR" .devlibs | tail -1 | awk '{ if ($1 > 64 * 1024 * 1024) { print "carry over 64 MiB"; exit 1 } }'
}

run() {
    local L=${OUT:-step23_logs} T0=$SECONDS
    mkdir -p "$L"
    export LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
    local S="$L/summary.txt"
    { date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; cat $DIR/refs.txt; } > "$L/gpu.txt" 2>&1
    # step <name> <timeout s> <command...>: runs unless the call's 270 s are spent; logs rc
    step() {
        local name=$1 limit=$2 left=$((270 - (SECONDS - T0)))
        shift 2
        if [ $left -lt 10 ]; then echo "$name: SKIPPED (no time left)" >> "$S"; return; fi
        [ $limit -gt $left ] && limit=$left
        local t=$SECONDS
        timeout -k 5 $limit "$@" > "$L/$name.log" 2>&1
        local rc=$?
        echo "$name rc=$rc ($((SECONDS - t)) s): $(grep -E 'Synthesis|PASS|FAIL:|ERROR SUMMARY' "$L/$name.log" | tail -1)" >> "$S"
    }
    step compare 60 "$DIR/compare_bwd90" both                       # want rc 0, PASS 32/32
    step planted_noempty 15 "$DIR/compare_bwd90_noempty" flash first  # want rc 1 (FAIL) or 124
    step planted_nods 15 "$DIR/compare_bwd90_nods" flash first        # want rc 1
    step planted_nodsfree 15 "$DIR/compare_bwd90_nodsfree" sage first  # want rc 1 (only sage D = 128 differs)
    step planted_norelease 12 "$DIR/compare_bwd90_norelease" flash first  # want rc 124 (hang)
    step test_flash_cuda 45 "$DIR/test_flash_cuda" --verbose --jobs 2 --filter 'flash_cuda/sm90_*'
    step test_sage_cuda 45 "$DIR/test_sage_cuda" --verbose --jobs 8 --filter 'sage_cuda/sm90_*'
    step test_attention_determinism_cuda 45 "$DIR/test_attention_determinism_cuda" --verbose --jobs 3
    local SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    step synccheck 30 "$SAN" --tool synccheck --error-exitcode 99 "$DIR/compare_bwd90" both small
    step racecheck 40 "$SAN" --tool racecheck --error-exitcode 99 "$DIR/compare_bwd90" both small
    # racecheck must see the class of bug it is here for: the loader not waiting for the release
    step racecheck_noempty 30 "$SAN" --tool racecheck --error-exitcode 99 "$DIR/compare_bwd90_noempty" flash small  # want rc 99
    step bench_abc 60 python3 "$DIR/bench_bwd90_abc.py" step23="$DIR/lib_step23.so" main="$DIR/lib_ref.so" step0="$DIR/lib_ref0.so"
    echo "total $((SECONDS - T0)) s" >> "$S"
    cat "$S"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash dev/sage_bwd_step23_gpu.sh prepare|run" >&2; exit 2 ;;
esac
