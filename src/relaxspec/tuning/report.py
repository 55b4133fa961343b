"""What a tuning run leaves: ``tune.json`` (the preset), ``frontier.png`` (every tried setting's
speed-up against its TV per token, the choice marked), ``settings.csv`` (the numbers behind it)
and ``report.md``.

A speed-up from fewer than :data:`~relaxspec.bench.report.MIN_INTERVAL_PAIRS` paired images has
no interval: it is written as ``[value, null, null]`` with its pair count (``pairs``), shown as
``1.07x (n/a: only 1 pair)``, and :func:`interval_note` says in one line what the budget allowed.
A preset is still written then (the choice is the best the budget could find), with that honest
null interval; the held-out measurement always plans at least that many images, so its interval
is missing only when a run resumed from an older plan.

MAL (the rows, ``settings.csv``, the held-out measurement) is bench's: image tokens committed per
target forward over all of a setting's images
(:func:`~relaxspec.bench.report.statistics.tokens_per_forward`), not a mean of per-image MALs."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from relaxspec import methods
from relaxspec.devices import machine_identity, machine_kind
from relaxspec.files import write_atomic, write_json
from relaxspec.pipelines.presets import preset_record
from relaxspec.bench.report import MIN_INTERVAL_PAIRS
from relaxspec.tuning.config import MIN_QUALITY_IMAGES, round_up
from relaxspec.tuning.budget import within

PRESET_FILE, REPORT_FILE, FRONTIER_FILE, TABLE_FILE = "tune.json", "report.md", "frontier.png", "settings.csv"
COLUMNS = ("label", "method", "family", "tree", "relaxed", "compile", "pairs", "speedup", "speedup_lo", "speedup_hi", "seconds",
           "mal", "tv_per_token", "quality_ok")


def _interval(value, lo, hi, digits: int = 2, pairs: int | None = None, unit: str = "") -> str:
    """``2.31x [2.10, 2.52]``; ``1.07x (n/a: only 1 pair)`` from too few pairs for an interval."""
    if value is None:
        return "–"
    text = f"{value:.{digits}f}{unit}"
    if lo is not None and hi is not None:
        return text + f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    if pairs is not None and pairs < MIN_INTERVAL_PAIRS:
        return text + f" (n/a: only {_pairs(pairs)})"
    return text


def _pairs(count: int, what: str = "") -> str:
    """``1 pair``, ``4 held-out image pairs``."""
    return f"{count} {what}pair" + ("" if count == 1 else "s")


def describe_row(row: dict) -> str:
    """``lantern[...]: 2.31x [2.10, 2.52] eager AR, TV 0.012 / token``."""
    tv = row.get("tv_per_token")
    speed = _interval(row.get("speedup"), row.get("speedup_lo"), row.get("speedup_hi"), pairs=row.get("pairs"),
                      unit="x")
    return f"{row['label']}: {speed} eager AR" + ("" if not row.get("relaxed") or tv is None else f", TV {tv:.4f} / token")


def describe_heldout(heldout: dict) -> str:
    """``1.33x [1.31, 1.36]`` (or ``(n/a: only 4 pairs)``) for the held-out measurement."""
    return _interval(*heldout["speedup"], pairs=heldout.get("pairs"), unit="x")


def interval_note(result: dict, minutes: float) -> str | None:
    """One line when the budget allowed the chosen setting fewer than
    :data:`~relaxspec.bench.report.MIN_INTERVAL_PAIRS` paired images on the tune or the held-out
    images (what was measured, that it has no interval, and the minutes that would give one);
    ``None`` otherwise."""
    chosen, heldout = result.get("chosen"), result.get("heldout")
    if chosen is None or heldout is None:
        return None
    short = []
    tune_pairs = chosen.get("pairs") or 0
    if tune_pairs < MIN_INTERVAL_PAIRS and chosen.get("speedup") is not None:
        short.append((tune_pairs, f"{_pairs(tune_pairs, 'tune image ')} (chosen at {chosen['speedup']:.2f}x)"))
    held_pairs = heldout.get("pairs", heldout.get("images", 0))
    if held_pairs < MIN_INTERVAL_PAIRS and heldout["speedup"][0] is not None:
        short.append((held_pairs, f"{_pairs(held_pairs, 'held-out image ')} (speed-up {heldout['speedup'][0]:.2f}x "
                                  "measured)"))
    if not short:
        return None
    fewest = max(min(count for count, _ in short), 1)
    suggested = round_up(minutes * MIN_INTERVAL_PAIRS / fewest)  # the pairs grow about in proportion to the minutes
    return (f"the budget allowed {chosen['label']} " + " and ".join(text for _, text in short)
            + f": no interval (one needs {MIN_INTERVAL_PAIRS} pairs); give --minutes >= {suggested:g} for one")


def closest_message(budget, closest: dict | None) -> str:
    """The line printed when no setting within the budget beats AR."""
    if closest is None:
        return f"no setting within the budget ({budget.describe()}) beats eager AR, and none was measured faster"
    if closest.get("relaxed") and budget.kind == "tv":
        return (f"no setting within the budget ({budget.describe()}) beats eager AR; the closest is "
                f"{describe_row(closest)} (budget {budget.max_tv_per_token:g}): raise --max-tv-per-token or tune "
                "for longer")
    if closest.get("relaxed") and budget.kind == "quality":
        verdict = "failed" if closest.get("quality_ok") is False else "was not judged on"
        return (f"no setting within the budget ({budget.describe()}) beats eager AR; the closest is "
                f"{describe_row(closest)}, which {verdict} the quality test: a weaker relaxation of it may pass, "
                "or use --max-tv-per-token")
    return (f"no setting within the budget ({budget.describe()}) beats eager AR on this machine; the fastest within "
            f"it is {describe_row(closest)}")


def write_results(out: Path, result: dict, tuner) -> dict:
    """Write ``settings.csv``, ``frontier.png`` (with matplotlib), ``report.md`` and, when a
    setting was chosen, ``tune.json``. Returns the paths written and the preset (or ``None``)."""
    out = Path(out)
    rows = sorted(result["rows"], key=lambda r: -(r.get("speedup") or 0))
    written = [out / TABLE_FILE]
    write_atomic(out / TABLE_FILE, lambda temp: temp.write_text(_csv(rows)))
    plot = frontier_plot(rows, result, tuner.config.budget, out / FRONTIER_FILE)
    if plot is not None:
        written.append(plot)
    preset = None
    chosen = result["chosen"]
    if chosen is not None:
        candidate = result["candidates"][chosen["label"]]
        options = methods.resolve(candidate.method, candidate.fields)
        measured = {"baseline": "eager AR (the model's plain sampling, same images and seeds)",
                    "heldout": result["heldout"], "tune": {k: chosen.get(k) for k in COLUMNS if k in chosen},
                    "settings_tried": len(rows) - 1, "rounds": len(tuner.state["rounds"]),
                    "spent_minutes": round(result["spent_seconds"] / 60, 2)}
        preset = preset_record(options, tuner.sampling, pipeline=tuner.pipeline, threads=tuner.config.threads,
                               batch_size=tuner.config.batch_size, measured=measured,
                               budget=tuner.config.budget.to_dict(), command=tuner.config.command, tree_root=out)
        write_json(out / PRESET_FILE, preset)
        written.append(out / PRESET_FILE)
    elif (out / PRESET_FILE).exists():
        (out / PRESET_FILE).unlink()  # a stale preset of an earlier run must not outlive this verdict
    text = markdown(rows, result, tuner, preset)
    write_atomic(out / REPORT_FILE, lambda temp: temp.write_text(text))
    written.append(out / REPORT_FILE)
    return {"files": written, "preset": preset}


def _csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k) for k in COLUMNS})
    return buffer.getvalue()


def frontier_plot(rows: list[dict], result: dict, budget, path: Path) -> Path | None:
    """Speed-up against eager AR (median, interval) over TV per token for every tried setting;
    the chosen one circled, the TV budget a dashed line. ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    def family_of(row: dict) -> str:
        return row.get("family", row["method"]) + (" compiled" if row.get("compile") else "")

    families = sorted({family_of(r) for r in rows if r["label"] != "ar"})
    colours = {f: plt.cm.tab10(i % 10) for i, f in enumerate(families)}
    for row in rows:
        if row["label"] == "ar" or row.get("speedup") is None:
            continue
        family = family_of(row)
        x = row.get("tv_per_token") or 0.0
        lo, hi = row.get("speedup_lo"), row.get("speedup_hi")
        err = None if lo is None else [[max(row["speedup"] - lo, 0.0)], [max(hi - row["speedup"], 0.0)]]
        marker = "x" if row.get("quality_ok") is False else "o"
        ax.errorbar([x], [row["speedup"]], yerr=err, fmt=marker, color=colours[family], alpha=0.8, ms=5,
                    label=family)
    chosen = result.get("chosen")
    if chosen is not None and chosen.get("speedup") is not None:
        ax.scatter([chosen.get("tv_per_token") or 0.0], [chosen["speedup"]], s=220, facecolors="none",
                   edgecolors="black", linewidths=1.5, label=f"chosen: {chosen['label']}", zorder=5)
    if budget.kind == "tv":
        ax.axvline(budget.max_tv_per_token, color="grey", linestyle="--", label="TV budget")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="best")
    ax.set_xlabel("mean one-step TV per token (0: exact)")
    ax.set_ylabel("speed-up vs eager AR (median, 95% CI)")
    ax.set_title(f"relaxspec tune: {len(rows) - 1} settings ({budget.describe()})", fontsize=9)
    fig.tight_layout()
    write_atomic(path, lambda temp: fig.savefig(temp, format="png", dpi=110))
    plt.close(fig)
    return path


def markdown(rows: list[dict], result: dict, tuner, preset: dict | None) -> str:
    budget, config = tuner.config.budget, tuner.config
    lines = ["# relaxspec tune", "", f"- budget: {budget.describe()}; {config.minutes:g} minutes "
             f"({result['spent_seconds'] / 60:.1f} spent)",
             f"- model: {tuner.pipeline.describe()}; machine: {machine_kind(machine_identity(tuner.device))}, "
             f"{config.threads} thread(s), batch size {config.batch_size}",
             f"- tuned on {len(config.tune)} classes / prompts, held out {len(config.heldout)}; "
             f"{len(rows) - 1} settings tried in {len(tuner.state['rounds'])} rounds of successive halving"]
    if result["spent_seconds"] > 1.1 * 60 * config.minutes:
        lines.append("- the search outran --minutes: the first round measures every setting once, and the quality "
                     f"test and the held-out measurement take at least {MIN_QUALITY_IMAGES} and {MIN_INTERVAL_PAIRS} "
                     "images")
    if config.budget.kind == "quality":
        lines.append(f"- quality source: {config.quality_source}")
    lines.append("")
    chosen, heldout = result["chosen"], result["heldout"]
    if chosen is None:
        lines += ["**No preset:** " + closest_message(budget, result.get("closest")), ""]
    else:
        setting = " ".join(f"{k}={v}" for k, v in preset["method"].items())
        lines += [f"**Chosen:** `{chosen['label']}`: `{setting}`", "",
                  f"- on the tune images: {describe_row(chosen)} ({chosen['pairs']} paired images)",
                  f"- held out ({heldout['images']} images): **{describe_heldout(heldout)} eager AR**, MAL "
                  f"{heldout['mal']:.2f}"
                  + ("" if heldout.get("tv_per_token") is None or not chosen["relaxed"]
                     else f", TV {heldout['tv_per_token']:.4f} / token")]
        if heldout.get("quality"):
            q = heldout["quality"]["metrics"]
            acc, fid = q.get("class_accuracy_diff_vs_ar"), q.get("fid_like_diff_vs_ar")
            lines.append(f"- held-out quality within AR's intervals: {heldout['quality']['ok']} (class accuracy minus "
                         f"AR's {_interval(*acc) if acc else '–'}, FID-like minus AR's "
                         f"{_interval(*fid) if fid else '–'}; {q.get('n_fake')} images)")
        if not heldout.get("within_budget", True):
            lines.append("- **warning: on the held-out images this setting is over the budget**")
        note = interval_note(result, config.minutes)
        if note is not None:
            lines.append(f"- **{note}**")
        lines += ["", f"Use it: `relaxspec generate --preset {Path(tuner.out) / PRESET_FILE} ...` "
                  "(also bench, demo, relaxspec.generate(preset=...))", ""]
    lines += ["| setting | speed-up vs AR [95% CI] | pairs | MAL | TV / token | within budget |", "|---|---|---|---|---|---|"]

    for row in rows:
        if row["label"] == "ar":
            continue
        ok = within(row, budget)
        tv = row.get("tv_per_token")
        lines.append(f"| `{row['label']}` | "
                     f"{_interval(row.get('speedup'), row.get('speedup_lo'), row.get('speedup_hi'), pairs=row['pairs'])} "
                     f"| {row['pairs']} | {row['mal']:.2f} | {'–' if tv is None else f'{tv:.4f}'} | "
                     f"{'yes' if ok else 'no' if ok is False else 'not judged'} |")
    judged = [r for r in rows if r.get("quality") and r["label"] != "ar"]
    if judged:
        lines += ["", f"Quality test ({judged[0]['quality'].get('n_fake')} images per setting; {config.quality_source}):",
                  "", "| setting | class accuracy minus AR's [95% CI] | FID-like minus AR's [95% CI] | within AR's "
                  "quality |", "|---|---|---|---|"]
        for row in judged:
            q = row["quality"]
            acc, fid = q.get("class_accuracy_diff_vs_ar"), q.get("fid_like_diff_vs_ar")
            lines.append(f"| `{row['label']}` | {_interval(*acc, digits=3) if acc else '–'} | "
                         f"{_interval(*fid, digits=3) if fid else '–'} | {'yes' if row.get('quality_ok') else 'no'} |")
    lines += ["", f"![frontier]({FRONTIER_FILE})", ""]
    return "\n".join(lines)


__all__ = ["FRONTIER_FILE", "PRESET_FILE", "REPORT_FILE", "TABLE_FILE", "closest_message", "describe_heldout",
           "describe_row", "frontier_plot", "interval_note", "write_results"]
