"""The pipeline: everything between the paths a user has and pixels, for one model family.

diffusers' idea for autoregressive image models. A pipeline owns its target, its image tokenizer
and (when there is one) its EAGLE drafter; its sampling defaults and method presets; how classes
or prompts become a :class:`~relaxspec.conditions.Condition`; the decode call for any method; and
how tokens become pixels. Commands, the Python API, bench and the demo take a pipeline and never
learn a family's details. :func:`relaxspec.pipelines.open_pipeline` is the one way to get one.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor
from PIL import Image

from relaxspec import methods
from relaxspec.conditions import Condition
from relaxspec.decoding import DecodeResult, decode, reserve
from relaxspec.errors import RelaxspecError
from relaxspec.methods import MethodOptions
from relaxspec.sampling import SamplingConfig
from relaxspec.models.weights import to_uint8 as saving_rule

#: Elements sampled (evenly strided) from each weight tensor for a fingerprint.
FINGERPRINT_ELEMENTS = 4096

#: Upstream LlamaGen's demo sampling (sample_c2i.py): what a model that brings no defaults gets.
UPSTREAM_SAMPLING = {"cfg_scale": 4.0, "temperature": 1.0, "top_k": 2000, "top_p": 1.0}


def to_uint8(pixels: Tensor) -> np.ndarray:
    """``[B, 3, H, W]`` in ``[-1, 1]`` -> uint8 ``[B, H, W, 3]``, rounded as LlamaGen saves images."""
    return saving_rule(pixels).cpu().numpy()


def weights_fingerprint(module) -> str | None:
    """A short content hash of a module's weights: every parameter's name, shape and an evenly
    strided sample of its values (as fp32 bytes on the host, so device and file location do not
    matter, and a fine-tune of any layer changes it). Configs are left out: a transformers
    family's target is opened for a prompt length, which is no property of the weights. ``None``
    for ``None``."""
    if module is None:
        return None
    digest = hashlib.sha256()
    for name, tensor in named_parameters(module):
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // FINGERPRINT_ELEMENTS)
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(flat[::stride][:FINGERPRINT_ELEMENTS].to("cpu", torch.float32).numpy().tobytes())
    return digest.hexdigest()[:16]


def named_parameters(obj) -> list:
    """A module's parameters, or those of the modules a wrapper holds (a transformers family's
    image tokenizer wraps the model's VQ part)."""
    if isinstance(obj, torch.nn.Module):
        return list(obj.named_parameters())
    found = []
    for attribute, value in sorted(vars(obj).items()):
        if isinstance(value, torch.nn.Module):
            found += [(f"{attribute}.{name}", tensor) for name, tensor in value.named_parameters()]
    return found


@dataclass
class PreparedDecode:
    """A method ready to decode on one pipeline (:meth:`ImagePipeline.prepare`): its options,
    checked against the model once (the sizes it uses set), its sampling, and the draft source and
    acceptance rule, built once, at the first decode (:meth:`parts`; a run with nothing left to
    decode builds nothing). Each part resets itself at the start of every decode, so one serves a
    whole run (generate's batches, bench's images, tune's rounds)."""

    options: MethodOptions
    sampling: SamplingConfig
    owner: object = None  # the pipeline that prepared it (it decodes only there)
    context: object = None  # what the parts are built from (a methods.BuildContext; None for AR)
    source: object = None
    rule: object = None

    def parts(self) -> tuple:
        """``(source, rule)``, built the first time (``(None, None)`` for plain AR): the parts
        :meth:`relaxspec.methods.base.Method.build` makes, the sizes checked when prepared."""
        if self.context is not None and self.source is None:
            self.source, self.rule = self.options.family.parts(self.options, self.context)
        return self.source, self.rule

    def reserve(self) -> None:
        """Size the model's caches for this method now (its parts built): a run that decodes
        several methods reserves them all before its first decode, so no method's compiled graphs
        are made at a cache size another method then grows (:func:`relaxspec.decoding.reserve`)."""
        reserve(self.owner.target, self.options, self.parts()[0])


class ImagePipeline(ABC):
    """A model family's target, tokenizer and drafter, with what it needs to turn conditions into
    images. The class is the family's contract with relaxspec (:mod:`relaxspec.pipelines.families`):

    * class attributes :attr:`family` (what users read), :attr:`takes` (``"classes"``,
      ``"prompts"``, or ``None`` where the model's files decide), :attr:`inputs` (what it opens its
      model with), :attr:`opened_with` (the flag that names one, for messages) and :attr:`usage`;
    * :meth:`open` (a classmethod: the pipeline for an :class:`~relaxspec.pipelines.families.Opening`
      and the family's inputs) and, for a file family that also opens folders,
      :meth:`claims_folder`;
    * :meth:`_conditions` (classes or prompts -> a :class:`Condition`); a family whose conditions
      can also come from a features file implements :meth:`feature_condition`.

    Args:
        target: a :class:`~relaxspec.models.base.TargetModel`.
        tokenizer: its :class:`~relaxspec.models.base.ImageTokenizer`.
        drafter: an EAGLE drafter attached to ``target``, or ``None``.
        sampling: the model's sampling defaults (fields of :class:`SamplingConfig`).
        presets: the model's own tuned setting per method name (``{}``: the registry's).
        default_method: the method a call without one uses.
        default_classes: the classes a call without conditions draws (class pipelines), or ``None``.
        identity: where the model came from, what a run records (paths, configs); its content is
            :meth:`fingerprint`.
    """

    family = "model"
    takes: str | None = "classes"
    #: What the family opens its model with (:class:`~relaxspec.pipelines.families.OpeningInput` s).
    inputs: tuple = ()
    #: The flag that opens a model of the family (what messages point to).
    opened_with = "--model-path"
    #: What `relaxspec info` says a model of this family is for.
    usage = ""
    #: What messages call a model of the family (default: :attr:`family`).
    called: str | None = None
    #: Whether the family is a folder family, found by its folder's model type
    #: (:class:`~relaxspec.pipelines.folders.FolderPipeline`).
    FOLDER = False

    @classmethod
    @abstractmethod
    def open(cls, opening, inputs: dict) -> "ImagePipeline":
        """The pipeline of the model ``opening`` and ``inputs`` (the family's own, checked against
        :attr:`inputs`) name; one-line errors."""

    @classmethod
    def claims_folder(cls, path) -> bool:
        """Whether a folder given as ``--model-path`` is this (file) family's; folder families are
        found by their model type instead."""
        return False

    def __init__(self, target, tokenizer, drafter=None, *, sampling: dict | None = None, presets: dict | None = None,
                 default_method: str = "ar", default_classes=None, identity: dict | None = None):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.sampling_defaults = {**UPSTREAM_SAMPLING, **(sampling or {})}
        self.presets = dict(presets or {})
        self.default_method = default_method
        self.default_classes = default_classes
        self.identity = dict(identity or {})
        self.drafter_path: str | None = None  # where the drafter was read from (openers set it)
        self.files: dict[str, str] = {}  # the files the model was read from, by role (openers set them)

    # ---------------------------------------------------------------- what it is
    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def grid(self) -> int:
        """Image tokens per side."""
        return self.target.config.grid_size

    @property
    def image_tokens(self) -> int:
        return self.target.config.block_size

    @property
    def image_size(self) -> int:
        """Pixels per side of a decoded image."""
        return self.grid * self.tokenizer.config.downsample_factor

    @property
    def class_names(self) -> list[str] | None:
        return getattr(self.target, "class_names", None)

    def fingerprint(self) -> dict:
        """The model's identity by content, what runs and presets are tied to: its family, image
        tokens, the weight fingerprints of the target, its image tokenizer (LANTERN's neighbours
        come from its codebook) and the drafter, and the dtype the target's weights run in (where
        the files lie does not matter; :attr:`identity` records that)."""
        first = next(iter(tensor for _, tensor in named_parameters(self.target)), None)
        return {"family": self.family, "image_tokens": self.image_tokens,
                "target": weights_fingerprint(self.target), "tokenizer": weights_fingerprint(self.tokenizer),
                "drafter": weights_fingerprint(self.drafter),
                "dtype": str(first.dtype).replace("torch.", "") if first is not None else None}

    def describe(self) -> str:
        return f"{self.family}, {self.image_size}-px images ({self.grid}x{self.grid} tokens)"

    # ---------------------------------------------------------------- conditions
    def conditions(self, classes=None, prompts: Sequence[str] | None = None) -> Condition:
        """Classes (names or ids) or prompts -> a :class:`Condition`, checked once here; with
        neither, the model's demo classes (a class pipeline that has them)."""
        if self.takes == "classes" and prompts is not None:
            raise RelaxspecError(f"this is a class-conditional model ({self.family}): give classes, not prompts")
        if self.takes == "prompts" and classes is not None:
            raise RelaxspecError(f"this is a text-to-image model ({self.family}): give prompts, not classes")
        return self._conditions(classes, prompts)

    @abstractmethod
    def _conditions(self, classes, prompts) -> Condition:
        """Classes or prompts (checked against :attr:`takes`) -> a :class:`Condition`."""

    def feature_condition(self, features: Tensor, mask: Tensor | None, source: str) -> Condition:
        """Precomputed condition features (``--caption-features``) -> a :class:`Condition`; a family
        whose model reads none refuses them in one line."""
        raise RelaxspecError(f"--caption-features: this {self.family} model reads no precomputed features; "
                             f"{self.conditions_hint()}")

    def conditions_hint(self) -> str:
        """What to give for this model's conditions (the end of a one-line refusal)."""
        if self.takes == "classes":
            return "give --classes"
        return "give --prompt TEXT (repeatable) or --prompts-file FILE"

    # ---------------------------------------------------------------- settings
    def sampling(self, sampling: SamplingConfig | dict | None = None, **overrides) -> SamplingConfig:
        """The model's sampling defaults with ``sampling`` (a :class:`SamplingConfig` is taken as
        it is) or ``overrides`` over them; ``None`` values keep the default."""
        if isinstance(sampling, SamplingConfig):
            if overrides:
                raise RelaxspecError("give sampling as a SamplingConfig or as fields, not both")
            return sampling
        if sampling is not None and not isinstance(sampling, dict):
            SamplingConfig.from_dict(sampling)  # the one-line refusal
        given = {**(sampling or {}), **overrides}
        return SamplingConfig.from_dict({**self.sampling_defaults,
                                         **{k: v for k, v in given.items() if v is not None}})

    def method(self, method: str | MethodOptions | None = None, fields: dict | None = None) -> MethodOptions:
        """A method name (the model's own preset of that name, then ``fields``; ``None``: the
        model's default method) or :class:`MethodOptions`, resolved, its drafter checked (its
        sizes are checked once, by :meth:`prepare`)."""
        if isinstance(method, MethodOptions):
            if fields:
                raise RelaxspecError("give method fields either in the MethodOptions or as keywords, not both")
            options = method
        else:
            options = methods.resolve(method or self.default_method, fields, self.presets)
        self._check_drafter(options)
        return options

    def check_fits(self, options: MethodOptions) -> None:
        """Refuse, with one line, a method whose sizes this model cannot use (a draft deeper or a
        window wider than its images, a tree past the node bound), before anything is decoded; and
        set the sizes it can use but not whole (LANTERN's ``k`` past the codebook, more rows than
        open at once) to what it uses, with a note in ``options.notes``."""
        context = methods.BuildContext(target=self.target, tokenizer=self.tokenizer)
        options.family.check_fits(options, context)
        options.family.use_effective(options, context)

    def prepare(self, options: MethodOptions | None = None, sampling: SamplingConfig | None = None) -> PreparedDecode:
        """``options`` (default: the model's default method) and ``sampling`` (default: the
        model's) ready to decode: the drafter checked, the sizes checked and set once
        (:meth:`check_fits`); the draft source and acceptance rule are built once, at the first
        decode (:meth:`PreparedDecode.parts`)."""
        options = options if options is not None else self.method()
        sampling = sampling if sampling is not None else self.sampling()
        self._check_drafter(options)
        self.check_fits(options)
        if options.method == "ar":
            return PreparedDecode(options, sampling, owner=self)
        context = methods.BuildContext(target=self.target, tokenizer=self.tokenizer,
                                       drafter=self.drafter if options.needs_drafter else None, sampling=sampling)
        return PreparedDecode(options, sampling, owner=self, context=context)

    def _check_drafter(self, options: MethodOptions) -> None:
        if options.needs_drafter and self.drafter is None:
            raise RelaxspecError(f"method {options.method!r} drafts with an EAGLE drafter and this model has none: "
                                 "give a drafter (relaxspec train-drafter trains one), or choose sjd, scd, sjd-pac "
                                 "or gsd")

    # ---------------------------------------------------------------- decoding and pixels
    def generate(self, condition: Condition, options: MethodOptions | PreparedDecode | None = None,
                 sampling: SamplingConfig | None = None, *, generator: torch.Generator | None = None,
                 progress: bool = False, on_step: Callable | None = None) -> DecodeResult:
        """Image tokens for every condition, with the method ``options`` names (default: the
        model's default method) and ``sampling`` (default: the model's), or a
        :class:`PreparedDecode` (:meth:`prepare`: the way a run of many decodes checks and builds
        its method once). Every decode of relaxspec's commands goes through here."""
        if isinstance(options, PreparedDecode):
            if sampling is not None:
                raise RelaxspecError("a PreparedDecode holds its sampling: give it or a sampling, not both")
            if options.owner is not self:
                raise RelaxspecError("this PreparedDecode was prepared by another pipeline: prepare it with this one")
            prepared = options
        else:
            prepared = self.prepare(options, sampling)
        condition = condition.to(self.device)
        chosen = prepared.options
        source, rule = prepared.parts()
        return decode(self.target, condition.cond, prepared.sampling, chosen, generator=generator,
                      drafter=self.drafter if chosen.needs_drafter else None, vq=self.tokenizer,
                      cond_mask=condition.mask, progress=progress, on_step=on_step, source=source, rule=rule)

    @torch.no_grad()
    def pixels(self, tokens: Tensor) -> np.ndarray:
        """Image tokens ``[B, N]`` -> uint8 pixels ``[B, H, W, 3]``: the tokenizer's decoding,
        converted by :meth:`to_uint8`."""
        return np.asarray(self.to_uint8(self.tokenizer.decode(tokens.to(self.device))))

    def to_uint8(self, decoded: Tensor) -> np.ndarray:
        """The tokenizer's output ``[B, 3, H, W]`` -> uint8 ``[B, H, W, 3]``: upstream LlamaGen's
        saving rule; a family whose official code converts its own way overrides it."""
        return to_uint8(decoded)

    def images(self, tokens: Tensor, upscale: int = 1) -> list:
        """Image tokens ``[B, N]`` -> PIL images, each enlarged ``upscale`` times (nearest neighbour)."""
        images = [Image.fromarray(p) for p in self.pixels(tokens)]
        if upscale > 1:
            images = [im.resize((im.width * upscale, im.height * upscale), Image.NEAREST) for im in images]
        return images

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"<{type(self).__name__}: {self.describe()}>"
