#!/usr/bin/env bash
# Everything docs/BENCHMARKS.md reports for a GPU, in one command, on a machine with a CUDA build
# of torch (nothing is downloaded):  bash benchmarks/gpu.sh [OUT] [PARTS]   (default OUT: gpu-results)
# With PARTS (e.g. "janus", "emu3" or "lumina": the transformers families at their real shapes, each its own
# call of under ten minutes on an H100) only benchmarks/gpu.py --parts PARTS runs; PARTS "tune" runs
# relaxspec tune --lossless on GPT-XL-shaped official-layout files (random weights, an untrained drafter) and
# records what it picks (OUT/tune-xl: tune.json or the closest setting, report.md, settings.csv).
#   1. the test suite, with the engine's CUDA-specific paths exercised by benchmarks/gpu.py
#   2. benchmarks/gpu.py --device cuda: greedy equality on CUDA (eager, compiled, vs AR),
#      GPT-XL bf16 AR eager/compiled, forward costs 1..64 tokens, per-step engine overhead,
#      the embedded model's speed-ups
# GPU_BUDGET=SECONDS bounds step 2 (items past it are recorded as skipped, eager checks and costs first) and
# GPU_TESTS=0 leaves out step 1 (no test touches CUDA; CI runs them): what a 15-minute lease affords.
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
from relaxspec.models.llamagen.checkpoints import load_gpt, save_model
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
if [ -n "$PARTS" ]; then
    python benchmarks/gpu.py --device cuda --out "$OUT" --parts "$PARTS" 2>&1 | tee "$OUT/gpu-$PARTS.log"
    exit 0
fi
if [ "${GPU_TESTS:-1}" = "0" ]; then
    echo "tests left out (GPU_TESTS=0)" | tee "$OUT/tests.txt"
elif python -c "import pytest" 2>/dev/null; then
    python -m pytest -q -x 2>&1 | tail -5 | tee "$OUT/tests.txt"
else
    echo "pytest not installed on this machine: tests skipped" | tee "$OUT/tests.txt"
fi
python benchmarks/gpu.py --device cuda --out "$OUT" --budget "${GPU_BUDGET:-3600}" 2>&1 | tee "$OUT/gpu.log"
