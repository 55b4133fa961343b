"""LlamaGen pipelines (arXiv 2406.06525): class-conditional (c2i), text-to-image with Flan-T5
prompts (t2i), and the embedded emoji model, a c2i pipeline with its own defaults and presets."""

from __future__ import annotations

import sys
from pathlib import Path
import dataclasses
import torch

from relaxspec.conditions import Condition, check_prompts, class_condition
from relaxspec.errors import RelaxspecError
from relaxspec.pipelines.base import ImagePipeline
from relaxspec.pipelines.families import OpeningInput, check_inputs, refuse_other
from relaxspec.models.llamagen.gpt import GPT_SIZES
from relaxspec.models.llamagen.vq import VQ_CONFIGS
from relaxspec.models.llamagen.checkpoints import load_vq, load_gpt, is_gpt_folder
from relaxspec.drafting.eagle import load_drafter
from relaxspec import embedded
from relaxspec.models.llamagen.hf_layout import is_lantern_folder
from relaxspec.models.llamagen.prompts import encode_prompts

#: Upstream LlamaGen's c2i demo classes (sample_c2i.py), for a model that names none of its own.
DEFAULT_CLASSES = "207,360,387,974,88,979,417,279"


def spec_id(spec: str | None) -> str | None:
    """A model name as given, a JSON config file as its resolved path (what a run records)."""
    return str(Path(spec).resolve()) if spec and spec not in GPT_SIZES and spec not in VQ_CONFIGS else spec


def _gpt_sizes() -> str:
    return ", ".join(GPT_SIZES)


def _vq_names() -> str:
    return ", ".join(VQ_CONFIGS)


class LlamaGenPipeline(ImagePipeline):
    """The LlamaGen family: a GPT file or folder and its VQ tokenizer's file, opened by
    ``gpt_ckpt`` (or a LlamaGen model folder given as ``--model-path``: relaxspec's, or official
    LANTERN's converted LlamaGen-T2I). Whether it draws classes (:class:`LlamaGenC2I`) or prompts
    (:class:`LlamaGenT2I`) its weights say."""

    family = "LlamaGen"
    takes = None
    opened_with = "--gpt-ckpt"
    called = "a LlamaGen checkpoint"
    usage = ("a LlamaGen target: relaxspec generate --gpt-ckpt PATH --vq-ckpt PATH (--gpt-model NAME for an "
             "official file; a t2i one with --t5-path DIR or --caption-features)")
    inputs = (
        OpeningInput("gpt_ckpt", "GPT weights: official .pt/.pth, .safetensors, a relaxspec model folder or official "
                                 "LANTERN's LlamaGen folder (default: the embedded emoji model, with its tokenizer and "
                                 "drafter)", metavar="PATH", opens=True),
        OpeningInput("gpt_model", f"named size ({_gpt_sizes()}), or a JSON file of GPTConfig fields (or upstream's "
                                  "ModelArgs) for other sizes; needed for official files (the head count is not in "
                                  "the weights)", kind="text", metavar="NAME|JSON"),
        OpeningInput("vq_ckpt", "the VQ tokenizer's weights that go with the GPT", metavar="PATH"),
        OpeningInput("vq_model", f"named tokenizer ({_vq_names()}) or a JSON file of VQConfig fields (or upstream's "
                                 "ModelArgs) (default VQ-16)", kind="text", metavar="NAME|JSON", default="VQ-16"),
        OpeningInput("downsample", "the tokenizer's downsampling factor, for an official GPT file opened without its "
                                   "VQ (train-drafter; with --vq-ckpt the VQ's own is used)", kind="int", metavar="N",
                     default=16),
        OpeningInput("t5_path", "the local Flan-T5 folder (save_pretrained layout) that encodes a t2i model's "
                                "prompts, as upstream LlamaGen's", needs="transformers"),
    )

    @classmethod
    def claims_folder(cls, path) -> bool:
        """relaxspec's own GPT folders and official LANTERN's LlamaGen folders."""
        return is_lantern_folder(path) or is_gpt_folder(path)

    @classmethod
    def open(cls, opening, inputs: dict) -> ImagePipeline:
        inputs = dict(inputs)
        gpt = inputs.pop("gpt_ckpt", None)
        if opening.model_path is not None:
            gpt = opening.model_path
        if inputs.get("vq_ckpt") is None and not opening.with_tokenizer:  # no pixels needed: the GPT alone
            target = load_gpt(gpt, inputs.get("gpt_model"), image_size=opening.image_size,
                              downsample=_downsample(inputs), precision=opening.precision, device=opening.device)
            return llamagen_pipeline(target, None, None, **{k: v for k, v in inputs.items() if k == "t5_path"})
        if inputs.get("vq_ckpt") is None:
            if opening.model_path is not None:
                raise RelaxspecError(f"--model-path {opening.model_path} is a LlamaGen model: give --vq-ckpt PATH (its "
                                     "VQ tokenizer's weights), and for a t2i model --t5-path DIR or --caption-features")
            raise RelaxspecError("--vq-ckpt is required with --gpt-ckpt (the tokenizer that goes with the GPT)")
        return open_llamagen(gpt, drafter_ckpt=opening.drafter_ckpt, device=opening.device,
                             precision=opening.precision, image_size=opening.image_size, **inputs)


def _downsample(inputs: dict) -> int:
    """The tokenizer's downsampling factor for a GPT opened without its VQ: given, else
    upstream's 16."""
    return inputs["downsample"] if inputs.get("downsample") is not None else 16


def open_tokenizer(inputs: dict, device="cpu"):
    """The VQ tokenizer the LlamaGen family's ``inputs`` name (``vq_ckpt``, ``vq_model``), alone:
    for a target already in memory (train-drafter's ``images``)."""
    inputs = check_inputs(LlamaGenPipeline, inputs)
    if inputs.get("vq_ckpt") is None:
        raise RelaxspecError("--images are encoded by the target's VQ tokenizer: give --vq-ckpt PATH")
    return load_vq(inputs["vq_ckpt"], inputs.get("vq_model") or "VQ-16", device=device)


class LlamaGenC2I(LlamaGenPipeline):
    """A class-conditional LlamaGen transformer and its VQ tokenizer; classes by id, or by name
    when the checkpoint names them."""

    family = "LlamaGen c2i"
    takes = "classes"

    def _conditions(self, classes, prompts) -> Condition:
        if classes is None:
            classes = self.default_classes
            if classes is None:
                raise RelaxspecError("give the classes to draw (this model has no demo classes)")
        return class_condition(classes, self.target.config.num_classes, self.class_names)


class LlamaGenT2I(LlamaGenPipeline):
    """A text-to-image LlamaGen transformer: prompts encoded by a local Flan-T5 folder
    (``t5_path``), as upstream's ``sample_t2i.py`` does, or caption features given directly."""

    family = "LlamaGen t2i"
    takes = "prompts"

    def __init__(self, target, tokenizer, drafter=None, *, t5_path: str | None = None, **kwargs):
        super().__init__(target, tokenizer, drafter, **kwargs)
        self.t5_path = t5_path

    def _conditions(self, classes, prompts) -> Condition:
        if prompts is None:
            raise RelaxspecError("this is a text-to-image (t2i) model: give prompts (with a Flan-T5 folder, t5_path), "
                                 "or caption features")
        return self.encode(check_prompts(prompts))

    def encode(self, prompts: list[str]) -> Condition:
        """Prompts -> left-padded T5 features and mask (:mod:`relaxspec.models.llamagen.prompts`)."""
        if not self.t5_path:
            raise RelaxspecError("encoding prompts needs --t5-path DIR / t5_path (a local Flan-T5 folder, as upstream "
                                 "LlamaGen uses), or give precomputed --caption-features")
        config = self.target.config
        features, mask, lengths = encode_prompts(prompts, self.t5_path, max_length=config.cls_token_num,
                                                 device=self.device)
        if features.shape[-1] != config.caption_dim:
            raise RelaxspecError(f"--t5-path {self.t5_path}: its features have {features.shape[-1]} dimensions, but "
                                 f"this model reads {config.caption_dim}: not the text encoder it was trained with")
        for i, length in enumerate(lengths):
            if length > config.cls_token_num:
                print(f"relaxspec: prompt {i + 1} has {length} tokens; the model reads {config.cls_token_num}, so it "
                      "is cut (as upstream)", file=sys.stderr)
        return Condition(features.cpu(), mask.cpu(), [{"prompt": p} for p in prompts],
                         {"prompts": list(prompts), "t5_path": str(Path(self.t5_path).resolve())})

    def conditions_hint(self) -> str:
        config = self.target.config
        if self.t5_path:
            return "--t5-path encodes prompts: give --prompt TEXT or --prompts-file FILE"
        return (f"give --prompt TEXT with --t5-path DIR, or --caption-features PATH.npy (caption features "
                f"[N, {config.cls_token_num}, {config.caption_dim}], e.g. Flan-T5-XL outputs)")

    def feature_condition(self, features: torch.Tensor, mask: torch.Tensor | None, source: str) -> Condition:
        """Precomputed caption features ``[N, C, caption_dim]`` (and mask ``[N, C]``), checked."""
        config = self.target.config
        expected = (config.cls_token_num, config.caption_dim)
        if tuple(features.shape[1:]) != expected:
            raise RelaxspecError(f"--caption-features {source}: shape {tuple(features.shape)}, but this model needs "
                                 f"[N, {expected[0]}, {expected[1]}]")
        if mask is not None and tuple(mask.shape) != tuple(features.shape[:2]):
            raise RelaxspecError(f"caption mask shape {tuple(mask.shape)} does not match the features' "
                                 f"{tuple(features.shape[:2])}")
        return Condition(features, mask, [{"caption": i} for i in range(features.shape[0])],
                         {"caption_features": str(Path(source).resolve()), "captions": int(features.shape[0]),
                          "caption_mask": mask is not None})


def open_llamagen(gpt_ckpt, vq_ckpt, *, gpt_model: str | None = None, vq_model: str | None = "VQ-16",
                  t5_path: str | None = None, downsample: int | None = None, drafter_ckpt=None, device="cpu", precision: str = "fp32",
                  image_size: int | None = None, sampling: dict | None = None, presets: dict | None = None,
                  default_method: str = "ar", default_classes=None, family: str | None = None) -> ImagePipeline:
    """A LlamaGen checkpoint pair (official files or relaxspec folders) as its pipeline."""
    if vq_ckpt is None:
        raise RelaxspecError("--vq-ckpt is required with --gpt-ckpt (the tokenizer that goes with the GPT)")
    vq = load_vq(vq_ckpt, vq_model or "VQ-16", device=device)
    downsample = vq.config.downsample_factor  # the VQ's own (a --downsample given beside it is not read)
    if image_size is not None and image_size % downsample:
        raise RelaxspecError(f"--image-size {image_size} is not a multiple of the tokenizer's downsampling {downsample}")
    target = load_gpt(gpt_ckpt, gpt_model, image_size=image_size, downsample=downsample, precision=precision,
                      device=device)
    if target.config.vocab_size != vq.config.codebook_size:
        raise RelaxspecError(f"the GPT's vocabulary ({target.config.vocab_size}) does not match the VQ codebook "
                             f"({vq.config.codebook_size}): they are not a pair")
    drafter = load_drafter(drafter_ckpt, target) if drafter_ckpt is not None else None
    identity = {"gpt_ckpt": str(Path(gpt_ckpt).resolve()), "gpt_model": spec_id(gpt_model),
                "gpt_config": target.config.to_dict(), "vq_ckpt": str(Path(vq_ckpt).resolve()),
                "vq_model": spec_id(vq_model or "VQ-16"), "vq_config": _asdict(vq.config)}
    kwargs = dict(sampling=sampling, presets=presets, default_method=default_method, identity=identity)
    if target.config.model_type == "c2i":
        if t5_path is not None:
            raise RelaxspecError("this is a class-conditional (c2i) model: give --classes, not prompts")
        if default_classes is None and target.config.num_classes > 979:
            default_classes = DEFAULT_CLASSES
        pipeline = LlamaGenC2I(target, vq, drafter, default_classes=default_classes, **kwargs)
    else:
        pipeline = LlamaGenT2I(target, vq, drafter, t5_path=t5_path, **kwargs)
    if family is not None:
        pipeline.family = family
    pipeline.drafter_path = None if drafter_ckpt is None else str(drafter_ckpt)
    pipeline.files = {"gpt_ckpt": str(gpt_ckpt), "vq_ckpt": str(vq_ckpt)}
    return pipeline


def llamagen_pipeline(target, vq=None, drafter=None, **inputs) -> ImagePipeline:
    """The pipeline around a LlamaGen target already in memory (with its VQ and drafter, either may
    be ``None``: one without a VQ formats conditions and paints nothing), its family's ``inputs``
    (a t2i target's ``t5_path``) checked as :func:`~relaxspec.pipelines.open_pipeline` checks them."""
    inputs = check_inputs(LlamaGenPipeline, inputs)
    for name in inputs:
        if name != "t5_path":
            raise RelaxspecError(f"--{name.replace('_', '-')}: a model in memory is opened already")
    if target.config.model_type == "c2i":
        if inputs:
            refuse_other("t5_path", "a class-conditional LlamaGen model (c2i)")
        return LlamaGenC2I(target, vq, drafter)
    return LlamaGenT2I(target, vq, drafter, **inputs)


def open_embedded(*, drafter_ckpt=None, device="cpu", precision: str = "fp32", with_drafter: bool = True):
    """The embedded emoji model (a LlamaGen c2i pipeline) with its shipped drafter, sampling
    defaults, tuned presets, default method and demo classes (``embedded/defaults.json``)."""
    defaults = embedded.defaults()
    if drafter_ckpt is None and with_drafter and embedded.available("drafter"):
        drafter_ckpt = embedded.path("drafter")
    return open_llamagen(embedded.path("gpt"), embedded.path("vq"), drafter_ckpt=drafter_ckpt,
                         device=device, precision=precision, sampling=defaults.get("sampling"),
                         presets=defaults.get("presets"), default_method=defaults.get("method", {}).get("method", "ar"),
                         default_classes=defaults.get("classes"), family="the embedded emoji model (LlamaGen c2i)")


def _asdict(config) -> dict:
    return dataclasses.asdict(config)


__all__ = ["DEFAULT_CLASSES", "LlamaGenC2I", "LlamaGenPipeline", "LlamaGenT2I", "llamagen_pipeline", "open_embedded", "open_llamagen", "open_tokenizer",
           "spec_id"]
