"""``open_pipeline``: the one front door from what a user has to a pipeline, and the one place
that decides which family opens it.

* nothing: the embedded emoji model (with its drafter, defaults and presets);
* ``model_path``: a model folder: a file family that claims it (LlamaGen's own folders and
  official LANTERN's, with their VQ and text inputs), else the transformers family its
  ``config.json`` ``model_type`` names (Anole and Lumina-mGPT, both ``chameleon``, by whether the
  weights hold the VQ decoder);
* a file family's opening inputs (LlamaGen's weights file, with its VQ file and the rest).

Every family's inputs are keywords, checked against what the family declares
(:mod:`relaxspec.pipelines.families`); what every family shares (device, precision, image size,
drafter, prompts a folder is opened for) is an :class:`~relaxspec.pipelines.families.Opening`.
"""

from __future__ import annotations

import importlib

import torch

from relaxspec.devices import resolve_device
from relaxspec.errors import RelaxspecError
from relaxspec.pipelines.base import ImagePipeline, UPSTREAM_SAMPLING
from relaxspec.pipelines.families import (FOLDER_PIPELINES, Opening, all_families, check_inputs, file_families,
                                          folder_entries, is_folder_family, known_inputs, pipeline_class,
                                          pipeline_classes, refuse_other)
from relaxspec.models.hf import read_config
from relaxspec.models.weights import PRECISIONS
from relaxspec.pipelines.families import opening_inputs
from relaxspec.pipelines.llamagen import open_embedded

#: What messages call the model opened when no family is named.
EMBEDDED = "the embedded model (class-conditional)"


def folder_pipeline_class(model_path):
    """The family of a model folder: a file family that claims it, else the one its
    ``model_type`` names (one-line errors)."""
    for family in file_families():
        if family.claims_folder(model_path):
            return family
    model_type = read_config(model_path).get("model_type")
    entries = folder_entries()
    if model_type not in entries:
        names = ", ".join(f"{t} ({' or '.join(c.family for c in pipeline_classes(t))})" for t in entries)
        raise RelaxspecError(f"{model_path}: model type {model_type!r} is not supported ({names} are)")
    *claimants, rest = pipeline_classes(model_type)
    return next((candidate for candidate in claimants if candidate.claims(model_path)), rest)


def choose_family(model_path=None, inputs: dict | None = None):
    """The family that opens ``model_path`` or the given family ``inputs`` (``None``: the embedded
    model), with the inputs checked against it (one-line errors); no weights are read."""
    given = known_inputs(inputs or {})
    openers = [f for f in file_families() if any(i.opens and i.name in given for i in f.inputs)]
    if model_path is not None:
        if openers:
            named = [i.flag for f in openers for i in f.inputs if i.opens and i.name in given]
            raise RelaxspecError(f"--model-path is a whole model: leave out {' / '.join(named)}")
        family = folder_pipeline_class(model_path)
    elif len(openers) > 1:
        raise RelaxspecError(f"{' and '.join(f.opened_with for f in openers)} name models of two families: give one")
    elif openers:
        family = openers[0]
    else:
        for name in given:
            refuse_other(name, EMBEDDED)
        return None
    check_inputs(family, given)
    return family


def model_module(model_path):
    """The model module of a folder's family (:mod:`relaxspec.models.janus`, ...)."""
    return importlib.import_module(folder_pipeline_class(model_path).MODEL)


def folder_sampling(model_path) -> dict:
    """A model folder's sampling defaults (its ``generation_config.json``, else its family's
    documented recipe, over upstream LlamaGen's), without loading the weights; ``{}`` beyond
    upstream's for a file family's folder (its pipeline brings its own)."""
    family = folder_pipeline_class(model_path)
    own = importlib.import_module(family.MODEL).sampling_defaults(model_path) if is_folder_family(family) else {}
    return {**UPSTREAM_SAMPLING, **own}


def open_pipeline(model_path=None, *, drafter_ckpt=None, device: str | torch.device = "cpu", precision: str = "fp32",
                  image_size: int | None = None, prompts=None, prompt_length: int | None = None,
                  with_drafter: bool = True, with_tokenizer: bool = True, **inputs) -> ImagePipeline:
    """The pipeline for what the user has (see the module docstring). ``drafter_ckpt``: an EAGLE
    drafter trained for the target (the embedded model brings its own; ``with_drafter=False``
    leaves it out). ``prompts`` / ``prompt_length``: what a transformers folder is opened for
    (its target is made for a prompt length). ``with_tokenizer=False``: no pixels are needed (a
    family may leave out an image tokenizer of its own files). ``inputs``: the family's opening
    inputs (LlamaGen's files, ``tokenizer_path``, ``negative_prompt``, ...; ``None`` values are left
    out).
    Every argument is checked with a one-line error."""
    if precision not in PRECISIONS:
        raise RelaxspecError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1):
        raise RelaxspecError(f"image size must be a whole number >= 1, got {image_size!r}")
    device = resolve_device(str(device), "--device")
    family = choose_family(model_path, inputs)
    opening = Opening(model_path=None if model_path is None else str(model_path),
                      drafter_ckpt=None if drafter_ckpt is None else str(drafter_ckpt), device=device,
                      precision=precision, image_size=image_size, prompts=None if prompts is None else list(prompts),
                      prompt_length=prompt_length, with_drafter=with_drafter, with_tokenizer=with_tokenizer)
    if family is None:
        if image_size is not None:
            raise RelaxspecError("--image-size: the embedded model's image size is fixed (32 px)")
        return open_embedded(drafter_ckpt=drafter_ckpt, device=device, precision=precision, with_drafter=with_drafter)
    return family.open(opening, known_inputs(inputs))


def reopen_pipeline(settings: dict, *, device=None, prompts=None) -> ImagePipeline:
    """The model a run's ``settings`` (stats.json) recorded, opened again as the run opened it:
    its folder or its family's inputs (recorded by their names), drafter, precision and image size."""
    folder = settings.get("model_path")
    inputs = {name: settings.get(name) for name, (declared, _) in opening_inputs().items()
              if not (folder is not None and declared.opens)}  # a folder stands for its family's files
    embedded = choose_family(folder, inputs) is None
    image_size = None if embedded else settings.get("image_size_given") if folder else settings.get("image_size")
    return open_pipeline(folder, drafter_ckpt=settings.get("drafter_ckpt"), device=device or settings.get("device", "cpu"),
                         precision=settings.get("precision", "fp32"), image_size=image_size, prompts=prompts, **inputs)


__all__ = ["EMBEDDED", "FOLDER_PIPELINES", "all_families", "choose_family", "folder_pipeline_class", "folder_sampling",
           "model_module", "open_pipeline", "pipeline_class", "pipeline_classes", "reopen_pipeline"]
