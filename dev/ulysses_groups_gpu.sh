#!/usr/bin/env bash
# Validation of Ulysses' attention pipelined by head groups (issue 6; branch ulysses-groups) on
# 2 GPUs: the all-to-all and Ulysses model tests, checkpoints bit for bit against main's build
# (sage and bf16, 2 and 4 groups), planted bugs that must fail, then the step time at 30,976 and
# 16,384 tokens against main's, interleaved.
#
#   bash dev/ulysses_groups_gpu.sh prepare        here (no GPU): fills $DEV (default
#                                                  /work/main/.devrun_ugroups), self-contained
#   bash .devrun_ugroups/ulysses_groups_gpu.sh run  on nvidia-h200-x2 from the tree root, carry
#                                                  [".devrun_ugroups", ".devlibs"]; logs to $OUT
#
# prepare: this worktree's build (make train_dit and the two test binaries), main's train_dit
# (the /work/main build, must be current) as train_dit_main, and variants compiled from copies of
# model/dit_gpu.cu or attention/ulysses_nccl.cu patched here (each edit must apply exactly once),
# never in the source, each put into a copy of this build's libditc.a:
#   prio0     the all-to-all stream at the default priority (timing only)
#   onestream every group's attention on the model stream (timing only: each group's kernels
#             then end in a partly idle last wave before the next group's start)
#   bugWait   the model stream does not wait for group g's q, k, v before its attention (a race:
#             the attention reads the previous step's q, k, v unless the exchange wins)
#   bugRound  every group's dq, dk, dv rounded from pair 0 on (group offsets lost: deterministic)
#   bugRuns   the runs' pair index without `first` (every part moves the pairs of part 0)
set -uo pipefail
MODE=${1:-}
DEV=${DEV:-/work/main/.devrun_ugroups}
MAIN=${MAIN:-/work/main}

# patch NAME SRC DST: DST = SRC with the variant NAME's edits, each applied exactly once.
patch_variant() {
    python3 - "$1" "$2" "$3" <<'PY'
import sys
name, src, dst = sys.argv[1:]
s = open(src).read()
edits = {
    "prio0": [("cudaStreamCreateWithPriority(&m->group_stream, cudaStreamNonBlocking, greatest)",
               "cudaStreamCreateWithPriority(&m->group_stream, cudaStreamNonBlocking, least)")],
    "onestream": [("{ return g % 2 ? m->odd_stream : m->stream; }", "{ return g < 0 ? m->odd_stream : m->stream; }")],
    "bugWait": [("        CUDA_CHECK(err, cudaStreamWaitEvent(c, ev[1 + g], 0), \"wait for group %d's q, k, v\", g);\n", "")],
    "bugRound": [("sb->dv_heads, B, first, count, c, err));", "sb->dv_heads, B, 0, count, c, err));")],
    "bugRuns": [("j = sel->first + k % sel->count, b", "j = k % sel->count, b")],
}[name]
for old, new in edits:
    n = s.count(old)
    if n != 1: sys.exit(f"patch {name}: {old[:60]!r} found {n} times, expected 1")
    s = s.replace(old, new)
open(dst, "w").write(s)
PY
}

prepare() {
    set -e
    local here; here=$(cd "$(dirname "$0")/.." && pwd)
    cd "$here"
    [ -z "$(git status --porcelain -- attention layers model dataloader train_dit.c test)" ] ||
        { echo "prepare: commit the sources first"; exit 1; }
    [ -z "$(git -C "$MAIN" status --porcelain -- attention layers model dataloader train_dit.c)" ] ||
        { echo "prepare: $MAIN has uncommitted library changes; its build is not main's"; exit 1; }
    for f in "$MAIN"/attention/* "$MAIN"/layers/* "$MAIN"/model/* "$MAIN"/train_dit.c; do
        [ "$MAIN/build/libditc.a" -nt "$f" ] || { echo "prepare: $MAIN/build/libditc.a is older than $f"; exit 1; }
    done
    [ "$MAIN/train_dit" -nt "$MAIN/build/libditc.a" ] || { echo "prepare: $MAIN/train_dit is stale"; exit 1; }
    make -j2 train_dit build/test_sequence_parallel_cuda build/test_sp_model_cuda
    local tmp; tmp=$(mktemp -d)
    local CUDA=/usr/local/cuda
    local NV="$CUDA/bin/nvcc -O3 -std=c++17 -I. --use_fast_math -Xcompiler -Wall -DDIT_NCCL
              -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    local F="-O3 -g -std=c11 -Wall -Wextra -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -DDIT_NCCL -I$CUDA/include"
    local L="-lm -lpthread -L$CUDA/lib64 -Wl,-rpath,$CUDA/lib64 -lcublasLt -lcublas -lcudart -lstdc++ -lnccl"
    rm -rf "$DEV" && mkdir -p "$DEV"
    for v in prio0 onestream bugWait bugRound bugRuns; do
        mkdir -p "$tmp/$v"
        if [ $v = bugRuns ]; then
            patch_variant $v attention/ulysses_nccl.cu "$tmp/$v/ulysses_nccl.cu"
            $NV -c -o "$tmp/$v/ulysses_nccl.o" "$tmp/$v/ulysses_nccl.cu" &
        else
            patch_variant $v model/dit_gpu.cu "$tmp/$v/dit_gpu.cu"
            $NV -c -o "$tmp/$v/dit_gpu.o" "$tmp/$v/dit_gpu.cu" &
        fi
        [ $v = onestream ] || [ $v = bugRound ] && wait   # two compilations at a time (2 cores)
    done
    wait
    for v in prio0 onestream bugWait bugRound bugRuns; do
        cp build/libditc.a "$tmp/$v/libditc.a"
        ar r "$tmp/$v/libditc.a" "$tmp/$v"/*.o
    done
    cp train_dit "$DEV/train_dit"
    cp build/test_sequence_parallel_cuda build/test_sp_model_cuda "$DEV/"
    for v in prio0 onestream bugWait bugRound; do gcc $F -o "$DEV/train_dit_$v" train_dit.c "$tmp/$v/libditc.a" $L; done
    gcc $F -o "$DEV/test_sequence_parallel_cuda_bugRuns" test/test_sequence_parallel_cuda.c "$tmp/bugRuns/libditc.a" \
        $L -lcriterion
    cp "$MAIN/train_dit" "$DEV/train_dit_main"
    strip "$DEV"/train_dit* "$DEV"/test_*
    cp dev/ulysses_groups_gpu.sh "$DEV/"
    rm -rf "$tmp"
    du -sh "$DEV" "$MAIN/.devlibs"
    echo "carry: [\"$(basename "$DEV")\", \".devlibs\"] (run from $MAIN): bash $(basename "$DEV")/ulysses_groups_gpu.sh run"
}

run() {
    local B; B=$(dirname "$0")
    local T0; T0=$(date +%s)
    local DEADLINE=$(( T0 + ${BUDGET_S:-165} ))
    : "${OUT:?OUT must be set (the device tool sets it)}"
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=WARN
    local N; N=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
    export LD_LIBRARY_PATH=$PWD/.devlibs:${N:+$N:}${LD_LIBRARY_PATH:-}
    local W=/tmp/ugroups_logs; rm -rf $W; mkdir -p $W
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
    local BIT="--device gpu --data synthetic --model S --batch 8 --steps 6 --ckpt-every 3 --sample-every 0 --seed 3 --deterministic --gpus 2 --sp-ulysses 2"
    timed() {   # name binary image-size [flags]
        local name=$1 bin=$2 size=$3; shift 3
        step $name 15 30 $B/$bin $TIMING --image-size $size --out $W/$name "$@"
    }
    bit() {     # name binary attn [flags]
        local name=$1 bin=$2 attn=$3; shift 3
        step $name 12 30 $B/$bin $BIT --attn $attn --out $W/$name "$@"
    }
    median() {  # median of the ms column of steps 4..10
        [ -f $W/$1/train_log.csv ] || { echo "n/a"; return; }
        awk -F, 'NR > 1 && $1 >= 4 && $1 <= 10 { print $5 }' $W/$1/train_log.csv | sort -g |
            awk '{ a[NR] = $1 } END { if (NR == 0) print "n/a"; else if (NR % 2) print a[(NR + 1) / 2]; else printf "%.3f\n", (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
    }
    bitwise() {  # bitwise REF RUN: checkpoints and logged step/loss/grad norm of two runs
        if [ ! -f $W/$1/train_log.csv ] || [ ! -f $W/$2/train_log.csv ]; then
            echo "bitwise $2 vs $1: a run FAILED or was skipped"; return
        fi
        local f n=0
        for f in $(ls $W/$1 | grep '^ckpt_'); do
            n=$((n + 1))
            if cmp -s $W/$1/$f $W/$2/$f; then echo "bitwise $2 vs $1: $f EQUAL"
            else echo "bitwise $2 vs $1: $f DIFFERENT ($(cmp -l $W/$1/$f $W/$2/$f 2>/dev/null | wc -l) bytes)"; fi
        done
        [ $n -gt 0 ] || echo "bitwise $2 vs $1: no checkpoint written"
        diff -q <(cut -d, -f1-3 $W/$1/train_log.csv) <(cut -d, -f1-3 $W/$2/train_log.csv) > /dev/null \
            && echo "bitwise $2 vs $1: train_log step,loss,grad_norm identical" || echo "bitwise $2 vs $1: train_log DIFFERS"
    }
    # 1. tests: the all-to-all (incl. the runs by parts) and the Ulysses model tests (2 groups)
    step tests_sp 15 40 $B/test_sequence_parallel_cuda --jobs 1 --verbose \
        --filter 'sequence_parallel_cuda/@(all_to_all*|ulysses*|shape*)'
    step tests_sp_model 20 50 $B/test_sp_model_cuda --jobs 1 --verbose --filter 'sp_model/ulysses2*'
    # 2. bit for bit against main: 6 deterministic steps of DiT-S batch 8 (head dim 64, 3 heads per
    #    rank: 24 pairs), sage 2 groups, bf16 2 groups, sage 4 groups; then head dim 128 (hidden
    #    256, 2 heads: the persistent Hopper forward of the 31K runs), sage 2 groups
    bit bit_main_sage train_dit_main sage; bit bit_g2_sage train_dit sage
    bitwise bit_main_sage bit_g2_sage > $W/bitwise.txt
    bit bit_main_bf16 train_dit_main bf16; bit bit_g2_bf16 train_dit bf16
    bitwise bit_main_bf16 bit_g2_bf16 >> $W/bitwise.txt
    bit bit_g4_sage train_dit sage --sp-head-groups 4
    bitwise bit_main_sage bit_g4_sage >> $W/bitwise.txt
    bit bit_main_d128 train_dit_main sage --hidden 256 --heads 2; bit bit_g2_d128 train_dit sage --hidden 256 --heads 2
    bitwise bit_main_d128 bit_g2_d128 >> $W/bitwise.txt
    # 3. planted bugs: each must FAIL (differ, or the test fail)
    bit bit_bugRound train_dit_bugRound sage; bitwise bit_main_sage bit_bugRound >> $W/bitwise.txt
    bit bit_bugWait train_dit_bugWait sage; bitwise bit_main_sage bit_bugWait >> $W/bitwise.txt
    step planted_bugRuns 8 20 $B/test_sequence_parallel_cuda_bugRuns --jobs 1 --verbose \
        --filter 'sequence_parallel_cuda/all_to_all_runs*'
    # 4. step time at 30,976 tokens, interleaved: main, 2 groups, 4 groups; twice
    for k in 1 2; do
        timed t352_main_$k train_dit_main 352
        timed t352_g2_$k train_dit 352
        timed t352_g4_$k train_dit 352 --sp-head-groups 4
    done
    # 5. as time allows: the default-priority stream, one compute stream, 1 group (the pipeline's
    #    overhead), 16,384 tokens
    timed t352_g2prio0_1 train_dit_prio0 352
    timed t352_g2onestream_1 train_dit_onestream 352
    timed t352_g1_1 train_dit 352 --sp-head-groups 1
    timed t256_main_1 train_dit_main 256; timed t256_g2_1 train_dit 256; timed t256_g4_1 train_dit 256 --sp-head-groups 4
    {
        echo "median ms/step, steps 4-10 (--image-size 352 = 30,976 tokens; 256 = 16,384):"
        for r in t352_{main,g2,g4}_{1,2} t352_g2prio0_1 t352_g2onestream_1 t352_g1_1 t256_{main,g2,g4}_1; do
            [ -d $W/$r ] && echo "  $r: $(median $r)"
        done
    } > $W/timing.txt
    rm -rf $W/bit_*/ckpt_*
    echo "total $(( $(date +%s) - T0 )) s" >> $W/status.txt
    tar czf $OUT/ugroups_logs.tgz -C /tmp ugroups_logs
    echo "=== status (planted_* must have rc != 0, the rest rc 0)"; cat $W/status.txt
    echo "=== tests"
    for t in tests_sp tests_sp_model planted_bugRuns; do
        [ -f $W/$t.log ] && echo "$t: $(grep -E 'Synthesis' $W/$t.log | tail -1)"
    done
    grep -h -E '\[FAIL\]' $W/tests_sp.log $W/tests_sp_model.log 2>/dev/null | head -8
    grep -h -E '\[FAIL\]|differs|written' $W/planted_*.log 2>/dev/null | head -4
    echo "=== bitwise (g2, g4, d128 EQUAL; bugRound, bugWait DIFFERENT)"; cat $W/bitwise.txt
    echo "=== timing"; cat $W/timing.txt
}

case $MODE in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash dev/ulysses_groups_gpu.sh prepare | bash .devrun_ugroups/ulysses_groups_gpu.sh run"; exit 2 ;;
esac
