"""``relaxspec tune``: the fastest setting for this model on this machine within a quality budget,
written as a preset file (``tune.json``) that ``generate``, ``bench``, ``demo`` and
``relaxspec.generate`` take with ``--preset`` / ``preset=``. The search is library code
(:mod:`relaxspec.tuning`); this module is the command: options, the model, the class split and
the checks."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np

from relaxspec.cli.options import add_model_options, model_family, open_from_args, read_prompts
from relaxspec.conditions import class_ids
from relaxspec import extras
from relaxspec.errors import RelaxspecError
from relaxspec.inputs import check_at_least, check_seed, check_threads
from relaxspec.runs.folder import hold_folder
from relaxspec.tuning import Budget, TuneConfig, Tuner
from relaxspec.tuning.config import check_minutes
from relaxspec.tuning.report import PRESET_FILE, closest_message, describe_heldout, describe_row, interval_note, write_results
from relaxspec import embedded as shipped
from relaxspec.bench.report import load_real_images
from relaxspec.evaluation.classifier import load_classifier

#: Where tuning the embedded model writes when no --out is given.
EMBEDDED_OUT = "tune-embedded"
#: Without --classes, a class c is held out when c % HELD_OUT_EVERY == 1 (as the shipped drafter
#: was trained without those classes) and tuned on otherwise.
HELD_OUT_EVERY = 4


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    tune = subparsers.add_parser("tune", help="find the fastest setting for this model and machine within a quality "
                                              "budget (writes a preset file)", description=(
        "Search decoding methods and their settings for the fastest one on this machine within a budget: "
        "time the forwards, probe acceptance per acceptance rule, build trees for this machine's costs, then race every "
        "setting against eager AR on the same images with successive halving (the slower half dropped each round), "
        "test the finalists' quality if asked, and measure the winner on held-out classes or prompts. Writes "
        "tune.json (use it with generate / bench / demo --preset), frontier.png, settings.csv and report.md into "
        "--out; run the same command again to continue an interrupted run."))
    tune.set_defaults(handler=cmd_tune)
    budget = tune.add_argument_group("budget (exactly one)").add_mutually_exclusive_group()
    budget.add_argument("--lossless", action="store_true", help="exact methods only (the model's own law)")
    budget.add_argument("--max-tv-per-token", type=float, metavar="X",
                        help="relaxed methods allowed while their mean one-step TV record per token is <= X")
    budget.add_argument("--within-ar-quality", action="store_true", help=(
        "relaxed methods allowed while their paired quality intervals against AR hold 0 (class accuracy and the "
        "FID-like distance of --classifier; the embedded model brings its own classifier)"))
    search = tune.add_argument_group("search")
    search.add_argument("--minutes", type=float, default=10.0, help=(
        "wall-clock budget of the search (default 10, at most 10080: a week). A budget that cannot pay for the least "
        "search (the probe, every setting once against AR, the winner on 5 held-out images) is refused once the "
        "forwards are timed (exit 2, no tune.json); a speed-up from fewer than 5 paired images is reported without an "
        "interval (n/a), with a line saying the minutes that would give one"))
    search.add_argument("--no-compile", action="store_true",
                        help="do not try compiled variants of the finalists (each compilation costs seconds to "
                             "minutes once)")
    search.add_argument("--threads", type=int, default=1, help="torch CPU threads, pinned while timing (default 1: timings on one "
                        "thread are steady on a busy machine and compare across runs; the preset records them)")
    search.add_argument("--batch-size", type=int, default=1, help="images per decode the preset is tuned for "
                                                                 "(default 1: latency)")
    search.add_argument("--seed", type=int, default=0, help="seeds every image of the search (default 0)")

    models = tune.add_argument_group("models (default: the embedded emoji model, its drafter and sampling)")
    add_model_options(models, drafter_help="EAGLE drafter folder (without one, only the "
                                                                  "drafter-free methods are tried)")

    images = tune.add_argument_group("images")
    images.add_argument("--classes", metavar="IDS|NAMES", help="classes to tune on (default: every class c with "
                                                               f"c %% {HELD_OUT_EVERY} != 1)")
    images.add_argument("--heldout-classes", metavar="IDS|NAMES", help="classes the result is measured on, never "
                                                                       "tuned on (default: the others with c %% "
                                                                       f"{HELD_OUT_EVERY} == 1)")
    images.add_argument("--prompt", action="append", metavar="TEXT", help="text-to-image: a prompt (repeatable)")
    images.add_argument("--prompts-file", metavar="FILE", help="text-to-image: prompts, one per line (a .json file: "
                                                               "MS-COCO captions or a JSON list); the 2nd, 4th, ... are "
                                                               "held out")

    sampling = tune.add_argument_group("sampling (default: the model's)")
    sampling.add_argument("--cfg-scale", type=float)
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--top-p", type=float)

    quality = tune.add_argument_group("quality (--within-ar-quality)")
    quality.add_argument("--classifier", metavar="DIR", help="classifier folder (relaxspec train-classifier; default "
                                                            "for the embedded model: its own)")
    quality.add_argument("--real-data", metavar="NPZ", help="held-out real images (.npz: images, labels); without it "
                                                           "the reference is an independent AR sample")
    output = tune.add_argument_group("output")
    output.add_argument("--out", metavar="DIR", help=f"output folder (default {EMBEDDED_OUT} for the embedded model)")
    output.add_argument("--overwrite", action="store_true", help="start afresh in an --out that holds another run")
    output.add_argument("--no-progress", action="store_true", help="no progress lines or bars")
    return tune


def budget_from_args(args: argparse.Namespace):
    if args.lossless:
        return Budget("lossless")
    if args.max_tv_per_token is not None:
        return Budget("tv", args.max_tv_per_token)
    if args.within_ar_quality:
        return Budget("quality")
    raise RelaxspecError("choose a budget: --lossless, --max-tv-per-token X or --within-ar-quality")


NEEDS_PROMPTS = "this model takes text prompts: give --prompts-file FILE (or --prompt, at least two)"
QUALITY_PROMPTS = ("--within-ar-quality scores class-conditional images; for a prompt model use --lossless or "
                   "--max-tv-per-token")


def check_inputs(args: argparse.Namespace):
    """Everything checked before a model loads (one line each); returns the budget and the family
    the model flags name (``None``: the embedded model)."""
    budget = budget_from_args(args)
    check_minutes(args.minutes)
    check_threads(args.threads)
    check_at_least("batch size", args.batch_size, 1)
    family = model_family(args)
    embedded = family is None
    if not args.out:
        if not embedded:
            raise RelaxspecError("--out DIR is required")
        args.out = EMBEDDED_OUT
    note = extras.missing("matplotlib", Path(args.out) / "frontier.png")
    if note:  # said now, not after the search
        print(f"relaxspec: note: {note}; tune.json, report.md and settings.csv are written", file=sys.stderr)
    check_seed(args.seed)
    if (args.classifier is not None or args.real_data is not None) and budget.kind != "quality":
        raise RelaxspecError("--classifier / --real-data go with --within-ar-quality")
    if budget.kind == "quality":
        if family is not None and family.takes == "prompts":
            raise RelaxspecError(QUALITY_PROMPTS)
        if args.classifier is None:
            if not embedded:
                raise RelaxspecError("--within-ar-quality needs --classifier DIR (relaxspec train-classifier) for this "
                                     "model")
            if not shipped.available("classifier"):
                raise RelaxspecError("--within-ar-quality needs --classifier DIR: the embedded classifier is not in "
                                     "this installation")
            args.classifier = str(shipped.path("classifier"))
        if args.real_data is not None and not Path(args.real_data).is_file():
            raise RelaxspecError(f"--real-data {args.real_data}: no such file")
    return budget, family


def split_classes(args: argparse.Namespace, pipeline) -> tuple[list, list]:
    """Tune and held-out conditions: class ids (disjoint) or prompts (the 1st, 3rd, ... tuned on,
    the 2nd, 4th, ... held out; repeated prompts once)."""
    if pipeline.takes == "prompts":
        prompts = list(dict.fromkeys(read_prompts(args)))
        if args.classes is not None or args.heldout_classes is not None:
            raise RelaxspecError(f"this {pipeline.family} model takes prompts: give --prompts-file, not --classes")
        if len(prompts) < 2:
            raise RelaxspecError("tuning a text-to-image model needs at least two different prompts (--prompt / "
                                 "--prompts-file): every second one is held out")
        return prompts[0::2], prompts[1::2]
    if args.prompt or args.prompts_file:
        raise RelaxspecError("this is a class-conditional model: give --classes, not prompts")
    count = pipeline.target.config.num_classes
    if count < 2:
        raise RelaxspecError("this model has one class: tuning needs a held-out class the search never sees")
    names = pipeline.class_names
    every = list(range(count))
    heldout = class_ids(args.heldout_classes, count, names) if args.heldout_classes is not None else None
    if args.classes is not None:
        tune = class_ids(args.classes, count, names)
    elif heldout is not None:
        tune = [c for c in every if c not in heldout]
    else:
        tune = [c for c in every if c % HELD_OUT_EVERY != 1]
    if heldout is None:
        rest = [c for c in every if c not in tune]
        heldout = [c for c in rest if c % HELD_OUT_EVERY == 1] or rest
    overlap = sorted(set(tune) & set(heldout))
    if overlap:
        raise RelaxspecError(f"--classes and --heldout-classes share class {overlap[0]}: the held-out result must "
                             "come from classes the search never saw")
    if not tune or not heldout:
        raise RelaxspecError("tuning needs at least one tune class and one held-out class: give --classes and "
                             "--heldout-classes")
    return list(dict.fromkeys(tune)), list(dict.fromkeys(heldout))


def cmd_tune(args: argparse.Namespace) -> int:
    budget, family = check_inputs(args)
    prompts = read_prompts(args) if (args.prompt or args.prompts_file) else []
    if family is not None and family.takes == "prompts" and not prompts:
        raise RelaxspecError(NEEDS_PROMPTS)
    pipeline = open_from_args(args, prompts=prompts or None)
    if pipeline.takes == "prompts" and not prompts:  # a family whose files say it (a LlamaGen t2i checkpoint)
        raise RelaxspecError(NEEDS_PROMPTS)
    if pipeline.takes == "prompts" and budget.kind == "quality":
        raise RelaxspecError(QUALITY_PROMPTS)
    sampling = pipeline.sampling(cfg_scale=args.cfg_scale, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p)
    tune, heldout = split_classes(args, pipeline)
    classifier = real_images = real_labels = None
    source = None
    if budget.kind == "quality":
        if pipeline.takes != "classes":
            raise RelaxspecError("--within-ar-quality scores class-conditional images; for a prompt model use "
                                 "--lossless or --max-tv-per-token")
        classifier = load_classifier(args.classifier)
        if classifier.config.num_classes < pipeline.target.config.num_classes:
            raise RelaxspecError(f"--classifier knows {classifier.config.num_classes} classes but the model has "
                                 f"{pipeline.target.config.num_classes}: it is not this model's classifier")
        if args.real_data is not None:
            real_images, real_labels = load_real_images(args.real_data)
            for part, classes in (("tune", tune), ("held-out", heldout)):
                if int(np.isin(real_labels, classes).sum()) < 2:
                    raise RelaxspecError(f"--real-data {args.real_data} holds fewer than two images of the {part} "
                                         "classes")
            source = f"classifier {args.classifier}, real images {args.real_data}"
        else:
            source = f"classifier {args.classifier}, reference: an independent AR sample of the same classes"
    config = TuneConfig(budget=budget, minutes=args.minutes, tune=tune, heldout=heldout, seed=args.seed,
                        threads=args.threads, batch_size=args.batch_size, compile=not args.no_compile,
                        classifier=classifier, real_images=real_images, real_labels=real_labels,
                        quality_source=source, progress=not args.no_progress,
                        command=shlex.join(["relaxspec", *sys.argv[1:]]) if sys.argv[1:2] == ["tune"] else "relaxspec tune")
    with hold_folder(args.out, "tune"):  # another run writing the folder is refused (its state would mix)
        tuner = Tuner(pipeline, sampling, args.out, config, overwrite=args.overwrite)
        result = tuner.run()
        written = write_results(Path(args.out), result, tuner)
    print(f"wrote {', '.join(p.name for p in written['files'])} in {args.out}")
    if result["chosen"] is None:
        print(f"relaxspec: {closest_message(budget, result.get('closest'))}", file=sys.stderr)
        return 1
    if not result["heldout"].get("within_budget", True):
        print(f"relaxspec: warning: on the held-out images {result['chosen']['label']} is over the budget "
              f"({budget.describe()}); see {Path(args.out) / 'report.md'}", file=sys.stderr)
    print(f"chosen: {describe_row(result['chosen'])} on the tune images; held out ({result['heldout']['images']} "
          f"images): {describe_heldout(result['heldout'])} eager AR")
    print(f"use it: relaxspec generate --preset {Path(args.out) / PRESET_FILE} ...")
    note = interval_note(result, args.minutes)
    if note is not None:
        print(f"relaxspec: {note}", file=sys.stderr)
    return 0


__all__ = ["add_tune_parser", "cmd_tune"]
