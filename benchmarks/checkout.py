"""For the benchmark scripts that count an older checkout (its ``src`` first on ``PYTHONPATH``):
this checkout's counting module, when the older one has none or lacks a name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def counting_attr(name: str):
    """``relaxspec.bench.counting.<name>``: the installed (or ``PYTHONPATH``'s) one if it has it,
    else this checkout's."""
    try:
        from relaxspec.bench import counting

        return getattr(counting, name)
    except (ImportError, AttributeError):
        spec = importlib.util.spec_from_file_location(
            "relaxspec_counting", Path(__file__).resolve().parents[1] / "src" / "relaxspec" / "bench" / "counting.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return getattr(module, name)
