"""The embedded default model: a small LlamaGen-architecture VQ tokenizer, c2i target and EAGLE
drafter trained by relaxspec's own recipes on colour emoji (see MODEL_CARD.md beside this file).

``relaxspec generate`` with no checkpoint options uses it, with the decoding method and sampling
settings recorded in ``defaults.json`` (chosen from the benchmark the model card reports).
"""

from __future__ import annotations

import json
from pathlib import Path

from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.checkpoints import load_gpt, load_vq
from relaxspec.drafting.eagle import load_drafter

ROOT = Path(__file__).resolve().parent
PARTS = {"gpt": ROOT / "gpt", "vq": ROOT / "vq", "drafter": ROOT / "drafter", "classifier": ROOT / "classifier"}
DEFAULTS_FILE = ROOT / "defaults.json"


def path(part: str) -> Path:
    """The folder of one part ("gpt", "vq", "drafter", "classifier"); a clear error if it is not
    shipped in this copy of relaxspec."""
    folder = PARTS[part]
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise RelaxspecError(f"the embedded model's {part} is not in this installation ({folder}); "
                             "pass your own checkpoints (--gpt-ckpt / --vq-ckpt / --drafter-ckpt)")
    return folder


def available(part: str = "gpt") -> bool:
    try:
        path(part)
        return True
    except RelaxspecError:
        return False


def defaults() -> dict:
    """Sampling and method defaults for the embedded model: ``{"sampling": {...}, "method": {...},
    "classes": "..."}`` (empty dict when not shipped)."""
    if not DEFAULTS_FILE.is_file():
        return {}
    return json.loads(DEFAULTS_FILE.read_text())


def load(device="cpu", precision: str = "fp32", with_drafter: bool = True):
    """``(target, vq, drafter)``; the drafter is ``None`` if not shipped or not asked for."""
    target = load_gpt(path("gpt"), precision=precision, device=device)
    vq = load_vq(path("vq"), device=device)
    drafter = load_drafter(path("drafter"), target) if with_drafter and available("drafter") else None
    return target, vq, drafter
