"""``relaxspec.generate``: images from class ids or names in one call.

It is ``relaxspec generate`` without files: the same defaults (the embedded emoji model with its
documented sampling and method when no model is given, upstream LlamaGen's sampling otherwise),
the same seeding (all conditions form batch 0 of a run seeded ``seed``, so the tokens equal
``relaxspec generate --batch-size N --seed S`` for the same N conditions), and the same checks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import torch

from relaxspec import methods
from relaxspec.decoding import DecodeResult, decode
from relaxspec.methods import MethodOptions
from relaxspec.devices import resolve_device
from relaxspec.errors import RelaxspecError
from relaxspec.inputs import check_seed, check_upscale
from relaxspec.sampling import SamplingConfig, batch_seed

#: Upstream LlamaGen's demo sampling (sample_c2i.py), for a model that brings no defaults.
UPSTREAM_SAMPLING = {"cfg_scale": 4.0, "temperature": 1.0, "top_k": 2000, "top_p": 1.0}


class Generation(NamedTuple):
    """What :func:`generate` returns: ``images`` (one ``PIL.Image`` per condition, in order) and
    the decode's ``result`` (tokens, accepted lengths, forwards, TV record, timings)."""

    images: list
    result: DecodeResult


@functools.lru_cache(maxsize=2)
def _embedded(device: str, precision: str):
    from relaxspec import embedded

    return embedded.load(device=device, precision=precision)


def generate(classes: str | Sequence[int | str] | None = None, method: str | MethodOptions | None = None, *,
             model: tuple | None = None, sampling: SamplingConfig | dict | None = None, seed: int = 0,
             device: str | torch.device | None = None, precision: str | None = None, upscale: int = 1,
             progress: bool = False, prompts: Sequence[str] | None = None, t5_path: str | None = None,
             model_path: str | None = None, drafter_ckpt: str | None = None, negative_prompt: str | None = None,
             image_size: int | None = None, **method_fields) -> Generation:
    """Generate one image per class (or per prompt, for a text-to-image model).

    ``classes``: class ids, or names for a model that names its classes (``"heart,animal-mammal"``
    or a list); default: the embedded model's demo classes. ``method``: a method name (``"ar"``,
    ``"lantern"``, ``"lantern++"``, ``"cool"``, ``"sd"``, ``"sjd"``, ``"scd"``, ``"eagle2"``) or a
    :class:`MethodOptions`; ``method_fields`` set its fields (``delta=0.2``, ``compile=True``).
    With no model and no method, the embedded model's documented default method (its
    ``defaults.json``). ``model``: ``(target, vq, drafter)`` (``drafter`` may be ``None`` for
    drafter-free methods); default: the embedded model, loaded once per ``device`` (default cpu) and ``precision``
    (default fp32), which only apply to it. ``sampling``: a
    :class:`SamplingConfig` or a dict of its fields over the model's defaults. ``upscale``: enlarge
    each image that many times (nearest neighbour). ``prompts`` with ``t5_path`` (a local Flan-T5
    folder): a t2i model's conditions, encoded as ``relaxspec generate --prompt --t5-path`` does.

    ``model_path``: a transformers model folder (Janus / Janus-Pro, Emu3; ``save_pretrained``
    layout) instead of ``model``, opened as ``relaxspec generate --model-path`` opens it: ``prompts``
    formatted by its processor, its sampling defaults, ``device`` and ``precision`` applied;
    ``drafter_ckpt`` an EAGLE drafter trained for it; ``negative_prompt`` (Emu3) and
    ``image_size`` as the command's flags.
    """
    check_upscale(upscale)  # and the output side, once the model's image size is known (_run)
    check_seed(seed)
    defaults = {}
    if model_path is not None:
        return _generate_folder(model_path, prompts, method, method_fields, sampling=sampling, seed=seed,
                                device=device, precision=precision, upscale=upscale, progress=progress,
                                drafter_ckpt=drafter_ckpt, negative_prompt=negative_prompt, image_size=image_size,
                                others=(model, classes, t5_path))
    if drafter_ckpt is not None or negative_prompt is not None or image_size is not None:
        raise RelaxspecError("drafter_ckpt, negative_prompt and image_size go with model_path")
    if model is None:
        from relaxspec import embedded

        target, vq, drafter = _embedded(str(resolve_device(str(device or "cpu"))), precision or "fp32")
        defaults = embedded.defaults()
    else:
        if device is not None or precision is not None:
            raise RelaxspecError("device and precision apply to the embedded model; load your own model on the "
                                 "device and in the precision you want")
        if not isinstance(model, (tuple, list)) or len(model) != 3:
            raise RelaxspecError("model must be (target, vq, drafter); drafter may be None")
        target, vq, drafter = model
    sampling = _sampling(sampling, defaults)
    options = _options(method, method_fields, defaults)
    if options.needs_drafter and drafter is None:
        raise RelaxspecError(f"method {options.method!r} drafts with an EAGLE drafter: pass model=(target, vq, drafter)")
    cond_mask = None
    if target.config.model_type == "t2i":
        cond, cond_mask = _prompt_features(prompts, t5_path, target, classes)
    elif prompts is not None or t5_path is not None:
        raise RelaxspecError("this is a class-conditional (c2i) model: give classes, not prompts")
    else:
        cond = torch.tensor(_class_ids(classes, target, defaults), dtype=torch.long)
    return _run(target, vq, drafter, cond, cond_mask, sampling, options, seed, upscale, progress)


def _run(target, vq, drafter, cond, cond_mask, sampling, options, seed, upscale, progress) -> Generation:
    from PIL import Image

    from relaxspec.models.llamagen.vq import to_uint8

    check_upscale(upscale, target.config.grid_size * vq.config.downsample_factor)
    run_device = target.device
    generator = torch.Generator(device=run_device).manual_seed(batch_seed(seed, 0))
    result = decode(target, cond, sampling, options, generator=generator, drafter=drafter, vq=vq, progress=progress,
                    cond_mask=cond_mask)
    pixels = to_uint8(vq.decode(result.tokens.to(run_device))).cpu().numpy()
    images = [Image.fromarray(p) for p in pixels]
    if upscale > 1:
        images = [im.resize((im.width * upscale, im.height * upscale), Image.NEAREST) for im in images]
    return Generation(images, result)


def _generate_folder(model_path, prompts, method, method_fields, *, sampling, seed, device, precision, upscale,
                     progress, drafter_ckpt, negative_prompt, image_size, others) -> Generation:
    """:func:`generate` for a transformers model folder (relaxspec.models.hf)."""
    from relaxspec.drafting.eagle import load_drafter
    from relaxspec.models import hf
    from relaxspec.models.llamagen.checkpoints import PRECISIONS

    model, classes, t5_path = others
    if model is not None or classes is not None or t5_path is not None:
        raise RelaxspecError("model_path is a whole text-to-image model: give prompts, not model / classes / t5_path")
    if not prompts or isinstance(prompts, str):
        raise RelaxspecError("model_path: give prompts=[...] (a list of texts)")
    family = hf.family(model_path)
    sampling = _sampling(sampling, {"sampling": family.sampling_defaults(model_path)})
    options = _options(method, method_fields, {})
    if options.needs_drafter and drafter_ckpt is None:
        raise RelaxspecError(f"method {options.method!r} drafts with an EAGLE drafter: give drafter_ckpt "
                             "(relaxspec train-drafter --model-path trains one)")
    if drafter_ckpt is not None and not options.needs_drafter:
        raise RelaxspecError(f"drafter_ckpt is not used by {options.family.where(options)}")
    if (precision or "fp32") not in PRECISIONS:
        raise RelaxspecError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    opened = family.open_folder(model_path, list(prompts), device=resolve_device(str(device or "cpu")),
                                dtype=PRECISIONS[precision or "fp32"], image_size=image_size,
                                negative_prompt=negative_prompt)
    drafter = load_drafter(drafter_ckpt, opened.target) if drafter_ckpt is not None else None
    return _run(opened.target, opened.tokenizer, drafter, opened.cond, opened.cond_mask, sampling, options, seed,
                upscale, progress)


def _prompt_features(prompts, t5_path, target, classes) -> tuple[torch.Tensor, torch.Tensor]:
    from relaxspec.models.llamagen.prompts import encode_prompts

    if classes is not None:
        raise RelaxspecError("this is a text-to-image (t2i) model: give prompts, not classes")
    if not prompts or isinstance(prompts, str):
        raise RelaxspecError("this is a text-to-image (t2i) model: give prompts=[...] (a list of texts) and t5_path")
    if t5_path is None:
        raise RelaxspecError("encoding prompts needs t5_path (a local Flan-T5 folder)")
    config = target.config
    if not hasattr(config, "caption_dim"):
        raise RelaxspecError("relaxspec.generate encodes prompts for LlamaGen t2i models; for a Janus or Emu3 model "
                             "give its folder as model_path (docs/models/)")
    features, mask, _ = encode_prompts(list(prompts), t5_path, max_length=config.cls_token_num, device=target.device)
    if features.shape[-1] != config.caption_dim:
        raise RelaxspecError(f"t5_path {t5_path}: its features have {features.shape[-1]} dimensions, but this model "
                             f"reads {config.caption_dim}")
    return features, mask


def _sampling(sampling: SamplingConfig | dict | None, defaults: dict) -> SamplingConfig:
    if isinstance(sampling, SamplingConfig):
        return sampling
    fields = {**UPSTREAM_SAMPLING, **defaults.get("sampling", {}), **(sampling or {})}
    return SamplingConfig(**fields)


def _options(method: str | MethodOptions | None, fields: dict, defaults: dict) -> MethodOptions:
    if isinstance(method, MethodOptions):
        if fields:
            raise RelaxspecError("give method fields either in the MethodOptions or as keywords, not both")
        return method
    if method is None:
        method = defaults.get("method", {}).get("method", "ar")
    return methods.resolve(method, fields, defaults.get("presets"))


def _class_ids(classes, target, defaults: dict) -> list[int]:
    names = target.class_names
    if classes is None:
        classes = defaults.get("classes")
        if classes is None:
            raise RelaxspecError("give the classes to draw (this model has no demo classes)")
    if names is not None:
        from relaxspec.data.emoji import resolve_classes

        ids = resolve_classes(classes, names)
    else:
        parts = classes.split(",") if isinstance(classes, str) else list(classes)
        try:
            ids = [int(c) for c in parts if str(c).strip()]
        except ValueError:
            raise RelaxspecError(f"this model does not name its classes: give class ids, got {classes!r}") from None
    num = target.config.num_classes
    bad = [c for c in ids if not 0 <= c < num]
    if bad:
        raise RelaxspecError(f"class id {bad[0]} is out of range: this model has classes 0..{num - 1}")
    if not ids:
        raise RelaxspecError("no classes given")
    return ids
