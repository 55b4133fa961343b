"""What every decoding step reads: its parts (:class:`StepParts`), never changed by it, and the
loop record a step function takes (:class:`Loop`: parts, the schedule and its state); and the
pieces the speculative schedules share (the walk's random numbers, the sibling-count tables, the
verification call)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from relaxspec.acceptance import AcceptanceRule
from relaxspec.caching import kept_buffer
from relaxspec.compiling import tensors_of
from relaxspec.decoding.plan import Schedule, State
from relaxspec.decoding.result import add_counts
from relaxspec.decoding.target import GuidedTarget
from relaxspec.decoding.verify import VerifyResult, WalkNoise, verify_tree, walk_tests
from relaxspec.drafting.base import DraftTree
from relaxspec.errors import RelaxspecError
from relaxspec.noise import UNIFORMS, VERIFY, NoiseSlot, StepNoise


@dataclass(eq=False)
class WalkSlots:
    """Where a walk's random numbers lie on the step's noise: the acceptance ``uniforms`` and the
    bonus ``clocks`` (``None`` when greedy, or for a source of no fixed shape, whose walk draws
    from the generator). Plain AR reads only ``clocks``."""

    uniforms: NoiseSlot | None = None
    clocks: NoiseSlot | None = None


@dataclass(eq=False)
class StepParts:
    """What a step runs, the same every step: the ``target``, the step's random numbers ``noise``
    (``slots`` on it), the draft ``source`` and ``rule`` (``None`` for plain AR), the ``walk``
    function, ``greedy``, ``record_tv`` (a relaxed rule's record is made) and the ``generator`` a
    walk of no fixed shape draws from."""

    target: GuidedTarget
    noise: StepNoise
    source: object | None = None
    rule: AcceptanceRule | None = None
    slots: WalkSlots | None = None
    walk: Callable | None = None
    greedy: bool = False
    record_tv: bool = False
    generator: torch.Generator | None = None
    tv_recorded: bool = True  # what the result says: False when a relaxed rule ran with the record off

    def walk_noise(self) -> WalkNoise | None:
        slots = self.slots
        if slots is None or slots.uniforms is None:
            return None
        return WalkNoise(self.noise.read(slots.uniforms), self.noise.read(slots.clocks))

    def verify(self, tree: DraftTree, probs: torch.Tensor) -> VerifyResult:
        """The walk of the step's trees (built valid: no check) against the target's ``probs``."""
        return verify_tree(self.rule, tree, probs, greedy=self.greedy, generator=self.generator,
                           record_tv=self.record_tv, noise=self.walk_noise(), check=False, walk=self.walk)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the parts hold (a rule's tables, a source's buffers, the noise): what a CUDA
        graph of the step keeps at fixed addresses with the state's."""
        return self.noise.buffers() + tensors_of(self.target, self.source, self.rule)


@dataclass(eq=False)
class Loop:
    """What a step function takes: the ``parts``, the ``schedule`` (its settings) and the
    ``state`` it updates in place. ``num_tokens`` image tokens per image."""

    parts: StepParts
    schedule: Schedule
    state: State
    num_tokens: int

    def tensors(self) -> list[torch.Tensor]:
        return self.state.tensors() + self.parts.tensors()


class TimedSource:
    """Profile mode: a draft source whose :meth:`propose` and :meth:`update` add their wall time
    to :attr:`seconds` (the step stays free of timing; the source's other attributes are its own)."""

    def __init__(self, source, seconds: float = 0.0):
        self.source, self.seconds = source, seconds

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def propose(self, *args):
        started = time.perf_counter()
        try:
            return self.source.propose(*args)
        finally:
            self.seconds += time.perf_counter() - started

    def update(self, *args) -> None:
        started = time.perf_counter()
        try:
            self.source.update(*args)
        finally:
            self.seconds += time.perf_counter() - started


def reserve_walk(noise: StepNoise, source, rows: int, vocab: int, greedy: bool) -> WalkSlots:
    """Reserve the walk's numbers on ``noise`` (its :data:`~relaxspec.noise.VERIFY` phase: the
    acceptance uniforms, then the bonus clocks) for ``rows`` trees; none when greedy or for a
    source of no fixed shape."""
    if greedy or source.level_widths is None:
        return WalkSlots()
    tests = walk_tests(source.level_widths, source.max_nodes if getattr(source, "longest_row", False) else None)
    return WalkSlots(noise.reserve((tests, rows), UNIFORMS, VERIFY),
                     noise.reserve((rows, vocab), phase=VERIFY))


def check_compilable(source, compile: bool) -> None:
    """One line for a source that cannot be part of a compiled step."""
    if compile and source.level_widths is None:
        raise RelaxspecError(f"the draft source {type(source).__name__} declares no fixed tree shape "
                             "(level_widths): its steps cannot be compiled; decode it without compile")


def rank_count_shape(level_widths: tuple[int, ...] | None) -> tuple[int, int] | None:
    """The walk's ``[levels, width]`` sibling-count tables for trees of ``level_widths`` (``None``:
    unknown until the first tree)."""
    if level_widths is None:
        return None
    return max(len(level_widths), 1), max(level_widths, default=1)


@dataclass(eq=False)
class DraftState(State):
    """The state every drafting schedule keeps besides its own: ``step_tv`` (each token's TV
    record, as ``tokens``), ``steps [B]`` (steps that committed), the sibling counts ``rank_tests``
    / ``rank_accepts [levels, width]`` (``None`` until the first tree for a source of no fixed
    shape) and ``done`` (tokens committed in all, what the loop reads)."""

    step_tv: torch.Tensor
    steps: torch.Tensor
    done: torch.Tensor
    rank_tests: torch.Tensor | None
    rank_accepts: torch.Tensor | None

    def add_rank_counts(self, result: VerifyResult) -> None:
        """Add a step's sibling counts (in place, where the source's trees have a fixed shape; a
        source of no fixed shape grows its tables as they come, eagerly)."""
        if self.rank_tests is not None and self.rank_tests.shape == result.rank_tests.shape:
            self.rank_tests.add_(result.rank_tests)
            self.rank_accepts.add_(result.rank_accepts)
        else:
            self.rank_tests = add_counts(self.rank_tests, result.rank_tests)
            self.rank_accepts = add_counts(self.rank_accepts, result.rank_accepts)

    @staticmethod
    def start(kept, first: torch.Tensor, source, columns: int) -> dict:
        """These fields at a decode's start (``kept``: :func:`kept_state`'s): ``tokens`` and
        ``step_tv`` ``[B, columns]`` with token 0 committed, no step taken, the sibling counts zero."""
        batch = first.shape[0]
        tokens = kept("tokens", (batch, columns))
        tokens[:, 0] = first
        counts = rank_count_shape(source.level_widths)
        return dict(tokens=tokens, step_tv=kept("step_tv", (batch, columns), torch.float32),
                    steps=kept("steps", (batch,)), done=kept("done", ()).fill_(batch),
                    rank_tests=None if counts is None else kept("rank_tests", counts),
                    rank_accepts=None if counts is None else kept("rank_accepts", counts))

    def read_out(self, loop) -> tuple[torch.Tensor, ...]:
        """``(tokens [B, N], steps, step_tv [B, N], rank_tests, rank_accepts)``: what every drafting
        schedule's result is made of (:func:`drafted_result`)."""
        n_tok = loop.num_tokens
        return (self.tokens[:, :n_tok], self.steps, self.step_tv[:, :n_tok], *self.rank_tables(loop.parts.source))

    def rank_tables(self, source) -> tuple[torch.Tensor, torch.Tensor]:
        """The sibling counts, zero tables for a one-token image from a source of no fixed shape
        (no step was taken)."""
        if self.rank_tests is None:
            zeros = torch.zeros(max(source.max_depth, 1), 1, dtype=torch.long, device=self.tokens.device)
            return zeros, zeros
        return self.rank_tests, self.rank_accepts


def drafted_result(loop, host: list[torch.Tensor], accept_lengths: list[list[int]]) -> dict:
    """The :class:`~relaxspec.decoding.result.DecodeResult` fields every drafting schedule reports,
    from the host copies of :meth:`DraftState.read_out` and the tokens each step committed."""
    tokens, steps, step_tv, rank_tests, rank_accepts = host
    return dict(tokens=tokens, target_forwards=steps + 1, drafter_forwards=steps * loop.parts.source.forwards_per_step,
                step_tv=step_tv, accept_lengths=accept_lengths, rank_tests=rank_tests, rank_accepts=rank_accepts,
                tv_recorded=loop.parts.tv_recorded)


def kept_state(model, prefix: str, device: torch.device):
    """``kept(name, shape, dtype=long)``: a zeroed state buffer kept with ``model`` under
    ``prefix.name`` (:func:`relaxspec.caching.kept_buffer`)."""
    def kept(name, shape, dtype=torch.long):
        return kept_buffer(model, f"{prefix}.{name}", shape, dtype, device).zero_()

    return kept


__all__ = ["DraftState", "Loop", "StepParts", "TimedSource", "WalkSlots", "check_compilable", "drafted_result",
           "kept_state",
           "rank_count_shape", "reserve_walk"]
