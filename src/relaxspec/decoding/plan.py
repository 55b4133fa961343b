"""What a decode is told: a :class:`DecodePlan` -- the draft source, the acceptance rule, the
:class:`Schedule` the steps follow and the flags -- built by a method
(:meth:`relaxspec.methods.Method.plan`) or by hand, and the registry of schedules.

A schedule says how a decode's steps cover the image: ``raster`` (one speculative step of every
image at a time, :mod:`relaxspec.decoding.raster`), ``rows`` (several rows open at once, each a
lane of drafts, :mod:`relaxspec.decoding.rows`) and ``ar`` (one token a forward, no drafts,
:mod:`relaxspec.decoding.ar`). The driver (:mod:`relaxspec.decoding.driver`) runs the prologue
(prefill, token 0, the noise, the source's start), the step loop and the read-out the same way for
every schedule; a schedule brings its state, its step and its part of the result. A new schedule
is a new module with a :class:`Schedule` subclass and one :func:`register` call.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, ClassVar

import torch

from relaxspec.acceptance import AcceptanceRule
from relaxspec.errors import RelaxspecError
from relaxspec.noise import StepNoise


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """A decode: ``schedule`` (how steps cover the image), the draft ``source`` and acceptance
    ``rule`` (``None`` for a schedule that drafts nothing, plain AR), ``compile`` (every step one
    graph), ``profile`` (the forwards timed apart), ``record_tv`` (a relaxed rule's TV record) and
    ``label`` (the progress bar's)."""

    schedule: "Schedule"
    source: object | None = None
    rule: AcceptanceRule | None = None
    compile: bool = False
    profile: bool = False
    record_tv: bool = True
    label: str = "decode"

    def __post_init__(self) -> None:
        if self.schedule.drafts and (self.source is None or self.rule is None):
            raise RelaxspecError(f"the {self.schedule.name} schedule needs a draft source and an acceptance rule")


@dataclass(eq=False)
class Layout:
    """What a schedule needs before anything is allocated: the ``source`` it drafts with (a view of
    the plan's, for rows), the target's cache ``scratch`` slots past the image, and ``lanes``, the
    trees one image drafts per step."""

    source: object | None
    scratch: int
    lanes: int = 1


@dataclass(eq=False)
class State:
    """The tensors a step updates in place, kept with the model across decodes of one shape (a
    compiled step finds them where they were): every schedule's state is a dataclass of tensors
    deriving from this one, ``tokens [B, >= N]`` (the first ``N`` columns are the image) first.
    :meth:`tensors` lists them: the fixed addresses a CUDA graph reads."""

    tokens: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [value for value in (getattr(self, f.name) for f in fields(self)) if isinstance(value, torch.Tensor)]


class Schedule:
    """How a decode's steps cover the image. Subclass it (a dataclass of the schedule's settings)
    and :func:`register` it. ``drafts``: the schedule runs a draft source and a rule.

    The driver calls, in order: :meth:`layout` (sizes, before the target's cache is allocated),
    :meth:`start_source` (the source's first pair, after token 0), :meth:`reserve` (the step's
    random numbers), :meth:`state` (the state at a decode's start, token 0 committed), then
    :meth:`step` until ``state.done`` reaches every token (or :meth:`fixed_steps` times), and
    :meth:`result` (the schedule's part of the :class:`~relaxspec.decoding.result.DecodeResult`,
    from the host copies of :meth:`read_out`'s tensors)."""

    name: ClassVar[str]
    drafts: ClassVar[bool] = True

    def layout(self, model, source) -> Layout:
        return Layout(source, source.max_nodes if source is not None else 0)

    def start_source(self, model, layout: Layout, first, probs, hidden, start) -> None:
        """Start the draft source on token 0: ``start(first, probs, hidden)`` calls
        ``source.start`` with the decode's other arguments (a schedule of lanes repeats the pair)."""
        start(first, probs, hidden[:, -1:])

    def reserve(self, noise: StepNoise, layout: Layout, batch: int, vocab: int, greedy: bool):
        """Reserve the step's random numbers beyond the source's; returns what the step reads them by."""
        return None

    def state(self, model, layout: Layout, target, first: torch.Tensor) -> State:
        raise NotImplementedError

    step: ClassVar[Callable]  # step(loop): one step, every result landing in loop.state

    def fixed_steps(self, num_tokens: int) -> int | None:
        """The steps a decode takes when the schedule knows it ahead (no count is read), else None."""
        return None

    def progress(self, state: State, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [B, N], done)`` for ``on_step``: the token buffer and how far each image got."""
        raise NotImplementedError

    def read_out(self, loop) -> tuple[torch.Tensor, ...]:
        """The tensors the result is made from, brought to the host in one copy after the loop."""
        raise NotImplementedError

    def result(self, host: list[torch.Tensor], loop) -> dict:
        """The :class:`~relaxspec.decoding.result.DecodeResult` fields of this schedule."""
        raise NotImplementedError


_SCHEDULES: dict[str, type[Schedule]] = {}


def register(schedule: type[Schedule]) -> type[Schedule]:
    """Add a :class:`Schedule` to the registry under its ``name`` (usable as a class decorator)."""
    if _SCHEDULES.get(schedule.name, schedule) is not schedule:
        raise RelaxspecError(f"two schedules are called {schedule.name!r}")
    _SCHEDULES[schedule.name] = schedule
    return schedule


def unregister(name: str) -> None:
    """Take the schedule ``name`` out of the registry (a test's own schedule, once it is done)."""
    _SCHEDULES.pop(name, None)


def schedule(name: str, **settings) -> Schedule:
    """The registered schedule ``name`` with ``settings``; one line for an unknown name."""
    if name not in _SCHEDULES:
        raise RelaxspecError(f"unknown schedule {name!r}; schedules: {', '.join(sorted(_SCHEDULES))}")
    return _SCHEDULES[name](**settings)


def schedules() -> tuple[str, ...]:
    return tuple(_SCHEDULES)


__all__ = ["DecodePlan", "Layout", "Schedule", "State", "register", "schedule", "schedules", "unregister"]
