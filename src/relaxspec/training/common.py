"""What every training recipe shares: resumable checkpoints, schedules, logging, the device.

A run writes into one folder ``out``:

* ``model.safetensors`` + ``config.json`` — the weights other commands load (our format);
* ``train_state.pt`` — what ``--resume`` loads: weights, optimizer, step, RNG, config, history.
  It holds only tensors, numbers, strings, lists and dicts, so it loads with
  ``torch.load(..., weights_only=True)`` (REFERENCE §2.3: a pickle can run code); the folder is
  opened, locked and resumed by :mod:`relaxspec.runs.folder`, as every command's is;
* ``metrics.jsonl`` — one JSON line per evaluation.

Every file is replaced atomically (written beside, then ``os.replace``), so an interrupted run
leaves the previous consistent checkpoint. A resumed run must keep its recipe: only the fields a
recipe names as run fields (length, output, device, progress ...) may change, or the
continuation would not be the run it claims to be.

Every recipe trains with :func:`run_training`, the one loop (nanoGPT's): it walks the steps,
draws each epoch's data order, sets the learning rate, steps the optimizer and calls the recipe's
hooks; a recipe supplies only its batch loss and what to do at its intervals.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable
import dataclasses

import torch
from tqdm.auto import tqdm

from relaxspec.models.weights import save_model
from relaxspec.devices import check_fits
from relaxspec.errors import RelaxspecError
from relaxspec.inputs import check_finite

METRICS = "metrics.jsonl"
#: Where a recipe keeps its best-scoring weights (model.safetensors + config.json).
BEST = "best"


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


def check_resumable(saved: dict, current: dict, run_fields: tuple[str, ...]) -> None:
    """Raise unless ``current`` (a config dict) equals ``saved`` in every field but ``run_fields``."""
    changed = [f"{k} (saved {saved.get(k)!r}, now {current[k]!r})" for k in current
               if k not in run_fields and plain(saved.get(k)) != plain(current[k])]
    if changed:
        raise RelaxspecError("cannot resume with a different recipe: " + "; ".join(changed)
                             + ". Only the run length and output settings may change.")


#: The most optimizer steps a run may ask for: years at ten steps a second, far beyond any real run,
#: so a slip such as ``--epochs 1e30`` (or ``inf``) is refused instead of overflowing or running forever.
MAX_STEPS = 10**9


def run_length(steps: int | None, epochs: float, steps_per_epoch: int) -> int:
    """A run's optimizer steps: ``steps`` when given (its config checked its range), else
    ``ceil(epochs * steps_per_epoch)``, refused with one line past :data:`MAX_STEPS`."""
    if steps is not None:
        return steps
    total = epochs * steps_per_epoch
    if not (math.isfinite(total) and 0 <= total <= MAX_STEPS):
        raise RelaxspecError(f"epochs {epochs} at {steps_per_epoch} steps an epoch is {total:.3g} steps; a run takes "
                             f"at most {MAX_STEPS:,}")
    return math.ceil(total)


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


def warmup_constant(step: int, lr: float, warmup: int) -> float:
    """Learning rate of 0-based ``step``: linear warm-up over ``warmup`` steps, then ``lr`` for
    good (no step's rate depends on the run's length, so a finished run can be extended exactly)."""
    return lr * min(1.0, (step + 1) / warmup) if warmup else lr


def shuffled(size: int, seed: int) -> Callable[[int], torch.Tensor]:
    """The default data order: epoch ``e`` visits ``randperm(size)`` drawn from a generator seeded
    ``mix(seed, e)``. Any step's batch is known without replaying the steps before it, which is
    what lets a resumed run continue bit for bit."""

    def order(epoch: int) -> torch.Tensor:
        return torch.randperm(size, generator=torch.Generator().manual_seed(mix(seed, epoch)))

    return order


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------


@dataclass
class Every:
    """A hook of :func:`run_training`: ``fn(done)`` after every ``interval``-th step and after the
    last step of the run (``done`` counts the steps done, so it is the step to resume from).
    ``fn`` returning True stops the run there; the hooks after it are not called for that step."""

    interval: int
    fn: Callable[[int], bool | None]

    def due(self, done: int, total: int) -> bool:
        return done % self.interval == 0 or done == total


@dataclass
class LoopResult:
    step: int  # steps done in all (a resumed run's earlier ones included): where to resume
    seconds: float  # time spent in training steps (no evaluations or checkpoints)
    examples: int  # examples trained on by this call
    stopped: bool  # a hook stopped the run before ``steps``

    @property
    def per_second(self) -> float:
        return self.examples / self.seconds if self.seconds else 0.0


#: ``step_loss(step, index [batch]) -> (loss, metrics)``: a recipe's forward pass on one batch.
StepLoss = Callable[[int, torch.Tensor], "tuple[torch.Tensor, dict]"]


def run_training(step_loss: StepLoss, optimizer: torch.optim.Optimizer, *, steps: int, size: int,
                 batch_size: int, lr: Callable[[int], float], first: int = 0, seed: int = 0,
                 order: Callable[[int], torch.Tensor] | None = None, grad_clip: float = 0.0,
                 parameters: Iterable[torch.Tensor] | None = None,
                 on_step: Callable[[int, dict], None] | None = None, hooks: Iterable[Every] = (),
                 postfix: Callable[[dict], dict] | None = None, desc: str = "train",
                 progress: bool = True) -> LoopResult:
    """Train steps ``first .. steps - 1`` over a data set of ``size`` examples; the one loop of
    every recipe (nanoGPT's). Step ``s`` (0-based):

    1. its batch: ``index``, slot ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``'s
       order (``batch_size`` positions; an epoch's last batch may be short). ``order(epoch)``
       (default :func:`shuffled` from ``seed``) is called once per epoch, at its first step;
    2. ``lr(s)`` (e.g. :func:`warmup_cosine`, :func:`warmup_constant`) on every param group;
    3. ``loss, metrics = step_loss(s, index)``: the recipe's forward pass, where it draws its own
       per-step randomness; ``metrics``: named scalars (tensors or numbers) for on_step and the bar;
    4. zero_grad, backward, ``clip_grad_norm_(parameters, grad_clip)`` when ``grad_clip > 0``
       (``parameters``: the model's, in its order; default the optimizer's), ``optimizer.step()``;
       ``metrics`` become floats (on a GPU this waits for the step);
    5. ``on_step(s, metrics)``: the recipe's per-step bookkeeping (counted in the step's time);
    6. the bar's postfix (``postfix(metrics)``, default every metric), then each ``hooks`` entry
       that is due (evaluation, checkpoint), in order; one returning True stops the run.

    Everything random is drawn from what ``s`` and the seed determine, so a run resumed at
    ``first`` (its model, optimizer and hook state restored) continues bit for bit."""
    order = order or shuffled(size, seed)
    if parameters is None:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
    parameters, hooks = list(parameters), list(hooks)  # clip_grad_norm_ sums in this order, every step
    steps_per_epoch = math.ceil(size / batch_size)
    seconds, examples, done, stopped = 0.0, 0, first, False
    epoch_order, drawn_epoch = None, -1
    bar = step_bar(first, steps, desc, progress)
    try:
        for step in bar:
            epoch, slot = divmod(step, steps_per_epoch)
            if epoch != drawn_epoch:
                epoch_order, drawn_epoch = order(epoch), epoch
            index = epoch_order[slot * batch_size : (slot + 1) * batch_size]
            rate = lr(step)
            for group in optimizer.param_groups:
                group["lr"] = rate

            start = time.perf_counter()
            loss, metrics = step_loss(step, index)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
            optimizer.step()
            metrics = {name: float(value.detach() if isinstance(value, torch.Tensor) else value)
                       for name, value in metrics.items()}
            if on_step is not None:
                on_step(step, metrics)
            seconds += time.perf_counter() - start
            examples += len(index)

            shown = postfix(metrics) if postfix else {name: f"{value:.4f}" for name, value in metrics.items()}
            bar.set_postfix(refresh=False, **shown)
            done = step + 1
            for hook in hooks:
                if hook.due(done, steps) and hook.fn(done):
                    stopped = True
                    break
            if stopped:
                break
    finally:
        bar.close()
    return LoopResult(done, seconds, examples, stopped)


# ------------------------------------------------------------------------------------------
# Progress and logs
# ------------------------------------------------------------------------------------------


def step_bar(first: int, total: int, desc: str, enabled: bool):
    """A tqdm over steps ``first .. total - 1`` that shows a resumed run's progress so far."""
    return tqdm(range(first, total), initial=first, total=max(total, first), desc=desc, unit="step",
                disable=not enabled)


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
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict):
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise RelaxspecError(f"unknown {cls.what} fields: {', '.join(unknown)}")
        return cls(**data)


#: Bytes a trained parameter holds under AdamW in fp32: the weight, its gradient and the two moments.
TRAINED_PARAMETER_BYTES = 16


def check_trainable(what: str, kind: str, build: Callable[[int], torch.nn.Module], layers: int, device) -> None:
    """Refuse, before any weight is allocated, a ``kind`` of model of ``layers`` layers
    (``build(n)``: one of ``n`` layers) whose training state does not fit in ``device``'s free
    memory, in one line naming ``what``. The size comes from one layer and two on the meta device: building a million
    layers took minutes even there."""
    with torch.device("meta"):
        one, two = (sum(p.numel() for p in build(n).parameters()) for n in (1, 2))
    parameters = one + (layers - 1) * (two - one)
    check_fits(f"{what} (a {kind} of {parameters:,} parameters; its weights, gradients and AdamW's two moments in "
               "fp32)", TRAINED_PARAMETER_BYTES * parameters, device)


def need_finite(config) -> None:
    """Config validation: every float field of the dataclass ``config`` is finite (an ``inf``
    learning rate or epoch count passes ``> 0`` checks and means nothing)."""
    for name in config.__dataclass_fields__:
        value = getattr(config, name)
        if isinstance(value, float):
            check_finite(name, value)


def need(ok: bool, message: str) -> None:
    """Config validation: raise the user-facing error ``message`` unless ``ok``."""
    if not ok:
        raise RelaxspecError(message)


#: The projections that write a transformer layer's attention and MLP back into the residual
#: stream: LlamaGen's ``wo`` / ``w2``, the transformers families' ``o_proj`` / ``down_proj``.
RESIDUAL_OUTPUTS = ("wo", "w2", "o_proj", "down_proj")


@torch.no_grad()
def start_as_identity(layer: torch.nn.Module) -> None:
    """Zero a pre-norm transformer layer's residual output projections (:data:`RESIDUAL_OUTPUTS`)
    so that it passes its input through unchanged until training wakes it up (function-preserving
    growth, Net2Net, arXiv 1511.05641)."""
    zeroed = 0
    for name, module in layer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in RESIDUAL_OUTPUTS:
            module.weight.zero_()
            if module.bias is not None:
                module.bias.zero_()
            zeroed += 1
    if zeroed < 2:
        raise RelaxspecError(f"{type(layer).__name__}: found no attention and MLP output projections to start "
                             f"it as the identity (looked for {', '.join(RESIDUAL_OUTPUTS)})")

