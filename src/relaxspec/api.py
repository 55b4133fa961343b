"""``relaxspec.generate``: images from classes or prompts in one call.

It is ``relaxspec generate`` without files, through the same pipeline
(:func:`relaxspec.pipelines.open_pipeline`): the same defaults (the embedded emoji model with its
documented sampling and method when no model is given, the model's own otherwise), the same
seeding (all conditions form batch 0 of a run seeded ``seed``, so the tokens equal ``relaxspec
generate --batch-size N --seed S`` for the same N conditions), and the same checks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import torch

from relaxspec.decoding import DecodeResult
from relaxspec.errors import RelaxspecError
from relaxspec.inputs import check_seed, check_upscale
from relaxspec.methods import MethodOptions
from relaxspec.pipelines import UPSTREAM_SAMPLING, ImagePipeline, open_pipeline
from relaxspec.pipelines.families import opening_inputs
from relaxspec.pipelines.llamagen import llamagen_pipeline
from relaxspec.pipelines.open import choose_family
from relaxspec.sampling import SamplingConfig, batch_seed
from relaxspec.models.llamagen.gpt import Transformer
from relaxspec.models.llamagen.vq import VQModel
from relaxspec.pipelines.presets import with_preset

__all__ = ["Generation", "UPSTREAM_SAMPLING", "generate", "pipeline_of"]


class Generation(NamedTuple):
    """What :func:`generate` returns: ``images`` (one ``PIL.Image`` per condition, in order) and
    the decode's ``result`` (tokens, accepted lengths, forwards, TV record, timings)."""

    images: list
    result: DecodeResult


@functools.lru_cache(maxsize=2)
def _embedded(device: str, precision: str) -> ImagePipeline:
    return open_pipeline(device=device, precision=precision)


def pipeline_of(model: tuple | ImagePipeline, **inputs) -> ImagePipeline:
    """A pipeline from ``(target, vq, drafter)`` already in memory (LlamaGen-format models; the
    drafter may be ``None``; ``inputs``: a t2i target's ``t5_path``), or the pipeline itself."""
    if isinstance(model, ImagePipeline):
        return model
    if not isinstance(model, (tuple, list)) or len(model) != 3:
        raise RelaxspecError("model must be (target, vq, drafter) or a pipeline; drafter may be None")
    target, vq, drafter = model

    if not isinstance(target, Transformer) or not isinstance(vq, VQModel) or \
            (drafter is not None and not isinstance(drafter, torch.nn.Module)):
        raise RelaxspecError(f"model=(target, vq, drafter) takes a LlamaGen-format Transformer, its VQModel and an "
                             f"EAGLE drafter or None (relaxspec.models.llamagen.checkpoints.load_gpt / load_vq), got "
                             f"({', '.join(type(part).__name__ for part in model)}); a transformers folder of a family relaxspec "
                             "opens is model_path=DIR, any other model a pipeline (relaxspec.pipelines.open_pipeline)")
    return llamagen_pipeline(target, vq, drafter, **inputs)


def generate(classes: str | Sequence[int | str] | None = None, method: str | MethodOptions | None = None, *,
             model: tuple | ImagePipeline | None = None, sampling: SamplingConfig | dict | None = None, seed: int = 0,
             device: str | torch.device | None = None, precision: str | None = None, upscale: int = 1,
             progress: bool = False, prompts: Sequence[str] | None = None, model_path: str | None = None,
             drafter_ckpt: str | None = None, image_size: int | None = None, preset: str | None = None,
             **fields) -> Generation:
    """Generate one image per class (or per prompt, for a text-to-image model).

    ``classes``: class ids, or names for a model that names its classes (``"heart,animal-mammal"``
    or a list); default: the model's demo classes. ``method``: a method name (``"ar"``,
    ``"lantern"``, ``"lantern++"``, ``"cool"``, ``"sd"``, ``"sjd"``, ``"scd"``, ``"gsd"``,
    ``"eagle2"``) or a :class:`MethodOptions`; ``fields`` set its fields (``delta=0.2``,
    ``compile=True``); default: the model's default method (the embedded model's is in its
    ``defaults.json``). ``sampling``: a :class:`SamplingConfig` or a dict of its fields over the
    model's defaults. ``upscale``: enlarge each image that many times (nearest neighbour).

    The model: by default the embedded one, loaded once per ``device`` (default cpu) and
    ``precision`` (default fp32); ``model``: a pipeline (:func:`relaxspec.pipelines.open_pipeline`)
    or ``(target, vq, drafter)`` in memory, with ``prompts`` and ``t5_path`` (a local Flan-T5
    folder) for a LlamaGen t2i target; ``model_path``: a model folder any family claims,
    or a family's files by its opening inputs (LlamaGen's weights and VQ files, ...), opened
    as ``relaxspec generate`` opens them (for ``prompts``), with ``drafter_ckpt`` and
    ``image_size``. A family's opening inputs (``tokenizer_path`` for Lumina-mGPT,
    ``negative_prompt`` for Emu3, :mod:`relaxspec.pipelines.families`) are keywords: every keyword
    that is not one is a method field.

    ``preset``: a preset file written by ``relaxspec tune`` for this model on this kind of machine
    (:mod:`relaxspec.pipelines.presets`): its method and settings become the default method (its
    sampling the default sampling); ``method_fields`` still set fields over it. A preset made for
    another model or machine is refused.
    """
    check_upscale(upscale)  # and the output side, once the model's image size is known
    check_seed(seed)
    if preset is not None and method is not None:
        raise RelaxspecError("a preset names its method: give preset or method, not both")
    known = opening_inputs()
    inputs = {name: fields.pop(name) for name in list(fields) if name in known and fields[name] is not None}
    method_fields = {name: value for name, value in fields.items() if name not in known}
    family = None if model is not None else choose_family(model_path, inputs)  # the inputs checked against it
    if family is not None:  # a model folder, or a file family's files: opened as the commands open them
        if family.takes == "prompts" and (classes is not None or not prompts or isinstance(prompts, str)):
            raise RelaxspecError(f"this {family.family} model takes text prompts: give prompts=[...] (a list of texts), "
                                 "not classes")
        pipeline = open_pipeline(model_path, prompts=None if prompts is None else list(prompts),
                                 drafter_ckpt=drafter_ckpt, device=device or "cpu", precision=precision or "fp32",
                                 image_size=image_size, **inputs)
    else:
        if drafter_ckpt is not None or image_size is not None:
            raise RelaxspecError("drafter_ckpt and image_size go with model_path or a model's files")
        if model is None:
            if prompts is not None:
                raise RelaxspecError("the embedded model is class-conditional: give classes, not prompts")
            pipeline = _embedded(str(device or "cpu"), precision or "fp32")
        else:
            if model_path is not None:
                raise RelaxspecError("give model or model_path, not both")
            if device is not None or precision is not None:
                raise RelaxspecError("device and precision apply to the embedded model; load your own model on the "
                                     "device and in the precision you want")
            if isinstance(model, ImagePipeline):  # opened already, with its inputs
                if inputs:
                    raise RelaxspecError(f"{', '.join(sorted(inputs))}: a pipeline is opened with its inputs; give them "
                                         "to open_pipeline")
                pipeline = model
            else:
                pipeline = pipeline_of(model, **inputs)
    if preset is not None:
        pipeline = with_preset(pipeline, preset)
    condition = pipeline.conditions(classes=classes, prompts=None if prompts is None else list(prompts))
    options = pipeline.method(method, method_fields)
    check_upscale(upscale, pipeline.image_size)
    generator = torch.Generator(device=pipeline.device).manual_seed(batch_seed(seed, 0))
    result = pipeline.generate(condition, options, pipeline.sampling(sampling), generator=generator, progress=progress)
    return Generation(pipeline.images(result.tokens, upscale), result)
