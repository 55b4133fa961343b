"""What a tuning run is asked (:class:`TuneConfig`) and the limits every run keeps: ``--minutes``
at most :data:`MAX_MINUTES` (:func:`check_minutes`), at most :data:`MAX_PLAN_IMAGES` images per
planned phase, at least :data:`MIN_QUALITY_IMAGES` per setting in the quality test."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from relaxspec.errors import RelaxspecError
from relaxspec.tuning.budget import Budget

#: Fewest images the quality test scores per setting (its intervals need a sample).
MIN_QUALITY_IMAGES = 16
#: The longest --minutes taken (a week): longer is a typo, and seconds past it overflow the plans.
MAX_MINUTES = 7 * 24 * 60
#: Most images any round, the quality test or the held-out measurement plans.
MAX_PLAN_IMAGES = 400


def round_up(minutes: float) -> float:
    """``minutes`` to two significant figures, never below it (the --minutes a message suggests)."""
    rounded = float(f"{minutes:.2g}")
    while rounded < minutes:
        rounded = float(f"{rounded * 1.1:.2g}")
    return rounded


def check_minutes(minutes) -> float:
    """``--minutes``, checked: a finite number in ``(0, MAX_MINUTES]``."""
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not (
            math.isfinite(minutes) and 0 < minutes <= MAX_MINUTES):
        shown = f"{minutes:g}" if isinstance(minutes, (int, float)) and not isinstance(minutes, bool) else repr(minutes)
        raise RelaxspecError(f"--minutes must be > 0 and at most {MAX_MINUTES} (a week), got {shown}")
    return float(minutes)


@dataclass
class TuneConfig:
    """What a tuning run is asked: the budget, the wall-clock minutes, the tune and held-out
    conditions (class ids, or prompts for a text-to-image model), seeding, threads, batch size,
    whether to try compilation, and the quality source (a classifier, and real images or
    ``None`` for an independent AR reference sample)."""

    budget: Budget
    minutes: float
    tune: list
    heldout: list
    seed: int = 0
    threads: int | None = 1
    batch_size: int = 1
    compile: bool = True
    classifier: object = None
    real_images: np.ndarray | None = None
    real_labels: np.ndarray | None = None
    quality_source: str | None = None
    progress: bool = True
    command: str = "relaxspec tune"
    extra_identity: dict = field(default_factory=dict)



__all__ = ["MAX_MINUTES", "MAX_PLAN_IMAGES", "MIN_QUALITY_IMAGES", "TuneConfig", "check_minutes", "round_up"]
