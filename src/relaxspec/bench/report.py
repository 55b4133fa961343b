"""From benchmark records to numbers, tables and plots.

Per method (REFERENCE §3):

* **MAL**: image tokens per target forward over all images (bonus included; AR = 1.0), and
  **target forwards per image** (the condition prefill included, so AR = image tokens);
* **drafter share**: draft-source seconds / decode seconds, and the **time split**: the shares of
  target forwards, drafter forwards and the engine's own time (everything else: logit processing,
  sampling, tree walk, masks, KV moves, Python) — the engine-overhead goal is about the last;
* **latency per image**: median and inter-quartile range of ``DecodeResult.seconds`` (batch 1:
  one image; throughput mode: the image's share of its batch);
* **speed-up vs AR**, computed *pairwise*: the median over images of
  ``AR latency_i / method latency_i`` (both decoded image ``i``, same class and seed, within
  seconds of each other), with a percentile-bootstrap interval over images;
* **TV bound**: the mean over images of the certified per-image sum (0 for exact methods;
  docs/METHODS.md);
* **quality** (with a classifier, held-out real images and the VQ decoder): class accuracy, the
  FID-like distance on *our classifier's* features (NOT comparable to Inception FID) and
  precision / recall (k = 3) against the real images of the benchmarked classes, each with a
  bootstrap interval that resamples the generated images (the real reference set is fixed and
  shared by all methods), plus the difference to AR with its own interval — an interval holding 0
  means "indistinguishable from AR at this sample size". Precision/recall intervals are
  indicative only (resampling duplicates images, which shrinks k-NN radii).

Outputs in the benchmark folder: ``summary.json``, ``summary.csv``, ``summary.md``,
``plot_data.json`` (every number behind the plots) and, when matplotlib is installed
(``pip install 'relaxspec[plots]'``), ``pareto.png``, ``mal_hist.png`` and ``accept_heatmap.png``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from relaxspec.bench.config import BASELINE
from relaxspec.bench.run import RECORDS_FILE, SETTINGS_FILE, read_records
from relaxspec.decoding.result import certified_tv, record_tv_sum
from relaxspec.errors import RelaxspecError, shown

SUMMARY_JSON, SUMMARY_CSV, SUMMARY_MD, PLOT_DATA = "summary.json", "summary.csv", "summary.md", "plot_data.json"
PLOT_FILES = ("pareto.png", "mal_hist.png", "accept_heatmap.png")
IMAGES_DIR = "images"
FID_LIKE_NOTE = ("FID-like = Fréchet distance on our classifier's features (relaxspec.evaluation), NOT comparable "
                 "to Inception FID; compare only numbers from the same classifier, reference set and sample count")


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


# ------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------


def _bootstrap(metric_fn: Callable[..., float], *arrays, n_boot: int = 200, seed: int = 0,
               paired: bool = True, bias_correct: bool = False) -> list:
    """``[value, lo, hi]`` with :func:`relaxspec.evaluation.metrics.bootstrap_ci` (``[value,
    None, None]`` when the evaluation module is missing or ``n_boot`` is 0)."""
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


#: Paired images a speed-up interval needs: from fewer a bootstrap gives no interval worth the
#: name (from one pair, ``[x, x]``), so the bounds are ``None``.
MIN_INTERVAL_PAIRS = 5


def speedup_interval(ratios, n_boot: int = 200, seed: int = 0) -> list:
    """``[median, lo, hi]`` of paired speed-ups (baseline seconds / method seconds per image,
    ``[pairs]``): ``lo`` and ``hi`` are ``None`` under :data:`MIN_INTERVAL_PAIRS` pairs, all three
    with none."""
    ratios = np.asarray(ratios, dtype=np.float64)
    if not len(ratios):
        return [None, None, None]
    if len(ratios) < MIN_INTERVAL_PAIRS:
        return [float(np.median(ratios)), None, None]
    return _bootstrap(np.median, ratios, n_boot=n_boot, seed=seed)


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
        "mal": float(len(mine) * num_tokens / forwards.sum()),
        "mal_image_mean": float(np.mean([r["mal"] for r in mine])),
        "target_forwards_per_image": float(forwards.mean()),
        "drafter_forwards_per_image": float(np.mean([r["drafter_forwards"] for r in mine])),
        "drafter_share": float(sum(r["drafter_seconds"] for r in mine) / max(seconds.sum(), 1e-12)),
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
        row["tv_sum_mean"], row["tv_sum_lo"], row["tv_sum_hi"] = _bootstrap(np.mean, tv, n_boot=n_boot, seed=seed)
        row["tv_certified"] = certified_tv(tv)
    return row


def time_split(records: Sequence[dict]) -> dict:
    """Where the decode time went: shares of target forwards, drafter forwards and the rest (the
    engine: sampling, tree walk, masks, cache moves, Python). ``None`` for records made before
    forwards were timed."""
    if not records or any("target_forward_seconds" not in r for r in records):
        return {"target_share": None, "drafter_forward_share": None, "overhead_share": None}
    total = max(sum(r["seconds"] for r in records), 1e-12)
    target = sum(r["target_forward_seconds"] for r in records) / total
    drafter = sum(r["drafter_forward_seconds"] for r in records) / total
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


# ------------------------------------------------------------------------------------------
# Quality
# ------------------------------------------------------------------------------------------


def image_folder_name(label: str) -> str:
    """A file-system-safe folder name for a method label (``lantern++`` -> ``lanternpp``)."""
    return re.sub(r"[^A-Za-z0-9._=,-]+", "_", label.replace("+", "p")).strip("_") or "method"


def ensure_images(out_dir: str | Path, records: Sequence[dict], vq, *, batch_size: int = 16,
                  progress: bool = False) -> dict[str, list[Path]]:
    """Decode each record's tokens with ``vq`` once: ``images/<method>/NNNN.png`` (kept across
    runs: only missing files are decoded). ``images/SETTINGS_HASH`` names the benchmark the
    images belong to; after ``--overwrite`` with other settings every image is decoded again.
    Returns the files per method label, by image index."""
    from tqdm.auto import tqdm

    from relaxspec.files import write_atomic, write_png
    from relaxspec.models.llamagen.vq import to_uint8

    out = Path(out_dir) / IMAGES_DIR
    marker = out / "SETTINGS_HASH"
    digest = str(records[0].get("settings_hash")) if records else ""
    current = marker.is_file() and marker.read_text().strip() == digest
    files: dict[str, list[Path]] = {}
    missing: list[tuple[Path, list[int]]] = []
    for r in sorted(records, key=lambda r: (r["method"], r["index"])):
        path = out / image_folder_name(r["method"]) / f"{r['index']:04d}.png"
        files.setdefault(r["method"], []).append(path)
        if not (current and path.is_file()):
            missing.append((path, r["tokens"]))
    if missing:
        device = next(vq.parameters()).device
        for start in tqdm(range(0, len(missing), batch_size), desc="vq decode", disable=True if not progress else None):
            chunk = missing[start : start + batch_size]
            tokens = torch.tensor([t for _, t in chunk], dtype=torch.long, device=device)
            with torch.inference_mode():
                pixels = to_uint8(vq.decode(tokens)).cpu().numpy()
            for (path, _), image in zip(chunk, pixels):
                path.parent.mkdir(parents=True, exist_ok=True)
                write_png(path, image)
    if not current:  # only once every image is this benchmark's (an interruption redoes them all)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(marker, lambda temp: temp.write_text(digest + "\n"))
    return files


def read_pngs(paths: Sequence[Path]) -> np.ndarray:
    """uint8 ``[n, H, W, 3]``."""
    from PIL import Image

    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(np.asarray(image.convert("RGB")))
    return np.stack(images)


def load_real_images(path: str | Path, classes: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Held-out real images (an ``.npz`` with ``images`` uint8 ``[n, H, W, 3]`` and ``labels``),
    restricted to ``classes`` (the benchmarked ones) when given."""
    from relaxspec.evaluation.classifier import load_split

    data = load_split(path)
    images, labels = data.images, data.labels
    if classes is not None:
        keep = np.isin(labels, np.asarray(sorted({int(c) for c in classes})))
        if not keep.any():
            raise RelaxspecError(f"{path}: no real images of the benchmarked classes")
        images, labels = images[keep], labels[keep]
    return images, labels


def quality_metrics(fake: dict[str, tuple[np.ndarray, np.ndarray]], classifier, real_images: np.ndarray, *,
                    indices: dict[str, Sequence[int]] | None = None, baseline: str = BASELINE, k: int = 3,
                    n_boot: int = 200, seed: int = 0) -> dict[str, dict]:
    """Per method label: ``class_accuracy``, ``fid_like``, ``precision``, ``recall`` as ``[value,
    lo, hi]``, and the differences to the baseline (``*_diff_vs_ar``: method minus baseline on the
    images both decoded, resampled pairwise by image). ``fake[label] = (uint8 images [n, H, W, 3],
    conditioning classes [n])``; ``indices[label]`` the image index of each row (default
    ``0 .. n-1``)."""
    from relaxspec.evaluation.metrics import QualityReference

    reference = QualityReference(classifier, real_images, k=k)
    fid = reference.fid
    per_method: dict[str, dict] = {}
    raw: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for label, (images, labels) in fake.items():
        measured = reference.measure(images, labels, n_boot=n_boot, seed=seed)
        report = measured.report
        raw[label] = measured.features, measured.hits
        per_method[label] = {
            "n_fake": report["n_fake"], "n_real": report["n_real"],
            **{name: None if report[name] is None else list(report[name]) for name in ("class_accuracy", "fid_like")},
            # [value, lo, hi], the interval bias-corrected and clipped to [0, 1]
            **{name: None if report[f"{name}_interval"] is None else list(report[f"{name}_interval"])
               for name in ("precision", "recall")},
            # which classes the model draws well: {class id: [hits, images]}
            "class_accuracy_by_class": report["class_accuracy_by_class"],
        }

    def rows_of(label: str) -> np.ndarray:
        return np.asarray(indices[label] if indices and label in indices else np.arange(len(raw[label][0])))

    if baseline in raw:
        for label in raw:
            if label == baseline:
                continue
            common, base_rows, my_rows = np.intersect1d(rows_of(baseline), rows_of(label), return_indices=True)
            if not len(common):
                continue
            base_feats, base_hits = raw[baseline][0][base_rows], raw[baseline][1][base_rows]
            feats, hits = raw[label][0][my_rows], raw[label][1][my_rows]
            row = per_method[label]
            row["class_accuracy_diff_vs_ar"] = _bootstrap(lambda a, b: b.mean() - a.mean(), base_hits, hits,
                                                          n_boot=n_boot, seed=seed)
            if len(feats) >= 2:
                row["fid_like_diff_vs_ar"] = _bootstrap(lambda a, b: fid(b) - fid(a), base_feats, feats,
                                                        n_boot=n_boot, seed=seed, bias_correct=True)
    return per_method


# ------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------

QUALITY_KEYS = ("class_accuracy", "fid_like", "precision", "recall", "class_accuracy_diff_vs_ar", "fid_like_diff_vs_ar")
CSV_COLUMNS = ("label", "family", "sweep", "method", "images", "mal", "mal_image_mean", "target_forwards_per_image",
               "drafter_forwards_per_image", "drafter_share", "target_share", "drafter_forward_share",
               "overhead_share", "latency_median_s", "latency_q25_s", "latency_q75_s",
               "latency_iqr_s", "latency_mean_s", "wall_median_s", "images_per_second", "speedup", "speedup_lo",
               "speedup_hi", "speedup_pairs", "tv_sum_mean", "tv_sum_lo", "tv_sum_hi", "tv_certified")


def _fmt(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _ci(triple, digits: int = 2) -> str:
    if triple is None:
        return "–"
    value, lo, hi = triple
    return _fmt(value, digits) + ("" if lo is None else f" [{_fmt(lo, digits)}, {_fmt(hi, digits)}]")


def _ms(seconds: float) -> str:
    ms = seconds * 1000.0
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


def _split(row: dict) -> str:
    if row.get("overhead_share") is None:
        return f"– / {100 * row['drafter_share']:.0f}% / –"
    return " / ".join(f"{100 * row[k]:.0f}%" for k in ("target_share", "drafter_forward_share", "overhead_share"))


def within_baseline_quality(row: dict) -> bool | None:
    """Whether a method's quality is not measurably worse than the baseline's: the 95 % paired
    intervals of its class-accuracy difference reach 0 or above and of its FID-like difference
    reach 0 or below (``None`` when its quality was not measured against the baseline)."""
    quality = row.get("quality") or {}
    accuracy, fid = quality.get("class_accuracy_diff_vs_ar"), quality.get("fid_like_diff_vs_ar")
    accuracy = None if accuracy is None or accuracy[2] is None else accuracy  # no interval: not measured
    fid = None if fid is None or fid[1] is None else fid
    if accuracy is None and fid is None:
        return None
    return (accuracy is None or accuracy[2] >= 0) and (fid is None or fid[1] <= 0)


def verdict(rows: Sequence[dict], baseline: str = BASELINE) -> str:
    """One line: the fastest method (median speed-up) whose quality stays within the baseline's
    intervals, or the fastest overall when quality was not measured."""
    timed = [row for row in rows if row["label"] != baseline and row.get("speedup") is not None]
    if not timed:
        return f"verdict: no method has a speed-up against {baseline}"
    judged = {row["label"]: within_baseline_quality(row) for row in timed}

    def speed(row: dict) -> str:
        interval = "" if row.get("speedup_lo") is None else f" [{row['speedup_lo']:.2f}, {row['speedup_hi']:.2f}]"
        return f"{row['speedup']:.2f}x {baseline}{interval}"

    fastest = max(timed, key=lambda row: row["speedup"])
    if fastest["speedup"] <= 1.0:
        return f"verdict: no method is faster than {baseline} (the fastest, {fastest['label']}, is {speed(fastest)})"
    if all(v is None for v in judged.values()):
        return f"verdict: fastest is {fastest['label']}, {speed(fastest)} (quality not measured)"
    good = [row for row in timed if judged[row["label"]]]
    if not good:
        return f"verdict: no method keeps quality within {baseline}'s intervals; fastest overall is {fastest['label']}"
    best = max(good, key=lambda row: row["speedup"])
    if best["speedup"] <= 1.0:
        return (f"verdict: no method within {baseline}'s quality is faster than {baseline} (the fastest overall "
                f"is {fastest['label']}, {speed(fastest)})")
    return f"verdict: fastest within {baseline}'s quality is {best['label']}, {speed(best)}"


def markdown_table(rows: Sequence[dict], baseline: str = BASELINE) -> str:
    """One row per method: speed, certificate and (when measured) quality."""
    quality = any(row.get("quality") for row in rows)
    against = "AR" if baseline == BASELINE else f"`{baseline}`"
    head = ["method", "images", "MAL", "target fwd / image", "time: target / drafter / engine", "latency ms, median [IQR]",
            f"speed-up vs {against} [95% CI]", "TV sum / image", "TV certified"]
    if quality:
        head += ["class acc. [95% CI]", "FID-like [95% CI]", "precision", "recall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if not row.get("images"):
            lines.append("| " + " | ".join([row["label"], "0"] + ["–"] * (len(head) - 2)) + " |")
            continue
        speedup = None if row["speedup"] is None else [row["speedup"], row["speedup_lo"], row["speedup_hi"]]
        cells = [f"`{row['label']}`", str(row["images"]), _fmt(row["mal"]), _fmt(row["target_forwards_per_image"], 1),
                 _split(row),
                 f"{_ms(row['latency_median_s'])} [{_ms(row['latency_q25_s'])}, {_ms(row['latency_q75_s'])}]",
                 _ci(speedup), _fmt(row["tv_sum_mean"], 3), _fmt(row["tv_certified"], 3)]
        if quality:
            q = row.get("quality") or {}
            cells += [_ci(q.get("class_accuracy"), 3), _ci(q.get("fid_like"), 2), _ci(q.get("precision"), 3),
                      _ci(q.get("recall"), 3)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_vs_ar(rows: Sequence[dict]) -> str:
    """Quality differences to AR (method minus AR), if measured."""
    with_diff = [r for r in rows if (r.get("quality") or {}).get("class_accuracy_diff_vs_ar")]
    if not with_diff:
        return ""
    lines = ["| method | class acc. − AR [95% CI] | FID-like − AR [95% CI] |", "|---|---|---|"]
    for row in with_diff:
        q = row["quality"]
        lines.append(f"| `{row['label']}` | {_ci(q.get('class_accuracy_diff_vs_ar'), 3)} | "
                     f"{_ci(q.get('fid_like_diff_vs_ar'), 2)} |")
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[dict]) -> str:
    buffer = io.StringIO()
    columns = list(CSV_COLUMNS)
    for key in QUALITY_KEYS:
        columns += [key, f"{key}_lo", f"{key}_hi"]
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        flat = dict(row)
        flat["sweep"] = ";".join(f"{k}={v}" for k, v in (row.get("sweep") or {}).items())
        for key in QUALITY_KEYS:
            triple = (row.get("quality") or {}).get(key)
            if triple is not None:
                flat[key], flat[f"{key}_lo"], flat[f"{key}_hi"] = triple
        writer.writerow({k: ("" if v is None else v) for k, v in flat.items() if k in columns})
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------
# Plots (optional: matplotlib)
# ------------------------------------------------------------------------------------------


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def make_plots(plot_data: dict, out_dir: str | Path) -> list[Path]:
    """``pareto.png``, ``mal_hist.png``, ``accept_heatmap.png`` from :func:`plot_data`'s numbers;
    needs matplotlib (``[]`` without it)."""
    if not plots_available():
        return []
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    out = Path(out_dir)
    written = []
    points = plot_data["pareto"]["points"]
    panels = [(key, name) for key, name in (("tv_sum_mean", "TV record sum (mean per image)"),
                                            ("fid_like", "FID-like (our classifier)"),
                                            ("class_accuracy", "class accuracy"))
              if any(p.get(key) is not None for p in points)]
    if panels and any(p.get("speedup") is not None for p in points):
        fig = Figure(figsize=(5.5 * len(panels), 4.2), layout="constrained")
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        families = list(dict.fromkeys(p["family"] for p in points))
        for ax, (key, name) in zip(axes, panels):
            for n, family in enumerate(families):
                mine = [p for p in points if p["family"] == family and p.get("speedup") is not None
                        and p.get(key) is not None]
                if not mine:
                    continue
                color = f"C{n % 10}"
                x = [p["speedup"] for p in mine]
                y = [p[key] for p in mine]
                xerr = [[max(p["speedup"] - (p["speedup_lo"] if p["speedup_lo"] is not None else p["speedup"]), 0)
                         for p in mine],
                        [max((p["speedup_hi"] if p["speedup_hi"] is not None else p["speedup"]) - p["speedup"], 0)
                         for p in mine]]
                ax.errorbar(x, y, xerr=xerr, fmt="o-" if len(mine) > 1 else "o", color=color, label=family,
                            capsize=2, markersize=4, linewidth=1)
                for p in mine:
                    if p.get("sweep"):
                        ax.annotate(",".join(f"{v}" for v in p["sweep"].values()), (p["speedup"], p[key]),
                                    fontsize=7, textcoords="offset points", xytext=(3, 3))
            ax.set_xlabel("speed-up vs AR (median per image)")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.savefig(out / "pareto.png", dpi=130)
        written.append(out / "pareto.png")

    hists = plot_data["accept_length_hist"]
    labels = list(hists)
    if labels:
        cols = min(4, len(labels))
        rows = math.ceil(len(labels) / cols)
        fig = Figure(figsize=(3.2 * cols, 2.4 * rows), layout="constrained")
        axes = fig.subplots(rows, cols, squeeze=False).ravel()
        for ax, label in zip(axes, labels):
            hist = {int(k): v for k, v in hists[label].items()}
            total = max(sum(hist.values()), 1)
            ax.bar(list(hist), [v / total for v in hist.values()], color="C0")
            ax.set_xlim(0.5, max(hist, default=1) + 0.5)
            ax.xaxis.get_major_locator().set_params(integer=True)
            mal = plot_data["mal"].get(label)
            ax.set_title(f"{label}" + ("" if mal is None else f" (MAL {mal:.2f})"), fontsize=8)
            ax.set_xlabel("tokens per target forward", fontsize=7)
            ax.tick_params(labelsize=7)
        for ax in axes[len(labels):]:
            ax.axis("off")
        fig.savefig(out / "mal_hist.png", dpi=130)
        written.append(out / "mal_hist.png")

    maps = {k: v for k, v in plot_data["accept_heatmap"].items() if v is not None}
    if maps:
        labels = list(maps)
        cols = min(4, len(labels))
        rows = math.ceil(len(labels) / cols)
        fig = Figure(figsize=(2.8 * cols + 0.8, 2.6 * rows), layout="constrained")
        axes = fig.subplots(rows, cols, squeeze=False).ravel()
        image = None
        for ax, label in zip(axes, labels):
            image = ax.imshow(np.asarray(maps[label]), vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
            ax.set_title(label, fontsize=8)
            side = len(maps[label])
            ticks = sorted({0, side // 2, side - 1})
            ax.set_xticks(ticks)
            ax.set_yticks(ticks)
            ax.tick_params(labelsize=6)
            ax.set_xlabel("token column", fontsize=7)
            ax.set_ylabel("token row", fontsize=7)
        for ax in axes[len(labels):]:
            ax.axis("off")
        fig.colorbar(image, ax=list(axes), shrink=0.8, label="share of images: token was an accepted draft")
        fig.savefig(out / "accept_heatmap.png", dpi=130)
        written.append(out / "accept_heatmap.png")
    return written


# ------------------------------------------------------------------------------------------
# Everything
# ------------------------------------------------------------------------------------------


def plot_data(rows: Sequence[dict], records: Sequence[dict], num_tokens: int) -> dict:
    """Every number behind the plots (written to ``plot_data.json`` whether or not matplotlib is there)."""
    points = []
    for row in rows:
        if not row.get("images"):
            continue
        q = row.get("quality") or {}
        points.append({"label": row["label"], "family": row.get("family", row["label"]), "sweep": row.get("sweep") or {},
                       "speedup": row["speedup"], "speedup_lo": row["speedup_lo"], "speedup_hi": row["speedup_hi"],
                       "tv_sum_mean": row["tv_sum_mean"], "mal": row["mal"],
                       "fid_like": (q.get("fid_like") or [None])[0], "class_accuracy": (q.get("class_accuracy") or [None])[0]})
    by_label = {row["label"]: [r for r in records if r["method"] == row["label"]] for row in rows}
    heatmaps = {label: (None if (m := acceptance_map(recs, num_tokens)) is None else m.round(4).tolist())
                for label, recs in by_label.items() if recs}
    return {
        "pareto": {"x": "speedup", "points": points,
                   "fronts": {"tv_sum_mean": pareto_front(points, "tv_sum_mean"),
                              "fid_like": pareto_front(points, "fid_like"),
                              "class_accuracy": pareto_front(points, "class_accuracy", lower_is_better=False)}},
        "accept_length_hist": {label: accept_length_histogram(recs) for label, recs in by_label.items() if recs},
        "mal": {row["label"]: row.get("mal") for row in rows if row.get("images")},
        "mal_per_image": {label: [round(r["mal"], 4) for r in recs] for label, recs in by_label.items() if recs},
        "accept_heatmap": heatmaps,
        "accept_heatmap_note": "share of images whose token at each grid position (raster order) was an accepted draft",
    }


def load_bench(out_dir: str | Path) -> tuple[dict, list[dict]]:
    """``(settings, records)`` of the benchmark in ``out_dir`` (records of its settings only)."""
    out = Path(out_dir)
    path = out / SETTINGS_FILE
    if not path.is_file():
        raise RelaxspecError(f"{out}: no {SETTINGS_FILE} (not a relaxspec bench folder)")
    try:
        meta = json.loads(path.read_text())
        digest, settings = meta["settings_hash"], meta["settings"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise RelaxspecError(f"{path}: not a relaxspec bench settings file") from None
    records = read_records(out, digest)
    if not records:
        raise RelaxspecError(f"{out / RECORDS_FILE}: no records of this benchmark yet")
    return settings, records


def write_report(out_dir: str | Path, *, vq=None, classifier=None, real_data: str | Path | None = None,
                 n_boot: int = 200, k: int = 3, plots: bool = True, progress: bool = False,
                 baseline: str | None = None) -> dict:
    """Summarise the benchmark in ``out_dir`` and write every output; returns ``{"rows", "files",
    "notes"}``. Quality needs ``vq`` (to decode the tokens), ``classifier`` and ``real_data``.
    ``baseline``: the label speed-ups are measured against (default: the run's, plain AR)."""
    from relaxspec.files import write_atomic, write_json

    out = Path(out_dir)
    settings, records = load_bench(out)
    methods = settings.get("methods", [])
    labels = [m["label"] for m in methods] or list(dict.fromkeys(r["method"] for r in records))
    num_tokens = int(settings.get("image_tokens") or len(records[0]["tokens"]))
    if baseline is not None and baseline not in labels:
        raise RelaxspecError(f"--baseline {shown(baseline)} is not a method of the benchmark in {out} "
                             f"({', '.join(labels)})")
    baseline = baseline or settings.get("baseline", BASELINE)
    rows = summarize(records, labels, num_tokens=num_tokens, baseline=baseline, n_boot=n_boot)
    info = {m["label"]: m for m in methods}
    for row in rows:
        spec = info.get(row["label"], {})
        row["sweep"], row["family"] = spec.get("sweep") or {}, spec.get("family", row.get("family", row["label"]))
        row["method"] = (spec.get("options") or {}).get("method")
        row["description"] = spec.get("description")
    notes = []
    if baseline not in labels or not any(r["method"] == baseline for r in records):
        notes.append(f"no {baseline} records: speed-ups are not available")

    quality_done = False
    if "classes" not in settings and classifier is not None:
        notes.append("quality not measured: the classifier scores class-conditional images, these are from prompts")
    elif classifier is None or real_data is None:
        notes.append("quality not measured (give --classifier and --real-data)")
    elif vq is None:
        notes.append("quality not measured (no VQ decoder to turn tokens into images)")
    else:
        try:
            import relaxspec.evaluation.metrics  # noqa: F401
        except ImportError as err:
            notes.append(f"quality not measured: relaxspec.evaluation is not importable ({err})")
        else:
            files = ensure_images(out, records, vq, progress=progress)
            real_images, _ = load_real_images(real_data, settings.get("classes"))
            quality_done = True
            fake, indices = {}, {}
            for label in labels:
                mine = sorted((r for r in records if r["method"] == label), key=lambda r: r["index"])
                if mine:
                    fake[label] = (read_pngs(files[label]), np.array([r["class"] for r in mine]))
                    indices[label] = [r["index"] for r in mine]
            try:
                quality = quality_metrics(fake, classifier, real_images, indices=indices, baseline=baseline, k=k,
                                          n_boot=n_boot)
            except ImportError as err:  # scipy (the Fréchet distance's matrix square root) is missing
                quality_done = False
                notes.append(f"quality not measured: {err} (pip install scipy)")
            else:
                for row in rows:
                    row["quality"] = quality.get(row["label"])
                notes.append(FID_LIKE_NOTE)
                notes.append("quality intervals resample the generated images (the real reference set is fixed); "
                             "precision/recall intervals are indicative only")

    data = plot_data(rows, records, num_tokens)
    written = [out / SUMMARY_JSON, out / SUMMARY_CSV, out / SUMMARY_MD, out / PLOT_DATA]
    if plots:
        pngs = make_plots(data, out)
        if pngs:
            written += pngs
        else:
            notes.append(f"plots not drawn: matplotlib is not installed (pip install 'relaxspec[plots]'); "
                         f"their numbers are in {PLOT_DATA}")
    summary = {"settings": settings, "methods": rows, "notes": notes, "quality_measured": quality_done,
               "verdict": verdict(rows, baseline),
               "definitions": {
                   "latency": "DecodeResult.seconds per image: decoding from the condition prefill to the last token, "
                              "before VQ decoding (median and quartiles over images)",
                   "speedup": f"median over images of {baseline} latency_i / method latency_i, percentile-bootstrap "
                              f"95% interval over images",
                   "mal": "image tokens / target forwards (bonus included, AR = 1.0)",
                   "target_forwards_per_image": "target forwards per image, the condition prefill included",
                   "drafter_share": "draft-source seconds (EAGLE drafter, or the Jacobi window's bookkeeping) / "
                                    "decode seconds",
                   "target_share": "seconds inside the target model's forward calls / decode seconds",
                   "drafter_forward_share": "seconds inside the drafter model's forward calls / decode seconds",
                   "overhead_share": "the rest / decode seconds: the engine (logit processing, sampling, drafting "
                                     "bookkeeping, tree walk, masks, KV moves, Python)",
                   "tv_sum": "mean over images of the per-image sum of one-step TV records (0 for exact methods)",
                   "tv_certified": "min(1, tv_sum): bounds the TV distance between the law of one image and the model's (docs/METHODS.md); 1 means the certificate says nothing"}}
    write_json(out / SUMMARY_JSON, summary)
    write_atomic(out / SUMMARY_CSV, lambda temp: temp.write_text(csv_text(rows)))
    write_atomic(out / SUMMARY_MD, lambda temp: temp.write_text(markdown_report(rows, settings, notes, baseline)))
    write_json(out / PLOT_DATA, data)
    return {"rows": rows, "files": written, "notes": notes, "verdict": summary["verdict"], "baseline": baseline}


def markdown_report(rows: Sequence[dict], settings: dict, notes: Sequence[str], baseline: str = BASELINE) -> str:
    sampling = settings.get("sampling", {})
    classes = settings.get("classes", [])
    images = (f"{len(classes)} images ({len(set(classes))} classes)" if "prompts" not in settings else
              f"{len(settings['prompts'])} images ({len(set(settings['prompts']))} prompts)")
    setup = (f"{images}, batch size {settings.get('batch_size')}, "
             f"{settings.get('threads')} thread(s); sampling: cfg {sampling.get('cfg_scale')}, temperature "
             f"{sampling.get('temperature')}, top-k {sampling.get('top_k')}, top-p {sampling.get('top_p')}; "
             f"seed {settings.get('seed')}.")
    legend = ("Latency: decoding time per image (condition prefill to last token, before VQ decoding). Speed-up: "
              f"median over images of {baseline} latency / method latency on the same image, 95% bootstrap interval. MAL: "
              "tokens per target forward (bonus included). Drafter share: time in the draft source (EAGLE drafter, "
              "or the Jacobi window's bookkeeping). TV bound: mean certified per-image TV sum (0 = exact).")
    text = ["# relaxspec bench", "", setup, "", legend, "", markdown_table(rows, baseline)]
    vs_ar = markdown_vs_ar(rows)
    if vs_ar:
        text += ["Quality relative to AR (method − AR; an interval holding 0: indistinguishable at this sample size):",
                 "", vs_ar]
    text += [verdict(rows, baseline).replace("verdict: ", "**Verdict:** ", 1), ""]
    if notes:
        text += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(text)


__all__ = [
    "verdict",
    "within_baseline_quality",
    "accept_length_histogram",
    "acceptance_map",
    "accepted_flags",
    "csv_text",
    "ensure_images",
    "load_bench",
    "load_real_images",
    "make_plots",
    "markdown_table",
    "method_summary",
    "pairwise_speedups",
    "pareto_front",
    "plot_data",
    "plots_available",
    "quality_metrics",
    "summarize",
    "write_report",
]
