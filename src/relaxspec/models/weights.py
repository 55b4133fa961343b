"""Weights and pixels, for every family: the precisions a target runs in, reading weight files
safely, strict loading with one error that lists every mismatch, relaxspec's own folder format
(``model.safetensors`` + ``config.json``, no pickle), and the image-saving rule.

PyTorch files (official LlamaGen ``.pt`` files, LANTERN's ``.bin`` drafters; REFERENCE §2.3) are
pickles: they are only ever read with ``torch.load(..., weights_only=True)``, which refuses anything
but tensors and plain containers; a file that would need more is refused with a message that says
so, never loaded unsafely. A family's own folder layouts and configs (LANTERN's HF-Llama LlamaGen
folders, a transformers folder) are read by its model module; what they share lives here.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from relaxspec.errors import RelaxspecError

#: The dtypes a target's weights may run in, by the name the commands take.
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The version of relaxspec's folder format (``config.json``'s ``format_version``).
FORMAT_VERSION = 1
#: The keys under which PyTorch checkpoints commonly nest their state dict.
CONTAINER_KEYS = ("model", "module", "state_dict")


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (one-line error when it is not one)."""
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001
        raise RelaxspecError(f"{path}: not a readable safetensors file ({err})") from None


@dataclass
class LoadedState:
    """A state dict and how it was stored (``layout``: "model", "module", "state_dict", "raw",
    "safetensors", "relaxspec", or a family's own folder layout such as LlamaGen's "lantern").
    "relaxspec" (and a family's folder layout) carries its config."""

    state_dict: dict[str, torch.Tensor]
    layout: str
    config: dict | None = None  # our own format carries its config
    kind: str | None = None
    meta: dict | None = None  # the whole config.json of our format (class names, provenance)


def _unpickling_error(path: Path, err: Exception, zip_file: bool) -> RelaxspecError:
    """Say why ``weights_only=True`` rejected a file: it holds objects that only code execution
    could build (refused), or its bytes are no PyTorch checkpoint at all. A zip-format
    ``torch.save`` file whose pickle is rejected is always the first case."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    found = re.search(r"GLOBAL (\S+)", text)
    detail = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", text, re.S)
    reason = " ".join((detail.group(1) if detail else text.splitlines()[0]).split())
    if found or zip_file:
        what = f"the file holds {found.group(1)}, which" if found else f"its pickle ({reason}) is something that"
        return RelaxspecError(
            f"{path}: refusing to load: {what} only an unsafe unpickling (one that can run arbitrary code) "
            f"could build. Save only the weights (torch.save(model.state_dict(), ...)) or convert the file "
            f"to safetensors."
        )
    return RelaxspecError(f"{path}: not a PyTorch checkpoint that can be loaded safely ({reason})")


def _torch_load(path: Path) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise _unpickling_error(path, err, zip_file=True) from None
    except RuntimeError as err:
        if "mmap" in str(err) or "zip" in str(err).lower():
            try:  # legacy (non-zip) torch.save files cannot be memory-mapped
                return torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as err2:
                raise _unpickling_error(path, err2, zip_file=False) from None
            except Exception as err2:  # noqa: BLE001 - any failure here means "not a checkpoint"
                raise RelaxspecError(f"{path}: not a readable PyTorch checkpoint ({type(err2).__name__}: {err2})") from None
        raise RelaxspecError(f"{path}: not a readable PyTorch checkpoint ({err})") from None
    except Exception as err:  # noqa: BLE001
        raise RelaxspecError(f"{path}: not a readable PyTorch checkpoint ({type(err).__name__}: {err})") from None


ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default format since torch 1.6
PICKLE_PROTO = b"\x80"  # the PROTO opcode every pickle of protocol >= 2 (legacy torch.save) starts with


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    """safetensors: an 8-byte little-endian header length, then the JSON header."""
    return len(head) > 9 and 0 < int.from_bytes(head[:8], "little") <= size - 8 and head[8:9] == b"{"


def _what_it_is(head: bytes) -> str:
    """A few words on what a file that no loader recognises is, from its first bytes."""
    text = None
    for cut in range(4):  # the sample may end inside a multi-byte character
        try:
            text = head[: len(head) - cut].decode("utf-8")
            break
        except UnicodeDecodeError:
            continue
    if text is not None and all(c.isprintable() or c in "\t\r\n" for c in text):
        start = " ".join(text.split())[:32]
        return f"it is a text file (starting {start!r})" if start else "it is a text file (blank)"
    return f"its bytes (starting {head[:4].hex(' ')}) are no known format"


def _is_state_dict(obj: object) -> bool:
    return isinstance(obj, dict) and len(obj) > 0 and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    )


def read_folder(path: Path, what: str = "a relaxspec model folder") -> LoadedState:
    """One of our folders (``config.json`` with its ``kind`` and ``config``, and
    ``model.safetensors``), each failure one line naming the file; ``what`` the folder is called
    in them."""
    config_file, weights = path / "config.json", path / "model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise RelaxspecError(f"{path}: {what} needs config.json and model.safetensors")
    try:
        meta = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RelaxspecError(f"{config_file}: unreadable config ({err})") from None
    if not isinstance(meta, dict) or "kind" not in meta or "config" not in meta:
        raise RelaxspecError(f"{config_file}: not a relaxspec config (needs 'kind' and 'config')")
    return LoadedState(load_safetensors(weights), "relaxspec", meta["config"], meta["kind"], meta)


def read_state(path: str | Path) -> LoadedState:
    """Read weights from a PyTorch file (``.pt``/``.pth``/``.bin``, only ever with
    ``weights_only=True``), a ``.safetensors`` file, or one of our folders, without building a
    model. A family's own folder layouts (LANTERN's HF-Llama LlamaGen) are read by its module
    (:func:`relaxspec.models.llamagen.checkpoints.read_llamagen_state`)."""
    path = Path(path)
    if not path.exists():
        raise RelaxspecError(f"{path}: no such file or folder")
    if path.is_dir():
        return read_folder(path)
    if not path.is_file():
        raise RelaxspecError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as handle:
            head = handle.read(512)
    except OSError as err:
        raise RelaxspecError(f"{path}: cannot read ({err.strerror})") from None
    if path.suffix == ".safetensors" or _looks_like_safetensors(head, path.stat().st_size):
        return LoadedState(load_safetensors(path), "safetensors")
    if not head:
        raise RelaxspecError(f"{path}: the file is empty")
    if not (head.startswith(ZIP_MAGIC) or head[:1] == PICKLE_PROTO):
        raise RelaxspecError(f"{path}: not a readable checkpoint: {_what_it_is(head)}, not a PyTorch file (a zip "
                             "archive or a pickle), a .safetensors file or a relaxspec model folder")
    obj = _torch_load(path)
    if isinstance(obj, dict):
        for key in CONTAINER_KEYS:
            if key in obj and _is_state_dict(obj[key]):
                return LoadedState(dict(obj[key]), key)
        if _is_state_dict(obj):
            return LoadedState(dict(obj), "raw")
    raise RelaxspecError(
        f"{path}: no state dict found (expected a dict of tensors, or one under one of the keys {CONTAINER_KEYS})"
    )


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


def save_model(model: torch.nn.Module, folder: str | Path, *, kind: str | None = None,
               dtype: torch.dtype | None = None, extra: dict | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (``kind``: what the model is, e.g. "gpt",
    "vq", "drafter", "classifier", by default the model's own ``checkpoint_kind``; its ``config``
    dataclass; its class names, if it has them)."""
    if kind is None:
        kind = getattr(model, "checkpoint_kind", None)  # a family's model classes declare it
    if kind is None:
        raise ValueError("save_model needs kind= for this module")
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


__all__ = ["CONTAINER_KEYS", "FORMAT_VERSION", "PRECISIONS", "LoadedState", "load_safetensors", "load_strict",
           "read_state", "save_model", "to_uint8"]
