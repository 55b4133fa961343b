"""LlamaGen's own files, as the commands show and make them: what ``relaxspec info`` says of a
checkpoint (:func:`describe_lines`, over :func:`~relaxspec.models.llamagen.checkpoints.describe`)
and the random-weight checkpoints ``relaxspec make-test-checkpoints`` writes in the official
layout (:func:`write_test_checkpoints`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.gpt import GPTConfig, Transformer, gpt_config
from relaxspec.models.llamagen.vq import VQ_CONFIGS, VQConfig, VQModel

#: Random-weight sizes for ``make-test-checkpoints`` (official layout, unnamed sizes, so a JSON
#: config travels with them). "small" is VQ-16-shaped at 256 px; "tiny" is for unit tests (16 px).
TEST_PRESETS: dict[str, dict] = {
    "small": dict(
        gpt=dict(dim=128, n_layer=2, n_head=2, vocab_size=16384, num_classes=1000),
        t2i=dict(cls_token_num=120, caption_dim=2048),
        vq=dict(codebook_size=16384, codebook_embed_dim=8, z_channels=64, ch=16, ch_mult=(1, 1, 2, 2, 4),
                num_res_blocks=1, norm_groups=8),
        image_size=256,
    ),
    "tiny": dict(
        gpt=dict(dim=64, n_layer=2, n_head=4, vocab_size=64, num_classes=10),
        t2i=dict(cls_token_num=6, caption_dim=32),
        vq=dict(codebook_size=64, codebook_embed_dim=8, z_channels=16, ch=32, ch_mult=(1, 2, 2),
                num_res_blocks=1, norm_groups=8),
        image_size=16,
    ),
}

LAYOUTS = {
    "model": 'official LlamaGen file {"model": state_dict}', "module": '{"module": state_dict}',
    "state_dict": '{"state_dict": state_dict}', "raw": "raw state dict (like upstream XXL / 3B / FSDP files)",
    "safetensors": "safetensors file", "relaxspec": "relaxspec folder (config.json + model.safetensors)",
    "lantern": "official LANTERN's LlamaGen folder (HF-Llama names; open it with --gpt-ckpt DIR --vq-ckpt VQ and "
               "--t5-path or --caption-features)",
}


def _short(value):
    """A config value for one line: long lists and nested configs as their size (--json has all)."""
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"[{len(value)} items]"
    if isinstance(value, dict):
        return f"{{{len(value)} fields}}"
    return value


def describe_lines(info: dict) -> list[str]:
    """What ``relaxspec info`` prints of a LlamaGen checkpoint (:func:`describe`'s record)."""
    lines = []
    lines.append(f"path:       {info['path']}")
    lines.append(f"layout:     {LAYOUTS.get(info['layout'], info['layout'])}")
    kind = info["kind"]
    if kind == "gpt" and isinstance(info.get("config"), dict) and "model_type" in info["config"]:
        kind = f"gpt ({info['config']['model_type']})"
    lines.append(f"kind:       {kind}")
    if info.get("config"):
        lines.append("config:     " + ", ".join(f"{k}={_short(v)}" for k, v in info["config"].items()))
    if info.get("kind") == "gpt" and info.get("layout") not in ("relaxspec", "lantern"):
        looks = info.get("looks_like")
        lines.append(f"looks like: {looks or 'no named size (load it with --gpt-model CONFIG.json)'}"
              + ("" if not looks else f" (pass --gpt-model {looks})"))
    lines.append(f"parameters: {info['parameters']:,} ({info['parameters'] / 1e6:.1f}M)")
    lines.append(f"tensors:    {info['tensors']} ({', '.join(info['dtypes'])})")
    return lines


def write_test_checkpoints(out, *, preset: str = "small", gpt_size: str | None = None, vq_size: str | None = None,
                           model_type: str = "c2i", image_size: int | None = None, seed: int = 0) -> str:
    """Write random-weight GPT and VQ checkpoints in the official layout into ``out`` (``gpt.pt``,
    ``vq.pt``, and ``gpt.json`` / ``vq.json`` for unnamed sizes): the ``preset``'s sizes, or the
    named ``gpt_size`` / ``vq_size``. Returns what to tell the user (what was written, and a
    generate command that reads it)."""
    if preset not in TEST_PRESETS:
        raise RelaxspecError(f"preset must be one of {', '.join(TEST_PRESETS)}, got {preset!r}")
    sizes = TEST_PRESETS[preset]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RelaxspecError(f"--out {out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if vq_size:
        vq_config, vq_spec = VQ_CONFIGS[vq_size], vq_size
    else:
        vq_config, vq_spec = VQConfig(**sizes["vq"]), str(out / "vq.json")
    image_size = image_size or (256 if vq_size else sizes["image_size"])
    downsample = vq_config.downsample_factor
    if image_size % downsample:
        raise RelaxspecError(f"--image-size {image_size} is not a multiple of the tokenizer's downsampling {downsample}")
    conditioning = dict(sizes["t2i"]) if model_type == "t2i" else {}
    if gpt_size:
        extra = {} if model_type == "c2i" else {"caption_dim": 2048}
        gpt = gpt_config(gpt_size, image_size=image_size, downsample=downsample, model_type=model_type,
                         vocab_size=vq_config.codebook_size, **extra)
        gpt_spec = gpt_size
    else:
        grid = image_size // downsample
        gpt = GPTConfig(**sizes["gpt"], **conditioning, model_type=model_type, block_size=grid * grid)
        if gpt.vocab_size != vq_config.codebook_size:
            gpt = dataclasses.replace(gpt, vocab_size=vq_config.codebook_size)
        gpt_spec = str(out / "gpt.json")
    target = Transformer(gpt)
    vq = VQModel(vq_config)
    torch.save({"model": target.state_dict()}, out / "gpt.pt")
    torch.save({"model": vq.state_dict()}, out / "vq.pt")
    if not gpt_size:
        (out / "gpt.json").write_text(json.dumps(gpt.to_dict(), indent=2) + "\n")
    if not vq_size:
        (out / "vq.json").write_text(json.dumps(dataclasses.asdict(vq_config), indent=2) + "\n")
    condition = "--classes 207,360" if model_type == "c2i" and gpt.num_classes > 360 else (
        "--classes 1,2" if model_type == "c2i" else "--caption-features CAPTIONS.npy")
    return (f"wrote random-weight checkpoints (official layout) to {out}: gpt.pt "
            f"({target.num_parameters() / 1e6:.1f}M parameters), vq.pt\n"
            f"try: relaxspec generate --gpt-ckpt {out / 'gpt.pt'} --gpt-model {gpt_spec} --vq-ckpt {out / 'vq.pt'} "
            f"--vq-model {vq_spec} --image-size {image_size} {condition} --out {out}-images")


__all__ = ["LAYOUTS", "TEST_PRESETS", "describe_lines", "write_test_checkpoints"]
