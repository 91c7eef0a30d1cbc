#!/usr/bin/env bash
# Every GPU test and benchmark in one go, for the GPU machine: the Criterion suites test_*_cuda,
# then the attention benchmarks and the train_dit-vs-PyTorch step time. Logs go to LOGS (default
# ./gpu_logs). BIN holds the prebuilt binaries and benchmark libraries (default build/); the
# machine has no Criterion, so its runtime libraries come in LIBS (default .devlibs).
#   BIN=build LOGS=/tmp/logs bash dev/gpu_suite.sh [tests|bench|all]
# The device tool brings back at most 8 files from $OUT: keep the logs elsewhere and pack them,
#   BIN=.devrun LOGS=/tmp/logs bash dev/gpu_suite.sh all; tar czf $OUT/logs.tgz -C /tmp/logs .
#   BIN=build LOGS=/tmp/logs bash dev/gpu_suite.sh multi     # on 2+ GPUs: the NCCL tests, one at a time
# (One GPU: the multi-GPU tests skip. `multi` sets NCCL_NVLS_ENABLE=0 and finds libnccl in
# PyTorch's nvidia-nccl wheel when the system has none.)
set -uo pipefail
BIN=${BIN:-build}; LOGS=${LOGS:-gpu_logs}; LIBS=${LIBS:-.devlibs}; what=${1:-all}
mkdir -p "$LOGS"
export LD_LIBRARY_PATH="$PWD/$LIBS:${LD_LIBRARY_PATH:-}"
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$LOGS/gpu.txt"
date -u | tee -a "$LOGS/gpu.txt"
if [ "$what" = multi ]; then
    export NCCL_NVLS_ENABLE=0
    nccl_dir=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
    [ -n "$nccl_dir" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nccl_dir"
    for t in "$BIN"/test_sequence_parallel_cuda "$BIN"/test_distributed_cuda "$BIN"/test_sp_model_cuda; do
        [ -x "$t" ] || continue
        echo "== $t" | tee -a "$LOGS/multi.log"
        timeout 400 "$t" --jobs 1 --verbose 2>&1 | tee -a "$LOGS/multi.log" | grep -E "Synthesis|FAIL|Assertion" || status=1
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    # the launchers: 3 deterministic steps on 2 GPUs started by `--gpus 2` and by mpirun must
    # write the same checkpoint (rank, world and local rank from Open MPI's environment)
    if [ -x "$BIN/train_dit" ] && command -v mpirun > /dev/null; then
        run="--device gpu --data synthetic --model S --batch 8 --steps 3 --ckpt-every 3 --sample-every 0 --seed 3 --deterministic"
        timeout 120 "$BIN/train_dit" $run --gpus 2 --out "$LOGS/launch_gpus" > "$LOGS/launch_gpus.log" 2>&1
        timeout 120 mpirun -np 2 --allow-run-as-root -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE "$BIN/train_dit" $run \
            --out "$LOGS/launch_mpirun" > "$LOGS/launch_mpirun.log" 2>&1
        if cmp -s "$LOGS/launch_gpus/ckpt_000003.safetensors" "$LOGS/launch_mpirun/ckpt_000003.safetensors"; then
            echo "launchers: --gpus 2 and mpirun -np 2 wrote the same checkpoint" | tee -a "$LOGS/multi.log"
        else
            echo "launchers: FAIL (see launch_gpus.log, launch_mpirun.log)" | tee -a "$LOGS/multi.log"; status=1
        fi
        rm -f "$LOGS"/launch_gpus/ckpt_* "$LOGS"/launch_mpirun/ckpt_*   # 0.5 GB: too big to bring back
    fi
    exit $status
fi
if [ "$what" != bench ]; then
    if [ -x "$BIN/train_dit" ]; then   # train_dit on the GPU against PyTorch in fp32 on the GPU
        cp "$BIN/train_dit" .
        python3 dev/parity.py --gpu > "$LOGS/parity_gpu.log" 2>&1 || status=1
        tail -1 "$LOGS/parity_gpu.log"
    fi
    for t in "$BIN"/test_*_cuda; do
        echo "== $t" | tee -a "$LOGS/tests.log"
        "$t" --jobs 4 2>&1 | tee -a "$LOGS/tests.log" | grep -E "Synthesis|FAIL|Assertion" || status=1
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
fi
if [ "$what" != tests ]; then
    [ -f "$BIN/libsage_bench.so" ] && python3 dev/bench_attention.py "$BIN/libsage_bench.so" 2>&1 | tee "$LOGS/bench_sage.log"
    [ -f "$BIN/libflash_bench.so" ] && python3 dev/bench_flash.py "$BIN/libflash_bench.so" 2>&1 | tee "$LOGS/bench_flash.log"
    if [ -x "$BIN/train_dit" ]; then
        cp "$BIN/train_dit" .
        python3 dev/bench_step.py --configs a,b,c,d --compile --fp8 2>&1 | tee "$LOGS/bench_step.log"
        [ -f "$BIN/libkernel_times.so" ] && python3 dev/profile_step.py --configs c,a --steps 8 \
            --lib "$BIN/libkernel_times.so" 2>&1 | tee "$LOGS/profile_step.log"
    fi
fi
exit $status
