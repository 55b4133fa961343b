"""Text prompts for LlamaGen's text-to-image models: a local Flan-T5 folder (what
``save_pretrained`` writes, e.g. google/flan-t5-xl downloaded by the user) encodes them into the
caption features the t2i transformer reads, the way upstream LlamaGen's ``sample_t2i.py`` does:

* the tokenizer pads every prompt to the model's ``cls_token_num`` tokens (120 for LlamaGen's t2i
  checkpoints), truncates longer ones, adds the end-of-sequence token and returns the mask;
* the T5 encoder's last hidden state ``[N, 120, 2048]`` is taken under that mask;
* then *left padding*: each row's valid tokens move to the end (``cat(emb[valid:], emb[:valid])``)
  and the mask is flipped, so the prompt sits just before the image tokens.

Upstream cleans captions first with PixArt's ``clean_caption`` (ftfy, BeautifulSoup and a page of
regular expressions). We apply upstream's own alternative, ``text.lower().strip()``, which gives
the same tokens for plain prompts (lower-case words and punctuation); prompts with URLs, HTML or
unusual punctuation may tokenise differently than upstream's cleaned text (README, "Text-to-image").

Needs the optional extra ``relaxspec[transformers]``. Weights are read from safetensors only.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from relaxspec.errors import RelaxspecError


def clean_prompt(text: str) -> str:
    """Upstream's caption text without PixArt's cleaning: lower-cased and stripped."""
    return str(text).lower().strip()


@functools.lru_cache(maxsize=1)
def load_t5(path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """``(tokenizer, encoder)`` from a local T5 folder, safetensors only (cached: one at a time)."""
    folder = Path(path)
    if not folder.is_dir():
        raise RelaxspecError(f"--t5-path {path}: not a folder (give a local Flan-T5 folder, as save_pretrained writes it)")
    if not (folder / "config.json").is_file():
        raise RelaxspecError(f"--t5-path {path}: no config.json: not a transformers model folder")
    if not any(folder.glob("*.safetensors")):
        raise RelaxspecError(f"--t5-path {path}: no .safetensors weights (relaxspec does not unpickle .bin files; "
                             "convert them, e.g. with save_pretrained(safe_serialization=True))")
    try:
        from transformers import AutoTokenizer, T5EncoderModel
    except ImportError as err:
        raise RelaxspecError(f"encoding prompts needs transformers: pip install \"relaxspec[transformers]\" ({err})") from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        encoder = T5EncoderModel.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    except (OSError, ValueError, KeyError) as err:
        raise RelaxspecError(f"--t5-path {path}: not a T5 encoder folder ({str(err).splitlines()[0]})") from None
    return tokenizer, encoder.to(device=device, dtype=dtype).eval().requires_grad_(False)


@torch.no_grad()
def encode_prompts(prompts: list[str], t5_path: str | Path, *, max_length: int, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Caption features ``[N, max_length, D]`` (left-padded), their mask ``[N, max_length]`` (bool)
    and each prompt's token count before truncation (more than ``max_length``: it was cut)."""
    if not prompts:
        raise RelaxspecError("no prompts given")
    empty = [i for i, p in enumerate(prompts) if not clean_prompt(p)]
    if empty:
        raise RelaxspecError(f"prompt {empty[0] + 1} is empty")
    tokenizer, encoder = load_t5(str(Path(t5_path).resolve()), str(device), dtype)
    texts = [clean_prompt(p) for p in prompts]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]
    batch = tokenizer(texts, max_length=max_length, padding="max_length", truncation=True,
                      return_attention_mask=True, add_special_tokens=True, return_tensors="pt")
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    features = encoder(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    return left_pad(features, mask.bool()), mask.bool().flip(-1), lengths


def left_pad(features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows of right-padded ``features [N, T, D]`` with ``mask [N, T]`` (valid tokens first) rotated
    so the valid tokens come last, as upstream's ``sample_t2i.py`` does."""
    rows = []
    for row, valid in zip(features, mask.sum(-1).tolist()):
        rows.append(torch.cat([row[valid:], row[:valid]]))
    return torch.stack(rows)
