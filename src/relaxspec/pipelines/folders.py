"""Pipelines for transformers model folders (``save_pretrained`` layout, safetensors): the model
module of a family (:mod:`relaxspec.models.janus`, :mod:`~relaxspec.models.emu3`,
:mod:`~relaxspec.models.lumina`) opens the folder; :class:`FolderPipeline` holds what it opened and
formats prompts for it. A family's pipeline file names its model module and what users read."""

from __future__ import annotations

import importlib
from pathlib import Path


from relaxspec.conditions import Condition, check_prompts
from relaxspec.errors import RelaxspecError
from relaxspec.pipelines.base import ImagePipeline
from relaxspec.pipelines.families import check_inputs
from relaxspec.drafting.eagle import load_drafter
from relaxspec.models.weights import PRECISIONS

#: Prompt tokens a folder is opened for when no prompts are given yet (the demo, a notebook):
#: any prompt up to this length then decodes; padding is masked and does not change the law.
DEFAULT_PROMPT_TOKENS = 128


class FolderPipeline(ImagePipeline):
    """A text-to-image model from a transformers folder. Subclasses set ``family`` and ``MODEL``
    (the model module's import path)."""

    takes = "prompts"
    opened_with = "--model-path"
    FOLDER = True  # found by its config.json model_type (relaxspec.pipelines.families)
    MODEL = ""  # the model module's import path

    @classmethod
    def open(cls, opening, inputs: dict) -> "FolderPipeline":
        return open_folder(cls, opening.model_path, prompts=opening.prompts, prompt_length=opening.prompt_length,
                           drafter_ckpt=opening.drafter_ckpt, device=opening.device, precision=opening.precision,
                           image_size=opening.image_size, **inputs)

    def __init__(self, opened, model_module, drafter=None, *, path, sampling: dict | None = None):
        identity = {"model_path": str(Path(path).resolve()), "model_type": model_module.MODEL_TYPE,
                    "model_config": vars(opened.target.config), "vq_config": vars(opened.tokenizer.config)}
        super().__init__(opened.target, opened.tokenizer, drafter, sampling=sampling, identity=identity)
        self.opened, self.model_module, self.path = opened, model_module, str(path)
        self.first_prompts = list(opened.record.get("prompts", []))

    @property
    def image_size(self) -> int:
        return self.opened.image_size

    @property
    def prompt_tokens(self) -> int:
        return self.target.config.condition_length

    def _conditions(self, classes, prompts) -> Condition:
        if prompts is None:
            raise RelaxspecError(f"this {self.family} model takes text prompts: give prompts (--prompt TEXT)")
        prompts = check_prompts(prompts)
        if prompts == self.first_prompts:
            cond, mask = self.opened.cond, self.opened.cond_mask
        else:
            cond, mask = self.opened.format(prompts)
        settings = {**self.opened.record, "prompts": prompts}
        return Condition(cond, mask, [{"prompt": p} for p in prompts], settings)



def open_folder(pipeline_class: type[FolderPipeline], path, *, prompts=None, prompt_length: int | None = None,
                drafter_ckpt=None, device="cpu", precision: str = "fp32", image_size: int | None = None,
                **inputs) -> FolderPipeline:
    """Open a folder of ``pipeline_class``'s family for ``prompts`` (or, without them, for prompts
    of up to ``prompt_length`` tokens, :data:`DEFAULT_PROMPT_TOKENS` by default). ``inputs``: the
    family's own opening inputs (``pipeline_class.inputs``), passed to its model module's
    ``open_folder`` by name."""
    inputs = check_inputs(pipeline_class, inputs)
    module = importlib.import_module(pipeline_class.MODEL)
    if prompts is None:
        prompts, prompt_length = ["a picture"], prompt_length or DEFAULT_PROMPT_TOKENS
    prompts = check_prompts(prompts)
    opened = module.open_folder(path, prompts, device=device, dtype=PRECISIONS[precision], image_size=image_size,
                                prompt_length=prompt_length, **inputs)
    drafter = load_drafter(drafter_ckpt, opened.target) if drafter_ckpt is not None else None
    pipeline = pipeline_class(opened, module, drafter, path=path, sampling=module.sampling_defaults(path))
    pipeline.drafter_path = None if drafter_ckpt is None else str(drafter_ckpt)
    pipeline.files = {"model_path": str(path)}
    record_inputs(pipeline, inputs)
    return pipeline


def record_inputs(pipeline: ImagePipeline, inputs: dict) -> None:
    """What a run records of the path inputs a folder pipeline was opened with: resolved in its
    identity and among its files, whose identities a run keeps. A text input is the family's to
    record (in its conditions' settings)."""
    kinds = {declared.name: declared.kind for declared in pipeline.inputs}
    for name, value in inputs.items():
        if kinds[name] == "path":
            pipeline.identity[name] = str(Path(value).resolve())
            pipeline.files[name] = str(value)
