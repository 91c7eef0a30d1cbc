#!/usr/bin/env bash
# ZeRO-1's gradient reduction behind the backward, second version (train_dit --zero-overlap,
# model/zero.h; dev/notes_sequence_parallel.md, "ZeRO-1's reduction behind the backward"): the
# adaLN weights' gradients per block, the final layer in the first bucket, --zero-overlap auto.
# Validated and timed on two H200s in one device call, in priority order: the per-block adaLN
# gradients against the stacked GEMM (one GPU) and the zero1 unit test (bitwise against the
# replicated update), four planted bugs that must fail them; 6 deterministic steps of DiT-S for
# Ulysses 2, ring 2 and data parallel 2 with --zero-overlap on, this branch against main, step-6
# checkpoints compared; ms/step main vs this branch interleaved at 30,976 tokens (two rounds,
# Ulysses 2 then ring 2), DiT-S data parallel 2 (auto must keep the reduce-scatter: equal time),
# 1 GPU at 30,976 tokens (the ratio), 16,384 tokens (one round); if time is left, the GPU model and
# sequence-parallel model suites.
#   here (nvcc, no GPU), from the branch's tree root:
#       bash dev/zero_overlap_gpu.sh prepare /work/main/.devrun_zov2
#     builds DIR with stripped binaries (this branch's train_dit and tests, the planted test builds,
#     main's train_dit copied from /work/main, its commit in DIR/commit.txt) and this script
#   GPU machine, from /work/main, carrying DIR and .devlibs (Criterion's runtime libraries):
#       run(command="bash .devrun_zov2/zero_overlap_gpu.sh run .devrun_zov2", kind="nvidia-h200-x2",
#           carry=[".devrun_zov2", ".devlibs"], timeout_s=230)
#   Every step runs under `timeout -k 3`, all within BUDGET_S (default 200 s); $OUT/summary.txt grows
#   step by step (a cut call still returns it, timings included); at most 4 small text files come
#   back (summary.txt, report.txt, tests.log, train.log), no checkpoints.
# Planted bugs (each a sed on a copy, checked to change the source, linked before libditc.a):
#   skip      model/zero.c: the last range of every bucket (the final layer in the first, fc2's bias
#             in the others: rank 1's slice) is not reduced (zero1 must FAIL)
#   root      model/distributed.c: the piece cut at the shard boundary ends one element late, so the
#             first element of rank 1's slice is reduced to rank 0 (zero1 must FAIL)
#   adasize   model/dit_gpu.cu: a block's adaLN weight range is 6h floats instead of 6h·h, so most of
#             the adaLN weights' gradients are never reduced (zero1 must FAIL)
#   adaslice  model/dit_gpu.cu: block l's adaLN gradients are written to block depth-1-l's slice
#             (dit_gpu/per_block_adaln_gradients_equal_the_stacked_gemm must FAIL; zero1 cannot see
#             it: its replicated reference has the same backward)
set -uo pipefail

prepare() {
    set -e
    local D=${1:-/work/main/.devrun_zov2}
    local CFLAGS="-O3 -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -I. -fopenmp -DDIT_CUDA -I/usr/local/cuda/include -DDIT_NCCL"
    local NVFLAGS="-O3 -std=c++17 -I. --use_fast_math -DDIT_NCCL -gencode=arch=compute_90a,code=sm_90a"
    local LIBS="-lm -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart -lstdc++ -lnccl"
    local B=build/zero_overlap_dev
    make -j2 train_dit build/libditc.a build/test_distributed_cuda build/test_dit_gpu_cuda build/test_sp_model_cuda
    rm -rf "$D" "$B" && mkdir -p "$D" "$B"
    sed 's/offsets, numels, n, grad_scale, r,/offsets, numels, n - 1, grad_scale, r,/' model/zero.c > $B/planted_skip.c
    sed 's/size_t end = (root + 1) \* count < hi ? (root + 1) \* count : hi;/size_t end = (root + 1) * count + 1 < hi ? (root + 1) * count + 1 : hi;/' \
        model/distributed.c > $B/planted_root.c
    sed 's/{g->ada_w, 6 \* h \* h}/{g->ada_w, 6 * h}/' model/dit_gpu.cu > $B/planted_adasize.cu
    sed 's/dw->ada_w + (size_t)l \* 6 \* h \* h, dw->ada_b + (size_t)l \* 6 \* h,/dw->ada_w + (size_t)(L - 1 - l) * 6 * h * h, dw->ada_b + (size_t)(L - 1 - l) * 6 * h,/' \
        model/dit_gpu.cu > $B/planted_adaslice.cu
    cmp -s model/zero.c $B/planted_skip.c && { echo "planted_skip: sed changed nothing" >&2; exit 1; }
    cmp -s model/distributed.c $B/planted_root.c && { echo "planted_root: sed changed nothing" >&2; exit 1; }
    cmp -s model/dit_gpu.cu $B/planted_adasize.cu && { echo "planted_adasize: sed changed nothing" >&2; exit 1; }
    cmp -s model/dit_gpu.cu $B/planted_adaslice.cu && { echo "planted_adaslice: sed changed nothing" >&2; exit 1; }
    for p in skip root; do cc $CFLAGS -c -o $B/planted_$p.o $B/planted_$p.c; done
    for p in adasize adaslice; do nvcc $NVFLAGS -c -o $B/planted_$p.o $B/planted_$p.cu; done
    # the planted object comes first: the archive's own member is then never pulled in (a clash
    # would be a duplicate-symbol link error, not a silent pick)
    for p in skip root adasize; do
        cc $CFLAGS -o $D/test_distributed_planted_$p test/test_distributed_cuda.c $B/planted_$p.o build/libditc.a \
            $LIBS -lcriterion
    done
    cc $CFLAGS -o $D/test_dit_gpu_planted_adaslice test/test_dit_gpu_cuda.c $B/planted_adaslice.o build/libditc.a \
        $LIBS -lcriterion
    cp train_dit $D/train_dit_new
    cp /work/main/train_dit $D/train_dit_main
    cp build/test_distributed_cuda build/test_dit_gpu_cuda build/test_sp_model_cuda $D/
    strip $D/*
    {
        echo "new (branch $(git rev-parse --abbrev-ref HEAD)): $(git rev-parse HEAD)$(git diff --quiet HEAD || echo ' + uncommitted changes')"
        echo "main (/work/main/train_dit): HEAD $(git -C /work/main rev-parse HEAD)," \
             "last code commit $(git -C /work/main log -1 --format=%h -- train_dit.c model layers attention dataloader Makefile)," \
             "binary of $(date -r /work/main/train_dit -u +%FT%TZ)"
    } > $D/commit.txt
    cp dev/zero_overlap_gpu.sh $D/
    du -sh "$D"
}

run() {
    local D=${1:-.devrun_zov2} O=${OUT:-zero_overlap_out} L
    L=$(mktemp -d)
    mkdir -p $O
    export LD_LIBRARY_PATH=$PWD/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export NCCL_NVLS_ENABLE=0
    local S=$O/summary.txt deadline=$((SECONDS + ${BUDGET_S:-200}))
    : > $S
    cat $D/commit.txt >> $S
    # step NAME SECONDS LOG COMMAND...: runs under timeout -k 3 (cut at the deadline), appends its
    # output to LOG, its rc and last line to the summary
    step() {
        local name=$1 t=$2 log=$3; shift 3
        [ $t -gt $((deadline - SECONDS)) ] && t=$((deadline - SECONDS))
        if [ $t -lt 2 ]; then echo "$name: skipped (deadline)" >> $S; return; fi
        echo "=== $name" >> $log
        timeout -k 3 $t "$@" >> $log 2>&1
        local rc=$?
        echo "$name: rc=$rc$([ $rc -ge 124 ] && echo ' (cut by timeout)') ($(tail -n 1 $log | cut -c1-200)) at $SECONDS s" >> $S
    }
    # median (or IQR) of train_log.csv's ms (column 5) over steps a..b of run directory $L/RUN
    median_ms() {
        awk -F, -v a=$2 -v b=$3 'NR > 1 && $1 >= a && $1 <= b {print $5}' $L/$1/train_log.csv 2>/dev/null | sort -g |
            awk -v want=$(($3 - $2 + 1)) '{v[NR] = $1} END {if (NR == want) print v[int((NR + 1) / 2)]; else print "n/a"}'
    }
    iqr_ms() {
        awk -F, -v a=$2 -v b=$3 'NR > 1 && $1 >= a && $1 <= b {print $5}' $L/$1/train_log.csv 2>/dev/null | sort -g |
            awk '{v[NR] = $1} END {if (NR >= 4) printf "%.3f\n", v[int(NR * 3 / 4)] - v[int(NR / 4) + 1]; else print "n/a"}'
    }
    # timed RUN LAST_STEP COMMAND...: a training run into $L/RUN, its median ms into the summary
    timed() {
        local run=$1 last=$2; shift 2
        step $run 25 $O/train.log "$@" --out $L/$run
        echo "  $run: median ms of steps 4-$last $(median_ms $run 4 $last)" >> $S
        find $L/$run -name '*.safetensors' -delete 2>/dev/null
    }
    timeout -k 3 10 nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $S 2>&1

    # 1. the unit tests (must pass, rc 0), then the planted builds in parallel (rc 1 = FAIL, as they
    #    must; each time-boxed: a hang is a failure of the build, not a wait)
    step adaln_unit 40 $O/tests.log $D/test_dit_gpu_cuda --jobs 1 --verbose --filter 'dit_gpu/per_block*'
    grep -E 'per-block adaLN gradients:' $O/tests.log | tail -1 >> $S
    step zero1_unit 60 $O/tests.log $D/test_distributed_cuda --jobs 1 --verbose --filter 'zero1/*'
    grep -E 'replicated_overlap vs replicated' $O/tests.log | tail -2 >> $S
    for p in skip root adasize; do
        step planted_$p 40 $L/planted_$p.log $D/test_distributed_planted_$p --jobs 1 --filter 'zero1/sharded*' &
    done
    step planted_adaslice 40 $L/planted_adaslice.log env CUDA_VISIBLE_DEVICES=0 $D/test_dit_gpu_planted_adaslice \
        --jobs 1 --filter 'dit_gpu/per_block*' &
    wait
    for p in skip root adasize adaslice; do
        grep -E 'differ from|against the stacked|Synthesis|=== ' $L/planted_$p.log | head -8 >> $O/tests.log
    done

    # 2. 6 deterministic steps of DiT-S for three meshes, new (--zero-overlap on: DiT-S is below
    #    auto's threshold) vs main, all at once (deterministic: contention changes no bit); step-6
    #    checkpoints compared; if they differ, the losses and norms of the 6 steps within 1e-3
    local CK="--device gpu --data synthetic --model S --batch 8 --image-size 32 --attn sage --steps 6 --deterministic --grad-clip 1e9 --ckpt-every 3 --sample-every 0 --seed 3 --gpus 2"
    for mesh in ulysses2 ring2 dp2; do
        local flags=""
        [ $mesh = ulysses2 ] && flags="--sp-ulysses 2"
        [ $mesh = ring2 ] && flags="--sp-ring 2"
        step ckpt_${mesh}_main 60 $L/ckpt_${mesh}_main.log $D/train_dit_main $CK $flags --out $L/ck_${mesh}_main &
        step ckpt_${mesh}_new 60 $L/ckpt_${mesh}_new.log $D/train_dit_new $CK $flags --zero-overlap on \
            --out $L/ck_${mesh}_new &
    done
    wait
    for mesh in ulysses2 ring2 dp2; do
        for b in main new; do tail -n 4 $L/ckpt_${mesh}_$b.log >> $O/train.log; done
        local a=$L/ck_${mesh}_main/ckpt_000006.safetensors n=$L/ck_${mesh}_new/ckpt_000006.safetensors verdict
        if [ ! -s $a ] || [ ! -s $n ]; then verdict=MISSING; elif cmp -s $a $n; then verdict=EQUAL; else verdict=DIFFERENT; fi
        echo "checkpoint step 6, $mesh: $verdict" >> $S
        # loss and grad norm columns of the logs (the ms column differs): equal, or the largest
        # relative difference over the 6 steps
        local lm=$L/ck_${mesh}_main/train_log.csv ln=$L/ck_${mesh}_new/train_log.csv
        if cmp -s <(cut -d, -f1-3 $lm 2>/dev/null) <(cut -d, -f1-3 $ln 2>/dev/null); then
            echo "train_log loss/grad_norm, $mesh: EQUAL" >> $S
        else
            echo "train_log loss/grad_norm, $mesh: DIFFERENT, largest relative difference $(paste -d, $lm $ln 2>/dev/null |
                awk -F, -v k=$(head -1 $lm 2>/dev/null | awk -F, '{print NF}') 'NR > 1 {for (c = 2; c <= 3; c++) {
                    d = $c - $(c + k); d = d < 0 ? -d : d; r = $c != 0 ? d / ($c < 0 ? -$c : $c) : d; if (r > m) m = r}}
                    END {printf "%.3g (rows %d)", m, NR - 1}')" >> $S
        fi
    done
    grep -h "ZeRO-1 over" $L/ckpt_ulysses2_new.log | head -1 >> $S
    find $L -name '*.safetensors' -delete

    # 3. ms/step (bench_sp.sh's model), main and new (auto: on at 1,261 MB of gradients) interleaved:
    #    30,976 tokens twice; DiT-S data parallel (auto: off, expected equal); 1 GPU (the ratio);
    #    16,384 tokens once
    local BIG="--device gpu --data synthetic --model S --hidden 2048 --heads 16 --depth 4 --batch 1 --attn sage --ckpt-every 0 --sample-every 0 --seed 1 --steps 10"
    for round in 1 2; do
        for kind in ulysses2 ring2; do
            local f=$([ $kind = ulysses2 ] && echo "--sp-ulysses 2" || echo "--sp-ring 2")
            for b in main new; do timed t352_${kind}_${b}_$round 10 $D/train_dit_$b $BIG --gpus 2 --image-size 352 $f; done
        done
    done
    grep -h "ZeRO-1 over" $O/train.log | sort | uniq -c >> $S
    local SMALL="--device gpu --data synthetic --model S --batch 8 --image-size 32 --attn sage --ckpt-every 0 --sample-every 0 --seed 1 --steps 30 --gpus 2"
    for b in main new; do timed s_dp2_$b 30 $D/train_dit_$b $SMALL; done
    for b in main new; do timed t352_1gpu_$b 10 env CUDA_VISIBLE_DEVICES=0 $D/train_dit_$b $BIG --gpus 1 --image-size 352; done
    for kind in ulysses2 ring2; do
        local f=$([ $kind = ulysses2 ] && echo "--sp-ulysses 2" || echo "--sp-ring 2")
        for b in main new; do timed t256_${kind}_$b 10 $D/train_dit_$b $BIG --gpus 2 --image-size 256 $f; done
    done
    # 4. if time is left: the GPU model suite (its tolerances against the CPU) and the
    #    sequence-parallel model suite
    step dit_gpu 60 $L/dit_gpu.log env CUDA_VISIBLE_DEVICES=0 $D/test_dit_gpu_cuda --jobs 1
    step sp_model 60 $L/sp_model.log $D/test_sp_model_cuda --jobs 1
    for t in dit_gpu sp_model; do grep -E 'Synthesis|FAIL' $L/$t.log 2>/dev/null | head -6 >> $O/tests.log; done

    # the report: medians and the decision rule
    {
        echo "== ms/step, median of steps 4-10 (main | new | new - main)"
        for run in t352_ulysses2_%_1 t352_ulysses2_%_2 t352_ring2_%_1 t352_ring2_%_2 t352_1gpu_% t256_ulysses2_% t256_ring2_%; do
            local m=$(median_ms ${run/\%/main} 4 10) n=$(median_ms ${run/\%/new} 4 10)
            echo "${run/_\%/}: $m | $n | $(awk -v a="$m" -v b="$n" 'BEGIN {if (a + 0 && b + 0) printf "%+.2f", b - a; else print "n/a"}')"
        done
        local g1=$(median_ms t352_1gpu_new 4 10) u1n=$(median_ms t352_ulysses2_new_1 4 10) u2n=$(median_ms t352_ulysses2_new_2 4 10)
        echo "speedup over 1 GPU (new), Ulysses 2 at 30,976: $(awk -v g=$g1 -v a=$u1n -v b=$u2n \
            'BEGIN {if (g + 0 && a + 0 && b + 0) printf "%.3fx / %.3fx", g / a, g / b; else print "n/a"}')"
        local sm=$(median_ms s_dp2_main 4 30) sn=$(median_ms s_dp2_new 4 30) qm=$(iqr_ms s_dp2_main 4 30) qn=$(iqr_ms s_dp2_new 4 30)
        echo "DiT-S data parallel 2, batch 8, median of steps 4-30: main $sm (IQR $qm) | new $sn (IQR $qn)"
        echo "== decision rule (merge if every line is yes)"
        for t in adaln_unit zero1_unit; do echo "$t passes: $(grep -q "^$t: rc=0 " $S && echo yes || echo no)"; done
        for p in skip root adasize adaslice; do
            echo "planted $p fails (rc 1): $(grep -q "^planted_$p: rc=1 " $S && echo yes || echo no)"
        done
        echo "all checkpoints EQUAL (else: see the train_log lines; DIFFERENT is acceptable only if adaln_unit passes" \
             "and the losses agree within 1e-3): $([ $(grep -c '^checkpoint step 6, .*: EQUAL' $S) = 3 ] && echo yes || echo no)"
        local u1m=$(median_ms t352_ulysses2_main_1 4 10) u2m=$(median_ms t352_ulysses2_main_2 4 10)
        echo "Ulysses 2 at 30,976 faster by > 0.5 ms in both rounds: $(awk -v a=$u1m -v b=$u1n -v c=$u2m -v d=$u2n \
            'BEGIN {print (a + 0 && b + 0 && c + 0 && d + 0 && a - b > 0.5 && c - d > 0.5) ? "yes" : "no"}')"
        local r1m=$(median_ms t352_ring2_main_1 4 10) r1n=$(median_ms t352_ring2_new_1 4 10)
        local r2m=$(median_ms t352_ring2_main_2 4 10) r2n=$(median_ms t352_ring2_new_2 4 10)
        echo "ring 2 at 30,976 not slower (mean of the rounds, new <= main + 0.5 ms): $(awk -v a=$r1m -v b=$r1n -v c=$r2m \
            -v d=$r2n 'BEGIN {print (a + 0 && b + 0 && c + 0 && d + 0 && (b + d) / 2 <= (a + c) / 2 + 0.5) ? "yes" : "no"}')"
        echo "DiT-S not slower by more than its noise (new <= main + the larger IQR): $(awk -v a=$sm -v b=$sn -v q=$qm \
            -v r=$qn 'BEGIN {n = q > r ? q : r; print (a + 0 && b + 0 && b <= a + n) ? "yes" : "no"}')"
        local m1=$(median_ms t352_1gpu_main 4 10)
        echo "1 GPU not slower (new <= main + 0.5 ms; the same code path): $(awk -v a=$m1 -v b=$g1 \
            'BEGIN {print (a + 0 && b + 0 && b <= a + 0.5) ? "yes" : "no"}')"
    } > $O/report.txt 2>&1
    echo "=== summary"; cat $S; echo "=== report"; cat $O/report.txt
    echo "=== tests (tail)"; tail -n 30 $O/tests.log
    rm -rf $L
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash dev/zero_overlap_gpu.sh prepare [DIR] | run [DIR]" >&2; exit 2 ;;
esac
