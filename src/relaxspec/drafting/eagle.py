"""The EAGLE drafter (arXiv 2401.15077, 2406.16858; REFERENCE §1.6), shaped for its target.

The drafter autoregresses on *features*: pair ``j`` is (the target's final hidden state that
predicted image token ``j``, the embedding of token ``j``) and the drafter's output there is its
guess of the feature that predicts token ``j + 1``; the target's frozen output head turns that
guess into draft logits. The token embedding and the head are the target's, shared and never
trained or stored; only ``fc`` (2d -> d) and ``n_layer`` transformer layers are the drafter's own.

The layers are of the target's family (``DrafterConfig.family``):

- ``"llamagen"``: LlamaGen blocks with 2D RoPE over the image grid (table row ``j`` for pair
  ``j``), sized from a LlamaGen target's config or, for a model known only by the
  :class:`~relaxspec.models.base.TargetModel` protocol, from its ``config`` (see
  :func:`drafter_target_config`). A ``config.json`` without ``family`` (every drafter written
  before families existed, the embedded one included) is one of these, and a LlamaGen drafter is
  still written without it.
- a transformers family (``"janus"``, ``"emu3"``, ``"chameleon"`` for Lumina-mGPT: the model's
  ``model_type``): decoder layers of the target's own class and layer config, with its rotary
  embedding over the 1D image-token index ``j`` (:mod:`relaxspec.drafting.family`). This is
  what :meth:`EagleDrafter.for_target` and ``relaxspec train-drafter`` build for such targets.

**Fused features** (EAGLE-3, arXiv 2503.01840; ``DrafterConfig.fused_layers``): instead of the
target's final state the drafter reads the residual streams *entering* a few target layers side by
side (EAGLE-3's low, middle and high: layers ``2, L // 2, L - 3`` of ``L``,
:func:`relaxspec.models.base.fused_layers`), ``k * d`` wide, which the engine asks every target
forward for (:func:`relaxspec.models.base.run_capturing`). ``fuse`` (``k d -> d``, no bias) brings
them to the drafter's width; a depth past the first reads the drafter's own output (``d`` wide,
EAGLE-3's: the width says which), and both pass ``feature_norm`` before ``fc``. The drafter's
output goes through its own ``out_norm`` before the target's frozen head. It departs from EAGLE-3
in keeping ``fc(cat[embedding, feature])`` and the family's own layers (EAGLE-3 widens its one
layer's attention input instead) and the target's head and codebook (EAGLE-3 trains a head over
a cut vocabulary).

Pair ``j`` sits in cache slot ``j``: the drafter sees no condition positions, only what the
target's features carry about the condition. With CFG the drafter runs on both streams (features
from each stream), exactly like the target.

Official LANTERN's drafters (:mod:`relaxspec.drafting.lantern_drafter` reads their folders) depart
from relaxspec's own in three :class:`DrafterConfig` fields that relaxspec's own drafters leave at
their defaults. LlamaGen's (LlamaGen blocks): layer 0 has no input norm
(``first_attention_norm=False``: EAGLE feeds ``fc``'s output to attention raw), the drafter keeps
its own token table (``own_embedding``), and it reads the condition (``condition_pairs = P``).
Anole's (Chameleon decoder layers, its family's) keep the input norm and have the other two.

Reading the condition is one idea for both: before image pair 0 the drafter attends to the
*condition pairs* ``t = 0 .. C-2`` of a ``C``-position condition, pair ``t`` being (the target's
final hidden state at condition position ``t``, the token at position ``t + 1``), as official
LANTERN feeds its drafter ``input_ids[:, 1:]`` beside the prefill's hidden states. Pair 0 (image
token 0) then pairs the feature at the condition's last position. What differs is what a
condition position holds:

- LlamaGen blocks: caption features, no tokens: every pair's token is 0, its RoPE row all zero
  (the table's first ``P`` rows), none masked; ``P = C - 1`` exactly (LANTERN's 119). Image pair
  ``j`` keeps its grid row (table row ``P + j``).
- a transformers family (Anole): prompt tokens (``condition_tokens [R, C]``, -1 where left-padded):
  pair ``t`` sits at the position the target gives position ``t`` (padding skipped; the
  unconditional context's <s> at 0, as LANTERN's ``input_position_diff`` shift puts it), pairs at
  padded positions are masked, and image pair ``j`` sits at the last prompt position's plus ``j``.
  ``P`` bounds ``C - 1`` (the RoPE table covers ``P + 1 + N`` positions).

The engine hands every draft source the prefill's hidden states at the condition positions
(``condition_hidden``) and the condition's tokens where the target has them
(``condition_tokens``, :func:`relaxspec.models.base.condition_tokens`); such a drafter writes the
pairs into cache slots ``0 .. P-1`` first (engine slot ``s`` is cache slot ``P + s``). Training
passes the teacher-forced pass's (``condition=``, ``condition_tokens=``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn as nn

from relaxspec.caching import kept_copy
from relaxspec.compiling import compiled, fixed_addresses, tensors_of
from relaxspec.drafting.drafter_config import LLAMAGEN, DrafterConfig, check_target, drafter_config
from relaxspec.drafting.family import FamilyLayers, rope_table
from relaxspec.models.weights import read_state, load_strict
from relaxspec.errors import RelaxspecError
from relaxspec.models import hf
from relaxspec.models.base import TargetModel
from relaxspec.models.llamagen.gpt import (RMSNorm, TransformerBlock, allocate_kv_store, release_kv_store,
                                           rope_table_2d, run_blocks)
from relaxspec.drafting.lantern_drafter import is_eagle_folder, read_lantern_drafter


class EagleDrafter(nn.Module):
    """``fc`` + ``n_layer`` layers of the target's family over (feature, token) pairs.

    ``target``: the target whose family's layer classes a transformers-family drafter is built of
    (not needed for LlamaGen blocks). Call :meth:`attach` with the target before use: it borrows
    the target's embedding and head.
    """

    def __init__(self, config: DrafterConfig, target: TargetModel | None = None):
        super().__init__()
        self.config = config
        pairs = config.condition_pairs
        if config.family == LLAMAGEN:
            tcfg = config.target_config
            self.fc = nn.Linear(2 * tcfg.dim, tcfg.dim, bias=True)
            self.layers = nn.ModuleList(TransformerBlock(tcfg) for _ in range(config.n_layer))
            if not config.first_attention_norm:  # LANTERN: fc's output enters attention un-normed
                self.layers[0].attention_norm = nn.Identity()
            if config.own_embedding:  # LANTERN: its own copy, frozen (trained drafters never move it)
                self.embed_tokens = nn.Embedding(tcfg.vocab_size, tcfg.dim).requires_grad_(False)
            # [P + block_size, head_dim / 2, 2]: P all-zero rows (the condition pairs'), then the grid's
            self.register_buffer("rope", rope_table_2d(tcfg.grid_size, tcfg.head_dim, tcfg.rope_base, pairs),
                                 persistent=False)
        else:
            if target is None:
                raise RelaxspecError(f"a drafter of the {config.family} family is built of its target's layers: "
                                     "give the target")
            check_target(config, target)
            text_model = hf.text_model_of(target)
            self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
            self.layers = FamilyLayers(text_model, config.layer, config.n_layer)
            if config.own_embedding:  # LANTERN's Anole drafter: the model's whole vocabulary, frozen
                self.embed_tokens = nn.Embedding(config.layer["config"]["vocab_size"], config.dim).requires_grad_(False)
            # [count, 2, head_dim]: the family rotary's (cos, sin) of 1D position p (image-token index j,
            # or with a prompt read first, its positions then the image's)
            count = config.target["block_size"] + (pairs + 1 if pairs else 0)
            self.register_buffer("rope", rope_table(text_model, self.layers.text_config, count), persistent=False)
        if config.fused:  # EAGLE-3: the target's fused streams brought to width d; norms before fc and the head
            dim, eps = config.dim, config.target.get("norm_eps", 1e-5)
            self.fuse = nn.Linear(len(config.fused_layers) * dim, dim, bias=False)
            self.feature_norm = RMSNorm(dim, eps)
            self.out_norm = RMSNorm(dim, eps)
        self._target: tuple[TargetModel] | None = None  # a tuple so the target is not a submodule
        self._kv_store: torch.Tensor | None = None
        self._kv_index: tuple[torch.Tensor, ...] | None = None
        self._condition_slots = 0  # cache slots the condition's pairs hold (engine slot s is slot P + s)
        self._condition_keys: torch.Tensor | None = None  # [rows, 1, P]: the cached pairs each query may see
        self._image_start: torch.Tensor | None = None  # [rows]: image pair 0's position
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @property
    def family(self) -> str:
        return self.config.family

    @classmethod
    def for_target(cls, target: TargetModel, n_layer: int = 1, family: str | None = None,
                   fused_layers: list[int] | bool | None = None) -> "EagleDrafter":
        """A new (untrained) drafter of ``target``'s family (:func:`drafter_config`; ``fused_layers``:
        a fused-feature one), in its dtype."""
        drafter = cls(drafter_config(target, n_layer, family, fused_layers), target)
        return drafter.to(target.dtype).attach(target)

    def attach(self, target: TargetModel) -> "EagleDrafter":
        check_target(self.config, target)
        self._target = (target,)
        return self

    @property
    def target(self) -> TargetModel:
        if self._target is None:
            raise RuntimeError("call drafter.attach(target) first")
        return self._target[0]

    def setup_caches(self, rows: int, max_seq: int, condition: torch.Tensor | None = None,
                     condition_tokens: torch.Tensor | None = None, compile: bool = False) -> None:
        """Static caches for ``rows`` rows of ``max_seq`` slots, reused while the shape stays.
        A drafter that reads the condition (``condition_pairs``) also writes its pairs first from
        ``condition [rows, C, dim]``, the target's hidden states at the condition positions of
        this decode's prefill, and (a family drafter) ``condition_tokens [rows, C]``, the
        condition's tokens (one compiled graph with ``compile``); without them (timing a step)
        there are no pairs to see."""
        pairs = 0
        if self.config.condition_pairs and self.family == LLAMAGEN:
            pairs = self.config.condition_pairs
        elif self.config.condition_pairs and condition is not None:
            pairs = self._check_condition(condition, condition_tokens, rows).shape[1] - 1
        dtype, device = self.fc.weight.dtype, self.fc.weight.device
        if self.family == LLAMAGEN:
            att = self.layers[0].attention
            allocate_kv_store(self, self.layers, rows, pairs + max_seq, att.n_kv_head, att.head_dim, dtype, device)
        else:
            self.layers.setup(rows, pairs + max_seq, dtype, device)
        self._condition_slots = pairs
        if self.config.condition_pairs:
            self._cache_condition(rows, pairs, condition, condition_tokens, compile)

    def _cache_condition(self, rows: int, pairs: int, condition: torch.Tensor | None,
                         tokens: torch.Tensor | None, compile: bool) -> None:
        """Write the condition's pairs into slots ``0 .. P-1`` (:func:`write_condition`), and keep
        which of them later queries see and where image pair 0 sits (at one address across
        decodes of a shape: a compiled step reads them)."""
        device = self.fc.weight.device
        keys = torch.zeros(rows, 1, pairs, dtype=torch.bool, device=device)
        start = torch.full((rows,), pairs if self.family == LLAMAGEN else 0, device=device)
        if condition is not None:
            write = write_condition
            if compile:
                write = compiled(write_condition, device, self)
                if device.type == "cuda":  # the cache it writes, read and written where it is by a CUDA graph
                    fixed_addresses(tensors_of(self) + [condition, tokens])
            keys, start = write(self, condition, tokens)
        self._condition_keys = kept_copy(self, "condition_keys", keys)
        self._image_start = kept_copy(self, "image_start", start)

    @property
    def cache_length(self) -> int:
        """Slots of the current caches (the engine's: the condition's, if any, come before)."""
        slots = self._kv_store.shape[4] if self.family == LLAMAGEN else self.layers.slots
        return slots - self._condition_slots

    def clear_caches(self) -> None:
        if self.family != LLAMAGEN:
            self.layers.clear()
        else:
            release_kv_store(self, self.layers)
        self._condition_slots, self._condition_keys, self._image_start = 0, None, None

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *,
                cache_slots: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                kv_len: int | None = None, condition: torch.Tensor | None = None,
                condition_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``features [R, T, dim]`` (target hidden states that predicted ``tokens``), ``tokens
        [R, T]``, ``positions [R, T]`` image-token indices. Returns the predicted next features
        ``[R, T, dim]`` and their draft logits ``[R, T, vocab]`` (fp32, unprocessed). A fused-feature
        drafter takes the target's fused streams ``[R, T, k * dim]`` or its own outputs ``[R, T,
        dim]`` (:meth:`lift`).

        A drafter with ``condition_pairs`` also attends to the condition's pairs: with caches,
        those :meth:`setup_caches` wrote; without, those of ``condition [R, C, dim]`` (the
        target's final hidden states at the condition positions, required) and, for a family
        drafter, ``condition_tokens [R, C]`` (the condition's tokens, -1 where padded), run
        before the ``T`` pairs."""
        target = self.target
        features = self.lift(features.to(self.fc.weight.dtype))
        if self.config.fused:
            features = self.feature_norm(features)
        h = self.fc(torch.cat([self._embed(tokens), features], dim=-1))
        if self.config.condition_pairs:
            h = self._run_after_condition(h, positions, cache_slots, attn_mask, kv_len, condition, condition_tokens)
        else:
            h = self._layers(h, positions, cache_slots, attn_mask, kv_len)
        return h, target.head(self.out_norm(h) if self.config.fused else h)

    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """A fused-feature drafter's input at its width: the target's fused streams ``[.., k * dim]``
        through ``fuse``; its own outputs ``[.., dim]`` as they are (EAGLE-3's test, by width:
        static under compile). Any other drafter's features as they are."""
        if self.config.fused and features.shape[-1] == self.fuse.in_features:
            return self.fuse(features)
        return features

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, cache_slots: torch.Tensor | None,
                attn_mask: torch.Tensor | None, kv_len: int | None) -> torch.Tensor:
        """The layers over ``h [R, T, dim]`` at ``positions [R, T]`` (rows of the RoPE table)."""
        positions = positions.clamp(max=self.rope.shape[0] - 1)  # past the image: outputs never used
        if self.family == LLAMAGEN:
            return run_blocks(self.layers, h, self.rope[positions], cache_slots, attn_mask, kv_len)[0]
        return self.layers.run(h, self.rope[positions], positions, cache_slots, attn_mask, kv_len)

    def _embed(self, tokens: torch.Tensor, vocabulary: bool = False) -> torch.Tensor:
        """Image tokens (codes) or, with ``vocabulary``, the model's token ids -> ``[.., dim]``."""
        if not self.config.own_embedding:
            return self.target.embed_tokens(tokens).to(self.fc.weight.dtype)
        if self.family != LLAMAGEN and not vocabulary:  # a code's id in the model's vocabulary
            tokens = self.target.code_ids[tokens]
        return self.embed_tokens(tokens).to(self.fc.weight.dtype)

    def _check_condition(self, condition: torch.Tensor, tokens: torch.Tensor | None, rows: int) -> torch.Tensor:
        """``condition [rows, C, dim]`` and, for a family drafter, ``tokens [rows, C]``, checked;
        returns the tokens (LlamaGen blocks: ``[rows, P + 1]`` zeros, captions have none)."""
        pairs = self.config.condition_pairs
        if condition.shape[0] != rows:
            raise RelaxspecError(f"the drafter reads the condition of {rows} rows; got hidden states "
                                 f"{tuple(condition.shape)}")
        if self.family == LLAMAGEN:
            if condition.shape[1] < pairs:
                raise RelaxspecError(f"the drafter reads {pairs} condition positions; got hidden states "
                                     f"{tuple(condition.shape)}")
            return torch.zeros(rows, pairs + 1, dtype=torch.long, device=condition.device)
        if tokens is None:
            raise RelaxspecError("this drafter (official LANTERN's Anole layout) reads the prompt's tokens: give "
                                 "them with the hidden states (condition_tokens=)")
        if tuple(tokens.shape) != tuple(condition.shape[:2]) or tokens.shape[1] - 1 > pairs:
            raise RelaxspecError(f"the drafter reads prompts of at most {pairs + 1} tokens, one token per hidden "
                                 f"state; got tokens {tuple(tokens.shape)} and hidden states {tuple(condition.shape)}")
        return tokens

    def _condition_pairs(self, condition: torch.Tensor, tokens: torch.Tensor | None):
        """The condition's pairs ``t = 0 .. P-1`` (module docstring) through ``fc``: ``h [R, P,
        dim]``, their RoPE ``positions [R, P]``, which are real (not padding) ``valid [R, P]`` and
        image pair 0's position ``start [R]``. LlamaGen blocks: token 0 at the table's zero rows,
        all real, image pair ``j`` at row ``P + j``. A family drafter: token ``t + 1`` at the
        target's position of ``t`` (left padding skipped), as LANTERN's ``input_ids[:, 1:]``."""
        rows = condition.shape[0]
        tokens = self._check_condition(condition, tokens, rows)
        count = tokens.shape[1] - 1
        if self.family == LLAMAGEN:
            positions = torch.arange(count, device=tokens.device).expand(rows, -1)
            valid = torch.ones(rows, count, dtype=torch.bool, device=tokens.device)
            start = torch.full((rows,), count, device=tokens.device)
        else:
            real = tokens >= 0
            padding = (~real).sum(-1, keepdim=True)
            position = (torch.arange(count + 1, device=tokens.device) - padding).clamp(min=0)
            positions, valid, start = position[:, :-1], real[:, :-1], position[:, -1]
        pair_tokens = tokens[:, 1:].clamp(min=0)
        h = self.fc(torch.cat([self._embed(pair_tokens, vocabulary=True),
                               condition[:, :count].to(self.fc.weight.dtype)], dim=-1))
        return h, positions, valid, start

    @staticmethod
    def _condition_mask(valid: torch.Tensor) -> torch.Tensor:
        """``[R, P, P]``: causal over the condition's real pairs; a padded pair sees itself only
        (its output is never read, and every other query hides it)."""
        count = valid.shape[1]
        causal = torch.ones(count, count, dtype=torch.bool, device=valid.device).tril()
        return (causal & valid[:, None, :]) | torch.eye(count, dtype=torch.bool, device=valid.device)

    def _run_after_condition(self, h: torch.Tensor, positions: torch.Tensor, cache_slots: torch.Tensor | None,
                             attn_mask: torch.Tensor | None, kv_len: int | None, condition: torch.Tensor | None,
                             condition_tokens: torch.Tensor | None) -> torch.Tensor:
        """The layers over image pairs ``h [R, T, dim]`` after the condition's pairs, which every
        image pair sees (where real)."""
        rows, count = h.shape[:2]
        cached = self._kv_store is not None if self.family == LLAMAGEN else self.layers.slots > 0
        if cache_slots is not None and cached:
            # Engine slot s is cache slot P + s; the engine's mask covers its slots, the condition's
            # columns are what setup_caches wrote for this decode.
            pairs = self._condition_slots
            if attn_mask is None:
                keys = torch.arange(self.cache_length if kv_len is None else kv_len, device=h.device)
                attn_mask = keys[None, None, :] <= cache_slots[:, :, None]
            seen = self._condition_keys[:rows].expand(rows, count, pairs)
            return self._layers(h, self._image_start[:rows, None] + positions, cache_slots + pairs,
                                torch.cat([seen, attn_mask], dim=-1), None if kv_len is None else pairs + kv_len)
        if condition is None:
            raise RelaxspecError("this drafter (official LANTERN's layout) reads the condition: give the target's "
                                 "hidden states at the condition positions (condition=)")
        pair_h, pair_positions, valid, start = self._condition_pairs(condition, condition_tokens)
        pairs = pair_h.shape[1]
        full = torch.ones(rows, pairs + count, pairs + count, dtype=torch.bool, device=h.device).tril()
        full[:, :, :pairs] &= valid[:, None, :]
        full[:, :pairs, :pairs] = self._condition_mask(valid)
        if attn_mask is not None:  # [R, T, T] over the image pairs
            full[:, pairs:, pairs:] = attn_mask
        h = torch.cat([pair_h, h], dim=1)
        positions = torch.cat([pair_positions, start[:, None] + positions], dim=1)
        return self._layers(h, positions, None, full, None)[:, pairs:]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def write_condition(drafter: EagleDrafter, condition: torch.Tensor, tokens: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's condition pairs (:meth:`EagleDrafter._condition_pairs`) written into cache
    slots ``0 .. P-1``, each attending causally to the real ones: which pairs are real ``[R, 1, P]``
    (what later queries see) and image pair 0's position ``[R]``. What ``--compile`` compiles."""
    h, positions, valid, start = drafter._condition_pairs(condition, tokens)
    slots = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
    drafter._layers(h, positions, slots, drafter._condition_mask(valid), h.shape[1])
    return valid[:, None, :], start


def load_drafter(path: str | Path, target: TargetModel, dtype: torch.dtype | None = None) -> EagleDrafter:
    """Read a drafter folder written by ``relaxspec train-drafter``
    (:func:`relaxspec.training.drafter.train_drafter`) (``kind == "drafter"``), build it of its
    family's layers and attach it to ``target`` (its device, and its dtype unless ``dtype`` is
    given: training reads fp32 weights as fp32 whatever the target's precision); a drafter made for another
    family or shape of target is refused. Official LANTERN's drafter folders, LlamaGen's and
    Anole's (a transformers ``config.json`` and ``pytorch_model.bin`` or ``model.safetensors``),
    are read by :func:`relaxspec.drafting.lantern_drafter.read_lantern_drafter`."""
    if is_eagle_folder(path):
        fields, state, weights = read_lantern_drafter(path, target)
        drafter = EagleDrafter(DrafterConfig(**fields), target)
        load_strict(drafter, state, str(weights))  # tensor shapes (its one line names the file)
        return drafter.to(device=target.device, dtype=dtype or target.dtype).eval().attach(target)
    loaded = read_state(path)
    if loaded.layout != "relaxspec":
        raise RelaxspecError(f"{path}: a drafter is a relaxspec folder (model.safetensors + config.json), "
                             f"not a {loaded.layout} file")
    if loaded.kind != "drafter":
        raise RelaxspecError(f"{path}: this is a {loaded.kind!r} model, not a drafter")
    config = loaded.config if isinstance(loaded.config, dict) else {}
    unknown = sorted(set(config) - {f.name for f in dataclasses.fields(DrafterConfig)})
    if unknown or not isinstance(config.get("target"), dict):
        raise RelaxspecError(f"{path}: not a drafter config (needs 'target' and 'n_layer'"
                             + (f"; unknown fields {', '.join(unknown)})" if unknown else ")"))
    try:
        config = DrafterConfig(**config)
        check_target(config, target)
        drafter = EagleDrafter(config, target)
    except TypeError as err:
        raise RelaxspecError(f"{path}: bad drafter config ({err})") from None
    except RelaxspecError as err:
        raise RelaxspecError(f"{path}: {err}") from None
    load_strict(drafter, loaded.state_dict, str(path))
    return drafter.to(device=target.device, dtype=dtype or target.dtype).eval().attach(target)
