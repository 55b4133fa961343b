"""The one logits-processing path every decoding method shares (REFERENCE §2.2).

Order, as upstream LlamaGen: classifier-free guidance on raw logits
(``uncond + (cond - uncond) * cfg_scale``), temperature, top-k, then top-p, softmax. Every
exactness or TV statement in relaxspec is about the distributions this module returns, for the
target and the drafter alike.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields as dataclass_fields

import torch

from relaxspec.errors import RelaxspecError, shown

#: Guidance scales past this are refused: published models guide at 1.5-10; far larger scales
#: overflow the guided logits (see :meth:`SamplingConfig.__post_init__`).
MAX_CFG_SCALE = 1000.0
#: Temperatures past this are refused (the law is uniform over the kept tokens long before).
MAX_TEMPERATURE = 1000.0


@dataclass(frozen=True)
class SamplingConfig:
    """How next-token distributions are formed.

    ``temperature == 0`` means greedy: tokens are the argmax; the distributions stay those of
    temperature 1 so relaxed rules can still measure how much mass they move.
    ``cfg_scale == 1`` drops the unconditional stream entirely. (Upstream LlamaGen also ignores
    guidance for ``cfg_scale < 1``; we apply the formula, which interpolates towards the
    unconditional model.)
    """

    cfg_scale: float = 4.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("cfg_scale", "temperature", "top_k", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise RelaxspecError(f"{name.replace('_', '-').replace('cfg-', 'cfg ')} must be a number, got "
                                     f"{shown(value)}")
        # A scale past MAX_CFG_SCALE (or inf) overflows the guided logits to inf - inf = nan, and every
        # token drawn from nan laws is 0: refused rather than returned as a black image.
        if not 0 <= self.cfg_scale <= MAX_CFG_SCALE:
            raise RelaxspecError(f"cfg scale must be in [0, {MAX_CFG_SCALE:g}], got {self.cfg_scale}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise RelaxspecError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {self.temperature}")
        if not math.isfinite(self.top_k) or int(self.top_k) != self.top_k or self.top_k < 0:
            raise RelaxspecError(f"top-k must be a whole number >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RelaxspecError(f"top-p must lie in (0, 1], got {self.top_p}")

    @classmethod
    def from_dict(cls, fields) -> "SamplingConfig":
        """A config from a dict of its fields (one-line errors for anything else, or an unknown field)."""
        if not isinstance(fields, dict):
            raise RelaxspecError(f"sampling must be a SamplingConfig or a dict of its fields "
                                 f"({', '.join(SAMPLING_FIELDS)}), got {shown(fields)}")
        unknown = [key for key in fields if key not in SAMPLING_FIELDS]
        if unknown:
            raise RelaxspecError(f"unknown sampling field {shown(unknown[0])}: the fields are "
                                 f"{', '.join(SAMPLING_FIELDS)}")
        return cls(**fields)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale != 1.0

    def to_dict(self) -> dict:
        return asdict(self)

    def on(self, device, buffer=None) -> "DeviceSampling":
        """This config as a compiled step reads it on ``device`` (:class:`DeviceSampling`): its
        numbers filled into ``buffer(name, dtype)`` -- 0-d tensors on ``device`` that a decoding
        loop keeps at one address with its model -- or into new tensors."""
        device = torch.device(device)
        values = {"cfg_scale": self.cfg_scale, "temperature": max(self.temperature, MIN_TEMPERATURE),
                  "top_k": int(self.top_k), "top_p": self.top_p}
        tensors = {}
        for name, dtype in DEVICE_FIELDS:
            tensor = torch.empty((), dtype=dtype, device=device) if buffer is None else buffer(name, dtype)
            tensors[name] = tensor.fill_(values[name])  # a fill: nothing is copied from the host
        return DeviceSampling(streams=2 if self.use_cfg else 1, greedy=self.greedy, top_k_on=self.top_k > 0,
                              top_p_on=self.top_p < 1.0, top_k_value=int(self.top_k), **tensors)


#: The fields of :class:`SamplingConfig`, in order.
SAMPLING_FIELDS = tuple(f.name for f in dataclass_fields(SamplingConfig))


def stream_rows(x: torch.Tensor | None, streams: int) -> torch.Tensor | None:
    """A per-image tensor ``[B, ...]`` repeated for every CFG stream (``[cond; uncond]`` rows:
    ``[S*B, ...]``); ``None`` stays ``None``."""
    return x if streams == 1 or x is None else torch.cat([x, x])


#: The smallest temperature divided by (a temperature below it is read as this one).
MIN_TEMPERATURE = 1e-5


@dataclass(eq=False)  # not frozen: torch 2.5-2.6 guard on every field of a frozen dataclass
class DeviceSampling:
    """A :class:`SamplingConfig` as decoding's compiled steps read it (issue 51): what changes the
    ops -- guidance on (``streams`` 2), the temperature applied (not when greedy), the filters on
    (top-k or top-p) -- as Python values, and every number as a device tensor, so a new cfg
    scale, temperature, top-k or top-p reaches a compiled step as data and compiles nothing (a
    Python float would be a constant of the graph: one graph per value).

    ``cfg_scale``, ``temperature`` (at least :data:`MIN_TEMPERATURE`), ``top_p``: float32 ``[]``;
    ``top_k``: int64 ``[]`` (0 = off). ``top_k_value``: top-k as a Python int, which an eager step
    reads instead (no graph to keep there, and ``topk`` finds the k-th logit several times faster
    than the sort a compiled step does on a CPU). Made by :meth:`SamplingConfig.on`."""

    streams: int
    greedy: bool
    top_k_on: bool
    top_p_on: bool
    top_k_value: int
    cfg_scale: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    @property
    def use_cfg(self) -> bool:
        return self.streams == 2

    @property
    def filtered(self) -> bool:
        return self.top_k_on or self.top_p_on


#: What :meth:`SamplingConfig.on` keeps its numbers in: ``(name, dtype)``.
DEVICE_FIELDS = (("cfg_scale", torch.float32), ("temperature", torch.float32), ("top_k", torch.int64),
                 ("top_p", torch.float32))


def guide(logits: torch.Tensor, cfg_scale: float | torch.Tensor) -> torch.Tensor:
    """``logits [2B, ..., V]`` stacked ``[cond; uncond]`` -> guided ``[B, ..., V]``."""
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + (cond - uncond) * cfg_scale


def filter_logits(logits: torch.Tensor, top_k: int | torch.Tensor = 0, top_p: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Upstream ``top_k_top_p_filtering``: top-k first (ties with the k-th value survive; 0 = off),
    then top-p on what is left (1 = off), always keeping the most likely token. Returns a new
    tensor. ``top_k`` and ``top_p`` may be tensors (``[]``, on the logits' device): one sort of the
    logits then serves both filters, so neither value is a shape and a new one compiles nothing;
    top-k alone with a Python ``top_k`` finds the k-th value with ``topk`` (a partial sort)."""
    vocab = logits.shape[-1]
    if not isinstance(top_k, torch.Tensor) and not isinstance(top_p, torch.Tensor) and top_p >= 1.0:
        if top_k <= 0:
            return logits.clone()
        kth = torch.topk(logits, min(int(top_k), vocab), dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, float("-inf"))
    values, order = torch.sort(logits, descending=True, dim=-1)
    if not isinstance(top_k, torch.Tensor):  # a decoding step's are tensors already (DeviceSampling)
        top_k = torch.tensor(top_k, device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # off: the smallest logit is the k-th
    kth = values.gather(-1, (k - 1).expand(*values.shape[:-1], 1))
    values = values.masked_fill(values < kth, float("-inf"))
    # top-p on the top-k-renormalised law; the token that crosses the threshold is kept
    cumulative = values.softmax(dim=-1).cumsum(dim=-1)
    if not isinstance(top_p, torch.Tensor):
        top_p = torch.tensor(top_p, device=logits.device)
    remove = (cumulative > top_p) & (top_p < 1.0)
    remove = torch.cat([torch.zeros_like(remove[..., :1]), remove[..., :-1]], dim=-1)
    values = values.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, values)


def process_logits(logits: torch.Tensor, config: SamplingConfig | DeviceSampling) -> torch.Tensor:
    """Raw model logits -> next-token probabilities.

    ``logits``: ``[2B, ..., V]`` (``[cond; uncond]``) when ``config.use_cfg``, else ``[B, ..., V]``.
    ``config``: a :class:`SamplingConfig` or, in a decoding step, its :class:`DeviceSampling`
    (what the step reads as data). Returns fp32 probabilities ``[B, ..., V]``.
    """
    if isinstance(config, SamplingConfig):
        config = config.on(logits.device)
    logits = logits.float()
    if config.use_cfg:
        logits = guide(logits, config.cfg_scale)
    if not config.greedy:  # greedy keeps temperature 1's laws (relaxed rules still measure them)
        logits = logits / config.temperature
    if config.top_p_on or (config.top_k_on and torch.compiler.is_compiling()):
        logits = filter_logits(logits, config.top_k, config.top_p)  # as data: a new value compiles nothing
    elif config.top_k_on:  # eager, top-k alone: the same filter, its k-th value by topk
        logits = filter_logits(logits, config.top_k_value)
    return logits.softmax(dim=-1)


def exponential_clocks(shape, generator: torch.Generator | None = None, device=None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """I.i.d. ``Exp(1)`` fp32 ``shape`` from ``generator``, floored at the smallest normal float
    (never 0): the randomness of :func:`race_keys`, drawable ahead of the ops that use it. ``out``
    (fp32 ``shape``): drawn into it, in place (a buffer a compiled graph reads at one address)."""
    if out is not None:
        return out.exponential_(generator=generator).clamp_(min=torch.finfo(torch.float32).tiny)
    clocks = torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=generator)
    return clocks.clamp(min=torch.finfo(torch.float32).tiny)


def race_keys(probs: torch.Tensor, generator: torch.Generator | None = None,
              clocks: torch.Tensor | None = None) -> torch.Tensor:
    """Exponential-race keys ``p_i / E_i`` (``E_i ~ Exp(1)`` i.i.d.: ``clocks``, or drawn from
    ``generator``), fp32 ``[..., V]``.

    ``argmax`` of the keys is a draw from ``probs`` (the first of independent ``Exp(p_i)``
    clocks ``E_i / p_i`` to ring is ``i`` with probability ``p_i / sum p``); on the CPU it is
    the very draw ``torch.multinomial(probs, 1)`` makes from the same generator state, since that
    is how it samples. ``topk(n)`` of the keys is ``n`` successive draws without replacement (the
    Gumbel-top-k trick, Kool et al. 2019: the logs of the keys are Gumbel-perturbed
    log-probabilities). Unlike ``torch.multinomial`` this never synchronises with the host.
    Zero-probability tokens get key 0 and come out only where every key is 0.
    """
    if clocks is None:
        clocks = exponential_clocks(probs.shape, generator, probs.device)
    return probs.to(torch.float32) / clocks


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None, greedy: bool = False,
                clocks: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row of ``probs [..., V]`` -> int64 ``[...]`` (argmax when greedy), by the
    exponential race (:func:`race_keys`, with ``clocks`` drawn ahead or from ``generator``): no
    host sync."""
    if greedy:
        return probs.argmax(dim=-1)
    return race_keys(probs, generator, clocks).argmax(dim=-1)


def batch_seed(seed: int, batch: int) -> int:
    """The seed of batch ``batch`` of a run seeded ``seed`` (``relaxspec generate`` and ``bench``):
    every batch has its own stream, so a resumed run reproduces an uninterrupted one."""
    return seed * 1_000_003 + batch

