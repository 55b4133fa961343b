#!/usr/bin/env bash
# Everything docs/BENCHMARKS.md reports for a GPU, in one command, on a machine with a CUDA build
# of torch (nothing is downloaded):  bash benchmarks/gpu.sh [OUT] [PARTS]   (default OUT: gpu-results)
# With PARTS (e.g. "janus", "emu3" or "lumina": the transformers families at their real shapes, each its own
# call of under ten minutes on an H100) only benchmarks/gpu.py --parts PARTS runs.
#   1. the test suite, with the engine's CUDA-specific paths exercised by benchmarks/gpu.py
#   2. benchmarks/gpu.py --device cuda: greedy equality on CUDA (eager, compiled, vs AR),
#      GPT-XL bf16 AR eager/compiled, forward costs 1..64 tokens, per-step engine overhead,
#      the embedded model's speed-ups
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-results}"
PARTS="${2:-}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/device.txt" || true
if [ -n "$PARTS" ]; then
    python benchmarks/gpu.py --device cuda --out "$OUT" --parts "$PARTS" 2>&1 | tee "$OUT/gpu-$PARTS.log"
    exit 0
fi
if python -c "import pytest" 2>/dev/null; then
    python -m pytest -q -x 2>&1 | tail -5 | tee "$OUT/tests.txt"
else
    echo "pytest not installed on this machine: tests skipped" | tee "$OUT/tests.txt"
fi
python benchmarks/gpu.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/gpu.log"
