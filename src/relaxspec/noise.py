"""A decoding step's random numbers, drawn outside the step (issue 41).

A step compiled as one graph cannot draw from the user's ``torch.Generator`` (and on a GPU
inductor's own random numbers would not reproduce eager's for a seed), so every number a step
uses is drawn before it, from the generator, into buffers the step reads: :class:`StepNoise`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from relaxspec.caching import kept_buffer

#: The kinds of random numbers a step draws: ``Exp(1)`` clocks (float32; races and Gumbel-top-k
#: siblings), and uniforms on [0, 1) in float64 (acceptance tests) or float32.
CLOCKS, UNIFORMS, UNIFORMS32 = "clocks", "uniforms", "uniforms32"
_KINDS = {CLOCKS: torch.float32, UNIFORMS: torch.float64, UNIFORMS32: torch.float32}
#: When in a step numbers are used, the order they are drawn in: the drafts, the verification
#: walk, the draft source's update after it (a Jacobi window's redraws).
DRAFT, VERIFY, UPDATE = 0, 1, 2


@dataclass(eq=False)
class NoiseSlot:
    """Where one reservation of :class:`StepNoise` lies: ``numel`` numbers of ``kind`` from
    ``offset`` of the kind's buffer (set by :meth:`StepNoise.allocate`), read as ``shape``."""

    kind: str
    shape: tuple[int, ...]
    phase: int = DRAFT
    offset: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class StepNoise:
    """The random numbers of one decoding step, drawn from the user's generator *outside* the
    step (issue 41: a step compiled as one graph cannot draw from a ``torch.Generator``; and on a
    GPU inductor's own random numbers would not reproduce eager's for a seed).

    Each part of a step that draws (a draft source's siblings or Jacobi window, the verification
    walk's acceptance uniforms and bonus clocks) reserves what it needs once per decode
    (:meth:`reserve`: a shape, a kind and the phase of the step that uses them: :data:`DRAFT`,
    :data:`VERIFY`, :data:`UPDATE`); before every step :meth:`draw` fills the buffers from the
    generator in the order the step uses them -- by phase, then reservation -- with one
    ``exponential_`` or ``uniform_`` per run of consecutive reservations of one kind, and inside the
    step each part reads its own numbers back (:meth:`read`: views, no draw). On the CPU a draw of
    ``m + n`` numbers is the same stream as a draw of ``m`` then of ``n``, so the step sees exactly
    the numbers its parts drew for themselves when they drew inside it (a seed maps to the same
    image as before issue 41; on a GPU the stream's offsets advance per draw, so there it may not).

    Shapes are fixed once reserved: the buffers are allocated once (:meth:`allocate`) and refilled
    in place, so a compiled (CUDA-graph) step reads them at the same addresses every step; with an
    ``owner`` (the target model) they are the owner's, reused by every decode of the same shapes,
    and so are the state buffers the step's parts keep through :meth:`kept`."""

    def __init__(self, device: torch.device | str | None = None, owner: object | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.owner = owner
        self.slots: list[NoiseSlot] = []
        self._sizes = {kind: 0 for kind in _KINDS}
        self._buffers: dict[str, torch.Tensor] = {}
        self._runs: list[torch.Tensor] = []

    def reserve(self, shape, kind: str = CLOCKS, phase: int = DRAFT) -> NoiseSlot:
        """Reserve ``shape`` numbers of ``kind`` (:data:`CLOCKS`, :data:`UNIFORMS` or
        :data:`UNIFORMS32`), used in ``phase`` of every step; returns the slot :meth:`read` takes."""
        if self._buffers:
            raise RuntimeError("StepNoise.reserve after allocate: reserve every part's numbers first")
        if kind not in _KINDS:
            raise ValueError(f"unknown kind of random numbers {kind!r}; kinds: {', '.join(_KINDS)}")
        slot = NoiseSlot(kind, tuple(int(s) for s in shape), phase)
        self.slots.append(slot)
        return slot

    def allocate(self) -> "StepNoise":
        """Lay the reservations out in draw order, allocate the buffers (once, after every
        reservation) and split them into the runs one draw each fills."""
        self.slots.sort(key=lambda slot: slot.phase)  # stable: reservation order within a phase
        for slot in self.slots:
            slot.offset = self._sizes[slot.kind]
            self._sizes[slot.kind] += slot.numel
        self._buffers = {kind: self.kept(f"noise.{kind}", (max(size, 1),), _KINDS[kind])
                         for kind, size in self._sizes.items()}
        runs: list[tuple[str, int, int]] = []
        for slot in self.slots:
            if runs and runs[-1][0] == slot.kind:
                kind, start, length = runs[-1]
                runs[-1] = (kind, start, length + slot.numel)
            else:
                runs.append((slot.kind, slot.offset, slot.numel))
        self._runs = [(kind, self._buffers[kind][start : start + length]) for kind, start, length in runs if length]
        return self

    @property
    def draws(self) -> int:
        """Ops :meth:`draw` makes per step (0 when nothing is random: greedy decoding)."""
        return len(self._runs)

    def draw(self, generator: torch.Generator | None) -> None:
        """Fill every reservation for the next step, in reservation order (outside the step)."""
        for kind, run in self._runs:
            if kind == CLOCKS:
                run.exponential_(generator=generator)
            else:
                run.uniform_(generator=generator)

    def read(self, slot: NoiseSlot) -> torch.Tensor:
        """This step's numbers of ``slot`` ``[*shape]`` (clocks floored at the smallest normal
        float, as :func:`exponential_clocks`)."""
        if slot.offset < 0:
            raise RuntimeError("StepNoise.read before allocate")
        values = self._buffers[slot.kind][slot.offset : slot.offset + slot.numel].view(slot.shape)
        return values.clamp(min=torch.finfo(torch.float32).tiny) if slot.kind == CLOCKS else values

    def kept(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """A state buffer of a step's part (a Jacobi window, say) on this step's device, kept with the
        owner across decodes (:func:`relaxspec.caching.kept_buffer`; a new one without an owner);
        its contents are the caller's to set."""
        if self.owner is None:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return kept_buffer(self.owner, name, shape, dtype, self.device)

    def buffers(self) -> list[torch.Tensor]:
        """The buffers a compiled step reads (to keep at fixed addresses)."""
        return list(self._buffers.values())
