"""The ``relaxspec`` command line.

Subcommands:

* ``generate``: condition -> image tokens (any decoding method) -> VQ decode -> PNGs, ``grid.png``,
  ``tokens.npy`` and ``stats.json``; resumable (finished batches of the same settings are kept).
* ``info``: what a checkpoint is (layout, inferred config, parameter count).
* ``make-test-checkpoints``: random-weight files in the official LlamaGen layout, for users without
  the released weights, for the README demo and for the tests.

Every mistake a user can make ends in one line ``relaxspec: error: ...`` on stderr and exit code 2.
An unexpected exception still shows its traceback: that is a bug to fix, not to hide.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from relaxspec import __version__
from relaxspec.checkpoints import PRECISIONS, describe, load_gpt, load_vq
from relaxspec.decoding import MethodOptions, decode
from relaxspec.decoding.options import ALIASES, DRAFTS, METHODS
from relaxspec.decoding.result import certified_tv, record_tv_sum
from relaxspec.errors import RelaxspecError
from relaxspec.models.gpt import GPT_SIZES, GPTConfig, Transformer, gpt_config
from relaxspec.models.vq import VQ_CONFIGS, VQConfig, VQModel, to_uint8
from relaxspec.sampling import SamplingConfig

#: Upstream LlamaGen's c2i demo classes (sample_c2i.py), used when --classes is not given.
DEFAULT_CLASSES = "207,360,387,974,88,979,417,279"
STATS_FILE, TOKENS_FILE, GRID_FILE = "stats.json", "tokens.npy", "grid.png"
#: ``generate`` flag -> MethodOptions field. Flags left unset keep MethodOptions' defaults, so a
#: method's own defaults (e.g. LANTERN++'s multiplicative ``lam``) still apply.
METHOD_FLAGS = {
    "draft": "draft", "depth": "depth", "tree": "tree", "siblings": "siblings",
    "dynamic_top_k": "dynamic_top_k", "total_tokens": "total_tokens", "k": "k", "delta": "delta",
    "lam": "lam", "residual": "residual", "geometry": "geometry", "cool_delta": "cool_delta",
    "nu": "nu", "normalisation": "normalisation", "window": "window", "anneal": "anneal",
    "compile": "compile", "record_tv": "record_tv",
}

#: Random-weight sizes for ``make-test-checkpoints`` (official layout, unnamed sizes, so a JSON
#: config travels with them). "small" is VQ-16-shaped at 256 px; "tiny" is for unit tests (16 px).
TEST_PRESETS: dict[str, dict] = {
    "small": dict(
        gpt=dict(dim=128, n_layer=2, n_head=2, vocab_size=16384, num_classes=1000),
        t2i=dict(cls_token_num=120, caption_dim=2048),
        vq=dict(codebook_size=16384, codebook_embed_dim=8, z_channels=64, ch=16, ch_mult=(1, 1, 2, 2, 4),
                num_res_blocks=1, norm_groups=8),
        image_size=256,
    ),
    "tiny": dict(
        gpt=dict(dim=64, n_layer=2, n_head=4, vocab_size=64, num_classes=10),
        t2i=dict(cls_token_num=6, caption_dim=32),
        vq=dict(codebook_size=64, codebook_embed_dim=8, z_channels=16, ch=32, ch_mult=(1, 2, 2),
                num_res_blocks=1, norm_groups=8),
        image_size=16,
    ),
}


class UsageError(Exception):
    """A command-line parsing error (argparse's message, printed on one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse hook
        raise UsageError(f"{message} (see '{self.prog} --help')")


# ------------------------------------------------------------------------------------------------
# parser
# ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="relaxspec", description="Exact and relaxed speculative decoding for LlamaGen.")
    parser.add_argument("--version", action="version", version=f"relaxspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{generate,info,data,train-vq,train-gpt,train-drafter,train-classifier,build-tree,bench,eval,make-test-checkpoints}")

    gen = commands.add_parser("generate", help="generate images", description=(
        "Generate images with a LlamaGen checkpoint. Writes NNNN.png per image, grid.png, tokens.npy "
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
                                                       "own for relaxspec folders, else 256)")
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

    sampling = gen.add_argument_group("sampling (upstream order: CFG, temperature, top-k, top-p)")
    sampling.add_argument("--cfg-scale", type=float, help="classifier-free guidance (default 4.0, upstream's demo; "
                                                          "the embedded model's own default with it; 1 = off)")
    sampling.add_argument("--temperature", type=float, help="0 = greedy (default 1.0)")
    sampling.add_argument("--top-k", type=int, help="0 = off (default 2000, upstream's demo; embedded: its own)")
    sampling.add_argument("--top-p", type=float, help="in (0, 1] (default 1.0 = off)")
    sampling.add_argument("--seed", type=int, default=0,
                          help="batch b samples with a generator seeded seed * 1000003 + b (default 0)")

    method = gen.add_argument_group("decoding method")
    method.add_argument("--method", choices=METHODS + tuple(ALIASES),
                        help="default: ar, or the embedded model's documented default method (MODEL_CARD.md)")
    method.add_argument("--draft", help=f"{' | '.join(DRAFTS)} | a JSON static tree")
    method.add_argument("--drafter-ckpt", metavar="PATH", help="EAGLE drafter (methods sd, lantern, cool)")
    method.add_argument("--depth", type=int, help="chain length / dynamic-tree depth")
    method.add_argument("--tree", help="name of a shipped static tree")
    method.add_argument("--siblings", choices=("sampled", "topk"))
    method.add_argument("--dynamic-top-k", type=int, help="EAGLE-2 dynamic tree: children per beam")
    method.add_argument("--total-tokens", type=int, help="EAGLE-2 dynamic tree: nodes per step")
    method.add_argument("--k", type=int, help="LANTERN: latent neighbours per token")
    method.add_argument("--delta", type=float, help="LANTERN: additive TV budget in [0, 1]")
    method.add_argument("--lam", type=float, help="LANTERN++: multiplicative bound >= 1")
    method.add_argument("--residual", choices=("relaxed", "plain"))
    method.add_argument("--geometry", choices=("raw", "normalised"), help="LANTERN neighbour geometry")
    method.add_argument("--cool-delta", type=float, help="COOL-SD relaxation strength")
    method.add_argument("--nu", type=float, help="COOL-SD annealing rate")
    method.add_argument("--normalisation", choices=("mean", "none"), help="COOL-SD schedule normalisation")
    method.add_argument("--window", type=int, help="SJD / SCD Jacobi window")
    method.add_argument("--anneal", action="store_true", default=None,
                        help="LANTERN: anneal the additive budget over draft depth (COOL-SD's schedule)")
    method.add_argument("--compile", action="store_true", default=None,
                        help="compile the model steps and the tree walk (torch.compile; CUDA graphs on a GPU): "
                             "the first batch pays the compilation, later ones run faster")
    method.add_argument("--no-tv-record", dest="record_tv", action="store_false", default=None,
                        help="relaxed methods: skip the per-token TV record (faster; no TV certificate)")

    output = gen.add_argument_group("output")
    output.add_argument("--out", required=True, metavar="DIR", help="output folder")
    output.add_argument("--batch-size", type=int, default=1, help="images per decoding batch (default 1)")
    output.add_argument("--grid-max", type=int, default=64, help="images in grid.png (the first N; default 64)")
    output.add_argument("--overwrite", action="store_true",
                        help="replace a previous run in --out made with different settings")
    output.add_argument("--no-progress", action="store_true", help="no progress bars")

    info = commands.add_parser("info", help="describe a checkpoint",
                               description="Print a checkpoint's layout, inferred config and parameter count.")
    info.set_defaults(handler=cmd_info)
    info.add_argument("ckpt", metavar="CKPT")
    info.add_argument("--json", action="store_true", help="print JSON")

    from relaxspec.bench.cli import add_bench_parser
    from relaxspec.data.emoji import add_data_parser
    from relaxspec.training.gpt import add_train_gpt_parser
    from relaxspec.training.vq import add_train_vq_parser
    from relaxspec.bench.eval import add_eval_parser
    from relaxspec.evaluation.classifier import add_train_classifier_parser
    from relaxspec.training.drafter import add_train_drafter_parser

    add_data_parser(commands)
    add_train_vq_parser(commands)
    add_train_gpt_parser(commands)
    add_train_drafter_parser(commands)
    add_bench_parser(commands)
    add_eval_parser(commands)
    add_train_classifier_parser(commands)
    tree = commands.add_parser("build-tree", help="choose a static draft tree from measured acceptance rates",
                               description=(
        "Pick the static tree with the largest expected accepted length for a node budget from the per-depth, "
        "per-rank acceptance counts that `relaxspec generate` stores in stats.json (measure with a wide tree, "
        "e.g. --draft static --tree probe6x8)."))
    tree.set_defaults(handler=cmd_build_tree)
    tree.add_argument("--stats", required=True, action="append", metavar="STATS_JSON",
                      help="stats.json of one or more generate runs (repeatable; counts are summed)")
    tree.add_argument("--budget", default="57", metavar="N|auto",
                      help="drafted nodes (default 57), or 'auto': time the target and drafter of the stats' run on "
                           "this machine and pick the size that commits the most tokens per second")
    tree.add_argument("--max-budget", type=int, default=64, help="largest size --budget auto considers (default 64)")
    tree.add_argument("--threads", type=int, default=None,
                      help="torch CPU threads while timing (--budget auto; default: 1 on CPU)")
    tree.add_argument("--max-depth", type=int, default=None, help="deepest level (default: as measured)")
    tree.add_argument("--max-children", type=int, default=None, help="children per node (default: as measured)")
    tree.add_argument("--min-tests", type=int, default=20,
                      help="rates measured on fewer tests are treated as 0 (default 20)")
    tree.add_argument("--out", required=True, metavar="TREE_JSON", help="where to write the tree")

    make = commands.add_parser("make-test-checkpoints", help="write random-weight checkpoints", description=(
        "Write random-weight GPT and VQ checkpoints in the official LlamaGen layout ({'model': state_dict}, "
        "upstream key names and shapes): gpt.pt and vq.pt, plus gpt.json / vq.json configs for unnamed sizes."))
    make.set_defaults(handler=cmd_make_test_checkpoints)
    make.add_argument("--out", required=True, metavar="DIR")
    make.add_argument("--preset", choices=tuple(TEST_PRESETS), default="small",
                      help="small: fast 256 px demo (default); tiny: 16 px, for unit tests")
    make.add_argument("--gpt-model", choices=tuple(GPT_SIZES), help="write this named size instead of the preset's GPT")
    make.add_argument("--vq-model", choices=tuple(VQ_CONFIGS), help="write this named tokenizer instead of the preset's")
    make.add_argument("--model-type", choices=("c2i", "t2i"), default="c2i")
    make.add_argument("--image-size", type=int,
                      help="resolution the GPT config is written for (default: the preset's; 256 with --vq-model)")
    make.add_argument("--seed", type=int, default=0)
    return parser


# ------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for any user error)."""
    try:
        args = build_parser().parse_args(argv)
        with warnings.catch_warnings():
            # torch warns about the pickle protocol of non-torch pickles before refusing them; the
            # refusal itself is the message.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            handler = getattr(args, "handler", None) or args.func
            return handler(args)
    except SystemExit as done:  # --help / --version
        return done.code if isinstance(done.code, int) else 0
    except (UsageError, RelaxspecError) as err:
        return _fail(str(err))
    except OSError as err:  # missing, unreadable or unwritable paths
        where = f"{err.filename}: " if err.filename else ""
        return _fail(f"{where}{err.strerror or err}")
    except KeyboardInterrupt:
        print("relaxspec: interrupted (finished images are kept; run again to resume)", file=sys.stderr)
        return 130


def _fail(message: str) -> int:
    print("relaxspec: error: " + " ".join(message.split()), file=sys.stderr)
    return 2


# ------------------------------------------------------------------------------------------------
# generate
# ------------------------------------------------------------------------------------------------


UPSTREAM_SAMPLING = {"cfg_scale": 4.0, "temperature": 1.0, "top_k": 2000, "top_p": 1.0}


def use_embedded_defaults(args: argparse.Namespace) -> bool:
    """With no --gpt-ckpt the embedded model (its tokenizer, drafter and documented defaults)
    stands in; flags the user did give still win."""
    if args.gpt_ckpt is not None:
        if args.vq_ckpt is None:
            raise RelaxspecError("--vq-ckpt is required with --gpt-ckpt (the tokenizer that goes with the GPT)")
        return False
    from relaxspec import embedded

    if args.vq_ckpt is not None or args.gpt_model is not None:
        raise RelaxspecError("--vq-ckpt / --gpt-model go with --gpt-ckpt; without it the embedded model is used")
    args.gpt_ckpt, args.vq_ckpt = str(embedded.path("gpt")), str(embedded.path("vq"))
    defaults = embedded.defaults()
    for key, value in defaults.get("sampling", {}).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.method is None and "method" in defaults:
        args.method = defaults["method"].get("method", "ar")
        for key, value in defaults["method"].items():
            if key != "method" and getattr(args, key, None) is None:
                setattr(args, key, value)
    if args.classes is None and "classes" in defaults:
        args.classes = defaults["classes"]
    if args.drafter_ckpt is None and embedded.available("drafter"):
        args.drafter_ckpt = str(embedded.path("drafter"))
    if args.threads is None:
        # A model this small is fastest on one thread, and far slower with two when anything else
        # runs on the other core (thread hand-offs, not arithmetic, dominate).
        args.threads = 1
    return True


def cmd_generate(args: argparse.Namespace) -> int:
    wall = time.perf_counter()
    use_embedded_defaults(args)
    for key, value in UPSTREAM_SAMPLING.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.method is None:
        args.method = "ar"
    sampling = SamplingConfig(cfg_scale=args.cfg_scale, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    options = method_options(args)
    for name in ("image_size", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise RelaxspecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seed < 0 or args.grid_max < 0:
        raise RelaxspecError("--seed and --grid-max must be >= 0")
    device = resolve_device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            raise RelaxspecError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise RelaxspecError(f"--out {out}: exists and is not a folder")

    vq = load_vq(args.vq_ckpt, args.vq_model, device=device)
    downsample = vq.config.downsample_factor
    if args.image_size is not None and args.image_size % downsample:
        raise RelaxspecError(
            f"--image-size {args.image_size} is not a multiple of the tokenizer's downsampling {downsample}")
    model = load_gpt(args.gpt_ckpt, args.gpt_model, image_size=args.image_size, downsample=downsample,
                     precision=args.precision, device=device)
    args.image_size = model.config.grid_size * downsample
    if model.config.vocab_size != vq.config.codebook_size:
        raise RelaxspecError(f"the GPT's vocabulary ({model.config.vocab_size}) does not match the VQ codebook "
                             f"({vq.config.codebook_size}): they are not a pair")
    conditions, cond_mask, cond_settings = load_conditions(args, model)
    drafter = load_drafter(args.drafter_ckpt, model) if options.needs_drafter else None

    settings = {
        "gpt_ckpt": str(Path(args.gpt_ckpt).resolve()), "gpt_model": _spec_id(args.gpt_model),
        "gpt_config": model.config.to_dict(),
        "vq_ckpt": str(Path(args.vq_ckpt).resolve()), "vq_model": _spec_id(args.vq_model),
        "vq_config": dataclasses.asdict(vq.config),
        "image_size": args.image_size, "image_tokens": model.config.block_size, **cond_settings,
        "sampling": sampling.to_dict(), "method": options.to_dict(),
        "drafter_ckpt": None if args.drafter_ckpt is None else str(Path(args.drafter_ckpt).resolve()),
        "seed": args.seed, "seeding": "batch b: torch.Generator().manual_seed(seed * 1000003 + b)",
        "batch_size": args.batch_size, "precision": args.precision, "device": str(device),
        "files": {key: file_identity(path) for key, path in (
            ("gpt_ckpt", args.gpt_ckpt), ("vq_ckpt", args.vq_ckpt), ("drafter_ckpt", args.drafter_ckpt),
            ("caption_features", args.caption_features), ("caption_mask", args.caption_mask)) if path},
    }
    settings_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    num_images, num_tokens = conditions.shape[0], model.config.block_size
    out.mkdir(parents=True, exist_ok=True)
    records, tokens = previous_run(out, settings, settings_hash, num_images, num_tokens, args.overwrite)

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
        result = decode(model, conditions[index], sampling, options, generator=generator, drafter=drafter, vq=vq,
                        cond_mask=None if cond_mask is None else cond_mask[index],
                        progress=show and sys.stderr.isatty())
        began = time.perf_counter()
        with torch.inference_mode():
            pixels = to_uint8(vq.decode(result.tokens.to(device))).cpu().numpy()
        vq_seconds = time.perf_counter() - began
        mal = result.mean_accepted_length
        accumulate_rank_counts(stats, result)
        for row, i in enumerate(index):
            name = f"{i:04d}.png"
            write_png(out / name, pixels[row])
            tokens[i] = result.tokens[row].numpy()
            records[i] = {
                "index": i, "file": name, **condition_record(cond_settings, i), "batch": batch, "batch_seed": seed,
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
    forwards = sum(r["target_forwards"] for r in done)
    tv_sums = [record_tv_sum(r) for r in done]
    recorded = not any(math.isnan(v) for v in tv_sums)  # --no-tv-record: no certificate
    stats.update(complete=True, images=done, totals={
        "images": num_images, "generated_this_run": generated,
        "seconds": sum(r["seconds"] for r in done),
        "seconds_per_image": sum(r["seconds"] for r in done) / num_images,
        "vq_seconds_per_image": sum(r["vq_seconds"] for r in done) / num_images,
        # where the decoding time went (records of runs before forwards were timed count as 0)
        **{f"{part}_share": sum(r.get(f"{part}_seconds", 0.0) for r in done) / max(sum(r["seconds"] for r in done), 1e-12)
           for part in ("target_forward", "drafter_forward")},
        "target_forwards_per_image": forwards / num_images,
        "mean_accepted_length": num_images * num_tokens / forwards,
        # the certificate: min(1, mean of the per-image sums), never a mean of capped values
        "tv_sum_mean": sum(tv_sums) / num_images if recorded else None,
        "tv_per_token_mean": sum(tv_sums) / (num_images * num_tokens) if recorded else None,
        "tv_certified": certified_tv(tv_sums) if recorded else None,
        "load_seconds": load_seconds, "wall_seconds_this_run": time.perf_counter() - wall,
    })
    write_atomic(out / TOKENS_FILE, lambda path: np.save(path, tokens))
    write_json(out / STATS_FILE, stats)
    totals = stats["totals"]
    print(f"{num_images} images in {out} ({generated} generated now, {num_images - generated} kept); "
          f"{totals['seconds_per_image']:.2f} s/image, {totals['target_forwards_per_image']:.1f} target forwards/image, "
          f"MAL {totals['mean_accepted_length']:.2f}")
    return 0


def accumulate_rank_counts(stats: dict, result) -> None:
    """Keep running ``[depth, rank]`` test / accept counts in stats.json (``relaxspec build-tree``
    reads them)."""
    if result.rank_tests is None:
        return
    counts = stats.setdefault("acceptance_counts", {"tests": [], "accepts": []})
    for key, new in (("tests", result.rank_tests.tolist()), ("accepts", result.rank_accepts.tolist())):
        old = counts[key]
        rows = max(len(old), len(new))
        cols = max([len(r) for r in old + new] or [0])
        merged = [[0] * cols for _ in range(rows)]
        for table in (old, new):
            for i, row in enumerate(table):
                for j, value in enumerate(row):
                    merged[i][j] += int(value)
        counts[key] = merged


def method_options(args: argparse.Namespace) -> MethodOptions:
    """``--method`` and the method flags the user set -> validated :class:`MethodOptions`."""
    given = {field: getattr(args, flag) for flag, field in METHOD_FLAGS.items() if getattr(args, flag) is not None}
    return MethodOptions(method=args.method, **given)


def load_drafter(path: str | None, target: Transformer):
    """The EAGLE drafter for ``target`` (methods sd / lantern / cool), from a folder written by
    ``relaxspec train-drafter``."""
    if path is None:
        raise RelaxspecError("--drafter-ckpt is required: this method drafts with an EAGLE drafter trained for the "
                             "target (train one with relaxspec train-drafter)")
    from relaxspec.training.drafter import load_drafter as load

    return load(path, target)


def resolve_device(name: str) -> torch.device:
    from relaxspec.training.common import resolve_device as resolve

    return resolve(name, "--device")


def _spec_id(spec: str | None) -> str | None:
    """A model name as given, a JSON config as its resolved path (for the settings hash)."""
    return str(Path(spec).resolve()) if spec and spec not in GPT_SIZES and spec not in VQ_CONFIGS else spec


def parse_classes(text: str, names: list[str] | None = None) -> list[int]:
    """Comma-separated class ids, or names when the model names its classes."""
    if names is not None:
        from relaxspec.data.emoji import resolve_classes

        return resolve_classes(text, names)
    try:
        classes = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise RelaxspecError(f"--classes must be comma-separated integer class ids (this model does not name its "
                             f"classes), got {text!r}") from None
    if not classes:
        raise RelaxspecError("--classes is empty")
    return classes


def load_conditions(args: argparse.Namespace, model: Transformer) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Class ids ``[N]`` (c2i) or caption features ``[N, C, caption_dim]`` and mask ``[N, C]`` (t2i),
    validated against the model, plus what ``stats.json`` records about them."""
    config = model.config
    if config.model_type == "c2i":
        if args.caption_features or args.caption_mask:
            raise RelaxspecError("this is a class-conditional (c2i) model: give --classes, not --caption-features")
        classes = parse_classes(args.classes if args.classes is not None else DEFAULT_CLASSES, model.class_names)
        bad = [c for c in classes if not 0 <= c < config.num_classes]
        if bad:
            raise RelaxspecError(f"class id {bad[0]} is out of range: this model has classes 0..{config.num_classes - 1}")
        return torch.tensor(classes, dtype=torch.long), None, {"classes": classes}
    if args.classes is not None:
        raise RelaxspecError("this is a text-to-image (t2i) model: give --caption-features, not --classes")
    if not args.caption_features:
        raise RelaxspecError(f"this is a text-to-image (t2i) model: give --caption-features PATH.npy (caption "
                             f"features [N, {config.cls_token_num}, {config.caption_dim}], e.g. Flan-T5-XL outputs)")
    features, mask = load_caption_features(args.caption_features, args.caption_mask)
    expected = (config.cls_token_num, config.caption_dim)
    if tuple(features.shape[1:]) != expected:
        raise RelaxspecError(f"--caption-features {args.caption_features}: shape {tuple(features.shape)}, but this "
                             f"model needs [N, {expected[0]}, {expected[1]}]")
    if mask is not None and tuple(mask.shape) != tuple(features.shape[:2]):
        raise RelaxspecError(f"caption mask shape {tuple(mask.shape)} does not match the features' {tuple(features.shape[:2])}")
    return features, mask, {"caption_features": str(Path(args.caption_features).resolve()),
                            "captions": int(features.shape[0]), "caption_mask": mask is not None}


def _load_array(path: str) -> np.ndarray | dict:
    if not Path(path).is_file():
        raise RelaxspecError(f"{path}: no such file")
    with open(path, "rb") as handle:
        magic = handle.read(6)
    if magic != b"\x93NUMPY" and not magic.startswith(b"PK"):
        raise RelaxspecError(f"{path}: not a .npy / .npz array file")
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                return {key: loaded[key] for key in loaded.files}
        return loaded
    except ValueError as err:
        if "allow_pickle" in str(err):  # object arrays are pickles: refused, as everywhere else
            raise RelaxspecError(f"{path}: refusing to load: the array holds Python objects (a pickle); "
                                 "save plain float / bool arrays") from None
        raise RelaxspecError(f"{path}: not a readable .npy / .npz file ({err})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as err:
        raise RelaxspecError(f"{path}: not a readable .npy / .npz file ({err})") from None


def load_caption_features(path: str, mask_path: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``.npy`` features ``[N, C, D]`` (+ optional ``.npy`` mask ``[N, C]``), or ``.npz`` with
    ``features`` and optional ``mask``."""
    data = _load_array(path)
    mask = None
    if isinstance(data, dict):
        if "features" not in data:
            raise RelaxspecError(f"{path}: an .npz of captions needs an array named 'features' (and optionally 'mask')")
        features, mask = data["features"], data.get("mask")
    else:
        features = data
    if mask_path:
        mask = _load_array(mask_path)
        if isinstance(mask, dict):
            raise RelaxspecError(f"{mask_path}: expected a .npy array [N, tokens]")
    if features.ndim != 3 or not np.issubdtype(features.dtype, np.floating):
        raise RelaxspecError(f"{path}: caption features must be a float array [N, tokens, dim], "
                             f"got {features.dtype} {features.shape}")
    if features.shape[0] == 0:
        raise RelaxspecError(f"{path}: no captions in the file")
    mask_t = None
    if mask is not None:
        if mask.ndim != 2 or not (mask.dtype == bool or np.issubdtype(mask.dtype, np.integer)):
            raise RelaxspecError(f"caption mask must be a bool or integer array [N, tokens], got {mask.dtype} {mask.shape}")
        mask_t = torch.from_numpy(np.ascontiguousarray(mask != 0))
    return torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)), mask_t


def condition_record(cond_settings: dict, index: int) -> dict:
    if "classes" in cond_settings:
        return {"class": cond_settings["classes"][index]}
    return {"caption": index}


def batch_seed(seed: int, batch: int) -> int:
    """Every batch has its own stream, so a resumed run reproduces an uninterrupted one."""
    return seed * 1_000_003 + batch


def file_identity(path: str) -> dict:
    """Enough to notice that a checkpoint was replaced: resolved path, size and mtime (per file
    for a model folder)."""
    path_ = Path(path)
    files = sorted(p for p in path_.iterdir() if p.is_file()) if path_.is_dir() else [path_]
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def previous_run(out: Path, settings: dict, settings_hash: str, num_images: int, num_tokens: int,
                 overwrite: bool) -> tuple[dict[int, dict], np.ndarray]:
    """The images of an earlier run with the same settings that are finished (PNG on disk, tokens
    saved), and the token array to continue. Tokens of unfinished images are -1."""
    tokens = np.full((num_images, num_tokens), -1, dtype=np.int64)
    stats_path = out / STATS_FILE
    if not stats_path.exists():
        return {}, tokens
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
        return {}, tokens
    try:
        saved = np.load(out / TOKENS_FILE, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return {}, tokens
    if saved.shape != tokens.shape:
        return {}, tokens
    records = {}
    for record in old_images:
        i = record.get("index")
        if (isinstance(i, int) and 0 <= i < num_images and (out / str(record.get("file"))).is_file()
                and (saved[i] >= 0).all()):
            records[i] = record
            tokens[i] = saved[i]
    return records, tokens


def write_atomic(path: Path, write) -> None:
    """``write(temp_path)`` then rename over ``path``: readers never see a half-written file."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        if temp.exists():
            temp.unlink()


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, lambda temp: temp.write_text(json.dumps(data, indent=2) + "\n"))


def write_png(path: Path, pixels: np.ndarray) -> None:
    """``pixels [H, W, 3]`` uint8."""
    from PIL import Image

    write_atomic(path, lambda temp: Image.fromarray(pixels).save(temp, format="PNG"))


def write_grid(out: Path, files: list[str], padding: int = 2) -> None:
    """A near-square grid of the given PNGs with black padding (like torchvision's save_image)."""
    from PIL import Image

    if not files:
        return
    images = []
    for name in files:
        with Image.open(out / name) as image:
            images.append(np.asarray(image.convert("RGB")))
    height, width = images[0].shape[:2]
    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    grid = np.zeros((rows * (height + padding) + padding, cols * (width + padding) + padding, 3), dtype=np.uint8)
    for n, image in enumerate(images):
        r, c = divmod(n, cols)
        top, left = padding + r * (height + padding), padding + c * (width + padding)
        grid[top : top + height, left : left + width] = image[:height, :width]
    write_png(out / GRID_FILE, grid)


# ------------------------------------------------------------------------------------------------
# info
# ------------------------------------------------------------------------------------------------

LAYOUTS = {
    "model": 'official LlamaGen file {"model": state_dict}', "module": '{"module": state_dict}',
    "state_dict": '{"state_dict": state_dict}', "raw": "raw state dict (like upstream XXL / 3B / FSDP files)",
    "safetensors": "safetensors file", "relaxspec": "relaxspec folder (config.json + model.safetensors)",
}


def cmd_build_tree(args: argparse.Namespace) -> int:
    from relaxspec.drafting.trees import build_tree, expected_accept_length

    tests = accepts = None
    for path in args.stats:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise RelaxspecError(f"{path}: not JSON ({err})") from None
        counts = data.get("acceptance_counts") if isinstance(data, dict) else None
        if not counts or not counts.get("tests"):
            raise RelaxspecError(f"{path}: no acceptance_counts (run relaxspec generate with a drafter method first)")
        t, a = torch.tensor(counts["tests"], dtype=torch.float64), torch.tensor(counts["accepts"], dtype=torch.float64)
        if tests is None:
            tests, accepts = t, a
        else:
            rows, cols = max(tests.shape[0], t.shape[0]), max(tests.shape[1], t.shape[1])
            grow = lambda x: torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))  # noqa: E731
            tests, accepts = grow(tests) + grow(t), grow(accepts) + grow(a)
    auto = str(args.budget).strip().lower() == "auto"
    if not auto:
        try:
            args.budget = int(args.budget)
        except ValueError:
            raise RelaxspecError(f"--budget must be a number of nodes or 'auto', got {args.budget!r}") from None
    if (not auto and args.budget < 1) or args.min_tests < 0 or args.max_budget < 1:
        raise RelaxspecError("--budget and --max-budget must be >= 1 and --min-tests >= 0")
    rates = torch.where(tests >= max(args.min_tests, 1), accepts / tests.clamp(min=1), torch.zeros_like(tests))
    record = {"rates": rates.tolist(), "tests": tests.tolist()}
    if auto:
        spec, record["costs"], record["curve"] = _tree_for_this_machine(args, rates)
    else:
        spec = build_tree(rates, args.budget, args.max_depth, args.max_children)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"paths": [list(p) for p in spec.paths], "expected_mal": 1 + expected_accept_length(spec, rates), **record}
    out.write_text(json.dumps(record) + "\n")
    print(f"{out}: {len(spec.paths)} nodes, depth {spec.depth}, per level {spec.level_sizes()}, "
          f"expected MAL {record['expected_mal']:.3f} (use --draft {out})")
    return 0


def _tree_for_this_machine(args: argparse.Namespace, rates: torch.Tensor):
    """``--budget auto``: time the stats' own target and drafter here, then pick the tree size
    with the most expected tokens per second. Returns the tree, the costs and the whole curve."""
    from relaxspec.bench.cost import measure_forward_costs
    from relaxspec.drafting.trees import best_tree_for_cost

    settings = json.loads(Path(args.stats[0]).read_text()).get("settings", {})
    if not settings.get("gpt_ckpt") or not settings.get("drafter_ckpt"):
        raise RelaxspecError(f"{args.stats[0]}: --budget auto needs a run that names its GPT and drafter checkpoints "
                             "(a relaxspec generate run with a drafter method)")
    device = resolve_device(settings.get("device", "cpu"))
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else None)
    if threads is not None:
        if threads < 1:
            raise RelaxspecError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    if settings.get("vq_config"):  # the run recorded its tokenizer: no need to load it for its grid
        downsample = VQConfig(**{**settings["vq_config"], "ch_mult": tuple(settings["vq_config"]["ch_mult"])}).downsample_factor
    else:
        downsample = load_vq(settings["vq_ckpt"], settings.get("vq_model")).config.downsample_factor
    model = load_gpt(settings["gpt_ckpt"], settings.get("gpt_model"), image_size=settings.get("image_size"),
                     downsample=downsample, precision=settings.get("precision", "fp32"), device=device)
    drafter = load_drafter(settings["drafter_ckpt"], model)
    sampling = SamplingConfig(**settings.get("sampling", {}))
    costs = measure_forward_costs(model, drafter, sampling=sampling,
                                  target_sizes=sorted({1, 2, 4, 8, 12, 16, 24, 32, 48, 64, args.max_budget + 1}))
    spec, curve = best_tree_for_cost(rates, costs.step_seconds, args.max_budget, args.max_depth, args.max_children)
    ar = costs.target_seconds(1)
    print("nodes  depth  expected MAL  step ms  tokens/s  est. speed-up vs AR (forwards only)")
    for row in curve:
        mark = " <-" if row["nodes"] == len(spec.paths) else ""
        print(f"{row['nodes']:5d}  {row['depth']:5d}  {row['expected_mal']:12.3f}  {1000 * row['step_seconds']:7.2f}  "
              f"{row['tokens_per_second']:8.1f}  {row['tokens_per_second'] * ar:5.2f}x{mark}")
    return spec, costs.to_dict(), curve


def cmd_info(args: argparse.Namespace) -> int:
    info = describe(args.ckpt)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"path:       {info['path']}")
    print(f"layout:     {LAYOUTS.get(info['layout'], info['layout'])}")
    kind = info["kind"]
    if kind == "gpt" and isinstance(info.get("config"), dict) and "model_type" in info["config"]:
        kind = f"gpt ({info['config']['model_type']})"
    print(f"kind:       {kind}")
    if info.get("config"):
        print("config:     " + ", ".join(f"{k}={v}" for k, v in info["config"].items()))
    if info.get("kind") == "gpt" and info.get("layout") != "relaxspec":
        looks = info.get("looks_like")
        print(f"looks like: {looks or 'no named size (load it with --gpt-model CONFIG.json)'}"
              + ("" if not looks else f" (pass --gpt-model {looks})"))
    print(f"parameters: {info['parameters']:,} ({info['parameters'] / 1e6:.1f}M)")
    print(f"tensors:    {info['tensors']} ({', '.join(info['dtypes'])})")
    return 0


# ------------------------------------------------------------------------------------------------
# make-test-checkpoints
# ------------------------------------------------------------------------------------------------


def cmd_make_test_checkpoints(args: argparse.Namespace) -> int:
    preset = TEST_PRESETS[args.preset]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise RelaxspecError(f"--out {out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.vq_model:
        vq_config, vq_spec = VQ_CONFIGS[args.vq_model], args.vq_model
    else:
        vq_config, vq_spec = VQConfig(**preset["vq"]), str(out / "vq.json")
    image_size = args.image_size or (256 if args.vq_model else preset["image_size"])
    downsample = vq_config.downsample_factor
    if image_size % downsample:
        raise RelaxspecError(f"--image-size {image_size} is not a multiple of the tokenizer's downsampling {downsample}")
    conditioning = dict(preset["t2i"]) if args.model_type == "t2i" else {}
    if args.gpt_model:
        extra = {} if args.model_type == "c2i" else {"caption_dim": 2048}
        gpt = gpt_config(args.gpt_model, image_size=image_size, downsample=downsample, model_type=args.model_type,
                         vocab_size=vq_config.codebook_size, **extra)
        gpt_spec = args.gpt_model
    else:
        grid = image_size // downsample
        gpt = GPTConfig(**preset["gpt"], **conditioning, model_type=args.model_type, block_size=grid * grid)
        if gpt.vocab_size != vq_config.codebook_size:
            gpt = dataclasses.replace(gpt, vocab_size=vq_config.codebook_size)
        gpt_spec = str(out / "gpt.json")
    target = Transformer(gpt)
    vq = VQModel(vq_config)
    torch.save({"model": target.state_dict()}, out / "gpt.pt")
    torch.save({"model": vq.state_dict()}, out / "vq.pt")
    if not args.gpt_model:
        (out / "gpt.json").write_text(json.dumps(gpt.to_dict(), indent=2) + "\n")
    if not args.vq_model:
        (out / "vq.json").write_text(json.dumps(dataclasses.asdict(vq_config), indent=2) + "\n")
    condition = "--classes 207,360" if args.model_type == "c2i" and gpt.num_classes > 360 else (
        "--classes 1,2" if args.model_type == "c2i" else "--caption-features CAPTIONS.npy")
    print(f"wrote random-weight checkpoints (official layout) to {out}: gpt.pt "
          f"({target.num_parameters() / 1e6:.1f}M parameters), vq.pt")
    print(f"try: relaxspec generate --gpt-ckpt {out / 'gpt.pt'} --gpt-model {gpt_spec} --vq-ckpt {out / 'vq.pt'} "
          f"--vq-model {vq_spec} --image-size {image_size} {condition} --out out")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
