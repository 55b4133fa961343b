"""An image run: conditions -> image tokens (any method) -> PNGs, ``tokens.npy`` and ``stats.json``
in one folder, written batch by batch; a run started again with the same settings keeps every
finished image (``relaxspec generate``, and each shard of ``relaxspec eval``).

Batch ``b`` samples with a generator seeded ``batch_seed(seed, b)``, so a resumed run draws what
an uninterrupted one would.

What a batch writes does not grow with the run: its rows of ``tokens.npy`` (the file made once at
its final size, its rows written in place) and one line of ``progress.jsonl`` (its images'
records and acceptance counts), appended after the tokens, so a crash in between only redoes the
batch. ``stats.json`` says the settings from the start and lists every image at the end, when
``progress.jsonl`` goes. (Rewriting the whole token array and image list after every batch, as
before, made a 50,000-image FID run write terabytes.)
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from relaxspec.devices import size_text
from relaxspec.errors import RelaxspecError
from relaxspec.decoding.result import certified_tv, record_tv_sum, total_rank_counts
from relaxspec.files import file_identity, png_is_whole, write_atomic, write_grid, write_json, write_png
from relaxspec.methods.grid import ROWS_SEEN
from relaxspec.runs.folder import RunKind, hold_folder, open_run, run_meta, settings_hash
from relaxspec.sampling import batch_seed

STATS_FILE, TOKENS_FILE, PROGRESS_FILE = "stats.json", "tokens.npy", "progress.jsonl"


def image_settings(pipeline, options, sampling, condition, *, seed: int, batch_size: int, precision: str,
                   files: dict | None = None, extra: dict | None = None) -> dict:
    """What ``stats.json`` records and the resume check compares: the model's identity, the images,
    sampling, the method's settings (only those it reads), seeding, and the identities of the files
    read (the model's, the drafter when the method reads it, and ``files``: role -> path)."""
    drafter_path = pipeline.drafter_path if options.needs_drafter else None  # not read, so not recorded
    files = {**pipeline.files, "drafter_ckpt": drafter_path, **(files or {})}
    return {
        **pipeline.identity,
        "image_size": pipeline.image_size, "image_tokens": pipeline.image_tokens, **condition.settings,
        "sampling": sampling.to_dict(), "method": options.to_dict(),
        "drafter_ckpt": None if drafter_path is None else str(Path(drafter_path).resolve()),
        "seed": seed, "seeding": "batch b: torch.Generator().manual_seed(seed * 1000003 + b)",
        "batch_size": batch_size, "precision": precision, "device": str(pipeline.device),
        "files": {key: file_identity(path) for key, path in files.items() if path},
        **(extra or {}),
    }


def write_image_run(pipeline, condition, prepared, out, settings: dict, *, seed: int = 0,
                    batch_size: int = 1, overwrite: bool = False, progress: bool = True, grid_max: int = 64,
                    upscale_by: int = 1, started: float | None = None) -> dict:
    """Generate one image per row of ``condition`` with ``pipeline`` and its ``prepared`` method
    (:meth:`~relaxspec.pipelines.ImagePipeline.prepare`: checked and built once for every batch)
    into ``out`` and return the finished ``stats.json``. ``settings``: what identifies the run (:func:`image_settings`); a
    folder holding another run's images is refused unless ``overwrite``, and so is a folder
    another run is writing (:func:`relaxspec.runs.folder.hold_folder`, held to the last write).
    ``started``: when the command began (``time.perf_counter()``), for the load time the totals
    report."""
    with hold_folder(out, "generate"):
        return _write_image_run(pipeline, condition, prepared, out, settings, seed=seed,
                                batch_size=batch_size, overwrite=overwrite, progress=progress, grid_max=grid_max,
                                upscale_by=upscale_by, started=started)


def _write_image_run(pipeline, condition, prepared, out, settings: dict, *, seed, batch_size, overwrite,
                     progress, grid_max, upscale_by, started) -> dict:
    wall = started if started is not None else time.perf_counter()
    out = Path(out)
    digest = settings_hash(settings)
    num_images, num_tokens = len(condition), pipeline.image_tokens
    out.mkdir(parents=True, exist_ok=True)
    records, tokens, old_counts = previous_run(out, settings, digest, num_images, num_tokens, overwrite)
    check_disk(out, num_images - len(records), pipeline.image_size)  # tokens.npy is whole already
    batch_counts = kept_batch_counts(old_counts, records, batch_size, num_images)

    options = prepared.options
    print(f"relaxspec: {options.describe()}", file=sys.stderr)  # the settings in use, and only those
    for note in options.notes:  # a value given past what this model can use, and what is used
        print(f"relaxspec: note: {note}", file=sys.stderr)
    # what is kept, said once in stats.json; the batches from here on are lines of progress.jsonl
    stats = run_meta(settings, digest, complete=False, images=[records[i] for i in sorted(records)], totals={})
    _with_counts(stats, batch_counts)
    write_json(out / STATS_FILE, stats)
    write_atomic(out / PROGRESS_FILE, lambda path: path.write_text(""))
    load_seconds = time.perf_counter() - wall
    bar = tqdm(total=num_images, initial=len(records), unit="image", desc="generate",
               disable=True if not progress else None)
    generated = 0
    for batch, start in enumerate(range(0, num_images, batch_size)):
        index = list(range(start, min(start + batch_size, num_images)))
        if all(i in records for i in index):
            continue
        batch_seed_b = batch_seed(seed, batch)
        generator = torch.Generator(device=pipeline.device).manual_seed(batch_seed_b)
        result = pipeline.generate(condition.select(index), prepared, generator=generator,
                                   progress=progress and sys.stderr.isatty())
        began = time.perf_counter()
        with torch.inference_mode():
            pixels = pipeline.pixels(result.tokens)
        vq_seconds = time.perf_counter() - began
        line = {"batch": batch, "images": []}
        if result.rank_tests is not None:  # per batch, so a resumed run keeps the finished batches' counts
            line["counts"] = batch_counts[str(batch)] = {"tests": result.rank_tests.tolist(),
                                                         "accepts": result.rank_accepts.tolist()}
        for row, i in enumerate(index):
            name = f"{i:04d}.png"
            write_png(out / name, upscale(pixels[row], upscale_by))
            tokens[i] = result.tokens[row].numpy()
            records[i] = {"index": i, "file": name, **condition.records[i], "batch": batch, "batch_seed": batch_seed_b,
                          **result.image_record(row), "vq_seconds": vq_seconds / len(index)}
            line["images"].append(records[i])
        generated += len(index)
        # Tokens first, then the record of what is finished: a crash in between only redoes a batch.
        tokens.flush()
        with open(out / PROGRESS_FILE, "a") as journal:
            journal.write(json.dumps(line) + "\n")
        bar.update(len(index))
    bar.close()

    write_grid(out, [records[i]["file"] for i in range(min(num_images, grid_max))])
    done = [records[i] for i in range(num_images)]
    stats.update(complete=True, images=done, totals=run_totals(done, num_tokens, generated))
    _with_counts(stats, batch_counts)
    stats["totals"].update(load_seconds=load_seconds, wall_seconds_this_run=time.perf_counter() - wall)
    tokens.flush()
    del tokens
    write_json(out / STATS_FILE, stats)
    (out / PROGRESS_FILE).unlink(missing_ok=True)
    return stats


def check_disk(out: Path, images: int, side: int) -> None:
    """Refuse, in one line with both sizes, a run whose ``images`` PNGs (``side`` pixels square)
    will not fit on ``out``'s disk. A PNG is taken as half its raw pixels, about what generated
    images compress to (an upscaled one, whose blocks compress away, about the same), and the
    records' kilobyte."""
    needed = images * (side * side * 3 // 2 + 1024)
    free = shutil.disk_usage(out).free
    if needed > free:
        raise RelaxspecError(f"--out {out}: {images:,} more images of {side} px need about {size_text(needed)} and "
                             f"its disk has {size_text(free)} free")


def _with_counts(stats: dict, batch_counts: dict) -> None:
    """stats.json's acceptance counts: per batch, and summed (none for a method that keeps none)."""
    if batch_counts:
        stats["acceptance_counts"] = total_rank_counts(batch_counts.values())
        stats["acceptance_counts_by_batch"] = batch_counts


def summary(out, stats: dict) -> str:
    """The line a finished run prints: where, how many generated now and kept, time and MAL, and
    in profile mode where the decoding time went."""
    totals = stats["totals"]
    count, generated = totals["images"], totals["generated_this_run"]
    line = (f"{count} images in {out} ({generated} generated now, {count - generated} kept); "
            f"{totals['seconds_per_image']:.2f} s/image, {totals['target_forwards_per_image']:.1f} target forwards/image, "
            f"MAL {totals['mean_accepted_length']:.2f}")
    target, drafter = totals.get("target_forward_share"), totals.get("drafter_forward_share")
    if target is None:  # the split is measured in profile mode only
        return line
    drafter = drafter or 0.0
    return (f"{line}; decoding time (--profile): target forwards {target:.0%}, drafter forwards {drafter:.0%}, "
            f"the rest {max(1.0 - target - drafter, 0.0):.0%}")


def run_totals(done: list[dict], num_tokens: int, generated: int) -> dict:
    """stats.json's totals over the finished images' records: times and where they went, target
    forwards, MAL, and the TV certificate (``min(1, mean of the per-image sums)``, never a mean of
    capped values; none when the record was off)."""
    num_images = len(done)
    forwards = sum(r["target_forwards"] for r in done)
    seconds = sum(r["seconds"] for r in done)
    tv_sums = [record_tv_sum(r) for r in done]
    recorded = not any(math.isnan(v) for v in tv_sums)  # --no-tv-record: no certificate
    rows = max((r.get("rows", 1) for r in done), default=1)
    return {
        "images": num_images, "generated_this_run": generated,
        "seconds": seconds, "seconds_per_image": seconds / num_images,
        "vq_seconds_per_image": sum(r["vq_seconds"] for r in done) / num_images,
        # where the decoding time went: profile mode only (None otherwise; records of runs before
        # forwards were timed count as 0)
        **{f"{part}_share": None if any(f"{part}_seconds" in r and r[f"{part}_seconds"] is None for r in done)
           else sum(r.get(f"{part}_seconds", 0.0) for r in done) / max(seconds, 1e-12)
           for part in ("target_forward", "drafter_forward")},
        "target_forwards_per_image": forwards / num_images,
        "mean_accepted_length": num_images * num_tokens / forwards,
        "tv_sum_mean": sum(tv_sums) / num_images if recorded else None,
        "tv_per_token_mean": sum(tv_sums) / (num_images * num_tokens) if recorded else None,
        # rows in parallel: the image law is not the model's, whatever the rule, so the record
        # (which covers the acceptance only) certifies nothing about it
        "tv_certified": certified_tv(tv_sums) if recorded and rows == 1 else None,
        **({"law": f"up to {rows} rows in parallel: not the model's law ({ROWS_SEEN}); the TV record covers the "
                   "acceptance only"} if rows > 1 else {}),
    }


def kept_batch_counts(old: dict, records: dict[int, dict], batch_size: int, num_images: int) -> dict[str, dict]:
    """Of the earlier run's per-batch ``[depth, rank]`` acceptance counts ``old``, those of the
    batches kept whole (every image finished), by batch index; a batch that is redone drops its
    old counts, so nothing is counted twice."""
    kept = {}
    for key, table in old.items() if isinstance(old, dict) else ():
        if not (key.isdigit() and isinstance(table, dict) and {"tests", "accepts"} <= set(table)):
            continue
        first = int(key) * batch_size
        if all(i in records for i in range(first, min(first + batch_size, num_images))):
            kept[key] = table
    return kept


def _image_records_problem(meta: dict) -> str | None:
    images = meta.get("images")
    if not isinstance(images, list) or not all(isinstance(r, dict) for r in images):
        return "no image records"
    return None


#: An image run's folder (generate, eval's shards): ``stats.json`` holds its settings and images.
IMAGE_RUN = RunKind("a run", STATS_FILE, "a run's record", owned=(PROGRESS_FILE,), problem=_image_records_problem)


def _remove_pngs(out: Path, old: dict | None) -> None:
    """A replaced run's PNGs (those its ``stats.json`` and ``progress.jsonl`` list)."""
    for record in _listed(out, old or {})[0]:
        stale = out / str(record.get("file", ""))
        if stale.parent == out and stale.suffix == ".png" and stale.is_file():
            stale.unlink()


def previous_run(out: Path, settings: dict, settings_hash: str, num_images: int, num_tokens: int,
                 overwrite: bool) -> tuple[dict[int, dict], np.ndarray, dict]:
    """The images of an earlier run with the same settings that are finished (PNG on disk, tokens
    saved; listed in its ``stats.json`` or its ``progress.jsonl``), ``tokens.npy`` opened to
    continue (a memory map of the run's final shape; rows of unfinished images -1 in a new file)
    and that run's per-batch acceptance counts (:func:`relaxspec.runs.folder.open_run`: another
    run's folder is refused, or replaced with ``overwrite``)."""
    shape = (num_images, num_tokens)
    old = open_run(out, IMAGE_RUN, settings, overwrite=overwrite, digest=settings_hash, clear=_remove_pngs)
    saved = _open_tokens(out / TOKENS_FILE, shape) if old is not None else None
    if saved is None:
        return {}, _new_tokens(out / TOKENS_FILE, shape), {}
    listed, counts = _listed(out, old)
    records = {}
    for record in listed:
        i = record.get("index")
        if (isinstance(i, int) and 0 <= i < num_images and (out / str(record.get("file"))).is_file()
                and (saved[i] >= 0).all() and png_is_whole(out / str(record.get("file")))):
            records[i] = record
    return records, saved, counts


def _listed(out: Path, meta: dict) -> tuple[list[dict], dict]:
    """The image records and per-batch counts of a run: its ``stats.json``'s, then the batches its
    ``progress.jsonl`` adds (a last line cut short by a crash is not a batch)."""
    images = list(meta.get("images") or [])
    counts = dict(meta.get("acceptance_counts_by_batch") or {})
    try:
        lines = (out / PROGRESS_FILE).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    for text in lines:
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if not (isinstance(line, dict) and isinstance(line.get("images"), list)):
            continue
        images.extend(record for record in line["images"] if isinstance(record, dict))
        if isinstance(line.get("counts"), dict) and isinstance(line.get("batch"), int):
            counts[str(line["batch"])] = line["counts"]
    return images, counts


def _open_tokens(path: Path, shape: tuple[int, int]) -> np.ndarray | None:
    """``tokens.npy`` of an earlier run, mapped for writing, if it is a whole int64 array of ``shape``."""
    try:
        tokens = np.lib.format.open_memmap(path, mode="r+")
    except (OSError, ValueError, EOFError):
        return None
    if tokens.shape != shape or tokens.dtype != np.int64:
        del tokens
        return None
    return tokens


def _new_tokens(path: Path, shape: tuple[int, int]) -> np.ndarray:
    """A new ``tokens.npy`` of the run's final ``shape``, every row -1 (no image yet), mapped for
    writing. The rows are written through the file first, so a full disk is an error here, not a
    SIGBUS from a page of the map that has no block behind it."""
    path.unlink(missing_ok=True)  # never written through: another file may share its inode
    rows = np.full((min(shape[0], 4096), shape[1]), -1, dtype=np.int64)
    try:
        with open(path, "wb") as handle:
            np.lib.format.write_array_header_1_0(handle, {"descr": "<i8", "fortran_order": False, "shape": shape})
            for start in range(0, shape[0], len(rows)):
                handle.write(rows[: min(len(rows), shape[0] - start)].tobytes())
    except OSError as err:
        path.unlink(missing_ok=True)
        raise RelaxspecError(f"{path}: cannot be written ({err.strerror or err})") from None
    return np.lib.format.open_memmap(path, mode="r+")


def upscale(pixels: np.ndarray, factor: int) -> np.ndarray:
    """``[H, W, 3]`` -> ``[factor * H, factor * W, 3]``, each pixel a ``factor`` x ``factor`` block."""
    return pixels if factor == 1 else pixels.repeat(factor, axis=0).repeat(factor, axis=1)


__all__ = ["PROGRESS_FILE", "STATS_FILE", "TOKENS_FILE", "image_settings", "kept_batch_counts", "previous_run", "run_totals", "summary", "upscale",
           "write_image_run"]
