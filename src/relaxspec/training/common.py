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

import argparse
import json
import math
import os
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from relaxspec.checkpoints import save_model
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


def config_from_args(args: argparse.Namespace, config_cls, read_saved) -> tuple[object, bool]:
    """The config the command line asks for: the given options over the defaults or, with
    ``--resume``, over the saved run's config (``read_saved(out) -> state dict``)."""
    given = {k: v for k, v in vars(args).items() if k in config_cls.__dataclass_fields__}
    resume = bool(getattr(args, "resume", False))
    base = dict(read_saved(given.get("out", config_cls.out))["config"]) if resume else {}
    return config_cls.from_dict({**base, **given}), resume


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


def resolve_device(name: str, what: str = "device") -> torch.device:
    """``auto`` is CUDA when present, else CPU; a CUDA device on a machine without one is refused
    here, with a clear message, rather than deep inside the first forward. ``what`` names the
    setting in messages (the CLI passes ``--device``)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise RelaxspecError(f"{what} {name!r} is not a device torch knows (try cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RelaxspecError(f"{what} {name}: CUDA is not available on this machine (this torch build: {torch.__version__})")
    return device


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


def add_run_options(parser: argparse.ArgumentParser, defaults, *, unit: str, seed_help: str,
                    cosine: bool = True, extra=None) -> None:
    """The options every recipe shares (optimiser, seed, precision, device, threads, intervals,
    resume, progress); each overrides the ``defaults`` dataclass field of the same name.
    ``extra(option)`` adds recipe-specific ones after the evaluation interval."""
    option = Options(parser, defaults)
    option.section("training")

    option("--steps", "optimizer steps (the cosine's length)" if cosine else "optimizer steps", type=int)
    option("--batch-size", f"{unit} per step", type=int)
    option("--lr", "peak AdamW learning rate", type=float)
    option("--min-lr", "learning rate at the end of the cosine", type=float)
    option("--weight-decay", "AdamW weight decay" + (" (matrices only)" if cosine else ""), type=float)
    option("--warmup-steps", "linear learning-rate warm-up", type=int)
    option("--grad-clip", "gradient-norm clip (0 = off)", type=float)
    option("--seed", seed_help, type=int)
    option.group.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in fp32 (default: bf16 autocast)")
    option("--device", "cpu, cuda, cuda:1, or auto")
    option("--threads", "torch CPU threads (1 is steadiest on a busy machine)", type=int)
    option("--eval-interval", "steps between evaluations", type=int)
    if extra is not None:
        extra(option)
    option("--checkpoint-interval", "steps between checkpoints", type=int)
    parser.add_argument("--resume", action="store_true", default=False, help="continue the run saved in --out")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


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


class Options:
    """Adds ``--flag`` options whose help shows the config dataclass's default; ``section(title)``
    starts an argument group. One definition for every recipe's parser."""

    def __init__(self, parser: argparse.ArgumentParser, defaults) -> None:
        self.parser, self.defaults, self.group = parser, defaults, parser

    def section(self, title: str) -> None:
        self.group = self.parser.add_argument_group(title)

    def __call__(self, flag: str, help: str, **kwargs) -> None:
        name = kwargs.get("dest", flag.lstrip("-").replace("-", "_"))
        default = getattr(self.defaults, name, None)
        if isinstance(default, tuple):
            default = ",".join(str(v) for v in default)
        shown = default is not None and default is not False and default != []
        self.group.add_argument(flag, help=f"{help} (default: {default})" if shown else help, **kwargs)


def need(ok: bool, message: str) -> None:
    """Config validation: raise the user-facing error ``message`` unless ``ok``."""
    if not ok:
        from relaxspec.errors import RelaxspecError

        raise RelaxspecError(message)
