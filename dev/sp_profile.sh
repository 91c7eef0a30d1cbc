#!/usr/bin/env bash
# Per-rank GPU timelines of training steps on 1 GPU, Ulysses 2 and ring 2 (sage, hidden 2048,
# 16 heads of 128, depth 4, batch 1; dev/bench_sp.sh's model) at 30,976 and 16,384 tokens, and
# their line-by-line account against half of one GPU's step (dev/sp_timeline.py); plus the
# Ulysses variant of this branch (dq/dk/dv exchanged in bf16 after the rotation) traced beside
# main's, and checked bit for bit against main's build.
#
#   bash dev/sp_profile.sh prepare      here (no GPU): builds everything into $DEV (default
#                                       /work/main/.devrun_sp2), self-contained
#   bash .devrun_sp2/sp_profile.sh run  on the 2-GPU machine, from the tree root, logs to $OUT
#
# prepare: main's train_dit (the /work/main build, must be current) as train_dit_main; this
# branch's model/dit_gpu.cu compiled with the Makefile's nvcc flags and put into a copy of main's
# build/libditc.a in place of main's dit_gpu.o (the rest of the library sources must be the same
# as main's: checked), linked into train_dit and test_sp_model_cuda; libsp_trace.so (CUPTI).
set -uo pipefail
MODE=${1:-}
DEV=${DEV:-/work/main/.devrun_sp2}
MAIN=${MAIN:-/work/main}

prepare() {
    set -e
    local here; here=$(cd "$(dirname "$0")/.." && pwd)
    cd "$here"
    # the library sources other than model/dit_gpu.{cu,h} must be main's: we link main's objects
    local changed
    changed=$(git diff --name-only "$(git -C "$MAIN" rev-parse HEAD)" HEAD -- attention layers model dataloader \
              | grep -v -E '^model/dit_gpu\.(cu|h)$' || true)
    [ -z "$changed" ] || { echo "prepare: library sources differ from main's: $changed"; exit 1; }
    [ -z "$(git -C "$MAIN" status --porcelain -- attention layers model dataloader train_dit.c)" ] ||
        { echo "prepare: $MAIN has uncommitted library changes; its build is not main's"; exit 1; }
    for f in "$MAIN"/attention/* "$MAIN"/layers/* "$MAIN"/model/* "$MAIN"/train_dit.c; do
        [ "$MAIN/build/libditc.a" -nt "$f" ] || { echo "prepare: $MAIN/build/libditc.a is older than $f"; exit 1; }
    done
    [ "$MAIN/train_dit" -nt "$MAIN/build/libditc.a" ] || { echo "prepare: $MAIN/train_dit is stale"; exit 1; }
    local tmp; tmp=$(mktemp -d)
    local CUDA=/usr/local/cuda
    $CUDA/bin/nvcc -O3 -std=c++17 -I. --use_fast_math -Xcompiler -Wall -DDIT_NCCL \
        -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a -c -o "$tmp/dit_gpu.o" model/dit_gpu.cu
    cp "$MAIN/build/libditc.a" "$tmp/libditc.a"
    ar r "$tmp/libditc.a" "$tmp/dit_gpu.o"
    local F="-O3 -g -std=c11 -Wall -Wextra -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -DDIT_NCCL -I$CUDA/include"
    local L="-lm -lpthread -L$CUDA/lib64 -Wl,-rpath,$CUDA/lib64 -lcublasLt -lcublas -lcudart -lstdc++ -lnccl"
    rm -rf "$DEV" && mkdir -p "$DEV"
    gcc $F -o "$DEV/train_dit" train_dit.c "$tmp/libditc.a" $L
    gcc $F -o "$DEV/test_sp_model_cuda" test/test_sp_model_cuda.c "$tmp/libditc.a" $L -lcriterion
    gcc -O2 -Wall -Wextra -shared -fPIC -I$CUDA/include dev/sp_trace.c -o "$DEV/libsp_trace.so" \
        -L$CUDA/lib64 -Wl,-rpath,$CUDA/lib64 -lcupti -ldl -lpthread -lstdc++
    cp "$MAIN/train_dit" "$DEV/train_dit_main"
    cp dev/sp_timeline.py dev/sp_profile.sh "$DEV/"
    python3 "$DEV/sp_timeline.py" --self-test | tail -1
    rm -rf "$tmp"
    du -sh "$DEV" "$MAIN/.devlibs"
    echo "carry: [\"$(basename "$DEV")\", \".devlibs\"] (run from $MAIN)"
}

run() {
    local B; B=$(dirname "$0")
    local T0; T0=$(date +%s)
    local DEADLINE=$(( T0 + ${BUDGET_S:-280} ))
    : "${OUT:?OUT must be set (the device tool sets it)}"
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=WARN
    local N; N=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
    export LD_LIBRARY_PATH=$PWD/.devlibs:${N:+$N:}${LD_LIBRARY_PATH:-}
    local W=/tmp/sp_profile; rm -rf $W; mkdir -p $W
    { nvidia-smi -L; date -u; ldd $B/train_dit | grep -E 'nccl|cupti|not found'; ldd $B/libsp_trace.so | grep -E 'cupti|not found'; } > $W/env.txt 2>&1
    python3 $B/sp_timeline.py --self-test > $W/self_test.txt 2>&1
    local MODEL="--device gpu --data synthetic --model S --hidden 2048 --heads 16 --depth 4 --batch 1 --attn sage --ckpt-every 0 --sample-every 0 --seed 1"
    traced() {   # name, binary, image size, extra flags: one traced run of 8 steps
        local name=$1 bin=$2 size=$3 left=$(( DEADLINE - $(date +%s) )); shift 3
        [ $left -gt 90 ] && left=90
        if [ $left -lt 25 ]; then echo "$name: skipped (deadline)" | tee -a $W/skipped.txt; return; fi
        mkdir -p $W/$name
        local t=$(date +%s)
        SP_TRACE_DIR=$W/$name LD_PRELOAD=$PWD/$B/libsp_trace.so timeout $left $B/$bin $MODEL --image-size $size \
            --steps 8 --out $W/$name/out "$@" > $W/$name/log.txt 2>&1 || echo "$name: FAILED or cut" | tee -a $W/skipped.txt
        echo "$name: $(( $(date +%s) - t )) s" >> $W/times.txt
    }
    # 1. the target size first: 1 GPU, Ulysses 2 (main), ring 2, Ulysses 2 with the bf16 exchange
    traced t352_1gpu train_dit_main 352
    traced t352_ulysses2 train_dit_main 352 --gpus 2 --sp-ulysses 2
    traced t352_ring2 train_dit_main 352 --gpus 2 --sp-ring 2
    traced t352_ulysses2_bf16a2a train_dit 352 --gpus 2 --sp-ulysses 2
    # 2. bit-for-bit: main's and this branch's Ulysses step, 6 steps of the small model, checkpoint
    #    compared byte for byte (the step is deterministic: sage's deterministic backward)
    if [ $(( DEADLINE - $(date +%s) )) -gt 60 ]; then
        for v in main bf16a2a; do
            local bin=train_dit_main; [ $v = bf16a2a ] && bin=train_dit
            timeout 40 $B/$bin --device gpu --data synthetic --model S --batch 8 --attn sage --steps 6 --ckpt-every 6 \
                --sample-every 0 --seed 3 --gpus 2 --sp-ulysses 2 --out $W/bit_$v > $W/bit_$v.log 2>&1
        done
        { if [ ! -f $W/bit_main/train_log.csv ] || [ ! -f $W/bit_bf16a2a/train_log.csv ]; then
              echo "bitwise: a run FAILED (see bit_main.log, bit_bf16a2a.log)"
          else
              for f in $(ls $W/bit_main | grep '^ckpt_'); do
                  if cmp -s $W/bit_main/$f $W/bit_bf16a2a/$f; then echo "$f: bitwise EQUAL"
                  else echo "$f: DIFFERENT, $(cmp -l $W/bit_main/$f $W/bit_bf16a2a/$f 2>/dev/null | wc -l) bytes differ"; fi
              done
              diff <(cut -d, -f1-3 $W/bit_main/train_log.csv) <(cut -d, -f1-3 $W/bit_bf16a2a/train_log.csv) \
                  && echo "train_log.csv step,loss,grad_norm: identical"
          fi; } > $W/bitwise.txt 2>&1
    fi
    # 3. the Ulysses model tests with this branch's build (gradients against one GPU)
    if [ $(( DEADLINE - $(date +%s) )) -gt 70 ]; then
        timeout 60 $B/test_sp_model_cuda --jobs 1 --verbose --filter 'sp_model/ulysses2*' > $W/test_ulysses.txt 2>&1
    fi
    # 4. 16K tokens if time is left
    traced t256_1gpu train_dit_main 256
    traced t256_ulysses2 train_dit_main 256 --gpus 2 --sp-ulysses 2
    traced t256_ring2 train_dit_main 256 --gpus 2 --sp-ring 2
    # the analysis (the traces travel too: it can be rerun here)
    for s in 352 256; do
        local args=""
        for r in 1gpu ulysses2 ring2 ulysses2_bf16a2a; do [ -d $W/t${s}_$r ] && args="$args --run ${r}=$W/t${s}_$r"; done
        [ -n "$args" ] && python3 $B/sp_timeline.py $args --skip 3 > $W/account_$s.md 2>&1
    done
    rm -rf $W/*/out/ckpt_* $W/bit_*/ckpt_*
    echo "total $(( $(date +%s) - T0 )) s" >> $W/times.txt
    tar czf $OUT/sp_profile.tgz -C /tmp sp_profile
    tail -1 $W/self_test.txt; cat $W/times.txt $W/bitwise.txt 2>/dev/null
    grep -E "PASS|FAIL|Synthesis" $W/test_ulysses.txt 2>/dev/null | tail -4
    grep -E "^## |^### |sum of the differences" $W/account_352.md 2>/dev/null
}

case $MODE in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash dev/sp_profile.sh prepare | bash .devrun_sp2/sp_profile.sh run"; exit 2 ;;
esac
