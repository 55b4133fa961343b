"""LlamaGen's GPT (arXiv 2406.06525), reproduced exactly, with the hooks speculative decoding needs.

One file a reader can hold in mind: a dataclass of hyper-parameters, the named-config table, the
transformer and its static KV cache. Parameter names match the official checkpoints
(REFERENCE §2.3) so that ``load_state_dict(strict=True)`` works on them.

Two departures from upstream's *interface* (not its arithmetic):

* RoPE position and KV-cache slot are separate inputs (upstream uses one ``input_pos`` for both),
  and an explicit attention mask may be given: tree verification writes sibling drafts into
  neighbouring slots while they share a RoPE position.
* ``forward`` can return the final (normed) hidden states with the logits: the EAGLE drafter
  consumes them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from relaxspec.errors import RelaxspecError
from relaxspec.models.base import run_capturing
from relaxspec.models.llamagen.lantern_rows import lantern_caption_bias

MODEL_TYPES = ("c2i", "t2i")


@dataclass
class GPTConfig:
    """Hyper-parameters of a LlamaGen transformer (upstream ``ModelArgs``, inference fields only)."""

    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    vocab_size: int = 16384
    model_type: str = "c2i"
    num_classes: int = 1000
    caption_dim: int = 2048
    cls_token_num: int = 1
    block_size: int = 256  # image tokens = grid * grid

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        self.validate()

    def validate(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise RelaxspecError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        for name in ("dim", "n_layer", "n_head", "n_kv_head", "vocab_size", "cls_token_num", "block_size"):
            if int(getattr(self, name)) <= 0:
                raise RelaxspecError(f"GPT config field {name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_head:
            raise RelaxspecError(f"dim {self.dim} is not divisible by n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            raise RelaxspecError(f"n_head {self.n_head} is not divisible by n_kv_head {self.n_kv_head}")
        if self.head_dim % 4:
            raise RelaxspecError(f"head dim {self.head_dim} must be a multiple of 4 for LlamaGen's 2D RoPE")
        if math.isqrt(self.block_size) ** 2 != self.block_size:
            raise RelaxspecError(f"block_size {self.block_size} must be a square number of image tokens")
        if self.model_type == "c2i" and self.num_classes <= 0:
            raise RelaxspecError("a c2i model needs num_classes > 0")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def grid_size(self) -> int:
        return math.isqrt(self.block_size)

    @property
    def condition_length(self) -> int:
        """The condition's slots before the image (``C``, what every target model's config
        says): upstream's ``cls_token_num``."""
        return self.cls_token_num

    @property
    def ffn_dim(self) -> int:
        """SwiGLU width: ``int(2 * 4 * dim / 3)`` (times the optional multiplier) rounded up to
        ``multiple_of``, as upstream ``FeedForward`` computes it."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return -(-hidden // self.multiple_of) * self.multiple_of

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GPTConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RelaxspecError(f"unknown GPT config fields: {', '.join(unknown)}")
        return cls(**data)


#: Upstream's named sizes (REFERENCE §2.1). Conditioning fields are filled in by :func:`gpt_config`.
GPT_SIZES: dict[str, dict] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
}



def block_shape(*, dim: int, n_head: int, vocab_size: int, block_size: int, condition_length: int,
                num_classes: int, model_type: str, multiple_of: int = 256) -> GPTConfig:
    """A one-layer ``GPTConfig`` of LlamaGen blocks shaped for a target of any family (what an
    EAGLE drafter of LlamaGen blocks is built from)."""
    return GPTConfig(dim=dim, n_layer=1, n_head=n_head, vocab_size=vocab_size, block_size=block_size,
                     cls_token_num=condition_length, num_classes=num_classes, model_type=model_type,
                     multiple_of=multiple_of)
def gpt_config(name: str, *, image_size: int = 256, downsample: int = 16, model_type: str = "c2i", **overrides) -> GPTConfig:
    """The config of a named LlamaGen model at an image resolution.

    ``image_size`` and ``downsample`` fix the token grid (256 px / 16 = 16x16 = 256 tokens); the
    RoPE table depends on it, so a checkpoint must run at its training resolution.
    """
    if name not in GPT_SIZES:
        raise RelaxspecError(f"unknown model name {name!r}; choose one of {', '.join(GPT_SIZES)}")
    if image_size <= 0 or image_size % downsample:
        raise RelaxspecError(f"image size {image_size} is not a multiple of the tokenizer's downsampling {downsample}")
    grid = image_size // downsample
    fields = dict(GPT_SIZES[name], block_size=grid * grid, model_type=model_type,
                  cls_token_num=120 if model_type == "t2i" else 1)
    fields.update(overrides)
    return GPTConfig(**fields)


# --------------------------------------------------------------------------------------------
# 2D RoPE
# --------------------------------------------------------------------------------------------


def rope_table_2d(grid_size: int, head_dim: int, base: float = 10000.0, cls_token_num: int = 1) -> torch.Tensor:
    """LlamaGen's 2D rotary table, ``[cls_token_num + grid_size**2, head_dim // 2, 2]`` (cos, sin).

    Image token ``k = i * grid + j`` rotates its first ``head_dim / 4`` pairs by ``i * w_m`` and the
    rest by ``j * w_m`` with ``w_m = base ** (-2m / (head_dim / 2))``. Condition positions get an
    all-zero table, so their queries and keys are multiplied by zero — upstream does this and a
    compatible implementation must too (REFERENCE §2.1).
    """
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))  # [head_dim/4]
    t = torch.arange(grid_size, dtype=torch.float32)
    angles = torch.outer(t, freqs)  # [grid, head_dim/4]
    grid = torch.cat(
        [angles[:, None, :].expand(-1, grid_size, -1), angles[None, :, :].expand(grid_size, -1, -1)], dim=-1
    )  # [grid, grid, head_dim/2]: row angle pairs, then column angle pairs
    table = torch.stack([torch.cos(grid), torch.sin(grid)], dim=-1).flatten(0, 1)
    return torch.cat([torch.zeros(cls_token_num, half, 2), table])


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x [B, T, H, D]`` by ``table [B, T, D/2, 2]`` (fp32 math)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    t = table[:, :, None]
    out = torch.stack(
        [xs[..., 0] * t[..., 0] - xs[..., 1] * t[..., 1], xs[..., 1] * t[..., 0] + xs[..., 0] * t[..., 1]], dim=-1
    )
    return out.flatten(3).type_as(x)


# --------------------------------------------------------------------------------------------
# Modules (names follow upstream so official state dicts load strictly)
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 whatever the weights' dtype, as upstream does.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class KVCache:
    """One layer's static cache: views ``k_cache`` / ``v_cache`` ``[batch, kv_heads, max_seq,
    head_dim]`` into the stacked store of all layers (:func:`allocate_kv_store`), written at
    explicit slots."""

    def __init__(self, store: torch.Tensor, layer: int):
        self.store, self.layer = store, layer
        _, _, rows, heads, _, _ = store.shape
        device = store.device
        # Index tensors of (layer, k/v, row, head): a write is one index_put_ on the store itself,
        # which torch.compile turns into an in-place write (through a view it copies the store).
        self._index = (torch.full((1, 1, 1, 1), layer, device=device), torch.arange(2, device=device).view(2, 1, 1, 1),
                       torch.arange(rows, device=device).view(1, rows, 1, 1),
                       torch.arange(heads, device=device).view(1, 1, heads, 1))

    @property
    def k_cache(self) -> torch.Tensor:
        return self.store[self.layer, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.store[self.layer, 1]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``slots [B, T]``; ``k, v [B, H, T, D]``: one in-place write for both."""
        self.store.index_put_((*self._index, slots[None, :, None, :]), torch.stack([k, v]).to(self.store.dtype))


def allocate_kv_store(owner: nn.Module, layers: nn.ModuleList, batch: int, max_seq: int, kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """One ``[layers, 2, batch, kv_heads, max_seq, head_dim]`` tensor for every layer's keys and
    values, kept on ``owner`` and reused while the shape, dtype and device stay the same (a
    decode never allocates its cache twice; stale entries are never attended: every query's
    mask covers only slots written for it). Compaction moves all layers in one gather and one
    in-place write (:func:`move_kv`)."""
    shape = (len(layers), 2, batch, kv_heads, max_seq, head_dim)
    store = getattr(owner, "_kv_store", None)
    if store is not None and tuple(store.shape) == shape and store.dtype == dtype and store.device == torch.device(device):
        if all(layer.attention.kv_cache is not None and layer.attention.kv_cache.store is store for layer in layers):
            return store  # the same tensors and index tables: compiled graphs see the same addresses
    else:
        release_kv_store(owner, layers)  # free the old store before allocating the new one
        store = torch.zeros(shape, dtype=dtype, device=device)
        owner._kv_store = store
    owner._kv_index = kv_index(store)
    for index, layer in enumerate(layers):
        layer.attention.kv_cache = KVCache(store, index)
    return store


def kv_index(store: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Index tensors of every (layer, k/v, row, head) of ``store``, broadcastable ``[L, 2, R, H, 1]``:
    with a slot index ``[1, 1, R, 1, n]`` they address ``n`` slots of every layer (:func:`move_kv`)."""
    layers, _, rows, heads, _, _ = store.shape
    device = store.device
    return (torch.arange(layers, device=device).view(layers, 1, 1, 1, 1), torch.arange(2, device=device).view(1, 2, 1, 1, 1),
            torch.arange(rows, device=device).view(1, 1, rows, 1, 1), torch.arange(heads, device=device).view(1, 1, 1, heads, 1))


def release_kv_store(owner: nn.Module, layers: nn.ModuleList) -> None:
    """Drop the caches and free the store."""
    for layer in layers:
        layer.attention.kv_cache = None
    owner._kv_store = owner._kv_index = None


def move_kv(store: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, index: tuple[torch.Tensor, ...] | None = None) -> None:
    """Copy slots ``src [B, n]`` onto ``dst [B, n]`` in every layer's keys and values: one gather
    and one in-place write whatever the depth (KV compaction after tree verification). All reads
    happen before any write, so a source slot may also be a destination. ``index``:
    :func:`kv_index` of ``store``, made once with the store.

    The write is an ``index_put_``, which inductor performs in place on the store a compiled step
    receives; a ``scatter_`` into it would be compiled as a clone of the whole store, the scatter
    and a copy back (issue 51: ~390 MB of traffic a step for GPT-XL at batch 1 with CFG)."""
    index = kv_index(store) if index is None else index
    values = store[(*index, src[None, None, :, None, :])]  # [L, 2, B, H, n, D]
    store.index_put_((*index, dst[None, None, :, None, :]), values)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        total = (config.n_head + 2 * config.n_kv_head) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x, rope, slots, mask, kv_len):
        b, t, _ = x.shape
        kv_size = self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([self.n_head * self.head_dim, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(b, t, self.n_head, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(b, t, self.n_kv_head, self.head_dim), rope).transpose(1, 2)
        v = v.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.kv_cache is not None and slots is not None:
            self.kv_cache.write(slots, k, v)
            k, v = self.kv_cache.k_cache, self.kv_cache.v_cache
            if kv_len is not None:
                k, v = k[:, :, :kv_len], v[:, :, :kv_len]
        if self.n_kv_head != self.n_head:
            rep = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, rope, slots, mask, kv_len):
        h = x + self.attention(self.attention_norm(x), rope, slots, mask, kv_len)
        return h + self.feed_forward(self.ffn_norm(h))


def run_blocks(layers: nn.ModuleList, h: torch.Tensor, rope: torch.Tensor, cache_slots: torch.Tensor | None,
               attn_mask: torch.Tensor | None, kv_len: int | None,
               capture: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run transformer blocks over ``h [B, T, dim]``. With caches and ``cache_slots [B, T]`` the
    inputs are written to those slots and attend to the first ``kv_len`` slots (default: the
    whole cache, so shapes never depend on the data), by default causally by slot; without,
    attention is plain causal over the ``T`` inputs. Returns the last block's output and, with
    ``capture``, the streams entering those blocks (:func:`relaxspec.models.base.run_capturing`)."""
    cache = layers[0].attention.kv_cache
    if cache_slots is not None and cache is not None:
        if attn_mask is None:
            keys = torch.arange(cache.store.shape[4] if kv_len is None else kv_len, device=h.device)
            attn_mask = keys[None, None, :] <= cache_slots[:, :, None]
    else:
        cache_slots = None
    return run_capturing(layers, h, lambda layer, x: layer(x, rope, cache_slots, attn_mask, kv_len), capture)


class LabelEmbedder(nn.Module):
    """c2i condition: one token per class; id ``num_classes`` is the learned null class."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(labels).unsqueeze(1)  # [B, 1, dim]


class CaptionMLP(nn.Module):
    def __init__(self, in_features: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """t2i condition: ``cls_token_num`` text features through ``cap_proj``; ``uncond_embedding``
    replaces the text for the unconditional CFG stream."""

    def __init__(self, caption_dim: int, dim: int, token_num: int):
        super().__init__()
        self.cap_proj = CaptionMLP(caption_dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)

    def forward(self, captions: torch.Tensor) -> torch.Tensor:
        return self.cap_proj(captions)


class Transformer(nn.Module):
    """LlamaGen GPT.

    Positions: the condition occupies table positions ``0 .. cls_token_num - 1``; image token
    ``k`` sits at ``cls_token_num + k``; the logits at position ``cls_token_num - 1 + k`` predict
    image token ``k``.
    """

    checkpoint_kind = "gpt"  # config.json's "kind" when saved (relaxspec.models.weights.save_model)

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        if config.model_type == "c2i":
            self.cls_embedding: nn.Module = LabelEmbedder(config.num_classes, config.dim)
        else:
            self.cls_embedding = CaptionEmbedder(config.caption_dim, config.dim, config.cls_token_num)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        table = rope_table_2d(config.grid_size, config.head_dim, config.rope_base, config.cls_token_num)
        self.register_buffer("rope", table, persistent=False)
        self.max_batch = 0
        self.max_seq = 0
        self._kv_store: torch.Tensor | None = None
        self._kv_index: tuple[torch.Tensor, ...] | None = None
        self.class_names: list[str] | None = None  # set by load_gpt when the checkpoint names them
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Upstream's initialisation (std 0.02); only matters for training from scratch.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    # ---------------------------------------------------------------- caches
    def setup_caches(self, batch: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        """Allocate static KV caches for ``batch`` rows of ``max_seq`` slots each."""
        config = self.config
        allocate_kv_store(self, self.layers, batch, max_seq, config.n_kv_head, config.head_dim,
                          dtype or self.output.weight.dtype, self.output.weight.device)
        self.max_batch, self.max_seq = batch, max_seq

    def clear_caches(self) -> None:
        """Free the KV store (decoding keeps it between calls of the same shape)."""
        release_kv_store(self, self.layers)
        self.max_batch = self.max_seq = 0

    def move_cache(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy KV slots ``src [B, n]`` to ``dst [B, n]`` in every layer (two ops in all)."""
        move_kv(self._kv_store, src, dst, self._kv_index)

    # ---------------------------------------------------------------- TargetModel (relaxspec.models.base)
    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.output.weight.dtype

    @property
    def token_embeddings(self) -> torch.Tensor:
        return self.tok_embeddings.weight[: self.config.vocab_size]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden.to(self.output.weight.dtype)).float()

    @property
    def num_layers(self) -> int:
        """Its blocks: ``prefill``, ``step`` and ``forward_train`` take ``capture=``
        (:func:`relaxspec.models.base.layer_count`)."""
        return self.config.n_layer

    def prefill(self, cond: torch.Tensor, positions: torch.Tensor, cache_slots: torch.Tensor,
                attn_mask: torch.Tensor, capture: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self(cond=cond, positions=positions, cache_slots=cache_slots, attn_mask=attn_mask, return_hidden=True,
                    check=False, capture=capture)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache_slots: torch.Tensor,
             attn_mask: torch.Tensor, capture: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self(tokens, positions, cache_slots=cache_slots, attn_mask=attn_mask, return_hidden=True, check=False,
                    capture=capture)

    def lantern_condition_states(self, cond: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The final hidden states ``[R, C, dim]`` at every caption position of ``cond`` (real
        tokens ``valid [R, C]``) as official LANTERN's converted target computes them, padded
        positions included (:mod:`relaxspec.models.llamagen.lantern_rows`). Runs beside the cache:
        nothing is written to it."""
        h = self.embed_condition(cond)
        positions = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
        bias = lantern_caption_bias(valid.to(h.device), h.dtype)
        return self.norm(run_blocks(self.layers, h, self.rope[positions], None, bias, None)[0])

    # ---------------------------------------------------------------- embeddings
    def null_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """The unconditional counterpart of ``cond`` (null class id, or the uncond caption)."""
        if self.config.model_type == "c2i":
            return torch.full_like(cond, self.config.num_classes)
        return self.cls_embedding.uncond_embedding.to(cond.dtype).expand_as(cond)

    def embed_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """``cond``: class ids ``[B]`` (c2i) or caption features ``[B, cls_token_num, caption_dim]``
        (t2i) -> ``[B, cls_token_num, dim]``."""
        if self.config.model_type == "c2i":
            return self.cls_embedding(cond)[:, : self.config.cls_token_num]
        return self.cls_embedding(cond.to(self.output.weight.dtype))

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        tokens: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        *,
        cond: torch.Tensor | None = None,
        embeddings: torch.Tensor | None = None,
        cache_slots: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_len: int | None = None,
        return_hidden: bool = False,
        check: bool = True,
        capture: tuple[int, ...] | None = None,
    ):
        """Run the transformer on one of ``tokens [B, T]``, ``cond`` (prefill) or ``embeddings``.

        ``positions [B, T]`` index the RoPE table (defaults to ``0..T-1``, or the condition
        positions for ``cond``). ``cache_slots [B, T]`` are the KV-cache slots to write; without
        them (or without caches) attention is plain causal over the ``T`` inputs. Queries attend to
        the first ``kv_len`` cache slots (default: the whole cache, the static shape decoding
        uses); ``attn_mask [B, T, kv_len]`` (True = may attend) overrides the default
        causal-by-slot mask.
        Returns fp32 logits ``[B, T, vocab]`` and, with ``return_hidden``, the normed final
        hidden states ``[B, T, dim]`` (what the output head sees), or with ``capture`` the streams
        entering those blocks side by side ``[B, T, k * dim]`` (a fused-feature drafter's input,
        :func:`relaxspec.models.base.run_capturing`). ``check=False`` skips the
        range check of ``positions`` (a host sync): the decoding loop builds them in range.
        """
        if embeddings is not None:
            h = embeddings
        elif cond is not None:
            h = self.embed_condition(cond)
        elif tokens is not None:
            h = self.tok_embeddings(tokens)
        else:
            raise ValueError("forward needs tokens, cond or embeddings")
        b, t = h.shape[:2]
        if positions is None:
            positions = torch.arange(t, device=h.device).expand(b, t)
        elif positions.dim() == 1:
            positions = positions.expand(b, -1)
        if check and (int(positions.max()) >= self.rope.shape[0] or int(positions.min()) < 0):
            raise ValueError(f"positions must lie in [0, {self.rope.shape[0]}) for this model's token grid")
        if cache_slots is not None and cache_slots.dim() == 1:
            cache_slots = cache_slots.expand(b, -1)
        h, captured = run_blocks(self.layers, h, self.rope[positions], cache_slots, attn_mask, kv_len, capture)
        h = self.norm(h)
        logits = self.output(h).float()
        return (logits, h if captured is None else captured) if return_hidden else logits

    def forward_train(self, cond: torch.Tensor, tokens: torch.Tensor, return_hidden: bool = False,
                      capture: tuple[int, ...] | None = None):
        """Teacher-forced pass over a whole image: ``tokens [B, N]`` -> logits ``[B, N, vocab]``
        where row ``k`` predicts image token ``k`` (and hidden states ``[B, N, dim]``, or with
        ``capture`` the blocks' streams, as :meth:`forward`)."""
        h = torch.cat([self.embed_condition(cond), self.tok_embeddings(tokens[:, :-1])], dim=1)
        out = self.forward(embeddings=h, return_hidden=return_hidden, capture=capture)
        cut = self.config.cls_token_num - 1
        if return_hidden:
            return out[0][:, cut:], out[1][:, cut:]
        return out[:, cut:]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
