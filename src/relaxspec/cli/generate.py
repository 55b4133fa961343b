"""``relaxspec generate``: condition -> image tokens (any decoding method) -> VQ decode -> PNGs,
``grid.png``, ``tokens.npy`` and ``stats.json``; resumable (finished batches of the same settings
are kept)."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from relaxspec import __version__, methods
from relaxspec.cli.options import (DEFAULT_CLASSES, add_family_inputs, add_model_path, family_inputs, open_from_args,
                                   read_prompts)
from relaxspec.conditions import Condition
from relaxspec.decoding.result import certified_tv, record_tv_sum, total_rank_counts
from relaxspec.errors import RelaxspecError
from relaxspec.files import (file_identity, load_caption_features, write_atomic, write_grid,
                             write_json, write_png)
from relaxspec.inputs import check_at_least, check_seed, check_threads, check_upscale
from relaxspec.models.llamagen.checkpoints import PRECISIONS
from relaxspec.models.llamagen.gpt import GPT_SIZES
from relaxspec.models.llamagen.vq import VQ_CONFIGS
from relaxspec.sampling import batch_seed

STATS_FILE, TOKENS_FILE = "stats.json", "tokens.npy"
def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    gen = subparsers.add_parser("generate", help="generate images", description=(
        "Generate images with a LlamaGen checkpoint (or, with --model-path, a Janus / Emu3 transformers folder). "
        "Writes NNNN.png per image, grid.png, tokens.npy "
        "and stats.json into --out; an interrupted run resumes when started again with the same settings."))
    gen.set_defaults(handler=cmd_generate)
    models = gen.add_argument_group("models")
    models.add_argument("--gpt-ckpt", metavar="PATH",
                        help="GPT weights: official .pt/.pth, .safetensors, or a relaxspec model folder "
                             "(default: the embedded emoji model, with its tokenizer and drafter)")
    models.add_argument("--gpt-model", metavar="NAME|JSON", help=(
        f"named size ({', '.join(GPT_SIZES)}), or a JSON file of GPTConfig fields for other sizes; "
        "needed for official files (the head count is not in the weights)"))
    models.add_argument("--vq-ckpt", metavar="PATH", help="VQ tokenizer weights (default: the embedded model's)")
    models.add_argument("--vq-model", default="VQ-16", metavar="NAME|JSON",
                        help=f"named tokenizer ({', '.join(VQ_CONFIGS)}) or a JSON file of VQConfig fields (default VQ-16)")
    models.add_argument("--image-size", type=int, help="pixels per side; fixes the token grid (default: the model's "
                                                       "own for relaxspec folders, else 256; Emu3: the image area "
                                                       "its processor asks for, default its own)")
    add_model_path(models)
    add_family_inputs(models)
    models.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32", help="GPT weights dtype (default fp32)")
    models.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    models.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice; 1 is often "
                                                    "fastest for small models on a busy machine)")

    cond = gen.add_argument_group("conditions")
    cond.add_argument("--classes", metavar="IDS|NAMES",
                      help=f"comma-separated class ids for a c2i model, or class names when the model names its "
                           f"classes (the embedded model: e.g. animal-mammal,food-fruit) (default: upstream's demo "
                           f"list {DEFAULT_CLASSES}, or the embedded model's demo classes)")
    cond.add_argument("--caption-features", metavar="PATH",
                      help="t2i: .npy of caption features [N, tokens, dim] (T5, left-padded), or .npz with "
                           "'features' and optional 'mask'")
    cond.add_argument("--caption-mask", metavar="PATH", help="t2i: .npy [N, tokens] of 1 (real token) / 0 (padding)")
    cond.add_argument("--prompt", action="append", metavar="TEXT",
                      help="t2i: a text prompt (repeatable), encoded with --t5-path as upstream LlamaGen does")
    cond.add_argument("--prompts-file", metavar="FILE", help="t2i: text prompts, one per line (blank lines skipped); a .json "
                      "file: MS-COCO captions (first per image) or a JSON list of captions")

    sampling = gen.add_argument_group("sampling (upstream order: CFG, temperature, top-k, top-p)")
    sampling.add_argument("--cfg-scale", type=float, help="classifier-free guidance (default 4.0, upstream's demo; "
                                                          "the embedded model's own default with it; 1 = off)")
    sampling.add_argument("--temperature", type=float, help="0 = greedy (default 1.0)")
    sampling.add_argument("--top-k", type=int, help="0 = off (default 2000, upstream's demo; embedded: its own)")
    sampling.add_argument("--top-p", type=float, help="in (0, 1] (default 1.0 = off)")
    sampling.add_argument("--seed", type=int, default=0,
                          help="batch b samples with a generator seeded seed * 1000003 + b (default 0)")

    method = gen.add_argument_group("decoding method (each flag is a setting of the methods in relaxspec.methods; a "
                                    "flag the chosen method does not read is an error)")
    method.add_argument("--method", choices=methods.names(), metavar="NAME",
                        help=f"{' | '.join(methods.names())} (default: ar, or the embedded model's documented default "
                             "method, MODEL_CARD.md); a model's own presets tune a name (the embedded model's "
                             "--method lantern is its tuned LANTERN)")
    method.add_argument("--drafter-ckpt", metavar="PATH", help="EAGLE drafter (methods that draft with it)")
    method.add_argument("--preset", metavar="TUNE_JSON", help="a preset file from relaxspec tune for this model on this "
                                                             "kind of machine: its method, settings, sampling and "
                                                             "threads (flags set over it)")
    add_setting_flags(method)

    output = gen.add_argument_group("output")
    output.add_argument("--out", required=True, metavar="DIR", help="output folder")
    output.add_argument("--batch-size", type=int, default=1, help="images per decoding batch (default 1)")
    output.add_argument("--upscale", type=int, default=1, metavar="N",
                        help="enlarge every PNG (and so the grid) N times, nearest neighbour, so small images "
                             "are viewable (tokens and stats are unchanged; the output side is capped at 8192 px; "
                             "default 1)")
    output.add_argument("--grid-max", type=int, default=64, help="images in grid.png (the first N; default 64)")
    output.add_argument("--overwrite", action="store_true",
                        help="replace a previous run in --out made with different settings")
    output.add_argument("--no-progress", action="store_true", help="no progress bars")
    return gen


def add_setting_flags(group) -> None:
    """One flag per method setting of the registry (unset flags stay ``None``: the method's
    preset and defaults apply)."""
    for setting in methods.settings().values():
        kwargs = dict(dest=setting.name, default=None, help=setting.help)
        if setting.kind is bool:
            kwargs["action"] = "store_false" if setting.off_switch else "store_true"
        else:
            kwargs.update(type=setting.kind, choices=setting.choices)
        group.add_argument(setting.cli_flag, **kwargs)


def given_settings(args: argparse.Namespace) -> dict:
    """The method flags the user set (unset flags stay out: the method's preset and defaults apply)."""
    return {name: getattr(args, name) for name in methods.settings() if getattr(args, name, None) is not None}


def command_condition(args: argparse.Namespace, pipeline, prompts: list[str]) -> Condition:
    """The images' conditions from --classes, prompts or --caption-features, for ``pipeline``."""
    if pipeline.takes == "classes":
        if getattr(args, "caption_features", None) or getattr(args, "caption_mask", None):
            raise RelaxspecError("this is a class-conditional (c2i) model: give --classes, not --caption-features")
        if prompts:
            raise RelaxspecError("this is a class-conditional (c2i) model: give --classes, not prompts")
        return pipeline.conditions(classes=args.classes)
    if args.classes is not None:
        if hasattr(pipeline, "caption_condition"):
            raise RelaxspecError("this is a text-to-image (t2i) model: give --prompt / --caption-features, not --classes")
        raise RelaxspecError(f"this {pipeline.family} model takes text prompts: --prompt TEXT or --prompts-file FILE")
    if prompts:
        return pipeline.conditions(prompts=prompts)
    if getattr(args, "caption_features", None) and hasattr(pipeline, "caption_condition"):
        features, mask = load_caption_features(args.caption_features, args.caption_mask)
        return pipeline.caption_condition(features, mask, args.caption_features)
    if hasattr(pipeline, "caption_condition"):
        if getattr(args, "t5_path", None):
            raise RelaxspecError("--t5-path encodes prompts: give --prompt TEXT or --prompts-file FILE")
        config = pipeline.target.config
        raise RelaxspecError(f"this is a text-to-image (t2i) model: give --prompt TEXT with --t5-path DIR, or "
                             f"--caption-features PATH.npy (caption features [N, {config.cls_token_num}, "
                             f"{config.caption_dim}], e.g. Flan-T5-XL outputs)")
    raise RelaxspecError(f"this {pipeline.family} model takes text prompts: give --prompt TEXT (repeatable) or "
                         "--prompts-file FILE")


def check_inputs(args: argparse.Namespace) -> list[str]:
    """Everything that can be checked before a model loads (one line each); returns the prompts."""
    if args.image_size is not None:
        check_at_least("image size", args.image_size, 1)
    check_at_least("batch size", args.batch_size, 1)
    check_at_least("grid max", args.grid_max, 0)
    check_upscale(args.upscale)  # the output side is checked once the model's image size is known
    check_seed(args.seed)
    embedded = args.gpt_ckpt is None and args.model_path is None
    preset = preset_option(args)
    if args.threads is None and preset is not None and preset.get("threads"):
        args.threads = int(preset["threads"])  # the threads it was timed with
    if args.threads is None and embedded:
        # A model this small is fastest on one thread, and far slower with two when anything else
        # runs on the other core (thread hand-offs, not arithmetic, dominate).
        args.threads = 1
    if args.threads is not None:
        torch.set_num_threads(check_threads(args.threads))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise RelaxspecError(f"--out {out}: exists and is not a folder")
    prompts = read_prompts(args)
    if args.model_path is not None:  # checked before the folder is read: what it takes
        from relaxspec.pipelines.families import check_inputs as check_family_inputs
        from relaxspec.pipelines.open import folder_pipeline_class

        family = folder_pipeline_class(args.model_path)
        check_family_inputs(family, family_inputs(args))
        if args.classes is not None or args.caption_features or not prompts:
            raise RelaxspecError(f"this {family.family} model takes text prompts: --prompt TEXT or --prompts-file FILE")
    if preset is not None:
        fields = dict(preset["method"])
        methods.resolve(fields.pop("method"), given_settings(args), {preset["method"]["method"]: fields})
    elif embedded:  # the method is checked before any weights load (the embedded model's presets are a file)
        from relaxspec import embedded as shipped

        early = shipped.defaults()
        methods.resolve(args.method or early.get("method", {}).get("method", "ar"), given_settings(args),
                        early.get("presets"))
    else:
        methods.resolve(args.method or "ar", given_settings(args))
    return prompts


def preset_option(args: argparse.Namespace) -> dict | None:
    """The ``--preset`` file, read and checked (``None`` without one); it names the method, so
    ``--method`` is refused beside it."""
    if getattr(args, "preset", None) is None:
        return None
    from relaxspec.pipelines.presets import read_preset

    if getattr(args, "method", None) is not None:
        raise RelaxspecError("--preset names the method: leave out --method (setting flags still apply over it)")
    return read_preset(args.preset)


def run_settings(args: argparse.Namespace, pipeline, options, sampling, condition: Condition) -> dict:
    """What stats.json records and the resume check compares: the model's identity, the images,
    sampling, the method's settings (only those it reads), seeding, and the files read."""
    drafter_path = pipeline.drafter_path if options.needs_drafter else None  # not read, so not recorded
    files = {**pipeline.files, "drafter_ckpt": drafter_path, "caption_features": args.caption_features,
             "caption_mask": args.caption_mask, "prompts_file": args.prompts_file}
    settings = {
        **pipeline.identity,
        "image_size": pipeline.image_size, "image_tokens": pipeline.image_tokens, **condition.settings,
        "sampling": sampling.to_dict(), "method": options.to_dict(),
        "drafter_ckpt": None if drafter_path is None else str(Path(drafter_path).resolve()),
        "seed": args.seed, "seeding": "batch b: torch.Generator().manual_seed(seed * 1000003 + b)",
        "batch_size": args.batch_size, "precision": args.precision, "device": str(pipeline.device),
        "files": {key: file_identity(path) for key, path in files.items() if path},
    }
    if args.upscale != 1:  # recorded only when used, so runs from before the flag still resume
        settings["upscale"] = args.upscale
    if args.model_path is not None and args.image_size is not None:
        # A folder family reads --image-size its own way (Emu3: the processor's image area), so the
        # flag as given is what reopens this run's model (build-tree --budget auto).
        settings["image_size_given"] = args.image_size
    return settings


def cmd_generate(args: argparse.Namespace) -> int:
    wall = time.perf_counter()
    prompts = check_inputs(args)
    out = Path(args.out)
    pipeline = open_from_args(args, prompts=prompts if args.model_path is not None and prompts else None)
    if args.preset is not None:
        from relaxspec.pipelines.presets import with_preset

        pipeline = with_preset(pipeline, args.preset)
    sampling = pipeline.sampling(cfg_scale=args.cfg_scale, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p)
    options = methods.resolve(args.method or pipeline.default_method, given_settings(args), pipeline.presets)
    if args.drafter_ckpt is not None and not options.needs_drafter and args.preset is None:
        raise RelaxspecError(f"--drafter-ckpt is not used by {options.family.where(options)}")
    if options.needs_drafter and pipeline.drafter is None:
        raise RelaxspecError("--drafter-ckpt is required: this method drafts with an EAGLE drafter trained for the "
                             "target (train one with relaxspec train-drafter)")
    pipeline.check_fits(options)
    condition = command_condition(args, pipeline, prompts)
    check_upscale(args.upscale, pipeline.image_size)
    device = pipeline.device
    settings = run_settings(args, pipeline, options, sampling, condition)
    settings_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    num_images, num_tokens = len(condition), pipeline.image_tokens
    out.mkdir(parents=True, exist_ok=True)
    records, tokens, old_counts = previous_run(out, settings, settings_hash, num_images, num_tokens, args.overwrite)
    batch_counts = kept_batch_counts(old_counts, records, args.batch_size, num_images)

    print(f"relaxspec: {options.describe()}", file=sys.stderr)  # the settings in use, and only those
    stats = {"relaxspec_version": __version__, "settings_hash": settings_hash, "settings": settings,
             "complete": False, "images": [], "totals": {}}
    load_seconds = time.perf_counter() - wall
    show = not args.no_progress
    bar = tqdm(total=num_images, initial=len(records), unit="image", desc="generate",
               disable=True if not show else None)
    generated = 0
    for batch, start in enumerate(range(0, num_images, args.batch_size)):
        index = list(range(start, min(start + args.batch_size, num_images)))
        if all(i in records for i in index):
            continue
        seed = batch_seed(args.seed, batch)
        generator = torch.Generator(device=device).manual_seed(seed)
        result = pipeline.generate(condition.select(index), options, sampling, generator=generator,
                                   progress=show and sys.stderr.isatty())
        began = time.perf_counter()
        with torch.inference_mode():
            pixels = pipeline.pixels(result.tokens)
        vq_seconds = time.perf_counter() - began
        mal = result.mean_accepted_length
        if result.rank_tests is not None:  # per batch, so a resumed run keeps the finished batches' counts
            batch_counts[str(batch)] = {"tests": result.rank_tests.tolist(), "accepts": result.rank_accepts.tolist()}
        if batch_counts:
            stats["acceptance_counts"] = total_rank_counts(batch_counts.values())
            stats["acceptance_counts_by_batch"] = batch_counts
        for row, i in enumerate(index):
            name = f"{i:04d}.png"
            write_png(out / name, upscale(pixels[row], args.upscale))
            tokens[i] = result.tokens[row].numpy()
            records[i] = {
                "index": i, "file": name, **condition.records[i], "batch": batch, "batch_seed": seed,
                "seconds": result.seconds / len(index), "vq_seconds": vq_seconds / len(index),
                "target_forwards": int(result.target_forwards[row]),
                "drafter_forwards": int(result.drafter_forwards[row]),
                "drafter_seconds": result.drafter_seconds / len(index),
                "target_forward_seconds": result.target_forward_seconds / len(index),
                "drafter_forward_seconds": result.drafter_forward_seconds / len(index),
                "mean_accepted_length": float(mal[row]), **result.tv_record(row),
            }
        generated += len(index)
        # Tokens first, then the record of what is finished: a crash in between only redoes a batch.
        write_atomic(out / TOKENS_FILE, lambda path: np.save(path, tokens))
        stats["images"] = [records[i] for i in sorted(records)]
        write_json(out / STATS_FILE, stats)
        bar.update(len(index))
    bar.close()

    write_grid(out, [records[i]["file"] for i in range(min(num_images, args.grid_max))])
    done = [records[i] for i in range(num_images)]
    stats.update(complete=True, images=done, totals=run_totals(done, num_tokens, generated))
    stats["totals"].update(load_seconds=load_seconds, wall_seconds_this_run=time.perf_counter() - wall)
    write_atomic(out / TOKENS_FILE, lambda path: np.save(path, tokens))
    write_json(out / STATS_FILE, stats)
    totals = stats["totals"]
    print(f"{num_images} images in {out} ({generated} generated now, {num_images - generated} kept); "
          f"{totals['seconds_per_image']:.2f} s/image, {totals['target_forwards_per_image']:.1f} target forwards/image, "
          f"MAL {totals['mean_accepted_length']:.2f}")
    return 0


def run_totals(done: list[dict], num_tokens: int, generated: int) -> dict:
    """stats.json's totals over the finished images' records: times and where they went, target
    forwards, MAL, and the TV certificate (``min(1, mean of the per-image sums)``, never a mean of
    capped values; none when the record was off)."""
    num_images = len(done)
    forwards = sum(r["target_forwards"] for r in done)
    seconds = sum(r["seconds"] for r in done)
    tv_sums = [record_tv_sum(r) for r in done]
    recorded = not any(math.isnan(v) for v in tv_sums)  # --no-tv-record: no certificate
    return {
        "images": num_images, "generated_this_run": generated,
        "seconds": seconds, "seconds_per_image": seconds / num_images,
        "vq_seconds_per_image": sum(r["vq_seconds"] for r in done) / num_images,
        # where the decoding time went (records of runs before forwards were timed count as 0)
        **{f"{part}_share": sum(r.get(f"{part}_seconds", 0.0) for r in done) / max(seconds, 1e-12)
           for part in ("target_forward", "drafter_forward")},
        "target_forwards_per_image": forwards / num_images,
        "mean_accepted_length": num_images * num_tokens / forwards,
        "tv_sum_mean": sum(tv_sums) / num_images if recorded else None,
        "tv_per_token_mean": sum(tv_sums) / (num_images * num_tokens) if recorded else None,
        "tv_certified": certified_tv(tv_sums) if recorded else None,
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


def previous_run(out: Path, settings: dict, settings_hash: str, num_images: int, num_tokens: int,
                 overwrite: bool) -> tuple[dict[int, dict], np.ndarray, dict]:
    """The images of an earlier run with the same settings that are finished (PNG on disk, tokens
    saved), the token array to continue (tokens of unfinished images are -1) and that run's
    per-batch acceptance counts."""
    tokens = np.full((num_images, num_tokens), -1, dtype=np.int64)
    stats_path = out / STATS_FILE
    if not stats_path.exists():
        return {}, tokens, {}
    try:
        old = json.loads(stats_path.read_text())
        old_hash, old_images = old["settings_hash"], old["images"]
        if not isinstance(old_images, list) or not all(isinstance(r, dict) for r in old_images):
            raise TypeError
    except (json.JSONDecodeError, KeyError, TypeError):
        old = old_hash = None
    if old_hash != settings_hash:
        if not overwrite:
            if old is None:
                raise RelaxspecError(f"--out {out}: {stats_path.name} there is not from relaxspec; "
                                     "choose another folder or pass --overwrite")
            old_settings = old.get("settings", {}) if isinstance(old.get("settings"), dict) else {}
            settings = json.loads(json.dumps(settings))  # tuples -> lists, as stored
            changed = sorted(k for k in set(settings) | set(old_settings) if settings.get(k) != old_settings.get(k))
            raise RelaxspecError(f"--out {out} holds a run with different settings (changed: {', '.join(changed) or '?'}); "
                                 "choose another folder or pass --overwrite")
        for record in old_images if old is not None else []:
            stale = out / str(record.get("file", ""))
            if stale.parent == out and stale.suffix == ".png" and stale.is_file():
                stale.unlink()
        return {}, tokens, {}
    try:
        saved = np.load(out / TOKENS_FILE, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return {}, tokens, {}
    if saved.shape != tokens.shape:
        return {}, tokens, {}
    records = {}
    for record in old_images:
        i = record.get("index")
        if (isinstance(i, int) and 0 <= i < num_images and (out / str(record.get("file"))).is_file()
                and (saved[i] >= 0).all()):
            records[i] = record
            tokens[i] = saved[i]
    return records, tokens, old.get("acceptance_counts_by_batch") or {}


def upscale(pixels: np.ndarray, factor: int) -> np.ndarray:
    """``[H, W, 3]`` -> ``[factor * H, factor * W, 3]``, each pixel a ``factor`` x ``factor`` block."""
    return pixels if factor == 1 else pixels.repeat(factor, axis=0).repeat(factor, axis=1)
