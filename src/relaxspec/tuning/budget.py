"""The quality budget of a tuning run, and the two decisions it governs: which settings survive a
round of successive halving, and which one is chosen. Pure functions of measured rows, so the
rule "a setting over budget is never chosen" is tested on its own.

A row is a dict with ``label``, ``relaxed`` (its law may differ from the model's), ``speedup``
(median paired ratio against eager AR, or ``None``), ``tv_per_token`` (mean one-step TV record per
token; 0 for exact methods) and, for ``quality`` budgets, ``quality_ok`` (``True`` / ``False``
once measured, else absent or ``None``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from relaxspec.errors import RelaxspecError

KINDS = ("lossless", "tv", "quality")
#: While quality is unknown, this many of the fastest settings on the speed / TV front survive a
#: round besides the faster half (a ladder of relaxation strengths for the quality test).
FRONT_KEPT = 4


@dataclass(frozen=True)
class Budget:
    """``lossless``: exact methods only; ``tv``: a mean one-step TV record per token of at most
    ``max_tv_per_token``; ``quality``: the paired quality intervals against AR must hold 0 (as
    ``relaxspec bench``'s verdict reads them)."""

    kind: str
    max_tv_per_token: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RelaxspecError(f"budget must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "tv":
            value = self.max_tv_per_token
            if value is None or isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)
                                                                and 0 <= value <= 1):
                raise RelaxspecError(f"--max-tv-per-token must be a number in [0, 1], got {value!r}")
        elif self.max_tv_per_token is not None:
            raise RelaxspecError("max_tv_per_token goes with the tv budget only")

    @property
    def relaxed_allowed(self) -> bool:
        return self.kind != "lossless"

    def describe(self) -> str:
        if self.kind == "lossless":
            return "lossless (exact methods only)"
        if self.kind == "tv":
            return f"mean one-step TV <= {self.max_tv_per_token:g} per token"
        return "within AR's quality (paired intervals against AR hold 0)"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "max_tv_per_token": self.max_tv_per_token, "description": self.describe()}


def within(row: dict, budget: Budget) -> bool | None:
    """``True``: the row is within the budget; ``False``: over it; ``None``: not known yet (a
    relaxed setting whose quality has not been measured)."""
    if not row.get("relaxed"):
        return True
    if budget.kind == "lossless":
        return False
    if budget.kind == "tv":
        tv = row.get("tv_per_token")
        return None if tv is None or (isinstance(tv, float) and math.isnan(tv)) else tv <= budget.max_tv_per_token
    return row.get("quality_ok")


def _speed(row: dict) -> float:
    return row["speedup"] if row.get("speedup") is not None else -math.inf


def _tv(row: dict) -> float:
    """A row's TV per token; unknown (``None``: rows in parallel, whose record covers the
    acceptance only, or a relaxed setting without its record) counts as the worst, so it never
    crowds a certified setting off the front."""
    tv = row.get("tv_per_token")
    return math.inf if tv is None or (isinstance(tv, float) and math.isnan(tv)) else tv


def pareto(rows: list[dict]) -> list[dict]:
    """The rows no other row beats on both speed-up (higher) and TV per token (lower)."""
    front = []
    for row in rows:
        tv = _tv(row)
        if not any(_speed(o) >= _speed(row) and _tv(o) <= tv and (_speed(o) > _speed(row) or _tv(o) < tv)
                   for o in rows):
            front.append(row)
    return front


def survivors(rows: list[dict], budget: Budget, keep: int) -> list[str]:
    """The labels that go on to the next round: never one over budget; the ``keep`` fastest of
    the rest, and (when quality is still unknown) the :data:`FRONT_KEPT` fastest rows on the
    speed / TV front, so a ladder of relaxation strengths reaches the quality test instead of only
    the strongest."""
    open_rows = [r for r in rows if within(r, budget) is not False and r.get("speedup") is not None]
    ranked = sorted(open_rows, key=_speed, reverse=True)
    kept = {r["label"] for r in ranked[:max(keep, 1)]}
    if budget.kind == "quality":
        front = sorted((r for r in pareto(open_rows) if within(r, budget) is None), key=_speed, reverse=True)
        kept |= {r["label"] for r in front[:FRONT_KEPT]}
    return [r["label"] for r in ranked if r["label"] in kept]


def choose(rows: list[dict], budget: Budget) -> tuple[dict | None, dict | None]:
    """``(chosen, None)``: the fastest row within the budget that beats eager AR (speed-up > 1);
    or ``(None, closest)`` when none does, ``closest`` being the setting nearest to qualifying
    (the fastest over-budget or unjudged one that beats AR, else the fastest within budget)."""
    timed = [r for r in rows if r.get("speedup") is not None]
    inside = [r for r in timed if within(r, budget) is True]
    best = max(inside, key=_speed, default=None)
    if best is not None and best["speedup"] > 1.0:
        return best, None
    outside = [r for r in timed if within(r, budget) is not True and r["speedup"] > 1.0]
    if budget.kind == "tv":  # the smallest measured TV over the budget (an unmeasured one says nothing)
        outside = [r for r in outside if within(r, budget) is False]
        if outside:
            return None, min(outside, key=lambda r: (_tv(r), -_speed(r)))
    elif outside:
        return None, max(outside, key=_speed)
    return None, best or max(timed, key=_speed, default=None)


__all__ = ["Budget", "KINDS", "choose", "pareto", "survivors", "within"]
