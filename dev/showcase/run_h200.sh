#!/usr/bin/env bash
# The loss-curve showcase of issue 7 on one H200, both configs at once (dev/notes_loss_curves.md):
#   fmnist256: depth 6, hidden 384, 6 heads, patch 2, 32x32 Fashion-MNIST (256 tokens), batch 32, 2000 steps
#   long4k:    the same model at 128x128 (Fashion-MNIST upscaled, 4096 tokens), batch 2, 500 steps
# each with train_dit --attn sage (FP8 P·V), sage-fp16, bf16 and sage with FP8 linears (ATTNS), PyTorch bf16 on the same
# stream and two other seeds, all runs concurrently. BIN holds train_dit, libditc.so, make_fashion_mnist and Fashion-MNIST's
# four idx .gz files; LIMIT (s) stops runs still going. The device tool returns at most 8 files,
# so everything but the checkpoints is packed into $OUT/curves.tgz.
#   BIN=.devrun_x LIMIT=200 OUT=... bash dev/showcase/run_h200.sh
set -u
BIN=${BIN:?set BIN to the folder with the binaries and the idx files}
LIMIT=${LIMIT:-200}
ATTNS=${ATTNS:-sage,sage-fp16,bf16,sage+fp8}
OUT=${OUT:-out/showcase}
mkdir -p "$OUT"
export OMP_NUM_THREADS=2 LD_LIBRARY_PATH=$PWD/.devlibs:${LD_LIBRARY_PATH:-}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; cat "$BIN/COMMIT" 2>/dev/null
  python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"; } > "$OUT/gpu.txt" 2>&1
"$BIN/make_fashion_mnist" "$BIN" /dev/shm/fashion-mnist > /dev/null || { echo "make_fashion_mnist failed"; exit 1; }
COMMON="--device cuda --parallel --time-limit $LIMIT --model S --depth 6 --patch 2 --seeds 1,2
        --data /dev/shm/fashion-mnist --train-dit $BIN/train_dit --lib $BIN/libditc.so --attn $ATTNS"
python3 dev/loss_curves.py $COMMON --batch 32 --steps 2000 --smooth 100 --sample-every 2000 \
    --out "$OUT/fmnist256" > "$OUT/fmnist256.log" 2>&1 &
python3 dev/loss_curves.py $COMMON --image-size 128 --batch 2 --steps 500 --smooth 50 --sample-every 500 \
    --out "$OUT/long4k" > "$OUT/long4k.log" 2>&1 &
wait
find "$OUT" -name '*.safetensors' -delete
tar czf "$OUT/curves.tgz" -C "$OUT" gpu.txt fmnist256.log long4k.log fmnist256 long4k
cat "$OUT/gpu.txt"; tail -n 16 "$OUT/fmnist256.log" "$OUT/long4k.log"
