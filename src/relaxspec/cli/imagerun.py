"""What ``relaxspec generate`` and ``relaxspec eval`` share: an image run's options, and from them
the pipeline, its conditions, the method, the sampling and the run's settings
(:mod:`relaxspec.runs.images` writes the run)."""

from __future__ import annotations

import argparse
from pathlib import Path

from relaxspec import methods
from relaxspec.cli.options import add_model_options, device_option, family_inputs, model_family, open_from_args, read_prompts
from relaxspec.conditions import Condition
from relaxspec.errors import RelaxspecError
from relaxspec.files import load_caption_features
from relaxspec.inputs import check_at_least, check_seed, check_upscale
from relaxspec.runs.images import image_settings
from relaxspec.runs.shards import local_processes
from relaxspec.pipelines.presets import read_preset, with_preset
from relaxspec.threads import DEFAULT_HELP, set_threads
from relaxspec.pipelines.families import opening_inputs
from relaxspec import embedded as shipped


def add_image_run_options(parser: argparse.ArgumentParser) -> None:
    """generate's options (models, conditions, sampling, method, output)."""
    models = parser.add_argument_group("models (default: the embedded emoji model, with its tokenizer and drafter)")
    add_model_options(models, drafter_help=None)
    models.add_argument("--threads", type=int, help=f"CPU threads for torch ({DEFAULT_HELP}; a preset's own "
                                                    "threads when --preset is given)")

    cond = parser.add_argument_group("conditions")
    cond.add_argument("--classes", metavar="IDS|NAMES",
                      help="comma-separated class ids for a c2i model, or class names when the model names its "
                           "classes (the embedded model: e.g. animal-mammal,food-fruit) (default: the model's demo "
                           "classes: upstream LlamaGen's demo list for an ImageNet model, the embedded model's own)")
    cond.add_argument("--caption-features", metavar="PATH",
                      help="t2i: .npy of caption features [N, tokens, dim] (T5, left-padded), or .npz with "
                           "'features' and optional 'mask'")
    cond.add_argument("--caption-mask", metavar="PATH", help="t2i: .npy [N, tokens] of 1 (real token) / 0 (padding)")
    cond.add_argument("--prompt", action="append", metavar="TEXT",
                      help="t2i: a text prompt (repeatable), encoded with --t5-path as upstream LlamaGen does")
    cond.add_argument("--prompts-file", metavar="FILE", help="t2i: text prompts, one per line (blank lines skipped); a .json "
                      "file: MS-COCO captions (first per image) or a JSON list of captions")

    sampling = parser.add_argument_group("sampling (upstream order: CFG, temperature, top-k, top-p)")
    sampling.add_argument("--cfg-scale", type=float, help="classifier-free guidance (default 4.0, upstream's demo; "
                                                          "the embedded model's own default with it; 1 = off)")
    sampling.add_argument("--temperature", type=float, help="0 = greedy (default 1.0)")
    sampling.add_argument("--top-k", type=int, help="0 = off (default 2000, upstream's demo; embedded: its own)")
    sampling.add_argument("--top-p", type=float, help="in (0, 1] (default 1.0 = off)")
    sampling.add_argument("--seed", type=int, default=0,
                          help="batch b samples with a generator seeded seed * 1000003 + b (default 0)")

    method = parser.add_argument_group("decoding method (each flag is a setting of the methods in relaxspec.methods; a "
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

    output = parser.add_argument_group("output")
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
    """The images' conditions from --classes, prompts or --caption-features, for ``pipeline``
    (what it takes, and what to give otherwise, is the family's)."""
    features = getattr(args, "caption_features", None) or getattr(args, "caption_mask", None)
    if pipeline.takes == "classes":
        if features:
            raise RelaxspecError("this is a class-conditional (c2i) model: give --classes, not --caption-features")
        if prompts:
            raise RelaxspecError("this is a class-conditional (c2i) model: give --classes, not prompts")
        return pipeline.conditions(classes=args.classes)
    if args.classes is not None:
        raise RelaxspecError(f"this is a text-to-image model ({pipeline.family}): {pipeline.conditions_hint()}, not "
                             "--classes")
    if prompts:
        return pipeline.conditions(prompts=prompts)
    if getattr(args, "caption_features", None):
        features, mask = load_caption_features(args.caption_features, args.caption_mask)
        return pipeline.feature_condition(features, mask, args.caption_features)
    raise RelaxspecError(f"this is a text-to-image model ({pipeline.family}): {pipeline.conditions_hint()}")


def check_inputs(args: argparse.Namespace) -> tuple[list[str], object]:
    """Everything that can be checked before a model loads (one line each); returns the prompts
    and the method's options."""
    if args.image_size is not None:
        check_at_least("image size", args.image_size, 1)
    check_at_least("batch size", args.batch_size, 1)
    check_at_least("grid max", args.grid_max, 0)
    check_upscale(args.upscale)  # the output side is checked once the model's image size is known
    check_seed(args.seed)
    family = model_family(args)  # the inputs checked against it before any weights load
    embedded = family is None
    preset = preset_option(args)
    if args.threads is None and preset is not None and preset.get("threads"):
        args.threads = int(preset["threads"])  # the threads it was timed with
    args.threads = set_threads(args.threads, device_option(args.device), small=embedded, processes=local_processes())
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise RelaxspecError(f"--out {out}: exists and is not a folder")
    prompts = read_prompts(args)
    if family is not None and family.takes == "prompts" and (args.classes is not None or args.caption_features or not prompts):  # checked before the folder is read
        raise RelaxspecError(f"this {family.family} model takes text prompts: --prompt TEXT or --prompts-file FILE")
    # The method, resolved once, before any weights load: from the preset file, the embedded
    # model's shipped presets (a file too), or the registry (a user's model brings no presets).
    if preset is not None:
        fields = dict(preset["method"])
        options = methods.resolve(fields.pop("method"), given_settings(args), {preset["method"]["method"]: fields})
    elif embedded:
        early = shipped.defaults()
        options = methods.resolve(args.method or early.get("method", {}).get("method", "ar"), given_settings(args),
                                  early.get("presets"))
    else:
        options = methods.resolve(args.method or "ar", given_settings(args))
    return prompts, options


def preset_option(args: argparse.Namespace) -> dict | None:
    """The ``--preset`` file, read and checked (``None`` without one); it names the method, so
    ``--method`` is refused beside it."""
    if getattr(args, "preset", None) is None:
        return None

    if getattr(args, "method", None) is not None:
        raise RelaxspecError("--preset names the method: leave out --method (setting flags still apply over it)")
    return read_preset(args.preset)


def run_settings(args: argparse.Namespace, pipeline, prepared, condition: Condition) -> dict:
    """The run's settings (:func:`relaxspec.runs.images.image_settings`) with the files the options
    named (caption features, prompts file) and what reopens its model."""
    declared = opening_inputs()
    files = {"caption_features": args.caption_features, "caption_mask": args.caption_mask,
             "prompts_file": args.prompts_file,
             # the family's path inputs its pipeline does not list among its files (LlamaGen's t5_path)
             **{name: value for name, value in family_inputs(args).items()
                if declared[name][0].kind == "path" and name not in pipeline.files}}
    settings = image_settings(pipeline, prepared.options, prepared.sampling, condition, seed=args.seed, batch_size=args.batch_size,
                              precision=args.precision, files=files)
    if args.upscale != 1:  # recorded only when used, so runs from before the flag still resume
        settings["upscale"] = args.upscale
    if args.model_path is not None and args.image_size is not None:
        # A folder family reads --image-size its own way (Emu3: the processor's image area), so the
        # flag as given is what reopens this run's model (build-tree --budget auto).
        settings["image_size_given"] = args.image_size
    return settings


def open_run(args: argparse.Namespace, prompts: list[str] | None = None):
    """The pipeline an image run's options name (with its ``--preset``), the options checked
    first (:func:`check_inputs`)."""
    if prompts is None:
        prompts, _ = check_inputs(args)
    pipeline = open_from_args(args, prompts=prompts or None)
    return with_preset(pipeline, args.preset) if args.preset is not None else pipeline


def prepare(args: argparse.Namespace, pipeline=None):
    """``(pipeline, condition, prepared)`` from an image run's options, each checked (the inputs
    before any weights load; the method's sizes once, by
    :meth:`~relaxspec.pipelines.ImagePipeline.prepare`, which builds what it decodes with).
    ``pipeline``: the one :func:`open_run` opened for these options already."""
    prompts, options = check_inputs(args)
    if pipeline is None:
        pipeline = open_run(args, prompts)
    sampling = pipeline.sampling(cfg_scale=args.cfg_scale, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p)
    if args.drafter_ckpt is not None and not options.needs_drafter and args.preset is None:
        raise RelaxspecError(f"--drafter-ckpt is not used by {options.family.where(options)}")
    if options.needs_drafter and pipeline.drafter is None:
        raise RelaxspecError("--drafter-ckpt is required: this method drafts with an EAGLE drafter trained for the "
                             "target (train one with relaxspec train-drafter)")
    prepared = pipeline.prepare(options, sampling)
    condition = command_condition(args, pipeline, prompts)
    check_upscale(args.upscale, pipeline.image_size)
    return pipeline, condition, prepared


__all__ = ["add_image_run_options", "add_setting_flags", "check_inputs", "command_condition", "given_settings",
           "open_run", "prepare", "preset_option", "run_settings"]
