#!/usr/bin/env bash
# Validation of steps 4 and 5 of dev/notes_bwd_plan.md (attention/backward_sm90.cuh: FA3's GEMM
# order in the consumer warpgroups, the exp2 without masks inside N, the ordered-dQ stage release,
# and 128-query steps at D = 64) in ONE device call. Results must stay bitwise identical to REF
# (default: branch sage-bwd-step23, the GPU-validated kernel of steps 0-3 that main holds) for BOTH
# score sources, sage and bf16 flash.
#   here (nvcc, no GPU):   bash dev/sage_bwd_step4_gpu.sh prepare
#       builds .devrun_step4/ (git-ignored) from this tree: compare_bwd90 (dev/compare_bwd90.c,
#       linked with REF's sage_backward_sm90.cu and flash_backward_sm90.cu built from
#       `git archive REF` with the entry points and the kernel renamed ref_*), the same for the
#       variant nos5 (64-query steps for flash at D = 64 too; call 3 of the notes ran the script
#       when step 5 covered sage D = 64 as well: then nos5 was today's sage) and planted-bug
#       builds (sed-modified copies of backward_sm90.cuh, never committed):
#         noempty   the loader does not wait for the consumers to release a stage   (must FAIL or hang)
#         nods      the consumers skip the named barrier before dQ reads dSᵀ          (must FAIL)
#         nodsfree  sage D = 128 (one dSᵀ buffer) skips the barrier before rewriting it (did not
#                   fail at steps 1-4: the race does not fire, see the notes)
#         norelease the consumers never release a stage: the loader waits forever  (must time out, rc 124)
#         s5row     the dQ writer adds both 64-query blocks of a 128-query step at the first
#                   block's rows                                                   (must FAIL)
#         nodqwait  (compiled only) the dQ tile is stored without waiting for the dQ product
#                   (wait<1> -> wait<2>): ptxas must report C7514 (it then serializes the wgmma,
#                   so the results stay right): shows that the C7513-5 check below catches it
#       test_flash_cuda, test_sage_cuda, test_attention_determinism_cuda, and the bench libraries
#       (sm_90a only; sage and flash sources) of this tree (step5), nos5, REF (step23) and REF0
#       (default ddd1910: main before steps 0-3) for dev/bench_bwd90_abc.py at N = 4K and 16K,
#       REPS = 5. A C7513/C7514/C7515 warning (wgmma serialized) in the build of this tree or of
#       nos5 stops the preparation. LIBS (default /work/main/.devlibs): Criterion's runtime
#       libraries, copied to .devlibs/ if this tree has none.
#   device call (run tool; its repository root is /work/main, so first
#       `rm -rf /work/main/.devrun_step4 && cp -r .devrun_step4 /work/main/`):
#       run(command="bash .devrun_step4/sage_bwd_step4_gpu.sh run", carry=[".devrun_step4", ".devlibs"], timeout_s=170)
#       logs to $OUT: gpu.txt, compare*.log (must PASS 40/40), planted_*.log, test_*.log,
#       synccheck.log, racecheck*.log, bench_abc.log; summary.txt.
#   profile (call 2 of the notes): one sage backward at D = 128, N = 16K of a library, for Nsight
#       Compute: ncu -k regex:attention_backward_sm90 -c 1 --section SpeedOfLight ... \
#           bash .devrun_step4/sage_bwd_step4_gpu.sh profile .devrun_step4/lib_step5.so
# Every step has its own timeout and the whole run stops starting steps at 140 s, so that a
# deadlock ends in a timeout with the logs; the steps run in order of importance. (Calls 1 and 2 of
# the notes ran earlier versions of this script: git log.)
set -uo pipefail
DIR=.devrun_step4

prepare() {
    set -e
    local REF=${REF:-sage-bwd-step23} REF0=${REF0:-ddd1910}
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
    local B=build/step4 H=attention/backward_sm90.cuh
    rm -rf "$DIR" "$B" && mkdir -p "$DIR" "$B/ref" "$B/ref0"
    { echo "REF $REF $(git rev-parse "$REF")"; echo "REF0 $REF0 $(git rev-parse "$REF0")"; echo "HEAD $(git rev-parse HEAD)";
      git diff --quiet HEAD -- attention || echo "(attention/ has uncommitted changes)"; } > "$DIR/refs.txt"
    cp dev/sage_bwd_step4_gpu.sh dev/bench_common.py "$DIR/"
    # the bench at N = 4K and 16K only (this call's device time is small)
    perl -pe 's/for N in \(4096, 16384, 32768\)/for N in (4096, 16384)/; s/^REPS = 3$/REPS = 5/' dev/bench_bwd90_abc.py > "$DIR/bench_bwd90_abc.py"
    if cmp -s dev/bench_bwd90_abc.py "$DIR/bench_bwd90_abc.py"; then echo "bench sizes: the edit did not apply" >&2; exit 1; fi
    cp build/test_flash_cuda build/test_sage_cuda build/test_attention_determinism_cuda "$DIR/"

    # the reference: REF's attention/ and layers/ only (no -I.), entry points and kernel renamed
    git archive "$REF" attention layers | tar -x -C "$B/ref"
    git archive "$REF0" attention layers | tar -x -C "$B/ref0"
    for f in sage flash; do
        $NVCC -I"$B/ref" $NVFLAGS $RENAME -c -o "$B/ref_$f.o" "$B/ref/attention/${f}_backward_sm90.cu"
    done
    cc $CFLAGS -o "$DIR/compare_bwd90" dev/compare_bwd90.c "$B/ref_sage.o" "$B/ref_flash.o" build/libditc.a $CUDA_LIBS

    # planted bugs and the variant: each pattern must occur exactly once; the copies of the two .cu
    # files sit next to the edited header's folder, so "attention/backward_sm90.cuh" is found in
    # -I$B/<name> first; ptxas' messages go to $B/<name>_<sage|flash>.ptxas
    plant() {   # plant <name> <perl substitution or ''> <pattern that must occur exactly once> [nvcc flags [nolink]]
        mkdir -p "$B/$1/attention"
        if [ -n "$2" ]; then
            [ "$(grep -cF -- "$3" $H)" = 1 ] || { echo "planted $1: pattern count $(grep -cF -- "$3" $H)" >&2; exit 1; }
            perl -pe "$2" $H > "$B/$1/$H"
            if cmp -s $H "$B/$1/$H"; then echo "planted $1: the edit did not apply" >&2; exit 1; fi
        else
            cp $H "$B/$1/$H"
        fi
        for f in sage flash; do
            cp attention/${f}_backward_sm90.cu "$B/$1/attention/${f}_backward_sm90_$1.cu"
            $NVCC -I"$B/$1" -I. $NVFLAGS ${4:-} -c -o "$B/$1_$f.o" "$B/$1/attention/${f}_backward_sm90_$1.cu" \
                > "$B/$1_$f.ptxas" 2>&1 || { cat "$B/$1_$f.ptxas" >&2; exit 1; }
        done
        [ -n "${5:-}" ] && return
        cc $CFLAGS -o "$DIR/compare_bwd90_$1" dev/compare_bwd90.c "$B/$1_sage.o" "$B/$1_flash.o" \
            "$B/ref_sage.o" "$B/ref_flash.o" build/libditc.a $CUDA_LIBS
    }
    local FULL='if (k0 + BWD90_KEYS <= N && q0 + BWD90_QUERIES <= N) exp2_scores<SAGE, false>(p, s_acc, scale, c_log2, s_lse, c, q0, N, key_valid);\n        else '
    plant nos5 's/QS = D == 64 && SCORES == SCORES_BF16 \? 2 \* BWD90_QUERIES : BWD90_QUERIES/QS = BWD90_QUERIES/' \
        'QS = D == 64 && SCORES == SCORES_BF16 ? 2 * BWD90_QUERIES : BWD90_QUERIES'
    plant noempty 's/if \(qs >= 2\) mbar_wait\(&bar->empty\[stage\]/if (0) mbar_wait(&bar->empty[stage]/' \
        'if (qs >= 2) mbar_wait(&bar->empty[stage]'
    plant nods 's/^(\s*)named_barrier_sync\(BWD90_BAR_DS, BWD90_THREADS\);/$1;/' \
        'named_barrier_sync(BWD90_BAR_DS, BWD90_THREADS);'
    plant nodsfree 's/if \(S::DS_BUFS == 1 && qs > 0\) named_barrier_sync/if (0) named_barrier_sync/' \
        'if (S::DS_BUFS == 1 && qs > 0) named_barrier_sync'
    plant norelease 's/^(\s*)mbar_arrive\(empty\);/$1;/' 'mbar_arrive(empty);'
    plant s5row 's/block \* BWD90_QUERIES, bh\);/H * qs * BWD90_QUERIES, bh);/' 'block * BWD90_QUERIES, bh);'
    plant nodqwait 's/wgmma_wait<1>\(\);   \/\/ dQ done, dK may still run/wgmma_wait<2>();/' \
        'wgmma_wait<1>();   // dQ done, dK may still run' '' nolink
    grep -h C7514 "$B"/nodqwait_*.ptxas > "$DIR/planted_ptxas.txt" || { echo "planted nodqwait: no C7514" >&2; exit 1; }

    # the bench libraries (sm_90a only: the H200 runs no sm_80 code): this tree, the variant, REF, REF0
    local CU="sage_quant.cu sage_forward.cu sage_forward_sm90.cu sage_backward.cu sage_backward_sm90.cu
              flash_forward.cu flash_forward_sm90.cu flash_backward.cu flash_backward_sm90.cu"
    gcc -O2 -fPIC -std=c11 -D_GNU_SOURCE -I. -c layers/common.c -o "$B/common_pic.o"
    # REF and REF0 in the background (the two cores), this tree's sources but the two backward
    # files once for the two builds, which differ only in backward_sm90.cuh
    for r in ref ref0; do
        $NVCC -I"$B/$r" $NVFLAGS -Xcompiler -fPIC -shared -o "$DIR/lib_$r.so" $(printf "$B/$r/attention/%s " $CU) "$B/common_pic.o" &
    done
    mkdir -p "$B/pic"
    local f v flags
    for f in $CU; do
        case $f in sage_backward_sm90.cu|flash_backward_sm90.cu) continue ;; esac
        $NVCC -I. $NVFLAGS -Xcompiler -fPIC -c -o "$B/pic/${f%.cu}.o" attention/$f
    done
    for v in step5 nos5; do   # -I$B/<variant> first: its header copy
        $NVCC -I"$B/$v" -I. $NVFLAGS -Xcompiler -fPIC -shared -o "$DIR/lib_$v.so" attention/sage_backward_sm90.cu \
            attention/flash_backward_sm90.cu "$B"/pic/*.o "$B/common_pic.o" > "$B/lib_$v.ptxas" 2>&1 ||
            { cat "$B/lib_$v.ptxas" >&2; exit 1; }
    done
    wait
    for r in ref ref0; do [ -f "$DIR/lib_$r.so" ] || { echo "lib_$r.so was not built" >&2; exit 1; }; done
    if grep -h -E 'C751[345]' "$B"/lib_*.ptxas "$B"/nos5_*.ptxas; then
        echo "wgmma serialization warnings (above)" >&2
        exit 1
    fi
    strip "$DIR"/compare_bwd90* "$DIR"/test_* "$DIR"/*.so

    if [ ! -d .devlibs ] && [ "$PWD" != /work/main ]; then cp -r "${LIBS:-/work/main/.devlibs}" .devlibs; fi
    du -sh "$DIR" .devlibs
    du -cb "$DIR" .devlibs | tail -1 | awk '{ if ($1 > 64 * 1024 * 1024) { print "carry over 64 MiB"; exit 1 } }'
}

run() {
    local L=${OUT:-step4_logs} T0=$SECONDS
    mkdir -p "$L"
    export LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
    local S="$L/summary.txt"
    { date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; cat $DIR/refs.txt;
      echo "planted nodqwait, ptxas:"; cat $DIR/planted_ptxas.txt; } > "$L/gpu.txt" 2>&1
    # step <name> <timeout s> <command...>: runs unless the call's 140 s are spent; logs rc
    step() {
        local name=$1 limit=$2 left=$((140 - (SECONDS - T0)))
        shift 2
        if [ $left -lt 10 ]; then echo "$name: SKIPPED (no time left)" >> "$S"; return; fi
        [ $limit -gt $left ] && limit=$left
        local t=$SECONDS
        timeout -k 5 $limit "$@" > "$L/$name.log" 2>&1
        local rc=$?
        echo "$name rc=$rc ($((SECONDS - t)) s): $(grep -E 'Synthesis|PASS|FAIL:|ERROR SUMMARY' "$L/$name.log" | tail -1)" >> "$S"
    }
    step compare 25 "$DIR/compare_bwd90" both                         # want rc 0, PASS 40/40
    step compare_nos5 25 "$DIR/compare_bwd90_nos5" both               # the fallback: want rc 0, PASS 40/40
    step planted_noempty 8 "$DIR/compare_bwd90_noempty" flash first    # want rc 1 (FAIL) or 124
    step planted_nods 10 "$DIR/compare_bwd90_nods" flash first          # want rc 1
    step planted_nodsfree 10 "$DIR/compare_bwd90_nodsfree" sage first   # rc 1 would show the race; rc 0 as at steps 1-4
    step planted_norelease 8 "$DIR/compare_bwd90_norelease" flash first # want rc 124 (hang)
    step planted_s5row 10 "$DIR/compare_bwd90_s5row" flash first        # want rc 1
    step test_flash_cuda 25 "$DIR/test_flash_cuda" --verbose --jobs 2 --filter 'flash_cuda/sm90_*'
    step test_sage_cuda 25 "$DIR/test_sage_cuda" --verbose --jobs 8 --filter 'sage_cuda/sm90_*'
    step test_attention_determinism_cuda 25 "$DIR/test_attention_determinism_cuda" --verbose --jobs 3
    local SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    step synccheck 20 "$SAN" --tool synccheck --error-exitcode 99 "$DIR/compare_bwd90" both small
    step racecheck 25 "$SAN" --tool racecheck --error-exitcode 99 "$DIR/compare_bwd90" both small
    step racecheck_nos5 25 "$SAN" --tool racecheck --error-exitcode 99 "$DIR/compare_bwd90_nos5" both small
    step bench_abc 60 python3 "$DIR/bench_bwd90_abc.py" step5="$DIR/lib_step5.so" nos5="$DIR/lib_nos5.so" \
        step23="$DIR/lib_ref.so" pre0="$DIR/lib_ref0.so"
    echo "total $((SECONDS - T0)) s" >> "$S"
    cat "$S"
}

# One sage forward + backward (D = 128, N = 16K, B = 1, H = 16) of the library $1, for ncu.
profile_one() {
    python3 - "$1" <<'PY'
import ctypes, sys, torch
sys.path.insert(0, ".devrun_step4")
from bench_bwd90_abc import load
from bench_common import check, err
lib = load(sys.argv[1])
B, H, N, D = 1, 16, 16384, 128
q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
out = torch.empty_like(q)
lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
ws = torch.empty(lib.sage_cuda_forward_workspace_size(B, H, N, D, 0), device="cuda", dtype=torch.uint8)
bws = torch.empty(lib.sage_cuda_backward_workspace_size(B, H, N, D), device="cuda", dtype=torch.uint8)
dq, dk, dv = (torch.empty(B, H, N, D, device="cuda", dtype=torch.float32) for _ in range(3))
s = torch.cuda.current_stream().cuda_stream
check(lib.sage_forward_cuda(out.data_ptr(), lse.data_ptr(), ws.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                            B, H, N, D, 0, s, err), "forward")
check(lib.sage_backward_sm90_cuda(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), bws.data_ptr(), ws.data_ptr(),
                                  do.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                  lse.data_ptr(), None, B, H, N, D, 0, s, err), "backward")
torch.cuda.synchronize()
print("ok")
PY
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    profile) profile_one "$2" ;;
    *) echo "usage: bash dev/sage_bwd_step4_gpu.sh prepare|run|profile <lib>" >&2; exit 2 ;;
esac
