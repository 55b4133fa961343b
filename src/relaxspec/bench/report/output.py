"""What a benchmark folder gets: ``summary.json``, ``summary.csv``, ``summary.md`` (the tables and
the one-line verdict), ``plot_data.json`` and the plots; :func:`write_report` makes them all from
the records :func:`load_bench` reads."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from relaxspec.bench.config import BASELINE
from relaxspec.bench.report.plots import PLOT_DATA, make_plots, plot_data
from relaxspec.bench.report.quality import (FID_LIKE_NOTE, ensure_images, load_real_images, quality_metrics, read_pngs,
                                            within_baseline_quality)
from relaxspec.bench.report.statistics import summarize
from relaxspec.bench.run import RECORDS_FILE, SETTINGS_FILE, read_records_counted
from relaxspec.errors import RelaxspecError, shown
from relaxspec.methods.grid import ROWS_SEEN
from relaxspec.files import write_atomic, write_json

SUMMARY_JSON, SUMMARY_CSV, SUMMARY_MD = "summary.json", "summary.csv", "summary.md"
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
    if row.get("drafter_share") is None:  # not profiled (--profile): one graph a step, no parts timed
        return "– / – / –"
    if row.get("overhead_share") is None:
        return f"– / {100 * row['drafter_share']:.0f}% / –"
    return " / ".join(f"{100 * row[k]:.0f}%" for k in ("target_share", "drafter_forward_share", "overhead_share"))


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


def load_bench(out_dir: str | Path) -> tuple[dict, list[dict]]:
    """``(settings, records)`` of the benchmark in ``out_dir`` (records of its settings only)."""
    settings, records, _ = load_bench_counted(out_dir)
    return settings, records


def load_bench_counted(out_dir: str | Path) -> tuple[dict, list[dict], int]:
    """:func:`load_bench`, and how many lines of ``records.jsonl`` were skipped as not records."""
    out = Path(out_dir)
    path = out / SETTINGS_FILE
    if not path.is_file():
        raise RelaxspecError(f"{out}: no {SETTINGS_FILE} (not a relaxspec bench folder)")
    try:
        meta = json.loads(path.read_text())
        digest, settings = meta["settings_hash"], meta["settings"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise RelaxspecError(f"{path}: not a relaxspec bench settings file") from None
    records, skipped = read_records_counted(out, digest)
    if not records:
        raise RelaxspecError(f"{out / RECORDS_FILE}: no records of this benchmark yet")
    return settings, records, skipped


def timed_by_note(records) -> str | None:
    """For a bench sharded over processes, which rank and device timed which images (every image's
    methods ran on one device, so each paired speed-up compares one device's timings)."""
    ranks: dict = {}
    for record in records:
        if "rank" in record:
            ranks.setdefault((record["rank"], record.get("device", "?")), set()).add(int(record["index"]))
    if not ranks:
        return None
    parts = [f"rank {rank} on {device}: images {min(found)}-{max(found)} ({len(found)})"
             for (rank, device), found in sorted(ranks.items())]
    return (f"timed by {len(ranks)} processes, each image's methods on one device (its speed-ups pair that "
            "device's timings): " + "; ".join(parts))


def write_report(out_dir: str | Path, *, vq=None, classifier=None, real_data: str | Path | None = None,
                 n_boot: int = 200, k: int = 3, plots: bool = True, progress: bool = False,
                 baseline: str | None = None) -> dict:
    """Summarise the benchmark in ``out_dir`` and write every output; returns ``{"rows", "files",
    "notes"}``. Quality needs ``vq`` (to decode the tokens), ``classifier`` and ``real_data``.
    ``baseline``: the label speed-ups are measured against (default: the run's, plain AR)."""
    out = Path(out_dir)
    settings, records, skipped = load_bench_counted(out)
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
    if skipped:  # a crash cuts a line off; an edit can damage more: say what the report leaves out
        notes.append(f"{skipped} line{'s' if skipped > 1 else ''} of {RECORDS_FILE} skipped: not a complete record "
                     "(cut off or damaged); run the bench command again to redo those images")
    timed = timed_by_note(records)
    if timed:
        notes.append(timed)
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
                   "mal": "image tokens / target forwards over all images (bonus included, AR = 1.0)",
                   "mal_image_mean": "the mean over images of each image's tokens / target forwards",
                   "target_forwards_per_image": "target forwards per image, the condition prefill included",
                   "drafter_share": "draft-source seconds (EAGLE drafter, or the Jacobi window's bookkeeping) / "
                                    "decode seconds (this and the three shares below: bench --profile only, "
                                    "else null)",
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
    """``summary.md``: the setup, a legend, the table, the quality differences, the verdict, the notes."""
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
              "or the Jacobi window's bookkeeping), measured with --profile only. TV bound: mean certified per-image TV sum (0 = exact).")
    text = ["# relaxspec bench", "", setup, "", legend, "", markdown_table(rows, baseline)]
    vs_ar = markdown_vs_ar(rows)
    if vs_ar:
        text += ["Quality relative to AR (method − AR; an interval holding 0: indistinguishable at this sample size):",
                 "", vs_ar]
    text += [verdict(rows, baseline).replace("verdict: ", "**Verdict:** ", 1), ""]
    parallel = [row["label"] for row in rows if row.get("rows")]
    if parallel:
        notes = [*notes, f"{', '.join(parallel)} paint rows in parallel: not the model's law, whatever the rule "
                         f"({ROWS_SEEN}). Their TV record "
                         "covers the acceptance only, so they have no TV certificate; judge them by the quality "
                         "columns."]
    if notes:
        text += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(text)

__all__ = ["CSV_COLUMNS", "QUALITY_KEYS", "SUMMARY_CSV", "SUMMARY_JSON", "SUMMARY_MD", "csv_text", "load_bench",
           "markdown_report", "markdown_table", "markdown_vs_ar", "verdict", "write_report"]
