"""``relaxspec train-vq / train-gpt / train-drafter / train-classifier`` and ``relaxspec data``:
every option overrides one field of the recipe's config dataclass (options not given keep its
default or, with ``--resume``, the saved run's value); the recipes themselves are library
functions (:mod:`relaxspec.training`, :mod:`relaxspec.evaluation.classifier`,
:mod:`relaxspec.data.emoji`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from relaxspec.models.weights import PRECISIONS
from relaxspec.cli.options import (
    Options,
    add_family_inputs,
    add_model_path,
    add_run_options,
    config_from_args,
    family_inputs,
    int_list,
)
from relaxspec.data.emoji import INSTALL_COMMAND, PACKAGE, VERSION, build_emoji_dataset, load_data
from relaxspec import extras
from relaxspec.threads import DEFAULT_HELP
from relaxspec.errors import RelaxspecError
from relaxspec.evaluation.classifier import ClassifierTrainConfig, save_classifier, train_classifier
from relaxspec.training.drafter import DrafterTrainConfig, train_drafter, read_train_state as read_drafter_state
from relaxspec.training.llamagen.gpt import GPTTrainConfig, train_gpt, read_train_state as read_gpt_state
from relaxspec.training.llamagen.vq import VQTrainConfig, train_vq, read_train_state as read_vq_state
from relaxspec.runs.shards import distributed
from relaxspec.training.distributed import alike
from relaxspec.pipelines.families import is_folder_family
from relaxspec.pipelines.open import folder_pipeline_class, folder_sampling


def class_ids(text: str) -> list[int]:
    """An argparse type: class ids separated by commas or spaces."""
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"class ids must be integers, got {text!r}") from None


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """``relaxspec data``: build the emoji data set."""
    parser = subparsers.add_parser(
        "data", help="build the emoji training data (offline, from an npm package)",
        description=f"Build the emoji data set from {PACKAGE}@{VERSION} (install it with `{INSTALL_COMMAND}`): "
                    "OUT/train.npz, OUT/val.npz, OUT/classes.json, OUT/SOURCE.md.")
    parser.add_argument("--out", default="data/emoji", metavar="DIR", help="output folder (default: data/emoji)")
    parser.add_argument("--source", metavar="DIR",
                        help="the package folder or a folder holding node_modules/ (default: ./node_modules, "
                             "then `npm root -g`)")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (default: 32)")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of base emoji held out (default: 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (default: 0)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(handler=run_data)
    return parser


def run_data(args: argparse.Namespace) -> int:
    """Entry point of ``relaxspec data``; raises :class:`RelaxspecError` on bad input."""
    summary = build_emoji_dataset(args.out, args.source, size=args.size, val_fraction=args.val_fraction,
                                  seed=args.seed, progress=args.progress)
    print(json.dumps(summary))
    return 0


def add_train_vq_parser(subparsers) -> argparse.ArgumentParser:
    """``relaxspec train-vq``: every option overrides one :class:`VQTrainConfig` field; options not
    given keep the default (or, with ``--resume``, the saved value)."""
    defaults = VQTrainConfig()
    parser = subparsers.add_parser(
        "train-vq", help="train a small LlamaGen VQ tokenizer on the emoji data",
        description="Train a LlamaGen-architecture VQ tokenizer on `relaxspec data` output. Writes "
                    "OUT/model.safetensors + config.json, OUT/train_state.pt and OUT/metrics.jsonl.",
        argument_default=argparse.SUPPRESS)

    option = Options(parser, defaults)

    option("--data", "folder written by `relaxspec data`", metavar="DIR")
    option("--out", "output folder", metavar="DIR")
    option("--export", "also write the final weights here in fp16 (model.safetensors + config.json)", metavar="DIR")
    option.section("model")
    option("--codebook-size", "codes", type=int)
    option("--codebook-embed-dim", "code vector width", type=int)
    option("--z-channels", "encoder output channels", type=int)
    option("--ch", "base channel width", type=int)
    option("--ch-mult", "width multipliers per level, e.g. 1,2,2 (levels - 1 = log2 downsampling)", type=int_list)
    option("--num-res-blocks", "residual blocks per level", type=int)
    option("--norm-groups", "GroupNorm groups", type=int)
    option.section("loss")
    option("--l1-weight", "pixel L1 weight", type=float)
    option("--l2-weight", "pixel L2 weight", type=float)
    option("--codebook-weight", "codebook loss weight", type=float)
    option("--commit-weight", "commitment loss weight (beta)", type=float)
    option("--restart-interval", "steps between dead-code restarts (0 = off)", type=int)
    option("--max-shift", "augmentation: largest translation in px", type=int)
    option.group.add_argument("--no-flip", dest="flip", action="store_false", help="augmentation: no mirror flips")
    add_run_options(parser, defaults, unit="images", seed_help="seed (init, data order, augmentation, restarts)",
                    cosine=False)
    parser.set_defaults(handler=run_train_vq)
    return parser


def run_train_vq(args: argparse.Namespace) -> int:
    """Entry point of ``relaxspec train-vq``; raises :class:`RelaxspecError` on bad input."""
    config, resume = config_from_args(args, VQTrainConfig, read_vq_state)
    result = train_vq(config, resume=resume)
    last = result.history[-1] if result.history else {}
    print(json.dumps({"out": config.out, "step": result.step, "images_per_second": round(result.images_per_second, 2),
                      "train_seconds": round(result.seconds, 1), "val": last.get("val"), "train": last.get("train")}))
    return 0


def add_train_gpt_parser(subparsers) -> argparse.ArgumentParser:
    """``relaxspec train-gpt``: every option overrides one :class:`GPTTrainConfig` field; options not
    given keep the default (or, with ``--resume``, the saved value)."""
    defaults = GPTTrainConfig()
    parser = subparsers.add_parser(
        "train-gpt", help="train a small LlamaGen c2i target on the emoji data",
        description="Train a LlamaGen c2i transformer on VQ tokens of `relaxspec data` output (augmented). "
                    "Writes OUT/best (the best-val weights), OUT/model.safetensors + config.json (the last), "
                    "OUT/train_state.pt, OUT/tokens.npz and OUT/metrics.jsonl.",
        argument_default=argparse.SUPPRESS)

    option = Options(parser, defaults)

    option("--data", "folder written by `relaxspec data`", metavar="DIR")
    option("--vq-ckpt", "the tokenizer (a relaxspec VQ folder, e.g. from `relaxspec train-vq`)", metavar="PATH")
    option("--out", "output folder", metavar="DIR")
    option("--export", "also write the best-val weights here in fp16 (model.safetensors + config.json)", metavar="DIR")
    option.section("model")
    option("--dim", "model width", type=int)
    option("--n-layer", "transformer blocks", type=int)
    option("--n-head", "attention heads (LlamaGen: head dim 64)", type=int)
    option("--init-from", "grow from this trained target (same width, fewer layers): its blocks are spread "
           "over the new depth, the new blocks start as the identity", metavar="PATH")
    option.section("data")
    option("--copies", "tokenised copies per training image (1 = no augmentation)", type=int)
    option("--max-shift", "augmentation: largest translation in px", type=int)
    option.group.add_argument("--no-flip", dest="flip", action="store_false", help="augmentation: no mirror flips")
    option("--class-dropout", "probability of training a sequence under the null class", type=float)
    add_run_options(parser, defaults, unit="sequences", seed_help="seed (init, augmentation, data order, class dropout)",
                    extra=lambda option: option("--patience", "evaluations without a better val NLL before "
                                                "stopping (0 = never)", type=int))
    parser.set_defaults(handler=run_train_gpt)
    return parser


def run_train_gpt(args: argparse.Namespace) -> int:
    """Entry point of ``relaxspec train-gpt``; raises :class:`RelaxspecError` on bad input."""
    config, resume = config_from_args(args, GPTTrainConfig, read_gpt_state)
    result = train_gpt(config, resume=resume)
    print(json.dumps({"out": config.out, "step": result.step, "stopped_early": result.stopped_early,
                      "sequences_per_second": round(result.sequences_per_second, 2),
                      "train_seconds": round(result.seconds, 1), "tokenise_seconds": round(result.tokenise_seconds, 1),
                      "best": result.best}))
    return 0


def add_train_drafter_parser(subparsers) -> argparse.ArgumentParser:
    """``relaxspec train-drafter``: every option overrides one :class:`DrafterTrainConfig` field;
    options not given keep the default (or, with ``--resume``, the saved value)."""
    defaults = DrafterTrainConfig()
    parser = subparsers.add_parser(
        "train-drafter", help="train an EAGLE drafter on a target's features",
        description="Train the EAGLE drafter (REFERENCE §1.6) on a frozen target's features: a LlamaGen "
                    "checkpoint (--gpt-ckpt; a t2i one with --t5-path) or a model folder of any family (--model-path, "
                    "with its family's inputs); text-to-image targets train on their own samples of --prompts-file. "
                    "Every evaluation logs the mean 1 - TV(p, q) per draft depth (exact acceptance) on the held-out "
                    "sequences; --law-loss kl distils the decoding law. Writes OUT/model.safetensors + config.json "
                    "(last), OUT/best/ (best chain MAL) and OUT/train_state.pt (--resume continues).",
        argument_default=argparse.SUPPRESS)

    option = Options(parser, defaults)

    option.section("target (its family's inputs, as every command takes them)")
    add_model_path(option.group)
    add_family_inputs(option.group, option=option)
    option("--image-size", "image resolution of an official checkpoint (Emu3: the image size to paint)", type=int)
    option("--precision", "target weights precision", choices=list(PRECISIONS))
    option.section("data")
    option("--data", "token sequences: .npz (tokens, labels) or .npy [n, N] with labels.npy / stats.json beside "
           "it; repeatable", action="append", metavar="FILE")
    option("--label", "class id for sources without labels", type=int)
    option("--self-samples", "also train on COUNT samples drawn from the target", type=int, metavar="COUNT")
    option("--prompts-file", "a target that takes prompts (--model-path, or a LlamaGen t2i --gpt-ckpt with --t5-path): "
           "the self-samples' prompts, one per line (cycled; a .json file: MS-COCO captions or a JSON list)",
           metavar="FILE")
    option("--classes", "classes of the self-samples, e.g. '1 2 3' or '1,2,3' (default: uniform)", type=class_ids,
           nargs="+", metavar="CLASS")
    option("--cfg-scale", "CFG scale of the self-samples and of the laws measured and distilled (--model-path: "
           "default its own)", type=float)
    option("--temperature", "temperature of the self-samples and the laws (--model-path: default its own)",
           type=float)
    option("--top-k", "top-k of the self-samples and the laws (0 = off; --model-path: default its own)", type=int)
    option("--top-p", "top-p of the self-samples and the laws (1 = off; --model-path: default its own)", type=float)
    option("--images", "folder of images (class sub-folders or --label) to encode with the target's image tokenizer "
           "(LlamaGen: give --vq-ckpt)", metavar="DIR")
    option("--val-fraction", "share of sequences held out to measure draft accuracy", type=float)
    option.section("training")
    option("--out", "output folder", metavar="DIR")
    option("--n-layer", "drafter transformer blocks", type=int)
    option("--init-from", "start from this drafter's weights (a relaxspec drafter folder, e.g. one trained for "
           "a shallower version of the target, or official LANTERN's released drafter folder, whose layout is "
           "kept); a drafter with fewer blocks grows: its blocks carry over and the new ones start as the identity",
           metavar="DIR")
    option("--fused", "an EAGLE-3 drafter: it reads the target's low, middle and high layers' streams fused "
           "(--fused-layers) instead of its final state; no feature loss and no feature noise unless given "
           "(--feature-weight 0 --noise 0)", action="store_true")
    option("--fused-layers", "with --fused: the target layers whose entering streams it reads (default EAGLE-3's "
           "2, L/2, L-3 of L layers)", type=int, nargs="+", metavar="LAYER")
    option("--epochs", "passes over the data", type=float)
    option("--steps", "optimizer steps (overrides --epochs)", type=int)
    option("--batch-size", "sequences per step", type=int)
    option("--lr", "AdamW learning rate", type=float)
    option("--weight-decay", "AdamW weight decay", type=float)
    option("--warmup-steps", "linear learning-rate warm-up", type=int)
    option("--grad-clip", "gradient-norm clip (0 = off)", type=float)
    option("--noise", "uniform feature noise amplitude a: U(-a, a)", type=float)
    option("--feature-weight", "weight of the feature (SmoothL1) term", type=float)
    option("--law-loss", "how the drafter's law is fitted: 'ce' (EAGLE's cross-entropy to each stream's raw law) "
           "or distilled on the decoding law (guided by --cfg-scale, tempered and filtered as decoding does): 'kl' "
           "(forward KL), 'tv', 'kl+tv'", choices=["ce", "kl", "tv", "kl+tv"])
    option("--ce-weight", "weight of the cross-entropy term (--law-loss ce)", type=float)
    option("--distill-weight", "weight of the distillation term (--law-loss kl, tv, kl+tv)", type=float)
    option("--train-depths", "draft depths trained: depth d from the drafter's own d-1 guesses, as decoding drafts",
           type=int)
    option("--depth-decay", "depth d weighs DECAY^(d-1) in the loss, normalised (EAGLE-3: 0.8; 1 = equal)",
           type=float)
    option("--through-depths", "the gradient also flows through the guesses each depth reads (EAGLE-3's "
           "training-time test)", action="store_true")
    option("--eval-depths", "draft depths whose 1 - TV(p, q) each evaluation measures", type=int)
    option("--patience", "evaluations without a better chain MAL before stopping (0 = never stop early)", type=int)
    option("--export", "also write the best weights here in fp16 (model.safetensors + config.json)", metavar="DIR")
    option("--null-fraction", "share of each batch also trained under the null condition", type=float)
    option("--seed", "seed (data order, noise, init, self-samples)", type=int)
    option("--bf16", "bf16 autocast", action="store_true")
    option("--device", "cpu, cuda, cuda:1, or auto")
    option("--threads", f"torch CPU threads ({DEFAULT_HELP}; under torchrun the processes on one machine share "
           "them)", type=int)
    option("--checkpoint-interval", "steps between checkpoints: a Ctrl-C loses at most this many steps, which "
           "--resume redoes (a checkpoint writes the drafter and its optimizer state, cheap next to the steps)",
           type=int)
    option("--eval-interval", "steps between evaluations (step 0 is the untrained baseline; these and the last "
           "step compete for OUT/best)", type=int)
    parser.add_argument("--resume", action="store_true", default=False,
                        help="continue the run saved in --out (also one stopped while drawing its self-samples)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(handler=run_train_drafter)
    return parser


def run_train_drafter(args: argparse.Namespace) -> int:
    """Entry point of ``relaxspec train-drafter``; raises :class:`RelaxspecError` on bad input.
    Under torchrun every process runs it; rank 0 says what they all would (settings) and prints
    the result."""
    rank = distributed()[0]
    with alike(rank):
        config, resume = _drafter_config(args)
    if rank == 0:
        note = extras.missing("matplotlib", f"accept.png in {config.out}")
        if note:  # said now, not at the end of the run
            print(f"relaxspec: note: {note}; metrics.jsonl has the same numbers", file=sys.stderr)
    result = train_drafter(config, resume=resume)
    if rank != 0:
        return 0
    last = result.history[-1] if result.history else {}

    def rounded(value):
        return [round(v, 5) for v in value] if isinstance(value, list) else round(value, 5)

    print(json.dumps({"out": config.out, "step": result.step, "stopped_early": result.stopped_early,
                      "sequences_per_second": round(result.sequences_per_second, 2),
                      **{k: rounded(v) for k, v in last.items() if isinstance(v, (float, list))},
                      "best": {k: rounded(v) if isinstance(v, (float, list)) else v for k, v in result.best.items()}}))
    return 0


def _drafter_config(args: argparse.Namespace) -> tuple[DrafterTrainConfig, bool]:
    """The run's config from the options (and, with --resume, the saved run's)."""
    if "classes" in args:  # each --classes word may itself be a comma list
        args.classes = [c for word in args.classes for c in word]
    if getattr(args, "model_path", None) is not None and not getattr(args, "resume", False):
        defaults = folder_sampling(args.model_path) if is_folder_family(folder_pipeline_class(args.model_path)) else {}
        for key, value in defaults.items():  # self-samples drawn as generate draws them
            if getattr(args, key, None) is None:
                setattr(args, key, value)
    if getattr(args, "fused", False) and not getattr(args, "resume", False):  # EAGLE-3: no feature loss, no noise
        for key in ("feature_weight", "noise"):
            if key not in args:
                setattr(args, key, 0.0)
    given = family_inputs(args)
    if given:  # the config's one field of family inputs (over a resumed run's saved ones)
        args.inputs = given
    config, resume = config_from_args(args, DrafterTrainConfig, read_drafter_state)
    check_law_weight(args, config.law_loss)
    return config, resume


def check_law_weight(args: argparse.Namespace, law_loss: str) -> None:
    """Refuse a loss weight given on the command line that ``law_loss`` never reads (the config's
    defaults, and a resumed run's saved values, are not given)."""
    if "ce_weight" in args and law_loss != "ce":
        raise RelaxspecError(f"--ce-weight goes with --law-loss ce; --law-loss {law_loss} reads --distill-weight")
    if "distill_weight" in args and law_loss == "ce":
        raise RelaxspecError("--distill-weight goes with --law-loss kl, tv or kl+tv; --law-loss ce reads --ce-weight")


def add_train_classifier_parser(subparsers) -> argparse.ArgumentParser:
    """``relaxspec train-classifier --data DIR --out DIR``: every option overrides one
    :class:`ClassifierTrainConfig` field; options not given keep the default."""
    defaults = ClassifierTrainConfig()
    parser = subparsers.add_parser(
        "train-classifier", help="train the offline evaluation classifier",
        description="Train the small CNN classifier whose features and logits the quality metrics use "
                    "(FID-like distance, precision/recall, class accuracy). Reads DATA/train.npz and "
                    "DATA/val.npz (images uint8 [n, H, W, 3], labels [n]); writes OUT/model.safetensors + "
                    "config.json (with val top-1 / top-5).",
        argument_default=argparse.SUPPRESS)

    option = Options(parser, defaults)

    option("--data", "folder with train.npz and val.npz", metavar="DIR")
    option("--out", "output folder", metavar="DIR")
    option("--channels", "conv widths of the stages, e.g. 32,64,128", type=int_list)
    option("--feature-dim", "width of the penultimate layer (the features)", type=int)
    option("--dropout", "dropout before the head", type=float)
    option("--epochs", "passes over the training split", type=int)
    option("--batch-size", "images per step", type=int)
    option("--lr", "peak AdamW learning rate", type=float)
    option("--weight-decay", "AdamW weight decay (conv and linear weights only)", type=float)
    option("--warmup-epochs", "linear warm-up before the cosine decay", type=float)
    option("--label-smoothing", "cross-entropy label smoothing", type=float)
    option("--translate", "largest random shift in pixels (0 = off)", type=int)
    parser.add_argument("--no-flip", dest="flip", action="store_false",
                        help="no random horizontal flips (by default all classes but text, flags, clocks, ... are "
                             "mirrored half the time)")
    option("--seed", "seed (init, data order, augmentation)", type=int)
    option("--device", "cpu, cuda, cuda:1, or auto")
    option("--threads", f"torch CPU threads ({DEFAULT_HELP})", type=int)
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(handler=run_train_classifier)
    return parser


def run_train_classifier(args: argparse.Namespace) -> int:
    """Entry point of ``relaxspec train-classifier``; raises :class:`RelaxspecError` on bad input."""
    given = {k: v for k, v in vars(args).items() if k in ClassifierTrainConfig.__dataclass_fields__}
    config = ClassifierTrainConfig.from_dict(given)
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise RelaxspecError(f"--out {out}: exists and is not a folder")
    train, val = load_data(config.data)
    model = train_classifier(train, val, config)
    save_classifier(model, out, config)
    summary = {k: v for k, v in model.metrics.items() if k != "history"}
    print(json.dumps({"out": str(out), **summary}))
    return 0
