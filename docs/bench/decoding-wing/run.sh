#!/bin/bash
# Held-out before (2f46d7b, /work/base) and after (/work/main), one core each, at the same time.
ARGS="--methods ar,ar-compiled,lantern,sd --sweep lantern:record_tv=true,false --compile --classes $(seq -s, 1 4 97) --num-images 100 --threads 1 --classifier src/relaxspec/embedded/classifier --real-data data/emoji/val.npz --no-plots"
(cd /work/base && PYTHONPATH=/work/base/src taskset -c 0 python -m relaxspec bench $ARGS --out /work/heldout52/before > /work/heldout52/before.log 2>&1) &
(cd /work/main && taskset -c 1 python -m relaxspec bench $ARGS --out /work/heldout52/after > /work/heldout52/after.log 2>&1) &
wait
for side in before after; do
  cp /work/heldout52/$side/summary.md /work/heldout52/$side-vs-ar.md
  cd /work/main && python -m relaxspec bench --report-only --baseline ar-compiled --out /work/heldout52/$side --classifier src/relaxspec/embedded/classifier --real-data data/emoji/val.npz --no-plots > /work/heldout52/$side-report.log 2>&1
  cp /work/heldout52/$side/summary.md /work/heldout52/$side-vs-compiled-ar.md
done
echo done
