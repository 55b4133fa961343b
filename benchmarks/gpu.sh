#!/usr/bin/env bash
# Everything docs/BENCHMARKS.md reports for a GPU, on a machine with a CUDA build of torch and the
# packages it comes with (nothing is downloaded; no test extra needed):
#     bash benchmarks/gpu.sh [OUT] [PARTS]     (default OUT: gpu-results, PARTS: checks,xl)
# The default fits one 600-second call, compiles included: benchmarks/gpu.py's checks on the device
# (greedy eager and compiled tokens) and GPT-XL's compiled steps (ar, sd-chain, zipar, gsd, lantern:
# ms a step, MAL, the step in compiled AR steps, CUDA-graph recordings / re-recordings / skips and
# graphs compiled), written to OUT/gpu.json and OUT/gpu.md after every item, so a cut run still
# reports. GPU_BUDGET=SECONDS (default 540) bounds it: items past it are recorded as skipped.
# PARTS "heldout" (first, e.g. "heldout,checks") runs the README's held-out command on the device
# (compiled, 100 images of the 25 held-out classes, against compiled AR; data/emoji, built or
# copied there, gives its quality columns) and packs its folder into OUT/bench-heldout.tgz.
# PARTS "embedded", "janus", "emu3" or "lumina" run those parts of gpu.py (each its own call: the
# transformers families at their real shapes take most of ten minutes each); PARTS "tune" runs
# relaxspec tune --lossless on GPT-XL-shaped official-layout files (random weights, an untrained
# drafter) and records what it picks (OUT/tune-xl: tune.json or the closest setting, report.md,
# settings.csv). GPU_TESTS=1 first runs the engine's compile tests with the machine's pytest (they
# need no test extra; minutes).
set -euo pipefail
python() { "${PYTHON:-$(type -P python3 || type -P python)}" "$@"; }  # the GPU image has python3 alone
cd "$(dirname "$0")/.."
OUT="${1:-gpu-results}"
PARTS="${2:-}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/device.txt" || true
if [ "$PARTS" = "tune" ]; then
    XL="$OUT/xl-files"
    GPT="${TUNE_GPT:-GPT-XL}"  # TUNE_GPT=GPT-B TUNE_SIZE=64 for a quick try of the script on a CPU
    SIZE="${TUNE_SIZE:-256}"
    DEVICE="${TUNE_DEVICE:-cuda}"
    python -m relaxspec.cli make-test-checkpoints --gpt-model "$GPT" --vq-model VQ-16 --image-size "$SIZE" --out "$XL"
    python - "$XL" "$GPT" "$SIZE" <<'PY'
import sys, torch
from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.models.llamagen.checkpoints import load_gpt
from relaxspec.models.weights import save_model
folder, name, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = load_gpt(f"{folder}/gpt.pt", name, image_size=size)
torch.manual_seed(0)
save_model(EagleDrafter.for_target(target), f"{folder}/drafter", kind="drafter")
PY
    set +e
    python -m relaxspec.cli tune --gpt-ckpt "$XL/gpt.pt" --gpt-model "$GPT" --vq-ckpt "$XL/vq.pt" --vq-model VQ-16 \
        --image-size "$SIZE" --drafter-ckpt "$XL/drafter" --device "$DEVICE" --precision bf16 --lossless \
        --minutes "${TUNE_MINUTES:-6}" --out "$OUT/tune-xl" 2>&1 | tee "$OUT/tune-xl.log"
    exit 0
fi
if [ "${GPU_TESTS:-0}" = "1" ]; then
    python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_gpu_ready.py tests/test_fast_engine.py 2>&1 \
        | tail -5 | tee "$OUT/tests.txt" || true
fi
export PYTHONUNBUFFERED=1
PARTS="${PARTS:-checks,xl}"
python benchmarks/gpu.py --device cuda --out "$OUT" --parts "$PARTS" --budget "${GPU_BUDGET:-540}" 2>&1 \
    | tee "$OUT/gpu-${PARTS//,/-}.log"
for folder in "$OUT"/bench-heldout*/; do  # the held-out bench's folders, one file each (records, summary, images)
    if [ -d "$folder" ]; then tar czf "${folder%/}.tgz" -C "$OUT" "$(basename "$folder")" && rm -rf "$folder"; fi
done
