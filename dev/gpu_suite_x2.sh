#!/usr/bin/env bash
# Everything on the two-GPU machine, in two device calls (nvidia-h200-x2; carry .devrun and .devlibs
# from `bash dev/devrun_prepare.sh`), logs (without checkpoints) tarred into $OUT/logs.tgz every
# 15 s (a cut call still returns them), the summaries printed at the end:
#   multi:  the multi-GPU suites on both GPUs, then dev/bench_sp.sh (1 GPU vs Ulysses 2 vs ring 2 at
#           16K and 31K tokens, and the bytes per step from NCCL's log);
#   single: the single-GPU suites on GPU 1 (in a copy of the tree, so that their ./train_dit does not
#           clash) beside the benchmarks on GPU 0: bench_step a,b,c,d --compile, bench_attention,
#           bench_flash, profile_step c,a.
#   run(command="bash dev/gpu_suite_x2.sh multi", kind="nvidia-h200-x2", carry=[".devrun", ".devlibs"], timeout_s=400)
#   run(command="bash dev/gpu_suite_x2.sh single", kind="nvidia-h200-x2", carry=[".devrun", ".devlibs"], timeout_s=420)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
part=${1:-}
L=/tmp/L_$part; rm -rf $L; mkdir -p $L; T0=$SECONDS   # (a warm machine keeps /tmp between calls)
pack() {   # the text logs only (the device tool brings back files of at most 16 MiB)
    ( cd /tmp && find L_$part -type f \( -name '*.log' -o -name '*.txt' -o -name '*.csv' -o -name '*.md' \
        -o -name '*.json' \) -size -8M | tar czf $OUT/logs.tmp.tgz -T - ) 2>/dev/null && mv $OUT/logs.tmp.tgz $OUT/logs.tgz
}
( while true; do pack; sleep 15; done ) &
TAR=$!
t() { echo "$1 at $((SECONDS - T0)) s" >> $L/times.txt; }
t start
if [ "$part" = multi ]; then
    BIN=.devrun LOGS=$L/multi timeout 200 bash dev/gpu_suite.sh multi > $L/multi_out.txt 2>&1; echo "multi rc=$?" >> $L/times.txt; t multi_done
    BIN=.devrun LOGS=$L/sp DEADLINE=$(( $(date +%s) + 200 )) bash dev/bench_sp.sh > $L/bench_sp.log 2>&1; t bench_sp_done
    kill $TAR; pack; cat $L/times.txt; grep -E "Synthesis|FAIL|launchers" $L/multi_out.txt; cat $L/bench_sp.log
elif [ "$part" = single ]; then
    mkdir -p /tmp/tree2 && cp -r dev test .devrun .devlibs /tmp/tree2/   # the tests' own ./train_dit copy
    ( cd /tmp/tree2 && CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=8 BIN=.devrun LOGS=$L/tests timeout 200 bash dev/gpu_suite.sh tests > $L/tests_out.txt 2>&1; echo "tests rc=$?" >> $L/times.txt; t tests_done ) &
    TESTS=$!
    cp .devrun/train_dit .
    export CUDA_VISIBLE_DEVICES=0
    python3 dev/bench_step.py --configs a,b,c,d --compile --fp8 > $L/bench_step.log 2>&1; t bench_step_done
    python3 dev/bench_attention.py .devrun/libsage_bench.so > $L/bench_sage.log 2>&1; t bench_sage_done
    python3 dev/bench_flash.py .devrun/libflash_bench.so > $L/bench_flash.log 2>&1; t bench_flash_done
    python3 dev/profile_step.py --configs c,a --steps 8 --fp8 --lib .devrun/libkernel_times.so > $L/profile_step.log 2>&1; t profile_done
    wait $TESTS
    kill $TAR; pack; cat $L/times.txt; grep -E "Synthesis|FAIL" $L/tests_out.txt
    for f in bench_step bench_sage bench_flash profile_step; do echo "=== $f"; tail -c 2500 $L/$f.log; done
else
    kill $TAR; echo "usage: bash dev/gpu_suite_x2.sh multi|single" >&2; exit 2
fi
