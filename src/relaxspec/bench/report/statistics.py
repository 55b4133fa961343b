"""The numbers of a benchmark: per-method speed summaries, paired speed-ups with their intervals,
MAL, acceptance maps and histograms, and the Pareto front. :func:`bootstrap` is the one interval
implementation ``relaxspec bench`` and ``relaxspec tune`` use.

MAL has one meaning everywhere (:func:`tokens_per_forward`): image tokens committed per target
forward over a run's images, total tokens / total target forwards (the condition prefill's
forward and the bonus token included; AR = 1.0). The mean of the per-image MALs weighs an image
decoded in few forwards as much as one decoded in many; bench reports it as ``mal_image_mean``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from relaxspec.bench.config import BASELINE
from relaxspec.decoding.result import certified_tv, record_tv_sum

#: Paired images a speed-up interval needs: from fewer a bootstrap gives no interval worth the
#: name (from one pair, ``[x, x]``), so the bounds are ``None``.
MIN_INTERVAL_PAIRS = 5


# ------------------------------------------------------------------------------------------
# Per-record quantities
# ------------------------------------------------------------------------------------------


def accepted_flags(accept_lengths: Sequence[int], num_tokens: int) -> np.ndarray | None:
    """bool ``[num_tokens]``: which committed tokens were accepted drafts.

    ``accept_lengths`` lists the tokens committed by each target forward (the prefill's first
    token included); in each, all but the last were accepted drafts and the last is the bonus /
    correction token drawn from the target. ``None`` if the lengths do not add up to the image.
    """
    if sum(accept_lengths) != num_tokens:
        return None
    flags = np.zeros(num_tokens, dtype=bool)
    position = 0
    for count in accept_lengths:
        flags[position : position + count - 1] = True
        position += count
    return flags


def acceptance_map(records: Sequence[dict], num_tokens: int) -> np.ndarray | None:
    """``[grid, grid]`` (raster order, as the tokens are generated): the share of images whose
    token at that position was an accepted draft (``[1, num_tokens]`` for a non-square count)."""
    flags = [f for r in records if (f := accepted_flags(r["accept_lengths"], num_tokens)) is not None]
    if not flags:
        return None
    share = np.mean(flags, axis=0)
    grid = math.isqrt(num_tokens)
    return share.reshape(grid, grid) if grid * grid == num_tokens else share.reshape(1, num_tokens)


def accept_length_histogram(records: Sequence[dict]) -> dict[int, int]:
    """Tokens committed per speculative step -> how many steps (the prefill is not a step)."""
    counts = Counter(n for r in records for n in r["accept_lengths"][1:])
    return {int(k): int(counts[k]) for k in sorted(counts)}


def tokens_per_forward(records: Sequence[dict], num_tokens: int) -> float:
    """MAL: image tokens committed per target forward over ``records`` (each an image of
    ``num_tokens`` tokens): total tokens / total target forwards, the prefill's forward and the
    bonus token included, so AR is 1.0. Not the mean of the records' own ``mal`` (see the module
    docstring)."""
    forwards = sum(r["target_forwards"] for r in records)
    return float(len(records) * num_tokens / forwards)


# ------------------------------------------------------------------------------------------
# Intervals
# ------------------------------------------------------------------------------------------


def bootstrap(metric_fn: Callable[..., float], *arrays, n_boot: int = 200, seed: int = 0,
              paired: bool = True, bias_correct: bool = False) -> list:
    """``[value, lo, hi]``: ``metric_fn(*arrays)`` and its 95 % percentile-bootstrap interval over
    the rows (images) of ``arrays``, from :func:`relaxspec.evaluation.metrics.bootstrap_ci`
    (``[value, None, None]`` when the evaluation module is missing or ``n_boot`` is 0)."""
    value = float(metric_fn(*arrays))
    if n_boot < 1:
        return [value, None, None]
    try:
        from relaxspec.evaluation.metrics import bootstrap_ci
    except ImportError:
        return [value, None, None]
    _, lo, hi = bootstrap_ci(metric_fn, *arrays, n_boot=n_boot, seed=seed, paired=paired, bias_correct=bias_correct)
    return [value, lo, hi]


def pairwise_speedups(records: Sequence[dict], label: str, baseline: str = BASELINE) -> np.ndarray:
    """``AR latency_i / method latency_i`` for every image ``i`` both decoded."""
    base = {r["index"]: r["seconds"] for r in records if r["method"] == baseline}
    return np.array([base[r["index"]] / r["seconds"] for r in records
                     if r["method"] == label and r["index"] in base and r["seconds"] > 0], dtype=np.float64)


def speedup_interval(ratios, n_boot: int = 200, seed: int = 0) -> list:
    """``[median, lo, hi]`` of paired speed-ups (baseline seconds / method seconds per image,
    ``[pairs]``): ``lo`` and ``hi`` are ``None`` under :data:`MIN_INTERVAL_PAIRS` pairs, all three
    with none."""
    ratios = np.asarray(ratios, dtype=np.float64)
    if not len(ratios):
        return [None, None, None]
    if len(ratios) < MIN_INTERVAL_PAIRS:
        return [float(np.median(ratios)), None, None]
    return bootstrap(np.median, ratios, n_boot=n_boot, seed=seed)


# ------------------------------------------------------------------------------------------
# Per-method summaries
# ------------------------------------------------------------------------------------------


def method_summary(records: Sequence[dict], label: str, num_tokens: int, baseline: str = BASELINE,
                   n_boot: int = 200, seed: int = 0) -> dict:
    """The speed numbers of one method (its records among ``records``; the baseline's are needed
    for the speed-up)."""
    mine = [r for r in records if r["method"] == label]
    if not mine:
        return {"label": label, "images": 0}
    seconds = np.array([r["seconds"] for r in mine])
    forwards = np.array([r["target_forwards"] for r in mine], dtype=np.float64)
    tv = np.array([record_tv_sum(r) for r in mine])
    q25, median, q75 = np.quantile(seconds, [0.25, 0.5, 0.75])
    ratios = pairwise_speedups(records, label, baseline)
    row = {
        "label": label, "family": mine[0].get("family", label), "images": len(mine),
        "mal": tokens_per_forward(mine, num_tokens),
        "mal_image_mean": float(np.mean([r["mal"] for r in mine])),
        "target_forwards_per_image": float(forwards.mean()),
        "drafter_forwards_per_image": float(np.mean([r["drafter_forwards"] for r in mine])),
        "drafter_share": None if any(r["drafter_seconds"] is None for r in mine)  # profile mode only
        else float(sum(r["drafter_seconds"] for r in mine) / max(seconds.sum(), 1e-12)),
        **time_split(mine),
        "latency_median_s": float(median), "latency_q25_s": float(q25), "latency_q75_s": float(q75),
        "latency_iqr_s": float(q75 - q25), "latency_mean_s": float(seconds.mean()),
        "wall_median_s": float(np.median([r["wall_seconds"] for r in mine])),
        "images_per_second": float(1.0 / max(seconds.mean(), 1e-12)),
        "speedup": None, "speedup_lo": None, "speedup_hi": None, "speedup_pairs": len(ratios),
    }
    row["speedup"], row["speedup_lo"], row["speedup_hi"] = speedup_interval(ratios, n_boot=n_boot, seed=seed)
    if np.isnan(tv).any():  # run with --no-tv-record: nothing was measured
        row["tv_sum_mean"] = row["tv_sum_lo"] = row["tv_sum_hi"] = row["tv_certified"] = None
    else:
        row["tv_sum_mean"], row["tv_sum_lo"], row["tv_sum_hi"] = bootstrap(np.mean, tv, n_boot=n_boot, seed=seed)
        row["tv_certified"] = certified_tv(tv)
    rows = max(int(r.get("rows", 1)) for r in mine)
    if rows > 1:  # rows in parallel: not the model's law, so the record certifies nothing about it
        row["rows"], row["tv_certified"] = rows, None
    return row


def time_split(records: Sequence[dict]) -> dict:
    """Where the decode time went: shares of target forwards, drafter forwards and the rest (the
    engine: sampling, tree walk, masks, cache moves, Python). ``None`` for records not made in
    profile mode (``--profile``: a step compiled as one graph has no parts to time), or made before
    forwards were timed."""
    if not records or any(r.get("target_forward_seconds") is None for r in records):
        return {"target_share": None, "drafter_forward_share": None, "overhead_share": None}
    total = max(sum(r["seconds"] for r in records), 1e-12)
    target = sum(r["target_forward_seconds"] for r in records) / total
    drafter = sum(r["drafter_forward_seconds"] or 0.0 for r in records) / total
    return {"target_share": target, "drafter_forward_share": drafter, "overhead_share": max(1.0 - target - drafter, 0.0)}


def summarize(records: Sequence[dict], labels: Sequence[str] | None = None, *, num_tokens: int | None = None,
              baseline: str = BASELINE, n_boot: int = 200, seed: int = 0) -> list[dict]:
    """One :func:`method_summary` row per method, in ``labels`` order (default: first seen)."""
    if not records:
        return []
    if labels is None:
        labels = list(dict.fromkeys(r["method"] for r in records))
    if num_tokens is None:
        num_tokens = len(records[0]["tokens"]) if "tokens" in records[0] else sum(records[0]["accept_lengths"])
    return [method_summary(records, label, num_tokens, baseline, n_boot, seed) for label in labels]


def pareto_front(points: Sequence[dict], y: str, lower_is_better: bool = True) -> list[str]:
    """Labels of the points no other point beats on both speed-up (higher) and ``y``."""
    usable = [p for p in points if p.get("speedup") is not None and p.get(y) is not None]
    sign = 1.0 if lower_is_better else -1.0
    front = []
    for p in usable:
        dominated = any(q["speedup"] >= p["speedup"] and sign * q[y] <= sign * p[y]
                        and (q["speedup"] > p["speedup"] or sign * q[y] < sign * p[y]) for q in usable)
        if not dominated:
            front.append(p["label"])
    return front


__all__ = ["MIN_INTERVAL_PAIRS", "accept_length_histogram", "acceptance_map", "accepted_flags", "bootstrap",
           "method_summary", "pairwise_speedups", "pareto_front", "speedup_interval", "summarize", "time_split",
           "tokens_per_forward"]
