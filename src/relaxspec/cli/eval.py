"""``relaxspec eval``: generate N images per class (or caption, or prompt) with ``relaxspec generate``,
sharded over processes, then score them.

Usage::

    relaxspec eval --images-per-class 50 --fid-ref REAL_DIR -- \\
        --gpt-ckpt c2i_B_256.pt --gpt-model GPT-B --vq-ckpt vq_ds16_c2i.pt --classes 0,1,2 \\
        --method lantern++ --drafter-ckpt drafter --out eval-lpp

Everything after ``--`` is ``relaxspec generate``'s own options (its parser checks them); eval
repeats every class (or caption of ``--caption-features``, or prompt of ``--prompt`` /
``--prompts-file``, e.g. with ``--model-path`` or ``--t5-path``) ``--images-per-class`` times, in
order.

Sharding (``torchrun --nproc_per_node G -m relaxspec eval ...``): rank ``r`` of ``W`` (the ``RANK`` /
``WORLD_SIZE`` variables torchrun sets; 0 / 1 without it) takes the contiguous slice
``[r * n / W, (r + 1) * n / W)`` of the image list and writes it to ``OUT/shard-RR-of-WW/`` with
``relaxspec generate``'s resumable writer (``--device cuda`` becomes ``cuda:LOCAL_RANK``). Rank
``r`` seeds with ``seed * W + r``, so a run is reproducible for a given ``W`` (with ``W = 1`` the
shard is exactly ``relaxspec generate``'s output). Restarting the same command resumes every
shard. The process that completes the last shard computes the scores (no process group is
needed); ``--scores-only`` recomputes them from the shards on disk.

Scores, each optional:

* ``--fid-ref DIR``: FID with clean-fid (``pip install clean-fid``: it needs torchvision, so it
  is never a relaxspec requirement) against the images in ``DIR``. clean-fid's Inception weights
  (``inception-2015-12-05.pt``) must be in its cache (``/tmp``) or downloadable.
* ``--classifier DIR --real-data NPZ``: the offline numbers of ``relaxspec bench`` — class
  accuracy, FID-like distance (our classifier's features, not comparable to FID), precision /
  recall — against held-out real images.
* ``--clip-path DIR``: the CLIP score of every image against its own prompt
  (:mod:`relaxspec.evaluation.clip`: official LANTERN's definition by default, ``--clip-score
  torchmetrics`` for torchmetrics', with a bootstrap 95% interval) from a local CLIP folder (safetensors only). Prompt runs only: a class
  id has no text to score against (class names are labels, not the captions CLIP scores are
  reported on), and ``--caption-features`` hold T5 features, not text, so both are refused.

Prompts: ``--prompts-file FILE.json`` (after ``--``) is read as a captions file, as every command
reads one (:func:`relaxspec.files.read_captions_json`: MS-COCO's ``captions_val2017.json`` gives
the first caption of each image, images by id; a JSON list or object of captions, e.g. LANTERN's
``captions_val2017_longest.json``, as is); other files are prompts one per line.
``--num-prompts N`` keeps the first N prompts.

Every score's inputs are checked before an image is generated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image
import torch

from relaxspec.errors import RelaxspecError
from relaxspec.inputs import check_image_count
from relaxspec.runs.shards import SHARD, distributed, shard_dir, shard_folders, shard_range
from relaxspec.cli.options import require_extras, Parser, read_prompts
from relaxspec.extras import require
from relaxspec.files import load_caption_features, read_json, write_atomic, write_json
from relaxspec.cli.imagerun import add_image_run_options, open_run, prepare, run_settings
from relaxspec.runs.images import summary, write_image_run
from relaxspec.bench.report import FID_LIKE_NOTE, load_real_images, quality_metrics, read_pngs
from relaxspec.evaluation.classifier import load_classifier

SCORES_FILE = "eval.json"
INCEPTION_FILE = "inception-2015-12-05.pt"


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    ev = subparsers.add_parser("eval", help="generate N images per class / prompt, sharded, then FID / CLIP / "
                                            "offline scores",
                               description=(
        "Generate --images-per-class images for every class (or caption) with relaxspec generate, sharded over "
        "torchrun processes (RANK / WORLD_SIZE) into OUT/shard-RR-of-WW/, resumable; then score them. Put "
        "relaxspec generate's options after '--' (they must include --out)."),
        usage="relaxspec eval [eval options] -- GENERATE_OPTIONS --out DIR")
    ev.set_defaults(handler=run_eval)
    ev.add_argument("--images-per-class", type=int, default=1, metavar="N",
                    help="images per class id / caption / prompt (default 1)")
    ev.add_argument("--fid-ref", metavar="DIR", help="reference images for FID with clean-fid (optional extra)")
    ev.add_argument("--fid-mode", default="clean", choices=("clean", "legacy_pytorch", "legacy_tensorflow"),
                    help="clean-fid's resizing mode (default clean)")
    ev.add_argument("--classifier", metavar="DIR", help="offline scores with this relaxspec classifier ...")
    ev.add_argument("--real-data", metavar="NPZ", help="... against these held-out real images (images, labels)")
    ev.add_argument("--clip-path", metavar="DIR",
                    help="CLIP score of each image against its own prompt, with this local CLIP folder (save_pretrained "
                         "layout, safetensors; prompt runs only)")
    ev.add_argument("--clip-score", choices=("lantern", "torchmetrics"), default="lantern",
                    help="the CLIP score's definition: lantern (default; official LANTERN's, for the LANTERN / "
                         "LANTERN++ tables with ViT-B/32): mean cos(image, 'A photo depicts ' + prompt); torchmetrics: "
                         "mean 100 * max(cos(image, prompt), 0)")
    ev.add_argument("--eval-res", type=int, metavar="PX",
                    help="FID and CLIP see every image (generated and reference) centre-cropped and LANCZOS-resized to "
                         "PX first, as official LANTERN's evaluation does (its tables: 256); default: as they are")
    ev.add_argument("--num-prompts", type=int, metavar="N",
                    help="only the first N prompts of --prompt / --prompts-file (a .json prompts file is read as "
                         "COCO captions or a JSON list of captions)")
    ev.add_argument("--scores-only", action="store_true", help="generate nothing; score the shards in --out")
    ev.add_argument("--table", nargs="+", metavar="OUT",
                    help="generate nothing: the per-method table of finished eval folders (their eval.json), one row "
                         "each, with the intervals; written to the first folder's parent as eval-table.md")
    ev.add_argument("generate_args", nargs=argparse.REMAINDER, help="-- then relaxspec generate's options")
    return ev


def parse_generate_args(argv: list[str]) -> argparse.Namespace:
    """``relaxspec generate``'s options (:func:`relaxspec.cli.imagerun.add_image_run_options`)."""
    argv = argv[1:] if argv and argv[0] == "--" else argv
    if not argv:
        raise RelaxspecError("give relaxspec generate's options after '--' (at least the models and --out DIR)")
    parser = Parser(prog="relaxspec eval ... --")
    add_image_run_options(parser)
    return parser.parse_args(argv)


def _write_captions(path: Path, features: np.ndarray, mask: np.ndarray | None) -> None:
    """Write a shard's caption file only if it differs: generate's settings hash includes the file's
    mtime, so rewriting an identical file would make a resumed shard look like a new run."""
    if path.is_file():
        with np.load(path, allow_pickle=False) as old:
            same = np.array_equal(old["features"], features) and (
                ("mask" in old.files) == (mask is not None) and (mask is None or np.array_equal(old["mask"], mask)))
        if same:
            return
    arrays = {"features": features, **({"mask": mask} if mask is not None else {})}
    write_atomic(path, lambda temp: np.savez(temp, **arrays))


def generate_shard(args: argparse.Namespace, gen: argparse.Namespace, rank: int, world: int, local: int) -> Path:
    """Generate this rank's slice into its shard folder: the pipeline the options name, the
    shard's conditions, and :func:`relaxspec.runs.images.write_image_run` (resumable)."""
    out = Path(gen.out)
    folder = shard_dir(out, rank, world)
    folder.mkdir(parents=True, exist_ok=True)
    repeat = args.images_per_class
    if world > 1 and gen.device == "cuda":
        gen.device = f"cuda:{local}"
    pipeline, started = None, None
    if gen.prompt or gen.prompts_file:
        given = read_prompts(gen)
        check_image_count(repeat * len(given), f"--images-per-class {repeat} x {len(given)} prompts")
        prompts = [p for p in given for _ in range(repeat)]
        mine = [prompts[i] for i in shard_range(len(prompts), rank, world)]
        gen.prompt, gen.prompts_file = mine, None  # the shard's prompts, in order (stats.json records them)
        count = len(mine)
    elif gen.caption_features:
        features, mask = load_caption_features(gen.caption_features, gen.caption_mask)
        check_image_count(repeat * features.shape[0], f"--images-per-class {repeat} x {features.shape[0]} captions")
        items = np.repeat(np.arange(features.shape[0]), repeat)
        mine = items[list(shard_range(len(items), rank, world))]
        captions = folder / "captions.npz"
        _write_captions(captions, features.numpy()[mine], None if mask is None else mask.numpy()[mine])
        gen.caption_features, gen.caption_mask = str(captions), None
        count = len(mine)
    else:
        # ids or names as given: generate checks them (relaxspec.conditions.class_ids) in each shard
        given = gen.classes
        if given is None:  # the opened model's demo classes (upstream's for an ImageNet LlamaGen, the embedded model's)
            started = time.perf_counter()  # the load time counts from here
            pipeline = open_run(gen)
            if pipeline.takes != "classes":
                raise RelaxspecError(f"this is a text-to-image model ({pipeline.family}): {pipeline.conditions_hint()}")
            given = pipeline.default_classes
            if given is None:
                raise RelaxspecError("give --classes (this model has no demo classes)")
        given = [c.strip() for c in (given.split(",") if isinstance(given, str) else [str(c) for c in given])]
        given = [c for c in given if c]
        check_image_count(repeat * len(given), f"--images-per-class {repeat} x {len(given)} classes")
        classes = [c for c in given for _ in range(repeat)]
        if not classes:
            raise RelaxspecError("no classes given")
        mine = [classes[i] for i in shard_range(len(classes), rank, world)]
        gen.classes = mine
        count = len(mine)
    if count == 0:
        print(f"rank {rank}/{world}: no images in this shard", file=sys.stderr)
        return folder
    gen.out = str(folder)
    gen.seed = gen.seed * world + rank
    if started is None:
        started = time.perf_counter()
    pipeline, condition, prepared = prepare(gen, pipeline)
    stats = write_image_run(pipeline, condition, prepared, folder, run_settings(gen, pipeline, prepared, condition),
                            seed=gen.seed, batch_size=gen.batch_size, overwrite=gen.overwrite,
                            progress=not gen.no_progress, grid_max=gen.grid_max, upscale_by=gen.upscale,
                            started=started)
    print(summary(folder, stats))
    return folder


def shards_complete(out: Path) -> bool:
    folders = shard_folders(out)
    if not folders:
        return False
    world = int(SHARD.search(folders[0].name).group(2))
    if len(folders) < world:
        return False
    for folder in folders:
        try:
            if not json.loads((folder / "stats.json").read_text()).get("complete"):
                return False
        except (OSError, json.JSONDecodeError):
            return False
    return True


def generated_records(out: Path) -> tuple[list[Path], list[dict]]:
    """Every generated PNG of every shard, in order, with its ``stats.json`` record (its class or
    prompt)."""
    files, records = [], []
    for folder in shard_folders(out):
        try:
            stats = json.loads((folder / "stats.json").read_text())
        except (OSError, json.JSONDecodeError):
            raise RelaxspecError(f"{folder}: no readable stats.json (generation did not start there)") from None
        for record in stats.get("images", []):
            path = folder / str(record.get("file"))
            if path.is_file():
                files.append(path)
                records.append(record)
    return files, records


def crop_resize(size: int):
    """``image [H, W, 3] uint8 -> [size, size, 3]``: the centre square of the long edge, then a
    LANCZOS resize, as official LANTERN's evaluation prepares both generated and reference images
    (``--eval_res``; COCO's photos are not square)."""
    def transform(image: np.ndarray) -> np.ndarray:
        picture = Image.fromarray(np.asarray(image))
        side = min(picture.size)
        left, top = (picture.width - side) // 2, (picture.height - side) // 2
        picture = picture.crop((left, top, left + side, top + side))
        return np.asarray(picture.resize((size, size), Image.LANCZOS))

    return transform


def clean_fid(files: list[Path], reference: str, mode: str = "clean", device: str = "cpu", progress: bool = True,
              eval_res: int | None = None) -> float:
    """FID (clean-fid's Inception features) between ``files`` and the images in ``reference``;
    ``eval_res``: both sets centre-cropped and resized first (:func:`crop_resize`), as LANTERN's
    tables are computed."""
    try:
        from cleanfid import fid as cfid
        from cleanfid.features import build_feature_extractor
    except ImportError:
        raise RelaxspecError("--fid-ref needs clean-fid (pip install clean-fid; it pulls in torchvision). "
                             "Without it, use --classifier/--real-data for the offline scores") from None

    if not Path(reference).is_dir():
        raise RelaxspecError(f"--fid-ref {reference}: no such folder")
    try:
        model = build_feature_extractor(mode, torch.device(device), use_dataparallel=False)
    except OSError as err:  # urllib's URLError is an OSError
        raise RelaxspecError(f"clean-fid could not load its Inception weights ({err}); put {INCEPTION_FILE} in "
                             f"/tmp (clean-fid's cache) on an offline machine") from None
    kwargs = dict(num_workers=0, batch_size=32, device=torch.device(device), mode=mode, verbose=progress)
    if eval_res is not None:
        kwargs["custom_image_tranform"] = crop_resize(eval_res)  # clean-fid's spelling
    generated = cfid.get_files_features([str(f) for f in files], model, description="FID generated: ", **kwargs)
    real = cfid.get_folder_features(str(reference), model, description="FID reference: ", **kwargs)
    return float(cfid.fid_from_feats(generated, real))


def score(args: argparse.Namespace, out: Path, device: str = "cpu", progress: bool = True) -> dict:
    """The requested scores of everything generated in ``out``, written to ``OUT/eval.json``."""
    files, records = generated_records(out)
    labels = [record.get("class") for record in records]
    if not files:
        raise RelaxspecError(f"{out}: no generated images to score")
    scores: dict = {"images": len(files), "shards": [p.name for p in shard_folders(out)],
                    "images_per_class": args.images_per_class}
    if args.fid_ref:
        scores["fid"] = {"value": clean_fid(files, args.fid_ref, args.fid_mode, device, progress, args.eval_res),
                         "reference": str(Path(args.fid_ref).resolve()), "mode": args.fid_mode,
                         "eval_res": args.eval_res,
                         "feature_network": "clean-fid Inception-v3 (inception-2015-12-05)"}
    if args.classifier:
        if any(label is None for label in labels):
            raise RelaxspecError("--classifier scores class-conditional images (these were generated from captions "
                                 "or prompts)")
        real, _ = load_real_images(args.real_data, labels)
        quality = quality_metrics({"generated": (read_pngs(files), np.array(labels))}, load_classifier(args.classifier),
                                  real)["generated"]
        scores["offline"] = {**quality, "classifier": str(Path(args.classifier).resolve()),
                             "real_data": str(Path(args.real_data).resolve()), "note": FID_LIKE_NOTE}
    if args.clip_path:
        from relaxspec.evaluation.clip import clip_score

        prompts = [record.get("prompt") for record in records]
        if not all(isinstance(prompt, str) for prompt in prompts):
            raise RelaxspecError("--clip-path scores images against their prompts (these were generated from classes "
                                 "or caption features)")
        scores["clip"] = clip_score(files, prompts, args.clip_path, device=device, progress=progress,
                                    definition=args.clip_score,
                                    transform=None if args.eval_res is None else crop_resize(args.eval_res))
        scores["clip"]["eval_res"] = args.eval_res
    write_json(out / SCORES_FILE, scores)
    return scores


def eval_prompts(args: argparse.Namespace, gen: argparse.Namespace) -> None:
    """The run's prompts read now (a bad prompts file is refused before any shard is written) and
    ``--num-prompts`` applied: ``gen.prompt`` becomes the run's first N prompts, in order."""
    if gen.prompts_file:
        read_prompts(gen)
    if args.num_prompts is not None:
        if args.num_prompts < 1:
            raise RelaxspecError(f"--num-prompts must be >= 1, got {args.num_prompts}")
        prompts = read_prompts(gen)
        if not prompts:
            raise RelaxspecError("--num-prompts keeps the first N prompts of --prompt / --prompts-file: this run has none")
        if args.num_prompts > len(prompts):  # said, and recorded as used (issue 45)
            print(f"relaxspec: note: --num-prompts {args.num_prompts:,}: the run has {len(prompts):,} prompts; "
                  f"all {len(prompts):,} are used", file=sys.stderr)
            args.num_prompts = len(prompts)
        gen.prompt, gen.prompts_file = prompts[:args.num_prompts], None


TABLE_FILE = "eval-table.md"


def _interval(score: dict | None, digits: int = 2) -> str:
    if not score or score.get("value") is None:
        return "–"
    text = f"{score['value']:.{digits}f}"
    return text if score.get("lo") is None else f"{text} [{score['lo']:.{digits}f}, {score['hi']:.{digits}f}]"


def table_rows(folders: list[str]) -> list[dict]:
    """One row per eval folder: its method (from the first shard's settings), images and scores."""
    rows = []
    for folder in map(Path, folders):
        path = folder / SCORES_FILE
        if not path.is_file():
            raise RelaxspecError(f"--table {folder}: no {SCORES_FILE} (run relaxspec eval with a score there first)")
        scores = read_json(path)
        shards = shard_folders(folder)
        settings = read_json(shards[0] / "stats.json").get("settings", {}) if shards else {}
        method = settings.get("method") or {}
        offline = scores.get("offline") or {}
        accuracy = offline.get("class_accuracy")
        rows.append({"folder": str(folder), "method": " ".join(f"{k}={v}" for k, v in method.items()) or "?",
                     "images": scores.get("images"), "fid": (scores.get("fid") or {}).get("value"),
                     "clip": scores.get("clip"),
                     "accuracy": None if not accuracy else {"value": accuracy[0], "lo": accuracy[1], "hi": accuracy[2]}})
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| run | method | images | FID | CLIP score [95% CI] | class accuracy [95% CI] |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        fid = "–" if row["fid"] is None else f"{row['fid']:.2f}"
        lines.append(f"| `{row['folder']}` | `{row['method']}` | {row['images']} | {fid} | {_interval(row['clip'])} | "
                     f"{_interval(row['accuracy'], 3)} |")
    return "\n".join(lines) + "\n"


def run_eval(args: argparse.Namespace) -> int:
    if args.table:
        if args.generate_args:
            raise RelaxspecError("--table reads finished eval folders: give no generate options after '--'")
        text = markdown_table(table_rows(args.table))
        write_atomic(Path(args.table[0]).parent / TABLE_FILE, lambda temp: temp.write_text(text))
        print(text, end="")
        return 0
    if args.images_per_class < 1:
        raise RelaxspecError(f"--images-per-class must be >= 1, got {args.images_per_class}")
    if (args.classifier is None) != (args.real_data is None):
        raise RelaxspecError("offline scores need both --classifier and --real-data")
    # Every score's inputs and packages are checked now, not after the images are generated.
    if args.fid_ref:
        require("clean-fid", "--fid-ref")
        if not Path(args.fid_ref).is_dir():
            raise RelaxspecError(f"--fid-ref {args.fid_ref}: no such folder")
    if args.classifier is not None:
        if not Path(args.classifier).is_dir():
            raise RelaxspecError(f"--classifier {args.classifier}: no such folder")
        if not Path(args.real_data).is_file():
            raise RelaxspecError(f"--real-data {args.real_data}: no such file")
    if args.eval_res is not None and not 16 <= args.eval_res <= 4096:
        raise RelaxspecError(f"--eval-res must be 16..4096 pixels, got {args.eval_res}")
    if args.clip_path is not None:
        from relaxspec.evaluation.clip import check_clip_folder

        require("transformers", "--clip-path")
        check_clip_folder(args.clip_path)
    gen = parse_generate_args(args.generate_args)
    require_extras(gen)
    eval_prompts(args, gen)
    if args.clip_path is not None and not (gen.prompt or gen.prompts_file):
        raise RelaxspecError("--clip-path scores each image against its prompt: this run has none (class-conditional, "
                             "or --caption-features, which hold no text); give --prompt / --prompts-file")
    if gen.upscale != 1:
        raise RelaxspecError("--upscale has no place in relaxspec eval: the scores must see the images as generated")
    out = Path(gen.out)
    progress = not gen.no_progress
    rank, world, local = distributed()
    device = f"cuda:{local}" if world > 1 and gen.device == "cuda" else gen.device
    wants_scores = bool(args.fid_ref or args.classifier or args.clip_path)
    if not args.scores_only:
        others = {int(SHARD.search(p.name).group(2)) for p in shard_folders(out)} - {world} if out.is_dir() else set()
        if others:
            raise RelaxspecError(f"--out {out} holds shards of {min(others)} processes, this run has {world}; "
                                 "use one folder per sharding")
        folder = generate_shard(args, gen, rank, world, local)
        print(f"rank {rank}/{world}: shard {folder} done", file=sys.stderr)
        if not wants_scores:
            return 0
        if not shards_complete(out):
            print(f"rank {rank}/{world}: other shards are still running; the last to finish scores them "
                  f"(or run again with --scores-only)", file=sys.stderr)
            return 0
    elif not wants_scores:
        raise RelaxspecError("--scores-only needs --fid-ref, --clip-path and/or --classifier with --real-data")
    scores = score(args, out, device, progress)
    parts = [f"{scores['images']} images"]
    if "fid" in scores:
        parts.append(f"FID {scores['fid']['value']:.2f} (clean-fid, {args.fid_mode})")
    if "offline" in scores:
        offline = scores["offline"]
        fid_like = "–" if offline["fid_like"] is None else f"{offline['fid_like'][0]:.3f}"
        parts.append(f"class accuracy {offline['class_accuracy'][0]:.3f}, FID-like {fid_like} "
                     f"(our classifier; not comparable to FID)")
    if "clip" in scores:
        clip = scores["clip"]
        digits = 4 if clip.get("definition") == "lantern" else 2  # a raw cosine, or a score out of 100
        parts.append(f"CLIP score ({clip.get('definition')}) {clip['value']:.{digits}f} [{clip['lo']:.{digits}f}, "
                     f"{clip['hi']:.{digits}f}]")
    print(f"{out / SCORES_FILE}: " + "; ".join(parts))
    return 0


__all__ = ["add_eval_parser", "clean_fid", "eval_prompts", "generated_records", "markdown_table", "run_eval",
           "table_rows"]
