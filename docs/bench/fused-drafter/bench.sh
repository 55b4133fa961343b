#!/bin/bash
# usage: bench.sh DRAFTER OUT  -- the README's held-out command, against compiled AR, with one drafter
cd "$(dirname "$0")/../../.."
relaxspec bench --methods ar-compiled,sd,lantern --baseline ar-compiled --compile --classes $(seq -s, 1 4 97) \
    --num-images 100 --threads 1 --drafter-ckpt "$1" --classifier src/relaxspec/embedded/classifier \
    --real-data data/emoji/val.npz --no-plots --no-progress --out "$2"
