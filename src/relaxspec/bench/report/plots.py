"""The plots of a benchmark (optional: matplotlib) and :func:`plot_data`, every number behind
them (written to ``plot_data.json`` whether or not matplotlib is there): ``pareto.png`` (speed-up
against TV, FID-like and class accuracy per family), ``mal_hist.png`` (tokens per target forward)
and ``accept_heatmap.png`` (where in the image drafts were accepted)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from relaxspec.bench.report.statistics import accept_length_histogram, acceptance_map, pareto_front

PLOT_DATA = "plot_data.json"
PLOT_FILES = ("pareto.png", "mal_hist.png", "accept_heatmap.png")


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

__all__ = ["PLOT_DATA", "PLOT_FILES", "make_plots", "plot_data", "plots_available"]
