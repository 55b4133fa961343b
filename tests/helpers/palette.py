"""A toy model family, "Palette", written as a user would add one: this model module and one
pipeline file (:mod:`helpers.palette_pipeline`), registered through a package's
``relaxspec.families`` entry point, with an opening input of its own (``--palette-path``, the
colours its image tokens decode to). No relaxspec file names it.

A Palette folder: ``config.json`` (``{"model_type": "palette"}``) and ``gpt/``, a LlamaGen t2i
transformer (relaxspec folder) whose caption features come from a toy text encoder (each word a
fixed random vector). Its image tokenizer paints token ``v`` as one pixel of palette colour ``v``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from relaxspec.errors import RelaxspecError
from relaxspec.models import hf

NAME = "Palette"
MODEL_TYPE = "palette"
SAMPLING = {"cfg_scale": 2.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
GPT = dict(dim=32, n_layer=1, n_head=2, vocab_size=16, model_type="t2i", caption_dim=8, cls_token_num=4, block_size=16)


@dataclass
class PaletteConfig:
    codebook_size: int
    codebook_embed_dim: int = 3
    downsample_factor: int = 1


class PaletteTokenizer(torch.nn.Module):
    """Token ``v`` -> one pixel of colour ``v`` (the palette file's RGB, in ``[-1, 1]``)."""

    def __init__(self, colours: torch.Tensor):
        super().__init__()
        self.config = PaletteConfig(codebook_size=colours.shape[0])
        self.register_buffer("colours", colours / 127.5 - 1)

    @property
    def codebook(self) -> torch.Tensor:
        return self.colours

    @property
    def raw_codebook(self) -> torch.Tensor:
        return self.colours

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        count, side = tokens.shape[0], int(tokens.shape[1] ** 0.5)
        return self.colours[tokens].view(count, side, side, 3).permute(0, 3, 1, 2)


def make_folder(folder: Path, seed: int = 0) -> Path:
    """A random-weight Palette folder."""
    from relaxspec.models.weights import save_model
    from relaxspec.models.llamagen.gpt import GPTConfig, Transformer

    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE}))
    save_model(Transformer(GPTConfig(**GPT)).eval(), folder / "gpt")
    return folder


def make_palette(path: Path, colours: int = GPT["vocab_size"], seed: int = 0) -> Path:
    generator = torch.Generator().manual_seed(seed)
    path.write_text(json.dumps(torch.randint(0, 256, (colours, 3), generator=generator).tolist()))
    return path


def read_palette(path, size: int) -> torch.Tensor:
    try:
        colours = torch.tensor(json.loads(Path(path).read_text()), dtype=torch.float32)
    except (OSError, ValueError, TypeError) as err:
        raise RelaxspecError(f"--palette-path {path}: not a JSON list of RGB colours ({err})") from None
    if colours.shape != (size, 3):
        raise RelaxspecError(f"--palette-path {path}: {tuple(colours.shape)} colours, the model paints {size}")
    return colours


def word_vector(word: str, dim: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "little")
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed))


def sampling_defaults(path) -> dict:
    return dict(SAMPLING)


def open_folder(path, prompts: list[str], *, device="cpu", dtype=torch.float32, image_size: int | None = None,
                prompt_length: int | None = None, palette_path=None) -> hf.Opened:
    from relaxspec.models.llamagen.checkpoints import load_gpt

    if palette_path is None:
        raise RelaxspecError("a Palette folder needs its colours: give --palette-path FILE")
    target = load_gpt(Path(path) / "gpt", device=device)
    config = target.config
    if image_size is not None and image_size != config.grid_size:
        raise RelaxspecError(f"a Palette image is {config.grid_size} pixels")
    tokenizer = PaletteTokenizer(read_palette(palette_path, config.vocab_size)).to(device)

    def format(texts):
        features = torch.zeros(len(texts), config.cls_token_num, config.caption_dim)
        mask = torch.zeros(len(texts), config.cls_token_num, dtype=torch.bool)
        for i, text in enumerate(texts):
            words = text.split()[-config.cls_token_num:]
            for j, word in enumerate(words):  # left-padded
                features[i, config.cls_token_num - len(words) + j] = word_vector(word, config.caption_dim)
                mask[i, config.cls_token_num - len(words) + j] = True
        return features.to(device), mask.to(device)

    cond, mask = format(prompts)
    return hf.Opened(target, tokenizer, cond, mask, config.grid_size,
                     {"prompts": list(prompts), "palette": str(Path(palette_path).resolve())}, format=format)
