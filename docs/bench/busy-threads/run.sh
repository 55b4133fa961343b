#!/usr/bin/env bash
# Issue 54, item 1: a run's default CPU threads on a machine whose cores are all busy.
# Starts one busy torch process per core (hog.py), then times, alternating, the README's
# make-test-checkpoints follow-up (2 images at 256 px) and a drafter training's start
# (train-drafter --steps 0, 8 self-samples) three ways: the new default (no --threads), one
# thread, and what ran before (torch's default of a thread a core, OpenMP's default wait policy:
# OMP_WAIT_POLICY set empty, which the launcher leaves alone and libgomp reads as unset).
# Usage: bash docs/bench/busy-threads/run.sh OUT_DIR   (writes OUT_DIR/times.txt)
set -euo pipefail
out=$(realpath -m "${1:?usage: run.sh OUT_DIR}")
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out" && cd "$out"
[ -f demo-ckpt/gpt.pt ] || relaxspec make-test-checkpoints --out demo-ckpt > /dev/null
files="--gpt-ckpt demo-ckpt/gpt.pt --gpt-model demo-ckpt/gpt.json --vq-ckpt demo-ckpt/vq.pt --vq-model demo-ckpt/vq.json --image-size 256"
hogs=()
for _ in $(seq "$(nproc)"); do python "$here/hog.py" & hogs+=($!); done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
sleep 2
: > times.txt
for round in 1 2 3; do
  for way in new one before; do
    case $way in
      new) env=(); threads=();;
      one) env=(); threads=(--threads 1);;
      before) env=(OMP_WAIT_POLICY=); threads=(--threads "$(nproc)");;
    esac
    rm -rf g d
    start=$(date +%s.%N)
    env "${env[@]}" relaxspec generate $files --classes 207,360 --no-progress "${threads[@]}" --out g > /dev/null 2>&1
    mid=$(date +%s.%N)
    env "${env[@]}" relaxspec train-drafter $files --self-samples 8 --steps 0 --no-progress "${threads[@]}" --out d > /dev/null 2>&1
    end=$(date +%s.%N)
    echo "$round $way generate $(echo "$mid - $start" | bc) train-drafter $(echo "$end - $mid" | bc)" | tee -a times.txt
  done
done
