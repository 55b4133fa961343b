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

from relaxspec.caching import kept_copy
from relaxspec.compiling import compiled
from relaxspec.errors import RelaxspecError
from relaxspec.timing import Stopwatch
from relaxspec.models.base import TargetModel, condition_states, condition_tokens
from relaxspec.sampling import SamplingConfig, process_logits, stream_rows


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
                mask: torch.Tensor | None, key_valid: torch.Tensor | None, sampling: SamplingConfig,
                streams: int, companion_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward for ``B`` images over ``tokens [B, T]`` (repeated for each CFG
    stream) at RoPE ``positions``, written to cache ``slots`` and attending by ``mask [B, T,
    cache]`` (default causal by slot): processed probabilities ``[B, T, V]`` and hidden states
    ``[S*B, T, dim]``. ``companion_mask [B, T, cache]``: which slots' row-end companions each
    query sees, for a target with row-end companions (:class:`relaxspec.models.hf.RowEndTarget`);
    ``None``: as the main keys are seen. This is what ``--compile`` compiles."""
    slots = stream_rows(slots, streams)
    attn_mask = attention_mask(slots, stream_rows(mask, streams), key_valid, model.max_seq)
    inputs = (stream_rows(tokens, streams), stream_rows(positions, streams), slots, attn_mask)
    if companion_mask is None:
        logits, hidden = model.step(*inputs)
    else:
        logits, hidden = model.step(*inputs, companion_mask=stream_rows(companion_mask, streams))
    return process_logits(logits, sampling), hidden


class GuidedTarget:
    """Drive ``model`` (any :class:`~relaxspec.models.base.TargetModel`) for ``B`` images
    (``2B`` rows with CFG).

    ``cond``: class ids ``[B]`` or caption features ``[B, C, caption_dim]``; ``cond_mask [B, C]``
    (t2i only) marks real caption tokens — padded ones are hidden from every query, as upstream.
    ``scratch`` extra cache slots are reserved past the image for speculative drafts.
    ``compile``: run :func:`guided_step` compiled as its own graph (:mod:`relaxspec.compiling`; a
    decoding loop that compiles its whole step leaves this off and traces the forward into the
    step's graph). ``timed``: time the forwards (and the prefill) in :attr:`watch` (profile mode;
    otherwise ``watch`` is ``None`` and nothing is timed).

    Shapes are static: the cache is allocated once per (model, rows, length) and kept between
    decodes, and every forward attends over the whole cache through a mask built from slots.
    """

    def __init__(self, model: TargetModel, cond: torch.Tensor, sampling: SamplingConfig, *,
                 cond_mask: torch.Tensor | None = None, scratch: int = 0, compile: bool = False,
                 timed: bool = False):
        self.model, self.sampling = model, sampling
        config = model.config
        self.batch = cond.shape[0]
        self.streams = 2 if sampling.use_cfg else 1
        self.cls = config.condition_length
        self.num_tokens = config.block_size
        self.device = model.device
        cond = cond.to(self.device)
        self.cond = torch.cat([cond, model.null_condition(cond)]) if self.streams == 2 else cond
        # [S*B, C] the condition's tokens for a target conditioned on tokens (else None): what a
        # drafter that reads the prompt pairs with the prefill's hidden states
        self.condition_tokens = condition_tokens(model, self.cond)
        self.max_seq = self.cls + self.num_tokens + scratch
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
        self._step = compiled(guided_step, self.device, model) if compile else guided_step

    def prefill(self, caption_rows: str = "upstream") -> tuple[torch.Tensor, torch.Tensor]:
        """Encode the condition. Returns probabilities for image token 0 ``[B, V]`` and the
        hidden states at every condition position ``[S*B, C, dim]`` (all streams; the last one
        predicted image token 0), those at padded caption positions computed as ``caption_rows``
        says (:func:`relaxspec.models.base.condition_states`: what the draft source reads)."""
        slots = torch.arange(self.cls, device=self.device).expand(self.batch * self.streams, -1)
        mask = attention_mask(slots, None, self.key_valid, self.max_seq)
        with self.watch or contextlib.nullcontext():
            logits, hidden = self.model.prefill(self.cond, slots, slots, mask)
            valid = None if self.key_valid is None else self.key_valid[:, : self.cls]
            hidden = condition_states(self.model, self.cond, valid, hidden, caption_rows)
        return process_logits(logits[:, -1], self.sampling), hidden

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor | None = None,
                companion_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over ``tokens [B, T]`` at RoPE ``positions [B, T]`` written to cache
        ``slots [B, T]``; ``mask [B, T, max_seq]`` (True = may attend), default causal by slot.
        ``companion_mask``: see :func:`guided_step` (rows in parallel on a row-end target only).
        Returns probabilities ``[B, T, V]`` (what each input predicts next) and hidden states
        ``[S*B, T, dim]``."""
        if self.watch is None:
            return self._step(self.model, tokens, positions, slots, mask, self.key_valid, self.sampling, self.streams,
                              companion_mask)
        with self.watch:
            return self._step(self.model, tokens, positions, slots, mask, self.key_valid, self.sampling, self.streams,
                              companion_mask)

    def move_cache(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Compact accepted tree nodes: copy slots ``src [B, n]`` onto ``dst [B, n]``."""
        self.model.move_cache(stream_rows(src, self.streams), stream_rows(dst, self.streams))

    def close(self) -> None:
        """The cache stays allocated for the next decode of the same shape
        (``model.clear_caches()`` frees it)."""
