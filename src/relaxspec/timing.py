"""A stopwatch for the parts of a decode (target forwards, drafter forwards).

Decoding results report where the time went — target forwards, drafter forwards and the rest
(the engine: sampling, tree walk, cache moves, Python) — so a missed speed goal can be traced.
On CUDA the watch synchronises the device around each timed region; the engine synchronises on
every step anyway (acceptance decisions are read on the host), so this adds no stall of its own
beyond the kernel queue it drains.
"""

from __future__ import annotations

import time

import torch


class Stopwatch:
    """``with watch: ...`` adds the block's wall time to ``watch.seconds``."""

    def __init__(self, device: torch.device | str | None = None):
        self.seconds = 0.0
        self.cuda = torch.device(device).type == "cuda" if device is not None else False
        self._start = 0.0

    def __enter__(self) -> "Stopwatch":
        if self.cuda:
            torch.cuda.synchronize()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - self._start
