"""The benchmark loop: every method on the same images and seeds, in one process, interleaved.

Image ``i`` (row ``i`` of a pipeline's :class:`~relaxspec.conditions.Condition`: a class id or a
prompt) is decoded by every method before image ``i + 1`` starts, and
the order of the methods rotates by one each image, so slow drift of the machine (other jobs,
thermal state, caches) falls on all methods alike and no method always runs first. Each decode
gets its own generator seeded ``seed * 1000003 + unit`` (``unit`` = the image, or the batch with
``batch_size > 1``) — the seeding of ``relaxspec generate``, so plain AR reproduces its images.

Latency is ``DecodeResult.seconds``: from the start of decoding (condition prefill included, as
the papers measure "after condition encoding") to the last token, before VQ decoding. The draft
source and acceptance rule (LANTERN's neighbour table) are built once per method, outside the
timed region. Our own ``time.perf_counter`` around the call is kept too (``wall_seconds``).

Every finished (image, method) pair is appended to ``out_dir/records.jsonl`` at once; a restarted
run skips the pairs already there. ``settings.json`` holds the settings hash (methods, classes,
seed, sampling, threads, batch size, model identity): records of other settings are never mixed
in — the run is refused unless ``overwrite``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from relaxspec.bench.config import BASELINE, MethodSpec
from relaxspec.conditions import Condition
from relaxspec.decoding.result import DecodeResult
from relaxspec.errors import RelaxspecError
from relaxspec.pipelines.base import PreparedDecode
from relaxspec.runs.folder import RunKind, hold_folder, open_run, run_meta, settings_hash
from relaxspec.sampling import SamplingConfig, batch_seed
from relaxspec.files import write_atomic, write_json
from relaxspec.runs.shards import SHARD, shard_folders

RECORDS_FILE, SETTINGS_FILE = "records.jsonl", "settings.json"
#: Generators for warm-up decodes (never recorded) are seeded from here, away from any real image.
WARMUP_SEED = 2**40


@dataclass
class PreparedMethod:
    """A benchmarked method ready to decode: its spec and what the pipeline prepared for it
    (:meth:`~relaxspec.pipelines.ImagePipeline.prepare`: checked once, its draft source and
    acceptance rule built once and reused across images; both reset themselves at the start of
    every decode)."""

    spec: MethodSpec
    prepared: PreparedDecode

    @classmethod
    def build(cls, spec: MethodSpec, sampling: SamplingConfig, pipeline) -> PreparedMethod:
        if spec.needs_drafter and pipeline.drafter is None:
            raise RelaxspecError(f"{spec.label} needs a trained drafter (--drafter-ckpt)")
        try:
            return cls(spec, pipeline.prepare(spec.method_options(), spec.sampling_config(sampling)))
        except RelaxspecError as err:
            raise RelaxspecError(f"{spec.label}: {err}") from None


def prompted(condition: Condition) -> bool:
    """Whether a bench's images are prompts (else class ids)."""
    return bool(condition.records) and "prompt" in condition.records[0]


def prompts_of(condition: Condition) -> list[str]:
    """The prompt of each image of a text-to-image bench (a pipeline's :class:`Condition`)."""
    return [record["prompt"] for record in condition.records]


def decode_method(method: PreparedMethod, pipeline, condition: Condition, generator: torch.Generator) -> DecodeResult:
    """One decode of ``condition`` (its rows on the pipeline's device), through the pipeline."""
    return pipeline.generate(condition, method.prepared, generator=generator)


def bench_settings(methods: Sequence[MethodSpec], condition: Condition, seed: int,
                   sampling: SamplingConfig, threads: int, batch_size: int, num_tokens: int, identity: dict) -> dict:
    images = {"prompts": prompts_of(condition)} if prompted(condition) else {
        "classes": [int(record["class"]) for record in condition.records]}
    return {
        "methods": [m.to_dict() for m in methods], "baseline": BASELINE, **images,
        "seed": seed, "seeding": "unit u (image, or batch of batch_size images): "
                                 "torch.Generator().manual_seed(seed * 1000003 + u)",
        "sampling": sampling.to_dict(), "threads": threads, "batch_size": batch_size,
        "image_tokens": num_tokens, "models": identity,
    }


def read_records(out_dir: str | Path, expected_hash: str | None = None) -> list[dict]:
    """The complete records in ``records.jsonl`` (a line cut off by a crash is skipped), only those
    of ``expected_hash`` when given."""
    return read_records_counted(out_dir, expected_hash)[0]


def read_records_counted(out_dir: str | Path, expected_hash: str | None = None) -> tuple[list[dict], int]:
    """:func:`read_records`, and how many non-empty lines were skipped as not records (cut off,
    damaged, or not a bench record); records of other settings are not counted."""
    path = Path(out_dir) / RECORDS_FILE
    if not path.exists():
        return [], 0
    records, skipped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if not (isinstance(record, dict) and "index" in record and "method" in record):
            skipped += 1
        elif expected_hash is None or record.get("settings_hash") == expected_hash:
            records.append(record)
    return records, skipped


#: A benchmark's folder: ``settings.json`` holds its settings, ``records.jsonl`` one line per decode.
BENCH_RUN = RunKind("a benchmark", SETTINGS_FILE, "a benchmark's settings", owned=(RECORDS_FILE,))


def prepare_out_dir(out: Path, settings: dict, digest: str, overwrite: bool) -> list[dict]:
    """Open ``out`` for the benchmark of ``settings`` (:func:`relaxspec.runs.folder.open_run`);
    return the records of the same benchmark there and rewrite ``records.jsonl`` with exactly them
    (dropping a torn last line before appending)."""
    old = open_run(out, BENCH_RUN, settings, overwrite=overwrite, digest=digest)
    records = read_records(out, digest) if old is not None else []
    # the settings first: a crash before the records are rewritten leaves a folder that resumes
    write_json(out / SETTINGS_FILE, run_meta(settings, digest))
    write_atomic(out / RECORDS_FILE, lambda temp: temp.write_text("".join(json.dumps(r) + "\n" for r in records)))
    return records


def _append(path: Path, records: list[dict]) -> None:
    with open(path, "a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))
        handle.flush()
        os.fsync(handle.fileno())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_decode(method: PreparedMethod, pipeline, condition: Condition, seed: int) -> tuple[DecodeResult, float]:
    """``(result, wall seconds)``; the garbage collector is off during the call (as ``timeit``
    does) so a collection never lands inside one method's timing."""
    device = pipeline.device
    generator = torch.Generator(device=device).manual_seed(seed)
    _sync(device)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        result = decode_method(method, pipeline, condition, generator)
        _sync(device)
        wall = time.perf_counter() - start
    finally:
        if gc_was_enabled:
            gc.enable()
    return result, wall


def result_records(result: DecodeResult, wall: float, method: MethodSpec, indices: list[int], classes: list,
                   seed: int, unit: int, position: int, digest: str, key: str = "class") -> list[dict]:
    """One record per image of a decode (per-image shares of the batch's times); ``classes[row]``
    is recorded under ``key`` (``"class"``, or ``"prompt"`` for prompt images)."""
    rows = len(indices)
    records = []
    for row, i in enumerate(indices):
        record = result.image_record(row)
        record["mal"] = record.pop("mean_accepted_length")  # the name bench's records have always had
        records.append({
            "settings_hash": digest, "index": i, "method": method.label, "family": method.family,
            key: classes[row], "unit": unit, "seed": seed, "batch_size": rows, "order": position,
            **record, "wall_seconds": wall / rows,
            "accept_lengths": [int(n) for n in result.accept_lengths[row]],
            "tokens": result.tokens[row].tolist(),
        })
    return records


def run_bench(pipeline, condition: Condition, methods: Sequence[MethodSpec], sampling: SamplingConfig,
              out_dir: str | Path, *, seed: int = 0, threads: int | None = 1, warmup: int = 1, batch_size: int = 1,
              progress: bool = True, identity: dict | None = None, overwrite: bool = False,
              part: range | None = None, timed_by: dict | None = None) -> list[dict]:
    """Benchmark ``methods`` on ``pipeline`` (:class:`~relaxspec.pipelines.ImagePipeline`) for the
    images of ``condition`` (image ``i`` conditioned on row ``i``: class ids are a condition too,
    ``pipeline.conditions(classes=...)``) and return every record of the run (resumed ones
    included).

    ``threads``: ``torch.set_num_threads`` for the run (restored afterwards; ``None`` leaves it).
    ``warmup``: unrecorded decodes per method before the first recorded one.
    ``batch_size > 1``: throughput mode; each decode takes ``batch_size`` images and every image's
    record holds its share of the batch's time. ``identity``: what the settings record about the
    model (default: its content, :meth:`~relaxspec.pipelines.ImagePipeline.fingerprint`).

    ``part``: the units (images, or batches of ``batch_size``) this process runs, for a run
    sharded over processes (:mod:`relaxspec.runs.shards`); the others are left to the other
    processes. Seeds, method order and record indices are those of the whole run, so the shards'
    records together are the records one process would write (timings aside). ``timed_by``: what
    every record says about where it was timed (a rank and its device). ``out_dir`` is held for the
    run (:func:`relaxspec.runs.folder.hold_folder`): another run writing it is refused.
    """
    with hold_folder(out_dir, "bench"):
        return _run_bench(pipeline, condition, methods, sampling, out_dir, seed=seed, threads=threads, warmup=warmup,
                          batch_size=batch_size, progress=progress, identity=identity, overwrite=overwrite, part=part,
                          timed_by=timed_by)


def _run_bench(pipeline, condition, methods, sampling, out_dir, *, seed, threads, warmup, batch_size, progress,
               identity, overwrite, part, timed_by) -> list[dict]:

    if not isinstance(condition, Condition) or not len(condition):
        raise RelaxspecError("no images to benchmark (give a pipeline's Condition)")
    if not methods:
        raise RelaxspecError("no methods to benchmark")
    if batch_size < 1 or warmup < 0 or (threads is not None and threads < 1):
        raise RelaxspecError(f"batch size and threads must be >= 1 and warm-up >= 0 "
                             f"(got {batch_size}, {threads}, {warmup})")
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise RelaxspecError("method labels must be unique")
    out = Path(out_dir)
    # every method checked once (its sizes, its drafter) before the folder is touched
    prepared = {m.label: PreparedMethod.build(m, sampling, pipeline) for m in methods}
    settings = bench_settings(methods, condition, seed, sampling, threads or torch.get_num_threads(), batch_size,
                              pipeline.image_tokens, identity if identity is not None else {"model": pipeline.fingerprint()})
    digest = settings_hash(settings)
    records = prepare_out_dir(out, settings, digest, overwrite)
    done = {(r["index"], r["method"]) for r in records}
    units = [list(range(start, min(start + batch_size, len(condition)))) for start in range(0, len(condition), batch_size)]
    mine = range(len(units)) if part is None else part
    todo = [(u, m) for u in mine for m in methods if any((i, m.label) not in done for i in units[u])]
    if not todo:
        return records
    key = "prompt" if prompted(condition) else "class"

    with contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        if threads is not None:
            torch.set_num_threads(threads)
        for method in prepared.values():  # their parts built once, under the run's threads, before any timing,
            method.prepared.parts()      # and the caches sized for them all: every graph made at one shape
            method.prepared.reserve()
        device = pipeline.device

        def conditions(index: list[int]) -> tuple[list, Condition]:
            part = condition.select(index).to(device)
            return [record[key] for record in part.records], part

        _, first = conditions(units[mine[0]])
        pending = {m.label for _, m in todo}
        for w in range(warmup):
            for m in methods:
                if m.label in pending:
                    timed_decode(prepared[m.label], pipeline, first, WARMUP_SEED + w)
        bar = tqdm(total=len(mine) * len(methods), initial=len(mine) * len(methods) - len(todo), unit="decode",
                   desc="bench", disable=True if not progress else None)
        stack.callback(bar.close)
        path = out / RECORDS_FILE
        for u in mine:
            index = units[u]
            shift = u % len(methods)
            order = list(methods[shift:]) + list(methods[:shift])  # rotate: no method always runs first
            cond_classes, part = conditions(index)
            seed_u = batch_seed(seed, u)
            for position, m in enumerate(order):
                if all((i, m.label) in done for i in index):
                    continue
                bar.set_postfix_str(f"image {index[0]} {m.label}", refresh=False)
                result, wall = timed_decode(prepared[m.label], pipeline, part, seed_u)
                new = [{**r, **(timed_by or {})}
                       for r in result_records(result, wall, m, index, cond_classes, seed_u, u, position, digest, key)
                       if (r["index"], m.label) not in done]
                _append(path, new)
                records.extend(new)
                done.update((i, m.label) for i in index)
                bar.update(1)
    return records


def merge_shards(out: str | Path, world: int | None = None, overwrite: bool = False) -> bool:
    """When every shard of a sharded bench (``out/shard-RR-of-WW/``, one per process) holds all
    its records, write them together as ``out``'s own ``settings.json`` and ``records.jsonl`` (what
    one process would have written, each record saying which rank and device timed it) and return
    True; else False (another process is still running). ``world``: the process count (default: the
    shards' own). Shards of different settings, or a folder holding another benchmark, are refused
    in one line."""
    out = Path(out)
    folders = shard_folders(out)  # one world size (a folder mixing them is refused)
    if not folders:
        return False
    world = world if world is not None else int(SHARD.search(folders[0].name).group(2))
    metas = []
    for folder in folders:
        try:
            metas.append(json.loads((folder / SETTINGS_FILE).read_text()))
        except (OSError, json.JSONDecodeError):
            return False  # a shard that has not started yet
    if len(metas) < world:
        return False
    if len({meta.get("settings_hash") for meta in metas}) > 1:
        raise RelaxspecError(f"{out}: its shards were run with different settings; rerun them with one command")
    meta = metas[0]
    settings, digest = meta["settings"], meta["settings_hash"]
    records = [record for folder in folders for record in read_records(folder, digest)]
    images = len(settings.get("prompts") or settings.get("classes") or [])
    pairs = {(record["index"], record["method"]) for record in records}
    if len(pairs) < images * len(settings["methods"]):
        return False
    open_run(out, BENCH_RUN, settings, overwrite=overwrite, digest=digest)  # this benchmark's, or refused
    order = {label: i for i, label in enumerate(m["label"] for m in settings["methods"])}
    records.sort(key=lambda record: (record["index"], order.get(record["method"], 0)))
    write_json(out / SETTINGS_FILE, {**meta, "shards": world})  # first: a crash before the records resumes
    write_atomic(out / RECORDS_FILE, lambda temp: temp.write_text("".join(json.dumps(r) + "\n" for r in records)))
    return True


__all__ = [
    "RECORDS_FILE",
    "merge_shards",
    "SETTINGS_FILE",
    "PreparedMethod",
    "prompts_of",
    "bench_settings",
    "decode_method",
    "prompted",
    "read_records",
    "run_bench",
    "settings_hash",
    "timed_decode",
]
