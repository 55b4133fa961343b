"""Quality against real images: decoding a benchmark's tokens to PNGs once, reading them and the
held-out real images, the classifier metrics with bootstrap intervals (class accuracy, FID-like,
precision / recall, and each method's difference to the baseline on the same images), and the
test whether a method stays within the baseline's quality."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from PIL import Image

from relaxspec.bench.config import BASELINE
from relaxspec.bench.report.statistics import bootstrap
from relaxspec.errors import RelaxspecError
from relaxspec.files import write_atomic, write_png
from relaxspec.models.weights import to_uint8
from relaxspec.evaluation.classifier import load_split
from relaxspec.evaluation.metrics import QualityReference

IMAGES_DIR = "images"
FID_LIKE_NOTE = ("FID-like = Fréchet distance on our classifier's features (relaxspec.evaluation), NOT comparable "
                 "to Inception FID; compare only numbers from the same classifier, reference set and sample count")


def image_folder_name(label: str) -> str:
    """A file-system-safe folder name for a method label (``lantern++`` -> ``lanternpp``)."""
    return re.sub(r"[^A-Za-z0-9._=,-]+", "_", label.replace("+", "p")).strip("_") or "method"


def ensure_images(out_dir: str | Path, records: Sequence[dict], vq, *, batch_size: int = 16,
                  progress: bool = False) -> dict[str, list[Path]]:
    """Decode each record's tokens with ``vq`` once: ``images/<method>/NNNN.png`` (kept across
    runs: only missing files are decoded). ``images/SETTINGS_HASH`` names the benchmark the
    images belong to; after ``--overwrite`` with other settings every image is decoded again.
    Returns the files per method label, by image index."""
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
    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(np.asarray(image.convert("RGB")))
    return np.stack(images)


def load_real_images(path: str | Path, classes: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Held-out real images (an ``.npz`` with ``images`` uint8 ``[n, H, W, 3]`` and ``labels``),
    restricted to ``classes`` (the benchmarked ones) when given."""
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
            row["class_accuracy_diff_vs_ar"] = bootstrap(lambda a, b: b.mean() - a.mean(), base_hits, hits,
                                                         n_boot=n_boot, seed=seed)
            if len(feats) >= 2:
                row["fid_like_diff_vs_ar"] = bootstrap(lambda a, b: fid(b) - fid(a), base_feats, feats,
                                                       n_boot=n_boot, seed=seed, bias_correct=True)
    return per_method


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


__all__ = ["FID_LIKE_NOTE", "IMAGES_DIR", "ensure_images", "image_folder_name", "load_real_images", "quality_metrics",
           "read_pngs", "within_baseline_quality"]
