#!/usr/bin/env bash
# The compile tests under another torch (issue 51: the GPU machines lent here run 2.11; pyproject's
# floor, 2.6, is the oldest that passes them):   bash benchmarks/torch_version.sh VERSION [PYTEST ARGS...]
# Makes .venvs/torch-VERSION once (TORCH_VENVS=DIR puts it elsewhere): torch==VERSION from PyPI (its
# Linux builds carry CUDA libraries, gigabytes, and run on a CPU too) and what the tests need, then
# this checkout installed into it without its dependencies (that torch stays), and runs the compile
# tests there: every method compiled == eager, one graph a step, no recompile
# (tests/test_fast_engine.py), settings as data, fixed addresses, the prefill compiled, the KV
# cache in place (tests/test_gpu_ready.py) and the packed weights (tests/test_compiling.py). The
# venv's pip reads no pip configuration file, so a machine-wide cap on torch versions (this
# project's machines have one) does not apply to it.
set -euo pipefail
VERSION="${1:?usage: bash benchmarks/torch_version.sh VERSION [PYTEST ARGS...]}"
shift
cd "$(dirname "$0")/.."
VENV="${TORCH_VENVS:-.venvs}/torch-$VERSION"
pip_() { PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip "$@"; }
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    pip_ install -q "torch==$VERSION" numpy safetensors pillow tqdm scipy pytest pytest-xdist "transformers>=4.56,<6"
fi
pip_ install -q --no-deps -e .
"$VENV/bin/python" -c "import sys, torch; print('torch', torch.__version__, 'python', sys.version.split()[0])"
# TESTS="tests/x.py::case ..." runs those instead
exec "$VENV/bin/python" -m pytest -p no:cacheprovider ${TESTS:-tests/test_fast_engine.py tests/test_gpu_ready.py tests/test_compiling.py} "$@"
