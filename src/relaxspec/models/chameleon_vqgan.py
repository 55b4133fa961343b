"""Meta's Chameleon VQGAN (a taming-transformers ``VQModel``), the image tokenizer of
Lumina-mGPT: its codebook and its decoder, written from the taming architecture, so pixels come
from the files Meta publishes (``vqgan.yaml``, ``vqgan.ckpt``) without Lumina's or taming's code.

transformers' ``ChameleonVQVAE`` has the encoder and the quantizer but no decoder (its converter
skips the decoder weights), so relaxspec reads Meta's checkpoint itself: ``quantize.embedding``,
``post_quant_conv`` and ``decoder.*``; the encoder, ``quant_conv`` and any training-loss weights
in the file are ignored.

The decoder (taming's ``Decoder`` with ``temb_ch = 0``): ``conv_in``; a middle of ResNet block,
attention, ResNet block; then, from the coarsest level to the finest, ``num_res_blocks + 1``
ResNet blocks per level (each followed by attention where the level's resolution is in
``attn_resolutions``) and a nearest-neighbour x2 upsample with a 3x3 conv between levels;
``norm_out``, swish, ``conv_out`` (no tanh). Norms are ``GroupNorm(32, eps=1e-6)``. Decoding runs
in fp32, as Lumina-mGPT decodes outside its bf16 autocast.
"""

from __future__ import annotations

import math
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relaxspec.errors import RelaxspecError

CONFIG_FILE, CHECKPOINT_FILE = "vqgan.yaml", "vqgan.ckpt"
#: The checkpoint keys the decoder reads; every other key (encoder, quant_conv, loss) is ignored.
READ_PREFIXES = ("quantize.embedding.", "post_quant_conv.", "decoder.")


@dataclass(frozen=True)
class VQGANConfig:
    """``vqgan.yaml``'s ``model.params``: the codebook (``n_embed`` codes of ``embed_dim``) and
    the decoder's ``ddconfig``. Chameleon's: 8192 x 256, ``ch`` 128, ``ch_mult`` (1, 1, 2, 2, 4),
    2 ResNet blocks, no attention outside the middle, ``z_channels`` 256, ``resolution`` 512."""

    embed_dim: int
    n_embed: int
    ch: int
    ch_mult: tuple[int, ...]
    num_res_blocks: int
    attn_resolutions: tuple[int, ...]
    z_channels: int
    resolution: int
    in_channels: int
    out_ch: int
    dropout: float = 0.0

    @property
    def downsample_factor(self) -> int:
        """Pixels per code side: one x2 upsample between consecutive levels."""
        return 2 ** (len(self.ch_mult) - 1)


def read_vqgan_config(path) -> VQGANConfig:
    """``vqgan.yaml`` (taming's ``VQModel`` config) -> :class:`VQGANConfig` (one-line errors)."""
    path = Path(path)
    try:
        import yaml
    except ImportError:
        raise RelaxspecError(f"{path}: reading it needs PyYAML (pip install pyyaml; transformers installs it)") \
            from None
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as err:
        raise RelaxspecError(f"{path}: cannot read the VQGAN config ({type(err).__name__})") from None
    except yaml.YAMLError as err:
        raise RelaxspecError(f"{path}: not YAML ({' '.join(str(err).split())[:120]})") from None
    try:
        params = document["model"]["params"]
        dd = params["ddconfig"]
        # Settings taming supports that Chameleon's decoder does not use: refused, not ignored.
        if not dd.get("resamp_with_conv", True) or dd.get("tanh_out", False) or dd.get("give_pre_end", False) \
                or dd.get("use_linear_attn", False) or dd.get("attn_type", "vanilla") != "vanilla":
            raise RelaxspecError(f"{path}: this VQGAN's decoder settings (resamp_with_conv, tanh_out, give_pre_end, "
                                 "attn_type) are not the Chameleon decoder's; relaxspec decodes only that one")
        config = VQGANConfig(embed_dim=int(params["embed_dim"]), n_embed=int(params["n_embed"]), ch=int(dd["ch"]),
                             ch_mult=tuple(int(m) for m in dd["ch_mult"]),
                             num_res_blocks=int(dd["num_res_blocks"]),
                             attn_resolutions=tuple(int(r) for r in dd["attn_resolutions"]),
                             z_channels=int(dd["z_channels"]), resolution=int(dd["resolution"]),
                             in_channels=int(dd["in_channels"]), out_ch=int(dd["out_ch"]),
                             dropout=float(dd.get("dropout", 0.0)))
    except RelaxspecError:
        raise
    except (KeyError, TypeError, ValueError) as err:
        raise RelaxspecError(f"{path}: not a taming VQModel config (model.params.{{embed_dim, n_embed, ddconfig}}: "
                             f"{type(err).__name__} {err})") from None
    if min(config.ch_mult, default=0) < 1 or config.ch < 1 or config.n_embed < 1 or config.num_res_blocks < 0:
        raise RelaxspecError(f"{path}: ch, ch_mult, n_embed must be positive and num_res_blocks >= 0")
    return config


# ---------------------------------------------------------------- the decoder (taming's names)
def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


def _swish(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    """norm1 -> swish -> conv1 -> norm2 -> swish -> (dropout) -> conv2, plus the input (through a
    1x1 ``nin_shortcut`` where the channel count changes)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = _norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(_swish(self.norm1(x)))
        h = self.conv2(_swish(self.norm2(h)))  # dropout is inactive at inference
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the ``H*W`` positions, 1x1 convs for q, k, v and the
    output, scaled by ``channels ** -0.5``; residual."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        normed = self.norm(x)
        q, k, v = (conv(normed).reshape(b, c, h * w).transpose(1, 2) for conv in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]  # [b, hw, c], scale c^-0.5
        return x + self.proj_out(out.transpose(1, 2).reshape(b, c, h, w))


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Decoder(nn.Module):
    """taming's ``Decoder``: latents ``[B, z_channels, h, w]`` -> pixels ``[B, out_ch, h*f,
    w*f]`` (``f`` the downsample factor). ``up[i]`` is level ``i`` (``up[0]`` the finest)."""

    def __init__(self, config: VQGANConfig):
        super().__init__()
        levels = len(config.ch_mult)
        channels = config.ch * config.ch_mult[-1]
        resolution = config.resolution // 2 ** (levels - 1)  # where attn_resolutions is read
        self.conv_in = nn.Conv2d(config.z_channels, channels, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(channels, channels)
        self.mid.attn_1 = AttnBlock(channels)
        self.mid.block_2 = ResnetBlock(channels, channels)
        up = []
        for level in reversed(range(levels)):
            stage = nn.Module()
            out = config.ch * config.ch_mult[level]
            stage.block = nn.ModuleList([ResnetBlock(channels if i == 0 else out, out)
                                         for i in range(config.num_res_blocks + 1)])
            attend = resolution in config.attn_resolutions
            stage.attn = nn.ModuleList([AttnBlock(out) for _ in stage.block] if attend else [])
            channels = out
            if level != 0:
                stage.upsample = Upsample(channels)
                resolution *= 2
            up.insert(0, stage)
        self.up = nn.ModuleList(up)
        self.norm_out = _norm(channels)
        self.conv_out = nn.Conv2d(channels, config.out_ch, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for level in reversed(range(len(self.up))):
            stage = self.up[level]
            for index, block in enumerate(stage.block):
                h = block(h)
                if len(stage.attn):
                    h = stage.attn[index](h)
            if level != 0:
                h = stage.upsample(h)
        return self.conv_out(_swish(self.norm_out(h)))


class ChameleonVQGAN(nn.Module):
    """The Chameleon VQGAN as an :class:`~relaxspec.models.base.ImageTokenizer`: codes
    ``[B, N]`` (``N = side**2``, row-major) -> codebook entries -> ``post_quant_conv`` ->
    decoder -> pixels ``[B, 3, H, W]`` clamped to ``[-1, 1]``, in fp32.

    ``config``: ``codebook_size``, ``downsample_factor``, ``codebook_embed_dim``; the whole
    yaml config is ``vqgan_config``."""

    def __init__(self, config: VQGANConfig):
        super().__init__()
        self.vqgan_config = config
        self.config = SimpleNamespace(codebook_size=config.n_embed, downsample_factor=config.downsample_factor,
                                      codebook_embed_dim=config.embed_dim)
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(config.n_embed, config.embed_dim)
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.z_channels, 1)
        self.decoder = Decoder(config)

    @property
    def raw_codebook(self) -> Tensor:
        """``[V, embed_dim]`` the stored code vectors."""
        return self.quantize.embedding.weight

    @property
    def codebook(self) -> Tensor:
        """``[V, embed_dim]`` what the decoder reads: the stored vectors (no normalisation)."""
        return self.raw_codebook

    @torch.no_grad()
    def decode(self, tokens: Tensor) -> Tensor:
        """Codes ``[B, N]`` (a square grid, row-major) -> pixels ``[B, 3, H, W]`` in ``[-1, 1]``."""
        batch, count = tokens.shape
        side = math.isqrt(count)
        if side * side != count:
            raise RelaxspecError(f"{count} image tokens are not a square grid")
        device = self.raw_codebook.device
        with torch.autocast(device.type, enabled=False):  # fp32 whatever the caller's autocast
            latents = self.quantize.embedding(tokens.to(device)).view(batch, side, side, -1).permute(0, 3, 1, 2)
            pixels = self.decoder(self.post_quant_conv(latents.float()))
        return pixels.float().clamp(-1.0, 1.0)


def _read_checkpoint(path: Path) -> dict:
    """``vqgan.ckpt``'s ``state_dict``, unpickled with ``weights_only=True`` only."""
    if not path.is_file():
        raise RelaxspecError(f"{path}: no such file (the Chameleon tokenizer folder holds vqgan.ckpt)")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", re.sub(r"\x1b\[[0-9;]*m", "", str(err)))
        held = f" (it holds {found.group(1)})" if found else ""
        raise RelaxspecError(f"{path}: not a plain weights checkpoint{held}: relaxspec loads it with "
                             "weights_only=True and never unpickles code") from None
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: say what, in one line
        raise RelaxspecError(f"{path}: not a readable PyTorch checkpoint ({type(err).__name__})") from None
    state = loaded.get("state_dict") if isinstance(loaded, dict) else None
    if not isinstance(state, dict):
        raise RelaxspecError(f"{path}: not a VQGAN checkpoint (a dict with a 'state_dict' of tensors)")
    return state


def load_vqgan(folder, *, device="cpu") -> ChameleonVQGAN:
    """The VQGAN of Meta's Chameleon tokenizer folder (``vqgan.yaml`` + ``vqgan.ckpt``), in fp32
    on ``device``. Keys the decoder reads must all be there with their shapes; decoder keys the
    config does not build (e.g. attention blocks a different ``attn_resolutions`` would have) are
    an error too."""
    folder = Path(folder)
    config = read_vqgan_config(folder / CONFIG_FILE)
    checkpoint = folder / CHECKPOINT_FILE
    return vqgan_from_state(config, _read_checkpoint(checkpoint), f"{checkpoint}", CONFIG_FILE, device=device)


def vqgan_from_state(config: VQGANConfig, state: dict, source: str, config_name: str, *,
                     device="cpu") -> ChameleonVQGAN:
    """The VQGAN of ``config`` from a state dict under taming's names (keys outside
    :data:`READ_PREFIXES` are ignored), in fp32 on ``device``; a missing, unexpected or misshapen
    decoder key is a one-line error naming ``source`` and ``config_name``."""
    state = {key: value for key, value in state.items() if key.startswith(READ_PREFIXES)}
    model = ChameleonVQGAN(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        what = (f"{len(missing)} missing, e.g. {missing[0]}" if missing
                else f"{len(unexpected)} unexpected, e.g. {unexpected[0]}")
        raise RelaxspecError(f"{source}: the weights do not match {config_name} ({what})")
    for key, value in state.items():
        if not isinstance(value, Tensor) or value.shape != expected[key].shape:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise RelaxspecError(f"{source}: {key} is {shape}; {config_name} makes it {tuple(expected[key].shape)}")
    model.load_state_dict({key: value.float() for key, value in state.items()})
    return model.to(device).eval().requires_grad_(False)
