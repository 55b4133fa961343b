"""The target model as the decoding loop sees it: a guided next-token distribution.

:class:`GuidedTarget` owns the ``[cond; uncond]`` classifier-free-guidance batch, the static KV
cache and the condition's key mask, and turns raw logits into processed probabilities with
:func:`relaxspec.sampling.process_logits`. Every decoding method (AR, speculative, Jacobi) drives
the target through it, so CFG and logits processing exist once.

Slots and positions: the condition occupies slots/positions ``0 .. C-1`` (``C`` =
``condition_length``) and committed image token ``k`` always sits at slot = position ``C + k``;
speculative steps put drafts in scratch slots beyond the committed prefix and compact them back.
"""

from __future__ import annotations

import contextlib

import torch

from relaxspec.caching import grown, kept_buffer, kept_copy
from relaxspec.compiling import compiled, fixed_addresses, tensors_of
from relaxspec.errors import RelaxspecError
from relaxspec.timing import Stopwatch
from relaxspec.models.base import TargetModel, condition_states, condition_tokens, prepare_condition
from relaxspec.sampling import (DeviceSampling, SamplingConfig, exponential_clocks, process_logits,
                                sample_from, stream_rows)


def attention_mask(slots: torch.Tensor, mask: torch.Tensor | None, key_valid: torch.Tensor | None,
                   cache_len: int) -> torch.Tensor:
    """``[R, T, cache_len]`` for queries at ``slots [R, T]``: ``mask`` (default causal by slot)
    with padded caption keys (``key_valid [R, cache_len]`` False) hidden."""
    keys = torch.arange(cache_len, device=slots.device)[None, None, :]
    if mask is None:
        mask = keys <= slots[:, :, None]
    if key_valid is None:
        return mask
    # A padded caption position still attends to itself (upstream's eye fix), else its row
    # would be all -inf.
    return (mask & key_valid[:, None, :]) | (keys == slots[:, :, None])


def guided_step(model: TargetModel, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor | None, key_valid: torch.Tensor | None, sampling: DeviceSampling,
                companion_mask: torch.Tensor | None = None,
                capture: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward for ``B`` images over ``tokens [B, T]`` (repeated for each CFG
    stream) at RoPE ``positions``, written to cache ``slots`` and attending by ``mask [B, T,
    cache]`` (default causal by slot): processed probabilities ``[B, T, V]`` and hidden states
    ``[S*B, T, dim]``. ``companion_mask [B, T, cache]``: which slots' row-end companions each
    query sees, for a target with row-end companions (:class:`relaxspec.models.hf.RowEndTarget`);
    ``None``: as the main keys are seen. ``capture``: the target layers whose streams the hidden
    states are instead (:func:`target_outputs`). This is what ``--compile`` compiles."""
    streams = sampling.streams
    slots = stream_rows(slots, streams)
    attn_mask = attention_mask(slots, stream_rows(mask, streams), key_valid, model.max_seq)
    inputs = (stream_rows(tokens, streams), stream_rows(positions, streams), slots, attn_mask)
    options = target_outputs(capture)
    if companion_mask is not None:
        options["companion_mask"] = stream_rows(companion_mask, streams)
    logits, hidden = model.step(*inputs, **options)
    return process_logits(logits, sampling), hidden


def target_outputs(capture: tuple[int, ...] | None) -> dict:
    """The keywords that make a target's ``prefill`` / ``step`` return the streams entering
    layers ``capture`` as its hidden states (a fused-feature drafter's input,
    :func:`relaxspec.models.base.run_capturing`); none for the final states, so a target that
    cannot capture is called as ever."""
    return {} if capture is None else {"capture": tuple(capture)}


def guided_prefill(model: TargetModel, cond: torch.Tensor, slots: torch.Tensor, key_valid: torch.Tensor | None,
                   sampling: DeviceSampling, caption_rows: str, clocks: torch.Tensor | None,
                   capture: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The condition's forward over ``slots`` = positions ``[R, C]`` (``0 .. C-1`` in every row;
    an input, not made in the graph: inductor's index analysis failed on a family's positions
    derived from an ``arange``) for every row of ``cond`` (``[cond; uncond]``), the law of image
    token 0 and token 0 itself, drawn by the exponential race on
    ``clocks [B, V]`` (drawn before the call from the user's generator) or, without clocks, the
    argmax: ``(first [B], probs [B, V], hidden [S*B, C, dim])``, the hidden states at padded
    caption positions as ``caption_rows`` says (:func:`relaxspec.models.base.condition_states`).
    What ``--compile`` compiles as an image's first graph (one per condition shape), after the
    target's eager :func:`~relaxspec.models.base.prepare_condition`."""
    cls = model.config.condition_length
    logits, hidden = model.prefill(cond, slots, slots, attention_mask(slots, None, key_valid, model.max_seq),
                                   **target_outputs(capture))
    valid = None if key_valid is None else key_valid[:, :cls]
    hidden = condition_states(model, cond, valid, hidden, caption_rows)
    probs = process_logits(logits[:, -1], sampling)
    return sample_from(probs, greedy=clocks is None, clocks=clocks), probs, hidden


def target_slots(model: TargetModel, scratch: int) -> int:
    """The target cache's slots for a decode with ``scratch`` slots past the image: the most any
    decode of ``model`` has needed, this one's included (:func:`relaxspec.caching.grown`). A decode
    that needs fewer (AR beside a speculative method) runs on the same cache, so its graphs keep
    their shapes and addresses."""
    config = model.config
    return grown(model, "target.slots", config.condition_length + config.block_size + scratch)


class GuidedTarget:
    """Drive ``model`` (any :class:`~relaxspec.models.base.TargetModel`) for ``B`` images
    (``2B`` rows with CFG).

    ``cond``: class ids ``[B]`` or caption features ``[B, C, caption_dim]``; ``cond_mask [B, C]``
    (t2i only) marks real caption tokens — padded ones are hidden from every query, as upstream.
    ``scratch`` extra cache slots are reserved past the image for speculative drafts; ``grow``:
    size the cache for the most slots any decode of the model has needed (False: exactly this
    one's, for a measurement). ``compile``: run :func:`guided_step` compiled as its own graph
    (:mod:`relaxspec.compiling`; a decoding loop that compiles its whole step leaves this off and
    traces the forward into the step's graph); ``compile_prefill``: run :func:`guided_prefill`
    compiled (one graph per condition shape). ``timed``: time the forwards (and the prefill) in
    :attr:`watch` (profile mode; otherwise ``watch`` is ``None`` and nothing is timed).

    The sampling's numbers reach the forwards as device tensors kept with the model
    (:meth:`~relaxspec.sampling.SamplingConfig.on`): a new cfg scale or temperature compiles
    nothing. Shapes are static: the cache is allocated once per (model, rows) with the most slots
    a decode of the model has needed (:func:`relaxspec.caching.grown`;
    :func:`relaxspec.decoding.reserve` sizes it ahead for a set of methods) and kept between
    decodes, and every forward attends over the whole cache through a mask built from slots.

    ``capture``: the target layers whose streams every forward returns as its hidden states
    instead of the final ones (what a fused-feature drafter reads: the draft source's
    ``target_layers``, :func:`relaxspec.drafting.base.target_layers`).
    """

    def __init__(self, model: TargetModel, cond: torch.Tensor, sampling: SamplingConfig, *,
                 cond_mask: torch.Tensor | None = None, scratch: int = 0, compile: bool = False,
                 compile_prefill: bool = False, timed: bool = False, grow: bool = True,
                 capture: tuple[int, ...] | None = None):
        self.model, self.sampling = model, sampling
        self.capture = None if capture is None else tuple(capture)
        config = model.config
        self.batch = cond.shape[0]
        self.streams = 2 if sampling.use_cfg else 1
        self.cls = config.condition_length
        self.num_tokens = config.block_size
        self.device = model.device
        self.greedy = sampling.greedy
        # the numbers every forward reads, kept with the model: one address across decodes
        self.device_sampling = sampling.on(
            self.device, lambda name, dtype: kept_buffer(model, f"sampling.{name}", (), dtype, self.device))
        cond = cond.to(self.device)
        cond = torch.cat([cond, model.null_condition(cond)]) if self.streams == 2 else cond
        self.cond = kept_copy(model, "condition", cond)  # what the compiled prefill reads: one address
        # [S*B, C] the condition's tokens for a target conditioned on tokens (else None): what a
        # drafter that reads the prompt pairs with the prefill's hidden states
        self.condition_tokens = condition_tokens(model, self.cond)
        self.max_seq = target_slots(model, scratch) if grow else self.cls + self.num_tokens + scratch
        model.setup_caches(self.batch * self.streams, self.max_seq)
        self.key_valid = None
        if cond_mask is not None:
            if tuple(cond_mask.shape) != (self.batch, self.cls):
                raise RelaxspecError(f"the condition mask is {tuple(cond_mask.shape)}; this model reads "
                                     f"{self.cls} condition tokens per image ({self.batch} images)")
            key_valid = torch.ones(self.batch, self.max_seq, dtype=torch.bool, device=self.device)
            key_valid[:, : self.cls] = cond_mask.to(self.device).bool()
            # Upstream masks the padded caption positions in both CFG streams. (Kept at one address
            # across decodes of a shape: a compiled step reads it.)
            self.key_valid = kept_copy(model, "key_valid", key_valid.repeat(self.streams, 1))
        self.watch = Stopwatch(self.device) if timed else None  # time inside the model's forward calls
        rows = self.batch * self.streams
        self._slots = kept_copy(model, "prefill.slots", torch.arange(self.cls, device=self.device).repeat(rows, 1))
        self._clocks = None if self.greedy else kept_buffer(model, "start.clocks", (self.batch, config.vocab_size),
                                                            torch.float32, self.device)
        self._step = compiled(guided_step, self.device, model) if compile else guided_step
        self._prefill = compiled(guided_prefill, self.device, model) if compile_prefill else guided_prefill
        if compile_prefill and self.device.type == "cuda":  # what the prefill's CUDA graph reads and writes in place
            fixed_addresses(tensors_of(self, model))

    def start(self, caption_rows: str = "upstream", generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encode the condition and draw image token 0 (from ``generator``; the argmax when
        greedy): ``(first [B], probs [B, V], hidden [S*B, C, dim])`` -- token 0, the law it was
        drawn from and the hidden states at every condition position (the last one predicted
        token 0), those at padded caption positions computed as ``caption_rows`` says
        (:func:`relaxspec.models.base.condition_states`: what the draft source reads). One
        compiled graph with ``compile``; the family's per-decode checks run before it, eagerly."""
        prepare_condition(self.model, self.cond, attention_mask(self._slots, None, self.key_valid, self.max_seq))
        clocks = self._clocks
        if clocks is not None:  # drawn as sample_from would draw them, into a buffer the graph reads at one address
            exponential_clocks(clocks.shape, generator, out=clocks)
        with self.watch or contextlib.nullcontext():
            out = self._prefill(self.model, self.cond, self._slots, self.key_valid, self.device_sampling, caption_rows,
                                clocks, self.capture)
        # kept at one address: what the draft source's first (compiled) forward reads
        return tuple(kept_copy(self.model, f"start.{name}", value) for name, value in zip(("first", "probs", "hidden"), out))

    def prefill(self, caption_rows: str = "upstream") -> tuple[torch.Tensor, torch.Tensor]:
        """Encode the condition: probabilities for image token 0 ``[B, V]`` and the hidden states
        at every condition position ``[S*B, C, dim]`` (:meth:`start` without the draw)."""
        prepare_condition(self.model, self.cond, attention_mask(self._slots, None, self.key_valid, self.max_seq))
        with self.watch or contextlib.nullcontext():
            _, probs, hidden = self._prefill(self.model, self.cond, self._slots, self.key_valid, self.device_sampling,
                                             caption_rows, None, self.capture)
        return probs, hidden

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor | None = None,
                companion_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over ``tokens [B, T]`` at RoPE ``positions [B, T]`` written to cache
        ``slots [B, T]``; ``mask [B, T, max_seq]`` (True = may attend), default causal by slot.
        ``companion_mask``: see :func:`guided_step` (rows in parallel on a row-end target only).
        Returns probabilities ``[B, T, V]`` (what each input predicts next) and hidden states
        ``[S*B, T, dim]``."""
        if self.watch is None:
            return self._step(self.model, tokens, positions, slots, mask, self.key_valid, self.device_sampling,
                              companion_mask, self.capture)
        with self.watch:
            return self._step(self.model, tokens, positions, slots, mask, self.key_valid, self.device_sampling,
                              companion_mask, self.capture)

    def move_cache(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Compact accepted tree nodes: copy slots ``src [B, n]`` onto ``dst [B, n]``."""
        self.model.move_cache(stream_rows(src, self.streams), stream_rows(dst, self.streams))

    def close(self) -> None:
        """The cache stays allocated for the next decode of the same shape
        (``model.clear_caches()`` frees it)."""
