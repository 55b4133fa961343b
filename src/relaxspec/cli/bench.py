"""``relaxspec bench``: every decoding method on the same images, then the tables and plots.

The measuring and reporting are library code (:mod:`relaxspec.bench`); this module is the
command: options, models and checks. The handler :func:`run_bench_cli` returns the exit code;
user errors raise :class:`RelaxspecError`, which ``relaxspec.cli.main`` prints on one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from relaxspec.bench.config import BASELINE, DEFAULT_METHODS, expand_methods, parse_methods, MethodSpec, check_spec
from relaxspec.cli.options import add_model_options, model_family, open_from_args, read_prompts
from relaxspec.runs.shards import distributed, shard_dir, shard_folders, shard_range
from relaxspec.conditions import class_ids
from relaxspec.errors import RelaxspecError, shown
from relaxspec import extras, embedded, methods
from relaxspec.inputs import check_at_least, check_image_count, check_seed, check_threads
from relaxspec.bench.report import load_real_images, write_report, SUMMARY_MD, markdown_table
from relaxspec.files import file_identity
from relaxspec.devices import machine_identity, machine_kind
from relaxspec.pipelines.presets import read_preset, with_preset
from relaxspec.bench.run import merge_shards, run_bench


#: Where a benchmark of the embedded model goes when no --out is given.
EMBEDDED_OUT = "bench-embedded"


def embedded_bench_defaults(family) -> tuple[dict, dict]:
    """The embedded model's own presets and benchmark settings (``defaults.json``: which methods a
    plain ``relaxspec bench`` runs, on how many images) when no model is named; empty for a user's
    model (``family``: the one the model flags name, ``None`` for the embedded model)."""
    if family is not None:
        return {}, {}

    defaults = embedded.defaults()
    return defaults.get("presets", {}), defaults.get("bench", {})


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmark decoding methods (speed, certificate, quality)", description=(
        "Run the chosen decoding methods on the same classes and seeds in one process, alternating methods image by "
        "image, and report per method MAL, target forwards, time split (target / drafter / engine, with --profile), latency (median, IQR), pairwise speed-up "
        "vs AR, the certified TV bound and, with --classifier and --real-data, class accuracy, the FID-like "
        "distance and precision/recall with bootstrap intervals. Writes records.jsonl (resumable: run the same "
        "command again to continue), summary.json/.csv/.md, plot_data.json and, with matplotlib, pareto.png, "
        "mal_hist.png and accept_heatmap.png into --out."))
    bench.set_defaults(handler=run_bench_cli)
    models = bench.add_argument_group("models (default: the embedded emoji model, its drafter and its sampling defaults)")
    add_model_options(models, drafter_help="EAGLE drafter folder (methods that draft with it)")

    images = bench.add_argument_group("images")
    images.add_argument("--classes", metavar="IDS", help="comma-separated class ids (default: all of the model's classes)")
    images.add_argument("--prompt", action="append", metavar="TEXT",
                        help="t2i (--model-path, or a LlamaGen t2i --gpt-ckpt with --t5-path): a prompt, repeatable")
    images.add_argument("--prompts-file", metavar="FILE", help="t2i: prompts, one per line (blank lines skipped); a .json file: "
                        "MS-COCO captions (first per image) or a JSON list of captions")
    count = images.add_mutually_exclusive_group()
    count.add_argument("--images-per-class", type=int, metavar="N", help="images per class (default 1)")
    count.add_argument("--num-images", type=int, metavar="N", help="images in all, cycling through --classes (or the "
                                                                   "prompts; default one per prompt)")
    images.add_argument("--seed", type=int, default=0,
                        help="image i (batch i with --batch-size) is seeded seed * 1000003 + i, as relaxspec generate")

    methods = bench.add_argument_group("methods")
    methods.add_argument("--methods", metavar="LIST", help=(
        "comma-separated method or preset names (default: the embedded model's benchmark list, its tuned presets; "
        f"for other models {','.join(DEFAULT_METHODS)}); {BASELINE} is "
        "always added as the speed-up baseline; a name means what generate --method NAME means on the same model; "
        "--list-methods describes them"))
    methods.add_argument("--sweep", action="append", default=[], metavar="NAME:FIELD=V1,V2,...", help=(
        "run NAME once per value instead of once with its default, e.g. lantern:delta=0.05,0.1,0.2,0.4, "
        "lantern++:lam=2,5,10, cool:cool_delta=1.1,2,4 (repeatable; sweeps of one name multiply)"))
    methods.add_argument("--preset", metavar="TUNE_JSON", help=(
        "a preset file from relaxspec tune: benchmarked as the method 'tuned' beside --methods (default with a "
        "preset: ar and tuned only), under the sampling it was tuned with"))
    methods.add_argument("--list-methods", action="store_true", help="describe the named methods and exit")

    sampling = bench.add_argument_group("sampling (upstream order: CFG, temperature, top-k, top-p)")
    sampling.add_argument("--cfg-scale", type=float, help="classifier-free guidance (default 4.0; 1 = off)")
    sampling.add_argument("--temperature", type=float, help="0 = greedy (default 1.0)")
    sampling.add_argument("--top-k", type=int, help="0 = off (default: upstream's 2000; the embedded model's own "
                                                     "default, 0, when no --gpt-ckpt is given)")
    sampling.add_argument("--top-p", type=float, help="in (0, 1] (default 1.0 = off)")

    timing = bench.add_argument_group("timing")
    timing.add_argument("--threads", type=int, default=1, help="torch CPU threads, pinned for the run (default 1: timings on one "
                        "thread are steady on a busy machine and compare across runs)")
    timing.add_argument("--warmup", type=int, default=1, help="unrecorded decodes per method first (default 1)")
    timing.add_argument("--compile", action="store_true",
                        help="every method but the eager baseline ar compiled (unless a --sweep sets its compile "
                             "field; add ar-compiled to --methods for the compiled AR baseline); keep --warmup >= 1 "
                             "so compilation stays out of the timings")
    timing.add_argument("--profile", action="store_true",
                        help="time every method's target and drafter forwards apart from the engine (the target / "
                             "drafter / engine shares of the report): each forward then runs as its own graph, so "
                             "compiled steps are slower than without it; for finding where the time goes")
    timing.add_argument("--batch-size", type=int, default=1,
                        help="images per decode (default 1: latency; 8: throughput mode)")

    quality = bench.add_argument_group("quality (optional)")
    quality.add_argument("--classifier", metavar="DIR", help="classifier folder (relaxspec train-classifier): "
                                                            "its features give the FID-like distance and precision/recall")
    quality.add_argument("--real-data", metavar="NPZ", help="held-out real images: .npz with images (uint8 [n, H, W, 3]) "
                                                           "and labels")
    quality.add_argument("--n-boot", type=int, default=200, help="bootstrap resamplings per interval (default 200)")

    output = bench.add_argument_group("output")
    output.add_argument("--out", metavar="DIR", help=f"output folder (default {EMBEDDED_OUT} for the embedded model; "
                                                     "required with --gpt-ckpt)")
    output.add_argument("--overwrite", action="store_true", help="replace a benchmark with other settings in --out")
    output.add_argument("--report-only", action="store_true",
                        help="decode nothing: rebuild the summaries and plots of --out (e.g. to add quality)")
    output.add_argument("--baseline", metavar="LABEL",
                        help=f"the method speed-ups are measured against (default {BASELINE}; e.g. ar-compiled)")
    output.add_argument("--no-plots", action="store_true", help="write plot_data.json but no PNG plots")
    output.add_argument("--no-progress", action="store_true", help="no progress bars")
    return bench


def list_methods(model_presets: dict | None = None) -> str:
    lines = [f"{name:12s} {preset.description}" for name, (_, preset) in methods.presets().items()]
    lines.append("aliases: " + ", ".join(f"{a} = {n}" for a, n in methods.registry.spellings().items()))
    for name, fields in (model_presets or {}).items():
        lines.append(f"this model's {name}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))
    return "\n".join(lines)


#: The label a --preset's setting is benchmarked under.
TUNED = "tuned"


def preset_spec(preset: dict):
    """The bench method a preset file stands for: its method with its settings as the model's
    preset of that name, labelled :data:`TUNED`."""
    fields = dict(preset["method"])
    name = fields.pop("method")
    spec = MethodSpec(label=TUNED, options={"method": name}, family=TUNED, preset=fields,
                      description=f"the preset {preset['path']}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))
    check_spec(spec)
    return spec


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise RelaxspecError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_quality_inputs(classifier, real_data: str, classes: list[int], num_classes: int) -> None:
    """The classifier covers the model's classes and ``real_data`` is a readable image set with
    images of the benchmarked classes (:func:`relaxspec.bench.report.load_real_images`)."""
    if classifier.config.num_classes < num_classes:
        raise RelaxspecError(f"--classifier knows {classifier.config.num_classes} classes but the model has "
                             f"{num_classes}: it is not this model's classifier")
    load_real_images(real_data, classes)


def run_bench_cli(args: argparse.Namespace) -> int:
    family = model_family(args)  # the model flags checked once, before any weights load
    if args.list_methods:
        print(list_methods(embedded_bench_defaults(family)[0]))
        return 0
    model_presets, bench_defaults = embedded_bench_defaults(family)
    if not args.no_plots and not extras.available("matplotlib"):
        raise RelaxspecError("relaxspec bench draws its plots with matplotlib, which is not installed: "
                             f"{extras.EXTRAS['matplotlib'].install}, or pass --no-plots")
    if not args.out:
        if family is not None:
            raise RelaxspecError("--out DIR is required")
        args.out = EMBEDDED_OUT
    prompted = bool(args.prompt or args.prompts_file)
    if prompted and args.classes is not None:
        raise RelaxspecError("give --classes or prompts, not both")
    if prompted and args.images_per_class is not None:
        raise RelaxspecError("--images-per-class goes with --classes; with prompts give --num-images")
    if prompted and args.classifier is not None:
        raise RelaxspecError("--classifier scores class-conditional images; a prompt bench reports speed and the TV "
                             "certificate (score prompt images with relaxspec eval --fid-ref)")
    if args.num_images is None and args.images_per_class is None and args.classes is None:
        args.num_images = bench_defaults.get("num_images")
    _positive(args, "images_per_class", "num_images", "batch_size", "image_size", "n_boot")
    if args.num_images is not None:
        check_image_count(args.num_images, f"--num-images {args.num_images}")
    check_threads(args.threads)
    check_at_least("warm-up", args.warmup, 0)
    check_seed(args.seed)
    if (args.classifier is None) != (args.real_data is None):
        raise RelaxspecError("quality needs both --classifier and --real-data")
    progress = not args.no_progress
    classifier = None
    if args.classifier is not None:
        if not Path(args.real_data).is_file():
            raise RelaxspecError(f"--real-data {args.real_data}: no such file")
        try:
            from relaxspec.evaluation.classifier import load_classifier  # the optional evaluation extra
        except ImportError as err:
            raise RelaxspecError(f"--classifier needs relaxspec.evaluation, which is not importable ({err})") from None
        classifier = load_classifier(args.classifier)

    rank, world, local = distributed()
    if args.report_only:
        if world == 1 and shard_folders(Path(args.out)):  # a sharded bench's report, its shards merged first
            if not merge_shards(args.out, overwrite=args.overwrite):
                raise RelaxspecError(f"{args.out}: its shards are not all finished; run the sharded bench again")
        vq = None
        if classifier is not None:
            vq = open_from_args(args, with_drafter=False).tokenizer

            load_real_images(args.real_data)  # checked before any image is decoded
        return _report(write_report, args.out, vq, classifier, args, progress)

    preset = None
    if args.preset is not None:
        preset = read_preset(args.preset)
        if args.methods is None:
            args.methods = BASELINE
    specs = expand_methods(parse_methods(args.methods, bench_defaults.get("methods")), args.sweep, model_presets)
    if preset is not None:
        specs.append(preset_spec(preset))
    if args.baseline is not None and args.baseline not in [spec.label for spec in specs]:
        raise RelaxspecError(f"--baseline {shown(args.baseline)} is not one of the benchmarked methods "
                             f"({', '.join(spec.label for spec in specs)}): add it to --methods")
    if args.compile:
        for spec in specs:
            if spec.label != BASELINE:
                spec.options.setdefault("compile", True)
    if args.profile:
        for spec in specs:
            spec.options.setdefault("profile", True)
    drafting = [s.label for s in specs if s.needs_drafter]
    embedded = family is None
    if drafting and args.drafter_ckpt is None and not embedded:
        raise RelaxspecError(f"{', '.join(drafting)} draft with an EAGLE drafter: give --drafter-ckpt (train one with "
                             "relaxspec train-drafter), or choose drafter-free --methods such as ar,sjd,scd")
    torch.set_num_threads(args.threads)
    if world > 1 and args.device == "cuda":
        args.device = f"cuda:{local}"
    prompts = _prompts(args) if prompted else []
    drafter_ckpt, args.drafter_ckpt = args.drafter_ckpt, args.drafter_ckpt if drafting else None
    pipeline = open_from_args(args, prompts=prompts or None, with_drafter=bool(drafting))
    args.drafter_ckpt = drafter_ckpt
    if preset is not None:
        pipeline = with_preset(pipeline, preset)
    if drafting and pipeline.drafter is None:
        raise RelaxspecError(f"{', '.join(drafting)} draft with an EAGLE drafter and this model has none: give "
                             "--drafter-ckpt, or choose drafter-free --methods such as ar,sjd,scd")
    sampling = pipeline.sampling(cfg_scale=args.cfg_scale, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p)
    images = bench_images(args, pipeline, prompts, classifier)
    identity = {**pipeline.identity, "image_size": pipeline.image_size,
                "files": {key: file_identity(path) for key, path in pipeline.files.items()},
                "drafter_ckpt": None if not drafting else str(Path(pipeline.drafter_path).resolve()),
                "precision": args.precision, "device": str(pipeline.device), "torch": torch.__version__}
    if pipeline.takes == "prompts":
        identity.update({k: v for k, v in images.settings.items() if k != "prompts"})
    if drafting:
        identity["files"]["drafter_ckpt"] = file_identity(pipeline.drafter_path)
    decodes = -(-len(images) // args.batch_size) * len(specs)
    print(f"bench: {len(images)} images x {len(specs)} methods ({', '.join(s.label for s in specs)}) = {decodes} "
          f"decodes at batch size {args.batch_size}, {args.threads} thread(s) -> {args.out}", file=sys.stderr)
    run = dict(seed=args.seed, threads=args.threads, warmup=args.warmup, batch_size=args.batch_size,
               progress=progress, identity=identity, overwrite=args.overwrite)
    if world == 1:
        run_bench(pipeline, images, specs, sampling, args.out, **run)
    else:  # this rank's slice of the batches, timed here; the last rank to finish merges and reports
        folder = shard_dir(Path(args.out), rank, world)
        part = shard_range(-(-len(images) // args.batch_size), rank, world)
        run_bench(pipeline, images, specs, sampling, folder, part=part,
                  timed_by={"rank": rank, "device": machine_kind(machine_identity(pipeline.device))}, **run)
        if not merge_shards(args.out, world, args.overwrite):
            print(f"rank {rank}/{world}: batches {part.start}-{part.stop - 1} done in {folder}; the rank that finishes "
                  "last merges the shards and writes the report", file=sys.stderr)
            return 0
    return _report(write_report, args.out, pipeline.tokenizer, classifier, args, progress)


def _prompts(args: argparse.Namespace) -> list[str]:
    """The bench's prompts (generate's reading of --prompt / --prompts-file), cycled to --num-images."""
    args.caption_features = args.caption_mask = None
    prompts = read_prompts(args)
    total = args.num_images if args.num_images is not None else len(prompts)
    return [prompts[i % len(prompts)] for i in range(total)]


def bench_images(args: argparse.Namespace, pipeline, prompts: list[str], classifier):
    """Image ``i``'s condition: the class list cycled (so an interrupted run covers every class),
    or the prompts; every input checked before anything is decoded."""
    
    if pipeline.takes == "prompts":
        if not prompts:
            raise RelaxspecError(f"this is a text-to-image model ({pipeline.family}): give --prompt / --prompts-file")
        return pipeline.conditions(prompts=prompts)
    if prompts:
        raise RelaxspecError("this is a class-conditional (c2i) model: give --classes, not prompts")
    num_classes = pipeline.target.config.num_classes
    classes = class_ids(args.classes, num_classes, pipeline.class_names) if args.classes is not None \
        else list(range(num_classes))
    total = args.num_images
    if total is None:
        total = check_image_count((args.images_per_class or 1) * len(classes),
                                  f"--images-per-class {args.images_per_class or 1} x {len(classes)} classes")
    classes = [classes[i % len(classes)] for i in range(total)]
    if classifier is not None:  # every quality input checked now, not after an hour of decoding
        check_quality_inputs(classifier, args.real_data, classes, num_classes)
    return pipeline.conditions(classes=classes)


def _report(write_report, out: str, vq, classifier, args: argparse.Namespace, progress: bool) -> int:
    result = write_report(out, vq=vq, classifier=classifier, real_data=args.real_data, n_boot=args.n_boot,
                          plots=not args.no_plots, progress=progress, baseline=args.baseline)
    print(markdown_table(result["rows"], result["baseline"]), end="")
    for note in result["notes"]:
        print(f"note: {note}")
    print(f"wrote {', '.join(p.name for p in result['files'])} in {out} (table: {Path(out) / SUMMARY_MD})")
    print(result["verdict"])
    return 0


__all__ = ["add_bench_parser", "run_bench_cli"]
