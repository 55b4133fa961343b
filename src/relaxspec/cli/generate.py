"""``relaxspec generate``: condition -> image tokens (any decoding method) -> VQ decode -> PNGs,
``grid.png``, ``tokens.npy`` and ``stats.json``; resumable (finished batches of the same settings
are kept)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from relaxspec import __version__
from relaxspec.models.llamagen.checkpoints import PRECISIONS, load_gpt, load_vq
from relaxspec.api import UPSTREAM_SAMPLING
from relaxspec.cli.options import DEFAULT_CLASSES, device_option, parse_classes, spec_id
from relaxspec import methods
from relaxspec.decoding import decode
from relaxspec.methods import MethodOptions
from relaxspec.decoding.result import certified_tv, record_tv_sum, total_rank_counts
from relaxspec.drafting.eagle import load_drafter
from relaxspec.errors import RelaxspecError
from relaxspec.inputs import check_at_least, check_seed, check_upscale
from relaxspec.files import load_caption_features, file_identity, read_prompts_file, write_atomic, write_grid, write_json, write_png
from relaxspec.models.llamagen.gpt import GPT_SIZES, Transformer
from relaxspec.models.llamagen.vq import VQ_CONFIGS, to_uint8
from relaxspec.sampling import SamplingConfig, batch_seed

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
    models.add_argument("--model-path", metavar="DIR",
                        help="a transformers model folder (save_pretrained layout, safetensors) of a supported "
                             "family: Janus / Janus-Pro or Emu3 (text prompts with --prompt; needs "
                             "relaxspec[transformers])")
    models.add_argument("--vq-ckpt", metavar="PATH", help="VQ tokenizer weights (default: the embedded model's)")
    models.add_argument("--vq-model", default="VQ-16", metavar="NAME|JSON",
                        help=f"named tokenizer ({', '.join(VQ_CONFIGS)}) or a JSON file of VQConfig fields (default VQ-16)")
    models.add_argument("--image-size", type=int, help="pixels per side; fixes the token grid (default: the model's "
                                                       "own for relaxspec folders, else 256; Emu3: the image area "
                                                       "its processor asks for, default its own)")
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
    cond.add_argument("--prompts-file", metavar="FILE", help="t2i: text prompts, one per line (blank lines skipped)")
    cond.add_argument("--negative-prompt", metavar="TEXT",
                      help="Emu3: the guidance's negative prompt (default: transformers' Emu3 example's; \"\" = "
                           "none, the prompt's last token is the unconditional context, as transformers without one)")
    cond.add_argument("--t5-path", metavar="DIR", help="t2i: a local Flan-T5 folder (save_pretrained layout, "
                                                      "safetensors) that encodes --prompt / --prompts-file "
                                                      "(needs relaxspec[transformers])")

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


def use_embedded_defaults(args: argparse.Namespace) -> bool:
    """With no --gpt-ckpt the embedded model (its tokenizer, drafter and documented defaults)
    stands in; flags the user did give still win."""
    if getattr(args, "model_path", None) is not None:
        if args.gpt_ckpt is not None or args.vq_ckpt is not None:
            raise RelaxspecError("--model-path is a whole model: leave out --gpt-ckpt / --vq-ckpt")
        return False
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
    args.model_presets = defaults.get("presets", {})
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
    drafter_given = args.drafter_ckpt is not None
    use_embedded_defaults(args)
    if args.model_path is not None:
        fill_folder_sampling(args)
    elif args.negative_prompt is not None:
        raise RelaxspecError("--negative-prompt goes with --model-path (an Emu3 folder)")
    for key, value in UPSTREAM_SAMPLING.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.method is None:
        args.method = "ar"
    sampling = SamplingConfig(cfg_scale=args.cfg_scale, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    options = method_options(args)
    if drafter_given and not options.needs_drafter:
        raise RelaxspecError(f"--drafter-ckpt is not used by {options.family.where(options)}")
    if args.image_size is not None:
        check_at_least("image size", args.image_size, 1)
    check_at_least("batch size", args.batch_size, 1)
    check_at_least("grid max", args.grid_max, 0)
    check_upscale(args.upscale)  # the output side is checked once the model's image size is known
    check_seed(args.seed)
    device = device_option(args.device)
    if args.threads is not None:
        if args.threads < 1:
            raise RelaxspecError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise RelaxspecError(f"--out {out}: exists and is not a folder")

    if args.model_path is not None:
        model, vq, conditions, cond_mask, cond_settings, identity = load_transformers_model(args, device)
    else:
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
        identity = {"gpt_ckpt": str(Path(args.gpt_ckpt).resolve()), "gpt_model": spec_id(args.gpt_model),
                    "gpt_config": model.config.to_dict(), "vq_ckpt": str(Path(args.vq_ckpt).resolve()),
                    "vq_model": spec_id(args.vq_model), "vq_config": dataclasses.asdict(vq.config)}
    check_upscale(args.upscale, args.image_size)
    if options.needs_drafter and args.drafter_ckpt is None:
        raise RelaxspecError("--drafter-ckpt is required: this method drafts with an EAGLE drafter trained for the "
                             "target (train one with relaxspec train-drafter)")
    drafter = load_drafter(args.drafter_ckpt, model) if options.needs_drafter else None
    if not options.needs_drafter:
        args.drafter_ckpt = None  # not read, so not recorded (the embedded model's stands in by default)

    settings = {
        **identity,
        "image_size": args.image_size, "image_tokens": model.config.block_size, **cond_settings,
        "sampling": sampling.to_dict(), "method": options.to_dict(),
        "drafter_ckpt": None if args.drafter_ckpt is None else str(Path(args.drafter_ckpt).resolve()),
        "seed": args.seed, "seeding": "batch b: torch.Generator().manual_seed(seed * 1000003 + b)",
        "batch_size": args.batch_size, "precision": args.precision, "device": str(device),
        "files": {key: file_identity(path) for key, path in (
            ("gpt_ckpt", args.gpt_ckpt), ("vq_ckpt", args.vq_ckpt), ("drafter_ckpt", args.drafter_ckpt),
            ("caption_features", args.caption_features), ("caption_mask", args.caption_mask),
            ("t5_path", args.t5_path), ("prompts_file", args.prompts_file), ("model_path", args.model_path)) if path},
    }
    if args.upscale != 1:  # recorded only when used, so runs from before the flag still resume
        settings["upscale"] = args.upscale
    settings_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    num_images, num_tokens = conditions.shape[0], model.config.block_size
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
        result = decode(model, conditions[index], sampling, options, generator=generator, drafter=drafter, vq=vq,
                        cond_mask=None if cond_mask is None else cond_mask[index],
                        progress=show and sys.stderr.isatty())
        began = time.perf_counter()
        with torch.inference_mode():
            pixels = to_uint8(vq.decode(result.tokens.to(device))).cpu().numpy()
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


def method_options(args: argparse.Namespace) -> MethodOptions:
    """``--method``, the model's preset of that name and the method flags the user set ->
    validated :class:`MethodOptions` (a flag the method does not read is an error)."""
    given = {name: getattr(args, name) for name in methods.settings() if getattr(args, name, None) is not None}
    return methods.resolve(args.method, given, getattr(args, "model_presets", None))


def load_conditions(args: argparse.Namespace, model: Transformer) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Class ids ``[N]`` (c2i) or caption features ``[N, C, caption_dim]`` and mask ``[N, C]`` (t2i),
    validated against the model, plus what ``stats.json`` records about them."""
    config = model.config
    if config.model_type == "c2i":
        if args.caption_features or args.caption_mask:
            raise RelaxspecError("this is a class-conditional (c2i) model: give --classes, not --caption-features")
        if args.prompt or args.prompts_file or args.t5_path:
            raise RelaxspecError("this is a class-conditional (c2i) model: give --classes, not prompts")
        classes = parse_classes(args.classes if args.classes is not None else DEFAULT_CLASSES, model.class_names)
        bad = [c for c in classes if not 0 <= c < config.num_classes]
        if bad:
            raise RelaxspecError(f"class id {bad[0]} is out of range: this model has classes 0..{config.num_classes - 1}")
        return torch.tensor(classes, dtype=torch.long), None, {"classes": classes}
    if args.classes is not None:
        raise RelaxspecError("this is a text-to-image (t2i) model: give --prompt / --caption-features, not --classes")
    prompts = read_prompts(args)
    if prompts:
        return encode(args, model, prompts)
    if args.t5_path:
        raise RelaxspecError("--t5-path encodes prompts: give --prompt TEXT or --prompts-file FILE")
    if not args.caption_features:
        raise RelaxspecError(f"this is a text-to-image (t2i) model: give --prompt TEXT with --t5-path DIR, or "
                             f"--caption-features PATH.npy (caption features [N, {config.cls_token_num}, "
                             f"{config.caption_dim}], e.g. Flan-T5-XL outputs)")
    features, mask = load_caption_features(args.caption_features, args.caption_mask)
    expected = (config.cls_token_num, config.caption_dim)
    if tuple(features.shape[1:]) != expected:
        raise RelaxspecError(f"--caption-features {args.caption_features}: shape {tuple(features.shape)}, but this "
                             f"model needs [N, {expected[0]}, {expected[1]}]")
    if mask is not None and tuple(mask.shape) != tuple(features.shape[:2]):
        raise RelaxspecError(f"caption mask shape {tuple(mask.shape)} does not match the features' {tuple(features.shape[:2])}")
    return features, mask, {"caption_features": str(Path(args.caption_features).resolve()),
                            "captions": int(features.shape[0]), "caption_mask": mask is not None}


def load_transformers_model(args: argparse.Namespace, device):
    """A ``--model-path`` folder: the target, its image tokenizer, the prompts' token ids and mask,
    what stats.json records about them, and the model's identity (relaxspec.models.hf)."""
    family, opened = open_model_folder(args, device)
    model, vq = opened.target, opened.tokenizer
    identity = {"model_path": str(Path(args.model_path).resolve()), "model_type": family.MODEL_TYPE,
                "model_config": vars(model.config), "vq_config": vars(vq.config)}
    return model, vq, opened.cond, opened.cond_mask, opened.record, identity


def open_model_folder(args: argparse.Namespace, device, prompts: list[str] | None = None):
    """``(family, opened)`` for ``--model-path`` (relaxspec.models.hf), on ``prompts`` (default: the
    --prompt / --prompts-file ones) with --precision, --image-size and --negative-prompt, as
    generate and bench open it; ``args.image_size`` becomes the folder's pixel size."""
    from relaxspec.models import hf

    family = hf.family(args.model_path)
    if getattr(args, "classes", None) is not None or getattr(args, "caption_features", None) or args.t5_path:
        raise RelaxspecError(f"this {family.NAME} model takes text prompts: --prompt TEXT or --prompts-file FILE")
    prompts = read_prompts(args) if prompts is None else prompts
    if not prompts:
        raise RelaxspecError(f"this {family.NAME} model takes text prompts: give --prompt TEXT (repeatable) or "
                             "--prompts-file FILE")
    opened = family.open_folder(args.model_path, prompts, device=device, dtype=PRECISIONS[args.precision],
                                image_size=args.image_size, negative_prompt=args.negative_prompt)
    args.image_size = opened.image_size
    return family, opened


def fill_folder_sampling(args: argparse.Namespace) -> None:
    """Sampling flags left out (``None`` or absent) come from the ``--model-path`` folder: its
    generation config, else its family's recipe. generate, bench and train-drafter read them so."""
    from relaxspec.models import hf

    for key, value in hf.family(args.model_path).sampling_defaults(args.model_path).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """``--prompt`` values, then the lines of ``--prompts-file`` (blank lines skipped)."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
        if not prompts:
            raise RelaxspecError(f"--prompts-file {args.prompts_file}: no prompts in the file")
    if prompts and (args.caption_features or args.caption_mask):
        raise RelaxspecError("give prompts or --caption-features, not both")
    return prompts


def encode(args: argparse.Namespace, model: Transformer, prompts: list[str]):
    """Prompts -> left-padded T5 features and mask (models.llamagen.prompts), checked against the model."""
    from relaxspec.models.llamagen.prompts import encode_prompts

    if not args.t5_path:
        raise RelaxspecError("encoding prompts needs --t5-path DIR (a local Flan-T5 folder, as upstream LlamaGen "
                             "uses), or give precomputed --caption-features")
    config = model.config
    features, mask, lengths = encode_prompts(prompts, args.t5_path, max_length=config.cls_token_num,
                                             device=model.device)
    if features.shape[-1] != config.caption_dim:
        raise RelaxspecError(f"--t5-path {args.t5_path}: its features have {features.shape[-1]} dimensions, but this "
                             f"model reads {config.caption_dim}: not the text encoder it was trained with")
    for i, length in enumerate(lengths):
        if length > config.cls_token_num:
            print(f"relaxspec: prompt {i + 1} has {length} tokens; the model reads {config.cls_token_num}, so it is "
                  "cut (as upstream)", file=sys.stderr)
    return features.cpu(), mask.cpu(), {"prompts": prompts, "t5_path": str(Path(args.t5_path).resolve())}


def condition_record(cond_settings: dict, index: int) -> dict:
    if "classes" in cond_settings:
        return {"class": cond_settings["classes"][index]}
    if "prompts" in cond_settings:
        return {"prompt": cond_settings["prompts"][index]}
    return {"caption": index}


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
