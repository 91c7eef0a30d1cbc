#!/usr/bin/env bash
# The EMA fused into the AdamW pass (branch adamw-ema), on one H200 in one device call:
# the optimizer test, the step-graph test, train_dit checkpoints against main's build (byte-equal
# expected: the EMA's roundings are main's, spelled out), configs a and c timed against main.
#   here:  bash dev/adamw_ema_gpu.sh prepare      (fills /work/main/.devrun_ema)
#   there: run(command="bash .devrun_ema/adamw_ema_gpu.sh run", kind="nvidia-h200",
#              carry=[".devrun_ema", ".devlibs"], timeout_s=110)
set -uo pipefail
if [ "${1:-}" = prepare ]; then
    set -e
    D=/work/main/.devrun_ema
    make -j2 train_dit build/test_layers_cuda build/test_step_graph_cuda
    rm -rf $D && mkdir -p $D
    cp train_dit build/test_layers_cuda build/test_step_graph_cuda dev/adamw_ema_gpu.sh $D/
    cp /work/main/train_dit $D/train_dit_main
    strip $D/train_dit $D/train_dit_main $D/test_layers_cuda $D/test_step_graph_cuda
    { git rev-parse HEAD; git -C /work/main rev-parse HEAD; } > $D/commit.txt
    du -sh $D; exit 0
fi
D=.devrun_ema; L=/tmp/ema; rm -rf $L; mkdir -p $L; S=$OUT/summary.txt; : > $S
export LD_LIBRARY_PATH=$PWD/.devlibs:${LD_LIBRARY_PATH:-}
say() { echo "$*" >> $S; }
say "adamw_ema_gpu.sh, $(date -u), branch/main: $(tr '\n' ' ' < $D/commit.txt)"
timeout -k 3 60 $D/test_layers_cuda --filter 'cuda/optimizer' > $L/t1.log 2>&1; say "test_layers_cuda optimizer rc=$? $(grep Synthesis $L/t1.log)"
timeout -k 3 60 $D/test_step_graph_cuda > $L/t2.log 2>&1; say "test_step_graph_cuda rc=$? $(grep Synthesis $L/t2.log)"
B="--device gpu --deterministic --ckpt-every 3 --steps 6 --model S --batch 8 --data synthetic --seed 3 --sample-every 0"
for g in on off; do
    timeout -k 3 40 $D/train_dit $B --cuda-graph $g --out $L/new_$g > $L/new_$g.log 2>&1
    timeout -k 3 40 $D/train_dit_main $B --cuda-graph $g --out $L/main_$g > $L/main_$g.log 2>&1
    for c in 000003 000006; do
        cmp -s $L/new_$g/ckpt_$c.safetensors $L/main_$g/ckpt_$c.safetensors && r=EQUAL || r=DIFFERENT
        say "checkpoint $c, cuda-graph $g: new vs main $r"
    done
done
find $L -name '*.safetensors' -delete
med() { awk -F, 'NR>1 && $1>=4 {print $5}' $1/train_log.csv | sort -g | awk '{v[NR]=$1} END{print v[int((NR+1)/2)]}'; }
A="--device gpu --data synthetic --image-size 32 --patch 2 --hidden 768 --depth 12 --heads 12 --batch 64 --attn sage --steps 30 --ckpt-every 0 --sample-every 0 --seed 1"
C="--device gpu --data synthetic --model S --hidden 2048 --heads 16 --depth 4 --batch 1 --image-size 256 --attn sage --steps 14 --ckpt-every 0 --sample-every 0 --seed 1"
for r in 1 2; do
    for v in main new; do
        bin=$D/train_dit; [ $v = main ] && bin=$D/train_dit_main
        [ $r = 1 ] && { timeout -k 3 40 $bin $A --out $L/a_${v}_$r > /dev/null 2>&1; say "a $v round $r: $(med $L/a_${v}_$r) ms"; }
        timeout -k 3 40 $bin $C --out $L/c_${v}_$r > /dev/null 2>&1; say "c $v round $r: $(med $L/c_${v}_$r) ms"
    done
done
cat $S
