"""Weights and pixels, for every family: the precisions a target runs in, strict loading with one
error that lists every mismatch, relaxspec's own folder format (``model.safetensors`` +
``config.json``, no pickle), and the image-saving rule.

A family's own file formats (LlamaGen's official ``.pt`` files, a transformers folder) are read by
its model module; what they share lives here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from relaxspec.errors import RelaxspecError

#: The dtypes a target's weights may run in, by the name the commands take.
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The version of relaxspec's folder format (``config.json``'s ``format_version``).
FORMAT_VERSION = 1


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (one-line error when it is not one)."""
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001
        raise RelaxspecError(f"{path}: not a readable safetensors file ({err})") from None


def load_strict(module: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict(strict=True)`` with one error that lists every missing key, unexpected
    key and shape mismatch."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    shapes = sorted(
        f"{k}: file {tuple(state_dict[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(expected) & set(state_dict)
        if tuple(state_dict[k].shape) != tuple(expected[k].shape)
    )
    problems = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise RelaxspecError(f"{source}: weights do not fit the model; " + "; ".join(problems))
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in state_dict.items()}, strict=True)


def save_folder(model: torch.nn.Module, folder: str | Path, *, kind: str, dtype: torch.dtype | None = None,
                extra: dict | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (``kind``: what the model is, e.g. "gpt",
    "vq", "drafter", "classifier"; its ``config`` dataclass; its class names, if it has them)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
             for k, v in model.state_dict().items()}
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else dataclasses.asdict(model.config)
    save_file(state, str(folder / "model.safetensors"))
    names = getattr(model, "class_names", None)  # a named model stays named when saved again
    meta = {"format_version": FORMAT_VERSION, "kind": kind, "config": config,
            **({"class_names": list(names)} if names else {}), **(extra or {})}
    (folder / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Decoder output ``[B, 3, H, W]`` in ``[-1, 1]`` -> ``uint8 [B, H, W, 3]``.

    Upstream LlamaGen's saving rule (REFERENCE §2.3): ``clamp(127.5 x + 128, 0, 255)`` then a plain
    cast, which truncates, so -1 -> 0 (0.5 truncates), 0 -> 128, 1 -> 255 (255.5 clamps). Computed
    in float32 so half-precision decoder output rounds the same way; stays on the input's device.
    """
    if images.ndim != 4:
        raise RelaxspecError(
            f"to_uint8 expects images [batch, C, H, W], got shape {tuple(images.shape)}."
        )
    pixels = torch.clamp(127.5 * images.float() + 128.0, 0, 255)
    return pixels.permute(0, 2, 3, 1).to(torch.uint8)


__all__ = ["FORMAT_VERSION", "PRECISIONS", "load_safetensors", "load_strict", "save_folder", "to_uint8"]
