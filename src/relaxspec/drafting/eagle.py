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

Pair ``j`` sits in cache slot ``j``: the drafter sees no condition positions, only what the
target's features carry about the condition. With CFG the drafter runs on both streams (features
from each stream), exactly like the target.

Official LANTERN's LlamaGen drafters (:mod:`relaxspec.drafting.lantern_drafter` reads their
folders) are LlamaGen blocks with three differences, each a :class:`DrafterConfig` field that
relaxspec's own drafters leave at its default: layer 0 has no input norm
(``first_attention_norm=False``: EAGLE feeds ``fc``'s output to attention raw), the drafter keeps
its own token table (``own_embedding``), and it also reads the condition
(``condition_pairs = P``): ``P`` leading pairs (the target's final hidden state at condition
position ``t``, token 0) for ``t = 0 .. P-1``, at all-zero RoPE, before pair 0 (the feature at the
condition's last position ``P``, image token 0). Image pair ``j`` keeps RoPE row ``j``. The engine
hands every draft source the prefill's hidden states at the condition positions
(``condition_hidden``), which such a drafter writes into its cache first; training passes the
teacher-forced pass's (``condition=``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn

from relaxspec.drafting.family import FamilyLayers, layer_spec, rope_table
from relaxspec.models.llamagen.checkpoints import load_strict, read_state
from relaxspec.errors import RelaxspecError
from relaxspec.models import hf
from relaxspec.models.base import TargetModel
from relaxspec.models.llamagen.gpt import (GPTConfig, TransformerBlock, allocate_kv_store, release_kv_store,
                                  rope_table_2d, run_blocks)


#: The family of drafters built of LlamaGen blocks (and of every drafter file without a family).
LLAMAGEN = "llamagen"


@dataclass
class DrafterConfig:
    """The drafter's own hyper-parameters; width, grid and vocabulary are the target's.

    ``family`` ``"llamagen"``: ``target`` is a LlamaGen ``GPTConfig`` dict (the blocks' shape).
    Any other family (a transformers ``model_type``): ``target`` is the engine's side of the
    target, ``{"dim", "vocab_size", "block_size"}``, and ``layer`` rebuilds the layers:
    ``{"class": decoder layer class, "config": layer config fields}``
    (:func:`relaxspec.drafting.family.layer_spec`).

    LlamaGen blocks only, official LANTERN's layout (defaults: relaxspec's own drafters):
    ``first_attention_norm`` False drops layer 0's input norm; ``own_embedding`` gives the drafter
    its own (frozen) token table instead of the target's; ``condition_pairs`` ``P > 0`` makes it
    read the target's features at the first ``P`` condition positions (a ``P + 1``-token
    condition)."""

    target: dict
    n_layer: int = 1
    family: str = LLAMAGEN
    layer: dict | None = None
    first_attention_norm: bool = True
    own_embedding: bool = False
    condition_pairs: int = 0

    def __post_init__(self) -> None:
        if self.n_layer < 1:
            raise RelaxspecError(f"drafter n_layer must be >= 1, got {self.n_layer}")
        if not isinstance(self.family, str) or not self.family:
            raise RelaxspecError(f"drafter family must be a name, got {self.family!r}")
        if self.family == LLAMAGEN and self.layer is not None:
            raise RelaxspecError("a llamagen drafter takes its shape from 'target'; it has no 'layer'")
        if not (isinstance(self.first_attention_norm, bool) and isinstance(self.own_embedding, bool)):
            raise RelaxspecError("drafter first_attention_norm and own_embedding must be true or false")
        if not isinstance(self.condition_pairs, int) or isinstance(self.condition_pairs, bool) \
                or self.condition_pairs < 0:
            raise RelaxspecError(f"drafter condition_pairs must be a count >= 0, got {self.condition_pairs!r}")
        if self.family != LLAMAGEN and self.lantern_layout:
            raise RelaxspecError(f"a drafter of the {self.family} family has its target's layers: "
                                 "first_attention_norm, own_embedding and condition_pairs are for LlamaGen blocks")
        if self.family != LLAMAGEN:
            layer = self.layer
            if not (isinstance(layer, dict) and isinstance(layer.get("class"), str)
                    and isinstance(layer.get("config"), dict)):
                raise RelaxspecError(f"a drafter of the {self.family} family needs 'layer': "
                                     "{'class': ..., 'config': {...}}")
            if not all(isinstance(self.target.get(key), int) for key in ("dim", "vocab_size", "block_size")):
                raise RelaxspecError(f"a drafter of the {self.family} family needs 'target' with dim, vocab_size "
                                     "and block_size")
            if layer["config"].get("hidden_size") != self.target["dim"]:
                raise RelaxspecError(f"the drafter's layers are {layer['config'].get('hidden_size')} wide, "
                                     f"its target {self.target['dim']}")

    @property
    def target_config(self) -> GPTConfig:
        """A llamagen drafter's block shape."""
        if self.family != LLAMAGEN:
            raise RelaxspecError(f"a drafter of the {self.family} family has no LlamaGen block config")
        return GPTConfig.from_dict(self.target)

    @property
    def dim(self) -> int:
        return int(self.target["dim"])

    @property
    def lantern_layout(self) -> bool:
        """Whether any of official LANTERN's departures from relaxspec's own drafter is set."""
        return not self.first_attention_norm or self.own_embedding or self.condition_pairs > 0

    def to_dict(self) -> dict:
        """As ``config.json`` records it; a llamagen drafter's as it always was (no family, and
        LANTERN's fields only when set)."""
        if self.family == LLAMAGEN:
            lantern = {name: getattr(self, name) for name in LANTERN_FIELDS
                       if getattr(self, name) != DEFAULTS[name]}
            return {"target": self.target, "n_layer": self.n_layer, **lantern}
        return {key: value for key, value in asdict(self).items() if key not in LANTERN_FIELDS}


#: Official LANTERN's layout of LlamaGen blocks (:class:`DrafterConfig`) and their defaults.
LANTERN_FIELDS = ("first_attention_norm", "own_embedding", "condition_pairs")
DEFAULTS = {f.name: f.default for f in dataclasses.fields(DrafterConfig)}


def drafter_target_config(target: TargetModel) -> dict:
    """The target's shape as the drafter's blocks need it (a LlamaGen ``GPTConfig`` dict): a
    LlamaGen target's own config; for any other :class:`TargetModel` one built from its
    ``config`` (``dim``, ``vocab_size``, ``block_size``, ``cls_token_num``, ``num_classes``,
    ``model_type``), with ``config.n_head`` heads if it says, else heads of 64 dims (or the widest
    that divides ``dim`` in multiples of 4, as the 2D RoPE needs)."""
    config = target.config
    if isinstance(config, GPTConfig):
        return config.to_dict()
    dim = int(config.dim)
    heads = getattr(config, "n_head", None)
    if heads is None or dim % heads or (dim // heads) % 4:
        fits = [h for h in range(1, dim + 1) if dim % h == 0 and (dim // h) % 4 == 0]
        if not fits:
            raise RelaxspecError(f"the target's width {dim} has no head size that is a multiple of 4: "
                                 "an EAGLE drafter cannot be built for it")
        heads = min(fits, key=lambda h: (abs(dim // h - 64), h))
    shape = GPTConfig(dim=dim, n_layer=1, n_head=int(heads), vocab_size=int(config.vocab_size),
                      block_size=int(config.block_size), cls_token_num=int(config.cls_token_num),
                      num_classes=max(1, int(getattr(config, "num_classes", 1) or 1)),
                      model_type=getattr(config, "model_type", "c2i"), multiple_of=32)
    return shape.to_dict()


def engine_shape(target: TargetModel) -> dict:
    """What a transformers-family drafter shares with its target: feature width, vocabulary
    (the codebook) and image tokens."""
    config = target.config
    return {"dim": int(config.dim), "vocab_size": int(config.vocab_size), "block_size": int(config.block_size)}


def drafter_config(target: TargetModel, n_layer: int = 1, family: str | None = None) -> DrafterConfig:
    """A new drafter's config for ``target``: of the target's own family (default; LlamaGen blocks
    for a LlamaGen target or one known only by the protocol), or ``family="llamagen"`` for
    LlamaGen blocks sized from any target."""
    own = hf.family_of(target)
    family = family or own or LLAMAGEN
    if family == LLAMAGEN:
        return DrafterConfig(target=drafter_target_config(target), n_layer=n_layer)
    if family != own:
        raise RelaxspecError(f"a drafter of the {family} family is built of its target's layers; this target is "
                             f"{own or 'not a transformers model'}")
    return DrafterConfig(target=engine_shape(target), n_layer=n_layer, family=family,
                         layer=layer_spec(hf.text_model_of(target), n_layer))


def check_target(config: DrafterConfig, target: TargetModel) -> None:
    """Refuse (one line) a ``target`` the drafter was not made for: another family, or another
    width, vocabulary, grid (or, for LlamaGen blocks, heads)."""
    if config.family == LLAMAGEN:
        tcfg, mine = GPTConfig.from_dict(drafter_target_config(target)), config.target_config
        theirs, ours = (tcfg.dim, tcfg.vocab_size, tcfg.block_size, tcfg.n_head), \
            (mine.dim, mine.vocab_size, mine.block_size, mine.n_head)
        what = "dim/vocab/grid/heads"
        if config.lantern_layout:  # LANTERN's drafter has heads of its own
            theirs, ours, what = theirs[:3], ours[:3], "dim/vocab/grid"
    else:
        own = hf.family_of(target)
        if own != config.family:
            raise RelaxspecError(f"the drafter is of the {config.family} family (its target's layers); this target "
                                 f"is {own or 'not a transformers model'}")
        shape = engine_shape(target)
        theirs, ours = tuple(shape.values()), tuple(config.target[key] for key in shape)
        what = "dim/vocab/grid"
    if theirs != ours:
        raise RelaxspecError(f"the drafter was trained for a different target ({what} {ours} vs {theirs})")
    if config.condition_pairs:
        cls = int(target.config.cls_token_num)
        if cls != config.condition_pairs + 1:
            raise RelaxspecError(f"the drafter reads a {config.condition_pairs + 1}-token condition "
                                 f"({config.condition_pairs} condition pairs); this target's condition is {cls} tokens")


class EagleDrafter(nn.Module):
    """``fc`` + ``n_layer`` layers of the target's family over (feature, token) pairs.

    ``target``: the target whose family's layer classes a transformers-family drafter is built of
    (not needed for LlamaGen blocks). Call :meth:`attach` with the target before use: it borrows
    the target's embedding and head.
    """

    def __init__(self, config: DrafterConfig, target: TargetModel | None = None):
        super().__init__()
        self.config = config
        if config.family == LLAMAGEN:
            tcfg = config.target_config
            self.fc = nn.Linear(2 * tcfg.dim, tcfg.dim, bias=True)
            self.layers = nn.ModuleList(TransformerBlock(tcfg) for _ in range(config.n_layer))
            if not config.first_attention_norm:  # LANTERN: fc's output enters attention un-normed
                self.layers[0].attention_norm = nn.Identity()
            if config.own_embedding:  # LANTERN: its own copy, frozen (trained drafters never move it)
                self.embed_tokens = nn.Embedding(tcfg.vocab_size, tcfg.dim).requires_grad_(False)
            self.register_buffer("rope", rope_table_2d(tcfg.grid_size, tcfg.head_dim, tcfg.rope_base, 0),
                                 persistent=False)
        else:
            if target is None:
                raise RelaxspecError(f"a drafter of the {config.family} family is built of its target's layers: "
                                     "give the target")
            check_target(config, target)
            text_model = hf.text_model_of(target)
            self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
            self.layers = FamilyLayers(text_model, config.layer, config.n_layer)
            # [block_size, 2, head_dim]: the family rotary's (cos, sin) of image-token index j
            self.register_buffer("rope", rope_table(text_model, self.layers.text_config, config.target["block_size"]),
                                 persistent=False)
        self._target: tuple[TargetModel] | None = None  # a tuple so the target is not a submodule
        self._kv_store: torch.Tensor | None = None
        self._condition_seen: torch.Tensor | None = None  # [rows, 1, 1]: the cached condition pairs are real
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @property
    def family(self) -> str:
        return self.config.family

    @classmethod
    def for_target(cls, target: TargetModel, n_layer: int = 1, family: str | None = None) -> "EagleDrafter":
        """A new (untrained) drafter of ``target``'s family (:func:`drafter_config`), in its dtype."""
        drafter = cls(drafter_config(target, n_layer, family), target)
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

    def setup_caches(self, rows: int, max_seq: int, condition: torch.Tensor | None = None) -> None:
        """Static caches for ``rows`` rows of ``max_seq`` slots, reused while the shape stays.
        A drafter that reads the condition (``condition_pairs`` P) also writes its pairs from
        ``condition [rows, >= P, dim]``, the target's hidden states at the condition positions
        of this decode's prefill; without them (timing a step) those slots stay hidden."""
        if self.family != LLAMAGEN:
            self.layers.setup(rows, max_seq, self.fc.weight.dtype, self.fc.weight.device)
            return
        att = self.layers[0].attention
        pairs = self.config.condition_pairs  # the condition's pairs sit in slots 0..P-1, before the engine's
        allocate_kv_store(self, self.layers, rows, pairs + max_seq, att.n_kv_head, att.head_dim,
                          self.fc.weight.dtype, self.fc.weight.device)
        if pairs:
            self._cache_condition(rows, condition)

    def _cache_condition(self, rows: int, condition: torch.Tensor | None) -> None:
        """Write the condition's pairs (``condition [rows, >= P, dim]``: the target's hidden states
        at condition positions ``0 .. P-1``) into slots ``0 .. P-1``; without them they stay hidden
        from every query."""
        device = self.fc.weight.device
        self._condition_seen = torch.full((rows, 1, 1), condition is not None, device=device)
        if condition is None:
            return
        pairs = self.config.condition_pairs
        if condition.shape[0] != rows or condition.shape[1] < pairs:
            raise RelaxspecError(f"the drafter reads {pairs} condition positions of {rows} rows; got hidden states "
                                 f"{tuple(condition.shape)}")
        slots = torch.arange(pairs, device=device).expand(rows, -1)
        run_blocks(self.layers, self._condition_input(condition[:, :pairs]), self._condition_rope(rows), slots, None,
                   None)

    @property
    def cache_length(self) -> int:
        """Slots of the current caches (the engine's: the condition's, if any, come before)."""
        if self.family != LLAMAGEN:
            return self.layers.slots
        return self._kv_store.shape[4] - self.config.condition_pairs

    def clear_caches(self) -> None:
        if self.family != LLAMAGEN:
            self.layers.clear()
        else:
            release_kv_store(self, self.layers)
            self._condition_seen = None

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *,
                cache_slots: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                kv_len: int | None = None, condition: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``features [R, T, dim]`` (target hidden states that predicted ``tokens``), ``tokens
        [R, T]``, ``positions [R, T]`` image-token indices. Returns the predicted next features
        ``[R, T, dim]`` and their draft logits ``[R, T, vocab]`` (fp32, unprocessed).

        A drafter with ``condition_pairs`` P also attends to the condition's pairs: with caches,
        those :meth:`setup_caches` wrote; without, ``condition [R, >= P, dim]`` (the target's
        final hidden states at condition positions ``0 .. P-1``, required), run before the ``T``
        pairs."""
        target = self.target
        h = self.fc(torch.cat([self._embed(tokens), features.to(self.fc.weight.dtype)], dim=-1))
        if self.family != LLAMAGEN:
            h = self.layers.run(h, self.rope[positions], positions, cache_slots, attn_mask, kv_len)
        elif self.config.condition_pairs:
            h = self._run_after_condition(h, self.rope[positions], cache_slots, attn_mask, kv_len, condition)
        else:
            h = run_blocks(self.layers, h, self.rope[positions], cache_slots, attn_mask, kv_len)
        return h, target.head(h)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.config.own_embedding else self.target.embed_tokens
        return table(tokens).to(self.fc.weight.dtype)

    def _condition_input(self, features: torch.Tensor) -> torch.Tensor:
        """``fc`` of the condition's pairs: (token 0, the target's feature at position ``t``), as
        LANTERN pairs its ``[0] * P`` input ids with the prefill's hidden states."""
        tokens = torch.zeros(features.shape[:2], dtype=torch.long, device=features.device)
        return self.fc(torch.cat([self._embed(tokens), features.to(self.fc.weight.dtype)], dim=-1))

    def _condition_rope(self, rows: int) -> torch.Tensor:
        """The condition's RoPE rows: all zero (LANTERN's table has ``P`` zero rows first)."""
        return self.rope.new_zeros(rows, self.config.condition_pairs, *self.rope.shape[1:])

    def _run_after_condition(self, h: torch.Tensor, rope: torch.Tensor, cache_slots: torch.Tensor | None,
                             attn_mask: torch.Tensor | None, kv_len: int | None,
                             condition: torch.Tensor | None) -> torch.Tensor:
        """The blocks over ``h [R, T, dim]`` after the condition's P pairs, which every pair sees."""
        rows, count = h.shape[:2]
        pairs = self.config.condition_pairs
        if cache_slots is not None and self._kv_store is not None:
            # Engine slot s is cache slot P + s; the engine's mask covers its slots, the condition's
            # columns are visible when they were written for this decode.
            if attn_mask is None:
                keys = torch.arange(self.cache_length if kv_len is None else kv_len, device=h.device)
                attn_mask = keys[None, None, :] <= cache_slots[:, :, None]
            seen = self._condition_seen[:rows].expand(rows, count, pairs)
            return run_blocks(self.layers, h, rope, cache_slots + pairs, torch.cat([seen, attn_mask], dim=-1),
                              None if kv_len is None else pairs + kv_len)
        if condition is None:
            raise RelaxspecError("this drafter (official LANTERN's layout) reads the condition: give the target's "
                                 "hidden states at the condition positions (condition=)")
        h = torch.cat([self._condition_input(condition[:, :pairs]), h], dim=1)
        rope = torch.cat([self._condition_rope(rows), rope], dim=1)
        if attn_mask is not None:  # [R, T, T] over the pairs -> [R, P+T, P+T]: condition causal, seen by all
            full = torch.ones(rows, pairs + count, pairs + count, dtype=torch.bool, device=h.device).tril()
            full[:, pairs:, pairs:] = attn_mask
            attn_mask = full
        return run_blocks(self.layers, h, rope, None, attn_mask, None)[:, pairs:]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def load_drafter(path: str | Path, target: TargetModel, dtype: torch.dtype | None = None) -> EagleDrafter:
    """Read a drafter folder written by ``relaxspec train-drafter``
    (:func:`relaxspec.training.drafter.train_drafter`) (``kind == "drafter"``), build it of its
    family's layers and attach it to ``target`` (its device, and its dtype unless ``dtype`` is
    given: training reads fp32 weights as fp32 whatever the target's precision); a drafter made for another
    family or shape of target is refused. Official LANTERN's LlamaGen drafter folders (a
    transformers ``config.json`` and ``pytorch_model.bin`` or ``model.safetensors``) are read by
    :func:`relaxspec.drafting.lantern_drafter.read_lantern_drafter`."""
    from relaxspec.drafting.lantern_drafter import is_eagle_folder, read_lantern_drafter

    if is_eagle_folder(path):
        fields, state, weights = read_lantern_drafter(path, target)
        drafter = EagleDrafter(DrafterConfig(**fields))
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
