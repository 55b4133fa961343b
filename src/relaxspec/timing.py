"""A stopwatch for the parts of a decode (target forwards, drafter forwards), in profile mode.

A decode run with ``profile=True`` (``--profile``) reports where the time goes -- target forwards,
drafter forwards and the rest (the engine: sampling, tree walk, cache moves, Python) -- so a
missed speed goal can be traced. Timing the parts apart needs them apart: in profile mode each
model call runs as its own compiled graph (:class:`Profiling`), so a profiled step is slower than
the default one, which runs as one graph and carries no timing (issue 41). On CUDA the watch
records a pair of CUDA events around each timed region and reads them only when
:attr:`Stopwatch.seconds` is asked for (after the decode): timing never synchronises the device
inside the loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Profiling:
    """Profile mode, as a decode hands it to its parts (the target, a draft source): time every
    model call with a :class:`Stopwatch`, each compiled as its own graph when ``compile``."""

    compile: bool = False


class Stopwatch:
    """``with watch: ...`` adds the block's time to ``watch.seconds`` (GPU time of the block's
    kernels on CUDA, wall time elsewhere)."""

    def __init__(self, device: torch.device | str | None = None):
        self.cuda = torch.device(device).type == "cuda" if device is not None else False
        self._wall = 0.0
        self._start = 0.0
        self._events: list[tuple] = []

    def __enter__(self) -> "Stopwatch":
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, torch.cuda.Event(enable_timing=True)))
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._events[-1][1].record()
        else:
            self._wall += time.perf_counter() - self._start

    @property
    def seconds(self) -> float:
        if not self._events:
            return self._wall
        self._events[-1][1].synchronize()
        return self._wall + sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
