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
    (:func:`relaxspec.drafting.family.layer_spec`)."""

    target: dict
    n_layer: int = 1
    family: str = LLAMAGEN
    layer: dict | None = None

    def __post_init__(self) -> None:
        if self.n_layer < 1:
            raise RelaxspecError(f"drafter n_layer must be >= 1, got {self.n_layer}")
        if not isinstance(self.family, str) or not self.family:
            raise RelaxspecError(f"drafter family must be a name, got {self.family!r}")
        if self.family == LLAMAGEN and self.layer is not None:
            raise RelaxspecError("a llamagen drafter takes its shape from 'target'; it has no 'layer'")
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

    def to_dict(self) -> dict:
        """As ``config.json`` records it; a llamagen drafter's as it always was (no family)."""
        if self.family == LLAMAGEN:
            return {"target": self.target, "n_layer": self.n_layer}
        return asdict(self)


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

    def setup_caches(self, rows: int, max_seq: int) -> None:
        """Static caches for ``rows`` rows of ``max_seq`` slots, reused while the shape stays."""
        if self.family != LLAMAGEN:
            self.layers.setup(rows, max_seq, self.fc.weight.dtype, self.fc.weight.device)
            return
        att = self.layers[0].attention
        allocate_kv_store(self, self.layers, rows, max_seq, att.n_kv_head, att.head_dim, self.fc.weight.dtype,
                          self.fc.weight.device)

    @property
    def cache_length(self) -> int:
        """Slots of the current caches."""
        return self.layers.slots if self.family != LLAMAGEN else self._kv_store.shape[4]

    def clear_caches(self) -> None:
        if self.family != LLAMAGEN:
            self.layers.clear()
        else:
            release_kv_store(self, self.layers)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *,
                cache_slots: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``features [R, T, dim]`` (target hidden states that predicted ``tokens``), ``tokens
        [R, T]``, ``positions [R, T]`` image-token indices. Returns the predicted next features
        ``[R, T, dim]`` and their draft logits ``[R, T, vocab]`` (fp32, unprocessed)."""
        target = self.target
        emb = target.embed_tokens(tokens).to(self.fc.weight.dtype)
        h = self.fc(torch.cat([emb, features.to(self.fc.weight.dtype)], dim=-1))
        if self.family != LLAMAGEN:
            h = self.layers.run(h, self.rope[positions], positions, cache_slots, attn_mask, kv_len)
        else:
            h = run_blocks(self.layers, h, self.rope[positions], cache_slots, attn_mask, kv_len)
        return h, target.head(h)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def load_drafter(path: str | Path, target: TargetModel, dtype: torch.dtype | None = None) -> EagleDrafter:
    """Read a drafter folder written by ``relaxspec train-drafter``
    (:func:`relaxspec.training.drafter.train_drafter`) (``kind == "drafter"``), build it of its
    family's layers and attach it to ``target`` (its device, and its dtype unless ``dtype`` is
    given: training reads fp32 weights as fp32 whatever the target's precision); a drafter made for another
    family or shape of target is refused."""
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
