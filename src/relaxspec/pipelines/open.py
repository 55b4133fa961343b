"""``open_pipeline``: the one front door from what a user has to a pipeline.

* nothing: the embedded emoji model (with its drafter, defaults and presets);
* ``gpt_ckpt`` + ``vq_ckpt`` (+ ``t5_path`` for prompts): a LlamaGen checkpoint pair;
* ``model_path``: a transformers folder, whose ``config.json`` ``model_type`` picks the family
  (:mod:`relaxspec.pipelines.families`; Anole and Lumina-mGPT, both ``chameleon``, by whether the
  weights hold the VQ decoder).

A family's own inputs (``t5_path``, ``tokenizer_path``, ``negative_prompt``, a plugin's) are
keywords too, checked against what the family declares.
"""

from __future__ import annotations

import importlib

import torch

from relaxspec.devices import resolve_device
from relaxspec.errors import RelaxspecError
from relaxspec.pipelines.base import ImagePipeline
from relaxspec.pipelines.families import (FOLDER_PIPELINES, all_families, check_inputs, folder_entries,
                                          pipeline_class, pipeline_classes)

def folder_pipeline_class(model_path):
    """The pipeline class of a model folder, from its ``model_type`` (one-line errors)."""
    from relaxspec.models.hf import read_config
    from relaxspec.models.llamagen.hf_layout import is_lantern_folder

    if is_lantern_folder(model_path):  # a LlamaGen model: its VQ and text encoder are not in the folder
        raise RelaxspecError(f"{model_path} is official LANTERN's LlamaGen folder: open it as LlamaGen weights, "
                             f"--gpt-ckpt {model_path} --vq-ckpt vq_ds16_t2i.pt, with --t5-path FLAN_T5_DIR or "
                             "--caption-features (docs/models/lantern.md)")
    model_type = read_config(model_path).get("model_type")
    entries = folder_entries()
    if model_type not in entries:
        names = ", ".join(f"{t} ({' or '.join(c.family for c in pipeline_classes(t))})" for t in entries)
        raise RelaxspecError(f"{model_path}: model type {model_type!r} is not supported ({names} are)")
    *claimants, rest = pipeline_classes(model_type)
    return next((candidate for candidate in claimants if candidate.claims(model_path)), rest)


def model_module(model_path):
    """The model module of a folder's family (:mod:`relaxspec.models.janus`, ...)."""
    return importlib.import_module(folder_pipeline_class(model_path).MODEL)


def folder_sampling(model_path) -> dict:
    """A model folder's sampling defaults (its ``generation_config.json``, else its family's
    documented recipe, over upstream LlamaGen's), without loading the weights."""
    from relaxspec.pipelines.base import UPSTREAM_SAMPLING

    return {**UPSTREAM_SAMPLING, **model_module(model_path).sampling_defaults(model_path)}


def open_pipeline(*, gpt_ckpt=None, gpt_model: str | None = None, vq_ckpt=None, vq_model: str | None = "VQ-16",
                  model_path=None, drafter_ckpt=None, device: str | torch.device = "cpu", precision: str = "fp32",
                  image_size: int | None = None, prompts=None, prompt_length: int | None = None,
                  with_drafter: bool = True, **inputs) -> ImagePipeline:
    """The pipeline for what the user has (see the module docstring). ``drafter_ckpt``: an EAGLE
    drafter trained for the target (the embedded model brings its own; ``with_drafter=False``
    leaves it out). ``prompts`` / ``prompt_length``: what a transformers folder is opened for
    (its target is made for a prompt length). ``inputs``: the family's own opening inputs
    (:attr:`ImagePipeline.inputs`; ``None`` values are left out). Every argument is checked with a
    one-line error."""
    from relaxspec.models.llamagen.checkpoints import PRECISIONS

    if precision not in PRECISIONS:
        raise RelaxspecError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1):
        raise RelaxspecError(f"image size must be a whole number >= 1, got {image_size!r}")
    device = resolve_device(str(device), "--device")
    if model_path is not None:
        if gpt_ckpt is not None or vq_ckpt is not None or gpt_model is not None:
            raise RelaxspecError("--model-path is a whole model: leave out --gpt-ckpt / --vq-ckpt / --gpt-model")
        from relaxspec.pipelines.folders import open_folder

        family = folder_pipeline_class(model_path)
        return open_folder(family, model_path, prompts=prompts, prompt_length=prompt_length, drafter_ckpt=drafter_ckpt,
                           device=device, precision=precision, image_size=image_size, **check_inputs(family, inputs))
    from relaxspec.pipelines.llamagen import LlamaGenC2I, LlamaGenT2I, open_embedded, open_llamagen

    if gpt_ckpt is not None:
        return open_llamagen(gpt_ckpt, vq_ckpt, gpt_model=gpt_model, vq_model=vq_model, drafter_ckpt=drafter_ckpt,
                             device=device, precision=precision, image_size=image_size,
                             **check_inputs(LlamaGenT2I, inputs, "a LlamaGen checkpoint"))
    if vq_ckpt is not None or gpt_model is not None:
        raise RelaxspecError("--vq-ckpt / --gpt-model go with --gpt-ckpt; without it the embedded model is used")
    check_inputs(LlamaGenC2I, inputs, "the embedded model (class-conditional)")  # the embedded model is class-conditional: it takes none
    if image_size is not None:
        raise RelaxspecError("--image-size: the embedded model's image size is fixed (32 px)")
    return open_embedded(drafter_ckpt=drafter_ckpt, device=device, precision=precision, with_drafter=with_drafter)


__all__ = ["FOLDER_PIPELINES", "all_families", "folder_pipeline_class", "folder_sampling", "model_module",
           "open_pipeline", "pipeline_class", "pipeline_classes"]
