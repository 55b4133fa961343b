#!/bin/bash
# The two drafters of docs/BENCHMARKS.md's fused-drafter section, on the embedded model (one thread each,
# run side by side on the two cores; ~55 minutes for 400 steps). The only difference is --fused.
# usage: train.sh OUT   (writes OUT/fused, OUT/plain and their fp16 exports)
set -e
cd "$(dirname "$0")/../../.."
CLASSES=$(python -c "print(' '.join(str(c) for c in range(99) if c % 4 != 1))")  # 1, 5, ..., 97 stay held out
COMMON="--gpt-ckpt src/relaxspec/embedded/gpt --self-samples 6000 --classes $CLASSES --init-from src/relaxspec/embedded/drafter
  --law-loss kl --train-depths 3 --eval-depths 4 --steps 400 --batch-size 32 --lr 3e-4 --warmup-steps 50
  --eval-interval 100 --checkpoint-interval 50 --val-fraction 0.03 --seed 1 --threads 1
  --depth-decay 0.8 --through-depths --feature-weight 0 --noise 0 --no-progress"
relaxspec train-drafter $COMMON --fused --out "$1/fused" --export "$1/fused-fp16" &
relaxspec train-drafter $COMMON --out "$1/plain" --export "$1/plain-fp16" &
wait
# the fused one, on to 800 steps
relaxspec train-drafter --out "$1/fused" --resume --steps 800 --threads 1 --no-progress --export "$1/fused800-fp16"
