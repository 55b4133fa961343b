"""What every training recipe shares: resumable checkpoints, schedules, logging, the device.

A run writes into one folder ``out``:

* ``model.safetensors`` + ``config.json`` — the weights other commands load (our format);
* ``train_state.pt`` — what ``--resume`` loads: weights, optimizer, step, RNG, config, history.
  It holds only tensors, numbers, strings, lists and dicts, so it loads with
  ``torch.load(..., weights_only=True)`` (REFERENCE §2.3: a pickle can run code);
* ``metrics.jsonl`` — one JSON line per evaluation.

Every file is replaced atomically (written beside, then ``os.replace``), so an interrupted run
leaves the previous consistent checkpoint. A resumed run must keep its recipe: only the fields a
recipe names as run fields (length, output, device, progress ...) may change, or the
continuation would not be the run it claims to be.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from relaxspec.models.llamagen.checkpoints import save_model
from relaxspec.errors import RelaxspecError

TRAIN_STATE = "train_state.pt"
METRICS = "metrics.jsonl"


# ------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------


def publish_model(out: str | Path, model: torch.nn.Module, *, kind: str | None = None, extra: dict | None = None,
                  dtype: torch.dtype | None = None, name: str = "") -> Path:
    """Write ``model`` as ``out/name/model.safetensors`` + ``config.json`` (via :func:`save_model`),
    replacing each file atomically."""
    folder = Path(out) / name if name else Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / ".checkpoint.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    save_model(model, staging, kind=kind, dtype=dtype, extra=extra)
    for file in ("model.safetensors", "config.json"):
        os.replace(staging / file, folder / file)
    shutil.rmtree(staging, ignore_errors=True)
    return folder


def save_train_state(out: str | Path, state: dict) -> None:
    """``torch.save(state, out/train_state.pt)`` atomically. ``state`` must hold only what
    ``weights_only=True`` loads (tensors, numbers, strings, lists, dicts)."""
    path = Path(out) / TRAIN_STATE
    tmp = path.with_name(TRAIN_STATE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def read_train_state(out: str | Path, version: int, what: str) -> dict:
    """``out/train_state.pt``, loaded with ``weights_only=True``; ``what`` names the recipe in the
    error for a file of another recipe or version."""
    path = Path(out) / TRAIN_STATE
    if not path.is_file():
        raise RelaxspecError(f"{path}: no training state to resume from")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure means "not our training state"
        raise RelaxspecError(f"{path}: not a readable training state ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict) or state.get("format_version") != version or state.get("recipe", what) != what:
        raise RelaxspecError(f"{path}: not a relaxspec {what} training state (version {version})")
    return state


def check_fresh_or_resume(out: str | Path, resume: bool, version: int, what: str) -> dict | None:
    """The saved state when resuming; ``None`` for a fresh run, which must not overwrite one."""
    if resume:
        return read_train_state(out, version, what)
    if (Path(out) / TRAIN_STATE).exists():
        raise RelaxspecError(f"{out} already holds a training run; pass --resume to continue it or choose another --out")
    return None


def check_resumable(saved: dict, current: dict, run_fields: tuple[str, ...]) -> None:
    """Raise unless ``current`` (a config dict) equals ``saved`` in every field but ``run_fields``."""
    changed = [f"{k} (saved {saved.get(k)!r}, now {current[k]!r})" for k in current
               if k not in run_fields and plain(saved.get(k)) != plain(current[k])]
    if changed:
        raise RelaxspecError("cannot resume with a different recipe: " + "; ".join(changed)
                             + ". Only the run length and output settings may change.")


def plain(value):
    """Tuples as lists, so a config read back from JSON / a state file compares equal."""
    return list(value) if isinstance(value, tuple) else value


def rng_state() -> dict:
    """The global RNG states a recipe may draw from (CPU, and CUDA when present)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict | torch.Tensor) -> None:
    """Restore what :func:`rng_state` captured (a bare tensor: the CPU state, as early files hold)."""
    if isinstance(state, torch.Tensor):
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------
# Schedules, randomness, devices
# ------------------------------------------------------------------------------------------


def mix(seed: int, index: int) -> int:
    """A seed for item ``index`` (an epoch, a step) of a run seeded ``seed``."""
    return (seed * 1_000_003 + index) % (2**63)


def probe_index(n: int, count: int) -> torch.Tensor:
    """A fixed random subset of ``min(n, count)`` of ``n`` items, sorted (the data sets are sorted
    by class, so a prefix would measure a few classes only)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(0))[: min(n, count)].sort().values


def warmup_cosine(step: int, total: int, lr: float, warmup: int, min_lr: float) -> float:
    """Learning rate of 0-based ``step``: linear warm-up over ``warmup`` steps, then a cosine from
    ``lr`` down to ``min_lr`` at ``total`` (nanoGPT's ``get_lr``)."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


# ------------------------------------------------------------------------------------------
# Progress and logs
# ------------------------------------------------------------------------------------------


def step_bar(first: int, total: int, desc: str, enabled: bool):
    """A tqdm over steps ``first .. total - 1`` that shows a resumed run's progress so far."""
    return tqdm(range(first, total), initial=first, total=max(total, first), desc=desc, disable=not enabled)


def log_metrics(out: str | Path, record: dict, line: str | None = None) -> None:
    """Append ``record`` to ``out/metrics.jsonl``; print ``line`` above the progress bar."""
    with open(Path(out) / METRICS, "a") as log:
        log.write(json.dumps(record) + "\n")
    if line:
        tqdm.write(line)


def rewrite_metrics(out: str | Path, history: list[dict]) -> None:
    """Make ``out/metrics.jsonl`` the saved ``history`` again: a resumed run drops the evaluations
    an interrupted run logged after its last checkpoint (they are about to be redone)."""
    path = Path(out) / METRICS
    tmp = path.with_name(METRICS + ".tmp")
    tmp.write_text("".join(json.dumps(record) + "\n" for record in history))
    os.replace(tmp, path)


def read_metrics(out: str | Path) -> list[dict]:
    path = Path(out) / METRICS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RecipeConfig:
    """Mixin for a recipe's config dataclass: a JSON-able dict and back, refusing unknown fields
    (a resumed run must not silently drop settings). ``what`` names the recipe in errors."""

    what = "training"

    def to_dict(self) -> dict:
        import dataclasses

        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict):
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            from relaxspec.errors import RelaxspecError

            raise RelaxspecError(f"unknown {cls.what} fields: {', '.join(unknown)}")
        return cls(**data)


def need(ok: bool, message: str) -> None:
    """Config validation: raise the user-facing error ``message`` unless ``ok``."""
    if not ok:
        from relaxspec.errors import RelaxspecError

        raise RelaxspecError(message)
