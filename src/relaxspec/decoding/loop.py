"""What every decoding loop shares (issue 41): a step that is one call -- one compiled graph, one
CUDA-graph replay on a GPU -- with its random numbers drawn just before it, and a lagged,
non-blocking read of how far the decode has got, which ends the loop and moves the progress bar.

A decode (:mod:`relaxspec.decoding.driver`, with the step of its schedule:
:mod:`relaxspec.decoding.raster`, :mod:`relaxspec.decoding.rows`, :mod:`relaxspec.decoding.ar`)
keeps everything a step changes -- tokens, counts, records, a draft source's state, the KV caches
-- in tensors it updates in place, and writes a step as a function of one record holding them
(``step(loop)``, :class:`relaxspec.decoding.steps.Loop`). :func:`step_runner` compiles that function as one
graph (``fullgraph=True``, static shapes; CUDA graphs on a GPU) or, in profile mode, leaves it
eager so its parts can be timed apart (each compiled on its own). :func:`run_steps` then calls,
per step: the draws of :class:`relaxspec.noise.StepNoise` (one op per run of one kind of
number), the step, and one copy of the committed count into a host buffer, read one step late
on a GPU (the host queues step ``k`` before it waits for step ``k - 1``'s count, so the device
never idles on a read; the step after the last commits nothing) and at once on the CPU, where
there is no queue to keep full.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from relaxspec.compiling import compiled, fixed_addresses, tensors_of
from relaxspec.noise import StepNoise


def read_lag(device: torch.device) -> int:
    """Steps the loop reads its count late by: 1 on a GPU (the next step is queued before the
    host waits), 0 on the CPU (the device is the host: nothing runs ahead)."""
    return 1 if torch.device(device).type == "cuda" else 0


class LaggedCount:
    """A device count read ``lag`` pushes late without blocking on the device: :meth:`push`
    copies it into a (pinned) host buffer (one op, asynchronous on a GPU, an event recorded
    after it); :meth:`latest` returns the value pushed ``lag`` pushes ago once its copy is done
    (``None`` before there is one), reading the buffer through numpy (no op)."""

    def __init__(self, device: torch.device, lag: int):
        cuda = torch.device(device).type == "cuda"
        self.lag = lag
        self._host = torch.zeros(lag + 1, dtype=torch.long, pin_memory=cuda)
        self._slots = list(self._host.unbind(0))  # views made once: a push is one copy
        self._values = self._host.numpy()
        self._events = [torch.cuda.Event() for _ in range(lag + 1)] if cuda else None
        self._pushed = 0

    def push(self, value: torch.Tensor) -> None:
        index = self._pushed % (self.lag + 1)
        self._slots[index].copy_(value, non_blocking=True)
        if self._events is not None:
            self._events[index].record()
        self._pushed += 1

    def latest(self) -> int | None:
        pushed = self._pushed - 1 - self.lag
        if pushed < 0:
            return None
        index = pushed % (self.lag + 1)
        if self._events is not None:
            self._events[index].synchronize()  # a step queued behind it keeps the device busy meanwhile
        return int(self._values[index])


def step_runner(step: Callable, loop: object, device: torch.device, modules, *, compile: bool,
                profile: bool) -> Callable[[], None]:
    """``step(loop)`` as a call of no arguments: compiled as one graph when ``compile`` and not
    ``profile`` (``modules``: the models it runs, packed on the CPU as :func:`compiled` does;
    the tensors ``loop.tensors()`` lists and the modules' are marked to keep their address on a
    GPU), eager otherwise."""
    if not compile or profile:
        return lambda: step(loop)
    graph = compiled(step, device, *modules)
    if torch.device(device).type == "cuda":  # (what a CUDA graph records; nothing to do elsewhere)
        fixed_addresses(loop.tensors() + tensors_of(*modules))
    return lambda: graph(loop)


def run_steps(step: Callable[[], None], noise: StepNoise, generator: torch.Generator | None,
              done: torch.Tensor | None, total: int, *, start: int, on_step: Callable[[], None] | None = None, bar=None,
              lag: int | None = None, steps: int | None = None) -> int:
    """Run ``step`` ``steps`` times when that is known ahead (plain AR: nothing is read), else until the committed count ``done`` (a device scalar the step updates) reaches
    ``total`` (``start`` before the first step): per step, ``noise``'s draws from ``generator``,
    the step, one lagged read of ``done`` (:class:`LaggedCount`, :func:`read_lag`), ``on_step()``
    and the progress ``bar``'s update. Returns the steps run (with a lag, the last ones commit
    nothing).

    The steps run past the last commit drew numbers nobody used: ``generator`` (the device's
    default one when ``None``) is set back to its state before their draws, so a seed's
    generator leaves a decode where a lag-free decode leaves it, and the next image drawn from it
    is the same whatever the device's lag (issue 51)."""
    if steps is not None:
        for _ in range(steps):
            noise.draw(generator)
            step()
            if on_step is not None:
                on_step()
            if bar is not None:
                bar.update(start)  # every step commits a token of every image
        return steps
    reader = LaggedCount(done.device, read_lag(done.device) if lag is None else lag)
    drawn = _drawn_generator(generator, done.device) if reader.lag and noise.draws else None
    states: deque = deque(maxlen=reader.lag + 1)  # the generator's state before each of the last draws
    seen, steps = start, 0
    while seen < total:
        if steps > total + reader.lag:  # every step commits a token of every unfinished image
            raise RuntimeError(f"the decoding loop ran {steps} steps for {total} tokens without finishing")
        if drawn is not None:
            states.append(drawn.get_state())
        noise.draw(generator)
        step()
        steps += 1
        reader.push(done)
        if on_step is not None:
            on_step()
        now = reader.latest()
        if now is None:
            continue
        if bar is not None:
            bar.update(now - seen)
        seen = now
    if drawn is not None and steps > reader.lag:  # the last `lag` steps committed nothing
        drawn.set_state(states[len(states) - reader.lag])
    return steps


def _drawn_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """The generator ``noise.draw(generator)`` draws from on ``device``."""
    if generator is not None:
        return generator
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


__all__ = ["LaggedCount", "read_lag", "run_steps", "step_runner"]
