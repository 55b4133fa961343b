"""The self-samples' cache: what makes drawing them (the slow part of a run) resumable, on any
number of processes.

Batch ``b`` of a run's self-samples is fixed by the run (its conditions, seed and batch size),
not by which process draws it, so the cache is kept by batch:

* ``out/self_samples.parts-<key>/batch-000123.npy`` — one file per drawn batch, written
  atomically by whichever rank drew it (``<key>`` names the conditions and settings: files of
  another run's settings are never read);
* ``out/self_samples.npz`` — every batch in one file (``tokens [count, N]``, ``done``, ``key``),
  written once all are drawn; the batch files are removed then. A file written before batches had
  their own (``done`` counts the rows drawn in order) is read as those batches.

A cache drawn by 4 processes is therefore a cache for 1 and the other way round; a run killed
while drawing loses at most the batches being drawn.
"""

from __future__ import annotations

import hashlib
import math
import shutil
from pathlib import Path

import numpy as np

from relaxspec.files import write_atomic


class SampleCache:
    """The cache at ``path`` (``out/self_samples.npz``) of ``count`` sequences of ``length``
    tokens drawn ``batch_size`` at a time under settings ``key`` (a JSON string)."""

    def __init__(self, path: str | Path, key: str, count: int, batch_size: int, length: int):
        self.path, self.key, self.count, self.batch_size, self.length = Path(path), key, count, batch_size, length
        self.batches = math.ceil(count / batch_size)
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.parts = self.path.with_name(f"{self.path.stem}.parts-{digest}")

    def rows(self, batch: int) -> slice:
        return slice(batch * self.batch_size, min((batch + 1) * self.batch_size, self.count))

    def load(self) -> tuple[np.ndarray, list[bool]]:
        """The tokens drawn so far (``-1`` elsewhere) and which batches they fill."""
        tokens = np.full((self.count, self.length), -1, dtype=np.int64)
        done = [False] * self.batches
        whole = self._whole()
        if whole is not None:
            old, rows = whole
            tokens[:rows] = old[:rows]
            done = [self.rows(b).stop <= rows for b in range(self.batches)]
        for batch in range(self.batches):
            if done[batch]:
                continue
            part = self._part(batch)
            if part is not None:
                tokens[self.rows(batch)], done[batch] = part, True
        return tokens, done

    def complete(self) -> bool:
        """Whether the one file holds every batch."""
        whole = self._whole()
        return whole is not None and whole[1] >= self.count

    def write(self, batch: int, tokens: np.ndarray) -> None:
        """Keep batch ``batch``'s ``tokens`` (its rows)."""
        self.parts.mkdir(parents=True, exist_ok=True)
        write_atomic(self.parts / f"batch-{batch:06d}.npy", lambda temp: np.save(temp, tokens))

    def finish(self, tokens: np.ndarray) -> None:
        """All batches drawn: write them as the one file, then remove every batch file."""
        write_atomic(self.path, lambda temp: np.savez(temp, tokens=tokens, done=self.count, key=self.key))
        for folder in self.path.parent.glob(f"{self.path.stem}.parts-*"):
            shutil.rmtree(folder, ignore_errors=True)

    def _whole(self) -> tuple[np.ndarray, int] | None:
        if not self.path.is_file():
            return None
        try:
            with np.load(self.path, allow_pickle=False) as old:
                if str(old["key"]) != self.key or old["tokens"].shape != (self.count, self.length):
                    return None
                return old["tokens"], int(old["done"])
        except (OSError, ValueError, KeyError):
            return None  # unreadable: drawn again

    def _part(self, batch: int) -> np.ndarray | None:
        path = self.parts / f"batch-{batch:06d}.npy"
        if not path.is_file():
            return None
        rows = self.rows(batch)
        try:
            part = np.load(path, allow_pickle=False)
        except (OSError, ValueError):
            return None
        return part if part.shape == (rows.stop - rows.start, self.length) else None


__all__ = ["SampleCache"]
