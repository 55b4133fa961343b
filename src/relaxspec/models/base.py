"""What decoding needs from a model family: :class:`TargetModel` (the autoregressive
transformer) and :class:`ImageTokenizer` (tokens <-> pixels, and the codebook).

The engine (:mod:`relaxspec.decoding`), the draft sources and the acceptance rules' builders use
only these members; LlamaGen (:class:`relaxspec.models.llamagen.gpt.Transformer`,
:class:`relaxspec.models.llamagen.vq.VQModel`) is the first implementation. A family that brings its own
conditioning, positions or caches implements the same members.

Conventions. ``B`` images, ``S`` CFG streams (2 with guidance: rows ``0..B-1`` conditional,
``B..2B-1`` unconditional), ``R = S*B`` rows, ``T`` tokens per call, ``V`` vocabulary, ``D``
hidden size, ``C = config.condition_length`` condition slots. The condition occupies cache slots and
positions ``0..C-1``; image token ``k`` is at slot ``C + k`` once committed; speculative drafts
sit in scratch slots past the image and are compacted with :meth:`TargetModel.move_cache`.

A target conditioned on token ids (the transformers families' prompts) may also offer
``condition_tokens(cond) -> [R, C]``: the token at every condition position of each row of
``cond`` (-1 where padded), what a drafter that reads the prompt (official LANTERN's Anole
drafter) pairs with the prefill's hidden states; :func:`condition_tokens` asks for it. A target
whose caption may be padded may offer ``lantern_condition_states(cond, valid) -> [R, C, D]``: its
caption rows as official LANTERN's converted target computes them (:func:`condition_states`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from relaxspec.errors import RelaxspecError


@runtime_checkable
class TargetModel(Protocol):
    """An autoregressive image-token model, as decoding drives it.

    ``config`` has at least ``vocab_size`` (``V``), ``block_size`` (image tokens ``N``),
    ``grid_size`` (``N = grid_size**2``), ``condition_length`` (``C``), ``dim`` (``D``),
    ``num_classes`` and ``model_type`` (``"c2i"`` / ``"t2i"``). ``class_names``: the class names
    when the checkpoint carries them, else ``None``. ``max_seq``: slots of the current cache.
    """

    config: Any
    class_names: list[str] | None
    max_seq: int

    @property
    def device(self) -> torch.device:
        """Where the weights live (and decoding runs)."""

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (drafters are cast to it)."""

    @property
    def token_embeddings(self) -> Tensor:
        """``[V, D]`` input embedding of every image token (GSD's latent distance reads it)."""

    def null_condition(self, cond: Tensor) -> Tensor:
        """The unconditional counterpart of ``cond`` (same shape), for classifier-free guidance."""

    def setup_caches(self, rows: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        """Allocate static KV caches of ``rows`` rows and ``max_seq`` slots (kept between decodes
        of the same shape)."""

    def clear_caches(self) -> None:
        """Free the caches."""

    def move_cache(self, src: Tensor, dst: Tensor) -> None:
        """Copy cache slots ``src [R, n]`` onto ``dst [R, n]`` in every layer (KV compaction after
        a speculative step; a slot copied onto itself is a no-op)."""

    def prefill(self, cond: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Encode conditions ``cond`` (class ids ``[R]`` or features ``[R, C, ...]``) at
        ``positions [R, C]`` into ``cache_slots [R, C]``, attending by ``attn_mask [R, C,
        max_seq]`` (True = may attend). Returns fp32 logits ``[R, C, V]`` (the last predicts image
        token 0) and the final hidden states ``[R, C, D]``. No host syncs (``--compile`` compiles
        it): checks of the condition that read the device go in an optional
        ``prepare_condition(cond, attn_mask)``, which decoding runs before it
        (:func:`prepare_condition`)."""

    def step(self, tokens: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor) -> tuple[Tensor, Tensor]:
        """One forward over image tokens ``tokens [R, T]`` at RoPE / position ids ``positions
        [R, T]``, writing ``cache_slots [R, T]`` and attending by the tree mask ``attn_mask [R, T,
        max_seq]``. Returns fp32 logits ``[R, T, V]`` (what each input predicts next) and the final
        hidden states ``[R, T, D]`` (what the output head sees; EAGLE drafts from them). No host
        syncs: this is what ``--compile`` compiles.

        A target with ``num_layers`` (:func:`layer_count`) also takes ``capture=(i, ..)`` in
        ``prefill`` and ``step``: the hidden states returned are then the residual streams entering
        those layers side by side ``[R, T, k * D]`` (:func:`run_capturing`), what a fused-feature
        (EAGLE-3) drafter reads; the logits are unchanged."""

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """``tokens [..]`` -> input embeddings ``[.., D]`` (the drafter's token input)."""

    def head(self, hidden: Tensor) -> Tensor:
        """Final hidden states ``[.., D]`` -> fp32 logits ``[.., V]`` (the drafter's output head)."""


def run_capturing(layers, hidden: Tensor, run, capture: tuple[int, ...] | None) -> tuple[Tensor, Tensor | None]:
    """``hidden = run(layer, hidden)`` for each of ``layers`` in turn: the last output and, with
    ``capture``, the residual streams *entering* layers ``capture`` (``i == len(layers)``: the last
    layer's output, before any final norm) side by side, ``[.., len(capture) * D]`` (EAGLE-3's fused
    low, middle and high features: :func:`fused_layers`); ``None`` without."""
    kept = {}
    for index, layer in enumerate(layers):
        if capture is not None and index in capture:
            kept[index] = hidden
        hidden = run(layer, hidden)
    if capture is None:
        return hidden, None
    kept[len(layers)] = hidden
    return hidden, torch.cat([kept[index] for index in capture], dim=-1)


def fused_layers(count: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high features of a ``count``-layer target as the streams entering
    layers ``2``, ``count // 2`` and ``count - 3`` (the official code's test, also vLLM's), kept
    in ``0 .. count`` for the shallow targets of tests."""
    return min(2, count), count // 2, max(count - 3, 0)


def layer_count(model: TargetModel) -> int | None:
    """How many decoder layers ``model`` has where it can hand their streams to a drafter
    (``model.num_layers``; its ``prefill`` and ``step`` then take ``capture=``), else ``None``."""
    count = getattr(model, "num_layers", None)
    return int(count) if isinstance(count, int) and not isinstance(count, bool) else None


def prepare_condition(model: TargetModel, cond: Tensor, attn_mask: Tensor) -> None:
    """``model.prepare_condition(cond, attn_mask)`` where the target has one: its per-decode
    checks and set-up of the condition rows ``cond`` it is about to encode (``attn_mask [R, C,
    max_seq]``, what :meth:`TargetModel.prefill` will get), run eagerly before the prefill. The
    checks may read values back to the host; the prefill may not (``--compile`` compiles it as
    an image's first graph), so a family does its reading here (Janus and the row-end families:
    the prompts' layout, their left padding)."""
    method = getattr(model, "prepare_condition", None)
    if callable(method):
        method(cond, attn_mask)


def condition_tokens(model: TargetModel, cond: Tensor) -> Tensor | None:
    """``model.condition_tokens(cond)`` (``[R, C]`` token ids, -1 where padded) for a target
    conditioned on tokens; ``None`` for one conditioned otherwise (class ids, caption features)."""
    method = getattr(model, "condition_tokens", None)
    return method(cond) if callable(method) else None


#: How the hidden states at padded caption positions are computed for a drafter that reads the
#: caption's rows: ``upstream`` as the target's own prefill computes them (upstream LlamaGen: a
#: padded position sees itself alone), ``lantern`` as official LANTERN's converted target does
#: (:mod:`relaxspec.models.llamagen.lantern_rows`), what LANTERN's released drafters were trained on.
CAPTION_ROWS = ("upstream", "lantern")


def condition_states(model: TargetModel, cond: Tensor, valid: Tensor | None, hidden: Tensor, rows: str) -> Tensor:
    """The hidden states at every condition position ``[R, C, D]`` a drafter reads: the
    prefill's own ``hidden`` with, for ``rows`` ``"lantern"``, its padded positions (``valid
    [R, C]`` False) as official LANTERN's converted target computes them -- asked of the target as
    ``model.lantern_condition_states(cond, valid) -> [R, C, D]`` (LlamaGen's offers it). Nothing
    changes where nothing is padded (``valid`` None)."""
    if rows not in CAPTION_ROWS:
        raise RelaxspecError(f"caption rows must be one of {', '.join(CAPTION_ROWS)}, got {rows!r}")
    if rows == "upstream" or valid is None:
        return hidden
    method = getattr(model, "lantern_condition_states", None)
    if not callable(method):
        raise RelaxspecError(f"the drafter reads padded caption rows as official LANTERN's target computes them; "
                             f"this target ({type(model).__name__}) cannot compute them")
    valid = valid.to(hidden.device).bool()
    return torch.where(valid[:, :, None], hidden, method(cond, valid).to(hidden.dtype))


@runtime_checkable
class TeacherForcedTarget(TargetModel, Protocol):
    """A target the training recipes can run teacher-forced (the EAGLE drafter's features)."""

    def forward_train(self, cond: Tensor, tokens: Tensor, return_hidden: bool = False):
        """Whole images ``tokens [R, N]`` under conditions ``cond`` -> fp32 logits ``[R, N, V]``
        (row ``k`` predicts image token ``k``) and, with ``return_hidden``, hidden states
        ``[R, N, D]``."""


@runtime_checkable
class ImageTokenizer(Protocol):
    """The image tokenizer of a model family: ``config.codebook_size`` (``V``),
    ``config.downsample_factor`` (pixels per token side)."""

    config: Any

    @property
    def codebook(self) -> Tensor:
        """``[V, d]`` the code vectors the decoder reads (LANTERN's normalised geometry, GSD's
        codebook latent)."""

    @property
    def raw_codebook(self) -> Tensor:
        """``[V, d]`` the stored code vectors (LANTERN's raw geometry)."""

    def decode(self, tokens: Tensor) -> Tensor:
        """Image tokens ``[B, N]`` -> pixels ``[B, 3, H, W]`` in ``[-1, 1]`` (no grad)."""
