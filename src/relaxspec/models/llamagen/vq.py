"""LlamaGen's VQ image tokenizer (arXiv 2406.06525, REFERENCE §2.3).

A convolutional encoder maps an image ``[B, 3, H, W]`` in ``[-1, 1]`` to a latent grid
``[B, z_channels, H/f, W/f]`` (``f = downsample_factor``, 16 for VQ-16); ``quant_conv`` projects
it to ``codebook_embed_dim`` channels and every grid cell becomes the index of its nearest
codebook vector. Decoding looks the indices up again, ``post_quant_conv`` projects back and a
mirrored decoder produces pixels in roughly ``[-1, 1]``.

Module and parameter names follow upstream (FoundationVision/LlamaGen,
``tokenizer/tokenizer_image/vq_model.py``) one for one, so the official ``vq_ds16_c2i.pt``
state dict loads with ``strict=True``. Janus-Pro's VQ uses the same architecture.

Inference only: the training losses (commitment, entropy) and the codebook-usage bookkeeping are
not implemented; the ``quantize.codebook_used`` buffer exists so official files load strictly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from relaxspec.errors import RelaxspecError
from relaxspec.models.weights import to_uint8  # noqa: F401 - upstream's saving rule, where LlamaGen code finds it

# Upstream registers ``codebook_used`` with a hard-coded length (a ring buffer of recent indices
# used for training-time usage statistics); it is part of the state dict, so keep its shape.
CODEBOOK_USAGE_LEN = 65536


@dataclass(frozen=True)
class VQConfig:
    """Hyper-parameters of the VQ tokenizer; defaults are LlamaGen's VQ-16.

    Upstream's ``ModelArgs`` has separate encoder / decoder ``ch_mult`` lists that are equal in
    every released model, so one ``ch_mult`` serves both here.
    """

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    # Upstream L2-normalises both the latent and the codebook before the nearest-neighbour
    # search, i.e. the lookup is by cosine similarity, and decodes from the normalised vectors.
    codebook_l2_norm: bool = True
    # Only decides whether the ``quantize.codebook_used`` buffer exists (official files have it).
    codebook_show_usage: bool = True
    z_channels: int = 256
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    dropout: float = 0.0
    # Upstream hard-codes GroupNorm(32, eps=1e-6); a field so tiny test models can use few channels.
    norm_groups: int = 32
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        # Accept a list (as upstream's ModelArgs uses) but store a tuple so configs stay hashable.
        if isinstance(self.ch_mult, (list, tuple)):
            object.__setattr__(self, "ch_mult", tuple(self.ch_mult))
        for name in (
            "codebook_size", "codebook_embed_dim", "z_channels", "ch", "num_res_blocks", "norm_groups"
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RelaxspecError(f"VQConfig.{name} must be a positive integer, got {value!r}.")
        for name in ("codebook_l2_norm", "codebook_show_usage"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise RelaxspecError(f"VQConfig.{name} must be True or False, got {value!r}.")
        if not isinstance(self.ch_mult, tuple) or not self.ch_mult or any(
            isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in self.ch_mult
        ):
            raise RelaxspecError(
                "VQConfig.ch_mult must be a non-empty sequence of positive integers, "
                f"got {self.ch_mult!r}."
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise RelaxspecError(f"VQConfig.dropout must be in [0, 1), got {self.dropout!r}.")
        if not isinstance(self.norm_eps, (int, float)) or not self.norm_eps > 0.0:
            raise RelaxspecError(f"VQConfig.norm_eps must be positive, got {self.norm_eps!r}.")
        # Every GroupNorm sits on ``ch`` or ``ch * m`` channels.
        for channels in {self.ch, *(self.ch * m for m in self.ch_mult)}:
            if channels % self.norm_groups:
                raise RelaxspecError(
                    f"VQConfig.norm_groups={self.norm_groups} must divide every block width "
                    f"(ch * ch_mult), but {channels} is not a multiple of it."
                )

    @property
    def downsample_factor(self) -> int:
        """Image pixels per latent cell along each side: one stride-2 step per level but the last."""
        return 2 ** (len(self.ch_mult) - 1)


VQ_CONFIGS: dict[str, VQConfig] = {
    "VQ-16": VQConfig(ch_mult=(1, 1, 2, 2, 4)),
    "VQ-8": VQConfig(ch_mult=(1, 2, 2, 4)),
}


def _norm(channels: int, config: VQConfig) -> nn.GroupNorm:
    return nn.GroupNorm(config.norm_groups, channels, eps=config.norm_eps, affine=True)


class ResnetBlock(nn.Module):
    """Pre-activation residual block: (GroupNorm, swish, conv3x3) x 2; 1x1 shortcut if widths differ."""

    def __init__(self, in_channels: int, out_channels: int, config: VQConfig) -> None:
        super().__init__()
        self.norm1 = _norm(in_channels, config)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.norm2 = _norm(out_channels, config)
        self.dropout = nn.Dropout(config.dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        # Upstream's name for the 1x1 projection (it never uses its 3x3 ``conv_shortcut`` option).
        self.nin_shortcut = (
            nn.Conv2d(in_channels, out_channels, kernel_size=1) if in_channels != out_channels else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C_in, H, W] -> [B, C_out, H, W]``."""
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        shortcut = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return shortcut + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all grid cells, 1x1 convs for q, k, v and the output."""

    def __init__(self, channels: int, config: VQConfig) -> None:
        super().__init__()
        self.norm = _norm(channels, config)
        self.q = nn.Conv2d(channels, channels, kernel_size=1)
        self.k = nn.Conv2d(channels, channels, kernel_size=1)
        self.v = nn.Conv2d(channels, channels, kernel_size=1)
        self.proj_out = nn.Conv2d(channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W] -> [B, C, H, W]``; softmax(q k^T / sqrt(C)) v as upstream, via SDPA."""
        b, c, height, width = x.shape
        h = self.norm(x)

        def cells(t: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, 1, H*W, C]
            return t.reshape(b, 1, c, height * width).transpose(2, 3)

        out = F.scaled_dot_product_attention(cells(self.q(h)), cells(self.k(h)), cells(self.v(h)))
        out = out.transpose(2, 3).reshape(b, c, height, width)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Stride-2 conv3x3 after zero-padding right and bottom by one (upstream's asymmetric pad)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W] -> [B, C, H/2, W/2]``."""
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest-neighbour x2 upsampling followed by a conv3x3."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W] -> [B, C, 2H, 2W]``."""
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: ``res`` blocks, each followed by ``attn[i]`` when the list is non-empty
    (only at the lowest resolution), then an optional ``downsample`` / ``upsample``."""

    def __init__(self, in_channels: int, out_channels: int, num_blocks: int, with_attn: bool,
                 config: VQConfig) -> None:
        super().__init__()
        self.res = nn.ModuleList(
            ResnetBlock(in_channels if i == 0 else out_channels, out_channels, config)
            for i in range(num_blocks)
        )
        self.attn = nn.ModuleList(
            AttnBlock(out_channels, config) for _ in range(num_blocks if with_attn else 0)
        )

    def blocks(self, h: torch.Tensor) -> torch.Tensor:
        for i, res in enumerate(self.res):
            h = res(h)
            if len(self.attn) > 0:
                h = self.attn[i](h)
        return h


def _middle(channels: int, config: VQConfig) -> nn.ModuleList:
    # Upstream's keys are ``mid.0`` (res), ``mid.1`` (attn), ``mid.2`` (res).
    return nn.ModuleList(
        [ResnetBlock(channels, channels, config), AttnBlock(channels, config),
         ResnetBlock(channels, channels, config)]
    )


class Encoder(nn.Module):
    """Image ``[B, 3, H, W]`` -> latent ``[B, z_channels, H/f, W/f]``."""

    def __init__(self, config: VQConfig) -> None:
        super().__init__()
        ch, mult, last = config.ch, config.ch_mult, len(config.ch_mult) - 1
        self.conv_in = nn.Conv2d(3, ch, kernel_size=3, padding=1)
        self.conv_blocks = nn.ModuleList()
        block_in = ch
        for level, m in enumerate(mult):
            block = _Level(block_in, ch * m, config.num_res_blocks, level == last, config)
            block_in = ch * m
            if level != last:
                block.downsample = Downsample(block_in)
            self.conv_blocks.append(block)
        self.mid = _middle(block_in, config)
        self.norm_out = _norm(block_in, config)
        self.conv_out = nn.Conv2d(block_in, config.z_channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for block in self.conv_blocks:
            h = block.blocks(h)
            if hasattr(block, "downsample"):
                h = block.downsample(h)
        for layer in self.mid:
            h = layer(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """Latent ``[B, z_channels, h, w]`` -> image ``[B, 3, h*f, w*f]``.

    ``conv_blocks[0]`` is the lowest resolution (upstream builds the levels in reverse), and each
    level has ``num_res_blocks + 1`` residual blocks.
    """

    def __init__(self, config: VQConfig) -> None:
        super().__init__()
        ch, mult = config.ch, config.ch_mult
        block_in = ch * mult[-1]
        self.conv_in = nn.Conv2d(config.z_channels, block_in, kernel_size=3, padding=1)
        self.mid = _middle(block_in, config)
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(len(mult))):
            block = _Level(block_in, ch * mult[level], config.num_res_blocks + 1,
                           level == len(mult) - 1, config)
            block_in = ch * mult[level]
            if level != 0:
                block.upsample = Upsample(block_in)
            self.conv_blocks.append(block)
        self.norm_out = _norm(block_in, config)
        self.conv_out = nn.Conv2d(block_in, 3, kernel_size=3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        for layer in self.mid:
            h = layer(h)
        for block in self.conv_blocks:
            h = block.blocks(h)
            if hasattr(block, "upsample"):
                h = block.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    """Holds the codebook ``embedding.weight [V, D]`` (and upstream's ``codebook_used`` buffer)."""

    def __init__(self, config: VQConfig) -> None:
        super().__init__()
        self.l2_norm = config.codebook_l2_norm
        self.embedding = nn.Embedding(config.codebook_size, config.codebook_embed_dim)
        # Upstream's initialisation, so a freshly built model matches a fresh upstream one.
        with torch.no_grad():
            bound = 1.0 / config.codebook_size
            self.embedding.weight.uniform_(-bound, bound)
            if self.l2_norm:
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, p=2, dim=-1))
        if config.codebook_show_usage:
            self.register_buffer("codebook_used", torch.zeros(CODEBOOK_USAGE_LEN))

    def lookup_table(self) -> torch.Tensor:
        """``[V, D]`` vectors used for both the search and the decode (normalised if ``l2_norm``)."""
        weight = self.embedding.weight
        return F.normalize(weight, p=2, dim=-1) if self.l2_norm else weight

    def nearest(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, D, h, w]`` -> ``[B, h, w]`` int64 index of the nearest codebook vector.

        Same expression as upstream, ``|z|^2 + |e|^2 - 2 z.e`` on the (normalised) vectors, so ties
        and rounding resolve the same way. Memory is ``B*h*w x V`` floats (16 MB per 256px image).
        """
        b, d, height, width = latents.shape
        z = latents.permute(0, 2, 3, 1).reshape(-1, d)
        if self.l2_norm:
            z = F.normalize(z, p=2, dim=-1)
        table = self.lookup_table()
        dist = z.pow(2).sum(1, keepdim=True) + table.pow(2).sum(1) - 2 * (z @ table.t())
        return dist.argmin(dim=1).reshape(b, height, width)


class VQModel(nn.Module):
    """LlamaGen's VQ tokenizer (arXiv 2406.06525): images <-> token grids, row-major.

    Submodules are named as upstream (``encoder``, ``decoder``, ``quantize``, ``quant_conv``,
    ``post_quant_conv``) so official state dicts load strictly.
    """

    checkpoint_kind = "vq"  # config.json's "kind" when saved (relaxspec.models.weights.save_model)

    def __init__(self, config: VQConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else VQConfig()
        cfg = self.config
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantize = VectorQuantizer(cfg)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.codebook_embed_dim, kernel_size=1)
        self.post_quant_conv = nn.Conv2d(cfg.codebook_embed_dim, cfg.z_channels, kernel_size=1)

    @property
    def codebook(self) -> torch.Tensor:
        """``[V, D]`` codebook as used at lookup: L2-normalised rows when ``codebook_l2_norm``."""
        return self.quantize.lookup_table()

    @property
    def raw_codebook(self) -> torch.Tensor:
        """``[V, D]`` stored codebook vectors (``quantize.embedding.weight``), not normalised."""
        return self.quantize.embedding.weight

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` in ``[-1, 1]`` -> tokens ``[B, (H/f) * (W/f)]`` int64, row-major grid.

        ``H`` and ``W`` must be multiples of ``f = config.downsample_factor``.
        """
        f = self.config.downsample_factor
        if images.ndim != 4 or images.shape[1] != 3:
            raise RelaxspecError(
                f"VQModel.encode expects images [batch, 3, H, W], got shape {tuple(images.shape)}."
            )
        if images.shape[2] % f or images.shape[3] % f:
            raise RelaxspecError(
                f"VQModel.encode needs H and W to be multiples of {f}, got {tuple(images.shape[2:])}."
            )
        latents = self.quant_conv(self.encoder(images))
        return self.quantize.nearest(latents).flatten(1)

    def codes_to_latents(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens ``[B, h*w]`` (square grid) or ``[B, h, w]`` -> latents ``[B, D, h, w]``.

        The rows come from :attr:`codebook` (normalised when ``codebook_l2_norm``), as upstream's
        ``get_codebook_entry``.
        """
        grid = self._as_grid(tokens)
        return self.codebook[grid].permute(0, 3, 1, 2).contiguous()

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens ``[B, h*w]`` (square grid) or ``[B, h, w]`` -> images ``[B, 3, h*f, w*f]``.

        Output is roughly in ``[-1, 1]`` and not clamped (as upstream); see :func:`to_uint8`.
        Never tracks gradients (tokens are not differentiable anyway); training code that needs
        them calls ``decoder(post_quant_conv(latents))`` itself.
        """
        return self.decoder(self.post_quant_conv(self.codes_to_latents(tokens)))

    def _as_grid(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise RelaxspecError(f"VQ tokens must be an integer tensor, got dtype {tokens.dtype}.")
        if tokens.ndim == 2:
            side = math.isqrt(tokens.shape[1])
            if side * side != tokens.shape[1] or side == 0:
                raise RelaxspecError(
                    f"VQ tokens [batch, n] need a square grid, but n={tokens.shape[1]} is not a "
                    "positive perfect square; pass [batch, h, w] instead."
                )
            tokens = tokens.reshape(tokens.shape[0], side, side)
        elif tokens.ndim != 3:
            raise RelaxspecError(
                f"VQ tokens must be [batch, h*w] or [batch, h, w], got shape {tuple(tokens.shape)}."
            )
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.codebook_size):
            raise RelaxspecError(
                f"VQ tokens must lie in [0, {self.config.codebook_size}), got values in "
                f"[{int(tokens.min())}, {int(tokens.max())}]."
            )
        return tokens.long()

