"""From benchmark records to numbers, tables and plots.

Per method (REFERENCE §3):

* **MAL**: image tokens per target forward over all images (total tokens / total target forwards,
  bonus included; AR = 1.0; :func:`~relaxspec.bench.report.statistics.tokens_per_forward`, the one
  meaning ``relaxspec tune`` reports too; the mean of per-image MALs is ``mal_image_mean``), and
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

The modules: :mod:`~relaxspec.bench.report.statistics` (the numbers and their bootstrap
intervals), :mod:`~relaxspec.bench.report.quality` (real images and the classifier metrics),
:mod:`~relaxspec.bench.report.plots` and :mod:`~relaxspec.bench.report.output` (the files,
:func:`write_report`).
"""

from relaxspec.bench.report.output import (CSV_COLUMNS, QUALITY_KEYS, SUMMARY_CSV, SUMMARY_JSON, SUMMARY_MD, csv_text,
                                           load_bench, markdown_report, markdown_table, markdown_vs_ar, verdict,
                                           write_report)
from relaxspec.bench.report.plots import PLOT_DATA, PLOT_FILES, make_plots, plot_data, plots_available
from relaxspec.bench.report.quality import (FID_LIKE_NOTE, IMAGES_DIR, ensure_images, image_folder_name,
                                            load_real_images, quality_metrics, read_pngs, within_baseline_quality)
from relaxspec.bench.report.statistics import (MIN_INTERVAL_PAIRS, accept_length_histogram, acceptance_map,
                                               accepted_flags, bootstrap, method_summary, pairwise_speedups,
                                               pareto_front, speedup_interval, summarize, time_split,
                                               tokens_per_forward)

__all__ = [
    "CSV_COLUMNS", "FID_LIKE_NOTE", "IMAGES_DIR", "MIN_INTERVAL_PAIRS", "PLOT_DATA", "PLOT_FILES", "QUALITY_KEYS",
    "SUMMARY_CSV", "SUMMARY_JSON", "SUMMARY_MD", "accept_length_histogram", "acceptance_map", "accepted_flags",
    "bootstrap", "csv_text", "ensure_images", "image_folder_name", "load_bench", "load_real_images", "make_plots",
    "markdown_report", "markdown_table", "markdown_vs_ar", "method_summary", "pairwise_speedups", "pareto_front",
    "plot_data", "plots_available", "quality_metrics", "read_pngs", "speedup_interval", "summarize", "time_split",
    "tokens_per_forward", "verdict", "within_baseline_quality", "write_report",
]
