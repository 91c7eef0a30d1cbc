#!/usr/bin/env bash
# Ring 2's backward with the direct return of the foreign dk/dv (attention/ring_nccl.cu
# ring2_backward) on 2 GPUs: the tests, checkpoints bit for bit against main's build, step time
# against main's, and two planted bugs that must be caught.
#
#   bash dev/ring_direct_gpu.sh prepare            here (no GPU): builds into $DEV (default
#                                                  /work/main/.devrun_ringret), self-contained
#   bash .devrun_ringret/ring_direct_gpu.sh run    on nvidia-h200-x2, from the tree root, carry
#                                                  [".devrun_ringret", ".devlibs"]; < 150 s
#
# prepare: main's train_dit (the /work/main build, must be current) as train_dit_main; this
# branch's attention/ring_nccl.cu compiled with the Makefile's nvcc flags into a copy of main's
# build/libditc.a in place of main's ring_nccl.o (every other library source must be main's:
# checked), linked into train_dit, test_sequence_parallel_cuda and test_sp_model_cuda; the same
# for commit $NOSPLIT's ring_nccl.cu (direct return, own step not split by heads: train_dit_nosplit,
# test_sp_nosplit), measured beside; and two test binaries with a planted bug in a patched copy of
# ring_nccl.cu:
#   planted_skip:  ring2_finish_kernel adds no returned term (dk += own only): the direct return
#                  skipped. Must fail ring2_backward_is_the_ring_bitwise and ring_exact_matches.
#   planted_order: dq = dq + (own + foreign) instead of (dq + own) + foreign. Must fail
#                  ring2_backward_is_the_ring_bitwise (its dq starts random); the tolerance tests
#                  and the trainer (dq starts at zero there: both orders agree) cannot see it.
set -uo pipefail
MODE=${1:-}
DEV=${DEV:-/work/main/.devrun_ringret}
MAIN=${MAIN:-/work/main}
NOSPLIT=c613124   # this branch's first version: direct return, own step whole (not split by heads)

prepare() {
    set -e
    local here; here=$(cd "$(dirname "$0")/.." && pwd)
    cd "$here"
    local changed
    changed=$(git diff --name-only "$(git -C "$MAIN" rev-parse HEAD)" HEAD -- attention layers model dataloader train_dit.c \
              | grep -v -E '^attention/ring_nccl\.cu$' || true)
    [ -z "$changed" ] || { echo "prepare: library sources differ from main's: $changed"; exit 1; }
    [ -z "$(git status --porcelain -- attention test)" ] || { echo "prepare: commit attention/ and test/ first"; exit 1; }
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
    # lib_with SRC NAME: main's library with ring_nccl.o compiled from SRC, as $tmp/NAME/libditc.a
    lib_with() {
        mkdir -p "$tmp/$2"
        $NV -c -o "$tmp/$2/ring_nccl.o" "$1"
        cp "$MAIN/build/libditc.a" "$tmp/$2/libditc.a"
        ar r "$tmp/$2/libditc.a" "$tmp/$2/ring_nccl.o"
    }
    lib_with attention/ring_nccl.cu branch
    local k=attention/ring_nccl.cu
    sed 's/dk\[i\] = dk\[i\] + (own\[n + i\] + back\[i\]);/dk[i] = dk[i] + own[n + i];/;
         s/dv\[i\] = dv\[i\] + (own\[2 \* n + i\] + back\[n + i\]);/dv[i] = dv[i] + own[2 * n + i];/' $k > "$tmp/skip.cu"
    sed 's/dq\[i\] = (dq\[i\] + own\[i\]) + foreign_dq\[i\];/dq[i] = dq[i] + (own[i] + foreign_dq[i]);/' $k > "$tmp/order.cu"
    [ "$(diff $k "$tmp/skip.cu" | grep -c '^>')" = 2 ] || { echo "prepare: planted_skip patch did not apply"; exit 1; }
    [ "$(diff $k "$tmp/order.cu" | grep -c '^>')" = 1 ] || { echo "prepare: planted_order patch did not apply"; exit 1; }
    # the patched copies compile from the tree root (-I.) like the original
    lib_with "$tmp/skip.cu" skip
    lib_with "$tmp/order.cu" order
    git show $NOSPLIT:attention/ring_nccl.cu > "$tmp/nosplit.cu"
    lib_with "$tmp/nosplit.cu" nosplit
    rm -rf "$DEV" && mkdir -p "$DEV"
    gcc $F -o "$DEV/train_dit" train_dit.c "$tmp/branch/libditc.a" $L
    for t in test_sequence_parallel_cuda test_sp_model_cuda; do
        gcc $F -o "$DEV/$t" test/$t.c "$tmp/branch/libditc.a" $L -lcriterion
    done
    gcc $F -o "$DEV/test_sp_planted_skip" test/test_sequence_parallel_cuda.c "$tmp/skip/libditc.a" $L -lcriterion
    gcc $F -o "$DEV/test_sp_planted_order" test/test_sequence_parallel_cuda.c "$tmp/order/libditc.a" $L -lcriterion
    gcc $F -o "$DEV/test_sp_nosplit" test/test_sequence_parallel_cuda.c "$tmp/nosplit/libditc.a" $L -lcriterion
    gcc $F -o "$DEV/train_dit_nosplit" train_dit.c "$tmp/nosplit/libditc.a" $L
    cp "$MAIN/train_dit" "$DEV/train_dit_main"
    strip "$DEV"/train_dit* "$DEV"/test_*
    cp dev/ring_direct_gpu.sh "$DEV/"
    git rev-parse HEAD > "$DEV/commit.txt"
    rm -rf "$tmp"
    du -sh "$DEV" "$MAIN/.devlibs"
    echo "run from $MAIN: bash $(basename "$DEV")/ring_direct_gpu.sh run   (carry [\"$(basename "$DEV")\", \".devlibs\"])"
}

run() {
    local B; B=$(dirname "$0")
    local T0; T0=$(date +%s)
    local DEADLINE=$(( T0 + ${BUDGET_S:-145} ))
    : "${OUT:?OUT must be set (the device tool sets it)}"
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=WARN
    local N; N=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
    export LD_LIBRARY_PATH=$PWD/.devlibs:${N:+$N:}${LD_LIBRARY_PATH:-}
    local W=/tmp/ring_logs; rm -rf $W; mkdir -p $W
    # step NAME MAX_S CMD...: CMD under timeout min(MAX_S, time left), stdout+stderr to NAME.txt; rc noted
    step() {
        local name=$1 max=$2 left=$(( DEADLINE - $(date +%s) - 2 )); shift 2
        [ $left -lt $max ] && max=$left
        if [ $max -lt 8 ]; then echo "$name: SKIPPED (deadline)" >> $W/summary.txt; return 99; fi
        local t=$(date +%s)
        timeout $max "$@" > $W/$name.txt 2>&1
        local rc=$?
        echo "$name: rc=$rc in $(( $(date +%s) - t )) s" >> $W/steps.txt
        return $rc
    }
    { nvidia-smi -L; date -u; cat $B/commit.txt; ldd $B/train_dit | grep -E 'nccl|criterion|not found'; } > $W/env.txt 2>&1
    # 1. the unit tests of this branch; the model's ring tests (gradients against one GPU) in the
    #    background meanwhile, beside the correctness runs (not beside the timed ones)
    step test_model_ring 70 $B/test_sp_model_cuda --jobs 1 --verbose --filter 'sp_model/ring2*' &
    local model_pid=$!
    step test_sp 45 $B/test_sequence_parallel_cuda --jobs 1 --verbose
    echo "test_sequence_parallel_cuda (branch) rc=$?" >> $W/summary.txt
    # 2. bit for bit: 6 steps of the small model, main vs branch (sage and bf16) and vs nosplit (sage)
    bit() {   # attn variant binary
        step bit_$1_$2 20 $B/$3 --device gpu --data synthetic --model S --batch 8 --attn $1 --steps 6 --ckpt-every 6 \
            --sample-every 0 --seed 3 --gpus 2 --sp-ring 2 --out $W/bit_$1_$2
    }
    compare() {   # attn variant
        local a=$W/bit_$1_main b=$W/bit_$1_$2
        if [ ! -f $a/train_log.csv ] || [ ! -f $b/train_log.csv ] || [ -z "$(ls $a | grep '^ckpt_')" ]; then
            echo "bitwise $1 main vs $2: a run FAILED" >> $W/summary.txt; return
        fi
        for f in $(ls $a | grep '^ckpt_'); do
            if cmp -s $a/$f $b/$f; then echo "bitwise $1 main vs $2 $f: EQUAL" >> $W/summary.txt
            else echo "bitwise $1 main vs $2 $f: DIFFERENT, $(cmp -l $a/$f $b/$f 2>/dev/null | wc -l) bytes" >> $W/summary.txt; fi
        done
        diff <(cut -d, -f1-3 $a/train_log.csv) <(cut -d, -f1-3 $b/train_log.csv) > /dev/null \
            && echo "bitwise $1 main vs $2 train_log step,loss,grad_norm: identical" >> $W/summary.txt \
            || echo "bitwise $1 main vs $2 train_log step,loss,grad_norm: DIFFER" >> $W/summary.txt
    }
    bit sage main train_dit_main; bit sage new train_dit; bit bf16 main train_dit_main; bit bf16 new train_dit
    compare sage new; compare bf16 new
    # 3. planted bugs: must FAIL
    step planted_skip_bitwise 15 $B/test_sp_planted_skip --jobs 1 --verbose \
        --filter 'sequence_parallel_cuda/ring2_backward_is_the_ring_bitwise'
    echo "planted_skip: ring2_backward_is_the_ring_bitwise rc=$? (must be 1)" >> $W/summary.txt
    step planted_skip_exact 15 $B/test_sp_planted_skip --jobs 1 --verbose \
        --filter 'sequence_parallel_cuda/ring_exact_matches_single_gpu'
    echo "planted_skip: ring_exact_matches_single_gpu rc=$? (must be 1)" >> $W/summary.txt
    step planted_order_bitwise 15 $B/test_sp_planted_order --jobs 1 --verbose \
        --filter 'sequence_parallel_cuda/ring2_backward_is_the_ring_bitwise'
    echo "planted_order: ring2_backward_is_the_ring_bitwise rc=$? (must be 1)" >> $W/summary.txt
    wait $model_pid
    echo "test_sp_model_cuda ring2* (branch) rc=$?" >> $W/summary.txt
    # 4. step time at 30,976 tokens: main, branch, main, branch; then what time is left: the
    #    unsplit version (time, bitwise, unit test) and 16,384 tokens
    local MODEL="--device gpu --data synthetic --model S --hidden 2048 --heads 16 --depth 4 --batch 1 --attn sage --ckpt-every 0 --sample-every 0 --seed 1 --steps 10 --gpus 2 --sp-ring 2"
    timed() {   # size rep variant binary
        step t$1_$3_$2 25 $B/$4 $MODEL --image-size $1 --out $W/t$1_$3_$2 || echo "time $1 $3 run $2: FAILED, cut or skipped" >> $W/summary.txt
    }
    for rep in 1 2; do timed 352 $rep main train_dit_main; timed 352 $rep new train_dit; done
    timed 352 1 nosplit train_dit_nosplit
    bit sage nosplit train_dit_nosplit && compare sage nosplit
    step test_nosplit 15 $B/test_sp_nosplit --jobs 1 --verbose --filter 'sequence_parallel_cuda/ring2_backward_is_the_ring_bitwise'
    echo "test_sp nosplit ring2_backward_is_the_ring_bitwise rc=$?" >> $W/summary.txt
    timed 256 1 main train_dit_main; timed 256 1 new train_dit
    for size in 352 256; do
        for v in main new nosplit; do
            local runs="" all=""
            for rep in 1 2; do
                local f=$W/t${size}_${v}_$rep/train_log.csv
                [ -f $f ] || continue
                local m; m=$(awk -F, '$1 ~ /^[0-9]+$/ && $1 >= 4 && $1 <= 10 {print $5}' $f | sort -g \
                             | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]}')
                runs="$runs $m"
                all="$all $(awk -F, '$1 ~ /^[0-9]+$/ && $1 >= 4 && $1 <= 10 {printf "%s ", $5}' $f)"
            done
            [ -z "$runs" ] && continue
            local med; med=$(echo $all | tr ' ' '\n' | sort -g | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2), "(" NR " steps)"}')
            echo "time $size $v: median ms of steps 4-10 = $med; per run:$runs" >> $W/summary.txt
        done
    done
    rm -rf $W/*/ckpt_*
    echo "total $(( $(date +%s) - T0 )) s" >> $W/summary.txt
    tar czf $OUT/ring_logs.tgz -C /tmp ring_logs
    grep -h -E "differs from the ring|ring of 1 rank|Synthesis|FAIL" $W/test_sp.txt | tail -16
    grep -h -E "Synthesis|FAIL" $W/test_model_ring.txt $W/test_nosplit.txt 2>/dev/null | tail -6
    grep -h -E "Synthesis" $W/planted_*.txt 2>/dev/null
    cat $W/steps.txt $W/summary.txt
}

case $MODE in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash dev/ring_direct_gpu.sh prepare | bash .devrun_ringret/ring_direct_gpu.sh run"; exit 2 ;;
esac
