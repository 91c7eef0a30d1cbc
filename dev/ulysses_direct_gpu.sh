#!/usr/bin/env bash
# Validation of the direct Ulysses all-to-all (no pack/unpack copies; issue 6) on 2 GPUs: the
# all-to-all and Ulysses tests of this branch, checkpoints bit for bit against main's build, the
# step time at 30,976 (and 16,384) tokens against main's, and planted bugs that must fail.
#
#   bash dev/ulysses_direct_gpu.sh prepare       here (no GPU): fills $DEV (default
#                                                 /work/main/.devrun_a2a), self-contained
#   bash .devrun_a2a/ulysses_direct_gpu.sh run    on nvidia-h200-x2 from the tree root, carry
#                                                 [".devrun_a2a", ".devlibs"]; logs to $OUT
#
# prepare: main's train_dit (the /work/main build, must be current) as train_dit_main; this
# branch's attention/ulysses_nccl.cu compiled with the Makefile's nvcc flags into a copy of main's
# build/libditc.a in place of main's ulysses_nccl.o (every other library source must be main's:
# checked), linked into train_dit, test_sequence_parallel_cuda and test_sp_model_cuda. Variants
# of ulysses_nccl.cu patched here (each patch must apply exactly once), never in the source:
#   selfnccl  the rank's own runs by ncclSend/ncclRecv to itself inside the group, no copy
#             (measured against the cudaMemcpy2DAsync on comm_stream of the branch)
#   bugA      the forward's received run of head h' placed at head (h'+1) mod H/R
#   bugB      the own runs' copy not ordered after stream (fork wait removed)
#   bugC      stream not ordered after the own runs' copy (join wait removed)
# and train_dit_commstream: the branch with model/dit_gpu.cu patched to create its comm_stream
# for Ulysses too (today only for the ring: under Ulysses alone comm_stream is the legacy
# default stream, which serializes with the blocking model stream, so the own runs' copy cannot
# overlap the exchange); the proposed one-line change to dit_gpu.cu, measured.
set -uo pipefail
MODE=${1:-}
DEV=${DEV:-/work/main/.devrun_a2a}
MAIN=${MAIN:-/work/main}

# patch NAME SRC DST: DST = SRC with the variant NAME's edits, each applied exactly once.
patch_variant() {
    python3 - "$1" "$2" "$3" <<'PY'
import sys
name, src, dst = sys.argv[1:]
s = open(src).read()
edits = {
    "selfnccl": [("            if (p == c->rank[i]) continue;\n", ""),
                 ("        if (copy_own_runs(c, i, dst[i], src[i], B, H, hs, run, inverse, c->comm_stream[i], err) != 0) return -1;\n", ""),
                 ("A2A_GROUP_OPS / (2 * (R - 1) * c->n_local)", "A2A_GROUP_OPS / (2 * R * c->n_local)"),
                 ("    if (R > 1) {\n", "    {\n")],
    "bugA": [(": head_offset(b, p, h, hs, R, run);", ": head_offset(b, p, (h + 1) % hs, hs, R, run);")],
    "bugB": [("        SP_CUDA_CHECK(cudaStreamWaitEvent(c->comm_stream[i], ready, 0), err,\n"
              "                      \"%s: cudaStreamWaitEvent(comm_stream, ready) on rank %d\", fn, c->rank[i]);\n", "")],
    "commstream": [("    if (sp->ring > 1 && cudaStreamCreateWithFlags(&m->comm_stream",
                    "    if ((sp->ring > 1 || sp->ulysses > 1) && cudaStreamCreateWithFlags(&m->comm_stream")],
    "bugC": [("        SP_CUDA_CHECK(cudaStreamWaitEvent(c->stream[i], joined[i], 0), err,\n"
              "                      \"%s: cudaStreamWaitEvent(stream, joined) on rank %d\", fn, c->rank[i]);\n", "")],
}[name]
for old, new in edits:
    n = s.count(old)
    if n != 1: sys.exit(f"patch {name}: {old[:60]!r} found {n} times, expected 1")
    s = s.replace(old, new)
if name == "selfnccl":
    s = s.replace("static int copy_own_runs(", "__attribute__((unused)) static int copy_own_runs(", 1)
open(dst, "w").write(s)
PY
}

prepare() {
    set -e
    local here; here=$(cd "$(dirname "$0")/.." && pwd)
    cd "$here"
    local changed
    changed=$(git diff --name-only "$(git -C "$MAIN" rev-parse HEAD)" HEAD -- attention layers model dataloader \
              | grep -v -E '^attention/(ulysses_nccl\.cu|sequence_parallel_cuda\.h)$' || true)
    # (the header's change is comments only: main's other objects are this branch's)
    [ -z "$changed" ] || { echo "prepare: library sources differ from main's: $changed"; exit 1; }
    [ -z "$(git status --porcelain -- attention)" ] || { echo "prepare: commit attention/ first"; exit 1; }
    [ -z "$(git -C "$MAIN" status --porcelain -- attention layers model dataloader train_dit.c)" ] ||
        { echo "prepare: $MAIN has uncommitted library changes; its build is not main's"; exit 1; }
    for f in "$MAIN"/attention/* "$MAIN"/layers/* "$MAIN"/model/* "$MAIN"/train_dit.c; do
        [ "$MAIN/build/libditc.a" -nt "$f" ] || { echo "prepare: $MAIN/build/libditc.a is older than $f"; exit 1; }
    done
    [ "$MAIN/train_dit" -nt "$MAIN/build/libditc.a" ] || { echo "prepare: $MAIN/train_dit is stale"; exit 1; }
    local tmp; tmp=$(mktemp -d)
    local CUDA=/usr/local/cuda
    local NV="$CUDA/bin/nvcc -O3 -std=c++17 -I. --use_fast_math -Xcompiler -Wall -DDIT_NCCL
              -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local F="-O3 -g -std=c11 -Wall -Wextra -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -DDIT_NCCL -I$CUDA/include"
    local L="-lm -lpthread -L$CUDA/lib64 -Wl,-rpath,$CUDA/lib64 -lcublasLt -lcublas -lcudart -lstdc++ -lnccl"
    rm -rf "$DEV" && mkdir -p "$DEV"
    for v in branch selfnccl bugA bugB bugC; do
        mkdir -p "$tmp/$v"
        if [ $v = branch ]; then cp attention/ulysses_nccl.cu "$tmp/$v/ulysses_nccl.cu"
        else patch_variant $v attention/ulysses_nccl.cu "$tmp/$v/ulysses_nccl.cu"; fi
        $NV -c -o "$tmp/$v/ulysses_nccl.o" "$tmp/$v/ulysses_nccl.cu"
        cp "$MAIN/build/libditc.a" "$tmp/$v/libditc.a"
        ar r "$tmp/$v/libditc.a" "$tmp/$v/ulysses_nccl.o"
    done
    gcc $F -o "$DEV/train_dit" train_dit.c "$tmp/branch/libditc.a" $L
    gcc $F -o "$DEV/train_dit_selfnccl" train_dit.c "$tmp/selfnccl/libditc.a" $L
    gcc $F -o "$DEV/train_dit_bugA" train_dit.c "$tmp/bugA/libditc.a" $L
    patch_variant commstream model/dit_gpu.cu "$tmp/dit_gpu.cu"
    $NV -c -o "$tmp/dit_gpu.o" "$tmp/dit_gpu.cu"
    cp "$tmp/branch/libditc.a" "$tmp/commstream.a"
    ar r "$tmp/commstream.a" "$tmp/dit_gpu.o"
    gcc $F -o "$DEV/train_dit_commstream" train_dit.c "$tmp/commstream.a" $L
    gcc $F -o "$DEV/test_sequence_parallel_cuda" test/test_sequence_parallel_cuda.c "$tmp/branch/libditc.a" $L -lcriterion
    gcc $F -o "$DEV/test_sp_model_cuda" test/test_sp_model_cuda.c "$tmp/branch/libditc.a" $L -lcriterion
    for v in bugA bugB bugC; do
        gcc $F -o "$DEV/test_sequence_parallel_cuda_$v" test/test_sequence_parallel_cuda.c "$tmp/$v/libditc.a" $L -lcriterion
    done
    cp "$MAIN/train_dit" "$DEV/train_dit_main"
    strip "$DEV"/train_dit* "$DEV"/test_*
    cp dev/ulysses_direct_gpu.sh "$DEV/"
    rm -rf "$tmp"
    du -sh "$DEV" "$MAIN/.devlibs"
    echo "carry: [\"$(basename "$DEV")\", \".devlibs\"] (run from $MAIN): bash $(basename "$DEV")/ulysses_direct_gpu.sh run"
}

run() {
    local B; B=$(dirname "$0")
    local T0; T0=$(date +%s)
    local DEADLINE=$(( T0 + ${BUDGET_S:-140} ))
    : "${OUT:?OUT must be set (the device tool sets it)}"
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=WARN
    local N; N=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
    export LD_LIBRARY_PATH=$PWD/.devlibs:${N:+$N:}${LD_LIBRARY_PATH:-}
    local W=/tmp/a2a_logs; rm -rf $W; mkdir -p $W
    { nvidia-smi -L; date -u; ldd $B/train_dit | grep -E 'nccl|not found'; } > $W/env.txt 2>&1
    left() { echo $(( DEADLINE - $(date +%s) )); }
    # step NAME MIN_S MAX_S CMD...: runs CMD under timeout min(MAX_S, time left), skipped when
    # less than MIN_S is left; the exit status goes to $W/status.txt
    step() {
        local name=$1 min=$2 max=$3 l; l=$(left); shift 3
        if [ $l -lt $min ]; then echo "$name: SKIPPED (deadline, ${l} s left)" >> $W/status.txt; return 1; fi
        [ $l -gt $max ] && l=$max
        local t=$(date +%s)
        timeout $l "$@" > $W/$name.log 2>&1
        local rc=$?
        echo "$name: rc $rc, $(( $(date +%s) - t )) s" >> $W/status.txt
        return $rc
    }
    local TIMING="--device gpu --data synthetic --model S --hidden 2048 --heads 16 --depth 4 --batch 1 --attn sage --ckpt-every 0 --sample-every 0 --seed 1 --steps 10 --gpus 2 --sp-ulysses 2"
    local BIT="--device gpu --data synthetic --model S --batch 8 --attn sage --steps 6 --ckpt-every 6 --sample-every 0 --seed 3 --gpus 2 --sp-ulysses 2"
    timed() {   # name binary image-size
        step $1 15 30 $B/$2 $TIMING --image-size $3 --out $W/$1
    }
    median() {  # median of the ms column of steps 4..10
        [ -f $W/$1/train_log.csv ] || { echo "n/a"; return; }
        awk -F, 'NR > 1 && $1 >= 4 && $1 <= 10 { print $5 }' $W/$1/train_log.csv | sort -g |
            awk '{ a[NR] = $1 } END { if (NR == 0) print "n/a"; else if (NR % 2) print a[(NR + 1) / 2]; else printf "%.3f\n", (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
    }
    bitwise() {  # compares checkpoints and logged loss/grad norm of bit_main and bit_$1
        if [ ! -f $W/bit_main/train_log.csv ] || [ ! -f $W/bit_$1/train_log.csv ]; then
            echo "bitwise $1: a run FAILED"; return
        fi
        local f n=0
        for f in $(ls $W/bit_main | grep '^ckpt_'); do
            n=$((n + 1))
            if cmp -s $W/bit_main/$f $W/bit_$1/$f; then echo "bitwise $1: $f EQUAL"
            else echo "bitwise $1: $f DIFFERENT ($(cmp -l $W/bit_main/$f $W/bit_$1/$f 2>/dev/null | wc -l) bytes)"; fi
        done
        [ $n -gt 0 ] || echo "bitwise $1: no checkpoint written"
        diff -q <(cut -d, -f1-3 $W/bit_main/train_log.csv) <(cut -d, -f1-3 $W/bit_$1/train_log.csv) > /dev/null \
            && echo "bitwise $1: train_log step,loss,grad_norm identical" || echo "bitwise $1: train_log DIFFERS"
    }
    # 1. this branch's tests: the all-to-all, Ulysses and shape tests, the Ulysses model tests
    step tests_sp 20 45 $B/test_sequence_parallel_cuda --jobs 1 --verbose \
        --filter 'sequence_parallel_cuda/@(all_to_all*|ulysses*|shape*)'
    step tests_sp_model 25 50 $B/test_sp_model_cuda --jobs 1 --verbose --filter 'sp_model/ulysses2*'
    # 2. bit for bit: main's and this branch's 6 steps
    step bit_main_run 15 30 $B/train_dit_main $BIT --out $W/bit_main
    step bit_branch_run 15 30 $B/train_dit $BIT --out $W/bit_branch
    bitwise branch > $W/bitwise.txt
    # 3. planted bugs: each must FAIL
    for v in bugA bugB bugC; do
        step planted_$v 8 20 $B/test_sequence_parallel_cuda_$v --jobs 1 --verbose --filter 'sequence_parallel_cuda/all_to_all*'
    done
    # 4. step time at 30,976 tokens, interleaved: main, branch, branch + Ulysses comm_stream,
    #    own runs by NCCL to self; twice
    for k in 1 2; do
        timed t352_main_$k train_dit_main 352; timed t352_branch_$k train_dit 352
        timed t352_commstream_$k train_dit_commstream 352; timed t352_selfnccl_$k train_dit_selfnccl 352
    done
    # 5. if time is left: bugA through the bitwise check, 16,384 tokens
    step bit_bugA_run 15 30 $B/train_dit_bugA $BIT --out $W/bit_bugA && bitwise bugA >> $W/bitwise.txt
    timed t256_main_1 train_dit_main 256; timed t256_branch_1 train_dit 256
    timed t256_commstream_1 train_dit_commstream 256
    {
        echo "median ms/step, steps 4-10 (--image-size 352 = 30,976 tokens; 256 = 16,384):"
        for r in t352_{main,branch,commstream,selfnccl}_{1,2} t256_{main,branch,commstream}_1; do
            [ -d $W/$r ] && echo "  $r: $(median $r)"
        done
    } > $W/timing.txt
    rm -rf $W/bit_*/ckpt_*
    echo "total $(( $(date +%s) - T0 )) s" >> $W/status.txt
    tar czf $OUT/a2a_logs.tgz -C /tmp a2a_logs
    echo "=== status (planted_* must have rc != 0, the rest rc 0)"; cat $W/status.txt
    echo "=== tests"
    for t in tests_sp tests_sp_model planted_bugA planted_bugB planted_bugC; do
        [ -f $W/$t.log ] && echo "$t: $(grep -E 'Synthesis' $W/$t.log | tail -1)"
    done
    grep -h -E '\[FAIL\]|Assertion|differs|before' $W/planted_*.log 2>/dev/null | head -12
    grep -h -E '\[FAIL\]' $W/tests_sp.log $W/tests_sp_model.log 2>/dev/null | head -8
    echo "=== bitwise"; cat $W/bitwise.txt
    echo "=== timing"; cat $W/timing.txt
}

case $MODE in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash dev/ulysses_direct_gpu.sh prepare | bash .devrun_a2a/ulysses_direct_gpu.sh run"; exit 2 ;;
esac
