"""EAGLE drafter for LlamaGen transformers (arXiv 2401.15077, 2406.16858; REFERENCE §1.6).

The drafter autoregresses on *features*: pair ``j`` is (the target's final hidden state that
predicted image token ``j``, the embedding of token ``j``) and the drafter's output there is its
guess of the feature that predicts token ``j + 1``; the target's frozen output head turns that
guess into draft logits. The token embedding and the head are the target's, shared and never
trained or stored; only ``fc`` (2d -> d) and one transformer block are the drafter's own.

Pair ``j`` uses the RoPE position of image token ``j`` (table row ``cls_token_num + j``) and sits
in cache slot ``j``: the drafter sees no condition positions, only what the target's features
carry about the condition. With CFG the drafter runs on both streams (features from each
stream), exactly like the target.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn

from relaxspec.models.llamagen.checkpoints import load_strict, read_state
from relaxspec.errors import RelaxspecError
from relaxspec.models.base import TargetModel
from relaxspec.models.llamagen.gpt import (GPTConfig, TransformerBlock, allocate_kv_store, release_kv_store,
                                  rope_table_2d, run_blocks)


@dataclass
class DrafterConfig:
    """The drafter's own hyper-parameters; width, heads, grid and vocabulary are the target's."""

    target: dict  # the target's GPTConfig as a dict
    n_layer: int = 1

    def __post_init__(self) -> None:
        if self.n_layer < 1:
            raise RelaxspecError(f"drafter n_layer must be >= 1, got {self.n_layer}")

    @property
    def target_config(self) -> GPTConfig:
        return GPTConfig.from_dict(self.target)

    def to_dict(self) -> dict:
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


class EagleDrafter(nn.Module):
    """``fc`` + ``n_layer`` LlamaGen blocks over (feature, token) pairs.

    Call :meth:`attach` with the target before use: it borrows the target's embedding and head.
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        tcfg = config.target_config
        self.fc = nn.Linear(2 * tcfg.dim, tcfg.dim, bias=True)
        self.layers = nn.ModuleList(TransformerBlock(tcfg) for _ in range(config.n_layer))
        self.register_buffer("rope", rope_table_2d(tcfg.grid_size, tcfg.head_dim, tcfg.rope_base, 0), persistent=False)
        self._target: tuple[TargetModel] | None = None  # a tuple so the target is not a submodule
        self._kv_store: torch.Tensor | None = None
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @classmethod
    def for_target(cls, target: TargetModel, n_layer: int = 1) -> "EagleDrafter":
        drafter = cls(DrafterConfig(target=drafter_target_config(target), n_layer=n_layer))
        return drafter.to(target.dtype).attach(target)

    def attach(self, target: TargetModel) -> "EagleDrafter":
        tcfg, mine = GPTConfig.from_dict(drafter_target_config(target)), self.config.target_config
        if (tcfg.dim, tcfg.vocab_size, tcfg.block_size, tcfg.n_head) != (mine.dim, mine.vocab_size, mine.block_size, mine.n_head):
            raise RelaxspecError(
                "the drafter was trained for a different target (dim/vocab/grid/heads "
                f"{(mine.dim, mine.vocab_size, mine.block_size, mine.n_head)} vs {(tcfg.dim, tcfg.vocab_size, tcfg.block_size, tcfg.n_head)})"
            )
        self._target = (target,)
        return self

    @property
    def target(self) -> TargetModel:
        if self._target is None:
            raise RuntimeError("call drafter.attach(target) first")
        return self._target[0]

    def setup_caches(self, rows: int, max_seq: int) -> None:
        """Static caches for ``rows`` rows of ``max_seq`` slots, reused while the shape stays."""
        att = self.layers[0].attention
        allocate_kv_store(self, self.layers, rows, max_seq, att.n_kv_head, att.head_dim, self.fc.weight.dtype,
                          self.fc.weight.device)

    @property
    def cache_length(self) -> int:
        """Slots of the current caches."""
        return self._kv_store.shape[4]

    def clear_caches(self) -> None:
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
        h = run_blocks(self.layers, h, self.rope[positions], cache_slots, attn_mask, kv_len)
        return h, target.head(h)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def load_drafter(path: str | Path, target: TargetModel) -> EagleDrafter:
    """Read a drafter folder written by ``relaxspec train-drafter``
    (:func:`relaxspec.training.drafter.train_drafter`) (``kind == "drafter"``) and attach it
    to ``target`` (its dtype and device)."""
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
        drafter = EagleDrafter(DrafterConfig(**config))
    except TypeError as err:
        raise RelaxspecError(f"{path}: bad drafter config ({err})") from None
    load_strict(drafter, loaded.state_dict, str(path))
    return drafter.to(device=target.device, dtype=target.dtype).eval().attach(target)
