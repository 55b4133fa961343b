"""What the commands share: option helpers over config dataclasses, integer lists, class lists,
model specs, the device option and upstream LlamaGen's sampling defaults."""

from __future__ import annotations

import argparse

import torch

from relaxspec.devices import resolve_device
from relaxspec.errors import RelaxspecError
from relaxspec import extras
from relaxspec.files import read_prompts_file
from relaxspec.models.weights import PRECISIONS
from relaxspec.pipelines.families import all_families, opening_inputs, takers_text
from relaxspec.pipelines.open import choose_family
from relaxspec.pipelines import open_pipeline
from relaxspec.threads import DEFAULT_HELP


class UsageError(Exception):
    """A command-line parsing error (argparse's message, printed on one line)."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake raises :class:`UsageError` instead of exiting, so ``main``
    prints every user error the same way (one line, exit 2)."""

    def error(self, message: str):  # noqa: D401 - argparse hook
        raise UsageError(f"{message} (see '{self.prog} --help')")


def add_model_options(group, *, drafter_help: str | None) -> None:
    """The model flags every command that opens a model shares, declared once: ``--model-path``,
    each family's opening inputs (LlamaGen's ``--gpt-ckpt``, ``--vq-ckpt``, ...), the drafter
    (``drafter_help``; ``None``: the command declares it elsewhere), image size, precision and
    device."""
    add_model_path(group)
    add_family_inputs(group)
    if drafter_help is not None:
        group.add_argument("--drafter-ckpt", metavar="PATH", help=drafter_help)
    group.add_argument("--image-size", type=int, help="pixels per side; fixes the token grid (default: the model's "
                                                      "own; official LlamaGen files 256; Emu3: the image area its "
                                                      "processor asks for)")
    group.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32", help="target weights dtype (default fp32)")
    group.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")


def add_model_path(group) -> None:
    """``--model-path``: a transformers folder of any registered family."""
    names = ", ".join(dict.fromkeys(f.family for f in all_families() if f.opened_with == "--model-path"))
    group.add_argument("--model-path", metavar="DIR", help=f"a model folder: a transformers folder (save_pretrained "
                                                           f"layout, safetensors) of a supported family: {names}; or a "
                                                           "LlamaGen model folder (relaxspec's, official LANTERN's) "
                                                           "with its family's inputs")


def add_family_inputs(group, option=None) -> None:
    """One flag per opening input a model family declares (``--t5-path``, ``--tokenizer-path``,
    ``--negative-prompt``, a plugin family's), its help naming the families that take it.
    ``option``: an :class:`Options` to add them through (a recipe's config defaults)."""
    for declared, takers in opening_inputs().values():
        text = f"{takers_text(takers)}: {declared.help}"
        kind = {"type": int} if declared.kind == "int" else {}
        if option is not None:
            option(declared.flag, text, metavar=declared.metavar, **kind)
        else:
            group.add_argument(declared.flag, metavar=declared.metavar, help=text, **kind)


def family_inputs(args: argparse.Namespace) -> dict:
    """The family opening inputs the command line gives (name -> value)."""
    return {name: getattr(args, name) for name in opening_inputs() if getattr(args, name, None) is not None}


def device_option(name: str) -> torch.device:
    """``--device NAME`` as a device (refused with one line when torch cannot use it here)."""
    return resolve_device(name, "--device")


def require_extras(args: argparse.Namespace) -> None:
    """The optional packages the given model flags need (``--model-path`` transformers, each
    family input what it declares), checked before a command does any work (``main`` calls it for
    every command)."""
    if getattr(args, "model_path", None) is not None:
        extras.require("transformers", "--model-path")
    for name, (declared, _) in opening_inputs().items():
        if declared.needs is not None and getattr(args, name, None) is not None:
            extras.require(declared.needs, declared.flag)


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: integers separated by commas or spaces, e.g. ``1,2,2``."""
    try:
        return tuple(int(part) for part in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,2, got {text!r}") from None


def model_family(args: argparse.Namespace):
    """The family the model flags name (``None``: the embedded model), their inputs checked
    against it before any weights load (:func:`relaxspec.pipelines.open.choose_family`)."""
    return choose_family(getattr(args, "model_path", None), family_inputs(args))


def open_from_args(args: argparse.Namespace, *, prompts: list[str] | None = None, prompt_length: int | None = None,
                   with_drafter: bool = True, with_tokenizer: bool = True):
    """The pipeline the model flags name (:func:`relaxspec.pipelines.open_pipeline`): the one way
    every command opens a model."""
    return open_pipeline(getattr(args, "model_path", None), drafter_ckpt=args.drafter_ckpt, device=args.device,
                         precision=args.precision, image_size=args.image_size, prompts=prompts,
                         prompt_length=prompt_length, with_drafter=with_drafter, with_tokenizer=with_tokenizer,
                         **family_inputs(args))


def read_prompts(args: argparse.Namespace) -> list[str]:
    """``--prompt`` values, then the lines of ``--prompts-file`` (blank lines skipped)."""
    prompts = list(getattr(args, "prompt", None) or [])
    if getattr(args, "prompts_file", None):
        prompts += read_prompts_file(args.prompts_file)
        if not prompts:
            raise RelaxspecError(f"--prompts-file {args.prompts_file}: no prompts in the file")
    if prompts and (getattr(args, "caption_features", None) or getattr(args, "caption_mask", None)):
        raise RelaxspecError("give prompts or --caption-features, not both")
    return prompts


def config_from_args(args: argparse.Namespace, config_cls, read_saved) -> tuple[object, bool]:
    """The config the command line asks for: the given options over the defaults or, with
    ``--resume``, over the saved run's config (``read_saved(out) -> state dict``; a dict field
    given, entry by entry)."""
    given = {k: v for k, v in vars(args).items() if k in config_cls.__dataclass_fields__}
    resume = bool(getattr(args, "resume", False))
    base = dict(read_saved(given.get("out", config_cls.out))["config"]) if resume else {}
    merged = {**base, **given}
    for key in set(base) & set(given):  # a dict field (a family's inputs): the given entries over the saved
        if isinstance(base[key], dict) and isinstance(given[key], dict):
            merged[key] = {**base[key], **given[key]}
    return config_cls.from_dict(merged), resume


def add_run_options(parser: argparse.ArgumentParser, defaults, *, unit: str, seed_help: str,
                    cosine: bool = True, extra=None) -> None:
    """The options every recipe shares (optimiser, seed, precision, device, threads, intervals,
    resume, progress); each overrides the ``defaults`` dataclass field of the same name.
    ``extra(option)`` adds recipe-specific ones after the evaluation interval."""
    option = Options(parser, defaults)
    option.section("training")

    option("--steps", "optimizer steps (the cosine's length)" if cosine else "optimizer steps", type=int)
    option("--batch-size", f"{unit} per step", type=int)
    option("--lr", "peak AdamW learning rate", type=float)
    option("--min-lr", "learning rate at the end of the cosine", type=float)
    option("--weight-decay", "AdamW weight decay" + (" (matrices only)" if cosine else ""), type=float)
    option("--warmup-steps", "linear learning-rate warm-up", type=int)
    option("--grad-clip", "gradient-norm clip (0 = off)", type=float)
    option("--seed", seed_help, type=int)
    option.group.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in fp32 (default: bf16 autocast)")
    option("--device", "cpu, cuda, cuda:1, or auto")
    option("--threads", f"torch CPU threads ({DEFAULT_HELP})", type=int)
    option("--eval-interval", "steps between evaluations", type=int)
    if extra is not None:
        extra(option)
    option("--checkpoint-interval", "steps between checkpoints", type=int)
    parser.add_argument("--resume", action="store_true", default=False, help="continue the run saved in --out")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


class Options:
    """Adds ``--flag`` options whose help shows the config dataclass's default; ``section(title)``
    starts an argument group. One definition for every recipe's parser."""

    def __init__(self, parser: argparse.ArgumentParser, defaults) -> None:
        self.parser, self.defaults, self.group = parser, defaults, parser

    def section(self, title: str) -> None:
        self.group = self.parser.add_argument_group(title)

    def __call__(self, flag: str, help: str, **kwargs) -> None:
        name = kwargs.get("dest", flag.lstrip("-").replace("-", "_"))
        default = getattr(self.defaults, name, None)
        if isinstance(default, tuple):
            default = ",".join(str(v) for v in default)
        shown = default is not None and default is not False and default != []
        self.group.add_argument(flag, help=f"{help} (default: {default})" if shown else help, **kwargs)
